//! `cargo xtask fuzz-api`: property-based fuzzing of the REST API with Schemathesis,
//! driven by the OpenAPI document the server serves at `/v1/openapi.json`.
//!
//! 1. makes sure the pinned Schemathesis is installed (`python3 -m pip install`, or the
//!    Python `--python` names);
//! 2. builds `server`, starts it on a free loopback port with a throwaway database (SQLite
//!    in a temp folder, or a fresh `passage_fuzz_<random>` PostgreSQL database) and eight
//!    simulated compute nodes, logs in as `admin`, makes an API token for the fuzzer (API
//!    tokens outlive password changes, which end login sessions), and seeds a variant and
//!    a package;
//! 3. runs `schemathesis run` with every check and N cases per operation, three times:
//!    the examples, coverage and fuzzing phases; then (with the seeds made again and
//!    every server and device back in service) the stateful phase over the document's
//!    links; then the fuzzing phase again for the deletions alone, which the first pass
//!    gives only the few ids it captured from earlier answers.
//!    It leaves out the two operations that would revoke the fuzzer's own token
//!    (`POST /v1/auth/logout`, `DELETE /v1/tokens/{uuid}`) and the one that would cut off
//!    the simulated nodes (`DELETE /v1/servers/{uuid}/credential`). `-- --phases …` runs
//!    once, with the phases named;
//! 4. prints a summary and the fleet it left, stops the server, and fails on any failure;
//!    on failure (or with `--keep`) the temp folder (database, server log, Schemathesis
//!    output and JUnit report) is kept and named.

use crate::http::{Client, Response, truncate};
use crate::util::{self, cargo, secs};
use anyhow::{Context, Result, anyhow, bail};
use serde_json::json;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The Schemathesis release this runner was written and checked against (flags differ
/// between 3.x and 4.x; 4.x runs the stateful phase by itself when it can infer links).
const SCHEMATHESIS_VERSION: &str = "4.32.5";
const DEFAULT_PG_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
const PING_WAIT: Duration = Duration::from_secs(60);
const NODES_WAIT: Duration = Duration::from_secs(30);
/// How long Schemathesis gets to print its summary after SIGINT.
const INTERRUPT_GRACE: Duration = Duration::from_secs(60);
/// `operationId`s left out: the first two would revoke the token the fuzzer runs with;
/// the third revokes a node's credential, which stops the simulated nodes for the rest of
/// the run (and with them every placement).
const EXCLUDED_OPERATIONS: &[&str] = &["logout", "delete_token", "revoke_credential"];
/// Simulated nodes and GPUs on each. Every phase creates VMs whose devices stay held (their
/// deletes name random ids) and drains the servers its links reach: with a fleet of two
/// nodes the stateful phase found no room left and its creations answered 409 throughout.
const SIM_SERVERS: usize = 8;
const SIM_GPUS: usize = 8;

/// `cargo xtask fuzz-api [options] [-- ARGS]`.
#[derive(clap::Args)]
#[command(
    after_help = "Installs schemathesis==4.32.5 with pip if needed. Exits non-zero on any \
failure and then keeps its temp folder (server log, Schemathesis output, JUnit report).\n\
Example: cargo xtask fuzz-api --cases 50 -- --seed 1 --phases fuzzing"
)]
pub struct Args {
    /// Test cases per API operation
    #[arg(long, value_name = "N", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..))]
    cases: u32,
    /// Database of the throwaway server; postgres makes a database passage_fuzz_<random>
    /// on PASSAGE_TEST_PG_URL (default postgres://postgres@127.0.0.1:5432/postgres),
    /// dropped after
    #[arg(long, value_name = "B", value_enum, default_value_t = Backend::Sqlite)]
    backend: Backend,
    /// Stop Schemathesis after M minutes and report what it found so far
    #[arg(long, value_name = "M", default_value_t = 20,
          value_parser = clap::value_parser!(u64).range(1..))]
    max_minutes: u64,
    /// Concurrent Schemathesis workers. One by default: with two, Hypothesis parses lambdas'
    /// source in two threads at once, which CPython 3.11 can fail with "SystemError: AST
    /// constructor recursion depth mismatch" (cpython#106905), reported as API errors
    #[arg(long, value_name = "W", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    workers: u32,
    /// The Python that runs Schemathesis (pip installs it there if missing)
    #[arg(
        long,
        value_name = "PATH",
        env = "PASSAGE_FUZZ_PYTHON",
        default_value = "python3"
    )]
    python: String,
    /// Keep the temp folder (database, server log, Schemathesis output) even when the run
    /// passes
    #[arg(long)]
    keep: bool,
    /// Arguments for `schemathesis run`
    #[arg(value_name = "ARGS", last = true)]
    passthrough: Vec<String>,
}

