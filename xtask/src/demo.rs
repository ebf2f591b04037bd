//! `cargo xtask demo`: a local control plane with simulated GPU nodes, until Ctrl-C.

use crate::http::{Client, Response, truncate};
use crate::util::{self, cargo, repo_root, tcp_answers};
use anyhow::{Context, Result, anyhow, bail};
use serde_json::json;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const DEMO_DIR: &str = ".passage-demo";
const PING_WAIT: Duration = Duration::from_secs(30);
const NODES_WAIT: Duration = Duration::from_secs(30);

/// `cargo xtask demo`: a local control plane with simulated GPU nodes.
#[derive(clap::Args)]
pub struct Args {
    /// Compute nodes to start (at most 64)
    #[arg(long, value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(..=64))]
    servers: u32,
    /// GPUs per node
    #[arg(long, value_name = "G", default_value_t = 8)]
    gpus: u32,
    /// GPU model the fake nodes carry
    #[arg(long, value_name = "M", value_enum, ignore_case = true, default_value_t = Model::H100)]
    model: Model,
    /// HTTP port on 127.0.0.1
    #[arg(long, value_name = "P", default_value_t = 8080)]
    port: u16,
    /// Delete .passage-demo/ first (new database, new password)
    #[arg(long)]
    reset: bool,
    /// Make the GPUs vGPU hosts: `mdev` (with --model a100) or `vfio` (with --model h100)
    #[arg(long, value_name = "F", value_parser = ["mdev", "vfio"])]
    vgpu: Option<String>,
}

/// The models `node-agent fake-sysfs` can fake.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Model {
    #[value(name = "v100")]
    V100,
    #[value(name = "a100")]
    A100,
    #[value(name = "h100")]
    H100,
    #[value(name = "l40s")]
    L40s,
}

impl Model {
    /// The name `node-agent fake-sysfs --model` takes.
    fn name(self) -> &'static str {
        match self {
            Model::V100 => "v100",
            Model::A100 => "a100",
            Model::H100 => "h100",
            Model::L40s => "l40s",
        }
    }

    /// `(vendor, device)` of the model's GPU.
    fn ids(self) -> (&'static str, &'static str) {
        match self {
            Model::V100 => ("10de", "1db4"),
            Model::A100 => ("10de", "20b0"),
            Model::H100 => ("10de", "2330"),
            Model::L40s => ("10de", "26b9"),
        }
    }
}

/// Children killed (and reaped) when dropped, whatever way we leave.
#[derive(Default)]
struct Children {
    list: Vec<(String, Child, PathBuf)>,
}

impl Children {
    /// A child that exited on its own, with its status and log.
    fn exited(&mut self) -> Option<(String, String, PathBuf)> {
        for (name, child, log) in &mut self.list {
            if let Ok(Some(status)) = child.try_wait() {
                return Some((name.clone(), status.to_string(), log.clone()));
            }
        }
        None
    }
}

