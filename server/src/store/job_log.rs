//! The job runners' routine writes, any number in one transaction: a step's start, a
//! step's success with the next one's start, a job's success, and a task queued for a
//! node. Each used to be a statement of its own on the one SQLite writer (9 per provision
//! and 10 per destroy of a VM with an image); `services::job_log` gathers those of every
//! running job into one transaction of at most three statements.

use super::sql::Sql;
use super::{Db, StoreResult, corrupt, now_ms};
use crate::in_tx;
use crate::store::page::Arg;
use passage_model::protocol::Task;
use passage_model::{JobId, ServerId, TaskId};

/// A job's progress: step `done` ended as succeeded, step `next` started, and the job
/// succeeded when `end_job` (each part optional).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepWrite {
    pub job: JobId,
    pub done: Option<usize>,
    pub next: Option<usize>,
    pub end_job: bool,
}

impl StepWrite {
    /// Step `idx` starts (the first step a runner runs).
    pub fn start(job: JobId, idx: usize) -> StepWrite {
        StepWrite {
            job,
            done: None,
            next: Some(idx),
            end_job: false,
        }
    }

    /// Step `done` succeeded and step `next` starts.
    pub fn advance(job: JobId, done: usize, next: usize) -> StepWrite {
        StepWrite {
            job,
            done: Some(done),
            next: Some(next),
            end_job: false,
        }
    }

    /// The job succeeded, with its last step if this runner ran it.
    pub fn succeed(job: JobId, last: Option<usize>) -> StepWrite {
        StepWrite {
            job,
            done: last,
            next: None,
            end_job: true,
        }
    }
}

/// A task to queue for a node's agent, under an id its caller chose (so that it can wait
/// for the result's wake-up before the task exists).
#[derive(Clone, Debug)]
pub struct NewTask {
    pub id: TaskId,
    pub server: ServerId,
    pub job: Option<JobId>,
    pub kind: &'static str,
    /// The task as JSON.
    pub payload: String,
}

impl NewTask {
    pub fn new(id: TaskId, server: ServerId, job: Option<JobId>, task: &Task) -> StoreResult<Self> {
        Ok(NewTask {
            id,
            server,
            job,
            kind: task.name(),
            payload: serde_json::to_string(task).map_err(corrupt)?,
        })
    }
}

fn idx(i: Option<usize>) -> Arg {
    i.map_or(Arg::Null, |i| {
        Arg::Int(i64::try_from(i).unwrap_or(i64::MAX))
    })
}

