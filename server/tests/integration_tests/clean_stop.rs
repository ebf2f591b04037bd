//! A clean stop, a reboot and a deletion during provisioning, through the real agent
//! loop over fake trees (the sim hypervisor, whose guests shut down at once when asked).
//! Real guests are in `guest_power`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config, wait_for};
use passage_model::api::{Job, JobState, Package, Vm, VmState};
use passage_model::networks::{Network, NetworkIp};
use passage_model::protocol::{Shutdown, TASKS_RUN, Task, TaskEnvelope, TaskResult};
use passage_model::{DeviceState, ErrorCode};
use serde_json::{Value, json};
use std::time::Duration;

/// The job `vm`'s answer names, once it has ended, as it must: succeeded.
async fn succeeded(s: &TestServer, vm: &Vm) -> Job {
    let job = s.wait_job(vm.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    job
}

/// The `stop` step's detail of a stop or reboot job.
fn stop_detail(job: &Job) -> Option<&str> {
    let step = job.steps.iter().find(|s| s.name == "stop").unwrap();
    step.detail.as_deref()
}

async fn stops_and_reboots(b: Backend) {
    let mut s = TestServer::start(b, fast_config()).await;
    let node = s.add_node(2).await;
    s.h100_catalog(1).await;
    let (_, token) = s.tenant("t").await;
    let c = s.with(&token);
    let vm: Vm = c
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias": "v", "package": "gpu-1x"}),
        )
        .await
        .ok(202);
    succeeded(&s, &vm).await;
    let path = format!("/v1/vms/{}", vm.uuid);
    let running = vec![vm.uuid.to_string()];

    // A clean stop: `stopping` from the answer on; the step says the guest shut down.
    let v: Vm = c.post_empty(&format!("{path}/stop")).await.ok(202);
    assert_eq!(v.state, VmState::Stopping);
    let job = succeeded(&s, &v).await;
    assert_eq!(job.name, "stop");
    assert_eq!(stop_detail(&job), Some("guest shut down after 0 s"));
    let v: Vm = c.get(&path).await.ok(200);
    assert_eq!(v.state, VmState::Stopped);
    assert!(node.running_vms().is_empty());
    // Neither a stop nor a reboot of a stopped VM.
    for what in ["stop", "reboot"] {
        c.post_empty::<Vm>(&format!("{path}/{what}"))
            .await
            .fails(409, ErrorCode::InvalidState);
    }
    // A body is checked before anything else.
    c.post::<Vm>(&format!("{path}/stop"), &json!({"forse": true}))
        .await
        .invalid("forse");

    // A forced stop: a power cut, said so.
    let v: Vm = c.post_empty(&format!("{path}/start")).await.ok(202);
    succeeded(&s, &v).await;
    assert_eq!(node.running_vms(), running);
    let v: Vm = c
        .post(&format!("{path}/stop"), &json!({"force": true}))
        .await
        .ok(202);
    assert_eq!(v.state, VmState::Stopping);
    let job = succeeded(&s, &v).await;
    assert_eq!(stop_detail(&job), Some("forced power off"));
    assert!(node.running_vms().is_empty());

    // A reboot through /v1: one job, a clean stop then a start.
    let v: Vm = c.post_empty(&format!("{path}/start")).await.ok(202);
    succeeded(&s, &v).await;
    let v: Vm = c.post_empty(&format!("{path}/reboot")).await.ok(202);
    assert_eq!(v.state, VmState::Stopping);
    let job = succeeded(&s, &v).await;
    assert_eq!(job.name, "reboot");
    let steps: Vec<(&str, JobState)> = job
        .steps
        .iter()
        .map(|s| (s.name.as_str(), job_state(s.state)))
        .collect();
    assert_eq!(
        steps,
        [
            ("stop", JobState::Succeeded),
            ("start", JobState::Succeeded)
        ]
    );
    assert_eq!(stop_detail(&job), Some("guest shut down after 0 s"));
    let v: Vm = c.get(&path).await.ok(200);
    assert_eq!(v.state, VmState::Running);
    assert_eq!(node.running_vms(), running);
    // Forced: a reset.
    let v: Vm = c
        .post(&format!("{path}/reboot"), &json!({"force": true}))
        .await
        .ok(202);
    let job = succeeded(&s, &v).await;
    assert_eq!(stop_detail(&job), Some("forced power off"));
    let v: Vm = c.get(&path).await.ok(200);
    assert_eq!(v.state, VmState::Running);
    assert_eq!(node.running_vms(), running);
    // Another tenant's VM is not there to reboot.
    let (_, other) = s.tenant("u").await;
    s.with(&other)
        .post_empty::<Vm>(&format!("{path}/reboot"))
        .await
        .fails(404, ErrorCode::ResourceNotFound);
}
both!(stops_and_reboots, stops_and_reboots);

