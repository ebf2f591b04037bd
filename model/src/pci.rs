//! PCI addresses, device paths and the RFD 114 description of one PCI function.
//!
//! Every parser here takes text from outside (sysfs, agents, API bodies) and returns an
//! error rather than panicking.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// Longest device path accepted: deeper than any real PCIe hierarchy.
pub const MAX_DEVICE_PATH_LEN: usize = 512;
/// Longest driver name accepted (Linux module names are far shorter).
pub const MAX_DRIVER_LEN: usize = 64;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PciParseError {
    #[error("PCI address {0:?} is not of the form DDDD:BB:DD.F")]
    Address(String),
    #[error("device path {0:?} is not of the form /devices/pciDDDD:BB/DDDD:BB:DD.F[/...]")]
    DevicePath(String),
    #[error("{what} {value:?} is not {digits} hexadecimal digits")]
    Hex {
        what: &'static str,
        value: String,
        digits: usize,
    },
    #[error("driver name {0:?} is empty, too long or has characters outside [A-Za-z0-9_.-]")]
    Driver(String),
    #[error("details: {0}")]
    Details(String),
}

/// A PCI function address, `0000:3b:00.0` (domain:bus:device.function).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddress {
    pub domain: u32,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

fn hex_exact(s: &str, min: usize, max: usize) -> Option<u32> {
    if s.len() < min || s.len() > max || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

impl FromStr for PciAddress {
    type Err = PciParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || PciParseError::Address(s.chars().take(64).collect());
        let (domain, rest) = s.split_once(':').ok_or_else(err)?;
        let (bus, rest) = rest.split_once(':').ok_or_else(err)?;
        let (device, function) = rest.split_once('.').ok_or_else(err)?;
        // Domains are 4 hex digits, or up to 8 behind Intel VMD.
        let domain = hex_exact(domain, 4, 8).ok_or_else(err)?;
        let bus = hex_exact(bus, 2, 2).ok_or_else(err)? as u8;
        let device = hex_exact(device, 2, 2).ok_or_else(err)? as u8;
        let function = hex_exact(function, 1, 1).ok_or_else(err)? as u8;
        if device > 0x1f || function > 7 {
            return Err(err());
        }
        Ok(PciAddress {
            domain,
            bus,
            device,
            function,
        })
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl PciAddress {
    /// bhyve's `B/S/F` slot notation.
    pub fn bsf(&self) -> String {
        format!("{}/{}/{}", self.bus, self.device, self.function)
    }
}

/// The physical path of a function under sysfs without the leading `/sys`:
/// `/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0`. Stable while the hardware stays.
///
/// A vGPU slot is named the way the kernel names a mediated device: its GPU's path and
/// the vGPU's UUID below it (`…/0000:3b:00.0/c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c8d`). The
/// control plane chooses the UUID when a GPU starts hosting vGPUs; for the vendor-VFIO
/// framework the node maps it onto one of the GPU's virtual functions.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePath {
    root: String,
    chain: Vec<PciAddress>,
    vgpu: Option<uuid::Uuid>,
}

impl DevicePath {
    pub fn new(root_domain: u32, root_bus: u8, chain: Vec<PciAddress>) -> Option<Self> {
        if chain.is_empty() {
            return None;
        }
        Some(DevicePath {
            root: format!("pci{root_domain:04x}:{root_bus:02x}"),
            chain,
            vgpu: None,
        })
    }

    /// The vGPU slot `id` on this GPU.
    pub fn with_vgpu(&self, id: uuid::Uuid) -> DevicePath {
        DevicePath {
            vgpu: Some(id),
            ..self.gpu()
        }
    }

    /// For a vGPU slot: its UUID.
    pub fn vgpu(&self) -> Option<uuid::Uuid> {
        self.vgpu
    }

    /// The PCI function itself: for a vGPU slot, the GPU that hosts it.
    pub fn gpu(&self) -> DevicePath {
        DevicePath {
            root: self.root.clone(),
            chain: self.chain.clone(),
            vgpu: None,
        }
    }

    /// The function itself (the last element of the chain); for a vGPU slot, its GPU's.
    pub fn address(&self) -> PciAddress {
        // `chain` is never empty: both constructors refuse an empty one.
        self.chain[self.chain.len() - 1]
    }

    /// The bridges above the function, root port first.
    pub fn parents(&self) -> &[PciAddress] {
        &self.chain[..self.chain.len() - 1]
    }
}

impl FromStr for DevicePath {
    type Err = PciParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || PciParseError::DevicePath(s.chars().take(80).collect());
        if s.len() > MAX_DEVICE_PATH_LEN {
            return Err(err());
        }
        let rest = s.strip_prefix("/devices/").ok_or_else(err)?;
        let mut parts = rest.split('/');
        let root = parts.next().ok_or_else(err)?;
        let root_bus = root.strip_prefix("pci").ok_or_else(err)?;
        let (dom, bus) = root_bus.split_once(':').ok_or_else(err)?;
        hex_exact(dom, 4, 8).ok_or_else(err)?;
        hex_exact(bus, 2, 2).ok_or_else(err)?;
        let mut parts: Vec<&str> = parts.collect();
        // A UUID is 36 characters with hyphens; no PCI address has either.
        let vgpu = match parts.last() {
            Some(last) if last.len() == 36 && last.contains('-') => {
                let id = uuid::Uuid::try_parse(last).map_err(|_| err())?;
                if id.hyphenated().to_string() != *last {
                    return Err(err());
                }
                parts.pop();
                Some(id)
            }
            _ => None,
        };
        let chain = parts
            .into_iter()
            .map(|p| p.parse::<PciAddress>().map_err(|_| err()))
            .collect::<Result<Vec<_>, _>>()?;
        if chain.is_empty() {
            return Err(err());
        }
        Ok(DevicePath {
            root: root.to_ascii_lowercase(),
            chain,
            vgpu,
        })
    }
}

