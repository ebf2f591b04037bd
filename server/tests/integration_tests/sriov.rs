//! SR-IOV virtual functions of other devices as variants (a NIC's VFs), through the real
//! agent loop over the fake kernel, on SQLite and on Postgres: the node is made to set
//! `sriov_numvfs`, each VF is a device a VM gets whole, the function that made them is
//! never given whole meanwhile, and it comes back whole (scrubbed) when no variant asks
//! for its VFs any more.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, Node, TestServer, fast_config, wait_for};
use node_agent::fake::{FakeOptions, GpuModel};
use passage_model::api::{Job, JobState, Package, Vm, VmState};
use passage_model::variant::DeviceType;
use passage_model::{DevicePath, DeviceState, ErrorCode, Variant};
use serde_json::json;
use std::time::Duration;

/// The generated tree's NIC: an Intel i350 with two ports, each able to make 7 VFs.
const I350: (&str, &str) = ("8086", "1521");
const I350_VF: (&str, &str) = ("8086", "1520");

/// The node's (function, state, variant) for each assignable device.
async fn nic_devices(s: &TestServer, node: &Node) -> Vec<(DevicePath, DeviceState, String)> {
    let srv = s.server(node.uuid).await;
    srv.assignable_devices
        .unwrap_or_default()
        .into_iter()
        .filter(|d| d.kind == DeviceType::Nic || d.kind == DeviceType::Vf)
        .map(|d| (d.id, d.state, d.variant))
        .collect()
}

/// `sriov_numvfs` of each i350 port in the tree, and how many VF directories exist.
fn vfs_in_tree(node: &Node) -> (Vec<u32>, usize) {
    let mut counts = Vec::new();
    let mut dirs = 0;
    for e in std::fs::read_dir(node.sysfs.join("bus/pci/devices")).unwrap() {
        let dir = std::fs::canonicalize(e.unwrap().path()).unwrap();
        let device = std::fs::read_to_string(dir.join("device")).unwrap();
        match device.trim() {
            "0x1521" => counts.push(
                std::fs::read_to_string(dir.join("sriov_numvfs"))
                    .unwrap()
                    .trim()
                    .parse()
                    .unwrap(),
            ),
            "0x1520" => dirs += 1,
            _ => {}
        }
    }
    counts.sort();
    (counts, dirs)
}

/// Waits until the node's NIC devices are `want` (ports in a state, VFs of the VF
/// variant that are unassigned), and the tree has `tree`.
async fn settle(
    s: &TestServer,
    node: &Node,
    ports: DeviceState,
    vfs: usize,
    tree: (Vec<u32>, usize),
) {
    let got = wait_for(Duration::from_secs(30), || async {
        let devs = nic_devices(s, node).await;
        let port_states: Vec<DeviceState> = devs
            .iter()
            .filter(|(_, _, v)| v == "I350")
            .map(|(_, st, _)| *st)
            .collect();
        let free_vfs = devs
            .iter()
            .filter(|(_, st, v)| v == "I350_VF" && *st == DeviceState::Unassigned)
            .count();
        (port_states == [ports, ports] && free_vfs == vfs && vfs_in_tree(node) == tree)
            .then_some(())
    })
    .await;
    assert!(
        got.is_some(),
        "want ports {ports:?}, {vfs} free VFs, tree {tree:?}; have {:?}, tree {:?}",
        nic_devices(s, node).await,
        vfs_in_tree(node)
    );
}

/// The body of the VF variant `I350_VF` asking `n` VFs per port.
fn vf_variant(n: u32) -> serde_json::Value {
    json!({"name": "I350_VF", "type": "vf", "parent": "I350", "num_vfs": n,
           "vendor": I350_VF.0, "device": I350_VF.1})
}

/// A server with one node (its real agent loop over a generated tree), the test image,
/// the port variant `I350` and, unless `package` is false, the whole-port package `nic`.
async fn nic_world(b: Backend, package: bool) -> (TestServer, Node) {
    let mut s = TestServer::start(b, fast_config()).await;
    let node = s
        .add_node_from(1, GpuModel::H100, &FakeOptions::default())
        .await;
    s.image().await;
    let _: Variant = s
        .post(
            "/v1/variants",
            &json!({"name": "I350", "type": "nic", "vendor": I350.0, "device": I350.1}),
        )
        .await
        .ok(201);
    if package {
        let _: Package = s
            .post(
                "/v1/packages",
                &json!({"name": "nic", "vcpus": 1, "memory_mib": 1024, "disk_gib": 10,
                        "devices": {"I350": 1}}),
            )
            .await
            .ok(201);
    }
    (s, node)
}

