//! GPUs that host vGPUs. A vGPU request that finds too few free slots of its variant
//! "opens" free GPUs of the parent variant: each goes `unassigned → shared` (a
//! conditional write on the GPU's row, so a whole-GPU reservation and an opening never
//! both win) and gets its slots, rows of `devices` named by the GPU's path and a UUID,
//! with `parent` set. From then on the slots are reserved, released and scrubbed as any
//! device, through `store::reserve`: a GPU never hosts more vGPUs than it has slots, and
//! a node's inventory never touches them. When the last slot of a GPU is free again after
//! its scrub, the GPU is "closed": its slots go and it turns `dirty`, so a full scrub
//! runs before it is whole again.

use super::devices::DeviceTx;
use super::reserve::free_index::{FreeIndexTx, Taken};
use super::room::{Fit, has_room_sql};
use super::{Db, StoreResult, corrupt, now_ms, parse_uuid};
use crate::in_tx;
use crate::placement::Policy;
use crate::store::reserve::devices::placeable;
use passage_model::vgpu::{VgpuHost, VgpuType, type_from_name};
use passage_model::{DeviceEvent, DevicePath, DeviceState, PciDetails, ServerId, Variant};
use std::collections::HashMap;

/// A GPU opened for a vGPU variant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Opened {
    pub server: ServerId,
    pub gpu: DevicePath,
    pub slots: u32,
}

/// The type `want` (a type id or name) among those a GPU reports.
pub fn find_type<'a>(host: &'a VgpuHost, want: &str) -> Option<&'a VgpuType> {
    host.types
        .iter()
        .find(|t| t.id == want)
        .or_else(|| host.types.iter().find(|t| t.name == want))
}

/// Whether the type `v` asks for is MIG-backed: as the node lists it on the GPU, else
/// as NVIDIA's name for it says (a vendor-VFIO GPU lists only the types of its current
/// mode); `None` when neither tells.
pub fn wants_mig(v: &Variant, host: Option<&VgpuHost>) -> Option<bool> {
    let want = v.vgpu_type.as_deref()?;
    host.and_then(|h| find_type(h, want))
        .and_then(|t| t.mig_backed)
        .or_else(|| type_from_name(want).1)
}

/// The GPU offers `v`'s type once its MIG mode changes: the mode is known, the type
/// needs the other one, and no vGPU exists on it (the driver changes the mode of an idle
/// GPU only). The node makes the change when it makes the first vGPU.
fn after_mig_switch(v: &Variant, host: &VgpuHost) -> bool {
    host.vgpus.is_empty()
        && matches!((host.mig_mode, wants_mig(v, Some(host))), (Some(m), Some(w)) if m != w)
}

/// How many slots of `v` a free GPU with these details gets: the variant's
/// `max_per_gpu`, or fewer when the node says the type fits fewer times; `None` when the
/// node does not offer the type on it now nor after a MIG mode change (no vGPU support,
/// another mode it cannot leave).
pub fn slots_on(v: &Variant, details: Option<&PciDetails>) -> Option<u32> {
    let host = details?.vgpu.as_ref()?;
    let want = v.vgpu_type.as_deref()?;
    let per_gpu = v.max_per_gpu?;
    let listed = find_type(host, want);
    if after_mig_switch(v, host) {
        let max = listed.and_then(|t| t.max_instances).unwrap_or(per_gpu);
        return Some(per_gpu.min(max)).filter(|n| *n > 0);
    }
    let t = listed?;
    if t.available == 0 {
        return None;
    }
    let fits = t.max_instances.unwrap_or(t.available).min(t.available);
    Some(per_gpu.min(fits)).filter(|n| *n > 0)
}

/// How many slots of `v` a GPU with these details hosts at most (whatever it does now):
/// the variant's `max_per_gpu`, or the node's count for the type when lower; 0 when the
/// node does not list the type for it and no MIG mode change would make it.
pub fn slots_max(v: &Variant, details: Option<&PciDetails>) -> u32 {
    let per_gpu = v.max_per_gpu.unwrap_or(0);
    let Some(host) = details.and_then(|d| d.vgpu.as_ref()) else {
        return 0;
    };
    match v
        .vgpu_type
        .as_deref()
        .and_then(|want| find_type(host, want))
    {
        Some(t) => t.max_instances.map_or(per_gpu, |m| m.min(per_gpu)),
        None if after_mig_switch(v, host) => per_gpu,
        None => 0,
    }
}

/// A whole GPU, in the units [`share_of`] counts: divisible by every count from 1 to 16.
pub const WHOLE_GPU: u64 = 720_720;

