//! The real `server` and `node-agent` binaries on loopback over a fake tree of 8 H100s:
//! operator sets up, tenant provisions and destroys, the device is scrubbed before reuse.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, Client, Proc, TestDb, agent_command, node_agent_bin, wait_for};
use passage_model::api::{
    Account, DeviceEventRecord, JoinToken, LoginResponse, Package, ScrubRecord, Server,
    ServerStatus, Vm, VmState,
};
use passage_model::{DeviceState, ServerId, Variant};
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// An active public qcow2 image `name` with the file at `path`, uploaded by the operator
/// (`token`).
pub(super) async fn upload_image(
    base: &str,
    token: &str,
    path: &Path,
    name: &str,
    default_user: &str,
) -> passage_model::images::Image {
    let op = Client::at(base, Some(token));
    let img: passage_model::images::Image = op
        .post(
            "/v1/images",
            &json!({"name":name,"version":"1","os":"linux","type":"qcow2",
                    "public":true,"tags":{"default_user":default_user}}),
        )
        .await
        .ok(201);
    let r = reqwest::Client::new()
        .put(format!("{base}/v1/images/{}/file", img.uuid))
        .bearer_auth(token)
        .body(tokio::fs::read(path).await.unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap());
    let img: passage_model::images::Image =
        op.get(&format!("/v1/images/{}", img.uuid)).await.ok(200);
    assert_eq!(img.state, passage_model::images::ImageState::Active);
    img
}

/// The H100 variant and a package `name` with two of them, sized for an emulated guest.
pub(super) async fn two_gpu_package(op: &Client, name: &str) {
    op.post::<Variant>(
        "/v1/variants",
        &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330"}),
    )
    .await
    .ok(201);
    op.post::<Package>(
        "/v1/packages",
        &json!({"name":name,"vcpus":1,"memory_mib":768,"disk_gib":4,
                "devices":{"NVIDIA_H100":2}}),
    )
    .await
    .ok(201);
}

/// The guests of an agent's state directory: QEMU outlives its agent by design, so a
/// test that ends (or fails) before its VMs are destroyed kills them when this drops.
pub(super) struct Guests {
    pub(super) state: PathBuf,
}

impl Drop for Guests {
    fn drop(&mut self) {
        let Ok(dirs) = std::fs::read_dir(self.state.join("qemu")) else {
            return;
        };
        for d in dirs.flatten() {
            let Ok(pid) = std::fs::read_to_string(d.path().join("qemu.pid")) else {
                continue;
            };
            let pid = pid.trim();
            // Only a QEMU of this VM's: a pid file may outlive its process.
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let name = d.file_name().to_string_lossy().into_owned();
            if String::from_utf8_lossy(&cmdline).contains(&name) {
                let _ = Command::new("kill").arg(pid).status();
            }
        }
    }
}

