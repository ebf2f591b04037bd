//! The provision saga: reserve → bind → launch → mark_used, each step undone on failure.
//! A VM deleted while it provisions is cancelled: the saga stops at its next step,
//! unwinds, and writes the VM's destroy.

use super::{Run, StepError, Workflow, agent_task, scrub};
use crate::services::Ctx;
use crate::store::device_moves::DeviceWrite;
use crate::store::{devices, vms};
use passage_model::api::{Vm, VmState};
use passage_model::images::Bootrom;
use passage_model::jobs::{JobKind, ProvisionStep};
use passage_model::protocol::{CloudInitSpec, NicSpec, Task, VmSpec};
use passage_model::{DeviceEvent, ServerId};

pub struct Provision;

pub(super) fn server_of(vm: &Vm) -> Result<ServerId, StepError> {
    vm.server_uuid
        .ok_or_else(|| StepError::Broken(format!("VM {} has no server", vm.uuid)))
}

pub(super) fn ids(vm: &Vm) -> Vec<String> {
    vm.assigned_devices.iter().map(|d| d.to_string()).collect()
}

/// The devices a VM holds now, by id.
pub(super) async fn held(ctx: &Ctx, vm: &Vm) -> Result<Vec<String>, StepError> {
    Ok(devices::held_by(&ctx.jobs_db, vm.uuid)
        .await?
        .iter()
        .map(|d| d.pci.id.to_string())
        .collect())
}

/// The vGPU type each vGPU slot among `devices` is made as, by slot path: its variant's
/// `vgpu_type`. Empty (and nothing read) when no slot is among them.
pub(super) async fn vgpu_types(
    ctx: &Ctx,
    server: ServerId,
    devices: &[passage_model::DevicePath],
) -> Result<std::collections::BTreeMap<String, String>, StepError> {
    let mut out = std::collections::BTreeMap::new();
    if devices.iter().all(|d| d.vgpu().is_none()) {
        return Ok(out);
    }
    let slots: Vec<String> = devices
        .iter()
        .filter(|d| d.vgpu().is_some())
        .map(ToString::to_string)
        .collect();
    let variants = crate::store::variants::list(&ctx.jobs_db).await?;
    let of = devices::variants_of(&ctx.jobs_db, server, &slots).await?;
    for slot in slots {
        let t = of
            .get(&slot)
            .and_then(Option::as_ref)
            .and_then(|name| variants.iter().find(|v| &v.name == name))
            .and_then(|v| v.vgpu_type.clone())
            .ok_or_else(|| StepError::Broken(format!("vGPU slot {slot} has no vGPU variant")))?;
        out.insert(slot, t);
    }
    Ok(out)
}

/// The spec a node starts the VM from: its NICs as its networks are now (MTU and
/// resolvers may have changed since it was created), its firmware (its image's
/// `requirements.bootrom`, else the default for a VM with or without devices), and, for a
/// VM with a disk, what its guest's cloud-init reads: the owner's keys as they are now and
/// the VM's metadata. Every start (provision, start, resize, migration) builds its spec
/// here, so all agree on the firmware while the image's requirement and the VM's devices
/// stay as they are.
pub(super) async fn spec(
    ctx: &Ctx,
    vm: &Vm,
    disk: Option<passage_model::protocol::DiskSpec>,
) -> Result<VmSpec, StepError> {
    let mut nics = Vec::with_capacity(vm.nics.len());
    for nic in &vm.nics {
        let n = crate::store::networks::get(&ctx.jobs_db, nic.network_uuid).await?;
        let prefix_len = n
            .subnet
            .parse::<ipnet::Ipv4Net>()
            .map_err(|e| StepError::Broken(format!("network {}: subnet: {e}", n.uuid)))?
            .prefix_len();
        nics.push(NicSpec {
            mac: nic.mac.clone(),
            ip: nic.ip,
            prefix_len,
            gateway: n.gateway,
            resolvers: n.resolvers,
            bridge: n.bridge,
            vlan_id: n.vlan_id,
            mtu: n.mtu,
            primary: nic.primary,
        });
    }
    let cloud_init = match disk {
        None => None,
        Some(_) => {
            let vms::GuestInputs { mut metadata, keys } =
                vms::guest_inputs(&ctx.jobs_db, vm.uuid).await?;
            Some(CloudInitSpec {
                hostname: vm.alias.clone(),
                ssh_authorized_keys: keys,
                user_data: metadata.remove(passage_model::metadata::USER_DATA),
                user_script: metadata.remove(passage_model::metadata::USER_SCRIPT),
                metadata,
            })
        }
    };
    let required = match vm.image_uuid {
        Some(image) => {
            super::disk::read_image(ctx, image)
                .await?
                .requirements
                .bootrom
        }
        None => None,
    };
    let bootrom = Bootrom::for_vm(required, !vm.assigned_devices.is_empty());
    Ok(VmSpec {
        uuid: vm.uuid,
        vcpus: vm.vcpus,
        memory_mib: vm.memory_mib,
        devices: vm.assigned_devices.clone(),
        disk,
        nics,
        cloud_init,
        bootrom: Some(bootrom),
    })
}

