//! Login throttling: failed logins are counted per login name and per client address in
//! a sliding window; past the limit, logins are refused for a while, even with the right
//! password. Names that do not exist are counted like those that do, so a lockout tells
//! nothing about which accounts exist.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct Limits {
    pub window: Duration,
    /// Failures for one login name within the window before it is locked.
    pub per_login: u32,
    /// Failures from one address within the window before it is refused.
    pub per_address: u32,
    pub lockout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            window: Duration::from_secs(15 * 60),
            per_login: 5,
            per_address: 20,
            lockout: Duration::from_secs(15 * 60),
        }
    }
}

#[derive(Default)]
struct Record {
    failures: Vec<Instant>,
    locked_until: Option<Instant>,
}

/// Keys are kept for at most this many entries; the oldest go first.
const MAX_KEYS: usize = 100_000;

#[derive(Default)]
pub struct LoginGuard {
    limits: Limits,
    logins: Mutex<HashMap<String, Record>>,
    addresses: Mutex<HashMap<IpAddr, Record>>,
}

impl LoginGuard {
    pub fn new(limits: Limits) -> Self {
        LoginGuard {
            limits,
            ..LoginGuard::default()
        }
    }

    /// `Some(wait)` when a login with this name or from this address must be refused now.
    pub fn check(&self, login: &str, addr: Option<IpAddr>) -> Option<Duration> {
        let now = Instant::now();
        let by_login = self
            .logins
            .lock()
            .ok()
            .and_then(|m| m.get(&login.to_lowercase()).and_then(|r| r.locked_until))
            .and_then(|t| t.checked_duration_since(now));
        let by_addr = addr.and_then(|a| {
            self.addresses
                .lock()
                .ok()
                .and_then(|m| m.get(&a).and_then(|r| r.locked_until))
                .and_then(|t| t.checked_duration_since(now))
        });
        by_login.max(by_addr)
    }

    pub fn failed(&self, login: &str, addr: Option<IpAddr>) {
        let now = Instant::now();
        if let Ok(mut m) = self.logins.lock() {
            note(
                &mut m,
                login.to_lowercase(),
                now,
                self.limits.per_login,
                &self.limits,
            );
        }
        if let (Some(a), Ok(mut m)) = (addr, self.addresses.lock()) {
            note(&mut m, a, now, self.limits.per_address, &self.limits);
        }
    }

    pub fn succeeded(&self, login: &str) {
        if let Ok(mut m) = self.logins.lock() {
            m.remove(&login.to_lowercase());
        }
    }
}

fn note<K: std::hash::Hash + Eq>(
    m: &mut HashMap<K, Record>,
    key: K,
    now: Instant,
    limit: u32,
    limits: &Limits,
) {
    if m.len() >= MAX_KEYS {
        // Under a spray of names, forget the unlocked ones first.
        m.retain(|_, r| r.locked_until.is_some_and(|t| t > now));
    }
    let r = m.entry(key).or_default();
    r.failures
        .retain(|t| now.saturating_duration_since(*t) < limits.window);
    r.failures.push(now);
    if r.failures.len() as u32 >= limit {
        r.locked_until = Some(now + limits.lockout);
        r.failures.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locks_a_login_after_the_limit_and_unknown_names_alike() {
        let g = LoginGuard::new(Limits {
            per_login: 3,
            per_address: 100,
            ..Limits::default()
        });
        for name in ["admin", "nobody-by-that-name"] {
            for _ in 0..2 {
                g.failed(name, None);
                assert!(g.check(name, None).is_none());
            }
            g.failed(name, None);
            assert!(g.check(name, None).is_some(), "{name}");
            assert!(g.check(&name.to_uppercase(), None).is_some());
        }
        assert!(g.check("other", None).is_none());
    }

    #[test]
    fn locks_an_address_across_names() {
        let g = LoginGuard::new(Limits {
            per_login: 100,
            per_address: 4,
            ..Limits::default()
        });
        let a: IpAddr = "192.0.2.7".parse().unwrap();
        for i in 0..4 {
            g.failed(&format!("user{i}"), Some(a));
        }
        assert!(g.check("fresh", Some(a)).is_some());
        assert!(
            g.check("fresh", Some("192.0.2.8".parse().unwrap()))
                .is_none()
        );
    }
}