/// What one vGPU of `v` takes of a GPU with these details when types mix on it: `1/n`
/// of [`WHOLE_GPU`] (rounded up), where `n` is how many of the type the GPU hosts alone.
pub fn share_of(v: &Variant, details: Option<&PciDetails>) -> u64 {
    let n = match slots_max(v, details) {
        0 => v.max_per_gpu.unwrap_or(1),
        n => n,
    };
    WHOLE_GPU.div_ceil(u64::from(n.max(1)))
}

type GpuRow = (String, String, i64, Option<String>, Option<String>);
/// A GPU that can host the type: its server, path, generation, the slots it gets, and
/// whether it already hosts vGPUs of other variants that mix (a join) or is whole.
type Eligible = (ServerId, DevicePath, i64, u32, bool);

/// Opens up to `gpus` free GPUs of `v`'s parent variant for `v`, on servers heard from
/// since `alive_after_ms` with room for one VM of `fit`: for `pack`, on the servers with
/// the fewest such GPUs free (they fill up first), for `spread` the most, one per server
/// in turn. Only the first `gpus + 8` servers of the free-device index in that order are
/// read. Answers those
/// it opened; a GPU taken meanwhile is skipped. When every GPU it found was taken or
/// changed meanwhile (a concurrent opening, another joiner), it reads again, up to
/// [`OPEN_ATTEMPTS`] times: a loser of that race still gets a GPU while one has room.
pub async fn open(
    db: &Db,
    v: &Variant,
    gpus: usize,
    policy: Policy,
    alive_after_ms: i64,
    fit: Fit,
    only: Option<ServerId>,
) -> StoreResult<Vec<Opened>> {
    for _ in 0..OPEN_ATTEMPTS {
        let (opened, found) = open_once(db, v, gpus, policy, alive_after_ms, fit, only).await?;
        if !opened.is_empty() || found == 0 {
            return Ok(opened);
        }
    }
    Ok(Vec::new())
}

/// Readings of the fleet one [`open`] makes at most.
const OPEN_ATTEMPTS: usize = 4;

