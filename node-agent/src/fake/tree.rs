//! Writes a sysfs tree for a GPU server: PCI roots per NUMA node, host bridges, root
//! ports, PCIe switches with GPUs behind them, and the usual chipset functions, with the
//! files and relative symlinks a kernel shows (and a `config` space pciutils can read).

use super::kernel::native_driver;
use super::vgpu::{self as fake_vgpu, FAKE_VFS, FakeGpu, FakeVgpu};
use crate::host::FAKE_MARKER;
use passage_model::{BarKind, DevicePath, PciAddress, PciBar};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The directory, at the root of a generated tree, that stands in for `/dev`: it holds a
/// regular file for each NVMe namespace, so scrubbing a fake node's NVMe writes there and
/// never to a real disk.
pub const FAKE_DEV_DIR: &str = ".passage-fake-dev";
/// The size of each fake NVMe namespace (a sparse file: it takes no disk space).
pub const FAKE_NVME_BYTES: u64 = 16 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum GpuModel {
    V100,
    A100,
    H100,
    L40s,
}

impl GpuModel {
    /// (device, subsystem device, revision); all NVIDIA parts, subsystem vendor NVIDIA.
    pub(crate) fn ids(self) -> (u16, u16, u8) {
        match self {
            GpuModel::V100 => (0x1db4, 0x1214, 0xa1),
            GpuModel::A100 => (0x20b0, 0x134f, 0xa1),
            GpuModel::H100 => (0x2330, 0x16c1, 0xa1),
            GpuModel::L40s => (0x26b9, 0x1851, 0xa1),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FakeSpec {
    pub gpus: u32,
    pub model: GpuModel,
    pub numa_nodes: u32,
}

/// Variations of the generated tree beyond [`FakeSpec`] (kept apart so code that builds
/// a `FakeSpec` by struct literal keeps compiling).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeOptions {
    /// Give each GPU an HDMI audio function `.1` in the GPU's IOMMU group, as consumer
    /// and workstation cards have: passthrough must then take both.
    pub gpu_audio: bool,
    /// CPUs online (`devices/system/cpu/online`); default 32 per NUMA node.
    pub cpus: Option<u32>,
    /// Memory over all NUMA nodes, split evenly; default 256 GiB per node.
    pub memory_mib: Option<u64>,
    /// Make the GPUs vGPU hosts of this framework (mdev needs `A100`, vendor VFIO
    /// `H100`; see [`super::vgpu`]).
    pub vgpu: Option<FakeVgpu>,
    /// Start those GPUs in MIG mode (only with `vgpu`).
    pub mig: bool,
    /// The Linux bridges the node has (`class/net/<name>/bridge/`), which a simulated
    /// node reports and hosts VMs on; default [`FAKE_BRIDGE`].
    pub bridges: Vec<String>,
    /// Huge pages reserved on each NUMA node, all free: (2 MiB pages, 1 GiB pages);
    /// default none, as a kernel boots without `hugepages=`.
    pub hugepages_per_node: (u64, u64),
}

/// The one bridge of a generated tree unless asked otherwise, so that simulated nodes can
/// host VMs on networks whose bridge is `br0`.
pub const FAKE_BRIDGE: &str = "br0";

impl Default for FakeOptions {
    fn default() -> Self {
        FakeOptions {
            gpu_audio: false,
            cpus: None,
            memory_mib: None,
            vgpu: None,
            mig: false,
            bridges: vec![FAKE_BRIDGE.to_string()],
            hugepages_per_node: (0, 0),
        }
    }
}

const FAKE_CPUS_PER_NODE: u32 = 32;
/// The stand-in for `/proc`, at the root of a generated tree: `/proc` is no part of
/// sysfs, and a simulated node must not report the host's CPUs.
pub const FAKE_PROC_DIR: &str = ".passage-fake-proc";
/// What the generated CPUs say of their address sizes (a Sapphire Rapids part's).
pub const FAKE_CPUINFO_ADDRESS_SIZES: &str = "46 bits physical, 57 bits virtual";
const FAKE_MIB_PER_NODE: u64 = 256 * 1024;

impl Default for FakeSpec {
    fn default() -> Self {
        FakeSpec {
            gpus: 8,
            model: GpuModel::H100,
            numa_nodes: 2,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FakeError {
    #[error("--numa-nodes must be between 1 and 8, not {0}")]
    NumaNodes(u32),
    #[error("{gpus} GPUs do not fit in the bus numbers of {numa_nodes} NUMA node(s)")]
    TooManyGpus { gpus: u32, numa_nodes: u32 },
    #[error("--vgpu {vgpu} needs --model {needs}")]
    VgpuModel {
        vgpu: &'static str,
        needs: &'static str,
    },
    #[error("--mig needs --vgpu")]
    MigWithoutVgpu,
    #[error("--bridge {name:?}: {reason}")]
    Bridge { name: String, reason: String },
    #[error("{0} exists and is not empty")]
    NotEmpty(PathBuf),
    #[error("writing {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// What was written, for callers and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeTree {
    pub root: PathBuf,
    pub functions: Vec<DevicePath>,
    pub gpus: Vec<DevicePath>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ids {
    vendor: u16,
    device: u16,
    subvendor: u16,
    subsystem: u16,
    revision: u8,
    class: u32,
}

/// A PCIe link as the kernel shows it in `current_link_speed` / `current_link_width`.
#[derive(Clone, Copy, Debug)]
struct Link {
    speed: &'static str,
    width: u16,
}

const GEN3_X4: Link = Link {
    speed: "8.0 GT/s PCIe",
    width: 4,
};
const GEN2_X4: Link = Link {
    speed: "5.0 GT/s PCIe",
    width: 4,
};
const GEN4_X16: Link = Link {
    speed: "16.0 GT/s PCIe",
    width: 16,
};
const GEN5_X16: Link = Link {
    speed: "32.0 GT/s PCIe",
    width: 16,
};

#[derive(Clone, Debug)]
struct Func {
    addr: PciAddress,
    ids: Ids,
    numa: u32,
    multifunction: bool,
    /// PCIe functions have a link (and AER); root-complex integrated ones have neither.
    link: Option<Link>,
    /// `sriov_totalvfs` for functions that can make virtual functions.
    sriov_total: Option<u32>,
    /// The physical slot label of the card this function is on.
    slot: Option<String>,
    /// In the IOMMU group of function 0 of the same device (not a group of its own).
    joins_group_of_fn0: bool,
    /// Primary, secondary and subordinate bus numbers for type-1 (bridge) headers.
    bridge: Option<(u8, u8, u8)>,
    /// A GPU made a vGPU host (mdev types, or vendor-VFIO VFs).
    vgpu: Option<FakeVgpu>,
    /// A VF's physical function, and a PF's VFs.
    physfn: Option<PciAddress>,
    virtfns: Vec<PciAddress>,
    children: Vec<Func>,
    /// Its regions, addresses filled in by [`assign_bars`] once the whole tree is known.
    bars: Vec<PciBar>,
    /// `reset_method`'s words; none (no file) for functions the kernel cannot reset.
    reset: &'static str,
}

const INTEL: u16 = 0x8086;
const PLX: u16 = 0x10b5;
const NVIDIA: u16 = 0x10de;

fn ids(vendor: u16, device: u16, subvendor: u16, subsystem: u16, revision: u8, class: u32) -> Ids {
    Ids {
        vendor,
        device,
        subvendor,
        subsystem,
        revision,
        class,
    }
}

fn addr(bus: u8, device: u8, function: u8) -> PciAddress {
    PciAddress {
        domain: 0,
        bus,
        device,
        function,
    }
}

fn endpoint(a: PciAddress, ids: Ids, numa: u32) -> Func {
    Func {
        addr: a,
        ids,
        numa,
        multifunction: false,
        link: None,
        sriov_total: None,
        slot: None,
        joins_group_of_fn0: false,
        bridge: None,
        vgpu: None,
        physfn: None,
        virtfns: Vec::new(),
        children: Vec::new(),
        bars: Vec::new(),
        reset: "",
    }
}

/// Hands out bus numbers depth-first, as firmware enumerates them.
struct Buses {
    next: u16,
    limit: u16,
}

impl Buses {
    fn take(&mut self) -> Option<u8> {
        if self.next > self.limit {
            return None;
        }
        let b = self.next as u8;
        self.next += 1;
        Some(b)
    }
    fn last(&self) -> u8 {
        (self.next - 1) as u8
    }
}

/// A bridge at `a` on `primary`, whose children are built on the secondary bus it gets.
fn bridge(
    a: PciAddress,
    ids: Ids,
    numa: u32,
    buses: &mut Buses,
    build: impl FnOnce(u8, &mut Buses) -> Option<Vec<Func>>,
) -> Option<Func> {
    let secondary = buses.take()?;
    let children = build(secondary, buses)?;
    Some(Func {
        addr: a,
        ids,
        numa,
        multifunction: false,
        link: Some(GEN4_X16),
        sriov_total: None,
        slot: None,
        joins_group_of_fn0: false,
        bridge: Some((a.bus, secondary, buses.last())),
        vgpu: None,
        physfn: None,
        virtfns: Vec::new(),
        children,
        bars: Vec::new(),
        reset: "",
    })
}

fn root_port(dev: u8, root_bus: u8) -> (PciAddress, Ids) {
    (
        addr(root_bus, dev, 0),
        ids(INTEL, 0x347a, INTEL, 0x0000, 0x04, 0x060400),
    )
}

/// Where the GPUs go and what they look like.
struct GpuPlan {
    model: GpuModel,
    audio: bool,
    vgpu: Option<FakeVgpu>,
    /// Slot number of the next GPU on this NUMA node (labels `CPU<node+1> SLOT<n>`).
    next_slot: u32,
}

/// Root port → switch upstream port → downstream ports → one GPU each.
fn gpu_switch(
    port_dev: u8,
    root_bus: u8,
    numa: u32,
    gpus: u32,
    plan: &mut GpuPlan,
    buses: &mut Buses,
) -> Option<Func> {
    let (rp, rp_ids) = root_port(port_dev, root_bus);
    let plx = ids(PLX, 0x8747, PLX, 0x8747, 0xca, 0x060400);
    let (gdev, gsub, grev) = plan.model.ids();
    let gpu_ids = ids(NVIDIA, gdev, NVIDIA, gsub, grev, 0x030200);
    // An AD102-class HDMI audio function: what sits at `.1` on NVIDIA display cards.
    let audio_ids = ids(NVIDIA, 0x22ba, NVIDIA, gsub, grev, 0x040300);
    let link = if plan.model == GpuModel::H100 {
        GEN5_X16
    } else {
        GEN4_X16
    };
    bridge(rp, rp_ids, numa, buses, |up_bus, buses| {
        let mut up = bridge(addr(up_bus, 0, 0), plx, numa, buses, |down_bus, buses| {
            let mut downs = Vec::new();
            for i in 0..gpus {
                let slot = format!("CPU{} SLOT{}", numa + 1, plan.next_slot);
                plan.next_slot += 1;
                let audio = plan.audio;
                let vgpu = plan.vgpu;
                let d = bridge(
                    addr(down_bus, (i * 8) as u8, 0),
                    plx,
                    numa,
                    buses,
                    |gpu_bus, _| {
                        let mut gpu = endpoint(addr(gpu_bus, 0, 0), gpu_ids, numa);
                        gpu.link = Some(link);
                        gpu.slot = Some(slot.clone());
                        gpu.vgpu = vgpu;
                        let mut vfs = Vec::new();
                        if vgpu == Some(FakeVgpu::Vfio) {
                            // VFs sit on the GPU's bus from function 4 on (first VF
                            // offset 4, stride 1), as on NVIDIA's SR-IOV boards.
                            for i in 0..FAKE_VFS {
                                let devfn = 4 + i;
                                let a = addr(gpu_bus, (devfn / 8) as u8, (devfn % 8) as u8);
                                let mut vf = endpoint(a, gpu_ids, numa);
                                vf.physfn = Some(gpu.addr);
                                vf.vgpu = vgpu;
                                gpu.virtfns.push(a);
                                vfs.push(vf);
                            }
                            gpu.sriov_total = Some(FAKE_VFS);
                        }
                        if !audio {
                            let mut all = vec![gpu];
                            all.append(&mut vfs);
                            return Some(all);
                        }
                        gpu.multifunction = true;
                        let mut snd = endpoint(addr(gpu_bus, 0, 1), audio_ids, numa);
                        snd.link = Some(link);
                        snd.slot = Some(slot);
                        snd.multifunction = true;
                        snd.joins_group_of_fn0 = true;
                        let mut all = vec![gpu, snd];
                        all.append(&mut vfs);
                        Some(all)
                    },
                )?;
                downs.push(d);
            }
            Some(downs)
        })?;
        // A PEX 8747's upstream port has its own registers; its downstream ports none.
        up.bars = vec![shape(0, BarKind::Memory, 256 << 10, false, false)];
        Some(vec![up])
    })
}

fn build(spec: &FakeSpec, opts: &FakeOptions) -> Result<Vec<(u8, Vec<Func>)>, FakeError> {
    let k = spec.numa_nodes;
    if !(1..=8).contains(&k) {
        return Err(FakeError::NumaNodes(k));
    }
    if opts.mig && opts.vgpu.is_none() {
        return Err(FakeError::MigWithoutVgpu);
    }
    for name in &opts.bridges {
        let reason = match passage_model::networks::check_bridge(name) {
            Err(e) => e.message,
            Ok(()) if name == "lo" => "the loopback interface is not a bridge".to_string(),
            Ok(()) => continue,
        };
        return Err(FakeError::Bridge {
            name: name.clone(),
            reason,
        });
    }
    if let Some(v) = opts.vgpu
        && fake_vgpu::table(spec.model).map(|(f, _)| f) != Some(v)
    {
        return Err(match v {
            FakeVgpu::Mdev => FakeError::VgpuModel {
                vgpu: "mdev",
                needs: "a100",
            },
            FakeVgpu::Vfio => FakeError::VgpuModel {
                vgpu: "vfio",
                needs: "h100",
            },
        });
    }
    let too_many = || FakeError::TooManyGpus {
        gpus: spec.gpus,
        numa_nodes: k,
    };
    let span = 256 / k as u16;
    let mut roots = Vec::new();
    for node in 0..k {
        let root_bus = (node as u16 * span) as u8;
        let mut buses = Buses {
            next: root_bus as u16 + 1,
            limit: root_bus as u16 + span - 1,
        };
        let mut funcs = vec![endpoint(
            addr(root_bus, 0, 0),
            ids(INTEL, 0x09a2, INTEL, 0x0000, 0x04, 0x060000),
            node,
        )];
        let mut port_dev = 1u8;
        let mut plan = GpuPlan {
            model: spec.model,
            audio: opts.gpu_audio,
            vgpu: opts.vgpu,
            next_slot: 1,
        };
        if node == 0 {
            let (rp, rp_ids) = root_port(port_dev, root_bus);
            port_dev += 1;
            let nic = ids(INTEL, 0x1521, 0x15d9, 0x1521, 0x01, 0x020000);
            funcs.push(
                bridge(rp, rp_ids, node, &mut buses, |b, _| {
                    let mut f0 = endpoint(addr(b, 0, 0), nic, node);
                    f0.multifunction = true;
                    let mut f1 = endpoint(addr(b, 0, 1), nic, node);
                    f1.multifunction = true;
                    // The i350 makes up to 7 virtual functions per port.
                    for f in [&mut f0, &mut f1] {
                        f.link = Some(GEN2_X4);
                        f.sriov_total = Some(7);
                    }
                    Some(vec![f0, f1])
                })
                .ok_or_else(too_many)?,
            );
            let (rp, rp_ids) = root_port(port_dev, root_bus);
            port_dev += 1;
            let nvme = ids(0x144d, 0xa80a, 0x144d, 0xa801, 0x00, 0x010802);
            funcs.push(
                bridge(rp, rp_ids, node, &mut buses, |b, _| {
                    let mut ssd = endpoint(addr(b, 0, 0), nvme, node);
                    ssd.link = Some(GEN3_X4);
                    Some(vec![ssd])
                })
                .ok_or_else(too_many)?,
            );
            let mut isa = endpoint(
                addr(root_bus, 0x1f, 0),
                ids(INTEL, 0xa1cb, 0x15d9, 0x1c48, 0x09, 0x060100),
                node,
            );
            isa.multifunction = true;
            funcs.push(isa);
            let mut smbus = endpoint(
                addr(root_bus, 0x1f, 4),
                ids(INTEL, 0xa1a3, 0x15d9, 0x1c48, 0x09, 0x0c0500),
                node,
            );
            smbus.multifunction = true;
            funcs.push(smbus);
        }
        // GPUs go round-robin over the nodes, two behind each switch as in HGX boards.
        let on_node = (0..spec.gpus).filter(|g| g % k == node).count() as u32;
        let mut left = on_node;
        while left > 0 {
            let here = left.min(2);
            if port_dev >= 0x1f {
                return Err(too_many());
            }
            funcs.push(
                gpu_switch(port_dev, root_bus, node, here, &mut plan, &mut buses)
                    .ok_or_else(too_many)?,
            );
            port_dev += 1;
            left -= here;
        }
        funcs.sort_by_key(|f| f.addr);
        each_mut(&mut funcs, &mut give_bars);
        roots.push((root_bus, funcs));
    }
    assign_bars(&mut roots).ok_or_else(too_many)?;
    Ok(roots)
}

/// A region of `size` bytes, its address not yet chosen.
fn shape(index: u8, kind: BarKind, size: u64, is_64bit: bool, prefetchable: bool) -> PciBar {
    PciBar {
        index,
        kind,
        start: 0,
        size,
        is_64bit,
        prefetchable,
    }
}

fn each_mut(funcs: &mut [Func], g: &mut impl FnMut(&mut Func)) {
    for f in funcs {
        g(f);
        each_mut(&mut f.children, g);
    }
}

/// The regions and reset methods of the parts the generator knows, as their datasheets
/// and `lspci -vv` on real machines show them. A VF's BARs live in its physical
/// function's SR-IOV capability; the generated VFs show none.
fn give_bars(f: &mut Func) {
    use BarKind::{Io, Memory};
    let mem32 = |i, size| shape(i, Memory, size, false, false);
    let mem64 = |i, size, pref| shape(i, Memory, size, true, pref);
    if f.physfn.is_some() {
        f.reset = "flr";
        return;
    }
    let gpu = [
        GpuModel::V100,
        GpuModel::A100,
        GpuModel::H100,
        GpuModel::L40s,
    ]
    .into_iter()
    .find(|m| m.ids().0 == f.ids.device);
    let (bars, reset) = match (f.ids.vendor, f.ids.class >> 8, gpu) {
        (NVIDIA, 0x0302, Some(model)) => {
            let framebuffer: u64 = match model {
                GpuModel::V100 => 32 << 30,
                GpuModel::A100 | GpuModel::H100 => 128 << 30,
                GpuModel::L40s => 64 << 30,
            };
            let reset = if model == GpuModel::V100 {
                "bus"
            } else {
                "flr bus"
            };
            (
                vec![
                    mem32(0, 16 << 20),
                    mem64(1, framebuffer, true),
                    mem64(3, 32 << 20, true),
                ],
                reset,
            )
        }
        // The HDMI audio function of a display card.
        (NVIDIA, 0x0403, _) => (vec![mem32(0, 16 << 10)], "flr"),
        // i350: registers, an I/O window, MSI-X tables.
        (INTEL, 0x0200, _) => (
            vec![
                mem32(0, 1 << 20),
                shape(2, Io, 32, false, false),
                mem32(3, 16 << 10),
            ],
            "flr bus",
        ),
        // An NVMe SSD: 64-bit registers, not prefetchable (so below 4 GiB).
        (_, 0x0108, _) => (vec![mem64(0, 32 << 10, false)], "flr bus"),
        // The chipset's SMBus controller.
        (INTEL, 0x0c05, _) => (
            vec![mem64(0, 256, false), shape(4, Io, 32, false, false)],
            "",
        ),
        _ => (Vec::new(), ""),
    };
    if f.bars.is_empty() {
        f.bars = bars;
    }
    f.reset = reset;
}

/// Where the generated regions go: non-prefetchable memory below 4 GiB (under the
/// firmware's area at 0xfc000000), I/O ports from 0x2000, and 64-bit prefetchable memory
/// high, each NUMA root its own window starting on a TiB boundary from 32 TiB, all below
/// the 46 address bits the generated CPUs have.
const LOW_MMIO: (u64, u64) = (0x9000_0000, 0xfc00_0000);
const IO_PORTS: (u64, u64) = (0x2000, 0x1_0000);
const HIGH_MMIO: (u64, u64) = (0x2000_0000_0000, 1 << 46);

/// Gives every region an address, as firmware does: per NUMA root, the largest first,
/// each aligned to its size. `None` when the windows are full.
fn assign_bars(roots: &mut [(u8, Vec<Func>)]) -> Option<()> {
    let (mut low, mut io, mut high) = (LOW_MMIO.0, IO_PORTS.0, HIGH_MMIO.0);
    for (_, funcs) in roots.iter_mut() {
        let mut wanted: Vec<(u64, PciAddress, u8)> = Vec::new();
        each_mut(funcs, &mut |f| {
            wanted.extend(f.bars.iter().map(|b| (b.size, f.addr, b.index)));
        });
        wanted.sort_by_key(|&(size, a, i)| (std::cmp::Reverse(size), a, i));
        let mut kinds = std::collections::HashMap::new();
        each_mut(funcs, &mut |f| {
            for b in &f.bars {
                kinds.insert((f.addr, b.index), (b.kind, b.prefetchable && b.is_64bit));
            }
        });
        let mut at = std::collections::HashMap::new();
        for (size, a, i) in wanted {
            let (cursor, limit) = match kinds.get(&(a, i))? {
                (BarKind::Io, _) => (&mut io, IO_PORTS.1),
                (BarKind::Memory, true) => (&mut high, HIGH_MMIO.1),
                (BarKind::Memory, false) => (&mut low, LOW_MMIO.1),
            };
            let start = cursor.checked_next_multiple_of(size)?;
            let end = start.checked_add(size)?;
            if end > limit {
                return None;
            }
            *cursor = end;
            at.insert((a, i), start);
        }
        each_mut(funcs, &mut |f| {
            for b in &mut f.bars {
                b.start = at.get(&(f.addr, b.index)).copied().unwrap_or(0);
            }
        });
        high = high.checked_next_multiple_of(1 << 40)?;
    }
    Some(())
}

/// Linux's flags for a region (`IORESOURCE_*`, with the BAR's own low bits), as
/// `resource` shows them.
fn resource_flags(b: &PciBar) -> u64 {
    match b.kind {
        BarKind::Io => 0x40101,
        BarKind::Memory => {
            let mut f = 0x40200 | bar_low_bits(b);
            if b.is_64bit {
                f |= 0x10_0000;
            }
            if b.prefetchable {
                f |= 0x2000;
            }
            f
        }
    }
}

/// The type bits of a BAR register: I/O, or memory 64-bit (0x4) and prefetchable (0x8).
fn bar_low_bits(b: &PciBar) -> u64 {
    match b.kind {
        BarKind::Io => 0x1,
        BarKind::Memory => {
            (if b.is_64bit { 0x4 } else { 0 }) | (if b.prefetchable { 0x8 } else { 0 })
        }
    }
}

/// `resource`: the BARs and ROM, then six lines for SR-IOV's VF BARs, all zero where
/// unassigned.
fn resource_text(bars: &[PciBar]) -> String {
    (0..13u8)
        .map(|i| match bars.iter().find(|b| b.index == i) {
            Some(b) => format!(
                "0x{:016x} 0x{:016x} 0x{:016x}\n",
                b.start,
                b.start + b.size - 1,
                resource_flags(b)
            ),
            None => format!("0x{0:016x} 0x{0:016x} 0x{0:016x}\n", 0),
        })
        .collect()
}

/// Writes the tree for `spec` under `out`, which must be absent or empty.
pub fn generate(out: &Path, spec: &FakeSpec) -> Result<FakeTree, FakeError> {
    generate_with(out, spec, &FakeOptions::default())
}

/// [`generate`] with variations.
pub fn generate_with(
    out: &Path,
    spec: &FakeSpec,
    opts: &FakeOptions,
) -> Result<FakeTree, FakeError> {
    let roots = build(spec, opts)?;
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| FakeError::Io { path, source }
    };
    if out.exists() {
        let mut entries = fs::read_dir(out).map_err(io_err(out))?;
        if entries.next().is_some() {
            return Err(FakeError::NotEmpty(out.to_path_buf()));
        }
    }
    let mut w = Writer {
        root: out.to_path_buf(),
        flat: Vec::new(),
        mig: opts.mig,
    };
    w.skeleton().map_err(io_err(out))?;
    w.host(spec, opts).map_err(io_err(out))?;
    w.net(&opts.bridges).map_err(io_err(out))?;
    for (root_bus, funcs) in &roots {
        let rel = PathBuf::from(format!("devices/pci0000:{root_bus:02x}"));
        fs::create_dir_all(out.join(&rel)).map_err(io_err(&out.join(&rel)))?;
        for f in funcs {
            w.collect(&rel, f);
        }
    }
    w.flat.sort_by_key(|(_, f)| f.addr);
    let flat = std::mem::take(&mut w.flat);
    let mut tree = FakeTree {
        root: out.to_path_buf(),
        functions: Vec::new(),
        gpus: Vec::new(),
    };
    let mut next_group = 0u32;
    let mut fn0_groups = std::collections::HashMap::new();
    let mut vgpu_hosts: Vec<FakeGpu> = Vec::new();
    for (rel, f) in &flat {
        let key = (f.addr.domain, f.addr.bus, f.addr.device);
        let group = match fn0_groups.get(&key) {
            Some(g) if f.joins_group_of_fn0 => *g,
            _ => {
                next_group += 1;
                next_group - 1
            }
        };
        if f.addr.function == 0 {
            fn0_groups.insert(key, group);
        }
        w.function(rel, f, group).map_err(io_err(&out.join(rel)))?;
        if let Some(label) = &f.slot
            && f.addr.function == 0
        {
            w.slot(label, f.addr).map_err(io_err(out))?;
        }
        let id: Result<DevicePath, _> = format!("/{}", rel.display()).parse();
        if let Ok(id) = id {
            if f.ids.class >> 8 == 0x0302 && f.physfn.is_none() {
                tree.gpus.push(id.clone());
            }
            tree.functions.push(id);
        }
        if f.vgpu.is_some() && f.physfn.is_none() {
            let parent = rel.parent().unwrap_or(Path::new(""));
            vgpu_hosts.push(FakeGpu {
                rel: rel.clone(),
                bdf: f.addr.to_string(),
                vfs: f
                    .virtfns
                    .iter()
                    .map(|v| parent.join(v.to_string()))
                    .collect(),
            });
        }
    }
    if let Some((framework, types)) = opts.vgpu.and_then(|_| fake_vgpu::table(spec.model)) {
        fake_vgpu::write_mig_support(out, framework, types, &vgpu_hosts, opts.mig)
            .map_err(io_err(out))?;
        fs::create_dir_all(out.join("bus/mdev/devices")).map_err(io_err(out))?;
    }
    super::gpu_zero::write_gpu_zero(out).map_err(io_err(out))?;
    fs::write(
        out.join(FAKE_MARKER),
        "generated by node-agent fake-sysfs\n",
    )
    .map_err(io_err(&out.join(FAKE_MARKER)))?;
    Ok(tree)
}

/// Writes the directory of a VF the fake kernel makes when its physical function's
/// `sriov_numvfs` is written: at `rel` (beside the PF), in IOMMU group `group` of its
/// own, bound to the VF driver of its ids if the world has one.
pub(crate) fn write_vf(
    root: &Path,
    rel: &Path,
    vf: PciAddress,
    pf: PciAddress,
    ids: Ids,
    numa: u32,
    group: u32,
) -> io::Result<()> {
    let mut f = endpoint(vf, ids, numa);
    f.physfn = Some(pf);
    give_bars(&mut f);
    let w = Writer {
        root: root.to_path_buf(),
        flat: Vec::new(),
        mig: false,
    };
    w.function(rel, &f, group)
}

impl Ids {
    /// The ids of a function as its directory's attributes give them.
    pub(crate) fn read(dir: &Path) -> io::Result<Ids> {
        let num = |name: &str| -> io::Result<u32> {
            let text = crate::host::read_attr(&dir.join(name))?;
            u32::from_str_radix(text.trim().trim_start_matches("0x"), 16).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}/{name}: {text:?}", dir.display()),
                )
            })
        };
        let narrow = |v: u32| u16::try_from(v).unwrap_or(u16::MAX);
        Ok(Ids {
            vendor: narrow(num("vendor")?),
            device: narrow(num("device")?),
            subvendor: narrow(num("subsystem_vendor")?),
            subsystem: narrow(num("subsystem_device")?),
            revision: u8::try_from(num("revision")?).unwrap_or(u8::MAX),
            class: num("class")?,
        })
    }

    /// The ids its VFs have: the VF device id of the few devices the fake world knows
    /// (an i350's VFs are 8086:1520), else the function's own.
    pub(crate) fn of_vf(self) -> Ids {
        let device = match (self.vendor, self.device) {
            (INTEL, 0x1521) => 0x1520,
            _ => self.device,
        };
        Ids { device, ..self }
    }
}

struct Writer {
    root: PathBuf,
    flat: Vec<(PathBuf, Func)>,
    /// vGPU hosts start in MIG mode.
    mig: bool,
}

const DRIVERS: &[&str] = &[
    "nvidia",
    "snd_hda_intel",
    "pcieport",
    "igb",
    "igbvf",
    "nvme",
    "i801_smbus",
    "vfio-pci",
];

fn symlink(target: &str, link: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(target, link)
    }
    #[cfg(not(unix))]
    {
        let _ = (target, link);
        Err(io::Error::other("symlinks need unix"))
    }
}

