//! A NIC's SR-IOV virtual functions over the fake kernel: `set_vfs` tasks make and take
//! down VFs, each VF is discovered as a function of its own (its `physfn`, its own
//! IOMMU group, its VF driver), counts beyond `sriov_totalvfs` and VFs passed through are
//! refused in the kernel's words.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use node_agent::agent::Executor;
use node_agent::fake::{FakeSpec, GpuModel, generate};
use node_agent::host::{Binder, discover, open_sysfs};
use node_agent::hypervisor::SimHypervisor;
use passage_model::protocol::Task;
use passage_model::{DevicePath, PciDevice};
use std::sync::Arc;

fn world() -> (tempfile::TempDir, Executor, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sys");
    let state = dir.path().join("state");
    generate(
        &root,
        &FakeSpec {
            gpus: 1,
            model: GpuModel::H100,
            numa_nodes: 1,
        },
    )
    .unwrap();
    let binder = Binder::new(open_sysfs(&root).unwrap(), &state);
    let hv = Arc::new(SimHypervisor::open(&state, None).unwrap());
    (dir, Executor::new(binder, hv), root)
}

fn functions(root: &std::path::Path) -> Vec<PciDevice> {
    let found = discover(root);
    assert!(found.notes.is_empty(), "{:?}", found.notes);
    found.devices
}

/// The i350's two ports.
fn ports(root: &std::path::Path) -> Vec<DevicePath> {
    functions(root)
        .into_iter()
        .filter(|d| d.device.to_string() == "1521")
        .map(|d| d.id)
        .collect()
}

fn vfs_of(root: &std::path::Path, port: &DevicePath) -> Vec<PciDevice> {
    functions(root)
        .into_iter()
        .filter(|d| d.details.as_ref().and_then(|x| x.physfn) == Some(port.address()))
        .collect()
}

fn set(exec: &Executor, port: &DevicePath, n: u32) -> Result<(), String> {
    let r = exec.execute(&Task::SetVfs {
        function: port.clone(),
        num_vfs: n,
    });
    if r.ok {
        Ok(())
    } else {
        Err(r.error.unwrap_or_default())
    }
}

#[test]
fn vfs_are_made_discovered_and_taken_down() {
    let (_dir, exec, root) = world();
    let ports = ports(&root);
    assert_eq!(ports.len(), 2);
    let (p0, p1) = (&ports[0], &ports[1]);
    set(&exec, p0, 3).unwrap();
    set(&exec, p0, 3).unwrap();
    let vfs = vfs_of(&root, p0);
    assert_eq!(vfs.len(), 3, "made once");
    let mut groups: Vec<u32> = vfs.iter().map(|v| v.iommu_group.unwrap()).collect();
    groups.dedup();
    assert_eq!(groups.len(), 3, "each VF in a group of its own");
    for v in &vfs {
        assert_eq!(v.device.to_string(), "1520", "an i350 VF's own id");
        assert_eq!(v.driver.as_deref(), Some("igbvf"));
        // A sibling of its port, at first VF offset 128, stride 2.
        assert_eq!(v.id.parents(), p0.parents());
    }
    let pf = functions(&root).into_iter().find(|d| d.id == *p0).unwrap();
    let details = pf.details.unwrap();
    assert_eq!(
        (details.sriov_totalvfs, details.sriov_numvfs),
        (Some(7), Some(3))
    );
    assert!(vfs_of(&root, p1).is_empty(), "the other port is untouched");

    // Beyond what the function can make: the kernel's limit, nothing changed.
    let e = set(&exec, p0, 8).unwrap_err();
    assert!(
        e.contains("makes at most 7 VFs (sriov_totalvfs); 8 were asked"),
        "{e}"
    );
    assert_eq!(vfs_of(&root, p0).len(), 3);

    // A VF passed through keeps every VF of its port.
    let vf = vfs[1].id.clone();
    exec.binder.bind_passthrough(&vf).unwrap();
    let e = set(&exec, p0, 2).unwrap_err();
    assert!(e.contains("passed through to a VM"), "{e}");
    assert_eq!(vfs_of(&root, p0).len(), 3);
    exec.binder.unbind_passthrough(&vf).unwrap();

    // A new count takes the VFs down first, then makes the new ones.
    set(&exec, p0, 2).unwrap();
    assert_eq!(vfs_of(&root, p0).len(), 2);
    set(&exec, p0, 0).unwrap();
    assert!(vfs_of(&root, p0).is_empty());
    assert!(
        !root
            .join("bus/pci/devices")
            .join(vf.address().to_string())
            .exists()
    );

    // Functions that cannot make VFs, and VFs, are refused.
    let gpu = functions(&root)
        .into_iter()
        .find(|d| d.class.is_gpu_like())
        .unwrap()
        .id;
    let e = set(&exec, &gpu, 1).unwrap_err();
    assert!(e.contains("cannot make virtual functions"), "{e}");
    set(&exec, p1, 1).unwrap();
    let vf = vfs_of(&root, p1).remove(0).id;
    let e = set(&exec, &vf, 1).unwrap_err();
    assert!(e.contains("a VF makes no VFs"), "{e}");
}
