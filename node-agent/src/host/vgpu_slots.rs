//! The vGPUs this node makes for VMs. The control plane names each vGPU slot by its GPU's
//! path and a UUID (`…/0000:3b:00.0/<uuid>`); the node makes it as the GPU's driver
//! allows:
//!
//! - mdev: the UUID is written to `mdev_supported_types/<type>/create`; the vGPU is
//!   `/sys/bus/mdev/devices/<uuid>` and goes when `1` is written to its `remove`;
//! - vendor VFIO: a free virtual function of the GPU gets the type through
//!   `nvidia/current_vgpu_type` (and loses it with `0`); the VF is then passed through.
//!
//! Each vGPU made is recorded (`vgpus.json` in the state directory: its VM, its VF) so
//! that an agent restart adopts what exists, and so that a late release from a VM
//! clears nothing of a later owner's: the same slot, and the same VF, serve one tenant
//! after another.

use super::{SysfsOps, device_dir, link_basename, read_attr};
use crate::host::vgpu::{NvidiaSmi, parse_creatable, parse_current};
use crate::state::{read_json, write_json};
use passage_model::protocol::{ScrubReport, ScrubStep};
use passage_model::{DevicePath, VmId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

const STATE_FILE: &str = "vgpus.json";

/// One vGPU this node made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VgpuRecord {
    pub vm: VmId,
    /// The driver's type id it was made as.
    pub type_id: String,
    /// For vendor VFIO: the VF that is the vGPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vf: Option<String>,
}

/// The made vGPUs, by slot UUID.
pub type VgpuState = BTreeMap<String, VgpuRecord>;

pub struct VgpuSlots {
    ops: Arc<dyn SysfsOps>,
    state_path: PathBuf,
    /// Changes a GPU's MIG mode when the type asked for needs the other one.
    nvidia_smi: NvidiaSmi,
    // Serialises read-modify-write of the record file between concurrent tasks.
    lock: Mutex<()>,
}

fn slot_id(slot: &DevicePath) -> Result<String, String> {
    slot.vgpu()
        .map(|u| u.hyphenated().to_string())
        .ok_or_else(|| format!("{slot} is not a vGPU slot"))
}

impl VgpuSlots {
    pub fn new(ops: Arc<dyn SysfsOps>, state_dir: &Path) -> Self {
        VgpuSlots {
            ops,
            state_path: state_dir.join(STATE_FILE),
            nvidia_smi: NvidiaSmi::Auto,
            lock: Mutex::new(()),
        }
    }

    pub fn with_nvidia_smi(mut self, smi: NvidiaSmi) -> Self {
        self.nvidia_smi = smi;
        self
    }

    fn root(&self) -> &Path {
        self.ops.root()
    }

    pub fn records(&self) -> Result<VgpuState, String> {
        read_json(&self.state_path)
            .map(Option::unwrap_or_default)
            .map_err(|e| format!("{}: {e}", self.state_path.display()))
    }

    fn save(&self, state: &VgpuState) -> Result<(), String> {
        write_json(&self.state_path, state, 0o600)
            .map_err(|e| format!("{}: {e}", self.state_path.display()))
    }

    fn mdev_dir(&self, slot: &DevicePath) -> PathBuf {
        device_dir(self.root(), slot)
    }

    fn vf_dir(&self, gpu_dir: &Path, vf: &str) -> PathBuf {
        gpu_dir.parent().unwrap_or(gpu_dir).join(vf)
    }

    /// Makes the vGPU of `slot` for `vm`, as type `want` (the driver's id or name); a
    /// vGPU this VM already has is kept. Errors carry the kernel's words.
    pub fn make(&self, slot: &DevicePath, want: &str, vm: VmId) -> Result<(), String> {
        let id = slot_id(slot)?;
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut state = self.records()?;
        if let Some(r) = state.get(&id) {
            if r.vm != vm {
                return Err(format!(
                    "vGPU {id} still belongs to VM {} (its release and scrub have not run)",
                    r.vm
                ));
            }
            if self.exists(slot, r) {
                return Ok(());
            }
        }
        let gpu_dir = device_dir(self.root(), &slot.gpu());
        if !gpu_dir.is_dir() {
            return Err(format!("no GPU at {}", slot.gpu()));
        }
        self.mig_mode_for(slot, &gpu_dir, want)?;
        let record = if gpu_dir.join("mdev_supported_types").is_dir() {
            self.make_mdev(&gpu_dir, &id, want, vm)?
        } else {
            let taken: Vec<String> = state
                .iter()
                .filter(|(k, _)| **k != id)
                .filter_map(|(_, r)| r.vf.clone())
                .collect();
            self.make_vf(&gpu_dir, want, vm, &taken, &mut state, &id)?
        };
        state.insert(id, record);
        self.save(&state)
    }

