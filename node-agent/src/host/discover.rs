//! PCI discovery: attribute files only, never `config` (reading config space can wake a
//! device from D3 or, on some hardware, upset it).

use super::AttrDir;
use super::details::{self, Fixed, GroupCache, Known, Shared};
use passage_model::pci::{PciClass, Revision, validate_driver};
use passage_model::{DevicePath, HexId, PciAddress, PciDevice};
use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

/// What a walk found: the functions it could describe, and for each one it could not,
/// `path: reason`; `notes` are optional attributes it ignored (`path: reason`), whose
/// functions are still listed, without that detail.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Discovery {
    pub devices: Vec<PciDevice>,
    pub skipped: Vec<String>,
    pub notes: Vec<String>,
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
    Discoverer::default().discover(sysfs_root)
}

pub fn try_discover(sysfs_root: &Path) -> Result<Discovery, DiscoveryError> {
    Discoverer::default().try_discover(sysfs_root)
}

/// What a function's directory showed that cannot change while the directory exists.
#[derive(Clone, Debug)]
struct Cached {
    /// The directory's device and inode: the kernel makes a new directory (a new inode)
    /// when a function is removed and another appears at the same address.
    dev: u64,
    ino: u64,
    ids: Ids,
    fixed: Fixed,
}

#[derive(Clone, Copy, Debug)]
struct Ids {
    vendor: HexId,
    device: HexId,
    subvendor: HexId,
    subsystem: HexId,
    revision: Revision,
    class: PciClass,
    numa_node: Option<u32>,
}

/// Discovery that remembers, between passes, what cannot change while a function's
/// directory exists (ids, class, revision, NUMA node, names, maximum link, VF total),
/// and reads again only what can (driver, IOMMU group, current link, VF count, AER
/// counters). The agent keeps one for its whole run: each pass then costs about half the
/// system calls. A function whose directory was replaced is read in full again.
#[derive(Debug, Default)]
pub struct Discoverer {
    cache: std::sync::Mutex<HashMap<PathBuf, Cached>>,
}

impl Discoverer {
    pub fn new() -> Self {
        Self::default()
    }

    /// [`discover`] with this discoverer's memory.
    pub fn discover(&self, sysfs_root: &Path) -> Discovery {
        self.try_discover(sysfs_root).unwrap_or_else(|e| Discovery {
            skipped: vec![e.to_string()],
            ..Discovery::default()
        })
    }

    /// [`try_discover`] with this discoverer's memory.
    pub fn try_discover(&self, sysfs_root: &Path) -> Result<Discovery, DiscoveryError> {
        // Taken for the pass and replaced after it, so the workers read it without a
        // lock and functions that disappeared are forgotten. A pass running at the same
        // time on the same discoverer just starts cold.
        let prev = std::mem::take(&mut *self.lock());
        let (found, next) = walk_tree(sysfs_root, &prev)?;
        *self.lock() = next;
        Ok(found)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, Cached>> {
        // The map holds no invariant a panicking pass could break.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn walk_tree(
    sysfs_root: &Path,
    prev: &HashMap<PathBuf, Cached>,
) -> Result<(Discovery, HashMap<PathBuf, Cached>), DiscoveryError> {
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
    let mut paths = Vec::new();
    for entry in entries {
        match entry {
            Ok(e) => paths.push(e.path()),
            Err(e) => out.skipped.push(format!("{}: {e}", list.display())),
        }
    }
    let shared = Shared::load(&root, &mut out.notes);
    // Discovery is all small reads, each a system call; spread over a few threads it
    // finishes in a fraction of the time on a host with hundreds of functions.
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, MAX_WORKERS)
        .min(paths.len().div_ceil(MIN_PER_WORKER).max(1));
    let chunk = paths.len().div_ceil(workers).max(1);
    let parts: Vec<Part> = if workers == 1 {
        vec![walk(&root, &paths, &shared, prev)]
    } else {
        std::thread::scope(|scope| {
            let handles: Vec<_> = paths
                .chunks(chunk)
                .map(|c| {
                    let (root, shared) = (&root, &shared);
                    scope.spawn(move || walk(root, c, shared, prev))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| Part {
                        skipped: vec![format!("{}: a discovery worker panicked", list.display())],
                        ..Part::default()
                    })
                })
                .collect()
        })
    };
    let mut next = HashMap::new();
    for mut p in parts {
        out.devices.append(&mut p.devices);
        out.skipped.append(&mut p.skipped);
        out.notes.append(&mut p.notes);
        next.extend(p.cached);
    }
    out.devices.sort_by_key(|d| d.address());
    out.devices.dedup_by_key(|d| d.address());
    out.skipped.sort();
    out.notes.sort();
    out.notes.dedup();
    Ok((out, next))
}

