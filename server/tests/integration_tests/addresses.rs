//! Addresses on networks: a new VM gets one on each network it names (or each default
//! network), reserved in the same transaction as its devices; destroy gives them back
//! once the VM is gone from its node; the last free address goes to one of many racers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::*;
use passage_model::ErrorCode;
use passage_model::api::{JobState, Vm};
use passage_model::networks::{Network, NetworkIp};
use serde_json::{Value, json};
use std::net::Ipv4Addr;

fn ip(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}

async fn create(c: &Client, body: Value) -> Reply<Vm> {
    c.post::<Vm>("/v1/vms", &body).await
}

async fn ips(s: &TestServer, net: &Network) -> Vec<NetworkIp> {
    s.get(&format!("/v1/networks/{}/ips", net.uuid))
        .await
        .ok(200)
}

async fn vms_hold_addresses_and_give_them_back(backend: Backend) {
    let mut s = TestServer::start(backend, fast_config()).await;
    let _node = s.add_node(8).await;
    s.h100_catalog(1).await;
    let (alice_uuid, alice) = s.tenant("alice").await;
    let alice = s.with(&alice);
    // Hosts .1 to .6; .1 is the gateway: five addresses for VMs.
    let lan: Network = s
        .post(
            "/v1/networks",
            &json!({"name": "lan", "subnet": "10.50.0.0/29", "gateway": "10.50.0.1",
                    "resolvers": ["10.50.0.1"], "bridge": "br0", "public": true,
                    "default": true}),
        )
        .await
        .ok(201);

    // No network named: the default one.
    let a = create(
        &alice,
        json!({"alias": "a", "package": "gpu-1x", "image": "test-image"}),
    )
    .await
    .ok(202);
    assert_eq!(a.nics.len(), 1);
    let nic = &a.nics[0];
    assert_eq!(
        (nic.ip, nic.network_uuid, nic.primary),
        (ip("10.50.0.2"), lan.uuid, true)
    );
    let mac = passage_model::networks::parse_mac(&nic.mac).unwrap();
    assert_eq!(
        mac[0] & 0x03,
        0x02,
        "locally administered, unicast: {}",
        nic.mac
    );
    assert_eq!(a.primary_ip, Some(ip("10.50.0.2")));
    let j = s.wait_job(a.job_uuid.unwrap()).await;
    assert_eq!(j.state, JobState::Succeeded, "{j:#?}");
    let shown: Vm = alice.get(&format!("/v1/vms/{}", a.uuid)).await.ok(200);
    assert_eq!(shown.nics, a.nics);

    // A fixed address, named the way Triton's CloudAPI takes it.
    let b = create(
        &alice,
        json!({"alias": "b", "package": "gpu-1x", "image": "test-image",
               "networks": [{"ipv4_uuid": "lan", "ipv4_ips": ["10.50.0.6"]}]}),
    )
    .await
    .ok(202);
    assert_eq!(b.primary_ip, Some(ip("10.50.0.6")));
    let held = ips(&s, &lan).await;
    let by: Vec<(Ipv4Addr, passage_model::VmId)> = held.iter().map(|i| (i.ip, i.vm_uuid)).collect();
    assert_eq!(
        by,
        vec![(ip("10.50.0.2"), a.uuid), (ip("10.50.0.6"), b.uuid)]
    );
    assert!(held.iter().all(|i| i.owner_uuid == alice_uuid));
    assert_eq!(held[0].mac, a.nics[0].mac);
    // Who holds an address is the operators' business.
    alice
        .get::<Value>(&format!("/v1/networks/{}/ips", lan.uuid))
        .await
        .fails(403, ErrorCode::Forbidden);

    // Refusals, each with its reason, and nothing taken.
    let e = create(
        &alice,
        json!({"alias": "c", "package": "gpu-1x", "image": "test-image",
               "networks": [{"ipv4_uuid": lan.uuid, "ipv4_ips": ["10.50.0.6"]}]}),
    )
    .await
    .fails(409, ErrorCode::Conflict);
    assert!(e.message.contains(&b.uuid.to_string()), "{}", e.message);
    let e = create(
        &alice,
        json!({"alias": "c", "package": "gpu-1x", "image": "test-image",
               "networks": [{"ipv4_uuid": "lan", "ipv4_ips": ["10.50.0.1"]}]}),
    )
    .await
    .invalid("networks[0].ipv4_ips[0]");
    assert!(e.message.contains("gateway"), "{}", e.message);
    create(
        &alice,
        json!({"alias": "c", "package": "gpu-1x", "image": "test-image",
               "networks": ["lan", "lan"]}),
    )
    .await
    .invalid("networks[1]");
    create(
        &alice,
        json!({"alias": "c", "package": "gpu-1x", "image": "test-image",
               "networks": ["nowhere"]}),
    )
    .await
    .missing("networks[0]");
    create(
        &alice,
        json!({"alias": "c", "package": "gpu-1x", "image": "test-image",
               "networks": [42]}),
    )
    .await
    .invalid("networks[0]");
    // A network on a bridge no node has: nowhere to put the VM.
    s.post::<Network>(
        "/v1/networks",
        &json!({"name": "far", "subnet": "10.51.0.0/24", "bridge": "br9", "public": true}),
    )
    .await
    .ok(201);
    let e = create(
        &alice,
        json!({"alias": "c", "package": "gpu-1x", "image": "test-image",
               "networks": ["far"]}),
    )
    .await
    .fails(409, ErrorCode::InsufficientCapacity);
    assert!(e.message.contains("bridge br9"), "{}", e.message);
    assert_eq!(ips(&s, &lan).await.len(), 2);
    // A network with addresses in use stays.
    s.delete::<Value>(&format!("/v1/networks/{}", lan.uuid))
        .await
        .fails(409, ErrorCode::Conflict);

    // Destroyed, the VM's address goes back; the next VM gets the one after the last
    // handed out (as NAPI does), and the freed one after the range wraps.
    let d: Vm = alice.delete(&format!("/v1/vms/{}", a.uuid)).await.ok(202);
    assert_eq!(
        s.wait_job(d.job_uuid.unwrap()).await.state,
        JobState::Succeeded
    );
    assert_eq!(
        ips(&s, &lan).await.iter().map(|i| i.ip).collect::<Vec<_>>(),
        vec![ip("10.50.0.6")]
    );
    let mut next = Vec::new();
    for i in 0..3 {
        let v = create(
            &alice,
            json!({"alias": format!("n{i}"), "package": "gpu-1x", "image": "test-image"}),
        )
        .await
        .ok(202);
        next.push(v.primary_ip.unwrap());
        s.wait_job(v.job_uuid.unwrap()).await;
    }
    assert_eq!(
        next,
        vec![ip("10.50.0.3"), ip("10.50.0.4"), ip("10.50.0.5")]
    );
    // Full: .2 is the only one left, and it goes once.
    let v = create(
        &s.as_admin(),
        json!({"alias": "last", "package": "gpu-1x", "image": "test-image",
               "owner_uuid": alice_uuid}),
    )
    .await
    .ok(202);
    assert_eq!(v.primary_ip, Some(ip("10.50.0.2")));
    let d: Vm = alice.delete(&format!("/v1/vms/{}", b.uuid)).await.ok(202);
    s.wait_job(d.job_uuid.unwrap()).await;
    let e = create(
        &alice,
        json!({"alias": "over", "package": "gpu-1x", "image": "test-image",
               "networks": [{"ipv4_uuid": "lan", "ipv4_ips": ["10.50.0.6"]}, "far"]}),
    )
    .await;
    // 10.50.0.6 is free again, but `far` is on no node's bridge.
    e.fails(409, ErrorCode::InsufficientCapacity);
    assert_eq!(ips(&s, &lan).await.len(), 4);

    // Operators who made networks mean VMs to be on one: with no default left, a VM
    // must name one.
    s.patch::<Network>(
        &format!("/v1/networks/{}", lan.uuid),
        &json!({"default": false}),
    )
    .await
    .ok(200);
    create(
        &alice,
        json!({"alias": "nd", "package": "gpu-1x", "image": "test-image"}),
    )
    .await
    .invalid("networks");
}
both!(
    vms_hold_addresses_and_give_them_back,
    vms_hold_addresses_and_give_them_back
);

