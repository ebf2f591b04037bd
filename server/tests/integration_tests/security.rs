//! Tenancy and hardening: the BOLA matrix, login throttling, sessions ended by a password
//! change, by idling and at their limit, security headers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{self, Backend, TestServer, fast_config};
use passage_model::api::{
    Account, ApiToken, Job, JoinToken, LoginResponse, Package, Server, ServerStatus, StepState, Vm,
};
use passage_model::protocol::{HeartbeatResponse, RegisterResponse};
use passage_model::{DeviceState, ErrorCode, Variant};
use serde::de::IgnoredAny;
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

/// Every object a refused call could have changed, as an operator reads it.
#[derive(Debug, PartialEq)]
struct Snapshot {
    vm: Vm,
    job: Job,
    account: Account,
    package: Package,
    variant: Variant,
    server: Server,
    tokens: Vec<ApiToken>,
}

async fn bola_matrix(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    // A fleet: one node (registered by hand, so jobs just wait), catalog, two tenants,
    // a reader, and the owner's VM, job and API token.
    let (server, agent, _) = s.manual_node(8).await;
    let pkg = s.h100_catalog(1).await;
    let packages: Vec<Package> = s.get("/v1/packages").await.ok(200);
    let pkg_uuid = packages[0].uuid;
    let (owner_uuid, owner) = s.tenant("owner").await;
    let (_, other) = s.tenant("other").await;
    let reader = s.reader("ro").await;
    let vm: Vm = s
        .with(&owner)
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"mine","package": pkg}),
        )
        .await
        .ok(202);
    let vm_uuid = vm.uuid;
    let job_uuid = vm.job_uuid.unwrap();
    let tok: ApiToken = s
        .with(&owner)
        .post("/v1/tokens", &json!({"name":"t"}))
        .await
        .ok(201);
    let tok_uuid = tok.uuid;
    let device = s.device_states(server).await[0].0.clone();

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
        let mut server: Server = s.get(&format!("/v1/servers/{server}")).await.ok(200);
        // Heartbeats move; nothing else may.
        server.last_heartbeat = None;
        server.status = ServerStatus::Running;
        Snapshot {
            vm: s.get(&format!("/v1/vms/{vm_uuid}")).await.ok(200),
            job: s.get(&format!("/v1/jobs/{job_uuid}")).await.ok(200),
            account: s.get(&format!("/v1/accounts/{owner_uuid}")).await.ok(200),
            package: s.get(&format!("/v1/packages/{pkg_uuid}")).await.ok(200),
            variant: s.get("/v1/variants/NVIDIA_H100").await.ok(200),
            server,
            tokens: s.with(&owner).get("/v1/tokens").await.ok(200),
        }
    };
    // The provision job waits on the silent node at `bind`; let it get there first, so
    // only refused calls could change what the snapshot sees.
    common::wait_for(std::time::Duration::from_secs(10), || async {
        let j: Job = s.get(&format!("/v1/jobs/{job_uuid}")).await.ok(200);
        (j.steps[1].state == StepState::Running).then_some(())
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
            let r = s
                .client(token(*who).as_deref())
                .send::<IgnoredAny>(method, path, body.as_ref().map(Value::to_string))
                .await;
            assert_eq!(r.status, expect[i], "{method} {path} as {who:?}: {r:?}");
            let code = match r.status {
                401 => ErrorCode::Unauthorized,
                403 => ErrorCode::Forbidden,
                404 => ErrorCode::ResourceNotFound,
                _ => continue,
            };
            assert_eq!(r.code(), Some(code), "{method} {path} as {who:?}");
        }
    }
    let after = snapshot().await;
    assert_eq!(before, after, "refused calls changed something");
    // The owner may do what others may not.
    s.with(&owner).delete::<()>(&tok_p).await.ok(204);
    // Still provisioning: the owner's deletion cancels it.
    let v: Vm = s.with(&owner).delete(&vm_p).await.ok(202);
    assert_eq!(v.state, passage_model::api::VmState::Destroying);
}
both!(bola_matrix_on, bola_matrix);

async fn login_throttling(b: Backend) {
    let mut cfg = fast_config();
    cfg.login_limits.per_login = 3;
    cfg.login_limits.per_address = 6;
    let s = TestServer::start(b, cfg).await;
    let attempt = |login: &'static str, pw: &'static str| {
        let anon = s.client(None);
        async move {
            anon.post::<LoginResponse>("/v1/auth/login", &json!({"login": login, "password": pw}))
                .await
        }
    };
    for _ in 0..3 {
        attempt("admin", "wrong-password").await.err(401);
    }
    // Locked: even the right password is refused for now.
    attempt("admin", common::ADMIN_PASSWORD)
        .await
        .fails(429, ErrorCode::RateLimited);
    // An unknown name locks the same way: no hint of which accounts exist.
    for _ in 0..3 {
        attempt("ghost", "wrong-password").await.err(401);
    }
    attempt("ghost", "wrong-password").await.err(429);
    // Six failures from this address: now every name is refused from here.
    attempt("someone-else", "whatever-pw").await.err(429);
}
both!(login_throttling_on, login_throttling);

