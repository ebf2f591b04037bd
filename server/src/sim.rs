//! `--sim-servers N`: compute nodes simulated inside the server process. Each is the real
//! agent loop over a fake sysfs tree with the `sim` hypervisor, talking the real agent
//! protocol over loopback: RFD 114's "fake GPUs" for demos, tests and benchmarks.

use crate::services::Ctx;
use crate::services::auth::{JOIN_TOKEN_PREFIX, new_secret, sha256_hex};
use crate::store::servers;
use node_agent::agent::{AgentConfig, credential};
use node_agent::fake::{FakeSpec, GpuModel};
use node_agent::hypervisor::HypervisorKind;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct SimSpec {
    pub servers: u32,
    pub gpus: u32,
    pub model: GpuModel,
    /// Where the nodes keep their trees and state; kept across restarts so a node keeps
    /// its identity.
    pub dir: PathBuf,
    /// Trusted by the nodes when the server speaks https (its own certificate file).
    pub ca_cert: Option<PathBuf>,
}

/// Nice value of the simulated nodes' threads: above the server's (0), so that the
/// server's own work (answering the API, running jobs) gets the CPU first.
const SIM_NICE: i32 = 10;

/// Threads for the simulated nodes' blocking work at most.
const SIM_BLOCKING_THREADS: usize = 16;

/// The runtime the simulated nodes run on, apart from the server's. A simulated node
/// stands for a machine of its own; in one process with the server, a thousand of them
/// polling and answering tasks on the server's runtime took the CPU the API needed, and
/// tokio has no priorities. On threads of their own, at a lower priority
/// ([`SIM_NICE`]), they get what the server leaves. Made once, kept for the process.
fn sim_runtime() -> anyhow::Result<&'static tokio::runtime::Runtime> {
    static RT: std::sync::Mutex<Option<&'static tokio::runtime::Runtime>> =
        std::sync::Mutex::new(None);
    let mut made = RT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(rt) = *made {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("sim-node")
        // Their blocking work is short (a simulated node's sysfs writes and state files):
        // a few threads serve a thousand nodes, where tokio's default of 512 would each
        // keep an allocator heap of its own.
        .max_blocking_threads(SIM_BLOCKING_THREADS)
        .on_thread_start(|| {
            // On Linux a nice value belongs to the thread that sets it.
            if let Err(e) = rustix::process::setpriority_process(None, SIM_NICE) {
                tracing::debug!(error = %e, "could not lower a simulated node thread's priority");
            }
        })
        .build()?;
    // Never dropped: a runtime may not be dropped from async code, and the nodes run
    // until the process ends.
    let rt: &'static tokio::runtime::Runtime = Box::leak(Box::new(rt));
    *made = Some(rt);
    Ok(rt)
}

/// Starts the simulated nodes; they register (or reconnect) on their own.
pub async fn start(ctx: &Ctx, base_url: &str, spec: &SimSpec) -> anyhow::Result<()> {
    let rt = sim_runtime()?;
    generate_trees(spec).await?;
    for i in 0..spec.servers {
        let node_dir = spec.dir.join(format!("node-{i}"));
        let sysfs = node_dir.join("sysfs");
        let state = node_dir.join("state");
        adopt(ctx, &state, base_url).await?;
        let token = new_secret(JOIN_TOKEN_PREFIX);
        let expires = crate::store::now_ms() + 3_600_000;
        servers::insert_join_token(&ctx.db, &sha256_hex(&token), "sim", expires).await?;
        let cfg = AgentConfig {
            server_url: base_url.to_string(),
            join_token: token,
            sysfs_root: sysfs,
            state_dir: state.clone(),
            hypervisor: HypervisorKind::Sim,
            // As a real agent does by default.
            heartbeat: Duration::from_secs(10),
            inventory_every: Duration::from_secs(60),
            hostname: format!("sim-{i}"),
            ca_cert: spec.ca_cert.clone(),
        };
        rt.spawn(async move {
            if let Err(e) = node_agent::agent::run(cfg).await {
                tracing::error!(node = i, error = %e, "simulated node stopped");
            }
        });
    }
    Ok(())
}

