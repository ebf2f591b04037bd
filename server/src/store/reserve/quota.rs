//! An owner's GPU quota in the database: `accounts.gpu_held` counts the devices its VMs
//! hold, charged when they are reserved and given back when they stop being held. The rule
//! itself is `passage_model::capacity::Quota::admits`; the charge states it again as the
//! condition of its write, so a write that would break it changes no row.

use crate::store::sql::Sql;
use passage_model::AccountId;

/// The condition of a charge of `n` more devices, as `Quota::admits` puts it.
fn admits(n: &str) -> String {
    format!("(accounts.gpu_quota IS NULL OR accounts.gpu_held + {n} <= accounts.gpu_quota)")
}

/// SQLite: charges each `(owner, devices)` of `charges`; answers one row `0` per owner
/// charged, which must be all of them.
pub(super) fn charge_sqlite(q: &mut Sql, charges: &[(AccountId, i64)]) -> String {
    let rows = q.rows(charges, |q, (owner, n)| {
        format!("{}, {}", q.text(owner), q.int(*n))
    });
    format!(
        "UPDATE accounts SET gpu_held = gpu_held + v.column2 FROM (VALUES {rows}) AS v \
         WHERE accounts.uuid = v.column1 AND {} RETURNING 0",
        admits("v.column2")
    )
}

/// Postgres: the same charge over arrays `owners` (text) and `counts` (int8), as a
/// data-modifying CTE body answering a row per owner charged.
pub(super) fn charge_pg(owners: &str, counts: &str) -> String {
    format!(
        "UPDATE accounts SET gpu_held = accounts.gpu_held + x.n \
         FROM UNNEST({owners}::text[], {counts}::int8[]) AS x(o, n) \
         WHERE accounts.uuid = x.o AND {} RETURNING 1",
        admits("x.n")
    )
}

/// Each listed owner's quota and charge, as the reservation's read takes them: rows
/// `('quota', owner, NULL, NULL, gpu_quota, gpu_held, NULL, NULL)`; `owners` is the
/// list's SQL (placeholders or `ANY(…)` target).
pub(super) fn read(owners_in: &str) -> String {
    format!(
        "SELECT 'quota', uuid, NULL, NULL, gpu_quota, gpu_held, NULL, NULL FROM accounts \
         WHERE uuid {owners_in}"
    )
}
