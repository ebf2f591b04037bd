//! vCPUs and memory: what each node reported, what its VMs take, and the check that keeps
//! a placement within them. Usage is summed from the VM rows themselves (every VM that is
//! not destroyed or failed holds its share, stopped ones included, as their devices stay
//! held), so no counter can drift from the VMs it counts.

use super::page::{self, Arg};
use super::{Db, StoreError, StoreResult, parse_uuid};
use crate::on_write;
use passage_model::protocol::HostResources;
use passage_model::{ServerId, VmId};
use std::collections::HashMap;

/// How reported capacity becomes allocatable capacity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Allocation {
    /// vCPUs per host CPU (Nova's `cpu_allocation_ratio`).
    pub cpu_ratio: f64,
    /// Memory kept for the host itself. Guest memory is never overcommitted: a VM with a
    /// passed-through device has all of its memory pinned for DMA.
    pub reserved_memory_mib: u64,
}

impl Default for Allocation {
    fn default() -> Self {
        Allocation {
            cpu_ratio: 1.0,
            reserved_memory_mib: 4096,
        }
    }
}

/// One node's allocatable vCPUs and memory, and what its VMs take of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Room {
    pub vcpus_total: i64,
    pub vcpus_used: i64,
    pub memory_total_mib: i64,
    pub memory_used_mib: i64,
}

impl Room {
    pub(crate) fn new(
        alloc: Allocation,
        cpus: i64,
        memory_mib: i64,
        vcpus_used: i64,
        mem_used: i64,
    ) -> Room {
        // Truncation is the point: a fraction of a vCPU cannot be given.
        #[allow(clippy::cast_possible_truncation)]
        let vcpus_total = (cpus as f64 * alloc.cpu_ratio).floor() as i64;
        let reserved = i64::try_from(alloc.reserved_memory_mib).unwrap_or(i64::MAX);
        Room {
            vcpus_total,
            vcpus_used,
            memory_total_mib: memory_mib.saturating_sub(reserved).max(0),
            memory_used_mib: mem_used,
        }
    }

    pub fn vcpus_free(&self) -> i64 {
        self.vcpus_total - self.vcpus_used
    }

    pub fn memory_free_mib(&self) -> i64 {
        self.memory_total_mib - self.memory_used_mib
    }

    /// Why `vcpus` and `memory_mib` more would not fit; `None` when they do.
    pub fn lacks(&self, vcpus: u32, memory_mib: u64) -> Option<String> {
        let mut why = Vec::new();
        if i64::from(vcpus) > self.vcpus_free() {
            why.push(format!(
                "has {} vCPUs free, needs {vcpus}",
                self.vcpus_free().max(0)
            ));
        }
        if i64::try_from(memory_mib).unwrap_or(i64::MAX) > self.memory_free_mib() {
            why.push(format!(
                "has {} MiB of memory free, needs {memory_mib}",
                self.memory_free_mib().max(0)
            ));
        }
        (!why.is_empty()).then(|| why.join("; "))
    }
}

