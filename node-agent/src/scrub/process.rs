//! Running a scrub program: never through a shell, with a deadline, its stderr kept for
//! the report. The program gets a process group of its own so a timeout kills what it
//! started too (a script's `sleep`), not only the script.

use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How much of a program's stderr a report keeps.
pub const MAX_STDERR: usize = 2048;
/// How long to wait for stderr to close after the program is gone; a daemon it left
/// behind in another session could hold it open forever.
const STDERR_GRACE: Duration = Duration::from_secs(1);
const POLL: Duration = Duration::from_millis(20);

#[derive(Debug)]
pub enum RunError {
    Spawn(std::io::Error),
    Wait(std::io::Error),
    TimedOut { stderr: String },
}

#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    pub stderr: String,
}

/// How much of a program's stdout [`run_capturing`] keeps.
pub const MAX_STDOUT: usize = 64 * 1024;

/// Runs `program` with `args` and waits at most `timeout` for it.
pub fn run<S: AsRef<OsStr>>(
    program: &Path,
    args: &[S],
    timeout: Duration,
) -> Result<Finished, RunError> {
    run_with(program, args, timeout, false).map(|(f, _)| f)
}

/// [`run`], keeping the first [`MAX_STDOUT`] bytes of stdout too (for programs whose
/// answer is their output, such as `nvidia-smi --query-gpu`).
pub fn run_capturing<S: AsRef<OsStr>>(
    program: &Path,
    args: &[S],
    timeout: Duration,
) -> Result<(Finished, String), RunError> {
    run_with(program, args, timeout, true)
}

fn run_with<S: AsRef<OsStr>>(
    program: &Path,
    args: &[S],
    timeout: Duration,
    capture: bool,
) -> Result<(Finished, String), RunError> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(if capture {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(RunError::Spawn)?;
    let stderr = collect(child.stderr.take(), MAX_STDERR + 4);
    let stdout = collect(child.stdout.take(), MAX_STDOUT);
    // A deadline past what `Instant` can hold is no deadline at all.
    let deadline = Instant::now().checked_add(timeout);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) => {}
            Err(e) => {
                kill_group(&mut child);
                return Err(RunError::Wait(e));
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break None;
        }
        std::thread::sleep(POLL);
    };
    // The program may have left children in its group; a scrub step leaves nothing
    // running behind it.
    kill_group(&mut child);
    let stderr = truncate(&stderr.recv_timeout(STDERR_GRACE).unwrap_or_default());
    let stdout = stdout.recv_timeout(STDERR_GRACE).unwrap_or_default();
    match status {
        Some(status) => Ok((Finished { status, stderr }, stdout)),
        None => Err(RunError::TimedOut { stderr }),
    }
}

fn kill_group(child: &mut Child) {
    let pid = rustix::process::Pid::from_child(child);
    // ESRCH when the group is already empty: nothing to do.
    let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    let _ = child.kill();
    let _ = child.wait();
}

/// Reads one of the child's pipes on a thread, keeping the first `max` bytes and
/// draining the rest so a chatty program never blocks on a full pipe.
fn collect(pipe: Option<impl Read + Send + 'static>, max: usize) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    if let Some(mut pipe) = pipe {
        std::thread::spawn(move || {
            let mut kept = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                match pipe.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let room = max.saturating_sub(kept.len());
                        kept.extend_from_slice(&buf[..n.min(room)]);
                    }
                }
            }
            let _ = tx.send(String::from_utf8_lossy(&kept).into_owned());
        });
    }
    rx
}

/// At most [`MAX_STDERR`] bytes, cut on a character boundary, trimmed.
pub fn truncate(s: &str) -> String {
    let s = s.trim();
    if s.len() <= MAX_STDERR {
        return s.to_string();
    }
    let mut cut = MAX_STDERR;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &s[..cut])
}

/// A finished run as a step outcome: exit 0 is success, anything else a failure that
/// quotes stderr.
pub fn describe_failure(
    what: &str,
    r: Result<Finished, RunError>,
    timeout: Duration,
) -> Option<String> {
    let with = |head: String, stderr: &str| {
        if stderr.is_empty() {
            head
        } else {
            format!("{head}: {stderr}")
        }
    };
    match r {
        Ok(f) if f.status.success() => None,
        Ok(f) => Some(with(format!("{what} failed ({})", f.status), &f.stderr)),
        Err(RunError::Spawn(e)) => Some(format!("{what} could not start: {e}")),
        Err(RunError::Wait(e)) => Some(format!("{what}: waiting for it failed: {e}")),
        Err(RunError::TimedOut { stderr }) => Some(with(
            format!("{what} killed after {} s", timeout.as_secs()),
            &stderr,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncates_on_a_char_boundary() {
        let long = "é".repeat(MAX_STDERR);
        let t = truncate(&long);
        assert!(t.len() <= MAX_STDERR + '…'.len_utf8());
        assert!(t.ends_with('…'));
        assert_eq!(truncate(" short \n"), "short");
    }

    #[test]
    fn keeps_stderr_and_status() {
        let r = run(
            Path::new("/bin/sh"),
            &["-c", "echo oops >&2; exit 3"],
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(r.status.code(), Some(3));
        assert_eq!(r.stderr, "oops");
        let r = run(
            Path::new("/bin/sh"),
            &["-c", "head -c 100000 /dev/zero | tr '\\0' x >&2"],
            Duration::from_secs(10),
        )
        .unwrap();
        assert!(r.status.success());
        assert!(r.stderr.len() <= MAX_STDERR + 3);
    }
}
