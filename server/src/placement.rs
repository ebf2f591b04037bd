//! Placement: which server and which devices a VM gets. Pure: it sees candidates, never
//! the database, so it can be tested and benchmarked alone. The store then reserves the
//! choice with conditional writes; a lost race means placing again.

use crate::store::devices::Candidate;
use passage_model::capacity::{DeviceShape, HostRoom};
use passage_model::{DevicePath, ServerId};
use std::collections::{BTreeMap, HashMap};

pub use passage_model::api::PlacementPolicy as Policy;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub server: ServerId,
    pub devices: Vec<DevicePath>,
}

/// The VM being placed, and its servers' NUMA rooms and address widths: a server's
/// devices are picked only where their NUMA nodes have the VM's cores and memory and the
/// node's address width holds its RAM and BARs. A server absent from `hosts` is unchecked.
#[derive(Clone, Copy, Debug)]
pub struct VmShape<'a> {
    pub vcpus: u32,
    pub memory_mib: u64,
    pub hosts: &'a HashMap<ServerId, HostRoom>,
}

impl VmShape<'_> {
    /// Why `server` cannot give the VM these devices; `None` when it can or is unchecked.
    fn lacks(&self, server: ServerId, devs: &[&Candidate]) -> Option<String> {
        let host = self.hosts.get(&server)?;
        let shapes: Vec<DeviceShape> = devs
            .iter()
            .map(|c| DeviceShape {
                numa_node: c.numa_node,
                window: c.window,
            })
            .collect();
        host.lacks(self.vcpus, self.memory_mib, &shapes)
    }
}

/// Picks a server that has `count` free devices of every requested variant, preferring
/// one where each variant's devices can all come from one NUMA node, then by `policy`:
/// the fewest free devices (pack) or the most (spread). Servers in `avoid` (where the
/// caller just lost a race) come last.
pub fn choose(
    candidates: &[Candidate],
    request: &BTreeMap<String, u32>,
    avoid: &[ServerId],
    policy: Policy,
) -> Option<Placement> {
    choose_fitting(candidates, request, avoid, policy, None)
}

/// [`choose`], where `shape` (when given) also says which devices' NUMA nodes and which
/// servers' address widths take the VM.
pub fn choose_fitting(
    candidates: &[Candidate],
    request: &BTreeMap<String, u32>,
    avoid: &[ServerId],
    policy: Policy,
    shape: Option<&VmShape<'_>>,
) -> Option<Placement> {
    if request.is_empty() || request.values().any(|n| *n == 0) {
        return None;
    }
    let mut by_server: HashMap<ServerId, Vec<&Candidate>> = HashMap::new();
    for c in candidates {
        by_server.entry(c.server_uuid).or_default().push(c);
    }
    // Smallest key wins: (avoided, not NUMA-local, free devices, uuid for determinism).
    type Key = (bool, bool, usize, ServerId);
    let mut best: Option<(Key, Vec<DevicePath>)> = None;
    for (server, devs) in by_server {
        let Some((numa_local, picked)) = pick_on_server(&devs, request, policy, shape) else {
            continue;
        };
        let free = match policy {
            Policy::Pack => devs.len(),
            Policy::Spread => usize::MAX - devs.len(),
        };
        let key = (avoid.contains(&server), !numa_local, free, server);
        if best.as_ref().is_none_or(|(k, _)| key < *k) {
            best = Some((key, picked));
        }
    }
    best.map(|((_, _, _, server), devices)| Placement { server, devices })
}

