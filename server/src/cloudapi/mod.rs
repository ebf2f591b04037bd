//! Triton's CloudAPI, the part the `triton` CLI uses, as a second face over the same
//! services as /v1: `/:login/...` at the server's root, authenticated by HTTP Signatures
//! made with the account's SSH keys. It adds no rule of its own: roles, validation,
//! quotas, visibility and audit are the services'; this module only translates shapes.

pub mod catalog;
pub mod machines;
pub mod shapes;
pub mod signature;

use crate::api::extract::ClientAddr;
use crate::error::ApiError;
use crate::services::auth::Caller;
use crate::services::{Ctx, audit};
use crate::store::{accounts, keys};
use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequestParts, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use passage_model::ErrorCode;
use serde::Serialize;

/// An error as CloudAPI words it: `{"code","message"}` with CloudAPI's codes.
#[derive(Debug)]
pub struct CloudError(pub ApiError);

impl From<ApiError> for CloudError {
    fn from(e: ApiError) -> Self {
        CloudError(e)
    }
}

impl From<crate::store::StoreError> for CloudError {
    fn from(e: crate::store::StoreError) -> Self {
        CloudError(e.into())
    }
}

pub type CloudResult<T> = Result<T, CloudError>;

/// CloudAPI's name for each of our codes (sdc-cloudapi `docs/index.md`, "Errors").
fn code_name(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::InvalidArgument => "InvalidArgument",
        ErrorCode::Unauthorized => "InvalidCredentials",
        ErrorCode::Forbidden => "NotAuthorized",
        ErrorCode::ResourceNotFound => "ResourceNotFound",
        ErrorCode::Conflict => "InvalidArgument",
        ErrorCode::InsufficientCapacity => "InsufficientCapacity",
        ErrorCode::QuotaExceeded => "QuotaExceeded",
        ErrorCode::InvalidState => "InvalidState",
        ErrorCode::PayloadTooLarge => "RequestTooLarge",
        ErrorCode::RateLimited => "RequestThrottled",
        ErrorCode::InternalError => "InternalError",
    }
}

impl IntoResponse for CloudError {
    fn into_response(self) -> Response {
        let e = self.0;
        if let Some(detail) = &e.internal {
            tracing::error!(code = ?e.code, detail = %detail, "cloudapi request failed");
        }
        let status =
            StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let message = match &e.field {
            Some(f) if !e.message.contains(f.as_str()) => format!("{f}: {}", e.message),
            _ => e.message.clone(),
        };
        #[derive(Serialize)]
        struct Body<'a> {
            code: &'a str,
            message: String,
        }
        (
            status,
            axum::Json(Body {
                code: code_name(e.code),
                message,
            }),
        )
            .into_response()
    }
}

fn invalid_credentials(message: impl Into<String>) -> CloudError {
    CloudError(ApiError::new(ErrorCode::Unauthorized, message))
}

/// A JSON answer with the length of the page in `x-resource-count`: the `triton` CLI
/// pages on it, and wants this page's count, not the total (`/v1` sends the total).
pub fn page<T: Serialize>(items: Vec<T>) -> Response {
    let n = items.len();
    let mut r = axum::Json(items).into_response();
    if let Ok(v) = HeaderValue::from_str(&n.to_string()) {
        r.headers_mut()
            .insert(HeaderName::from_static("x-resource-count"), v);
    }
    r
}

/// The account a request was signed by, verified; its login is the path's.
#[derive(Clone, Debug)]
pub struct Signed {
    pub caller: Caller,
}

impl FromRequestParts<Ctx> for Signed {
    type Rejection = CloudError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &Ctx,
    ) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Signed>()
            .cloned()
            .ok_or_else(|| invalid_credentials("this call needs an HTTP Signature"))
    }
}

