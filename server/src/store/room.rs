//! vCPUs and memory: what each node reported, and what its VMs take of them. Usage is
//! summed from the VM rows themselves (every VM that is not destroyed or failed holds its
//! share, stopped ones included, as their devices stay held), so no counter can drift from
//! the VMs it counts. The arithmetic is `passage_model::capacity`; the sums are stated here
//! once and used by placement's reads and by the reservation's check (`store::reserve`).

use super::page::{self, Arg};
use super::{Db, StoreResult, parse_uuid};
use crate::on_write;
use passage_model::ServerId;
pub use passage_model::capacity::{Allocation, HostRoom, Room, fits};
use passage_model::protocol::{HostFacts, HostResources};
use std::collections::HashMap;

/// `servers s LEFT JOIN vms v ON {VMS_HOLDING}`: the VMs that hold a share of `s`.
pub(crate) const VMS_HOLDING: &str =
    "v.server_uuid = s.uuid AND v.state NOT IN ('destroyed', 'failed')";

/// A server's reported CPUs and memory, and the vCPUs and memory its VMs (`v`, joined on
/// [`VMS_HOLDING`]) hold: four columns, grouped by [`ROOM_GROUP`].
pub(crate) const ROOM_COLS: &str = "s.cpus, s.memory_mib, \
     CAST(COALESCE(SUM(v.vcpus), 0) AS BIGINT), CAST(COALESCE(SUM(v.memory_mib), 0) AS BIGINT)";

pub(crate) const ROOM_GROUP: &str = "GROUP BY s.uuid, s.cpus, s.memory_mib";

/// Servers whose agent reported its resources; the others are not checked.
pub(crate) const REPORTED: &str = "s.cpus IS NOT NULL AND s.memory_mib IS NOT NULL";

/// What one more VM asks of a server's room, and how the room is counted.
#[derive(Clone, Copy, Debug)]
pub struct Fit {
    pub vcpus: u32,
    pub memory_mib: u64,
    pub alloc: Allocation,
}

/// A condition on `s` (a `servers` row): the server has room for one more VM of
/// `vcpus` and `memory_mib` (the placeholders that bind them), or never reported its
/// resources. Placement's reads of the free-device index filter with it, so that
/// servers with free devices but no vCPUs or memory left are never suggested: without
/// it a fleet whose free devices sit on full servers sent every request to a full scan.
/// The same sums as [`ROOM_COLS`], per server through `vms_server`; a hint only, as the
/// reservation checks the room again under its lock.
pub(crate) fn has_room_sql(alloc: Allocation, vcpus: &str, memory_mib: &str) -> String {
    // An integer fits under `floor(cpus * ratio)` exactly when it fits under the product.
    let ratio = if alloc.cpu_ratio.is_finite() && alloc.cpu_ratio > 0.0 {
        alloc.cpu_ratio
    } else {
        1.0
    };
    let reserved = i64::try_from(alloc.reserved_memory_mib).unwrap_or(i64::MAX);
    format!(
        "(s.cpus IS NULL OR s.memory_mib IS NULL OR (SELECT \
         COALESCE(SUM(v.vcpus), 0) + {vcpus} <= s.cpus * CAST({ratio:?} AS DOUBLE PRECISION) \
         AND COALESCE(SUM(v.memory_mib), 0) + {memory_mib} <= s.memory_mib - {reserved} \
         FROM vms v WHERE {VMS_HOLDING}))"
    )
}

/// The room of each listed server (`servers_in`: ` IN (…)` or ` = ANY(…)`), leaving out
/// the VMs of `vms_not_in` (` NOT IN (…)` or a condition that is always true), as rows
/// `('room', server, NULL, NULL, cpus, memory, vcpus used, memory used)`.
pub(crate) fn read_sql(servers_in: &str, vms_not_in: &str) -> String {
    format!(
        "SELECT 'room' AS kind, s.uuid AS k, CAST(NULL AS TEXT) AS id, \
         CAST(NULL AS TEXT) AS variant, {ROOM_COLS} \
         FROM servers s LEFT JOIN vms v ON {VMS_HOLDING} AND v.uuid {vms_not_in} \
         WHERE s.uuid {servers_in} AND {REPORTED} {ROOM_GROUP}"
    )
}

/// Records what a node reported; `None` (an agent that cannot tell) keeps the last
/// values rather than lifting every limit.
pub async fn set_host(db: &Db, server: ServerId, host: Option<HostResources>) -> StoreResult<()> {
    let Some(h) = host else { return Ok(()) };
    on_write!(db, |p| sqlx::query(
        "UPDATE servers SET cpus = $2, memory_mib = $3 WHERE uuid = $1 \
         AND (cpus IS NULL OR cpus <> $2 OR memory_mib IS NULL OR memory_mib <> $3)"
    )
    .bind(server.to_string())
    .bind(i64::from(h.cpus))
    .bind(i64::try_from(h.memory_mib).unwrap_or(i64::MAX))
    .execute(p)
    .await
    .map(|_| ()))?;
    Ok(())
}

type RoomRow = (String, i64, i64, i64, i64);

