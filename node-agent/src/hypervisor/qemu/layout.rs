//! Where a VM's passed devices sit in the guest, how its memory and vCPUs split into
//! guest NUMA nodes, and how much 64-bit address space its devices need. Pure: it works
//! from what the host says about each function ([`PassedFunction`]), so the command line
//! for eight H100s can be checked without one.
//!
//! The shape follows what a GPU needs from a guest to work as on bare metal:
//! - each device behind its own `pcie-root-port`, at `addr=0` with its functions
//!   together (a GPU and its audio function as one multifunction device), so the guest
//!   sees a PCIe link and can reset the device with a secondary bus reset;
//! - when the VM's devices come from two or more host NUMA nodes, one guest NUMA node
//!   per host node, each with a `pxb-pcie` expander holding its devices' root ports, so
//!   the guest's `numa_node` of each device mirrors the host's;
//! - a 64-bit PCI window large enough for every 64-bit BAR (an H100's BAR1 alone is
//!   128 GiB; firmware's default window is 32 GiB), and the guest address width it needs.

use passage_model::{DevicePath, PciAddress, PciBar};
use std::collections::BTreeMap;

use passage_model::guest_shape::{self, GIB, PortWindow};
pub use passage_model::guest_shape::{DEFAULT_PHYS_BITS, MAX_PHYS_BITS, NodeShare as GuestNode};
/// The first expander's bus number: `pcie.0` and what hangs below it keep the numbers
/// before it (when there are expanders, no root port is on `pcie.0`).
const FIRST_EXPANDER_BUS: u32 = 0x20;
/// Guest NUMA nodes (and so expanders) one VM may have; no host has more NUMA nodes
/// with GPUs.
pub const MAX_EXPANDERS: usize = 8;

const NVIDIA: u16 = 0x10de;

/// What the host says about one function the VM is given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassedFunction {
    pub path: DevicePath,
    pub vendor: u16,
    /// The PCI class code (`0x030200` for a 3D controller).
    pub class: u32,
    pub numa_node: Option<u32>,
    /// The upstream port of the host PCIe switch the function sits behind, if any.
    pub switch: Option<PciAddress>,
    pub bars: Vec<PciBar>,
}

impl PassedFunction {
    fn is_gpu(&self) -> bool {
        self.class >> 16 == 0x03
    }

    /// The host device the function belongs to: a vGPU is a device of its own.
    fn device_key(&self) -> (String, Option<uuid::Uuid>) {
        let a = self.path.address();
        (
            format!("{:04x}:{:02x}:{:02x}", a.domain, a.bus, a.device),
            self.path.vgpu(),
        )
    }
}

/// One guest PCIe slot: a root port and the functions of one device on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Indexes into the VM's devices (and the facts), in guest function order.
    pub functions: Vec<usize>,
    /// The guest NUMA node whose expander holds the root port; `None`: on `pcie.0`.
    pub guest_node: Option<usize>,
    /// NVIDIA's P2P hint: GPUs behind one host PCIe switch share an id.
    pub clique: Option<u8>,
}

/// Where everything goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub slots: Vec<Slot>,
    /// Empty: one guest node, no `-numa`.
    pub nodes: Vec<GuestNode>,
    /// Per guest node, the first bus number of its `pxb-pcie` expander (the expander's
    /// root bus; its root ports take the numbers after it).
    pub expander_buses: Vec<u32>,
    /// The 64-bit PCI window to ask for, in bytes; 0 leaves QEMU's and the firmware's
    /// defaults (no large BARs).
    pub hole64: u64,
    /// The guest physical address width the RAM and the window need.
    pub phys_bits_needed: u8,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error(
        "its {memory_mib} MiB of RAM and {window_gib} GiB of device BARs need {needed}-bit guest \
         addresses; this host's CPUs have {host} (a VM this large does not fit this node)"
    )]
    AddressWidth {
        memory_mib: u64,
        window_gib: u64,
        needed: u8,
        host: u8,
    },
    #[error("its devices come from {0} NUMA nodes; at most {MAX_EXPANDERS} are supported")]
    TooManyNodes(usize),
    #[error("its {0} devices do not fit the guest's PCI bus numbers")]
    TooManyDevices(usize),
    #[error("its RAM ({memory_mib} MiB) is not a multiple of {page_kib} KiB pages")]
    PageSize { memory_mib: u64, page_kib: u64 },
}

