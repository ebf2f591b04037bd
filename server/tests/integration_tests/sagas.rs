//! Every workflow, the omicron way, through the real agent loop over fake sysfs trees:
//! each action (and each undo) run twice succeeds and changes nothing more; a failure
//! injected after each step unwinds to what the workflow promises; unwinding again,
//! twice, changes nothing. The scenarios are one exhaustive `match` over the job kinds,
//! so a new workflow does not compile until it has one here.

use crate::common::{Backend, Node, TestServer, fast_config, wait_for};
use passage_model::api::{DeviceEventRecord, Job, JobState, StepState, Vm, VmState};
use passage_model::jobs::JobKind;
use passage_model::{AccountId, DevicePath, DeviceState, JobId, ServerId, VmId};
use passage_server::config::Config;
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;

/// A fleet brought to where a job of one kind starts, and that job.
struct Scenario {
    s: TestServer,
    nodes: Vec<Node>,
    tenant: AccountId,
    /// The VM the job works on (none for a scrub).
    vm: Option<VmId>,
    /// The fleet just before the job was asked for.
    before: Snapshot,
    job: JobId,
}

/// A device as a snapshot keeps it: id, state, holder, driver.
type DeviceLine = (DevicePath, DeviceState, Option<VmId>, Option<String>);

/// What a job may change, fleet-wide.
#[derive(Debug, PartialEq, Clone)]
struct Snapshot {
    /// Per node, its devices.
    devices: Vec<Vec<DeviceLine>>,
    /// Per node: the VMs it runs.
    running: Vec<Vec<String>>,
    /// Every VM: (uuid, state, server, devices).
    vms: Vec<(VmId, VmState, Option<ServerId>, Vec<DevicePath>)>,
    /// Devices charged to the tenant's quota.
    held: i64,
}

async fn snapshot(s: &TestServer, nodes: &[Node], tenant: AccountId) -> Snapshot {
    let mut devices = Vec::new();
    let mut running = Vec::new();
    for n in nodes {
        let states = s.device_states(n.uuid).await;
        devices.push(
            states
                .into_iter()
                .map(|(id, st, by)| {
                    let driver = n.driver_of(&id.to_string());
                    (id, st, by, driver)
                })
                .collect(),
        );
        let mut r = n.running_vms();
        r.sort();
        running.push(r);
    }
    let mut vms: Vec<Vm> = s.get("/v1/vms").await.ok(200);
    vms.sort_by_key(|v| v.uuid);
    let vms = vms
        .into_iter()
        .map(|mut v| {
            v.assigned_devices.sort();
            (v.uuid, v.state, v.server_uuid, v.assigned_devices)
        })
        .collect();
    let held = passage_server::store::accounts::gpu_held(&s.ctx.db, tenant)
        .await
        .unwrap();
    Snapshot {
        devices,
        running,
        vms,
        held,
    }
}

async fn vm(s: &TestServer, uuid: VmId) -> Vm {
    s.get(&format!("/v1/vms/{uuid}")).await.ok(200)
}

/// Waits until nothing is being scrubbed or run.
async fn settle(s: &TestServer, nodes: &[Node]) {
    wait_for(Duration::from_secs(60), || async {
        for n in nodes {
            if s.device_states(n.uuid).await.iter().any(|(_, st, _)| {
                matches!(
                    st,
                    DeviceState::Dirty | DeviceState::Cleaning | DeviceState::Provisioning
                )
            }) {
                return None;
            }
        }
        let jobs: Vec<Job> = s.get("/v1/jobs").await.ok(200);
        jobs.iter()
            .all(|j| matches!(j.state, JobState::Succeeded | JobState::Failed))
            .then_some(())
    })
    .await
    .expect("the fleet settled");
}

