//! Shared GPUs through the REST API: vGPU variants, one GPU one mode, slots reserved
//! without ever exceeding a GPU's count, pack and spread, on SQLite and on Postgres.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config};
use node_agent::fake::{FakeOptions, FakeVgpu};
use passage_model::api::{Capacity, Package, VgpuCapacity, Vm};
use passage_model::{DevicePath, DeviceState, ErrorCode, PciDevice, ServerId, Variant, VmId};
use serde_json::json;

/// H100s hosting vGPUs through vendor VFIO, with CPUs and memory to spare.
/// Answers the server, the node's credential and its inventory.
async fn vgpu_node(s: &TestServer, gpus: u32) -> (ServerId, String, Vec<PciDevice>) {
    let opts = FakeOptions {
        vgpu: Some(FakeVgpu::Vfio),
        ..FakeOptions::default()
    };
    let host = json!({"cpus": 512, "memory_mib": 4_194_304});
    s.manual_node_from(gpus, Some(host), &opts).await
}

/// `NVIDIA_H100` (whole), `H100_10C` (4 time-sliced vGPUs per GPU) and a package of one
/// of each, `gpu-1x` and `vgpu-<policy>`.
async fn catalog(s: &TestServer, policy: &str) -> String {
    s.h100_catalog(1).await;
    let r = s
        .post::<Variant>(
            "/v1/variants",
            &json!({"name": "H100_10C", "type": "vgpu", "parent": "NVIDIA_H100",
                    "vgpu_type": "NVIDIA H100XM-10C", "max_per_gpu": 4}),
        )
        .await;
    assert!(r.status == 201 || r.status == 409, "{r:?}");
    let name = format!("vgpu-{policy}");
    let p: Package = s
        .post(
            "/v1/packages",
            &json!({"name": name, "vcpus": 1, "memory_mib": 1024, "disk_gib": 10,
                    "devices": {"H100_10C": 1}, "placement": policy}),
        )
        .await
        .ok(201);
    // No GPU hosts the type yet, and a tenant is told it can have one.
    let (_, t) = s.tenant(&format!("asker-{policy}")).await;
    let a: passage_model::api::PackageAvailability = s
        .with(&t)
        .get(&format!("/v1/packages/{}/availability", p.uuid))
        .await
        .ok(200);
    assert!(a.capacity_ok, "{a:?}");
    name
}

async fn create(s: &TestServer, token: &str, package: &str, alias: &str) -> Vm {
    s.with(token)
        .post::<Vm>(
            "/v1/vms",
            &json!({"image": "test-image", "alias": alias, "package": package}),
        )
        .await
        .ok(202)
}

async fn vgpu_capacity(s: &TestServer) -> VgpuCapacity {
    capacity_of(s, "H100_10C").await
}

/// The vGPU capacity of the variant `name`, from `/v1/capacity`.
async fn capacity_of(s: &TestServer, name: &str) -> VgpuCapacity {
    let all: Vec<Capacity> = s.get("/v1/capacity").await.ok(200);
    all.into_iter()
        .find(|c| c.variant == name)
        .and_then(|c| c.vgpu)
        .unwrap_or_else(|| panic!("{name}'s capacity"))
}

/// Waits (up to 30 s) for `gpu` of `node` to be free whole again; whether it was.
async fn back_whole(s: &TestServer, node: ServerId, gpu: &DevicePath) -> bool {
    crate::common::wait_for(std::time::Duration::from_secs(30), || async {
        let states = s.device_states(node).await;
        states
            .iter()
            .any(|(id, st, _)| id == gpu && *st == DeviceState::Unassigned)
            .then_some(())
    })
    .await
    .is_some()
}

type States = Vec<(DevicePath, DeviceState, Option<VmId>)>;

fn slots_of(states: &States, gpu: &DevicePath) -> Vec<(DeviceState, Option<VmId>)> {
    states
        .iter()
        .filter(|(id, _, _)| id.vgpu().is_some() && id.gpu() == *gpu)
        .map(|(_, st, u)| (*st, *u))
        .collect()
}

fn gpus_in(states: &States, state: DeviceState) -> Vec<DevicePath> {
    states
        .iter()
        .filter(|(id, st, _)| id.vgpu().is_none() && *st == state)
        .map(|(id, _, _)| id.clone())
        .collect()
}

