//! The node's CPUs and memory for VMs, read from sysfs like everything else the agent
//! reports (so a fake tree carries them too): `devices/system/cpu/online` and the
//! `MemTotal` of every `devices/system/node/node<N>/meminfo`.

use super::read_attr;
use passage_model::protocol::{HostResources, MAX_HOST_CPUS, MAX_HOST_MEMORY_MIB};
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

/// Counts the CPUs of a kernel CPU list (`0-63`, `0,2-5,8`); `None` for anything else,
/// including ranges beyond [`MAX_HOST_CPUS`].
pub fn count_cpu_list(list: &str) -> Option<u32> {
    let mut total: u32 = 0;
    for part in list.trim().split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?),
            None => {
                let n = part.parse::<u32>().ok()?;
                (n, n)
            }
        };
        if hi < lo || hi >= MAX_HOST_CPUS {
            return None;
        }
        total = total.checked_add(hi - lo + 1)?;
    }
    (1..=MAX_HOST_CPUS).contains(&total).then_some(total)
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
    }
    if !seen {
        return Err(ResourcesError::NoMemory(nodes));
    }
    let memory_mib = (kib / 1024).min(MAX_HOST_MEMORY_MIB);
    let r = HostResources { cpus, memory_mib };
    r.validate().map_err(|(_, why)| ResourcesError::Parse {
        path: nodes,
        why: format!("memory {why}"),
    })?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(count_cpu_list("0-63\n"), Some(64));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("0,2-5,8"), Some(6));
        for bad in ["", "-", "5-3", "a", "0-", "0,,1", "0-70000", "1-2-3"] {
            assert_eq!(count_cpu_list(bad), None, "{bad:?}");
        }
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
        assert_eq!(
            r,
            HostResources {
                cpus: 8,
                memory_mib: 4096
            }
        );
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
        }
    }
}
