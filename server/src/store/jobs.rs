//! Persisted jobs and their steps: the saga log a restarted server resumes from. A job is
//! written with its kind alone; its steps always come from the kind
//! (`passage_model::jobs::JobKind::step_names`), and a step's row is written when the step
//! first starts (`store::job_log`): a step without one is pending.

use super::page::{self, Page, PageReq, TimeKey, Where};
use super::sql::Sql;
use super::{Db, StoreError, StoreResult, corrupt, now_ms, parse_uuid, to_time};
use crate::{bind_args, in_tx, on_read, on_write};
use chrono::{DateTime, Utc};
use passage_model::api::{Job, JobState, JobStep, StepState};
use passage_model::jobs::{JobKind, StepErrorKind};
use passage_model::{AccountId, JobId, VmId};
use std::collections::HashMap;

/// A job to write.
#[derive(Clone, Debug)]
pub struct NewJob {
    pub uuid: JobId,
    pub kind: JobKind,
    /// The VM it works on.
    pub vm: Option<VmId>,
    /// The account whose VM it is (for access checks).
    pub owner: Option<AccountId>,
    /// The workflow's own parameters, as JSON.
    pub payload: Option<String>,
}

/// Jobs written in a transaction beside other writes (a VM row, a reservation).
pub trait JobTx {
    /// Writes each job, queued, its steps pending (no rows of their own yet).
    fn insert_jobs(&mut self, jobs: &[NewJob]) -> impl Future<Output = StoreResult<()>> + Send;
}

impl JobTx for sqlx::Transaction<'_, sqlx::Sqlite> {
    async fn insert_jobs(&mut self, jobs: &[NewJob]) -> StoreResult<()> {
        if jobs.is_empty() {
            return Ok(());
        }
        let now = now_ms();
        let mut q = Sql::default();
        let rows = q.rows(jobs, |q, j| {
            format!(
                "{}, {}, {}, {}, {}, 'queued', {}",
                q.text(j.uuid),
                q.text(j.kind),
                q.arg(j.vm.map_or(page::Arg::Null, |v| page::Arg::Text(v.to_string()))),
                q.arg(
                    j.owner
                        .map_or(page::Arg::Null, |o| page::Arg::Text(o.to_string()))
                ),
                q.arg(j.payload.clone().map_or(page::Arg::Null, page::Arg::Text)),
                q.int(now)
            )
        });
        let sql = format!(
            "INSERT INTO jobs (uuid, name, vm_uuid, owner_uuid, payload, state, created_at) \
             VALUES {rows}"
        );
        bind_args!(sqlx::query(&sql), &q.args)
            .execute(&mut **self)
            .await?;
        Ok(())
    }
}

/// The jobs on Postgres, one statement over arrays whatever their count.
const PG_INSERT: &str = "INSERT INTO jobs (uuid, name, vm_uuid, owner_uuid, payload, state, \
     created_at) \
     SELECT x.u, x.n, x.v, x.o, x.p, 'queued', $1 \
     FROM UNNEST($2::text[], $3::text[], $4::text[], $5::text[], $6::text[]) \
     AS x(u, n, v, o, p)";

impl JobTx for sqlx::Transaction<'_, sqlx::Postgres> {
    async fn insert_jobs(&mut self, jobs: &[NewJob]) -> StoreResult<()> {
        if jobs.is_empty() {
            return Ok(());
        }
        sqlx::query(PG_INSERT)
            .bind(now_ms())
            .bind(jobs.iter().map(|j| j.uuid.to_string()).collect::<Vec<_>>())
            .bind(jobs.iter().map(|j| j.kind.as_str()).collect::<Vec<_>>())
            .bind(
                jobs.iter()
                    .map(|j| j.vm.map(|v| v.to_string()))
                    .collect::<Vec<_>>(),
            )
            .bind(
                jobs.iter()
                    .map(|j| j.owner.map(|o| o.to_string()))
                    .collect::<Vec<_>>(),
            )
            .bind(jobs.iter().map(|j| j.payload.clone()).collect::<Vec<_>>())
            .execute(&mut **self)
            .await?;
        Ok(())
    }
}

/// Writes a job in a transaction of its own.
pub async fn insert(db: &Db, job: NewJob) -> StoreResult<()> {
    in_tx!(db, |tx| tx.insert_jobs(std::slice::from_ref(&job)).await)
}

