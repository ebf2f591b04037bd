//! The guest image the node agent's boot tests run (`test_image.sh`): built from Debian
//! packages only, once per recipe, and cached outside the clone in
//! `~/.cache/passage-images/` under a name holding a hash of the recipe, so CI builds it
//! once and a changed recipe builds a new one.

use crate::util;
use anyhow::{Context, Result, bail};
use sha2::Digest;
use std::path::PathBuf;
use std::process::Command;

const RECIPE: &str = include_str!("test_image.sh");

/// The tools the recipe runs, with the Debian package of each.
pub const TOOLS: &[(&str, &str)] = &[
    ("mmdebstrap", "mmdebstrap"),
    ("qemu-img", "qemu-utils"),
    ("extlinux", "extlinux"),
    ("sfdisk", "fdisk"),
    ("mkfs.ext4", "e2fsprogs"),
    ("mkfs.vfat", "dosfstools"),
    ("mcopy", "mtools"),
];

fn cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    base.join("passage-images")
}

/// The image's path for this recipe (whether or not it is built yet).
pub fn path() -> PathBuf {
    let digest = hex::encode(sha2::Sha256::digest(RECIPE.as_bytes()));
    cache_dir().join(format!("debian-test-{}.qcow2", &digest[..16]))
}

/// Builds the image unless this recipe's is already there; answers its path.
pub fn ensure() -> Result<PathBuf> {
    let out = path();
    if out.is_file() {
        println!("test image present: {}", out.display());
        return Ok(out);
    }
    for (tool, package) in TOOLS {
        crate::test::ensure_tool(tool, package)?;
    }
    let dir = cache_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let script = dir.join("build-test-image.sh");
    std::fs::write(&script, RECIPE).with_context(|| format!("writing {}", script.display()))?;
    let work = dir.join(format!("work-{}", std::process::id()));
    println!("building the test image (Debian packages, a few minutes)");
    let started = std::time::Instant::now();
    let mut cmd = Command::new("sh");
    cmd.arg(&script).arg(&out).arg(&work);
    let r = util::run_checked(&mut cmd);
    let _ = std::fs::remove_dir_all(&work);
    r.context("building the guest test image")?;
    if !out.is_file() {
        bail!("the image recipe ended without writing {}", out.display());
    }
    println!(
        "test image built in {}: {}",
        util::secs(started.elapsed()),
        out.display()
    );
    // Images of earlier recipes are no longer used by anything: ~100 MB each.
    if let Ok(rd) = std::fs::read_dir(&dir) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("debian-test-") && name.ends_with(".qcow2") && e.path() != out {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(out)
}
