//! Short-lived memory of what nearly every request reads: who a bearer token belongs to,
//! what a package asks for. An entry lives [`TTL`] at most, and this process forgets
//! everything at once when it changes the underlying rows itself; another replica's
//! change is seen within [`TTL`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How stale an entry may be: long enough that a client's burst reads the database once,
/// short enough that a token revoked through another replica stops working at once for
/// any practical purpose.
pub const TTL: Duration = Duration::from_secs(1);
/// Entries kept at most; past this, expired ones go, and if none had, all of them.
const MAX_ENTRIES: usize = 10_000;

pub struct TtlCache<V> {
    map: Mutex<HashMap<String, (Instant, V)>>,
    /// Keys being read from the database now. A burst of requests that all miss (the
    /// first after a start, or every `TTL` under load) waits for one read instead of
    /// sending the same query once per request, and is woken all at once when it is in.
    loading: Mutex<HashMap<String, Arc<tokio::sync::OnceCell<V>>>>,
}

impl<V> Default for TtlCache<V> {
    fn default() -> Self {
        TtlCache {
            map: Mutex::new(HashMap::new()),
            loading: Mutex::new(HashMap::new()),
        }
    }
}

impl<V: Clone> TtlCache<V> {
    pub fn get(&self, key: &str) -> Option<V> {
        let map = self.map.lock().ok()?;
        map.get(key)
            .filter(|(at, _)| at.elapsed() < TTL)
            .map(|(_, v)| v.clone())
    }

    /// The entry for `key`, read by `load` on a miss. Concurrent misses for one key share
    /// one `load`: the first caller reads, the others wait for it and take what it read.
    /// A failed load is not remembered: the next waiter tries again.
    pub async fn get_or_load<E, Fut>(&self, key: &str, load: impl FnOnce() -> Fut) -> Result<V, E>
    where
        Fut: Future<Output = Result<V, E>>,
    {
        if let Some(v) = self.get(key) {
            return Ok(v);
        }
        let cell = self.loading.lock().ok().map(|mut loading| {
            loading
                .entry(key.to_string())
                .or_insert_with(|| Arc::new(tokio::sync::OnceCell::new()))
                .clone()
        });
        let Some(cell) = cell else {
            // A poisoned lock: read alone rather than fail.
            return load().await;
        };
        let r = cell.get_or_try_init(load).await.cloned();
        if let Ok(v) = &r {
            self.put(key, v.clone());
        }
        // The next miss, after `TTL`, reads again; those holding this cell are answered.
        if let Ok(mut loading) = self.loading.lock()
            && loading.get(key).is_some_and(|c| Arc::ptr_eq(c, &cell))
        {
            loading.remove(key);
        }
        r
    }

    pub fn put(&self, key: &str, value: V) {
        if let Ok(mut map) = self.map.lock() {
            if map.len() >= MAX_ENTRIES {
                map.retain(|_, (at, _)| at.elapsed() < TTL);
                if map.len() >= MAX_ENTRIES {
                    map.clear();
                }
            }
            map.insert(key.to_string(), (Instant::now(), value));
        }
    }

    /// Forgets `key`, keeping the rest.
    pub fn forget(&self, key: &str) {
        if let Ok(mut map) = self.map.lock() {
            map.remove(key);
        }
    }

    /// Forgets everything: this process just changed what the entries were read from.
    pub fn clear(&self) {
        if let Ok(mut map) = self.map.lock() {
            map.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn concurrent_misses_share_one_load() {
        let c = Arc::new(TtlCache::<u32>::default());
        let loads = Arc::new(AtomicUsize::new(0));
        let mut waiting = Vec::new();
        for _ in 0..32 {
            let (c, loads) = (c.clone(), loads.clone());
            waiting.push(tokio::spawn(async move {
                c.get_or_load("k", || async {
                    loads.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Ok::<_, ()>(7)
                })
                .await
            }));
        }
        for w in waiting {
            assert_eq!(w.await.ok(), Some(Ok(7)));
        }
        assert_eq!(loads.load(Ordering::SeqCst), 1);
        // A failed load is not kept: the next caller reads again.
        c.forget("k");
        let failed: Result<u32, &str> = c.get_or_load("k", || async { Err("down") }).await;
        assert_eq!(failed, Err("down"));
        let again: Result<u32, &str> = c.get_or_load("k", || async { Ok(8) }).await;
        assert_eq!(again, Ok(8));
        assert!(c.loading.lock().map(|l| l.is_empty()).unwrap_or(false));
    }

    #[test]
    fn entries_are_forgotten() {
        let c = TtlCache::default();
        c.put("a", 1);
        c.put("b", 2);
        assert_eq!(c.get("a"), Some(1));
        c.forget("a");
        assert_eq!(c.get("a"), None);
        assert_eq!(c.get("b"), Some(2));
        c.clear();
        assert_eq!(c.get("b"), None);
        for i in 0..MAX_ENTRIES + 5 {
            c.put(&i.to_string(), i);
        }
        assert!(c.map.lock().map(|m| m.len()).unwrap_or(0) <= MAX_ENTRIES);
    }
}
