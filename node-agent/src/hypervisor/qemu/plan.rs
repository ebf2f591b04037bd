//! What a launch reads from the host before QEMU's command line is written: each passed
//! function's regions, NUMA node and switch (from the tree devices come from), and from
//! the host QEMU runs on, its CPUs' address width and the huge pages it has free.

use super::QemuConfig;
use super::command::{Backing, CpuModel, LaunchPlan, StandIn};
use super::layout::{self, MAX_PHYS_BITS, PassedFunction};
use passage_model::protocol::VmSpec;
use std::path::Path;

/// Whether guest RAM comes from huge pages (node config `hugepages`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HugepagePolicy {
    /// Only from huge pages: a VM that cannot have them does not start.
    Require,
    /// From huge pages when enough are free (1 GiB ones first), else ordinary pages.
    #[default]
    Prefer,
    /// Never.
    Off,
}

/// Huge page sizes in KiB, the preferred first.
const PAGE_SIZES_KIB: [u64; 2] = [1024 * 1024, 2048];

/// Reads the host and decides the VM's layout, firmware, CPU model and RAM backing.
pub fn launch_plan(cfg: &QemuConfig, spec: &VmSpec) -> Result<LaunchPlan, String> {
    let stand_in = cfg.stand_in();
    let mut functions = Vec::with_capacity(spec.devices.len());
    for d in &spec.devices {
        let mut f = match &cfg.sysfs_root {
            Some(root) => passed_function(root, d)?,
            None => PassedFunction {
                path: d.clone(),
                vendor: 0,
                class: 0,
                numa_node: None,
                switch: None,
                bars: Vec::new(),
            },
        };
        // An `edu` stand-in has one small 32-bit BAR: sizing a window for the real
        // function's would only make the guest's firmware slower.
        if stand_in == StandIn::Edu {
            f.bars.clear();
        }
        functions.push(f);
    }
    let bootrom = super::checks::bootrom_of(spec);
    // A generated tree's NUMA nodes are not this host's: only real devices bind.
    let bind_numa = stand_in == StandIn::None
        && functions
            .iter()
            .filter_map(|f| f.numa_node)
            .all(|n| node_dir(&cfg.host_sysfs, n).is_dir());

    let (layout, backing) = choose_backing(cfg, spec, &functions, bind_numa)?;
    let cpu = if cfg.accel.starts_with("kvm") {
        if let Some(host_bits) = host_address_bits(&cfg.host_sysfs) {
            layout::check_width(&layout, spec.memory_mib, host_bits).map_err(|e| e.to_string())?;
        }
        CpuModel::Host
    } else {
        if layout.phys_bits_needed > MAX_PHYS_BITS {
            return Err(layout::LayoutError::AddressWidth {
                memory_mib: spec.memory_mib,
                window_gib: layout.hole64 >> 30,
                needed: layout.phys_bits_needed,
                host: MAX_PHYS_BITS,
            }
            .to_string());
        }
        CpuModel::Max {
            phys_bits: layout.phys_bits_needed,
        }
    };
    Ok(LaunchPlan {
        functions,
        layout,
        bootrom,
        cpu,
        backing,
        bind_numa,
    })
}

/// What the tree at `root` says about the function at `d`; for a vGPU, its GPU's NUMA
/// node and switch, but not its BARs (a vGPU's are its own, and small).
fn passed_function(root: &Path, d: &passage_model::DevicePath) -> Result<PassedFunction, String> {
    let facts = crate::host::function_facts(root, d).map_err(|e| e.to_string())?;
    Ok(PassedFunction {
        path: d.clone(),
        vendor: facts.vendor,
        class: facts.class,
        numa_node: facts.numa_node,
        switch: facts.switch,
        bars: if d.vgpu().is_some() {
            Vec::new()
        } else {
            facts.bars
        },
    })
}

fn node_dir(host_sysfs: &Path, node: u32) -> std::path::PathBuf {
    host_sysfs.join(format!("devices/system/node/node{node}"))
}

/// The physical address width of the host behind `host_sysfs` (its `/proc/cpuinfo`, or a
/// generated tree's stand-in).
fn host_address_bits(host_sysfs: &Path) -> Option<u8> {
    let text = crate::host::read_cpuinfo(&crate::host::cpuinfo_path(host_sysfs)).ok()?;
    crate::host::address_bits(&text)
}

/// Free huge pages of `page_kib` on host node `node`, or on the whole host.
fn free_pages(host_sysfs: &Path, node: Option<u32>, page_kib: u64) -> u64 {
    let pool = format!("hugepages/hugepages-{page_kib}kB/free_hugepages");
    let path = match node {
        Some(n) => node_dir(host_sysfs, n).join(pool),
        None => host_sysfs.join("kernel/mm").join(pool),
    };
    crate::host::read_attr(&path)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0)
}

/// The layout with the largest huge pages the policy allows and the host has free for
/// every guest node (each node's share from its own host node when bound), or ordinary
/// pages.
fn choose_backing(
    cfg: &QemuConfig,
    spec: &VmSpec,
    functions: &[PassedFunction],
    bind_numa: bool,
) -> Result<(layout::Layout, Backing), String> {
    let plain = || {
        layout::plan(spec.vcpus, spec.memory_mib, functions, 4)
            .map(|l| (l, Backing::Plain))
            .map_err(|e| e.to_string())
    };
    if cfg.hugepages == HugepagePolicy::Off {
        return plain();
    }
    let mut short = Vec::new();
    for page_kib in PAGE_SIZES_KIB {
        let Ok(l) = layout::plan(spec.vcpus, spec.memory_mib, functions, page_kib) else {
            continue;
        };
        // (host node to take from, MiB) per share of the RAM: each guest node's from its
        // host node when bound, else all of it from the host's pool.
        let shares: Vec<(Option<u32>, u64)> = if !bind_numa {
            vec![(None, spec.memory_mib)]
        } else if l.nodes.is_empty() {
            vec![(single_node(functions), spec.memory_mib)]
        } else {
            l.nodes
                .iter()
                .map(|n| (Some(n.host_node), n.memory_mib))
                .collect()
        };
        let mut enough = true;
        for (node, mib) in shares {
            let need = mib * 1024 / page_kib;
            let free = free_pages(&cfg.host_sysfs, node, page_kib);
            if free < need {
                enough = false;
                short.push(format!(
                    "{need} page{} of {} free{} ({free} are)",
                    if need == 1 { "" } else { "s" },
                    page_name(page_kib),
                    node.map(|n| format!(" on NUMA node {n}"))
                        .unwrap_or_default()
                ));
            }
        }
        if enough {
            return Ok((l, Backing::Hugepages { page_kib }));
        }
    }
    if cfg.hugepages == HugepagePolicy::Require {
        let why = if short.is_empty() {
            format!(
                "its {} MiB of RAM is not a whole number of huge pages",
                spec.memory_mib
            )
        } else {
            format!("it needs {}", short.join(", or "))
        };
        return Err(format!(
            "huge pages are required on this node (hugepages = \"require\") and {why}: reserve \
             more (/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages, or per NUMA node) \
             or set hugepages = \"prefer\""
        ));
    }
    plain()
}

/// The one host node all the functions report, if they report one.
fn single_node(functions: &[PassedFunction]) -> Option<u32> {
    let mut n = functions.iter().filter_map(|f| f.numa_node);
    let first = n.next()?;
    n.all(|x| x == first).then_some(first)
}

fn page_name(page_kib: u64) -> String {
    if page_kib >= 1024 * 1024 {
        format!("{} GiB", page_kib / (1024 * 1024))
    } else {
        format!("{} MiB", page_kib / 1024)
    }
}
