//! Request extractors: JSON bodies with errors that name the field, bearer credentials,
//! list paging.

use crate::error::ApiError;
use crate::services::auth::{self, Caller};
use crate::services::{Ctx, agents};
use crate::store::page::{Cursor, MAX_CURSOR_LEN, PageReq, Start};
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, header};
use passage_model::api::MAX_LIST_LIMIT;
use passage_model::{ErrorCode, ServerId};
use serde::de::DeserializeOwned;
use std::collections::HashMap;

/// A JSON body. Malformed JSON, unknown or missing fields and wrong types answer 400 with
/// the path of the offending field; a body over the limit answers 413.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(ErrorCode::PayloadTooLarge, "the request body is too large")
            } else {
                ApiError::new(
                    ErrorCode::InvalidArgument,
                    "could not read the request body",
                )
            }
        })?;
        parse_json(&bytes).map(ApiJson)
    }
}

pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    passage_model::decode::json_object(bytes).map_err(|e| ApiError::invalid(e.field, e.message))
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v: &HeaderValue| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

impl FromRequestParts<Ctx> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, ctx: &Ctx) -> Result<Self, Self::Rejection> {
        // Resolved already by the audit layer, from this request's own bearer token.
        if let Some(c) = parts.extensions.get::<Caller>() {
            return Ok(c.clone());
        }
        let token = bearer(&parts.headers).ok_or_else(ApiError::unauthorized)?;
        let account = auth::caller_from_token(ctx, token).await?;
        Ok(Caller { account })
    }
}

/// The node a request of the agent API comes from.
pub struct AgentServer(pub ServerId);

impl FromRequestParts<Ctx> for AgentServer {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, ctx: &Ctx) -> Result<Self, Self::Rejection> {
        let credential = bearer(&parts.headers).ok_or_else(ApiError::unauthorized)?;
        Ok(AgentServer(
            agents::server_from_credential(ctx, credential).await?,
        ))
    }
}

/// Query parameters, parsed by hand so a bad value gets a 400 naming it.
pub struct QueryMap(pub HashMap<String, String>);

impl<S: Send + Sync> FromRequestParts<S> for QueryMap {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let q = parts.uri.query().unwrap_or("");
        if q.len() > 4096 {
            return Err(ApiError::invalid("query", "too long"));
        }
        let map: HashMap<String, String> =
            serde_urlencoded::from_str(q).map_err(|e| ApiError::invalid("query", e.to_string()))?;
        if let Some((k, _)) = map
            .iter()
            .find(|(k, v)| k.contains('\0') || v.contains('\0'))
        {
            return Err(ApiError::invalid(
                k.replace('\0', ""),
                "may not contain NUL",
            ));
        }
        Ok(QueryMap(map))
    }
}

impl QueryMap {
    /// A parameter's value. An empty one (`?owner_uuid=`) is a value like any other, and
    /// refused where it is not valid: taking it as absent would widen a filter a script
    /// meant to narrow (the portal leaves empty filters out itself).
    pub fn get(&self, k: &str) -> Option<&str> {
        self.0.get(k).map(String::as_str)
    }

    pub fn parse<T: std::str::FromStr>(&self, k: &str) -> Result<Option<T>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .parse()
                .map(Some)
                .map_err(|_| ApiError::invalid(k, format!("{v:?} is not valid here"))),
        }
    }

    /// `?limit=N&offset=N` as Triton's CloudAPI takes them.
    pub fn page(&self) -> Result<(i64, i64), ApiError> {
        let limit: u32 = self.parse("limit")?.unwrap_or(MAX_LIST_LIMIT);
        if limit == 0 || limit > MAX_LIST_LIMIT {
            return Err(ApiError::invalid(
                "limit",
                format!("must be 1 to {MAX_LIST_LIMIT}"),
            ));
        }
        let offset: u32 = self.parse("offset")?.unwrap_or(0);
        Ok((i64::from(limit), i64::from(offset)))
    }

    /// `?limit=N` with either `?offset=N` or `?after=CURSOR`, the cursor a previous page
    /// gave in `x-next-cursor` (both at once: 400 naming `after`).
    pub fn keyset<K: Cursor>(&self) -> Result<PageReq<K>, ApiError> {
        let (limit, offset) = self.page()?;
        let Some(raw) = self.get("after") else {
            return Ok(PageReq::offset(limit, offset));
        };
        let key = (raw.len() <= MAX_CURSOR_LEN)
            .then(|| K::decode(raw))
            .flatten()
            .ok_or_else(|| {
                ApiError::invalid(
                    "after",
                    "is not a cursor of this list (pass the x-next-cursor header of the \
                     previous page as it came)",
                )
            })?;
        Ok(PageReq {
            limit,
            start: Start::After(key, offset),
        })
    }
}

/// The client's address, when the server was started with connection info.
pub struct ClientAddr(pub Option<std::net::IpAddr>);

impl<S: Send + Sync> FromRequestParts<S> for ClientAddr {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(ClientAddr(
            parts
                .extensions
                .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                .map(|c| c.0.ip()),
        ))
    }
}
