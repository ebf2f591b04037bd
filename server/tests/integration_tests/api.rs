//! The REST and agent APIs over a real server on loopback, on SQLite and on Postgres.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config};
use serde_json::{Value, json};

async fn auth_and_roles(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    // Ping needs nothing; everything else needs a token.
    let (st, p) = s.call("GET", "/v1/ping", None, None).await;
    assert_eq!((st, p["ok"].clone()), (200, json!(true)));
    let (st, e) = s.call("GET", "/v1/vms", None, None).await;
    assert_eq!((st, e["code"].as_str()), (401, Some("Unauthorized")));
    let (st, _) = s.call("GET", "/v1/vms", Some("pst_nonsense"), None).await;
    assert_eq!(st, 401);
    // Wrong password and unknown user: the same answer.
    let (st1, e1) = s
        .call(
            "POST",
            "/v1/auth/login",
            None,
            Some(json!({"login":"admin","password":"wrong-pass"})),
        )
        .await;
    let (st2, e2) = s
        .call(
            "POST",
            "/v1/auth/login",
            None,
            Some(json!({"login":"nobody","password":"wrong-pass"})),
        )
        .await;
    assert_eq!((st1, st2), (401, 401));
    assert_eq!(e1, e2);

    let (tenant_uuid, tenant) = s.tenant("alice").await;
    let (_, other) = s.tenant("bob").await;
    for (method, path) in [
        ("GET", "/v1/accounts"),
        ("GET", "/v1/servers"),
        ("GET", "/v1/variants"),
        ("POST", "/v1/servers/join-tokens"),
    ] {
        let (st, e) = s.call(method, path, Some(&tenant), None).await;
        assert_eq!(st, 403, "{method} {path}: {e}");
        assert_eq!(e["code"], "Forbidden");
    }
    let (st, _) = s
        .call(
            "POST",
            "/v1/variants",
            Some(&tenant),
            Some(json!({"name":"X","type":"gpu","vendor":"10de","device":"2330"})),
        )
        .await;
    assert_eq!(st, 403);
    // A tenant reads itself and packages, not other accounts.
    let (st, me) = s
        .call(
            "GET",
            &format!("/v1/accounts/{tenant_uuid}"),
            Some(&tenant),
            None,
        )
        .await;
    assert_eq!((st, me["login"].as_str()), (200, Some("alice")));
    assert!(me.get("password_hash").is_none());
    let (st, _) = s.call("GET", "/v1/packages", Some(&tenant), None).await;
    assert_eq!(st, 200);

    // A read-only operator reads everything and changes nothing.
    let (st, _) = s
        .admin_call(
            "POST",
            "/v1/accounts",
            Some(json!({"login":"ro","password":"reader-password","role":"reader"})),
        )
        .await;
    assert_eq!(st, 201);
    let reader = s.login("ro", "reader-password").await;
    let (st, list) = s.call("GET", "/v1/accounts", Some(&reader), None).await;
    assert_eq!(st, 200);
    assert_eq!(list.as_array().unwrap().len(), 4);
    let (st, _) = s
        .call(
            "POST",
            "/v1/accounts",
            Some(&reader),
            Some(json!({"login":"x","password":"xxxxxxxxxx"})),
        )
        .await;
    assert_eq!(st, 403);
    let (st, _) = s
        .call(
            "POST",
            "/v1/vms",
            Some(&reader),
            Some(json!({"alias":"a","package":"p"})),
        )
        .await;
    assert_eq!(st, 403);

    // Node credentials and user tokens do not cross.
    let jt = s.join_token().await;
    let (st, reg) = s
        .call(
            "POST",
            "/agent/v1/register",
            None,
            Some(json!({"join_token": jt, "hostname":"cn-1", "agent_version":"t", "protocol_version":1})),
        )
        .await;
    assert_eq!(st, 201, "{reg}");
    let cred = reg["credential"].as_str().unwrap().to_string();
    let (st, _) = s.call("GET", "/v1/vms", Some(&cred), None).await;
    assert_eq!(st, 401, "a node credential cannot call /v1");
    let (st, _) = s
        .call(
            "POST",
            "/agent/v1/heartbeat",
            Some(&s.admin),
            Some(json!({})),
        )
        .await;
    assert_eq!(st, 401, "a user token cannot call the agent API");
    let (st, _) = s
        .call("POST", "/agent/v1/heartbeat", Some(&cred), Some(json!({})))
        .await;
    assert_eq!(st, 200);
    // A join token admits one node only.
    let (st, _) = s
        .call(
            "POST",
            "/agent/v1/register",
            None,
            Some(json!({"join_token": jt, "hostname":"cn-2", "agent_version":"t", "protocol_version":1})),
        )
        .await;
    assert_eq!(st, 401);

    // Another tenant's VM is not found, not forbidden, and stays untouched.
    s.manual_node(1).await;
    s.h100_catalog(1).await;
    let (st, vm) = s
        .call(
            "POST",
            "/v1/vms",
            Some(&tenant),
            Some(json!({"alias":"mine","package":"gpu-1x"})),
        )
        .await;
    assert_eq!(st, 202, "{vm}");
    let vm_path = format!("/v1/vms/{}", vm["uuid"].as_str().unwrap());
    let job_path = format!("/v1/jobs/{}", vm["job_uuid"].as_str().unwrap());
    for (method, path) in [("GET", &vm_path), ("DELETE", &vm_path), ("GET", &job_path)] {
        let (st, e) = s.call(method, path, Some(&other), None).await;
        assert_eq!(
            (st, e["code"].as_str()),
            (404, Some("ResourceNotFound")),
            "{method} {path}"
        );
    }
    let (st, _) = s.call("DELETE", &vm_path, Some(&reader), None).await;
    assert_eq!(st, 403);
    let (_, list) = s.call("GET", "/v1/vms", Some(&other), None).await;
    assert_eq!(list, json!([]));
    let (st, mine) = s.call("GET", &vm_path, Some(&tenant), None).await;
    assert_eq!((st, mine["state"].as_str()), (200, Some("provisioning")));
    let (st, _) = s.call("GET", &job_path, Some(&tenant), None).await;
    assert_eq!(st, 200);

    // API tokens: shown once, listed without the secret, work, revocable by their owner only.
    let (st, t) = s
        .call(
            "POST",
            "/v1/tokens",
            Some(&tenant),
            Some(json!({"name": "ci"})),
        )
        .await;
    assert_eq!(st, 201, "{t}");
    let api_token = t["token"].as_str().unwrap().to_string();
    let (_, list) = s.call("GET", "/v1/tokens", Some(&tenant), None).await;
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert!(list[0].get("token").is_none());
    let (st, _) = s.call("GET", &vm_path, Some(&api_token), None).await;
    assert_eq!(st, 200);
    let tok_path = format!("/v1/tokens/{}", t["uuid"].as_str().unwrap());
    let (st, _) = s.call("DELETE", &tok_path, Some(&other), None).await;
    assert_eq!(st, 404);
    let (st, _) = s.call("DELETE", &tok_path, Some(&tenant), None).await;
    assert_eq!(st, 204);
    let (st, _) = s.call("GET", &vm_path, Some(&api_token), None).await;
    assert_eq!(st, 401);

    // Logout ends the token.
    let (st, _) = s.call("POST", "/v1/auth/logout", Some(&tenant), None).await;
    assert_eq!(st, 204);
    let (st, _) = s.call("GET", "/v1/packages", Some(&tenant), None).await;
    assert_eq!(st, 401);
}
both!(auth_and_roles_on, auth_and_roles);

