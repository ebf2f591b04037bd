//! Running one task: the pure part of the agent loop, testable over a fake tree and the
//! simulated hypervisor without any server.

use crate::host::{Binder, VgpuSlots};
use crate::hypervisor::Hypervisor;
use crate::images::ImageService;
use crate::scrub::{ScrubEnv, scrub_for_task};
use passage_model::DevicePath;
use passage_model::VmId;
use passage_model::protocol::{DiskSpec, MAX_TASK_DEVICES, Task, TaskProgress, TaskResult, VmSpec};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::watch;

pub struct Executor {
    pub binder: Binder,
    /// The vGPUs made for VMs (slots in a task's devices).
    pub vgpus: VgpuSlots,
    pub hypervisor: Arc<dyn Hypervisor>,
    /// The programs and block devices scrub steps use.
    pub scrub_env: ScrubEnv,
    /// Images and boot disks; `None` on a node without real disks (the sim hypervisor),
    /// where `FetchImage` and `DeleteDisk` succeed at once: a fleet of simulated nodes
    /// must not each download image files.
    pub images: Option<Arc<ImageService>>,
}

impl Executor {
    /// An executor whose scrubs use what suits the binder's tree
    /// ([`ScrubEnv::for_sysfs`]: the host's tools, or none on a generated tree).
    pub fn new(binder: Binder, hypervisor: Arc<dyn Hypervisor>) -> Self {
        let scrub_env = ScrubEnv::for_sysfs(binder.ops().as_ref());
        let vgpus = VgpuSlots::new(binder.ops().clone(), binder.state_dir());
        Executor {
            vgpus,
            binder,
            hypervisor,
            scrub_env,
            images: None,
        }
    }

    pub fn with_images(mut self, images: Arc<ImageService>) -> Self {
        self.images = Some(images);
        self
    }

    /// Runs `task` from async code: `FetchImage` as the download it is (on the runtime,
    /// reporting `progress`), everything else on a blocking thread through [`execute`].
    ///
    /// [`execute`]: Self::execute
    pub async fn run(
        self: Arc<Self>,
        task: Task,
        progress: watch::Sender<TaskProgress>,
    ) -> TaskResult {
        match &task {
            Task::FetchImage { vm_uuid, disk } => {
                return self.fetch_image(*vm_uuid, disk, &progress).await;
            }
            Task::BootVm { vm, vgpu_types } if self.downloads(&task) => {
                let bind = self.clone();
                let (v, t) = (vm.clone(), vgpu_types.clone());
                let bound = tokio::task::spawn_blocking(move || bind.bind(v.uuid, &v.devices, &t))
                    .await
                    .unwrap_or_else(|e| TaskResult::failure(format!("task crashed: {e}")));
                if !bound.ok {
                    return part_failed(Task::BIND_PASSTHROUGH, &bound);
                }
                if let Some(disk) = &vm.disk {
                    let fetched = self.fetch_image(vm.uuid, disk, &progress).await;
                    if !fetched.ok {
                        return part_failed(Task::FETCH_IMAGE, &fetched);
                    }
                }
                let vm = vm.clone();
                let started = tokio::task::spawn_blocking(move || self.start(&vm))
                    .await
                    .unwrap_or_else(|e| TaskResult::failure(format!("task crashed: {e}")));
                return if started.ok {
                    started
                } else {
                    part_failed(Task::START_VM, &started)
                };
            }
            _ => {}
        }
        tokio::task::spawn_blocking(move || self.execute(&task))
            .await
            .unwrap_or_else(|e| TaskResult::failure(format!("task crashed: {e}")))
    }

    /// Whether `task` fetches an image, which only [`run`] can (a download on the async
    /// runtime): a `FetchImage`, or a `BootVm` with a disk, on a node with an image
    /// service. The rest runs through [`execute`] as well.
    ///
    /// [`run`]: Self::run
    /// [`execute`]: Self::execute
    pub fn downloads(&self, task: &Task) -> bool {
        self.images.is_some()
            && match task {
                Task::FetchImage { .. } => true,
                Task::BootVm { vm, .. } => vm.disk.is_some(),
                _ => false,
            }
    }