/// What must hold of any settled fleet: held devices belong to live VMs that list them
/// and stay bound for passthrough, quota counts exactly what is held, nodes run exactly
/// the running VMs.
fn invariants(snap: &Snapshot, nodes: &[Node], what: &str) {
    let mut held = 0;
    for (n, devs) in nodes.iter().zip(&snap.devices) {
        for (id, st, by, driver) in devs {
            assert!(
                !matches!(
                    st,
                    DeviceState::Provisioning | DeviceState::Cleaning | DeviceState::Dirty
                ),
                "{what}: {id} is {st} once settled"
            );
            if let Some(by) = by {
                held += 1;
                assert_eq!(*st, DeviceState::Used, "{what}: {id} held in state {st}");
                let vm = snap.vms.iter().find(|v| &v.0 == by).unwrap();
                assert!(
                    matches!(vm.1, VmState::Running | VmState::Stopped),
                    "{what}: {id} held by a VM in state {:?}",
                    vm.1
                );
                assert_eq!(vm.2, Some(n.uuid), "{what}");
                assert!(vm.3.contains(id), "{what}: {by} does not list {id}");
                assert_eq!(
                    driver.as_deref(),
                    Some("vfio-pci"),
                    "{what}: {id}, held by {by}, is not bound for passthrough"
                );
            }
        }
    }
    assert_eq!(snap.held, held, "{what}: quota charged for what is held");
    for (n, running) in nodes.iter().zip(&snap.running) {
        let mut want: Vec<String> = snap
            .vms
            .iter()
            .filter(|v| v.1 == VmState::Running && v.2 == Some(n.uuid))
            .map(|v| v.0.to_string())
            .collect();
        want.sort();
        assert_eq!(running, &want, "{what}: the node runs the running VMs");
    }
}

async fn create_running(s: &TestServer, token: &str, package: &str) -> Vm {
    let v: Vm = s
        .with(token)
        .post(
            "/v1/vms",
            &json!({"image": "test-image", "alias": "saga", "package": package}),
        )
        .await
        .ok(202);
    let j = s.wait_job(v.job_uuid.unwrap()).await;
    assert_eq!(j.state, JobState::Succeeded, "{j:?}");
    v
}

async fn stop(s: &TestServer, token: &str, uuid: VmId) {
    let v: Vm = s
        .with(token)
        .post_empty(&format!("/v1/vms/{uuid}/stop"))
        .await
        .ok(202);
    let j = s.wait_job(v.job_uuid.unwrap()).await;
    assert_eq!(j.state, JobState::Succeeded, "{j:?}");
}

