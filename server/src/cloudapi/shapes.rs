//! CloudAPI's objects, built from Passage's views: field names, units (MiB) and states
//! as sdc-cloudapi's `docs/index.md` gives them and the `triton` CLI reads them.

use chrono::{DateTime, SecondsFormat, Utc};
use passage_model::api::{Account, Package, Vm, VmState};
use passage_model::images::{Image, ImageState};
use passage_model::keys::SshKey;
use passage_model::networks::Network;
use serde::Serialize;
use std::collections::BTreeMap;

fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

const MIB_PER_GIB: u64 = 1024;

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CloudAccount {
    pub id: String,
    pub login: String,
    pub email: String,
    pub created: String,
    pub updated: String,
}

impl From<&Account> for CloudAccount {
    fn from(a: &Account) -> Self {
        CloudAccount {
            id: a.uuid.to_string(),
            login: a.login.clone(),
            // Passage keeps no e-mail address.
            email: String::new(),
            created: time(a.created_at),
            updated: time(a.created_at),
        }
    }
}

#[derive(Serialize)]
pub struct CloudKey {
    pub name: String,
    /// CloudAPI names keys by their MD5 fingerprint.
    pub fingerprint: String,
    pub key: String,
    pub created: String,
}

impl From<SshKey> for CloudKey {
    fn from(k: SshKey) -> Self {
        CloudKey {
            name: k.name,
            fingerprint: k.md5_fingerprint,
            key: k.key,
            created: time(k.created_at),
        }
    }
}

#[derive(Serialize)]
pub struct CloudPackage {
    pub id: String,
    pub name: String,
    pub memory: u64,
    pub disk: u64,
    pub swap: u64,
    pub vcpus: u32,
    pub lwps: u32,
    pub version: &'static str,
    pub group: &'static str,
    pub description: String,
    pub default: bool,
    /// RFD 114: the devices of each variant a VM of this package gets.
    pub devices: BTreeMap<String, u32>,
}

impl From<&Package> for CloudPackage {
    fn from(p: &Package) -> Self {
        let gpus: u32 = p.devices.values().sum();
        CloudPackage {
            id: p.uuid.to_string(),
            name: p.name.clone(),
            memory: p.memory_mib,
            disk: p.disk_gib * MIB_PER_GIB,
            // No swap is configured in the guest beyond its memory.
            swap: p.memory_mib,
            vcpus: p.vcpus,
            lwps: 4000,
            version: "1.0.0",
            group: if gpus > 0 { "gpu" } else { "" },
            description: format!(
                "{} vCPUs, {} MiB memory, {} GiB disk{}",
                p.vcpus,
                p.memory_mib,
                p.disk_gib,
                p.devices
                    .iter()
                    .map(|(v, n)| format!(", {n} × {v}"))
                    .collect::<String>()
            ),
            default: false,
            devices: p.devices.clone(),
        }
    }
}

#[derive(Serialize)]
pub struct CloudImage {
    pub id: String,
    pub name: String,
    pub version: String,
    pub os: String,
    /// IMGAPI's type for a hardware VM's disk image.
    #[serde(rename = "type")]
    pub image_type: &'static str,
    pub state: &'static str,
    pub public: bool,
    pub owner: String,
    pub description: String,
    pub published_at: Option<String>,
    pub tags: BTreeMap<String, String>,
    pub requirements: serde_json::Value,
    pub files: Vec<serde_json::Value>,
}

impl From<&Image> for CloudImage {
    fn from(i: &Image) -> Self {
        let mut requirements = serde_json::Map::new();
        if let Some(min) = i.requirements.min_disk_gib {
            requirements.insert("min_disk".into(), (min * MIB_PER_GIB).into());
        }
        if let Some(bootrom) = i.requirements.bootrom {
            requirements.insert("bootrom".into(), bootrom.as_str().into());
        }
        CloudImage {
            id: i.uuid.to_string(),
            name: i.name.clone(),
            version: i.version.clone(),
            os: i.os.clone(),
            image_type: "zvol",
            state: match i.state {
                ImageState::Active => "active",
                ImageState::Unactivated => "unactivated",
                ImageState::Disabled => "disabled",
                ImageState::Failed => "failed",
            },
            public: i.public,
            owner: i.owner_uuid.to_string(),
            description: i.description.clone().unwrap_or_default(),
            published_at: i.published_at.map(time),
            tags: i.tags.clone(),
            requirements: requirements.into(),
            files: match (&i.sha256, i.size) {
                (Some(sha), Some(size)) => vec![serde_json::json!({
                    "sha256": sha.to_string(),
                    "size": size,
                    "compression": "none",
                })],
                _ => Vec::new(),
            },
        }
    }
}