async fn vgpu_variants_are_checked(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    s.h100_catalog(1).await;
    let made: Variant = s
        .post(
            "/v1/variants",
            &json!({"name": "H100_10C", "type": "vgpu", "parent": "NVIDIA_H100",
                    "vgpu_type": "NVIDIA H100XM-10C", "max_per_gpu": 4}),
        )
        .await
        .ok(201);
    // Its ids are its parent's.
    assert_eq!(made.vendor.to_string(), "10de");
    assert_eq!(made.device.to_string(), "2330");
    assert_eq!(made.parent.as_deref(), Some("NVIDIA_H100"));
    assert_eq!(made.max_per_gpu, Some(4));
    let bad = |body: serde_json::Value| {
        let s = &s;
        async move { s.post::<Variant>("/v1/variants", &body).await }
    };
    bad(json!({"name": "x", "type": "vgpu", "vgpu_type": "557", "max_per_gpu": 1}))
        .await
        .invalid("parent");
    bad(
        json!({"name": "x", "type": "vgpu", "parent": "nope", "vgpu_type": "557",
               "max_per_gpu": 1}),
    )
    .await
    .invalid("parent");
    bad(
        json!({"name": "x", "type": "vgpu", "parent": "H100_10C", "vgpu_type": "557",
               "max_per_gpu": 1}),
    )
    .await
    .invalid("parent");
    bad(json!({"name": "x", "type": "vgpu", "parent": "NVIDIA_H100", "max_per_gpu": 1}))
        .await
        .invalid("vgpu_type");
    bad(
        json!({"name": "x", "type": "vgpu", "parent": "NVIDIA_H100", "vgpu_type": "557",
               "max_per_gpu": 0}),
    )
    .await
    .invalid("max_per_gpu");
    bad(
        json!({"name": "x", "type": "gpu", "vendor": "10de", "device": "2330",
               "max_per_gpu": 2}),
    )
    .await
    .invalid("type");
    bad(json!({"name": "x", "type": "gpu"}))
        .await
        .invalid("vendor");
    // A parent stays while a vGPU variant names it, and stays a GPU variant.
    s.delete::<()>("/v1/variants/NVIDIA_H100")
        .await
        .fails(409, ErrorCode::Conflict);
    s.put::<Variant>(
        "/v1/variants/NVIDIA_H100",
        &json!({"name": "NVIDIA_H100", "type": "other", "vendor": "10de", "device": "2330"}),
    )
    .await
    .fails(409, ErrorCode::Conflict);
}
both!(vgpu_variants_are_checked_on, vgpu_variants_are_checked);