impl fmt::Display for DevicePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "/devices/{}", self.root)?;
        for a in &self.chain {
            write!(f, "/{a}")?;
        }
        if let Some(id) = self.vgpu {
            write!(f, "/{}", id.hyphenated())?;
        }
        Ok(())
    }
}

macro_rules! string_serde {
    ($t:ty) => {
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
string_serde!(PciAddress);
string_serde!(DevicePath);

/// A 16-bit PCI id (vendor, device, subsystem vendor, subsystem), written as 4 hex digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HexId(pub u16);

impl HexId {
    /// `ffff`: what PCI reads from an empty slot, so no real function's id; stands for
    /// "not given" where a body may leave an id out.
    pub const fn unset() -> HexId {
        HexId(0xffff)
    }
}

impl FromStr for HexId {
    type Err = PciParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.strip_prefix("0x").unwrap_or(s);
        hex_exact(t, 4, 4)
            .map(|v| HexId(v as u16))
            .ok_or_else(|| PciParseError::Hex {
                what: "PCI id",
                value: s.chars().take(16).collect(),
                digits: 4,
            })
    }
}
impl fmt::Display for HexId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}", self.0)
    }
}
string_serde!(HexId);

/// An 8-bit PCI revision, written as 2 hex digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Revision(pub u8);

impl FromStr for Revision {
    type Err = PciParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.strip_prefix("0x").unwrap_or(s);
        hex_exact(t, 2, 2)
            .map(|v| Revision(v as u8))
            .ok_or_else(|| PciParseError::Hex {
                what: "PCI revision",
                value: s.chars().take(16).collect(),
                digits: 2,
            })
    }
}
impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:02x}", self.0)
    }
}
string_serde!(Revision);

/// A 24-bit PCI class code (class, subclass, programming interface), 6 hex digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciClass(pub u32);

impl PciClass {
    pub fn base(&self) -> u8 {
        (self.0 >> 16) as u8
    }
    /// Display controllers (0x03) and processing accelerators (0x12).
    pub fn is_gpu_like(&self) -> bool {
        matches!(self.base(), 0x03 | 0x12)
    }
    pub fn is_bridge(&self) -> bool {
        self.base() == 0x06
    }
}

