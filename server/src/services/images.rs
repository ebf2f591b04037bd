//! The image catalog: records, their files, and who may see and use them.
//!
//! Operators create, change and delete images and upload their files; tenants list and
//! read active public images and their own (an operator may create an image owned by a
//! tenant, private to it). Tenants do not create images themselves: a file from a tenant
//! would land on every node that boots it, which is an operator's call for now.
//!
//! Files live under the image directory by SHA-256, so two images with the same bytes
//! share one file. An upload streams to a temporary file in that directory, hashing on
//! the way, and becomes the image's file by an atomic rename only once checked; a client
//! that goes away, a wrong checksum or a bad format leaves no file behind. After a check
//! fails the image is `failed`; after an interruption it stays `unactivated`; either may
//! take a new upload.

use super::Ctx;
use super::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::store::images::{self as store, ImageFilter};
use axum::body::Body;
use futures_util::StreamExt;
use node_agent::images::sink::HashingSink;
use passage_model::images::{CreateImage, Image, ImageState, Sha256, UpdateImage, check_format};
use passage_model::{ErrorCode, ImageId};
use sha2::Digest;
use std::path::{Path, PathBuf};

/// An upload claim older than this is taken to be abandoned (its server died mid-upload)
/// and another upload may take the image over.
const STALE_UPLOAD_MS: i64 = 24 * 3600 * 1000;

pub fn image_dir(ctx: &Ctx) -> PathBuf {
    ctx.cfg
        .image_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("images"))
}

/// The stored file of a digest.
pub fn file_path(ctx: &Ctx, sha256: &Sha256) -> PathBuf {
    // A `Sha256` is 64 hex digits: no path separator can reach the file name.
    image_dir(ctx).join(sha256.as_str())
}

/// Whether `caller` may see `img`: staff see all; a tenant sees active public images and
/// its own.
fn visible(caller: &Caller, img: &Image) -> bool {
    caller.account.role.sees_all()
        || img.owner_uuid == caller.account.uuid
        || (img.public && img.state == ImageState::Active)
}

pub async fn create(ctx: &Ctx, caller: &Caller, req: CreateImage) -> ApiResult<Image> {
    caller.require_operator()?;
    req.validate()?;
    let owner = req.owner_uuid.unwrap_or(caller.account.uuid);
    if req.owner_uuid.is_some() {
        crate::store::accounts::get(&ctx.db, owner)
            .await
            .map_err(|_| ApiError::missing("owner_uuid", "no such account"))?;
    }
    Ok(store::insert(
        &ctx.db,
        store::NewImage {
            name: &req.name,
            version: &req.version,
            os: &req.os,
            image_type: req.image_type,
            description: req.description.as_deref(),
            public: req.public,
            owner,
            tags: &req.tags,
            requirements: &req.requirements,
        },
    )
    .await?)
}

/// An image by uuid: those the caller may list, and also one any of the caller's live
/// VMs was built from, whatever its state since (a disabled image stays readable to the
/// VMs' owners: `triton ssh` reads the VM's image for its default user).
pub async fn get(ctx: &Ctx, caller: &Caller, uuid: ImageId) -> ApiResult<Image> {
    let mut img = store::get(&ctx.db, uuid).await?;
    if !visible(caller, &img) && !uses(ctx, caller, uuid).await? {
        return Err(ApiError::not_found("image"));
    }
    count_vms(ctx, caller, std::slice::from_mut(&mut img)).await?;
    Ok(img)
}

/// Whether one of the caller's VMs not yet destroyed was built from `image`.
async fn uses(ctx: &Ctx, caller: &Caller, image: ImageId) -> ApiResult<bool> {
    let filter = crate::listing::VmFilter {
        owner: Some(caller.account.uuid),
        image: Some(image),
        live: true,
        ..Default::default()
    };
    let page =
        crate::store::vms::list(&ctx.db, &filter, &crate::listing::PageReq::offset(1, 0)).await?;
    Ok(!page.items.is_empty())
}

/// Fills in `vm_count` for staff, with one query for the whole page.
async fn count_vms(ctx: &Ctx, caller: &Caller, images: &mut [Image]) -> ApiResult<()> {
    if !caller.account.role.sees_all() {
        return Ok(());
    }
    let uuids: Vec<ImageId> = images.iter().map(|i| i.uuid).collect();
    let counts = store::live_vm_counts(&ctx.db, &uuids).await?;
    for img in images {
        img.vm_count = Some(counts.get(&img.uuid).copied().unwrap_or(0));
    }
    Ok(())
}

