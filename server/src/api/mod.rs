//! The HTTP surface: REST /v1, the agent API, the portal at / (see `crate::portal`).

pub mod agent;
pub mod audit;
pub mod extract;
pub mod file_stream;
pub mod hardening;
pub mod links;
pub mod metrics;
pub mod params;
pub mod v1;

use crate::error::ApiError;
use crate::services::Ctx;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::response::IntoResponse;
use axum::routing::{get, post, put};
use passage_model::ErrorCode;
use utoipa::OpenApi;

/// API bodies are small; 64 KiB is far above any valid one.
pub const API_BODY_LIMIT: usize = 64 * 1024;
/// An inventory of 4096 functions fits with room to spare.
pub const AGENT_BODY_LIMIT: usize = 4 * 1024 * 1024;

/// The /v1 routes and their OpenAPI document, from one source: a route exists in the
/// document exactly when it is served.
pub fn v1_routes() -> (Router<Ctx>, utoipa::openapi::OpenApi) {
    use utoipa_axum::router::OpenApiRouter;
    use utoipa_axum::routes;
    let (router, mut doc) = OpenApiRouter::<Ctx>::with_openapi(ApiDoc::openapi())
        .routes(routes!(v1::ping))
        .routes(routes!(v1::login))
        .routes(routes!(v1::logout))
        .routes(routes!(v1::me))
        .routes(routes!(v1::list_accounts, v1::create_account))
        .routes(routes!(
            v1::get_account,
            v1::update_account,
            v1::delete_account
        ))
        .routes(routes!(v1::list_tokens, v1::create_token))
        .routes(routes!(v1::delete_token))
        .routes(routes!(v1::list_networks, v1::create_network))
        .routes(routes!(
            v1::get_network,
            v1::update_network,
            v1::delete_network
        ))
        .routes(routes!(v1::list_network_ips))
        .routes(routes!(v1::list_keys, v1::create_key))
        .routes(routes!(v1::get_key, v1::delete_key))
        .routes(routes!(v1::list_account_keys, v1::create_account_key))
        .routes(routes!(v1::get_account_key, v1::delete_account_key))
        .routes(routes!(v1::list_variants, v1::create_variant))
        .routes(routes!(
            v1::get_variant,
            v1::put_variant,
            v1::delete_variant
        ))
        .routes(routes!(v1::list_packages, v1::create_package))
        .routes(routes!(v1::get_package, v1::delete_package))
        .routes(routes!(v1::package_availability))
        .routes(routes!(v1::list_images, v1::create_image))
        .routes(routes!(v1::get_image, v1::update_image, v1::delete_image))
        .routes(routes!(v1::upload_image_file, v1::download_image_file))
        .routes(routes!(v1::list_servers))
        .routes(routes!(v1::list_devices))
        .routes(routes!(v1::create_join_token))
        .routes(routes!(v1::get_server, v1::update_server))
        .routes(routes!(v1::device_events))
        .routes(routes!(v1::scrub_reports))
        .routes(routes!(v1::device_action))
        .routes(routes!(v1::revoke_credential))
        .routes(routes!(v1::capacity))
        .routes(routes!(v1::alerts))
        .routes(routes!(v1::audit))
        .routes(routes!(v1::usage))
        .routes(routes!(v1::placement_dry_run))
        .routes(routes!(v1::list_vms, v1::create_vm))
        .routes(routes!(v1::get_vm, v1::delete_vm))
        .routes(routes!(v1::vm_console))
        .routes(routes!(v1::stop_vm))
        .routes(routes!(v1::reboot_vm))
        .routes(routes!(v1::start_vm))
        .routes(routes!(v1::resize_vm))
        .routes(routes!(v1::migrate_vm))
        .routes(routes!(
            v1::list_vm_tags,
            v1::add_vm_tags,
            v1::replace_vm_tags,
            v1::delete_vm_tags
        ))
        .routes(routes!(v1::get_vm_tag, v1::delete_vm_tag))
        .routes(routes!(
            v1::list_vm_metadata,
            v1::add_vm_metadata,
            v1::replace_vm_metadata,
            v1::delete_vm_metadata
        ))
        .routes(routes!(v1::get_vm_metadata_key, v1::delete_vm_metadata_key))
        .routes(routes!(v1::list_jobs))
        .routes(routes!(v1::get_job))
        .split_for_parts();
    // Paths were written relative to /v1.
    let paths = std::mem::take(&mut doc.paths.paths);
    doc.paths.paths = paths
        .into_iter()
        .map(|(p, item)| (format!("/v1{p}"), item))
        .collect();
    close_variants(&mut doc, "ScrubAction");
    (router, doc)
}

