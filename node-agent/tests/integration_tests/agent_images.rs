//! The whole agent (`agent::run_with`, QEMU backend) against a small stand-in control
//! plane on loopback that speaks the agent API: a slow image download runs beside the
//! other tasks (a second VM's task answers first), posts its progress while it runs, and
//! ends with the VM's disk made on the verified image.

use axum::Json;
use axum::extract::{Path as AxPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use node_agent::agent::{AgentConfig, RunOptions};
use node_agent::hypervisor::HypervisorKind;
use node_agent::images::cache::hash_file;
use passage_model::images::ImageType;
use passage_model::protocol::{DiskSpec, ImageRef, Task, TaskEnvelope, TaskProgress, TaskResult};
use passage_model::{TaskId, VmId};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Seen {
    tasks_sent: bool,
    results: Vec<(TaskId, TaskResult, Instant)>,
    image_requests: usize,
    progress: Vec<(TaskId, TaskProgress)>,
}

#[derive(Clone)]
struct Cp {
    tasks: Vec<TaskEnvelope>,
    image: Arc<Vec<u8>>,
    seen: Arc<Mutex<Seen>>,
}

/// A body fed by a task that sends the image in small pieces with pauses: a slow link.
struct Trickle(tokio::sync::mpsc::Receiver<Bytes>);

impl futures_core::Stream for Trickle {
    type Item = Result<Bytes, std::io::Error>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|c| c.map(Ok))
    }
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

