//! `cargo xtask bench discovery`: how long PCI discovery takes on a ~300-function tree,
//! next to pciutils' `lspci` on the same tree.
//!
//! Three figures, each min / median / p95 over warm runs (the tree is in the page cache):
//! - discovery in-process (`node-agent bench-discovery`), cold (every pass from nothing,
//!   as `node-agent lspci` does) and warm (one `Discoverer` reused, as the agent does on
//!   every inventory pass: only what can change is read again);
//! - `node-agent lspci` as a process: the same walk plus process start and printing;
//! - `lspci -n` as a process over the same tree, for scale.

use crate::util::{self, cargo, on_path, repo_root, target_dir};
use anyhow::{Context, Result, bail};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// 72 GPUs with their audio functions over 8 NUMA nodes: 311 functions.
const GPUS: &str = "72";
const NUMA_NODES: &str = "8";
const IN_PROCESS_RUNS: &str = "500";
const PROCESS_RUNS: usize = 50;

/// `cargo xtask bench discovery|placement|fleet|portal|images|ssh`.
#[derive(clap::Subcommand)]
pub enum Bench {
    /// PCI discovery on a ~300-function fake tree, next to `lspci`
    ///
    /// Times node-agent's PCI discovery (in-process cold and warm, and as a process) on a
    /// ~300-function fake tree, next to `lspci` on the same tree. Builds node-agent
    /// --release.
    Discovery,
    /// VM creations per second through the API, then multi-GPU placement decisions
    ///
    /// VM creations through the HTTP API of a release `server` onto simulated nodes, then
    /// 4- and 8-GPU placement decisions in-process (server/examples/bench_placement.rs).
    Placement(Placement),
    /// The whole pipeline on a simulated fleet: creations to running, deletions to clean
    ///
    /// A release `server --sim-servers N` (real agent loops over fake trees, `sim`
    /// hypervisor, in the server's process); creations from concurrent clients until every
    /// VM runs, then deletions until every device is scrubbed and free; the idle fleet's
    /// CPU, memory and open files (server/examples/bench_fleet.rs).
    Fleet(Fleet),
    /// The portal's servers, devices and VMs list pages over a seeded fleet
    ///
    /// Fetches the list pages of a release `server` as a signed-in operator from
    /// concurrent clients: p50/p95/p99 and page size (server/examples/bench_portal.rs).
    Portal(Portal),
    /// A 2 GiB image uploaded and downloaded by a node, next to `cp` on the same disk
    ///
    /// A release `server` and a real `node-agent run --hypervisor qemu` (TCG, generated
    /// tree): `cp` + fsync of the image file, its upload (`curl -T`) with the server's RSS,
    /// the node's download for a first VM, and a second VM from the cached image
    /// (server/examples/bench_images.rs). Drops the page cache before each transfer
    /// (root) unless `--page-cache warm`.
    Images(Images),
    /// Create → ssh answers through Passage, next to the same guest started by hand
    ///
    /// A release `server` and a real `node-agent run --hypervisor qemu` (TCG, generated
    /// tree) in a network namespace of their own: each round, a VM created through the
    /// API until `ssh` answers, and the same guest (its spec, a fresh overlay on the same
    /// cached image, the seed, a tap on the same bridge) started by hand with
    /// `qemu-system-x86_64` until `ssh` answers; goal: Passage adds <= 1.0 s
    /// (server/examples/bench_ssh.rs). Needs root; builds the guest test image if
    /// missing.
    Ssh(Ssh),
    /// `POST /v1/vms` to QEMU answering QMP for an 8-GPU VM, ordinary RAM and huge pages
    ///
    /// A release `server` and two real `node-agent run --hypervisor qemu` nodes (TCG,
    /// generated trees of 8 H100s, stand-ins with the real 128 GiB BARs), one with
    /// `hugepages = "off"`, one with `"require"`; rounds of one VM on each, from the POST
    /// to the end of the `launch` step and to `running` (server/examples/bench_launch.rs).
    /// Needs root: it reserves 2 MiB huge pages and allows overcommit, and puts both back.
    Launch(Launch),
}

