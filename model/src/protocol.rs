//! The agent protocol: what a node agent and the control plane say to each other.
//!
//! Paths (all JSON, under `/agent/v1`): `POST register` (join token → node credential),
//! then with `Authorization: Bearer <credential>`: `POST heartbeat`, `PUT inventory`,
//! `GET tasks?wait=SECONDS` (long-poll), `POST tasks/{id}/result`, `POST tasks/results`
//! (several results at once, [`TaskResults`]; both take `?wait=SECONDS` and then answer
//! the next poll's tasks too), `POST tasks/{id}/progress` ([`TaskProgress`], while a long task runs), and
//! `GET images/{sha256}` (an image file's bytes, honouring `Range: bytes=N-` so an
//! interrupted download resumes).

use crate::ids::{ServerId, TaskId, VmId};
use crate::images::{ImageType, Sha256};
use crate::pci::{DevicePath, PciDevice};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const PROTOCOL_VERSION: u32 = 1;
/// More functions than any real server has; a report beyond this is refused.
pub const MAX_INVENTORY_DEVICES: usize = 4096;
pub const MAX_HOSTNAME_LEN: usize = 253;
pub const MAX_ERROR_LEN: usize = 4096;
pub const MAX_TASK_DEVICES: usize = 64;
pub const MAX_LONG_POLL_SECS: u64 = 60;

#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterRequest {
    pub join_token: String,
    pub hostname: String,
    pub agent_version: String,
    pub protocol_version: u32,
}

#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterResponse {
    pub server_uuid: ServerId,
    /// The node's secret; sent back as a bearer token. Shown once.
    pub credential: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    /// The VMs the agent's hypervisor is running now; the control plane marks a running
    /// VM missing from this list as stopped. Absent (not empty) when the agent cannot
    /// tell.
    #[serde(default)]
    pub running_vms: Option<Vec<VmId>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InventoryReport {
    pub devices: Vec<PciDevice>,
    /// The CPUs and memory the node has for VMs. Absent from agents that cannot tell (and
    /// from older agents): placement then leaves the node's vCPUs and memory unchecked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostResources>,
    /// The Linux bridges the node has, by name: placement puts a VM only where every one
    /// of its networks' bridges is. Absent from agents that cannot tell (and older ones):
    /// such a node gets no VM with a network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridges: Option<Vec<String>>,
}

/// More bridges than any node has; a report beyond this is refused.
pub const MAX_BRIDGES: usize = 1024;

/// More CPUs than any machine has; a report beyond this is refused.
pub const MAX_HOST_CPUS: u32 = 1 << 16;
/// 64 PiB: beyond any machine.
pub const MAX_HOST_MEMORY_MIB: u64 = 1 << 36;

/// Most NUMA nodes accepted (Linux's `MAX_NUMNODES` is at most 1024).
pub const MAX_NUMA_NODES: usize = 1024;
/// Most huge page sizes accepted per NUMA node (x86 has two, arm64 four).
pub const MAX_HUGEPAGE_POOLS: usize = 8;
/// Longest CPU list accepted (`0-63,128-191`): a kernel writes at most a page.
pub const MAX_CPU_LIST_LEN: usize = 4096;

/// What a node has besides its devices, as its kernel counts it: online CPUs, the
/// memory of all its NUMA nodes, and (from newer agents) what a VM launch and NUMA-aware
/// placement need to know of the machine.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostResources {
    pub cpus: u32,
    pub memory_mib: u64,
    /// The CPUs' physical address width (`/proc/cpuinfo`'s `address sizes`): a guest
    /// whose BARs sit above it cannot reach them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address_bits: Option<u8>,
    /// Each NUMA node's CPUs, memory and huge pages, by node number.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub numa: Vec<NumaNode>,
    /// The CPUs the agent keeps for the host (a kernel CPU list): no vCPU is pinned to
    /// them, so placement does not count them.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reserved_cpus: String,
}

/// One NUMA node as `devices/system/node/node<N>` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NumaNode {
    pub node: u32,
    /// Its CPUs as a kernel CPU list (`0-15,64-79`); empty for a node with memory only.
    #[serde(default)]
    pub cpus: String,
    /// Its `MemTotal`.
    pub memory_mib: u64,
    /// Its huge page pools, by page size.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hugepages: Vec<HugepagePool>,
}

/// The huge pages of one size on one NUMA node (`hugepages-<size>kB/nr_hugepages` and
/// `free_hugepages`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HugepagePool {
    pub size_kib: u64,
    pub total: u64,
    pub free: u64,
}