/// The room of each of `servers` that reported its resources (all of them with `None`).
pub async fn rooms(
    db: &Db,
    servers: Option<&[ServerId]>,
    alloc: Allocation,
) -> StoreResult<HashMap<ServerId, Room>> {
    let base = format!(
        "SELECT s.uuid, {ROOM_COLS} FROM servers s LEFT JOIN vms v ON {VMS_HOLDING} \
         WHERE {REPORTED}"
    );
    let (sql, args) = match servers {
        Some([]) => return Ok(HashMap::new()),
        Some(list) => (
            format!(
                "{base} AND s.uuid IN ({}) {ROOM_GROUP}",
                page::marks(1, list.len())
            ),
            list.iter().map(|s| Arg::Text(s.to_string())).collect(),
        ),
        None => (format!("{base} {ROOM_GROUP}"), Vec::new()),
    };
    let rows: Vec<RoomRow> = page::fetch(db, &sql, &args).await?;
    rows.into_iter()
        .map(|(s, cpus, mem, vused, mused)| {
            Ok((
                parse_uuid(&s, "server")?,
                Room::new(alloc, cpus, mem, vused, mused),
            ))
        })
        .collect()
}

/// The facts each listed server reported (`('facts', server, facts JSON, …)` rows), and
/// each device a VM other than `vms_not_in` holds there with its NUMA node and the VM's
/// vCPUs and memory (`('held', server, vm, NULL, node, vcpus, memory, NULL)` rows): what
/// [`HostRows`] makes each server's [`HostRoom`] of.
pub(crate) fn host_read_sql(servers_in: &str, vms_not_in: &str) -> String {
    format!(
        "SELECT 'facts' AS kind, uuid AS k, host_facts AS id, CAST(NULL AS TEXT) AS variant, \
         CAST(NULL AS BIGINT), CAST(NULL AS BIGINT), CAST(NULL AS BIGINT), \
         CAST(NULL AS BIGINT) FROM servers WHERE uuid {servers_in} AND host_facts IS NOT NULL \
         UNION ALL SELECT 'held', d.server_uuid, v.uuid, CAST(NULL AS TEXT), \
         CAST(d.numa_node AS BIGINT), CAST(v.vcpus AS BIGINT), CAST(v.memory_mib AS BIGINT), \
         CAST(NULL AS BIGINT) FROM devices d JOIN vms v ON v.uuid = d.used_by \
         WHERE d.server_uuid {servers_in} AND d.numa_node IS NOT NULL \
         AND v.state NOT IN ('destroyed', 'failed') AND v.uuid {vms_not_in}"
    )
}

/// A VM holding devices on a server: its vCPUs, memory and devices' NUMA nodes.
type HeldBy = (u32, u64, Vec<Option<u32>>);

/// The rows of [`host_read_sql`], gathered into each server's [`HostRoom`].
#[derive(Default)]
pub(crate) struct HostRows {
    facts: HashMap<ServerId, HostFacts>,
    /// Each VM holding devices on a listed server, by (server, VM).
    held: HashMap<(ServerId, String), HeldBy>,
}

impl HostRows {
    /// Takes a row of [`host_read_sql`]; `false` for a row of any other kind.
    pub(crate) fn take(
        &mut self,
        kind: &str,
        server: &str,
        id: Option<&str>,
        [node, vcpus, memory]: [Option<i64>; 3],
    ) -> StoreResult<bool> {
        match kind {
            "facts" => {
                // Facts that do not parse (written by a newer server) check nothing.
                if let Some(f) = id.and_then(|t| serde_json::from_str::<HostFacts>(t).ok()) {
                    self.facts.insert(parse_uuid(server, "server")?, f);
                }
            }
            "held" => {
                let vm = id.unwrap_or_default().to_string();
                let e = self
                    .held
                    .entry((parse_uuid(server, "server")?, vm))
                    .or_insert_with(|| {
                        (
                            vcpus.and_then(|v| u32::try_from(v).ok()).unwrap_or(0),
                            memory.and_then(|m| u64::try_from(m).ok()).unwrap_or(0),
                            Vec::new(),
                        )
                    });
                e.2.push(node.and_then(|n| u32::try_from(n).ok()));
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    pub(crate) fn rooms(self, alloc: Allocation) -> HashMap<ServerId, HostRoom> {
        let mut rooms: HashMap<ServerId, HostRoom> = self
            .facts
            .iter()
            .map(|(s, f)| (*s, HostRoom::new(f, alloc)))
            .collect();
        for ((server, _), (vcpus, memory_mib, numa)) in self.held {
            if let Some(host) = rooms.get_mut(&server) {
                host.hold(vcpus, memory_mib, &numa);
            }
        }
        rooms
    }
}

/// A row of the reservation's read and of [`host_read_sql`]:
/// `(kind, key, id, variant or text, n1, n2, n3, n4)`.
pub(crate) type ReadRow = (
    String,
    String,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
);

/// The NUMA rooms and address widths of `servers` that reported them (all with `None`).
pub async fn host_rooms(
    db: &Db,
    servers: Option<&[ServerId]>,
    alloc: Allocation,
) -> StoreResult<HashMap<ServerId, HostRoom>> {
    let (sql, args) = match servers {
        Some([]) => return Ok(HashMap::new()),
        Some(list) => (
            host_read_sql(
                &format!("IN ({})", page::marks(1, list.len())),
                "IS NOT NULL",
            ),
            list.iter().map(|s| Arg::Text(s.to_string())).collect(),
        ),
        None => (host_read_sql("IS NOT NULL", "IS NOT NULL"), Vec::new()),
    };
    let rows: Vec<ReadRow> = page::fetch(db, &sql, &args).await?;
    let mut hosts = HostRows::default();
    for (kind, key, id, _, n1, n2, n3, _) in rows {
        hosts.take(&kind, &key, id.as_deref(), [n1, n2, n3])?;
    }
    Ok(hosts.rooms(alloc))
}
