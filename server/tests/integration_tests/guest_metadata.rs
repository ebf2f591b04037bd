//! The metadata service at 169.254.169.254 from inside real guests: the real server and a
//! real `node-agent --hypervisor qemu` (emulated) with the Debian test image, in a network
//! namespace this test makes. Two guests on one bridge, booted together:
//!
//! - each one's `curl 169.254.169.254/latest/meta-data/instance-id` answers its own uuid,
//!   and OpenStack's `meta_data.json` its own name and keys;
//! - one cannot reach the other's listener (the port the node's rules give the other tap);
//! - a tag set with the real `triton instance tag set` (through `/v1` where
//!   `PASSAGE_TEST_TRITON` is not set) shows in the API and, within seconds, in the
//!   guest's `meta_data.json` and EC2's `tags/instance/`;
//! - once the VMs are destroyed their taps' chains are gone from the node's table.
//!
//! The guests are read through `ssh` as the image's default user.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::e2e::{guest_image, login, provision_ended, qemu_node, start_server, upload_image};
use crate::common::{Backend, Client, TestDb, own_network, sh, ssh, wait_for};
use passage_model::Variant;
use passage_model::api::{JobState, Package, Vm, VmState};
use serde_json::{Value, json};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const BRIDGE: &str = "psg-meta0";
const GATEWAY: &str = "10.78.0.1";
/// A first boot under emulation, two at once on a busy machine.
const BOOT_TIMEOUT: Duration = Duration::from_secs(900);

