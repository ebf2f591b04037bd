//! PCI discovery: attribute files only, never `config` (reading config space can wake a
//! device from D3 or, on some hardware, upset it).

use super::details::{self, Fixed, Kept, Known, Shared, SlotMemory};
use super::{AttrDir, FdBudget};
use passage_model::pci::{MAX_GROUP_MEMBERS, PciClass, Revision, validate_driver};
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
    Discoverer::one_shot().discover(sysfs_root)
}

pub fn try_discover(sysfs_root: &Path) -> Result<Discovery, DiscoveryError> {
    Discoverer::one_shot().try_discover(sysfs_root)
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
    kept: Kept,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Ids {
    pub(crate) vendor: HexId,
    device: HexId,
    subvendor: HexId,
    subsystem: HexId,
    revision: Revision,
    pub(crate) class: PciClass,
    pub(crate) numa_node: Option<u32>,
}

/// Discovery that remembers, between passes, what cannot change while a function's
/// directory exists (ids, class, revision, NUMA node, names, maximum link, VF total),
/// and reads again only what can (driver, IOMMU group, current link, VF count, AER
/// counters). The agent keeps one for its whole run: each pass then costs about half the
/// system calls. A function whose directory was replaced is read in full again. It also
/// remembers each PCI slot's address per slot directory (see [`SlotMemory`]); the slots
/// directory itself is listed on every pass, so slots that come and go are seen.
///
/// It holds the attributes read on every pass open between passes (current link speed
/// and width, AER counters, VF count: a `pread` each instead of open, read and close),
/// up to a share of the process's open-file limit (see [`FdBudget::from_rlimit`]):
/// 4096 descriptors at most, four per function (five with SR-IOV); the agent's systemd
/// unit raises the limit for that. The one-shot [`discover`] keeps none.
#[derive(Debug)]
pub struct Discoverer {
    memory: std::sync::Mutex<Memory>,
    keep_open: bool,
    /// Asked for MIG mode on passes that found a GPU hosting vGPUs (and only then).
    nvidia_smi: super::NvidiaSmi,
}

impl Default for Discoverer {
    fn default() -> Self {
        Self::new()
    }
}

/// What a [`Discoverer`] keeps from one pass to the next.
#[derive(Debug, Default)]
struct Memory {
    functions: HashMap<PathBuf, Cached>,
    slots: SlotMemory,
}

impl Discoverer {
    pub fn new() -> Self {
        Discoverer {
            memory: Default::default(),
            keep_open: true,
            nvidia_smi: super::NvidiaSmi::Auto,
        }
    }

    /// Where MIG mode comes from (default [`super::NvidiaSmi::Auto`]).
    pub fn with_nvidia_smi(mut self, smi: super::NvidiaSmi) -> Self {
        self.nvidia_smi = smi;
        self
    }

    /// For a single pass: nothing is kept open for a next one.
    fn one_shot() -> Self {
        Discoverer {
            memory: Default::default(),
            keep_open: false,
            nvidia_smi: super::NvidiaSmi::Auto,
        }
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
        let budget = if self.keep_open {
            FdBudget::from_rlimit()
        } else {
            FdBudget::none()
        };
        let threads = cpus().clamp(1, MAX_WORKERS);
        let (mut found, next) = walk_tree(sysfs_root, &prev, &budget, threads)?;
        fill_mig_modes(sysfs_root, &self.nvidia_smi, &mut found);
        *self.lock() = next;
        Ok(found)
    }

    /// Reads again only the functions at `addrs` (those a task just rebound), with this
    /// discoverer's memory, which keeps every other function's: `before` with those
    /// functions as they are now. A whole pass over a GPU node's few dozen functions
    /// after every bind and unbind was the largest part of a simulated fleet's agent
    /// work. `None` where only a whole pass can say what the node has: a function gone
    /// or unreadable, one that moved to another IOMMU group (its members are read with
    /// the whole tree), or one hosting vGPUs (MIG mode comes with a whole pass).
    pub fn try_rediscover(
        &self,
        sysfs_root: &Path,
        addrs: &[PciAddress],
        before: &[PciDevice],
    ) -> Result<Option<Vec<PciDevice>>, DiscoveryError> {
        Ok(self
            .reread(sysfs_root, addrs)?
            .and_then(|read| merge_reread(before, read)))
    }

    /// The functions at `addrs` as they are now, read alone with this discoverer's
    /// memory, for [`merge_reread`] into the inventory they belong to; `None` where one
    /// is gone or unreadable (only a whole pass can say what the node has). Apart from
    /// the merge so that a task's own thread reads its functions right after changing
    /// them, and the merge is done against whatever inventory is the latest by then.
    pub fn reread(
        &self,
        sysfs_root: &Path,
        addrs: &[PciAddress],
    ) -> Result<Option<Vec<PciDevice>>, DiscoveryError> {
        let root = fs::canonicalize(sysfs_root).map_err(|source| DiscoveryError::Root {
            path: sysfs_root.to_path_buf(),
            source,
        })?;
        let list = root.join("bus/pci/devices");
        let list_dir = AttrDir::open(&list).map_err(|source| DiscoveryError::List {
            path: list.clone(),
            source,
        })?;
        let budget = if self.keep_open {
            FdBudget::from_rlimit()
        } else {
            FdBudget::none()
        };
        // Held for the few functions' reads: tasks of one node re-reading at once take
        // turns instead of each starting cold (a whole pass takes the memory out).
        let mut memory = self.lock();
        let mut notes = Vec::new();
        let (shared, slots) = Shared::load(&root, &memory.slots, &mut notes);
        let names: Vec<std::ffi::OsString> = addrs.iter().map(|a| a.to_string().into()).collect();
        let part = walk(
            &Walk {
                root: &root,
                list: &list_dir,
                shared: &shared,
                prev: &memory.functions,
                budget: &budget,
            },
            &names,
        );
        memory.slots = slots;
        memory.functions.extend(part.cached);
        let sound = part.skipped.is_empty() && part.devices.len() == addrs.len();
        Ok(sound.then_some(part.devices))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Memory> {
        // The maps hold no invariant a panicking pass could break.
        self.memory.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// `before` with the functions [`Discoverer::reread`] read in place of their old
/// selves; `None` where only a whole pass can say what the node has: a function not in
/// `before`, one that moved to another IOMMU group (its members are read with the whole
/// tree), or one hosting vGPUs (MIG mode comes with a whole pass).
pub fn merge_reread(before: &[PciDevice], read: Vec<PciDevice>) -> Option<Vec<PciDevice>> {
    let mut now = before.to_vec();
    for mut d in read {
        let old = now.iter_mut().find(|o| o.id == d.id)?;
        let members = old.details.as_ref().map(|x| x.iommu_group_members.clone());
        match (d.details.as_mut(), members) {
            (Some(x), Some(members)) if old.iommu_group == d.iommu_group && x.vgpu.is_none() => {
                x.iommu_group_members = members;
            }
            _ => return None,
        }
        *old = d;
    }
    Some(now)
}

fn walk_tree(
    sysfs_root: &Path,
    prev: &Memory,
    budget: &FdBudget,
    threads: usize,
) -> Result<(Discovery, Memory), DiscoveryError> {
    let root = fs::canonicalize(sysfs_root).map_err(|source| DiscoveryError::Root {
        path: sysfs_root.to_path_buf(),
        source,
    })?;
    let list = root.join("bus/pci/devices");
    let list_err = |source| DiscoveryError::List {
        path: list.clone(),
        source,
    };
    let entries = fs::read_dir(&list).map_err(list_err)?;
    // The links are read relative to the listed directory: one path component each.
    let list_dir = AttrDir::open(&list).map_err(list_err)?;
    let mut out = Discovery::default();
    let mut names = Vec::new();
    for entry in entries {
        match entry {
            Ok(e) => names.push(e.file_name()),
            Err(e) => out.skipped.push(format!("{}: {e}", list.display())),
        }
    }
    let (shared, slots) = Shared::load(&root, &prev.slots, &mut out.notes);
    let ctx = Walk {
        root: &root,
        list: &list_dir,
        shared: &shared,
        prev: &prev.functions,
        budget,
    };
    // Discovery is all small reads, each a system call; spread over a few threads it
    // finishes in a fraction of the time on a host with hundreds of functions. The
    // calling thread takes the first share itself.
    let workers = threads
        .max(1)
        .min(names.len().div_ceil(MIN_PER_WORKER).max(1));
    let chunk = names.len().div_ceil(workers).max(1);
    let parts: Vec<Part> = if workers == 1 {
        vec![walk(&ctx, &names)]
    } else {
        std::thread::scope(|scope| {
            let mut chunks = names.chunks(chunk);
            let first = chunks.next().unwrap_or_default();
            let handles: Vec<_> = chunks
                .map(|c| {
                    let ctx = &ctx;
                    scope.spawn(move || walk(ctx, c))
                })
                .collect();
            let mut parts = vec![walk(&ctx, first)];
            parts.extend(handles.into_iter().map(|h| {
                h.join().unwrap_or_else(|_| Part {
                    skipped: vec![format!("{}: a discovery worker panicked", list.display())],
                    ..Part::default()
                })
            }));
            parts
        })
    };
    let mut next = Memory {
        functions: HashMap::with_capacity(names.len()),
        slots,
    };
    let mut groups: HashMap<u32, Vec<PciAddress>> = HashMap::new();
    for mut p in parts {
        out.devices.append(&mut p.devices);
        out.skipped.append(&mut p.skipped);
        out.notes.append(&mut p.notes);
        next.functions.extend(p.cached);
        for (group, addr) in p.grouped {
            groups.entry(group).or_default().push(addr);
        }
    }
    out.devices.sort_by_key(|d| d.address());
    out.devices.dedup_by_key(|d| d.address());
    fill_group_members(&root, &mut out, groups);
    out.skipped.sort();
    out.notes.sort();
    out.notes.dedup();
    Ok((out, next))
}

/// Asks `nvidia-smi` for MIG mode once per pass, and only when a GPU hosts vGPUs: a
/// host without vGPU software never runs it.
fn fill_mig_modes(root: &Path, smi: &super::NvidiaSmi, out: &mut Discovery) {
    let hosts = || {
        out.devices
            .iter()
            .any(|d| d.details.as_ref().is_some_and(|x| x.vgpu.is_some()))
    };
    if !hosts() {
        return;
    }
    let modes = smi.mig_modes(root, &mut out.notes);
    for d in &mut out.devices {
        let addr = d.address();
        if let Some(v) = d.details.as_mut().and_then(|x| x.vgpu.as_mut()) {
            v.mig_mode = modes.get(&addr).copied();
        }
    }
}

/// Gives every function the members of its IOMMU group: the functions of this pass
/// whose `iommu_group` link names the same group, skipped ones included. The kernel
/// makes a device's `iommu_group` link and its entry in the group's `devices/` together
/// (`iommu_group_add_device`) and removes both together, so this is the group's listing
/// without listing it (an open, an `fstat`, two `getdents` and a close per group per
/// pass: a sixth of a warm pass's system calls on the benchmark's tree). It differs only for members that are not PCI functions (a
/// platform device sharing a group on some ARM systems), which the field, a list of PCI
/// addresses, could not name anyway.
fn fill_group_members(root: &Path, out: &mut Discovery, mut groups: HashMap<u32, Vec<PciAddress>>) {
    for members in groups.values_mut() {
        members.sort();
        members.dedup();
    }
    for d in &mut out.devices {
        let (Some(g), Some(details)) = (d.iommu_group, d.details.as_mut()) else {
            continue;
        };
        let Some(members) = groups.get(&g) else {
            continue;
        };
        if members.len() > MAX_GROUP_MEMBERS {
            out.notes.push(format!(
                "{}: more than {MAX_GROUP_MEMBERS} members",
                root.join(format!("kernel/iommu_groups/{g}")).display()
            ));
        } else {
            details.iommu_group_members = members.clone();
        }
    }
}

/// Threads for one discovery pass, and the fewest functions worth a thread of their own:
/// starting and joining a thread costs about as much as reading a few dozen functions,
/// so a node with a GPU or eight and their bridges (about 33) reads them on one.
const MAX_WORKERS: usize = 4;
const MIN_PER_WORKER: usize = 64;

/// The CPUs this process may use, read once: `available_parallelism` reads the cgroup's
/// quota files on every call, and a server simulating a fleet makes hundreds of passes
/// a second.
fn cpus() -> usize {
    static CPUS: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
    });
    *CPUS
}

/// What every worker of a pass shares.
struct Walk<'a> {
    root: &'a Path,
    /// `bus/pci/devices`, opened for lookups.
    list: &'a AttrDir,
    shared: &'a Shared,
    prev: &'a HashMap<PathBuf, Cached>,
    budget: &'a FdBudget,
}

/// What one worker found.
#[derive(Default)]
struct Part {
    devices: Vec<PciDevice>,
    skipped: Vec<String>,
    notes: Vec<String>,
    cached: Vec<(PathBuf, Cached)>,
    /// (IOMMU group, function) for every function whose group link was read.
    grouped: Vec<(u32, PciAddress)>,
}

fn walk(ctx: &Walk<'_>, names: &[std::ffi::OsString]) -> Part {
    let mut part = Part::default();
    for name in names {
        match describe(ctx, name, &mut part) {
            Ok((d, real, cached)) => {
                part.devices.push(d);
                part.cached.push((real, cached));
            }
            Err(reason) => part.skipped.push(format!(
                "{}: {reason}",
                ctx.list.path().join(name).display()
            )),
        }
    }
    part
}

/// Where the `bus/pci/devices/<bdf>` link points, resolved without walking the path
/// component by component (`canonicalize` would cost a system call per component, for
/// each of hundreds of functions), and that directory opened. The kernel's links are
/// relative, one level, to a directory under `devices/`; a target that climbs out of the
/// root, or a second link at the end (a loop, or a tree not shaped like sysfs), is
/// refused.
fn resolve(ctx: &Walk<'_>, name: &std::ffi::OsStr) -> Result<(PathBuf, AttrDir), String> {
    let target = ctx
        .list
        .read_link(name)
        .map_err(|e| format!("not a link to a device: {e}"))?;
    let mut out = PathBuf::new();
    for c in ctx.list.path().join(&target).components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    if !out.starts_with(ctx.root) {
        return Err(format!(
            "resolves to {} outside the sysfs root",
            out.display()
        ));
    }
    match AttrDir::open_dir_nofollow(&out) {
        Ok(dir) => Ok((out, dir)),
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NOTDIR.raw_os_error()) => {
            Err(format!("resolves to {}, not a directory", out.display()))
        }
        Err(e) => Err(format!("cannot resolve: {e}")),
    }
}

