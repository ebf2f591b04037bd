//! The fake world's vGPU side: type tables for the generated GPUs, the capacity rules
//! both the generator and the fake kernel apply, and the `nvidia-smi` stand-in for MIG
//! mode.
//!
//! The tables are illustrative: real names and plausible counts (an A100 40GB's
//! time-sliced `A100-4C` fits 10 times; an H100 80GB's `H100XM-1-10C` 7 times, one per MIG
//! slice), type ids made up. Capacity follows NVIDIA's rules as far as the fake needs:
//! time-sliced types only with MIG mode off and one type per GPU at a time; MIG-backed
//! types only with MIG mode on, mixed freely within the GPU's 7 compute slices. A100s use
//! the mdev framework with the types on the GPU itself (not on VFs); H100s use vendor
//! VFIO over 32 VFs.

use super::tree::GpuModel;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Where a generated tree keeps its stand-ins for the host's GPU tools (relative to its
/// root): what a fake node's scrub searches instead of `PATH`.
pub const FAKE_BIN_DIR: &str = ".passage-fake-bin";
/// The `nvidia-smi` stand-in a generated tree carries (relative to its root).
pub const FAKE_NVIDIA_SMI: &str = ".passage-fake-bin/nvidia-smi";
/// Its state: one `BDF 0|1` line per GPU.
const MIG_STATE: &str = ".passage-fake-bin/mig-mode";
/// Per GPU and mode, what the stand-in rewrites when MIG mode changes.
const MIG_TABLES: &str = ".passage-fake-bin/mig";

/// Which framework `fake-sysfs --vgpu` emulates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FakeVgpu {
    /// mdev types on each GPU (with `--model a100`).
    Mdev,
    /// NVIDIA vendor VFIO over SR-IOV VFs (with `--model h100`).
    Vfio,
}

/// VFs each vendor-VFIO GPU has (an H100's `sriov_totalvfs`).
pub(crate) const FAKE_VFS: u32 = 32;

#[derive(Clone, Copy, Debug)]
pub(crate) struct TypeSpec {
    pub id: &'static str,
    pub name: &'static str,
    pub fb_mib: u64,
    pub max: u32,
    /// MIG compute slices taken (0: time-sliced).
    pub slices: u32,
}

const fn t(id: &'static str, name: &'static str, gb: u64, max: u32, slices: u32) -> TypeSpec {
    TypeSpec {
        id,
        name,
        fb_mib: gb * 1024,
        max,
        slices,
    }
}

const A100: &[TypeSpec] = &[
    t("nvidia-467", "GRID A100-7-40C", 40, 1, 7),
    t("nvidia-468", "GRID A100-1-5C", 5, 7, 1),
    t("nvidia-469", "GRID A100-2-10C", 10, 3, 2),
    t("nvidia-470", "GRID A100-3-20C", 20, 2, 3),
    t("nvidia-472", "GRID A100-4C", 4, 10, 0),
    t("nvidia-473", "GRID A100-5C", 5, 8, 0),
    t("nvidia-474", "GRID A100-8C", 8, 5, 0),
    t("nvidia-475", "GRID A100-10C", 10, 4, 0),
    t("nvidia-476", "GRID A100-20C", 20, 2, 0),
    t("nvidia-477", "GRID A100-40C", 40, 1, 0),
];

const H100: &[TypeSpec] = &[
    t("557", "NVIDIA H100XM-1-10C", 10, 7, 1),
    t("558", "NVIDIA H100XM-2-20C", 20, 3, 2),
    t("559", "NVIDIA H100XM-3-40C", 40, 2, 3),
    t("560", "NVIDIA H100XM-7-80C", 80, 1, 7),
    t("561", "NVIDIA H100XM-4C", 4, 20, 0),
    t("562", "NVIDIA H100XM-10C", 10, 8, 0),
    t("563", "NVIDIA H100XM-20C", 20, 4, 0),
    t("564", "NVIDIA H100XM-40C", 40, 2, 0),
    t("565", "NVIDIA H100XM-80C", 80, 1, 0),
];

/// The framework a model's fake uses, and its types.
pub(crate) fn table(model: GpuModel) -> Option<(FakeVgpu, &'static [TypeSpec])> {
    match model {
        GpuModel::A100 => Some((FakeVgpu::Mdev, A100)),
        GpuModel::H100 => Some((FakeVgpu::Vfio, H100)),
        _ => None,
    }
}

/// The table of a GPU by its PCI device id (what the fake kernel knows of a GPU).
pub(crate) fn table_for_device(device: u16) -> Option<&'static [TypeSpec]> {
    [GpuModel::A100, GpuModel::H100]
        .into_iter()
        .find(|m| m.ids().0 == device)
        .and_then(table)
        .map(|(_, t)| t)
}

