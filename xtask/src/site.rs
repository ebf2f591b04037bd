//! Builds the portal's browser half into `<target>/site`, where the `server` binary finds
//! it (see server/src/portal.rs):
//!
//! 1. `passage-app` for wasm32 with feature `hydrate`, in the `wasm-release` profile
//!    (size-optimised, LTO);
//! 2. bound by the `wasm-bindgen` CLI, at exactly the version in Cargo.lock (the CLI and
//!    the library must agree);
//! 3. shrunk by `wasm-opt -Oz` (Binaryen from npm, pinned by `xtask/wasm-opt/`'s lock
//!    file and installed once into a cache outside the clone);
//! 4. with the stylesheet, into `site/pkg/<hash>/`, where the hash is that of the files:
//!    the server names that folder in every page and lets browsers keep its files for a
//!    year, so a new build must live under a new name. `site/bundle` names the current
//!    folder; the one before stays, so a server started earlier keeps working;
//! 5. each file also brotli- and gzip-compressed beside it (`.br`, `.gz`), which the
//!    server sends to browsers that take them.
//!
//! Steps 2 to 5 are skipped when their inputs (the wasm, the stylesheet, the tools) are
//! those `site/bundle.inputs` recorded for a bundle that is still there.

use crate::util::{cargo, on_path, repo_root, run_checked, target_dir};
use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What to do without `npm` (and so without `wasm-opt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WasmOpt {
    /// Fail: CI measures what browsers download, and that counts on wasm-opt.
    Required,
    /// Ship the bundle unshrunk, with a warning (the demo needs only Rust).
    IfAvailable,
}

/// The files browsers fetch from a bundle: `wasm-bindgen`'s output and the stylesheet.
const OUTPUT_NAME: &str = "passage";

/// Builds the site and answers its folder; without npm, without wasm-opt (`cargo xtask
/// site` and `demo`).
pub fn build() -> Result<PathBuf> {
    build_with(WasmOpt::IfAvailable)
}

/// Builds the site and answers its folder.
pub fn build_with(wasm_opt: WasmOpt) -> Result<PathBuf> {
    let root = repo_root();
    let target = target_dir()?;
    ensure_wasm_target()?;
    let bindgen = ensure_wasm_bindgen(&root)?;
    let (optimizer, xterm) = match (wasm_opt, on_path("npm")) {
        (_, true) => (Some(ensure_wasm_opt(&root)?), Some(ensure_xterm(&root)?)),
        (WasmOpt::Required, false) => {
            bail!(
                "npm is missing: it installs wasm-opt, which shrinks the portal's bundle, \
                 and xterm.js, the portal's terminal"
            )
        }
        (WasmOpt::IfAvailable, false) => {
            eprintln!(
                "xtask: warning: no npm, so no wasm-opt and no xterm.js; the portal's bundle \
                 stays larger and it has no terminal (the console's text log stays)"
            );
            (None, None)
        }
    };
    eprintln!("xtask: building the portal's WebAssembly (passage-app, feature hydrate, release)");
    run_checked(cargo().args([
        "build",
        "-p",
        "passage-app",
        "--lib",
        "--target",
        "wasm32-unknown-unknown",
        "--profile",
        "wasm-release",
        "--no-default-features",
        "--features",
        "hydrate",
    ]))?;
    let wasm = target.join("wasm32-unknown-unknown/wasm-release/passage_app.wasm");
    let css = root.join("style/passage.css");
    let site = target.join("site");
    let pkg = site.join("pkg");
    std::fs::create_dir_all(&pkg).with_context(|| format!("cannot create {}", pkg.display()))?;

    // wasm-bindgen and wasm-opt take half a minute even when cargo had nothing to do:
    // the same inputs (and tools) make the same bundle, which may be there already.
    let mut files = vec![wasm.as_path(), css.as_path()];
    files.extend(xterm.iter().flatten().map(PathBuf::as_path));
    let inputs = inputs_key(&files, &bindgen, optimizer.as_deref())?;
    let inputs_file = site.join("bundle.inputs");
    let reusable = std::fs::read_to_string(&inputs_file)
        .ok()
        .and_then(|s| {
            let (key, id) = s.trim().split_once(' ')?;
            (key == inputs).then(|| id.to_string())
        })
        .filter(|id| pkg.join(id).is_dir());
    let id = match reusable {
        Some(id) => {
            eprintln!("xtask: the portal's bundle is up to date");
            id
        }
        None => {
            let id = make_bundle(
                &wasm,
                &css,
                xterm.as_ref(),
                &bindgen,
                optimizer.as_deref(),
                &site,
            )?;
            write_atomically(&inputs_file, format!("{inputs} {id}").as_bytes())?;
            id
        }
    };
    let previous = std::fs::read_to_string(site.join("bundle")).ok();
    write_atomically(&site.join("bundle"), id.as_bytes())?;
    prune(&pkg, &id, previous.as_deref().map(str::trim))?;

    let public = root.join("app/public");
    for entry in
        std::fs::read_dir(&public).with_context(|| format!("cannot read {}", public.display()))?
    {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            copy(&entry.path(), &site.join(entry.file_name()))?;
        }
    }
    report(&pkg.join(&id))?;
    Ok(site)
}