impl Args {
    #[cfg(test)]
    pub fn passthrough(&self) -> &[String] {
        &self.passthrough
    }
}

#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum Backend {
    Sqlite,
    #[value(alias = "postgresql")]
    Postgres,
}

pub fn run(opts: &Args) -> Result<()> {
    let started = Instant::now();

    // Ctrl-C (or a SIGTERM to us) stops Schemathesis early; it still prints its summary
    // and we still stop the server. Registering a handler also means the children start
    // with the default disposition even when we were started with SIGINT ignored.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .context("cannot install a signal handler")?;
    }

    println!("==> schemathesis");
    ensure_schemathesis(&opts.python)?;

    println!("==> building the server");
    util::run_checked(cargo().args(["build", "-p", "passage-server", "--bin", "server"]))?;
    let server_bin = util::target_dir()?.join("debug/server");
    if !server_bin.is_file() {
        bail!("{} was not built", server_bin.display());
    }

    let mut run = FuzzRun::new()?;
    run.keep = opts.keep;
    println!("work folder: {}", run.dir.display());

    let database = match opts.backend {
        Backend::Sqlite => format!("sqlite://{}", run.dir.join("passage.db").display()),
        Backend::Postgres => run.create_pg_database()?,
    };
    let port = free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let password = random_hex(16)?;
    println!(
        "==> starting the server on http://{addr} ({})",
        redact(&database)
    );
    run.start_server(&server_bin, &addr, &database, &password)?;
    let mut api = Client::new(&addr);
    run.wait_for_ping(&api, &stop)?;

    println!("==> seeding: admin login, variant, package, API token");
    let login = api.post(
        "/v1/auth/login",
        Some(&json!({"login": "admin", "password": password})),
    )?;
    let session = expect(&login, 200, "log in as admin")?["token"]
        .as_str()
        .ok_or_else(|| anyhow!("login answer has no token"))?
        .to_string();
    api.set_token(&session);
    let r = api.post("/v1/tokens", Some(&json!({"name": "fuzz"})))?;
    let token = expect(&r, 201, "create an API token")?["token"]
        .as_str()
        .ok_or_else(|| anyhow!("token answer has no secret"))?
        .to_string();
    api.set_token(&token);
    wait_for_nodes(&api, &stop)?;
    seed(&api)?;

    println!(
        "==> schemathesis run: {} case(s) per operation, all checks, {} worker(s), \
         at most {} min",
        opts.cases, opts.workers, opts.max_minutes
    );
    let fuzz_started = Instant::now();
    let deadline = fuzz_started + Duration::from_secs(opts.max_minutes * 60);
    let outcome = if opts.passthrough.iter().any(|a| a.starts_with("--phases")) {
        run.schemathesis(opts, &addr, &token, &stop, &[], deadline)?
    } else {
        let mut outcome = run.schemathesis(
            opts,
            &addr,
            &token,
            &stop,
            &["--phases", "examples,coverage,fuzzing"],
            deadline,
        )?;
        // The stateful phase starts from a fleet in service: the phases before it delete
        // the seeded package and variant and drain servers, after which every creation it
        // chains from a package answers 409 and the calls on VMs are never reached.
        if !outcome.timed_out && !outcome.interrupted {
            println!("==> back in service for the stateful phase");
            seed(&api)?;
            let more = run.schemathesis(
                opts,
                &addr,
                &token,
                &stop,
                &["--phases", "stateful"],
                deadline,
            )?;
            outcome.merge(more);
        }
        // In the first pass, the deletions draw their ids from those Schemathesis saw in
        // earlier answers (4.17 and later), a handful, and Hypothesis stops after about
        // twenty distinct cases; in a run of their own they get their N.
        if !outcome.timed_out && !outcome.interrupted {
            println!("==> the deletions, fuzzed on their own");
            let more = run.schemathesis(
                opts,
                &addr,
                &token,
                &stop,
                &["--phases", "fuzzing", "--include-method", "DELETE"],
                deadline,
            )?;
            outcome.merge(more);
        }
        outcome
    };
    let fuzz_time = fuzz_started.elapsed();

    // The fuzzer must not have lost its own credentials part way through.
    let token_alive = api.get("/v1/tokens").map(|r| r.status == 200).ok();
    let fleet = fleet_at_end(&api).unwrap_or_else(|e| vec![format!("(could not read it: {e:#})")]);
    let server_exit = run.server_exit();
    let panics = count_panics(&run.server_log);

    println!();
    println!("==> summary");
    println!(
        "schemathesis {SCHEMATHESIS_VERSION}: {} case(s)/operation, {} (exit {})",
        opts.cases,
        secs(fuzz_time),
        outcome
            .exit
            .map_or_else(|| "killed".to_string(), |c| c.to_string())
    );
    for line in &outcome.summary {
        println!("  {line}");
    }
    if !outcome.failures.is_empty() {
        println!("failures by operation:");
        for (op, checks) in &outcome.failures {
            println!("  {op}");
            for c in checks {
                println!("      {c}");
            }
        }
    }
    println!("fleet at the end:");
    for line in &fleet {
        println!("  {line}");
    }
    let mut problems = Vec::new();
    if outcome.timed_out {
        problems.push(format!(
            "stopped at the time limit ({} min): results are partial",
            opts.max_minutes
        ));
    }
    if outcome.interrupted {
        problems.push("interrupted".to_string());
    }
    if outcome.exit != Some(0) && !outcome.timed_out && !outcome.interrupted {
        problems.push("schemathesis reported failures or errors".to_string());
    }
    if outcome.timed_out && outcome.found_failures {
        problems.push("schemathesis reported failures before the time limit".to_string());
    }
    if let Some(status) = server_exit {
        problems.push(format!("the server exited during the run ({status})"));
    }
    if panics > 0 {
        problems.push(format!("the server log has {panics} panic(s)"));
    }
    if token_alive == Some(false) {
        problems
            .push("the fuzzer's API token no longer works: later results may be 401s".to_string());
    }
    println!("total time: {}", secs(started.elapsed()));

    // A time limit reached with nothing found is a pass; anything else that went wrong
    // is a failure.
    let failed = problems
        .iter()
        .any(|p| !p.starts_with("stopped at the time limit"));
    for p in &problems {
        println!("- {p}");
    }
    drop(api);
    run.stop_server();
    if failed {
        run.keep = true;
        println!("server log:          {}", run.server_log.display());
        println!(
            "schemathesis output: {}",
            run.dir.join("schemathesis.log").display()
        );
        println!("reports:             {}", run.dir.join("reports").display());
        println!(
            "(reproductions print `Authorization: [Filtered]`: use a token of your own, \
             or -- --output-sanitize false)"
        );
        bail!("API fuzzing found problems");
    }
    println!("no failures");
    Ok(())
}