/// 64 tenants' creations race for a network's last free address: one gets it, the others
/// are told the network is full, and no address is held twice.
async fn racers_for_the_last_address(backend: Backend) {
    let mut s = TestServer::start(backend, fast_config()).await;
    let _a = s.add_node(8).await;
    let _b = s.add_node(8).await;
    s.h100_catalog(1).await;
    let net: Network = s
        .post(
            "/v1/networks",
            &json!({"name": "one", "subnet": "10.60.0.0/24", "bridge": "br0", "public": true,
                    "provision_start_ip": "10.60.0.9", "provision_end_ip": "10.60.0.9"}),
        )
        .await
        .ok(201);
    let (_, t) = s.tenant("t").await;
    let mut racers = Vec::new();
    for i in 0..64 {
        let c = s.with(&t);
        racers.push(tokio::spawn(async move {
            create(
                &c,
                json!({"alias": format!("r{i}"), "package": "gpu-1x", "image": "test-image",
                       "networks": ["one"]}),
            )
            .await
        }));
    }
    let mut won = Vec::new();
    for r in racers {
        let r = r.await.unwrap();
        if r.status == 202 {
            won.push(r.ok(202));
        } else {
            let e = r.fails(409, ErrorCode::InsufficientCapacity);
            assert!(e.message.contains("no free address"), "{}", e.message);
        }
    }
    assert_eq!(won.len(), 1, "{won:#?}");
    assert_eq!(won[0].primary_ip, Some(ip("10.60.0.9")));
    let held = ips(&s, &net).await;
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].vm_uuid, won[0].uuid);
    // The losers hold no GPU either.
    let vms: Vec<Vm> = s.get("/v1/vms").await.ok(200);
    let gpus: usize = vms.iter().map(|v| v.assigned_devices.len()).sum();
    assert_eq!(gpus, 1);
}
both!(racers_for_the_last_address, racers_for_the_last_address);

