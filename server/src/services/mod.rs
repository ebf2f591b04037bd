//! The control plane's application layer: one module per aggregate. Handlers (REST, agent
//! API, later the portal) call these; these call the store.

pub mod accounts;
pub mod agents;
pub mod audit;
pub mod auth;
pub mod batcher;
pub mod cache;
pub mod catalog;
pub mod completions;
pub mod console;
pub mod destroys;
pub mod device_log;
pub mod heartbeats;
pub mod images;
pub mod job_log;
pub mod keys;
pub mod login_guard;
pub mod metrics;
pub mod networks;
pub mod ops;
pub mod pacer;
pub mod placer;
pub mod queue_marks;
pub mod servers;
pub mod task_results;
pub mod task_takes;
pub mod vm_labels;
pub mod vm_ops;
pub mod vms;
pub mod wakers;

use crate::config::Config;
use crate::store::Db;
use std::sync::Arc;

pub struct Services {
    pub db: Db,
    /// The placement batches' own connections: a creation waits for its batch, never
    /// for the job steps of the creations before it.
    pub placer_db: Db,
    /// The audit writer's own connection: every state-changing answer waits for its
    /// record, so a burst of job steps in the shared pool must not hold that up.
    pub audit_db: Db,
    /// Writes that a tenant's call waits for (a deletion, a stop or start), ahead of job
    /// steps and node reports on SQLite, as creations' batches are: 10,000 deletions
    /// queued behind the destroys they started were answered at 550 a second.
    pub api_db: Db,
    /// Job steps' connections, fewer than the shared pool's: a burst of jobs starting
    /// together runs a few statements at a time in the database instead of sixteen, so
    /// the requests being answered meanwhile keep their share of its CPUs.
    pub jobs_db: Db,
    pub cfg: Config,
    /// Wakes a node's long poll when a task is queued for it.
    pub tasks_queued: wakers::Wakers<passage_model::ServerId>,
    /// Whether a node's long poll must look at its queue ([`queue_marks`]).
    pub queue_marks: queue_marks::QueueMarks,
    /// Wakes the job step waiting on a task when its result arrives.
    pub task_done: wakers::Wakers<passage_model::TaskId>,
    /// Results for the job steps of this process that wait for them.
    pub task_results: task_results::TaskResults,
    pub metrics: metrics::Metrics,
    /// This process among replicas: the owner named in job leases.
    pub instance: String,
    /// Set when the process is shutting down: its job runners take and renew no more
    /// leases, so the leases it gave back stay free for the next start.
    pub stopping: std::sync::atomic::AtomicBool,
    /// Jobs this process is running now (never two runners for one job here).
    pub running_jobs: std::sync::Mutex<std::collections::HashSet<passage_model::JobId>>,
    /// Provisions whose VM was deleted here while they ran: each stops at its next step
    /// and unwinds. The VM's `destroying` state says the same to a run read back from the
    /// database (a restart, another replica), and a provision's last step refuses a VM
    /// that is no longer provisioning.
    pub cancelled_jobs: std::sync::Mutex<std::collections::HashSet<passage_model::JobId>>,
    pub login_guard: login_guard::LoginGuard,
    /// Jobs that may run at once in this process.
    pub job_permits: Arc<tokio::sync::Semaphore>,
    /// Creations waiting to be placed together.
    pub placer: placer::Placer,
    /// Job steps' turns while creations are coming in: creations are answered first.
    pub job_pacer: pacer::JobPacer,
    /// Audit records waiting to be written together.
    pub audit: batcher::Batcher<audit::Pending>,
    /// Job runners' claims, step writes and queued tasks waiting to be written together.
    pub job_log: batcher::Batcher<job_log::Pending>,
    /// Nodes' task results waiting to be recorded together.
    pub completions: batcher::Batcher<completions::Pending>,
    /// The long polls looking at their queues, taken together (`task_takes`).
    pub task_takes: batcher::Batcher<task_takes::Look>,
    /// Job steps' device moves (and scrub reports) waiting to be written together.
    pub device_log: batcher::Batcher<device_log::Pending>,
    /// Deletions waiting to be written together.
    pub destroys: batcher::Batcher<destroys::Pending>,
    /// Nodes' heartbeats waiting to be written together.
    pub heartbeat_log: batcher::Batcher<heartbeats::Beat>,
    /// Live tokens by the SHA-256 of their secret.
    pub tokens: cache::TtlCache<crate::store::accounts::LiveToken>,
    /// Nodes by the SHA-256 of their credential: every agent request (a poll and a result
    /// per task, heartbeats) is authenticated, and a fleet's job steps spent a statement
    /// on each. Forgotten whole when this process writes any credential.
    pub node_credentials: cache::TtlCache<passage_model::ServerId>,
    /// Packages by the uuid or name they were asked for by.
    pub packages: cache::TtlCache<passage_model::api::Package>,
    /// Images by uuid, for job steps (a provision reads its VM's image for the disk it
    /// fetches and again for the one it launches), and as creations name them (by name,
    /// name and version, or uuid; see `images::resolve`). Every image write clears it.
    pub images: cache::TtlCache<passage_model::images::Image>,
    /// Servers whose heartbeat this process wrote within [`cache::TTL`]: a node polls for
    /// tasks after every task it ran, and a heartbeat per poll cost the one SQLite writer a
    /// statement per task for a time only read to the second's tens.
    pub heartbeats: cache::TtlCache<()>,
    /// Every server's bridges (one entry, [`networks::BRIDGES_KEY`]): placement reads it
    /// for every VM with a network.
    pub bridges: cache::TtlCache<networks::BridgeMap>,
    /// The default networks an owner's VMs get, and whether any network exists, by owner:
    /// every creation that names no network reads them. Every network write clears it.
    pub default_networks: cache::TtlCache<networks::Defaults>,
    /// Servers whose SR-IOV reconciler (`workflows::sriov`) runs now, each with whether
    /// it is asked to run again after (and then whether to retry refused counts).
    pub sriov_busy:
        std::sync::Mutex<std::collections::HashMap<passage_model::ServerId, Option<bool>>>,
    /// The later task kinds each node's agent said on its last poll here that it runs
    /// (`services::agents::note_runs`).
    pub later_tasks: std::sync::Mutex<
        std::collections::HashMap<passage_model::ServerId, passage_model::protocol::LaterTasks>,
    >,
    /// Interactive console sessions: the VMs with one open, and those waiting for their
    /// node to dial back.
    pub consoles: console::Consoles,
}

