//! `GET /v1/vms/{uuid}/console`: the end of a VM's serial console, read from its node
//! (here the real agent loop with the simulated hypervisor, which writes a boot log).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::*;
use passage_model::ErrorCode;
use passage_model::VmId;
use passage_model::api::{JobState, Vm, VmConsole};
use serde_json::{Value, json};
use std::time::Duration;

async fn owners_read_their_vms_console(backend: Backend) {
    let mut s = TestServer::start(backend, fast_config()).await;
    let _node = s.add_node(2).await;
    s.h100_catalog(1).await;
    let (_, alice) = s.tenant("alice").await;
    let (_, bob) = s.tenant("bob").await;
    let (alice, bob) = (s.with(&alice), s.with(&bob));
    let vm: Vm = alice
        .post(
            "/v1/vms",
            &json!({"alias": "c", "package": "gpu-1x", "image": "test-image"}),
        )
        .await
        .ok(202);
    let job = s.wait_job(vm.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let path = format!("/v1/vms/{}/console", vm.uuid);
    let c: VmConsole = alice.get(&path).await.ok(200);
    assert_eq!(c.vm_uuid, vm.uuid);
    assert!(
        c.output.contains(&vm.uuid.to_string()),
        "the simulated boot log names its VM: {:?}",
        c.output
    );
    let by_op: VmConsole = s.get(&path).await.ok(200);
    assert_eq!(by_op.vm_uuid, vm.uuid);
    bob.get::<Value>(&path)
        .await
        .fails(404, ErrorCode::ResourceNotFound);

    let d: Vm = alice.delete(&format!("/v1/vms/{}", vm.uuid)).await.ok(202);
    s.wait_job(d.job_uuid.unwrap()).await;
    alice
        .get::<Value>(&path)
        .await
        .fails(409, ErrorCode::InvalidState);
}
both!(owners_read_their_vms_console, owners_read_their_vms_console);

/// The interactive console's websocket, as a client opens it.
pub type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Opens `/v1/vms/{vm}/console` as a websocket with `headers` (a bearer token, a cookie
/// and an origin): the socket, or the HTTP status it was refused with.
pub async fn open_console(base: &str, vm: VmId, headers: &[(&str, String)]) -> Result<Socket, u16> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let url = format!("{}/v1/vms/{vm}/console", base.replacen("http", "ws", 1));
    let mut req = url.into_client_request().unwrap();
    for (k, v) in headers {
        req.headers_mut().insert(
            axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    match tokio_tungstenite::connect_async(req).await {
        Ok((s, _)) => Ok(s),
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => Err(r.status().as_u16()),
        Err(e) => panic!("opening the console: {e}"),
    }
}

pub fn bearer(token: &str) -> Vec<(&'static str, String)> {
    vec![("authorization", format!("Bearer {token}"))]
}

/// What came from the console until `want` appeared (all of it, as text), or a panic
/// after `limit` naming what did come.
pub async fn read_until(ws: &mut Socket, want: &str, limit: Duration) -> String {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + limit;
    while !String::from_utf8_lossy(&got).contains(want) {
        let m = match tokio::time::timeout_at(deadline, ws.next()).await {
            Ok(Some(Ok(m))) => m,
            Ok(other) => panic!(
                "the console ended ({other:?}) before {want:?}; it sent {:?}",
                String::from_utf8_lossy(&got)
            ),
            Err(_) => panic!(
                "no {want:?} within {limit:?}; the console sent {:?}",
                String::from_utf8_lossy(&got)
            ),
        };
        match m {
            Message::Binary(b) => got.extend_from_slice(&b),
            Message::Text(t) => got.extend_from_slice(t.as_bytes()),
            Message::Close(c) => panic!(
                "the console closed ({c:?}) before {want:?}; it sent {:?}",
                String::from_utf8_lossy(&got)
            ),
            _ => {}
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Sends `text` as a binary frame, as a terminal sends keystrokes.
pub async fn type_in(ws: &mut Socket, text: &str) {
    use futures_util::SinkExt;
    ws.send(tokio_tungstenite::tungstenite::Message::Binary(
        text.as_bytes().to_vec().into(),
    ))
    .await
    .unwrap();
}

/// The close frame the console ends with (code and reason), skipping what comes first.
pub async fn closed(ws: &mut Socket, limit: Duration) -> (u16, String) {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Ok(Some(Ok(Message::Close(Some(f))))) => {
                return (u16::from(f.code), f.reason.as_str().to_string());
            }
            Ok(Some(Ok(Message::Close(None)))) | Ok(None) => return (1005, String::new()),
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(e))) => panic!("the console failed instead of closing: {e}"),
            Err(_) => panic!("the console did not close within {limit:?}"),
        }
    }
}

/// The owner logs in at the simulated VM's serial port through the websocket and runs
/// `echo`; another tenant gets 404, a second session 409, a cookie from another site 403;
/// what was typed shows in the text console; the session ends when the VM is destroyed;
/// every opening, refusal and closing is in the audit log.
async fn owners_use_their_vms_interactive_console(backend: Backend) {
    let mut s = TestServer::start(backend, fast_config()).await;
    let _node = s.add_node(2).await;
    s.h100_catalog(1).await;
    let (_, alice_token) = s.tenant("alice").await;
    let (_, bob_token) = s.tenant("bob").await;
    let alice = s.with(&alice_token);
    let vm: Vm = alice
        .post(
            "/v1/vms",
            &json!({"alias": "web-1", "package": "gpu-1x", "image": "test-image"}),
        )
        .await
        .ok(202);
    let job = s.wait_job(vm.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let limit = Duration::from_secs(20);

    let t0 = std::time::Instant::now();
    let mut ws = open_console(&s.base, vm.uuid, &bearer(&alice_token))
        .await
        .expect("the owner opens the console");
    read_until(&mut ws, "web-1 login: ", limit).await;
    eprintln!("console open to its login prompt: {:?}", t0.elapsed());
    type_in(&mut ws, "debian\r").await;
    read_until(&mut ws, "Password: ", limit).await;
    type_in(&mut ws, "anything\r").await;
    read_until(&mut ws, "debian@web-1:~$ ", limit).await;
    // A keystroke's way there and back (tenant → server → node → port and back).
    let mut rtts = Vec::new();
    for c in ["e", "c", "h", "o", " ", "4", "2"] {
        let t = std::time::Instant::now();
        type_in(&mut ws, c).await;
        read_until(&mut ws, c, limit).await;
        rtts.push(t.elapsed());
    }
    rtts.sort();
    eprintln!(
        "keystroke round trip: median {:?}, max {:?}",
        rtts[rtts.len() / 2],
        rtts[rtts.len() - 1]
    );
    type_in(&mut ws, "\r").await;
    read_until(&mut ws, "\r\n42\r\n", limit).await;

    // One session at a time; another tenant does not learn the VM exists.
    assert_eq!(
        open_console(&s.base, vm.uuid, &bearer(&alice_token))
            .await
            .err(),
        Some(409)
    );
    assert_eq!(
        open_console(&s.base, vm.uuid, &bearer(&bob_token))
            .await
            .err(),
        Some(404)
    );
    // The portal's cookie counts only from the portal's own pages.
    let cookie = |origin: &str| {
        vec![
            (
                "cookie",
                format!("{}={alice_token}", passage_app::backend::SESSION_COOKIE),
            ),
            ("origin", origin.to_string()),
        ]
    };
    assert_eq!(
        open_console(&s.base, vm.uuid, &cookie("http://evil.example"))
            .await
            .err(),
        Some(403)
    );
    assert_eq!(open_console(&s.base, vm.uuid, &[]).await.err(), Some(401));
    // The text console has what was typed, as a guest's log would.
    let path = format!("/v1/vms/{}/console", vm.uuid);
    let c: VmConsole = alice.get(&path).await.ok(200);
    assert!(c.output.contains("echo 42\r\n42\r\n"), "{:?}", c.output);
    assert!(!c.output.contains("anything"), "the password is not echoed");

    // Closed by the tenant: the VM's console is free again, here from the portal's page.
    ws.close(None).await.unwrap();
    let mut ws = wait_for(limit, || async {
        open_console(&s.base, vm.uuid, &cookie(&s.base)).await.ok()
    })
    .await
    .expect("the console opens again once closed, with the portal's cookie");
    read_until(&mut ws, "login: ", limit).await;

    // The VM goes: so does its console, saying why.
    let d: Vm = alice.delete(&format!("/v1/vms/{}", vm.uuid)).await.ok(202);
    let (code, why) = closed(&mut ws, limit).await;
    assert_eq!(code, 1000, "{why}");
    assert!(why.contains("serial port closed"), "{why}");
    s.wait_job(d.job_uuid.unwrap()).await;
    assert_eq!(
        open_console(&s.base, vm.uuid, &bearer(&alice_token))
            .await
            .err(),
        Some(409),
        "a destroyed VM has no console"
    );

    // Audited: who opened, who was refused, and each closing.
    let log: Vec<passage_model::api::AuditEntry> = s.get("/v1/audit?limit=1000").await.ok(200);
    let ours: Vec<(String, u16, Option<String>)> = log
        .iter()
        .filter(|e| e.path == path)
        .map(|e| (e.method.clone(), e.status, e.actor_login.clone()))
        .collect();
    let has = |method: &str, status: u16, who: &str| {
        ours.iter()
            .any(|(m, st, a)| m == method && *st == status && a.as_deref() == Some(who))
    };
    assert!(has("GET", 101, "alice"), "{ours:?}");
    assert!(has("GET", 409, "alice"), "{ours:?}");
    assert!(has("GET", 404, "bob"), "{ours:?}");
    assert!(has("CLOSE", 1000, "alice"), "{ours:?}");
    assert_eq!(
        ours.iter().filter(|(m, _, _)| m == "CLOSE").count(),
        2,
        "{ours:?}"
    );
}
both!(
    owners_use_their_vms_interactive_console,
    owners_use_their_vms_interactive_console
);
