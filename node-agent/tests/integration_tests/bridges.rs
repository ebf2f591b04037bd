//! The bridges an agent reports are those its hypervisor attaches taps to: a simulated
//! node's from its generated tree, a QEMU node's from the host's own network even when
//! its PCI devices come from a generated tree. The whole agent (`agent::run`) against a
//! stand-in control plane on loopback that keeps the inventories it is sent.

use super::netns::{self, NetNs};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use node_agent::agent::AgentConfig;
use node_agent::fake::{FakeOptions, FakeSpec, generate_with};
use node_agent::hypervisor::HypervisorKind;
use passage_model::protocol::{InventoryReport, TaskEnvelope};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Seen = Arc<Mutex<Vec<InventoryReport>>>;

async fn register() -> Response {
    Json(serde_json::json!({
        "server_uuid": uuid::Uuid::new_v4(),
        "credential": "node-credential",
    }))
    .into_response()
}

async fn inventory(State(seen): State<Seen>, Json(r): Json<InventoryReport>) -> Response {
    seen.lock().unwrap().push(r);
    StatusCode::NO_CONTENT.into_response()
}

async fn tasks() -> Response {
    tokio::time::sleep(Duration::from_millis(200)).await;
    Json(Vec::<TaskEnvelope>::new()).into_response()
}

/// The first inventory an agent over `sysfs_root` with `hypervisor` reports.
async fn first_inventory(
    dir: &Path,
    sysfs_root: &Path,
    hypervisor: HypervisorKind,
) -> InventoryReport {
    use axum::routing::{get, post, put};
    let seen = Seen::default();
    let app = axum::Router::new()
        .route("/agent/v1/register", post(register))
        .route("/agent/v1/inventory", put(inventory))
        .route("/agent/v1/heartbeat", post(|| async { StatusCode::OK }))
        .route("/agent/v1/tasks", get(tasks))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let cfg = AgentConfig {
        server_url: format!("http://{addr}"),
        join_token: "join".into(),
        sysfs_root: sysfs_root.to_path_buf(),
        state_dir: dir.join("state"),
        hypervisor,
        heartbeat: Duration::from_secs(1),
        inventory_every: Duration::from_secs(1),
        hostname: "cn-test".into(),
        ca_cert: None,
    };
    let agent = tokio::spawn(node_agent::agent::run(cfg));
    let deadline = Instant::now() + Duration::from_secs(30);
    let report = loop {
        if let Some(r) = seen.lock().unwrap().first() {
            break r.clone();
        }
        assert!(!agent.is_finished(), "the agent ended: {:?}", agent.await);
        assert!(Instant::now() < deadline, "no inventory within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    agent.abort();
    server.abort();
    report
}

fn tree(dir: &Path, bridges: &[&str]) -> std::path::PathBuf {
    let root = dir.join("sys");
    let opts = FakeOptions {
        bridges: bridges.iter().map(|b| b.to_string()).collect(),
        ..FakeOptions::default()
    };
    generate_with(&root, &FakeSpec::default(), &opts).unwrap();
    root
}

#[tokio::test]
async fn a_simulated_node_reports_its_trees_bridges() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sys");
    node_agent::fake::generate(&root, &FakeSpec::default()).unwrap();
    let r = first_inventory(dir.path(), &root, HypervisorKind::Sim).await;
    assert_eq!(r.bridges, Some(vec!["br0".to_string()]));
    assert!(!r.devices.is_empty());

    let none = tempfile::tempdir().unwrap();
    let root = tree(none.path(), &[]);
    let r = first_inventory(none.path(), &root, HypervisorKind::Sim).await;
    assert_eq!(
        r.bridges,
        Some(Vec::new()),
        "none is an empty list, not unknown"
    );
}

#[test]
fn a_qemu_node_reports_the_hosts_bridges_not_its_trees() {
    if netns::inside().is_some() {
        let dir = tempfile::tempdir().unwrap();
        // PCI devices from a generated tree, which has br0 and vmbr9.
        let root = tree(dir.path(), &["br0", "vmbr9"]);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let r = rt.block_on(first_inventory(dir.path(), &root, HypervisorKind::Qemu));
        assert_eq!(
            r.bridges,
            Some(vec!["pstbrh1".to_string(), "pstbrh2".to_string()])
        );
        return;
    }
    if node_agent::hypervisor::find_on_path(node_agent::hypervisor::QEMU_BINARY).is_none() {
        assert_eq!(
            std::env::var("PASSAGE_ALLOW_NO_QEMU").as_deref(),
            Ok("1"),
            "QEMU (qemu-system-x86) is not installed; cargo xtask test installs it"
        );
        eprintln!("note: SKIPPED: QEMU is not installed and PASSAGE_ALLOW_NO_QEMU=1");
        return;
    }
    let Some(ns) = NetNs::new("brs") else { return };
    for b in ["pstbrh2", "pstbrh1"] {
        ns.ip_ok(&["link", "add", b, "type", "bridge"]);
    }
    // Not a bridge: a port of one is not reported.
    ns.ip_ok(&["tuntap", "add", "dev", "pstport0", "mode", "tap"]);
    ns.ip_ok(&["link", "set", "dev", "pstport0", "master", "pstbrh1"]);
    ns.run_test(&netns::test_name(
        module_path!(),
        "a_qemu_node_reports_the_hosts_bridges_not_its_trees",
    ));
}
