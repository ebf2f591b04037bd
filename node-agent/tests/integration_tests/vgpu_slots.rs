//! The vGPUs a node makes for VMs, over the fake kernel's two frameworks: made once per
//! owner, released only by their owner, destroyed by the scrub, adopted after a restart,
//! refused with the kernel's words when the type does not fit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use node_agent::fake::{FakeOptions, FakeSpec, FakeVgpu, GpuModel};
use node_agent::host::{VgpuSlots, open_sysfs};
use passage_model::{DevicePath, VmId};

fn world(model: GpuModel, vgpu: FakeVgpu) -> (tempfile::TempDir, VgpuSlots, DevicePath) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sys");
    let spec = FakeSpec {
        gpus: 1,
        model,
        numa_nodes: 1,
    };
    let opts = FakeOptions {
        vgpu: Some(vgpu),
        ..FakeOptions::default()
    };
    node_agent::fake::generate_with(&root, &spec, &opts).unwrap();
    let gpu = node_agent::host::discover(&root)
        .devices
        .into_iter()
        .find(|d| d.details.as_ref().is_some_and(|x| x.vgpu.is_some()))
        .unwrap()
        .id;
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let slots = VgpuSlots::new(open_sysfs(&root).unwrap(), &state);
    (dir, slots, gpu)
}

fn vgpus_on(dir: &tempfile::TempDir) -> usize {
    let root = dir.path().join("sys");
    node_agent::host::discover(&root)
        .devices
        .iter()
        .filter_map(|d| d.details.as_ref()?.vgpu.as_ref())
        .map(|h| h.vgpus.len())
        .sum()
}

#[test]
fn a_late_release_never_clears_a_later_owners_vgpu() {
    for (model, framework, ty) in [
        (GpuModel::A100, FakeVgpu::Mdev, "GRID A100-10C"),
        (GpuModel::H100, FakeVgpu::Vfio, "NVIDIA H100XM-10C"),
    ] {
        let (dir, slots, gpu) = world(model, framework);
        let slot = gpu.with_vgpu(uuid::Uuid::new_v4());
        let (a, b) = (VmId::new_random(), VmId::new_random());
        slots.make(&slot, ty, a).unwrap();
        slots.make(&slot, ty, a).unwrap();
        assert_eq!(vgpus_on(&dir), 1, "{model:?}: made once");
        let err = slots.make(&slot, ty, b).unwrap_err();
        assert!(err.contains(&a.to_string()), "{err}");
        // B's release of A's vGPU does nothing.
        slots.release(&slot, b).unwrap();
        assert_eq!(vgpus_on(&dir), 1);
        // A restarted agent finds what it made.
        let state = dir.path().join("state");
        let again = VgpuSlots::new(open_sysfs(&dir.path().join("sys")).unwrap(), &state);
        assert_eq!(again.records().unwrap().len(), 1);
        let launch = again.launch_path(&slot).unwrap();
        assert_eq!(launch.vgpu(), slot.vgpu());
        if framework == FakeVgpu::Vfio {
            assert_ne!(
                launch.address(),
                gpu.address(),
                "the VF is passed, not the GPU"
            );
        }
        again.release(&slot, a).unwrap();
        assert_eq!(vgpus_on(&dir), 0, "{model:?}: released by its owner");
        // B gets the same slot; A's late release leaves it.
        again.make(&slot, ty, b).unwrap();
        again.release(&slot, a).unwrap();
        assert_eq!(vgpus_on(&dir), 1, "{model:?}: B's vGPU stays");
        // The scrub destroys it whoever made it, and checks it is gone.
        let report = again.scrub(&slot);
        assert!(report.ok, "{report:?}");
        assert_eq!(report.steps.len(), 2);
        assert_eq!(vgpus_on(&dir), 0);
        assert!(again.records().unwrap().is_empty());
        assert!(again.scrub(&slot).ok, "scrubbing a gone vGPU is done");
    }
}

#[test]
fn a_type_that_does_not_fit_fails_with_the_kernels_words() {
    let (_dir, slots, gpu) = world(GpuModel::A100, FakeVgpu::Mdev);
    let vm = VmId::new_random();
    // GRID A100-20C fits twice; one more is refused by the driver.
    for _ in 0..2 {
        slots
            .make(&gpu.with_vgpu(uuid::Uuid::new_v4()), "GRID A100-20C", vm)
            .unwrap();
    }
    let err = slots
        .make(&gpu.with_vgpu(uuid::Uuid::new_v4()), "GRID A100-20C", vm)
        .unwrap_err();
    assert!(err.contains("available_instances 0"), "{err}");
    let err = slots
        .make(&gpu.with_vgpu(uuid::Uuid::new_v4()), "no such type", vm)
        .unwrap_err();
    assert!(err.contains("offers no vGPU type"), "{err}");
    let err = slots.make(&gpu, "GRID A100-20C", vm).unwrap_err();
    assert!(err.contains("not a vGPU slot"), "{err}");
}

