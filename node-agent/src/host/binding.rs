//! Binding functions to vfio-pci for passthrough, through `driver_override` and
//! `drivers_probe` (never `new_id`, which would grab every function with the same ids).
//!
//! The desired bindings and each device's original driver live in
//! `STATE/bindings.json`, written before the first change to a device, so a restarted
//! agent can re-apply them and give devices back to the right driver.

use super::{SysfsOps, bound_driver, device_dir};
use crate::state::{read_json, write_json};
use passage_model::DevicePath;
use serde::{Deserialize, Serialize};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const VFIO_DRIVER: &str = "vfio-pci";
/// How long an unbind may block before the bind gives up on it: the kernel's write does
/// not return while a process holds the device (nvidia's driver waits for its last
/// user), and a task must not hang the agent.
pub const DEFAULT_UNBIND_TIMEOUT: Duration = Duration::from_secs(30);
const STATE_FILE: &str = "bindings.json";

#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("device {0} is not in the sysfs tree")]
    NotFound(DevicePath),
    #[error("driver {VFIO_DRIVER} is not loaded (no {0}); run `modprobe vfio-pci`")]
    VfioMissing(PathBuf),
    #[error("device {device}: writing {path}: {source}")]
    Write {
        device: DevicePath,
        path: PathBuf,
        source: io::Error,
    },
    #[error("device {device}: reading its driver: {source}")]
    Read {
        device: DevicePath,
        source: io::Error,
    },
    #[error("device {device} is bound to {found} after binding, expected {expected}")]
    WrongDriver {
        device: DevicePath,
        expected: String,
        found: String,
    },
    #[error("binding state {path}: {source}")]
    State { path: PathBuf, source: io::Error },
    #[error(
        "device {device} shares IOMMU group {group} with {}, which would stay with the host; \
         pass them through in the same request or bind them to {VFIO_DRIVER} first",
        others.join(", ")
    )]
    GroupNotViable {
        device: DevicePath,
        group: String,
        /// `BDF (driver X)` or `BDF (no driver)` for each blocking function.
        others: Vec<String>,
    },
    /// An unbind that did not return within its bound: `why` names the driver, the
    /// bound, who holds the driver's device nodes open and what to do.
    #[error("device {device}: {why}")]
    UnbindStuck { device: DevicePath, why: String },
    #[error("device {device}: reading its IOMMU group: {reason}")]
    Group { device: DevicePath, reason: String },
}

/// One device the agent holds for passthrough.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindingRecord {
    pub device: DevicePath,
    /// The driver the device had before; `None` when it had none.
    pub original_driver: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindingState {
    pub bindings: Vec<BindingRecord>,
}

/// Binds and unbinds over any [`SysfsOps`]: the same code drives a real kernel and the
/// fake one.
pub struct Binder {
    ops: Arc<dyn SysfsOps>,
    state_path: PathBuf,
    // Serialises read-modify-write of the state file between concurrent tasks.
    lock: Mutex<()>,
    unbind_timeout: Duration,
    /// Where processes' open files (`PID/fd/N` links) and the device nodes they point
    /// at are, to name who keeps a device busy.
    proc_root: PathBuf,
    dev_root: PathBuf,
}

impl Binder {
    pub fn new(ops: Arc<dyn SysfsOps>, state_dir: &Path) -> Self {
        Binder {
            ops,
            state_path: state_dir.join(STATE_FILE),
            lock: Mutex::new(()),
            unbind_timeout: DEFAULT_UNBIND_TIMEOUT,
            proc_root: PathBuf::from("/proc"),
            dev_root: PathBuf::from("/dev"),
        }
    }

    pub fn with_unbind_timeout(mut self, timeout: Duration) -> Self {
        self.unbind_timeout = timeout;
        self
    }

    /// Other roots than `/proc` and `/dev` for naming a busy device's holders.
    pub fn with_holder_roots(mut self, proc_root: &Path, dev_root: &Path) -> Self {
        self.proc_root = proc_root.to_path_buf();
        self.dev_root = dev_root.to_path_buf();
        self
    }

