//! The image catalog. A row's file lives under the image directory by its SHA-256; the
//! row holds the digest and size once an upload was checked.

use super::{Db, StoreError, StoreResult, now_ms, parse_uuid, to_time, unique_as_conflict};
use crate::{on_read, on_write};
use passage_model::images::{Bootrom, Image, ImageRequirements, ImageState, ImageType, Sha256};
use passage_model::{AccountId, ImageId};
use std::collections::{BTreeMap, HashMap};

#[derive(sqlx::FromRow)]
struct ImageRow {
    uuid: String,
    name: String,
    version: String,
    os: String,
    image_type: String,
    description: Option<String>,
    state: String,
    public: i64,
    owner_uuid: String,
    published_at: Option<i64>,
    size: Option<i64>,
    sha256: Option<String>,
    tags: String,
    min_disk_gib: Option<i64>,
    bootrom: Option<String>,
    created_at: i64,
}

impl ImageRow {
    fn into_view(self) -> StoreResult<Image> {
        let corrupt = |what: &str| StoreError::Corrupt(format!("image {}: {what}", self.uuid));
        let tags: BTreeMap<String, String> =
            serde_json::from_str(&self.tags).map_err(|_| corrupt("tags"))?;
        let image_type: ImageType = self.image_type.parse().map_err(|_| corrupt("type"))?;
        let state = ImageState::parse(&self.state).ok_or_else(|| corrupt("state"))?;
        let sha256 = self
            .sha256
            .as_deref()
            .map(|s| s.parse::<Sha256>().map_err(|_| corrupt("sha256")))
            .transpose()?;
        let bootrom = self
            .bootrom
            .as_deref()
            .map(|b| Bootrom::parse(b).ok_or_else(|| corrupt("bootrom")))
            .transpose()?;
        Ok(Image {
            uuid: parse_uuid(&self.uuid, "image")?,
            name: self.name,
            version: self.version,
            os: self.os,
            image_type,
            description: self.description,
            state,
            public: self.public != 0,
            owner_uuid: parse_uuid(&self.owner_uuid, "image owner")?,
            published_at: self.published_at.map(to_time),
            size: self.size.and_then(|s| u64::try_from(s).ok()),
            sha256,
            tags,
            requirements: ImageRequirements {
                min_disk_gib: self.min_disk_gib.and_then(|g| u64::try_from(g).ok()),
                bootrom,
            },
            created_at: to_time(self.created_at),
            vm_count: None,
        })
    }
}

const COLS: &str = "uuid, name, version, os, image_type, description, state, public, \
    owner_uuid, published_at, size, sha256, tags, min_disk_gib, bootrom, created_at";

fn tags_text(tags: &BTreeMap<String, String>) -> StoreResult<String> {
    serde_json::to_string(tags).map_err(|e| StoreError::Corrupt(format!("image tags: {e}")))
}

fn gib(g: Option<u64>) -> Option<i64> {
    g.map(|g| i64::try_from(g).unwrap_or(i64::MAX))
}

pub struct NewImage<'a> {
    pub name: &'a str,
    pub version: &'a str,
    pub os: &'a str,
    pub image_type: ImageType,
    pub description: Option<&'a str>,
    pub public: bool,
    pub owner: AccountId,
    pub tags: &'a BTreeMap<String, String>,
    pub requirements: &'a ImageRequirements,
}

pub async fn insert(db: &Db, i: NewImage<'_>) -> StoreResult<Image> {
    let uuid = ImageId::new_random();
    let tags = tags_text(i.tags)?;
    on_write!(db, |c| sqlx::query(&format!(
        "INSERT INTO images ({COLS}) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, NULL, NULL, NULL, $10, $11, $12, $13)"
    ))
    .bind(uuid.to_string())
    .bind(i.name)
    .bind(i.version)
    .bind(i.os)
    .bind(i.image_type.as_str())
    .bind(i.description)
    .bind(ImageState::Unactivated.as_str())
    .bind(i64::from(i.public))
    .bind(i.owner.to_string())
    .bind(&tags)
    .bind(gib(i.requirements.min_disk_gib))
    .bind(i.requirements.bootrom.map(Bootrom::as_str))
    .bind(now_ms())
    .execute(c)
    .await
    .map(|r| r.rows_affected()))
    .map_err(|e| {
        unique_as_conflict(e, || {
            format!("image {:?} version {:?} exists", i.name, i.version)
        })
    })?;
    get(db, uuid).await
}

