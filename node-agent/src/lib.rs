//! Passage node agent: discovers PCI functions from sysfs, binds them for passthrough,
//! launches VMs through a hypervisor backend, scrubs devices after use and speaks the
//! agent protocol to the control plane.

pub mod agent;
pub mod config;
pub mod fake;
pub mod host;
pub mod hypervisor;
pub mod images;
pub mod metadata;
pub mod net;
pub mod ppt;
pub mod scrub;
pub mod seed;
pub mod state;
