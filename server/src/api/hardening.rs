//! HTTP hardening that applies to every answer: security headers and a time limit.
//! CORS stays closed: no CORS layer means browsers refuse cross-origin calls.

use crate::error::ApiError;
use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderName, HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::time::Duration;
use tower_http::set_header::SetResponseHeaderLayer;

/// Fit for the portal: its own scripts and WebAssembly only, never framed.
const CSP: &str = "default-src 'self'; script-src 'self' 'wasm-unsafe-eval'; \
    style-src 'self'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; \
    base-uri 'self'; form-action 'self'; object-src 'none'";

pub fn security_headers<S: Clone + Send + Sync + 'static>(r: Router<S>) -> Router<S> {
    let set = |name: HeaderName, value: &'static str| {
        SetResponseHeaderLayer::if_not_present(name, HeaderValue::from_static(value))
    };
    r.layer(set(header::CONTENT_SECURITY_POLICY, CSP))
        .layer(set(header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .layer(set(header::X_FRAME_OPTIONS, "DENY"))
        .layer(set(header::REFERRER_POLICY, "same-origin"))
        .layer(set(
            HeaderName::from_static("cross-origin-opener-policy"),
            "same-origin",
        ))
}

/// A request that takes longer than this gets a JSON error instead of hanging a client.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Image uploads stream gigabytes: they run as long as their bytes keep coming.
fn unlimited(req: &Request) -> bool {
    let path = req.uri().path();
    let path = path.strip_prefix("/v1").unwrap_or(path);
    req.method() == axum::http::Method::PUT
        && path.starts_with("/images/")
        && path.ends_with("/file")
}

pub async fn time_limit(req: Request, next: Next) -> Response {
    if unlimited(&req) {
        return next.run(req).await;
    }
    match tokio::time::timeout(REQUEST_TIMEOUT, next.run(req)).await {
        Ok(r) => r,
        Err(_) => ApiError {
            code: passage_model::ErrorCode::InternalError,
            message: format!(
                "the request did not finish within {} s",
                REQUEST_TIMEOUT.as_secs()
            ),
            field: None,
            internal: None,
        }
        .into_response(),
    }
}
