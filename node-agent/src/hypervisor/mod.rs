//! VM launch backends behind one trait. Only the simulator exists today; qemu,
//! cloud-hypervisor and bhyve are named so the command line and config can already say
//! which one a node will use.

mod sim;

pub use sim::SimHypervisor;

use passage_model::VmId;
use passage_model::protocol::VmSpec;
use std::path::Path;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum HypervisorError {
    #[error("hypervisor {0} is not supported yet; use sim")]
    Unsupported(HypervisorKind),
    #[error("VM {vm}: device {device} is not bound to vfio-pci (driver: {driver})")]
    DeviceNotReady {
        vm: VmId,
        device: String,
        driver: String,
    },
    #[error("VM {vm} is already running with a different spec")]
    Conflict { vm: VmId },
    #[error("hypervisor state {path}: {source}")]
    State {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HypervisorKind {
    Sim,
    Qemu,
    CloudHypervisor,
    Bhyve,
}

impl std::fmt::Display for HypervisorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HypervisorKind::Sim => "sim",
            HypervisorKind::Qemu => "qemu",
            HypervisorKind::CloudHypervisor => "cloud-hypervisor",
            HypervisorKind::Bhyve => "bhyve",
        })
    }
}

/// Calls may block (a real backend spawns processes); async callers use `spawn_blocking`.
pub trait Hypervisor: Send + Sync {
    /// Starts the VM; starting one already running with the same spec is a no-op.
    fn start(&self, spec: &VmSpec) -> Result<(), HypervisorError>;
    /// Stops the VM; stopping one that is not running is a no-op.
    fn stop(&self, vm: VmId) -> Result<(), HypervisorError>;
    fn running(&self) -> Vec<VmId>;
}

/// The backend for `kind`. `sysfs_root`, when given, lets the simulator refuse devices
/// that are not bound to vfio-pci, as a real launch would fail.
pub fn open(
    kind: HypervisorKind,
    state_dir: &Path,
    sysfs_root: Option<&Path>,
) -> Result<Arc<dyn Hypervisor>, HypervisorError> {
    match kind {
        HypervisorKind::Sim => Ok(Arc::new(SimHypervisor::open(state_dir, sysfs_root)?)),
        other => Err(HypervisorError::Unsupported(other)),
    }
}
