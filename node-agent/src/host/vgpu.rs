//! A GPU's sharing facts ([`VgpuHost`]): read from sysfs for NVIDIA GPUs whose driver
//! shows either vGPU framework, and MIG mode from `nvidia-smi`.
//!
//! - mdev (up to Ampere): `mdev_supported_types/<id>/{name,description,
//!   available_instances,devices/}` on the GPU itself, or on each of its VFs (NVIDIA's
//!   SR-IOV Ampere boards put the types on the VFs); both forms are read, the VF form
//!   summed over the VFs.
//! - vendor VFIO (Ada, Hopper, vGPU 17+): per VF (`virtfnN`) `nvidia/creatable_vgpu_types`
//!   and `nvidia/current_vgpu_type`. Sysfs shows neither framebuffer nor maximum
//!   count for these types: the framebuffer comes from NVIDIA's naming convention
//!   (`H100XM-1-10C`: MIG-backed, 1 slice, 10 GB; `L40S-12Q`: time-sliced, 12 GB), the
//!   maximum is left unknown, and `available` is the number of free VFs that would take
//!   the type now.
//!
//! Nothing here is needed to list a function: a garbled file becomes a note and the
//! field stays empty; reads are single pages ([`read_attr`]) and listings are bounded.

use super::{AttrDir, read_attr};
use passage_model::PciAddress;
use passage_model::pci::MAX_NAME_LEN;
use passage_model::vgpu::{
    MAX_FRAMEBUFFER_MIB, MAX_INSTANCES, MAX_VFS, MAX_VGPU_TYPES, MAX_VGPUS, Vgpu, VgpuFramework,
    VgpuHost, VgpuType, type_from_name, validate_type_id, validate_vgpu_id,
};
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub(crate) const NVIDIA: u16 = 0x10de;

/// The mdev framework's directory of types, on a GPU or a VF.
const MDEV_TYPES: &str = "mdev_supported_types";
/// A vendor-VFIO VF's directory.
const VF_NVIDIA: &str = "nvidia";

/// Keys of NVIDIA's mdev `description`: `num_heads=1, frl_config=60, framebuffer=4096M,
/// max_resolution=4096x2160, max_instance=10`. Returns (framebuffer MiB, max instances);
/// a key missing or garbled leaves its value unknown.
pub(crate) fn parse_description(text: &str) -> (Option<u64>, Option<u32>) {
    let mut fb = None;
    let mut max = None;
    for part in text.split(',') {
        let Some((k, v)) = part.split_once('=') else {
            continue;
        };
        match k.trim() {
            "framebuffer" => fb = parse_size_mib(v.trim()),
            "max_instance" => {
                max = v
                    .trim()
                    .parse::<u32>()
                    .ok()
                    .filter(|m| (1..=MAX_INSTANCES).contains(m))
            }
            _ => {}
        }
    }
    (fb, max)
}

/// `4096M`, `8G` → MiB, within the model's bounds.
fn parse_size_mib(v: &str) -> Option<u64> {
    let (digits, unit) = v.split_at(v.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = digits.parse().ok()?;
    let mib = match unit {
        "M" | "MB" | "MiB" => n,
        "G" | "GB" | "GiB" => n.checked_mul(1024)?,
        _ => return None,
    };
    (1..=MAX_FRAMEBUFFER_MIB).contains(&mib).then_some(mib)
}

/// `nvidia/creatable_vgpu_types`: a header `ID    : vGPU Name`, then `557   : NVIDIA
/// H100XM-1-10C` per type. Lines that are neither are returned as problems.
pub(crate) fn parse_creatable(text: &str) -> (Vec<(String, String)>, Vec<String>) {
    let mut types = Vec::new();
    let mut bad = Vec::new();
    for line in text.lines() {
        let t = line.trim();
        if t.is_empty() {
            continue;
        }
        let Some((id, name)) = t.split_once(':') else {
            bad.push(short(t));
            continue;
        };
        let (id, name) = (id.trim(), name.trim());
        if id == "ID" {
            continue;
        }
        let id_ok = !id.is_empty() && id.len() <= 10 && id.bytes().all(|b| b.is_ascii_digit());
        if !id_ok || !good_name(name) || types.len() >= MAX_VGPU_TYPES {
            bad.push(short(t));
            continue;
        }
        types.push((id.to_string(), name.to_string()));
    }
    (types, bad)
}

/// `nvidia/current_vgpu_type`: a type id, `0` for none.
pub(crate) fn parse_current(text: &str) -> Result<Option<String>, String> {
    let t = text.trim();
    if t.is_empty() || t.len() > 10 || !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(short(t));
    }
    let t = t.trim_start_matches('0');
    Ok((!t.is_empty()).then(|| t.to_string()))
}

