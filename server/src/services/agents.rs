//! The agent side: registration, heartbeats, inventory, the task queue.

use super::Ctx;
use super::auth::{NODE_CREDENTIAL_PREFIX, new_secret, sha256_hex};
use crate::error::{ApiError, ApiResult};
use crate::store::{devices, servers, tasks};
use passage_model::protocol::{
    InventoryReport, LaterTasks, MAX_BRIDGES, MAX_INVENTORY_DEVICES, MAX_LONG_POLL_SECS,
    PROTOCOL_VERSION, RegisterRequest, RegisterResponse, TaskEnvelope, TaskResult,
};
use passage_model::{ErrorCode, ServerId, TaskId};
use std::collections::HashSet;
use std::time::Duration;

/// Tasks handed to an agent per poll.
pub(super) const TASK_BATCH: i64 = 32;

pub async fn register(ctx: &Ctx, req: RegisterRequest) -> ApiResult<RegisterResponse> {
    if req.protocol_version != PROTOCOL_VERSION {
        return Err(ApiError::invalid(
            "protocol_version",
            format!("this server speaks agent protocol {PROTOCOL_VERSION}"),
        ));
    }
    super::servers::validate_hostname("hostname", &req.hostname)?;
    if req.join_token.len() > 128 || req.agent_version.len() > 64 {
        return Err(ApiError::new(
            ErrorCode::Unauthorized,
            "join token invalid, expired or already used",
        ));
    }
    let credential = new_secret(NODE_CREDENTIAL_PREFIX);
    let server = servers::register(
        &ctx.db,
        &sha256_hex(&req.join_token),
        &req.hostname,
        &sha256_hex(&credential),
    )
    .await;
    // A re-admitted node's old credential stops working here at once.
    ctx.node_credentials.clear();
    let server = server?.ok_or_else(|| {
        ApiError::new(
            ErrorCode::Unauthorized,
            "join token invalid, expired or already used",
        )
    })?;
    tracing::info!(%server, hostname = %req.hostname, agent = %req.agent_version, "node registered");
    Ok(RegisterResponse {
        server_uuid: server,
        credential,
    })
}

/// The server a node credential belongs to; user tokens are not node credentials.
pub async fn server_from_credential(ctx: &Ctx, credential: &str) -> ApiResult<ServerId> {
    if !credential.starts_with(NODE_CREDENTIAL_PREFIX) || credential.len() > 128 {
        return Err(ApiError::unauthorized());
    }
    let hash = sha256_hex(credential);
    if let Some(server) = ctx.node_credentials.get(&hash) {
        return Ok(server);
    }
    // Only a credential that matched is kept: an unknown one is read again each time, so
    // a node admitted a moment ago is let in at once.
    let server = servers::by_credential(&ctx.db, &hash)
        .await?
        .ok_or_else(ApiError::unauthorized)?;
    ctx.node_credentials.put(&hash, server);
    Ok(server)
}

pub async fn heartbeat(
    ctx: &Ctx,
    server: ServerId,
    hb: passage_model::protocol::Heartbeat,
) -> ApiResult<()> {
    // With the other nodes' heartbeats, on the jobs' lane, whose commits on Postgres do
    // not wait for the WAL to reach the disk: 1,250 nodes' heartbeats were 125 WAL
    // flushes a second that the durable writes (creations' batches) queued with.
    super::heartbeats::beat(ctx, server).await?;
    let Some(running) = hb.running_vms else {
        return Ok(());
    };
    if running.len() > MAX_INVENTORY_DEVICES {
        return Err(ApiError::invalid("running_vms", "too many"));
    }
    let grace = i64::try_from(ctx.cfg.vm_exit_grace.as_millis()).unwrap_or(i64::MAX);
    // Never silently lost: the VM shows stopped, its devices stay with it, and the
    // operator sees why in an alert written with the state.
    for vm in crate::store::vms::reconcile_exits(&ctx.db, server, &running, grace).await? {
        tracing::warn!(%vm, %server, "VM exited on its node");
    }
    Ok(())
}

/// The reported functions (`devices`, of an inventory or a task's result) are each valid
/// and each reported once.
fn check_functions(devices: &[passage_model::PciDevice]) -> ApiResult<()> {
    let mut seen = HashSet::new();
    for (i, d) in devices.iter().enumerate() {
        d.validate()
            .map_err(|e| ApiError::invalid(format!("devices[{i}]"), e.to_string()))?;
        if !seen.insert(d.id.to_string()) {
            return Err(ApiError::invalid(
                format!("devices[{i}].id"),
                "reported twice",
            ));
        }
        // vGPU slots are the control plane's own rows, never a node's functions.
        if d.id.vgpu().is_some() {
            return Err(ApiError::invalid(
                format!("devices[{i}].id"),
                "a PCI function's path, not a vGPU's",
            ));
        }
    }
    Ok(())
}

