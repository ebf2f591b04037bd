//! One module per area: discovery against pciutils, binding, scrubbing, the QEMU
//! backend, robustness of the parsers.

mod agent_images;
mod binding;
mod bridges;
mod guest_boot;
mod guest_seed;
mod images;
mod netns;
mod pciutils;
mod qemu;
mod robustness;
mod scrub;
mod sriov;
mod taps;
mod vgpu_slots;
