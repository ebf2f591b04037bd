//! Server objects (CNAPI-shaped) and join tokens.

use super::Ctx;
use super::auth::{Caller, JOIN_TOKEN_PREFIX, new_secret, sha256_hex};
use crate::error::{ApiError, ApiResult};
use crate::listing::{DeviceFilter, DeviceKey, Page, PageReq, ServerFilter, TimeKey};
use crate::store::{self, devices, room, servers, variants, vms};
use chrono::Utc;
use passage_model::api::{
    AssignableDevice, CreateJoinToken, DeviceRow, JoinToken, Server, ServerResources, ServerStatus,
    ServerVm, Sysinfo, SysinfoDevice, UpdateServer, Vm,
};
use passage_model::variant::{DeviceType, ScrubPolicy};
use passage_model::{DeviceState, ServerId};
use std::collections::{BTreeMap, HashMap};

const DEFAULT_JOIN_TTL_SECS: u64 = 3600;
const MAX_JOIN_TTL_SECS: u64 = 7 * 24 * 3600;

pub fn status(ctx: &Ctx, last_heartbeat: Option<chrono::DateTime<Utc>>) -> ServerStatus {
    match last_heartbeat {
        None => ServerStatus::Unknown,
        Some(t) if t.timestamp_millis() >= ctx.alive_after_ms() => ServerStatus::Running,
        Some(_) => ServerStatus::Offline,
    }
}

/// Variant name → device type and scrub policy, for `assignable_devices`' `type` and
/// `scrub_policy`.
async fn variant_kinds(ctx: &Ctx) -> ApiResult<BTreeMap<String, (DeviceType, ScrubPolicy)>> {
    Ok(variants::list(&ctx.db)
        .await?
        .into_iter()
        .map(|v| (v.name, (v.kind, v.scrub_policy)))
        .collect())
}

pub async fn view(ctx: &Ctx, rec: servers::ServerRecord) -> ApiResult<Server> {
    let devs = devices::for_server(&ctx.db, rec.uuid).await?;
    let kinds = variant_kinds(ctx).await?;
    let vms = vms::on_server(&ctx.db, rec.uuid).await?;
    let res = resources(ctx, &[rec.uuid]).await?.remove(&rec.uuid);
    Ok(assemble(ctx, rec, &devs, vms, &kinds, res))
}

/// The `resources` of each of `servers` that reported them.
async fn resources(
    ctx: &Ctx,
    servers: &[ServerId],
) -> ApiResult<HashMap<ServerId, ServerResources>> {
    Ok(room::rooms(&ctx.db, Some(servers), ctx.cfg.alloc)
        .await?
        .into_iter()
        .map(|(s, r)| {
            (
                s,
                ServerResources {
                    vcpus_total: r.vcpus_total,
                    vcpus_used: r.vcpus_used,
                    memory_total_mib: r.memory_total_mib,
                    memory_used_mib: r.memory_used_mib,
                },
            )
        })
        .collect())
}

/// The server object from what the store holds: its devices and its VMs.
fn assemble(
    ctx: &Ctx,
    rec: servers::ServerRecord,
    devs: &[devices::DeviceRecord],
    on_server: Vec<Vm>,
    kinds: &BTreeMap<String, (DeviceType, ScrubPolicy)>,
    resources: Option<ServerResources>,
) -> Server {
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
    let mut device_counts = BTreeMap::new();
    for d in devs.iter().filter(|d| d.variant.is_some()) {
        *device_counts.entry(d.state).or_insert(0u32) += 1;
    }
    let assignable_devices = devs
        .iter()
        .filter_map(|d| {
            let variant = d.variant.clone()?;
            let (kind, scrub_policy) = kinds
                .get(&variant)
                .copied()
                .unwrap_or((DeviceType::Other, ScrubPolicy::Full));
            Some(AssignableDevice {
                id: d.pci.id.clone(),
                state: d.state,
                kind,
                variant,
                used_by: d.used_by,
                numa_node: d.pci.numa_node,
                taint: d.taint.clone(),
                scrub_policy,
                state_reason: d.state_reason.clone(),
            })
        })
        .collect();
    let vms = on_server
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
    Server {
        uuid: rec.uuid,
        status: status(ctx, rec.last_heartbeat),
        hostname: rec.hostname,
        last_heartbeat: rec.last_heartbeat,
        created_at: rec.created_at,
        disabled: rec.disabled,
        sysinfo: Some(Sysinfo { pci_devices }),
        device_counts,
        assignable_devices: Some(assignable_devices),
        vms: Some(vms),
        resources,
        host: rec.host,
    }
}

