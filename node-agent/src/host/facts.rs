//! What a VM launch needs to know of one function on this host: its regions, its NUMA
//! node and the PCIe switch above it. Read from the same attributes, with the same
//! parsers, as discovery.

use super::{AttrDir, details, device_dir};
use passage_model::{DevicePath, PciAddress, PciBar};
use std::path::{Path, PathBuf};

/// One function's facts for a launch (see [`function_facts`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FunctionFacts {
    /// Its vendor and class code (`0x030200`): which guest-side hints apply to it.
    pub vendor: u16,
    pub class: u32,
    /// Its assigned regions, by index (sysfs `resource`); the guest's PCI holes must
    /// hold them.
    pub bars: Vec<PciBar>,
    /// Its NUMA node; `None` where the kernel says -1 or has no NUMA support.
    pub numa_node: Option<u32>,
    /// The upstream port of the PCIe switch directly above it, if it sits behind one:
    /// functions behind one switch talk peer to peer without crossing the root complex,
    /// so a launch that keeps them together behind one guest switch keeps that path.
    pub switch: Option<PciAddress>,
    /// Attributes that were present but could not be read or parsed (`path: reason`);
    /// their fields are left empty.
    pub notes: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum FactsError {
    #[error("{path}: {why}")]
    Function { path: PathBuf, why: String },
}

/// The facts of the function at `id` in the tree at `sysfs_root`.
///
/// The switch is read from the device path: a switch is an upstream port with
/// downstream ports below it, so a function behind one has at least three bridges above
/// it (root port, upstream port, downstream port) and the upstream port is the one
/// above its downstream port. A function straight below a root port, or below a lone
/// PCIe-to-PCI bridge, has none.
pub fn function_facts(sysfs_root: &Path, id: &DevicePath) -> Result<FunctionFacts, FactsError> {
    let path = device_dir(sysfs_root, &id.gpu());
    let err = |why: String| FactsError::Function {
        path: path.clone(),
        why,
    };
    let dir = AttrDir::open(&path).map_err(|e| err(e.to_string()))?;
    let ids = super::discover::read_ids(&dir).map_err(err)?;
    let numa_node = ids.numa_node;
    let mut notes = Vec::new();
    let bars = details::read_bars(&dir, &mut notes);
    let parents = id.parents();
    let switch = (parents.len() >= 3).then(|| parents[parents.len() - 2]);
    Ok(FunctionFacts {
        vendor: ids.vendor.0,
        class: ids.class.0,
        bars,
        numa_node,
        switch,
        notes,
    })
}

/// [`function_facts`] for the function at `addr`, found through `bus/pci/devices`.
pub fn function_facts_by_address(
    sysfs_root: &Path,
    addr: PciAddress,
) -> Result<FunctionFacts, FactsError> {
    function_facts(sysfs_root, &device_path_of(sysfs_root, addr)?)
}

/// The device path of `addr`: where its `bus/pci/devices` link leads, which must stay
/// inside the root and name the same function.
pub fn device_path_of(sysfs_root: &Path, addr: PciAddress) -> Result<DevicePath, FactsError> {
    let link = sysfs_root.join("bus/pci/devices").join(addr.to_string());
    let err = |why: String| FactsError::Function {
        path: link.clone(),
        why,
    };
    let root = std::fs::canonicalize(sysfs_root).map_err(|e| err(e.to_string()))?;
    let real = std::fs::canonicalize(&link).map_err(|e| err(e.to_string()))?;
    let rel = real
        .strip_prefix(&root)
        .map_err(|_| err("leads outside the sysfs root".into()))?;
    let id: DevicePath = format!("/{}", rel.to_string_lossy())
        .parse()
        .map_err(|e| err(format!("{e}")))?;
    if id.address() != addr {
        return Err(err(format!("leads to {id}, another function")));
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{FakeSpec, GpuModel, generate};

    #[test]
    fn a_generated_gpu() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("sys");
        let tree = generate(
            &root,
            &FakeSpec {
                gpus: 4,
                model: GpuModel::H100,
                numa_nodes: 2,
            },
        )
        .unwrap();
        let gpu = tree.gpus.last().unwrap();
        let facts = function_facts(&root, gpu).unwrap();
        assert!(facts.notes.is_empty(), "{:?}", facts.notes);
        assert_eq!(facts.numa_node, Some(1));
        assert_eq!(facts.switch, Some(gpu.parents()[1]));
        let sizes: Vec<(u8, u64, bool)> = facts
            .bars
            .iter()
            .map(|b| (b.index, b.size, b.prefetchable))
            .collect();
        assert_eq!(
            sizes,
            vec![
                (0, 16 << 20, false),
                (1, 128 << 30, true),
                (3, 32 << 20, true)
            ]
        );
        assert_eq!(
            function_facts_by_address(&root, gpu.address()).unwrap(),
            facts
        );
        // A root port sits below no switch; a missing function is an error.
        let rp = gpu.parents()[0];
        assert_eq!(function_facts_by_address(&root, rp).unwrap().switch, None);
        let absent: PciAddress = "0000:ff:1f.7".parse().unwrap();
        assert!(function_facts_by_address(&root, absent).is_err());
        // A garbled `resource` is a note, not an error.
        std::fs::write(device_dir(&root, gpu).join("resource"), "garbage\n").unwrap();
        let facts = function_facts(&root, gpu).unwrap();
        assert!(facts.bars.is_empty());
        assert_eq!(facts.notes.len(), 1);
    }
}
