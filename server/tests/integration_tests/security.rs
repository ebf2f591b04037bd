//! Tenancy and hardening: the BOLA matrix, login throttling, sessions ended by a password
//! change, by idling and at their limit, security headers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{self, Backend, TestServer, fast_config};
use serde_json::{Value, json};

#[derive(Clone, Copy, Debug)]
enum Who {
    Owner,
    Other,
    Reader,
    Operator,
    Anonymous,
    Agent,
}

const ALL: [Who; 6] = [
    Who::Owner,
    Who::Other,
    Who::Reader,
    Who::Operator,
    Who::Anonymous,
    Who::Agent,
];

async fn bola_matrix(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    // A fleet: one node (registered by hand, so jobs just wait), catalog, two tenants,
    // a reader, and the owner's VM, job and API token.
    let (server, agent, _) = s.manual_node(8).await;
    let pkg = s.h100_catalog(1).await;
    let (_, pkg_obj) = s.admin_call("GET", "/v1/packages", None).await;
    let pkg_uuid = pkg_obj[0]["uuid"].as_str().unwrap().to_string();
    let (owner_uuid, owner) = s.tenant("owner").await;
    let (_, other) = s.tenant("other").await;
    s.admin_call(
        "POST",
        "/v1/accounts",
        Some(json!({"login":"ro","password":"reader-password","role":"reader"})),
    )
    .await;
    let reader = s.login("ro", "reader-password").await;
    let (_, vm) = s
        .call(
            "POST",
            "/v1/vms",
            Some(&owner),
            Some(json!({"alias":"mine","package": pkg})),
        )
        .await;
    let vm_uuid = vm["uuid"].as_str().unwrap().to_string();
    let job_uuid = vm["job_uuid"].as_str().unwrap().to_string();
    let (_, tok) = s
        .call(
            "POST",
            "/v1/tokens",
            Some(&owner),
            Some(json!({"name":"t"})),
        )
        .await;
    let tok_uuid = tok["uuid"].as_str().unwrap().to_string();
    let device = s.device_states(&server).await[0].0.clone();

    let token = |w: Who| -> Option<String> {
        match w {
            Who::Owner => Some(owner.clone()),
            Who::Other => Some(other.clone()),
            Who::Reader => Some(reader.clone()),
            Who::Operator => Some(s.admin.clone()),
            Who::Anonymous => None,
            Who::Agent => Some(agent.clone()),
        }
    };
    let snapshot = || async {
        let mut out = Vec::new();
        for p in [
            format!("/v1/vms/{vm_uuid}"),
            format!("/v1/jobs/{job_uuid}"),
            format!("/v1/accounts/{owner_uuid}"),
            format!("/v1/packages/{pkg_uuid}"),
            "/v1/variants/NVIDIA_H100".to_string(),
            format!("/v1/servers/{server}"),
        ] {
            let (_, mut v) = s.admin_call("GET", &p, None).await;
            // Heartbeats move; nothing else may.
            if let Some(o) = v.as_object_mut() {
                o.remove("last_heartbeat");
                o.remove("status");
            }
            out.push(v);
        }
        let (_, t) = s.call("GET", "/v1/tokens", Some(&owner), None).await;
        out.push(t);
        out
    };
    // The provision job waits on the silent node at `bind`; let it get there first, so
    // only refused calls could change what the snapshot sees.
    common::wait_for(std::time::Duration::from_secs(10), || async {
        let (_, j) = s
            .admin_call("GET", &format!("/v1/jobs/{job_uuid}"), None)
            .await;
        (j["steps"][1]["state"] == "running").then_some(())
    })
    .await
    .expect("the job reached bind");
    let before = snapshot().await;

    // (method, path, body, expected status for Owner, Other, Reader, Operator, Anonymous, Agent);
    // 0 = not tried (the call would succeed and change things).
    let vm_p = format!("/v1/vms/{vm_uuid}");
    let job_p = format!("/v1/jobs/{job_uuid}");
    let acct_p = format!("/v1/accounts/{owner_uuid}");
    let tok_p = format!("/v1/tokens/{tok_uuid}");
    let pkg_p = format!("/v1/packages/{pkg_uuid}");
    let srv_p = format!("/v1/servers/{server}");
    let act_p = format!("/v1/servers/{server}/device-actions");
    let variant = json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330"});
    let cases: Vec<(&str, String, Option<Value>, [u16; 6])> = vec![
        ("GET", vm_p.clone(), None, [200, 404, 200, 200, 401, 401]),
        ("DELETE", vm_p.clone(), None, [0, 404, 403, 0, 401, 401]),
        ("GET", job_p.clone(), None, [200, 404, 200, 200, 401, 401]),
        ("GET", acct_p.clone(), None, [200, 404, 200, 200, 401, 401]),
        (
            "PATCH",
            acct_p.clone(),
            Some(json!({"gpu_quota": 99})),
            [403, 404, 403, 0, 401, 401],
        ),
        ("DELETE", acct_p.clone(), None, [403, 404, 403, 0, 401, 401]),
        ("DELETE", tok_p.clone(), None, [0, 404, 404, 404, 401, 401]),
        ("GET", pkg_p.clone(), None, [200, 200, 200, 200, 401, 401]),
        ("DELETE", pkg_p.clone(), None, [403, 403, 403, 0, 401, 401]),
        (
            "GET",
            "/v1/variants/NVIDIA_H100".into(),
            None,
            [403, 403, 200, 200, 401, 401],
        ),
        (
            "PUT",
            "/v1/variants/NVIDIA_H100".into(),
            Some(variant.clone()),
            [403, 403, 403, 0, 401, 401],
        ),
        (
            "DELETE",
            "/v1/variants/NVIDIA_H100".into(),
            None,
            [403, 403, 403, 0, 401, 401],
        ),
        ("GET", srv_p.clone(), None, [403, 403, 200, 200, 401, 401]),
        (
            "PATCH",
            srv_p.clone(),
            Some(json!({"disabled": true})),
            [403, 403, 403, 0, 401, 401],
        ),
        (
            "GET",
            format!("{srv_p}/device-events"),
            None,
            [403, 403, 200, 200, 401, 401],
        ),
        (
            "POST",
            act_p.clone(),
            Some(json!({"device": device, "action":"disable","reason":"x"})),
            [403, 403, 403, 0, 401, 401],
        ),
        (
            "POST",
            "/v1/servers/join-tokens".into(),
            None,
            [403, 403, 403, 0, 401, 401],
        ),
        (
            "GET",
            "/v1/accounts".into(),
            None,
            [403, 403, 200, 200, 401, 401],
        ),
        (
            "GET",
            "/v1/audit".into(),
            None,
            [403, 403, 200, 200, 401, 401],
        ),
        (
            "GET",
            "/v1/capacity".into(),
            None,
            [403, 403, 200, 200, 401, 401],
        ),
    ];
    for (method, path, body, expect) in &cases {
        for (i, who) in ALL.iter().enumerate() {
            if expect[i] == 0 {
                continue;
            }
            let (st, e) = s
                .call(method, path, token(*who).as_deref(), body.clone())
                .await;
            assert_eq!(st, expect[i], "{method} {path} as {who:?}: {e}");
            let code = match st {
                401 => "Unauthorized",
                403 => "Forbidden",
                404 => "ResourceNotFound",
                _ => continue,
            };
            assert_eq!(e["code"], code, "{method} {path} as {who:?}");
        }
    }
    let after = snapshot().await;
    for (i, (a, b)) in before.iter().zip(&after).enumerate() {
        assert!(a == b, "refused calls changed object {i}");
    }
    // The owner may do what others may not.
    let (st, _) = s.call("DELETE", &tok_p, Some(&owner), None).await;
    assert_eq!(st, 204);
    let (st, _) = s.call("DELETE", &vm_p, Some(&owner), None).await;
    assert_eq!(
        st, 409,
        "still provisioning: the owner gets past the checks to the state check"
    );
}
both!(bola_matrix_on, bola_matrix);

