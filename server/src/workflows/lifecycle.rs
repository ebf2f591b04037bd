//! A VM's life after provisioning: stop, start, and the replacement of its devices that
//! a resize (another package) or a cold migration (another server) needs.

use super::provision::vm_of;
use super::{agent_task, scrub};
use crate::services::Ctx;
use crate::store::jobs::JobRecord;
use crate::store::{devices, vms};
use passage_model::api::VmState;
use passage_model::protocol::{Task, VmSpec};
use passage_model::{DeviceEvent, DevicePath, PackageId, ServerId};
use serde::{Deserialize, Serialize};

pub const STOP_STEPS: &[&str] = &["stop"];
pub const START_STEPS: &[&str] = &["bind", "launch"];
pub const REPLACE_STEPS: &[&str] = &["reserve", "bind", "commit", "unbind", "scrub"];

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

fn plan_of(job: &JobRecord) -> Result<Plan, String> {
    serde_json::from_str(job.payload.as_deref().unwrap_or(""))
        .map_err(|e| format!("the job's plan is unreadable: {e}"))
}

fn strings(d: &[DevicePath]) -> Vec<String> {
    d.iter().map(ToString::to_string).collect()
}

pub(super) async fn stop(ctx: &Ctx, job: &JobRecord, step: &str) -> Result<(), String> {
    let vm = vm_of(ctx, job).await?;
    let server = vm.server_uuid.ok_or("the VM has no server")?;
    if step != "stop" {
        return Err(format!("unknown stop step {step}"));
    }
    let task = Task::StopVm { vm_uuid: vm.uuid };
    agent_task::run(ctx, server, Some(job.view.uuid), task).await?;
    vms::set_state(
        &ctx.jobs_db,
        vm.uuid,
        &[VmState::Running, VmState::Stopped],
        VmState::Stopped,
    )
    .await
    .map_err(|e| e.to_string())?;
    Ok(())
}

pub(super) async fn start(ctx: &Ctx, job: &JobRecord, step: &str) -> Result<(), String> {
    let vm = vm_of(ctx, job).await?;
    let server = vm.server_uuid.ok_or("the VM has no server")?;
    let job_id = Some(job.view.uuid);
    match step {
        // Idempotent on the node, and needed after a node reboot or a migration.
        "bind" if vm.assigned_devices.is_empty() => Ok(()),
        "bind" => {
            let task = Task::BindPassthrough {
                vm_uuid: vm.uuid,
                devices: vm.assigned_devices.clone(),
            };
            agent_task::run(ctx, server, job_id, task).await.map(drop)
        }
        "launch" => {
            let task = Task::StartVm {
                vm: VmSpec {
                    uuid: vm.uuid,
                    vcpus: vm.vcpus,
                    memory_mib: vm.memory_mib,
                    devices: vm.assigned_devices.clone(),
                },
            };
            agent_task::run(ctx, server, job_id, task).await?;
            vms::set_state(
                &ctx.jobs_db,
                vm.uuid,
                &[VmState::Stopped, VmState::Running],
                VmState::Running,
            )
            .await
            .map_err(|e| e.to_string())?;
            Ok(())
        }
        other => Err(format!("unknown start step {other}")),
    }
}

pub(super) async fn start_undo(ctx: &Ctx, job: &JobRecord, step: &str) -> Result<(), String> {
    let vm = vm_of(ctx, job).await?;
    let server = vm.server_uuid.ok_or("the VM has no server")?;
    if step == "launch" {
        let task = Task::StopVm { vm_uuid: vm.uuid };
        agent_task::run(ctx, server, Some(job.view.uuid), task).await?;
        vms::set_state(&ctx.jobs_db, vm.uuid, &[VmState::Running], VmState::Stopped)
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

pub(super) async fn replace(ctx: &Ctx, job: &JobRecord, step: &str) -> Result<(), String> {
    let vm = vm_of(ctx, job).await?;
    let plan = plan_of(job)?;
    let job_id = Some(job.view.uuid);
    match step {
        "reserve" => {
            let held = devices::held_by(&ctx.jobs_db, vm.uuid)
                .await
                .map_err(|e| e.to_string())?;
            let missing: Vec<&DevicePath> = plan
                .add
                .iter()
                .filter(|d| {
                    !held
                        .iter()
                        .any(|h| h.pci.id == **d && h.server_uuid == plan.to_server)
                })
                .collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "{} new device(s) are no longer reserved",
                    missing.len()
                ))
            }
        }
        "bind" if plan.add.is_empty() => Ok(()),
        "bind" => {
            let task = Task::BindPassthrough {
                vm_uuid: vm.uuid,
                devices: plan.add.clone(),
            };
            agent_task::run(ctx, plan.to_server, job_id, task)
                .await
                .map(drop)
        }
        "commit" => {
            let mut assigned = plan.keep.clone();
            assigned.extend(plan.add.iter().cloned());
            vms::commit_replacement(
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
            .await
            .map_err(|e| e.to_string())
        }
        "unbind" if plan.remove.is_empty() => Ok(()),
        "unbind" => {
            let task = Task::UnbindPassthrough {
                vm_uuid: vm.uuid,
                devices: plan.remove.clone(),
            };
            agent_task::run(ctx, plan.from_server, job_id, task)
                .await
                .map(drop)
        }
        "scrub" => {
            scrub::scrub_devices(ctx, plan.from_server, job_id, &strings(&plan.remove)).await
        }
        other => Err(format!("unknown replace step {other}")),
    }
}

/// Before `commit` a failed replacement gives back what it reserved; after it, the VM has
/// its new devices and what is left (unbinding, scrubbing the old ones) is finished by the
/// reconciler rather than undone.
pub(super) async fn replace_undo(ctx: &Ctx, job: &JobRecord, step: &str) -> Result<(), String> {
    let committed = job
        .view
        .steps
        .iter()
        .any(|s| s.name == "commit" && s.state == passage_model::api::StepState::Succeeded);
    if committed {
        return Ok(());
    }
    let vm = vm_of(ctx, job).await?;
    let plan = plan_of(job)?;
    match step {
        "reserve" => devices::move_devices(
            &ctx.jobs_db,
            plan.to_server,
            &strings(&plan.add),
            DeviceEvent::CancelUnused,
            Some(vm.uuid),
            &format!("resize or migration of VM {} unwound", vm.uuid),
        )
        .await
        .map(drop)
        .map_err(|e| e.to_string()),
        "bind" if plan.add.is_empty() => Ok(()),
        "bind" => {
            let task = Task::UnbindPassthrough {
                vm_uuid: vm.uuid,
                devices: plan.add.clone(),
            };
            agent_task::run(ctx, plan.to_server, Some(job.view.uuid), task)
                .await
                .map(drop)
        }
        _ => Ok(()),
    }
}
