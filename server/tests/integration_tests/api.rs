//! The REST and agent APIs over a real server on loopback, on SQLite and on Postgres.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config};
use passage_model::api::{
    Account, ApiToken, DeviceEventRecord, LoginResponse, Package, Ping, Vm, VmState,
};
use passage_model::protocol::{HeartbeatResponse, RegisterResponse};
use passage_model::{DeviceState, ErrorCode, Variant};
use serde::de::IgnoredAny;
use serde_json::json;

async fn auth_and_roles(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let anon = s.client(None);
    // Ping needs nothing; everything else needs a token.
    let p: Ping = anon.get("/v1/ping").await.ok(200);
    assert!(p.ok);
    anon.get::<Vec<Vm>>("/v1/vms")
        .await
        .fails(401, ErrorCode::Unauthorized);
    s.with("pst_nonsense")
        .get::<Vec<Vm>>("/v1/vms")
        .await
        .err(401);
    // Wrong password and unknown user: the same answer.
    let wrong = |login: &str| json!({"login": login, "password": "wrong-pass"});
    let e1 = anon
        .post::<LoginResponse>("/v1/auth/login", &wrong("admin"))
        .await
        .err(401);
    let e2 = anon
        .post::<LoginResponse>("/v1/auth/login", &wrong("nobody"))
        .await
        .err(401);
    assert_eq!(e1, e2);

    let (tenant_uuid, tenant) = s.tenant("alice").await;
    let (_, other) = s.tenant("bob").await;
    for (method, path) in [
        ("GET", "/v1/accounts"),
        ("GET", "/v1/servers"),
        ("GET", "/v1/variants"),
        ("POST", "/v1/servers/join-tokens"),
    ] {
        s.with(&tenant)
            .send::<IgnoredAny>(method, path, None)
            .await
            .fails(403, ErrorCode::Forbidden);
    }
    s.with(&tenant)
        .post::<Variant>(
            "/v1/variants",
            &json!({"name":"X","type":"gpu","vendor":"10de","device":"2330"}),
        )
        .await
        .err(403);
    // A tenant reads itself and packages, not other accounts.
    let me: Account = s
        .with(&tenant)
        .get(&format!("/v1/accounts/{tenant_uuid}"))
        .await
        .ok(200);
    assert_eq!(me.login, "alice");
    // No field beyond the view's (a password hash above all) leaves the server.
    let (_, raw) = s
        .call(
            "GET",
            &format!("/v1/accounts/{tenant_uuid}"),
            Some(&tenant),
            None,
        )
        .await;
    assert!(raw.get("password_hash").is_none());
    s.with(&tenant)
        .get::<Vec<Package>>("/v1/packages")
        .await
        .ok(200);

    // A read-only operator reads everything and changes nothing.
    let reader = s.reader("ro").await;
    let list: Vec<Account> = s.with(&reader).get("/v1/accounts").await.ok(200);
    assert_eq!(list.len(), 4);
    s.with(&reader)
        .post::<Account>(
            "/v1/accounts",
            &json!({"login":"x","password":"xxxxxxxxxx"}),
        )
        .await
        .err(403);
    s.with(&reader)
        .post::<Vm>(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"a","package":"p"}),
        )
        .await
        .err(403);

    // Node credentials and user tokens do not cross.
    let jt = s.join_token().await;
    let reg: RegisterResponse = anon
        .post(
            "/agent/v1/register",
            &json!({"join_token": jt, "hostname":"cn-1", "agent_version":"t", "protocol_version":1}),
        )
        .await
        .ok(201);
    let cred = reg.credential;
    s.with(&cred).get::<Vec<Vm>>("/v1/vms").await.err(401);
    s.as_admin()
        .post::<HeartbeatResponse>("/agent/v1/heartbeat", &json!({}))
        .await
        .err(401);
    s.with(&cred)
        .post::<HeartbeatResponse>("/agent/v1/heartbeat", &json!({}))
        .await
        .ok(200);
    // A join token admits one node only.
    anon.post::<RegisterResponse>(
        "/agent/v1/register",
        &json!({"join_token": jt, "hostname":"cn-2", "agent_version":"t", "protocol_version":1}),
    )
    .await
    .err(401);

    // Another tenant's VM is not found, not forbidden, and stays untouched.
    s.manual_node(1).await;
    s.h100_catalog(1).await;
    let vm: Vm = s
        .with(&tenant)
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"mine","package":"gpu-1x"}),
        )
        .await
        .ok(202);
    let vm_path = format!("/v1/vms/{}", vm.uuid);
    let job_path = format!("/v1/jobs/{}", vm.job_uuid.unwrap());
    for (method, path) in [("GET", &vm_path), ("DELETE", &vm_path), ("GET", &job_path)] {
        s.with(&other)
            .send::<IgnoredAny>(method, path, None)
            .await
            .fails(404, ErrorCode::ResourceNotFound);
    }
    s.with(&reader).delete::<Vm>(&vm_path).await.err(403);
    let list: Vec<Vm> = s.with(&other).get("/v1/vms").await.ok(200);
    assert!(list.is_empty());
    let mine: Vm = s.with(&tenant).get(&vm_path).await.ok(200);
    assert_eq!(mine.state, VmState::Provisioning);
    s.with(&tenant).get::<IgnoredAny>(&job_path).await.ok(200);

    // API tokens: shown once, listed without the secret, work, revocable by their owner only.
    let t: ApiToken = s
        .with(&tenant)
        .post("/v1/tokens", &json!({"name": "ci"}))
        .await
        .ok(201);
    let api_token = t.token.clone().unwrap();
    let list: Vec<ApiToken> = s.with(&tenant).get("/v1/tokens").await.ok(200);
    assert_eq!(list.len(), 1);
    assert!(list[0].token.is_none());
    s.with(&api_token).get::<Vm>(&vm_path).await.ok(200);
    let tok_path = format!("/v1/tokens/{}", t.uuid);
    s.with(&other).delete::<()>(&tok_path).await.err(404);
    s.with(&tenant).delete::<()>(&tok_path).await.ok(204);
    s.with(&api_token).get::<Vm>(&vm_path).await.err(401);

    // Logout ends the token.
    s.with(&tenant)
        .post_empty::<()>("/v1/auth/logout")
        .await
        .ok(204);
    s.with(&tenant)
        .get::<Vec<Package>>("/v1/packages")
        .await
        .err(401);
}
both!(auth_and_roles_on, auth_and_roles);

