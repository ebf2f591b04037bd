//! Variants and packages: what the fleet offers.

use super::Ctx;
use super::audit::AuditDetail;
use super::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::store::{devices, packages, variants};
use passage_model::api::{CreatePackage, Package};
use passage_model::variant::ScrubPolicy;
use passage_model::{PackageId, Variant};

fn check_variant(v: &Variant) -> ApiResult<()> {
    v.validate()
        .map_err(|e| ApiError::invalid(e.field(), e.to_string()))
}

async fn recompute(ctx: &Ctx) -> ApiResult<()> {
    let n = devices::recompute_variants(&ctx.db).await?;
    tracing::info!(changed = n, "device variants recomputed");
    Ok(())
}

/// A vGPU variant's parent must be a GPU variant that exists; the vGPU variant takes its
/// ids. A VF variant's parent must be a variant of whole functions that are not GPUs (a
/// GPU's VFs are its vGPUs). A variant that is a parent keeps the type its children need.
async fn resolve_parent(ctx: &Ctx, v: &mut Variant) -> ApiResult<()> {
    use passage_model::variant::DeviceType;
    if let Some(name) = &v.parent {
        let parent = match variants::get(&ctx.db, name).await {
            Ok(p) => p,
            Err(crate::store::StoreError::NotFound(_)) => {
                return Err(ApiError::invalid(
                    "parent",
                    format!("no variant is named {name:?}"),
                ));
            }
            Err(e) => return Err(e.into()),
        };
        if v.is_vf() {
            if matches!(
                parent.kind,
                DeviceType::Gpu | DeviceType::Vgpu | DeviceType::Vf
            ) {
                return Err(ApiError::invalid(
                    "parent",
                    format!(
                        "variant {name:?} is of type {}: VF variants are for other devices' \
                         functions (a GPU's VFs are its vGPUs: use a vgpu variant)",
                        parent.kind.as_str()
                    ),
                ));
            }
        } else {
            if parent.kind != DeviceType::Gpu {
                return Err(ApiError::invalid(
                    "parent",
                    format!("variant {name:?} is not a GPU variant (type gpu)"),
                ));
            }
            v.vendor = parent.vendor;
            v.device = parent.device;
            v.subvendor = parent.subvendor;
            v.subsystem = parent.subsystem;
            v.revision = parent.revision;
        }
    }
    for child in variants::list(&ctx.db).await? {
        if child.parent.as_deref() != Some(v.name.as_str()) {
            continue;
        }
        let fits = match child.kind {
            DeviceType::Vgpu => v.kind == DeviceType::Gpu,
            _ => !matches!(v.kind, DeviceType::Gpu | DeviceType::Vgpu | DeviceType::Vf),
        };
        if !fits {
            return Err(ApiError::conflict(format!(
                "type: variant {:?} is the parent of {} variant {:?} and keeps a type \
                 that can be",
                v.name,
                child.kind.as_str(),
                child.name
            )));
        }
    }
    Ok(())
}

/// What the audit log says of a variant's scrub policy set or changed (the method and
/// path alone would not tell that an operator chose to leave GPU memory uncleared).
fn policy_detail(old: Option<ScrubPolicy>, new: &Variant) -> Option<AuditDetail> {
    let was = old.unwrap_or_default();
    if old.is_some() && was == new.scrub_policy {
        return None;
    }
    if old.is_none() && new.scrub_policy == ScrubPolicy::Full {
        return None;
    }
    let effect = match new.scrub_policy {
        ScrubPolicy::ResetOnly => "GPU memory is no longer cleared between tenants",
        ScrubPolicy::Full => "GPU memory is zeroed and verified between tenants",
    };
    Some(AuditDetail(format!(
        "variant {:?}: scrub_policy {} -> {} ({effect})",
        new.name,
        was.as_str(),
        new.scrub_policy.as_str()
    )))
}

