//! Placement in batches. Concurrent creations queue here; one task takes whatever has
//! queued (up to [`MAX_BATCH`]), places all of it on one read of the free-device index,
//! and reserves it in one transaction (`store::batch`). While a batch is in the database
//! the next one gathers, so under load the cost of a placement is shared by the batch,
//! and a lone request is placed at once, alone.
//!
//! The batch is a fast path, not a second policy: a request it cannot place among the
//! servers it read, or that loses a device or the room on its server to a concurrent
//! writer (another replica, an agent's report), is placed alone by
//! `vms::place_and_reserve`, which looks at the whole fleet and raises the capacity
//! alert when nothing fits.

use super::Ctx;
use super::batcher::{Batcher, OnTheWay};
use super::networks::BridgeFilter;
use crate::error::{ApiError, ApiResult};
use crate::placement::{self, Policy};
use crate::store::create::{self, NewVm};
use crate::store::devices::Candidate;
use crate::store::reserve::addresses::NicWant;
use crate::store::room::{self, Room};
use crate::store::{StoreError, devices};
use passage_model::ImageId;
use passage_model::api::{Package, Vm};
use passage_model::{AccountId, DevicePath, JobId, PackageId, ServerId, VmId};
use std::collections::{BTreeMap, HashMap};
use tokio::sync::oneshot;

/// Creations placed and written together at most.
pub const MAX_BATCH: usize = 64;

/// How long a batch waits for the callers the last batch answered. A batch's write takes
/// 5 to 20 ms: waiting up to 5 ms to write 64 creations at once costs less than writing
/// the first to come back alone and the rest after it.
pub const LINGER: std::time::Duration = std::time::Duration::from_millis(5);

/// The queue of creations waiting to be placed together.
pub type Placer = Batcher<Request>;

/// One creation waiting for its placement.
pub struct Request {
    alias: String,
    owner: AccountId,
    uuid: VmId,
    job: JobId,
    package: Package,
    image: Option<ImageId>,
    extras: Extras,
    answer: oneshot::Sender<ApiResult<Vm>>,
}

/// What a creation asks for besides its package: addresses on networks (and so servers
/// with their bridges), metadata for its guest, and tags.
#[derive(Clone)]
pub struct Extras {
    pub nics: Vec<NicWant>,
    pub bridges: BridgeFilter,
    /// A JSON object.
    pub metadata: String,
    pub tags: passage_model::tags::Tags,
    /// The owner's keys it is given (a JSON array of `store::vms::GivenKey`); `None`: the
    /// owner's keys at each start.
    pub keys: Option<String>,
}

impl Extras {
    /// A VM without networks or metadata.
    pub fn none() -> Extras {
        Extras {
            nics: Vec::new(),
            bridges: BridgeFilter::any(),
            metadata: "{}".into(),
            tags: passage_model::tags::Tags::new(),
            keys: None,
        }
    }
}

/// Places `package` for a new VM and reserves its devices: the VM as written, in
/// `provisioning`, with its provision job queued (not yet started).
#[allow(clippy::too_many_arguments)]
pub async fn place(
    ctx: &Ctx,
    alias: &str,
    owner: AccountId,
    uuid: VmId,
    job: JobId,
    package: &Package,
    image: Option<ImageId>,
    extras: Extras,
    on_the_way: OnTheWay,
) -> ApiResult<Vm> {
    if package.devices.is_empty() {
        // A VM without devices needs no device index: one server with room will do.
        return super::vms::place_and_reserve(
            ctx,
            alias,
            owner,
            uuid,
            job,
            package,
            image,
            &extras,
            Vec::new(),
        )
        .await;
    }
    let (answer, answered) = oneshot::channel();
    let req = Request {
        alias: alias.to_string(),
        owner,
        uuid,
        job,
        package: package.clone(),
        image,
        extras,
        answer,
    };
    drop(on_the_way);
    ctx.placer
        .submit(ctx, req, MAX_BATCH, |ctx, batch| async move {
            place_batch(&ctx, batch).await
        })
        .await
        .map_err(|_| ApiError::internal("the placement queue is closed"))?;
    answered
        .await
        .map_err(|_| ApiError::internal("the placement task ended without an answer"))?
}

