//! One module per area; `cargo nextest run -E 'test(api::)'` (or any part of a test's
//! path) picks an area.

mod addresses;
mod api;
mod clean_stop;
mod cloudapi;
mod console;
mod durable;
mod e2e;
mod gpu_clearing;
mod guest_console;
mod guest_metadata;
mod guest_power;
mod guest_ssh;
mod images;
mod keys;
mod lifecycle;
mod networks;
mod openapi;
mod ops;
mod pagination;
mod portal;
mod room;
mod sagas;
mod schema;
mod security;
mod sriov;
mod store;
mod tls;
mod triton_cli;
mod vgpus;
mod vm_labels;
mod workflows;