/// `nvidia-smi --query-gpu=pci.bus_id,mig.mode.current --format=csv,noheader`:
/// `00000000:3B:00.0, Enabled` per GPU. GPUs without MIG (`[N/A]`) and lines that do not
/// parse are left out.
pub(crate) fn parse_mig_query(text: &str) -> HashMap<PciAddress, bool> {
    let mut out = HashMap::new();
    for line in text.lines().take(4096) {
        let Some((bus, mode)) = line.split_once(',') else {
            continue;
        };
        let Ok(addr) = bus.trim().parse::<PciAddress>() else {
            continue;
        };
        let on = match mode.trim() {
            "Enabled" => true,
            "Disabled" => false,
            _ => continue,
        };
        out.insert(addr, on);
    }
    out
}

fn good_name(name: &str) -> bool {
    !name.is_empty() && name.chars().count() <= MAX_NAME_LEN && !name.chars().any(char::is_control)
}

fn short(t: &str) -> String {
    t.chars().take(60).collect()
}

/// Reads the vGPU facts of the NVIDIA GPU in `dir` with `numvfs` VFs enabled; `None` when
/// its driver shows neither framework (what every GPU without vGPU software reads: one
/// failed lookup, plus none for its VFs when it has none).
pub(crate) fn read_host(
    dir: &AttrDir,
    numvfs: Option<u32>,
    notes: &mut Vec<String>,
) -> Option<VgpuHost> {
    let mut mdev = MdevTypes::default();
    let mut found_mdev = read_mdev(&dir.path().join(MDEV_TYPES), &mut mdev, notes);
    let mut vfs = Vec::new();
    let mut vfio = VfioTypes::default();
    let mut found_vfio = false;
    let n = numvfs.unwrap_or(0) as usize;
    if n > MAX_VFS {
        notes.push(format!(
            "{}: more than {MAX_VFS} VFs; the first are reported",
            dir.path().display()
        ));
    }
    for i in 0..n.min(MAX_VFS) {
        let link = format!("virtfn{i}");
        let vf = match dir.link_basename(&link) {
            Ok(Some(b)) => b,
            Ok(None) => continue,
            Err(e) => {
                notes.push(format!("{}/{link}: {e}", dir.path().display()));
                continue;
            }
        };
        let Ok(addr) = vf.parse::<PciAddress>() else {
            notes.push(format!(
                "{}/{link}: not a PCI address",
                dir.path().display()
            ));
            continue;
        };
        vfs.push(addr);
        // The kernel's `virtfnN` links point at siblings of the PF.
        let Some(vf_dir) = dir.path().parent().map(|p| p.join(&vf)) else {
            continue;
        };
        found_mdev |= read_mdev(&vf_dir.join(MDEV_TYPES), &mut mdev, notes);
        found_vfio |= read_vfio_vf(&vf_dir, addr, &mut vfio, notes);
    }
    vfs.sort();
    let (framework, mut types, mut vgpus) = if found_vfio {
        let (t, v) = vfio.finish(dir.path(), notes);
        (VgpuFramework::VendorVfio, t, v)
    } else if found_mdev {
        (
            VgpuFramework::Mdev,
            mdev.types.into_values().collect(),
            mdev.vgpus,
        )
    } else {
        return None;
    };
    types.sort_by(|a, b| a.id.cmp(&b.id));
    vgpus.sort_by(|a, b| a.id.cmp(&b.id));
    vgpus.truncate(MAX_VGPUS);
    Some(VgpuHost {
        framework,
        types,
        vfs,
        vgpus,
        mig_mode: None,
    })
}

#[derive(Default)]
struct MdevTypes {
    types: BTreeMap<String, VgpuType>,
    vgpus: Vec<Vgpu>,
}

/// Adds the mdev types in `types_dir` (a GPU's or a VF's) to `into`; false when there is
/// no such directory.
fn read_mdev(types_dir: &Path, into: &mut MdevTypes, notes: &mut Vec<String>) -> bool {
    let entries = match fs::read_dir(types_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return false,
        Err(e) => {
            notes.push(format!("{}: {e}", types_dir.display()));
            return false;
        }
    };
    for (i, entry) in entries.flatten().enumerate() {
        if i >= MAX_VGPU_TYPES {
            notes.push(format!(
                "{}: more than {MAX_VGPU_TYPES} types; the rest are left out",
                types_dir.display()
            ));
            break;
        }
        let id = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if validate_type_id(&id).is_err() {
            notes.push(format!("{}: not a type id", path.display()));
            continue;
        }
        match read_mdev_type(&path, &id, into) {
            Ok(()) => {}
            Err(why) => notes.push(format!("{}: {why}", path.display())),
        }
    }
    true
}

