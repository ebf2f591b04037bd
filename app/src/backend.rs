//! Server half of the portal: the in-process API client, the session cookie and CSRF.

use crate::error::{PortalError, PortalResult};
use crate::rpc::Page;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use leptos::prelude::*;
use passage_model::ErrorCode;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// The control plane's REST API (`/v1`), answered in this process. The server crate
/// implements it by handing the request to its own router.
pub trait Backend: Send + Sync + 'static {
    fn call(
        &self,
        req: Request<Vec<u8>>,
    ) -> Pin<Box<dyn Future<Output = Response<Vec<u8>>> + Send + 'static>>;
}

/// What the server puts in each portal request's context.
#[derive(Clone)]
pub struct BackendHandle(pub Arc<dyn Backend>);

pub const SESSION_COOKIE: &str = "passage_session";

/// The caller's session token, from the request's cookies.
pub fn session_token() -> Option<String> {
    let parts = use_context::<http::request::Parts>()?;
    parts
        .headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == SESSION_COOKIE)
        .map(|(_, v)| v.trim().to_string())
        .filter(|v| !v.is_empty() && v.len() <= 256)
}

/// The CSRF token for a session: derived from the HttpOnly session secret, so a page of
/// another site can neither read nor compute it, and it needs no storage.
pub fn csrf_for(session: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"passage-portal-csrf\0");
    h.update(session.as_bytes());
    hex::encode(&h.finalize()[..16])
}

