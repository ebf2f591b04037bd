//! Fake hardware: a generator of sysfs trees shaped like a real kernel's for a GPU
//! server, and a fake kernel that reacts to attribute writes on such a tree.

mod kernel;
mod tree;
mod vgpu;

pub use kernel::{BUSY_DIR, FakeKernel, RESET_LOG, native_driver, set_busy};
pub use tree::{
    FAKE_BRIDGE, FAKE_CPUINFO_ADDRESS_SIZES, FAKE_DEV_DIR, FAKE_NVME_BYTES, FAKE_PROC_DIR,
    FakeError, FakeOptions, FakeSpec, FakeTree, GpuModel, generate, generate_with,
};
pub use vgpu::{FAKE_NVIDIA_SMI, FakeVgpu};
