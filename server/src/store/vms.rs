//! VMs: their rows, their state, and the jobs that change them. Creation is
//! `store::create`; everything a VM reserves goes through `store::reserve`.

use super::device_moves::DeviceWrite;
use super::devices::DeviceTx;
use super::jobs::{JobTx, NewJob};
use super::page::{self, Page, PageReq, TimeKey, Where};
use super::reserve::{self, Claim, ReserveTx};
use super::room::Allocation;
use super::sql::Sql;
use super::{Db, StoreError, StoreResult, corrupt, now_ms, parse_uuid, to_time};
use crate::{bind_args, in_tx, on_read, on_write};
use passage_model::api::{Vm, VmState};
use passage_model::{AccountId, DeviceEvent, JobId, PackageId, ServerId, VmId};
use std::collections::HashMap;

#[derive(sqlx::FromRow)]
struct VmRow {
    uuid: String,
    alias: String,
    owner_uuid: String,
    server_uuid: Option<String>,
    package_uuid: Option<String>,
    state: String,
    vcpus: i64,
    memory_mib: i64,
    assigned_devices: String,
    job_uuid: Option<String>,
    created_at: i64,
    image_uuid: Option<String>,
    nics: String,
    tags: String,
    updated_at: i64,
    metadata: String,
    ssh_keys: Option<String>,
}

const COLS: &str = "uuid, alias, owner_uuid, server_uuid, package_uuid, state, vcpus, \
    memory_mib, assigned_devices, job_uuid, created_at, image_uuid, nics, tags, updated_at, \
    metadata, ssh_keys";

/// One of the owner's keys a VM was given, as kept with the VM: the key itself too, so
/// that its guest trusts what it was given even after the account's key is deleted.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct GivenKey {
    pub name: String,
    pub fingerprint: String,
    pub key: String,
}

/// The `ssh_keys` column's keys as the VM lists them; `None` if unreadable.
pub fn listed_keys(text: &str) -> Option<Vec<passage_model::keys::VmKey>> {
    let keys: Vec<GivenKey> = serde_json::from_str(text).ok()?;
    Some(
        keys.into_iter()
            .map(|k| passage_model::keys::VmKey {
                name: k.name,
                fingerprint: k.fingerprint,
            })
            .collect(),
    )
}

impl VmRow {
    fn into_view(self) -> StoreResult<Vm> {
        let nics: Vec<passage_model::networks::Nic> =
            serde_json::from_str(&self.nics).map_err(corrupt)?;
        Ok(Vm {
            primary_ip: nics.iter().find(|n| n.primary).map(|n| n.ip),
            nics,
            uuid: parse_uuid(&self.uuid, "vm")?,
            alias: self.alias,
            owner_uuid: parse_uuid(&self.owner_uuid, "account")?,
            server_uuid: self
                .server_uuid
                .as_deref()
                .map(|s| parse_uuid(s, "server"))
                .transpose()?,
            package_uuid: self
                .package_uuid
                .as_deref()
                .map(|s| parse_uuid(s, "package"))
                .transpose()?,
            state: VmState::parse(&self.state).ok_or_else(|| corrupt(&self.state))?,
            vcpus: u32::try_from(self.vcpus).unwrap_or(0),
            memory_mib: u64::try_from(self.memory_mib).unwrap_or(0),
            assigned_devices: serde_json::from_str(&self.assigned_devices).map_err(corrupt)?,
            job_uuid: self
                .job_uuid
                .as_deref()
                .map(|s| parse_uuid(s, "job"))
                .transpose()?,
            image_uuid: self
                .image_uuid
                .as_deref()
                .map(|s| parse_uuid(s, "image"))
                .transpose()?,
            tags: serde_json::from_str(&self.tags).map_err(corrupt)?,
            keys: match self.ssh_keys.as_deref() {
                Some(text) => Some(listed_keys(text).ok_or_else(|| corrupt("ssh_keys"))?),
                None => None,
            },
            metadata: serde_json::from_str(&self.metadata).map_err(corrupt)?,
            created_at: to_time(self.created_at),
            updated_at: to_time(self.updated_at),
        })
    }
}

