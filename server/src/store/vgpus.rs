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
use super::reserve::free_index::FreeIndexTx;
use super::room::{Fit, has_room_sql};
use super::{Db, StoreResult, corrupt, now_ms, parse_uuid};
use crate::in_tx;
use crate::placement::Policy;
use crate::store::reserve::devices::placeable;
use passage_model::vgpu::{VgpuHost, VgpuType};
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

/// How many slots of `v` a free GPU with these details gets: the variant's
/// `max_per_gpu`, or fewer when the node says the type fits fewer times; `None` when the
/// node does not offer the type on it now (no vGPU support, another mode, MIG off).
pub fn slots_on(v: &Variant, details: Option<&PciDetails>) -> Option<u32> {
    let host = details?.vgpu.as_ref()?;
    let t = find_type(host, v.vgpu_type.as_deref()?)?;
    if t.available == 0 {
        return None;
    }
    let fits = t.max_instances.unwrap_or(t.available).min(t.available);
    Some(v.max_per_gpu?.min(fits)).filter(|n| *n > 0)
}

/// How many slots of `v` a GPU with these details hosts at most (whatever it does now):
/// the variant's `max_per_gpu`, or the node's count for the type when lower; 0 when the
/// node does not list the type for it.
pub fn slots_max(v: &Variant, details: Option<&PciDetails>) -> u32 {
    let Some(t) = details
        .and_then(|d| d.vgpu.as_ref())
        .zip(v.vgpu_type.as_deref())
        .and_then(|(host, want)| find_type(host, want))
    else {
        return 0;
    };
    let per_gpu = v.max_per_gpu.unwrap_or(0);
    t.max_instances.map_or(per_gpu, |m| m.min(per_gpu))
}

type GpuRow = (String, String, i64, Option<String>, Option<String>);
/// A free GPU that offers the type: its server, path, generation and slots.
type Eligible = (ServerId, DevicePath, i64, u32);

/// Opens up to `gpus` free GPUs of `v`'s parent variant for `v`, on servers heard from
/// since `alive_after_ms` with room for one VM of `fit`: for `pack`, on the servers with
/// the fewest such GPUs free (they fill up first), for `spread` the most, one per server
/// in turn. Only the first `gpus + 8` servers of the free-device index in that order are
/// read. Answers those
/// it opened; a GPU taken meanwhile is skipped.
pub async fn open(
    db: &Db,
    v: &Variant,
    gpus: usize,
    policy: Policy,
    alive_after_ms: i64,
    fit: Fit,
    only: Option<ServerId>,
) -> StoreResult<Vec<Opened>> {
    let Some(parent) = v.parent.as_deref().filter(|_| v.is_vgpu() && gpus > 0) else {
        return Ok(Vec::new());
    };
    // The servers come from the free-device index, in policy order, as many as GPUs are
    // wanted and a few more (a GPU may not offer the type): the read stays the size of
    // the request, not of the fleet.
    let order = match policy {
        Policy::Pack => "ASC",
        Policy::Spread => "DESC",
    };
    let sql = format!(
        "WITH h AS MATERIALIZED (SELECT f.server_uuid AS uuid FROM free_devices f \
         JOIN servers s ON s.uuid = f.server_uuid \
         WHERE f.variant = $1 AND f.free > 0 AND s.last_heartbeat >= $2 AND s.disabled = 0 \
         AND ($6 IS NULL OR f.server_uuid = $6) \
         AND {} ORDER BY f.free {order}, f.server_uuid LIMIT $5) \
         SELECT d.server_uuid, d.id, d.generation, d.details, d.variant \
         FROM h CROSS JOIN devices d WHERE d.server_uuid = h.uuid AND d.parent IS NULL AND {}",
        has_room_sql(fit.alloc, "$3", "$4"),
        placeable("d."),
    );
    let memory = i64::try_from(fit.memory_mib).unwrap_or(i64::MAX);
    let servers = i64::try_from(gpus.saturating_add(8)).unwrap_or(i64::MAX);
    let rows: Vec<GpuRow> = crate::on_read!(db, |p| sqlx::query_as(&sql)
        .bind(parent)
        .bind(alive_after_ms)
        .bind(i64::from(fit.vcpus))
        .bind(memory)
        .bind(servers)
        .bind(only.map(|s| s.to_string()))
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
    eligible.truncate(gpus);
    if eligible.is_empty() {
        return Ok(Vec::new());
    }
    let to = passage_model::transition(DeviceState::Unassigned, DeviceEvent::Share)
        .map_err(|e| corrupt(e.to_string()))?;
    let name = v.name.clone();
    let vgpu_type = v.vgpu_type.clone().unwrap_or_default();
    let now = now_ms();
    // A batch opens many GPUs at once: each statement below writes all of them (in
    // chunks), not one GPU or one slot at a time, so the one SQLite writer runs a handful
    // of statements per batch instead of six per GPU.
    let reason = |n: u32| format!("hosts {n} vGPU(s) of type {vgpu_type:?} (variant {name})");
    in_tx!(db, |tx| {
        let mut won: std::collections::HashSet<(String, String)> = std::collections::HashSet::new();
        for chunk in eligible.chunks(CHUNK) {
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
            for (server, gpu, generation, _) in chunk {
                q = q
                    .bind(server.to_string())
                    .bind(gpu.to_string())
                    .bind(*generation);
            }
            won.extend(q.fetch_all(&mut *tx).await?);
        }
        let opened: Vec<Opened> = eligible
            .iter()
            .filter(|(server, gpu, ..)| won.contains(&(server.to_string(), gpu.to_string())))
            .map(|(server, gpu, _, slots)| Opened {
                server: *server,
                gpu: gpu.clone(),
                slots: *slots,
            })
            .collect();
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
                        "(${}, ${}, 'unassigned', $1, ${}, $2)",
                        3 * i + 3,
                        3 * i + 4,
                        3 * i + 5
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
                q = q
                    .bind(o.server.to_string())
                    .bind(o.gpu.to_string())
                    .bind(reason(o.slots));
            }
            q.execute(&mut *tx).await?;
        }
        let mut servers: Vec<ServerId> = opened.iter().map(|o| o.server).collect();
        servers.sort();
        servers.dedup();
        for s in servers {
            tx.refresh_free(s).await?;
        }
        Ok(opened)
    })
}

/// Rows per multi-row statement when opening GPUs: 3 values each, far below SQLite's
/// limit on a statement's values.
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
/// free-device index.
pub async fn free_slots(db: &Db, variant: &str, alive_after_ms: i64) -> StoreResult<i64> {
    let n: Option<i64> = crate::on_read!(db, |p| sqlx::query_scalar(
        "SELECT CAST(SUM(f.free) AS BIGINT) FROM free_devices f \
         JOIN servers s ON s.uuid = f.server_uuid \
         WHERE f.variant = $1 AND s.last_heartbeat >= $2 AND s.disabled = 0"
    )
    .bind(variant)
    .bind(alive_after_ms)
    .fetch_one(p)
    .await)?;
    Ok(n.unwrap_or(0))
}