/// Binds, shrinks and compresses the bundle into `site/pkg/<id>/`; answers the id.
fn make_bundle(
    wasm: &Path,
    css: &Path,
    xterm: Option<&[PathBuf; 2]>,
    bindgen: &Path,
    optimizer: Option<&Path>,
    site: &Path,
) -> Result<String> {
    let staging = site.join(".staging");
    if staging.exists() {
        std::fs::remove_dir_all(&staging)
            .with_context(|| format!("cannot remove {}", staging.display()))?;
    }
    std::fs::create_dir_all(&staging)
        .with_context(|| format!("cannot create {}", staging.display()))?;
    run_checked(
        Command::new(bindgen)
            .args([
                "--target",
                "web",
                "--no-typescript",
                "--out-name",
                OUTPUT_NAME,
                "--out-dir",
            ])
            .arg(&staging)
            .arg(wasm),
    )?;
    if let Some(optimizer) = optimizer {
        let bg = staging.join(format!("{OUTPUT_NAME}_bg.wasm"));
        let shrunk = staging.join("shrunk.wasm");
        eprintln!("xtask: wasm-opt -Oz");
        run_checked(
            Command::new(optimizer)
                .arg("-Oz")
                .args(WASM_FEATURES)
                .arg(&bg)
                .arg("-o")
                .arg(&shrunk),
        )?;
        std::fs::rename(&shrunk, &bg)
            .with_context(|| format!("cannot replace {}", bg.display()))?;
    }
    copy(css, &staging.join(format!("{OUTPUT_NAME}.css")))?;
    if let Some([script, style]) = xterm {
        copy(script, &staging.join("xterm.js"))?;
        copy(style, &staging.join("xterm.css"))?;
    }

    let files = files_under(&staging)?;
    let id = bundle_id(&staging, &files)?;
    for f in &files {
        precompress(&staging.join(f))?;
    }
    let dest = site.join("pkg").join(&id);
    if dest.exists() {
        // The same files again: what is there is already right.
        std::fs::remove_dir_all(&staging)
            .with_context(|| format!("cannot remove {}", staging.display()))?;
    } else {
        std::fs::rename(&staging, &dest)
            .with_context(|| format!("cannot move the bundle to {}", dest.display()))?;
    }
    Ok(id)
}

/// A digest of what a bundle is made from: the files, and which tools made it.
fn inputs_key(files: &[&Path], bindgen: &Path, optimizer: Option<&Path>) -> Result<String> {
    let mut h = Sha256::new();
    for f in files {
        let bytes = std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?;
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    }
    // The tools by path: wasm-opt's names its pinned version; wasm-bindgen's version
    // follows Cargo.lock, which the wasm already reflects.
    for tool in [Some(bindgen), optimizer] {
        h.update(
            tool.map(|t| t.to_string_lossy().into_owned())
                .unwrap_or_default(),
        );
        h.update([0]);
    }
    h.update(WASM_FEATURES.join(" "));
    Ok(hex::encode(&h.finalize()[..16]))
}

