//! The job runner: claims a job's lease, runs its steps in order through its workflow,
//! keeps the lease alive, and on a failure unwinds what started, newest first. Steps that
//! already succeeded are skipped, so a job a restart interrupted picks up where it stopped.
//!
//! Test hooks, applied here rather than inside each action: `Config::faults` names steps
//! (`kind.step`) after which a failure is injected, and `Config::repeat_steps` runs every
//! action and every undo twice (the second run must succeed and change nothing).

use super::{Run, StepError, StepsOfKind, Workflow, dispatch};
use crate::error::{ApiError, ApiResult};
use crate::services::{Ctx, job_log};
use crate::store::job_log::{StepRange, StepWrite};
use crate::store::jobs::{self, JobRecord};
use passage_model::JobId;
use passage_model::api::{JobState, StepState, Vm};
use passage_model::jobs::Steps;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Runs a job in the background, unless this process runs it already.
pub fn spawn(ctx: Ctx, job: JobId) {
    spawn_with(ctx, job, None);
}

/// [`spawn`] for a job whose VM the caller has just written, as that write left it: a
/// workflow that keeps its VM ([`Workflow::KEEPS_VM`]) starts from this copy instead of
/// reading the row again (a read per creation and per deletion).
pub fn spawn_with(ctx: Ctx, job: JobId, vm: Option<Vm>) {
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
        if let Err(e) = Box::pin(run_given(&ctx, job, vm)).await {
            tracing::error!(%job, error = %e, "job runner failed");
        }
        drop(permit);
        if let Ok(mut set) = ctx.running_jobs.lock() {
            set.remove(&job);
        }
    });
}

