//! A real guest's cloud-init takes the seed the agent writes: the test image boots under
//! the QEMU backend (TCG) with one NIC and a seed (`node_agent::seed`), and a tenant
//! user-script reports on the serial console what cloud-init did: the hostname, the NIC's
//! static address and MTU, the default route, the resolvers, the default user's keys (the
//! owner's and the tenant's, merged), the metadata file, and the tenant's cloud-config
//! `runcmd` reports that it ran.
//!
//! The NIC: a tap the backend makes on bridge `br0`, in a network namespace the test
//! makes, with the gateway's address 10.0.2.2 on the bridge.
//!
//! Skipped without the image, as `guest_boot` is.

use super::guest_boot::test_image;
use super::netns::{self, NetNs};
use node_agent::hypervisor::{Hypervisor, QemuConfig, QemuHypervisor, VmFiles, find_on_path};
use node_agent::images::disk::{create_overlay, delete_disk};
use passage_model::VmId;
use passage_model::images::ImageType;
use passage_model::protocol::{CloudInitSpec, DiskSpec, ImageRef, NicSpec, VmSpec};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// A first boot runs cloud-init's four stages in Python: about a minute on a quiet
/// 2-core machine under emulation, several on a busy one.
const CLOUD_INIT_TIMEOUT: Duration = Duration::from_secs(600);

const MAC: &str = "02:50:41:53:53:01";
const OWNER_KEY: &str = "ssh-ed25519 \
    AAAAC3NzaC1lZDI1NTE5AAAAICsVhhK8c+tJot9qEmol/W4tP+d76TliB/jhQ0SBBdLo owner@passage";
const TENANT_KEY: &str = "ssh-ed25519 \
    AAAAC3NzaC1lZDI1NTE5AAAAIPYeUQNRJG/riMVPCAdmEuxlOOTduTHPvRt57OxAjPU9 tenant@passage";

/// The tenant's own cloud-config: a key of theirs (merged with the owner's), and a
/// command whose output holds quotes and non-ASCII text.
fn tenant_user_data() -> String {
    format!(
        "#cloud-config\n\
         ssh_authorized_keys:\n  - {TENANT_KEY}\n\
         runcmd:\n  - |\n    printf 'PASSAGE-CI-RUNCMD=%s\\n' \"h\u{e9}llo \\\"w\u{f6}rld\\\" 'ok'\" > /dev/ttyS0\n"
    )
}

/// The tenant's user-script, without an interpreter line (the seed adds `#!/bin/sh`):
/// reports what cloud-init set up, one `PASSAGE-CI-…` line each.
const USER_SCRIPT: &str = r#"say() { echo "$1" > /dev/ttyS0; }
say "PASSAGE-CI-HOSTNAME=$(hostname)"
say "PASSAGE-CI-INSTANCE=$(cat /var/lib/cloud/data/instance-id)"
say "PASSAGE-CI-ADDR=$(ip -4 -o addr show dev eth0 | awk '{print $4}')"
say "PASSAGE-CI-MTU=$(cat /sys/class/net/eth0/mtu)"
say "PASSAGE-CI-ROUTE=$(ip -4 route show default | sed 's/ *$//')"
say "PASSAGE-CI-RESOLV=$(awk '/^nameserver/ {print $2}' /etc/resolv.conf | tr '\n' ' ')"
while read -r k; do say "PASSAGE-CI-KEY=$k"; done < /home/debian/.ssh/authorized_keys
mkdir -p /run/cidata && mount -o ro -L cidata /run/cidata &&
  say "PASSAGE-CI-METADATA=$(tr -d ' \n' < /run/cidata/passage-metadata.json)" &&
  umount /run/cidata
say "PASSAGE-CI-DONE"
"#;

fn console_text(path: &Path) -> String {
    String::from_utf8_lossy(&std::fs::read(path).unwrap_or_default()).into_owned()
}

