//! `GET /v1/vms/{uuid}/console`: the end of a VM's serial console, read from its node
//! (here the real agent loop with the simulated hypervisor, which writes a boot log).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::*;
use passage_model::ErrorCode;
use passage_model::api::{JobState, Vm, VmConsole};
use serde_json::{Value, json};

async fn owners_read_their_vms_console(backend: Backend) {
    let mut s = TestServer::start(backend, fast_config()).await;
    let _node = s.add_node(2).await;
    s.h100_catalog(1).await;
    let (_, alice) = s.tenant("alice").await;
    let (_, bob) = s.tenant("bob").await;
    let (alice, bob) = (s.with(&alice), s.with(&bob));
    let vm: Vm = alice
        .post(
            "/v1/vms",
            &json!({"alias": "c", "package": "gpu-1x", "image": "test-image"}),
        )
        .await
        .ok(202);
    let job = s.wait_job(vm.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let path = format!("/v1/vms/{}/console", vm.uuid);
    let c: VmConsole = alice.get(&path).await.ok(200);
    assert_eq!(c.vm_uuid, vm.uuid);
    assert!(
        c.output.contains(&vm.uuid.to_string()),
        "the simulated boot log names its VM: {:?}",
        c.output
    );
    let by_op: VmConsole = s.get(&path).await.ok(200);
    assert_eq!(by_op.vm_uuid, vm.uuid);
    bob.get::<Value>(&path)
        .await
        .fails(404, ErrorCode::ResourceNotFound);

    let d: Vm = alice.delete(&format!("/v1/vms/{}", vm.uuid)).await.ok(202);
    s.wait_job(d.job_uuid.unwrap()).await;
    alice
        .get::<Value>(&path)
        .await
        .fails(409, ErrorCode::InvalidState);
}
both!(owners_read_their_vms_console, owners_read_their_vms_console);
