//! Wake-ups by key: a task queued for one node wakes that node's long poll, a result
//! given for one task wakes the job step waiting on it, and nobody else. One `Notify` for
//! all of them woke every waiter for every event: with 2,000 nodes polling, each task
//! queued made 2,000 pollers query the database (on SQLite, each taking the one writer).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, Weak};
use tokio::sync::Notify;

/// Waiters by key. A waiter holds the `Arc<Notify>` of its key while it waits; the map
/// keeps only weak references, so keys nobody waits on cost nothing but a pruned entry.
pub struct Wakers<K> {
    map: Mutex<HashMap<K, Weak<Notify>>>,
}

impl<K> Default for Wakers<K> {
    fn default() -> Self {
        Wakers {
            map: Mutex::new(HashMap::new()),
        }
    }
}

/// Entries past this count are swept of keys nobody waits on any more.
const SWEEP_AT: usize = 1024;

impl<K: Hash + Eq + Clone> Wakers<K> {
    /// The handle to wait on for `key`. Take it, then create its `notified()` future,
    /// then look at the database, then await: a wake between the look and the await is
    /// not lost (`Notify::notify_waiters` wakes every `Notified` created before it).
    pub fn handle(&self, key: &K) -> Arc<Notify> {
        let mut map = self.lock();
        if let Some(n) = map.get(key).and_then(Weak::upgrade) {
            return n;
        }
        if map.len() >= SWEEP_AT && map.len().is_power_of_two() {
            map.retain(|_, w| w.strong_count() > 0);
        }
        let n = Arc::new(Notify::new());
        map.insert(key.clone(), Arc::downgrade(&n));
        n
    }

    /// Wakes whoever waits on `key` now; nobody waiting is nothing to do.
    pub fn wake(&self, key: &K) {
        let n = self.lock().get(key).and_then(Weak::upgrade);
        if let Some(n) = n {
            n.notify_waiters();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<K, Weak<Notify>>> {
        // The map holds weak references only: a panic elsewhere leaves nothing broken.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn only_the_keys_waiter_is_woken() {
        let w: Arc<Wakers<u32>> = Arc::default();
        let (a, b) = (w.handle(&1), w.handle(&2));
        let (wa, wb) = (a.notified(), b.notified());
        w.wake(&1);
        tokio::time::timeout(Duration::from_secs(5), wa)
            .await
            .expect("the waiter on 1 is woken");
        assert!(
            tokio::time::timeout(Duration::from_millis(50), wb)
                .await
                .is_err(),
            "the waiter on 2 sleeps on"
        );
        // Waking a key nobody waits on is a no-op, and one woken before the wait is
        // not remembered (the waiter looks at the database after creating its future).
        w.wake(&3);
    }

    #[test]
    fn keys_nobody_waits_on_are_swept() {
        let w: Wakers<usize> = Wakers::default();
        for k in 0..SWEEP_AT * 4 {
            drop(w.handle(&k));
        }
        assert!(w.len() <= SWEEP_AT + 1, "{}", w.len());
        let held: Vec<_> = (0..10).map(|k| w.handle(&k)).collect();
        assert!(Arc::ptr_eq(&held[3], &w.handle(&3)), "one Notify per key");
    }
}
