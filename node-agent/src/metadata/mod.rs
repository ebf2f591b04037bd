//! The metadata service at 169.254.169.254, as EC2 and OpenStack guests expect it (the
//! answers: [`answers`]). Each VM is told only about itself, and it is known by the tap its
//! request came in on, never by anything the guest sends:
//!
//! - for each tap of ours, a listener on 169.254.169.254:<port of its own>, bound to the
//!   tap's bridge (so answers leave by it), serving that tap's VM;
//! - Passage's nftables table ([`crate::net::nft`]) gives each tap's TCP to port 80 the
//!   tap's port, and the answers port 80 back, and drops what a guest sends to the address
//!   otherwise (another VM's port included);
//! - the bridge holds the address, and a routing rule sends the answers straight onto the
//!   bridge ([`crate::net::prepare_metadata_bridge`]).
//!
//! One loop keeps all this in step with the taps there are, once a second: a tap made
//! gets its listener and rules, a tap gone loses them, and an agent restarted makes them
//! all again (the listeners died with the old agent; the table is written whole).
//!
//! Tags, metadata and keys are the server's current ones (asked at most every
//! [`FRESH_FOR`] per VM), or, while the server cannot answer, the last ones it gave, else
//! the VM's spec.

pub mod answers;

use crate::agent::AgentClient;
use crate::hypervisor::Hypervisor;
use crate::net::{self, nft};
use answers::{Answer, Guest};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use passage_model::VmId;
use passage_model::protocol::{GuestMetadata, VmSpec};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddrV4;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// How long the server's answer is used before it is asked again.
pub const FRESH_FOR: Duration = Duration::from_secs(2);
/// How often taps are looked for.
pub const EVERY: Duration = Duration::from_secs(1);
/// A guest's request carries no body worth reading.
const MAX_BODY: usize = 1024;

/// What the listeners share: the VMs' specs and the server's answers.
struct Shared {
    client: Option<AgentClient>,
    specs: Mutex<HashMap<VmId, VmSpec>>,
    cache: Mutex<HashMap<VmId, (Instant, GuestMetadata)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// What VM `vm`'s guest is told now; `None` once the VM is gone from this node.
    async fn guest(&self, vm: VmId) -> Option<Guest> {
        let spec = lock(&self.specs).get(&vm).cloned()?;
        let cached = lock(&self.cache).get(&vm).cloned();
        if let Some((at, m)) = &cached
            && at.elapsed() < FRESH_FOR
        {
            return Some(Guest::current(&spec, m));
        }
        let Some(client) = &self.client else {
            return Some(Guest::from_spec(&spec));
        };
        match client.guest_metadata(vm).await {
            Ok(Some(m)) if m.uuid == vm => {
                lock(&self.cache).insert(vm, (Instant::now(), m.clone()));
                Some(Guest::current(&spec, &m))
            }
            Ok(_) => Some(Guest::from_spec(&spec)),
            Err(e) => {
                debug!(%vm, error = %e, "the server did not answer for a guest's metadata");
                Some(match cached {
                    Some((_, m)) => Guest::current(&spec, &m),
                    None => Guest::from_spec(&spec),
                })
            }
        }
    }
}

/// One tap's listener.
struct Listener {
    vm: VmId,
    bridge: String,
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub struct MetadataService {
    shared: Arc<Shared>,
    /// Where taps and bridges are (the host's own sysfs).
    net_root: PathBuf,
    listeners: BTreeMap<String, Listener>,
    /// The rules last written; `None` before the first write (which clears a previous
    /// agent's).
    installed: Option<Vec<nft::TapRule>>,
    /// Something this node lacks (nft): said once, then the service is off.
    off: bool,
}

impl MetadataService {
    /// `client`: the agent's client, to ask the server for current tags and metadata
    /// (`None`: the specs only).
    pub fn new(client: Option<AgentClient>, net_root: PathBuf) -> Self {
        MetadataService {
            shared: Arc::new(Shared {
                client,
                specs: Mutex::new(HashMap::new()),
                cache: Mutex::new(HashMap::new()),
            }),
            net_root,
            listeners: BTreeMap::new(),
            installed: None,
            off: false,
        }
    }

    /// Each tap's port, as the rules send its guest's requests there.
    pub fn ports(&self) -> BTreeMap<String, u16> {
        self.listeners
            .iter()
            .map(|(t, l)| (t.clone(), l.port))
            .collect()
    }

