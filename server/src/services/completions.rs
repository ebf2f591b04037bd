//! Group commit for the nodes' task results: each node posts one result per task (seven
//! per VM from its creation to its scrub), and the results that arrive together are
//! recorded in one statement (`store::tasks::complete_many`) instead of one each.

use super::Ctx;
use crate::store::tasks::{self, Completion};
use crate::store::{StoreError, StoreResult};
use passage_model::protocol::TaskResult;
use tokio::sync::oneshot;

/// Results recorded together at most.
const MAX_BATCH: usize = 256;

/// A node waits for its answer: whatever queued while the last batch was written is the
/// next batch.
pub const LINGER: std::time::Duration = std::time::Duration::ZERO;

pub struct Pending {
    done: Completion,
    result: TaskResult,
    recorded: oneshot::Sender<StoreResult<()>>,
}

/// Records a node's result for its task; returns once it is committed, and the step of
/// this process waiting for it has it. Refused when the task is not that node's, or has
/// a result already.
pub async fn complete(ctx: &Ctx, done: Completion, result: TaskResult) -> StoreResult<()> {
    let wrap = |recorded| Pending {
        done,
        result,
        recorded,
    };
    ctx.completions
        .ask(ctx, wrap, MAX_BATCH, record)
        .await
        .ok_or(StoreError::Sqlx(sqlx::Error::PoolClosed))?
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
            let mut told = Vec::new();
            for (p, ok) in batch.into_iter().zip(recorded) {
                let answer = if ok {
                    handed_over(&ctx, &p);
                    told.push(p.done.task.to_string());
                    Ok(())
                } else {
                    Err(tasks::not_completed(&ctx.db, p.done.server, p.done.task).await)
                };
                let _ = p.recorded.send(answer);
            }
            announce(&ctx, &told).await;
        }
        // One statement, all or nothing: each alone, so that an error is its own.
        Err(e) if batch.len() > 1 => {
            tracing::warn!(error = %e, results = batch.len(),
                "a batch of task results failed; recording them one by one");
            for p in batch {
                let r = match tasks::complete_many(&ctx.db, std::slice::from_ref(&p.done)).await {
                    Ok(ok) if ok.first() == Some(&true) => {
                        handed_over(&ctx, &p);
                        announce(&ctx, &[p.done.task.to_string()]).await;
                        Ok(())
                    }
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

/// A recorded result goes to the step of this process waiting for it, if one is.
fn handed_over(ctx: &Ctx, p: &Pending) {
    ctx.task_results.deliver(p.done.task, &p.result);
    ctx.task_done.wake(&p.done.task);
}

/// Tells the other replicas which results were recorded, after this process's own steps
/// have theirs: a replica hears its own announcement too, and a step woken by it before
/// its result was handed over would read it from the database.
async fn announce(ctx: &Ctx, tasks: &[String]) {
    if let Err(e) = tasks::announce(&ctx.db, tasks::DONE_CHANNEL, tasks).await {
        // A waiting replica looks again within its poll interval.
        tracing::warn!(error = %e, results = tasks.len(), "announcing task results");
    }
}