impl Writer {
    fn skeleton(&self) -> io::Result<()> {
        let pci = self.root.join("bus/pci");
        fs::create_dir_all(pci.join("devices"))?;
        fs::create_dir_all(pci.join("slots"))?;
        fs::create_dir_all(self.root.join("kernel/iommu_groups"))?;
        fs::write(pci.join("drivers_probe"), "")?;
        fs::write(pci.join("drivers_autoprobe"), "1\n")?;
        fs::write(pci.join("rescan"), "")?;
        for d in DRIVERS {
            let dir = pci.join("drivers").join(d);
            fs::create_dir_all(&dir)?;
            for f in ["bind", "unbind", "new_id", "remove_id", "uevent"] {
                fs::write(dir.join(f), "")?;
            }
        }
        Ok(())
    }

    /// The CPUs online and each NUMA node's memory, as `devices/system` shows them.
    fn host(&self, spec: &FakeSpec, opts: &FakeOptions) -> io::Result<()> {
        let nodes = spec.numa_nodes.max(1);
        let cpus = opts.cpus.unwrap_or(FAKE_CPUS_PER_NODE * nodes).max(1);
        let cpu = self.root.join("devices/system/cpu");
        fs::create_dir_all(&cpu)?;
        fs::write(cpu.join("online"), format!("0-{}\n", cpus - 1))?;
        let total = opts
            .memory_mib
            .unwrap_or(FAKE_MIB_PER_NODE * u64::from(nodes));
        let (two_mib, one_gib) = opts.hugepages_per_node;
        for n in 0..nodes {
            let dir = self.root.join(format!("devices/system/node/node{n}"));
            fs::create_dir_all(&dir)?;
            let kib = total / u64::from(nodes) * 1024;
            fs::write(
                dir.join("meminfo"),
                format!("Node {n} MemTotal:       {kib} kB\nNode {n} MemFree:        {kib} kB\n"),
            )?;
            // The online CPUs split evenly, in order; a node left without any (fewer CPUs
            // than nodes) has an empty list, as a memory-only node has.
            let (lo, hi) = (n * cpus / nodes, (n + 1) * cpus / nodes);
            let list = match hi - lo {
                0 => String::new(),
                1 => lo.to_string(),
                _ => format!("{lo}-{}", hi - 1),
            };
            fs::write(dir.join("cpulist"), format!("{list}\n"))?;
            for (size_kib, count) in [(2048u64, two_mib), (1 << 20, one_gib)] {
                let pool = dir.join(format!("hugepages/hugepages-{size_kib}kB"));
                fs::create_dir_all(&pool)?;
                fs::write(pool.join("nr_hugepages"), format!("{count}\n"))?;
                fs::write(pool.join("free_hugepages"), format!("{count}\n"))?;
                fs::write(pool.join("surplus_hugepages"), "0\n")?;
            }
        }
        let proc = self.root.join(FAKE_PROC_DIR);
        fs::create_dir_all(&proc)?;
        // The first CPU's entry only: the agent reads the address sizes, which every CPU
        // shares, and a simulated fleet writes thousands of these files.
        fs::write(
            proc.join("cpuinfo"),
            format!(
                "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) \
                 Platinum 8480+\naddress sizes\t: {FAKE_CPUINFO_ADDRESS_SIZES}\n\n"
            ),
        )?;
        Ok(())
    }

