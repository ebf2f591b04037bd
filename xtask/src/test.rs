//! `cargo xtask test`: the one command CI runs.

use crate::util::{self, cargo, on_path, secs, show, tcp_answers};
use anyhow::{Context, Result, bail};
use std::process::Command;
use std::time::{Duration, Instant};

const DEFAULT_PG_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
/// What the node agent boots UEFI guests with (Debian's `ovmf`).
const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
const PG_START_WAIT: Duration = Duration::from_secs(30);

/// `cargo xtask test [-- ARGS]`.
#[derive(clap::Args)]
#[command(after_help = "Example: cargo xtask test -- store_")]
pub struct Args {
    /// Arguments for the test runner (nextest or cargo test); with any, the doc tests and
    /// the end2end tests are skipped
    #[arg(
        value_name = "ARGS",
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    passthrough: Vec<String>,
}

impl Args {
    #[cfg(test)]
    pub fn passthrough(&self) -> &[String] {
        &self.passthrough
    }
}

pub fn run(args: &Args) -> Result<()> {
    // Everything after `--` (or any argument at all) goes to the test runner.
    let passthrough = &args.passthrough;

    // Set for every child rather than for ourselves (`set_var` is unsafe in edition 2024).
    let pg_url = std::env::var("PASSAGE_TEST_PG_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| DEFAULT_PG_URL.to_string());
    let mut stages = Stages::default();
    stages.run("lspci", ensure_lspci)?;
    // The guest SSH test logs in to its VM with the real client.
    stages.run("ssh", || ensure_tool("ssh", "openssh-client"))?;
    stages.run("qemu", ensure_qemu)?;
    // The metadata service's rules (the agent's own nftables table) and its tests' client.
    stages.run("nftables", || ensure_tool("nft", "nftables"))?;
    stages.run("curl", || ensure_tool("curl", "curl"))?;
    // The guest the node agent's boot tests run, found by them in PASSAGE_TEST_IMAGE.
    let mut test_image = None;
    stages.run("test-image", || {
        test_image = ensure_test_image()?;
        Ok(())
    })?;
    // Triton's own CLI, which the CloudAPI tests drive, found by them in PASSAGE_TEST_TRITON.
    let mut triton = None;
    stages.run("triton-cli", || {
        triton = Some(crate::site::npm_tool(
            &util::repo_root(),
            "triton-cli",
            "triton",
        )?);
        Ok(())
    })?;
    let with_env = |mut cmd: Command| {
        cmd.env("PASSAGE_TEST_PG_URL", &pg_url);
        if let Some(p) = &test_image {
            cmd.env("PASSAGE_TEST_IMAGE", p);
        }
        if let Some(t) = &triton {
            cmd.env("PASSAGE_TEST_TRITON", t);
        }
        cmd
    };

    let nextest = cargo()
        .args(["nextest", "--version"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);

    stages.run("postgres", || ensure_postgres(&pg_url))?;
    drop_test_databases(&pg_url);
    stages.run("fmt", || {
        util::run_checked(cargo().args(["fmt", "--all", "--", "--check"]))
    })?;
    stages.run("clippy", || {
        util::run_checked(cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))
    })?;
    // The server's integration tests spawn the node-agent binary next to theirs.
    stages.run("build", || {
        util::run_checked(cargo().args(["build", "--workspace", "--bins"]))
    })?;
    // The portal's browser half, which the server serves and the end2end tests load.
    stages.run("site", || {
        crate::site::build_with(crate::site::WasmOpt::Required).map(|_| ())
    })?;
    // nextest does not run doc tests. They go first so the test runner's own summary is
    // the last thing printed (CI reads it).
    if nextest {
        if passthrough.is_empty() {
            stages.run("doctest", || {
                let mut cmd = with_env(cargo());
                cmd.args(["test", "--workspace", "--doc"]);
                util::run_checked(&mut cmd)
            })?;
        } else {
            println!("==> doctest skipped (test runner arguments given)");
        }
    }
    if nextest {
        stages.run("nextest", || {
            let mut cmd = with_env(cargo());
            cmd.args(["nextest", "run", "--workspace", "--no-fail-fast"])
                .args(passthrough);
            util::run_checked(&mut cmd)
        })?;
    } else {
        stages.run("test", || {
            let mut cmd = with_env(cargo());
            cmd.args(["test", "--workspace", "--no-fail-fast"])
                .args(passthrough);
            util::run_checked(&mut cmd)
        })?;
    }
    // And those this run made, once the tests passed: left behind, forty-odd databases
    // kept autovacuum visiting each of them, which took the placement benchmark's p99 on
    // Postgres from about 40 ms to 42-73 ms on a 2-CPU machine.
    drop_test_databases(&pg_url);
    // The portal in real Chromium, against the real binaries. Skipped when the runner
    // was given a filter (those name Rust tests).
    if passthrough.is_empty() {
        stages.run("chromium", || ensure_tool("chromium", "chromium"))?;
        stages.run("end2end", end2end)?;
    } else {
        println!("==> end2end skipped (test runner arguments given)");
    }
    stages.summary();
    Ok(())
}

/// Playwright (installed from npm, without its own browsers) driving Debian's Chromium.
fn end2end() -> Result<()> {
    let dir = util::repo_root().join("end2end");
    if !dir.join("node_modules/@playwright/test").is_dir() {
        let mut cmd = Command::new("npm");
        cmd.current_dir(&dir)
            .args(["ci", "--no-audit", "--no-fund"])
            .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1");
        util::run_checked(&mut cmd)?;
    }
    let bin_dir = util::target_dir()?.join("debug");
    let mut cmd = Command::new("npx");
    cmd.current_dir(&dir)
        .args(["playwright", "test"])
        .env("PASSAGE_BIN_DIR", &bin_dir)
        .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1");
    util::run_checked(&mut cmd).context(
        "end2end tests failed; screenshots and traces of the failing pages are in end2end/test-results/",
    )
}

#[derive(Default)]
struct Stages {
    done: Vec<(&'static str, Duration)>,
}

impl Stages {
    fn run(&mut self, name: &'static str, f: impl FnOnce() -> Result<()>) -> Result<()> {
        println!("==> {name}");
        let start = Instant::now();
        let result = f();
        let took = start.elapsed();
        match result {
            Ok(()) => {
                println!("<== {name} ok ({})", secs(took));
                self.done.push((name, took));
                Ok(())
            }
            Err(e) => {
                println!("<== {name} FAILED ({})", secs(took));
                self.summary();
                Err(e.context(format!("stage `{name}` failed")))
            }
        }
    }

    fn summary(&self) {
        let total: Duration = self.done.iter().map(|(_, d)| *d).sum();
        let parts: Vec<String> = self
            .done
            .iter()
            .map(|(n, d)| format!("{n} {}", secs(*d)))
            .collect();
        println!(
            "==> passed: {} (total {})",
            if parts.is_empty() {
                "none".to_string()
            } else {
                parts.join(", ")
            },
            secs(total)
        );
    }
}

/// `lspci` is used by the node-agent tests that compare against the real tool.
fn ensure_lspci() -> Result<()> {
    ensure_tool("lspci", "pciutils")
}

/// `qemu-system-x86_64` runs the node-agent's QEMU backend test (TCG, no KVM needed).
/// Where it cannot be installed the stage fails, unless `PASSAGE_ALLOW_NO_QEMU=1`, in
/// which case the test itself skips with a note.
fn ensure_qemu() -> Result<()> {
    // UEFI guests boot OVMF, the node agent's default for VMs with devices.
    let qemu = ensure_tool("qemu-system-x86_64", "qemu-system-x86").and_then(|()| {
        ensure_package(OVMF_CODE, "ovmf", || {
            std::path::Path::new(OVMF_CODE).is_file()
        })
    });
    match qemu {
        Err(e) if std::env::var("PASSAGE_ALLOW_NO_QEMU").as_deref() == Ok("1") => {
            println!("warning: {e:#}; PASSAGE_ALLOW_NO_QEMU=1, so the QEMU test will skip");
            Ok(())
        }
        other => other,
    }
}

/// Builds or finds the guest test image. Where it cannot be built the stage fails, unless
/// `PASSAGE_ALLOW_NO_QEMU=1`, in which case the boot tests skip with a note.
fn ensure_test_image() -> Result<Option<std::path::PathBuf>> {
    match crate::test_image::ensure() {
        Ok(p) => Ok(Some(p)),
        Err(e) if std::env::var("PASSAGE_ALLOW_NO_QEMU").as_deref() == Ok("1") => {
            println!("warning: {e:#}; PASSAGE_ALLOW_NO_QEMU=1, so the guest boot tests will skip");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Installs the Debian `package` with apt-get unless `tool` is already on PATH.
pub(crate) fn ensure_tool(tool: &str, package: &str) -> Result<()> {
    ensure_package(tool, package, || on_path(tool))
}

/// Installs the Debian `package` with apt-get unless `present` says `tool` (a command
/// or a file) is there.
fn ensure_package(tool: &str, package: &str, present: impl Fn() -> bool) -> Result<()> {
    if present() {
        println!("{tool} present");
        return Ok(());
    }
    if !on_path("apt-get") {
        bail!("{tool} is missing and there is no apt-get; install {package}");
    }
    let install = || {
        let mut cmd = Command::new("apt-get");
        cmd.args(["install", "-y", "--no-install-recommends", package])
            .env("DEBIAN_FRONTEND", "noninteractive");
        util::run_checked(&mut cmd)
    };
    if install().is_err() {
        println!("apt-get install failed; running apt-get update and retrying");
        util::run_checked(Command::new("apt-get").arg("update"))?;
        install()?;
    }
    if !present() {
        bail!("{package} is installed but {tool} is still not there");
    }
    Ok(())
}

/// Each Postgres test makes a database `passage_t_<uuid>` of its own; drop those earlier
/// runs left so they do not pile up. Best effort: a failure here is only a warning.
fn drop_test_databases(url: &str) {
    let listed = Command::new("psql")
        .args([
            url,
            "-Atc",
            "SELECT datname FROM pg_database WHERE datname LIKE 'passage\\_t\\_%'",
        ])
        .output();
    let out = match listed {
        Ok(o) if o.status.success() => o,
        Ok(o) => {
            println!(
                "warning: listing old test databases: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            return;
        }
        Err(e) => {
            println!("warning: psql not found ({e}); old test databases are kept");
            return;
        }
    };
    let names: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|n| {
            n.starts_with("passage_t_") && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        })
        .map(String::from)
        .collect();
    for n in &names {
        let _ = Command::new("psql")
            .args([url, "-qc", &format!("DROP DATABASE IF EXISTS {n}")])
            .output();
    }
    if !names.is_empty() {
        println!(
            "dropped {} test database(s) left by earlier runs",
            names.len()
        );
    }
}

/// Makes sure the Postgres the tests use answers; starts the local cluster if it does not.
pub(crate) fn ensure_postgres(url: &str) -> Result<()> {
    let Some(addr) = pg_addr(url) else {
        println!("PASSAGE_TEST_PG_URL names no TCP host; not checking it");
        return Ok(());
    };
    if tcp_answers(&addr, Duration::from_secs(1)) {
        println!("PostgreSQL answers at {addr}");
        return Ok(());
    }
    let host = addr.rsplit_once(':').map(|(h, _)| h).unwrap_or(&addr);
    if !matches!(host, "127.0.0.1" | "localhost" | "[::1]") {
        bail!("PostgreSQL at {addr} (PASSAGE_TEST_PG_URL) does not answer");
    }
    let version = local_cluster_version()?;
    let mut cmd = Command::new("pg_ctlcluster");
    cmd.args(["--skip-systemctl-redirect", &version, "main", "start"]);
    println!(
        "PostgreSQL does not answer at {addr}; running `{}`",
        show(&cmd)
    );
    // A failure here (say, already starting) is judged by whether the port answers.
    if let Err(e) = util::run_checked(&mut cmd) {
        println!("warning: {e:#}");
    }
    let start = Instant::now();
    while start.elapsed() < PG_START_WAIT {
        if tcp_answers(&addr, Duration::from_secs(1)) {
            println!(
                "PostgreSQL answers at {addr} after {}",
                secs(start.elapsed())
            );
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    bail!(
        "PostgreSQL did not answer at {addr} within {} s of starting cluster {version}/main \
         (see /var/log/postgresql/)",
        PG_START_WAIT.as_secs()
    )
}

/// `host:port` of a `postgres://[user[:pw]@]host[:port][/db][?…]` URL, if it names a host.
fn pg_addr(url: &str) -> Option<String> {
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))?;
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if hostport.is_empty() {
        return None; // a Unix socket, or host given in the query string
    }
    let has_port = match hostport.rfind(']') {
        Some(end) => hostport[end..].contains(':'),
        None => hostport.contains(':'),
    };
    Some(if has_port {
        hostport.to_string()
    } else {
        format!("{hostport}:5432")
    })
}

/// The newest PostgreSQL version with a cluster under /etc/postgresql.
fn local_cluster_version() -> Result<String> {
    let dir = "/etc/postgresql";
    let mut versions: Vec<(Vec<u32>, String)> = std::fs::read_dir(dir)
        .with_context(|| format!("PostgreSQL does not answer and {dir} cannot be read"))?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter_map(|name| {
            let key: Option<Vec<u32>> = name.split('.').map(|p| p.parse().ok()).collect();
            key.map(|k| (k, name))
        })
        .collect();
    versions.sort();
    match versions.pop() {
        Some((_, v)) => Ok(v),
        None => bail!("PostgreSQL does not answer and {dir} holds no cluster"),
    }
}

#[cfg(test)]
mod tests {
    use super::pg_addr;

    #[test]
    fn pg_addr_forms() {
        assert_eq!(
            pg_addr("postgres://postgres@127.0.0.1:5432/postgres").as_deref(),
            Some("127.0.0.1:5432")
        );
        assert_eq!(
            pg_addr("postgresql://u:p@db.example/x?sslmode=disable").as_deref(),
            Some("db.example:5432")
        );
        assert_eq!(
            pg_addr("postgres://[::1]:6543/x").as_deref(),
            Some("[::1]:6543")
        );
        assert_eq!(pg_addr("postgres://[::1]/x").as_deref(), Some("[::1]:5432"));
        assert_eq!(pg_addr("postgres:///db?host=/run/postgresql"), None);
        assert_eq!(pg_addr("sqlite://x.db"), None);
    }
}