pub async fn inventory(ctx: &Ctx, server: ServerId, report: InventoryReport) -> ApiResult<()> {
    if report.devices.len() > MAX_INVENTORY_DEVICES {
        return Err(ApiError::invalid(
            "devices",
            format!("at most {MAX_INVENTORY_DEVICES} functions per report"),
        ));
    }
    check_functions(&report.devices)?;
    if let Some(h) = &report.host {
        h.validate()
            .map_err(|(field, why)| ApiError::invalid(field, why))?;
    }
    if let Some(bridges) = &report.bridges {
        if bridges.len() > MAX_BRIDGES {
            return Err(ApiError::invalid(
                "bridges",
                format!("at most {MAX_BRIDGES} bridges per report"),
            ));
        }
        for (i, b) in bridges.iter().enumerate() {
            passage_model::networks::check_bridge(b)
                .map_err(|e| ApiError::invalid(format!("bridges[{i}]"), e.message))?;
        }
    }
    let applied = devices::apply_inventory(
        &ctx.db,
        server,
        report.host.as_ref(),
        &report.devices,
        devices::Coverage::Whole,
    )
    .await?;
    if let Some(bridges) = &report.bridges {
        servers::set_bridges(&ctx.db, server, bridges).await?;
        ctx.bridges.forget(super::networks::BRIDGES_KEY);
    }
    if applied.vf_variants {
        crate::workflows::sriov::spawn(ctx, server, false);
    }
    Ok(())
}

/// Notes the later task kinds a node's agent said on this poll that it runs (`runs`, as
/// `passage_model::protocol::TASKS_RUN` names them): what it said last stands.
pub fn note_runs(ctx: &Ctx, server: ServerId, runs: Option<&str>) {
    let kinds = runs.map(LaterTasks::parse).unwrap_or_default();
    let mut nodes = ctx.later_tasks.lock().unwrap_or_else(|p| p.into_inner());
    if kinds.is_empty() {
        nodes.remove(&server);
    } else {
        nodes.insert(server, kinds);
    }
}

/// Whether `server`'s agent said on its last poll here that it runs tasks of `kind` (one
/// of `passage_model::protocol::LATER_TASKS`). Another replica's nodes, and every node
/// until it polls after a restart, get the separate tasks.
pub fn runs(ctx: &Ctx, server: ServerId, kind: &str) -> bool {
    ctx.later_tasks
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&server)
        .is_some_and(|k| k.has(kind))
}

/// How long [`runs_soon`] waits for a node that has not polled since this server started.
const FIRST_POLL_WAIT: Duration = Duration::from_secs(5);

