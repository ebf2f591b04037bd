//! Operator actions, capacity, alerts, usage, audit, metrics and placement dry runs, on
//! SQLite and Postgres, with the real agent loop over fake trees.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, Reply, TestServer, fast_config, wait_for};
use passage_model::api::{
    Alert, AuditEntry, Capacity, DeviceEventRecord, JobState, LoginResponse, Package,
    PlacementExplanation, Server, Usage, Vm,
};
use passage_model::{DevicePath, DeviceState, ErrorCode, ServerId};
use serde_json::json;
use std::time::Duration;

async fn capacity_of(s: &TestServer) -> Capacity {
    let c: Vec<Capacity> = s.get("/v1/capacity").await.ok(200);
    c.into_iter().find(|c| c.variant == "NVIDIA_H100").unwrap()
}

async fn act(
    s: &TestServer,
    server: ServerId,
    device: &DevicePath,
    action: &str,
) -> Reply<Vec<DeviceEventRecord>> {
    s.post(
        &format!("/v1/servers/{server}/device-actions"),
        &json!({"device": device, "action": action, "reason": "checked by hand"}),
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
    assert_eq!((c.total, c.free), (2, 2));

    // Drain the server: no placements, and capacity says so; undrain: back.
    let srv: Server = s
        .patch(
            &format!("/v1/servers/{}", node.uuid),
            &json!({"disabled": true}),
        )
        .await
        .ok(200);
    assert!(srv.disabled);
    s.post::<Vm>(
        "/v1/vms",
        &json!({"image": "test-image", "alias":"a","package":"gpu-1x"}),
    )
    .await
    .fails(409, ErrorCode::InsufficientCapacity);
    let c = capacity_of(&s).await;
    // Still there and clean, but not free: placement would not take them.
    assert_eq!((c.total, c.unassigned, c.free), (2, 2, 0), "{c:?}");
    let alerts: Vec<Alert> = s.get("/v1/alerts").await.ok(200);
    let a = &alerts[0];
    assert_eq!(
        (a.kind.as_str(), a.variant.as_deref(), a.count),
        ("insufficient_capacity", Some("NVIDIA_H100"), Some(1))
    );
    let dry: PlacementExplanation = s
        .post("/v1/placement/dry-run", &json!({"package":"gpu-1x"}))
        .await
        .ok(200);
    assert!(dry.server.is_none(), "{dry:?}");
    assert!(dry.servers[0].reasons[0].contains("disabled"));
    s.patch::<Server>(
        &format!("/v1/servers/{}", node.uuid),
        &json!({"disabled": false}),
    )
    .await
    .ok(200);
    let dry: PlacementExplanation = s
        .post("/v1/placement/dry-run", &json!({"package":"gpu-1x"}))
        .await
        .ok(200);
    assert_eq!(dry.server, Some(node.uuid));

    let devs = s.device_states(node.uuid).await;
    let (d0, d1) = (devs[0].0.clone(), devs[1].0.clone());
    // Disable one device: placement skips it.
    let h = act(&s, node.uuid, &d0, "disable").await.ok(200);
    assert!(h.last().unwrap().reason.contains("checked by hand"));
    act(&s, node.uuid, &d0, "requeue")
        .await
        .fails(409, ErrorCode::InvalidState);
    let vm: Vm = s
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"b","package":"gpu-1x"}),
        )
        .await
        .ok(202);
    assert_eq!(vm.assigned_devices[0], d1);
    // A held device is refused.
    act(&s, node.uuid, &d1, "quarantine")
        .await
        .fails(409, ErrorCode::InvalidState);
    // Enable, quarantine, then requeue after a check: scrubbed before it is free again.
    act(&s, node.uuid, &d0, "enable").await.ok(200);
    act(&s, node.uuid, &d0, "quarantine").await.ok(200);
    assert_eq!(capacity_of(&s).await.quarantined, 1);
    act(&s, node.uuid, &d0, "requeue").await.ok(200);
    let back = wait_for(Duration::from_secs(30), || async {
        let st = s.device_states(node.uuid).await;
        st.iter()
            .any(|(id, state, _)| *id == d0 && *state == DeviceState::Unassigned)
            .then_some(())
    })
    .await;
    assert!(back.is_some(), "the requeued device was scrubbed and freed");
    let ev: Vec<DeviceEventRecord> = s
        .get(&format!(
            "/v1/servers/{}/device-events?device={d0}",
            node.uuid
        ))
        .await
        .ok(200);
    let path: Vec<DeviceState> = ev.iter().map(|e| e.to).collect();
    use DeviceState::*;
    assert_eq!(
        path,
        [
            Disabled,
            Unassigned,
            Quarantined,
            Dirty,
            Cleaning,
            Unassigned
        ]
    );

    // Tenants cannot act on devices; bad actions are 400.
    let (_, tenant) = s.tenant("t").await;
    s.with(&tenant)
        .post::<Vec<DeviceEventRecord>>(
            &format!("/v1/servers/{}/device-actions", node.uuid),
            &json!({"device": d0, "action": "disable", "reason": "x"}),
        )
        .await
        .err(403);
    s.post::<Vec<DeviceEventRecord>>(
        &format!("/v1/servers/{}/device-actions", node.uuid),
        &json!({"device": d0, "action": "explode", "reason": "x"}),
    )
    .await
    .invalid("action");
}
both!(operator_actions_on, operator_actions);

