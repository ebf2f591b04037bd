//! Which host CPUs a VM's vCPUs run on. A GPU VM's vCPUs each get a host CPU of their
//! own, on the NUMA node of the VM's GPUs (its guest node's host node when it has
//! several), out of the node's CPUs less the host's reserve; QEMU's other threads (its
//! main loop, I/O) run on the reserve. What each VM holds is kept beside it
//! ([`PINNING_FILE`]), so an agent that restarts knows which CPUs its adopted VMs hold.

use super::layout::Layout;
use passage_model::protocol::parse_cpu_list;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// The CPUs a VM holds, in its directory.
pub const PINNING_FILE: &str = "pinning.json";

/// Whether vCPUs are pinned (node config `pin_vcpus`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PinPolicy {
    /// VMs given real devices through vfio (a GPU VM); not VMs of stand-ins or none.
    #[default]
    Devices,
    /// Every VM.
    Always,
    /// None.
    Never,
}

/// The host CPUs a VM's vCPUs run on, vCPU `i` on `vcpus[i]`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pinning {
    pub vcpus: Vec<u32>,
}

/// A compact kernel CPU list of `cpus`.
pub fn cpu_list(cpus: &[u32]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    parts.join(",")
}

/// This host's CPUs by NUMA node (`devices/system/node/node<N>/cpulist`); one node
/// holding every online CPU where the kernel shows no nodes.
pub fn host_cpus(host_sysfs: &Path) -> BTreeMap<u32, Vec<u32>> {
    let mut out = BTreeMap::new();
    if let Ok(entries) = std::fs::read_dir(host_sysfs.join("devices/system/node")) {
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(n) = name
                .to_str()
                .and_then(|n| n.strip_prefix("node"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some(cpus) = crate::host::read_attr(&e.path().join("cpulist"))
                .ok()
                .and_then(|t| parse_cpu_list(&t))
            {
                out.insert(n, cpus);
            }
        }
    }
    if out.is_empty()
        && let Some(cpus) = crate::host::read_attr(&host_sysfs.join("devices/system/cpu/online"))
            .ok()
            .and_then(|t| parse_cpu_list(&t))
    {
        out.insert(0, cpus);
    }
    out
}

/// Chooses a host CPU for each of `vcpus` vCPUs: guest node `k`'s vCPUs from its host
/// node, a VM of one guest node from `node` (the host node of its devices; any node when
/// none is known), never a CPU of `reserved` or of `held`.
pub fn choose(
    by_node: &BTreeMap<u32, Vec<u32>>,
    reserved: &BTreeSet<u32>,
    held: &BTreeSet<u32>,
    layout: &Layout,
    vcpus: u32,
    node: Option<u32>,
) -> Result<Pinning, String> {
    let free = |n: u32| -> Vec<u32> {
        by_node
            .get(&n)
            .map(|c| {
                c.iter()
                    .copied()
                    .filter(|c| !reserved.contains(c) && !held.contains(c))
                    .collect()
            })
            .unwrap_or_default()
    };
    // (host node or any, how many vCPUs) per share.
    let shares: Vec<(Option<u32>, u32)> = if layout.nodes.is_empty() {
        vec![(node, vcpus)]
    } else {
        layout
            .nodes
            .iter()
            .map(|n| (Some(n.host_node), n.vcpus.end - n.vcpus.start))
            .collect()
    };
    let mut out = Vec::with_capacity(vcpus as usize);
    for (n, count) in shares {
        let pool: Vec<u32> = match n {
            Some(n) if by_node.contains_key(&n) => free(n),
            // A node this host does not have (a generated tree's): any free CPU.
            _ => by_node.keys().flat_map(|&n| free(n)).collect(),
        };
        let pool: Vec<u32> = pool.into_iter().filter(|c| !out.contains(c)).collect();
        if (pool.len() as u64) < u64::from(count) {
            return Err(format!(
                "it needs {count} host CPUs of its own{} and {} are free (the host's reserve \
                 and other VMs' hold the rest)",
                n.map(|n| format!(" on NUMA node {n}")).unwrap_or_default(),
                pool.len()
            ));
        }
        out.extend(pool.into_iter().take(count as usize));
    }
    Ok(Pinning { vcpus: out })
}

/// Moves QEMU's threads (`pid`'s, all of them) to `reserved` when there is one, then
/// each vCPU thread (`vcpu_threads[i]`, from QMP `query-cpus-fast`) to its CPU, with
/// util-linux's `taskset`.
pub fn apply(
    pid: u32,
    vcpu_threads: &[u64],
    pinning: &Pinning,
    reserved: &BTreeSet<u32>,
) -> Result<(), String> {
    let taskset = |args: &[String]| -> Result<(), String> {
        let out = Command::new("taskset")
            .args(args)
            .output()
            .map_err(|e| format!("running taskset: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "taskset {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    };
    if !reserved.is_empty() {
        let list = cpu_list(&reserved.iter().copied().collect::<Vec<_>>());
        taskset(&["-a".into(), "-p".into(), "-c".into(), list, pid.to_string()])?;
    }
    if vcpu_threads.len() != pinning.vcpus.len() {
        return Err(format!(
            "QEMU runs {} vCPU threads and {} CPUs were chosen",
            vcpu_threads.len(),
            pinning.vcpus.len()
        ));
    }
    for (tid, cpu) in vcpu_threads.iter().zip(&pinning.vcpus) {
        taskset(&["-p".into(), "-c".into(), cpu.to_string(), tid.to_string()])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::layout::{GuestNode, Layout};
    use super::*;

    fn layout(nodes: Vec<GuestNode>) -> Layout {
        Layout {
            slots: Vec::new(),
            nodes,
            expander_buses: Vec::new(),
            hole64: 0,
            phys_bits_needed: 40,
        }
    }

    #[test]
    fn cpu_lists_round_trip() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(cpu_list(&[11, 0, 1, 2, 3, 8, 10]), "0-3,8,10-11");
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(parse_cpu_list("0-99999999"), None);
        assert_eq!(parse_cpu_list("0-3,2-5"), Some(vec![0, 1, 2, 3, 4, 5]));
    }

    #[test]
    fn vcpus_go_to_their_nodes_cpus_not_the_reserve_nor_another_vms() {
        let by_node = BTreeMap::from([(0, (0..8).collect()), (1, (8..16).collect())]);
        let reserved = BTreeSet::from([0, 8]);
        let held = BTreeSet::from([1, 2]);
        let one = choose(&by_node, &reserved, &held, &layout(Vec::new()), 3, Some(1)).unwrap();
        assert_eq!(one.vcpus, [9, 10, 11]);
        let two = layout(vec![
            GuestNode {
                host_node: 0,
                vcpus: 0..2,
                memory_mib: 1024,
            },
            GuestNode {
                host_node: 1,
                vcpus: 2..4,
                memory_mib: 1024,
            },
        ]);
        let p = choose(&by_node, &reserved, &held, &two, 4, None).unwrap();
        assert_eq!(p.vcpus, [3, 4, 9, 10]);
        let err = choose(&by_node, &reserved, &held, &layout(Vec::new()), 6, Some(0)).unwrap_err();
        assert!(
            err.contains("needs 6 host CPUs of its own on NUMA node 0 and 5 are free"),
            "{err}"
        );
    }
}
