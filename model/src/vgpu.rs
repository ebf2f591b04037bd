//! What a physical GPU offers for sharing: the vGPU framework its driver uses, the vGPU
//! types it can host and how many of each can still be made, its SR-IOV virtual
//! functions, the vGPUs that exist on it, and whether MIG mode is on. An agent reports
//! it inside the GPU's [`crate::PciDetails`]; every field comes from the host's sysfs or
//! its `nvidia-smi`, so every bound here is checked on receipt.

use crate::pci::{MAX_NAME_LEN, PciAddress, PciParseError};
use serde::{Deserialize, Serialize};

/// Most vGPU types accepted per GPU (an A100's mdev driver lists about 30, time-sliced
/// and MIG-backed together).
pub const MAX_VGPU_TYPES: usize = 128;
/// Most virtual functions accepted per GPU (NVIDIA boards make 16 to 32; SR-IOV allows
/// more, so the bound is the PCI one of 256 functions a bus can hold).
pub const MAX_VFS: usize = 256;
/// Most vGPUs accepted per GPU: one per VF at most, and mdev hosts make fewer.
pub const MAX_VGPUS: usize = 256;
/// Longest type id accepted: `nvidia-222` (mdev) or `557` (vendor VFIO).
pub const MAX_VGPU_TYPE_ID_LEN: usize = 64;
/// Longest vGPU id accepted: an mdev UUID (36) or a VF's PCI address (12, 13 with VMD).
pub const MAX_VGPU_ID_LEN: usize = 64;
/// A framebuffer above 16 TiB is not a GPU's.
pub const MAX_FRAMEBUFFER_MIB: u64 = 16 << 20;
/// Instance counts above this are not a GPU's (a time-sliced 1 GiB type on a 1 TiB part).
pub const MAX_INSTANCES: u32 = 4096;

/// How the host's driver makes vGPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum VgpuFramework {
    /// Mediated devices (NVIDIA up to Ampere): `mdev_supported_types/<type>/create` takes
    /// a UUID; the vGPU is `/sys/bus/mdev/devices/<uuid>`.
    Mdev,
    /// NVIDIA's vendor VFIO (Ada, Hopper and newer, vGPU 17+): each SR-IOV virtual
    /// function becomes a vGPU when a type id is written to its
    /// `nvidia/current_vgpu_type`, and is then passed through as a whole function.
    VendorVfio,
}

/// One vGPU type a GPU can host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VgpuType {
    /// The driver's id: the mdev type directory (`nvidia-222`) or the vendor VFIO
    /// number (`557`).
    pub id: String,
    /// As the driver names it, e.g. `NVIDIA A100-4C` or `NVIDIA H100XM-1-10C`.
    pub name: String,
    /// Memory of one vGPU of this type, in MiB; absent when the host does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub framebuffer_mib: Option<u64>,
    /// How many of this type the GPU holds when it hosts nothing else; absent when the
    /// host does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_instances: Option<u32>,
    /// How many more can be made now, given the vGPUs that exist.
    pub available: u32,
    /// Backed by a MIG slice (needs MIG mode) rather than time-sliced; absent when the
    /// name does not tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_backed: Option<bool>,
}

/// One vGPU that exists on the GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Vgpu {
    /// The mdev's UUID, or the address of the VF that is the vGPU.
    pub id: String,
    /// The [`VgpuType::id`] it was made as.
    pub type_id: String,
}

/// A GPU's sharing facts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VgpuHost {
    pub framework: VgpuFramework,
    /// Sorted by id.
    #[serde(default)]
    pub types: Vec<VgpuType>,
    /// The GPU's SR-IOV virtual functions, sorted. Each is also reported as a PCI function
    /// of its own; these are not whole GPUs to hand out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vfs: Vec<PciAddress>,
    /// Sorted by id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vgpus: Vec<Vgpu>,
    /// From `nvidia-smi`; absent when it could not be asked or does not know.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_mode: Option<bool>,
}

fn bad(msg: String) -> PciParseError {
    PciParseError::Details(msg)
}

