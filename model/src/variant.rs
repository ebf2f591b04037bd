//! Device variants: the operator's names for "this kind of card", and the rule that maps
//! a reported PCI function onto one (RFD 114: only the control plane translates).

use crate::pci::{HexId, PciDevice, Revision};
use serde::{Deserialize, Serialize};

pub const MAX_VARIANT_NAME_LEN: usize = 64;
pub const MAX_DESCRIPTION_LEN: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeviceType {
    Gpu,
    Nvme,
    Nic,
    Fpga,
    Other,
    /// A share of a GPU: one vGPU of one type, on a GPU of its `parent` variant.
    Vgpu,
    /// An SR-IOV virtual function of a function of its `parent` variant (a NIC's VF):
    /// each such function is made to have `num_vfs` of them, and each VF is a device.
    Vf,
}

impl DeviceType {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceType::Gpu => "gpu",
            DeviceType::Nvme => "nvme",
            DeviceType::Nic => "nic",
            DeviceType::Fpga => "fpga",
            DeviceType::Other => "other",
            DeviceType::Vgpu => "vgpu",
            DeviceType::Vf => "vf",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "gpu" => DeviceType::Gpu,
            "nvme" => DeviceType::Nvme,
            "nic" => DeviceType::Nic,
            "fpga" => DeviceType::Fpga,
            "other" => DeviceType::Other,
            "vgpu" => DeviceType::Vgpu,
            "vf" => DeviceType::Vf,
            _ => return None,
        })
    }
}

/// How a GPU variant's devices are cleaned between tenants.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum ScrubPolicy {
    /// A GPU goes back to the pool only after its memory was zeroed and read back as
    /// zero; a node that cannot do that quarantines it.
    #[default]
    Full,
    /// The operator's choice to reset a GPU without clearing its memory (a node without
    /// the zeroing helper, a fleet that trusts its tenants): the device and the audit log
    /// say its memory was not cleared.
    ResetOnly,
}

impl ScrubPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            ScrubPolicy::Full => "full",
            ScrubPolicy::ResetOnly => "reset-only",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "full" => Some(ScrubPolicy::Full),
            "reset-only" => Some(ScrubPolicy::ResetOnly),
            _ => None,
        }
    }
}

/// `{"name","type","vendor","device","subvendor","subsystem","revision","description"}`;
/// an absent optional id matches any value.
///
/// A vGPU variant (`"type":"vgpu"`) names no PCI function: it is one vGPU of type
/// `vgpu_type` on a GPU of its `parent` variant, at most `max_per_gpu` per GPU. Its ids are
/// its parent's (the server copies them; a body may leave them out).
///
/// A VF variant (`"type":"vf"`) is the SR-IOV virtual functions of the functions of its
/// `parent` variant: each of those gets `num_vfs` VFs (the node writes `sriov_numvfs`),
/// is no longer given whole, and each VF whose ids match (a VF's own ids, e.g. an i350's
/// VFs are 8086:1520) is a device of this variant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    #[schema(min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9_.-]+$")]
    pub name: String,
    #[serde(rename = "type")]
    pub kind: DeviceType,
    #[serde(default = "HexId::unset")]
    pub vendor: HexId,
    #[serde(default = "HexId::unset")]
    pub device: HexId,
    #[serde(default)]
    pub subvendor: Option<HexId>,
    #[serde(default)]
    pub subsystem: Option<HexId>,
    #[serde(default)]
    pub revision: Option<Revision>,
    #[serde(default)]
    #[schema(max_length = 1024)]
    pub description: Option<String>,
    /// How its devices are cleaned between tenants; `null` = the agent's default for the
    /// device's class (GPUs: reset, vendor reset, memory zeroing, driver check). Under
    /// the `full` scrub policy a GPU variant's own pipeline is given memory zeroing when
    /// it lacks it; under `reset-only` zeroing is taken out.
    #[serde(default)]
    #[schema(min_items = 1, max_items = 16)]
    pub scrub: Option<Vec<crate::protocol::ScrubAction>>,
    /// GPU variants: `full` (the default) clears and checks each GPU's memory before
    /// the next tenant; `reset-only` resets it without clearing its memory.
    #[serde(default)]
    pub scrub_policy: ScrubPolicy,
    /// vGPU and VF variants only: the variant whose GPUs host it, or whose functions
    /// make its VFs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 64)]
    pub parent: Option<String>,
    /// vGPU variants only: the driver's type, by id (`nvidia-222`, `557`) or by name
    /// (`NVIDIA A100-4C`), as the node's discovery reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 64)]
    pub vgpu_type: Option<String>,
    /// vGPU variants only: how many vGPUs of this type one GPU hosts (CloudStack's
    /// `max_capacity` per GPU); a node that reports fewer for the type gets fewer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 4096)]
    pub max_per_gpu: Option<u32>,
    /// VF variants only: how many VFs each function of the parent variant makes
    /// (`sriov_numvfs`); at most what the function can (`sriov_totalvfs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 1024)]
    pub num_vfs: Option<u32>,
    /// vGPU variants only: its vGPUs may share a GPU with those of other variants of the
    /// same parent that say so too (MIG-backed types on a GPU in MIG mode, or time-sliced
    /// types in NVIDIA's mixed-size mode). A vGPU of it then takes `1/n` of the GPU,
    /// where `n` is how many of its type one GPU hosts. Without it, a GPU hosts one
    /// variant at a time.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mix: bool,
}

