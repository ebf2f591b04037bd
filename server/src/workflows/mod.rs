//! Workflows as sagas: each step has an action and an idempotent undo, every step's state
//! is persisted, and a failed step unwinds every step that started, newest first.
//!
//! Provision: reserve → bind → launch → mark_used (each undone on failure).
//! Destroy: stop → unbind → release → scrub (forward only: past `stop` there is nothing
//! to give back; on failure the VM's devices are quarantined, never freed unscrubbed).
//! Scrub: scrub (the devices a failed provision released).

pub mod agent_task;
pub mod destroy;
pub mod lifecycle;
pub mod provision;
pub mod reconcile;
pub mod scrub;

use crate::error::{ApiError, ApiResult};
use crate::services::Ctx;
use crate::store::jobs::{self, JobRecord};
use passage_model::JobId;
use passage_model::api::{JobState, StepState};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Saga {
    Provision,
    Destroy,
    Scrub,
    Stop,
    Start,
    Replace,
}

impl Saga {
    fn of(name: &str) -> Option<Saga> {
        match name {
            "provision" => Some(Saga::Provision),
            "destroy" => Some(Saga::Destroy),
            "scrub" => Some(Saga::Scrub),
            "stop" => Some(Saga::Stop),
            "start" => Some(Saga::Start),
            "resize" | "migrate" => Some(Saga::Replace),
            _ => None,
        }
    }

    async fn action(self, ctx: &Ctx, job: &JobRecord, step: &str) -> Result<(), String> {
        match self {
            Saga::Provision => provision::action(ctx, job, step).await,
            Saga::Destroy => destroy::action(ctx, job, step).await,
            Saga::Scrub => scrub::job_action(ctx, job, step).await,
            Saga::Stop => lifecycle::stop(ctx, job, step).await,
            Saga::Start => lifecycle::start(ctx, job, step).await,
            Saga::Replace => lifecycle::replace(ctx, job, step).await,
        }
    }

    async fn undo(self, ctx: &Ctx, job: &JobRecord, step: &str) -> Result<(), String> {
        match self {
            Saga::Provision => provision::undo(ctx, job, step).await,
            Saga::Start => lifecycle::start_undo(ctx, job, step).await,
            Saga::Replace => lifecycle::replace_undo(ctx, job, step).await,
            Saga::Destroy | Saga::Scrub | Saga::Stop => Ok(()),
        }
    }

    async fn on_failed(self, ctx: &Ctx, job: &JobRecord, error: &str) -> Result<(), String> {
        match self {
            Saga::Provision => provision::on_failed(ctx, job, error).await,
            Saga::Destroy => destroy::on_failed(ctx, job, error).await,
            Saga::Scrub | Saga::Stop | Saga::Start | Saga::Replace => Ok(()),
        }
    }
}

pub const PROVISION_STEPS: &[&str] = &["reserve", "bind", "launch", "mark_used"];
pub const DESTROY_STEPS: &[&str] = &["stop", "unbind", "release", "scrub"];
pub const SCRUB_STEPS: &[&str] = &["scrub"];

/// Runs a job in the background, unless this process runs it already.
pub fn spawn(ctx: Ctx, job: JobId) {
    let fresh = ctx
        .running_jobs
        .lock()
        .map(|mut set| set.insert(job))
        .unwrap_or(false);
    if !fresh {
        return;
    }
    tokio::spawn(async move {
        // Bounded: a burst of provisions queues here instead of flooding the database
        // and the agents; the semaphore is never closed.
        let permit = ctx.job_permits.clone().acquire_owned().await;
        // Boxed: a waiting task's size is then that of the wait, not of the whole job's
        // state machine, and a burst of 10,000 creations queues 10,000 waiting tasks.
        if let Err(e) = Box::pin(run(&ctx, job)).await {
            tracing::error!(%job, error = %e, "job runner failed");
        }
        drop(permit);
        if let Ok(mut set) = ctx.running_jobs.lock() {
            set.remove(&job);
        }
    });
}

fn lease_until(ctx: &Ctx) -> i64 {
    crate::store::now_ms() + i64::try_from(ctx.cfg.job_lease.as_millis()).unwrap_or(30_000)
}

/// Keeps the lease alive while the job runs; `lost` turns true if another replica took it.
fn keep_lease(ctx: &Ctx, job: JobId, lost: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    let ctx = ctx.clone();
    tokio::spawn(async move {
        let every = (ctx.cfg.job_lease / 3).max(std::time::Duration::from_millis(100));
        loop {
            tokio::time::sleep(every).await;
            match jobs::claim(&ctx.jobs_db, job, &ctx.instance, lease_until(&ctx)).await {
                Ok(true) => {}
                Ok(false) => {
                    lost.store(true, Ordering::SeqCst);
                    return;
                }
                Err(e) => tracing::warn!(%job, error = %e, "renewing a job lease"),
            }
        }
    })
}

fn fault(ctx: &Ctx, job: &str, step: &str) -> Result<(), String> {
    let key = format!("{job}.{step}");
    if ctx.cfg.faults.contains(&key) {
        return Err(format!("injected fault at {key}"));
    }
    Ok(())
}

/// Runs (or resumes) a job to its end. Steps already `succeeded` are skipped, so a job
/// interrupted by a restart picks up where it stopped.
pub async fn run(ctx: &Ctx, job: JobId) -> ApiResult<()> {
    if !jobs::claim(&ctx.jobs_db, job, &ctx.instance, lease_until(ctx)).await? {
        // Finished, or another replica holds it.
        return Ok(());
    }
    let lost = Arc::new(AtomicBool::new(false));
    let lease = keep_lease(ctx, job, lost.clone());
    let r = run_claimed(ctx, job, &lost).await;
    lease.abort();
    r
}

