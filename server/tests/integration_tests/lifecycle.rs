//! Stop, start, resize and cold migration through the real agent loop over fake trees.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config, wait_for};
use serde_json::{Value, json};
use std::time::Duration;

async fn act(s: &TestServer, token: &str, vm: &str, what: &str, body: Option<Value>) -> Value {
    let (st, v) = s
        .call("POST", &format!("/v1/vms/{vm}/{what}"), Some(token), body)
        .await;
    assert_eq!(st, 202, "{what}: {v}");
    let job = s.wait_job(v["job_uuid"].as_str().unwrap()).await;
    assert_eq!(job["state"], "succeeded", "{what}: {job}");
    s.admin_call("GET", &format!("/v1/vms/{vm}"), None).await.1
}

async fn free_again(s: &TestServer, server: &str, n: usize) {
    let ok = wait_for(Duration::from_secs(30), || async {
        let st = s.device_states(server).await;
        (st.iter().filter(|(_, st, _)| st == "unassigned").count() == n).then_some(())
    })
    .await;
    assert!(ok.is_some(), "{:?}", s.device_states(server).await);
}

async fn stop_start_resize_migrate(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let a = s.add_node(4).await;
    s.h100_catalog(1).await;
    let (st, _) = s
        .admin_call(
            "POST",
            "/v1/packages",
            Some(json!({"name":"gpu-2x","vcpus":8,"memory_mib":8192,"devices":{"NVIDIA_H100":2}})),
        )
        .await;
    assert_eq!(st, 201);
    let (owner, tenant) = s.tenant("t").await;
    let (_, vm) = s
        .call(
            "POST",
            "/v1/vms",
            Some(&tenant),
            Some(json!({"alias":"v","package":"gpu-1x"})),
        )
        .await;
    let uuid = vm["uuid"].as_str().unwrap().to_string();
    s.wait_job(vm["job_uuid"].as_str().unwrap()).await;

    // Resizing needs a stopped VM.
    let (st, e) = s
        .call(
            "POST",
            &format!("/v1/vms/{uuid}/resize"),
            Some(&tenant),
            Some(json!({"package":"gpu-2x"})),
        )
        .await;
    assert_eq!((st, e["code"].as_str()), (409, Some("InvalidState")), "{e}");
    let v = act(&s, &tenant, &uuid, "stop", None).await;
    assert_eq!(v["state"], "stopped");
    assert!(a.running_vms().is_empty());
    let v = act(&s, &tenant, &uuid, "start", None).await;
    assert_eq!(v["state"], "running");
    assert_eq!(a.running_vms(), vec![uuid.clone()]);
    act(&s, &tenant, &uuid, "stop", None).await;

    // Grow in place: the server has free devices; the first device stays.
    let first = v["assigned_devices"][0].clone();
    let v = act(
        &s,
        &tenant,
        &uuid,
        "resize",
        Some(json!({"package":"gpu-2x"})),
    )
    .await;
    assert_eq!(v["assigned_devices"].as_array().unwrap().len(), 2);
    assert_eq!(v["assigned_devices"][0], first);
    assert_eq!(
        (v["vcpus"].as_u64(), v["server_uuid"].as_str()),
        (Some(8), Some(a.uuid.as_str()))
    );
    let added = v["assigned_devices"][1].as_str().unwrap().to_string();
    assert_eq!(a.driver_of(&added).as_deref(), Some("vfio-pci"));
    // Shrink: the surplus device is released and scrubbed.
    let v = act(
        &s,
        &tenant,
        &uuid,
        "resize",
        Some(json!({"package":"gpu-1x"})),
    )
    .await;
    assert_eq!(v["assigned_devices"], json!([first]));
    free_again(&s, &a.uuid, 3).await;
    assert_eq!(a.driver_of(&added).as_deref(), Some("nvidia"));

    // Cold migration (operators only) to a second node; then it starts there.
    let b2 = s.add_node(2).await;
    let (st, _) = s
        .call(
            "POST",
            &format!("/v1/vms/{uuid}/migrate"),
            Some(&tenant),
            Some(json!({})),
        )
        .await;
    assert_eq!(st, 403);
    let v = act(
        &s,
        &s.admin.clone(),
        &uuid,
        "migrate",
        Some(json!({"server_uuid": b2.uuid})),
    )
    .await;
    assert_eq!(v["server_uuid"], b2.uuid.as_str());
    free_again(&s, &a.uuid, 4).await;
    let v = act(&s, &tenant, &uuid, "start", None).await;
    assert_eq!(v["state"], "running");
    assert_eq!(b2.running_vms(), vec![uuid.clone()]);
    assert!(a.running_vms().is_empty());

    // Quota counts every device held, including those a resize adds.
    act(&s, &tenant, &uuid, "stop", None).await;
    s.admin_call(
        "PATCH",
        &format!("/v1/accounts/{owner}"),
        Some(json!({"gpu_quota": 1})),
    )
    .await;
    let (st, e) = s
        .call(
            "POST",
            &format!("/v1/vms/{uuid}/resize"),
            Some(&tenant),
            Some(json!({"package":"gpu-2x"})),
        )
        .await;
    assert_eq!(
        (st, e["code"].as_str()),
        (409, Some("QuotaExceeded")),
        "{e}"
    );
    // Usage follows each device: one record per device the VM held, the released closed.
    let (_, u) = s.call("GET", "/v1/usage", Some(&tenant), None).await;
    let recs = u["records"].as_array().unwrap();
    assert_eq!(recs.len(), 3, "{u}");
    assert_eq!(recs.iter().filter(|r| r["ended_at"].is_null()).count(), 1);
}
both!(stop_start_resize_migrate_on, stop_start_resize_migrate);

