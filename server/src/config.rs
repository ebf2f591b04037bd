//! Run-time settings of the control plane.

use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Config {
    /// A server not heard from for this long is `offline` and gets no placements.
    pub heartbeat_timeout: Duration,
    /// How long a job step waits for an agent's answer before failing.
    pub task_timeout: Duration,
    /// The longest a clean stop waits for a guest to shut down, whatever its package
    /// asks; then the VM is powered off.
    pub stop_grace_max: Duration,
    /// A task handed out but never answered is handed out again after this.
    pub task_redeliver_after: Duration,
    /// Lifetime of a login session however busy (the absolute timeout).
    pub token_ttl: Duration,
    /// A login session unused for this long ends (the idle timeout). API tokens have
    /// only their expiry.
    pub session_idle: Duration,
    /// Dirty devices left this long without a scrub get one from the reconciler.
    pub scrub_grace: Duration,
    /// How often background reconcilers run.
    pub reconcile_every: Duration,
    /// A GPU opened for vGPUs whose slots have all been free this long (opened for a
    /// request that then went elsewhere, or never came) leaves vGPU mode through its
    /// scrub, to be given whole again.
    pub vgpu_idle_close: Duration,
    /// How long a job's lease lasts without renewal: after that another replica (or this
    /// one, restarted) takes the job over.
    pub job_lease: Duration,
    /// A running VM that its node stops reporting is marked stopped, once it has been
    /// running this long (a node's report may predate the VM's start).
    pub vm_exit_grace: Duration,
    /// Jobs this process runs at once; more wait their turn. `None`: the database's
    /// own default ([`crate::services::default_job_concurrency`]).
    pub job_concurrency: Option<usize>,
    /// Failed-login throttling.
    pub login_limits: crate::services::login_guard::Limits,
    /// Serve https with these files; plain http when `None`.
    pub tls: Option<crate::tls::TlsFiles>,
    /// Placement policy for packages that do not name one.
    pub placement: crate::placement::Policy,
    /// How nodes' reported CPUs and memory become room for VMs.
    pub alloc: crate::store::room::Allocation,
    /// Where image files are kept, by SHA-256. `None`: beside the SQLite file
    /// (`<db dir>/images`), or `./images` on Postgres (see [`Config::resolve_image_dir`]).
    pub image_dir: Option<std::path::PathBuf>,
    /// The largest image file an upload may bring.
    pub image_max_bytes: u64,
    /// Test only: stop every job just before this step (`provision.launch`, …), to prove
    /// that a server killed there resumes or unwinds the job.
    pub pause_before: Option<String>,
    /// Test only: job steps (`provision.launch`, `destroy.stop`, …) made to fail after
    /// their action ran, to prove every undo.
    pub faults: Vec<String>,
    /// Test only: every job step's action, and every undo, runs twice in a row; the
    /// second run must succeed and change nothing (each is idempotent).
    pub repeat_steps: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            heartbeat_timeout: Duration::from_secs(30),
            task_timeout: Duration::from_secs(120),
            stop_grace_max: Duration::from_secs(300),
            task_redeliver_after: Duration::from_secs(60),
            token_ttl: Duration::from_secs(12 * 3600),
            session_idle: Duration::from_secs(30 * 60),
            scrub_grace: Duration::from_secs(10),
            reconcile_every: Duration::from_secs(2),
            vgpu_idle_close: Duration::from_secs(600),
            job_lease: Duration::from_secs(30),
            pause_before: None,
            tls: None,
            placement: crate::placement::Policy::Pack,
            alloc: crate::store::room::Allocation::default(),
            login_limits: crate::services::login_guard::Limits::default(),
            job_concurrency: None,
            vm_exit_grace: Duration::from_secs(10),
            faults: Vec::new(),
            repeat_steps: false,
            image_dir: None,
            image_max_bytes: 64 * 1024 * 1024 * 1024,
        }
    }
}

impl Config {
    /// The image directory: as configured, else beside the SQLite database file, else
    /// (Postgres) `./images`. Replicas on one Postgres database must share it.
    pub fn resolve_image_dir(&mut self, database_url: &str) -> std::path::PathBuf {
        if let Some(d) = &self.image_dir {
            return d.clone();
        }
        let dir = database_url
            .strip_prefix("sqlite://")
            .or_else(|| database_url.strip_prefix("sqlite:"))
            .map(|p| p.split('?').next().unwrap_or(p))
            .map(|p| {
                std::path::Path::new(p)
                    .parent()
                    .map(|d| d.join("images"))
                    .unwrap_or_else(|| "images".into())
            })
            .unwrap_or_else(|| "images".into());
        // `passage.db` has an empty parent: the current directory.
        let dir = if dir.as_os_str().is_empty() {
            "images".into()
        } else {
            dir
        };
        self.image_dir = Some(dir.clone());
        dir
    }
}
