//! The HTTP surface: REST /v1, the agent API, the portal at /.

pub mod agent;
pub mod audit;
pub mod extract;
pub mod metrics;
pub mod v1;

use crate::error::ApiError;
use crate::services::Ctx;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::response::{Html, IntoResponse};
use axum::routing::{get, post, put};
use passage_model::ErrorCode;

/// API bodies are small; 64 KiB is far above any valid one.
pub const API_BODY_LIMIT: usize = 64 * 1024;
/// An inventory of 4096 functions fits with room to spare.
pub const AGENT_BODY_LIMIT: usize = 4 * 1024 * 1024;

pub fn router(ctx: Ctx) -> Router {
    let v1 = Router::new()
        .route("/ping", get(v1::ping))
        .route("/auth/login", post(v1::login))
        .route("/auth/logout", post(v1::logout))
        .route("/accounts", get(v1::list_accounts).post(v1::create_account))
        .route(
            "/accounts/{uuid}",
            get(v1::get_account)
                .patch(v1::update_account)
                .delete(v1::delete_account),
        )
        .route("/tokens", get(v1::list_tokens).post(v1::create_token))
        .route("/tokens/{uuid}", axum::routing::delete(v1::delete_token))
        .route("/variants", get(v1::list_variants).post(v1::create_variant))
        .route(
            "/variants/{name}",
            get(v1::get_variant)
                .put(v1::put_variant)
                .delete(v1::delete_variant),
        )
        .route("/packages", get(v1::list_packages).post(v1::create_package))
        .route(
            "/packages/{uuid}",
            get(v1::get_package).delete(v1::delete_package),
        )
        .route("/servers", get(v1::list_servers))
        .route("/servers/join-tokens", post(v1::create_join_token))
        .route(
            "/servers/{uuid}",
            get(v1::get_server).patch(v1::update_server),
        )
        .route("/servers/{uuid}/device-events", get(v1::device_events))
        .route("/servers/{uuid}/scrub-reports", get(v1::scrub_reports))
        .route("/servers/{uuid}/device-actions", post(v1::device_action))
        .route("/capacity", get(v1::capacity))
        .route("/alerts", get(v1::alerts))
        .route("/audit", get(v1::audit))
        .route("/usage", get(v1::usage))
        .route("/placement/dry-run", post(v1::placement_dry_run))
        .route("/vms", get(v1::list_vms).post(v1::create_vm))
        .route("/vms/{uuid}", get(v1::get_vm).delete(v1::delete_vm))
        .route("/jobs", get(v1::list_jobs))
        .route("/jobs/{uuid}", get(v1::get_job))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(API_BODY_LIMIT))
        .layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            audit::record,
        ));
    let agent_api = Router::new()
        .route("/register", post(agent::register))
        .route("/heartbeat", post(agent::heartbeat))
        .route("/inventory", put(agent::inventory))
        .route("/tasks", get(agent::poll_tasks))
        .route("/tasks/{uuid}/result", post(agent::task_result))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(AGENT_BODY_LIMIT));
    Router::new()
        .route("/", get(portal))
        .route("/metrics", get(metrics::render))
        .nest("/v1", v1)
        .nest("/agent/v1", agent_api)
        .with_state(ctx)
        .layer(tower_http::trace::TraceLayer::new_for_http())
}

async fn portal() -> Html<String> {
    Html(passage_app::placeholder_page(env!("CARGO_PKG_VERSION")))
}

async fn not_found() -> impl IntoResponse {
    ApiError::new(ErrorCode::ResourceNotFound, "no such route")
}