pub async fn get(db: &Db, uuid: VmId) -> StoreResult<Vm> {
    let row: Option<VmRow> = on_read!(db, |p| sqlx::query_as(&format!(
        "SELECT {COLS} FROM vms WHERE uuid = $1"
    ))
    .bind(uuid.to_string())
    .fetch_optional(p)
    .await)?;
    row.ok_or(StoreError::NotFound("vm"))?.into_view()
}

pub use crate::listing::VmFilter;

/// One page of VMs, newest first, filtered in SQL.
pub async fn list(db: &Db, f: &VmFilter, req: &PageReq<TimeKey>) -> StoreResult<Page<Vm, TimeKey>> {
    let mut w = Where::default();
    if let Some(o) = f.owner {
        let a = w.text(o.to_string());
        w.and(format!("owner_uuid = {a}"));
    }
    if let Some(st) = f.state {
        let a = w.text(st.as_str());
        w.and(format!("state = {a}"));
    }
    if let Some(sv) = f.server {
        let a = w.text(sv.to_string());
        w.and(format!("server_uuid = {a}"));
    }
    if let Some(i) = f.image {
        let a = w.text(i.to_string());
        w.and(format!("image_uuid = {a}"));
    }
    if let Some(d) = &f.assigned_device {
        // One whole element of the JSON array of paths: quoted, with LIKE's wildcards
        // escaped (a device path has none, but the store does not rely on it).
        let escaped = d
            .replace('\\', "\\\\")
            .replace('%', "\\%")
            .replace('_', "\\_");
        let a = w.text(format!("%\"{escaped}\"%"));
        w.and(format!("assigned_devices LIKE {a} ESCAPE '\\'"));
    }
    if let Some(alias) = &f.alias {
        let a = w.text(alias.clone());
        w.and(format!("alias = {a}"));
    }
    if f.live {
        let a = w.text(VmState::Destroyed.as_str());
        w.and(format!("state <> {a}"));
    }
    if let Some(m) = f.memory_mib {
        let a = w.int(i64::try_from(m).unwrap_or(i64::MAX));
        w.and(format!("memory_mib = {a}"));
    }
    for (key, texts) in &f.tags {
        // The value's JSON text: SQLite's `->` and Postgres' `jsonb -> key` both give it
        // minified, so `"train"`, `8` and `true` compare as written by `filter_texts`.
        let value = match db {
            Db::Sqlite { .. } => {
                let k = w.text(format!("$.\"{key}\""));
                format!("(tags -> {k})")
            }
            Db::Postgres(_) => {
                let k = w.text(key.clone());
                format!("((tags::jsonb -> {k})::text)")
            }
        };
        let alts: Vec<String> = texts.iter().map(|t| w.text(t.clone())).collect();
        w.and(format!("{value} IN ({})", alts.join(", ")));
    }
    let p = page::newest_first(db, COLS, "vms", w, req, |r: &VmRow| {
        TimeKey::new(r.created_at, &r.uuid)
    })
    .await?;
    Ok(Page {
        items: p
            .items
            .into_iter()
            .map(VmRow::into_view)
            .collect::<StoreResult<_>>()?,
        total: p.total,
        next: p.next,
    })
}

/// Moves a VM from one of `from` to `to`; false if it was in none of them.
pub async fn set_state(db: &Db, uuid: VmId, from: &[VmState], to: VmState) -> StoreResult<bool> {
    let list: Vec<String> = from.iter().map(|s| format!("'{}'", s.as_str())).collect();
    let n = on_write!(db, |p| sqlx::query(&format!(
        "UPDATE vms SET state = $2, updated_at = $3 WHERE uuid = $1 AND state IN ({})",
        list.join(", ")
    ))
    .bind(uuid.to_string())
    .bind(to.as_str())
    .bind(now_ms())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(n == 1)
}

/// Starts a destroy: the VM goes `destroying` and its destroy job `job` is written,
/// together, if the VM is at rest with no job running. The job written is `job_for` the
/// VM as the update leaves it, which may refuse it instead (the transaction is then
/// undone, and its error is the answer).
pub async fn begin_destroy(
    db: &Db,
    uuid: VmId,
    job: JobId,
    job_for: impl FnOnce(&Vm) -> StoreResult<NewJob> + Send,
) -> StoreResult<Vm> {
    // The row as the update leaves it is the answer: no read after the commit.
    in_tx!(db, |tx| {
        let row: Option<VmRow> = sqlx::query_as(&format!(
            "UPDATE vms SET state = 'destroying', job_uuid = $2, updated_at = $3 \
             WHERE uuid = $1 AND state IN ('running', 'stopped', 'failed') AND {NO_JOB_RUNNING} \
             RETURNING {COLS}",
        ))
        .bind(uuid.to_string())
        .bind(job.to_string())
        .bind(now_ms())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Err(StoreError::InvalidState(
                "the VM has a job running (provision, stop, start, resize, migrate or destroy); \
                 wait for it"
                    .into(),
            ));
        };
        let vm = row.into_view()?;
        let new = job_for(&vm)?;
        tx.insert_jobs(std::slice::from_ref(&new)).await?;
        Ok(vm)
    })
}

