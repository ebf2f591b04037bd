//! What the benchmarks share: a real `server` process on a temporary database, a
//! synthetic fleet registered through the agent API, percentiles.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod guests;

use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

pub fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

pub fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// A synthetic GPU server: `gpus` H100s split over two NUMA nodes, each behind its own
/// root port.
pub fn inventory(gpus: usize) -> Value {
    inventory_with(gpus, None)
}

/// [`inventory`] whose GPUs, with `vgpu_slots`, host NVIDIA's `H100XM-20C` through mdev,
/// that many times each.
pub fn inventory_with(gpus: usize, vgpu_slots: Option<u32>) -> Value {
    let devices: Vec<Value> = (0..gpus)
        .map(|g| {
            let numa = u32::from(g >= gpus / 2);
            json!({
                "id": format!("/devices/pci0000:{:02x}/0000:{:02x}:01.0/0000:{:02x}:00.0", g * 16, g * 16, g * 16 + 1),
                "vendor": "10de", "device": "2330", "subvendor": "10de", "subsystem": "16c1",
                "revision": "a1", "class": "030200", "driver": "nvidia",
                "numa_node": numa, "iommu_group": g,
                "details": vgpu_slots.map(|n| json!({"vgpu": {"framework": "mdev", "types": [
                    {"id": "nvidia-563", "name": "NVIDIA H100XM-20C", "framebuffer_mib": 20480,
                     "max_instances": n, "available": n}]}}))
            })
        })
        .collect();
    json!({ "devices": devices })
}