/// One try of [`open`]: the GPUs opened, and how many it tried (0: none could host the
/// type, and another read would find none either).
async fn open_once(
    db: &Db,
    v: &Variant,
    gpus: usize,
    policy: Policy,
    alive_after_ms: i64,
    fit: Fit,
    only: Option<ServerId>,
) -> StoreResult<(Vec<Opened>, usize)> {
    let Some(parent) = v.parent.as_deref().filter(|_| v.is_vgpu() && gpus > 0) else {
        return Ok((Vec::new(), 0));
    };
    // The servers come from the free-device index, in policy order, as many as GPUs are
    // wanted and a few more (a GPU may not offer the type): the read stays the size of
    // the request, not of the fleet. Pack takes GPUs from as few servers as it can, so it
    // stops at the server where the free GPUs counted so far reach that number ($7):
    // the devices of two or three servers, not of twenty, for a batch's sixteen GPUs.
    // The running count is taken over the first servers only, after the `LIMIT`, so
    // that the servers can be read in the index's order and the read can stop there.
    let order = match policy {
        Policy::Pack => "ASC",
        Policy::Spread => "DESC",
    };
    // One text with a server and one without: `$6 IS NULL OR …` in a single text made
    // Postgres expect a handful of rows and sort them all instead of walking the index
    // in order (1.5 ms against 0.1 ms a batch at 1,250 servers).
    let only_sql = match only {
        Some(_) => "AND f.server_uuid = $6",
        None => "AND CAST($6 AS TEXT) IS NULL",
    };
    let sql = format!(
        "WITH h AS MATERIALIZED (SELECT uuid FROM (SELECT uuid, \
         SUM(free) OVER (ORDER BY free {order}, uuid ROWS UNBOUNDED PRECEDING) - free AS before \
         FROM (SELECT f.server_uuid AS uuid, f.free FROM free_devices f \
         JOIN servers s ON s.uuid = f.server_uuid \
         WHERE f.variant = $1 AND f.free > 0 AND s.last_heartbeat >= $2 AND s.disabled = 0 \
         {only_sql} \
         AND {} ORDER BY f.free {order}, f.server_uuid LIMIT $5) c) w WHERE w.before < $7) \
         SELECT d.server_uuid, d.id, d.generation, d.details, d.variant \
         FROM h CROSS JOIN devices d WHERE d.server_uuid = h.uuid AND d.parent IS NULL AND {}",
        has_room_sql(fit.alloc, "$3", "$4"),
        placeable("d."),
    );
    let memory = i64::try_from(fit.memory_mib).unwrap_or(i64::MAX);
    let servers = i64::try_from(gpus.saturating_add(8)).unwrap_or(i64::MAX);
    let enough = match policy {
        Policy::Pack => servers,
        Policy::Spread => i64::MAX,
    };
    let rows: Vec<GpuRow> = crate::on_read!(db, |p| sqlx::query_as(&sql)
        .bind(parent)
        .bind(alive_after_ms)
        .bind(i64::from(fit.vcpus))
        .bind(memory)
        .bind(servers)
        .bind(only.map(|s| s.to_string()))
        .bind(enough)
        .fetch_all(p)
        .await)?;
    let mut eligible: Vec<Eligible> = Vec::new();
    for (server, id, generation, details, variant) in rows {
        // The variant is checked here, not in the statement: with it there, Postgres
        // walked the variant's index once per suggested server (150,000 rows a batch on
        // a fresh fleet) instead of each server's few devices by key.
        if variant.as_deref() != Some(parent) {
            continue;
        }
        let details: Option<PciDetails> = details
            .as_deref()
            .and_then(|j| serde_json::from_str(j).ok());
        if let Some(n) = slots_on(v, details.as_ref()) {
            eligible.push((
                parse_uuid(&server, "server")?,
                id.parse().map_err(corrupt)?,
                generation,
                n,
                false,
            ));
        }
    }
    let mut per_server: HashMap<ServerId, usize> = HashMap::new();
    for (s, ..) in &eligible {
        *per_server.entry(*s).or_default() += 1;
    }
    eligible.sort_by_cached_key(|(s, id, ..)| {
        let n = per_server.get(s).copied().unwrap_or(0);
        let by_policy = match policy {
            Policy::Pack => n,
            Policy::Spread => usize::MAX - n,
        };
        (by_policy, *s, id.clone())
    });
    // Spread opens one GPU per server in turn: the emptiest GPUs are on different nodes.
    if policy == Policy::Spread {
        let mut round: HashMap<ServerId, usize> = HashMap::new();
        eligible = {
            let mut keyed: Vec<(usize, usize, Eligible)> = eligible
                .into_iter()
                .enumerate()
                .map(|(i, e)| {
                    let r = round.entry(e.0).or_default();
                    *r += 1;
                    (*r, i, e)
                })
                .collect();
            keyed.sort_by_key(|(r, i, _)| (*r, *i));
            keyed.into_iter().map(|(_, _, e)| e).collect()
        };
    }
    let mut reclaim: HashMap<(ServerId, DevicePath), Vec<String>> = HashMap::new();
    if v.mix {
        // Mixing variants fill GPUs already hosting them first when packing (CloudStack's
        // depth-first), and only once whole GPUs run out when spreading.
        let mut found = joinable(db, v, parent, alive_after_ms, Some(fit), only).await?;
        found.sort_by_key(|j| match policy {
            Policy::Pack => (j.room, j.gpu.0, j.gpu.1.clone()),
            Policy::Spread => (u64::MAX - j.room, j.gpu.0, j.gpu.1.clone()),
        });
        let joins = found.into_iter().map(|j| {
            reclaim.insert((j.gpu.0, j.gpu.1.clone()), j.reclaim);
            j.gpu
        });
        eligible = match policy {
            Policy::Pack => joins.chain(eligible).collect(),
            Policy::Spread => eligible.into_iter().chain(joins).collect(),
        };
    }
    eligible.truncate(gpus);
    if eligible.is_empty() {
        return Ok((Vec::new(), 0));
    }
    let found = eligible.len();
    let to = passage_model::transition(DeviceState::Unassigned, DeviceEvent::Share)
        .map_err(|e| corrupt(e.to_string()))?;
    let name = v.name.clone();
    let vgpu_type = v.vgpu_type.clone().unwrap_or_default();
    let now = now_ms();
    // A batch opens many GPUs at once: each statement below writes all of them (in
    // chunks), not one GPU or one slot at a time, so the one SQLite writer runs a handful
    // of statements per batch instead of six per GPU.
    let reason = |n: u32| format!("hosts {n} vGPU(s) of type {vgpu_type:?} (variant {name})");
    let (joins, whole): (Vec<Eligible>, Vec<Eligible>) =
        eligible.iter().cloned().partition(|e| e.4);
    if let (Db::Postgres(pool), true) = (db, joins.is_empty()) {
        let reasons: Vec<String> = whole.iter().map(|e| reason(e.3)).collect();
        let won = open_whole_pg(pool, &whole, &reasons, &name, parent, to.as_str(), now).await?;
        return Ok((opened_of(&eligible, &won), found));
    }
    let postgres = db.backend() == "postgres";
    in_tx!(db, |tx| {
        if postgres {
            // An opening need not wait for the disk: it only turns free GPUs into free
            // slots. A reservation of those slots commits durably after it, and Postgres
            // flushes the WAL in order, so no held slot can outlive its opening; an
            // opening lost in a crash leaves its GPUs whole, as if never opened. The
            // flush it skips is a second one per placement batch beside the batch's own.
            sqlx::query("SET LOCAL synchronous_commit = off")
                .execute(&mut *tx)
                .await?;
        }
        let mut won: std::collections::HashSet<(String, String)> = std::collections::HashSet::new();
        // What the free-device index gains and loses, by (server, variant): every device
        // counted here was placeable when a conditional statement below changed it.
        let mut free: Taken = Taken::new();
        for chunk in whole.chunks(CHUNK) {
            let rows: Vec<String> = (0..chunk.len())
                .map(|i| {
                    format!(
                        "(${}, ${}, CAST(${} AS BIGINT))",
                        3 * i + 3,
                        3 * i + 4,
                        3 * i + 5
                    )
                })
                .collect();
            let sql = format!(
                "UPDATE devices SET state = $1, generation = generation + 1, updated_at = $2 \
                 FROM (VALUES {}) AS v WHERE devices.server_uuid = v.column1 \
                 AND devices.id = v.column2 AND devices.generation = v.column3 \
                 AND devices.parent IS NULL AND devices.state = 'unassigned' \
                 AND devices.missing = 0 AND devices.taint IS NULL \
                 RETURNING server_uuid, id",
                rows.join(", ")
            );
            let mut q = sqlx::query_as::<_, (String, String)>(&sql)
                .bind(to.as_str())
                .bind(now);
            for (server, gpu, generation, ..) in chunk {
                q = q
                    .bind(server.to_string())
                    .bind(gpu.to_string())
                    .bind(*generation);
            }
            won.extend(q.fetch_all(&mut *tx).await?);
        }
        // A join is conditional on the GPU's generation as read: an opening or closing
        // meanwhile (each bumps it) changed the slots its room was counted from.
        for (server, gpu, generation, ..) in &joins {
            let hit: Option<(String, String)> = sqlx::query_as(
                "UPDATE devices SET generation = generation + 1, updated_at = $1 \
                 WHERE server_uuid = $2 AND id = $3 AND generation = $4 \
                 AND parent IS NULL AND state = 'shared' AND missing = 0 AND taint IS NULL \
                 RETURNING server_uuid, id",
            )
            .bind(now)
            .bind(server.to_string())
            .bind(gpu.to_string())
            .bind(*generation)
            .fetch_optional(&mut *tx)
            .await?;
            if hit.is_none() {
                continue;
            }
            // The free slots of other variants it takes back: one taken meanwhile leaves
            // too little room, and the GPU gets no new slot this time.
            let ids = reclaim
                .get(&(*server, gpu.clone()))
                .map(Vec::as_slice)
                .unwrap_or_default();
            let mut gone = 0;
            for slot in ids {
                let variant: Option<Option<String>> = sqlx::query_scalar(&format!(
                    "DELETE FROM devices WHERE server_uuid = $1 AND id = $2 \
                     AND parent IS NOT NULL AND {} RETURNING variant",
                    placeable("")
                ))
                .bind(server.to_string())
                .bind(slot)
                .fetch_optional(&mut *tx)
                .await?;
                if let Some(variant) = variant {
                    gone += 1;
                    if let Some(variant) = variant {
                        *free.entry((server.to_string(), variant)).or_default() -= 1;
                    }
                }
            }
            if gone == ids.len() {
                won.extend(hit);
            }
        }
        let opened = opened_of(&eligible, &won);
        let slots: Vec<(String, String, String)> = opened
            .iter()
            .flat_map(|o| {
                (0..o.slots).map(|_| {
                    (
                        o.server.to_string(),
                        o.gpu.to_string(),
                        o.gpu.with_vgpu(uuid::Uuid::new_v4()).to_string(),
                    )
                })
            })
            .collect();
        for chunk in slots.chunks(CHUNK) {
            let rows: Vec<String> = (0..chunk.len())
                .map(|i| format!("(${}, ${}, ${})", 3 * i + 3, 3 * i + 4, 3 * i + 5))
                .collect();
            let sql = format!(
                "INSERT INTO devices (server_uuid, id, bdf, vendor, device, subvendor, \
                 subsystem, revision, class, driver, numa_node, iommu_group, variant, \
                 state, used_by, generation, missing, taint, updated_at, details, parent) \
                 SELECT d.server_uuid, v.column3, d.bdf, d.vendor, d.device, d.subvendor, \
                 d.subsystem, d.revision, d.class, NULL, d.numa_node, d.iommu_group, $1, \
                 'unassigned', NULL, 0, 0, NULL, $2, NULL, d.id \
                 FROM (VALUES {}) AS v JOIN devices d \
                 ON d.server_uuid = v.column1 AND d.id = v.column2",
                rows.join(", ")
            );
            let mut q = sqlx::query(&sql).bind(&name).bind(now);
            for (server, gpu, slot) in chunk {
                q = q.bind(server).bind(gpu).bind(slot);
            }
            q.execute(&mut *tx).await?;
        }
        for chunk in opened.chunks(CHUNK) {
            let rows: Vec<String> = (0..chunk.len())
                .map(|i| {
                    format!(
                        "(${}, ${}, ${}, $1, ${}, $2)",
                        4 * i + 3,
                        4 * i + 4,
                        4 * i + 5,
                        4 * i + 6
                    )
                })
                .collect();
            let sql = format!(
                "INSERT INTO device_events (server_uuid, device, from_state, to_state, \
                 reason, at) VALUES {}",
                rows.join(", ")
            );
            let mut q = sqlx::query(&sql).bind(to.as_str()).bind(now);
            for o in chunk {
                let joined = joins.iter().any(|j| j.0 == o.server && j.1 == o.gpu);
                q = q
                    .bind(o.server.to_string())
                    .bind(o.gpu.to_string())
                    .bind(if joined { "shared" } else { "unassigned" })
                    .bind(if joined {
                        format!("also {}", reason(o.slots))
                    } else {
                        reason(o.slots)
                    });
            }
            q.execute(&mut *tx).await?;
        }
        for o in &opened {
            *free
                .entry((o.server.to_string(), name.clone()))
                .or_default() += i64::from(o.slots);
            if !joins.iter().any(|j| j.0 == o.server && j.1 == o.gpu) {
                *free
                    .entry((o.server.to_string(), parent.to_string()))
                    .or_default() -= 1;
            }
        }
        tx.add_free(&free).await?;
        Ok((opened, found))
    })
}

