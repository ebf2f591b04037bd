//! Group commit for the nodes' heartbeats: a heartbeat, or the one a long poll carries,
//! waits here, and one task marks every node that has gathered alive in one statement
//! (`store::servers::heartbeat_many`). A fleet's 1,250 nodes beat a few hundred times a
//! second while their jobs run (each poll after a task carries one), and each was a turn
//! of its own on the one SQLite writer, in line with the job steps.

use super::Ctx;
use crate::store::servers;
use crate::store::{StoreError, StoreResult};
use passage_model::ServerId;
use std::collections::HashSet;
use tokio::sync::oneshot;

/// Nodes marked by one statement at most.
const MAX_BATCH: usize = 256;

/// A heartbeat waits for no one: whatever queued while the last batch was written is the
/// next batch.
pub const LINGER: std::time::Duration = std::time::Duration::ZERO;

pub struct Beat {
    server: ServerId,
    written: oneshot::Sender<StoreResult<()>>,
}

/// Marks `server` alive now, with whatever other nodes' heartbeats are waiting; returns
/// once that is committed. On the jobs' lane: on Postgres its commits do not wait for
/// the WAL to reach the disk, and a heartbeat lost with the database's last fraction of
/// a second is sent again within one interval.
pub async fn beat(ctx: &Ctx, server: ServerId) -> StoreResult<()> {
    ctx.heartbeat_log
        .ask(
            ctx,
            |written| Beat { server, written },
            MAX_BATCH,
            write_batch,
        )
        .await
        .ok_or(StoreError::Sqlx(sqlx::Error::PoolClosed))?
}

async fn write_batch(ctx: Ctx, batch: Vec<Beat>) {
    let mut seen = HashSet::new();
    let servers: Vec<ServerId> = batch
        .iter()
        .filter(|b| seen.insert(b.server))
        .map(|b| b.server)
        .collect();
    match servers::heartbeat_many(&ctx.jobs_db, &servers).await {
        Ok(()) => {
            for b in batch {
                let _ = b.written.send(Ok(()));
            }
        }
        // One statement, all or nothing: each alone, so that an error is its own.
        Err(e) if batch.len() > 1 => {
            tracing::warn!(error = %e, nodes = servers.len(),
                "a heartbeat batch failed; writing its heartbeats one by one");
            for b in batch {
                let r = servers::heartbeat_many(&ctx.jobs_db, &[b.server]).await;
                let _ = b.written.send(r);
            }
        }
        Err(e) => {
            if let Some(b) = batch.into_iter().next() {
                let _ = b.written.send(Err(e));
            }
        }
    }
}
