//! Images benchmark: a large image through the whole system, next to `cp` of the same
//! file on the same disk. A release `server` and a real `node-agent run --hypervisor qemu`
//! (TCG, over a generated tree with two stand-in GPUs) on loopback:
//!
//! 1. `cp` of the image file, then `sync FILE` (its fsync), in the work directory; then
//!    the upload's client alone: the same `curl -T` into a loopback sink that discards
//!    the body (the bound under any server's upload on this machine);
//! 2. the upload: `curl -T` streaming the file to `PUT /v1/images/{uuid}/file` until the
//!    answer (the image `active`: whole file written, fsynced, SHA-256 checked, renamed),
//!    with the server's RSS sampled every 20 ms;
//! 3. the agent's download: a VM from the image; its provision's `fetch_image` step makes
//!    the node fetch the file over the agent API (`GET /agent/v1/images/{sha256}`),
//!    hash it, fsync it and rename it into its cache, then make the VM's qcow2 overlay;
//! 4. a second VM from the same image on the same node: nothing fetched, the overlay only.
//!
//! The work directory (image directory, agent state, the 2 GiB files) is removed at the
//! end. Run by `cargo xtask bench images` (release build).
//!
//! Each round does all four with a new image, server and node; the goals are judged on
//! the medians of the rounds.
//!
//! Usage: bench_images --server-bin PATH --agent-bin PATH [--size-mib 2048]
//!        [--work-dir DIR] [--page-cache cold|warm] [--rounds 3]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use chrono::{DateTime, Utc};
use clap::Parser;
use common::guests::{Api, Cleanup, median};
use passage_model::api::{Job, JobState, JobStep, Vm, VmState};
use rand::{RngCore, SeedableRng};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MIB: f64 = 1024.0 * 1024.0;
/// Goals of issue 17.
const MIN_RATIO: f64 = 0.8;
const MAX_RSS_GROWTH_MIB: f64 = 32.0;
const MAX_DISK_READY_MS: f64 = 100.0;
/// What the second provision may move at most and still count as "nothing fetched":
/// API answers, heartbeats and database pages, six orders below the image.
const IDLE_IO_BYTES: u64 = 1 << 20;

#[derive(Parser)]
struct Args {
    /// The `server` binary to start.
    #[arg(long, value_name = "PATH")]
    server_bin: PathBuf,
    /// The `node-agent` binary to start.
    #[arg(long, value_name = "PATH")]
    agent_bin: PathBuf,
    /// Size of the image (random bytes, a `raw` image).
    #[arg(long, default_value_t = 2048)]
    size_mib: u64,
    /// Where the temporary work directory goes (the image directory, the agent's cache
    /// and the `cp` copy are all inside it, on one disk).
    #[arg(long, value_name = "DIR")]
    work_dir: Option<PathBuf>,
    /// `cold`: `sync` and drop the page cache before each measured transfer (needs
    /// root), so each reads its source from the disk; `warm`: `sync` only, the source
    /// stays in the page cache.
    #[arg(long, default_value = "cold", value_parser = ["cold", "warm"])]
    page_cache: String,
    /// How long the node and each provision may take.
    #[arg(long, default_value_t = 600)]
    limit_secs: u64,
    /// Whole runs, each with a new image, server and node; the goals are judged on the
    /// medians. One transfer of 2 GiB varies by a third from run to run here.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// What one round measured, for the medians.
struct Round {
    cp: Rate,
    client_alone: Rate,
    upload: Rate,
    download: Rate,
    rss_growth_mib: f64,
    disk2_ms: f64,
    nothing_fetched: bool,
}

/// `/proc/PID/…` of a process.
struct Proc(u32);

impl Proc {
    fn status_kib(&self, key: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.0)).unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// User + system CPU time so far, in seconds (USER_HZ: 100 on every Linux this runs on).
    fn cpu_secs(&self) -> f64 {
        let s = std::fs::read_to_string(format!("/proc/{}/stat", self.0)).unwrap_or_default();
        // The fields after the command name (which may hold spaces) in parentheses:
        // utime and stime are fields 14 and 15 of the whole line, 11 and 12 after it.
        let rest = s.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = rest.split_whitespace().collect();
        let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        (t(11) + t(12)) / 100.0
    }

