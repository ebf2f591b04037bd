//! Launch benchmark: the time from `POST /v1/vms` to QEMU answering QMP for a VM of eight
//! H100 stand-ins, with ordinary RAM and with RAM from 2 MiB huge pages, side by side.
//!
//! A release `server` and two real `node-agent run --hypervisor qemu` nodes (TCG, over
//! generated trees of 8 H100s each, `PASSAGE_QEMU_STAND_IN=sized`: each GPU an
//! `ivshmem-plain` with its real 128 GiB BAR, on two guest NUMA nodes): one with
//! `hugepages = "off"`, one with `hugepages = "require"`. Each round creates one VM on each
//! (the other node drained meanwhile) and reads, from the VM's provision job, when the
//! `launch` step ended, which is when the agent's start saw QEMU answer QMP; then destroys
//! it and waits for its GPUs to be free again.
//!
//! The huge pages are reserved on this machine for the bench (`/proc/sys/vm/nr_hugepages`,
//! root) and given back at the end; the huge-page VM gets as much as the machine can
//! reserve, at most `--memory-gib`. Ordinary RAM larger than the machine's needs the
//! kernel to allow overcommit (`vm.overcommit_memory = 1`, also set and restored here):
//! QEMU maps all of it, the guest touches little of it.
//!
//! Usage: bench_launch --server-bin PATH --agent-bin PATH [--memory-gib 64]
//!        [--hugepages-gib N] [--rounds 3]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use clap::Parser;
use common::guests::{Api, Cleanup, median};
use passage_model::api::{Job, JobState, Server, Vm, VmState};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    #[arg(long, value_name = "PATH")]
    server_bin: PathBuf,
    #[arg(long, value_name = "PATH")]
    agent_bin: PathBuf,
    /// Guest RAM of the ordinary-pages VM, and the most the huge-page VM gets.
    #[arg(long, default_value_t = 64)]
    memory_gib: u64,
    /// Guest RAM of the huge-page VM [default: what this machine can reserve of 2 MiB
    /// pages, keeping 8 GiB for itself, at most --memory-gib].
    #[arg(long)]
    hugepages_gib: Option<u64>,
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

const GPUS: usize = 8;
const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";
const OVERCOMMIT: &str = "/proc/sys/vm/overcommit_memory";

/// A kernel setting put back as it was when the bench ends, however it ends.
struct Restore(&'static str, String);

impl Drop for Restore {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(self.0, &self.1) {
            eprintln!("could not restore {}: {e}", self.0);
        }
    }
}

fn set(path: &'static str, value: &str) -> Restore {
    let before = std::fs::read_to_string(path).unwrap_or_default();
    std::fs::write(path, value).unwrap_or_else(|e| panic!("{path}: {e} (the bench needs root)"));
    Restore(path, before)
}

/// A `/proc/meminfo` figure (kiB or a count); 0 when absent.
fn meminfo(key: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(0)
}

fn mem_available_gib() -> u64 {
    meminfo("MemAvailable:") >> 20
}

