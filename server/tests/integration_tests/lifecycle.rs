//! Stop, start, resize and cold migration through the real agent loop over fake trees.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config, wait_for};
use passage_model::api::{Alert, Capacity, DeviceRow, JobState, Package, Usage, Vm, VmState};
use passage_model::jobs::JobKind;
use passage_model::{DeviceState, ErrorCode, JobId, ServerId, VmId};
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

/// Deletions that come together are written in one transaction
/// (`store::vms::begin_destroy_many`), each answered as its own: a VM of another account
/// is left as it was (its owner's deletion in the same batch still takes it), a VM named
/// twice is taken once, a missing one is not, an operator's takes anyone's. Then the same
/// mix, at once through the API.
async fn deletions_together_are_each_answered_as_their_own(b: Backend) {
    use passage_server::services::destroys;
    use passage_server::store::{jobs, vms};
    let mut s = TestServer::start(b, fast_config()).await;
    let node = s.add_node(8).await;
    s.h100_catalog(1).await;
    let (owner_id, owner) = s.tenant("owner").await;
    let (other_id, other) = s.tenant("other").await;
    let mut made = Vec::new();
    for (token, n) in [(&owner, 5), (&other, 2)] {
        for i in 0..n {
            let vm: Vm = s
                .with(token)
                .post(
                    "/v1/vms",
                    &json!({"image": "test-image", "alias": format!("v{i}"), "package": "gpu-1x"}),
                )
                .await
                .ok(202);
            made.push(vm);
        }
    }
    let mut at_rest = Vec::new();
    for vm in &made {
        assert_eq!(
            s.wait_job(vm.job_uuid.unwrap()).await.state,
            JobState::Succeeded
        );
        at_rest.push(s.get::<Vm>(&format!("/v1/vms/{}", vm.uuid)).await.ok(200));
    }
    let (mine, theirs) = at_rest.split_at(5);

    let req = |vm: &Vm, owner| vms::DestroyReq {
        vm: vm.uuid,
        job: JobId::new_random(),
        owner,
    };
    let missing = vms::DestroyReq {
        vm: VmId::new_random(),
        job: JobId::new_random(),
        owner: None,
    };
    let reqs = vec![
        req(&mine[0], Some(owner_id)),
        req(&mine[1], Some(other_id)),
        req(&mine[1], Some(owner_id)),
        missing,
        req(&theirs[0], None),
        req(&mine[2], Some(owner_id)),
        req(&mine[2], Some(owner_id)),
        req(&mine[3], Some(other_id)),
    ];
    let got = vms::begin_destroy_many(&s.ctx.api_db, &reqs, destroys::job_for)
        .await
        .unwrap();
    let taken: Vec<bool> = got.iter().map(Option::is_some).collect();
    assert_eq!(&taken[..5], [true, false, true, false, true]);
    assert_eq!(
        taken[5] as u8 + taken[6] as u8,
        1,
        "mine[2] named twice: {got:?}"
    );
    assert!(!taken[7]);
    for (r, vm) in reqs.iter().zip(&got) {
        let Some(vm) = vm else { continue };
        assert_eq!(
            (vm.uuid, vm.state, vm.job_uuid),
            (r.vm, VmState::Destroying, Some(r.job))
        );
        let job = jobs::get(&s.ctx.db, r.job).await.unwrap();
        assert_eq!((job.kind, job.vm), (JobKind::Destroy, Some(r.vm)));
        // Queued; the reconciler may have picked it up already.
        assert!(
            matches!(job.state, JobState::Queued | JobState::Running),
            "{job:?}"
        );
        passage_server::workflows::spawn(s.ctx.clone(), r.job);
    }
    let left: Vm = s.get(&format!("/v1/vms/{}", mine[3].uuid)).await.ok(200);
    assert_eq!(left, mine[3], "another account's deletion changed the VM");

    // Through the API, all at once.
    let path = |vm: &Vm| format!("/v1/vms/{}", vm.uuid);
    let (o, t) = (s.with(&owner), s.with(&other));
    let calls = [
        (o.clone(), path(&mine[3])),
        (o.clone(), path(&mine[4])),
        (o.clone(), path(&mine[4])),
        (o.clone(), path(&theirs[1])),
        (t.clone(), path(&mine[3])),
    ];
    let answers = futures_util::future::join_all(
        calls
            .iter()
            .map(|(c, p)| async move { c.delete::<Vm>(p).await }),
    )
    .await;
    let status: Vec<u16> = answers.iter().map(|r| r.status).collect();
    assert_eq!(status[0], 202, "{answers:?}");
    let mut twice = [status[1], status[2]];
    twice.sort();
    assert_eq!(twice, [202, 409], "{answers:?}");
    assert_eq!(status[3..], [404, 404], "{answers:?}");
    for r in answers.into_iter().filter(|r| r.status == 202) {
        let job = s.wait_job(r.ok(202).job_uuid.unwrap()).await;
        assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    }
    // What the batch took, destroyed too; the other account's last VM runs on.
    for r in reqs
        .iter()
        .zip(&got)
        .filter(|(_, g)| g.is_some())
        .map(|(r, _)| r)
    {
        assert_eq!(s.wait_job(r.job).await.state, JobState::Succeeded);
    }
    assert_eq!(node.running_vms(), vec![theirs[1].uuid.to_string()]);
    free_again(&s, node.uuid, 7).await;
}
both!(
    deletions_together_are_each_answered_as_their_own_on,
    deletions_together_are_each_answered_as_their_own
);