fn job_state(s: passage_model::api::StepState) -> JobState {
    match s {
        passage_model::api::StepState::Succeeded => JobState::Succeeded,
        passage_model::api::StepState::Running => JobState::Running,
        _ => JobState::Failed,
    }
}

/// A package's grace for its guests is its own, at most the server's limit; the shutdown
/// task a node gets carries it.
async fn grace_from_the_package(b: Backend) {
    let cfg = passage_server::config::Config {
        stop_grace_max: Duration::from_secs(90),
        ..fast_config()
    };
    let mut s = TestServer::start(b, cfg).await;
    // A stopped VM keeps its GPU: one each.
    let _node = s.add_node(3).await;
    s.h100_catalog(1).await;
    for (name, grace) in [("patient", Some(120)), ("quick", Some(5)), ("plain", None)] {
        let mut body = json!({"name": name, "vcpus": 1, "memory_mib": 512,
                              "devices": {"NVIDIA_H100": 1}});
        if let Some(g) = grace {
            body["stop_grace_s"] = json!(g);
        }
        let p: Package = s.post("/v1/packages", &body).await.ok(201);
        assert_eq!(p.stop_grace_s, grace);
    }
    s.post::<Package>(
        "/v1/packages",
        &json!({"name": "forever", "vcpus": 1, "memory_mib": 512, "stop_grace_s": 3601}),
    )
    .await
    .invalid("stop_grace_s");
    let (_, token) = s.tenant("t").await;
    let c = s.with(&token);
    for (package, want) in [("patient", 90), ("quick", 5), ("plain", 60)] {
        let vm: Vm = c
            .post(
                "/v1/vms",
                &json!({"image": "test-image", "alias": package, "package": package}),
            )
            .await
            .ok(202);
        succeeded(&s, &vm).await;
        let v: Vm = c
            .post_empty(&format!("/v1/vms/{}/stop", vm.uuid))
            .await
            .ok(202);
        succeeded(&s, &v).await;
        let task = shutdown_task(&s, v.job_uuid.unwrap()).await;
        assert_eq!(task["grace_s"], want, "{package}: {task}");
        assert_eq!(task["vm_uuid"], vm.uuid.to_string());
    }
}
both!(grace_from_the_package, grace_from_the_package);

/// The `shutdown_vm` task of `job`, as the node got it.
async fn shutdown_task(s: &TestServer, job: passage_model::JobId) -> Value {
    let sql = "SELECT payload FROM tasks WHERE job_uuid = $1 AND kind = 'shutdown_vm'";
    let payload: String = match &s.ctx.db {
        passage_server::store::Db::Sqlite { read, .. } => sqlx::query_scalar(sql)
            .bind(job.to_string())
            .fetch_one(read)
            .await
            .unwrap(),
        passage_server::store::Db::Postgres(p) => sqlx::query_scalar(sql)
            .bind(job.to_string())
            .fetch_one(p)
            .await
            .unwrap(),
    };
    serde_json::from_str(&payload).unwrap()
}