/// What the control plane keeps and shows of a node's [`HostResources`] beyond its CPU
/// and memory totals (which placement counts and `resources` shows).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HostFacts {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address_bits: Option<u8>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub numa: Vec<NumaNode>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reserved_cpus: String,
}

impl HostFacts {
    pub fn is_empty(&self) -> bool {
        self.address_bits.is_none() && self.numa.is_empty() && self.reserved_cpus.is_empty()
    }
}

/// The CPUs of a kernel CPU list (`0-63`, `0,2-5,8`), sorted, each once; empty for an
/// empty list; `None` for anything else, including CPU numbers from [`MAX_HOST_CPUS`] on.
pub fn parse_cpu_list(list: &str) -> Option<Vec<u32>> {
    let list = list.trim();
    if list.len() > MAX_CPU_LIST_LEN {
        return None;
    }
    if list.is_empty() {
        return Some(Vec::new());
    }
    let mut out = Vec::new();
    for part in list.split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?),
            None => {
                let n = part.parse::<u32>().ok()?;
                (n, n)
            }
        };
        // Overlapping ranges could otherwise make a short list expand without bound.
        if hi < lo
            || hi >= MAX_HOST_CPUS
            || out.len() + (hi - lo) as usize >= MAX_HOST_CPUS as usize
        {
            return None;
        }
        out.extend(lo..=hi);
    }
    out.sort_unstable();
    out.dedup();
    Some(out)
}

/// Counts the CPUs of a kernel CPU list; `None` for an empty or malformed one (see
/// [`parse_cpu_list`]).
pub fn count_cpu_list(list: &str) -> Option<u32> {
    let n = u32::try_from(parse_cpu_list(list)?.len()).ok()?;
    (1..=MAX_HOST_CPUS).contains(&n).then_some(n)
}

