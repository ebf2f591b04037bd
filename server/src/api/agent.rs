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
    Heartbeat, HeartbeatResponse, InventoryReport, RegisterRequest, TaskResult,
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
    Ok(Json(agents::poll_tasks(&ctx, server, wait).await?).into_response())
}

pub async fn task_result(
    State(ctx): State<Ctx>,
    AgentServer(server): AgentServer,
    Path(raw): Path<String>,
    ApiJson(result): ApiJson<TaskResult>,
) -> ApiResult<StatusCode> {
    let task: TaskId = raw.parse().map_err(|_| ApiError::not_found("task"))?;
    agents::task_result(&ctx, server, task, result).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn rotate_credential(
    State(ctx): State<Ctx>,
    AgentServer(server): AgentServer,
) -> ApiResult<Response> {
    Ok(Json(agents::rotate_credential(&ctx, server).await?).into_response())
}