/// 64 creations race for the last vGPU slot of a GPU: one wins, the GPU never hosts more
/// than its 4, and the GPU is not given whole while it hosts vGPUs. An inventory from the
/// node frees no slot.
async fn race_for_the_last_vgpu_slot(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let (server, cred, devices) = vgpu_node(&s, 1).await;
    let package = catalog(&s, "pack").await;
    let (_, tenant) = s.tenant("racer").await;
    let first: Vec<Vm> = {
        let mut v = Vec::new();
        for i in 0..3 {
            v.push(create(&s, &tenant, &package, &format!("first-{i}")).await);
        }
        v
    };
    let states = s.device_states(server).await;
    let shared = gpus_in(&states, DeviceState::Shared);
    assert_eq!(shared.len(), 1, "{states:?}");
    let gpu = &shared[0];
    assert_eq!(slots_of(&states, gpu).len(), 4);
    for vm in &first {
        assert_eq!(vm.assigned_devices.len(), 1);
        assert_eq!(vm.assigned_devices[0].gpu(), *gpu);
    }
    // The GPU is not whole any more.
    s.with(&tenant)
        .post::<Vm>(
            "/v1/vms",
            &json!({"image": "test-image", "alias": "whole", "package": "gpu-1x"}),
        )
        .await
        .fails(409, ErrorCode::InsufficientCapacity);

    let calls: Vec<_> = (0..64)
        .map(|i| {
            let c = s.with(&tenant);
            let body = json!({"image": "test-image", "alias": format!("race-{i}"),
                              "package": package});
            tokio::spawn(async move { c.post::<Vm>("/v1/vms", &body).await })
        })
        .collect();
    let mut won = Vec::new();
    let mut lost = 0;
    for c in calls {
        let r = c.await.unwrap();
        match r.status {
            202 => won.push(r.ok(202)),
            _ => {
                r.fails(409, ErrorCode::InsufficientCapacity);
                lost += 1;
            }
        }
    }
    assert_eq!((won.len(), lost), (1, 63));
    let states = s.device_states(server).await;
    let slots = slots_of(&states, gpu);
    assert_eq!(slots.len(), 4, "never more slots than the type allows");
    assert!(
        slots
            .iter()
            .all(|(st, u)| *st == DeviceState::Provisioning && u.is_some())
    );
    let mut holders: Vec<VmId> = slots.iter().filter_map(|(_, u)| *u).collect();
    holders.sort();
    holders.dedup();
    assert_eq!(holders.len(), 4, "each slot held by a different VM");
    assert_eq!(gpus_in(&states, DeviceState::Shared), vec![gpu.clone()]);
    let cap = vgpu_capacity(&s).await;
    assert_eq!(
        (
            cap.max_capacity,
            cap.remaining_capacity,
            cap.in_use,
            cap.gpus
        ),
        (4, 0, 4, 1)
    );
    s.assert_free_index_exact("vGPUs").await;
    // The slots keep the type they were made for.
    s.put::<Variant>(
        "/v1/variants/H100_10C",
        &json!({"name": "H100_10C", "type": "vgpu", "parent": "NVIDIA_H100",
                "vgpu_type": "NVIDIA H100XM-20C", "max_per_gpu": 4}),
    )
    .await
    .fails(409, ErrorCode::Conflict);
    s.delete::<()>("/v1/variants/H100_10C")
        .await
        .fails(409, ErrorCode::Conflict);

    // The node's next inventory knows nothing of slots: it frees none of them.
    s.with(&cred)
        .put::<()>("/agent/v1/inventory", &json!({"devices": devices}))
        .await
        .ok(204);
    let after = s.device_states(server).await;
    assert_eq!(slots_of(&after, gpu), slots);
}
both!(race_for_the_last_vgpu_slot_on, race_for_the_last_vgpu_slot);

/// Pack fills the GPU already in the type before opening another; spread puts each vGPU
/// on the emptiest GPU. A whole-GPU request takes the GPU no vGPU is on.
async fn pack_and_spread(b: Backend) {
    for policy in ["pack", "spread"] {
        let s = TestServer::start(b, fast_config()).await;
        let (server, _, _) = vgpu_node(&s, 2).await;
        let package = catalog(&s, policy).await;
        let (_, tenant) = s.tenant("t").await;
        let a = create(&s, &tenant, &package, "a").await;
        let b2 = create(&s, &tenant, &package, "b").await;
        let (ga, gb) = (a.assigned_devices[0].gpu(), b2.assigned_devices[0].gpu());
        let states = s.device_states(server).await;
        let shared = gpus_in(&states, DeviceState::Shared);
        if policy == "pack" {
            assert_eq!(ga, gb, "pack: both on one GPU");
            assert_eq!(shared, vec![ga.clone()]);
            // CloudStack's figures: 2 slots of 4 used on the shared GPU, and the other GPU
            // would host 4 more while it is whole.
            let cap = vgpu_capacity(&s).await;
            assert_eq!(
                (
                    cap.max_capacity,
                    cap.remaining_capacity,
                    cap.in_use,
                    cap.gpus
                ),
                (8, 6, 2, 1)
            );
            assert_eq!(cap.servers.len(), 1);
            assert_eq!(cap.servers[0].server_uuid, server);
            assert_eq!(cap.servers[0].remaining_capacity, 6);
            let whole = create(&s, &tenant, "gpu-1x", "whole").await;
            assert_ne!(whole.assigned_devices[0], ga);
            assert_eq!(whole.assigned_devices[0].vgpu(), None);
            // The whole GPU is held now: the shared one's free slots remain.
            let cap = vgpu_capacity(&s).await;
            assert_eq!(
                (cap.max_capacity, cap.remaining_capacity, cap.in_use),
                (8, 2, 2)
            );
            let all: Vec<Capacity> = s.get("/v1/capacity").await.ok(200);
            let parent = all.iter().find(|c| c.variant == "NVIDIA_H100").unwrap();
            assert_eq!((parent.shared, parent.provisioning), (1, 1));
        } else {
            assert_ne!(ga, gb, "spread: one vGPU per GPU");
            assert_eq!(shared.len(), 2);
            s.with(&tenant)
                .post::<Vm>(
                    "/v1/vms",
                    &json!({"image": "test-image", "alias": "whole", "package": "gpu-1x"}),
                )
                .await
                .fails(409, ErrorCode::InsufficientCapacity);
        }
    }
}
both!(pack_and_spread_on, pack_and_spread);

