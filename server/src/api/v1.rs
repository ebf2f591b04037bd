//! Handlers of the public REST API under /v1: thin, they parse (bodies with `ApiJson`,
//! query strings with `ApiQuery` into the types of [`super::params`]), call a service,
//! answer. Who may do what is the services' to decide, not theirs; the errors every call
//! may answer are declared once, in [`ErrorResponses`].

use super::extract::{ApiJson, ApiQuery};
use super::params::{
    DeviceEventsQuery, DevicesQuery, ImagesQuery, JobsQuery, Keyset, Paging, ScrubReportsQuery,
    ServersQuery, UsageQuery, VmsQuery,
};
use crate::error::{ApiError, ApiResult, ErrorResponses};
use crate::listing::{Cursor, DeviceKey, Page, TimeKey};
use crate::services::auth::{self, Caller};
use crate::services::vm_labels::{self, Change};
use crate::services::{Ctx, accounts, catalog, images, keys, networks, ops, servers, vms};
use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
// Named only in the `#[utoipa::path]` attributes.
#[allow(unused_imports)]
use passage_model::api::{
    Account, Alert, ApiToken, AuditEntry, Capacity, CreateApiToken, DeviceActionRequest,
    DeviceEventRecord, DeviceRow, Job, JoinToken, LoginResponse, Package, PackageAvailability,
    PlacementDryRun, PlacementExplanation, ScrubRecord, Server, Usage, Vm, VmConsole,
};
use passage_model::api::{
    CreateAccount, CreateJoinToken, CreatePackage, CreateVm, LoginRequest, Ping, UpdateAccount,
    UpdateServer,
};
#[allow(unused_imports)]
use passage_model::images::Image;
use passage_model::images::{CreateImage, Sha256, UpdateImage};
use passage_model::keys::{CreateSshKey, SshKey};
use passage_model::networks::{CreateNetwork, Network, NetworkIp, UpdateNetwork};
use passage_model::{
    AccountId, ApiErrorBody, ImageId, JobId, NetworkId, PackageId, ServerId, Variant, VmId,
};
use serde::Serialize;
use std::collections::BTreeMap;

/// A list answer: the items, with the total in `x-resource-count`.
fn listed<T: Serialize>(items: Vec<T>, total: i64) -> Response {
    let mut r = Json(items).into_response();
    if let Ok(v) = HeaderValue::from_str(&total.to_string()) {
        r.headers_mut()
            .insert(HeaderName::from_static("x-resource-count"), v);
    }
    r
}

/// A page of a list: the items, the total in `x-resource-count`, and when more follow,
/// the cursor of the next page in `x-next-cursor`.
fn paged<T: Serialize, K: Cursor>(page: Page<T, K>) -> Response {
    let mut r = listed(page.items, page.total);
    if let Some(v) = page
        .next
        .and_then(|k| HeaderValue::from_str(&k.encode()).ok())
    {
        r.headers_mut()
            .insert(HeaderName::from_static("x-next-cursor"), v);
    }
    r
}

fn id<T: std::str::FromStr>(raw: &str, what: &'static str) -> ApiResult<T> {
    // A malformed id cannot name anything: same answer as an unknown one.
    raw.parse().map_err(|_| ApiError::not_found(what))
}

#[utoipa::path(get, path = "/ping", tag = "meta", responses((status = 200, description = "Alive", body = Ping)))]
pub async fn ping() -> Json<Ping> {
    Json(Ping {
        ok: true,
        version: env!("CARGO_PKG_VERSION").to_string(),
    })
}

#[utoipa::path(post, path = "/auth/login", tag = "auth", request_body = LoginRequest, responses((status = 200, description = "A bearer token", body = LoginResponse), (status = 400, description = "Invalid argument", body = ApiErrorBody), (status = 401, description = "Wrong login or password", body = ApiErrorBody), (status = 429, description = "Too many failed logins", body = ApiErrorBody), (status = 413, description = "Body too large", body = ApiErrorBody)))]
pub async fn login(
    State(ctx): State<Ctx>,
    super::extract::ClientAddr(addr): super::extract::ClientAddr,
    ApiJson(req): ApiJson<LoginRequest>,
) -> ApiResult<Response> {
    let r = auth::login(&ctx, &req.login, &req.password, addr).await?;
    Ok(Json(r).into_response())
}