/// The routes, under `/:login`, and `/--ping`.
pub fn router(ctx: Ctx) -> Router {
    Router::new()
        .route("/--ping", get(ping))
        .route("/{login}", get(catalog::account))
        .route(
            "/{login}/keys",
            get(catalog::list_keys).post(catalog::create_key),
        )
        .route(
            "/{login}/keys/{name}",
            get(catalog::get_key).delete(catalog::delete_key),
        )
        .route("/{login}/packages", get(catalog::list_packages))
        .route("/{login}/packages/{id}", get(catalog::get_package))
        .route("/{login}/images", get(catalog::list_images))
        .route("/{login}/images/{id}", get(catalog::get_image))
        .route("/{login}/networks", get(catalog::list_networks))
        .route("/{login}/networks/{id}", get(catalog::get_network))
        .route(
            "/{login}/machines",
            get(machines::list).post(machines::create),
        )
        .route(
            "/{login}/machines/{id}",
            get(machines::get)
                .post(machines::action)
                .delete(machines::delete),
        )
        .route(
            "/{login}/machines/{id}/tags",
            get(machines::tags)
                .post(machines::add_tags)
                .put(machines::replace_tags)
                .delete(machines::delete_tags),
        )
        .route(
            "/{login}/machines/{id}/tags/{key}",
            get(machines::tag).delete(machines::delete_tag),
        )
        .route(
            "/{login}/machines/{id}/metadata",
            get(machines::list_metadata)
                .post(machines::update_metadata)
                .delete(machines::delete_all_metadata),
        )
        .route(
            "/{login}/machines/{id}/metadata/{key}",
            get(machines::get_metadata).delete(machines::delete_metadata),
        )
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(crate::api::API_BODY_LIMIT))
        .layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            authenticate,
        ))
        .layer(axum::middleware::from_fn(crate::api::hardening::time_limit))
        .with_state(ctx)
}

/// Whether a request that no other route took is CloudAPI's: its first path segment may
/// be a login, and it is not a browser asking for a page (those get the portal's own
/// not-found page).
pub fn claims(method: &Method, path: &str, headers: &HeaderMap) -> bool {
    let first = path.trim_start_matches('/').split('/').next().unwrap_or("");
    if first.is_empty() || (first != "--ping" && passage_model::api::is_reserved_login(first)) {
        return false;
    }
    if headers.contains_key(header::AUTHORIZATION) || headers.contains_key("accept-version") {
        return true;
    }
    let html = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("text/html"));
    !(html && *method == Method::GET)
}

async fn ping() -> Response {
    axum::Json(serde_json::json!({
        "ping": "pong",
        "cloudapi": {"versions": ["9.0.0"]},
        "passage": env!("CARGO_PKG_VERSION"),
    }))
    .into_response()
}

async fn not_found() -> CloudError {
    CloudError(ApiError::new(ErrorCode::ResourceNotFound, "no such route"))
}

/// Verifies the request's signature, and records the call in the audit log when it
/// changes something, as /v1 does.
async fn authenticate(
    State(ctx): State<Ctx>,
    ClientAddr(addr): ClientAddr,
    mut req: Request,
    next: Next,
) -> Response {
    if req.uri().path() == "/--ping" {
        return next.run(req).await;
    }
    // The body is not `Sync`: the check borrows copies of the parts it reads, not `req`.
    let (method, uri, headers) = (
        req.method().clone(),
        req.uri().clone(),
        req.headers().clone(),
    );
    let signed = match verify_request(&ctx, &method, &uri, &headers, addr).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let account = signed.caller.account.clone();
    req.extensions_mut().insert(signed);
    if matches!(*req.method(), Method::GET | Method::HEAD) {
        return next.run(req).await;
    }
    let method = req.method().to_string();
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    let actor = Some((account.uuid, account.login));
    if let Err(e) = audit::record(&ctx, actor, method.clone(), path.clone(), status, None).await {
        tracing::warn!(error = %e, %method, %path, "could not write the audit log");
    }
    resp
}

