//! `server`: Passage's control plane.

use clap::Parser;
use passage_server::config::Config;
use std::time::Duration;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(
    name = "server",
    version,
    about = "Passage control plane: GPU instances for your own datacenter"
)]
struct Args {
    /// Address to serve HTTP on.
    #[arg(long, env = "PASSAGE_LISTEN", default_value = "127.0.0.1:8080")]
    listen: String,
    /// `sqlite://PATH` or `postgres://…`.
    #[arg(
        long,
        env = "PASSAGE_DATABASE_URL",
        default_value = "sqlite://passage.db"
    )]
    database: String,
    /// A node not heard from for this long is offline and gets no placements.
    #[arg(long, default_value_t = 30)]
    heartbeat_timeout_secs: u64,
    /// Where image files are kept (content-addressed by SHA-256). Default: `images/`
    /// beside the SQLite file, or `./images` on Postgres; replicas sharing a Postgres
    /// database must share this directory too.
    #[arg(long, env = "PASSAGE_IMAGE_DIR")]
    image_dir: Option<std::path::PathBuf>,
    /// The largest image file an upload may bring, in GiB.
    #[arg(long, env = "PASSAGE_IMAGE_MAX_GIB", default_value_t = 64)]
    image_max_gib: u64,
    /// How long a job step waits for a node's answer.
    #[arg(long, default_value_t = 120)]
    task_timeout_secs: u64,
    /// The longest a clean stop waits for a guest to shut down, whatever its package
    /// asks (default 60 s); then the VM is powered off.
    #[arg(long, env = "PASSAGE_STOP_GRACE_MAX_SECS", default_value_t = 300)]
    stop_grace_max_secs: u64,
    /// How long a dirty device may wait before the reconciler scrubs it.
    #[arg(long, default_value_t = 10)]
    scrub_grace_secs: u64,
    /// How long a GPU opened for vGPUs may host none before it is closed and scrubbed
    /// whole again.
    #[arg(long, default_value_t = 600)]
    vgpu_idle_close_secs: u64,
    /// A job whose runner has not renewed its lease for this long is taken over (by
    /// another replica, or by this server after a restart).
    #[arg(long, default_value_t = 30)]
    job_lease_secs: u64,
    /// A login session (portal or `POST /v1/auth/login`) unused for this long ends.
    #[arg(long, default_value_t = 30 * 60)]
    session_idle_secs: u64,
    /// A login session ends this long after sign-in, however busy.
    #[arg(long, default_value_t = 12 * 3600)]
    session_max_secs: u64,
    /// Serve https with this certificate chain (PEM), with --tls-key; SIGHUP reloads
    /// both. Without it the server speaks plain http, for a TLS-terminating proxy in front.
    #[arg(long, env = "PASSAGE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "PASSAGE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// Placement policy for packages that name none: `pack` fills a server before the
    /// next, `spread` puts each VM where the most is free.
    #[arg(long, default_value = "pack", value_parser = ["pack", "spread"])]
    placement: String,
    /// vCPUs a node may give per CPU it reports (1.0: no overcommit).
    #[arg(long, default_value_t = 1.0, value_parser = parse_ratio)]
    cpu_allocation_ratio: f64,
    /// Memory (MiB) of each node kept for its host, never given to VMs. Guest memory is
    /// not overcommitted: passthrough pins all of it.
    #[arg(long, default_value_t = 4096)]
    reserved_host_memory_mib: u64,
    /// Jobs (provision, destroy, scrub…) this server runs at once; more wait their turn
    /// [default: 512 on SQLite, 1024 on Postgres]. Most of a job's time is spent waiting
    /// for its node: at 256, a burst of 10,000 creations on 1,250 simulated nodes left a
    /// third of two CPUs idle, and 512 brought them all to `running` 11–21 % sooner on
    /// SQLite, where 1,024 did no better. On Postgres 1,024 took creations from
    /// 1,571–1,763/s to 2,175–2,178/s with the jobs running (BENCHMARKS.md, twenty-eighth
    /// and thirtieth sessions).
    #[arg(long)]
    job_concurrency: Option<usize>,
    /// Also run this many simulated compute nodes (real agent loop, fake sysfs, `sim`
    /// hypervisor) in this process.
    #[arg(long, default_value_t = 0)]
    sim_servers: u32,
    /// GPUs per simulated node.
    #[arg(long, default_value_t = 8)]
    sim_gpus: u32,
    /// GPU model of the simulated nodes.
    #[arg(long, value_enum, default_value = "h100")]
    sim_model: node_agent::fake::GpuModel,
    /// Where simulated nodes keep their fake trees and state.
    #[arg(long, default_value = "passage-sim")]
    sim_dir: std::path::PathBuf,
}

