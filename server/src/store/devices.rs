//! Reported PCI functions and the state of the assignable ones. Every state change goes
//! through the pure state machine: `Reserve` in `store::reserve` (one VM or a batch),
//! every other event through `DeviceTx::move_many` (`store::device_moves`), where the
//! machine decides, a conditional `UPDATE … WHERE generation = ?` makes it stick, and an
//! event row records it.

use super::page::{self, Arg, DeviceKey, Page, PageReq, Start, Where};
use super::reserve::devices::placeable;
use super::reserve::free_index::FreeIndexTx;
use super::room::{REPORTED, ROOM_COLS, ROOM_GROUP, VMS_HOLDING};
use super::sql::padded;
use super::{Db, StoreResult, corrupt, now_ms, parse_uuid};
use crate::{in_tx, on_read};
use passage_model::variant::classify;
use passage_model::{DeviceEvent, DevicePath, DeviceState, PciDevice, ServerId, VmId};
use std::collections::{BTreeMap, HashMap, HashSet};

#[derive(Clone, Debug)]
pub struct DeviceRecord {
    pub server_uuid: ServerId,
    pub pci: PciDevice,
    pub variant: Option<String>,
    pub state: DeviceState,
    pub used_by: Option<VmId>,
    pub missing: bool,
    pub taint: Option<String>,
    /// Why it is in its state, where the state alone does not say (see
    /// `device_moves::MoveReq::note`).
    pub state_reason: Option<String>,
}

#[derive(sqlx::FromRow)]
struct DeviceRow {
    server_uuid: String,
    id: String,
    vendor: String,
    device: String,
    subvendor: String,
    subsystem: String,
    revision: String,
    class: String,
    driver: Option<String>,
    numa_node: Option<i64>,
    iommu_group: Option<i64>,
    variant: Option<String>,
    state: String,
    used_by: Option<String>,
    missing: i64,
    taint: Option<String>,
    details: Option<String>,
    state_reason: Option<String>,
}

pub(crate) const COLS: &str = "server_uuid, id, vendor, device, subvendor, subsystem, revision, \
    class, driver, numa_node, iommu_group, variant, state, used_by, missing, taint, details, \
    state_reason";

impl DeviceRow {
    fn into_record(self) -> StoreResult<DeviceRecord> {
        Ok(DeviceRecord {
            server_uuid: parse_uuid(&self.server_uuid, "server")?,
            pci: PciDevice {
                id: self.id.parse().map_err(corrupt)?,
                vendor: self.vendor.parse().map_err(corrupt)?,
                device: self.device.parse().map_err(corrupt)?,
                subvendor: self.subvendor.parse().map_err(corrupt)?,
                subsystem: self.subsystem.parse().map_err(corrupt)?,
                revision: self.revision.parse().map_err(corrupt)?,
                class: self.class.parse().map_err(corrupt)?,
                driver: self.driver,
                numa_node: self.numa_node.and_then(|n| u32::try_from(n).ok()),
                iommu_group: self.iommu_group.and_then(|n| u32::try_from(n).ok()),
                // Written by us from a validated report; unreadable means an older shape.
                details: self
                    .details
                    .as_deref()
                    .and_then(|j| serde_json::from_str(j).ok()),
            },
            variant: self.variant,
            state: DeviceState::parse(&self.state).ok_or_else(|| corrupt(&self.state))?,
            used_by: self.used_by.map(|u| parse_uuid(&u, "vm")).transpose()?,
            missing: self.missing != 0,
            taint: self.taint,
            state_reason: self.state_reason,
        })
    }
}

fn records(rows: Vec<DeviceRow>) -> StoreResult<Vec<DeviceRecord>> {
    rows.into_iter().map(DeviceRow::into_record).collect()
}

/// The one way device rows are read: `SELECT {COLS} FROM devices` plus the rest of the
/// statement (`WHERE …`, `ORDER BY …`), with its values bound in order.
async fn select(db: &Db, rest: &str, args: &[page::Arg]) -> StoreResult<Vec<DeviceRecord>> {
    records(page::fetch(db, &format!("SELECT {COLS} FROM devices {rest}"), args).await?)
}

pub async fn for_server(db: &Db, server: ServerId) -> StoreResult<Vec<DeviceRecord>> {
    select(
        db,
        "WHERE server_uuid = $1 ORDER BY bdf",
        &[page::Arg::Text(server.to_string())],
    )
    .await
}

/// The variant of each of `ids` on `server` (those that exist): a provision's bind reads
/// its vGPU slots' types so, not every device of the node with its details.
pub async fn variants_of(
    db: &Db,
    server: ServerId,
    ids: &[String],
) -> StoreResult<HashMap<String, Option<String>>> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let sql = format!(
        "SELECT id, variant FROM devices WHERE server_uuid = $1 AND id IN ({})",
        page::marks(2, ids.len())
    );
    let server_s = server.to_string();
    let rows: Vec<(String, Option<String>)> = on_read!(db, |p| {
        let mut q = sqlx::query_as(&sql).bind(&server_s);
        for id in ids {
            q = q.bind(id);
        }
        q.fetch_all(p).await
    })?;
    Ok(rows.into_iter().collect())
}

/// What a scrub needs to know of one device: its variant's type, pipeline and scrub
/// policy, its vendor, and the hostname of its server (for the reasons it may be
/// quarantined with).
#[derive(Clone, Debug)]
pub struct ScrubPlan {
    pub kind: passage_model::variant::DeviceType,
    pub pipeline: Option<Vec<passage_model::protocol::ScrubAction>>,
    pub policy: passage_model::variant::ScrubPolicy,
    pub vendor: String,
    pub hostname: String,
}

/// The [`ScrubPlan`] of each of `ids` on `server` that has a variant, read with the
/// devices in one statement: a scrub reads nothing else of its devices or the catalog.
pub async fn scrub_plans(
    db: &Db,
    server: ServerId,
    ids: &[String],
) -> StoreResult<HashMap<String, ScrubPlan>> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let sql = format!(
        "SELECT d.id, v.scrub, v.kind, v.scrub_policy, d.vendor, s.hostname FROM devices d \
         JOIN variants v ON v.name = d.variant JOIN servers s ON s.uuid = d.server_uuid \
         WHERE d.server_uuid = $1 AND d.id IN ({})",
        page::marks(2, ids.len())
    );
    let server_s = server.to_string();
    type Row = (String, Option<String>, String, String, String, String);
    let rows: Vec<Row> = on_read!(db, |p| {
        let mut q = sqlx::query_as(&sql).bind(&server_s);
        for id in ids {
            q = q.bind(id);
        }
        q.fetch_all(p).await
    })?;
    rows.into_iter()
        .map(|(id, scrub, kind, policy, vendor, hostname)| {
            let plan = ScrubPlan {
                kind: passage_model::variant::DeviceType::parse(&kind)
                    .ok_or_else(|| corrupt(&kind))?,
                pipeline: scrub
                    .as_deref()
                    .map(serde_json::from_str)
                    .transpose()
                    .map_err(corrupt)?,
                policy: passage_model::variant::ScrubPolicy::parse(&policy)
                    .ok_or_else(|| corrupt(&policy))?,
                vendor,
                hostname,
            };
            Ok((id, plan))
        })
        .collect()
}

/// The devices of several servers at once (one page of the server list): by server, then
/// by address.
pub async fn for_servers(db: &Db, servers: &[ServerId]) -> StoreResult<Vec<DeviceRecord>> {
    if servers.is_empty() {
        return Ok(Vec::new());
    }
    let rest = format!(
        "WHERE server_uuid IN ({}) ORDER BY server_uuid, bdf",
        page::marks(1, servers.len())
    );
    let args: Vec<page::Arg> = servers
        .iter()
        .map(|s| page::Arg::Text(s.to_string()))
        .collect();
    select(db, &rest, &args).await
}