fn read_mdev_type(path: &Path, id: &str, into: &mut MdevTypes) -> Result<(), String> {
    let attr = |f: &str| read_attr(&path.join(f)).map_err(|e| format!("{f}: {e}"));
    let name = attr("name")?;
    if !good_name(&name) {
        return Err(format!("name {:?} is empty, long or odd", short(&name)));
    }
    let available = attr("available_instances")?
        .trim()
        .parse::<u32>()
        .ok()
        .filter(|n| *n <= MAX_INSTANCES)
        .ok_or_else(|| "available_instances is not a count".to_string())?;
    let (framebuffer_mib, max_instances) = match read_attr(&path.join("description")) {
        Ok(d) => parse_description(&d),
        Err(_) => (None, None),
    };
    let (name_fb, mig_backed) = type_from_name(&name);
    let t = into
        .types
        .entry(id.to_string())
        .or_insert_with(|| VgpuType {
            id: id.to_string(),
            name,
            framebuffer_mib: framebuffer_mib.or(name_fb),
            max_instances,
            available: 0,
            mig_backed,
        });
    // Summed over the VFs when the types are on VFs.
    t.available = t.available.saturating_add(available).min(MAX_INSTANCES);
    if let Ok(devs) = fs::read_dir(path.join("devices")) {
        for d in devs.flatten().take(MAX_VGPUS) {
            let uuid = d.file_name().to_string_lossy().into_owned();
            if validate_vgpu_id(&uuid).is_ok() {
                into.vgpus.push(Vgpu {
                    id: uuid,
                    type_id: id.to_string(),
                });
            }
        }
    }
    Ok(())
}

#[derive(Default)]
struct VfioTypes {
    /// Type id → (name, free VFs that list it).
    creatable: BTreeMap<String, (String, u32)>,
    vgpus: Vec<Vgpu>,
}

impl VfioTypes {
    fn finish(mut self, gpu: &Path, notes: &mut Vec<String>) -> (Vec<VgpuType>, Vec<Vgpu>) {
        // A type in use but creatable nowhere any more (the GPU is full) still belongs in
        // the list, with nothing available; sysfs no longer names it.
        for v in &self.vgpus {
            if !self.creatable.contains_key(&v.type_id) {
                notes.push(format!(
                    "{}: vGPU type {} is in use but no VF lists it now; its name is unknown",
                    gpu.display(),
                    v.type_id
                ));
                self.creatable
                    .insert(v.type_id.clone(), (format!("type {}", v.type_id), 0));
            }
        }
        let types = self
            .creatable
            .into_iter()
            .take(MAX_VGPU_TYPES)
            .map(|(id, (name, free))| {
                let (framebuffer_mib, mig_backed) = type_from_name(&name);
                VgpuType {
                    id,
                    name,
                    framebuffer_mib,
                    max_instances: None,
                    available: free,
                    mig_backed,
                }
            })
            .collect();
        (types, self.vgpus)
    }
}

/// Reads one VF's vendor-VFIO files into `into`; false when it has none.
fn read_vfio_vf(
    vf_dir: &Path,
    addr: PciAddress,
    into: &mut VfioTypes,
    notes: &mut Vec<String>,
) -> bool {
    let nv = vf_dir.join(VF_NVIDIA);
    let current = match read_attr(&nv.join("current_vgpu_type")) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return false,
        Err(e) => {
            notes.push(format!("{}/current_vgpu_type: {e}", nv.display()));
            return true;
        }
    };
    match parse_current(&current) {
        Ok(Some(t)) => {
            into.vgpus.push(Vgpu {
                id: addr.to_string(),
                type_id: t,
            });
            return true;
        }
        Ok(None) => {}
        Err(bad) => {
            notes.push(format!(
                "{}/current_vgpu_type: unexpected content {bad:?}",
                nv.display()
            ));
            return true;
        }
    }
    match read_attr(&nv.join("creatable_vgpu_types")) {
        Ok(text) => {
            let (types, bad) = parse_creatable(&text);
            for b in bad {
                notes.push(format!(
                    "{}/creatable_vgpu_types: line {b:?} skipped",
                    nv.display()
                ));
            }
            for (id, name) in types {
                into.creatable.entry(id).or_insert((name, 0)).1 += 1;
            }
        }
        Err(e) => notes.push(format!("{}/creatable_vgpu_types: {e}", nv.display())),
    }
    true
}

