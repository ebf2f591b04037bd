//! A VM's tags and metadata changed after its creation through `/v1/vms/{uuid}/tags` and
//! `/metadata`: set, replace, delete one and all, by the limits of creation, on the
//! owner's VMs only, and audited.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config};
use passage_model::ErrorCode;
use passage_model::api::{AuditEntry, Vm};
use serde::de::IgnoredAny;
use serde_json::{Value, json};
use std::collections::BTreeMap;

async fn tags_and_metadata_change(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    s.manual_node(1).await;
    s.h100_catalog(1).await;
    let (_, tenant) = s.tenant("tess").await;
    let (_, other) = s.tenant("otto").await;
    let reader = s.reader("rita").await;
    let t = s.with(&tenant);
    let vm: Vm = t
        .post(
            "/v1/vms",
            &json!({"alias": "tagged", "package": "gpu-1x", "image": "test-image",
                    "tags": {"role": "train"}, "metadata": {"note": "hi"}}),
        )
        .await
        .ok(202);
    let tags = format!("/v1/vms/{}/tags", vm.uuid);
    let md = format!("/v1/vms/{}/metadata", vm.uuid);

    // Tags: read, merged, replaced, one deleted, all deleted.
    let now: Value = t.get(&tags).await.ok(200);
    assert_eq!(now, json!({"role": "train"}));
    let now: Value = t
        .post(&tags, &json!({"gpu": 8, "prod": true, "role": "eval"}))
        .await
        .ok(200);
    assert_eq!(now, json!({"gpu": 8, "prod": true, "role": "eval"}));
    let one: Value = t.get(&format!("{tags}/gpu")).await.ok(200);
    assert_eq!(one, json!(8));
    let got: Vm = t.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
    assert_eq!(got.tags.get("role"), Some(&json!("eval")));
    let now: Value = t.put(&tags, &json!({"a": "1", "b": "2"})).await.ok(200);
    assert_eq!(now, json!({"a": "1", "b": "2"}));
    t.delete::<IgnoredAny>(&format!("{tags}/a")).await.ok(204);
    assert_eq!(t.get::<Value>(&tags).await.ok(200), json!({"b": "2"}));
    t.delete::<IgnoredAny>(&format!("{tags}/a"))
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    t.get::<IgnoredAny>(&format!("{tags}/a"))
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    t.delete::<IgnoredAny>(&tags).await.ok(204);
    assert_eq!(t.get::<Value>(&tags).await.ok(200), json!({}));

    // The limits of creation hold for the result.
    t.post::<IgnoredAny>(&tags, &json!({"a b": "x"}))
        .await
        .invalid("tags");
    t.post::<IgnoredAny>(&tags, &json!({"obj": {"x": 1}}))
        .await
        .invalid("tags.obj");
    let many: BTreeMap<String, Value> = (0..=passage_model::tags::MAX_TAGS)
        .map(|i| (format!("k{i}"), json!(i)))
        .collect();
    t.put::<IgnoredAny>(&tags, &many).await.invalid("tags");
    // A merge that would pass the count is refused as a whole.
    let half: BTreeMap<String, Value> = (0..40).map(|i| (format!("a{i}"), json!(i))).collect();
    t.put::<Value>(&tags, &half).await.ok(200);
    let more: BTreeMap<String, Value> = (0..40).map(|i| (format!("b{i}"), json!(i))).collect();
    t.post::<IgnoredAny>(&tags, &more).await.invalid("tags");
    assert_eq!(t.get::<BTreeMap<String, Value>>(&tags).await.ok(200), half);

    // Metadata: the same calls, string values.
    assert_eq!(t.get::<Value>(&md).await.ok(200), json!({"note": "hi"}));
    let now: Value = t
        .post(&md, &json!({"user-script": "#!/bin/sh\ntrue\n", "x": "1"}))
        .await
        .ok(200);
    assert_eq!(
        now,
        json!({"note": "hi", "user-script": "#!/bin/sh\ntrue\n", "x": "1"})
    );
    assert_eq!(t.get::<Value>(&format!("{md}/x")).await.ok(200), json!("1"));
    let now: Value = t.put(&md, &json!({"y": "2"})).await.ok(200);
    assert_eq!(now, json!({"y": "2"}));
    t.post::<IgnoredAny>(&md, &json!({"n": 1}))
        .await
        .fails(400, ErrorCode::InvalidArgument);
    t.post::<IgnoredAny>(&md, &json!({"bad key": "v"}))
        .await
        .invalid("metadata");
    let big = "x".repeat(passage_model::metadata::MAX_TOTAL_BYTES);
    t.post::<IgnoredAny>(&md, &json!({ "big": big }))
        .await
        .invalid("metadata");
    t.delete::<IgnoredAny>(&format!("{md}/y")).await.ok(204);
    t.post::<Value>(&md, &json!({"z": "3"})).await.ok(200);
    t.delete::<IgnoredAny>(&md).await.ok(204);
    assert_eq!(t.get::<Value>(&md).await.ok(200), json!({}));
    let got: Vm = t.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
    assert!(got.metadata.is_empty());

    // Another tenant finds nothing; a reader reads but may not change; an operator may.
    for (method, path) in [
        ("GET", tags.clone()),
        ("POST", tags.clone()),
        ("PUT", tags.clone()),
        ("DELETE", tags.clone()),
        ("GET", format!("{tags}/b")),
        ("DELETE", format!("{tags}/b")),
        ("GET", md.clone()),
        ("POST", md.clone()),
        ("DELETE", format!("{md}/z")),
    ] {
        let body = (method == "POST" || method == "PUT").then(|| json!({"k": "v"}).to_string());
        s.with(&other)
            .send::<IgnoredAny>(method, &path, body)
            .await
            .fails(404, ErrorCode::ResourceNotFound);
    }
    s.with(&reader).get::<Value>(&tags).await.ok(200);
    s.with(&reader)
        .post::<IgnoredAny>(&tags, &json!({"k": "v"}))
        .await
        .fails(403, ErrorCode::Forbidden);
    let now: Value = s.put(&tags, &json!({"by": "admin"})).await.ok(200);
    assert_eq!(now, json!({"by": "admin"}));
    // A malformed or unknown VM is not found.
    t.get::<IgnoredAny>("/v1/vms/not-a-uuid/tags")
        .await
        .fails(404, ErrorCode::ResourceNotFound);

    // Each change is in the audit log, with who made it and its answer.
    let log: Vec<AuditEntry> = s.get("/v1/audit?limit=1000").await.ok(200);
    let on = |method: &str, path: &str, status: u16, who: &str| {
        log.iter().any(|e| {
            e.method == method
                && e.path == path
                && e.status == status
                && e.actor_login.as_deref() == Some(who)
        })
    };
    assert!(on("POST", &tags, 200, "tess"), "{log:?}");
    assert!(on("PUT", &tags, 200, "tess"));
    assert!(on("DELETE", &format!("{tags}/a"), 204, "tess"));
    assert!(on("DELETE", &tags, 204, "tess"));
    assert!(on("POST", &tags, 400, "tess"));
    assert!(on("PUT", &tags, 200, "admin"));
    assert!(on("POST", &tags, 404, "otto"));
    assert!(on("DELETE", &md, 204, "tess"));
    assert!(on("PUT", &md, 200, "tess"));
}

