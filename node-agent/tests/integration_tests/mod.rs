//! One module per area: discovery against pciutils, binding, scrubbing, the QEMU
//! backend, robustness of the parsers.

mod agent_images;
mod binding;
mod guest_boot;
mod images;
mod pciutils;
mod qemu;
mod robustness;
mod scrub;
mod sriov;
mod vgpu_slots;
