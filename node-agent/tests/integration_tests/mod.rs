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

/// The values a guest's console shows for `KEY=` (`PASSAGE-EDU-COUNT`, say), in order: a
/// report's digits wherever they are in a line, as the guest's script writes straight to
/// the serial port while systemd and getty write theirs, and one may land mid-line
/// or behind the other's escape codes.
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
