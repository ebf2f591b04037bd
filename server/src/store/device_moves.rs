//! Device state changes in sets (`DeviceTx::move_many`): any number of requests, each
//! some devices of one server and an event, in a few statements whatever their count:
//! one read of the devices, one conditional update, one insert of their events, one
//! quota release and one change of the free-device index. The state machine still
//! decides each device's move (`passage_model::state::transition`), and `generation`
//! still makes it stick: a device written by someone else since the read is a lost race.
//! Moving device by device took four statements per device and a transaction per caller;
//! the fleet's four moves per VM were then the largest group of the one SQLite writer's
//! statements.

use super::page::{Arg, value_rows};
use super::{StoreError, StoreResult, corrupt};
use passage_model::state::transition;
use passage_model::{DeviceEvent, DeviceState, JobId, ServerId, VmId};
use std::collections::{BTreeMap, HashMap, HashSet};

/// One request of a set of moves: `event` for each of `ids` on `server` that can take it.
#[derive(Clone, Debug)]
pub struct MoveReq {
    pub server: ServerId,
    pub ids: Vec<String>,
    pub event: DeviceEvent,
    /// With `vm`, a held device moves only if `vm` holds it.
    pub vm: Option<VmId>,
    pub reason: String,
    /// A scrub's job, for `ScrubStart`: recorded on each device moved to `cleaning`; a
    /// device this job moved to `cleaning` before and that is `cleaning` still is answered
    /// as moved (`cleaning` to `cleaning`, nothing written): its scrub is to run again.
    pub job: Option<JobId>,
    /// What the devices show as their `state_reason` after the move; `None` clears it,
    /// except on a move to `quarantined`, which shows `reason`.
    pub note: Option<String>,
}

impl MoveReq {
    pub fn new(
        server: ServerId,
        ids: &[String],
        event: DeviceEvent,
        vm: Option<VmId>,
        reason: &str,
    ) -> Self {
        MoveReq {
            server,
            ids: ids.to_vec(),
            event,
            vm,
            reason: reason.to_string(),
            job: None,
            note: None,
        }
    }

    /// This request with `note` as the moved devices' `state_reason`.
    pub fn with_note(mut self, note: Option<String>) -> Self {
        self.note = note;
        self
    }

    /// The start of `job`'s scrub of those of `ids` that are dirty (and of those it left
    /// `cleaning` before).
    pub fn scrub_start(server: ServerId, ids: &[String], job: Option<JobId>) -> Self {
        MoveReq {
            job,
            ..MoveReq::new(server, ids, DeviceEvent::ScrubStart, None, "scrub started")
        }
    }
}

/// What `move_devices` and `move_many` changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Moved {
    pub id: String,
    pub from: DeviceState,
    pub to: DeviceState,
}

/// Rows per statement at most: seven values each, far below either database's limit.
pub(super) const CHUNK: usize = 500;

/// A device's row as the read found it.
#[derive(sqlx::FromRow)]
pub(super) struct Current {
    server_uuid: String,
    id: String,
    state: String,
    used_by: Option<String>,
    generation: i64,
    scrub_job: Option<String>,
}

/// One device's move, decided.
pub(super) struct Planned {
    req: usize,
    pub(super) server: String,
    pub(super) id: String,
    from: DeviceState,
    to: DeviceState,
    /// `used_by` after the move.
    used_by: Option<String>,
    /// The VM that held it before, when the move frees it (its owner's quota goes down).
    released_from: Option<String>,
    generation: i64,
    job: Option<String>,
    /// Its `state_reason` after the move.
    note: Option<String>,
    /// False for a scrub taken up again: answered, not written.
    pub(super) write: bool,
}

/// Splits the requests' devices, in order, into runs in which no device comes twice: a
/// run is read and written at once, so a device's second move must see its first.
pub(super) fn runs(reqs: &[MoveReq]) -> Vec<Vec<(usize, String, String)>> {
    let mut runs = Vec::new();
    let mut run: Vec<(usize, String, String)> = Vec::new();
    let mut seen: HashSet<(String, String)> = HashSet::new();
    for (i, r) in reqs.iter().enumerate() {
        let server = r.server.to_string();
        for id in &r.ids {
            if !seen.insert((server.clone(), id.clone())) {
                runs.push(std::mem::take(&mut run));
                seen.clear();
                seen.insert((server.clone(), id.clone()));
            }
            run.push((i, server.clone(), id.clone()));
        }
    }
    if !run.is_empty() {
        runs.push(run);
    }
    runs
}

