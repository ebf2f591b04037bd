//! Interactive serial consoles: a tenant's websocket (`/v1/vms/{uuid}/console`, upgraded)
//! joined to one the VM's node dials back. The server cannot dial a node: it queues an
//! `attach_console` task naming an unguessable session, the node's agent opens the VM's
//! serial port and dials `/agent/v1/console/{session}` with its credential, and the two
//! websockets are joined here, bytes copied both ways until either closes.
//!
//! One session per VM at a time (a second is refused with 409), held by this process:
//! with several replicas, the node must dial the replica that holds the tenant's socket
//! (the session is unknown elsewhere and the console fails to open, saying so).

use super::Ctx;
use super::auth::Caller;
use crate::error::{ApiError, ApiResult};
use axum::extract::ws::{CloseFrame, Message, WebSocket};
use passage_model::api::VmState;
use passage_model::protocol::Task;
use passage_model::{AccountId, ServerId, VmId};
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::oneshot;

/// How long the node has to open the VM's serial port and dial back.
pub const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);
/// A session where nothing went either way for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// The largest message taken from either side: keystrokes and pastes from the tenant,
/// at most 16 KiB of output per frame from the node.
pub const MAX_MESSAGE: usize = 64 * 1024;

/// Close codes the tenant's websocket ends with (besides the websocket's own, as 1009 for
/// a message over [`MAX_MESSAGE`]).
pub mod close {
    /// The tenant closed, or the VM's serial port did (the VM stopped or was destroyed).
    pub const NORMAL: u16 = 1000;
    /// Nothing went either way for [`super::IDLE_TIMEOUT`].
    pub const IDLE: u16 = 1008;
    /// The node could not open the console, did not within [`super::ATTACH_TIMEOUT`], or
    /// its side ended without closing.
    pub const NODE: u16 = 1011;
}

/// The sessions of this process: the VMs with one open, and the sessions waiting for
/// their node to dial back.
#[derive(Default)]
pub struct Consoles {
    open: Mutex<HashSet<VmId>>,
    waiting: Mutex<HashMap<String, Waiting>>,
}

struct Waiting {
    server: ServerId,
    socket: oneshot::Sender<WebSocket>,
}

impl Consoles {
    fn open(&self) -> std::sync::MutexGuard<'_, HashSet<VmId>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, HashMap<String, Waiting>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The waiting end of `session` when `server` is the node it was given to; it is no
    /// longer waiting after this. Anything else is `None`, alike.
    pub fn take(&self, session: &str, server: ServerId) -> Option<oneshot::Sender<WebSocket>> {
        let mut waiting = self.waiting();
        if waiting.get(session).is_none_or(|w| w.server != server) {
            return None;
        }
        waiting.remove(session).map(|w| w.socket)
    }
}

/// A VM's console held by one session: released when dropped.
struct Claim {
    ctx: Ctx,
    vm: VmId,
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.ctx.consoles.open().remove(&self.vm);
    }
}

/// A session admitted: its VM claimed, waiting for the tenant's websocket.
pub struct Session {
    claim: Claim,
    server: ServerId,
    actor: (AccountId, String),
    path: String,
}

/// The checks before the upgrade, answered as HTTP errors: the VM is the caller's (or an
/// operator's: 404 otherwise, and 403 for a read-only operator), running, on a node whose
/// agent attaches consoles, and has no session open (409).
pub async fn admit(ctx: &Ctx, caller: &Caller, uuid: VmId) -> ApiResult<Session> {
    let vm = super::vms::get(ctx, caller, uuid).await?;
    caller.may_change(vm.owner_uuid)?;
    let server = match (vm.state, vm.server_uuid) {
        (VmState::Running, Some(s)) => s,
        (state, _) => {
            return Err(ApiError::invalid_state(format!(
                "the VM is {}: its console opens while it runs",
                serde_json::to_value(state)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_else(|| "not running".to_string())
            )));
        }
    };
    if !super::agents::runs_soon(ctx, server, Task::ATTACH_CONSOLE).await {
        return Err(ApiError::invalid_state(
            "the VM's node runs an agent too old for an interactive console; the text \
             console (this URL without a websocket upgrade) still works",
        ));
    }
    if !ctx.consoles.open().insert(uuid) {
        return Err(ApiError::conflict(
            "another console session is open on this VM: one at a time",
        ));
    }
    Ok(Session {
        claim: Claim {
            ctx: ctx.clone(),
            vm: uuid,
        },
        server,
        actor: (caller.account.uuid, caller.account.login.clone()),
        path: format!("/v1/vms/{uuid}/console"),
    })
}

/// Records a console's opening (101), refusal (its status) or closing (method `CLOSE`,
/// the close code as status) in the audit log.
pub async fn audit(
    ctx: &Ctx,
    actor: Option<(AccountId, String)>,
    method: &str,
    path: &str,
    status: u16,
) {
    if let Err(e) = super::audit::record(
        ctx,
        actor,
        method.to_string(),
        path.to_string(),
        status,
        None,
    )
    .await
    {
        tracing::warn!(error = %e, %path, "could not write the audit log");
    }
}

