//! Stop, reboot, start, resize (another package) and cold migration (another server) of a VM.

use super::Ctx;
use super::auth::Caller;
use super::catalog;
use crate::error::{ApiError, ApiResult};
use crate::placement;
use crate::store::reserve::Claim;
use crate::store::{StoreError, devices, room, vms};
use crate::workflows::lifecycle::{self, Migrate, Reboot, Resize, Start, Stop, StopPlan};
use crate::workflows::{self, Workflow};
use passage_model::api::{DEFAULT_STOP_GRACE_S, Package, Vm, VmState};
use passage_model::{DevicePath, ErrorCode, JobId, ServerId, VmId};
use std::collections::BTreeMap;

const ATTEMPTS: usize = 16;

async fn owned(ctx: &Ctx, caller: &Caller, uuid: VmId) -> ApiResult<Vm> {
    let vm = super::vms::get(ctx, caller, uuid).await?;
    caller.may_change(vm.owner_uuid)?;
    super::vms::settled(ctx, vm).await
}

/// Writes a job of `W` for a VM in one of `from`, and runs it.
async fn begin<W: Workflow>(
    ctx: &Ctx,
    vm: &Vm,
    from: &[VmState],
    payload: &W::Payload,
    claim: Option<Claim<'_>>,
) -> Result<Vm, StoreError> {
    begin_as::<W>(ctx, vm, from, None, payload, claim).await
}

/// [`begin`], the VM going to state `to` with the job's write.
async fn begin_as<W: Workflow>(
    ctx: &Ctx,
    vm: &Vm,
    from: &[VmState],
    to: Option<VmState>,
    payload: &W::Payload,
    claim: Option<Claim<'_>>,
) -> Result<Vm, StoreError> {
    let job = JobId::new_random();
    let new = workflows::new_job::<W>(job, Some(vm.uuid), Some(vm.owner_uuid), payload)
        .map_err(|e| StoreError::Corrupt(e.to_string()))?;
    let vm = vms::begin_job_as(&ctx.api_db, vm.uuid, from, to, new, claim, ctx.cfg.alloc).await?;
    workflows::spawn(ctx.clone(), job);
    Ok(vm)
}

/// How a stop of `vm` goes: forced, or its guest given its package's grace (the
/// default where it names none), never more than the server's limit.
async fn stop_plan(ctx: &Ctx, vm: &Vm, force: bool) -> ApiResult<StopPlan> {
    let asked = match vm.package_uuid {
        Some(p) => match crate::store::packages::get(&ctx.db, p).await {
            Ok(p) => p.stop_grace_s,
            // A package deleted since: the default.
            Err(StoreError::NotFound(_)) => None,
            Err(e) => return Err(e.into()),
        },
        None => None,
    };
    let max = u32::try_from(ctx.cfg.stop_grace_max.as_secs()).unwrap_or(u32::MAX);
    Ok(StopPlan {
        force,
        grace_s: asked.unwrap_or(DEFAULT_STOP_GRACE_S).min(max),
    })
}

/// Stops a running VM: the guest is asked to shut down (the ACPI power button) and given
/// its grace, then the VM is ended; `force` ends it at once. The VM shows `stopping`
/// from this answer on, `stopped` once its job is done; the job's step says which
/// happened.
pub async fn stop(ctx: &Ctx, caller: &Caller, uuid: VmId, force: bool) -> ApiResult<Vm> {
    let vm = owned(ctx, caller, uuid).await?;
    let plan = stop_plan(ctx, &vm, force).await?;
    let to = Some(VmState::Stopping);
    Ok(begin_as::<Stop>(ctx, &vm, &[VmState::Running], to, &Some(plan), None).await?)
}

pub async fn start(ctx: &Ctx, caller: &Caller, uuid: VmId) -> ApiResult<Vm> {
    let vm = owned(ctx, caller, uuid).await?;
    Ok(begin::<Start>(ctx, &vm, &[VmState::Stopped], &(), None).await?)
}

/// A stop as [`stop`] makes it (`force`: a reset), then a start, in one job: the VM
/// keeps its devices, disk and addresses throughout. A stop that fails leaves the VM
/// running, a start that fails leaves it stopped.
pub async fn reboot(ctx: &Ctx, caller: &Caller, uuid: VmId, force: bool) -> ApiResult<Vm> {
    let vm = owned(ctx, caller, uuid).await?;
    let plan = stop_plan(ctx, &vm, force).await?;
    let to = Some(VmState::Stopping);
    Ok(begin_as::<Reboot>(ctx, &vm, &[VmState::Running], to, &plan, None).await?)
}

