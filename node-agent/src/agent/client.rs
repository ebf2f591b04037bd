//! The HTTP side of the agent protocol. Every body is parsed with serde; every failure is
//! an error value saying whether retrying can help.

use passage_model::TaskId;
use passage_model::images::Sha256;
use passage_model::protocol::{
    Heartbeat, HeartbeatResponse, InventoryReport, RegisterRequest, RegisterResponse, TASKS_RUN,
    TaskEnvelope, TaskProgress, TaskResult, TaskResults, TaskResultsAnswer,
};
use reqwest::StatusCode;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Bodies beyond this are not agent protocol answers.
const MAX_BODY: usize = 16 * 1024 * 1024;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// A guest's metadata request waits on this one.
const GUEST_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{what}: cannot reach the server: {}", chain(source))]
    Transport {
        what: &'static str,
        source: reqwest::Error,
    },
    #[error("{what}: server answered {status}: {code} {message}")]
    Server {
        what: &'static str,
        status: u16,
        code: String,
        message: String,
    },
    #[error("{what}: unreadable answer: {detail}")]
    Decode { what: &'static str, detail: String },
    #[error("invalid server URL {0:?}")]
    Url(String),
    #[error("CA certificate {path}: {detail}")]
    CaCert { path: String, detail: String },
    #[error("TLS settings: {0}")]
    Tls(String),
    #[error("{what}: websocket: {detail}")]
    Socket { what: &'static str, detail: String },
}

/// A CA bundle bigger than this is not a CA bundle.
const MAX_CA_LEN: u64 = 1024 * 1024;

/// The certificates of a PEM file the agent should trust besides the public roots (a
/// datacenter's own CA): the file's bytes, read whole up to [`MAX_CA_LEN`];
/// [`tls_config`] reads the certificates in them.
fn ca_pem(path: &std::path::Path) -> Result<Vec<u8>, ClientError> {
    let bad = |detail: String| ClientError::CaCert {
        path: path.display().to_string(),
        detail,
    };
    let len = std::fs::metadata(path)
        .map_err(|e| bad(e.to_string()))?
        .len();
    if len > MAX_CA_LEN {
        return Err(bad(format!("{len} bytes: more than {MAX_CA_LEN}")));
    }
    std::fs::read(path).map_err(|e| bad(e.to_string()))
}

/// The TLS settings of every client in this process that trusts the same CA bundle (or
/// none besides the public roots), made once and shared: a clone shares its certificate
/// verifier and its session cache. Each client made its own, the public roots and a
/// session cache of 256 entries, and a server with 1,250 simulated nodes in its process
/// held 35 MB of them (a heap profile of an idle fleet).
fn tls_config(
    ca: Option<(&std::path::Path, Vec<u8>)>,
) -> Result<rustls::ClientConfig, ClientError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    type Made = Vec<(Option<Vec<u8>>, rustls::ClientConfig)>;
    static MADE: std::sync::Mutex<Made> = std::sync::Mutex::new(Vec::new());
    let (path, pem) = match ca {
        Some((path, pem)) => (Some(path), Some(pem)),
        None => (None, None),
    };
    let mut made = MADE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, c)) = made.iter().find(|(k, _)| *k == pem) {
        return Ok(c.clone());
    }
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let (Some(path), Some(pem)) = (path, &pem) {
        let bad = |detail: String| ClientError::CaCert {
            path: path.display().to_string(),
            detail,
        };
        let mut found = 0;
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| bad(format!("not a PEM certificate bundle: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| bad(format!("not a CA certificate: {e}")))?;
            found += 1;
        }
        if found == 0 {
            return Err(bad("holds no certificate".into()));
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ClientError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    // Kept to a handful of processes' worth: a process makes clients for one server.
    if made.len() >= 8 {
        made.remove(0);
    }
    made.push((pem, config.clone()));
    Ok(config)
}

/// reqwest's own message hides the cause ("connection refused") in its source chain.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

impl ClientError {
    /// Worth retrying: the network, an overloaded or restarting server.
    pub fn is_transient(&self) -> bool {
        match self {
            ClientError::Transport { .. } => true,
            ClientError::Server { status, .. } => {
                *status >= 500 || *status == 429 || *status == 408
            }
            ClientError::Decode { .. }
            | ClientError::Url(_)
            | ClientError::CaCert { .. }
            | ClientError::Tls(_)
            | ClientError::Socket { .. } => false,
        }
    }

    /// The server does not know the call: an older server, for a call added since.
    pub fn is_unknown_call(&self) -> bool {
        self.status() == Some(404)
    }

    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Server { status, .. } => Some(*status),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct AgentClient {
    /// For the node's chain of long polls and the results whose answers are its next
    /// poll: one connection, kept.
    http: reqwest::Client,
    /// For everything else (heartbeats, inventory reports, progress, downloads): a
    /// connection each, closed after its answer. See [`AgentClient::with_ca`].
    brief: reqwest::Client,
    base: String,
    credential: Option<String>,
    /// The TLS settings both clients use, for the console's websockets too.
    tls: std::sync::Arc<rustls::ClientConfig>,
}

/// A websocket the agent dialled to the server (a console session's).
pub type ServerSocket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// How long a console's websocket may take to open.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest frame the agent takes from the server on a console: keystrokes and pastes.
pub const MAX_SOCKET_MESSAGE: usize = 64 * 1024;

impl AgentClient {
    pub fn new(server_url: &str) -> Result<Self, ClientError> {
        Self::with_ca(server_url, None)
    }

    /// A client that also trusts the certificates in `ca_cert` (PEM) for an `https://`
    /// server.
    pub fn with_ca(
        server_url: &str,
        ca_cert: Option<&std::path::Path>,
    ) -> Result<Self, ClientError> {
        let base = server_url.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) || base.len() < 8 {
            return Err(ClientError::Url(server_url.to_string()));
        }
        let ca = match ca_cert {
            Some(path) => Some((path, ca_pem(path)?)),
            None => None,
        };
        let tls = tls_config(ca)?;
        let client = |idle: usize| {
            reqwest::Client::builder()
                .pool_max_idle_per_host(idle)
                .pool_idle_timeout(Duration::from_secs(30))
                .connect_timeout(Duration::from_secs(10))
                .user_agent(concat!("passage-node-agent/", env!("CARGO_PKG_VERSION")))
                .use_preconfigured_tls(tls.clone())
                .build()
                .map_err(|_| ClientError::Url(server_url.to_string()))
        };
        // An agent's long polls follow one another on one connection, kept. The rest is
        // a heartbeat every 10 s and now and then an inventory report or a task's
        // progress: on a connection kept for them too, each node held two for good, and
        // a connection's buffers and state on both ends were about 40 KB (a heap profile
        // of an idle fleet of 1,250 simulated nodes in one process, where both ends are
        // the server's). A connection made for each of those costs less than that one
        // kept; with TLS the shared session cache makes its handshake a resumption.
        Ok(AgentClient {
            http: client(1)?,
            brief: client(0)?,
            base,
            credential: None,
            tls: std::sync::Arc::new(tls),
        })
    }

    pub fn with_credential(mut self, credential: String) -> Self {
        self.credential = Some(credential);
        self
    }

    fn url(&self, path: &str) -> String {
        format!("{}/agent/v1/{path}", self.base)
    }

    async fn send<T: DeserializeOwned>(
        &self,
        what: &'static str,
        req: reqwest::RequestBuilder,
        timeout: Duration,
    ) -> Result<T, ClientError> {
        let req = match &self.credential {
            Some(c) => req.bearer_auth(c),
            None => req,
        };
        let resp = req
            .timeout(timeout)
            .send()
            .await
            .map_err(|source| ClientError::Transport { what, source })?;
        let status = resp.status();
        let body = read_body(what, resp).await?;
        if !status.is_success() {
            return Err(server_error(what, status, &body));
        }
        // An empty success body stands for "nothing to say" (204 and friends).
        let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
            b"null"
        } else {
            &body
        };
        serde_json::from_slice(body).map_err(|e| ClientError::Decode {
            what,
            detail: e.to_string(),
        })
    }

    async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        what: &'static str,
        method: reqwest::Method,
        path: &str,
        body: &B,
    ) -> Result<T, ClientError> {
        let req = self.brief.request(method, self.url(path)).json(body);
        self.send(what, req, REQUEST_TIMEOUT).await
    }

    /// What VM `vm`'s guest is told now (the metadata service's current tags, metadata and
    /// keys); `None` when the server does not know the VM on this node. Brief: a guest
    /// waits on it, and the service falls back on the VM's spec.
    pub async fn guest_metadata(
        &self,
        vm: passage_model::VmId,
    ) -> Result<Option<passage_model::protocol::GuestMetadata>, ClientError> {
        let req = self.brief.get(self.url(&format!("vms/{vm}/guest")));
        match self.send("guest metadata", req, GUEST_TIMEOUT).await {
            Ok(m) => Ok(m),
            Err(e) if e.status() == Some(404) => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub async fn register(&self, req: &RegisterRequest) -> Result<RegisterResponse, ClientError> {
        self.call("register", reqwest::Method::POST, "register", req)
            .await
    }

    /// Trades the node's credential for a new one; the old one stops working.
    pub async fn rotate_credential(&self) -> Result<RegisterResponse, ClientError> {
        self.call(
            "credential rotation",
            reqwest::Method::POST,
            "credential",
            &serde_json::json!({}),
        )
        .await
    }

    pub async fn put_inventory(&self, report: &InventoryReport) -> Result<(), ClientError> {
        let _: serde_json::Value = self
            .call("inventory", reqwest::Method::PUT, "inventory", report)
            .await?;
        Ok(())
    }

    /// The answer's body is optional to us: an older server may send none.
    pub async fn heartbeat(
        &self,
        hb: &Heartbeat,
    ) -> Result<Option<HeartbeatResponse>, ClientError> {
        self.call("heartbeat", reqwest::Method::POST, "heartbeat", hb)
            .await
    }

    /// Long-polls for work; the server answers at the latest after `wait`.
    pub async fn poll_tasks(&self, wait: Duration) -> Result<Vec<TaskEnvelope>, ClientError> {
        let secs = wait.as_secs();
        let req = self
            .http
            .get(self.url(&format!("tasks?wait={secs}&runs={TASKS_RUN}")));
        let tasks: Option<Vec<TaskEnvelope>> =
            self.send("tasks", req, wait + REQUEST_TIMEOUT).await?;
        Ok(tasks.unwrap_or_default())
    }

    pub async fn post_result(&self, id: TaskId, result: &TaskResult) -> Result<(), ClientError> {
        let req = self
            .http
            .post(self.url(&format!("tasks/{id}/result")))
            .json(result);
        let _: serde_json::Value = self.send("task result", req, REQUEST_TIMEOUT).await?;
        Ok(())
    }
    /// Posts a result and long-polls in the same request: the tasks queued for this node,
    /// as [`Self::poll_tasks`] answers. `None` from a server that only records the result
    /// (204): the node polls on its own then.
    pub async fn post_result_then_poll(
        &self,
        id: TaskId,
        result: &TaskResult,
        wait: Duration,
    ) -> Result<Option<Vec<TaskEnvelope>>, ClientError> {
        let secs = wait.as_secs();
        let req = self
            .http
            .post(self.url(&format!("tasks/{id}/result?wait={secs}&runs={TASKS_RUN}")))
            .json(result);
        self.send("task result", req, wait + REQUEST_TIMEOUT).await
    }

    /// Posts several results at once; with `wait`, the answer is also the next long poll.
    /// Each result is recorded or refused on its own: the refused ones are in the answer.
    /// A server without this call answers 404 (see [`ClientError::is_unknown_call`]).
    pub async fn post_results(
        &self,
        results: &TaskResults,
        wait: Option<Duration>,
    ) -> Result<TaskResultsAnswer, ClientError> {
        let (path, timeout) = match wait {
            Some(w) => (
                format!("tasks/results?wait={}&runs={TASKS_RUN}", w.as_secs()),
                w + REQUEST_TIMEOUT,
            ),
            None => ("tasks/results".to_string(), REQUEST_TIMEOUT),
        };
        let req = self.http.post(self.url(&path)).json(results);
        self.send("task results", req, timeout).await
    }

    /// How far a long task has come; the server shows it on the job step.
    pub async fn post_progress(
        &self,
        id: TaskId,
        progress: &TaskProgress,
    ) -> Result<(), ClientError> {
        let _: serde_json::Value = self
            .call(
                "task progress",
                reqwest::Method::POST,
                &format!("tasks/{id}/progress"),
                progress,
            )
            .await?;
        Ok(())
    }

    /// Starts the download of an image file from byte `offset` (`Range: bytes=N-`). The
    /// answer is the open response, its status checked: 206 (from `offset`) or 200 (the
    /// whole file: a server that ignores ranges). No overall timeout: a large image takes
    /// as long as it takes; a stalled connection is caught by the reader's idle timeout.
    pub async fn get_image(
        &self,
        sha256: &Sha256,
        offset: u64,
    ) -> Result<reqwest::Response, ClientError> {
        let what = "image download";
        let mut req = self.brief.get(self.url(&format!("images/{sha256}")));
        if offset > 0 {
            req = req.header(reqwest::header::RANGE, format!("bytes={offset}-"));
        }
        if let Some(c) = &self.credential {
            req = req.bearer_auth(c);
        }
        let resp = req
            .send()
            .await
            .map_err(|source| ClientError::Transport { what, source })?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body = read_body(what, resp).await.unwrap_or_default();
        Err(server_error(what, status, &body))
    }
}

impl AgentClient {
    /// Opens the websocket of console session `session` (`GET
    /// /agent/v1/console/{session}`, upgraded), with the node's credential and the
    /// client's TLS settings.
    pub async fn console_socket(&self, session: &str) -> Result<ServerSocket, ClientError> {
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        let what = "console";
        let bad = |detail: String| ClientError::Socket { what, detail };
        if !passage_model::protocol::is_console_session(session) {
            return Err(bad("not a console session name".to_string()));
        }
        let url = match self.base.split_once("://") {
            Some(("https", rest)) => format!("wss://{rest}"),
            Some((_, rest)) => format!("ws://{rest}"),
            None => return Err(ClientError::Url(self.base.clone())),
        } + &format!("/agent/v1/console/{session}");
        let mut req = url
            .as_str()
            .into_client_request()
            .map_err(|e| bad(format!("{url}: {e}")))?;
        if let Some(c) = &self.credential {
            let v = format!("Bearer {c}")
                .parse()
                .map_err(|_| bad("the credential is not a header value".to_string()))?;
            req.headers_mut().insert(reqwest::header::AUTHORIZATION, v);
        }
        let config = tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
            .max_message_size(Some(MAX_SOCKET_MESSAGE))
            .max_frame_size(Some(MAX_SOCKET_MESSAGE));
        let connector = tokio_tungstenite::Connector::Rustls(self.tls.clone());
        // Keystrokes go one by one: Nagle's delay would be felt.
        let open = tokio_tungstenite::connect_async_tls_with_config(
            req,
            Some(config),
            true,
            Some(connector),
        );
        match tokio::time::timeout(SOCKET_TIMEOUT, open).await {
            Ok(Ok((socket, _))) => Ok(socket),
            Ok(Err(e)) => Err(bad(e.to_string())),
            Err(_) => Err(bad(format!(
                "not open within {} s",
                SOCKET_TIMEOUT.as_secs()
            ))),
        }
    }
}

async fn read_body(
    what: &'static str,
    mut resp: reqwest::Response,
) -> Result<Vec<u8>, ClientError> {
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|source| ClientError::Transport { what, source })?
    {
        if body.len() + chunk.len() > MAX_BODY {
            return Err(ClientError::Decode {
                what,
                detail: format!("body larger than {MAX_BODY} bytes"),
            });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// `{"code","message"}`, read leniently: a code this agent does not know is still shown.
#[derive(Deserialize)]
struct ErrorBody {
    code: String,
    message: String,
}

fn server_error(what: &'static str, status: StatusCode, body: &[u8]) -> ClientError {
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) => ClientError::Server {
            what,
            status: status.as_u16(),
            code: e.code,
            message: e.message,
        },
        Err(_) => ClientError::Server {
            what,
            status: status.as_u16(),
            code: status
                .canonical_reason()
                .unwrap_or("error")
                .replace(' ', ""),
            // Keep a little of a non-JSON body (a proxy's page) for the log.
            message: String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_classify() {
        let e = server_error(
            "x",
            StatusCode::UNAUTHORIZED,
            br#"{"code":"Unauthorized","message":"bad token"}"#,
        );
        assert_eq!(e.status(), Some(401));
        assert!(!e.is_transient());
        assert!(e.to_string().contains("bad token"));
        let e = server_error("x", StatusCode::BAD_GATEWAY, b"<html>");
        assert!(e.is_transient());
        assert!(AgentClient::new("ftp://x").is_err());
        assert!(AgentClient::new("http://cp:8080/").is_ok());
    }

    #[test]
    fn clients_trusting_the_same_certificates_share_their_tls_settings() {
        let dir = tempfile::tempdir().unwrap();
        let ca = rcgen::generate_simple_self_signed(vec!["cp.example".to_string()]).unwrap();
        let pem = dir.path().join("ca.pem");
        std::fs::write(&pem, ca.cert.pem()).unwrap();
        let made = |ca: Option<&std::path::Path>| {
            let ca = ca.map(|p| (p, ca_pem(p).unwrap()));
            tls_config(ca).unwrap()
        };
        let same = |a: &rustls::ClientConfig, b: &rustls::ClientConfig| {
            std::sync::Arc::ptr_eq(a.crypto_provider(), b.crypto_provider())
        };
        let (public, public_again) = (made(None), made(None));
        assert!(same(&public, &public_again));
        let (own, own_again) = (made(Some(&pem)), made(Some(&pem)));
        assert!(same(&own, &own_again));
        assert!(!same(&public, &own));
        assert_eq!(own.alpn_protocols, vec![b"http/1.1".to_vec()]);
        // A bundle changed on disk is read again: its certificates, not the old ones.
        let other = rcgen::generate_simple_self_signed(vec!["cp.example".to_string()]).unwrap();
        std::fs::write(&pem, other.cert.pem()).unwrap();
        assert!(!same(&own, &made(Some(&pem))));
        assert!(AgentClient::with_ca("https://cp.example:8443", Some(&pem)).is_ok());
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let not = |name: &str, body: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, body).unwrap();
            AgentClient::with_ca("https://cp.example", Some(&p))
                .unwrap_err()
                .to_string()
        };
        let e = not("empty.pem", "no certificate in here\n");
        assert!(
            e.contains("empty.pem") && e.contains("holds no certificate"),
            "{e}"
        );
        let e = not(
            "broken.pem",
            "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n",
        );
        assert!(
            e.contains("broken.pem") && e.contains("not a CA certificate"),
            "{e}"
        );
        let missing = dir.path().join("missing.pem");
        let e = AgentClient::with_ca("https://cp.example", Some(&missing)).unwrap_err();
        assert!(matches!(e, ClientError::CaCert { .. }), "{e}");
    }
}