/// How `nvidia-smi` is found for MIG mode.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NvidiaSmi {
    /// On a generated tree, the tree's own stand-in ([`crate::fake::FAKE_NVIDIA_SMI`]);
    /// elsewhere `nvidia-smi` on `PATH`. A fake tree never runs the host's.
    #[default]
    Auto,
    Path(PathBuf),
    /// Never asked: MIG mode stays unknown.
    Off,
}

/// How long MIG mode may take to read before the pass goes on without it.
const NVIDIA_SMI_TIMEOUT: Duration = Duration::from_secs(10);

impl NvidiaSmi {
    fn program(&self, root: &Path) -> Option<PathBuf> {
        match self {
            NvidiaSmi::Off => None,
            NvidiaSmi::Path(p) => Some(p.clone()),
            NvidiaSmi::Auto if root.join(super::FAKE_MARKER).exists() => {
                let p = root.join(crate::fake::FAKE_NVIDIA_SMI);
                p.exists().then_some(p)
            }
            NvidiaSmi::Auto => std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|d| d.join(crate::scrub::NVIDIA_SMI))
                    .find(|p| p.is_file())
            }),
        }
    }

    /// Turns MIG mode of the GPU at `gpu` on or off (`nvidia-smi -i BUS_ID -mig 1|0`); the
    /// error carries nvidia-smi's words (it refuses a GPU in use).
    pub(crate) fn set_mig(&self, root: &Path, gpu: PciAddress, on: bool) -> Result<(), String> {
        let smi = self
            .program(root)
            .ok_or_else(|| "nvidia-smi is not installed: MIG mode cannot change".to_string())?;
        let id = format!(
            "{:08X}:{:02X}:{:02X}.{:X}",
            gpu.domain, gpu.bus, gpu.device, gpu.function
        );
        let args = ["-i", id.as_str(), "-mig", if on { "1" } else { "0" }];
        match crate::scrub::process::run_capturing(&smi, &args, NVIDIA_SMI_TIMEOUT) {
            Ok((f, _)) if f.status.success() => Ok(()),
            Ok((f, out)) => {
                let words = if f.stderr.trim().is_empty() {
                    out.trim()
                } else {
                    f.stderr.trim()
                };
                Err(format!(
                    "nvidia-smi {}: {}: {words}",
                    args.join(" "),
                    f.status
                ))
            }
            Err(e) => Err(format!("nvidia-smi {}: {e:?}", args.join(" "))),
        }
    }

    /// The MIG mode of the GPU at `gpu`; `None` when nvidia-smi cannot tell.
    pub(crate) fn mig_mode(&self, root: &Path, gpu: PciAddress) -> Option<bool> {
        let mut notes = Vec::new();
        self.mig_modes(root, &mut notes).get(&gpu).copied()
    }

    /// Each GPU's MIG mode, by address; empty (with a note) when it cannot be read.
    pub(crate) fn mig_modes(
        &self,
        root: &Path,
        notes: &mut Vec<String>,
    ) -> HashMap<PciAddress, bool> {
        let Some(smi) = self.program(root) else {
            return HashMap::new();
        };
        let args = [
            "--query-gpu=pci.bus_id,mig.mode.current",
            "--format=csv,noheader",
        ];
        match crate::scrub::process::run_capturing(&smi, &args, NVIDIA_SMI_TIMEOUT) {
            Ok((f, out)) if f.status.success() => parse_mig_query(&out),
            Ok((f, _)) => {
                notes.push(format!("{}: {} {}", smi.display(), f.status, f.stderr));
                HashMap::new()
            }
            Err(e) => {
                notes.push(format!("{}: {e:?}", smi.display()));
                HashMap::new()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn descriptions() {
        let d = "num_heads=1, frl_config=60, framebuffer=4096M, max_resolution=4096x2160, \
                 max_instance=10";
        assert_eq!(parse_description(d), (Some(4096), Some(10)));
        assert_eq!(
            parse_description("framebuffer=40G,max_instance=1"),
            (Some(40960), Some(1))
        );
        for bad in [
            "",
            "garbage",
            "framebuffer=, max_instance=",
            "framebuffer=4096X",
            "max_instance=-1",
            "max_instance=0",
            "framebuffer=99999999999999999999M",
        ] {
            let (fb, max) = parse_description(bad);
            assert!(fb.is_none() && max.is_none(), "{bad:?}");
        }
    }

    #[test]
    fn names() {
        assert_eq!(
            type_from_name("NVIDIA H100XM-1-10C"),
            (Some(10240), Some(true))
        );
        assert_eq!(type_from_name("GRID A100-4C"), (Some(4096), Some(false)));
        assert_eq!(
            type_from_name("NVIDIA L40S-12Q"),
            (Some(12288), Some(false))
        );
        assert_eq!(
            type_from_name("NVIDIA A100-7-40C"),
            (Some(40960), Some(true))
        );
        for odd in [
            "",
            "NVIDIA",
            "H100",
            "H100-4X",
            "H100-0-10C",
            "A-B-C-D",
            "H100--C",
        ] {
            assert_eq!(type_from_name(odd), (None, None), "{odd:?}");
        }
    }

    #[test]
    fn creatable_lists() {
        let text = "ID    : vGPU Name\n557   : NVIDIA H100XM-1-10C\n558   : NVIDIA H100XM-2-20C\n";
        let (t, bad) = parse_creatable(text);
        assert_eq!(
            t,
            [
                ("557".into(), "NVIDIA H100XM-1-10C".into()),
                ("558".into(), "NVIDIA H100XM-2-20C".into())
            ]
        );
        assert!(bad.is_empty());
        let (t, bad) =
            parse_creatable("ID : vGPU Name\nxyz : A\n12 :\nno colon\n13 : ok\n\u{1}2 : x");
        assert_eq!(t, [("13".into(), "ok".into())]);
        assert_eq!(bad.len(), 4, "{bad:?}");
        assert_eq!(parse_current("0\n"), Ok(None));
        assert_eq!(parse_current("557"), Ok(Some("557".into())));
        assert!(parse_current("").is_err());
        assert!(parse_current("x").is_err());
        assert!(parse_current("99999999999").is_err());
    }

    #[test]
    fn mig_query() {
        let m = parse_mig_query(
            "00000000:3B:00.0, Enabled\n00000000:5E:00.0, Disabled\n00000000:86:00.0, [N/A]\ngarbage\n",
        );
        assert_eq!(m.len(), 2);
        assert!(m[&"0000:3b:00.0".parse().unwrap()]);
        assert!(!m[&"0000:5e:00.0".parse().unwrap()]);
        // What a real H200 host printed (driver 580.159.04), byte for byte.
        let m = parse_mig_query("00000000:00:06.0, Disabled\n");
        assert_eq!(m.get(&"0000:00:06.0".parse().unwrap()), Some(&false));
    }

    proptest! {
        #[test]
        fn parsers_never_panic(s in "\\PC{0,300}") {
            let _ = parse_description(&s);
            let _ = type_from_name(&s);
            let _ = parse_creatable(&s);
            let _ = parse_current(&s);
            let _ = parse_mig_query(&s);
        }

        #[test]
        fn creatable_lines_never_panic(lines in proptest::collection::vec("[0-9A-Za-z :\\-]{0,30}", 0..40)) {
            let (t, _) = parse_creatable(&lines.join("\n"));
            prop_assert!(t.len() <= MAX_VGPU_TYPES);
        }
    }
}

/// Discovery over generated trees, with the fake kernel making and removing vGPUs and
/// the fake `nvidia-smi` changing MIG mode.
#[cfg(test)]
mod fake_tests {
    use super::*;
    use crate::fake::{FakeKernel, FakeOptions, FakeSpec, FakeVgpu, GpuModel, generate_with};
    use crate::host::{Discoverer, Discovery, SysfsOps, device_dir, discover};
    use passage_model::PciDevice;

    fn tree(model: GpuModel, vgpu: FakeVgpu, mig: bool) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sys");
        let spec = FakeSpec {
            gpus: 2,
            model,
            numa_nodes: 1,
        };
        let opts = FakeOptions {
            vgpu: Some(vgpu),
            mig,
            ..FakeOptions::default()
        };
        generate_with(&root, &spec, &opts).unwrap();
        (dir, fs::canonicalize(&root).unwrap())
    }

    fn hosts(d: &Discovery) -> Vec<(&PciDevice, &VgpuHost)> {
        d.devices
            .iter()
            .filter_map(|x| Some((x, x.details.as_ref()?.vgpu.as_ref()?)))
            .collect()
    }

    fn ty<'a>(h: &'a VgpuHost, id: &str) -> Option<&'a VgpuType> {
        h.types.iter().find(|t| t.id == id)
    }

    const UUIDS: [&str; 11] = [
        "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c80",
        "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c81",
        "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c82",
        "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c83",
        "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c84",
        "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c85",
        "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c86",
        "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c87",
        "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c88",
        "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c89",
        "c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c8a",
    ];

    #[test]
    fn mdev_types_count_down_on_create_and_up_on_remove() {
        let (_d, root) = tree(GpuModel::A100, FakeVgpu::Mdev, false);
        let k = FakeKernel::new(&root).unwrap();
        let disc = Discoverer::new();
        let first = disc.discover(&root);
        assert!(first.skipped.is_empty(), "{:?}", first.skipped);
        let hs = hosts(&first);
        assert_eq!(hs.len(), 2);
        let (gpu, h) = hs[0];
        assert_eq!(h.framework, VgpuFramework::Mdev);
        assert_eq!(h.mig_mode, Some(false), "through the fake nvidia-smi");
        let four = ty(h, "nvidia-472").unwrap();
        assert_eq!(four.name, "GRID A100-4C");
        assert_eq!(
            (
                four.framebuffer_mib,
                four.max_instances,
                four.available,
                four.mig_backed
            ),
            (Some(4096), Some(10), 10, Some(false))
        );
        assert_eq!(
            ty(h, "nvidia-468").unwrap().available,
            0,
            "MIG-backed needs MIG mode"
        );
        let gdir = device_dir(&root, &gpu.id);
        let create = |t: &str, u: &str| {
            k.write_attr(&gdir.join(format!("mdev_supported_types/{t}/create")), u)
        };
        create("nvidia-472", UUIDS[0]).unwrap();
        assert!(
            root.join("bus/mdev/devices")
                .join(UUIDS[0])
                .join("mdev_type")
                .exists()
        );
        let d = disc.discover(&root);
        let h = hosts(&d)[0].1.clone();
        assert_eq!(ty(&h, "nvidia-472").unwrap().available, 9);
        assert_eq!(
            ty(&h, "nvidia-473").unwrap().available,
            0,
            "one type per GPU"
        );
        assert_eq!(
            h.vgpus,
            [Vgpu {
                id: UUIDS[0].into(),
                type_id: "nvidia-472".into()
            }]
        );
        assert_eq!(hosts(&d)[1].1.vgpus.len(), 0, "the other GPU is untouched");
        assert_eq!(ty(hosts(&d)[1].1, "nvidia-473").unwrap().available, 8);

        // Refusals, in the kernel's terms.
        let e = create("nvidia-472", UUIDS[0]).unwrap_err();
        assert!(e.to_string().contains("EEXIST"), "{e}");
        let e = create("nvidia-472", "not-a-uuid").unwrap_err();
        assert!(e.to_string().contains("EINVAL"), "{e}");
        let e = create("nvidia-473", UUIDS[1]).unwrap_err();
        assert!(e.to_string().contains("EUSERS"), "{e}");
        for u in &UUIDS[1..10] {
            create("nvidia-472", u).unwrap();
        }
        let e = create("nvidia-472", UUIDS[10]).unwrap_err();
        assert!(e.to_string().contains("available_instances 0"), "{e}");

        // A restarted agent (a fresh discoverer) finds the vGPUs that exist.
        let fresh = Discoverer::new().discover(&root);
        let h = hosts(&fresh)[0].1.clone();
        assert_eq!(h.vgpus.len(), 10);
        assert_eq!(ty(&h, "nvidia-472").unwrap().available, 0);
        assert_eq!(fresh, disc.discover(&root), "warm and cold agree");

        // Removing gives back one instance; the last one gives back every type.
        let remove = |u: &str| k.write_attr(&gdir.join(u).join("remove"), "1");
        let e =
            remove(UUIDS[0]).and_then(|_| k.write_attr(&gdir.join(UUIDS[1]).join("remove"), "2"));
        assert!(e.unwrap_err().to_string().contains("EINVAL"));
        let h = hosts(&disc.discover(&root))[0].1.clone();
        assert_eq!(ty(&h, "nvidia-472").unwrap().available, 1);
        assert!(!root.join("bus/mdev/devices").join(UUIDS[0]).exists());
        for u in &UUIDS[1..10] {
            remove(u).unwrap();
        }
        let h = hosts(&disc.discover(&root))[0].1.clone();
        assert!(h.vgpus.is_empty());
        assert_eq!(ty(&h, "nvidia-473").unwrap().available, 8);
    }

    #[test]
    fn vendor_vfio_vfs_take_a_type_and_give_it_back() {
        let (_d, root) = tree(GpuModel::H100, FakeVgpu::Vfio, false);
        let k = FakeKernel::new(&root).unwrap();
        let disc = Discoverer::new();
        let d = disc.discover(&root);
        assert!(d.skipped.is_empty(), "{:?}", d.skipped);
        let hs = hosts(&d);
        assert_eq!(hs.len(), 2, "VFs host nothing themselves");
        let (gpu, h) = (hs[0].0.clone(), hs[0].1.clone());
        assert_eq!(h.framework, VgpuFramework::VendorVfio);
        assert_eq!(h.vfs.len(), 32);
        // VFs are PCI functions of their own, pointing back at the GPU.
        for vf in &h.vfs {
            let f = d.devices.iter().find(|x| x.address() == *vf).unwrap();
            assert_eq!(f.details.as_ref().unwrap().physfn, Some(gpu.address()));
        }
        let ten = ty(&h, "562").unwrap();
        assert_eq!(ten.name, "NVIDIA H100XM-10C");
        assert_eq!(
            (ten.framebuffer_mib, ten.max_instances, ten.available),
            (Some(10240), None, 32)
        );
        assert!(ty(&h, "557").is_none(), "MIG-backed types need MIG mode");

        let vf_dir = |i: usize| device_dir(&root, &gpu.id).with_file_name(h.vfs[i].to_string());
        let set = |i: usize, v: &str| k.write_attr(&vf_dir(i).join("nvidia/current_vgpu_type"), v);
        set(0, "562").unwrap();
        let h2 = hosts(&disc.discover(&root))[0].1.clone();
        assert_eq!(
            h2.vgpus,
            [Vgpu {
                id: h.vfs[0].to_string(),
                type_id: "562".into()
            }]
        );
        assert_eq!(ty(&h2, "562").unwrap().available, 31);
        assert!(ty(&h2, "561").is_none(), "one time-sliced type per GPU");
        let e = set(1, "561").unwrap_err();
        assert!(e.to_string().contains("EINVAL"), "{e}");
        let e = set(0, "562").unwrap_err();
        assert!(e.to_string().contains("EBUSY"), "{e}");
        let e = set(1, "five").unwrap_err();
        assert!(e.to_string().contains("EINVAL"), "{e}");
        for i in 1..8 {
            set(i, "562").unwrap();
        }
        let e = set(8, "562").unwrap_err();
        assert!(e.to_string().contains("cannot be created"), "{e}");

        // Full: the type is still reported (from the vGPUs), with nothing available.
        let fresh = Discoverer::new().discover(&root);
        let h3 = hosts(&fresh)[0].1.clone();
        assert_eq!(h3.vgpus.len(), 8);
        assert_eq!(ty(&h3, "562").unwrap().available, 0);
        assert!(
            fresh.notes.iter().any(|n| n.contains("no VF lists it")),
            "{:?}",
            fresh.notes
        );

        set(0, "0").unwrap();
        let h4 = hosts(&disc.discover(&root))[0].1.clone();
        assert_eq!(h4.vgpus.len(), 7);
        assert_eq!(
            ty(&h4, "562").unwrap().available,
            25,
            "the free VFs list it again"
        );
    }

    #[test]
    fn mig_mode_comes_from_nvidia_smi() {
        let (_d, root) = tree(GpuModel::H100, FakeVgpu::Vfio, false);
        let smi = root.join(crate::fake::FAKE_NVIDIA_SMI);
        let run = |args: &[&str]| {
            std::process::Command::new(&smi)
                .args(args)
                .output()
                .unwrap()
        };
        let d = discover(&root);
        let (gpu, h) = (hosts(&d)[0].0.clone(), hosts(&d)[0].1.clone());
        assert_eq!(h.mig_mode, Some(false));
        let out = run(&["-i", "0", "-mig", "1"]);
        assert!(out.status.success(), "{out:?}");
        let d = discover(&root);
        let h = hosts(&d)[0].1.clone();
        assert_eq!(h.mig_mode, Some(true));
        assert_eq!(hosts(&d)[1].1.mig_mode, Some(false), "per GPU");
        let ids: Vec<_> = h.types.iter().map(|t| t.id.as_str()).collect();
        assert_eq!(ids, ["557", "558", "559", "560"], "MIG-backed types only");
        assert!(h.types.iter().all(|t| t.mig_backed == Some(true)));

        // A GPU hosting a vGPU cannot change mode; by bus id as well as by index.
        let k = FakeKernel::new(&root).unwrap();
        let vf = device_dir(&root, &gpu.id).with_file_name(h.vfs[3].to_string());
        k.write_attr(&vf.join("nvidia/current_vgpu_type"), "558")
            .unwrap();
        let out = run(&["-i", "00000000:05:00.0", "-mig", "0"]);
        assert!(!out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("In use"),
            "{out:?}"
        );
        k.write_attr(&vf.join("nvidia/current_vgpu_type"), "0")
            .unwrap();
        assert!(
            run(&["-i", &gpu.address().to_string(), "-mig", "0"])
                .status
                .success()
        );
        let h = hosts(&discover(&root))[0].1.clone();
        assert_eq!(
            (h.mig_mode, ty(&h, "561").map(|t| t.available)),
            (Some(false), Some(32))
        );
        assert!(
            !run(&["-i", "7", "-mig", "1"]).status.success(),
            "no such GPU"
        );

        // Told not to ask: unknown.
        let off = Discoverer::new()
            .with_nvidia_smi(NvidiaSmi::Off)
            .discover(&root);
        assert_eq!(hosts(&off)[0].1.mig_mode, None);
        // An mdev tree generated in MIG mode.
        let (_d2, root2) = tree(GpuModel::A100, FakeVgpu::Mdev, true);
        let h = hosts(&discover(&root2))[0].1.clone();
        assert_eq!(h.mig_mode, Some(true));
        assert_eq!(ty(&h, "nvidia-468").unwrap().available, 7);
        assert_eq!(ty(&h, "nvidia-472").unwrap().available, 0);
    }

    #[test]
    fn garbled_vgpu_files_are_notes_not_failures() {
        let (_d, root) = tree(GpuModel::A100, FakeVgpu::Mdev, false);
        let d = discover(&root);
        let gdir = device_dir(&root, &hosts(&d)[0].0.id);
        let types = gdir.join("mdev_supported_types");
        fs::write(types.join("nvidia-472/description"), "framebuffer=lots\n").unwrap();
        fs::write(types.join("nvidia-473/available_instances"), "many\n").unwrap();
        fs::write(types.join("nvidia-474/name"), "x".repeat(5000)).unwrap();
        fs::create_dir(types.join("bad type")).unwrap();
        let d2 = discover(&root);
        assert_eq!(d2.devices.len(), d.devices.len(), "no function is dropped");
        let h = hosts(&d2)[0].1.clone();
        let four = ty(&h, "nvidia-472").unwrap();
        assert_eq!(
            (four.max_instances, four.framebuffer_mib),
            (None, Some(4096)),
            "from the name"
        );
        assert!(ty(&h, "nvidia-473").is_none() && ty(&h, "nvidia-474").is_none());
        assert!(h.validate().is_ok());
        assert!(
            d2.notes.iter().any(|n| n.contains("available_instances")),
            "{:?}",
            d2.notes
        );
        assert!(
            d2.notes.iter().any(|n| n.contains("not a type id")),
            "{:?}",
            d2.notes
        );

        let (_d, root) = tree(GpuModel::H100, FakeVgpu::Vfio, false);
        let d = discover(&root);
        let (gpu, h) = (hosts(&d)[0].0.clone(), hosts(&d)[0].1.clone());
        let vf = |i: usize| device_dir(&root, &gpu.id).with_file_name(h.vfs[i].to_string());
        fs::write(
            vf(0).join("nvidia/creatable_vgpu_types"),
            "ID : vGPU Name\n\u{7}junk\n562 : \n12x : y\n",
        )
        .unwrap();
        fs::write(vf(1).join("nvidia/current_vgpu_type"), "banana\n").unwrap();
        fs::write(
            vf(2).join("nvidia/creatable_vgpu_types"),
            "561   : NVIDIA H100XM-4C\n".repeat(400),
        )
        .unwrap();
        let d2 = discover(&root);
        assert_eq!(d2.devices.len(), d.devices.len());
        let h2 = hosts(&d2)[0].1.clone();
        assert!(h2.validate().is_ok());
        assert_eq!(
            ty(&h2, "562").unwrap().available,
            29,
            "three VFs say nothing usable of 562"
        );
        assert!(
            d2.notes.iter().any(|n| n.contains("skipped")),
            "{:?}",
            d2.notes
        );
        assert!(
            d2.notes.iter().any(|n| n.contains("banana")),
            "{:?}",
            d2.notes
        );
    }

    #[test]
    fn gpus_without_vgpu_software_report_none() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sys");
        generate_with(&root, &FakeSpec::default(), &FakeOptions::default()).unwrap();
        let d = discover(&root);
        assert!(hosts(&d).is_empty());
        assert!(
            d.devices
                .iter()
                .all(|x| x.details.as_ref().unwrap().physfn.is_none())
        );
        assert!(!root.join(crate::fake::FAKE_NVIDIA_SMI).exists());
        // Mismatched options are refused before anything is written.
        let spec = FakeSpec {
            model: GpuModel::V100,
            ..FakeSpec::default()
        };
        let opts = FakeOptions {
            vgpu: Some(FakeVgpu::Mdev),
            ..FakeOptions::default()
        };
        assert!(generate_with(&dir.path().join("x"), &spec, &opts).is_err());
        let opts = FakeOptions {
            mig: true,
            ..FakeOptions::default()
        };
        assert!(generate_with(&dir.path().join("y"), &FakeSpec::default(), &opts).is_err());
    }
}
