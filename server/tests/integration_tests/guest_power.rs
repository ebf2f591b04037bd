//! A clean stop and a reboot of a real guest, through the whole system: the real server
//! and a real `node-agent --hypervisor qemu` (emulated) with the Debian test image. One
//! guest serves every check, as each boot costs minutes under emulation. Five times in a
//! row, about 40 s after a boot in which cloud-init made new host keys (a power cut there
//! left them as empty files) and right after the guest wrote a file without syncing it,
//! the VM goes down cleanly and comes back, and its next boot finds both whole:
//!
//! 1. a `/v1` stop, then a `/v1` start;
//! 2. a `/v1` reboot: one job, a clean stop and a start;
//! 3. `triton instance reboot` through CloudAPI, signed with the owner's key;
//! 4. a `/v1` stop and start again; 5. a `/v1` reboot again.
//!
//! Each stop's job step says the guest shut down (the ACPI power button), not that it was
//! powered off, and each boot has a new boot id.
//!
//! The guest reports on its serial console, read through the API. cloud-init's `bootcmd`
//! (every boot, before its `ssh` module) reports what the last boot left: the boot id, a
//! digest of the file and of the host keys, the keys' bytes; it then removes the `ssh`
//! module's semaphore, so that every boot makes new host keys as a first boot does. A
//! per-boot script (cloud-init's final stage) waits for the guest's 38th second, writes
//! the file and reports what this boot made.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::e2e::{guest_image, login, provision_ended, qemu_node, start_server, upload_image};
use super::triton_cli::{TritonUser, triton_cli};
use crate::common::{Backend, Client, TestDb, wait_for};
use passage_model::Variant;
use passage_model::api::{Job, JobState, Package, Vm, VmConsole, VmState};
use passage_model::keys::SshKey;
use serde_json::json;
use std::time::{Duration, Instant};

/// A boot under emulation, cloud-init's first one included: minutes on a busy machine.
const BOOT_TIMEOUT: Duration = Duration::from_secs(600);

/// How many times the guest goes down and comes back.
const CYCLES: usize = 5;

/// Every boot: a stand-in for systemd-logind's power key handling (see below), the report
/// of what the last boot left, and the `ssh` module's semaphore removed so that cloud-init
/// makes new host keys later in this boot. The final stage runs the per-boot script.
///
/// The test image is Debian minbase without D-Bus, where systemd-logind (which shuts
/// Debian's cloud images down on the ACPI power button) cannot run. In its place, as it
/// would: a watcher of the power button's input device that runs `systemctl poweroff`
/// on the first key event (a unit of its own, started without waiting: cloud-init runs
/// `bootcmd` before the targets a default unit would wait for). The press itself is the
/// kernel's ACPI button driver's, from QEMU's `system_powerdown`, as on any guest. (With
/// `dbus` in `xtask/src/test_image.sh` logind would do it, at the cost of rebuilding the
/// image everywhere.)
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
    echo "PASSAGE-T-BOOT=$(cat /proc/sys/kernel/random/boot_id) mark=$(sha256sum /var/tmp/passage-mark 2>/dev/null | cut -c1-16) keys=$(cat /etc/ssh/ssh_host_*_key 2>/dev/null | sha256sum | cut -c1-16) bytes=$(cat /etc/ssh/ssh_host_*_key 2>/dev/null | wc -c) end" > /dev/ttyS0
  - rm -f /var/lib/cloud/instance/sem/config_ssh
write_files:
  - path: /var/lib/cloud/scripts/per-boot/passage-mark.sh
    permissions: "0755"
    content: |
      #!/bin/sh
      while [ "$(cut -d. -f1 /proc/uptime)" -lt 38 ]; do sleep 1; done
      head -c 1048576 /dev/urandom > /var/tmp/passage-mark
      echo "PASSAGE-T-MADE=$(cat /proc/sys/kernel/random/boot_id) mark=$(sha256sum /var/tmp/passage-mark | cut -c1-16) keys=$(cat /etc/ssh/ssh_host_*_key | sha256sum | cut -c1-16) bytes=$(cat /etc/ssh/ssh_host_*_key | wc -c) end" > /dev/ttyS0
"#;

/// One report: a boot's id and the file and host keys as that boot found them
/// (`PASSAGE-T-BOOT`) or left them (`PASSAGE-T-MADE`).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Report {
    id: String,
    mark: String,
    keys: String,
    bytes: u64,
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

