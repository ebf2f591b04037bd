//! Fleet benchmark: the whole pipeline a user runs, on a simulated fleet inside a real
//! `server` process (`--sim-servers`: the real agent loop per node, fake sysfs, the `sim`
//! hypervisor). Creations from many clients, then every VM `running` (bind, launch and
//! mark-used answered by the nodes), then every VM deleted and every device back to
//! `unassigned` through its scrub. Run by `cargo xtask bench fleet` (release build).
//!
//! Usage: bench_fleet --server-bin PATH [--backend sqlite|postgres] [--servers 1250]
//!        [--gpus 8] [--vms 10000] [--vcpus 1] [--memory-mib 1024] [--clients 64]
//!        [--idle-secs 10] [--poll-ms 200]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use clap::Parser;
use common::{ms, pct, post};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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
    /// VMs to create (one GPU each).
    #[arg(long, default_value_t = 10_000)]
    vms: usize,
    /// vCPUs of the package each VM gets.
    #[arg(long, default_value_t = 1)]
    vcpus: u32,
    /// Memory (MiB) of the package each VM gets. The simulated nodes report 64 CPUs and
    /// 512 GiB (4 GiB kept for the host): 8 vCPUs and 65536 MiB leave each node's eighth
    /// GPU free with no room for its VM, the case where placement must skip full nodes.
    #[arg(long, default_value_t = 1024)]
    memory_mib: u64,
    /// Concurrent API clients.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// How long the idle fleet is watched before the run.
    #[arg(long, default_value_t = 10)]
    idle_secs: u64,
    /// How long to wait for each phase to finish before reporting it unfinished.
    #[arg(long, default_value_t = 600)]
    phase_limit_secs: u64,
    /// How often the capacity is read to see a phase finish: its end is seen at most this
    /// late. Each read counts every device by state; at 50 ms, the reads alone kept a third
    /// of a Postgres backend busy while the jobs ran.
    #[arg(long, default_value_t = 200)]
    poll_ms: u64,
}

/// What `/proc` says of the server process.
struct Proc {
    pid: u32,
    ticks_per_sec: f64,
}

impl Proc {
    /// User + system CPU time so far, in seconds.
    fn cpu_secs(&self) -> f64 {
        let s = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
        // The fields after the command name (which may hold spaces) in parentheses.
        let rest = s.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = rest.split_whitespace().collect();
        let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after it.
        (t(11) + t(12)) / self.ticks_per_sec
    }

    fn status_kib(&self, key: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// Context switches so far (voluntary and not) of each of the server's threads, by
    /// thread id.
    fn switches(&self) -> std::collections::HashMap<String, u64> {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{}/task", self.pid)) else {
            return Default::default();
        };
        dir.flatten()
            .map(|t| {
                let s = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
                let n: u64 = s
                    .lines()
                    .filter(|l| l.contains("ctxt_switches:"))
                    .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                    .sum();
                (t.file_name().to_string_lossy().into_owned(), n)
            })
            .collect()
    }

    /// Context switches of the server's threads since `before` (a thread that ended
    /// meanwhile is not counted: a run's threads live as long as it, but for a few of the
    /// simulated nodes' blocking threads that end after 10 s without work).
    fn switches_since(&self, before: &std::collections::HashMap<String, u64>) -> u64 {
        self.switches()
            .iter()
            .map(|(tid, n)| n.saturating_sub(before.get(tid).copied().unwrap_or(0)))
            .sum()
    }

    fn open_files(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid)).map_or(0, |d| d.count())
    }
}

/// Room a simulated node's fake sysfs tree takes on a tmpfs (about 2.9 MiB: a thousand
/// small files and links), with some to spare.
const TREE_BYTES: u64 = 4 << 20;

