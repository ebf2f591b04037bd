//! Cleaning a device between tenants: a function-level reset through the kernel's
//! `reset` attribute, then a check that the device came back where it was.

use crate::host::{SysfsOps, bound_driver, device_dir};
use passage_model::DevicePath;
use passage_model::protocol::{ScrubReport, ScrubStep};
use std::time::Instant;

fn step(name: &str, started: Instant, result: Result<(), String>) -> ScrubStep {
    ScrubStep {
        name: name.to_string(),
        ok: result.is_ok(),
        duration_ms: started.elapsed().as_millis().try_into().unwrap_or(u64::MAX),
        detail: result.err(),
        skipped: false,
    }
}

/// Scrubs one device. Never fails as a call: every problem is a failed step in the report.
pub fn scrub(ops: &dyn SysfsOps, dev: &DevicePath) -> ScrubReport {
    let dir = device_dir(ops.root(), dev);
    let before = bound_driver(&dir).ok().flatten();
    let mut steps = Vec::new();

    let t = Instant::now();
    let flr = if dir.is_dir() {
        ops.write_attr(&dir.join("reset"), "1")
            .map_err(|e| format!("writing {}: {e}", dir.join("reset").display()))
    } else {
        Err(format!("device {dev} is not in the sysfs tree"))
    };
    steps.push(step("flr", t, flr));

    let t = Instant::now();
    let verify = if !dir.is_dir() {
        Err(format!("device {dev} is gone"))
    } else {
        match bound_driver(&dir) {
            Err(e) => Err(format!("reading driver: {e}")),
            Ok(after) if after == before => Ok(()),
            Ok(after) => Err(format!(
                "driver was {} before the reset and is {} after",
                before.as_deref().unwrap_or("none"),
                after.as_deref().unwrap_or("none")
            )),
        }
    };
    steps.push(step("verify_driver", t, verify));

    ScrubReport {
        device: dev.clone(),
        ok: steps.iter().all(|s| s.ok),
        steps,
    }
}
