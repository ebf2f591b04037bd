//! The per-server task queue the agents long-poll.

use super::{Db, StoreError, StoreResult, corrupt, now_ms, parse_uuid};
use crate::{in_tx, on_read, on_write};
use passage_model::protocol::{Task, TaskEnvelope, TaskResult};
use passage_model::{JobId, ServerId, TaskId};

pub async fn enqueue(
    db: &Db,
    server: ServerId,
    job: Option<JobId>,
    task: &Task,
) -> StoreResult<TaskId> {
    let id = TaskId::new_random();
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
    Ok(id)
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
    let rows: Vec<(String, String, String)> = in_tx!(db, |tx| {
        let rows: Vec<(String, String, String)> = sqlx::query_as(
            "SELECT uuid, payload, state FROM tasks WHERE server_uuid = $1 \
             AND (state = 'queued' OR (state = 'taken' AND taken_at < $2)) \
             ORDER BY created_at LIMIT $3",
        )
        .bind(&server_s)
        .bind(now - redeliver_after_ms)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        let mut taken = Vec::new();
        for (uuid, payload, state) in rows {
            let n = sqlx::query(
                "UPDATE tasks SET state = 'taken', taken_at = $2 WHERE uuid = $1 AND state = $3",
            )
            .bind(&uuid)
            .bind(now)
            .bind(&state)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n == 1 {
                taken.push((uuid, payload, state));
            }
        }
        Ok(taken)
    })?;
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
    let row: Option<(String, String)> = on_read!(db, |p| sqlx::query_as(
        "SELECT payload, state FROM tasks WHERE uuid = $1 AND server_uuid = $2"
    )
    .bind(task.to_string())
    .bind(server.to_string())
    .fetch_optional(p)
    .await)?;
    let (task_payload, _) = row.ok_or(StoreError::NotFound("task"))?;
    let n = on_write!(db, |p| sqlx::query(
        "UPDATE tasks SET state = 'done', result = $3, done_at = $4 \
         WHERE uuid = $1 AND server_uuid = $2 AND state <> 'done'"
    )
    .bind(task.to_string())
    .bind(server.to_string())
    .bind(payload)
    .bind(now_ms())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    if n == 0 {
        return Err(StoreError::Conflict("the task already has a result".into()));
    }
    serde_json::from_str(&task_payload).map_err(corrupt)
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
