//! Placement benchmark: VM creations through the HTTP API of a real `server` process onto
//! simulated nodes, with many concurrent clients; then NUMA-affine multi-GPU decisions
//! timed in-process. Run by `cargo xtask bench placement` (release build).
//!
//! Usage: bench_placement --server-bin PATH [--backend sqlite|postgres] [--servers 1250]
//!        [--gpus 8] [--vms 10000] [--clients 64] [--vgpu-slots 4]
//!
//! With `--vgpu-slots N` every GPU can host N vGPUs of one type, and each VM asks for one
//! vGPU instead of a whole GPU: the run then includes turning free GPUs into vGPU hosts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use clap::Parser;
use common::{ms, pct, post};
use passage_server::placement::{self, Policy};
use passage_server::store::devices::Candidate;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// The `server` binary to start.
    #[arg(long, value_name = "PATH")]
    server_bin: String,
    /// sqlite | postgres (a fresh database on PASSAGE_TEST_PG_URL).
    #[arg(long, default_value = "sqlite", value_parser = ["sqlite", "postgres"])]
    backend: String,
    /// Simulated compute nodes.
    #[arg(long, default_value_t = 1250)]
    servers: usize,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus: usize,
    /// VMs to create.
    #[arg(long, default_value_t = 10_000)]
    vms: usize,
    /// Concurrent API clients.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Each VM asks for one vGPU of a type every GPU hosts this many times.
    #[arg(long, value_name = "N")]
    vgpu_slots: Option<u32>,
    /// Write every creation as `started_ms,latency_ms,status` (CSV) to this file, to see
    /// where in the run the slow ones fall.
    #[arg(long, value_name = "PATH")]
    latencies: Option<std::path::PathBuf>,
    /// Each VM also gets an address on a default /16 network on bridge br0 (every node
    /// reports br0): the addresses' share of a creation.
    #[arg(long)]
    network: bool,
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
    let a = Args::parse();
    let dir = tempfile::tempdir().unwrap();
    let db = common::database(&a.backend, dir.path()).await;
    let (mut child, base) = common::start_server(&a.server_bin, &db);
    let pid = child.id();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(a.clients)
        .build()
        .unwrap();
    let op = common::catalog(&http, &base).await;
    let package = match a.vgpu_slots {
        None => "gpu-1x",
        Some(n) => {
            let variant = json!({"name": "H100_20C", "type": "vgpu", "parent": "H100",
                                 "vgpu_type": "NVIDIA H100XM-20C", "max_per_gpu": n});
            post(&http, &format!("{base}/v1/variants"), Some(&op), variant).await;
            let pkg = json!({"name": "vgpu-1x", "vcpus": 1, "memory_mib": 1024,
                             "devices": {"H100_20C": 1}});
            post(&http, &format!("{base}/v1/packages"), Some(&op), pkg).await;
            "vgpu-1x"
        }
    };

    if a.network {
        let net = json!({"name": "bench", "subnet": "10.128.0.0/16", "bridge": "br0",
                         "public": true, "default": true});
        let (st, body) = post(&http, &format!("{base}/v1/networks"), Some(&op), net).await;
        assert_eq!(st, 201, "{body}");
    }

    // The fleet: every node registers and reports, as an agent would.
    let t = Instant::now();
    let mut inventory = common::inventory_with(a.gpus, a.vgpu_slots);
    if a.network {
        inventory["bridges"] = json!(["br0"]);
    }
    common::fleet_with(&http, &base, &op, a.servers, inventory).await;
    println!(
        "fleet: {} servers x {} GPUs registered in {:.1} s",
        a.servers,
        a.gpus,
        t.elapsed().as_secs_f64()
    );

    // Each client's connection is opened before the clock starts, as an API client that
    // keeps its connection alive has it: the run times creations, not TCP handshakes.
    let mut opening = Vec::new();
    for _ in 0..a.clients {
        let (http, base) = (http.clone(), base.clone());
        opening.push(tokio::spawn(async move {
            http.get(format!("{base}/v1/ping")).send().await.unwrap();
        }));
    }
    for o in opening {
        o.await.unwrap();
    }

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
                let started = t.duration_since(start);
                let (st, _) = post(
                    &http,
                    &format!("{base}/v1/vms"),
                    Some(&op),
                    json!({"alias": format!("b{i}"), "package": package, "image": "bench"}),
                )
                .await;
                lat.push((started, t.elapsed(), st));
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
    if let Some(path) = &a.latencies {
        let mut csv = String::from("started_ms,latency_ms,status\n");
        for (s, l, st) in &lat {
            csv.push_str(&format!(
                "{:.3},{:.3},{st}\n",
                s.as_secs_f64() * 1e3,
                l.as_secs_f64() * 1e3
            ));
        }
        std::fs::write(path, csv).unwrap();
    }
    // Where the tail falls: the slowest 1 % by when they were sent.
    lat.sort_by_key(|&(_, l, _)| std::cmp::Reverse(l));
    let tail = &lat[..lat.len().div_ceil(100)];
    let early = tail.iter().filter(|(s, _, _)| s.as_millis() < 500).count();
    println!(
        "slowest 1 %: {} creations, {early} of them sent in the run's first 0.5 s",
        tail.len()
    );
    let mut lat: Vec<_> = lat.into_iter().map(|(_, l, _)| l).collect();
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

    // The check: no device held twice, every placement holds exactly one device (and,
    // with --network, one address, never another VM's).
    let mut seen = HashSet::new();
    let mut held = 0usize;
    let mut addresses = HashSet::new();
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
            if a.network {
                let ip = vm["primary_ip"].as_str().expect("an address").to_string();
                assert!(addresses.insert(ip.clone()), "address held twice: {ip}");
            }
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
    let of = |name: &str| {
        cap.as_array()
            .and_then(|c| c.iter().find(|c| c["variant"] == name))
            .cloned()
            .unwrap_or_default()
    };
    let whole = of("H100");
    if a.network {
        println!("check: {} distinct addresses", addresses.len());
    }
    println!(
        "check: {held} devices assigned, {} distinct; capacity held {} of {}",
        seen.len(),
        whole["held"],
        whole["total"]
    );
    if a.vgpu_slots.is_some() {
        let v = &of("H100_20C")["vgpu"];
        println!(
            "vGPUs: {} in use, {} remaining of {} on {} GPUs hosting them ({} GPUs shared)",
            v["in_use"], v["remaining_capacity"], v["max_capacity"], v["gpus"], whole["shared"]
        );
    }
    assert_eq!(held, placed);
    println!(
        "server peak RSS: {} MiB",
        rss_peak_kib(pid).unwrap_or(0) / 1024
    );
    let _ = child.kill();
    let _ = child.wait();
    common::drop_database(&db).await;

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
                window: None,
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
