//! Provision and destroy through the real agent loop over fake sysfs trees, with a
//! failure injected at every step: each job fails cleanly, no device stays held, no VM
//! is left half-made, and undoing again changes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, Node, TestServer, fast_config, wait_for};
use passage_server::workflows::{DESTROY_STEPS, PROVISION_STEPS};
use serde_json::{Value, json};
use std::time::Duration;

async fn create_vm(s: &TestServer, token: &str, alias: &str) -> Value {
    let (st, vm) = s
        .call(
            "POST",
            "/v1/vms",
            Some(token),
            Some(json!({"alias": alias, "package": "gpu-1x"})),
        )
        .await;
    assert_eq!(st, 202, "{vm}");
    vm
}

async fn vm(s: &TestServer, uuid: &str) -> Value {
    s.admin_call("GET", &format!("/v1/vms/{uuid}"), None)
        .await
        .1
}

/// Waits until no device of the server is dirty or cleaning (scrubs done).
async fn settle(s: &TestServer, server: &str) -> Vec<(String, String, Option<String>)> {
    wait_for(Duration::from_secs(60), || async {
        let st = s.device_states(server).await;
        st.iter()
            .all(|(_, state, _)| state != "dirty" && state != "cleaning")
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
    let uuid = v["uuid"].as_str().unwrap().to_string();
    assert_eq!(v["state"], "provisioning");
    assert_eq!(v["owner_uuid"], owner.as_str());
    let job = s.wait_job(v["job_uuid"].as_str().unwrap()).await;
    assert_eq!(job["state"], "succeeded", "{job}");
    let names: Vec<&str> = job["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, PROVISION_STEPS);
    let v = vm(&s, &uuid).await;
    assert_eq!(v["state"], "running");
    let dev = v["assigned_devices"][0].as_str().unwrap().to_string();
    assert_eq!(node.driver_of(&dev).as_deref(), Some("vfio-pci"));
    assert_eq!(node.running_vms(), vec![uuid.clone()]);
    let srv = s.server(&node.uuid).await;
    assert_eq!(srv["vms"][&uuid]["assigned_devices"][0], dev.as_str());
    let d = srv["assignable_devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["id"] == dev.as_str())
        .unwrap()
        .clone();
    assert_eq!(
        (d["state"].as_str(), d["used_by"].as_str()),
        (Some("used"), Some(uuid.as_str()))
    );

    let (st, gone) = s
        .call("DELETE", &format!("/v1/vms/{uuid}"), Some(&tenant), None)
        .await;
    assert_eq!((st, gone["state"].as_str()), (202, Some("destroying")));
    let job = s.wait_job(gone["job_uuid"].as_str().unwrap()).await;
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(vm(&s, &uuid).await["state"], "destroyed");
    assert!(node.running_vms().is_empty());
    assert_eq!(node.driver_of(&dev).as_deref(), Some("nvidia"));
    let states = settle(&s, &node.uuid).await;
    assert!(
        states
            .iter()
            .all(|(_, st, u)| st == "unassigned" && u.is_none())
    );
    // The device went dirty, and came back only after its scrub report.
    let (_, events) = s
        .admin_call(
            "GET",
            &format!("/v1/servers/{}/device-events?device={dev}", node.uuid),
            None,
        )
        .await;
    let path: Vec<&str> = events
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["to"].as_str().unwrap())
        .collect();
    assert_eq!(
        path,
        ["provisioning", "used", "dirty", "cleaning", "unassigned"]
    );
    let (_, reports) = s
        .admin_call(
            "GET",
            &format!("/v1/servers/{}/scrub-reports?device={dev}", node.uuid),
            None,
        )
        .await;
    let r = &reports[0];
    assert_eq!(r["ok"], true);
    assert!(
        r["steps"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["name"] == "reset" && s["ok"] == true)
    );
    let unassigned_at = events[4]["at"].as_str().unwrap();
    assert!(r["at"].as_str().unwrap() <= unassigned_at);
    let resets = std::fs::read_to_string(node.sysfs.join(node_agent::fake::RESET_LOG)).unwrap();
    assert!(
        resets.contains(dev.rsplit('/').next().unwrap()),
        "the agent reset the device"
    );
}
both!(provision_and_destroy_on, provision_and_destroy);

/// What must not change when an unwound job is unwound again.
async fn snapshot(s: &TestServer, node: &Node, vm_uuid: &str) -> Value {
    let devs = s.device_states(&node.uuid).await;
    let drivers: Vec<Option<String>> = devs.iter().map(|(id, _, _)| node.driver_of(id)).collect();
    let v = vm(s, vm_uuid).await;
    json!({"devices": devs, "drivers": drivers, "vm": v, "running": node.running_vms()})
}

async fn provision_faults(b: Backend) {
    for step in PROVISION_STEPS {
        let mut cfg = fast_config();
        cfg.faults = vec![format!("provision.{step}")];
        let mut s = TestServer::start(b, cfg).await;
        let node = s.add_node(2).await;
        s.h100_catalog(1).await;
        let (_, tenant) = s.tenant("t1").await;
        let v = create_vm(&s, &tenant, "doomed").await;
        let uuid = v["uuid"].as_str().unwrap().to_string();
        let job_uuid = v["job_uuid"].as_str().unwrap().to_string();
        let job = s.wait_job(&job_uuid).await;
        assert_eq!(job["state"], "failed", "{step}: {job}");
        assert!(
            job["error"]
                .as_str()
                .unwrap()
                .contains(&format!("provision.{step}"))
        );
        let v = vm(&s, &uuid).await;
        assert_eq!(v["state"], "failed", "{step}");
        assert!(node.running_vms().is_empty(), "{step}: no VM left running");
        let states = settle(&s, &node.uuid).await;
        for (id, st, used_by) in &states {
            assert_eq!(st, "unassigned", "{step}: {id}");
            assert!(used_by.is_none());
            assert_eq!(
                node.driver_of(id).as_deref(),
                Some("nvidia"),
                "{step}: driver restored"
            );
        }
        // Every step that started was undone.
        for st in job["steps"].as_array().unwrap() {
            if !st["started_at"].is_null() {
                assert_eq!(st["state"], "undone", "{step}: {st}");
            }
        }
        // Unwinding again, twice, changes nothing.
        let before = snapshot(&s, &node, &uuid).await;
        for _ in 0..2 {
            let errors = passage_server::workflows::unwind(&s.ctx, job_uuid.parse().unwrap())
                .await
                .unwrap();
            assert!(errors.is_empty(), "{errors:?}");
            assert_eq!(snapshot(&s, &node, &uuid).await, before, "{step}");
        }
        s.ctx.db.close().await;
    }
}
both!(provision_faults_on, provision_faults);

async fn destroy_faults(b: Backend) {
    for step in DESTROY_STEPS {
        let mut cfg = fast_config();
        cfg.faults = vec![format!("destroy.{step}")];
        let mut s = TestServer::start(b, cfg).await;
        let node = s.add_node(2).await;
        s.h100_catalog(1).await;
        let (_, tenant) = s.tenant("t1").await;
        let v = create_vm(&s, &tenant, "short-lived").await;
        let uuid = v["uuid"].as_str().unwrap().to_string();
        assert_eq!(
            s.wait_job(v["job_uuid"].as_str().unwrap()).await["state"],
            "succeeded"
        );
        let (st, d) = s
            .call("DELETE", &format!("/v1/vms/{uuid}"), Some(&tenant), None)
            .await;
        assert_eq!(st, 202);
        let job = s.wait_job(d["job_uuid"].as_str().unwrap()).await;
        assert_eq!(job["state"], "failed", "{step}: {job}");
        let v = vm(&s, &uuid).await;
        let states = settle(&s, &node.uuid).await;
        // Never held after a failed destroy, never freed without a scrub.
        assert!(
            states
                .iter()
                .all(|(_, st, u)| u.is_none() && st != "used" && st != "provisioning"),
            "{step}: {states:?}"
        );
        match *step {
            // The VM's fate on the node is unknown to the control plane: its device is
            // quarantined for an operator, the VM marked failed.
            "stop" | "unbind" => {
                assert_eq!(v["state"], "failed", "{step}");
                assert_eq!(
                    states
                        .iter()
                        .filter(|(_, st, _)| st == "quarantined")
                        .count(),
                    1,
                    "{step}"
                );
            }
            // Past the release the VM is gone; the device was (or will be) scrubbed.
            _ => {
                assert_eq!(v["state"], "destroyed", "{step}");
                assert!(
                    states.iter().all(|(_, st, _)| st == "unassigned"),
                    "{step}: {states:?}"
                );
            }
        }
        assert!(node.running_vms().is_empty(), "{step}");
        s.ctx.db.close().await;
    }
}
both!(destroy_faults_on, destroy_faults);

async fn quota_is_enforced(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    s.add_node(4).await;
    s.h100_catalog(1).await;
    let (uuid, tenant) = s.tenant("q").await;
    let (st, _) = s
        .admin_call(
            "PATCH",
            &format!("/v1/accounts/{uuid}"),
            Some(json!({"gpu_quota": 1})),
        )
        .await;
    assert_eq!(st, 200);
    create_vm(&s, &tenant, "first").await;
    let (st, e) = s
        .call(
            "POST",
            "/v1/vms",
            Some(&tenant),
            Some(json!({"alias":"second","package":"gpu-1x"})),
        )
        .await;
    assert_eq!(
        (st, e["code"].as_str()),
        (409, Some("QuotaExceeded")),
        "{e}"
    );
}
both!(quota_is_enforced_on, quota_is_enforced);

/// A variant's own scrub pipeline reaches the node: a failing step quarantines the device,
/// and the report shows each step.
async fn variant_scrub_pipeline(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let node = s.add_node(1).await;
    let (st, v) = s
        .admin_call(
            "POST",
            "/v1/variants",
            Some(json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330",
                "scrub":[{"action":"reset"},{"action":"command","argv":["/bin/false"]},{"action":"verify_driver"}]})),
        )
        .await;
    assert_eq!(st, 201, "{v}");
    assert_eq!(v["scrub"][1]["action"], "command");
    s.admin_call(
        "POST",
        "/v1/packages",
        Some(json!({"name":"gpu-1x","vcpus":1,"memory_mib":1024,"devices":{"NVIDIA_H100":1}})),
    )
    .await;
    let vm = create_vm(&s, &s.admin.clone(), "p").await;
    s.wait_job(vm["job_uuid"].as_str().unwrap()).await;
    let (_, d) = s
        .admin_call(
            "DELETE",
            &format!("/v1/vms/{}", vm["uuid"].as_str().unwrap()),
            None,
        )
        .await;
    let job = s.wait_job(d["job_uuid"].as_str().unwrap()).await;
    assert_eq!(job["state"], "failed", "the scrub step failed: {job}");
    let states = settle(&s, &node.uuid).await;
    assert_eq!(states[0].1, "quarantined");
    let (_, reports) = s
        .admin_call(
            "GET",
            &format!("/v1/servers/{}/scrub-reports", node.uuid),
            None,
        )
        .await;
    let steps: Vec<(&str, bool)> = reports[0]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["name"].as_str().unwrap(), s["ok"].as_bool().unwrap()))
        .collect();
    assert_eq!(
        steps,
        [("reset", true), ("command", false)],
        "stops at the first failure"
    );
}
both!(variant_scrub_pipeline_on, variant_scrub_pipeline);