pub async fn list(
    ctx: &Ctx,
    caller: &Caller,
    mut filter: ImageFilter,
    limit: i64,
    offset: i64,
) -> ApiResult<(Vec<Image>, i64)> {
    filter.visible_to = (!caller.account.role.sees_all()).then_some(caller.account.uuid);
    let (mut items, total) = store::list(&ctx.db, &filter, limit, offset).await?;
    count_vms(ctx, caller, &mut items).await?;
    Ok((items, total))
}

pub async fn update(
    ctx: &Ctx,
    caller: &Caller,
    uuid: ImageId,
    req: UpdateImage,
) -> ApiResult<Image> {
    caller.require_operator()?;
    req.validate()?;
    let r = store::update(
        &ctx.db,
        uuid,
        store::Changes {
            description: req.description.as_deref(),
            public: req.public,
            tags: req.tags.as_ref(),
            requirements: req.requirements.as_ref(),
        },
    )
    .await;
    ctx.images.clear();
    Ok(r?)
}

/// An image no VM was built from goes (record and, unless another image shares it, its
/// file); one that VMs were built from becomes `disabled` and stays readable, and its
/// file goes once the last of those VMs is destroyed ([`release_file`]).
pub async fn delete(ctx: &Ctx, caller: &Caller, uuid: ImageId) -> ApiResult<()> {
    caller.require_operator()?;
    let img = store::get(&ctx.db, uuid).await?;
    let gone = if store::any_vm(&ctx.db, uuid).await? {
        store::disable(&ctx.db, uuid).await
    } else {
        store::delete(&ctx.db, uuid).await
    };
    ctx.images.clear();
    gone?;
    if let Some(sha) = &img.sha256 {
        release_file(ctx, sha).await?;
    }
    Ok(())
}

/// Removes the file of `sha256` when no image needs it any more (no active image has it,
/// and no disabled one with a VM not yet destroyed). Called after a delete and after a
/// VM's destroy.
pub async fn release_file(ctx: &Ctx, sha256: &Sha256) -> ApiResult<()> {
    let needed = store::needed_files(&ctx.db).await?;
    if needed.iter().any(|s| s == sha256.as_str()) {
        return Ok(());
    }
    match tokio::fs::remove_file(file_path(ctx, sha256)).await {
        Ok(()) => {
            tracing::info!(sha256 = %sha256, "image file removed: no image needs it");
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(ApiError::internal(format!(
            "removing image file {sha256}: {e}"
        ))),
    }
}

/// After a VM built from `image` is destroyed: its image's file may go.
pub async fn vm_destroyed(ctx: &Ctx, image: Option<ImageId>) {
    let Some(image) = image else { return };
    // Through the images' cache, and nothing more for an active image (its file stays):
    // a fleet's destroys read the image and then every image's file, two reads per VM.
    // A replica that disabled it within the cache's second leaves the file to the next
    // destroy or to the image's deletion.
    let key = image.to_string();
    let Ok(img) = ctx
        .images
        .get_or_load(&key, || store::get(&ctx.jobs_db, image))
        .await
    else {
        return;
    };
    if img.state == ImageState::Active {
        return;
    }
    if let Some(sha) = &img.sha256
        && let Err(e) = release_file(ctx, sha).await
    {
        tracing::warn!(error = %e, %image, "could not release an image file");
    }
}

/// What an upload holds until it ends: its claim on the image and its temporary file.
/// Dropped before [`Upload::finish`] (the client went away, the handler was cancelled, a
/// check failed), it removes the file and gives the claim back.
struct Upload {
    ctx: Ctx,
    uuid: ImageId,
    tmp: Option<PathBuf>,
    /// The state the image returns to if the upload ends without a file.
    fallback: ImageState,
    finished: bool,
}

impl Drop for Upload {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if let Some(tmp) = self.tmp.take()
            && let Err(e) = std::fs::remove_file(&tmp)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(error = %e, path = %tmp.display(), "could not remove an upload's file");
        }
        let (ctx, uuid, state) = (self.ctx.clone(), self.uuid, self.fallback);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Err(e) = store::release_upload(&ctx.db, uuid, state).await {
                    tracing::warn!(error = %e, %uuid, "could not release an upload claim");
                }
            });
        }
    }
}

fn io_error(what: &str, e: std::io::Error) -> ApiError {
    ApiError::internal(format!("{what}: {e}"))
}

