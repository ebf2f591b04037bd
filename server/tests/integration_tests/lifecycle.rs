//! Stop, start, resize and cold migration through the real agent loop over fake trees.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config, wait_for};
use passage_model::api::{Alert, Capacity, DeviceRow, JobState, Package, Usage, Vm, VmState};
use passage_model::{DeviceState, ErrorCode, ServerId, VmId};
use serde_json::{Value, json};
use std::time::Duration;

/// `what` (stop, start, resize, migrate) on `vm` as `token`, waited for: the VM after.
async fn act(s: &TestServer, token: &str, vm: VmId, what: &str, body: Option<Value>) -> Vm {
    let path = format!("/v1/vms/{vm}/{what}");
    let c = s.with(token);
    let v: Vm = match body {
        Some(b) => c.post(&path, &b).await,
        None => c.post_empty(&path).await,
    }
    .ok(202);
    let job = s.wait_job(v.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{what}: {job:?}");
    s.get(&format!("/v1/vms/{vm}")).await.ok(200)
}

async fn free_again(s: &TestServer, server: ServerId, n: usize) {
    let ok = wait_for(Duration::from_secs(30), || async {
        let st = s.device_states(server).await;
        (st.iter()
            .filter(|(_, st, _)| *st == DeviceState::Unassigned)
            .count()
            == n)
            .then_some(())
    })
    .await;
    assert!(ok.is_some(), "{:?}", s.device_states(server).await);
}

async fn stop_start_resize_migrate(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let a = s.add_node(4).await;
    s.h100_catalog(1).await;
    s.post::<Package>(
        "/v1/packages",
        &json!({"name":"gpu-2x","vcpus":8,"memory_mib":8192,"devices":{"NVIDIA_H100":2}}),
    )
    .await
    .ok(201);
    let (owner, tenant) = s.tenant("t").await;
    let vm: Vm = s
        .with(&tenant)
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"v","package":"gpu-1x"}),
        )
        .await
        .ok(202);
    let uuid = vm.uuid;
    s.wait_job(vm.job_uuid.unwrap()).await;
    // A VM made before images: it may move (one with a boot disk may not: images.rs).
    s.forget_image(uuid).await;

    // Resizing needs a stopped VM.
    s.with(&tenant)
        .post::<Vm>(
            &format!("/v1/vms/{uuid}/resize"),
            &json!({"package":"gpu-2x"}),
        )
        .await
        .fails(409, ErrorCode::InvalidState);
    let v = act(&s, &tenant, uuid, "stop", None).await;
    assert_eq!(v.state, VmState::Stopped);
    assert!(a.running_vms().is_empty());
    let v = act(&s, &tenant, uuid, "start", None).await;
    assert_eq!(v.state, VmState::Running);
    assert_eq!(a.running_vms(), vec![uuid.to_string()]);
    act(&s, &tenant, uuid, "stop", None).await;

    // Grow in place: the server has free devices; the first device stays.
    let first = v.assigned_devices[0].clone();
    let v = act(
        &s,
        &tenant,
        uuid,
        "resize",
        Some(json!({"package":"gpu-2x"})),
    )
    .await;
    assert_eq!(v.assigned_devices.len(), 2);
    assert_eq!(v.assigned_devices[0], first);
    assert_eq!((v.vcpus, v.server_uuid), (8, Some(a.uuid)));
    let added = v.assigned_devices[1].to_string();
    assert_eq!(a.driver_of(&added).as_deref(), Some("vfio-pci"));
    // Shrink: the surplus device is released and scrubbed.
    let v = act(
        &s,
        &tenant,
        uuid,
        "resize",
        Some(json!({"package":"gpu-1x"})),
    )
    .await;
    assert_eq!(v.assigned_devices, vec![first]);
    free_again(&s, a.uuid, 3).await;
    assert_eq!(a.driver_of(&added).as_deref(), Some("nvidia"));

    // Cold migration (operators only) to a second node; then it starts there.
    let b2 = s.add_node(2).await;
    s.with(&tenant)
        .post::<Vm>(&format!("/v1/vms/{uuid}/migrate"), &json!({}))
        .await
        .err(403);
    let v = act(
        &s,
        &s.admin.clone(),
        uuid,
        "migrate",
        Some(json!({"server_uuid": b2.uuid})),
    )
    .await;
    assert_eq!(v.server_uuid, Some(b2.uuid));
    free_again(&s, a.uuid, 4).await;
    let v = act(&s, &tenant, uuid, "start", None).await;
    assert_eq!(v.state, VmState::Running);
    assert_eq!(b2.running_vms(), vec![uuid.to_string()]);
    assert!(a.running_vms().is_empty());

    // Quota counts every device held, including those a resize adds.
    act(&s, &tenant, uuid, "stop", None).await;
    s.patch::<passage_model::api::Account>(
        &format!("/v1/accounts/{owner}"),
        &json!({"gpu_quota": 1}),
    )
    .await
    .ok(200);
    s.with(&tenant)
        .post::<Vm>(
            &format!("/v1/vms/{uuid}/resize"),
            &json!({"package":"gpu-2x"}),
        )
        .await
        .fails(409, ErrorCode::QuotaExceeded);
    // Usage follows each device: one record per device the VM held, the released closed.
    let u: Usage = s.with(&tenant).get("/v1/usage").await.ok(200);
    assert_eq!(u.records.len(), 3, "{u:?}");
    assert_eq!(u.records.iter().filter(|r| r.ended_at.is_none()).count(), 1);
}
both!(stop_start_resize_migrate_on, stop_start_resize_migrate);