impl Drop for Children {
    /// SIGTERM first (the server and the agents shut down gracefully on it), SIGKILL for
    /// whatever is still there after a few seconds.
    fn drop(&mut self) {
        for (_, child, _) in self.list.iter_mut().rev() {
            if let Ok(None) = child.try_wait() {
                let _ = Command::new("kill")
                    .args(["-TERM", &child.id().to_string()])
                    .stderr(Stdio::null())
                    .status();
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for (_, child, _) in &mut self.list {
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub fn run(opts: &Args) -> Result<()> {
    let (vendor, device) = opts.model.ids();
    let variant = format!("NVIDIA_{}", opts.model.name().to_ascii_uppercase());

    // Ctrl-C, `kill` and a closed terminal all end the demo the same orderly way.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .context("cannot install a signal handler")?;
    }

    let root = repo_root();
    let addr = format!("127.0.0.1:{}", opts.port);
    if tcp_answers(&addr, Duration::from_millis(300)) {
        bail!("something already listens on {addr} (an earlier demo?); stop it or pick --port");
    }

    println!("==> building the binaries");
    util::run_checked(cargo().args(["build", "--workspace", "--bins"]))?;
    crate::site::build()?;
    let bin_dir = util::target_dir()?.join("debug");
    let server_bin = bin_dir.join("server");
    let agent_bin = bin_dir.join("node-agent");
    for b in [&server_bin, &agent_bin] {
        if !b.is_file() {
            bail!("{} was not built", b.display());
        }
    }

    let dir = root.join(DEMO_DIR);
    if opts.reset && dir.exists() {
        println!("==> --reset: removing {DEMO_DIR}/");
        std::fs::remove_dir_all(&dir)
            .with_context(|| format!("cannot remove {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let db = dir.join("passage.db");
    let pw_file = dir.join("admin-password");
    let fresh = !db.exists();
    let password = if fresh {
        // A new database: node credentials from an older one would be refused.
        for k in 1..=256 {
            let state = dir.join(format!("node-{k}")).join("state");
            if state.exists() {
                std::fs::remove_dir_all(&state)
                    .with_context(|| format!("cannot remove {}", state.display()))?;
            }
        }
        let pw = random_password()?;
        write_secret(&pw_file, &pw)?;
        pw
    } else {
        std::fs::read_to_string(&pw_file)
            .map(|s| s.trim().to_string())
            .ok()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| {
                anyhow!(
                    "{} exists but {} does not; rerun with --reset to start over",
                    db.display(),
                    pw_file.display()
                )
            })?
    };

    let mut children = Children::default();
    println!("==> starting the server on http://{addr}");
    let server_log = dir.join("server.log");
    let mut cmd = Command::new(&server_bin);
    cmd.current_dir(&root)
        .args(["--listen", &addr, "--database"])
        .arg(format!("sqlite://{DEMO_DIR}/passage.db"))
        .env("PASSAGE_ADMIN_PASSWORD", &password)
        .env_remove("PASSAGE_LISTEN")
        .env_remove("PASSAGE_DATABASE_URL");
    spawn(&mut children, "server", cmd, &server_log)?;

    let mut api = Client::new(&addr);
    wait_for_ping(&api, &mut children, &stop, &server_log)?;

    let login = api.post(
        "/v1/auth/login",
        Some(&json!({"login": "admin", "password": password})),
    )?;
    if login.status == 401 {
        bail!(
            "the password in {} does not open the demo database; rerun with --reset",
            pw_file.display()
        );
    }
    let token = expect(&login, 200, "log in as admin")?["token"]
        .as_str()
        .ok_or_else(|| anyhow!("login answer has no token"))?
        .to_string();
    api.set_token(&token);

    // The variant and the package: 409 means an earlier run made them.
    let r = api.post(
        "/v1/variants",
        Some(&json!({"name": variant, "type": "gpu", "vendor": vendor, "device": device})),
    )?;
    created_or_exists(&r, &format!("variant {variant}"))?;
    let r = api.post(
        "/v1/packages",
        Some(&json!({
            "name": "gpu-1x", "vcpus": 8, "memory_mib": 65536, "disk_gib": 100,
            "devices": {variant.as_str(): 1}
        })),
    )?;
    created_or_exists(&r, "package gpu-1x")?;
    seed_image(&api, "demo")?;

    for k in 1..=opts.servers {
        let node = dir.join(format!("node-{k}"));
        let sysfs = node.join("sysfs");
        if !sysfs.exists() {
            util::run_checked(
                Command::new(&agent_bin)
                    .args(["fake-sysfs", "--out"])
                    .arg(&sysfs)
                    .args([
                        "--gpus",
                        &opts.gpus.to_string(),
                        "--model",
                        opts.model.name(),
                    ])
                    .args(opts.vgpu.iter().flat_map(|f| ["--vgpu", f.as_str()])),
            )?;
        } else {
            println!(
                "reusing {} (delete it, or --reset, for new hardware)",
                sysfs.display()
            );
        }
        let r = api.post("/v1/servers/join-tokens", None)?;
        let join = expect(&r, 201, "create a join token")?["token"]
            .as_str()
            .ok_or_else(|| anyhow!("join-token answer has no token"))?
            .to_string();
        let mut cmd = Command::new(&agent_bin);
        cmd.current_dir(&root)
            .args(["run", "--server", &format!("http://{addr}")])
            .args(["--join-token", &join, "--sysfs-root"])
            .arg(&sysfs)
            .arg("--state-dir")
            .arg(node.join("state"))
            .args([
                "--hypervisor",
                "sim",
                "--hostname",
                &format!("demo-node-{k}"),
            ])
            .env_remove("PASSAGE_SERVER")
            .env_remove("PASSAGE_JOIN_TOKEN");
        spawn(
            &mut children,
            &format!("node-agent demo-node-{k}"),
            cmd,
            &dir.join(format!("node-{k}.log")),
        )?;
    }

    wait_for_nodes(&api, &mut children, &stop, opts.servers)?;

    let url = format!("http://{addr}");
    println!();
    println!("Passage demo is running at {url} (the portal; the API is under {url}/v1)");
    println!("  operator login: admin");
    println!("  password:       {password}");
    if !fresh {
        println!(
            "  (the password printed when {DEMO_DIR}/ was first made; kept in {DEMO_DIR}/admin-password)"
        );
    }
    println!("  logs:           {DEMO_DIR}/server.log, {DEMO_DIR}/node-K.log");
    println!();
    println!("Try:");
    println!(
        "  TOKEN=$(curl -s {url}/v1/auth/login -H 'content-type: application/json' \\\n    \
         -d '{{\"login\":\"admin\",\"password\":\"{password}\"}}' | sed 's/.*\"token\":\"\\([^\"]*\\)\".*/\\1/')"
    );
    println!("  curl -s {url}/v1/servers -H \"Authorization: Bearer $TOKEN\"");
    println!("  curl -s {url}/v1/packages -H \"Authorization: Bearer $TOKEN\"");
    println!(
        "  curl -s {url}/v1/vms -H \"Authorization: Bearer $TOKEN\" -H 'content-type: application/json' \\\n    \
         -d '{{\"alias\":\"my-vm\",\"package\":\"gpu-1x\",\"image\":\"demo\"}}'"
    );
    println!("  curl -s {url}/v1/vms -H \"Authorization: Bearer $TOKEN\"");
    println!();
    println!("Press Ctrl-C to stop.");

    while !stop.load(Ordering::Relaxed) {
        if let Some((name, status, log)) = children.exited() {
            // Ctrl-C reaches the children too; they may go before we see the flag.
            std::thread::sleep(Duration::from_millis(300));
            if stop.load(Ordering::Relaxed) {
                break;
            }
            bail!(
                "{name} exited ({status}); see {}:\n{}",
                log.display(),
                log_tail(&log)
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    println!("\nstopping the demo");
    drop(children);
    Ok(())
}

fn spawn(children: &mut Children, name: &str, mut cmd: Command, log: &Path) -> Result<()> {
    let out = File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
    let err = out.try_clone()?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .with_context(|| format!("cannot start {name} ({})", util::show(&cmd)))?;
    children
        .list
        .push((name.to_string(), child, log.to_path_buf()));
    Ok(())
}

fn wait_for_ping(
    api: &Client,
    children: &mut Children,
    stop: &AtomicBool,
    log: &Path,
) -> Result<()> {
    let start = Instant::now();
    loop {
        if stop.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        if let Some((name, status, log)) = children.exited() {
            bail!(
                "{name} exited ({status}) before answering; see {}:\n{}",
                log.display(),
                log_tail(&log)
            );
        }
        if let Ok(r) = api.get("/v1/ping")
            && r.status == 200
        {
            return Ok(());
        }
        if start.elapsed() > PING_WAIT {
            bail!(
                "server did not answer /v1/ping within {} s; see {}",
                PING_WAIT.as_secs(),
                display_rel(log)
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Waits until `demo-node-1..=n` are all listed as running, then prints them.
fn wait_for_nodes(api: &Client, children: &mut Children, stop: &AtomicBool, n: u32) -> Result<()> {
    let start = Instant::now();
    let wanted: Vec<String> = (1..=n).map(|k| format!("demo-node-{k}")).collect();
    loop {
        if stop.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        if let Some((name, status, log)) = children.exited() {
            bail!(
                "{name} exited ({status}); see {}:\n{}",
                log.display(),
                log_tail(&log)
            );
        }
        let r = api.get("/v1/servers?limit=1000")?;
        let list = expect(&r, 200, "list servers")?;
        let servers = list.as_array().cloned().unwrap_or_default();
        let running = |host: &str| {
            servers.iter().any(|s| {
                s["hostname"].as_str() == Some(host) && s["status"].as_str() == Some("running")
            })
        };
        let all = wanted.iter().all(|h| running(h));
        if all || start.elapsed() > NODES_WAIT {
            println!("==> servers");
            for s in &servers {
                let devices = s["assignable_devices"].as_array().map_or(0, Vec::len);
                println!(
                    "  {}  {:<14} {:<8} {} assignable device(s)",
                    s["uuid"].as_str().unwrap_or("?"),
                    s["hostname"].as_str().unwrap_or("?"),
                    s["status"].as_str().unwrap_or("?"),
                    devices
                );
            }
            if !all {
                let missing: Vec<&str> = wanted
                    .iter()
                    .filter(|h| !running(h))
                    .map(String::as_str)
                    .collect();
                println!(
                    "warning: not running after {} s: {} (see {DEMO_DIR}/node-K.log)",
                    NODES_WAIT.as_secs(),
                    missing.join(", ")
                );
            }
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The JSON body of `r` if it has the `want` status, else an error naming `what`.
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

fn created_or_exists(r: &Response, what: &str) -> Result<()> {
    match r.status {
        200 | 201 => println!("created {what}"),
        409 => println!("{what} exists already"),
        s => bail!(
            "could not create {what}: HTTP {s} {}",
            truncate(&r.text(), 300)
        ),
    }
    Ok(())
}

/// 24 characters from [A-Za-z0-9] out of /dev/urandom (about 142 bits).
fn random_password() -> Result<String> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut f = File::open("/dev/urandom").context("cannot open /dev/urandom")?;
    let mut out = String::new();
    let mut buf = [0u8; 64];
    while out.len() < 24 {
        f.read_exact(&mut buf)?;
        // 248 = 4 * 62: dropping bytes above it keeps every character equally likely.
        for b in buf.iter().filter(|&&b| b < 248) {
            if out.len() < 24 {
                out.push(char::from(ALPHABET[usize::from(*b) % ALPHABET.len()]));
            }
        }
    }
    Ok(out)
}

/// Writes a secret readable by its owner only.
fn write_secret(path: &Path, secret: &str) -> Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    // `mode` applies only on creation; an older file may have looser bits.
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    writeln!(f, "{secret}")?;
    Ok(())
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

fn display_rel(p: &Path) -> String {
    p.strip_prefix(repo_root())
        .unwrap_or(p)
        .display()
        .to_string()
}

/// An image VMs may boot: `name` version 1, a small raw disk (simulated nodes boot
/// anything). Made once; a later run finds it active.
pub(crate) fn seed_image(api: &Client, name: &str) -> Result<()> {
    let have = expect(
        &api.get(&format!("/v1/images?name={name}&state=active"))?,
        200,
        "list images",
    )?;
    if have.as_array().is_some_and(|a| !a.is_empty()) {
        return Ok(());
    }
    let create = |version: &str| {
        api.post(
            "/v1/images",
            Some(
                &json!({"name": name, "version": version, "os": "linux", "type": "raw",
                         "public": true, "description": "A blank raw disk"}),
            ),
        )
    };
    let mut r = create("1")?;
    if r.status == 409 {
        // Version 1 exists but is not active (deleted while VMs use it, or never
        // uploaded): a newer version, which `name` alone then names.
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(2);
        r = create(&secs.to_string())?;
    }
    let uuid = expect(&r, 201, "create the image")?["uuid"]
        .as_str()
        .ok_or_else(|| anyhow!("the image has no uuid"))?
        .to_string();
    let r = api.put_bytes(&format!("/v1/images/{uuid}/file"), &vec![0u8; 1 << 20])?;
    expect(&r, 200, "upload the image")?;
    Ok(())
}
