//! The host boundary: PCI discovery from a sysfs tree and the attribute writes that bind
//! devices for passthrough. Everything takes a sysfs root so tests and demos run over a
//! fake tree (see [`crate::fake`]) exactly as production runs over `/sys`.

mod binding;
mod discover;

pub use binding::{BindError, Binder, BindingRecord, BindingState, VFIO_DRIVER};
pub use discover::{Discovery, DiscoveryError, discover, try_discover};

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The file at the root of a generated tree: its presence means writes must go through
/// the fake kernel, because no real kernel stands behind those files.
pub const FAKE_MARKER: &str = ".passage-fake-sysfs";

/// Sysfs attributes are at most one page; anything longer is not a kernel attribute.
const MAX_ATTR_LEN: u64 = 4096;

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

/// Reads a small attribute, trimmed of the kernel's trailing newline.
pub(crate) fn read_attr(path: &Path) -> io::Result<String> {
    let mut s = String::new();
    fs::File::open(path)?
        .take(MAX_ATTR_LEN)
        .read_to_string(&mut s)?;
    Ok(s.trim_end().to_string())
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