    /// `lo` and the bridges, each in `devices/virtual/net/` with a `class/net/` link to
    /// it, as a kernel shows them.
    fn net(&self, bridges: &[String]) -> io::Result<()> {
        let class = self.root.join("class/net");
        fs::create_dir_all(&class)?;
        let mut names = vec![("lo", false)];
        names.extend(bridges.iter().map(|b| (b.as_str(), true)));
        names.sort();
        names.dedup_by_key(|n| n.0);
        for (name, bridge) in names {
            let dir = self.root.join("devices/virtual/net").join(name);
            fs::create_dir_all(&dir)?;
            fs::write(dir.join("mtu"), if bridge { "1500\n" } else { "65536\n" })?;
            if bridge {
                let b = dir.join("bridge");
                fs::create_dir_all(&b)?;
                fs::write(b.join("vlan_filtering"), "0\n")?;
                fs::write(b.join("default_pvid"), "1\n")?;
            }
            std::os::unix::fs::symlink(
                format!("../../devices/virtual/net/{name}"),
                class.join(name),
            )?;
        }
        Ok(())
    }

    /// An NVMe controller's sysfs entries for its one namespace (`nvme/nvme0/nvme0n1`,
    /// with `size` in 512-byte sectors and `dev`), and the namespace's stand-in device
    /// node under [`FAKE_DEV_DIR`]. The generated world has one NVMe controller.
    fn nvme(&self, dir: &Path) -> io::Result<()> {
        let ns = dir.join("nvme/nvme0/nvme0n1");
        fs::create_dir_all(&ns)?;
        fs::write(ns.join("size"), format!("{}\n", FAKE_NVME_BYTES / 512))?;
        fs::write(ns.join("dev"), "259:0\n")?;
        fs::write(dir.join("nvme/nvme0/model"), "SAMSUNG MZQL23T8HCLS-00A07\n")?;
        let dev = self.root.join(FAKE_DEV_DIR);
        fs::create_dir_all(&dev)?;
        fs::File::create(dev.join("nvme0n1"))?.set_len(FAKE_NVME_BYTES)
    }

