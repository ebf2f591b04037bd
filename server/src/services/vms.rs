//! VMs: placement and reservation on create, the destroy workflow, and jobs.

use super::Ctx;
use super::auth::Caller;
use super::catalog;
use super::networks::BridgeFilter;
use super::placer::Extras;
use crate::error::{ApiError, ApiResult};
use crate::listing::{JobFilter, Page, PageReq, TimeKey, VmFilter};
use crate::placement;
use crate::store::create::{self, NewVm};
use crate::store::{self, StoreError, accounts, devices, jobs, room, vms};
use crate::workflows;
use passage_model::api::{CreateVm, Job, JobState, Role, Vm, VmState};
use passage_model::{DevicePath, ErrorCode, JobId, PackageId, VmId};
use std::collections::BTreeMap;

/// A lost race means someone else took a device; each retry re-reads the free devices, so
/// this bounds work, not correctness.
const MAX_PLACEMENT_ATTEMPTS: usize = 32;

fn insufficient(request: &BTreeMap<String, u32>, bridges: &BridgeFilter) -> ApiError {
    let what: Vec<String> = request.iter().map(|(v, n)| format!("{n} × {v}")).collect();
    let on = if bridges.needs().is_empty() {
        String::new()
    } else {
        let b: Vec<&str> = bridges.needs().iter().map(String::as_str).collect();
        format!(" with bridge {}", b.join(" and "))
    };
    ApiError::new(
        ErrorCode::InsufficientCapacity,
        format!(
            "no running server{on} has {} free right now",
            if what.is_empty() {
                "room".to_string()
            } else {
                what.join(" and ")
            }
        ),
    )
}

/// The owner's keys a new VM is given, as kept with it (a JSON array of
/// [`vms::GivenKey`]): those `chosen` by name or fingerprint (SHA-256 or MD5), in that
/// order, or when none are chosen all of them, oldest first. A choice that names none of
/// the owner's keys is refused, naming it.
async fn given_keys(
    ctx: &Ctx,
    owner: passage_model::AccountId,
    chosen: Option<&[String]>,
) -> ApiResult<String> {
    let all = store::keys::all(&ctx.db, owner).await?;
    let given: Vec<&passage_model::keys::SshKey> = match chosen {
        None => all.iter().collect(),
        Some(chosen) => {
            let mut given = Vec::with_capacity(chosen.len());
            for (i, c) in chosen.iter().enumerate() {
                let k = all
                    .iter()
                    .find(|k| k.name == *c || k.fingerprint == *c || k.md5_fingerprint == *c)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            format!("keys[{i}]"),
                            format!("the owner has no key named or fingerprinted {c:?}"),
                        )
                    })?;
                // A name and a fingerprint of one key are the same key, given once.
                if given
                    .iter()
                    .any(|g: &&passage_model::keys::SshKey| g.name == k.name)
                {
                    return Err(ApiError::invalid(
                        format!("keys[{i}]"),
                        format!("key {:?} is already given", k.name),
                    ));
                }
                given.push(k);
            }
            given
        }
    };
    let kept: Vec<vms::GivenKey> = given
        .into_iter()
        .map(|k| vms::GivenKey {
            name: k.name.clone(),
            fingerprint: k.fingerprint.clone(),
            key: k.key.clone(),
        })
        .collect();
    serde_json::to_string(&kept).map_err(|e| ApiError::internal(format!("keys: {e}")))
}

