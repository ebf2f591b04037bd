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
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// 72 GPUs with their audio functions over 8 NUMA nodes: 311 functions.
const GPUS: &str = "72";
const NUMA_NODES: &str = "8";
const IN_PROCESS_RUNS: &str = "500";
const PROCESS_RUNS: usize = 50;

pub fn run(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("discovery") => discovery(),
        Some("placement") => example("bench_placement", &args[1..]),
        Some("portal") => example("bench_portal", &args[1..]),
        Some("-h" | "--help") | None => {
            println!(
                "usage: cargo xtask bench discovery\n       cargo xtask bench placement \
                 [--backend sqlite|postgres] [--servers N] [--gpus G] [--vms N] [--clients C]\n       \
                 cargo xtask bench portal [--backend sqlite|postgres] [--servers N] [--gpus G] \
                 [--vms N] [--clients C] [--requests R]"
            );
            Ok(())
        }
        Some(other) => bail!("unknown benchmark {other:?} (known: discovery, placement, portal)"),
    }
}

/// VM creations through the HTTP API of a release `server` onto simulated nodes, then
/// multi-GPU decisions in-process: `server/examples/bench_placement.rs` does the work.
/// Runs one of the server's benchmark examples against a release `server`.
fn example(name: &str, args: &[String]) -> Result<()> {
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
