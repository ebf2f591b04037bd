//! The agent loop: register once, then report inventory, heartbeat and run tasks until
//! stopped. Transient failures (network, 5xx) are retried with capped backoff and never
//! end the agent; a rejected join token or credential does.

pub mod client;
pub mod console;
pub mod credential;
pub mod tasks;

pub use client::{AgentClient, ClientError};
pub use credential::Credential;
pub use tasks::Executor;

use crate::host::{Binder, Discoverer, open_sysfs};
use crate::hypervisor::{self, HypervisorKind};
use crate::scrub::{ScrubEnv, ScrubOverrides};
use passage_model::TaskId;
use passage_model::protocol::{
    Heartbeat, InventoryReport, MAX_INVENTORY_DEVICES, MAX_RESULTS_PER_POST, MAX_TASK_DEVICES,
    PROTOCOL_VERSION, RegisterRequest, Task, TaskEnvelope, TaskOutcome, TaskProgress, TaskResult,
    TaskResults, VmSpec,
};
use passage_model::{PciAddress, PciDevice};
use std::collections::HashSet;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, watch};
use tracing::{debug, error, info, warn};

/// One discovery pass, as it would be reported.
struct Discovered {
    report: InventoryReport,
    skipped: usize,
    /// Functions left out, attributes ignored and interfaces unreadable, for the debug log.
    notes: Vec<String>,
}

/// Functions a task changed: sent with its result; `after` is remembered as the last
/// report once the server has them, if `before` is still the last one.
struct Changes {
    devices: Vec<PciDevice>,
    before: Arc<InventoryReport>,
    after: Arc<InventoryReport>,
}

pub const DEFAULT_STATE_DIR: &str = "/var/lib/passage-agent";
const LONG_POLL: Duration = Duration::from_secs(30);
/// How long the answer to results that bring changed functions waits for the next tasks
/// ([`LONG_POLL`] for the others): long enough for a destroy's scrub, which follows its
/// result at once.
const CHANGES_WAIT: Duration = Duration::from_secs(1);
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Progress posts of a long task: a few a second at most.
const PROGRESS_EVERY: Duration = Duration::from_millis(300);

#[derive(Clone)]
pub struct AgentConfig {
    pub server_url: String,
    pub join_token: String,
    pub sysfs_root: PathBuf,
    pub state_dir: PathBuf,
    pub hypervisor: HypervisorKind,
    pub heartbeat: Duration,
    /// How often a heartbeat also reads the whole inventory again when nothing asked for
    /// it sooner: a function changed behind the agent's back (an operator's driver bind,
    /// a device gone) shows within this. Tasks send the functions they change at once.
    pub inventory_every: Duration,
    pub hostname: String,
    /// A PEM bundle of CA certificates to trust for an `https://` server, besides the
    /// public roots.
    pub ca_cert: Option<PathBuf>,
}

// The join token admits a node: it never reaches a log through `{:?}`.
impl std::fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConfig")
            .field("server_url", &self.server_url)
            .field("join_token", &"<redacted>")
            .field("sysfs_root", &self.sysfs_root)
            .field("state_dir", &self.state_dir)
            .field("hypervisor", &self.hypervisor)
            .field("heartbeat", &self.heartbeat)
            .field("hostname", &self.hostname)
            .field("ca_cert", &self.ca_cert)
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the server refused the join token ({0}); ask an operator for a new one")]
    BadJoinToken(String),
    #[error(
        "the server refused this node's credential ({0}); remove {1} and register again with a new join token"
    )]
    CredentialRejected(String, PathBuf),
    #[error(
        "{path} holds a credential for {saved}, not {requested}; remove it to join another control plane"
    )]
    OtherServer {
        path: PathBuf,
        saved: String,
        requested: String,
    },
    #[error("registration failed: {0}")]
    Register(ClientError),
    #[error("{0}")]
    Setup(String),
}