#[utoipa::path(post, path = "/auth/logout", tag = "auth", responses((status = 204, description = "The token is revoked"), ErrorResponses), security(("bearer" = [])))]
pub async fn logout(
    State(ctx): State<Ctx>,
    _caller: Caller,
    headers: HeaderMap,
) -> ApiResult<StatusCode> {
    if let Some(t) = crate::api::extract::session_credential(&headers) {
        auth::logout(&ctx, &t).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/auth/me", tag = "auth", responses((status = 200, description = "The caller's own account", body = Account), ErrorResponses), security(("bearer" = [])))]
pub async fn me(caller: Caller) -> Json<Account> {
    Json(caller.account)
}

// ---- accounts ----

#[utoipa::path(get, path = "/accounts", tag = "accounts", params(Paging), responses((status = 200, description = "Accounts, newest first", body = [Account]), ErrorResponses), security(("bearer" = [])))]
pub async fn list_accounts(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiQuery(page): ApiQuery<Paging>,
) -> ApiResult<Response> {
    let (limit, offset) = page.bounds()?;
    let (items, total) = accounts::list(&ctx, &caller, limit, offset).await?;
    Ok(listed(items, total))
}

#[utoipa::path(post, path = "/accounts", tag = "accounts", request_body = CreateAccount, responses((status = 201, description = "Created", body = Account), ErrorResponses), security(("bearer" = [])))]
pub async fn create_account(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateAccount>,
) -> ApiResult<Response> {
    let a = accounts::create(&ctx, &caller, req).await?;
    Ok((StatusCode::CREATED, Json(a)).into_response())
}

#[utoipa::path(get, path = "/accounts/{uuid}", tag = "accounts", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 200, description = "The account", body = Account), ErrorResponses), security(("bearer" = [])))]
pub async fn get_account(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let uuid: AccountId = id(&raw, "account")?;
    Ok(Json(accounts::get(&ctx, &caller, uuid).await?).into_response())
}

#[utoipa::path(patch, path = "/accounts/{uuid}", tag = "accounts", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), request_body = UpdateAccount, responses((status = 200, description = "Updated", body = Account), ErrorResponses), security(("bearer" = [])))]
pub async fn update_account(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(req): ApiJson<UpdateAccount>,
) -> ApiResult<Response> {
    let uuid: AccountId = id(&raw, "account")?;
    Ok(Json(accounts::update(&ctx, &caller, uuid, req).await?).into_response())
}

#[utoipa::path(delete, path = "/accounts/{uuid}", tag = "accounts", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 204, description = "Deleted"), ErrorResponses), security(("bearer" = [])))]
pub async fn delete_account(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<StatusCode> {
    let uuid: AccountId = id(&raw, "account")?;
    accounts::delete(&ctx, &caller, uuid).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- variants ----

#[utoipa::path(get, path = "/variants", tag = "variants", params(Paging), responses((status = 200, description = "Variants, newest first", body = [Variant]), ErrorResponses), security(("bearer" = [])))]
pub async fn list_variants(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiQuery(page): ApiQuery<Paging>,
) -> ApiResult<Response> {
    let (limit, offset) = page.bounds()?;
    let (items, total) = catalog::list_variants(&ctx, &caller, limit, offset).await?;
    Ok(listed(items, total))
}

#[utoipa::path(post, path = "/variants", tag = "variants", request_body = Variant, responses((status = 201, description = "Created", body = Variant), ErrorResponses), security(("bearer" = [])))]
pub async fn create_variant(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiJson(v): ApiJson<Variant>,
) -> ApiResult<Response> {
    let (v, detail) = catalog::create_variant(&ctx, &caller, v).await?;
    let mut resp = (StatusCode::CREATED, Json(v)).into_response();
    if let Some(d) = detail {
        resp.extensions_mut().insert(d);
    }
    Ok(resp)
}

#[utoipa::path(get, path = "/variants/{name}", tag = "variants", params(("name" = String, Path, description = "The variant's name")), responses((status = 200, description = "The variant", body = Variant), ErrorResponses), security(("bearer" = [])))]
pub async fn get_variant(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult<Response> {
    Ok(Json(catalog::get_variant(&ctx, &caller, &name).await?).into_response())
}

#[utoipa::path(put, path = "/variants/{name}", tag = "variants", params(("name" = String, Path, description = "The variant's name")), request_body = Variant, responses((status = 200, description = "Replaced", body = Variant), ErrorResponses), security(("bearer" = [])))]
pub async fn put_variant(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(name): Path<String>,
    ApiJson(v): ApiJson<Variant>,
) -> ApiResult<Response> {
    let (v, detail) = catalog::put_variant(&ctx, &caller, &name, v).await?;
    let mut resp = Json(v).into_response();
    if let Some(d) = detail {
        resp.extensions_mut().insert(d);
    }
    Ok(resp)
}

#[utoipa::path(delete, path = "/variants/{name}", tag = "variants", params(("name" = String, Path, description = "The variant's name")), responses((status = 204, description = "Deleted"), ErrorResponses), security(("bearer" = [])))]
pub async fn delete_variant(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    catalog::delete_variant(&ctx, &caller, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- packages ----

#[utoipa::path(get, path = "/packages", tag = "packages", params(Paging), responses((status = 200, description = "Packages, newest first", body = [Package]), ErrorResponses), security(("bearer" = [])))]
pub async fn list_packages(
    State(ctx): State<Ctx>,
    _caller: Caller,
    ApiQuery(page): ApiQuery<Paging>,
) -> ApiResult<Response> {
    let (limit, offset) = page.bounds()?;
    let (items, total) = catalog::list_packages(&ctx, limit, offset).await?;
    Ok(listed(items, total))
}

#[utoipa::path(post, path = "/packages", tag = "packages", request_body = CreatePackage, responses((status = 201, description = "Created", body = Package), ErrorResponses), security(("bearer" = [])))]
pub async fn create_package(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiJson(req): ApiJson<CreatePackage>,
) -> ApiResult<Response> {
    let p = catalog::create_package(&ctx, &caller, req).await?;
    Ok((StatusCode::CREATED, Json(p)).into_response())
}

#[utoipa::path(get, path = "/packages/{uuid}", tag = "packages", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 200, description = "The package", body = Package), ErrorResponses), security(("bearer" = [])))]
pub async fn get_package(
    State(ctx): State<Ctx>,
    _caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let uuid: PackageId = id(&raw, "package")?;
    Ok(Json(catalog::get_package(&ctx, uuid).await?).into_response())
}

#[utoipa::path(get, path = "/packages/{uuid}/availability", tag = "packages", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 200, description = "Whether the caller could get this package now (capacity and quota)", body = PackageAvailability), ErrorResponses), security(("bearer" = [])))]
pub async fn package_availability(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let uuid: PackageId = id(&raw, "package")?;
    Ok(Json(vms::availability(&ctx, &caller, uuid).await?).into_response())
}

#[utoipa::path(delete, path = "/packages/{uuid}", tag = "packages", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 204, description = "Deleted"), ErrorResponses), security(("bearer" = [])))]
pub async fn delete_package(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<StatusCode> {
    let uuid: PackageId = id(&raw, "package")?;
    catalog::delete_package(&ctx, &caller, uuid).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- servers ----

#[utoipa::path(get, path = "/servers", tag = "servers", params(Keyset<TimeKey>, ServersQuery), responses((status = 200, description = "Compute nodes, newest first (then by uuid, descending)", body = [Server], headers(("x-resource-count" = i64, description = "How many items match the filters, all pages together"), ("x-next-cursor" = String, description = "Present when more items follow: pass it as after to get the next page"))), ErrorResponses), security(("bearer" = [])))]
pub async fn list_servers(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiQuery(page): ApiQuery<Keyset<TimeKey>>,
    ApiQuery(q): ApiQuery<ServersQuery>,
) -> ApiResult<Response> {
    let detail = if q.brief == Some(true) {
        servers::Detail::Brief
    } else {
        servers::Detail::Full
    };
    Ok(paged(
        servers::list(&ctx, &caller, q.status, detail, &page.request()?).await?,
    ))
}

#[utoipa::path(get, path = "/devices", tag = "servers", params(Keyset<DeviceKey>, DevicesQuery), responses((status = 200, description = "The assignable devices (those matching a variant) of every server, ordered by server hostname, then server uuid, then device id, ascending", body = [DeviceRow], headers(("x-resource-count" = i64, description = "How many items match the filters, all pages together"), ("x-next-cursor" = String, description = "Present when more items follow: pass it as after to get the next page"))), ErrorResponses), security(("bearer" = [])))]
pub async fn list_devices(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiQuery(page): ApiQuery<Keyset<DeviceKey>>,
    ApiQuery(q): ApiQuery<DevicesQuery>,
) -> ApiResult<Response> {
    let req = page.request()?;
    Ok(paged(
        servers::list_devices(&ctx, &caller, &q.filter()?, &req).await?,
    ))
}

#[utoipa::path(get, path = "/servers/{uuid}", tag = "servers", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 200, description = "The compute node", body = Server), ErrorResponses), security(("bearer" = [])))]
pub async fn get_server(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let uuid: ServerId = id(&raw, "server")?;
    Ok(Json(servers::get(&ctx, &caller, uuid).await?).into_response())
}

#[utoipa::path(patch, path = "/servers/{uuid}", tag = "servers", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), request_body = UpdateServer, responses((status = 200, description = "Updated", body = Server), ErrorResponses), security(("bearer" = [])))]
pub async fn update_server(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(req): ApiJson<UpdateServer>,
) -> ApiResult<Response> {
    let uuid: ServerId = id(&raw, "server")?;
    Ok(Json(servers::update(&ctx, &caller, uuid, req).await?).into_response())
}

#[utoipa::path(post, path = "/servers/join-tokens", tag = "servers", request_body(content = Option<CreateJoinToken>, description = "Optional", content_type = "application/json"), responses((status = 201, description = "A single-use token admitting one node", body = JoinToken), ErrorResponses), security(("bearer" = [])))]
pub async fn create_join_token(
    State(ctx): State<Ctx>,
    caller: Caller,
    body: axum::body::Bytes,
) -> ApiResult<Response> {
    // No body, or JSON `null`, asks for the defaults.
    let text = body.trim_ascii();
    let req: CreateJoinToken = if text.is_empty() || text == b"null" {
        CreateJoinToken::default()
    } else {
        super::extract::parse_json(&body)?
    };
    let t = servers::create_join_token(&ctx, &caller, req).await?;
    Ok((StatusCode::CREATED, Json(t)).into_response())
}

#[utoipa::path(get, path = "/servers/{uuid}/device-events", tag = "servers", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid"), DeviceEventsQuery), responses((status = 200, description = "State changes, oldest first", body = [DeviceEventRecord]), ErrorResponses), security(("bearer" = [])))]
pub async fn device_events(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiQuery(q): ApiQuery<DeviceEventsQuery>,
) -> ApiResult<Response> {
    let uuid: ServerId = id(&raw, "server")?;
    let device = q.device.as_ref().map(ToString::to_string);
    let items = servers::device_events(&ctx, &caller, uuid, device.as_deref(), q.last()?).await?;
    let n = items.len() as i64;
    Ok(listed(items, n))
}

#[utoipa::path(get, path = "/servers/{uuid}/scrub-reports", tag = "servers", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid"), ScrubReportsQuery), responses((status = 200, description = "Scrub reports, oldest first", body = [ScrubRecord]), ErrorResponses), security(("bearer" = [])))]
pub async fn scrub_reports(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiQuery(q): ApiQuery<ScrubReportsQuery>,
) -> ApiResult<Response> {
    let uuid: ServerId = id(&raw, "server")?;
    let device = q.device.as_ref().map(ToString::to_string);
    let items = servers::scrub_reports(&ctx, &caller, uuid, device.as_deref()).await?;
    let n = items.len() as i64;
    Ok(listed(items, n))
}

// ---- vms and jobs ----

#[utoipa::path(get, path = "/vms", tag = "vms", params(Keyset<TimeKey>, VmsQuery), responses((status = 200, description = "VMs, newest first (then by uuid, descending)", body = [Vm], headers(("x-resource-count" = i64, description = "How many items match the filters, all pages together"), ("x-next-cursor" = String, description = "Present when more items follow: pass it as after to get the next page"))), ErrorResponses), security(("bearer" = [])))]
pub async fn list_vms(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiQuery(page): ApiQuery<Keyset<TimeKey>>,
    ApiQuery(q): ApiQuery<VmsQuery>,
) -> ApiResult<Response> {
    let req = page.request()?;
    Ok(paged(vms::list(&ctx, &caller, q.into(), &req).await?))
}

#[utoipa::path(post, path = "/vms", tag = "vms", request_body = CreateVm, responses((status = 202, description = "Placed and reserved; provisioning", body = Vm), ErrorResponses), security(("bearer" = [])))]
pub async fn create_vm(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateVm>,
) -> ApiResult<Response> {
    let vm = vms::create(&ctx, &caller, req).await?;
    Ok((StatusCode::ACCEPTED, Json(vm)).into_response())
}

#[utoipa::path(get, path = "/vms/{uuid}", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 200, description = "The VM", body = Vm), ErrorResponses), security(("bearer" = [])))]
pub async fn get_vm(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    Ok(Json(vms::get(&ctx, &caller, uuid).await?).into_response())
}

#[utoipa::path(get, path = "/vms/{uuid}/console", tag = "vms", description = "Without `Upgrade: websocket`: the end of the VM's serial console as text. With it: an interactive console, one session per VM at a time. Binary frames carry the serial port's raw bytes both ways; text frames from the client are taken as their UTF-8 bytes. The client authenticates with its bearer token, or the portal's session cookie from a page of this server (`Origin`). Messages up to 64 KiB; closed after 30 minutes without traffic (1008), when the VM stops (1000), or when its node cannot attach or drops (1011), the close reason saying why. Opening, refusal and closing are audited.", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 200, description = "The last 64 KiB of the VM's serial console, read from its node now", body = VmConsole), (status = 101, description = "Upgraded: the interactive console"), (status = 409, description = "The VM has no console now (never placed, destroyed, not running for a websocket), its node did not answer, or (websocket) a session is open already", body = ApiErrorBody), ErrorResponses), security(("bearer" = [])))]
pub async fn vm_console(
    State(ctx): State<Ctx>,
    headers: HeaderMap,
    upgrade: Result<
        axum::extract::ws::WebSocketUpgrade,
        axum::extract::ws::rejection::WebSocketUpgradeRejection,
    >,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let wants_socket = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    if !wants_socket {
        let token =
            super::extract::session_credential(&headers).ok_or_else(ApiError::unauthorized)?;
        let caller = Caller {
            account: auth::caller_from_token(&ctx, &token).await?,
        };
        let uuid: VmId = id(&raw, "vm")?;
        return Ok(Json(vms::console(&ctx, &caller, uuid).await?).into_response());
    }
    let upgrade = match upgrade {
        Ok(u) => u,
        Err(e) => return Ok(e.into_response()),
    };
    let path = format!("/v1/vms/{raw}/console");
    let mut actor = None;
    let admitted = async {
        let token =
            super::extract::socket_credential(&headers)?.ok_or_else(ApiError::unauthorized)?;
        let caller = Caller {
            account: auth::caller_from_token(&ctx, &token).await?,
        };
        actor = Some((caller.account.uuid, caller.account.login.clone()));
        let uuid: VmId = id(&raw, "vm")?;
        crate::services::console::admit(&ctx, &caller, uuid).await
    }
    .await;
    let session = match admitted {
        Ok(s) => s,
        Err(e) => {
            let status = e.code.http_status();
            crate::services::console::audit(&ctx, actor, "GET", &path, status).await;
            return Err(e);
        }
    };
    crate::services::console::audit(&ctx, actor, "GET", &path, 101).await;
    let max = crate::services::console::MAX_MESSAGE;
    Ok(upgrade
        .max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| crate::services::console::serve(ctx, session, socket))
        .into_response())
}

#[utoipa::path(delete, path = "/vms/{uuid}", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 202, description = "Destroying", body = Vm), ErrorResponses), security(("bearer" = [])))]
pub async fn delete_vm(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    let vm = vms::destroy(&ctx, &caller, uuid).await?;
    Ok((StatusCode::ACCEPTED, Json(vm)).into_response())
}

#[utoipa::path(get, path = "/jobs/{uuid}", tag = "jobs", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 200, description = "The job and its steps", body = Job), ErrorResponses), security(("bearer" = [])))]
pub async fn get_job(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let uuid: JobId = id(&raw, "job")?;
    Ok(Json(vms::job(&ctx, &caller, uuid).await?).into_response())
}

#[utoipa::path(get, path = "/jobs", tag = "jobs", params(Keyset<TimeKey>, JobsQuery), responses((status = 200, description = "Jobs, newest first (then by uuid, descending)", body = [Job], headers(("x-resource-count" = i64, description = "How many items match the filters, all pages together"), ("x-next-cursor" = String, description = "Present when more items follow: pass it as after to get the next page"))), ErrorResponses), security(("bearer" = [])))]
pub async fn list_jobs(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiQuery(page): ApiQuery<Keyset<TimeKey>>,
    ApiQuery(q): ApiQuery<JobsQuery>,
) -> ApiResult<Response> {
    let req = page.request()?;
    Ok(paged(vms::list_jobs(&ctx, &caller, q.state, &req).await?))
}

// ---- the caller's API tokens ----

#[utoipa::path(get, path = "/tokens", tag = "auth", responses((status = 200, description = "The caller's API tokens (without secrets)", body = [ApiToken]), ErrorResponses), security(("bearer" = [])))]
pub async fn list_tokens(State(ctx): State<Ctx>, caller: Caller) -> ApiResult<Response> {
    let items = auth::list_api_tokens(&ctx, &caller).await?;
    let n = items.len() as i64;
    Ok(listed(items, n))
}

#[utoipa::path(post, path = "/tokens", tag = "auth", request_body = CreateApiToken, responses((status = 201, description = "The token; its secret is shown this once", body = ApiToken), ErrorResponses), security(("bearer" = [])))]
pub async fn create_token(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiJson(req): ApiJson<passage_model::api::CreateApiToken>,
) -> ApiResult<Response> {
    let t = auth::create_api_token(&ctx, &caller, req).await?;
    Ok((StatusCode::CREATED, Json(t)).into_response())
}

#[utoipa::path(delete, path = "/tokens/{uuid}", tag = "auth", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 204, description = "Revoked"), ErrorResponses), security(("bearer" = [])))]
pub async fn delete_token(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<StatusCode> {
    let uuid: uuid::Uuid = id(&raw, "token")?;
    auth::delete_api_token(&ctx, &caller, uuid).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- networks ----

#[utoipa::path(get, path = "/networks", tag = "networks", params(Paging), responses((status = 200, description = "Networks, newest first: for tenants, public ones and those made for them", body = [Network], headers(("x-resource-count" = i64, description = "How many networks the caller sees"))), ErrorResponses), security(("bearer" = [])))]
pub async fn list_networks(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiQuery(page): ApiQuery<Paging>,
) -> ApiResult<Response> {
    let (limit, offset) = page.bounds()?;
    let (items, total) = networks::list(&ctx, &caller, limit, offset).await?;
    Ok(listed(items, total))
}

#[utoipa::path(post, path = "/networks", tag = "networks", request_body = CreateNetwork, responses((status = 201, description = "Created (operators)", body = Network), (status = 409, description = "The name is taken, or the subnet overlaps another on the same bridge and VLAN", body = ApiErrorBody), ErrorResponses), security(("bearer" = [])))]
pub async fn create_network(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateNetwork>,
) -> ApiResult<Response> {
    let n = networks::create(&ctx, &caller, req).await?;
    Ok((StatusCode::CREATED, Json(n)).into_response())
}

#[utoipa::path(get, path = "/networks/{uuid}", tag = "networks", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 200, description = "The network", body = Network), ErrorResponses), security(("bearer" = [])))]
pub async fn get_network(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let uuid: NetworkId = id(&raw, "network")?;
    Ok(Json(networks::get(&ctx, &caller, uuid).await?).into_response())
}

#[utoipa::path(patch, path = "/networks/{uuid}", tag = "networks", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), request_body = UpdateNetwork, responses((status = 200, description = "Updated (operators)", body = Network), ErrorResponses), security(("bearer" = [])))]
pub async fn update_network(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(req): ApiJson<UpdateNetwork>,
) -> ApiResult<Response> {
    let uuid: NetworkId = id(&raw, "network")?;
    Ok(Json(networks::update(&ctx, &caller, uuid, req).await?).into_response())
}

#[utoipa::path(delete, path = "/networks/{uuid}", tag = "networks", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 204, description = "Deleted (operators)"), ErrorResponses), security(("bearer" = [])))]
pub async fn delete_network(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<StatusCode> {
    let uuid: NetworkId = id(&raw, "network")?;
    networks::delete(&ctx, &caller, uuid).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/networks/{uuid}/ips", tag = "networks", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid"), Paging), responses((status = 200, description = "The network's addresses in use and the VMs holding them, ascending (operators)", body = [NetworkIp], headers(("x-resource-count" = i64, description = "How many addresses are in use"))), ErrorResponses), security(("bearer" = [])))]
pub async fn list_network_ips(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiQuery(page): ApiQuery<Paging>,
) -> ApiResult<Response> {
    let uuid: NetworkId = id(&raw, "network")?;
    let (limit, offset) = page.bounds()?;
    let (items, total) = networks::ips(&ctx, &caller, uuid, limit, offset).await?;
    Ok(listed(items, total))
}

// ---- SSH keys ----

const KEY_NAME: &str = "The key's name (URL-encoded)";

#[utoipa::path(get, path = "/keys", tag = "keys", params(Paging), responses((status = 200, description = "The caller's SSH keys, newest first", body = [SshKey], headers(("x-resource-count" = i64, description = "How many keys the account has"))), ErrorResponses), security(("bearer" = [])))]
pub async fn list_keys(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiQuery(page): ApiQuery<Paging>,
) -> ApiResult<Response> {
    let (limit, offset) = page.bounds()?;
    let me = caller.account.uuid;
    let (items, total) = keys::list(&ctx, &caller, me, limit, offset).await?;
    Ok(listed(items, total))
}

#[utoipa::path(post, path = "/keys", tag = "keys", request_body = CreateSshKey, responses((status = 201, description = "Added", body = SshKey), (status = 409, description = "A key of that name, the same key, or too many keys", body = ApiErrorBody), ErrorResponses), security(("bearer" = [])))]
pub async fn create_key(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateSshKey>,
) -> ApiResult<Response> {
    let me = caller.account.uuid;
    let k = keys::create(&ctx, &caller, me, req).await?;
    Ok((StatusCode::CREATED, Json(k)).into_response())
}

#[utoipa::path(get, path = "/keys/{name}", tag = "keys", params(("name" = String, Path, description = KEY_NAME)), responses((status = 200, description = "The key", body = SshKey), ErrorResponses), security(("bearer" = [])))]
pub async fn get_key(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult<Response> {
    let me = caller.account.uuid;
    Ok(Json(keys::get(&ctx, &caller, me, &name).await?).into_response())
}

#[utoipa::path(delete, path = "/keys/{name}", tag = "keys", params(("name" = String, Path, description = KEY_NAME)), responses((status = 204, description = "Deleted"), ErrorResponses), security(("bearer" = [])))]
pub async fn delete_key(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    let me = caller.account.uuid;
    keys::delete(&ctx, &caller, me, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/accounts/{uuid}/keys", tag = "keys", params(("uuid" = String, Path, format = Uuid, description = "The account's uuid"), Paging), responses((status = 200, description = "The account's SSH keys, newest first (operators and readers; anyone for their own)", body = [SshKey], headers(("x-resource-count" = i64, description = "How many keys the account has"))), ErrorResponses), security(("bearer" = [])))]
pub async fn list_account_keys(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiQuery(page): ApiQuery<Paging>,
) -> ApiResult<Response> {
    let account: AccountId = id(&raw, "account")?;
    let (limit, offset) = page.bounds()?;
    let (items, total) = keys::list(&ctx, &caller, account, limit, offset).await?;
    Ok(listed(items, total))
}

#[utoipa::path(post, path = "/accounts/{uuid}/keys", tag = "keys", params(("uuid" = String, Path, format = Uuid, description = "The account's uuid")), request_body = CreateSshKey, responses((status = 201, description = "Added (operators; anyone to their own account)", body = SshKey), (status = 409, description = "A key of that name, the same key, or too many keys", body = ApiErrorBody), ErrorResponses), security(("bearer" = [])))]
pub async fn create_account_key(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(req): ApiJson<CreateSshKey>,
) -> ApiResult<Response> {
    let account: AccountId = id(&raw, "account")?;
    let k = keys::create(&ctx, &caller, account, req).await?;
    Ok((StatusCode::CREATED, Json(k)).into_response())
}

#[utoipa::path(get, path = "/accounts/{uuid}/keys/{name}", tag = "keys", params(("uuid" = String, Path, format = Uuid, description = "The account's uuid"), ("name" = String, Path, description = KEY_NAME)), responses((status = 200, description = "The key", body = SshKey), ErrorResponses), security(("bearer" = [])))]
pub async fn get_account_key(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path((raw, name)): Path<(String, String)>,
) -> ApiResult<Response> {
    let account: AccountId = id(&raw, "account")?;
    Ok(Json(keys::get(&ctx, &caller, account, &name).await?).into_response())
}

#[utoipa::path(delete, path = "/accounts/{uuid}/keys/{name}", tag = "keys", params(("uuid" = String, Path, format = Uuid, description = "The account's uuid"), ("name" = String, Path, description = KEY_NAME)), responses((status = 204, description = "Deleted"), ErrorResponses), security(("bearer" = [])))]
pub async fn delete_account_key(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path((raw, name)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let account: AccountId = id(&raw, "account")?;
    keys::delete(&ctx, &caller, account, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- operations ----

#[utoipa::path(get, path = "/capacity", tag = "operations", responses((status = 200, description = "Devices per variant by state", body = [Capacity]), ErrorResponses), security(("bearer" = [])))]
pub async fn capacity(State(ctx): State<Ctx>, caller: Caller) -> ApiResult<Response> {
    let items = ops::capacity(&ctx, &caller).await?;
    let n = items.len() as i64;
    Ok(listed(items, n))
}

#[utoipa::path(get, path = "/alerts", tag = "operations", params(Paging), responses((status = 200, description = "Alerts, newest first", body = [Alert]), ErrorResponses), security(("bearer" = [])))]
pub async fn alerts(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiQuery(page): ApiQuery<Paging>,
) -> ApiResult<Response> {
    let (limit, offset) = page.bounds()?;
    let (items, total) = ops::alerts(&ctx, &caller, limit, offset).await?;
    Ok(listed(items, total))
}

#[utoipa::path(get, path = "/audit", tag = "operations", params(Paging), responses((status = 200, description = "State-changing calls, newest first", body = [AuditEntry]), ErrorResponses), security(("bearer" = [])))]
pub async fn audit(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiQuery(page): ApiQuery<Paging>,
) -> ApiResult<Response> {
    let (limit, offset) = page.bounds()?;
    let (items, total) = ops::audit(&ctx, &caller, limit, offset).await?;
    Ok(listed(items, total))
}

#[utoipa::path(get, path = "/usage", tag = "operations", params(UsageQuery), responses((status = 200, description = "GPU-hours", body = Usage), ErrorResponses), security(("bearer" = [])))]
pub async fn usage(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiQuery(q): ApiQuery<UsageQuery>,
) -> ApiResult<Response> {
    let u = ops::usage(&ctx, &caller, q.owner_uuid, q.start()?, q.end()?).await?;
    Ok(Json(u).into_response())
}

#[utoipa::path(post, path = "/servers/{uuid}/device-actions", tag = "servers", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), request_body = DeviceActionRequest, responses((status = 200, description = "The device's history after the action", body = [DeviceEventRecord]), ErrorResponses), security(("bearer" = [])))]
pub async fn device_action(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(req): ApiJson<passage_model::api::DeviceActionRequest>,
) -> ApiResult<Response> {
    let uuid: ServerId = id(&raw, "server")?;
    let history = ops::device_action(&ctx, &caller, uuid, req).await?;
    Ok(Json(history).into_response())
}

#[utoipa::path(post, path = "/placement/dry-run", tag = "operations", request_body = PlacementDryRun, responses((status = 200, description = "Where the package would go, and why not elsewhere", body = PlacementExplanation), ErrorResponses), security(("bearer" = [])))]
pub async fn placement_dry_run(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiJson(req): ApiJson<passage_model::api::PlacementDryRun>,
) -> ApiResult<Response> {
    Ok(Json(ops::dry_run(&ctx, &caller, &req.package).await?).into_response())
}

#[utoipa::path(delete, path = "/servers/{uuid}/credential", tag = "servers", params(("uuid" = String, Path, format = Uuid, description = "The server's uuid")), responses((status = 204, description = "Revoked: the node's agent is refused until re-admitted"), (status = 401, description = "No valid credentials", body = ApiErrorBody), (status = 403, description = "The caller's role may not do this", body = ApiErrorBody), (status = 404, description = "Not found", body = ApiErrorBody)), security(("bearer" = [])))]
pub async fn revoke_credential(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<StatusCode> {
    let uuid: ServerId = id(&raw, "server")?;
    servers::revoke_credential(&ctx, &caller, uuid).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The optional body of a stop or a reboot: none, or `{"force": bool}`.
fn stop_body(body: &[u8]) -> ApiResult<passage_model::api::StopVm> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(passage_model::api::StopVm::default());
    }
    crate::api::extract::parse_json(body)
}

#[utoipa::path(post, path = "/vms/{uuid}/stop", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid")), request_body(content = passage_model::api::StopVm, description = "Optional: `force` powers the VM off at once instead of asking its guest to shut down"), responses((status = 202, description = "Stopping: the guest is asked to shut down (the VM shows `stopping`)", body = Vm), ErrorResponses), security(("bearer" = [])))]
pub async fn stop_vm(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    body: axum::body::Bytes,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    let req = stop_body(&body)?;
    let vm = crate::services::vm_ops::stop(&ctx, &caller, uuid, req.force).await?;
    Ok((StatusCode::ACCEPTED, Json(vm)).into_response())
}

#[utoipa::path(post, path = "/vms/{uuid}/reboot", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid")), request_body(content = passage_model::api::StopVm, description = "Optional: `force` resets the VM instead of asking its guest to shut down"), responses((status = 202, description = "Rebooting: a clean stop, then a start, in one job", body = Vm), ErrorResponses), security(("bearer" = [])))]
pub async fn reboot_vm(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    body: axum::body::Bytes,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    let req = stop_body(&body)?;
    let vm = crate::services::vm_ops::reboot(&ctx, &caller, uuid, req.force).await?;
    Ok((StatusCode::ACCEPTED, Json(vm)).into_response())
}

#[utoipa::path(post, path = "/vms/{uuid}/start", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid")), responses((status = 202, description = "Starting", body = Vm), ErrorResponses), security(("bearer" = [])))]
pub async fn start_vm(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    let vm = crate::services::vm_ops::start(&ctx, &caller, uuid).await?;
    Ok((StatusCode::ACCEPTED, Json(vm)).into_response())
}

#[utoipa::path(post, path = "/vms/{uuid}/resize", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid")), request_body = passage_model::api::ResizeVm, responses((status = 202, description = "Resizing (new devices reserved)", body = Vm), ErrorResponses), security(("bearer" = [])))]
pub async fn resize_vm(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(req): ApiJson<passage_model::api::ResizeVm>,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    let vm = crate::services::vm_ops::resize(&ctx, &caller, uuid, &req.package).await?;
    Ok((StatusCode::ACCEPTED, Json(vm)).into_response())
}

#[utoipa::path(post, path = "/vms/{uuid}/migrate", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid")), request_body = passage_model::api::MigrateVm, responses((status = 202, description = "Migrating (devices on the target reserved)", body = Vm), ErrorResponses), security(("bearer" = [])))]
pub async fn migrate_vm(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(req): ApiJson<passage_model::api::MigrateVm>,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    let vm = crate::services::vm_ops::migrate(&ctx, &caller, uuid, req.server_uuid).await?;
    Ok((StatusCode::ACCEPTED, Json(vm)).into_response())
}

// ---- images ----

#[utoipa::path(get, path = "/images", tag = "images", params(Paging, ImagesQuery), responses((status = 200, description = "Images, newest first: for tenants, active public images and their own", body = [Image], headers(("x-resource-count" = i64, description = "How many images match the filters"))), ErrorResponses), security(("bearer" = [])))]
pub async fn list_images(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiQuery(page): ApiQuery<Paging>,
    ApiQuery(q): ApiQuery<ImagesQuery>,
) -> ApiResult<Response> {
    let (limit, offset) = page.bounds()?;
    let (items, total) = images::list(&ctx, &caller, q.into(), limit, offset).await?;
    Ok(listed(items, total))
}

#[utoipa::path(post, path = "/images", tag = "images", request_body = CreateImage, responses((status = 201, description = "Created, unactivated until its file is uploaded", body = Image), ErrorResponses), security(("bearer" = [])))]
pub async fn create_image(
    State(ctx): State<Ctx>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateImage>,
) -> ApiResult<Response> {
    let img = images::create(&ctx, &caller, req).await?;
    Ok((StatusCode::CREATED, Json(img)).into_response())
}

#[utoipa::path(get, path = "/images/{uuid}", tag = "images", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 200, description = "The image", body = Image), ErrorResponses), security(("bearer" = [])))]
pub async fn get_image(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let uuid: ImageId = id(&raw, "image")?;
    Ok(Json(images::get(&ctx, &caller, uuid).await?).into_response())
}

#[utoipa::path(patch, path = "/images/{uuid}", tag = "images", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), request_body = UpdateImage, responses((status = 200, description = "Updated", body = Image), ErrorResponses), security(("bearer" = [])))]
pub async fn update_image(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(req): ApiJson<UpdateImage>,
) -> ApiResult<Response> {
    let uuid: ImageId = id(&raw, "image")?;
    Ok(Json(images::update(&ctx, &caller, uuid, req).await?).into_response())
}

#[utoipa::path(delete, path = "/images/{uuid}", tag = "images", params(("uuid" = String, Path, format = Uuid, description = "The object's uuid")), responses((status = 204, description = "Deleted, or disabled when VMs were built from it"), ErrorResponses), security(("bearer" = [])))]
pub async fn delete_image(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<StatusCode> {
    let uuid: ImageId = id(&raw, "image")?;
    images::delete(&ctx, &caller, uuid).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The `x-content-sha256` header, when given.
fn content_sha256(headers: &HeaderMap) -> ApiResult<Option<Sha256>> {
    headers
        .get("x-content-sha256")
        .map(|v| {
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<Sha256>().ok())
                .ok_or_else(|| ApiError::invalid("x-content-sha256", "must be 64 hex digits"))
        })
        .transpose()
}

#[utoipa::path(put, path = "/images/{uuid}/file", tag = "images", params(("uuid" = String, Path, format = Uuid, description = "The image's uuid"), ("x-content-sha256" = Option<String>, Header, description = "The file's SHA-256 (64 hex digits); the upload is refused unless it matches")), request_body(content = Vec<u8>, description = "The image file's raw bytes", content_type = "application/octet-stream"), responses((status = 200, description = "The file is in and checked: the image is active", body = Image), (status = 409, description = "Another upload of this image is under way, or it already has its file", body = ApiErrorBody), (status = 413, description = "Larger than the server takes", body = ApiErrorBody), ErrorResponses), security(("bearer" = [])))]
pub async fn upload_image_file(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> ApiResult<Response> {
    let uuid: ImageId = id(&raw, "image")?;
    let expected = content_sha256(&headers)?;
    let length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let img = images::upload(&ctx, &caller, uuid, expected, length, body).await?;
    Ok(Json(img).into_response())
}

#[utoipa::path(get, path = "/images/{uuid}/file", tag = "images", params(("uuid" = String, Path, format = Uuid, description = "The image's uuid")), responses((status = 200, description = "The image file", content_type = "application/octet-stream", body = Vec<u8>), ErrorResponses), security(("bearer" = [])))]
pub async fn download_image_file(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let uuid: ImageId = id(&raw, "image")?;
    let f = images::open_file(&ctx, &caller, uuid).await?;
    Ok(file_response(f.file.into_std().await, f.len))
}

/// A file streamed out from disk in constant memory.
pub fn file_response(file: std::fs::File, len: u64) -> Response {
    let mut r = file_body(file, len).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    r
}

pub use super::file_stream::file_body;

// ---- a VM's tags and metadata ----

#[utoipa::path(get, path = "/vms/{uuid}/tags", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid")), responses((status = 200, description = "The VM's tags", body = BTreeMap<String, serde_json::Value>), ErrorResponses), security(("bearer" = [])))]
pub async fn list_vm_tags(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    Ok(Json(vm_labels::tags(&ctx, &caller, uuid).await?).into_response())
}

#[utoipa::path(post, path = "/vms/{uuid}/tags", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid")), request_body(content = BTreeMap<String, serde_json::Value>, description = "Tags to set (string, number or boolean values); the others stay"), responses((status = 200, description = "The VM's tags after the change", body = BTreeMap<String, serde_json::Value>), ErrorResponses), security(("bearer" = [])))]
pub async fn add_vm_tags(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(tags): ApiJson<passage_model::tags::Tags>,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    let all = vm_labels::change_tags(&ctx, &caller, uuid, Change::Merge(tags)).await?;
    Ok(Json(all).into_response())
}

#[utoipa::path(put, path = "/vms/{uuid}/tags", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid")), request_body(content = BTreeMap<String, serde_json::Value>, description = "The VM's tags from now on, all of them"), responses((status = 200, description = "The VM's tags after the change", body = BTreeMap<String, serde_json::Value>), ErrorResponses), security(("bearer" = [])))]
pub async fn replace_vm_tags(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(tags): ApiJson<passage_model::tags::Tags>,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    let all = vm_labels::change_tags(&ctx, &caller, uuid, Change::Replace(tags)).await?;
    Ok(Json(all).into_response())
}

#[utoipa::path(delete, path = "/vms/{uuid}/tags", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid")), responses((status = 204, description = "Every tag removed"), ErrorResponses), security(("bearer" = [])))]
pub async fn delete_vm_tags(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<StatusCode> {
    let uuid: VmId = id(&raw, "vm")?;
    vm_labels::change_tags(&ctx, &caller, uuid, Change::DeleteAll).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/vms/{uuid}/tags/{key}", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid"), ("key" = String, Path, description = "The tag's key")), responses((status = 200, description = "The tag's value", body = serde_json::Value), ErrorResponses), security(("bearer" = [])))]
pub async fn get_vm_tag(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path((raw, key)): Path<(String, String)>,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    Ok(Json(vm_labels::tag(&ctx, &caller, uuid, &key).await?).into_response())
}

#[utoipa::path(delete, path = "/vms/{uuid}/tags/{key}", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid"), ("key" = String, Path, description = "The tag's key")), responses((status = 204, description = "Removed"), ErrorResponses), security(("bearer" = [])))]
pub async fn delete_vm_tag(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path((raw, key)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let uuid: VmId = id(&raw, "vm")?;
    vm_labels::change_tags(&ctx, &caller, uuid, Change::Delete(key)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/vms/{uuid}/metadata", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid")), responses((status = 200, description = "The VM's metadata", body = BTreeMap<String, String>), ErrorResponses), security(("bearer" = [])))]
pub async fn list_vm_metadata(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    Ok(Json(vm_labels::metadata(&ctx, &caller, uuid).await?).into_response())
}

#[utoipa::path(post, path = "/vms/{uuid}/metadata", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid")), request_body(content = BTreeMap<String, String>, description = "Keys to set (string values); the others stay. The guest's seed has them from its next start"), responses((status = 200, description = "The VM's metadata after the change", body = BTreeMap<String, String>), ErrorResponses), security(("bearer" = [])))]
pub async fn add_vm_metadata(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(md): ApiJson<BTreeMap<String, String>>,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    let all = vm_labels::change_metadata(&ctx, &caller, uuid, Change::Merge(md)).await?;
    Ok(Json(all).into_response())
}

#[utoipa::path(put, path = "/vms/{uuid}/metadata", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid")), request_body(content = BTreeMap<String, String>, description = "The VM's metadata from now on, all of it"), responses((status = 200, description = "The VM's metadata after the change", body = BTreeMap<String, String>), ErrorResponses), security(("bearer" = [])))]
pub async fn replace_vm_metadata(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(md): ApiJson<BTreeMap<String, String>>,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    let all = vm_labels::change_metadata(&ctx, &caller, uuid, Change::Replace(md)).await?;
    Ok(Json(all).into_response())
}

#[utoipa::path(delete, path = "/vms/{uuid}/metadata", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid")), responses((status = 204, description = "Every key removed"), ErrorResponses), security(("bearer" = [])))]
pub async fn delete_vm_metadata(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<StatusCode> {
    let uuid: VmId = id(&raw, "vm")?;
    vm_labels::change_metadata(&ctx, &caller, uuid, Change::DeleteAll).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/vms/{uuid}/metadata/{key}", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid"), ("key" = String, Path, description = "The metadata key")), responses((status = 200, description = "The key's value", body = String), ErrorResponses), security(("bearer" = [])))]
pub async fn get_vm_metadata_key(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path((raw, key)): Path<(String, String)>,
) -> ApiResult<Response> {
    let uuid: VmId = id(&raw, "vm")?;
    Ok(Json(vm_labels::metadata_value(&ctx, &caller, uuid, &key).await?).into_response())
}

#[utoipa::path(delete, path = "/vms/{uuid}/metadata/{key}", tag = "vms", params(("uuid" = String, Path, format = Uuid, description = "The VM's uuid"), ("key" = String, Path, description = "The metadata key")), responses((status = 204, description = "Removed"), ErrorResponses), security(("bearer" = [])))]
pub async fn delete_vm_metadata_key(
    State(ctx): State<Ctx>,
    caller: Caller,
    Path((raw, key)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let uuid: VmId = id(&raw, "vm")?;
    vm_labels::change_metadata(&ctx, &caller, uuid, Change::Delete(key)).await?;
    Ok(StatusCode::NO_CONTENT)
}
