//! Test harness: a real server on loopback over a real SQLite file or a fresh Postgres
//! database, real node agents (the library's loop, in-process) over fake sysfs trees,
//! and typed calls: `s.get::<Vm>(path)`, `s.with(&token).post::<Vm>(path, &body)` answer
//! a [`Reply`] whose body is the model's type, or the error body.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use node_agent::agent::AgentConfig;
use node_agent::fake::{FakeSpec, GpuModel};
use node_agent::hypervisor::HypervisorKind;
use passage_model::api::{Account, Job, JobState, JoinToken, LoginResponse, Package, Server};
use passage_model::protocol::RegisterResponse;
use passage_model::{
    AccountId, ApiErrorBody, DevicePath, DeviceState, ErrorCode, JobId, PciDevice, ServerId,
    Variant, VmId,
};
use passage_server::config::Config;
use passage_server::services::Ctx;
use serde::Serialize;
use serde::de::DeserializeOwned;
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
    pub async fn start(backend: Backend, mut cfg: Config) -> TestServer {
        let db = TestDb::new(backend).await;
        // Each test its own image directory, on Postgres too (its default is ./images).
        if cfg.image_dir.is_none() {
            cfg.image_dir = Some(db.dir.path().join("images"));
        }
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

    /// Calls made with `token` (none: anonymous). The client owns what it needs, so a
    /// task of its own can use it.
    pub fn client(&self, token: Option<&str>) -> Client {
        Client {
            http: self.http.clone(),
            base: self.base.clone(),
            token: token.map(String::from),
        }
    }

    /// Calls made with `token`.
    pub fn with(&self, token: &str) -> Client {
        self.client(Some(token))
    }

    /// Calls made as the operator `admin`.
    pub fn as_admin(&self) -> Client {
        self.client(Some(&self.admin))
    }

    /// `GET` as `admin`.
    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Reply<T> {
        self.as_admin().get(path).await
    }

    /// `POST` with a JSON body as `admin`.
    pub async fn post<T: DeserializeOwned>(&self, path: &str, body: &impl Serialize) -> Reply<T> {
        self.as_admin().post(path, body).await
    }

    /// `PUT` with a JSON body as `admin`.
    pub async fn put<T: DeserializeOwned>(&self, path: &str, body: &impl Serialize) -> Reply<T> {
        self.as_admin().put(path, body).await
    }

    /// `PATCH` with a JSON body as `admin`.
    pub async fn patch<T: DeserializeOwned>(&self, path: &str, body: &impl Serialize) -> Reply<T> {
        self.as_admin().patch(path, body).await
    }

    /// `DELETE` as `admin`.
    pub async fn delete<T: DeserializeOwned>(&self, path: &str) -> Reply<T> {
        self.as_admin().delete(path).await
    }

    /// One request, its answer as JSON whatever it is: for the tests that look at what
    /// the typed calls would hide (documents, answers that are not the contract's).
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

    pub async fn login(&self, login: &str, password: &str) -> String {
        let body = json!({"login": login, "password": password});
        let r: LoginResponse = self
            .client(None)
            .post("/v1/auth/login", &body)
            .await
            .ok(200);
        r.token
    }

    /// `/metrics` as the operator reads it (Prometheus text).
    pub async fn metrics(&self) -> String {
        self.http
            .get(self.url("/metrics"))
            .bearer_auth(&self.admin)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    pub async fn join_token(&self) -> String {
        let t: JoinToken = self
            .as_admin()
            .post_empty("/v1/servers/join-tokens")
            .await
            .ok(201);
        t.token
    }

    /// A node: a fake sysfs tree with `gpus` H100s and the real agent loop serving it.
    /// Returns the node's folder (sysfs/ and state/ inside) once its server shows up.
    pub async fn add_node(&mut self, gpus: u32) -> Node {
        self.add_node_from(
            gpus,
            GpuModel::H100,
            &node_agent::fake::FakeOptions::default(),
        )
        .await
    }

    /// [`Self::add_node`] with GPUs of `model` generated with `opts` (vGPU hosts…).
    pub async fn add_node_from(
        &mut self,
        gpus: u32,
        model: GpuModel,
        opts: &node_agent::fake::FakeOptions,
    ) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let sysfs = dir.path().join("sysfs");
        let state = dir.path().join("state");
        node_agent::fake::generate_with(
            &sysfs,
            &FakeSpec {
                gpus,
                model,
                numa_nodes: 2,
            },
            opts,
        )
        .unwrap();
        let before = self.server_uuids().await;
        self.run_agent(&sysfs, &state).await;
        let uuid = wait_for(Duration::from_secs(20), || async {
            let now = self.server_uuids().await;
            now.into_iter().find(|u| !before.contains(u))
        })
        .await
        .expect("the node registered");
        // Its inventory arrives right after registration.
        wait_for(Duration::from_secs(20), || async {
            let s: Server = self.get(&format!("/v1/servers/{uuid}")).await.ok(200);
            s.sysinfo
                .is_some_and(|i| !i.pci_devices.is_empty())
                .then_some(())
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

    /// Runs the agent loop of a node over `sysfs`, keeping its credential in `state` (a
    /// node that registered before goes on as itself).
    async fn run_agent(&mut self, sysfs: &std::path::Path, state: &std::path::Path) {
        let cfg = AgentConfig {
            server_url: self.base.clone(),
            join_token: self.join_token().await,
            sysfs_root: sysfs.to_path_buf(),
            state_dir: state.to_path_buf(),
            hypervisor: HypervisorKind::Sim,
            heartbeat: Duration::from_secs(1),
            inventory_every: Duration::from_secs(1),
            hostname: format!("node-{}", self.agents.len()),
            ca_cert: None,
        };
        self.agents.push(tokio::spawn(async move {
            if let Err(e) = node_agent::agent::run(cfg).await {
                eprintln!("agent stopped: {e}");
            }
        }));
    }

    /// Stops every node's agent loop, as a node that went away would: tasks queued for
    /// them wait until [`Self::resume_agent`].
    pub fn pause_agents(&mut self) {
        for a in self.agents.drain(..) {
            a.abort();
        }
    }

    /// Runs `node`'s agent loop again after [`Self::pause_agents`].
    pub async fn resume_agent(&mut self, node: &Node) {
        self.run_agent(&node.sysfs, &node.state).await;
    }

    /// A node registered by hand (no agent loop: its tasks are never answered) that
    /// reported the inventory of a fake tree of `gpus` H100s: (server uuid, node
    /// credential, devices reported).
    pub async fn manual_node(&self, gpus: u32) -> (ServerId, String, Vec<PciDevice>) {
        self.manual_node_with(gpus, None).await
    }

    /// [`Self::manual_node`] that also reports `host` (`{"cpus": …, "memory_mib": …}`).
    pub async fn manual_node_with(
        &self,
        gpus: u32,
        host: Option<Value>,
    ) -> (ServerId, String, Vec<PciDevice>) {
        self.manual_node_from(gpus, host, &node_agent::fake::FakeOptions::default())
            .await
    }

    /// [`Self::manual_node_with`] over a tree generated with `opts` (vGPU hosts…).
    pub async fn manual_node_from(
        &self,
        gpus: u32,
        host: Option<Value>,
        opts: &node_agent::fake::FakeOptions,
    ) -> (ServerId, String, Vec<PciDevice>) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sys");
        let spec = FakeSpec {
            gpus,
            model: GpuModel::H100,
            numa_nodes: 2,
        };
        node_agent::fake::generate_with(&root, &spec, opts).unwrap();
        self.register_tree(&root, host).await
    }

    /// A node registered by hand that reported the inventory of the tree at `root` (and
    /// `host`): (server uuid, node credential, devices reported). No agent loop runs.
    pub async fn register_tree(
        &self,
        root: &std::path::Path,
        host: Option<Value>,
    ) -> (ServerId, String, Vec<PciDevice>) {
        let devices = node_agent::host::discover(root).devices;
        let jt = self.join_token().await;
        let body = json!({"join_token": jt, "hostname": "cn-manual", "agent_version": "t",
                          "protocol_version": 1});
        let reg: RegisterResponse = self
            .client(None)
            .post("/agent/v1/register", &body)
            .await
            .ok(201);
        let mut inventory = json!({ "devices": devices });
        if let Some(h) = host {
            inventory["host"] = h;
        }
        self.with(&reg.credential)
            .put::<()>("/agent/v1/inventory", &inventory)
            .await
            .ok(204);
        (reg.server_uuid, reg.credential, devices)
    }

    pub async fn server_uuids(&self) -> Vec<ServerId> {
        let servers: Vec<Server> = self.get("/v1/servers").await.ok(200);
        servers.into_iter().map(|s| s.uuid).collect()
    }

    pub async fn server(&self, uuid: ServerId) -> Server {
        self.get(&format!("/v1/servers/{uuid}")).await.ok(200)
    }

    /// Variant `NVIDIA_H100` and package `gpu-<n>x` asking for `n` of it.
    pub async fn h100_catalog(&self, n: u32) -> String {
        // VMs boot an image: the harness's is there for the VMs of this package.
        self.image().await;
        let r: Reply<Variant> = self
            .post(
                "/v1/variants",
                &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330"}),
            )
            .await;
        assert!(r.status == 201 || r.status == 409, "{r:?}");
        let name = format!("gpu-{n}x");
        let _: Package = self
            .post(
                "/v1/packages",
                &json!({"name": name, "vcpus": 4, "memory_mib": 4096, "disk_gib": 10,
                        "devices": {"NVIDIA_H100": n}}),
            )
            .await
            .ok(201);
        name
    }

    /// An active public raw image `test-image` (version 1, 1 MiB of a pattern), created
    /// and uploaded on first use; its name is what VM creations send.
    pub async fn image(&self) -> String {
        create_test_image(&self.as_admin()).await
    }

    /// Makes `vm` one created before images existed (no image, so no boot disk): for
    /// tests of what only such VMs may still do (move to another node).
    pub async fn forget_image(&self, vm: VmId) {
        let sql = "UPDATE vms SET image_uuid = NULL WHERE uuid = $1";
        match &self.ctx.db {
            passage_server::store::Db::Sqlite { write, .. } => {
                sqlx::query(sql)
                    .bind(vm.to_string())
                    .execute(write)
                    .await
                    .unwrap();
            }
            passage_server::store::Db::Postgres(p) => {
                sqlx::query(sql)
                    .bind(vm.to_string())
                    .execute(p)
                    .await
                    .unwrap();
            }
        }
    }

    /// How many tasks wait for `server` to take them.
    pub async fn queued_tasks(&self, server: ServerId) -> i64 {
        let sql = "SELECT COUNT(*) FROM tasks WHERE server_uuid = $1 AND state = 'queued'";
        match &self.ctx.db {
            passage_server::store::Db::Sqlite { read, .. } => sqlx::query_scalar(sql)
                .bind(server.to_string())
                .fetch_one(read)
                .await
                .unwrap(),
            passage_server::store::Db::Postgres(p) => sqlx::query_scalar(sql)
                .bind(server.to_string())
                .fetch_one(p)
                .await
                .unwrap(),
        }
    }

    /// A tenant account `login` (password `tenant-password`) and a session of it.
    pub async fn tenant(&self, login: &str) -> (AccountId, String) {
        let a: Account = self
            .post(
                "/v1/accounts",
                &json!({"login": login, "password": "tenant-password", "role": "tenant"}),
            )
            .await
            .ok(201);
        (a.uuid, self.login(login, "tenant-password").await)
    }

    /// A read-only operator account `login` (password `reader-password`) and a session of
    /// it.
    pub async fn reader(&self, login: &str) -> String {
        self.post::<Account>(
            "/v1/accounts",
            &json!({"login": login, "password": "reader-password", "role": "reader"}),
        )
        .await
        .ok(201);
        self.login(login, "reader-password").await
    }

    /// `job` once it has ended, either way.
    pub async fn wait_job(&self, job: JobId) -> Job {
        wait_for(Duration::from_secs(60), || async {
            let j: Job = self.get(&format!("/v1/jobs/{job}")).await.ok(200);
            matches!(j.state, JobState::Succeeded | JobState::Failed).then_some(j)
        })
        .await
        .unwrap_or_else(|| panic!("job {job} did not end"))
    }

    /// The states of a server's assignable devices: (id, state, the VM holding it).
    pub async fn device_states(
        &self,
        server: ServerId,
    ) -> Vec<(DevicePath, DeviceState, Option<VmId>)> {
        self.server(server)
            .await
            .assignable_devices
            .unwrap_or_default()
            .into_iter()
            .map(|d| (d.id, d.state, d.used_by))
            .collect()
    }

    /// Checks that the free-device index placement reads (kept by adding and subtracting
    /// as devices move) is what a recount of the devices makes it (rows of 0 left out).
    pub async fn assert_free_index_exact(&self, what: &str) {
        assert_free_index_exact(&self.ctx.db, what).await;
    }
}

/// [`TestServer::assert_free_index_exact`] on a database of the caller's.
pub async fn assert_free_index_exact(db: &passage_server::store::Db, what: &str) {
    use passage_server::store::Db;
    let kept = "SELECT server_uuid, variant, CAST(free AS BIGINT) FROM free_devices \
                WHERE free <> 0 ORDER BY 1, 2";
    let counted = "SELECT server_uuid, variant, CAST(COUNT(*) AS BIGINT) FROM devices \
                   WHERE variant IS NOT NULL AND state = 'unassigned' AND missing = 0 \
                   AND taint IS NULL GROUP BY server_uuid, variant ORDER BY 1, 2";
    type Rows = Vec<(String, String, i64)>;
    let (kept, counted): (Rows, Rows) = match db {
        Db::Sqlite { read, .. } => (
            sqlx::query_as(kept).fetch_all(read).await.unwrap(),
            sqlx::query_as(counted).fetch_all(read).await.unwrap(),
        ),
        Db::Postgres(p) => (
            sqlx::query_as(kept).fetch_all(p).await.unwrap(),
            sqlx::query_as(counted).fetch_all(p).await.unwrap(),
        ),
    };
    assert_eq!(
        kept, counted,
        "{what}: the free-device index against a recount"
    );
}

/// Calls to the server with one token (or none).
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Client {
    /// Calls to a server this harness did not start (a `server` process), at `base`.
    pub fn at(base: &str, token: Option<&str>) -> Client {
        Client {
            http: reqwest::Client::new(),
            base: base.to_string(),
            token: token.map(String::from),
        }
    }

    /// One request with an optional body (JSON text); its answer decoded as `T` (a success) or
    /// as the error body every failure carries.
    pub async fn send<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<String>,
    ) -> Reply<T> {
        let mut rb = self
            .http
            .request(method.parse().unwrap(), format!("{}{path}", self.base));
        if let Some(t) = &self.token {
            rb = rb.bearer_auth(t);
        }
        if let Some(b) = body {
            rb = rb.header("content-type", "application/json").body(b);
        }
        Reply::from(rb.send().await.unwrap()).await
    }

    /// A request whose body is `text` as it is, sent as JSON: for bodies that are not
    /// what any request type would write.
    pub async fn raw<T: DeserializeOwned>(&self, method: &str, path: &str, text: &str) -> Reply<T> {
        let mut rb = self
            .http
            .request(method.parse().unwrap(), format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(text.to_string());
        if let Some(t) = &self.token {
            rb = rb.bearer_auth(t);
        }
        Reply::from(rb.send().await.unwrap()).await
    }

    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Reply<T> {
        self.send("GET", path, None).await
    }

    /// `PUT` of raw bytes (an image file), with an optional `x-content-sha256`.
    pub async fn put_bytes<T: DeserializeOwned>(
        &self,
        path: &str,
        bytes: Vec<u8>,
        sha256: Option<&str>,
    ) -> Reply<T> {
        let mut rb = self
            .http
            .put(format!("{}{path}", self.base))
            .header("content-type", "application/octet-stream")
            .body(bytes);
        if let Some(h) = sha256 {
            rb = rb.header("x-content-sha256", h);
        }
        if let Some(t) = &self.token {
            rb = rb.bearer_auth(t);
        }
        Reply::from(rb.send().await.unwrap()).await
    }

    /// The raw answer to a `GET` (a file), with its status and headers.
    pub async fn get_raw(&self, path: &str, range: Option<&str>) -> reqwest::Response {
        let mut rb = self.http.get(format!("{}{path}", self.base));
        if let Some(r) = range {
            rb = rb.header("range", r);
        }
        if let Some(t) = &self.token {
            rb = rb.bearer_auth(t);
        }
        rb.send().await.unwrap()
    }

    /// `GET` with query parameters, encoded as a form (a NUL becomes `%00`).
    pub async fn get_query<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, &str)],
    ) -> Reply<T> {
        let mut rb = self.http.get(format!("{}{path}", self.base)).query(query);
        if let Some(t) = &self.token {
            rb = rb.bearer_auth(t);
        }
        Reply::from(rb.send().await.unwrap()).await
    }

    pub async fn post<T: DeserializeOwned>(&self, path: &str, body: &impl Serialize) -> Reply<T> {
        self.send("POST", path, Some(json_text(body))).await
    }

    /// `POST` without a body.
    pub async fn post_empty<T: DeserializeOwned>(&self, path: &str) -> Reply<T> {
        self.send("POST", path, None).await
    }

    pub async fn put<T: DeserializeOwned>(&self, path: &str, body: &impl Serialize) -> Reply<T> {
        self.send("PUT", path, Some(json_text(body))).await
    }

    pub async fn patch<T: DeserializeOwned>(&self, path: &str, body: &impl Serialize) -> Reply<T> {
        self.send("PATCH", path, Some(json_text(body))).await
    }

    pub async fn delete<T: DeserializeOwned>(&self, path: &str) -> Reply<T> {
        self.send("DELETE", path, None).await
    }
}

