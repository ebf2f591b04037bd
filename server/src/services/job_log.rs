//! Group commit for the job runners: each job's claim, its step writes and the tasks its
//! steps queue wait here, and one task writes whatever has gathered in one transaction
//! (`store::job_log`) and claims the jobs that have gathered in one statement. A runner
//! still waits for its own write before it acts, so the saga log says a step started
//! before the step does anything; what changes is that a thousand runners pay for a few
//! dozen transactions instead of a thousand statements.

use super::Ctx;
use crate::store::job_log::{self, NewTask, StepWrite};
use crate::store::jobs::JobRecord;
use crate::store::{StoreError, StoreResult};
use passage_model::JobId;
use tokio::sync::oneshot;

/// Writes gathered into one transaction at most.
const MAX_BATCH: usize = 256;

/// A runner's write waits for no one: whatever queued while the last batch was written
/// is the next batch.
pub const LINGER: std::time::Duration = std::time::Duration::ZERO;

pub enum Write {
    Steps(StepWrite),
    Task(NewTask),
    /// This process's lease on a job, for its runner to start.
    Claim(JobId),
}

pub struct Pending {
    write: Write,
    /// The claimed job's record for a claim, `None` for the rest (or a job not claimed).
    written: oneshot::Sender<StoreResult<Option<JobRecord>>>,
}

/// Writes `write` with whatever else is waiting; returns once it is committed.
async fn write(ctx: &Ctx, write: Write) -> StoreResult<Option<JobRecord>> {
    ctx.job_log
        .ask(
            ctx,
            |written| Pending { write, written },
            MAX_BATCH,
            write_batch,
        )
        .await
        .ok_or(StoreError::Sqlx(sqlx::Error::PoolClosed))?
}

pub async fn steps(ctx: &Ctx, s: StepWrite) -> StoreResult<()> {
    write(ctx, Write::Steps(s)).await.map(drop)
}

pub async fn task(ctx: &Ctx, t: NewTask) -> StoreResult<()> {
    write(ctx, Write::Task(t)).await.map(drop)
}

/// Takes this process's lease on `job`: the job as it stands once claimed, or `None` when
/// it is finished or another replica holds it.
pub async fn claim(ctx: &Ctx, job: JobId) -> StoreResult<Option<JobRecord>> {
    write(ctx, Write::Claim(job)).await
}

/// When a lease taken now runs out.
pub fn lease_until(ctx: &Ctx) -> i64 {
    crate::store::now_ms() + i64::try_from(ctx.cfg.job_lease.as_millis()).unwrap_or(30_000)
}

fn split(batch: &[Pending]) -> (Vec<StepWrite>, Vec<NewTask>, Vec<JobId>) {
    let mut steps = Vec::new();
    let mut tasks = Vec::new();
    let mut claims = Vec::new();
    for p in batch {
        match &p.write {
            Write::Steps(s) => steps.push(*s),
            Write::Task(t) => tasks.push(t.clone()),
            Write::Claim(j) => claims.push(*j),
        }
    }
    (steps, tasks, claims)
}

/// The batch's writes and its claims (in one transaction on SQLite).
async fn run(
    ctx: &Ctx,
    steps: &[StepWrite],
    tasks: &[NewTask],
    claims: &[JobId],
) -> StoreResult<std::collections::HashMap<JobId, JobRecord>> {
    let claims = job_log::Claims {
        jobs: claims,
        owner: &ctx.instance,
        until_ms: lease_until(ctx),
    };
    job_log::write_and_claim(&ctx.jobs_db, steps, tasks, &claims).await
}

async fn write_batch(ctx: Ctx, batch: Vec<Pending>) {
    let (steps, tasks, claims) = split(&batch);
    let t0 = std::time::Instant::now();
    let r = run(&ctx, &steps, &tasks, &claims).await;
    tracing::debug!(
        steps = steps.len(),
        tasks = tasks.len(),
        claims = claims.len(),
        took_ms = t0.elapsed().as_secs_f64() * 1e3,
        ok = r.is_ok(),
        "job log batch written"
    );
    match r {
        Ok(mut claimed) => {
            for p in batch {
                let answer = match &p.write {
                    Write::Claim(j) => claimed.remove(j),
                    _ => None,
                };
                let _ = p.written.send(Ok(answer));
            }
        }
        // All or nothing: each is written alone, so that one write's error is its own.
        Err(e) if batch.len() > 1 => {
            tracing::warn!(error = %e, writes = batch.len(),
                "a job log batch failed; writing its writes one by one");
            for p in batch {
                let (steps, tasks, claims) = split(std::slice::from_ref(&p));
                let r = run(&ctx, &steps, &tasks, &claims).await;
                let _ = p
                    .written
                    .send(r.map(|mut c| c.drain().next().map(|(_, rec)| rec)));
            }
        }
        Err(e) => {
            if let Some(p) = batch.into_iter().next() {
                let _ = p.written.send(Err(e));
            }
        }
    }
}
