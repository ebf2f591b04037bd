//! CloudAPI's HTTP face, called directly with signed requests: what the `triton` CLI
//! cannot be made to send (a stale date, a burst of bad signatures, forms, query
//! actions), and the answers around it (`/--ping`, paging, reserved logins, the portal's
//! own not-found page for browsers).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::*;
use base64::Engine;
use ed25519_dalek::{Signer, SigningKey};
use passage_model::ErrorCode;
use passage_model::keys::SshKey;
use serde_json::{Value, json};

/// An account's key, and requests signed with it as the `triton` CLI signs them.
struct Signer25519 {
    login: String,
    key: SigningKey,
    md5: String,
}

impl Signer25519 {
    fn new(login: &str) -> Signer25519 {
        Signer25519 {
            login: login.to_string(),
            key: SigningKey::generate(&mut rand::rngs::OsRng),
            md5: String::new(),
        }
    }

    fn public(&self) -> String {
        let k = ssh_key::PublicKey::from(ssh_key::public::Ed25519PublicKey(
            self.key.verifying_key().to_bytes(),
        ));
        k.to_openssh().unwrap()
    }

    /// Adds the key to the account through `/v1` and remembers its fingerprint.
    async fn register(&mut self, c: &Client) {
        let k: SshKey = c
            .post("/v1/keys", &json!({"key": self.public()}))
            .await
            .ok(201);
        self.md5 = k.md5_fingerprint;
    }

    fn authorization(&self, method: &str, target: &str, date: &str) -> String {
        let message = format!(
            "(request-target): {} {target}\ndate: {date}",
            method.to_lowercase()
        );
        let sig = self.key.sign(message.as_bytes());
        format!(
            "Signature keyId=\"/{}/keys/{}\",algorithm=\"ed25519-sha512\",\
             headers=\"(request-target) date\",signature=\"{}\"",
            self.login,
            self.md5,
            base64::engine::general_purpose::STANDARD.encode(sig.to_bytes())
        )
    }

    async fn send(
        &self,
        s: &TestServer,
        method: &str,
        target: &str,
        body: Option<(&str, String)>,
    ) -> reqwest::Response {
        self.send_dated(s, method, target, body, chrono::Utc::now())
            .await
    }

    async fn send_dated(
        &self,
        s: &TestServer,
        method: &str,
        target: &str,
        body: Option<(&str, String)>,
        at: chrono::DateTime<chrono::Utc>,
    ) -> reqwest::Response {
        let date = at.format("%a, %d %b %Y %H:%M:%S GMT").to_string();
        let mut r = s
            .http
            .request(method.parse().unwrap(), s.url(target))
            .header("date", &date)
            .header("accept", "application/json")
            .header("authorization", self.authorization(method, target, &date));
        if let Some((ctype, b)) = body {
            r = r.header("content-type", ctype).body(b);
        }
        r.send().await.unwrap()
    }
}

async fn code_of(r: reqwest::Response) -> (u16, String) {
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    (status, body["code"].as_str().unwrap_or("").to_string())
}

