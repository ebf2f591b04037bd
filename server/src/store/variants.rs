//! Device variants.

use super::{Db, StoreError, StoreResult, corrupt, now_ms, unique_as_conflict};
use crate::{on_read, on_write};
use passage_model::Variant;
use passage_model::variant::{DeviceType, ScrubPolicy};

#[derive(sqlx::FromRow)]
pub(crate) struct VariantRow {
    name: String,
    kind: String,
    vendor: String,
    device: String,
    subvendor: Option<String>,
    subsystem: Option<String>,
    revision: Option<String>,
    description: Option<String>,
    scrub: Option<String>,
    parent: Option<String>,
    vgpu_type: Option<String>,
    max_per_gpu: Option<i64>,
    num_vfs: Option<i64>,
    mix: i64,
    scrub_policy: String,
}

impl VariantRow {
    fn into_view(self) -> StoreResult<Variant> {
        Ok(Variant {
            kind: DeviceType::parse(&self.kind).ok_or_else(|| corrupt(&self.kind))?,
            vendor: self.vendor.parse().map_err(corrupt)?,
            device: self.device.parse().map_err(corrupt)?,
            subvendor: self
                .subvendor
                .map(|s| s.parse())
                .transpose()
                .map_err(corrupt)?,
            subsystem: self
                .subsystem
                .map(|s| s.parse())
                .transpose()
                .map_err(corrupt)?,
            revision: self
                .revision
                .map(|s| s.parse())
                .transpose()
                .map_err(corrupt)?,
            description: self.description,
            parent: self.parent,
            vgpu_type: self.vgpu_type,
            max_per_gpu: self
                .max_per_gpu
                .map(u32::try_from)
                .transpose()
                .map_err(corrupt)?,
            num_vfs: self
                .num_vfs
                .map(u32::try_from)
                .transpose()
                .map_err(corrupt)?,
            mix: self.mix != 0,
            scrub_policy: ScrubPolicy::parse(&self.scrub_policy)
                .ok_or_else(|| corrupt(&self.scrub_policy))?,
            scrub: self
                .scrub
                .as_deref()
                .map(serde_json::from_str)
                .transpose()
                .map_err(corrupt)?,
            name: self.name,
        })
    }
}

const COLS: &str = "name, kind, vendor, device, subvendor, subsystem, revision, description, scrub, \
    parent, vgpu_type, max_per_gpu, num_vfs, mix, scrub_policy";

/// A page, newest first, and the total.
pub async fn page(db: &Db, limit: i64, offset: i64) -> StoreResult<(Vec<Variant>, i64)> {
    let rows: Vec<VariantRow> = on_read!(db, |p| sqlx::query_as(&format!(
        "SELECT {COLS} FROM variants ORDER BY created_at DESC, name DESC LIMIT $1 OFFSET $2"
    ))
    .bind(limit)
    .bind(offset)
    .fetch_all(p)
    .await)?;
    let total: i64 = on_read!(db, |p| sqlx::query_scalar("SELECT COUNT(*) FROM variants")
        .fetch_one(p)
        .await)?;
    Ok((
        rows.into_iter()
            .map(VariantRow::into_view)
            .collect::<StoreResult<_>>()?,
        total,
    ))
}

/// Every variant, read inside a transaction that classifies devices (`LIST_ALL`'s rows
/// through [`views`]).
pub(crate) const LIST_ALL: &str = "SELECT name, kind, vendor, device, subvendor, subsystem, \
     revision, description, scrub, parent, vgpu_type, max_per_gpu, num_vfs, mix, scrub_policy \
     FROM variants ORDER BY name";

pub(crate) fn views(rows: Vec<VariantRow>) -> StoreResult<Vec<Variant>> {
    rows.into_iter().map(VariantRow::into_view).collect()
}

/// Every variant (matching needs them all).
pub async fn list(db: &Db) -> StoreResult<Vec<Variant>> {
    let rows: Vec<VariantRow> = on_read!(db, |p| sqlx::query_as(&format!(
        "SELECT {COLS} FROM variants ORDER BY name"
    ))
    .fetch_all(p)
    .await)?;
    rows.into_iter().map(VariantRow::into_view).collect()
}

pub async fn get(db: &Db, name: &str) -> StoreResult<Variant> {
    let row: Option<VariantRow> = on_read!(db, |p| sqlx::query_as(&format!(
        "SELECT {COLS} FROM variants WHERE name = $1"
    ))
    .bind(name)
    .fetch_optional(p)
    .await)?;
    row.ok_or(StoreError::NotFound("variant"))?.into_view()
}