/// A request and where the batch put it.
struct Planned {
    req: Request,
    server: ServerId,
    devices: Vec<DevicePath>,
}

/// Places `batch` and writes it; the queue's task gathers the next batch meanwhile, and
/// takes all of it at once when this one is done: the busier the queue, the bigger the
/// batch, and the fewer round trips to the database per creation.
async fn place_batch(ctx: &Ctx, batch: Vec<Request>) {
    let t0 = std::time::Instant::now();
    // Requests alike in package and bridges are placed on one read.
    let mut by_package: BTreeMap<(PackageId, Vec<String>), Vec<Request>> = BTreeMap::new();
    for r in batch {
        let bridges: Vec<String> = r.extras.bridges.needs().iter().cloned().collect();
        by_package
            .entry((r.package.uuid, bridges))
            .or_default()
            .push(r);
    }
    let mut planned = Vec::new();
    let mut alone: Vec<(Request, Vec<ServerId>)> = Vec::new();
    for (_, reqs) in by_package {
        let (p, rest) = plan(ctx, reqs).await;
        planned.extend(p);
        alone.extend(rest.into_iter().map(|r| (r, Vec::new())));
    }
    tracing::debug!(
        planned = planned.len(),
        alone = alone.len(),
        took_ms = t0.elapsed().as_secs_f64() * 1e3,
        "placement batch planned"
    );
    place_alone(ctx, alone);
    write(ctx, planned).await;
}

/// Writes a planned batch and answers each request.
async fn write(ctx: &Ctx, planned: Vec<Planned>) {
    let news: Vec<NewVm<'_>> = planned
        .iter()
        .map(|p| NewVm {
            uuid: p.req.uuid,
            alias: &p.req.alias,
            owner: p.req.owner,
            package: Some(p.req.package.uuid),
            vcpus: p.req.package.vcpus,
            memory_mib: p.req.package.memory_mib,
            server: Some(p.server),
            devices: &p.devices,
            job: p.req.job,
            image: p.req.image,
            nics: &p.req.extras.nics,
            metadata: &p.req.extras.metadata,
            tags: &p.req.extras.tags,
            keys: p.req.extras.keys.as_deref(),
        })
        .collect();
    let t0 = std::time::Instant::now();
    let written = create::create_many(&ctx.placer_db, &news, ctx.cfg.alloc).await;
    drop(news);
    tracing::debug!(
        vms = planned.len(),
        took_ms = t0.elapsed().as_secs_f64() * 1e3,
        ok = written.is_ok(),
        "placement batch written"
    );
    let mut alone: Vec<(Request, Vec<ServerId>)> = Vec::new();
    match written {
        Ok(outcomes) => {
            for (p, outcome) in planned.into_iter().zip(outcomes) {
                match outcome {
                    Ok(vm) => {
                        let _ = p.req.answer.send(Ok(vm));
                    }
                    // Lost to a writer outside this batch: placed again, alone.
                    Err(StoreError::Retry | StoreError::NoRoom(_)) => {
                        alone.push((p.req, vec![p.server]));
                    }
                    Err(e) => {
                        let _ = p.req.answer.send(Err(e.into()));
                    }
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "a placement batch failed; placing its requests one by one");
            alone.extend(planned.into_iter().map(|p| (p.req, Vec::new())));
        }
    }
    place_alone(ctx, alone);
}

/// Requests the batch could not place, each placed alone (avoiding the servers named).
fn place_alone(ctx: &Ctx, alone: Vec<(Request, Vec<ServerId>)>) {
    for (req, avoid) in alone {
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let r = super::vms::place_and_reserve(
                &ctx,
                &req.alias,
                req.owner,
                req.uuid,
                req.job,
                &req.package,
                req.image,
                &req.extras,
                avoid,
            )
            .await;
            let _ = req.answer.send(r);
        });
    }
}