/// A node: a generated tree with two H100s and the real agent running QEMU (emulated),
/// registered with its two GPUs. Answers the agent and its guests.
pub(super) async fn qemu_node(db: &TestDb, base: &str, op: &Client) -> (Proc, Guests) {
    let agent_bin = node_agent_bin();
    let jt: JoinToken = op.post_empty("/v1/servers/join-tokens").await.ok(201);
    let sysfs = db.dir.path().join("sysfs");
    let out = Command::new(&agent_bin)
        .args(["fake-sysfs", "--out"])
        .arg(&sysfs)
        .args(["--gpus", "2", "--model", "h100"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let state = db.dir.path().join("agent-state");
    let agent = Proc(
        agent_command(base, &jt.token, &sysfs, &state)
            .args(["--hypervisor", "qemu"])
            .env("PASSAGE_QEMU_ACCEL", "tcg")
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap(),
    );
    wait_for(Duration::from_secs(30), || async {
        let list: Vec<Server> = op.get("/v1/servers").await.ok(200);
        (list.first()?.assignable_devices.as_ref()?.len() == 2).then_some(())
    })
    .await
    .expect("the node registered with two GPUs");
    (agent, Guests { state })
}

/// The VM's provision job once it has succeeded or failed (five minutes at most: an
/// emulated guest's first boot).
pub(super) async fn provision_ended(op: &Client, vm: &Vm) -> passage_model::api::Job {
    use passage_model::api::{Job, JobState};
    let path = format!("/v1/jobs/{}", vm.job_uuid.unwrap());
    wait_for(Duration::from_secs(300), || async {
        let j: Job = op.get(&path).await.ok(200);
        matches!(j.state, JobState::Succeeded | JobState::Failed).then_some(j)
    })
    .await
    .expect("the provision ended")
}

pub(super) fn start_server(db: &TestDb, extra: &[&str]) -> (Proc, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_server"))
        .args(["--listen", "127.0.0.1:0", "--database", &db.url])
        .args(extra)
        .env("PASSAGE_IMAGE_DIR", db.dir.path().join("images"))
        .env("PASSAGE_ADMIN_PASSWORD", "e2e-admin-password")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let proc = Proc(child);
    let mut lines = BufReader::new(stdout).lines();
    let base = loop {
        let line = lines
            .next()
            .expect("server exited before listening")
            .unwrap();
        if let Some(url) = line.strip_prefix("Passage listening on ") {
            break url.trim().to_string();
        }
    };
    (proc, base)
}

pub(super) async fn login(base: &str, login: &str, password: &str) -> String {
    let l: LoginResponse = Client::at(base, None)
        .post(
            "/v1/auth/login",
            &json!({"login": login, "password": password}),
        )
        .await
        .ok(200);
    l.token
}

async fn walk(b: Backend) {
    let db = TestDb::new(b).await;
    let agent_bin = node_agent_bin();
    let (_server, base) = start_server(&db, &[]);

    // Operator: log in, admit a node.
    let op = Client::at(
        &base,
        Some(&login(&base, "admin", "e2e-admin-password").await),
    );
    let jt: JoinToken = op.post_empty("/v1/servers/join-tokens").await.ok(201);
    let sysfs = db.dir.path().join("sysfs");
    let out = Command::new(&agent_bin)
        .args(["fake-sysfs", "--out"])
        .arg(&sysfs)
        .args(["--gpus", "8", "--model", "h100"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let state = db.dir.path().join("agent-state");
    let _agent = Proc(
        agent_command(&base, &jt.token, &sysfs, &state)
            .args(["--hypervisor", "sim", "--hostname", "cn-e2e"])
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap(),
    );
    let server_uuid = wait_for(Duration::from_secs(30), || async {
        let list: Vec<Server> = op.get("/v1/servers").await.ok(200);
        let s = list.into_iter().next()?;
        (s.sysinfo?.pci_devices.len() > 8).then_some(s.uuid)
    })
    .await
    .expect("the node registered and reported");

    // Operator: variant, package, tenant.
    op.post::<Variant>(
        "/v1/variants",
        &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330"}),
    )
    .await
    .ok(201);
    let srv: Server = op.get(&format!("/v1/servers/{server_uuid}")).await.ok(200);
    assert_eq!(srv.status, ServerStatus::Running);
    assert_eq!(srv.assignable_devices.unwrap().len(), 8);
    op.post::<Package>("/v1/packages", &json!({"name":"gpu-1x","vcpus":8,"memory_mib":65536,"disk_gib":100,"devices":{"NVIDIA_H100":1}}))
        .await
        .ok(201);
    crate::common::create_test_image(&op).await;
    op.post::<Account>(
        "/v1/accounts",
        &json!({"login":"tenant1","password":"tenant-password","role":"tenant"}),
    )
    .await
    .ok(201);
    let tenant = Client::at(
        &base,
        Some(&login(&base, "tenant1", "tenant-password").await),
    );

    // Tenant: create, watch it run with one device.
    let vm: Vm = tenant
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"train-1","package":"gpu-1x"}),
        )
        .await
        .ok(202);
    let vm_path = format!("/v1/vms/{}", vm.uuid);
    let running = wait_for(Duration::from_secs(30), || async {
        let v: Vm = tenant.get(&vm_path).await.ok(200);
        (v.state == VmState::Running).then_some(v)
    })
    .await
    .expect("the VM reached running");
    assert_eq!(running.assigned_devices.len(), 1);
    let dev = running.assigned_devices[0].to_string();
    let lspci = Command::new(&agent_bin)
        .args(["lspci", "--sysfs-root"])
        .arg(&sysfs)
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&lspci.stdout);
    let line = listing.lines().find(|l| l.contains(&dev)).unwrap();
    assert!(line.ends_with(" vfio-pci"), "bound for passthrough: {line}");

    // Tenant: destroy. The device goes dirty, and is unassigned only after its scrub.
    tenant.delete::<Vm>(&vm_path).await.ok(202);
    wait_for(Duration::from_secs(30), || async {
        let v: Vm = tenant.get(&vm_path).await.ok(200);
        (v.state == VmState::Destroyed).then_some(())
    })
    .await
    .expect("the VM was destroyed");
    let events_path = format!("/v1/servers/{server_uuid}/device-events?device={dev}");
    let events = wait_for(Duration::from_secs(30), || async {
        let ev: Vec<DeviceEventRecord> = op.get(&events_path).await.ok(200);
        (ev.last()?.to == DeviceState::Unassigned && ev.len() > 2).then_some(ev)
    })
    .await
    .expect("the device came back");
    let path: Vec<DeviceState> = events.iter().map(|e| e.to).collect();
    use DeviceState::*;
    assert_eq!(path, [Provisioning, Used, Dirty, Cleaning, Unassigned]);
    let reports: Vec<ScrubRecord> = op
        .get(&format!(
            "/v1/servers/{server_uuid}/scrub-reports?device={dev}"
        ))
        .await
        .ok(200);
    let report = &reports[0];
    assert!(report.ok);
    let (dirty_at, back_at) = (events[2].at, events[4].at);
    assert!(
        dirty_at <= report.at && report.at <= back_at,
        "{dirty_at} {} {back_at}",
        report.at
    );
    let srv: Server = op.get(&format!("/v1/servers/{server_uuid}")).await.ok(200);
    assert!(
        srv.assignable_devices
            .unwrap()
            .iter()
            .all(|d| d.state == DeviceState::Unassigned)
    );
}
both!(real_binaries, walk);

