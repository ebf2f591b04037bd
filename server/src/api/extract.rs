//! Request extractors: JSON bodies and query strings with errors that name the field,
//! bearer credentials, the client's address.

use crate::error::ApiError;
use crate::services::auth::{self, Caller};
use crate::services::{Ctx, agents};
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, header};
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
    Ok(passage_model::decode::json_object(bytes)?)
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v: &HeaderValue| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// The header the portal's own scripts send with its CSRF token on calls to /v1.
pub const CSRF_HEADER: &str = "x-csrf-token";

/// The session token a /v1 call is made with: its bearer token, or else the portal's
/// session cookie, taken only beside the CSRF token derived from it (`x-csrf-token`). The
/// cookie is HttpOnly, so the portal's scripts (an upload streamed from the browser)
/// cannot send it as a bearer token. Browsers attach cookies to requests other sites
/// make, so the cookie alone counts for nothing: another site can neither read nor
/// compute the CSRF token, and CORS stays closed to the custom header.
pub fn session_credential(headers: &HeaderMap) -> Option<String> {
    if let Some(t) = bearer(headers) {
        return Some(t.to_string());
    }
    let given = headers.get(CSRF_HEADER)?.to_str().ok()?;
    let session = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == passage_app::backend::SESSION_COOKIE)
        .map(|(_, v)| v.trim())
        .filter(|v| !v.is_empty() && v.len() <= 256)?;
    passage_app::backend::csrf_matches(session, given).then(|| session.to_string())
}

/// The session token of a websocket's upgrade (a console): its bearer token, or else the
/// portal's session cookie when the request comes from a page of this server. A browser's
/// WebSocket cannot send a header of its own (no CSRF token), but it always sends the
/// page's `Origin`, which the page cannot change: a cookie with an `Origin` naming another
/// site (cross-site websocket hijacking), or none, is refused with 403. `Ok(None)`: no
/// credential at all.
pub fn socket_credential(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    if let Some(t) = bearer(headers) {
        return Ok(Some(t.to_string()));
    }
    let Some(session) = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == passage_app::backend::SESSION_COOKIE)
        .map(|(_, v)| v.trim())
        .filter(|v| !v.is_empty() && v.len() <= 256)
    else {
        return Ok(None);
    };
    if !same_origin(headers) {
        return Err(ApiError::new(
            ErrorCode::Forbidden,
            "a console opened with the portal's cookie must come from the portal's own pages \
             (Origin); API clients send their token as a bearer token",
        ));
    }
    Ok(Some(session.to_string()))
}

/// Whether the request's `Origin` names the host it was sent to (`Host`, or HTTP/2's
/// authority): a page of this server.
fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false;
    };
    matches!(scheme, "http" | "https") && authority.eq_ignore_ascii_case(host)
}

impl FromRequestParts<Ctx> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, ctx: &Ctx) -> Result<Self, Self::Rejection> {
        // Resolved already by the audit layer, from this request's own bearer token.
        if let Some(c) = parts.extensions.get::<Caller>() {
            return Ok(c.clone());
        }
        let token = session_credential(&parts.headers).ok_or_else(ApiError::unauthorized)?;
        let account = auth::caller_from_token(ctx, &token).await?;
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

/// Longest query string taken; every list's filters together fit in a fraction of it.
pub const MAX_QUERY_LEN: usize = 4096;

/// Query parameters decoded into `T`, a type of [`super::params`] that the document
/// states too. Parameters `T` does not name are ignored; a value that does not parse
/// answers 400 naming its parameter. An empty value (`?owner_uuid=`) is a value like any
/// other, and refused where it is not valid: taking it as absent would widen a filter a
/// script meant to narrow (the portal leaves empty filters out itself).
pub struct ApiQuery<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiQuery<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parse_query(parts.uri.query().unwrap_or("")).map(ApiQuery)
    }
}

