//! The control plane's application layer: one module per aggregate. Handlers (REST, agent
//! API, later the portal) call these; these call the store.

pub mod accounts;
pub mod agents;
pub mod audit;
pub mod auth;
pub mod batcher;
pub mod cache;
pub mod catalog;
pub mod images;
pub mod login_guard;
pub mod metrics;
pub mod ops;
pub mod placer;
pub mod servers;
pub mod vm_ops;
pub mod vms;

use crate::config::Config;
use crate::store::Db;
use std::sync::Arc;
use tokio::sync::Notify;

pub struct Services {
    pub db: Db,
    /// The placement batches' own connections: a creation waits for its batch, never
    /// for the job steps of the creations before it.
    pub placer_db: Db,
    /// The audit writer's own connection: every state-changing answer waits for its
    /// record, so a burst of job steps in the shared pool must not hold that up.
    pub audit_db: Db,
    /// Job steps' connections, fewer than the shared pool's: a burst of jobs starting
    /// together runs a few statements at a time in the database instead of sixteen, so
    /// the requests being answered meanwhile keep their share of its CPUs.
    pub jobs_db: Db,
    pub cfg: Config,
    /// Wakes agents' long-polls when a task is queued.
    pub tasks_queued: Notify,
    /// Wakes job steps waiting on an agent when a result arrives.
    pub task_done: Notify,
    pub metrics: metrics::Metrics,
    /// This process among replicas: the owner named in job leases.
    pub instance: String,
    /// Jobs this process is running now (never two runners for one job here).
    pub running_jobs: std::sync::Mutex<std::collections::HashSet<passage_model::JobId>>,
    pub login_guard: login_guard::LoginGuard,
    /// Jobs that may run at once in this process.
    pub job_permits: Arc<tokio::sync::Semaphore>,
    /// Creations waiting to be placed together.
    pub placer: placer::Placer,
    /// Audit records waiting to be written together.
    pub audit: batcher::Batcher<audit::Pending>,
    /// Live tokens by the SHA-256 of their secret.
    pub tokens: cache::TtlCache<crate::store::accounts::LiveToken>,
    /// Packages by the uuid or name they were asked for by.
    pub packages: cache::TtlCache<passage_model::api::Package>,
}

pub type Ctx = Arc<Services>;

/// Batches are placed one at a time (`batcher::drain`): one connection is all they use.
const PLACER_CONNECTIONS: u32 = 1;
/// Audit batches are written one at a time too.
const AUDIT_CONNECTIONS: u32 = 1;
const JOB_CONNECTIONS: u32 = 4;

impl Services {
    pub fn new(db: Db, cfg: Config) -> Ctx {
        let cfg_limits = cfg.login_limits.clone();
        let job_concurrency = cfg.job_concurrency.max(1);
        Arc::new(Services {
            placer_db: db.lane(PLACER_CONNECTIONS),
            audit_db: db.lane(AUDIT_CONNECTIONS),
            jobs_db: db.lane(JOB_CONNECTIONS),
            db,
            cfg,
            tasks_queued: Notify::new(),
            task_done: Notify::new(),
            metrics: metrics::Metrics::default(),
            instance: uuid::Uuid::new_v4().to_string(),
            running_jobs: std::sync::Mutex::new(std::collections::HashSet::new()),
            login_guard: login_guard::LoginGuard::new(cfg_limits),
            job_permits: Arc::new(tokio::sync::Semaphore::new(job_concurrency)),
            placer: placer::Placer::new(placer::LINGER),
            audit: batcher::Batcher::new(audit::LINGER),
            tokens: cache::TtlCache::default(),
            packages: cache::TtlCache::default(),
        })
    }

    /// The oldest heartbeat (ms since the epoch) a server may have and still be running.
    pub fn alive_after_ms(&self) -> i64 {
        crate::store::now_ms() - i64::try_from(self.cfg.heartbeat_timeout.as_millis()).unwrap_or(0)
    }
}
