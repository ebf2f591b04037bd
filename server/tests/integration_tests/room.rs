//! vCPUs and memory as a placement filter: what nodes report, what VMs hold, and the
//! check that keeps concurrent creations within a node, on SQLite and Postgres.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config};
use passage_model::api::{PlacementExplanation, Server, Vm};
use passage_model::{DeviceState, ErrorCode};
use passage_server::store::room::Allocation;
use serde_json::json;
use std::time::Duration;

fn resources(server: &Server) -> (i64, i64, i64, i64) {
    let r = server.resources.expect("the node reported its resources");
    (
        r.vcpus_total,
        r.vcpus_used,
        r.memory_total_mib,
        r.memory_used_mib,
    )
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
    assert_eq!(resources(&s.server(small).await), (8, 0, 8192, 0));

    // Sixty-four creations race for that room: exactly two win.
    let (_, tenant) = s.tenant("racer").await;
    let calls: Vec<_> = (0..64)
        .map(|i| {
            let c = s.with(&tenant);
            let body =
                json!({"image": "test-image", "alias": format!("r{i}"), "package": "gpu-1x"});
            tokio::spawn(async move { c.post::<Vm>("/v1/vms", &body).await })
        })
        .collect();
    let mut results = Vec::new();
    for c in calls {
        results.push(c.await.unwrap());
    }
    let won = results.iter().filter(|r| r.status == 202).count();
    assert_eq!(won, 2, "{results:?}");
    for r in results.into_iter().filter(|r| r.status != 202) {
        r.fails(409, ErrorCode::InsufficientCapacity);
    }
    let srv = s.server(small).await;
    assert_eq!(resources(&srv), (8, 8, 8192, 8192));
    let devices = srv.assignable_devices.clone().unwrap();
    let free = devices
        .iter()
        .filter(|d| d.state == DeviceState::Unassigned)
        .count();
    assert_eq!(free, 2, "GPUs are left, but no vCPUs: {srv:?}");

    // The dry run says why.
    let dry: PlacementExplanation = s
        .post("/v1/placement/dry-run", &json!({"package": "gpu-1x"}))
        .await
        .ok(200);
    assert!(dry.server.is_none(), "{dry:?}");
    let why = dry.servers[0].reasons.join("; ");
    assert!(why.contains("has 0 vCPUs free, needs 4"), "{why}");
    assert!(
        why.contains("has 0 MiB of memory free, needs 4096"),
        "{why}"
    );

    // An operator naming a free device there is refused for the same reason.
    let free_dev = devices
        .iter()
        .find(|x| x.state == DeviceState::Unassigned)
        .unwrap()
        .id
        .clone();
    let e = s
        .post::<Vm>(
            "/v1/vms",
            &json!({"image": "test-image", "alias": "pinned", "server_uuid": small,
                    "assigned_devices": [free_dev], "vcpus": 1, "memory_mib": 128}),
        )
        .await
        .fails(409, ErrorCode::InsufficientCapacity);
    assert!(e.message.contains("vCPUs"), "{e:?}");

    // Operators naming devices skip placement's own look at the room: the check in the
    // reservation alone decides. Eight distinct free GPUs, room for four VMs of 2 vCPUs.
    let host = json!({"cpus": 8, "memory_mib": 9216});
    let (pinned, _, _) = s.manual_node_with(8, Some(host)).await;
    let ids: Vec<_> = s
        .server(pinned)
        .await
        .assignable_devices
        .unwrap()
        .into_iter()
        .map(|d| d.id)
        .collect();
    assert_eq!(ids.len(), 8);
    let calls: Vec<_> = ids
        .into_iter()
        .enumerate()
        .map(|(i, id)| {
            let c = s.as_admin();
            let body = json!({"image": "test-image", "alias": format!("p{i}"), "server_uuid": pinned,
                              "assigned_devices": [id], "vcpus": 2, "memory_mib": 1024});
            tokio::spawn(async move { c.post::<Vm>("/v1/vms", &body).await })
        })
        .collect();
    let mut won = 0;
    for c in calls {
        let r = c.await.unwrap();
        match r.status {
            202 => won += 1,
            _ => {
                r.err(409);
            }
        }
    }
    assert_eq!(won, 4);
    assert_eq!(resources(&s.server(pinned).await), (8, 8, 8192, 4096));

    // A node that never reported its CPUs is not held to them.
    let (other, _, _) = s.manual_node(1).await;
    assert!(s.server(other).await.resources.is_none());
    let vm: Vm = s
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias": "elsewhere", "package": "gpu-1x"}),
        )
        .await
        .ok(202);
    assert_eq!(vm.server_uuid, Some(other));

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
        s.with(&cred)
            .put::<()>(
                "/agent/v1/inventory",
                &json!({"devices": devices, "host": bad}),
            )
            .await
            .fails(400, ErrorCode::InvalidArgument);
    }

    // The real agent reports what its tree says: 64 CPUs, 512 GiB over two NUMA nodes.
    let node = s.add_node(1).await;
    assert_eq!(
        resources(&s.server(node.uuid).await),
        (64, 0, 512 * 1024 - 1024, 0)
    );
}
both!(
    cpus_and_memory_bound_placement,
    cpus_and_memory_bound_placement
);

