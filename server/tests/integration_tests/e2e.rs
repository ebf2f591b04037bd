//! The real `server` and `node-agent` binaries on loopback over a fake tree of 8 H100s:
//! operator sets up, tenant provisions and destroys, the device is scrubbed before reuse.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestDb, wait_for};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn node_agent_bin() -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_server")).with_file_name("node-agent");
    assert!(
        p.exists(),
        "{} is missing: build the binaries first (cargo build --workspace --bins; \
         cargo xtask test does)",
        p.display()
    );
    p
}

fn start_server(db: &TestDb, extra: &[&str]) -> (Proc, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_server"))
        .args(["--listen", "127.0.0.1:0", "--database", &db.url])
        .args(extra)
        .env("PASSAGE_ADMIN_PASSWORD", "e2e-admin-password")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let proc = Proc(child);
    let mut lines = BufReader::new(stdout).lines();
    let base = loop {
        let line = lines
            .next()
            .expect("server exited before listening")
            .unwrap();
        if let Some(url) = line.strip_prefix("Passage listening on ") {
            break url.trim().to_string();
        }
    };
    (proc, base)
}

async fn call(
    http: &reqwest::Client,
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut rb = http.request(method.parse().unwrap(), url);
    if let Some(t) = token {
        rb = rb.bearer_auth(t);
    }
    if let Some(b) = body {
        rb = rb.json(&b);
    }
    let r = rb.send().await.unwrap();
    let st = r.status().as_u16();
    let text = r.text().await.unwrap();
    (st, serde_json::from_str(&text).unwrap_or(Value::Null))
}