/// Creates a variant; answers it and, when its scrub policy is not the default, what
/// the audit log records of that.
pub async fn create_variant(
    ctx: &Ctx,
    caller: &Caller,
    mut v: Variant,
) -> ApiResult<(Variant, Option<AuditDetail>)> {
    caller.require_operator()?;
    check_variant(&v)?;
    resolve_parent(ctx, &mut v).await?;
    variants::insert(&ctx.db, &v).await?;
    recompute(ctx).await?;
    if v.is_vf() {
        crate::workflows::sriov::spawn_everywhere(ctx, true);
    }
    let detail = policy_detail(None, &v);
    Ok((variants::get(&ctx.db, &v.name).await?, detail))
}

/// A name no variant can have names none: 404 before the store sees it.
fn known_shape(name: &str) -> ApiResult<()> {
    passage_model::variant::validate_name(name).map_err(|_| ApiError::not_found("variant"))
}

/// Replaces a variant; answers it and, when its scrub policy changed, what the audit log
/// records of that.
pub async fn put_variant(
    ctx: &Ctx,
    caller: &Caller,
    name: &str,
    mut v: Variant,
) -> ApiResult<(Variant, Option<AuditDetail>)> {
    caller.require_operator()?;
    known_shape(name)?;
    check_variant(&v)?;
    if v.name != name {
        return Err(ApiError::conflict(
            "name: must equal the name in the URL (variants cannot be renamed)",
        ));
    }
    resolve_parent(ctx, &mut v).await?;
    // GPUs host slots of the type and parent they were opened for: those stay while any do.
    let old = variants::get(&ctx.db, name).await?;
    if (old.kind != v.kind || old.parent != v.parent || old.vgpu_type != v.vgpu_type)
        && variants::slots_of(&ctx.db, name).await? > 0
    {
        return Err(ApiError::conflict(format!(
            "vgpu_type: GPUs host vGPUs of variant {name:?}; its type, parent and vGPU type \
             stay until they are gone (max_per_gpu applies to GPUs opened from now on)"
        )));
    }
    // A function's VFs are made for the count and the parent asked: they stay while a VM
    // holds one (changing the count destroys every VF of the function).
    let vf_change = old.num_vfs != v.num_vfs || old.parent != v.parent || old.kind != v.kind;
    if old.is_vf() && vf_change && variants::busy_devices(&ctx.db, name).await? > 0 {
        return Err(ApiError::conflict(format!(
            "num_vfs: VMs hold VFs of variant {name:?} (or they are being cleaned); its \
             count, parent and type stay until they are free"
        )));
    }
    variants::update(&ctx.db, &v).await?;
    recompute(ctx).await?;
    if old.is_vf() || v.is_vf() {
        crate::workflows::sriov::spawn_everywhere(ctx, true);
    }
    if old.scrub_policy != v.scrub_policy {
        tracing::info!(variant = %name, from = old.scrub_policy.as_str(),
            to = v.scrub_policy.as_str(), by = %caller.account.login, "scrub policy changed");
    }
    let detail = policy_detail(Some(old.scrub_policy), &v);
    Ok((variants::get(&ctx.db, name).await?, detail))
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
    let old = variants::get(&ctx.db, name).await?;
    variants::delete(&ctx.db, name).await?;
    recompute(ctx).await?;
    if old.is_vf() {
        crate::workflows::sriov::spawn_everywhere(ctx, true);
    }
    Ok(())
}

pub async fn create_package(ctx: &Ctx, caller: &Caller, req: CreatePackage) -> ApiResult<Package> {
    caller.require_operator()?;
    let known = variants::list(&ctx.db).await?;
    req.validate(|name| known.iter().any(|v| v.name == name))?;
    Ok(packages::insert(
        &ctx.db,
        packages::NewPackage {
            name: req.name.trim(),
            vcpus: req.vcpus,
            memory_mib: req.memory_mib,
            disk_gib: req.disk_gib,
            devices: &req.devices,
            placement: req.placement,
            stop_grace_s: req.stop_grace_s,
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
