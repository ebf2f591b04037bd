#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Passthrough binding, scrubbing and task execution over a generated tree driven by the
//! fake kernel, checked through the real `node-agent lspci` binary and discovery.

use node_agent::agent::Executor;
use node_agent::fake::{FakeOptions, FakeSpec, GpuModel, RESET_LOG, generate, generate_with};
use node_agent::host::{BindError, Binder, discover, open_sysfs};
use node_agent::hypervisor::{Hypervisor, SimHypervisor};
use node_agent::scrub::scrub;
use passage_model::protocol::{Task, VmSpec};
use passage_model::{DevicePath, VmId};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

struct World {
    _dir: tempfile::TempDir,
    root: std::path::PathBuf,
    state: std::path::PathBuf,
    gpus: Vec<DevicePath>,
}

fn world(gpus: u32) -> World {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sys");
    let state = dir.path().join("state");
    let tree = generate(
        &root,
        &FakeSpec {
            gpus,
            model: GpuModel::A100,
            numa_nodes: 2,
        },
    )
    .unwrap();
    World {
        _dir: dir,
        root,
        state,
        gpus: tree.gpus,
    }
}

fn binder(w: &World) -> Binder {
    Binder::new(open_sysfs(&w.root).unwrap(), &w.state)
}

fn driver_via_cli(root: &Path, dev: &DevicePath) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_node-agent"))
        .arg("lspci")
        .arg("--sysfs-root")
        .arg(root)
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8(out.stdout).unwrap();
    let line = stdout
        .lines()
        .find(|l| l.split_whitespace().nth(5) == Some(&dev.to_string()))
        .unwrap_or_else(|| panic!("{dev} not listed:\n{stdout}"));
    line.split_whitespace().nth(6).unwrap().to_string()
}

fn driver_override(root: &Path, dev: &DevicePath) -> String {
    let p = root
        .join(dev.to_string().trim_start_matches('/'))
        .join("driver_override");
    std::fs::read_to_string(p).unwrap().trim().to_string()
}

#[test]
fn bind_and_unbind_round_trip_idempotently() {
    let w = world(4);
    let b = binder(&w);
    let gpu = &w.gpus[1];
    assert_eq!(driver_via_cli(&w.root, gpu), "nvidia");

    b.bind_passthrough(gpu).unwrap();
    assert_eq!(driver_via_cli(&w.root, gpu), "vfio-pci");
    assert_eq!(driver_override(&w.root, gpu), "vfio-pci");
    b.bind_passthrough(gpu).unwrap();
    assert_eq!(driver_via_cli(&w.root, gpu), "vfio-pci");
    // Only the one device moved: no binding by vendor:device.
    assert_eq!(driver_via_cli(&w.root, &w.gpus[0]), "nvidia");
    let state = b.state().unwrap();
    assert_eq!(state.bindings.len(), 1);
    assert_eq!(state.bindings[0].original_driver.as_deref(), Some("nvidia"));
    // Back links in the driver directories follow the device.
    let bdf = gpu.address().to_string();
    assert!(w.root.join("bus/pci/drivers/vfio-pci").join(&bdf).exists());
    assert!(!w.root.join("bus/pci/drivers/nvidia").join(&bdf).exists());

    b.unbind_passthrough(gpu).unwrap();
    assert_eq!(driver_via_cli(&w.root, gpu), "nvidia");
    assert_eq!(driver_override(&w.root, gpu), "(null)");
    assert!(b.state().unwrap().bindings.is_empty());
    b.unbind_passthrough(gpu).unwrap();
    assert_eq!(driver_via_cli(&w.root, gpu), "nvidia");
    assert!(w.root.join("bus/pci/drivers/nvidia").join(&bdf).exists());
}