/// `cargo xtask bench launch`: flags given are passed on to the example, which holds the
/// defaults.
#[derive(clap::Args)]
pub struct Launch {
    /// Guest RAM in GiB of the ordinary-pages VM, and the most the huge-page VM gets
    /// [default: 64]
    #[arg(long, value_name = "GIB")]
    memory_gib: Option<usize>,
    /// Guest RAM in GiB of the huge-page VM [default: what the machine can reserve,
    /// keeping 8 GiB]
    #[arg(long, value_name = "GIB")]
    hugepages_gib: Option<usize>,
    /// Rounds, each one VM of each kind [default: 3]
    #[arg(long, value_name = "N")]
    rounds: Option<usize>,
}

/// `cargo xtask bench ssh`: flags given are passed on to the example, which holds the
/// defaults.
#[derive(clap::Args)]
pub struct Ssh {
    /// Rounds, each one boot through Passage and one by hand [default: 3]
    #[arg(long, value_name = "N")]
    rounds: Option<usize>,
    /// The guest image (qcow2 with cloud-init) [default: the test image, built if
    /// missing, as `cargo xtask test-image`]
    #[arg(long, value_name = "PATH")]
    image: Option<PathBuf>,
    /// Where the temporary work directory goes [default: <target>/bench-ssh]
    #[arg(long, value_name = "DIR")]
    work_dir: Option<PathBuf>,
}

/// `cargo xtask bench images`: flags given are passed on to the example, which holds the
/// defaults.
#[derive(clap::Args)]
pub struct Images {
    /// Size of the image in MiB [default: 2048]
    #[arg(long, value_name = "MIB")]
    size_mib: Option<usize>,
    /// cold: drop the page cache before each transfer (root); warm: keep it [default: cold]
    #[arg(long, value_name = "C", value_parser = ["cold", "warm"])]
    page_cache: Option<String>,
    /// Where the temporary work directory goes [default: <target>/bench-images]
    #[arg(long, value_name = "DIR")]
    work_dir: Option<PathBuf>,
    /// Whole runs; the goals are judged on the medians [default: 3]
    #[arg(long, value_name = "N")]
    rounds: Option<usize>,
}

/// `cargo xtask bench placement`: flags given are passed on to the example, which holds
/// the defaults.
#[derive(clap::Args)]
pub struct Placement {
    /// Database of the server [default: sqlite]
    #[arg(long, value_name = "B", value_enum)]
    backend: Option<Backend>,
    /// Simulated compute nodes [default: 1250]
    #[arg(long, value_name = "N")]
    servers: Option<usize>,
    /// GPUs per node [default: 8]
    #[arg(long, value_name = "G")]
    gpus: Option<usize>,
    /// VMs to create [default: 10000]
    #[arg(long, value_name = "N")]
    vms: Option<usize>,
    /// Concurrent API clients [default: 64]
    #[arg(long, value_name = "C")]
    clients: Option<usize>,
    /// Each VM asks for one vGPU of a type every GPU hosts N times (not set: a whole GPU)
    #[arg(long, value_name = "N")]
    vgpu_slots: Option<usize>,
    /// Each VM also gets an address on a default /16 network on bridge br0, which every
    /// node reports
    #[arg(long)]
    network: bool,
}