/// The hostname the kernel knows, without a dependency on libc.
pub fn system_hostname() -> String {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .map(|s| s.trim().to_string())
        .find(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// Retries `f` while its error is transient, doubling the wait up to [`MAX_BACKOFF`].
pub async fn with_retry<T, F, Fut>(what: &str, mut f: F) -> Result<T, ClientError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ClientError>>,
{
    let mut delay = FIRST_BACKOFF;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if e.is_transient() => {
                warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "{what} failed; retrying");
                tokio::time::sleep(jitter(delay)).await;
                delay = (delay * 2).min(MAX_BACKOFF);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Up to a quarter more, so a fleet that lost its server does not come back in lockstep.
fn jitter(d: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.subsec_nanos())
        .unwrap_or(0);
    d + d.mul_f64(f64::from(nanos % 1000) / 4000.0)
}

fn blocking_err(e: tokio::task::JoinError) -> AgentError {
    AgentError::Setup(format!("background work failed: {e}"))
}

/// Loads the saved credential, or registers with the join token and saves one.
pub async fn ensure_credential(cfg: &AgentConfig) -> Result<Credential, AgentError> {
    let dir = cfg.state_dir.clone();
    let saved = tokio::task::spawn_blocking(move || credential::load(&dir))
        .await
        .map_err(blocking_err)?
        .map_err(|e| AgentError::Setup(format!("reading the saved credential: {e}")))?;
    let requested = cfg.server_url.trim_end_matches('/').to_string();
    if let Some(c) = saved {
        if c.server_url.trim_end_matches('/') != requested {
            return Err(AgentError::OtherServer {
                path: credential::credential_path(&cfg.state_dir),
                saved: c.server_url,
                requested,
            });
        }
        info!(server_uuid = %c.server_uuid, "using the saved node credential");
        return Ok(c);
    }
    let client = AgentClient::with_ca(&cfg.server_url, cfg.ca_cert.as_deref())
        .map_err(|e| AgentError::Setup(e.to_string()))?;
    let req = RegisterRequest {
        join_token: cfg.join_token.clone(),
        hostname: cfg.hostname.clone(),
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        protocol_version: PROTOCOL_VERSION,
    };
    let resp = with_retry("register", || client.register(&req))
        .await
        .map_err(|e| match e.status() {
            Some(401) => AgentError::BadJoinToken(e.to_string()),
            _ => AgentError::Register(e),
        })?;
    let c = Credential {
        server_url: requested,
        server_uuid: resp.server_uuid,
        credential: resp.credential,
    };
    let (dir, saved) = (cfg.state_dir.clone(), c.clone());
    tokio::task::spawn_blocking(move || credential::save(&dir, &saved))
        .await
        .map_err(blocking_err)?
        .map_err(|e| AgentError::Setup(format!("saving the node credential: {e}")))?;
    info!(server_uuid = %c.server_uuid, "registered with the control plane");
    Ok(c)
}

struct Agent {
    client: AgentClient,
    executor: Arc<tasks::Executor>,
    sysfs_root: PathBuf,
    /// Where the bridges VMs attach to are listed (see [`HypervisorKind::net_sysfs_root`]).
    net_root: PathBuf,
    /// Kept for the agent's life, so each pass re-reads only what can change.
    discoverer: Arc<Discoverer>,
    /// The CPUs kept for the host (`host_reserved_cpus`, a kernel CPU list), reported so
    /// that placement counts only the CPUs vCPUs are pinned to.
    reserved_cpus: String,
    credential_path: PathBuf,
    // Held across discovery and upload, so the two loops never report out of order.
    // Shared, not copied: a task's changes keep the reports they were read against and
    // bring the server to, and a bind or unbind copied the node's whole list five times.
    last_inventory: Mutex<Option<Arc<InventoryReport>>>,
    /// The inventory a result being posted brings the server to: a result's answer may
    /// be a long poll, and a heartbeat meanwhile need not upload what it carries.
    sending: std::sync::Mutex<Option<Arc<InventoryReport>>>,
    /// Tasks running in the background (downloads): a task the server sends again while
    /// it runs (a poll before its result is in) is not started twice.
    in_flight: std::sync::Mutex<HashSet<TaskId>>,
    /// The server answered `tasks/results` with 404: it is older, results go one by one.
    single_results: std::sync::atomic::AtomicBool,
    /// Something the server should have was not taken (an upload failed, a result with
    /// changed functions was refused): the next heartbeat reads the whole inventory.
    inventory_due: std::sync::atomic::AtomicBool,
    /// A whole inventory went while a result's changed functions were on their way: the
    /// server may have taken the result after it, so once the result's post is answered
    /// the whole inventory goes again.
    overtaken: std::sync::atomic::AtomicBool,
}

impl Agent {
    fn fatal(&self, e: &ClientError) -> Option<AgentError> {
        (e.status() == Some(401))
            .then(|| AgentError::CredentialRejected(e.to_string(), self.credential_path.clone()))
    }

    /// Reads the node's functions and resources as an inventory report; `None` (logged)
    /// when the tree cannot be read. `last` is what was reported before, for the logs.
    async fn discover(&self, last: Option<&InventoryReport>) -> Option<Discovered> {
        let root = self.sysfs_root.clone();
        let net_root = self.net_root.clone();
        let disc = self.discoverer.clone();
        let (found, host, bridges) = match tokio::task::spawn_blocking(move || {
            (
                disc.try_discover(&root),
                crate::host::host_resources(&root),
                crate::net::bridges(&net_root),
            )
        })
        .await
        {
            Ok((Ok(d), host, bridges)) => (d, host, bridges),
            Ok((Err(e), _, _)) => {
                warn!(error = %e, "PCI discovery failed; inventory not reported");
                return None;
            }
            Err(e) => {
                warn!(error = %e, "PCI discovery panicked; inventory not reported");
                return None;
            }
        };
        let host = match host {
            Ok(mut h) => {
                h.reserved_cpus.clone_from(&self.reserved_cpus);
                Some(h)
            }
            Err(e) => {
                // Reported without: the control plane then leaves vCPUs and memory
                // unchecked on this node rather than refusing every VM.
                if last.is_none_or(|l| l.host.is_some()) {
                    warn!(error = %e, "CPU and memory not readable; reported without them");
                }
                None
            }
        };
        let (bridges, bridge_notes) = match bridges {
            Ok(b) => (Some(b.names), b.notes),
            Err(e) => {
                // Reported without: the control plane then places no VM with a network
                // here, rather than one on a bridge that may be missing.
                if last.is_none_or(|l| l.bridges.is_some()) {
                    warn!(error = %e, root = %self.net_root.display(), "network interfaces not readable; bridges not reported");
                }
                (None, Vec::new())
            }
        };
        let mut devices = found.devices;
        if devices.len() > MAX_INVENTORY_DEVICES {
            warn!(
                found = devices.len(),
                "more PCI functions than the protocol allows; reporting the first ones"
            );
            devices.truncate(MAX_INVENTORY_DEVICES);
        }
        Some(Discovered {
            report: InventoryReport {
                devices,
                host,
                bridges,
            },
            skipped: found.skipped.len(),
            notes: found
                .skipped
                .into_iter()
                .chain(found.notes)
                .chain(bridge_notes)
                .collect(),
        })
    }

    /// Re-discovers and uploads the inventory if it changed since the last upload. A tree
    /// that cannot be read is not reported as empty: that would look like lost devices.
    async fn report_inventory(&self) -> Result<(), AgentError> {
        let mut last = self.last_inventory.lock().await;
        let Some(found) = self.discover(last.as_deref()).await else {
            self.inventory_due();
            return Ok(());
        };
        // Nothing to send when it is what a result on its way brings (unless that result
        // is refused: then `last` stays as it was, and the next heartbeat uploads).
        self.upload(&mut last, found).await
    }

    fn sending(&self) -> std::sync::MutexGuard<'_, Option<Arc<InventoryReport>>> {
        self.sending.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn upload(
        &self,
        last: &mut Option<Arc<InventoryReport>>,
        found: Discovered,
    ) -> Result<(), AgentError> {
        let report = found.report;
        // Against what the server will have: a result's changed functions may be on
        // their way still (its post is also the next long poll, which may wait for
        // minutes), and a change since then must go now, even back to what `last` says.
        let base = self.sending().clone().or_else(|| last.clone());
        if base.as_deref() == Some(&report) {
            return Ok(());
        }
        for n in &found.notes {
            debug!(note = %n, "left out of the inventory");
        }
        match self.client.put_inventory(&report).await {
            Ok(()) => {
                info!(
                    devices = report.devices.len(),
                    skipped = found.skipped,
                    "inventory reported"
                );
                *last = Some(Arc::new(report));
                if self.sending().take().is_some() {
                    self.overtaken
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                }
                Ok(())
            }
            Err(e) => match self.fatal(&e) {
                Some(f) => Err(f),
                None => {
                    // Not remembered, so the next heartbeat tries again.
                    warn!(error = %e, "inventory upload failed");
                    self.inventory_due();
                    Ok(())
                }
            },
        }
    }

    /// After a task that rebinds functions: the functions that changed since the last
    /// report, to send with the task's result instead of a whole inventory, and the report
    /// to remember once the server has them. When more than functions' attributes changed
    /// (a function came or went, the host's resources or its bridges, nothing reported
    /// yet), the whole inventory is uploaded here instead and nothing is returned.
    ///
    /// `rebound`: the functions a bind or unbind touched as its own thread read them
    /// right after it ([`Discoverer::reread`]), to put in the latest report in place of
    /// their old selves when nothing else can have changed.
    async fn changed_functions(
        &self,
        rebound: Option<Vec<PciDevice>>,
    ) -> Result<Option<Changes>, AgentError> {
        let mut last = self.last_inventory.lock().await;
        // Results posted after this one's may be on their way: the server will have
        // their functions first, so this task's are told against those.
        let base = self.sending().clone().or_else(|| last.clone());
        if let (Some(read), Some(before)) = (rebound, base.as_ref())
            && let Some(now) = crate::host::merge_reread(&before.devices, read)
        {
            let devices: Vec<PciDevice> = before
                .devices
                .iter()
                .zip(&now)
                .filter(|(a, b)| a != b)
                .map(|(_, b)| b.clone())
                .collect();
            let after = Arc::new(InventoryReport {
                devices: now,
                host: before.host.clone(),
                bridges: before.bridges.clone(),
            });
            return Ok(Some(Changes {
                devices,
                before: before.clone(),
                after,
            }));
        }
        // Only a whole pass can tell: below.
        let Some(found) = self.discover(base.as_deref()).await else {
            self.inventory_due();
            return Ok(None);
        };
        let Some(before) = base.as_ref() else {
            return self.upload(&mut last, found).await.map(|()| None);
        };
        let now = &found.report;
        let same_functions = before.host == now.host
            && before.bridges == now.bridges
            && before.devices.len() == now.devices.len()
            && before
                .devices
                .iter()
                .zip(&now.devices)
                .all(|(a, b)| a.id == b.id);
        if !same_functions {
            return self.upload(&mut last, found).await.map(|()| None);
        }
        let devices: Vec<PciDevice> = before
            .devices
            .iter()
            .zip(&now.devices)
            .filter(|(a, b)| a != b)
            .map(|(_, b)| b.clone())
            .take(MAX_TASK_DEVICES + 1)
            .collect();
        if devices.len() > MAX_TASK_DEVICES {
            return self.upload(&mut last, found).await.map(|()| None);
        }
        Ok(Some(Changes {
            devices,
            before: before.clone(),
            after: Arc::new(found.report),
        }))
    }

    async fn heartbeat_loop(
        self: Arc<Self>,
        every: Duration,
        inventory_every: Duration,
    ) -> Result<(), AgentError> {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The inventory was read just before the loop starts.
        let mut read_at = tokio::time::Instant::now();
        loop {
            tick.tick().await;
            let hv = self.executor.hypervisor.clone();
            let running_vms = tokio::task::spawn_blocking(move || {
                hv.trim();
                hv.running()
            })
            .await
            .map_err(blocking_err)?;
            match self
                .client
                .heartbeat(&Heartbeat {
                    running_vms: Some(running_vms),
                })
                .await
            {
                Ok(_) => debug!("heartbeat"),
                Err(e) => {
                    if let Some(f) = self.fatal(&e) {
                        return Err(f);
                    }
                    warn!(error = %e, "heartbeat failed");
                }
            }
            // A whole pass reads every attribute of every function: on a node that runs
            // its tasks and reports their changes itself, once in a while is enough.
            let due = self
                .inventory_due
                .swap(false, std::sync::atomic::Ordering::Relaxed);
            if due || read_at.elapsed() >= inventory_every {
                read_at = tokio::time::Instant::now();
                self.report_inventory().await?;
            }
        }
    }

    async fn task_loop(self: Arc<Self>) -> Result<(), AgentError> {
        // What the last result's answer brought: the next poll's tasks.
        let mut next: Vec<TaskEnvelope> = Vec::new();
        loop {
            let polled = if next.is_empty() {
                with_retry("task poll", || self.client.poll_tasks(LONG_POLL)).await
            } else {
                Ok(std::mem::take(&mut next))
            };
            let envelopes = match polled {
                Ok(t) => t,
                Err(e) => {
                    if let Some(f) = self.fatal(&e) {
                        return Err(f);
                    }
                    // A 4xx here is a server bug or a protocol mismatch: slow down, go on.
                    error!(error = %e, "task poll refused");
                    tokio::time::sleep(MAX_BACKOFF).await;
                    continue;
                }
            };
            // Results not posted yet: the quick tasks of a batch post theirs together.
            let mut group: Vec<Finished> = Vec::new();
            for env in envelopes {
                if self.in_flight().contains(&env.id) {
                    debug!(task = %env.id, "task already running");
                    continue;
                }
                // A console session lasts as long as its tenant types: it runs beside
                // everything else, and its result goes as soon as it is open.
                if let Task::AttachConsole { vm_uuid, session } = &env.task {
                    let (id, vm, session) = (env.id, *vm_uuid, session.clone());
                    self.in_flight().insert(id);
                    tokio::spawn(self.clone().attach_console(id, vm, session));
                    continue;
                }
                // A download or a QEMU start can take minutes: it runs beside the other
                // tasks, so one VM's image or pinned memory does not hold up another VM's
                // stop or scrub. A stop of the VM itself meanwhile cancels its start (see
                // the QEMU backend). The rest run in turn, as the server sends them.
                if self.executor.runs_long(&env.task) {
                    let id = env.id;
                    self.in_flight().insert(id);
                    let agent = self.clone();
                    tokio::spawn(async move {
                        let done = agent.clone().run_task(env).await;
                        if let Err(e) = agent.post_group(vec![done], None).await {
                            error!(error = %e, "task result could not be reported");
                        }
                        agent.in_flight().remove(&id);
                    });
                    continue;
                }
                let run = self.clone().run_task(env);
                tokio::pin!(run);
                // While a task runs, the results before it go once they have waited
                // GROUP_WAIT: a slow task does not hold up a quick one's. They are posted
                // beside the task, never instead of it: the task may hold the inventory
                // lock that recording their post takes.
                let mut posting = None;
                let done = loop {
                    let due = group
                        .first()
                        .filter(|_| posting.is_none())
                        .map(|f| f.at + GROUP_WAIT);
                    tokio::select! {
                        done = &mut run => break done,
                        () = sleep_until_some(due), if due.is_some() => {
                            let earlier = std::mem::take(&mut group);
                            posting = Some(Box::pin(self.post_group(earlier, None)));
                        }
                        posted = or_pending(posting.as_mut()), if posting.is_some() => {
                            posted?;
                            posting = None;
                        }
                    }
                };
                // In order: the inventory the next results bring builds on these.
                if let Some(p) = posting {
                    p.await?;
                }
                // A console is read for someone waiting: it goes at once.
                let now = done.result.console.is_some();
                group.push(done);
                if now || group.len() >= MAX_RESULTS_PER_POST {
                    self.post_group(std::mem::take(&mut group), None).await?;
                }
            }
            // The batch's last results ask for the next batch in their answer. Results that
            // bring changed functions hold the reports those were read against and bring
            // the server to until they are answered (two of the node's whole inventories
            // at once): their answer waits a second for tasks, not a long poll's time.
            let wait = if group.iter().any(|f| f.inventory.is_some()) {
                CHANGES_WAIT
            } else {
                LONG_POLL
            };
            if !group.is_empty()
                && let Some(more) = self.post_group(group, Some(wait)).await?
            {
                next = more;
            }
        }
    }

    /// Runs an `attach_console` task: reports whether the console opened, then copies
    /// its bytes until it closes.
    async fn attach_console(self: Arc<Self>, id: TaskId, vm: passage_model::VmId, session: String) {
        info!(task = %id, kind = Task::ATTACH_CONSOLE, %vm, "running task");
        let opened = console::attach(&self.executor.hypervisor, &self.client, vm, &session).await;
        let result = match &opened {
            Ok(_) => TaskResult::success(),
            Err(e) => {
                warn!(task = %id, %vm, error = %e, "console not attached");
                TaskResult::failure(e.to_string())
            }
        };
        let done = Finished {
            id,
            result,
            inventory: None,
            at: tokio::time::Instant::now(),
        };
        if let Err(e) = self.post_group(vec![done], None).await {
            error!(error = %e, "task result could not be reported");
        }
        self.in_flight().remove(&id);
        if let Ok((serial, socket)) = opened {
            console::pump(serial, socket).await;
            info!(task = %id, %vm, "console closed");
        }
    }

    fn in_flight(&self) -> std::sync::MutexGuard<'_, HashSet<TaskId>> {
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs one task, posting its progress while it runs; the result is for
    /// [`Self::post_group`], with the functions the task changed.
    async fn run_task(self: Arc<Self>, env: TaskEnvelope) -> Finished {
        let name = env.task.name();
        info!(task = %env.id, kind = name, "running task");
        let (tx, rx) = watch::channel(TaskProgress { done: 0, total: 0 });
        // The functions a bind or unbind rebinds, read again on the task's own thread as
        // soon as it is done (one hop to a blocking thread per task, not two). vGPU slots
        // change their GPU's vGPUs: those come with a whole pass.
        let rebound = match &env.task {
            Task::BindPassthrough { devices, .. }
            | Task::UnbindPassthrough { devices, .. }
            | Task::DestroyVm { devices, .. }
            | Task::BootVm {
                vm: VmSpec { devices, .. },
                ..
            } if devices.iter().all(|d| d.vgpu().is_none()) => {
                let mut a: Vec<PciAddress> = devices.iter().map(|d| d.address()).collect();
                a.sort();
                a.dedup();
                Some(a)
            }
            _ => None,
        };
        // The task runs on a blocking thread: its progress is posted from here meanwhile.
        // The poster ends when the task drops its sender, after sending what it has left.
        let ((mut result, reread), ()) = tokio::join!(
            self.execute(env.task.clone(), tx, rebound),
            post_progress(self.client.clone(), env.id, rx)
        );
        if result.ok {
            info!(task = %env.id, kind = name, "task succeeded");
        } else {
            warn!(task = %env.id, kind = name, error = ?result.error, "task failed");
        }
        // The functions a task rebound go to the server with its result, so the job
        // waiting for it sees them as they are now, without a whole inventory pass. VFs
        // made or taken down change the functions themselves: the whole inventory goes
        // first (`changed_functions` sees that).
        let changes = match &env.task {
            Task::BindPassthrough { .. }
            | Task::UnbindPassthrough { .. }
            | Task::DestroyVm { .. }
            | Task::BootVm { .. }
            | Task::SetVfs { .. } => self.changed_functions(reread).await,
            _ => Ok(None),
        };
        let changes = match changes {
            Ok(c) => c,
            Err(e) => {
                // Only a refused credential ends up here: the post will say so again.
                warn!(error = %e, "reading the functions a task changed");
                None
            }
        };
        // What the server will have once it takes the result; remembered when it has.
        let inventory = changes.map(|c| {
            result.devices = c.devices;
            *self.sending() = Some(c.after.clone());
            (c.before, c.after)
        });
        Finished {
            id: env.id,
            result,
            inventory,
            at: tokio::time::Instant::now(),
        }
    }

    /// Runs `task`; with `rebound`, reads those functions again on the same blocking
    /// thread right after it (`None` when they could not all be read alone).
    async fn execute(
        &self,
        task: Task,
        progress: watch::Sender<TaskProgress>,
        rebound: Option<Vec<PciAddress>>,
    ) -> (TaskResult, Option<Vec<PciDevice>>) {
        let Some(addrs) = rebound else {
            return (self.executor.clone().run(task, progress).await, None);
        };
        let (exec, disc) = (self.executor.clone(), self.discoverer.clone());
        let root = self.sysfs_root.clone();
        let reread = move |disc: &Discoverer| match disc.reread(&root, &addrs) {
            Ok(read) => read,
            Err(e) => {
                warn!(error = %e, "reading rebound functions failed");
                None
            }
        };
        // A download in the task: it runs on the runtime, and the functions are read
        // after it on a thread of their own.
        if exec.downloads(&task) {
            let result = exec.run(task, progress).await;
            let read = tokio::task::spawn_blocking(move || reread(&disc))
                .await
                .unwrap_or(None);
            return (result, read);
        }
        let ran = tokio::task::spawn_blocking(move || {
            let result = exec.execute(&task);
            drop(progress);
            (result, reread(&disc))
        })
        .await;
        ran.unwrap_or_else(|e| (TaskResult::failure(format!("task crashed: {e}")), None))
    }

    /// Posts results in one request (each alone to a server without `tasks/results`).
    /// With `wait` the answer is also the next poll, waiting that long for tasks: its
    /// tasks are returned (`None` when it brought none, or was refused). A refused result
    /// is logged and dropped; the next heartbeat's inventory brings the functions it
    /// changed.
    async fn post_group(
        &self,
        group: Vec<Finished>,
        wait: Option<Duration>,
    ) -> Result<Option<Vec<TaskEnvelope>>, AgentError> {
        let (all_taken, next) = if group.len() > 1 && !self.single_results() {
            let body = TaskResults {
                results: group
                    .iter()
                    .map(|f| TaskOutcome {
                        task: f.id,
                        result: f.result.clone(),
                    })
                    .collect(),
            };
            match with_retry("task results", || self.client.post_results(&body, wait)).await {
                Ok(answer) => {
                    for r in &answer.refused {
                        warn!(task = %r.task, code = ?r.error.code, error = %r.error.message,
                            "task result refused");
                    }
                    (answer.refused.is_empty(), answer.tasks)
                }
                Err(e) if e.is_unknown_call() => {
                    info!("the server takes results one at a time");
                    self.single_results
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    self.post_each(&group, wait).await?
                }
                Err(e) => self.refused(&e).map(|()| (false, None))?,
            }
        } else {
            self.post_each(&group, wait).await?
        };
        self.taken(&group, all_taken).await;
        Ok(next)
    }

    /// Posts results one request each; the last one's answer is the next poll with `wait`.
    async fn post_each(
        &self,
        group: &[Finished],
        wait: Option<Duration>,
    ) -> Result<(bool, Option<Vec<TaskEnvelope>>), AgentError> {
        let mut all_taken = true;
        let mut next = None;
        for (i, f) in group.iter().enumerate() {
            let posted = with_retry("task result", || async {
                match wait.filter(|_| i + 1 == group.len()) {
                    Some(w) => self.client.post_result_then_poll(f.id, &f.result, w).await,
                    None => self
                        .client
                        .post_result(f.id, &f.result)
                        .await
                        .map(|()| None),
                }
            })
            .await;
            match posted {
                Ok(n) => next = n,
                Err(e) => {
                    all_taken = false;
                    // A result whose answer was lost in a long poll and was sent again is
                    // refused as already recorded: that too lands here.
                    warn!(task = %f.id, "task result refused");
                    self.refused(&e)?;
                }
            }
        }
        Ok((all_taken, next))
    }

    /// A post that failed: fatal for a refused credential, logged otherwise.
    fn refused(&self, e: &ClientError) -> Result<(), AgentError> {
        match self.fatal(e) {
            Some(f) => Err(f),
            None => {
                warn!(error = %e, "task results not reported");
                Ok(())
            }
        }
    }

    /// The next heartbeat reads and reports the whole inventory.
    fn inventory_due(&self) {
        self.inventory_due
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn single_results(&self) -> bool {
        self.single_results
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// After a group's post: the inventory its results brought the server to is the last
    /// report, when the server took them all and nothing reported in between (a
    /// heartbeat's upload is newer). Otherwise, or when a whole inventory went while they
    /// were on their way (`overtaken`), the next heartbeat uploads.
    async fn taken(&self, group: &[Finished], all_taken: bool) {
        let first = group.iter().find_map(|f| f.inventory.as_ref());
        let final_ = group.iter().rev().find_map(|f| f.inventory.as_ref());
        let (Some((before, _)), Some((_, after))) = (first, final_) else {
            return;
        };
        if !all_taken {
            self.inventory_due();
        }
        let mut last = self.last_inventory.lock().await;
        if self
            .overtaken
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            *last = None;
            self.inventory_due();
            return;
        }
        let mut sending = self.sending();
        if all_taken && last.as_ref() == Some(before) {
            *last = Some(after.clone());
        }
        // A task since may have built on these results: its own post settles it.
        if !all_taken || sending.as_ref() == Some(after) {
            *sending = None;
        }
    }
}

/// A task run, its result not yet posted.
struct Finished {
    id: TaskId,
    result: TaskResult,
    /// The inventory the task's changed functions were read against, and the one they
    /// bring the server to.
    inventory: Option<(Arc<InventoryReport>, Arc<InventoryReport>)>,
    /// When it ended.
    at: tokio::time::Instant,
}

/// How long a quick task's result may wait for the next ones of its batch, to be posted
/// with them in one request.
const GROUP_WAIT: Duration = Duration::from_millis(50);

/// `f`'s output, or never when there is none.
async fn or_pending<F: Future + Unpin>(f: Option<&mut F>) -> F::Output {
    match f {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Posts each new progress value, at most one every [`PROGRESS_EVERY`]; ends when the
/// task drops its sender. A failed post is only logged: progress is a courtesy.
async fn post_progress(client: AgentClient, id: TaskId, mut rx: watch::Receiver<TaskProgress>) {
    if rx.changed().await.is_err() {
        return;
    }
    loop {
        let p = *rx.borrow_and_update();
        if let Err(e) = client.post_progress(id, &p).await {
            debug!(task = %id, error = %e, "progress not reported");
        }
        // The pause between posts ends early when the task does (its sender dropped): the
        // task's result is posted only after this returns, and a pause there made every
        // `fetch_image` step, a cached image's too, 0.3 s longer.
        let pause = tokio::time::sleep(PROGRESS_EVERY);
        tokio::pin!(pause);
        let mut newer = false;
        let open = loop {
            tokio::select! {
                () = &mut pause => break true,
                changed = rx.changed() => match changed {
                    Ok(()) => newer = true,
                    Err(_) => break false,
                },
            }
        };
        // The newest value is sent (after the pause, or at once when the task ended).
        if !newer && (!open || rx.changed().await.is_err()) {
            return;
        }
    }
}

fn prepare_state_dir(dir: &Path) -> Result<(), AgentError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| AgentError::Setup(format!("creating state dir {}: {e}", dir.display())))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // Holds the node credential: nobody else needs to look inside.
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    }
    Ok(())
}

/// The operator's settings beyond [`AgentConfig`] (kept apart because callers build
/// that one field by field).
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub scrub: ScrubOverrides,
    /// The image cache's budget (`image_cache_gib`).
    pub image_cache_gib: u64,
    /// How QEMU runs here (`qemu_start_base_secs`, `qemu_start_secs_per_gib`,
    /// `ovmf_code`, `ovmf_vars`).
    pub qemu: crate::hypervisor::QemuOptions,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            scrub: ScrubOverrides::default(),
            image_cache_gib: crate::images::DEFAULT_CACHE_GIB,
            qemu: crate::hypervisor::QemuOptions::default(),
        }
    }
}