    /// Keeps the service in step with `hv`'s taps until the agent ends.
    pub async fn run(mut self, hv: Arc<dyn Hypervisor>) {
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.off {
                return;
            }
            let hv = hv.clone();
            let root = self.net_root.clone();
            let found = tokio::task::spawn_blocking(move || {
                let specs = hv.tap_specs();
                let taps: Vec<(String, Option<String>)> = net::our_taps(&root)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|t| {
                        let m = net::master_of(&root, &t);
                        (t, m)
                    })
                    .collect();
                (specs, taps)
            })
            .await;
            match found {
                Ok((specs, taps)) => self.reconcile(specs, &taps).await,
                Err(e) => warn!(error = %e, "reading the taps failed"),
            }
        }
    }

    /// One pass: listeners for the taps there are, none for those gone, the table
    /// written when it changes.
    pub async fn reconcile(&mut self, specs: Vec<VmSpec>, taps: &[(String, Option<String>)]) {
        let present: HashMap<&str, Option<&str>> = taps
            .iter()
            .map(|(t, m)| (t.as_str(), m.as_deref()))
            .collect();
        // tap → (VM, bridge): a tap of a known VM that is a port of its NIC's bridge.
        let mut want: BTreeMap<String, (VmId, String)> = BTreeMap::new();
        for spec in &specs {
            for (i, nic) in spec.nics.iter().enumerate() {
                let tap = net::tap_name(spec.uuid, i);
                if present.get(tap.as_str()) == Some(&Some(nic.bridge.as_str())) {
                    want.insert(tap, (spec.uuid, nic.bridge.clone()));
                }
            }
        }
        *lock(&self.shared.specs) = specs.into_iter().map(|s| (s.uuid, s)).collect();
        {
            let specs = lock(&self.shared.specs);
            lock(&self.shared.cache).retain(|vm, _| specs.contains_key(vm));
        }
        self.listeners.retain(|tap, l| {
            want.get(tap)
                .is_some_and(|(vm, br)| *vm == l.vm && *br == l.bridge)
        });
        if self.installed.is_none() && !self.first_pass().await {
            return;
        }
        for (tap, (vm, bridge)) in want {
            if self.listeners.contains_key(&tap) {
                continue;
            }
            match self.listen(vm, &bridge).await {
                Ok(l) => {
                    info!(%vm, tap, port = l.port, "metadata service listening for the VM");
                    self.listeners.insert(tap, l);
                }
                Err(e) => warn!(%vm, tap, error = %e, "no metadata service for this tap"),
            }
        }
        self.write_rules().await;
    }

    /// What the first pass does before any listener: the routing rule.
    async fn first_pass(&mut self) -> bool {
        match tokio::task::spawn_blocking(net::ensure_metadata_rule).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                warn!(error = %e, "the metadata service's routing rule could not be made; retrying");
                false
            }
            Err(e) => {
                warn!(error = %e, "the metadata service's routing rule could not be made");
                false
            }
        }
    }

    /// Writes the table when the rules (ports, taps, bridges' MACs) differ from the last.
    async fn write_rules(&mut self) {
        let mut rules = Vec::with_capacity(self.listeners.len());
        let mut macs: HashMap<&str, String> = HashMap::new();
        for (tap, l) in &self.listeners {
            let mac = match macs.get(l.bridge.as_str()) {
                Some(m) => m.clone(),
                None => match net::link_mac(&self.net_root, &l.bridge) {
                    Ok(m) => {
                        macs.insert(&l.bridge, m.clone());
                        m
                    }
                    Err(e) => {
                        warn!(tap, error = %e, "the bridge's address is unreadable");
                        continue;
                    }
                },
            };
            rules.push(nft::TapRule {
                tap: tap.clone(),
                port: l.port,
                bridge_mac: mac,
            });
        }
        if self.installed.as_ref() == Some(&rules) {
            return;
        }
        let r = rules.clone();
        match tokio::task::spawn_blocking(move || nft::install(&r)).await {
            Ok(Ok(())) => {
                debug!(taps = rules.len(), "metadata rules written");
                self.installed = Some(rules);
            }
            Ok(Err(nft::NftError::NotInstalled)) => {
                warn!("{}", nft::NftError::NotInstalled);
                self.off = true;
                self.listeners.clear();
            }
            Ok(Err(e)) => warn!(error = %e, "writing the metadata rules failed; retrying"),
            Err(e) => warn!(error = %e, "writing the metadata rules failed; retrying"),
        }
    }

    /// A listener for `vm` on `bridge`, at a port the kernel chooses.
    async fn listen(&self, vm: VmId, bridge: &str) -> Result<Listener, String> {
        // Again for each tap (both commands change nothing when done): an address an
        // operator removed meanwhile comes back with the next VM.
        let (root, br) = (self.net_root.clone(), bridge.to_string());
        tokio::task::spawn_blocking(move || net::prepare_metadata_bridge(&root, &br))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let std = bind(bridge).map_err(|e| format!("listening on {bridge}: {e}"))?;
        let port = std.local_addr().map_err(|e| e.to_string())?.port();
        let listener = tokio::net::TcpListener::from_std(std).map_err(|e| e.to_string())?;
        let app = axum::Router::new()
            .fallback(serve)
            .layer(DefaultBodyLimit::max(MAX_BODY))
            .with_state(Served {
                vm,
                shared: self.shared.clone(),
            });
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                warn!(%vm, error = %e, "the metadata listener ended");
            }
        });
        Ok(Listener {
            vm,
            bridge: bridge.to_string(),
            port,
            task,
        })
    }
}

/// A listening socket on 169.254.169.254 at a port the kernel picks, bound to `bridge`:
/// it takes only what arrives on that bridge, and its answers leave by it.
fn bind(bridge: &str) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
    s.bind_device(Some(bridge.as_bytes()))?;
    s.bind(&SocketAddrV4::new(nft::METADATA_ADDR, 0).into())?;
    s.listen(64)?;
    s.set_nonblocking(true)?;
    Ok(s.into())
}

#[derive(Clone)]
struct Served {
    vm: VmId,
    shared: Arc<Shared>,
}

async fn serve(State(s): State<Served>, method: Method, uri: Uri) -> Response {
    if method != Method::GET && method != Method::HEAD {
        return (StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n").into_response();
    }
    let Some(guest) = s.shared.guest(s.vm).await else {
        return not_found();
    };
    match answers::answer(&guest, uri.path()) {
        Some(a) => answer_response(&a),
        None => not_found(),
    }
}

fn not_found() -> Response {
    (StatusCode::NOT_FOUND, "not found\n").into_response()
}

fn answer_response(a: &Answer) -> Response {
    (
        [(header::CONTENT_TYPE, a.content_type())],
        a.body().to_string(),
    )
        .into_response()
}