#[test]
fn a_back_link_left_by_a_killed_process_does_not_stop_the_unbind() {
    let w = world(2);
    let b = binder(&w);
    let gpu = &w.gpus[0];
    let bdf = gpu.address().to_string();
    b.bind_passthrough(gpu).unwrap();
    // What a process killed inside the bind's detach from nvidia leaves: the device on
    // vfio-pci, and nvidia's back link still there.
    let nvidia = w.root.join("bus/pci/drivers/nvidia");
    let vfio_link = std::fs::read_link(w.root.join("bus/pci/drivers/vfio-pci").join(&bdf)).unwrap();
    std::os::unix::fs::symlink(&vfio_link, nvidia.join(&bdf)).unwrap();
    b.unbind_passthrough(gpu).unwrap();
    assert_eq!(driver_via_cli(&w.root, gpu), "nvidia");
    assert!(nvidia.join(&bdf).exists());
}

#[test]
fn unknown_devices_are_refused() {
    let w = world(2);
    let b = binder(&w);
    let ghost: DevicePath = "/devices/pci0000:00/0000:00:03.0/0000:7f:00.0"
        .parse()
        .unwrap();
    let e = b.bind_passthrough(&ghost).unwrap_err();
    assert!(matches!(e, BindError::NotFound(_)), "{e}");
    assert!(e.to_string().contains("0000:7f:00.0"));
    assert!(b.unbind_passthrough(&ghost).is_err());
}

#[test]
fn missing_vfio_driver_is_reported() {
    let w = world(2);
    std::fs::remove_dir_all(w.root.join("bus/pci/drivers/vfio-pci")).unwrap();
    let e = binder(&w).bind_passthrough(&w.gpus[0]).unwrap_err();
    assert!(e.to_string().contains("modprobe vfio-pci"), "{e}");
    assert_eq!(driver_via_cli(&w.root, &w.gpus[0]), "nvidia");
}

#[test]
fn bindings_survive_a_restart_and_are_reapplied() {
    let w = world(2);
    binder(&w).bind_passthrough(&w.gpus[0]).unwrap();
    // A reboot: the kernel forgets the override and nvidia grabs the device again.
    let dir = w.root.join(w.gpus[0].to_string().trim_start_matches('/'));
    let ops = open_sysfs(&w.root).unwrap();
    ops.write_attr(&dir.join("driver_override"), "\n").unwrap();
    ops.write_attr(
        &w.root.join("bus/pci/drivers/vfio-pci/unbind"),
        &w.gpus[0].address().to_string(),
    )
    .unwrap();
    ops.write_attr(
        &w.root.join("bus/pci/drivers_probe"),
        &w.gpus[0].address().to_string(),
    )
    .unwrap();
    assert_eq!(driver_via_cli(&w.root, &w.gpus[0]), "nvidia");

    let fresh = binder(&w);
    assert!(fresh.reapply_bindings().unwrap().is_empty());
    assert_eq!(driver_via_cli(&w.root, &w.gpus[0]), "vfio-pci");
    fresh.unbind_passthrough(&w.gpus[0]).unwrap();
    assert_eq!(driver_via_cli(&w.root, &w.gpus[0]), "nvidia");
}

#[test]
fn scrub_resets_and_verifies() {
    let w = world(2);
    let ops = open_sysfs(&w.root).unwrap();
    let r = scrub(&ops, &w.gpus[0]);
    assert!(r.ok, "{r:?}");
    assert_eq!(
        r.steps.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
        ["reset", "verify_driver"]
    );
    let log = std::fs::read_to_string(w.root.join(RESET_LOG)).unwrap();
    assert_eq!(log.trim(), w.gpus[0].address().to_string());

    // Without its own reset the GPU's bridge is reset; without that either, it fails
    // and the driver check is not run.
    let dir = w.root.join(w.gpus[1].to_string().trim_start_matches('/'));
    std::fs::remove_file(dir.join("reset")).unwrap();
    let r = scrub(&ops, &w.gpus[1]);
    assert!(r.ok, "{r:?}");
    assert_eq!(r.steps[0].name, "bus_reset");
    std::fs::remove_file(dir.parent().unwrap().join("reset")).unwrap();
    let r = scrub(&ops, &w.gpus[1]);
    assert!(!r.ok);
    assert_eq!(r.steps.len(), 1);
    assert!(!r.steps[0].ok);
    assert!(r.steps[0].detail.as_deref().unwrap().contains("reset"));

    let ghost: DevicePath = "/devices/pci0000:00/0000:00:09.0".parse().unwrap();
    let r = scrub(&ops, &ghost);
    assert!(!r.ok && r.steps.iter().all(|s| !s.ok));
}