/// How many assignable devices each of `servers` has in each state.
pub async fn state_counts(
    db: &Db,
    servers: &[ServerId],
) -> StoreResult<HashMap<ServerId, BTreeMap<DeviceState, u32>>> {
    let mut out: HashMap<ServerId, BTreeMap<DeviceState, u32>> = HashMap::new();
    if servers.is_empty() {
        return Ok(out);
    }
    let sql = format!(
        "SELECT server_uuid, state, COUNT(*) FROM devices WHERE server_uuid IN ({}) \
         AND variant IS NOT NULL GROUP BY server_uuid, state",
        page::marks(1, servers.len())
    );
    let args: Vec<page::Arg> = servers
        .iter()
        .map(|s| page::Arg::Text(s.to_string()))
        .collect();
    let rows: Vec<(String, String, i64)> = page::fetch(db, &sql, &args).await?;
    for (server, state, n) in rows {
        let state = DeviceState::parse(&state).ok_or_else(|| corrupt(&state))?;
        out.entry(parse_uuid(&server, "server")?)
            .or_default()
            .insert(state, u32::try_from(n).unwrap_or(u32::MAX));
    }
    Ok(out)
}

pub use crate::listing::DeviceFilter;

/// An assignable device with the hostname of its server.
#[derive(Clone, Debug)]
pub struct ListedDevice {
    pub hostname: String,
    pub device: DeviceRecord,
}

#[derive(sqlx::FromRow)]
struct ListedRow {
    #[sqlx(flatten)]
    device: DeviceRow,
    hostname: String,
}

/// One page of the assignable devices (those matching a variant) of every server, in the
/// order (server hostname, server uuid, device id), ascending: a total order, since a
/// device id is unique within its server.
pub async fn page(
    db: &Db,
    f: &DeviceFilter,
    req: &PageReq<DeviceKey>,
) -> StoreResult<Page<ListedDevice, DeviceKey>> {
    let mut w = Where::default();
    w.and("d.variant IS NOT NULL");
    if let Some(st) = f.state {
        let a = w.text(st.as_str());
        w.and(format!("d.state = {a}"));
    }
    if let Some(v) = &f.variant {
        let a = w.text(v.clone());
        w.and(format!("d.variant = {a}"));
    }
    if let Some(sv) = f.server {
        let a = w.text(sv.to_string());
        w.and(format!("d.server_uuid = {a}"));
    }
    // Every device has its server (a cascading foreign key), so the count needs no join:
    // it stays within the devices' own indexes.
    let total = page::count(
        db,
        &format!("SELECT COUNT(*) FROM devices d{}", w.sql()),
        &w.args,
    )
    .await?;
    // SQLite keeps a CROSS JOIN's order: servers by their (hostname, uuid) index outside,
    // each one's devices by index inside, so the rows come sorted and a page stops after
    // `limit` instead of sorting the whole fleet. Postgres plans it as any join.
    const FROM: &str = "servers s CROSS JOIN devices d";
    w.and("d.server_uuid = s.uuid");
    let offset = match &req.start {
        Start::Offset(n) => *n,
        Start::After(k, skip) => {
            let h = w.text(k.hostname.clone());
            let u = w.text(k.server_uuid.clone());
            let i = w.text(k.id.clone());
            // The first condition is implied by the second; it lets Postgres start its
            // scan of servers by hostname at the cursor instead of filtering from the top.
            w.and(format!("s.hostname >= {h}"));
            w.and(format!(
                "(s.hostname, d.server_uuid, d.id) > ({h}, {u}, {i})"
            ));
            *skip
        }
    };
    let lim = w.int(req.limit.saturating_add(1));
    let off = w.int(offset);
    let cols: Vec<String> = COLS.split(',').map(|c| format!("d.{}", c.trim())).collect();
    let sql = format!(
        "SELECT {}, s.hostname FROM {FROM}{} ORDER BY s.hostname, d.server_uuid, d.id \
         LIMIT {lim} OFFSET {off}",
        cols.join(", "),
        w.sql()
    );
    let rows: Vec<ListedRow> = page::fetch(db, &sql, &w.args).await?;
    let (rows, more) = page::split(rows, req.limit);
    let next = if more {
        rows.last()
            .map(|r| DeviceKey::new(&r.hostname, r.device.server_uuid.as_str(), &r.device.id))
    } else {
        None
    };
    let items = rows
        .into_iter()
        .map(|r| {
            Ok(ListedDevice {
                hostname: r.hostname,
                device: r.device.into_record()?,
            })
        })
        .collect::<StoreResult<_>>()?;
    Ok(Page { items, total, next })
}

pub async fn held_by(db: &Db, vm: VmId) -> StoreResult<Vec<DeviceRecord>> {
    select(
        db,
        "WHERE used_by = $1 ORDER BY bdf",
        &[page::Arg::Text(vm.to_string())],
    )
    .await
}

pub async fn in_state(db: &Db, state: DeviceState) -> StoreResult<Vec<DeviceRecord>> {
    select(
        db,
        "WHERE state = $1 AND variant IS NOT NULL",
        &[page::Arg::Text(state.as_str().into())],
    )
    .await
}

/// Every assignable device: for whole-fleet checks in tests and the capacity view.
pub async fn all_assignable(db: &Db) -> StoreResult<Vec<DeviceRecord>> {
    select(
        db,
        "WHERE variant IS NOT NULL OR state <> 'unassigned'",
        &[],
    )
    .await
}

/// A device placement may choose.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub server_uuid: ServerId,
    pub id: DevicePath,
    pub variant: String,
    pub numa_node: Option<u32>,
    /// What its BARs take of a guest's 64-bit window, where the read looked (the dry
    /// run); `None` elsewhere, where the reservation checks the address width.
    pub window: Option<passage_model::guest_shape::PortWindow>,
}

/// Unassigned, untainted devices of these variants on servers heard from since
/// `alive_after_ms`.
pub async fn candidates(
    db: &Db,
    variants: &[String],
    alive_after_ms: i64,
) -> StoreResult<Vec<Candidate>> {
    if variants.is_empty() {
        return Ok(Vec::new());
    }
    let marks: Vec<String> = (0..variants.len()).map(|i| format!("${}", i + 2)).collect();
    let sql = format!(
        "SELECT d.server_uuid, d.id, d.variant, d.numa_node FROM devices d \
         JOIN servers s ON s.uuid = d.server_uuid \
         WHERE {} AND s.last_heartbeat >= $1 AND s.disabled = 0 AND d.variant IN ({})",
        placeable("d."),
        marks.join(", ")
    );
    let rows: Vec<(String, String, String, Option<i64>)> = on_read!(db, |p| {
        let mut q = sqlx::query_as(&sql).bind(alive_after_ms);
        for v in variants {
            q = q.bind(v);
        }
        q.fetch_all(p).await
    })?;
    rows.into_iter()
        .map(|(s, id, variant, numa)| {
            Ok(Candidate {
                server_uuid: parse_uuid(&s, "server")?,
                id: id.parse().map_err(corrupt)?,
                variant,
                numa_node: numa.and_then(|n| u32::try_from(n).ok()),
                window: None,
            })
        })
        .collect()
}

/// What a device's BARs take of a guest's 64-bit window, from its stored details (JSON);
/// `None` without a 64-bit BAR or with details that do not parse.
pub(crate) fn bar_window(details: &str) -> Option<passage_model::guest_shape::PortWindow> {
    /// The one part of the details this reads.
    #[derive(serde::Deserialize)]
    struct Bars {
        #[serde(default)]
        bars: Vec<passage_model::PciBar>,
    }
    let b: Bars = serde_json::from_str(details).ok()?;
    passage_model::guest_shape::port_window(&b.bars)
}