/// A bridge that went from its node after the node reported it: the VM is placed there,
/// its launch fails with the node's words, and the provision gives the address back.
/// The node reports its bridges with each heartbeat, and one that lands between the
/// bridge going and the creation makes placement refuse instead; then the bridge comes
/// back and the test tries again, so it passes only through the failed launch.
async fn a_failed_launch_gives_its_address_back(backend: Backend) {
    let mut s = TestServer::start(backend, fast_config()).await;
    let node = s.add_node(2).await;
    s.h100_catalog(1).await;
    let (_, alice) = s.tenant("alice").await;
    let alice = s.with(&alice);
    let lan: Network = s
        .post(
            "/v1/networks",
            &json!({"name": "lan", "subnet": "10.52.0.0/24", "bridge": "br0",
                    "public": true, "default": true}),
        )
        .await
        .ok(201);
    let bridge = node.sysfs.join("class/net/br0");
    let hidden = node.sysfs.join("class/net/.br0-gone");
    for _ in 0..5 {
        std::fs::rename(&bridge, &hidden).unwrap();
        let r = create(
            &alice,
            json!({"alias": "v", "package": "gpu-1x", "image": "test-image"}),
        )
        .await;
        if r.status == 409 {
            // The report came first: put the bridge back, and give the next report
            // (each second) and the servers' bridges cache (one second) time to see it.
            std::fs::rename(&hidden, &bridge).unwrap();
            tokio::time::sleep(std::time::Duration::from_secs(3)).await;
            continue;
        }
        let vm = r.ok(202);
        assert!(vm.primary_ip.is_some(), "{vm:?}");
        let job = s.wait_job(vm.job_uuid.unwrap()).await;
        assert_eq!(job.state, JobState::Failed, "{job:?}");
        let launch = job.steps.iter().find(|st| st.name == "launch").unwrap();
        let why = launch.error.as_deref().unwrap_or("");
        assert!(
            why.contains("br0"),
            "the node's words name the bridge: {why}"
        );
        assert!(
            ips(&s, &lan).await.is_empty(),
            "the failed provision gave its address back"
        );
        let v: Vm = alice.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
        assert_eq!(v.state, passage_model::api::VmState::Failed);
        return;
    }
    panic!("the node's report beat every creation; the launch never failed");
}
both!(
    a_failed_launch_gives_its_address_back,
    a_failed_launch_gives_its_address_back
);
