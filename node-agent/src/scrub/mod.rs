//! Cleaning a device between tenants: a pipeline of steps (reset, vendor reset, an
//! operator's command, GPU memory zeroing, NVMe label wipe, driver check), each timed and
//! reported. The control plane names the steps per device; a device it names none for
//! gets [`default_pipeline`] for its PCI class.
//!
//! A pipeline stops at its first failed step; the steps after it are not run and not
//! reported, so a report's last step is the one that failed.

mod env;
mod nvme;
pub(crate) mod process;
mod programs;
mod reset;
mod vendor;

pub use env::{GPU_ZERO_HELPER, NVIDIA_SMI, ScrubEnv, ScrubOverrides};
pub use process::MAX_STDERR;
pub use programs::{
    DEFAULT_COMMAND_TIMEOUT_SECS, GPU_ZERO_NO_DRIVER, GPU_ZERO_TIMEOUT, MAX_COMMAND_TIMEOUT_SECS,
    NVIDIA_SMI_TIMEOUT,
};
pub use vendor::{DRIVER_WRITE_TIMEOUT, NVIDIA_DRIVER};

use crate::host::{SysfsOps, bound_driver, device_dir, read_attr};
use passage_model::DevicePath;
use passage_model::pci::PciClass;
use passage_model::protocol::{MAX_SCRUB_STEPS, ScrubAction, ScrubReport, ScrubStep};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

const NVIDIA: u16 = 0x10de;
const NVME_CLASS: u32 = 0x010802;

/// How a step ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    Done(Option<String>),
    /// Could not run on this node (a tool is missing); counts as success: for steps
    /// whose absence leaves nothing behind that the next tenant could read.
    Skipped(String),
    /// Could not run on this node, and the device is not clean without it (no zeroing
    /// helper, no vendor driver for it): fails the pipeline, reported as skipped so the
    /// control plane can tell "this node cannot" from "this device failed".
    Unable(String),
    Failed(String),
}

/// The report name of an action (a reset that fell back to the bridge is `bus_reset`).
pub fn step_name(action: &ScrubAction) -> &'static str {
    match action {
        ScrubAction::Reset {} => "reset",
        ScrubAction::NvidiaReset {} => "nvidia_reset",
        ScrubAction::Command { .. } => "command",
        ScrubAction::ZeroGpuMemory {} => "zero_gpu_memory",
        ScrubAction::WipeNvmeLabels {} => "wipe_nvme_labels",
        ScrubAction::VerifyDriver {} => "verify_driver",
    }
}

fn hex_attr(dir: &Path, name: &str) -> Option<u32> {
    let text = read_attr(&dir.join(name)).ok()?;
    u32::from_str_radix(text.trim_start_matches("0x"), 16).ok()
}

/// The steps for a device the control plane gave none for, by its class and vendor in
/// sysfs: GPUs and accelerators get the NVIDIA steps when they are NVIDIA's, NVMe
/// controllers the label wipe, everything a reset and a driver check.
pub fn default_pipeline(ops: &dyn SysfsOps, dev: &DevicePath) -> Vec<ScrubAction> {
    use ScrubAction::*;
    let dir = device_dir(ops.root(), dev);
    let class = hex_attr(&dir, "class");
    let nvidia = hex_attr(&dir, "vendor") == Some(u32::from(NVIDIA));
    match class {
        Some(c) if PciClass(c).is_gpu_like() && nvidia => {
            vec![Reset {}, NvidiaReset {}, ZeroGpuMemory {}, VerifyDriver {}]
        }
        Some(c) if PciClass(c).is_gpu_like() => vec![Reset {}, VerifyDriver {}],
        Some(NVME_CLASS) => vec![WipeNvmeLabels {}, Reset {}, VerifyDriver {}],
        _ => vec![Reset {}, VerifyDriver {}],
    }
}

/// Scrubs one device with a reset and a driver check, and nothing from the host's
/// programs or block devices: the pipeline of a device that is neither GPU nor NVMe.
pub fn scrub(ops: &Arc<dyn SysfsOps>, dev: &DevicePath) -> ScrubReport {
    let env = ScrubEnv::isolated(Path::new("/nonexistent"));
    scrub_with(
        ops,
        dev,
        &[ScrubAction::Reset {}, ScrubAction::VerifyDriver {}],
        &env,
    )
}

