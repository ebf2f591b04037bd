//! Networks (`/v1/networks`): operators create and change them, tenants read the public
//! ones and those made for them; subnets on one bridge and VLAN never overlap, even when
//! created at once.

use crate::common::*;
use passage_model::ErrorCode;
use passage_model::api::Account;
use passage_model::networks::Network;
use serde_json::{Value, json};

fn net(name: &str, subnet: &str) -> Value {
    json!({"name": name, "subnet": subnet, "bridge": "br0"})
}

async fn operators_manage_networks_tenants_see_theirs(backend: Backend) {
    let s = TestServer::start(backend, fast_config()).await;
    let op = s.as_admin();
    let (alice_uuid, alice) = s.tenant("alice").await;
    let (_, bob) = s.tenant("bob").await;
    let (alice, bob) = (s.with(&alice), s.with(&bob));

    let public: Network = op
        .post(
            "/v1/networks",
            &json!({"name": "external", "subnet": "192.0.2.0/24", "gateway": "192.0.2.1",
                    "provision_start_ip": "192.0.2.10", "provision_end_ip": "192.0.2.250",
                    "resolvers": ["192.0.2.1", "2001:db8::53"], "bridge": "br0",
                    "public": true, "default": true, "description": "the world"}),
        )
        .await
        .ok(201);
    assert_eq!(public.subnet, "192.0.2.0/24");
    assert_eq!(public.provision_start_ip.to_string(), "192.0.2.10");
    assert_eq!(public.mtu, 1500);
    assert_eq!(public.vlan_id, 0);
    assert!(public.default && public.public);
    let private: Network = op
        .post(
            "/v1/networks",
            &json!({"name": "alice-lan", "subnet": "10.20.0.0/16", "bridge": "br1",
                    "vlan_id": 20, "mtu": 9000, "owner_uuids": [alice_uuid]}),
        )
        .await
        .ok(201);
    assert_eq!(private.provision_start_ip.to_string(), "10.20.0.1");
    assert_eq!(private.provision_end_ip.to_string(), "10.20.255.254");

    let seen = |c: Client| async move {
        let r = c.get::<Vec<Network>>("/v1/networks").await;
        let total = r.header("x-resource-count").map(String::from);
        let names: Vec<String> = r.ok(200).into_iter().map(|n| n.name).collect();
        (names, total)
    };
    assert_eq!(
        seen(op.clone()).await,
        (
            vec!["alice-lan".into(), "external".into()],
            Some("2".into())
        )
    );
    assert_eq!(
        seen(alice.clone()).await,
        (
            vec!["alice-lan".into(), "external".into()],
            Some("2".into())
        )
    );
    assert_eq!(
        seen(bob.clone()).await,
        (vec!["external".into()], Some("1".into()))
    );
    let private_path = format!("/v1/networks/{}", private.uuid);
    alice.get::<Network>(&private_path).await.ok(200);
    bob.get::<Network>(&private_path)
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    bob.patch::<Network>(&private_path, &json!({"mtu": 1400}))
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    // Tenants read; they do not write.
    alice
        .post::<Network>("/v1/networks", &net("mine", "10.99.0.0/24"))
        .await
        .fails(403, ErrorCode::Forbidden);
    alice
        .patch::<Network>(&private_path, &json!({"mtu": 1400}))
        .await
        .fails(403, ErrorCode::Forbidden);
    alice
        .delete::<()>(&private_path)
        .await
        .fails(403, ErrorCode::Forbidden);

    // Bad requests name their field.
    op.post::<Network>("/v1/networks", &net("bad", "192.0.2.7/24"))
        .await
        .invalid("subnet");
    op.post::<Network>(
        "/v1/networks",
        &json!({"name": "bad", "subnet": "10.5.0.0/24", "bridge": "br0",
                "gateway": "10.6.0.1"}),
    )
    .await
    .invalid("gateway");
    op.post::<Network>(
        "/v1/networks",
        &json!({"name": "bad", "subnet": "10.5.0.0/24", "bridge": "not a bridge"}),
    )
    .await
    .invalid("bridge");
    op.post::<Network>(
        "/v1/networks",
        &json!({"name": "bad", "subnet": "10.5.0.0/24", "bridge": "br0",
                "owner_uuids": [uuid::Uuid::new_v4()]}),
    )
    .await
    .invalid("owner_uuids");
    // Names are unique; subnets on one bridge and VLAN do not overlap.
    op.post::<Network>("/v1/networks", &net("external", "10.7.0.0/24"))
        .await
        .fails(409, ErrorCode::Conflict);
    let e = op
        .post::<Network>("/v1/networks", &net("inside", "192.0.2.128/25"))
        .await
        .fails(409, ErrorCode::Conflict);
    assert!(e.message.contains("external"), "{}", e.message);
    // The same subnet on another VLAN or bridge is another network.
    op.post::<Network>(
        "/v1/networks",
        &json!({"name": "v30", "subnet": "192.0.2.0/24", "bridge": "br0", "vlan_id": 30}),
    )
    .await
    .ok(201);
    op.post::<Network>(
        "/v1/networks",
        &json!({"name": "other-bridge", "subnet": "192.0.2.0/24", "bridge": "br2"}),
    )
    .await
    .ok(201);

    // What may change, changes; the addresses may not.
    let changed: Network = op
        .patch(
            &private_path,
            &json!({"name": "alice-and-bob", "mtu": 1400, "owner_uuids": [alice_uuid],
                    "resolvers": ["10.20.0.1"], "description": "lab"}),
        )
        .await
        .ok(200);
    assert_eq!(changed.name, "alice-and-bob");
    assert_eq!(changed.mtu, 1400);
    assert_eq!(changed.description.as_deref(), Some("lab"));
    assert_eq!(changed.subnet, "10.20.0.0/16");
    op.patch::<Network>(&private_path, &json!({"subnet": "10.21.0.0/16"}))
        .await
        .fails(400, ErrorCode::InvalidArgument);
    op.patch::<Network>(&private_path, &json!({"name": "external"}))
        .await
        .fails(409, ErrorCode::Conflict);
    let cleared: Network = op
        .patch(
            &private_path,
            &json!({"description": "", "owner_uuids": []}),
        )
        .await
        .ok(200);
    assert_eq!(cleared.description, None);
    assert!(cleared.owner_uuids.is_empty());
    alice
        .get::<Network>(&private_path)
        .await
        .fails(404, ErrorCode::ResourceNotFound);

    op.delete::<()>(&private_path).await.ok(204);
    op.get::<Network>(&private_path)
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    // An owner's account goes: the network stays, without it.
    let carol: Account = op
        .post(
            "/v1/accounts",
            &json!({"login": "carol", "password": "tenant-password", "role": "tenant"}),
        )
        .await
        .ok(201);
    let hers: Network = op
        .post(
            "/v1/networks",
            &json!({"name": "carol-lan", "subnet": "10.30.0.0/24", "bridge": "br0",
                    "owner_uuids": [carol.uuid]}),
        )
        .await
        .ok(201);
    op.delete::<()>(&format!("/v1/accounts/{}", carol.uuid))
        .await
        .ok(204);
    let left: Network = op.get(&format!("/v1/networks/{}", hers.uuid)).await.ok(200);
    assert!(left.owner_uuids.is_empty());
}
both!(
    operators_manage_networks_tenants_see_theirs,
    operators_manage_networks_tenants_see_theirs
);

/// 64 operators create overlapping subnets on one bridge at once: exactly one wins, the
/// others get 409 and leave nothing behind.
async fn overlapping_creations_race_and_one_wins(backend: Backend) {
    let s = TestServer::start(backend, fast_config()).await;
    let mut racers = Vec::new();
    for i in 0..64u32 {
        let op = s.as_admin();
        // Every subnet holds 10.40.0.0: /16 to /24 around it.
        let prefix = 16 + i % 9;
        racers.push(tokio::spawn(async move {
            op.post::<Network>(
                "/v1/networks",
                &net(&format!("racer-{i}"), &format!("10.40.0.0/{prefix}")),
            )
            .await
        }));
    }
    let mut won = 0;
    for r in racers {
        let r = r.await.unwrap();
        match r.status {
            201 => won += 1,
            _ => {
                r.fails(409, ErrorCode::Conflict);
            }
        }
    }
    assert_eq!(won, 1);
    let all = s.as_admin().get::<Vec<Network>>("/v1/networks").await;
    assert_eq!(all.ok(200).len(), 1);
}
both!(
    overlapping_creations_race_and_one_wins,
    overlapping_creations_race_and_one_wins
);
