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
pub(crate) type Taken = BTreeMap<(String, String), i64>;

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

/// Recounts servers' free devices per variant, in the caller's transaction.
pub trait FreeIndexTx {
    fn refresh_free(&mut self, server: ServerId) -> impl Future<Output = StoreResult<()>> + Send;
    /// [`FreeIndexTx::refresh_free`] for many servers, in two statements per
    /// [`RECOUNT_CHUNK`] servers rather than two per server: an opening of vGPU hosts
    /// touches a batch's worth of servers, and on Postgres each statement is a round trip.
    fn refresh_free_many(
        &mut self,
        servers: &[ServerId],
    ) -> impl Future<Output = StoreResult<()>> + Send;
    /// Adds `changes` (by server and variant; negative: fewer free) to the index, for a
    /// change whose every device it counts was placeable before (a conditional update
    /// saw it so) or is placeable now: exact without reading any device.
    fn add_free(&mut self, changes: &Taken) -> impl Future<Output = StoreResult<()>> + Send;
}

/// Servers recounted per statement at most.
const RECOUNT_CHUNK: usize = 500;

macro_rules! impl_free_index_tx {
    ($db:ty) => {
        impl FreeIndexTx for sqlx::Transaction<'_, $db> {
            async fn refresh_free(&mut self, server: ServerId) -> StoreResult<()> {
                self.refresh_free_many(std::slice::from_ref(&server)).await
            }

            async fn refresh_free_many(&mut self, servers: &[ServerId]) -> StoreResult<()> {
                for chunk in servers.chunks(RECOUNT_CHUNK) {
                    let list: Vec<String> = (1..=chunk.len()).map(|i| format!("${i}")).collect();
                    let list = list.join(", ");
                    // Zero first, then count: a variant with no free device left keeps a
                    // row of 0, and concurrent writers on one server queue on these rows.
                    let zero =
                        format!("UPDATE free_devices SET free = 0 WHERE server_uuid IN ({list})");
                    let mut q = sqlx::query(&zero);
                    for s in chunk {
                        q = q.bind(s.to_string());
                    }
                    q.execute(&mut **self).await?;
                    let count = format!(
                        "INSERT INTO free_devices (server_uuid, variant, free) \
                         SELECT server_uuid, variant, COUNT(*) FROM devices \
                         WHERE server_uuid IN ({list}) AND variant IS NOT NULL AND {} \
                         GROUP BY server_uuid, variant \
                         ON CONFLICT (server_uuid, variant) DO UPDATE SET free = excluded.free",
                        placeable("")
                    );
                    let mut q = sqlx::query(&count);
                    for s in chunk {
                        q = q.bind(s.to_string());
                    }
                    q.execute(&mut **self).await?;
                }
                Ok(())
            }

            async fn add_free(&mut self, changes: &Taken) -> StoreResult<()> {
                // Fewer free: the rows exist (what is taken away was counted). More free:
                // a variant new on its server gets its row.
                let (less, more): (Vec<_>, Vec<_>) = changes
                    .iter()
                    .filter(|(_, n)| **n != 0)
                    .partition(|(_, n)| **n < 0);
                for (rows, adding) in [(less, false), (more, true)] {
                    for chunk in rows.chunks(RECOUNT_CHUNK) {
                        let values: Vec<String> = (0..chunk.len())
                            .map(|i| {
                                format!("(${}, ${}, CAST(${} AS BIGINT))", 3 * i + 1, 3 * i + 2, 3 * i + 3)
                            })
                            .collect();
                        let values = values.join(", ");
                        let sql = if adding {
                            format!(
                                "INSERT INTO free_devices (server_uuid, variant, free) \
                                 SELECT v.column1, v.column2, v.column3 FROM (VALUES {values}) AS v \
                                 WHERE true ON CONFLICT (server_uuid, variant) \
                                 DO UPDATE SET free = free_devices.free + excluded.free"
                            )
                        } else {
                            format!(
                                "UPDATE free_devices SET free = free_devices.free + v.column3 \
                                 FROM (VALUES {values}) AS v WHERE free_devices.server_uuid = v.column1 \
                                 AND free_devices.variant = v.column2"
                            )
                        };
                        let mut q = sqlx::query(&sql);
                        for ((server, variant), n) in chunk {
                            q = q.bind(server).bind(variant).bind(**n);
                        }
                        q.execute(&mut **self).await?;
                    }
                }
                Ok(())
            }
        }
    };
}

impl_free_index_tx!(sqlx::Sqlite);
impl_free_index_tx!(sqlx::Postgres);
