//! Group commit for the nodes' long polls: a job step that queues tasks for many nodes
//! wakes each of their polls at once, and the polls that look at their queues together
//! take their tasks in one statement (`store::tasks::take_many`). On SQLite each look is
//! a write on the one writer, in line with the creations and the job steps.

use super::Ctx;
use crate::store::tasks;
use crate::store::{StoreError, StoreResult};
use passage_model::ServerId;
use passage_model::protocol::TaskEnvelope;
use std::collections::HashSet;
use tokio::sync::oneshot;

/// Nodes served by one statement at most.
const MAX_BATCH: usize = 256;

/// A poll waits for its answer: whatever queued while the last batch was written is the
/// next batch.
pub const LINGER: std::time::Duration = std::time::Duration::ZERO;

pub struct Look {
    server: ServerId,
    answer: oneshot::Sender<StoreResult<Vec<TaskEnvelope>>>,
}

/// Takes up to [`super::agents::TASK_BATCH`] of `server`'s deliverable tasks, as
/// `tasks::take` does, together with the other nodes' polls looking at the same time.
pub async fn take(ctx: &Ctx, server: ServerId) -> StoreResult<Vec<TaskEnvelope>> {
    ctx.task_takes
        .ask(ctx, |answer| Look { server, answer }, MAX_BATCH, run)
        .await
        .ok_or(StoreError::Sqlx(sqlx::Error::PoolClosed))?
}

async fn run(ctx: Ctx, batch: Vec<Look>) {
    let limit = super::agents::TASK_BATCH;
    let redeliver = i64::try_from(ctx.cfg.task_redeliver_after.as_millis()).unwrap_or(i64::MAX);
    // A node polling twice at once: its first look takes what there is, the others find
    // its queue as that one left it.
    let mut seen = HashSet::new();
    let servers: Vec<ServerId> = batch
        .iter()
        .filter(|l| seen.insert(l.server))
        .map(|l| l.server)
        .collect();
    match tasks::take_many(&ctx.db, &servers, limit, redeliver).await {
        Ok(mut got) => {
            for look in batch {
                let mine = got.remove(&look.server).unwrap_or_default();
                let _ = look.answer.send(Ok(mine));
            }
        }
        // One statement, all or nothing: each alone, so that an error is its own.
        Err(e) if servers.len() > 1 => {
            tracing::warn!(error = %e, nodes = servers.len(),
                "taking tasks for a batch of nodes failed; taking them one by one");
            let mut seen = HashSet::new();
            for look in batch {
                let r = if seen.insert(look.server) {
                    tasks::take(&ctx.db, look.server, limit, redeliver).await
                } else {
                    Ok(Vec::new())
                };
                let _ = look.answer.send(r);
            }
        }
        Err(e) => {
            let mut e = Some(e);
            for look in batch {
                let r = match e.take() {
                    Some(e) => Err(e),
                    None => Ok(Vec::new()),
                };
                let _ = look.answer.send(r);
            }
        }
    }
}
