//! Reservation of every scarce thing a VM holds, in one place: its devices (through the
//! state machine's `Reserve`), its owner's GPU quota, its server's vCPUs and memory, and
//! the free-device index placement reads. One creation, a batch of creations and a
//! resize's new devices all go through [`ReserveTx::reserve`], on both databases:
//!
//! 1. lock what no conditional write can guard: the vCPUs and memory of a server are sums
//!    over VM rows, so on Postgres the claimed servers' rows are locked, in key order (on
//!    SQLite the one writer is lock enough);
//! 2. read, in one query, each claimed server's room (without the claiming VMs), its NUMA
//!    nodes' room and address width (its reported facts and the VMs holding devices there),
//!    each owner's quota, the servers' free devices and the claimed devices' BARs;
//! 3. decide every claim in order, as if each ran alone (`passage_model::capacity`);
//! 4. write what the winners take: quotas charged, devices reserved, their history, the
//!    free-device index. The quota and device writes are conditional, and their counts must
//!    match the decision, else the whole transaction is [`StoreError::Retry`].
//!
//! The rules' SQL lives in the submodules, one per scarce thing, each with its SQLite and
//! its Postgres rendering side by side (Postgres binds arrays, so its statements keep one
//! text, planned once per connection, whatever the batch size).

pub mod addresses;
pub mod devices;
pub mod free_index;
pub mod quota;

use super::page::{Arg, marks};
use super::room::{self, Allocation, ReadRow, Room};
use super::sql::Sql;
use super::{StoreError, StoreResult, now_ms, parse_uuid};
use crate::bind_args;
use devices::Reserved;
use free_index::Taken;
use passage_model::capacity::{self, Holdings, Quota};
pub use passage_model::capacity::{Claim, Refusal};
use passage_model::{AccountId, DevicePath, ServerId};
use std::collections::HashMap;

/// What one claim got.
pub type Verdict = Result<(), Refusal>;

/// A refusal as the store's error, as a caller of the single path sees it.
pub fn refused(r: Refusal) -> StoreError {
    match r {
        Refusal::Taken => StoreError::Retry,
        Refusal::NoRoom(m) => StoreError::NoRoom(m),
        Refusal::Quota(m) => StoreError::Quota(m),
    }
}

