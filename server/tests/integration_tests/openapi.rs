//! The OpenAPI document at /v1/openapi.json is generated from the handlers: every route of
//! the contract is in it, and every path in it is served.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config};
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
    ("get", "/v1/networks"),
    ("post", "/v1/networks"),
    ("get", "/v1/networks/{uuid}"),
    ("patch", "/v1/networks/{uuid}"),
    ("delete", "/v1/networks/{uuid}"),
    ("get", "/v1/networks/{uuid}/ips"),
    ("get", "/v1/vms/{uuid}/console"),
    ("get", "/v1/keys"),
    ("post", "/v1/keys"),
    ("get", "/v1/keys/{name}"),
    ("delete", "/v1/keys/{name}"),
    ("get", "/v1/accounts/{uuid}/keys"),
    ("post", "/v1/accounts/{uuid}/keys"),
    ("get", "/v1/accounts/{uuid}/keys/{name}"),
    ("delete", "/v1/accounts/{uuid}/keys/{name}"),
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
    ("get", "/v1/images"),
    ("post", "/v1/images"),
    ("get", "/v1/images/{uuid}"),
    ("patch", "/v1/images/{uuid}"),
    ("delete", "/v1/images/{uuid}"),
    ("put", "/v1/images/{uuid}/file"),
    ("get", "/v1/images/{uuid}/file"),
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
    ("post", "/v1/vms/{uuid}/reboot"),
    ("post", "/v1/vms/{uuid}/start"),
    ("post", "/v1/vms/{uuid}/resize"),
    ("post", "/v1/vms/{uuid}/migrate"),
    ("get", "/v1/vms/{uuid}/tags"),
    ("post", "/v1/vms/{uuid}/tags"),
    ("put", "/v1/vms/{uuid}/tags"),
    ("delete", "/v1/vms/{uuid}/tags"),
    ("get", "/v1/vms/{uuid}/tags/{key}"),
    ("delete", "/v1/vms/{uuid}/tags/{key}"),
    ("get", "/v1/vms/{uuid}/metadata"),
    ("post", "/v1/vms/{uuid}/metadata"),
    ("put", "/v1/vms/{uuid}/metadata"),
    ("delete", "/v1/vms/{uuid}/metadata"),
    ("get", "/v1/vms/{uuid}/metadata/{key}"),
    ("delete", "/v1/vms/{uuid}/metadata/{key}"),
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
    // An image's firmware is one of IMGAPI's two names, nothing else.
    assert_eq!(
        schemas["Bootrom"]["enum"],
        serde_json::json!(["uefi", "bios"])
    );
    assert!(
        schemas["ImageRequirements"]["properties"]["bootrom"].is_object(),
        "{}",
        schemas["ImageRequirements"]
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

/// Follows a `$ref` to the schema it names.
fn resolve<'a>(doc: &'a Value, mut node: &'a Value) -> &'a Value {
    while let Some(r) = node["$ref"].as_str() {
        node = doc.pointer(r.trim_start_matches('#')).unwrap();
    }
    node
}

/// The schema a JSON pointer into a value of `schema` lands on, if the schema has it.
fn at<'a>(doc: &'a Value, schema: &'a Value, pointer: &str) -> Option<&'a Value> {
    let mut node = resolve(doc, schema);
    for seg in pointer.trim_start_matches('/').split('/') {
        node = if seg.parse::<usize>().is_ok() {
            resolve(doc, node.get("items")?)
        } else {
            resolve(doc, node.get("properties")?.get(seg)?)
        };
    }
    Some(node)
}

/// Answers link to the operations their values feed, so that a client (or Schemathesis's
/// stateful phase) reaches real objects: each link names an operation that exists, fills
/// parameters it has from fields the source's answer has (or from its own path), and every operation on one
/// object is reached by some link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_link_to_the_calls_they_feed() {
    let s = TestServer::start(Backend::Sqlite, fast_config()).await;
    let doc: Value = s
        .http
        .get(s.url("/v1/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut ops = std::collections::BTreeMap::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            ops.insert(
                op["operationId"].as_str().unwrap().to_string(),
                (format!("{method} {path}"), op),
            );
        }
    }
    let mut targets = std::collections::BTreeSet::new();
    let mut count = 0;
    for (label, op) in ops.values() {
        for (status, response) in op["responses"].as_object().unwrap() {
            let Some(links) = response["links"].as_object() else {
                continue;
            };
            let schema = &response["content"]["application/json"]["schema"];
            for (name, link) in links {
                count += 1;
                let to = link["operationId"].as_str().unwrap();
                let (_, target) = ops
                    .get(to)
                    .unwrap_or_else(|| panic!("{label} {status} {name}: no operation {to}"));
                targets.insert(to.to_string());
                let mut exprs: Vec<&str> = Vec::new();
                for (param, expr) in link["parameters"].as_object().into_iter().flatten() {
                    assert!(
                        target["parameters"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .any(|p| p["name"] == param.as_str()),
                        "{label} {status} {name}: {to} has no parameter {param}"
                    );
                    exprs.push(expr.as_str().unwrap());
                }
                for (field, expr) in link["requestBody"].as_object().into_iter().flatten() {
                    let body = &target["requestBody"]["content"]["application/json"]["schema"];
                    assert!(
                        at(&doc, body, field).is_some(),
                        "{label} {status} {name}: {to}'s body has no {field}"
                    );
                    // A null leaves an optional field out of the merged body.
                    if let Some(expr) = expr.as_str() {
                        exprs.push(expr);
                    }
                }
                assert!(!exprs.is_empty(), "{label} {status} {name} passes nothing");
                for expr in exprs {
                    // A value of the request's own path: the source must have it.
                    if let Some(param) = expr.strip_prefix("$request.path.") {
                        assert!(
                            label.contains(&format!("{{{param}}}")),
                            "{label} {status} {name}: no path parameter {param}"
                        );
                        continue;
                    }
                    let pointer = expr.strip_prefix("$response.body#").unwrap();
                    assert!(
                        at(&doc, schema, pointer).is_some(),
                        "{label} {status} {name}: the answer has no {pointer}"
                    );
                }
            }
        }
    }
    assert!(count >= 40, "{count} links");
    // Operations on one object, less the three that would cut off the caller or its nodes.
    for (id, (label, _)) in &ops {
        let on_object = label.contains('{');
        let cut_off = ["logout", "delete_token", "revoke_credential"].contains(&id.as_str());
        if on_object && !cut_off {
            assert!(targets.contains(id), "{label} ({id}) is no link's target");
        }
    }
}
