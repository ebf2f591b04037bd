//! Group commit: callers queue work and wait; one task takes whatever has queued (up to a
//! limit) and does it together, so that a burst of N requests costs the database a few
//! statements instead of N round trips each. A lone request is taken at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::mpsc;

/// Items that may wait for a batch; past this, callers wait to queue.
const QUEUE: usize = 4096;
/// The batch size from which the next one lingers.
const LINGER_AFTER: usize = 8;
/// How soon after a batch the next must start for its callers to count as the same burst.
/// Answering a batch's callers and their next requests takes a few milliseconds (7 to 12
/// on a 2-CPU machine under load); a caller after a longer quiet spell is on its own.
const BURST_GAP: Duration = Duration::from_millis(50);

pub struct Batcher<T> {
    queue: mpsc::Sender<T>,
    /// Taken by the first submission, which starts the task that drains the queue.
    idle: Mutex<Option<mpsc::Receiver<T>>>,
    /// How long a batch may wait for the callers the last one answered.
    linger: Duration,
    /// Callers on their way to `submit` (see [`Batcher::on_the_way`]).
    coming: Arc<AtomicUsize>,
    /// Items submitted and not yet through their batch.
    pending: Arc<AtomicUsize>,
    /// When the last batch ended.
    ended: Arc<Mutex<Option<tokio::time::Instant>>>,
}

/// A caller that will submit soon: while it lives, a batch being gathered may wait for it
/// (up to the batcher's linger). Dropped just before the caller submits, or when it
/// turns back.
pub struct OnTheWay(Arc<AtomicUsize>);

impl Drop for OnTheWay {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<T> Batcher<T> {
    /// A batcher whose batches wait at most `linger` for more items after a large one.
    pub fn new(linger: Duration) -> Self {
        let (queue, rx) = mpsc::channel(QUEUE);
        Batcher {
            queue,
            idle: Mutex::new(Some(rx)),
            linger,
            coming: Arc::new(AtomicUsize::new(0)),
            pending: Arc::new(AtomicUsize::new(0)),
            ended: Arc::new(Mutex::new(None)),
        }
    }

    /// Whether callers are coming: one is on its way, queued, or in a batch being run, or
    /// a batch ended within [`BURST_GAP`] (its callers are sending their next requests).
    pub fn busy(&self) -> bool {
        if self.pending.load(Ordering::SeqCst) + self.coming.load(Ordering::SeqCst) > 0 {
            return true;
        }
        let ended = self.ended.lock().map(|e| *e).unwrap_or(None);
        ended.is_some_and(|at| at.elapsed() < BURST_GAP)
    }

    /// Counts the caller as on its way from the moment it knows it will submit, before
    /// the reads that come first (its package, say): a burst that arrives together is then
    /// gathered into one batch, instead of the first caller's alone and the rest after.
    pub fn on_the_way(&self) -> OnTheWay {
        self.coming.fetch_add(1, Ordering::SeqCst);
        OnTheWay(self.coming.clone())
    }
}

impl<T: Send + 'static> Batcher<T> {
    /// Queues `item` for `run`, which gets up to `max` queued items at a time, one batch
    /// after another. The item carries its own way to answer (a oneshot sender). Fails
    /// only once the services are shutting down.
    /// `ctx` is what `run` works with (the services); the queue's task holds it weakly.
    pub async fn submit<C, F, Fut>(
        &self,
        ctx: &Arc<C>,
        item: T,
        max: usize,
        run: F,
    ) -> Result<(), T>
    where
        C: Send + Sync + 'static,
        F: Fn(Arc<C>, Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let idle = self.idle.lock().ok().and_then(|mut idle| idle.take());
        if let Some(rx) = idle {
            let gather = Gather {
                max: max.max(1),
                linger: self.linger,
                coming: self.coming.clone(),
                pending: self.pending.clone(),
                ended: self.ended.clone(),
            };
            tokio::spawn(drain(Arc::downgrade(ctx), rx, gather, run));
        }
        self.pending.fetch_add(1, Ordering::SeqCst);
        let sent = self.queue.send(item).await.map_err(|e| e.0);
        if sent.is_err() {
            self.pending.fetch_sub(1, Ordering::SeqCst);
        }
        sent
    }
}

impl<T: Send + 'static> Batcher<T> {
    /// [`Batcher::submit`] for an item that carries its own answer: `wrap` makes the item
    /// around the answer's sender, and this waits for the answer. `None` once the
    /// services are shutting down (the queue closed, or its task gone before answering).
    pub async fn ask<R, C, F, Fut>(
        &self,
        ctx: &Arc<C>,
        wrap: impl FnOnce(tokio::sync::oneshot::Sender<R>) -> T,
        max: usize,
        run: F,
    ) -> Option<R>
    where
        C: Send + Sync + 'static,
        F: Fn(Arc<C>, Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (answer, answered) = tokio::sync::oneshot::channel();
        self.submit(ctx, wrap(answer), max, run).await.ok()?;
        answered.await.ok()
    }
}

/// How the queue's consumer gathers a batch.
struct Gather {
    max: usize,
    linger: Duration,
    coming: Arc<AtomicUsize>,
    pending: Arc<AtomicUsize>,
    ended: Arc<Mutex<Option<tokio::time::Instant>>>,
}

