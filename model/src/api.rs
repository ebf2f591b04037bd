//! The views and parameters of the public `/v1` API (see CONTRACT.md).
//!
//! Views are what clients see; the store's row types never leave the server.

use crate::decode::BodyError;
use crate::ids::{AccountId, JobId, PackageId, ServerId, VmId};
use crate::pci::{DevicePath, HexId, PciAddress, PciClass, Revision};
use crate::state::DeviceState;
use crate::variant::DeviceType;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;

// The bounds of the request bodies. Each request type's `validate()` applies them; its
// `#[schema]` attributes state them to the OpenAPI document, in literals (utoipa takes
// no constants there), and `tests::the_schemas_state_the_bounds_validate_applies` holds
// the two equal.
pub const MAX_LOGIN_LEN: usize = 64;
pub const MAX_PASSWORD_LEN: usize = 1024;
pub const MIN_PASSWORD_LEN: usize = 8;
/// The most GPUs an account's quota may name.
pub const MAX_GPU_QUOTA: u32 = 100_000;
/// A package's name, in characters.
pub const MAX_NAME_LEN: usize = 128;
pub const MIN_VCPUS: u32 = 1;
pub const MAX_VCPUS: u32 = 1024;
pub const MIN_MEMORY_MIB: u64 = 64;
pub const MAX_MEMORY_MIB: u64 = 16 * 1024 * 1024;
pub const MAX_DISK_GIB: u64 = 1024 * 1024;
pub const MAX_PACKAGE_DEVICE_KINDS: usize = 16;
pub const MAX_DEVICES_PER_VM: u32 = 16;
pub const MAX_ALIAS_LEN: usize = 64;
pub const MAX_LIST_LIMIT: u32 = 1000;
/// An image as `POST /v1/vms` names it (`name@version` at most).
pub const MAX_IMAGE_KEY_LEN: usize = 256;

fn check_password(pw: &str) -> Result<(), BodyError> {
    let n = pw.chars().count();
    if !(MIN_PASSWORD_LEN..=MAX_PASSWORD_LEN).contains(&n) {
        return Err(BodyError::new(
            "password",
            format!("must be {MIN_PASSWORD_LEN} to {MAX_PASSWORD_LEN} characters"),
        ));
    }
    Ok(())
}

fn check_quota(q: Option<u32>) -> Result<(), BodyError> {
    if q.is_some_and(|q| q > MAX_GPU_QUOTA) {
        return Err(BodyError::new(
            "gpu_quota",
            format!("must be at most {MAX_GPU_QUOTA}"),
        ));
    }
    Ok(())
}

fn check_vcpus(vcpus: u32) -> Result<(), BodyError> {
    if !(MIN_VCPUS..=MAX_VCPUS).contains(&vcpus) {
        return Err(BodyError::new(
            "vcpus",
            format!("must be {MIN_VCPUS} to {MAX_VCPUS}"),
        ));
    }
    Ok(())
}

fn check_memory(memory_mib: u64) -> Result<(), BodyError> {
    if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&memory_mib) {
        return Err(BodyError::new(
            "memory_mib",
            format!("must be {MIN_MEMORY_MIB} to {MAX_MEMORY_MIB}"),
        ));
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Operator,
    /// A read-only operator.
    Reader,
    Tenant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Operator => "operator",
            Role::Reader => "reader",
            Role::Tenant => "tenant",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "operator" => Role::Operator,
            "reader" => Role::Reader,
            "tenant" => Role::Tenant,
            _ => return None,
        })
    }
    /// Sees every object (operators and readers).
    pub fn sees_all(self) -> bool {
        matches!(self, Role::Operator | Role::Reader)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Account {
    pub uuid: AccountId,
    pub login: String,
    pub role: Role,
    pub gpu_quota: Option<u32>,
    pub created_at: DateTime<Utc>,
}

#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateAccount {
    #[schema(min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9_.@-]+$")]
    pub login: String,
    #[schema(min_length = 8, max_length = 1024, pattern = "^[^\\x00]*$")]
    pub password: String,
    #[serde(default = "default_role")]
    pub role: Role,
    #[serde(default)]
    #[schema(maximum = 100000)]
    pub gpu_quota: Option<u32>,
}

fn default_role() -> Role {
    Role::Tenant
}

impl CreateAccount {
    /// The first field out of bounds, if any.
    pub fn validate(&self) -> Result<(), BodyError> {
        let login_ok = !self.login.is_empty()
            && self.login.len() <= MAX_LOGIN_LEN
            && self
                .login
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'@'));
        if !login_ok {
            return Err(BodyError::new(
                "login",
                format!(
                    "must be 1 to {MAX_LOGIN_LEN} characters of A-Z, a-z, 0-9, '_', '-', '.', '@'"
                ),
            ));
        }
        if is_reserved_login(&self.login) {
            return Err(BodyError::new(
                "login",
                format!(
                    "{:?} is reserved: CloudAPI serves each account at /LOGIN, beside the \
                     server's own paths ({})",
                    self.login,
                    RESERVED_LOGINS.join(", ")
                ),
            ));
        }
        check_password(&self.password)?;
        check_quota(self.gpu_quota)
    }
}

/// The first path segments the server itself answers (the API, the agent API, metrics,
/// the portal's pages and files): CloudAPI answers `/LOGIN/…` at the root too, so no
/// account may be named like one of them.
pub const RESERVED_LOGINS: &[&str] = &[
    "v1",
    "agent",
    "metrics",
    "--ping",
    "login",
    "admin",
    "instances",
    "keys",
    "pkg",
    "portal",
    "favicon.ico",
    "openapi.json",
];

/// Whether `login` is one of [`RESERVED_LOGINS`], in any case.
pub fn is_reserved_login(login: &str) -> bool {
    RESERVED_LOGINS
        .iter()
        .any(|r| r.eq_ignore_ascii_case(login))
}