pub async fn create(ctx: &Ctx, caller: &Caller, req: CreateVm) -> ApiResult<Vm> {
    if caller.account.role == Role::Reader {
        return Err(ApiError::forbidden());
    }
    // Operators' fields are refused to others before their values are looked at.
    if req.assigned_devices.is_some() || req.owner_uuid.is_some_and(|o| o != caller.account.uuid) {
        caller.require_operator()?;
    }
    req.validate()?;
    let owner = match req.owner_uuid {
        Some(o) if o != caller.account.uuid => match accounts::get(&ctx.db, o).await {
            Ok(_) => o,
            Err(StoreError::NotFound(_)) => {
                return Err(ApiError::missing("owner_uuid", "no such account"));
            }
            Err(e) => return Err(e.into()),
        },
        _ => caller.account.uuid,
    };
    // The image is the owner's to use: an operator creating for a tenant names one the
    // tenant may use (or an operator's own, which every operator sees).
    let image_key = req
        .image
        .as_deref()
        .ok_or_else(|| ApiError::invalid("image", "an image is required"))?;
    let image = super::images::resolve(ctx, caller, image_key).await?;
    let attachment = super::networks::attach(ctx, caller, owner, req.networks.as_deref()).await?;
    let metadata = serde_json::to_string(&req.metadata.clone().unwrap_or_default())
        .map_err(|e| ApiError::internal(format!("metadata: {e}")))?;
    let extras = Extras {
        nics: attachment.nics,
        bridges: super::networks::BridgeFilter::new(ctx, attachment.bridges).await?,
        metadata,
        tags: req.tags.clone().unwrap_or_default(),
        keys: Some(given_keys(ctx, owner, req.keys.as_deref()).await?),
    };
    let job = JobId::new_ordered();
    let uuid = VmId::new_ordered();
    let vm = if let Some(devs) = req.assigned_devices.clone() {
        create_with_devices(
            ctx,
            &req.alias,
            owner,
            uuid,
            job,
            devs,
            req.server_uuid,
            &req,
            &image,
            &extras,
        )
        .await?
    } else {
        let key = req
            .package
            .as_deref()
            .ok_or_else(|| ApiError::invalid("package", "a package (uuid or name) is required"))?;
        let on_the_way = ctx.placer.on_the_way();
        let package = match catalog::find_package(ctx, key).await {
            Ok(p) => p,
            Err(e) if e.code == ErrorCode::ResourceNotFound => {
                return Err(ApiError::missing("package", "no such package"));
            }
            Err(e) => return Err(e),
        };
        if let Some(min) = image.requirements.min_disk_gib
            && package.disk_gib < min
        {
            return Err(ApiError::conflict(format!(
                "image {}@{} needs a disk of at least {min} GiB; package {} has {} GiB",
                image.name, image.version, package.name, package.disk_gib
            )));
        }
        let started = std::time::Instant::now();
        let r = super::placer::place(
            ctx,
            &req.alias,
            owner,
            uuid,
            job,
            &package,
            Some(image.uuid),
            extras,
            on_the_way,
        )
        .await;
        let outcome = match &r {
            Ok(_) => "placed",
            Err(e) if e.code == ErrorCode::InsufficientCapacity => "insufficient_capacity",
            Err(e) if e.code == ErrorCode::QuotaExceeded => "quota_exceeded",
            Err(_) => "error",
        };
        ctx.metrics.placement(outcome, started.elapsed());
        r?
    };
    workflows::spawn_with(ctx.clone(), job, Some(vm.clone()));
    Ok(vm)
}