fn parsed(text: &str, tag: &str) -> Vec<Report> {
    reports(text, tag)
        .into_iter()
        .map(|f| Report {
            id: f[0].clone(),
            mark: field(&f, "mark").to_string(),
            keys: field(&f, "keys").to_string(),
            bytes: field(&f, "bytes").parse().unwrap_or(0),
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
async fn next_boot(c: &Client, vm: &Vm, seen: &mut Vec<String>) -> Report {
    let new = wait_for(BOOT_TIMEOUT, || async {
        parsed(&console(c, vm).await, "PASSAGE-T-BOOT=")
            .into_iter()
            .find(|b| !seen.contains(&b.id))
    })
    .await;
    let Some(new) = new else {
        panic!("no new boot; console:\n{}", console(c, vm).await);
    };
    seen.push(new.id.clone());
    new
}

/// Waits for what boot `id` made: its host keys and the file, written at its 38th second.
async fn made(c: &Client, vm: &Vm, id: &str) -> Report {
    let made = wait_for(BOOT_TIMEOUT, || async {
        parsed(&console(c, vm).await, "PASSAGE-T-MADE=")
            .into_iter()
            .find(|m| m.id == id)
    })
    .await;
    let Some(made) = made else {
        panic!(
            "boot {id} never wrote its file; console:\n{}",
            console(c, vm).await
        );
    };
    made
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
    // A tenant owns the VM; its key signs CloudAPI for the `triton` CLI. The operator
    // stops, starts and reboots it through /v1.
    op.post::<passage_model::api::Account>(
        "/v1/accounts",
        &json!({"login":"owner","password":"owner-password","role":"tenant"}),
    )
    .await
    .ok(201);
    let owner = Client::at(&base, Some(&login(&base, "owner", "owner-password").await));
    let triton = triton_cli().map(|cli| TritonUser::new(&cli, &base, "owner"));
    if let Some((_, public)) = &triton {
        owner
            .post::<SshKey>("/v1/keys", &json!({"name": "laptop", "key": public}))
            .await
            .ok(201);
    }
    let (_agent, _guests) = qemu_node(&db, &base, &op).await;

    let vm: Vm = owner
        .post(
            "/v1/vms",
            &json!({"image":"debian-test","alias":"power","package":"power-1x",
                    "metadata":{"user-data": USER_DATA}}),
        )
        .await
        .ok(202);
    let job = provision_ended(&op, &vm).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let path = format!("/v1/vms/{}", vm.uuid);

    let mut seen = Vec::new();
    let first = next_boot(&op, &vm, &mut seen).await;
    assert_eq!(first.bytes, 0, "a first boot finds no host keys: {first:?}");
    let mut left = made(&op, &vm, &first.id).await;
    let first_boot = started.elapsed();
    let mut said = Vec::new();
    for cycle in 0..CYCLES {
        assert!(left.bytes > 0, "boot {cycle} made no host keys: {left:?}");
        // Nothing the guest made is synced: the file a moment ago, the host keys earlier
        // in this boot, which began about 40 s ago. The guest goes down at once.
        // `triton instance reboot -w` waits on CloudAPI's ListMachineAudit, which Passage
        // does not answer yet: the CLI reboots without `-w` and the test waits.
        let how = match cycle {
            1 | 4 => "reboot",
            2 if triton.is_some() => "triton",
            _ => "stop",
        };
        let job = match how {
            "triton" => {
                let (user, _) = triton.as_ref().unwrap();
                let out = user
                    .run(&["instance", "reboot", &vm.uuid.to_string()])
                    .await
                    .ok();
                assert!(out.contains("Rebooting instance"), "{out}");
                let v: Vm = op.get(&path).await.ok(200);
                let j = succeeded(&op, v.job_uuid.unwrap(), Duration::from_secs(900)).await;
                assert_eq!(j.name, "reboot");
                j
            }
            "reboot" => {
                let v: Vm = op.post_empty(&format!("{path}/reboot")).await.ok(202);
                assert_eq!(v.state, VmState::Stopping);
                let j = succeeded(&op, v.job_uuid.unwrap(), Duration::from_secs(900)).await;
                assert_eq!(j.name, "reboot");
                j
            }
            _ => {
                let v: Vm = op.post_empty(&format!("{path}/stop")).await.ok(202);
                assert_eq!(v.state, VmState::Stopping);
                let j = succeeded(&op, v.job_uuid.unwrap(), Duration::from_secs(600)).await;
                let v: Vm = op.get(&path).await.ok(200);
                assert_eq!(v.state, VmState::Stopped);
                let v: Vm = op.post_empty(&format!("{path}/start")).await.ok(202);
                succeeded(&op, v.job_uuid.unwrap(), Duration::from_secs(300)).await;
                j
            }
        };
        let detail = stop_detail(&job);
        assert!(
            detail.starts_with("guest shut down after "),
            "cycle {cycle} ({how}): {detail}"
        );
        said.push(format!("{how}: {detail}"));
        let boot = next_boot(&op, &vm, &mut seen).await;
        assert_eq!(
            (&boot.mark, &boot.keys, boot.bytes),
            (&left.mark, &left.keys, left.bytes),
            "cycle {cycle} ({how}): the next boot found other than the last one left"
        );
        let next = made(&op, &vm, &boot.id).await;
        assert_ne!(
            next.keys, left.keys,
            "the boot after cycle {cycle} made new host keys"
        );
        left = next;
    }
    let v: Vm = op.get(&path).await.ok(200);
    assert_eq!(v.state, VmState::Running);
    println!(
        "first boot to its file {:.0} s; {}; whole test {:.0} s",
        first_boot.as_secs_f64(),
        said.join("; "),
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
    let text = "[  OK  ] Started foo.PASSAGE-T-BOOT=abc mark= keys= bytes=0 end\r\n\
                PASSAGE-T-BOOT=def mark=0123 keys=4567 bytes=798 end\n\
                PASSAGE-T-BOOT=ghi mark=01";
    assert_eq!(
        parsed(text, "PASSAGE-T-BOOT="),
        [
            Report {
                id: "abc".into(),
                mark: String::new(),
                keys: String::new(),
                bytes: 0
            },
            Report {
                id: "def".into(),
                mark: "0123".into(),
                keys: "4567".into(),
                bytes: 798
            }
        ]
    );
}