/// `Some(None)` when the field is present and null, `None` when absent.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateAccount {
    #[serde(default)]
    #[schema(min_length = 8, max_length = 1024, pattern = "^[^\\x00]*$")]
    pub password: Option<String>,
    #[serde(default)]
    pub role: Option<Role>,
    /// `null` removes the quota.
    #[serde(default, deserialize_with = "present")]
    #[schema(maximum = 100000)]
    pub gpu_quota: Option<Option<u32>>,
}

impl UpdateAccount {
    /// The first field out of bounds, if any.
    pub fn validate(&self) -> Result<(), BodyError> {
        if let Some(pw) = &self.password {
            check_password(pw)?;
        }
        check_quota(self.gpu_quota.flatten())
    }
}

#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LoginRequest {
    #[schema(pattern = "^[^\\x00]*$")]
    pub login: String,
    #[schema(pattern = "^[^\\x00]*$")]
    pub password: String,
}

#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LoginResponse {
    pub token: String,
    pub expires_at: DateTime<Utc>,
    pub account: Account,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Ping {
    pub ok: bool,
    pub version: String,
}

/// How placement chooses among servers that fit.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum PlacementPolicy {
    /// Fill a server before the next (CloudStack's DFS): keeps whole servers free for
    /// big requests.
    #[default]
    Pack,
    /// Put each VM where the most is free (CloudStack's BFS): spreads load and risk.
    Spread,
}

impl PlacementPolicy {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pack" => Some(PlacementPolicy::Pack),
            "spread" => Some(PlacementPolicy::Spread),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            PlacementPolicy::Pack => "pack",
            PlacementPolicy::Spread => "spread",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Package {
    pub uuid: PackageId,
    pub name: String,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub disk_gib: u64,
    pub devices: BTreeMap<String, u32>,
    /// `null`: the server's default policy.
    pub placement: Option<PlacementPolicy>,
    /// How long a clean stop waits for the guest to shut down before it powers the VM
    /// off; `null`: [`DEFAULT_STOP_GRACE_S`]. The server caps it with its own limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_grace_s: Option<u32>,
    pub created_at: DateTime<Utc>,
}

/// A clean stop's wait for the guest when its package names none.
pub const DEFAULT_STOP_GRACE_S: u32 = 60;
/// The longest wait for a guest a package may name (the server may cap it lower).
pub const MAX_STOP_GRACE_S: u32 = 3600;

/// The optional body of `POST /v1/vms/{uuid}/stop` and `/reboot`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StopVm {
    /// Power the VM off at once instead of asking the guest to shut down first.
    #[serde(default)]
    pub force: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreatePackage {
    #[schema(
        min_length = 1,
        max_length = 128,
        pattern = "^[^\\x00-\\x1f\\x7f-\\x9f]*[^\\s\\x00-\\x1f\\x7f-\\x9f][^\\x00-\\x1f\\x7f-\\x9f]*$"
    )]
    pub name: String,
    #[schema(minimum = 1, maximum = 1024)]
    pub vcpus: u32,
    #[schema(minimum = 64, maximum = 16777216)]
    pub memory_mib: u64,
    #[serde(default)]
    #[schema(maximum = 1048576)]
    pub disk_gib: u64,
    #[serde(default)]
    pub devices: BTreeMap<String, u32>,
    #[serde(default)]
    pub placement: Option<PlacementPolicy>,
    /// Seconds a clean stop waits for the guest (at most [`MAX_STOP_GRACE_S`]); absent:
    /// [`DEFAULT_STOP_GRACE_S`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(maximum = 3600)]
    pub stop_grace_s: Option<u32>,
}

/// Why a body naming other objects was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A field out of bounds.
    Invalid(BodyError),
    /// A field names an object that does not exist.
    Missing(BodyError),
}

impl From<BodyError> for Refusal {
    fn from(e: BodyError) -> Self {
        Refusal::Invalid(e)
    }
}