    /// Turns MIG mode off on a whole NVIDIA GPU being scrubbed, when it is on: a GPU that
    /// hosted MIG-backed vGPUs, or whose tenant turned MIG on from inside its VM, goes to
    /// the next tenant as a whole GPU again. Runs before the pipeline (a mode change takes
    /// effect at the GPU's next reset). `None`: nothing to do (not an NVIDIA GPU, MIG
    /// mode off, or no nvidia-smi to tell).
    pub fn mig_off(&self, dev: &DevicePath) -> Option<ScrubStep> {
        if dev.vgpu().is_some() {
            return None;
        }
        let dir = device_dir(self.root(), dev);
        let vendor = read_attr(&dir.join("vendor")).ok()?;
        if !vendor.trim().eq_ignore_ascii_case("0x10de") {
            return None;
        }
        let gpu = dev.address();
        if self.nvidia_smi.mig_mode(self.root(), gpu) != Some(true) {
            return None;
        }
        let started = Instant::now();
        let done = self.nvidia_smi.set_mig(self.root(), gpu, false);
        if done.is_ok() {
            tracing::info!(%gpu, "MIG mode turned off by the scrub");
        }
        Some(ScrubStep {
            name: "mig_off".into(),
            ok: done.is_ok(),
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            detail: Some(
                done.err()
                    .unwrap_or_else(|| "MIG mode was on: turned off".into()),
            ),
            skipped: false,
        })
    }

