//! Scrubbing: dirty → cleaning → (agent scrubs, reports each step) → unassigned, or
//! quarantined when any step failed or no report came.

use super::{Run, StepError, Workflow, agent_task, new_job};
use crate::services::Ctx;
use crate::services::device_log;
use crate::store::device_moves::{DeviceWrite, MoveReq, Moved};
use crate::store::{StoreError, StoreResult, devices, jobs};
use passage_model::jobs::{JobKind, ScrubStep};
use passage_model::protocol::Task;
use passage_model::{DeviceEvent, DevicePath, JobId, ServerId};
use serde::{Deserialize, Serialize};

/// Dirty devices of one server, scrubbed.
pub struct Scrub;

#[derive(Serialize, Deserialize)]
pub struct ScrubPayload {
    server: ServerId,
    devices: Vec<String>,
}

impl Workflow for Scrub {
    const KIND: JobKind = JobKind::Scrub;
    type Step = ScrubStep;
    type Payload = ScrubPayload;

    async fn action(ctx: &Ctx, run: &Run<Self>, step: ScrubStep) -> Result<(), StepError> {
        match step {
            ScrubStep::Scrub => {
                let p = &run.payload;
                scrub_devices(ctx, p.server, Some(run.job), &p.devices).await
            }
        }
    }
}

/// Starts a job that scrubs these devices of one server.
pub async fn start_job(ctx: &Ctx, server: ServerId, ids: &[String]) -> StoreResult<JobId> {
    let job = JobId::new_random();
    let payload = ScrubPayload {
        server,
        devices: ids.to_vec(),
    };
    let new = new_job::<Scrub>(job, None, None, &payload)
        .map_err(|e| StoreError::Corrupt(e.to_string()))?;
    // Through the shared pool, not the job steps' lane: an operator's requeue starts this
    // from a request, which must not queue behind the steps of running jobs.
    jobs::insert(&ctx.db, new).await?;
    super::spawn(ctx.clone(), job);
    Ok(job)
}

/// Scrubs those of `ids` that are dirty, and those `job` left `cleaning` when it stopped
/// (`MoveReq::scrub_start`). Each device's outcome follows its own report.
pub async fn scrub_devices(
    ctx: &Ctx,
    server: ServerId,
    job: Option<JobId>,
    ids: &[String],
) -> Result<(), StepError> {
    let start = DeviceWrite {
        moves: vec![MoveReq::scrub_start(server, ids, job)],
        ..DeviceWrite::default()
    };
    let started: Vec<Moved> = device_log::write(ctx, start)
        .await?
        .into_iter()
        .flatten()
        .collect();
    let resumed = started.iter().filter(|m| m.from == m.to).count();
    if resumed > 0 {
        tracing::info!(%server, devices = resumed, ?job,
            "devices this job left cleaning are scrubbed again");
    }
    let ids: Vec<String> = started.into_iter().map(|m| m.id).collect();
    if ids.is_empty() {
        return Ok(());
    }
    super::runner::pause_point(ctx, "scrub.started").await;
    let paths: Vec<DevicePath> = ids.iter().filter_map(|id| id.parse().ok()).collect();
    let failed = match scrub_started(ctx, server, job, &ids, paths).await {
        Ok(failed) => failed,
        Err(e) => {
            // Whatever stopped it after the start (no answer from the node, a write that
            // failed): the devices it left `cleaning` go back to dirty, for this step's
            // retry or the reconciler. A retry starts only dirty devices, so one left
            // `cleaning` stayed there for good: a fleet run ended with a device
            // `cleaning` whose destroy had succeeded.
            tracing::warn!(%server, error = %e, "scrub stopped after its start");
            devices::move_devices(
                &ctx.jobs_db,
                server,
                &ids,
                DeviceEvent::ScrubAborted,
                None,
                &format!("scrub interrupted: {e}"),
            )
            .await?;
            return Err(e);
        }
    };
    close_free_gpus(ctx, server, &ids).await?;
    if failed.is_empty() {
        Ok(())
    } else {
        Err(StepError::Refused(format!(
            "devices quarantined: {}",
            failed.join("; ")
        )))
    }
}

/// The scrub of `ids`, moved to `cleaning`: the node's pipelines and each device's
/// outcome. Answers the devices quarantined, with why.
async fn scrub_started(
    ctx: &Ctx,
    server: ServerId,
    job: Option<JobId>,
    ids: &[String],
    paths: Vec<DevicePath>,
) -> Result<Vec<String>, StepError> {
    let task = Task::Scrub {
        pipelines: pipelines(ctx, server, ids).await?,
        devices: paths,
    };
    // Its reports are recorded with its id.
    let task_id = passage_model::TaskId::new_ordered();
    // No answer: the scrub may not have run (the caller puts the devices back to dirty).
    let task_result = agent_task::run_raw_as(ctx, server, job, task_id, task).await?;
    let mut failed = Vec::new();
    let mut outcome = DeviceWrite::default();
    for id in ids {
        let report = task_result
            .scrub_reports
            .iter()
            .find(|r| r.device.to_string() == *id);
        let (event, reason) = match report {
            Some(r) if r.ok => (DeviceEvent::ScrubSucceeded, "scrub succeeded".to_string()),
            Some(r) => {
                let bad: Vec<&str> = r
                    .steps
                    .iter()
                    .filter(|s| !s.ok)
                    .map(|s| s.name.as_str())
                    .collect();
                (
                    DeviceEvent::ScrubFailed,
                    format!("scrub step(s) failed: {}", bad.join(", ")),
                )
            }
            None => (
                DeviceEvent::ScrubFailed,
                "the node sent no scrub report for this device".to_string(),
            ),
        };
        if let Some(r) = report {
            outcome.reports.push((server, task_id, r.clone()));
        }
        if event == DeviceEvent::ScrubFailed {
            failed.push(format!("{id}: {reason}"));
        }
        outcome.moves.push(MoveReq::new(
            server,
            std::slice::from_ref(id),
            event,
            None,
            &reason,
        ));
    }
    device_log::write(ctx, outcome).await?;
    Ok(failed)
}

/// Closes the GPUs of those of `ids` that are vGPU slots once all their slots are free
/// (`store::vgpus::close_idle`), and starts the full scrub of the GPUs closed.
pub async fn close_free_gpus(ctx: &Ctx, server: ServerId, ids: &[String]) -> StoreResult<()> {
    let gpus = crate::store::vgpus::parents_of(ids);
    let closed = crate::store::vgpus::close_idle(&ctx.jobs_db, server, &gpus).await?;
    if !closed.is_empty() {
        start_job(ctx, server, &closed).await?;
    }
    Ok(())
}

/// Each device's pipeline from its variant; devices whose variant names none are left to
/// the agent's default.
async fn pipelines(
    ctx: &Ctx,
    server: ServerId,
    ids: &[String],
) -> Result<std::collections::BTreeMap<String, Vec<passage_model::protocol::ScrubAction>>, StepError>
{
    // Only the devices scrubbed: a server's whole device list per scrub was most of
    // what a fleet's destroys read.
    Ok(devices::scrub_pipelines(&ctx.jobs_db, server, ids)
        .await?
        .into_iter()
        .collect())
}