#[test]
fn executor_runs_a_vm_lifecycle() {
    let w = world(4);
    let hv = Arc::new(SimHypervisor::open(&w.state, Some(&w.root)).unwrap());
    let exec = Executor::new(binder(&w), hv.clone());
    let vm = VmId::new_random();
    let devices = vec![w.gpus[2].clone(), w.gpus[3].clone()];
    let spec = VmSpec {
        uuid: vm,
        vcpus: 8,
        memory_mib: 16384,
        devices: devices.clone(),
        disk: None,
        nics: Vec::new(),
        cloud_init: None,
        bootrom: None,
    };

    // Launching before binding fails, as a real hypervisor would.
    let r = exec.execute(&Task::StartVm { vm: spec.clone() });
    assert!(!r.ok);
    assert!(r.error.unwrap().contains("vfio-pci"));

    let bind = Task::BindPassthrough {
        vm_uuid: vm,
        devices: devices.clone(),
        vgpu_types: Default::default(),
    };
    assert!(exec.execute(&bind).ok);
    assert!(exec.execute(&bind).ok);
    let found = discover(&w.root);
    for d in &devices {
        let dev = found.devices.iter().find(|x| &x.id == d).unwrap();
        assert_eq!(dev.driver.as_deref(), Some("vfio-pci"));
    }
    assert!(exec.execute(&Task::StartVm { vm: spec.clone() }).ok);
    assert_eq!(hv.running(), vec![vm]);
    assert!(exec.execute(&Task::StopVm { vm_uuid: vm }).ok);
    assert!(exec.execute(&Task::StopVm { vm_uuid: vm }).ok);
    assert!(hv.running().is_empty());

    let r = exec.execute(&Task::Scrub {
        devices: devices.clone(),
        pipelines: Default::default(),
    });
    assert!(r.ok, "{r:?}");
    assert_eq!(r.scrub_reports.len(), 2);

    let unbind = Task::UnbindPassthrough {
        vm_uuid: vm,
        devices: devices.clone(),
    };
    assert!(exec.execute(&unbind).ok);
    assert!(exec.execute(&unbind).ok);
    for d in &devices {
        assert_eq!(driver_via_cli(&w.root, d), "nvidia");
    }

    // A failing scrub fails the task and still reports every device.
    let dir = w.root.join(devices[0].to_string().trim_start_matches('/'));
    std::fs::remove_file(dir.join("reset")).unwrap();
    std::fs::remove_file(dir.parent().unwrap().join("reset")).unwrap();
    let r = exec.execute(&Task::Scrub {
        devices,
        pipelines: Default::default(),
    });
    assert!(!r.ok);
    assert_eq!(r.scrub_reports.len(), 2);
    assert!(!r.scrub_reports[0].ok && r.scrub_reports[1].ok);
}

