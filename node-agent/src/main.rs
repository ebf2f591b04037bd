use clap::{Parser, Subcommand};
use node_agent::agent::{self, AgentConfig, DEFAULT_STATE_DIR};
use node_agent::config::{self, FileConfig};
use node_agent::fake::{self, FakeOptions, FakeSpec, FakeVgpu, GpuModel};
use node_agent::host::{Discoverer, discover};
use node_agent::hypervisor::HypervisorKind;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
        /// Also print each function's details (names, slot, IOMMU group, link, AER).
        #[arg(short, long)]
        verbose: bool,
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
        /// Give each GPU an HDMI audio function `.1` in its IOMMU group.
        #[arg(long)]
        gpu_audio: bool,
        /// CPUs online (default 32 per NUMA node).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
        cpus: Option<u32>,
        /// Memory in MiB over all NUMA nodes (default 256 GiB per node).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=68719476736))]
        memory_mib: Option<u64>,
        /// Make the GPUs vGPU hosts: mdev types (with --model a100) or NVIDIA vendor VFIO
        /// over 32 SR-IOV VFs each (with --model h100); writes a stand-in nvidia-smi too.
        #[arg(long, value_enum)]
        vgpu: Option<FakeVgpu>,
        /// Start those GPUs in MIG mode (MIG-backed vGPU types only).
        #[arg(long, requires = "vgpu")]
        mig: bool,
        /// A Linux bridge the node has, for VMs' networks; repeat it or separate names
        /// with commas (default br0; `--bridge ''` for none).
        #[arg(
            long = "bridge",
            visible_alias = "bridges",
            value_name = "NAME",
            value_delimiter = ','
        )]
        bridges: Option<Vec<String>>,
        /// 2 MiB huge pages reserved (all free) on each NUMA node. Default 0.
        #[arg(long, default_value_t = 0)]
        hugepages_2m: u64,
        /// 1 GiB huge pages reserved (all free) on each NUMA node. Default 0.
        #[arg(long, default_value_t = 0)]
        hugepages_1g: u64,
    },
    /// Times discovery in-process: min, median and p95 over N warm runs.
    #[command(hide = true)]
    BenchDiscovery {
        #[arg(long, default_value = "/sys")]
        sysfs_root: PathBuf,
        #[arg(long, default_value_t = 200)]
        iterations: u32,
    },
    /// Replaces this node's saved credential with a new one from the control plane (the
    /// old one stops working at once). Run it while the agent is stopped, or restart it.
    RotateCredential {
        #[arg(long, default_value = DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
        /// A PEM file of CA certificates to trust for an https:// server.
        #[arg(long, env = "PASSAGE_CA_CERT")]
        ca_cert: Option<PathBuf>,
    },
    /// Registers with the control plane, then heartbeats, reports inventory and runs tasks.
    Run {
        /// A TOML file with any of the settings below; flags override it.
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long, env = "PASSAGE_SERVER")]
        server: Option<String>,
        #[arg(long, env = "PASSAGE_JOIN_TOKEN", hide_env_values = true)]
        join_token: Option<String>,
        /// A file holding the join token (instead of --join-token).
        #[arg(long, conflicts_with = "join_token")]
        join_token_file: Option<PathBuf>,
        /// Default /sys.
        #[arg(long)]
        sysfs_root: Option<PathBuf>,
        /// Default /var/lib/passage-agent.
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Default sim.
        #[arg(long, value_enum)]
        hypervisor: Option<HypervisorKind>,
        /// Default 10.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3600))]
        heartbeat_secs: Option<u64>,
        /// How often a heartbeat also reads the whole inventory again (a change made
        /// behind the agent's back shows within this; tasks report theirs at once).
        /// Default 60.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3600))]
        inventory_secs: Option<u64>,
        #[arg(long)]
        hostname: Option<String>,
        /// A PEM file of CA certificates to trust for an https:// server, besides the
        /// public roots (a datacenter's own CA, or the server's self-signed certificate).
        #[arg(long, env = "PASSAGE_CA_CERT")]
        ca_cert: Option<PathBuf>,
        /// The image cache's budget in GiB. Default 50.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=config::MAX_IMAGE_CACHE_GIB))]
        image_cache_gib: Option<u64>,
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
        Command::Lspci {
            sysfs_root,
            verbose,
        } => lspci(&sysfs_root, verbose),
        Command::BenchDiscovery {
            sysfs_root,
            iterations,
        } => bench_discovery(&sysfs_root, iterations),
        Command::RotateCredential { state_dir, ca_cert } => {
            rotate_credential(&state_dir, ca_cert.as_deref())
        }
        Command::FakeSysfs {
            out,
            gpus,
            model,
            numa_nodes,
            gpu_audio,
            cpus,
            memory_mib,
            vgpu,
            mig,
            bridges,
            hugepages_2m,
            hugepages_1g,
        } => {
            let spec = FakeSpec {
                gpus,
                model,
                numa_nodes,
            };
            match fake::generate_with(
                &out,
                &spec,
                &FakeOptions {
                    gpu_audio,
                    cpus,
                    memory_mib,
                    vgpu,
                    mig,
                    bridges: match bridges {
                        Some(b) => b.into_iter().filter(|b| !b.is_empty()).collect(),
                        None => vec![fake::FAKE_BRIDGE.to_string()],
                    },
                    hugepages_per_node: (hugepages_2m, hugepages_1g),
                },
            ) {
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
            config,
            server,
            join_token,
            join_token_file,
            sysfs_root,
            state_dir,
            hypervisor,
            heartbeat_secs,
            inventory_secs,
            hostname,
            ca_cert,
            image_cache_gib,
        } => {
            // Discovery keeps sysfs attributes open between passes, within a share of
            // this limit.
            if let Err(e) = node_agent::host::raise_open_file_limit() {
                tracing::warn!(error = %e, "cannot raise the open-file limit");
            }
            let file = match config.as_deref().map(FileConfig::load).transpose() {
                Ok(f) => f.unwrap_or_default(),
                Err(e) => return fail(&e),
            };
            let scrub = file.scrub_overrides();
            let qemu = file.qemu_options();
            let Some(server_url) = server.or(file.server) else {
                return fail(
                    &"no server URL: give --server, PASSAGE_SERVER or `server` in --config",
                );
            };
            let sysfs_root = sysfs_root
                .or(file.sysfs_root)
                .unwrap_or_else(|| PathBuf::from("/sys"));
            let state_dir = state_dir
                .or(file.state_dir)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR));
            if let Err(e) = config::preflight(&sysfs_root, &state_dir) {
                return fail(&e);
            }
            // The token only matters until the node has registered; a node with a saved
            // credential starts without one.
            let token_file = join_token_file.or(file.join_token_file);
            let join_token = match (join_token, token_file) {
                (Some(t), _) => t,
                (None, Some(p)) => match config::read_token_file(&p) {
                    Ok(t) => t,
                    Err(e) => return fail(&e),
                },
                (None, None) => {
                    if !agent::credential::credential_path(&state_dir).exists() {
                        return fail(&format!(
                            "no join token and no saved credential in {}: give --join-token, \
                             PASSAGE_JOIN_TOKEN, --join-token-file or `join_token_file` in --config",
                            state_dir.display()
                        ));
                    }
                    String::new()
                }
            };
            let cfg = AgentConfig {
                server_url,
                join_token,
                sysfs_root,
                state_dir,
                hypervisor: hypervisor
                    .or(file.hypervisor)
                    .unwrap_or(HypervisorKind::Sim),
                heartbeat: Duration::from_secs(
                    heartbeat_secs.or(file.heartbeat_secs).unwrap_or(10),
                ),
                inventory_every: Duration::from_secs(
                    inventory_secs.or(file.inventory_secs).unwrap_or(60),
                ),
                hostname: hostname
                    .or(file.hostname)
                    .unwrap_or_else(agent::system_hostname),
                ca_cert: ca_cert.or(file.ca_cert),
            };
            let rt = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => return fail(&format!("cannot start the async runtime: {e}")),
            };
            let opts = agent::RunOptions {
                scrub,
                image_cache_gib: image_cache_gib
                    .or(file.image_cache_gib)
                    .unwrap_or(node_agent::images::DEFAULT_CACHE_GIB),
                qemu,
            };
            match rt.block_on(agent::run_with(cfg, opts)) {
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

fn lspci(root: &std::path::Path, verbose: bool) -> ExitCode {
    let found = discover(root);
    let mut out = std::io::stdout().lock();
    for d in &found.devices {
        let mut text = format!("{}\n", d.lister_line());
        if verbose {
            // The regions first, in the words of pciutils' `lspci -vv` (which names each
            // region's index, as `-v` does not); no `[disabled]` or `[virtual]`, which
            // come from config space, never read here.
            for b in d.details.iter().flat_map(|x| &x.bars) {
                if b.index < passage_model::pci::ROM_BAR_INDEX {
                    text.push_str(&format!("\tRegion {}: {}\n", b.index, b.pciutils_text()));
                }
            }
            // Then indented `key: value` lines, as pciutils' -v does.
            for (k, v) in d.details.iter().flat_map(|x| x.lines()) {
                if k != "bars" {
                    text.push_str(&format!("\t{k}: {v}\n"));
                }
            }
            text.push('\n');
        }
        if out.write_all(text.as_bytes()).is_err() {
            // A closed pipe (`| head`) is not an error worth reporting.
            return ExitCode::SUCCESS;
        }
    }
    for s in &found.skipped {
        eprintln!("skipped {s}");
    }
    if verbose {
        for s in &found.notes {
            eprintln!("note: {s}");
        }
    }
    if found.devices.is_empty() && !found.skipped.is_empty() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// `bench-discovery`: passes of discovery in this process, so the figures measure the
/// walk, not process start-up. `cold` passes start from nothing each time (what
/// `node-agent lspci` does); `warm` passes reuse one [`Discoverer`], as the agent does.
/// Prints one `key value` line per figure.
fn bench_discovery(root: &std::path::Path, iterations: u32) -> ExitCode {
    let iterations = iterations.max(1);
    let first = discover(root);
    if first.devices.is_empty() {
        return fail(&format!("no PCI functions under {}", root.display()));
    }
    println!("functions {}", first.devices.len());
    println!("iterations {iterations}");
    let warm = Discoverer::new();
    std::hint::black_box(warm.discover(root));
    for (name, disc) in [("cold", None), ("warm", Some(&warm))] {
        let mut times: Vec<Duration> = (0..iterations)
            .map(|_| {
                let t = std::time::Instant::now();
                let d = match disc {
                    Some(w) => w.discover(root),
                    None => discover(root),
                };
                let took = t.elapsed();
                std::hint::black_box(d);
                took
            })
            .collect();
        times.sort();
        let pick = |q: f64| {
            let i = ((times.len() as f64 - 1.0) * q).round() as usize;
            times.get(i).copied().unwrap_or_default()
        };
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!("{name}_min_us {:.0}", us(pick(0.0)));
        println!("{name}_median_us {:.0}", us(pick(0.5)));
        println!("{name}_p95_us {:.0}", us(pick(0.95)));
    }
    ExitCode::SUCCESS
}

fn rotate_credential(state_dir: &std::path::Path, ca_cert: Option<&std::path::Path>) -> ExitCode {
    let saved = match agent::credential::load(state_dir) {
        Ok(Some(c)) => c,
        Ok(None) => {
            return fail(&format!(
                "no saved credential in {}: this node has not registered",
                state_dir.display()
            ));
        }
        Err(e) => {
            return fail(&format!(
                "reading the credential in {}: {e}",
                state_dir.display()
            ));
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(&e),
    };
    let answer = rt.block_on(async {
        agent::client::AgentClient::with_ca(&saved.server_url, ca_cert)
            .map(|c| c.with_credential(saved.credential.clone()))?
            .rotate_credential()
            .await
    });
    match answer {
        Ok(r) => {
            let next = agent::credential::Credential {
                server_url: saved.server_url.clone(),
                server_uuid: r.server_uuid,
                credential: r.credential,
            };
            if let Err(e) = agent::credential::save(state_dir, &next) {
                // The old credential is already dead: say so plainly.
                return fail(&format!(
                    "the server rotated the credential but it could not be saved in {}: {e}; \
                     re-admit this node with a join token made for server {}",
                    state_dir.display(),
                    r.server_uuid
                ));
            }
            println!("credential rotated for server {}", r.server_uuid);
            ExitCode::SUCCESS
        }
        Err(e) => fail(&format!("rotating the credential: {e}")),
    }
}
