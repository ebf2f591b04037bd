//! PCI discovery: attribute files only, never `config` (reading config space can wake a
//! device from D3 or, on some hardware, upset it).

use super::{link_basename, read_attr};
use passage_model::pci::{PciClass, Revision, validate_driver};
use passage_model::{DevicePath, HexId, PciAddress, PciDevice};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// What a walk found: the functions it could describe, and for each one it could not,
/// `path: reason`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Discovery {
    pub devices: Vec<PciDevice>,
    pub skipped: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("cannot resolve sysfs root {path}: {source}")]
    Root { path: PathBuf, source: io::Error },
    #[error("cannot list {path}: {source}")]
    List { path: PathBuf, source: io::Error },
}

/// Walks `<root>/bus/pci/devices`. A tree that cannot be listed yields no devices and one
/// skipped entry saying why; callers that must tell "no devices" from "could not look"
/// use [`try_discover`].
pub fn discover(sysfs_root: &Path) -> Discovery {
    try_discover(sysfs_root).unwrap_or_else(|e| Discovery {
        devices: Vec::new(),
        skipped: vec![e.to_string()],
    })
}

pub fn try_discover(sysfs_root: &Path) -> Result<Discovery, DiscoveryError> {
    let root = fs::canonicalize(sysfs_root).map_err(|source| DiscoveryError::Root {
        path: sysfs_root.to_path_buf(),
        source,
    })?;
    let list = root.join("bus/pci/devices");
    let entries = fs::read_dir(&list).map_err(|source| DiscoveryError::List {
        path: list.clone(),
        source,
    })?;
    let mut out = Discovery::default();
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                out.skipped.push(format!("{}: {e}", list.display()));
                continue;
            }
        };
        let path = entry.path();
        match describe(&root, &path) {
            Ok(d) => out.devices.push(d),
            Err(reason) => out.skipped.push(format!("{}: {reason}", path.display())),
        }
    }
    out.devices.sort_by_key(|d| d.address());
    out.devices.dedup_by_key(|d| d.address());
    out.skipped.sort();
    Ok(out)
}

fn describe(root: &Path, link: &Path) -> Result<PciDevice, String> {
    let name = link
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let addr: PciAddress = name.parse().map_err(|e| format!("{e}"))?;
    // canonicalize reports loops (ELOOP) and dangling links as errors, which is what we want.
    let real = fs::canonicalize(link).map_err(|e| format!("cannot resolve: {e}"))?;
    let rel = real
        .strip_prefix(root)
        .map_err(|_| format!("resolves to {} outside the sysfs root", real.display()))?;
    let id: DevicePath = format!("/{}", rel.to_string_lossy())
        .parse()
        .map_err(|e| format!("{e}"))?;
    if id.address() != addr {
        return Err(format!("resolves to {id}, another function"));
    }
    let attr = |file: &str| -> Result<String, String> {
        read_attr(&real.join(file)).map_err(|e| format!("{file}: {e}"))
    };
    let hex = |file: &str| -> Result<HexId, String> {
        attr(file)?.parse().map_err(|e| format!("{file}: {e}"))
    };
    let vendor = hex("vendor")?;
    let device = hex("device")?;
    let subvendor = hex("subsystem_vendor")?;
    let subsystem = hex("subsystem_device")?;
    let revision: Revision = attr("revision")?
        .parse()
        .map_err(|e| format!("revision: {e}"))?;
    let class: PciClass = attr("class")?.parse().map_err(|e| format!("class: {e}"))?;
    let numa_node = numa(&real)?;
    let driver = link_basename(&real.join("driver")).map_err(|e| format!("driver: {e}"))?;
    if let Some(d) = &driver {
        validate_driver(d).map_err(|e| format!("driver: {e}"))?;
    }
    let iommu_group =
        match link_basename(&real.join("iommu_group")).map_err(|e| format!("iommu_group: {e}"))? {
            None => None,
            Some(g) => Some(
                g.parse::<u32>()
                    .map_err(|_| format!("iommu_group: {g:?} is not a group number"))?,
            ),
        };
    Ok(PciDevice {
        id,
        vendor,
        device,
        subvendor,
        subsystem,
        revision,
        class,
        driver,
        numa_node,
        iommu_group,
    })
}