/// The read of a chunk of `(server, id)` keys, with its values.
pub(super) fn read_sql(keys: &[(usize, String, String)]) -> (String, Vec<Arg>) {
    let args = keys
        .iter()
        .flat_map(|(_, s, id)| [Arg::Text(s.clone()), Arg::Text(id.clone())])
        .collect();
    (
        format!(
            "SELECT d.server_uuid, d.id, d.state, d.used_by, d.generation, d.scrub_job \
             FROM (VALUES {}) AS v JOIN devices d \
             ON d.server_uuid = v.column1 AND d.id = v.column2",
            value_rows(1, keys.len(), 2)
        ),
        args,
    )
}

/// Decides each device's move from the rows read: devices missing, not held by the
/// request's VM, or unable to take its event are left out (undo steps are idempotent).
pub(super) fn plan(
    reqs: &[MoveReq],
    run: &[(usize, String, String)],
    current: Vec<Current>,
) -> StoreResult<Vec<Planned>> {
    let mut by_key: HashMap<(String, String), Current> = current
        .into_iter()
        .map(|c| ((c.server_uuid.clone(), c.id.clone()), c))
        .collect();
    let mut planned = Vec::new();
    for (i, server, id) in run {
        let Some(r) = reqs.get(*i) else { continue };
        let Some(c) = by_key.remove(&(server.clone(), id.clone())) else {
            continue;
        };
        let from = DeviceState::parse(&c.state).ok_or_else(|| corrupt(&c.state))?;
        let vm = r.vm.map(|v| v.to_string());
        if from.is_held() && vm.is_some() && c.used_by != vm {
            continue;
        }
        let job = r.job.map(|j| j.to_string());
        if r.event == DeviceEvent::ScrubStart
            && from == DeviceState::Cleaning
            && job.is_some()
            && c.scrub_job == job
        {
            planned.push(Planned {
                req: *i,
                server: server.clone(),
                id: id.clone(),
                from,
                to: from,
                used_by: c.used_by,
                released_from: None,
                generation: c.generation,
                job,
                note: None,
                write: false,
            });
            continue;
        }
        let Ok(to) = transition(from, r.event) else {
            continue;
        };
        if to == from {
            continue;
        }
        let released_from = (from.is_held() && !to.is_held())
            .then(|| c.used_by.clone())
            .flatten();
        // A quarantined device always says why, for the operator who must act on it.
        let note = r
            .note
            .clone()
            .or_else(|| (to == DeviceState::Quarantined).then(|| r.reason.clone()));
        planned.push(Planned {
            req: *i,
            server: server.clone(),
            id: id.clone(),
            from,
            to,
            used_by: if to.is_held() { c.used_by } else { None },
            released_from,
            generation: c.generation,
            job,
            note,
            write: true,
        });
    }
    Ok(planned)
}

/// The conditional update of a chunk of planned writes, with its values (`now` first). It
/// answers what else decides whether each device is placeable, as of the row's lock: the
/// free index then changes by what the move made of it.
pub(super) fn update_sql(now: i64, writes: &[&Planned]) -> (String, Vec<Arg>) {
    let text = |o: &Option<String>| o.clone().map_or(Arg::Null, Arg::Text);
    let mut args = vec![Arg::Int(now)];
    args.extend(writes.iter().flat_map(|p| {
        [
            Arg::Text(p.server.clone()),
            Arg::Text(p.id.clone()),
            Arg::Text(p.to.as_str().to_string()),
            text(&p.used_by),
            Arg::Int(p.generation),
            text(&p.job),
            text(&p.note),
        ]
    }));
    (
        format!(
            "UPDATE devices SET state = v.column3, used_by = v.column4, \
             generation = devices.generation + 1, updated_at = $1, state_reason = v.column7, \
             scrub_job = CASE WHEN v.column3 = 'cleaning' THEN v.column6 \
               ELSE devices.scrub_job END \
             FROM (VALUES {}) AS v \
             WHERE devices.server_uuid = v.column1 AND devices.id = v.column2 \
             AND devices.generation = v.column5 \
             RETURNING server_uuid, id, variant, \
             CAST(CASE WHEN missing = 0 AND taint IS NULL THEN 1 ELSE 0 END AS BIGINT)",
            value_rows(2, writes.len(), 7)
        ),
        args,
    )
}