/// A deletion of a VM still provisioning (a cancel): the VM goes `destroying` while its
/// provision job `job` runs on; that job sees it at its next step, unwinds, and then
/// writes the VM's destroy ([`destroy_after_cancel`]). `None` when the VM is not
/// provisioning under that job (its provision ended meanwhile).
pub async fn cancel_provision(db: &Db, uuid: VmId, job: JobId) -> StoreResult<Option<Vm>> {
    let row: Option<VmRow> = on_write!(db, |p| sqlx::query_as(&format!(
        "UPDATE vms SET state = 'destroying', updated_at = $3 \
         WHERE uuid = $1 AND state = 'provisioning' AND job_uuid = $2 RETURNING {COLS}"
    ))
    .bind(uuid.to_string())
    .bind(job.to_string())
    .bind(now_ms())
    .fetch_optional(p)
    .await)?;
    row.map(VmRow::into_view).transpose()
}

/// After the unwind of provision `cancelled`, whose VM was deleted meanwhile: the VM's
/// destroy job, written as `job_for` makes it for the VM as the update leaves it, with
/// the VM naming it. `None` when the VM is not `destroying` under that provision.
pub async fn destroy_after_cancel(
    db: &Db,
    uuid: VmId,
    cancelled: JobId,
    job: JobId,
    job_for: impl FnOnce(&Vm) -> StoreResult<NewJob> + Send,
) -> StoreResult<Option<Vm>> {
    in_tx!(db, |tx| {
        let row: Option<VmRow> = sqlx::query_as(&format!(
            "UPDATE vms SET job_uuid = $3, updated_at = $4 \
             WHERE uuid = $1 AND state = 'destroying' AND job_uuid = $2 RETURNING {COLS}",
        ))
        .bind(uuid.to_string())
        .bind(cancelled.to_string())
        .bind(job.to_string())
        .bind(now_ms())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let vm = row.into_view()?;
        let new = job_for(&vm)?;
        tx.insert_jobs(std::slice::from_ref(&new)).await?;
        Ok(Some(vm))
    })
}

/// One VM's destroy in a batch of them ([`begin_destroy_many`]).
pub struct DestroyReq {
    pub vm: VmId,
    pub job: JobId,
    /// The VM must be this account's (a tenant's own); `None`: anyone's.
    pub owner: Option<AccountId>,
}

/// [`begin_destroy`] for several VMs in one transaction: one commit (on Postgres, one wait
/// for the WAL's flush) for a burst of deletions instead of one each. Each VM that is at
/// rest with no job running, and is `owner`'s where one is given, goes `destroying` with
/// its job, written as `job_for` makes it; the answers follow `reqs`, `None` for a VM not
/// changed (missing, another's, busy or destroyed: the caller tells which apart).
pub async fn begin_destroy_many(
    db: &Db,
    reqs: &[DestroyReq],
    job_for: impl Fn(&Vm) -> StoreResult<NewJob> + Send + Sync,
) -> StoreResult<Vec<Option<Vm>>> {
    if reqs.is_empty() {
        return Ok(Vec::new());
    }
    let now = now_ms();
    in_tx!(db, |tx| {
        let rows = tx.mark_destroying(reqs, now).await?;
        let mut changed: HashMap<JobId, Vm> = HashMap::with_capacity(rows.len());
        let mut jobs = Vec::with_capacity(rows.len());
        for row in rows {
            let vm = row.into_view()?;
            let job = job_for(&vm)?;
            changed.insert(job.uuid, vm);
            jobs.push(job);
        }
        tx.insert_jobs(&jobs).await?;
        Ok(reqs.iter().map(|r| changed.remove(&r.job)).collect())
    })
}