/// A fresh fleet brought to where a job of `kind` starts, and the job asked for.
async fn scenario(b: Backend, kind: JobKind, cfg: Config) -> Scenario {
    let mut s = TestServer::start(b, cfg).await;
    let mut nodes = vec![s.add_node(3).await];
    s.h100_catalog(1).await;
    s.h100_catalog(2).await;
    let (tenant, token) = s.tenant("t").await;
    let vm = match kind {
        JobKind::Provision | JobKind::Scrub => None,
        JobKind::Destroy | JobKind::Stop | JobKind::Reboot => {
            Some(create_running(&s, &token, "gpu-1x").await)
        }
        JobKind::Start | JobKind::Resize | JobKind::Migrate => {
            let v = create_running(&s, &token, "gpu-1x").await;
            stop(&s, &token, v.uuid).await;
            if kind == JobKind::Migrate {
                // Only a VM without a boot disk (made before images) may move.
                s.forget_image(v.uuid).await;
            }
            Some(v)
        }
    };
    // The migration's target joins once the VM is placed: pack would have chosen it.
    if kind == JobKind::Migrate {
        nodes.push(s.add_node(2).await);
    }
    let uuid = vm.as_ref().map(|v| v.uuid);
    let node0 = nodes[0].uuid;
    // A device an operator took out of service, to be requeued through a scrub.
    let free = s.device_states(node0).await[0].0.clone();
    let action = |action: &str| json!({"device": free, "action": action, "reason": "test"});
    let actions = format!("/v1/servers/{node0}/device-actions");
    if kind == JobKind::Scrub {
        let _: Vec<DeviceEventRecord> = s.post(&actions, &action("quarantine")).await.ok(200);
    }
    let before = snapshot(&s, &nodes, tenant).await;
    let on_vm = |path: &str| format!("/v1/vms/{}{path}", uuid.unwrap());
    let as_tenant = s.with(&token);
    let asked: Vm = match kind {
        JobKind::Provision => as_tenant
            .post(
                "/v1/vms",
                &json!({"image": "test-image", "alias": "saga", "package": "gpu-1x"}),
            )
            .await
            .ok(202),
        JobKind::Destroy => as_tenant.delete(&on_vm("")).await.ok(202),
        JobKind::Stop => as_tenant.post_empty(&on_vm("/stop")).await.ok(202),
        JobKind::Reboot => as_tenant.post_empty(&on_vm("/reboot")).await.ok(202),
        JobKind::Start => as_tenant.post_empty(&on_vm("/start")).await.ok(202),
        JobKind::Resize => as_tenant
            .post(&on_vm("/resize"), &json!({"package": "gpu-2x"}))
            .await
            .ok(202),
        JobKind::Migrate => s
            .post(&on_vm("/migrate"), &json!({"server_uuid": nodes[1].uuid}))
            .await
            .ok(202),
        JobKind::Scrub => {
            let _: Vec<DeviceEventRecord> = s.post(&actions, &action("requeue")).await.ok(200);
            let jobs: Vec<Job> = s.get("/v1/jobs").await.ok(200);
            let job = jobs.iter().find(|j| j.name == "scrub").unwrap().uuid;
            // No VM: the job is all there is to follow.
            return Scenario {
                s,
                nodes,
                tenant,
                vm: None,
                before,
                job,
            };
        }
    };
    Scenario {
        job: asked.job_uuid.unwrap(),
        s,
        nodes,
        tenant,
        vm: uuid,
        before,
    }
}

/// The VM a provision made (the one VM that was not there before), or the scenario's.
fn the_vm(sc: &Scenario, after: &Snapshot) -> VmId {
    after
        .vms
        .iter()
        .find(|v| !sc.before.vms.iter().any(|b| b.0 == v.0))
        .map(|v| v.0)
        .or(sc.vm)
        .unwrap()
}

/// How many devices of the fleet are in each state.
fn states(snap: &Snapshot) -> BTreeMap<DeviceState, usize> {
    let mut m = BTreeMap::new();
    for d in snap.devices.iter().flatten() {
        *m.entry(d.1).or_default() += 1;
    }
    m
}

/// What a job of `kind` leaves when it succeeds.
async fn check_succeeded(sc: &Scenario, kind: JobKind, after: &Snapshot) {
    let what = format!("{kind} succeeded");
    match kind {
        JobKind::Provision => {
            let v = vm(&sc.s, the_vm(sc, after)).await;
            assert_eq!(v.state, VmState::Running, "{what}");
            assert_eq!(after.held, 1, "{what}");
        }
        JobKind::Destroy => {
            let v = vm(&sc.s, the_vm(sc, after)).await;
            assert_eq!(v.state, VmState::Destroyed, "{what}");
            assert_eq!(
                states(after).get(&DeviceState::Unassigned),
                Some(&3),
                "{what}"
            );
        }
        JobKind::Stop | JobKind::Start | JobKind::Reboot => {
            let v = vm(&sc.s, the_vm(sc, after)).await;
            let want = if kind == JobKind::Stop {
                VmState::Stopped
            } else {
                VmState::Running
            };
            assert_eq!(v.state, want, "{what}");
            assert_eq!(after.held, 1, "{what}");
        }
        JobKind::Resize => {
            let v = vm(&sc.s, the_vm(sc, after)).await;
            assert_eq!(v.assigned_devices.len(), 2, "{what}");
            assert_eq!(after.held, 2, "{what}");
        }
        JobKind::Migrate => {
            let v = vm(&sc.s, the_vm(sc, after)).await;
            assert_eq!(v.server_uuid, Some(sc.nodes[1].uuid), "{what}");
            assert_eq!(after.held, 1, "{what}");
        }
        JobKind::Scrub => {
            assert_eq!(
                states(after).get(&DeviceState::Unassigned),
                Some(&3),
                "{what}"
            );
        }
    }
}

