//! Group commit for the nodes' task results: each node posts one result per task (seven
//! per VM from its creation to its scrub), and the results that arrive together are
//! recorded in one statement (`store::tasks::complete_many`) instead of one each.

use super::Ctx;
use crate::store::tasks::{self, Completion};
use crate::store::{StoreError, StoreResult};
use tokio::sync::oneshot;

/// Results recorded together at most.
const MAX_BATCH: usize = 256;

/// A node waits for its answer: whatever queued while the last batch was written is the
/// next batch.
pub const LINGER: std::time::Duration = std::time::Duration::ZERO;

pub struct Pending {
    done: Completion,
    recorded: oneshot::Sender<StoreResult<()>>,
}

/// Records a node's result for its task; returns once it is committed. Refused when the
/// task is not that node's, or has a result already.
pub async fn complete(ctx: &Ctx, done: Completion) -> StoreResult<()> {
    let (recorded, answer) = oneshot::channel();
    ctx.completions
        .submit(ctx, Pending { done, recorded }, MAX_BATCH, record)
        .await
        .map_err(|_| StoreError::Sqlx(sqlx::Error::PoolClosed))?;
    answer
        .await
        .map_err(|_| StoreError::Sqlx(sqlx::Error::PoolClosed))?
}

async fn record(ctx: Ctx, batch: Vec<Pending>) {
    let done: Vec<Completion> = batch.iter().map(|p| p.done.clone()).collect();
    let t0 = std::time::Instant::now();
    let r = tasks::complete_many(&ctx.db, &done).await;
    tracing::debug!(
        results = done.len(),
        took_ms = t0.elapsed().as_secs_f64() * 1e3,
        ok = r.is_ok(),
        "task results recorded"
    );
    match r {
        Ok(recorded) => {
            for (p, ok) in batch.into_iter().zip(recorded) {
                let answer = if ok {
                    Ok(())
                } else {
                    Err(tasks::not_completed(&ctx.db, p.done.server, p.done.task).await)
                };
                let _ = p.recorded.send(answer);
            }
        }
        // One statement, all or nothing: each alone, so that an error is its own.
        Err(e) if batch.len() > 1 => {
            tracing::warn!(error = %e, results = batch.len(),
                "a batch of task results failed; recording them one by one");
            for p in batch {
                let r = match tasks::complete_many(&ctx.db, std::slice::from_ref(&p.done)).await {
                    Ok(ok) if ok.first() == Some(&true) => Ok(()),
                    Ok(_) => Err(tasks::not_completed(&ctx.db, p.done.server, p.done.task).await),
                    Err(e) => Err(e),
                };
                let _ = p.recorded.send(r);
            }
        }
        Err(e) => {
            if let Some(p) = batch.into_iter().next() {
                let _ = p.recorded.send(Err(e));
            }
        }
    }
}