impl FromStr for PciClass {
    type Err = PciParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.strip_prefix("0x").unwrap_or(s);
        hex_exact(t, 6, 6)
            .map(PciClass)
            .ok_or_else(|| PciParseError::Hex {
                what: "PCI class",
                value: s.chars().take(16).collect(),
                digits: 6,
            })
    }
}
impl fmt::Display for PciClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:06x}", self.0)
    }
}
string_serde!(PciClass);

/// Checks a kernel driver name as reported by an agent.
pub fn validate_driver(name: &str) -> Result<(), PciParseError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_DRIVER_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(PciParseError::Driver(name.chars().take(80).collect()))
    }
}

/// One PCI function as RFD 114's lister and sysinfo describe it, plus what placement
/// needs (class, NUMA node, IOMMU group).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PciDevice {
    pub id: DevicePath,
    pub vendor: HexId,
    pub device: HexId,
    pub subvendor: HexId,
    pub subsystem: HexId,
    pub revision: Revision,
    pub class: PciClass,
    /// `None` when no driver is bound (RFD 114 prints `-`).
    pub driver: Option<String>,
    /// `None` where the kernel reports -1 (no NUMA information).
    pub numa_node: Option<u32>,
    pub iommu_group: Option<u32>,
    /// What an agent could learn beyond the RFD fields. Absent from older agents, and
    /// left out of the JSON when absent so older servers accept newer agents' reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<PciDetails>,
}

/// Longest vendor, device or class name accepted (pci.ids names are far shorter).
pub const MAX_NAME_LEN: usize = 256;
/// Longest slot label accepted (firmware labels such as `CPU2 SLOT2`).
pub const MAX_SLOT_LEN: usize = 64;
/// Longest link speed accepted (the kernel writes e.g. `16.0 GT/s PCIe`).
pub const MAX_LINK_SPEED_LEN: usize = 64;
/// Most IOMMU group members and bridges accepted per function.
pub const MAX_GROUP_MEMBERS: usize = 256;

/// Optional facts about a function, all read from sysfs attributes (never `config`).
/// Every field may be missing: kernels, platforms and device kinds differ in what they
/// show, and an old agent sends none of them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PciDetails {
    /// From the pci.ids database the agent ships.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_name: Option<String>,
    /// The class/subclass name, e.g. `3D controller`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class_name: Option<String>,
    /// Every function in the same IOMMU group, this one included, sorted. Passthrough
    /// takes a whole group, so placement must know who shares it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub iommu_group_members: Vec<PciAddress>,
    /// The bridges above the function, root port first (from the device path).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bridges: Vec<PciAddress>,
    /// As the kernel writes it, e.g. `16.0 GT/s PCIe`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_link_speed: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_link_width: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_link_speed: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_link_width: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sriov_totalvfs: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sriov_numvfs: Option<u32>,
    /// The physical slot label (RFD 114's "CPU2 SLOT2" location question).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<String>,
    /// AER totals since boot: `TOTAL_ERR_FATAL` and `TOTAL_ERR_NONFATAL`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aer_fatal: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aer_nonfatal: Option<u64>,
    /// For an SR-IOV virtual function: its physical function (the `physfn` link).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub physfn: Option<PciAddress>,
    /// For a GPU whose driver can share it: its vGPU types, VFs, vGPUs and MIG mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu: Option<crate::vgpu::VgpuHost>,
    /// The regions the function decodes, as the kernel assigned them (sysfs `resource`),
    /// by index; unassigned ones left out. A VM launch sizes its PCI holes from these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bars: Vec<PciBar>,
    /// The resets the kernel may use on the function, in its order of preference
    /// (sysfs `reset_method`, e.g. `flr bus`). Empty when the kernel knows none or does
    /// not say: a function that cannot be reset is a poor candidate for passthrough.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reset_methods: Vec<String>,
}

/// The index of the expansion ROM among a function's resources (after BARs 0 to 5).
pub const ROM_BAR_INDEX: u8 = 6;
/// Most reset methods accepted (Linux knows seven).
pub const MAX_RESET_METHODS: usize = 8;
/// Longest reset method name accepted (Linux's are at most 10 characters).
pub const MAX_RESET_METHOD_LEN: usize = 32;

