//! Device history and scrub reports.

use super::page::Arg;
use super::{Db, StoreResult, corrupt, parse_uuid, to_time};
use crate::on_read;
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

/// The insert of scrub reports (each with its server and task), with its values, for a
/// caller's transaction.
pub(crate) fn scrub_reports_insert(
    reports: &[(ServerId, TaskId, &ScrubReport)],
    now: i64,
) -> StoreResult<(String, Vec<Arg>)> {
    let mut args = Vec::with_capacity(reports.len() * 6);
    for (server, task, r) in reports {
        args.extend([
            Arg::Text(server.to_string()),
            Arg::Text(r.device.to_string()),
            Arg::Int(i64::from(r.ok)),
            Arg::Text(serde_json::to_string(&r.steps).map_err(corrupt)?),
            Arg::Text(task.to_string()),
            Arg::Int(now),
        ]);
    }
    Ok((
        format!(
            "INSERT INTO scrub_reports (server_uuid, device, ok, steps, task_uuid, at) VALUES {}",
            super::page::value_rows(1, reports.len(), 6)
        ),
        args,
    ))
}

pub async fn scrub_reports(
    db: &Db,
    server: ServerId,
    device: Option<&str>,
) -> StoreResult<Vec<ScrubRecord>> {
    type Row = (String, String, i64, String, i64, Option<String>);
    let rows: Vec<Row> = on_read!(db, |p| {
        sqlx::query_as(
            "SELECT server_uuid, device, ok, steps, at, task_uuid FROM scrub_reports \
             WHERE server_uuid = $1 AND (CAST($2 AS TEXT) IS NULL OR device = $2) ORDER BY seq",
        )
        .bind(server.to_string())
        .bind(device)
        .fetch_all(p)
        .await
    })?;
    rows.into_iter()
        .map(|(s, d, ok, steps, at, task)| {
            Ok(ScrubRecord {
                task_uuid: task.map(|t| parse_uuid(&t, "task")).transpose()?,
                server_uuid: parse_uuid(&s, "server")?,
                device: d.parse().map_err(corrupt)?,
                ok: ok != 0,
                steps: serde_json::from_str(&steps).map_err(corrupt)?,
                at: to_time(at),
            })
        })
        .collect()
}