/// `--sim-servers`: simulated nodes register themselves, keep their identity across a
/// restart of the server, and are placed on like any other; on a fresh database beside
/// the same `--sim-dir`, they join again instead of being refused.
async fn simulated_nodes(b: Backend) {
    let first = TestDb::new(b).await;
    let fresh = TestDb::new(b).await;
    let db = &first;
    let sim_dir = db.dir.path().join("sim");
    let sim = sim_dir.to_str().unwrap().to_string();
    let args = [
        "--sim-servers",
        "2",
        "--sim-gpus",
        "4",
        "--sim-model",
        "a100",
        "--sim-dir",
        &sim,
    ];
    let mut uuids: Vec<ServerId> = Vec::new();
    for round in 0..3 {
        let db = if round < 2 { db } else { &fresh };
        let (server, base) = start_server(db, &args);
        let op = Client::at(
            &base,
            Some(&login(&base, "admin", "e2e-admin-password").await),
        );
        let list = wait_for(Duration::from_secs(30), || async {
            let list: Vec<Server> = op.get("/v1/servers").await.ok(200);
            let ready = list
                .iter()
                .filter(|s| s.status == ServerStatus::Running)
                .filter(|s| {
                    s.sysinfo.as_ref().is_some_and(|i| {
                        i.pci_devices
                            .iter()
                            .filter(|d| d.device.to_string() == "20b0")
                            .count()
                            == 4
                    })
                })
                .count();
            (ready == 2).then_some(list)
        })
        .await
        .unwrap_or_else(|| panic!("round {round}: two simulated nodes with 4 A100s each"));
        let mut now: Vec<ServerId> = list.iter().map(|s| s.uuid).collect();
        now.sort();
        match round {
            0 => uuids = now,
            1 => assert_eq!(
                now, uuids,
                "the same two nodes after a restart, no new ones"
            ),
            _ => assert!(
                now.iter().all(|u| !uuids.contains(u)),
                "two new nodes in the fresh database"
            ),
        }
        drop(server);
    }
}
both!(sim_servers, simulated_nodes);

