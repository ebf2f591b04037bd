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

/// Each write's steps in one statement over `x(job, done_lo, done_hi, next_lo, next_hi)`:
/// the done range succeeded, the next range started (its error cleared), at `$1`. The
/// same text on both databases; a macro so that Postgres's statement stays a constant.
macro_rules! step_ranges_update {
    () => {
        "UPDATE job_steps SET \
         state = CASE WHEN job_steps.idx BETWEEN x.done_lo AND x.done_hi \
           THEN 'succeeded' ELSE 'running' END, \
         ended_at = CASE WHEN job_steps.idx BETWEEN x.done_lo AND x.done_hi \
           THEN $1 ELSE job_steps.ended_at END, \
         started_at = CASE WHEN job_steps.idx BETWEEN x.next_lo AND x.next_hi \
           THEN COALESCE(job_steps.started_at, $1) ELSE job_steps.started_at END, \
         error = CASE WHEN job_steps.idx BETWEEN x.next_lo AND x.next_hi \
           THEN NULL ELSE job_steps.error END, \
         error_kind = CASE WHEN job_steps.idx BETWEEN x.next_lo AND x.next_hi \
           THEN NULL ELSE job_steps.error_kind END \
         FROM x WHERE job_steps.job_uuid = x.job \
         AND (job_steps.idx BETWEEN x.done_lo AND x.done_hi \
           OR job_steps.idx BETWEEN x.next_lo AND x.next_hi)"
    };
}

/// Steps `lo..=hi` of a job, by index.
pub type StepRange = (usize, usize);

/// A job's progress: steps `done` ended as succeeded, steps `next` started, and the job
/// succeeded when `end_job` (each part optional). Several steps start together where one
/// step's action does the next ones' work too (`Workflow::ahead`), and end together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepWrite {
    pub job: JobId,
    pub done: Option<StepRange>,
    pub next: Option<StepRange>,
    pub end_job: bool,
}

impl StepWrite {
    /// Steps `done` succeeded, when given, and steps `next` start.
    pub fn advance(job: JobId, done: Option<StepRange>, next: StepRange) -> StepWrite {
        StepWrite {
            job,
            done,
            next: Some(next),
            end_job: false,
        }
    }

    /// Steps `done` succeeded; the job goes on, or stops here for now.
    pub fn ended(job: JobId, done: StepRange) -> StepWrite {
        StepWrite {
            job,
            done: Some(done),
            next: None,
            end_job: false,
        }
    }

    /// The job succeeded, with its last steps if this runner ran them.
    pub fn succeed(job: JobId, last: Option<StepRange>) -> StepWrite {
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
                        "{}, {}, {}, {}, {}",
                        q.text(s.job),
                        q.arg(idx(s.done.map(|d| d.0))),
                        q.arg(idx(s.done.map(|d| d.1))),
                        q.arg(idx(s.next.map(|n| n.0))),
                        q.arg(idx(s.next.map(|n| n.1)))
                    )
                });
                // Placeholders are bound in order: the fragment's two `$1`, the same time,
                // come after the rows' values.
                let set = step_ranges_update!().replace("$1", "?");
                q.int(now);
                q.int(now);
                parts.push(format!(
                    "WITH x(job, done_lo, done_hi, next_lo, next_hi) AS (VALUES {rows}) {set}"
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
                .bind(ends(&stepped, |s| s.done.map(|d| d.0)))
                .bind(ends(&stepped, |s| s.done.map(|d| d.1)))
                .bind(ends(&stepped, |s| s.next.map(|n| n.0)))
                .bind(ends(&stepped, |s| s.next.map(|n| n.1)))
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

/// One end of each write's ranges, as the statement's array binds it.
fn ends(stepped: &[&StepWrite], end: impl Fn(&StepWrite) -> Option<usize>) -> Vec<Option<i64>> {
    stepped
        .iter()
        .map(|s| end(s).map(|i| i64::try_from(i).unwrap_or(i64::MAX)))
        .collect()
}

/// The same writes on Postgres: one statement over arrays whatever their count. It tells
/// the other replicas which nodes have new tasks (`NOTIFY`, sent as it commits), once per
/// node, not once per task.
const PG_WRITE: &str = concat!(
    "WITH \
     x AS (SELECT * FROM UNNEST($2::text[], $3::int8[], $4::int8[], $5::int8[], $6::int8[]) \
       AS x(job, done_lo, done_hi, next_lo, next_hi)), \
     s AS (",
    step_ranges_update!(),
    " \
       RETURNING 1), \
     j AS (UPDATE jobs SET state = 'succeeded', ended_at = $1 WHERE uuid = ANY($7::text[]) \
       RETURNING 1), \
     t AS (INSERT INTO tasks (uuid, server_uuid, job_uuid, kind, payload, state, created_at) \
       SELECT t.u, t.s, t.j, t.k, t.p, 'queued', $1 \
       FROM UNNEST($8::text[], $9::text[], $10::text[], $11::text[], $12::text[]) \
       AS t(u, s, j, k, p) RETURNING 1), \
     n AS (SELECT pg_notify($13, q.s) FROM (SELECT DISTINCT s FROM UNNEST($9::text[]) AS s) q) \
     SELECT (SELECT COUNT(*) FROM s) + (SELECT COUNT(*) FROM j) + (SELECT COUNT(*) FROM t) \
     + (SELECT COUNT(*) FROM n)"
);