/// [`runs`], giving a node not heard from since this server started a moment to poll.
pub async fn runs_soon(ctx: &Ctx, server: ServerId, kind: &str) -> bool {
    let deadline = tokio::time::Instant::now() + FIRST_POLL_WAIT;
    loop {
        if runs(ctx, server, kind) {
            return true;
        }
        if polled(ctx, server) || tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether `server`'s agent has named any later task kind on a poll here since this
/// server started: one that has and did not name a kind does not run it.
pub fn polled(ctx: &Ctx, server: ServerId) -> bool {
    ctx.later_tasks
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains_key(&server)
}

/// Long-poll: answers as soon as tasks are queued, or empty after `wait`.
pub async fn poll_tasks(ctx: &Ctx, server: ServerId, wait: u64) -> ApiResult<Vec<TaskEnvelope>> {
    let wait = Duration::from_secs(wait.min(MAX_LONG_POLL_SECS));
    let deadline = tokio::time::Instant::now() + wait;
    let key = server.to_string();
    if ctx.heartbeats.get(&key).is_none() {
        // Written as [`heartbeat`]'s.
        super::heartbeats::beat(ctx, server).await?;
        ctx.heartbeats.put(&key, ());
    }
    let waker = ctx.tasks_queued.handle(&server);
    loop {
        let notified = waker.notified();
        if !ctx.queue_marks.known_empty(&server) {
            let count = ctx.queue_marks.count(&server);
            let got = super::task_takes::take(ctx, server).await?;
            if got.len() < usize::try_from(TASK_BATCH).unwrap_or(usize::MAX) {
                ctx.queue_marks.drained(&server, count);
            }
            if !got.is_empty() {
                return Ok(got);
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(Vec::new());
        }
        let until = match ctx.replica_poll() {
            // The poll covers a task whose announcement was lost.
            Some(every) => deadline.min(tokio::time::Instant::now() + every),
            None => deadline,
        };
        let _ = tokio::time::timeout_at(until, notified).await;
    }
}

pub async fn task_result(
    ctx: &Ctx,
    server: ServerId,
    task: TaskId,
    result: TaskResult,
) -> ApiResult<()> {
    let done = checked_result(server, task, &result, "")?;
    ctx.metrics.result_post(1);
    super::completions::complete(ctx, done, result).await?;
    Ok(())
}

/// A result's bounds, and the completion to record: the functions the task changed are
/// written with the result, in its transaction. `at` prefixes the fields an error names.
fn checked_result(
    server: ServerId,
    task: TaskId,
    result: &TaskResult,
    at: &str,
) -> ApiResult<tasks::Completion> {
    if result
        .error
        .as_ref()
        .is_some_and(|e| e.len() > passage_model::protocol::MAX_ERROR_LEN)
    {
        return Err(ApiError::invalid(format!("{at}error"), "too long"));
    }
    if result.scrub_reports.len() > passage_model::protocol::MAX_TASK_DEVICES {
        return Err(ApiError::invalid(format!("{at}scrub_reports"), "too many"));
    }
    if result.devices.len() > passage_model::protocol::MAX_TASK_DEVICES {
        return Err(ApiError::invalid(format!("{at}devices"), "too many"));
    }
    check_functions(&result.devices).map_err(|mut e| {
        if let Some(f) = e.field.take() {
            e.message = format!("{at}{}", e.message);
            e.field = Some(format!("{at}{f}"));
        }
        e
    })?;
    Ok(tasks::Completion::new(task, server, result)?)
}

/// Several results of the node's tasks at once, each recorded or refused as it would be
/// alone; they reach the completions batcher together, so they are usually written in
/// one statement. A body out of bounds is refused whole (400) and records nothing. The
/// refused ones are returned; a failure that is not the result's own (the database) fails
/// the whole call, so that the node sends them all again.
pub async fn task_results(
    ctx: &Ctx,
    server: ServerId,
    batch: passage_model::protocol::TaskResults,
) -> ApiResult<Vec<passage_model::protocol::RefusedResult>> {
    use passage_model::protocol::{MAX_RESULTS_PER_POST, RefusedResult};
    if batch.results.len() > MAX_RESULTS_PER_POST {
        return Err(ApiError::invalid(
            "results",
            format!("at most {MAX_RESULTS_PER_POST} results per post"),
        ));
    }
    let mut seen = HashSet::new();
    let mut checked = Vec::with_capacity(batch.results.len());
    for (i, r) in batch.results.into_iter().enumerate() {
        if !seen.insert(r.task) {
            return Err(ApiError::invalid(
                format!("results[{i}].task"),
                "posted twice",
            ));
        }
        let done = checked_result(server, r.task, &r.result, &format!("results[{i}].result."))?;
        checked.push((r.task, done, r.result));
    }
    ctx.metrics.result_post(checked.len());
    let recorded = futures_util::future::join_all(checked.into_iter().map(
        |(task, done, result)| async move {
            (task, super::completions::complete(ctx, done, result).await)
        },
    ))
    .await;
    let mut refused = Vec::new();
    for (task, r) in recorded {
        let Err(e) = r else { continue };
        let e = ApiError::from(e);
        if e.code == ErrorCode::InternalError {
            return Err(e);
        }
        refused.push(RefusedResult {
            task,
            error: passage_model::ApiErrorBody {
                code: e.code,
                message: e.message,
                field: e.field,
            },
        });
    }
    Ok(refused)
}

/// A node's progress on one of its own tasks, shown on the job step waiting for it.
pub async fn task_progress(
    ctx: &Ctx,
    server: ServerId,
    task: TaskId,
    p: passage_model::protocol::TaskProgress,
) -> ApiResult<()> {
    if p.done > p.total {
        return Err(ApiError::invalid("done", "must not exceed total"));
    }
    let job = tasks::open_task_job(&ctx.db, server, task).await?;
    tasks::touch(&ctx.db, task).await?;
    if let Some(job) = job {
        crate::store::jobs::set_progress(&ctx.db, job, p.done, p.total).await?;
    }
    Ok(())
}

/// A node replaces its own credential; the old one stops working at once.
pub async fn rotate_credential(ctx: &Ctx, server: ServerId) -> ApiResult<RegisterResponse> {
    let credential = new_secret(NODE_CREDENTIAL_PREFIX);
    let set = servers::set_credential(&ctx.db, server, &sha256_hex(&credential)).await;
    ctx.node_credentials.clear();
    set?;
    tracing::info!(%server, "node credential rotated");
    Ok(RegisterResponse {
        server_uuid: server,
        credential,
    })
}