/// How many more of `t` fit on a GPU in MIG mode `mig` that hosts `existing` (type ids).
pub(crate) fn fits(types: &[TypeSpec], mig: bool, existing: &[String], t: &TypeSpec) -> u32 {
    let count = existing.iter().filter(|e| *e == t.id).count() as u32;
    if (t.slices > 0) != mig {
        return 0;
    }
    if t.slices == 0 {
        // Time-sliced: one type per GPU.
        if existing.iter().any(|e| e != t.id) {
            return 0;
        }
        return t.max.saturating_sub(count);
    }
    let used: u32 = existing
        .iter()
        .filter_map(|e| types.iter().find(|x| x.id == e))
        .map(|x| x.slices)
        .sum();
    t.max
        .saturating_sub(count)
        .min(7u32.saturating_sub(used) / t.slices)
}

/// A free VF's `nvidia/creatable_vgpu_types`: the header, then every type that fits.
pub(crate) fn creatable_text(types: &[TypeSpec], mig: bool, existing: &[String]) -> String {
    let mut s = String::from("ID    : vGPU Name\n");
    for t in types {
        if fits(types, mig, existing, t) > 0 {
            s.push_str(&format!("{:<6}: {}\n", t.id, t.name));
        }
    }
    s
}

/// NVIDIA's mdev `description` for a type.
pub(crate) fn description(t: &TypeSpec) -> String {
    format!(
        "num_heads=1, frl_config=60, framebuffer={}M, max_resolution=4096x2160, max_instance={}\n",
        t.fb_mib, t.max
    )
}

/// MIG mode of the GPU `bdf` as the stand-in last set it (off when unknown).
pub(crate) fn mig_on(root: &Path, bdf: &str) -> bool {
    crate::host::read_attr(&root.join(MIG_STATE)).is_ok_and(|s| {
        s.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == [bdf, "1"])
    })
}

/// One GPU of a generated tree as [`write_mig_support`] needs it: the GPU's directory and
/// address (relative to the root), and its VFs'.
pub(crate) struct FakeGpu {
    pub rel: PathBuf,
    pub bdf: String,
    pub vfs: Vec<PathBuf>,
}

/// Writes the `nvidia-smi` stand-in, its state and, per GPU and mode, the sysfs contents
/// of an idle GPU in that mode (what the stand-in rewrites on a change).
pub(crate) fn write_mig_support(
    root: &Path,
    framework: FakeVgpu,
    types: &[TypeSpec],
    gpus: &[FakeGpu],
    mig: bool,
) -> io::Result<()> {
    let tables = root.join(MIG_TABLES);
    fs::create_dir_all(&tables)?;
    let mut state = String::new();
    for g in gpus {
        state.push_str(&format!("{} {}\n", g.bdf, u8::from(mig)));
        for (suffix, on) in [("on", true), ("off", false)] {
            let mut lines = String::new();
            let rel = g.rel.display();
            match framework {
                FakeVgpu::Mdev => {
                    lines.push_str(&format!("e {rel}/mdev_supported_types/*/devices/*\n"));
                    for t in types {
                        lines.push_str(&format!(
                            "w {rel}/mdev_supported_types/{}/available_instances {}\\n\n",
                            t.id,
                            fits(types, on, &[], t)
                        ));
                    }
                }
                FakeVgpu::Vfio => {
                    for vf in &g.vfs {
                        lines.push_str(&format!("n {}/nvidia/current_vgpu_type\n", vf.display()));
                    }
                    let text = creatable_text(types, on, &[]).replace('\n', "\\n");
                    for vf in &g.vfs {
                        lines.push_str(&format!(
                            "w {}/nvidia/creatable_vgpu_types {text}\n",
                            vf.display()
                        ));
                    }
                }
            }
            fs::write(tables.join(format!("{}.{suffix}", g.bdf)), lines)?;
        }
    }
    fs::write(root.join(MIG_STATE), state)?;
    let smi = root.join(FAKE_NVIDIA_SMI);
    fs::write(&smi, NVIDIA_SMI_SCRIPT)?;
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&smi, fs::Permissions::from_mode(0o755))
}