/// The events of a chunk of planned writes.
pub(super) fn events_sql(reqs: &[MoveReq], now: i64, writes: &[&Planned]) -> (String, Vec<Arg>) {
    let args = writes
        .iter()
        .flat_map(|p| {
            let reason = reqs.get(p.req).map(|r| r.reason.clone());
            [
                Arg::Text(p.server.clone()),
                Arg::Text(p.id.clone()),
                Arg::Text(p.from.as_str().to_string()),
                Arg::Text(p.to.as_str().to_string()),
                Arg::Text(reason.unwrap_or_default()),
                Arg::Int(now),
            ]
        })
        .collect();
    (
        format!(
            "INSERT INTO device_events (server_uuid, device, from_state, to_state, reason, at) \
             VALUES {}",
            value_rows(1, writes.len(), 6)
        ),
        args,
    )
}

/// Gives back to their owners the devices that stopped being held (by VM: how many),
/// never below zero. The VMs' owners are looked up here, as a release by one device at a
/// time did.
pub(super) fn release_sql(released: &[(String, i64)]) -> (String, Vec<Arg>) {
    let args = released
        .iter()
        .flat_map(|(vm, n)| [Arg::Text(vm.clone()), Arg::Int(*n)])
        .collect();
    (
        format!(
            "UPDATE accounts SET gpu_held = CASE WHEN gpu_held > r.n THEN gpu_held - r.n \
             ELSE 0 END \
             FROM (SELECT vms.owner_uuid AS owner, CAST(SUM(x.column2) AS BIGINT) AS n \
               FROM (VALUES {}) AS x JOIN vms ON vms.uuid = x.column1 \
               GROUP BY vms.owner_uuid) AS r \
             WHERE accounts.uuid = r.owner",
            value_rows(1, released.len(), 2)
        ),
        args,
    )
}

/// What the update answered of each device: its variant and whether it is sound (not
/// missing, not tainted), for the free-device index.
pub(super) type Written = HashMap<(String, String), (Option<String>, i64)>;

/// Folds a run's written moves into the change of the free-device index, the quota to
/// give back and each request's answer. Every planned write must have been written: one
/// that was not lost a race (`StoreError::Retry`).
pub(super) fn settle(
    planned: Vec<Planned>,
    written: &Written,
    free_change: &mut super::reserve::free_index::Taken,
    released: &mut BTreeMap<String, i64>,
    answers: &mut [Vec<Moved>],
) -> StoreResult<()> {
    for p in planned {
        if p.write {
            let Some((variant, sound)) = written.get(&(p.server.clone(), p.id.clone())) else {
                return Err(StoreError::Retry);
            };
            if let Some(variant) = variant.as_ref().filter(|_| *sound == 1) {
                let free = |s: DeviceState| i64::from(s == DeviceState::Unassigned);
                *free_change
                    .entry((p.server.clone(), variant.clone()))
                    .or_insert(0) += free(p.to) - free(p.from);
            }
            if let Some(vm) = &p.released_from {
                *released.entry(vm.clone()).or_insert(0) += 1;
            }
        }
        if let Some(a) = answers.get_mut(p.req) {
            a.push(Moved {
                id: p.id,
                from: p.from,
                to: p.to,
            });
        }
    }
    Ok(())
}