/// Reservations inside a transaction that writes the rest (VM rows, jobs) beside them.
pub trait ReserveTx {
    /// Decides `claims` in order and writes the reservations of those that win; each
    /// claim gets its own verdict. `purpose` goes into the devices' history ("reserved for
    /// VM … (purpose)"). `Err(Retry)` for the whole call when a conditional write found less
    /// than the decision counted: the caller's transaction must be dropped.
    fn reserve(
        &mut self,
        claims: &[Claim<'_>],
        alloc: Allocation,
        purpose: &str,
    ) -> impl Future<Output = StoreResult<Vec<Verdict>>> + Send;
}

/// The servers and owners (those claiming devices) of the claims, each once, in key
/// order, and the claiming VMs.
struct Keys {
    servers: Vec<String>,
    owners: Vec<String>,
    vms: Vec<String>,
    /// The claimed devices' ids (on any of the servers; the read matches both).
    devices: Vec<String>,
}

impl Keys {
    fn of(claims: &[Claim<'_>]) -> StoreResult<Keys> {
        if claims
            .iter()
            .any(|c| c.server.is_none() && !c.devices.is_empty())
        {
            return Err(StoreError::Corrupt(
                "devices claimed without a server".into(),
            ));
        }
        let mut servers: Vec<ServerId> = claims.iter().filter_map(|c| c.server).collect();
        servers.sort();
        servers.dedup();
        let mut owners: Vec<AccountId> = claims
            .iter()
            .filter(|c| c.server.is_some() && !c.devices.is_empty())
            .map(|c| c.owner)
            .collect();
        owners.sort();
        owners.dedup();
        let mut devices: Vec<String> = claims
            .iter()
            .flat_map(|c| c.devices.iter().map(ToString::to_string))
            .collect();
        devices.sort();
        devices.dedup();
        Ok(Keys {
            servers: servers.iter().map(ToString::to_string).collect(),
            owners: owners.iter().map(ToString::to_string).collect(),
            vms: claims.iter().map(|c| c.vm.to_string()).collect(),
            devices,
        })
    }
}

/// What the read found: the decision's inputs, and each free device's variant (for the
/// free-device index).
fn holdings(rows: Vec<ReadRow>, alloc: Allocation) -> StoreResult<(Holdings, Variants)> {
    let mut h = Holdings::default();
    let mut variants = Variants::new();
    let mut hosts = room::HostRows::default();
    for (kind, key, id, variant, n1, n2, n3, n4) in rows {
        if hosts.take(&kind, &key, id.as_deref(), [n1, n2, n3])? {
            continue;
        }
        match kind.as_str() {
            "bars" => {
                let server: ServerId = parse_uuid(&key, "server")?;
                let path: DevicePath = id.unwrap_or_default().parse().map_err(super::corrupt)?;
                let window = variant.as_deref().and_then(super::devices::bar_window);
                h.shapes.entry((server, path)).or_default().window = window;
            }
            "room" => {
                h.rooms.insert(
                    parse_uuid(&key, "server")?,
                    Room::new(
                        alloc,
                        n1.unwrap_or(0),
                        n2.unwrap_or(0),
                        n3.unwrap_or(0),
                        n4.unwrap_or(0),
                    ),
                );
            }
            "quota" => {
                h.quotas.insert(
                    parse_uuid(&key, "account")?,
                    Quota {
                        limit: n1,
                        held: n2.unwrap_or(0),
                    },
                );
            }
            _ => {
                let server: ServerId = parse_uuid(&key, "server")?;
                let path: DevicePath = id.unwrap_or_default().parse().map_err(super::corrupt)?;
                if let Some(v) = variant {
                    variants.insert((server, path.clone()), v);
                }
                if let Some(n) = n1.and_then(|n| u32::try_from(n).ok()) {
                    h.shapes
                        .entry((server, path.clone()))
                        .or_default()
                        .numa_node = Some(n);
                }
                h.free.insert((server, path));
            }
        }
    }
    h.hosts = hosts.rooms(alloc);
    Ok((h, variants))
}

/// The claimed devices' details (`'bars'` rows), for their BARs.
fn bars_read(servers_in: &str, ids_in: &str) -> String {
    format!(
        "SELECT 'bars', server_uuid, id, details, CAST(NULL AS BIGINT), CAST(NULL AS BIGINT), \
         CAST(NULL AS BIGINT), CAST(NULL AS BIGINT) FROM devices \
         WHERE server_uuid {servers_in} AND id {ids_in} AND details IS NOT NULL"
    )
}

type Variants = HashMap<(ServerId, DevicePath), String>;

/// What the winners take.
struct Won {
    /// Devices charged to each owner's quota.
    charges: Vec<(AccountId, i64)>,
    devices: Vec<Reserved>,
    /// The free-device index, less what was taken, by (server, variant): exact, as the
    /// devices were read free under the same lock.
    taken: Taken,
}

impl Won {
    fn of(claims: &[Claim<'_>], verdicts: &[Verdict], variants: &Variants) -> Won {
        let mut w = Won {
            charges: Vec::new(),
            devices: Vec::new(),
            taken: Taken::new(),
        };
        for (c, v) in claims.iter().zip(verdicts) {
            let (Ok(()), Some(server)) = (v, c.server) else {
                continue;
            };
            if c.devices.is_empty() {
                continue;
            }
            let n = c.devices.len() as i64;
            match w.charges.iter_mut().find(|(o, _)| *o == c.owner) {
                Some((_, held)) => *held += n,
                None => w.charges.push((c.owner, n)),
            }
            for d in c.devices {
                w.devices.push((server, d.to_string(), c.vm));
                if let Some(variant) = variants.get(&(server, d.clone())) {
                    *w.taken
                        .entry((server.to_string(), variant.clone()))
                        .or_default() += 1;
                }
            }
        }
        w
    }
}

fn reason(purpose: &str) -> impl Fn(passage_model::VmId) -> String + '_ {
    move |vm| format!("reserved for VM {vm} ({purpose})")
}

impl ReserveTx for sqlx::Transaction<'_, sqlx::Sqlite> {
    async fn reserve(
        &mut self,
        claims: &[Claim<'_>],
        alloc: Allocation,
        purpose: &str,
    ) -> StoreResult<Vec<Verdict>> {
        let keys = Keys::of(claims)?;
        if keys.servers.is_empty() {
            return Ok(capacity::decide(claims, Holdings::default()));
        }
        // Every statement is a round trip to the one writer's thread: one read, one write.
        // The read numbers its placeholders, as its parts name their lists in any order.
        let mut args: Vec<Arg> = Vec::new();
        let mut list = |items: &[String]| {
            let first = args.len() + 1;
            args.extend(items.iter().map(|i| Arg::Text(i.clone())));
            marks(first, items.len())
        };
        let (servers, vms) = (list(&keys.servers), list(&keys.vms));
        let (servers_in, vms_not_in) = (format!("IN ({servers})"), format!("NOT IN ({vms})"));
        let mut parts = vec![
            room::read_sql(&servers_in, &vms_not_in),
            room::host_read_sql(&servers_in, &vms_not_in),
        ];
        if !keys.owners.is_empty() {
            let owners = list(&keys.owners);
            parts.push(quota::read(&format!("IN ({owners})")));
            parts.push(devices::read_free(&servers_in));
            let ids = list(&keys.devices);
            parts.push(bars_read(&servers_in, &format!("IN ({ids})")));
        }
        let sql = parts.join(" UNION ALL ");
        let rows: Vec<ReadRow> = bind_args!(sqlx::query_as(&sql), &args)
            .fetch_all(&mut **self)
            .await?;
        let (h, variants) = holdings(rows, alloc)?;
        let verdicts = capacity::decide(claims, h);
        let won = Won::of(claims, &verdicts, &variants);
        if won.devices.is_empty() {
            return Ok(verdicts);
        }
        let transition = devices::reserve_transition()?;
        let mut q = Sql::default();
        let mut all = vec![quota::charge_sqlite(&mut q, &won.charges)];
        all.extend(devices::reserve_sqlite(
            &mut q,
            &won.devices,
            transition,
            &reason(purpose),
            now_ms(),
        ));
        all.extend(free_index::take_sqlite(&mut q, &won.taken));
        let sql = all.join(";\n");
        let rows: Vec<(i64,)> = bind_args!(sqlx::query_as(&sql), &q.args)
            .fetch_all(&mut **self)
            .await?;
        // One row `0` per owner charged, one row `1` per device reserved.
        let reserved = rows.iter().filter(|(k,)| *k == 1).count();
        if reserved != won.devices.len() || rows.len() - reserved != won.charges.len() {
            // Checked under the writer's lock just before: only a bug gets here.
            return Err(StoreError::Retry);
        }
        Ok(verdicts)
    }
}

/// The reservation's read on Postgres: `$1` the servers, `$2` the owners claiming devices,
/// `$3` the claiming VMs, `$4` the claimed devices.
fn pg_read() -> String {
    [
        room::read_sql("= ANY($1::text[])", "<> ALL($3::text[])"),
        room::host_read_sql("= ANY($1::text[])", "<> ALL($3::text[])"),
        quota::read("= ANY($2::text[])"),
        devices::read_free("= ANY($1::text[])"),
        bars_read("= ANY($1::text[])", "= ANY($4::text[])"),
    ]
    .join(" UNION ALL ")
}

/// Every write of a reservation on Postgres as one statement (data-modifying CTEs all
/// run, whether read or not), answering the devices reserved and the owners charged.
fn pg_write() -> String {
    format!(
        "WITH a AS ({}), e AS ({}), f AS ({}), d AS ({}) \
         SELECT (SELECT COUNT(*) FROM d), (SELECT COUNT(*) FROM a)",
        quota::charge_pg("$2", "$3"),
        devices::events_pg(["$4", "$5", "$8", "$7"], "$9", "$1"),
        free_index::take_pg("$10", "$11", "$12"),
        devices::reserve_pg(["$4", "$5", "$6", "$8", "$13"], "$9", "$1"),
    )
}

impl ReserveTx for sqlx::Transaction<'_, sqlx::Postgres> {
    async fn reserve(
        &mut self,
        claims: &[Claim<'_>],
        alloc: Allocation,
        purpose: &str,
    ) -> StoreResult<Vec<Verdict>> {
        let keys = Keys::of(claims)?;
        if keys.servers.is_empty() {
            return Ok(capacity::decide(claims, Holdings::default()));
        }
        // The lock comes first, and the read after it in a statement of its own, so that
        // it sees what a reservation that held the lock before has committed.
        let _: Vec<(i32,)> = sqlx::query_as(
            "SELECT 1 FROM servers WHERE uuid = ANY($1::text[]) ORDER BY uuid \
             FOR NO KEY UPDATE",
        )
        .bind(&keys.servers)
        .fetch_all(&mut **self)
        .await?;
        let rows: Vec<ReadRow> = sqlx::query_as(&pg_read())
            .bind(&keys.servers)
            .bind(&keys.owners)
            .bind(&keys.vms)
            .bind(&keys.devices)
            .fetch_all(&mut **self)
            .await?;
        let (h, variants) = holdings(rows, alloc)?;
        let verdicts = capacity::decide(claims, h);
        let won = Won::of(claims, &verdicts, &variants);
        if won.devices.is_empty() {
            return Ok(verdicts);
        }
        let (from, to) = devices::reserve_transition()?;
        let why = reason(purpose);
        let n = won.devices.len();
        let strings = |f: &dyn Fn(&Reserved) -> String| -> Vec<String> {
            won.devices.iter().map(f).collect()
        };
        let (reserved, charged): (i64, i64) = sqlx::query_as(&pg_write())
            .bind(now_ms())
            .bind(
                won.charges
                    .iter()
                    .map(|(o, _)| o.to_string())
                    .collect::<Vec<_>>(),
            )
            .bind(won.charges.iter().map(|(_, n)| *n).collect::<Vec<_>>())
            .bind(strings(&|(s, _, _)| s.to_string()))
            .bind(strings(&|(_, i, _)| i.clone()))
            .bind(strings(&|(_, _, vm)| vm.to_string()))
            .bind(strings(&|(_, _, vm)| why(*vm)))
            .bind(vec![from.as_str().to_string(); n])
            .bind(to.as_str())
            .bind(won.taken.keys().map(|(s, _)| s.clone()).collect::<Vec<_>>())
            .bind(won.taken.keys().map(|(_, v)| v.clone()).collect::<Vec<_>>())
            .bind(won.taken.values().copied().collect::<Vec<_>>())
            .bind(vec![0_i64; n])
            .fetch_one(&mut **self)
            .await?;
        // Devices need no lock: their write is conditional, and a count short of the
        // decision (a device taken, a quota spent by another replica since the read)
        // undoes the whole transaction.
        if reserved != n as i64 || charged != won.charges.len() as i64 {
            return Err(StoreError::Retry);
        }
        Ok(verdicts)
    }
}