/// Lays out a VM of `vcpus` and `memory_mib` with `functions` (in the spec's order).
/// `page_kib` is the page size its RAM comes in (4 for ordinary pages): each guest node's
/// share is a whole number of pages.
pub fn plan(
    vcpus: u32,
    memory_mib: u64,
    functions: &[PassedFunction],
    page_kib: u64,
) -> Result<Layout, LayoutError> {
    let page_mib = (page_kib / 1024).max(1);
    if page_kib >= 1024 && !memory_mib.is_multiple_of(page_mib) {
        return Err(LayoutError::PageSize {
            memory_mib,
            page_kib,
        });
    }
    // Guest nodes: the host nodes the devices come from, in order, when there are two
    // or more. One host node needs no guest topology: binding the RAM is enough.
    let host_nodes = guest_shape::host_nodes(functions.iter().map(|f| f.numa_node));
    let nodes = if host_nodes.len() >= 2 {
        if host_nodes.len() > MAX_EXPANDERS {
            return Err(LayoutError::TooManyNodes(host_nodes.len()));
        }
        guest_shape::split(vcpus, memory_mib, page_mib, &host_nodes)
    } else {
        Vec::new()
    };
    let guest_node_of = |f: &PassedFunction| {
        if nodes.is_empty() {
            return None;
        }
        // A function whose node the host does not know goes with the first node.
        Some(
            f.numa_node
                .and_then(|h| nodes.iter().position(|n| n.host_node == h))
                .unwrap_or(0),
        )
    };

    // Slots: functions of one host device together, in the order the devices first
    // appear in the spec; within a device, by host function number.
    let mut order: Vec<(String, Option<uuid::Uuid>)> = Vec::new();
    let mut members: BTreeMap<(String, Option<uuid::Uuid>), Vec<usize>> = BTreeMap::new();
    for (i, f) in functions.iter().enumerate() {
        let key = f.device_key();
        if !members.contains_key(&key) {
            order.push(key.clone());
        }
        members.entry(key).or_default().push(i);
    }
    let mut cliques: BTreeMap<PciAddress, u8> = BTreeMap::new();
    let mut slots = Vec::with_capacity(order.len());
    for key in order {
        let mut fns = members.remove(&key).unwrap_or_default();
        fns.sort_by_key(|&i| functions[i].path.address().function);
        let lead = &functions[fns[0]];
        // Only where two of the VM's GPUs share a switch does a clique say anything.
        let clique = lead
            .switch
            .filter(|_| lead.vendor == NVIDIA && lead.is_gpu() && lead.path.vgpu().is_none())
            .filter(|s| {
                functions
                    .iter()
                    .filter(|f| f.vendor == NVIDIA && f.is_gpu() && f.path.vgpu().is_none())
                    .filter(|f| f.switch.as_ref() == Some(s))
                    .map(PassedFunction::device_key)
                    .collect::<std::collections::BTreeSet<_>>()
                    .len()
                    >= 2
            })
            .map(|s| {
                let next = cliques.len() as u8;
                *cliques.entry(s).or_insert(next)
            });
        slots.push(Slot {
            guest_node: guest_node_of(lead),
            functions: fns,
            clique,
        });
    }

    // Each expander's root bus, then one bus per root port on it.
    let mut expander_buses = Vec::with_capacity(nodes.len());
    let mut next = FIRST_EXPANDER_BUS;
    for k in 0..nodes.len() {
        let ports = slots.iter().filter(|s| s.guest_node == Some(k)).count() as u32;
        expander_buses.push(next);
        next = guest_shape::round_up(u64::from(next + 1 + ports), 0x10) as u32;
    }
    if next > 0x100 {
        return Err(LayoutError::TooManyDevices(slots.len()));
    }
    let hole64 = window(&slots, functions);
    let phys_bits_needed = guest_shape::phys_bits_needed(memory_mib, hole64);
    Ok(Layout {
        slots,
        nodes,
        expander_buses,
        hole64,
        phys_bits_needed,
    })
}

/// The 64-bit window: each root port's window holds its device's 64-bit BARs; each root
/// bus (`pcie.0` or an expander) is a window of its own.
fn window(slots: &[Slot], functions: &[PassedFunction]) -> u64 {
    guest_shape::window(slots.iter().filter_map(|slot| {
        let port: Option<PortWindow> = guest_shape::port_window(
            slot.functions
                .iter()
                .flat_map(|&i| functions[i].bars.iter()),
        );
        port.map(|p| (slot.guest_node, p))
    }))
}