/// More VFs than one function of any device makes.
pub const MAX_VFS: u32 = 1024;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VariantError {
    #[error("name must be 1 to 64 characters of A-Z, a-z, 0-9, '_', '-' or '.'")]
    Name,
    #[error("description is longer than 1024 characters")]
    Description,
    #[error("{0}")]
    Scrub(String),
    #[error("{1}")]
    Vgpu(&'static str, String),
}

impl VariantError {
    pub fn field(&self) -> &'static str {
        match self {
            VariantError::Name => "name",
            VariantError::Description => "description",
            VariantError::Scrub(_) => "scrub",
            VariantError::Vgpu(field, _) => field,
        }
    }
}

pub fn validate_name(name: &str) -> Result<(), VariantError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_VARIANT_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok { Ok(()) } else { Err(VariantError::Name) }
}

impl Variant {
    pub fn validate(&self) -> Result<(), VariantError> {
        validate_name(&self.name)?;
        if self
            .description
            .as_ref()
            .is_some_and(|d| d.chars().count() > MAX_DESCRIPTION_LEN)
        {
            return Err(VariantError::Description);
        }
        if let Some(steps) = &self.scrub {
            validate_pipeline(steps)?;
        }
        if self.scrub_policy == ScrubPolicy::ResetOnly && self.kind != DeviceType::Gpu {
            return Err(VariantError::Vgpu(
                "scrub_policy",
                "scrub_policy reset-only is for variants of type gpu (whole GPUs, whose \
                 memory is what it leaves uncleared)"
                    .to_string(),
            ));
        }
        self.validate_vgpu()
    }

    fn validate_vgpu(&self) -> Result<(), VariantError> {
        let bad = |field, m: &str| Err(VariantError::Vgpu(field, m.to_string()));
        if self.kind != DeviceType::Vgpu && self.mix {
            return bad("mix", "mix is for variants of type vgpu");
        }
        if self.kind != DeviceType::Vf && self.num_vfs.is_some() {
            return bad("num_vfs", "num_vfs is for variants of type vf");
        }
        if self.kind == DeviceType::Vf {
            if self.vgpu_type.is_some() || self.max_per_gpu.is_some() {
                return bad(
                    "type",
                    "vgpu_type and max_per_gpu are for variants of type vgpu",
                );
            }
            self.validate_parent("a vf variant names the variant whose functions make its VFs")?;
            match self.num_vfs {
                Some(n) if (1..=MAX_VFS).contains(&n) => {}
                _ => return bad("num_vfs", &format!("num_vfs is 1 to {MAX_VFS}")),
            }
        }
        if self.kind != DeviceType::Vgpu {
            if self.kind != DeviceType::Vf
                && (self.parent.is_some() || self.vgpu_type.is_some() || self.max_per_gpu.is_some())
            {
                return bad(
                    "type",
                    "parent is for variants of type vgpu or vf, vgpu_type and max_per_gpu \
                     for type vgpu",
                );
            }
            if self.vendor == HexId::unset() {
                return bad(
                    "vendor",
                    "missing field `vendor` (a PCI vendor id, e.g. 10de)",
                );
            }
            if self.device == HexId::unset() {
                return bad(
                    "device",
                    "missing field `device` (a PCI device id, e.g. 2330)",
                );
            }
            return Ok(());
        }
        self.validate_parent("a vgpu variant names its parent GPU variant")?;
        match &self.vgpu_type {
            Some(t)
                if !t.trim().is_empty()
                    && t.chars().count() <= 64
                    && !t.chars().any(char::is_control) => {}
            _ => {
                return bad(
                    "vgpu_type",
                    "vgpu_type is the driver's type id or name, 1 to 64 characters",
                );
            }
        }
        match self.max_per_gpu {
            Some(n) if (1..=crate::vgpu::MAX_INSTANCES).contains(&n) => Ok(()),
            _ => bad(
                "max_per_gpu",
                &format!("max_per_gpu is 1 to {}", crate::vgpu::MAX_INSTANCES),
            ),
        }
    }