/// What NVIDIA's type names say: `[NVIDIA |GRID ]<board>-<slices>-<GB><series>` is
/// MIG-backed, `<board>-<GB><series>` time-sliced (series A, B, C or Q). Returns
/// (framebuffer MiB, MIG-backed); a name not of either form says nothing.
pub fn type_from_name(name: &str) -> (Option<u64>, Option<bool>) {
    let last = name.rsplit(' ').next().unwrap_or(name);
    let parts: Vec<&str> = last.split('-').collect();
    let profile = |p: &str| {
        let series = p.chars().last()?;
        if !matches!(series, 'A' | 'B' | 'C' | 'Q') {
            return None;
        }
        let gb: u64 = p[..p.len() - 1].parse().ok()?;
        let mib = gb.checked_mul(1024)?;
        (1..=MAX_FRAMEBUFFER_MIB).contains(&mib).then_some(mib)
    };
    match parts.as_slice() {
        [_board, slices, p] if slices.parse::<u8>().is_ok_and(|s| (1..=8).contains(&s)) => {
            match profile(p) {
                Some(fb) => (Some(fb), Some(true)),
                None => (None, None),
            }
        }
        [_board, p] => match profile(p) {
            Some(fb) => (Some(fb), Some(false)),
            None => (None, None),
        },
        _ => (None, None),
    }
}

/// A driver's type id: `nvidia-222`, `557`.
pub fn validate_type_id(id: &str) -> Result<(), PciParseError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_VGPU_TYPE_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(bad(format!(
            "vGPU type id {:?} is empty, longer than {MAX_VGPU_TYPE_ID_LEN} or has characters \
             outside [A-Za-z0-9_.-]",
            id.chars().take(80).collect::<String>()
        )))
    }
}

/// A vGPU id: a UUID or a PCI address (hex digits, `-`, `:`, `.`).
pub fn validate_vgpu_id(id: &str) -> Result<(), PciParseError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_VGPU_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_hexdigit() || matches!(b, b'-' | b':' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(bad(format!(
            "vGPU id {:?} is not a UUID or a PCI address",
            id.chars().take(80).collect::<String>()
        )))
    }
}

impl VgpuHost {
    /// The bounds serde cannot check: list sizes, string lengths and alphabets, counts.
    pub fn validate(&self) -> Result<(), PciParseError> {
        if self.types.len() > MAX_VGPU_TYPES {
            return Err(bad(format!("more than {MAX_VGPU_TYPES} vGPU types")));
        }
        if self.vfs.len() > MAX_VFS {
            return Err(bad(format!("more than {MAX_VFS} virtual functions")));
        }
        if self.vgpus.len() > MAX_VGPUS {
            return Err(bad(format!("more than {MAX_VGPUS} vGPUs")));
        }
        for t in &self.types {
            validate_type_id(&t.id)?;
            if t.name.is_empty()
                || t.name.chars().count() > MAX_NAME_LEN
                || t.name.chars().any(char::is_control)
            {
                return Err(bad(format!(
                    "vGPU type {} has an empty name, one longer than {MAX_NAME_LEN} characters \
                     or one with control characters",
                    t.id
                )));
            }
            if t.framebuffer_mib
                .is_some_and(|f| f == 0 || f > MAX_FRAMEBUFFER_MIB)
            {
                return Err(bad(format!(
                    "vGPU type {}: framebuffer_mib out of 1..={MAX_FRAMEBUFFER_MIB}",
                    t.id
                )));
            }
            if t.max_instances.is_some_and(|m| m == 0 || m > MAX_INSTANCES)
                || t.available > MAX_INSTANCES
            {
                return Err(bad(format!(
                    "vGPU type {}: instance counts out of 1..={MAX_INSTANCES}",
                    t.id
                )));
            }
        }
        for v in &self.vgpus {
            validate_vgpu_id(&v.id)?;
            validate_type_id(&v.type_id)?;
        }
        Ok(())
    }

