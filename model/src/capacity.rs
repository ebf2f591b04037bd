//! The pure rules of the scarce things a VM reserves besides its devices' states: a node's
//! vCPUs and memory ("room"), an owner's GPU quota, and the in-order decision of many
//! claims at once. The store reads what it needs, asks [`decide`], and writes the winners
//! (`server/src/store/reserve/`); placement asks the same [`Room`] whether a server fits.

use crate::guest_shape::{self, PortWindow};
use crate::ids::{AccountId, ServerId, VmId};
use crate::pci::DevicePath;
use crate::protocol::{HostFacts, parse_cpu_list};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

/// How reported capacity becomes allocatable capacity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Allocation {
    /// vCPUs per host CPU (Nova's `cpu_allocation_ratio`).
    pub cpu_ratio: f64,
    /// Memory kept for the host itself. Guest memory is never overcommitted: a VM with a
    /// passed-through device has all of its memory pinned for DMA.
    pub reserved_memory_mib: u64,
}

impl Default for Allocation {
    fn default() -> Self {
        Allocation {
            cpu_ratio: 1.0,
            reserved_memory_mib: 4096,
        }
    }
}

/// One node's allocatable vCPUs and memory, and what its VMs take of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Room {
    pub vcpus_total: i64,
    pub vcpus_used: i64,
    pub memory_total_mib: i64,
    pub memory_used_mib: i64,
}

impl Room {
    /// A node with `cpus` CPUs and `memory_mib` of memory, of which its VMs hold
    /// `vcpus_used` vCPUs and `memory_used_mib`.
    pub fn new(
        alloc: Allocation,
        cpus: i64,
        memory_mib: i64,
        vcpus_used: i64,
        memory_used_mib: i64,
    ) -> Room {
        // Truncation is the point: a fraction of a vCPU cannot be given.
        #[allow(clippy::cast_possible_truncation)]
        let vcpus_total = (cpus as f64 * alloc.cpu_ratio).floor() as i64;
        let reserved = i64::try_from(alloc.reserved_memory_mib).unwrap_or(i64::MAX);
        Room {
            vcpus_total,
            vcpus_used,
            memory_total_mib: memory_mib.saturating_sub(reserved).max(0),
            memory_used_mib,
        }
    }

    pub fn vcpus_free(&self) -> i64 {
        self.vcpus_total - self.vcpus_used
    }

    pub fn memory_free_mib(&self) -> i64 {
        self.memory_total_mib - self.memory_used_mib
    }

    /// Why `vcpus` and `memory_mib` more would not fit; `None` when they do.
    pub fn lacks(&self, vcpus: u32, memory_mib: u64) -> Option<String> {
        let mut why = Vec::new();
        if i64::from(vcpus) > self.vcpus_free() {
            why.push(format!(
                "has {} vCPUs free, needs {vcpus}",
                self.vcpus_free().max(0)
            ));
        }
        if mib(memory_mib) > self.memory_free_mib() {
            why.push(format!(
                "has {} MiB of memory free, needs {memory_mib}",
                self.memory_free_mib().max(0)
            ));
        }
        (!why.is_empty()).then(|| why.join("; "))
    }

    /// Takes `vcpus` and `memory_mib` more, or says why the server cannot give them.
    pub fn take(&mut self, server: ServerId, vcpus: u32, memory_mib: u64) -> Result<(), Refusal> {
        let after = Room {
            vcpus_used: self.vcpus_used.saturating_add(i64::from(vcpus)),
            memory_used_mib: self.memory_used_mib.saturating_add(mib(memory_mib)),
            ..*self
        };
        if after.vcpus_free() < 0 || after.memory_free_mib() < 0 {
            return Err(Refusal::NoRoom(format!(
                "server {server} has {} of {} vCPUs and {} of {} MiB of memory allocated \
                 with this VM",
                after.vcpus_used, after.vcpus_total, after.memory_used_mib, after.memory_total_mib
            )));
        }
        *self = after;
        Ok(())
    }
}

fn mib(m: u64) -> i64 {
    i64::try_from(m).unwrap_or(i64::MAX)
}

/// Whether a node with `room` (`None`: never reported, so unchecked) takes the VM.
pub fn fits(room: Option<&Room>, vcpus: u32, memory_mib: u64) -> bool {
    room.is_none_or(|r| r.lacks(vcpus, memory_mib).is_none())
}

/// Where one device a VM holds or claims sits, and what its BARs take of the guest's
/// 64-bit PCI window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceShape {
    pub numa_node: Option<u32>,
    pub window: Option<PortWindow>,
}

