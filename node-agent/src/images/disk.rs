//! VM boot disks: a qcow2 overlay on the cached image, `STATE/qemu/<vm>/disk.qcow2`,
//! with `disk.json` beside it naming the image (so the cache knows the image is in use).
//! The disk is a plain file: stop/start and agent or node restarts keep it; only
//! [`delete_disk`] (the VM's destroy) removes it.

use super::ImageError;
use crate::state::{read_json, write_json};
use passage_model::VmId;
use passage_model::images::Sha256;
use passage_model::protocol::DiskSpec;
use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const QEMU_IMG_BINARY: &str = "qemu-img";
pub const DISK_FILE: &str = "disk.qcow2";
const DISK_SPEC_FILE: &str = "disk.json";
const DISK_TMP_FILE: &str = ".disk.qcow2.tmp";
/// Files of a VM that go with its disk when it is destroyed: the guest's console and
/// its cloud-init seed may hold the tenant's data.
const VM_FILES: &[&str] = &[
    "console.log",
    "console.log.0",
    "console.log.0.tmp",
    "qemu.log",
    crate::hypervisor::SERIAL_FILE,
    crate::seed::SEED_FILE,
    crate::seed::SEED_TMP_FILE,
    // A UEFI VM's variables live as long as its disk.
    crate::hypervisor::OVMF_VARS_FILE,
    crate::hypervisor::OVMF_VARS_TMP_FILE,
    crate::hypervisor::PINNING_FILE,
];

/// `STATE/qemu/<vm>`: the VM's directory (shared with the QEMU backend's files).
pub fn vm_dir(state_dir: &Path, vm: VmId) -> PathBuf {
    state_dir.join("qemu").join(vm.to_string())
}

pub fn disk_path(state_dir: &Path, vm: VmId) -> PathBuf {
    vm_dir(state_dir, vm).join(DISK_FILE)
}

/// Makes the VM's disk unless it exists: `qemu-img create -f qcow2 -b IMAGE -F TYPE` at
/// `size_gib`, under a temporary name renamed into place, so a crash leaves either no
/// disk or a whole one. An existing disk is kept as it is (the guest's data).
pub fn create_overlay(
    qemu_img: &Path,
    state_dir: &Path,
    vm: VmId,
    disk: &DiskSpec,
    image_path: &Path,
) -> Result<PathBuf, ImageError> {
    let dir = vm_dir(state_dir, vm);
    let path = dir.join(DISK_FILE);
    let spec_path = dir.join(DISK_SPEC_FILE);
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| ImageError::Io { path: p, source }
    };
    fs::create_dir_all(&dir).map_err(io(&dir))?;
    let recorded: Option<DiskSpec> = read_json(&spec_path).ok().flatten();
    if path.exists() {
        // The record names what the existing disk is built on: kept as it is (written
        // only where missing, as by hand-made disks).
        if recorded.is_none() {
            write_json(&spec_path, disk, 0o600).map_err(io(&spec_path))?;
        }
        return Ok(path);
    }
    // Written first: from here on the image counts as in use, so no eviction races the
    // disk being made on it.
    if recorded.as_ref() != Some(disk) {
        write_json(&spec_path, disk, 0o600).map_err(io(&spec_path))?;
    }
    let started = std::time::Instant::now();
    let made = make_overlay(qemu_img, &dir, disk, image_path);
    if made.is_err() && !path.exists() {
        // No disk, so no longer a user of the image.
        let _ = crate::state::remove_json(&spec_path);
    }
    made?;
    tracing::info!(
        vm = %vm,
        disk = %path.display(),
        image = %disk.image.sha256,
        size_gib = disk.size_gib,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "boot disk created"
    );
    Ok(path)
}

