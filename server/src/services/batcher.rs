//! Group commit: callers queue work and wait; one task takes whatever has queued (up to a
//! limit) and does it together, so that a burst of N requests costs the database a few
//! statements instead of N round trips each. A lone request is taken at once.

use super::{Ctx, Services};
use std::sync::{Mutex, Weak};
use tokio::sync::mpsc;

/// Items that may wait for a batch; past this, callers wait to queue.
const QUEUE: usize = 4096;
/// How long a batch may wait for more items when the last one was large.
const LINGER: std::time::Duration = std::time::Duration::from_millis(1);
/// The batch size from which the next one lingers.
const LINGER_AFTER: usize = 8;

pub struct Batcher<T> {
    queue: mpsc::Sender<T>,
    /// Taken by the first submission, which starts the task that drains the queue.
    idle: Mutex<Option<mpsc::Receiver<T>>>,
}

impl<T> Default for Batcher<T> {
    fn default() -> Self {
        let (queue, rx) = mpsc::channel(QUEUE);
        Batcher {
            queue,
            idle: Mutex::new(Some(rx)),
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
            tokio::spawn(drain(std::sync::Arc::downgrade(ctx), rx, max.max(1), run));
        }
        self.queue.send(item).await.map_err(|e| e.0)
    }
}

/// The queue's one consumer. It holds the services weakly: when they go, the queue's
/// sender goes with them and this ends.
async fn drain<T, F, Fut>(ctx: Weak<Services>, mut rx: mpsc::Receiver<T>, max: usize, run: F)
where
    F: Fn(Ctx, Vec<T>) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut last = 0;
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        take(&mut rx, &mut batch, max);
        // Under load, the callers the last batch answered are sending their next requests
        // now: a moment's wait lets them join this batch instead of forming a small one
        // of their own. A lone caller never waits.
        if last >= LINGER_AFTER && batch.len() < last / 2 {
            tokio::time::sleep(LINGER).await;
            take(&mut rx, &mut batch, max);
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