/// What address space a region decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum BarKind {
    Memory,
    Io,
}

/// One region of a function: a base address register (index 0 to 5) or the expansion
/// ROM ([`ROM_BAR_INDEX`]). A 64-bit BAR takes two registers; it is listed under the
/// lower index and the next index is absent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PciBar {
    pub index: u8,
    pub kind: BarKind,
    /// The bus address the region starts at.
    pub start: u64,
    /// Its length in bytes, never 0.
    pub size: u64,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_64bit: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub prefetchable: bool,
}

impl PciBar {
    /// The last address of the region; `None` when it would pass 2^64.
    pub fn end(&self) -> Option<u64> {
        self.size
            .checked_sub(1)
            .and_then(|s| self.start.checked_add(s))
    }

    fn check(&self) -> Result<(), String> {
        if self.index > ROM_BAR_INDEX {
            return Err(format!("BAR index {} is above {ROM_BAR_INDEX}", self.index));
        }
        if self.size == 0 || self.end().is_none() {
            return Err(format!("BAR {} is empty or passes 2^64", self.index));
        }
        if self.kind == BarKind::Io
            && (self.is_64bit || self.prefetchable || self.index == ROM_BAR_INDEX)
        {
            return Err(format!(
                "BAR {}: an I/O region is neither 64-bit nor prefetchable nor a ROM",
                self.index
            ));
        }
        Ok(())
    }

    /// `Memory at 9e000000 (32-bit, non-prefetchable) [size=16M]`, `I/O ports at e000
    /// [size=32]`: the words pciutils' `lspci -vv` prints after `Region N: `, for an
    /// enabled region.
    pub fn pciutils_text(&self) -> String {
        let what = match self.kind {
            BarKind::Io => format!("I/O ports at {:04x}", self.start),
            BarKind::Memory => format!(
                "Memory at {:08x} ({}, {}prefetchable)",
                self.start,
                if self.is_64bit { "64-bit" } else { "32-bit" },
                if self.prefetchable { "" } else { "non-" }
            ),
        };
        format!("{what} [size={}]", size_text(self.size))
    }
}

/// A size as pciutils writes it: the largest of K, M, G, T that divides it exactly
/// (`16M`, `128G`, `96`, `1536K`).
pub fn size_text(mut bytes: u64) -> String {
    let mut unit = 0;
    while unit < 4 && bytes != 0 && bytes.is_multiple_of(1024) {
        bytes /= 1024;
        unit += 1;
    }
    format!("{bytes}{}", ["", "K", "M", "G", "T"][unit])
}