async fn login_throttling(b: Backend) {
    let mut cfg = fast_config();
    cfg.login_limits.per_login = 3;
    cfg.login_limits.per_address = 6;
    let s = TestServer::start(b, cfg).await;
    let attempt = |login: &'static str, pw: &'static str| {
        let s = &s;
        async move {
            s.call(
                "POST",
                "/v1/auth/login",
                None,
                Some(json!({"login": login, "password": pw})),
            )
            .await
        }
    };
    for _ in 0..3 {
        assert_eq!(attempt("admin", "wrong-password").await.0, 401);
    }
    // Locked: even the right password is refused for now.
    let (st, e) = attempt("admin", common::ADMIN_PASSWORD).await;
    assert_eq!((st, e["code"].as_str()), (429, Some("RateLimited")), "{e}");
    // An unknown name locks the same way: no hint of which accounts exist.
    for _ in 0..3 {
        assert_eq!(attempt("ghost", "wrong-password").await.0, 401);
    }
    assert_eq!(attempt("ghost", "wrong-password").await.0, 429);
    // Six failures from this address: now every name is refused from here.
    let (st, _) = attempt("someone-else", "whatever-pw").await;
    assert_eq!(st, 429);
}
both!(login_throttling_on, login_throttling);

async fn password_change_ends_sessions(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let (uuid, tenant) = s.tenant("pat").await;
    let (_, api_tok) = s
        .call(
            "POST",
            "/v1/tokens",
            Some(&tenant),
            Some(json!({"name":"ci"})),
        )
        .await;
    let api_tok = api_tok["token"].as_str().unwrap().to_string();
    let (st, _) = s
        .admin_call(
            "PATCH",
            &format!("/v1/accounts/{uuid}"),
            Some(json!({"password": "a-new-password"})),
        )
        .await;
    assert_eq!(st, 200);
    assert_eq!(
        s.call("GET", "/v1/packages", Some(&tenant), None).await.0,
        401,
        "old session ended"
    );
    assert_eq!(
        s.call("GET", "/v1/packages", Some(&api_tok), None).await.0,
        200,
        "API tokens live on until revoked"
    );
    assert_eq!(
        s.call(
            "POST",
            "/v1/auth/login",
            None,
            Some(json!({"login":"pat","password":"tenant-password"}))
        )
        .await
        .0,
        401
    );
    s.login("pat", "a-new-password").await;
}
both!(
    password_change_ends_sessions_on,
    password_change_ends_sessions
);

