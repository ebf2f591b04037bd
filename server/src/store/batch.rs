//! Many VM creations in one transaction: what a burst of concurrent `POST /v1/vms` costs
//! the database. Each creation keeps its own outcome (created, lost a device, no room, over
//! quota), exactly as if it had run alone in the order given; only the statements are
//! shared: a few multi-row statements for the whole batch instead of about ten per VM.
//! On SQLite, where every statement is a round trip to the one writer's thread, that
//! round trip is what limited creations per second.

use super::page::Arg;
use super::room::{Allocation, Room};
use super::vms::NewVm;
use super::{Db, StoreError, StoreResult, now_ms, parse_uuid, to_time};
use crate::{bind_args, in_tx};
use passage_model::api::{Vm, VmState};
use passage_model::{AccountId, DeviceState, ServerId, VmId};
use std::collections::{BTreeMap, HashMap, HashSet};

/// What one creation of a batch needs from the checks, decided in order.
fn decide(
    vms: &[NewVm<'_>],
    mut rooms: HashMap<ServerId, Room>,
    mut quotas: HashMap<AccountId, (Option<i64>, i64)>,
    free: &HashMap<(String, String), Option<String>>,
) -> Vec<Result<(), StoreError>> {
    let mut taken: HashSet<(String, String)> = HashSet::new();
    vms.iter()
        .map(|vm| {
            let mem = i64::try_from(vm.memory_mib).unwrap_or(i64::MAX);
            if let Some(server) = vm.server
                && let Some(r) = rooms.get(&server)
            {
                let after = Room {
                    vcpus_used: r.vcpus_used.saturating_add(i64::from(vm.vcpus)),
                    memory_used_mib: r.memory_used_mib.saturating_add(mem),
                    ..*r
                };
                if after.vcpus_free() < 0 || after.memory_free_mib() < 0 {
                    return Err(StoreError::NoRoom(format!(
                        "server {server} has {} of {} vCPUs and {} of {} MiB of memory \
                         allocated with this VM",
                        after.vcpus_used,
                        after.vcpus_total,
                        after.memory_used_mib,
                        after.memory_total_mib
                    )));
                }
            }
            let n = vm.devices.len() as i64;
            if n > 0 {
                let (quota, held) = quotas.get(&vm.owner).copied().unwrap_or((None, 0));
                if quota.is_some_and(|q| held + n > q) {
                    return Err(StoreError::Quota(format!(
                        "GPU quota of {} device(s) would be exceeded by {n} more",
                        quota.unwrap_or(0)
                    )));
                }
                let server = vm.server.map(|s| s.to_string()).unwrap_or_default();
                let keys: Vec<(String, String)> = vm
                    .devices
                    .iter()
                    .map(|d| (server.clone(), d.to_string()))
                    .collect();
                if keys
                    .iter()
                    .any(|k| !free.contains_key(k) || taken.contains(k))
                {
                    return Err(StoreError::Retry);
                }
                taken.extend(keys);
                quotas.insert(vm.owner, (quota, held + n));
            }
            if let Some(server) = vm.server
                && let Some(r) = rooms.get_mut(&server)
            {
                r.vcpus_used = r.vcpus_used.saturating_add(i64::from(vm.vcpus));
                r.memory_used_mib = r.memory_used_mib.saturating_add(mem);
            }
            Ok(())
        })
        .collect()
}

/// The view of a VM just written, without reading it back.
fn view(vm: &NewVm<'_>, now: i64) -> Vm {
    Vm {
        uuid: vm.uuid,
        alias: vm.alias.to_string(),
        owner_uuid: vm.owner,
        server_uuid: vm.server,
        package_uuid: vm.package,
        state: VmState::Provisioning,
        vcpus: vm.vcpus,
        memory_mib: vm.memory_mib,
        assigned_devices: vm.devices.to_vec(),
        job_uuid: Some(vm.job),
        created_at: to_time(now),
    }
}

/// The values of one or more SQLite statements and their placeholders, each used once, in
/// the order of the text: anonymous `?`s, which SQLite binds in order across the
/// statements of one call without looking each name up. (Postgres takes arrays instead:
/// `PG_CHECK`, `PG_WRITE`.)
#[derive(Default)]
struct Sql {
    args: Vec<Arg>,
}

impl Sql {
    /// Records a value; answers its placeholder, to be used once, after those before it.
    fn arg(&mut self, a: Arg) -> String {
        self.args.push(a);
        "?".to_string()
    }

    fn text(&mut self, s: impl std::fmt::Display) -> String {
        self.arg(Arg::Text(s.to_string()))
    }

    fn list<T: std::fmt::Display>(&mut self, items: &[T]) -> String {
        items
            .iter()
            .map(|i| self.text(i))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// One query for every check of a batch: each server's room, each owner's quota and each
/// free device on the batch's servers (with its variant), as rows
/// `(kind, key, id, variant, n1, n2, n3, n4)`.
fn check_query(mut q: Sql, servers: &[ServerId], owners: &[AccountId]) -> (String, Vec<Arg>) {
    let mut parts = Vec::new();
    if !servers.is_empty() {
        let list = q.list(servers);
        parts.push(format!(
            "SELECT 'room' AS kind, s.uuid AS k, CAST(NULL AS TEXT) AS id, \
             CAST(NULL AS TEXT) AS variant, s.cpus AS n1, \
             s.memory_mib AS n2, CAST(COALESCE(SUM(v.vcpus), 0) AS BIGINT) AS n3, \
             CAST(COALESCE(SUM(v.memory_mib), 0) AS BIGINT) AS n4 \
             FROM servers s LEFT JOIN vms v ON v.server_uuid = s.uuid \
             AND v.state NOT IN ('destroyed', 'failed') WHERE s.uuid IN ({list}) \
             AND s.cpus IS NOT NULL AND s.memory_mib IS NOT NULL \
             GROUP BY s.uuid, s.cpus, s.memory_mib"
        ));
    }
    if !owners.is_empty() {
        let list = q.list(owners);
        parts.push(format!(
            "SELECT 'quota', uuid, NULL, NULL, gpu_quota, gpu_held, NULL, NULL FROM accounts \
             WHERE uuid IN ({list})"
        ));
        let list = q.list(servers);
        parts.push(format!(
            "SELECT 'free', server_uuid, id, variant, NULL, NULL, NULL, NULL FROM devices \
             WHERE server_uuid IN ({list}) AND state = 'unassigned' AND missing = 0 \
             AND taint IS NULL"
        ));
    }
    (parts.join(" UNION ALL "), q.args)
}

type CheckRow = (
    String,
    String,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
);

/// What the checks found.
#[derive(Default)]
struct Found {
    rooms: HashMap<ServerId, Room>,
    quotas: HashMap<AccountId, (Option<i64>, i64)>,
    /// Free devices by (server, id), with their variant.
    free: HashMap<(String, String), Option<String>>,
}

impl Found {
    fn read(rows: Vec<CheckRow>, alloc: Allocation) -> StoreResult<Found> {
        let mut f = Found::default();
        for (kind, key, id, variant, n1, n2, n3, n4) in rows {
            match kind.as_str() {
                "room" => {
                    f.rooms.insert(
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
                    f.quotas
                        .insert(parse_uuid(&key, "account")?, (n1, n2.unwrap_or(0)));
                }
                _ => {
                    f.free.insert((key, id.unwrap_or_default()), variant);
                }
            }
        }
        Ok(f)
    }
}

/// The writes for the creations that passed every check, with their values in `q`: the
/// VM rows, their jobs and steps, the owners' quotas, the reservation of the devices
/// (without its `RETURNING`), their history and the free-device index.
struct Writes {
    vms: String,
    jobs: String,
    steps: Option<String>,
    quotas: Option<String>,
    reserve: Option<String>,
    events: Option<String>,
    /// The free-device index, less what the batch takes.
    free: Option<String>,
    /// Owners charged (rows the quota update must change).
    owners: usize,
    devices: usize,
}

/// What a batch's winners change besides their own rows, derived once for either backend.
struct Rows {
    /// Devices charged to each owner's quota.
    held: Vec<(AccountId, i64)>,
    /// Each device reserved: its server, its id and the VM it goes to.
    devs: Vec<(ServerId, String, VmId)>,
    /// The free-device index, less what was taken, by (server, variant): exact, as the
    /// devices were read free under the same lock; any drift heals at the server's next
    /// device change, which recounts.
    taken: BTreeMap<(String, String), i64>,
}

impl Rows {
    fn of(
        won: &[&NewVm<'_>],
        free: &HashMap<(String, String), Option<String>>,
    ) -> StoreResult<Rows> {
        let mut held: Vec<(AccountId, i64)> = Vec::new();
        let mut devs: Vec<(ServerId, String, VmId)> = Vec::new();
        for vm in won.iter().filter(|v| !v.devices.is_empty()) {
            let Some(server) = vm.server else {
                return Err(StoreError::Corrupt("devices without a server".into()));
            };
            match held.iter_mut().find(|(o, _)| *o == vm.owner) {
                Some((_, n)) => *n += vm.devices.len() as i64,
                None => held.push((vm.owner, vm.devices.len() as i64)),
            }
            devs.extend(vm.devices.iter().map(|d| (server, d.to_string(), vm.uuid)));
        }
        let mut taken: BTreeMap<(String, String), i64> = BTreeMap::new();
        for (server, id, _) in &devs {
            if let Some(Some(variant)) = free.get(&(server.to_string(), id.clone())) {
                *taken
                    .entry((server.to_string(), variant.clone()))
                    .or_default() += 1;
            }
        }
        Ok(Rows { held, devs, taken })
    }
}

fn writes(
    q: &mut Sql,
    won: &[&NewVm<'_>],
    free: &HashMap<(String, String), Option<String>>,
    now: i64,
) -> StoreResult<Writes> {
    let mut rows = Vec::with_capacity(won.len());
    for vm in won {
        let ids: Vec<String> = vm.devices.iter().map(|d| d.to_string()).collect();
        let vals = [
            Arg::Text(vm.uuid.to_string()),
            Arg::Text(vm.alias.to_string()),
            Arg::Text(vm.owner.to_string()),
            vm.server.map_or(Arg::Null, |s| Arg::Text(s.to_string())),
            vm.package.map_or(Arg::Null, |p| Arg::Text(p.to_string())),
            Arg::Int(i64::from(vm.vcpus)),
            Arg::Int(i64::try_from(vm.memory_mib).unwrap_or(i64::MAX)),
            Arg::Text(serde_json::to_string(&ids).map_err(super::corrupt)?),
            Arg::Text(vm.job.to_string()),
            Arg::Int(now),
            Arg::Int(now),
        ]
        .map(|a| q.arg(a));
        let [
            uuid,
            alias,
            owner,
            server,
            package,
            vcpus,
            mem,
            devs,
            job,
            at,
            at2,
        ] = vals;
        rows.push(format!(
            "({uuid}, {alias}, {owner}, {server}, {package}, 'provisioning', {vcpus}, {mem}, \
             {devs}, {job}, {at}, {at2})"
        ));
    }
    let vms = format!(
        "INSERT INTO vms (uuid, alias, owner_uuid, server_uuid, package_uuid, state, vcpus, \
         memory_mib, assigned_devices, job_uuid, created_at, updated_at) VALUES {}",
        rows.join(", ")
    );
    let rows: Vec<String> = won
        .iter()
        .map(|vm| {
            let (job, uuid, owner) = (q.text(vm.job), q.text(vm.uuid), q.text(vm.owner));
            let at = q.arg(Arg::Int(now));
            format!("({job}, 'provision', {uuid}, {owner}, NULL, 'queued', {at})")
        })
        .collect();
    let jobs = format!(
        "INSERT INTO jobs (uuid, name, vm_uuid, owner_uuid, payload, state, created_at) \
         VALUES {}",
        rows.join(", ")
    );
    let mut rows = Vec::new();
    for vm in won {
        for (idx, step) in vm.job_steps.iter().enumerate() {
            let (job, i, name) = (q.text(vm.job), q.arg(Arg::Int(idx as i64)), q.text(step));
            rows.push(format!("({job}, {i}, {name}, 'pending')"));
        }
    }
    let steps = (!rows.is_empty()).then(|| {
        format!(
            "INSERT INTO job_steps (job_uuid, idx, name, state) VALUES {}",
            rows.join(", ")
        )
    });

    let Rows { held, devs, taken } = Rows::of(won, free)?;
    let mut w = Writes {
        vms,
        jobs,
        steps,
        quotas: None,
        reserve: None,
        events: None,
        free: None,
        owners: held.len(),
        devices: devs.len(),
    };
    if devs.is_empty() {
        return Ok(w);
    }
    let rows: Vec<String> = held
        .iter()
        .map(|(o, n)| {
            let (o, n) = (q.text(o), q.arg(Arg::Int(*n)));
            format!("({o}, {n})")
        })
        .collect();
    w.quotas = Some(format!(
        "UPDATE accounts SET gpu_held = gpu_held + v.column2 FROM (VALUES {}) AS v \
         WHERE accounts.uuid = v.column1 \
         AND (accounts.gpu_quota IS NULL OR accounts.gpu_held + v.column2 <= accounts.gpu_quota)",
        rows.join(", ")
    ));
    // The states are the machine's own: `Reserve` takes `unassigned` to `provisioning`.
    let (from, to) = (DeviceState::Unassigned, DeviceState::Provisioning);
    let at = q.arg(Arg::Int(now));
    let keys: Vec<String> = devs
        .iter()
        .map(|(server, id, vm)| {
            let (s, i, v) = (q.text(server), q.text(id), q.text(vm));
            format!("({s}, {i}, {v}, '{}', 0)", from.as_str())
        })
        .collect();
    // The state and `missing` a device must still have are join keys, not filters: as
    // filters, Postgres estimates (before its first ANALYZE of a fresh fleet) that almost
    // no device passes them and scans the list once per device, 370 ms for 63 creations.
    w.reserve = Some(format!(
        "UPDATE devices SET state = '{}', used_by = v.column3, generation = generation + 1, \
         updated_at = {at} FROM (VALUES {}) AS v WHERE devices.server_uuid = v.column1 \
         AND devices.id = v.column2 AND devices.state = v.column4 \
         AND devices.missing = v.column5 AND devices.taint IS NULL",
        to.as_str(),
        keys.join(", ")
    ));
    let events: Vec<String> = devs
        .iter()
        .map(|(server, id, vm)| {
            let (s, i) = (q.text(server), q.text(id));
            let (why, at) = (
                q.text(format!("reserved for VM {vm}")),
                q.arg(Arg::Int(now)),
            );
            format!(
                "({s}, {i}, '{}', '{}', {why}, {at})",
                from.as_str(),
                to.as_str()
            )
        })
        .collect();
    w.events = Some(format!(
        "INSERT INTO device_events (server_uuid, device, from_state, to_state, reason, at) \
         VALUES {}",
        events.join(", ")
    ));
    if !taken.is_empty() {
        let rows: Vec<String> = taken
            .iter()
            .map(|((server, variant), n)| {
                let (s, v, n) = (q.text(server), q.text(variant), q.arg(Arg::Int(*n)));
                format!("({s}, {v}, {n})")
            })
            .collect();
        w.free = Some(format!(
            "UPDATE free_devices SET free = free - v.column3 FROM (VALUES {}) AS v \
             WHERE free_devices.server_uuid = v.column1 AND free_devices.variant = v.column2",
            rows.join(", ")
        ));
    }
    Ok(w)
}

/// The batch inside one transaction, on either backend.
trait BatchTx {
    fn create_many(
        &mut self,
        vms: &[NewVm<'_>],
        alloc: Allocation,
    ) -> impl Future<Output = StoreResult<Vec<StoreResult<Vm>>>> + Send;
}

impl BatchTx for sqlx::Transaction<'_, sqlx::Sqlite> {
    async fn create_many(
        &mut self,
        vms: &[NewVm<'_>],
        alloc: Allocation,
    ) -> StoreResult<Vec<StoreResult<Vm>>> {
        // The one writer connection is lock enough; every statement is a round trip to
        // its thread, so the checks are one query and the writes one call.
        let (servers, owners) = keys(vms);
        let (sql, args) = check_query(Sql::default(), &servers, &owners);
        let rows: Vec<CheckRow> = if sql.is_empty() {
            Vec::new()
        } else {
            bind_args!(sqlx::query_as(&sql), &args)
                .fetch_all(&mut **self)
                .await?
        };
        let found = Found::read(rows, alloc)?;
        let verdicts = decide(vms, found.rooms, found.quotas, &found.free);
        let won = winners(vms, &verdicts);
        let now = now_ms();
        if !won.is_empty() {
            let mut q = Sql::default();
            let w = writes(&mut q, &won, &found.free, now)?;
            let mut all = vec![w.vms, w.jobs];
            all.extend(w.steps);
            // The statements answering rows, one per owner charged and one per device
            // reserved, which must be all of them.
            all.extend(w.quotas.map(|a| format!("{a} RETURNING 0")));
            all.extend(w.reserve.map(|r| format!("{r} RETURNING 1")));
            all.extend(w.events);
            all.extend(w.free);
            let sql = all.join(";\n");
            let rows: Vec<(i64,)> = bind_args!(sqlx::query_as(&sql), &q.args)
                .fetch_all(&mut **self)
                .await?;
            let reserved = rows.iter().filter(|(k,)| *k == 1).count();
            if reserved != w.devices || rows.len() - reserved != w.owners {
                // Checked under the writer's lock just before: only a bug gets here.
                return Err(StoreError::Retry);
            }
        }
        Ok(answers(vms, verdicts, now))
    }
}

impl BatchTx for sqlx::Transaction<'_, sqlx::Postgres> {
    async fn create_many(
        &mut self,
        vms: &[NewVm<'_>],
        alloc: Allocation,
    ) -> StoreResult<Vec<StoreResult<Vm>>> {
        let (servers, owners) = keys(vms);
        let servers: Vec<String> = servers.iter().map(ToString::to_string).collect();
        let owners: Vec<String> = owners.iter().map(ToString::to_string).collect();
        // Every statement here takes arrays, so its text is the same for any batch: it is
        // parsed and planned once per connection, not once per batch size, and binds a
        // few arrays instead of thousands of values.
        //
        // The servers' rows are locked first (in key order, as a single creation locks
        // its server): their vCPUs and memory are summed from VM rows, which no
        // conditional write can guard. Devices and quotas need no lock: their writes
        // below are conditional, and a count short of the plan undoes the whole batch.
        // The check reads after the lock, in a statement of its own, so that it sees
        // what a creation that held the lock before has committed.
        if !servers.is_empty() {
            let _: Vec<(i32,)> = sqlx::query_as(
                "SELECT 1 FROM servers WHERE uuid = ANY($1::text[]) ORDER BY uuid \
                 FOR NO KEY UPDATE",
            )
            .bind(&servers)
            .fetch_all(&mut **self)
            .await?;
        }
        let rows: Vec<CheckRow> = sqlx::query_as(PG_CHECK)
            .bind(&servers)
            .bind(&owners)
            .fetch_all(&mut **self)
            .await?;
        let found = Found::read(rows, alloc)?;
        let verdicts = decide(vms, found.rooms, found.quotas, &found.free);
        let won = winners(vms, &verdicts);
        let now = now_ms();
        if !won.is_empty() {
            let r = Rows::of(&won, &found.free)?;
            let (reserved, charges): (i64, i64) =
                pg_write(&won, &r, now)?.fetch_one(&mut **self).await?;
            if charges != r.held.len() as i64 {
                // A quota changed since the check (another replica's creation).
                return Err(StoreError::Retry);
            }
            if reserved != r.devs.len() as i64 {
                return Err(StoreError::Retry);
            }
        }
        Ok(answers(vms, verdicts, now))
    }
}

/// The checks of a batch on Postgres, as `check_query` builds them for SQLite: `$1` the
/// servers, `$2` the owners reserving devices.
const PG_CHECK: &str = "SELECT 'room' AS kind, s.uuid AS k, CAST(NULL AS TEXT) AS id, \
     CAST(NULL AS TEXT) AS variant, s.cpus AS n1, s.memory_mib AS n2, \
     CAST(COALESCE(SUM(v.vcpus), 0) AS BIGINT) AS n3, \
     CAST(COALESCE(SUM(v.memory_mib), 0) AS BIGINT) AS n4 \
     FROM servers s LEFT JOIN vms v ON v.server_uuid = s.uuid \
     AND v.state NOT IN ('destroyed', 'failed') WHERE s.uuid = ANY($1::text[]) \
     AND s.cpus IS NOT NULL AND s.memory_mib IS NOT NULL \
     GROUP BY s.uuid, s.cpus, s.memory_mib \
     UNION ALL SELECT 'quota', uuid, NULL, NULL, gpu_quota, gpu_held, NULL, NULL \
     FROM accounts WHERE uuid = ANY($2::text[]) \
     UNION ALL SELECT 'free', server_uuid, id, variant, NULL, NULL, NULL, NULL FROM devices \
     WHERE server_uuid = ANY($1::text[]) AND state = 'unassigned' AND missing = 0 \
     AND taint IS NULL";

/// Every write of a batch on Postgres as one statement: data-modifying CTEs all run,
/// whether read or not. It answers the devices reserved and the owners charged. A
/// device's required state and presence are join keys, not filters: as filters, Postgres
/// estimates (before its first ANALYZE of a fresh fleet) that almost no device passes them
/// and scans the list once per device (370 ms for 63 creations).
const PG_WRITE: &str = "WITH \
     v AS (INSERT INTO vms (uuid, alias, owner_uuid, server_uuid, package_uuid, state, \
       vcpus, memory_mib, assigned_devices, job_uuid, created_at, updated_at) \
       SELECT x.u, x.a, x.o, x.s, x.p, 'provisioning', x.c, x.m, x.d, x.j, $1, $1 \
       FROM UNNEST($2::text[], $3::text[], $4::text[], $5::text[], $6::text[], \
       $7::int8[], $8::int8[], $9::text[], $10::text[]) AS x(u, a, o, s, p, c, m, d, j) \
       RETURNING 1), \
     j AS (INSERT INTO jobs (uuid, name, vm_uuid, owner_uuid, payload, state, created_at) \
       SELECT x.j, 'provision', x.u, x.o, NULL, 'queued', $1 \
       FROM UNNEST($10::text[], $2::text[], $4::text[]) AS x(j, u, o) RETURNING 1), \
     st AS (INSERT INTO job_steps (job_uuid, idx, name, state) \
       SELECT x.j, x.i, x.n, 'pending' FROM UNNEST($11::text[], $12::int8[], $13::text[]) \
       AS x(j, i, n) RETURNING 1), \
     a AS (UPDATE accounts SET gpu_held = accounts.gpu_held + x.n \
       FROM UNNEST($14::text[], $15::int8[]) AS x(o, n) WHERE accounts.uuid = x.o \
       AND (accounts.gpu_quota IS NULL OR accounts.gpu_held + x.n <= accounts.gpu_quota) \
       RETURNING 1), \
     e AS (INSERT INTO device_events (server_uuid, device, from_state, to_state, reason, at) \
       SELECT x.s, x.i, x.f, $25, x.r, $1 \
       FROM UNNEST($16::text[], $17::text[], $19::text[], $20::text[]) AS x(s, i, f, r) \
       RETURNING 1), \
     f AS (UPDATE free_devices SET free = free_devices.free - x.n \
       FROM UNNEST($22::text[], $23::text[], $24::int8[]) AS x(s, v, n) \
       WHERE free_devices.server_uuid = x.s AND free_devices.variant = x.v RETURNING 1), \
     d AS (UPDATE devices SET state = $25, used_by = x.vm, \
       generation = devices.generation + 1, updated_at = $1 \
       FROM UNNEST($16::text[], $17::text[], $18::text[], $19::text[], $21::int8[]) \
       AS x(s, i, vm, st, mi) WHERE devices.server_uuid = x.s AND devices.id = x.i \
       AND devices.state = x.st AND devices.missing = x.mi AND devices.taint IS NULL \
       RETURNING 1) \
     SELECT (SELECT COUNT(*) FROM d), (SELECT COUNT(*) FROM a)";

type PgQuery<'q> =
    sqlx::query::QueryAs<'q, sqlx::Postgres, (i64, i64), sqlx::postgres::PgArguments>;

/// `PG_WRITE` with the winners' arrays bound.
fn pg_write<'q>(won: &[&NewVm<'_>], r: &Rows, now: i64) -> StoreResult<PgQuery<'q>> {
    let text =
        |f: &dyn Fn(&NewVm<'_>) -> String| -> Vec<String> { won.iter().map(|v| f(v)).collect() };
    let mut devices_json = Vec::with_capacity(won.len());
    for vm in won {
        let ids: Vec<String> = vm.devices.iter().map(ToString::to_string).collect();
        devices_json.push(serde_json::to_string(&ids).map_err(super::corrupt)?);
    }
    let mut steps: (Vec<String>, Vec<i64>, Vec<String>) = Default::default();
    for vm in won {
        for (i, name) in vm.job_steps.iter().enumerate() {
            steps.0.push(vm.job.to_string());
            steps.1.push(i as i64);
            steps.2.push((*name).to_string());
        }
    }
    // The states are the machine's own: `Reserve` takes `unassigned` to `provisioning`.
    let (from, to) = (DeviceState::Unassigned, DeviceState::Provisioning);
    let n = r.devs.len();
    Ok(sqlx::query_as(PG_WRITE)
        .bind(now)
        .bind(text(&|v| v.uuid.to_string()))
        .bind(text(&|v| v.alias.to_string()))
        .bind(text(&|v| v.owner.to_string()))
        .bind(
            won.iter()
                .map(|v| v.server.map(|s| s.to_string()))
                .collect::<Vec<_>>(),
        )
        .bind(
            won.iter()
                .map(|v| v.package.map(|p| p.to_string()))
                .collect::<Vec<_>>(),
        )
        .bind(won.iter().map(|v| i64::from(v.vcpus)).collect::<Vec<_>>())
        .bind(
            won.iter()
                .map(|v| i64::try_from(v.memory_mib).unwrap_or(i64::MAX))
                .collect::<Vec<_>>(),
        )
        .bind(devices_json)
        .bind(text(&|v| v.job.to_string()))
        .bind(steps.0)
        .bind(steps.1)
        .bind(steps.2)
        .bind(
            r.held
                .iter()
                .map(|(o, _)| o.to_string())
                .collect::<Vec<_>>(),
        )
        .bind(r.held.iter().map(|(_, n)| *n).collect::<Vec<_>>())
        .bind(
            r.devs
                .iter()
                .map(|(s, _, _)| s.to_string())
                .collect::<Vec<_>>(),
        )
        .bind(r.devs.iter().map(|(_, i, _)| i.clone()).collect::<Vec<_>>())
        .bind(
            r.devs
                .iter()
                .map(|(_, _, v)| v.to_string())
                .collect::<Vec<_>>(),
        )
        .bind(vec![from.as_str().to_string(); n])
        .bind(
            r.devs
                .iter()
                .map(|(_, _, v)| format!("reserved for VM {v}"))
                .collect::<Vec<_>>(),
        )
        .bind(vec![0_i64; n])
        .bind(r.taken.keys().map(|(s, _)| s.clone()).collect::<Vec<_>>())
        .bind(r.taken.keys().map(|(_, v)| v.clone()).collect::<Vec<_>>())
        .bind(r.taken.values().copied().collect::<Vec<_>>())
        .bind(to.as_str()))
}

/// The servers and owners (those reserving devices) of a batch, each once, in key order.
fn keys(vms: &[NewVm<'_>]) -> (Vec<ServerId>, Vec<AccountId>) {
    let mut servers: Vec<ServerId> = vms.iter().filter_map(|v| v.server).collect();
    servers.sort();
    servers.dedup();
    let mut owners: Vec<AccountId> = vms
        .iter()
        .filter(|v| !v.devices.is_empty())
        .map(|v| v.owner)
        .collect();
    owners.sort();
    owners.dedup();
    (servers, owners)
}

fn winners<'a, 'b>(
    vms: &'a [NewVm<'b>],
    verdicts: &[Result<(), StoreError>],
) -> Vec<&'a NewVm<'b>> {
    vms.iter()
        .zip(verdicts)
        .filter(|(_, v)| v.is_ok())
        .map(|(vm, _)| vm)
        .collect()
}

fn answers(
    vms: &[NewVm<'_>],
    verdicts: Vec<Result<(), StoreError>>,
    now: i64,
) -> Vec<StoreResult<Vm>> {
    vms.iter()
        .zip(verdicts)
        .map(|(vm, v)| v.map(|()| view(vm, now)))
        .collect()
}

/// Creates every VM of `vms` that can be created, each with its devices reserved, its
/// owner's quota charged and its provision job (steps `job_steps`) written, all in one
/// transaction. Each gets its own answer, as `vms::create_reserved` would have given it
/// run alone in this order: `Retry` for a device no longer free (or listed by an
/// earlier VM of the batch), `NoRoom`, `Quota`. An `Err` of the whole call means nothing
/// was written.
pub async fn create_many(
    db: &Db,
    vms: &[NewVm<'_>],
    alloc: Allocation,
) -> StoreResult<Vec<StoreResult<Vm>>> {
    if vms.is_empty() {
        return Ok(Vec::new());
    }
    in_tx!(db, |tx| tx.create_many(vms, alloc).await)
}

#[cfg(test)]
mod tests {
    use super::*;
    use passage_model::{DevicePath, JobId, PackageId, VmId};

    fn path(bus: u8) -> DevicePath {
        format!("/devices/pci0000:00/0000:00:01.0/0000:{bus:02x}:00.0")
            .parse()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn new_vm(owner: AccountId, server: ServerId, devices: &[DevicePath], vcpus: u32) -> NewVm<'_> {
        NewVm {
            uuid: VmId::new_random(),
            alias: "x",
            owner,
            package: Some(PackageId(uuid::Uuid::from_u128(5))),
            vcpus,
            memory_mib: 1024,
            server: Some(server),
            devices,
            job: JobId::new_random(),
            job_steps: &[],
            alloc: Allocation::default(),
        }
    }

    #[test]
    fn each_creation_is_decided_as_if_alone_in_order() {
        let server = ServerId(uuid::Uuid::from_u128(1));
        let (a, b) = (
            AccountId(uuid::Uuid::from_u128(10)),
            AccountId(uuid::Uuid::from_u128(11)),
        );
        let (d1, d2, d3) = ([path(1)], [path(2)], [path(3)]);
        let vms = [
            new_vm(a, server, &d1, 4),
            new_vm(b, server, &d1, 4), // the device went to the first
            new_vm(a, server, &d2, 4), // a's quota of 1 is spent
            new_vm(b, server, &d2, 9), // 9 more vCPUs: 16 total, 8 taken
            new_vm(b, server, &d3, 4),
        ];
        let rooms = HashMap::from([(
            server,
            Room {
                vcpus_total: 16,
                vcpus_used: 4,
                memory_total_mib: 1 << 20,
                memory_used_mib: 0,
            },
        )]);
        let quotas = HashMap::from([(a, (Some(1), 0)), (b, (None, 3))]);
        let free: HashMap<(String, String), Option<String>> = [path(1), path(2), path(3)]
            .iter()
            .map(|p| ((server.to_string(), p.to_string()), Some("A".to_string())))
            .collect();
        let v = decide(&vms, rooms, quotas, &free);
        assert!(v[0].is_ok());
        assert!(matches!(v[1], Err(StoreError::Retry)), "{:?}", v[1]);
        assert!(matches!(v[2], Err(StoreError::Quota(_))), "{:?}", v[2]);
        assert!(matches!(v[3], Err(StoreError::NoRoom(_))), "{:?}", v[3]);
        assert!(v[4].is_ok(), "{:?}", v[4]);
    }
}
