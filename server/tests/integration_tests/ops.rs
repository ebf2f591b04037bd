//! Operator actions, capacity, alerts, usage, audit, metrics and placement dry runs, on
//! SQLite and Postgres, with the real agent loop over fake trees.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config, wait_for};
use serde_json::{Value, json};
use std::time::Duration;

async fn capacity_of(s: &TestServer) -> Value {
    let (st, c) = s.admin_call("GET", "/v1/capacity", None).await;
    assert_eq!(st, 200, "{c}");
    c.as_array()
        .unwrap()
        .iter()
        .find(|c| c["variant"] == "NVIDIA_H100")
        .cloned()
        .unwrap()
}

async fn act(s: &TestServer, server: &str, device: &str, action: &str) -> (u16, Value) {
    s.admin_call(
        "POST",
        &format!("/v1/servers/{server}/device-actions"),
        Some(json!({"device": device, "action": action, "reason": "checked by hand"})),
    )
    .await
}

async fn operator_actions(b: Backend) {
    let mut cfg = fast_config();
    cfg.scrub_grace = Duration::from_secs(3600);
    let mut s = TestServer::start(b, cfg).await;
    let node = s.add_node(2).await;
    s.h100_catalog(1).await;
    let c = capacity_of(&s).await;
    assert_eq!(
        (c["total"].as_u64(), c["free"].as_u64()),
        (Some(2), Some(2))
    );

    // Drain the server: no placements, and capacity says so; undrain: back.
    let (st, srv) = s
        .admin_call(
            "PATCH",
            &format!("/v1/servers/{}", node.uuid),
            Some(json!({"disabled": true})),
        )
        .await;
    assert_eq!((st, srv["disabled"].as_bool()), (200, Some(true)));
    let (st, e) = s
        .admin_call(
            "POST",
            "/v1/vms",
            Some(json!({"alias":"a","package":"gpu-1x"})),
        )
        .await;
    assert_eq!(
        (st, e["code"].as_str()),
        (409, Some("InsufficientCapacity"))
    );
    assert_eq!(capacity_of(&s).await["free"], 0);
    let (_, alerts) = s.admin_call("GET", "/v1/alerts", None).await;
    let a = &alerts[0];
    assert_eq!(
        (
            a["kind"].as_str(),
            a["variant"].as_str(),
            a["count"].as_u64()
        ),
        (Some("insufficient_capacity"), Some("NVIDIA_H100"), Some(1))
    );
    let (_, dry) = s
        .admin_call(
            "POST",
            "/v1/placement/dry-run",
            Some(json!({"package":"gpu-1x"})),
        )
        .await;
    assert!(dry["server"].is_null(), "{dry}");
    assert!(
        dry["servers"][0]["reasons"][0]
            .as_str()
            .unwrap()
            .contains("disabled")
    );
    s.admin_call(
        "PATCH",
        &format!("/v1/servers/{}", node.uuid),
        Some(json!({"disabled": false})),
    )
    .await;
    let (_, dry) = s
        .admin_call(
            "POST",
            "/v1/placement/dry-run",
            Some(json!({"package":"gpu-1x"})),
        )
        .await;
    assert_eq!(dry["server"], node.uuid.as_str());

    let devs = s.device_states(&node.uuid).await;
    let (d0, d1) = (devs[0].0.clone(), devs[1].0.clone());
    // Disable one device: placement skips it.
    let (st, h) = act(&s, &node.uuid, &d0, "disable").await;
    assert_eq!(st, 200, "{h}");
    assert!(
        h.as_array().unwrap().last().unwrap()["reason"]
            .as_str()
            .unwrap()
            .contains("checked by hand")
    );
    let (st, e) = act(&s, &node.uuid, &d0, "requeue").await;
    assert_eq!((st, e["code"].as_str()), (409, Some("InvalidState")), "{e}");
    let (st, vm) = s
        .admin_call(
            "POST",
            "/v1/vms",
            Some(json!({"alias":"b","package":"gpu-1x"})),
        )
        .await;
    assert_eq!(st, 202);
    assert_eq!(vm["assigned_devices"][0], d1.as_str());
    let (st, e) = act(&s, &node.uuid, &d1, "quarantine").await;
    assert_eq!(
        (st, e["code"].as_str()),
        (409, Some("InvalidState")),
        "a held device is refused"
    );
    // Enable, quarantine, then requeue after a check: scrubbed before it is free again.
    assert_eq!(act(&s, &node.uuid, &d0, "enable").await.0, 200);
    assert_eq!(act(&s, &node.uuid, &d0, "quarantine").await.0, 200);
    assert_eq!(capacity_of(&s).await["quarantined"], 1);
    assert_eq!(act(&s, &node.uuid, &d0, "requeue").await.0, 200);
    let back = wait_for(Duration::from_secs(30), || async {
        let st = s.device_states(&node.uuid).await;
        st.iter()
            .any(|(id, state, _)| *id == d0 && state == "unassigned")
            .then_some(())
    })
    .await;
    assert!(back.is_some(), "the requeued device was scrubbed and freed");
    let (_, ev) = s
        .admin_call(
            "GET",
            &format!("/v1/servers/{}/device-events?device={d0}", node.uuid),
            None,
        )
        .await;
    let path: Vec<&str> = ev
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["to"].as_str().unwrap())
        .collect();
    assert_eq!(
        path,
        [
            "disabled",
            "unassigned",
            "quarantined",
            "dirty",
            "cleaning",
            "unassigned"
        ]
    );

    // Tenants cannot act on devices; bad actions are 400.
    let (_, tenant) = s.tenant("t").await;
    let (st, _) = s
        .call(
            "POST",
            &format!("/v1/servers/{}/device-actions", node.uuid),
            Some(&tenant),
            Some(json!({"device": d0, "action": "disable", "reason": "x"})),
        )
        .await;
    assert_eq!(st, 403);
    let (st, e) = s
        .admin_call(
            "POST",
            &format!("/v1/servers/{}/device-actions", node.uuid),
            Some(json!({"device": d0, "action": "explode", "reason": "x"})),
        )
        .await;
    assert_eq!((st, e["field"].as_str()), (400, Some("action")), "{e}");
}
both!(operator_actions_on, operator_actions);