/// One server of the batch's read: its free devices and its room, as the batch uses them.
struct Slot {
    server: ServerId,
    cands: Vec<Candidate>,
    room: Option<Room>,
    /// Breaks ties between servers with as many free devices, so that replicas placing at
    /// once do not all start on the same server.
    tie: u64,
}

impl Slot {
    fn free_of(&self, variant: &str) -> usize {
        self.cands.iter().filter(|c| c.variant == variant).count()
    }
}

/// Places the requests of one package on the servers the free-device index suggests,
/// as many as they hold; the rest are returned to be placed alone.
async fn plan(ctx: &Ctx, reqs: Vec<Request>) -> (Vec<Planned>, Vec<Request>) {
    use rand::Rng;
    let Some(package) = reqs.first().map(|r| r.package.clone()) else {
        return (Vec::new(), reqs);
    };
    let package = &package;
    let request = &package.devices;
    let Some((primary, &count)) = request.iter().max_by_key(|(_, n)| **n) else {
        return (Vec::new(), reqs);
    };
    let policy = package.placement.unwrap_or(ctx.cfg.placement);
    let t0 = std::time::Instant::now();
    if let Err(e) = open_vgpus(ctx, package, reqs.len()).await {
        tracing::warn!(error = %e, "opening GPUs for vGPUs; placing with the slots there are");
    }
    let variants: Vec<String> = request.keys().cloned().collect();
    // Servers enough for every request's devices and some to spare, for servers that turn
    // out short of vCPUs or memory or of NUMA-local sets; never more than one per request.
    let wanted = i64::from(count).saturating_mul(i64::try_from(reqs.len()).unwrap_or(i64::MAX));
    let need = wanted
        .saturating_mul(2)
        .saturating_add(i64::from(count) * 8);
    let limit = i64::try_from(reqs.len() + 8).unwrap_or(i64::MAX);
    let read = devices::placement_view(
        &ctx.placer_db,
        primary,
        count,
        &variants,
        ctx.alive_after_ms(),
        policy == Policy::Spread,
        need,
        limit,
        room::Fit {
            vcpus: package.vcpus,
            memory_mib: package.memory_mib,
            alloc: ctx.cfg.alloc,
        },
    )
    .await;
    // With "planned" and "written", the parts of a batch's time: where a burst's time
    // goes is read from these (BENCHMARKS.md, thirty-fifth session).
    tracing::debug!(
        took_ms = t0.elapsed().as_secs_f64() * 1e3,
        "placement candidates read (and GPUs opened for vGPUs)"
    );
    let view = match read {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(error = %e, "reading placement candidates; placing alone");
            return (Vec::new(), reqs);
        }
    };
    let mut by_server: HashMap<ServerId, Vec<Candidate>> = HashMap::new();
    for c in view.candidates {
        by_server.entry(c.server_uuid).or_default().push(c);
    }
    let mut rng = rand::thread_rng();
    let bridges = reqs.first().map(|r| r.extras.bridges.clone());
    let mut slots: Vec<Slot> = view
        .servers
        .iter()
        .filter(|s| bridges.as_ref().is_none_or(|b| b.admits(**s)))
        .map(|s| Slot {
            server: *s,
            cands: by_server.remove(s).unwrap_or_default(),
            room: view.rooms.get(s).copied(),
            tie: rng.r#gen(),
        })
        .collect();
    let mut planned = Vec::new();
    let mut alone = Vec::new();
    for req in reqs {
        match pick(&mut slots, request, primary, policy, package) {
            Some((server, devices)) => planned.push(Planned {
                req,
                server,
                devices,
            }),
            None => alone.push(req),
        }
    }
    (planned, alone)
}

