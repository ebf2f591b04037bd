//! Compute nodes: join tokens, registration, heartbeats.

use super::page::{self, Page, PageReq, TimeKey, Where};
use super::sql::padded;
use super::{Db, StoreError, StoreResult, now_ms, parse_uuid, to_time};
use crate::{in_tx, on_read, on_write};
use chrono::{DateTime, Utc};
use passage_model::ServerId;

pub struct ServerRecord {
    pub uuid: ServerId,
    pub hostname: String,
    pub last_heartbeat: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    /// Drained: no new placements.
    pub disabled: bool,
    /// What its agent last reported of the machine beyond CPU and memory totals.
    pub host: Option<passage_model::protocol::HostFacts>,
}

#[derive(sqlx::FromRow)]
struct ServerRow {
    uuid: String,
    hostname: String,
    last_heartbeat: Option<i64>,
    created_at: i64,
    disabled: i64,
    host_facts: Option<String>,
}

impl ServerRow {
    fn into_record(self) -> StoreResult<ServerRecord> {
        Ok(ServerRecord {
            uuid: parse_uuid(&self.uuid, "server")?,
            hostname: self.hostname,
            last_heartbeat: self.last_heartbeat.map(to_time),
            created_at: to_time(self.created_at),
            disabled: self.disabled != 0,
            host: self
                .host_facts
                .as_deref()
                .map(serde_json::from_str)
                .transpose()
                .map_err(super::corrupt)?,
        })
    }
}

pub async fn insert_join_token(
    db: &Db,
    token_hash: &str,
    created_by: &str,
    expires_at: i64,
) -> StoreResult<()> {
    insert_join_token_for(db, token_hash, created_by, expires_at, None).await
}

