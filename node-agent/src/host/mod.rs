//! The host boundary: PCI discovery from a sysfs tree and the attribute writes that bind
//! devices for passthrough. Everything takes a sysfs root so tests and demos run over a
//! fake tree (see [`crate::fake`]) exactly as production runs over `/sys`.

mod binding;
mod details;
mod discover;
mod resources;

pub use binding::{BindError, Binder, BindingRecord, BindingState, VFIO_DRIVER};
pub use details::{PCI_IDS_VERSION, class_name, device_name, vendor_name};
pub use discover::{Discoverer, Discovery, DiscoveryError, discover, try_discover};
pub use resources::{ResourcesError, count_cpu_list, host_resources, mem_total_kib};

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
        use rustix::fs::{Mode, OFlags};
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
        )?;
        let mut buf = [0u8; MAX_ATTR_LEN];
        let n = rustix::io::read(&fd, &mut buf)?;
        let text = std::str::from_utf8(&buf[..n])
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        Ok(text.trim_end().to_string())
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