    /// Whether `task` may take minutes: a `FetchImage` whose image is not in the cache
    /// yet (one that is makes the VM's disk on it and is done), or a VM's start where the
    /// hypervisor's starts are slow (QEMU pinning a large guest's memory). Without an
    /// image service (the sim hypervisor) nothing is fetched at all.
    pub fn runs_long(&self, task: &Task) -> bool {
        if matches!(task, Task::StartVm { .. } | Task::BootVm { .. })
            && self.hypervisor.starts_slowly()
        {
            return true;
        }
        // A guest given a minute to shut down must not hold up the node's other VMs.
        if matches!(task, Task::ShutdownVm { .. }) && self.hypervisor.stops_slowly() {
            return true;
        }
        let disk = match task {
            Task::FetchImage { disk, .. } => disk,
            Task::BootVm { vm, .. } => match &vm.disk {
                Some(d) => d,
                None => return false,
            },
            _ => return false,
        };
        self.images
            .as_ref()
            .is_some_and(|i| !i.cache.path(&disk.image.sha256).is_file())
    }

    async fn fetch_image(
        &self,
        vm: VmId,
        disk: &DiskSpec,
        progress: &watch::Sender<TaskProgress>,
    ) -> TaskResult {
        let Some(images) = &self.images else {
            return TaskResult::success();
        };
        if disk.size_gib == 0 {
            return TaskResult::failure("a boot disk of 0 GiB cannot hold the image".to_string());
        }
        match images.fetch(vm, disk, progress).await {
            Ok(_) => TaskResult::success(),
            Err(e) => TaskResult::failure(e.to_string()),
        }
    }

    /// The nvidia-smi that changes a GPU's MIG mode for a vGPU type that needs it.
    pub fn with_nvidia_smi(mut self, smi: crate::host::NvidiaSmi) -> Self {
        self.vgpus = self.vgpus.with_nvidia_smi(smi);
        self
    }

    pub fn with_scrub_env(mut self, env: ScrubEnv) -> Self {
        self.scrub_env = env;
        self
    }