    /// One line for display (`node-agent lspci -v`): framework, MIG mode, types with
    /// available/max, VF and vGPU counts.
    pub fn summary(&self) -> String {
        let framework = match self.framework {
            VgpuFramework::Mdev => "mdev",
            VgpuFramework::VendorVfio => "vendor_vfio",
        };
        let mig = match self.mig_mode {
            Some(true) => "on",
            Some(false) => "off",
            None => "unknown",
        };
        let types = self
            .types
            .iter()
            .map(|t| {
                let max = t.max_instances.map_or("?".to_string(), |m| m.to_string());
                format!("{}={}({}/{})", t.id, t.name, t.available, max)
            })
            .collect::<Vec<_>>()
            .join(" ");
        format!(
            "{framework} mig={mig} vfs={} vgpus={} types: {types}",
            self.vfs.len(),
            self.vgpus.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn host() -> VgpuHost {
        VgpuHost {
            framework: VgpuFramework::VendorVfio,
            types: vec![VgpuType {
                id: "557".into(),
                name: "NVIDIA H100XM-1-10C".into(),
                framebuffer_mib: Some(10240),
                max_instances: None,
                available: 7,
                mig_backed: Some(true),
            }],
            vfs: vec!["0000:3b:00.4".parse().unwrap()],
            vgpus: vec![Vgpu {
                id: "0000:3b:00.4".into(),
                type_id: "557".into(),
            }],
            mig_mode: Some(true),
        }
    }

    #[test]
    fn round_trips_and_refuses_unknown_keys() {
        let h = host();
        let json = serde_json::to_value(&h).unwrap();
        assert_eq!(json["framework"], "vendor_vfio");
        assert_eq!(json["types"][0]["framebuffer_mib"], 10240);
        assert!(json["types"][0].get("max_instances").is_none());
        assert_eq!(serde_json::from_value::<VgpuHost>(json.clone()).unwrap(), h);
        assert!(h.validate().is_ok());
        let mut bad = json.clone();
        bad["types"][0]["colour"] = "green".into();
        assert!(serde_json::from_value::<VgpuHost>(bad).is_err());
        let mut bad = json.clone();
        bad["framework"] = "sriov".into();
        assert!(serde_json::from_value::<VgpuHost>(bad).is_err());
        let mut bad = json;
        bad["types"][0]["available"] = (-1).into();
        assert!(serde_json::from_value::<VgpuHost>(bad).is_err());
        let mdev: VgpuHost = serde_json::from_value(serde_json::json!({
            "framework": "mdev",
            "types": [{"id": "nvidia-222", "name": "GRID A100-4C", "available": 10,
                       "max_instances": 10, "framebuffer_mib": 4096}],
            "vgpus": [{"id": "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c8d", "type_id": "nvidia-222"}]
        }))
        .unwrap();
        assert!(mdev.validate().is_ok());
        assert!(mdev.summary().contains("nvidia-222=GRID A100-4C(10/10)"));
    }

    #[test]
    fn bounds_are_checked() {
        let refused = |f: &dyn Fn(&mut VgpuHost)| {
            let mut h = host();
            f(&mut h);
            assert!(h.validate().is_err(), "{h:?}");
        };
        refused(&|h| h.types[0].id = "nvidia 222".into());
        refused(&|h| h.types[0].id = "x".repeat(MAX_VGPU_TYPE_ID_LEN + 1));
        refused(&|h| h.types[0].id = String::new());
        refused(&|h| h.types[0].name = "a\nb".into());
        refused(&|h| h.types[0].name = String::new());
        refused(&|h| h.types[0].name = "n".repeat(MAX_NAME_LEN + 1));
        refused(&|h| h.types[0].framebuffer_mib = Some(0));
        refused(&|h| h.types[0].framebuffer_mib = Some(MAX_FRAMEBUFFER_MIB + 1));
        refused(&|h| h.types[0].max_instances = Some(0));
        refused(&|h| h.types[0].available = MAX_INSTANCES + 1);
        refused(&|h| h.vgpus[0].id = "../../etc".into());
        refused(&|h| h.vgpus[0].type_id = "5 5".into());
        refused(&|h| h.types = vec![h.types[0].clone(); MAX_VGPU_TYPES + 1]);
        refused(&|h| h.vfs = vec![h.vfs[0]; MAX_VFS + 1]);
        refused(&|h| h.vgpus = vec![h.vgpus[0].clone(); MAX_VGPUS + 1]);
    }

    proptest! {
        #[test]
        fn validation_never_panics(id in "\\PC{0,80}", name in "\\PC{0,300}", n: u32, f: u64) {
            let mut h = host();
            h.types[0].id = id.clone();
            h.types[0].name = name;
            h.types[0].available = n;
            h.types[0].framebuffer_mib = Some(f);
            h.vgpus[0].id = id;
            let _ = h.validate();
            let _ = h.summary();
        }
    }
}