#[derive(sqlx::FromRow)]
struct JobRow {
    uuid: String,
    name: String,
    vm_uuid: Option<String>,
    owner_uuid: Option<String>,
    payload: Option<String>,
    state: String,
    error: Option<String>,
    created_at: i64,
    ended_at: Option<i64>,
}

#[derive(sqlx::FromRow)]
struct StepRow {
    idx: i64,
    name: String,
    state: String,
    started_at: Option<i64>,
    ended_at: Option<i64>,
    error: Option<String>,
    error_kind: Option<String>,
    progress_done: Option<i64>,
    progress_total: Option<i64>,
    detail: Option<String>,
}

/// Why a step failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepFailure {
    pub kind: StepErrorKind,
    pub message: String,
}

/// A step as its job's runner keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepRecord {
    pub name: String,
    pub state: StepState,
    pub started_at: Option<DateTime<Utc>>,
    pub ended_at: Option<DateTime<Utc>>,
    pub failure: Option<StepFailure>,
    pub progress: Option<passage_model::api::Progress>,
    /// What the step found, in words (how a stop ended).
    pub detail: Option<String>,
}

/// A job as its runner keeps it; the API sees [`JobRecord::view`].
#[derive(Clone, Debug)]
pub struct JobRecord {
    pub uuid: JobId,
    pub kind: JobKind,
    pub vm: Option<VmId>,
    /// The account whose VM the job works on (for access checks).
    pub owner: Option<AccountId>,
    pub payload: Option<String>,
    pub state: JobState,
    pub steps: Vec<StepRecord>,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
}

impl JobRecord {
    pub fn view(&self) -> Job {
        Job {
            uuid: self.uuid,
            name: self.kind.as_str().to_string(),
            vm_uuid: self.vm,
            state: self.state,
            steps: self
                .steps
                .iter()
                .map(|s| JobStep {
                    name: s.name.clone(),
                    state: s.state,
                    started_at: s.started_at,
                    ended_at: s.ended_at,
                    error: s.failure.as_ref().map(|f| f.message.clone()),
                    error_kind: s.failure.as_ref().map(|f| f.kind),
                    progress: s.progress,
                    detail: s.detail.clone(),
                })
                .collect(),
            created_at: self.created_at,
            ended_at: self.ended_at,
            error: self.error.clone(),
        }
    }
}

const JOB_COLS: &str =
    "uuid, name, vm_uuid, owner_uuid, payload, state, error, created_at, ended_at";

const STEP_COLS: &str = "idx, name, state, started_at, ended_at, error, error_kind, progress_done, progress_total, \
     detail";

fn step_record(s: StepRow) -> StoreResult<StepRecord> {
    let failure = match s.error {
        None => None,
        Some(message) => Some(StepFailure {
            // Written before kinds were kept: refused is what such a failure was.
            kind: match s.error_kind.as_deref() {
                None => StepErrorKind::Refused,
                Some(k) => StepErrorKind::parse(k).ok_or_else(|| corrupt(k))?,
            },
            message,
        }),
    };
    let progress = match (s.progress_done, s.progress_total) {
        (Some(d), Some(t)) => Some(passage_model::api::Progress {
            done: u64::try_from(d).unwrap_or(0),
            total: u64::try_from(t).unwrap_or(0),
        }),
        _ => None,
    };
    Ok(StepRecord {
        progress,
        detail: s.detail,
        state: StepState::parse(&s.state).ok_or_else(|| corrupt(&s.state))?,
        name: s.name,
        started_at: s.started_at.map(to_time),
        ended_at: s.ended_at.map(to_time),
        failure,
    })
}

/// A job's steps, in order: each of its kind's, as its row says once it has started, and
/// pending before.
fn steps_of(kind: JobKind, rows: Vec<StepRow>) -> StoreResult<Vec<StepRecord>> {
    let names = kind.step_names();
    let mut out: Vec<StepRecord> = names
        .iter()
        .map(|n| StepRecord {
            name: (*n).to_string(),
            state: StepState::Pending,
            started_at: None,
            ended_at: None,
            failure: None,
            progress: None,
            detail: None,
        })
        .collect();
    for row in rows {
        let slot = usize::try_from(row.idx)
            .ok()
            .and_then(|i| out.get_mut(i))
            .ok_or_else(|| corrupt(format!("{kind} job step {}", row.idx)))?;
        *slot = step_record(row)?;
    }
    Ok(out)
}

