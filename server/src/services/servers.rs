//! Server objects (CNAPI-shaped) and join tokens.

use super::Ctx;
use super::auth::{Caller, JOIN_TOKEN_PREFIX, new_secret, sha256_hex};
use crate::error::{ApiError, ApiResult};
use crate::store::{self, devices, servers, variants, vms};
use chrono::Utc;
use passage_model::ServerId;
use passage_model::api::{
    AssignableDevice, CreateJoinToken, JoinToken, Server, ServerStatus, ServerVm, Sysinfo,
    SysinfoDevice, UpdateServer,
};
use passage_model::variant::DeviceType;
use std::collections::BTreeMap;

const DEFAULT_JOIN_TTL_SECS: u64 = 3600;
const MAX_JOIN_TTL_SECS: u64 = 7 * 24 * 3600;

pub fn status(ctx: &Ctx, last_heartbeat: Option<chrono::DateTime<Utc>>) -> ServerStatus {
    match last_heartbeat {
        None => ServerStatus::Unknown,
        Some(t) if t.timestamp_millis() >= ctx.alive_after_ms() => ServerStatus::Running,
        Some(_) => ServerStatus::Offline,
    }
}

pub async fn view(ctx: &Ctx, rec: servers::ServerRecord) -> ApiResult<Server> {
    let devs = devices::for_server(&ctx.db, rec.uuid).await?;
    let kinds: BTreeMap<String, DeviceType> = variants::list(&ctx.db)
        .await?
        .into_iter()
        .map(|v| (v.name, v.kind))
        .collect();
    let pci_devices = devs
        .iter()
        .filter(|d| !d.missing)
        .map(|d| SysinfoDevice {
            vendor: d.pci.vendor,
            device: d.pci.device,
            subsystem: d.pci.subsystem,
            subvendor: d.pci.subvendor,
            revision: d.pci.revision,
            class: d.pci.class,
            id: d.pci.id.clone(),
            driver: d.pci.driver.clone().unwrap_or_else(|| "-".into()),
            numa_node: d.pci.numa_node,
            iommu_group: d.pci.iommu_group,
            used_by: d.used_by,
            details: d.pci.details.clone(),
        })
        .collect();
    let assignable_devices = devs
        .iter()
        .filter_map(|d| {
            let variant = d.variant.clone()?;
            Some(AssignableDevice {
                id: d.pci.id.clone(),
                state: d.state,
                kind: kinds.get(&variant).copied().unwrap_or(DeviceType::Other),
                variant,
                used_by: d.used_by,
                numa_node: d.pci.numa_node,
                taint: d.taint.clone(),
            })
        })
        .collect();
    let vms = vms::on_server(&ctx.db, rec.uuid)
        .await?
        .into_iter()
        .map(|vm| {
            (
                vm.uuid,
                ServerVm {
                    uuid: vm.uuid,
                    owner_uuid: vm.owner_uuid,
                    state: vm.state,
                    brand: "bhyve".into(),
                    assigned_devices: vm.assigned_devices,
                },
            )
        })
        .collect();
    Ok(Server {
        uuid: rec.uuid,
        status: status(ctx, rec.last_heartbeat),
        hostname: rec.hostname,
        last_heartbeat: rec.last_heartbeat,
        created_at: rec.created_at,
        disabled: rec.disabled,
        sysinfo: Sysinfo { pci_devices },
        assignable_devices,
        vms,
    })
}

pub async fn get(ctx: &Ctx, caller: &Caller, uuid: ServerId) -> ApiResult<Server> {
    caller.require_staff()?;
    let rec = servers::get(&ctx.db, uuid).await?;
    view(ctx, rec).await
}

pub async fn list(
    ctx: &Ctx,
    caller: &Caller,
    limit: i64,
    offset: i64,
) -> ApiResult<(Vec<Server>, i64)> {
    caller.require_staff()?;
    let (recs, total) = servers::list(&ctx.db, limit, offset).await?;
    let mut out = Vec::with_capacity(recs.len());
    for r in recs {
        out.push(view(ctx, r).await?);
    }
    Ok((out, total))
}

pub async fn update(
    ctx: &Ctx,
    caller: &Caller,
    uuid: ServerId,
    req: UpdateServer,
) -> ApiResult<Server> {
    caller.require_operator()?;
    if let Some(h) = &req.hostname {
        validate_hostname("hostname", h)?;
        servers::set_hostname(&ctx.db, uuid, h).await?;
    }
    if let Some(d) = req.disabled {
        servers::set_disabled(&ctx.db, uuid, d).await?;
        tracing::info!(server = %uuid, disabled = d, by = %caller.account.login, "server service state changed");
    }
    get(ctx, caller, uuid).await
}

pub fn validate_hostname(field: &str, h: &str) -> ApiResult<()> {
    let ok = !h.is_empty()
        && h.len() <= passage_model::protocol::MAX_HOSTNAME_LEN
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            field,
            "must be 1 to 253 characters of A-Z, a-z, 0-9, '-', '.', '_'",
        ))
    }
}

pub async fn create_join_token(
    ctx: &Ctx,
    caller: &Caller,
    req: CreateJoinToken,
) -> ApiResult<JoinToken> {
    caller.require_operator()?;
    let ttl = req.ttl_secs.unwrap_or(DEFAULT_JOIN_TTL_SECS);
    if !(1..=MAX_JOIN_TTL_SECS).contains(&ttl) {
        return Err(ApiError::invalid(
            "ttl_secs",
            format!("must be 1 to {MAX_JOIN_TTL_SECS}"),
        ));
    }
    if let Some(s) = req.server_uuid {
        match servers::get(&ctx.db, s).await {
            Ok(_) => {}
            Err(store::StoreError::NotFound(_)) => {
                return Err(ApiError::invalid("server_uuid", "no such server"));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let token = new_secret(JOIN_TOKEN_PREFIX);
    let expires_at = Utc::now() + chrono::Duration::seconds(i64::try_from(ttl).unwrap_or(3600));
    servers::insert_join_token_for(
        &ctx.db,
        &sha256_hex(&token),
        &caller.account.uuid.to_string(),
        expires_at.timestamp_millis(),
        req.server_uuid,
    )
    .await?;
    Ok(JoinToken { token, expires_at })
}

pub async fn device_events(
    ctx: &Ctx,
    caller: &Caller,
    uuid: ServerId,
    device: Option<&str>,
) -> ApiResult<Vec<passage_model::api::DeviceEventRecord>> {
    caller.require_staff()?;
    servers::get(&ctx.db, uuid).await?;
    Ok(store::events::device_events(&ctx.db, uuid, device).await?)
}

pub async fn scrub_reports(
    ctx: &Ctx,
    caller: &Caller,
    uuid: ServerId,
    device: Option<&str>,
) -> ApiResult<Vec<passage_model::api::ScrubRecord>> {
    caller.require_staff()?;
    servers::get(&ctx.db, uuid).await?;
    Ok(store::events::scrub_reports(&ctx.db, uuid, device).await?)
}

/// Revokes a node's credential: its agent is refused from now on, until the node is
/// re-admitted with a join token made for it.
pub async fn revoke_credential(ctx: &Ctx, caller: &Caller, uuid: ServerId) -> ApiResult<()> {
    caller.require_operator()?;
    // No SHA-256 hex digest has this form, so no credential matches it.
    let unusable = format!("revoked:{}", uuid::Uuid::new_v4());
    servers::set_credential(&ctx.db, uuid, &unusable).await?;
    tracing::warn!(server = %uuid, by = %caller.account.login, "node credential revoked");
    Ok(())
}