pub async fn post(
    http: &reqwest::Client,
    url: &str,
    token: Option<&str>,
    body: Value,
) -> (u16, Value) {
    let mut rb = http.post(url).json(&body);
    if let Some(t) = token {
        rb = rb.bearer_auth(t);
    }
    let r = rb.send().await.unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

/// A database URL for `backend`: a file in `dir`, or a new Postgres database.
pub async fn database(backend: &str, dir: &std::path::Path) -> String {
    match backend {
        "sqlite" => format!("sqlite://{}", dir.join("bench.db").display()),
        "postgres" => {
            let admin = std::env::var("PASSAGE_TEST_PG_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
            let name = format!("passage_bench_{}", uuid::Uuid::new_v4().simple());
            let pool = sqlx::PgPool::connect(&admin).await.unwrap();
            sqlx::query(&format!("CREATE DATABASE {name}"))
                .execute(&pool)
                .await
                .unwrap();
            let base = admin.rsplit_once('/').map(|(b, _)| b.to_string()).unwrap();
            format!("{base}/{name}")
        }
        other => panic!("--backend sqlite|postgres, not {other}"),
    }
}

/// Drops the Postgres database `database` made, once its server has stopped, so that runs
/// do not pile up databases; a SQLite file goes with its temp folder.
pub async fn drop_database(url: &str) {
    let Some((base, name)) = url.rsplit_once('/') else {
        return;
    };
    if !name.starts_with("passage_bench_") {
        return;
    }
    let admin = std::env::var("PASSAGE_TEST_PG_URL").unwrap_or_else(|_| format!("{base}/postgres"));
    let dropped = match sqlx::PgPool::connect(&admin).await {
        Ok(pool) => sqlx::query(&format!("DROP DATABASE IF EXISTS {name}"))
            .execute(&pool)
            .await
            .map(|_| ()),
        Err(e) => Err(e),
    };
    if let Err(e) = dropped {
        eprintln!("could not drop the bench database {name}: {e}");
    }
}

pub const ADMIN_PASSWORD: &str = "bench-admin-password";

/// Starts `server_bin` on a free port; answers the child and its base URL. Nodes stay
/// "running" for an hour without heartbeats, and job steps wait an hour for agents that
/// never answer, so only the measured requests load the server.
pub fn start_server(server_bin: &str, db: &str) -> (Child, String) {
    let mut cmd = Command::new(server_bin);
    cmd.args(["--listen", "127.0.0.1:0", "--database", db])
        .args([
            "--heartbeat-timeout-secs",
            "3600",
            "--job-concurrency",
            "64",
        ])
        .args(["--task-timeout-secs", "3600"])
        // Not ./images on Postgres: the bench's files stay out of the clone.
        .env(
            "PASSAGE_IMAGE_DIR",
            std::env::temp_dir().join(format!("passage-bench-images-{}", std::process::id())),
        )
        .env("PASSAGE_ADMIN_PASSWORD", ADMIN_PASSWORD)
        // Errors only, unless a run is being traced (`BENCH_RUST_LOG=passage_server::…=debug`).
        .env(
            "RUST_LOG",
            std::env::var("BENCH_RUST_LOG").unwrap_or("error".into()),
        );
    spawn_server(&mut cmd)
}

/// Starts `cmd` (a `server` command line) with its stdout piped; answers the child and
/// the base URL it prints once it listens.
pub fn spawn_server(cmd: &mut Command) -> (Child, String) {
    let mut child = cmd.stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let base = loop {
        let l = lines.next().expect("server exited").unwrap();
        if let Some(u) = l.strip_prefix("Passage listening on ") {
            break u.trim().to_string();
        }
    };
    // Keep reading, so the server never writes into a closed pipe.
    std::thread::spawn(move || for _ in lines {});
    (child, base)
}

/// Logs in as the operator and creates variant `H100` and package `gpu-1x`; answers the
/// operator's token.
pub async fn catalog(http: &reqwest::Client, base: &str) -> String {
    let (_, login) = post(
        http,
        &format!("{base}/v1/auth/login"),
        None,
        json!({"login":"admin","password":ADMIN_PASSWORD}),
    )
    .await;
    let op = login["token"].as_str().unwrap().to_string();
    post(
        http,
        &format!("{base}/v1/variants"),
        Some(&op),
        json!({"name":"H100","type":"gpu","vendor":"10de","device":"2330"}),
    )
    .await;
    post(
        http,
        &format!("{base}/v1/packages"),
        Some(&op),
        json!({"name":"gpu-1x","vcpus":8,"memory_mib":65536,"devices":{"H100":1}}),
    )
    .await;
    // VMs boot an image: a small raw one, `bench`.
    let (_, img) = post(
        http,
        &format!("{base}/v1/images"),
        Some(&op),
        json!({"name":"bench","version":"1","os":"linux","type":"raw","public":true}),
    )
    .await;
    let uuid = img["uuid"].as_str().unwrap_or_default().to_string();
    let r = http
        .put(format!("{base}/v1/images/{uuid}/file"))
        .bearer_auth(&op)
        .body(vec![0x5au8; 1 << 20])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "uploading the bench image");
    op
}

/// Every node registers and reports its GPUs, as an agent would.
pub async fn fleet(http: &reqwest::Client, base: &str, op: &str, servers: usize, gpus: usize) {
    fleet_with(http, base, op, servers, inventory(gpus)).await;
}

/// [`fleet`] of nodes that each report `inv`.
pub async fn fleet_with(http: &reqwest::Client, base: &str, op: &str, servers: usize, inv: Value) {
    let mut joins = Vec::new();
    let sem = Arc::new(tokio::sync::Semaphore::new(16));
    for i in 0..servers {
        let (http, base, op, inv, sem) = (
            http.clone(),
            base.to_string(),
            op.to_string(),
            inv.clone(),
            sem.clone(),
        );
        joins.push(tokio::spawn(async move {
            let _p = sem.acquire().await.unwrap();
            let (_, jt) = post(
                &http,
                &format!("{base}/v1/servers/join-tokens"),
                Some(&op),
                json!({}),
            )
            .await;
            let (_, reg) = post(
                &http,
                &format!("{base}/agent/v1/register"),
                None,
                json!({
                "join_token": jt["token"], "hostname": format!("cn-{i}"),
                "agent_version": "bench", "protocol_version": 1}),
            )
            .await;
            let cred = reg["credential"].as_str().unwrap().to_string();
            let r = http
                .put(format!("{base}/agent/v1/inventory"))
                .bearer_auth(&cred)
                .json(&inv)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 204);
        }));
    }
    for j in joins {
        j.await.unwrap();
    }
}