    /// A vGPU host's files: mdev types on an mdev GPU, `nvidia/` on a vendor-VFIO VF;
    /// every GPU starts idle, in the MIG mode of the options.
    fn vgpu_files(&self, dir: &Path, f: &Func, v: FakeVgpu) -> io::Result<()> {
        let Some(types) = fake_vgpu::table_for_device(f.ids.device) else {
            return Ok(());
        };
        let mig = self.mig;
        match v {
            FakeVgpu::Mdev => {
                for t in types {
                    let td = dir.join("mdev_supported_types").join(t.id);
                    fs::create_dir_all(td.join("devices"))?;
                    fs::write(td.join("name"), format!("{}\n", t.name))?;
                    fs::write(td.join("description"), fake_vgpu::description(t))?;
                    fs::write(td.join("device_api"), "vfio-pci\n")?;
                    fs::write(
                        td.join("available_instances"),
                        format!("{}\n", fake_vgpu::fits(types, mig, &[], t)),
                    )?;
                    fs::write(td.join("create"), "")?;
                }
            }
            FakeVgpu::Vfio if f.physfn.is_some() => {
                let nv = dir.join("nvidia");
                fs::create_dir_all(&nv)?;
                fs::write(
                    nv.join("creatable_vgpu_types"),
                    fake_vgpu::creatable_text(types, mig, &[]),
                )?;
                fs::write(nv.join("current_vgpu_type"), "0\n")?;
            }
            FakeVgpu::Vfio => {}
        }
        Ok(())
    }