    /// Runs `task` (blocking: sysfs writes, hypervisor calls). Every failure becomes a
    /// failed [`TaskResult`]; the agent reports it and carries on.
    pub fn execute(&self, task: &Task) -> TaskResult {
        match task {
            Task::BindPassthrough {
                vm_uuid,
                devices,
                vgpu_types,
            } => self.bind(*vm_uuid, devices, vgpu_types),
            Task::UnbindPassthrough { vm_uuid, devices } => self.unbind(*vm_uuid, devices),
            Task::StartVm { vm } => self.start(vm),
            // Each part only once the one before it succeeded: a VM never starts without
            // its devices or its disk.
            Task::BootVm { .. } if self.downloads(task) => TaskResult::failure(
                "internal: boot_vm tasks with a disk run through Executor::run".to_string(),
            ),
            Task::BootVm { vm, vgpu_types } => {
                let bound = self.bind(vm.uuid, &vm.devices, vgpu_types);
                if !bound.ok {
                    return part_failed(Task::BIND_PASSTHROUGH, &bound);
                }
                // Without an image service (the sim) there is nothing to fetch.
                let started = self.start(vm);
                if !started.ok {
                    return part_failed(Task::START_VM, &started);
                }
                started
            }
            Task::StopVm { vm_uuid } => self.stop(*vm_uuid),
            Task::ShutdownVm { vm_uuid, grace_s } => {
                let grace = (*grace_s).min(passage_model::protocol::MAX_SHUTDOWN_GRACE_S);
                match self
                    .hypervisor
                    .shutdown(*vm_uuid, std::time::Duration::from_secs(grace.into()))
                {
                    Ok(outcome) => TaskResult {
                        shutdown: Some(outcome),
                        ..TaskResult::success()
                    },
                    Err(e) => TaskResult::failure(e.to_string()),
                }
            }
            // A download: it runs on the async runtime (see `run`). Without images (the
            // sim) there is nothing to do.
            Task::FetchImage { .. } => match self.images {
                None => TaskResult::success(),
                Some(_) => TaskResult::failure(
                    "internal: fetch_image tasks run through Executor::run".to_string(),
                ),
            },
            Task::ReadConsole { vm_uuid } => match self.hypervisor.console(*vm_uuid) {
                Ok(console) => TaskResult {
                    console: Some(console),
                    ..TaskResult::success()
                },
                Err(e) => TaskResult::failure(e.to_string()),
            },
            Task::DeleteDisk { vm_uuid } => self.delete_disk(*vm_uuid),
            // It needs the agent's connection to the server: the agent loop runs it.
            Task::AttachConsole { .. } => TaskResult::failure(
                "internal: attach_console tasks run in the agent loop".to_string(),
            ),
            Task::DestroyVm {
                vm_uuid,
                devices,
                delete_disk,
            } => {
                if devices.len() > MAX_TASK_DEVICES {
                    return too_many(devices.len());
                }
                // Each part only once the one before it succeeded: a device is never given
                // back from under a running VM, nor its disk deleted.
                let parts: [(&str, &dyn Fn() -> TaskResult); 3] = [
                    (Task::STOP_VM, &|| self.stop(*vm_uuid)),
                    (Task::UNBIND_PASSTHROUGH, &|| self.unbind(*vm_uuid, devices)),
                    (Task::DELETE_DISK, &|| {
                        if *delete_disk {
                            self.delete_disk(*vm_uuid)
                        } else {
                            TaskResult::success()
                        }
                    }),
                ];
                for (name, part) in parts {
                    let r = part();
                    if !r.ok {
                        return part_failed(name, &r);
                    }
                }
                TaskResult::success()
            }
            Task::SetVfs { function, num_vfs } => {
                match crate::host::set_numvfs(self.binder.ops().as_ref(), function, *num_vfs) {
                    Ok(()) => TaskResult::success(),
                    Err(e) => TaskResult::failure(e),
                }
            }
            Task::Scrub { devices, pipelines } => {
                if devices.len() > MAX_TASK_DEVICES {
                    return too_many(devices.len());
                }
                let ops = self.binder.ops();
                let reports: Vec<_> = devices
                    .iter()
                    .map(|d| {
                        if d.vgpu().is_some() {
                            return self.vgpus.scrub(d);
                        }
                        let mig = self.vgpus.mig_off(d);
                        if let Some(step) = mig.as_ref().filter(|s| !s.ok) {
                            return passage_model::protocol::ScrubReport {
                                device: d.clone(),
                                ok: false,
                                steps: vec![step.clone()],
                            };
                        }
                        let mut report = scrub_for_task(ops, d, pipelines, &self.scrub_env);
                        report.steps.splice(0..0, mig);
                        report
                    })
                    .collect();
                let failed: Vec<String> = reports
                    .iter()
                    .filter(|r| !r.ok)
                    .map(|r| r.device.to_string())
                    .collect();
                let mut result = if failed.is_empty() {
                    TaskResult::success()
                } else {
                    TaskResult::failure(format!("scrub failed for {}", failed.join(", ")))
                };
                result.scrub_reports = reports;
                result
            }
        }
    }

    /// Binds `devices` for passthrough to `vm`; vGPU slots among them are made as the
    /// vGPU type `vgpu_types` names for each.
    fn bind(
        &self,
        vm: VmId,
        devices: &[DevicePath],
        vgpu_types: &BTreeMap<String, String>,
    ) -> TaskResult {
        if devices.len() > MAX_TASK_DEVICES {
            return too_many(devices.len());
        }
        let functions: Vec<DevicePath> = devices
            .iter()
            .filter(|d| d.vgpu().is_none())
            .cloned()
            .collect();
        // The whole set at once: functions sharing an IOMMU group (a GPU and its audio
        // function) are only viable together.
        if let Err(e) = self.binder.check_viability(&functions) {
            return TaskResult::failure(e.to_string());
        }
        self.each(devices, |d| {
            if d.vgpu().is_some() {
                let t = vgpu_types
                    .get(&d.to_string())
                    .ok_or_else(|| format!("{d}: no vGPU type given"))?;
                return self.vgpus.make(d, t, vm);
            }
            self.binder.bind_checked(d).map_err(|e| e.to_string())
        })
    }