/// `qemu-img create` under a temporary name, renamed to `DIR/disk.qcow2`.
fn make_overlay(
    qemu_img: &Path,
    dir: &Path,
    disk: &DiskSpec,
    image_path: &Path,
) -> Result<(), ImageError> {
    let path = dir.join(DISK_FILE);
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| ImageError::Io { path: p, source }
    };
    let backing = fs::canonicalize(image_path).map_err(io(image_path))?;
    let virtual_size = image_virtual_size(qemu_img, &backing, disk)?;
    let disk_bytes = disk.size_gib.saturating_mul(super::GIB);
    if disk_bytes < virtual_size {
        // qemu-img would make the smaller disk without a word, cutting the guest's file
        // systems short.
        return Err(ImageError::Disk(format!(
            "a {} GiB disk cannot hold the image, whose disk is {virtual_size} bytes ({:.1} GiB)",
            disk.size_gib,
            virtual_size as f64 / super::GIB as f64
        )));
    }
    let tmp = dir.join(DISK_TMP_FILE);
    let _ = fs::remove_file(&tmp);
    let out = Command::new(qemu_img)
        .args(["create", "-q", "-f", "qcow2", "-b"])
        .arg(&backing)
        .args(["-F", disk.image.image_type.as_str()])
        .arg(&tmp)
        .arg(format!("{}G", disk.size_gib))
        .output()
        .map_err(|e| {
            ImageError::Disk(format!(
                "running {}: {e} (is qemu-utils installed?)",
                qemu_img.display()
            ))
        })?;
    if !out.status.success() {
        let _ = fs::remove_file(&tmp);
        return Err(ImageError::Disk(format!(
            "qemu-img create failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    if let Ok(f) = fs::File::open(&tmp) {
        let _ = f.sync_all();
    }
    fs::rename(&tmp, &path).map_err(io(&path))?;
    super::cache::sync_dir(dir);
    Ok(())
}

/// The size of the disk an image holds (`qemu-img info`), read as the declared type
/// only. A qcow2 image that names a backing file of its own is refused: QEMU would open
/// that path on this node for the guest.
fn image_virtual_size(qemu_img: &Path, image: &Path, disk: &DiskSpec) -> Result<u64, ImageError> {
    let out = Command::new(qemu_img)
        .args([
            "info",
            "--output=json",
            "-f",
            disk.image.image_type.as_str(),
        ])
        .arg(image)
        .output()
        .map_err(|e| {
            ImageError::Disk(format!(
                "running {}: {e} (is qemu-utils installed?)",
                qemu_img.display()
            ))
        })?;
    if !out.status.success() {
        return Err(ImageError::Disk(format!(
            "the image is not a readable {} file: {}",
            disk.image.image_type.as_str(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let info: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| ImageError::Disk(format!("qemu-img info answered unreadable JSON: {e}")))?;
    if info.get("backing-filename").is_some() {
        return Err(ImageError::Disk(
            "the image names a backing file of its own; images must be self-contained".into(),
        ));
    }
    info.get("virtual-size")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| ImageError::Disk("qemu-img info gave no virtual size".into()))
}

/// Deletes the VM's disk, its record and console, then its directory if nothing else is
/// left there. A disk that is not there is already deleted.
pub fn delete_disk(state_dir: &Path, vm: VmId) -> Result<(), ImageError> {
    let dir = vm_dir(state_dir, vm);
    for name in [DISK_FILE, DISK_TMP_FILE, DISK_SPEC_FILE]
        .iter()
        .chain(VM_FILES)
    {
        let p = dir.join(name);
        // The scratch file of a record written with `write_json`, where there is one.
        let _ = fs::remove_file(crate::state::scratch_path(&p));
        match fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(ImageError::Io { path: p, source }),
        }
    }
    // Fails (and is left) when not empty: another file there is not ours to delete.
    let _ = fs::remove_dir(&dir);
    Ok(())
}

/// The images the disks on this node are built on.
pub fn images_in_use(state_dir: &Path) -> HashSet<Sha256> {
    let Ok(rd) = fs::read_dir(state_dir.join("qemu")) else {
        return HashSet::new();
    };
    rd.flatten()
        .filter_map(|e| {
            let dir = e.path();
            // A record without a disk is a disk being made (or whose making failed):
            // counted, so the image is not evicted under it.
            let spec: DiskSpec = read_json(&dir.join(DISK_SPEC_FILE)).ok().flatten()?;
            Some(spec.image.sha256)
        })
        .collect()
}
