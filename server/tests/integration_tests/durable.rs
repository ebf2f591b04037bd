//! Durable jobs: the real server binary killed with SIGKILL at every step boundary of
//! provision and destroy resumes each job on restart; a silent agent times a job out
//! into a clean failure; two replicas on one Postgres never run a job twice.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestDb, TestServer, fast_config, wait_for};
use passage_server::workflows::{DESTROY_STEPS, PROVISION_STEPS};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Server {
    proc: Proc,
    lines: mpsc::Receiver<String>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start(db: &TestDb, port: u16, pause: Option<&str>) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_server"));
    cmd.args([
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--database",
        &db.url,
    ])
    .args(["--job-lease-secs", "1", "--task-timeout-secs", "20"])
    .env("PASSAGE_ADMIN_PASSWORD", "durable-admin-pw")
    .env("RUST_LOG", "warn")
    .stdout(Stdio::piped());
    if let Some(p) = pause {
        cmd.env("PASSAGE_PAUSE_BEFORE", p);
    }
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let s = Server {
        proc: Proc(child),
        lines: rx,
    };
    s.wait_line("Passage listening", Duration::from_secs(30));
    s
}

impl Server {
    fn wait_line(&self, needle: &str, limit: Duration) {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(needle) => return,
                Ok(_) => {}
                Err(_) => panic!("the server never printed {needle:?}"),
            }
        }
    }

    /// SIGKILL: no shutdown, no lease released, nothing flushed but what was committed.
    fn kill9(mut self) {
        self.proc.0.kill().unwrap();
        self.proc.0.wait().unwrap();
    }
}

struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut rb = self
            .http
            .request(method.parse().unwrap(), format!("{}{path}", self.base));
        if let Some(t) = token {
            rb = rb.bearer_auth(t);
        }
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        match rb.send().await {
            Ok(r) => {
                let st = r.status().as_u16();
                (st, r.json().await.unwrap_or(Value::Null))
            }
            Err(_) => (0, Value::Null),
        }
    }

    async fn login(&self) -> String {
        let (_, l) = self
            .call(
                "POST",
                "/v1/auth/login",
                None,
                Some(json!({"login":"admin","password":"durable-admin-pw"})),
            )
            .await;
        l["token"].as_str().unwrap().to_string()
    }

    async fn job_end(&self, token: &str, job: &str) -> Value {
        wait_for(Duration::from_secs(60), || async {
            let (_, j) = self
                .call("GET", &format!("/v1/jobs/{job}"), Some(token), None)
                .await;
            matches!(j["state"].as_str(), Some("succeeded" | "failed")).then_some(j)
        })
        .await
        .unwrap_or_else(|| panic!("job {job} never ended"))
    }

    async fn devices(&self, token: &str, server: &str) -> Vec<Value> {
        let (_, s) = self
            .call("GET", &format!("/v1/servers/{server}"), Some(token), None)
            .await;
        s["assignable_devices"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

async fn killed_at_every_boundary(b: Backend) {
    let db = TestDb::new(b).await;
    let port = free_port();
    let api = Api {
        http: reqwest::Client::new(),
        base: format!("http://127.0.0.1:{port}"),
    };
    let agent_bin = Path::new(env!("CARGO_BIN_EXE_server")).with_file_name("node-agent");
    assert!(
        agent_bin.exists(),
        "build the binaries first (cargo xtask test does)"
    );

    // Set up with a plain server: catalog and one node of 8 GPUs whose agent outlives
    // every server process below.
    let server = start(&db, port, None);
    let op = api.login().await;
    api.call(
        "POST",
        "/v1/variants",
        Some(&op),
        Some(json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330"})),
    )
    .await;
    api.call(
        "POST",
        "/v1/packages",
        Some(&op),
        Some(json!({"name":"gpu-1x","vcpus":2,"memory_mib":2048,"devices":{"NVIDIA_H100":1}})),
    )
    .await;
    let (_, jt) = api
        .call("POST", "/v1/servers/join-tokens", Some(&op), None)
        .await;
    let sysfs = db.dir.path().join("sysfs");
    node_agent::fake::generate(&sysfs, &node_agent::fake::FakeSpec::default()).unwrap();
    let _agent = Proc(
        Command::new(&agent_bin)
            .args([
                "run",
                "--server",
                &api.base,
                "--join-token",
                jt["token"].as_str().unwrap(),
            ])
            .arg("--sysfs-root")
            .arg(&sysfs)
            .arg("--state-dir")
            .arg(db.dir.path().join("agent"))
            .args(["--hypervisor", "sim", "--heartbeat-secs", "1"])
            .env("RUST_LOG", "error")
            .spawn()
            .unwrap(),
    );
    let node = wait_for(Duration::from_secs(30), || async {
        let (_, l) = api.call("GET", "/v1/servers", Some(&op), None).await;
        let s = l.as_array()?.first()?.clone();
        (s["assignable_devices"].as_array()?.len() == 8)
            .then(|| s["uuid"].as_str().unwrap().to_string())
    })
    .await
    .expect("the node registered");
    drop(server);

    let mut running_vms = Vec::new();
    for step in PROVISION_STEPS {
        let key = format!("provision.{step}");
        let paused = start(&db, port, Some(&key));
        let op = api.login().await;
        let (st, vm) = api
            .call(
                "POST",
                "/v1/vms",
                Some(&op),
                Some(json!({"alias": format!("k-{step}"), "package":"gpu-1x"})),
            )
            .await;
        assert_eq!(st, 202, "{vm}");
        paused.wait_line(&format!("paused before {key}"), Duration::from_secs(30));
        paused.kill9();
        let _server = start(&db, port, None);
        let op = api.login().await;
        let job = api.job_end(&op, vm["job_uuid"].as_str().unwrap()).await;
        assert_eq!(job["state"], "succeeded", "{key}: {job}");
        let (_, v) = api
            .call(
                "GET",
                &format!("/v1/vms/{}", vm["uuid"].as_str().unwrap()),
                Some(&op),
                None,
            )
            .await;
        assert_eq!(v["state"], "running", "{key}");
        running_vms.push(v);
    }
    for (step, vm) in DESTROY_STEPS.iter().zip(&running_vms) {
        let key = format!("destroy.{step}");
        let paused = start(&db, port, Some(&key));
        let op = api.login().await;
        let (st, d) = api
            .call(
                "DELETE",
                &format!("/v1/vms/{}", vm["uuid"].as_str().unwrap()),
                Some(&op),
                None,
            )
            .await;
        assert_eq!(st, 202, "{d}");
        paused.wait_line(&format!("paused before {key}"), Duration::from_secs(30));
        paused.kill9();
        let _server = start(&db, port, None);
        let op = api.login().await;
        let job = api.job_end(&op, d["job_uuid"].as_str().unwrap()).await;
        assert_eq!(job["state"], "succeeded", "{key}: {job}");
        let (_, v) = api
            .call(
                "GET",
                &format!("/v1/vms/{}", vm["uuid"].as_str().unwrap()),
                Some(&op),
                None,
            )
            .await;
        assert_eq!(v["state"], "destroyed", "{key}");
    }
    // Every VM is gone and every device is free again: none held by a dead job.
    let _server = start(&db, port, None);
    let op = api.login().await;
    let settled = wait_for(Duration::from_secs(30), || async {
        let d = api.devices(&op, &node).await;
        (d.len() == 8
            && d.iter()
                .all(|d| d["state"] == "unassigned" && d["used_by"].is_null()))
        .then_some(())
    })
    .await;
    assert!(settled.is_some(), "{:?}", api.devices(&op, &node).await);
}
both!(killed_at_every_boundary_on, killed_at_every_boundary);

async fn silent_agent_times_out(b: Backend) {
    let mut cfg = fast_config();
    cfg.task_timeout = Duration::from_secs(1);
    let s = TestServer::start(b, cfg).await;
    // A node that registered and reported, then fell silent (no agent loop answers).
    let (server, _, _) = s.manual_node(8).await;
    s.h100_catalog(1).await;
    let (st, vm) = s
        .admin_call(
            "POST",
            "/v1/vms",
            Some(json!({"alias":"lonely","package":"gpu-1x"})),
        )
        .await;
    assert_eq!(st, 202);
    let job = s.wait_job(vm["job_uuid"].as_str().unwrap()).await;
    assert_eq!(job["state"], "failed");
    let err = job["error"].as_str().unwrap();
    assert!(
        err.contains("did not answer bind_passthrough within 1 s"),
        "{err}"
    );
    let (_, v) = s
        .admin_call(
            "GET",
            &format!("/v1/vms/{}", vm["uuid"].as_str().unwrap()),
            None,
        )
        .await;
    assert_eq!(v["state"], "failed");
    assert!(
        s.device_states(&server)
            .await
            .iter()
            .all(|(_, _, u)| u.is_none()),
        "nothing held"
    );
}
both!(silent_agent_times_out_on, silent_agent_times_out);

/// Two replicas on one Postgres take provisions in parallel.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_on_postgres() {
    let mut a = TestServer::start(Backend::Postgres, fast_config()).await;
    let b = passage_server::start(&a.db.url, "127.0.0.1:0", fast_config(), None)
        .await
        .unwrap();
    let b_base = format!("http://{}", b.addr);
    let node = a.add_node(8).await;
    a.h100_catalog(1).await;
    let mut calls = Vec::new();
    for i in 0..32 {
        let base = if i % 2 == 0 {
            a.base.clone()
        } else {
            b_base.clone()
        };
        let http = a.http.clone();
        let token = a.admin.clone();
        calls.push(tokio::spawn(async move {
            let r = http
                .post(format!("{base}/v1/vms"))
                .bearer_auth(token)
                .json(&json!({"alias": format!("r{i}"), "package": "gpu-1x"}))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }));
    }
    let mut jobs = Vec::new();
    for c in calls {
        let (st, v) = c.await.unwrap();
        if st == 202 {
            jobs.push(v["job_uuid"].as_str().unwrap().to_string());
        } else {
            assert_eq!(v["code"], "InsufficientCapacity");
        }
    }
    assert_eq!(jobs.len(), 8);
    for j in &jobs {
        assert_eq!(a.wait_job(j).await["state"], "succeeded");
    }
    let states = a.device_states(&node.uuid).await;
    let mut holders: Vec<_> = states
        .iter()
        .filter(|(_, st, _)| st == "used")
        .map(|(_, _, u)| u.clone())
        .collect();
    holders.sort();
    holders.dedup();
    assert_eq!(holders.len(), 8, "each device used by one VM");
    // No job ran twice: one bind and one start task per job.
    if let passage_server::store::Db::Postgres(pool) = &a.ctx.db {
        let twice: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM (SELECT job_uuid, kind FROM tasks WHERE job_uuid IS NOT NULL \
             GROUP BY job_uuid, kind HAVING COUNT(*) > 1) t",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(twice, 0);
    }
    b.server.abort();
}