async fn vfs_made_given_and_taken_down(b: Backend) {
    let (s, node) = nic_world(b, true).await;
    // A VF variant's parent is a variant of whole functions other than GPUs.
    let gpu = s.h100_catalog(1).await;
    for (parent, field) in [("NOPE", "parent"), (gpu.as_str(), "parent")] {
        s.post::<Variant>(
            "/v1/variants",
            &json!({"name": "X", "type": "vf", "parent": parent, "num_vfs": 2,
                    "vendor": I350_VF.0, "device": I350_VF.1}),
        )
        .await
        .invalid(field);
    }
    s.post::<Variant>(
        "/v1/variants",
        &json!({"name": "X", "type": "vf", "parent": "I350", "vendor": I350_VF.0,
                "device": I350_VF.1}),
    )
    .await
    .invalid("num_vfs");

    settle(&s, &node, DeviceState::Unassigned, 0, (vec![0, 0], 0)).await;
    let made: Variant = s.post("/v1/variants", &vf_variant(3)).await.ok(201);
    assert_eq!(made.num_vfs, Some(3));
    let vf2: Package = s
        .post(
            "/v1/packages",
            &json!({"name": "vf2", "vcpus": 1, "memory_mib": 1024, "disk_gib": 10,
                    "devices": {"I350_VF": 2}}),
        )
        .await
        .ok(201);
    // Each port is shared and makes 3 VFs; each VF is a device of the VF variant.
    settle(&s, &node, DeviceState::Shared, 6, (vec![3, 3], 6)).await;
    // The parent stays a type that can make VFs.
    s.put::<Variant>(
        "/v1/variants/I350",
        &json!({"name": "I350", "type": "gpu", "vendor": I350.0, "device": I350.1}),
    )
    .await
    .fails(409, ErrorCode::Conflict);

    let (_, tenant) = s.tenant("t").await;
    let create = |package: &'static str, alias: &'static str| {
        let c = s.with(&tenant);
        async move {
            c.post::<Vm>(
                "/v1/vms",
                &json!({"image": "test-image", "alias": alias, "package": package}),
            )
            .await
        }
    };
    // A shared port is never given whole.
    create("nic", "whole")
        .await
        .fails(409, ErrorCode::InsufficientCapacity);
    let vm = create("vf2", "a").await.ok(202);
    let job: Job = s.wait_job(vm.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let vm: Vm = s
        .with(&tenant)
        .get(&format!("/v1/vms/{}", vm.uuid))
        .await
        .ok(200);
    assert_eq!(vm.state, VmState::Running);
    assert_eq!(vm.assigned_devices.len(), 2);
    for d in &vm.assigned_devices {
        assert_eq!(node.driver_of(&d.to_string()).as_deref(), Some("vfio-pci"));
        let dir = node_agent::host::device_dir(&node.sysfs, d);
        assert!(dir.join("physfn").exists(), "{d} is a VF");
    }
    // While a VM holds VFs, their count stays, and the node would refuse it anyway.
    s.put::<Variant>("/v1/variants/I350_VF", &vf_variant(2))
        .await
        .fails(409, ErrorCode::Conflict);
    let r = s
        .delete::<Variant>("/v1/variants/I350_VF")
        .await
        .fails(409, ErrorCode::Conflict);
    assert!(r.message.contains("in use"), "{r:?}");

    // Destroyed: its VFs are scrubbed and free again, the count unchanged.
    let r = s
        .with(&tenant)
        .delete::<Vm>(&format!("/v1/vms/{}", vm.uuid))
        .await;
    s.wait_job(r.ok(202).job_uuid.unwrap()).await;
    settle(&s, &node, DeviceState::Shared, 6, (vec![3, 3], 6)).await;
    for d in &vm.assigned_devices {
        assert_eq!(node.driver_of(&d.to_string()).as_deref(), Some("igbvf"));
    }

    // A new count: every port's VFs go and the new ones come.
    let _: Variant = s.put("/v1/variants/I350_VF", &vf_variant(2)).await.ok(200);
    settle(&s, &node, DeviceState::Shared, 4, (vec![2, 2], 4)).await;

    // No VF variant: the VFs go, the ports are scrubbed and given whole again.
    let r = s
        .delete::<serde_json::Value>(&format!("/v1/packages/{}", vf2.uuid))
        .await;
    assert_eq!(r.status, 204, "{r:?}");
    let r = s.delete::<serde_json::Value>("/v1/variants/I350_VF").await;
    assert_eq!(r.status, 204, "{r:?}");
    settle(&s, &node, DeviceState::Unassigned, 0, (vec![0, 0], 0)).await;
    let whole = create("nic", "whole").await.ok(202);
    let job: Job = s.wait_job(whole.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
}
both!(
    vfs_made_given_and_taken_down_on,
    vfs_made_given_and_taken_down
);

/// A count the function cannot make: the node's words end up on the function, which
/// gives no VF and is not given whole either; a count it can make clears them.
async fn a_refused_count_is_shown_on_the_function(b: Backend) {
    let (s, node) = nic_world(b, false).await;
    let _: Variant = s.post("/v1/variants", &vf_variant(9)).await.ok(201);
    let taints = wait_for(Duration::from_secs(30), || async {
        let srv = s.server(node.uuid).await;
        let t: Vec<String> = srv
            .assignable_devices
            .unwrap_or_default()
            .into_iter()
            .filter(|d| d.variant == "I350" && d.state == DeviceState::Shared)
            .filter_map(|d| d.taint)
            .collect();
        (t.len() == 2).then_some(t)
    })
    .await
    .expect("both ports carry the node's refusal");
    for t in &taints {
        assert!(
            t.contains("makes at most 7 VFs (sriov_totalvfs); 9 were asked"),
            "{t}"
        );
    }
    assert_eq!(vfs_in_tree(&node), (vec![0, 0], 0));
    let _: Variant = s.put("/v1/variants/I350_VF", &vf_variant(7)).await.ok(200);
    settle(&s, &node, DeviceState::Shared, 14, (vec![7, 7], 14)).await;
    // The node reports its new VFs before it answers the task, so the answer that
    // clears a port's refusal may come just after the VFs show.
    let cleared = wait_for(Duration::from_secs(30), || async {
        let srv = s.server(node.uuid).await;
        let taints: Vec<String> = srv
            .assignable_devices
            .unwrap_or_default()
            .into_iter()
            .filter_map(|d| d.taint)
            .collect();
        taints.is_empty().then_some(())
    })
    .await;
    assert!(cleared.is_some(), "the refusal is cleared");
}
both!(
    a_refused_count_is_shown_on_the_function_on,
    a_refused_count_is_shown_on_the_function
);

/// 64 creations of a VM that takes a port whole race the VF variant that shares the
/// ports: each port ends either held whole (and makes no VF) or shared with its VFs,
/// never both; once the whole-port VMs are gone, every port is shared.
async fn whole_ports_race_the_vf_variant(b: Backend) {
    let (s, node) = nic_world(b, true).await;
    let (_, tenant) = s.tenant("t").await;
    let racers: Vec<_> = (0..64)
        .map(|i| {
            let c = s.with(&tenant);
            let body = json!({"image": "test-image", "alias": format!("r{i}"), "package": "nic"});
            tokio::spawn(async move { c.post::<Vm>("/v1/vms", &body).await })
        })
        .collect();
    let v = s.post::<Variant>("/v1/variants", &vf_variant(2)).await;
    assert_eq!(v.status, 201, "{v:?}");
    let mut won = Vec::new();
    for r in racers {
        let r = r.await.unwrap();
        match r.status {
            202 => won.push(r.ok(202)),
            _ => {
                r.fails(409, ErrorCode::InsufficientCapacity);
            }
        }
    }
    assert!(won.len() <= 2, "{} VMs got a port", won.len());
    for vm in &won {
        let job: Job = s.wait_job(vm.job_uuid.unwrap()).await;
        assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    }
    let held: Vec<DevicePath> = won
        .iter()
        .flat_map(|v| v.assigned_devices.clone())
        .collect();
    // Each port the VMs do not hold is shared and makes its VFs; a held port makes none.
    let free_ports = 2 - held.len();
    let counts = {
        let mut c = vec![0; held.len()];
        c.extend(vec![2; free_ports]);
        c
    };
    let got = wait_for(Duration::from_secs(30), || async {
        let devs = nic_devices(&s, &node).await;
        let ok = devs
            .iter()
            .filter(|(_, _, v)| v == "I350")
            .all(|(id, st, _)| {
                if held.contains(id) {
                    *st == DeviceState::Used
                } else {
                    *st == DeviceState::Shared
                }
            });
        (ok && vfs_in_tree(&node) == (counts.clone(), 2 * free_ports)).then_some(())
    })
    .await;
    assert!(
        got.is_some(),
        "held {held:?}: {:?}, tree {:?}",
        nic_devices(&s, &node).await,
        vfs_in_tree(&node)
    );
    for vm in &won {
        let r = s
            .with(&tenant)
            .delete::<Vm>(&format!("/v1/vms/{}", vm.uuid))
            .await;
        s.wait_job(r.ok(202).job_uuid.unwrap()).await;
    }
    // Scrubbed and free, the ports the VMs had are shared too.
    settle(&s, &node, DeviceState::Shared, 4, (vec![2, 2], 4)).await;
}
both!(
    whole_ports_race_the_vf_variant_on,
    whole_ports_race_the_vf_variant
);