/// The WebAssembly features Rust's wasm32 target enables by default, so wasm-opt accepts
/// (and keeps) the instructions rustc emits.
const WASM_FEATURES: &[&str] = &[
    "--enable-bulk-memory",
    "--enable-bulk-memory-opt",
    "--enable-call-indirect-overlong",
    "--enable-multivalue",
    "--enable-mutable-globals",
    "--enable-nontrapping-float-to-int",
    "--enable-reference-types",
    "--enable-sign-ext",
];

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .map(|_| ())
        .with_context(|| format!("cannot copy {} to {}", from.display(), to.display()))
}

/// The files below `dir`, as sorted relative paths (wasm-bindgen may add `snippets/`).
fn files_under(dir: &Path) -> Result<Vec<PathBuf>> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        for entry in
            std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))?
        {
            let entry = entry?;
            let path = entry.path();
            if entry.file_type()?.is_dir() {
                walk(root, &path, out)?;
            } else if let Ok(rel) = path.strip_prefix(root) {
                out.push(rel.to_path_buf());
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out)?;
    out.sort();
    Ok(out)
}

/// 16 hex digits of the SHA-256 of every file's name and content.
fn bundle_id(dir: &Path, files: &[PathBuf]) -> Result<String> {
    let mut h = Sha256::new();
    for f in files {
        let bytes =
            std::fs::read(dir.join(f)).with_context(|| format!("cannot read {}", f.display()))?;
        h.update(f.to_string_lossy().as_bytes());
        h.update([0]);
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    }
    Ok(hex::encode(&h.finalize()[..8]))
}

/// Writes `file.br` (brotli, quality 11) and `file.gz` (gzip, level 9) beside `file`.
fn precompress(file: &Path) -> Result<()> {
    let data = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let mut br = Vec::new();
    {
        let params = brotli::enc::BrotliEncoderParams {
            quality: 11,
            lgwin: 22,
            ..Default::default()
        };
        brotli::BrotliCompress(&mut data.as_slice(), &mut br, &params)
            .with_context(|| format!("cannot brotli-compress {}", file.display()))?;
    }
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(&data)
        .and_then(|()| gz.try_finish())
        .with_context(|| format!("cannot gzip {}", file.display()))?;
    let gz = gz.get_ref();
    for (ext, bytes) in [("br", br.as_slice()), ("gz", gz.as_slice())] {
        let mut name = file.as_os_str().to_owned();
        name.push(".");
        name.push(ext);
        std::fs::write(&name, bytes)
            .with_context(|| format!("cannot write {}", Path::new(&name).display()))?;
    }
    Ok(())
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}

