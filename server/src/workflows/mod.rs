//! Workflows as sagas: each step has an action and an idempotent undo, every step's state
//! is persisted, and a failed step unwinds every step that started, newest first.
//!
//! Provision: reserve → bind → launch → mark_used (each undone on failure).
//! Destroy: stop → unbind → release → scrub (forward only: past `stop` there is nothing
//! to give back; on failure the VM's devices are quarantined, never freed unscrubbed).
//! Scrub: scrub (the devices a failed provision released).

pub mod agent_task;
pub mod destroy;
pub mod provision;
pub mod reconcile;
pub mod scrub;

use crate::error::{ApiError, ApiResult};
use crate::services::Ctx;
use crate::store::jobs::{self, JobRecord};
use passage_model::JobId;
use passage_model::api::{JobState, StepState};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Saga {
    Provision,
    Destroy,
    Scrub,
}

impl Saga {
    fn of(name: &str) -> Option<Saga> {
        match name {
            "provision" => Some(Saga::Provision),
            "destroy" => Some(Saga::Destroy),
            "scrub" => Some(Saga::Scrub),
            _ => None,
        }
    }

    async fn action(self, ctx: &Ctx, job: &JobRecord, step: &str) -> Result<(), String> {
        match self {
            Saga::Provision => provision::action(ctx, job, step).await,
            Saga::Destroy => destroy::action(ctx, job, step).await,
            Saga::Scrub => scrub::job_action(ctx, job, step).await,
        }
    }

    async fn undo(self, ctx: &Ctx, job: &JobRecord, step: &str) -> Result<(), String> {
        match self {
            Saga::Provision => provision::undo(ctx, job, step).await,
            Saga::Destroy | Saga::Scrub => Ok(()),
        }
    }

    async fn on_failed(self, ctx: &Ctx, job: &JobRecord, error: &str) -> Result<(), String> {
        match self {
            Saga::Provision => provision::on_failed(ctx, job, error).await,
            Saga::Destroy => destroy::on_failed(ctx, job, error).await,
            Saga::Scrub => Ok(()),
        }
    }
}

pub const PROVISION_STEPS: &[&str] = &["reserve", "bind", "launch", "mark_used"];
pub const DESTROY_STEPS: &[&str] = &["stop", "unbind", "release", "scrub"];
pub const SCRUB_STEPS: &[&str] = &["scrub"];

/// Runs a job in the background.
pub fn spawn(ctx: Ctx, job: JobId) {
    tokio::spawn(async move {
        if let Err(e) = run(&ctx, job).await {
            tracing::error!(%job, error = %e, "job runner failed");
        }
    });
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
    let rec = jobs::get(&ctx.db, job).await?;
    if matches!(rec.view.state, JobState::Succeeded | JobState::Failed) {
        return Ok(());
    }
    let saga = Saga::of(&rec.view.name)
        .ok_or_else(|| ApiError::internal(format!("unknown job kind {}", rec.view.name)))?;
    jobs::set_state(&ctx.db, job, JobState::Running, None).await?;
    for (i, step) in rec.view.steps.iter().enumerate() {
        if step.state == StepState::Succeeded {
            continue;
        }
        jobs::step_started(&ctx.db, job, i).await?;
        let fresh = jobs::get(&ctx.db, job).await?;
        let started = std::time::Instant::now();
        let result = match saga.action(ctx, &fresh, &step.name).await {
            Ok(()) => fault(ctx, &rec.view.name, &step.name),
            Err(e) => Err(e),
        };
        ctx.metrics
            .step(&rec.view.name, &step.name, started.elapsed());
        match result {
            Ok(()) => jobs::step_ended(&ctx.db, job, i, StepState::Succeeded, None).await?,
            Err(e) => {
                tracing::warn!(%job, step = %step.name, error = %e, "job step failed");
                jobs::step_ended(&ctx.db, job, i, StepState::Failed, Some(&e)).await?;
                let undo_errors = unwind(ctx, job).await?;
                let mut error = format!("{} failed: {e}", step.name);
                if !undo_errors.is_empty() {
                    error.push_str(&format!("; undo failed: {}", undo_errors.join("; ")));
                }
                let fresh = jobs::get(&ctx.db, job).await?;
                if let Err(e2) = saga.on_failed(ctx, &fresh, &error).await {
                    error.push_str(&format!("; cleanup failed: {e2}"));
                }
                jobs::set_state(&ctx.db, job, JobState::Failed, Some(&error)).await?;
                return Ok(());
            }
        }
    }
    jobs::set_state(&ctx.db, job, JobState::Succeeded, None).await?;
    Ok(())
}

/// Runs the undo of every step that started, newest first. Undos are idempotent: calling
/// this again on an unwound job changes nothing. Returns the undos that failed.
pub async fn unwind(ctx: &Ctx, job: JobId) -> ApiResult<Vec<String>> {
    let rec = jobs::get(&ctx.db, job).await?;
    let saga = Saga::of(&rec.view.name)
        .ok_or_else(|| ApiError::internal(format!("unknown job kind {}", rec.view.name)))?;
    let mut errors = Vec::new();
    for (i, step) in rec.view.steps.iter().enumerate().rev() {
        if step.started_at.is_none() {
            continue;
        }
        match saga.undo(ctx, &rec, &step.name).await {
            Ok(()) => jobs::step_ended(&ctx.db, job, i, StepState::Undone, None).await?,
            Err(e) => {
                tracing::warn!(%job, step = %step.name, error = %e, "undo failed");
                errors.push(format!("{}: {e}", step.name));
            }
        }
    }
    Ok(errors)
}

/// Jobs left unfinished by a previous run of the server: resume each.
pub async fn resume_all(ctx: &Ctx) -> ApiResult<usize> {
    let pending = jobs::unfinished(&ctx.db).await?;
    let n = pending.len();
    for (job, name) in pending {
        tracing::info!(%job, %name, "resuming job");
        spawn(ctx.clone(), job);
    }
    Ok(n)
}