async fn verify_request(
    ctx: &Ctx,
    method: &Method,
    uri: &axum::http::Uri,
    headers: &HeaderMap,
    addr: Option<std::net::IpAddr>,
) -> CloudResult<Signed> {
    let value = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| {
            invalid_credentials(
                "this call needs an HTTP Signature (Authorization: Signature keyId=…) made \
                 with one of the account's SSH keys",
            )
        })?;
    let sig = signature::parse(value).map_err(|e| invalid_credentials(e.to_string()))?;
    let login = sig.login.clone();
    if let Some(wait) = ctx.login_guard.check(&login, addr) {
        return Err(CloudError(ApiError::new(
            ErrorCode::RateLimited,
            format!(
                "too many failed sign-ins; try again in {} s",
                wait.as_secs().max(1)
            ),
        )));
    }
    let failed = |why: String| {
        ctx.login_guard.failed(&login, addr);
        tracing::info!(%login, reason = %why, "cloudapi signature refused");
        invalid_credentials(format!("invalid signature: {why}"))
    };
    let date = headers
        .get("x-date")
        .or_else(|| headers.get(header::DATE))
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| failed("the request has no date header".into()))?;
    signature::check_date(date, chrono::Utc::now()).map_err(|e| failed(e.to_string()))?;
    let target = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_string(), |p| p.as_str().to_string());
    let message = signature::signing_string(&sig, method.as_str(), &target, |h| {
        headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    })
    .map_err(|e| failed(e.to_string()))?;
    let found = keys::signing_key(&ctx.db, &login, &sig.md5_fingerprint).await?;
    let Some((account, key_text)) = found else {
        // One answer for an unknown login and an unknown key: neither is revealed.
        return Err(failed(format!(
            "no key {} for this account",
            sig.md5_fingerprint
        )));
    };
    let key = ssh_key::PublicKey::from_openssh(&key_text)
        .map_err(|e| CloudError(ApiError::internal(format!("stored key: {e}"))))?;
    let check = {
        let sig = sig.clone();
        let message = message.into_bytes();
        // RSA verification takes a fraction of a millisecond to a few: off the runtime.
        tokio::task::spawn_blocking(move || signature::verify(&key, &sig, &message))
            .await
            .map_err(|e| CloudError(ApiError::internal(format!("verify task: {e}"))))?
    };
    check.map_err(|e| failed(e.to_string()))?;
    ctx.login_guard.succeeded(&login);
    // The path names whose objects are meant; it must be the signer's own.
    let path_login = uri
        .path()
        .trim_start_matches('/')
        .split('/')
        .next()
        .unwrap_or("");
    if path_login != login {
        return Err(CloudError(ApiError::new(
            ErrorCode::Forbidden,
            format!("{login} may not act as {path_login:?}"),
        )));
    }
    let account = accounts::get(&ctx.db, account).await?;
    Ok(Signed {
        caller: Caller { account },
    })
}

/// A body as CloudAPI takes one: a JSON object, or a form (`application/x-www-form-urlencoded`),
/// whose values are strings; empty is an empty object.
pub fn body_object(
    headers: &HeaderMap,
    body: &[u8],
) -> CloudResult<serde_json::Map<String, serde_json::Value>> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(serde_json::Map::new());
    }
    let form = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
    if form {
        let mut m = serde_json::Map::new();
        for (k, v) in form_urlencoded::parse(body) {
            if k.contains('\0') || v.contains('\0') {
                return Err(CloudError(ApiError::invalid(
                    k.replace('\0', ""),
                    "may not contain NUL",
                )));
            }
            m.insert(k.into_owned(), serde_json::Value::String(v.into_owned()));
        }
        return Ok(m);
    }
    Ok(passage_model::decode::json_object(body).map_err(ApiError::from)?)
}

/// The query string as name/value pairs, by `/v1`'s rules (length, NUL), the last of a
/// repeated name counting.
pub fn query_pairs(query: Option<&str>) -> CloudResult<Vec<(String, String)>> {
    let q = query.unwrap_or("");
    if q.len() > crate::api::extract::MAX_QUERY_LEN {
        return Err(CloudError(ApiError::invalid("query", "too long")));
    }
    let mut out: Vec<(String, String)> = Vec::new();
    for (k, v) in form_urlencoded::parse(q.as_bytes()) {
        if k.contains('\0') || v.contains('\0') {
            return Err(CloudError(ApiError::invalid(
                k.replace('\0', ""),
                "may not contain NUL",
            )));
        }
        out.retain(|(ok, _)| *ok != k);
        out.push((k.into_owned(), v.into_owned()));
    }
    Ok(out)
}

/// A uuid in a path: a malformed one cannot name anything, so it is not found.
pub fn path_id<T: std::str::FromStr>(raw: &str, what: &'static str) -> CloudResult<T> {
    raw.parse()
        .map_err(|_| CloudError(ApiError::not_found(what)))
}
