//! Passage's control plane.

pub mod api;
pub mod cloudapi;
pub mod config;
pub mod error;
pub mod health;
pub mod listing;
pub mod placement;
pub mod portal;
pub mod services;
pub mod sim;
pub mod store;
pub mod tls;
pub mod workflows;

use config::Config;
use services::{Ctx, Services};
use std::net::SocketAddr;
use store::Db;

/// A running control plane: what `main` and the tests hold.
pub struct Running {
    pub ctx: Ctx,
    pub addr: SocketAddr,
    /// The generated `admin` password, when this start created the account without one.
    pub admin_password: Option<String>,
    pub server: tokio::task::JoinHandle<std::io::Result<()>>,
    /// Whether it speaks https.
    pub tls: bool,
}

impl Running {
    /// The base URL clients on this host reach it at.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }
}

/// Opens the database (migrating it), creates `admin` on an empty one, resumes unfinished
/// jobs, starts the reconcilers and serves HTTP on `listen`.
pub async fn start(
    database_url: &str,
    listen: &str,
    cfg: Config,
    admin_password: Option<String>,
) -> anyhow::Result<Running> {
    let db = Db::connect(database_url)
        .await
        .map_err(|e| anyhow::anyhow!("opening the database: {e}"))?;
    let mut cfg = cfg;
    let image_dir = cfg.resolve_image_dir(database_url);
    tokio::fs::create_dir_all(&image_dir).await.map_err(|e| {
        anyhow::anyhow!("creating the image directory {}: {e}", image_dir.display())
    })?;
    let ctx = Services::new(db, cfg);
    let admin_password = services::auth::bootstrap_admin(&ctx, admin_password)
        .await
        .map_err(|e| anyhow::anyhow!("creating the admin account: {e}"))?;
    workflows::resume_all(&ctx)
        .await
        .map_err(|e| anyhow::anyhow!("resuming jobs: {e}"))?;
    workflows::reconcile::spawn_loops(ctx.clone());
    store::statistics::spawn(&ctx.db);
    services::wake_on_notify(&ctx);
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("listening on {listen}: {e}"))?;
    let addr = listener.local_addr()?;
    let app = api::router(ctx.clone());
    let tls = ctx.cfg.tls.clone();
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(stop_on_signal(ctx.clone(), stop.clone()));
    let server = match &tls {
        None => {
            let graceful = axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .with_graceful_shutdown(stop.clone().cancelled_owned());
            tokio::spawn(async move {
                tokio::select! {
                    r = graceful => r,
                    // Agents' long polls and idle keep-alive connections would hold a
                    // graceful shutdown for a minute: in-flight requests get the grace,
                    // then the rest are dropped.
                    _ = async {
                        stop.cancelled().await;
                        tokio::time::sleep(SHUTDOWN_GRACE).await;
                    } => Ok(()),
                }
            })
        }
        Some(files) => {
            let config = tls::load(files).map_err(|e| anyhow::anyhow!("{e}"))?;
            tls::reload_on_hangup(files.clone(), config.clone());
            let handle = axum_server::Handle::new();
            let h = handle.clone();
            tokio::spawn(async move {
                stop.cancelled().await;
                h.graceful_shutdown(Some(SHUTDOWN_GRACE));
            });
            let server = axum_server::from_tcp_rustls(listener.into_std()?, config)?;
            tokio::spawn(async move {
                server
                    .handle(handle)
                    .serve(app.into_make_service_with_connect_info::<SocketAddr>())
                    .await
            })
        }
    };
    Ok(Running {
        ctx,
        addr,
        admin_password,
        server,
        tls: tls.is_some(),
    })
}

/// How long requests in flight at a shutdown get to finish: systemd's stop timeout is
/// 90 s, but an operator restarting a server expects it gone in seconds.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Ctrl-C or SIGTERM (what systemd sends): stop taking requests, give those in flight
/// [`SHUTDOWN_GRACE`], and give back this process's job leases so the next start resumes
/// its jobs at once. A step cut off mid-way is run again then: every step is idempotent.
async fn stop_on_signal(ctx: services::Ctx, stop: tokio_util::sync::CancellationToken) {
    shutdown_signal().await;
    ctx.stopping
        .store(true, std::sync::atomic::Ordering::SeqCst);
    match store::jobs::release_leases(&ctx.db, &ctx.instance).await {
        Ok(n) => tracing::info!(jobs = n, "gave back job leases"),
        Err(e) => tracing::warn!(error = %e, "giving back job leases"),
    }
    stop.cancel();
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    tracing::info!("shutting down");
}
