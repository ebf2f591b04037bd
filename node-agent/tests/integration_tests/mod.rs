//! One module per area: discovery against pciutils, binding, scrubbing, the QEMU
//! backend, robustness of the parsers.

mod agent_images;
mod binding;
mod bridges;
mod guest_boot;
mod guest_layout;
mod guest_seed;
mod images;
mod metadata_rules;
mod netns;
mod pciutils;
mod qemu;
mod robustness;
mod scrub;
mod slow_start;
mod sriov;
mod taps;
mod vgpu_slots;

/// The values a guest's console shows for `KEY=` (`PASSAGE-EDU-COUNT`, say), in order,
/// each up to the line's end or its first control character: the guest's scripts write
/// straight to the serial port while systemd and getty write theirs, so a report may
/// land mid-line or among the other's escape codes.
pub fn reported(console: &str, key: &str) -> Vec<String> {
    let prefix = format!("{key}=");
    let mut out: Vec<String> = console
        .lines()
        .filter_map(|l| l.split_once(&prefix))
        .map(|(_, v)| {
            v.split(char::is_control)
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .collect();
    // cloud-init copies a script's output to the console too: each once.
    out.dedup();
    out
}

/// Stops every guest its hypervisor runs when it drops. QEMU outlives whoever started it
/// by design, so a test that fails before its own stop would leave an emulated guest
/// using a CPU for good.
pub struct StopOnDrop<'a>(pub &'a dyn node_agent::hypervisor::Hypervisor);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        for vm in self.0.running() {
            let _ = self.0.stop(vm);
        }
    }
}
