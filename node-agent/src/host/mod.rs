//! The host boundary: PCI discovery from a sysfs tree and the attribute writes that bind
//! devices for passthrough. Everything takes a sysfs root so tests and demos run over a
//! fake tree (see [`crate::fake`]) exactly as production runs over `/sys`.

mod binding;
mod details;
mod discover;
mod facts;
mod resources;
mod sriov;
mod vgpu;
mod vgpu_slots;

pub use binding::{BindError, Binder, BindingRecord, BindingState, VFIO_DRIVER};
pub use details::{PCI_IDS_VERSION, class_name, device_name, vendor_name};
pub use discover::{Discoverer, Discovery, DiscoveryError, discover, merge_reread, try_discover};
pub use facts::{
    FactsError, FunctionFacts, device_path_of, function_facts, function_facts_by_address,
};
pub(crate) use resources::read_cpuinfo;
pub use resources::{
    ResourcesError, address_bits, count_cpu_list, cpuinfo_path, host_resources, mem_total_kib,
};
pub use sriov::set_numvfs;
pub use vgpu::NvidiaSmi;
pub use vgpu_slots::{VgpuRecord, VgpuSlots, VgpuState};

use std::fs;
use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The file at the root of a generated tree: its presence means writes must go through
/// the fake kernel, because no real kernel stands behind those files.
pub const FAKE_MARKER: &str = ".passage-fake-sysfs";

/// Sysfs attributes are at most one page; anything longer is not a kernel attribute.
const MAX_ATTR_LEN: usize = 4096;

/// Writes to kernel attribute files. Reads go straight to the file system for both
/// implementations: the tree itself is the state.
pub trait SysfsOps: Send + Sync {
    /// The sysfs root, canonical.
    fn root(&self) -> &Path;
    /// Writes `value` to the existing attribute `path` (absolute, under the root). A
    /// missing attribute is an error: the kernel never creates one on write.
    fn write_attr(&self, path: &Path, value: &str) -> io::Result<()>;
}

/// A real kernel: plain writes, the kernel does the rest.
#[derive(Debug)]
pub struct LinuxSysfs {
    root: PathBuf,
}

impl LinuxSysfs {
    pub fn new(root: &Path) -> io::Result<Self> {
        Ok(LinuxSysfs {
            root: fs::canonicalize(root)?,
        })
    }
}

impl SysfsOps for LinuxSysfs {
    fn root(&self) -> &Path {
        &self.root
    }

    fn write_attr(&self, path: &Path, value: &str) -> io::Result<()> {
        write_existing(path, value)
    }
}

/// Opens the right implementation for a root: the fake kernel when the tree carries the
/// fake marker, the real one otherwise.
pub fn open_sysfs(root: &Path) -> io::Result<Arc<dyn SysfsOps>> {
    if root.join(FAKE_MARKER).exists() {
        Ok(Arc::new(crate::fake::FakeKernel::new(root)?))
    } else {
        Ok(Arc::new(LinuxSysfs::new(root)?))
    }
}

/// One write on an existing file, as sysfs expects (a single `write(2)`).
pub(crate) fn write_existing(path: &Path, value: &str) -> io::Result<()> {
    use std::io::Write;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)?;
    f.write_all(value.as_bytes())
}

/// Reads a small attribute, trimmed of the kernel's trailing newline. One `read(2)`:
/// sysfs hands over a whole attribute (at most a page) in the first read, and a second
/// read just to see end-of-file would double the system calls of a discovery pass.
/// Content past the first page is never read; invalid UTF-8 is an error.
pub(crate) fn read_attr(path: &Path) -> io::Result<String> {
    let mut buf = [0u8; MAX_ATTR_LEN];
    let n = fs::File::open(path)?.read(&mut buf)?;
    let text = std::str::from_utf8(&buf[..n])
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok(text.trim_end().to_string())
}

