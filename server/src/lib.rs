//! Passage's control plane.

pub mod api;
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
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("listening on {listen}: {e}"))?;
    let addr = listener.local_addr()?;
    let app = api::router(ctx.clone());
    let tls = ctx.cfg.tls.clone();
    let server = match &tls {
        None => tokio::spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .with_graceful_shutdown(shutdown_signal())
            .await
        }),
        Some(files) => {
            let config = tls::load(files).map_err(|e| anyhow::anyhow!("{e}"))?;
            tls::reload_on_hangup(files.clone(), config.clone());
            let handle = axum_server::Handle::new();
            let stop = handle.clone();
            tokio::spawn(async move {
                shutdown_signal().await;
                stop.graceful_shutdown(Some(std::time::Duration::from_secs(30)));
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

/// Ctrl-C or SIGTERM (what systemd sends): stop taking requests, finish those in flight.
/// Jobs interrupted here resume at the next start.
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