/// Kernels without NUMA support have no `numa_node`; -1 means "no affinity".
fn numa(dir: &Path) -> Result<Option<u32>, String> {
    let text = match read_attr(&dir.join("numa_node")) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("numa_node: {e}")),
    };
    let n: i64 = text
        .parse()
        .map_err(|_| format!("numa_node: {text:?} is not a number"))?;
    if n < 0 {
        Ok(None)
    } else {
        u32::try_from(n)
            .map(Some)
            .map_err(|_| format!("numa_node: {n} out of range"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{FakeSpec, generate};

    fn tree() -> (tempfile::TempDir, PathBuf, Discovery) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sys");
        generate(&root, &FakeSpec::default()).unwrap();
        let d = discover(&root);
        (dir, root, d)
    }

    fn dev_dir(root: &Path, d: &PciDevice) -> PathBuf {
        root.join(d.id.to_string().trim_start_matches('/'))
    }

    #[test]
    fn reads_a_generated_tree() {
        let (_dir, _root, d) = tree();
        assert!(d.skipped.is_empty(), "{:?}", d.skipped);
        let gpus: Vec<_> = d.devices.iter().filter(|x| x.class.is_gpu_like()).collect();
        assert_eq!(gpus.len(), 8);
        assert!(gpus.iter().all(|g| g.driver.as_deref() == Some("nvidia")));
        assert!(gpus.iter().all(|g| g.iommu_group.is_some()));
        assert_eq!(gpus.iter().filter(|g| g.numa_node == Some(1)).count(), 4);
        let mut sorted = d.devices.clone();
        sorted.sort_by_key(|x| x.address());
        assert_eq!(sorted, d.devices);
        let groups: std::collections::BTreeSet<_> =
            d.devices.iter().map(|x| x.iommu_group).collect();
        assert_eq!(groups.len(), d.devices.len());
    }

    #[test]
    fn bad_functions_are_skipped_not_fatal() {
        let (_dir, root, d) = tree();
        let (a, b, c) = (&d.devices[3], &d.devices[5], &d.devices[7]);
        fs::write(dev_dir(&root, a).join("vendor"), "0xzzzz\n").unwrap();
        fs::remove_file(dev_dir(&root, b).join("class")).unwrap();
        fs::write(dev_dir(&root, c).join("numa_node"), "-1\n").unwrap();
        let again = discover(&root);
        assert_eq!(again.devices.len(), d.devices.len() - 2);
        assert_eq!(again.skipped.len(), 2, "{:?}", again.skipped);
        assert!(again.skipped.iter().any(|s| s.contains("vendor")));
        assert!(again.skipped.iter().any(|s| s.contains("class")));
        let c2 = again.devices.iter().find(|x| x.id == c.id).unwrap();
        assert_eq!(c2.numa_node, None);
    }

    #[cfg(unix)]
    #[test]
    fn loops_and_escapes_are_refused() {
        let (dir, root, d) = tree();
        let list = root.join("bus/pci/devices");
        std::os::unix::fs::symlink("0000:00:1e.7", list.join("0000:00:1e.6")).unwrap();
        std::os::unix::fs::symlink("0000:00:1e.6", list.join("0000:00:1e.7")).unwrap();
        let outside = dir.path().join("devices/pci0000:00/0000:00:1d.0");
        fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, list.join("0000:00:1d.0")).unwrap();
        fs::write(list.join("garbage"), "").unwrap();
        let again = discover(&root);
        assert_eq!(again.devices, d.devices);
        assert_eq!(again.skipped.len(), 4, "{:?}", again.skipped);
        assert!(
            again
                .skipped
                .iter()
                .any(|s| s.contains("outside the sysfs root"))
        );
    }

    #[test]
    fn a_missing_root_is_reported() {
        let d = discover(Path::new("/nonexistent/passage/sys"));
        assert!(d.devices.is_empty());
        assert_eq!(d.skipped.len(), 1);
        assert!(try_discover(Path::new("/nonexistent/passage/sys")).is_err());
    }
}