fn describe(
    ctx: &Walk<'_>,
    name: &std::ffi::OsStr,
    part: &mut Part,
) -> Result<(PciDevice, PathBuf, Cached), String> {
    let addr: PciAddress = name.to_string_lossy().parse().map_err(|e| format!("{e}"))?;
    let (real, dir) = resolve(ctx, name)?;
    let rel = real
        .strip_prefix(ctx.root)
        .map_err(|_| format!("resolves to {} outside the sysfs root", real.display()))?;
    let id: DevicePath = format!("/{}", rel.to_string_lossy())
        .parse()
        .map_err(|e| format!("{e}"))?;
    if id.address() != addr {
        return Err(format!("resolves to {id}, another function"));
    }
    // The group first: a function skipped below for a bad attribute is still a member
    // of its group, and its group-mates list it.
    let iommu_group = dir
        .link_basename("iommu_group")
        .map_err(|e| format!("iommu_group: {e}"))
        .and_then(|g| match g {
            None => Ok(None),
            Some(g) => g
                .parse::<u32>()
                .map(Some)
                .map_err(|_| format!("iommu_group: {g:?} is not a group number")),
        });
    if let Ok(Some(g)) = iommu_group {
        part.grouped.push((g, addr));
    }
    let (dev, ino) = dir.dev_ino().map_err(|e| format!("cannot open: {e}"))?;
    let remembered = ctx
        .prev
        .get(&real)
        .filter(|c| c.dev == dev && c.ino == ino)
        .cloned();
    let (ids, fixed, mut kept) = match remembered {
        Some(c) => (c.ids, Some(c.fixed), c.kept),
        None => (read_ids(&dir)?, None, Kept::default()),
    };
    let driver = dir
        .link_basename("driver")
        .map_err(|e| format!("driver: {e}"))?;
    if let Some(d) = &driver {
        validate_driver(d).map_err(|e| format!("driver: {e}"))?;
    }
    let iommu_group = iommu_group?;
    let known = Known {
        addr,
        parents: id.parents(),
        vendor: ids.vendor,
        device: ids.device,
        class: ids.class,
    };
    let fixed = fixed.unwrap_or_else(|| details::read_fixed(&dir, &known));
    let details = details::collect(
        &dir,
        &known,
        &fixed,
        ctx.shared,
        &mut kept,
        ctx.budget,
        &mut part.notes,
    );
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
        kept,
    };
    Ok((device, real, cached))
}