async fn tasks(State(cp): State<Cp>) -> Response {
    let first = {
        let mut seen = cp.seen.lock().unwrap();
        !std::mem::replace(&mut seen.tasks_sent, true)
    };
    if first {
        return Json(cp.tasks.clone()).into_response();
    }
    // The download, sent again while it runs (as a server that re-sends tasks without a
    // result would): the agent must not start it twice.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let again: Vec<TaskEnvelope> = cp
        .tasks
        .iter()
        .filter(|t| matches!(t.task, Task::FetchImage { .. }))
        .filter(|t| !cp.seen.lock().unwrap().results.iter().any(|r| r.0 == t.id))
        .cloned()
        .collect();
    if !again.is_empty() {
        return Json(again).into_response();
    }
    // A long poll with nothing to do.
    tokio::time::sleep(Duration::from_millis(500)).await;
    Json(Vec::<TaskEnvelope>::new()).into_response()
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

async fn progress(
    State(cp): State<Cp>,
    AxPath(id): AxPath<TaskId>,
    Json(p): Json<TaskProgress>,
) -> Response {
    cp.seen.lock().unwrap().progress.push((id, p));
    StatusCode::NO_CONTENT.into_response()
}

async fn image(State(cp): State<Cp>) -> Response {
    cp.seen.lock().unwrap().image_requests += 1;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let bytes = cp.image.clone();
    tokio::spawn(async move {
        for c in bytes.chunks(128 * 1024) {
            tokio::time::sleep(Duration::from_millis(60)).await;
            if tx.send(Bytes::copy_from_slice(c)).await.is_err() {
                return;
            }
        }
    });
    Response::builder()
        .header("content-length", cp.image.len())
        .body(axum::body::Body::from_stream(Trickle(rx)))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_download_runs_beside_other_tasks_and_reports_progress() {
    if node_agent::hypervisor::find_on_path("qemu-system-x86_64").is_none()
        || node_agent::hypervisor::find_on_path("qemu-img").is_none()
    {
        assert_eq!(
            std::env::var("PASSAGE_ALLOW_NO_QEMU").as_deref(),
            Ok("1"),
            "QEMU (qemu-system-x86, qemu-utils) is not installed; cargo xtask test installs it"
        );
        eprintln!("note: SKIPPED: QEMU is not installed and PASSAGE_ALLOW_NO_QEMU=1");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sys");
    let state = dir.path().join("st");
    node_agent::fake::generate(&root, &node_agent::fake::FakeSpec::default()).unwrap();

    // 3 MiB in 24 pieces, 60 ms apart: about 1.5 s of download.
    let bytes: Vec<u8> = (0..3 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let f = dir.path().join("img");
    std::fs::write(&f, &bytes).unwrap();
    let sha256 = hash_file(&f).unwrap();
    let (vm_a, vm_b) = (VmId::new_random(), VmId::new_random());
    let fetch = TaskEnvelope {
        id: TaskId::new_random(),
        task: Task::FetchImage {
            vm_uuid: vm_a,
            disk: DiskSpec {
                image: ImageRef {
                    sha256,
                    size: bytes.len() as u64,
                    image_type: ImageType::Raw,
                },
                size_gib: 1,
            },
        },
    };
    let stop = TaskEnvelope {
        id: TaskId::new_random(),
        task: Task::StopVm { vm_uuid: vm_b },
    };
    let seen = Arc::new(Mutex::new(Seen::default()));
    let cp = Cp {
        tasks: vec![fetch.clone(), stop.clone()],
        image: Arc::new(bytes),
        seen: seen.clone(),
    };
    use axum::routing::{get, post, put};
    let app = axum::Router::new()
        .route("/agent/v1/register", post(register))
        .route("/agent/v1/inventory", put(empty))
        .route("/agent/v1/heartbeat", post(empty))
        .route("/agent/v1/tasks", get(tasks))
        .route("/agent/v1/tasks/{id}/result", post(result))
        .route("/agent/v1/tasks/{id}/progress", post(progress))
        .route("/agent/v1/images/{sha}", get(image))
        .with_state(cp);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let cfg = AgentConfig {
        server_url: format!("http://{addr}"),
        join_token: "join".into(),
        sysfs_root: root,
        state_dir: state.clone(),
        hypervisor: HypervisorKind::Qemu,
        heartbeat: Duration::from_secs(1),
        inventory_every: Duration::from_secs(1),
        hostname: "cn-test".into(),
        ca_cert: None,
    };
    let agent = tokio::spawn(node_agent::agent::run_with(cfg, RunOptions::default()));

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if seen.lock().unwrap().results.len() >= 2 {
            break;
        }
        assert!(!agent.is_finished(), "the agent ended: {:?}", agent.await);
        assert!(Instant::now() < deadline, "no results within 60 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen_all = seen.clone();
    let seen = seen.lock().unwrap();
    // Give a second run (were there one) time to report too.
    drop(seen);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seen = seen_all.lock().unwrap();
    let order: Vec<TaskId> = seen.results.iter().map(|r| r.0).collect();
    assert_eq!(
        order[..2],
        [stop.id, fetch.id],
        "the other VM's task answers while the download runs"
    );
    // Sent again while it ran, the download still ran once. (A copy that arrives after
    // its result runs again, harmlessly: the image is cached and the disk exists.)
    assert_eq!(seen.image_requests, 1);
    let fetch_results = order.iter().filter(|id| **id == fetch.id).count();
    assert!(
        fetch_results <= 2,
        "the download was started {fetch_results} times"
    );
    for (_, r, _) in &seen.results {
        assert!(r.ok, "{r:?}");
    }
    let total = 3 * 1024 * 1024;
    let fetch_progress: Vec<TaskProgress> = seen
        .progress
        .iter()
        .filter(|p| p.0 == fetch.id)
        .map(|p| p.1)
        .collect();
    assert!(
        fetch_progress
            .iter()
            .any(|p| p.total == total && p.done > 0 && p.done < total),
        "progress while downloading: {fetch_progress:?}"
    );
    assert_eq!(
        fetch_progress.last(),
        Some(&TaskProgress { done: total, total })
    );
    // At most a few a second.
    assert!(fetch_progress.len() <= 12, "{fetch_progress:?}");
    let disk: PathBuf = node_agent::images::disk_path(&state, vm_a);
    assert!(disk.is_file());
    drop(seen);
    agent.abort();
}
