//! A tenant's interactive console on this node: the server cannot dial a node, so for a
//! console session it queues `attach_console`, and the agent opens the VM's serial port,
//! dials a websocket back to the server for that session and copies bytes both ways
//! until either side closes. The VM's text log keeps being written meanwhile (QEMU logs
//! every byte of the port whether a client is connected or not).

use super::client::{AgentClient, ClientError, ServerSocket};
use crate::hypervisor::{Hypervisor, HypervisorError, SerialPort};
use futures_util::{SinkExt, StreamExt};
use passage_model::VmId;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

/// What the serial port is read in: a frame to the server holds at most this.
const CHUNK: usize = 16 * 1024;

/// A serial port, open.
pub trait Serial: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Serial for T {}

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("{0}")]
    Hypervisor(#[from] HypervisorError),
    #[error(
        "VM {vm} has no serial socket ({detail}): it was started by an older agent or is \
         not running; stop and start it for an interactive console"
    )]
    NoSocket { vm: VmId, detail: String },
    #[error("{0}")]
    Server(#[from] ClientError),
}

/// Opens `vm`'s serial port, then the session's websocket to the server: both, or an
/// error saying which could not be opened.
pub async fn attach(
    hypervisor: &Arc<dyn Hypervisor>,
    client: &AgentClient,
    vm: VmId,
    session: &str,
) -> Result<(Box<dyn Serial>, ServerSocket), AttachError> {
    let serial: Box<dyn Serial> = match hypervisor.serial(vm)? {
        SerialPort::Stream(s) => Box::new(s),
        SerialPort::Socket(path) => match tokio::net::UnixStream::connect(&path).await {
            Ok(s) => Box::new(s),
            Err(e) => {
                return Err(AttachError::NoSocket {
                    vm,
                    detail: format!("{}: {e}", path.display()),
                });
            }
        },
    };
    let socket = client.console_socket(session).await?;
    Ok((serial, socket))
}

/// Copies bytes both ways until either side closes: the serial port's output goes as
/// binary frames; binary and text frames from the server go to the port as bytes. A port
/// that closes (the VM stopped) closes the websocket normally, saying so.
pub async fn pump(serial: Box<dyn Serial>, socket: ServerSocket) {
    let (mut port_in, mut port_out) = tokio::io::split(serial);
    let (mut to_server, mut from_server) = socket.split();
    let mut buf = vec![0u8; CHUNK];
    loop {
        tokio::select! {
            r = port_in.read(&mut buf) => {
                let n = match r {
                    Ok(0) | Err(_) => {
                        let bye = CloseFrame {
                            code: CloseCode::Normal,
                            reason: "the VM's serial port closed (the VM stopped)".into(),
                        };
                        let _ = to_server.send(Message::Close(Some(bye))).await;
                        return;
                    }
                    Ok(n) => n,
                };
                let frame = Message::Binary(bytes::Bytes::copy_from_slice(&buf[..n]));
                if to_server.send(frame).await.is_err() {
                    return;
                }
            }
            m = from_server.next() => {
                let bytes = match m {
                    Some(Ok(Message::Binary(b))) => b,
                    Some(Ok(Message::Text(t))) => bytes::Bytes::copy_from_slice(t.as_bytes()),
                    // Answered by the websocket itself.
                    Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => continue,
                    Some(Ok(Message::Close(_)) | Err(_)) | None => {
                        let _ = to_server.close().await;
                        return;
                    }
                };
                if port_out.write_all(&bytes).await.is_err() {
                    return;
                }
            }
        }
    }
}