/// What a VM at rest with no job running, `owner`'s where one is given, must be for a
/// batched destroy to take it.
fn destroy_cond() -> String {
    "(b.owner IS NULL OR vms.owner_uuid = b.owner) \
     AND vms.state IN ('running', 'stopped', 'failed') AND "
        .to_string()
        + NO_JOB_RUNNING
}

/// [`begin_destroy_many`]'s update, in one statement on either database.
trait DestroyTx {
    /// Marks the VMs of `reqs` that may be destroyed `destroying` with their jobs; answers
    /// their rows as the update leaves them. `b` names a VM twice when two deletions of it
    /// come together: one of them gets it (its job is the row's), the other is refused as
    /// the VM being busy.
    fn mark_destroying(
        &mut self,
        reqs: &[DestroyReq],
        now: i64,
    ) -> impl Future<Output = StoreResult<Vec<VmRow>>> + Send;
}

impl DestroyTx for sqlx::Transaction<'_, sqlx::Sqlite> {
    async fn mark_destroying(&mut self, reqs: &[DestroyReq], now: i64) -> StoreResult<Vec<VmRow>> {
        let mut q = Sql::default();
        let values = q.rows(reqs, |q, r| {
            let owner = r
                .owner
                .map_or(page::Arg::Null, |o| page::Arg::Text(o.to_string()));
            format!("{}, {}, {}", q.text(r.vm), q.text(r.job), q.arg(owner))
        });
        let at = q.int(now);
        let sql = format!(
            "WITH b(vm, job, owner) AS (VALUES {values}) \
             UPDATE vms SET state = 'destroying', job_uuid = b.job, updated_at = {at} \
             FROM b WHERE vms.uuid = b.vm AND {} RETURNING {COLS}",
            destroy_cond()
        );
        Ok(bind_args!(sqlx::query_as(&sql), &q.args)
            .fetch_all(&mut **self)
            .await?)
    }
}

impl DestroyTx for sqlx::Transaction<'_, sqlx::Postgres> {
    async fn mark_destroying(&mut self, reqs: &[DestroyReq], now: i64) -> StoreResult<Vec<VmRow>> {
        let sql = format!(
            "UPDATE vms SET state = 'destroying', job_uuid = b.job, updated_at = $1 \
             FROM UNNEST($2::text[], $3::text[], $4::text[]) AS b(vm, job, owner) \
             WHERE vms.uuid = b.vm AND {} RETURNING {}",
            destroy_cond(),
            qualified_cols("vms")
        );
        let owners: Vec<Option<String>> = reqs
            .iter()
            .map(|r| r.owner.map(|o| o.to_string()))
            .collect();
        Ok(sqlx::query_as(&sql)
            .bind(now)
            .bind(reqs.iter().map(|r| r.vm.to_string()).collect::<Vec<_>>())
            .bind(reqs.iter().map(|r| r.job.to_string()).collect::<Vec<_>>())
            .bind(owners)
            .fetch_all(&mut **self)
            .await?)
    }
}