/// The GPUs of `eligible` whose write won (by server and path, as the statements answer).
fn opened_of(
    eligible: &[Eligible],
    won: &std::collections::HashSet<(String, String)>,
) -> Vec<Opened> {
    eligible
        .iter()
        .filter(|(server, gpu, ..)| won.contains(&(server.to_string(), gpu.to_string())))
        .map(|(server, gpu, _, slots, _)| Opened {
            server: *server,
            gpu: gpu.clone(),
            slots: *slots,
        })
        .collect()
}

/// The opening of whole GPUs on Postgres as one statement over arrays: each GPU's
/// conditional `unassigned → shared`, its slots, its event and both counts of the
/// free-device index, for the GPUs whose write won. One text whatever the batch, so it
/// is planned once per connection; the statements of the general path (a `VALUES` list
/// per chunk, a text per size) were about half of a vGPU placement batch's time there:
/// 7–18 ms against 6–9 ms for the batch's own write, measured at 1,250 × 8.
async fn open_whole_pg(
    pool: &sqlx::PgPool,
    whole: &[Eligible],
    reasons: &[String],
    variant: &str,
    parent: &str,
    to: &str,
    now: i64,
) -> StoreResult<std::collections::HashSet<(String, String)>> {
    // Every GPU's slots are named now; those of a GPU that loses its write are not
    // inserted (the join on `won`).
    let mut slot_gpus: (Vec<String>, Vec<String>, Vec<String>) = Default::default();
    for (server, gpu, _, n, _) in whole {
        for _ in 0..*n {
            slot_gpus.0.push(server.to_string());
            slot_gpus.1.push(gpu.to_string());
            slot_gpus
                .2
                .push(gpu.with_vgpu(uuid::Uuid::new_v4()).to_string());
        }
    }
    let sql = "WITH won AS (UPDATE devices SET state = $1, generation = devices.generation + 1, \
         updated_at = $2 \
         FROM UNNEST($3::text[], $4::text[], $5::int8[], $6::text[]) AS v(s, id, g, why) \
         WHERE devices.server_uuid = v.s AND devices.id = v.id AND devices.generation = v.g \
         AND devices.parent IS NULL AND devices.state = 'unassigned' \
         AND devices.missing = 0 AND devices.taint IS NULL \
         RETURNING devices.server_uuid, devices.id, devices.bdf, devices.vendor, \
         devices.device, devices.subvendor, devices.subsystem, devices.revision, \
         devices.class, devices.numa_node, devices.iommu_group, v.why), \
         slots AS (INSERT INTO devices (server_uuid, id, bdf, vendor, device, subvendor, \
         subsystem, revision, class, driver, numa_node, iommu_group, variant, \
         state, used_by, generation, missing, taint, updated_at, details, parent) \
         SELECT w.server_uuid, x.slot, w.bdf, w.vendor, w.device, w.subvendor, \
         w.subsystem, w.revision, w.class, NULL, w.numa_node, w.iommu_group, $9, \
         'unassigned', NULL, 0, 0, NULL, $2, NULL, w.id \
         FROM won w JOIN UNNEST($7::text[], $8::text[], $11::text[]) AS x(s, gpu, slot) \
         ON x.s = w.server_uuid AND x.gpu = w.id RETURNING server_uuid), \
         ev AS (INSERT INTO device_events (server_uuid, device, from_state, to_state, \
         reason, at) SELECT w.server_uuid, w.id, 'unassigned', $1, w.why, $2 FROM won w \
         RETURNING 1), \
         less AS (UPDATE free_devices SET free = free_devices.free - c.n \
         FROM (SELECT server_uuid, COUNT(*) AS n FROM won GROUP BY server_uuid) c \
         WHERE free_devices.server_uuid = c.server_uuid AND free_devices.variant = $10 \
         RETURNING 1), \
         more AS (INSERT INTO free_devices (server_uuid, variant, free) \
         SELECT server_uuid, $9, COUNT(*) FROM slots GROUP BY server_uuid \
         ON CONFLICT (server_uuid, variant) DO UPDATE \
         SET free = free_devices.free + excluded.free RETURNING 1) \
         SELECT server_uuid, id FROM won";
    let mut tx = pool.begin().await?;
    // As in the general path: an opening need not wait for the disk.
    sqlx::query("SET LOCAL synchronous_commit = off")
        .execute(&mut *tx)
        .await?;
    let won: Vec<(String, String)> = sqlx::query_as(sql)
        .bind(to)
        .bind(now)
        .bind(whole.iter().map(|e| e.0.to_string()).collect::<Vec<_>>())
        .bind(whole.iter().map(|e| e.1.to_string()).collect::<Vec<_>>())
        .bind(whole.iter().map(|e| e.2).collect::<Vec<_>>())
        .bind(reasons)
        .bind(&slot_gpus.0)
        .bind(&slot_gpus.1)
        .bind(variant)
        .bind(parent)
        .bind(&slot_gpus.2)
        .fetch_all(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(won.into_iter().collect())
}

/// A GPU that a mixing variant can join, as [`joinable`] finds it.
pub(crate) struct Join {
    /// Its server, path, generation, the slots a join adds (`n`), and `true`.
    pub(crate) gpu: Eligible,
    /// Its room now, in [`WHOLE_GPU`] units, counting free slots of other variants as
    /// room (a join takes them back).
    room: u64,
    /// Free slots of other variants it deletes to make that room, largest first.
    reclaim: Vec<String>,
}

type SlotRow = (String, String, i64, Option<String>, String, String, String);

/// GPUs of `parent` already hosting vGPUs, all of variants that mix (as `v` does) and need
/// the same MIG mode, with room for at least one more of `v` once the free slots of the
/// other variants are taken back, on servers heard from since `alive_after_ms` with room
/// for one VM of `fit` (any room, for `None`: what the capacity view counts).
pub(crate) async fn joinable(
    db: &Db,
    v: &Variant,
    parent: &str,
    alive_after_ms: i64,
    fit: Option<Fit>,
    only: Option<ServerId>,
) -> StoreResult<Vec<Join>> {
    let room = match fit {
        Some(fit) => has_room_sql(fit.alloc, "$3", "$4"),
        // The same parameters, bound to 0, so that the statement's shape does not change.
        None => "$3 >= 0 AND $4 >= 0".to_string(),
    };
    let fit = fit.unwrap_or(Fit {
        vcpus: 0,
        memory_mib: 0,
        alloc: Default::default(),
    });
    let sql = format!(
        "SELECT g.server_uuid, g.id, g.generation, g.details, x.id, x.variant, x.state \
         FROM devices g JOIN servers s ON s.uuid = g.server_uuid \
         JOIN devices x ON x.server_uuid = g.server_uuid AND x.parent = g.id \
         WHERE g.variant = $1 AND g.state = 'shared' AND g.parent IS NULL \
         AND g.missing = 0 AND g.taint IS NULL \
         AND s.last_heartbeat >= $2 AND s.disabled = 0 \
         AND ($5 IS NULL OR g.server_uuid = $5) AND {room} \
         ORDER BY g.server_uuid, g.id",
    );
    let memory = i64::try_from(fit.memory_mib).unwrap_or(i64::MAX);
    let rows: Vec<SlotRow> = crate::on_read!(db, |p| sqlx::query_as(&sql)
        .bind(parent)
        .bind(alive_after_ms)
        .bind(i64::from(fit.vcpus))
        .bind(memory)
        .bind(only.map(|s| s.to_string()))
        .fetch_all(p)
        .await)?;
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let all = super::variants::list(db).await?;
    let by_name: HashMap<&str, &Variant> = all.iter().map(|u| (u.name.as_str(), u)).collect();
    // Per GPU: (server, id), its generation, details, and its slots (id, variant, free).
    type Slots = Vec<(String, String, bool)>;
    type Gpu = ((String, String), i64, Option<String>, Slots);
    let mut gpus: Vec<Gpu> = Vec::new();
    for (server, id, generation, details, slot, variant, state) in rows {
        let key = (server, id);
        let entry = (slot, variant, state == "unassigned");
        match gpus.last_mut() {
            Some(g) if g.0 == key => g.3.push(entry),
            _ => gpus.push((key, generation, details, vec![entry])),
        }
    }
    let mut out = Vec::new();
    'gpus: for ((server, id), generation, details, slots) in gpus {
        let details: Option<PciDetails> = details
            .as_deref()
            .and_then(|j| serde_json::from_str(j).ok());
        let host = details.as_ref().and_then(|d| d.vgpu.as_ref());
        let mig = wants_mig(v, host);
        let mut used: u64 = 0;
        let mut mine: u32 = 0;
        // (share, slot) of the free slots of other variants.
        let mut others_free: Vec<(u64, String)> = Vec::new();
        for (slot, name, free) in slots {
            let Some(u) = by_name.get(name.as_str()) else {
                continue 'gpus;
            };
            let same_mode = match (mig, wants_mig(u, host)) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            };
            if !u.mix || u.parent.as_deref() != Some(parent) || !same_mode {
                continue 'gpus;
            }
            let share = share_of(u, details.as_ref());
            if u.name == v.name {
                mine += 1;
                used = used.saturating_add(share);
            } else if free {
                others_free.push((share, slot));
            } else {
                used = used.saturating_add(share);
            }
        }
        let room = WHOLE_GPU.saturating_sub(used);
        let one = share_of(v, details.as_ref());
        let n = u32::try_from(room / one)
            .unwrap_or(u32::MAX)
            .min(v.max_per_gpu.unwrap_or(0).saturating_sub(mine));
        if n == 0 {
            continue;
        }
        // Take back only as many free slots of the others as the new ones need.
        let mut left = WHOLE_GPU
            .saturating_sub(used)
            .saturating_sub(others_free.iter().map(|(s, _)| *s).sum::<u64>());
        let need = one.saturating_mul(u64::from(n));
        others_free.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        let mut reclaim = Vec::new();
        for (share, slot) in others_free {
            if left >= need {
                break;
            }
            left = left.saturating_add(share);
            reclaim.push(slot);
        }
        out.push(Join {
            gpu: (
                parse_uuid(&server, "server")?,
                id.parse().map_err(corrupt)?,
                generation,
                n,
                true,
            ),
            room,
            reclaim,
        });
    }
    Ok(out)
}