pub type Ctx = Arc<Services>;

/// See [`Services::replica_poll`].
const REPLICA_POLL: std::time::Duration = std::time::Duration::from_secs(5);

/// On Postgres, listens for what the other replicas announce (a task queued for a node
/// whose long poll may be here, a result for a step that may wait here) and wakes the
/// waiter. `PgListener` reconnects by itself; what is sent meanwhile is lost and found
/// by the waiters' [`Services::replica_poll`].
pub fn wake_on_notify(ctx: &Ctx) {
    let crate::store::Db::Postgres(pool) = &ctx.db else {
        return;
    };
    let (pool, ctx) = (pool.clone(), Arc::downgrade(ctx));
    tokio::spawn(async move {
        use crate::store::tasks::{DONE_CHANNEL, QUEUED_CHANNEL};
        let mut listener = loop {
            match sqlx::postgres::PgListener::connect_with(&pool).await {
                Ok(mut l) => match l.listen_all([QUEUED_CHANNEL, DONE_CHANNEL]).await {
                    Ok(()) => break l,
                    Err(e) => tracing::warn!(error = %e, "LISTEN for other replicas"),
                },
                Err(e) => tracing::warn!(error = %e, "connecting to LISTEN for other replicas"),
            }
            tokio::time::sleep(REPLICA_POLL).await;
        };
        loop {
            let n = match listener.recv().await {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(error = %e, "listening for other replicas");
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    continue;
                }
            };
            let Some(ctx) = ctx.upgrade() else {
                return;
            };
            match n.channel() {
                QUEUED_CHANNEL => {
                    if let Ok(s) = n.payload().parse() {
                        ctx.queue_marks.queued(&s);
                        ctx.tasks_queued.wake(&s);
                    }
                }
                DONE_CHANNEL => {
                    if let Ok(t) = n.payload().parse() {
                        ctx.task_done.wake(&t);
                    }
                }
                _ => {}
            }
        }
    });
}