/// The queue's one consumer. It holds the services weakly: when they go, the queue's
/// sender goes with them and this ends.
async fn drain<C, T, F, Fut>(ctx: Weak<C>, mut rx: mpsc::Receiver<T>, g: Gather, run: F)
where
    F: Fn(Arc<C>, Vec<T>) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut last = 0;
    let mut left_over = 0;
    let mut done_at = tokio::time::Instant::now();
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        take(&mut rx, &mut batch, g.max);
        // Wait (until `linger` has passed) for the callers known to be coming: those on
        // their way now and, under load, those the last batch answered, who are sending
        // their next requests one a moment after the other, besides those who queued
        // while it was written. One batch of them all costs less than a batch of the
        // first alone (or of a part) that the others then wait behind, and a burst
        // whose callers split in two groups, each waiting for the other's batch, comes
        // back together. A caller after a quiet spell, with nobody on the way, never waits.
        let burst = last >= LINGER_AFTER && done_at.elapsed() < BURST_GAP;
        let expected = if burst { left_over + last } else { 0 };
        let want = |have: usize, coming: &AtomicUsize| {
            expected
                .max(have + coming.load(Ordering::SeqCst))
                .min(g.max)
        };
        if batch.len() < want(batch.len(), &g.coming) {
            let until = tokio::time::Instant::now() + g.linger;
            while batch.len() < want(batch.len(), &g.coming) {
                match tokio::time::timeout_at(until, rx.recv()).await {
                    Ok(Some(item)) => {
                        batch.push(item);
                        take(&mut rx, &mut batch, g.max);
                    }
                    Ok(None) | Err(_) => break,
                }
            }
        }
        last = batch.len();
        let Some(ctx) = ctx.upgrade() else { return };
        run(ctx, batch).await;
        done_at = tokio::time::Instant::now();
        // The end first: a look between the two sees the batch running or just ended.
        if let Ok(mut ended) = g.ended.lock() {
            *ended = Some(done_at);
        }
        g.pending.fetch_sub(last, Ordering::SeqCst);
        // Callers that queued while the batch was written: none of them is one it
        // answered.
        left_over = rx.len();
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    type Sizes = Arc<Mutex<Vec<usize>>>;

    async fn record(sizes: Arc<Sizes>, batch: Vec<tokio::sync::oneshot::Sender<()>>) {
        if let Ok(mut s) = sizes.lock() {
            s.push(batch.len());
        }
        for answer in batch {
            let _ = answer.send(());
        }
    }

    async fn submit(b: &Batcher<tokio::sync::oneshot::Sender<()>>, sizes: &Arc<Sizes>) {
        let (answer, answered) = tokio::sync::oneshot::channel();
        assert!(b.submit(sizes, answer, 64, record).await.is_ok());
        assert!(answered.await.is_ok());
    }

    #[tokio::test]
    async fn callers_on_their_way_are_gathered_into_one_batch() {
        let b = Arc::new(Batcher::new(Duration::from_secs(10)));
        let sizes: Arc<Sizes> = Arc::default();
        let coming: Vec<OnTheWay> = (0..8).map(|_| b.on_the_way()).collect();
        let mut callers = Vec::new();
        for on_the_way in coming {
            let (b, sizes) = (b.clone(), sizes.clone());
            callers.push(tokio::spawn(async move {
                // Each reads something first, one after the other.
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(on_the_way);
                submit(&b, &sizes).await;
            }));
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        for c in callers {
            assert!(c.await.is_ok());
        }
        assert_eq!(sizes.lock().map(|s| s.clone()).ok(), Some(vec![8]));
    }

    #[tokio::test]
    async fn busy_while_callers_are_queued_or_placed_and_for_a_gap_after() {
        let b = Arc::new(Batcher::new(Duration::from_millis(1)));
        assert!(!b.busy(), "nobody has come");
        let (release, held) = tokio::sync::oneshot::channel::<()>();
        let held = Arc::new(Mutex::new(Some(held)));
        let (answer, answered) = tokio::sync::oneshot::channel::<()>();
        let ctx = Arc::new(());
        let run = move |_: Arc<()>, batch: Vec<tokio::sync::oneshot::Sender<()>>| {
            let held = held.lock().ok().and_then(|mut h| h.take());
            async move {
                if let Some(h) = held {
                    let _ = h.await;
                }
                for a in batch {
                    let _ = a.send(());
                }
            }
        };
        assert!(b.submit(&ctx, answer, 64, run).await.is_ok());
        assert!(b.busy(), "a caller is in a batch");
        let _ = release.send(());
        assert!(answered.await.is_ok());
        tokio::time::sleep(BURST_GAP + Duration::from_millis(20)).await;
        assert!(!b.busy(), "quiet once the gap has passed");
        let coming = b.on_the_way();
        assert!(b.busy(), "a caller on its way");
        drop(coming);
        assert!(!b.busy());
    }

    #[tokio::test]
    async fn a_lone_caller_never_waits() {
        let b = Batcher::new(Duration::from_secs(10));
        let sizes: Arc<Sizes> = Arc::default();
        let t = Instant::now();
        submit(&b, &sizes).await;
        submit(&b, &sizes).await;
        // Far below the 10 s it would have lingered.
        assert!(t.elapsed() < Duration::from_secs(5));
        assert_eq!(sizes.lock().map(|s| s.clone()).ok(), Some(vec![1, 1]));
    }

    #[tokio::test]
    async fn a_counted_caller_that_never_submits_holds_the_batch_only_for_the_linger() {
        let b = Batcher::new(Duration::from_millis(50));
        let sizes: Arc<Sizes> = Arc::default();
        let never = b.on_the_way();
        submit(&b, &sizes).await;
        drop(never);
        assert_eq!(sizes.lock().map(|s| s.clone()).ok(), Some(vec![1]));
    }
}
