//! A VM's life after provisioning: stop (a clean one: the guest asked to shut down, then
//! given its grace, unless forced), reboot (a stop and a start in one job), start, and
//! the replacement of its devices that a resize (another package) or a cold migration
//! (another server) needs.

use super::provision::{server_of, spec};
use super::{Run, StepError, Workflow, agent_task, scrub};
use crate::services::Ctx;
use crate::store::{devices, jobs, vms};
use passage_model::api::{Vm, VmState};
use passage_model::jobs::{JobKind, RebootStep, ReplaceStep, StartStep, StopStep};
use passage_model::protocol::Task;
use passage_model::{DeviceEvent, DevicePath, JobId, PackageId, ServerId, VmId};
use serde::{Deserialize, Serialize};

/// What a stop or a reboot does to its VM's guest, fixed when it is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopPlan {
    /// Power the VM off at once, without asking the guest.
    pub force: bool,
    /// How long the guest has to shut down once asked (its package's, capped by the
    /// server's limit).
    pub grace_s: u32,
}

impl Default for StopPlan {
    /// A stop job written before clean stops were (no payload): a clean stop with the
    /// default grace.
    fn default() -> Self {
        StopPlan {
            force: false,
            grace_s: passage_model::api::DEFAULT_STOP_GRACE_S,
        }
    }
}

