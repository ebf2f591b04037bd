//! The interactive console with a real guest, through the whole system: the real server
//! and a real `node-agent --hypervisor qemu` (emulated) with the Debian test image. A
//! tenant's VM is given a user with a password through cloud-init; once it has booted,
//! the tenant opens the console's websocket, logs in at the guest's own `login:` prompt
//! (agetty on ttyS0) and runs commands: the answers come from the guest (its boot id is
//! the one its first boot wrote to the log before anyone was connected), and the text
//! console still has everything, what was typed included.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::console::{bearer, closed, open_console, read_until, type_in};
use super::e2e::{guest_image, login, provision_ended, qemu_node, start_server, upload_image};
use crate::common::{Backend, Client, TestDb, wait_for};
use passage_model::Variant;
use passage_model::api::{JobState, Package, Vm, VmConsole, VmState};
use serde_json::json;
use std::time::{Duration, Instant};

/// A boot under emulation, cloud-init's first one included: minutes on a busy machine.
const BOOT_TIMEOUT: Duration = Duration::from_secs(600);
/// An answer from the guest's shell, under emulation.
const ANSWER: Duration = Duration::from_secs(60);

const PASSWORD: &str = "console-Passw0rd-42";

/// A user of the tenant's with a password (what a tenant does to log in at a console),
/// and a report of the boot's id on the serial port, written at every boot.
fn user_data() -> String {
    format!(
        r#"#cloud-config
users:
  - name: tenant
    shell: /bin/bash
    lock_passwd: false
    plain_text_passwd: {PASSWORD}
bootcmd:
  - echo "PASSAGE-T-BOOT=$(cat /proc/sys/kernel/random/boot_id) end" > /dev/ttyS0
"#
    )
}

/// The boot id the guest wrote to its log.
fn reported_boot(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|l| l.split_once("PASSAGE-T-BOOT=")?.1.split_once(" end"))
        .map(|(id, _)| id.trim().to_string())
        .find(|id| id.len() == 36)
}

async fn console(c: &Client, vm: &Vm) -> String {
    c.get::<VmConsole>(&format!("/v1/vms/{}/console", vm.uuid))
        .await
        .ok(200)
        .output
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_logs_in_through_the_console_websocket_and_runs_a_command() {
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
    op.post::<Package>(
        "/v1/packages",
        &json!({"name":"console-1x","vcpus":1,"memory_mib":768,"disk_gib":4,
                "devices":{"NVIDIA_H100":1}}),
    )
    .await
    .ok(201);
    op.post::<serde_json::Value>(
        "/v1/accounts",
        &json!({"login":"carol","password":"carol-password-1","role":"tenant"}),
    )
    .await
    .ok(201);
    let carol_token = login(&base, "carol", "carol-password-1").await;
    let carol = Client::at(&base, Some(&carol_token));
    let (_agent, _guests) = qemu_node(&db, &base, &op).await;

    let vm: Vm = carol
        .post(
            "/v1/vms",
            &json!({"image":"debian-test","alias":"console","package":"console-1x",
                    "metadata":{"user-data": user_data()}}),
        )
        .await
        .ok(202);
    let job = provision_ended(&carol, &vm).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");

    // Booted, with nobody connected to the serial port: the log has it all the same, up
    // to agetty's prompt and cloud-init's last word (agetty prompts before cloud-init has
    // set the password: a login then would be refused).
    let boot = wait_for(BOOT_TIMEOUT, || async {
        let text = console(&carol, &vm).await;
        let id = reported_boot(&text)?;
        (text.contains("console login:") && text.contains(" finished at ")).then_some(id)
    })
    .await;
    let Some(boot) = boot else {
        panic!(
            "no boot report and login prompt; console:\n{}",
            console(&carol, &vm).await
        );
    };
    let booted = started.elapsed();

    let t0 = Instant::now();
    let mut ws = open_console(&base, vm.uuid, &bearer(&carol_token))
        .await
        .expect("the owner opens the console");
    let opened = t0.elapsed();
    // The prompt went by before anyone was here: an empty line asks agetty again.
    type_in(&mut ws, "\r").await;
    read_until(&mut ws, "console login: ", ANSWER).await;
    type_in(&mut ws, "tenant\r").await;
    read_until(&mut ws, "Password: ", ANSWER).await;
    type_in(&mut ws, &format!("{PASSWORD}\r")).await;
    read_until(&mut ws, "tenant@console:~$ ", ANSWER).await;

    // A keystroke's way there and back: the guest's tty echoes it.
    let mut rtts = Vec::new();
    for c in ["e", "c", "h", "o", " "] {
        let t = Instant::now();
        type_in(&mut ws, c).await;
        read_until(&mut ws, c, ANSWER).await;
        rtts.push(t.elapsed());
    }
    type_in(&mut ws, "$((6*7))\r").await;
    // Bash turns bracketed paste off before the command's output ("\x1b[?2004l\r").
    read_until(&mut ws, "42\r\n", ANSWER).await;
    read_until(&mut ws, "tenant@console:~$ ", ANSWER).await;
    // The shell is the guest's own: the boot id its log reported (a panic names what the
    // console said instead).
    type_in(&mut ws, "cat /proc/sys/kernel/random/boot_id\r").await;
    read_until(&mut ws, &format!("{boot}\r\n"), ANSWER).await;

    // The log kept being written while the session was open: what was typed is there.
    let text = console(&carol, &vm).await;
    assert!(text.contains("echo $((6*7))"), "{text}");
    assert!(!text.contains(PASSWORD), "the password is not echoed");

    // Once stopped, the VM's console closes, saying why.
    carol
        .post::<Vm>(
            &format!("/v1/vms/{}/stop", vm.uuid),
            &json!({"force": true}),
        )
        .await
        .ok(202);
    let (code, why) = closed(&mut ws, Duration::from_secs(120)).await;
    assert_eq!(code, 1000, "{why}");
    assert!(why.contains("serial port closed"), "{why}");
    wait_for(Duration::from_secs(120), || async {
        let v: Vm = carol.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
        (v.state == VmState::Stopped).then_some(())
    })
    .await
    .expect("the VM stopped");

    rtts.sort();
    println!(
        "boot to login prompt {:.0} s; console open {} ms; keystroke round trip median \
         {} ms, max {} ms (emulated guest); whole test {:.0} s",
        booted.as_secs_f64(),
        opened.as_millis(),
        rtts[rtts.len() / 2].as_millis(),
        rtts[rtts.len() - 1].as_millis(),
        started.elapsed().as_secs_f64()
    );
    carol
        .delete::<Vm>(&format!("/v1/vms/{}", vm.uuid))
        .await
        .ok(202);
}

#[test]
fn the_boot_report_is_read_from_a_busy_log() {
    let text = "[  OK  ] x PASSAGE-T-BOOT=0c2f6c0e-8a41-4f6b-9e3e-1b2c3d4e5f60 end\r\n\
                PASSAGE-T-BOOT=cut";
    assert_eq!(
        reported_boot(text).as_deref(),
        Some("0c2f6c0e-8a41-4f6b-9e3e-1b2c3d4e5f60")
    );
}