pub async fn get(db: &Db, uuid: ImageId) -> StoreResult<Image> {
    let row: Option<ImageRow> = on_read!(db, |c| sqlx::query_as(&format!(
        "SELECT {COLS} FROM images WHERE uuid = $1"
    ))
    .bind(uuid.to_string())
    .fetch_optional(c)
    .await)?;
    row.ok_or(StoreError::NotFound("image"))?.into_view()
}

/// Which images a list shows.
#[derive(Clone, Debug, Default)]
pub struct ImageFilter {
    pub name: Option<String>,
    pub version: Option<String>,
    pub state: Option<ImageState>,
    pub os: Option<String>,
    /// A tenant's view: active public images and the tenant's own (any state).
    pub visible_to: Option<AccountId>,
}

/// The WHERE clause of `f`, its parameters numbered from `$1`.
fn clause(f: &ImageFilter) -> (String, Vec<String>) {
    let mut conds = Vec::new();
    let mut args = Vec::new();
    let mut push = |cond: &str, v: String| {
        args.push(v);
        conds.push(cond.replace('?', &format!("${}", args.len())));
    };
    if let Some(n) = &f.name {
        push("name = ?", n.clone());
    }
    if let Some(v) = &f.version {
        push("version = ?", v.clone());
    }
    if let Some(s) = f.state {
        push("state = ?", s.as_str().to_string());
    }
    if let Some(o) = &f.os {
        push("os = ?", o.clone());
    }
    if let Some(a) = f.visible_to {
        push(
            "((public = 1 AND state = 'active') OR owner_uuid = ?)",
            a.to_string(),
        );
    }
    if conds.is_empty() {
        (String::new(), args)
    } else {
        (format!("WHERE {}", conds.join(" AND ")), args)
    }
}

/// Newest first (by creation), with the total matching.
pub async fn list(
    db: &Db,
    f: &ImageFilter,
    limit: i64,
    offset: i64,
) -> StoreResult<(Vec<Image>, i64)> {
    let (w, args) = clause(f);
    let n = args.len();
    let sql = format!(
        "SELECT {COLS} FROM images {w} ORDER BY created_at DESC, uuid DESC LIMIT ${} OFFSET ${}",
        n + 1,
        n + 2
    );
    let count = format!("SELECT COUNT(*) FROM images {w}");
    let rows: Vec<ImageRow> = on_read!(db, |c| {
        let mut q = sqlx::query_as(&sql);
        for a in &args {
            q = q.bind(a);
        }
        q.bind(limit).bind(offset).fetch_all(c).await
    })?;
    let total: i64 = on_read!(db, |c| {
        let mut q = sqlx::query_scalar(&count);
        for a in &args {
            q = q.bind(a);
        }
        q.fetch_one(c).await
    })?;
    Ok((
        rows.into_iter()
            .map(ImageRow::into_view)
            .collect::<StoreResult<_>>()?,
        total,
    ))
}

/// The newest active image named `name` (by publication) among those `f` lets through.
pub async fn newest_active(
    db: &Db,
    name: &str,
    visible_to: Option<AccountId>,
) -> StoreResult<Image> {
    let f = ImageFilter {
        name: Some(name.to_string()),
        state: Some(ImageState::Active),
        visible_to,
        ..ImageFilter::default()
    };
    let (w, args) = clause(&f);
    let sql = format!(
        "SELECT {COLS} FROM images {w} ORDER BY published_at DESC, created_at DESC LIMIT 1"
    );
    let row: Option<ImageRow> = on_read!(db, |c| {
        let mut q = sqlx::query_as(&sql);
        for a in &args {
            q = q.bind(a);
        }
        q.fetch_optional(c).await
    })?;
    row.ok_or(StoreError::NotFound("image"))?.into_view()
}

