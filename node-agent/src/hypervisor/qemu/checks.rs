//! What a host needs before QEMU can pass a device through, checked before launch so
//! each missing piece fails with the fix instead of QEMU's own words minutes later, and
//! the probe that keeps a node whose `/dev/kvm` does not work off KVM.

use super::QemuConfig;
use passage_model::images::Bootrom;
use passage_model::protocol::VmSpec;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Locked memory QEMU needs beyond the guest's RAM (its own buffers, the device's ROM,
/// the IOMMU's tables).
pub const MEMLOCK_MARGIN_MIB: u64 = 1024;

/// The locked-memory limit QEMU inherits from the agent (`RLIMIT_MEMLOCK`, soft): bytes,
/// `None` when unlimited.
pub fn agent_memlock_limit() -> Option<u64> {
    let r = rustix::process::getrlimit(rustix::process::Resource::Memlock);
    r.current
}

/// The boot firmware `spec` gets.
pub fn bootrom_of(spec: &VmSpec) -> Bootrom {
    spec.bootrom
        .unwrap_or_else(|| Bootrom::for_vm(None, !spec.devices.is_empty()))
}

fn size(bytes: u64) -> String {
    const KIB: u64 = 1024;
    const MIB: u64 = KIB * 1024;
    const GIB: u64 = MIB * 1024;
    if bytes >= GIB && bytes.is_multiple_of(GIB) {
        format!("{} GiB", bytes / GIB)
    } else if bytes >= MIB && bytes.is_multiple_of(MIB) {
        format!("{} MiB", bytes / MIB)
    } else if bytes >= KIB && bytes.is_multiple_of(KIB) {
        format!("{} KiB", bytes / KIB)
    } else {
        format!("{bytes} bytes")
    }
}

fn non_empty_dir(p: &Path) -> bool {
    std::fs::read_dir(p).is_ok_and(|mut d| d.next().is_some())
}

/// Each check before launching `spec`, the first failure as the sentence an operator
/// acts on. Passed devices need the IOMMU, vfio-pci and enough locked memory (vfio pins
/// all of the guest's RAM); UEFI needs OVMF's files. `memlock` is the limit QEMU will
/// inherit ([`agent_memlock_limit`]). Stand-in devices over a generated tree pass
/// nothing through, so only the firmware is checked for them.
pub fn before_launch(cfg: &QemuConfig, spec: &VmSpec, memlock: Option<u64>) -> Result<(), String> {
    if !spec.devices.is_empty() && !cfg.stand_in_devices {
        let sys = cfg.sysfs_root.as_deref().unwrap_or(Path::new("/sys"));
        if !non_empty_dir(&sys.join("kernel/iommu_groups"))
            && !non_empty_dir(&sys.join("class/iommu"))
        {
            return Err(format!(
                "IOMMU is off (no groups under {}): boot the host with intel_iommu=on (or \
                 amd_iommu=on) iommu=pt",
                sys.join("kernel/iommu_groups").display()
            ));
        }
        let vfio = sys.join("bus/pci/drivers").join(crate::host::VFIO_DRIVER);
        if !vfio.is_dir() {
            return Err(format!(
                "vfio-pci is not loaded (no {}): modprobe vfio-pci",
                vfio.display()
            ));
        }
        let need = spec
            .memory_mib
            .saturating_add(MEMLOCK_MARGIN_MIB)
            .saturating_mul(1024 * 1024);
        if let Some(limit) = memlock
            && limit < need
        {
            return Err(format!(
                "the locked-memory limit is {}, below the VM's {} (plus {} for QEMU): run the \
                 agent with LimitMEMLOCK=infinity (systemd) or ulimit -l unlimited",
                size(limit),
                size(spec.memory_mib.saturating_mul(1024 * 1024)),
                size(MEMLOCK_MARGIN_MIB * 1024 * 1024),
            ));
        }
    }
    if bootrom_of(spec) == Bootrom::Uefi {
        for f in [&cfg.ovmf_code, &cfg.ovmf_vars] {
            if !f.is_file() {
                return Err(format!(
                    "OVMF not found at {} (UEFI firmware): apt install ovmf",
                    f.display()
                ));
            }
        }
    }
    Ok(())
}

/// Whether the CPU flags in `cpuinfo` (`/proc/cpuinfo`'s text) offer hardware
/// virtualisation: without `vmx` (Intel) or `svm` (AMD) KVM cannot run a guest, whatever
/// `/dev/kvm` says.
pub fn cpu_has_virtualisation(cpuinfo: &str) -> bool {
    cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .filter_map(|l| l.split_once(':'))
        .any(|(_, flags)| flags.split_whitespace().any(|f| f == "vmx" || f == "svm"))
}