/// Whether a node with `room` (`None`: never reported, so unchecked) takes the VM.
pub fn fits(room: Option<&Room>, vcpus: u32, memory_mib: u64) -> bool {
    room.is_none_or(|r| r.lacks(vcpus, memory_mib).is_none())
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

/// `FROM servers s` joined to the VMs that hold a share of it.
const ROOM_SQL: &str = "SELECT s.uuid, s.cpus, s.memory_mib, \
     CAST(COALESCE(SUM(v.vcpus), 0) AS BIGINT), CAST(COALESCE(SUM(v.memory_mib), 0) AS BIGINT) \
     FROM servers s LEFT JOIN vms v ON v.server_uuid = s.uuid \
     AND v.state NOT IN ('destroyed', 'failed') WHERE s.cpus IS NOT NULL \
     AND s.memory_mib IS NOT NULL";

type RoomRow = (String, i64, i64, i64, i64);

/// The room query for `n` servers whose uuids are bound from `$first` on.
fn rooms_of(first: usize, n: usize) -> String {
    format!(
        "{ROOM_SQL} AND s.uuid IN ({}) GROUP BY s.uuid, s.cpus, s.memory_mib",
        page::marks(first, n)
    )
}

/// The room of each of `servers` that reported its resources (all of them with `None`).
pub async fn rooms(
    db: &Db,
    servers: Option<&[ServerId]>,
    alloc: Allocation,
) -> StoreResult<HashMap<ServerId, Room>> {
    let (sql, args) = match servers {
        Some([]) => return Ok(HashMap::new()),
        Some(list) => (
            rooms_of(1, list.len()),
            list.iter().map(|s| Arg::Text(s.to_string())).collect(),
        ),
        None => (
            format!("{ROOM_SQL} GROUP BY s.uuid, s.cpus, s.memory_mib"),
            Vec::new(),
        ),
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

/// The room check inside a transaction that has just written a VM row onto a server.
pub trait RoomTx {
    /// Locks the server's row (concurrent placements on it queue here), then sums its
    /// VMs other than `vm` and adds `vm` at its new shape: `Err(NoRoom)` when that
    /// exceeds the server's allocatable vCPUs or memory. A server that never reported
    /// passes.
    fn check_room(
        &mut self,
        server: ServerId,
        alloc: Allocation,
        vm: VmId,
        vcpus: u32,
        memory_mib: u64,
    ) -> impl Future<Output = StoreResult<()>> + Send;
}

macro_rules! impl_room_tx {
    ($db:ty) => {
        impl RoomTx for sqlx::Transaction<'_, $db> {
            async fn check_room(
                &mut self,
                server: ServerId,
                alloc: Allocation,
                vm: VmId,
                vcpus: u32,
                memory_mib: u64,
            ) -> StoreResult<()> {
                sqlx::query("UPDATE servers SET cpus = cpus WHERE uuid = $1")
                    .bind(server.to_string())
                    .execute(&mut **self)
                    .await?;
                let row: Option<RoomRow> = sqlx::query_as(
                    "SELECT s.uuid, s.cpus, s.memory_mib, \
                     CAST(COALESCE(SUM(v.vcpus), 0) AS BIGINT), \
                     CAST(COALESCE(SUM(v.memory_mib), 0) AS BIGINT) \
                     FROM servers s LEFT JOIN vms v ON v.server_uuid = s.uuid \
                     AND v.state NOT IN ('destroyed', 'failed') AND v.uuid <> $2 \
                     WHERE s.uuid = $1 AND s.cpus IS NOT NULL AND s.memory_mib IS NOT NULL \
                     GROUP BY s.uuid, s.cpus, s.memory_mib",
                )
                .bind(server.to_string())
                .bind(vm.to_string())
                .fetch_optional(&mut **self)
                .await?;
                let Some((_, cpus, mem, vused, mused)) = row else {
                    return Ok(());
                };
                let mem_new = i64::try_from(memory_mib).unwrap_or(i64::MAX);
                let room = Room::new(
                    alloc,
                    cpus,
                    mem,
                    vused.saturating_add(i64::from(vcpus)),
                    mused.saturating_add(mem_new),
                );
                if room.vcpus_free() < 0 || room.memory_free_mib() < 0 {
                    return Err(StoreError::NoRoom(format!(
                        "server {server} has {} of {} vCPUs and {} of {} MiB of memory \
                         allocated with this VM",
                        room.vcpus_used,
                        room.vcpus_total,
                        room.memory_used_mib,
                        room.memory_total_mib
                    )));
                }
                Ok(())
            }
        }
    };
}

impl_room_tx!(sqlx::Sqlite);
impl_room_tx!(sqlx::Postgres);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocatable_capacity() {
        let alloc = Allocation {
            cpu_ratio: 1.5,
            reserved_memory_mib: 1024,
        };
        let r = Room::new(alloc, 5, 4096, 6, 1000);
        assert_eq!(r.vcpus_total, 7);
        assert_eq!(r.memory_total_mib, 3072);
        assert_eq!(r.lacks(1, 2072), None);
        assert_eq!(
            r.lacks(2, 2073).as_deref(),
            Some("has 1 vCPUs free, needs 2; has 2072 MiB of memory free, needs 2073")
        );
        assert!(fits(None, u32::MAX, u64::MAX));
        assert!(!fits(Some(&r), 2, 1));
        // More reserved than there is: nothing allocatable, never negative.
        let r = Room::new(alloc, 1, 512, 0, 0);
        assert_eq!(r.memory_total_mib, 0);
    }
}
