//! The OpenAPI document at /v1/openapi.json is generated from the handlers: every route of
//! the contract is in it, and every path in it is served.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Backend, TestServer, fast_config};
use serde_json::Value;

/// The /v1 routes of CONTRACT.md, plus the ones added since.
const ROUTES: &[(&str, &str)] = &[
    ("get", "/v1/ping"),
    ("post", "/v1/auth/login"),
    ("post", "/v1/auth/logout"),
    ("get", "/v1/auth/me"),
    ("get", "/v1/accounts"),
    ("post", "/v1/accounts"),
    ("get", "/v1/accounts/{uuid}"),
    ("patch", "/v1/accounts/{uuid}"),
    ("delete", "/v1/accounts/{uuid}"),
    ("get", "/v1/tokens"),
    ("post", "/v1/tokens"),
    ("delete", "/v1/tokens/{uuid}"),
    ("get", "/v1/variants"),
    ("post", "/v1/variants"),
    ("get", "/v1/variants/{name}"),
    ("put", "/v1/variants/{name}"),
    ("delete", "/v1/variants/{name}"),
    ("get", "/v1/packages"),
    ("post", "/v1/packages"),
    ("get", "/v1/packages/{uuid}"),
    ("delete", "/v1/packages/{uuid}"),
    ("get", "/v1/packages/{uuid}/availability"),
    ("get", "/v1/servers"),
    ("get", "/v1/devices"),
    ("get", "/v1/servers/{uuid}"),
    ("patch", "/v1/servers/{uuid}"),
    ("post", "/v1/servers/join-tokens"),
    ("get", "/v1/servers/{uuid}/device-events"),
    ("get", "/v1/servers/{uuid}/scrub-reports"),
    ("post", "/v1/servers/{uuid}/device-actions"),
    ("delete", "/v1/servers/{uuid}/credential"),
    ("get", "/v1/vms"),
    ("post", "/v1/vms"),
    ("get", "/v1/vms/{uuid}"),
    ("delete", "/v1/vms/{uuid}"),
    ("post", "/v1/vms/{uuid}/stop"),
    ("post", "/v1/vms/{uuid}/start"),
    ("post", "/v1/vms/{uuid}/resize"),
    ("post", "/v1/vms/{uuid}/migrate"),
    ("get", "/v1/jobs"),
    ("get", "/v1/jobs/{uuid}"),
    ("get", "/v1/capacity"),
    ("get", "/v1/alerts"),
    ("get", "/v1/audit"),
    ("get", "/v1/usage"),
    ("post", "/v1/placement/dry-run"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_is_documented_and_served() {
    let s = TestServer::start(Backend::Sqlite, fast_config()).await;
    let r = s.http.get(s.url("/v1/openapi.json")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let doc: Value = r.json().await.unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    // Scrub steps refuse unknown fields, and the document says so for each kind of step.
    let steps = doc["components"]["schemas"]["ScrubAction"]["oneOf"]
        .as_array()
        .unwrap();
    assert!(steps.len() >= 5);
    for step in steps {
        assert_eq!(step["additionalProperties"], false, "{step}");
    }
    // Rules the decoder enforces beyond utoipa's attributes are stated too.
    let schemas = &doc["components"]["schemas"];
    assert_eq!(
        schemas["LoginRequest"]["properties"]["login"]["pattern"],
        "^[^\\x00]*$"
    );
    assert_eq!(schemas["CreateVm"]["then"]["required"][0], "server_uuid");
    assert!(
        schemas["CreatePackage"]["properties"]["devices"]["propertyNames"]["pattern"].is_string()
    );
    let paths = doc["paths"].as_object().unwrap();
    for (method, path) in ROUTES {
        assert!(
            paths.get(*path).and_then(|p| p.get(*method)).is_some(),
            "{method} {path} is not in the OpenAPI document"
        );
    }
    let mut documented = 0;
    for (path, item) in paths {
        for method in ["get", "post", "put", "patch", "delete"] {
            let Some(op) = item.get(method) else { continue };
            documented += 1;
            assert!(
                ROUTES.contains(&(method, path.as_str())),
                "{method} {path} is new: add it to ROUTES"
            );
            assert!(
                op["responses"].as_object().is_some_and(|r| !r.is_empty()),
                "{method} {path}"
            );
            let concrete = path
                .replace("{uuid}", "00000000-0000-0000-0000-000000000000")
                .replace("{name}", "x");
            let resp = s
                .http
                .request(method.to_uppercase().parse().unwrap(), s.url(&concrete))
                .send()
                .await
                .unwrap();
            let st = resp.status().as_u16();
            let body: Value = resp.json().await.unwrap_or(Value::Null);
            assert_ne!(st, 405, "{method} {path}: not served");
            assert!(
                !(st == 404 && body["message"] == "no such route"),
                "{method} {path}: documented but not served"
            );
        }
    }
    assert_eq!(documented, ROUTES.len());
    // The schemas the operations name are in the document.
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for name in [
        "Vm",
        "Server",
        "Job",
        "Variant",
        "Package",
        "ApiErrorBody",
        "DevicePath",
        "Capacity",
    ] {
        assert!(schemas.contains_key(name), "schema {name} missing");
    }
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
}