    fn validate_parent(&self, missing: &str) -> Result<(), VariantError> {
        let bad = |m: &str| Err(VariantError::Vgpu("parent", m.to_string()));
        match &self.parent {
            None => bad(missing),
            Some(p) if validate_name(p).is_err() => bad("parent is not a variant name"),
            Some(p) if *p == self.name => bad("a variant is not its own parent"),
            Some(_) => Ok(()),
        }
    }

    pub fn is_vgpu(&self) -> bool {
        self.kind == DeviceType::Vgpu
    }

    pub fn is_vf(&self) -> bool {
        self.kind == DeviceType::Vf
    }

    /// Whether `d` has this variant's ids. A vGPU variant matches no PCI function: its
    /// devices are slots the control plane makes on its parent's GPUs. A VF variant
    /// matches only VFs, every other variant only functions that are not VFs.
    pub fn matches(&self, d: &PciDevice) -> bool {
        !self.is_vgpu()
            && self.is_vf() == d.details.as_ref().is_some_and(|x| x.physfn.is_some())
            && self.vendor == d.vendor
            && self.device == d.device
            && self.subvendor.is_none_or(|v| v == d.subvendor)
            && self.subsystem.is_none_or(|v| v == d.subsystem)
            && self.revision.is_none_or(|v| v == d.revision)
    }

    /// How many optional ids are pinned: the more, the more specific.
    pub fn specificity(&self) -> u8 {
        u8::from(self.subvendor.is_some())
            + u8::from(self.subsystem.is_some())
            + u8::from(self.revision.is_some())
    }
}

fn validate_pipeline(steps: &[crate::protocol::ScrubAction]) -> Result<(), VariantError> {
    use crate::protocol::{MAX_SCRUB_STEPS, ScrubAction};
    let bad = |m: String| Err(VariantError::Scrub(m));
    if steps.is_empty() || steps.len() > MAX_SCRUB_STEPS {
        return bad(format!("a scrub pipeline has 1 to {MAX_SCRUB_STEPS} steps"));
    }
    for (i, s) in steps.iter().enumerate() {
        if let ScrubAction::Command { argv, timeout_secs } = s {
            if argv.is_empty() || argv.len() > 32 {
                return bad(format!("step {i}: a command has 1 to 32 arguments"));
            }
            if argv.iter().any(|a| a.len() > 1024 || a.contains('\0')) {
                return bad(format!(
                    "step {i}: arguments are at most 1024 bytes, without NUL"
                ));
            }
            if timeout_secs.is_some_and(|t| t == 0 || t > 3600) {
                return bad(format!("step {i}: timeout_secs is 1 to 3600"));
            }
        }
    }
    Ok(())
}

