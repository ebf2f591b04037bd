//! Running one task: the pure part of the agent loop, testable over a fake tree and the
//! simulated hypervisor without any server.

use crate::host::Binder;
use crate::hypervisor::Hypervisor;
use crate::scrub::{ScrubEnv, scrub_for_task};
use passage_model::DevicePath;
use passage_model::protocol::{MAX_TASK_DEVICES, Task, TaskResult};
use std::sync::Arc;

pub struct Executor {
    pub binder: Binder,
    pub hypervisor: Arc<dyn Hypervisor>,
    /// The programs and block devices scrub steps use.
    pub scrub_env: ScrubEnv,
}

impl Executor {
    /// An executor whose scrubs use what suits the binder's tree
    /// ([`ScrubEnv::for_sysfs`]: the host's tools, or none on a generated tree).
    pub fn new(binder: Binder, hypervisor: Arc<dyn Hypervisor>) -> Self {
        let scrub_env = ScrubEnv::for_sysfs(binder.ops().as_ref());
        Executor {
            binder,
            hypervisor,
            scrub_env,
        }
    }

    pub fn with_scrub_env(mut self, env: ScrubEnv) -> Self {
        self.scrub_env = env;
        self
    }

    /// Runs `task` (blocking: sysfs writes, hypervisor calls). Every failure becomes a
    /// failed [`TaskResult`]; the agent reports it and carries on.
    pub fn execute(&self, task: &Task) -> TaskResult {
        match task {
            Task::BindPassthrough { devices, .. } => {
                if devices.len() > MAX_TASK_DEVICES {
                    return too_many(devices.len());
                }
                // The whole set at once: functions sharing an IOMMU group (a GPU and its
                // audio function) are only viable together.
                if let Err(e) = self.binder.check_viability(devices) {
                    return TaskResult::failure(e.to_string());
                }
                self.each(devices, |d| {
                    self.binder.bind_checked(d).map_err(|e| e.to_string())
                })
            }
            Task::UnbindPassthrough { devices, .. } => self.each(devices, |d| {
                self.binder.unbind_passthrough(d).map_err(|e| e.to_string())
            }),
            Task::StartVm { vm } => {
                if vm.devices.len() > MAX_TASK_DEVICES {
                    return too_many(vm.devices.len());
                }
                match self.hypervisor.start(vm) {
                    Ok(()) => TaskResult::success(),
                    Err(e) => TaskResult::failure(e.to_string()),
                }
            }
            Task::StopVm { vm_uuid } => match self.hypervisor.stop(*vm_uuid) {
                Ok(()) => TaskResult::success(),
                Err(e) => TaskResult::failure(e.to_string()),
            },
            // Placeholder until the node side of issue 17 (image cache, disk overlays)
            // lands: nothing to fetch or delete yet, so both succeed, which lets the
            // control plane's new workflow steps run against sim nodes meanwhile.
            Task::FetchImage { .. } | Task::DeleteDisk { .. } => TaskResult::success(),
            Task::Scrub { devices, pipelines } => {
                if devices.len() > MAX_TASK_DEVICES {
                    return too_many(devices.len());
                }
                let ops = self.binder.ops();
                let reports: Vec<_> = devices
                    .iter()
                    .map(|d| scrub_for_task(ops.as_ref(), d, pipelines, &self.scrub_env))
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

fn too_many(n: usize) -> TaskResult {
    TaskResult::failure(format!(
        "task names {n} devices, more than the {MAX_TASK_DEVICES} allowed"
    ))
}
