//! Lending a GPU to its vendor's driver for the zeroing helper, and taking it back.
//!
//! CUDA reaches a GPU only through NVIDIA's driver, and on the usual passthrough host a
//! GPU between tenants is on `vfio-pci` or on no driver at all. The zeroing step binds it
//! to `nvidia` (through `driver_override`, as the binder does for `vfio-pci`), runs the
//! helper, and gives it back to the driver and override it had. Each write that can
//! block (an unbind waits for the driver's users) has a bound.

use super::Outcome;
use crate::host::{SysfsOps, bound_driver, read_attr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// NVIDIA's kernel driver, as sysfs names it.
pub const NVIDIA_DRIVER: &str = "nvidia";
/// How long one bind, unbind or probe may take before the step gives up on it.
pub const DRIVER_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// A GPU taken from its driver for the vendor's: what to give it back.
#[derive(Debug)]
pub(super) struct Lent {
    dir: PathBuf,
    bdf: String,
    driver: Option<String>,
    /// Its `driver_override` before, `None` when it had none.
    override_: Option<String>,
}

impl Lent {
    /// The driver it is given back to, for the report.
    pub(super) fn driver_name(&self) -> &str {
        self.driver.as_deref().unwrap_or("no driver")
    }
}

/// Writes `value` to `path` on a thread of its own, waiting at most `timeout`: a write the
/// kernel does not finish (an unbind while a process holds the device) is left behind and
/// reported.
fn write_bounded(
    ops: &Arc<dyn SysfsOps>,
    path: &Path,
    value: &str,
    timeout: Duration,
) -> Result<(), String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (o, p, v) = (ops.clone(), path.to_path_buf(), value.to_string());
    std::thread::Builder::new()
        .name("scrub driver write".to_string())
        .spawn(move || {
            let _ = tx.send(o.write_attr(&p, &v));
        })
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    match rx.recv_timeout(timeout) {
        Ok(r) => r.map_err(|e| format!("writing {} to {}: {e}", value.trim(), path.display())),
        Err(_) => Err(format!(
            "writing {} to {} did not finish within {} s (the device is busy)",
            value.trim(),
            path.display(),
            timeout.as_secs()
        )),
    }
}

fn override_of(dir: &Path) -> Option<String> {
    let text = read_attr(&dir.join("driver_override")).ok()?;
    let text = text.trim();
    (!text.is_empty() && text != "(null)").then(|| text.to_string())
}

/// Puts the GPU at `dir` on `vendor`'s driver; `Ok(None)` when it already is. A host
/// without that driver cannot clear the GPU ([`Outcome::Unable`]); a bind that fails or
/// hangs fails the step.
pub(super) fn lend(
    ops: &Arc<dyn SysfsOps>,
    dir: &Path,
    bdf: &str,
    vendor: &str,
    timeout: Duration,
) -> Result<Option<Lent>, Outcome> {
    let current =
        bound_driver(dir).map_err(|e| Outcome::Failed(format!("reading {bdf}'s driver: {e}")))?;
    if current.as_deref() == Some(vendor) {
        return Ok(None);
    }
    let drivers = ops.root().join("bus/pci/drivers");
    if !drivers.join(vendor).is_dir() {
        return Err(Outcome::Unable(format!(
            "the {vendor} driver is not loaded (no {}), so {bdf} cannot be lent to it",
            drivers.join(vendor).display()
        )));
    }
    let lent = Lent {
        dir: dir.to_path_buf(),
        bdf: bdf.to_string(),
        driver: current.clone(),
        override_: override_of(dir),
    };
    let go = || -> Result<(), String> {
        write_bounded(ops, &dir.join("driver_override"), vendor, timeout)?;
        if let Some(d) = &current {
            write_bounded(ops, &drivers.join(d).join("unbind"), bdf, timeout)?;
        }
        write_bounded(ops, &ops.root().join("bus/pci/drivers_probe"), bdf, timeout)?;
        match bound_driver(dir) {
            Ok(Some(d)) if d == vendor => Ok(()),
            Ok(found) => Err(format!(
                "{bdf} is on {} after binding it to {vendor}",
                found.as_deref().unwrap_or("no driver")
            )),
            Err(e) => Err(format!("reading {bdf}'s driver: {e}")),
        }
    };
    match go() {
        Ok(()) => Ok(Some(lent)),
        Err(why) => {
            // Back where it was, as far as that goes; the device is quarantined anyway.
            let back = give_back(ops, &lent, vendor, timeout).err();
            Err(Outcome::Failed(match back {
                None => format!("binding {bdf} to {vendor}: {why}"),
                Some(b) => format!("binding {bdf} to {vendor}: {why}; then {b}"),
            }))
        }
    }
}

/// Gives a lent GPU back to the driver and override it had.
pub(super) fn give_back(
    ops: &Arc<dyn SysfsOps>,
    lent: &Lent,
    vendor: &str,
    timeout: Duration,
) -> Result<(), String> {
    let (dir, bdf) = (&lent.dir, lent.bdf.as_str());
    let drivers = ops.root().join("bus/pci/drivers");
    // A newline clears the override (the kernel shows "(null)" again).
    let override_ = lent.override_.clone().unwrap_or_else(|| "\n".to_string());
    write_bounded(ops, &dir.join("driver_override"), &override_, timeout)?;
    if bound_driver(dir).ok().flatten().as_deref() == Some(vendor) {
        write_bounded(ops, &drivers.join(vendor).join("unbind"), bdf, timeout)?;
    }
    if let Some(d) = &lent.driver {
        write_bounded(ops, &drivers.join(d).join("bind"), bdf, timeout)?;
    }
    match bound_driver(dir) {
        Ok(found) if found == lent.driver => Ok(()),
        Ok(found) => Err(format!(
            "giving {bdf} back to {}: it is on {}",
            lent.driver.as_deref().unwrap_or("no driver"),
            found.as_deref().unwrap_or("no driver")
        )),
        Err(e) => Err(format!("reading {bdf}'s driver: {e}")),
    }
}