/// The test guest image (`cargo xtask test` builds it and names it in
/// `PASSAGE_TEST_IMAGE`); outside CI, or with `PASSAGE_ALLOW_NO_QEMU=1`, its absence
/// skips the test.
pub(super) fn guest_image() -> Option<PathBuf> {
    let found = std::env::var_os("PASSAGE_TEST_IMAGE")
        .map(PathBuf::from)
        .filter(|p| p.is_file());
    if found.is_none() {
        let allowed = std::env::var("PASSAGE_ALLOW_NO_QEMU").as_deref() == Ok("1");
        assert!(
            allowed || std::env::var_os("CI").is_none(),
            "PASSAGE_TEST_IMAGE is not set to a file: `cargo xtask test` builds the guest image"
        );
        eprintln!("note: SKIPPED: PASSAGE_TEST_IMAGE is not set (run `cargo xtask test-image`)");
    }
    found
}

/// The whole system boots a guest: the real server and a real `node-agent` with the QEMU
/// backend (emulated: this machine's /dev/kvm does not work) over a generated tree with
/// two GPUs. An operator uploads the Debian test image; a tenant's VM with a 2-GPU
/// package is provisioned; the node downloads the image from the server over the agent
/// API, makes the VM's disk on it, and the guest boots and counts two stand-in devices;
/// destroying the VM deletes its disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_guest_boots_through_the_whole_system() {
    let Some(image) = guest_image() else {
        return;
    };
    let db = TestDb::new(Backend::Sqlite).await;
    let (_server, base) = start_server(&db, &[]);
    let token = login(&base, "admin", "e2e-admin-password").await;
    let op = Client::at(&base, Some(&token));

    let img = upload_image(&base, &token, &image, "debian-test", "root").await;
    let size = std::fs::metadata(&image).unwrap().len();
    two_gpu_package(&op, "boot-2x").await;
    let (_agent, guests) = qemu_node(&db, &base, &op).await;
    let state = guests.state.clone();

    let vm: Vm = op
        .post(
            "/v1/vms",
            &json!({"image":"debian-test","alias":"boot-1","package":"boot-2x"}),
        )
        .await
        .ok(202);
    assert_eq!(vm.image_uuid, Some(img.uuid));
    let vm_path = format!("/v1/vms/{}", vm.uuid);
    let job = provision_ended(&op, &vm).await;
    assert_eq!(
        job.state,
        passage_model::api::JobState::Succeeded,
        "{job:?}"
    );
    let fetch = job.steps.iter().find(|s| s.name == "fetch_image").unwrap();
    assert!(fetch.error.is_none(), "{fetch:?}");
    let cached = state
        .join("images")
        .join(img.sha256.as_ref().unwrap().as_str());
    assert_eq!(
        std::fs::metadata(&cached).unwrap().len(),
        size,
        "the whole image"
    );

    // The guest's own words, on its serial console, as the API reads it from the node.
    let console_path = format!("{vm_path}/console");
    let read = || async {
        op.get::<passage_model::api::VmConsole>(&console_path)
            .await
            .ok(200)
            .output
    };
    let seen = wait_for(Duration::from_secs(300), || async {
        let text = read().await;
        text.lines()
            .any(|l| l.trim_end().ends_with("PASSAGE-BOOT-COUNT=1"))
            .then_some(text)
    })
    .await;
    let Some(seen) = seen else {
        panic!("the guest never booted; console:\n{}", read().await);
    };
    assert!(
        // Anywhere in a line: the guest writes to the serial port while systemd does.
        seen.lines()
            .filter_map(|l| l.split_once("PASSAGE-EDU-COUNT="))
            .any(|(_, v)| v.split(char::is_control).next().map(str::trim) == Some("2")),
        "two stand-in GPUs in the guest:\n{seen}"
    );

    let disk = state
        .join("qemu")
        .join(vm.uuid.to_string())
        .join("disk.qcow2");
    assert!(disk.is_file());
    op.delete::<Vm>(&vm_path).await.ok(202);
    wait_for(Duration::from_secs(120), || async {
        let v: Vm = op.get(&vm_path).await.ok(200);
        (v.state == VmState::Destroyed).then_some(())
    })
    .await
    .expect("the VM was destroyed");
    assert!(!disk.exists(), "destroy deleted the disk");
}

