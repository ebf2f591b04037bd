//! Serves the portal (the `passage-app` crate) at `/`: its pages, its server functions
//! and its static files (the WebAssembly bundle and the stylesheet under `/pkg`).
//!
//! The bundle lives in `site/pkg/<hash of its files>/` (see xtask/src/site.rs), named by
//! `site/bundle`: pages link to that folder, so its files can be cached for a year and
//! a new build is fetched under its new name. Each file lies there precompressed too.
//!
//! The portal reaches the control plane through [`InProcessApi`]: its requests go to
//! the same `/v1` router that answers HTTP clients, without a socket, so every rule of
//! the API (roles, validation, audit) applies to the portal too.

use axum::Router;
use axum::body::Body;
use axum::extract::OriginalUri;
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use axum::response::IntoResponse;
use leptos::prelude::*;
use leptos_axum::{LeptosRoutes, generate_route_list};
use passage_app::backend::{Backend, BackendHandle};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use tower::ServiceExt;

/// API answers larger than this are cut off rather than buffered (a page of 1,000
/// servers with their devices is well under it).
const MAX_API_ANSWER: usize = 32 * 1024 * 1024;

/// The `/v1` router, called in-process.
pub struct InProcessApi {
    v1: Router,
}

impl Backend for InProcessApi {
    fn call(
        &self,
        req: Request<Vec<u8>>,
    ) -> Pin<Box<dyn Future<Output = Response<Vec<u8>>> + Send + 'static>> {
        let v1 = self.v1.clone();
        Box::pin(async move {
            let (mut parts, body) = req.into_parts();
            // The router is nested at /v1 for HTTP clients; in-process it gets the path
            // below it, and the audit log still sees the full one.
            let full = parts.uri.clone();
            let inner = full
                .path_and_query()
                .map(|pq| pq.as_str())
                .unwrap_or("/")
                .strip_prefix("/v1")
                .unwrap_or("/")
                .to_string();
            parts.uri = inner.parse().unwrap_or_default();
            parts.extensions.insert(OriginalUri(full));
            let req = Request::from_parts(parts, Body::from(body));
            let res = match v1.oneshot(req).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            let (parts, body) = res.into_parts();
            match axum::body::to_bytes(body, MAX_API_ANSWER).await {
                Ok(b) => Response::from_parts(parts, b.to_vec()),
                Err(_) => {
                    let mut r = Response::new(
                        br#"{"code":"InternalError","message":"the answer was too large"}"#
                            .to_vec(),
                    );
                    *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                    r
                }
            }
        })
    }
}

/// Where the built bundle is: `PASSAGE_SITE_ROOT`, else `site/` beside the target
/// directory the `server` binary was built in (where `cargo xtask` writes it), else
/// `target/site`.
pub fn site_root() -> PathBuf {
    if let Some(p) = std::env::var_os("PASSAGE_SITE_ROOT") {
        return PathBuf::from(p);
    }
    let beside_exe = std::env::current_exe().ok().and_then(|exe| {
        // target/debug/server → target/site; target/debug/deps/test-… → target/site
        exe.ancestors()
            .skip(1)
            .take(3)
            .map(|d| d.join("site"))
            .find(|d| d.join("pkg").is_dir())
    });
    beside_exe.unwrap_or_else(|| PathBuf::from("target/site"))
}

/// The current bundle's folder below the site root: `pkg/<hash>` as `site/bundle` names
/// it, or `pkg` where no bundle was built (the pages then work as without scripts).
fn bundle_dir(site: &std::path::Path) -> String {
    let file = site.join("bundle");
    match std::fs::read_to_string(&file) {
        Ok(id) => {
            let id = id.trim();
            if !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
                return format!("pkg/{id}");
            }
            tracing::warn!(file = %file.display(), "not a bundle id; serving the portal without its scripts");
        }
        Err(e) => {
            tracing::warn!(file = %file.display(), error = %e, "no portal bundle; run `cargo xtask site`");
        }
    }
    "pkg".to_string()
}

/// The bundle's files never change under their name: a browser may keep them a year.
const IMMUTABLE: HeaderValue = HeaderValue::from_static("public, max-age=31536000, immutable");

