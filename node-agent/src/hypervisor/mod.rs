//! VM launch backends behind one trait: the simulator and QEMU run VMs;
//! cloud-hypervisor and bhyve have command-line builders only.

mod bhyve;
mod cloud_hypervisor;
pub mod console;
mod qemu;
pub mod qmp;
mod sim;
mod sim_serial;

pub use bhyve::{BHYVE_BINARY, PassthruRef, TooManyDevices, bhyve_argv};
pub use cloud_hypervisor::{CLOUD_HYPERVISOR_BINARY, cloud_hypervisor_argv};
pub use qemu::{
    Backing, CpuModel, DEFAULT_OVMF_CODE, DEFAULT_OVMF_VARS, HugepagePolicy, LaunchPlan,
    OVMF_VARS_FILE, OVMF_VARS_TMP_FILE, PINNING_FILE, PinPolicy, Pinning, QEMU_BINARY, QemuConfig,
    QemuHypervisor, QemuOptions, SERIAL_FILE, STAND_IN_ENV, StandIn, StartLimit, VmFiles, checks,
    cpu_list, launch_plan, layout, qemu_argv, vars_path,
};
pub use sim::SimHypervisor;

use crate::host::{VFIO_DRIVER, bound_driver, device_dir};
use std::path::PathBuf;

use passage_model::VmId;
use passage_model::protocol::{Shutdown, VmSpec};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum HypervisorError {
    #[error("hypervisor {0} can only build command lines here, not run VMs; use sim or qemu")]
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
    #[error("{binary} is not installed here (not found on PATH)")]
    NotInstalled { binary: &'static str },
    #[error("VM {vm}: launch failed: {reason}")]
    Launch { vm: VmId, reason: String },
    #[error("VM {vm}: QMP: {reason}")]
    Qmp { vm: VmId, reason: String },
    #[error("VM {vm} is not running on this node")]
    NotRunning { vm: VmId },
    #[error("VM {vm}: {source}")]
    Network {
        vm: VmId,
        source: crate::net::NetError,
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

impl HypervisorKind {
    /// The sysfs tree whose bridges VMs' taps attach to: the simulator's own (generated)
    /// tree, else the host's, whatever tree PCI devices are read from.
    pub fn net_sysfs_root(self, sysfs_root: &Path) -> PathBuf {
        match self {
            HypervisorKind::Sim => sysfs_root.to_path_buf(),
            _ => PathBuf::from(crate::net::HOST_SYSFS),
        }
    }
}

/// Calls may block (a real backend spawns processes); async callers use `spawn_blocking`.
pub trait Hypervisor: Send + Sync {
    /// Starts the VM; starting one already running with the same spec is a no-op.
    fn start(&self, spec: &VmSpec) -> Result<(), HypervisorError>;
    /// Stops the VM at once (a power cut); stopping one that is not running is a no-op.
    fn stop(&self, vm: VmId) -> Result<(), HypervisorError>;
    /// Asks the guest to shut down (the ACPI power button), waits up to `grace` for it,
    /// then ends the VM as [`Hypervisor::stop`] does, whichever happened. One that is not
    /// running is [`Shutdown::NotRunning`].
    fn shutdown(&self, vm: VmId, grace: Duration) -> Result<Shutdown, HypervisorError>;
    /// Whether a [`Hypervisor::shutdown`] may take as long as its grace (a real guest),
    /// so that the agent runs it beside its other tasks.
    fn stops_slowly(&self) -> bool {
        false
    }
    fn running(&self) -> Vec<VmId>;
    /// The specs of the VMs whose taps this backend made (starting or running), for the
    /// metadata service; empty for a backend that makes no taps.
    fn tap_specs(&self) -> Vec<VmSpec> {
        Vec::new()
    }
    /// The end of the VM's serial console (at most
    /// [`passage_model::protocol::MAX_CONSOLE_BYTES`]): empty for a VM that never printed
    /// or that this node does not know.
    fn console(&self, vm: VmId) -> Result<String, HypervisorError>;
    /// The running VM's serial port, for an interactive console: called on the async
    /// runtime (it must not block), once per session. Only one session at a time may
    /// write to a port; the server sees to that.
    fn serial(&self, vm: VmId) -> Result<SerialPort, HypervisorError> {
        Err(HypervisorError::NotRunning { vm })
    }
    /// Keeps what running VMs write on this node bounded (their consoles); the agent
    /// calls it with each heartbeat.
    fn trim(&self) {}
    /// Whether a start may take minutes (QEMU pinning a large guest's memory): the agent
    /// then runs starts beside its other tasks rather than in turn.
    fn starts_slowly(&self) -> bool {
        false
    }
}

/// Where a VM's serial port is reached.
pub enum SerialPort {
    /// A unix socket its hypervisor listens on (QEMU's `serial.sock`).
    Socket(PathBuf),
    /// A stream open already (the simulator's stand-in).
    Stream(tokio::io::DuplexStream),
}

/// The backend for `kind`. `sysfs_root`, when given, lets the simulator refuse devices
/// that are not bound to vfio-pci, as a real launch would fail.
/// `qemu` applies to the QEMU backend only.
pub fn open(
    kind: HypervisorKind,
    state_dir: &Path,
    sysfs_root: Option<&Path>,
    qemu: &QemuOptions,
) -> Result<Arc<dyn Hypervisor>, HypervisorError> {
    match kind {
        HypervisorKind::Sim => Ok(Arc::new(SimHypervisor::open(state_dir, sysfs_root)?)),
        HypervisorKind::Qemu => Ok(Arc::new(QemuHypervisor::open(
            QemuConfig::from_path(sysfs_root)?.with_options(qemu),
            state_dir,
        )?)),
        // Builders only: say first whether the binary is even here, as that is the
        // operator's next question.
        HypervisorKind::CloudHypervisor if find_on_path(CLOUD_HYPERVISOR_BINARY).is_none() => {
            Err(HypervisorError::NotInstalled {
                binary: CLOUD_HYPERVISOR_BINARY,
            })
        }
        HypervisorKind::Bhyve if find_on_path(BHYVE_BINARY).is_none() => {
            Err(HypervisorError::NotInstalled {
                binary: BHYVE_BINARY,
            })
        }
        other => Err(HypervisorError::Unsupported(other)),
    }
}

/// The first executable file named `name` in `PATH`.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| {
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                p.metadata()
                    .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            }
            #[cfg(not(unix))]
            {
                p.is_file()
            }
        })
}