/// The accelerator to run VMs with and, when KVM was dropped, why (for the log). The
/// operator's choice (`env`, see [`super::ACCEL_ENV`]) always wins. Otherwise `kvm:tcg`
/// where KVM works or `/dev/kvm` is absent (QEMU falls back by itself then); a `/dev/kvm`
/// that is there but does not work makes QEMU hang at start rather than fall back, so
/// then `tcg`. `kvm_works` runs only when the CPU offers virtualisation.
pub fn choose_accel(
    env: Option<String>,
    dev_kvm: bool,
    cpu_virt: bool,
    kvm_works: impl FnOnce() -> bool,
) -> (String, Option<String>) {
    // Only a name QEMU knows overrides; anything else is ignored, as without it.
    if let Some(a) = env.filter(|a| matches!(a.trim(), "kvm" | "tcg" | "kvm:tcg" | "tcg:kvm")) {
        return (super::accel_from_env(Some(a)), None);
    }
    let default = super::accel_from_env(None);
    if !dev_kvm {
        return (default, None);
    }
    if !cpu_virt {
        return (
            "tcg".to_string(),
            Some(
                "/dev/kvm exists but the CPU offers no vmx or svm (a VM without nested \
                 virtualisation?): VMs run under TCG emulation"
                    .to_string(),
            ),
        );
    }
    if !kvm_works() {
        return (
            "tcg".to_string(),
            Some("KVM did not answer a test VM in time: VMs run under TCG emulation".to_string()),
        );
    }
    (default, None)
}

