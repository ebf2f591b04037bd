//! What this process knows of each node's task queue: whether a long poll must look at
//! the database at all. A node asks for work again as soon as it has answered what it
//! took, before the next step of the job has queued anything; that look found nothing in
//! about one poll in three, and on SQLite each look is a write (`UPDATE … RETURNING`) on
//! the one writer, in line with the creations and the job steps.
//!
//! A look may be left out when nothing was queued for the node since a look that found
//! its queue drained, and that look is recent ([`FRESH`]). Every task is queued through
//! [`QueueMarks::queued`] after its row is written (this process's job steps, and other
//! replicas' announcements on Postgres); a look notes the count it began at, so a task
//! counted after the look began is looked for again. A task given out but never answered
//! becomes deliverable again by time alone: a look at least every [`FRESH`] while a node
//! polls finds it as before.

use passage_model::ServerId;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a look that found a node's queue drained stands for that queue.
pub const FRESH: Duration = Duration::from_millis(250);

#[derive(Default)]
pub struct QueueMarks {
    marks: Mutex<HashMap<ServerId, Mark>>,
}

#[derive(Clone, Copy, Default)]
struct Mark {
    /// Tasks queued for the node by this count.
    queued: u64,
    /// The count at which a look began that found the queue drained, and when it ended.
    drained: Option<(u64, Instant)>,
}

impl QueueMarks {
    /// A task was queued for `server` (its row written).
    pub fn queued(&self, server: &ServerId) {
        self.lock().entry(*server).or_default().queued += 1;
    }

    /// The count to note before a look at `server`'s queue.
    pub fn count(&self, server: &ServerId) -> u64 {
        self.lock().get(server).map_or(0, |m| m.queued)
    }

    /// A look begun at `count` came back with less than it asked for: the queue held
    /// nothing more then.
    pub fn drained(&self, server: &ServerId, count: u64) {
        let mut marks = self.lock();
        let m = marks.entry(*server).or_default();
        if m.drained.is_none_or(|(c, _)| c <= count) {
            m.drained = Some((count, Instant::now()));
        }
    }

    /// Whether `server`'s queue is known to be empty now, without a look.
    pub fn known_empty(&self, server: &ServerId) -> bool {
        self.lock().get(server).is_some_and(|m| {
            m.drained
                .is_some_and(|(c, at)| c == m.queued && at.elapsed() < FRESH)
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ServerId, Mark>> {
        // Plain counters: a panic elsewhere leaves nothing half-written.
        self.marks.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drained_queue_is_known_empty_until_a_task_comes_or_the_look_is_old() {
        let q = QueueMarks::default();
        let s = ServerId::new_random();
        assert!(!q.known_empty(&s), "never looked at: look");
        let c = q.count(&s);
        q.drained(&s, c);
        assert!(q.known_empty(&s));
        q.queued(&s);
        assert!(!q.known_empty(&s), "a task queued since");
        // A task counted while a look ran: that look does not stand for it.
        let c = q.count(&s);
        q.queued(&s);
        q.drained(&s, c);
        assert!(!q.known_empty(&s));
        let c = q.count(&s);
        q.drained(&s, c);
        assert!(q.known_empty(&s));
        // An older look ending later does not undo a newer one.
        q.drained(&s, c - 1);
        assert!(q.known_empty(&s));
        assert!(!q.known_empty(&ServerId::new_random()), "per node");
        std::thread::sleep(FRESH);
        assert!(!q.known_empty(&s), "a look stands for a while only");
    }
}
