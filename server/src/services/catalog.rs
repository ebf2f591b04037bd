//! Variants and packages: what the fleet offers.

use super::Ctx;
use super::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::store::{devices, packages, variants};
use passage_model::api::{
    CreatePackage, MAX_DEVICES_PER_VM, MAX_NAME_LEN, MAX_PACKAGE_DEVICE_KINDS, Package,
};
use passage_model::{PackageId, Variant};

fn check_variant(v: &Variant) -> ApiResult<()> {
    v.validate()
        .map_err(|e| ApiError::invalid(e.field(), e.to_string()))
}

async fn recompute(ctx: &Ctx) -> ApiResult<()> {
    let all = variants::list(&ctx.db).await?;
    let n = devices::recompute_variants(&ctx.db, &all).await?;
    tracing::info!(changed = n, "device variants recomputed");
    Ok(())
}

pub async fn create_variant(ctx: &Ctx, caller: &Caller, v: Variant) -> ApiResult<Variant> {
    caller.require_operator()?;
    check_variant(&v)?;
    variants::insert(&ctx.db, &v).await?;
    recompute(ctx).await?;
    Ok(variants::get(&ctx.db, &v.name).await?)
}

/// A name no variant can have names none: 404 before the store sees it.
fn known_shape(name: &str) -> ApiResult<()> {
    passage_model::variant::validate_name(name).map_err(|_| ApiError::not_found("variant"))
}

pub async fn put_variant(ctx: &Ctx, caller: &Caller, name: &str, v: Variant) -> ApiResult<Variant> {
    caller.require_operator()?;
    known_shape(name)?;
    check_variant(&v)?;
    if v.name != name {
        return Err(ApiError::conflict(
            "name: must equal the name in the URL (variants cannot be renamed)",
        ));
    }
    variants::update(&ctx.db, &v).await?;
    recompute(ctx).await?;
    Ok(variants::get(&ctx.db, name).await?)
}

pub async fn get_variant(ctx: &Ctx, caller: &Caller, name: &str) -> ApiResult<Variant> {
    caller.require_staff()?;
    known_shape(name)?;
    Ok(variants::get(&ctx.db, name).await?)
}

pub async fn list_variants(
    ctx: &Ctx,
    caller: &Caller,
    limit: i64,
    offset: i64,
) -> ApiResult<(Vec<Variant>, i64)> {
    caller.require_staff()?;
    Ok(variants::page(&ctx.db, limit, offset).await?)
}

pub async fn delete_variant(ctx: &Ctx, caller: &Caller, name: &str) -> ApiResult<()> {
    caller.require_operator()?;
    known_shape(name)?;
    variants::delete(&ctx.db, name).await?;
    recompute(ctx).await
}

pub async fn create_package(ctx: &Ctx, caller: &Caller, req: CreatePackage) -> ApiResult<Package> {
    caller.require_operator()?;
    let name_ok = !req.name.trim().is_empty()
        && req.name.chars().count() <= MAX_NAME_LEN
        && !req.name.chars().any(char::is_control);
    if !name_ok {
        return Err(ApiError::invalid(
            "name",
            format!("must be 1 to {MAX_NAME_LEN} printable characters"),
        ));
    }
    if req.name.parse::<uuid::Uuid>().is_ok() {
        return Err(ApiError::invalid(
            "name",
            "must not be a uuid (packages are looked up by uuid or name)",
        ));
    }
    if !(1..=1024).contains(&req.vcpus) {
        return Err(ApiError::invalid("vcpus", "must be 1 to 1024"));
    }
    if !(64..=16 * 1024 * 1024).contains(&req.memory_mib) {
        return Err(ApiError::invalid("memory_mib", "must be 64 to 16777216"));
    }
    if req.disk_gib > 1024 * 1024 {
        return Err(ApiError::invalid("disk_gib", "must be at most 1048576"));
    }
    if req.devices.len() > MAX_PACKAGE_DEVICE_KINDS {
        return Err(ApiError::invalid(
            "devices",
            format!("at most {MAX_PACKAGE_DEVICE_KINDS} variants"),
        ));
    }
    let known = variants::list(&ctx.db).await?;
    let mut total = 0u32;
    for (variant, count) in &req.devices {
        let field = format!("devices.{variant}");
        if !known.iter().any(|v| &v.name == variant) {
            return Err(ApiError::missing(field, "no such variant"));
        }
        if *count == 0 {
            return Err(ApiError::invalid(field, "count must be at least 1"));
        }
        total = total.saturating_add(*count);
    }
    if total > MAX_DEVICES_PER_VM {
        return Err(ApiError::invalid(
            "devices",
            format!("at most {MAX_DEVICES_PER_VM} devices per VM"),
        ));
    }
    Ok(packages::insert(
        &ctx.db,
        packages::NewPackage {
            name: req.name.trim(),
            vcpus: req.vcpus,
            memory_mib: req.memory_mib,
            disk_gib: req.disk_gib,
            devices: &req.devices,
            placement: req.placement,
        },
    )
    .await?)
}

/// Tenants may read packages: they choose from them.
pub async fn get_package(ctx: &Ctx, uuid: PackageId) -> ApiResult<Package> {
    Ok(packages::get(&ctx.db, uuid).await?)
}

/// By uuid or by name.
pub async fn find_package(ctx: &Ctx, key: &str) -> ApiResult<Package> {
    let p = ctx
        .packages
        .get_or_load(key, || async {
            match key.parse::<PackageId>() {
                Ok(id) => packages::get(&ctx.db, id).await,
                Err(_) => packages::by_name(&ctx.db, key).await,
            }
        })
        .await?;
    Ok(p)
}

pub async fn list_packages(ctx: &Ctx, limit: i64, offset: i64) -> ApiResult<(Vec<Package>, i64)> {
    Ok(packages::list(&ctx.db, limit, offset).await?)
}

pub async fn delete_package(ctx: &Ctx, caller: &Caller, uuid: PackageId) -> ApiResult<()> {
    caller.require_operator()?;
    let r = packages::delete(&ctx.db, uuid).await;
    ctx.packages.clear();
    Ok(r?)
}
