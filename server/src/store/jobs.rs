//! Persisted jobs and their steps: the saga log a restarted server resumes from.

use super::page::{self, Page, PageReq, TimeKey, Where};
use super::{Db, StoreError, StoreResult, corrupt, now_ms, parse_uuid, to_time};
use crate::{in_tx, on_read, on_write};
use passage_model::api::{Job, JobState, JobStep, StepState};
use passage_model::{AccountId, JobId, VmId};
use std::collections::HashMap;

pub trait JobTx {
    fn insert_job(
        &mut self,
        job: JobId,
        name: &str,
        vm: Option<VmId>,
        owner: Option<AccountId>,
        payload: Option<&str>,
        steps: &[&str],
    ) -> impl Future<Output = StoreResult<()>> + Send;
}

macro_rules! impl_job_tx {
    ($db:ty) => {
        impl JobTx for sqlx::Transaction<'_, $db> {
            async fn insert_job(
                &mut self,
                job: JobId,
                name: &str,
                vm: Option<VmId>,
                owner: Option<AccountId>,
                payload: Option<&str>,
                steps: &[&str],
            ) -> StoreResult<()> {
                let now = now_ms();
                sqlx::query(
                    "INSERT INTO jobs (uuid, name, vm_uuid, owner_uuid, payload, state, \
                     created_at) VALUES ($1, $2, $3, $4, $6, 'queued', $5)",
                )
                .bind(job.to_string())
                .bind(name)
                .bind(vm.map(|v| v.to_string()))
                .bind(owner.map(|o| o.to_string()))
                .bind(now)
                .bind(payload)
                .execute(&mut **self)
                .await?;
                if steps.is_empty() {
                    return Ok(());
                }
                // One statement for all steps: a creation's transaction is short of
                // round trips to the single SQLite writer.
                let rows: Vec<String> = (0..steps.len())
                    .map(|i| format!("($1, {i}, ${}, 'pending')", i + 2))
                    .collect();
                let sql = format!(
                    "INSERT INTO job_steps (job_uuid, idx, name, state) VALUES {}",
                    rows.join(", ")
                );
                let mut q = sqlx::query(&sql).bind(job.to_string());
                for step in steps {
                    q = q.bind(*step);
                }
                q.execute(&mut **self).await?;
                Ok(())
            }
        }
    };
}
impl_job_tx!(sqlx::Sqlite);
impl_job_tx!(sqlx::Postgres);

pub async fn insert(
    db: &Db,
    job: JobId,
    name: &str,
    vm: Option<VmId>,
    owner: Option<AccountId>,
    payload: Option<&str>,
    steps: &[&str],
) -> StoreResult<()> {
    in_tx!(db, |tx| tx
        .insert_job(job, name, vm, owner, payload, steps)
        .await)
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
    name: String,
    state: String,
    started_at: Option<i64>,
    ended_at: Option<i64>,
    error: Option<String>,
}

pub struct JobRecord {
    pub view: Job,
    /// The account whose VM the job works on (for access checks).
    pub owner: Option<AccountId>,
    pub payload: Option<String>,
}

const JOB_COLS: &str =
    "uuid, name, vm_uuid, owner_uuid, payload, state, error, created_at, ended_at";

fn record(row: JobRow, steps: Vec<StepRow>) -> StoreResult<JobRecord> {
    let owner = row
        .owner_uuid
        .as_deref()
        .map(|o| parse_uuid(o, "account"))
        .transpose()?;
    let view = Job {
        uuid: parse_uuid(&row.uuid, "job")?,
        name: row.name,
        vm_uuid: row
            .vm_uuid
            .as_deref()
            .map(|v| parse_uuid(v, "vm"))
            .transpose()?,
        state: JobState::parse(&row.state).ok_or_else(|| corrupt(&row.state))?,
        steps: steps
            .into_iter()
            .map(|s| {
                Ok(JobStep {
                    state: StepState::parse(&s.state).ok_or_else(|| corrupt(&s.state))?,
                    name: s.name,
                    started_at: s.started_at.map(to_time),
                    ended_at: s.ended_at.map(to_time),
                    error: s.error,
                })
            })
            .collect::<StoreResult<_>>()?,
        created_at: to_time(row.created_at),
        ended_at: row.ended_at.map(to_time),
        error: row.error,
    };
    Ok(JobRecord {
        view,
        owner,
        payload: row.payload,
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
    let steps: Vec<StepRow> = on_read!(db, |p| sqlx::query_as(
        "SELECT name, state, started_at, ended_at, error FROM job_steps \
         WHERE job_uuid = $1 ORDER BY idx"
    )
    .bind(job.to_string())
    .fetch_all(p)
    .await)?;
    record(row, steps)
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

pub async fn step_started(db: &Db, job: JobId, idx: usize) -> StoreResult<()> {
    on_write!(db, |p| sqlx::query(
        "UPDATE job_steps SET state = 'running', started_at = COALESCE(started_at, $3), \
         error = NULL WHERE job_uuid = $1 AND idx = $2"
    )
    .bind(job.to_string())
    .bind(idx as i64)
    .bind(now_ms())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

pub async fn step_ended(
    db: &Db,
    job: JobId,
    idx: usize,
    state: StepState,
    error: Option<&str>,
) -> StoreResult<()> {
    on_write!(db, |p| sqlx::query(
        "UPDATE job_steps SET state = $3, ended_at = $4, error = COALESCE($5, error) \
         WHERE job_uuid = $1 AND idx = $2"
    )
    .bind(job.to_string())
    .bind(idx as i64)
    .bind(state.as_str())
    .bind(now_ms())
    .bind(error)
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
            "SELECT job_uuid, name, state, started_at, ended_at, error FROM job_steps \
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
            record(row, s).map(|r| r.view)
        })
        .collect::<StoreResult<_>>()?;
    Ok(Page {
        items,
        total: p.total,
        next: p.next,
    })
}

/// Takes (or renews) the lease on an unfinished job: free, already ours, or expired. A
/// claimed job is `running`: its runner has started (one statement for both, as every
/// job's start pays it).
pub async fn claim(db: &Db, job: JobId, owner: &str, until_ms: i64) -> StoreResult<bool> {
    let n = on_write!(db, |p| sqlx::query(
        "UPDATE jobs SET lease_owner = $2, lease_until = $3, state = 'running' WHERE uuid = $1 \
         AND state IN ('queued', 'running') \
         AND (lease_owner IS NULL OR lease_owner = $2 OR lease_until < $4)"
    )
    .bind(job.to_string())
    .bind(owner)
    .bind(until_ms)
    .bind(now_ms())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(n == 1)
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