/// Whether `given` is the CSRF token of `session`. Compared without an early exit, so
/// timing says nothing about the expected value.
pub fn csrf_matches(session: &str, given: &str) -> bool {
    let want = csrf_for(session);
    want.len() == given.len()
        && want
            .bytes()
            .zip(given.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Every state-changing server function starts here.
pub fn check_csrf(given: &str) -> PortalResult<()> {
    let session = session_token().ok_or_else(PortalError::unauthorized)?;
    if csrf_matches(&session, given) {
        Ok(())
    } else {
        pass_status_on(StatusCode::FORBIDDEN);
        Err(PortalError::new(
            ErrorCode::Forbidden,
            "This form has expired or did not come from this portal. Reload the page and try again.",
        ))
    }
}

/// Login has no session yet to bind a CSRF token to: refuse a form posted by another
/// origin instead (browsers always send `Origin` on cross-origin POSTs).
pub fn check_same_origin() -> PortalResult<()> {
    let Some(parts) = use_context::<http::request::Parts>() else {
        return Ok(());
    };
    let Some(origin) = parts
        .headers
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
    else {
        return Ok(());
    };
    let host = parts
        .headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let origin_host = origin.split_once("://").map(|(_, h)| h).unwrap_or(origin);
    if origin == "null" || origin_host != host {
        return Err(PortalError::new(
            ErrorCode::Forbidden,
            "This form was posted from another site.",
        ));
    }
    Ok(())
}

/// This portal's address as the browser reached it, for commands shown to paste into a
/// shell.
pub fn site_origin() -> String {
    let host = use_context::<http::request::Parts>()
        .and_then(|p| {
            p.headers
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_string)
        })
        .unwrap_or_else(|| "127.0.0.1:8080".to_string());
    format!("http://{host}")
}

pub fn set_session_cookie(token: &str, max_age_secs: i64) {
    let v = format!(
        "{SESSION_COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax; Max-Age={}",
        max_age_secs.max(0)
    );
    set_cookie(v);
}

pub fn clear_session_cookie() {
    set_cookie(format!(
        "{SESSION_COOKIE}=; Path=/; HttpOnly; SameSite=Lax; Max-Age=0"
    ));
}

fn set_cookie(v: String) {
    if let (Some(res), Ok(v)) = (
        use_context::<leptos_axum::ResponseOptions>(),
        HeaderValue::from_str(&v),
    ) {
        res.append_header(header::SET_COOKIE, v);
    }
}

/// Sets the status of the page being rendered (404, 403…), for people and for tests.
pub fn set_status(code: u16) {
    if let (Some(res), Ok(s)) = (
        use_context::<leptos_axum::ResponseOptions>(),
        StatusCode::from_u16(code),
    ) {
        res.set_status(s);
    }
}

/// One API answer: its body and the list headers.
pub struct Reply {
    pub status: StatusCode,
    pub body: Vec<u8>,
    pub total: Option<u64>,
    pub next: Option<String>,
}

/// Calls `/v1{path}` as the session's account (or anonymously without a session).
pub async fn call(method: Method, path: &str, body: Option<Vec<u8>>) -> PortalResult<Reply> {
    let backend = use_context::<BackendHandle>()
        .ok_or_else(|| PortalError::portal("the portal is not connected to the API"))?;
    let mut req = Request::builder()
        .method(method)
        .uri(format!("/v1{path}"))
        .header(header::ACCEPT, "application/json");
    if let Some(t) = session_token() {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    // The API rate-limits logins per client address: pass the browser's on.
    type Peer = axum::extract::ConnectInfo<std::net::SocketAddr>;
    if let Some(peer) =
        use_context::<http::request::Parts>().and_then(|p| p.extensions.get::<Peer>().cloned())
    {
        req = req.extension(peer);
    }
    let req = match body {
        Some(b) => req.header(header::CONTENT_TYPE, "application/json").body(b),
        None => req.body(Vec::new()),
    }
    .map_err(|e| PortalError::portal(format!("bad request: {e}")))?;
    let res = backend.0.call(req).await;
    let header_str = |name: &str| {
        res.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let total = header_str("x-resource-count").and_then(|v| v.parse().ok());
    let next = header_str("x-next-cursor");
    let status = res.status();
    let body = res.into_body();
    if !status.is_success() {
        pass_status_on(status);
        return Err(api_error(status, &body));
    }
    Ok(Reply {
        status,
        body,
        total,
        next,
    })
}

/// A server function called by the page's script answers with the API's own status
/// (not a blanket 500). A plain form post is redirected back to its page instead, and a
/// page render decides its status itself, so both are left alone.
pub fn pass_status_on(status: StatusCode) {
    let Some(parts) = use_context::<http::request::Parts>() else {
        return;
    };
    let from_script = parts.uri.path().starts_with("/portal/fn/")
        && !parts
            .headers
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("text/html"));
    if from_script && let Some(res) = use_context::<leptos_axum::ResponseOptions>() {
        res.set_status(status);
    }
}

fn api_error(status: StatusCode, body: &[u8]) -> PortalError {
    match serde_json::from_slice::<passage_model::ApiErrorBody>(body) {
        Ok(b) => PortalError {
            code: b.code.into(),
            message: b.message,
            field: b.field,
        },
        Err(_) => PortalError::new(
            ErrorCode::InternalError,
            format!("the API answered {status}"),
        ),
    }
}

fn decode<T: DeserializeOwned>(body: &[u8]) -> PortalResult<T> {
    serde_json::from_slice(body)
        .map_err(|e| PortalError::portal(format!("unexpected answer from the API: {e}")))
}

pub async fn get<T: DeserializeOwned>(path: &str) -> PortalResult<T> {
    decode(&call(Method::GET, path, None).await?.body)
}

pub async fn list<T: DeserializeOwned>(path: &str) -> PortalResult<Page<T>> {
    let r = call(Method::GET, path, None).await?;
    let items: Vec<T> = decode(&r.body)?;
    Ok(Page {
        total: r.total.unwrap_or(items.len() as u64),
        items,
        next: r.next,
    })
}

pub async fn send<T: DeserializeOwned>(
    method: Method,
    path: &str,
    body: &impl Serialize,
) -> PortalResult<T> {
    let b = serde_json::to_vec(body)
        .map_err(|e| PortalError::portal(format!("could not encode the form: {e}")))?;
    decode(&call(method, path, Some(b)).await?.body)
}

pub async fn delete(path: &str) -> PortalResult<()> {
    call(Method::DELETE, path, None).await.map(|_| ())
}

pub use crate::fmt::query;

/// A path segment that came from a URL or a form, checked before it goes into an API path.
pub fn segment(s: &str) -> PortalResult<&str> {
    if !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        Ok(s)
    } else {
        Err(PortalError::new(
            ErrorCode::ResourceNotFound,
            "no such object",
        ))
    }
}