/// What a job of `kind` leaves when a failure is injected after `step`.
async fn check_failed(sc: &Scenario, kind: JobKind, step: &str, after: &Snapshot) {
    let what = format!("{kind} failing after {step}");
    let unchanged = |a: &Snapshot| {
        assert_eq!(a.devices, sc.before.devices, "{what}: devices");
        assert_eq!(a.running, sc.before.running, "{what}: running");
        assert_eq!(a.held, sc.before.held, "{what}: quota");
    };
    match (kind, step) {
        // Everything undone; the VM stays, failed.
        (JobKind::Provision, _) => {
            unchanged(after);
            let v = vm(&sc.s, the_vm(sc, after)).await;
            assert_eq!(v.state, VmState::Failed, "{what}");
        }
        // Before the release the VM's fate on the node is unknown: it is failed and its
        // device quarantined; after, it is gone and its device scrubbed.
        (JobKind::Destroy, "stop" | "unbind" | "delete_disk") => {
            let v = vm(&sc.s, the_vm(sc, after)).await;
            assert_eq!(v.state, VmState::Failed, "{what}");
            assert_eq!(
                states(after).get(&DeviceState::Quarantined),
                Some(&1),
                "{what}"
            );
        }
        (JobKind::Destroy, _) => {
            let v = vm(&sc.s, the_vm(sc, after)).await;
            assert_eq!(v.state, VmState::Destroyed, "{what}");
            assert_eq!(
                states(after).get(&DeviceState::Unassigned),
                Some(&3),
                "{what}"
            );
        }
        // Forward only: the VM was stopped before the failure.
        (JobKind::Stop, _) => {
            let v = vm(&sc.s, the_vm(sc, after)).await;
            assert_eq!(v.state, VmState::Stopped, "{what}");
            assert_eq!(after.held, 1, "{what}");
        }
        // A reboot that failed after its stop, or whose start was undone: the VM is
        // stopped, its device still its own.
        (JobKind::Reboot, _) => {
            let v = vm(&sc.s, the_vm(sc, after)).await;
            assert_eq!(v.state, VmState::Stopped, "{what}");
            assert_eq!(after.held, 1, "{what}");
        }
        // A launched VM stopped again: as before.
        (JobKind::Start, _) => {
            unchanged(after);
            assert_eq!(after.vms, sc.before.vms, "{what}");
        }
        // Before the commit, the new devices are given back: as before.
        (JobKind::Resize | JobKind::Migrate, "reserve" | "bind") => {
            unchanged(after);
            assert_eq!(after.vms, sc.before.vms, "{what}");
        }
        // After it, the VM has its new devices; the old ones are scrubbed.
        (JobKind::Resize, _) => {
            let v = vm(&sc.s, the_vm(sc, after)).await;
            assert_eq!(v.assigned_devices.len(), 2, "{what}");
            assert_eq!(after.held, 2, "{what}");
        }
        (JobKind::Migrate, _) => {
            let v = vm(&sc.s, the_vm(sc, after)).await;
            assert_eq!(v.server_uuid, Some(sc.nodes[1].uuid), "{what}");
            assert_eq!(after.held, 1, "{what}");
        }
        // Forward only: the scrub had succeeded.
        (JobKind::Scrub, _) => {
            assert_eq!(
                states(after).get(&DeviceState::Unassigned),
                Some(&3),
                "{what}"
            );
        }
    }
}

fn saga_config() -> Config {
    Config {
        // Devices a failure left dirty are scrubbed by the reconciler within the test.
        scrub_grace: Duration::from_secs(1),
        ..fast_config()
    }
}