#[test]
fn guests_read_their_own_metadata() {
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

/// `script` run in the guest at `host` as `debian`; its output, or `None`.
async fn in_guest(key: &Path, host: &str, script: &str) -> Option<String> {
    let (key, host, script) = (key.to_path_buf(), host.to_string(), script.to_string());
    tokio::task::spawn_blocking(move || ssh(&key, "debian", &host, &script))
        .await
        .ok()
        .flatten()
}

/// The node's rules: the port the tap of `vm`'s first NIC is sent to.
fn port_of(vm: &Vm) -> Option<u16> {
    let tap = node_agent::net::tap_name(vm.uuid, 0);
    let table =
        sh(Command::new("nft").args(["list", "chain", "bridge", "passage", &format!("in-{tap}")]));
    table
        .split_once("tcp dport set ")?
        .1
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

async fn walk(image: &Path) {
    let db = TestDb::new(Backend::Sqlite).await;
    let (_server, base) = start_server(&db, &[]);
    let token = login(&base, "admin", "e2e-admin-password").await;
    let op = Client::at(&base, Some(&token));
    upload_image(&base, &token, image, "debian-cloud", "debian").await;
    op.post::<Variant>(
        "/v1/variants",
        &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330"}),
    )
    .await
    .ok(201);
    op.post::<Package>(
        "/v1/packages",
        &json!({"name":"meta-1x","vcpus":1,"memory_mib":640,"disk_gib":4,
                "devices":{"NVIDIA_H100":1}}),
    )
    .await
    .ok(201);
    op.post::<Value>(
        "/v1/networks",
        &json!({"name":"meta","subnet":"10.78.0.0/24","gateway":GATEWAY,
                "provision_start_ip":"10.78.0.10","provision_end_ip":"10.78.0.20",
                "resolvers":[GATEWAY],"bridge":BRIDGE,"public":true,"default":true}),
    )
    .await
    .ok(201);
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("id_ed25519");
    sh(Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "tenant@meta", "-f"])
        .arg(&key));
    let public = std::fs::read_to_string(key.with_extension("pub")).unwrap();
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
        .post::<Value>("/v1/keys", &json!({"name":"laptop","key": public.trim()}))
        .await
        .ok(201);
    let (_agent, _guests) = qemu_node(&db, &base, &op).await;

    // Two guests, booted together.
    let started = Instant::now();
    let mut vms: Vec<Vm> = Vec::new();
    for alias in ["meta-a", "meta-b"] {
        vms.push(
            tenant
                .post(
                    "/v1/vms",
                    &json!({"image":"debian-cloud","alias":alias,"package":"meta-1x"}),
                )
                .await
                .ok(202),
        );
    }
    for vm in &vms {
        let job = provision_ended(&op, vm).await;
        assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    }
    let hosts: Vec<String> = vms
        .iter()
        .map(|v| v.primary_ip.expect("an address").to_string())
        .collect();
    let curl_id = "curl -sS -m 10 http://169.254.169.254/latest/meta-data/instance-id";
    let boot = |h: String| {
        let key = key.clone();
        async move { wait_for(BOOT_TIMEOUT, || in_guest(&key, &h, curl_id)).await }
    };
    let (first, second) = tokio::join!(boot(hosts[0].clone()), boot(hosts[1].clone()));
    let answers = [first, second];
    for (vm, answer) in vms.iter().zip(&answers) {
        let Some(answer) = answer else {
            let console: passage_model::api::VmConsole = tenant
                .get(&format!("/v1/vms/{}/console", vm.uuid))
                .await
                .ok(200);
            panic!("{} never answered; console:\n{}", vm.alias, console.output);
        };
        assert_eq!(
            answer.trim(),
            vm.uuid.to_string(),
            "{}'s own uuid",
            vm.alias
        );
    }
    println!(
        "two guests created → both read their instance-id: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // What one answer takes, from inside the guest (ARP and the server's answer included).
    let timed = in_guest(
        &key,
        &hosts[0],
        "for i in 1 2 3; do curl -sS -o /dev/null -w '%{time_total}\\n' \
         http://169.254.169.254/openstack/latest/meta_data.json; done",
    )
    .await
    .unwrap();
    println!(
        "meta_data.json from inside the guest (s): {}",
        timed.split_whitespace().collect::<Vec<_>>().join(" ")
    );

    let md = in_guest(
        &key,
        &hosts[1],
        "curl -sS http://169.254.169.254/openstack/latest/meta_data.json",
    )
    .await
    .unwrap();
    let md: Value = serde_json::from_str(&md).unwrap();
    assert_eq!(md["uuid"], json!(vms[1].uuid.to_string()));
    assert_eq!(md["hostname"], json!("meta-b"));
    assert_eq!(md["public_keys"]["laptop"], json!(public.trim()));

    // Guest A at guest B's listener: dropped before it reaches the host.
    let theirs = port_of(&vms[1]).expect("B's tap has a port");
    let reached = in_guest(
        &key,
        &hosts[0],
        &format!(
            "curl -sS -m 5 http://169.254.169.254:{theirs}/latest/meta-data/instance-id \
             || echo refused"
        ),
    )
    .await
    .unwrap();
    assert_eq!(
        reached.trim(),
        "refused",
        "A reached B's port {theirs}: {reached}"
    );

    // A tag set after creation: in the API, then in the guest.
    let a = &vms[0];
    match super::triton_cli::triton_cli() {
        Some(cli) => {
            let (user, public) = super::triton_cli::TritonUser::new(&cli, &base, "tenant");
            tenant
                .post::<Value>("/v1/keys", &json!({"name": "triton", "key": public}))
                .await
                .ok(201);
            user.run(&[
                "instance",
                "tag",
                "set",
                "-w",
                &a.alias,
                "role=metadata-test",
            ])
            .await
            .ok();
        }
        None => {
            println!("note: PASSAGE_TEST_TRITON not set; the tag is set through /v1");
            tenant
                .post::<Value>(
                    &format!("/v1/vms/{}/tags", a.uuid),
                    &json!({"role": "metadata-test"}),
                )
                .await
                .ok(200);
        }
    }
    let tags: Value = tenant
        .get(&format!("/v1/vms/{}/tags", a.uuid))
        .await
        .ok(200);
    assert_eq!(tags["role"], json!("metadata-test"), "{tags}");
    let tagged_at = Instant::now();
    let seen = wait_for(Duration::from_secs(30), || async {
        let md = in_guest(
            &key,
            &hosts[0],
            "curl -sS http://169.254.169.254/openstack/latest/meta_data.json; echo; \
             curl -sS http://169.254.169.254/latest/meta-data/tags/instance/role",
        )
        .await?;
        let (json_line, ec2) = md.split_once('\n')?;
        let md: Value = serde_json::from_str(json_line).ok()?;
        (md["tags"]["role"] == json!("metadata-test") && ec2.trim() == "metadata-test")
            .then_some(())
    })
    .await;
    assert!(seen.is_some(), "the tag never reached the guest's metadata");
    println!(
        "tag set → seen in the guest: {:.1} s",
        tagged_at.elapsed().as_secs_f64()
    );
    // B's answers did not change.
    let b_tags = in_guest(
        &key,
        &hosts[1],
        "curl -sS http://169.254.169.254/latest/meta-data/tags/instance/",
    )
    .await
    .unwrap();
    assert_eq!(b_tags.trim(), "", "B has no tags: {b_tags}");

    // Destroyed: their taps' chains go with their taps.
    for vm in &vms {
        tenant
            .delete::<Vm>(&format!("/v1/vms/{}", vm.uuid))
            .await
            .ok(202);
    }
    for vm in &vms {
        let path = format!("/v1/vms/{}", vm.uuid);
        wait_for(Duration::from_secs(120), || async {
            let v: Vm = tenant.get(&path).await.ok(200);
            (v.state == VmState::Destroyed).then_some(())
        })
        .await
        .expect("the VM was destroyed");
    }
    let gone = wait_for(Duration::from_secs(10), || async {
        let table = sh(Command::new("nft").args(["list", "table", "bridge", "passage"]));
        (!table.contains("chain in-psg")).then_some(())
    })
    .await;
    assert!(gone.is_some(), "the destroyed VMs' chains stayed");
}