/// Checks one reset method name as `reset_method` lists it (`flr`, `bus`, `pm`,
/// `acpi`, `device_specific`, `cxl_bus`): short, lowercase letters, digits and `_`.
pub fn valid_reset_method(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_RESET_METHOD_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

impl PciDetails {
    /// Checks the bounds serde cannot: string lengths and list sizes, so a report cannot
    /// make the server store unbounded text.
    pub fn validate(&self) -> Result<(), PciParseError> {
        let text = |what: &str, v: &Option<String>, max: usize| match v {
            Some(s) if s.chars().count() > max || s.chars().any(char::is_control) => {
                Err(PciParseError::Details(format!(
                    "{what} is longer than {max} characters or has control characters"
                )))
            }
            _ => Ok(()),
        };
        text("vendor_name", &self.vendor_name, MAX_NAME_LEN)?;
        text("device_name", &self.device_name, MAX_NAME_LEN)?;
        text("class_name", &self.class_name, MAX_NAME_LEN)?;
        text("slot", &self.slot, MAX_SLOT_LEN)?;
        text(
            "current_link_speed",
            &self.current_link_speed,
            MAX_LINK_SPEED_LEN,
        )?;
        text("max_link_speed", &self.max_link_speed, MAX_LINK_SPEED_LEN)?;
        if self.iommu_group_members.len() > MAX_GROUP_MEMBERS {
            return Err(PciParseError::Details(format!(
                "more than {MAX_GROUP_MEMBERS} IOMMU group members"
            )));
        }
        if self.bridges.len() > MAX_GROUP_MEMBERS {
            return Err(PciParseError::Details(format!(
                "more than {MAX_GROUP_MEMBERS} bridges"
            )));
        }
        if let Some(v) = &self.vgpu {
            v.validate()?;
        }
        if self.bars.len() > usize::from(ROM_BAR_INDEX) + 1 {
            return Err(PciParseError::Details(format!(
                "more than {} BARs",
                ROM_BAR_INDEX + 1
            )));
        }
        let mut seen = 0u8;
        for b in &self.bars {
            b.check().map_err(PciParseError::Details)?;
            if seen & (1 << b.index) != 0 {
                return Err(PciParseError::Details(format!(
                    "BAR {} listed twice",
                    b.index
                )));
            }
            seen |= 1 << b.index;
        }
        if self.reset_methods.len() > MAX_RESET_METHODS {
            return Err(PciParseError::Details(format!(
                "more than {MAX_RESET_METHODS} reset methods"
            )));
        }
        if let Some(bad) = self.reset_methods.iter().find(|m| !valid_reset_method(m)) {
            return Err(PciParseError::Details(format!(
                "reset method {:?} is not a short lowercase word",
                bad.chars().take(40).collect::<String>()
            )));
        }
        Ok(())
    }

    /// `key: value` pairs for display (`node-agent lspci -v`), in a fixed order, only
    /// for what is known.
    pub fn lines(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        let mut put = |k: &'static str, v: Option<String>| {
            if let Some(v) = v {
                out.push((k, v));
            }
        };
        put("vendor_name", self.vendor_name.clone());
        put("device_name", self.device_name.clone());
        put("class_name", self.class_name.clone());
        put("slot", self.slot.clone());
        let join = |v: &[PciAddress]| {
            (!v.is_empty()).then(|| {
                v.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(" ")
            })
        };
        put("bridges", join(&self.bridges));
        put("iommu_group_members", join(&self.iommu_group_members));
        put("current_link_speed", self.current_link_speed.clone());
        put(
            "current_link_width",
            self.current_link_width.map(|w| format!("x{w}")),
        );
        put("max_link_speed", self.max_link_speed.clone());
        put(
            "max_link_width",
            self.max_link_width.map(|w| format!("x{w}")),
        );
        put("sriov_totalvfs", self.sriov_totalvfs.map(|n| n.to_string()));
        put("sriov_numvfs", self.sriov_numvfs.map(|n| n.to_string()));
        put("aer_fatal", self.aer_fatal.map(|n| n.to_string()));
        put("aer_nonfatal", self.aer_nonfatal.map(|n| n.to_string()));
        put("physfn", self.physfn.map(|a| a.to_string()));
        put(
            "vgpu",
            self.vgpu.as_ref().map(crate::vgpu::VgpuHost::summary),
        );
        put(
            "bars",
            (!self.bars.is_empty()).then(|| {
                self.bars
                    .iter()
                    .map(|b| format!("{}: {}", b.index, b.pciutils_text()))
                    .collect::<Vec<_>>()
                    .join("; ")
            }),
        );
        put(
            "reset_methods",
            (!self.reset_methods.is_empty()).then(|| self.reset_methods.join(" ")),
        );
        out
    }
}

impl PciDevice {
    pub fn address(&self) -> PciAddress {
        self.id.address()
    }

    /// RFD 114's lister line: `vendor device subsystem subvendor revision id driver`.
    pub fn lister_line(&self) -> String {
        format!(
            "{} {} {} {} {} {} {}",
            self.vendor,
            self.device,
            self.subsystem,
            self.subvendor,
            self.revision,
            self.id,
            self.driver.as_deref().unwrap_or("-")
        )
    }