/// Why no server of `candidates` takes the VM of `shape`, for the first (by uuid) that has
/// the devices but not the NUMA room or address width for them; `None` when none is so.
pub fn why_unfit(
    candidates: &[Candidate],
    request: &BTreeMap<String, u32>,
    policy: Policy,
    shape: &VmShape<'_>,
) -> Option<String> {
    let mut by_server: BTreeMap<ServerId, Vec<&Candidate>> = BTreeMap::new();
    for c in candidates {
        by_server.entry(c.server_uuid).or_default().push(c);
    }
    by_server.into_iter().find_map(|(server, devs)| {
        let (_, ids) = pick_on_server(&devs, request, policy, None)?;
        let picked: Vec<&Candidate> = ids
            .iter()
            .filter_map(|id| devs.iter().copied().find(|c| &c.id == id))
            .collect();
        shape
            .lacks(server, &picked)
            .map(|why| format!("server {server}: {why}"))
    })
}

/// The devices one server would give, and whether each variant's share sits on a single
/// NUMA node. vGPU slots come from the GPU with the fewest free slots first (pack) or
/// the most (spread). With a `shape`, a NUMA node whose CPUs or memory cannot take the VM
/// is passed over, and a server that cannot take it at all gives nothing.
pub fn pick_on_server(
    devs: &[&Candidate],
    request: &BTreeMap<String, u32>,
    policy: Policy,
    shape: Option<&VmShape<'_>>,
) -> Option<(bool, Vec<DevicePath>)> {
    let server = devs.first()?.server_uuid;
    let admits = |p: &[&Candidate]| shape.is_none_or(|s| s.lacks(server, p).is_none());
    let mut all_local = true;
    let mut picked: Vec<&Candidate> = Vec::new();
    for (variant, &count) in request {
        let count = count as usize;
        let mut of_variant: Vec<&Candidate> = devs
            .iter()
            .copied()
            .filter(|c| &c.variant == variant)
            .collect();
        if of_variant.len() < count {
            return None;
        }
        of_variant.sort_by(|a, b| a.id.cmp(&b.id));
        if of_variant.first().is_some_and(|c| c.id.vgpu().is_some()) {
            let mut per_gpu: HashMap<DevicePath, usize> = HashMap::new();
            for c in &of_variant {
                *per_gpu.entry(c.id.gpu()).or_default() += 1;
            }
            of_variant.sort_by_cached_key(|c| {
                let gpu = c.id.gpu();
                let n = per_gpu.get(&gpu).copied().unwrap_or(0);
                let by_policy = match policy {
                    Policy::Pack => n,
                    Policy::Spread => usize::MAX - n,
                };
                (by_policy, gpu, c.id.clone())
            });
            picked.extend(of_variant.iter().take(count).copied());
            continue;
        }
        let mut by_numa: BTreeMap<Option<u32>, Vec<&Candidate>> = BTreeMap::new();
        for c in &of_variant {
            by_numa.entry(c.numa_node).or_default().push(c);
        }
        // The fullest node that fits alone, else the smallest that fits: leaves big
        // blocks for big requests. A node without the VM's cores or memory is no fit.
        let mut local: Vec<&Vec<&Candidate>> =
            by_numa.values().filter(|v| v.len() >= count).collect();
        local.sort_by_key(|v| v.len());
        let local = local
            .into_iter()
            .map(|v| under_one_root(v, count))
            .find(|p| {
                let mut with = picked.clone();
                with.extend(p.iter().copied());
                admits(&with)
            });
        match local {
            Some(p) => picked.extend(p),
            None => {
                all_local = false;
                picked.extend(under_one_root(&of_variant, count));
            }
        }
    }
    if !admits(&picked) {
        return None;
    }
    Some((all_local, picked.iter().map(|c| c.id.clone()).collect()))
}

/// What placement knows of a server besides its free devices.
/// `count` devices from `devs`, all under one PCIe root port when some root has enough
/// (peer-to-peer traffic stays below it), else in address order.
fn under_one_root<'a>(devs: &[&'a Candidate], count: usize) -> Vec<&'a Candidate> {
    let mut by_root: BTreeMap<Option<passage_model::PciAddress>, Vec<&Candidate>> = BTreeMap::new();
    for c in devs {
        by_root
            .entry(c.id.parents().first().copied())
            .or_default()
            .push(c);
    }
    let group = by_root
        .values()
        .filter(|v| v.len() >= count)
        .min_by_key(|v| v.len());
    match group {
        Some(v) => v.iter().take(count).copied().collect(),
        None => devs.iter().take(count).copied().collect(),
    }
}