/// `DELETE` of a VM still provisioning is accepted, twice: the provision stops at its
/// next step and unwinds, and the VM is destroyed like any other, its GPU scrubbed and
/// its address given back.
async fn delete_while_provisioning(b: Backend) {
    let cfg = passage_server::config::Config {
        // A task handed to the agent as it was stopped goes out again soon.
        task_redeliver_after: Duration::from_secs(2),
        ..fast_config()
    };
    let mut s = TestServer::start(b, cfg).await;
    let node = s.add_node(2).await;
    s.h100_catalog(1).await;
    let net: Network = s
        .post(
            "/v1/networks",
            &json!({"name": "lan", "subnet": "10.9.0.0/24", "gateway": "10.9.0.1",
                    "provision_start_ip": "10.9.0.10", "provision_end_ip": "10.9.0.20",
                    "bridge": "br0", "public": true, "default": true}),
        )
        .await
        .ok(201);
    let (_, token) = s.tenant("t").await;
    let c = s.with(&token);

    // The node's agent away: the provision waits at its first node step.
    s.pause_agents();
    let vm: Vm = c
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias": "v", "package": "gpu-1x"}),
        )
        .await
        .ok(202);
    assert_eq!(vm.state, VmState::Provisioning);
    assert!(vm.primary_ip.is_some());
    let path = format!("/v1/vms/{}", vm.uuid);
    wait_for(Duration::from_secs(20), || async {
        let j: Job = c
            .get(&format!("/v1/jobs/{}", vm.job_uuid.unwrap()))
            .await
            .ok(200);
        (j.steps[1].state == passage_model::api::StepState::Running).then_some(())
    })
    .await
    .expect("the provision reached its bind");
    let v: Vm = c.delete(&path).await.ok(202);
    assert_eq!(v.state, VmState::Destroying);
    // Asked again meanwhile: the same deletion, under way.
    let again: Vm = c.delete(&path).await.ok(202);
    assert_eq!(again.state, VmState::Destroying);

    // The agent back: the bind (with the launch: one task) ends, the next step stops.
    s.resume_agent(&node).await;
    let destroyed = wait_for(Duration::from_secs(60), || async {
        let v: Vm = c.get(&path).await.ok(200);
        (v.state == VmState::Destroyed).then_some(v)
    })
    .await;
    assert!(destroyed.is_some(), "{:?}", c.get::<Vm>(&path).await);
    let provision: Job = c
        .get(&format!("/v1/jobs/{}", vm.job_uuid.unwrap()))
        .await
        .ok(200);
    assert_eq!(provision.state, JobState::Failed);
    assert!(
        provision.error.as_deref().unwrap().contains("cancelled"),
        "{provision:?}"
    );
    let jobs: Vec<Job> = s.get("/v1/jobs").await.ok(200);
    let destroy = jobs
        .iter()
        .find(|j| j.name == "destroy" && j.vm_uuid == Some(vm.uuid))
        .expect("a destroy job");
    assert_eq!(destroy.state, JobState::Succeeded, "{destroy:?}");
    assert!(node.running_vms().is_empty());

    // Its GPU was in a launched VM: scrubbed before it is free again.
    let free = wait_for(Duration::from_secs(30), || async {
        let st = s.device_states(node.uuid).await;
        st.iter()
            .all(|(_, st, _)| *st == DeviceState::Unassigned)
            .then_some(())
    })
    .await;
    assert!(free.is_some(), "{:?}", s.device_states(node.uuid).await);
    let used = &vm.assigned_devices[0];
    let history: Vec<passage_model::api::DeviceEventRecord> = s
        .get(&format!(
            "/v1/servers/{}/device-events?device={used}",
            node.uuid
        ))
        .await
        .ok(200);
    assert!(
        history.iter().any(|e| e.to == DeviceState::Cleaning),
        "scrubbed: {history:?}"
    );
    assert_eq!(node.driver_of(&used.to_string()).as_deref(), Some("nvidia"));
    // Its address is free for the next VM.
    let held: Vec<NetworkIp> = s
        .get(&format!("/v1/networks/{}/ips", net.uuid))
        .await
        .ok(200);
    assert!(held.is_empty(), "{held:?}");
    let next: Vm = c
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias": "w", "package": "gpu-1x",
                    "networks": [{"ipv4_uuid": "lan", "ipv4_ips": [vm.primary_ip.unwrap().to_string()]}]}),
        )
        .await
        .ok(202);
    assert_eq!(next.primary_ip, vm.primary_ip);
    succeeded(&s, &next).await;
}
both!(delete_while_provisioning, delete_while_provisioning);