async fn counts(s: &TestServer) -> (usize, usize, usize, usize) {
    (
        s.get::<Vec<Variant>>("/v1/variants").await.ok(200).len(),
        s.get::<Vec<Package>>("/v1/packages").await.ok(200).len(),
        s.get::<Vec<Account>>("/v1/accounts").await.ok(200).len(),
        s.get::<Vec<Vm>>("/v1/vms").await.ok(200).len(),
    )
}

async fn bad_input(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    s.h100_catalog(1).await;
    let before = counts(&s).await;
    let admin = s.as_admin();

    // Bodies no request type would write, sent as they are.
    admin
        .raw::<Variant>("POST", "/v1/variants", "{not json")
        .await
        .fails(400, ErrorCode::InvalidArgument);
    admin
        .raw::<Variant>(
            "POST",
            "/v1/variants",
            r#"{"name":"A","type":"gpu","vendor":"10de","device":"2330","colour":"red"}"#,
        )
        .await
        .invalid("colour");
    admin
        .raw::<Variant>(
            "POST",
            "/v1/variants",
            r#"{"name":"A","type":"gpu","vendor":"10de"}"#,
        )
        .await
        .invalid("device");
    admin
        .raw::<Variant>(
            "POST",
            "/v1/variants",
            r#"{"name":"A","type":"gpu","vendor":"10dz","device":"2330"}"#,
        )
        .await
        .invalid("vendor");
    admin
        .raw::<Variant>(
            "POST",
            "/v1/variants",
            r#"{"name":"bad name","type":"gpu","vendor":"10de","device":"2330"}"#,
        )
        .await
        .invalid("name");
    admin
        .raw::<Package>(
            "POST",
            "/v1/packages",
            r#"{"name":"p","vcpus":1,"memory_mib":1024,"devices":{"NO_SUCH":1}}"#,
        )
        .await
        .missing("devices.NO_SUCH");
    admin
        .raw::<Package>(
            "POST",
            "/v1/packages",
            r#"{"name":"p","vcpus":1,"memory_mib":1024,"devices":{"NVIDIA_H100":0}}"#,
        )
        .await
        .invalid("devices.NVIDIA_H100");
    admin
        .raw::<Package>(
            "POST",
            "/v1/packages",
            r#"{"name":"p","vcpus":1,"memory_mib":1024,"devices":{"NVIDIA_H100":-2}}"#,
        )
        .await
        .invalid("devices.NVIDIA_H100");
    admin
        .raw::<Package>(
            "POST",
            "/v1/packages",
            r#"{"name":"p","vcpus":0,"memory_mib":1024}"#,
        )
        .await
        .invalid("vcpus");
    admin
        .raw::<Vm>(
            "POST",
            "/v1/vms",
            r#"{"image":"test-image","alias":"v","package":"gpu-1x","assigned_devices":["/devices/pci0000:00/0000:00:01.0"]}"#,
        )
        .await
        .invalid("assigned_devices");
    admin
        .raw::<Vm>(
            "POST",
            "/v1/vms",
            r#"{"image":"test-image","alias":"v","assigned_devices":["/devices/pci0000:00/0000:00:01.99"],"server_uuid":"00000000-0000-0000-0000-000000000000"}"#,
        )
        .await
        .invalid("assigned_devices[0]");
    admin
        .raw::<Vm>(
            "POST",
            "/v1/vms",
            r#"{"image":"test-image","alias":"v","package":"no-such-package"}"#,
        )
        .await
        .missing("package");
    admin
        .raw::<Vm>(
            "POST",
            "/v1/vms",
            r#"{"image":"test-image","alias":"bad alias!","package":"gpu-1x"}"#,
        )
        .await
        .invalid("alias");
    admin
        .raw::<Account>(
            "POST",
            "/v1/accounts",
            r#"{"login":"x","password":"short"}"#,
        )
        .await
        .invalid("password");
    admin
        .get::<Vec<Vm>>("/v1/vms?limit=0")
        .await
        .invalid("limit");
    admin
        .get::<Vec<Vm>>("/v1/vms?state=sleepy")
        .await
        .invalid("state");

    // Arrays are not objects, even where serde would take one field by field.
    admin
        .raw::<Variant>("POST", "/v1/variants", r#"["A","gpu","10de","2330"]"#)
        .await
        .invalid("body");
    // NUL never reaches the store (Postgres text cannot hold it).
    admin
        .raw::<Variant>(
            "POST",
            "/v1/variants",
            r#"{"name":"A","type":"gpu","vendor":"10de","device":"2330","description":"a\u0000b"}"#,
        )
        .await
        .invalid("body");
    s.client(None)
        .raw::<LoginResponse>(
            "POST",
            "/v1/auth/login",
            r#"{"login":"a\u0000","password":"x"}"#,
        )
        .await
        .err(400);
    admin
        .get::<Vec<Vm>>("/v1/vms?assigned_device=%00")
        .await
        .invalid("assigned_device");
    admin.get::<Variant>("/v1/variants/a%00b").await.err(404);

    // Oversize body: 413, whatever it holds.
    let big = format!(
        r#"{{"name":"{}","vcpus":1,"memory_mib":1024}}"#,
        "x".repeat(200_000)
    );
    // The server stops reading and closes that connection: a client of its own, so
    // the shared pool never reuses a connection being closed.
    let oversize = reqwest::Client::new()
        .post(s.url("/v1/packages"))
        .bearer_auth(&s.admin)
        .header("content-type", "application/json")
        .body(big)
        .send()
        .await
        .unwrap();
    assert_eq!(oversize.status().as_u16(), 413);
    let e: passage_model::ApiErrorBody = oversize.json().await.unwrap();
    assert_eq!(e.code, ErrorCode::PayloadTooLarge, "{e:?}");

    // Agent messages get the same treatment.
    let jt = s.join_token().await;
    let anon = s.client(None);
    anon.raw::<RegisterResponse>(
        "POST",
        "/agent/v1/register",
        &format!(r#"{{"join_token":"{jt}","hostname":"bad host","agent_version":"t","protocol_version":1}}"#),
    )
    .await
    .invalid("hostname");
    let reg: RegisterResponse = anon
        .post(
            "/agent/v1/register",
            &json!({"join_token": jt, "hostname":"cn-1", "agent_version":"t", "protocol_version":1}),
        )
        .await
        .ok(201);
    s.with(&reg.credential)
        .raw::<()>(
            "PUT",
            "/agent/v1/inventory",
            r#"{"devices":[{"id":"/devices/pci0000:00/0000:00:01.0","vendor":"10de","device":"2330","subvendor":"10de","subsystem":"16c1","revision":"a1","class":"03020","driver":null,"numa_node":0,"iommu_group":1}]}"#,
        )
        .await
        .invalid("devices[0].class");

    assert_eq!(
        counts(&s).await,
        before,
        "nothing was written by refused calls"
    );
}
both!(bad_input_on, bad_input);

/// NVIDIA's SR-IOV functions carry their GPU's ids: a whole-GPU variant must still count
/// each physical GPU once, and never offer a VF, which shares the GPU's hardware.
async fn virtual_functions_are_not_whole_gpus(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    s.h100_catalog(1).await;
    let opts = node_agent::fake::FakeOptions {
        vgpu: Some(node_agent::fake::FakeVgpu::Vfio),
        ..Default::default()
    };
    let (server, _cred, devices) = s.manual_node_from(2, None, &opts).await;
    let vfs = devices
        .iter()
        .filter(|d| d.details.as_ref().is_some_and(|x| x.physfn.is_some()))
        .count();
    assert!(vfs >= 2, "the tree has VFs with the GPU's ids ({vfs})");
    let states = s.device_states(server).await;
    assert_eq!(states.len(), 2, "one assignable device per physical GPU");
    for (id, _, _) in &states {
        let d = devices.iter().find(|d| d.id == *id).unwrap();
        assert!(d.details.as_ref().is_none_or(|x| x.physfn.is_none()));
    }
}
both!(
    virtual_functions_are_not_whole_gpus_on,
    virtual_functions_are_not_whole_gpus
);

async fn inventory_and_variants(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let (server, cred, devices) = s.manual_node(8).await;
    let srv = s.server(server).await;
    assert_eq!(srv.sysinfo.unwrap().pci_devices.len(), devices.len());
    assert_eq!(srv.assignable_devices.unwrap().len(), 0, "no variant yet");
    assert_eq!(srv.status, passage_model::api::ServerStatus::Running);

    // A variant makes the matching devices assignable; changing it recomputes.
    s.h100_catalog(1).await;
    assert_eq!(s.device_states(server).await.len(), 8);
    s.put::<Variant>(
        "/v1/variants/NVIDIA_H100",
        &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330","revision":"ff"}),
    )
    .await
    .ok(200);
    assert_eq!(
        s.device_states(server).await.len(),
        0,
        "revision ff matches none"
    );
    s.put::<Variant>(
        "/v1/variants/NVIDIA_H100",
        &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330","revision":"a1"}),
    )
    .await
    .ok(200);
    assert_eq!(s.device_states(server).await.len(), 8);
    // In use by a package: not deletable.
    s.delete::<()>("/v1/variants/NVIDIA_H100")
        .await
        .fails(409, ErrorCode::Conflict);

    // Reserve one device (no agent answers, so the job waits; the reservation stands).
    let vm: Vm = s
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias":"held","package":"gpu-1x"}),
        )
        .await
        .ok(202);
    let held_id = vm.assigned_devices[0].clone();

    // The node now reports everything but the held device and one free GPU.
    let free_gone = s
        .device_states(server)
        .await
        .into_iter()
        .find(|(id, st, _)| *id != held_id && *st == DeviceState::Unassigned)
        .unwrap()
        .0;
    let partial: Vec<_> = devices
        .iter()
        .filter(|d| d.id != held_id && d.id != free_gone)
        .collect();
    s.with(&cred)
        .put::<()>("/agent/v1/inventory", &json!({"devices": partial}))
        .await
        .ok(204);
    let srv = s.server(server).await;
    let assignable = srv.assignable_devices.unwrap();
    let find =
        |id: &passage_model::DevicePath| assignable.iter().find(|d| d.id == *id).cloned().unwrap();
    let held = find(&held_id);
    assert_eq!(
        held.state,
        DeviceState::Provisioning,
        "a missing held device is never freed"
    );
    assert_eq!(held.used_by, Some(vm.uuid));
    assert!(held.taint.unwrap().contains("missing"));
    assert!(find(&free_gone).taint.is_some());

    // Tainted devices are not placed: 8 - 1 held - 1 missing = 6 more fit, not 7.
    let mut ok = 0;
    for i in 0..8 {
        let r = s
            .post::<Vm>(
                "/v1/vms",
                &json!({"image": "test-image", "alias": format!("v{i}"), "package":"gpu-1x"}),
            )
            .await;
        if r.status == 202 {
            ok += 1;
        } else {
            r.err(409);
        }
    }
    assert_eq!(ok, 6);

    // Reported again: the taint clears, the device stays held.
    s.with(&cred)
        .put::<()>("/agent/v1/inventory", &json!({"devices": devices}))
        .await
        .ok(204);
    let back = s
        .server(server)
        .await
        .assignable_devices
        .unwrap()
        .into_iter()
        .find(|d| d.id == held_id)
        .unwrap();
    assert!(back.taint.is_none());
    assert_eq!(back.used_by, Some(vm.uuid));
}
both!(inventory_and_variants_on, inventory_and_variants);

async fn race_for_the_last_devices(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let (server, _cred, _) = s.manual_node(8).await;
    s.h100_catalog(1).await;
    let (_, tenant) = s.tenant("racer").await;
    let calls: Vec<_> = (0..64)
        .map(|i| {
            let c = s.with(&tenant);
            let body =
                json!({"image": "test-image", "alias": format!("race-{i}"), "package": "gpu-1x"});
            tokio::spawn(async move { c.post::<Vm>("/v1/vms", &body).await })
        })
        .collect();
    let mut won = Vec::new();
    let mut lost = 0;
    for c in calls {
        let r = c.await.unwrap();
        match r.status {
            202 => won.push(r.ok(202)),
            _ => {
                r.fails(409, ErrorCode::InsufficientCapacity);
                lost += 1;
            }
        }
    }
    assert_eq!((won.len(), lost), (8, 56));
    let states = s.device_states(server).await;
    assert!(
        states
            .iter()
            .all(|(_, st, _)| *st == DeviceState::Provisioning)
    );
    let mut holders: Vec<_> = states.iter().filter_map(|(_, _, u)| *u).collect();
    holders.sort();
    holders.dedup();
    assert_eq!(holders.len(), 8, "each device held by a different VM");
    let mut assigned: Vec<_> = won.iter().map(|v| v.assigned_devices[0].clone()).collect();
    assigned.sort();
    assigned.dedup();
    assert_eq!(assigned.len(), 8, "no device given twice");
    // The history agrees: one reservation per device, ever.
    let events: Vec<DeviceEventRecord> = s
        .get(&format!("/v1/servers/{server}/device-events"))
        .await
        .ok(200);
    let reserves = events
        .iter()
        .filter(|e| e.to == DeviceState::Provisioning)
        .count();
    assert_eq!(reserves, 8);
}
both!(race_for_the_last_devices_on, race_for_the_last_devices);

async fn lists_page_newest_first(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    for name in ["t1", "t2", "t3"] {
        s.tenant(name).await;
    }
    let r = s.get::<Vec<Account>>("/v1/accounts?limit=2&offset=0").await;
    assert_eq!(r.header("x-resource-count"), Some("4"));
    let logins: Vec<String> = r.ok(200).into_iter().map(|a| a.login).collect();
    assert_eq!(logins, ["t3", "t2"]);
    let rest: Vec<Account> = s.get("/v1/accounts?limit=2&offset=2").await.ok(200);
    let logins: Vec<String> = rest.into_iter().map(|a| a.login).collect();
    assert_eq!(logins, ["t1", "admin"]);
    s.get::<Vec<Account>>("/v1/accounts?limit=1001")
        .await
        .invalid("limit");
}
both!(lists_page_newest_first_on, lists_page_newest_first);

/// A node that answers a task with `?wait=N` gets its next tasks in the same answer,
/// as its long poll would: a VM is provisioned with one request per task. A result sent
/// again is refused as recorded (no poll is made for it), and a result without `wait`
/// is answered 204 as before.
async fn a_result_answer_is_the_next_poll(b: Backend) {
    use passage_model::protocol::{Task, TaskEnvelope, TaskResult};
    let s = TestServer::start(b, crate::common::fast_config()).await;
    let (_, cred, _) = s.manual_node(1).await;
    s.h100_catalog(1).await;
    let vm: Vm = s
        .post(
            "/v1/vms",
            &json!({"alias": "one-trip", "package": "gpu-1x", "image": "test-image"}),
        )
        .await
        .ok(202);
    let node = s.client(Some(&cred));
    let mut tasks: Vec<TaskEnvelope> = node.get("/agent/v1/tasks?wait=5").await.ok(200);
    let mut seen = Vec::new();
    while let Some(t) = tasks.pop() {
        assert!(tasks.is_empty(), "one task at a time for one VM: {tasks:?}");
        seen.push(t.task.name());
        let path = format!("/agent/v1/tasks/{}/result", t.id);
        if matches!(t.task, Task::StartVm { .. }) {
            // The last task: a plain answer, then the VM runs.
            node.post::<()>(&path, &TaskResult::success()).await.ok(204);
            node.post::<()>(&format!("{path}?wait=1"), &TaskResult::success())
                .await
                .fails(409, ErrorCode::Conflict);
            break;
        }
        tasks = node
            .post(&format!("{path}?wait=5"), &TaskResult::success())
            .await
            .ok(200);
    }
    assert_eq!(seen, ["bind_passthrough", "fetch_image", "start_vm"]);
    let running = crate::common::wait_for(std::time::Duration::from_secs(10), || async {
        let v: Vm = s.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
        (v.state == VmState::Running).then_some(v)
    })
    .await;
    assert!(running.is_some(), "the VM runs");
    // Nothing is left queued for the node.
    let none: Vec<TaskEnvelope> = node.get("/agent/v1/tasks?wait=0").await.ok(200);
    assert!(none.is_empty(), "{none:?}");
}
both!(
    a_result_answer_is_the_next_poll_on,
    a_result_answer_is_the_next_poll
);

/// A node answers every task it is given, successfully, polling with `query` (`wait=5`
/// and what it says it runs), until it has answered a task of kind `last`. Answers the
/// tasks in the order they came.
async fn work_until(
    node: &crate::common::Client,
    query: &str,
    last: &str,
) -> Vec<passage_model::protocol::Task> {
    use passage_model::protocol::{ScrubReport, Task, TaskEnvelope, TaskResult};
    let mut tasks: Vec<TaskEnvelope> = node.get(&format!("/agent/v1/tasks?{query}")).await.ok(200);
    let mut seen = Vec::new();
    for _ in 0..20 {
        let Some(t) = tasks.pop() else {
            tasks = node.get(&format!("/agent/v1/tasks?{query}")).await.ok(200);
            continue;
        };
        assert!(tasks.is_empty(), "one task at a time for one VM: {tasks:?}");
        seen.push(t.task.clone());
        let mut result = TaskResult::success();
        if let Task::Scrub { devices, .. } = &t.task {
            // As an agent reports a GPU's scrub: its memory zeroed and read back.
            result.scrub_reports = devices
                .iter()
                .map(|d| ScrubReport {
                    device: d.clone(),
                    ok: true,
                    steps: vec![passage_model::protocol::ScrubStep {
                        name: "zero_gpu_memory".into(),
                        ok: true,
                        duration_ms: 1,
                        detail: None,
                        skipped: false,
                    }],
                })
                .collect();
        }
        let path = format!("/agent/v1/tasks/{}/result", t.id);
        if t.task.name() == last {
            node.post::<()>(&path, &result).await.ok(204);
            return seen;
        }
        tasks = node.post(&format!("{path}?{query}"), &result).await.ok(200);
    }
    panic!("no {last} task came: {seen:?}");
}

fn names(tasks: &[passage_model::protocol::Task]) -> Vec<&'static str> {
    tasks.iter().map(|t| t.name()).collect()
}

