//! What the benchmarks that boot guests share (`bench_images`, `bench_ssh`): the API as
//! one account sees it, medians, and the processes to kill when a bench ends.

use super::post;
use serde_json::Value;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The median; NaN for none.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The processes this bench started; killed when it ends, however it ends. QEMU
/// processes outlive an agent by design, so those of the bench's VMs are killed too.
pub struct Cleanup {
    pub children: Vec<Child>,
    /// Agents' (or the bench's own) `qemu/` folders, one per VM with its `qemu.pid`.
    pub qemu_dirs: Vec<PathBuf>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for c in self.children.iter_mut().rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for dir in &self.qemu_dirs {
            let Ok(dirs) = std::fs::read_dir(dir) else {
                continue;
            };
            for d in dirs.flatten() {
                let Ok(pid) = std::fs::read_to_string(d.path().join("qemu.pid")) else {
                    continue;
                };
                let pid = pid.trim();
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                // Only a QEMU of ours: a pid file may outlive its process.
                let name = d.file_name().to_string_lossy().to_string();
                if String::from_utf8_lossy(&cmdline).contains(&name) {
                    let _ = Command::new("kill").arg(pid).status();
                }
            }
        }
    }
}

/// An account's view of the API: each call asserts success.
pub struct Api {
    pub http: reqwest::Client,
    pub base: String,
    pub token: String,
}

impl Api {
    pub async fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> T {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "GET {path}: {}", r.status());
        r.json().await.unwrap()
    }

    pub async fn post(&self, path: &str, body: Value) -> Value {
        let (st, v) = post(
            &self.http,
            &format!("{}{path}", self.base),
            Some(&self.token),
            body,
        )
        .await;
        assert!((200..300).contains(&st), "POST {path}: {st} {v}");
        v
    }

    /// Polls `f` every 20 ms until it answers, or panics after `limit`.
    pub async fn wait<T, F, Fut>(&self, what: &str, limit: Duration, mut f: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let t = Instant::now();
        loop {
            if let Some(v) = f().await {
                return v;
            }
            assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn delete(&self, path: &str) {
        let r = self
            .http
            .delete(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "DELETE {path}: {}", r.status());
    }
}
