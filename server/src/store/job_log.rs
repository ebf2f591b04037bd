//! The job runners' routine writes, any number in one transaction: a step's start, a
//! step's success with the next one's start, a job's success, and a task queued for a
//! node. Each used to be a statement of its own on the one SQLite writer (9 per provision
//! and 10 per destroy of a VM with an image); `services::job_log` gathers those of every
//! running job into one transaction of at most three statements.

use super::jobs::{self, JobRecord};
use super::sql::Sql;
use super::{Db, StoreResult, corrupt, now_ms};
use crate::store::page::Arg;
use passage_model::jobs::JobKind;
use passage_model::protocol::Task;
use passage_model::{JobId, ServerId, TaskId};
use std::collections::HashMap;

/// The columns a step write gives a step's row.
macro_rules! step_cols {
    () => {
        "INSERT INTO job_steps (job_uuid, idx, name, state, started_at, ended_at) "
    };
}

/// What a step write does to a step's row that exists. A step's row is written when the
/// step first starts (a job is written without its steps: its kind names them), so a
/// start inserts it or, for a step started again, clears its error and keeps its first
/// start; an end (`succeeded`) sets its end. The same text on both databases; macros so
/// that Postgres's statement stays a constant.
macro_rules! step_upsert {
    () => {
        " ON CONFLICT (job_uuid, idx) DO UPDATE SET \
         state = excluded.state, \
         started_at = COALESCE(job_steps.started_at, excluded.started_at), \
         ended_at = CASE WHEN excluded.state = 'succeeded' \
           THEN excluded.ended_at ELSE job_steps.ended_at END, \
         error = CASE WHEN excluded.state = 'running' THEN NULL ELSE job_steps.error END, \
         error_kind = CASE WHEN excluded.state = 'running' \
           THEN NULL ELSE job_steps.error_kind END"
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
    /// The job's kind, which names its steps.
    pub kind: JobKind,
    pub done: Option<StepRange>,
    pub next: Option<StepRange>,
    pub end_job: bool,
}

impl StepWrite {
    /// Steps `done` succeeded, when given, and steps `next` start.
    pub fn advance(
        job: JobId,
        kind: JobKind,
        done: Option<StepRange>,
        next: StepRange,
    ) -> StepWrite {
        StepWrite {
            job,
            kind,
            done,
            next: Some(next),
            end_job: false,
        }
    }

    /// Steps `done` succeeded; the job goes on, or stops here for now.
    pub fn ended(job: JobId, kind: JobKind, done: StepRange) -> StepWrite {
        StepWrite {
            job,
            kind,
            done: Some(done),
            next: None,
            end_job: false,
        }
    }

    /// The job succeeded, with its last steps if this runner ran them.
    pub fn succeed(job: JobId, kind: JobKind, last: Option<StepRange>) -> StepWrite {
        StepWrite {
            job,
            kind,
            done: last,
            next: None,
            end_job: true,
        }
    }

    /// Each step's row as this write leaves it: `(index, name, state)`, the state
    /// `succeeded` or `running`. An index past the kind's steps is a caller's mistake.
    fn rows(&self) -> StoreResult<Vec<(usize, &'static str, &'static str)>> {
        let names = self.kind.step_names();
        let mut out = Vec::new();
        for (range, state) in [(self.done, "succeeded"), (self.next, "running")] {
            let Some((lo, hi)) = range else { continue };
            for i in lo..=hi {
                let name = names.get(i).ok_or_else(|| {
                    corrupt(format!("{} job {} has no step {i}", self.kind, self.job))
                })?;
                out.push((i, *name, state));
            }
        }
        Ok(out)
    }
}

/// A step's row as a write leaves it.
struct WrittenStep {
    job: JobId,
    idx: i64,
    name: &'static str,
    state: &'static str,
}

fn step_rows(steps: &[StepWrite]) -> StoreResult<Vec<WrittenStep>> {
    let mut out = Vec::new();
    for s in steps {
        for (i, name, state) in s.rows()? {
            out.push(WrittenStep {
                job: s.job,
                idx: i64::try_from(i).unwrap_or(i64::MAX),
                name,
                state,
            });
        }
    }
    Ok(out)
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

/// Writes `steps` and `tasks` in one transaction: all of them or, on an error, none.
/// A job appears at most once in `steps` (its runner waits for each of its writes).
pub async fn write(db: &Db, steps: &[StepWrite], tasks: &[NewTask]) -> StoreResult<()> {
    write_and_claim(db, steps, tasks, &Claims::default())
        .await
        .map(drop)
}

/// Jobs for this process's runners to take, as `jobs::claim_records` takes them.
#[derive(Default)]
pub struct Claims<'a> {
    pub jobs: &'a [JobId],
    pub owner: &'a str,
    pub until_ms: i64,
}

/// [`write`], then the `claims` as `jobs::claim_records` makes them: the jobs claimed, as
/// they stand once claimed. On SQLite the claims go in the same call to the writer (its
/// turns are what a burst of job steps waits for), as the transaction's last statement;
/// on Postgres they follow the write's statement.
pub async fn write_and_claim(
    db: &Db,
    steps: &[StepWrite],
    tasks: &[NewTask],
    claims: &Claims<'_>,
) -> StoreResult<HashMap<JobId, JobRecord>> {
    if steps.is_empty() && tasks.is_empty() && claims.jobs.is_empty() {
        return Ok(HashMap::new());
    }
    let now = now_ms();
    let ended: Vec<JobId> = steps.iter().filter(|s| s.end_job).map(|s| s.job).collect();
    let rows = step_rows(steps)?;
    match db {
        Db::Sqlite { write, turn, .. } => {
            // One text, its values bound in order: one call to the writer's thread.
            let mut q = Sql::default();
            let mut parts = Vec::new();
            if !rows.is_empty() {
                let values = q.rows(&rows, |q, r| {
                    let ended = (r.state == "succeeded").then_some(now);
                    format!(
                        "{}, {}, {}, {}, {}, {}",
                        q.text(r.job),
                        q.int(r.idx),
                        q.text(r.name),
                        q.text(r.state),
                        q.int(now),
                        q.arg(ended.map_or(Arg::Null, Arg::Int))
                    )
                });
                parts.push(format!("{}VALUES {values}{}", step_cols!(), step_upsert!()));
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
            if !claims.jobs.is_empty() {
                parts.push(jobs::claim_sqlite(
                    &mut q,
                    claims.jobs,
                    claims.owner,
                    claims.until_ms,
                ));
            }
            if parts.is_empty() {
                return Ok(HashMap::new());
            }
            let claimed = super::sqlite_atomic(write, turn, &parts.join(";\n"), &q.args).await?;
            jobs::claimed(db, &claimed).await
        }
        // One statement: atomic without a transaction around it.
        Db::Postgres(p) => {
            if !steps.is_empty() || !tasks.is_empty() {
                let _: (i64,) = sqlx::query_as(PG_WRITE)
                    .bind(now)
                    .bind(rows.iter().map(|r| r.job.to_string()).collect::<Vec<_>>())
                    .bind(rows.iter().map(|r| r.idx).collect::<Vec<_>>())
                    .bind(rows.iter().map(|r| r.name).collect::<Vec<_>>())
                    .bind(rows.iter().map(|r| r.state).collect::<Vec<_>>())
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
            }
            jobs::claim_records(db, claims.jobs, claims.owner, claims.until_ms).await
        }
    }
}

/// The same writes on Postgres: one statement over arrays whatever their count. It tells
/// the other replicas which nodes have new tasks (`NOTIFY`, sent as it commits), once per
/// node, not once per task.
const PG_WRITE: &str = concat!(
    "WITH s AS (",
    step_cols!(),
    "SELECT x.j, x.i, x.n, x.s, $1, CASE WHEN x.s = 'succeeded' THEN $1 END \
     FROM UNNEST($2::text[], $3::int8[], $4::text[], $5::text[]) AS x(j, i, n, s)",
    step_upsert!(),
    " RETURNING 1), \
     j AS (UPDATE jobs SET state = 'succeeded', ended_at = $1 WHERE uuid = ANY($6::text[]) \
       RETURNING 1), \
     t AS (INSERT INTO tasks (uuid, server_uuid, job_uuid, kind, payload, state, created_at) \
       SELECT t.u, t.s, t.j, t.k, t.p, 'queued', $1 \
       FROM UNNEST($7::text[], $8::text[], $9::text[], $10::text[], $11::text[]) \
       AS t(u, s, j, k, p) RETURNING 1), \
     n AS (SELECT pg_notify($12, q.s) FROM (SELECT DISTINCT s FROM UNNEST($8::text[]) AS s) q) \
     SELECT (SELECT COUNT(*) FROM s) + (SELECT COUNT(*) FROM j) + (SELECT COUNT(*) FROM t) \
     + (SELECT COUNT(*) FROM n)"
);
