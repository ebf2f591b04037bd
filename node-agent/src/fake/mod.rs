//! Fake hardware: a generator of sysfs trees shaped like a real kernel's for a GPU
//! server, and a fake kernel that reacts to attribute writes on such a tree.

mod gpu_zero;
mod kernel;
mod tree;
mod vgpu;

pub use gpu_zero::{
    FAKE_GPU_MEMORY_BYTES, FAKE_GPU_MEMORY_DIR, FAKE_GPU_ZERO, FakeFault, ensure_gpu_zero,
    gpu_memory, set_fault,
};
pub use kernel::{BUSY_DIR, FakeKernel, HOST_LOG, RESET_LOG, native_driver, set_busy};
pub use tree::{
    FAKE_BRIDGE, FAKE_CPUINFO_ADDRESS_SIZES, FAKE_DEV_DIR, FAKE_NVME_BYTES, FAKE_PROC_DIR,
    FakeError, FakeOptions, FakeSpec, FakeTree, GpuModel, generate, generate_with,
};
pub use vgpu::{FAKE_BIN_DIR, FAKE_NVIDIA_SMI, FakeVgpu};