impl HostResources {
    /// Refuses counts no machine has; names the field that is wrong.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(1..=MAX_HOST_CPUS).contains(&self.cpus) {
            return Err(("host.cpus", format!("must be 1 to {MAX_HOST_CPUS}")));
        }
        if !(1..=MAX_HOST_MEMORY_MIB).contains(&self.memory_mib) {
            return Err((
                "host.memory_mib",
                format!("must be 1 to {MAX_HOST_MEMORY_MIB}"),
            ));
        }
        if let Some(bits) = self.address_bits
            && !(32..=64).contains(&bits)
        {
            return Err(("host.address_bits", "must be 32 to 64".into()));
        }
        if self.numa.len() > MAX_NUMA_NODES {
            return Err(("host.numa", format!("at most {MAX_NUMA_NODES} nodes")));
        }
        if !self.reserved_cpus.is_empty() && parse_cpu_list(&self.reserved_cpus).is_none() {
            return Err(("host.reserved_cpus", "is not a CPU list".into()));
        }
        let mut nodes = std::collections::BTreeSet::new();
        for n in &self.numa {
            if n.node as usize >= MAX_NUMA_NODES || !nodes.insert(n.node) {
                return Err((
                    "host.numa",
                    format!(
                        "node {} is listed twice or not below {MAX_NUMA_NODES}",
                        n.node
                    ),
                ));
            }
            if !n.cpus.is_empty() && count_cpu_list(&n.cpus).is_none() {
                return Err((
                    "host.numa",
                    format!("node {}: cpus is not a CPU list", n.node),
                ));
            }
            if n.memory_mib > MAX_HOST_MEMORY_MIB {
                return Err((
                    "host.numa",
                    format!("node {}: memory_mib above {MAX_HOST_MEMORY_MIB}", n.node),
                ));
            }
            if n.hugepages.len() > MAX_HUGEPAGE_POOLS {
                return Err((
                    "host.numa",
                    format!(
                        "node {}: at most {MAX_HUGEPAGE_POOLS} huge page sizes",
                        n.node
                    ),
                ));
            }
            let mut sizes = std::collections::BTreeSet::new();
            for h in &n.hugepages {
                let kib = h
                    .total
                    .checked_mul(h.size_kib)
                    .filter(|k| *k / 1024 <= MAX_HOST_MEMORY_MIB);
                let ok = h.size_kib.is_power_of_two()
                    && h.size_kib >= 4
                    && h.free <= h.total
                    && kib.is_some()
                    && sizes.insert(h.size_kib);
                if !ok {
                    return Err((
                        "host.numa",
                        format!(
                            "node {}: huge pages of {} KiB: a size that is no power of two, \
                             listed twice, more free than total, or more than any machine",
                            n.node, h.size_kib
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The facts the control plane keeps beyond the totals.
    pub fn facts(&self) -> HostFacts {
        HostFacts {
            address_bits: self.address_bits,
            numa: self.numa.clone(),
            reserved_cpus: self.reserved_cpus.clone(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSpec {
    pub uuid: VmId,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub devices: Vec<DevicePath>,
    /// The boot disk; absent for VMs made before images (they boot nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskSpec>,
    /// Its network interfaces, in the guest's order (the primary first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nics: Vec<NicSpec>,
    /// What the guest's cloud-init reads from its NoCloud seed; absent for VMs made before
    /// seeds (they get none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<CloudInitSpec>,
    /// The firmware to boot; absent (older servers): [`crate::images::Bootrom::for_vm`]
    /// with no image requirement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootrom: Option<crate::images::Bootrom>,
}

/// NICs a VM may have at most.
pub const MAX_NICS: usize = 8;

/// One network interface of a VM: a tap on the node's `bridge` (tagged `vlan_id` when not
/// 0), seen by the guest as a virtio-net device with `mac`, configured (through the seed's
/// network-config) with `ip`/`prefix_len`, the default route via `gateway` when this is the
/// primary NIC, and `resolvers`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicSpec {
    /// Six lower-case hex octets joined by ':' (see [`crate::networks::parse_mac`]).
    pub mac: String,
    pub ip: std::net::Ipv4Addr,
    pub prefix_len: u8,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<std::net::Ipv4Addr>,
    #[serde(default)]
    pub resolvers: Vec<std::net::IpAddr>,
    pub bridge: String,
    /// 0: untagged.
    #[serde(default)]
    pub vlan_id: u16,
    pub mtu: u32,
    pub primary: bool,
}

impl NicSpec {
    /// Refuses what no node could build; names the field that is wrong.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        crate::networks::parse_mac(&self.mac).map_err(|e| ("mac", e))?;
        if !(1..=32).contains(&self.prefix_len) {
            return Err(("prefix_len", "must be 1 to 32".into()));
        }
        crate::networks::check_bridge(&self.bridge).map_err(|e| ("bridge", e.message))?;
        if self.vlan_id > crate::networks::MAX_VLAN_ID {
            return Err((
                "vlan_id",
                format!("must be 0 to {}", crate::networks::MAX_VLAN_ID),
            ));
        }
        if !(crate::networks::MIN_MTU..=crate::networks::MAX_MTU).contains(&self.mtu) {
            return Err((
                "mtu",
                format!(
                    "must be {} to {}",
                    crate::networks::MIN_MTU,
                    crate::networks::MAX_MTU
                ),
            ));
        }
        if self.resolvers.len() > crate::networks::MAX_RESOLVERS {
            return Err((
                "resolvers",
                format!("at most {}", crate::networks::MAX_RESOLVERS),
            ));
        }
        Ok(())
    }
}

/// What the node writes into a VM's NoCloud seed (a read-only `cidata` volume), besides
/// the network-config it derives from the NICs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudInitSpec {
    /// meta-data's `local-hostname`: the VM's alias.
    pub hostname: String,
    /// The owner's public keys, in OpenSSH's one-line form.
    #[serde(default)]
    pub ssh_authorized_keys: Vec<String>,
    /// The tenant's `user-data` metadata, merged with the keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<String>,
    /// The tenant's `user-script` metadata: run once at first boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_script: Option<String>,
    /// The other metadata keys, as given.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// What the node's metadata service (169.254.169.254) tells a guest about itself, as it is
/// now: `GET /agent/v1/vms/{uuid}/guest`, answered only for a VM placed on the calling node.
/// The node falls back on the VM's spec ([`CloudInitSpec`]) while the server cannot answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestMetadata {
    pub uuid: VmId,
    /// The owning account (OpenStack's `project_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_uuid: Option<crate::ids::AccountId>,
    /// The VM's alias.
    pub hostname: String,
    #[serde(default)]
    pub tags: crate::tags::Tags,
    /// The tenant's metadata, `user-data` and `user-script` included.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// The keys the VM was given, by name; absent for a VM made before keys could be
    /// chosen (its seed's keys stand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<Vec<GuestKey>>,
}

/// One of a VM's keys, named as its owner named it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestKey {
    pub name: String,
    /// OpenSSH's one-line form.
    pub key: String,
}

/// An image file as the node fetches and caches it: named by its digest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageRef {
    pub sha256: Sha256,
    /// Bytes.
    pub size: u64,
    #[serde(rename = "type")]
    pub image_type: ImageType,
}

/// A VM's boot disk: an overlay on the cached image, grown to the package's size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskSpec {
    pub image: ImageRef,
    pub size_gib: u64,
}

/// How far a long task (an image download) has come; the server shows it on the job step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskProgress {
    pub done: u64,
    pub total: u64,
}

/// Work for one agent. Every task is idempotent on the agent: run twice, same result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Task {
    /// Reserve the devices for passthrough (vfio-pci on Linux) and remember the binding.
    /// vGPU slots among them are made as vGPUs of the type named here (the driver's id
    /// or name), by slot path.
    BindPassthrough {
        vm_uuid: VmId,
        devices: Vec<DevicePath>,
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        vgpu_types: BTreeMap<String, String>,
    },
    /// Give the devices back to the driver they had before; vGPU slots among them are
    /// destroyed if their vGPU is still this VM's.
    UnbindPassthrough {
        vm_uuid: VmId,
        devices: Vec<DevicePath>,
    },
    StartVm {
        vm: VmSpec,
    },
    /// Stop the VM at once (a power cut); a VM that is not running is already stopped.
    StopVm {
        vm_uuid: VmId,
    },
    /// Ask the guest to shut down (the ACPI power button), wait up to `grace_s` seconds
    /// for it, then end the VM as `stop_vm` does; the result's
    /// [`TaskResult::shutdown`] says which happened. Sent only to an agent that said it
    /// runs it ([`TASKS_RUN`] on its poll).
    ShutdownVm {
        vm_uuid: VmId,
        grace_s: u32,
    },
    /// Bring the VM's image into the node's cache (download and verify it unless it is
    /// there and whole) and make the VM's boot disk on it unless the disk exists.
    FetchImage {
        vm_uuid: VmId,
        disk: DiskSpec,
    },
    /// Delete the VM's boot disk; a disk that is not there is already deleted.
    DeleteDisk {
        vm_uuid: VmId,
    },
    /// A destroyed VM's work on its node in one task, as `stop_vm`, then
    /// `unbind_passthrough` of `devices`, then `delete_disk` when `delete_disk`; the first
    /// part that fails ends it, and its error names that part. Sent only to an agent that
    /// said it runs it ([`TASKS_RUN`] on its poll).
    DestroyVm {
        vm_uuid: VmId,
        devices: Vec<DevicePath>,
        #[serde(default)]
        delete_disk: bool,
    },
    /// A new or stopped VM's work on its node in one task, as `bind_passthrough` of the
    /// spec's devices (vGPU slots made as `vgpu_types` names), then `fetch_image` of its
    /// disk when it has one, then `start_vm`; the first part that fails ends it, and its
    /// error names that part. Sent only to an agent that said it runs it ([`TASKS_RUN`]
    /// on its poll).
    BootVm {
        vm: VmSpec,
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        vgpu_types: BTreeMap<String, String>,
    },
    /// Answer the last [`MAX_CONSOLE_BYTES`] of the VM's serial console (in
    /// [`TaskResult::console`]); empty for a VM that never printed.
    ReadConsole {
        vm_uuid: VmId,
    },
    /// Open the VM's serial port for a tenant's interactive console: dial back a websocket
    /// to the server's `GET /agent/v1/console/{session}` (with the node's credential) and
    /// copy bytes both ways between it and the serial port until either side closes. The
    /// result is sent once both are open (or either could not be); the copying goes on
    /// after it. Sent only to an agent that said it runs it ([`TASKS_RUN`] on its poll).
    AttachConsole {
        vm_uuid: VmId,
        /// The server's name for this session: [`CONSOLE_SESSION_LEN`] lowercase hex
        /// digits, unguessable, good for one dial within seconds.
        session: String,
    },
    /// Make the function have `num_vfs` SR-IOV virtual functions (its `sriov_numvfs`),
    /// taking down those it has first when the count differs. Refused while one of its
    /// VFs is passed through to a VM.
    SetVfs {
        function: DevicePath,
        num_vfs: u32,
    },
    /// Clean devices a VM had, each step reported.
    Scrub {
        devices: Vec<DevicePath>,
        /// The steps for each device (by its path); a device not named here gets the
        /// agent's default for its class. Steps run in order; the first failure stops
        /// that device's pipeline.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        pipelines: BTreeMap<String, Vec<ScrubAction>>,
    },
}

/// One step of a scrub pipeline (configured per variant on the control plane).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "action", rename_all = "snake_case", deny_unknown_fields)]
pub enum ScrubAction {
    /// Function-level reset through sysfs `reset`; where the device lacks FLR, a secondary
    /// bus reset of its parent bridge (`reset_method` / the bridge's `reset`).
    Reset {},
    /// `nvidia-smi --gpu-reset -i BDF` when nvidia-smi is installed; reported as skipped
    /// when it is not.
    NvidiaReset {},
    /// An operator's command; `{bdf}` and `{path}` in the arguments are replaced by the
    /// device's address and sysfs path. Fails on a non-zero exit or after `timeout_secs`.
    Command {
        #[schema(min_items = 1, max_items = 32)]
        argv: Vec<String>,
        #[serde(default)]
        #[schema(minimum = 1, maximum = 3600)]
        timeout_secs: Option<u64>,
    },
    /// Zero the GPU's memory and read it back (NVIDIA, needs the zeroing helper and CUDA
    /// on the node); where either is absent it fails, reported as skipped.
    ZeroGpuMemory {},
    /// For NVMe: wipe partition tables and ZFS labels on the controller's namespaces so the
    /// host never imports a tenant's pool.
    WipeNvmeLabels {},
    /// Check the device is still present and bound as before.
    VerifyDriver {},
}

pub const MAX_SCRUB_STEPS: usize = 16;

impl Task {
    /// [`Task::DestroyVm`]'s name, as [`TASKS_RUN`] says it.
    pub const DESTROY_VM: &str = "destroy_vm";
    /// [`Task::BootVm`]'s name, as [`TASKS_RUN`] says it.
    pub const BOOT_VM: &str = "boot_vm";
    // The names of the tasks that are parts of those two, as their errors name them.
    pub const BIND_PASSTHROUGH: &str = "bind_passthrough";
    pub const UNBIND_PASSTHROUGH: &str = "unbind_passthrough";
    pub const FETCH_IMAGE: &str = "fetch_image";
    pub const START_VM: &str = "start_vm";
    pub const STOP_VM: &str = "stop_vm";
    /// [`Task::ShutdownVm`]'s name, as [`TASKS_RUN`] says it.
    pub const SHUTDOWN_VM: &str = "shutdown_vm";
    pub const DELETE_DISK: &str = "delete_disk";
    /// [`Task::AttachConsole`]'s name, as [`TASKS_RUN`] says it.
    pub const ATTACH_CONSOLE: &str = "attach_console";

    pub fn name(&self) -> &'static str {
        match self {
            Task::BindPassthrough { .. } => Self::BIND_PASSTHROUGH,
            Task::UnbindPassthrough { .. } => Self::UNBIND_PASSTHROUGH,
            Task::StartVm { .. } => Self::START_VM,
            Task::StopVm { .. } => Self::STOP_VM,
            Task::ShutdownVm { .. } => Self::SHUTDOWN_VM,
            Task::FetchImage { .. } => Self::FETCH_IMAGE,
            Task::DeleteDisk { .. } => Self::DELETE_DISK,
            Task::DestroyVm { .. } => Self::DESTROY_VM,
            Task::BootVm { .. } => Self::BOOT_VM,
            Task::ReadConsole { .. } => "read_console",
            Task::AttachConsole { .. } => Self::ATTACH_CONSOLE,
            Task::SetVfs { .. } => "set_vfs",
            Task::Scrub { .. } => "scrub",
        }
    }
}