/// The attributes every function must have, parsed.
pub(crate) fn read_ids(dir: &AttrDir) -> Result<Ids, String> {
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
pub(crate) fn numa(dir: &AttrDir) -> Result<Option<u32>, String> {
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

    #[test]
    fn regions_and_resets_are_read_and_garbage_is_a_note() {
        let (_dir, root, d) = tree();
        let gpu = d.devices.iter().find(|x| x.class.is_gpu_like()).unwrap();
        let details = gpu.details.as_ref().unwrap();
        assert_eq!(details.bars.len(), 3);
        assert_eq!(details.reset_methods, ["flr", "bus"]);
        assert!(d.notes.is_empty(), "{:?}", d.notes);
        // Every generated region is the function's own: none overlaps another.
        let mut all: Vec<(u64, u64)> = d
            .devices
            .iter()
            .flat_map(|x| x.details.iter().flat_map(|y| &y.bars))
            .filter(|b| b.kind == passage_model::BarKind::Memory)
            .map(|b| (b.start, b.end().unwrap()))
            .collect();
        all.sort();
        assert!(all.windows(2).all(|w| w[0].1 < w[1].0), "{all:x?}");

        fs::write(dev_dir(&root, gpu).join("resource"), "0x1 0x2\n").unwrap();
        fs::write(dev_dir(&root, gpu).join("reset_method"), "FLR!\n").unwrap();
        let again = discover(&root);
        let g = again.devices.iter().find(|x| x.id == gpu.id).unwrap();
        let details = g.details.as_ref().unwrap();
        assert!(details.bars.is_empty() && details.reset_methods.is_empty());
        assert_eq!(again.notes.len(), 2, "{:?}", again.notes);
        assert!(again.skipped.is_empty());
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

    /// Points the link `name` in `dir` at `target`'s last component replaced by `to`.
    fn relink(dir: &Path, name: &str, to: &str) {
        let old = fs::read_link(dir.join(name)).unwrap();
        fs::remove_file(dir.join(name)).unwrap();
        std::os::unix::fs::symlink(old.with_file_name(to), dir.join(name)).unwrap();
    }

    fn find<'a>(d: &'a Discovery, id: &DevicePath) -> &'a PciDevice {
        d.devices.iter().find(|x| &x.id == id).unwrap()
    }

    fn members(d: &Discovery, id: &DevicePath) -> Vec<PciAddress> {
        find(d, id)
            .details
            .as_ref()
            .unwrap()
            .iommu_group_members
            .clone()
    }

    /// A pass shared among threads reports what one thread alone reports, on a tree large
    /// enough for several (each takes at least `MIN_PER_WORKER` functions).
    #[test]
    fn threads_split_a_pass_without_changing_it() {
        use crate::fake::{FakeOptions, generate_with};
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sys");
        let spec = FakeSpec {
            gpus: 48,
            ..FakeSpec::default()
        };
        let opts = FakeOptions {
            gpu_audio: true,
            ..FakeOptions::default()
        };
        generate_with(&root, &spec, &opts).unwrap();
        let pass = |threads| walk_tree(&root, &Memory::default(), &FdBudget::none(), threads);
        let (alone, _) = pass(1).unwrap();
        assert!(
            alone.devices.len() > 3 * MIN_PER_WORKER,
            "{}",
            alone.devices.len()
        );
        let (shared, _) = pass(MAX_WORKERS).unwrap();
        assert_eq!(shared, alone);
        assert!(alone.skipped.is_empty(), "{:?}", alone.skipped);
    }

    /// A generated tree whose GPUs each have an HDMI audio function in their IOMMU group.
    fn tree_with_gpu_audio() -> (tempfile::TempDir, PathBuf) {
        use crate::fake::{FakeOptions, generate_with};
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sys");
        let opts = FakeOptions {
            gpu_audio: true,
            ..FakeOptions::default()
        };
        generate_with(&root, &FakeSpec::default(), &opts).unwrap();
        (dir, root)
    }

    /// Reading only the functions a task rebound gives what a whole pass gives, and
    /// declines (`None`) where only a whole pass can tell.
    #[test]
    fn a_partial_pass_reads_rebound_functions_as_a_whole_pass_does() {
        let (_dir, root) = tree_with_gpu_audio();
        let disc = Discoverer::new();
        let first = disc.discover(&root).devices;
        let gpus: Vec<&PciDevice> = first.iter().filter(|d| d.class.is_gpu_like()).collect();
        let (gpu, other) = (gpus[0], gpus[1]);
        let audio = first
            .iter()
            .find(|d| d.address().function == 1 && gpu.id.parents() == d.id.parents())
            .unwrap();
        let both = [gpu.address(), audio.address()];

        // A bind of the GPU and its audio function, then an unbind.
        relink(&dev_dir(&root, gpu), "driver", "vfio-pci");
        relink(&dev_dir(&root, audio), "driver", "vfio-pci");
        let bound = disc.try_rediscover(&root, &both, &first).unwrap().unwrap();
        assert_eq!(bound, discover(&root).devices);
        assert_eq!(
            bound
                .iter()
                .find(|d| d.id == gpu.id)
                .unwrap()
                .driver
                .as_deref(),
            Some("vfio-pci")
        );
        assert_eq!(
            bound
                .iter()
                .filter(|d| **d != first[first.iter().position(|f| f.id == d.id).unwrap()])
                .count(),
            2,
            "only the rebound functions changed"
        );
        fs::remove_file(dev_dir(&root, gpu).join("driver")).unwrap();
        let unbound = disc
            .try_rediscover(&root, &[gpu.address()], &bound)
            .unwrap()
            .unwrap();
        assert_eq!(unbound, discover(&root).devices);
        // The memory it kept serves the next whole pass.
        assert_eq!(disc.discover(&root).devices, unbound);

        // A function that is not there, or not in what was reported before.
        let nowhere: PciAddress = "0000:ee:1f.7".parse().unwrap();
        assert_eq!(
            disc.try_rediscover(&root, &[nowhere], &unbound).unwrap(),
            None
        );
        let without: Vec<PciDevice> = unbound
            .iter()
            .filter(|d| d.id != other.id)
            .cloned()
            .collect();
        assert_eq!(
            disc.try_rediscover(&root, &[other.address()], &without)
                .unwrap(),
            None
        );
        // A function moved to another IOMMU group: its group's members come with a
        // whole pass.
        relink(&dev_dir(&root, audio), "iommu_group", "999");
        assert_eq!(
            disc.try_rediscover(&root, &[audio.address()], &unbound)
                .unwrap(),
            None
        );
    }

    /// A warm discoverer sees every change a host can make between passes, and what it
    /// reports is what a cold pass reports.
    #[test]
    fn a_warm_discoverer_sees_what_changes() {
        let (dir, root) = tree_with_gpu_audio();
        let disc = Discoverer::new();
        let pass = |what: &str| {
            let warm = disc.discover(&root);
            assert_eq!(warm, discover(&root), "warm and cold differ after {what}");
            assert!(warm.skipped.is_empty(), "{what}: {:?}", warm.skipped);
            warm
        };
        let first = pass("nothing");
        let first_again = pass("a second pass");
        assert_eq!(first, first_again);
        let gpu = first
            .devices
            .iter()
            .find(|d| d.class.is_gpu_like())
            .unwrap();
        let gpu_id = gpu.id.clone();
        let gdir = dev_dir(&root, gpu);
        let audio = first
            .devices
            .iter()
            .find(|d| d.address().function == 1 && gpu.id.parents() == d.id.parents())
            .unwrap();
        let (audio_id, adir) = (audio.id.clone(), dev_dir(&root, audio));
        assert_eq!(
            members(&first, &gpu_id),
            [gpu.address(), audio.address()],
            "the audio function shares the GPU's group"
        );

        // A driver rebind, and an unbind.
        relink(&gdir, "driver", "vfio-pci");
        let d = pass("a rebind");
        assert_eq!(find(&d, &gpu_id).driver.as_deref(), Some("vfio-pci"));
        fs::remove_file(gdir.join("driver")).unwrap();
        let d = pass("an unbind");
        assert_eq!(find(&d, &gpu_id).driver, None);

        // The audio function leaves the GPU's group for a group of its own (both sides
        // change, as the kernel changes them), and comes back.
        let group = gpu.iommu_group.unwrap();
        let groups = root.join("kernel/iommu_groups");
        fs::create_dir_all(groups.join("999/devices")).unwrap();
        let entry = audio.address().to_string();
        fs::rename(
            groups.join(format!("{group}/devices/{entry}")),
            groups.join(format!("999/devices/{entry}")),
        )
        .unwrap();
        relink(&adir, "iommu_group", "999");
        let d = pass("a group change");
        assert_eq!(members(&d, &gpu_id), [gpu.address()]);
        assert_eq!(find(&d, &audio_id).iommu_group, Some(999));
        assert_eq!(members(&d, &audio_id), [audio.address()]);
        fs::rename(
            groups.join(format!("999/devices/{entry}")),
            groups.join(format!("{group}/devices/{entry}")),
        )
        .unwrap();
        relink(&adir, "iommu_group", &group.to_string());
        let d = pass("a group change back");
        assert_eq!(members(&d, &gpu_id), [gpu.address(), audio.address()]);
        assert_eq!(members(&d, &audio_id), [gpu.address(), audio.address()]);

        // Error counters, the current link and the VF count.
        fs::write(
            gdir.join("aer_dev_nonfatal"),
            "TLP 5\nTOTAL_ERR_NONFATAL 5\n",
        )
        .unwrap();
        fs::write(gdir.join("current_link_width"), "8\n").unwrap();
        let pf = first
            .devices
            .iter()
            .find(|d| d.details.as_ref().unwrap().sriov_totalvfs.is_some())
            .unwrap();
        fs::write(dev_dir(&root, pf).join("sriov_numvfs"), "4\n").unwrap();
        let d = pass("counters");
        let gd = find(&d, &gpu_id).details.clone().unwrap();
        assert_eq!((gd.aer_nonfatal, gd.current_link_width), (Some(5), Some(8)));
        let pfd = find(&d, &pf.id).details.clone().unwrap();
        assert_eq!(pfd.sriov_numvfs, Some(4));

        // Slots: one appears, one goes, one is replaced by another of the same name
        // (kept aside, so this file system cannot hand its inode to the new one).
        let slots = root.join("bus/pci/slots");
        let slot_of =
            |d: &Discovery, id: &DevicePath| find(d, id).details.as_ref().unwrap().slot.clone();
        let gpu_slot = slot_of(&first, &gpu_id).unwrap();
        let unslotted = first
            .devices
            .iter()
            .filter(|d| d.details.as_ref().unwrap().slot.is_none())
            .map(|d| d.id.clone())
            .next_back()
            .unwrap();
        let ua = unslotted.address();
        fs::create_dir(slots.join("NEW SLOT")).unwrap();
        fs::write(
            slots.join("NEW SLOT/address"),
            format!("{:04x}:{:02x}:{:02x}\n", ua.domain, ua.bus, ua.device),
        )
        .unwrap();
        let d = pass("a new slot");
        assert_eq!(slot_of(&d, &unslotted).as_deref(), Some("NEW SLOT"));
        fs::rename(slots.join("NEW SLOT"), dir.path().join("old-slot")).unwrap();
        fs::create_dir(slots.join("NEW SLOT")).unwrap();
        let ga = gpu.address();
        fs::write(
            slots.join("NEW SLOT/address"),
            format!("{:04x}:{:02x}:{:02x}\n", ga.domain, ga.bus, ga.device),
        )
        .unwrap();
        fs::remove_dir_all(slots.join(&gpu_slot)).unwrap();
        let d = pass("a replaced slot");
        assert_eq!(slot_of(&d, &unslotted), None);
        assert_eq!(slot_of(&d, &gpu_id).as_deref(), Some("NEW SLOT"));

        // A function goes away (its bus link and directory), and another's directory is
        // replaced.
        fs::remove_file(
            root.join("bus/pci/devices")
                .join(audio.address().to_string()),
        )
        .unwrap();
        fs::rename(&adir, dir.path().join("old-audio")).unwrap();
        let d = pass("a removal");
        assert!(d.devices.iter().all(|x| x.id != audio_id));
        assert_eq!(members(&d, &gpu_id), [gpu.address()]);
        assert_eq!(d.devices.len(), first.devices.len() - 1);
    }

    /// The members of a function's IOMMU group are the group's listing in
    /// `kernel/iommu_groups/N/devices`, though discovery never lists it: it gathers the
    /// functions whose `iommu_group` link names the group, skipped ones too.
    #[test]
    fn group_members_match_the_groups_listing() {
        use crate::fake::{FakeOptions, generate_with};
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sys");
        let opts = FakeOptions {
            gpu_audio: true,
            ..FakeOptions::default()
        };
        generate_with(&root, &FakeSpec::default(), &opts).unwrap();
        let d = discover(&root);
        let listing = |g: u32| {
            let mut m: Vec<PciAddress> =
                fs::read_dir(root.join(format!("kernel/iommu_groups/{g}/devices")))
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_str().unwrap().parse().unwrap())
                    .collect();
            m.sort();
            m
        };
        let mut shared = 0;
        for x in &d.devices {
            let g = x.iommu_group.unwrap();
            assert_eq!(members(&d, &x.id), listing(g), "{}", x.id);
            shared += usize::from(listing(g).len() > 1);
        }
        assert!(shared >= 16, "the tree has shared groups ({shared})");

        // A member that cannot be listed (no class) is still its group-mates' member.
        let gpu = d.devices.iter().find(|x| x.class.is_gpu_like()).unwrap();
        let audio = d
            .devices
            .iter()
            .find(|x| x.address().function == 1 && x.id.parents() == gpu.id.parents())
            .unwrap();
        fs::remove_file(dev_dir(&root, audio).join("class")).unwrap();
        let again = discover(&root);
        assert_eq!(again.skipped.len(), 1, "{:?}", again.skipped);
        assert_eq!(members(&again, &gpu.id), [gpu.address(), audio.address()]);
    }

    #[test]
    fn a_missing_root_is_reported() {
        let d = discover(Path::new("/nonexistent/passage/sys"));
        assert!(d.devices.is_empty());
        assert_eq!(d.skipped.len(), 1);
        assert!(try_discover(Path::new("/nonexistent/passage/sys")).is_err());
    }
}