fn record(row: JobRow, steps: Vec<StepRow>) -> StoreResult<JobRecord> {
    let kind =
        JobKind::parse(&row.name).ok_or_else(|| corrupt(format!("job kind {}", row.name)))?;
    Ok(JobRecord {
        uuid: parse_uuid(&row.uuid, "job")?,
        kind,
        vm: row
            .vm_uuid
            .as_deref()
            .map(|v| parse_uuid(v, "vm"))
            .transpose()?,
        owner: row
            .owner_uuid
            .as_deref()
            .map(|o| parse_uuid(o, "account"))
            .transpose()?,
        payload: row.payload,
        state: JobState::parse(&row.state).ok_or_else(|| corrupt(&row.state))?,
        steps: steps_of(kind, steps)?,
        error: row.error,
        created_at: to_time(row.created_at),
        ended_at: row.ended_at.map(to_time),
    })
}

pub async fn get(db: &Db, job: JobId) -> StoreResult<JobRecord> {
    let row: Option<JobRow> = on_read!(db, |p| sqlx::query_as(&format!(
        "SELECT {JOB_COLS} FROM jobs WHERE uuid = $1"
    ))
    .bind(job.to_string())
    .fetch_optional(p)
    .await)?;
    let row = row.ok_or(StoreError::NotFound("job"))?;
    with_steps(db, row).await
}

async fn with_steps(db: &Db, row: JobRow) -> StoreResult<JobRecord> {
    let steps: Vec<StepRow> = on_read!(db, |p| sqlx::query_as(&format!(
        "SELECT {STEP_COLS} FROM job_steps WHERE job_uuid = $1 ORDER BY idx"
    ))
    .bind(&row.uuid)
    .fetch_all(p)
    .await)?;
    record(row, steps)
}

/// Jobs' starts: [`claim`] for each of `jobs` at once, answering those claimed as they
/// stand once claimed (the claim's own `RETURNING`, and their steps in one read) instead
/// of a read of each job after it. Those finished or held by another replica are absent.
pub async fn claim_records(
    db: &Db,
    jobs: &[JobId],
    owner: &str,
    until_ms: i64,
) -> StoreResult<HashMap<JobId, JobRecord>> {
    if jobs.is_empty() {
        return Ok(HashMap::new());
    }
    let mut w = Where::default();
    let (o, until, now) = (w.text(owner), w.int(until_ms), w.int(now_ms()));
    let list: Vec<String> = jobs.iter().map(|j| w.text(j.to_string())).collect();
    let sql = claim_sql(&o, &until, &list.join(", "), &claimable(&o, &now));
    let rows: Vec<JobRow> = on_write!(db, |p| bind_args!(sqlx::query_as(&sql), &w.args)
        .fetch_all(p)
        .await)?;
    with_steps_of(db, rows).await
}

/// The claim's statement, from its placeholders: the owner, the lease's end, the jobs'
/// list and the claimable condition.
fn claim_sql(owner: &str, until: &str, list: &str, claimable: &str) -> String {
    format!(
        "UPDATE jobs SET lease_owner = {owner}, lease_until = {until}, state = 'running' \
         WHERE uuid IN ({list}) AND {claimable} RETURNING {JOB_COLS}"
    )
}

/// [`claim_records`]'s statement for a SQLite call whose values are bound in order (`q`):
/// its rows, returned, go to [`claimed`].
pub(super) fn claim_sqlite(q: &mut Sql, jobs: &[JobId], owner: &str, until_ms: i64) -> String {
    let (o, until) = (q.text(owner), q.int(until_ms));
    let list = q.list(jobs);
    let (o2, now) = (q.text(owner), q.int(now_ms()));
    claim_sql(&o, &until, &list, &claimable(&o2, &now))
}