/// Where the simulated nodes' trees go: a tmpfs (`/dev/shm`) when it has room, as sysfs is
/// in memory on a real node; a thousand nodes' million files on a disk took minutes to
/// write and to delete, and the next run's start waited behind the last one's deletion.
fn sim_parent(servers: usize) -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    let room = rustix::fs::statvfs(shm)
        .map(|s| s.f_bavail.saturating_mul(s.f_frsize))
        .unwrap_or(0);
    if room >= (servers as u64).saturating_mul(TREE_BYTES)
        && let Ok(d) = tempfile::Builder::new()
            .prefix("passage-bench-fleet")
            .tempdir_in(shm)
    {
        return d;
    }
    tempfile::tempdir().unwrap()
}

fn start(a: &Args, db: &str, sim_dir: &std::path::Path) -> (Child, String) {
    let mut cmd = Command::new(&a.server_bin);
    cmd.args(["--listen", "127.0.0.1:0", "--database", db])
        .args(["--sim-servers", &a.servers.to_string()])
        .args(["--sim-gpus", &a.gpus.to_string()])
        .arg("--sim-dir")
        .arg(sim_dir)
        .args(["--scrub-grace-secs", "0"])
        // Not ./images on Postgres: the bench's files stay out of the clone.
        .env("PASSAGE_IMAGE_DIR", sim_dir.with_file_name("images"))
        .env("PASSAGE_ADMIN_PASSWORD", common::ADMIN_PASSWORD)
        // Errors only, unless a run is being traced (`BENCH_RUST_LOG=sqlx::query=debug`).
        .env(
            "RUST_LOG",
            std::env::var("BENCH_RUST_LOG").unwrap_or("error".into()),
        );
    common::spawn_server(&mut cmd)
}

async fn capacity(http: &reqwest::Client, base: &str, op: &str) -> Value {
    let r = http
        .get(format!("{base}/v1/capacity"))
        .bearer_auth(op)
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    v.as_array()
        .and_then(|a| a.iter().find(|c| c["variant"] == "H100").cloned())
        .unwrap_or(Value::Null)
}

fn count(c: &Value, key: &str) -> u64 {
    c[key].as_u64().unwrap_or(0)
}

/// Polls the capacity every `every` until `done` says so or the limit passes; answers when
/// it was seen done, measured from `from`.
async fn until(
    http: &reqwest::Client,
    base: &str,
    op: &str,
    (from, every, limit): (Instant, Duration, Duration),
    done: impl Fn(&Value) -> bool,
) -> Option<Duration> {
    loop {
        let c = capacity(http, base, op).await;
        if done(&c) {
            return Some(from.elapsed());
        }
        if from.elapsed() > limit {
            eprintln!("unfinished after {limit:?}: {c}");
            return None;
        }
        tokio::time::sleep(every).await;
    }
}