/// Makes sure there are vGPU slots for `vms` VMs of `package`: for each vGPU variant it
/// asks for, opens free GPUs of the parent variant (`store::vgpus::open`). Pack opens only
/// as many as the free slots lack, so vGPUs fill the GPUs already in their type first
/// (CloudStack's depth-first); spread opens one GPU per vGPU while whole GPUs are free, so
/// each goes to the emptiest GPU (breadth-first). Answers the GPUs opened.
pub(super) async fn open_vgpus(
    ctx: &Ctx,
    package: &Package,
    vms: usize,
) -> crate::store::StoreResult<usize> {
    let fit = room::Fit {
        vcpus: package.vcpus,
        memory_mib: package.memory_mib,
        alloc: ctx.cfg.alloc,
    };
    let policy = package.placement.unwrap_or(ctx.cfg.placement);
    open_vgpus_for(ctx, &package.devices, fit, policy, vms, None).await
}

/// [`open_vgpus`] for `vms` VMs that each ask for `devices`, with room for `fit`; only on
/// server `only` when given (a VM resized in place, or migrated to a named server).
pub(super) async fn open_vgpus_for(
    ctx: &Ctx,
    devices: &BTreeMap<String, u32>,
    fit: room::Fit,
    policy: Policy,
    vms: usize,
    only: Option<ServerId>,
) -> crate::store::StoreResult<usize> {
    use crate::store::{variants, vgpus};
    let mut opened = 0;
    let mut known: Option<Vec<passage_model::Variant>> = None;
    for (name, &count) in devices {
        if known.is_none() {
            let all = variants::list(&ctx.placer_db).await?;
            if !all.iter().any(passage_model::Variant::is_vgpu) {
                return Ok(0);
            }
            known = Some(all);
        }
        let Some(v) = known
            .as_ref()
            .and_then(|all| all.iter().find(|v| &v.name == name && v.is_vgpu()))
        else {
            continue;
        };
        let need = i64::from(count).saturating_mul(i64::try_from(vms).unwrap_or(i64::MAX));
        let free = match only {
            // The free slots elsewhere are no use to a VM that stays on its server.
            Some(server) => vgpus::free_slots_on(&ctx.placer_db, name, server).await?,
            None => vgpus::free_slots(&ctx.placer_db, name, ctx.alive_after_ms()).await?,
        };
        let per_gpu = i64::from(v.max_per_gpu.unwrap_or(1).max(1));
        let gpus = match policy {
            Policy::Pack => ((need - free).max(0) + per_gpu - 1) / per_gpu,
            Policy::Spread => need,
        };
        if gpus == 0 {
            continue;
        }
        let got = vgpus::open(
            &ctx.placer_db,
            v,
            usize::try_from(gpus).unwrap_or(usize::MAX),
            policy,
            ctx.alive_after_ms(),
            fit,
            only,
        )
        .await?;
        tracing::debug!(variant = %name, wanted = gpus, opened = got.len(), "GPUs opened for vGPUs");
        opened += got.len();
    }
    Ok(opened)
}