/// What a node reports of the machine beyond its totals (address width, NUMA nodes and
/// their huge pages) and of each function (regions, reset methods) shows in
/// `GET /v1/servers/{uuid}`; an agent that reports none of it keeps what was said.
async fn host_facts_show_in_the_api(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let facts = json!({
        "address_bits": 52,
        "numa": [
            {"node": 0, "cpus": "0-7", "memory_mib": 4096,
             "hugepages": [{"size_kib": 2048, "total": 64, "free": 60}]},
            {"node": 1, "cpus": "", "memory_mib": 4096}
        ]
    });
    let mut host = json!({"cpus": 8, "memory_mib": 8192});
    for (k, v) in facts.as_object().unwrap() {
        host[k] = v.clone();
    }
    let (uuid, cred, devices) = s.manual_node_with(1, Some(host)).await;
    let srv = s.server(uuid).await;
    assert_eq!(
        serde_json::to_value(srv.host.as_ref().unwrap()).unwrap(),
        facts
    );
    let raw: serde_json::Value = s.get(&format!("/v1/servers/{uuid}")).await.ok(200);
    assert_eq!(raw["host"]["numa"][0]["hugepages"][0]["free"], 60);

    // An older agent's report (totals only) keeps the facts.
    s.with(&cred)
        .put::<()>(
            "/agent/v1/inventory",
            &json!({"devices": devices, "host": {"cpus": 8, "memory_mib": 8192}}),
        )
        .await
        .ok(204);
    assert_eq!(
        serde_json::to_value(s.server(uuid).await.host.unwrap()).unwrap(),
        facts
    );

    // Facts out of bounds are refused like the totals.
    for bad in [
        json!({"cpus": 8, "memory_mib": 8192, "address_bits": 80}),
        json!({"cpus": 8, "memory_mib": 8192,
               "numa": [{"node": 0, "cpus": "0-", "memory_mib": 1}]}),
        json!({"cpus": 8, "memory_mib": 8192,
               "numa": [{"node": 0, "cpus": "0", "memory_mib": 1,
                         "hugepages": [{"size_kib": 2048, "total": 1, "free": 2}]}]}),
    ] {
        s.with(&cred)
            .put::<()>(
                "/agent/v1/inventory",
                &json!({"devices": devices, "host": bad}),
            )
            .await
            .fails(400, ErrorCode::InvalidArgument);
    }

    // The real agent reads its generated tree: 46 address bits, two nodes of 32 CPUs,
    // and each GPU's regions and resets.
    let node = s.add_node(2).await;
    let srv = s.server(node.uuid).await;
    let host = srv.host.clone().expect("the agent reported its host facts");
    assert_eq!(host.address_bits, Some(46));
    let cpus: Vec<&str> = host.numa.iter().map(|n| n.cpus.as_str()).collect();
    assert_eq!(cpus, ["0-31", "32-63"]);
    assert!(host.numa.iter().all(|n| n.hugepages.len() == 2));
    let gpus: Vec<_> = srv
        .sysinfo
        .unwrap()
        .pci_devices
        .into_iter()
        .filter(|d| d.device.to_string() == "2330")
        .collect();
    assert_eq!(gpus.len(), 2);
    for g in gpus {
        let d = g.details.unwrap();
        let sizes: Vec<u64> = d.bars.iter().map(|b| b.size).collect();
        assert_eq!(sizes, [16 << 20, 128 << 30, 32 << 20]);
        assert_eq!(d.reset_methods, ["flr", "bus"]);
    }
}
both!(host_facts_show_in_the_api, host_facts_show_in_the_api);

/// A node whose two NUMA nodes each have 8 CPUs (one kept for the host) and 16 GiB, and
/// 46 address bits; `gpus` H100s, half on each node.
fn two_node_host(gpus_cpus: u32, address_bits: u8) -> serde_json::Value {
    json!({"cpus": gpus_cpus, "memory_mib": 32768, "address_bits": address_bits,
           "reserved_cpus": "0,8",
           "numa": [{"node": 0, "cpus": "0-7", "memory_mib": 16384},
                    {"node": 1, "cpus": "8-15", "memory_mib": 16384}]})
}