/// Refuses a VM whose devices are not on vfio-pci: QEMU would fail later and less clearly.
pub(crate) fn check_devices_ready(sysfs_root: &Path, spec: &VmSpec) -> Result<(), HypervisorError> {
    for dev in &spec.devices {
        // A vGPU: an mdev exists at its path, or (vendor VFIO) its VF carries a type.
        if dev.vgpu().is_some() {
            let mdev = device_dir(sysfs_root, dev);
            let vf_type = crate::host::read_attr(
                &device_dir(sysfs_root, &dev.gpu()).join("nvidia/current_vgpu_type"),
            )
            .unwrap_or_default();
            if !mdev.is_dir() && matches!(vf_type.trim(), "" | "0") {
                return Err(HypervisorError::DeviceNotReady {
                    vm: spec.uuid,
                    device: dev.to_string(),
                    driver: "no vGPU made".to_string(),
                });
            }
            continue;
        }
        let driver = bound_driver(&device_dir(sysfs_root, dev)).ok().flatten();
        if driver.as_deref() != Some(VFIO_DRIVER) {
            return Err(HypervisorError::DeviceNotReady {
                vm: spec.uuid,
                device: dev.to_string(),
                driver: driver.unwrap_or_else(|| "none".to_string()),
            });
        }
    }
    Ok(())
}
