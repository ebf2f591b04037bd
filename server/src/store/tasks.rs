//! The per-server task queue the agents long-poll.

use super::{Db, StoreError, StoreResult, corrupt, now_ms, parse_uuid};
use crate::{on_read, on_write};
use passage_model::protocol::{Task, TaskEnvelope, TaskResult};
use passage_model::{JobId, ServerId, TaskId};

/// Queues `task` for `server`'s agent under `id`, which the caller chooses so that it can
/// wait for the result's wake-up before the task exists.
pub async fn enqueue(
    db: &Db,
    id: TaskId,
    server: ServerId,
    job: Option<JobId>,
    task: &Task,
) -> StoreResult<()> {
    let payload = serde_json::to_string(task).map_err(corrupt)?;
    on_write!(db, |p| sqlx::query(
        "INSERT INTO tasks (uuid, server_uuid, job_uuid, kind, payload, state, created_at) \
         VALUES ($1, $2, $3, $4, $5, 'queued', $6)"
    )
    .bind(id.to_string())
    .bind(server.to_string())
    .bind(job.map(|j| j.to_string()))
    .bind(task.name())
    .bind(payload)
    .bind(now_ms())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

/// The Postgres channels replicas tell each other on (`NOTIFY`): a task queued for a node
/// (payload: the server's uuid) and a task given its result (payload: the task's uuid).
pub const QUEUED_CHANNEL: &str = "passage_task_queued";
pub const DONE_CHANNEL: &str = "passage_task_done";

/// Tells the other replicas on a shared Postgres (each listens: `services::wake_on_notify`);
/// nothing to do on SQLite, which has no other replica.
pub async fn announce(db: &Db, channel: &str, key: &str) -> StoreResult<()> {
    if let Db::Postgres(p) = db {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(channel)
            .bind(key)
            .execute(p)
            .await?;
    }
    Ok(())
}

/// Hands out queued tasks, and tasks taken longer than `redeliver_after_ms` ago whose
/// result never came (tasks are idempotent on the agent, so running one twice is safe).
pub async fn take(
    db: &Db,
    server: ServerId,
    limit: i64,
    redeliver_after_ms: i64,
) -> StoreResult<Vec<TaskEnvelope>> {
    let now = now_ms();
    let server_s = server.to_string();
    // One statement: the oldest deliverable tasks are marked taken and returned. The
    // condition is stated again outside the subquery, so that on Postgres a task another
    // replica took meanwhile is re-checked after its row lock and skipped.
    let deliverable =
        "server_uuid = $1 AND (state = 'queued' OR (state = 'taken' AND taken_at < $2))";
    let mut rows: Vec<(String, String, i64)> = on_write!(db, |p| sqlx::query_as(&format!(
        "UPDATE tasks SET state = 'taken', taken_at = $4 WHERE {deliverable} AND uuid IN \
         (SELECT uuid FROM tasks WHERE {deliverable} ORDER BY created_at LIMIT $3) \
         RETURNING uuid, payload, created_at"
    ))
    .bind(&server_s)
    .bind(now - redeliver_after_ms)
    .bind(limit)
    .bind(now)
    .fetch_all(p)
    .await)?;
    // RETURNING keeps no order.
    rows.sort_by_key(|r| r.2);
    rows.into_iter()
        .map(|(uuid, payload, _)| {
            Ok(TaskEnvelope {
                id: parse_uuid(&uuid, "task")?,
                task: serde_json::from_str(&payload).map_err(corrupt)?,
            })
        })
        .collect()
}

/// Records a result; only the server the task was for may give it, and only once.
pub async fn complete(
    db: &Db,
    server: ServerId,
    task: TaskId,
    result: &TaskResult,
) -> StoreResult<Task> {
    let payload = serde_json::to_string(result).map_err(corrupt)?;
    let done: Option<(String,)> = on_write!(db, |p| sqlx::query_as(
        "UPDATE tasks SET state = 'done', result = $3, done_at = $4 \
         WHERE uuid = $1 AND server_uuid = $2 AND state <> 'done' RETURNING payload"
    )
    .bind(task.to_string())
    .bind(server.to_string())
    .bind(payload)
    .bind(now_ms())
    .fetch_optional(p)
    .await)?;
    if let Some((task_payload,)) = done {
        return serde_json::from_str(&task_payload).map_err(corrupt);
    }
    // Nothing written: say whether the task is unknown here or already answered.
    let known: Option<(String,)> = on_read!(db, |p| sqlx::query_as(
        "SELECT state FROM tasks WHERE uuid = $1 AND server_uuid = $2"
    )
    .bind(task.to_string())
    .bind(server.to_string())
    .fetch_optional(p)
    .await)?;
    match known {
        None => Err(StoreError::NotFound("task")),
        Some(_) => Err(StoreError::Conflict("the task already has a result".into())),
    }
}

pub async fn result(db: &Db, task: TaskId) -> StoreResult<Option<TaskResult>> {
    let row: Option<(String, Option<String>)> = on_read!(db, |p| sqlx::query_as(
        "SELECT state, result FROM tasks WHERE uuid = $1"
    )
    .bind(task.to_string())
    .fetch_optional(p)
    .await)?;
    match row {
        Some((state, Some(result))) if state == "done" => {
            Ok(Some(serde_json::from_str(&result).map_err(corrupt)?))
        }
        Some(_) => Ok(None),
        None => Err(StoreError::NotFound("task")),
    }
}

/// A task its node reports progress on is alive: it is not handed out again meanwhile.
pub async fn touch(db: &Db, task: TaskId) -> StoreResult<()> {
    on_write!(db, |p| sqlx::query(
        "UPDATE tasks SET taken_at = $2 WHERE uuid = $1 AND state = 'taken'"
    )
    .bind(task.to_string())
    .bind(now_ms())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

/// The job a task of `server`'s works for, if the task is `server`'s and not yet done.
pub async fn open_task_job(db: &Db, server: ServerId, task: TaskId) -> StoreResult<Option<JobId>> {
    let row: Option<(Option<String>,)> = on_read!(db, |p| sqlx::query_as(
        "SELECT job_uuid FROM tasks WHERE uuid = $1 AND server_uuid = $2 AND state <> 'done'"
    )
    .bind(task.to_string())
    .bind(server.to_string())
    .fetch_optional(p)
    .await)?;
    let (job,) = row.ok_or(StoreError::NotFound("task"))?;
    job.as_deref().map(|j| parse_uuid(j, "job")).transpose()
}
