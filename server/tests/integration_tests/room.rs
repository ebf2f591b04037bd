//! vCPUs and memory as a placement filter: what nodes report, what VMs hold, and the
//! check that keeps concurrent creations within a node, on SQLite and Postgres.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config};
use passage_server::store::room::Allocation;
use serde_json::{Value, json};
use std::time::Duration;

fn resources(server: &Value) -> (i64, i64, i64, i64) {
    let r = &server["resources"];
    let n = |k: &str| r[k].as_i64().unwrap_or(-1);
    (
        n("vcpus_total"),
        n("vcpus_used"),
        n("memory_total_mib"),
        n("memory_used_mib"),
    )
}

async fn create(s: &TestServer, alias: &str) -> (u16, Value) {
    s.admin_call(
        "POST",
        "/v1/vms",
        Some(json!({"alias": alias, "package": "gpu-1x"})),
    )
    .await
}

async fn cpus_and_memory_bound_placement(b: Backend) {
    let mut cfg = fast_config();
    // Jobs wait on a node that never answers: the VMs stay provisioning, holding room.
    cfg.task_timeout = Duration::from_secs(600);
    cfg.alloc = Allocation {
        cpu_ratio: 1.0,
        reserved_memory_mib: 1024,
    };
    let mut s = TestServer::start(b, cfg).await;
    s.h100_catalog(1).await; // 4 vCPUs, 4096 MiB, one H100

    // Reported: 8 CPUs and 9 GiB, of which 1 GiB stays with the host. Four free GPUs,
    // room for two VMs.
    let host = json!({"cpus": 8, "memory_mib": 9216});
    let (small, _, _) = s.manual_node_with(4, Some(host)).await;
    assert_eq!(resources(&s.server(&small).await), (8, 0, 8192, 0));

    // Sixty-four creations race for that room: exactly two win.
    let (_, tenant) = s.tenant("racer").await;
    let mut calls = Vec::new();
    for i in 0..64 {
        let http = s.http.clone();
        let url = s.url("/v1/vms");
        let tenant = tenant.clone();
        calls.push(tokio::spawn(async move {
            let r = http
                .post(url)
                .bearer_auth(tenant)
                .json(&json!({"alias": format!("r{i}"), "package": "gpu-1x"}))
                .send()
                .await
                .unwrap();
            let st = r.status().as_u16();
            (st, r.json::<Value>().await.unwrap())
        }));
    }
    let mut results = Vec::new();
    for c in calls {
        results.push(c.await.unwrap());
    }
    let won = results.iter().filter(|(st, _)| *st == 202).count();
    for (st, e) in results.iter().filter(|(st, _)| *st != 202) {
        assert_eq!(
            (*st, e["code"].as_str()),
            (409, Some("InsufficientCapacity")),
            "{e}"
        );
    }
    assert_eq!(won, 2, "{results:?}");
    let srv = s.server(&small).await;
    assert_eq!(resources(&srv), (8, 8, 8192, 8192));
    let free = srv["assignable_devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["state"] == "unassigned")
        .count();
    assert_eq!(free, 2, "GPUs are left, but no vCPUs: {srv}");

    // The dry run says why.
    let (_, dry) = s
        .admin_call(
            "POST",
            "/v1/placement/dry-run",
            Some(json!({"package": "gpu-1x"})),
        )
        .await;
    assert!(dry["server"].is_null(), "{dry}");
    let why = dry["servers"][0]["reasons"].to_string();
    assert!(why.contains("has 0 vCPUs free, needs 4"), "{why}");
    assert!(
        why.contains("has 0 MiB of memory free, needs 4096"),
        "{why}"
    );

    // An operator naming a free device there is refused for the same reason.
    let free_dev = srv["assignable_devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["state"] == "unassigned")
        .unwrap()["id"]
        .clone();
    let (st, e) = s
        .admin_call(
            "POST",
            "/v1/vms",
            Some(json!({"alias": "pinned", "server_uuid": small,
                        "assigned_devices": [free_dev], "vcpus": 1, "memory_mib": 128})),
        )
        .await;
    assert_eq!(
        (st, e["code"].as_str()),
        (409, Some("InsufficientCapacity")),
        "{e}"
    );
    assert!(e["message"].as_str().unwrap().contains("vCPUs"), "{e}");

    // Operators naming devices skip placement's own look at the room: the check in the
    // reservation alone decides. Eight distinct free GPUs, room for four VMs of 2 vCPUs.
    let host = json!({"cpus": 8, "memory_mib": 9216});
    let (pinned, _, _) = s.manual_node_with(8, Some(host)).await;
    let ids: Vec<Value> = s.server(&pinned).await["assignable_devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].clone())
        .collect();
    assert_eq!(ids.len(), 8);
    let mut calls = Vec::new();
    for (i, id) in ids.into_iter().enumerate() {
        let http = s.http.clone();
        let url = s.url("/v1/vms");
        let admin = s.admin.clone();
        let body = json!({"alias": format!("p{i}"), "server_uuid": pinned,
                          "assigned_devices": [id], "vcpus": 2, "memory_mib": 1024});
        calls.push(tokio::spawn(async move {
            let r = http
                .post(url)
                .bearer_auth(admin)
                .json(&body)
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        }));
    }
    let mut won = 0;
    for c in calls {
        match c.await.unwrap() {
            202 => won += 1,
            409 => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(won, 4);
    assert_eq!(resources(&s.server(&pinned).await), (8, 8, 8192, 4096));

    // A node that never reported its CPUs is not held to them.
    let (other, _, _) = s.manual_node(1).await;
    assert!(s.server(&other).await["resources"].is_null());
    let (st, vm) = create(&s, "elsewhere").await;
    assert_eq!(st, 202, "{vm}");
    assert_eq!(vm["server_uuid"], other.as_str());

    // A report out of range is refused and changes nothing.
    let (_, cred, devices) = s
        .manual_node_with(1, Some(json!({"cpus": 2, "memory_mib": 4096})))
        .await;
    for bad in [
        json!({"cpus": 0, "memory_mib": 1}),
        json!({"cpus": 1, "memory_mib": 0}),
        json!({"cpus": 70000, "memory_mib": 1}),
        json!({"cpus": 1}),
        json!({"cpus": 1, "memory_mib": 1, "gpus": 2}),
    ] {
        let (st, e) = s
            .call(
                "PUT",
                "/agent/v1/inventory",
                Some(&cred),
                Some(json!({"devices": devices, "host": bad})),
            )
            .await;
        assert_eq!(st, 400, "{bad} → {e}");
    }

    // The real agent reports what its tree says: 64 CPUs, 512 GiB over two NUMA nodes.
    let node = s.add_node(1).await;
    assert_eq!(
        resources(&s.server(&node.uuid).await),
        (64, 0, 512 * 1024 - 1024, 0)
    );
}
both!(
    cpus_and_memory_bound_placement,
    cpus_and_memory_bound_placement
);