/// The variant a device belongs to: the most specific match, ties broken by name so the
/// answer never depends on the order variants were listed in.
///
/// An SR-IOV virtual function (one with a `physfn`) belongs only to a VF variant whose
/// parent is `pf_variant`, its physical function's variant. A VF may carry its GPU's
/// vendor and device ids (the fake vendor-VFIO tree's do), so a whole-GPU variant would
/// take each for a GPU of its own, and a GPU and its VFs could go to different VMs; and
/// a VF of a function not made to share (not of a VF variant's parent) is no device.
pub fn classify<'a>(
    variants: &'a [Variant],
    d: &PciDevice,
    pf_variant: Option<&str>,
) -> Option<&'a Variant> {
    let is_vf = d.details.as_ref().is_some_and(|x| x.physfn.is_some());
    if is_vf && pf_variant.is_none() {
        return None;
    }
    let fits = |v: &&Variant| v.matches(d) && (!is_vf || v.parent.as_deref() == pf_variant);
    variants.iter().filter(fits).max_by(|a, b| {
        a.specificity()
            .cmp(&b.specificity())
            .then_with(|| b.name.cmp(&a.name))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(vendor: &str, device: &str, sv: &str, ss: &str, rev: &str) -> PciDevice {
        PciDevice {
            id: "/devices/pci0000:00/0000:00:01.0/0000:01:00.0"
                .parse()
                .unwrap(),
            vendor: vendor.parse().unwrap(),
            device: device.parse().unwrap(),
            subvendor: sv.parse().unwrap(),
            subsystem: ss.parse().unwrap(),
            revision: rev.parse().unwrap(),
            class: "030200".parse().unwrap(),
            driver: None,
            numa_node: None,
            iommu_group: None,
            details: None,
        }
    }

    fn variant(name: &str, sv: Option<&str>, rev: Option<&str>) -> Variant {
        Variant {
            name: name.into(),
            kind: DeviceType::Gpu,
            vendor: "10de".parse().unwrap(),
            device: "2330".parse().unwrap(),
            subvendor: sv.map(|s| s.parse().unwrap()),
            subsystem: None,
            revision: rev.map(|s| s.parse().unwrap()),
            description: None,
            scrub: None,
            scrub_policy: Default::default(),
            parent: None,
            vgpu_type: None,
            max_per_gpu: None,
            num_vfs: None,
            mix: false,
        }
    }

    #[test]
    fn optional_fields_mean_any() {
        let d = dev("10de", "2330", "10de", "16c1", "a1");
        assert!(variant("H100", None, None).matches(&d));
        assert!(variant("H100", Some("10de"), Some("a1")).matches(&d));
        assert!(!variant("H100", Some("1028"), None).matches(&d));
        assert!(!variant("H100", None, Some("a2")).matches(&d));
        let other = dev("10de", "2331", "10de", "16c1", "a1");
        assert!(!variant("H100", None, None).matches(&other));
    }

    #[test]
    fn most_specific_wins_whatever_the_order() {
        let d = dev("10de", "2330", "10de", "16c1", "a1");
        let a = variant("ANY_H100", None, None);
        let b = variant("H100_A1", None, Some("a1"));
        let list1 = [a.clone(), b.clone()];
        let list2 = [b, a];
        assert_eq!(classify(&list1, &d, None).unwrap().name, "H100_A1");
        assert_eq!(classify(&list2, &d, None).unwrap().name, "H100_A1");
        assert!(classify(&[], &d, None).is_none());
    }

    #[test]
    fn a_virtual_function_is_never_a_whole_device() {
        let pf = dev("10de", "2330", "10de", "16c1", "a1");
        let mut vf = pf.clone();
        vf.details = Some(crate::pci::PciDetails {
            physfn: Some("0000:3b:00.0".parse().unwrap()),
            ..Default::default()
        });
        let list = [variant("H100", None, None)];
        assert!(
            !variant("H100", None, None).matches(&vf),
            "same ids as its GPU, but a VF"
        );
        assert!(classify(&list, &vf, Some("H100")).is_none());
        assert_eq!(classify(&list, &pf, None).unwrap().name, "H100");
    }

    #[test]
    fn a_vf_belongs_to_the_vf_variant_of_its_pfs_variant() {
        let pf = dev("8086", "1521", "15d9", "1521", "01");
        let mut vf = dev("8086", "1520", "15d9", "1521", "01");
        vf.details = Some(crate::pci::PciDetails {
            physfn: Some("0000:01:00.0".parse().unwrap()),
            ..Default::default()
        });
        let nic = Variant {
            kind: DeviceType::Nic,
            vendor: "8086".parse().unwrap(),
            device: "1521".parse().unwrap(),
            ..variant("I350", None, None)
        };
        let vfs = Variant {
            kind: DeviceType::Vf,
            vendor: "8086".parse().unwrap(),
            device: "1520".parse().unwrap(),
            parent: Some("I350".into()),
            num_vfs: Some(4),
            ..variant("I350_VF", None, None)
        };
        assert_eq!(vfs.validate(), Ok(()));
        let list = [nic.clone(), vfs.clone()];
        assert_eq!(classify(&list, &pf, None).unwrap().name, "I350");
        assert_eq!(classify(&list, &vf, Some("I350")).unwrap().name, "I350_VF");
        // A VF of a function of another variant, or of none, is no device.
        assert!(classify(&list, &vf, Some("OTHER")).is_none());
        assert!(classify(&list, &vf, None).is_none());
        // The VF variant's ids are a VF's: a PF with them is not one.
        let mut like_vf = vf.clone();
        like_vf.details = None;
        assert!(classify(&list, &like_vf, None).is_none());
        let field = |v: Variant| v.validate().unwrap_err().field();
        assert_eq!(
            field(Variant {
                parent: None,
                ..vfs.clone()
            }),
            "parent"
        );
        assert_eq!(
            field(Variant {
                num_vfs: None,
                ..vfs.clone()
            }),
            "num_vfs"
        );
        assert_eq!(
            field(Variant {
                num_vfs: Some(0),
                ..vfs.clone()
            }),
            "num_vfs"
        );
        assert_eq!(
            field(Variant {
                num_vfs: Some(MAX_VFS + 1),
                ..vfs.clone()
            }),
            "num_vfs"
        );
        assert_eq!(
            field(Variant {
                max_per_gpu: Some(2),
                ..vfs.clone()
            }),
            "type"
        );
        assert_eq!(
            field(Variant {
                num_vfs: Some(2),
                ..nic.clone()
            }),
            "num_vfs"
        );
        assert_eq!(field(Variant { mix: true, ..nic }), "mix");
        assert_eq!(
            field(Variant {
                mix: true,
                ..vfs.clone()
            }),
            "mix"
        );
        assert_eq!(
            field(Variant {
                device: HexId::unset(),
                ..vfs
            }),
            "device"
        );
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_name("NVIDIA_GPU_GEN1").is_ok());
        assert!(validate_name("").is_err());
        assert!(validate_name("a/b").is_err());
        assert!(validate_name(&"x".repeat(65)).is_err());
    }

    #[test]
    fn scrub_pipelines_are_checked() {
        let with = |json: &str| {
            serde_json::from_str::<Variant>(&format!(
                r#"{{"name":"X","type":"gpu","vendor":"10de","device":"2330","scrub":{json}}}"#
            ))
        };
        assert!(
            with(r#"[{"action":"reset"},{"action":"verify_driver"}]"#)
                .unwrap()
                .validate()
                .is_ok()
        );
        assert!(with("[]").unwrap().validate().is_err());
        assert!(
            with(r#"[{"action":"command","argv":[]}]"#)
                .unwrap()
                .validate()
                .is_err()
        );
        assert!(
            with(r#"[{"action":"command","argv":["x"],"timeout_secs":0}]"#)
                .unwrap()
                .validate()
                .is_err()
        );
        assert!(with(r#"[{"action":"format_disk"}]"#).is_err());
    }

    #[test]
    fn json_shape() {
        let v: Variant = serde_json::from_str(
            r#"{"name":"NVIDIA_GPU_GEN1","type":"gpu","vendor":"10de","device":"1db4"}"#,
        )
        .unwrap();
        assert_eq!(v.subvendor, None);
        let bad = serde_json::from_str::<Variant>(
            r#"{"name":"X","type":"gpu","vendor":"10de","device":"1db4","colour":1}"#,
        );
        assert!(bad.unwrap_err().to_string().contains("colour"));
    }
}