/// What the BARs of each placeable device of `variants` take of a guest's 64-bit
/// window, by server and device (devices without a 64-bit BAR are absent): the dry run's
/// read, as it reads every device's details.
pub async fn candidate_windows(
    db: &Db,
    variants: &[String],
) -> StoreResult<HashMap<(ServerId, DevicePath), passage_model::guest_shape::PortWindow>> {
    if variants.is_empty() {
        return Ok(HashMap::new());
    }
    let sql = format!(
        "SELECT d.server_uuid, d.id, d.details FROM devices d WHERE {} AND d.variant IN ({}) \
         AND d.details IS NOT NULL",
        placeable("d."),
        page::marks(1, variants.len())
    );
    let args: Vec<Arg> = variants.iter().map(|v| Arg::Text(v.clone())).collect();
    let rows: Vec<(String, String, String)> = page::fetch(db, &sql, &args).await?;
    let mut out = HashMap::new();
    for (s, id, details) in rows {
        let Some(w) = bar_window(&details) else {
            continue;
        };
        out.insert((parse_uuid(&s, "server")?, id.parse().map_err(corrupt)?), w);
    }
    Ok(out)
}

pub use super::device_moves::{MoveReq, Moved};

/// Device changes that must share a transaction with other writes (VM rows, quotas).
pub trait DeviceTx {
    /// Applies `event` to each device that can take it; with `vm`, a held device moves
    /// only if `vm` holds it. Devices that cannot take the event are left alone (so undo
    /// steps are idempotent); a lost race is `StoreError::Retry`. `Reserve` is not taken
    /// here: a reservation claims quota and room with its devices (`store::reserve`).
    fn move_devices(
        &mut self,
        server: ServerId,
        ids: &[String],
        event: DeviceEvent,
        vm: Option<VmId>,
        reason: &str,
    ) -> impl Future<Output = StoreResult<Vec<Moved>>> + Send;
    /// [`DeviceTx::move_devices`] for many requests at once, in a few statements
    /// (`store::device_moves`): each request's answer, in order. A device in two
    /// requests moves for the first, then for the second.
    fn move_many(
        &mut self,
        reqs: &[MoveReq],
    ) -> impl Future<Output = StoreResult<Vec<Vec<Moved>>>> + Send;
}

macro_rules! impl_device_tx {
    ($db:ty) => {
        impl DeviceTx for sqlx::Transaction<'_, $db> {
            async fn move_devices(
                &mut self,
                server: ServerId,
                ids: &[String],
                event: DeviceEvent,
                vm: Option<VmId>,
                reason: &str,
            ) -> StoreResult<Vec<Moved>> {
                let req = MoveReq::new(server, ids, event, vm, reason);
                let mut answers = self.move_many(std::slice::from_ref(&req)).await?;
                Ok(answers.pop().unwrap_or_default())
            }

            async fn move_many(&mut self, reqs: &[MoveReq]) -> StoreResult<Vec<Vec<Moved>>> {
                super::device_moves::move_many_body!(self, reqs)
            }
        }
    };
}

impl_device_tx!(sqlx::Sqlite);
impl_device_tx!(sqlx::Postgres);

/// Moves devices in a transaction of their own.
pub async fn move_devices(
    db: &Db,
    server: ServerId,
    ids: &[String],
    event: DeviceEvent,
    vm: Option<VmId>,
    reason: &str,
) -> StoreResult<Vec<Moved>> {
    in_tx!(db, |tx| tx
        .move_devices(server, ids, event, vm, reason)
        .await)
}

/// What a report covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coverage {
    /// Every function of the node: one it leaves out is missing.
    Whole,
    /// Only functions that changed (sent with a task's result); the rest are as they were.
    Changed,
}

/// What the store holds of a reported function, to tell whether a report changes it.
#[derive(sqlx::FromRow)]
struct KnownRow {
    #[sqlx(flatten)]
    row: DeviceRow,
    /// Used by a VM that no job is working on (see `health::taint`).
    at_rest: i64,
}

impl KnownRow {
    /// Whether writing `d` (classified as `variant`, its details serialized as `details`)
    /// would leave the row as it is.
    fn same_as(&self, d: &PciDevice, variant: &Option<String>, details: &Option<String>) -> bool {
        let r = &self.row;
        r.missing == 0
            && r.vendor == d.vendor.to_string()
            && r.device == d.device.to_string()
            && r.subvendor == d.subvendor.to_string()
            && r.subsystem == d.subsystem.to_string()
            && r.revision == d.revision.to_string()
            && r.class == d.class.to_string()
            && r.driver == d.driver
            && r.numa_node == d.numa_node.map(i64::from)
            && r.iommu_group == d.iommu_group.map(i64::from)
            && &r.variant == variant
            && &r.details == details
    }
}

/// Applies an agent's inventory: new functions appear, known ones are refreshed, and a
/// device missing from the report is flagged and kept out of placement but never freed.
///
/// The report is also the node's heartbeat, and carries its CPUs and memory (`host`,
/// kept as they were when absent): a whole report writes the server's row first, in the
/// same transaction, as placements lock a server's row before its devices.
///
/// On Postgres two advisory locks order reports against what SQLite's one writer orders
/// by itself, without the server row that every placement on the node also locks (a
/// task's result, several per VM, then waited behind the node's creations):
/// - [`VARIANTS_LOCK`], shared, before the variants are read: a variant created meanwhile
///   is either seen here or finds these devices in its own recount
///   ([`recompute_variants`] takes it exclusively), so a device is never left without the
///   variant it matches;
/// - the node's own lock ([`NODE_LOCK_SPACE`]), exclusive: two reports of one node apply
///   one after the other.
///
/// A report that changes what the node can place (a new function, a variant, `missing`,
/// a taint) locks the server's row before its first write and recounts the free index
/// under it, as a whole report and a placement do.
///
/// Only what changed is written: a node reports its whole inventory after every bind and
/// unbind, and rewriting each of its functions then cost the one SQLite writer a dozen
/// statements per VM for a single changed driver link.
pub async fn apply_inventory(
    db: &Db,
    server: ServerId,
    host: Option<&passage_model::protocol::HostResources>,
    report: &[PciDevice],
    coverage: Coverage,
) -> StoreResult<Applied> {
    let report = Report {
        server,
        host,
        devices: report,
        coverage,
    };
    in_tx!(db, |tx| {
        tx.lock_reports(&[server]).await?;
        let variants = tx.read_variants().await?;
        tx.apply_report(&report, &variants).await?;
        Ok(Applied {
            vf_variants: variants.iter().any(|v| v.is_vf()),
        })
    })
}

/// One node's report: its whole inventory, or the functions a task changed.
pub struct Report<'a> {
    pub server: ServerId,
    /// The node's CPUs and memory, kept as they were when absent.
    pub host: Option<&'a passage_model::protocol::HostResources>,
    pub devices: &'a [PciDevice],
    pub coverage: Coverage,
}

