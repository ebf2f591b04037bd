use clap::{Parser, Subcommand};
use node_agent::agent::{self, AgentConfig, DEFAULT_STATE_DIR};
use node_agent::fake::{self, FakeSpec, GpuModel};
use node_agent::host::discover;
use node_agent::hypervisor::HypervisorKind;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Passage node agent: PCI discovery, passthrough binding, VM launch and scrubbing.
#[derive(Parser)]
#[command(name = "node-agent", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// One line per PCI function: vendor device subsystem subvendor revision id driver.
    Lspci {
        #[arg(long, default_value = "/sys")]
        sysfs_root: PathBuf,
    },
    /// Writes a sysfs tree a kernel would show for a GPU server.
    FakeSysfs {
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        gpus: u32,
        #[arg(long, value_enum, default_value = "h100")]
        model: GpuModel,
        #[arg(long, default_value_t = 2)]
        numa_nodes: u32,
    },
    /// Registers with the control plane, then heartbeats, reports inventory and runs tasks.
    Run {
        #[arg(long, env = "PASSAGE_SERVER")]
        server: String,
        #[arg(long, env = "PASSAGE_JOIN_TOKEN", hide_env_values = true)]
        join_token: String,
        #[arg(long, default_value = "/sys")]
        sysfs_root: PathBuf,
        #[arg(long, default_value = DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
        #[arg(long, value_enum, default_value = "sim")]
        hypervisor: HypervisorKind,
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
        heartbeat_secs: u64,
        #[arg(long)]
        hostname: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match cli.command {
        Command::Lspci { sysfs_root } => lspci(&sysfs_root),
        Command::FakeSysfs {
            out,
            gpus,
            model,
            numa_nodes,
        } => {
            let spec = FakeSpec {
                gpus,
                model,
                numa_nodes,
            };
            match fake::generate(&out, &spec) {
                Ok(tree) => {
                    eprintln!(
                        "wrote {} PCI functions ({} GPUs) under {}",
                        tree.functions.len(),
                        tree.gpus.len(),
                        out.display()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
        Command::Run {
            server,
            join_token,
            sysfs_root,
            state_dir,
            hypervisor,
            heartbeat_secs,
            hostname,
        } => {
            if hypervisor != HypervisorKind::Sim {
                return fail(&format!(
                    "hypervisor {hypervisor} is not supported yet; use sim"
                ));
            }
            let cfg = AgentConfig {
                server_url: server,
                join_token,
                sysfs_root,
                state_dir,
                hypervisor,
                heartbeat: Duration::from_secs(heartbeat_secs),
                hostname: hostname.unwrap_or_else(agent::system_hostname),
            };
            let rt = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => return fail(&format!("cannot start the async runtime: {e}")),
            };
            match rt.block_on(agent::run(cfg)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
    }
}

fn fail(e: &dyn std::fmt::Display) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::FAILURE
}

fn lspci(root: &std::path::Path) -> ExitCode {
    let found = discover(root);
    let mut out = std::io::stdout().lock();
    for d in &found.devices {
        if writeln!(out, "{}", d.lister_line()).is_err() {
            // A closed pipe (`| head`) is not an error worth reporting.
            return ExitCode::SUCCESS;
        }
    }
    for s in &found.skipped {
        eprintln!("skipped {s}");
    }
    if found.devices.is_empty() && !found.skipped.is_empty() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
