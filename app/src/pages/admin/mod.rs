pub mod accounts;
pub mod devices;
pub mod jobs;
pub mod overview;
pub mod packages;
pub mod servers;
pub mod variants;
pub mod vms;