/// Binds the VM's devices, makes its disk and starts it, as one task: the bind, fetch and
/// launch steps' work, for a node whose agent runs `boot_vm` (one round trip to the node
/// instead of three).
pub(super) async fn boot(
    ctx: &Ctx,
    server: ServerId,
    job: Option<passage_model::JobId>,
    vm: &Vm,
) -> Result<(), StepError> {
    let disk = super::disk::spec(ctx, vm).await?;
    let task = Task::BootVm {
        vgpu_types: vgpu_types(ctx, server, &vm.assigned_devices).await?,
        vm: spec(ctx, vm, disk).await?,
    };
    agent_task::run(ctx, server, job, task).await.map(drop)
}

impl Workflow for Provision {
    const KIND: JobKind = JobKind::Provision;
    type Step = ProvisionStep;
    type Payload = ();
    const LEADS_TO: Option<VmState> = Some(VmState::Running);
    // A provisioning VM's devices, server, image, NICs and size are fixed from its
    // creation; only `mark_used`, the last step, writes its state. Keys and metadata are
    // read apart, as they are now.
    const KEEPS_VM: bool = true;

    async fn ahead(ctx: &Ctx, run: &Run<Self>, step: ProvisionStep) -> Vec<ProvisionStep> {
        match step {
            ProvisionStep::Bind => {
                let later = [ProvisionStep::FetchImage, ProvisionStep::Launch];
                run.ahead_if_node_runs(ctx, Task::BOOT_VM, &later).await
            }
            _ => Vec::new(),
        }
    }

    // The reservation's check from the creation's own write is no check at all (see
    // `action`).
    fn only_looks(run: &Run<Self>, step: ProvisionStep) -> bool {
        step == ProvisionStep::Reserve && run.from_write()
    }

    fn failed_at(run: &Run<Self>, step: ProvisionStep, e: &StepError) -> ProvisionStep {
        use ProvisionStep::{FetchImage, Launch};
        let parts = [(Task::FETCH_IMAGE, FetchImage), (Task::START_VM, Launch)];
        run.failed_part(step, e, Task::BOOT_VM, &parts)
    }

    async fn action(ctx: &Ctx, run: &Run<Self>, step: ProvisionStep) -> Result<(), StepError> {
        let vm = run.vm(ctx).await?;
        if cancelled(ctx, run, &vm) {
            return Err(StepError::Refused(CANCELLED.to_string()));
        }
        let server = server_of(&vm)?;
        let job = Some(run.job);
        match step {
            // The reservation was made with the VM row; check it still holds. A run that
            // starts from the creation's own write needs no look: that transaction
            // reserved exactly the VM's devices, and only the VM's own jobs (one at a time,
            // this one first) move devices a VM holds; an inventory only flags them
            // missing. A provision read back after a restart looks.
            ProvisionStep::Reserve if run.from_write() => Ok(()),
            ProvisionStep::Reserve => {
                let mut held = held(ctx, &vm).await?;
                let mut want = ids(&vm);
                held.sort();
                want.sort();
                if held != want {
                    return Err(StepError::Refused(format!(
                        "the reservation no longer holds: {} of {} devices held",
                        held.len(),
                        want.len()
                    )));
                }
                Ok(())
            }
            ProvisionStep::Bind if run.does_too(ProvisionStep::Launch) => {
                boot(ctx, server, job, &vm).await
            }
            ProvisionStep::FetchImage | ProvisionStep::Launch if run.was_done_ahead(step) => Ok(()),
            ProvisionStep::Bind if vm.assigned_devices.is_empty() => Ok(()),
            ProvisionStep::Bind => {
                let task = Task::BindPassthrough {
                    vm_uuid: vm.uuid,
                    devices: vm.assigned_devices.clone(),
                    vgpu_types: vgpu_types(ctx, server, &vm.assigned_devices).await?,
                };
                agent_task::run(ctx, server, job, task).await.map(drop)
            }
            ProvisionStep::FetchImage => super::disk::fetch(ctx, server, job, &vm).await,
            ProvisionStep::Launch => {
                let disk = super::disk::spec(ctx, &vm).await?;
                let task = Task::StartVm {
                    vm: spec(ctx, &vm, disk).await?,
                };
                agent_task::run(ctx, server, job, task).await.map(drop)
            }
            ProvisionStep::MarkUsed => {
                let w = DeviceWrite::running(vm.uuid, server, &ids(&vm));
                crate::services::device_log::write(ctx, w).await?;
                Ok(())
            }
        }
    }