/// The whole life of vGPUs through the real agent loop over the fake kernel, for both
/// frameworks: two VMs get vGPUs of one GPU (an mdev each, or a VF each with the type
/// set), run, and are destroyed; their vGPUs are gone from the node after the scrub, and
/// the GPU, scrubbed whole, is assignable whole again.
async fn vgpus_made_run_and_go_on_a_node(b: Backend) {
    use node_agent::fake::GpuModel;
    use passage_model::api::{Job, JobState, VmState};
    for (model, framework, ids, vgpu_type) in [
        (
            GpuModel::A100,
            FakeVgpu::Mdev,
            ("A100", "20b0"),
            "GRID A100-10C",
        ),
        (
            GpuModel::H100,
            FakeVgpu::Vfio,
            ("H100", "2330"),
            "NVIDIA H100XM-10C",
        ),
    ] {
        let mut s = TestServer::start(b, fast_config()).await;
        let opts = FakeOptions {
            vgpu: Some(framework),
            ..FakeOptions::default()
        };
        let node = s.add_node_from(1, model, &opts).await;
        s.image().await;
        let (parent, device) = ids;
        let _: Variant = s
            .post(
                "/v1/variants",
                &json!({"name": parent, "type": "gpu", "vendor": "10de", "device": device}),
            )
            .await
            .ok(201);
        let _: Variant = s
            .post(
                "/v1/variants",
                &json!({"name": "V", "type": "vgpu", "parent": parent,
                        "vgpu_type": vgpu_type, "max_per_gpu": 4}),
            )
            .await
            .ok(201);
        for (name, devices) in [("vgpu", json!({"V": 1})), ("whole", json!({parent: 1}))] {
            let _: Package = s
                .post(
                    "/v1/packages",
                    &json!({"name": name, "vcpus": 1, "memory_mib": 1024, "disk_gib": 10,
                            "devices": devices}),
                )
                .await
                .ok(201);
        }
        let (_, tenant) = s.tenant("t").await;
        let mut vms = Vec::new();
        for alias in ["a", "b"] {
            let vm = create(&s, &tenant, "vgpu", alias).await;
            let job: Job = s.wait_job(vm.job_uuid.unwrap()).await;
            assert_eq!(job.state, JobState::Succeeded, "{model:?}: {job:?}");
            vms.push(vm);
        }
        let mdevs = node.sysfs.join("bus/mdev/devices");
        let made = |vm: &Vm| {
            let slot = &vm.assigned_devices[0];
            match framework {
                FakeVgpu::Mdev => mdevs.join(slot.vgpu().unwrap().to_string()).exists(),
                // Some VF of the GPU carries a type.
                FakeVgpu::Vfio => !vf_types(&node, &slot.gpu()).is_empty(),
            }
        };
        for vm in &vms {
            let v: Vm = s
                .with(&tenant)
                .get(&format!("/v1/vms/{}", vm.uuid))
                .await
                .ok(200);
            assert_eq!(v.state, VmState::Running, "{model:?}");
            assert!(
                made(vm),
                "{model:?}: the vGPU of {} exists on the node",
                vm.uuid
            );
        }
        assert_eq!(
            vms[0].assigned_devices[0].gpu(),
            vms[1].assigned_devices[0].gpu()
        );
        let gpu = vms[0].assigned_devices[0].gpu();
        // Destroyed: the vGPUs go, then the GPU is scrubbed whole.
        for vm in &vms {
            let r = s
                .with(&tenant)
                .delete::<Vm>(&format!("/v1/vms/{}", vm.uuid))
                .await;
            s.wait_job(r.ok(202).job_uuid.unwrap()).await;
        }
        let whole_again = crate::common::wait_for(std::time::Duration::from_secs(30), || async {
            let states = s.device_states(node.uuid).await;
            let gpu_state = states.iter().find(|(id, _, _)| *id == gpu).map(|x| x.1);
            let slots = states
                .iter()
                .filter(|(id, _, _)| id.vgpu().is_some())
                .count();
            (gpu_state == Some(DeviceState::Unassigned) && slots == 0).then_some(())
        })
        .await;
        assert!(
            whole_again.is_some(),
            "{model:?}: {:?}",
            s.device_states(node.uuid).await
        );
        for vm in &vms {
            assert!(!made(vm), "{model:?}: the vGPU of {} is gone", vm.uuid);
        }
        let whole = create(&s, &tenant, "whole", "w").await;
        assert_eq!(whole.assigned_devices, vec![gpu.clone()]);
    }
}
both!(
    vgpus_made_run_and_go_on_a_node_on,
    vgpus_made_run_and_go_on_a_node
);

