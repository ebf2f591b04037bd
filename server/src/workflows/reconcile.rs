//! Background reconcilers: the control plane's loop that repairs what jobs left behind.

use crate::services::Ctx;
use crate::store::{devices, now_ms};
use std::collections::BTreeMap;

/// Dirty devices nobody is scrubbing (their job failed, the server restarted) get a
/// scrub job.
pub async fn scrub_forgotten(ctx: &Ctx) -> crate::store::StoreResult<usize> {
    let grace = i64::try_from(ctx.cfg.scrub_grace.as_millis()).unwrap_or(i64::MAX);
    let dirty = devices::dirty_before(
        &ctx.jobs_db,
        now_ms().saturating_sub(grace),
        ctx.alive_after_ms(),
    )
    .await?;
    let mut by_server: BTreeMap<_, Vec<String>> = BTreeMap::new();
    for (server, id) in dirty {
        by_server.entry(server).or_default().push(id);
    }
    let n = by_server.len();
    for (server, ids) in by_server {
        super::scrub::start_job(ctx, server, &ids).await?;
    }
    Ok(n)
}

/// GPUs opened for vGPUs that none has used for `vgpu_idle_close` (a request opened
/// them and went elsewhere, or failed) are closed and scrubbed whole: otherwise they would
/// stay out of whole-GPU placement for good.
pub async fn close_idle_vgpu_hosts(ctx: &Ctx) -> crate::store::StoreResult<usize> {
    let grace = i64::try_from(ctx.cfg.vgpu_idle_close.as_millis()).unwrap_or(i64::MAX);
    let idle = crate::store::vgpus::idle_hosts(
        &ctx.jobs_db,
        now_ms().saturating_sub(grace),
        ctx.alive_after_ms(),
    )
    .await?;
    let mut by_server: BTreeMap<_, Vec<String>> = BTreeMap::new();
    for (server, gpu) in idle {
        by_server.entry(server).or_default().push(gpu);
    }
    let mut n = 0;
    for (server, gpus) in by_server {
        let closed = crate::store::vgpus::close_idle(&ctx.jobs_db, server, &gpus).await?;
        if !closed.is_empty() {
            tracing::info!(%server, gpus = closed.len(), "idle vGPU hosts closed");
            n += closed.len();
            super::scrub::start_job(ctx, server, &closed).await?;
        }
    }
    Ok(n)
}

pub fn spawn_loops(ctx: Ctx) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(ctx.cfg.reconcile_every);
        // Idle vGPU hosts are looked for a few times per grace period, not every tick:
        // the read groups every vGPU slot of the fleet.
        let idle_every = (ctx.cfg.vgpu_idle_close / 4).max(ctx.cfg.reconcile_every);
        let mut idle_checked = tokio::time::Instant::now();
        loop {
            tick.tick().await;
            if let Err(e) = scrub_forgotten(&ctx).await {
                tracing::warn!(error = %e, "scrub reconciler");
            }
            if idle_checked.elapsed() >= idle_every {
                idle_checked = tokio::time::Instant::now();
                if let Err(e) = close_idle_vgpu_hosts(&ctx).await {
                    tracing::warn!(error = %e, "idle vGPU host reconciler");
                }
            }
            if let Err(e) = super::resume_all(&ctx).await {
                tracing::warn!(error = %e, "job reconciler");
            }
            super::sriov::spawn_everywhere(&ctx, false);
        }
    });
}