/// Writes the fake sysfs tree of every node that has none yet, on as many threads as the
/// machine has CPUs: a tree is about a thousand files and links, so a fleet of a thousand
/// nodes is a million, and one thread writing them kept the fleet from starting for
/// minutes. A tree is written under a temporary name and renamed when whole, so a start
/// cut short leaves no half tree that a later start would take for a node's.
async fn generate_trees(spec: &SimSpec) -> anyhow::Result<()> {
    let missing: Vec<PathBuf> = (0..spec.servers)
        .map(|i| spec.dir.join(format!("node-{i}")))
        .filter(|d| !d.join("sysfs").exists())
        .collect();
    // Trees kept from an older build lack the zeroing helper's stand-in, without which
    // their GPUs could never be scrubbed clean.
    let kept: Vec<PathBuf> = (0..spec.servers)
        .map(|i| spec.dir.join(format!("node-{i}")).join("sysfs"))
        .collect();
    tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        for tree in kept.iter().filter(|t| t.is_dir()) {
            node_agent::fake::ensure_gpu_zero(tree)?;
        }
        Ok(())
    })
    .await??;
    if missing.is_empty() {
        return Ok(());
    }
    let started = std::time::Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let fake = FakeSpec {
        gpus: spec.gpus,
        model: spec.model,
        numa_nodes: 2,
    };
    let count = missing.len();
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let missing = std::sync::Arc::new(missing);
    let mut workers = Vec::new();
    for _ in 0..threads.min(count) {
        let (next, missing) = (next.clone(), missing.clone());
        workers.push(tokio::task::spawn_blocking(
            move || -> anyhow::Result<()> {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(node) = missing.get(i) else {
                        return Ok(());
                    };
                    let partial = node.join("sysfs.partial");
                    if partial.exists() {
                        std::fs::remove_dir_all(&partial)?;
                    }
                    node_agent::fake::generate(&partial, &fake)?;
                    std::fs::rename(&partial, node.join("sysfs"))?;
                }
            },
        ));
    }
    for w in workers {
        w.await??;
    }
    tracing::info!(
        nodes = count,
        threads,
        secs = started.elapsed().as_secs_f64(),
        "simulated nodes' sysfs trees written"
    );
    Ok(())
}

/// A simulated node belongs to this server wherever it listens now: its saved credential
/// is pointed at the current address. The server minted that credential itself, so when
/// its database does not know it (a fresh database beside an old `--sim-dir`), the node
/// forgets it and joins again with the token it is given, instead of being refused.
async fn adopt(ctx: &Ctx, state: &Path, base_url: &str) -> anyhow::Result<()> {
    let Some(mut c) = credential::load(state)? else {
        return Ok(());
    };
    let known = servers::by_credential(&ctx.db, &sha256_hex(&c.credential)).await?;
    if known != Some(c.server_uuid) {
        tracing::info!(
            server = %c.server_uuid,
            dir = %state.display(),
            "a simulated node's credential is unknown to this database: it joins again"
        );
        credential::remove(state)?;
        return Ok(());
    }
    if c.server_url != base_url {
        c.server_url = base_url.to_string();
        credential::save(state, &c)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn trees_are_written_whole_and_a_half_tree_is_written_again() {
        let dir = tempfile::tempdir().unwrap();
        let spec = SimSpec {
            servers: 3,
            gpus: 1,
            model: GpuModel::H100,
            dir: dir.path().to_path_buf(),
            ca_cert: None,
        };
        // A start cut short in node-1's tree.
        let half = dir.path().join("node-1/sysfs.partial");
        std::fs::create_dir_all(&half).unwrap();
        std::fs::write(half.join("junk"), "x").unwrap();
        generate_trees(&spec).await.unwrap();
        for i in 0..3 {
            let node = dir.path().join(format!("node-{i}"));
            let found = node_agent::host::discover(&node.join("sysfs")).devices;
            assert!(!found.is_empty(), "node-{i} has its functions");
            assert!(!node.join("sysfs.partial").exists());
        }
        assert!(!dir.path().join("node-1/sysfs/junk").exists());
        // A tree already there is kept.
        let kept = dir.path().join("node-0/sysfs/kept");
        std::fs::write(&kept, "x").unwrap();
        generate_trees(&spec).await.unwrap();
        assert!(kept.exists());
    }
}
