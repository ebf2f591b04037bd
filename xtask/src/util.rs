//! Small helpers shared by the subcommands.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The workspace root (the folder above `xtask/`).
/// The repository `cargo xtask` was run in. `cargo run` names the package's directory at
/// run time; the one compiled in is only a fallback, as clones sharing a target directory
/// share one `xtask` binary and it may have been built in another clone.
pub fn repo_root() -> PathBuf {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest.parent().map(Path::to_path_buf).unwrap_or(manifest)
}

/// The cargo that runs us (`CARGO` is set by `cargo run`), else `cargo` from PATH.
pub fn cargo() -> Command {
    let bin = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(bin);
    cmd.current_dir(repo_root());
    cmd
}

/// Runs a command to completion, failing on a non-zero exit.
pub fn run_checked(cmd: &mut Command) -> Result<()> {
    let shown = show(cmd);
    let status = cmd
        .status()
        .with_context(|| format!("cannot start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// A command as one readable line.
pub fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    if let Some(name) = Path::new(&s).file_name() {
        s = name.to_string_lossy().into_owned();
    }
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Whether `name` is an executable file in some PATH folder.
pub fn on_path(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let Some(path) = std::env::var_os("PATH") else {
        return false;
    };
    std::env::split_paths(&path).any(|dir| {
        std::fs::metadata(dir.join(name))
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    })
}

/// Whether a TCP connection to `addr` (host:port) succeeds within `timeout`.
pub fn tcp_answers(addr: &str, timeout: Duration) -> bool {
    use std::net::{TcpStream, ToSocketAddrs};
    let Ok(addrs) = addr.to_socket_addrs() else {
        return false;
    };
    addrs
        .into_iter()
        .any(|a| TcpStream::connect_timeout(&a, timeout).is_ok())
}

/// Human-readable seconds.
pub fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 60.0 {
        format!("{s:.1} s")
    } else {
        format!("{}m{:02.0}s", (s / 60.0).floor(), s % 60.0)
    }
}

/// The cargo target directory (honours `CARGO_TARGET_DIR` and `build.target-dir`).
pub fn target_dir() -> Result<PathBuf> {
    let out = cargo()
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .output()
        .context("cannot run `cargo metadata`")?;
    if !out.status.success() {
        bail!(
            "`cargo metadata` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("`cargo metadata` printed invalid JSON")?;
    match meta.get("target_directory").and_then(|v| v.as_str()) {
        Some(dir) => Ok(PathBuf::from(dir)),
        None => bail!("`cargo metadata` did not name a target_directory"),
    }
}