/// `DeviceTx::move_many` for one transaction type (SQLite's or Postgres's): the
/// statements above, run by run.
macro_rules! move_many_body {
    ($tx:expr, $reqs:expr) => {{
        use $crate::store::device_moves as dm;
        use $crate::store::reserve::free_index::FreeIndexTx;
        let tx = $tx;
        let reqs: &[dm::MoveReq] = $reqs;
        if reqs
            .iter()
            .any(|r| r.event == passage_model::DeviceEvent::Reserve)
        {
            return Err($crate::store::StoreError::Corrupt(
                "devices are reserved through store::reserve".into(),
            ));
        }
        let now = $crate::store::now_ms();
        let mut answers: Vec<Vec<dm::Moved>> = vec![Vec::new(); reqs.len()];
        let mut free_change = $crate::store::reserve::free_index::Taken::new();
        let mut released = std::collections::BTreeMap::new();
        for run in dm::runs(reqs) {
            let mut current = Vec::new();
            for chunk in run.chunks(dm::CHUNK) {
                let (sql, args) = dm::read_sql(chunk);
                let rows: Vec<dm::Current> = $crate::bind_args!(sqlx::query_as(&sql), &args)
                    .fetch_all(&mut **tx)
                    .await?;
                current.extend(rows);
            }
            let planned = dm::plan(reqs, &run, current)?;
            let writes: Vec<&dm::Planned> = planned.iter().filter(|p| p.write).collect();
            let mut written = dm::Written::new();
            for chunk in writes.chunks(dm::CHUNK) {
                let (sql, args) = dm::update_sql(now, chunk);
                let rows: Vec<(String, String, Option<String>, i64)> =
                    $crate::bind_args!(sqlx::query_as(&sql), &args)
                        .fetch_all(&mut **tx)
                        .await?;
                written.extend(
                    rows.into_iter()
                        .map(|(s, id, v, sound)| ((s, id), (v, sound))),
                );
                let (sql, args) = dm::events_sql(reqs, now, chunk);
                $crate::bind_args!(sqlx::query(&sql), &args)
                    .execute(&mut **tx)
                    .await?;
            }
            dm::settle(
                planned,
                &written,
                &mut free_change,
                &mut released,
                &mut answers,
            )?;
        }
        let released: Vec<(String, i64)> = released.into_iter().collect();
        for chunk in released.chunks(dm::CHUNK) {
            let (sql, args) = dm::release_sql(chunk);
            $crate::bind_args!(sqlx::query(&sql), &args)
                .execute(&mut **tx)
                .await?;
        }
        tx.add_free(&free_change).await?;
        Ok(answers)
    }};
}
pub(crate) use move_many_body;

/// A VM's change written with its devices' moves.
#[derive(Clone, Copy, Debug)]
pub enum VmChange {
    /// The last provision step: the VM `running`, its devices `used` (the write's moves)
    /// and a usage record opened for each; refused (`InvalidState`), moves and all, once
    /// the VM is no longer being provisioned.
    Running(VmId),
    /// The destroy's point of no return: the VM `destroyed`, its usage ended and its
    /// addresses free for the next VM; its devices go `dirty` (the write's moves).
    Destroyed(VmId),
}

/// One caller's device writes for a batch: its moves, the scrub reports (each with its
/// server and task) that explain them, and the VM change they go with.
#[derive(Clone, Debug, Default)]
pub struct DeviceWrite {
    pub moves: Vec<MoveReq>,
    pub reports: Vec<(
        ServerId,
        passage_model::TaskId,
        passage_model::protocol::ScrubReport,
    )>,
    pub vm: Option<VmChange>,
}

impl DeviceWrite {
    /// Devices `ids` on `server` `used` by `vm`, and `vm` `running`, together.
    pub fn running(vm: VmId, server: ServerId, ids: &[String]) -> Self {
        DeviceWrite {
            moves: vec![MoveReq::new(
                server,
                ids,
                DeviceEvent::Attach,
                Some(vm),
                &format!("attached to running VM {vm}"),
            )],
            reports: Vec::new(),
            vm: Some(VmChange::Running(vm)),
        }
    }

