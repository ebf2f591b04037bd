//! Operations records: the audit log, usage (GPU-hours), alerts, fleet capacity.

use super::page::Arg;
use super::{Db, StoreResult, corrupt, now_ms, parse_uuid, to_time};
use crate::{bind_args, on_read, on_write};
use passage_model::api::{Alert, AuditEntry, Capacity, UsageRecord};
use passage_model::{AccountId, VmId};
use std::collections::BTreeMap;

/// One state-changing call, for the audit log.
#[derive(Clone, Debug)]
pub struct AuditRecord {
    pub at: i64,
    pub actor: Option<(AccountId, String)>,
    pub method: String,
    pub path: String,
    pub status: u16,
    pub detail: Option<String>,
}

/// Appends `records` to the audit log, in order, in one statement.
pub async fn audit(db: &Db, records: &[AuditRecord]) -> StoreResult<()> {
    if records.is_empty() {
        return Ok(());
    }
    let mut args = Vec::with_capacity(records.len() * 7);
    for r in records {
        let (uuid, login) = match &r.actor {
            Some((u, l)) => (Arg::Text(u.to_string()), Arg::Text(l.clone())),
            None => (Arg::Null, Arg::Null),
        };
        args.extend([
            Arg::Int(r.at),
            uuid,
            login,
            Arg::Text(r.method.clone()),
            Arg::Text(r.path.clone()),
            Arg::Int(i64::from(r.status)),
            r.detail.clone().map_or(Arg::Null, Arg::Text),
        ]);
    }
    let sql = format!(
        "INSERT INTO audit_log (at, actor, actor_login, method, path, status, detail) VALUES {}",
        super::page::value_rows(1, records.len(), 7)
    );
    on_write!(db, |p| bind_args!(sqlx::query(&sql), &args)
        .execute(p)
        .await
        .map(|r| r.rows_affected()))?;
    Ok(())
}

pub async fn audit_log(db: &Db, limit: i64, offset: i64) -> StoreResult<(Vec<AuditEntry>, i64)> {
    type Row = (
        i64,
        Option<String>,
        Option<String>,
        String,
        String,
        i64,
        Option<String>,
    );
    let rows: Vec<Row> = on_read!(db, |p| sqlx::query_as(
        "SELECT at, actor, actor_login, method, path, status, detail FROM audit_log \
             ORDER BY seq DESC LIMIT $1 OFFSET $2"
    )
    .bind(limit)
    .bind(offset)
    .fetch_all(p)
    .await)?;
    let total: i64 = on_read!(db, |p| sqlx::query_scalar("SELECT COUNT(*) FROM audit_log")
        .fetch_one(p)
        .await)?;
    let items = rows
        .into_iter()
        .map(|(at, actor, actor_login, method, path, status, detail)| {
            Ok(AuditEntry {
                at: to_time(at),
                actor: actor
                    .as_deref()
                    .map(|a| parse_uuid(a, "account"))
                    .transpose()?,
                actor_login,
                method,
                path,
                status: u16::try_from(status).unwrap_or(0),
                detail,
            })
        })
        .collect::<StoreResult<_>>()?;
    Ok((items, total))
}