/// Waits until a console line satisfies `done`; answers the console's text.
async fn wait_for(files: &VmFiles, what: &str, done: impl Fn(&str) -> bool) -> String {
    let started = Instant::now();
    loop {
        let text = console_text(&files.console);
        if text.lines().any(|l| done(l.trim())) {
            return text;
        }
        if started.elapsed() > CLOUD_INIT_TIMEOUT {
            let tail: String = text
                .chars()
                .rev()
                .take(4000)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            panic!(
                "no {what} on the console within {}s; console tail:\n{tail}\nQEMU log:\n{}",
                CLOUD_INIT_TIMEOUT.as_secs(),
                std::fs::read_to_string(&files.log).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The values the console shows for `PASSAGE-CI-<key>=`, in order.
fn reported(console: &str, key: &str) -> Vec<String> {
    super::reported(console, &format!("PASSAGE-CI-{key}"))
}

/// The guest's NIC is a real tap on a bridge `br0` holding the gateway's address, in a
/// network namespace the test makes (the test runs again inside it).
#[test]
fn cloud_init_in_a_real_guest_applies_the_seed() {
    if netns::inside().is_some() {
        let Some(image) = test_image() else { return };
        return tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(applies_the_seed_inside(image));
    }
    if test_image().is_none() {
        return;
    }
    let Some(ns) = NetNs::new("seed") else { return };
    ns.ip_ok(&["link", "add", "br0", "type", "bridge"]);
    ns.ip_ok(&["addr", "add", "10.0.2.2/24", "dev", "br0"]);
    ns.ip_ok(&["link", "set", "br0", "up"]);
    ns.run_test(&netns::test_name(
        module_path!(),
        "cloud_init_in_a_real_guest_applies_the_seed",
    ));
}

async fn applies_the_seed_inside(image: std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("st");
    let vm = VmId::new_random();
    let disk = DiskSpec {
        image: ImageRef {
            sha256: node_agent::images::cache::hash_file(&image).unwrap(),
            size: std::fs::metadata(&image).unwrap().len(),
            image_type: ImageType::Qcow2,
        },
        size_gib: 4,
    };
    let qemu_img = find_on_path("qemu-img").unwrap();
    create_overlay(&qemu_img, &state, vm, &disk, &image).unwrap();

    let mut cfg = QemuConfig::from_path(None).unwrap();
    cfg.accel = "tcg".into();
    let hv = QemuHypervisor::open(cfg, &state).unwrap();
    let _stop = super::StopOnDrop(&hv);

    let hostname = "ci-guest-1";
    let spec = VmSpec {
        uuid: vm,
        vcpus: 1,
        memory_mib: 512,
        devices: Vec::new(),
        disk: Some(disk),
        nics: vec![NicSpec {
            mac: MAC.into(),
            ip: "10.0.2.15".parse().unwrap(),
            prefix_len: 24,
            gateway: Some("10.0.2.2".parse().unwrap()),
            resolvers: vec!["10.0.2.3".parse().unwrap()],
            bridge: "br0".into(),
            vlan_id: 0,
            // Not QEMU's default, so the guest shows it came from the seed.
            mtu: 1400,
            primary: true,
        }],
        cloud_init: Some(CloudInitSpec {
            hostname: hostname.into(),
            ssh_authorized_keys: vec![OWNER_KEY.into()],
            user_data: Some(tenant_user_data()),
            user_script: Some(USER_SCRIPT.into()),
            metadata: BTreeMap::from([("role".to_string(), "db \"primary\"".to_string())]),
        }),
        bootrom: None,
    };
    let files = VmFiles::new(&state, vm);

    let t = Instant::now();
    tokio::task::block_in_place(|| hv.start(&spec)).unwrap();
    assert!(files.seed.is_file(), "the backend wrote the seed");
    let report = wait_for(&files, "PASSAGE-BOOT-COUNT=1", |l| {
        l == "PASSAGE-BOOT-COUNT=1"
    })
    .await;
    let at_report = t.elapsed();
    assert_eq!(super::reported(&report, "PASSAGE-EDU-COUNT"), ["0"]);
    // No devices and no firmware asked for: SeaBIOS.
    assert_eq!(super::reported(&report, "PASSAGE-FIRMWARE"), ["bios"]);
    let console = wait_for(&files, "cloud-init's final message", |l| {
        l.contains("Cloud-init v.") && l.contains("finished at")
    })
    .await;
    let at_final = t.elapsed();
    let console = if console
        .lines()
        .any(|l| l.trim().ends_with("PASSAGE-CI-DONE"))
    {
        console
    } else {
        // The script runs in the final stage, before its message; this is a safeguard.
        wait_for(&files, "PASSAGE-CI-DONE", |l| {
            l.ends_with("PASSAGE-CI-DONE")
        })
        .await
    };
    eprintln!(
        "QEMU start to the passage-report line: {:.1}s; to cloud-init's final stage: {:.1}s",
        at_report.as_secs_f64(),
        at_final.as_secs_f64()
    );

    let one = |key: &str| -> String {
        let v = reported(&console, key);
        assert_eq!(v.len(), 1, "{key}: {v:?}\n{console}");
        v[0].clone()
    };
    assert_eq!(one("HOSTNAME"), hostname);
    assert_eq!(one("INSTANCE"), vm.to_string());
    assert_eq!(one("ADDR"), "10.0.2.15/24");
    assert_eq!(one("MTU"), "1400");
    assert_eq!(one("ROUTE"), "default via 10.0.2.2 dev eth0");
    assert_eq!(one("RESOLV").trim(), "10.0.2.3");
    let mut keys = reported(&console, "KEY");
    keys.sort();
    let mut want = vec![OWNER_KEY.to_string(), TENANT_KEY.to_string()];
    want.sort();
    assert_eq!(keys, want, "the owner's key and the tenant's, merged");
    assert_eq!(one("METADATA"), r#"{"role":"db\"primary\""}"#);
    assert_eq!(one("RUNCMD"), "h\u{e9}llo \"w\u{f6}rld\" 'ok'");
    // cloud-init took everything without a complaint (a refused key, a failed module,
    // a network-config it could not render).
    let complaints: Vec<&str> = console
        .lines()
        .filter(|l| l.contains("[WARNING]") || l.contains("[ERROR]") || l.contains("Traceback"))
        .collect();
    assert!(
        complaints.is_empty(),
        "cloud-init complained:\n{}",
        complaints.join("\n")
    );

    tokio::task::block_in_place(|| hv.stop(vm)).unwrap();
    delete_disk(&state, vm).unwrap();
    assert!(!files.seed.exists(), "the seed goes with the disk");
    assert!(!files.dir.exists());
}