    async fn undo(ctx: &Ctx, run: &Run<Self>, step: ProvisionStep) -> Result<(), StepError> {
        let vm = run.vm(ctx).await?;
        let server = server_of(&vm)?;
        let job = Some(run.job);
        match step {
            ProvisionStep::Reserve => {
                // Once a launch was tried, a VM may have touched the devices: they must
                // be scrubbed before anyone else gets them.
                let launched = run.started(ProvisionStep::Launch);
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
                .await?;
                crate::store::ops::end_usage(&ctx.jobs_db, vm.uuid).await?;
                // Launch's undo has stopped it (and removed its taps): its addresses may
                // go to the next VM.
                vms::release_addresses(&ctx.jobs_db, vm.uuid).await?;
                if launched && !moved.is_empty() {
                    let dirty: Vec<String> = moved.into_iter().map(|m| m.id).collect();
                    scrub::start_job(ctx, server, &dirty).await?;
                } else if !moved.is_empty() {
                    scrub::close_free_gpus(ctx, server, &ids(&vm)).await?;
                }
                Ok(())
            }
            ProvisionStep::Bind if vm.assigned_devices.is_empty() => Ok(()),
            ProvisionStep::Bind => {
                let task = Task::UnbindPassthrough {
                    vm_uuid: vm.uuid,
                    devices: vm.assigned_devices.clone(),
                };
                agent_task::run(ctx, server, job, task).await.map(drop)
            }
            // The new VM's disk holds nothing yet: it goes (the cached image stays).
            ProvisionStep::FetchImage => super::disk::delete(ctx, server, job, &vm).await,
            ProvisionStep::Launch => {
                let task = Task::StopVm { vm_uuid: vm.uuid };
                agent_task::run(ctx, server, job, task).await.map(drop)
            }
            // Its effects (devices used, VM running) are undone by `reserve`'s undo and
            // by `on_failed`.
            ProvisionStep::MarkUsed => Ok(()),
        }
    }

    /// After the unwind: the VM is `failed`. If an undo could not run, the devices it
    /// still holds are quarantined: their state on the node is unknown.
    async fn on_failed(ctx: &Ctx, run: &Run<Self>, error: &str) -> Result<(), StepError> {
        let vm = run.vm(ctx).await?;
        if let Some(server) = vm.server_uuid {
            let still_held = held(ctx, &vm).await?;
            if !still_held.is_empty() {
                devices::move_devices(
                    &ctx.jobs_db,
                    server,
                    &still_held,
                    DeviceEvent::Quarantine,
                    Some(vm.uuid),
                    &format!("provision failed and could not be unwound: {error}"),
                )
                .await?;
            }
        }
        vms::set_state(
            &ctx.jobs_db,
            vm.uuid,
            &[VmState::Provisioning, VmState::Running],
            VmState::Failed,
        )
        .await?;
        // Deleted while provisioning (cancelled, or failed as it was deleted): destroyed
        // now like any other VM, its devices scrubbed where a guest may have touched
        // them, its addresses given back.
        let now = vms::get(&ctx.jobs_db, vm.uuid).await?;
        if now.state == VmState::Destroying && now.job_uuid == Some(run.job) {
            let job = passage_model::JobId::new_random();
            let job_for = |v: &Vm| {
                super::new_job::<super::destroy::Destroy>(
                    job,
                    Some(v.uuid),
                    Some(v.owner_uuid),
                    &(),
                )
                .map_err(|e| crate::store::StoreError::Corrupt(e.to_string()))
            };
            if let Some(v) =
                vms::destroy_after_cancel(&ctx.jobs_db, vm.uuid, run.job, job, job_for).await?
            {
                super::spawn_with(ctx.clone(), job, Some(v));
            }
        }
        ctx.cancelled_jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&run.job);
        Ok(())
    }
}

/// Why a provision whose VM was deleted stops.
const CANCELLED: &str = "cancelled: the VM was deleted while it was provisioning";

/// Whether the provision's VM was deleted while it ran: noted here by the deletion, or,
/// for a run read back from the database, the VM's state.
fn cancelled(ctx: &Ctx, run: &Run<Provision>, vm: &Vm) -> bool {
    vm.state == VmState::Destroying
        || ctx
            .cancelled_jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&run.job)
}
