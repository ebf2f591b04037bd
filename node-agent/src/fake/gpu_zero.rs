//! The fake world's GPU memory and its zeroing helper: a stand-in for `passage-gpu-zero`
//! (`node-agent/gpu-zero`) that a generated tree carries, so simulated nodes scrub their
//! GPUs through the same step, exit codes and summary line as a real host.
//!
//! Each GPU's memory is a file, `FAKE_GPU_MEMORY_DIR/BDF` (made on the first scrub,
//! [`FAKE_GPU_MEMORY_BYTES`] long; a test may write a larger or dirtier one first). The
//! stand-in answers like the real helper: exit 3 when the vendor driver is absent (no
//! `bus/pci/drivers/nvidia` in the tree, or the [`FakeFault::NoCudaDriver`] switch), exit
//! 1 when the GPU is not bound to `nvidia` (CUDA cannot open it), else it writes zeros
//! over the whole file, reads it back, and exits 4 naming the first byte that is not zero,
//! or 0 with the real helper's summary line on stdout.

use std::fs;
use std::io;
use std::path::Path;

/// The stand-in (relative to the tree's root), beside the `nvidia-smi` one.
pub const FAKE_GPU_ZERO: &str = ".passage-fake-bin/passage-gpu-zero";
/// Where the stand-in is moved while [`FakeFault::GpuZeroMissing`] is on.
const FAKE_GPU_ZERO_OFF: &str = ".passage-fake-bin/passage-gpu-zero.missing";
/// The fake GPUs' memory, one file per GPU named by its address.
pub const FAKE_GPU_MEMORY_DIR: &str = ".passage-fake-gpu-memory";
/// A fake GPU's memory when the stand-in makes it: small, since a simulated fleet has
/// thousands of GPUs.
pub const FAKE_GPU_MEMORY_BYTES: u64 = 64 * 1024;
/// One empty file per fault switched on.
pub(crate) const FAULTS_DIR: &str = ".passage-fake-faults";

/// Faults a test injects into a generated tree's GPU tools, from outside the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FakeFault {
    /// The zeroing helper is not installed.
    GpuZeroMissing,
    /// A byte of every GPU's memory stays `0x5a` after clearing: the read-back fails.
    GpuZeroVerifyFails,
    /// The helper finds no CUDA driver (exit 3), as on a host without NVIDIA's driver.
    NoCudaDriver,
    /// Every function reset fails with EIO, as an FLR the device never completes.
    ResetFails,
}

impl FakeFault {
    fn file(self) -> &'static str {
        match self {
            FakeFault::GpuZeroMissing => "gpu-zero-missing",
            FakeFault::GpuZeroVerifyFails => "gpu-zero-verify-fails",
            FakeFault::NoCudaDriver => "no-cuda-driver",
            FakeFault::ResetFails => "reset-fails",
        }
    }
}

/// Whether `fault` is on in the tree at `root` (the fake kernel's own faults).
pub(crate) fn fault_on(root: &Path, fault: FakeFault) -> bool {
    root.join(FAULTS_DIR).join(fault.file()).exists()
}

