//! Where a scrub finds its helper programs and block devices. A generated (fake) tree
//! gets none of the host's: a demo node must never reset a real GPU or write to a real
//! disk because an operator scrubbed one of its pretend devices.

use crate::fake::{FAKE_BIN_DIR, FAKE_DEV_DIR};
use crate::host::{FAKE_MARKER, SysfsOps};
use std::path::{Path, PathBuf};

pub const NVIDIA_SMI: &str = "nvidia-smi";
pub const GPU_ZERO_HELPER: &str = "passage-gpu-zero";

/// What an operator set in the agent's config file (see
/// [`crate::config::FileConfig`]); each one left out keeps the [`ScrubEnv`] default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScrubOverrides {
    pub nvidia_smi: Option<PathBuf>,
    pub gpu_zero_helper: Option<PathBuf>,
    pub dev_dir: Option<PathBuf>,
}

/// What the scrub steps may use on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScrubEnv {
    /// The nvidia-smi to run; `None`: look for [`NVIDIA_SMI`] in `search_path`. A path
    /// that does not exist means nvidia-smi is not installed (the step is skipped).
    pub nvidia_smi: Option<PathBuf>,
    /// The GPU memory zeroing helper (see [`super::programs`] for its contract); `None`:
    /// look for [`GPU_ZERO_HELPER`] in `search_path`.
    pub gpu_zero_helper: Option<PathBuf>,
    /// Directories searched for the programs above when not given, like `PATH`.
    pub search_path: Vec<PathBuf>,
    /// Where the block device nodes are (`/dev` on a host).
    pub dev_dir: PathBuf,
    /// How long one driver bind, unbind or probe of a scrub may take.
    pub driver_timeout: std::time::Duration,
}

impl ScrubEnv {
    /// A real host: programs from the agent's `PATH`, devices under `/dev`.
    pub fn host() -> Self {
        let search_path = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect())
            .unwrap_or_default();
        ScrubEnv {
            nvidia_smi: None,
            gpu_zero_helper: None,
            search_path,
            dev_dir: PathBuf::from("/dev"),
            driver_timeout: super::vendor::DRIVER_WRITE_TIMEOUT,
        }
    }

    /// No programs at all, block devices under `dev_dir`: what a test or a fake node sees
    /// until it provides its own.
    pub fn isolated(dev_dir: &Path) -> Self {
        ScrubEnv {
            nvidia_smi: None,
            gpu_zero_helper: None,
            search_path: Vec::new(),
            dev_dir: dev_dir.to_path_buf(),
            driver_timeout: super::vendor::DRIVER_WRITE_TIMEOUT,
        }
    }

    /// [`ScrubEnv::host`] for a real sysfs; for a generated tree, [`ScrubEnv::isolated`]
    /// over the tree's own stand-in block devices, with the tree's stand-in tools (its
    /// zeroing helper, its `nvidia-smi` where it has one) as the only programs.
    pub fn for_sysfs(ops: &dyn SysfsOps) -> Self {
        let root = ops.root();
        if root.join(FAKE_MARKER).exists() {
            ScrubEnv {
                search_path: vec![root.join(FAKE_BIN_DIR)],
                ..ScrubEnv::isolated(&root.join(FAKE_DEV_DIR))
            }
        } else {
            ScrubEnv::host()
        }
    }

    pub fn with_overrides(mut self, o: &ScrubOverrides) -> Self {
        if let Some(p) = &o.nvidia_smi {
            self.nvidia_smi = Some(p.clone());
        }
        if let Some(p) = &o.gpu_zero_helper {
            self.gpu_zero_helper = Some(p.clone());
        }
        if let Some(p) = &o.dev_dir {
            self.dev_dir = p.clone();
        }
        self
    }

    /// The program to run: the configured one if it exists, else `name` from the search
    /// path; `None` when it is not on this node.
    pub(crate) fn program(&self, configured: Option<&Path>, name: &str) -> Option<PathBuf> {
        match configured {
            Some(p) => is_executable(p).then(|| p.to_path_buf()),
            None => self
                .search_path
                .iter()
                .map(|d| d.join(name))
                .find(|p| is_executable(p)),
        }
    }
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