/// Rows per multi-row statement when opening GPUs: 3 or 4 values each, far below
/// SQLite's limit on a statement's values.
const CHUNK: usize = 500;

/// Closes those of `gpus` (ids on `server`) whose vGPU slots are all free: the slots go
/// and the GPU turns `dirty` (`Unshare`), to be scrubbed whole. On Postgres the server's
/// row is locked first, as a reservation locks it before it takes a slot: a slot is never
/// taken from a GPU being closed. Answers the GPUs closed.
pub async fn close_idle(db: &Db, server: ServerId, gpus: &[String]) -> StoreResult<Vec<String>> {
    if gpus.is_empty() {
        return Ok(Vec::new());
    }
    let server_s = server.to_string();
    let lock = matches!(db, Db::Postgres(_))
        .then_some("SELECT 1 FROM servers WHERE uuid = $1 FOR NO KEY UPDATE");
    in_tx!(db, |tx| {
        if let Some(lock) = lock {
            let _: Vec<(i32,)> = sqlx::query_as(lock)
                .bind(&server_s)
                .fetch_all(&mut *tx)
                .await?;
        }
        let mut closed = Vec::new();
        for gpu in gpus {
            let (slots, busy): (i64, i64) = sqlx::query_as(
                "SELECT COUNT(*), CAST(COALESCE(SUM(CASE WHEN state = 'unassigned' THEN 0 \
                 ELSE 1 END), 0) AS BIGINT) FROM devices WHERE server_uuid = $1 AND parent = $2",
            )
            .bind(&server_s)
            .bind(gpu)
            .fetch_one(&mut *tx)
            .await?;
            if slots == 0 || busy > 0 {
                continue;
            }
            sqlx::query("DELETE FROM devices WHERE server_uuid = $1 AND parent = $2")
                .bind(&server_s)
                .bind(gpu)
                .execute(&mut *tx)
                .await?;
            let moved = tx
                .move_devices(
                    server,
                    std::slice::from_ref(gpu),
                    DeviceEvent::Unshare,
                    None,
                    "its last vGPU is gone: scrubbed whole before it is assignable again",
                )
                .await?;
            if !moved.is_empty() {
                closed.push(gpu.clone());
            }
        }
        if !closed.is_empty() {
            tx.refresh_free(server).await?;
        }
        Ok(closed)
    })
}