    /// Starts the VM, its vGPU slots given as the vGPUs made in them.
    fn start(&self, vm: &VmSpec) -> TaskResult {
        if vm.devices.len() > MAX_TASK_DEVICES {
            return too_many(vm.devices.len());
        }
        let mut launch = vm.clone();
        for d in &mut launch.devices {
            if d.vgpu().is_some() {
                match self.vgpus.launch_path(d) {
                    Ok(p) => *d = p,
                    Err(e) => return TaskResult::failure(e),
                }
            }
        }
        // Every passed function is reset before each launch; one that cannot be fails it
        // (the provision unwinds, and the device's scrub finds it again). A VM already
        // running (a start replayed) keeps its devices untouched.
        let launching = !self.hypervisor.running().contains(&vm.uuid);
        for d in vm
            .devices
            .iter()
            .filter(|d| launching && d.vgpu().is_none())
        {
            if let Err(why) = crate::scrub::reset_before_launch(self.binder.ops().as_ref(), d) {
                return TaskResult::failure(format!(
                    "reset of {} before launch failed: {why}",
                    d.address()
                ));
            }
        }
        match self.hypervisor.start(&launch) {
            Ok(()) => TaskResult::success(),
            Err(e) => TaskResult::failure(e.to_string()),
        }
    }

    /// Stops the VM; one that is not running is already stopped.
    fn stop(&self, vm: VmId) -> TaskResult {
        match self.hypervisor.stop(vm) {
            Ok(()) => TaskResult::success(),
            Err(e) => TaskResult::failure(e.to_string()),
        }
    }

    /// Gives `devices` back to the drivers they had; a vGPU slot's vGPU is destroyed if
    /// it is still `vm`'s.
    fn unbind(&self, vm: VmId, devices: &[DevicePath]) -> TaskResult {
        self.each(devices, |d| {
            if d.vgpu().is_some() {
                return self.vgpus.release(d, vm);
            }
            self.binder.unbind_passthrough(d).map_err(|e| e.to_string())
        })
    }

    /// Deletes the VM's boot disk; one that is not there is already deleted.
    fn delete_disk(&self, vm: VmId) -> TaskResult {
        let Some(images) = &self.images else {
            return TaskResult::success();
        };
        // QEMU writes to the disk while the VM runs: deleting it under the guest would
        // lose nothing QEMU cares about but leave a VM without a disk.
        if self.hypervisor.running().contains(&vm) {
            return TaskResult::failure(format!(
                "VM {vm} is still running; stop it before deleting its disk"
            ));
        }
        match crate::images::delete_disk(&images.state_dir, vm) {
            Ok(()) => TaskResult::success(),
            Err(e) => TaskResult::failure(e.to_string()),
        }
    }

    /// Tries every device even after a failure, so one bad device does not hide the
    /// state of the others; the result names each failure.
    fn each(
        &self,
        devices: &[DevicePath],
        f: impl Fn(&DevicePath) -> Result<(), String>,
    ) -> TaskResult {
        if devices.len() > MAX_TASK_DEVICES {
            return too_many(devices.len());
        }
        let errors: Vec<String> = devices.iter().filter_map(|d| f(d).err()).collect();
        if errors.is_empty() {
            TaskResult::success()
        } else {
            TaskResult::failure(errors.join("; "))
        }
    }
}

/// A task of several parts that ended at `name`'s failure `r`: said with the part's name.
fn part_failed(name: &str, r: &TaskResult) -> TaskResult {
    TaskResult::failure(format!(
        "{name}: {}",
        r.error.as_deref().unwrap_or("failed")
    ))
}

fn too_many(n: usize) -> TaskResult {
    TaskResult::failure(format!(
        "task names {n} devices, more than the {MAX_TASK_DEVICES} allowed"
    ))
}