/// The harness's image `test-image` through `op` (an operator's client), unless it is
/// there already; its name.
pub async fn create_test_image(op: &Client) -> String {
    let name = "test-image";
    let have: Vec<passage_model::images::Image> =
        op.get(&format!("/v1/images?name={name}")).await.ok(200);
    if have
        .iter()
        .any(|i| i.state == passage_model::images::ImageState::Active)
    {
        return name.into();
    }
    let img: passage_model::images::Image = op
        .post(
            "/v1/images",
            &json!({"name": name, "version": "1", "os": "linux", "type": "raw",
                    "public": true}),
        )
        .await
        .ok(201);
    let _: passage_model::images::Image = op
        .put_bytes(
            &format!("/v1/images/{}/file", img.uuid),
            test_image_bytes(),
            None,
        )
        .await
        .ok(200);
    name.into()
}

/// The bytes of the harness's test image: 1 MiB, not all zero, not qcow2.
pub fn test_image_bytes() -> Vec<u8> {
    (0..1024 * 1024u32).map(|i| (i % 251) as u8).collect()
}

fn json_text(body: &impl Serialize) -> String {
    serde_json::to_string(body).unwrap()
}

/// An answer: its status and headers, and its body decoded as `T` when the call
/// succeeded (2xx; an empty body decodes as `()`) or as [`ApiErrorBody`] when it failed.
/// A body that is neither fails the test: the contract says what every answer holds.
pub struct Reply<T> {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Result<T, ApiErrorBody>,
    /// The body as it came, for messages.
    pub text: String,
}