/// A node that says it runs `boot_vm` (on its polls) gets one task for a new VM's bind,
/// disk and start, and one that says `destroy_vm` one for its stop, unbind and disk's
/// deletion; a node that says neither gets the separate tasks as before. Each way ends
/// with the VM running, every step of its job succeeded, then the VM destroyed and its
/// device scrubbed and free.
async fn a_node_that_runs_them_gets_one_task_per_boot_and_destroy(b: Backend) {
    use passage_model::api::{Job, StepState};
    use passage_model::protocol::Task;
    let s = TestServer::start(b, crate::common::fast_config()).await;
    let (server, cred, _) = s.manual_node(1).await;
    s.h100_catalog(1).await;
    let node = s.client(Some(&cred));
    let three = vec!["bind_passthrough", "fetch_image", "start_vm"];
    let four = vec!["stop_vm", "unbind_passthrough", "delete_disk", "scrub"];
    for (query, made_by, gone_by) in [
        ("wait=5", three.clone(), four.clone()),
        (
            "wait=5&runs=destroy_vm",
            three.clone(),
            vec!["destroy_vm", "scrub"],
        ),
        ("wait=5&runs=boot_vm", vec!["boot_vm"], four.clone()),
        (
            "wait=5&runs=destroy_vm,boot_vm",
            vec!["boot_vm"],
            vec!["destroy_vm", "scrub"],
        ),
        // Said on this poll: what the node said before does not stand.
        ("wait=5&runs=something_else", three.clone(), four.clone()),
    ] {
        let vm: Vm = s
            .post(
                "/v1/vms",
                &json!({"alias": "one-trip", "package": "gpu-1x", "image": "test-image"}),
            )
            .await
            .ok(202);
        let made = work_until(&node, query, made_by[made_by.len() - 1]).await;
        assert_eq!(names(&made), made_by, "{query}");
        let running = crate::common::wait_for(std::time::Duration::from_secs(10), || async {
            let v: Vm = s.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
            (v.state == VmState::Running).then_some(v)
        })
        .await;
        let held = running.expect("the VM runs").assigned_devices;
        assert_eq!(held.len(), 1, "{query}");
        for t in &made {
            if let Task::BootVm {
                vm: spec,
                vgpu_types,
            } = t
            {
                assert_eq!(spec.uuid, vm.uuid);
                assert_eq!(spec.devices, held, "{query}");
                assert_eq!(spec.disk.as_ref().map(|d| d.size_gib), Some(10), "{query}");
                assert!(spec.cloud_init.is_some(), "{query}: a seed for its image");
                assert!(vgpu_types.is_empty());
            }
        }
        let job: Job = s
            .get(&format!("/v1/jobs/{}", vm.job_uuid.unwrap()))
            .await
            .ok(200);
        let done = crate::common::wait_for(std::time::Duration::from_secs(10), || async {
            let j: Job = s.get(&format!("/v1/jobs/{}", job.uuid)).await.ok(200);
            j.steps
                .iter()
                .all(|st| st.state == StepState::Succeeded && st.ended_at.is_some())
                .then_some(j)
        })
        .await;
        let Some(done) = done else {
            panic!("{query}: every step of the provision succeeded")
        };
        // The reservation's check, written only with the next step's start, has its
        // start as every step has.
        for st in &done.steps {
            assert!(
                st.started_at.is_some() && st.started_at <= st.ended_at,
                "{query}: {st:?}"
            );
        }

        let _: Vm = s.delete(&format!("/v1/vms/{}", vm.uuid)).await.ok(202);
        let gone = work_until(&node, query, "scrub").await;
        assert_eq!(names(&gone), gone_by, "{query}");
        for t in gone.iter().filter(|t| matches!(t, Task::DestroyVm { .. })) {
            assert_eq!(
                *t,
                Task::DestroyVm {
                    vm_uuid: vm.uuid,
                    devices: held.clone(),
                    delete_disk: true,
                }
            );
        }
        let clean = crate::common::wait_for(std::time::Duration::from_secs(10), || async {
            let v: Vm = s.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
            let states = s.device_states(server).await;
            (v.state == VmState::Destroyed
                && states
                    .iter()
                    .all(|(_, st, by)| *st == DeviceState::Unassigned && by.is_none()))
            .then_some(())
        })
        .await;
        assert!(clean.is_some(), "{query}: destroyed, and the device clean");
    }
}
both!(
    a_node_that_runs_them_gets_one_task_per_boot_and_destroy_on,
    a_node_that_runs_them_gets_one_task_per_boot_and_destroy
);