/// Removes from `pkg` every bundle but `current` and `previous`, and the files of the
/// old flat layout (`pkg/passage.js`…).
fn prune(pkg: &Path, current: &str, previous: Option<&str>) -> Result<()> {
    for entry in std::fs::read_dir(pkg).with_context(|| format!("cannot read {}", pkg.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        if name == current || previous.is_some_and(|p| name == p) {
            continue;
        }
        let path = entry.path();
        let removed = if entry.file_type()?.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed.with_context(|| format!("cannot remove {}", path.display()))?;
    }
    Ok(())
}

/// Prints each file's size, raw and compressed.
fn report(dir: &Path) -> Result<()> {
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    eprintln!("xtask: the portal's bundle, {}:", dir.display());
    for f in files_under(dir)? {
        if f.extension().is_some_and(|e| e == "br" || e == "gz") {
            continue;
        }
        let path = dir.join(&f);
        let mut br = path.as_os_str().to_owned();
        br.push(".br");
        let mut gz = path.as_os_str().to_owned();
        gz.push(".gz");
        eprintln!(
            "  {:<24} {:>9} bytes, {:>8} brotli, {:>8} gzip",
            f.display(),
            size(&path),
            size(Path::new(&br)),
            size(Path::new(&gz))
        );
    }
    Ok(())
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

/// `wasm-opt` from npm's `binaryen` at the version `xtask/wasm-opt/package-lock.json`
/// pins (with its checksum).
fn ensure_wasm_opt(root: &Path) -> Result<PathBuf> {
    npm_tool(root, "wasm-opt", "wasm-opt")
}

/// The command `bin` of the npm packages `xtask/<spec>/package-lock.json` pins (with
/// their checksums), installed by `npm ci` into `~/.cache/passage-tools/<spec>-<lock
/// hash>/` on first use: outside the clone, so a fresh checkout does not fetch it again.
pub fn npm_tool(root: &Path, spec: &str, bin: &str) -> Result<PathBuf> {
    let dir = npm_packages(root, spec, &Path::new("node_modules/.bin").join(bin))?;
    Ok(dir.join("node_modules/.bin").join(bin))
}

/// The folder where `npm ci` installed the packages `xtask/<spec>/package-lock.json` pins
/// (with their checksums): `~/.cache/passage-tools/<spec>-<lock hash>/`, made on first
/// use, outside the clone, so a fresh checkout does not fetch them again. `expect` is a
/// file below it that the install must have made.
fn npm_packages(root: &Path, spec: &str, expect: &Path) -> Result<PathBuf> {
    let spec_dir = root.join("xtask").join(spec);
    let lock = std::fs::read(spec_dir.join("package-lock.json"))
        .with_context(|| format!("cannot read xtask/{spec}/package-lock.json"))?;
    let manifest = std::fs::read(spec_dir.join("package.json"))
        .with_context(|| format!("cannot read xtask/{spec}/package.json"))?;
    let key = hex::encode(&Sha256::digest([manifest.as_slice(), &lock].concat())[..6]);
    let dir = tools_cache()?.join(format!("{spec}-{key}"));
    let path = dir.join(expect);
    if path.is_file() {
        return Ok(dir);
    }
    eprintln!(
        "xtask: installing xtask/{spec} (npm) into {} (once)",
        dir.display()
    );
    let partial = dir.with_extension("partial");
    if partial.exists() {
        std::fs::remove_dir_all(&partial)
            .with_context(|| format!("cannot remove {}", partial.display()))?;
    }
    std::fs::create_dir_all(&partial)
        .with_context(|| format!("cannot create {}", partial.display()))?;
    std::fs::write(partial.join("package.json"), &manifest)?;
    std::fs::write(partial.join("package-lock.json"), &lock)?;
    run_checked(
        Command::new("npm")
            .current_dir(&partial)
            .args(["ci", "--no-audit", "--no-fund"]),
    )?;
    std::fs::rename(&partial, &dir).with_context(|| format!("cannot create {}", dir.display()))?;
    if !path.is_file() {
        bail!(
            "npm installed xtask/{spec} but {} is missing",
            path.display()
        );
    }
    Ok(dir)
}

/// xterm.js's script and stylesheet, from npm at the version `xtask/xterm/`'s lock file
/// pins: the portal's interactive console loads them when a tenant opens it.
fn ensure_xterm(root: &Path) -> Result<[PathBuf; 2]> {
    let script = Path::new("node_modules/@xterm/xterm/lib/xterm.js");
    let dir = npm_packages(root, "xterm", script)?;
    Ok([
        dir.join(script),
        dir.join("node_modules/@xterm/xterm/css/xterm.css"),
    ])
}

/// Where tools the build fetches are kept: `$XDG_CACHE_HOME/passage-tools`, else
/// `~/.cache/passage-tools`.
fn tools_cache() -> Result<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .context("neither XDG_CACHE_HOME nor HOME is set")?;
    Ok(base.join("passage-tools"))
}
