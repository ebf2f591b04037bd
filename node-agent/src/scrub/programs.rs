//! Steps that run a program: `nvidia-smi --gpu-reset`, the GPU memory zeroing helper and
//! an operator's command.
//!
//! # The GPU memory helper, `passage-gpu-zero`
//!
//! The agent cannot load CUDA itself (`dlopen` needs `unsafe`, which this workspace
//! forbids), so zeroing is a separate program installed next to the NVIDIA driver:
//!
//! ```text
//! passage-gpu-zero --bdf 0000:3b:00.0
//! ```
//!
//! It must select the GPU by PCI bus id (`cuDeviceGetByPCIBusId`), allocate as much of
//! its memory as it can in chunks, write zeros to all of it (`cuMemsetD8`), read every
//! chunk back and check that it is zero, free it, and exit 0. Any error, or a non-zero
//! byte read back, exits non-zero with a one-line reason on stderr (the agent puts the
//! first 2 KiB of stderr into the report). It gets [`GPU_ZERO_TIMEOUT`] to finish; it
//! needs no arguments beyond `--bdf` and reads nothing from stdin.
//!
//! Exit [`GPU_ZERO_NO_DRIVER`] (3) means the host has no CUDA driver library
//! (`libcuda.so.1`) and nothing was done: the step fails, reported as skipped (this node
//! cannot clear GPU memory) with the helper's line, as when the helper itself is not
//! installed. Every other non-zero exit, or a death by signal, fails the step. Either way
//! the device is quarantined: a GPU whose memory was not cleared never goes back to the
//! pool unless an operator chose so (the variant's `scrub_policy: reset-only`, under which
//! the control plane sends no zeroing step at all). On success the helper's last stdout
//! line (its summary: bytes zeroed and verified, time, rate) is the step's detail.
//!
//! The workspace's own helper is the `passage-gpu-zero` crate (`node-agent/gpu-zero/`):
//! it loads `libcuda.so.1` at run time, clears with `cuMemsetD32` and reads back into
//! page-locked host buffers checked on several threads; its exit codes are 0, 1
//! (failed), 2 (bad arguments), 3 (no driver) and 4 (memory not zero).

use super::Outcome;
use super::env::{GPU_ZERO_HELPER, NVIDIA_SMI, ScrubEnv};
use super::process::{describe_failure, run, run_capturing, truncate};
use passage_model::PciAddress;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const NVIDIA_SMI_TIMEOUT: Duration = Duration::from_secs(60);
/// Clearing and reading back 80 GiB or more of HBM takes seconds; minutes means stuck.
pub const GPU_ZERO_TIMEOUT: Duration = Duration::from_secs(300);
/// The helper's exit code for "no CUDA driver on this host; nothing done".
pub const GPU_ZERO_NO_DRIVER: i32 = 3;
pub const DEFAULT_COMMAND_TIMEOUT_SECS: u64 = 60;
/// A longer step would outlive any task timeout the control plane would wait out.
pub const MAX_COMMAND_TIMEOUT_SECS: u64 = 3600;

pub(super) fn nvidia_reset(env: &ScrubEnv, addr: PciAddress) -> Outcome {
    let Some(smi) = env.program(env.nvidia_smi.as_deref(), NVIDIA_SMI) else {
        return Outcome::Skipped("nvidia-smi not installed".to_string());
    };
    let bdf = addr.to_string();
    let r = run(&smi, &["--gpu-reset", "-i", &bdf], NVIDIA_SMI_TIMEOUT);
    match describe_failure("nvidia-smi --gpu-reset", r, NVIDIA_SMI_TIMEOUT) {
        None => Outcome::Done(None),
        Some(why) => Outcome::Failed(why),
    }
}

pub(super) fn zero_gpu_memory(env: &ScrubEnv, addr: PciAddress) -> Outcome {
    let Some(helper) = env.program(env.gpu_zero_helper.as_deref(), GPU_ZERO_HELPER) else {
        return Outcome::Unable(format!("{GPU_ZERO_HELPER} not found"));
    };
    let bdf = addr.to_string();
    let r = run_capturing(&helper, &["--bdf", &bdf], GPU_ZERO_TIMEOUT);
    if let Ok((f, _)) = &r
        && f.status.code() == Some(GPU_ZERO_NO_DRIVER)
    {
        return Outcome::Unable(if f.stderr.is_empty() {
            format!("{GPU_ZERO_HELPER} found no CUDA driver; GPU memory not zeroed")
        } else {
            f.stderr.clone()
        });
    }
    // The helper's summary (bytes zeroed and verified, time, rate) is its last line on
    // stdout; the report keeps it.
    let (r, summary) = match r {
        Ok((f, out)) => (
            Ok(f),
            out.lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(truncate),
        ),
        Err(e) => (Err(e), None),
    };
    match describe_failure(GPU_ZERO_HELPER, r, GPU_ZERO_TIMEOUT) {
        None => {
            Outcome::Done(Some(summary.unwrap_or_else(|| {
                format!("zeroed and verified by {}", helper.display())
            })))
        }
        Some(why) => Outcome::Failed(why),
    }
}

/// An operator's command, with `{bdf}` and `{path}` (the function's directory in the
/// agent's sysfs tree) replaced in its arguments. The program is looked up on the
/// agent's `PATH` as `execvp` would; nothing passes through a shell.
pub(super) fn command(
    argv: &[String],
    timeout_secs: Option<u64>,
    addr: PciAddress,
    dir: &Path,
) -> Outcome {
    let Some((program, args)) = argv.split_first() else {
        return Outcome::Failed("empty command".to_string());
    };
    if program.is_empty() {
        return Outcome::Failed("empty command".to_string());
    }
    let secs = timeout_secs.unwrap_or(DEFAULT_COMMAND_TIMEOUT_SECS);
    if !(1..=MAX_COMMAND_TIMEOUT_SECS).contains(&secs) {
        return Outcome::Failed(format!(
            "timeout_secs must be between 1 and {MAX_COMMAND_TIMEOUT_SECS}, not {secs}"
        ));
    }
    let timeout = Duration::from_secs(secs);
    let (bdf, path) = (addr.to_string(), dir.to_string_lossy());
    let args: Vec<String> = args.iter().map(|a| substitute(a, &bdf, &path)).collect();
    let r = run(&PathBuf::from(program), &args, timeout);
    match describe_failure(program, r, timeout) {
        None => Outcome::Done(None),
        Some(why) => Outcome::Failed(why),
    }
}

/// One pass, so a path that happens to contain `{bdf}` is not rewritten again.
fn substitute(arg: &str, bdf: &str, path: &str) -> String {
    let mut out = String::with_capacity(arg.len());
    let mut rest = arg;
    while let Some(i) = rest.find('{') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("{bdf}") {
            out.push_str(bdf);
            rest = t;
        } else if let Some(t) = tail.strip_prefix("{path}") {
            out.push_str(path);
            rest = t;
        } else {
            out.push('{');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::substitute;

    #[test]
    fn substitutes_once() {
        assert_eq!(
            substitute("x{bdf}-{path}{}{", "0000:01:00.0", "/s/{bdf}"),
            "x0000:01:00.0-/s/{bdf}{}{"
        );
        assert_eq!(substitute("plain", "a", "b"), "plain");
        assert_eq!(substitute("é{bdf}é", "a", "b"), "éaé");
    }
}
