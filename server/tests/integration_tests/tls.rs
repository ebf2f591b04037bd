//! https served by the real `server` binary (`--tls-cert`, `--tls-key`): clients that
//! trust the certificate get through, others and plain http do not; the real `node-agent`
//! registers and reports over https with `--ca-cert`; SIGHUP swaps in a new certificate;
//! a key that does not match its certificate stops the start with a clear error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, Proc, TestDb, agent_command, node_agent_bin, wait_for};
use passage_model::api::{JoinToken, LoginResponse, Server, ServerStatus};
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// A self-signed certificate for this host's loopback names; answers (cert, key) paths.
fn certificate(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string(), "127.0.0.1".into()])
        .unwrap();
    let cert = dir.join(format!("{name}.crt"));
    let key = dir.join(format!("{name}.key"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    (cert, key)
}

fn server_cmd(db: &TestDb, cert: &Path, key: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_server"));
    cmd.args(["--listen", "127.0.0.1:0", "--database", &db.url])
        .arg("--tls-cert")
        .arg(cert)
        .arg("--tls-key")
        .arg(key)
        .env("PASSAGE_ADMIN_PASSWORD", "tls-admin-password")
        .env("RUST_LOG", "warn");
    cmd
}

fn trusting(cert: &Path) -> reqwest::Client {
    let pem = std::fs::read(cert).unwrap();
    reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
        .build()
        .unwrap()
}

async fn ping(http: &reqwest::Client, base: &str) -> Result<u16, String> {
    http.get(format!("{base}/v1/ping"))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| format!("{e:?}"))
}

#[tokio::test]
async fn https_for_clients_and_agents_with_reload() {
    let db = TestDb::new(Backend::Sqlite).await;
    let dir = db.dir.path().to_path_buf();
    let (cert, key) = certificate(&dir, "first");
    let mut child = server_cmd(&db, &cert, &key)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let stdout = child.stdout.take().unwrap();
    let _server = Proc(child);
    let mut lines = BufReader::new(stdout).lines();
    let base = loop {
        let line = lines.next().expect("server exited").unwrap();
        if let Some(url) = line.strip_prefix("Passage listening on ") {
            break url.trim().to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    assert!(base.starts_with("https://127.0.0.1:"), "{base}");

    let http = trusting(&cert);
    assert_eq!(ping(&http, &base).await, Ok(200));
    let stranger = reqwest::Client::new();
    let e = ping(&stranger, &base).await.expect_err("an unknown issuer");
    assert!(e.contains("Certificate"), "{e}");
    let plain = base.replacen("https://", "http://", 1);
    assert!(
        ping(&stranger, &plain).await.is_err(),
        "no plain http on the https port"
    );

    // The real agent, trusting the certificate, registers and reports over https.
    let r = http
        .post(format!("{base}/v1/auth/login"))
        .json(&json!({"login":"admin","password":"tls-admin-password"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let op = r.json::<LoginResponse>().await.unwrap().token;
    let jt: JoinToken = http
        .post(format!("{base}/v1/servers/join-tokens"))
        .bearer_auth(&op)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let agent_bin = node_agent_bin();
    let sysfs = dir.join("sysfs");
    let out = Command::new(&agent_bin)
        .args(["fake-sysfs", "--out"])
        .arg(&sysfs)
        .args(["--gpus", "2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _agent = Proc(
        agent_command(&base, &jt.token, &sysfs, &dir.join("agent-state"))
            .arg("--ca-cert")
            .arg(&cert)
            .args(["--hostname", "cn-tls"])
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap(),
    );
    let reported = wait_for(Duration::from_secs(30), || async {
        let list: Vec<Server> = http
            .get(format!("{base}/v1/servers"))
            .bearer_auth(&op)
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        let s = list.into_iter().next()?;
        (s.status == ServerStatus::Running && s.sysinfo.as_ref()?.pci_devices.len() > 2)
            .then_some(s)
    })
    .await;
    assert!(
        reported.is_some(),
        "the agent registered and reported over https"
    );

    // A renewed certificate: written over the old files, taken up on SIGHUP.
    let (next_cert, next_key) = certificate(&dir, "second");
    let old_cert = dir.join("old.crt");
    std::fs::copy(&cert, &old_cert).unwrap();
    std::fs::copy(&next_cert, &cert).unwrap();
    std::fs::copy(&next_key, &key).unwrap();
    let renewed = trusting(&next_cert);
    let st = Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let took = wait_for(Duration::from_secs(10), || async {
        (ping(&renewed, &base).await == Ok(200)).then_some(())
    })
    .await;
    assert!(
        took.is_some(),
        "new connections get the renewed certificate"
    );
    assert!(
        ping(&trusting(&old_cert), &base).await.is_err(),
        "the old certificate is gone"
    );

    // A broken pair on the next SIGHUP: refused, the renewed one stays in use.
    std::fs::write(&key, "not a key").unwrap();
    Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(ping(&trusting(&next_cert), &base).await, Ok(200));
}

#[tokio::test]
async fn a_key_that_does_not_match_stops_the_start() {
    let db = TestDb::new(Backend::Sqlite).await;
    let dir = db.dir.path();
    let (cert, _) = certificate(dir, "one");
    let (_, other_key) = certificate(dir, "two");
    let out = server_cmd(&db, &cert, &other_key).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("do not make a usable pair"), "{err}");
    let out = server_cmd(&db, &dir.join("missing.crt"), &other_key)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("missing.crt"),
        "{err}"
    );
}