/// One NUMA node's CPUs and memory for the VMs whose devices sit on it (their vCPUs are
/// pinned to its CPUs and their RAM bound to its memory, one CPU per vCPU), and what
/// those VMs hold of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeRoom {
    /// `None`: a node without CPUs of its own (memory only); its VMs' vCPUs run anywhere.
    pub cpus_total: Option<i64>,
    pub cpus_used: i64,
    pub memory_total_mib: i64,
    pub memory_used_mib: i64,
}

/// What a node's NUMA layout and CPUs allow a VM with devices: its physical address
/// width, and each NUMA node's room. Made from the facts the agent reported; a node that
/// reported none has an empty one, which checks nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostRoom {
    pub address_bits: Option<u8>,
    pub nodes: BTreeMap<u32, NodeRoom>,
}

impl HostRoom {
    /// Each node's CPUs less those the agent keeps for the host, and its memory less its
    /// share of the host's reserve.
    pub fn new(facts: &HostFacts, alloc: Allocation) -> HostRoom {
        let reserved: BTreeSet<u32> = parse_cpu_list(&facts.reserved_cpus)
            .unwrap_or_default()
            .into_iter()
            .collect();
        let with_memory = facts
            .numa
            .iter()
            .filter(|n| n.memory_mib > 0)
            .count()
            .max(1);
        let reserve_share = alloc.reserved_memory_mib / with_memory as u64;
        let nodes = facts
            .numa
            .iter()
            .map(|n| {
                let cpus = parse_cpu_list(&n.cpus).unwrap_or_default();
                let cpus_total = (!cpus.is_empty())
                    .then(|| cpus.iter().filter(|c| !reserved.contains(c)).count() as i64);
                let room = NodeRoom {
                    cpus_total,
                    cpus_used: 0,
                    memory_total_mib: mib(n.memory_mib.saturating_sub(reserve_share)),
                    memory_used_mib: 0,
                };
                (n.node, room)
            })
            .collect();
        HostRoom {
            address_bits: facts.address_bits,
            nodes,
        }
    }

    /// Counts a VM of `vcpus` and `memory_mib` whose devices sit on `numa` (one entry per
    /// device), as the agent binds it.
    pub fn hold(&mut self, vcpus: u32, memory_mib: u64, numa: &[Option<u32>]) {
        let nodes = guest_shape::host_nodes(numa.iter().copied());
        for share in guest_shape::split(vcpus, memory_mib, 1, &nodes) {
            if let Some(n) = self.nodes.get_mut(&share.host_node) {
                n.cpus_used = n
                    .cpus_used
                    .saturating_add(i64::from(share.vcpus.end - share.vcpus.start));
                n.memory_used_mib = n.memory_used_mib.saturating_add(mib(share.memory_mib));
            }
        }
    }

    /// Why one more VM of `vcpus` and `memory_mib` with `devices` would not fit: the
    /// guest address width its RAM and BARs need, and each of its devices' NUMA nodes'
    /// share of its vCPUs and memory. `None` when it fits.
    pub fn lacks(&self, vcpus: u32, memory_mib: u64, devices: &[DeviceShape]) -> Option<String> {
        if devices.is_empty() {
            return None;
        }
        let mut why = Vec::new();
        if let Some(bits) = self.address_bits {
            let laid: Vec<_> = devices.iter().map(|d| (d.numa_node, d.window)).collect();
            why.extend(guest_shape::width_lacks(
                memory_mib,
                guest_shape::vm_window(&laid),
                bits,
            ));
        }
        let nodes = guest_shape::host_nodes(devices.iter().map(|d| d.numa_node));
        for share in guest_shape::split(vcpus, memory_mib, 1, &nodes) {
            let Some(n) = self.nodes.get(&share.host_node) else {
                continue;
            };
            let want = i64::from(share.vcpus.end - share.vcpus.start);
            if let Some(total) = n.cpus_total {
                let free = total - n.cpus_used;
                if want > free {
                    why.push(format!(
                        "NUMA node {} of its devices has {} CPUs free for pinning, needs {want}",
                        share.host_node,
                        free.max(0)
                    ));
                }
            }
            let free = n.memory_total_mib - n.memory_used_mib;
            if mib(share.memory_mib) > free {
                why.push(format!(
                    "NUMA node {} of its devices has {} MiB of memory free, needs {}",
                    share.host_node,
                    free.max(0),
                    share.memory_mib
                ));
            }
        }
        (!why.is_empty()).then(|| why.join("; "))
    }