/// Switches `fault` on or off in the generated tree at `root`.
pub fn set_fault(root: &Path, fault: FakeFault, on: bool) -> io::Result<()> {
    if fault == FakeFault::GpuZeroMissing {
        let (from, to) = if on {
            (FAKE_GPU_ZERO, FAKE_GPU_ZERO_OFF)
        } else {
            (FAKE_GPU_ZERO_OFF, FAKE_GPU_ZERO)
        };
        return match fs::rename(root.join(from), root.join(to)) {
            // Already as asked.
            Err(e) if e.kind() == io::ErrorKind::NotFound && root.join(to).exists() => Ok(()),
            r => r,
        };
    }
    let f = root.join(FAULTS_DIR).join(fault.file());
    if on {
        fs::create_dir_all(root.join(FAULTS_DIR))?;
        fs::write(f, b"")
    } else {
        match fs::remove_file(f) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// The fake memory of GPU `bdf` in the tree at `root`.
pub fn gpu_memory(root: &Path, bdf: &str) -> std::path::PathBuf {
    root.join(FAKE_GPU_MEMORY_DIR).join(bdf)
}

/// Gives a tree generated before trees carried the stand-in one (a simulated fleet's
/// kept `--sim-dir`), leaving a tree that has it, or has it switched off, as it is.
pub fn ensure_gpu_zero(root: &Path) -> io::Result<()> {
    if root.join(FAKE_GPU_ZERO).exists() || root.join(FAKE_GPU_ZERO_OFF).exists() {
        return Ok(());
    }
    write_gpu_zero(root)
}

/// Writes the stand-in into the tree at `root`.
pub(crate) fn write_gpu_zero(root: &Path) -> io::Result<()> {
    let helper = root.join(FAKE_GPU_ZERO);
    if let Some(dir) = helper.parent() {
        fs::create_dir_all(dir)?;
    }
    fs::create_dir_all(root.join(FAKE_GPU_MEMORY_DIR))?;
    fs::write(
        &helper,
        SCRIPT.replace("@BYTES@", &FAKE_GPU_MEMORY_BYTES.to_string()),
    )?;
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&helper, fs::Permissions::from_mode(0o755))
}

/// Messages and exit codes as `node-agent/gpu-zero/src/main.rs` and `zero.rs` give them.
const SCRIPT: &str = r#"#!/bin/sh
# passage-gpu-zero's stand-in over a tree written by `node-agent fake-sysfs`: the GPU's
# memory is the file .passage-fake-gpu-memory/BDF.
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
faults="$root/.passage-fake-faults"
if [ "$#" -ne 2 ] || [ "$1" != --bdf ]; then
  echo "expected --bdf followed by a PCI address" >&2; exit 2
fi
bdf=$2
case "$bdf" in
  ?*:??:??.?) ;;
  *) echo "invalid value '$bdf' for '--bdf <BDF>': expected a PCI address like 0000:3b:00.0" >&2; exit 2 ;;
esac
case "$bdf" in *[!0-9a-f:.]*)
  echo "invalid value '$bdf' for '--bdf <BDF>': expected a PCI address like 0000:3b:00.0" >&2; exit 2 ;;
esac
if [ -e "$faults/no-cuda-driver" ] || [ ! -d "$root/bus/pci/drivers/nvidia" ]; then
  echo "CUDA driver (libcuda.so.1) not found; GPU memory not zeroed" >&2; exit 3
fi
drv=$(readlink "$root/bus/pci/devices/$bdf/driver" 2>/dev/null)
if [ "${drv##*/}" != nvidia ]; then
  echo "no CUDA device at $bdf (cuDeviceGetByPCIBusId): CUDA_ERROR_INVALID_DEVICE" >&2; exit 1
fi
mem="$root/.passage-fake-gpu-memory/$bdf"
[ -f "$mem" ] || head -c @BYTES@ /dev/urandom > "$mem" || exit 1
size=$(wc -c < "$mem")
if [ "$size" -lt 8 ]; then
  echo "GPU memory could not be allocated: $size bytes" >&2; exit 1
fi
dd if=/dev/zero of="$mem" bs="$size" count=1 conv=notrunc 2>/dev/null || {
  echo "cuMemsetD32: CUDA_ERROR_UNKNOWN" >&2; exit 1; }
if [ -e "$faults/gpu-zero-verify-fails" ]; then
  printf 'Z' | dd of="$mem" bs=1 seek=$((size / 2)) conv=notrunc 2>/dev/null
fi
at=$(cmp -n "$size" "$mem" /dev/zero 2>/dev/null | sed -n 's/.* differ: [a-z]* \([0-9]*\),.*/\1/p')
if [ -n "$at" ]; then
  value=$(od -An -tx1 -j $((at - 1)) -N1 "$mem" | tr -d ' \n')
  printf 'GPU memory is not zero after clearing: byte 0x%s at device address 0x%x\n' "$value" $((at - 1)) >&2
  exit 4
fi
echo "zero $bdf" >> "$root/.passage-fake-host.log"
awk -v b="$size" -v bdf="$bdf" 'BEGIN {
  printf "%s (Passage fake GPU): zeroed and verified %.1f of %.1f GiB in 0.0 s (0.0 GiB/s)\n", bdf, b / 1073741824, b / 1073741824
}'
"#;