/// `destroy_vm` stops the VM and gives its devices back in one task, twice with the same
/// end; a part that fails fails the task, named in its error.
#[test]
fn executor_destroys_a_vm_in_one_task() {
    let w = world(4);
    let hv = Arc::new(SimHypervisor::open(&w.state, Some(&w.root)).unwrap());
    let exec = Executor::new(binder(&w), hv.clone());
    let vm = VmId::new_random();
    let devices = vec![w.gpus[0].clone(), w.gpus[1].clone()];
    let bind = Task::BindPassthrough {
        vm_uuid: vm,
        devices: devices.clone(),
        vgpu_types: Default::default(),
    };
    assert!(exec.execute(&bind).ok);
    let spec = VmSpec {
        uuid: vm,
        vcpus: 2,
        memory_mib: 2048,
        devices: devices.clone(),
        disk: None,
        nics: Vec::new(),
        cloud_init: None,
        bootrom: None,
    };
    assert!(exec.execute(&Task::StartVm { vm: spec }).ok);
    assert_eq!(hv.running(), vec![vm]);

    let destroy = Task::DestroyVm {
        vm_uuid: vm,
        devices: devices.clone(),
        delete_disk: true,
    };
    for _ in 0..2 {
        let r = exec.execute(&destroy);
        assert!(r.ok, "{r:?}");
        assert!(hv.running().is_empty());
        for d in &devices {
            assert_eq!(driver_via_cli(&w.root, d), "nvidia");
        }
    }

    // A device that is not there fails the unbind: the error names that part.
    let other = VmId::new_random();
    assert!(
        exec.execute(&Task::BindPassthrough {
            vm_uuid: other,
            devices: vec![w.gpus[2].clone()],
            vgpu_types: Default::default(),
        })
        .ok
    );
    let ghost: DevicePath = "/devices/pci0000:00/0000:00:09.0".parse().unwrap();
    let r = exec.execute(&Task::DestroyVm {
        vm_uuid: other,
        devices: vec![ghost, w.gpus[2].clone()],
        delete_disk: false,
    });
    assert!(!r.ok);
    let error = r.error.unwrap();
    assert!(error.starts_with("unbind_passthrough: "), "{error}");
    // As `unbind_passthrough` alone: every device is tried.
    assert_eq!(driver_via_cli(&w.root, &w.gpus[2]), "nvidia");

    let too_many = Task::DestroyVm {
        vm_uuid: other,
        devices: vec![w.gpus[3].clone(); passage_model::protocol::MAX_TASK_DEVICES + 1],
        delete_disk: false,
    };
    let r = exec.execute(&too_many);
    assert!(!r.ok && r.error.unwrap().contains("more than"));
}

#[test]
fn executor_boots_a_vm_in_one_task() {
    let w = world(4);
    let hv = Arc::new(SimHypervisor::open(&w.state, Some(&w.root)).unwrap());
    let exec = Executor::new(binder(&w), hv.clone());
    let spec = |devices: Vec<DevicePath>| VmSpec {
        uuid: VmId::new_random(),
        vcpus: 2,
        memory_mib: 2048,
        devices,
        disk: None,
        nics: Vec::new(),
        cloud_init: None,
        bootrom: None,
    };
    let vm = spec(vec![w.gpus[0].clone(), w.gpus[1].clone()]);
    let boot = Task::BootVm {
        vm: vm.clone(),
        vgpu_types: Default::default(),
    };
    // Twice: the second changes nothing.
    for _ in 0..2 {
        let r = exec.execute(&boot);
        assert!(r.ok, "{r:?}");
        assert_eq!(hv.running(), vec![vm.uuid]);
        for d in &vm.devices {
            assert_eq!(driver_via_cli(&w.root, d), "vfio-pci");
        }
    }

    // Each passed function was reset before the launch, once: the replayed boot found
    // the VM running and left its devices alone.
    let log = std::fs::read_to_string(w.root.join(node_agent::fake::HOST_LOG)).unwrap();
    for d in &vm.devices {
        let bdf = d.address().to_string();
        let lines: Vec<&str> = log.lines().collect();
        let reset = lines.iter().position(|l| *l == format!("reset {bdf}"));
        let bound = lines
            .iter()
            .position(|l| *l == format!("probe {bdf} vfio-pci"));
        assert!(bound.is_some() && reset.is_some() && bound < reset, "{log}");
        assert_eq!(
            lines
                .iter()
                .filter(|l| **l == format!("reset {bdf}"))
                .count(),
            1
        );
    }

    // A reset that fails fails the launch, named.
    node_agent::fake::set_fault(&w.root, node_agent::fake::FakeFault::ResetFails, true).unwrap();
    let failing = spec(vec![w.gpus[2].clone()]);
    let r = exec.execute(&Task::BootVm {
        vm: failing.clone(),
        vgpu_types: Default::default(),
    });
    assert!(!r.ok);
    let error = r.error.unwrap();
    assert!(
        error.starts_with("start_vm: reset of ") && error.contains("before launch failed"),
        "{error}"
    );
    assert_eq!(hv.running(), vec![vm.uuid], "not started");
    node_agent::fake::set_fault(&w.root, node_agent::fake::FakeFault::ResetFails, false).unwrap();
    exec.execute(&Task::UnbindPassthrough {
        vm_uuid: failing.uuid,
        devices: failing.devices.clone(),
    });

    // A device that is not there fails the bind: the error names that part, and the VM
    // is not started.
    let ghost: DevicePath = "/devices/pci0000:00/0000:00:09.0".parse().unwrap();
    let bad = spec(vec![w.gpus[2].clone(), ghost]);
    let r = exec.execute(&Task::BootVm {
        vm: bad.clone(),
        vgpu_types: Default::default(),
    });
    assert!(!r.ok);
    let error = r.error.unwrap();
    assert!(error.starts_with("bind_passthrough: "), "{error}");
    assert_eq!(hv.running(), vec![vm.uuid]);

    // Another spec under a running VM's id: the start refuses it, and says so.
    let mut clash = spec(vec![w.gpus[3].clone()]);
    clash.uuid = vm.uuid;
    let r = exec.execute(&Task::BootVm {
        vm: clash,
        vgpu_types: Default::default(),
    });
    assert!(!r.ok);
    let error = r.error.unwrap();
    assert!(error.starts_with("start_vm: "), "{error}");
    // Its bind, the part before, was done.
    assert_eq!(driver_via_cli(&w.root, &w.gpus[3]), "vfio-pci");

    let too_many = Task::BootVm {
        vm: spec(vec![
            w.gpus[3].clone();
            passage_model::protocol::MAX_TASK_DEVICES + 1
        ]),
        vgpu_types: Default::default(),
    };
    let r = exec.execute(&too_many);
    assert!(!r.ok && r.error.unwrap().contains("more than"));
}

