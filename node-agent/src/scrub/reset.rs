//! The reset step: the function's own reset (FLR or whatever method the kernel picked,
//! through `reset`), else a reset of its parent bridge.

use super::Outcome;
use crate::host::SysfsOps;
use passage_model::PciAddress;
use std::fs;
use std::path::Path;

/// Resets the function at `dir`; the name says which kind of reset ran.
pub(super) fn reset(ops: &dyn SysfsOps, dir: &Path, addr: PciAddress) -> (&'static str, Outcome) {
    let own = dir.join("reset");
    if own.exists() {
        return (
            "reset",
            match ops.write_attr(&own, "1") {
                Ok(()) => Outcome::Done(None),
                Err(e) => Outcome::Failed(format!("writing {}: {e}", own.display())),
            },
        );
    }
    // The kernel shows no `reset` when it knows no method for the function (no FLR, no
    // PM reset, not alone on its bus). Resetting the bridge above resets its link and
    // with it everything below.
    let bridge = dir.parent().filter(|p| address_of(p).is_some());
    let Some(bridge) = bridge.filter(|b| b.join("reset").exists()) else {
        return (
            "reset",
            Outcome::Failed(format!(
                "{addr} has no reset attribute (the kernel knows no reset method for it) \
                 and no parent bridge with one"
            )),
        );
    };
    let bridge_name = address_of(bridge)
        .map(|a| a.to_string())
        .unwrap_or_default();
    // A bridge reset hits every function below it: refuse when that reaches beyond this
    // card, which could be another tenant's device.
    let others: Vec<String> = match functions_below(bridge) {
        Ok(found) => found
            .into_iter()
            .filter(|a| (a.domain, a.bus, a.device) != (addr.domain, addr.bus, addr.device))
            .map(|a| a.to_string())
            .collect(),
        Err(e) => {
            return (
                "bus_reset",
                Outcome::Failed(format!("listing the functions below {bridge_name}: {e}")),
            );
        }
    };
    if !others.is_empty() {
        return (
            "bus_reset",
            Outcome::Failed(format!(
                "{addr} has no function reset, and resetting bridge {bridge_name} would also \
                 reset {}",
                others.join(", ")
            )),
        );
    }
    let attr = bridge.join("reset");
    match ops.write_attr(&attr, "1") {
        Ok(()) => (
            "bus_reset",
            Outcome::Done(Some(format!(
                "{addr} has no function reset; reset bridge {bridge_name}"
            ))),
        ),
        Err(e) => (
            "bus_reset",
            Outcome::Failed(format!("writing {}: {e}", attr.display())),
        ),
    }
}

fn address_of(dir: &Path) -> Option<PciAddress> {
    dir.file_name()?.to_str()?.parse().ok()
}

/// Every PCI function in the subtree under `dir` (not following links: `driver`,
/// `subsystem` and the like point back up the tree).
fn functions_below(dir: &Path) -> std::io::Result<Vec<PciAddress>> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in fs::read_dir(&d)? {
            let entry = entry?;
            if !entry.file_type()?.is_dir() {
                continue;
            }
            let path = entry.path();
            if let Some(a) = address_of(&path) {
                found.push(a);
                pending.push(path);
            }
        }
    }
    Ok(found)
}