    /// Unbinds `dev` from `driver`, giving up after the bound with the processes that
    /// hold the driver's device nodes open. The write runs on a thread of its own that
    /// is left behind when it blocks: the kernel finishes it once the holders let go.
    fn unbind_bounded(&self, dev: &DevicePath, driver: &str, bdf: &str) -> Result<(), BindError> {
        let path = self.drivers().join(driver).join("unbind");
        let (tx, rx) = std::sync::mpsc::channel();
        let (ops, p, v) = (self.ops.clone(), path.clone(), bdf.to_string());
        std::thread::Builder::new()
            .name(format!("unbind {bdf}"))
            .spawn(move || {
                let _ = tx.send(ops.write_attr(&p, &v));
            })
            .map_err(|source| BindError::Write {
                device: dev.clone(),
                path: path.clone(),
                source,
            })?;
        match rx.recv_timeout(self.unbind_timeout) {
            Ok(r) => r.map_err(|source| BindError::Write {
                device: dev.clone(),
                path,
                source,
            }),
            Err(_) => {
                let holders = device_holders(&self.proc_root, &self.dev_root, driver);
                let holders = if holders.is_empty() {
                    format!(
                        "no process holds {} open; the driver itself is busy with it \
                         (see the kernel log)",
                        node_glob(&self.dev_root, driver)
                    )
                } else {
                    format!(
                        "{} open by {}; stop them and try again",
                        node_glob(&self.dev_root, driver),
                        holders.join(", ")
                    )
                };
                Err(BindError::UnbindStuck {
                    device: dev.clone(),
                    why: format!(
                        "unbinding it from {driver} did not finish within {} s, the device \
                         is busy: {holders}",
                        self.unbind_timeout.as_secs_f64().ceil() as u64
                    ),
                })
            }
        }
    }

    pub fn ops(&self) -> &Arc<dyn SysfsOps> {
        &self.ops
    }

    /// Where the binding records live (the agent's state directory).
    pub fn state_dir(&self) -> &Path {
        self.state_path.parent().unwrap_or(&self.state_path)
    }

    pub fn state(&self) -> Result<BindingState, BindError> {
        read_json(&self.state_path)
            .map(Option::unwrap_or_default)
            .map_err(|source| BindError::State {
                path: self.state_path.clone(),
                source,
            })
    }

    fn save(&self, state: &BindingState) -> Result<(), BindError> {
        write_json(&self.state_path, state, 0o600).map_err(|source| BindError::State {
            path: self.state_path.clone(),
            source,
        })
    }

    fn locked(&self) -> std::sync::MutexGuard<'_, ()> {
        // A panic elsewhere while holding the lock leaves nothing half-done in memory.
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn existing_dir(&self, dev: &DevicePath) -> Result<PathBuf, BindError> {
        let dir = device_dir(self.ops.root(), dev);
        let listed = self
            .ops
            .root()
            .join("bus/pci/devices")
            .join(dev.address().to_string());
        if dir.is_dir() && listed.exists() {
            Ok(dir)
        } else {
            Err(BindError::NotFound(dev.clone()))
        }
    }

    fn write(&self, dev: &DevicePath, path: PathBuf, value: &str) -> Result<(), BindError> {
        self.ops
            .write_attr(&path, value)
            .map_err(|source| BindError::Write {
                device: dev.clone(),
                path,
                source,
            })
    }

    fn driver_of(&self, dev: &DevicePath, dir: &Path) -> Result<Option<String>, BindError> {
        bound_driver(dir).map_err(|source| BindError::Read {
            device: dev.clone(),
            source,
        })
    }

    fn drivers(&self) -> PathBuf {
        self.ops.root().join("bus/pci/drivers")
    }

