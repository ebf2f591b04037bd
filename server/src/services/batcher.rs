//! Group commit: callers queue work and wait; one task takes whatever has queued (up to a
//! limit) and does it together, so that a burst of N requests costs the database a few
//! statements instead of N round trips each. A lone request is taken at once.

use super::{Ctx, Services};
use std::sync::{Mutex, Weak};
use std::time::Duration;
use tokio::sync::mpsc;

/// Items that may wait for a batch; past this, callers wait to queue.
const QUEUE: usize = 4096;
/// The batch size from which the next one lingers.
const LINGER_AFTER: usize = 8;

pub struct Batcher<T> {
    queue: mpsc::Sender<T>,
    /// Taken by the first submission, which starts the task that drains the queue.
    idle: Mutex<Option<mpsc::Receiver<T>>>,
    /// How long a batch may wait for the callers the last one answered.
    linger: Duration,
}

impl<T> Batcher<T> {
    /// A batcher whose batches wait at most `linger` for more items after a large one.
    pub fn new(linger: Duration) -> Self {
        let (queue, rx) = mpsc::channel(QUEUE);
        Batcher {
            queue,
            idle: Mutex::new(Some(rx)),
            linger,
        }
    }
}

impl<T: Send + 'static> Batcher<T> {
    /// Queues `item` for `run`, which gets up to `max` queued items at a time, one batch
    /// after another. The item carries its own way to answer (a oneshot sender). Fails
    /// only once the services are shutting down.
    pub async fn submit<F, Fut>(&self, ctx: &Ctx, item: T, max: usize, run: F) -> Result<(), T>
    where
        F: Fn(Ctx, Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let idle = self.idle.lock().ok().and_then(|mut idle| idle.take());
        if let Some(rx) = idle {
            let linger = self.linger;
            tokio::spawn(drain(
                std::sync::Arc::downgrade(ctx),
                rx,
                max.max(1),
                linger,
                run,
            ));
        }
        self.queue.send(item).await.map_err(|e| e.0)
    }
}

/// The queue's one consumer. It holds the services weakly: when they go, the queue's
/// sender goes with them and this ends.
async fn drain<T, F, Fut>(
    ctx: Weak<Services>,
    mut rx: mpsc::Receiver<T>,
    max: usize,
    linger: Duration,
    run: F,
) where
    F: Fn(Ctx, Vec<T>) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut last = 0;
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        take(&mut rx, &mut batch, max);
        // Under load, the callers the last batch answered are sending their next requests
        // now, each a moment after the other. Waiting for them (until `linger` has
        // passed) makes one batch of them instead of a batch of the first alone, which
        // all the others would then wait behind. A lone caller never waits.
        if last >= LINGER_AFTER {
            let until = tokio::time::Instant::now() + linger;
            let want = last.min(max);
            while batch.len() < want {
                match tokio::time::timeout_at(until, rx.recv()).await {
                    Ok(Some(item)) => {
                        batch.push(item);
                        take(&mut rx, &mut batch, max);
                    }
                    Ok(None) | Err(_) => break,
                }
            }
        }
        last = batch.len();
        let Some(ctx) = ctx.upgrade() else { return };
        run(ctx, batch).await;
    }
}

/// Moves what is queued into `batch`, up to `max` items in all.
fn take<T>(rx: &mut mpsc::Receiver<T>, batch: &mut Vec<T>, max: usize) {
    while batch.len() < max {
        match rx.try_recv() {
            Ok(item) => batch.push(item),
            Err(_) => break,
        }
    }
}