    /// Takes what [`HostRoom::lacks`] checks, or says why `server` cannot give it.
    pub fn take(
        &mut self,
        server: ServerId,
        vcpus: u32,
        memory_mib: u64,
        devices: &[DeviceShape],
    ) -> Result<(), Refusal> {
        if let Some(why) = self.lacks(vcpus, memory_mib, devices) {
            return Err(Refusal::NoRoom(format!("server {server}: {why}")));
        }
        let numa: Vec<Option<u32>> = devices.iter().map(|d| d.numa_node).collect();
        self.hold(vcpus, memory_mib, &numa);
        Ok(())
    }
}

/// An owner's GPU quota and the devices charged to it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quota {
    /// `None`: no limit.
    pub limit: Option<i64>,
    pub held: i64,
}

impl Quota {
    /// Whether `more` devices may be charged: the one rule, which the store's conditional
    /// write states again in SQL (`store::reserve::quota`).
    pub fn admits(&self, more: i64) -> bool {
        self.limit
            .is_none_or(|q| self.held.saturating_add(more) <= q)
    }

    /// Charges `more` devices, or says why not.
    pub fn charge(&mut self, more: i64) -> Result<(), Refusal> {
        if !self.admits(more) {
            return Err(Refusal::Quota(format!(
                "GPU quota of {} device(s) would be exceeded by {more} more",
                self.limit.unwrap_or(0)
            )));
        }
        self.held = self.held.saturating_add(more);
        Ok(())
    }
}

/// Why a claim was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A device is not free any more, or an earlier claim of the same decision took it.
    Taken,
    /// The server lacks the vCPUs or memory.
    NoRoom(String),
    /// The owner's GPU quota would be exceeded.
    Quota(String),
}

/// What one VM asks to reserve at once: its devices on one server, charged to its owner,
/// and its vCPUs and memory there.
#[derive(Clone, Copy, Debug)]
pub struct Claim<'a> {
    pub vm: VmId,
    pub owner: AccountId,
    /// `None`: a VM that was never placed reserves nothing.
    pub server: Option<ServerId>,
    pub devices: &'a [DevicePath],
    pub vcpus: u32,
    pub memory_mib: u64,
}

/// What a decision starts from, read in one go under the store's lock.
#[derive(Clone, Debug, Default)]
pub struct Holdings {
    /// Each claimed server's room without the claiming VMs (a resize counts its VM at its
    /// new shape only). A server that never reported its resources is absent: unchecked.
    pub rooms: HashMap<ServerId, Room>,
    /// The quota of each owner that claims devices.
    pub quotas: HashMap<AccountId, Quota>,
    /// The free devices of the claimed servers.
    pub free: HashSet<(ServerId, DevicePath)>,
    /// The NUMA rooms and address widths of the claimed servers that reported them, less
    /// the claiming VMs (absent: unchecked).
    pub hosts: HashMap<ServerId, HostRoom>,
    /// Where the claimed devices sit and their BARs' windows (absent: unknown, unchecked).
    pub shapes: HashMap<(ServerId, DevicePath), DeviceShape>,
}