/// Refuses a layout the host's address width cannot hold.
pub fn check_width(layout: &Layout, memory_mib: u64, host_bits: u8) -> Result<(), LayoutError> {
    if layout.phys_bits_needed > host_bits {
        return Err(LayoutError::AddressWidth {
            memory_mib,
            window_gib: layout.hole64 / GIB,
            needed: layout.phys_bits_needed,
            host: host_bits,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn bar(index: u8, size: u64, is_64bit: bool) -> PciBar {
        PciBar {
            index,
            kind: passage_model::BarKind::Memory,
            start: 0,
            size,
            is_64bit,
            prefetchable: is_64bit,
        }
    }

    fn h100_bars() -> Vec<PciBar> {
        vec![
            bar(0, 16 * MIB, false),
            bar(1, 128 * GIB, true),
            bar(3, 32 * MIB, true),
        ]
    }

    fn path_switch(p: &DevicePath) -> Option<PciAddress> {
        let parents = p.parents();
        (parents.len() >= 3).then(|| parents[parents.len() - 2])
    }

    /// An HGX-like GPU: root port, switch up and down ports, GPU.
    fn gpu(root_bus: u8, switch_bus: u8, gpu_bus: u8, numa: u32) -> PassedFunction {
        let path = format!(
            "/devices/pci0000:{root_bus:02x}/0000:{root_bus:02x}:01.0/0000:{:02x}:00.0/\
             0000:{:02x}:{:02x}.0/0000:{gpu_bus:02x}:00.0",
            switch_bus,
            switch_bus + 1,
            gpu_bus & 0x1f
        );
        let path: DevicePath = path.parse().unwrap();
        PassedFunction {
            path: path.clone(),
            vendor: NVIDIA,
            class: 0x030200,
            numa_node: Some(numa),
            switch: path_switch(&path),
            bars: h100_bars(),
        }
    }

    #[test]
    fn one_h100_gets_a_window_for_its_bars() {
        let l = plan(8, 65536, &[gpu(0x15, 0x16, 0x18, 0)], 4).unwrap();
        assert_eq!(l.slots.len(), 1);
        assert!(l.nodes.is_empty(), "one host node, no guest topology");
        assert_eq!(l.slots[0].clique, None, "alone behind its switch");
        // 128 GiB + 32 MiB aligned to 128 GiB: 256 GiB, and a GiB for the rest.
        assert_eq!(l.hole64, 257 * GIB);
        // 64 GiB of RAM ends at 66 GiB; the window at 256 GiB ends at 513 GiB.
        assert_eq!(l.phys_bits_needed, 40);
    }

    #[test]
    fn eight_h100s_over_two_nodes() {
        let gpus: Vec<_> = (0..8u8)
            .map(|i| {
                let node = u32::from(i / 4);
                let root = if node == 0 { 0x15 } else { 0x95 };
                // Two GPUs behind each switch.
                gpu(
                    root,
                    root + 1 + (i % 4 / 2) * 8,
                    root + 3 + (i % 4 / 2) * 8 + i % 2,
                    node,
                )
            })
            .collect();
        let l = plan(32, 1024 * 1024, &gpus, 4).unwrap();
        assert_eq!(l.nodes.len(), 2);
        assert_eq!(l.nodes[0].vcpus, 0..16);
        assert_eq!(l.nodes[1].vcpus, 16..32);
        assert_eq!(l.nodes[0].memory_mib, 512 * 1024);
        let on: Vec<_> = l.slots.iter().map(|s| s.guest_node).collect();
        assert_eq!(
            on,
            [
                Some(0),
                Some(0),
                Some(0),
                Some(0),
                Some(1),
                Some(1),
                Some(1),
                Some(1)
            ]
        );
        let cliques: Vec<_> = l.slots.iter().map(|s| s.clique).collect();
        assert_eq!(
            cliques,
            [
                Some(0),
                Some(0),
                Some(1),
                Some(1),
                Some(2),
                Some(2),
                Some(3),
                Some(3)
            ]
        );
        // Eight 256 GiB root-port windows and a GiB.
        assert_eq!(l.hole64, 2049 * GIB);
        // 1 TiB of RAM ends near 1 TiB + 2 GiB; the window, aligned to 2 TiB, ends
        // beyond 4 TiB.
        assert_eq!(l.phys_bits_needed, 43);
        assert_eq!(
            check_width(&l, 1024 * 1024, 42),
            Err(LayoutError::AddressWidth {
                memory_mib: 1024 * 1024,
                window_gib: 2049,
                needed: 43,
                host: 42
            })
        );
        assert_eq!(check_width(&l, 1024 * 1024, 46), Ok(()));
    }

    #[test]
    fn a_gpu_and_its_audio_function_share_a_slot() {
        let g = gpu(0x15, 0x16, 0x18, 0);
        let mut audio = g.clone();
        audio.path = g
            .path
            .to_string()
            .replace("0000:18:00.0", "0000:18:00.1")
            .parse()
            .unwrap();
        audio.class = 0x040300;
        audio.bars = vec![bar(0, 16 * 1024, false)];
        // Given audio first, the GPU is still function 0.
        let l = plan(4, 8192, &[audio, g], 4).unwrap();
        assert_eq!(l.slots.len(), 1);
        assert_eq!(l.slots[0].functions, [1, 0]);
    }

    #[test]
    fn memory_splits_in_whole_pages() {
        let gpus = [gpu(0x15, 0x16, 0x18, 0), gpu(0x95, 0x96, 0x98, 1)];
        let l = plan(3, 5 * 1024, &gpus, 1024 * 1024).unwrap();
        assert_eq!(l.nodes[0].memory_mib, 3 * 1024);
        assert_eq!(l.nodes[1].memory_mib, 2 * 1024);
        assert_eq!(l.nodes[0].vcpus, 0..2);
        assert_eq!(l.nodes[1].vcpus, 2..3);
        assert_eq!(
            plan(3, 5001, &gpus, 2048),
            Err(LayoutError::PageSize {
                memory_mib: 5001,
                page_kib: 2048
            })
        );
    }

    #[test]
    fn no_large_bars_no_window() {
        let mut g = gpu(0x15, 0x16, 0x18, 0);
        g.bars.clear();
        let l = plan(1, 1024, &[g], 4).unwrap();
        assert_eq!(l.hole64, 0);
        assert_eq!(l.phys_bits_needed, DEFAULT_PHYS_BITS);
    }
}