async fn sessions_end_when_idle_and_at_their_limit(b: Backend) {
    use std::time::{Duration, Instant};
    let mut cfg = fast_config();
    cfg.session_idle = Duration::from_secs(2);
    cfg.token_ttl = Duration::from_secs(5);
    let s = TestServer::start(b, cfg).await;
    let (_, tenant) = s.tenant("pat").await;
    let signed_in = Instant::now();
    let (_, api) = s
        .call(
            "POST",
            "/v1/tokens",
            Some(&tenant),
            Some(json!({"name":"ci"})),
        )
        .await;
    let api = api["token"].as_str().unwrap().to_string();
    let me = |t: String| {
        let s = &s;
        async move { s.call("GET", "/v1/auth/me", Some(&t), None).await.0 }
    };
    // In use, a session outlives its idle timeout many times over...
    while signed_in.elapsed() < Duration::from_millis(3500) {
        assert_eq!(me(tenant.clone()).await, 200, "a busy session lives on");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // ...but not its absolute limit, however busy.
    let ended = loop {
        if me(tenant.clone()).await == 401 {
            break signed_in.elapsed();
        }
        assert!(signed_in.elapsed() < Duration::from_secs(10), "never ended");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        ended >= Duration::from_millis(4800),
        "ended early: {ended:?}"
    );
    // Idle: a fresh session left alone ends after the idle timeout...
    let idle = s.login("pat", "tenant-password").await;
    assert_eq!(me(idle.clone()).await, 200);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(me(idle.clone()).await, 401, "idle session ended");
    // ...and stays ended when used again. API tokens have only their expiry.
    assert_eq!(me(idle).await, 401);
    assert_eq!(me(api).await, 200, "API tokens do not idle out");
}
both!(
    sessions_end_when_idle_and_at_their_limit_on,
    sessions_end_when_idle_and_at_their_limit
);

#[tokio::test]
async fn security_headers_everywhere() {
    let s = TestServer::start(Backend::Sqlite, fast_config()).await;
    for path in ["/", "/login", "/v1/ping", "/v1/vms", "/v1/nowhere"] {
        let r = s.http.get(s.url(path)).send().await.unwrap();
        let h = r.headers();
        assert!(
            h["content-security-policy"]
                .to_str()
                .unwrap()
                .contains("frame-ancestors 'none'"),
            "{path}"
        );
        assert_eq!(h["x-content-type-options"], "nosniff", "{path}");
        assert_eq!(h["referrer-policy"], "same-origin", "{path}");
        assert_eq!(h["x-frame-options"], "DENY", "{path}");
        assert!(
            h.get("access-control-allow-origin").is_none(),
            "CORS stays closed"
        );
    }
}

/// A node's credential: the node can rotate it, an operator can revoke it, and a join
/// token made for the server re-admits the same node with its devices and history.
async fn node_identity(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let dir = tempfile::tempdir().unwrap();
    node_agent::fake::generate(
        &dir.path().join("sys"),
        &node_agent::fake::FakeSpec::default(),
    )
    .unwrap();
    let devices = node_agent::host::discover(&dir.path().join("sys")).devices;
    let register = |jt: String| {
        let s = &s;
        async move {
            s.call("POST", "/agent/v1/register", None,
                   Some(json!({"join_token": jt, "hostname":"cn-1", "agent_version":"t", "protocol_version":1})))
                .await
        }
    };
    let (_, reg) = register(s.join_token().await).await;
    let server = reg["server_uuid"].as_str().unwrap().to_string();
    let cred = reg["credential"].as_str().unwrap().to_string();
    s.call(
        "PUT",
        "/agent/v1/inventory",
        Some(&cred),
        Some(json!({"devices": devices})),
    )
    .await;
    let hb = |c: String| {
        let s = &s;
        async move {
            s.call("POST", "/agent/v1/heartbeat", Some(&c), Some(json!({})))
                .await
                .0
        }
    };

    let (st, rot) = s
        .call("POST", "/agent/v1/credential", Some(&cred), Some(json!({})))
        .await;
    assert_eq!(
        (st, rot["server_uuid"].as_str()),
        (200, Some(server.as_str()))
    );
    let cred2 = rot["credential"].as_str().unwrap().to_string();
    assert_eq!(hb(cred.clone()).await, 401, "the old credential is dead");
    assert_eq!(hb(cred2.clone()).await, 200);

    let (_, tenant) = s.tenant("t").await;
    let path = format!("/v1/servers/{server}/credential");
    assert_eq!(s.call("DELETE", &path, Some(&tenant), None).await.0, 403);
    assert_eq!(s.admin_call("DELETE", &path, None).await.0, 204);
    assert_eq!(hb(cred2).await, 401, "revoked");

    let (st, e) = s
        .admin_call(
            "POST",
            "/v1/servers/join-tokens",
            Some(json!({"server_uuid": "00000000-0000-0000-0000-000000000000"})),
        )
        .await;
    assert_eq!((st, e["field"].as_str()), (404, Some("server_uuid")));
    let (st, jt) = s
        .admin_call(
            "POST",
            "/v1/servers/join-tokens",
            Some(json!({"server_uuid": server})),
        )
        .await;
    assert_eq!(st, 201);
    let (st, back) = register(jt["token"].as_str().unwrap().to_string()).await;
    assert_eq!(
        (st, back["server_uuid"].as_str()),
        (201, Some(server.as_str())),
        "the same node"
    );
    assert_eq!(
        hb(back["credential"].as_str().unwrap().to_string()).await,
        200
    );
    assert_eq!(
        s.server_uuids().await,
        vec![server.clone()],
        "no second server"
    );
    assert!(
        !s.server(&server).await["sysinfo"]["PCI Devices"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}
both!(node_identity_on, node_identity);

/// 64 creations at once by one tenant whose quota is 4: exactly 4 succeed, the others are
/// refused with `QuotaExceeded` naming the quota, and nothing is left half-reserved.
async fn quota_under_a_race(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let (server, _, _) = s.manual_node(8).await;
    s.h100_catalog(1).await;
    let (uuid, tenant) = s.tenant("greedy").await;
    s.admin_call(
        "PATCH",
        &format!("/v1/accounts/{uuid}"),
        Some(json!({"gpu_quota": 4})),
    )
    .await;
    let mut calls = Vec::new();
    for i in 0..64 {
        let (http, url, t) = (s.http.clone(), s.url("/v1/vms"), tenant.clone());
        calls.push(tokio::spawn(async move {
            let r = http
                .post(url)
                .bearer_auth(t)
                .json(&json!({"alias": format!("q{i}"), "package": "gpu-1x"}))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }));
    }
    let mut ok = 0;
    for c in calls {
        let (st, body) = c.await.unwrap();
        if st == 202 {
            ok += 1;
        } else {
            assert_eq!(
                (st, body["code"].as_str()),
                (409, Some("QuotaExceeded")),
                "{body}"
            );
            assert!(
                body["message"].as_str().unwrap().contains("quota of 4"),
                "{body}"
            );
        }
    }
    assert_eq!(ok, 4);
    let held = s
        .device_states(&server)
        .await
        .iter()
        .filter(|(_, st, _)| st == "provisioning")
        .count();
    assert_eq!(held, 4, "exactly the winners' devices are held");
}
both!(quota_under_a_race_on, quota_under_a_race);