async fn counts(s: &TestServer) -> (usize, usize, usize, usize) {
    let n = |v: Value| v.as_array().map_or(0, Vec::len);
    (
        n(s.admin_call("GET", "/v1/variants", None).await.1),
        n(s.admin_call("GET", "/v1/packages", None).await.1),
        n(s.admin_call("GET", "/v1/accounts", None).await.1),
        n(s.admin_call("GET", "/v1/vms", None).await.1),
    )
}

fn assert_invalid(st: u16, e: &Value, field: &str) {
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["code"], "InvalidArgument", "{e}");
    assert_eq!(e["field"].as_str(), Some(field), "{e}");
}

/// Naming what does not exist is a 404, with the field that named it.
fn assert_missing(st: u16, e: &Value, field: &str) {
    assert_eq!(st, 404, "{e}");
    assert_eq!(e["code"], "ResourceNotFound", "{e}");
    assert_eq!(e["field"].as_str(), Some(field), "{e}");
}

async fn bad_input(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    s.h100_catalog(1).await;
    let before = counts(&s).await;
    let admin = s.admin.clone();

    let (st, e) = s
        .raw("POST", "/v1/variants", Some(&admin), "{not json")
        .await;
    assert_eq!(
        (st, e["code"].as_str()),
        (400, Some("InvalidArgument")),
        "{e}"
    );
    let (st, e) = s
        .raw(
            "POST",
            "/v1/variants",
            Some(&admin),
            r#"{"name":"A","type":"gpu","vendor":"10de","device":"2330","colour":"red"}"#,
        )
        .await;
    assert_invalid(st, &e, "colour");
    let (st, e) = s
        .raw(
            "POST",
            "/v1/variants",
            Some(&admin),
            r#"{"name":"A","type":"gpu","vendor":"10de"}"#,
        )
        .await;
    assert_invalid(st, &e, "device");
    let (st, e) = s
        .raw(
            "POST",
            "/v1/variants",
            Some(&admin),
            r#"{"name":"A","type":"gpu","vendor":"10dz","device":"2330"}"#,
        )
        .await;
    assert_invalid(st, &e, "vendor");
    let (st, e) = s
        .raw(
            "POST",
            "/v1/variants",
            Some(&admin),
            r#"{"name":"bad name","type":"gpu","vendor":"10de","device":"2330"}"#,
        )
        .await;
    assert_invalid(st, &e, "name");
    let (st, e) = s
        .raw(
            "POST",
            "/v1/packages",
            Some(&admin),
            r#"{"name":"p","vcpus":1,"memory_mib":1024,"devices":{"NO_SUCH":1}}"#,
        )
        .await;
    assert_missing(st, &e, "devices.NO_SUCH");
    let (st, e) = s
        .raw(
            "POST",
            "/v1/packages",
            Some(&admin),
            r#"{"name":"p","vcpus":1,"memory_mib":1024,"devices":{"NVIDIA_H100":0}}"#,
        )
        .await;
    assert_invalid(st, &e, "devices.NVIDIA_H100");
    let (st, e) = s
        .raw(
            "POST",
            "/v1/packages",
            Some(&admin),
            r#"{"name":"p","vcpus":1,"memory_mib":1024,"devices":{"NVIDIA_H100":-2}}"#,
        )
        .await;
    assert_invalid(st, &e, "devices.NVIDIA_H100");
    let (st, e) = s
        .raw(
            "POST",
            "/v1/packages",
            Some(&admin),
            r#"{"name":"p","vcpus":0,"memory_mib":1024}"#,
        )
        .await;
    assert_invalid(st, &e, "vcpus");
    let (st, e) = s
        .raw(
            "POST",
            "/v1/vms",
            Some(&admin),
            r#"{"alias":"v","package":"gpu-1x","assigned_devices":["/devices/pci0000:00/0000:00:01.0"]}"#,
        )
        .await;
    assert_invalid(st, &e, "assigned_devices");
    let (st, e) = s
        .raw(
            "POST",
            "/v1/vms",
            Some(&admin),
            r#"{"alias":"v","assigned_devices":["/devices/pci0000:00/0000:00:01.99"],"server_uuid":"00000000-0000-0000-0000-000000000000"}"#,
        )
        .await;
    assert_invalid(st, &e, "assigned_devices[0]");
    let (st, e) = s
        .raw(
            "POST",
            "/v1/vms",
            Some(&admin),
            r#"{"alias":"v","package":"no-such-package"}"#,
        )
        .await;
    assert_missing(st, &e, "package");
    let (st, e) = s
        .raw(
            "POST",
            "/v1/vms",
            Some(&admin),
            r#"{"alias":"bad alias!","package":"gpu-1x"}"#,
        )
        .await;
    assert_invalid(st, &e, "alias");
    let (st, e) = s
        .raw(
            "POST",
            "/v1/accounts",
            Some(&admin),
            r#"{"login":"x","password":"short"}"#,
        )
        .await;
    assert_invalid(st, &e, "password");
    let (st, e) = s.call("GET", "/v1/vms?limit=0", Some(&admin), None).await;
    assert_invalid(st, &e, "limit");
    let (st, e) = s
        .call("GET", "/v1/vms?state=sleepy", Some(&admin), None)
        .await;
    assert_invalid(st, &e, "state");

    // Arrays are not objects, even where serde would take one field by field.
    let (st, e) = s
        .raw(
            "POST",
            "/v1/variants",
            Some(&admin),
            r#"["A","gpu","10de","2330"]"#,
        )
        .await;
    assert_invalid(st, &e, "body");
    // NUL never reaches the store (Postgres text cannot hold it).
    let (st, e) = s
        .raw(
            "POST",
            "/v1/variants",
            Some(&admin),
            r#"{"name":"A","type":"gpu","vendor":"10de","device":"2330","description":"a\u0000b"}"#,
        )
        .await;
    assert_invalid(st, &e, "body");
    let (st, _) = s
        .raw(
            "POST",
            "/v1/auth/login",
            None,
            r#"{"login":"a\u0000","password":"x"}"#,
        )
        .await;
    assert_eq!(st, 400);
    let (st, e) = s
        .call("GET", "/v1/vms?assigned_device=%00", Some(&admin), None)
        .await;
    assert_eq!(st, 400, "{e}");
    let (st, _) = s
        .call("GET", "/v1/variants/a%00b", Some(&admin), None)
        .await;
    assert_eq!(st, 404);

    // Oversize body: 413, whatever it holds.
    let big = format!(
        r#"{{"name":"{}","vcpus":1,"memory_mib":1024}}"#,
        "x".repeat(200_000)
    );
    // The server stops reading and closes that connection: a client of its own, so
    // the shared pool never reuses a connection being closed.
    let oversize = reqwest::Client::new()
        .post(s.url("/v1/packages"))
        .bearer_auth(&admin)
        .header("content-type", "application/json")
        .body(big)
        .send()
        .await
        .unwrap();
    let st = oversize.status().as_u16();
    let e: Value = oversize.json().await.unwrap();
    assert_eq!(
        (st, e["code"].as_str()),
        (413, Some("PayloadTooLarge")),
        "{e}"
    );

    // Agent messages get the same treatment.
    let jt = s.join_token().await;
    let (st, e) = s
        .raw(
            "POST",
            "/agent/v1/register",
            None,
            &format!(r#"{{"join_token":"{jt}","hostname":"bad host","agent_version":"t","protocol_version":1}}"#),
        )
        .await;
    assert_invalid(st, &e, "hostname");
    let (_, reg) = s
        .call(
            "POST",
            "/agent/v1/register",
            None,
            Some(json!({"join_token": jt, "hostname":"cn-1", "agent_version":"t", "protocol_version":1})),
        )
        .await;
    let cred = reg["credential"].as_str().unwrap().to_string();
    let (st, e) = s
        .raw(
            "PUT",
            "/agent/v1/inventory",
            Some(&cred),
            r#"{"devices":[{"id":"/devices/pci0000:00/0000:00:01.0","vendor":"10de","device":"2330","subvendor":"10de","subsystem":"16c1","revision":"a1","class":"03020","driver":null,"numa_node":0,"iommu_group":1}]}"#,
        )
        .await;
    assert_invalid(st, &e, "devices[0].class");

    assert_eq!(
        counts(&s).await,
        before,
        "nothing was written by refused calls"
    );
}
both!(bad_input_on, bad_input);

async fn inventory_and_variants(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let (server, cred, devices) = s.manual_node(8).await;
    let srv = s.server(&server).await;
    assert_eq!(
        srv["sysinfo"]["PCI Devices"].as_array().unwrap().len(),
        devices.len()
    );
    assert_eq!(
        srv["assignable_devices"].as_array().unwrap().len(),
        0,
        "no variant yet"
    );
    assert_eq!(srv["status"], "running");

    // A variant makes the matching devices assignable; changing it recomputes.
    s.h100_catalog(1).await;
    assert_eq!(s.device_states(&server).await.len(), 8);
    let (st, _) = s
        .admin_call(
            "PUT",
            "/v1/variants/NVIDIA_H100",
            Some(json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330","revision":"ff"})),
        )
        .await;
    assert_eq!(st, 200);
    assert_eq!(
        s.device_states(&server).await.len(),
        0,
        "revision ff matches none"
    );
    let (st, _) = s
        .admin_call(
            "PUT",
            "/v1/variants/NVIDIA_H100",
            Some(json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330","revision":"a1"})),
        )
        .await;
    assert_eq!(st, 200);
    assert_eq!(s.device_states(&server).await.len(), 8);
    // In use by a package: not deletable.
    let (st, e) = s
        .admin_call("DELETE", "/v1/variants/NVIDIA_H100", None)
        .await;
    assert_eq!((st, e["code"].as_str()), (409, Some("Conflict")));

    // Reserve one device (no agent answers, so the job waits; the reservation stands).
    let (st, vm) = s
        .admin_call(
            "POST",
            "/v1/vms",
            Some(json!({"alias":"held","package":"gpu-1x"})),
        )
        .await;
    assert_eq!(st, 202, "{vm}");
    let held_id = vm["assigned_devices"][0].as_str().unwrap().to_string();

    // The node now reports everything but the held device and one free GPU.
    let free_gone = s
        .device_states(&server)
        .await
        .into_iter()
        .find(|(id, st, _)| *id != held_id && st == "unassigned")
        .unwrap()
        .0;
    let partial: Vec<_> = devices
        .iter()
        .filter(|d| d.id.to_string() != held_id && d.id.to_string() != free_gone)
        .collect();
    let (st, _) = s
        .call(
            "PUT",
            "/agent/v1/inventory",
            Some(&cred),
            Some(json!({"devices": partial})),
        )
        .await;
    assert_eq!(st, 204);
    let srv = s.server(&server).await;
    let find = |id: &str| {
        srv["assignable_devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["id"] == id)
            .cloned()
            .unwrap()
    };
    let held = find(&held_id);
    assert_eq!(
        held["state"], "provisioning",
        "a missing held device is never freed"
    );
    assert_eq!(held["used_by"], vm["uuid"]);
    assert!(held["taint"].as_str().unwrap().contains("missing"));
    assert!(find(&free_gone)["taint"].is_string());

    // Tainted devices are not placed: 8 - 1 held - 1 missing = 6 more fit, not 7.
    let mut ok = 0;
    for i in 0..8 {
        let (st, _) = s
            .admin_call(
                "POST",
                "/v1/vms",
                Some(json!({"alias": format!("v{i}"), "package":"gpu-1x"})),
            )
            .await;
        if st == 202 {
            ok += 1;
        } else {
            assert_eq!(st, 409);
        }
    }
    assert_eq!(ok, 6);

    // Reported again: the taint clears, the device stays held.
    let (st, _) = s
        .call(
            "PUT",
            "/agent/v1/inventory",
            Some(&cred),
            Some(json!({"devices": devices})),
        )
        .await;
    assert_eq!(st, 204);
    let srv = s.server(&server).await;
    let back = srv["assignable_devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["id"] == held_id.as_str())
        .cloned()
        .unwrap();
    assert!(back["taint"].is_null());
    assert_eq!(back["used_by"], vm["uuid"]);
}
both!(inventory_and_variants_on, inventory_and_variants);

async fn race_for_the_last_devices(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let (server, _cred, _) = s.manual_node(8).await;
    s.h100_catalog(1).await;
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
                .json(&json!({"alias": format!("race-{i}"), "package": "gpu-1x"}))
                .send()
                .await
                .unwrap();
            let st = r.status().as_u16();
            (st, r.json::<Value>().await.unwrap())
        }));
    }
    let mut won = Vec::new();
    let mut lost = 0;
    for c in calls {
        let (st, body) = c.await.unwrap();
        match st {
            202 => won.push(body),
            409 => {
                assert_eq!(body["code"], "InsufficientCapacity", "{body}");
                lost += 1;
            }
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert_eq!((won.len(), lost), (8, 56));
    let states = s.device_states(&server).await;
    assert!(states.iter().all(|(_, st, _)| st == "provisioning"));
    let mut holders: Vec<String> = states.iter().filter_map(|(_, _, u)| u.clone()).collect();
    holders.sort();
    holders.dedup();
    assert_eq!(holders.len(), 8, "each device held by a different VM");
    let mut assigned: Vec<String> = won
        .iter()
        .map(|v| v["assigned_devices"][0].as_str().unwrap().to_string())
        .collect();
    assigned.sort();
    assigned.dedup();
    assert_eq!(assigned.len(), 8, "no device given twice");
    // The history agrees: one reservation per device, ever.
    let (_, events) = s
        .admin_call("GET", &format!("/v1/servers/{server}/device-events"), None)
        .await;
    let reserves = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["to"] == "provisioning")
        .count();
    assert_eq!(reserves, 8);
}
both!(race_for_the_last_devices_on, race_for_the_last_devices);

async fn lists_page_newest_first(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    for name in ["t1", "t2", "t3"] {
        s.tenant(name).await;
    }
    let r = s
        .http
        .get(s.url("/v1/accounts?limit=2&offset=0"))
        .bearer_auth(&s.admin)
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-resource-count"], "4");
    let page: Value = r.json().await.unwrap();
    let logins: Vec<&str> = page
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["login"].as_str().unwrap())
        .collect();
    assert_eq!(logins, ["t3", "t2"]);
    let (_, rest) = s
        .admin_call("GET", "/v1/accounts?limit=2&offset=2", None)
        .await;
    let logins: Vec<&str> = rest
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["login"].as_str().unwrap())
        .collect();
    assert_eq!(logins, ["t1", "admin"]);
    let (st, e) = s.admin_call("GET", "/v1/accounts?limit=1001", None).await;
    assert_invalid(st, &e, "limit");
}
both!(lists_page_newest_first_on, lists_page_newest_first);
