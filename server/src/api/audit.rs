//! The audit log: every state-changing call to /v1, who made it, what, when, the result.

use crate::services::{self, Ctx, auth};
use axum::extract::{OriginalUri, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;

pub async fn record(State(ctx): State<Ctx>, req: Request, next: Next) -> Response {
    if matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return next.run(req).await;
    }
    let method = req.method().to_string();
    let path = req
        .extensions()
        .get::<OriginalUri>()
        .map(|u| u.0.path().to_string())
        .unwrap_or_else(|| req.uri().path().to_string());
    // Resolved before the call: a logout ends the very token that names its caller.
    let token = super::extract::session_credential(req.headers());
    let account = match token {
        Some(t) => auth::caller_from_token(&ctx, &t).await.ok(),
        None => None,
    };
    let actor = account.as_ref().map(|a| (a.uuid, a.login.clone()));
    let mut req = req;
    if let Some(a) = account {
        // The handler's `Caller` is this same account: no second token lookup.
        req.extensions_mut().insert(auth::Caller { account: a });
    }
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    let detail = resp
        .extensions()
        .get::<services::audit::AuditDetail>()
        .map(|d| d.0.clone());
    if let Err(e) =
        services::audit::record(&ctx, actor, method.clone(), path.clone(), status, detail).await
    {
        tracing::warn!(error = %e, %method, %path, "could not write the audit log");
    }
    resp
}