/// The VM's devices by variant, as the fleet knows them.
async fn current(ctx: &Ctx, vm: &Vm) -> ApiResult<(ServerId, BTreeMap<String, Vec<DevicePath>>)> {
    let server = vm
        .server_uuid
        .ok_or_else(|| ApiError::invalid_state("the VM was never placed"))?;
    let mut by_variant: BTreeMap<String, Vec<DevicePath>> = BTreeMap::new();
    for d in devices::held_by(&ctx.db, vm.uuid).await? {
        by_variant
            .entry(d.variant.unwrap_or_default())
            .or_default()
            .push(d.pci.id);
    }
    Ok((server, by_variant))
}

fn counts(m: &BTreeMap<String, Vec<DevicePath>>) -> BTreeMap<String, u32> {
    m.iter().map(|(k, v)| (k.clone(), v.len() as u32)).collect()
}

/// Another package for a stopped VM: devices added on its server when it has them free,
/// else the VM moves to a server that has the whole new set.
pub async fn resize(ctx: &Ctx, caller: &Caller, uuid: VmId, package: &str) -> ApiResult<Vm> {
    let vm = owned(ctx, caller, uuid).await?;
    let package = match catalog::find_package(ctx, package).await {
        Ok(p) => p,
        Err(e) if e.code == ErrorCode::ResourceNotFound => {
            return Err(ApiError::missing("package", "no such package"));
        }
        Err(e) => return Err(e),
    };
    replace(ctx, vm, Some(package), None).await
}

/// A stopped VM to another server with free devices of its variants (operators).
pub async fn migrate(
    ctx: &Ctx,
    caller: &Caller,
    uuid: VmId,
    target: Option<ServerId>,
) -> ApiResult<Vm> {
    caller.require_operator()?;
    let vm = owned(ctx, caller, uuid).await?;
    replace(ctx, vm, None, Some(target)).await
}

async fn replace(
    ctx: &Ctx,
    vm: Vm,
    package: Option<Package>,
    migrate_to: Option<Option<ServerId>>,
) -> ApiResult<Vm> {
    if vm.state != VmState::Stopped {
        return Err(ApiError::invalid_state("stop the VM first"));
    }
    // A boot disk lives on its node (an overlay on that node's cached image): until disks
    // can be copied, a VM with one stays where it is.
    let pinned = vm.image_uuid.is_some();
    if pinned && migrate_to.is_some() {
        return Err(ApiError::invalid_state(
            "the VM's boot disk lives on its node: it cannot migrate",
        ));
    }
    let (from, have) = current(ctx, &vm).await?;
    let want: BTreeMap<String, u32> = match &package {
        Some(p) => p.devices.clone(),
        None => counts(&have),
    };
    let (vcpus, memory_mib) = package
        .as_ref()
        .map_or((vm.vcpus, vm.memory_mib), |p| (p.vcpus, p.memory_mib));
    let variants: Vec<String> = want.keys().cloned().collect();
    let mut avoid = Vec::new();
    let mut opened = false;
    for _ in 0..ATTEMPTS {
        let mut cands = devices::candidates(&ctx.db, &variants, ctx.alive_after_ms()).await?;
        let rooms = room::rooms(&ctx.db, None, ctx.cfg.alloc).await?;
        // On its own server the VM's current share is given back first.
        let fits = |s: ServerId| match rooms.get(&s) {
            Some(r) if s == from => {
                let mut r = *r;
                r.vcpus_used -= i64::from(vm.vcpus);
                r.memory_used_mib -= i64::try_from(vm.memory_mib).unwrap_or(i64::MAX);
                r.lacks(vcpus, memory_mib).is_none()
            }
            r => room::fits(r, vcpus, memory_mib),
        };
        cands.retain(|c| fits(c.server_uuid) && !avoid.contains(&c.server_uuid));
        let plan = match migrate_to {
            None if pinned => fits(from)
                .then(|| plan_in_place(from, &have, &want, &cands))
                .flatten(),
            None => fits(from)
                .then(|| plan_in_place(from, &have, &want, &cands))
                .flatten()
                .or_else(|| plan_elsewhere(from, &have, &want, &cands, None, &avoid)),
            Some(target) => {
                if target == Some(from) {
                    return Err(ApiError::invalid(
                        "server_uuid",
                        "the VM is on that server already",
                    ));
                }
                if target.is_some_and(|t| !fits(t)) {
                    return Err(ApiError::new(
                        ErrorCode::InsufficientCapacity,
                        "that server lacks the vCPUs or memory this VM needs",
                    ));
                }
                plan_elsewhere(from, &have, &want, &cands, target, &avoid)
            }
        };
        let Some(mut plan) = plan else {
            // vGPUs the plan lacks may come from GPUs opened for them: on the VM's server
            // for a resize (it stays there when it can, and must with a boot disk), on
            // the target of a migration.
            if !opened {
                opened = true;
                let only = match migrate_to {
                    None => Some(from),
                    Some(target) => target,
                };
                let fit = room::Fit {
                    vcpus,
                    memory_mib,
                    alloc: ctx.cfg.alloc,
                };
                let policy = package
                    .as_ref()
                    .and_then(|p| p.placement)
                    .unwrap_or(ctx.cfg.placement);
                if super::placer::open_vgpus_for(ctx, &want, fit, policy, 1, only).await? > 0 {
                    continue;
                }
            }
            if pinned && migrate_to.is_none() {
                return Err(ApiError::invalid_state(
                    "the VM's boot disk lives on its node, and that node lacks what the new \
                     package needs",
                ));
            }
            return Err(ApiError::new(
                ErrorCode::InsufficientCapacity,
                "no running server has the devices this needs free right now",
            ));
        };
        plan.package = package.as_ref().map(|p| p.uuid);
        plan.vcpus = vcpus;
        plan.memory_mib = memory_mib;
        let claim = Claim {
            vm: vm.uuid,
            owner: vm.owner_uuid,
            server: Some(plan.to_server),
            devices: &plan.add,
            vcpus,
            memory_mib,
        };
        let from = [VmState::Stopped];
        let r = match migrate_to {
            None => begin::<Resize>(ctx, &vm, &from, &plan, Some(claim)).await,
            Some(_) => begin::<Migrate>(ctx, &vm, &from, &plan, Some(claim)).await,
        };
        match r {
            Ok(vm) => return Ok(vm),
            Err(StoreError::Retry | StoreError::NoRoom(_)) => avoid.push(plan.to_server),
            Err(e) => return Err(e.into()),
        }
    }
    Err(ApiError::conflict("too many concurrent changes; try again"))
}

