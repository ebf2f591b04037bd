//! The test users do first: create a GPU instance, `ssh` in, see the GPUs. The real
//! server and a real `node-agent --hypervisor qemu` (emulated: this machine's /dev/kvm
//! does not work) over a generated tree with two GPUs, in a network namespace this test
//! makes, with a bridge and the network's gateway address on it; the Debian test image
//! with real cloud-init. A tenant with two ed25519 keys creates an instance on the network
//! given one of them and the test `ssh`es to its `primary_ip` as the image's default user:
//! that key logs in, the other does not. A second instance is deleted while it is still
//! provisioning: it ends destroyed, its GPUs scrubbed and its address free again.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::e2e::{
    guest_image, login, provision_ended, qemu_node, start_server, two_gpu_package, upload_image,
};
use crate::common::{Backend, Client, TestDb, ip, own_network, sh, ssh, wait_for};
use passage_model::api::{Job, JobState, StepState, Vm, VmState};
use passage_model::networks::{Network, NetworkIp};
use serde_json::json;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const BRIDGE: &str = "psg-e2e0";
const GATEWAY: &str = "10.77.0.1";

fn our_taps() -> Vec<String> {
    ip(&["-o", "link", "show"])
        .lines()
        .filter_map(|l| l.split(':').nth(1))
        .map(|n| n.trim().split('@').next().unwrap_or("").to_string())
        .filter(|n| n.starts_with("psg") && n != BRIDGE)
        .collect()
}