/// A server as a list screen needs it: counts of its devices by state, no inventory.
fn brief(
    ctx: &Ctx,
    rec: servers::ServerRecord,
    device_counts: BTreeMap<DeviceState, u32>,
    resources: Option<ServerResources>,
) -> Server {
    Server {
        uuid: rec.uuid,
        status: status(ctx, rec.last_heartbeat),
        hostname: rec.hostname,
        last_heartbeat: rec.last_heartbeat,
        created_at: rec.created_at,
        disabled: rec.disabled,
        sysinfo: None,
        device_counts,
        assignable_devices: None,
        vms: None,
        resources,
        host: rec.host,
    }
}

pub async fn get(ctx: &Ctx, caller: &Caller, uuid: ServerId) -> ApiResult<Server> {
    caller.require_staff()?;
    let rec = servers::get(&ctx.db, uuid).await?;
    view(ctx, rec).await
}

/// One page of servers, newest first: four queries whatever the page size (the servers,
/// their devices, their VMs, the variants). A `brief` page, for list screens, takes two:
/// the servers and their device counts by state.
pub async fn list(
    ctx: &Ctx,
    caller: &Caller,
    status: Option<ServerStatus>,
    detail: Detail,
    req: &PageReq<TimeKey>,
) -> ApiResult<Page<Server, TimeKey>> {
    caller.require_staff()?;
    let filter = ServerFilter {
        status,
        alive_after_ms: ctx.alive_after_ms(),
    };
    let page = servers::page(&ctx.db, &filter, req).await?;
    let uuids: Vec<ServerId> = page.items.iter().map(|r| r.uuid).collect();
    let mut res = resources(ctx, &uuids).await?;
    if detail == Detail::Brief {
        let mut counts = devices::state_counts(&ctx.db, &uuids).await?;
        return Ok(page.map(|rec| {
            let c = counts.remove(&rec.uuid).unwrap_or_default();
            let r = res.remove(&rec.uuid);
            brief(ctx, rec, c, r)
        }));
    }
    let mut devs: BTreeMap<ServerId, Vec<devices::DeviceRecord>> = BTreeMap::new();
    for d in devices::for_servers(&ctx.db, &uuids).await? {
        devs.entry(d.server_uuid).or_default().push(d);
    }
    let mut on: BTreeMap<ServerId, Vec<Vm>> = BTreeMap::new();
    for vm in vms::on_servers(&ctx.db, &uuids).await? {
        if let Some(s) = vm.server_uuid {
            on.entry(s).or_default().push(vm);
        }
    }
    let kinds = if page.items.is_empty() {
        BTreeMap::new()
    } else {
        variant_kinds(ctx).await?
    };
    Ok(page.map(|rec| {
        let d = devs.remove(&rec.uuid).unwrap_or_default();
        let v = on.remove(&rec.uuid).unwrap_or_default();
        let r = res.remove(&rec.uuid);
        assemble(ctx, rec, &d, v, &kinds, r)
    }))
}

/// How much of each server a list holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Detail {
    Full,
    Brief,
}

/// One page of the fleet's assignable devices (see `devices::page` for the order).
pub async fn list_devices(
    ctx: &Ctx,
    caller: &Caller,
    filter: &DeviceFilter,
    req: &PageReq<DeviceKey>,
) -> ApiResult<Page<DeviceRow, DeviceKey>> {
    caller.require_staff()?;
    let page = devices::page(&ctx.db, filter, req).await?;
    let kinds = if page.items.is_empty() {
        BTreeMap::new()
    } else {
        variant_kinds(ctx).await?
    };
    Ok(page.map(|l| {
        let d = l.device;
        let scrub_policy = d
            .variant
            .as_ref()
            .and_then(|v| kinds.get(v))
            .map_or(ScrubPolicy::Full, |k| k.1);
        DeviceRow {
            scrub_policy,
            state_reason: d.state_reason,
            address: d.pci.address(),
            id: d.pci.id,
            server_uuid: d.server_uuid,
            hostname: l.hostname,
            variant: d.variant,
            state: d.state,
            used_by: d.used_by,
            numa_node: d.pci.numa_node,
            driver: d.pci.driver,
            vendor: d.pci.vendor,
            device: d.pci.device,
            taint: d.taint,
        }
    }))
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
                return Err(ApiError::missing("server_uuid", "no such server"));
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
    last: Option<i64>,
) -> ApiResult<Vec<passage_model::api::DeviceEventRecord>> {
    caller.require_staff()?;
    servers::get(&ctx.db, uuid).await?;
    Ok(store::events::device_events(&ctx.db, uuid, device, last).await?)
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
    let set = servers::set_credential(&ctx.db, uuid, &unusable).await;
    ctx.node_credentials.clear();
    set?;
    tracing::warn!(server = %uuid, by = %caller.account.login, "node credential revoked");
    Ok(())
}