/// A node: a generated tree of 8 H100s and the real agent with `hugepages`.
fn node(
    a: &Args,
    w: &Path,
    name: &str,
    base: &str,
    token: &str,
    hugepages: &str,
    pages: u64,
) -> std::process::Child {
    let sysfs = w.join(format!("{name}-sys"));
    let out = Command::new(&a.agent_bin)
        .args(["fake-sysfs", "--out"])
        .arg(&sysfs)
        .args(["--gpus", &GPUS.to_string(), "--model", "h100"])
        .args(["--hugepages-2m", &pages.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config = w.join(format!("{name}.toml"));
    std::fs::write(&config, format!("hugepages = \"{hugepages}\"\n")).unwrap();
    Command::new(&a.agent_bin)
        .args([
            "run",
            "--server",
            base,
            "--join-token",
            token,
            "--hostname",
            name,
        ])
        .arg("--sysfs-root")
        .arg(&sysfs)
        .arg("--state-dir")
        .arg(w.join(format!("{name}-state")))
        .arg("--config")
        .arg(&config)
        .args(["--hypervisor", "qemu", "--heartbeat-secs", "1"])
        .env("PASSAGE_QEMU_ACCEL", "tcg")
        .env("PASSAGE_QEMU_STAND_IN", "sized")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// One VM of `package` on `server` (the other drained): seconds from the POST to the end
/// of its `launch` step, and to the VM `running` as the API shows it.
async fn launch(
    api: &Api,
    servers: &[(String, Server)],
    on: usize,
    package: &str,
    limit: Duration,
) -> (f64, f64) {
    for (i, (_, s)) in servers.iter().enumerate() {
        let r = api
            .http
            .patch(format!("{}/v1/servers/{}", api.base, s.uuid))
            .bearer_auth(&api.token)
            .json(&json!({"disabled": i != on}))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "draining: {}", r.status());
    }
    let t0 = chrono::Utc::now();
    let started = Instant::now();
    let vm: Vm = serde_json::from_value(
        api.post(
            "/v1/vms",
            json!({"alias": format!("launch-{package}"), "image": "bench", "package": package}),
        )
        .await,
    )
    .unwrap();
    let vm_path = format!("/v1/vms/{}", vm.uuid);
    let running = api
        .wait("the VM running", limit, || async {
            let v: Vm = api.get(&vm_path).await;
            assert_ne!(v.state, VmState::Failed, "{v:?}");
            (v.state == VmState::Running).then_some(started.elapsed().as_secs_f64())
        })
        .await;
    let job_path = format!("/v1/jobs/{}", vm.job_uuid.unwrap());
    let job: Job = api
        .wait("the provision", limit, || async {
            let j: Job = api.get(&job_path).await;
            matches!(j.state, JobState::Succeeded | JobState::Failed).then_some(j)
        })
        .await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let boot = job
        .steps
        .iter()
        .find(|s| s.name == "launch")
        .and_then(|s| s.ended_at)
        .map_or(f64::NAN, |e| (e - t0).num_milliseconds() as f64 / 1000.0);
    api.delete(&vm_path).await;
    let server = servers[on].1.uuid;
    api.wait("the GPUs free again", limit, || async {
        let v: Vm = api.get(&vm_path).await;
        let s: Server = api.get(&format!("/v1/servers/{server}")).await;
        let free = s
            .assignable_devices?
            .iter()
            .filter(|d| d.state == passage_model::DeviceState::Unassigned)
            .count();
        (v.state == VmState::Destroyed && free == GPUS).then_some(())
    })
    .await;
    (boot, running)
}

#[tokio::main]
async fn main() {
    let a = Args::parse();
    let limit = Duration::from_secs(600);
    let huge_gib = a
        .hugepages_gib
        .unwrap_or_else(|| mem_available_gib().saturating_sub(8).min(a.memory_gib))
        .min(a.memory_gib);
    assert!(
        huge_gib >= 1,
        "this machine cannot reserve a GiB of huge pages"
    );
    let pages = huge_gib * 512;
    let _overcommit = set(OVERCOMMIT, "1");
    // On top of those other guests of this machine hold now.
    let in_use = meminfo("HugePages_Total:") - meminfo("HugePages_Free:");
    let _pages = set(NR_HUGEPAGES, &(in_use + pages).to_string());
    let free = meminfo("HugePages_Free:");
    assert!(
        free >= pages,
        "the kernel reserved {free} of {pages} 2 MiB pages"
    );

    // Short: QMP sockets go under the agents' state directories.
    let work = tempfile::Builder::new()
        .prefix("pbl-")
        .tempdir_in("/tmp")
        .unwrap();
    let w = work.path();
    let db = format!("sqlite://{}", w.join("bench.db").display());
    let mut cmd = Command::new(&a.server_bin);
    cmd.args(["--listen", "127.0.0.1:0", "--database", &db])
        .arg("--image-dir")
        .arg(w.join("images"))
        .env("PASSAGE_ADMIN_PASSWORD", common::ADMIN_PASSWORD)
        .env("RUST_LOG", "error");
    let (child, base) = common::spawn_server(&mut cmd);
    let mut cleanup = Cleanup {
        children: vec![child],
        qemu_dirs: vec![w.join("plain-state/qemu"), w.join("huge-state/qemu")],
    };
    let http = reqwest::Client::new();
    let token = common::catalog(&http, &base).await;
    let api = Api {
        http,
        base: base.clone(),
        token,
    };
    for (name, gib) in [("launch-plain", a.memory_gib), ("launch-huge", huge_gib)] {
        api.post(
            "/v1/packages",
            json!({"name": name, "vcpus": 2, "memory_mib": gib * 1024, "disk_gib": 1, "devices": {"H100": GPUS}}),
        )
        .await;
    }
    let mut servers: Vec<(String, Server)> = Vec::new();
    for (name, policy, fake_pages) in [("plain", "off", 0), ("huge", "require", pages)] {
        let jt = api.post("/v1/servers/join-tokens", json!({})).await;
        let token = jt["token"].as_str().unwrap().to_string();
        cleanup
            .children
            .push(node(&a, w, name, &base, &token, policy, fake_pages));
        let s = api
            .wait("the node with its GPUs", limit, || async {
                let list: Vec<Server> = api.get("/v1/servers").await;
                list.into_iter().find(|s| {
                    s.hostname == name
                        && s.assignable_devices
                            .as_ref()
                            .is_some_and(|d| d.len() == GPUS)
                })
            })
            .await;
        servers.push((name.to_string(), s));
    }

    println!(
        "launch: {GPUS} H100 stand-ins (128 GiB BAR each, two guest NUMA nodes), 2 vCPUs, TCG, {} CPUs; \
         ordinary RAM {} GiB, 2 MiB huge pages {} GiB",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        a.memory_gib,
        huge_gib
    );
    println!(
        "{:<8} {:>28} {:>28}",
        "round", "ordinary: launch / running s", "huge pages: launch / running s"
    );
    let (mut plain, mut huge) = (Vec::new(), Vec::new());
    for r in 1..=a.rounds {
        let p = launch(&api, &servers, 0, "launch-plain", limit).await;
        let h = launch(&api, &servers, 1, "launch-huge", limit).await;
        println!(
            "{r:<8} {:>19.2} / {:>6.2} {:>19.2} / {:>6.2}",
            p.0, p.1, h.0, h.1
        );
        plain.push(p);
        huge.push(h);
    }
    let med = |v: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| median(v.iter().map(f).collect());
    println!(
        "{:<8} {:>19.2} / {:>6.2} {:>19.2} / {:>6.2}",
        "median",
        med(&plain, |x| x.0),
        med(&plain, |x| x.1),
        med(&huge, |x| x.0),
        med(&huge, |x| x.1)
    );
    drop(cleanup);
}
