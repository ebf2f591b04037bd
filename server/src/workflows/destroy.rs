//! The destroy saga: stop → unbind → release → scrub. Forward only.

use super::provision::vm_of;
use super::{agent_task, scrub};
use crate::services::Ctx;
use crate::store::jobs::JobRecord;
use crate::store::{devices, vms};
use passage_model::DeviceEvent;
use passage_model::api::VmState;
use passage_model::protocol::Task;

pub(super) async fn action(ctx: &Ctx, job: &JobRecord, step: &str) -> Result<(), String> {
    let vm = vm_of(ctx, job).await?;
    let held: Vec<String> = devices::held_by(&ctx.jobs_db, vm.uuid)
        .await
        .map_err(|e| e.to_string())?
        .iter()
        .map(|d| d.pci.id.to_string())
        .collect();
    let Some(server) = vm.server_uuid else {
        // Never placed: nothing on any node to stop or clean.
        if step == "release" {
            vms::release_destroyed(&ctx.jobs_db, vm.uuid, None, &[])
                .await
                .map_err(|e| e.to_string())?;
        }
        return Ok(());
    };
    match step {
        "stop" => {
            agent_task::run(
                ctx,
                server,
                Some(job.view.uuid),
                Task::StopVm { vm_uuid: vm.uuid },
            )
            .await?;
            Ok(())
        }
        "unbind" => {
            if held.is_empty() {
                return Ok(());
            }
            let devices = held
                .iter()
                .filter_map(|d| d.parse().ok())
                .collect::<Vec<_>>();
            agent_task::run(
                ctx,
                server,
                Some(job.view.uuid),
                Task::UnbindPassthrough {
                    vm_uuid: vm.uuid,
                    devices,
                },
            )
            .await?;
            Ok(())
        }
        "release" => vms::release_destroyed(&ctx.jobs_db, vm.uuid, Some(server), &held)
            .await
            .map_err(|e| e.to_string()),
        "scrub" => {
            let ids: Vec<String> = vm.assigned_devices.iter().map(|d| d.to_string()).collect();
            scrub::scrub_devices(ctx, server, Some(job.view.uuid), &ids).await
        }
        other => Err(format!("unknown destroy step {other}")),
    }
}

/// A destroy that failed before `release` leaves a VM whose state on the node is unknown:
/// it is `failed`, and its devices are quarantined (never freed without a scrub).
pub(super) async fn on_failed(ctx: &Ctx, job: &JobRecord, error: &str) -> Result<(), String> {
    let vm = vm_of(ctx, job).await?;
    crate::store::ops::end_usage(&ctx.jobs_db, vm.uuid)
        .await
        .map_err(|e| e.to_string())?;
    if let Some(server) = vm.server_uuid {
        let held: Vec<String> = devices::held_by(&ctx.jobs_db, vm.uuid)
            .await
            .map_err(|e| e.to_string())?
            .iter()
            .map(|d| d.pci.id.to_string())
            .collect();
        devices::move_devices(
            &ctx.jobs_db,
            server,
            &held,
            DeviceEvent::Quarantine,
            Some(vm.uuid),
            &format!("destroy failed: {error}"),
        )
        .await
        .map_err(|e| e.to_string())?;
    }
    vms::set_state(
        &ctx.jobs_db,
        vm.uuid,
        &[VmState::Destroying],
        VmState::Failed,
    )
    .await
    .map_err(|e| e.to_string())?;
    // Released but not scrubbed (the failure came after `release`): scrub now rather than
    // wait for the reconciler.
    if let Some(server) = vm.server_uuid {
        let ids: Vec<String> = vm.assigned_devices.iter().map(|d| d.to_string()).collect();
        let dirty: Vec<String> = devices::for_server(&ctx.jobs_db, server)
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .filter(|d| {
                d.state == passage_model::DeviceState::Dirty && ids.contains(&d.pci.id.to_string())
            })
            .map(|d| d.pci.id.to_string())
            .collect();
        if !dirty.is_empty() {
            scrub::start_job(ctx, server, &dirty)
                .await
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}