/// Ends the open usage records of a VM (idempotent).
pub async fn end_usage(db: &Db, vm: VmId) -> StoreResult<()> {
    on_write!(db, |p| sqlx::query(
        "UPDATE usage_records SET ended_at = $2 WHERE vm_uuid = $1 AND ended_at IS NULL"
    )
    .bind(vm.to_string())
    .bind(now_ms())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

/// Records overlapping `[from, to)`, with the hours inside the window.
pub async fn usage(
    db: &Db,
    owner: Option<AccountId>,
    from_ms: i64,
    to_ms: i64,
) -> StoreResult<Vec<UsageRecord>> {
    type Row = (
        String,
        String,
        String,
        String,
        Option<String>,
        i64,
        Option<i64>,
    );
    let owner_s = owner.map(|o| o.to_string());
    let rows: Vec<Row> = on_read!(db, |p| sqlx::query_as(
        "SELECT vm_uuid, owner_uuid, server_uuid, device, variant, started_at, ended_at \
         FROM usage_records WHERE (CAST($1 AS TEXT) IS NULL OR owner_uuid = $1) \
         AND started_at < $3 AND (ended_at IS NULL OR ended_at > $2) ORDER BY seq LIMIT 100000"
    )
    .bind(&owner_s)
    .bind(from_ms)
    .bind(to_ms)
    .fetch_all(p)
    .await)?;
    let now = now_ms();
    rows.into_iter()
        .map(|(vm, owner, server, device, variant, start, end)| {
            let lo = start.max(from_ms);
            let hi = end.unwrap_or(now).min(to_ms);
            Ok(UsageRecord {
                vm_uuid: parse_uuid(&vm, "vm")?,
                owner_uuid: parse_uuid(&owner, "account")?,
                server_uuid: parse_uuid(&server, "server")?,
                device: device.parse().map_err(corrupt)?,
                variant,
                started_at: to_time(start),
                ended_at: end.map(to_time),
                gpu_hours: (hi - lo).max(0) as f64 / 3_600_000.0,
            })
        })
        .collect()
}

pub async fn alert(
    db: &Db,
    kind: &str,
    message: &str,
    variant: Option<&str>,
    count: Option<u32>,
) -> StoreResult<()> {
    on_write!(db, |p| sqlx::query(
        "INSERT INTO alerts (kind, message, variant, count, at) VALUES ($1, $2, $3, $4, $5)"
    )
    .bind(kind)
    .bind(message)
    .bind(variant)
    .bind(count.map(i64::from))
    .bind(now_ms())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

pub async fn alerts(db: &Db, limit: i64, offset: i64) -> StoreResult<(Vec<Alert>, i64)> {
    type Row = (String, String, Option<String>, Option<i64>, i64);
    let rows: Vec<Row> = on_read!(db, |p| {
        sqlx::query_as(
            "SELECT kind, message, variant, count, at FROM alerts ORDER BY seq DESC \
             LIMIT $1 OFFSET $2",
        )
        .bind(limit)
        .bind(offset)
        .fetch_all(p)
        .await
    })?;
    let total: i64 = on_read!(db, |p| sqlx::query_scalar("SELECT COUNT(*) FROM alerts")
        .fetch_one(p)
        .await)?;
    Ok((
        rows.into_iter()
            .map(|(kind, message, variant, count, at)| Alert {
                kind,
                message,
                variant,
                count: count.and_then(|c| u32::try_from(c).ok()),
                at: to_time(at),
            })
            .collect(),
        total,
    ))
}

/// Devices per variant by state; `free` counts what placement could take now.
///
/// One statement, so one snapshot: the counts by variant, state and taint walk the
/// devices' index alone (a join to every device's server took 20–30 ms at 10,000 GPUs,
/// and the fleet bench asks 20 times a second); the second part takes back from `free`
/// the untainted unassigned devices of servers that are down or disabled, usually none.
pub async fn capacity(db: &Db, alive_after_ms: i64) -> StoreResult<Vec<Capacity>> {
    let rows: Vec<(String, String, i64, i64, i64)> = on_read!(db, |p| sqlx::query_as(
        "WITH down AS MATERIALIZED (SELECT uuid FROM servers \
           WHERE last_heartbeat IS NULL OR last_heartbeat < $1 OR disabled <> 0) \
         SELECT variant, state, \
           CAST(CASE WHEN taint IS NULL AND missing = 0 THEN 0 ELSE 1 END AS BIGINT), \
           CAST(0 AS BIGINT), COUNT(*) \
         FROM devices WHERE variant IS NOT NULL GROUP BY variant, state, missing, taint \
         UNION ALL \
         SELECT d.variant, d.state, CAST(0 AS BIGINT), CAST(1 AS BIGINT), COUNT(*) \
         FROM down JOIN devices d ON d.server_uuid = down.uuid \
         WHERE d.variant IS NOT NULL AND d.state = 'unassigned' AND d.taint IS NULL \
           AND d.missing = 0 \
         GROUP BY d.variant, d.state"
    )
    .bind(alive_after_ms)
    .fetch_all(p)
    .await)?;
    let mut by: BTreeMap<String, Capacity> = BTreeMap::new();
    // Taken back once every count is in: the rows come in no set order.
    let mut unreachable: Vec<(String, u64)> = Vec::new();
    for (variant, state, tainted, on_down_server, n) in rows {
        let n = u64::try_from(n).unwrap_or(0);
        if on_down_server == 1 {
            unreachable.push((variant, n));
            continue;
        }
        let c = by.entry(variant.clone()).or_insert_with(|| Capacity {
            variant,
            ..Capacity::default()
        });
        c.total += n;
        if tainted == 1 {
            c.tainted += n;
        }
        match state.as_str() {
            "unassigned" => {
                c.unassigned += n;
                if tainted == 0 {
                    c.free += n;
                }
            }
            "provisioning" => c.provisioning += n,
            "used" => c.used += n,
            "dirty" => c.dirty += n,
            "cleaning" => c.cleaning += n,
            "quarantined" => c.quarantined += n,
            "disabled" => c.disabled += n,
            "shared" => c.shared += n,
            other => return Err(corrupt(other)),
        }
    }
    for (variant, n) in unreachable {
        if let Some(c) = by.get_mut(&variant) {
            c.free = c.free.saturating_sub(n);
        }
    }
    for c in by.values_mut() {
        c.held = c.provisioning + c.used;
    }
    let vgpus: Vec<passage_model::Variant> = super::variants::list(db)
        .await?
        .into_iter()
        .filter(passage_model::Variant::is_vgpu)
        .collect();
    for v in &vgpus {
        let cap = vgpu_capacity(db, v, alive_after_ms).await?;
        by.entry(v.name.clone())
            .or_insert_with(|| Capacity {
                variant: v.name.clone(),
                ..Capacity::default()
            })
            .vgpu = Some(cap);
    }
    Ok(by.into_values().collect())
}

type VgpuRow = (
    String,
    String,
    String,
    Option<String>,
    String,
    i64,
    i64,
    Option<String>,
    String,
);

/// A vGPU variant's capacity: its slots, and the GPUs of its parent that could host it.
pub async fn vgpu_capacity(
    db: &Db,
    v: &passage_model::Variant,
    alive_after_ms: i64,
) -> StoreResult<passage_model::api::VgpuCapacity> {
    use super::vgpus::{slots_max, slots_on};
    use passage_model::api::{VgpuCapacity, VgpuServerCapacity};
    let parent = v.parent.clone().unwrap_or_default();
    let rows: Vec<VgpuRow> = on_read!(db, |p| sqlx::query_as(
        "SELECT d.server_uuid, d.id, d.state, d.parent, d.variant, \
           CAST(CASE WHEN d.taint IS NULL AND d.missing = 0 THEN 0 ELSE 1 END AS BIGINT), \
           CAST(CASE WHEN s.last_heartbeat >= $1 AND s.disabled = 0 THEN 1 ELSE 0 END AS BIGINT), \
           CASE WHEN d.parent IS NULL THEN d.details END, s.hostname \
         FROM devices d JOIN servers s ON s.uuid = d.server_uuid \
         WHERE d.variant = $2 OR (d.variant = $3 AND d.parent IS NULL) \
         ORDER BY s.hostname, d.server_uuid"
    )
    .bind(alive_after_ms)
    .bind(&v.name)
    .bind(&parent)
    .fetch_all(p)
    .await)?;
    // GPUs of the parent that host this type now: their slots count, not the GPU.
    let hosting: std::collections::HashSet<(String, String)> = rows
        .iter()
        .filter_map(|r| r.3.clone().map(|gpu| (r.0.clone(), gpu)))
        .collect();
    let mut servers: Vec<VgpuServerCapacity> = Vec::new();
    for (server, id, state, slot_of, _variant, tainted, up, details, hostname) in rows {
        let uuid = super::parse_uuid(&server, "server")?;
        if servers.last().is_none_or(|s| s.server_uuid != uuid) {
            servers.push(VgpuServerCapacity {
                server_uuid: uuid,
                hostname,
                max_capacity: 0,
                remaining_capacity: 0,
                in_use: 0,
                gpus: 0,
            });
        }
        let Some(s) = servers.last_mut() else {
            continue;
        };
        let placeable = tainted == 0 && up == 1;
        if slot_of.is_some() {
            s.max_capacity += 1;
            match state.as_str() {
                "provisioning" | "used" => s.in_use += 1,
                "unassigned" if placeable => s.remaining_capacity += 1,
                _ => {}
            }
            continue;
        }
        if hosting.contains(&(server.clone(), id)) {
            s.gpus += 1;
            continue;
        }
        // A GPU of the parent: whole, or hosting another type (which counts 0).
        if state == "shared" {
            continue;
        }
        let details: Option<passage_model::PciDetails> = details
            .as_deref()
            .and_then(|j| serde_json::from_str(j).ok());
        s.max_capacity += u64::from(slots_max(v, details.as_ref()));
        if state == "unassigned" && placeable {
            s.remaining_capacity += u64::from(slots_on(v, details.as_ref()).unwrap_or(0));
        }
    }
    if v.mix {
        // A shared GPU that a mixing variant can join has room for more of it, counting
        // the free slots of the others there as room (a join takes them back).
        for j in super::vgpus::joinable(db, v, &parent, alive_after_ms, None, None).await? {
            let (server, .., n, _) = j.gpu;
            if let Some(s) = servers.iter_mut().find(|s| s.server_uuid == server) {
                s.max_capacity += u64::from(n);
                s.remaining_capacity += u64::from(n);
            }
        }
    }
    servers.retain(|s| s.max_capacity > 0 || s.in_use > 0);
    Ok(VgpuCapacity {
        parent,
        vgpu_type: v.vgpu_type.clone().unwrap_or_default(),
        max_per_gpu: v.max_per_gpu.unwrap_or(0),
        max_capacity: servers.iter().map(|s| s.max_capacity).sum(),
        remaining_capacity: servers.iter().map(|s| s.remaining_capacity).sum(),
        in_use: servers.iter().map(|s| s.in_use).sum(),
        gpus: servers.iter().map(|s| s.gpus).sum(),
        servers,
    })
}