/// Growing when the server lacks free devices moves the VM to one that has them all.
async fn resize_replaces_when_the_server_is_full(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let a = s.add_node(2).await;
    s.h100_catalog(1).await;
    s.post::<Package>(
        "/v1/packages",
        &json!({"name":"gpu-2x","vcpus":8,"memory_mib":8192,"devices":{"NVIDIA_H100":2}}),
    )
    .await
    .ok(201);
    let admin = s.admin.clone();
    let v1: Vm = s
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"v1","package":"gpu-1x"}),
        )
        .await
        .ok(202);
    let v2: Vm = s
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"v2","package":"gpu-1x"}),
        )
        .await
        .ok(202);
    for v in [&v1, &v2] {
        s.forget_image(v.uuid).await;
    }
    for v in [&v1, &v2] {
        s.wait_job(v.job_uuid.unwrap()).await;
        assert_eq!(v.server_uuid, Some(a.uuid));
    }
    let b2 = s.add_node(2).await;
    act(&s, &admin, v1.uuid, "stop", None).await;
    let v = act(
        &s,
        &admin,
        v1.uuid,
        "resize",
        Some(json!({"package":"gpu-2x"})),
    )
    .await;
    assert_eq!(v.server_uuid, Some(b2.uuid));
    assert_eq!(v.assigned_devices.len(), 2);
    free_again(&s, a.uuid, 1).await;
    free_again(&s, b2.uuid, 0).await;
}
both!(
    resize_replaces_when_the_server_is_full_on,
    resize_replaces_when_the_server_is_full
);

/// A VM that dies on its node is never silently lost: the node's heartbeat no longer lists
/// it, the VM shows `stopped` (its devices stay with it), an alert says so, and it starts
/// again.
async fn a_vm_that_exits_is_reported(b: Backend) {
    let mut cfg = fast_config();
    cfg.vm_exit_grace = Duration::from_millis(200);
    let mut s = TestServer::start(b, cfg).await;
    let node = s.add_node(1).await;
    s.h100_catalog(1).await;
    let admin = s.admin.clone();
    let vm: Vm = s
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"fragile","package":"gpu-1x"}),
        )
        .await
        .ok(202);
    let uuid = vm.uuid;
    s.wait_job(vm.job_uuid.unwrap()).await;
    // The sim hypervisor keeps its VMs in its state file; emptying it is a crash.
    std::fs::write(node.state.join("sim-vms.json"), "[]").unwrap();
    let stopped = wait_for(Duration::from_secs(20), || async {
        let v: Vm = s.get(&format!("/v1/vms/{uuid}")).await.ok(200);
        (v.state == VmState::Stopped).then_some(v)
    })
    .await
    .expect("the exit was noticed");
    assert_eq!(stopped.assigned_devices.len(), 1);
    let alerts: Vec<Alert> = s.get("/v1/alerts").await.ok(200);
    assert!(
        alerts
            .iter()
            .any(|a| a.kind == "vm_exited" && a.message.contains(&uuid.to_string()))
    );
    assert_eq!(
        s.device_states(node.uuid).await[0].1,
        DeviceState::Used,
        "the device stays with the VM"
    );
    let v = act(&s, &admin, uuid, "start", None).await;
    assert_eq!(v.state, VmState::Running);
    assert_eq!(node.running_vms(), vec![uuid.to_string()]);
}
both!(a_vm_that_exits_is_reported_on, a_vm_that_exits_is_reported);