async fn walk(b: Backend) {
    let db = TestDb::new(b).await;
    let agent_bin = node_agent_bin();
    let (_server, base) = start_server(&db, &[]);
    let http = reqwest::Client::new();
    let u = |p: &str| format!("{base}{p}");

    // Operator: log in, admit a node.
    let (st, login) = call(
        &http,
        "POST",
        &u("/v1/auth/login"),
        None,
        Some(json!({"login":"admin","password":"e2e-admin-password"})),
    )
    .await;
    assert_eq!(st, 200, "{login}");
    let op = login["token"].as_str().unwrap().to_string();
    let (st, jt) = call(
        &http,
        "POST",
        &u("/v1/servers/join-tokens"),
        Some(&op),
        None,
    )
    .await;
    assert_eq!(st, 201);
    let sysfs = db.dir.path().join("sysfs");
    let out = Command::new(&agent_bin)
        .args(["fake-sysfs", "--out"])
        .arg(&sysfs)
        .args(["--gpus", "8", "--model", "h100"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _agent = Proc(
        Command::new(&agent_bin)
            .args([
                "run",
                "--server",
                &base,
                "--join-token",
                jt["token"].as_str().unwrap(),
            ])
            .arg("--sysfs-root")
            .arg(&sysfs)
            .arg("--state-dir")
            .arg(db.dir.path().join("agent-state"))
            .args([
                "--hypervisor",
                "sim",
                "--heartbeat-secs",
                "1",
                "--hostname",
                "cn-e2e",
            ])
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap(),
    );
    let server_uuid = wait_for(Duration::from_secs(30), || async {
        let (_, list) = call(&http, "GET", &u("/v1/servers"), Some(&op), None).await;
        let s = list.as_array()?.first()?.clone();
        (s["sysinfo"]["PCI Devices"].as_array()?.len() > 8)
            .then(|| s["uuid"].as_str().unwrap().to_string())
    })
    .await
    .expect("the node registered and reported");

    // Operator: variant, package, tenant.
    let (st, _) = call(
        &http,
        "POST",
        &u("/v1/variants"),
        Some(&op),
        Some(json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330"})),
    )
    .await;
    assert_eq!(st, 201);
    let (_, srv) = call(
        &http,
        "GET",
        &u(&format!("/v1/servers/{server_uuid}")),
        Some(&op),
        None,
    )
    .await;
    assert_eq!(srv["status"], "running");
    assert_eq!(srv["assignable_devices"].as_array().unwrap().len(), 8);
    let (st, _) = call(&http, "POST", &u("/v1/packages"), Some(&op), Some(json!({"name":"gpu-1x","vcpus":8,"memory_mib":65536,"disk_gib":100,"devices":{"NVIDIA_H100":1}}))).await;
    assert_eq!(st, 201);
    let (st, _) = call(
        &http,
        "POST",
        &u("/v1/accounts"),
        Some(&op),
        Some(json!({"login":"tenant1","password":"tenant-password","role":"tenant"})),
    )
    .await;
    assert_eq!(st, 201);
    let (_, tl) = call(
        &http,
        "POST",
        &u("/v1/auth/login"),
        None,
        Some(json!({"login":"tenant1","password":"tenant-password"})),
    )
    .await;
    let tenant = tl["token"].as_str().unwrap().to_string();

    // Tenant: create, watch it run with one device.
    let (st, vm) = call(
        &http,
        "POST",
        &u("/v1/vms"),
        Some(&tenant),
        Some(json!({"alias":"train-1","package":"gpu-1x"})),
    )
    .await;
    assert_eq!(st, 202, "{vm}");
    let vm_url = u(&format!("/v1/vms/{}", vm["uuid"].as_str().unwrap()));
    let running = wait_for(Duration::from_secs(30), || async {
        let (_, v) = call(&http, "GET", &vm_url, Some(&tenant), None).await;
        (v["state"] == "running").then_some(v)
    })
    .await
    .expect("the VM reached running");
    let devs = running["assigned_devices"].as_array().unwrap();
    assert_eq!(devs.len(), 1);
    let dev = devs[0].as_str().unwrap().to_string();
    let lspci = Command::new(&agent_bin)
        .args(["lspci", "--sysfs-root"])
        .arg(&sysfs)
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&lspci.stdout);
    let line = listing.lines().find(|l| l.contains(&dev)).unwrap();
    assert!(line.ends_with(" vfio-pci"), "bound for passthrough: {line}");

    // Tenant: destroy. The device goes dirty, and is unassigned only after its scrub.
    let (st, _) = call(&http, "DELETE", &vm_url, Some(&tenant), None).await;
    assert_eq!(st, 202);
    wait_for(Duration::from_secs(30), || async {
        let (_, v) = call(&http, "GET", &vm_url, Some(&tenant), None).await;
        (v["state"] == "destroyed").then_some(())
    })
    .await
    .expect("the VM was destroyed");
    let events_url = u(&format!(
        "/v1/servers/{server_uuid}/device-events?device={dev}"
    ));
    let events = wait_for(Duration::from_secs(30), || async {
        let (_, ev) = call(&http, "GET", &events_url, Some(&op), None).await;
        (ev.as_array()?.last()?["to"] == "unassigned" && ev.as_array()?.len() > 2).then_some(ev)
    })
    .await
    .expect("the device came back");
    let path: Vec<&str> = events
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["to"].as_str().unwrap())
        .collect();
    assert_eq!(
        path,
        ["provisioning", "used", "dirty", "cleaning", "unassigned"]
    );
    let (_, reports) = call(
        &http,
        "GET",
        &u(&format!(
            "/v1/servers/{server_uuid}/scrub-reports?device={dev}"
        )),
        Some(&op),
        None,
    )
    .await;
    let report = &reports.as_array().unwrap()[0];
    assert_eq!(report["ok"], true);
    let dirty_at = events[2]["at"].as_str().unwrap();
    let back_at = events[4]["at"].as_str().unwrap();
    let report_at = report["at"].as_str().unwrap();
    assert!(
        dirty_at <= report_at && report_at <= back_at,
        "{dirty_at} {report_at} {back_at}"
    );
    let (_, srv) = call(
        &http,
        "GET",
        &u(&format!("/v1/servers/{server_uuid}")),
        Some(&op),
        None,
    )
    .await;
    assert!(
        srv["assignable_devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["state"] == "unassigned")
    );
}
both!(real_binaries, walk);

/// `--sim-servers`: simulated nodes register themselves, keep their identity across a
/// restart of the server, and are placed on like any other.
async fn simulated_nodes(b: Backend) {
    let db = TestDb::new(b).await;
    let sim_dir = db.dir.path().join("sim");
    let sim = sim_dir.to_str().unwrap().to_string();
    let args = [
        "--sim-servers",
        "2",
        "--sim-gpus",
        "4",
        "--sim-model",
        "a100",
        "--sim-dir",
        &sim,
    ];
    let http = reqwest::Client::new();
    let mut uuids: Vec<String> = Vec::new();
    for round in 0..2 {
        let (server, base) = start_server(&db, &args);
        let (_, login) = call(
            &http,
            "POST",
            &format!("{base}/v1/auth/login"),
            None,
            Some(json!({"login":"admin","password":"e2e-admin-password"})),
        )
        .await;
        let op = login["token"].as_str().unwrap().to_string();
        let list = wait_for(Duration::from_secs(30), || async {
            let (_, list) =
                call(&http, "GET", &format!("{base}/v1/servers"), Some(&op), None).await;
            let ready = list
                .as_array()?
                .iter()
                .filter(|s| s["status"] == "running")
                .filter(|s| {
                    s["sysinfo"]["PCI Devices"]
                        .as_array()
                        .is_some_and(|d| d.iter().filter(|d| d["device"] == "20b0").count() == 4)
                })
                .count();
            (ready == 2).then_some(list)
        })
        .await
        .unwrap_or_else(|| panic!("round {round}: two simulated nodes with 4 A100s each"));
        let mut now: Vec<String> = list
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["uuid"].as_str().unwrap().to_string())
            .collect();
        now.sort();
        if round == 0 {
            uuids = now;
        } else {
            assert_eq!(
                now, uuids,
                "the same two nodes after a restart, no new ones"
            );
        }
        drop(server);
    }
}
both!(sim_servers, simulated_nodes);