/// Threads for one discovery pass, and the fewest functions worth a thread of their own.
const MAX_WORKERS: usize = 4;
const MIN_PER_WORKER: usize = 32;

/// What one worker found.
#[derive(Default)]
struct Part {
    devices: Vec<PciDevice>,
    skipped: Vec<String>,
    notes: Vec<String>,
    cached: Vec<(PathBuf, Cached)>,
}

fn walk(root: &Path, links: &[PathBuf], shared: &Shared, prev: &HashMap<PathBuf, Cached>) -> Part {
    let mut part = Part::default();
    let mut groups = GroupCache::default();
    for path in links {
        match describe(root, path, shared, prev, &mut groups, &mut part.notes) {
            Ok((d, real, cached)) => {
                part.devices.push(d);
                part.cached.push((real, cached));
            }
            Err(reason) => part.skipped.push(format!("{}: {reason}", path.display())),
        }
    }
    part
}

/// Where the `bus/pci/devices/<bdf>` link points, resolved without walking the path
/// component by component (`canonicalize` would cost a system call per component, for
/// each of hundreds of functions). The kernel's links are relative, one level, to a
/// directory under `devices/`; a target that climbs out of the root, or a second link
/// at the end (a loop, or a tree not shaped like sysfs), is refused.
fn resolve(root: &Path, link: &Path) -> Result<(PathBuf, fs::Metadata), String> {
    let target = fs::read_link(link).map_err(|e| format!("not a link to a device: {e}"))?;
    let base = link.parent().unwrap_or(root);
    let mut out = PathBuf::new();
    for c in base.join(&target).components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    if !out.starts_with(root) {
        return Err(format!(
            "resolves to {} outside the sysfs root",
            out.display()
        ));
    }
    let meta = fs::symlink_metadata(&out).map_err(|e| format!("cannot resolve: {e}"))?;
    if !meta.is_dir() {
        return Err(format!("resolves to {}, not a directory", out.display()));
    }
    Ok((out, meta))
}

fn describe(
    root: &Path,
    link: &Path,
    shared: &Shared,
    prev: &HashMap<PathBuf, Cached>,
    groups: &mut GroupCache,
    notes: &mut Vec<String>,
) -> Result<(PciDevice, PathBuf, Cached), String> {
    let name = link
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let addr: PciAddress = name.parse().map_err(|e| format!("{e}"))?;
    let (real, meta) = resolve(root, link)?;
    let rel = real
        .strip_prefix(root)
        .map_err(|_| format!("resolves to {} outside the sysfs root", real.display()))?;
    let id: DevicePath = format!("/{}", rel.to_string_lossy())
        .parse()
        .map_err(|e| format!("{e}"))?;
    if id.address() != addr {
        return Err(format!("resolves to {id}, another function"));
    }
    let dir = AttrDir::open(&real).map_err(|e| format!("cannot open: {e}"))?;
    use std::os::unix::fs::MetadataExt;
    let (dev, ino) = (meta.dev(), meta.ino());
    let remembered = prev
        .get(&real)
        .filter(|c| c.dev == dev && c.ino == ino)
        .cloned();
    let ids = match &remembered {
        Some(c) => c.ids,
        None => read_ids(&dir)?,
    };
    let driver = dir
        .link_basename("driver")
        .map_err(|e| format!("driver: {e}"))?;
    if let Some(d) = &driver {
        validate_driver(d).map_err(|e| format!("driver: {e}"))?;
    }
    let iommu_group = match dir
        .link_basename("iommu_group")
        .map_err(|e| format!("iommu_group: {e}"))?
    {
        None => None,
        Some(g) => Some(
            g.parse::<u32>()
                .map_err(|_| format!("iommu_group: {g:?} is not a group number"))?,
        ),
    };
    let known = Known {
        addr,
        parents: id.parents(),
        vendor: ids.vendor,
        device: ids.device,
        class: ids.class,
        iommu_group,
    };
    let fixed = match remembered {
        Some(c) => c.fixed,
        None => details::read_fixed(&dir, &known),
    };
    let details = details::collect(root, &dir, &known, &fixed, shared, groups, notes);
    let device = PciDevice {
        details: Some(details),
        id,
        vendor: ids.vendor,
        device: ids.device,
        subvendor: ids.subvendor,
        subsystem: ids.subsystem,
        revision: ids.revision,
        class: ids.class,
        driver,
        numa_node: ids.numa_node,
        iommu_group,
    };
    let cached = Cached {
        dev,
        ino,
        ids,
        fixed,
    };
    Ok((device, real, cached))
}

