//! Durable jobs: the real server binary killed with SIGKILL at every step boundary of
//! provision and destroy resumes each job on restart; a silent agent times a job out
//! into a clean failure; two replicas on one Postgres never run a job twice.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{
    Backend, Client, Proc, TestDb, TestServer, agent_command, fast_config, node_agent_bin, wait_for,
};
use passage_model::api::{
    AssignableDevice, Job, JobState, JoinToken, LoginResponse, Package, Vm, VmState,
};
use passage_model::jobs::JobKind;
use passage_model::{DeviceState, ErrorCode, JobId, ServerId, Variant};
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

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
    start_with(db, port, pause, &[])
}

fn start_with(db: &TestDb, port: u16, pause: Option<&str>, extra: &[&str]) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_server"));
    cmd.args(extra);
    cmd.args([
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--database",
        &db.url,
    ])
    .args(["--job-lease-secs", "1", "--task-timeout-secs", "20"])
    .env("PASSAGE_IMAGE_DIR", db.dir.path().join("images"))
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

    /// SIGTERM, as systemd stops a service; answers how long the process took to exit.
    fn terminate(mut self) -> Duration {
        let pid = self.proc.0.id().to_string();
        let sent = std::time::Instant::now();
        let status = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(status.success());
        loop {
            if self.proc.0.try_wait().unwrap().is_some() {
                return sent.elapsed();
            }
            assert!(
                sent.elapsed() < Duration::from_secs(30),
                "the server has not exited 30 s after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL: no shutdown, no lease released, nothing flushed but what was committed.
    fn kill9(mut self) {
        self.proc.0.kill().unwrap();
        self.proc.0.wait().unwrap();
    }
}

/// Calls to the `server` process on `base`.
struct Api {
    base: String,
}

impl Api {
    fn client(&self, token: Option<&str>) -> Client {
        Client::at(&self.base, token)
    }

    async fn login(&self) -> String {
        let l: LoginResponse = self
            .client(None)
            .post(
                "/v1/auth/login",
                &json!({"login":"admin","password":"durable-admin-pw"}),
            )
            .await
            .ok(200);
        l.token
    }

    async fn job_end(&self, token: &str, job: JobId) -> Job {
        wait_for(Duration::from_secs(60), || async {
            let j: Job = self
                .client(Some(token))
                .get(&format!("/v1/jobs/{job}"))
                .await
                .ok(200);
            matches!(j.state, JobState::Succeeded | JobState::Failed).then_some(j)
        })
        .await
        .unwrap_or_else(|| panic!("job {job} never ended"))
    }

    async fn devices(&self, token: &str, server: ServerId) -> Vec<AssignableDevice> {
        let s: passage_model::api::Server = self
            .client(Some(token))
            .get(&format!("/v1/servers/{server}"))
            .await
            .ok(200);
        s.assignable_devices.unwrap_or_default()
    }
}

async fn killed_at_every_boundary(b: Backend) {
    let db = TestDb::new(b).await;
    let port = free_port();
    let api = Api {
        base: format!("http://127.0.0.1:{port}"),
    };
    // Its agent outlives every server process below: checked before any starts.
    node_agent_bin();

    // Set up with a plain server: catalog and one node of 8 GPUs whose agent outlives
    // every server process below.
    let server = start(&db, port, None);
    let op = api.login().await;
    api.client(Some(&op))
        .post::<Variant>(
            "/v1/variants",
            &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330"}),
        )
        .await
        .ok(201);
    api.client(Some(&op))
        .post::<Package>(
            "/v1/packages",
            &json!({"name":"gpu-1x","vcpus":2,"memory_mib":2048,"devices":{"NVIDIA_H100":1}}),
        )
        .await
        .ok(201);
    crate::common::create_test_image(&api.client(Some(&op))).await;
    let jt: JoinToken = api
        .client(Some(&op))
        .post_empty("/v1/servers/join-tokens")
        .await
        .ok(201);
    let sysfs = db.dir.path().join("sysfs");
    node_agent::fake::generate(&sysfs, &node_agent::fake::FakeSpec::default()).unwrap();
    let _agent = Proc(
        agent_command(&api.base, &jt.token, &sysfs, &db.dir.path().join("agent"))
            .args(["--hypervisor", "sim"])
            .env("RUST_LOG", "error")
            .spawn()
            .unwrap(),
    );
    let node = wait_for(Duration::from_secs(30), || async {
        let l: Vec<passage_model::api::Server> =
            api.client(Some(&op)).get("/v1/servers").await.ok(200);
        let s = l.into_iter().next()?;
        (s.assignable_devices?.len() == 8).then_some(s.uuid)
    })
    .await
    .expect("the node registered");
    drop(server);

    let mut running_vms = Vec::new();
    for step in JobKind::Provision.step_names() {
        let key = format!("provision.{step}");
        let paused = start(&db, port, Some(&key));
        let op = api.login().await;
        let vm: Vm = api
            .client(Some(&op))
            .post(
                "/v1/vms",
                &json!({"image": "test-image", "alias": format!("k-{step}"), "package":"gpu-1x"}),
            )
            .await
            .ok(202);
        paused.wait_line(&format!("paused before {key}"), Duration::from_secs(30));
        paused.kill9();
        let _server = start(&db, port, None);
        let op = api.login().await;
        let job = api.job_end(&op, vm.job_uuid.unwrap()).await;
        assert_eq!(job.state, JobState::Succeeded, "{key}: {job:?}");
        let v: Vm = api
            .client(Some(&op))
            .get(&format!("/v1/vms/{}", vm.uuid))
            .await
            .ok(200);
        assert_eq!(v.state, VmState::Running, "{key}");
        running_vms.push(v);
    }
    // One more VM, for a kill inside the scrub step, its devices already `cleaning`: the
    // resumed step must take them up again, or they stay `cleaning` for good.
    {
        let _server = start(&db, port, None);
        let op = api.login().await;
        let vm: Vm = api
            .client(Some(&op))
            .post(
                "/v1/vms",
                &json!({"image": "test-image", "alias": "k-scrub", "package":"gpu-1x"}),
            )
            .await
            .ok(202);
        let job = api.job_end(&op, vm.job_uuid.unwrap()).await;
        assert_eq!(job.state, JobState::Succeeded, "{job:?}");
        running_vms.push(vm);
    }
    let keys = JobKind::Destroy
        .step_names()
        .iter()
        .map(|step| format!("destroy.{step}"))
        .chain(["scrub.started".to_string()]);
    assert_eq!(keys.clone().count(), running_vms.len());
    for (key, vm) in keys.zip(&running_vms) {
        let paused = start(&db, port, Some(&key));
        let op = api.login().await;
        let d: Vm = api
            .client(Some(&op))
            .delete(&format!("/v1/vms/{}", vm.uuid))
            .await
            .ok(202);
        paused.wait_line(&format!("paused before {key}"), Duration::from_secs(30));
        paused.kill9();
        let _server = start(&db, port, None);
        let op = api.login().await;
        let job = api.job_end(&op, d.job_uuid.unwrap()).await;
        assert_eq!(job.state, JobState::Succeeded, "{key}: {job:?}");
        let v: Vm = api
            .client(Some(&op))
            .get(&format!("/v1/vms/{}", vm.uuid))
            .await
            .ok(200);
        assert_eq!(v.state, VmState::Destroyed, "{key}");
    }
    // Every VM is gone and every device is free again: none held by a dead job.
    let _server = start(&db, port, None);
    let op = api.login().await;
    let settled = wait_for(Duration::from_secs(30), || async {
        let d = api.devices(&op, node).await;
        (d.len() == 8
            && d.iter()
                .all(|d| d.state == DeviceState::Unassigned && d.used_by.is_none()))
        .then_some(())
    })
    .await;
    assert!(settled.is_some(), "{:?}", api.devices(&op, node).await);
}
both!(killed_at_every_boundary_on, killed_at_every_boundary);

/// SIGTERM in the middle of a burst of creations on a simulated fleet: the server is gone
/// within 5 s (agents' long polls and the jobs in flight do not hold it), and after a
/// restart every job ends, no device is held twice, and once every VM is destroyed every
/// device is clean and free again: none is stuck.
async fn sigterm_mid_run(b: Backend) {
    let db = TestDb::new(b).await;
    let port = free_port();
    let api = Api {
        base: format!("http://127.0.0.1:{port}"),
    };
    let sim_dir = db.dir.path().join("sim");
    let sim_dir = sim_dir.to_str().unwrap();
    let fleet = [
        "--sim-servers",
        "8",
        "--sim-gpus",
        "8",
        "--sim-dir",
        sim_dir,
        "--scrub-grace-secs",
        "0",
    ];
    let server = start_with(&db, port, None, &fleet);
    let op = api.login().await;
    let c = api.client(Some(&op));
    c.post::<Variant>(
        "/v1/variants",
        &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330"}),
    )
    .await
    .ok(201);
    c.post::<Package>(
        "/v1/packages",
        &json!({"name":"gpu-1x","vcpus":1,"memory_mib":1024,"devices":{"NVIDIA_H100":1}}),
    )
    .await
    .ok(201);
    let image = crate::common::create_test_image(&c).await;
    let fleet_gpus = 64;
    wait_for(Duration::from_secs(60), || async {
        let l: Vec<passage_model::api::Server> = c.get("/v1/servers?limit=1000").await.ok(200);
        let gpus: usize = l
            .iter()
            .map(|s| s.assignable_devices.as_ref().map_or(0, Vec::len))
            .sum();
        (gpus == fleet_gpus).then_some(())
    })
    .await
    .expect("the simulated fleet came up");

    // Every GPU asked for at once; SIGTERM while their jobs run.
    let posts: Vec<_> = (0..fleet_gpus)
        .map(|i| {
            let c = api.client(Some(&op));
            let image = image.clone();
            tokio::spawn(async move {
                c.post::<Vm>(
                    "/v1/vms",
                    &json!({"alias": format!("t-{i}"), "package":"gpu-1x", "image": image}),
                )
                .await
                .ok(202)
            })
        })
        .collect();
    let mut vms = Vec::new();
    for p in posts {
        vms.push(p.await.unwrap());
    }
    let took = server.terminate();
    assert!(
        took < Duration::from_secs(5),
        "exited {took:?} after SIGTERM"
    );

    let _server = start_with(&db, port, None, &fleet);
    let op = api.login().await;
    let c = api.client(Some(&op));
    for vm in &vms {
        let job = api.job_end(&op, vm.job_uuid.unwrap()).await;
        assert!(
            matches!(job.state, JobState::Succeeded | JobState::Failed),
            "{job:?}"
        );
    }
    let listed: Vec<Vm> = c.get("/v1/vms?limit=1000").await.ok(200);
    let mut held: Vec<String> = listed
        .iter()
        .flat_map(|v| {
            // Every simulated node has the same device paths: a device is its node's.
            let node = v.server_uuid;
            v.assigned_devices
                .iter()
                .map(move |d| format!("{node:?}{d}"))
        })
        .collect();
    let n = held.len();
    held.sort();
    held.dedup();
    assert_eq!(held.len(), n, "a device held by two VMs");
    for v in &listed {
        assert!(
            matches!(v.state, VmState::Running | VmState::Failed),
            "{} is {:?}",
            v.uuid,
            v.state
        );
    }

    for v in &listed {
        if v.state == VmState::Running {
            let d: Vm = c.delete(&format!("/v1/vms/{}", v.uuid)).await.ok(202);
            api.job_end(&op, d.job_uuid.unwrap()).await;
        }
    }
    let clean = wait_for(Duration::from_secs(60), || async {
        let l: Vec<passage_model::api::Server> = c.get("/v1/servers?limit=1000").await.ok(200);
        let devices: Vec<AssignableDevice> = l
            .into_iter()
            .flat_map(|s| s.assignable_devices.unwrap_or_default())
            .collect();
        (devices.len() == fleet_gpus
            && devices
                .iter()
                .all(|d| d.state == DeviceState::Unassigned && d.used_by.is_none()))
        .then_some(())
    })
    .await;
    assert!(clean.is_some(), "devices stuck after the restart");
}
both!(sigterm_mid_run_on, sigterm_mid_run);

async fn silent_agent_times_out(b: Backend) {
    let mut cfg = fast_config();
    cfg.task_timeout = Duration::from_secs(1);
    let s = TestServer::start(b, cfg).await;
    // A node that registered and reported, then fell silent (no agent loop answers).
    let (server, _, _) = s.manual_node(8).await;
    s.h100_catalog(1).await;
    let vm: Vm = s
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"lonely","package":"gpu-1x"}),
        )
        .await
        .ok(202);
    let job = s.wait_job(vm.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Failed);
    let err = job.error.unwrap();
    assert!(
        err.contains("did not answer bind_passthrough within 1 s"),
        "{err}"
    );
    let v: Vm = s.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
    assert_eq!(v.state, VmState::Failed);
    assert!(
        s.device_states(server)
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
    let calls: Vec<_> = (0..32)
        .map(|i| {
            let c = if i % 2 == 0 {
                a.as_admin()
            } else {
                Client::at(&b_base, Some(&a.admin))
            };
            let body =
                json!({"image": "test-image", "alias": format!("r{i}"), "package": "gpu-1x"});
            tokio::spawn(async move { c.post::<Vm>("/v1/vms", &body).await })
        })
        .collect();
    let mut jobs = Vec::new();
    for c in calls {
        let r = c.await.unwrap();
        if r.status == 202 {
            jobs.push(r.ok(202).job_uuid.unwrap());
        } else {
            r.fails(409, ErrorCode::InsufficientCapacity);
        }
    }
    assert_eq!(jobs.len(), 8);
    for j in &jobs {
        assert_eq!(a.wait_job(*j).await.state, JobState::Succeeded);
    }
    let states = a.device_states(node.uuid).await;
    let mut holders: Vec<_> = states
        .iter()
        .filter(|(_, st, _)| *st == DeviceState::Used)
        .map(|(_, _, u)| *u)
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

/// Postgres connections are pinged as they leave the pool only after sitting idle: cut
/// while idle (as a database restart cuts them), each is found dead and replaced before a
/// request uses it, and every request after the cut succeeds. Nothing else runs meanwhile
/// (no node, no reconciler), so the requests are the first to take the cut connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_cut_while_idle_are_replaced() {
    let cfg = passage_server::config::Config {
        reconcile_every: Duration::from_secs(3600),
        ..fast_config()
    };
    let s = TestServer::start(Backend::Postgres, cfg).await;
    s.h100_catalog(1).await;
    // Several connections in the pool, each used.
    let reads = (0..16).map(|_| s.get::<Vec<Package>>("/v1/packages"));
    for r in futures_util::future::join_all(reads).await {
        r.ok(200);
    }
    let name = s.db.url.rsplit('/').next().unwrap().to_string();
    let admin = sqlx::PgPool::connect(&crate::common::pg_admin_url())
        .await
        .unwrap();
    let cut: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(&name)
    .fetch_all(&admin)
    .await
    .unwrap();
    assert!(cut.len() >= 2, "the server's connections were cut: {cut:?}");
    admin.close().await;
    // Past the idle time after which a connection is pinged.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for _ in 0..20 {
        s.get::<Vec<Package>>("/v1/packages").await.ok(200);
    }
    let reads = (0..16).map(|_| s.get::<Vec<Vm>>("/v1/vms"));
    for r in futures_util::future::join_all(reads).await {
        r.ok(200);
    }
}