/// A server with `gpus` H100s on one node whose real agent loop makes vendor-VFIO vGPUs
/// over the fake kernel, and the test image.
async fn agent_world(
    b: Backend,
    cfg: passage_server::config::Config,
    gpus: u32,
) -> (TestServer, crate::common::Node) {
    let mut s = TestServer::start(b, cfg).await;
    let opts = FakeOptions {
        vgpu: Some(FakeVgpu::Vfio),
        ..FakeOptions::default()
    };
    let node = s
        .add_node_from(gpus, node_agent::fake::GpuModel::H100, &opts)
        .await;
    s.image().await;
    (s, node)
}

/// A GPU opened for a request that then could not be placed (its other device was
/// nowhere) hosts no vGPU; once none of its slots has been used for `vgpu_idle_close`, it
/// is closed, scrubbed through the real agent loop, and given whole again.
async fn an_idle_vgpu_host_goes_back_whole(b: Backend) {
    use passage_model::api::{Job, JobState};
    let cfg = passage_server::config::Config {
        vgpu_idle_close: std::time::Duration::from_secs(3),
        ..fast_config()
    };
    let (s, node) = agent_world(b, cfg, 1).await;
    catalog(&s, "pack").await;
    let _: Variant = s
        .post(
            "/v1/variants",
            &json!({"name": "NOPE", "type": "fpga", "vendor": "dead", "device": "beef"}),
        )
        .await
        .ok(201);
    let _: Package = s
        .post(
            "/v1/packages",
            &json!({"name": "vgpu-and-nope", "vcpus": 1, "memory_mib": 1024, "disk_gib": 10,
                    "devices": {"H100_10C": 1, "NOPE": 1}}),
        )
        .await
        .ok(201);
    let (_, tenant) = s.tenant("t").await;
    let r = s
        .with(&tenant)
        .post::<Vm>(
            "/v1/vms",
            &json!({"image": "test-image", "alias": "x", "package": "vgpu-and-nope"}),
        )
        .await;
    r.fails(409, ErrorCode::InsufficientCapacity);
    let gpu_states = || async {
        let states = s.device_states(node.uuid).await;
        let gpus: Vec<DeviceState> = states
            .iter()
            .filter(|(id, _, _)| id.vgpu().is_none())
            .filter(|(id, _, _)| {
                // The GPUs, not the node's other devices.
                node_agent::host::device_dir(&node.sysfs, id)
                    .join("sriov_totalvfs")
                    .exists()
                    && std::fs::read_to_string(
                        node_agent::host::device_dir(&node.sysfs, id).join("class"),
                    )
                    .is_ok_and(|c| c.starts_with("0x03"))
            })
            .map(|(_, st, _)| *st)
            .collect();
        let slots = states
            .iter()
            .filter(|(id, _, _)| id.vgpu().is_some())
            .count();
        (gpus, slots)
    };
    let (gpus, slots) = gpu_states().await;
    // Opened for the request, unused: 4 free slots, for 3 s.
    assert_eq!((gpus, slots), (vec![DeviceState::Shared], 4));
    let whole = crate::common::wait_for(std::time::Duration::from_secs(30), || async {
        let (gpus, slots) = gpu_states().await;
        (gpus == [DeviceState::Unassigned] && slots == 0).then_some(())
    })
    .await;
    assert!(whole.is_some(), "{:?}", gpu_states().await);
    let vm = create(&s, &tenant, "gpu-1x", "w").await;
    let job: Job = s.wait_job(vm.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
}
both!(
    an_idle_vgpu_host_goes_back_whole_on,
    an_idle_vgpu_host_goes_back_whole
);

/// A stopped VM resized from a whole GPU to a vGPU package gets its vGPU on its own
/// server (its boot disk lives there), from a GPU opened for it; its whole GPU is
/// scrubbed and free again, and the VM starts with the vGPU.
async fn a_vm_resized_to_a_vgpu_gets_one_on_its_server(b: Backend) {
    use passage_model::api::{Job, JobState, VmState};
    let (s, node) = agent_world(b, fast_config(), 2).await;
    let vgpu_package = catalog(&s, "pack").await;
    let (_, tenant) = s.tenant("t").await;
    let vm = create(&s, &tenant, "gpu-1x", "grow").await;
    let job: Job = s.wait_job(vm.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let whole = vm.assigned_devices[0].clone();
    let act = |what: &'static str, body: serde_json::Value| {
        let c = s.with(&tenant);
        let path = format!("/v1/vms/{}/{what}", vm.uuid);
        async move { c.post::<Vm>(&path, &body).await.ok(202) }
    };
    let stopped = act("stop", json!({})).await;
    s.wait_job(stopped.job_uuid.unwrap()).await;
    let resized = act("resize", json!({"package": vgpu_package})).await;
    let job: Job = s.wait_job(resized.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let v: Vm = s
        .with(&tenant)
        .get(&format!("/v1/vms/{}", vm.uuid))
        .await
        .ok(200);
    assert_eq!(v.server_uuid, Some(node.uuid));
    assert_eq!(v.assigned_devices.len(), 1, "{v:?}");
    let slot = &v.assigned_devices[0];
    assert!(slot.vgpu().is_some(), "{slot}");
    assert_ne!(slot.gpu(), whole, "the other GPU was opened");
    assert!(
        back_whole(&s, node.uuid, &whole).await,
        "{:?}",
        s.device_states(node.uuid).await
    );
    let started = act("start", json!({})).await;
    let job: Job = s.wait_job(started.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let v: Vm = s
        .with(&tenant)
        .get(&format!("/v1/vms/{}", vm.uuid))
        .await
        .ok(200);
    assert_eq!(v.state, VmState::Running);
}
both!(
    a_vm_resized_to_a_vgpu_gets_one_on_its_server_on,
    a_vm_resized_to_a_vgpu_gets_one_on_its_server
);

/// MIG mode of each GPU of `node`, by the node's `nvidia-smi` (the fake tree's stand-in).
fn mig_modes(node: &crate::common::Node) -> Vec<(String, bool)> {
    let out = std::process::Command::new(node.sysfs.join(node_agent::fake::FAKE_NVIDIA_SMI))
        .args([
            "--query-gpu=pci.bus_id,mig.mode.current",
            "--format=csv,noheader",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once(", "))
        .map(|(id, m)| (id.to_string(), m == "Enabled"))
        .collect()
}

fn mig_on(node: &crate::common::Node, gpu: &DevicePath) -> bool {
    let a = gpu.address();
    let id = format!(
        "{:08X}:{:02X}:{:02X}.{:X}",
        a.domain, a.bus, a.device, a.function
    );
    let modes = mig_modes(node);
    modes
        .iter()
        .find(|(g, _)| *g == id)
        .unwrap_or_else(|| panic!("{id} in {modes:?}"))
        .1
}

/// `NVIDIA_H100` and the mixing MIG-backed `H100_1G` (7 per GPU) and `H100_2G` (3), with
/// the time-sliced `H100_10C` (4, no mixing) when `sliced`; a pack package of one of each,
/// named in lower case.
async fn mig_catalog(s: &TestServer, sliced: bool) {
    s.h100_catalog(1).await;
    let types = [
        ("H100_1G", "NVIDIA H100XM-1-10C", 7, true),
        ("H100_2G", "NVIDIA H100XM-2-20C", 3, true),
        ("H100_10C", "NVIDIA H100XM-10C", 4, false),
    ];
    for (name, vgpu_type, max, mix) in types.into_iter().filter(|t| sliced || t.3) {
        let v: Variant = s
            .post(
                "/v1/variants",
                &json!({"name": name, "type": "vgpu", "parent": "NVIDIA_H100",
                        "vgpu_type": vgpu_type, "max_per_gpu": max, "mix": mix}),
            )
            .await
            .ok(201);
        assert_eq!(v.mix, mix);
        let _: Package = s
            .post(
                "/v1/packages",
                &json!({"name": name.to_lowercase(), "vcpus": 1, "memory_mib": 1024,
                        "disk_gib": 10, "devices": {name: 1}, "placement": "pack"}),
            )
            .await
            .ok(201);
    }
}

/// The vGPU type ids the VFs of the vendor-VFIO `gpu` carry now, sorted.
fn vf_types(node: &crate::common::Node, gpu: &DevicePath) -> Vec<String> {
    let dir = node_agent::host::device_dir(&node.sysfs, gpu);
    let mut types: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("virtfn"))
        .filter_map(|e| std::fs::read_to_string(e.path().join("nvidia/current_vgpu_type")).ok())
        .map(|t| t.trim().to_string())
        .filter(|t| t != "0")
        .collect();
    types.sort();
    types
}

/// MIG-backed types that mix, through the real agent loop over the fake kernel: the
/// first vGPU of one turns its GPU's MIG mode on (the node runs nvidia-smi); a vGPU of
/// another MIG-backed type then joins that GPU (pack), taking back free slots of the
/// first so the two never claim more than the GPU; a time-sliced type, which does not
/// mix, gets the other GPU, whose MIG mode stays off. Destroyed, every vGPU goes.
async fn mig_types_switch_the_gpu_and_mix(b: Backend) {
    use passage_model::api::{Job, JobState};
    let cfg = passage_server::config::Config {
        vgpu_idle_close: std::time::Duration::from_secs(2),
        ..fast_config()
    };
    let (s, node) = agent_world(b, cfg, 2).await;
    mig_catalog(&s, true).await;
    assert!(
        mig_modes(&node).iter().all(|(_, on)| !on),
        "MIG is off at first"
    );
    let (_, tenant) = s.tenant("t").await;
    let mut vms = Vec::new();
    for (package, alias) in [("h100_1g", "a"), ("h100_2g", "b"), ("h100_10c", "c")] {
        let vm = create(&s, &tenant, package, alias).await;
        let job: Job = s.wait_job(vm.job_uuid.unwrap()).await;
        assert_eq!(job.state, JobState::Succeeded, "{package}: {job:?}");
        vms.push(vm);
    }
    let gpu_of = |vm: &Vm| vm.assigned_devices[0].gpu();
    let (mig_gpu, other) = (gpu_of(&vms[0]), gpu_of(&vms[2]));
    assert_eq!(gpu_of(&vms[1]), mig_gpu, "the 2G joins the 1G's GPU");
    assert_ne!(other, mig_gpu, "the time-sliced type does not mix");
    assert!(mig_on(&node, &mig_gpu));
    assert!(!mig_on(&node, &other));
    // The capacity view counts what a join would add: one more 2G does not fit beside
    // the two 1G and two 2G slots (17/21 of the GPU held or the 2G's own), while two
    // more 1G do, once the free 2G slot is taken back (13/21 held).
    let cap = |name: &'static str| {
        let s = &s;
        async move {
            let c = capacity_of(s, name).await;
            (c.max_capacity, c.remaining_capacity, c.in_use)
        }
    };
    assert_eq!(cap("H100_1G").await, (4, 3, 1), "1G: 2 slots + 2 joinable");
    s.assert_free_index_exact("vGPUs").await;
    assert_eq!(
        cap("H100_2G").await,
        (2, 1, 1),
        "2G: its 2 slots, none joinable"
    );
    // On the MIG GPU: 1/7 each of the 1G slots, 1/3 each of the 2G: two of each fit
    // (one held and one free of each); five free 1G slots were taken back.
    let srv = s.server(node.uuid).await;
    let on_mig: Vec<(String, DeviceState)> = srv
        .assignable_devices
        .unwrap_or_default()
        .into_iter()
        .filter(|d| d.id.vgpu().is_some() && d.id.gpu() == mig_gpu)
        .map(|d| (d.variant, d.state))
        .collect();
    let count = |v: &str, st: DeviceState| on_mig.iter().filter(|x| x.0 == v && x.1 == st).count();
    assert_eq!(
        (
            count("H100_1G", DeviceState::Used),
            count("H100_1G", DeviceState::Unassigned),
            count("H100_2G", DeviceState::Used),
            count("H100_2G", DeviceState::Unassigned),
        ),
        (1, 1, 1, 1),
        "{on_mig:?}"
    );
    // The node made them: one VF of the MIG GPU is each type.
    assert_eq!(vf_types(&node, &mig_gpu), ["557", "558"]);
    for vm in &vms {
        let r = s
            .with(&tenant)
            .delete::<Vm>(&format!("/v1/vms/{}", vm.uuid))
            .await;
        let job: Job = s.wait_job(r.ok(202).job_uuid.unwrap()).await;
        assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    }
    let none_left = crate::common::wait_for(std::time::Duration::from_secs(30), || async {
        vf_types(&node, &mig_gpu).is_empty().then_some(())
    })
    .await;
    assert!(none_left.is_some(), "every vGPU of the MIG GPU is gone");
    // Idle, the GPU closes and is scrubbed whole: its scrub turns MIG mode off, so the
    // next tenant of the whole GPU gets it as any other.
    assert!(
        back_whole(&s, node.uuid, &mig_gpu).await,
        "the MIG GPU went back whole"
    );
    assert!(!mig_on(&node, &mig_gpu), "its scrub turned MIG mode off");
}
both!(
    mig_types_switch_the_gpu_and_mix_on,
    mig_types_switch_the_gpu_and_mix
);

/// 64 creations of two MIG-backed types that mix (1/7 and 1/3 of a GPU each) race for
/// one GPU already hosting one of them: whatever wins, the slots on it, held or free,
/// never claim more than the whole GPU, and every creation that lost was told there is
/// no capacity.
async fn mixing_types_race_for_one_gpu(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let (server, _, _) = vgpu_node(&s, 1).await;
    mig_catalog(&s, false).await;
    let (_, tenant) = s.tenant("racer").await;
    // The GPU hosts 1G slots first, one held: the 2G racers join it by taking free 1G
    // slots back while the 1G racers reserve those same slots.
    let first = create(&s, &tenant, "h100_1g", "first").await;
    let calls: Vec<_> = (0..64)
        .map(|i| {
            let c = s.with(&tenant);
            let package = if i % 2 == 0 { "h100_1g" } else { "h100_2g" };
            let body = json!({"image": "test-image", "alias": format!("race-{i}"),
                              "package": package});
            tokio::spawn(async move { (package, c.post::<Vm>("/v1/vms", &body).await) })
        })
        .collect();
    let mut won: Vec<(&str, Vm)> = vec![("h100_1g", first)];
    for c in calls {
        let (package, r) = c.await.unwrap();
        match r.status {
            202 => won.push((package, r.ok(202))),
            _ => {
                r.fails(409, ErrorCode::InsufficientCapacity);
            }
        }
    }
    assert!(!won.is_empty());
    let srv = s.server(server).await;
    let slots: Vec<(String, DeviceState, Option<VmId>)> = srv
        .assignable_devices
        .unwrap_or_default()
        .into_iter()
        .filter(|d| d.id.vgpu().is_some())
        .map(|d| (d.variant, d.state, d.used_by))
        .collect();
    let n = |v: &str, held: bool| {
        slots
            .iter()
            .filter(|(x, st, _)| x == v && (!held || *st == DeviceState::Provisioning))
            .count()
    };
    // In sevenths and thirds of the GPU: 3 per 1G, 7 per 2G, 21 the whole GPU.
    let claimed = 3 * n("H100_1G", false) + 7 * n("H100_2G", false);
    assert!(
        claimed <= 21,
        "the slots claim {claimed}/21 of the GPU: {slots:?}"
    );
    let held = 3 * n("H100_1G", true) + 7 * n("H100_2G", true);
    assert_eq!(
        n("H100_1G", true) + n("H100_2G", true),
        won.len(),
        "{slots:?}"
    );
    assert!(held <= 21);
    for (package, vm) in &won {
        let variant = if *package == "h100_1g" {
            "H100_1G"
        } else {
            "H100_2G"
        };
        let slot = slots
            .iter()
            .find(|(_, _, u)| *u == Some(vm.uuid))
            .expect("each winner holds a slot");
        assert_eq!(slot.0, variant);
    }
    assert_eq!(
        gpus_in(&s.device_states(server).await, DeviceState::Shared).len(),
        1
    );
    s.assert_free_index_exact("vGPUs").await;
}
both!(
    mixing_types_race_for_one_gpu_on,
    mixing_types_race_for_one_gpu
);
