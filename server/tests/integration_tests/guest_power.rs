//! A clean stop and a reboot of a real guest, through the whole system: the real server
//! and a real `node-agent --hypervisor qemu` (emulated) with the Debian test image. One
//! guest serves every check, as each boot costs minutes under emulation:
//!
//! - a file written in the guest right before a `/v1` stop is whole after the start, and
//!   the host keys cloud-init made at its first boot, a moment before, are too (a power
//!   cut there left them as empty files);
//! - the stop's job step says the guest shut down (the ACPI power button), not that it
//!   was powered off;
//! - a `/v1` reboot is one job, a clean stop and a start, and the guest's boot id changes.
//!
//! The guest reports on its serial console, read through the API: cloud-init's `bootcmd`
//! (every boot) prints the boot id, a digest of the file and the size of the host keys;
//! the tenant's user-script (first boot only) writes the file and prints its digest.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::e2e::{guest_image, login, provision_ended, qemu_node, start_server, upload_image};
use crate::common::{Backend, Client, TestDb, wait_for};
use passage_model::Variant;
use passage_model::api::{Job, JobState, Package, Vm, VmConsole, VmState};
use serde_json::json;
use std::time::{Duration, Instant};

/// A boot under emulation, cloud-init's first one included: minutes on a busy machine.
const BOOT_TIMEOUT: Duration = Duration::from_secs(600);

/// Every boot: a stand-in for systemd-logind's power key handling (see below), then a
/// report of the boot's id, the written file's digest (empty before it exists) and the
/// host keys' bytes, ended by `end` so that a line cut short is not read.
///
/// The test image is Debian minbase without D-Bus, where systemd-logind (which shuts
/// Debian's cloud images down on the ACPI power button) cannot run. In its place, as it
/// would: a watcher of the power button's input device that runs `systemctl poweroff`
/// on the first key event (a unit of its own, started without waiting: cloud-init runs
/// `bootcmd` before the targets a default unit would wait for). The press itself is the kernel's ACPI button driver's, from
/// QEMU's `system_powerdown`, as on any guest. (With `dbus` in `xtask/src/test_image.sh`
/// logind would do it, at the cost of rebuilding the image everywhere.)
const USER_DATA: &str = r#"#cloud-config
bootcmd:
  - |
    for d in /sys/class/input/event*; do
      if grep -qx 'Power Button' "$d/device/name" 2>/dev/null; then
        systemd-run --no-block -p DefaultDependencies=no --unit="passage-power-${d##*/}" \
          sh -c "head -c 24 /dev/input/${d##*/} >/dev/null && systemctl poweroff"
      fi
    done
  - |
    echo "PASSAGE-T-BOOT=$(cat /proc/sys/kernel/random/boot_id) mark=$(sha256sum /var/tmp/passage-mark 2>/dev/null | cut -c1-16) keys=$(cat /etc/ssh/ssh_host_*_key 2>/dev/null | wc -c) end" > /dev/ttyS0
"#;

/// The first boot's last act: a megabyte written and not synced, its digest, and the
/// host keys' bytes as they are now. The test stops the VM as soon as it reads this.
const USER_SCRIPT: &str = "head -c 1048576 /dev/urandom > /var/tmp/passage-mark\n\
echo \"PASSAGE-T-MARK=$(sha256sum /var/tmp/passage-mark | cut -c1-16) \
keys=$(cat /etc/ssh/ssh_host_*_key | wc -c) end\" > /dev/ttyS0\n";

/// One `PASSAGE-T-BOOT` report.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Boot {
    id: String,
    mark: String,
    keys: u64,
}

/// The fields of every whole `tag` line in `text`, each as `(first, name=value…)`.
/// Anywhere in a line: the guest writes to the serial port while systemd does.
fn reports(text: &str, tag: &str) -> Vec<Vec<String>> {
    text.lines()
        .filter_map(|l| l.split_once(tag))
        .filter_map(|(_, rest)| {
            let fields: Vec<String> = rest
                .split(char::is_control)
                .next()?
                .split_whitespace()
                .map(str::to_string)
                .collect();
            (fields.last().map(String::as_str) == Some("end")).then_some(fields)
        })
        .collect()
}

fn field<'a>(fields: &'a [String], name: &str) -> &'a str {
    fields
        .iter()
        .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
        .unwrap_or("")
}

fn boots(text: &str) -> Vec<Boot> {
    reports(text, "PASSAGE-T-BOOT=")
        .into_iter()
        .map(|f| Boot {
            id: f[0].clone(),
            mark: field(&f, "mark").to_string(),
            keys: field(&f, "keys").parse().unwrap_or(0),
        })
        .collect()
}

/// The VM's console as the API reads it from its node.
async fn console(c: &Client, vm: &Vm) -> String {
    c.get::<VmConsole>(&format!("/v1/vms/{}/console", vm.uuid))
        .await
        .ok(200)
        .output
}

/// Waits until the console shows a boot other than those in `seen`; keeps every boot
/// seen (the console's window may no longer hold the older ones).
async fn next_boot(c: &Client, vm: &Vm, seen: &mut Vec<Boot>) -> Boot {
    let known: Vec<String> = seen.iter().map(|b| b.id.clone()).collect();
    let new = wait_for(BOOT_TIMEOUT, || async {
        boots(&console(c, vm).await)
            .into_iter()
            .find(|b| !known.contains(&b.id))
    })
    .await;
    let Some(new) = new else {
        panic!("no new boot; console:\n{}", console(c, vm).await);
    };
    seen.push(new.clone());
    new
}