/// `cargo xtask bench fleet`: flags given are passed on to the example, which holds the
/// defaults.
#[derive(clap::Args)]
pub struct Fleet {
    /// Database of the server [default: sqlite]
    #[arg(long, value_name = "B", value_enum)]
    backend: Option<Backend>,
    /// Simulated compute nodes [default: 1250]
    #[arg(long, value_name = "N")]
    servers: Option<usize>,
    /// GPUs per node [default: 8]
    #[arg(long, value_name = "G")]
    gpus: Option<usize>,
    /// VMs to create and delete [default: 10000]
    #[arg(long, value_name = "N")]
    vms: Option<usize>,
    /// vCPUs per VM [default: 1]
    #[arg(long, value_name = "N")]
    vcpus: Option<usize>,
    /// Memory per VM, MiB [default: 1024; 65536 leaves each node's eighth GPU without
    /// room for its VM]
    #[arg(long, value_name = "MIB")]
    memory_mib: Option<usize>,
    /// Concurrent API clients [default: 64]
    #[arg(long, value_name = "C")]
    clients: Option<usize>,
    /// Seconds the idle fleet is watched [default: 10]
    #[arg(long, value_name = "S")]
    idle_secs: Option<usize>,
    /// How often the capacity is read to see a phase finish, ms [default: 200]
    #[arg(long, value_name = "MS")]
    poll_ms: Option<usize>,
}

/// `cargo xtask bench portal`: flags given are passed on to the example, which holds the
/// defaults.
#[derive(clap::Args)]
pub struct Portal {
    /// Database of the server [default: sqlite]
    #[arg(long, value_name = "B", value_enum)]
    backend: Option<Backend>,
    /// Simulated compute nodes [default: 2000]
    #[arg(long, value_name = "N")]
    servers: Option<usize>,
    /// GPUs per node [default: 8]
    #[arg(long, value_name = "G")]
    gpus: Option<usize>,
    /// VMs to seed [default: 5000]
    #[arg(long, value_name = "N")]
    vms: Option<usize>,
    /// Concurrent clients [default: 16]
    #[arg(long, value_name = "C")]
    clients: Option<usize>,
    /// Requests per page, spread over the clients [default: 400]
    #[arg(long, value_name = "R")]
    requests: Option<usize>,
    /// Keep the SQLite database in this directory (to study its query plans afterwards)
    #[arg(long, value_name = "DIR")]
    keep: Option<PathBuf>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }
}

/// The flags given, as the examples take them.
#[derive(Default)]
struct Flags(Vec<OsString>);

impl Flags {
    fn add(&mut self, flag: &str, value: Option<impl Into<OsString>>) -> &mut Self {
        if let Some(v) = value {
            self.0.push(flag.into());
            self.0.push(v.into());
        }
        self
    }

    fn number(&mut self, flag: &str, value: Option<usize>) -> &mut Self {
        self.add(flag, value.map(|n| n.to_string()))
    }
}

pub fn run(bench: &Bench) -> Result<()> {
    match bench {
        Bench::Discovery => discovery(),
        Bench::Placement(p) => {
            let mut f = Flags::default();
            f.add("--backend", p.backend.map(Backend::name))
                .number("--servers", p.servers)
                .number("--gpus", p.gpus)
                .number("--vms", p.vms)
                .number("--clients", p.clients)
                .number("--vgpu-slots", p.vgpu_slots);
            if p.network {
                f.0.push("--network".into());
            }
            example("bench_placement", &f.0)
        }
        Bench::Fleet(p) => {
            let mut f = Flags::default();
            f.add("--backend", p.backend.map(Backend::name))
                .number("--servers", p.servers)
                .number("--gpus", p.gpus)
                .number("--vms", p.vms)
                .number("--vcpus", p.vcpus)
                .number("--memory-mib", p.memory_mib)
                .number("--clients", p.clients)
                .number("--idle-secs", p.idle_secs)
                .number("--poll-ms", p.poll_ms);
            example("bench_fleet", &f.0)
        }
        Bench::Portal(p) => {
            let mut f = Flags::default();
            f.add("--backend", p.backend.map(Backend::name))
                .number("--servers", p.servers)
                .number("--gpus", p.gpus)
                .number("--vms", p.vms)
                .number("--clients", p.clients)
                .number("--requests", p.requests)
                .add("--keep", p.keep.clone());
            example("bench_portal", &f.0)
        }
        Bench::Images(p) => images(p),
        Bench::Ssh(p) => ssh(p),
        Bench::Launch(p) => {
            crate::test::ensure_tool("qemu-system-x86_64", "qemu-system-x86")?;
            crate::test::ensure_tool("qemu-img", "qemu-utils")?;
            let mut f = Flags::default();
            f.number("--memory-gib", p.memory_gib)
                .number("--hugepages-gib", p.hugepages_gib)
                .number("--rounds", p.rounds);
            example_with_agent("bench_launch", &f.0)
        }
    }
}