/// Keeps the lease alive while the job runs; `lost` turns true if another replica took it.
fn keep_lease(ctx: &Ctx, job: JobId, lost: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    let ctx = ctx.clone();
    tokio::spawn(async move {
        let every = (ctx.cfg.job_lease / 3).max(Duration::from_millis(100));
        loop {
            tokio::time::sleep(every).await;
            if ctx.stopping.load(Ordering::SeqCst) {
                // The lease was given back for the next start; this runner's work ends
                // with the process.
                lost.store(true, Ordering::SeqCst);
                return;
            }
            match jobs::claim(&ctx.jobs_db, job, &ctx.instance, job_log::lease_until(&ctx)).await {
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

/// Runs (or resumes) a job to its end.
pub async fn run(ctx: &Ctx, job: JobId) -> ApiResult<()> {
    run_given(ctx, job, None).await
}

/// [`run`], with the VM as the write that started the job left it ([`spawn_with`]).
async fn run_given(ctx: &Ctx, job: JobId, vm: Option<Vm>) -> ApiResult<()> {
    if ctx.stopping.load(Ordering::SeqCst) {
        return Ok(());
    }
    ctx.job_pacer.turn(|| ctx.placer.busy()).await;
    // Read once, with the claim: while this runner holds the lease, it alone writes the
    // job's steps, and it keeps its copy in step with what it writes.
    let Some(rec) = job_log::claim(ctx, job).await? else {
        // Finished, or another replica holds it.
        return Ok(());
    };
    let lost = Arc::new(AtomicBool::new(false));
    let lease = keep_lease(ctx, job, lost.clone());
    let r = dispatch!(rec.kind, W => run_claimed::<W>(ctx, rec, &lost, vm).await);
    lease.abort();
    r
}

/// The failure injected after `kind.step`, if the configuration names it.
fn fault<W: Workflow>(ctx: &Ctx, step: W::Step) -> Result<(), StepError> {
    let key = format!("{}.{}", W::KIND, step.name());
    if ctx.cfg.faults.contains(&key) {
        return Err(StepError::Refused(format!("injected fault at {key}")));
    }
    Ok(())
}

/// Runs `step`'s action; a retryable failure is tried again, with a pause that doubles,
/// while the step is younger than the task timeout. With `repeat_steps`, a successful
/// action runs a second time, which must succeed too.
async fn act<W: Workflow>(ctx: &Ctx, run: &Run<W>, step: W::Step) -> Result<(), StepError> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(100);
    loop {
        match W::action(ctx, run, step).await {
            Ok(()) => break,
            Err(StepError::Retryable(e)) if started.elapsed() + pause < ctx.cfg.task_timeout => {
                tracing::info!(job = %run.job, step = step.name(), error = %e, "retrying a step");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e),
        }
    }
    if ctx.cfg.repeat_steps {
        W::action(ctx, run, step)
            .await
            .map_err(|e| StepError::Broken(format!("the action is not idempotent: {e}")))?;
    }
    fault::<W>(ctx, step)
}

async fn run_claimed<W: Workflow>(
    ctx: &Ctx,
    rec: JobRecord,
    lost: &AtomicBool,
    vm: Option<Vm>,
) -> ApiResult<()> {
    let () = StepsOfKind::<W>::CHECK;
    let job = rec.uuid;
    let mut run = match Run::<W>::of(&rec) {
        Ok(r) => r.given(vm),
        Err(e) => {
            // Nothing of it can run or be undone: say why and stop.
            tracing::error!(%job, error = %e, "a job that cannot be read");
            jobs::set_state(&ctx.jobs_db, job, JobState::Failed, Some(e.message())).await?;
            return Ok(());
        }
    };
    // A job that was already unwinding when its runner died goes on unwinding.
    if let Some(failed) = rec
        .steps
        .iter()
        .find(|s| matches!(s.state, StepState::Failed | StepState::Undone))
    {
        let e = failed
            .failure
            .as_ref()
            .map_or("interrupted while unwinding".to_string(), |f| {
                f.message.clone()
            });
        return fail::<W>(ctx, &run, &failed.name, &e).await;
    }
    // Steps that succeeded are written when the next one starts, in the same statement
    // (a crash between the two replays them, as any step may be), or alone before
    // anything that may stop the run here. Several at once where one step did the work
    // of the next ones too (`Workflow::ahead`): those start with it and are not written
    // again until they end.
    let mut ended: Option<StepRange> = None;
    for (i, step) in W::Step::ALL.iter().copied().enumerate() {
        if run.succeeded(step) {
            continue;
        }
        if lost.load(Ordering::SeqCst) {
            if let Some(done) = ended.take() {
                job_log::steps(ctx, StepWrite::ended(job, W::KIND, done)).await?;
            }
            tracing::warn!(%job, "lost the job's lease to another replica; stopping here");
            return Ok(());
        }
        let key = format!("{}.{}", W::KIND, step.name());
        if ctx.cfg.pause_before.as_deref() == Some(key.as_str()) {
            if let Some(done) = ended.take() {
                job_log::steps(ctx, StepWrite::ended(job, W::KIND, done)).await?;
            }
            pause_point(ctx, &key).await;
        }
        // Started with the step that did its work, or one that only looks: nothing to
        // write before it.
        let done_ahead = run.was_done_ahead(step);
        if !done_ahead && W::only_looks(&run, step) {
            run.set(i, StepState::Running);
        } else if !done_ahead {
            ctx.job_pacer.turn(|| ctx.placer.busy()).await;
            let doing = W::ahead(ctx, &run, step).await;
            let last = doing
                .iter()
                .filter_map(|s| W::Step::ALL.iter().position(|a| a == s))
                .fold(i, usize::max);
            job_log::steps(
                ctx,
                StepWrite::advance(job, W::KIND, ended.take(), (i, last)),
            )
            .await?;
            for k in i..=last {
                run.set(k, StepState::Running);
            }
            run.doing = doing;
        }
        let started = Instant::now();
        let result = act(ctx, &run, step).await;
        ctx.metrics
            .step(W::KIND.as_str(), step.name(), started.elapsed());
        match result {
            Ok(()) => {
                ended = Some((ended.map_or(i, |(lo, _)| lo), i));
                run.set(i, StepState::Succeeded);
                let doing = std::mem::take(&mut run.doing);
                run.done_ahead.extend(doing);
            }
            Err(e) => {
                let at = W::failed_at(&run, step, &e);
                let idx = W::Step::ALL.iter().position(|s| *s == at).unwrap_or(i);
                tracing::warn!(%job, step = at.name(), kind = e.kind().as_str(), error = %e,
                    "job step failed");
                jobs::step_ended(
                    &ctx.jobs_db,
                    (job, W::KIND),
                    idx,
                    StepState::Failed,
                    Some(&e.failure()),
                )
                .await?;
                return fail::<W>(ctx, &run, at.name(), e.message()).await;
            }
        }
    }
    job_log::steps(ctx, StepWrite::succeed(job, W::KIND, ended)).await?;
    Ok(())
}

/// Unwinds what the job did and records why it failed.
async fn fail<W: Workflow>(ctx: &Ctx, run: &Run<W>, step: &str, e: &str) -> ApiResult<()> {
    let undo_errors = unwind_as::<W>(ctx, run.job).await?;
    let mut error = format!("{step} failed: {e}");
    if !undo_errors.is_empty() {
        error.push_str(&format!("; undo failed: {}", undo_errors.join("; ")));
    }
    if let Err(e2) = W::on_failed(ctx, run, &error).await {
        error.push_str(&format!("; cleanup failed: {e2}"));
    }
    jobs::set_state(&ctx.jobs_db, run.job, JobState::Failed, Some(&error)).await?;
    Ok(())
}

/// Runs the undo of every step that started, newest first. Undos are idempotent: calling
/// this again on an unwound job changes nothing. Returns the undos that failed.
pub async fn unwind(ctx: &Ctx, job: JobId) -> ApiResult<Vec<String>> {
    let rec = jobs::get(&ctx.jobs_db, job).await?;
    dispatch!(rec.kind, W => unwind_as::<W>(ctx, job).await)
}

async fn unwind_as<W: Workflow>(ctx: &Ctx, job: JobId) -> ApiResult<Vec<String>> {
    // Read again: the undos look at the steps as they stand now.
    let rec = jobs::get(&ctx.jobs_db, job).await?;
    let run = Run::<W>::of(&rec).map_err(|e| ApiError::internal(e.to_string()))?;
    let mut errors = Vec::new();
    for (i, step) in W::Step::ALL.iter().copied().enumerate().rev() {
        if !run.started(step) {
            continue;
        }
        let mut r = W::undo(ctx, &run, step).await;
        if r.is_ok() && ctx.cfg.repeat_steps {
            r = W::undo(ctx, &run, step)
                .await
                .map_err(|e| StepError::Broken(format!("the undo is not idempotent: {e}")));
        }
        match r {
            Ok(()) => {
                jobs::step_ended(&ctx.jobs_db, (job, W::KIND), i, StepState::Undone, None).await?
            }
            Err(e) => {
                tracing::warn!(%job, step = step.name(), error = %e, "undo failed");
                errors.push(format!("{}: {e}", step.name()));
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

/// The test hook `PASSAGE_PAUSE_BEFORE=key` (the durability tests kill the process
/// there): says so on stdout and never returns. `key` is a step's `kind.step`, or a point
/// inside a step such as `scrub.started`.
pub async fn pause_point(ctx: &Ctx, key: &str) {
    if ctx.cfg.pause_before.as_deref() != Some(key) {
        return;
    }
    use std::io::Write;
    let mut out = std::io::stdout();
    let _ = writeln!(out, "passage: paused before {key} (test hook)");
    let _ = out.flush();
    std::future::pending::<()>().await;
}