/// Runs `steps` on one device in order, stopping at the first failure. Never fails as a
/// call: every problem is a failed step in the report.
pub fn scrub_with(
    ops: &Arc<dyn SysfsOps>,
    dev: &DevicePath,
    steps: &[ScrubAction],
    env: &ScrubEnv,
) -> ScrubReport {
    let dir = device_dir(ops.root(), dev);
    let addr = dev.address();
    let mut report = ScrubReport {
        device: dev.clone(),
        ok: false,
        steps: Vec::new(),
    };
    if !dir.is_dir() {
        let name = steps.first().map(step_name).unwrap_or("scrub");
        report.steps.push(record(
            name,
            Instant::now(),
            Outcome::Failed(format!("device {dev} is not in the sysfs tree")),
        ));
        return report;
    }
    let before = bound_driver(&dir).ok().flatten();
    for action in steps {
        if let ScrubAction::ZeroGpuMemory {} = action {
            let done = zero_on_vendor_driver(ops, &dir, addr, env);
            let failed = done.iter().any(|s| !s.ok);
            report.steps.extend(done);
            if failed {
                return report;
            }
            continue;
        }
        let started = Instant::now();
        let (name, outcome) = match action {
            ScrubAction::Reset {} => reset::reset(ops.as_ref(), &dir, addr),
            ScrubAction::NvidiaReset {} => ("nvidia_reset", programs::nvidia_reset(env, addr)),
            ScrubAction::Command { argv, timeout_secs } => (
                "command",
                programs::command(argv, *timeout_secs, addr, &dir),
            ),
            ScrubAction::ZeroGpuMemory {} => {
                ("zero_gpu_memory", programs::zero_gpu_memory(env, addr))
            }
            ScrubAction::WipeNvmeLabels {} => {
                ("wipe_nvme_labels", nvme::wipe_labels(&env.dev_dir, &dir))
            }
            ScrubAction::VerifyDriver {} => ("verify_driver", verify_driver(dev, &dir, &before)),
        };
        let step = record(name, started, outcome);
        let failed = !step.ok;
        report.steps.push(step);
        if failed {
            return report;
        }
    }
    report.ok = !report.steps.is_empty();
    report
}

/// The zeroing step with the GPU on NVIDIA's driver, which CUDA needs: a GPU on another
/// driver (vfio-pci between tenants on a passthrough host) or on none is lent to it for
/// the helper and given back after, each move reported as a step of its own
/// (`bind_vendor_driver`, `zero_gpu_memory`, `bind_back`). A host without NVIDIA's driver
/// cannot clear the GPU: `zero_gpu_memory` fails as skipped. After a failed zeroing the
/// GPU is still given back, and a failure to do so is added to the zeroing's detail, so
/// the report's last step stays the one that failed.
fn zero_on_vendor_driver(
    ops: &Arc<dyn SysfsOps>,
    dir: &Path,
    addr: passage_model::PciAddress,
    env: &ScrubEnv,
) -> Vec<ScrubStep> {
    let bdf = addr.to_string();
    let mut done = Vec::new();
    let started = Instant::now();
    let lent = match vendor::lend(ops, dir, &bdf, NVIDIA_DRIVER, env.driver_timeout) {
        Ok(lent) => lent,
        Err(o @ Outcome::Unable(_)) => {
            done.push(record("zero_gpu_memory", started, o));
            return done;
        }
        Err(o) => {
            done.push(record("bind_vendor_driver", started, o));
            return done;
        }
    };
    if let Some(l) = &lent {
        done.push(record(
            "bind_vendor_driver",
            started,
            Outcome::Done(Some(format!(
                "{bdf} lent to {NVIDIA_DRIVER} (from {})",
                l.driver_name()
            ))),
        ));
    }
    let started = Instant::now();
    let zeroed = programs::zero_gpu_memory(env, addr);
    let Some(l) = lent else {
        done.push(record("zero_gpu_memory", started, zeroed));
        return done;
    };
    let ok = matches!(zeroed, Outcome::Done(_));
    let back_started = Instant::now();
    let back = vendor::give_back(ops, &l, NVIDIA_DRIVER, env.driver_timeout);
    match (ok, back) {
        (true, Ok(())) => {
            done.push(record("zero_gpu_memory", started, zeroed));
            let to = l.driver_name();
            done.push(record(
                "bind_back",
                back_started,
                Outcome::Done(Some(format!("{bdf} back on {to}"))),
            ));
        }
        (true, Err(why)) => {
            done.push(record("zero_gpu_memory", started, zeroed));
            done.push(record("bind_back", back_started, Outcome::Failed(why)));
        }
        (false, back) => {
            let zeroed = match (zeroed, back) {
                (o, Ok(())) => o,
                (Outcome::Unable(d), Err(b)) => Outcome::Unable(format!("{d}; {b}")),
                (Outcome::Failed(d), Err(b)) => Outcome::Failed(format!("{d}; {b}")),
                (o, Err(_)) => o,
            };
            done.push(record("zero_gpu_memory", started, zeroed));
        }
    }
    done
}