    /// A field of `/proc/PID/io`: `rchar`/`wchar` count every byte through read/write
    /// calls, sockets included.
    fn io(&self, key: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/io", self.0)).unwrap_or_default();
        s.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// The largest VmRSS seen every 20 ms until stopped, in KiB.
struct RssSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: std::thread::JoinHandle<()>,
}

impl RssSampler {
    fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let (s, p) = (stop.clone(), peak.clone());
        let thread = std::thread::spawn(move || {
            let proc = Proc(pid);
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(proc.status_kib("VmRSS:"), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        RssSampler { stop, peak, thread }
    }

    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
        self.peak.load(Ordering::Relaxed)
    }
}

/// Before each measured transfer: what earlier phases left dirty goes to disk first, so
/// that no transfer pays for another's writeback; `cold` also empties the page cache.
fn settle(cold: bool) {
    Command::new("sync").status().unwrap();
    if cold {
        std::fs::write("/proc/sys/vm/drop_caches", "3\n")
            .expect("dropping the page cache (--page-cache cold needs root)");
    }
}

/// Times `curl -T src` (the upload's own flags, less the server) into a loopback sink
/// that reads the body in 1 MiB reads, discards it and answers 200: what the client
/// costs by itself, the bound under any server's upload on the same machine.
fn curl_into_sink(src: &Path, size: u64) -> Rate {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let sink = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut head = Vec::new();
        let body_start = loop {
            let n = conn.read(&mut buf).unwrap();
            assert!(n > 0, "the client closed before its headers ended");
            head.extend_from_slice(&buf[..n]);
            if let Some(i) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
        };
        let text = String::from_utf8_lossy(&head[..body_start]).to_ascii_lowercase();
        let want: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("the client sent no content-length");
        let mut got = (head.len() - body_start) as u64;
        while got < want {
            let n = conn.read(&mut buf).unwrap();
            assert!(n > 0, "the client closed after {got} of {want} bytes");
            got += n as u64;
        }
        conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            .unwrap();
        got
    });
    let t = Instant::now();
    let ok = Command::new("curl")
        .args([
            "-sS",
            "--fail",
            "-X",
            "PUT",
            "-H",
            "Expect:",
            "-o",
            "/dev/null",
        ])
        .arg("-T")
        .arg(src)
        .arg(format!("http://127.0.0.1:{port}/sink"))
        .status()
        .unwrap();
    let secs = t.elapsed().as_secs_f64();
    assert!(ok.success(), "curl into the sink failed");
    assert_eq!(sink.join().unwrap(), size, "the sink got another size");
    Rate::of(size, secs)
}

/// `size` random bytes (incompressible), fsynced. Not a valid boot sector and not qcow2,
/// so it passes as `raw` and QEMU's firmware only finds no bootable disk.
fn make_image(path: &Path, size: u64) {
    let mut f = std::fs::File::create(path).unwrap();
    let mut rng = rand::rngs::StdRng::from_entropy();
    let mut buf = vec![0u8; 4 << 20];
    let mut left = size;
    let mut first = true;
    while left > 0 {
        rng.fill_bytes(&mut buf);
        if first {
            buf[..4].copy_from_slice(b"RAW\0");
            buf[510] = 0;
            buf[511] = 0;
            first = false;
        }
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n]).unwrap();
        left -= n as u64;
    }
    f.sync_all().unwrap();
}

/// One figure of a transfer: seconds and MiB/s.
#[derive(Clone, Copy)]
struct Rate {
    secs: f64,
    mib_s: f64,
}

impl Rate {
    fn of(bytes: u64, secs: f64) -> Self {
        Rate {
            secs,
            mib_s: bytes as f64 / MIB / secs.max(1e-9),
        }
    }
}

fn step<'a>(job: &'a Job, name: &str) -> &'a JobStep {
    job.steps
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no step {name} in {job:?}"))
}

fn step_secs(s: &JobStep) -> f64 {
    let (Some(a), Some(b)) = (s.started_at, s.ended_at) else {
        panic!("step {} has no start or end: {s:?}", s.name);
    };
    secs_between(a, b)
}

fn secs_between(a: DateTime<Utc>, b: DateTime<Utc>) -> f64 {
    (b - a).num_microseconds().unwrap_or(0) as f64 / 1e6
}

/// `key=value` of a tracing line (plain text, no colours: not a terminal).
fn field(line: &str, key: &str) -> Option<String> {
    let at = line.find(&format!(" {key}="))?;
    let rest = &line[at + key.len() + 2..];
    Some(
        rest.split_whitespace()
            .next()?
            .trim_matches('"')
            .to_string(),
    )
}