    /// Checks that passing `devs` through together leaves no IOMMU group half with the
    /// host: every other endpoint in their groups must be on vfio-pci already. Bridges
    /// are fine (the kernel lets vfio share a group with a PCIe bridge). Devices without
    /// an IOMMU group (no IOMMU, or a fake tree without groups) have nothing to check.
    pub fn check_viability(&self, devs: &[DevicePath]) -> Result<(), BindError> {
        let wanted: std::collections::BTreeSet<_> = devs.iter().map(DevicePath::address).collect();
        for dev in devs {
            let dir = self.existing_dir(dev)?;
            let group_err = |reason: String| BindError::Group {
                device: dev.clone(),
                reason,
            };
            let group_dir = match std::fs::canonicalize(dir.join("iommu_group")) {
                Ok(g) => g,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(group_err(e.to_string())),
            };
            let group = group_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let entries = std::fs::read_dir(group_dir.join("devices"))
                .map_err(|e| group_err(format!("{}: {e}", group_dir.display())))?;
            let mut others = Vec::new();
            for entry in entries {
                let entry = entry.map_err(|e| group_err(e.to_string()))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                let addr: passage_model::PciAddress = name
                    .parse()
                    .map_err(|e| group_err(format!("member {name:?}: {e}")))?;
                if wanted.contains(&addr) {
                    continue;
                }
                let member = entry.path();
                let class = super::read_attr(&member.join("class"))
                    .ok()
                    .and_then(|c| c.parse::<passage_model::pci::PciClass>().ok());
                // An unreadable class is treated as an endpoint: refusing is the safe side.
                if class.is_some_and(|c| c.is_bridge()) {
                    continue;
                }
                match bound_driver(&member).map_err(|e| group_err(e.to_string()))? {
                    Some(d) if d == VFIO_DRIVER => {}
                    Some(d) => others.push(format!("{name} (driver {d})")),
                    None => others.push(format!("{name} (no driver)")),
                }
            }
            if !others.is_empty() {
                others.sort();
                return Err(BindError::GroupNotViable {
                    device: dev.clone(),
                    group,
                    others,
                });
            }
        }
        Ok(())
    }

    /// Reserves every device in `devs` for passthrough, together: their IOMMU groups are
    /// checked as one set first (see [`Binder::check_viability`]), so a GPU and its audio
    /// function in one group go through in one call. Nothing is changed when the check
    /// fails; a failure part-way leaves the devices already bound bound (each is
    /// recorded, and unbinding gives it back).
    pub fn bind_passthrough_many(&self, devs: &[DevicePath]) -> Result<(), BindError> {
        self.check_viability(devs)?;
        for d in devs {
            self.bind_checked(d)?;
        }
        Ok(())
    }

    /// Reserves `dev` for passthrough. Binding a device already on vfio-pci is a no-op
    /// apart from making sure the binding is remembered. A device that shares its IOMMU
    /// group with other endpoints is refused: use [`Binder::bind_passthrough_many`].
    pub fn bind_passthrough(&self, dev: &DevicePath) -> Result<(), BindError> {
        self.bind_passthrough_many(std::slice::from_ref(dev))
    }

    /// Binds one device whose group viability the caller has checked (or, re-applying a
    /// saved binding, checked when it was first made).
    pub(crate) fn bind_checked(&self, dev: &DevicePath) -> Result<(), BindError> {
        let _guard = self.locked();
        let dir = self.existing_dir(dev)?;
        let vfio_dir = self.drivers().join(VFIO_DRIVER);
        if !vfio_dir.is_dir() {
            return Err(BindError::VfioMissing(vfio_dir));
        }
        let current = self.driver_of(dev, &dir)?;
        let mut state = self.state()?;
        if !state.bindings.iter().any(|b| &b.device == dev) {
            // A device found on vfio-pci without a record was put there by someone else;
            // giving it back later must not "restore" vfio-pci.
            let original = current.clone().filter(|d| d != VFIO_DRIVER);
            state.bindings.push(BindingRecord {
                device: dev.clone(),
                original_driver: original,
            });
            state.bindings.sort_by(|a, b| a.device.cmp(&b.device));
            self.save(&state)?;
        }
        let bdf = dev.address().to_string();
        // Set even when already bound, so a later reprobe (hotplug, driver reload) keeps it.
        self.write(dev, dir.join("driver_override"), VFIO_DRIVER)?;
        if current.as_deref() == Some(VFIO_DRIVER) {
            return Ok(());
        }
        if let Some(d) = &current {
            self.unbind_bounded(dev, d, &bdf)?;
        }
        self.write(dev, self.ops.root().join("bus/pci/drivers_probe"), &bdf)?;
        match self.driver_of(dev, &dir)? {
            Some(d) if d == VFIO_DRIVER => Ok(()),
            found => Err(BindError::WrongDriver {
                device: dev.clone(),
                expected: VFIO_DRIVER.to_string(),
                found: found.unwrap_or_else(|| "no driver".to_string()),
            }),
        }
    }