/// The jobs [`claim_sqlite`]'s statement returned, as [`claim_records`] answers them.
pub(super) async fn claimed(
    db: &Db,
    rows: &[sqlx::sqlite::SqliteRow],
) -> StoreResult<HashMap<JobId, JobRecord>> {
    use sqlx::FromRow;
    let rows = rows
        .iter()
        .map(JobRow::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    with_steps_of(db, rows).await
}

/// Claimed jobs' rows with their steps, read in one query.
async fn with_steps_of(db: &Db, rows: Vec<JobRow>) -> StoreResult<HashMap<JobId, JobRecord>> {
    if rows.is_empty() {
        return Ok(HashMap::new());
    }
    let sql = format!(
        "SELECT job_uuid, {STEP_COLS} FROM job_steps \
         WHERE job_uuid IN ({}) ORDER BY job_uuid, idx",
        page::marks(1, rows.len())
    );
    let args: Vec<page::Arg> = rows
        .iter()
        .map(|r| page::Arg::Text(r.uuid.clone()))
        .collect();
    let mut steps: HashMap<String, Vec<StepRow>> = HashMap::new();
    for r in page::fetch::<StepOfJob>(db, &sql, &args).await? {
        steps.entry(r.job_uuid).or_default().push(r.step);
    }
    rows.into_iter()
        .map(|row| {
            let s = steps.remove(&row.uuid).unwrap_or_default();
            record(row, s).map(|r| (r.uuid, r))
        })
        .collect()
}

pub async fn set_state(
    db: &Db,
    job: JobId,
    state: JobState,
    error: Option<&str>,
) -> StoreResult<()> {
    let ended = matches!(state, JobState::Succeeded | JobState::Failed).then(now_ms);
    on_write!(db, |p| sqlx::query(
        "UPDATE jobs SET state = $2, error = COALESCE($3, error), ended_at = $4 WHERE uuid = $1"
    )
    .bind(job.to_string())
    .bind(state.as_str())
    .bind(error)
    .bind(ended)
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

/// Ends a step of a `kind` job in `state`; a failure is kept with its kind (a later end
/// without one keeps it: an undone step still says why its job failed). The step's row is
/// written if it has none yet (a failure put on a step its task did ahead).
pub async fn step_ended(
    db: &Db,
    (job, kind): (JobId, JobKind),
    idx: usize,
    state: StepState,
    failure: Option<&StepFailure>,
) -> StoreResult<()> {
    let name = kind
        .step_names()
        .get(idx)
        .ok_or_else(|| corrupt(format!("{kind} job {job} has no step {idx}")))?;
    let now = now_ms();
    on_write!(db, |p| sqlx::query(
        "INSERT INTO job_steps (job_uuid, idx, name, state, started_at, ended_at, error, \
         error_kind) VALUES ($1, $2, $3, $4, $5, $5, $6, $7) \
         ON CONFLICT (job_uuid, idx) DO UPDATE SET state = excluded.state, \
         ended_at = excluded.ended_at, error = COALESCE(excluded.error, job_steps.error), \
         error_kind = COALESCE(excluded.error_kind, job_steps.error_kind)"
    )
    .bind(job.to_string())
    .bind(idx as i64)
    .bind(*name)
    .bind(state.as_str())
    .bind(now)
    .bind(failure.map(|f| f.message.as_str()))
    .bind(failure.map(|f| f.kind.as_str()))
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

pub use crate::listing::JobFilter;

#[derive(sqlx::FromRow)]
struct StepOfJob {
    job_uuid: String,
    #[sqlx(flatten)]
    step: StepRow,
}

/// One page of jobs, newest first, with their steps (two queries for the whole page).
pub async fn list(
    db: &Db,
    f: &JobFilter,
    req: &PageReq<TimeKey>,
) -> StoreResult<Page<Job, TimeKey>> {
    let mut w = Where::default();
    if let Some(o) = f.owner {
        let a = w.text(o.to_string());
        w.and(format!("owner_uuid = {a}"));
    }
    if let Some(st) = f.state {
        let a = w.text(st.as_str());
        w.and(format!("state = {a}"));
    }
    let p = page::newest_first(db, JOB_COLS, "jobs", w, req, |r: &JobRow| {
        TimeKey::new(r.created_at, &r.uuid)
    })
    .await?;
    let mut steps: HashMap<String, Vec<StepRow>> = HashMap::new();
    if !p.items.is_empty() {
        let sql = format!(
            "SELECT job_uuid, {STEP_COLS} FROM job_steps \
             WHERE job_uuid IN ({}) ORDER BY job_uuid, idx",
            page::marks(1, p.items.len())
        );
        let args: Vec<page::Arg> = p
            .items
            .iter()
            .map(|r| page::Arg::Text(r.uuid.clone()))
            .collect();
        let rows: Vec<StepOfJob> = page::fetch(db, &sql, &args).await?;
        for r in rows {
            steps.entry(r.job_uuid).or_default().push(r.step);
        }
    }
    let items = p
        .items
        .into_iter()
        .map(|row| {
            let s = steps.remove(&row.uuid).unwrap_or_default();
            record(row, s).map(|r| r.view())
        })
        .collect::<StoreResult<_>>()?;
    Ok(Page {
        items,
        total: p.total,
        next: p.next,
    })
}

/// A job a runner may take: unfinished, and free, already `owner`'s, or with its lease run
/// out before `now` (both placeholders).
fn claimable(owner: &str, now: &str) -> String {
    format!(
        "state IN ('queued', 'running') \
         AND (lease_owner IS NULL OR lease_owner = {owner} OR lease_until < {now})"
    )
}

/// Takes (or renews) the lease on an unfinished job: free, already ours, or expired. A
/// claimed job is `running`: its runner has started (one statement for both, as every
/// job's start pays it).
pub async fn claim(db: &Db, job: JobId, owner: &str, until_ms: i64) -> StoreResult<bool> {
    let n = on_write!(db, |p| sqlx::query(&format!(
        "UPDATE jobs SET lease_owner = $2, lease_until = $3, state = 'running' \
             WHERE uuid = $1 AND {}",
        claimable("$2", "$4")
    ))
    .bind(job.to_string())
    .bind(owner)
    .bind(until_ms)
    .bind(now_ms())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(n == 1)
}

/// Gives back the leases `owner` holds, as it shuts down: the next start (or another
/// replica) takes the jobs over at once instead of after the lease runs out. The owner
/// is kept, so the record still says who ran them last.
pub async fn release_leases(db: &Db, owner: &str) -> StoreResult<u64> {
    Ok(on_write!(db, |p| sqlx::query(
        "UPDATE jobs SET lease_until = 0 WHERE lease_owner = $1 \
         AND state IN ('queued', 'running')"
    )
    .bind(owner)
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?)
}

/// Unfinished jobs nobody holds a live lease on. A job never leased is left alone for
/// `grace_ms` after its creation: its creator is about to run it.
pub async fn orphaned(db: &Db, grace_ms: i64) -> StoreResult<Vec<JobId>> {
    let now = now_ms();
    let rows: Vec<String> = on_read!(db, |p| sqlx::query_scalar(
        "SELECT uuid FROM jobs WHERE state IN ('queued', 'running') \
         AND ((lease_until IS NULL AND created_at < $2) OR lease_until < $1) \
         ORDER BY created_at LIMIT 500"
    )
    .bind(now)
    .bind(now - grace_ms)
    .fetch_all(p)
    .await)?;
    rows.iter().map(|u| parse_uuid(u, "job")).collect()
}

/// Records what step `idx` of `job` found (how a stop ended), on its row, written when
/// the step started.
pub async fn set_step_detail(db: &Db, job: JobId, idx: usize, detail: &str) -> StoreResult<()> {
    on_write!(db, |p| sqlx::query(
        "UPDATE job_steps SET detail = $3 WHERE job_uuid = $1 AND idx = $2"
    )
    .bind(job.to_string())
    .bind(i64::try_from(idx).unwrap_or(i64::MAX))
    .bind(detail)
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

/// Records an agent's progress on the running step of `job` (the one waiting for its
/// task). Where several run as one task (a bind, the image's fetch and a launch), a
/// download's progress is the fetch's. `false` when no step of the job is running.
pub async fn set_progress(db: &Db, job: JobId, done: u64, total: u64) -> StoreResult<bool> {
    let n = on_write!(db, |p| sqlx::query(
        "UPDATE job_steps SET progress_done = $2, progress_total = $3 \
         WHERE job_uuid = $1 AND state = 'running' \
         AND (name = 'fetch_image' OR NOT EXISTS (SELECT 1 FROM job_steps f \
           WHERE f.job_uuid = $1 AND f.state = 'running' AND f.name = 'fetch_image'))"
    )
    .bind(job.to_string())
    .bind(i64::try_from(done).unwrap_or(i64::MAX))
    .bind(i64::try_from(total).unwrap_or(i64::MAX))
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(n > 0)
}
