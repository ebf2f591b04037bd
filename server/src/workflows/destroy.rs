//! The destroy saga: stop → unbind → release → scrub. Forward only.

use super::provision::{held, ids};
use super::{Run, StepError, Workflow, agent_task, scrub};
use crate::services::Ctx;
use crate::store::device_moves::DeviceWrite;
use crate::store::{devices, vms};
use passage_model::api::VmState;
use passage_model::jobs::{DestroyStep, JobKind};
use passage_model::protocol::Task;
use passage_model::{DeviceEvent, DeviceState};

pub struct Destroy;

impl Workflow for Destroy {
    const KIND: JobKind = JobKind::Destroy;
    type Step = DestroyStep;
    type Payload = ();
    // A VM being destroyed keeps its server, devices and image until the job is done;
    // the devices it still holds are read apart, where a step needs them.
    const KEEPS_VM: bool = true;

    /// A node whose agent runs `destroy_vm` gets the stop, the unbind and the disk's
    /// deletion as one task: one round trip to the node instead of three.
    async fn ahead(ctx: &Ctx, run: &Run<Self>, step: DestroyStep) -> Vec<DestroyStep> {
        match step {
            DestroyStep::Stop => {
                let later = [DestroyStep::Unbind, DestroyStep::DeleteDisk];
                run.ahead_if_node_runs(ctx, Task::DESTROY_VM, &later).await
            }
            _ => Vec::new(),
        }
    }

    fn failed_at(run: &Run<Self>, step: DestroyStep, e: &StepError) -> DestroyStep {
        use DestroyStep::{DeleteDisk, Unbind};
        let parts = [
            (Task::UNBIND_PASSTHROUGH, Unbind),
            (Task::DELETE_DISK, DeleteDisk),
        ];
        run.failed_part(step, e, Task::DESTROY_VM, &parts)
    }

    async fn action(ctx: &Ctx, run: &Run<Self>, step: DestroyStep) -> Result<(), StepError> {
        let vm = run.vm(ctx).await?;
        let job = Some(run.job);
        let Some(server) = vm.server_uuid else {
            // Never placed: nothing on any node to stop or clean.
            if step == DestroyStep::Release {
                vms::release_destroyed(&ctx.jobs_db, vm.uuid, None, &[]).await?;
                crate::services::images::vm_destroyed(ctx, vm.image_uuid).await;
            }
            return Ok(());
        };
        match step {
            // The stop, the unbind and the disk's deletion as one task (`ahead`), in that
            // order, ending at the first part that fails. A failure fails this step as the
            // part's own step would have failed (a destroy is forward only either way).
            DestroyStep::Stop if run.does_too(DestroyStep::Unbind) => {
                let held = run.held_first(ctx, &vm).await?;
                let task = Task::DestroyVm {
                    vm_uuid: vm.uuid,
                    devices: held.iter().filter_map(|d| d.parse().ok()).collect(),
                    delete_disk: vm.image_uuid.is_some(),
                };
                agent_task::run(ctx, server, job, task).await.map(drop)
            }
            DestroyStep::Stop => {
                let task = Task::StopVm { vm_uuid: vm.uuid };
                agent_task::run(ctx, server, job, task).await.map(drop)
            }
            DestroyStep::Unbind | DestroyStep::DeleteDisk if run.was_done_ahead(step) => Ok(()),
            DestroyStep::Unbind => {
                let held = run.held_first(ctx, &vm).await?;
                if held.is_empty() {
                    return Ok(());
                }
                let devices = held.iter().filter_map(|d| d.parse().ok()).collect();
                let task = Task::UnbindPassthrough {
                    vm_uuid: vm.uuid,
                    devices,
                };
                agent_task::run(ctx, server, job, task).await.map(drop)
            }
            DestroyStep::DeleteDisk => super::disk::delete(ctx, server, job, &vm).await,
            DestroyStep::Release => {
                // As `unbind` read them, when it ran in this run: the VM gains none.
                let held = run.held_first(ctx, &vm).await?;
                let w = DeviceWrite::destroyed(vm.uuid, Some(server), &held);
                crate::services::device_log::write(ctx, w).await?;
                // The last VM built from a deleted image: its file may go now.
                crate::services::images::vm_destroyed(ctx, vm.image_uuid).await;
                Ok(())
            }
            DestroyStep::Scrub => scrub::scrub_devices(ctx, server, job, &ids(&vm)).await,
        }
    }

    /// A destroy that failed before `release` leaves a VM whose state on the node is
    /// unknown: it is `failed`, and its devices are quarantined (never freed without a
    /// scrub).
    async fn on_failed(ctx: &Ctx, run: &Run<Self>, error: &str) -> Result<(), StepError> {
        let vm = run.vm(ctx).await?;
        crate::store::ops::end_usage(&ctx.jobs_db, vm.uuid).await?;
        if let Some(server) = vm.server_uuid {
            devices::move_devices(
                &ctx.jobs_db,
                server,
                &held(ctx, &vm).await?,
                DeviceEvent::Quarantine,
                Some(vm.uuid),
                &format!("destroy failed: {error}"),
            )
            .await?;
        }
        vms::set_state(
            &ctx.jobs_db,
            vm.uuid,
            &[VmState::Destroying],
            VmState::Failed,
        )
        .await?;
        // Released but not scrubbed (the failure came after `release`): scrub now rather
        // than wait for the reconciler.
        if let Some(server) = vm.server_uuid {
            let ids = ids(&vm);
            let dirty: Vec<String> = devices::for_server(&ctx.jobs_db, server)
                .await?
                .into_iter()
                .filter(|d| d.state == DeviceState::Dirty && ids.contains(&d.pci.id.to_string()))
                .map(|d| d.pci.id.to_string())
                .collect();
            if !dirty.is_empty() {
                scrub::start_job(ctx, server, &dirty).await?;
            }
        }
        Ok(())
    }
}