fn close_frame(code: u16, reason: &str) -> Message {
    // A close frame's reason is at most 123 bytes.
    let mut reason = reason.to_string();
    if reason.len() > 123 {
        let mut cut = 120;
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        reason.truncate(cut);
        reason.push('…');
    }
    Message::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    }))
}

/// Serves an admitted session on the tenant's websocket: has the node attach, joins the
/// two and copies until either closes; the closing is audited.
pub async fn serve(ctx: Ctx, session: Session, mut tenant: WebSocket) {
    let (code, why) = match attach(&ctx, &session).await {
        Ok(node) => join(&mut tenant, node).await,
        Err(why) => (close::NODE, why),
    };
    let _ = tenant.send(close_frame(code, &why)).await;
    tracing::info!(vm = %session.claim.vm, code, %why, "console closed");
    audit(
        &ctx,
        Some(session.actor.clone()),
        "CLOSE",
        &session.path,
        code,
    )
    .await;
    drop(session);
}

/// Has the VM's node attach its serial port: its websocket, or why not.
async fn attach(ctx: &Ctx, session: &Session) -> Result<WebSocket, String> {
    let name = hex::encode(rand::random::<[u8; 32]>());
    let (tx, mut rx) = oneshot::channel();
    ctx.consoles.waiting().insert(
        name.clone(),
        Waiting {
            server: session.server,
            socket: tx,
        },
    );
    let task = Task::AttachConsole {
        vm_uuid: session.claim.vm,
        session: name.clone(),
    };
    let answered = crate::workflows::agent_task::run_raw(ctx, session.server, None, task);
    tokio::pin!(answered);
    let deadline = tokio::time::sleep(ATTACH_TIMEOUT);
    tokio::pin!(deadline);
    let mut answer_seen = false;
    let r = loop {
        tokio::select! {
            s = &mut rx => break s.map_err(|_| "the console's session was dropped".to_string()),
            r = &mut answered, if !answer_seen => match r {
                // Opened: its websocket is on its way (or here already).
                Ok(r) if r.ok => answer_seen = true,
                Ok(r) => break Err(format!(
                    "the node could not open the console: {}",
                    r.error.as_deref().unwrap_or("no reason given")
                )),
                Err(e) => break Err(format!("the node did not answer: {e}")),
            },
            () = &mut deadline => break Err(format!(
                "the VM's node did not open the console within {} s",
                ATTACH_TIMEOUT.as_secs()
            )),
        }
    };
    ctx.consoles.waiting().remove(&name);
    r
}

/// Copies between the tenant and the node until either closes or both are idle for
/// [`IDLE_TIMEOUT`]; answers the close code and reason for the tenant.
async fn join(tenant: &mut WebSocket, mut node: WebSocket) -> (u16, String) {
    let idle = tokio::time::sleep(IDLE_TIMEOUT);
    tokio::pin!(idle);
    loop {
        tokio::select! {
            m = tenant.recv() => {
                let bytes = match m {
                    Some(Ok(Message::Binary(b))) => b,
                    Some(Ok(Message::Text(t))) => axum::body::Bytes::copy_from_slice(t.as_str().as_bytes()),
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => {
                        let _ = node.send(close_frame(close::NORMAL, "the tenant closed the console")).await;
                        return (close::NORMAL, "closed by the client".to_string());
                    }
                };
                if node.send(Message::Binary(bytes)).await.is_err() {
                    return (close::NODE, "the node's side of the console ended".to_string());
                }
            }
            m = node.recv() => {
                let bytes = match m {
                    Some(Ok(Message::Binary(b))) => b,
                    Some(Ok(Message::Text(t))) => axum::body::Bytes::copy_from_slice(t.as_str().as_bytes()),
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                    Some(Ok(Message::Close(frame))) => {
                        let why = frame
                            .map(|f| f.reason.as_str().to_string())
                            .filter(|r| !r.is_empty())
                            .unwrap_or_else(|| "the VM's console closed".to_string());
                        return (close::NORMAL, why);
                    }
                    None | Some(Err(_)) => {
                        return (close::NODE, "the node's side of the console ended".to_string());
                    }
                };
                if tenant.send(Message::Binary(bytes)).await.is_err() {
                    let _ = node.send(close_frame(close::NORMAL, "the tenant went away")).await;
                    return (close::NORMAL, "the client went away".to_string());
                }
            }
            () = &mut idle => {
                let why = format!("idle for {} minutes", IDLE_TIMEOUT.as_secs() / 60);
                let _ = node.send(close_frame(close::NORMAL, &why)).await;
                return (close::IDLE, why);
            }
        }
        idle.as_mut()
            .reset(tokio::time::Instant::now() + IDLE_TIMEOUT);
    }
}
