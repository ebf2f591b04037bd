//! Scrubbing: dirty → cleaning → (agent scrubs, reports each step) → unassigned, or
//! quarantined when any step failed or no report came, or when a GPU's memory was not
//! zeroed and verified (unless its variant's scrub policy is `reset-only`).

use super::{Run, StepError, Workflow, agent_task, new_job};
use crate::services::Ctx;
use crate::services::device_log;
use crate::store::device_moves::{DeviceWrite, MoveReq, Moved};
use crate::store::devices::ScrubPlan;
use crate::store::{StoreError, StoreResult, devices, jobs};
use passage_model::jobs::{JobKind, ScrubStep};
use passage_model::protocol::{MAX_SCRUB_STEPS, ScrubAction, ScrubReport, Task};
use passage_model::variant::{DeviceType, ScrubPolicy};
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
    // Only the devices scrubbed: a server's whole device list per scrub was most of
    // what a fleet's destroys read.
    let plans = devices::scrub_plans(&ctx.jobs_db, server, ids).await?;
    let pipelines = plans
        .iter()
        .filter_map(|(id, plan)| Some((id.clone(), pipeline_for(plan)?)))
        .collect();
    let task = Task::Scrub {
        pipelines,
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
        let verdict = judge(plans.get(id), report);
        if let Some(r) = report {
            outcome.reports.push((server, task_id, r.clone()));
        }
        if verdict.event == DeviceEvent::ScrubFailed {
            failed.push(format!("{id}: {}", verdict.reason));
        }
        outcome.moves.push(
            MoveReq::new(
                server,
                std::slice::from_ref(id),
                verdict.event,
                None,
                &verdict.reason,
            )
            .with_note(verdict.note),
        );
    }
    device_log::write(ctx, outcome).await?;
    Ok(failed)
}

/// The steps sent for a device; `None` leaves it to the agent's default for its class.
///
/// A GPU under the `full` policy is zeroed whatever its variant's pipeline says (a
/// pipeline without the step gets it before its closing driver check), since it goes back
/// to the pool only once its memory reads back as zero. Under `reset-only` it is sent its
/// variant's pipeline, or the GPU default, without the zeroing step.
pub(crate) fn pipeline_for(plan: &ScrubPlan) -> Option<Vec<ScrubAction>> {
    if plan.kind != DeviceType::Gpu {
        return plan.pipeline.clone();
    }
    match plan.policy {
        ScrubPolicy::Full => {
            let mut steps = plan.pipeline.clone()?;
            let zeroes = steps.contains(&ScrubAction::ZeroGpuMemory {});
            if !zeroes && steps.len() < MAX_SCRUB_STEPS {
                let at = match steps.last() {
                    Some(ScrubAction::VerifyDriver {}) => steps.len() - 1,
                    _ => steps.len(),
                };
                steps.insert(at, ScrubAction::ZeroGpuMemory {});
            }
            Some(steps)
        }
        ScrubPolicy::ResetOnly => {
            let mut steps = plan.pipeline.clone().unwrap_or_else(|| {
                let mut d = vec![ScrubAction::Reset {}];
                if plan.vendor.eq_ignore_ascii_case("10de") {
                    d.push(ScrubAction::NvidiaReset {});
                }
                d.push(ScrubAction::VerifyDriver {});
                d
            });
            steps.retain(|a| *a != ScrubAction::ZeroGpuMemory {});
            if steps.is_empty() {
                steps.push(ScrubAction::Reset {});
            }
            Some(steps)
        }
    }
}

/// A device's outcome from its node's report.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub event: DeviceEvent,
    /// The device event's reason.
    pub reason: String,
    /// The device's `state_reason` after the move (a quarantine shows `reason` anyway).
    pub note: Option<String>,
}

/// The step that clears a GPU's memory, as the agent names it.
const ZERO_STEP: &str = "zero_gpu_memory";