/// The task kinds beyond protocol 1's first set that an agent runs, as it names them on
/// each poll (`GET /agent/v1/tasks?wait=N&runs=destroy_vm,boot_vm`), comma-separated: an
/// agent that does not name a kind is never sent one (it could not read the poll's
/// answer).
pub const TASKS_RUN: &str = "destroy_vm,boot_vm,shutdown_vm,attach_console";

/// The kinds [`TASKS_RUN`] may name, each a bit of [`LaterTasks`].
pub const LATER_TASKS: [&str; 4] = [
    Task::DESTROY_VM,
    Task::BOOT_VM,
    Task::SHUTDOWN_VM,
    Task::ATTACH_CONSOLE,
];

/// The length of an [`Task::AttachConsole`] session's name: 32 random bytes in hex.
pub const CONSOLE_SESSION_LEN: usize = 64;

/// Whether `s` is a session name as [`Task::AttachConsole`] carries one (and so safe in a
/// URL path).
pub fn is_console_session(s: &str) -> bool {
    s.len() == CONSOLE_SESSION_LEN && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The later task kinds ([`LATER_TASKS`]) an agent said it runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaterTasks(u8);

impl LaterTasks {
    /// Reads a poll's `runs`; kinds this build does not know are passed over.
    pub fn parse(runs: &str) -> Self {
        let mut bits = 0u8;
        for kind in runs.split(',') {
            if let Some(i) = LATER_TASKS.iter().position(|k| *k == kind.trim()) {
                bits |= 1 << i;
            }
        }
        LaterTasks(bits)
    }

    /// Whether `kind` (a task's [`Task::name`]) is among them.
    pub fn has(self, kind: &str) -> bool {
        LATER_TASKS
            .iter()
            .position(|k| *k == kind)
            .is_some_and(|i| self.0 & (1 << i) != 0)
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskEnvelope {
    pub id: TaskId,
    pub task: Task,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ScrubStep {
    pub name: String,
    pub ok: bool,
    pub duration_ms: u64,
    #[serde(default)]
    pub detail: Option<String>,
    /// The step could not run here (no nvidia-smi, no CUDA). `ok` says whether the
    /// device is clean without it: true for a vendor reset passed over, false for GPU
    /// memory zeroing (the node cannot clear the GPU, which is then quarantined).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScrubReport {
    pub device: DevicePath,
    pub ok: bool,
    pub steps: Vec<ScrubStep>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskResult {
    pub ok: bool,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub scrub_reports: Vec<ScrubReport>,
    /// Functions the task changed (their driver, after a bind or an unbind), as read
    /// after it, so the server need not wait for a whole inventory.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<PciDevice>,
    /// A `read_console`'s answer: the console's last bytes, as UTF-8 (invalid sequences
    /// replaced), at most [`MAX_CONSOLE_BYTES`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub console: Option<String>,
    /// A `shutdown_vm`'s answer: how the VM ended. Only ever in the answer to a task an
    /// older server never sends, so its strict parse never meets it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown: Option<Shutdown>,
}

/// How a `shutdown_vm` ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case", deny_unknown_fields)]
pub enum Shutdown {
    /// The guest shut itself down, this long after it was asked.
    GuestShutDown { after_ms: u64 },
    /// The guest was asked and did not shut down within its grace: powered off.
    TimedOut { grace_s: u32 },
    /// The guest could not be asked (its QEMU did not answer QMP): powered off.
    NotAsked { reason: String },
    /// The VM was not running: nothing to shut down.
    NotRunning,
}

impl Shutdown {
    /// What a job step says of it.
    pub fn describe(&self) -> String {
        match self {
            Shutdown::GuestShutDown { after_ms } => {
                format!("guest shut down after {} s", after_ms.div_ceil(1000))
            }
            Shutdown::TimedOut { grace_s } => {
                format!("guest did not shut down within {grace_s} s: powered off")
            }
            Shutdown::NotAsked { reason } => {
                format!("guest could not be asked to shut down ({reason}): powered off")
            }
            Shutdown::NotRunning => "the VM was not running".to_string(),
        }
    }
}

/// The longest grace a `shutdown_vm` is given, whatever a task says.
pub const MAX_SHUTDOWN_GRACE_S: u32 = 3600;

/// How much of a VM's serial console a node keeps and answers: its last 64 KiB.
pub const MAX_CONSOLE_BYTES: usize = 64 * 1024;

impl TaskResult {
    pub fn success() -> Self {
        TaskResult {
            ok: true,
            error: None,
            scrub_reports: Vec::new(),
            devices: Vec::new(),
            console: None,
            shutdown: None,
        }
    }
    pub fn failure(msg: impl Into<String>) -> Self {
        let mut m: String = msg.into();
        if m.len() > MAX_ERROR_LEN {
            let mut cut = MAX_ERROR_LEN;
            while !m.is_char_boundary(cut) {
                cut -= 1;
            }
            m.truncate(cut);
        }
        TaskResult {
            ok: false,
            error: Some(m),
            scrub_reports: Vec::new(),
            devices: Vec::new(),
            console: None,
            shutdown: None,
        }
    }
}

/// Results a node posts together, at most this many.
pub const MAX_RESULTS_PER_POST: usize = 32;

/// `POST tasks/results`: the results of several of the node's tasks. Each is recorded or
/// refused on its own, as if posted alone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskResults {
    pub results: Vec<TaskOutcome>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskOutcome {
    pub task: TaskId,
    pub result: TaskResult,
}

/// The answer to [`TaskResults`]: the results not recorded, each with the error it would
/// have had alone (the rest are recorded), and with `?wait=` the node's next tasks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskResultsAnswer {
    #[serde(default)]
    pub refused: Vec<RefusedResult>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<Vec<TaskEnvelope>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusedResult {
    pub task: TaskId,
    pub error: crate::ApiErrorBody,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatResponse {
    pub server_uuid: ServerId,
}

crate::redact::debug_redacting!(RegisterRequest { hostname, agent_version, protocol_version } secret { join_token });
crate::redact::debug_redacting!(RegisterResponse { server_uuid } secret { credential });

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> HostResources {
        HostResources {
            cpus: 64,
            memory_mib: 512 * 1024,
            address_bits: Some(46),
            numa: (0..2)
                .map(|n| NumaNode {
                    node: n,
                    cpus: format!("{}-{}", n * 32, n * 32 + 31),
                    memory_mib: 256 * 1024,
                    hugepages: vec![
                        HugepagePool {
                            size_kib: 2048,
                            total: 512,
                            free: 500,
                        },
                        HugepagePool {
                            size_kib: 1 << 20,
                            total: 0,
                            free: 0,
                        },
                    ],
                })
                .collect(),
            reserved_cpus: String::new(),
        }
    }

    #[test]
    fn host_facts_are_optional_and_bounded() {
        // An older agent's report: totals only, and it serialises back unchanged.
        let old = serde_json::json!({"cpus": 8, "memory_mib": 4096});
        let h: HostResources = serde_json::from_value(old.clone()).unwrap();
        assert!(h.validate().is_ok() && h.facts().is_empty());
        assert_eq!(serde_json::to_value(&h).unwrap(), old);

        let h = host();
        assert!(h.validate().is_ok());
        let json = serde_json::to_value(&h).unwrap();
        assert_eq!(json["address_bits"], 46);
        assert_eq!(json["numa"][1]["cpus"], "32-63");
        assert_eq!(json["numa"][0]["hugepages"][0]["size_kib"], 2048);
        assert_eq!(
            serde_json::from_value::<HostResources>(json.clone()).unwrap(),
            h
        );
        let facts = h.facts();
        assert_eq!(facts.numa.len(), 2);
        assert_eq!(
            serde_json::from_value::<HostFacts>(serde_json::to_value(&facts).unwrap()).unwrap(),
            facts
        );
        let mut bad = json;
        bad["numa"][0]["colour"] = "green".into();
        assert!(serde_json::from_value::<HostResources>(bad).is_err());

        // A memory-only node (CXL) has no CPUs.
        let mut cxl = host();
        cxl.numa[1].cpus = String::new();
        assert!(cxl.validate().is_ok());

        let breaks: [&dyn Fn(&mut HostResources); 10] = [
            &|h| h.address_bits = Some(31),
            &|h| h.address_bits = Some(65),
            &|h| h.numa[1].node = 0,
            &|h| h.numa[1].node = MAX_NUMA_NODES as u32,
            &|h| h.numa[0].cpus = "0-".into(),
            &|h| h.numa[0].memory_mib = MAX_HOST_MEMORY_MIB + 1,
            &|h| h.numa[0].hugepages[0].free = 513,
            &|h| h.numa[0].hugepages[0].size_kib = 3000,
            &|h| h.numa[0].hugepages[1].size_kib = 2048,
            &|h| h.numa[0].hugepages[0].total = u64::MAX,
        ];
        for (i, b) in breaks.iter().enumerate() {
            let mut h = host();
            b(&mut h);
            assert!(h.validate().is_err(), "case {i}: {h:?}");
        }
        let mut many = host();
        many.numa[0].hugepages = (0..=MAX_HUGEPAGE_POOLS as u32)
            .map(|i| HugepagePool {
                size_kib: 4 << i,
                total: 0,
                free: 0,
            })
            .collect();
        assert!(many.validate().is_err());
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(count_cpu_list("0-63\n"), Some(64));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("0,2-5,8"), Some(6));
        for bad in ["", "-", "5-3", "a", "0-", "0,,1", "0-70000", "1-2-3"] {
            assert_eq!(count_cpu_list(bad), None, "{bad:?}");
        }
        assert_eq!(count_cpu_list(&"1,".repeat(3000)), None);
        assert_eq!(count_cpu_list(&"0-65535,".repeat(400)), None);
    }

    #[test]
    fn scrub_steps_refuse_unknown_fields() {
        let ok: Vec<ScrubAction> =
            serde_json::from_str(r#"[{"action":"reset"},{"action":"verify_driver"}]"#).unwrap();
        assert_eq!(ok, [ScrubAction::Reset {}, ScrubAction::VerifyDriver {}]);
        assert_eq!(
            serde_json::to_string(&ok).unwrap(),
            r#"[{"action":"reset"},{"action":"verify_driver"}]"#
        );
        for bad in [
            r#"{"action":"verify_driver","x":1}"#,
            r#"{"action":"reset","argv":["a"]}"#,
            r#"{"action":"command","argv":["a"],"x":1}"#,
        ] {
            assert!(serde_json::from_str::<ScrubAction>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tasks_are_tagged_and_strict() {
        let t = Task::StopVm {
            vm_uuid: VmId::new_random(),
        };
        let v = serde_json::to_value(&t).unwrap();
        assert_eq!(v["type"], "stop_vm");
        assert_eq!(serde_json::from_value::<Task>(v).unwrap(), t);
        assert!(serde_json::from_str::<Task>(r#"{"type":"format_disk"}"#).is_err());
        assert!(
            serde_json::from_str::<TaskResult>(r#"{"ok":true,"extra":1}"#).is_err(),
            "unknown fields are refused"
        );
    }

    /// An older agent's result (no `shutdown`) still parses; a newer one's round-trips.
    #[test]
    fn shutdown_results_old_and_new() {
        let old: TaskResult = serde_json::from_str(r#"{"ok":true,"error":null}"#).unwrap();
        assert_eq!(old.shutdown, None);
        assert!(
            !serde_json::to_string(&TaskResult::success())
                .unwrap()
                .contains("shutdown"),
            "absent unless asked, so an older server's strict parse never meets it"
        );
        let r = TaskResult {
            shutdown: Some(Shutdown::GuestShutDown { after_ms: 11_200 }),
            ..TaskResult::success()
        };
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains(r#""outcome":"guest_shut_down""#), "{text}");
        assert_eq!(serde_json::from_str::<TaskResult>(&text).unwrap(), r);
        assert_eq!(r.shutdown.unwrap().describe(), "guest shut down after 12 s");
        assert_eq!(
            Shutdown::TimedOut { grace_s: 60 }.describe(),
            "guest did not shut down within 60 s: powered off"
        );
        let t = Task::ShutdownVm {
            vm_uuid: VmId::new_random(),
            grace_s: 60,
        };
        let v = serde_json::to_value(&t).unwrap();
        assert_eq!(v["type"], "shutdown_vm");
        assert_eq!(serde_json::from_value::<Task>(v).unwrap(), t);
    }

    #[test]
    fn later_tasks_are_read_from_a_poll() {
        let all = LaterTasks::parse(TASKS_RUN);
        for k in LATER_TASKS {
            assert!(all.has(k), "{k}");
        }
        let one = LaterTasks::parse("boot_vm,format_disk");
        assert!(one.has("boot_vm"));
        assert!(!one.has("destroy_vm"));
        assert!(!one.has("format_disk"), "unknown kinds are passed over");
        assert!(LaterTasks::parse("").is_empty());
        assert!(!LaterTasks::parse(TASKS_RUN).has("stop_vm"));
    }

    #[test]
    fn a_console_session_is_hex_of_one_length_only() {
        let ok = "0123456789abcdef".repeat(4);
        assert!(is_console_session(&ok));
        assert!(!is_console_session(&ok[1..]));
        assert!(!is_console_session(&ok.to_uppercase()));
        assert!(!is_console_session(&format!("{}/", &ok[1..])));
        let t = Task::AttachConsole {
            vm_uuid: VmId::new_random(),
            session: ok,
        };
        let v = serde_json::to_value(&t).unwrap();
        assert_eq!(v["type"], "attach_console");
        assert_eq!(serde_json::from_value::<Task>(v).unwrap(), t);
    }

    #[test]
    fn long_errors_are_cut_on_a_char_boundary() {
        let r = TaskResult::failure("é".repeat(MAX_ERROR_LEN));
        assert!(r.error.unwrap().len() <= MAX_ERROR_LEN);
    }
}