    /// Gives `dev` back to the driver it had before binding. A device not bound for
    /// passthrough is left alone.
    pub fn unbind_passthrough(&self, dev: &DevicePath) -> Result<(), BindError> {
        let _guard = self.locked();
        let dir = self.existing_dir(dev)?;
        let mut state = self.state()?;
        let record = state.bindings.iter().find(|b| &b.device == dev).cloned();
        let current = self.driver_of(dev, &dir)?;
        let bdf = dev.address().to_string();
        if current.as_deref() == Some(VFIO_DRIVER) || record.is_some() {
            // A newline clears the override (the kernel shows "(null)" again).
            self.write(dev, dir.join("driver_override"), "\n")?;
        }
        if current.as_deref() == Some(VFIO_DRIVER) {
            self.unbind_bounded(dev, VFIO_DRIVER, &bdf)?;
            let original = record.as_ref().and_then(|r| r.original_driver.clone());
            match &original {
                Some(o) if self.drivers().join(o).is_dir() => {
                    self.write(dev, self.drivers().join(o).join("bind"), &bdf)?;
                }
                _ => {
                    self.write(dev, self.ops.root().join("bus/pci/drivers_probe"), &bdf)?;
                }
            }
            if let Some(o) = original {
                let found = self.driver_of(dev, &dir)?;
                if found.as_deref() != Some(o.as_str()) {
                    return Err(BindError::WrongDriver {
                        device: dev.clone(),
                        expected: o,
                        found: found.unwrap_or_else(|| "no driver".to_string()),
                    });
                }
            }
        }
        if record.is_some() {
            state.bindings.retain(|b| &b.device != dev);
            self.save(&state)?;
        }
        Ok(())
    }

    /// Re-applies every remembered binding (after an agent or host restart). Each device
    /// is tried; the failures come back with the device they concern.
    pub fn reapply_bindings(&self) -> Result<Vec<(DevicePath, BindError)>, BindError> {
        let state = self.state()?;
        let mut failures = Vec::new();
        // Group viability was checked when the binding was made; re-applying it device by
        // device must not fail because the rest of the group is not back yet.
        for b in state.bindings {
            if let Err(e) = self.bind_checked(&b.device) {
                failures.push((b.device, e));
            }
        }
        Ok(failures)
    }
}

/// The device nodes a driver's users hold open: `/dev/nvidia*` (the GPUs, `nvidiactl`,
/// `nvidia-uvm`) for nvidia, `/dev/vfio/*` for vfio-pci (a VM's QEMU); none for others.
fn node_glob(dev_root: &Path, driver: &str) -> String {
    match driver {
        VFIO_DRIVER => format!("{}/*", dev_root.join("vfio").display()),
        d => format!("{}*", dev_root.join(d).display()),
    }
}

fn holds_node(target: &Path, dev_root: &Path, driver: &str) -> bool {
    match driver {
        VFIO_DRIVER => target.parent() == Some(dev_root.join("vfio").as_path()),
        d => {
            target.parent() == Some(dev_root)
                && target
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(d))
        }
    }
}

/// `pid N (COMMAND)` for each process under `proc_root` with a file descriptor on one of
/// `driver`'s device nodes under `dev_root`, by pid. Processes that go away or that the
/// agent may not look into are skipped.
pub fn device_holders(proc_root: &Path, dev_root: &Path, driver: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    let mut found: Vec<(u32, String)> = entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let fds = std::fs::read_dir(e.path().join("fd")).ok()?;
            let holds = fds
                .flatten()
                .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                .any(|t| holds_node(&t, dev_root, driver));
            if !holds {
                return None;
            }
            let comm = crate::host::read_attr(&e.path().join("comm"))
                .map(|c| c.trim().to_string())
                .unwrap_or_else(|_| "?".to_string());
            Some((pid, comm))
        })
        .collect();
    found.sort();
    found
        .into_iter()
        .map(|(pid, comm)| format!("pid {pid} ({comm})"))
        .collect()
}