/// Batches are placed one at a time (`batcher::drain`): one connection is all they use.
const PLACER_CONNECTIONS: u32 = 1;
/// Audit batches are written one at a time too.
const AUDIT_CONNECTIONS: u32 = 1;
const JOB_CONNECTIONS: u32 = 4;
/// While creations are coming in, one job step starts per this interval at most (100 a
/// second), and every step still waiting goes once they stop (`services::pacer`). At 2 ms
/// (the nineteenth session), Postgres runs of 10,000 vGPU creations went from a p99 of
/// 44.9–56.7 ms to 35.6–41.5 ms. At 10 ms, in 16 fleet runs of 10,000 creations on
/// Postgres alternated with 12 at 2 ms, the p99 was under 50 ms in 11 (median 44.9 ms)
/// against 3 (median 60.6 ms), creations came at a median 3,043/s against 2,635/s, and
/// every VM was running as soon (median 13.6 s against 13.9 s): a burst of creations is
/// bounded by the free devices, and the jobs it leaves waiting run together when it ends.
/// Without that release, 1,024 jobs waiting for turns 10 ms apart would wait up to 10 s;
/// with it alone, at 2 ms, the p99 was no better (51.5–104.6 ms in 5 runs). BENCHMARKS.md,
/// thirty-third session.
const JOB_PACE: std::time::Duration = std::time::Duration::from_millis(10);

/// Jobs run at once unless the operator says otherwise. On SQLite every write waits for
/// the one writer, and 1,024 jobs did no better than 512 there; on Postgres, where the
/// jobs' statements run side by side, 1,024 took the fleet bench's creations from
/// 1,571–1,763/s to 2,175–2,178/s and their p99 from 147–148 ms to 80–96 ms, with every
/// VM running and every device clean as soon or sooner (BENCHMARKS.md, thirtieth
/// session).
pub fn default_job_concurrency(backend: &str) -> usize {
    match backend {
        "postgres" => 1024,
        _ => 512,
    }
}

impl Services {
    pub fn new(db: Db, cfg: Config) -> Ctx {
        let cfg_limits = cfg.login_limits.clone();
        let job_concurrency = cfg
            .job_concurrency
            .unwrap_or_else(|| default_job_concurrency(db.backend()))
            .max(1);
        Arc::new(Services {
            placer_db: db.lane(PLACER_CONNECTIONS).first_in_line(),
            audit_db: db.lane(AUDIT_CONNECTIONS).first_in_line(),
            api_db: db.first_in_line(),
            jobs_db: db.lane_with(JOB_CONNECTIONS, crate::store::Commit::Relaxed),
            db,
            cfg,
            tasks_queued: wakers::Wakers::default(),
            queue_marks: queue_marks::QueueMarks::default(),
            task_done: wakers::Wakers::default(),
            task_results: task_results::TaskResults::default(),
            metrics: metrics::Metrics::default(),
            instance: uuid::Uuid::new_v4().to_string(),
            stopping: std::sync::atomic::AtomicBool::new(false),
            running_jobs: std::sync::Mutex::new(std::collections::HashSet::new()),
            cancelled_jobs: std::sync::Mutex::new(std::collections::HashSet::new()),
            login_guard: login_guard::LoginGuard::new(cfg_limits),
            job_permits: Arc::new(tokio::sync::Semaphore::new(job_concurrency)),
            placer: placer::Placer::new(placer::LINGER),
            job_pacer: pacer::JobPacer::new(JOB_PACE),
            audit: batcher::Batcher::new(audit::LINGER),
            job_log: batcher::Batcher::new(job_log::LINGER),
            completions: batcher::Batcher::new(completions::LINGER),
            task_takes: batcher::Batcher::new(task_takes::LINGER),
            device_log: batcher::Batcher::new(device_log::LINGER),
            destroys: batcher::Batcher::new(destroys::LINGER),
            heartbeat_log: batcher::Batcher::new(heartbeats::LINGER),
            tokens: cache::TtlCache::default(),
            node_credentials: cache::TtlCache::default(),
            packages: cache::TtlCache::default(),
            images: cache::TtlCache::default(),
            heartbeats: cache::TtlCache::default(),
            bridges: cache::TtlCache::default(),
            default_networks: cache::TtlCache::default(),
            sriov_busy: std::sync::Mutex::new(std::collections::HashMap::new()),
            later_tasks: std::sync::Mutex::new(std::collections::HashMap::new()),
            consoles: console::Consoles::default(),
        })
    }

    /// How often a waiter looks at the database for what another replica did (a task it
    /// queued, a result given to it) in case the announcement ([`wake_on_notify`]) was
    /// lost while the listener reconnected. Only Postgres is shared by replicas: on
    /// SQLite this process is the only writer and its own wake-ups are enough.
    pub fn replica_poll(&self) -> Option<std::time::Duration> {
        matches!(self.db, crate::store::Db::Postgres(_)).then_some(REPLICA_POLL)
    }

    /// The oldest heartbeat (ms since the epoch) a server may have and still be running.
    pub fn alive_after_ms(&self) -> i64 {
        crate::store::now_ms() - i64::try_from(self.cfg.heartbeat_timeout.as_millis()).unwrap_or(0)
    }
}
