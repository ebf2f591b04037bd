#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The QEMU backend against a real `qemu-system-x86_64`: TCG, no disk, no passthrough
//! device. `cargo xtask test` installs QEMU; where it cannot be installed, set
//! `PASSAGE_ALLOW_NO_QEMU=1` to skip with a note instead of failing.

use node_agent::hypervisor::{
    Hypervisor, QEMU_BINARY, QemuConfig, QemuHypervisor, VmFiles, find_on_path, qmp::Qmp,
};
use passage_model::VmId;
use passage_model::protocol::VmSpec;
use std::time::Duration;

/// QEMU under TCG without stand-ins; `None` (skip) only where allowed.
pub(super) fn qemu() -> Option<QemuConfig> {
    match find_on_path(QEMU_BINARY) {
        Some(binary) => Some(QemuConfig {
            binary,
            accel: "tcg".into(),
            sysfs_root: None,
            stand_in_devices: false,
            stand_in_bars: false,
            ovmf_code: node_agent::hypervisor::DEFAULT_OVMF_CODE.into(),
            ovmf_vars: node_agent::hypervisor::DEFAULT_OVMF_VARS.into(),
            start: Default::default(),
            hugepages: node_agent::hypervisor::HugepagePolicy::Off,
            pin_vcpus: node_agent::hypervisor::PinPolicy::Never,
            host_reserved_cpus: Default::default(),
            host_sysfs: "/sys".into(),
        }),
        None if std::env::var("PASSAGE_ALLOW_NO_QEMU").as_deref() == Ok("1") => {
            eprintln!("note: SKIPPED: {QEMU_BINARY} is not installed and PASSAGE_ALLOW_NO_QEMU=1");
            None
        }
        None => panic!(
            "{QEMU_BINARY} is not installed: `apt-get install qemu-system-x86` (cargo xtask \
             test does), or set PASSAGE_ALLOW_NO_QEMU=1 to skip this test"
        ),
    }
}

fn spec() -> VmSpec {
    VmSpec {
        uuid: VmId::new_random(),
        vcpus: 1,
        memory_mib: 64,
        devices: Vec::new(),
        disk: None,
        nics: Vec::new(),
        cloud_init: None,
        bootrom: None,
    }
}

fn pid_alive(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/stat"))
        .map(|s| {
            // A zombie (state Z) has exited; only its table entry is left.
            let s = String::from_utf8_lossy(&s).to_string();
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

#[test]
fn starts_queries_and_stops_a_real_qemu() {
    let Some(cfg) = qemu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let h = QemuHypervisor::open(cfg.clone(), dir.path()).unwrap();
    let s = spec();
    h.start(&s).unwrap();
    h.start(&s).unwrap(); // idempotent
    assert_eq!(h.running(), vec![s.uuid]);
    assert_eq!(h.status(s.uuid).unwrap(), "running");

    // Our own QMP conversation on the VM's socket.
    let files = VmFiles::new(dir.path(), s.uuid);
    let mut q = Qmp::connect(&files.qmp, Duration::from_secs(5)).unwrap();
    assert_eq!(q.status().unwrap(), "running");
    let name = q.execute("query-name", None).unwrap();
    assert!(name["name"].as_str().unwrap().contains(&s.uuid.to_string()));
    drop(q);

    let mut other = s.clone();
    other.vcpus = 2;
    assert!(
        h.start(&other).is_err(),
        "a different spec for a running VM"
    );

    let pid: u32 = std::fs::read_to_string(&files.pid)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(pid_alive(pid));

    // A restarted agent adopts the running VM from the state dir and can stop it.
    let again = QemuHypervisor::open(cfg, dir.path()).unwrap();
    assert_eq!(again.running(), vec![s.uuid]);
    again.stop(s.uuid).unwrap();
    assert!(again.running().is_empty());
    // The first instance is QEMU's parent: it sees the exit once the kernel reports it,
    // which can trail the moment the process stops answering by a few milliseconds.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !h.running().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        h.running().is_empty(),
        "the first instance sees it gone too"
    );
    assert!(!pid_alive(pid), "QEMU {pid} still running");
    assert!(!files.qmp.exists() && !files.pid.exists());
    h.stop(s.uuid).unwrap(); // stopping a stopped VM is a no-op
}

#[test]
fn a_failed_launch_reports_qemus_words() {
    let Some(mut cfg) = qemu() else { return };
    cfg.accel = "no-such-accelerator".into();
    let dir = tempfile::tempdir().unwrap();
    let h = QemuHypervisor::open(cfg, dir.path()).unwrap();
    let e = h.start(&spec()).unwrap_err().to_string();
    assert!(e.contains("launch failed"), "{e}");
    assert!(e.contains("accel"), "QEMU's own message is missing: {e}");
    assert!(h.running().is_empty());
}