/// Every step of `kind`: a failure injected after it, then two more unwinds.
async fn faults(b: Backend, kind: JobKind) {
    for step in kind.step_names() {
        let mut cfg = saga_config();
        cfg.faults = vec![format!("{kind}.{step}")];
        let sc = scenario(b, kind, cfg).await;
        let j = sc.s.wait_job(sc.job).await;
        let what = format!("{kind} failing after {step}");
        assert_eq!(j.state, JobState::Failed, "{what}: {j:?}");
        assert!(
            j.error
                .as_deref()
                .unwrap()
                .contains(&format!("injected fault at {kind}.{step}")),
            "{what}: {j:?}"
        );
        for st in &j.steps {
            if st.started_at.is_some() {
                assert_eq!(st.state, StepState::Undone, "{what}: {st:?}");
            }
        }
        settle(&sc.s, &sc.nodes).await;
        let after = snapshot(&sc.s, &sc.nodes, sc.tenant).await;
        invariants(&after, &sc.nodes, &what);
        sc.s.assert_free_index_exact(&what).await;
        check_failed(&sc, kind, step, &after).await;
        // Unwinding again, twice, changes nothing.
        for _ in 0..2 {
            let errors = passage_server::workflows::unwind(&sc.s.ctx, sc.job)
                .await
                .unwrap();
            assert!(errors.is_empty(), "{what}: {errors:?}");
            settle(&sc.s, &sc.nodes).await;
            assert_eq!(
                snapshot(&sc.s, &sc.nodes, sc.tenant).await,
                after,
                "{what}: a second unwind changed something"
            );
        }
        sc.s.ctx.db.close().await;
    }
}

/// Every action and every undo of every job on the way runs twice: each job still ends
/// as it would have, and no device records a change twice.
async fn twice(b: Backend, kind: JobKind) {
    let mut cfg = saga_config();
    cfg.repeat_steps = true;
    let sc = scenario(b, kind, cfg).await;
    let j = sc.s.wait_job(sc.job).await;
    assert_eq!(j.state, JobState::Succeeded, "{kind} run twice: {j:?}");
    settle(&sc.s, &sc.nodes).await;
    let after = snapshot(&sc.s, &sc.nodes, sc.tenant).await;
    invariants(&after, &sc.nodes, &format!("{kind} run twice"));
    sc.s.assert_free_index_exact(&format!("{kind} run twice"))
        .await;
    check_succeeded(&sc, kind, &after).await;
    for n in &sc.nodes {
        let events: Vec<DeviceEventRecord> =
            sc.s.get(&format!("/v1/servers/{}/device-events", n.uuid))
                .await
                .ok(200);
        let mut by_device: BTreeMap<DevicePath, Vec<(DeviceState, DeviceState)>> = BTreeMap::new();
        for e in events {
            by_device.entry(e.device).or_default().push((e.from, e.to));
        }
        for (d, moves) in by_device {
            for w in moves.windows(2) {
                assert_ne!(w[0], w[1], "{kind} run twice: {d} moved twice: {moves:?}");
            }
        }
    }
    sc.s.ctx.db.close().await;
}

macro_rules! sagas {
    ($($name:ident => $kind:expr),* $(,)?) => {
        $(
            mod $name {
                use super::*;
                async fn faults_of(b: Backend) {
                    faults(b, $kind).await
                }
                async fn twice_of(b: Backend) {
                    twice(b, $kind).await
                }
                both!(fault_after_each_step, faults_of);
                both!(every_step_twice, twice_of);
            }
        )*
    };
}

sagas! {
    provision => JobKind::Provision,
    destroy => JobKind::Destroy,
    scrub => JobKind::Scrub,
    stop => JobKind::Stop,
    start => JobKind::Start,
    resize => JobKind::Resize,
    migrate => JobKind::Migrate,
    reboot => JobKind::Reboot,
}

/// Each kind has its tests above: a kind added without them fails here.
#[test]
fn every_kind_is_covered() {
    let covered = [
        JobKind::Provision,
        JobKind::Destroy,
        JobKind::Scrub,
        JobKind::Stop,
        JobKind::Start,
        JobKind::Resize,
        JobKind::Migrate,
        JobKind::Reboot,
    ];
    assert_eq!(covered, JobKind::ALL);
}