    /// Puts the GPU in the MIG mode the type `want` needs (MIG-backed types exist only
    /// with MIG mode on, time-sliced ones only with it off) when its mode is known and
    /// differs. nvidia-smi refuses while the GPU hosts a vGPU; its words are the error.
    fn mig_mode_for(&self, slot: &DevicePath, gpu_dir: &Path, want: &str) -> Result<(), String> {
        let Some(needs) = self.type_needs_mig(gpu_dir, want) else {
            return Ok(());
        };
        let gpu = slot.gpu().address();
        match self.nvidia_smi.mig_mode(self.root(), gpu) {
            Some(on) if on != needs => {
                self.nvidia_smi
                    .set_mig(self.root(), gpu, needs)
                    .map_err(|e| {
                        format!(
                            "vGPU type {want:?} needs MIG mode {}: {e}",
                            if needs { "on" } else { "off" }
                        )
                    })?;
                tracing::info!(%gpu, mig = needs, vgpu_type = want, "MIG mode changed for a vGPU type");
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Whether `want` (a type id or name) is MIG-backed: by its name, or by the name the
    /// GPU lists for the id (mdev lists every type; a vendor-VFIO VF only those it can
    /// make now).
    fn type_needs_mig(&self, gpu_dir: &Path, want: &str) -> Option<bool> {
        if let Some(m) = passage_model::vgpu::type_from_name(want).1 {
            return Some(m);
        }
        let mdev = gpu_dir.join("mdev_supported_types").join(want);
        if passage_model::vgpu::validate_type_id(want).is_ok() && mdev.is_dir() {
            let name = read_attr(&mdev.join("name")).ok()?;
            return passage_model::vgpu::type_from_name(name.trim()).1;
        }
        let entries = fs::read_dir(gpu_dir).ok()?;
        for e in entries.flatten().take(passage_model::vgpu::MAX_VFS) {
            if !e.file_name().to_string_lossy().starts_with("virtfn") {
                continue;
            }
            let Ok(Some(vf)) = link_basename(&e.path()) else {
                continue;
            };
            let nv = self.vf_dir(gpu_dir, &vf).join("nvidia");
            let creatable = read_attr(&nv.join("creatable_vgpu_types")).unwrap_or_default();
            let (types, _) = parse_creatable(&creatable);
            if let Some((_, name)) = types.iter().find(|(id, _)| id == want) {
                return passage_model::vgpu::type_from_name(name).1;
            }
        }
        None
    }

    fn make_mdev(
        &self,
        gpu_dir: &Path,
        id: &str,
        want: &str,
        vm: VmId,
    ) -> Result<VgpuRecord, String> {
        let types = gpu_dir.join("mdev_supported_types");
        let entries = fs::read_dir(&types).map_err(|e| format!("{}: {e}", types.display()))?;
        let mut found = None;
        for e in entries.flatten().take(passage_model::vgpu::MAX_VGPU_TYPES) {
            let type_id = e.file_name().to_string_lossy().into_owned();
            let name = read_attr(&e.path().join("name")).unwrap_or_default();
            if type_id == want || name.trim() == want {
                found = Some(type_id);
                break;
            }
        }
        let type_id =
            found.ok_or_else(|| format!("{} offers no vGPU type {want:?}", gpu_dir.display()))?;
        let existing = self.root().join("bus/mdev/devices").join(id);
        if !existing.exists() {
            self.ops
                .write_attr(&types.join(&type_id).join("create"), id)
                .map_err(|e| format!("creating mdev {id} of type {type_id}: {e}"))?;
        }
        Ok(VgpuRecord {
            vm,
            type_id,
            vf: None,
        })
    }

    /// Makes a free VF of the GPU the vGPU. The record is saved before the VF gets its
    /// type: a crash between the two leaves a record of a VF without a vGPU (harmless: its
    /// release and scrub find nothing to clear), never a typed VF that no record names,
    /// which no scrub could find (its slot's UUID is nowhere in sysfs).
    fn make_vf(
        &self,
        gpu_dir: &Path,
        want: &str,
        vm: VmId,
        taken: &[String],
        state: &mut VgpuState,
        id: &str,
    ) -> Result<VgpuRecord, String> {
        let mut vfs: Vec<(u32, String)> = Vec::new();
        let entries = fs::read_dir(gpu_dir).map_err(|e| format!("{}: {e}", gpu_dir.display()))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(n) = name
                .strip_prefix("virtfn")
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if let Ok(Some(vf)) = link_basename(&e.path()) {
                vfs.push((n, vf));
            }
        }
        if vfs.is_empty() {
            return Err(format!(
                "{} has neither mdev types nor virtual functions: it hosts no vGPUs",
                gpu_dir.display()
            ));
        }
        vfs.sort();
        let mut last_err = format!(
            "no free virtual function of {} offers {want:?}",
            gpu_dir.display()
        );
        let before = state.get(id).cloned();
        for (_, vf) in vfs {
            if taken.contains(&vf) {
                continue;
            }
            let nv = self.vf_dir(gpu_dir, &vf).join("nvidia");
            let Ok(current) = read_attr(&nv.join("current_vgpu_type")) else {
                continue;
            };
            if !matches!(parse_current(&current), Ok(None)) {
                continue;
            }
            let creatable = read_attr(&nv.join("creatable_vgpu_types")).unwrap_or_default();
            let (types, _) = parse_creatable(&creatable);
            let Some((type_id, _)) = types.iter().find(|(id, name)| id == want || name == want)
            else {
                continue;
            };
            let record = VgpuRecord {
                vm,
                type_id: type_id.clone(),
                vf: Some(vf.clone()),
            };
            state.insert(id.to_string(), record.clone());
            self.save(state)?;
            match self.ops.write_attr(&nv.join("current_vgpu_type"), type_id) {
                Ok(()) => return Ok(record),
                Err(e) => last_err = format!("making {vf} a vGPU of type {type_id}: {e}"),
            }
        }
        match before {
            Some(r) => state.insert(id.to_string(), r),
            None => state.remove(id),
        };
        self.save(state)?;
        Err(last_err)
    }

    fn exists(&self, slot: &DevicePath, r: &VgpuRecord) -> bool {
        match &r.vf {
            None => self.mdev_dir(slot).is_dir(),
            Some(vf) => {
                let gpu_dir = device_dir(self.root(), &slot.gpu());
                read_attr(&self.vf_dir(&gpu_dir, vf).join("nvidia/current_vgpu_type"))
                    .ok()
                    .and_then(|t| parse_current(&t).ok().flatten())
                    .is_some()
            }
        }
    }

    /// Releases `vm`'s vGPU of `slot`: destroyed if it is still `vm`'s, left alone if a
    /// later VM has it (a late release), nothing to do if it is gone.
    pub fn release(&self, slot: &DevicePath, vm: VmId) -> Result<(), String> {
        let id = slot_id(slot)?;
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut state = self.records()?;
        match state.get(&id) {
            Some(r) if r.vm == vm => {
                self.destroy_one(slot, r)?;
                state.remove(&id);
                self.save(&state)
            }
            _ => Ok(()),
        }
    }

    fn destroy_one(&self, slot: &DevicePath, r: &VgpuRecord) -> Result<(), String> {
        match &r.vf {
            None => {
                let dir = self.mdev_dir(slot);
                if dir.is_dir() {
                    self.ops
                        .write_attr(&dir.join("remove"), "1")
                        .map_err(|e| format!("removing mdev {}: {e}", dir.display()))?;
                }
                Ok(())
            }
            Some(vf) => {
                let gpu_dir = device_dir(self.root(), &slot.gpu());
                let file = self.vf_dir(&gpu_dir, vf).join("nvidia/current_vgpu_type");
                match read_attr(&file).ok().map(|t| parse_current(&t)) {
                    Some(Ok(Some(_))) => self
                        .ops
                        .write_attr(&file, "0")
                        .map_err(|e| format!("clearing the vGPU of {vf}: {e}")),
                    _ => Ok(()),
                }
            }
        }
    }

    /// The scrub of a released slot: its vGPU destroyed (whoever it was made for: a
    /// dirty slot has no owner), then checked gone.
    pub fn scrub(&self, slot: &DevicePath) -> ScrubReport {
        let mut steps = Vec::new();
        let started = Instant::now();
        let id = slot_id(slot).unwrap_or_default();
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let destroyed = self.records().and_then(|mut state| {
            let record = state.get(&id).cloned().unwrap_or(VgpuRecord {
                // Not recorded: an mdev by this UUID may still exist (a record lost).
                vm: VmId::new_random(),
                type_id: String::new(),
                vf: None,
            });
            self.destroy_one(slot, &record)?;
            let gone = !self.exists(slot, &record);
            if gone {
                state.remove(&id);
                self.save(&state)?;
            }
            Ok(gone)
        });
        let ms = |t: Instant| u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX);
        let (ok, detail) = match &destroyed {
            Ok(_) => (true, None),
            Err(e) => (false, Some(e.clone())),
        };
        steps.push(ScrubStep {
            name: "destroy_vgpu".into(),
            ok,
            duration_ms: ms(started),
            detail,
            skipped: false,
        });
        if ok {
            let checked = Instant::now();
            let gone = matches!(destroyed, Ok(true));
            steps.push(ScrubStep {
                name: "check_vgpu_gone".into(),
                ok: gone,
                duration_ms: ms(checked),
                detail: (!gone).then(|| "the vGPU is still there after its removal".into()),
                skipped: false,
            });
        }
        ScrubReport {
            device: slot.clone(),
            ok: steps.iter().all(|s| s.ok),
            steps,
        }
    }

    /// What the hypervisor is given for `slot`: the slot itself for an mdev (its path is
    /// the mdev's), or for a vendor-VFIO vGPU its VF's path with the slot's UUID below it,
    /// so the launch passes the VF through and still knows it is a vGPU.
    pub fn launch_path(&self, slot: &DevicePath) -> Result<DevicePath, String> {
        let id = slot_id(slot)?;
        let state = self.records()?;
        let r = state
            .get(&id)
            .ok_or_else(|| format!("vGPU {id} was not made on this node"))?;
        match &r.vf {
            None => Ok(slot.clone()),
            Some(vf) => {
                let gpu = slot.gpu().to_string();
                let above = gpu.rsplit_once('/').map_or("", |(a, _)| a);
                format!("{above}/{vf}/{id}")
                    .parse()
                    .map_err(|e| format!("the VF of vGPU {id}: {e}"))
            }
        }
    }
}