#[derive(Clone, Debug)]
pub struct ServerInfo {
    pub uuid: ServerId,
    pub hostname: String,
    pub running: bool,
    pub disabled: bool,
    /// Its vCPUs and memory; `None` when its agent never reported them (unchecked).
    pub room: Option<crate::store::room::Room>,
    /// Its NUMA nodes' room and address width; `None` when never reported (unchecked).
    pub host: Option<HostRoom>,
}

/// The decision `choose` would make, and for every server why it was or was not fit: the
/// hard filters in order (status, service state, vCPUs and memory, devices per variant,
/// then the NUMA nodes and address width of the devices it would give).
pub fn explain(
    servers: &[ServerInfo],
    candidates: &[Candidate],
    request: &BTreeMap<String, u32>,
    (vcpus, memory_mib): (u32, u64),
    policy: Policy,
) -> passage_model::api::PlacementExplanation {
    let mut verdicts = Vec::with_capacity(servers.len());
    let mut fit: Vec<Candidate> = Vec::new();
    let mut fit_servers: Vec<ServerId> = Vec::new();
    let hosts: HashMap<ServerId, HostRoom> = servers
        .iter()
        .filter_map(|s| Some((s.uuid, s.host.clone()?)))
        .collect();
    let shape = VmShape {
        vcpus,
        memory_mib,
        hosts: &hosts,
    };
    for s in servers {
        let mut reasons = Vec::new();
        if !s.running {
            reasons.push("not running (no recent heartbeat)".to_string());
        }
        if s.disabled {
            reasons.push("disabled by an operator (drained)".to_string());
        }
        if let Some(why) = s.room.and_then(|r| r.lacks(vcpus, memory_mib)) {
            reasons.push(why);
        }
        let mine: Vec<&Candidate> = candidates
            .iter()
            .filter(|c| c.server_uuid == s.uuid)
            .collect();
        for (variant, &want) in request {
            let have = mine.iter().filter(|c| &c.variant == variant).count();
            if have < want as usize {
                reasons.push(format!("has {have} free {variant}, needs {want}"));
            }
        }
        if reasons.is_empty()
            && !request.is_empty()
            && pick_on_server(&mine, request, policy, Some(&shape)).is_none()
        {
            // The devices it would give without the check, and why they do not do.
            let why = pick_on_server(&mine, request, policy, None)
                .and_then(|(_, ids)| {
                    let devs: Vec<&Candidate> = ids
                        .iter()
                        .filter_map(|id| mine.iter().copied().find(|c| &c.id == id))
                        .collect();
                    shape.lacks(s.uuid, &devs)
                })
                .unwrap_or_else(|| "no NUMA node of its devices has room".to_string());
            reasons.push(why);
        }
        if reasons.is_empty() {
            fit.extend(mine.into_iter().cloned());
            fit_servers.push(s.uuid);
        }
        verdicts.push(passage_model::api::ServerVerdict {
            uuid: s.uuid,
            hostname: s.hostname.clone(),
            accepted: reasons.is_empty(),
            reasons,
        });
    }
    let choice = if request.is_empty() {
        fit_servers.iter().min().map(|s| Placement {
            server: *s,
            devices: Vec::new(),
        })
    } else {
        choose_fitting(&fit, request, &[], policy, Some(&shape))
    };
    passage_model::api::PlacementExplanation {
        server: choice.as_ref().map(|c| c.server),
        devices: choice.map(|c| c.devices).unwrap_or_default(),
        servers: verdicts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn server(n: u128) -> ServerId {
        ServerId(Uuid::from_u128(n))
    }

    fn cand(s: u128, bus: u8, variant: &str, numa: u32) -> Candidate {
        Candidate {
            server_uuid: server(s),
            id: format!("/devices/pci0000:00/0000:00:01.0/0000:{bus:02x}:00.0")
                .parse()
                .unwrap(),
            variant: variant.into(),
            numa_node: Some(numa),
            window: None,
        }
    }

    fn req(v: &[(&str, u32)]) -> BTreeMap<String, u32> {
        v.iter().map(|(k, n)| (k.to_string(), *n)).collect()
    }

    #[test]
    fn needs_enough_of_every_variant() {
        let c = vec![cand(1, 1, "A", 0), cand(1, 2, "B", 0), cand(2, 1, "A", 0)];
        let p = choose(&c, &req(&[("A", 1), ("B", 1)]), &[], Policy::Pack).unwrap();
        assert_eq!(p.server, server(1));
        assert_eq!(p.devices.len(), 2);
        assert!(choose(&c, &req(&[("A", 2)]), &[], Policy::Pack).is_none());
        assert!(choose(&c, &req(&[("C", 1)]), &[], Policy::Pack).is_none());
        assert!(choose(&c, &req(&[]), &[], Policy::Pack).is_none());
        assert!(choose(&[], &req(&[("A", 1)]), &[], Policy::Pack).is_none());
    }

    #[test]
    fn prefers_one_numa_node_then_packs() {
        // Server 1: 2 A on node 0 and 2 on node 1 (a 3-GPU request must straddle).
        // Server 2: 3 A on node 0, more free devices overall.
        let mut c = vec![
            cand(1, 1, "A", 0),
            cand(1, 2, "A", 0),
            cand(1, 3, "A", 1),
            cand(1, 4, "A", 1),
        ];
        c.extend([
            cand(2, 1, "A", 0),
            cand(2, 2, "A", 0),
            cand(2, 3, "A", 0),
            cand(2, 4, "A", 1),
            cand(2, 5, "A", 1),
        ]);
        let p = choose(&c, &req(&[("A", 3)]), &[], Policy::Pack).unwrap();
        assert_eq!(p.server, server(2), "NUMA-local wins over packing");
        // One device: both are local; server 1 has fewer free, so pack onto it.
        let p = choose(&c, &req(&[("A", 1)]), &[], Policy::Pack).unwrap();
        assert_eq!(p.server, server(1));
        // Spread: the server with the most free devices.
        let p = choose(&c, &req(&[("A", 1)]), &[], Policy::Spread).unwrap();
        assert_eq!(p.server, server(2));
        // The avoided server comes last.
        let p = choose(&c, &req(&[("A", 1)]), &[server(1)], Policy::Pack).unwrap();
        assert_eq!(p.server, server(2));
    }

    #[test]
    fn explanations_name_every_rejection() {
        let info = |n: u128, running: bool, disabled: bool| ServerInfo {
            uuid: server(n),
            hostname: format!("cn-{n}"),
            running,
            disabled,
            room: None,
            host: None,
        };
        let full = crate::store::room::Room {
            vcpus_total: 64,
            vcpus_used: 60,
            memory_total_mib: 1 << 20,
            memory_used_mib: 0,
        };
        let servers = [
            info(1, false, false),
            info(2, true, true),
            info(3, true, false),
            info(4, true, false),
            ServerInfo {
                room: Some(full),
                ..info(5, true, false)
            },
        ];
        let c = vec![
            cand(1, 1, "A", 0),
            cand(2, 1, "A", 0),
            cand(3, 1, "A", 0),
            cand(4, 1, "A", 0),
            cand(4, 2, "A", 0),
            cand(5, 1, "A", 0),
            cand(5, 2, "A", 0),
            cand(5, 3, "A", 0),
        ];
        let e = explain(&servers, &c, &req(&[("A", 2)]), (8, 1024), Policy::Spread);
        assert_eq!(
            e.server,
            Some(server(4)),
            "server 5 has more free but no vCPUs"
        );
        assert_eq!(e.devices.len(), 2);
        let why = |n: usize| e.servers[n].reasons.join("; ");
        assert!(why(0).contains("not running"));
        assert!(why(1).contains("disabled"));
        assert_eq!(why(2), "has 1 free A, needs 2");
        assert!(e.servers[3].accepted);
        assert_eq!(why(4), "has 4 vCPUs free, needs 8");
    }

    #[test]
    fn devices_under_one_root_port() {
        let at = |root: u8, bus: u8| Candidate {
            server_uuid: server(1),
            id: format!("/devices/pci0000:00/0000:00:{root:02x}.0/0000:{bus:02x}:00.0")
                .parse()
                .unwrap(),
            variant: "A".into(),
            numa_node: Some(0),
            window: None,
        };
        // Root 1 has one device, root 2 has two: a pair goes under root 2.
        let c = vec![at(1, 0x10), at(2, 0x20), at(2, 0x21)];
        let p = choose(&c, &req(&[("A", 2)]), &[], Policy::Pack).unwrap();
        let roots: Vec<_> = p
            .devices
            .iter()
            .map(|d| d.parents()[0].to_string())
            .collect();
        assert_eq!(roots, ["0000:00:02.0", "0000:00:02.0"]);
    }

    #[test]
    fn devices_on_the_chosen_node() {
        let c = vec![cand(1, 1, "A", 1), cand(1, 2, "A", 0), cand(1, 3, "A", 0)];
        let p = choose(&c, &req(&[("A", 2)]), &[], Policy::Pack).unwrap();
        let buses: Vec<String> = p.devices.iter().map(|d| d.address().to_string()).collect();
        assert_eq!(buses, vec!["0000:02:00.0", "0000:03:00.0"]);
    }

    #[test]
    fn a_numa_node_without_cores_is_passed_over() {
        use passage_model::capacity::{HostRoom, NodeRoom};
        // Node 1 holds two free devices (the smallest block that fits) but 2 free CPUs;
        // node 0 three devices and 8 CPUs.
        let c = vec![
            cand(1, 1, "A", 0),
            cand(1, 2, "A", 0),
            cand(1, 3, "A", 0),
            cand(1, 4, "A", 1),
            cand(1, 5, "A", 1),
        ];
        let node = |cpus_used| NodeRoom {
            cpus_total: Some(8),
            cpus_used,
            memory_total_mib: 1 << 20,
            memory_used_mib: 0,
        };
        let host = HostRoom {
            address_bits: None,
            nodes: BTreeMap::from([(0, node(0)), (1, node(6))]),
        };
        let hosts = HashMap::from([(server(1), host)]);
        let shape = VmShape {
            vcpus: 4,
            memory_mib: 1024,
            hosts: &hosts,
        };
        let p = choose(&c, &req(&[("A", 2)]), &[], Policy::Pack).unwrap();
        assert_eq!(p.devices[0].address().bus, 4, "unchecked: node 1");
        let p = choose_fitting(&c, &req(&[("A", 2)]), &[], Policy::Pack, Some(&shape)).unwrap();
        let buses: Vec<u8> = p.devices.iter().map(|d| d.address().bus).collect();
        assert_eq!(buses, [1, 2], "node 0 has the cores");
        // 12 vCPUs fit no node.
        let big = VmShape { vcpus: 12, ..shape };
        assert!(choose_fitting(&c, &req(&[("A", 2)]), &[], Policy::Pack, Some(&big)).is_none());
        let why = why_unfit(&c, &req(&[("A", 2)]), Policy::Pack, &big).unwrap_or_default();
        assert!(
            why.contains("NUMA node 1 of its devices has 2 CPUs free for pinning, needs 12"),
            "{why}"
        );
    }
}