/// Judges one device's report. A GPU under the `full` policy is clean only when its
/// report has a zeroing step that ran and succeeded: a step that could not run (no
/// helper, no vendor driver) or none at all quarantines it with a reason naming the node
/// and what it lacks, whatever the other steps did.
pub(crate) fn judge(plan: Option<&ScrubPlan>, report: Option<&ScrubReport>) -> Verdict {
    let host = plan.map_or("the node", |p| p.hostname.as_str());
    let failed = |reason: String| Verdict {
        event: DeviceEvent::ScrubFailed,
        reason,
        note: None,
    };
    let Some(r) = report else {
        return failed(format!("{host} sent no scrub report for this device"));
    };
    let detail = |s: &passage_model::protocol::ScrubStep| {
        s.detail.clone().unwrap_or_else(|| "no detail".to_string())
    };
    let gpu = plan.is_some_and(|p| p.kind == DeviceType::Gpu);
    if !r.ok {
        return failed(match r.steps.iter().find(|s| !s.ok) {
            Some(s) if s.name == ZERO_STEP && s.skipped => {
                format!("{host} cannot clear GPU memory: {}", detail(s))
            }
            Some(s) if s.name == ZERO_STEP => {
                format!("{host} could not clear GPU memory: {}", detail(s))
            }
            Some(s) => format!("scrub step {} failed on {host}: {}", s.name, detail(s)),
            None => format!("{host} reported the scrub failed without a failed step"),
        });
    }
    let policy = plan.map_or(ScrubPolicy::Full, |p| p.policy);
    if gpu && policy == ScrubPolicy::Full {
        let zero = r.steps.iter().find(|s| s.name == ZERO_STEP);
        match zero {
            Some(s) if s.ok && !s.skipped => {}
            // An agent that counts a zeroing it could not run as success.
            Some(s) => {
                return failed(format!("{host} cannot clear GPU memory: {}", detail(s)));
            }
            None => {
                return failed(format!(
                    "{host} cannot clear GPU memory: its scrub ran no {ZERO_STEP} step \
                     (the agent knows no zeroing for this GPU)"
                ));
            }
        }
    }
    if gpu && policy == ScrubPolicy::ResetOnly {
        let note = "GPU memory not cleared: the variant's scrub_policy is reset-only \
                    (an operator's choice)";
        return Verdict {
            event: DeviceEvent::ScrubSucceeded,
            reason: format!("scrub succeeded; {note}"),
            note: Some(note.to_string()),
        };
    }
    Verdict {
        event: DeviceEvent::ScrubSucceeded,
        reason: "scrub succeeded".to_string(),
        note: None,
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use ScrubAction::*;
    use passage_model::protocol::ScrubStep as Step;

    fn plan(
        kind: DeviceType,
        policy: ScrubPolicy,
        pipeline: Option<Vec<ScrubAction>>,
    ) -> ScrubPlan {
        ScrubPlan {
            kind,
            pipeline,
            policy,
            vendor: "10de".to_string(),
            hostname: "cn-7".to_string(),
        }
    }

    fn step(name: &str, ok: bool, skipped: bool, detail: &str) -> Step {
        Step {
            name: name.to_string(),
            ok,
            duration_ms: 1,
            detail: Some(detail.to_string()),
            skipped,
        }
    }

    fn report(steps: Vec<Step>) -> ScrubReport {
        ScrubReport {
            device: "/devices/pci0000:00/0000:00:01.0/0000:3b:00.0"
                .parse()
                .unwrap(),
            ok: steps.iter().all(|s| s.ok),
            steps,
        }
    }

    #[test]
    fn gpus_under_full_are_always_zeroed() {
        let gpu = |p| plan(DeviceType::Gpu, ScrubPolicy::Full, p);
        assert_eq!(pipeline_for(&gpu(None)), None, "the agent's default zeroes");
        assert_eq!(
            pipeline_for(&gpu(Some(vec![Reset {}, VerifyDriver {}]))),
            Some(vec![Reset {}, ZeroGpuMemory {}, VerifyDriver {}])
        );
        assert_eq!(
            pipeline_for(&gpu(Some(vec![Reset {}]))),
            Some(vec![Reset {}, ZeroGpuMemory {}])
        );
        let own = vec![ZeroGpuMemory {}, Reset {}];
        assert_eq!(pipeline_for(&gpu(Some(own.clone()))), Some(own));
        // Other types keep their pipeline as it is.
        let nvme = plan(DeviceType::Nvme, ScrubPolicy::Full, Some(vec![Reset {}]));
        assert_eq!(pipeline_for(&nvme), Some(vec![Reset {}]));
        assert_eq!(
            pipeline_for(&plan(DeviceType::Nic, ScrubPolicy::Full, None)),
            None
        );
    }

    #[test]
    fn reset_only_takes_zeroing_out() {
        let gpu = |p| plan(DeviceType::Gpu, ScrubPolicy::ResetOnly, p);
        assert_eq!(
            pipeline_for(&gpu(None)),
            Some(vec![Reset {}, NvidiaReset {}, VerifyDriver {}])
        );
        let mut other = gpu(None);
        other.vendor = "1002".to_string();
        assert_eq!(pipeline_for(&other), Some(vec![Reset {}, VerifyDriver {}]));
        assert_eq!(
            pipeline_for(&gpu(Some(vec![
                Reset {},
                ZeroGpuMemory {},
                VerifyDriver {}
            ]))),
            Some(vec![Reset {}, VerifyDriver {}])
        );
        assert_eq!(
            pipeline_for(&gpu(Some(vec![ZeroGpuMemory {}]))),
            Some(vec![Reset {}])
        );
    }

    #[test]
    fn a_gpu_is_clean_only_once_its_memory_reads_back_as_zero() {
        let full = plan(DeviceType::Gpu, ScrubPolicy::Full, None);
        let ok = |n| step(n, true, false, "fine");
        let zeroed = report(vec![
            ok("reset"),
            ok("zero_gpu_memory"),
            ok("verify_driver"),
        ]);
        assert_eq!(
            judge(Some(&full), Some(&zeroed)),
            Verdict {
                event: DeviceEvent::ScrubSucceeded,
                reason: "scrub succeeded".into(),
                note: None
            }
        );
        // This node cannot clear it: the helper is missing (a failed skip, or an older
        // agent's successful skip), or no zeroing ran at all.
        for zero in [
            step("zero_gpu_memory", false, true, "passage-gpu-zero not found"),
            step("zero_gpu_memory", true, true, "passage-gpu-zero not found"),
        ] {
            let v = judge(Some(&full), Some(&report(vec![ok("reset"), zero])));
            assert_eq!(v.event, DeviceEvent::ScrubFailed);
            assert_eq!(
                v.reason,
                "cn-7 cannot clear GPU memory: passage-gpu-zero not found"
            );
        }
        let v = judge(
            Some(&full),
            Some(&report(vec![ok("reset"), ok("verify_driver")])),
        );
        assert_eq!(v.event, DeviceEvent::ScrubFailed);
        assert!(
            v.reason.starts_with("cn-7 cannot clear GPU memory: "),
            "{v:?}"
        );
        // The read-back failed.
        let bad = step(
            "zero_gpu_memory",
            false,
            false,
            "passage-gpu-zero failed (exit status: 4): not zero",
        );
        let v = judge(Some(&full), Some(&report(vec![ok("reset"), bad])));
        assert_eq!(
            v.reason,
            "cn-7 could not clear GPU memory: passage-gpu-zero failed (exit status: 4): not zero"
        );
        // Any other step names itself.
        let v = judge(
            Some(&full),
            Some(&report(vec![step("reset", false, false, "EIO")])),
        );
        assert_eq!(v.reason, "scrub step reset failed on cn-7: EIO");
        let v = judge(Some(&full), None);
        assert_eq!(v.reason, "cn-7 sent no scrub report for this device");

        // Not a GPU: the steps decide, as before.
        let nic = plan(DeviceType::Nic, ScrubPolicy::Full, None);
        let v = judge(
            Some(&nic),
            Some(&report(vec![ok("reset"), ok("verify_driver")])),
        );
        assert_eq!(v.event, DeviceEvent::ScrubSucceeded);
        assert_eq!(
            judge(None, Some(&report(vec![ok("reset")]))).event,
            DeviceEvent::ScrubSucceeded
        );
    }

    #[test]
    fn reset_only_returns_a_gpu_saying_its_memory_was_not_cleared() {
        let ro = plan(DeviceType::Gpu, ScrubPolicy::ResetOnly, None);
        let ok = |n| step(n, true, false, "fine");
        let v = judge(
            Some(&ro),
            Some(&report(vec![ok("reset"), ok("verify_driver")])),
        );
        assert_eq!(v.event, DeviceEvent::ScrubSucceeded);
        let note = v.note.unwrap_or_default();
        assert!(note.starts_with("GPU memory not cleared"), "{note}");
        assert!(
            note.contains("reset-only") && note.contains("operator's choice"),
            "{note}"
        );
        // A failed reset still quarantines.
        let v = judge(
            Some(&ro),
            Some(&report(vec![step("reset", false, false, "EIO")])),
        );
        assert_eq!(v.event, DeviceEvent::ScrubFailed);
    }
}