impl<T: DeserializeOwned> Reply<T> {
    async fn from(resp: reqwest::Response) -> Reply<T> {
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().await.unwrap();
        let body = if (200..300).contains(&status) {
            let json = if text.is_empty() { "null" } else { &text };
            Ok(serde_json::from_str(json).unwrap_or_else(|e| {
                panic!(
                    "{status}: the answer is no {}: {e}\n{text}",
                    std::any::type_name::<T>()
                )
            }))
        } else {
            Err(serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{status}: the answer is no error body: {e}\n{text}")))
        };
        Reply {
            status,
            headers,
            body,
            text,
        }
    }
}

impl<T> Reply<T> {
    /// The body of a success with exactly this status.
    #[track_caller]
    pub fn ok(self, status: u16) -> T {
        match self.body {
            Ok(v) if self.status == status => v,
            _ => panic!("expected {status}, got {}: {}", self.status, self.text),
        }
    }

    /// The error of a failure with exactly this status.
    #[track_caller]
    pub fn err(self, status: u16) -> ApiErrorBody {
        match self.body {
            Err(e) if self.status == status => e,
            _ => panic!("expected {status}, got {}: {}", self.status, self.text),
        }
    }

    /// The error of a failure with exactly this status and code.
    #[track_caller]
    pub fn fails(self, status: u16, code: ErrorCode) -> ApiErrorBody {
        let e = self.err(status);
        assert_eq!(e.code, code, "{e:?}");
        e
    }