/// Runs the agent until a fatal error or Ctrl-C, with the default settings.
pub async fn run(cfg: AgentConfig) -> Result<(), AgentError> {
    run_with(cfg, RunOptions::default()).await
}

/// [`run`] with the operator's scrub and image cache settings.
pub async fn run_with(cfg: AgentConfig, opts: RunOptions) -> Result<(), AgentError> {
    let scrub = opts.scrub.clone();
    let setup = {
        let cfg = cfg.clone();
        let opts = opts.clone();
        tokio::task::spawn_blocking(move || -> Result<tasks::Executor, AgentError> {
            prepare_state_dir(&cfg.state_dir)?;
            let hv = hypervisor::open(
                cfg.hypervisor,
                &cfg.state_dir,
                Some(&cfg.sysfs_root),
                &opts.qemu,
            )
            .map_err(|e| AgentError::Setup(e.to_string()))?;
            let ops = open_sysfs(&cfg.sysfs_root).map_err(|e| {
                AgentError::Setup(format!("sysfs root {}: {e}", cfg.sysfs_root.display()))
            })?;
            let scrub_env = ScrubEnv::for_sysfs(ops.as_ref()).with_overrides(&scrub);
            let binder = Binder::new(ops, &cfg.state_dir);
            match binder.reapply_bindings() {
                Ok(failures) => {
                    for (dev, e) in failures {
                        error!(device = %dev, error = %e, "could not re-apply a passthrough binding");
                    }
                }
                Err(e) => error!(error = %e, "could not read the saved bindings"),
            }
            // MIG mode changes through the same nvidia-smi the scrub runs, when one is
            // configured.
            let smi = scrub
                .nvidia_smi
                .clone()
                .map_or(crate::host::NvidiaSmi::Auto, crate::host::NvidiaSmi::Path);
            Ok(tasks::Executor::new(binder, hv)
                .with_scrub_env(scrub_env)
                .with_nvidia_smi(smi))
        })
    };
    let mut executor = setup.await.map_err(blocking_err)??;
    let cred = ensure_credential(&cfg).await?;
    let client = AgentClient::with_ca(&cfg.server_url, cfg.ca_cert.as_deref())
        .map_err(|e| AgentError::Setup(e.to_string()))?
        .with_credential(cred.credential.clone());
    // Simulated nodes have no disks: FetchImage succeeds at once without a download
    // (a fleet of thousands must not each fetch the file). Every other hypervisor gets
    // the cache and real overlays.
    if cfg.hypervisor != HypervisorKind::Sim {
        if crate::hypervisor::find_on_path(crate::images::QEMU_IMG_BINARY).is_none() {
            // Not fatal: the node still runs VMs without disks; each fetch_image task
            // fails with this same advice until it is installed.
            warn!("qemu-img is not on PATH (Debian: qemu-utils); VMs' boot disks cannot be made");
        }
        let source = Arc::new(crate::images::HttpSource::new(client.clone()));
        executor = executor.with_images(Arc::new(crate::images::ImageService::new(
            &cfg.state_dir,
            opts.image_cache_gib,
            source,
        )));
    }
    let agent = Arc::new(Agent {
        client,
        executor: Arc::new(executor),
        sysfs_root: cfg.sysfs_root.clone(),
        net_root: cfg.hypervisor.net_sysfs_root(&cfg.sysfs_root),
        // MIG mode comes from the same nvidia-smi the scrub runs, when one is configured.
        discoverer: Arc::new(
            Discoverer::new().with_nvidia_smi(
                opts.scrub
                    .nvidia_smi
                    .clone()
                    .map_or(crate::host::NvidiaSmi::Auto, crate::host::NvidiaSmi::Path),
            ),
        ),
        reserved_cpus: opts
            .qemu
            .host_reserved_cpus
            .as_deref()
            .map(crate::hypervisor::cpu_list)
            .unwrap_or_default(),
        credential_path: credential::credential_path(&cfg.state_dir),
        last_inventory: Mutex::new(None),
        sending: std::sync::Mutex::new(None),
        single_results: std::sync::atomic::AtomicBool::new(false),
        inventory_due: std::sync::atomic::AtomicBool::new(false),
        overtaken: std::sync::atomic::AtomicBool::new(false),
        in_flight: std::sync::Mutex::new(HashSet::new()),
    });
    agent.report_inventory().await?;
    // Only QEMU makes taps ([`crate::net`]); the service answers on them.
    if cfg.hypervisor == HypervisorKind::Qemu {
        let service = crate::metadata::MetadataService::new(
            Some(agent.client.clone()),
            agent.net_root.clone(),
        );
        tokio::spawn(service.run(agent.executor.hypervisor.clone()));
    }
    tokio::select! {
        r = agent.clone().heartbeat_loop(cfg.heartbeat, cfg.inventory_every) => r,
        r = agent.clone().task_loop() => r,
        _ = tokio::signal::ctrl_c() => {
            info!("interrupted; stopping");
            Ok(())
        }
    }
}

#[cfg(test)]
mod redaction_tests {
    use super::*;

    #[test]
    fn agent_config_debug_hides_the_join_token() {
        let c = AgentConfig {
            server_url: "http://cp:8080".into(),
            join_token: "psj_secret".into(),
            sysfs_root: "/sys".into(),
            state_dir: "/var/lib/passage-agent".into(),
            hypervisor: HypervisorKind::Sim,
            heartbeat: Duration::from_secs(10),
            inventory_every: Duration::from_secs(10),
            hostname: "cn-1".into(),
            ca_cert: None,
        };
        let shown = format!("{c:?}");
        assert!(!shown.contains("psj_secret"), "{shown}");
        assert!(shown.contains("cn-1"));
    }
}