/// MIG mode of the world's GPU, as the node's discovery reads it (through the tree's
/// nvidia-smi stand-in).
fn mig_mode(dir: &tempfile::TempDir) -> Option<bool> {
    node_agent::host::discover(&dir.path().join("sys"))
        .devices
        .iter()
        .find_map(|d| d.details.as_ref()?.vgpu.as_ref()?.mig_mode)
}

/// Both frameworks: a MIG-backed type on a GPU with MIG mode off turns it on first (by
/// its name, or by the id mdev lists it under); a time-sliced type then cannot turn it
/// off while the MIG vGPU exists, and says so in nvidia-smi's words; once that vGPU is
/// gone it can.
#[test]
fn a_vgpu_type_gets_the_mig_mode_it_needs() {
    for (model, framework, mig_type, sliced) in [
        (
            GpuModel::A100,
            FakeVgpu::Mdev,
            "nvidia-468",
            "GRID A100-10C",
        ),
        (
            GpuModel::H100,
            FakeVgpu::Vfio,
            "NVIDIA H100XM-1-10C",
            "NVIDIA H100XM-10C",
        ),
    ] {
        let (dir, slots, gpu) = world(model, framework);
        assert_eq!(mig_mode(&dir), Some(false), "{model:?}");
        let (a, b) = (VmId::new_random(), VmId::new_random());
        let mig_slot = gpu.with_vgpu(uuid::Uuid::new_v4());
        slots.make(&mig_slot, mig_type, a).unwrap();
        assert_eq!(mig_mode(&dir), Some(true), "{model:?}");
        assert_eq!(vgpus_on(&dir), 1);
        let sliced_slot = gpu.with_vgpu(uuid::Uuid::new_v4());
        let err = slots.make(&sliced_slot, sliced, b).unwrap_err();
        assert!(err.contains("needs MIG mode off"), "{model:?}: {err}");
        assert!(err.contains("In use by another client"), "{model:?}: {err}");
        assert_eq!(mig_mode(&dir), Some(true));
        slots.release(&mig_slot, a).unwrap();
        slots.make(&sliced_slot, sliced, b).unwrap();
        assert_eq!(mig_mode(&dir), Some(false), "{model:?}");
        assert_eq!(vgpus_on(&dir), 1);
    }
}

/// A GPU left in MIG mode by its MIG-backed vGPUs goes back to the next tenant whole with
/// MIG mode off: its whole-GPU scrub turns the mode off before the pipeline (and says
/// so); a GPU whose mode is off gets no such step.
#[test]
fn the_whole_gpu_scrub_turns_mig_mode_off() {
    use node_agent::agent::Executor;
    use node_agent::host::Binder;
    use node_agent::hypervisor::SimHypervisor;
    use passage_model::protocol::Task;
    use std::sync::Arc;
    for (model, framework, mig_type) in [
        (GpuModel::A100, FakeVgpu::Mdev, "nvidia-468"),
        (GpuModel::H100, FakeVgpu::Vfio, "NVIDIA H100XM-1-10C"),
    ] {
        let (dir, slots, gpu) = world(model, framework);
        let root = dir.path().join("sys");
        let state = dir.path().join("state");
        let binder = Binder::new(open_sysfs(&root).unwrap(), &state);
        let hv = Arc::new(SimHypervisor::open(&state, None).unwrap());
        let exec = Executor::new(binder, hv);
        let scrub = |exec: &Executor| {
            let r = exec.execute(&Task::Scrub {
                devices: vec![gpu.clone()],
                pipelines: Default::default(),
            });
            assert!(r.ok, "{model:?}: {:?}", r.error);
            r.scrub_reports.into_iter().next().unwrap()
        };
        let clean = scrub(&exec);
        assert!(
            clean.steps.iter().all(|s| s.name != "mig_off"),
            "{model:?}: MIG off already: {:?}",
            clean.steps
        );

        let vm = VmId::new_random();
        let slot = gpu.with_vgpu(uuid::Uuid::new_v4());
        slots.make(&slot, mig_type, vm).unwrap();
        assert_eq!(mig_mode(&dir), Some(true), "{model:?}");
        slots.release(&slot, vm).unwrap();
        let gone = slots.scrub(&slot);
        assert!(gone.ok, "{model:?}: {gone:?}");
        assert_eq!(
            mig_mode(&dir),
            Some(true),
            "{model:?}: the slot's scrub leaves the mode"
        );

        let whole = scrub(&exec);
        let first = whole.steps.first().unwrap();
        assert_eq!(first.name, "mig_off", "{model:?}: {:?}", whole.steps);
        assert!(first.ok, "{model:?}: {first:?}");
        assert!(whole.steps.len() > 1, "the pipeline ran after it");
        assert_eq!(mig_mode(&dir), Some(false), "{model:?}");
    }
}