/// A `boot_vm` task covers the provision's bind, fetch and launch: while it runs the three
/// steps are running (a download's progress shows on the fetch alone), and when the node
/// says it failed in its start, the failure is the launch step's, and each of the three
/// is undone, newest first (the VM stopped, its disk deleted, its device given back), as
/// they would be after their own tasks; the device, which a started VM may have touched,
/// is scrubbed before it is free again.
async fn a_failed_boot_vm_undoes_every_step_it_covered(b: Backend) {
    use passage_model::api::{Job, JobState, Progress, StepState};
    use passage_model::protocol::{Task, TaskEnvelope, TaskResult};
    let s = TestServer::start(b, crate::common::fast_config()).await;
    let (server, cred, _) = s.manual_node(1).await;
    s.h100_catalog(1).await;
    let node = s.client(Some(&cred));
    let query = "wait=5&runs=destroy_vm,boot_vm";
    let vm: Vm = s
        .post(
            "/v1/vms",
            &json!({"alias": "no-room", "package": "gpu-1x", "image": "test-image"}),
        )
        .await
        .ok(202);
    let job = vm.job_uuid.unwrap();
    let mut tasks: Vec<TaskEnvelope> = node.get(&format!("/agent/v1/tasks?{query}")).await.ok(200);
    let boot = tasks.pop().expect("a task");
    assert!(matches!(boot.task, Task::BootVm { .. }), "{boot:?}");
    let j: Job = s.get(&format!("/v1/jobs/{job}")).await.ok(200);
    let states: Vec<(&str, StepState)> = j
        .steps
        .iter()
        .map(|st| (st.name.as_str(), st.state))
        .collect();
    assert_eq!(
        states,
        [
            ("reserve", StepState::Succeeded),
            ("bind", StepState::Running),
            ("fetch_image", StepState::Running),
            ("launch", StepState::Running),
            ("mark_used", StepState::Pending),
        ]
    );
    let path = format!("/agent/v1/tasks/{}", boot.id);
    node.post::<()>(
        &format!("{path}/progress"),
        &json!({"done": 100, "total": 1000}),
    )
    .await
    .ok(204);
    let j: Job = s.get(&format!("/v1/jobs/{job}")).await.ok(200);
    for st in &j.steps {
        let want = (st.name == "fetch_image").then_some(Progress {
            done: 100,
            total: 1000,
        });
        assert_eq!(st.progress, want, "{st:?}");
    }
    let failed = TaskResult::failure("start_vm: the node has no memory left");
    node.post::<()>(&format!("{path}/result"), &failed)
        .await
        .ok(204);
    let undone = work_until(&node, query, "scrub").await;
    assert_eq!(
        names(&undone),
        ["stop_vm", "delete_disk", "unbind_passthrough", "scrub"]
    );
    let end = crate::common::wait_for(std::time::Duration::from_secs(10), || async {
        let j: Job = s.get(&format!("/v1/jobs/{job}")).await.ok(200);
        let v: Vm = s.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
        let states = s.device_states(server).await;
        (j.state == JobState::Failed
            && v.state == VmState::Failed
            && states
                .iter()
                .all(|(_, st, by)| *st == DeviceState::Unassigned && by.is_none()))
        .then_some(j)
    })
    .await;
    let j = end.expect("the job failed, the VM too, and the device is clean");
    assert!(
        j.error
            .as_deref()
            .is_some_and(|e| e.contains("start_vm: the node has no memory left")),
        "{j:?}"
    );
    for st in &j.steps[..4] {
        assert_eq!(st.state, StepState::Undone, "{st:?}");
    }
    assert_eq!(j.steps[4].state, StepState::Pending);
    // The failure is the launch's, the part the node named.
    let errors: Vec<(&str, bool)> = j
        .steps
        .iter()
        .map(|st| {
            let named = st
                .error
                .as_deref()
                .is_some_and(|e| e.contains("no memory left"));
            (st.name.as_str(), named)
        })
        .collect();
    assert_eq!(
        errors,
        [
            ("reserve", false),
            ("bind", false),
            ("fetch_image", false),
            ("launch", true),
            ("mark_used", false),
        ]
    );
    assert!(j.error.unwrap().starts_with("launch failed: "));
}
both!(
    a_failed_boot_vm_undoes_every_step_it_covered_on,
    a_failed_boot_vm_undoes_every_step_it_covered
);