/// Decodes a query string into `T`, by [`ApiQuery`]'s rules.
pub fn parse_query<T: DeserializeOwned>(query: &str) -> Result<T, ApiError> {
    if query.len() > MAX_QUERY_LEN {
        return Err(ApiError::invalid("query", "too long"));
    }
    let pairs: Vec<(String, String)> =
        serde_urlencoded::from_str(query).map_err(|e| ApiError::invalid("query", e.to_string()))?;
    // A parameter given twice counts once, with its last value (serde would refuse the
    // repeat as a duplicate field; clients have always been answered this way).
    let mut params: Vec<(String, String)> = Vec::with_capacity(pairs.len());
    let mut at: HashMap<String, usize> = HashMap::with_capacity(pairs.len());
    for (k, v) in pairs {
        match at.get(&k) {
            Some(&i) => params[i].1 = v,
            None => {
                at.insert(k.clone(), params.len());
                params.push((k, v));
            }
        }
    }
    // Postgres text cannot hold NUL, and no filter needs one.
    if let Some((k, _)) = params
        .iter()
        .find(|(k, v)| k.contains('\0') || v.contains('\0'))
    {
        return Err(ApiError::invalid(
            k.replace('\0', ""),
            "may not contain NUL",
        ));
    }
    let encoded = serde_urlencoded::to_string(&params)
        .map_err(|e| ApiError::invalid("query", e.to_string()))?;
    let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(encoded.as_bytes()));
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = match e.path().to_string() {
            p if p.is_empty() || p == "." => "query".to_string(),
            p => p,
        };
        let value = params
            .iter()
            .find(|(k, _)| *k == field)
            .map_or("", |(_, v)| v.as_str());
        ApiError::invalid(
            field.as_str(),
            format!("{value:?} is not valid here ({})", e.inner()),
        )
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, PartialEq, serde::Deserialize)]
    struct Q {
        limit: Option<u32>,
        owner: Option<passage_model::AccountId>,
        name: Option<String>,
        brief: Option<bool>,
    }

    fn field(r: Result<Q, ApiError>) -> Option<String> {
        r.err().and_then(|e| e.field)
    }

    #[test]
    fn query_strings_by_the_old_rules() {
        assert_eq!(parse_query::<Q>("").unwrap(), Q::default());
        let q: Q = parse_query("limit=5&name=a%20b&brief=true").unwrap();
        assert_eq!(
            (q.limit, q.name.as_deref(), q.brief),
            (Some(5), Some("a b"), Some(true))
        );
        // Parameters no call names are ignored; the last of a repeated one counts.
        let q: Q = parse_query("colour=red&limit=1&limit=7").unwrap();
        assert_eq!(q.limit, Some(7));
        // An empty value is a value: refused where it does not parse, kept where it does.
        assert_eq!(field(parse_query("owner=")).as_deref(), Some("owner"));
        assert_eq!(parse_query::<Q>("name=").unwrap().name.as_deref(), Some(""));
        // A value that does not parse is named, with what it was.
        let e = parse_query::<Q>("limit=ten").unwrap_err();
        assert_eq!(e.field.as_deref(), Some("limit"));
        assert!(e.message.contains("\"ten\""), "{}", e.message);
        assert_eq!(field(parse_query("brief=yes")).as_deref(), Some("brief"));
        assert_eq!(field(parse_query("limit=-1")).as_deref(), Some("limit"));
        // NUL anywhere is refused, named by the parameter it was in.
        assert_eq!(field(parse_query("name=a%00b")).as_deref(), Some("name"));
        assert_eq!(field(parse_query("na%00me=x")).as_deref(), Some("name"));
        // Too long, whatever it holds.
        let long = format!("name={}", "x".repeat(MAX_QUERY_LEN));
        assert_eq!(field(parse_query(&long)).as_deref(), Some("query"));
        let just = format!("name={}", "x".repeat(MAX_QUERY_LEN - 5));
        assert_eq!(
            parse_query::<Q>(&just).unwrap().name.map(|n| n.len()),
            Some(MAX_QUERY_LEN - 5)
        );
    }
}
