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

pub fn spawn_loops(ctx: Ctx) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(ctx.cfg.reconcile_every);
        loop {
            tick.tick().await;
            if let Err(e) = scrub_forgotten(&ctx).await {
                tracing::warn!(error = %e, "scrub reconciler");
            }
            if let Err(e) = super::resume_all(&ctx).await {
                tracing::warn!(error = %e, "job reconciler");
            }
        }
    });
}