/// `POST /agent/v1/tasks/results`: a node's results at once, each recorded or refused as
/// alone, and with `?wait=` the next poll's tasks in the same answer; a body out of
/// bounds records none of them.
async fn results_posted_together(b: Backend) {
    use passage_model::protocol::{
        MAX_RESULTS_PER_POST, Task, TaskEnvelope, TaskResult, TaskResultsAnswer,
    };
    let s = TestServer::start(b, crate::common::fast_config()).await;
    let (server, cred, reported) = s.manual_node(2).await;
    s.h100_catalog(1).await;
    let mut vms = Vec::new();
    for alias in ["together-a", "together-b"] {
        let vm: Vm = s
            .post(
                "/v1/vms",
                &json!({"alias": alias, "package": "gpu-1x", "image": "test-image"}),
            )
            .await
            .ok(202);
        vms.push(vm.uuid);
    }
    let node = s.client(Some(&cred));
    let mut binds: Vec<TaskEnvelope> = Vec::new();
    while binds.len() < 2 {
        let got: Vec<TaskEnvelope> = node.get("/agent/v1/tasks?wait=5").await.ok(200);
        assert!(!got.is_empty(), "both VMs' binds are queued: {binds:?}");
        binds.extend(got);
    }
    assert!(
        binds
            .iter()
            .all(|t| matches!(t.task, Task::BindPassthrough { .. })),
        "{binds:?}"
    );
    let ok = |t: &TaskEnvelope| json!({"task": t.id, "result": TaskResult::success()});
    let path = "/agent/v1/tasks/results";

    // Out of bounds, whole: nothing is recorded.
    let twice = json!({"results": [ok(&binds[0]), ok(&binds[1]), ok(&binds[0])]});
    node.post::<()>(path, &twice)
        .await
        .invalid("results[2].task");
    let bad = json!({"results": [ok(&binds[0]), {"task": binds[1].id, "result": {"ok": false,
        "error": "x".repeat(passage_model::protocol::MAX_ERROR_LEN + 1)}}]});
    node.post::<()>(path, &bad)
        .await
        .invalid("results[1].result.error");
    let many: Vec<_> = (0..=MAX_RESULTS_PER_POST)
        .map(|_| json!({"task": passage_model::TaskId::new_random(), "result": TaskResult::success()}))
        .collect();
    node.post::<()>(path, &json!({"results": many}))
        .await
        .invalid("results");

    // Both recorded, with the functions each bind changed; a function in both takes its
    // state in the later one. The answer brings each VM's next task.
    let gpus: Vec<passage_model::PciDevice> = reported
        .iter()
        .filter(|d| d.class.is_gpu_like())
        .cloned()
        .collect();
    assert_eq!(gpus.len(), 2, "{reported:?}");
    let with = |t: &TaskEnvelope, drivers: &[(usize, &str)]| {
        let mut r = TaskResult::success();
        for (i, driver) in drivers {
            let mut d = gpus[*i].clone();
            d.driver = Some(driver.to_string());
            r.devices.push(d);
        }
        json!({"task": t.id, "result": r})
    };
    let answer: TaskResultsAnswer = node
        .post(
            &format!("{path}?wait=5"),
            &json!({"results": [
                with(&binds[0], &[(0, "vfio-pci"), (1, "in-between")]),
                with(&binds[1], &[(1, "vfio-pci")]),
            ]}),
        )
        .await
        .ok(200);
    assert!(answer.refused.is_empty(), "{answer:?}");
    let rows: Vec<passage_model::api::DeviceRow> = s.get("/v1/devices").await.ok(200);
    for g in &gpus {
        let row = rows
            .iter()
            .find(|r| r.server_uuid == server && r.id == g.id)
            .unwrap_or_else(|| panic!("{} in {rows:?}", g.id));
        assert_eq!(row.driver.as_deref(), Some("vfio-pci"), "{row:?}");
    }
    let mut next = answer.tasks.expect("a poll's answer with ?wait=");
    while next.len() < 2 {
        let more: Vec<TaskEnvelope> = node.get("/agent/v1/tasks?wait=5").await.ok(200);
        assert!(
            !more.is_empty(),
            "both VMs' next tasks are queued: {next:?}"
        );
        next.extend(more);
    }
    assert!(
        next.iter()
            .all(|t| matches!(t.task, Task::FetchImage { .. })),
        "{next:?}"
    );

    // Each refused as alone: one already has a result, one is no task of this node's;
    // the third is recorded. Without `?wait=` no tasks are answered.
    let unknown = passage_model::TaskId::new_random();
    let answer: TaskResultsAnswer = node
        .post(
            path,
            &json!({"results": [ok(&binds[0]), ok(&next[0]),
            {"task": unknown, "result": TaskResult::success()}]}),
        )
        .await
        .ok(200);
    assert_eq!(answer.tasks, None);
    let refused: Vec<_> = answer
        .refused
        .iter()
        .map(|r| (r.task, r.error.code))
        .collect();
    assert_eq!(
        refused,
        [
            (binds[0].id, ErrorCode::Conflict),
            (unknown, ErrorCode::ResourceNotFound)
        ]
    );
    // Recorded: posted alone now, it is refused as having a result.
    node.post::<()>(
        &format!("/agent/v1/tasks/{}/result", next[0].id),
        &TaskResult::success(),
    )
    .await
    .fails(409, ErrorCode::Conflict);
    // Another node cannot post this node's results.
    let (_, other, _) = s.manual_node(1).await;
    let answer: TaskResultsAnswer = s
        .client(Some(&other))
        .post(path, &json!({"results": [ok(&next[1])]}))
        .await
        .ok(200);
    assert_eq!(answer.refused.len(), 1, "{answer:?}");
    assert_eq!(answer.refused[0].error.code, ErrorCode::ResourceNotFound);
}
both!(results_posted_together_on, results_posted_together);