    /// `bus/pci/slots/<label>/address`: the slot's `domain:bus:device`.
    fn slot(&self, label: &str, a: PciAddress) -> io::Result<()> {
        let dir = self.root.join("bus/pci/slots").join(label);
        fs::create_dir_all(&dir)?;
        fs::write(
            dir.join("address"),
            format!("{:04x}:{:02x}:{:02x}\n", a.domain, a.bus, a.device),
        )?;
        fs::write(dir.join("power"), "1\n")
    }

    fn collect(&mut self, parent: &Path, f: &Func) {
        let rel = parent.join(f.addr.to_string());
        for c in &f.children {
            self.collect(&rel, c);
        }
        self.flat.push((rel, f.clone()));
    }

    fn function(&self, rel: &Path, f: &Func, group: u32) -> io::Result<()> {
        let dir = self.root.join(rel);
        fs::create_dir_all(&dir)?;
        let i = f.ids;
        let bdf = f.addr.to_string();
        let files: [(&str, String); 14] = [
            ("vendor", format!("0x{:04x}\n", i.vendor)),
            ("device", format!("0x{:04x}\n", i.device)),
            ("subsystem_vendor", format!("0x{:04x}\n", i.subvendor)),
            ("subsystem_device", format!("0x{:04x}\n", i.subsystem)),
            ("revision", format!("0x{:02x}\n", i.revision)),
            ("class", format!("0x{:06x}\n", i.class)),
            ("numa_node", format!("{}\n", f.numa)),
            ("driver_override", "(null)\n".to_string()),
            ("reset", String::new()),
            ("enable", "1\n".to_string()),
            (
                "irq",
                if f.bridge.is_some() {
                    "0\n".into()
                } else {
                    format!("{}\n", 32 + group)
                },
            ),
            ("resource", resource_text(&f.bars)),
            ("local_cpulist", "0-15\n".to_string()),
            (
                "modalias",
                format!(
                    "pci:v{:08X}d{:08X}sv{:08X}sd{:08X}bc{:02X}sc{:02X}i{:02X}\n",
                    i.vendor,
                    i.device,
                    i.subvendor,
                    i.subsystem,
                    i.class >> 16,
                    (i.class >> 8) & 0xff,
                    i.class & 0xff
                ),
            ),
        ];
        for (name, text) in files {
            fs::write(dir.join(name), text)?;
        }
        fs::write(dir.join("config"), config_space(f))?;
        if !f.reset.is_empty() {
            fs::write(dir.join("reset_method"), format!("{}\n", f.reset))?;
        }
        if let Some(link) = f.link {
            for (name, text) in [
                ("current_link_speed", link.speed.to_string()),
                ("max_link_speed", link.speed.to_string()),
                ("current_link_width", link.width.to_string()),
                ("max_link_width", link.width.to_string()),
            ] {
                fs::write(dir.join(name), format!("{text}\n"))?;
            }
            fs::write(dir.join("aer_dev_fatal"), aer_text(AER_FATAL, "FATAL"))?;
            fs::write(
                dir.join("aer_dev_nonfatal"),
                aer_text(AER_NONFATAL, "NONFATAL"),
            )?;
            fs::write(
                dir.join("aer_dev_correctable"),
                aer_text(AER_CORRECTABLE, "COR"),
            )?;
        }
        if i.class == 0x010802 {
            self.nvme(&dir)?;
        }
        if let Some(total) = f.sriov_total {
            fs::write(dir.join("sriov_totalvfs"), format!("{total}\n"))?;
            fs::write(dir.join("sriov_numvfs"), format!("{}\n", f.virtfns.len()))?;
        }
        for (n, vf) in f.virtfns.iter().enumerate() {
            symlink(&format!("../{vf}"), &dir.join(format!("virtfn{n}")))?;
        }
        if let Some(pf) = f.physfn {
            symlink(&format!("../{pf}"), &dir.join("physfn"))?;
        }
        if let Some(v) = f.vgpu {
            self.vgpu_files(&dir, f, v)?;
        }
        let up = "../".repeat(rel.components().count());
        symlink(&format!("{up}bus/pci"), &dir.join("subsystem"))?;
        let group_dir = self.root.join(format!("kernel/iommu_groups/{group}"));
        fs::create_dir_all(group_dir.join("devices"))?;
        fs::write(group_dir.join("type"), "DMA\n")?;
        symlink(
            &format!("{up}kernel/iommu_groups/{group}"),
            &dir.join("iommu_group"),
        )?;
        symlink(
            &format!("../../../../{}", rel.display()),
            &group_dir.join("devices").join(&bdf),
        )?;
        symlink(
            &format!("../../../{}", rel.display()),
            &self.root.join("bus/pci/devices").join(&bdf),
        )?;
        if let Some(d) = native_driver(i.vendor, i.device, i.class) {
            symlink(&format!("{up}bus/pci/drivers/{d}"), &dir.join("driver"))?;
            symlink(
                &format!("../../../../{}", rel.display()),
                &self.root.join("bus/pci/drivers").join(d).join(&bdf),
            )?;
        }
        Ok(())
    }
}