/// Inventories applied in the caller's transaction ([`apply_inventory`] says how), so that
/// the task results that arrive together write their changed functions with the results
/// themselves (`store::tasks::complete_many`): one transaction and one read of the
/// variants for the batch, not one each.
pub trait InventoryTx {
    /// Takes, on Postgres, what orders these servers' reports against other reports of
    /// theirs and against a recount of the variants ([`VARIANTS_LOCK`] shared, then each
    /// node's lock in one order, so that two batches never wait for each other in a
    /// circle); SQLite's one writer orders them already. Before [`InventoryTx::read_variants`].
    fn lock_reports(
        &mut self,
        servers: &[ServerId],
    ) -> impl Future<Output = StoreResult<()>> + Send;
    /// The variants, to classify reported functions by.
    fn read_variants(
        &mut self,
    ) -> impl Future<Output = StoreResult<Vec<passage_model::Variant>>> + Send;
    /// Writes what `report` changes, its node's locks taken.
    fn apply_report(
        &mut self,
        report: &Report<'_>,
        variants: &[passage_model::Variant],
    ) -> impl Future<Output = StoreResult<()>> + Send;
    /// [`InventoryTx::apply_report`] for each of `reports`, in order, their nodes' locks
    /// taken. Task results' changed functions (a bind's or an unbind's drivers) of nodes
    /// with one report each are read in one statement and, where they only change what a
    /// function says of itself (not whether it is placeable), written in one: a batch of
    /// results then costs the one writer two statements, not two per result.
    fn apply_changed(
        &mut self,
        reports: &[Report<'_>],
        variants: &[passage_model::Variant],
    ) -> impl Future<Output = StoreResult<()>> + Send;
}

macro_rules! impl_inventory_tx {
    ($db:ty, $postgres:expr) => {
        impl InventoryTx for sqlx::Transaction<'_, $db> {
            async fn lock_reports(&mut self, servers: &[ServerId]) -> StoreResult<()> {
                if !$postgres {
                    return Ok(());
                }
                let mut keys: Vec<String> = servers.iter().map(ToString::to_string).collect();
                keys.sort();
                keys.dedup();
                // One node (an inventory, or a batch from one node): one round trip.
                if let [one] = keys.as_slice() {
                    sqlx::query(
                        "SELECT pg_advisory_xact_lock_shared($1), \
                         pg_advisory_xact_lock($2, hashtext($3))",
                    )
                    .bind(VARIANTS_LOCK)
                    .bind(NODE_LOCK_SPACE)
                    .bind(one)
                    .execute(&mut **self)
                    .await?;
                    return Ok(());
                }
                sqlx::query("SELECT pg_advisory_xact_lock_shared($1)")
                    .bind(VARIANTS_LOCK)
                    .execute(&mut **self)
                    .await?;
                for s in keys {
                    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
                        .bind(NODE_LOCK_SPACE)
                        .bind(s)
                        .execute(&mut **self)
                        .await?;
                }
                Ok(())
            }

            async fn read_variants(&mut self) -> StoreResult<Vec<passage_model::Variant>> {
                let rows: Vec<super::variants::VariantRow> =
                    sqlx::query_as(super::variants::LIST_ALL)
                        .fetch_all(&mut **self)
                        .await?;
                super::variants::views(rows)
            }

            async fn apply_report(
                &mut self,
                r: &Report<'_>,
                variants: &[passage_model::Variant],
            ) -> StoreResult<()> {
                let (server, host, report, coverage) = (r.server, r.host, r.devices, r.coverage);
                let postgres = $postgres;
                let now = now_ms();
                let server_s = server.to_string();
                let reported: HashSet<String> = report.iter().map(|d| d.id.to_string()).collect();
                let cpus = host.map(|h| i64::from(h.cpus));
                let memory = host.map(|h| i64::try_from(h.memory_mib).unwrap_or(i64::MAX));
                // An agent that reads no facts (an older one) keeps what a newer one said.
                let facts = host
                    .map(passage_model::protocol::HostResources::facts)
                    .filter(|f| !f.is_empty())
                    .map(|f| serde_json::to_string(&f))
                    .transpose()
                    .map_err(super::corrupt)?;
                // A task's changed functions come with its result, which is no heartbeat: the
                // agent's own heartbeats say it is alive.
                let server_locked = coverage == Coverage::Whole || host.is_some();
                if server_locked {
                    sqlx::query(
                        "UPDATE servers SET last_heartbeat = $2, cpus = COALESCE($3, cpus), \
                         memory_mib = COALESCE($4, memory_mib), \
                         host_facts = COALESCE($5, host_facts) WHERE uuid = $1",
                    )
                    .bind(&server_s)
                    .bind(now)
                    .bind(cpus)
                    .bind(memory)
                    .bind(facts)
                    .execute(&mut **self)
                    .await?;
                }
                // A task's few changed functions need only their own rows, and the shared
                // functions whose VFs they may be: not every function of the node, each with
                // its details, twice per VM.
                let only = match coverage {
                    Coverage::Whole => String::new(),
                    Coverage::Changed if report.is_empty() => " AND d.state = 'shared'".to_string(),
                    Coverage::Changed => format!(
                        " AND (d.state = 'shared' OR d.id IN ({}))",
                        page::marks(2, report.len())
                    ),
                };
                let sql = known_sql(&format!("d.server_uuid = $1{only}"));
                let mut q = sqlx::query_as(&sql).bind(&server_s);
                if coverage == Coverage::Changed {
                    for d in report {
                        q = q.bind(d.id.to_string());
                    }
                }
                let known: Vec<KnownRow> = q.fetch_all(&mut **self).await?;
                let known: HashMap<&str, &KnownRow> =
                    known.iter().map(|k| (k.row.id.as_str(), k)).collect();
                let shared = shared_functions(known.values().map(|k| &k.row));
                let writes = report
                    .iter()
                    .map(|d| InventoryWrite::of(d, &variants, &shared, &known))
                    .collect::<StoreResult<Vec<_>>>()?;
                let writes: Vec<InventoryWrite<'_>> = writes.into_iter().flatten().collect();
                // Whether a device may have become placeable or stopped being so: only then is
                // the free index recounted. A driver change alone (every bind and unbind) leaves
                // it as it is.
                let mut recount = writes.iter().any(InventoryWrite::recounts);
                if recount && !server_locked && postgres {
                    sqlx::query("SELECT 1 FROM servers WHERE uuid = $1 FOR NO KEY UPDATE")
                        .bind(&server_s)
                        .execute(&mut **self)
                        .await?;
                }
                for w in &writes {
                    let d = w.device;
                    match &w.was {
                        None => {
                            let mut args = vec![
                                Arg::Text(server_s.clone()),
                                Arg::Text(w.id.clone()),
                                Arg::Text(d.address().to_string()),
                            ];
                            args.extend(w.reported());
                            args.push(Arg::Int(now));
                            crate::bind_args!(
                                sqlx::query(
                                    "INSERT INTO devices (server_uuid, id, bdf, vendor, device, \
                                     subvendor, subsystem, revision, class, driver, numa_node, \
                                     iommu_group, variant, details, state, used_by, generation, \
                                     missing, taint, updated_at) \
                                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, \
                                     CAST($11 AS BIGINT), CAST($12 AS BIGINT), $13, $14, \
                                     'unassigned', NULL, 0, 0, NULL, $15)",
                                ),
                                &args
                            )
                            .execute(&mut **self)
                            .await?;
                        }
                        Some(was) => {
                            let mut args =
                                vec![Arg::Text(server_s.clone()), Arg::Text(w.id.clone())];
                            args.extend(w.reported());
                            args.push(Arg::Int(now));
                            args.push(w.health.clone().map_or(Arg::Null, Arg::Text));
                            crate::bind_args!(
                                sqlx::query(
                                    "UPDATE devices SET vendor = $3, device = $4, subvendor = $5, \
                                     subsystem = $6, revision = $7, class = $8, driver = $9, \
                                     numa_node = CAST($10 AS BIGINT), \
                                     iommu_group = CAST($11 AS BIGINT), variant = $12, \
                                     details = $13, missing = 0, \
                                     taint = CASE WHEN CAST($15 AS TEXT) IS NOT NULL THEN $15 \
                                       WHEN missing = 1 THEN NULL ELSE taint END, \
                                     updated_at = $14 WHERE server_uuid = $1 AND id = $2",
                                ),
                                &args
                            )
                            .execute(&mut **self)
                            .await?;
                            if was.missing != 0 {
                                // Its vGPU slots were flagged with it; back with it.
                                sqlx::query(
                                    "UPDATE devices SET missing = 0, taint = NULL, updated_at = $3 \
                                     WHERE server_uuid = $1 AND parent = $2 AND missing = 1",
                                )
                                .bind(&server_s)
                                .bind(&w.id)
                                .bind(now)
                                .execute(&mut **self)
                                .await?;
                            }
                        }
                    }
                }
                for k in known.values().map(|k| &k.row) {
                    if coverage == Coverage::Changed || k.missing != 0 || reported.contains(&k.id) {
                        continue;
                    }
                    recount = true;
                    // A free VF gone with its function's `sriov_numvfs` is no loss: it goes.
                    if k.is_vf() && matches!(k.state.as_str(), "unassigned" | "disabled") {
                        sqlx::query(
                            "DELETE FROM devices WHERE server_uuid = $1 AND id = $2 \
                             AND state IN ('unassigned', 'disabled')",
                        )
                        .bind(&server_s)
                        .bind(&k.id)
                        .execute(&mut **self)
                        .await?;
                        continue;
                    }
                    // A missing GPU's vGPU slots are flagged with it: placement skips them.
                    sqlx::query(
                        "UPDATE devices SET missing = 1, taint = $3, updated_at = $4 \
                         WHERE server_uuid = $1 AND (id = $2 OR parent = $2) AND missing = 0",
                    )
                    .bind(&server_s)
                    .bind(&k.id)
                    .bind(format!(
                        "missing from the agent's inventory report (state was {})",
                        k.state
                    ))
                    .bind(now)
                    .execute(&mut **self)
                    .await?;
                }
                if recount {
                    self.refresh_free(server).await?;
                }
                Ok(())
            }

            async fn apply_changed(
                &mut self,
                reports: &[Report<'_>],
                variants: &[passage_model::Variant],
            ) -> StoreResult<()> {
                let (plain, rest) = plain_reports(reports);
                let mut alone: Vec<&Report<'_>> = Vec::new();
                // One function alone costs its own path a read and a write too.
                if plain.iter().map(|r| r.devices.len()).sum::<usize>() < 2 {
                    alone.extend(plain);
                } else {
                    for chunk in plain.chunks(CHANGED_CHUNK) {
                        alone.extend(self.apply_plain(chunk, variants).await?);
                    }
                }
                // Each node's reports here are its only ones, or all of them: their order
                // within a node is kept.
                alone.extend(rest);
                for r in alone {
                    self.apply_report(r, variants).await?;
                }
                Ok(())
            }
        }

        impl PlainTx for sqlx::Transaction<'_, $db> {
            async fn apply_plain<'r, 'a>(
                &mut self,
                reports: &[&'r Report<'a>],
                variants: &[passage_model::Variant],
            ) -> StoreResult<Vec<&'r Report<'a>>> {
                let servers: Vec<String> = reports.iter().map(|r| r.server.to_string()).collect();
                // Each function by its node and address: nodes share addresses, and an
                // address alone would read every listed node's function at it.
                let keys: Vec<String> = reports
                    .iter()
                    .zip(&servers)
                    .flat_map(|(r, s)| r.devices.iter().map(move |d| format!("{s} {}", d.id)))
                    .collect();
                let (in_servers, in_keys) = (padded(&servers), padded(&keys));
                // The servers' list lets the read walk each node's functions by key, as
                // one node's read does; the pairs pick the reported ones among them.
                let sql = known_sql(&format!(
                    "d.server_uuid IN ({}) AND (d.state = 'shared' \
                     OR d.server_uuid || ' ' || d.id IN ({}))",
                    page::marks(1, in_servers.len()),
                    page::marks(1 + in_servers.len(), in_keys.len())
                ));
                let mut q = sqlx::query_as(&sql);
                for s in in_servers.iter().chain(&in_keys) {
                    q = q.bind(s.as_str());
                }
                let rows: Vec<KnownRow> = q.fetch_all(&mut **self).await?;
                let mut by_server: HashMap<&str, Vec<&KnownRow>> = HashMap::new();
                for k in &rows {
                    by_server.entry(k.row.server_uuid.as_str()).or_default().push(k);
                }
                let mut alone = Vec::new();
                let mut writes: Vec<(String, InventoryWrite<'_>)> = Vec::new();
                for (r, server) in reports.iter().zip(&servers) {
                    let reported: HashSet<String> = r.devices.iter().map(|d| d.id.to_string()).collect();
                    let mine = by_server.get(server.as_str()).map_or(&[][..], Vec::as_slice);
                    let known: HashMap<&str, &KnownRow> = mine
                        .iter()
                        .filter(|k| k.row.state == "shared" || reported.contains(&k.row.id))
                        .map(|k| (k.row.id.as_str(), *k))
                        .collect();
                    let shared = shared_functions(known.values().map(|k| &k.row));
                    let mine: Vec<InventoryWrite<'_>> = r
                        .devices
                        .iter()
                        .map(|d| InventoryWrite::of(d, variants, &shared, &known))
                        .collect::<StoreResult<Vec<_>>>()?
                        .into_iter()
                        .flatten()
                        .collect();
                    if mine.iter().all(InventoryWrite::plain) {
                        writes.extend(mine.into_iter().map(|w| (server.clone(), w)));
                    } else {
                        // A new function, a variant, a taint: the node's own path, which
                        // takes the locks that need and recounts.
                        alone.push(*r);
                    }
                }
                let now = now_ms();
                let refs: Vec<(String, &InventoryWrite<'_>)> =
                    writes.iter().map(|(s, w)| (s.clone(), w)).collect();
                for chunk in refs.chunks(CHANGED_CHUNK) {
                    let (sql, args) = plain_update_sql(now, &padded(chunk));
                    crate::bind_args!(sqlx::query(&sql), &args)
                        .execute(&mut **self)
                        .await?;
                }
                Ok(alone)
            }
        }
    };
}

/// The shared read and write of [`InventoryTx::apply_changed`], for a chunk of reports:
/// answers those that need their own path.
trait PlainTx {
    fn apply_plain<'r, 'a>(
        &mut self,
        reports: &[&'r Report<'a>],
        variants: &[passage_model::Variant],
    ) -> impl Future<Output = StoreResult<Vec<&'r Report<'a>>>> + Send;
}

impl_inventory_tx!(sqlx::Sqlite, false);
impl_inventory_tx!(sqlx::Postgres, true);

/// Postgres advisory lock (one 64-bit key) that orders inventories, which take it shared,
/// against a recount of every device's variant, which takes it exclusively. The bytes
/// spell "passage" and 1.
pub const VARIANTS_LOCK: i64 = 0x7061_7373_6167_6501;

/// First half of a node's own advisory lock (two 32-bit keys, a space apart from the
/// 64-bit ones): the second is the hash of the server's uuid. A collision only makes two
/// nodes' reports wait for each other.
pub const NODE_LOCK_SPACE: i32 = 0x7061_7301;

/// The read of stored functions an inventory compares its report with (`filter` picks
/// them): each row with whether a VM uses it at rest, which decides a taint.
fn known_sql(filter: &str) -> String {
    format!(
        "SELECT {}, CAST(CASE WHEN d.state = 'used' \
         AND v.state IN ('running', 'stopped') AND (v.job_uuid IS NULL OR NOT EXISTS \
         (SELECT 1 FROM jobs j WHERE j.uuid = v.job_uuid \
         AND j.state IN ('queued', 'running'))) THEN 1 ELSE 0 END AS BIGINT) AS at_rest \
         FROM devices d LEFT JOIN vms v ON v.uuid = d.used_by \
         WHERE d.parent IS NULL AND {filter}",
        COLS.split(", ")
            .map(|c| format!("d.{c}"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Task results' reports read and written together at most ([`InventoryTx::apply_changed`]),
/// so that one statement's values stay far under either database's limit.
const CHANGED_CHUNK: usize = 256;

/// The reports of [`InventoryTx::apply_changed`] that one read and one update can take:
/// a task's changed functions, from a node with no other report in the batch (a second
/// report must see the first one's writes). The rest, in their order.
fn plain_reports<'r, 'a>(reports: &'r [Report<'a>]) -> (Vec<&'r Report<'a>>, Vec<&'r Report<'a>>) {
    let mut per_server: HashMap<ServerId, usize> = HashMap::new();
    for r in reports {
        *per_server.entry(r.server).or_default() += 1;
    }
    reports.iter().partition(|r| {
        r.coverage == Coverage::Changed
            && r.host.is_none()
            && !r.devices.is_empty()
            && per_server.get(&r.server) == Some(&1)
    })
}

/// The update of a chunk of driver-and-details writes ([`InventoryWrite::plain`]) to rows
/// that stay as placeable as they were, with its values (`now` first).
fn plain_update_sql(now: i64, writes: &[(String, &InventoryWrite<'_>)]) -> (String, Vec<Arg>) {
    let mut args = vec![Arg::Int(now)];
    for (server, w) in writes {
        args.extend([Arg::Text(server.clone()), Arg::Text(w.id.clone())]);
        args.extend(w.reported());
    }
    (
        format!(
            "UPDATE devices SET vendor = v.column3, device = v.column4, subvendor = v.column5, \
             subsystem = v.column6, revision = v.column7, class = v.column8, driver = v.column9, \
             numa_node = CAST(v.column10 AS BIGINT), iommu_group = CAST(v.column11 AS BIGINT), \
             variant = v.column12, details = v.column13, updated_at = $1 \
             FROM (VALUES {}) AS v \
             WHERE devices.server_uuid = v.column1 AND devices.id = v.column2",
            page::value_rows(2, writes.len(), 13)
        ),
        args,
    )
}

/// One reported function's write, worked out before any is made: whether the report
/// changes what the node can place decides which locks it needs first.
struct InventoryWrite<'a> {
    device: &'a PciDevice,
    id: String,
    /// The stored row; `None`: a function new to the store.
    was: Option<&'a DeviceRow>,
    variant: Option<String>,
    details: Option<String>,
    health: Option<String>,
}

impl<'a> InventoryWrite<'a> {
    /// The write `d` needs, or `None` when it leaves the stored row as it is.
    fn of(
        d: &'a PciDevice,
        variants: &[passage_model::Variant],
        shared: &HashMap<passage_model::PciAddress, Option<String>>,
        known: &HashMap<&str, &'a KnownRow>,
    ) -> StoreResult<Option<Self>> {
        let id = d.id.to_string();
        let details = d
            .details
            .as_ref()
            .map(serde_json::to_string)
            .transpose()
            .map_err(corrupt)?;
        let matched = classify(variants, d, pf_variant(shared, d)).map(|v| v.name.clone());
        let Some(k) = known.get(id.as_str()) else {
            return Ok(Some(Self {
                device: d,
                id,
                was: None,
                variant: matched,
                details,
                health: None,
            }));
        };
        let previous: Option<passage_model::PciDetails> = k
            .row
            .details
            .as_deref()
            .and_then(|j| serde_json::from_str(j).ok());
        let health = crate::health::taint(k.at_rest == 1, previous.as_ref(), d);
        // A held or dirty device keeps its variant until it is free again.
        let variant = if matches!(k.row.state.as_str(), "unassigned" | "disabled") {
            matched
        } else {
            k.row.variant.clone()
        };
        if health.is_none() && k.same_as(d, &variant, &details) {
            return Ok(None);
        }
        Ok(Some(Self {
            device: d,
            id,
            was: Some(&k.row),
            variant,
            details,
            health,
        }))
    }

    /// What the report says of the function, in the order every statement that writes it
    /// takes: vendor, device, subvendor, subsystem, revision, class, driver, NUMA node,
    /// IOMMU group, variant, details. The numbers go as text (a `VALUES` column keeps one
    /// type over its rows, and a NULL here is text); the statements cast them back.
    fn reported(&self) -> [Arg; 11] {
        let d = self.device;
        let text = |o: &Option<String>| o.clone().map_or(Arg::Null, Arg::Text);
        let number = |o: Option<u32>| o.map_or(Arg::Null, |n| Arg::Text(n.to_string()));
        [
            Arg::Text(d.vendor.to_string()),
            Arg::Text(d.device.to_string()),
            Arg::Text(d.subvendor.to_string()),
            Arg::Text(d.subsystem.to_string()),
            Arg::Text(d.revision.to_string()),
            Arg::Text(d.class.to_string()),
            text(&d.driver),
            number(d.numa_node),
            number(d.iommu_group),
            text(&self.variant),
            text(&self.details),
        ]
    }

    /// Whether the write rewrites a known, present function without a taint: what
    /// [`plain_update_sql`] writes, nothing of whether it is placeable.
    fn plain(&self) -> bool {
        self.was.is_some_and(|was| was.missing == 0) && !self.recounts()
    }

    /// Whether the write may make the device placeable or stop it being so (new, a
    /// variant, `missing` or a taint changed).
    fn recounts(&self) -> bool {
        match self.was {
            None => true,
            Some(was) => self.health.is_some() || was.missing != 0 || was.variant != self.variant,
        }
    }
}

/// What an inventory found beside the devices.
#[derive(Clone, Copy, Debug, Default)]
pub struct Applied {
    /// Some variant is a VF variant: the node's functions may need their VFs made or
    /// taken down (`workflows::sriov`).
    pub vf_variants: bool,
}

impl DeviceRow {
    fn is_vf(&self) -> bool {
        self.details
            .as_deref()
            .and_then(|j| serde_json::from_str::<passage_model::PciDetails>(j).ok())
            .is_some_and(|d| d.physfn.is_some())
    }
}

/// The functions in state `shared` (hosting vGPUs or VFs), by address, with their
/// variants: a VF is a device only while its function is shared.
fn shared_functions<'a>(
    rows: impl Iterator<Item = &'a DeviceRow>,
) -> HashMap<passage_model::PciAddress, Option<String>> {
    rows.filter(|r| r.state == "shared")
        .filter_map(|r| {
            let path: DevicePath = r.id.parse().ok()?;
            path.vgpu()
                .is_none()
                .then(|| (path.address(), r.variant.clone()))
        })
        .collect()
}

/// The variant of `d`'s physical function when `d` is a VF of a shared function.
fn pf_variant<'a>(
    shared: &'a HashMap<passage_model::PciAddress, Option<String>>,
    d: &PciDevice,
) -> Option<&'a str> {
    let pf = d.details.as_ref()?.physfn?;
    shared.get(&pf)?.as_deref()
}

/// Re-derives every free device's variant after the variants changed. On Postgres
/// [`VARIANTS_LOCK`] is taken exclusively first, as an inventory takes it shared before
/// it reads the variants: an inventory still open when the variants changed is waited
/// for and its devices recounted here. Then every server's row, as a placement locks it
/// before it reads the devices' variants.
pub async fn recompute_variants(db: &Db) -> StoreResult<u64> {
    recompute_variants_on(db, None).await
}

/// [`recompute_variants`] for one server's devices, or every server's. For one server
/// the node's own lock stands in for [`VARIANTS_LOCK`]: only that node's reports need
/// waiting for.
pub async fn recompute_variants_on(db: &Db, server: Option<ServerId>) -> StoreResult<u64> {
    let server_s = server.map(|s| s.to_string());
    let lock = matches!(db, Db::Postgres(_)).then_some(
        "SELECT 1 FROM servers WHERE ($1 IS NULL OR uuid = $1) ORDER BY uuid \
         FOR NO KEY UPDATE",
    );
    in_tx!(db, |tx| {
        if let Some(lock) = lock {
            match &server_s {
                None => sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(VARIANTS_LOCK),
                Some(s) => sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
                    .bind(NODE_LOCK_SPACE)
                    .bind(s),
            }
            .execute(&mut *tx)
            .await?;
            let _: Vec<(i32,)> = sqlx::query_as(lock)
                .bind(&server_s)
                .fetch_all(&mut *tx)
                .await?;
        }
        let variants: Vec<super::variants::VariantRow> = sqlx::query_as(super::variants::LIST_ALL)
            .fetch_all(&mut *tx)
            .await?;
        let variants = super::variants::views(variants)?;
        let rows: Vec<DeviceRow> = sqlx::query_as(&format!(
            "SELECT {COLS} FROM devices WHERE state IN ('unassigned', 'disabled', 'shared') \
             AND parent IS NULL AND ($1 IS NULL OR server_uuid = $1)"
        ))
        .bind(&server_s)
        .fetch_all(&mut *tx)
        .await?;
        let mut shared: HashMap<String, HashMap<passage_model::PciAddress, Option<String>>> =
            HashMap::new();
        for r in &rows {
            shared
                .entry(r.server_uuid.clone())
                .or_default()
                .extend(shared_functions(std::iter::once(r)));
        }
        let free: Vec<DeviceRow> = rows.into_iter().filter(|r| r.state != "shared").collect();
        let mut changes = Vec::new();
        for r in records(free)? {
            let server_key = r.server_uuid.to_string();
            let pf = shared.get(&server_key).and_then(|m| pf_variant(m, &r.pci));
            let v = classify(&variants, &r.pci, pf).map(|v| v.name.clone());
            if v != r.variant {
                changes.push((server_key, r.pci.id.to_string(), v));
            }
        }
        let servers: std::collections::BTreeSet<String> =
            changes.iter().map(|(s, _, _)| s.clone()).collect();
        for (server, id, variant) in &changes {
            sqlx::query(
                "UPDATE devices SET variant = $3, generation = generation + 1 \
                 WHERE server_uuid = $1 AND id = $2 AND state IN ('unassigned', 'disabled')",
            )
            .bind(server)
            .bind(id)
            .bind(variant)
            .execute(&mut *tx)
            .await?;
        }
        let servers = servers
            .iter()
            .map(|s| parse_uuid(s, "server"))
            .collect::<StoreResult<Vec<ServerId>>>()?;
        tx.refresh_free_many(&servers).await?;
        Ok(changes.len() as u64)
    })
}

/// Count of devices per variant that match, for the variants view.
pub async fn count_by_variant(db: &Db) -> StoreResult<HashMap<String, i64>> {
    let rows: Vec<(String, i64)> = on_read!(db, |p| sqlx::query_as(
        "SELECT variant, COUNT(*) FROM devices WHERE variant IS NOT NULL GROUP BY variant"
    )
    .fetch_all(p)
    .await)?;
    Ok(rows.into_iter().collect())
}

/// Dirty devices untouched since `before_ms`: scrubs someone forgot (a job that failed, a
/// server that restarted).
/// Only on servers heard from since `alive_after_ms`: an offline node cannot scrub.
pub async fn dirty_before(
    db: &Db,
    before_ms: i64,
    alive_after_ms: i64,
) -> StoreResult<Vec<(ServerId, String)>> {
    let rows: Vec<(String, String)> = on_read!(db, |p| sqlx::query_as(
        "SELECT d.server_uuid, d.id FROM devices d JOIN servers s ON s.uuid = d.server_uuid \
         WHERE d.state = 'dirty' AND d.updated_at < $1 AND s.last_heartbeat >= $2"
    )
    .bind(before_ms)
    .bind(alive_after_ms)
    .fetch_all(p)
    .await)?;
    rows.into_iter()
        .map(|(s, id)| Ok((parse_uuid(&s, "server")?, id)))
        .collect()
}

/// Servers where SR-IOV functions may need their VFs made or taken down: those with a
/// function of a VF variant's parent, and those with a shared function that hosts no
/// vGPU slot (`workflows::sriov` sorts out which).
pub async fn sriov_servers(db: &Db) -> StoreResult<Vec<ServerId>> {
    let rows: Vec<(String,)> = on_read!(db, |p| sqlx::query_as(
        "SELECT d.server_uuid FROM variants v JOIN devices d ON d.variant = v.parent \
         WHERE v.kind = 'vf' AND d.parent IS NULL \
         UNION SELECT d.server_uuid FROM devices d WHERE d.parent IS NULL \
         AND d.state = 'shared' AND NOT EXISTS (SELECT 1 FROM devices s \
         WHERE s.server_uuid = d.server_uuid AND s.parent = d.id)"
    )
    .fetch_all(p)
    .await)?;
    rows.into_iter()
        .map(|(s,)| parse_uuid(&s, "server"))
        .collect()
}

/// The taint of a function whose node refused the VFs asked of it starts so.
pub const SRIOV_TAINT: &str = "sriov: ";

/// Keeps the node's refusal to make a function's VFs as the function's taint (`why`
/// starts with [`SRIOV_TAINT`]), or clears such a taint (`None`). Another taint (a health
/// finding, an operator's) is never replaced nor cleared here.
pub async fn sriov_refused(
    db: &Db,
    server: ServerId,
    id: &str,
    why: Option<&str>,
) -> StoreResult<()> {
    in_tx!(db, |tx| {
        sqlx::query(
            "UPDATE devices SET taint = $3, generation = generation + 1, updated_at = $4 \
             WHERE server_uuid = $1 AND id = $2 AND CAST($3 AS TEXT) IS DISTINCT FROM taint \
             AND (taint IS NULL OR taint LIKE $5)",
        )
        .bind(server.to_string())
        .bind(id)
        .bind(why)
        .bind(now_ms())
        .bind(format!("{SRIOV_TAINT}%"))
        .execute(&mut *tx)
        .await?;
        tx.refresh_free(server).await?;
        Ok(())
    })
}

/// Clears a device's taint; false if it had none.
pub async fn clear_taint(db: &Db, server: ServerId, id: &str) -> StoreResult<bool> {
    in_tx!(db, |tx| {
        let n = sqlx::query(
            "UPDATE devices SET taint = NULL, generation = generation + 1 \
             WHERE server_uuid = $1 AND id = $2 AND taint IS NOT NULL AND missing = 0",
        )
        .bind(server.to_string())
        .bind(id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.refresh_free(server).await?;
        Ok(n == 1)
    })
}

/// Up to `limit` servers in service, heard from since `alive_after_ms`, with at least
/// `at_least` free devices of `variant` and room for one VM as `fit` asks: fewest free
/// first (pack) or most (spread).
pub async fn hinted_servers(
    db: &Db,
    variant: &str,
    at_least: u32,
    alive_after_ms: i64,
    spread: bool,
    limit: i64,
    fit: super::room::Fit,
) -> StoreResult<Vec<(ServerId, i64)>> {
    let order = if spread { "DESC" } else { "ASC" };
    let sql = format!(
        "SELECT f.server_uuid, f.free FROM free_devices f \
         JOIN servers s ON s.uuid = f.server_uuid \
         WHERE f.variant = $1 AND f.free >= $2 AND s.last_heartbeat >= $3 \
         AND s.disabled = 0 AND {} ORDER BY f.free {order} LIMIT $4",
        super::room::has_room_sql(fit.alloc, "$5", "$6")
    );
    let rows: Vec<(String, i64)> = on_read!(db, |p| sqlx::query_as(&sql)
        .bind(variant)
        .bind(i64::from(at_least))
        .bind(alive_after_ms)
        .bind(limit)
        .bind(i64::from(fit.vcpus))
        .bind(i64::try_from(fit.memory_mib).unwrap_or(i64::MAX))
        .fetch_all(p)
        .await)?;
    rows.iter()
        .map(|(s, n)| Ok((parse_uuid(s, "server")?, *n)))
        .collect()
}

/// What a batch of placements reads: the servers the free-device index suggests, in its
/// order, with their room and their placeable devices.
pub struct PlacementView {
    pub servers: Vec<ServerId>,
    pub rooms: HashMap<ServerId, super::room::Room>,
    pub candidates: Vec<Candidate>,
}

/// Servers in service, heard from since `alive_after_ms`, with at least `at_least` free
/// devices of `variant` and room for one VM as `fit` asks (fewest free first, or most
/// with `spread`), as many as hold
/// `need` such devices together but at most `limit`; their vCPUs and memory, and their
/// placeable devices of `variants`: one query.
#[allow(clippy::too_many_arguments)]
pub async fn placement_view(
    db: &Db,
    variant: &str,
    at_least: u32,
    variants: &[String],
    alive_after_ms: i64,
    spread: bool,
    need: i64,
    limit: i64,
    fit: super::room::Fit,
) -> StoreResult<PlacementView> {
    let alloc = fit.alloc;
    let order = if spread { "DESC" } else { "ASC" };
    // Row kinds: 0 a suggested server (n1: its free devices), 1 its room, 2 a free device.
    // The servers come in policy order until they hold `need` devices or `limit` servers.
    // The running count is taken over the first `limit` servers only, after their
    // `LIMIT`: the read then walks the index in (free, server) order, both ways alike,
    // and stops there, checking the room of those servers alone. Counted over every
    // server with a free device, it checked the room of all of them and sorted them for
    // each batch: 18.6 ms against 1.0 ms at 1,250 servers on Postgres.
    // `CROSS JOIN` keeps SQLite walking from the few suggested servers into the big tables
    // by key, whatever its statistics say. Postgres plans a `CROSS JOIN` as a plain join,
    // and from statistics gathered before the fleet's devices were placeable (the first
    // batch after a fleet joined) it read every free device once per suggested server:
    // 225 and 237 ms for the first reads of a burst at 1,250 servers (`auto_explain`),
    // which every creation waited for. There the devices are read in a `LATERAL` subquery
    // that the planner may not pull up (`OFFSET 0`), so each server's are looked up by its
    // key, and the variants are named, not `IS NOT NULL`, so that every column of the
    // placement index bounds the lookup.
    let mut variants_wanted: Vec<&str> = vec![variant];
    for v in variants {
        if !variants_wanted.contains(&v.as_str()) {
            variants_wanted.push(v);
        }
    }
    let free_devices = match db {
        Db::Postgres(_) => format!(
            "FROM h CROSS JOIN LATERAL (SELECT d.server_uuid, d.id, d.variant, d.numa_node \
             FROM devices d WHERE d.server_uuid = h.uuid AND {} AND d.variant IN ({}) \
             OFFSET 0) AS d",
            placeable("d."),
            page::marks(8, variants_wanted.len())
        ),
        Db::Sqlite { .. } => format!(
            "FROM h CROSS JOIN devices d WHERE d.server_uuid = h.uuid AND {} \
             AND d.variant IS NOT NULL",
            placeable("d.")
        ),
    };
    let sql = format!(
        "WITH h AS MATERIALIZED (SELECT uuid, free FROM (SELECT uuid, free, \
         SUM(free) OVER (ORDER BY free {order}, uuid {order} ROWS UNBOUNDED PRECEDING) \
         AS upto FROM (SELECT f.server_uuid AS uuid, f.free AS free FROM free_devices f \
         JOIN servers s ON s.uuid = f.server_uuid \
         WHERE f.variant = $1 AND f.free >= $2 AND s.last_heartbeat >= $3 AND s.disabled = 0 \
         AND {has_room} ORDER BY f.free {order}, f.server_uuid {order} LIMIT $5) AS pick) \
         AS r WHERE upto - free < $4 ORDER BY free {order}, uuid {order} LIMIT $5) \
         SELECT 0 AS kind, h.uuid AS k, CAST(NULL AS TEXT) AS id, CAST(NULL AS TEXT) AS v, \
         h.free AS n1, CAST(NULL AS BIGINT) AS n2, CAST(NULL AS BIGINT) AS n3, \
         CAST(NULL AS BIGINT) AS n4 FROM h \
         UNION ALL SELECT 1, s.uuid, NULL, NULL, {ROOM_COLS} \
         FROM h CROSS JOIN servers s LEFT JOIN vms v ON {VMS_HOLDING} \
         WHERE s.uuid = h.uuid AND {REPORTED} {ROOM_GROUP} \
         UNION ALL SELECT 2, d.server_uuid, d.id, d.variant, d.numa_node, NULL, NULL, NULL \
         {free_devices}",
        has_room = super::room::has_room_sql(alloc, "$6", "$7"),
    );
    let mut args = vec![
        page::Arg::Text(variant.to_string()),
        page::Arg::Int(i64::from(at_least)),
        page::Arg::Int(alive_after_ms),
        page::Arg::Int(need),
        page::Arg::Int(limit),
        page::Arg::Int(i64::from(fit.vcpus)),
        page::Arg::Int(i64::try_from(fit.memory_mib).unwrap_or(i64::MAX)),
    ];
    if matches!(db, Db::Postgres(_)) {
        args.extend(
            variants_wanted
                .iter()
                .map(|v| page::Arg::Text((*v).to_string())),
        );
    }
    type Row = (
        i32,
        String,
        Option<String>,
        Option<String>,
        Option<i64>,
        Option<i64>,
        Option<i64>,
        Option<i64>,
    );
    let rows: Vec<Row> = page::fetch(db, &sql, &args).await?;
    let mut ranked: Vec<(i64, ServerId)> = Vec::new();
    let mut view = PlacementView {
        servers: Vec::new(),
        rooms: HashMap::new(),
        candidates: Vec::new(),
    };
    for (kind, key, id, variant, n1, n2, n3, n4) in rows {
        let server: ServerId = parse_uuid(&key, "server")?;
        match kind {
            0 => ranked.push((n1.unwrap_or(0), server)),
            1 => {
                view.rooms.insert(
                    server,
                    super::room::Room::new(
                        alloc,
                        n1.unwrap_or(0),
                        n2.unwrap_or(0),
                        n3.unwrap_or(0),
                        n4.unwrap_or(0),
                    ),
                );
            }
            _ => {
                let variant = variant.unwrap_or_default();
                if variants.contains(&variant) {
                    view.candidates.push(Candidate {
                        server_uuid: server,
                        id: id.unwrap_or_default().parse().map_err(corrupt)?,
                        variant,
                        numa_node: n1.and_then(|n| u32::try_from(n).ok()),
                        window: None,
                    });
                }
            }
        }
    }
    if spread {
        ranked.sort_by_key(|r| std::cmp::Reverse(r.0));
    } else {
        ranked.sort_by_key(|r| r.0);
    }
    view.servers = ranked.into_iter().map(|(_, s)| s).collect();
    Ok(view)
}

/// The placeable devices of these variants on one server.
pub async fn candidates_on(
    db: &Db,
    server: ServerId,
    variants: &[String],
) -> StoreResult<Vec<Candidate>> {
    let sql = format!(
        "SELECT id, variant, numa_node FROM devices WHERE server_uuid = $1 AND {} \
         AND variant IS NOT NULL",
        placeable("")
    );
    let rows: Vec<(String, String, Option<i64>)> = on_read!(db, |p| sqlx::query_as(&sql)
        .bind(server.to_string())
        .fetch_all(p)
        .await)?;
    rows.into_iter()
        .filter(|(_, v, _)| variants.contains(v))
        .map(|(id, variant, numa)| {
            Ok(Candidate {
                server_uuid: server,
                id: id.parse().map_err(corrupt)?,
                variant,
                numa_node: numa.and_then(|n| u32::try_from(n).ok()),
                window: None,
            })
        })
        .collect()
}