/// How long a stop waits for a node that has not polled since this server started, to
/// learn whether its agent can ask a guest to shut down.
const NODE_POLL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether `server`'s agent runs `shutdown_vm`; a node not heard from since this server
/// started is given a moment to poll first.
async fn asks_guests(ctx: &Ctx, server: ServerId) -> bool {
    let deadline = tokio::time::Instant::now() + NODE_POLL_WAIT;
    loop {
        if crate::services::agents::runs(ctx, server, Task::SHUTDOWN_VM) {
            return true;
        }
        if crate::services::agents::polled(ctx, server) || tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Ends the VM on its node as `plan` says, and answers what happened, in words: the
/// guest asked to shut down and given its grace, or powered off at once; `None` when the
/// VM was found stopped already.
async fn end_vm(
    ctx: &Ctx,
    job: JobId,
    vm: VmId,
    server: ServerId,
    plan: StopPlan,
) -> Result<Option<String>, StepError> {
    if plan.force {
        agent_task::run(ctx, server, Some(job), Task::StopVm { vm_uuid: vm }).await?;
        return Ok(Some("forced power off".to_string()));
    }
    if !asks_guests(ctx, server).await {
        agent_task::run(ctx, server, Some(job), Task::StopVm { vm_uuid: vm }).await?;
        return Ok(Some(
            "powered off: the node's agent is too old to ask the guest to shut down".to_string(),
        ));
    }
    let task = Task::ShutdownVm {
        vm_uuid: vm,
        grace_s: plan.grace_s,
    };
    let r = agent_task::run(ctx, server, Some(job), task).await?;
    Ok(match r.shutdown {
        // A step run again (after a restart) finds the VM it stopped: what it said the
        // first time stands.
        Some(passage_model::protocol::Shutdown::NotRunning) => None,
        Some(s) => Some(s.describe()),
        None => Some("stopped".to_string()),
    })
}

/// A stop step's work for a VM that shows `stopping`: the VM ended as `plan` says, the
/// step's detail written (step `idx` of the job), the VM `stopped`.
async fn stop_step(
    ctx: &Ctx,
    job: JobId,
    idx: usize,
    vm: &Vm,
    plan: StopPlan,
) -> Result<(), StepError> {
    let server = server_of(vm)?;
    if let Some(detail) = end_vm(ctx, job, vm.uuid, server, plan).await? {
        jobs::set_step_detail(&ctx.jobs_db, job, idx, &detail).await?;
    }
    vms::set_state(
        &ctx.jobs_db,
        vm.uuid,
        &[VmState::Stopping, VmState::Running, VmState::Stopped],
        VmState::Stopped,
    )
    .await?;
    Ok(())
}

/// A stop that failed leaves the VM as it was: running (the reconciler marks it stopped
/// if its node stops reporting it).
async fn stop_failed(ctx: &Ctx, vm: Option<VmId>) -> Result<(), StepError> {
    if let Some(vm) = vm {
        vms::set_state(&ctx.jobs_db, vm, &[VmState::Stopping], VmState::Running).await?;
    }
    Ok(())
}

pub struct Stop;

impl Workflow for Stop {
    const KIND: JobKind = JobKind::Stop;
    type Step = StopStep;
    /// `None` in a job written before clean stops: [`StopPlan::default`].
    type Payload = Option<StopPlan>;
    const LEADS_TO: Option<VmState> = Some(VmState::Stopped);

    async fn action(ctx: &Ctx, run: &Run<Self>, step: StopStep) -> Result<(), StepError> {
        let vm = run.vm(ctx).await?;
        match step {
            StopStep::Stop => {
                let plan = run.payload.unwrap_or_default();
                stop_step(ctx, run.job, 0, &vm, plan).await
            }
        }
    }

    async fn on_failed(ctx: &Ctx, run: &Run<Self>, _error: &str) -> Result<(), StepError> {
        stop_failed(ctx, run.vm).await
    }
}

/// A clean stop then a start, in one job: the VM keeps its devices, disk and addresses
/// throughout.
pub struct Reboot;

impl Workflow for Reboot {
    const KIND: JobKind = JobKind::Reboot;
    type Step = RebootStep;
    type Payload = StopPlan;
    const LEADS_TO: Option<VmState> = Some(VmState::Running);

    async fn action(ctx: &Ctx, run: &Run<Self>, step: RebootStep) -> Result<(), StepError> {
        let vm = run.vm(ctx).await?;
        let server = server_of(&vm)?;
        let job = Some(run.job);
        match step {
            RebootStep::Stop => stop_step(ctx, run.job, 0, &vm, run.payload).await,
            RebootStep::Start => {
                // Each part is idempotent on the node: bound devices stay bound, a disk
                // that is there stays, a running VM with the same spec is left alone.
                if crate::services::agents::runs(ctx, server, Task::BOOT_VM) {
                    super::provision::boot(ctx, server, job, &vm).await?;
                } else {
                    if !vm.assigned_devices.is_empty() {
                        let task = Task::BindPassthrough {
                            vm_uuid: vm.uuid,
                            devices: vm.assigned_devices.clone(),
                            vgpu_types: super::provision::vgpu_types(
                                ctx,
                                server,
                                &vm.assigned_devices,
                            )
                            .await?,
                        };
                        agent_task::run(ctx, server, job, task).await?;
                    }
                    super::disk::fetch(ctx, server, job, &vm).await?;
                    let disk = super::disk::spec(ctx, &vm).await?;
                    let task = Task::StartVm {
                        vm: spec(ctx, &vm, disk).await?,
                    };
                    agent_task::run(ctx, server, job, task).await?;
                }
                vms::set_state(
                    &ctx.jobs_db,
                    vm.uuid,
                    &[VmState::Stopped, VmState::Running],
                    VmState::Running,
                )
                .await?;
                Ok(())
            }
        }
    }

    async fn undo(ctx: &Ctx, run: &Run<Self>, step: RebootStep) -> Result<(), StepError> {
        match step {
            // Nothing to take back: a stopped VM stays stopped.
            RebootStep::Stop => Ok(()),
            // A start that failed part way: the VM is stopped, as the stop left it.
            RebootStep::Start => {
                let vm = run.vm(ctx).await?;
                let server = server_of(&vm)?;
                let task = Task::StopVm { vm_uuid: vm.uuid };
                agent_task::run(ctx, server, Some(run.job), task).await?;
                vms::set_state(&ctx.jobs_db, vm.uuid, &[VmState::Running], VmState::Stopped)
                    .await?;
                Ok(())
            }
        }
    }

    async fn on_failed(ctx: &Ctx, run: &Run<Self>, _error: &str) -> Result<(), StepError> {
        stop_failed(ctx, run.vm).await
    }
}

pub struct Start;

impl Workflow for Start {
    const KIND: JobKind = JobKind::Start;
    type Step = StartStep;
    type Payload = ();
    const LEADS_TO: Option<VmState> = Some(VmState::Running);

    async fn ahead(ctx: &Ctx, run: &Run<Self>, step: StartStep) -> Vec<StartStep> {
        match step {
            StartStep::Bind => {
                let later = [StartStep::FetchImage, StartStep::Launch];
                run.ahead_if_node_runs(ctx, Task::BOOT_VM, &later).await
            }
            _ => Vec::new(),
        }
    }

    fn failed_at(run: &Run<Self>, step: StartStep, e: &StepError) -> StartStep {
        use StartStep::{FetchImage, Launch};
        let parts = [(Task::FETCH_IMAGE, FetchImage), (Task::START_VM, Launch)];
        run.failed_part(step, e, Task::BOOT_VM, &parts)
    }

    async fn action(ctx: &Ctx, run: &Run<Self>, step: StartStep) -> Result<(), StepError> {
        let vm = run.vm(ctx).await?;
        let server = server_of(&vm)?;
        let job = Some(run.job);
        match step {
            StartStep::Bind if run.does_too(StartStep::Launch) => {
                super::provision::boot(ctx, server, job, &vm).await
            }
            StartStep::FetchImage if run.was_done_ahead(step) => Ok(()),
            // Idempotent on the node, and needed after a node reboot or a migration.
            StartStep::Bind if vm.assigned_devices.is_empty() => Ok(()),
            StartStep::Bind => {
                let task = Task::BindPassthrough {
                    vm_uuid: vm.uuid,
                    devices: vm.assigned_devices.clone(),
                    vgpu_types: super::provision::vgpu_types(ctx, server, &vm.assigned_devices)
                        .await?,
                };
                agent_task::run(ctx, server, job, task).await.map(drop)
            }
            // After a node lost its cache (or the disk), it is made again.
            StartStep::FetchImage => super::disk::fetch(ctx, server, job, &vm).await,
            StartStep::Launch => {
                // Started with the bind, or now.
                if !run.was_done_ahead(step) {
                    let disk = super::disk::spec(ctx, &vm).await?;
                    let task = Task::StartVm {
                        vm: spec(ctx, &vm, disk).await?,
                    };
                    agent_task::run(ctx, server, job, task).await?;
                }
                vms::set_state(
                    &ctx.jobs_db,
                    vm.uuid,
                    &[VmState::Stopped, VmState::Running],
                    VmState::Running,
                )
                .await?;
                Ok(())
            }
        }
    }

    async fn undo(ctx: &Ctx, run: &Run<Self>, step: StartStep) -> Result<(), StepError> {
        match step {
            // The devices stay bound for the stopped VM, as a stop leaves them.
            StartStep::Bind => Ok(()),
            // Never deletes the disk: it holds the VM's data.
            StartStep::FetchImage => Ok(()),
            StartStep::Launch => {
                let vm = run.vm(ctx).await?;
                let server = server_of(&vm)?;
                let task = Task::StopVm { vm_uuid: vm.uuid };
                agent_task::run(ctx, server, Some(run.job), task).await?;
                vms::set_state(&ctx.jobs_db, vm.uuid, &[VmState::Running], VmState::Stopped)
                    .await?;
                Ok(())
            }
        }
    }
}

/// What a resize or migration will do, fixed when it is asked for.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Plan {
    pub from_server: ServerId,
    pub to_server: ServerId,
    pub keep: Vec<DevicePath>,
    pub add: Vec<DevicePath>,
    pub remove: Vec<DevicePath>,
    pub package: Option<PackageId>,
    pub vcpus: u32,
    pub memory_mib: u64,
}

fn strings(d: &[DevicePath]) -> Vec<String> {
    d.iter().map(ToString::to_string).collect()
}

/// Another package for a stopped VM.
pub struct Resize;

/// A stopped VM to another server.
pub struct Migrate;

impl Workflow for Resize {
    const KIND: JobKind = JobKind::Resize;
    type Step = ReplaceStep;
    type Payload = Plan;

    async fn action(ctx: &Ctx, run: &Run<Self>, step: ReplaceStep) -> Result<(), StepError> {
        replace(ctx, run.job, &run.vm(ctx).await?, &run.payload, step).await
    }

    async fn undo(ctx: &Ctx, run: &Run<Self>, step: ReplaceStep) -> Result<(), StepError> {
        replace_undo(ctx, run.job, &run.vm(ctx).await?, &run.payload, step).await
    }
}

impl Workflow for Migrate {
    const KIND: JobKind = JobKind::Migrate;
    type Step = ReplaceStep;
    type Payload = Plan;

    async fn action(ctx: &Ctx, run: &Run<Self>, step: ReplaceStep) -> Result<(), StepError> {
        replace(ctx, run.job, &run.vm(ctx).await?, &run.payload, step).await
    }

    async fn undo(ctx: &Ctx, run: &Run<Self>, step: ReplaceStep) -> Result<(), StepError> {
        replace_undo(ctx, run.job, &run.vm(ctx).await?, &run.payload, step).await
    }
}

async fn replace(
    ctx: &Ctx,
    job: passage_model::JobId,
    vm: &passage_model::api::Vm,
    plan: &Plan,
    step: ReplaceStep,
) -> Result<(), StepError> {
    let job = Some(job);
    match step {
        ReplaceStep::Reserve => {
            let held = devices::held_by(&ctx.jobs_db, vm.uuid).await?;
            let missing = plan
                .add
                .iter()
                .filter(|d| {
                    !held
                        .iter()
                        .any(|h| h.pci.id == **d && h.server_uuid == plan.to_server)
                })
                .count();
            if missing == 0 {
                Ok(())
            } else {
                Err(StepError::Refused(format!(
                    "{missing} new device(s) are no longer reserved"
                )))
            }
        }
        ReplaceStep::Bind if plan.add.is_empty() => Ok(()),
        ReplaceStep::Bind => {
            let task = Task::BindPassthrough {
                vm_uuid: vm.uuid,
                devices: plan.add.clone(),
                vgpu_types: super::provision::vgpu_types(ctx, plan.to_server, &plan.add).await?,
            };
            agent_task::run(ctx, plan.to_server, job, task)
                .await
                .map(drop)
        }
        ReplaceStep::Commit => {
            let mut assigned = plan.keep.clone();
            assigned.extend(plan.add.iter().cloned());
            Ok(vms::commit_replacement(
                &ctx.jobs_db,
                vm.uuid,
                vms::Replacement {
                    from_server: plan.from_server,
                    to_server: plan.to_server,
                    added: &strings(&plan.add),
                    removed: &strings(&plan.remove),
                    assigned: &strings(&assigned),
                    package: plan.package,
                    vcpus: plan.vcpus,
                    memory_mib: plan.memory_mib,
                },
            )
            .await?)
        }
        ReplaceStep::Unbind if plan.remove.is_empty() => Ok(()),
        ReplaceStep::Unbind => {
            let task = Task::UnbindPassthrough {
                vm_uuid: vm.uuid,
                devices: plan.remove.clone(),
            };
            agent_task::run(ctx, plan.from_server, job, task)
                .await
                .map(drop)
        }
        ReplaceStep::Scrub => {
            scrub::scrub_devices(ctx, plan.from_server, job, &strings(&plan.remove)).await
        }
    }
}

/// Whether the VM row has the plan's outcome already: `commit` ran. Asked of the row, not
/// of the step's record, which an unwind marks undone: a second unwind must not take
/// back the devices of a VM that uses them.
fn committed(vm: &passage_model::api::Vm, plan: &Plan) -> bool {
    let mut now: Vec<&DevicePath> = vm.assigned_devices.iter().collect();
    let mut after: Vec<&DevicePath> = plan.keep.iter().chain(&plan.add).collect();
    now.sort();
    after.sort();
    vm.server_uuid == Some(plan.to_server) && now == after
}

/// Before `commit` a failed replacement gives back what it reserved; after it, the VM has
/// its new devices and what is left (unbinding, scrubbing the old ones) is finished by the
/// reconciler rather than undone.
async fn replace_undo(
    ctx: &Ctx,
    job: passage_model::JobId,
    vm: &passage_model::api::Vm,
    plan: &Plan,
    step: ReplaceStep,
) -> Result<(), StepError> {
    if committed(vm, plan) {
        return Ok(());
    }
    match step {
        ReplaceStep::Reserve => {
            devices::move_devices(
                &ctx.jobs_db,
                plan.to_server,
                &strings(&plan.add),
                DeviceEvent::CancelUnused,
                Some(vm.uuid),
                &format!("resize or migration of VM {} unwound", vm.uuid),
            )
            .await?;
            super::scrub::close_free_gpus(ctx, plan.to_server, &strings(&plan.add)).await?;
            Ok(())
        }
        ReplaceStep::Bind if plan.add.is_empty() => Ok(()),
        ReplaceStep::Bind => {
            let task = Task::UnbindPassthrough {
                vm_uuid: vm.uuid,
                devices: plan.add.clone(),
            };
            agent_task::run(ctx, plan.to_server, Some(job), task)
                .await
                .map(drop)
        }
        ReplaceStep::Commit | ReplaceStep::Unbind | ReplaceStep::Scrub => Ok(()),
    }
}