/// `bench_ssh` needs the agent binary beside the server, QEMU, `qemu-img`, `ssh` and the
/// guest image.
fn ssh(p: &Ssh) -> Result<()> {
    crate::test::ensure_tool("qemu-system-x86_64", "qemu-system-x86")?;
    crate::test::ensure_tool("qemu-img", "qemu-utils")?;
    crate::test::ensure_tool("ssh", "openssh-client")?;
    crate::test::ensure_tool("ssh-keygen", "openssh-client")?;
    let image = match &p.image {
        Some(i) => i.clone(),
        None => crate::test_image::ensure()?,
    };
    // Not the system's temp dir: that may be a tmpfs, which no real node's disks are.
    let work = match &p.work_dir {
        Some(d) => d.clone(),
        None => target_dir()?.join("bench-ssh"),
    };
    let mut f = Flags::default();
    f.add("--image", Some(image))
        .add("--work-dir", Some(work))
        .number("--rounds", p.rounds);
    example_with_agent("bench_ssh", &f.0)
}

/// Builds `server`, `node-agent` and the example `name` in release mode, and runs the
/// example with both binaries and `args`.
fn example_with_agent(name: &str, args: &[OsString]) -> Result<()> {
    println!("==> building server, node-agent and {name} (release)");
    util::run_checked(cargo().args([
        "build",
        "--release",
        "-p",
        "passage-server",
        "-p",
        "node-agent",
        "--bin",
        "server",
        "--bin",
        "node-agent",
        "--example",
        name,
    ]))?;
    let release = target_dir()?.join("release");
    let mut cmd = Command::new(release.join("examples").join(name));
    cmd.arg("--server-bin")
        .arg(release.join("server"))
        .arg("--agent-bin")
        .arg(release.join("node-agent"))
        .args(args);
    util::run_checked(&mut cmd)
}

/// `bench_images` needs the agent binary beside the server, and QEMU, `qemu-img` and
/// curl on the machine.
fn images(p: &Images) -> Result<()> {
    crate::test::ensure_tool("qemu-system-x86_64", "qemu-system-x86")?;
    crate::test::ensure_tool("qemu-img", "qemu-utils")?;
    crate::test::ensure_tool("curl", "curl")?;
    // Not the system's temp dir: that may be a tmpfs, where `cp` and fsync cost nothing.
    let work = match &p.work_dir {
        Some(d) => d.clone(),
        None => target_dir()?.join("bench-images"),
    };
    let mut f = Flags::default();
    f.number("--size-mib", p.size_mib)
        .add("--page-cache", p.page_cache.clone())
        .add("--work-dir", Some(work))
        .number("--rounds", p.rounds);
    example_with_agent("bench_images", &f.0)
}

/// Runs one of the server's benchmark examples (`server/examples/<name>.rs`) against a
/// release `server`.
fn example(name: &str, args: &[OsString]) -> Result<()> {
    println!("==> building server and {name} (release)");
    util::run_checked(cargo().args([
        "build",
        "--release",
        "-p",
        "passage-server",
        "--bin",
        "server",
        "--example",
        name,
    ]))?;
    let release = target_dir()?.join("release");
    let mut cmd = Command::new(release.join("examples").join(name));
    cmd.arg("--server-bin")
        .arg(release.join("server"))
        .args(args);
    util::run_checked(&mut cmd)
}