both!(tags_and_metadata_change, tags_and_metadata_change);

/// `GET /agent/v1/vms/{uuid}/guest`: what a node's metadata service tells a guest, its
/// tags and metadata as they are now; only the node the VM is on gets it.
async fn the_node_reads_its_guests_labels(b: Backend) {
    use passage_model::protocol::GuestMetadata;
    let s = TestServer::start(b, fast_config()).await;
    let (node, cred, _) = s.manual_node(1).await;
    s.h100_catalog(1).await;
    let (owner, tenant) = s.tenant("gina").await;
    let t = s.with(&tenant);
    let vm: Vm = t
        .post(
            "/v1/vms",
            &json!({"alias": "guest", "package": "gpu-1x", "image": "test-image",
                    "tags": {"role": "train"},
                    "metadata": {"user-data": "#cloud-config\n", "note": "hi"}}),
        )
        .await
        .ok(202);
    assert_eq!(vm.server_uuid, Some(node));
    let path = format!("/agent/v1/vms/{}/guest", vm.uuid);
    let n = s.with(&cred);
    let g: GuestMetadata = n.get(&path).await.ok(200);
    assert_eq!((g.uuid, g.owner_uuid), (vm.uuid, Some(owner)));
    assert_eq!(g.hostname, "guest");
    assert_eq!(g.tags.get("role"), Some(&json!("train")));
    assert_eq!(g.metadata.get("note").map(String::as_str), Some("hi"));
    assert_eq!(
        g.metadata.get("user-data").map(String::as_str),
        Some("#cloud-config\n")
    );
    t.post::<Value>(
        &format!("/v1/vms/{}/tags", vm.uuid),
        &json!({"role": "eval"}),
    )
    .await
    .ok(200);
    let g: GuestMetadata = n.get(&path).await.ok(200);
    assert_eq!(g.tags.get("role"), Some(&json!("eval")));

    // Another node, a tenant's token, no credential, a VM that does not exist: nothing.
    let (_, other, _) = s.manual_node(1).await;
    s.with(&other)
        .get::<IgnoredAny>(&path)
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    t.get::<IgnoredAny>(&path)
        .await
        .fails(401, ErrorCode::Unauthorized);
    s.client(None)
        .get::<IgnoredAny>(&path)
        .await
        .fails(401, ErrorCode::Unauthorized);
    n.get::<IgnoredAny>(&format!(
        "/agent/v1/vms/{}/guest",
        passage_model::VmId::new_random()
    ))
    .await
    .fails(404, ErrorCode::ResourceNotFound);
    n.get::<IgnoredAny>("/agent/v1/vms/not-a-uuid/guest")
        .await
        .fails(404, ErrorCode::ResourceNotFound);
}

both!(
    the_node_reads_its_guests_labels,
    the_node_reads_its_guests_labels
);