async fn usage_audit_metrics(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let node = s.add_node(2).await;
    s.h100_catalog(1).await;
    let (alice_uuid, alice) = s.tenant("alice").await;
    let (_, bob) = s.tenant("bob").await;
    let (st, vm) = s
        .call(
            "POST",
            "/v1/vms",
            Some(&alice),
            Some(json!({"alias":"u","package":"gpu-1x"})),
        )
        .await;
    assert_eq!(st, 202);
    s.wait_job(vm["job_uuid"].as_str().unwrap()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, d) = s
        .call(
            "DELETE",
            &format!("/v1/vms/{}", vm["uuid"].as_str().unwrap()),
            Some(&alice),
            None,
        )
        .await;
    s.wait_job(d["job_uuid"].as_str().unwrap()).await;

    let (st, u) = s.call("GET", "/v1/usage", Some(&alice), None).await;
    assert_eq!(st, 200, "{u}");
    let r = &u["records"][0];
    assert_eq!(r["vm_uuid"], vm["uuid"]);
    assert_eq!(r["variant"], "NVIDIA_H100");
    assert!(r["ended_at"].is_string());
    let hours = u["gpu_hours"].as_f64().unwrap();
    assert!(hours > 0.0 && hours < 0.01, "{hours}");
    assert_eq!(u["by_variant"]["NVIDIA_H100"].as_f64(), Some(hours));
    let (_, ub) = s.call("GET", "/v1/usage", Some(&bob), None).await;
    assert_eq!(ub["records"], json!([]));
    let (st, _) = s
        .call(
            "GET",
            &format!("/v1/usage?owner_uuid={alice_uuid}"),
            Some(&bob),
            None,
        )
        .await;
    assert_eq!(st, 404);
    let (st, all) = s
        .admin_call("GET", &format!("/v1/usage?owner_uuid={alice_uuid}"), None)
        .await;
    assert_eq!((st, all["records"].as_array().unwrap().len()), (200, 1));
    let (st, e) = s.admin_call("GET", "/v1/usage?from=yesterday", None).await;
    assert_eq!((st, e["field"].as_str()), (400, Some("from")));
    let (_, empty) = s
        .admin_call(
            "GET",
            "/v1/usage?from=2020-01-01T00:00:00Z&to=2020-02-01T00:00:00Z",
            None,
        )
        .await;
    assert_eq!(empty["gpu_hours"], 0.0);

    // Audit: who did what, with the result; readable by operators only.
    let _ = s
        .call(
            "POST",
            "/v1/auth/login",
            None,
            Some(json!({"login":"alice","password":"nope-nope"})),
        )
        .await;
    let (st, log) = s.admin_call("GET", "/v1/audit", None).await;
    assert_eq!(st, 200);
    let entries = log.as_array().unwrap();
    let find = |m: &str, p: &str, login: Option<&str>| {
        entries
            .iter()
            .find(|e| e["method"] == m && e["path"] == p && e["actor_login"].as_str() == login)
            .cloned()
    };
    assert_eq!(
        find("POST", "/v1/variants", Some("admin")).unwrap()["status"],
        201
    );
    assert_eq!(
        find("POST", "/v1/vms", Some("alice")).unwrap()["status"],
        202
    );
    assert!(
        entries
            .iter()
            .any(|e| e["method"] == "DELETE" && e["actor_login"] == "alice")
    );
    assert!(
        entries
            .iter()
            .any(|e| e["path"] == "/v1/auth/login" && e["status"] == 401 && e["actor"].is_null())
    );
    assert!(entries.iter().all(|e| e["method"] != "GET"));
    let (st, _) = s.call("GET", "/v1/audit", Some(&alice), None).await;
    assert_eq!(st, 403);

    // Metrics: fleet gauges, placements, step durations.
    let r = s.http.get(s.url("/metrics")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let text = s
        .http
        .get(s.url("/metrics"))
        .bearer_auth(&s.admin)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let settled = wait_for(Duration::from_secs(30), || async {
        let t = s
            .http
            .get(s.url("/metrics"))
            .bearer_auth(&s.admin)
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        t.contains("passage_devices{variant=\"NVIDIA_H100\",state=\"unassigned\"} 2")
            .then_some(t)
    })
    .await
    .unwrap_or(text);
    assert!(
        settled.contains("passage_devices{variant=\"NVIDIA_H100\",state=\"unassigned\"} 2"),
        "{settled}"
    );
    assert!(settled.contains("passage_placements_total{outcome=\"placed\"} 1"));
    assert!(settled.contains("passage_agents_heartbeating 1"));
    assert!(
        settled.contains("passage_job_step_seconds_count{job=\"provision\",step=\"launch\"} 1")
    );
    assert!(settled.contains("passage_placement_seconds_bucket{le=\"+Inf\"} 1"));
    let _ = node;
}
both!(usage_audit_metrics_on, usage_audit_metrics);

async fn placement_policies(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let a = s.add_node(2).await;
    let c = s.add_node(2).await;
    let plain = s.add_node(0).await;
    s.h100_catalog(1).await;
    let (st, _) = s
        .admin_call(
            "POST",
            "/v1/packages",
            Some(json!({"name":"spread-1x","vcpus":1,"memory_mib":1024,
            "devices":{"NVIDIA_H100":1},"placement":"spread"})),
        )
        .await;
    assert_eq!(st, 201);
    let (st, e) = s
        .admin_call(
            "POST",
            "/v1/packages",
            Some(json!({"name":"x","vcpus":1,"memory_mib":1024,"placement":"random"})),
        )
        .await;
    assert_eq!((st, e["field"].as_str()), (400, Some("placement")));
    let (st, p) = s
        .admin_call(
            "POST",
            "/v1/packages",
            Some(json!({"name":"cpu-only","vcpus":1,"memory_mib":1024})),
        )
        .await;
    assert_eq!((st, p["placement"].clone()), (201, Value::Null));

    let place = |alias: &'static str, pkg: &'static str| {
        let s = &s;
        async move {
            let (st, vm) = s
                .admin_call(
                    "POST",
                    "/v1/vms",
                    Some(json!({"alias": alias, "package": pkg})),
                )
                .await;
            assert_eq!(st, 202, "{vm}");
            vm["server_uuid"].as_str().unwrap().to_string()
        }
    };
    // Spread: two VMs on two servers (pack would have put both on one).
    let s1 = place("s1", "spread-1x").await;
    let s2 = place("s2", "spread-1x").await;
    assert_ne!(s1, s2);
    assert!([&a.uuid, &c.uuid].contains(&&s1) && [&a.uuid, &c.uuid].contains(&&s2));
    // No devices asked: the server without GPUs.
    assert_eq!(place("cpu", "cpu-only").await, plain.uuid);
}
both!(placement_policies_on, placement_policies);

/// The taint of the server's first device, once it has one.
async fn tainted(s: &TestServer, server: &str, cause: &str) -> String {
    wait_for(Duration::from_secs(30), || async {
        let srv = s.server(server).await;
        srv["assignable_devices"][0]["taint"]
            .as_str()
            .map(String::from)
    })
    .await
    .unwrap_or_else(|| panic!("{cause} did not taint the device"))
}

/// AER errors rising on a device taint it: out of placement, shown with the reason, until
/// an operator clears it after a check.
async fn health_taints(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let node = s.add_node(1).await;
    s.h100_catalog(1).await;
    let gpu = s.device_states(&node.uuid).await[0].0.clone();
    let aer = node
        .sysfs
        .join(gpu.trim_start_matches('/'))
        .join("aer_dev_fatal");
    let text = std::fs::read_to_string(&aer).unwrap();
    std::fs::write(&aer, text.replace("TOTAL_ERR_FATAL 0", "TOTAL_ERR_FATAL 3")).unwrap();
    let taint = tainted(&s, &node.uuid, "the rising AER counter").await;
    assert!(
        taint.contains("AER fatal errors rose from 0 to 3"),
        "{taint}"
    );
    let srv = s.server(&node.uuid).await;
    let reported = srv["sysinfo"]["PCI Devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["id"] == gpu.as_str())
        .cloned()
        .unwrap();
    assert_eq!(
        reported["details"]["aer_fatal"], 3,
        "details reach the server object"
    );
    assert_eq!(capacity_of(&s).await["tainted"], 1);
    let (st, e) = s
        .admin_call(
            "POST",
            "/v1/vms",
            Some(json!({"alias":"x","package":"gpu-1x"})),
        )
        .await;
    assert_eq!(
        (st, e["code"].as_str()),
        (409, Some("InsufficientCapacity"))
    );
    // Cleared after a check: placeable again; the counter no longer rises, so it stays clear.
    assert_eq!(act(&s, &node.uuid, &gpu, "clear_taint").await.0, 200);
    assert_eq!(
        act(&s, &node.uuid, &gpu, "clear_taint").await.0,
        409,
        "nothing left to clear"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(s.server(&node.uuid).await["assignable_devices"][0]["taint"].is_null());
    let (st, vm) = s
        .admin_call(
            "POST",
            "/v1/vms",
            Some(json!({"alias":"y","package":"gpu-1x"})),
        )
        .await;
    assert_eq!(st, 202);
    let job = s.wait_job(vm["job_uuid"].as_str().unwrap()).await;
    assert_eq!(job["state"], "succeeded", "{job}");
    assert!(s.server(&node.uuid).await["assignable_devices"][0]["taint"].is_null());

    // Someone on the host takes the device of a running VM back from vfio-pci: tainted.
    let link = node.sysfs.join(gpu.trim_start_matches('/')).join("driver");
    let target = std::fs::read_link(&link).unwrap();
    assert_eq!(target.file_name().unwrap(), "vfio-pci");
    std::fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink(target.with_file_name("nvidia"), &link).unwrap();
    let taint = tainted(&s, &node.uuid, "the driver change").await;
    assert!(
        taint.contains("bound to nvidia while attached to a VM"),
        "{taint}"
    );
}
both!(health_taints_on, health_taints);
