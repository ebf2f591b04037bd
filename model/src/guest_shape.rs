//! How a VM's vCPUs, RAM and device BARs map onto the host that runs it: the split over
//! the NUMA nodes of its devices, and the guest physical address width its RAM and 64-bit
//! PCI window need. The node agent lays out the QEMU command line with these rules and
//! the control plane places VMs with the same ones, so a VM placed is a VM that launches.

use crate::pci::{BarKind, PciBar};
use std::collections::BTreeMap;

pub const GIB: u64 = 1 << 30;
const FOUR_GIB: u64 = 4 * GIB;
/// q35 keeps guest RAM below 2 GiB when the VM has more than 2.75 GiB, the rest above
/// 4 GiB (QEMU's `pc_q35_init`).
const Q35_LOWMEM_SPLIT: u64 = 0xb000_0000;
const Q35_LOWMEM: u64 = 0x8000_0000;
/// Room in the 64-bit window for what is not passed through (virtio's 64-bit BARs).
const WINDOW_SLACK: u64 = GIB;
/// QEMU's own default guest address width under TCG, and a floor for the width asked.
pub const DEFAULT_PHYS_BITS: u8 = 40;
/// The widest guest address x86-64 QEMU emulates.
pub const MAX_PHYS_BITS: u8 = 52;

/// One guest NUMA node's share of a VM, mirroring one host node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeShare {
    pub host_node: u32,
    /// The vCPU indexes, `first..end`; empty when the VM has fewer vCPUs than nodes.
    pub vcpus: std::ops::Range<u32>,
    pub memory_mib: u64,
}

/// vCPUs and RAM split evenly over `host_nodes` (in order), in whole pages of `page_mib`;
/// the first nodes take what does not divide.
pub fn split(vcpus: u32, memory_mib: u64, page_mib: u64, host_nodes: &[u32]) -> Vec<NodeShare> {
    let n = host_nodes.len() as u64;
    if n == 0 {
        return Vec::new();
    }
    let page_mib = page_mib.max(1);
    let pages = memory_mib / page_mib;
    let mut out = Vec::with_capacity(host_nodes.len());
    let mut cpu = 0;
    for (i, &host_node) in host_nodes.iter().enumerate() {
        let i = i as u64;
        let take_cpus = vcpus / n as u32 + u32::from((i as u32) < vcpus % n as u32);
        let take_pages = pages / n + u64::from(i < pages % n);
        out.push(NodeShare {
            host_node,
            vcpus: cpu..cpu + take_cpus,
            memory_mib: take_pages * page_mib,
        });
        cpu += take_cpus;
    }
    out
}

/// The host NUMA nodes a VM's devices come from, sorted, each once: its guest nodes when
/// there are two or more, the node its RAM and vCPUs are bound to when there is one.
pub fn host_nodes(numa: impl IntoIterator<Item = Option<u32>>) -> Vec<u32> {
    let mut n: Vec<u32> = numa.into_iter().flatten().collect();
    n.sort_unstable();
    n.dedup();
    n
}

/// What one guest root port's prefetchable window takes of the 64-bit PCI window: its
/// device's 64-bit memory BARs (largest first, each naturally aligned), so their total
/// rounded up to the largest, aligned to the largest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortWindow {
    pub size: u64,
    pub align: u64,
}

/// The window of one passed device's functions; `None` when none has a 64-bit BAR.
pub fn port_window<'a>(bars: impl IntoIterator<Item = &'a PciBar>) -> Option<PortWindow> {
    let mut sizes: Vec<u64> = bars
        .into_iter()
        .filter(|b| b.kind == BarKind::Memory && b.is_64bit && b.size > 0)
        .map(|b| b.size.next_power_of_two())
        .collect();
    if sizes.is_empty() {
        return None;
    }
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let largest = sizes[0];
    let total = sizes.iter().fold(0u64, |acc, s| acc.saturating_add(*s));
    Some(PortWindow {
        size: round_up(total, largest),
        align: largest,
    })
}

/// The 64-bit window a VM needs: each root bus (`pcie.0`, or one expander per guest NUMA
/// node, keyed by `bus`) is a window of its own holding its root ports' windows, aligned
/// to the largest of them; plus room for virtio, in whole GiB. 0 when no port has one.
pub fn window<K: Ord>(ports: impl IntoIterator<Item = (K, PortWindow)>) -> u64 {
    let mut buses: BTreeMap<K, (u64, u64)> = BTreeMap::new();
    for (bus, port) in ports {
        let b = buses.entry(bus).or_insert((0, 0));
        b.0 = b.0.saturating_add(port.size);
        b.1 = b.1.max(port.align);
    }
    if buses.is_empty() {
        return 0;
    }
    let sum = buses.values().fold(0u64, |acc, (total, align)| {
        acc.saturating_add(round_up(*total, *align))
    });
    round_up(sum.saturating_add(WINDOW_SLACK), GIB)
}