/// Places one VM alone, looking at the whole fleet when the free-device index finds
/// nothing, and raises a capacity alert when nothing fits. Servers in `avoid` (where the
/// caller just lost a race) come last.
#[allow(clippy::too_many_arguments)]
pub(super) async fn place_and_reserve(
    ctx: &Ctx,
    alias: &str,
    owner: passage_model::AccountId,
    uuid: VmId,
    job: JobId,
    package: &passage_model::api::Package,
    image: Option<passage_model::ImageId>,
    extras: &Extras,
    mut avoid: Vec<passage_model::ServerId>,
) -> ApiResult<Vm> {
    let bridges = &extras.bridges;
    let variants: Vec<String> = package.devices.keys().cloned().collect();
    let mut opened_gpus = false;
    // Servers whose reservation found no room for the VM (its NUMA nodes' cores or
    // memory, its address width, or its vCPUs taken meanwhile): not tried again, and the
    // last reason goes with the answer when nothing else fits.
    let mut unfit: Vec<passage_model::ServerId> = Vec::new();
    let mut refusal: Option<String> = None;
    for _ in 0..MAX_PLACEMENT_ATTEMPTS {
        let policy = package.placement.unwrap_or(ctx.cfg.placement);
        let choice = if package.devices.is_empty() {
            any_running_server(ctx, package, &avoid, bridges)
                .await?
                .map(|server| placement::Placement {
                    server,
                    devices: Vec::new(),
                })
        } else {
            match hinted_choice(ctx, package, &variants, &avoid, policy, bridges).await? {
                Some(c) => Some(c),
                // The index is a hint: before saying no, look at every device.
                None => {
                    let mut cands = full_scan(ctx, &variants).await?;
                    cands.retain(|c| {
                        bridges.admits(c.server_uuid) && !unfit.contains(&c.server_uuid)
                    });
                    let cands = with_room(ctx, package, cands).await?;
                    let (choice, why) =
                        choose_fitting_why(ctx, package, &cands, &avoid, policy).await?;
                    if refusal.is_none() {
                        refusal = why;
                    }
                    choice
                }
            }
        };
        let Some(choice) = choice else {
            // No free vGPU slot: open a free GPU for them once, then look again.
            if !opened_gpus && !package.devices.is_empty() {
                opened_gpus = true;
                if super::placer::open_vgpus(ctx, package, 1).await? > 0 {
                    continue;
                }
            }
            let mut err = insufficient(&package.devices, bridges);
            if let Some(why) = &refusal {
                err.message = format!("{}; {why}", err.message);
            }
            for (variant, count) in &package.devices {
                let r = store::ops::alert(
                    &ctx.db,
                    "insufficient_capacity",
                    &err.message,
                    Some(variant),
                    Some(*count),
                )
                .await;
                if let Err(e) = r {
                    tracing::warn!(error = %e, "could not record a capacity alert");
                }
            }
            return Err(err);
        };
        let r = create::create_one(
            &ctx.db,
            NewVm {
                uuid,
                alias,
                owner,
                package: Some(package.uuid),
                vcpus: package.vcpus,
                memory_mib: package.memory_mib,
                server: Some(choice.server),
                devices: &choice.devices,
                job,
                image,
                nics: &extras.nics,
                metadata: &extras.metadata,
                tags: &extras.tags,
                keys: extras.keys.as_deref(),
            },
            ctx.cfg.alloc,
        )
        .await;
        match r {
            Ok(vm) => return Ok(vm),
            // Lost a device to a concurrent placement there.
            Err(StoreError::Retry) => avoid.push(choice.server),
            Err(StoreError::NoRoom(why)) => {
                avoid.push(choice.server);
                unfit.push(choice.server);
                refusal = Some(why);
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(ApiError::conflict(
        "too many concurrent provisions for the same devices; try again",
    ))
}

/// Servers that fit come from the free-device index (fewest free first for pack, most
/// for spread); servers that tie are tried in random order, so concurrent requests spread
/// over them instead of all racing for the same devices.
/// Could the caller get `package` right now? The same placement as a creation, without
/// reserving anything, plus the caller's quota.
pub async fn availability(
    ctx: &Ctx,
    caller: &Caller,
    package: PackageId,
) -> ApiResult<passage_model::api::PackageAvailability> {
    let package = catalog::get_package(ctx, package).await?;
    let wanted: u32 = package.devices.values().sum();
    let quota_ok = match caller.account.gpu_quota {
        None => true,
        Some(q) => passage_model::capacity::Quota {
            limit: Some(i64::from(q)),
            held: accounts::gpu_held(&ctx.db, caller.account.uuid).await?,
        }
        .admits(i64::from(wanted)),
    };
    let any = BridgeFilter::any();
    let capacity_ok = if package.devices.is_empty() {
        any_running_server(ctx, &package, &[], &any)
            .await?
            .is_some()
    } else {
        let variants: Vec<String> = package.devices.keys().cloned().collect();
        let policy = package.placement.unwrap_or(ctx.cfg.placement);
        match hinted_choice(ctx, &package, &variants, &[], policy, &any).await? {
            Some(_) => true,
            None => {
                let cands = with_room(ctx, &package, full_scan(ctx, &variants).await?).await?;
                choose_fitting(ctx, &package, &cands, &[], policy)
                    .await?
                    .is_some()
                    || vgpus_would_open(ctx, &package).await?
            }
        }
    };
    let message = if !quota_ok {
        Some(format!(
            "needs {wanted} device(s); your GPU quota is {}",
            caller.account.gpu_quota.unwrap_or(0)
        ))
    } else if !capacity_ok {
        Some(insufficient(&package.devices, &any).message)
    } else {
        None
    };
    Ok(passage_model::api::PackageAvailability {
        package: package.uuid,
        capacity_ok,
        quota_ok,
        message,
    })
}

/// Whether a package of vGPUs only would get them by opening free GPUs (a creation opens
/// them; asking must not).
async fn vgpus_would_open(ctx: &Ctx, package: &passage_model::api::Package) -> ApiResult<bool> {
    let all = store::variants::list(&ctx.db).await?;
    for (name, &count) in &package.devices {
        let Some(v) = all.iter().find(|v| &v.name == name && v.is_vgpu()) else {
            return Ok(false);
        };
        let cap = store::ops::vgpu_capacity(&ctx.db, v, ctx.alive_after_ms()).await?;
        if cap.remaining_capacity < u64::from(count) {
            return Ok(false);
        }
    }
    Ok(!package.devices.is_empty())
}

async fn hinted_choice(
    ctx: &Ctx,
    package: &passage_model::api::Package,
    variants: &[String],
    avoid: &[passage_model::ServerId],
    policy: placement::Policy,
    bridges: &BridgeFilter,
) -> ApiResult<Option<placement::Placement>> {
    use rand::seq::SliceRandom;
    let request = &package.devices;
    let Some((primary, &count)) = request.iter().max_by_key(|(_, n)| **n) else {
        return Ok(None);
    };
    let spread = policy == placement::Policy::Spread;
    let fit = room::Fit {
        vcpus: package.vcpus,
        memory_mib: package.memory_mib,
        alloc: ctx.cfg.alloc,
    };
    let mut servers = devices::hinted_servers(
        &ctx.db,
        primary,
        count,
        ctx.alive_after_ms(),
        spread,
        32,
        fit,
    )
    .await?;
    servers.retain(|(s, _)| !avoid.contains(s) && bridges.admits(*s));
    let mut order: Vec<passage_model::ServerId> = Vec::with_capacity(servers.len());
    for tie in servers.chunk_by(|a, b| a.1 == b.1) {
        let mut group: Vec<_> = tie.iter().map(|(s, _)| *s).collect();
        group.shuffle(&mut rand::thread_rng());
        order.extend(group);
    }
    for server in order.into_iter().take(8) {
        let cands = devices::candidates_on(&ctx.db, server, variants).await?;
        if let Some(p) = choose_fitting(ctx, package, &cands, &[], policy).await? {
            return Ok(Some(p));
        }
    }
    Ok(None)
}

/// `placement::choose` among `cands`, with their servers' NUMA rooms and address widths.
async fn choose_fitting(
    ctx: &Ctx,
    package: &passage_model::api::Package,
    cands: &[devices::Candidate],
    avoid: &[passage_model::ServerId],
    policy: placement::Policy,
) -> ApiResult<Option<placement::Placement>> {
    Ok(choose_fitting_why(ctx, package, cands, avoid, policy)
        .await?
        .0)
}

/// [`choose_fitting`], and when nothing fits, why a server with the devices does not.
async fn choose_fitting_why(
    ctx: &Ctx,
    package: &passage_model::api::Package,
    cands: &[devices::Candidate],
    avoid: &[passage_model::ServerId],
    policy: placement::Policy,
) -> ApiResult<(Option<placement::Placement>, Option<String>)> {
    let mut servers: Vec<passage_model::ServerId> = cands.iter().map(|c| c.server_uuid).collect();
    servers.sort();
    servers.dedup();
    let hosts = room::host_rooms(&ctx.db, Some(&servers), ctx.cfg.alloc).await?;
    let shape = placement::VmShape {
        vcpus: package.vcpus,
        memory_mib: package.memory_mib,
        hosts: &hosts,
    };
    let choice = placement::choose_fitting(cands, &package.devices, avoid, policy, Some(&shape));
    let why = match choice {
        Some(_) => None,
        None => placement::why_unfit(cands, &package.devices, policy, &shape),
    };
    Ok((choice, why))
}

/// Every placeable device of `variants` on running servers in service.
async fn full_scan(ctx: &Ctx, variants: &[String]) -> ApiResult<Vec<devices::Candidate>> {
    Ok(devices::candidates(&ctx.db, variants, ctx.alive_after_ms()).await?)
}

/// The candidates on servers with the vCPUs and memory `package` asks for.
async fn with_room(
    ctx: &Ctx,
    package: &passage_model::api::Package,
    mut cands: Vec<devices::Candidate>,
) -> ApiResult<Vec<devices::Candidate>> {
    let rooms = room::rooms(&ctx.db, None, ctx.cfg.alloc).await?;
    cands.retain(|c| room::fits(rooms.get(&c.server_uuid), package.vcpus, package.memory_mib));
    Ok(cands)
}

/// For a VM without devices: a server without GPUs first, else the one with fewest, of
/// those with the vCPUs and memory it asks for.
async fn any_running_server(
    ctx: &Ctx,
    package: &passage_model::api::Package,
    avoid: &[passage_model::ServerId],
    bridges: &BridgeFilter,
) -> ApiResult<Option<passage_model::ServerId>> {
    let servers = store::servers::alive_by_device_count(&ctx.db, ctx.alive_after_ms()).await?;
    let rooms = room::rooms(&ctx.db, None, ctx.cfg.alloc).await?;
    Ok(servers
        .iter()
        .map(|(s, _)| *s)
        .filter(|s| !avoid.contains(s) && bridges.admits(*s))
        .find(|s| room::fits(rooms.get(s), package.vcpus, package.memory_mib)))
}

#[allow(clippy::too_many_arguments)]
async fn create_with_devices(
    ctx: &Ctx,
    alias: &str,
    owner: passage_model::AccountId,
    uuid: VmId,
    job: JobId,
    devs: Vec<DevicePath>,
    server: Option<passage_model::ServerId>,
    req: &CreateVm,
    image: &passage_model::images::Image,
    extras: &Extras,
) -> ApiResult<Vm> {
    let server =
        server.ok_or_else(|| ApiError::invalid("server_uuid", "required with assigned_devices"))?;
    let vcpus = req.vcpus.unwrap_or(1);
    let memory_mib = req.memory_mib.unwrap_or(1024);
    let known = match store::servers::get(&ctx.db, server).await {
        Ok(_) if !extras.bridges.admits(server) => {
            let b: Vec<&str> = extras.bridges.needs().iter().map(String::as_str).collect();
            return Err(ApiError::conflict(format!(
                "server {server} has not reported bridge {}, which the VM's networks need",
                b.join(" and ")
            )));
        }
        Ok(_) => devices::for_server(&ctx.db, server).await?,
        Err(StoreError::NotFound(_)) => {
            return Err(ApiError::missing("server_uuid", "no such server"));
        }
        Err(e) => return Err(e.into()),
    };
    for (i, d) in devs.iter().enumerate() {
        if devs[..i].contains(d) {
            return Err(ApiError::invalid(
                format!("assigned_devices[{i}]"),
                "listed twice",
            ));
        }
        let Some(rec) = known.iter().find(|k| k.pci.id == *d) else {
            return Err(ApiError::missing(
                format!("assigned_devices[{i}]"),
                "no such device on that server",
            ));
        };
        if rec.variant.is_none() {
            return Err(ApiError::conflict(format!(
                "assigned_devices[{i}]: the device matches no variant, so it is not assignable"
            )));
        }
        if rec.missing || rec.taint.is_some() {
            return Err(ApiError::conflict(format!(
                "device {d} is tainted: {}",
                rec.taint.as_deref().unwrap_or("missing")
            )));
        }
    }
    let r = create::create_one(
        &ctx.db,
        NewVm {
            uuid,
            alias,
            owner,
            package: None,
            vcpus,
            memory_mib,
            server: Some(server),
            devices: &devs,
            job,
            image: Some(image.uuid),
            nics: &extras.nics,
            metadata: &extras.metadata,
            tags: &extras.tags,
            keys: extras.keys.as_deref(),
        },
        ctx.cfg.alloc,
    )
    .await;
    match r {
        Ok(vm) => Ok(vm),
        Err(StoreError::Retry) => Err(ApiError::conflict(
            "one of the devices is not free (held, dirty, quarantined, disabled, missing or \
             tainted)",
        )),
        Err(e) => Err(e.into()),
    }
}

pub async fn get(ctx: &Ctx, caller: &Caller, uuid: VmId) -> ApiResult<Vm> {
    let vm = match vms::get(&ctx.db, uuid).await {
        Ok(vm) => vm,
        Err(StoreError::NotFound(_)) => return Err(ApiError::not_found("vm")),
        Err(e) => return Err(e.into()),
    };
    if !caller.sees(vm.owner_uuid) {
        return Err(ApiError::not_found("vm"));
    }
    Ok(vm)
}

/// The end of the VM's serial console, read from its node now.
pub async fn console(
    ctx: &Ctx,
    caller: &Caller,
    uuid: VmId,
) -> ApiResult<passage_model::api::VmConsole> {
    let vm = get(ctx, caller, uuid).await?;
    let Some(server) = vm.server_uuid else {
        return Err(ApiError::invalid_state(
            "the VM was never placed on a node: it has no console",
        ));
    };
    if vm.state == VmState::Destroyed {
        return Err(ApiError::invalid_state(
            "the VM is destroyed: its console went with it",
        ));
    }
    let task = passage_model::protocol::Task::ReadConsole { vm_uuid: uuid };
    let r = crate::workflows::agent_task::run_raw(ctx, server, None, task)
        .await
        .map_err(|e| ApiError::invalid_state(format!("reading the console: {e}")))?;
    match (r.ok, r.console) {
        (true, Some(mut output)) => {
            // The node's word is bounded by the protocol, not trusted to keep it.
            let max = passage_model::protocol::MAX_CONSOLE_BYTES;
            if output.len() > max {
                let mut cut = output.len() - max;
                while !output.is_char_boundary(cut) {
                    cut += 1;
                }
                output.drain(..cut);
            }
            Ok(passage_model::api::VmConsole {
                vm_uuid: uuid,
                output,
                read_at: chrono::Utc::now(),
            })
        }
        (true, None) => Err(ApiError::internal(
            "the node answered read_console without a console",
        )),
        (false, _) => Err(ApiError::invalid_state(format!(
            "the node could not read the console: {}",
            r.error.as_deref().unwrap_or("no reason given")
        ))),
    }
}

pub async fn list(
    ctx: &Ctx,
    caller: &Caller,
    mut filter: VmFilter,
    req: &PageReq<TimeKey>,
) -> ApiResult<Page<Vm, TimeKey>> {
    if !caller.account.role.sees_all() {
        if filter.owner.is_some_and(|o| o != caller.account.uuid) {
            // Another tenant's VMs: none that this caller can see.
            return Ok(Page {
                items: Vec::new(),
                total: 0,
                next: None,
            });
        }
        filter.owner = Some(caller.account.uuid);
    }
    Ok(vms::list(&ctx.db, &filter, req).await?)
}

pub async fn destroy(ctx: &Ctx, caller: &Caller, uuid: VmId) -> ApiResult<Vm> {
    let job = JobId::new_random();
    // Tried at once, before any read, and written with the deletions that come with it:
    // nearly every deletion is of a VM at rest that the caller may change, and reading it
    // first cost every deletion a read. The update takes only a VM the caller may change
    // (`Caller::may_change` as a condition on its owner); anything else is told apart below.
    let first = if caller.account.role == Role::Reader {
        None
    } else {
        let owner = (!caller.account.role.sees_all()).then_some(caller.account.uuid);
        super::destroys::begin(
            ctx,
            vms::DestroyReq {
                vm: uuid,
                job,
                owner,
            },
        )
        .await?
    };
    let vm = match first {
        Some(vm) => vm,
        None => match destroy_refused(ctx, caller, uuid, job).await? {
            Deletion::Begun(vm) => vm,
            // Its provision unwinds and then writes the destroy: nothing to run here.
            Deletion::Cancelled(vm) => return Ok(vm),
        },
    };
    workflows::spawn_with(ctx.clone(), job, Some(vm.clone()));
    Ok(vm)
}

/// How a deletion the first try refused went on.
enum Deletion {
    /// Its destroy job (the one asked for) is written.
    Begun(Vm),
    /// The VM was still provisioning: its provision is cancelled, and destroys it after
    /// its unwind.
    Cancelled(Vm),
}

/// A deletion the first try refused: the VM is missing, the caller's to see but not to
/// change, destroyed, still provisioning (its provision is cancelled), or busy with a
/// job. Its answer says which; a job that is over in all but name is waited for
/// (`settled`) and the deletion tried once more.
async fn destroy_refused(
    ctx: &Ctx,
    caller: &Caller,
    uuid: VmId,
    job: JobId,
) -> ApiResult<Deletion> {
    let vm = get(ctx, caller, uuid).await?;
    caller.may_change(vm.owner_uuid)?;
    if vm.state == VmState::Destroyed {
        return Err(ApiError::invalid_state("the VM is already destroyed"));
    }
    if let Some(cancelled) = cancel(ctx, &vm).await? {
        return Ok(Deletion::Cancelled(cancelled));
    }
    let vm = match vms::begin_destroy(&ctx.api_db, uuid, job, super::destroys::job_for).await {
        Err(StoreError::InvalidState(_)) if vm.job_uuid.is_some() => {
            let vm = settled(ctx, vm).await?;
            if vm.state == VmState::Destroyed {
                return Err(ApiError::invalid_state("the VM is already destroyed"));
            }
            // A provision that was cancelled by another deletion: this one is under way
            // too.
            if let Some(cancelled) = cancel(ctx, &vm).await? {
                return Ok(Deletion::Cancelled(cancelled));
            }
            vms::begin_destroy(&ctx.api_db, uuid, job, super::destroys::job_for).await?
        }
        r => r?,
    };
    Ok(Deletion::Begun(vm))
}

/// Cancels the provision of `vm` if it is still provisioning (or was cancelled already):
/// the VM as it stands after. The provision stops at its next step, unwinds, and writes
/// the VM's destroy.
async fn cancel(ctx: &Ctx, vm: &Vm) -> ApiResult<Option<Vm>> {
    let Some(job) = vm.job_uuid else {
        return Ok(None);
    };
    if vm.state == VmState::Destroying {
        let cancelling = match jobs::get(&ctx.db, job).await {
            Ok(j) => j.kind == passage_model::jobs::JobKind::Provision,
            Err(StoreError::NotFound(_)) => false,
            Err(e) => return Err(e.into()),
        };
        return Ok(cancelling.then(|| vm.clone()));
    }
    if vm.state != VmState::Provisioning {
        return Ok(None);
    }
    let noted = |on: bool| {
        let mut set = ctx.cancelled_jobs.lock().unwrap_or_else(|p| p.into_inner());
        if on {
            set.insert(job);
        } else {
            set.remove(&job);
        }
    };
    // Noted before the write, so that the runner here stops at its very next step; taken
    // back when the write did not cancel it (the provision ended meanwhile, or an error).
    noted(true);
    let r = vms::cancel_provision(&ctx.api_db, vm.uuid, job).await;
    if !matches!(r, Ok(Some(_))) {
        noted(false);
    }
    Ok(r?)
}

/// How long a call on a VM waits for a job in its last step to be marked done.
const FINISHING_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// `vm`, once a job whose last step has already put it where the job leads has been
/// marked done. That step makes the VM `running` or `stopped` a moment before the job is
/// marked done: a client that sees the VM running and deletes it at once must not be
/// refused for a job that is over in all but name. Any other job is left alone, and the
/// call is refused as before.
pub async fn settled(ctx: &Ctx, mut vm: Vm) -> ApiResult<Vm> {
    let deadline = tokio::time::Instant::now() + FINISHING_WAIT;
    loop {
        let Some(job) = vm.job_uuid else {
            return Ok(vm);
        };
        let rec = match jobs::get(&ctx.db, job).await {
            Ok(r) => r,
            Err(StoreError::NotFound(_)) => return Ok(vm),
            Err(e) => return Err(e.into()),
        };
        let finishing = matches!(rec.state, JobState::Queued | JobState::Running)
            && workflows::leads_to(rec.kind) == Some(vm.state)
            && rec.steps.last().is_some_and(|s| s.started_at.is_some());
        if !finishing || tokio::time::Instant::now() >= deadline {
            return Ok(vm);
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        vm = vms::get(&ctx.db, vm.uuid).await?;
    }
}

pub async fn job(ctx: &Ctx, caller: &Caller, uuid: JobId) -> ApiResult<Job> {
    let rec = match jobs::get(&ctx.db, uuid).await {
        Ok(r) => r,
        Err(StoreError::NotFound(_)) => return Err(ApiError::not_found("job")),
        Err(e) => return Err(e.into()),
    };
    let visible = match rec.owner {
        Some(owner) => caller.sees(owner),
        None => caller.account.role.sees_all(),
    };
    if !visible {
        return Err(ApiError::not_found("job"));
    }
    Ok(rec.view())
}

/// One page of jobs, newest first: a tenant's own (those on its VMs), or all for staff.
pub async fn list_jobs(
    ctx: &Ctx,
    caller: &Caller,
    state: Option<JobState>,
    req: &PageReq<TimeKey>,
) -> ApiResult<Page<Job, TimeKey>> {
    let filter = JobFilter {
        owner: (!caller.account.role.sees_all()).then_some(caller.account.uuid),
        state,
    };
    Ok(jobs::list(&ctx.db, &filter, req).await?)
}