/// Decides each claim in order, as if each were made alone after those before it: room
/// first (the node's, then its devices' NUMA nodes' and address width), then quota, then
/// the devices, each spent only by the claims that win.
pub fn decide(claims: &[Claim<'_>], mut h: Holdings) -> Vec<Result<(), Refusal>> {
    let mut taken: HashSet<(ServerId, DevicePath)> = HashSet::new();
    claims
        .iter()
        .map(|c| {
            let Some(server) = c.server else {
                return Ok(());
            };
            let mut room = h.rooms.get(&server).copied();
            if let Some(r) = room.as_mut() {
                r.take(server, c.vcpus, c.memory_mib)?;
            }
            let mut host = h.hosts.get(&server).cloned();
            if let Some(host) = host.as_mut() {
                let shapes: Vec<DeviceShape> = c
                    .devices
                    .iter()
                    .map(|d| {
                        h.shapes
                            .get(&(server, d.clone()))
                            .copied()
                            .unwrap_or_default()
                    })
                    .collect();
                host.take(server, c.vcpus, c.memory_mib, &shapes)?;
            }
            let n = c.devices.len() as i64;
            let mut quota = h.quotas.get(&c.owner).copied().unwrap_or(Quota {
                limit: None,
                held: 0,
            });
            if n > 0 {
                quota.charge(n)?;
                let keys: Vec<(ServerId, DevicePath)> =
                    c.devices.iter().map(|d| (server, d.clone())).collect();
                let mut seen = HashSet::new();
                if keys
                    .iter()
                    .any(|k| !h.free.contains(k) || taken.contains(k) || !seen.insert(k))
                {
                    return Err(Refusal::Taken);
                }
                taken.extend(keys);
                h.quotas.insert(c.owner, quota);
            }
            if let Some(r) = room {
                h.rooms.insert(server, r);
            }
            if let Some(host) = host {
                h.hosts.insert(server, host);
            }
            Ok(())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn path(bus: u8) -> DevicePath {
        format!("/devices/pci0000:00/0000:00:01.0/0000:{bus:02x}:00.0")
            .parse()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn allocatable_capacity() {
        let alloc = Allocation {
            cpu_ratio: 1.5,
            reserved_memory_mib: 1024,
        };
        let r = Room::new(alloc, 5, 4096, 6, 1000);
        assert_eq!(r.vcpus_total, 7);
        assert_eq!(r.memory_total_mib, 3072);
        assert_eq!(r.lacks(1, 2072), None);
        assert_eq!(
            r.lacks(2, 2073).as_deref(),
            Some("has 1 vCPUs free, needs 2; has 2072 MiB of memory free, needs 2073")
        );
        assert!(fits(None, u32::MAX, u64::MAX));
        assert!(!fits(Some(&r), 2, 1));
        // More reserved than there is: nothing allocatable, never negative.
        let r = Room::new(alloc, 1, 512, 0, 0);
        assert_eq!(r.memory_total_mib, 0);
    }

    #[test]
    fn quota_boundaries() {
        let q = Quota {
            limit: Some(2),
            held: 1,
        };
        assert!(q.admits(1));
        assert!(!q.admits(2));
        assert!(
            Quota {
                limit: None,
                held: i64::MAX
            }
            .admits(i64::MAX)
        );
        let mut q = q;
        assert_eq!(q.charge(1), Ok(()));
        assert_eq!(q.held, 2);
        assert!(matches!(q.charge(1), Err(Refusal::Quota(_))));
        assert_eq!(q.held, 2, "a refused charge spends nothing");
    }

    fn claim(server: ServerId, owner: AccountId, devices: &[DevicePath], vcpus: u32) -> Claim<'_> {
        Claim {
            vm: VmId(Uuid::new_v4()),
            owner,
            server: Some(server),
            devices,
            vcpus,
            memory_mib: 1024,
        }
    }

    fn quota(limit: Option<i64>, held: i64) -> Quota {
        Quota { limit, held }
    }

    fn room(vcpus_total: i64, vcpus_used: i64) -> Room {
        Room {
            vcpus_total,
            vcpus_used,
            memory_total_mib: 1 << 20,
            memory_used_mib: 0,
        }
    }

    #[test]
    fn each_claim_is_decided_as_if_alone_in_order() {
        let s = ServerId(Uuid::from_u128(1));
        let (a, b) = (
            AccountId(Uuid::from_u128(10)),
            AccountId(Uuid::from_u128(11)),
        );
        let (d1, d2, d3, twice) = ([path(1)], [path(2)], [path(3)], [path(3), path(3)]);
        let claims = [
            claim(s, a, &d1, 4),
            claim(s, b, &d1, 4),    // the device went to the first
            claim(s, a, &d2, 4),    // a's quota of 1 is spent
            claim(s, b, &d2, 9),    // 9 more vCPUs: 16 total, 8 taken
            claim(s, b, &twice, 1), // one device named twice
            claim(s, b, &d3, 4),
            claim(s, b, &[], 4), // room only: 16 of 16 now
            claim(s, b, &[], 1),
        ];
        let h = Holdings {
            rooms: HashMap::from([(s, room(16, 4))]),
            quotas: HashMap::from([(a, quota(Some(1), 0)), (b, quota(None, 3))]),
            free: [path(1), path(2), path(3)]
                .into_iter()
                .map(|p| (s, p))
                .collect(),
            ..Holdings::default()
        };
        let v = decide(&claims, h);
        assert_eq!(v[0], Ok(()));
        assert_eq!(v[1], Err(Refusal::Taken));
        assert!(matches!(v[2], Err(Refusal::Quota(_))), "{:?}", v[2]);
        assert!(matches!(v[3], Err(Refusal::NoRoom(_))), "{:?}", v[3]);
        assert_eq!(v[4], Err(Refusal::Taken));
        assert_eq!(v[5], Ok(()));
        assert_eq!(v[6], Ok(()));
        assert!(matches!(v[7], Err(Refusal::NoRoom(_))), "{:?}", v[7]);
    }

    #[test]
    fn a_refused_claim_spends_nothing() {
        let s = ServerId(Uuid::from_u128(1));
        let a = AccountId(Uuid::from_u128(10));
        let (gone, ok) = ([path(9)], [path(1)]);
        let claims = [claim(s, a, &gone, 8), claim(s, a, &ok, 8)];
        let h = Holdings {
            rooms: HashMap::from([(s, room(8, 0))]),
            quotas: HashMap::from([(a, quota(Some(1), 0))]),
            free: HashSet::from([(s, path(1))]),
            ..Holdings::default()
        };
        // The first claim's device is gone: its vCPUs and quota go to the second.
        assert_eq!(decide(&claims, h), vec![Err(Refusal::Taken), Ok(())]);
    }

    #[test]
    fn an_unplaced_claim_reserves_nothing() {
        let c = Claim {
            server: None,
            ..claim(ServerId(Uuid::nil()), AccountId(Uuid::nil()), &[], u32::MAX)
        };
        assert_eq!(decide(&[c], Holdings::default()), vec![Ok(())]);
    }

    fn facts(reserved: &str) -> HostFacts {
        let node = |node: u32, cpus: &str| crate::protocol::NumaNode {
            node,
            cpus: cpus.into(),
            memory_mib: 64 * 1024,
            hugepages: Vec::new(),
        };
        HostFacts {
            address_bits: Some(46),
            numa: vec![node(0, "0-15"), node(1, "16-31")],
            reserved_cpus: reserved.into(),
        }
    }

    #[test]
    fn numa_nodes_of_the_devices_give_the_cores_and_memory() {
        let alloc = Allocation {
            cpu_ratio: 4.0,
            reserved_memory_mib: 8192,
        };
        let mut host = HostRoom::new(&facts("0,16"), alloc);
        // 15 CPUs each (the reserve is never pinned to), 60 GiB each (4 of the 8 kept).
        assert_eq!(host.nodes[&0].cpus_total, Some(15));
        assert_eq!(host.nodes[&1].memory_total_mib, 60 * 1024);
        let on = |n: u32| DeviceShape {
            numa_node: Some(n),
            window: None,
        };
        let s = ServerId(Uuid::from_u128(1));
        assert_eq!(host.take(s, 12, 1024, &[on(0)]), Ok(()));
        // 4 more on node 0 is one too many, whatever the node's ratio: pinned is 1:1.
        let why = host.lacks(4, 1024, &[on(0)]).unwrap_or_default();
        assert_eq!(
            why,
            "NUMA node 0 of its devices has 3 CPUs free for pinning, needs 4"
        );
        // Across both nodes it takes 2 and 2.
        assert_eq!(host.take(s, 4, 1024, &[on(0), on(1)]), Ok(()));
        assert_eq!(host.nodes[&0].cpus_used, 14);
        assert_eq!(host.nodes[&1].cpus_used, 2);
        // Memory per node.
        let why = host.lacks(1, 61 * 1024, &[on(1)]).unwrap_or_default();
        assert!(
            why.contains("NUMA node 1 of its devices has 60928 MiB"),
            "{why}"
        );
        // No devices: the node's room is the server's business, not a NUMA node's.
        assert_eq!(host.lacks(64, 1 << 30, &[]), None);
        // A device whose node is unknown checks nothing but the width.
        assert_eq!(host.lacks(64, 1024, &[DeviceShape::default()]), None);
    }

    #[test]
    fn the_address_width_bounds_ram_and_bars() {
        let mut f = facts("");
        f.address_bits = Some(42);
        let host = HostRoom::new(&f, Allocation::default());
        let h100 = DeviceShape {
            numa_node: None,
            window: Some(PortWindow {
                size: 256 << 30,
                align: 128 << 30,
            }),
        };
        assert_eq!(host.lacks(1, 4096, &[h100; 4]), None);
        // Eight of them need a 2 TiB + 1 GiB window: 43 bits.
        let why = host.lacks(1, 4096, &[h100; 8]).unwrap_or_default();
        assert!(why.contains("need 43-bit guest addresses"), "{why}");
        // Decided as a claim: refused with the reason, nothing spent.
        let s = ServerId(Uuid::from_u128(1));
        let a = AccountId(Uuid::from_u128(10));
        let devs: Vec<DevicePath> = (1..=8).map(path).collect();
        let h = Holdings {
            hosts: HashMap::from([(s, host)]),
            free: devs.iter().map(|d| (s, d.clone())).collect(),
            shapes: devs.iter().map(|d| ((s, d.clone()), h100)).collect(),
            ..Holdings::default()
        };
        let v = decide(&[claim(s, a, &devs, 1), claim(s, a, &devs[..4], 1)], h);
        assert!(
            matches!(&v[0], Err(Refusal::NoRoom(m)) if m.contains("43-bit")),
            "{v:?}"
        );
        assert_eq!(v[1], Ok(()));
    }
}