async fn cloudapi_by_hand(backend: Backend) {
    let mut s = TestServer::start(backend, fast_config()).await;
    let _node = s.add_node(2).await;
    let package = s.h100_catalog(1).await;
    let (_, token) = s.tenant("carol").await;
    let carol_api = s.with(&token);
    let mut carol = Signer25519::new("carol");
    carol.register(&carol_api).await;

    // Ping needs no signature; everything else does.
    let ping: Value = s
        .http
        .get(s.url("/--ping"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ping["ping"], "pong");
    let r = s
        .http
        .get(s.url("/carol/machines"))
        .header("accept", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(code_of(r).await, (401, "InvalidCredentials".into()));
    // A browser asking for the same path gets the portal's not-found page.
    let r = s
        .http
        .get(s.url("/carol/machines"))
        .header("accept", "text/html,application/xhtml+xml")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert!(r.text().await.unwrap().contains("<html"));

    // A date more than five minutes off is refused, though the signature is good.
    let stale = chrono::Utc::now() - chrono::Duration::seconds(400);
    let r = carol
        .send_dated(&s, "GET", "/carol/machines", None, stale)
        .await;
    assert_eq!(code_of(r).await, (401, "InvalidCredentials".into()));
    let r = carol.send(&s, "GET", "/carol", None).await;
    assert_eq!(r.status(), 200);

    // Machines: form bodies, query actions, paging by page length, tag filters.
    for i in 0..2 {
        let form =
            format!("name=m{i}&image=test-image&package={package}&tag.gpu=8&metadata.note=hi");
        let r = carol
            .send(
                &s,
                "POST",
                "/carol/machines",
                Some(("application/x-www-form-urlencoded", form)),
            )
            .await;
        assert_eq!(r.status(), 201);
        assert!(
            r.headers()["location"]
                .to_str()
                .unwrap()
                .starts_with("/carol/machines/")
        );
        let m: Value = r.json().await.unwrap();
        assert_eq!(m["state"], "provisioning");
        assert_eq!(m["tags"]["gpu"], "8");
    }
    let r = carol
        .send(&s, "GET", "/carol/machines?limit=1&offset=0", None)
        .await;
    assert_eq!(r.headers()["x-resource-count"], "1");
    let page: Vec<Value> = r.json().await.unwrap();
    assert_eq!(page[0]["name"], "m1", "newest first");
    let r = carol
        .send(&s, "GET", "/carol/machines?limit=1&offset=1", None)
        .await;
    let page: Vec<Value> = r.json().await.unwrap();
    assert_eq!(page[0]["name"], "m0");
    let r = carol
        .send(&s, "GET", "/carol/machines?limit=1&offset=2", None)
        .await;
    assert_eq!(r.headers()["x-resource-count"], "0");
    // `tag.gpu=8` finds the string "8" (and would find the number 8).
    let r = carol
        .send(&s, "GET", "/carol/machines?tag.gpu=8", None)
        .await;
    assert_eq!(r.json::<Vec<Value>>().await.unwrap().len(), 2);
    let r = carol
        .send(&s, "GET", "/carol/machines?tag.gpu=9&tag.other=x", None)
        .await;
    assert_eq!(r.json::<Vec<Value>>().await.unwrap().len(), 0);
    let r = carol
        .send(&s, "GET", "/carol/machines?state=sleeping", None)
        .await;
    assert_eq!(code_of(r).await, (400, "InvalidArgument".into()));

    let id = page_id(&carol, &s, "m0").await;
    wait_state(&carol, &s, &id, "running").await;
    let r = carol
        .send(
            &s,
            "POST",
            &format!("/carol/machines/{id}?action=stop"),
            None,
        )
        .await;
    assert_eq!(r.status(), 202);
    wait_state(&carol, &s, &id, "stopped").await;
    // Starting it twice: the second finds it not stopped.
    let m0 = format!("/carol/machines/{id}");
    let start = || {
        carol.send(
            &s,
            "POST",
            &m0,
            Some(("application/x-www-form-urlencoded", "action=start".into())),
        )
    };
    assert_eq!(start().await.status(), 202);
    let (status, code) = code_of(start().await).await;
    assert_eq!((status, code.as_str()), (409, "InvalidState"));
    let r = carol
        .send(
            &s,
            "POST",
            &format!("/carol/machines/{id}"),
            Some(("application/json", r#"{"action":"dance"}"#.into())),
        )
        .await;
    assert_eq!(code_of(r).await, (400, "InvalidArgument".into()));
    // Reboot: a clean stop, then a start, in one job.
    wait_state(&carol, &s, &id, "running").await;
    let r = carol
        .send(
            &s,
            "POST",
            &format!("/carol/machines/{id}"),
            Some(("application/json", r#"{"action":"reboot"}"#.into())),
        )
        .await;
    assert_eq!(r.status(), 202);
    let reboot = wait_for(std::time::Duration::from_secs(30), || async {
        // Carol's jobs, newest first: the reboot on top of the ones above.
        let jobs: Vec<Value> = carol_api.get("/v1/jobs").await.ok(200);
        let mine: Vec<&Value> = jobs
            .iter()
            .filter(|j| j["vm_uuid"] == id.as_str())
            .collect();
        let names: Vec<String> = mine
            .iter()
            .map(|j| Some(format!("{}:{}", j["name"].as_str()?, j["state"].as_str()?)))
            .collect::<Option<Vec<String>>>()?;
        (names[..3] == ["reboot:succeeded", "start:succeeded", "stop:succeeded"])
            .then(|| mine[0].clone())
    })
    .await
    .expect("reboot = one job, a clean stop then a start");
    assert_eq!(reboot["steps"][0]["name"], "stop");
    assert_eq!(reboot["steps"][0]["detail"], "guest shut down after 0 s");
    assert_eq!(reboot["steps"][1]["name"], "start");
    wait_state(&carol, &s, &id, "running").await;
    let r = carol
        .send(&s, "GET", "/carol/machines/not-a-uuid", None)
        .await;
    assert_eq!(code_of(r).await, (404, "ResourceNotFound".into()));

    // An image's firmware, as IMGAPI's `requirements.bootrom`.
    let images: Vec<Value> = carol_api.get("/v1/images").await.ok(200);
    let image = images[0]["uuid"].as_str().unwrap().to_string();
    s.patch::<Value>(
        &format!("/v1/images/{image}"),
        &json!({"requirements": {"bootrom": "uefi"}}),
    )
    .await
    .ok(200);
    let r = carol
        .send(&s, "GET", &format!("/carol/images/{image}"), None)
        .await;
    let shown: Value = r.json().await.unwrap();
    assert_eq!(shown["requirements"]["bootrom"], "uefi", "{shown}");

    // An image carol's VMs were built from stays readable to her once disabled (`triton
    // ssh` reads it), though no longer listed; to others it is gone.
    s.delete::<Value>(&format!("/v1/images/{image}")).await;
    let r = carol
        .send(&s, "GET", &format!("/carol/images/{image}"), None)
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["state"], "disabled");
    let r = carol.send(&s, "GET", "/carol/images", None).await;
    assert_eq!(r.headers()["x-resource-count"], "0");
    let (_, dave) = s.tenant("dave").await;
    s.with(&dave)
        .get::<Value>(&format!("/v1/images/{image}"))
        .await
        .fails(404, ErrorCode::ResourceNotFound);

    // A bad signature counts as a failed login: after five, even good ones wait.
    let mut wrong = Signer25519::new("carol");
    wrong.md5 = carol.md5.clone();
    for _ in 0..5 {
        let r = wrong.send(&s, "GET", "/carol", None).await;
        assert_eq!(code_of(r).await, (401, "InvalidCredentials".into()));
    }
    let r = carol.send(&s, "GET", "/carol", None).await;
    assert_eq!(code_of(r).await, (429, "RequestThrottled".into()));

    // Reserved logins: no account can shadow the server's own paths.
    for login in ["v1", "agent", "metrics", "admin", "Keys", "--ping"] {
        let e = s
            .post::<Value>(
                "/v1/accounts",
                &json!({"login": login, "password": "long-enough-1"}),
            )
            .await
            .fails(400, ErrorCode::InvalidArgument);
        assert!(e.message.contains("reserved"), "{login}: {}", e.message);
    }
}
both!(cloudapi_http, cloudapi_by_hand);

async fn page_id(c: &Signer25519, s: &TestServer, name: &str) -> String {
    let r = c
        .send(s, "GET", &format!("/carol/machines?name={name}"), None)
        .await;
    let list: Vec<Value> = r.json().await.unwrap();
    assert_eq!(list.len(), 1, "{list:?}");
    list[0]["id"].as_str().unwrap().to_string()
}

/// Waits until the machine `id` reads `state`.
async fn wait_state(c: &Signer25519, s: &TestServer, id: &str, state: &str) {
    let path = format!("/carol/machines/{id}");
    let seen = wait_for(std::time::Duration::from_secs(30), || async {
        let m: Value = c.send(s, "GET", &path, None).await.json().await.ok()?;
        (m["state"] == state).then_some(())
    })
    .await;
    assert!(seen.is_some(), "{id} never read {state}");
}

/// CloudAPI's tag and metadata calls as the `triton` CLI makes them (`instance tag
/// set|replace-all|delete|list|get`, and the metadata twins): JSON objects of typed
/// values, answers of the whole set, 204s on deletes; the limits of creation; another
/// account's machine not found; every change in the audit log.
async fn cloudapi_tags_and_metadata(backend: Backend) {
    let s = TestServer::start(backend, fast_config()).await;
    s.manual_node(1).await;
    let package = s.h100_catalog(1).await;
    let (_, token) = s.tenant("carol").await;
    let mut carol = Signer25519::new("carol");
    carol.register(&s.with(&token)).await;
    let (_, dave_token) = s.tenant("dave").await;
    let mut dave = Signer25519::new("dave");
    dave.register(&s.with(&dave_token)).await;
    let json_body = |v: Value| Some(("application/json", v.to_string()));

    let r = carol
        .send(
            &s,
            "POST",
            "/carol/machines",
            json_body(
                json!({"name": "t0", "image": "test-image", "package": package,
                             "tag.role": "train", "metadata.note": "hi"}),
            ),
        )
        .await;
    assert_eq!(r.status(), 201);
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let tags = format!("/carol/machines/{id}/tags");
    let md = format!("/carol/machines/{id}/metadata");

    // AddMachineTags merges and answers the whole set.
    let r = carol
        .send(
            &s,
            "POST",
            &tags,
            json_body(json!({"gpu": 8, "prod": true})),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"gpu": 8, "prod": true, "role": "train"})
    );
    let r = carol.send(&s, "GET", &format!("{tags}/gpu"), None).await;
    assert_eq!(r.json::<Value>().await.unwrap(), json!(8));
    // ReplaceMachineTags.
    let r = carol
        .send(&s, "PUT", &tags, json_body(json!({"a": "1", "b": "2"})))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"a": "1", "b": "2"})
    );
    // DeleteMachineTag, then ListMachineTags; an absent tag is not found.
    let r = carol.send(&s, "DELETE", &format!("{tags}/a"), None).await;
    assert_eq!(r.status(), 204);
    let r = carol.send(&s, "GET", &tags, None).await;
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"b": "2"}));
    let r = carol.send(&s, "DELETE", &format!("{tags}/a"), None).await;
    assert_eq!(code_of(r).await, (404, "ResourceNotFound".into()));
    // The machine shows them.
    let m: Value = carol
        .send(&s, "GET", &format!("/carol/machines/{id}"), None)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(m["tags"], json!({"b": "2"}));
    // Limits as at creation.
    let r = carol
        .send(&s, "POST", &tags, json_body(json!({"o": {"x": 1}})))
        .await;
    assert_eq!(code_of(r).await, (400, "InvalidArgument".into()));
    let r = carol
        .send(&s, "POST", &tags, json_body(json!({"a=b": "x"})))
        .await;
    assert_eq!(code_of(r).await, (400, "InvalidArgument".into()));
    // DeleteMachineTags.
    let r = carol.send(&s, "DELETE", &tags, None).await;
    assert_eq!(r.status(), 204);
    let r = carol.send(&s, "GET", &tags, None).await;
    assert_eq!(r.json::<Value>().await.unwrap(), json!({}));

    // Metadata: UpdateMachineMetadata (typed values become their JSON text), Get, List,
    // DeleteMachineMetadata, DeleteAllMachineMetadata.
    let r = carol
        .send(&s, "POST", &md, json_body(json!({"count": 3, "x": "y"})))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"count": "3", "note": "hi", "x": "y"})
    );
    let r = carol.send(&s, "GET", &format!("{md}/count"), None).await;
    assert_eq!(r.json::<Value>().await.unwrap(), json!("3"));
    let r = carol.send(&s, "DELETE", &format!("{md}/x"), None).await;
    assert_eq!(r.status(), 204);
    let r = carol.send(&s, "GET", &md, None).await;
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"count": "3", "note": "hi"})
    );
    let r = carol
        .send(&s, "POST", &md, json_body(json!({"bad key": "v"})))
        .await;
    assert_eq!(code_of(r).await, (400, "InvalidArgument".into()));
    let r = carol.send(&s, "DELETE", &md, None).await;
    assert_eq!(r.status(), 204);
    let r = carol.send(&s, "GET", &md, None).await;
    assert_eq!(r.json::<Value>().await.unwrap(), json!({}));

    // Another account's machine is not there, under either login.
    for (method, path) in [
        ("GET", format!("/dave/machines/{id}/tags")),
        ("POST", format!("/dave/machines/{id}/tags")),
        ("PUT", format!("/dave/machines/{id}/tags")),
        ("DELETE", format!("/dave/machines/{id}/tags")),
        ("POST", format!("/dave/machines/{id}/metadata")),
        ("DELETE", format!("/dave/machines/{id}/metadata/note")),
    ] {
        let body = (method != "GET" && method != "DELETE").then(|| json!({"k": "v"}));
        let r = dave.send(&s, method, &path, body.and_then(json_body)).await;
        assert_eq!(code_of(r).await.0, 404, "{method} {path}");
    }

    // Audited, with the signer as the actor.
    let log: Vec<passage_model::api::AuditEntry> = s.get("/v1/audit?limit=1000").await.ok(200);
    for (method, path, status) in [
        ("POST", tags.clone(), 200),
        ("PUT", tags.clone(), 200),
        ("DELETE", format!("{tags}/a"), 204),
        ("DELETE", tags.clone(), 204),
        ("POST", md.clone(), 200),
        ("DELETE", md.clone(), 204),
    ] {
        assert!(
            log.iter().any(|e| e.method == method
                && e.path == path
                && e.status == status
                && e.actor_login.as_deref() == Some("carol")),
            "{method} {path} {status}: {log:?}"
        );
    }
}

both!(cloudapi_labels, cloudapi_tags_and_metadata);