/// A function's directory, opened once so its attributes are read relative to it.
pub(crate) struct AttrDir {
    fd: std::os::fd::OwnedFd,
    path: PathBuf,
}

impl AttrDir {
    pub(crate) fn open(path: &Path) -> io::Result<Self> {
        use rustix::fs::{Mode, OFlags};
        // O_PATH: a handle for lookups only; no read permission or open of the inode.
        let fd = rustix::fs::open(
            path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(AttrDir {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// [`AttrDir::open`], refusing a symbolic link as the last component
    /// (`ENOTDIR`), as an `lstat` first would but without a second walk of the path.
    pub(crate) fn open_dir_nofollow(path: &Path) -> io::Result<Self> {
        use rustix::fs::{Mode, OFlags};
        let fd = rustix::fs::open(
            path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(AttrDir {
            fd,
            path: path.to_path_buf(),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The directory's device and inode numbers (`fstat` on the handle: no path walk).
    // The field types of `Stat` differ between targets; on most they are already `u64`.
    #[allow(clippy::unnecessary_cast)]
    pub(crate) fn dev_ino(&self) -> io::Result<(u64, u64)> {
        let st = rustix::fs::fstat(&self.fd)?;
        Ok((st.st_dev as u64, st.st_ino as u64))
    }

    /// The target of the link `name` in this directory.
    pub(crate) fn read_link(&self, name: &std::ffi::OsStr) -> io::Result<PathBuf> {
        let target = rustix::fs::readlinkat(&self.fd, name, Vec::new())?;
        Ok(PathBuf::from(
            <std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(target.into_bytes()),
        ))
    }

    /// [`read_attr`] for the attribute `name` in this directory.
    pub(crate) fn read(&self, name: &str) -> io::Result<String> {
        let fd = self.open_attr(name)?;
        let mut buf = [0u8; MAX_ATTR_LEN];
        let n = rustix::io::read(&fd, &mut buf)?;
        attr_text(&buf[..n])
    }

    fn open_attr(&self, name: &str) -> io::Result<OwnedFd> {
        use rustix::fs::{Mode, OFlags};
        Ok(rustix::fs::openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
        )?)
    }

    /// [`AttrDir::read`] through `kept`, the attribute held open since an earlier pass
    /// over this same directory: one `pread` at offset 0 instead of open, read and
    /// close. Sysfs attributes are `seq_file`s, and a read at offset 0 starts them over,
    /// so the kernel formats the value afresh (checked on this kernel: a network
    /// counter read twice through one descriptor changes). A kept descriptor whose read
    /// fails (the attribute was removed: `ENODEV`) is dropped and the attribute opened
    /// again. A newly opened attribute is kept while `budget` has room.
    ///
    /// On a regular file system (a generated tree) the value written in place is what
    /// is read; a file replaced by another would go on being read through the old one.
    /// The kernel never does that to an attribute of a directory that still exists.
    pub(crate) fn read_kept(
        &self,
        name: &str,
        kept: &mut KeptFd,
        budget: &FdBudget,
    ) -> io::Result<String> {
        let mut buf = [0u8; MAX_ATTR_LEN];
        // A pass that keeps nothing lets go of what earlier passes kept.
        if let Some(fd) = kept.take()
            && budget.keeps()
            && let Ok(n) = rustix::io::pread(&fd.fd, &mut buf, 0)
        {
            *kept = Some(fd);
            return attr_text(&buf[..n]);
        }
        let fd = self.open_attr(name)?;
        let n = rustix::io::read(&fd, &mut buf)?;
        let text = attr_text(&buf[..n])?;
        *kept = budget.hold(fd);
        Ok(text)
    }

    /// [`link_basename`] for the link `name` in this directory.
    pub(crate) fn link_basename(&self, name: &str) -> io::Result<Option<String>> {
        match rustix::fs::readlinkat(&self.fd, name, Vec::new()) {
            Ok(target) => {
                let target = PathBuf::from(
                    <std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(
                        target.into_bytes(),
                    ),
                );
                Ok(target.file_name().map(|n| n.to_string_lossy().into_owned()))
            }
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

fn attr_text(bytes: &[u8]) -> io::Result<String> {
    let text =
        std::str::from_utf8(bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok(text.trim_end().to_string())
}

/// An attribute held open between discovery passes (see [`AttrDir::read_kept`]).
pub(crate) type KeptFd = Option<Arc<HeldFd>>;

/// A descriptor counted against its [`FdBudget`] for as long as it is open.
#[derive(Debug)]
pub(crate) struct HeldFd {
    fd: OwnedFd,
    count: Arc<AtomicUsize>,
}

impl Drop for HeldFd {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How many attributes may be held open between discovery passes. The count is the
/// whole process's: a server running two thousand simulated nodes runs two thousand
/// discoverers, and a budget per discoverer would let them hold twice the open-file
/// limit between them.
#[derive(Debug, Clone)]
pub(crate) struct FdBudget {
    limit: usize,
    held: Arc<AtomicUsize>,
}

/// The most attributes a process holds open: four per function for about a thousand
/// functions.
const MAX_KEPT_FDS: u64 = 4096;
/// Descriptors left to everything else the process opens (sockets, state files, QMP
/// connections, scrub programs' pipes, database files).
const FD_RESERVE: u64 = 512;

/// The descriptors this process holds between passes, all discoverers together.
static PROCESS_HELD: std::sync::LazyLock<Arc<AtomicUsize>> =
    std::sync::LazyLock::new(|| Arc::new(AtomicUsize::new(0)));

impl FdBudget {
    pub(crate) fn none() -> Self {
        FdBudget {
            limit: 0,
            held: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Half of what the process's open-file limit leaves after [`FD_RESERVE`], at most
    /// [`MAX_KEPT_FDS`], for the whole process: 256 under systemd's default soft limit
    /// of 1024 (the agent raises it to the hard limit at start), 4096 under a limit of
    /// 8704 or more.
    pub(crate) fn from_rlimit() -> Self {
        let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        let limit = (soft.saturating_sub(FD_RESERVE) / 2).min(MAX_KEPT_FDS);
        FdBudget {
            limit: usize::try_from(limit).unwrap_or(0),
            held: PROCESS_HELD.clone(),
        }
    }

    /// Whether this pass keeps descriptors at all.
    fn keeps(&self) -> bool {
        self.limit > 0
    }

    /// `fd`, counted, while the budget has room; otherwise it is closed.
    fn hold(&self, fd: OwnedFd) -> KeptFd {
        self.held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                (u < self.limit).then_some(u + 1)
            })
            .ok()?;
        Some(Arc::new(HeldFd {
            fd,
            count: self.held.clone(),
        }))
    }

    #[cfg(test)]
    fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
}

/// Raises this process's soft open-file limit to its hard limit, as servers do at start
/// (systemd's default soft limit of 1024 is for old `select()` programs), and answers the
/// soft limit now in force. The discoverers' shared budget follows it.
pub fn raise_open_file_limit() -> io::Result<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut lim = getrlimit(Resource::Nofile);
    if lim.current != lim.maximum {
        lim.current = lim.maximum;
        setrlimit(Resource::Nofile, lim)?;
    }
    Ok(getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX))
}

/// The basename of a symlink (`driver`, `iommu_group`); `Ok(None)` when there is none.
pub(crate) fn link_basename(path: &Path) -> io::Result<Option<String>> {
    match fs::read_link(path) {
        Ok(target) => Ok(target.file_name().map(|n| n.to_string_lossy().into_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The directory of a function in the tree, from its device path. `DevicePath` admits
/// only `pciDDDD:BB` and addresses as components, so the join cannot climb out.
pub fn device_dir(root: &Path, dev: &passage_model::DevicePath) -> PathBuf {
    root.join(dev.to_string().trim_start_matches('/'))
}

/// The driver bound to the function at `dir`, if any.
pub fn bound_driver(dir: &Path) -> io::Result<Option<String>> {
    link_basename(&dir.join("driver"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(limit: usize) -> FdBudget {
        FdBudget {
            limit,
            held: Arc::new(AtomicUsize::new(0)),
        }
    }

    #[test]
    fn kept_attributes_are_read_again_through_their_descriptor() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("a"), "1\n").unwrap();
        fs::write(tmp.path().join("b"), "x\n").unwrap();
        let dir = AttrDir::open(tmp.path()).unwrap();
        let one = budget(1);
        let (mut a, mut b) = (KeptFd::None, KeptFd::None);
        assert_eq!(dir.read_kept("a", &mut a, &one).unwrap(), "1");
        assert!(a.is_some(), "kept within the budget");
        assert_eq!(dir.read_kept("b", &mut b, &one).unwrap(), "x");
        assert!(b.is_none(), "the budget is spent");

        // The next pass: a value written in place is read through the kept descriptor,
        // which stays counted.
        let held = a.clone().unwrap();
        fs::write(tmp.path().join("a"), "22\n").unwrap();
        assert_eq!(dir.read_kept("a", &mut a, &one).unwrap(), "22");
        assert!(
            Arc::ptr_eq(a.as_ref().unwrap(), &held),
            "the same descriptor"
        );
        drop(held);
        assert_eq!(one.held(), 1);

        // A descriptor that cannot be read any more (here: a directory's, EISDIR; in
        // sysfs a removed attribute's, ENODEV) is replaced by a fresh open.
        let sub = tmp.path().join("sub");
        fs::create_dir(&sub).unwrap();
        let two = budget(2);
        let dir_fd =
            rustix::fs::open(&sub, rustix::fs::OFlags::RDONLY, rustix::fs::Mode::empty()).unwrap();
        let mut broken = two.hold(dir_fd);
        assert_eq!(two.held(), 1);
        assert_eq!(dir.read_kept("b", &mut broken, &two).unwrap(), "x");
        let fresh = broken.unwrap();
        assert_eq!(
            two.held(),
            1,
            "the broken one was let go, the fresh one kept"
        );
        let mut buf = [0u8; 8];
        assert_eq!(rustix::io::pread(&fresh.fd, &mut buf, 0).unwrap(), 2);
        drop(fresh);
        assert_eq!(two.held(), 0);

        // A missing attribute is NotFound and keeps nothing; no budget keeps nothing.
        let mut c = KeptFd::None;
        let e = dir.read_kept("c", &mut c, &budget(4)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(c.is_none());
        assert_eq!(dir.read_kept("a", &mut c, &FdBudget::none()).unwrap(), "22");
        assert!(c.is_none());
        // A kept descriptor on a pass that keeps nothing is let go.
        assert_eq!(dir.read_kept("a", &mut a, &FdBudget::none()).unwrap(), "22");
        assert!(a.is_none());
        assert_eq!(one.held(), 0);
    }

    #[test]
    fn the_budget_is_the_whole_process() {
        let a = FdBudget::from_rlimit();
        let b = FdBudget::from_rlimit();
        let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        assert!(a.limit as u64 <= MAX_KEPT_FDS);
        assert!((a.limit as u64) * 2 + FD_RESERVE <= soft.max(FD_RESERVE));
        assert!(
            Arc::ptr_eq(&a.held, &b.held),
            "one count for every discoverer"
        );

        let two = budget(2);
        let open = || {
            rustix::fs::open("/", rustix::fs::OFlags::RDONLY, rustix::fs::Mode::empty()).unwrap()
        };
        let x = two.hold(open());
        let y = two.clone().hold(open());
        assert!(x.is_some() && y.is_some());
        assert!(two.hold(open()).is_none(), "full for every holder");
        drop(x);
        assert!(two.hold(open()).is_some());
    }
}
