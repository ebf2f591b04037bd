//! The node's CPUs and memory for VMs, read from sysfs like everything else the agent
//! reports (so a fake tree carries them too): `devices/system/cpu/online` and the
//! `MemTotal` of every `devices/system/node/node<N>/meminfo`; and what a launch and
//! NUMA-aware placement need besides: each node's `cpulist` and huge page pools, and the
//! CPUs' physical address width from `/proc/cpuinfo` (from the generator's stand-in in a
//! generated tree).

use super::read_attr;
use passage_model::protocol::{
    HostResources, HugepagePool, MAX_HOST_MEMORY_MIB, MAX_HUGEPAGE_POOLS, MAX_NUMA_NODES, NumaNode,
};
use std::fs;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ResourcesError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {why}")]
    Parse { path: PathBuf, why: String },
    #[error("no NUMA node under {0} reports MemTotal")]
    NoMemory(PathBuf),
}

pub use passage_model::protocol::count_cpu_list;

/// `/proc/cpuinfo` is read up to this much: the first CPU's entry is within the first
/// few KiB, and a machine with a thousand CPUs has a file of a megabyte.
const CPUINFO_READ: u64 = 64 << 10;

/// The physical address width from `/proc/cpuinfo`'s first `address sizes : 46 bits
/// physical, 48 bits virtual` line; `None` without one (arm64 kernels write none).
pub fn address_bits(cpuinfo: &str) -> Option<u8> {
    let line = cpuinfo.lines().find(|l| {
        l.split(':')
            .next()
            .is_some_and(|k| k.trim() == "address sizes")
    })?;
    let (_, value) = line.split_once(':')?;
    let mut words = value.split_whitespace();
    let bits = words.next()?.parse::<u8>().ok()?;
    (words.next() == Some("bits")
        && words
            .next()
            .is_some_and(|w| w.trim_end_matches(',') == "physical")
        && (32..=64).contains(&bits))
    .then_some(bits)
}

/// Where the CPU description of the machine behind `root` is: the generator's stand-in
/// inside a generated tree, the kernel's `/proc/cpuinfo` for any other.
pub fn cpuinfo_path(root: &Path) -> PathBuf {
    if root.join(super::FAKE_MARKER).exists() {
        root.join(crate::fake::FAKE_PROC_DIR).join("cpuinfo")
    } else {
        PathBuf::from("/proc/cpuinfo")
    }
}

pub(crate) fn read_cpuinfo(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    fs::File::open(path)?
        .take(CPUINFO_READ)
        .read_to_string(&mut text)?;
    Ok(text)
}

/// The address width from the cpuinfo at `path`. The kernel's is read once per process:
/// the width cannot change while the machine runs, and reading `/proc/cpuinfo` asks
/// every CPU for its frequency, on every inventory pass otherwise.
fn read_address_bits(path: &Path) -> Option<u8> {
    static MACHINE: std::sync::OnceLock<Option<u8>> = std::sync::OnceLock::new();
    let read = || read_cpuinfo(path).ok().and_then(|t| address_bits(&t));
    if path == Path::new("/proc/cpuinfo") {
        *MACHINE.get_or_init(read)
    } else {
        read()
    }
}

/// `hugepages-<size>kB` → the size in KiB.
fn hugepage_size_kib(name: &str) -> Option<u64> {
    let n = name.strip_prefix("hugepages-")?.strip_suffix("kB")?;
    (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .then(|| n.parse().ok())
        .flatten()
}

/// A node's huge page pools, smallest page first. A node without `hugepages/` (a kernel
/// without huge pages) has none.
fn hugepages(node: &Path) -> Result<Vec<HugepagePool>, ResourcesError> {
    let dir = node.join("hugepages");
    let Ok(entries) = fs::read_dir(&dir) else {
        return Ok(Vec::new());
    };
    let mut pools = Vec::new();
    for entry in entries.flatten() {
        let Some(size_kib) = entry.file_name().to_str().and_then(hugepage_size_kib) else {
            continue;
        };
        let count = |file: &str| -> Result<u64, ResourcesError> {
            let path = entry.path().join(file);
            let text = read_attr(&path).map_err(|source| ResourcesError::Io {
                path: path.clone(),
                source,
            })?;
            text.trim().parse().map_err(|_| ResourcesError::Parse {
                path,
                why: format!(
                    "{:?} is not a count",
                    text.chars().take(40).collect::<String>()
                ),
            })
        };
        pools.push(HugepagePool {
            size_kib,
            total: count("nr_hugepages")?,
            free: count("free_hugepages")?,
        });
        if pools.len() > MAX_HUGEPAGE_POOLS {
            return Err(ResourcesError::Parse {
                path: dir,
                why: format!("more than {MAX_HUGEPAGE_POOLS} huge page sizes"),
            });
        }
    }
    pools.sort_by_key(|p| p.size_kib);
    Ok(pools)
}

/// The `MemTotal` of one node's `meminfo` (`Node 0 MemTotal:  263921664 kB`), in KiB.
pub fn mem_total_kib(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.contains("MemTotal:"))?;
    let mut words = line.split_once("MemTotal:")?.1.split_whitespace();
    let n = words.next()?.parse::<u64>().ok()?;
    (words.next() == Some("kB")).then_some(n)
}