impl CreatePackage {
    /// The first field out of bounds, or the first variant `variant_exists` does not know,
    /// in the order the API has always judged them: the name, the sizes, how many
    /// variants; then each variant named, whether it exists before how many of it are
    /// asked; then the total.
    pub fn validate(&self, variant_exists: impl Fn(&str) -> bool) -> Result<(), Refusal> {
        let name_ok = !self.name.trim().is_empty()
            && self.name.chars().count() <= MAX_NAME_LEN
            && !self.name.chars().any(char::is_control);
        if !name_ok {
            return Err(BodyError::new(
                "name",
                format!("must be 1 to {MAX_NAME_LEN} printable characters"),
            )
            .into());
        }
        if self.name.parse::<uuid::Uuid>().is_ok() {
            return Err(BodyError::new(
                "name",
                "must not be a uuid (packages are looked up by uuid or name)",
            )
            .into());
        }
        check_vcpus(self.vcpus)?;
        check_memory(self.memory_mib)?;
        if self.stop_grace_s.is_some_and(|g| g > MAX_STOP_GRACE_S) {
            return Err(BodyError::new(
                "stop_grace_s",
                format!("must be at most {MAX_STOP_GRACE_S}"),
            )
            .into());
        }
        if self.disk_gib > MAX_DISK_GIB {
            return Err(
                BodyError::new("disk_gib", format!("must be at most {MAX_DISK_GIB}")).into(),
            );
        }
        if self.devices.len() > MAX_PACKAGE_DEVICE_KINDS {
            return Err(BodyError::new(
                "devices",
                format!("at most {MAX_PACKAGE_DEVICE_KINDS} variants"),
            )
            .into());
        }
        let mut total = 0u32;
        for (variant, count) in &self.devices {
            let field = format!("devices.{variant}");
            if !variant_exists(variant) {
                return Err(Refusal::Missing(BodyError::new(field, "no such variant")));
            }
            if *count == 0 {
                return Err(BodyError::new(field, "count must be at least 1").into());
            }
            total = total.saturating_add(*count);
        }
        if total > MAX_DEVICES_PER_VM {
            return Err(BodyError::new(
                "devices",
                format!("at most {MAX_DEVICES_PER_VM} devices per VM"),
            )
            .into());
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ServerStatus {
    Running,
    Unknown,
    Offline,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SysinfoDevice {
    pub vendor: HexId,
    pub device: HexId,
    pub subsystem: HexId,
    pub subvendor: HexId,
    pub revision: Revision,
    pub class: PciClass,
    pub id: DevicePath,
    /// `-` when no driver is bound, as in RFD 114.
    pub driver: String,
    pub numa_node: Option<u32>,
    pub iommu_group: Option<u32>,
    pub used_by: Option<VmId>,
    /// Names, PCIe link, slot, AER counters, IOMMU group members, as the agent saw them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<crate::pci::PciDetails>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Sysinfo {
    #[serde(rename = "PCI Devices")]
    pub pci_devices: Vec<SysinfoDevice>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AssignableDevice {
    pub id: DevicePath,
    pub state: DeviceState,
    #[serde(rename = "type")]
    pub kind: DeviceType,
    pub variant: String,
    pub used_by: Option<VmId>,
    pub numa_node: Option<u32>,
    /// Why the device is kept out of placement although its state allows it (for
    /// example: held, then missing from the agent's latest report).
    pub taint: Option<String>,
    /// Its variant's scrub policy: `reset-only` GPUs go back to the pool with their memory
    /// not cleared.
    #[serde(default)]
    pub scrub_policy: crate::variant::ScrubPolicy,
    /// Why it is in its state where the state alone does not say: why it was quarantined
    /// ("cn-7 cannot clear GPU memory: passage-gpu-zero not found"), or that its last
    /// scrub left its memory uncleared by the operator's choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_reason: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ServerVm {
    pub uuid: VmId,
    pub owner_uuid: AccountId,
    pub state: VmState,
    pub brand: String,
    pub assigned_devices: Vec<DevicePath>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Server {
    pub uuid: ServerId,
    pub hostname: String,
    pub status: ServerStatus,
    pub last_heartbeat: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    /// Drained by an operator: no new placements; running VMs are untouched.
    pub disabled: bool,
    /// Every reported PCI function; absent from a `brief` list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sysinfo: Option<Sysinfo>,
    /// How many of its assignable devices are in each state (states with none left out).
    #[serde(default)]
    pub device_counts: BTreeMap<DeviceState, u32>,
    /// The devices that match a variant; absent from a `brief` list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assignable_devices: Option<Vec<AssignableDevice>>,
    /// The VMs on the server; absent from a `brief` list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vms: Option<BTreeMap<VmId, ServerVm>>,
    /// Its vCPUs and memory for VMs; absent until its agent reports them (placement then
    /// leaves them unchecked on this server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ServerResources>,
    /// What its agent last reported of the machine (address width, NUMA nodes and their
    /// huge pages); absent until an agent that reads them reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<crate::protocol::HostFacts>,
}

/// What a server can give VMs besides devices, and what its VMs (all but destroyed and
/// failed ones) hold: the reported CPUs times the allocation ratio, and the reported
/// memory less the host's reserve.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ServerResources {
    pub vcpus_total: i64,
    pub vcpus_used: i64,
    pub memory_total_mib: i64,
    pub memory_used_mib: i64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateServer {
    #[serde(default)]
    #[schema(min_length = 1, max_length = 253, pattern = "^[A-Za-z0-9._-]+$")]
    pub hostname: Option<String>,
    /// `true` drains the server (no new placements), `false` puts it back in service.
    #[serde(default)]
    pub disabled: Option<bool>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateJoinToken {
    /// How long the token admits a node; default one hour, at most a week.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 604800)]
    pub ttl_secs: Option<u64>,
    /// Re-admit this known server (after its credential was revoked or lost): it keeps
    /// its identity, devices and VMs.
    #[serde(default)]
    pub server_uuid: Option<ServerId>,
}

#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JoinToken {
    pub token: String,
    pub expires_at: DateTime<Utc>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    Provisioning,
    Running,
    /// Its guest was asked to shut down and the VM is not stopped yet.
    Stopping,
    Stopped,
    Destroying,
    Destroyed,
    Failed,
}

impl VmState {
    pub fn as_str(self) -> &'static str {
        match self {
            VmState::Provisioning => "provisioning",
            VmState::Running => "running",
            VmState::Stopping => "stopping",
            VmState::Stopped => "stopped",
            VmState::Destroying => "destroying",
            VmState::Destroyed => "destroyed",
            VmState::Failed => "failed",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "provisioning" => VmState::Provisioning,
            "running" => VmState::Running,
            "stopping" => VmState::Stopping,
            "stopped" => VmState::Stopped,
            "destroying" => VmState::Destroying,
            "destroyed" => VmState::Destroyed,
            "failed" => VmState::Failed,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Vm {
    pub uuid: VmId,
    pub alias: String,
    pub owner_uuid: AccountId,
    pub server_uuid: Option<ServerId>,
    pub package_uuid: Option<PackageId>,
    pub state: VmState,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub assigned_devices: Vec<DevicePath>,
    pub job_uuid: Option<JobId>,
    /// The image its boot disk was made from (`null` for VMs made before images).
    #[serde(default)]
    pub image_uuid: Option<crate::ids::ImageId>,
    /// Its network interfaces, the primary first.
    #[serde(default)]
    pub nics: Vec<crate::networks::Nic>,
    /// The primary NIC's address.
    #[serde(default)]
    #[schema(value_type = Option<String>, format = Ipv4)]
    pub primary_ip: Option<std::net::Ipv4Addr>,
    /// Its tags.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub tags: crate::tags::Tags,
    /// The owner's SSH keys it was given at creation (its seed's authorized keys); null for
    /// a VM made before keys could be chosen, whose guest gets the owner's keys as they
    /// are at each start.
    #[serde(default)]
    pub keys: Option<Vec<crate::keys::VmKey>>,
    /// Its metadata for the guest, as given at creation.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    pub created_at: DateTime<Utc>,
    /// When its row last changed (state, devices, server).
    pub updated_at: DateTime<Utc>,
}

/// The end of a VM's serial console, as its node keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VmConsole {
    pub vm_uuid: VmId,
    /// The last 64 KiB at most, as UTF-8 (invalid bytes replaced).
    pub output: String,
    pub read_at: DateTime<Utc>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVm {
    #[schema(min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9_.-]+$")]
    pub alias: String,
    /// A package uuid or name.
    #[serde(default)]
    pub package: Option<String>,
    /// The image to boot: a uuid, `name@version`, or `name` (its newest active version).
    /// Required.
    #[serde(default)]
    #[schema(min_length = 1, max_length = 256)]
    pub image: Option<String>,
    /// Operators only: create on behalf of this account (default: the caller).
    #[serde(default)]
    pub owner_uuid: Option<AccountId>,
    /// Operators only, without a package: exactly these devices.
    #[serde(default)]
    #[schema(min_items = 1, max_items = 16)]
    pub assigned_devices: Option<Vec<DevicePath>>,
    /// Operators only, with `assigned_devices`: the server that has them.
    #[serde(default)]
    pub server_uuid: Option<ServerId>,
    /// Without a package: the VM's size (default 1 vCPU, 1024 MiB).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1024)]
    pub vcpus: Option<u32>,
    #[serde(default)]
    #[schema(minimum = 64, maximum = 16777216)]
    pub memory_mib: Option<u64>,
    /// The networks it gets an address on, the primary first. Absent: the networks marked
    /// default that the owner may use.
    #[serde(default)]
    #[schema(max_items = 8)]
    pub networks: Option<Vec<crate::networks::NetworkChoice>>,
    /// String keys and values for the guest: `user-data` (cloud-init's), `user-script`
    /// (run at first boot), and any others.
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
    /// Tags to find it by: string, number or boolean values.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tags: Option<crate::tags::Tags>,
    /// Which of the owner's SSH keys its guest trusts, each by name or fingerprint
    /// (`SHA256:…` or MD5). Absent: all of them.
    #[serde(default)]
    #[schema(max_items = 100)]
    pub keys: Option<Vec<String>>,
}

impl CreateVm {
    /// The first field out of bounds, if any: a VM comes either from a package (which
    /// sets its size and lets placement choose its server) or, for operators, from
    /// devices named outright on a server named with them.
    pub fn validate(&self) -> Result<(), BodyError> {
        let alias_ok = !self.alias.is_empty()
            && self.alias.len() <= MAX_ALIAS_LEN
            && self
                .alias
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
        if !alias_ok {
            return Err(BodyError::new(
                "alias",
                format!("must be 1 to {MAX_ALIAS_LEN} characters of A-Z, a-z, 0-9, '_', '-', '.'"),
            ));
        }
        match self.image.as_deref() {
            None => {
                return Err(BodyError::new(
                    "image",
                    "an image (uuid, name or name@version) is required",
                ));
            }
            Some(i) if i.is_empty() || i.len() > MAX_IMAGE_KEY_LEN => {
                return Err(BodyError::new(
                    "image",
                    format!("must be 1 to {MAX_IMAGE_KEY_LEN} characters"),
                ));
            }
            Some(_) => {}
        }
        if let Some(n) = &self.networks {
            crate::networks::check_choices("networks", n)?;
        }
        if let Some(m) = &self.metadata {
            crate::metadata::check("metadata", m)?;
        }
        if let Some(t) = &self.tags {
            crate::tags::check("tags", t)?;
        }
        if let Some(k) = &self.keys {
            crate::keys::check_choices("keys", k)?;
        }
        if self.package.is_some() && self.assigned_devices.is_some() {
            return Err(BodyError::new(
                "assigned_devices",
                "give either a package or assigned_devices, not both",
            ));
        }
        match &self.assigned_devices {
            Some(devices) => {
                if self.server_uuid.is_none() {
                    return Err(BodyError::new(
                        "server_uuid",
                        "required with assigned_devices",
                    ));
                }
                if devices.is_empty() || devices.len() > MAX_DEVICES_PER_VM as usize {
                    return Err(BodyError::new(
                        "assigned_devices",
                        format!("must list 1 to {MAX_DEVICES_PER_VM} devices"),
                    ));
                }
                if let Some(vcpus) = self.vcpus {
                    check_vcpus(vcpus)?;
                }
                if let Some(memory_mib) = self.memory_mib {
                    check_memory(memory_mib)?;
                }
            }
            None => {
                if self.package.is_none() {
                    return Err(BodyError::new(
                        "package",
                        "a package (uuid or name) is required",
                    ));
                }
                if self.server_uuid.is_some() {
                    return Err(BodyError::new(
                        "server_uuid",
                        "only with assigned_devices; packages are placed by the control plane",
                    ));
                }
                if self.vcpus.is_some() || self.memory_mib.is_some() {
                    return Err(BodyError::new(
                        "vcpus",
                        "the package sets vcpus and memory_mib",
                    ));
                }
            }
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Queued,
    Running,
    Succeeded,
    Failed,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "queued" => JobState::Queued,
            "running" => JobState::Running,
            "succeeded" => JobState::Succeeded,
            "failed" => JobState::Failed,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum StepState {
    Pending,
    Running,
    Succeeded,
    Failed,
    /// Its undo ran after a later step failed.
    Undone,
}

impl StepState {
    pub fn as_str(self) -> &'static str {
        match self {
            StepState::Pending => "pending",
            StepState::Running => "running",
            StepState::Succeeded => "succeeded",
            StepState::Failed => "failed",
            StepState::Undone => "undone",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => StepState::Pending,
            "running" => StepState::Running,
            "succeeded" => StepState::Succeeded,
            "failed" => StepState::Failed,
            "undone" => StepState::Undone,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobStep {
    pub name: String,
    pub state: StepState,
    pub started_at: Option<DateTime<Utc>>,
    pub ended_at: Option<DateTime<Utc>>,
    pub error: Option<String>,
    /// With `error`: whether the failure was `retryable` (retried within the step's time
    /// before the job gave up), `refused` (a rule, or the node said no) or `broken` (the
    /// control plane's own fault).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_kind: Option<crate::jobs::StepErrorKind>,
    /// How far the step's node task has come (an image download: bytes of total), as
    /// its agent last reported; kept after the step ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// What the step found, in words: how a stop ended ("guest shut down after 12 s",
    /// "guest did not shut down within 60 s: powered off", "forced power off").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Work done of a total (bytes, for an image download).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Progress {
    pub done: u64,
    pub total: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Job {
    pub uuid: JobId,
    pub name: String,
    pub vm_uuid: Option<VmId>,
    pub state: JobState,
    pub steps: Vec<JobStep>,
    pub created_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
    pub error: Option<String>,
}

/// A device's recorded state change: the history behind "dirty, then unassigned only
/// after its scrub report".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DeviceEventRecord {
    pub server_uuid: ServerId,
    pub device: DevicePath,
    pub from: DeviceState,
    pub to: DeviceState,
    pub reason: String,
    pub at: DateTime<Utc>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ScrubRecord {
    pub server_uuid: ServerId,
    pub device: DevicePath,
    pub ok: bool,
    pub steps: Vec<crate::protocol::ScrubStep>,
    pub at: DateTime<Utc>,
    /// The node task whose result carried this report (its payload names the pipeline
    /// the node was asked to run); absent on reports older than this field.
    pub task_uuid: Option<crate::ids::TaskId>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_account_tells_null_from_absent() {
        let a: UpdateAccount = serde_json::from_str(r#"{"gpu_quota":null}"#).unwrap();
        assert_eq!(a.gpu_quota, Some(None));
        let b: UpdateAccount = serde_json::from_str(r#"{}"#).unwrap();
        assert_eq!(b.gpu_quota, None);
        let c: UpdateAccount = serde_json::from_str(r#"{"gpu_quota":4}"#).unwrap();
        assert_eq!(c.gpu_quota, Some(Some(4)));
    }

    #[test]
    fn create_vm_refuses_unknown_fields() {
        assert!(serde_json::from_str::<CreateVm>(r#"{"alias":"a","pkg":"x"}"#).is_err());
        assert!(serde_json::from_str::<CreateVm>(r#"{"package":"x"}"#).is_err());
    }

    /// The field `validate` names, or `None` when it takes the value.
    fn refused(r: Result<(), BodyError>) -> Option<String> {
        r.err().map(|e| e.field)
    }

    fn account(login: &str, password: &str, gpu_quota: Option<u32>) -> CreateAccount {
        CreateAccount {
            login: login.into(),
            password: password.into(),
            role: Role::Tenant,
            gpu_quota,
        }
    }

    #[test]
    fn accounts_bounds_on_both_sides() {
        let pw = "p".repeat(MIN_PASSWORD_LEN);
        let ok = |a: CreateAccount| refused(a.validate());
        assert_eq!(ok(account("a", &pw, None)), None);
        assert_eq!(ok(account(&"a".repeat(MAX_LOGIN_LEN), &pw, None)), None);
        assert_eq!(ok(account("a.b_c-d@e", &pw, None)), None);
        for bad in [
            String::new(),
            "a".repeat(MAX_LOGIN_LEN + 1),
            "a b".into(),
            "é".into(),
        ] {
            assert_eq!(
                ok(account(&bad, &pw, None)).as_deref(),
                Some("login"),
                "{bad:?}"
            );
        }
        let short = "p".repeat(MIN_PASSWORD_LEN - 1);
        let long = "p".repeat(MAX_PASSWORD_LEN + 1);
        assert_eq!(ok(account("a", &short, None)).as_deref(), Some("password"));
        assert_eq!(ok(account("a", &long, None)).as_deref(), Some("password"));
        // Characters, not bytes.
        let wide = "é".repeat(MAX_PASSWORD_LEN);
        assert_eq!(ok(account("a", &wide, None)), None);
        assert_eq!(ok(account("a", &pw, Some(MAX_GPU_QUOTA))), None);
        assert_eq!(ok(account("a", &pw, Some(0))), None);
        assert_eq!(
            ok(account("a", &pw, Some(MAX_GPU_QUOTA + 1))).as_deref(),
            Some("gpu_quota")
        );

        let update = |password: Option<&str>, gpu_quota| UpdateAccount {
            password: password.map(String::from),
            role: None,
            gpu_quota,
        };
        assert_eq!(refused(update(None, None).validate()), None);
        assert_eq!(refused(update(Some(&pw), Some(None)).validate()), None);
        assert_eq!(
            refused(update(Some(&short), None).validate()).as_deref(),
            Some("password")
        );
        assert_eq!(
            refused(update(None, Some(Some(MAX_GPU_QUOTA))).validate()),
            None
        );
        assert_eq!(
            refused(update(None, Some(Some(MAX_GPU_QUOTA + 1))).validate()).as_deref(),
            Some("gpu_quota")
        );
    }

    fn package() -> CreatePackage {
        CreatePackage {
            name: "gpu-1x".into(),
            vcpus: MIN_VCPUS,
            memory_mib: MIN_MEMORY_MIB,
            disk_gib: 0,
            devices: BTreeMap::new(),
            placement: None,
            stop_grace_s: None,
        }
    }

    #[test]
    fn a_packages_stop_grace_is_bounded() {
        let ok = |g| CreatePackage {
            stop_grace_s: Some(g),
            ..package()
        };
        assert!(ok(0).validate(|_| true).is_ok());
        assert!(ok(MAX_STOP_GRACE_S).validate(|_| true).is_ok());
        assert!(matches!(
            ok(MAX_STOP_GRACE_S + 1).validate(|_| true),
            Err(Refusal::Invalid(e)) if e.field == "stop_grace_s"
        ));
    }

    #[test]
    fn packages_bounds_on_both_sides() {
        let with = |f: &dyn Fn(&mut CreatePackage)| {
            let mut p = package();
            f(&mut p);
            match p.validate(|_| true) {
                Ok(()) => None,
                Err(Refusal::Invalid(e)) => Some(e.field),
                Err(Refusal::Missing(e)) => panic!("{e}"),
            }
        };
        assert_eq!(with(&|_| {}), None);
        assert_eq!(with(&|p| p.name = "n".repeat(MAX_NAME_LEN)), None);
        assert_eq!(with(&|p| p.name = "é".repeat(MAX_NAME_LEN)), None);
        for bad in [
            String::new(),
            "  ".into(),
            "n".repeat(MAX_NAME_LEN + 1),
            "a\nb".into(),
            "0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44".into(),
        ] {
            assert_eq!(with(&|p| p.name = bad.clone()).as_deref(), Some("name"));
        }
        assert_eq!(with(&|p| p.vcpus = MAX_VCPUS), None);
        for bad in [MIN_VCPUS - 1, MAX_VCPUS + 1] {
            assert_eq!(with(&|p| p.vcpus = bad).as_deref(), Some("vcpus"));
        }
        assert_eq!(with(&|p| p.memory_mib = MAX_MEMORY_MIB), None);
        for bad in [MIN_MEMORY_MIB - 1, MAX_MEMORY_MIB + 1] {
            assert_eq!(with(&|p| p.memory_mib = bad).as_deref(), Some("memory_mib"));
        }
        assert_eq!(with(&|p| p.disk_gib = MAX_DISK_GIB), None);
        assert_eq!(
            with(&|p| p.disk_gib = MAX_DISK_GIB + 1).as_deref(),
            Some("disk_gib")
        );
        let kinds = |n: usize| (0..n).map(|i| (format!("V{i}"), 1)).collect();
        assert_eq!(with(&|p| p.devices = kinds(MAX_PACKAGE_DEVICE_KINDS)), None);
        assert_eq!(
            with(&|p| p.devices = kinds(MAX_PACKAGE_DEVICE_KINDS + 1)).as_deref(),
            Some("devices")
        );
        let one = |n: u32| [("V".to_string(), n)].into();
        assert_eq!(with(&|p| p.devices = one(MAX_DEVICES_PER_VM)), None);
        assert_eq!(
            with(&|p| p.devices = one(MAX_DEVICES_PER_VM + 1)).as_deref(),
            Some("devices")
        );
        assert_eq!(with(&|p| p.devices = one(0)).as_deref(), Some("devices.V"));
        // The total counts, not each variant's share; a huge one does not wrap around.
        let two = |a: u32, b: u32| [("A".to_string(), a), ("B".to_string(), b)].into();
        assert_eq!(with(&|p| p.devices = two(8, 8)), None);
        assert_eq!(with(&|p| p.devices = two(8, 9)).as_deref(), Some("devices"));
        assert_eq!(
            with(&|p| p.devices = two(u32::MAX, u32::MAX)).as_deref(),
            Some("devices")
        );
    }

    /// A variant no one defined is answered as missing, after the bounds of the fields
    /// before `devices` and before the counts of the variants after it.
    #[test]
    fn packages_name_unknown_variants_in_order() {
        let known = |v: &str| v == "A";
        let mut p = package();
        p.devices = [("A".to_string(), 1), ("B".to_string(), 0)].into();
        assert_eq!(
            p.validate(known),
            Err(Refusal::Missing(BodyError::new(
                "devices.B",
                "no such variant"
            )))
        );
        p.devices = [("A".to_string(), 0), ("B".to_string(), 1)].into();
        assert!(matches!(p.validate(known), Err(Refusal::Invalid(e)) if e.field == "devices.A"));
        p.devices = [("A".to_string(), 9), ("B".to_string(), 9)].into();
        assert!(matches!(p.validate(known), Err(Refusal::Missing(_))));
        p.vcpus = 0;
        assert!(matches!(p.validate(known), Err(Refusal::Invalid(e)) if e.field == "vcpus"));
        p.vcpus = 1;
        p.devices = [("A".to_string(), 1)].into();
        assert_eq!(p.validate(known), Ok(()));
    }

    fn vm_from_devices(n: usize) -> CreateVm {
        let device: DevicePath = "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0"
            .parse()
            .unwrap();
        CreateVm {
            alias: "vm".into(),
            package: None,
            image: Some("debian".into()),
            owner_uuid: None,
            assigned_devices: Some(vec![device; n]),
            server_uuid: Some(ServerId::new_random()),
            vcpus: None,
            memory_mib: None,
            networks: None,
            metadata: None,
            tags: None,
            keys: None,
        }
    }

    fn vm_from_package() -> CreateVm {
        CreateVm {
            assigned_devices: None,
            server_uuid: None,
            package: Some("gpu-1x".into()),
            ..vm_from_devices(1)
        }
    }

    #[test]
    fn vms_bounds_on_both_sides() {
        let devices = |f: &dyn Fn(&mut CreateVm)| {
            let mut v = vm_from_devices(1);
            f(&mut v);
            refused(v.validate())
        };
        let packaged = |f: &dyn Fn(&mut CreateVm)| {
            let mut v = vm_from_package();
            f(&mut v);
            refused(v.validate())
        };
        assert_eq!(devices(&|_| {}), None);
        assert_eq!(packaged(&|_| {}), None);
        assert_eq!(
            packaged(&|v| v.keys = Some(vec!["a".into(), "SHA256:x".into()])),
            None
        );
        assert_eq!(
            packaged(&|v| v.keys = Some(vec!["a".into(), String::new()])),
            Some("keys[1]".into())
        );
        assert_eq!(
            packaged(&|v| v.keys = Some(vec!["a".into(), "a".into()])),
            Some("keys[1]".into())
        );
        assert_eq!(packaged(&|v| v.alias = "a".repeat(MAX_ALIAS_LEN)), None);
        for bad in [String::new(), "a".repeat(MAX_ALIAS_LEN + 1), "a@b".into()] {
            assert_eq!(
                packaged(&|v| v.alias = bad.clone()).as_deref(),
                Some("alias")
            );
        }
        assert_eq!(
            vm_from_devices(MAX_DEVICES_PER_VM as usize).validate(),
            Ok(())
        );
        for n in [0, MAX_DEVICES_PER_VM as usize + 1] {
            assert_eq!(
                refused(vm_from_devices(n).validate()).as_deref(),
                Some("assigned_devices")
            );
        }
        assert_eq!(devices(&|v| v.vcpus = Some(MIN_VCPUS)), None);
        assert_eq!(devices(&|v| v.vcpus = Some(MAX_VCPUS)), None);
        for bad in [MIN_VCPUS - 1, MAX_VCPUS + 1] {
            assert_eq!(devices(&|v| v.vcpus = Some(bad)).as_deref(), Some("vcpus"));
        }
        assert_eq!(devices(&|v| v.memory_mib = Some(MIN_MEMORY_MIB)), None);
        assert_eq!(devices(&|v| v.memory_mib = Some(MAX_MEMORY_MIB)), None);
        for bad in [MIN_MEMORY_MIB - 1, MAX_MEMORY_MIB + 1] {
            assert_eq!(
                devices(&|v| v.memory_mib = Some(bad)).as_deref(),
                Some("memory_mib")
            );
        }
        // Which fields go with which.
        assert_eq!(
            devices(&|v| v.server_uuid = None).as_deref(),
            Some("server_uuid")
        );
        assert_eq!(
            devices(&|v| v.package = Some("p".into())).as_deref(),
            Some("assigned_devices")
        );
        assert_eq!(packaged(&|v| v.package = None).as_deref(), Some("package"));
        assert_eq!(
            packaged(&|v| v.server_uuid = Some(ServerId::new_random())).as_deref(),
            Some("server_uuid")
        );
        assert_eq!(packaged(&|v| v.vcpus = Some(2)).as_deref(), Some("vcpus"));
        assert_eq!(
            packaged(&|v| v.memory_mib = Some(2048)).as_deref(),
            Some("vcpus")
        );
    }

    /// `#[schema]` attributes take literals only: the bounds they state to the OpenAPI
    /// document are the ones `validate` applies.
    #[test]
    fn the_schemas_state_the_bounds_validate_applies() {
        use serde_json::{Value, json};
        use utoipa::PartialSchema;
        fn props(schema: utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>) -> Value {
            serde_json::to_value(schema).unwrap()["properties"].clone()
        }
        let account = props(CreateAccount::schema());
        let update = props(UpdateAccount::schema());
        let package = props(CreatePackage::schema());
        let vm = props(CreateVm::schema());
        let expect: [(&Value, &str, &str, Value); 19] = [
            (&account, "login", "minLength", json!(1)),
            (&account, "login", "maxLength", json!(MAX_LOGIN_LEN)),
            (&account, "password", "minLength", json!(MIN_PASSWORD_LEN)),
            (&account, "password", "maxLength", json!(MAX_PASSWORD_LEN)),
            (&account, "gpu_quota", "maximum", json!(MAX_GPU_QUOTA)),
            (&update, "password", "minLength", json!(MIN_PASSWORD_LEN)),
            (&update, "password", "maxLength", json!(MAX_PASSWORD_LEN)),
            (&update, "gpu_quota", "maximum", json!(MAX_GPU_QUOTA)),
            (&package, "name", "maxLength", json!(MAX_NAME_LEN)),
            (&package, "vcpus", "minimum", json!(MIN_VCPUS)),
            (&package, "vcpus", "maximum", json!(MAX_VCPUS)),
            (&package, "memory_mib", "minimum", json!(MIN_MEMORY_MIB)),
            (&package, "memory_mib", "maximum", json!(MAX_MEMORY_MIB)),
            (&package, "disk_gib", "maximum", json!(MAX_DISK_GIB)),
            (&vm, "alias", "maxLength", json!(MAX_ALIAS_LEN)),
            (
                &vm,
                "assigned_devices",
                "maxItems",
                json!(MAX_DEVICES_PER_VM),
            ),
            (&vm, "vcpus", "maximum", json!(MAX_VCPUS)),
            (&vm, "memory_mib", "minimum", json!(MIN_MEMORY_MIB)),
            (&vm, "memory_mib", "maximum", json!(MAX_MEMORY_MIB)),
        ];
        for (props, field, keyword, want) in expect {
            assert_eq!(props[field][keyword], want, "{field}.{keyword}: {props}");
        }
        assert_eq!(vm["vcpus"]["minimum"], json!(MIN_VCPUS));
        assert_eq!(vm["assigned_devices"]["minItems"], json!(1));
    }
}

#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ApiToken {
    pub uuid: uuid::Uuid,
    pub name: String,
    pub expires_at: DateTime<Utc>,
    /// The secret: present only in the answer to its creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateApiToken {
    #[schema(
        min_length = 1,
        max_length = 64,
        pattern = "^[^\\x00-\\x1f\\x7f-\\x9f]*[^\\s\\x00-\\x1f\\x7f-\\x9f][^\\x00-\\x1f\\x7f-\\x9f]*$"
    )]
    pub name: String,
    /// Lifetime; default 90 days, at most a year.
    #[serde(default)]
    #[schema(minimum = 60, maximum = 31536000)]
    pub ttl_secs: Option<u64>,
}

/// What an operator may do to one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeviceAction {
    /// Take an unassigned device out of service.
    Disable,
    /// Put a disabled device back in service.
    Enable,
    /// Keep a device away from tenants until someone has looked at it.
    Quarantine,
    /// Release a quarantined device after a check: it is scrubbed again before reuse.
    Requeue,
    /// Clear a health taint (AER errors, wrong driver) after a check.
    #[serde(rename = "clear_taint")]
    ClearTaint,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeviceActionRequest {
    pub device: DevicePath,
    pub action: DeviceAction,
    /// Why: recorded in the device's history.
    #[schema(min_length = 1, max_length = 512, pattern = "^[^\\x00]*\\S[^\\x00]*$")]
    pub reason: String,
}

/// One variant's devices across the fleet, by state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Capacity {
    pub variant: String,
    pub total: u64,
    /// Placeable now: unassigned, untainted, on a running server in service.
    pub free: u64,
    /// Provisioning or used.
    pub held: u64,
    pub unassigned: u64,
    pub provisioning: u64,
    pub used: u64,
    pub dirty: u64,
    pub cleaning: u64,
    pub quarantined: u64,
    pub disabled: u64,
    /// GPUs hosting vGPUs (not assignable whole).
    #[serde(default)]
    pub shared: u64,
    pub tainted: u64,
    /// For a vGPU variant: its slots as CloudStack counts them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu: Option<VgpuCapacity>,
}

/// A vGPU variant's capacity, fleet-wide and per server (CloudStack's `max_capacity` and
/// `remaining_capacity`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VgpuCapacity {
    pub parent: String,
    pub vgpu_type: String,
    pub max_per_gpu: u32,
    /// vGPUs of this type the fleet would host if every GPU of the parent variant that
    /// offers the type hosted only it (GPUs hosting another type count 0).
    pub max_capacity: u64,
    /// vGPUs of this type that could be created now: free slots on GPUs already in the
    /// type, plus the slots free whole GPUs would get, on servers up and in service.
    pub remaining_capacity: u64,
    /// Slots held by VMs (provisioning or used).
    pub in_use: u64,
    /// GPUs hosting this type now.
    pub gpus: u64,
    pub servers: Vec<VgpuServerCapacity>,
}

/// One server's share of a [`VgpuCapacity`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VgpuServerCapacity {
    pub server_uuid: ServerId,
    pub hostname: String,
    pub max_capacity: u64,
    pub remaining_capacity: u64,
    pub in_use: u64,
    pub gpus: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Alert {
    pub kind: String,
    pub message: String,
    pub variant: Option<String>,
    pub count: Option<u32>,
    pub at: DateTime<Utc>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct UsageRecord {
    pub vm_uuid: VmId,
    pub owner_uuid: AccountId,
    pub server_uuid: ServerId,
    pub device: DevicePath,
    pub variant: Option<String>,
    pub started_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
    /// Within the asked window.
    pub gpu_hours: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Usage {
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub gpu_hours: f64,
    pub by_variant: BTreeMap<String, f64>,
    pub records: Vec<UsageRecord>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AuditEntry {
    pub at: DateTime<Utc>,
    pub actor: Option<AccountId>,
    pub actor_login: Option<String>,
    pub method: String,
    pub path: String,
    pub status: u16,
    /// What the call changed where its method and path do not say (a variant's scrub
    /// policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PlacementDryRun {
    /// A package uuid or name.
    #[schema(min_length = 1, max_length = 128, pattern = "^[^\\x00]*$")]
    pub package: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ServerVerdict {
    pub uuid: ServerId,
    pub hostname: String,
    pub accepted: bool,
    /// Why a server was rejected (empty when accepted).
    pub reasons: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PlacementExplanation {
    pub server: Option<ServerId>,
    pub devices: Vec<DevicePath>,
    pub servers: Vec<ServerVerdict>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResizeVm {
    /// The new package (uuid or name).
    pub package: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MigrateVm {
    /// The server to move to; default: placement picks one.
    #[serde(default)]
    pub server_uuid: Option<ServerId>,
}

/// Whether a package can be had right now by the caller: what the self-service page
/// shows next to each package.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PackageAvailability {
    pub package: PackageId,
    /// Enough placeable devices on one running server.
    pub capacity_ok: bool,
    /// The caller's GPU quota has room for the package's devices.
    pub quota_ok: bool,
    /// Why not, when either is false.
    pub message: Option<String>,
}

/// One assignable device in the fleet-wide device list (`GET /v1/devices`): a device that
/// matches a variant, with the server it sits in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DeviceRow {
    pub id: DevicePath,
    pub server_uuid: ServerId,
    pub hostname: String,
    /// The function's PCI address (the last element of `id`).
    pub address: PciAddress,
    /// The variant it matches (always set in this list, which holds assignable devices
    /// only; nullable for lists to come).
    pub variant: Option<String>,
    pub state: DeviceState,
    pub used_by: Option<VmId>,
    pub numa_node: Option<u32>,
    /// The bound driver, null when none is.
    pub driver: Option<String>,
    pub vendor: HexId,
    pub device: HexId,
    /// Why the device is kept out of placement although its state allows it.
    pub taint: Option<String>,
    /// Its variant's scrub policy (see [`AssignableDevice::scrub_policy`]).
    #[serde(default)]
    pub scrub_policy: crate::variant::ScrubPolicy,
    /// Why it is in its state (see [`AssignableDevice::state_reason`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_reason: Option<String>,
}

crate::redact::debug_redacting!(CreateAccount { login, role, gpu_quota } secret { password });
crate::redact::debug_redacting!(UpdateAccount { role, gpu_quota } secret { password });
crate::redact::debug_redacting!(LoginRequest { login } secret { password });
crate::redact::debug_redacting!(LoginResponse { expires_at, account } secret { token });
crate::redact::debug_redacting!(JoinToken { expires_at } secret { token });
crate::redact::debug_redacting!(ApiToken { uuid, name, expires_at } secret { token });
