//! Builds the portal's browser half: the `passage-app` crate for wasm32 with feature
//! `hydrate`, bound by the `wasm-bindgen` CLI, plus the stylesheet and static files, into
//! `<target>/site` where the `server` binary finds it (see server/src/portal.rs).
//!
//! Tools come from crates.io and rustup only, installed on first use: the wasm32 target
//! and `wasm-bindgen-cli` at exactly the version in Cargo.lock (the CLI and the library
//! must agree).

use crate::util::{cargo, repo_root, run_checked, target_dir};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Builds the site and answers its folder.
pub fn build() -> Result<PathBuf> {
    let root = repo_root();
    let target = target_dir()?;
    ensure_wasm_target()?;
    let bindgen = ensure_wasm_bindgen(&root)?;
    eprintln!("xtask: building the portal's WebAssembly (passage-app, feature hydrate)");
    run_checked(cargo().args([
        "build",
        "-p",
        "passage-app",
        "--lib",
        "--target",
        "wasm32-unknown-unknown",
        "--no-default-features",
        "--features",
        "hydrate",
    ]))?;
    let wasm = target.join("wasm32-unknown-unknown/debug/passage_app.wasm");
    let site = target.join("site");
    let pkg = site.join("pkg");
    std::fs::create_dir_all(&pkg).with_context(|| format!("cannot create {}", pkg.display()))?;
    run_checked(
        Command::new(&bindgen)
            .args([
                "--target",
                "web",
                "--no-typescript",
                "--out-name",
                "passage",
                "--out-dir",
            ])
            .arg(&pkg)
            .arg(&wasm),
    )?;
    copy(&root.join("style/passage.css"), &pkg.join("passage.css"))?;
    let public = root.join("app/public");
    for entry in
        std::fs::read_dir(&public).with_context(|| format!("cannot read {}", public.display()))?
    {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            copy(&entry.path(), &site.join(entry.file_name()))?;
        }
    }
    Ok(site)
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .map(|_| ())
        .with_context(|| format!("cannot copy {} to {}", from.display(), to.display()))
}

fn ensure_wasm_target() -> Result<()> {
    let out = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .context("cannot run rustup")?;
    if String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.trim() == "wasm32-unknown-unknown")
    {
        return Ok(());
    }
    eprintln!("xtask: adding the wasm32-unknown-unknown target");
    run_checked(Command::new("rustup").args(["target", "add", "wasm32-unknown-unknown"]))
}

/// The version of `wasm-bindgen` that Cargo.lock pins.
fn locked_bindgen_version(root: &Path) -> Result<String> {
    let lock =
        std::fs::read_to_string(root.join("Cargo.lock")).context("cannot read Cargo.lock")?;
    let mut lines = lock.lines();
    while let Some(l) = lines.next() {
        if l.trim() == "name = \"wasm-bindgen\""
            && let Some(v) = lines
                .next()
                .and_then(|v| v.trim().strip_prefix("version = \""))
                .and_then(|v| v.strip_suffix('"'))
        {
            return Ok(v.to_string());
        }
    }
    bail!("Cargo.lock has no wasm-bindgen package")
}

/// `wasm-bindgen` at the locked version: from PATH, from cargo's bin folder, or installed
/// there now (a few minutes, once).
fn ensure_wasm_bindgen(root: &Path) -> Result<PathBuf> {
    let want = locked_bindgen_version(root)?;
    let cargo_bin = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from(".cargo"))
        .join("bin/wasm-bindgen");
    for candidate in [PathBuf::from("wasm-bindgen"), cargo_bin.clone()] {
        if let Ok(out) = Command::new(&candidate).arg("--version").output() {
            let v = String::from_utf8_lossy(&out.stdout);
            if v.split_whitespace().nth(1) == Some(want.as_str()) {
                return Ok(candidate);
            }
        }
    }
    eprintln!("xtask: installing wasm-bindgen-cli {want} (once)");
    run_checked(cargo().args(["install", "wasm-bindgen-cli", "--version", &want]))?;
    Ok(cargo_bin)
}