/// A tree whose GPUs each share their IOMMU group with an HDMI audio function `.1`.
fn world_with_audio(gpus: u32) -> (World, Vec<DevicePath>) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sys");
    let state = dir.path().join("state");
    let tree = generate_with(
        &root,
        &FakeSpec {
            gpus,
            model: GpuModel::L40s,
            numa_nodes: 1,
        },
        &FakeOptions {
            gpu_audio: true,
            ..Default::default()
        },
    )
    .unwrap();
    let audio: Vec<DevicePath> = tree
        .functions
        .iter()
        .filter(|f| {
            let a = f.address();
            a.function == 1 && tree.gpus.iter().any(|g| g.parents() == f.parents())
        })
        .cloned()
        .collect();
    assert_eq!(audio.len(), gpus as usize);
    let w = World {
        _dir: dir,
        root,
        state,
        gpus: tree.gpus,
    };
    (w, audio)
}

#[test]
fn a_shared_iommu_group_must_go_through_whole() {
    let (w, audio) = world_with_audio(2);
    let b = binder(&w);
    let (gpu, snd) = (&w.gpus[0], &audio[0]);
    assert_eq!(driver_via_cli(&w.root, snd), "snd_hda_intel");

    // Alone, the GPU would leave its audio function with the host: refused, unchanged.
    let e = b.bind_passthrough(gpu).unwrap_err();
    assert!(matches!(e, BindError::GroupNotViable { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.contains(&format!("{} (driver snd_hda_intel)", snd.address())),
        "{text}"
    );
    assert_eq!(driver_via_cli(&w.root, gpu), "nvidia");
    assert!(b.state().unwrap().bindings.is_empty());

    // Together they go; the other GPU's group is untouched.
    b.bind_passthrough_many(&[gpu.clone(), snd.clone()])
        .unwrap();
    assert_eq!(driver_via_cli(&w.root, gpu), "vfio-pci");
    assert_eq!(driver_via_cli(&w.root, snd), "vfio-pci");
    assert_eq!(driver_via_cli(&w.root, &w.gpus[1]), "nvidia");
    // Once the rest of the group is on vfio-pci, the GPU alone is viable again.
    b.bind_passthrough(gpu).unwrap();

    // The task path checks the set as a whole too.
    let hv = Arc::new(SimHypervisor::open(&w.state, Some(&w.root)).unwrap());
    let exec = Executor::new(binder(&w), hv);
    let vm = VmId::new_random();
    let r = exec.execute(&Task::BindPassthrough {
        vm_uuid: vm,
        devices: vec![w.gpus[1].clone()],
        vgpu_types: Default::default(),
    });
    assert!(!r.ok);
    assert!(r.error.unwrap().contains("IOMMU group"));
    let r = exec.execute(&Task::BindPassthrough {
        vm_uuid: vm,
        devices: vec![w.gpus[1].clone(), audio[1].clone()],
        vgpu_types: Default::default(),
    });
    assert!(r.ok, "{r:?}");

    // Discovery reports the group's members on both functions.
    let found = discover(&w.root);
    let g = found.devices.iter().find(|d| &d.id == gpu).unwrap();
    let members = &g.details.as_ref().unwrap().iommu_group_members;
    assert_eq!(members, &vec![gpu.address(), snd.address()]);
}

#[test]
fn bridges_in_the_group_do_not_block() {
    let w = world(2);
    let gpu = &w.gpus[0];
    // Put the GPU's downstream port into the GPU's group, as ACS-less switches do.
    let port = gpu.parents().last().unwrap().to_string();
    let group = std::fs::read_link(
        w.root
            .join(gpu.to_string().trim_start_matches('/'))
            .join("iommu_group"),
    )
    .unwrap();
    let group_dir = w
        .root
        .join(gpu.to_string().trim_start_matches('/'))
        .join(&group);
    let port_dir = std::fs::canonicalize(w.root.join("bus/pci/devices").join(&port)).unwrap();
    std::os::unix::fs::symlink(&port_dir, group_dir.join("devices").join(&port)).unwrap();
    binder(&w).bind_passthrough(gpu).unwrap();
    assert_eq!(driver_via_cli(&w.root, gpu), "vfio-pci");
}

/// A GPU held open by a process: the kernel's unbind from nvidia blocks (the fake's busy
/// switch), and the bind gives up after its bound naming the holder, instead of hanging
/// the agent. Once the holder lets go the device is free to bind again.
#[test]
fn a_busy_gpu_fails_to_bind_within_the_bound_naming_its_holder() {
    let w = world(2);
    let gpu = &w.gpus[0];
    let bdf = gpu.address().to_string();
    // A staged /proc: pid 4242 (nvidia-smi) holds /dev/nvidia0, pid 7 holds a tty.
    let (proc_root, dev_root) = (w.state.join("proc"), w.state.join("dev"));
    for (pid, comm, node) in [(4242, "nvidia-smi", "nvidia0"), (7, "bash", "tty1")] {
        let fd = proc_root.join(pid.to_string()).join("fd");
        std::fs::create_dir_all(&fd).unwrap();
        std::fs::write(fd.parent().unwrap().join("comm"), format!("{comm}\n")).unwrap();
        std::os::unix::fs::symlink(dev_root.join(node), fd.join("3")).unwrap();
    }
    node_agent::fake::set_busy(&w.root, &bdf, true).unwrap();
    let b = binder(&w)
        .with_unbind_timeout(std::time::Duration::from_millis(500))
        .with_holder_roots(&proc_root, &dev_root);
    let t = std::time::Instant::now();
    let e = b.bind_passthrough(gpu).unwrap_err();
    assert!(
        t.elapsed() < std::time::Duration::from_secs(3),
        "{:?}",
        t.elapsed()
    );
    assert!(matches!(e, BindError::UnbindStuck { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("unbinding it from nvidia did not finish within 1 s")
            && msg.contains("pid 4242 (nvidia-smi)")
            && !msg.contains("bash"),
        "{msg}"
    );
    // The holder goes: the abandoned write finishes, and a bind now succeeds.
    node_agent::fake::set_busy(&w.root, &bdf, false).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while driver_via_cli(&w.root, gpu) == "nvidia" && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    b.bind_passthrough(gpu).unwrap();
    assert_eq!(driver_via_cli(&w.root, gpu), "vfio-pci");
}