/// Installs the pinned Schemathesis unless `PYTHON -m schemathesis.cli` is that version.
fn ensure_schemathesis(python: &str) -> Result<()> {
    let installed = installed_schemathesis(python);
    if installed.as_deref() == Some(SCHEMATHESIS_VERSION) {
        println!("schemathesis {SCHEMATHESIS_VERSION} is installed");
        return Ok(());
    }
    match &installed {
        Some(v) => println!("schemathesis {v} is installed; installing {SCHEMATHESIS_VERSION}"),
        None => println!("schemathesis is not installed; installing {SCHEMATHESIS_VERSION}"),
    }
    util::run_checked(Command::new(python).args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--quiet",
        &format!("schemathesis=={SCHEMATHESIS_VERSION}"),
    ]))
    .with_context(|| format!("installing schemathesis (needs {python} with pip)"))?;
    match installed_schemathesis(python) {
        Some(v) if v == SCHEMATHESIS_VERSION => Ok(()),
        Some(v) => bail!("pip installed schemathesis {v}, not {SCHEMATHESIS_VERSION}"),
        None => bail!("`{python} -m schemathesis.cli --version` still fails after pip install"),
    }
}

/// The version `PYTHON -m schemathesis.cli --version` reports, if it runs.
fn installed_schemathesis(python: &str) -> Option<String> {
    let out = Command::new(python)
        .args(["-m", "schemathesis.cli", "--version"])
        .stdin(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    // "python -m schemathesis.cli, version 4.32.5"
    let text = String::from_utf8_lossy(&out.stdout);
    text.split("version")
        .nth(1)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

struct Outcome {
    exit: Option<i32>,
    timed_out: bool,
    interrupted: bool,
    found_failures: bool,
    /// Schemathesis' own summary: its failure counts and test-case totals.
    summary: Vec<String>,
    /// Each failing operation with the checks it failed.
    failures: Vec<(String, Vec<String>)>,
}

impl Outcome {
    /// One outcome for two runs, the second after the first: the worse exit.
    fn merge(&mut self, later: Outcome) {
        self.exit = match (self.exit, later.exit) {
            (Some(0), e) => e,
            (e, _) => e,
        };
        self.timed_out |= later.timed_out;
        self.interrupted |= later.interrupted;
        self.found_failures |= later.found_failures;
        self.summary.extend(later.summary);
        self.failures.extend(later.failures);
    }
}

/// One run's temp folder, server and database; dropping it stops and removes them.
struct FuzzRun {
    dir: PathBuf,
    server: Option<Child>,
    server_log: PathBuf,
    /// `(admin URL, database name)` of a Postgres database to drop at the end.
    pg: Option<(String, String)>,
    keep: bool,
}

impl FuzzRun {
    fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("passage-fuzz-{}", random_hex(4)?));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        Ok(Self {
            server_log: dir.join("server.log"),
            dir,
            server: None,
            pg: None,
            keep: false,
        })
    }

    fn create_pg_database(&mut self) -> Result<String> {
        let admin_url = std::env::var("PASSAGE_TEST_PG_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| DEFAULT_PG_URL.to_string());
        crate::test::ensure_postgres(&admin_url)?;
        let name = format!("passage_fuzz_{}", random_hex(6)?);
        let out = Command::new("psql")
            .args([&admin_url, "-qc", &format!("CREATE DATABASE {name}")])
            .stdin(Stdio::null())
            .output()
            .context("cannot run psql (apt-get install postgresql-client)")?;
        if !out.status.success() {
            bail!(
                "CREATE DATABASE {name} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        println!("created database {name}");
        self.pg = Some((admin_url.clone(), name.clone()));
        with_database(&admin_url, &name)
    }

    fn start_server(&mut self, bin: &Path, addr: &str, database: &str, pw: &str) -> Result<()> {
        let out = File::create(&self.server_log)
            .with_context(|| format!("cannot create {}", self.server_log.display()))?;
        let err = out.try_clone()?;
        let mut cmd = Command::new(bin);
        cmd.current_dir(&self.dir)
            .args(["--listen", addr, "--database", database])
            .arg("--sim-servers")
            .arg(SIM_SERVERS.to_string())
            .arg("--sim-gpus")
            .arg(SIM_GPUS.to_string())
            .arg("--sim-dir")
            .arg(self.dir.join("sim"))
            .env("PASSAGE_ADMIN_PASSWORD", pw)
            .env_remove("PASSAGE_LISTEN")
            .env_remove("PASSAGE_DATABASE_URL")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", util::show(&cmd)))?;
        self.server = Some(child);
        Ok(())
    }

    fn wait_for_ping(&mut self, api: &Client, stop: &AtomicBool) -> Result<()> {
        let start = Instant::now();
        loop {
            if stop.load(Ordering::Relaxed) {
                bail!("interrupted");
            }
            if let Some(status) = self.server_exit() {
                self.keep = true;
                bail!(
                    "the server exited ({status}) before answering; see {}:\n{}",
                    self.server_log.display(),
                    log_tail(&self.server_log)
                );
            }
            if let Ok(r) = api.get("/v1/ping")
                && r.status == 200
            {
                return Ok(());
            }
            if start.elapsed() > PING_WAIT {
                self.keep = true;
                bail!(
                    "the server did not answer /v1/ping within {} s; see {}",
                    PING_WAIT.as_secs(),
                    self.server_log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// How the server ended, if it has.
    fn server_exit(&mut self) -> Option<String> {
        let child = self.server.as_mut()?;
        match child.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            _ => None,
        }
    }

    /// SIGTERM (the server shuts down gracefully on it), SIGKILL after 5 s.
    fn stop_server(&mut self) {
        let Some(mut child) = self.server.take() else {
            return;
        };
        if let Ok(None) = child.try_wait() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .stderr(Stdio::null())
                .status();
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Runs Schemathesis once, with `extra` arguments (which phases, which operations),
    /// until `deadline`.
    fn schemathesis(
        &self,
        opts: &Args,
        addr: &str,
        token: &str,
        stop: &AtomicBool,
        extra: &[&str],
        deadline: Instant,
    ) -> Result<Outcome> {
        let reports = self.dir.join("reports");
        let mut cmd = Command::new(&opts.python);
        // Its example database (.hypothesis/, .schemathesis/) goes in the temp folder.
        cmd.current_dir(&self.dir)
            .args(["-m", "schemathesis.cli", "run"])
            .arg(format!("http://{addr}/v1/openapi.json"))
            .args(["--header", &format!("Authorization: Bearer {token}")])
            .args(["--checks", "all"])
            .args(["--max-examples", &opts.cases.to_string()])
            .args(["--workers", &opts.workers.to_string()]);
        for op in EXCLUDED_OPERATIONS {
            cmd.args(["--exclude-operation-id", op]);
        }
        cmd.args(extra);
        cmd.args(["--no-color", "--report", "junit", "--report-dir"])
            .arg(&reports)
            .args(&opts.passthrough)
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let shown = util::show(&cmd).replace(token, "$TOKEN");
        println!("{shown}");
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start `{} -m schemathesis.cli run`", opts.python))?;

        // Echo both streams and keep them in schemathesis.log.
        let log_path = self.dir.join("schemathesis.log");
        let log = Arc::new(std::sync::Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log_path)
                .with_context(|| format!("cannot open {}", log_path.display()))?,
        ));
        let lines = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let mut pumps = Vec::new();
        let streams: [Option<Box<dyn Read + Send>>; 2] = [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        ];
        for stream in streams.into_iter().flatten() {
            let log = Arc::clone(&log);
            let lines = Arc::clone(&lines);
            pumps.push(std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    println!("{line}");
                    if let Ok(mut f) = log.lock() {
                        let _ = writeln!(f, "{line}");
                    }
                    if let Ok(mut l) = lines.lock() {
                        l.push(line);
                    }
                }
            }));
        }

        let mut timed_out = false;
        let mut interrupted = false;
        let mut signalled_at: Option<Instant> = None;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            if signalled_at.is_none() {
                if Instant::now() >= deadline {
                    timed_out = true;
                } else if stop.load(Ordering::Relaxed) {
                    interrupted = true;
                }
                if timed_out || interrupted {
                    // SIGINT: Schemathesis stops and prints its summary of what it found.
                    let _ = Command::new("kill")
                        .args(["-INT", &child.id().to_string()])
                        .stderr(Stdio::null())
                        .status();
                    signalled_at = Some(Instant::now());
                }
            } else if signalled_at.is_some_and(|t| t.elapsed() > INTERRUPT_GRACE) {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        for p in pumps {
            let _ = p.join();
        }
        let lines = lines.lock().map(|l| l.clone()).unwrap_or_default();
        Ok(Outcome {
            exit: status.and_then(|s| s.code()),
            timed_out,
            interrupted,
            found_failures: lines
                .iter()
                .any(|l| l.trim_start().starts_with("Failures:")),
            summary: summary_lines(&lines),
            failures: failures_by_operation(&lines),
        })
    }
}

impl Drop for FuzzRun {
    fn drop(&mut self) {
        self.stop_server();
        if let Some((admin_url, name)) = self.pg.take() {
            let dropped = Command::new("psql")
                .args([
                    &admin_url,
                    "-qc",
                    &format!("DROP DATABASE IF EXISTS {name}"),
                ])
                .stdin(Stdio::null())
                .output();
            match dropped {
                Ok(o) if o.status.success() => println!("dropped database {name}"),
                _ => println!("warning: could not drop database {name}"),
            }
        }
        if self.keep {
            println!("kept {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The parts of Schemathesis' closing summary worth repeating: failure counts per kind,
/// errors, warnings and the test-case total.
fn summary_lines(lines: &[String]) -> Vec<String> {
    let Some(start) = lines.iter().rposition(|l| l.contains("SUMMARY")) else {
        return vec!["(schemathesis printed no summary)".to_string()];
    };
    let mut out = Vec::new();
    let mut section = "";
    for line in &lines[start + 1..] {
        let t = line.trim();
        if t.starts_with('=') {
            out.push(t.trim_matches(|c| c == '=' || c == ' ').into());
            continue;
        }
        if t.ends_with(':') && !line.starts_with(' ') {
            section = t;
            continue;
        }
        if t.is_empty() {
            continue;
        }
        match section {
            "Failures:" | "Errors:" | "Warnings:" if !t.starts_with("For more information") => {
                out.push(format!("{section} {t}"))
            }
            "Test cases:" => out.push(format!("test cases: {t}")),
            _ => {}
        }
    }
    out
}

/// From Schemathesis' FAILURES section: each operation (`____ GET /v1/x ____`) with the
/// distinct checks that failed on it (`- ST202 Schema-valid request rejected`), in order.
fn failures_by_operation(lines: &[String]) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    let mut inside = false;
    for line in lines {
        let t = line.trim_end();
        if t.starts_with("===") {
            inside = t.contains(" FAILURES ");
            continue;
        }
        if !inside {
            continue;
        }
        if t.starts_with('_') && t.ends_with('_') {
            let op = t.trim_matches(|c| c == '_' || c == ' ');
            if !op.is_empty() {
                out.push((op.to_string(), Vec::new()));
            }
        } else if let Some(check) = t.strip_prefix("- ")
            && let Some((_, checks)) = out.last_mut()
            && !checks.iter().any(|c| c == check)
        {
            checks.push(check.to_string());
        }
    }
    out
}

/// Waits (best effort) until the simulated nodes are running, so that devices exist.
fn wait_for_nodes(api: &Client, stop: &AtomicBool) -> Result<()> {
    let start = Instant::now();
    loop {
        if stop.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        let r = api.get("/v1/servers?limit=1000")?;
        let list = expect(&r, 200, "list servers")?;
        let servers = list.as_array().cloned().unwrap_or_default();
        let running = servers
            .iter()
            .filter(|s| s["status"].as_str() == Some("running"))
            .count();
        let devices: usize = servers
            .iter()
            .map(|s| s["assignable_devices"].as_array().map_or(0, Vec::len))
            .sum();
        if running >= SIM_SERVERS {
            println!("{running} simulated server(s) running with {devices} assignable device(s)");
            return Ok(());
        }
        if start.elapsed() > NODES_WAIT {
            println!(
                "warning: only {running} of {SIM_SERVERS} simulated servers running after {} s",
                NODES_WAIT.as_secs()
            );
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The fleet the fuzzer starts from, made again before the stateful phase: variant
/// `NVIDIA_H100` matching the simulated GPUs, package `gpu-1x` with one of them, every
/// server and device back in service.
fn seed(api: &Client) -> Result<()> {
    let variant = json!({"name": "NVIDIA_H100", "type": "gpu", "vendor": "10de", "device": "2330"});
    let r = api.request("PUT", "/v1/variants/NVIDIA_H100", Some(&variant))?;
    if r.status == 404 {
        let r = api.post("/v1/variants", Some(&variant))?;
        expect(&r, 201, "create the variant NVIDIA_H100")?;
    } else {
        expect(&r, 200, "put the variant NVIDIA_H100")?;
    }
    let r = api.post(
        "/v1/packages",
        Some(&json!({
            "name": "gpu-1x", "vcpus": 2, "memory_mib": 2048,
            "devices": {"NVIDIA_H100": 1}
        })),
    )?;
    if r.status != 409 {
        expect(&r, 201, "create the package gpu-1x")?;
    }
    // VMs boot an image: `fuzz` (made again if the fuzzer deleted it).
    crate::demo::seed_image(api, "fuzz")?;
    let servers = expect(
        &api.get("/v1/servers?brief=true&limit=1000")?,
        200,
        "list servers",
    )?;
    let mut undrained = 0;
    for s in servers.as_array().into_iter().flatten() {
        if s["disabled"] == true {
            let uuid = s["uuid"].as_str().unwrap_or_default();
            let r = api.request(
                "PATCH",
                &format!("/v1/servers/{uuid}"),
                Some(&json!({"disabled": false})),
            )?;
            expect(&r, 200, "put a server back in service")?;
            undrained += 1;
        }
    }
    let devices = expect(&api.get("/v1/devices?limit=1000")?, 200, "list devices")?;
    let mut restored = 0;
    for d in devices.as_array().into_iter().flatten() {
        let actions: &[&str] = match (d["state"].as_str(), d["taint"].is_string()) {
            (Some("disabled"), t) => {
                if t {
                    &["enable", "clear_taint"]
                } else {
                    &["enable"]
                }
            }
            (Some("quarantined"), t) => {
                if t {
                    &["requeue", "clear_taint"]
                } else {
                    &["requeue"]
                }
            }
            (_, true) => &["clear_taint"],
            _ => &[],
        };
        let server = d["server_uuid"].as_str().unwrap_or_default();
        for action in actions {
            let body = json!({
                "device": d["id"], "action": action,
                "reason": "fuzz-api: back in service for the next phase"
            });
            let r = api.post(&format!("/v1/servers/{server}/device-actions"), Some(&body))?;
            expect(&r, 200, &format!("{action} a device"))?;
        }
        restored += usize::from(!actions.is_empty());
    }
    if undrained + restored > 0 {
        println!("{undrained} server(s) and {restored} device(s) put back in service");
    }
    Ok(())
}

/// What the run left behind: devices by state per variant, servers drained or down, VMs
/// by state. Tells whether later phases still had room to create VMs in.
fn fleet_at_end(api: &Client) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let cap = expect(&api.get("/v1/capacity")?, 200, "read the capacity")?;
    for v in cap.as_array().into_iter().flatten() {
        let n = |k: &str| v[k].as_u64().unwrap_or(0);
        lines.push(format!(
            "{}: {} devices, {} free, {} held, {} dirty, {} quarantined, {} disabled",
            v["variant"].as_str().unwrap_or("?"),
            n("total"),
            n("free"),
            n("held"),
            n("dirty"),
            n("quarantined"),
            n("disabled"),
        ));
    }
    let servers = expect(
        &api.get("/v1/servers?brief=true&limit=1000")?,
        200,
        "list servers",
    )?;
    let servers = servers.as_array().cloned().unwrap_or_default();
    let drained = servers.iter().filter(|s| s["disabled"] == true).count();
    let running = servers
        .iter()
        .filter(|s| s["status"].as_str() == Some("running"))
        .count();
    lines.push(format!(
        "servers: {} in all, {running} running, {drained} drained",
        servers.len()
    ));
    let vms = expect(&api.get("/v1/vms?limit=1000")?, 200, "list VMs")?;
    let mut by_state = std::collections::BTreeMap::<String, usize>::new();
    for vm in vms.as_array().into_iter().flatten() {
        *by_state
            .entry(vm["state"].as_str().unwrap_or("?").to_string())
            .or_default() += 1;
    }
    let states: Vec<String> = by_state.iter().map(|(s, n)| format!("{n} {s}")).collect();
    lines.push(format!("VMs (first 1,000): {}", states.join(", ")));
    Ok(lines)
}

fn expect(r: &Response, want: u16, what: &str) -> Result<serde_json::Value> {
    if r.status != want {
        bail!(
            "could not {what}: HTTP {} {}",
            r.status,
            truncate(&r.text(), 300)
        );
    }
    r.json()
}

/// A loopback port nobody listens on (the OS picks it; there is a small race).
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot bind a free port")?;
    Ok(l.local_addr()?.port())
}

/// `n` random bytes from /dev/urandom as lowercase hex.
fn random_hex(n: usize) -> Result<String> {
    let mut buf = vec![0u8; n];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .context("cannot read /dev/urandom")?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// `url` with its database name replaced by `db` (query string kept).
fn with_database(url: &str, db: &str) -> Result<String> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| anyhow!("{url:?} is not a postgres:// URL"))?;
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let authority = before_query.split('/').next().unwrap_or("");
    let mut out = format!("{scheme}://{authority}/{db}");
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Ok(out)
}

/// A database URL with any password replaced, for printing.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    match authority.rsplit_once('@') {
        Some((userinfo, host)) if userinfo.contains(':') => {
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{host}{}", &rest[authority.len()..])
        }
        _ => url.to_string(),
    }
}

fn count_panics(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("panicked"))
        .count()
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(15);
    lines[from..]
        .iter()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::{failures_by_operation, redact, summary_lines, with_database};

    #[test]
    fn failures() {
        let text = "\
=================================== FAILURES ===================================
_______________________________ GET /v1/accounts _______________________________
1. Test Case ID: FhyCCu

- ST201 Schema-violating request accepted

    Invalid data should have been rejected
2. Test Case ID: Kgg14r

- ST202 Schema-valid request rejected
3. Test Case ID: Kgg14s

- ST202 Schema-valid request rejected
________________________________ GET /v1/alerts ________________________________
1. Test Case ID: zIwG33

- Server error
=================================== WARNINGS ===================================
- not a failure";
        let lines: Vec<String> = text.lines().map(String::from).collect();
        let got = failures_by_operation(&lines);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].0, "GET /v1/accounts");
        assert_eq!(
            got[0].1,
            [
                "ST201 Schema-violating request accepted",
                "ST202 Schema-valid request rejected"
            ]
        );
        assert_eq!(got[1].0, "GET /v1/alerts");
        assert_eq!(got[1].1, ["Server error"]);
    }

    #[test]
    fn database_url() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/postgres", "x").unwrap(),
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(
            with_database("postgresql://u:p@h/d?sslmode=disable", "x").unwrap(),
            "postgresql://u:p@h/x?sslmode=disable"
        );
        assert_eq!(
            with_database("postgres://h:1", "x").unwrap(),
            "postgres://h:1/x"
        );
        assert!(with_database("nonsense", "x").is_err());
    }

    #[test]
    fn redaction() {
        assert_eq!(redact("postgres://u:secret@h/d"), "postgres://u:***@h/d");
        assert_eq!(redact("postgres://u@h/d"), "postgres://u@h/d");
        assert_eq!(redact("sqlite:///tmp/x.db"), "sqlite:///tmp/x.db");
    }

    #[test]
    fn summary() {
        let text = "\
=================================== SUMMARY ====================================

API Operations:
  Selected: 36/38

Failures:
  ❌ ST202 Schema-valid request rejected: 19

Test cases:
  4606 generated, 29 found 29 unique failures, 32 skipped

=============== 29 failures, 1 warning, interrupted after 39.81s ===============";
        let lines: Vec<String> = text.lines().map(String::from).collect();
        assert_eq!(
            summary_lines(&lines),
            [
                "Failures: ❌ ST202 Schema-valid request rejected: 19",
                "test cases: 4606 generated, 29 found 29 unique failures, 32 skipped",
                "29 failures, 1 warning, interrupted after 39.81s",
            ]
        );
    }
}
