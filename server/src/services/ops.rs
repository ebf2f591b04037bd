//! Operator views and actions: capacity, alerts, usage, the audit log, device actions,
//! placement dry runs.

use super::Ctx;
use super::auth::Caller;
use super::catalog;
use crate::error::{ApiError, ApiResult};
use crate::placement;
use crate::store::{self, devices, ops, servers};
use crate::workflows;
use chrono::{DateTime, Utc};
use passage_model::api::{
    Alert, AuditEntry, Capacity, DeviceAction, DeviceActionRequest, DeviceEventRecord,
    PlacementExplanation, Usage,
};
use passage_model::{AccountId, DeviceEvent, ServerId};
use std::collections::BTreeMap;

pub async fn capacity(ctx: &Ctx, caller: &Caller) -> ApiResult<Vec<Capacity>> {
    caller.require_staff()?;
    Ok(ops::capacity(&ctx.db, ctx.alive_after_ms()).await?)
}

pub async fn alerts(
    ctx: &Ctx,
    caller: &Caller,
    limit: i64,
    offset: i64,
) -> ApiResult<(Vec<Alert>, i64)> {
    caller.require_staff()?;
    Ok(ops::alerts(&ctx.db, limit, offset).await?)
}

pub async fn audit(
    ctx: &Ctx,
    caller: &Caller,
    limit: i64,
    offset: i64,
) -> ApiResult<(Vec<AuditEntry>, i64)> {
    caller.require_staff()?;
    Ok(ops::audit_log(&ctx.db, limit, offset).await?)
}

/// GPU-hours in `[from, to)` (default: the last 30 days): a tenant's own, or anyone's for
/// operators.
pub async fn usage(
    ctx: &Ctx,
    caller: &Caller,
    owner: Option<AccountId>,
    from: Option<DateTime<Utc>>,
    to: Option<DateTime<Utc>>,
) -> ApiResult<Usage> {
    let owner = if caller.account.role.sees_all() {
        owner
    } else {
        if owner.is_some_and(|o| o != caller.account.uuid) {
            return Err(ApiError::not_found("account"));
        }
        Some(caller.account.uuid)
    };
    let to = to.unwrap_or_else(Utc::now);
    let from = from.unwrap_or(to - chrono::Duration::days(30));
    // A reversed range is empty: no usage in it.
    let to = to.max(from);
    let records = ops::usage(
        &ctx.db,
        owner,
        from.timestamp_millis(),
        to.timestamp_millis(),
    )
    .await?;
    let mut by_variant: BTreeMap<String, f64> = BTreeMap::new();
    for r in &records {
        *by_variant
            .entry(r.variant.clone().unwrap_or_else(|| "-".into()))
            .or_default() += r.gpu_hours;
    }
    Ok(Usage {
        from,
        to,
        gpu_hours: records.iter().map(|r| r.gpu_hours).sum(),
        by_variant,
        records,
    })
}

/// Disable, enable, quarantine or requeue one device; the reason goes in its history.
pub async fn device_action(
    ctx: &Ctx,
    caller: &Caller,
    server: ServerId,
    req: DeviceActionRequest,
) -> ApiResult<Vec<DeviceEventRecord>> {
    caller.require_operator()?;
    let reason = req.reason.trim();
    if reason.is_empty() || reason.chars().count() > 512 {
        return Err(ApiError::invalid("reason", "must be 1 to 512 characters"));
    }
    servers::get(&ctx.db, server).await?;
    let id = req.device.to_string();
    let rec = devices::for_server(&ctx.db, server)
        .await?
        .into_iter()
        .find(|d| d.pci.id == req.device && d.variant.is_some())
        .ok_or_else(|| ApiError::not_found("device"))?;
    let why = format!("{:?} by {}: {reason}", req.action, caller.account.login).to_lowercase();
    let event = match req.action {
        DeviceAction::ClearTaint => return clear_taint(ctx, server, &id, rec.missing, &why).await,
        DeviceAction::Disable => DeviceEvent::Disable,
        DeviceAction::Enable => DeviceEvent::Enable,
        DeviceAction::Quarantine => DeviceEvent::Quarantine,
        DeviceAction::Requeue => DeviceEvent::Requeue,
    };
    // Quarantining a device under a live VM would take it from the VM's owner silently.
    if rec.state.is_held() {
        return Err(ApiError::invalid_state(format!(
            "the device is {} by a VM; destroy the VM first",
            rec.state
        )));
    }
    let moved = devices::move_devices(
        &ctx.db,
        server,
        std::slice::from_ref(&id),
        event,
        None,
        &why,
    )
    .await?;
    if moved.is_empty() {
        return Err(ApiError::invalid_state(format!(
            "a device in state {} cannot be given {:?}",
            rec.state, req.action
        )));
    }
    if event == DeviceEvent::Requeue {
        workflows::scrub::start_job(ctx, server, std::slice::from_ref(&id)).await?;
    }
    Ok(store::events::device_events(&ctx.db, server, Some(&id), None).await?)
}

async fn clear_taint(
    ctx: &Ctx,
    server: ServerId,
    id: &str,
    missing: bool,
    why: &str,
) -> ApiResult<Vec<DeviceEventRecord>> {
    if missing {
        return Err(ApiError::invalid_state(
            "the device is missing from its node's reports; it clears when it is seen again",
        ));
    }
    if !devices::clear_taint(&ctx.db, server, id).await? {
        return Err(ApiError::invalid_state("the device has no taint"));
    }
    tracing::info!(%server, device = %id, %why, "taint cleared");
    Ok(store::events::device_events(&ctx.db, server, Some(id), None).await?)
}

/// Where a package would go now, and why every other server would not.
pub async fn dry_run(ctx: &Ctx, caller: &Caller, package: &str) -> ApiResult<PlacementExplanation> {
    caller.require_staff()?;
    let package = catalog::find_package(ctx, package)
        .await
        .map_err(|_| ApiError::missing("package", "no such package"))?;
    let (all, _) = servers::list(&ctx.db, 100_000, 0).await?;
    let variants: Vec<String> = package.devices.keys().cloned().collect();
    // Every unassigned, untainted device of the variants, whatever its server's status:
    // the explanation names the server's status itself.
    let mut cands = devices::candidates(&ctx.db, &variants, i64::MIN).await?;
    let windows = devices::candidate_windows(&ctx.db, &variants).await?;
    for c in &mut cands {
        c.window = windows.get(&(c.server_uuid, c.id.clone())).copied();
    }
    let rooms = store::room::rooms(&ctx.db, None, ctx.cfg.alloc).await?;
    let mut hosts = store::room::host_rooms(&ctx.db, None, ctx.cfg.alloc).await?;
    let infos: Vec<placement::ServerInfo> = all
        .iter()
        .map(|s| placement::ServerInfo {
            uuid: s.uuid,
            hostname: s.hostname.clone(),
            running: s
                .last_heartbeat
                .is_some_and(|t| t.timestamp_millis() >= ctx.alive_after_ms()),
            disabled: s.disabled,
            room: rooms.get(&s.uuid).copied(),
            host: hosts.remove(&s.uuid),
        })
        .collect();
    Ok(placement::explain(
        &infos,
        &cands,
        &package.devices,
        (package.vcpus, package.memory_mib),
        package.placement.unwrap_or(ctx.cfg.placement),
    ))
}
