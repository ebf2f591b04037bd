//! Handlers of the agent API under /agent/v1. Only a node credential gets past
//! `AgentServer`; a node acts only for itself.

use super::extract::{AgentServer, ApiJson, ApiQuery};
use super::params::TasksQuery;
use crate::error::{ApiError, ApiResult};
use crate::services::{Ctx, agents};
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use passage_model::TaskId;
use passage_model::protocol::{
    Heartbeat, HeartbeatResponse, InventoryReport, RegisterRequest, TaskResult, TaskResults,
    TaskResultsAnswer,
};

pub async fn register(
    State(ctx): State<Ctx>,
    ApiJson(req): ApiJson<RegisterRequest>,
) -> ApiResult<Response> {
    let r = agents::register(&ctx, req).await?;
    Ok((StatusCode::CREATED, Json(r)).into_response())
}

pub async fn heartbeat(
    State(ctx): State<Ctx>,
    AgentServer(server): AgentServer,
    ApiJson(hb): ApiJson<Heartbeat>,
) -> ApiResult<Response> {
    agents::heartbeat(&ctx, server, hb).await?;
    Ok(Json(HeartbeatResponse {
        server_uuid: server,
    })
    .into_response())
}

pub async fn inventory(
    State(ctx): State<Ctx>,
    AgentServer(server): AgentServer,
    ApiJson(report): ApiJson<InventoryReport>,
) -> ApiResult<StatusCode> {
    agents::inventory(&ctx, server, report).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn poll_tasks(
    State(ctx): State<Ctx>,
    AgentServer(server): AgentServer,
    ApiQuery(q): ApiQuery<TasksQuery>,
) -> ApiResult<Response> {
    let wait = q.wait.unwrap_or(0);
    agents::note_runs(&ctx, server, q.runs.as_deref());
    Ok(Json(agents::poll_tasks(&ctx, server, wait).await?).into_response())
}

/// `POST /agent/v1/tasks/{id}/result`: 204 once the result is recorded. With `?wait=N`
/// the answer is also the node's next poll: 200 with the tasks queued for it, as
/// `GET /agent/v1/tasks?wait=N` answers, so a node that works through its queue makes
/// one request per task instead of two.
pub async fn task_result(
    State(ctx): State<Ctx>,
    AgentServer(server): AgentServer,
    Path(raw): Path<String>,
    ApiQuery(q): ApiQuery<TasksQuery>,
    ApiJson(result): ApiJson<TaskResult>,
) -> ApiResult<Response> {
    let task: TaskId = raw.parse().map_err(|_| ApiError::not_found("task"))?;
    agents::task_result(&ctx, server, task, result).await?;
    match q.wait {
        Some(wait) => {
            agents::note_runs(&ctx, server, q.runs.as_deref());
            Ok(Json(agents::poll_tasks(&ctx, server, wait).await?).into_response())
        }
        None => Ok(StatusCode::NO_CONTENT.into_response()),
    }
}

/// `POST /agent/v1/tasks/results`: several results at once ([`TaskResults`]), each
/// recorded or refused as alone; 200 with the refused ones and, with `?wait=N`, the node's
/// next tasks as `GET /agent/v1/tasks?wait=N` answers them.
pub async fn task_results(
    State(ctx): State<Ctx>,
    AgentServer(server): AgentServer,
    ApiQuery(q): ApiQuery<TasksQuery>,
    ApiJson(batch): ApiJson<TaskResults>,
) -> ApiResult<Response> {
    let refused = agents::task_results(&ctx, server, batch).await?;
    let tasks = match q.wait {
        Some(wait) => {
            agents::note_runs(&ctx, server, q.runs.as_deref());
            Some(agents::poll_tasks(&ctx, server, wait).await?)
        }
        None => None,
    };
    Ok(Json(TaskResultsAnswer { refused, tasks }).into_response())
}

/// `POST /agent/v1/tasks/{id}/progress`: how far a long task has come.
pub async fn task_progress(
    State(ctx): State<Ctx>,
    AgentServer(server): AgentServer,
    Path(raw): Path<String>,
    ApiJson(p): ApiJson<passage_model::protocol::TaskProgress>,
) -> ApiResult<StatusCode> {
    let task: TaskId = raw.parse().map_err(|_| ApiError::not_found("task"))?;
    agents::task_progress(&ctx, server, task, p).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /agent/v1/images/{sha256}`: an image file for a node's cache, whole (200) or from
/// an offset (`Range: bytes=N-` or `bytes=N-M`: 206 with `Content-Range`), so a broken
/// download resumes. Only files of images a VM may use (active, or disabled with VMs).
pub async fn image_file(
    State(ctx): State<Ctx>,
    AgentServer(_server): AgentServer,
    Path(raw): Path<String>,
    headers: axum::http::HeaderMap,
) -> ApiResult<Response> {
    use axum::http::{HeaderValue, header};
    use tokio::io::AsyncSeekExt;
    let sha: passage_model::images::Sha256 =
        raw.parse().map_err(|_| ApiError::not_found("image"))?;
    let f = crate::services::images::open_for_agent(&ctx, &sha).await?;
    let len = f.len;
    let Some(range) = headers.get(header::RANGE) else {
        return Ok(super::v1::file_response(f.file.into_std().await, len));
    };
    let unsatisfiable = || {
        let mut r = ApiError::new(
            passage_model::ErrorCode::InvalidArgument,
            "range: not satisfiable",
        )
        .into_response();
        *r.status_mut() = StatusCode::RANGE_NOT_SATISFIABLE;
        if let Ok(v) = HeaderValue::from_str(&format!("bytes */{len}")) {
            r.headers_mut().insert(header::CONTENT_RANGE, v);
        }
        r
    };
    let Some((start, end)) = range.to_str().ok().and_then(|r| parse_range(r, len)) else {
        return Ok(unsatisfiable());
    };
    let mut file = f.file;
    file.seek(std::io::SeekFrom::Start(start))
        .await
        .map_err(|e| ApiError::internal(format!("seeking an image file: {e}")))?;
    let count = end - start + 1;
    let body = super::v1::file_body(file.into_std().await, count);
    let mut r = body.into_response();
    *r.status_mut() = StatusCode::PARTIAL_CONTENT;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(count));
    if let Ok(v) = HeaderValue::from_str(&format!("bytes {start}-{end}/{len}")) {
        h.insert(header::CONTENT_RANGE, v);
    }
    Ok(r)
}

/// `bytes=N-` or `bytes=N-M` within a file of `len` bytes: the first and last byte.
/// One range only; anything else (suffix ranges, lists, past the end) is refused.
fn parse_range(h: &str, len: u64) -> Option<(u64, u64)> {
    let spec = h.trim().strip_prefix("bytes=")?;
    let (a, b) = spec.split_once('-')?;
    let start: u64 = a.trim().parse().ok()?;
    let end: u64 = match b.trim() {
        "" => len.checked_sub(1)?,
        m => m.parse::<u64>().ok()?.min(len.checked_sub(1)?),
    };
    (start < len && start <= end).then_some((start, end))
}

/// `GET /agent/v1/vms/{uuid}/guest`: what the node's metadata service tells the VM's guest,
/// for a VM on the calling node only.
pub async fn guest_metadata(
    State(ctx): State<Ctx>,
    AgentServer(server): AgentServer,
    Path(raw): Path<String>,
) -> ApiResult<Json<passage_model::protocol::GuestMetadata>> {
    let vm: passage_model::VmId = raw.parse().map_err(|_| ApiError::not_found("vm"))?;
    Ok(Json(
        crate::services::vm_labels::for_guest(&ctx, server, vm).await?,
    ))
}

pub async fn rotate_credential(
    State(ctx): State<Ctx>,
    AgentServer(server): AgentServer,
) -> ApiResult<Response> {
    Ok(Json(agents::rotate_credential(&ctx, server).await?).into_response())
}

/// `GET /agent/v1/console/{session}`, upgraded: the node's end of an interactive console
/// session it was given (`attach_console`). A session that is not waiting for this node
/// is 404, alike for every reason.
pub async fn console(
    State(ctx): State<Ctx>,
    AgentServer(server): AgentServer,
    Path(session): Path<String>,
    upgrade: axum::extract::ws::WebSocketUpgrade,
) -> ApiResult<Response> {
    let waiting = passage_model::protocol::is_console_session(&session)
        .then(|| ctx.consoles.take(&session, server))
        .flatten()
        .ok_or_else(|| ApiError::not_found("console session"))?;
    let max = crate::services::console::MAX_MESSAGE;
    Ok(upgrade
        .max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| async move {
            // A session given up meanwhile (its tenant gone): the socket closes.
            let _ = waiting.send(socket);
        })
        .into_response())
}
