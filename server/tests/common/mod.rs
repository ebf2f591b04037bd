//! Test harness: a real server on loopback over a real SQLite file or a fresh Postgres
//! database, real node agents (the library's loop, in-process) over fake sysfs trees.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use node_agent::agent::AgentConfig;
use node_agent::fake::{FakeSpec, GpuModel};
use node_agent::hypervisor::HypervisorKind;
use passage_server::config::Config;
use passage_server::services::Ctx;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Duration;
use tempfile::TempDir;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// Runs one async test body on both backends: `both!(name, body_fn)` makes
/// `name_sqlite` and `name_postgres`.
#[macro_export]
macro_rules! both {
    ($name:ident, $body:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                super::$body($crate::common::Backend::Sqlite).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                super::$body($crate::common::Backend::Postgres).await
            }
        }
    };
}

pub fn pg_admin_url() -> String {
    std::env::var("PASSAGE_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A database of its own for one test.
pub struct TestDb {
    pub url: String,
    pub dir: TempDir,
}

impl TestDb {
    pub async fn new(backend: Backend) -> TestDb {
        let dir = tempfile::tempdir().unwrap();
        let url = match backend {
            Backend::Sqlite => format!("sqlite://{}", dir.path().join("passage.db").display()),
            Backend::Postgres => {
                let admin = pg_admin_url();
                let name = format!("passage_t_{}", uuid::Uuid::new_v4().simple());
                let pool = sqlx::PgPool::connect(&admin).await.unwrap_or_else(|e| {
                    panic!(
                        "Postgres at {admin} is needed for this test ({e}); \
                         `cargo xtask test` starts it, or set PASSAGE_TEST_PG_URL"
                    )
                });
                sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&pool)
                    .await
                    .unwrap();
                pool.close().await;
                let base = admin.rsplit_once('/').map(|(b, _)| b).unwrap_or(&admin);
                format!("{base}/{name}")
            }
        };
        TestDb { url, dir }
    }
}

pub struct TestServer {
    pub db: TestDb,
    pub ctx: Ctx,
    pub base: String,
    pub http: reqwest::Client,
    pub admin: String,
    agents: Vec<tokio::task::JoinHandle<()>>,
}

pub const ADMIN_PASSWORD: &str = "admin-password-1";

pub fn fast_config() -> Config {
    Config {
        heartbeat_timeout: Duration::from_secs(30),
        task_timeout: Duration::from_secs(20),
        scrub_grace: Duration::from_secs(3600),
        reconcile_every: Duration::from_millis(500),
        ..Config::default()
    }
}

impl TestServer {
    pub async fn start(backend: Backend, cfg: Config) -> TestServer {
        let db = TestDb::new(backend).await;
        let running =
            passage_server::start(&db.url, "127.0.0.1:0", cfg, Some(ADMIN_PASSWORD.into()))
                .await
                .unwrap();
        let base = format!("http://{}", running.addr);
        let http = reqwest::Client::new();
        let mut s = TestServer {
            db,
            ctx: running.ctx,
            base,
            http,
            admin: String::new(),
            agents: Vec::new(),
        };
        s.admin = s.login("admin", ADMIN_PASSWORD).await;
        s
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub async fn login(&self, login: &str, password: &str) -> String {
        let (st, body) = self
            .call(
                "POST",
                "/v1/auth/login",
                None,
                Some(json!({"login": login, "password": password})),
            )
            .await;
        assert_eq!(st, 200, "login {login}: {body}");
        body["token"].as_str().unwrap().to_string()
    }

    /// One request; answers (status, JSON body or Null).
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut rb = self.http.request(method.parse().unwrap(), self.url(path));
        if let Some(t) = token {
            rb = rb.bearer_auth(t);
        }
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        let resp = rb.send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let v = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        (status, v)
    }

    pub async fn raw(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: &str,
    ) -> (u16, Value) {
        let mut rb = self
            .http
            .request(method.parse().unwrap(), self.url(path))
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(t) = token {
            rb = rb.bearer_auth(t);
        }
        let resp = rb.send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub async fn admin_call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let t = self.admin.clone();
        self.call(method, path, Some(&t), body).await
    }

    pub async fn join_token(&self) -> String {
        let (st, b) = self
            .admin_call("POST", "/v1/servers/join-tokens", None)
            .await;
        assert_eq!(st, 201, "{b}");
        b["token"].as_str().unwrap().to_string()
    }

    /// A node: a fake sysfs tree with `gpus` H100s and the real agent loop serving it.
    /// Returns the node's folder (sysfs/ and state/ inside) once its server shows up.
    pub async fn add_node(&mut self, gpus: u32) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let sysfs = dir.path().join("sysfs");
        let state = dir.path().join("state");
        node_agent::fake::generate(
            &sysfs,
            &FakeSpec {
                gpus,
                model: GpuModel::H100,
                numa_nodes: 2,
            },
        )
        .unwrap();
        let before = self.server_uuids().await;
        let cfg = AgentConfig {
            server_url: self.base.clone(),
            join_token: self.join_token().await,
            sysfs_root: sysfs.clone(),
            state_dir: state.clone(),
            hypervisor: HypervisorKind::Sim,
            heartbeat: Duration::from_secs(1),
            hostname: format!("node-{}", self.agents.len()),
            ca_cert: None,
        };
        self.agents.push(tokio::spawn(async move {
            if let Err(e) = node_agent::agent::run(cfg).await {
                eprintln!("agent stopped: {e}");
            }
        }));
        let uuid = wait_for(Duration::from_secs(20), || async {
            let now = self.server_uuids().await;
            now.into_iter().find(|u| !before.contains(u))
        })
        .await
        .expect("the node registered");
        // Its inventory arrives right after registration.
        wait_for(Duration::from_secs(20), || async {
            let (_, s) = self
                .admin_call("GET", &format!("/v1/servers/{uuid}"), None)
                .await;
            (s["sysinfo"]["PCI Devices"].as_array().map_or(0, Vec::len) > 0).then_some(())
        })
        .await
        .expect("the node reported its inventory");
        Node {
            uuid,
            sysfs,
            state,
            _dir: dir,
        }
    }

    /// A node registered by hand (no agent loop: its tasks are never answered) that
    /// reported the inventory of a fake tree of `gpus` H100s: (server uuid, node
    /// credential, devices reported).
    pub async fn manual_node(&self, gpus: u32) -> (String, String, Vec<passage_model::PciDevice>) {
        self.manual_node_with(gpus, None).await
    }

    /// [`Self::manual_node`] that also reports `host` (`{"cpus": …, "memory_mib": …}`).
    pub async fn manual_node_with(
        &self,
        gpus: u32,
        host: Option<Value>,
    ) -> (String, String, Vec<passage_model::PciDevice>) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sys");
        let spec = FakeSpec {
            gpus,
            model: GpuModel::H100,
            numa_nodes: 2,
        };
        node_agent::fake::generate(&root, &spec).unwrap();
        let devices = node_agent::host::discover(&root).devices;
        let jt = self.join_token().await;
        let body = json!({"join_token": jt, "hostname": "cn-manual", "agent_version": "t",
                          "protocol_version": 1});
        let (st, reg) = self
            .call("POST", "/agent/v1/register", None, Some(body))
            .await;
        assert_eq!(st, 201, "{reg}");
        let cred = reg["credential"].as_str().unwrap().to_string();
        let uuid = reg["server_uuid"].as_str().unwrap().to_string();
        let mut inventory = json!({ "devices": devices });
        if let Some(h) = host {
            inventory["host"] = h;
        }
        let (st, e) = self
            .call("PUT", "/agent/v1/inventory", Some(&cred), Some(inventory))
            .await;
        assert_eq!(st, 204, "{e}");
        (uuid, cred, devices)
    }

    pub async fn server_uuids(&self) -> Vec<String> {
        let (_, b) = self.admin_call("GET", "/v1/servers", None).await;
        b.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s["uuid"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }

    pub async fn server(&self, uuid: &str) -> Value {
        let (st, s) = self
            .admin_call("GET", &format!("/v1/servers/{uuid}"), None)
            .await;
        assert_eq!(st, 200, "{s}");
        s
    }

    /// Variant `NVIDIA_H100` and package `gpu-<n>x` asking for `n` of it.
    pub async fn h100_catalog(&self, n: u32) -> String {
        let (st, b) = self
            .admin_call(
                "POST",
                "/v1/variants",
                Some(json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330"})),
            )
            .await;
        assert!(st == 201 || st == 409, "{st} {b}");
        let name = format!("gpu-{n}x");
        let (st, b) = self
            .admin_call(
                "POST",
                "/v1/packages",
                Some(
                    json!({"name": name, "vcpus": 4, "memory_mib": 4096, "disk_gib": 10,
                            "devices": {"NVIDIA_H100": n}}),
                ),
            )
            .await;
        assert_eq!(st, 201, "{b}");
        name
    }

    pub async fn tenant(&self, login: &str) -> (String, String) {
        let (st, b) = self
            .admin_call(
                "POST",
                "/v1/accounts",
                Some(json!({"login": login, "password": "tenant-password", "role": "tenant"})),
            )
            .await;
        assert_eq!(st, 201, "{b}");
        let uuid = b["uuid"].as_str().unwrap().to_string();
        (uuid, self.login(login, "tenant-password").await)
    }

    pub async fn wait_job(&self, job: &str) -> Value {
        wait_for(Duration::from_secs(60), || async {
            let (_, j) = self
                .admin_call("GET", &format!("/v1/jobs/{job}"), None)
                .await;
            matches!(j["state"].as_str(), Some("succeeded" | "failed")).then_some(j)
        })
        .await
        .unwrap_or_else(|| panic!("job {job} did not end"))
    }

    /// Device states of a server's assignable devices, by id.
    pub async fn device_states(&self, server: &str) -> Vec<(String, String, Option<String>)> {
        let s = self.server(server).await;
        s["assignable_devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                (
                    d["id"].as_str().unwrap().to_string(),
                    d["state"].as_str().unwrap().to_string(),
                    d["used_by"].as_str().map(String::from),
                )
            })
            .collect()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        for a in &self.agents {
            a.abort();
        }
    }
}

pub struct Node {
    pub uuid: String,
    pub sysfs: PathBuf,
    pub state: PathBuf,
    _dir: TempDir,
}

impl Node {
    /// The driver bound to a device, read from the fake tree as the kernel shows it.
    pub fn driver_of(&self, device_id: &str) -> Option<String> {
        let dir = self.sysfs.join(device_id.trim_start_matches('/'));
        std::fs::read_link(dir.join("driver"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
    }

    /// VMs the node's simulated hypervisor is running.
    pub fn running_vms(&self) -> Vec<String> {
        node_agent::hypervisor::SimHypervisor::open(&self.state, None)
            .map(|h| {
                use node_agent::hypervisor::Hypervisor;
                h.running().iter().map(ToString::to_string).collect()
            })
            .unwrap_or_default()
    }
}

pub async fn wait_for<T, F, Fut>(limit: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