async fn password_change_ends_sessions(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let (uuid, tenant) = s.tenant("pat").await;
    let api_tok: ApiToken = s
        .with(&tenant)
        .post("/v1/tokens", &json!({"name":"ci"}))
        .await
        .ok(201);
    let api_tok = api_tok.token.unwrap();
    s.patch::<Account>(
        &format!("/v1/accounts/{uuid}"),
        &json!({"password": "a-new-password"}),
    )
    .await
    .ok(200);
    assert_eq!(
        s.with(&tenant)
            .get::<Vec<Package>>("/v1/packages")
            .await
            .status,
        401,
        "old session ended"
    );
    assert_eq!(
        s.with(&api_tok)
            .get::<Vec<Package>>("/v1/packages")
            .await
            .status,
        200,
        "API tokens live on until revoked"
    );
    s.client(None)
        .post::<LoginResponse>(
            "/v1/auth/login",
            &json!({"login":"pat","password":"tenant-password"}),
        )
        .await
        .err(401);
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
    let api: ApiToken = s
        .with(&tenant)
        .post("/v1/tokens", &json!({"name":"ci"}))
        .await
        .ok(201);
    let api = api.token.unwrap();
    let me = |t: String| {
        let c = s.with(&t);
        async move { c.get::<Account>("/v1/auth/me").await.status }
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
        let anon = s.client(None);
        async move {
            anon.post::<RegisterResponse>(
                "/agent/v1/register",
                &json!({"join_token": jt, "hostname":"cn-1", "agent_version":"t", "protocol_version":1}),
            )
            .await
        }
    };
    let reg = register(s.join_token().await).await.ok(201);
    let server = reg.server_uuid;
    let cred = reg.credential;
    s.with(&cred)
        .put::<()>("/agent/v1/inventory", &json!({"devices": devices}))
        .await
        .ok(204);
    let hb = |c: String| {
        let c = s.with(&c);
        async move {
            c.post::<HeartbeatResponse>("/agent/v1/heartbeat", &json!({}))
                .await
                .status
        }
    };

    let rot: RegisterResponse = s
        .with(&cred)
        .post("/agent/v1/credential", &json!({}))
        .await
        .ok(200);
    assert_eq!(rot.server_uuid, server);
    let cred2 = rot.credential;
    assert_eq!(hb(cred.clone()).await, 401, "the old credential is dead");
    assert_eq!(hb(cred2.clone()).await, 200);

    let (_, tenant) = s.tenant("t").await;
    let path = format!("/v1/servers/{server}/credential");
    s.with(&tenant).delete::<()>(&path).await.err(403);
    s.delete::<()>(&path).await.ok(204);
    assert_eq!(hb(cred2).await, 401, "revoked");

    s.post::<JoinToken>(
        "/v1/servers/join-tokens",
        &json!({"server_uuid": "00000000-0000-0000-0000-000000000000"}),
    )
    .await
    .missing("server_uuid");
    let jt: JoinToken = s
        .post("/v1/servers/join-tokens", &json!({"server_uuid": server}))
        .await
        .ok(201);
    let back = register(jt.token).await.ok(201);
    assert_eq!(back.server_uuid, server, "the same node");
    assert_eq!(hb(back.credential).await, 200);
    assert_eq!(s.server_uuids().await, vec![server], "no second server");
    assert!(
        !s.server(server)
            .await
            .sysinfo
            .unwrap()
            .pci_devices
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
    s.patch::<Account>(&format!("/v1/accounts/{uuid}"), &json!({"gpu_quota": 4}))
        .await
        .ok(200);
    let calls: Vec<_> = (0..64)
        .map(|i| {
            let c = s.with(&tenant);
            let body =
                json!({"image": "test-image", "alias": format!("q{i}"), "package": "gpu-1x"});
            tokio::spawn(async move { c.post::<Vm>("/v1/vms", &body).await })
        })
        .collect();
    let mut ok = 0;
    for c in calls {
        let r = c.await.unwrap();
        if r.status == 202 {
            ok += 1;
        } else {
            let e = r.fails(409, ErrorCode::QuotaExceeded);
            assert!(e.message.contains("quota of 4"), "{e:?}");
        }
    }
    assert_eq!(ok, 4);
    let held = s
        .device_states(server)
        .await
        .iter()
        .filter(|(_, st, _)| *st == DeviceState::Provisioning)
        .count();
    assert_eq!(held, 4, "exactly the winners' devices are held");
}
both!(quota_under_a_race_on, quota_under_a_race);