/// Static files of `dir`, precompressed variants first, cacheable for good.
fn bundle_files(
    dir: std::path::PathBuf,
) -> impl tower::Service<
    Request<Body>,
    Response = Response<tower_http::services::fs::ServeFileSystemResponseBody>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone
+ Send
+ Sync
+ 'static {
    use tower_http::set_header::SetResponseHeaderLayer;
    let files = tower_http::services::ServeDir::new(dir)
        .precompressed_br()
        .precompressed_gzip();
    tower::ServiceBuilder::new()
        .layer(SetResponseHeaderLayer::overriding(
            header::CACHE_CONTROL,
            |res: &Response<_>| {
                (res.status().is_success() || res.status() == StatusCode::NOT_MODIFIED)
                    .then_some(IMMUTABLE)
            },
        ))
        // A shared cache must not hand a brotli body to a client that asked for none.
        .layer(SetResponseHeaderLayer::appending(
            header::VARY,
            HeaderValue::from_static("accept-encoding"),
        ))
        .service(files)
}

/// The portal's routes, ready to merge into the main router. Paths it does not route go
/// to `cloudapi` when [`crate::cloudapi::claims`] takes them (an API client at `/LOGIN/…`),
/// else to the portal's not-found page.
pub fn router(v1: Router, cloudapi: Router) -> Router {
    let site = site_root();
    let options = LeptosOptions::builder()
        .output_name("passage")
        .site_root(site.to_string_lossy().to_string())
        .site_pkg_dir(bundle_dir(&site))
        .build();
    let backend = BackendHandle(Arc::new(InProcessApi { v1 }));
    let routes = generate_route_list(passage_app::App);
    let context = move || provide_context(backend.clone());
    let shell_options = options.clone();
    // Any other path renders the app's own not-found page (with status 404).
    let not_found = leptos_axum::render_app_async_with_context(context.clone(), {
        let options = options.clone();
        move || passage_app::shell(options.clone())
    });
    let pkg = bundle_files(site.join("pkg"));
    let favicon = tower_http::services::ServeFile::new(site.join("favicon.ico"));
    Router::new()
        .leptos_routes_with_context(&options, routes, context, move || {
            passage_app::shell(shell_options.clone())
        })
        .nest_service("/pkg", pkg)
        .route_service("/favicon.ico", favicon)
        .fallback(move |req: Request<Body>| {
            let to_cloudapi =
                crate::cloudapi::claims(req.method(), req.uri().path(), req.headers());
            let (not_found, cloudapi) = (not_found.clone(), cloudapi.clone());
            async move {
                if to_cloudapi {
                    match cloudapi.oneshot(req).await {
                        Ok(r) => r,
                        Err(never) => match never {},
                    }
                } else {
                    not_found(req).await.into_response()
                }
            }
        })
        .with_state(options)
}

#[cfg(test)]
mod tests {
    use super::bundle_dir;

    /// A server function's default URL ends in a hash of the folder its crate was built
    /// in: a `server` built in one checkout and a bundle built in another then miss each
    /// other, and every form says "error deserializing server function results". Each
    /// one names its endpoint instead.
    #[test]
    fn server_function_urls_do_not_depend_on_the_build_folder() {
        let paths: Vec<&str> = leptos::server_fn::axum::server_fn_paths()
            .map(|(path, _)| path)
            .collect();
        assert!(paths.len() >= 39, "{paths:?}");
        assert!(paths.contains(&"/portal/fn/login"), "{paths:?}");
        for p in paths {
            let name = p.strip_prefix("/portal/fn/").unwrap_or("");
            assert!(
                !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{p}"
            );
        }
    }

    #[test]
    fn pages_link_the_bundle_that_site_bundle_names() {
        let site = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        // No bundle built: the plain folder, where the pages find nothing and work
        // without scripts.
        assert_eq!(bundle_dir(site.path()), "pkg");
        let write = |s: &str| {
            std::fs::write(site.path().join("bundle"), s).unwrap_or_else(|e| panic!("{e}"))
        };
        write("3a867090bf6edb3f\n");
        assert_eq!(bundle_dir(site.path()), "pkg/3a867090bf6edb3f");
        for bad in ["", "../../etc", "3a86 7090", "pkg/3a86", &"a".repeat(65)] {
            write(bad);
            assert_eq!(bundle_dir(site.path()), "pkg", "{bad:?}");
        }
    }
}