    /// Checks what serde cannot: the driver name's alphabet and the details' bounds.
    pub fn validate(&self) -> Result<(), PciParseError> {
        if let Some(d) = &self.driver {
            validate_driver(d)?;
        }
        if let Some(d) = &self.details {
            d.validate()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn addresses() {
        let a: PciAddress = "0000:3b:00.0".parse().unwrap();
        assert_eq!(a.bus, 0x3b);
        assert_eq!(a.to_string(), "0000:3b:00.0");
        assert_eq!(a.bsf(), "59/0/0");
        let vmd: PciAddress = "10000:e1:1f.7".parse().unwrap();
        assert_eq!(vmd.to_string(), "10000:e1:1f.7");
        for bad in [
            "",
            "0000:3b:00",
            "0000:3b:20.0",
            "0000:3b:00.8",
            "000:3b:00.0",
            "0000:3b:0.0",
            "0000:zz:00.0",
            "0000:3b:00.0.1",
            "0000:+3:00.0",
            "0000:3b:00.00",
            "ééé",
        ] {
            assert!(bad.parse::<PciAddress>().is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn device_paths() {
        let s = "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0";
        let p: DevicePath = s.parse().unwrap();
        assert_eq!(p.to_string(), s);
        assert_eq!(p.address().to_string(), "0000:3b:00.0");
        assert_eq!(p.parents().len(), 1);
        assert_eq!(p.vgpu(), None);

        // A vGPU slot: its GPU's path and a UUID, lowercase and hyphenated as the kernel
        // names an mdev.
        let slot = format!("{s}/c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c8d");
        let v: DevicePath = slot.parse().unwrap();
        assert_eq!(v.to_string(), slot);
        assert_eq!(v.gpu(), p);
        assert_eq!(v.address(), p.address());
        assert_eq!(
            v.vgpu().unwrap().to_string(),
            "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c8d"
        );
        assert_eq!(p.with_vgpu(v.vgpu().unwrap()), v);
        assert_ne!(v, p);
        for bad in [
            format!("{s}/C9E2D4A0-3F7E-4C89-9A43-0D2F5A6B7C8D"),
            format!("{s}/c9e2d4a03f7e4c899a430d2f5a6b7c8d"),
            format!("{s}/c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c8d/0000:3c:00.0"),
            "/devices/pci0000:3a/c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c8d".to_string(),
            format!("{s}/c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c8z"),
        ] {
            assert!(bad.parse::<DevicePath>().is_err(), "{bad} accepted");
        }
        for bad in [
            "/devices/pci0000:3a",
            "/devices/pci0000:3a/",
            "devices/pci0000:3a/0000:3a:00.0",
            "/devices/pcizz:3a/0000:3a:00.0",
            "/devices/pci0000:3a/0000:3a:00.0/../x",
            "/sys/devices/pci0000:3a/0000:3a:00.0",
        ] {
            assert!(bad.parse::<DevicePath>().is_err(), "{bad} accepted");
        }
        let long = format!("/devices/pci0000:00{}", "/0000:00:00.0".repeat(100));
        assert!(long.parse::<DevicePath>().is_err());
    }

    #[test]
    fn ids_and_lister_line() {
        let d = PciDevice {
            id: "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0"
                .parse()
                .unwrap(),
            vendor: "10de".parse().unwrap(),
            device: "0x1db4".parse().unwrap(),
            subvendor: "10de".parse().unwrap(),
            subsystem: "1214".parse().unwrap(),
            revision: "0xa1".parse().unwrap(),
            class: "0x030200".parse().unwrap(),
            driver: None,
            numa_node: Some(0),
            iommu_group: Some(12),
            details: None,
        };
        assert_eq!(
            d.lister_line(),
            "10de 1db4 1214 10de a1 /devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0 -"
        );
        let json = serde_json::to_value(&d).unwrap();
        assert_eq!(json["vendor"], "10de");
        assert_eq!(json["class"], "030200");
        let back: PciDevice = serde_json::from_value(json).unwrap();
        assert_eq!(back, d);
        assert!("10de0".parse::<HexId>().is_err());
        assert!("1g00".parse::<HexId>().is_err());
        assert!("a".parse::<Revision>().is_err());
        assert!(validate_driver("nvidia").is_ok());
        assert!(validate_driver("vfio-pci").is_ok());
        assert!(validate_driver("a b").is_err());
        assert!(validate_driver("").is_err());
    }

    #[test]
    fn details_are_optional_and_bounded() {
        let json = serde_json::json!({
            "id": "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0",
            "vendor": "10de", "device": "1db4", "subvendor": "10de", "subsystem": "1214",
            "revision": "a1", "class": "030200", "driver": null, "numa_node": 0,
            "iommu_group": 12
        });
        // An old agent's report (no details) still parses, and serialises back unchanged.
        let old: PciDevice = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(old.details, None);
        assert_eq!(serde_json::to_value(&old).unwrap(), json);

        let mut with = json.clone();
        with["details"] = serde_json::json!({
            "vendor_name": "NVIDIA Corporation", "slot": "CPU1 SLOT3",
            "iommu_group_members": ["0000:3b:00.0", "0000:3b:00.1"],
            "current_link_speed": "16.0 GT/s PCIe", "current_link_width": 16,
            "aer_fatal": 0
        });
        let d: PciDevice = serde_json::from_value(with.clone()).unwrap();
        let details = d.details.clone().unwrap();
        assert_eq!(details.slot.as_deref(), Some("CPU1 SLOT3"));
        assert_eq!(details.iommu_group_members.len(), 2);
        assert!(d.validate().is_ok());
        assert_eq!(serde_json::to_value(&d).unwrap(), with);
        assert!(
            details
                .lines()
                .contains(&("current_link_width", "x16".to_string()))
        );

        // Unknown keys inside details are refused, as for the device itself.
        let mut bad = with.clone();
        bad["details"]["colour"] = "green".into();
        assert!(serde_json::from_value::<PciDevice>(bad).is_err());

        let mut long = details.clone();
        long.slot = Some("x".repeat(MAX_SLOT_LEN + 1));
        assert!(long.validate().is_err());
        let mut long = details.clone();
        long.device_name = Some("x".repeat(MAX_NAME_LEN + 1));
        assert!(long.validate().is_err());
        let mut ctl = details.clone();
        ctl.vendor_name = Some("a\nb".into());
        assert!(ctl.validate().is_err());
        let mut many = details;
        many.iommu_group_members = vec!["0000:00:00.0".parse().unwrap(); MAX_GROUP_MEMBERS + 1];
        assert!(many.validate().is_err());
        let mut dev = d;
        dev.details = Some(many);
        assert!(dev.validate().is_err());

        // vGPU facts travel inside details and their bounds are the details' bounds.
        let mut with_vgpu = with.clone();
        with_vgpu["details"]["physfn"] = "0000:3a:00.0".into();
        with_vgpu["details"]["vgpu"] = serde_json::json!({
            "framework": "mdev", "mig_mode": false,
            "types": [{"id": "nvidia-222", "name": "GRID A100-4C", "available": 9,
                       "max_instances": 10, "framebuffer_mib": 4096}],
            "vgpus": [{"id": "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c8d", "type_id": "nvidia-222"}]
        });
        let v: PciDevice = serde_json::from_value(with_vgpu.clone()).unwrap();
        assert!(v.validate().is_ok());
        assert_eq!(serde_json::to_value(&v).unwrap(), with_vgpu);
        let mut bad = with_vgpu.clone();
        bad["details"]["vgpu"]["types"][0]["id"] = "nvidia/../222".into();
        let bad: PciDevice = serde_json::from_value(bad).unwrap();
        assert!(bad.validate().is_err());
        let mut bad = with_vgpu;
        bad["details"]["vgpu"]["mig"] = true.into();
        assert!(serde_json::from_value::<PciDevice>(bad).is_err());
    }

    #[test]
    fn bars_and_reset_methods() {
        let gpu = PciBar {
            index: 1,
            kind: BarKind::Memory,
            start: 0x2bfe_0000_0000,
            size: 128 << 30,
            is_64bit: true,
            prefetchable: true,
        };
        let regs = PciBar {
            index: 0,
            kind: BarKind::Memory,
            start: 0x9e00_0000,
            size: 16 << 20,
            is_64bit: false,
            prefetchable: false,
        };
        let io = PciBar {
            index: 2,
            kind: BarKind::Io,
            start: 0xe000,
            size: 32,
            is_64bit: false,
            prefetchable: false,
        };
        assert_eq!(
            gpu.pciutils_text(),
            "Memory at 2bfe00000000 (64-bit, prefetchable) [size=128G]"
        );
        assert_eq!(
            regs.pciutils_text(),
            "Memory at 9e000000 (32-bit, non-prefetchable) [size=16M]"
        );
        assert_eq!(io.pciutils_text(), "I/O ports at e000 [size=32]");
        assert_eq!(size_text(96), "96");
        assert_eq!(size_text(1536 << 10), "1536K");
        assert_eq!(size_text(1 << 50), "1024T");
        assert_eq!(size_text(0), "0");
        assert_eq!(gpu.end(), Some(0x2bfe_0000_0000 + (128 << 30) - 1));

        let details = PciDetails {
            bars: vec![regs, gpu, io],
            reset_methods: vec!["flr".into(), "bus".into()],
            ..PciDetails::default()
        };
        assert!(details.validate().is_ok());
        let json = serde_json::to_value(&details).unwrap();
        assert_eq!(
            json["bars"][0],
            serde_json::json!({"index": 0, "kind": "memory", "start": 0x9e00_0000u64,
                               "size": 16u64 << 20})
        );
        assert_eq!(json["bars"][1]["is_64bit"], true);
        assert_eq!(json["reset_methods"], serde_json::json!(["flr", "bus"]));
        assert_eq!(
            serde_json::from_value::<PciDetails>(json.clone()).unwrap(),
            details
        );
        let lines = details.lines();
        assert!(lines.contains(&("reset_methods", "flr bus".to_string())));
        assert!(lines.iter().any(|(k, v)| *k == "bars"
            && v.starts_with("0: Memory at 9e000000")
            && v.contains("; 1: Memory at 2bfe00000000")));
        // Nothing known, nothing shown.
        assert!(PciDetails::default().lines().is_empty());
        let mut bad = json;
        bad["bars"][0]["colour"] = "green".into();
        assert!(serde_json::from_value::<PciDetails>(bad).is_err());

        let bad_bars: [&dyn Fn(&mut PciBar); 5] = [
            &|b| b.index = 7,
            &|b| b.size = 0,
            &|b| b.start = u64::MAX,
            &|b| {
                b.kind = BarKind::Io;
                b.prefetchable = true;
            },
            &|b| {
                b.kind = BarKind::Io;
                b.index = ROM_BAR_INDEX;
            },
        ];
        for change in bad_bars {
            let mut d = details.clone();
            change(&mut d.bars[0]);
            assert!(d.validate().is_err(), "{:?}", d.bars[0]);
        }
        let mut twice = details.clone();
        twice.bars.push(regs);
        assert!(twice.validate().is_err());
        let mut many = details.clone();
        many.bars = (0..8)
            .map(|i| PciBar {
                index: i % 7,
                ..regs
            })
            .collect();
        assert!(many.validate().is_err());
        for bad in [
            "",
            "FLR",
            "f l r",
            "flr\n",
            &"x".repeat(MAX_RESET_METHOD_LEN + 1),
        ] {
            let mut d = details.clone();
            d.reset_methods = vec![bad.to_string()];
            assert!(d.validate().is_err(), "{bad:?}");
        }
        let mut d = details;
        d.reset_methods = vec!["bus".to_string(); MAX_RESET_METHODS + 1];
        assert!(d.validate().is_err());
        assert!(valid_reset_method("device_specific"));
        assert!(valid_reset_method("cxl_bus"));
    }

    proptest! {
        #[test]
        fn parsers_never_panic(s in "\\PC{0,80}") {
            let _ = s.parse::<PciAddress>();
            let _ = s.parse::<DevicePath>();
            let _ = s.parse::<HexId>();
            let _ = s.parse::<Revision>();
            let _ = s.parse::<PciClass>();
        }

        #[test]
        fn address_round_trips(d in 0u32..0x10000, b: u8, dev in 0u8..32, f in 0u8..8) {
            let a = PciAddress { domain: d, bus: b, device: dev, function: f };
            prop_assert_eq!(a.to_string().parse::<PciAddress>().unwrap(), a);
        }

        #[test]
        fn address_like_strings_never_panic(s in "[0-9a-fA-F:.]{0,20}") {
            let _ = s.parse::<PciAddress>();
        }
    }
}