/// `PUT /v1/images/{uuid}/file`: the body, streamed to disk, becomes the image's file.
pub async fn upload(
    ctx: &Ctx,
    caller: &Caller,
    uuid: ImageId,
    expected: Option<Sha256>,
    content_length: Option<u64>,
    body: Body,
) -> ApiResult<Image> {
    caller.require_operator()?;
    let img = store::get(&ctx.db, uuid).await?;
    if matches!(img.state, ImageState::Active | ImageState::Disabled) {
        return Err(ApiError::invalid_state(format!(
            "image {uuid} is {}: its file cannot change (create a new version)",
            img.state.as_str()
        )));
    }
    let max = ctx.cfg.image_max_bytes;
    if content_length.is_some_and(|n| n > max) {
        return Err(too_large(max));
    }
    if !store::claim_upload(&ctx.db, uuid, crate::store::now_ms() - STALE_UPLOAD_MS).await? {
        return Err(ApiError::conflict(format!(
            "an upload of image {uuid} is under way"
        )));
    }
    let dir = image_dir(ctx);
    let tmp = dir.join(format!(".upload-{uuid}-{}", uuid::Uuid::new_v4().simple()));
    let mut up = Upload {
        ctx: ctx.clone(),
        uuid,
        tmp: Some(tmp.clone()),
        fallback: ImageState::Unactivated,
        finished: false,
    };
    match receive(ctx, &img, &mut up, &dir, &tmp, expected, body).await {
        Ok(img) => Ok(img),
        Err(e) => {
            // Answered only once the file is gone and the claim given back, so that the
            // client's next call sees both (`Drop` covers a cancelled handler).
            if let Some(tmp) = up.tmp.take()
                && let Err(io) = tokio::fs::remove_file(&tmp).await
                && io.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(error = %io, path = %tmp.display(), "could not remove an upload's file");
            }
            store::release_upload(&ctx.db, uuid, up.fallback).await?;
            up.finished = true;
            Err(e)
        }
    }
}

/// The body into `tmp`, checked, then renamed into place and the image activated.
async fn receive(
    ctx: &Ctx,
    img: &Image,
    up: &mut Upload,
    dir: &Path,
    tmp: &Path,
    expected: Option<Sha256>,
    body: Body,
) -> ApiResult<Image> {
    let uuid = img.uuid;
    let max = ctx.cfg.image_max_bytes;
    let file = tokio::fs::File::create(tmp)
        .await
        .map_err(|e| io_error("creating an upload file", e))?;
    // Written and hashed on threads of their own while this task reads the socket.
    let mut sink = HashingSink::start(file.into_std().await, sha2::Sha256::new());
    let mut size: u64 = 0;
    let mut head: Vec<u8> = Vec::with_capacity(8);
    let mut stream = body.into_data_stream();
    let mut received = Ok(());
    while let Some(chunk) = stream.next().await {
        // An error here is the client's connection failing mid-body: the image stays
        // unactivated (`up` cleans up as it drops).
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                received = Err(ApiError::invalid(
                    "body",
                    format!("the upload was cut short: {e}"),
                ));
                break;
            }
        };
        size = size.saturating_add(chunk.len() as u64);
        if size > max {
            received = Err(too_large(max));
            break;
        }
        if head.len() < 8 {
            let take = (8 - head.len()).min(chunk.len());
            head.extend_from_slice(&chunk[..take]);
        }
        if sink.push(chunk).await.is_err() {
            // The writer stopped: `finish` says why.
            break;
        }
    }
    // Both threads are done with the file before anything else happens to it.
    let finished = sink.finish().await;
    received?;
    let (file, hasher) = finished.map_err(|e| io_error("writing an upload file", e))?;
    tokio::task::spawn_blocking(move || file.sync_all())
        .await
        .map_err(|e| ApiError::internal(format!("syncing an upload file: {e}")))?
        .map_err(|e| io_error("syncing an upload file", e))?;
    let digest: [u8; 32] = hasher.finalize().into();
    let sha = Sha256::from_bytes(&digest);
    if let Some(want) = expected
        && want != sha
    {
        up.fallback = ImageState::Failed;
        return Err(ApiError::invalid(
            "x-content-sha256",
            format!("the file's SHA-256 is {sha}, not {want}"),
        ));
    }
    if let Err(why) = check_format(img.image_type, &head, size) {
        up.fallback = ImageState::Failed;
        return Err(ApiError::invalid("type", why));
    }
    let dest = file_path(ctx, &sha);
    // Same name, same bytes: a file already there (another image's) is replaced by an
    // equal one, atomically.
    tokio::fs::rename(tmp, &dest)
        .await
        .map_err(|e| io_error("moving an upload into place", e))?;
    up.tmp = None;
    sync_dir(dir).await;
    let activated = store::activate(&ctx.db, uuid, &sha, size).await;
    ctx.images.clear();
    match activated {
        Ok(img) => {
            up.finished = true;
            tracing::info!(%uuid, sha256 = %sha, size, "image active");
            Ok(img)
        }
        Err(e) => {
            // Deleted while uploading: the file may have no image now.
            release_file(ctx, &sha).await?;
            Err(e.into())
        }
    }
}

