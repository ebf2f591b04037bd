#![allow(clippy::unwrap_used, clippy::expect_used)]
//! A VM whose QEMU takes 90 s to answer (vfio pinning a large guest's RAM), through the
//! real agent binary against a small stand-in control plane on loopback, with a QEMU
//! stand-in on the agent's PATH: the start waits as long as the VM's RAM asks (a fixed
//! 30 s base alone would give up), and meanwhile heartbeats keep flowing and another
//! VM's start and stop on the same node complete.

use axum::Json;
use axum::extract::{Path as AxPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use passage_model::protocol::{Heartbeat, Task, TaskEnvelope, TaskResult, VmSpec};
use passage_model::{TaskId, VmId};
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long the slow VM's QEMU takes to answer QMP.
const DELAY_SECS: u64 = 90;

/// `qemu-system-x86_64` as far as the agent can tell: writes its pidfile, listens on its
/// QMP socket at once (as QEMU does) but only answers once its delay is over (the slow
/// VM's, by uuid), then serves the greeting, `qmp_capabilities`, `query-status` and
/// `quit`.
const STAND_IN: &str = r#"#!/usr/bin/env python3
import json, os, socket, sys, time
a = sys.argv[1:]
arg = lambda k: a[a.index(k) + 1]
path = arg("-qmp")[len("unix:"):].split(",")[0]
with open(arg("-pidfile"), "w") as f:
    f.write(str(os.getpid()))
s = socket.socket(socket.AF_UNIX)
s.bind(path)
s.listen(128)
if arg("-uuid") == os.environ.get("STANDIN_SLOW_UUID"):
    time.sleep(float(os.environ["STANDIN_DELAY"]))
while True:
    c, _ = s.accept()
    try:
        f = c.makefile("rwb")
        f.write(b'{"QMP": {"version": {}, "capabilities": []}}\r\n')
        f.flush()
        for line in f:
            cmd = json.loads(line).get("execute")
            r = {"status": "running", "running": True} if cmd == "query-status" else {}
            f.write((json.dumps({"return": r}) + "\r\n").encode())
            f.flush()
            if cmd == "quit":
                sys.exit(0)
    except (OSError, ValueError):
        pass
    finally:
        c.close()
"#;

#[derive(Default)]
struct Seen {
    sent: Vec<TaskId>,
    results: Vec<(TaskId, TaskResult, Instant)>,
    heartbeats: Vec<(Instant, Vec<VmId>)>,
}

#[derive(Clone)]
struct Cp {
    /// In the order they go: the first two at once, each other once the one before it
    /// has a result.
    start_a: TaskEnvelope,
    start_b: TaskEnvelope,
    stop_b: TaskEnvelope,
    stop_a: TaskEnvelope,
    seen: Arc<Mutex<Seen>>,
}

async fn register() -> Response {
    Json(serde_json::json!({
        "server_uuid": uuid::Uuid::new_v4(),
        "credential": "node-credential",
    }))
    .into_response()
}

async fn empty() -> Response {
    StatusCode::OK.into_response()
}

async fn heartbeat(State(cp): State<Cp>, Json(hb): Json<Heartbeat>) -> Response {
    cp.seen
        .lock()
        .unwrap()
        .heartbeats
        .push((Instant::now(), hb.running_vms.unwrap_or_default()));
    StatusCode::OK.into_response()
}

async fn tasks(State(cp): State<Cp>) -> Response {
    let next = {
        let mut seen = cp.seen.lock().unwrap();
        let done = |id: TaskId| seen.results.iter().any(|r| r.0 == id);
        let next: Vec<TaskEnvelope> = if seen.sent.is_empty() {
            vec![cp.start_a.clone(), cp.start_b.clone()]
        } else if done(cp.start_b.id) && !seen.sent.contains(&cp.stop_b.id) {
            vec![cp.stop_b.clone()]
        } else if done(cp.start_a.id) && !seen.sent.contains(&cp.stop_a.id) {
            vec![cp.stop_a.clone()]
        } else {
            Vec::new()
        };
        seen.sent.extend(next.iter().map(|t| t.id));
        next
    };
    if next.is_empty() {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    Json(next).into_response()
}

async fn result(
    State(cp): State<Cp>,
    AxPath(id): AxPath<TaskId>,
    Json(r): Json<TaskResult>,
) -> Response {
    cp.seen
        .lock()
        .unwrap()
        .results
        .push((id, r, Instant::now()));
    StatusCode::NO_CONTENT.into_response()
}

fn vm(memory_mib: u64) -> VmSpec {
    VmSpec {
        uuid: VmId::new_random(),
        vcpus: 1,
        memory_mib,
        devices: Vec::new(),
        disk: None,
        nics: Vec::new(),
        cloud_init: None,
        bootrom: None,
    }
}

fn envelope(task: Task) -> TaskEnvelope {
    TaskEnvelope {
        id: TaskId::new_random(),
        task,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_pins_for_minutes_blocks_neither_heartbeats_nor_other_vms() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sys");
    let state = dir.path().join("st");
    node_agent::fake::generate(&root, &node_agent::fake::FakeSpec::default()).unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let qemu = bin.join("qemu-system-x86_64");
    std::fs::write(&qemu, STAND_IN).unwrap();
    std::fs::set_permissions(&qemu, std::fs::Permissions::from_mode(0o755)).unwrap();

    // 32 GiB: 30 s + 3 s per GiB = 126 s, past the stand-in's 90.
    let (a, b) = (vm(32 * 1024), vm(64));
    let cp = Cp {
        start_a: envelope(Task::StartVm { vm: a.clone() }),
        start_b: envelope(Task::StartVm { vm: b.clone() }),
        stop_b: envelope(Task::StopVm { vm_uuid: b.uuid }),
        stop_a: envelope(Task::StopVm { vm_uuid: a.uuid }),
        seen: Arc::new(Mutex::new(Seen::default())),
    };
    let seen = cp.seen.clone();
    use axum::routing::{get, post, put};
    let app = axum::Router::new()
        .route("/agent/v1/register", post(register))
        .route("/agent/v1/inventory", put(empty))
        .route("/agent/v1/heartbeat", post(heartbeat))
        .route("/agent/v1/tasks", get(tasks))
        .route("/agent/v1/tasks/{id}/result", post(result))
        .route("/agent/v1/tasks/{id}/progress", post(empty))
        .with_state(cp.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "server = \"http://{addr}\"\nsysfs_root = \"{}\"\nstate_dir = \"{}\"\n\
             hypervisor = \"qemu\"\nheartbeat_secs = 1\n\
             qemu_start_base_secs = 30\nqemu_start_secs_per_gib = 3\n",
            root.display(),
            state.display()
        ),
    )
    .unwrap();
    let log = dir.path().join("agent.log");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut agent = tokio::process::Command::new(env!("CARGO_BIN_EXE_node-agent"))
        .args(["run", "--config"])
        .arg(&config)
        .args(["--join-token", "join"])
        .env("PATH", path)
        // The stand-in is no QEMU to probe KVM with.
        .env("PASSAGE_QEMU_ACCEL", "tcg")
        .env("STANDIN_SLOW_UUID", a.uuid.to_string())
        .env("STANDIN_DELAY", DELAY_SECS.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();

    let began = Instant::now();
    let deadline = began + Duration::from_secs(DELAY_SECS + 60);
    loop {
        if seen.lock().unwrap().results.len() >= 4 {
            break;
        }
        if let Ok(Some(exit)) = agent.try_wait() {
            panic!("the agent ended ({exit}):\n{}", log_text());
        }
        assert!(
            Instant::now() < deadline,
            "not all results within {} s: {:?}\n{}",
            DELAY_SECS + 60,
            seen.lock()
                .unwrap()
                .results
                .iter()
                .map(|r| (r.0, r.1.ok))
                .collect::<Vec<_>>(),
            log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = agent.kill().await;

    let seen = seen.lock().unwrap();
    for (id, r, _) in &seen.results {
        assert!(r.ok, "task {id}: {r:?}\n{}", log_text());
    }
    let at = |id: TaskId| seen.results.iter().find(|r| r.0 == id).unwrap().2;
    let a_started = at(cp.start_a.id);
    assert!(
        a_started - began >= Duration::from_secs(DELAY_SECS),
        "the slow VM started after {:?}",
        a_started - began
    );
    // The other VM's start and stop went while the slow one was still starting.
    assert!(at(cp.start_b.id) < at(cp.stop_b.id));
    assert!(
        at(cp.stop_b.id) < a_started,
        "the other VM's stop waited for the slow start"
    );
    assert!(
        at(cp.stop_b.id) - began < Duration::from_secs(30),
        "{:?}",
        at(cp.stop_b.id) - began
    );
    // Heartbeats every second throughout the wait, never more than a few apart.
    let beats: Vec<Instant> = seen
        .heartbeats
        .iter()
        .map(|h| h.0)
        .filter(|t| *t < a_started)
        .collect();
    assert!(
        beats.len() as u64 >= DELAY_SECS - 10,
        "{} heartbeats in {DELAY_SECS} s",
        beats.len()
    );
    let gap = beats
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    assert!(gap < Duration::from_secs(4), "heartbeats {gap:?} apart");
    // The slow VM is reported running only once it is.
    assert!(
        seen.heartbeats
            .iter()
            .filter(|h| h.0 < a_started)
            .all(|h| !h.1.contains(&a.uuid))
    );
    eprintln!(
        "slow start answered after {:?}; the other VM's stop after {:?}; {} heartbeats, at most {gap:?} apart",
        a_started - began,
        at(cp.stop_b.id) - began,
        beats.len()
    );
}

/// The backend alone, with the stand-in as its binary: while a VM starts, a second start
/// of it with the same spec joins (and succeeds with it), one with another spec is
/// refused, the map answers, and a stop cancels a start under way.
#[test]
fn a_second_start_joins_and_a_stop_cancels() {
    use node_agent::hypervisor::{Hypervisor, QemuConfig, QemuHypervisor, StartLimit};
    let dir = tempfile::tempdir().unwrap();
    let qemu = dir.path().join("qemu-system-x86_64");
    // Every VM slow, by 3 s: the environment is shared with the tests beside this one.
    std::fs::write(
        &qemu,
        STAND_IN
            .replace("os.environ.get(\"STANDIN_SLOW_UUID\")", "arg(\"-uuid\")")
            .replace("os.environ[\"STANDIN_DELAY\"]", "\"3\""),
    )
    .unwrap();
    std::fs::set_permissions(&qemu, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cfg = QemuConfig {
        binary: qemu,
        accel: "tcg".into(),
        sysfs_root: None,
        stand_in_devices: false,
        ovmf_code: node_agent::hypervisor::DEFAULT_OVMF_CODE.into(),
        ovmf_vars: node_agent::hypervisor::DEFAULT_OVMF_VARS.into(),
        start: StartLimit {
            base_secs: 30,
            secs_per_gib: 0,
        },
        stand_in_bars: false,
        hugepages: node_agent::hypervisor::HugepagePolicy::Off,
        pin_vcpus: node_agent::hypervisor::PinPolicy::Never,
        host_reserved_cpus: Default::default(),
        host_sysfs: "/sys".into(),
    };
    let h = Arc::new(QemuHypervisor::open(cfg, &dir.path().join("st")).unwrap());
    let s = vm(64);
    let first = {
        let (h, s) = (h.clone(), s.clone());
        std::thread::spawn(move || h.start(&s))
    };
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    assert!(h.running().is_empty(), "not running while it starts");
    assert!(h.console(s.uuid).unwrap().is_empty());
    assert!(t.elapsed() < Duration::from_millis(500), "the map was held");
    let mut other = s.clone();
    other.vcpus = 2;
    assert!(h.start(&other).is_err(), "another spec while starting");
    h.start(&s).unwrap();
    assert!(t.elapsed() >= Duration::from_secs(2), "{:?}", t.elapsed());
    first.join().unwrap().unwrap();
    assert_eq!(h.running(), vec![s.uuid]);
    h.stop(s.uuid).unwrap();

    // A stop while it starts: the start fails at once, saying so.
    let first = {
        let (h, s) = (h.clone(), s.clone());
        std::thread::spawn(move || h.start(&s))
    };
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    h.stop(s.uuid).unwrap();
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let e = first.join().unwrap().unwrap_err().to_string();
    assert!(e.contains("stopped while starting"), "{e}");
    assert!(h.running().is_empty());
}