/// The stand-in: `--query-gpu=pci.bus_id,mig.mode.current --format=csv,noheader`, `-i
/// GPU -mig 0|1` (GPU: index or bus id; refused while the GPU hosts vGPUs, as the real
/// one refuses a GPU in use) and `--gpu-reset -i GPU` (does nothing).
const NVIDIA_SMI_SCRIPT: &str = r#"#!/bin/sh
# nvidia-smi's stand-in over a tree written by `node-agent fake-sysfs --vgpu ... [--mig]`.
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
state="$here/mig-mode"
nv_id() { printf '0000%s\n' "$1" | tr a-f A-F; }
resolve() {
  id=$(printf '%s' "$1" | tr A-F a-f)
  case "$id" in
    *:*) [ ${#id} -eq 16 ] && id=${id#0000} ;;
    *) id=$(awk -v n="$id" 'NR == n + 1 { print $1 }' "$state") ;;
  esac
  if [ -z "$id" ] || ! grep -q "^$id " "$state"; then
    echo "No devices were found" >&2; exit 6
  fi
}
case "$1 $3" in
  "--query-gpu=pci.bus_id,mig.mode.current --format=csv,noheader"*|"--query-gpu=pci.bus_id,mig.mode.current "*)
    while read -r bdf mode; do
      if [ "$mode" = 1 ]; then m=Enabled; else m=Disabled; fi
      echo "$(nv_id "$bdf"), $m"
    done < "$state"
    exit 0 ;;
  "-i -mig")
    resolve "$2"
    case "$4" in 0) suffix=off ;; 1) suffix=on ;; *) echo "Invalid MIG mode: $4" >&2; exit 2 ;; esac
    table="$here/mig/$id.$suffix"
    busy=
    while read -r op path value; do
      case "$op" in
        e) for x in "$root"/$path; do [ -e "$x" ] && busy=1; done ;;
        n) [ "$(cat "$root/$path")" = 0 ] || busy=1 ;;
      esac
    done < "$table"
    if [ -n "$busy" ]; then
      echo "Unable to change MIG mode for GPU $(nv_id "$id"): In use by another client" >&2
      exit 1
    fi
    while read -r op path value; do
      [ "$op" = w ] && printf '%b' "$value" > "$root/$path"
    done < "$table"
    awk -v id="$id" -v m="$4" '$1 == id { $2 = m } { print }' "$state" > "$state.new" && mv "$state.new" "$state"
    if [ "$4" = 1 ]; then w=Enabled; else w=Disabled; fi
    echo "$w MIG Mode for GPU $(nv_id "$id")."
    echo "All done."
    exit 0 ;;
esac
case "$1" in
  --gpu-reset) exit 0 ;;
esac
echo "fake nvidia-smi: unsupported arguments: $*" >&2
exit 2
"#;

/// The type ids of the vGPUs on the VFs in `vfs`' `nvidia/current_vgpu_type`.
pub(crate) fn vf_types(vfs: &[PathBuf]) -> io::Result<Vec<String>> {
    let mut out = Vec::new();
    for vf in vfs {
        let t = crate::host::read_attr(&vf.join("nvidia/current_vgpu_type"))?;
        if t.trim() != "0" {
            out.push(t.trim().to_string());
        }
    }
    Ok(out)
}

/// Type ids of the mdevs under a parent's `mdev_supported_types`, by type.
pub(crate) fn mdev_types(parent: &Path) -> io::Result<Vec<String>> {
    let mut out = Vec::new();
    for e in fs::read_dir(parent.join("mdev_supported_types"))? {
        let e = e?;
        let id = e.file_name().to_string_lossy().into_owned();
        for _ in fs::read_dir(e.path().join("devices"))? {
            out.push(id.clone());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_rules() {
        let mut seen = std::collections::HashSet::new();
        assert!(
            A100.iter().chain(H100).all(|t| seen.insert(t.id)),
            "ids are unique"
        );
        let four_c = &A100[4];
        assert_eq!(fits(A100, false, &[], four_c), 10);
        let e = vec!["nvidia-472".to_string(); 3];
        assert_eq!(fits(A100, false, &e, four_c), 7);
        assert_eq!(
            fits(A100, false, &e, &A100[5]),
            0,
            "one time-sliced type per GPU"
        );
        assert_eq!(
            fits(A100, true, &[], four_c),
            0,
            "no time-sliced types in MIG mode"
        );
        let mig = vec!["nvidia-470".to_string(), "nvidia-469".to_string()];
        assert_eq!(fits(A100, true, &mig, &A100[1]), 2, "7 - 3 - 2 slices left");
        assert_eq!(fits(A100, true, &mig, &A100[0]), 0);
        let text = creatable_text(H100, true, &[]);
        assert!(text.starts_with("ID    : vGPU Name\n557   : NVIDIA H100XM-1-10C\n"));
        assert!(!text.contains("H100XM-4C"));
    }
}