/// The CPUs online and the memory of all NUMA nodes under `root`.
pub fn host_resources(root: &Path) -> Result<HostResources, ResourcesError> {
    let online = root.join("devices/system/cpu/online");
    let text = read_attr(&online).map_err(|source| ResourcesError::Io {
        path: online.clone(),
        source,
    })?;
    let cpus = count_cpu_list(&text).ok_or_else(|| ResourcesError::Parse {
        path: online.clone(),
        why: format!("{text:?} is not a CPU list"),
    })?;
    let nodes = root.join("devices/system/node");
    let entries = fs::read_dir(&nodes).map_err(|source| ResourcesError::Io {
        path: nodes.clone(),
        source,
    })?;
    let mut kib: u64 = 0;
    let mut seen = false;
    let mut numa = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(n) = name.to_str().and_then(|n| n.strip_prefix("node")) else {
            continue;
        };
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let path = entry.path().join("meminfo");
        let text = read_attr(&path).map_err(|source| ResourcesError::Io {
            path: path.clone(),
            source,
        })?;
        let node_kib = mem_total_kib(&text).ok_or_else(|| ResourcesError::Parse {
            path: path.clone(),
            why: "no MemTotal line in kB".into(),
        })?;
        kib = kib.saturating_add(node_kib);
        seen = true;
        let Ok(node) = n.parse::<u32>() else {
            continue;
        };
        if numa.len() >= MAX_NUMA_NODES {
            return Err(ResourcesError::Parse {
                path: nodes,
                why: format!("more than {MAX_NUMA_NODES} NUMA nodes"),
            });
        }
        let cpulist = entry.path().join("cpulist");
        let node_cpus = match read_attr(&cpulist) {
            Ok(t) if t.trim().is_empty() || count_cpu_list(&t).is_some() => t.trim().to_string(),
            Ok(t) => {
                return Err(ResourcesError::Parse {
                    path: cpulist,
                    why: format!(
                        "{:?} is not a CPU list",
                        t.chars().take(40).collect::<String>()
                    ),
                });
            }
            // Kernels have written `cpulist` since 2.6.26; a tree without it is an older
            // generated one, whose nodes then say nothing of their CPUs.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(source) => {
                return Err(ResourcesError::Io {
                    path: cpulist,
                    source,
                });
            }
        };
        numa.push(NumaNode {
            node,
            cpus: node_cpus,
            memory_mib: (node_kib / 1024).min(MAX_HOST_MEMORY_MIB),
            hugepages: hugepages(&entry.path())?,
        });
    }
    if !seen {
        return Err(ResourcesError::NoMemory(nodes));
    }
    numa.sort_by_key(|n| n.node);
    let memory_mib = (kib / 1024).min(MAX_HOST_MEMORY_MIB);
    // The address width is a launch's concern, not the inventory's: a node whose
    // cpuinfo cannot be read still reports its CPUs and memory.
    let address_bits = read_address_bits(&cpuinfo_path(root));
    let r = HostResources {
        cpus,
        memory_mib,
        address_bits,
        numa,
        reserved_cpus: String::new(),
    };
    r.validate().map_err(|(field, why)| ResourcesError::Parse {
        path: nodes,
        why: format!("{field} {why}"),
    })?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cpuinfo_address_sizes() {
        let x86 = "processor\t: 0\nvendor_id\t: GenuineIntel\n\
                   address sizes\t: 46 bits physical, 48 bits virtual\npower management:\n\n\
                   processor\t: 1\naddress sizes\t: 46 bits physical, 48 bits virtual\n";
        assert_eq!(address_bits(x86), Some(46));
        assert_eq!(
            address_bits("address sizes : 52 bits physical, 57 bits virtual"),
            Some(52)
        );
        for bad in [
            "",
            "processor : 0\nBogoMIPS : 50.00\n",
            "address sizes : 46 bytes physical",
            "address sizes : 99 bits physical, 48 bits virtual",
            "address sizes : 20 bits physical, 48 bits virtual",
            "address sizes : -1 bits physical",
            "address sizes : 48 bits virtual",
            "address sizes",
        ] {
            assert_eq!(address_bits(bad), None, "{bad:?}");
        }
        assert_eq!(hugepage_size_kib("hugepages-2048kB"), Some(2048));
        assert_eq!(hugepage_size_kib("hugepages-1048576kB"), Some(1 << 20));
        for bad in [
            "hugepages-kB",
            "hugepages-2048",
            "hugepages-+2kB",
            "x-2048kB",
        ] {
            assert_eq!(hugepage_size_kib(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn from_a_generated_tree() {
        use crate::fake::{FakeOptions, FakeSpec, generate_with};
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sys");
        let opts = FakeOptions {
            cpus: Some(48),
            hugepages_per_node: (512, 4),
            ..FakeOptions::default()
        };
        let spec = FakeSpec {
            numa_nodes: 3,
            ..FakeSpec::default()
        };
        generate_with(&root, &spec, &opts).unwrap();
        let r = host_resources(&root).unwrap();
        assert_eq!(r.cpus, 48);
        assert_eq!(r.address_bits, Some(46));
        let lists: Vec<&str> = r.numa.iter().map(|n| n.cpus.as_str()).collect();
        assert_eq!(lists, ["0-15", "16-31", "32-47"]);
        let total: u32 = r.numa.iter().filter_map(|n| count_cpu_list(&n.cpus)).sum();
        assert_eq!(total, r.cpus);
        assert_eq!(
            r.numa.iter().map(|n| n.memory_mib).sum::<u64>(),
            r.memory_mib
        );
        assert_eq!(
            r.numa[2].hugepages,
            [
                HugepagePool {
                    size_kib: 2048,
                    total: 512,
                    free: 512
                },
                HugepagePool {
                    size_kib: 1 << 20,
                    total: 4,
                    free: 4
                }
            ]
        );

        // A garbled pool or CPU list is refused, as a garbled meminfo is.
        let pool = root.join("devices/system/node/node1/hugepages/hugepages-2048kB");
        fs::write(pool.join("free_hugepages"), "many\n").unwrap();
        assert!(host_resources(&root).is_err());
        fs::write(pool.join("free_hugepages"), "600\n").unwrap();
        assert!(host_resources(&root).is_err(), "more free than total");
        fs::write(pool.join("free_hugepages"), "0\n").unwrap();
        assert!(host_resources(&root).is_ok());
        fs::write(root.join("devices/system/node/node1/cpulist"), "1-\n").unwrap();
        assert!(host_resources(&root).is_err());
        fs::write(root.join("devices/system/node/node1/cpulist"), "\n").unwrap();
        assert!(host_resources(&root).is_ok());
        // Without cpuinfo there is no width, and nothing else is lost.
        fs::remove_file(root.join(crate::fake::FAKE_PROC_DIR).join("cpuinfo")).unwrap();
        let r = host_resources(&root).unwrap();
        assert_eq!((r.address_bits, r.numa.len()), (None, 3));
    }

    #[test]
    fn meminfo_lines() {
        let node = "Node 0 MemTotal:       263921664 kB\nNode 0 MemFree:        1 kB\n";
        assert_eq!(mem_total_kib(node), Some(263_921_664));
        assert_eq!(mem_total_kib("Node 0 MemTotal: 12 MB"), None);
        assert_eq!(mem_total_kib("Node 0 MemFree: 12 kB"), None);
        assert_eq!(mem_total_kib("Node 0 MemTotal:"), None);
    }

    #[test]
    fn from_a_tree() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        assert!(matches!(
            host_resources(root),
            Err(ResourcesError::Io { .. })
        ));
        fs::create_dir_all(root.join("devices/system/cpu")).unwrap();
        fs::write(root.join("devices/system/cpu/online"), "0-7\n").unwrap();
        fs::create_dir_all(root.join("devices/system/node")).unwrap();
        assert!(matches!(
            host_resources(root),
            Err(ResourcesError::NoMemory(_))
        ));
        for n in 0..2 {
            let d = root.join(format!("devices/system/node/node{n}"));
            fs::create_dir_all(&d).unwrap();
            fs::write(
                d.join("meminfo"),
                format!("Node {n} MemTotal: 2097152 kB\n"),
            )
            .unwrap();
        }
        // Not a node: ignored.
        fs::create_dir_all(root.join("devices/system/node/power")).unwrap();
        let r = host_resources(root).unwrap();
        assert_eq!((r.cpus, r.memory_mib), (8, 4096));
        // No cpulist and no huge pages here: the nodes are listed all the same.
        assert_eq!(r.numa.len(), 2);
        assert!(
            r.numa
                .iter()
                .all(|n| n.cpus.is_empty() && n.hugepages.is_empty())
        );
        assert_eq!(r.numa[1].memory_mib, 2048);
        fs::write(
            root.join("devices/system/node/node1/meminfo"),
            b"garbage\xff",
        )
        .unwrap();
        assert!(host_resources(root).is_err());
    }

    proptest! {
        #[test]
        fn parsers_never_panic(s in "\\PC{0,64}") {
            let _ = count_cpu_list(&s);
            let _ = mem_total_kib(&s);
            let _ = address_bits(&s);
            let _ = hugepage_size_kib(&s);
        }
    }
}