/// The attributes every function must have, parsed.
fn read_ids(dir: &AttrDir) -> Result<Ids, String> {
    let attr = |file: &str| -> Result<String, String> {
        dir.read(file).map_err(|e| format!("{file}: {e}"))
    };
    let hex = |file: &str| -> Result<HexId, String> {
        attr(file)?.parse().map_err(|e| format!("{file}: {e}"))
    };
    Ok(Ids {
        vendor: hex("vendor")?,
        device: hex("device")?,
        subvendor: hex("subsystem_vendor")?,
        subsystem: hex("subsystem_device")?,
        revision: attr("revision")?
            .parse()
            .map_err(|e| format!("revision: {e}"))?,
        class: attr("class")?.parse().map_err(|e| format!("class: {e}"))?,
        numa_node: numa(dir)?,
    })
}

/// Kernels without NUMA support have no `numa_node`; -1 means "no affinity".
fn numa(dir: &AttrDir) -> Result<Option<u32>, String> {
    let text = match dir.read("numa_node") {
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
    fn a_discoverer_remembers_only_what_cannot_change() {
        let (_dir, root, cold) = tree();
        let disc = Discoverer::new();
        assert_eq!(disc.discover(&root), cold);
        assert_eq!(disc.discover(&root), cold, "a warm pass sees the same");

        // What can change is read on every pass.
        let gpu = cold.devices.iter().find(|d| d.class.is_gpu_like()).unwrap();
        let dir = dev_dir(&root, gpu);
        fs::write(dir.join("current_link_speed"), "2.5 GT/s PCIe\n").unwrap();
        fs::write(dir.join("aer_dev_fatal"), "TLP 1\nTOTAL_ERR_FATAL 1\n").unwrap();
        let warm = disc.discover(&root);
        let g = warm.devices.iter().find(|d| d.id == gpu.id).unwrap();
        let details = g.details.as_ref().unwrap();
        assert_eq!(details.current_link_speed.as_deref(), Some("2.5 GT/s PCIe"));
        assert_eq!(details.aer_fatal, Some(1));

        // A fixed attribute edited in place is not re-read (a kernel never does this)...
        fs::write(dir.join("device"), "0x1db4\n").unwrap();
        let warm = disc.discover(&root);
        let g = warm.devices.iter().find(|d| d.id == gpu.id).unwrap();
        assert_eq!(g.device, gpu.device);
        // ...but a replaced directory (a new function at the address) is read in full.
        let moved = dir.with_extension("old");
        fs::rename(&dir, &moved).unwrap();
        fs::create_dir(&dir).unwrap();
        for e in fs::read_dir(&moved).unwrap() {
            let e = e.unwrap();
            let to = dir.join(e.file_name());
            if e.file_type().unwrap().is_symlink() {
                std::os::unix::fs::symlink(fs::read_link(e.path()).unwrap(), to).unwrap();
            } else if e.file_type().unwrap().is_file() {
                fs::copy(e.path(), to).unwrap();
            }
        }
        let warm = disc.discover(&root);
        let g = warm.devices.iter().find(|d| d.id == gpu.id).unwrap();
        assert_eq!(g.device.to_string(), "1db4");
        assert_eq!(
            g.details.as_ref().unwrap().device_name.as_deref(),
            Some("GV100GL [Tesla V100 PCIe 16GB]")
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