/// Resets `dev` just before a VM starts with it, as the scrub's reset step does (its own
/// reset, else its bridge's when nothing else is below): what the last run left in it (a
/// VM killed while it started) must not reach the next guest. Answers the kind of reset
/// that ran, or why none could.
pub fn reset_before_launch(ops: &dyn SysfsOps, dev: &DevicePath) -> Result<&'static str, String> {
    let dir = device_dir(ops.root(), dev);
    if !dir.is_dir() {
        return Err(format!("device {dev} is not in the sysfs tree"));
    }
    match reset::reset(ops, &dir, dev.address()) {
        (name, Outcome::Done(_)) => Ok(name),
        (_, Outcome::Failed(why) | Outcome::Unable(why) | Outcome::Skipped(why)) => Err(why),
    }
}

/// Scrubs `dev` as a [`Task::Scrub`](passage_model::protocol::Task::Scrub) asks: with
/// its pipeline from `pipelines` (keyed by device path) or else the default one.
pub fn scrub_for_task(
    ops: &Arc<dyn SysfsOps>,
    dev: &DevicePath,
    pipelines: &BTreeMap<String, Vec<ScrubAction>>,
    env: &ScrubEnv,
) -> ScrubReport {
    // Keys are compared as device paths, so a key spelled in upper case still matches.
    let given = pipelines.get(&dev.to_string()).or_else(|| {
        pipelines
            .iter()
            .find(|(k, _)| k.parse::<DevicePath>().is_ok_and(|p| &p == dev))
            .map(|(_, v)| v)
    });
    let steps = match given {
        None => default_pipeline(ops.as_ref(), dev),
        Some(steps) if steps.len() > MAX_SCRUB_STEPS => {
            return refused(
                dev,
                format!(
                    "the pipeline has {} steps, more than the {MAX_SCRUB_STEPS} allowed",
                    steps.len()
                ),
            );
        }
        // Reporting a device clean after doing nothing to it would free it unscrubbed.
        Some(steps) if steps.is_empty() => {
            return refused(dev, "the pipeline has no steps".to_string());
        }
        Some(steps) => steps.clone(),
    };
    scrub_with(ops, dev, &steps, env)
}

fn refused(dev: &DevicePath, why: String) -> ScrubReport {
    ScrubReport {
        device: dev.clone(),
        ok: false,
        steps: vec![record("pipeline", Instant::now(), Outcome::Failed(why))],
    }
}

fn record(name: &str, started: Instant, outcome: Outcome) -> ScrubStep {
    let duration_ms = started.elapsed().as_millis().try_into().unwrap_or(u64::MAX);
    let (ok, skipped, detail) = match outcome {
        Outcome::Done(d) => (true, false, d),
        Outcome::Skipped(d) => (true, true, Some(d)),
        Outcome::Unable(d) => (false, true, Some(d)),
        Outcome::Failed(d) => (false, false, Some(d)),
    };
    ScrubStep {
        name: name.to_string(),
        ok,
        duration_ms,
        detail,
        skipped,
    }
}

/// The device is still there and on the driver it had when the scrub began: a reset that
/// lost the device or knocked it off its driver leaves it unusable for the next tenant.
fn verify_driver(dev: &DevicePath, dir: &Path, before: &Option<String>) -> Outcome {
    if !dir.is_dir() {
        return Outcome::Failed(format!("device {dev} is gone"));
    }
    match bound_driver(dir) {
        Err(e) => Outcome::Failed(format!("reading driver: {e}")),
        Ok(after) if &after == before => Outcome::Done(None),
        Ok(after) => Outcome::Failed(format!(
            "driver was {} before the scrub and is {} after",
            before.as_deref().unwrap_or("none"),
            after.as_deref().unwrap_or("none")
        )),
    }
}