/// A node that requires huge pages for guest RAM and has none free: the start fails
/// before QEMU runs, with the reason and its fix in the job, and the provision unwinds
/// (the VM failed, its GPUs scrubbed and free again, nothing left in the node's VM
/// directory).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn required_hugepages_that_are_not_free_unwind_the_provision() {
    let Some(image) = guest_image() else {
        return;
    };
    let db = TestDb::new(Backend::Sqlite).await;
    let (_server, base) = start_server(&db, &[]);
    let token = login(&base, "admin", "e2e-admin-password").await;
    let op = Client::at(&base, Some(&token));
    upload_image(&base, &token, &image, "debian-test", "root").await;
    two_gpu_package(&op, "hp-2x").await;

    let jt: JoinToken = op.post_empty("/v1/servers/join-tokens").await.ok(201);
    let sysfs = db.dir.path().join("sysfs");
    let out = Command::new(node_agent_bin())
        .args(["fake-sysfs", "--out"])
        .arg(&sysfs)
        .args(["--gpus", "2", "--model", "h100"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let config = db.dir.path().join("agent.toml");
    std::fs::write(&config, "hugepages = \"require\"\n").unwrap();
    let state = db.dir.path().join("agent-state");
    let _agent = Proc(
        agent_command(&base, &jt.token, &sysfs, &state)
            .args(["--hypervisor", "qemu", "--config"])
            .arg(&config)
            .env("PASSAGE_QEMU_ACCEL", "tcg")
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap(),
    );
    let _guests = Guests {
        state: state.clone(),
    };
    let gpus_free = || async {
        let list: Vec<Server> = op.get("/v1/servers").await.ok(200);
        let devs = list.first()?.assignable_devices.clone()?;
        (devs.len() == 2 && devs.iter().all(|d| d.state == DeviceState::Unassigned)).then_some(())
    };
    wait_for(Duration::from_secs(30), gpus_free)
        .await
        .expect("the node registered with two free GPUs");

    let vm: Vm = op
        .post(
            "/v1/vms",
            &json!({"image":"debian-test","alias":"hp-1","package":"hp-2x"}),
        )
        .await
        .ok(202);
    let job = provision_ended(&op, &vm).await;
    assert_eq!(job.state, passage_model::api::JobState::Failed, "{job:?}");
    let why = job
        .steps
        .iter()
        .filter_map(|s| s.error.as_deref())
        .collect::<Vec<_>>()
        .join("; ");
    assert!(
        why.contains("huge pages are required on this node") && why.contains("nr_hugepages"),
        "{job:?}"
    );
    let v: Vm = op.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
    assert_eq!(v.state, VmState::Failed, "{v:?}");
    wait_for(Duration::from_secs(60), gpus_free)
        .await
        .expect("the GPUs were scrubbed and are free again");
    let left: Vec<_> = walkdir(&state.join("qemu"));
    assert!(left.is_empty(), "the VM's directory is gone: {left:?}");
}

fn walkdir(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        out.push(e.path());
        if e.path().is_dir() {
            out.extend(walkdir(&e.path()));
        }
    }
    out
}