/// The error names Linux's `aer_dev_*` attributes list, each with its count.
const AER_FATAL: &[&str] = &[
    "Undefined",
    "DLP",
    "SDES",
    "TLP",
    "FCP",
    "CmpltTO",
    "CmpltAbrt",
    "UnxCmplt",
    "RxOF",
    "MalfTLP",
    "ECRC",
    "UnsupReq",
    "ACSViol",
    "UncorrIntErr",
    "BlockedTLP",
    "AtomicOpBlocked",
    "TLPBlockedErr",
    "PoisonTLPBlocked",
];
const AER_NONFATAL: &[&str] = AER_FATAL;
const AER_CORRECTABLE: &[&str] = &[
    "RxErr",
    "BadTLP",
    "BadDLLP",
    "Rollover",
    "Timeout",
    "NonFatalErr",
    "CorrIntErr",
    "HeaderOF",
];

/// An AER counter file of a healthy function: every count 0, then the total line.
fn aer_text(names: &[&str], total: &str) -> String {
    let mut s: String = names.iter().map(|n| format!("{n} 0\n")).collect();
    s.push_str(&format!("TOTAL_ERR_{total} 0\n"));
    s
}

/// The first 256 bytes of configuration space: the standard header, no capabilities.
fn config_space(f: &Func) -> Vec<u8> {
    let mut c = vec![0u8; 256];
    let i = f.ids;
    c[0x00..0x02].copy_from_slice(&i.vendor.to_le_bytes());
    c[0x02..0x04].copy_from_slice(&i.device.to_le_bytes());
    // Memory space and bus master enabled, as firmware leaves an enumerated function;
    // I/O space too where it has I/O ports.
    let io = f.bars.iter().any(|b| b.kind == BarKind::Io);
    c[0x04..0x06].copy_from_slice(&(0x0006u16 | u16::from(io)).to_le_bytes());
    c[0x08] = i.revision;
    c[0x09] = (i.class & 0xff) as u8;
    c[0x0a] = ((i.class >> 8) & 0xff) as u8;
    c[0x0b] = (i.class >> 16) as u8;
    let multi = if f.multifunction && f.addr.function == 0 {
        0x80
    } else {
        0
    };
    match f.bridge {
        Some((primary, secondary, subordinate)) => {
            c[0x0e] = 0x01 | multi;
            c[0x18] = primary;
            c[0x19] = secondary;
            c[0x1a] = subordinate;
        }
        None => {
            c[0x0e] = multi;
            c[0x2c..0x2e].copy_from_slice(&i.subvendor.to_le_bytes());
            c[0x2e..0x30].copy_from_slice(&i.subsystem.to_le_bytes());
            if i.class >> 16 != 0x06 {
                c[0x3d] = 1;
            }
        }
    }
    // Type-1 headers have two BARs, type-0 six; the ROM is not generated.
    let bars = if f.bridge.is_some() { 2 } else { 6 };
    for b in f.bars.iter().filter(|b| b.index < bars) {
        let at = 0x10 + 4 * usize::from(b.index);
        let low = (b.start & 0xffff_fff0) | bar_low_bits(b);
        c[at..at + 4].copy_from_slice(&(low as u32).to_le_bytes());
        if b.is_64bit && b.index + 1 < bars {
            c[at + 4..at + 8].copy_from_slice(&((b.start >> 32) as u32).to_le_bytes());
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_numbers_nest() {
        let roots = build(&FakeSpec::default(), &FakeOptions::default()).unwrap();
        fn check(f: &Func) {
            if let Some((_, sec, sub)) = f.bridge {
                assert!(sec <= sub);
                for c in &f.children {
                    assert_eq!(c.addr.bus, sec);
                    if let Some((p, s2, sub2)) = c.bridge {
                        assert_eq!(p, sec);
                        assert!(s2 > sec && sub2 <= sub);
                    }
                    check(c);
                }
            }
        }
        assert_eq!(roots.len(), 2);
        assert_eq!(roots[1].0, 0x80);
        for (_, funcs) in &roots {
            funcs.iter().for_each(check);
        }
    }

    #[test]
    fn bridges_as_a_kernel_shows_them() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("a");
        generate(&root, &FakeSpec::default()).unwrap();
        let found = crate::net::bridges(&root).unwrap();
        assert_eq!(found.names, [FAKE_BRIDGE]);
        assert!(found.notes.is_empty(), "{:?}", found.notes);
        // A link into devices/, as in /sys.
        assert!(root.join("class/net/br0").is_symlink());
        assert!(root.join("class/net/lo").exists());

        let none = dir.path().join("b");
        let opts = FakeOptions {
            bridges: Vec::new(),
            ..FakeOptions::default()
        };
        generate_with(&none, &FakeSpec::default(), &opts).unwrap();
        assert!(crate::net::bridges(&none).unwrap().names.is_empty());

        let two = dir.path().join("c");
        let opts = FakeOptions {
            bridges: vec!["vmbr1".into(), "br0".into(), "vmbr1".into()],
            ..FakeOptions::default()
        };
        generate_with(&two, &FakeSpec::default(), &opts).unwrap();
        assert_eq!(crate::net::bridges(&two).unwrap().names, ["br0", "vmbr1"]);

        for bad in ["", "a/b", "lo", "sixteen-bytes-xx"] {
            let opts = FakeOptions {
                bridges: vec![bad.into()],
                ..FakeOptions::default()
            };
            let out = dir.path().join("d");
            let e = generate_with(&out, &FakeSpec::default(), &opts).unwrap_err();
            assert!(matches!(e, FakeError::Bridge { .. }), "{bad}: {e}");
            assert!(!out.exists(), "nothing written for {bad:?}");
        }
    }

    #[test]
    fn refuses_impossible_specs() {
        let spec = FakeSpec {
            numa_nodes: 0,
            ..FakeSpec::default()
        };
        let opts = FakeOptions::default();
        assert!(matches!(build(&spec, &opts), Err(FakeError::NumaNodes(0))));
        let spec = FakeSpec {
            gpus: 10_000,
            numa_nodes: 8,
            ..FakeSpec::default()
        };
        assert!(matches!(
            build(&spec, &opts),
            Err(FakeError::TooManyGpus { .. })
        ));
    }
}