#[derive(Serialize)]
pub struct CloudNetwork {
    pub id: String,
    pub name: String,
    pub public: bool,
    pub fabric: bool,
    pub description: String,
    pub subnet: String,
    pub provision_start_ip: String,
    pub provision_end_ip: String,
    pub gateway: Option<String>,
    pub resolvers: Vec<String>,
    pub vlan_id: u16,
    pub mtu: u32,
}

impl From<&Network> for CloudNetwork {
    fn from(n: &Network) -> Self {
        CloudNetwork {
            id: n.uuid.to_string(),
            name: n.name.clone(),
            public: n.public,
            fabric: false,
            description: n.description.clone().unwrap_or_default(),
            subnet: n.subnet.clone(),
            provision_start_ip: n.provision_start_ip.to_string(),
            provision_end_ip: n.provision_end_ip.to_string(),
            gateway: n.gateway.map(|g| g.to_string()),
            resolvers: n.resolvers.iter().map(ToString::to_string).collect(),
            vlan_id: n.vlan_id,
            mtu: n.mtu,
        }
    }
}

/// A VM's state as CloudAPI names it (sdc-cloudapi `lib/machines.js` `translateState`).
pub fn machine_state(s: VmState) -> &'static str {
    match s {
        VmState::Provisioning => "provisioning",
        VmState::Running => "running",
        VmState::Stopping => "stopping",
        VmState::Stopped => "stopped",
        // A destroy stops the VM first; the machine reads `deleted` once it is gone.
        VmState::Destroying => "stopping",
        VmState::Destroyed => "deleted",
        VmState::Failed => "failed",
    }
}

/// The VM states a CloudAPI state filter means; `None` for a name CloudAPI does not use.
pub fn states_named(s: &str) -> Option<&'static [VmState]> {
    Some(match s {
        "provisioning" => &[VmState::Provisioning],
        "running" => &[VmState::Running],
        "stopping" => &[VmState::Stopping, VmState::Destroying],
        "stopped" => &[VmState::Stopped],
        "deleted" => &[VmState::Destroyed],
        "failed" => &[VmState::Failed],
        _ => return None,
    })
}

#[derive(Serialize)]
pub struct Machine {
    pub id: String,
    pub name: String,
    #[serde(rename = "type")]
    pub machine_type: &'static str,
    pub brand: &'static str,
    pub state: &'static str,
    pub image: Option<String>,
    pub ips: Vec<String>,
    pub memory: u64,
    pub disk: u64,
    pub vcpus: u32,
    pub metadata: BTreeMap<String, String>,
    pub tags: passage_model::tags::Tags,
    pub created: String,
    pub updated: String,
    pub docker: bool,
    pub firewall_enabled: bool,
    pub deletion_protection: bool,
    pub networks: Vec<String>,
    #[serde(rename = "primaryIp")]
    pub primary_ip: Option<String>,
    /// The package's name, as CloudAPI gives it.
    pub package: String,
    pub compute_node: Option<String>,
    /// RFD 114: the PCI devices passed through to it.
    pub assigned_devices: Vec<String>,
    /// How many devices it holds.
    pub gpus: usize,
}

/// A VM as a CloudAPI machine; `packages` gives its package's name and disk.
pub fn machine(vm: &Vm, packages: &BTreeMap<passage_model::PackageId, Package>) -> Machine {
    let package = vm.package_uuid.and_then(|p| packages.get(&p));
    let mut networks: Vec<String> = Vec::new();
    for n in &vm.nics {
        let id = n.network_uuid.to_string();
        if !networks.contains(&id) {
            networks.push(id);
        }
    }
    Machine {
        id: vm.uuid.to_string(),
        name: vm.alias.clone(),
        machine_type: "virtualmachine",
        brand: "kvm",
        state: machine_state(vm.state),
        image: vm.image_uuid.map(|i| i.to_string()),
        ips: vm.nics.iter().map(|n| n.ip.to_string()).collect(),
        memory: vm.memory_mib,
        disk: package.map_or(0, |p| p.disk_gib * MIB_PER_GIB),
        vcpus: vm.vcpus,
        metadata: vm.metadata.clone(),
        tags: vm.tags.clone(),
        created: time(vm.created_at),
        updated: time(vm.updated_at),
        docker: false,
        firewall_enabled: false,
        deletion_protection: false,
        networks,
        primary_ip: vm.primary_ip.map(|i| i.to_string()),
        package: package.map_or_else(String::new, |p| p.name.clone()),
        compute_node: vm.server_uuid.map(|s| s.to_string()),
        assigned_devices: vm
            .assigned_devices
            .iter()
            .map(ToString::to_string)
            .collect(),
        gpus: vm.assigned_devices.len(),
    }
}
