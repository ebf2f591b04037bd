//! Packages: the shape of a VM, devices included.

use super::{Db, StoreError, StoreResult, now_ms, parse_uuid, to_time, unique_as_conflict};
use crate::{on_read, on_write};
use passage_model::PackageId;
use passage_model::api::Package;
use std::collections::BTreeMap;

#[derive(sqlx::FromRow)]
struct PackageRow {
    uuid: String,
    name: String,
    vcpus: i64,
    memory_mib: i64,
    disk_gib: i64,
    devices: String,
    placement: Option<String>,
    stop_grace_s: Option<i64>,
    created_at: i64,
}

impl PackageRow {
    fn into_view(self) -> StoreResult<Package> {
        let devices: BTreeMap<String, u32> = serde_json::from_str(&self.devices)
            .map_err(|e| StoreError::Corrupt(format!("package devices: {e}")))?;
        Ok(Package {
            uuid: parse_uuid(&self.uuid, "package")?,
            name: self.name,
            vcpus: u32::try_from(self.vcpus).unwrap_or(0),
            memory_mib: u64::try_from(self.memory_mib).unwrap_or(0),
            disk_gib: u64::try_from(self.disk_gib).unwrap_or(0),
            devices,
            placement: self
                .placement
                .as_deref()
                .map(|p| {
                    passage_model::api::PlacementPolicy::parse(p)
                        .ok_or_else(|| StoreError::Corrupt(format!("placement {p:?}")))
                })
                .transpose()?,
            stop_grace_s: self.stop_grace_s.and_then(|g| u32::try_from(g).ok()),
            created_at: to_time(self.created_at),
        })
    }
}

const COLS: &str =
    "uuid, name, vcpus, memory_mib, disk_gib, devices, placement, created_at, stop_grace_s";

pub struct NewPackage<'a> {
    pub name: &'a str,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub disk_gib: u64,
    pub devices: &'a BTreeMap<String, u32>,
    pub placement: Option<passage_model::api::PlacementPolicy>,
    pub stop_grace_s: Option<u32>,
}

pub async fn insert(db: &Db, p: NewPackage<'_>) -> StoreResult<Package> {
    let uuid = PackageId::new_random();
    let devices = serde_json::to_string(p.devices)
        .map_err(|e| StoreError::Corrupt(format!("package devices: {e}")))?;
    on_write!(db, |c| sqlx::query(&format!(
        "INSERT INTO packages ({COLS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
    ))
    .bind(uuid.to_string())
    .bind(p.name)
    .bind(i64::from(p.vcpus))
    .bind(i64::try_from(p.memory_mib).unwrap_or(i64::MAX))
    .bind(i64::try_from(p.disk_gib).unwrap_or(i64::MAX))
    .bind(devices)
    .bind(p.placement.map(|x| x.as_str()))
    .bind(now_ms())
    .bind(p.stop_grace_s.map(i64::from))
    .execute(c)
    .await
    .map(|r| r.rows_affected()))
    .map_err(|e| unique_as_conflict(e, || format!("package {:?} exists", p.name)))?;
    get(db, uuid).await
}

pub async fn get(db: &Db, uuid: PackageId) -> StoreResult<Package> {
    let row: Option<PackageRow> = on_read!(db, |c| sqlx::query_as(&format!(
        "SELECT {COLS} FROM packages WHERE uuid = $1"
    ))
    .bind(uuid.to_string())
    .fetch_optional(c)
    .await)?;
    row.ok_or(StoreError::NotFound("package"))?.into_view()
}

pub async fn by_name(db: &Db, name: &str) -> StoreResult<Package> {
    let row: Option<PackageRow> = on_read!(db, |c| sqlx::query_as(&format!(
        "SELECT {COLS} FROM packages WHERE name = $1"
    ))
    .bind(name)
    .fetch_optional(c)
    .await)?;
    row.ok_or(StoreError::NotFound("package"))?.into_view()
}

pub async fn list(db: &Db, limit: i64, offset: i64) -> StoreResult<(Vec<Package>, i64)> {
    let rows: Vec<PackageRow> = on_read!(db, |c| sqlx::query_as(&format!(
        "SELECT {COLS} FROM packages ORDER BY created_at DESC, uuid DESC LIMIT $1 OFFSET $2"
    ))
    .bind(limit)
    .bind(offset)
    .fetch_all(c)
    .await)?;
    let total: i64 = on_read!(db, |c| sqlx::query_scalar("SELECT COUNT(*) FROM packages")
        .fetch_one(c)
        .await)?;
    Ok((
        rows.into_iter()
            .map(PackageRow::into_view)
            .collect::<StoreResult<_>>()?,
        total,
    ))
}

pub async fn list_all(db: &Db) -> StoreResult<Vec<Package>> {
    let rows: Vec<PackageRow> = on_read!(db, |c| sqlx::query_as(&format!(
        "SELECT {COLS} FROM packages"
    ))
    .fetch_all(c)
    .await)?;
    rows.into_iter().map(PackageRow::into_view).collect()
}

pub async fn delete(db: &Db, uuid: PackageId) -> StoreResult<()> {
    let n = on_write!(db, |c| sqlx::query("DELETE FROM packages WHERE uuid = $1")
        .bind(uuid.to_string())
        .execute(c)
        .await
        .map(|r| r.rows_affected()))?;
    if n == 0 {
        return Err(StoreError::NotFound("package"));
    }
    Ok(())
}