/// GPUs hosting vGPUs whose slots are all free and untouched since `before_ms`, on
/// servers heard from since `alive_after_ms` (an offline node cannot scrub): (server,
/// GPU id), to be closed.
pub async fn idle_hosts(
    db: &Db,
    before_ms: i64,
    alive_after_ms: i64,
) -> StoreResult<Vec<(ServerId, String)>> {
    let rows: Vec<(String, String)> = crate::on_read!(db, |p| sqlx::query_as(
        "SELECT d.server_uuid, d.parent FROM devices d \
         JOIN servers s ON s.uuid = d.server_uuid \
         WHERE d.parent IS NOT NULL AND s.last_heartbeat >= $2 \
         GROUP BY d.server_uuid, d.parent \
         HAVING SUM(CASE WHEN d.state = 'unassigned' THEN 0 ELSE 1 END) = 0 \
         AND MAX(d.updated_at) < $1"
    )
    .bind(before_ms)
    .bind(alive_after_ms)
    .fetch_all(p)
    .await)?;
    rows.into_iter()
        .map(|(s, g)| Ok((parse_uuid(&s, "server")?, g)))
        .collect()
}

/// The GPUs hosting these slot ids (those of `ids` that are vGPU slots), each once.
pub fn parents_of(ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = ids
        .iter()
        .filter_map(|id| id.parse::<DevicePath>().ok())
        .filter(|p| p.vgpu().is_some())
        .map(|p| p.gpu().to_string())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Free vGPU slots of `variant` on `server`, from the free-device index.
pub async fn free_slots_on(db: &Db, variant: &str, server: ServerId) -> StoreResult<i64> {
    let n: Option<i64> = crate::on_read!(db, |p| sqlx::query_scalar(
        "SELECT CAST(SUM(free) AS BIGINT) FROM free_devices \
         WHERE variant = $1 AND server_uuid = $2"
    )
    .bind(variant)
    .bind(server.to_string())
    .fetch_one(p)
    .await)?;
    Ok(n.unwrap_or(0))
}

/// Free vGPU slots of `variant` on servers heard from since `alive_after_ms`, from the
/// free-device index. Asked once per placement batch: `free > 0` lets Postgres read only
/// the servers with free slots through the index on `(variant, free)`, not every server
/// that ever hosted the type.
pub async fn free_slots(db: &Db, variant: &str, alive_after_ms: i64) -> StoreResult<i64> {
    let n: Option<i64> = crate::on_read!(db, |p| sqlx::query_scalar(
        "SELECT CAST(SUM(f.free) AS BIGINT) FROM free_devices f \
         JOIN servers s ON s.uuid = f.server_uuid \
         WHERE f.variant = $1 AND f.free > 0 AND s.last_heartbeat >= $2 AND s.disabled = 0"
    )
    .bind(variant)
    .bind(alive_after_ms)
    .fetch_one(p)
    .await)?;
    Ok(n.unwrap_or(0))
}