/// The real agent loop, finding four VMs' first tasks queued when it starts, posts the
/// results of a batch together: fewer result requests than results, as `/metrics`
/// counts them, and every VM runs.
async fn an_agent_posts_a_batch_results_together(b: Backend) {
    use node_agent::agent::{AgentConfig, Credential, credential};
    use node_agent::fake::{FakeSpec, GpuModel};
    use std::time::Duration;
    let s = TestServer::start(b, fast_config()).await;
    s.h100_catalog(1).await;
    // The node registers and reports by hand, so its tasks queue before its loop runs.
    let dir = tempfile::tempdir().unwrap();
    let (sysfs, state) = (dir.path().join("sysfs"), dir.path().join("state"));
    let spec = FakeSpec {
        gpus: 4,
        model: GpuModel::H100,
        numa_nodes: 2,
    };
    node_agent::fake::generate_with(&sysfs, &spec, &Default::default()).unwrap();
    let (server_uuid, node_credential, _) = s.register_tree(&sysfs, None).await;
    let mut vms = Vec::new();
    for i in 0..4 {
        let vm: Vm = s
            .post(
                "/v1/vms",
                &json!({"alias": format!("batch-{i}"), "package": "gpu-1x", "image": "test-image"}),
            )
            .await
            .ok(202);
        vms.push(vm.uuid);
    }
    let counts = || async {
        let text = s.metrics().await;
        let read = |name: &str| -> u64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("{name} in {text}"))
        };
        (
            read("passage_agent_results_total"),
            read("passage_agent_result_posts_total"),
        )
    };
    assert_eq!(counts().await, (0, 0));
    // While creations come in, job steps start paced apart: the agent starts once all
    // four first tasks wait, or its first poll could take them one by one.
    let queued = crate::common::wait_for(Duration::from_secs(30), || async {
        (s.queued_tasks(server_uuid).await == 4).then_some(())
    })
    .await;
    assert!(queued.is_some(), "the four VMs' first tasks are queued");
    std::fs::create_dir_all(&state).unwrap();
    let cred = Credential {
        server_url: s.base.clone(),
        server_uuid,
        credential: node_credential,
    };
    credential::save(&state, &cred).unwrap();
    let cfg = AgentConfig {
        server_url: s.base.clone(),
        join_token: String::new(),
        sysfs_root: sysfs.clone(),
        state_dir: state.clone(),
        hypervisor: node_agent::hypervisor::HypervisorKind::Sim,
        heartbeat: Duration::from_secs(1),
        inventory_every: Duration::from_secs(1),
        hostname: "cn-batch".into(),
        ca_cert: None,
    };
    let agent = tokio::spawn(node_agent::agent::run(cfg));
    for vm in &vms {
        let running = crate::common::wait_for(Duration::from_secs(30), || async {
            let v: Vm = s.get(&format!("/v1/vms/{vm}")).await.ok(200);
            (v.state == VmState::Running).then_some(())
        })
        .await;
        assert!(running.is_some(), "VM {vm} runs");
    }
    agent.abort();
    let (results, posts) = counts().await;
    // Each VM: bind, fetch_image and start_vm, or boot_vm alone once the node has said
    // on a poll that it runs it (the four binds, queued before, came in one batch).
    assert!(results >= 4, "{results} results");
    assert!(posts < results, "{posts} posts for {results} results");
}
both!(
    an_agent_posts_a_batch_results_together_on,
    an_agent_posts_a_batch_results_together
);