#[test]
fn a_tenant_sshes_into_a_new_gpu_instance() {
    let Some(image) = guest_image() else {
        return;
    };
    if !own_network(BRIDGE, &format!("{GATEWAY}/24")) {
        return;
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap()
        .block_on(walk(&image));
}

async fn walk(image: &Path) {
    let db = TestDb::new(Backend::Sqlite).await;
    let (_server, base) = start_server(&db, &[]);
    let token = login(&base, "admin", "e2e-admin-password").await;
    let op = Client::at(&base, Some(&token));

    upload_image(&base, &token, image, "debian-cloud", "debian").await;
    two_gpu_package(&op, "ssh-2x").await;
    let net: Network = op
        .post(
            "/v1/networks",
            &json!({"name":"e2e","subnet":"10.77.0.0/24","gateway":GATEWAY,
                    "provision_start_ip":"10.77.0.10","provision_end_ip":"10.77.0.20",
                    "resolvers":[GATEWAY],"bridge":BRIDGE,"public":true,"default":true}),
        )
        .await
        .ok(201);

    // The tenant and its two keys.
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("id_ed25519");
    let other_key = keys.path().join("other_ed25519");
    for k in [&key, &other_key] {
        sh(Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", "tenant@e2e", "-f"])
            .arg(k));
    }
    let public = std::fs::read_to_string(key.with_extension("pub")).unwrap();
    let other_public = std::fs::read_to_string(other_key.with_extension("pub")).unwrap();
    op.post::<passage_model::api::Account>(
        "/v1/accounts",
        &json!({"login":"tenant","password":"tenant-password","role":"tenant"}),
    )
    .await
    .ok(201);
    let tenant = Client::at(
        &base,
        Some(&login(&base, "tenant", "tenant-password").await),
    );
    tenant
        .post::<serde_json::Value>("/v1/keys", &json!({"name": "laptop", "key": public.trim()}))
        .await
        .ok(201);
    tenant
        .post::<serde_json::Value>(
            "/v1/keys",
            &json!({"name": "other", "key": other_public.trim()}),
        )
        .await
        .ok(201);

    let (_agent, _guests) = qemu_node(&db, &base, &op).await;

    // Create → ssh answers.
    let started = Instant::now();
    let vm: Vm = tenant
        .post(
            "/v1/vms",
            &json!({"image":"debian-cloud","alias":"gpu-box","package":"ssh-2x",
                    "keys":["laptop"],
                    "metadata":{
                        "user-data":"#cloud-config\nruncmd:\n  - [sh, -c, 'echo ran > /var/tmp/user-data-ran']\n",
                        "user-script":"#!/bin/sh\necho ran > /var/tmp/user-script-ran\n"}}),
        )
        .await
        .ok(202);
    let addr = vm.primary_ip.expect("an address on the default network");
    assert_eq!(vm.nics.len(), 1);
    let job = provision_ended(&op, &vm).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let running = started.elapsed();
    let taps = our_taps();
    assert_eq!(taps.len(), 1, "one tap for the VM's one NIC: {taps:?}");

    let script = "hostname; ip -4 -o addr show scope global; \
                  grep -l 0x11e8 /sys/bus/pci/devices/*/device | wc -l; \
                  cat /var/tmp/user-data-ran /var/tmp/user-script-ran";
    let host = addr.to_string();
    let answer = wait_for(Duration::from_secs(600), || {
        let key = key.clone();
        let host = host.clone();
        async move {
            tokio::task::spawn_blocking(move || ssh(&key, "debian", &host, script))
                .await
                .ok()
                .flatten()
                // cloud-init's final stage runs the user's scripts after sshd is up.
                .filter(|out| out.matches("ran").count() == 2)
        }
    })
    .await;
    let Some(answer) = answer else {
        let console: passage_model::api::VmConsole = tenant
            .get(&format!("/v1/vms/{}/console", vm.uuid))
            .await
            .ok(200);
        panic!("ssh never answered; console:\n{}", console.output);
    };
    let ssh_at = started.elapsed();
    println!(
        "create → running {:.1} s, create → ssh answers {:.1} s",
        running.as_secs_f64(),
        ssh_at.as_secs_f64()
    );
    let lines: Vec<&str> = answer.lines().collect();
    assert_eq!(lines[0], "gpu-box", "the hostname is the alias: {answer}");
    assert!(
        lines[1].contains(&format!("inet {addr}/24")),
        "the address the API shows: {answer}"
    );
    assert_eq!(lines[2], "2", "two stand-in GPUs: {answer}");
    assert_eq!(&lines[3..], ["ran", "ran"], "user-data and user-script ran");
    // Only the key it was given logs in.
    let listed: Vec<String> = vm.keys.iter().flatten().map(|k| k.name.clone()).collect();
    assert_eq!(listed, ["laptop"]);
    let (other, h) = (other_key.clone(), host.clone());
    let refused = tokio::task::spawn_blocking(move || ssh(&other, "debian", &h, "true"))
        .await
        .unwrap();
    assert_eq!(refused, None, "a key the VM was not given logged in");

    // Destroy: the tap goes, the address returns, the next VM may get it.
    let vm_path = format!("/v1/vms/{}", vm.uuid);
    let placed: Vm = op.get(&vm_path).await.ok(200);
    tenant.delete::<Vm>(&vm_path).await.ok(202);
    wait_for(Duration::from_secs(120), || async {
        let v: Vm = tenant.get(&vm_path).await.ok(200);
        (v.state == VmState::Destroyed).then_some(())
    })
    .await
    .expect("the VM was destroyed");
    assert!(our_taps().is_empty(), "taps left: {:?}", our_taps());
    let held: Vec<NetworkIp> = op
        .get(&format!("/v1/networks/{}/ips", net.uuid))
        .await
        .ok(200);
    assert!(held.is_empty(), "{held:?}");
    // Its GPUs come back once scrubbed, a moment after the VM is destroyed (slower on a
    // busy machine): until then the node has none free for the next VM.
    let server = placed.server_uuid.expect("a placed VM names its server");
    all_unassigned(&op, server)
        .await
        .expect("the GPUs were scrubbed");
    let again: Vm = tenant
        .post(
            "/v1/vms",
            &json!({"image":"debian-cloud","alias":"again","package":"ssh-2x",
                    "networks":[{"ipv4_uuid":"e2e","ipv4_ips":[host]}]}),
        )
        .await
        .ok(202);
    assert_eq!(again.primary_ip, Some(addr));
    // Deleted while its node binds and launches it: the provision stops, unwinds, and the
    // VM is destroyed like any other.
    let again_job = format!("/v1/jobs/{}", again.job_uuid.unwrap());
    wait_for(Duration::from_secs(120), || async {
        let j: Job = op.get(&again_job).await.ok(200);
        j.steps
            .iter()
            .skip(1)
            .any(|s| s.state != StepState::Pending)
            .then_some(())
    })
    .await
    .expect("the provision reached its node");
    let again_path = format!("/v1/vms/{}", again.uuid);
    let v: Vm = tenant.delete(&again_path).await.ok(202);
    assert_eq!(v.state, VmState::Destroying);
    wait_for(Duration::from_secs(300), || async {
        let v: Vm = tenant.get(&again_path).await.ok(200);
        (v.state == VmState::Destroyed).then_some(())
    })
    .await
    .expect("the second VM was destroyed");
    let j: Job = op.get(&again_job).await.ok(200);
    assert_eq!(j.state, JobState::Failed, "{j:?}");
    assert!(
        j.error.as_deref().unwrap_or("").contains("cancelled"),
        "{j:?}"
    );
    assert!(our_taps().is_empty(), "taps left: {:?}", our_taps());
    let held: Vec<NetworkIp> = op
        .get(&format!("/v1/networks/{}/ips", net.uuid))
        .await
        .ok(200);
    assert!(held.is_empty(), "{held:?}");

    all_unassigned(&op, server)
        .await
        .expect("the GPUs of the VM deleted while provisioning were scrubbed");

    // The same through Triton's own CLI: `triton instance create -w`, then `triton ssh`.
    let Some(cli) = super::triton_cli::triton_cli() else {
        return;
    };
    let (user, public) = super::triton_cli::TritonUser::new(&cli, &base, "tenant");
    tenant
        .post::<serde_json::Value>("/v1/keys", &json!({"name": "triton", "key": public}))
        .await
        .ok(201);
    let started = Instant::now();
    let out = user
        .run(&[
            "instance",
            "create",
            "-w",
            "-n",
            "tri-box",
            "debian-cloud",
            "ssh-2x",
        ])
        .await
        .ok();
    assert!(out.contains("Created instance tri-box"), "{out}");
    // `triton ssh` runs `ssh` from PATH with no key or host-key options; a user answers
    // the host-key prompt and has the key in ~/.ssh (which ssh finds by the passwd entry,
    // not $HOME). This `ssh` does both, then runs the real one with what triton gave it.
    let bin = user.home.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let wrapper = bin.join("ssh");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec {} -F /dev/null -o BatchMode=yes -o ConnectTimeout=10 \
             -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -i {} \"$@\"\n",
            sh(Command::new("sh").args(["-c", "command -v ssh"])).trim(),
            user.ssh_dir().join("id_ed25519").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let lspci = wait_for(Duration::from_secs(600), || {
        let mut cmd = user.command(&["ssh", "tri-box", "lspci", "-n"]);
        cmd.env("PATH", &path);
        async move {
            let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
                .await
                .ok()?;
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).to_string())
        }
    })
    .await
    .expect("triton ssh tri-box answered");
    println!(
        "triton instance create -w → triton ssh answers {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        lspci.matches("1234:11e8").count(),
        2,
        "two stand-in GPUs in `lspci -n`: {lspci}"
    );
    let out = user
        .run(&["instance", "delete", "-w", "-f", "tri-box"])
        .await
        .ok();
    assert!(out.contains("Delete instance tri-box"), "{out}");
    assert!(our_taps().is_empty(), "taps left: {:?}", our_taps());
}

/// Waits until every assignable device of `server` is unassigned (scrubbed).
async fn all_unassigned(op: &Client, server: passage_model::ServerId) -> Option<()> {
    wait_for(Duration::from_secs(120), || async {
        let srv: passage_model::api::Server =
            op.get(&format!("/v1/servers/{server}")).await.ok(200);
        srv.assignable_devices?
            .iter()
            .all(|d| d.state == passage_model::DeviceState::Unassigned)
            .then_some(())
    })
    .await
}