/// The 64-bit window of a VM whose devices are `(host NUMA node, port window)`, laid out
/// as the agent lays them out: one root bus per host node when they come from two or
/// more (a device whose node is unknown with the first), else one.
pub fn vm_window(devices: &[(Option<u32>, Option<PortWindow>)]) -> u64 {
    let nodes = host_nodes(devices.iter().map(|(n, _)| *n));
    window(devices.iter().filter_map(|(n, w)| {
        let bus = if nodes.len() >= 2 {
            n.and_then(|n| nodes.iter().position(|h| *h == n))
                .unwrap_or(0)
        } else {
            0
        };
        w.map(|w| (bus, w))
    }))
}

/// The guest address width a VM with `memory_mib` of RAM and a 64-bit window of `hole64`
/// bytes needs. OVMF puts the window above the RAM at an address aligned to the largest
/// power of two not above its size; q35 puts RAM beyond 2 GiB above 4 GiB.
pub fn phys_bits_needed(memory_mib: u64, hole64: u64) -> u8 {
    let ram = memory_mib.saturating_mul(1 << 20);
    let above_4g = if ram >= Q35_LOWMEM_SPLIT {
        ram - Q35_LOWMEM
    } else {
        0
    };
    let first = FOUR_GIB.saturating_add(above_4g);
    let end = if hole64 == 0 {
        first
    } else {
        let align = 1u64 << (63 - hole64.leading_zeros());
        round_up(first, align).saturating_add(hole64)
    };
    let bits = 64 - (end.saturating_sub(1)).leading_zeros();
    (bits as u8).max(DEFAULT_PHYS_BITS)
}

/// Why a VM of `memory_mib` with a 64-bit window of `hole64` does not fit a host whose
/// CPUs have `host_bits` of physical address; `None` when it fits.
pub fn width_lacks(memory_mib: u64, hole64: u64, host_bits: u8) -> Option<String> {
    let needed = phys_bits_needed(memory_mib, hole64);
    (needed > host_bits).then(|| {
        format!(
            "its {memory_mib} MiB of RAM and {} GiB of device BARs need {needed}-bit guest \
             addresses; this host's CPUs have {host_bits}",
            hole64 / GIB
        )
    })
}

pub fn round_up(v: u64, to: u64) -> u64 {
    if to == 0 {
        return v;
    }
    v.div_ceil(to).saturating_mul(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bar(index: u8, size: u64, is_64bit: bool) -> PciBar {
        PciBar {
            index,
            kind: BarKind::Memory,
            start: 0,
            size,
            is_64bit,
            prefetchable: is_64bit,
        }
    }

    fn h100() -> Vec<PciBar> {
        vec![
            bar(0, 16 << 20, false),
            bar(1, 128 * GIB, true),
            bar(3, 32 << 20, true),
        ]
    }

    #[test]
    fn an_h100_port_takes_twice_its_bar1() {
        // 128 GiB + 32 MiB, rounded up to the 128 GiB alignment.
        assert_eq!(
            port_window(&h100()),
            Some(PortWindow {
                size: 256 * GIB,
                align: 128 * GIB
            })
        );
        assert_eq!(port_window(&[bar(0, 16 << 20, false)]), None);
    }

    #[test]
    fn eight_h100s_on_two_nodes() {
        let w = port_window(&h100());
        let devs: Vec<_> = (0..8).map(|i| (Some(i / 4), w)).collect();
        // Two buses of 4 × 256 GiB each, plus a GiB for virtio.
        assert_eq!(vm_window(&devs), 2049 * GIB);
        assert_eq!(phys_bits_needed(1024 * 1024, vm_window(&devs)), 43);
        assert!(width_lacks(1024 * 1024, vm_window(&devs), 46).is_none());
        let why = width_lacks(1024 * 1024, vm_window(&devs), 42).unwrap_or_default();
        assert!(why.contains("need 43-bit"), "{why}");
        // Nothing passed: QEMU's defaults.
        assert_eq!(vm_window(&[]), 0);
        assert_eq!(phys_bits_needed(2048, 0), DEFAULT_PHYS_BITS);
    }

    #[test]
    fn shares_add_up() {
        let s = split(9, 10 * 1024, 1024, &[0, 1]);
        assert_eq!(s[0].vcpus, 0..5);
        assert_eq!(s[1].vcpus, 5..9);
        assert_eq!(s[0].memory_mib + s[1].memory_mib, 10 * 1024);
        assert!(split(4, 1024, 1, &[]).is_empty());
        assert_eq!(host_nodes([Some(1), None, Some(0), Some(1)]), vec![0, 1]);
    }

    #[test]
    fn address_width_follows_ovmf_placement() {
        // 2 GiB of RAM sits below 4 GiB; a 2 TiB + 1 GiB window aligned to 2 TiB ends
        // past 4 TiB: 43 bits. Exactly 2 TiB ends at 4 TiB: 42.
        assert_eq!(phys_bits_needed(2048, 2049 * GIB), 43);
        assert_eq!(phys_bits_needed(2048, 2048 * GIB), 42);
        assert_eq!(phys_bits_needed(2048, 0), 40);
        assert_eq!(phys_bits_needed(u64::MAX, u64::MAX), 64);
    }
}