/// A CPU allocation ratio: a number from 0.1 to 64.
fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.1..=64.0).contains(&r) => Ok(r),
        _ => Err(format!("{s:?} is not a ratio from 0.1 to 64")),
    }
}

/// Rendering a portal page nests many futures; unoptimised builds need more than tokio's
/// default 2 MiB of stack per worker for them. Untouched stack costs no memory.
const WORKER_STACK: usize = 32 * 1024 * 1024;

fn main() -> std::process::ExitCode {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(WORKER_STACK)
        .build()
    {
        Ok(rt) => {
            let code = rt.block_on(serve());
            // Jobs' steps and simulated nodes may still be running: the process is
            // going, they end with it (every step is idempotent and resumes at the
            // next start), so the runtime does not wait on them.
            rt.shutdown_timeout(Duration::from_millis(500));
            code
        }
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn,tower_http=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    match node_agent::host::raise_open_file_limit() {
        Ok(n) => tracing::debug!(limit = n, "open-file limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit"),
    }
    let mut cfg = Config {
        heartbeat_timeout: Duration::from_secs(args.heartbeat_timeout_secs.max(1)),
        task_timeout: Duration::from_secs(args.task_timeout_secs.max(1)),
        image_dir: args.image_dir.clone(),
        image_max_bytes: args.image_max_gib.saturating_mul(1024 * 1024 * 1024),
        scrub_grace: Duration::from_secs(args.scrub_grace_secs),
        stop_grace_max: Duration::from_secs(args.stop_grace_max_secs),
        vgpu_idle_close: Duration::from_secs(args.vgpu_idle_close_secs.max(1)),
        job_lease: Duration::from_secs(args.job_lease_secs.max(1)),
        session_idle: Duration::from_secs(args.session_idle_secs.max(1)),
        tls: match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(passage_server::tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
            }),
            _ => None,
        },
        token_ttl: Duration::from_secs(args.session_max_secs.max(1)),
        placement: passage_server::placement::Policy::parse(&args.placement).unwrap_or_default(),
        job_concurrency: args.job_concurrency.map(|n| n.max(1)),
        alloc: passage_server::store::room::Allocation {
            cpu_ratio: args.cpu_allocation_ratio,
            reserved_memory_mib: args.reserved_host_memory_mib,
        },
        ..Config::default()
    };
    // Test only: make named job steps fail after their action, to exercise every undo.
    if let Ok(f) = std::env::var("PASSAGE_INJECT_FAULTS") {
        cfg.faults = f
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        tracing::warn!(faults = ?cfg.faults, "fault injection is on");
    }
    // Test only: park every job just before this step, to be killed there.
    if let Ok(p) = std::env::var("PASSAGE_PAUSE_BEFORE") {
        tracing::warn!(step = %p, "jobs pause before this step (test hook)");
        cfg.pause_before = Some(p);
    }
    let admin = std::env::var("PASSAGE_ADMIN_PASSWORD")
        .ok()
        .filter(|p| !p.is_empty());
    let running = match passage_server::start(&args.database, &args.listen, cfg, admin).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("server: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    if let Some(pw) = &running.admin_password {
        println!("Created the operator account 'admin' with password: {pw}");
        println!("(shown once; set PASSAGE_ADMIN_PASSWORD to choose it)");
    }
    if args.sim_servers > 0 {
        let spec = passage_server::sim::SimSpec {
            servers: args.sim_servers,
            gpus: args.sim_gpus,
            model: args.sim_model,
            dir: args.sim_dir.clone(),
            ca_cert: args.tls_cert.clone(),
        };
        let base = running.url();
        if let Err(e) = passage_server::sim::start(&running.ctx, &base, &spec).await {
            eprintln!("server: starting simulated nodes: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
        println!(
            "Running {} simulated node(s) with {} {:?} GPU(s) each under {}",
            args.sim_servers,
            args.sim_gpus,
            args.sim_model,
            args.sim_dir.display()
        );
    }
    println!("Passage listening on {}", running.url());
    match running.server.await {
        Ok(Ok(())) => std::process::ExitCode::SUCCESS,
        Ok(Err(e)) => {
            eprintln!("server: {e}");
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("server: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
