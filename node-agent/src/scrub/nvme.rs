//! Wiping an NVMe controller's namespaces of what would make the host act on a tenant's
//! data: partition tables (MBR and GPT, primary and backup) and ZFS labels.
//!
//! Where those live: MBR and the primary GPT in the first sectors; the backup GPT in the
//! last ones; ZFS labels L0 and L1 at 0 and 256 KiB, L2 and L3 in the last 512 KiB of
//! the size rounded down to 256 KiB (so within the last 768 KiB). Zeroing the first and
//! the last MiB of each namespace covers them all; the same for each partition the
//! kernel shows, because a pool made on a partition (ZFS's own whole-disk layout) has
//! its labels relative to the partition, and a stale partition node would expose them.

use super::Outcome;
use crate::host::read_attr;
use std::fs::{self, File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;
const SECTOR: u64 = 512;

/// A namespace: its sysfs directory and the name of its block device.
#[derive(Debug)]
struct Namespace {
    sysfs: PathBuf,
    name: String,
}

pub(super) fn wipe_labels(dev_dir: &Path, function_dir: &Path) -> Outcome {
    let namespaces = match namespaces(function_dir) {
        Ok(n) => n,
        Err(e) => return Outcome::Failed(format!("listing namespaces: {e}")),
    };
    if namespaces.is_empty() {
        return Outcome::Done(Some("no namespaces".to_string()));
    }
    let mut wiped = Vec::new();
    for ns in &namespaces {
        if let Err(e) = wipe(dev_dir, ns) {
            return Outcome::Failed(format!("{}: {e}", ns.name));
        }
        wiped.push(ns.name.as_str());
    }
    Outcome::Done(Some(format!("wiped {}", wiped.join(", "))))
}

/// `nvme<digits>`.
fn is_controller(name: &str) -> bool {
    name.strip_prefix("nvme")
        .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}

/// The block device of a namespace entry: `nvme0n1` itself, or for the hidden path
/// device of native multipath, `nvme<subsys>c<ctrl>n<ns>`, its head `nvme<subsys>n<ns>`
/// (the one with a device node).
fn block_device(entry: &str) -> Option<String> {
    let rest = entry.strip_prefix("nvme")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (before, ns) = rest.split_once('n')?;
    if !digits(ns) {
        return None;
    }
    let subsys = match before.split_once('c') {
        Some((subsys, ctrl)) if digits(subsys) && digits(ctrl) => subsys,
        None if digits(before) => before,
        _ => return None,
    };
    Some(format!("nvme{subsys}n{ns}"))
}

fn namespaces(function_dir: &Path) -> std::io::Result<Vec<Namespace>> {
    let mut found: Vec<Namespace> = Vec::new();
    let controllers = match fs::read_dir(function_dir.join("nvme")) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(e),
    };
    for ctrl in controllers {
        let ctrl = ctrl?;
        if !is_controller(&ctrl.file_name().to_string_lossy()) {
            continue;
        }
        for entry in fs::read_dir(ctrl.path())? {
            let entry = entry?;
            let Some(name) = block_device(&entry.file_name().to_string_lossy()) else {
                continue;
            };
            if !found.iter().any(|n| n.name == name) {
                found.push(Namespace {
                    sysfs: entry.path(),
                    name,
                });
            }
        }
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(found)
}

fn sectors(path: &Path) -> Result<u64, String> {
    let text = read_attr(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    text.parse::<u64>()
        .map_err(|_| format!("{} is not a sector count: {text:?}", path.display()))
}

fn bytes(path: &Path) -> Result<u64, String> {
    sectors(path)?
        .checked_mul(SECTOR)
        .ok_or_else(|| format!("{} is too large", path.display()))
}

/// The byte ranges to zero in a region of `len` bytes at `start`: its first and last MiB,
/// or all of it when it is smaller than that.
fn ends(start: u64, len: u64) -> Vec<(u64, u64)> {
    if len < 2 * MIB {
        vec![(start, len)]
    } else {
        vec![(start, MIB), (start + len - MIB, MIB)]
    }
}

/// The partitions the kernel found on the namespace, as (start, length) in bytes.
fn partitions(ns: &Namespace, size: u64) -> Result<Vec<(u64, u64)>, String> {
    let mut parts = Vec::new();
    let Ok(entries) = fs::read_dir(&ns.sysfs) else {
        return Ok(parts);
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_part = entry.file_name().to_str().is_some_and(|n| {
            n.rsplit_once('p').is_some_and(|(base, num)| {
                base.starts_with("nvme")
                    && !num.is_empty()
                    && num.bytes().all(|b| b.is_ascii_digit())
            })
        });
        if !is_part || !path.join("start").is_file() {
            continue;
        }
        let start = bytes(&path.join("start"))?;
        let len = bytes(&path.join("size"))?;
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(format!(
                "partition {} lies beyond the namespace's {size} bytes",
                path.display()
            ));
        }
        parts.push((start, len));
    }
    Ok(parts)
}

fn wipe(dev_dir: &Path, ns: &Namespace) -> Result<(), String> {
    let size = bytes(&ns.sysfs.join("size"))?;
    let mut ranges = ends(0, size);
    for (start, len) in partitions(ns, size)? {
        ranges.extend(ends(start, len));
    }
    let node = dev_dir.join(&ns.name);
    let mut file = open_exclusive(&node)?;
    check_identity(&file, &node, ns)?;
    let actual = file
        .seek(SeekFrom::End(0))
        .map_err(|e| format!("sizing {}: {e}", node.display()))?;
    if actual != size {
        return Err(format!(
            "{} has {actual} bytes but sysfs says {size}; not writing to it",
            node.display()
        ));
    }
    let zeros = vec![0u8; MIB as usize];
    for (start, len) in ranges {
        let mut at = start;
        let end = start + len;
        while at < end {
            let n = (end - at).min(MIB) as usize;
            file.write_all_at(&zeros[..n], at)
                .map_err(|e| format!("writing {} at {at}: {e}", node.display()))?;
            at += n as u64;
        }
    }
    file.sync_all()
        .map_err(|e| format!("flushing {}: {e}", node.display()))
}

/// Opens the node for writing, never creating it. `O_EXCL` on a block device fails with
/// `EBUSY` while anything on the host holds it (a mounted file system, md, device
/// mapper, an imported pool): such a namespace is in use by the host and is not wiped.
fn open_exclusive(node: &Path) -> Result<File, String> {
    let excl = rustix::fs::OFlags::EXCL.bits() as i32;
    OpenOptions::new()
        .write(true)
        .custom_flags(excl)
        .open(node)
        .map_err(|e| match e.raw_os_error() {
            Some(code) if rustix::io::Errno::from_raw_os_error(code) == rustix::io::Errno::BUSY => {
                format!(
                    "{} is in use on the host (mounted or held); not wiped",
                    node.display()
                )
            }
            _ => format!("opening {}: {e}", node.display()),
        })
}

/// A block device node must be the namespace sysfs names (`dev` is `major:minor`), so a
/// renamed or stale node never sends the zeros to another disk.
fn check_identity(file: &File, node: &Path, ns: &Namespace) -> Result<(), String> {
    let meta = file
        .metadata()
        .map_err(|e| format!("inspecting {}: {e}", node.display()))?;
    if !meta.file_type().is_block_device() {
        return Ok(());
    }
    let dev = read_attr(&ns.sysfs.join("dev"))
        .map_err(|e| format!("reading {}/dev: {e}", ns.sysfs.display()))?;
    let rdev = meta.rdev();
    let actual = format!("{}:{}", rustix::fs::major(rdev), rustix::fs::minor(rdev));
    if actual != dev {
        return Err(format!(
            "{} is device {actual}, but the namespace is {dev}",
            node.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_block_devices() {
        assert_eq!(block_device("nvme0n1").as_deref(), Some("nvme0n1"));
        assert_eq!(block_device("nvme2c5n3").as_deref(), Some("nvme2n3"));
        for bad in [
            "nvme0",
            "nvme0n",
            "nvmeXn1",
            "nvme0n1p1",
            "power",
            "nvme0c0n",
            "nvme0cn1",
            "nvme0n1/../x",
        ] {
            assert_eq!(block_device(bad), None, "{bad}");
        }
        assert!(is_controller("nvme12"));
        assert!(!is_controller("nvme") && !is_controller("nvme0n1"));
    }

    #[test]
    fn ends_never_pass_the_region() {
        assert_eq!(ends(0, 1000), vec![(0, 1000)]);
        assert_eq!(ends(0, 2 * MIB), vec![(0, MIB), (MIB, MIB)]);
        assert_eq!(
            ends(4096, 3 * MIB),
            vec![(4096, MIB), (4096 + 2 * MIB, MIB)]
        );
        assert_eq!(ends(0, 0), vec![(0, 0)]);
    }
}
