//! Group commit for the job steps' device moves: a VM made running or destroyed with its
//! devices, a scrub's start, a scrub's outcome with the node's reports. Each caller waits
//! for its own write, as before; one task writes whatever has gathered in one transaction
//! (`store::device_moves::write`), a few statements for the lot instead of a transaction
//! and four statements per device.

use super::Ctx;
use crate::store::device_moves::{self, DeviceWrite, Moved};
use crate::store::{StoreError, StoreResult};
use tokio::sync::oneshot;

/// Writes gathered into one transaction at most.
const MAX_BATCH: usize = 256;

/// A write waits for no one: whatever queued while the last batch was written is the
/// next batch.
pub const LINGER: std::time::Duration = std::time::Duration::ZERO;

pub struct Pending {
    write: DeviceWrite,
    /// Each of the write's moves' answers.
    written: oneshot::Sender<StoreResult<Vec<Vec<Moved>>>>,
}

/// Writes `write` with whatever else is waiting; returns once it is committed, with what
/// each of its moves moved.
pub async fn write(ctx: &Ctx, write: DeviceWrite) -> StoreResult<Vec<Vec<Moved>>> {
    ctx.device_log
        .ask(
            ctx,
            |written| Pending { write, written },
            MAX_BATCH,
            write_batch,
        )
        .await
        .ok_or(StoreError::Sqlx(sqlx::Error::PoolClosed))?
}

async fn write_batch(ctx: Ctx, batch: Vec<Pending>) {
    let (writes, answers): (Vec<DeviceWrite>, Vec<_>) =
        batch.into_iter().map(|p| (p.write, p.written)).unzip();
    let t0 = std::time::Instant::now();
    let r = device_moves::write(&ctx.jobs_db, &writes).await;
    tracing::debug!(
        writes = writes.len(),
        took_ms = t0.elapsed().as_secs_f64() * 1e3,
        ok = r.is_ok(),
        "device log batch written"
    );
    match r {
        Ok(moved) => {
            for (a, m) in answers.into_iter().zip(moved) {
                let _ = a.send(m);
            }
        }
        // All or nothing: each is written alone, so that one write's error (a lost race)
        // is its own.
        Err(e) if writes.len() > 1 => {
            tracing::warn!(error = %e, writes = writes.len(),
                "a device log batch failed; writing its writes one by one");
            for (w, a) in writes.into_iter().zip(answers) {
                let r = device_moves::write(&ctx.jobs_db, std::slice::from_ref(&w)).await;
                let _ = a.send(r.and_then(|mut m| m.pop().unwrap_or(Ok(Vec::new()))));
            }
        }
        Err(e) => {
            if let Some(a) = answers.into_iter().next() {
                let _ = a.send(Err(e));
            }
        }
    }
}