pub async fn by_name_version(db: &Db, name: &str, version: &str) -> StoreResult<Image> {
    let row: Option<ImageRow> = on_read!(db, |c| sqlx::query_as(&format!(
        "SELECT {COLS} FROM images WHERE name = $1 AND version = $2"
    ))
    .bind(name)
    .bind(version)
    .fetch_optional(c)
    .await)?;
    row.ok_or(StoreError::NotFound("image"))?.into_view()
}

/// An image with this file that a node may fetch: active, or disabled with VMs left.
pub async fn by_sha256(db: &Db, sha256: &Sha256) -> StoreResult<Option<Image>> {
    let row: Option<ImageRow> = on_read!(db, |c| sqlx::query_as(&format!(
        "SELECT {COLS} FROM images WHERE sha256 = $1 AND state IN ('active', 'disabled') \
         ORDER BY state ASC LIMIT 1"
    ))
    .bind(sha256.as_str())
    .fetch_optional(c)
    .await)?;
    row.map(ImageRow::into_view).transpose()
}

pub struct Changes<'a> {
    pub description: Option<&'a str>,
    pub public: Option<bool>,
    pub tags: Option<&'a BTreeMap<String, String>>,
    pub requirements: Option<&'a ImageRequirements>,
}

pub async fn update(db: &Db, uuid: ImageId, ch: Changes<'_>) -> StoreResult<Image> {
    let tags = ch.tags.map(tags_text).transpose()?;
    // COALESCE keeps what is not being changed; min_disk_gib and bootrom are set as a
    // whole with `requirements` (a flag says whether it is), since NULL is a value there.
    let n = on_write!(db, |c| sqlx::query(
        "UPDATE images SET description = COALESCE($2, description), \
         public = COALESCE($3, public), tags = COALESCE($4, tags), \
         min_disk_gib = CASE WHEN $5 = 1 THEN $6 ELSE min_disk_gib END, \
         bootrom = CASE WHEN $5 = 1 THEN $7 ELSE bootrom END \
         WHERE uuid = $1"
    )
    .bind(uuid.to_string())
    .bind(ch.description)
    .bind(ch.public.map(i64::from))
    .bind(tags)
    .bind(i64::from(ch.requirements.is_some()))
    .bind(gib(ch.requirements.and_then(|r| r.min_disk_gib)))
    .bind(ch.requirements.and_then(|r| r.bootrom).map(Bootrom::as_str))
    .execute(c)
    .await
    .map(|r| r.rows_affected()))?;
    if n == 0 {
        return Err(StoreError::NotFound("image"));
    }
    get(db, uuid).await
}

