//! Devices reserved for a VM: the one writer of the state machine's `Reserve`
//! (`unassigned → provisioning`), for one VM or a batch, on both databases. Every other
//! state change goes through `store::devices::DeviceTx::move_devices`, device by device.

use crate::store::sql::Sql;
use crate::store::{StoreError, StoreResult};
use passage_model::{DeviceEvent, DeviceState, ServerId, VmId, transition};

/// The condition for a device placement may take, on a table aliased `alias` (with its
/// dot, or empty): free, reported by its node, healthy.
pub(crate) fn placeable(alias: &str) -> String {
    format!(
        "{alias}state = '{}' AND {alias}missing = 0 AND {alias}taint IS NULL",
        DeviceState::Unassigned.as_str()
    )
}

/// What `Reserve` does, asked of the state machine (once per reservation, for all of its
/// devices): from the free state, to the held one.
pub(super) fn reserve_transition() -> StoreResult<(DeviceState, DeviceState)> {
    let from = DeviceState::Unassigned;
    let to =
        transition(from, DeviceEvent::Reserve).map_err(|e| StoreError::Corrupt(e.to_string()))?;
    if !to.is_held() {
        return Err(StoreError::Corrupt(format!(
            "the state machine's Reserve leads to {to}, which holds nothing"
        )));
    }
    Ok((from, to))
}

/// One device to reserve: its server, its id and the VM it goes to.
pub(super) type Reserved = (ServerId, String, VmId);

/// SQLite: the reservation of `devs` (answering one row `1` per device moved, which must
/// be all of them) and their history.
pub(super) fn reserve_sqlite(
    q: &mut Sql,
    devs: &[Reserved],
    (from, to): (DeviceState, DeviceState),
    reason: &dyn Fn(VmId) -> String,
    now: i64,
) -> [String; 2] {
    let at = q.int(now);
    // The state and `missing` a device must still have are join keys, as on Postgres.
    let rows = q.rows(devs, |q, (server, id, vm)| {
        format!(
            "{}, {}, {}, '{}', 0",
            q.text(server),
            q.text(id),
            q.text(vm),
            from.as_str()
        )
    });
    let reserve = format!(
        "UPDATE devices SET state = '{}', used_by = v.column3, generation = generation + 1, \
         updated_at = {at} FROM (VALUES {rows}) AS v WHERE devices.server_uuid = v.column1 \
         AND devices.id = v.column2 AND devices.state = v.column4 \
         AND devices.missing = v.column5 AND devices.taint IS NULL RETURNING 1",
        to.as_str()
    );
    let rows = q.rows(devs, |q, (server, id, vm)| {
        format!(
            "{}, {}, '{}', '{}', {}, {}",
            q.text(server),
            q.text(id),
            from.as_str(),
            to.as_str(),
            q.text(reason(*vm)),
            q.int(now)
        )
    });
    let events = format!(
        "INSERT INTO device_events (server_uuid, device, from_state, to_state, reason, at) \
         VALUES {rows}"
    );
    [reserve, events]
}

/// Postgres: the reservation as a data-modifying CTE body over arrays of servers, ids,
/// VMs, required states (text) and required `missing` (int8), setting state `to` and time
/// `at` (placeholders). A device's required state and presence are join keys, not
/// filters: as filters, Postgres estimates (before its first ANALYZE of a fresh fleet)
/// that almost no device passes them and scans the list once per device (370 ms for 63
/// creations).
pub(super) fn reserve_pg(arrays: [&str; 5], to: &str, at: &str) -> String {
    let [s, i, vm, st, mi] = arrays;
    format!(
        "UPDATE devices SET state = {to}, used_by = x.vm, \
         generation = devices.generation + 1, updated_at = {at} \
         FROM UNNEST({s}::text[], {i}::text[], {vm}::text[], {st}::text[], {mi}::int8[]) \
         AS x(s, i, vm, st, mi) WHERE devices.server_uuid = x.s AND devices.id = x.i \
         AND devices.state = x.st AND devices.missing = x.mi AND devices.taint IS NULL \
         RETURNING 1"
    )
}

/// Postgres: the reserved devices' history over arrays of servers, ids, previous states and
/// reasons, to state `to` at `at`.
pub(super) fn events_pg(arrays: [&str; 4], to: &str, at: &str) -> String {
    let [s, i, st, r] = arrays;
    format!(
        "INSERT INTO device_events (server_uuid, device, from_state, to_state, reason, at) \
         SELECT x.s, x.i, x.f, {to}, x.r, {at} \
         FROM UNNEST({s}::text[], {i}::text[], {st}::text[], {r}::text[]) AS x(s, i, f, r) \
         RETURNING 1"
    )
}

/// The free devices of the listed servers with their variants, as the reservation's read
/// takes them: rows `('free', server, id, variant, NULL…)`.
pub(super) fn read_free(servers_in: &str) -> String {
    format!(
        "SELECT 'free', server_uuid, id, variant, CAST(numa_node AS BIGINT), NULL, NULL, NULL \
         FROM devices WHERE server_uuid {servers_in} AND {}",
        placeable("")
    )
}