    /// `vm` `destroyed` and the devices it held (`ids` on `server`) `dirty`, together.
    pub fn destroyed(vm: VmId, server: Option<ServerId>, ids: &[String]) -> Self {
        DeviceWrite {
            moves: server
                .map(|s| {
                    MoveReq::new(
                        s,
                        ids,
                        DeviceEvent::Release,
                        Some(vm),
                        &format!("VM {vm} destroyed"),
                    )
                })
                .into_iter()
                .collect(),
            reports: Vec::new(),
            vm: Some(VmChange::Destroyed(vm)),
        }
    }
}

/// `$first, $first+1, …` for `items`, with their values.
fn list(first: usize, items: &[String]) -> (String, Vec<Arg>) {
    (
        super::page::marks(first, items.len()),
        items.iter().cloned().map(Arg::Text).collect(),
    )
}

/// The statements that make VMs `running`, each answering those it made so, with their
/// values (`now` first).
fn running_sql(now: i64, running: &[String]) -> Vec<(String, Vec<Arg>)> {
    running
        .chunks(CHUNK)
        .map(|chunk| {
            let (marks, mut args) = list(2, chunk);
            args.insert(0, Arg::Int(now));
            (
                format!(
                    "UPDATE vms SET state = 'running', updated_at = $1 WHERE uuid IN ({marks}) \
                     AND state IN ('provisioning', 'running') RETURNING uuid"
                ),
                args,
            )
        })
        .collect()
}

/// `destroyed`'s three statements per chunk of VMs, with their values.
fn destroyed_sql(now: i64, destroyed: &[String]) -> Vec<(String, Vec<Arg>)> {
    let mut out = Vec::new();
    for chunk in destroyed.chunks(CHUNK) {
        let (marks, args) = list(2, chunk);
        let with_now = |args: &Vec<Arg>| {
            let mut a = vec![Arg::Int(now)];
            a.extend(args.iter().cloned());
            a
        };
        out.push((
            format!(
                "UPDATE usage_records SET ended_at = $1 WHERE vm_uuid IN ({marks}) \
                 AND ended_at IS NULL"
            ),
            with_now(&args),
        ));
        // Gone from its node: its addresses may go to the next VM.
        let (marks1, args1) = list(1, chunk);
        out.push((
            format!("DELETE FROM network_ips WHERE vm_uuid IN ({marks1})"),
            args1,
        ));
        out.push((
            format!(
                "UPDATE vms SET state = 'destroyed', updated_at = $1 WHERE uuid IN ({marks}) \
                 AND state IN ('destroying', 'destroyed')"
            ),
            with_now(&args),
        ));
    }
    out
}

/// Opens a usage record for each `(vm, server, device)` that has none open (a replayed
/// step finds it open), with its values, `now` first.
fn usage_sql(now: i64, attached: &[(String, String, String)]) -> (String, Vec<Arg>) {
    let mut args = vec![Arg::Int(now)];
    args.extend(attached.iter().flat_map(|(vm, server, id)| {
        [
            Arg::Text(vm.clone()),
            Arg::Text(server.clone()),
            Arg::Text(id.clone()),
        ]
    }));
    (
        format!(
            "INSERT INTO usage_records (vm_uuid, owner_uuid, server_uuid, device, variant, \
             started_at) SELECT v.uuid, v.owner_uuid, x.column2, x.column3, \
             (SELECT d.variant FROM devices d WHERE d.server_uuid = x.column2 \
               AND d.id = x.column3), $1 \
             FROM (VALUES {}) AS x JOIN vms v ON v.uuid = x.column1 \
             WHERE NOT EXISTS (SELECT 1 FROM usage_records u WHERE u.vm_uuid = x.column1 \
               AND u.device = x.column3 AND u.ended_at IS NULL)",
            value_rows(2, attached.len(), 3)
        ),
        args,
    )
}

/// What a batch's writes answer: each write's moves' answers, or why it was refused.
pub type Answers = Vec<StoreResult<Vec<Vec<Moved>>>>;