/// Claims `uuid` for one upload: only an image without a file (`unactivated` or `failed`)
/// and no upload under way (or one abandoned before `stale_before_ms`). `false`: another
/// upload holds it, or the image is not in a state to take a file.
pub async fn claim_upload(db: &Db, uuid: ImageId, stale_before_ms: i64) -> StoreResult<bool> {
    let n = on_write!(db, |c| sqlx::query(
        "UPDATE images SET uploading_since = $2 WHERE uuid = $1 \
         AND state IN ('unactivated', 'failed') \
         AND (uploading_since IS NULL OR uploading_since < $3)"
    )
    .bind(uuid.to_string())
    .bind(now_ms())
    .bind(stale_before_ms)
    .execute(c)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(n == 1)
}

/// Ends an upload without a file: the image goes to `state` (`unactivated` when the
/// client went away, `failed` when the file failed a check).
pub async fn release_upload(db: &Db, uuid: ImageId, state: ImageState) -> StoreResult<()> {
    on_write!(db, |c| sqlx::query(
        "UPDATE images SET uploading_since = NULL, state = $2 WHERE uuid = $1 \
         AND state IN ('unactivated', 'failed')"
    )
    .bind(uuid.to_string())
    .bind(state.as_str())
    .execute(c)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

/// Ends an upload with its checked file: the image is active.
pub async fn activate(db: &Db, uuid: ImageId, sha256: &Sha256, size: u64) -> StoreResult<Image> {
    let n = on_write!(db, |c| sqlx::query(
        "UPDATE images SET uploading_since = NULL, state = 'active', sha256 = $2, size = $3, \
         published_at = $4 WHERE uuid = $1 AND state IN ('unactivated', 'failed')"
    )
    .bind(uuid.to_string())
    .bind(sha256.as_str())
    .bind(i64::try_from(size).unwrap_or(i64::MAX))
    .bind(now_ms())
    .execute(c)
    .await
    .map(|r| r.rows_affected()))?;
    if n == 0 {
        // Deleted meanwhile.
        return Err(StoreError::NotFound("image"));
    }
    get(db, uuid).await
}

/// Is any image row (other than `except`) holding this file?
pub async fn file_in_use(db: &Db, sha256: &Sha256, except: Option<ImageId>) -> StoreResult<bool> {
    let except = except.map(|e| e.to_string()).unwrap_or_default();
    let n: i64 = on_read!(db, |c| sqlx::query_scalar(
        "SELECT COUNT(*) FROM images WHERE sha256 = $1 AND uuid <> $2 AND state <> 'failed'"
    )
    .bind(sha256.as_str())
    .bind(&except)
    .fetch_one(c)
    .await)?;
    Ok(n > 0)
}

/// VMs not yet destroyed that were built from `uuid`.
pub async fn live_vms(db: &Db, uuid: ImageId) -> StoreResult<i64> {
    Ok(on_read!(db, |c| sqlx::query_scalar(
        "SELECT COUNT(*) FROM vms WHERE image_uuid = $1 AND state <> 'destroyed'"
    )
    .bind(uuid.to_string())
    .fetch_one(c)
    .await)?)
}

/// VMs not yet destroyed built from each of `uuids`, in one query; an image no such VM
/// names is absent from the map.
pub async fn live_vm_counts(db: &Db, uuids: &[ImageId]) -> StoreResult<HashMap<ImageId, u64>> {
    if uuids.is_empty() {
        return Ok(HashMap::new());
    }
    let marks: Vec<String> = (1..=uuids.len()).map(|i| format!("${i}")).collect();
    let sql = format!(
        "SELECT image_uuid, COUNT(*) FROM vms \
         WHERE image_uuid IN ({}) AND state <> 'destroyed' GROUP BY image_uuid",
        marks.join(", ")
    );
    let rows: Vec<(String, i64)> = on_read!(db, |c| {
        let mut q = sqlx::query_as(&sql);
        for u in uuids {
            q = q.bind(u.to_string());
        }
        q.fetch_all(c).await
    })?;
    rows.into_iter()
        .map(|(u, n)| Ok((parse_uuid(&u, "image")?, u64::try_from(n).unwrap_or(0))))
        .collect()
}

/// Whether any VM row (destroyed or not) names `uuid`: then its record stays.
pub async fn any_vm(db: &Db, uuid: ImageId) -> StoreResult<bool> {
    let n: i64 = on_read!(db, |c| sqlx::query_scalar(
        "SELECT COUNT(*) FROM vms WHERE image_uuid = $1"
    )
    .bind(uuid.to_string())
    .fetch_one(c)
    .await)?;
    Ok(n > 0)
}

pub async fn disable(db: &Db, uuid: ImageId) -> StoreResult<()> {
    on_write!(db, |c| sqlx::query(
        "UPDATE images SET state = 'disabled', uploading_since = NULL WHERE uuid = $1"
    )
    .bind(uuid.to_string())
    .execute(c)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

pub async fn delete(db: &Db, uuid: ImageId) -> StoreResult<()> {
    let n = on_write!(db, |c| sqlx::query("DELETE FROM images WHERE uuid = $1")
        .bind(uuid.to_string())
        .execute(c)
        .await
        .map(|r| r.rows_affected()))?;
    if n == 0 {
        return Err(StoreError::NotFound("image"));
    }
    Ok(())
}

/// Files a stored image still needs: those of active images, and of disabled images with
/// a VM not yet destroyed. Every other file under the image directory may go.
pub async fn needed_files(db: &Db) -> StoreResult<Vec<String>> {
    Ok(on_read!(db, |c| sqlx::query_scalar(
        "SELECT DISTINCT sha256 FROM images i WHERE sha256 IS NOT NULL AND (state = 'active' \
         OR (state = 'disabled' AND EXISTS (SELECT 1 FROM vms v \
             WHERE v.image_uuid = i.uuid AND v.state <> 'destroyed')))"
    )
    .fetch_all(c)
    .await)?)
}