fn too_large(max: u64) -> ApiError {
    ApiError::new(
        ErrorCode::PayloadTooLarge,
        format!("an image file may have at most {max} bytes"),
    )
}

/// Makes a rename in `dir` durable (best effort: not every filesystem allows it).
async fn sync_dir(dir: &Path) {
    let dir = dir.to_path_buf();
    let _ =
        tokio::task::spawn_blocking(move || std::fs::File::open(&dir).and_then(|d| d.sync_all()))
            .await;
}

/// An open image file and its length, for streaming out.
pub struct ImageFile {
    pub file: tokio::fs::File,
    pub len: u64,
    pub image: Image,
}

/// `GET /v1/images/{uuid}/file`: whoever may see an image may download its file.
pub async fn open_file(ctx: &Ctx, caller: &Caller, uuid: ImageId) -> ApiResult<ImageFile> {
    let img = get(ctx, caller, uuid).await?;
    let Some(sha) = img.sha256.clone() else {
        return Err(ApiError::invalid_state(format!(
            "image {uuid} has no file yet"
        )));
    };
    open_sha(ctx, &sha, img).await
}

async fn open_sha(ctx: &Ctx, sha: &Sha256, image: Image) -> ApiResult<ImageFile> {
    let path = file_path(ctx, sha);
    let file = tokio::fs::File::open(&path).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            ApiError::not_found("image file")
        } else {
            io_error("opening an image file", e)
        }
    })?;
    let len = file
        .metadata()
        .await
        .map_err(|e| io_error("reading an image file's size", e))?
        .len();
    Ok(ImageFile { file, len, image })
}

/// The agent's download: the file of an active (or disabled, still in use) image.
pub async fn open_for_agent(ctx: &Ctx, sha: &Sha256) -> ApiResult<ImageFile> {
    let image = store::by_sha256(&ctx.db, sha)
        .await?
        .ok_or_else(|| ApiError::not_found("image"))?;
    open_sha(ctx, sha, image).await
}

/// A key as `POST /v1/vms` takes it: a uuid, `name@version`, or `name` (its newest active
/// version). Only active images the caller may see; anything else is 404 naming `image`.
pub async fn resolve(ctx: &Ctx, caller: &Caller, key: &str) -> ApiResult<Image> {
    let missing = || ApiError::missing("image", format!("no usable image {key:?}"));
    // Through the cache job steps read images by (by uuid, under the same key): a burst
    // of creations from one image reads it once, and every image write here clears it.
    let found = if let Ok(uuid) = key.parse::<ImageId>() {
        ctx.images
            .get_or_load(&uuid.to_string(), || store::get(&ctx.db, uuid))
            .await
    } else {
        match passage_model::images::split_image_key(key) {
            (name, Some(version)) => {
                ctx.images
                    .get_or_load(&format!("version\0{name}\0{version}"), || {
                        store::by_name_version(&ctx.db, name, version)
                    })
                    .await
            }
            (name, None) => {
                let scope = (!caller.account.role.sees_all()).then_some(caller.account.uuid);
                // NULs part the fields: no uuid and no image name holds one.
                let cache_key = match scope {
                    Some(a) => format!("newest\0{name}\0{a}"),
                    None => format!("newest\0{name}\0"),
                };
                ctx.images
                    .get_or_load(&cache_key, || store::newest_active(&ctx.db, name, scope))
                    .await
            }
        }
    };
    let img = match found {
        Ok(img) => img,
        Err(crate::store::StoreError::NotFound(_)) => return Err(missing()),
        Err(e) => return Err(e.into()),
    };
    if img.state != ImageState::Active || !visible(caller, &img) {
        return Err(missing());
    }
    Ok(img)
}