async fn numa_nodes_and_address_width_bound_placement(b: Backend) {
    let mut cfg = fast_config();
    cfg.task_timeout = Duration::from_secs(600);
    cfg.alloc = Allocation {
        cpu_ratio: 1.0,
        reserved_memory_mib: 0,
    };
    let s = TestServer::start(b, cfg).await;
    s.h100_catalog(1).await;
    let _: passage_model::api::Package = s
        .post(
            "/v1/packages",
            &json!({"name": "numa-3", "vcpus": 3, "memory_mib": 2048, "disk_gib": 10,
                    "devices": {"NVIDIA_H100": 1}}),
        )
        .await
        .ok(201);
    let _: passage_model::api::Package = s
        .post(
            "/v1/packages",
            &json!({"name": "wide-2", "vcpus": 1, "memory_mib": 4096, "disk_gib": 10,
                    "devices": {"NVIDIA_H100": 2}}),
        )
        .await
        .ok(201);

    // A node of 40-bit CPUs: one H100's 128 GiB BAR1 fits its guest, two do not (their
    // window of 513 GiB sits at 512 GiB and ends past 2^40).
    let (narrow, _, _) = s.manual_node_with(4, Some(two_node_host(64, 40))).await;
    let e = s
        .post::<Vm>(
            "/v1/vms",
            &json!({"image": "test-image", "alias": "wide", "package": "wide-2"}),
        )
        .await
        .fails(409, ErrorCode::InsufficientCapacity);
    assert!(e.message.contains("need 41-bit guest addresses"), "{e:?}");
    let dry: PlacementExplanation = s
        .post("/v1/placement/dry-run", &json!({"package": "wide-2"}))
        .await
        .ok(200);
    assert!(dry.server.is_none(), "{dry:?}");
    let why = dry.servers[0].reasons.join("; ");
    assert!(
        why.contains(
            "513 GiB of device BARs need 41-bit guest addresses; this host's CPUs have 40"
        ),
        "{why}"
    );
    let one: Vm = s
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias": "one", "package": "gpu-1x"}),
        )
        .await
        .ok(202);
    assert_eq!(one.server_uuid, Some(narrow));
    let _: Server = s
        .patch(&format!("/v1/servers/{narrow}"), &json!({"disabled": true}))
        .await
        .ok(200);

    // Eight GPUs, four per NUMA node, and 7 CPUs per node for pinning: 64 creations of
    // 3 vCPUs race, and two fit on each node, though the node has 64 CPUs and GPUs left.
    let (numa, _, _) = s.manual_node_with(8, Some(two_node_host(64, 46))).await;
    let (_, tenant) = s.tenant("racer").await;
    let calls: Vec<_> = (0..64)
        .map(|i| {
            let c = s.with(&tenant);
            let body =
                json!({"image": "test-image", "alias": format!("n{i}"), "package": "numa-3"});
            tokio::spawn(async move { c.post::<Vm>("/v1/vms", &body).await })
        })
        .collect();
    let mut won = Vec::new();
    for c in calls {
        let r = c.await.unwrap();
        if r.status == 202 {
            won.push(r.ok(202));
        } else {
            let e = r.fails(409, ErrorCode::InsufficientCapacity);
            assert!(e.message.contains("CPUs free for pinning"), "{e:?}");
        }
    }
    assert_eq!(won.len(), 4, "{won:?}");
    // Two on each node: the devices' NUMA nodes say so.
    let srv = s.server(numa).await;
    let devices = srv.assignable_devices.clone().unwrap();
    let node_of = |id: &passage_model::DevicePath| {
        srv.sysinfo
            .as_ref()
            .unwrap()
            .pci_devices
            .iter()
            .find(|d| &d.id == id)
            .and_then(|d| d.numa_node)
    };
    let mut per_node = [0, 0];
    for vm in &won {
        assert_eq!(vm.server_uuid, Some(numa));
        let n = node_of(&vm.assigned_devices[0]).unwrap();
        per_node[n as usize] += 1;
    }
    assert_eq!(per_node, [2, 2]);
    let free = devices
        .iter()
        .filter(|d| d.state == DeviceState::Unassigned)
        .count();
    assert_eq!(free, 4, "GPUs are left, but no cores beside them");
    let dry: PlacementExplanation = s
        .post("/v1/placement/dry-run", &json!({"package": "numa-3"}))
        .await
        .ok(200);
    assert!(dry.server.is_none(), "{dry:?}");
    let verdict = dry.servers.iter().find(|v| v.uuid == numa).unwrap();
    let why = verdict.reasons.join("; ");
    assert!(
        why.contains("NUMA node 0 of its devices has 1 CPUs free for pinning, needs 3"),
        "{why}"
    );
    // One vCPU still fits beside each pair.
    let _: passage_model::api::Package = s
        .post(
            "/v1/packages",
            &json!({"name": "numa-1", "vcpus": 1, "memory_mib": 1024, "disk_gib": 10,
                    "devices": {"NVIDIA_H100": 1}}),
        )
        .await
        .ok(201);
    let small: Vm = s
        .with(&tenant)
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias": "small", "package": "numa-1"}),
        )
        .await
        .ok(202);
    assert_eq!(small.server_uuid, Some(numa));
}
both!(
    numa_nodes_and_address_width_bound_placement,
    numa_nodes_and_address_width_bound_placement
);