/// Writes `steps` and `tasks` in one transaction: all of them or, on an error, none.
/// A job appears at most once in `steps` (its runner waits for each of its writes).
pub async fn write(db: &Db, steps: &[StepWrite], tasks: &[NewTask]) -> StoreResult<()> {
    if steps.is_empty() && tasks.is_empty() {
        return Ok(());
    }
    let now = now_ms();
    let ended: Vec<JobId> = steps.iter().filter(|s| s.end_job).map(|s| s.job).collect();
    let stepped: Vec<&StepWrite> = steps
        .iter()
        .filter(|s| s.done.is_some() || s.next.is_some())
        .collect();
    match db {
        Db::Sqlite { .. } => {
            // One text, its values bound in order: one call to the writer's thread.
            let mut q = Sql::default();
            let mut parts = Vec::new();
            if !stepped.is_empty() {
                let rows = q.rows(&stepped, |q, s| {
                    format!(
                        "{}, {}, {}",
                        q.text(s.job),
                        q.arg(idx(s.done)),
                        q.arg(idx(s.next))
                    )
                });
                parts.push(format!(
                    "WITH x(job, done, next) AS (VALUES {rows}) \
                     UPDATE job_steps SET \
                     state = CASE WHEN job_steps.idx = x.done THEN 'succeeded' ELSE 'running' END, \
                     ended_at = CASE WHEN job_steps.idx = x.done THEN {} ELSE job_steps.ended_at END, \
                     started_at = CASE WHEN job_steps.idx = x.next \
                       THEN COALESCE(job_steps.started_at, {}) ELSE job_steps.started_at END, \
                     error = CASE WHEN job_steps.idx = x.next THEN NULL ELSE job_steps.error END, \
                     error_kind = CASE WHEN job_steps.idx = x.next THEN NULL \
                       ELSE job_steps.error_kind END \
                     FROM x WHERE job_steps.job_uuid = x.job AND job_steps.idx IN (x.done, x.next)",
                    q.int(now),
                    q.int(now)
                ));
            }
            if !ended.is_empty() {
                let at = q.int(now);
                let list = q.list(&ended);
                parts.push(format!(
                    "UPDATE jobs SET state = 'succeeded', ended_at = {at} WHERE uuid IN ({list})"
                ));
            }
            if !tasks.is_empty() {
                let rows = q.rows(tasks, |q, t| {
                    format!(
                        "{}, {}, {}, {}, {}, 'queued', {}",
                        q.text(t.id),
                        q.text(t.server),
                        q.arg(t.job.map_or(Arg::Null, |j| Arg::Text(j.to_string()))),
                        q.text(t.kind),
                        q.arg(Arg::Text(t.payload.clone())),
                        q.int(now)
                    )
                });
                parts.push(format!(
                    "INSERT INTO tasks (uuid, server_uuid, job_uuid, kind, payload, state, \
                     created_at) VALUES {rows}"
                ));
            }
            let sql = parts.join(";\n");
            in_tx!(db, |tx| {
                crate::bind_args!(sqlx::query(&sql), &q.args)
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            })
        }
        // One statement: atomic without a transaction around it.
        Db::Postgres(p) => {
            let _: (i64,) = sqlx::query_as(PG_WRITE)
                .bind(now)
                .bind(
                    stepped
                        .iter()
                        .map(|s| s.job.to_string())
                        .collect::<Vec<_>>(),
                )
                .bind(
                    stepped
                        .iter()
                        .map(|s| s.done.map(|i| i as i64))
                        .collect::<Vec<_>>(),
                )
                .bind(
                    stepped
                        .iter()
                        .map(|s| s.next.map(|i| i as i64))
                        .collect::<Vec<_>>(),
                )
                .bind(ended.iter().map(ToString::to_string).collect::<Vec<_>>())
                .bind(tasks.iter().map(|t| t.id.to_string()).collect::<Vec<_>>())
                .bind(
                    tasks
                        .iter()
                        .map(|t| t.server.to_string())
                        .collect::<Vec<_>>(),
                )
                .bind(
                    tasks
                        .iter()
                        .map(|t| t.job.map(|j| j.to_string()))
                        .collect::<Vec<_>>(),
                )
                .bind(tasks.iter().map(|t| t.kind).collect::<Vec<_>>())
                .bind(tasks.iter().map(|t| t.payload.as_str()).collect::<Vec<_>>())
                .bind(super::tasks::QUEUED_CHANNEL)
                .fetch_one(p)
                .await?;
            Ok(())
        }
    }
}

/// The same writes on Postgres: one statement over arrays whatever their count. It tells
/// the other replicas which nodes have new tasks (`NOTIFY`, sent as it commits), once per
/// node, not once per task.
const PG_WRITE: &str = "WITH \
     x AS (SELECT * FROM UNNEST($2::text[], $3::int8[], $4::int8[]) AS x(job, done, next)), \
     s AS (UPDATE job_steps SET \
       state = CASE WHEN job_steps.idx = x.done THEN 'succeeded' ELSE 'running' END, \
       ended_at = CASE WHEN job_steps.idx = x.done THEN $1 ELSE job_steps.ended_at END, \
       started_at = CASE WHEN job_steps.idx = x.next \
         THEN COALESCE(job_steps.started_at, $1) ELSE job_steps.started_at END, \
       error = CASE WHEN job_steps.idx = x.next THEN NULL ELSE job_steps.error END, \
       error_kind = CASE WHEN job_steps.idx = x.next THEN NULL ELSE job_steps.error_kind END \
       FROM x WHERE job_steps.job_uuid = x.job AND job_steps.idx IN (x.done, x.next) \
       RETURNING 1), \
     j AS (UPDATE jobs SET state = 'succeeded', ended_at = $1 WHERE uuid = ANY($5::text[]) \
       RETURNING 1), \
     t AS (INSERT INTO tasks (uuid, server_uuid, job_uuid, kind, payload, state, created_at) \
       SELECT t.u, t.s, t.j, t.k, t.p, 'queued', $1 \
       FROM UNNEST($6::text[], $7::text[], $8::text[], $9::text[], $10::text[]) \
       AS t(u, s, j, k, p) RETURNING 1), \
     n AS (SELECT pg_notify($11, q.s) FROM (SELECT DISTINCT s FROM UNNEST($7::text[]) AS s) q) \
     SELECT (SELECT COUNT(*) FROM s) + (SELECT COUNT(*) FROM j) + (SELECT COUNT(*) FROM t) \
     + (SELECT COUNT(*) FROM n)";
