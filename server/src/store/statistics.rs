//! Planner statistics on Postgres that follow the fleet as it grows. Autovacuum
//! re-analyzes a table only on its round (a minute by default) and only after a tenth of
//! its rows changed, so for the first minute after 1,250 nodes join, placement is planned
//! from the statistics of a nearly empty `devices` table: the reservation's read of a
//! batch's servers then walked the whole placement index (3.5 ms a batch against 0.1 ms),
//! and 10,000 vGPU placements ran at 1,880–2,060/s instead of 2,260–2,440/s (measured
//! with `cargo xtask bench placement --backend postgres --vgpu-slots 4`). Postgres's own
//! advice after a bulk load is to run `ANALYZE`; a fleet joining is one.
//!
//! SQLite plans without gathered statistics: nothing to do there.

use super::{Db, StoreResult};
use std::time::{Duration, Instant};

/// The tables placement, reservations and jobs read by key and by state.
const TABLES: &[&str] = &[
    "servers",
    "devices",
    "free_devices",
    "vms",
    "jobs",
    "job_steps",
    "tasks",
];

/// Tables whose rows change state far more often than they come and go: they are due by
/// how far their row count moved since this keeper analyzed them, not by their updates. A
/// burst of creations turns thousands of `devices` rows from free to used in seconds,
/// which made the keeper analyze `devices` in the middle of it (0.43 of a Postgres
/// backend for a second, as the slowest 1 % of the creations were answered), while the
/// statements on `devices` read it by key or count it by state, whatever its states'
/// spread. In 8 fleet runs on Postgres alternated with 8 that analyzed it on its updates,
/// the creations' p99 was under 50 ms in 6 (median 44.0 ms) against 3 (median 55.5 ms),
/// lower in 6 of the 8 pairs, at a median 3,003/s against 2,740/s (BENCHMARKS.md,
/// thirty-third session). Rows come and go when nodes join or leave and when GPUs open for
/// vGPUs; then it is analyzed as before.
const BY_ROW_COUNT: &[&str] = &["devices"];

/// How often the counts of changed rows are read.
const EVERY: Duration = Duration::from_secs(2);

/// A table is analyzed again once this many rows changed since its last analysis, and
/// at least a fifth of its rows: as it grows, analyses come further apart.
const MIN_CHANGES: i64 = 500;

/// A table is analyzed at most this often: a placement storm changes every device row
/// within seconds, and each analysis makes every connection plan its statements again.
const AT_MOST_EVERY: Duration = Duration::from_secs(10);

/// Whether a table with `live` rows, `changed` of them since its last analysis, is due.
pub fn due(changed: i64, live: i64) -> bool {
    changed >= MIN_CHANGES && changed.saturating_mul(5) >= live
}

/// On Postgres, keeps the statistics of [`TABLES`] current for as long as the process
/// runs; on SQLite, nothing.
pub fn spawn(db: &Db) {
    let Db::Postgres(pool) = db else {
        return;
    };
    let pool = pool.clone();
    tokio::spawn(async move {
        let mut last: std::collections::HashMap<String, Analyzed> = Default::default();
        loop {
            tokio::time::sleep(EVERY).await;
            if pool.is_closed() {
                return;
            }
            match analyze_due(&pool, &mut last).await {
                Ok(done) if !done.is_empty() => {
                    tracing::debug!(tables = ?done, "planner statistics gathered again");
                }
                Ok(_) => {}
                Err(e) => tracing::debug!(error = %e, "reading or gathering planner statistics"),
            }
        }
    });
}

/// When this keeper last analyzed a table, and the rows it had then.
#[derive(Clone, Copy, Debug)]
pub struct Analyzed {
    pub at: Instant,
    /// `n_live_tup` as read just before.
    pub live: i64,
}

/// Analyzes those of [`TABLES`] that are [`due`] and were not analyzed by this process in
/// the last [`AT_MOST_EVERY`]; answers their names. Those of [`BY_ROW_COUNT`] that this
/// keeper analyzed before count the rows come or gone since, not the rows changed.
pub async fn analyze_due(
    pool: &sqlx::PgPool,
    last: &mut std::collections::HashMap<String, Analyzed>,
) -> StoreResult<Vec<String>> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT relname::text, n_mod_since_analyze, n_live_tup FROM pg_stat_user_tables \
         WHERE schemaname = current_schema() AND relname = ANY($1::text[])",
    )
    .bind(TABLES)
    .fetch_all(pool)
    .await?;
    let mut done = Vec::new();
    for (table, changed, live) in rows {
        // Only names of the list reach the statement: it takes no parameter there.
        let Some(name) = TABLES.iter().find(|t| **t == table) else {
            continue;
        };
        let before = last.get(*name);
        let recent = before.is_some_and(|a| a.at.elapsed() < AT_MOST_EVERY);
        let changed = match before {
            Some(a) if BY_ROW_COUNT.contains(name) => live.saturating_sub(a.live).saturating_abs(),
            _ => changed,
        };
        if recent || !due(changed, live) {
            continue;
        }
        sqlx::query(&format!("ANALYZE {name}"))
            .execute(pool)
            .await?;
        last.insert(
            name.to_string(),
            Analyzed {
                at: Instant::now(),
                live,
            },
        );
        done.push(name.to_string());
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_is_due_after_enough_changes_and_a_fifth_of_its_rows() {
        assert!(!due(0, 0));
        assert!(
            !due(MIN_CHANGES - 1, 0),
            "a few hundred rows: autovacuum's work"
        );
        assert!(due(MIN_CHANGES, 0), "a table filled from empty");
        assert!(due(10_000, 10_000));
        assert!(due(2_000, 10_000));
        assert!(!due(1_999, 10_000), "under a fifth of its rows");
    }
}
