//! A VM's life after provisioning: stop, start, and the replacement of its devices that
//! a resize (another package) or a cold migration (another server) needs.

use super::provision::{server_of, spec};
use super::{Run, StepError, Workflow, agent_task, scrub};
use crate::services::Ctx;
use crate::store::{devices, vms};
use passage_model::api::VmState;
use passage_model::jobs::{JobKind, ReplaceStep, StartStep, StopStep};
use passage_model::protocol::Task;
use passage_model::{DeviceEvent, DevicePath, PackageId, ServerId};
use serde::{Deserialize, Serialize};

pub struct Stop;

impl Workflow for Stop {
    const KIND: JobKind = JobKind::Stop;
    type Step = StopStep;
    type Payload = ();
    const LEADS_TO: Option<VmState> = Some(VmState::Stopped);

    async fn action(ctx: &Ctx, run: &Run<Self>, step: StopStep) -> Result<(), StepError> {
        let vm = run.vm(ctx).await?;
        let server = server_of(&vm)?;
        match step {
            StopStep::Stop => {
                let task = Task::StopVm { vm_uuid: vm.uuid };
                agent_task::run(ctx, server, Some(run.job), task).await?;
                vms::set_state(
                    &ctx.jobs_db,
                    vm.uuid,
                    &[VmState::Running, VmState::Stopped],
                    VmState::Stopped,
                )
                .await?;
                Ok(())
            }
        }
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
