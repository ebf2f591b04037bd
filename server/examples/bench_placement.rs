//! Placement benchmark: VM creations through the HTTP API of a real `server` process onto
//! simulated nodes, with many concurrent clients; then NUMA-affine multi-GPU decisions
//! timed in-process. Run by `cargo xtask bench placement` (release build).
//!
//! Usage: bench_placement --server-bin PATH [--backend sqlite|postgres] [--servers 1250]
//!        [--gpus 8] [--vms 10000] [--clients 64]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use passage_server::placement::{self, Policy};
use passage_server::store::devices::Candidate;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Args {
    server_bin: String,
    backend: String,
    servers: usize,
    gpus: usize,
    vms: usize,
    clients: usize,
}

fn args() -> Args {
    let mut a = Args {
        server_bin: String::new(),
        backend: "sqlite".into(),
        servers: 1250,
        gpus: 8,
        vms: 10_000,
        clients: 64,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i + 1 < v.len() {
        let val = v[i + 1].clone();
        match v[i].as_str() {
            "--server-bin" => a.server_bin = val,
            "--backend" => a.backend = val,
            "--servers" => a.servers = val.parse().expect("--servers N"),
            "--gpus" => a.gpus = val.parse().expect("--gpus N"),
            "--vms" => a.vms = val.parse().expect("--vms N"),
            "--clients" => a.clients = val.parse().expect("--clients N"),
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    assert!(!a.server_bin.is_empty(), "--server-bin PATH is required");
    a
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// A synthetic GPU server: `gpus` H100s split over two NUMA nodes, each behind its own
/// root port.
fn inventory(gpus: usize) -> Value {
    let devices: Vec<Value> = (0..gpus)
        .map(|g| {
            let numa = u32::from(g >= gpus / 2);
            json!({
                "id": format!("/devices/pci0000:{:02x}/0000:{:02x}:01.0/0000:{:02x}:00.0", g * 16, g * 16, g * 16 + 1),
                "vendor": "10de", "device": "2330", "subvendor": "10de", "subsystem": "16c1",
                "revision": "a1", "class": "030200", "driver": "nvidia",
                "numa_node": numa, "iommu_group": g
            })
        })
        .collect();
    json!({ "devices": devices })
}

async fn post(http: &reqwest::Client, url: &str, token: Option<&str>, body: Value) -> (u16, Value) {
    let mut rb = http.post(url).json(&body);
    if let Some(t) = token {
        rb = rb.bearer_auth(t);
    }
    let r = rb.send().await.unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

fn rss_peak_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let a = args();
    let dir = tempfile::tempdir().unwrap();
    let db = match a.backend.as_str() {
        "sqlite" => format!("sqlite://{}", dir.path().join("bench.db").display()),
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
    };
    let mut child = Command::new(&a.server_bin)
        .args(["--listen", "127.0.0.1:0", "--database", &db])
        .args([
            "--heartbeat-timeout-secs",
            "3600",
            "--job-concurrency",
            "64",
        ])
        .env("PASSAGE_ADMIN_PASSWORD", "bench-admin-password")
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let base = loop {
        let l = lines.next().expect("server exited").unwrap();
        if let Some(u) = l.strip_prefix("Passage listening on ") {
            break u.trim().to_string();
        }
    };
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(a.clients)
        .build()
        .unwrap();
    let (_, login) = post(
        &http,
        &format!("{base}/v1/auth/login"),
        None,
        json!({"login":"admin","password":"bench-admin-password"}),
    )
    .await;
    let op = login["token"].as_str().unwrap().to_string();
    post(
        &http,
        &format!("{base}/v1/variants"),
        Some(&op),
        json!({"name":"H100","type":"gpu","vendor":"10de","device":"2330"}),
    )
    .await;
    post(
        &http,
        &format!("{base}/v1/packages"),
        Some(&op),
        json!({"name":"gpu-1x","vcpus":8,"memory_mib":65536,"devices":{"H100":1}}),
    )
    .await;

    // The fleet: every node registers and reports, as an agent would.
    let t = Instant::now();
    let inv = inventory(a.gpus);
    let mut joins = Vec::new();
    let sem = Arc::new(tokio::sync::Semaphore::new(16));
    for i in 0..a.servers {
        let (http, base, op, inv, sem) = (
            http.clone(),
            base.clone(),
            op.clone(),
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
    println!(
        "fleet: {} servers x {} GPUs registered in {:.1} s",
        a.servers,
        a.gpus,
        t.elapsed().as_secs_f64()
    );

    // The run: `vms` creations from `clients` concurrent clients.
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..a.clients {
        let (http, base, op, next) = (http.clone(), base.clone(), op.clone(), next.clone());
        let total = a.vms;
        workers.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut codes: BTreeMap<u16, usize> = BTreeMap::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= total {
                    break;
                }
                let t = Instant::now();
                let (st, _) = post(
                    &http,
                    &format!("{base}/v1/vms"),
                    Some(&op),
                    json!({"alias": format!("b{i}"), "package": "gpu-1x"}),
                )
                .await;
                lat.push(t.elapsed());
                *codes.entry(st).or_default() += 1;
            }
            (lat, codes)
        }));
    }
    let mut lat = Vec::new();
    let mut codes: BTreeMap<u16, usize> = BTreeMap::new();
    for w in workers {
        let (l, c) = w.await.unwrap();
        lat.extend(l);
        for (k, v) in c {
            *codes.entry(k).or_default() += v;
        }
    }
    let wall = start.elapsed();
    lat.sort();
    let placed = codes.get(&202).copied().unwrap_or(0);
    println!(
        "placements ({}): {placed} of {} in {:.2} s = {:.0}/s; latency p50 {} p95 {} p99 {} max {}; answers {codes:?}",
        a.backend,
        a.vms,
        wall.as_secs_f64(),
        placed as f64 / wall.as_secs_f64(),
        ms(pct(&lat, 0.5)),
        ms(pct(&lat, 0.95)),
        ms(pct(&lat, 0.99)),
        ms(pct(&lat, 1.0)),
    );

    // The check: no device held twice, every placement holds exactly one device.
    let mut seen = HashSet::new();
    let mut held = 0usize;
    for page in 0.. {
        let r = http
            .get(format!("{base}/v1/vms?limit=1000&offset={}", page * 1000))
            .bearer_auth(&op)
            .send()
            .await
            .unwrap();
        let vms: Value = r.json().await.unwrap();
        let vms = vms.as_array().unwrap();
        if vms.is_empty() {
            break;
        }
        for vm in vms {
            for d in vm["assigned_devices"].as_array().unwrap() {
                held += 1;
                assert!(
                    seen.insert(format!("{}{}", vm["server_uuid"], d)),
                    "device held twice: {d}"
                );
            }
        }
    }
    let r = http
        .get(format!("{base}/v1/capacity"))
        .bearer_auth(&op)
        .send()
        .await
        .unwrap();
    let cap: Value = r.json().await.unwrap();
    println!(
        "check: {held} devices assigned, {} distinct; capacity held {} of {}",
        seen.len(),
        cap[0]["held"],
        cap[0]["total"]
    );
    assert_eq!(held, placed);
    println!(
        "server peak RSS: {} MiB",
        rss_peak_kib(pid).unwrap_or(0) / 1024
    );
    let _ = child.kill();
    let _ = child.wait();

    // Multi-GPU NUMA-affine decisions over 2,000 servers, in-process.
    let mut cands = Vec::new();
    for s in 0..2000u128 {
        // Half the fleet partly used, so decisions have to look.
        let free = if s % 2 == 0 { 8 } else { 3 + (s % 5) as usize };
        for g in 0..free {
            cands.push(Candidate {
                server_uuid: passage_model::ServerId(uuid::Uuid::from_u128(s + 1)),
                id: format!(
                    "/devices/pci0000:{:02x}/0000:{:02x}:01.0/0000:{:02x}:00.0",
                    g * 16,
                    g * 16,
                    g * 16 + 1
                )
                .parse()
                .unwrap(),
                variant: "H100".into(),
                numa_node: Some(u32::from(g >= 4)),
            });
        }
    }
    for n in [4u32, 8] {
        let req: BTreeMap<String, u32> = [("H100".to_string(), n)].into();
        let mut times = Vec::new();
        for _ in 0..200 {
            let t = Instant::now();
            let p = placement::choose(&cands, &req, &[], Policy::Pack).unwrap();
            times.push(t.elapsed());
            assert_eq!(p.devices.len(), n as usize);
        }
        times.sort();
        println!(
            "decision for {n} GPUs over 2000 servers ({} free devices): p50 {} p99 {}",
            cands.len(),
            ms(pct(&times, 0.5)),
            ms(pct(&times, 0.99))
        );
    }
}