/// [`COLS`], each qualified by `table`: a statement that joins another relation names
/// them unambiguously.
fn qualified_cols(table: &str) -> String {
    COLS.split(',')
        .map(|c| format!("{table}.{}", c.trim()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// VMs on a server, for the server object's `vms` map.
pub async fn on_server(db: &Db, server: ServerId) -> StoreResult<Vec<Vm>> {
    let rows: Vec<VmRow> = on_read!(db, |p| sqlx::query_as(&format!(
        "SELECT {COLS} FROM vms WHERE server_uuid = $1 \
         AND state NOT IN ('destroyed', 'failed') ORDER BY created_at"
    ))
    .bind(server.to_string())
    .fetch_all(p)
    .await)?;
    rows.into_iter().map(VmRow::into_view).collect()
}

/// The VMs of several servers at once (one page of the server list), by creation.
pub async fn on_servers(db: &Db, servers: &[ServerId]) -> StoreResult<Vec<Vm>> {
    if servers.is_empty() {
        return Ok(Vec::new());
    }
    let sql = format!(
        "SELECT {COLS} FROM vms WHERE server_uuid IN ({}) \
         AND state NOT IN ('destroyed', 'failed') ORDER BY created_at",
        page::marks(1, servers.len())
    );
    let args: Vec<page::Arg> = servers
        .iter()
        .map(|s| page::Arg::Text(s.to_string()))
        .collect();
    let rows: Vec<VmRow> = page::fetch(db, &sql, &args).await?;
    rows.into_iter().map(VmRow::into_view).collect()
}

/// The last provision step: devices `used`, VM `running`, together
/// (`DeviceWrite::running`; the job steps write it with others, `services::device_log`).
pub async fn mark_running(
    db: &Db,
    uuid: VmId,
    server: ServerId,
    ids: &[String],
) -> StoreResult<()> {
    let w = DeviceWrite::running(uuid, server, ids);
    alone(db, w).await
}

/// The destroy's point of no return: the VM's devices go `dirty` (to be scrubbed) and the
/// VM is `destroyed`, together (`DeviceWrite::destroyed`).
pub async fn release_destroyed(
    db: &Db,
    uuid: VmId,
    server: Option<ServerId>,
    ids: &[String],
) -> StoreResult<()> {
    alone(db, DeviceWrite::destroyed(uuid, server, ids)).await
}

/// `w` in a transaction of its own.
async fn alone(db: &Db, w: DeviceWrite) -> StoreResult<()> {
    let mut answers = super::device_moves::write(db, std::slice::from_ref(&w)).await?;
    answers.pop().unwrap_or(Ok(Vec::new())).map(drop)
}

/// A VM has at most one job at a time. Correlated, so each VM looks up its own job by
/// key: `NOT IN (SELECT …)` built the set of every unfinished job for each statement,
/// and 10,000 deletions queued behind each other made that quadratic.
const NO_JOB_RUNNING: &str = "(vms.job_uuid IS NULL OR NOT EXISTS \
    (SELECT 1 FROM jobs j WHERE j.uuid = vms.job_uuid AND j.state IN ('queued', 'running')))";

/// Writes `job` for a VM in one of `from` with no other job running, reserving first what
/// `claim` asks (all or none: `StoreError::Retry` when a device was taken, `NoRoom`,
/// `Quota`). The VM row keeps its old server and shape until the job ends; the claim
/// counts it at its new one on the target server.
pub async fn begin_job(
    db: &Db,
    uuid: VmId,
    from: &[VmState],
    job: NewJob,
    claim: Option<Claim<'_>>,
    alloc: Allocation,
) -> StoreResult<Vm> {
    begin_job_as(db, uuid, from, None, job, claim, alloc).await
}

/// [`begin_job`], the VM going to state `to` in the same write when one is given (a
/// stop's `stopping`, shown from the answer on).
pub async fn begin_job_as(
    db: &Db,
    uuid: VmId,
    from: &[VmState],
    to: Option<VmState>,
    job: NewJob,
    claim: Option<Claim<'_>>,
    alloc: Allocation,
) -> StoreResult<Vm> {
    let states: Vec<String> = from.iter().map(|s| format!("'{}'", s.as_str())).collect();
    // A state's name from the model's own list, never from a caller's text.
    let set_state = to.map_or(String::new(), |s| format!(", state = '{}'", s.as_str()));
    in_tx!(db, |tx| {
        let n = sqlx::query(&format!(
            "UPDATE vms SET job_uuid = $2, updated_at = $3{set_state} WHERE uuid = $1 \
             AND state IN ({}) AND {NO_JOB_RUNNING}",
            states.join(", ")
        ))
        .bind(uuid.to_string())
        .bind(job.uuid.to_string())
        .bind(now_ms())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n != 1 {
            return Err(StoreError::InvalidState(format!(
                "the VM must be {} with no job running",
                from.iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(" or ")
            )));
        }
        if let Some(claim) = claim {
            let verdict = tx
                .reserve(&[claim], alloc, job.kind.as_str())
                .await?
                .pop()
                .unwrap_or(Ok(()));
            verdict.map_err(reserve::refused)?;
        }
        tx.insert_jobs(std::slice::from_ref(&job)).await?;
        Ok(())
    })?;
    get(db, uuid).await
}

/// The new shape of a VM after a resize or a cold migration.
pub struct Replacement<'a> {
    pub from_server: ServerId,
    pub to_server: ServerId,
    pub added: &'a [String],
    pub removed: &'a [String],
    pub assigned: &'a [String],
    pub package: Option<PackageId>,
    pub vcpus: u32,
    pub memory_mib: u64,
}

/// The point of no return of a resize or migration: added devices `used`, removed ones
/// `dirty`, usage records and the VM row updated, together.
pub async fn commit_replacement(db: &Db, uuid: VmId, r: Replacement<'_>) -> StoreResult<()> {
    let now = now_ms();
    let assigned = serde_json::to_string(r.assigned).map_err(corrupt)?;
    in_tx!(db, |tx| {
        tx.move_devices(
            r.to_server,
            r.added,
            DeviceEvent::Attach,
            Some(uuid),
            &format!("attached to VM {uuid}"),
        )
        .await?;
        tx.move_devices(
            r.from_server,
            r.removed,
            DeviceEvent::Release,
            Some(uuid),
            &format!("released by VM {uuid}"),
        )
        .await?;
        for id in r.removed {
            sqlx::query(
                "UPDATE usage_records SET ended_at = $3 WHERE vm_uuid = $1 AND device = $2 \
                 AND server_uuid = $4 AND ended_at IS NULL",
            )
            .bind(uuid.to_string())
            .bind(id)
            .bind(now)
            .bind(r.from_server.to_string())
            .execute(&mut *tx)
            .await?;
        }
        for id in r.added {
            sqlx::query(
                "INSERT INTO usage_records (vm_uuid, owner_uuid, server_uuid, device, \
                 variant, started_at) SELECT v.uuid, v.owner_uuid, $2, $3, \
                 (SELECT variant FROM devices WHERE server_uuid = $2 AND id = $3), $4 \
                 FROM vms v WHERE v.uuid = $1",
            )
            .bind(uuid.to_string())
            .bind(r.to_server.to_string())
            .bind(id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query(
            "UPDATE vms SET server_uuid = $2, package_uuid = COALESCE($3, package_uuid), \
             vcpus = $4, memory_mib = $5, assigned_devices = $6, updated_at = $7 WHERE uuid = $1",
        )
        .bind(uuid.to_string())
        .bind(r.to_server.to_string())
        .bind(r.package.map(|p| p.to_string()))
        .bind(i64::from(r.vcpus))
        .bind(i64::try_from(r.memory_mib).unwrap_or(i64::MAX))
        .bind(assigned)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        Ok(())
    })
}

/// Running VMs of a server that its node no longer runs (and no job is working on, and
/// that have been running longer than `grace_ms`) become `stopped`, each with a
/// `vm_exited` alert; returns them.
pub async fn reconcile_exits(
    db: &Db,
    server: ServerId,
    running: &[VmId],
    grace_ms: i64,
) -> StoreResult<Vec<VmId>> {
    let now = now_ms();
    let rows: Vec<String> = on_read!(db, |p| sqlx::query_scalar(&format!(
        "SELECT uuid FROM vms WHERE server_uuid = $1 AND state = 'running' \
         AND updated_at < $2 AND {NO_JOB_RUNNING}"
    ))
    .bind(server.to_string())
    .bind(now - grace_ms)
    .fetch_all(p)
    .await)?;
    let mut gone = Vec::new();
    for u in rows {
        let vm: VmId = parse_uuid(&u, "vm")?;
        if running.contains(&vm) {
            continue;
        }
        // The alert goes with the state: whoever sees the VM stopped sees why.
        let stopped = in_tx!(db, |tx| {
            let n = sqlx::query(&format!(
                "UPDATE vms SET state = 'stopped', updated_at = $2 WHERE uuid = $1 \
                 AND state = 'running' AND {NO_JOB_RUNNING}"
            ))
            .bind(&u)
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n == 1 {
                sqlx::query(
                    "INSERT INTO alerts (kind, message, variant, count, at) \
                     VALUES ('vm_exited', $1, NULL, NULL, $2)",
                )
                .bind(format!(
                    "VM {vm} stopped running on server {server} without being asked"
                ))
                .bind(now)
                .execute(&mut *tx)
                .await?;
            }
            Ok(n == 1)
        })?;
        if stopped {
            gone.push(vm);
        }
    }
    Ok(gone)
}

/// What a VM's guest is told at its launch, read together: its metadata, and the public
/// keys it was given at creation (those it was made with, in the order given), or for a
/// VM made before keys could be chosen, its owner's keys (oldest first) as they are now.
pub struct GuestInputs {
    pub metadata: std::collections::BTreeMap<String, String>,
    pub keys: Vec<String>,
}

pub async fn guest_inputs(db: &Db, uuid: VmId) -> StoreResult<GuestInputs> {
    // One row per owner's key (one with no key when the owner has none), each with the
    // metadata and the keys the VM was given.
    let rows: Vec<(String, Option<String>, Option<String>)> = on_read!(db, |c| sqlx::query_as(
        "SELECT v.metadata, v.ssh_keys, k.public_key FROM vms v \
         LEFT JOIN ssh_keys k ON k.account_uuid = v.owner_uuid AND v.ssh_keys IS NULL \
         WHERE v.uuid = $1 ORDER BY k.created_at, k.name"
    )
    .bind(uuid.to_string())
    .fetch_all(c)
    .await)?;
    let first = rows.first().ok_or(StoreError::NotFound("vm"))?;
    let metadata = serde_json::from_str(&first.0).map_err(corrupt)?;
    let keys = match &first.1 {
        Some(given) => serde_json::from_str::<Vec<GivenKey>>(given)
            .map_err(corrupt)?
            .into_iter()
            .map(|k| k.key)
            .collect(),
        None => rows.into_iter().filter_map(|(_, _, k)| k).collect(),
    };
    Ok(GuestInputs { metadata, keys })
}

/// A VM that will not run (its provision unwound) gives its addresses back, and its row
/// stops showing them.
pub async fn release_addresses(db: &Db, uuid: VmId) -> StoreResult<()> {
    in_tx!(db, |tx| {
        sqlx::query("DELETE FROM network_ips WHERE vm_uuid = $1")
            .bind(uuid.to_string())
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE vms SET nics = '[]' WHERE uuid = $1")
            .bind(uuid.to_string())
            .execute(&mut *tx)
            .await?;
        Ok(())
    })
}

/// Which of a VM's label columns a change is to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Labels {
    Tags,
    Metadata,
}

impl Labels {
    fn column(self) -> &'static str {
        match self {
            Labels::Tags => "tags",
            Labels::Metadata => "metadata",
        }
    }
}

/// The keys a VM was given, with the keys themselves (`None`: a VM made before keys could
/// be chosen).
pub async fn given_keys(db: &Db, uuid: VmId) -> StoreResult<Option<Vec<GivenKey>>> {
    let row: Option<(Option<String>,)> = on_read!(db, |p| sqlx::query_as(
        "SELECT ssh_keys FROM vms WHERE uuid = $1"
    )
    .bind(uuid.to_string())
    .fetch_optional(p)
    .await)?;
    let (text,) = row.ok_or(StoreError::NotFound("vm"))?;
    text.map(|t| serde_json::from_str(&t).map_err(corrupt))
        .transpose()
}

/// Writes `new` (JSON) as a VM's tags or metadata if they still read `old`, so that two
/// changes made at once never lose one; false when another change came first (or the VM
/// is gone), and the caller reads again.
pub async fn swap_labels(
    db: &Db,
    uuid: VmId,
    which: Labels,
    old: &str,
    new: &str,
) -> StoreResult<bool> {
    let col = which.column();
    let n = on_write!(db, |p| sqlx::query(&format!(
        "UPDATE vms SET {col} = $3 WHERE uuid = $1 AND {col} = $2"
    ))
    .bind(uuid.to_string())
    .bind(old)
    .bind(new)
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(n == 1)
}

/// A VM's tags or metadata as stored (JSON text), and its owner.
pub async fn labels(
    db: &Db,
    uuid: VmId,
    which: Labels,
) -> StoreResult<(AccountId, VmState, String)> {
    let col = which.column();
    let row: Option<(String, String, String)> = on_read!(db, |p| sqlx::query_as(&format!(
        "SELECT owner_uuid, state, {col} FROM vms WHERE uuid = $1"
    ))
    .bind(uuid.to_string())
    .fetch_optional(p)
    .await)?;
    let (owner, state, text) = row.ok_or(StoreError::NotFound("vm"))?;
    Ok((
        parse_uuid(&owner, "account")?,
        VmState::parse(&state).ok_or_else(|| corrupt(&state))?,
        text,
    ))
}