async fn run_claimed(ctx: &Ctx, job: JobId, lost: &AtomicBool) -> ApiResult<()> {
    // Read once: while this runner holds the lease, it alone writes the job's steps, and
    // it keeps its copy in step with what it writes.
    let mut rec = jobs::get(&ctx.jobs_db, job).await?;
    if matches!(rec.view.state, JobState::Succeeded | JobState::Failed) {
        return Ok(());
    }
    let saga = Saga::of(&rec.view.name)
        .ok_or_else(|| ApiError::internal(format!("unknown job kind {}", rec.view.name)))?;
    rec.view.state = JobState::Running;
    // A job that was already unwinding when its runner died goes on unwinding.
    if let Some((i, failed)) = rec
        .view
        .steps
        .iter()
        .enumerate()
        .find(|(_, s)| matches!(s.state, StepState::Failed | StepState::Undone))
    {
        let e = failed
            .error
            .clone()
            .unwrap_or_else(|| "interrupted while unwinding".into());
        return fail(ctx, saga, job, &rec.view.steps[i].name, &e).await;
    }
    for i in 0..rec.view.steps.len() {
        let step = rec.view.steps[i].clone();
        if step.state == StepState::Succeeded {
            continue;
        }
        if lost.load(Ordering::SeqCst) {
            tracing::warn!(%job, "lost the job's lease to another replica; stopping here");
            return Ok(());
        }
        let key = format!("{}.{}", rec.view.name, step.name);
        if ctx.cfg.pause_before.as_deref() == Some(key.as_str()) {
            use std::io::Write;
            let mut out = std::io::stdout();
            let _ = writeln!(out, "passage: paused before {key} (test hook)");
            let _ = out.flush();
            std::future::pending::<()>().await;
        }
        jobs::step_started(&ctx.jobs_db, job, i).await?;
        let now = chrono::Utc::now();
        let s = &mut rec.view.steps[i];
        s.state = StepState::Running;
        s.started_at.get_or_insert(now);
        s.error = None;
        let started = std::time::Instant::now();
        let result = match saga.action(ctx, &rec, &step.name).await {
            Ok(()) => fault(ctx, &rec.view.name, &step.name),
            Err(e) => Err(e),
        };
        ctx.metrics
            .step(&rec.view.name, &step.name, started.elapsed());
        match result {
            Ok(()) => {
                jobs::step_ended(&ctx.jobs_db, job, i, StepState::Succeeded, None).await?;
                rec.view.steps[i].state = StepState::Succeeded;
            }
            Err(e) => {
                tracing::warn!(%job, step = %step.name, error = %e, "job step failed");
                jobs::step_ended(&ctx.jobs_db, job, i, StepState::Failed, Some(&e)).await?;
                return fail(ctx, saga, job, &step.name, &e).await;
            }
        }
    }
    jobs::set_state(&ctx.jobs_db, job, JobState::Succeeded, None).await?;
    Ok(())
}

/// Unwinds what the job did and records why it failed.
async fn fail(ctx: &Ctx, saga: Saga, job: JobId, step: &str, e: &str) -> ApiResult<()> {
    let undo_errors = unwind(ctx, job).await?;
    let mut error = format!("{step} failed: {e}");
    if !undo_errors.is_empty() {
        error.push_str(&format!("; undo failed: {}", undo_errors.join("; ")));
    }
    let fresh = jobs::get(&ctx.jobs_db, job).await?;
    if let Err(e2) = saga.on_failed(ctx, &fresh, &error).await {
        error.push_str(&format!("; cleanup failed: {e2}"));
    }
    jobs::set_state(&ctx.jobs_db, job, JobState::Failed, Some(&error)).await?;
    Ok(())
}

/// Runs the undo of every step that started, newest first. Undos are idempotent: calling
/// this again on an unwound job changes nothing. Returns the undos that failed.
pub async fn unwind(ctx: &Ctx, job: JobId) -> ApiResult<Vec<String>> {
    let rec = jobs::get(&ctx.jobs_db, job).await?;
    let saga = Saga::of(&rec.view.name)
        .ok_or_else(|| ApiError::internal(format!("unknown job kind {}", rec.view.name)))?;
    let mut errors = Vec::new();
    for (i, step) in rec.view.steps.iter().enumerate().rev() {
        if step.started_at.is_none() {
            continue;
        }
        match saga.undo(ctx, &rec, &step.name).await {
            Ok(()) => jobs::step_ended(&ctx.jobs_db, job, i, StepState::Undone, None).await?,
            Err(e) => {
                tracing::warn!(%job, step = %step.name, error = %e, "undo failed");
                errors.push(format!("{}: {e}", step.name));
            }
        }
    }
    Ok(errors)
}

/// Jobs whose runner is gone (a server that died, a replica that stopped): resume each.
pub async fn resume_all(ctx: &Ctx) -> ApiResult<usize> {
    let pending = jobs::orphaned(&ctx.jobs_db, 5_000).await?;
    let n = pending.len();
    for job in pending {
        let known = ctx
            .running_jobs
            .lock()
            .map(|s| s.contains(&job))
            .unwrap_or(true);
        if !known {
            tracing::info!(%job, "resuming an orphaned job");
            spawn(ctx.clone(), job);
        }
    }
    Ok(n)
}