/// Writes `writes` in one transaction: every report, the VMs' changes, then the moves of
/// every write not refused, in order (a device in two writes moves for the first, then
/// for the second), then the usage records of the VMs made running. The batch is all or
/// nothing (the outer error); a write refused is left out of it, alone.
pub async fn write(db: &super::Db, writes: &[DeviceWrite]) -> StoreResult<Answers> {
    use super::devices::DeviceTx;
    let now = super::now_ms();
    let reports: Vec<_> = writes
        .iter()
        .flat_map(|w| w.reports.iter().map(|(s, t, r)| (*s, *t, r)))
        .collect();
    let inserts = reports
        .chunks(CHUNK)
        .map(|c| super::events::scrub_reports_insert(c, now))
        .collect::<StoreResult<Vec<_>>>()?;
    let vm_of = |w: &DeviceWrite, running: bool| match w.vm {
        Some(VmChange::Running(v)) if running => Some(v.to_string()),
        Some(VmChange::Destroyed(v)) if !running => Some(v.to_string()),
        _ => None,
    };
    let running: Vec<String> = writes.iter().filter_map(|w| vm_of(w, true)).collect();
    let destroyed: Vec<String> = writes.iter().filter_map(|w| vm_of(w, false)).collect();
    let (running, destroyed) = (running_sql(now, &running), destroyed_sql(now, &destroyed));
    crate::in_tx!(db, |tx| {
        for (sql, args) in &inserts {
            crate::bind_args!(sqlx::query(sql), args)
                .execute(&mut *tx)
                .await?;
        }
        let mut made_running: HashSet<String> = HashSet::new();
        for (sql, args) in &running {
            let rows: Vec<(String,)> = crate::bind_args!(sqlx::query_as(sql), args)
                .fetch_all(&mut *tx)
                .await?;
            made_running.extend(rows.into_iter().map(|(u,)| u));
        }
        for (sql, args) in &destroyed {
            crate::bind_args!(sqlx::query(sql), args)
                .execute(&mut *tx)
                .await?;
        }
        let refused = |w: &DeviceWrite| vm_of(w, true).is_some_and(|v| !made_running.contains(&v));
        let reqs: Vec<MoveReq> = writes
            .iter()
            .filter(|w| !refused(w))
            .flat_map(|w| w.moves.iter().cloned())
            .collect();
        let mut moved = tx.move_many(&reqs).await?.into_iter();
        let mut answers: Answers = Vec::with_capacity(writes.len());
        let mut attached = Vec::new();
        for w in writes {
            if refused(w) {
                answers.push(Err(StoreError::InvalidState(
                    "the VM is no longer being provisioned".into(),
                )));
                continue;
            }
            if let Some(vm) = vm_of(w, true) {
                for r in &w.moves {
                    let server = r.server.to_string();
                    attached.extend(
                        r.ids
                            .iter()
                            .map(|id| (vm.clone(), server.clone(), id.clone())),
                    );
                }
            }
            answers.push(Ok(moved.by_ref().take(w.moves.len()).collect()));
        }
        for chunk in attached.chunks(CHUNK) {
            let (sql, args) = usage_sql(now, chunk);
            crate::bind_args!(sqlx::query(&sql), &args)
                .execute(&mut *tx)
                .await?;
        }
        Ok(answers)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(server: ServerId, ids: &[&str]) -> MoveReq {
        let ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
        MoveReq::new(server, &ids, DeviceEvent::Release, None, "t")
    }

    /// A device asked for twice starts a new run at its second request, so that it is
    /// read again after its first move; the same id on another server does not.
    #[test]
    fn a_device_comes_once_per_run() {
        let (s1, s2) = (ServerId::new_random(), ServerId::new_random());
        let reqs = [
            req(s1, &["a", "b"]),
            req(s2, &["a"]),
            req(s1, &["b", "c", "c"]),
        ];
        let runs: Vec<Vec<(usize, String)>> = runs(&reqs)
            .into_iter()
            .map(|r| r.into_iter().map(|(i, _, id)| (i, id)).collect())
            .collect();
        let run = |v: &[(usize, &str)]| -> Vec<(usize, String)> {
            v.iter().map(|(i, id)| (*i, id.to_string())).collect()
        };
        assert_eq!(
            runs,
            vec![
                run(&[(0, "a"), (0, "b"), (1, "a")]),
                run(&[(2, "b"), (2, "c")]),
                run(&[(2, "c")]),
            ]
        );
        assert!(super::runs(&[]).is_empty());
    }
}
