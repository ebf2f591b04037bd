//! The free-device index (`free_devices`: free devices per server and variant), which
//! placement reads to find servers without scanning every device. A hint only: every
//! reservation stays conditional on the devices themselves. Two ways to keep it: recount a
//! server after any change of its devices, or, for a reservation that read the devices
//! free under the same lock, subtract what it took (exact, and far cheaper for a batch).

use super::devices::placeable;
use crate::store::StoreResult;
use crate::store::sql::Sql;
use passage_model::ServerId;
use std::collections::BTreeMap;

/// Devices taken, by (server, variant).
pub(super) type Taken = BTreeMap<(String, String), i64>;

/// SQLite: subtracts what a reservation took.
pub(super) fn take_sqlite(q: &mut Sql, taken: &Taken) -> Option<String> {
    if taken.is_empty() {
        return None;
    }
    let items: Vec<(&(String, String), &i64)> = taken.iter().collect();
    let rows = q.rows(&items, |q, ((server, variant), n)| {
        format!("{}, {}, {}", q.text(server), q.text(variant), q.int(**n))
    });
    Some(format!(
        "UPDATE free_devices SET free = free - v.column3 FROM (VALUES {rows}) AS v \
         WHERE free_devices.server_uuid = v.column1 AND free_devices.variant = v.column2"
    ))
}

/// Postgres: the same over arrays of servers, variants (text) and counts (int8), as a
/// data-modifying CTE body.
pub(super) fn take_pg(servers: &str, variants: &str, counts: &str) -> String {
    format!(
        "UPDATE free_devices SET free = free_devices.free - x.n \
         FROM UNNEST({servers}::text[], {variants}::text[], {counts}::int8[]) AS x(s, v, n) \
         WHERE free_devices.server_uuid = x.s AND free_devices.variant = x.v RETURNING 1"
    )
}

/// Recounts the server's free devices per variant, in the caller's transaction.
pub trait FreeIndexTx {
    fn refresh_free(&mut self, server: ServerId) -> impl Future<Output = StoreResult<()>> + Send;
}

macro_rules! impl_free_index_tx {
    ($db:ty) => {
        impl FreeIndexTx for sqlx::Transaction<'_, $db> {
            async fn refresh_free(&mut self, server: ServerId) -> StoreResult<()> {
                // Zero first, then count: a variant with no free device left keeps a row
                // of 0, and concurrent writers on one server queue on these rows.
                sqlx::query("UPDATE free_devices SET free = 0 WHERE server_uuid = $1")
                    .bind(server.to_string())
                    .execute(&mut **self)
                    .await?;
                sqlx::query(&format!(
                    "INSERT INTO free_devices (server_uuid, variant, free) \
                     SELECT server_uuid, variant, COUNT(*) FROM devices \
                     WHERE server_uuid = $1 AND variant IS NOT NULL AND {} \
                     GROUP BY server_uuid, variant \
                     ON CONFLICT (server_uuid, variant) DO UPDATE SET free = excluded.free",
                    placeable("")
                ))
                .bind(server.to_string())
                .execute(&mut **self)
                .await?;
                Ok(())
            }
        }
    };
}

impl_free_index_tx!(sqlx::Sqlite);
impl_free_index_tx!(sqlx::Postgres);
