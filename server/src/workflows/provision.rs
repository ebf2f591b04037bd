//! The provision saga: reserve → bind → launch → mark_used.

use super::{agent_task, scrub};
use crate::services::Ctx;
use crate::store::jobs::JobRecord;
use crate::store::{devices, vms};
use passage_model::api::{Vm, VmState};
use passage_model::protocol::{Task, VmSpec};
use passage_model::{DeviceEvent, ServerId};

pub(super) async fn vm_of(ctx: &Ctx, job: &JobRecord) -> Result<Vm, String> {
    let id = job.view.vm_uuid.ok_or("the job has no VM")?;
    vms::get(&ctx.jobs_db, id).await.map_err(|e| e.to_string())
}

fn server_of(vm: &Vm) -> Result<ServerId, String> {
    vm.server_uuid
        .ok_or_else(|| "the VM has no server".to_string())
}

fn ids(vm: &Vm) -> Vec<String> {
    vm.assigned_devices.iter().map(|d| d.to_string()).collect()
}

pub(super) async fn action(ctx: &Ctx, job: &JobRecord, step: &str) -> Result<(), String> {
    let vm = vm_of(ctx, job).await?;
    let server = server_of(&vm)?;
    match step {
        // The reservation was made with the VM row; check it still holds.
        "reserve" => {
            let held = devices::held_by(&ctx.jobs_db, vm.uuid)
                .await
                .map_err(|e| e.to_string())?;
            let mut held: Vec<String> = held.iter().map(|d| d.pci.id.to_string()).collect();
            let mut want = ids(&vm);
            held.sort();
            want.sort();
            if held != want {
                return Err(format!(
                    "the reservation no longer holds: {} of {} devices held",
                    held.len(),
                    want.len()
                ));
            }
            Ok(())
        }
        "bind" => {
            if vm.assigned_devices.is_empty() {
                return Ok(());
            }
            let task = Task::BindPassthrough {
                vm_uuid: vm.uuid,
                devices: vm.assigned_devices.clone(),
            };
            agent_task::run(ctx, server, Some(job.view.uuid), task).await?;
            Ok(())
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
            agent_task::run(ctx, server, Some(job.view.uuid), task).await?;
            Ok(())
        }
        "mark_used" => vms::mark_running(&ctx.jobs_db, vm.uuid, server, &ids(&vm))
            .await
            .map_err(|e| e.to_string()),
        other => Err(format!("unknown provision step {other}")),
    }
}

pub(super) async fn undo(ctx: &Ctx, job: &JobRecord, step: &str) -> Result<(), String> {
    let vm = vm_of(ctx, job).await?;
    let server = server_of(&vm)?;
    match step {
        "reserve" => {
            // Once a launch was tried, a VM may have touched the devices: they must be
            // scrubbed before anyone else gets them.
            let launched = job
                .view
                .steps
                .iter()
                .any(|s| s.name == "launch" && s.started_at.is_some());
            let event = if launched {
                DeviceEvent::Release
            } else {
                DeviceEvent::CancelUnused
            };
            let moved = devices::move_devices(
                &ctx.jobs_db,
                server,
                &ids(&vm),
                event,
                Some(vm.uuid),
                &format!("provision of VM {} unwound", vm.uuid),
            )
            .await
            .map_err(|e| e.to_string())?;
            crate::store::ops::end_usage(&ctx.jobs_db, vm.uuid)
                .await
                .map_err(|e| e.to_string())?;
            if launched && !moved.is_empty() {
                let dirty: Vec<String> = moved.into_iter().map(|m| m.id).collect();
                scrub::start_job(ctx, server, &dirty)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        }
        "bind" => {
            if vm.assigned_devices.is_empty() {
                return Ok(());
            }
            let task = Task::UnbindPassthrough {
                vm_uuid: vm.uuid,
                devices: vm.assigned_devices.clone(),
            };
            agent_task::run(ctx, server, Some(job.view.uuid), task).await?;
            Ok(())
        }
        "launch" => {
            let task = Task::StopVm { vm_uuid: vm.uuid };
            agent_task::run(ctx, server, Some(job.view.uuid), task).await?;
            Ok(())
        }
        // Its effects (devices used, VM running) are undone by `reserve`'s undo and by
        // `on_failed`.
        "mark_used" => Ok(()),
        other => Err(format!("unknown provision step {other}")),
    }
}

/// After the unwind: the VM is `failed`. If an undo could not run, the devices it still
/// holds are quarantined: their state on the node is unknown.
pub(super) async fn on_failed(ctx: &Ctx, job: &JobRecord, error: &str) -> Result<(), String> {
    let vm = vm_of(ctx, job).await?;
    if let Some(server) = vm.server_uuid {
        let still_held = devices::held_by(&ctx.jobs_db, vm.uuid)
            .await
            .map_err(|e| e.to_string())?;
        if !still_held.is_empty() {
            let held: Vec<String> = still_held.iter().map(|d| d.pci.id.to_string()).collect();
            devices::move_devices(
                &ctx.jobs_db,
                server,
                &held,
                DeviceEvent::Quarantine,
                Some(vm.uuid),
                &format!("provision failed and could not be unwound: {error}"),
            )
            .await
            .map_err(|e| e.to_string())?;
        }
    }
    vms::set_state(
        &ctx.jobs_db,
        vm.uuid,
        &[VmState::Provisioning, VmState::Running],
        VmState::Failed,
    )
    .await
    .map_err(|e| e.to_string())?;
    Ok(())
}