/// A join token; with `for_server`, it re-admits that server instead of a new one.
pub async fn insert_join_token_for(
    db: &Db,
    token_hash: &str,
    created_by: &str,
    expires_at: i64,
    for_server: Option<ServerId>,
) -> StoreResult<()> {
    on_write!(db, |p| sqlx::query(
        "INSERT INTO join_tokens (token_hash, created_by, expires_at, created_at, for_server) \
         VALUES ($1, $2, $3, $4, $5)"
    )
    .bind(token_hash)
    .bind(created_by)
    .bind(expires_at)
    .bind(now_ms())
    .bind(for_server.map(|s| s.to_string()))
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

/// Spends a join token and creates the server in one transaction, so a token admits one
/// node however many agents race with it.
pub async fn register(
    db: &Db,
    join_token_hash: &str,
    hostname: &str,
    credential_hash: &str,
) -> StoreResult<Option<ServerId>> {
    let fresh = ServerId::new_random();
    let now = now_ms();
    in_tx!(db, |tx| {
        let token: Option<(Option<String>,)> = sqlx::query_as(
            "SELECT for_server FROM join_tokens \
             WHERE token_hash = $1 AND used_at IS NULL AND expires_at > $2",
        )
        .bind(join_token_hash)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((for_server,)) = token else {
            return Ok(None);
        };
        let uuid = match &for_server {
            Some(s) => parse_uuid::<ServerId>(s, "server")?,
            None => fresh,
        };
        let spent = sqlx::query(
            "UPDATE join_tokens SET used_at = $2, server_uuid = $3 \
             WHERE token_hash = $1 AND used_at IS NULL AND expires_at > $2",
        )
        .bind(join_token_hash)
        .bind(now)
        .bind(uuid.to_string())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if spent != 1 {
            return Ok(None);
        }
        if for_server.is_some() {
            // The same node, a new credential: its devices, VMs and history stay.
            sqlx::query(
                "UPDATE servers SET credential_hash = $2, hostname = $3, last_heartbeat = $4 \
                 WHERE uuid = $1",
            )
            .bind(uuid.to_string())
            .bind(credential_hash)
            .bind(hostname)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            return Ok(Some(uuid));
        }
        sqlx::query(
            "INSERT INTO servers (uuid, hostname, credential_hash, last_heartbeat, created_at) \
             VALUES ($1, $2, $3, $4, $4)",
        )
        .bind(uuid.to_string())
        .bind(hostname)
        .bind(credential_hash)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        Ok(Some(uuid))
    })
}

pub async fn by_credential(db: &Db, credential_hash: &str) -> StoreResult<Option<ServerId>> {
    let s: Option<String> = on_read!(db, |p| sqlx::query_scalar(
        "SELECT uuid FROM servers WHERE credential_hash = $1"
    )
    .bind(credential_hash)
    .fetch_optional(p)
    .await)?;
    s.map(|s| parse_uuid(&s, "server")).transpose()
}

/// Marks each of `servers` alive now, in one statement (`services::heartbeats` gathers
/// the nodes' heartbeats into it).
pub async fn heartbeat_many(db: &Db, servers: &[ServerId]) -> StoreResult<()> {
    if servers.is_empty() {
        return Ok(());
    }
    let mut w = Where::default();
    let now = w.int(now_ms());
    let list: Vec<String> = padded(servers)
        .iter()
        .map(|s| w.text(s.to_string()))
        .collect();
    let sql = format!(
        "UPDATE servers SET last_heartbeat = {now} WHERE uuid IN ({})",
        list.join(", ")
    );
    on_write!(db, |p| crate::bind_args!(sqlx::query(&sql), &w.args)
        .execute(p)
        .await
        .map(|r| r.rows_affected()))?;
    Ok(())
}

pub async fn get(db: &Db, uuid: ServerId) -> StoreResult<ServerRecord> {
    let row: Option<ServerRow> = on_read!(db, |p| {
        sqlx::query_as(
        "SELECT uuid, hostname, last_heartbeat, created_at, disabled, host_facts FROM servers WHERE uuid = $1"
    )
    .bind(uuid.to_string())
    .fetch_optional(p)
    .await
    })?;
    row.ok_or(StoreError::NotFound("server"))?.into_record()
}

pub async fn list(db: &Db, limit: i64, offset: i64) -> StoreResult<(Vec<ServerRecord>, i64)> {
    let rows: Vec<ServerRow> = on_read!(db, |p| sqlx::query_as(
        "SELECT uuid, hostname, last_heartbeat, created_at, disabled, host_facts FROM servers \
         ORDER BY created_at DESC, uuid DESC LIMIT $1 OFFSET $2"
    )
    .bind(limit)
    .bind(offset)
    .fetch_all(p)
    .await)?;
    let total: i64 = on_read!(db, |p| sqlx::query_scalar("SELECT COUNT(*) FROM servers")
        .fetch_one(p)
        .await)?;
    Ok((
        rows.into_iter()
            .map(ServerRow::into_record)
            .collect::<StoreResult<_>>()?,
        total,
    ))
}

pub use crate::listing::ServerFilter;

const SERVER_COLS: &str = "uuid, hostname, last_heartbeat, created_at, disabled, host_facts";

/// One page of servers, newest first.
pub async fn page(
    db: &Db,
    f: &ServerFilter,
    req: &PageReq<TimeKey>,
) -> StoreResult<Page<ServerRecord, TimeKey>> {
    use passage_model::api::ServerStatus;
    let mut w = Where::default();
    match f.status {
        None => {}
        Some(ServerStatus::Unknown) => w.and("last_heartbeat IS NULL"),
        Some(ServerStatus::Running) => {
            let t = w.int(f.alive_after_ms);
            w.and(format!("last_heartbeat >= {t}"));
        }
        Some(ServerStatus::Offline) => {
            let t = w.int(f.alive_after_ms);
            w.and(format!("last_heartbeat < {t}"));
        }
    }
    let p = page::newest_first(db, SERVER_COLS, "servers", w, req, |r: &ServerRow| {
        TimeKey::new(r.created_at, &r.uuid)
    })
    .await?;
    Ok(Page {
        items: p
            .items
            .into_iter()
            .map(ServerRow::into_record)
            .collect::<StoreResult<_>>()?,
        total: p.total,
        next: p.next,
    })
}

pub async fn set_hostname(db: &Db, uuid: ServerId, hostname: &str) -> StoreResult<()> {
    let n = on_write!(db, |p| sqlx::query(
        "UPDATE servers SET hostname = $2 WHERE uuid = $1"
    )
    .bind(uuid.to_string())
    .bind(hostname)
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    if n == 0 {
        return Err(StoreError::NotFound("server"));
    }
    Ok(())
}

pub async fn set_disabled(db: &Db, uuid: ServerId, disabled: bool) -> StoreResult<()> {
    let n = on_write!(db, |p| sqlx::query(
        "UPDATE servers SET disabled = $2 WHERE uuid = $1"
    )
    .bind(uuid.to_string())
    .bind(i64::from(disabled))
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    if n == 0 {
        return Err(StoreError::NotFound("server"));
    }
    Ok(())
}

/// Running servers in service with how many assignable devices each has, fewest first:
/// VMs that ask for no device go where no GPU is wasted on them (CloudStack's rule).
pub async fn alive_by_device_count(
    db: &Db,
    alive_after_ms: i64,
) -> StoreResult<Vec<(ServerId, i64)>> {
    let rows: Vec<(String, i64)> = on_read!(db, |p| sqlx::query_as(
        "SELECT s.uuid, COUNT(d.id) FROM servers s \
         LEFT JOIN devices d ON d.server_uuid = s.uuid AND d.variant IS NOT NULL \
         WHERE s.last_heartbeat >= $1 AND s.disabled = 0 \
         GROUP BY s.uuid ORDER BY COUNT(d.id), s.uuid"
    )
    .bind(alive_after_ms)
    .fetch_all(p)
    .await)?;
    rows.into_iter()
        .map(|(u, n)| Ok((parse_uuid(&u, "server")?, n)))
        .collect()
}

/// Replaces a node's credential hash (rotation, or revocation with an unusable value).
pub async fn set_credential(db: &Db, uuid: ServerId, credential_hash: &str) -> StoreResult<()> {
    let n = on_write!(db, |p| sqlx::query(
        "UPDATE servers SET credential_hash = $2 WHERE uuid = $1"
    )
    .bind(uuid.to_string())
    .bind(credential_hash)
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    if n == 0 {
        return Err(StoreError::NotFound("server"));
    }
    Ok(())
}

/// Records the bridges a node reported; a node that reports none keeps what it had.
pub async fn set_bridges(db: &Db, uuid: ServerId, bridges: &[String]) -> StoreResult<()> {
    let text = serde_json::to_string(bridges).map_err(super::corrupt)?;
    on_write!(db, |p| sqlx::query(
        "UPDATE servers SET bridges = $2 WHERE uuid = $1 \
         AND (bridges IS NULL OR bridges <> $2)"
    )
    .bind(uuid.to_string())
    .bind(text)
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

/// Every server's bridges, as its node last reported them; a server that never reported
/// any is absent.
pub async fn bridges(
    db: &Db,
) -> StoreResult<std::collections::HashMap<ServerId, std::collections::BTreeSet<String>>> {
    let rows: Vec<(String, String)> = on_read!(db, |p| sqlx::query_as(
        "SELECT uuid, bridges FROM servers WHERE bridges IS NOT NULL"
    )
    .fetch_all(p)
    .await)?;
    rows.into_iter()
        .map(|(u, b)| {
            Ok((
                parse_uuid(&u, "server")?,
                serde_json::from_str(&b).map_err(super::corrupt)?,
            ))
        })
        .collect()
}
