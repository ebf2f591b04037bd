//! SR-IOV virtual functions as devices (a NIC's VFs): a VF variant asks every function of
//! its parent variant for `num_vfs` VFs. This reconciler brings each node's functions to
//! what the variants ask:
//!
//! - a free function of a VF variant's parent is `shared` (never given whole again until
//!   it leaves that mode), then its node sets `sriov_numvfs`; the VFs come back in the
//!   node's inventory as functions of their own, of the VF variant;
//! - a shared function whose count changed gets the new count once none of its VFs is
//!   held (the kernel takes every VF down to change it);
//! - a shared function no VF variant asks for any more, none of whose VFs is held, has
//!   its VFs taken down, then goes `dirty` and through the full scrub.
//!
//! It is level-triggered: it compares what the store says the node has (the functions'
//! reported `sriov_numvfs`) with what the variants ask, so running it twice, or on two
//! replicas, does no harm; it runs after a node's inventory, after a VF variant changes,
//! and from the periodic reconciler.

use super::{StepError, agent_task};
use crate::services::Ctx;
use crate::store::{devices, variants};
use passage_model::protocol::Task;
use passage_model::{DeviceEvent, DeviceState, ServerId};
use std::collections::HashMap;

use devices::SRIOV_TAINT as TAINT;

/// Runs [`reconcile`] for `server` in the background, one run per server at a time: a
/// request while one runs makes it run once more after.
pub fn spawn(ctx: &Ctx, server: ServerId, retry_refused: bool) {
    {
        let mut busy = ctx.sriov_busy.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(again) = busy.get_mut(&server) {
            *again = Some(again.unwrap_or(false) || retry_refused);
            return;
        }
        busy.insert(server, None);
    }
    let ctx = ctx.clone();
    tokio::spawn(async move {
        let mut retry = retry_refused;
        loop {
            if let Err(e) = reconcile(&ctx, server, retry).await {
                tracing::warn!(%server, error = %e, "SR-IOV reconciler");
            }
            let mut busy = ctx.sriov_busy.lock().unwrap_or_else(|p| p.into_inner());
            match busy.get_mut(&server).and_then(Option::take) {
                Some(r) => retry = r,
                None => {
                    busy.remove(&server);
                    return;
                }
            }
        }
    });
}

/// [`spawn`] for every server that has a function a VF variant asks for, or a function
/// shared for VFs.
pub fn spawn_everywhere(ctx: &Ctx, retry_refused: bool) {
    let ctx = ctx.clone();
    tokio::spawn(async move {
        match devices::sriov_servers(&ctx.jobs_db).await {
            Ok(servers) => {
                for s in servers {
                    spawn(&ctx, s, retry_refused);
                }
            }
            Err(e) => tracing::warn!(error = %e, "listing servers for the SR-IOV reconciler"),
        }
    });
}

/// Brings `server`'s SR-IOV functions to what the VF variants ask. A function whose
/// node refused its count carries the node's words as its taint; it is asked again when
/// `retry_refused` (a VF variant changed), or once an operator cleared the taint, not
/// on every pass.
pub async fn reconcile(ctx: &Ctx, server: ServerId, retry_refused: bool) -> Result<(), StepError> {
    let db = &ctx.jobs_db;
    // Parent variant → (VFs per function, VF variant).
    let wanted: HashMap<String, (u32, String)> = variants::list(db)
        .await?
        .into_iter()
        .filter(|v| v.is_vf())
        .filter_map(|v| Some((v.parent?, (v.num_vfs?, v.name))))
        .collect();
    let devs = devices::for_server(db, server).await?;
    let mut shared_any = false;
    for pf in &devs {
        let Some(details) = pf.pci.details.as_ref() else {
            continue;
        };
        // A GPU's VFs are its vGPUs (`store::vgpus`); a VF makes none.
        if details.sriov_totalvfs.is_none()
            || details.physfn.is_some()
            || pf.pci.id.vgpu().is_some()
            || pf.pci.class.is_gpu_like()
            || pf.missing
        {
            continue;
        }
        let id = pf.pci.id.to_string();
        let address = pf.pci.address();
        let have = details.sriov_numvfs.unwrap_or(0);
        let held = devs.iter().any(|v| {
            v.pci.details.as_ref().and_then(|d| d.physfn) == Some(address)
                && !matches!(v.state, DeviceState::Unassigned | DeviceState::Disabled)
        });
        let refused = pf.taint.as_deref().is_some_and(|t| t.starts_with(TAINT));
        if refused && !retry_refused {
            continue;
        }
        let want = pf.variant.as_ref().and_then(|v| wanted.get(v));
        match (want, pf.state) {
            (Some((n, vf_variant)), DeviceState::Unassigned) => {
                let n = *n;
                let moved = devices::move_devices(
                    db,
                    server,
                    std::slice::from_ref(&id),
                    DeviceEvent::Share,
                    None,
                    &format!("shared: its VFs are devices of variant {vf_variant} ({n} asked)"),
                )
                .await?;
                if moved.is_empty() {
                    // Taken whole meanwhile: asked again once it is free.
                    continue;
                }
                shared_any = true;
                if have != n && !held {
                    set_vfs(ctx, server, &id, n).await?;
                }
            }
            (Some((n, _)), DeviceState::Shared) if have != *n && !held => {
                set_vfs(ctx, server, &id, *n).await?;
            }
            (None, DeviceState::Shared) if !held => {
                if have != 0 && !set_vfs(ctx, server, &id, 0).await? {
                    continue;
                }
                let moved = devices::move_devices(
                    db,
                    server,
                    std::slice::from_ref(&id),
                    DeviceEvent::Unshare,
                    None,
                    "no VF variant asks for its VFs any more",
                )
                .await?;
                if !moved.is_empty() {
                    super::scrub::start_job(ctx, server, std::slice::from_ref(&id)).await?;
                }
            }
            _ => {}
        }
    }
    if shared_any {
        // VFs that were there before their function was shared become devices now.
        devices::recompute_variants_on(db, Some(server)).await?;
    }
    Ok(())
}

/// Asks the node for `n` VFs on the function `id`; whether it made them. A refusal is
/// kept as the function's taint, in the node's words; success clears it.
async fn set_vfs(ctx: &Ctx, server: ServerId, id: &str, n: u32) -> Result<bool, StepError> {
    let function = id
        .parse()
        .map_err(|e| StepError::Refused(format!("{id}: {e}")))?;
    let task = Task::SetVfs {
        function,
        num_vfs: n,
    };
    let r = agent_task::run_raw(ctx, server, None, task).await?;
    let taint = (!r.ok).then(|| {
        format!(
            "{TAINT}the node could not make {n} VFs: {}",
            r.error.as_deref().unwrap_or("no reason given")
        )
    });
    if let Some(t) = &taint {
        tracing::warn!(%server, function = id, reason = t.as_str(), "SR-IOV");
    }
    devices::sriov_refused(&ctx.jobs_db, server, id, taint.as_deref()).await?;
    Ok(r.ok)
}