fn empty_plan(from: ServerId, to: ServerId) -> lifecycle::Plan {
    lifecycle::Plan {
        from_server: from,
        to_server: to,
        keep: Vec::new(),
        add: Vec::new(),
        remove: Vec::new(),
        package: None,
        vcpus: 0,
        memory_mib: 0,
    }
}

/// Keep what the new shape still wants, add the rest from the same server's free
/// devices, release the surplus. `None` when the server lacks free devices.
fn plan_in_place(
    from: ServerId,
    have: &BTreeMap<String, Vec<DevicePath>>,
    want: &BTreeMap<String, u32>,
    cands: &[devices::Candidate],
) -> Option<lifecycle::Plan> {
    let mut plan = empty_plan(from, from);
    let mut need: BTreeMap<String, u32> = BTreeMap::new();
    for (variant, &n) in want {
        let mine = have.get(variant).cloned().unwrap_or_default();
        let keep = (n as usize).min(mine.len());
        plan.keep.extend(mine[..keep].iter().cloned());
        if n as usize > mine.len() {
            need.insert(variant.clone(), n - mine.len() as u32);
        }
    }
    for (variant, mine) in have {
        let keep = want.get(variant).copied().unwrap_or(0) as usize;
        plan.remove.extend(mine.iter().skip(keep).cloned());
    }
    if !need.is_empty() {
        let local: Vec<devices::Candidate> = cands
            .iter()
            .filter(|c| c.server_uuid == from)
            .cloned()
            .collect();
        plan.add = placement::choose(&local, &need, &[], placement::Policy::Pack)?.devices;
    }
    Some(plan)
}

/// The whole new set on another server; every current device is released.
fn plan_elsewhere(
    from: ServerId,
    have: &BTreeMap<String, Vec<DevicePath>>,
    want: &BTreeMap<String, u32>,
    cands: &[devices::Candidate],
    target: Option<ServerId>,
    avoid: &[ServerId],
) -> Option<lifecycle::Plan> {
    let pool: Vec<devices::Candidate> = cands
        .iter()
        .filter(|c| c.server_uuid != from && target.is_none_or(|t| c.server_uuid == t))
        .cloned()
        .collect();
    let to = if want.is_empty() {
        target?
    } else {
        let chosen = placement::choose(&pool, want, avoid, placement::Policy::Pack)?;
        let mut plan = empty_plan(from, chosen.server);
        plan.add = chosen.devices;
        plan.remove = have.values().flatten().cloned().collect();
        return Some(plan);
    };
    let mut plan = empty_plan(from, to);
    plan.remove = have.values().flatten().cloned().collect();
    Some(plan)
}
