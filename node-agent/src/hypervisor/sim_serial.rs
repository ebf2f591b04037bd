//! The simulated VM's serial port: a stand-in at the host boundary, so that a simulated
//! fleet (and the portal's tests on it) can open an interactive console. It is a line
//! discipline and no more: a `login:` prompt, a `Password:` prompt that takes any
//! password (there is no guest to check it against), then a prompt where `echo WORDS`
//! prints its words and every other command says that nothing runs here; `exit` goes
//! back to the login prompt. Typed characters are echoed as a terminal would, except the
//! password; backspace erases. It ends when its VM stops.

use passage_model::VmId;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

/// The stream's buffer each way.
pub const BUFFER: usize = 16 * 1024;
/// A longer line is cut: nobody types more at a prompt.
const MAX_LINE: usize = 1024;
/// How much of each VM's session the text console keeps.
const MAX_TRANSCRIPT: usize = 16 * 1024;
/// How often the stand-in looks whether its VM is still running.
const ALIVE_EVERY: Duration = Duration::from_millis(500);

/// What each VM's stand-in printed (its echo included), for the text console, as a
/// guest's serial output goes to its log.
#[derive(Clone, Default)]
pub struct Transcripts(Arc<Mutex<BTreeMap<VmId, String>>>);

impl Transcripts {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<VmId, String>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, vm: VmId) -> String {
        self.lock().get(&vm).cloned().unwrap_or_default()
    }

    pub fn forget(&self, vm: VmId) {
        self.lock().remove(&vm);
    }

    pub fn writer(&self, vm: VmId) -> impl Fn(&str) + Send + Sync + 'static {
        let all = self.clone();
        move |text: &str| {
            let mut all = all.lock();
            let t = all.entry(vm).or_default();
            t.push_str(text);
            if t.len() > MAX_TRANSCRIPT {
                let mut cut = t.len() - MAX_TRANSCRIPT;
                while !t.is_char_boundary(cut) {
                    cut += 1;
                }
                t.drain(..cut);
            }
        }
    }
}

enum State {
    Login,
    Password { user: String },
    Shell { user: String },
}

/// Serves one console session on `io` until the other end closes or `alive` says the VM
/// stopped.
pub async fn run(
    mut io: DuplexStream,
    host: String,
    alive: impl Fn() -> bool + Send + Sync + 'static,
    log: impl Fn(&str) + Send + Sync + 'static,
) {
    let mut state = State::Login;
    let mut line: Vec<u8> = Vec::new();
    // A CR LF pair is one Enter.
    let mut after_cr = false;
    let mut buf = [0u8; 1024];
    let mut tick = tokio::time::interval(ALIVE_EVERY);
    let login = format!("\r\n{host} login: ");
    if say(&mut io, &log, &login).await.is_err() {
        return;
    }
    loop {
        let n = tokio::select! {
            r = io.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = tick.tick() => {
                if alive() {
                    continue;
                }
                return;
            }
        };
        let mut out = String::new();
        for &b in &buf[..n] {
            let enter = b == b'\r' || (b == b'\n' && !after_cr);
            after_cr = b == b'\r';
            if b == b'\n' && !enter {
                continue;
            }
            let echo = !matches!(state, State::Password { .. });
            if enter {
                let typed = String::from_utf8_lossy(&line).trim().to_string();
                line.clear();
                out.push_str("\r\n");
                state = match state {
                    State::Login if typed.is_empty() => {
                        out.push_str(login.trim_start());
                        State::Login
                    }
                    State::Login => {
                        out.push_str("Password: ");
                        State::Password { user: typed }
                    }
                    State::Password { user } => {
                        out.push_str(&format!(
                            "Linux {host} (a Passage simulated VM: no guest runs here)\r\n{}",
                            prompt(&user, &host)
                        ));
                        State::Shell { user }
                    }
                    State::Shell { user } => match typed.as_str() {
                        "exit" | "logout" => {
                            out.push_str(login.trim_start());
                            State::Login
                        }
                        "" => {
                            out.push_str(&prompt(&user, &host));
                            State::Shell { user }
                        }
                        cmd => {
                            match cmd.strip_prefix("echo") {
                                Some(words) if words.is_empty() || words.starts_with(' ') => {
                                    out.push_str(words.trim_start());
                                    out.push_str("\r\n");
                                }
                                _ => out.push_str(&format!(
                                    "{}: not run: a simulated VM has no commands\r\n",
                                    cmd.split_whitespace().next().unwrap_or(cmd)
                                )),
                            }
                            out.push_str(&prompt(&user, &host));
                            State::Shell { user }
                        }
                    },
                };
            } else if b == 0x7f || b == 0x08 {
                if line.pop().is_some() && echo {
                    out.push_str("\x08 \x08");
                }
            } else if line.len() < MAX_LINE && (b >= 0x20 || b == b'\t') {
                line.push(b);
                if echo {
                    out.push_str(&String::from_utf8_lossy(&[b]));
                }
            }
        }
        if !out.is_empty() && say(&mut io, &log, &out).await.is_err() {
            return;
        }
    }
}

fn prompt(user: &str, host: &str) -> String {
    format!("{user}@{host}:~$ ")
}

async fn say(io: &mut DuplexStream, log: &impl Fn(&str), text: &str) -> std::io::Result<()> {
    log(text);
    io.write_all(text.as_bytes()).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    async fn read_until(io: &mut DuplexStream, want: &str) -> String {
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        while !String::from_utf8_lossy(&got).contains(want) {
            let n = tokio::time::timeout(Duration::from_secs(5), io.read(&mut buf))
                .await
                .unwrap()
                .unwrap();
            assert!(
                n > 0,
                "closed before {want:?}: {:?}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    }

    #[tokio::test]
    async fn logs_in_echoes_and_ends_with_its_vm() {
        let (ours, mut theirs) = tokio::io::duplex(BUFFER);
        let alive = Arc::new(AtomicBool::new(true));
        let a = alive.clone();
        let transcripts = Transcripts::default();
        let vm = VmId::new_random();
        let task = tokio::spawn(run(
            ours,
            "web-1".into(),
            move || a.load(Ordering::Relaxed),
            transcripts.writer(vm),
        ));
        read_until(&mut theirs, "web-1 login: ").await;
        theirs.write_all(b"debian\r").await.unwrap();
        read_until(&mut theirs, "debian\r\nPassword: ").await;
        // Not echoed: the password.
        theirs.write_all(b"s3cret\r\n").await.unwrap();
        let got = read_until(&mut theirs, "debian@web-1:~$ ").await;
        assert!(!got.contains("s3cret"), "{got:?}");
        theirs.write_all(b"echo 42x\x7f\r").await.unwrap();
        read_until(&mut theirs, "echo 42x\x08 \x08\r\n42\r\ndebian@web-1:~$ ").await;
        theirs.write_all(b"ls\r").await.unwrap();
        read_until(&mut theirs, "ls: not run").await;
        theirs.write_all(b"exit\r").await.unwrap();
        read_until(&mut theirs, "web-1 login: ").await;
        let t = transcripts.get(vm);
        assert!(t.contains("echo 42") && !t.contains("s3cret"), "{t:?}");
        // The VM stops: the port closes.
        alive.store(false, Ordering::Relaxed);
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), theirs.read_to_end(&mut rest))
            .await
            .unwrap()
            .unwrap();
        task.await.unwrap();
    }
}
