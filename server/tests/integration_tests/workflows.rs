//! Provision and destroy through the real agent loop over fake sysfs trees: the whole
//! path of a device from reservation to scrub, quotas, and a variant's own scrub pipeline.
//! (A failure injected after every step of every workflow: `sagas.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config, wait_for};
use passage_model::api::{DeviceEventRecord, JobState, Package, ScrubRecord, Vm, VmState};
use passage_model::jobs::JobKind;
use passage_model::{DevicePath, DeviceState, ErrorCode, ServerId, Variant, VmId};
use serde_json::json;
use std::time::Duration;

async fn create_vm(s: &TestServer, token: &str, alias: &str) -> Vm {
    s.with(token)
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias": alias, "package": "gpu-1x"}),
        )
        .await
        .ok(202)
}

async fn vm(s: &TestServer, uuid: VmId) -> Vm {
    s.get(&format!("/v1/vms/{uuid}")).await.ok(200)
}

type DeviceStates = Vec<(DevicePath, DeviceState, Option<VmId>)>;

/// Waits until no device of the server is dirty or cleaning (scrubs done).
async fn settle(s: &TestServer, server: ServerId) -> DeviceStates {
    wait_for(Duration::from_secs(60), || async {
        let st = s.device_states(server).await;
        st.iter()
            .all(|(_, state, _)| !matches!(state, DeviceState::Dirty | DeviceState::Cleaning))
            .then_some(st)
    })
    .await
    .expect("devices settled")
}

async fn provision_and_destroy(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let node = s.add_node(8).await;
    s.h100_catalog(1).await;
    let (owner, tenant) = s.tenant("t1").await;
    let v = create_vm(&s, &tenant, "vm-1").await;
    let uuid = v.uuid;
    assert_eq!(v.state, VmState::Provisioning);
    assert_eq!(v.owner_uuid, owner);
    let job = s.wait_job(v.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let names: Vec<&str> = job.steps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, JobKind::Provision.step_names());
    let v = vm(&s, uuid).await;
    assert_eq!(v.state, VmState::Running);
    let dev = v.assigned_devices[0].clone();
    let dev_s = dev.to_string();
    assert_eq!(node.driver_of(&dev_s).as_deref(), Some("vfio-pci"));
    assert_eq!(node.running_vms(), vec![uuid.to_string()]);
    let srv = s.server(node.uuid).await;
    assert_eq!(srv.vms.unwrap()[&uuid].assigned_devices[0], dev);
    let d = srv
        .assignable_devices
        .unwrap()
        .into_iter()
        .find(|d| d.id == dev)
        .unwrap();
    assert_eq!((d.state, d.used_by), (DeviceState::Used, Some(uuid)));

    let gone: Vm = s
        .with(&tenant)
        .delete(&format!("/v1/vms/{uuid}"))
        .await
        .ok(202);
    assert_eq!(gone.state, VmState::Destroying);
    let job = s.wait_job(gone.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    assert_eq!(vm(&s, uuid).await.state, VmState::Destroyed);
    assert!(node.running_vms().is_empty());
    assert_eq!(node.driver_of(&dev_s).as_deref(), Some("nvidia"));
    let states = settle(&s, node.uuid).await;
    assert!(
        states
            .iter()
            .all(|(_, st, u)| *st == DeviceState::Unassigned && u.is_none())
    );
    // The device went dirty, and came back only after its scrub report.
    let events: Vec<DeviceEventRecord> = s
        .get(&format!(
            "/v1/servers/{}/device-events?device={dev}",
            node.uuid
        ))
        .await
        .ok(200);
    let path: Vec<DeviceState> = events.iter().map(|e| e.to).collect();
    use DeviceState::*;
    assert_eq!(path, [Provisioning, Used, Dirty, Cleaning, Unassigned]);
    let reports: Vec<ScrubRecord> = s
        .get(&format!(
            "/v1/servers/{}/scrub-reports?device={dev}",
            node.uuid
        ))
        .await
        .ok(200);
    let r = &reports[0];
    assert!(r.ok);
    assert!(r.steps.iter().any(|s| s.name == "reset" && s.ok));
    assert!(r.at <= events[4].at);
    // The report names the scrub task whose result brought it.
    let task = passage_server::store::tasks::result(&s.ctx.db, r.task_uuid.unwrap())
        .await
        .unwrap()
        .unwrap();
    assert!(task.scrub_reports.iter().any(|t| t.device == dev && t.ok));
    let resets = std::fs::read_to_string(node.sysfs.join(node_agent::fake::RESET_LOG)).unwrap();
    assert!(
        resets.contains(&dev.address().to_string()),
        "the agent reset the device"
    );
}
both!(provision_and_destroy_on, provision_and_destroy);

async fn quota_is_enforced(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    s.add_node(4).await;
    s.h100_catalog(1).await;
    let (uuid, tenant) = s.tenant("q").await;
    s.patch::<passage_model::api::Account>(
        &format!("/v1/accounts/{uuid}"),
        &json!({"gpu_quota": 1}),
    )
    .await
    .ok(200);
    create_vm(&s, &tenant, "first").await;
    s.with(&tenant)
        .post::<Vm>(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"second","package":"gpu-1x"}),
        )
        .await
        .fails(409, ErrorCode::QuotaExceeded);
}
both!(quota_is_enforced_on, quota_is_enforced);

/// A variant's own scrub pipeline reaches the node: a failing step quarantines the device,
/// and the report shows each step.
async fn variant_scrub_pipeline(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let node = s.add_node(1).await;
    let v: Variant = s
        .post(
            "/v1/variants",
            &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330",
                "scrub":[{"action":"reset"},{"action":"command","argv":["/bin/false"]},{"action":"verify_driver"}]}),
        )
        .await
        .ok(201);
    assert!(matches!(
        v.scrub.as_deref().unwrap()[1],
        passage_model::protocol::ScrubAction::Command { .. }
    ));
    s.post::<Package>(
        "/v1/packages",
        &json!({"name":"gpu-1x","vcpus":1,"memory_mib":1024,"devices":{"NVIDIA_H100":1}}),
    )
    .await
    .ok(201);
    s.image().await;
    let vm = create_vm(&s, &s.admin.clone(), "p").await;
    s.wait_job(vm.job_uuid.unwrap()).await;
    let d: Vm = s.delete(&format!("/v1/vms/{}", vm.uuid)).await.ok(202);
    let job = s.wait_job(d.job_uuid.unwrap()).await;
    assert_eq!(
        job.state,
        JobState::Failed,
        "the scrub step failed: {job:?}"
    );
    let states = settle(&s, node.uuid).await;
    assert_eq!(states[0].1, DeviceState::Quarantined);
    let reports: Vec<ScrubRecord> = s
        .get(&format!("/v1/servers/{}/scrub-reports", node.uuid))
        .await
        .ok(200);
    let steps: Vec<(&str, bool)> = reports[0]
        .steps
        .iter()
        .map(|s| (s.name.as_str(), s.ok))
        .collect();
    assert_eq!(
        steps,
        [("reset", true), ("command", false)],
        "stops at the first failure"
    );
}
both!(variant_scrub_pipeline_on, variant_scrub_pipeline);
