//! Device history and scrub reports.

use super::{Db, StoreResult, corrupt, now_ms, parse_uuid, to_time};
use crate::{on_read, on_write};
use passage_model::api::{DeviceEventRecord, ScrubRecord};
use passage_model::protocol::ScrubReport;
use passage_model::{DeviceState, ServerId, TaskId};

pub async fn device_events(
    db: &Db,
    server: ServerId,
    device: Option<&str>,
    last: Option<i64>,
) -> StoreResult<Vec<DeviceEventRecord>> {
    // Newest first so `last` can cut; turned back to oldest first below.
    let mut rows: Vec<(String, String, String, String, String, i64)> = on_read!(db, |p| {
        sqlx::query_as(
            "SELECT server_uuid, device, from_state, to_state, reason, at FROM device_events \
             WHERE server_uuid = $1 AND (CAST($2 AS TEXT) IS NULL OR device = $2) \
             ORDER BY seq DESC LIMIT $3",
        )
        .bind(server.to_string())
        .bind(device)
        .bind(last.unwrap_or(i64::MAX))
        .fetch_all(p)
        .await
    })?;
    rows.reverse();
    rows.into_iter()
        .map(|(s, d, f, t, reason, at)| {
            Ok(DeviceEventRecord {
                server_uuid: parse_uuid(&s, "server")?,
                device: d.parse().map_err(corrupt)?,
                from: DeviceState::parse(&f).ok_or_else(|| corrupt(&f))?,
                to: DeviceState::parse(&t).ok_or_else(|| corrupt(&t))?,
                reason,
                at: to_time(at),
            })
        })
        .collect()
}

pub async fn insert_scrub_report(
    db: &Db,
    server: ServerId,
    task: TaskId,
    report: &ScrubReport,
) -> StoreResult<()> {
    let steps = serde_json::to_string(&report.steps).map_err(corrupt)?;
    on_write!(db, |p| sqlx::query(
        "INSERT INTO scrub_reports (server_uuid, device, ok, steps, task_uuid, at) \
         VALUES ($1, $2, $3, $4, $5, $6)"
    )
    .bind(server.to_string())
    .bind(report.device.to_string())
    .bind(i64::from(report.ok))
    .bind(steps)
    .bind(task.to_string())
    .bind(now_ms())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

pub async fn scrub_reports(
    db: &Db,
    server: ServerId,
    device: Option<&str>,
) -> StoreResult<Vec<ScrubRecord>> {
    let rows: Vec<(String, String, i64, String, i64)> = on_read!(db, |p| {
        sqlx::query_as(
            "SELECT server_uuid, device, ok, steps, at FROM scrub_reports \
             WHERE server_uuid = $1 AND (CAST($2 AS TEXT) IS NULL OR device = $2) ORDER BY seq",
        )
        .bind(server.to_string())
        .bind(device)
        .fetch_all(p)
        .await
    })?;
    rows.into_iter()
        .map(|(s, d, ok, steps, at)| {
            Ok(ScrubRecord {
                server_uuid: parse_uuid(&s, "server")?,
                device: d.parse().map_err(corrupt)?,
                ok: ok != 0,
                steps: serde_json::from_str(&steps).map_err(corrupt)?,
                at: to_time(at),
            })
        })
        .collect()
}
