//! A small QMP client: JSON objects one per line over QEMU's unix socket. Only what the
//! agent needs: the capabilities handshake, commands, and their `return` or `error`.
//! Asynchronous `event` lines that arrive in between are skipped.

use serde_json::{Value, json};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// A QMP reply line longer than this is not one QEMU would send for our commands.
const MAX_LINE: u64 = 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("QMP socket: {0}")]
    Io(#[from] io::Error),
    #[error("QMP: unexpected reply {0}")]
    Protocol(String),
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
}

pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    /// Connects, reads the greeting and negotiates capabilities.
    pub fn connect(socket: &Path, timeout: Duration) -> Result<Self, QmpError> {
        let stream = UnixStream::connect(socket)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let writer = stream.try_clone()?;
        let mut qmp = Qmp {
            reader: BufReader::new(stream),
            writer,
        };
        let greeting = qmp.read_line()?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(short(&greeting)));
        }
        qmp.execute("qmp_capabilities", None)?;
        Ok(qmp)
    }

    fn read_line(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        let n = (&mut self.reader).take(MAX_LINE).read_line(&mut line)?;
        if n == 0 {
            return Err(QmpError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "QEMU closed the QMP connection",
            )));
        }
        serde_json::from_str(line.trim()).map_err(|e| {
            QmpError::Protocol(format!(
                "{e}: {}",
                line.chars().take(200).collect::<String>()
            ))
        })
    }

    /// Runs one command and returns its `return` value.
    pub fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        let mut msg = json!({ "execute": command });
        if let Some(a) = arguments {
            msg["arguments"] = a;
        }
        let mut text = msg.to_string();
        text.push('\n');
        self.writer.write_all(text.as_bytes())?;
        loop {
            let reply = self.read_line()?;
            if let Some(r) = reply.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = reply.get("error") {
                let field = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
                return Err(QmpError::Command {
                    command: command.to_string(),
                    class: field("class"),
                    desc: field("desc"),
                });
            }
            if reply.get("event").is_none() {
                return Err(QmpError::Protocol(short(&reply)));
            }
        }
    }

    /// `query-status`: the run state (`running`, `paused`, `prelaunch`, …).
    pub fn status(&mut self) -> Result<String, QmpError> {
        let r = self.execute("query-status", None)?;
        r.get("status")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| QmpError::Protocol(short(&r)))
    }

    /// `system_powerdown`: presses the guest's ACPI power button. QEMU answers at once;
    /// the guest shuts down (and QEMU exits) in its own time, or never.
    pub fn powerdown(&mut self) -> Result<(), QmpError> {
        self.execute("system_powerdown", None).map(drop)
    }

    /// `quit`: QEMU exits after answering (or before: a closed connection counts too).
    pub fn quit(&mut self) -> Result<(), QmpError> {
        match self.execute("quit", None) {
            Ok(_) => Ok(()),
            Err(QmpError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(()),
            Err(e) => Err(e),
        }
    }
}

fn short(v: &Value) -> String {
    v.to_string().chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A scripted peer on a real socket: what QEMU sends, byte for byte, including an
    /// event line between a command and its reply.
    fn serve(script: &'static [&'static str]) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            s.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\r\n")
                .unwrap();
            for reply in script {
                let mut line = String::new();
                if r.read_line(&mut line).unwrap() == 0 {
                    return;
                }
                s.write_all(reply.as_bytes()).unwrap();
            }
        });
        (dir, path)
    }

    #[test]
    fn handshake_status_events_and_errors() {
        let (_d, path) = serve(&[
            "{\"return\": {}}\r\n",
            "{\"event\": \"RESUME\", \"timestamp\": {}}\r\n{\"return\": {\"status\": \"running\", \"running\": true}}\r\n",
            "{\"error\": {\"class\": \"CommandNotFound\", \"desc\": \"nope\"}}\r\n",
            "garbage\r\n",
        ]);
        let mut q = Qmp::connect(&path, Duration::from_secs(5)).unwrap();
        assert_eq!(q.status().unwrap(), "running");
        let e = q.execute("nope", None).unwrap_err();
        assert!(e.to_string().contains("CommandNotFound"), "{e}");
        assert!(matches!(q.status(), Err(QmpError::Protocol(_))));
    }

    #[test]
    fn a_peer_that_hangs_up_is_an_error() {
        let (_d, path) = serve(&[]);
        assert!(Qmp::connect(&path, Duration::from_secs(5)).is_err());
    }
}