async fn usage_audit_metrics(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let node = s.add_node(2).await;
    s.h100_catalog(1).await;
    let (alice_uuid, alice) = s.tenant("alice").await;
    let (_, bob) = s.tenant("bob").await;
    let vm: Vm = s
        .with(&alice)
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"u","package":"gpu-1x"}),
        )
        .await
        .ok(202);
    s.wait_job(vm.job_uuid.unwrap()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let d: Vm = s
        .with(&alice)
        .delete(&format!("/v1/vms/{}", vm.uuid))
        .await
        .ok(202);
    s.wait_job(d.job_uuid.unwrap()).await;

    let u: Usage = s.with(&alice).get("/v1/usage").await.ok(200);
    let r = &u.records[0];
    assert_eq!(r.vm_uuid, vm.uuid);
    assert_eq!(r.variant.as_deref(), Some("NVIDIA_H100"));
    assert!(r.ended_at.is_some());
    let hours = u.gpu_hours;
    assert!(hours > 0.0 && hours < 0.01, "{hours}");
    assert_eq!(u.by_variant.get("NVIDIA_H100"), Some(&hours));
    let ub: Usage = s.with(&bob).get("/v1/usage").await.ok(200);
    assert!(ub.records.is_empty());
    s.with(&bob)
        .get::<Usage>(&format!("/v1/usage?owner_uuid={alice_uuid}"))
        .await
        .err(404);
    let all: Usage = s
        .get(&format!("/v1/usage?owner_uuid={alice_uuid}"))
        .await
        .ok(200);
    assert_eq!(all.records.len(), 1);
    s.get::<Usage>("/v1/usage?from=yesterday")
        .await
        .invalid("from");
    let empty: Usage = s
        .get("/v1/usage?from=2020-01-01T00:00:00Z&to=2020-02-01T00:00:00Z")
        .await
        .ok(200);
    assert_eq!(empty.gpu_hours, 0.0);

    // Audit: who did what, with the result; readable by operators only.
    s.client(None)
        .post::<LoginResponse>(
            "/v1/auth/login",
            &json!({"login":"alice","password":"nope-nope"}),
        )
        .await
        .err(401);
    let entries: Vec<AuditEntry> = s.get("/v1/audit").await.ok(200);
    let find = |m: &str, p: &str, login: Option<&str>| {
        entries
            .iter()
            .find(|e| e.method == m && e.path == p && e.actor_login.as_deref() == login)
            .cloned()
    };
    assert_eq!(
        find("POST", "/v1/variants", Some("admin")).unwrap().status,
        201
    );
    assert_eq!(find("POST", "/v1/vms", Some("alice")).unwrap().status, 202);
    assert!(
        entries
            .iter()
            .any(|e| e.method == "DELETE" && e.actor_login.as_deref() == Some("alice"))
    );
    assert!(
        entries
            .iter()
            .any(|e| e.path == "/v1/auth/login" && e.status == 401 && e.actor.is_none())
    );
    assert!(entries.iter().all(|e| e.method != "GET"));
    s.with(&alice)
        .get::<Vec<AuditEntry>>("/v1/audit")
        .await
        .err(403);

    // Metrics: fleet gauges, placements, step durations (Prometheus text, read raw).
    let r = s.http.get(s.url("/metrics")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let text = s.metrics().await;
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
    s.post::<Package>(
        "/v1/packages",
        &json!({"name":"spread-1x","vcpus":1,"memory_mib":1024,
                "devices":{"NVIDIA_H100":1},"placement":"spread"}),
    )
    .await
    .ok(201);
    s.post::<Package>(
        "/v1/packages",
        &json!({"name":"x","vcpus":1,"memory_mib":1024,"placement":"random"}),
    )
    .await
    .invalid("placement");
    let p: Package = s
        .post(
            "/v1/packages",
            &json!({"name":"cpu-only","vcpus":1,"memory_mib":1024}),
        )
        .await
        .ok(201);
    assert_eq!(p.placement, None);

    let place = |alias: &'static str, pkg: &'static str| {
        let c = s.as_admin();
        async move {
            let vm: Vm = c
                .post(
                    "/v1/vms",
                    &json!({"image": "test-image", "alias": alias, "package": pkg}),
                )
                .await
                .ok(202);
            vm.server_uuid.unwrap()
        }
    };
    // Spread: two VMs on two servers (pack would have put both on one).
    let s1 = place("s1", "spread-1x").await;
    let s2 = place("s2", "spread-1x").await;
    assert_ne!(s1, s2);
    assert!([a.uuid, c.uuid].contains(&s1) && [a.uuid, c.uuid].contains(&s2));
    // No devices asked: the server without GPUs.
    assert_eq!(place("cpu", "cpu-only").await, plain.uuid);
}
both!(placement_policies_on, placement_policies);

/// The taint of the server's first device, once it has one.
async fn tainted(s: &TestServer, server: ServerId, cause: &str) -> String {
    wait_for(Duration::from_secs(30), || async {
        first_device_taint(s, server).await
    })
    .await
    .unwrap_or_else(|| panic!("{cause} did not taint the device"))
}

async fn first_device_taint(s: &TestServer, server: ServerId) -> Option<String> {
    s.server(server).await.assignable_devices.unwrap()[0]
        .taint
        .clone()
}

/// AER errors rising on a device taint it: out of placement, shown with the reason, until
/// an operator clears it after a check.
async fn health_taints(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let node = s.add_node(1).await;
    s.h100_catalog(1).await;
    let gpu = s.device_states(node.uuid).await[0].0.clone();
    let dir = node.sysfs.join(gpu.to_string().trim_start_matches('/'));
    let aer = dir.join("aer_dev_fatal");
    let text = std::fs::read_to_string(&aer).unwrap();
    std::fs::write(&aer, text.replace("TOTAL_ERR_FATAL 0", "TOTAL_ERR_FATAL 3")).unwrap();
    let taint = tainted(&s, node.uuid, "the rising AER counter").await;
    assert!(
        taint.contains("AER fatal errors rose from 0 to 3"),
        "{taint}"
    );
    let reported = s
        .server(node.uuid)
        .await
        .sysinfo
        .unwrap()
        .pci_devices
        .into_iter()
        .find(|d| d.id == gpu)
        .unwrap();
    assert_eq!(
        reported.details.unwrap().aer_fatal,
        Some(3),
        "details reach the server object"
    );
    assert_eq!(capacity_of(&s).await.tainted, 1);
    s.post::<Vm>(
        "/v1/vms",
        &json!({"image": "test-image", "alias":"x","package":"gpu-1x"}),
    )
    .await
    .fails(409, ErrorCode::InsufficientCapacity);
    // Cleared after a check: placeable again; the counter no longer rises, so it stays clear.
    act(&s, node.uuid, &gpu, "clear_taint").await.ok(200);
    assert_eq!(
        act(&s, node.uuid, &gpu, "clear_taint").await.status,
        409,
        "nothing left to clear"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(first_device_taint(&s, node.uuid).await.is_none());
    let vm: Vm = s
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"y","package":"gpu-1x"}),
        )
        .await
        .ok(202);
    let job = s.wait_job(vm.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    assert!(first_device_taint(&s, node.uuid).await.is_none());

    // Someone on the host takes the device of a running VM back from vfio-pci: tainted.
    let link = dir.join("driver");
    let target = std::fs::read_link(&link).unwrap();
    assert_eq!(target.file_name().unwrap(), "vfio-pci");
    std::fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink(target.with_file_name("nvidia"), &link).unwrap();
    let taint = tainted(&s, node.uuid, "the driver change").await;
    assert!(
        taint.contains("bound to nvidia while attached to a VM"),
        "{taint}"
    );
}
both!(health_taints_on, health_taints);