/// A node answering by hand, polling as an agent that runs the later task kinds `runs`:
/// answers each task it gets with `answer`'s result until one of kind `last` is
/// answered; the kinds it got, in order.
async fn answer_until(
    node: &crate::common::Client,
    runs: &str,
    last: &str,
    answer: impl Fn(&Task) -> TaskResult,
) -> Vec<&'static str> {
    let query = format!("wait=5&runs={runs}");
    let mut seen = Vec::new();
    for _ in 0..20 {
        let tasks: Vec<TaskEnvelope> = node.get(&format!("/agent/v1/tasks?{query}")).await.ok(200);
        for t in tasks {
            seen.push(t.task.name());
            let path = format!("/agent/v1/tasks/{}/result", t.id);
            node.post::<()>(&path, &answer(&t.task)).await.ok(204);
            if t.task.name() == last {
                return seen;
            }
        }
    }
    panic!("no {last} task came: {seen:?}");
}

/// An agent that does not say it runs `shutdown_vm` (one older than clean stops) gets
/// the power cut it always got, and the step says why; one that does gets the guest's
/// grace, and its word on how the guest ended is the step's.
async fn older_and_newer_agents(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let (_, cred, _) = s.manual_node(1).await;
    s.h100_catalog(1).await;
    let node = s.client(Some(&cred));
    let vm: Vm = s
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias": "v", "package": "gpu-1x"}),
        )
        .await
        .ok(202);
    let ok = |_: &Task| TaskResult::success();
    let old = "destroy_vm,boot_vm";
    assert_eq!(answer_until(&node, old, "boot_vm", ok).await, ["boot_vm"]);
    succeeded(&s, &vm).await;
    let path = format!("/v1/vms/{}", vm.uuid);

    let v: Vm = s
        .as_admin()
        .post_empty(&format!("{path}/stop"))
        .await
        .ok(202);
    assert_eq!(answer_until(&node, old, "stop_vm", ok).await, ["stop_vm"]);
    let job = succeeded(&s, &v).await;
    assert_eq!(
        stop_detail(&job),
        Some("powered off: the node's agent is too old to ask the guest to shut down")
    );

    // A newer agent: the guest did not go within its grace.
    let v: Vm = s
        .as_admin()
        .post_empty(&format!("{path}/start"))
        .await
        .ok(202);
    answer_until(&node, TASKS_RUN, "boot_vm", ok).await;
    succeeded(&s, &v).await;
    let v: Vm = s
        .as_admin()
        .post_empty(&format!("{path}/stop"))
        .await
        .ok(202);
    let timed_out = |t: &Task| match t {
        Task::ShutdownVm { grace_s, .. } => TaskResult {
            shutdown: Some(Shutdown::TimedOut { grace_s: *grace_s }),
            ..TaskResult::success()
        },
        _ => TaskResult::success(),
    };
    let got = answer_until(&node, TASKS_RUN, "shutdown_vm", timed_out).await;
    assert_eq!(got, ["shutdown_vm"]);
    let job = succeeded(&s, &v).await;
    assert_eq!(
        stop_detail(&job),
        Some("guest did not shut down within 60 s: powered off")
    );
    let v: Vm = s.get(&path).await.ok(200);
    assert_eq!(v.state, VmState::Stopped);
}
both!(older_and_newer_agents, older_and_newer_agents);