/// Growing when the server lacks free devices moves the VM to one that has them all.
async fn resize_replaces_when_the_server_is_full(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let a = s.add_node(2).await;
    s.h100_catalog(1).await;
    s.admin_call(
        "POST",
        "/v1/packages",
        Some(json!({"name":"gpu-2x","vcpus":8,"memory_mib":8192,"devices":{"NVIDIA_H100":2}})),
    )
    .await;
    let admin = s.admin.clone();
    let (_, v1) = s
        .admin_call(
            "POST",
            "/v1/vms",
            Some(json!({"alias":"v1","package":"gpu-1x"})),
        )
        .await;
    let (_, v2) = s
        .admin_call(
            "POST",
            "/v1/vms",
            Some(json!({"alias":"v2","package":"gpu-1x"})),
        )
        .await;
    for v in [&v1, &v2] {
        s.wait_job(v["job_uuid"].as_str().unwrap()).await;
        assert_eq!(v["server_uuid"], a.uuid.as_str());
    }
    let b2 = s.add_node(2).await;
    let uuid = v1["uuid"].as_str().unwrap().to_string();
    act(&s, &admin, &uuid, "stop", None).await;
    let v = act(
        &s,
        &admin,
        &uuid,
        "resize",
        Some(json!({"package":"gpu-2x"})),
    )
    .await;
    assert_eq!(v["server_uuid"], b2.uuid.as_str());
    assert_eq!(v["assigned_devices"].as_array().unwrap().len(), 2);
    free_again(&s, &a.uuid, 1).await;
    free_again(&s, &b2.uuid, 0).await;
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
    let (_, vm) = s
        .admin_call(
            "POST",
            "/v1/vms",
            Some(json!({"alias":"fragile","package":"gpu-1x"})),
        )
        .await;
    let uuid = vm["uuid"].as_str().unwrap().to_string();
    s.wait_job(vm["job_uuid"].as_str().unwrap()).await;
    // The sim hypervisor keeps its VMs in its state file; emptying it is a crash.
    std::fs::write(node.state.join("sim-vms.json"), "[]").unwrap();
    let stopped = wait_for(Duration::from_secs(20), || async {
        let (_, v) = s.admin_call("GET", &format!("/v1/vms/{uuid}"), None).await;
        (v["state"] == "stopped").then_some(v)
    })
    .await
    .expect("the exit was noticed");
    assert_eq!(stopped["assigned_devices"].as_array().unwrap().len(), 1);
    let (_, alerts) = s.admin_call("GET", "/v1/alerts", None).await;
    assert!(
        alerts
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["kind"] == "vm_exited" && a["message"].as_str().unwrap().contains(&uuid))
    );
    assert_eq!(
        s.device_states(&node.uuid).await[0].1,
        "used",
        "the device stays with the VM"
    );
    let v = act(&s, &admin, &uuid, "start", None).await;
    assert_eq!(v["state"], "running");
    assert_eq!(node.running_vms(), vec![uuid]);
}
both!(a_vm_that_exits_is_reported_on, a_vm_that_exits_is_reported);

/// Polls the VM as fast as a script would until it is in `state`.
async fn seen(s: &TestServer, token: &str, uuid: &str, state: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, v) = s
            .call("GET", &format!("/v1/vms/{uuid}"), Some(token), None)
            .await;
        if v["state"] == state {
            return;
        }
        if v["state"] == "failed" {
            let job = s.wait_job(v["job_uuid"].as_str().unwrap()).await;
            panic!("the VM failed: {job}");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the VM never became {state}: {v}"
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
    for round in 0..6 {
        let (st, vm) = s
            .call(
                "POST",
                "/v1/vms",
                Some(&tenant),
                Some(json!({"alias": format!("quick{round}"), "package":"gpu-1x"})),
            )
            .await;
        if st != 202 {
            let cap = s.admin_call("GET", "/v1/capacity", None).await.1;
            let srv = s.server(&node.uuid).await;
            let devs = s.admin_call("GET", "/v1/devices", None).await.1;
            panic!(
                "round {round}: {vm}\n{cap}\n{}\n{}\n{devs}",
                srv["resources"], srv["device_counts"]
            );
        }
        let uuid = vm["uuid"].as_str().unwrap().to_string();
        seen(&s, &tenant, &uuid, "running").await;
        let (st, v) = s
            .call("POST", &format!("/v1/vms/{uuid}/stop"), Some(&tenant), None)
            .await;
        assert_eq!(st, 202, "round {round}: stop as soon as running: {v}");
        seen(&s, &tenant, &uuid, "stopped").await;
        let (st, v) = s
            .call(
                "POST",
                &format!("/v1/vms/{uuid}/start"),
                Some(&tenant),
                None,
            )
            .await;
        assert_eq!(st, 202, "round {round}: start as soon as stopped: {v}");
        seen(&s, &tenant, &uuid, "running").await;
        let (st, v) = s
            .call("DELETE", &format!("/v1/vms/{uuid}"), Some(&tenant), None)
            .await;
        assert_eq!(st, 202, "round {round}: delete as soon as running: {v}");
        s.wait_job(v["job_uuid"].as_str().unwrap()).await;
        // Scrubbed and free again before the next round.
        free_again(&s, &node.uuid, 2).await;
    }
}
both!(
    a_vm_seen_settled_takes_the_next_action_at_once_on,
    a_vm_seen_settled_takes_the_next_action_at_once
);
