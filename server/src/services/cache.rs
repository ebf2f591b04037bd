//! Short-lived memory of what nearly every request reads: who a bearer token belongs to,
//! what a package asks for. An entry lives [`TTL`] at most, and this process forgets
//! everything at once when it changes the underlying rows itself; another replica's
//! change is seen within [`TTL`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How stale an entry may be: long enough that a client's burst reads the database once,
/// short enough that a token revoked through another replica stops working at once for
/// any practical purpose.
pub const TTL: Duration = Duration::from_secs(1);
/// Entries kept at most; past this, expired ones go, and if none had, all of them.
const MAX_ENTRIES: usize = 10_000;

pub struct TtlCache<V> {
    map: Mutex<HashMap<String, (Instant, V)>>,
}

impl<V> Default for TtlCache<V> {
    fn default() -> Self {
        TtlCache {
            map: Mutex::new(HashMap::new()),
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