fn discovery() -> Result<()> {
    println!("==> building node-agent (release)");
    util::run_checked(cargo().args(["build", "--release", "-p", "node-agent"]))?;
    let agent = target_dir()?.join("release/node-agent");
    let work = target_dir()?.join("bench-discovery");
    let sys = work.join("sys");
    if work.exists() {
        std::fs::remove_dir_all(&work)
            .with_context(|| format!("removing the old tree {}", work.display()))?;
    }
    util::run_checked(Command::new(&agent).args([
        "fake-sysfs",
        "--out",
        &sys.display().to_string(),
        "--gpus",
        GPUS,
        "--numa-nodes",
        NUMA_NODES,
        "--gpu-audio",
    ]))?;

    let out = Command::new(&agent)
        .args(["bench-discovery", "--sysfs-root"])
        .arg(&sys)
        .args(["--iterations", IN_PROCESS_RUNS])
        .output()
        .context("running node-agent bench-discovery")?;
    if !out.status.success() {
        bail!(
            "node-agent bench-discovery failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let field = |k: &str| -> Result<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(k)?.trim().parse().ok())
            .with_context(|| format!("no {k} in bench-discovery output: {text}"))
    };
    let functions = field("functions")?;
    let figures = |kind: &str| -> Result<(f64, f64, f64)> {
        Ok((
            field(&format!("{kind}_min_us"))? / 1000.0,
            field(&format!("{kind}_median_us"))? / 1000.0,
            field(&format!("{kind}_p95_us"))? / 1000.0,
        ))
    };
    let cold = figures("cold")?;
    let warm = figures("warm")?;

    let agent_lspci = time_process(
        Command::new(&agent)
            .arg("lspci")
            .arg("--sysfs-root")
            .arg(&sys),
    )?;
    let pciutils = if on_path("lspci") {
        let sysfs_path = format!("sysfs.path={}", sys.join("bus/pci").display());
        Some(time_process(Command::new("lspci").args([
            "-n",
            "-A",
            "linux-sysfs",
            "-O",
            &sysfs_path,
        ]))?)
    } else {
        println!("note: lspci is not installed (apt-get install pciutils); no comparison");
        None
    };

    println!();
    println!(
        "discovery of {functions:.0} PCI functions ({} CPUs), warm, milliseconds:",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("{:<44} {:>8} {:>8} {:>8}", "", "min", "median", "p95");
    let row = |name: &str, (a, b, c): (f64, f64, f64)| {
        println!("{name:<44} {a:>8.2} {b:>8.2} {c:>8.2}");
    };
    row(&format!("in-process, cold ({IN_PROCESS_RUNS} runs)"), cold);
    row(
        &format!("in-process, warm Discoverer ({IN_PROCESS_RUNS} runs)"),
        warm,
    );
    row(
        &format!("node-agent lspci, process ({PROCESS_RUNS} runs)"),
        agent_lspci,
    );
    if let Some(p) = pciutils {
        row(&format!("lspci -n, process ({PROCESS_RUNS} runs)"), p);
    }
    println!("tree: {} (kept for inspection)", rel(&sys));
    Ok(())
}

/// min / median / p95 of `PROCESS_RUNS` runs of `cmd` (output discarded), in ms.
fn time_process(cmd: &mut Command) -> Result<(f64, f64, f64)> {
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    // One run first, so the binary and the tree are in the page cache.
    let status = cmd.status().with_context(|| util::show(cmd))?;
    if !status.success() {
        bail!("`{}` failed ({status})", util::show(cmd));
    }
    let mut times: Vec<Duration> = Vec::with_capacity(PROCESS_RUNS);
    for _ in 0..PROCESS_RUNS {
        let t = Instant::now();
        cmd.status().with_context(|| util::show(cmd))?;
        times.push(t.elapsed());
    }
    times.sort();
    let ms = |q: f64| {
        let i = ((times.len() as f64 - 1.0) * q).round() as usize;
        times.get(i).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    Ok((ms(0.0), ms(0.5), ms(0.95)))
}

fn rel(p: &Path) -> String {
    p.strip_prefix(repo_root())
        .unwrap_or(p)
        .display()
        .to_string()
}
