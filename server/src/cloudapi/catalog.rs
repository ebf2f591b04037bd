//! What a machine is made from and who makes it: the account, its SSH keys, packages,
//! images and networks.

use super::shapes::{CloudAccount, CloudImage, CloudKey, CloudNetwork, CloudPackage};
use super::{CloudError, CloudResult, Signed, body_object, page, path_id, query_pairs};
use crate::error::ApiError;
use crate::services::{Ctx, catalog, images, keys, networks};
use crate::store::images::ImageFilter;
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use passage_model::images::ImageState;
use passage_model::keys::CreateSshKey;
use passage_model::{ImageId, NetworkId, PackageId};

/// Everything of a kind in one answer: CloudAPI's catalogue lists are not paged.
const ALL: i64 = passage_model::api::MAX_LIST_LIMIT as i64;

pub async fn account(Signed { caller }: Signed) -> Response {
    Json(CloudAccount::from(&caller.account)).into_response()
}

pub async fn list_keys(State(ctx): State<Ctx>, Signed { caller }: Signed) -> CloudResult<Response> {
    let (items, _) = keys::list(&ctx, &caller, caller.account.uuid, ALL, 0).await?;
    Ok(page(items.into_iter().map(CloudKey::from).collect()))
}

pub async fn create_key(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    headers: HeaderMap,
    body: Bytes,
) -> CloudResult<Response> {
    let mut b = body_object(&headers, &body)?;
    let text = |b: &mut serde_json::Map<String, serde_json::Value>, k: &str| match b.remove(k) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(CloudError(ApiError::invalid(k, "must be a string"))),
    };
    let key = text(&mut b, "key")?
        .ok_or_else(|| CloudError(ApiError::invalid("key", "the public key is required")))?;
    let name = text(&mut b, "name")?.filter(|n| !n.is_empty());
    if let Some(k) = b.keys().next() {
        return Err(CloudError(ApiError::invalid(
            k.as_str(),
            "is not a field of a key (name, key)",
        )));
    }
    let k = keys::create(
        &ctx,
        &caller,
        caller.account.uuid,
        CreateSshKey { name, key },
    )
    .await?;
    Ok((StatusCode::CREATED, Json(CloudKey::from(k))).into_response())
}

/// A key by its name, or by its MD5 fingerprint as CloudAPI also allows.
async fn find_key(
    ctx: &Ctx,
    caller: &crate::services::auth::Caller,
    name: &str,
) -> CloudResult<passage_model::keys::SshKey> {
    match keys::get(ctx, caller, caller.account.uuid, name).await {
        Ok(k) => Ok(k),
        Err(e) if e.code == passage_model::ErrorCode::ResourceNotFound => {
            let md5 = name
                .strip_prefix("MD5:")
                .unwrap_or(name)
                .to_ascii_lowercase();
            crate::store::keys::by_md5(&ctx.db, caller.account.uuid, &md5)
                .await
                .map_err(|_| CloudError(ApiError::not_found("key")))
        }
        Err(e) => Err(e.into()),
    }
}

pub async fn get_key(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, name)): Path<(String, String)>,
) -> CloudResult<Response> {
    let k = find_key(&ctx, &caller, &name).await?;
    Ok(Json(CloudKey::from(k)).into_response())
}

pub async fn delete_key(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, name)): Path<(String, String)>,
) -> CloudResult<StatusCode> {
    let k = find_key(&ctx, &caller, &name).await?;
    keys::delete(&ctx, &caller, caller.account.uuid, &k.name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Packages, by the filters the CLI passes on (`name`, `memory`, `disk`, `vcpus`).
pub async fn list_packages(State(ctx): State<Ctx>, _: Signed, uri: Uri) -> CloudResult<Response> {
    let q = query_pairs(uri.query())?;
    let (items, _) = catalog::list_packages(&ctx, ALL, 0).await?;
    let mut out: Vec<CloudPackage> = items.iter().map(CloudPackage::from).collect();
    for (k, v) in &q {
        match k.as_str() {
            "name" => out.retain(|p| p.name == *v),
            "memory" => out.retain(|p| p.memory.to_string() == *v),
            "disk" => out.retain(|p| p.disk.to_string() == *v),
            "vcpus" => out.retain(|p| p.vcpus.to_string() == *v),
            _ => {}
        }
    }
    // Oldest first, as CloudAPI lists them.
    out.reverse();
    Ok(page(out))
}

pub async fn get_package(
    State(ctx): State<Ctx>,
    _: Signed,
    Path((_, raw)): Path<(String, String)>,
) -> CloudResult<Response> {
    // CloudAPI takes a package's name here too.
    let p = match raw.parse::<PackageId>() {
        Ok(id) => catalog::get_package(&ctx, id).await?,
        Err(_) => catalog::find_package(&ctx, &raw).await?,
    };
    Ok(Json(CloudPackage::from(&p)).into_response())
}

/// Images the account may use, oldest first (ascending `published_at`): the `triton` CLI
/// takes the last of several of one name as the newest. `state` is `active` unless
/// given (`all` for every state); `name`, `version`, `os` and `type` filter.
pub async fn list_images(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    uri: Uri,
) -> CloudResult<Response> {
    let q = query_pairs(uri.query())?;
    let get = |k: &str| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let state = match get("state").as_deref() {
        None => Some(ImageState::Active),
        Some("all") => None,
        Some(s) => Some(ImageState::parse(s).ok_or_else(|| {
            CloudError(ApiError::invalid(
                "state",
                format!("{s:?} is not an image state (active, unactivated, disabled, failed, all)"),
            ))
        })?),
    };
    let filter = ImageFilter {
        name: get("name"),
        version: get("version"),
        state,
        os: get("os"),
        visible_to: None,
    };
    let (mut items, _) = images::list(&ctx, &caller, filter, ALL, 0).await?;
    if let Some(t) = get("type")
        && t != "zvol"
    {
        items.clear();
    }
    items.sort_by_key(|i| (i.published_at.unwrap_or(i.created_at), i.created_at));
    Ok(page(items.iter().map(CloudImage::from).collect()))
}

pub async fn get_image(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw)): Path<(String, String)>,
) -> CloudResult<Response> {
    let id: ImageId = path_id(&raw, "image")?;
    let i = images::get(&ctx, &caller, id).await?;
    Ok(Json(CloudImage::from(&i)).into_response())
}

pub async fn list_networks(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
) -> CloudResult<Response> {
    let (items, _) = networks::list(&ctx, &caller, ALL, 0).await?;
    Ok(page(items.iter().map(CloudNetwork::from).collect()))
}

pub async fn get_network(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw)): Path<(String, String)>,
) -> CloudResult<Response> {
    let id: NetworkId = path_id(&raw, "network")?;
    let n = networks::get(&ctx, &caller, id).await?;
    Ok(Json(CloudNetwork::from(&n)).into_response())
}