/// `job` once ended, which it must within `limit`, as it must: succeeded.
async fn succeeded(c: &Client, job: passage_model::JobId, limit: Duration) -> Job {
    let j = wait_for(limit, || async {
        let j: Job = c.get(&format!("/v1/jobs/{job}")).await.ok(200);
        matches!(j.state, JobState::Succeeded | JobState::Failed).then_some(j)
    })
    .await
    .expect("the job ended");
    assert_eq!(j.state, JobState::Succeeded, "{j:?}");
    j
}

fn stop_detail(job: &Job) -> String {
    job.steps
        .iter()
        .find(|s| s.name == "stop")
        .and_then(|s| s.detail.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_clean_stop_keeps_the_guests_writes_and_a_reboot_boots_again() {
    let Some(image) = guest_image() else {
        return;
    };
    let started = Instant::now();
    let db = TestDb::new(Backend::Sqlite).await;
    let (_server, base) = start_server(&db, &[]);
    let token = login(&base, "admin", "e2e-admin-password").await;
    let op = Client::at(&base, Some(&token));
    upload_image(&base, &token, &image, "debian-test", "root").await;
    op.post::<Variant>(
        "/v1/variants",
        &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330"}),
    )
    .await
    .ok(201);
    // A grace long enough for a guest shutting down under emulation on a busy machine:
    // the test wants to see the guest shut itself down, not the power cut after it.
    op.post::<Package>(
        "/v1/packages",
        &json!({"name":"power-1x","vcpus":1,"memory_mib":768,"disk_gib":4,
                "devices":{"NVIDIA_H100":1},"stop_grace_s":300}),
    )
    .await
    .ok(201);
    let (_agent, _guests) = qemu_node(&db, &base, &op).await;

    let vm: Vm = op
        .post(
            "/v1/vms",
            &json!({"image":"debian-test","alias":"power","package":"power-1x",
                    "metadata":{"user-data": USER_DATA, "user-script": USER_SCRIPT}}),
        )
        .await
        .ok(202);
    let job = provision_ended(&op, &vm).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let path = format!("/v1/vms/{}", vm.uuid);

    // First boot: cloud-init makes the host keys, the user-script writes the file.
    let mut seen = Vec::new();
    let first = next_boot(&op, &vm, &mut seen).await;
    let mark = wait_for(BOOT_TIMEOUT, || async {
        reports(&console(&op, &vm).await, "PASSAGE-T-MARK=")
            .into_iter()
            .next()
    })
    .await;
    let Some(mark) = mark else {
        panic!(
            "the user-script never ran; console:\n{}",
            console(&op, &vm).await
        );
    };
    let (digest, keys) = (mark[0].clone(), field(&mark, "keys").to_string());
    let keys: u64 = keys.parse().unwrap();
    assert!(keys > 0, "host keys at first boot: {mark:?}");
    let booted = started.elapsed();

    // At once: a clean stop. The guest shuts itself down; the step says so.
    let v: Vm = op.post_empty(&format!("{path}/stop")).await.ok(202);
    assert_eq!(v.state, VmState::Stopping);
    let stop = succeeded(&op, v.job_uuid.unwrap(), Duration::from_secs(600)).await;
    let said = stop_detail(&stop);
    assert!(said.starts_with("guest shut down after "), "{said}");
    let v: Vm = op.get(&path).await.ok(200);
    assert_eq!(v.state, VmState::Stopped);

    // Started again: the file and the host keys are whole.
    let v: Vm = op.post_empty(&format!("{path}/start")).await.ok(202);
    succeeded(&op, v.job_uuid.unwrap(), Duration::from_secs(300)).await;
    let second = next_boot(&op, &vm, &mut seen).await;
    assert_ne!(second.id, first.id);
    assert_eq!(
        second.mark, digest,
        "the file written before the stop: {second:?}"
    );
    assert_eq!(second.keys, keys, "the first boot's host keys: {second:?}");

    // A reboot through /v1: one job, a clean stop and a start; a new boot id.
    let v: Vm = op.post_empty(&format!("{path}/reboot")).await.ok(202);
    assert_eq!(v.state, VmState::Stopping);
    let reboot = succeeded(&op, v.job_uuid.unwrap(), Duration::from_secs(900)).await;
    assert_eq!(reboot.name, "reboot");
    let said_reboot = stop_detail(&reboot);
    assert!(
        said_reboot.starts_with("guest shut down after "),
        "{said_reboot}"
    );
    let third = next_boot(&op, &vm, &mut seen).await;
    assert_ne!(third.id, second.id);
    assert_eq!(third.mark, digest);
    let v: Vm = op.get(&path).await.ok(200);
    assert_eq!(v.state, VmState::Running);
    println!(
        "first boot to its report {:.0} s; stop: {said}; reboot: {said_reboot}; \
         whole test {:.0} s",
        booted.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );

    op.delete::<Vm>(&path).await.ok(202);
    wait_for(Duration::from_secs(120), || async {
        let v: Vm = op.get(&path).await.ok(200);
        (v.state == VmState::Destroyed).then_some(())
    })
    .await
    .expect("the VM was destroyed");
}

#[test]
fn reports_are_read_whole_from_a_busy_console() {
    let text = "[  OK  ] Started foo.PASSAGE-T-BOOT=abc mark= keys=0 end\r\n\
                PASSAGE-T-BOOT=def mark=0123 keys=798 end\n\
                PASSAGE-T-BOOT=ghi mark=01";
    assert_eq!(
        boots(text),
        [
            Boot {
                id: "abc".into(),
                mark: String::new(),
                keys: 0
            },
            Boot {
                id: "def".into(),
                mark: "0123".into(),
                keys: 798
            }
        ]
    );
}