pub async fn insert(db: &Db, v: &Variant) -> StoreResult<()> {
    on_write!(db, |p| sqlx::query(&format!(
        "INSERT INTO variants ({COLS}, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $10, $11, $12, $13, $14, $15, $16, $9)"
    ))
    .bind(&v.name)
    .bind(v.kind.as_str())
    .bind(v.vendor.to_string())
    .bind(v.device.to_string())
    .bind(v.subvendor.map(|x| x.to_string()))
    .bind(v.subsystem.map(|x| x.to_string()))
    .bind(v.revision.map(|x| x.to_string()))
    .bind(&v.description)
    .bind(now_ms())
    .bind(scrub_json(v)?)
    .bind(&v.parent)
    .bind(&v.vgpu_type)
    .bind(v.max_per_gpu.map(i64::from))
    .bind(v.num_vfs.map(i64::from))
    .bind(i64::from(v.mix))
    .bind(v.scrub_policy.as_str())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))
    .map_err(|e| unique_as_conflict(e, || format!("variant {:?} exists", v.name)))?;
    Ok(())
}

pub async fn update(db: &Db, v: &Variant) -> StoreResult<()> {
    let n = on_write!(db, |p| sqlx::query(
        "UPDATE variants SET kind = $2, vendor = $3, device = $4, subvendor = $5, \
         subsystem = $6, revision = $7, description = $8, scrub = $9, parent = $10, \
         vgpu_type = $11, max_per_gpu = $12, num_vfs = $13, mix = $14, scrub_policy = $15 \
         WHERE name = $1"
    )
    .bind(&v.name)
    .bind(v.kind.as_str())
    .bind(v.vendor.to_string())
    .bind(v.device.to_string())
    .bind(v.subvendor.map(|x| x.to_string()))
    .bind(v.subsystem.map(|x| x.to_string()))
    .bind(v.revision.map(|x| x.to_string()))
    .bind(&v.description)
    .bind(scrub_json(v)?)
    .bind(&v.parent)
    .bind(&v.vgpu_type)
    .bind(v.max_per_gpu.map(i64::from))
    .bind(v.num_vfs.map(i64::from))
    .bind(i64::from(v.mix))
    .bind(v.scrub_policy.as_str())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    if n == 0 {
        return Err(StoreError::NotFound("variant"));
    }
    Ok(())
}

/// Refused while a package asks for the variant, a vGPU or VF variant names it as parent, or
/// a device of it is anywhere but `unassigned`/`disabled` (for a vGPU variant: while any
/// GPU hosts its slots): each would lose track of what a VM holds or of a GPU's mode.
pub async fn delete(db: &Db, name: &str) -> StoreResult<()> {
    let child: Option<String> = on_read!(db, |p| sqlx::query_scalar(
        "SELECT name FROM variants WHERE parent = $1 ORDER BY name LIMIT 1"
    )
    .bind(name)
    .fetch_optional(p)
    .await)?;
    if let Some(child) = child {
        return Err(StoreError::Conflict(format!(
            "variant {child:?} names variant {name:?} as its parent"
        )));
    }
    let busy = busy_devices(db, name).await?;
    if busy > 0 {
        return Err(StoreError::Conflict(format!(
            "{busy} device(s) of variant {name:?} are in use or being cleaned"
        )));
    }
    let packages = super::packages::list_all(db).await?;
    if let Some(p) = packages.iter().find(|p| p.devices.contains_key(name)) {
        return Err(StoreError::Conflict(format!(
            "package {:?} asks for variant {name:?}",
            p.name
        )));
    }
    let n = on_write!(db, |p| sqlx::query("DELETE FROM variants WHERE name = $1")
        .bind(name)
        .execute(p)
        .await
        .map(|r| r.rows_affected()))?;
    if n == 0 {
        return Err(StoreError::NotFound("variant"));
    }
    Ok(())
}

/// Devices of `name` held, dirty or being cleaned, and vGPU slots of it in any state.
pub async fn busy_devices(db: &Db, name: &str) -> StoreResult<i64> {
    Ok(on_read!(db, |p| sqlx::query_scalar(
        "SELECT COUNT(*) FROM devices WHERE variant = $1 \
         AND (state NOT IN ('unassigned', 'disabled') OR parent IS NOT NULL)"
    )
    .bind(name)
    .fetch_one(p)
    .await)?)
}

/// vGPU slots of `name` that exist (on GPUs hosting it now).
pub async fn slots_of(db: &Db, name: &str) -> StoreResult<i64> {
    Ok(on_read!(db, |p| sqlx::query_scalar(
        "SELECT COUNT(*) FROM devices WHERE variant = $1 AND parent IS NOT NULL"
    )
    .bind(name)
    .fetch_one(p)
    .await)?)
}

fn scrub_json(v: &Variant) -> StoreResult<Option<String>> {
    v.scrub
        .as_ref()
        .map(serde_json::to_string)
        .transpose()
        .map_err(corrupt)
}