impl Api {
    /// A VM from `image`; answers it running and its provision's job.
    async fn provision(&self, alias: &str, image: &str, limit: Duration) -> (Vm, Job) {
        let vm: Vm = serde_json::from_value(
            self.post(
                "/v1/vms",
                json!({"alias": alias, "image": image, "package": "bench-image"}),
            )
            .await,
        )
        .unwrap();
        let job_path = format!("/v1/jobs/{}", vm.job_uuid.expect("a provision job"));
        let job: Job = self
            .wait("the provision", limit, || async {
                let j: Job = self.get(&job_path).await;
                matches!(j.state, JobState::Succeeded | JobState::Failed).then_some(j)
            })
            .await;
        assert_eq!(
            job.state,
            JobState::Succeeded,
            "provision of {alias}: {job:?}"
        );
        let vm_path = format!("/v1/vms/{}", vm.uuid);
        let vm = self
            .wait("the VM running", limit, || async {
                let v: Vm = self.get(&vm_path).await;
                (v.state == VmState::Running).then_some(v)
            })
            .await;
        (vm, job)
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = Args::parse();
    let mut rounds = Vec::new();
    for n in 1..=a.rounds.max(1) {
        println!("==> round {n} of {}", a.rounds.max(1));
        rounds.push(round(&a).await);
        println!();
    }
    let verdict = |ok: bool| if ok { "PASS" } else { "FAIL" };
    let ratios = |f: fn(&Round) -> Rate| -> Vec<f64> {
        rounds.iter().map(|r| f(r).mib_s / r.cp.mib_s).collect()
    };
    let show = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let up = ratios(|r| r.upload);
    let alone = ratios(|r| r.client_alone);
    let down = ratios(|r| r.download);
    let cp = median(rounds.iter().map(|r| r.cp.mib_s).collect());
    let rss = median(rounds.iter().map(|r| r.rss_growth_mib).collect());
    let disk2 = median(rounds.iter().map(|r| r.disk2_ms).collect());
    let all_nothing = rounds.iter().all(|r| r.nothing_fetched);
    println!(
        "summary of {} rounds (each ratio to its own round's cp; cp median {cp:.0} MiB/s):",
        rounds.len()
    );
    println!(
        "  upload >= {MIN_RATIO} x cp: median {:.2} x (rounds: {})  {}",
        median(up.clone()),
        show(&up),
        verdict(median(up.clone()) >= MIN_RATIO)
    );
    println!(
        "  (the upload's client alone, curl into a sink that discards: median {:.2} x (rounds: {}))",
        median(alone.clone()),
        show(&alone)
    );
    println!(
        "  agent download (fetch_image step) >= {MIN_RATIO} x cp: median {:.2} x (rounds: {})  {}",
        median(down.clone()),
        show(&down),
        verdict(median(down.clone()) >= MIN_RATIO)
    );
    println!(
        "  server RSS growth during the upload <= {MAX_RSS_GROWTH_MIB} MiB: median {rss:.1} MiB  {}",
        verdict(rss <= MAX_RSS_GROWTH_MIB)
    );
    println!(
        "  second VM fetches 0 bytes, every round: {}",
        verdict(all_nothing)
    );
    println!(
        "  second VM's disk ready <= {MAX_DISK_READY_MS} ms: median {disk2:.0} ms  {}",
        verdict(disk2 <= MAX_DISK_READY_MS)
    );
}

/// One whole run: a new image, server and node in a new work directory.
async fn round(a: &Args) -> Round {
    let cold = a.page_cache == "cold";
    let limit = Duration::from_secs(a.limit_secs);
    let size = a.size_mib * 1024 * 1024;
    let root = a.work_dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&root).unwrap();
    let root = std::fs::canonicalize(&root).unwrap();
    let work = tempfile::Builder::new()
        .prefix("bench-images-")
        .tempdir_in(&root)
        .unwrap();
    let w = work.path();
    let (image_dir, sysfs) = (w.join("images"), w.join("sysfs"));
    // The agent's state (its image cache) is in the work directory, reached through a
    // short link: QEMU's QMP socket goes under it, and a unix socket's path has at most
    // 107 bytes.
    std::fs::create_dir(w.join("agent")).unwrap();
    let link = tempfile::Builder::new().prefix("pbi-").tempdir().unwrap();
    let state = link.path().join("s");
    std::os::unix::fs::symlink(w.join("agent"), &state).unwrap();
    let mut cleanup = Cleanup {
        children: Vec::new(),
        qemu_dirs: vec![state.join("qemu")],
    };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "images: {} MiB of random bytes as a raw image; work directory {} (page cache {}); load average {}",
        a.size_mib,
        w.display(),
        a.page_cache,
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );

    let src = w.join("image.raw");
    let t = Instant::now();
    make_image(&src, size);
    println!(
        "made {} in {:.1} s",
        src.display(),
        t.elapsed().as_secs_f64()
    );

    // What hashing costs per byte: the server and the agent both hash every byte.
    let sha_mib_s = {
        use sha2::Digest;
        let mut buf = vec![0u8; 64 << 20];
        rand::rngs::StdRng::from_entropy().fill_bytes(&mut buf);
        // CPU time, not wall time: other processes share the machine.
        let me = Proc(std::process::id());
        let cpu0 = me.cpu_secs();
        let mut h = sha2::Sha256::new();
        for _ in 0..16 {
            h.update(&buf);
        }
        std::hint::black_box(h.finalize());
        1024.0 / (me.cpu_secs() - cpu0).max(0.01)
    };

    // 1. cp, then the copy's fsync (what the server and the agent do with theirs).
    let copy = w.join("copy.raw");
    settle(cold);
    let t = Instant::now();
    let ok = Command::new("cp").arg(&src).arg(&copy).status().unwrap();
    assert!(ok.success(), "cp failed");
    let ok = Command::new("sync").arg(&copy).status().unwrap();
    assert!(ok.success(), "sync FILE failed");
    let cp = Rate::of(size, t.elapsed().as_secs_f64());
    std::fs::remove_file(&copy).unwrap();

    // The upload's client alone: the same curl into a sink that reads the body and
    // throws it away. No server can make the upload faster than this.
    settle(cold);
    let client_alone = curl_into_sink(&src, size);

    // The server, its catalog, the image record.
    let db = format!("sqlite://{}", w.join("bench.db").display());
    let mut cmd = Command::new(&a.server_bin);
    cmd.args(["--listen", "127.0.0.1:0", "--database", &db])
        .arg("--image-dir")
        .arg(&image_dir)
        .env("PASSAGE_ADMIN_PASSWORD", common::ADMIN_PASSWORD)
        .env("RUST_LOG", "error");
    let (child, base) = common::spawn_server(&mut cmd);
    let server = Proc(child.id());
    cleanup.children.push(child);
    let http = reqwest::Client::new();
    let token = common::catalog(&http, &base).await;
    let api = Api {
        http,
        base: base.clone(),
        token,
    };
    let disk_gib = a.size_mib.div_ceil(1024) + 1;
    api.post(
        "/v1/packages",
        json!({"name":"bench-image","vcpus":1,"memory_mib":256,"disk_gib":disk_gib,
               "devices":{"H100":1}}),
    )
    .await;
    let img = api
        .post(
            "/v1/images",
            json!({"name":"bench-big","version":"1","os":"linux","type":"raw","public":true}),
        )
        .await;
    let img_uuid = img["uuid"].as_str().unwrap().to_string();

    // 2. The upload, streamed by curl from the disk.
    let answer = w.join("upload-answer.json");
    settle(cold);
    let rss_before = server.status_kib("VmRSS:");
    let sampler = RssSampler::start(server.0);
    let cpu0 = server.cpu_secs();
    let t = Instant::now();
    let out = Command::new("curl")
        .args(["-sS", "--fail-with-body", "-X", "PUT", "-H", "Expect:"])
        .args(["-H", &format!("Authorization: Bearer {}", api.token)])
        .arg("-T")
        .arg(&src)
        .arg("-o")
        .arg(&answer)
        .arg(format!("{base}/v1/images/{img_uuid}/file"))
        .status()
        .unwrap();
    let upload = Rate::of(size, t.elapsed().as_secs_f64());
    let upload_cpu = server.cpu_secs() - cpu0;
    let rss_peak = sampler.finish().max(server.status_kib("VmRSS:"));
    let answered: Value =
        serde_json::from_slice(&std::fs::read(&answer).unwrap_or_default()).unwrap_or_default();
    assert!(out.success(), "the upload failed: {answered}");
    assert_eq!(answered["state"], "active", "{answered}");
    assert_eq!(answered["size"].as_u64(), Some(size), "{answered}");
    let sha = answered["sha256"].as_str().unwrap().to_string();
    let rss_growth = (rss_peak.saturating_sub(rss_before)) as f64 / 1024.0;

    // The node: a generated tree with two stand-in GPUs, the real agent running QEMU.
    let out = Command::new(&a.agent_bin)
        .args(["fake-sysfs", "--out"])
        .arg(&sysfs)
        .args(["--gpus", "2", "--model", "h100"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let jt = api.post("/v1/servers/join-tokens", json!({})).await;
    let mut agent = Command::new(&a.agent_bin)
        .args(["run", "--server", &base, "--join-token"])
        .arg(jt["token"].as_str().unwrap())
        .arg("--sysfs-root")
        .arg(&sysfs)
        .arg("--state-dir")
        .arg(&state)
        .args(["--hypervisor", "qemu", "--heartbeat-secs", "1"])
        .env("PASSAGE_QEMU_ACCEL", "tcg")
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let agent_proc = Proc(agent.id());
    let log: Arc<Mutex<Vec<String>>> = Arc::default();
    {
        let (log, stderr) = (log.clone(), agent.stderr.take().unwrap());
        std::thread::spawn(move || {
            for l in BufReader::new(stderr).lines().map_while(Result::ok) {
                log.lock().unwrap().push(l);
            }
        });
    }
    cleanup.children.push(agent);
    api.wait("the node with two GPUs", limit, || async {
        let list: Vec<passage_model::api::Server> = api.get("/v1/servers").await;
        (list.first()?.assignable_devices.as_ref()?.len() == 2).then_some(())
    })
    .await;
    let log_lines = |msg: &str| -> Vec<String> {
        log.lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(msg))
            .cloned()
            .collect()
    };
    let disk_ms = |vm: &Vm| -> f64 {
        log_lines("boot disk created")
            .iter()
            .find(|l| field(l, "vm").as_deref() == Some(&vm.uuid.to_string()))
            .and_then(|l| field(l, "elapsed_ms")?.parse().ok())
            .unwrap_or(f64::NAN)
    };

    // 3. The first VM: the node downloads the image.
    settle(cold);
    let rss_before_dl = server.status_kib("VmRSS:");
    let sampler = RssSampler::start(server.0);
    let (cpu_s0, cpu_a0) = (server.cpu_secs(), agent_proc.cpu_secs());
    let (vm1, job1) = api.provision("image-1", &img_uuid, limit).await;
    let (dl_cpu_server, dl_cpu_agent) =
        (server.cpu_secs() - cpu_s0, agent_proc.cpu_secs() - cpu_a0);
    let rss_growth_dl = sampler.finish().saturating_sub(rss_before_dl) as f64 / 1024.0;
    let fetch1 = step(&job1, "fetch_image");
    let step1 = Rate::of(size, step_secs(fetch1));
    let progress1 = fetch1.progress.map(|p| (p.done, p.total));
    let downloaded = log_lines("image downloaded and verified");
    assert_eq!(downloaded.len(), 1, "one download: {downloaded:?}");
    let agent_ms: f64 = field(&downloaded[0], "elapsed_ms")
        .and_then(|v| v.parse().ok())
        .expect("elapsed_ms in the agent's log");
    let agent_dl = Rate::of(size, agent_ms / 1000.0);
    let cached = state.join("images").join(&sha);
    assert_eq!(std::fs::metadata(&cached).unwrap().len(), size);
    let disk1_ms = disk_ms(&vm1);

    // 4. The second VM on the same node, from the same image.
    let nothing_before = log_lines("nothing fetched").len();
    let (wchar0, rchar0) = (server.io("wchar"), agent_proc.io("rchar"));
    let (vm2, job2) = api.provision("image-2", &img_uuid, limit).await;
    let (server_wrote, agent_read) = (server.io("wchar") - wchar0, agent_proc.io("rchar") - rchar0);
    assert_eq!(vm1.server_uuid, vm2.server_uuid, "both VMs on the one node");
    let fetch2 = step(&job2, "fetch_image");
    let fetch2_ms = step_secs(fetch2) * 1000.0;
    let disk2_ms = disk_ms(&vm2);
    let downloads = log_lines("image downloaded and verified").len();
    let cache_hit = log_lines("nothing fetched").len() > nothing_before;
    let nothing_fetched =
        downloads == 1 && cache_hit && server_wrote < IDLE_IO_BYTES && agent_read < IDLE_IO_BYTES;

    // Both VMs go; their disks with them.
    for vm in [&vm1, &vm2] {
        let path = format!("/v1/vms/{}", vm.uuid);
        let r = api
            .http
            .delete(format!("{base}{path}"))
            .bearer_auth(&api.token)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 202, "destroying {path}");
    }
    for vm in [&vm1, &vm2] {
        let path = format!("/v1/vms/{}", vm.uuid);
        api.wait("the VM destroyed", limit, || async {
            let v: Vm = api.get(&path).await;
            (v.state == VmState::Destroyed).then_some(())
        })
        .await;
    }

    let verdict = |ok: bool| if ok { "PASS" } else { "FAIL" };
    let ratio = |r: Rate| r.mib_s / cp.mib_s;
    println!();
    println!(
        "{:<58} {:>9} {:>9} {:>7}",
        "transfer of the image", "seconds", "MiB/s", "x cp"
    );
    let row = |name: &str, r: Rate| {
        println!(
            "{name:<58} {:>9.2} {:>9.0} {:>7.2}",
            r.secs,
            r.mib_s,
            ratio(r)
        );
    };
    row("cp + sync FILE", cp);
    row(
        "the client alone: curl -T into a sink that discards",
        client_alone,
    );
    row(
        "upload: curl -T to PUT /v1/images/{uuid}/file, to active",
        upload,
    );
    row("download: the job's fetch_image step (first VM)", step1);
    row(
        "download: the agent's own (fetch, SHA-256, fsync, rename)",
        agent_dl,
    );
    println!();
    println!(
        "server RSS during the upload: {:.1} MiB before, {:.1} MiB peak, growth {:.1} MiB (VmHWM now {:.1} MiB); during the first VM's download: growth {:.1} MiB",
        rss_before as f64 / 1024.0,
        rss_peak as f64 / 1024.0,
        rss_growth,
        server.status_kib("VmHWM:") as f64 / 1024.0,
        rss_growth_dl
    );
    println!(
        "CPU time: the server {upload_cpu:.2} s during the upload; during the first VM's provision the server {dl_cpu_server:.2} s and the agent {dl_cpu_agent:.2} s ({} CPUs, load average at the start {})",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "SHA-256 (the sha2 crate in this build, 1 GiB in memory): {sha_mib_s:.0} MiB per CPU second"
    );
    println!("first VM: fetch_image progress {progress1:?}; its overlay made in {disk1_ms:.0} ms");
    println!(
        "second VM: fetch_image step {fetch2_ms:.0} ms; overlay made in {disk2_ms:.0} ms; agent logged a cache hit: {cache_hit}; downloads logged in all: {downloads}; during its provision the server wrote {:.1} KiB and the agent read {:.1} KiB (all files and sockets)",
        server_wrote as f64 / 1024.0,
        agent_read as f64 / 1024.0
    );
    println!();
    println!("goals (issue 17), this round:");
    println!(
        "  upload >= {MIN_RATIO} x cp: {:.2} x  {} (curl alone into a sink: {:.2} x)",
        ratio(upload),
        verdict(ratio(upload) >= MIN_RATIO),
        ratio(client_alone)
    );
    println!(
        "  server RSS growth during the upload <= {MAX_RSS_GROWTH_MIB} MiB: {rss_growth:.1} MiB  {}",
        verdict(rss_growth <= MAX_RSS_GROWTH_MIB)
    );
    println!(
        "  agent download (fetch_image step) >= {MIN_RATIO} x cp: {:.2} x  {}",
        ratio(step1),
        verdict(ratio(step1) >= MIN_RATIO)
    );
    println!("  second VM fetches 0 bytes: {}", verdict(nothing_fetched));
    println!(
        "  second VM's disk ready <= {MAX_DISK_READY_MS} ms: overlay {disk2_ms:.0} ms  {}",
        verdict(disk2_ms <= MAX_DISK_READY_MS)
    );
    println!(
        "load average now: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    drop(cleanup);
    drop(link);
    drop(work);
    Round {
        cp,
        client_alone,
        upload,
        download: step1,
        rss_growth_mib: rss_growth,
        disk2_ms,
        nothing_fetched,
    }
}
