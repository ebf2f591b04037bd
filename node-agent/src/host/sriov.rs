//! A function's SR-IOV virtual functions: how many it has is its `sriov_numvfs`. The
//! kernel changes that count only from or to 0, and taking VFs down destroys each of
//! them, so a count is changed only while none of the function's VFs is passed through.

use super::{SysfsOps, VFIO_DRIVER, bound_driver, device_dir, link_basename, read_attr};
use passage_model::DevicePath;
use std::path::Path;

/// Makes `function` have `n` VFs: nothing when it has them, else its VFs taken down (if
/// any) and `n` made. Errors say why in the kernel's words.
pub fn set_numvfs(ops: &dyn SysfsOps, function: &DevicePath, n: u32) -> Result<(), String> {
    if function.vgpu().is_some() {
        return Err(format!("{function} is a vGPU, not a PCI function"));
    }
    let dir = device_dir(ops.root(), function);
    if !dir.is_dir() {
        return Err(format!("{function}: no such function on this node"));
    }
    if link_basename(&dir.join("physfn"))
        .map_err(|e| format!("{function}/physfn: {e}"))?
        .is_some()
    {
        return Err(format!("{function} is a VF: a VF makes no VFs"));
    }
    let read = |name: &str| -> Result<u32, String> {
        let text = read_attr(&dir.join(name)).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                format!("{function} cannot make virtual functions (it has no {name})")
            }
            _ => format!("{function}/{name}: {e}"),
        })?;
        text.trim()
            .parse()
            .map_err(|_| format!("{function}/{name}: {text:?} is not a count"))
    };
    let total = read("sriov_totalvfs")?;
    if n > total {
        return Err(format!(
            "{function} makes at most {total} VFs (sriov_totalvfs); {n} were asked"
        ));
    }
    let have = read("sriov_numvfs")?;
    if have == n {
        return Ok(());
    }
    let attr = dir.join("sriov_numvfs");
    if have != 0 {
        if let Some(vf) = passed_through(&dir, have)? {
            return Err(format!(
                "VF {vf} of {function} is passed through to a VM (bound to {VFIO_DRIVER}); \
                 its VFs stay until it is released"
            ));
        }
        ops.write_attr(&attr, "0")
            .map_err(|e| format!("taking down the VFs of {function}: {e}"))?;
    }
    if n != 0 {
        ops.write_attr(&attr, &n.to_string())
            .map_err(|e| format!("making {n} VFs on {function}: {e}"))?;
    }
    Ok(())
}

/// The first of the function's `count` VFs that is bound to vfio-pci.
fn passed_through(dir: &Path, count: u32) -> Result<Option<String>, String> {
    for i in 0..count {
        let link = dir.join(format!("virtfn{i}"));
        let Some(vf) = link_basename(&link).map_err(|e| format!("{}: {e}", link.display()))? else {
            continue;
        };
        let vf_dir = dir.parent().unwrap_or(dir).join(&vf);
        let driver = bound_driver(&vf_dir).map_err(|e| format!("{vf}/driver: {e}"))?;
        if driver.as_deref() == Some(VFIO_DRIVER) {
            return Ok(Some(vf));
        }
    }
    Ok(None)
}