/// Polls the VM as fast as a script would until it is in `state`.
async fn seen(s: &TestServer, token: &str, uuid: VmId, state: VmState) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let v: Vm = s.with(token).get(&format!("/v1/vms/{uuid}")).await.ok(200);
        if v.state == state {
            return;
        }
        if v.state == VmState::Failed {
            let job = s.wait_job(v.job_uuid.unwrap()).await;
            panic!("the VM failed: {job:?}");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the VM never became {state:?}: {v:?}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The last step of a job makes the VM running (or stopped) a moment before the job is
/// marked done; a client acting on what it sees must not get a 409 for that job.
async fn a_vm_seen_settled_takes_the_next_action_at_once(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let node = s.add_node(2).await;
    s.h100_catalog(1).await;
    let (_, tenant) = s.tenant("t").await;
    let t = s.with(&tenant);
    for round in 0..6 {
        let r = t
            .post::<Vm>(
                "/v1/vms",
                &json!({"image": "test-image", "alias": format!("quick{round}"), "package":"gpu-1x"}),
            )
            .await;
        if r.status != 202 {
            let cap: Vec<Capacity> = s.get("/v1/capacity").await.ok(200);
            let srv = s.server(node.uuid).await;
            let devs: Vec<DeviceRow> = s.get("/v1/devices").await.ok(200);
            panic!(
                "round {round}: {r:?}\n{cap:?}\n{:?}\n{:?}\n{devs:?}",
                srv.resources, srv.device_counts
            );
        }
        let uuid = r.ok(202).uuid;
        seen(&s, &tenant, uuid, VmState::Running).await;
        let r = t.post_empty::<Vm>(&format!("/v1/vms/{uuid}/stop")).await;
        assert_eq!(
            r.status, 202,
            "round {round}: stop as soon as running: {r:?}"
        );
        seen(&s, &tenant, uuid, VmState::Stopped).await;
        let r = t.post_empty::<Vm>(&format!("/v1/vms/{uuid}/start")).await;
        assert_eq!(
            r.status, 202,
            "round {round}: start as soon as stopped: {r:?}"
        );
        seen(&s, &tenant, uuid, VmState::Running).await;
        let r = t.delete::<Vm>(&format!("/v1/vms/{uuid}")).await;
        assert_eq!(
            r.status, 202,
            "round {round}: delete as soon as running: {r:?}"
        );
        s.wait_job(r.ok(202).job_uuid.unwrap()).await;
        // Scrubbed and free again before the next round.
        free_again(&s, node.uuid, 2).await;
    }
}
both!(
    a_vm_seen_settled_takes_the_next_action_at_once_on,
    a_vm_seen_settled_takes_the_next_action_at_once
);

/// A deletion is tried before the VM is read: a VM at rest that the caller may not change
/// must still answer as a read would (404 to another tenant, 403 to a reader) and be left
/// as it was; the answers after the owner's deletion say why each is refused.
async fn only_whom_may_change_a_vm_at_rest_deletes_it(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let node = s.add_node(1).await;
    s.h100_catalog(1).await;
    let (_, owner) = s.tenant("owner").await;
    let (_, other) = s.tenant("other").await;
    let reader = s.reader("ro").await;
    let vm: Vm = s
        .with(&owner)
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"v","package":"gpu-1x"}),
        )
        .await
        .ok(202);
    let path = format!("/v1/vms/{}", vm.uuid);
    let job = s.wait_job(vm.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let before: Vm = s.get(&path).await.ok(200);
    assert_eq!(before.state, VmState::Running);

    s.with(&other)
        .delete::<Vm>(&path)
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    s.with(&reader).delete::<Vm>(&path).await.err(403);
    let after: Vm = s.get(&path).await.ok(200);
    assert_eq!(after, before, "a refused deletion changed the VM");
    assert_eq!(node.running_vms(), vec![vm.uuid.to_string()]);

    let gone: Vm = s.with(&owner).delete(&path).await.ok(202);
    assert_eq!(gone.state, VmState::Destroying);
    assert_ne!(gone.job_uuid, before.job_uuid);
    s.with(&owner)
        .delete::<Vm>(&path)
        .await
        .fails(409, ErrorCode::InvalidState);
    let job = s.wait_job(gone.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    assert!(node.running_vms().is_empty());
    s.with(&owner)
        .delete::<Vm>(&path)
        .await
        .fails(409, ErrorCode::InvalidState);
    s.with(&other)
        .delete::<Vm>(&path)
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    free_again(&s, node.uuid, 1).await;
}
both!(
    only_whom_may_change_a_vm_at_rest_deletes_it_on,
    only_whom_may_change_a_vm_at_rest_deletes_it
);