/// The server for one more request of `package`, taken from `slots`: the first by policy
/// (fewest free devices of the primary variant for pack, most for spread) where the
/// devices share a NUMA node, else the first that fits at all.
fn pick(
    slots: &mut [Slot],
    request: &BTreeMap<String, u32>,
    primary: &str,
    policy: Policy,
    package: &Package,
) -> Option<(ServerId, Vec<DevicePath>)> {
    slots.sort_by_cached_key(|s| {
        let free = s.free_of(primary);
        let by_policy = match policy {
            Policy::Pack => free,
            Policy::Spread => usize::MAX - free,
        };
        (by_policy, s.tie)
    });
    let mut fallback: Option<(usize, Vec<DevicePath>)> = None;
    let mut chosen = None;
    for (i, slot) in slots.iter().enumerate() {
        if !room::fits(slot.room.as_ref(), package.vcpus, package.memory_mib) {
            continue;
        }
        let cands: Vec<&Candidate> = slot.cands.iter().collect();
        let Some((numa_local, devices)) = placement::pick_on_server(&cands, request, policy, None)
        else {
            continue;
        };
        if numa_local {
            chosen = Some((i, devices));
            break;
        }
        if fallback.is_none() {
            fallback = Some((i, devices));
        }
    }
    let (i, devices) = chosen.or(fallback)?;
    let slot = &mut slots[i];
    if let Some(r) = slot.room.as_mut() {
        // It fits (checked above); the reservation checks again when the batch is written.
        r.take(slot.server, package.vcpus, package.memory_mib)
            .ok()?;
    }
    slot.cands.retain(|c| !devices.contains(&c.id));
    Some((slot.server, devices))
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn package(devices: &[(&str, u32)], vcpus: u32) -> Package {
        Package {
            uuid: PackageId(Uuid::from_u128(7)),
            name: "p".into(),
            vcpus,
            memory_mib: 1024,
            disk_gib: 10,
            devices: devices.iter().map(|(v, n)| (v.to_string(), *n)).collect(),
            placement: None,
            stop_grace_s: None,
            created_at: chrono::DateTime::default(),
        }
    }

    fn slot(n: u128, devices: &[(u8, u32)], vcpus_free: Option<i64>) -> Slot {
        let server = ServerId(Uuid::from_u128(n));
        Slot {
            server,
            cands: devices
                .iter()
                .map(|(bus, numa)| Candidate {
                    server_uuid: server,
                    id: format!("/devices/pci0000:00/0000:00:01.0/0000:{bus:02x}:00.0")
                        .parse()
                        .unwrap_or_else(|e| panic!("{e}")),
                    variant: "A".into(),
                    numa_node: Some(*numa),
                    window: None,
                })
                .collect(),
            room: vcpus_free.map(|f| Room {
                vcpus_total: f,
                vcpus_used: 0,
                memory_total_mib: 1 << 20,
                memory_used_mib: 0,
            }),
            tie: u64::try_from(n).unwrap_or(0),
        }
    }

    #[test]
    fn pack_fills_one_server_before_the_next_and_spread_alternates() {
        let p = package(&[("A", 1)], 4);
        let mut slots = vec![slot(1, &[(1, 0), (2, 0)], None), slot(2, &[(1, 0)], None)];
        let order: Vec<u128> = (0..3)
            .map(|_| pick(&mut slots, &p.devices, "A", Policy::Pack, &p))
            .map(|c| c.map_or(0, |(s, _)| s.0.as_u128()))
            .collect();
        assert_eq!(order, [2, 1, 1], "fewest free first, then what is left");
        assert!(pick(&mut slots, &p.devices, "A", Policy::Pack, &p).is_none());

        let mut slots = vec![
            slot(1, &[(1, 0), (2, 0)], None),
            slot(2, &[(1, 0), (2, 0)], None),
        ];
        let order: Vec<u128> = (0..4)
            .map(|_| pick(&mut slots, &p.devices, "A", Policy::Spread, &p))
            .map(|c| c.map_or(0, |(s, _)| s.0.as_u128()))
            .collect();
        assert_eq!(order, [1, 2, 1, 2], "most free first");
    }

    #[test]
    fn numa_local_wins_and_room_is_counted() {
        // Server 1 packs better but must straddle NUMA nodes for two devices.
        let p = package(&[("A", 2)], 8);
        let mut slots = vec![
            slot(1, &[(1, 0), (2, 1)], None),
            slot(2, &[(1, 0), (2, 0), (3, 1)], Some(8)),
        ];
        let (s, devs) = pick(&mut slots, &p.devices, "A", Policy::Pack, &p)
            .unwrap_or_else(|| panic!("no placement"));
        assert_eq!(s.0.as_u128(), 2);
        assert_eq!(devs.len(), 2);
        // Server 2 has no vCPUs left now: the straddling server is all there is.
        let (s, _) = pick(&mut slots, &p.devices, "A", Policy::Pack, &p)
            .unwrap_or_else(|| panic!("no placement"));
        assert_eq!(s.0.as_u128(), 1);
        assert!(pick(&mut slots, &p.devices, "A", Policy::Pack, &p).is_none());
    }
}