/// The served document: utoipa's, plus the rules its attributes cannot state. The body
/// decoder and the query parser refuse NUL in every string, so every free string says so;
/// a package's device counts are keyed by variant names; a VM's `assigned_devices` needs
/// its `server_uuid`; answers link to the calls their values feed ([`links`]).
fn document(doc: &utoipa::openapi::OpenApi) -> serde_json::Value {
    use passage_model::api::MAX_DEVICES_PER_VM;
    use passage_model::variant::MAX_VARIANT_NAME_LEN;
    use serde_json::{Value, json};
    let mut v = serde_json::to_value(doc).unwrap_or(Value::Null);
    fn no_nul(v: &mut Value) {
        match v {
            Value::Object(o) => {
                let is_string = match o.get("type") {
                    Some(Value::String(t)) => t == "string",
                    Some(Value::Array(ts)) => ts.iter().any(|t| t == "string"),
                    _ => false,
                };
                let free = ["pattern", "format", "enum", "const"]
                    .iter()
                    .all(|k| !o.contains_key(*k));
                if is_string && free {
                    o.insert("pattern".into(), json!("^[^\\x00]*$"));
                }
                o.values_mut().for_each(no_nul);
            }
            Value::Array(a) => a.iter_mut().for_each(no_nul),
            _ => {}
        }
    }
    no_nul(&mut v);
    links::add(&mut v);
    let schemas = &mut v["components"]["schemas"];
    if let Some(devices) = schemas
        .pointer_mut("/CreatePackage/properties/devices")
        .and_then(Value::as_object_mut)
    {
        devices.insert(
            "propertyNames".into(),
            json!({"pattern": format!("^[A-Za-z0-9_.-]{{1,{MAX_VARIANT_NAME_LEN}}}$")}),
        );
        devices.insert(
            "additionalProperties".into(),
            json!({"type": "integer", "minimum": 1, "maximum": MAX_DEVICES_PER_VM}),
        );
    }
    if let Some(vm) = schemas.get_mut("CreateVm").and_then(Value::as_object_mut) {
        // `image` is an Option only so that its absence is answered naming it.
        if let Some(req) = vm.get_mut("required").and_then(Value::as_array_mut) {
            req.push(json!("image"));
        }
        // Devices named outright come with their server, and without a package; otherwise a
        // package is required, and a server, vcpus and memory are not named (the package
        // sets the last two).
        vm.insert(
            "if".into(),
            json!({"required": ["assigned_devices"],
                   "properties": {"assigned_devices": {"type": "array"}}}),
        );
        vm.insert(
            "then".into(),
            json!({"required": ["server_uuid"],
                   "properties": {"server_uuid": {"type": "string"}, "package": {"type": "null"}}}),
        );
        vm.insert(
            "else".into(),
            json!({"required": ["package"], "properties": {
                "package": {"type": "string"},
                "server_uuid": {"type": "null"},
                "vcpus": {"type": "null"},
                "memory_mib": {"type": "null"}
            }}),
        );
    }
    v
}

/// utoipa marks a `deny_unknown_fields` struct closed (`additionalProperties: false`) but
/// not the variants of such a tagged enum; the decoder refuses unknown fields in both, so
/// the document says so.
fn close_variants(doc: &mut utoipa::openapi::OpenApi, name: &str) {
    use utoipa::openapi::RefOr;
    use utoipa::openapi::schema::{AdditionalProperties, Schema};
    let Some(RefOr::T(Schema::OneOf(one_of))) = doc
        .components
        .as_mut()
        .and_then(|c| c.schemas.get_mut(name))
    else {
        return;
    };
    for item in &mut one_of.items {
        if let RefOr::T(Schema::Object(o)) = item {
            o.additional_properties = Some(Box::new(AdditionalProperties::FreeForm(false)));
        }
    }
}

#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "Passage",
        description = "GPU instances for your own datacenter: the public API."
    ),
    modifiers(&BearerAuth)
)]
struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

pub fn router(ctx: Ctx) -> Router {
    let (v1_router, doc) = v1_routes();
    let doc = std::sync::Arc::new(document(&doc));
    let v1: Router = v1_router
        .route(
            "/openapi.json",
            get(move || {
                let doc = doc.clone();
                async move { axum::Json((*doc).clone()) }
            }),
        )
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(API_BODY_LIMIT))
        .layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            audit::record,
        ))
        .layer(axum::middleware::from_fn(hardening::time_limit))
        .with_state(ctx.clone());
    let agent_api = Router::new()
        .route("/register", post(agent::register))
        .route("/heartbeat", post(agent::heartbeat))
        .route("/inventory", put(agent::inventory))
        .route("/tasks", get(agent::poll_tasks))
        .route("/tasks/results", post(agent::task_results))
        .route("/tasks/{uuid}/result", post(agent::task_result))
        .route("/tasks/{uuid}/progress", post(agent::task_progress))
        .route("/images/{sha256}", get(agent::image_file))
        .route("/vms/{uuid}/guest", get(agent::guest_metadata))
        .route("/credential", post(agent::rotate_credential))
        .route("/console/{session}", get(agent::console))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(AGENT_BODY_LIMIT));
    let cloudapi_ctx = ctx.clone();
    let app = Router::new()
        .route("/metrics", get(metrics::render))
        .nest("/agent/v1", agent_api)
        .with_state(ctx)
        .nest_service("/v1", v1.clone())
        .merge(crate::portal::router(
            v1,
            crate::cloudapi::router(cloudapi_ctx),
        ))
        // Portal forms post small bodies; nothing else is served here.
        .layer(DefaultBodyLimit::max(API_BODY_LIMIT));
    hardening::security_headers(app).layer(tower_http::trace::TraceLayer::new_for_http())
}

async fn not_found() -> impl IntoResponse {
    ApiError::new(ErrorCode::ResourceNotFound, "no such route")
}
