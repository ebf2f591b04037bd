//! A network namespace a test makes for itself, and a way to run a test inside one: the
//! test binary runs that one test again under `ip netns exec`, which also mounts a `/sys`
//! showing the namespace's interfaces (where the agent reads bridges and taps). Nothing a
//! test does there reaches the host's network.
//!
//! Namespaces need root and iproute2. Where they cannot be made the tests skip with a
//! note, except in CI (`CI` set), where they fail unless `PASSAGE_ALLOW_NO_NETNS=1`.

use std::process::{Command, Output};

/// Set in the copy of the test binary that runs inside the namespace, to its name.
const CHILD_ENV: &str = "PASSAGE_TEST_NETNS";

/// The namespace this process runs in, when it is the copy started by [`NetNs::run_test`].
pub fn inside() -> Option<String> {
    std::env::var(CHILD_ENV).ok()
}

/// The test's name as libtest knows it: `module_path!()` without the crate.
pub fn test_name(module_path: &str, f: &str) -> String {
    let m = module_path.split_once("::").map_or(module_path, |(_, m)| m);
    format!("{m}::{f}")
}

pub struct NetNs {
    pub name: String,
}

fn skip_or_fail(why: &str) -> Option<NetNs> {
    let allowed = std::env::var("PASSAGE_ALLOW_NO_NETNS").as_deref() == Ok("1");
    if allowed || std::env::var_os("CI").is_none() {
        eprintln!("note: SKIPPED: {why} (network namespaces need root and iproute2)");
        return None;
    }
    panic!("{why}: network namespaces need root and iproute2; or set PASSAGE_ALLOW_NO_NETNS=1");
}

impl NetNs {
    /// A new namespace with a unique name; removed on drop, with whatever runs in it.
    pub fn new(tag: &str) -> Option<NetNs> {
        // Unique across concurrent tests and runs: the pid and a random tail.
        let name = format!(
            "pst-{tag}-{}-{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        match Command::new("ip").args(["netns", "add", &name]).output() {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                return skip_or_fail(&format!(
                    "cannot make a network namespace: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                ));
            }
            Err(e) => return skip_or_fail(&format!("cannot run ip: {e}")),
        }
        let ns = NetNs { name };
        ns.ip_ok(&["link", "set", "dev", "lo", "up"]);
        Some(ns)
    }

    /// `ip -n NS ARGS`.
    pub fn ip(&self, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["-n", &self.name])
            .args(args)
            .output()
            .unwrap()
    }

    pub fn ip_ok(&self, args: &[&str]) {
        let o = self.ip(args);
        assert!(
            o.status.success(),
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr)
        );
    }

    /// Runs test `name` of this binary again inside the namespace and fails if it fails;
    /// its output goes where ours does.
    pub fn run_test(&self, name: &str) {
        let exe = std::env::current_exe().unwrap();
        let status = Command::new("ip")
            .args(["netns", "exec", &self.name])
            .arg(&exe)
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &self.name)
            .status()
            .unwrap();
        assert!(status.success(), "{name} inside {}: {status}", self.name);
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // What a failed test left running in it (QEMU): each was started by the test.
        if let Ok(o) = Command::new("ip")
            .args(["netns", "pids", &self.name])
            .output()
        {
            for pid in String::from_utf8_lossy(&o.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-KILL", pid]).status();
            }
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}