/// `n` requests from `clients` concurrent clients: `request(i)` makes the i-th. Answers
/// every latency (sorted), the answers by status, and the wall time.
async fn burst<F, Fut>(
    clients: usize,
    n: usize,
    request: F,
) -> (Vec<Duration>, BTreeMap<u16, usize>, Duration, Vec<usize>)
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = u16> + Send,
{
    let request = Arc::new(request);
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..clients {
        let (next, request) = (next.clone(), request.clone());
        workers.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut codes: BTreeMap<u16, usize> = BTreeMap::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    break;
                }
                let t = Instant::now();
                let st = request(i).await;
                lat.push((t - start, t.elapsed()));
                *codes.entry(st).or_default() += 1;
            }
            (lat, codes)
        }));
    }
    let mut timed: Vec<(Duration, Duration)> = Vec::new();
    let mut codes: BTreeMap<u16, usize> = BTreeMap::new();
    for w in workers {
        let (l, c) = w.await.unwrap();
        timed.extend(l);
        for (k, v) in c {
            *codes.entry(k).or_default() += v;
        }
    }
    let wall = start.elapsed();
    let mut lat: Vec<Duration> = timed.iter().map(|t| t.1).collect();
    lat.sort();
    // Where the slowest 1 % fell: how many were sent in each second of the burst.
    let p99 = pct(&lat, 0.99);
    let mut slow_by_second = vec![0; wall.as_secs() as usize + 1];
    for (sent, took) in &timed {
        if *took >= p99 {
            slow_by_second[sent.as_secs() as usize] += 1;
        }
    }
    (lat, codes, wall, slow_by_second)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let a = Args::parse();
    let limit = Duration::from_secs(a.phase_limit_secs);
    let every = Duration::from_millis(a.poll_ms.max(1));
    let dir = tempfile::tempdir().unwrap();
    let db = common::database(&a.backend, dir.path()).await;
    let sims = sim_parent(a.servers);
    let sim_dir = sims.path().join("sim");
    println!("simulated nodes' trees in {}", sim_dir.display());
    let t = Instant::now();
    let (mut child, base) = start(&a, &db, &sim_dir);
    let server = Proc {
        pid: child.id(),
        // USER_HZ: 100 on every Linux this runs on.
        ticks_per_sec: 100.0,
    };
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(a.clients)
        .build()
        .unwrap();
    let op = common::catalog(&http, &base).await;
    // One GPU and little else: the simulated nodes report their CPUs and memory, and the
    // run measures the pipeline, not how many 64 GiB VMs a node's memory holds.
    post(
        &http,
        &format!("{base}/v1/packages"),
        Some(&op),
        json!({"name":"fleet-1x","vcpus":a.vcpus,"memory_mib":a.memory_mib,"devices":{"H100":1}}),
    )
    .await;
    let total = (a.servers * a.gpus) as u64;
    let up = until(&http, &base, &op, (t, every, limit), |c| {
        count(c, "free") == total
    })
    .await;
    println!(
        "fleet ({}): {} simulated nodes x {} GPUs, all {total} GPUs free {} after the server started",
        a.backend,
        a.servers,
        a.gpus,
        up.map_or("never".into(), |d| format!("{:.1} s", d.as_secs_f64())),
    );

    // The idle fleet: heartbeats and inventory reports only.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cpu0 = server.cpu_secs();
    let t_idle = Instant::now();
    tokio::time::sleep(Duration::from_secs(a.idle_secs)).await;
    let idle_cpu = (server.cpu_secs() - cpu0) / t_idle.elapsed().as_secs_f64();
    println!(
        "idle fleet: server CPU {:.0} % of one core, RSS {} MiB, {} open files",
        idle_cpu * 100.0,
        server.status_kib("VmRSS:") / 1024,
        server.open_files()
    );

    // Connections opened before the clock starts, as long-lived API clients have them.
    for _ in 0..a.clients {
        http.get(format!("{base}/v1/ping")).send().await.unwrap();
    }

    // Creations: accepted, then all running.
    let cpu0 = server.cpu_secs();
    let sw0 = server.switches();
    let first = Instant::now();
    let (h, b, o) = (http.clone(), base.clone(), op.clone());
    let created: Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let keep = created.clone();
    let (lat, codes, wall, slow) = burst(a.clients, a.vms, move |i| {
        let (h, b, o, keep) = (h.clone(), b.clone(), o.clone(), keep.clone());
        async move {
            let (st, vm) = post(
                &h,
                &format!("{b}/v1/vms"),
                Some(&o),
                json!({"alias": format!("f{i}"), "package": "fleet-1x", "image": "bench"}),
            )
            .await;
            if let Some(u) = vm["uuid"].as_str() {
                keep.lock().unwrap().push(u.to_string());
            }
            st
        }
    })
    .await;
    let accepted = codes.get(&202).copied().unwrap_or(0);
    println!(
        "creations: {accepted} of {} accepted in {:.2} s = {:.0}/s; latency p50 {} p99 {} max {}; answers {codes:?}",
        a.vms,
        wall.as_secs_f64(),
        accepted as f64 / wall.as_secs_f64(),
        ms(pct(&lat, 0.5)),
        ms(pct(&lat, 0.99)),
        ms(pct(&lat, 1.0)),
    );
    println!("  the slowest 1 % by second sent: {slow:?}");
    let n = accepted as u64;
    let running = until(&http, &base, &op, (first, every, limit), |c| {
        count(c, "used") == n
    })
    .await;
    let vms_running = {
        let r = http
            .get(format!("{base}/v1/vms?state=running&limit=1"))
            .bearer_auth(&op)
            .send()
            .await
            .unwrap();
        r.headers()
            .get("x-resource-count")
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let cpu_create = server.cpu_secs() - cpu0;
    let sw_create = server.switches_since(&sw0);
    match running {
        Some(d) => println!(
            "running: all {n} devices used {:.2} s after the first request = {:.0} VMs/s end to end ({vms_running} VMs running); server CPU {:.1} s = {:.2} ms per VM, {:.0} context switches per VM",
            d.as_secs_f64(),
            n as f64 / d.as_secs_f64(),
            cpu_create,
            cpu_create * 1000.0 / n.max(1) as f64,
            sw_create as f64 / n.max(1) as f64
        ),
        None => println!("running: not all {n} within {limit:?} ({vms_running} VMs running)"),
    }

    // Deletions: accepted, then every device clean and free again.
    let uuids = Arc::new(std::mem::take(&mut *created.lock().unwrap()));
    let cpu0 = server.cpu_secs();
    let sw0 = server.switches();
    let first = Instant::now();
    let (h, b, o, u) = (http.clone(), base.clone(), op.clone(), uuids.clone());
    let (lat, codes, wall, slow) = burst(a.clients, uuids.len(), move |i| {
        let (h, b, o, u) = (h.clone(), b.clone(), o.clone(), u.clone());
        async move {
            let r = h
                .delete(format!("{b}/v1/vms/{}", u[i]))
                .bearer_auth(&o)
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        }
    })
    .await;
    println!(
        "deletions: {} accepted in {:.2} s = {:.0}/s; latency p50 {} p99 {}; answers {codes:?}",
        codes.get(&202).copied().unwrap_or(0),
        wall.as_secs_f64(),
        uuids.len() as f64 / wall.as_secs_f64(),
        ms(pct(&lat, 0.5)),
        ms(pct(&lat, 0.99)),
    );
    println!("  the slowest 1 % by second sent: {slow:?}");
    let clean = until(&http, &base, &op, (first, every, limit), |c| {
        count(c, "unassigned") == total && count(c, "held") == 0
    })
    .await;
    let cpu_delete = server.cpu_secs() - cpu0;
    let sw_delete = server.switches_since(&sw0);
    match clean {
        Some(d) => println!(
            "clean: all {total} devices unassigned {:.2} s after the first deletion; server CPU {:.1} s = {:.2} ms per VM, {:.0} context switches per VM",
            d.as_secs_f64(),
            cpu_delete,
            cpu_delete * 1000.0 / uuids.len().max(1) as f64,
            sw_delete as f64 / uuids.len().max(1) as f64
        ),
        None => println!("clean: not within {limit:?}"),
    }
    let text = http
        .get(format!("{base}/metrics"))
        .bearer_auth(&op)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let metric = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0)
    };
    let (results, posts) = (
        metric("passage_agent_results_total"),
        metric("passage_agent_result_posts_total"),
    );
    println!(
        "task results: {results} in {posts} requests = {:.2} requests per VM for {:.2} results",
        posts as f64 / uuids.len().max(1) as f64,
        results as f64 / uuids.len().max(1) as f64,
    );
    println!(
        "server peak RSS: {} MiB; open files now {}",
        server.status_kib("VmHWM:") / 1024,
        server.open_files()
    );
    let _ = child.kill();
    let _ = child.wait();
    common::drop_database(&db).await;
}
