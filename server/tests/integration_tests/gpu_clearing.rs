//! A GPU goes back to the pool only once its memory was zeroed and read back as zero:
//! the real `server` and `node-agent` binaries over a generated tree, whose stand-in
//! zeroing helper clears a file standing for each GPU's memory and takes injected faults.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::e2e::{login, start_server};
use crate::common::{Backend, Client, Proc, TestDb, agent_command, node_agent_bin, wait_for};
use node_agent::fake::{FakeFault, gpu_memory, set_fault};
use passage_model::api::{
    AuditEntry, DeviceRow, JoinToken, Package, ScrubRecord, Server, Vm, VmState,
};
use passage_model::variant::ScrubPolicy;
use passage_model::{DeviceState, ServerId, Variant};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

struct Fleet {
    _server: Proc,
    _agent: Proc,
    op: Client,
    tenant: Client,
    node: ServerId,
    sysfs: PathBuf,
}

/// A server, and a node `cn-7` with `gpus` H100s over a generated tree, the H100
/// variant, a one-GPU package and a tenant.
async fn fleet(db: &TestDb, gpus: u32) -> Fleet {
    let (server, base) = start_server(db, &[]);
    let op = Client::at(
        &base,
        Some(&login(&base, "admin", "e2e-admin-password").await),
    );
    let jt: JoinToken = op.post_empty("/v1/servers/join-tokens").await.ok(201);
    let sysfs = db.dir.path().join("sysfs");
    let out = Command::new(node_agent_bin())
        .args(["fake-sysfs", "--out"])
        .arg(&sysfs)
        .args(["--gpus", &gpus.to_string(), "--model", "h100"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let agent = Proc(
        agent_command(&base, &jt.token, &sysfs, &db.dir.path().join("agent-state"))
            .args(["--hypervisor", "sim", "--hostname", "cn-7"])
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap(),
    );
    let node = wait_for(Duration::from_secs(30), || async {
        let list: Vec<Server> = op.get("/v1/servers").await.ok(200);
        let s = list.into_iter().next()?;
        (s.sysinfo?.pci_devices.len() > gpus as usize).then_some(s.uuid)
    })
    .await
    .expect("the node registered and reported");
    op.post::<Variant>(
        "/v1/variants",
        &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330"}),
    )
    .await
    .ok(201);
    op.post::<Package>(
        "/v1/packages",
        &json!({"name":"gpu-1x","vcpus":1,"memory_mib":1024,"disk_gib":10,
                "devices":{"NVIDIA_H100":1}}),
    )
    .await
    .ok(201);
    crate::common::create_test_image(&op).await;
    op.post::<passage_model::api::Account>(
        "/v1/accounts",
        &json!({"login":"tenant1","password":"tenant-password","role":"tenant"}),
    )
    .await
    .ok(201);
    let tenant = Client::at(
        &base,
        Some(&login(&base, "tenant1", "tenant-password").await),
    );
    Fleet {
        _server: server,
        _agent: agent,
        op,
        tenant,
        node,
        sysfs,
    }
}

impl Fleet {
    /// A tenant's VM with one GPU, running; answers the VM and its GPU's id.
    async fn running_vm(&self, alias: &str) -> (Vm, String) {
        let vm: Vm = self
            .tenant
            .post(
                "/v1/vms",
                &json!({"image":"test-image","alias":alias,"package":"gpu-1x"}),
            )
            .await
            .ok(202);
        let path = format!("/v1/vms/{}", vm.uuid);
        let vm = wait_for(Duration::from_secs(30), || async {
            let v: Vm = self.tenant.get(&path).await.ok(200);
            (v.state == VmState::Running).then_some(v)
        })
        .await
        .expect("the VM reached running");
        let dev = vm.assigned_devices[0].to_string();
        (vm, dev)
    }

    /// Destroys `vm` and waits until its GPU `dev` has left `dirty` and `cleaning`;
    /// answers the device as `GET /v1/servers/{uuid}` shows it.
    async fn destroy(&self, vm: &Vm, dev: &str) -> passage_model::api::AssignableDevice {
        self.tenant
            .delete::<Vm>(&format!("/v1/vms/{}", vm.uuid))
            .await
            .ok(202);
        wait_for(Duration::from_secs(30), || async {
            let d = self.device(dev).await;
            let settled = !matches!(
                d.state,
                DeviceState::Dirty
                    | DeviceState::Cleaning
                    | DeviceState::Used
                    | DeviceState::Provisioning
            );
            settled.then_some(d)
        })
        .await
        .expect("the GPU's scrub ended")
    }

    async fn device(&self, dev: &str) -> passage_model::api::AssignableDevice {
        let srv: Server = self
            .op
            .get(&format!("/v1/servers/{}", self.node))
            .await
            .ok(200);
        srv.assignable_devices
            .unwrap()
            .into_iter()
            .find(|d| d.id.to_string() == dev)
            .unwrap()
    }

    /// The device as the fleet-wide list shows it.
    async fn listed(&self, dev: &str) -> DeviceRow {
        let rows: Vec<DeviceRow> = self.op.get("/v1/devices").await.ok(200);
        rows.into_iter().find(|d| d.id.to_string() == dev).unwrap()
    }

    fn memory(&self, dev: &str) -> PathBuf {
        let bdf = dev.rsplit('/').next().unwrap();
        gpu_memory(&self.sysfs, bdf)
    }

    async fn last_scrub(&self, dev: &str) -> ScrubRecord {
        let reports: Vec<ScrubRecord> = self
            .op
            .get(&format!(
                "/v1/servers/{}/scrub-reports?device={dev}",
                self.node
            ))
            .await
            .ok(200);
        reports.last().unwrap().clone()
    }
}

/// A tenant's bytes in the fake GPU's memory, as a guest would leave them.
fn dirty(mem: &Path) {
    std::fs::write(mem, vec![0xA5u8; 256 * 1024]).unwrap();
}

fn all_zero(mem: &Path) -> bool {
    let data = std::fs::read(mem).unwrap();
    !data.is_empty() && data.iter().all(|&b| b == 0)
}

/// The usual path zeroes the GPU's memory and frees it; a node without the zeroing helper
/// quarantines the GPU, saying why in the API; so does a read-back that finds a byte set.
async fn a_gpu_that_was_not_cleared_is_quarantined(b: Backend) {
    let db = TestDb::new(b).await;
    let f = fleet(&db, 3).await;

    // Cleared and verified: back to the pool, its memory zero.
    let (vm, dev) = f.running_vm("first").await;
    dirty(&f.memory(&dev));
    let d = f.destroy(&vm, &dev).await;
    assert_eq!(d.state, DeviceState::Unassigned, "{d:?}");
    assert_eq!(d.state_reason, None);
    assert_eq!(d.scrub_policy, ScrubPolicy::Full);
    assert!(all_zero(&f.memory(&dev)), "the tenant's bytes were cleared");
    let r = f.last_scrub(&dev).await;
    let zero = r
        .steps
        .iter()
        .find(|s| s.name == "zero_gpu_memory")
        .unwrap();
    assert!(zero.ok && !zero.skipped, "{r:?}");
    assert!(
        zero.detail
            .as_deref()
            .unwrap()
            .contains("zeroed and verified"),
        "{r:?}"
    );

    // No helper on the node: quarantined, the tenant's bytes still there.
    set_fault(&f.sysfs, FakeFault::GpuZeroMissing, true).unwrap();
    let (vm, dev) = f.running_vm("second").await;
    dirty(&f.memory(&dev));
    let d = f.destroy(&vm, &dev).await;
    assert_eq!(d.state, DeviceState::Quarantined, "{d:?}");
    let why = "cn-7 cannot clear GPU memory: passage-gpu-zero not found";
    assert_eq!(d.state_reason.as_deref(), Some(why));
    assert_eq!(f.listed(&dev).await.state_reason.as_deref(), Some(why));
    assert!(!all_zero(&f.memory(&dev)));
    let r = f.last_scrub(&dev).await;
    let zero = r.steps.last().unwrap();
    assert_eq!(zero.name, "zero_gpu_memory");
    assert!(!zero.ok && zero.skipped, "{r:?}");
    set_fault(&f.sysfs, FakeFault::GpuZeroMissing, false).unwrap();

    // The read-back finds a byte that stayed set: quarantined.
    set_fault(&f.sysfs, FakeFault::GpuZeroVerifyFails, true).unwrap();
    let (vm, dev) = f.running_vm("third").await;
    let d = f.destroy(&vm, &dev).await;
    assert_eq!(d.state, DeviceState::Quarantined, "{d:?}");
    let why = d.state_reason.unwrap_or_default();
    assert!(
        why.starts_with("cn-7 could not clear GPU memory: ")
            && why.contains("GPU memory is not zero after clearing: byte 0x5a"),
        "{why}"
    );
}
both!(
    not_cleared_quarantines,
    a_gpu_that_was_not_cleared_is_quarantined
);

/// An operator's `reset-only`: recorded on the variant, shown on each device, in the
/// audit log; its GPUs come back from a node without the helper, saying their memory was
/// not cleared; back to `full`, they are cleared again.
async fn reset_only_is_the_operators_choice(b: Backend) {
    let db = TestDb::new(b).await;
    let f = fleet(&db, 2).await;
    set_fault(&f.sysfs, FakeFault::GpuZeroMissing, true).unwrap();

    // Only GPU variants take it.
    f.op.post::<Variant>(
        "/v1/variants",
        &json!({"name":"NIC","type":"nic","vendor":"8086","device":"1521",
                "scrub_policy":"reset-only"}),
    )
    .await
    .fails(400, passage_model::ErrorCode::InvalidArgument);
    f.op.put::<Variant>(
        "/v1/variants/NVIDIA_H100",
        &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330",
                "scrub_policy":"sometimes"}),
    )
    .await
    .fails(400, passage_model::ErrorCode::InvalidArgument);

    let v: Variant =
        f.op.put(
            "/v1/variants/NVIDIA_H100",
            &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330",
                    "scrub_policy":"reset-only"}),
        )
        .await
        .ok(200);
    assert_eq!(v.scrub_policy, ScrubPolicy::ResetOnly);
    let got: Variant = f.op.get("/v1/variants/NVIDIA_H100").await.ok(200);
    assert_eq!(got.scrub_policy, ScrubPolicy::ResetOnly);
    let audit: Vec<AuditEntry> = f.op.get("/v1/audit").await.ok(200);
    let entry = audit
        .iter()
        .find(|e| e.method == "PUT" && e.path == "/v1/variants/NVIDIA_H100" && e.status == 200)
        .unwrap();
    assert_eq!(
        entry.detail.as_deref(),
        Some(
            "variant \"NVIDIA_H100\": scrub_policy full -> reset-only \
             (GPU memory is no longer cleared between tenants)"
        )
    );

    let (vm, dev) = f.running_vm("trusting").await;
    assert_eq!(f.device(&dev).await.scrub_policy, ScrubPolicy::ResetOnly);
    assert_eq!(f.listed(&dev).await.scrub_policy, ScrubPolicy::ResetOnly);
    dirty(&f.memory(&dev));
    let d = f.destroy(&vm, &dev).await;
    assert_eq!(d.state, DeviceState::Unassigned, "{d:?}");
    let note = d.state_reason.unwrap_or_default();
    assert!(
        note.starts_with("GPU memory not cleared") && note.contains("operator's choice"),
        "{note}"
    );
    assert!(!all_zero(&f.memory(&dev)), "reset only: nothing cleared");
    let r = f.last_scrub(&dev).await;
    let names: Vec<&str> = r.steps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["reset", "nvidia_reset", "verify_driver"], "{r:?}");

    // Back to full: the audit says so, and the next scrub clears it again.
    f.op.put::<Variant>(
        "/v1/variants/NVIDIA_H100",
        &json!({"name":"NVIDIA_H100","type":"gpu","vendor":"10de","device":"2330"}),
    )
    .await
    .ok(200);
    let audit: Vec<AuditEntry> = f.op.get("/v1/audit").await.ok(200);
    assert!(
        audit[0]
            .detail
            .as_deref()
            .is_some_and(|d| d.contains("reset-only -> full")),
        "{:?}",
        audit[0]
    );
    set_fault(&f.sysfs, FakeFault::GpuZeroMissing, false).unwrap();
    let (vm, dev) = f.running_vm("careful").await;
    dirty(&f.memory(&dev));
    let d = f.destroy(&vm, &dev).await;
    assert_eq!(d.state, DeviceState::Unassigned, "{d:?}");
    assert_eq!(d.state_reason, None, "the note went with the policy");
    assert!(all_zero(&f.memory(&dev)));
}
both!(reset_only, reset_only_is_the_operators_choice);