/// How long the KVM probe's QEMU may take before KVM counts as broken.
pub const KVM_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs `binary` with KVM and no guest, asks `query-kvm` over QMP on stdio and kills it
/// after `timeout` whatever it does: true only when KVM answers enabled.
pub fn kvm_answers(binary: &Path, timeout: Duration) -> bool {
    let child = Command::new(binary)
        .args([
            "-machine",
            "none,accel=kvm",
            "-nodefaults",
            "-nographic",
            "-display",
            "none",
            "-qmp",
            "stdio",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let Ok(mut child) = child else {
        return false;
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let stdin = child.stdin.take();
    let stdout = child.stdout.take();
    // The conversation runs on a thread of its own: a QEMU stuck in KVM's setup never
    // answers, and the kill below then ends the thread's reads.
    std::thread::spawn(move || {
        let (Some(mut stdin), Some(stdout)) = (stdin, stdout) else {
            let _ = tx.send(false);
            return;
        };
        let _ = stdin.write_all(
            b"{\"execute\":\"qmp_capabilities\"}\n{\"execute\":\"query-kvm\"}\n{\"execute\":\"quit\"}\n",
        );
        let _ = stdin.flush();
        let mut lines = BufReader::new(stdout.take(64 * 1024)).lines();
        let ok = lines.by_ref().map_while(Result::ok).any(|l| {
            serde_json::from_str::<serde_json::Value>(&l)
                .is_ok_and(|v| v.pointer("/return/enabled").and_then(|e| e.as_bool()) == Some(true))
        });
        let _ = tx.send(ok);
    });
    let started = Instant::now();
    let answer = rx.recv_timeout(timeout).unwrap_or(false);
    let _ = child.kill();
    let _ = child.wait();
    tracing::debug!(
        elapsed_ms = started.elapsed().as_millis() as u64,
        answer,
        "KVM probe"
    );
    answer
}

/// [`choose_accel`] on this host: the environment, `/dev/kvm`, `/proc/cpuinfo` and, when
/// those say KVM could work, a short run of `binary`.
pub fn probe_accel(binary: &Path) -> String {
    let env = std::env::var(super::ACCEL_ENV).ok();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let (accel, why) = choose_accel(
        env,
        Path::new("/dev/kvm").exists(),
        cpu_has_virtualisation(&cpuinfo),
        || kvm_answers(binary, KVM_PROBE_TIMEOUT),
    );
    if let Some(why) = why {
        tracing::warn!(accel = %accel, "{why}; set {}=kvm to insist", super::ACCEL_ENV);
    }
    accel
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn cfg(root: &Path) -> QemuConfig {
        QemuConfig {
            binary: PathBuf::from("qemu-system-x86_64"),
            accel: "tcg".into(),
            sysfs_root: Some(root.to_path_buf()),
            stand_in_devices: false,
            ovmf_code: root.join("OVMF_CODE_4M.fd"),
            ovmf_vars: root.join("OVMF_VARS_4M.fd"),
            stand_in_bars: false,
            hugepages: Default::default(),
            pin_vcpus: Default::default(),
            host_reserved_cpus: Default::default(),
            host_sysfs: root.to_path_buf(),
            start: super::super::StartLimit::default(),
        }
    }

    fn spec(devices: bool) -> VmSpec {
        VmSpec {
            uuid: passage_model::VmId::new_random(),
            vcpus: 1,
            memory_mib: 80 * 1024,
            devices: if devices {
                vec![
                    "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0"
                        .parse()
                        .unwrap(),
                ]
            } else {
                Vec::new()
            },
            disk: None,
            nics: Vec::new(),
            cloud_init: None,
            bootrom: None,
        }
    }

    #[test]
    fn each_missing_piece_names_its_fix() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let c = cfg(root);
        let s = spec(true);
        let e = before_launch(&c, &s, None).unwrap_err();
        assert!(
            e.contains("IOMMU is off") && e.contains("intel_iommu=on"),
            "{e}"
        );
        std::fs::create_dir_all(root.join("kernel/iommu_groups/7")).unwrap();
        let e = before_launch(&c, &s, None).unwrap_err();
        assert!(e.contains("modprobe vfio-pci"), "{e}");
        std::fs::create_dir_all(root.join("bus/pci/drivers/vfio-pci")).unwrap();
        let e = before_launch(&c, &s, Some(64 * 1024)).unwrap_err();
        assert!(
            e.contains("64 KiB, below the VM's 80 GiB") && e.contains("LimitMEMLOCK=infinity"),
            "{e}"
        );
        // UEFI by default for a VM with devices.
        let e = before_launch(&c, &s, None).unwrap_err();
        assert!(
            e.contains("OVMF not found at") && e.contains("apt install ovmf"),
            "{e}"
        );
        std::fs::write(&c.ovmf_code, b"").unwrap();
        std::fs::write(&c.ovmf_vars, b"").unwrap();
        before_launch(&c, &s, None).unwrap();
        before_launch(&c, &s, Some(82 * 1024 * 1024 * 1024)).unwrap();
        // `class/iommu` alone also says the IOMMU is on.
        std::fs::remove_dir_all(root.join("kernel")).unwrap();
        std::fs::create_dir_all(root.join("class/iommu/dmar0")).unwrap();
        before_launch(&c, &s, None).unwrap();
    }

    #[test]
    fn a_vm_without_devices_or_with_stand_ins_needs_none_of_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = cfg(dir.path());
        before_launch(&c, &spec(false), Some(0)).unwrap();
        c.stand_in_devices = true;
        let mut s = spec(true);
        s.bootrom = Some(Bootrom::Bios);
        before_launch(&c, &s, Some(0)).unwrap();
        // Firmware is still firmware.
        s.bootrom = Some(Bootrom::Uefi);
        assert!(before_launch(&c, &s, None).unwrap_err().contains("OVMF"));
    }

    #[test]
    fn kvm_only_where_it_works() {
        let never = || -> bool { panic!("probed") };
        assert_eq!(
            choose_accel(Some("kvm".into()), true, false, never).0,
            "kvm"
        );
        assert_eq!(
            choose_accel(Some("whpx".into()), true, false, never).0,
            "tcg"
        );
        assert_eq!(
            choose_accel(None, false, false, never),
            ("kvm:tcg".into(), None)
        );
        let (a, why) = choose_accel(None, true, false, never);
        assert_eq!(a, "tcg");
        assert!(why.unwrap().contains("vmx or svm"));
        assert_eq!(choose_accel(None, true, true, || false).0, "tcg");
        assert_eq!(
            choose_accel(None, true, true, || true),
            ("kvm:tcg".into(), None)
        );
        assert!(cpu_has_virtualisation("flags\t\t: fpu vme de vmx sse\n"));
        assert!(cpu_has_virtualisation("flags : fpu svm\n"));
        assert!(!cpu_has_virtualisation(
            "flags : fpu vmxx svmy\nmodel name : vmx\n"
        ));
    }

    /// This machine: `/dev/kvm` is there but the CPU offers no virtualisation, so TCG.
    #[test]
    fn this_host_gets_what_its_kvm_allows() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let virt = cpu_has_virtualisation(&cpuinfo);
        let (accel, _) = choose_accel(None, Path::new("/dev/kvm").exists(), virt, || {
            kvm_answers(Path::new(super::super::QEMU_BINARY), KVM_PROBE_TIMEOUT)
        });
        if Path::new("/dev/kvm").exists() && !virt {
            assert_eq!(accel, "tcg");
        }
    }

    /// Stand-ins for QEMU: one that hangs (a broken KVM) and one that answers.
    #[test]
    fn the_probe_gives_up_on_a_qemu_that_hangs() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let hang = dir.path().join("hang");
        std::fs::write(&hang, "#!/bin/sh\nexec sleep 60\n").unwrap();
        let answer = dir.path().join("answer");
        std::fs::write(
            &answer,
            "#!/bin/sh\necho '{\"QMP\": {}}'\nread a; echo '{\"return\": {}}'\n\
             read b; echo '{\"return\": {\"enabled\": true, \"present\": true}}'\n",
        )
        .unwrap();
        for f in [&hang, &answer] {
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let t = Instant::now();
        assert!(!kvm_answers(&hang, Duration::from_millis(500)));
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(kvm_answers(&answer, Duration::from_secs(5)));
        assert!(!kvm_answers(
            &dir.path().join("missing"),
            Duration::from_secs(1)
        ));
    }
}