    /// A 400 `InvalidArgument` that names `field`.
    #[track_caller]
    pub fn invalid(self, field: &str) -> ApiErrorBody {
        let e = self.fails(400, ErrorCode::InvalidArgument);
        assert_eq!(e.field.as_deref(), Some(field), "{e:?}");
        e
    }

    /// A 404 `ResourceNotFound` that names `field`: the body named what does not exist.
    #[track_caller]
    pub fn missing(self, field: &str) -> ApiErrorBody {
        let e = self.fails(404, ErrorCode::ResourceNotFound);
        assert_eq!(e.field.as_deref(), Some(field), "{e:?}");
        e
    }

    /// The error's code, when the call failed.
    pub fn code(&self) -> Option<ErrorCode> {
        self.body.as_ref().err().map(|e| e.code)
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

impl<T> std::fmt::Debug for Reply<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.text)
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
    pub uuid: ServerId,
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

/// A child process killed (and reaped) when dropped.
pub struct Proc(pub std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `node-agent` binary built beside the server's.
pub fn node_agent_bin() -> PathBuf {
    let p = std::path::Path::new(env!("CARGO_BIN_EXE_server")).with_file_name("node-agent");
    assert!(
        p.exists(),
        "{} is missing: build the binaries first (cargo build --workspace --bins; \
         cargo xtask test does)",
        p.display()
    );
    p
}

/// `node-agent run` joining `server` with `token`, on the tree at `sysfs`, keeping its
/// state in `state`, heartbeating and reading its inventory every second; callers add
/// the hypervisor, hostname and environment they need.
pub fn agent_command(
    server: &str,
    token: &str,
    sysfs: &std::path::Path,
    state: &std::path::Path,
) -> std::process::Command {
    let mut cmd = std::process::Command::new(node_agent_bin());
    cmd.args(["run", "--server", server, "--join-token", token])
        .arg("--sysfs-root")
        .arg(sysfs)
        .arg("--state-dir")
        .arg(state)
        .args(["--heartbeat-secs", "1", "--inventory-secs", "1"]);
    cmd
}

// Guests on a network of the test's own (the real-guest tests).

pub fn sh(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn ip(args: &[&str]) -> String {
    sh(std::process::Command::new("ip").args(args))
}

/// Moves this thread (and the threads and processes it starts after) into a new network
/// namespace with loopback up and `bridge` (holding `address`, a CIDR) for VMs to attach to, and a mount namespace with a
/// sysfs of its own: sysfs shows the interfaces of the namespace that mounted it, and the
/// agent finds bridges and taps there. False, with a note, where it cannot (not root); CI
/// fails instead.
pub fn own_network(bridge: &str, address: &str) -> bool {
    use rustix::thread::UnshareFlags;
    // rustix deprecates the safe `unshare` because unsharing the file table (CLONE_FILES)
    // can invalidate borrowed descriptors; new network and mount namespaces touch none,
    // and the workspace forbids `unsafe`.
    #[allow(deprecated)]
    let made = rustix::thread::unshare(UnshareFlags::NEWNET | UnshareFlags::NEWNS);
    if let Err(e) = made {
        assert!(
            std::env::var_os("CI").is_none()
                || std::env::var("PASSAGE_ALLOW_NO_NETNS").as_deref() == Ok("1"),
            "cannot make a network namespace: {e}"
        );
        eprintln!("note: SKIPPED: cannot make a network namespace: {e}");
        return false;
    }
    // Private first, so the new sysfs stays out of the machine's own mount table.
    sh(std::process::Command::new("mount").args(["--make-rprivate", "/"]));
    sh(std::process::Command::new("mount").args(["-t", "sysfs", "sysfs", "/sys"]));
    ip(&["link", "set", "lo", "up"]);
    ip(&["link", "add", bridge, "type", "bridge"]);
    ip(&["addr", "add", address, "dev", bridge]);
    ip(&["link", "set", bridge, "up"]);
    true
}

/// `ssh` as `user` with `key` to `host`, running `script`; its output when it answers.
pub fn ssh(key: &std::path::Path, user: &str, host: &str, script: &str) -> Option<String> {
    let out = std::process::Command::new("ssh")
        .arg("-i")
        .arg(key)
        .args([
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "ConnectTimeout=5",
            "-o",
            "BatchMode=yes",
            "-o",
            "LogLevel=ERROR",
        ])
        .arg(format!("{user}@{host}"))
        .arg(script)
        .stdin(std::process::Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}
