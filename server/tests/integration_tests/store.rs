//! The store's own invariants, the same bodies on SQLite and on Postgres.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestDb};
use passage_model::api::Role;
use passage_model::{AccountId, DeviceEvent, DevicePath, DeviceState, JobId, ServerId, VmId};
use passage_server::store::create::{self, NewVm};
use passage_server::store::device_moves::{self, DeviceWrite, MoveReq};
use passage_server::store::room::Allocation;
use passage_server::store::{Db, StoreError, accounts, devices, ops, servers, variants};

async fn seeded(b: Backend) -> (TestDb, Db, passage_model::ServerId, Vec<String>) {
    let tdb = TestDb::new(b).await;
    let db = Db::connect(&tdb.url).await.unwrap();
    servers::insert_join_token(&db, "jt-hash", "test", i64::MAX)
        .await
        .unwrap();
    let server = servers::register(&db, "jt-hash", "cn-1", "cred-hash")
        .await
        .unwrap()
        .unwrap();
    assert!(
        servers::register(&db, "jt-hash", "cn-2", "cred-2")
            .await
            .unwrap()
            .is_none(),
        "a join token is spent once"
    );
    let root = tdb.dir.path().join("sys");
    node_agent::fake::generate(&root, &node_agent::fake::FakeSpec::default()).unwrap();
    let report = node_agent::host::discover(&root).devices;
    let variant: passage_model::Variant =
        serde_json::from_str(r#"{"name":"H100","type":"gpu","vendor":"10de","device":"2330"}"#)
            .unwrap();
    variants::insert(&db, &variant).await.unwrap();
    devices::apply_inventory(&db, server, None, &report, devices::Coverage::Whole)
        .await
        .unwrap();
    let ids: Vec<String> = devices::for_server(&db, server)
        .await
        .unwrap()
        .into_iter()
        .filter(|d| d.variant.is_some())
        .map(|d| d.pci.id.to_string())
        .collect();
    assert!(!ids.is_empty());
    (tdb, db, server, ids)
}

async fn device_state(db: &Db, server: ServerId, id: &str) -> DeviceState {
    stored_device(db, server, id).await.state
}

async fn stored_device(
    db: &Db,
    server: ServerId,
    id: &str,
) -> passage_server::store::devices::DeviceRecord {
    devices::for_server(db, server)
        .await
        .unwrap()
        .into_iter()
        .find(|d| d.pci.id.to_string() == id)
        .unwrap()
}

async fn tenant(db: &Db, login: &'static str, quota: Option<u32>) -> AccountId {
    accounts::insert(
        db,
        accounts::NewAccount {
            login,
            password_hash: "x",
            role: Role::Tenant,
            gpu_quota: quota,
        },
    )
    .await
    .unwrap()
    .uuid
}

static NO_TAGS: passage_model::tags::Tags = passage_model::tags::Tags::new();

fn paths(ids: &[String]) -> Vec<DevicePath> {
    ids.iter().map(|i| i.parse().unwrap()).collect()
}

fn new_vm<'a>(
    owner: AccountId,
    server: ServerId,
    devices: &'a [DevicePath],
    vcpus: u32,
) -> NewVm<'a> {
    NewVm {
        uuid: VmId::new_ordered(),
        alias: "v",
        owner,
        package: None,
        vcpus,
        memory_mib: 1024,
        server: Some(server),
        devices,
        job: JobId::new_ordered(),
        image: None,
        nics: &[],
        metadata: "{}",
        tags: &NO_TAGS,
        keys: None,
    }
}

/// What a VM of `vcpus` and 1 GiB asks of a server's room.
fn fit(vcpus: u32, alloc: Allocation) -> passage_server::store::room::Fit {
    passage_server::store::room::Fit {
        vcpus,
        memory_mib: 1024,
        alloc,
    }
}

/// A VM of its own holding `ids`, reserved as every reservation is (`store::reserve`).
async fn reserved(db: &Db, server: ServerId, owner: AccountId, ids: &[String]) -> VmId {
    let devs = paths(ids);
    create::create_one(db, new_vm(owner, server, &devs, 0), Allocation::default())
        .await
        .unwrap()
        .uuid
}

async fn migrations_and_inventory(b: Backend) {
    let (tdb, db, server, ids) = seeded(b).await;
    // Migrating again is a no-op.
    let again = Db::connect(&tdb.url).await.unwrap();
    assert_eq!(
        devices::for_server(&again, server).await.unwrap().len(),
        devices::for_server(&db, server).await.unwrap().len()
    );
    let cands = devices::candidates(&db, &["H100".into()], 0).await.unwrap();
    assert_eq!(cands.len(), ids.len());
    assert!(
        devices::candidates(&db, &["H100".into()], i64::MAX)
            .await
            .unwrap()
            .is_empty(),
        "a silent server gets nothing"
    );
    // Capacity agrees: a silent server's devices are counted, clean, and not free.
    let n = ids.len() as u64;
    let cap = |alive_after| {
        let db = db.clone();
        async move {
            let c = ops::capacity(&db, alive_after).await.unwrap();
            let h = c.iter().find(|c| c.variant == "H100").unwrap();
            (h.total, h.unassigned, h.free)
        }
    };
    assert_eq!(cap(0).await, (n, n, n));
    assert_eq!(cap(i64::MAX).await, (n, n, 0));
    // Re-applying the same report changes nothing.
    let before = devices::for_server(&db, server).await.unwrap().len();
    let report: Vec<_> = devices::for_server(&db, server)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.pci)
        .collect();
    let vs = variants::list(&db).await.unwrap();
    devices::apply_inventory(&db, server, None, &report, devices::Coverage::Whole)
        .await
        .unwrap();
    assert_eq!(
        devices::for_server(&db, server).await.unwrap().len(),
        before
    );
    // Unknown objects are NotFound, duplicates Conflict.
    assert!(matches!(
        variants::get(&db, "nope").await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        variants::insert(&db, &vs[0]).await,
        Err(StoreError::Conflict(_))
    ));
}
both!(migrations_and_inventory_on, migrations_and_inventory);

async fn transitions_follow_the_machine(b: Backend) {
    let (_tdb, db, server, ids) = seeded(b).await;
    let one = vec![ids[0].clone()];
    let vm = VmId::new_random();
    // Not allowed by the state machine: nothing moves, nothing is recorded.
    let m = devices::move_devices(&db, server, &one, DeviceEvent::ScrubSucceeded, None, "t")
        .await
        .unwrap();
    assert!(m.is_empty());
    // Reservations have one writer, which claims quota and room with the devices.
    assert!(matches!(
        devices::move_devices(&db, server, &one, DeviceEvent::Reserve, Some(vm), "t").await,
        Err(StoreError::Corrupt(_))
    ));
    let owner = tenant(&db, "t", None).await;
    let vm = reserved(&db, server, owner, &one).await;
    let d = devices::held_by(&db, vm).await.unwrap();
    assert_eq!((d.len(), d[0].state), (1, DeviceState::Provisioning));
    // Only the holder moves a held device.
    let m = devices::move_devices(
        &db,
        server,
        &one,
        DeviceEvent::Release,
        Some(VmId::new_random()),
        "t",
    )
    .await
    .unwrap();
    assert!(m.is_empty());
    for (ev, to) in [
        (DeviceEvent::Attach, DeviceState::Used),
        (DeviceEvent::Release, DeviceState::Dirty),
    ] {
        let m = devices::move_devices(&db, server, &one, ev, Some(vm), "t")
            .await
            .unwrap();
        assert_eq!(m[0].to, to);
        // Idempotent: the same event again does nothing.
        assert!(
            devices::move_devices(&db, server, &one, ev, Some(vm), "t")
                .await
                .unwrap()
                .is_empty()
        );
    }
    let held = devices::held_by(&db, vm).await.unwrap();
    assert!(held.is_empty(), "a dirty device is held by nobody");
    // Dirty never goes straight back.
    assert!(
        devices::move_devices(&db, server, &one, DeviceEvent::Enable, None, "t")
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        devices::move_devices(&db, server, &one, DeviceEvent::CancelUnused, Some(vm), "t")
            .await
            .unwrap()
            .is_empty()
    );
    let d = devices::for_server(&db, server)
        .await
        .unwrap()
        .into_iter()
        .find(|d| d.pci.id.to_string() == ids[0])
        .unwrap();
    assert_eq!(d.state, DeviceState::Dirty);
}
both!(
    transitions_follow_the_machine_on,
    transitions_follow_the_machine
);

/// A scrub's start records its job on each device it moves to `cleaning`: the same job,
/// started again (a step resumed after a restart), takes those devices up again; another
/// job or a scrub without a job does not.
async fn a_resumed_scrub_takes_up_its_own_cleaning_devices(b: Backend) {
    let (_tdb, db, server, ids) = seeded(b).await;
    let two = vec![ids[0].clone(), ids[1].clone()];
    let owner = tenant(&db, "t", None).await;
    let vm = reserved(&db, server, owner, &two).await;
    for ev in [DeviceEvent::Attach, DeviceEvent::Release] {
        devices::move_devices(&db, server, &two, ev, Some(vm), "t")
            .await
            .unwrap();
    }
    let (job, other) = (JobId::new_random(), JobId::new_random());
    let start = |ids: &[String], job: Option<JobId>| {
        let (db, w) = (
            db.clone(),
            DeviceWrite {
                moves: vec![MoveReq::scrub_start(server, ids, job)],
                ..DeviceWrite::default()
            },
        );
        async move {
            let mut answers = device_moves::write(&db, &[w]).await.unwrap();
            let moved: Vec<String> = answers
                .pop()
                .unwrap()
                .unwrap()
                .into_iter()
                .flatten()
                .map(|m| m.id)
                .collect();
            moved
        }
    };
    // Only the first is asked for when the scrub starts.
    let started = start(&two[..1], Some(job)).await;
    assert_eq!(started, two[..1]);
    assert_eq!(
        device_state(&db, server, &two[0]).await,
        DeviceState::Cleaning
    );
    // Started again by its own job: the cleaning one is taken up, the dirty one started.
    let mut again = start(&two, Some(job)).await;
    again.sort();
    let mut want = two.clone();
    want.sort();
    assert_eq!(again, want);
    // Not by another job, nor by a scrub with no job.
    for j in [Some(other), None] {
        assert!(start(&two, j).await.is_empty());
    }
    devices::move_devices(&db, server, &two, DeviceEvent::ScrubSucceeded, None, "t")
        .await
        .unwrap();
    assert_eq!(
        device_state(&db, server, &two[1]).await,
        DeviceState::Unassigned
    );
}
both!(
    a_resumed_scrub_takes_up_its_own_cleaning_devices_on,
    a_resumed_scrub_takes_up_its_own_cleaning_devices
);

/// One batch of the job steps' device writes: each write is answered for itself. A VM no
/// longer being provisioned is refused with its devices left as they were; the other is
/// running with a usage record per device. Then, in one batch, a release and the scrub
/// start of the same device (moved for the first, then for the second), and a scrub's
/// outcome with its report.
async fn a_batch_of_device_writes_answers_each_write(b: Backend) {
    use passage_model::api::VmState;
    use passage_server::store::{events, vms};
    let (_tdb, db, server, ids) = seeded(b).await;
    let owner = tenant(&db, "t", None).await;
    let (one, two) = (vec![ids[0].clone()], vec![ids[1].clone()]);
    let (a, gone) = (
        reserved(&db, server, owner, &one).await,
        reserved(&db, server, owner, &two).await,
    );
    assert!(
        vms::set_state(&db, gone, &[VmState::Provisioning], VmState::Destroying)
            .await
            .unwrap()
    );
    let mut answers = device_moves::write(
        &db,
        &[
            DeviceWrite::running(a, server, &one),
            DeviceWrite::running(gone, server, &two),
        ],
    )
    .await
    .unwrap();
    assert!(matches!(
        answers.pop().unwrap(),
        Err(StoreError::InvalidState(_))
    ));
    let moved = answers.pop().unwrap().unwrap();
    assert_eq!(moved[0][0].to, DeviceState::Used);
    assert_eq!(vms::get(&db, a).await.unwrap().state, VmState::Running);
    assert_eq!(
        device_state(&db, server, &two[0]).await,
        DeviceState::Provisioning
    );
    let usage = ops::usage(&db, Some(owner), 0, i64::MAX).await.unwrap();
    assert_eq!(usage.len(), 1, "{usage:?}");
    assert_eq!(accounts::gpu_held(&db, owner).await.unwrap(), 2);

    let job = JobId::new_random();
    assert!(
        vms::set_state(&db, a, &[VmState::Running], VmState::Destroying)
            .await
            .unwrap()
    );
    let answers = device_moves::write(
        &db,
        &[
            DeviceWrite::destroyed(a, Some(server), &one),
            DeviceWrite {
                moves: vec![MoveReq::scrub_start(server, &one, Some(job))],
                ..DeviceWrite::default()
            },
        ],
    )
    .await
    .unwrap();
    let answers: Vec<_> = answers.into_iter().map(Result::unwrap).collect();
    assert_eq!(
        (answers[0][0][0].from, answers[0][0][0].to),
        (DeviceState::Used, DeviceState::Dirty)
    );
    assert_eq!(
        (answers[1][0][0].from, answers[1][0][0].to),
        (DeviceState::Dirty, DeviceState::Cleaning)
    );
    assert_eq!(vms::get(&db, a).await.unwrap().state, VmState::Destroyed);
    assert_eq!(accounts::gpu_held(&db, owner).await.unwrap(), 1);
    let usage = ops::usage(&db, Some(owner), 0, i64::MAX).await.unwrap();
    assert!(usage[0].ended_at.is_some(), "{usage:?}");

    let report = passage_model::protocol::ScrubReport {
        device: one[0].parse().unwrap(),
        ok: true,
        steps: Vec::new(),
    };
    let outcome = DeviceWrite {
        moves: vec![MoveReq::new(
            server,
            &one,
            DeviceEvent::ScrubSucceeded,
            None,
            "scrub succeeded",
        )],
        reports: vec![(server, passage_model::TaskId::new_random(), report)],
        vm: None,
    };
    let answers = device_moves::write(&db, &[outcome]).await.unwrap();
    assert_eq!(
        answers[0].as_ref().unwrap()[0][0].to,
        DeviceState::Unassigned
    );
    assert_eq!(
        device_state(&db, server, &one[0]).await,
        DeviceState::Unassigned
    );
    let reports = events::scrub_reports(&db, server, Some(&one[0]))
        .await
        .unwrap();
    assert_eq!(reports.len(), 1);
}
both!(
    a_batch_of_device_writes_answers_each_write_on,
    a_batch_of_device_writes_answers_each_write
);

/// 64 creations race for the last free device: exactly one gets it, one device is
/// charged, and the free-device index shows none left.
async fn concurrent_reservations_of_one_device(b: Backend) {
    let (_tdb, db, server, ids) = seeded(b).await;
    let owner = tenant(&db, "t", None).await;
    // All but the last device taken first.
    reserved(&db, server, owner, &ids[1..]).await;
    let target = paths(&ids[..1]);
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let db = db.clone();
        let target = target.clone();
        tasks.push(tokio::spawn(async move {
            create::create_one(
                &db,
                new_vm(owner, server, &target, 1),
                Allocation::default(),
            )
            .await
        }));
    }
    let mut winners = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => winners += 1,
            Err(StoreError::Retry) => {}
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(winners, 1);
    assert_eq!(
        accounts::gpu_held(&db, owner).await.unwrap(),
        ids.len() as i64
    );
    assert!(
        devices::hinted_servers(&db, "H100", 1, 0, false, 10, fit(1, Allocation::default()))
            .await
            .unwrap()
            .is_empty()
    );
}
both!(
    concurrent_reservations_of_one_device_on,
    concurrent_reservations_of_one_device
);

/// A batch of creations gets, for each, what it would have got alone in that order: the
/// first to name a device gets it, a device taken outside the batch is lost, quota and
/// room are spent in order; only the winners are written.
async fn a_batch_decides_each_creation_in_order(b: Backend) {
    use passage_model::api::{Role, VmState};
    use passage_model::{JobId, PackageId};
    use passage_server::store::{jobs, room, vms};
    let (_tdb, db, server, ids) = seeded(b).await;
    assert!(ids.len() >= 4);
    // 8 vCPUs to give: 4 CPUs at a ratio of 2, and memory to spare.
    room::set_host(
        &db,
        server,
        Some(passage_model::protocol::HostResources {
            cpus: 4,
            memory_mib: 1 << 20,
            ..Default::default()
        }),
    )
    .await
    .unwrap();
    let alloc = room::Allocation {
        cpu_ratio: 2.0,
        reserved_memory_mib: 0,
    };
    let account = |login: &'static str, quota| accounts::NewAccount {
        login,
        password_hash: "x",
        role: Role::Tenant,
        gpu_quota: quota,
    };
    let a = accounts::insert(&db, account("a", Some(1))).await.unwrap();
    let t = accounts::insert(&db, account("t", None)).await.unwrap();
    // Taken before the batch, by a VM of its own.
    let other = tenant(&db, "o", None).await;
    reserved(&db, server, other, &ids[3..4]).await;
    let dev = |i: usize| vec![ids[i].parse::<passage_model::DevicePath>().unwrap()];
    let (d0, d1, d2, d3) = (dev(0), dev(1), dev(2), dev(3));
    let new = |owner, devices: &'static [passage_model::DevicePath], vcpus| NewVm {
        uuid: VmId::new_ordered(),
        alias: "b",
        owner,
        package: Some(PackageId::new_random()),
        vcpus,
        memory_mib: 1024,
        server: Some(server),
        devices,
        job: JobId::new_ordered(),
        image: None,
        nics: &[],
        metadata: "{}",
        tags: &NO_TAGS,
        keys: None,
    };
    let leak = |v: Vec<passage_model::DevicePath>| -> &'static [passage_model::DevicePath] {
        Box::leak(v.into_boxed_slice())
    };
    let (d0, d1, d2, d3) = (leak(d0), leak(d1), leak(d2), leak(d3));
    let batch_vms = vec![
        new(t.uuid, d0, 2),
        new(a.uuid, d0, 2), // d0 went to the first
        new(t.uuid, d3, 2), // d3 was taken before the batch
        new(a.uuid, d1, 2), // a's one device
        new(a.uuid, d2, 2), // a's quota is spent
        new(t.uuid, d2, 5), // 2 + 2 taken of 8: no room for 5
        new(t.uuid, d2, 4),
    ];
    let out = create::create_many(&db, &batch_vms, alloc).await.unwrap();
    let kinds: Vec<String> = out
        .iter()
        .map(|o| match o {
            Ok(_) => "ok".into(),
            Err(StoreError::Retry) => "retry".into(),
            Err(StoreError::Quota(_)) => "quota".into(),
            Err(StoreError::NoRoom(_)) => "room".into(),
            Err(e) => format!("{e}"),
        })
        .collect();
    assert_eq!(kinds, ["ok", "retry", "retry", "ok", "quota", "room", "ok"]);
    for (vm, o) in batch_vms.iter().zip(&out) {
        match o {
            Ok(view) => {
                // What was answered is what was written.
                let stored = vms::get(&db, vm.uuid).await.unwrap();
                assert_eq!(&stored, view);
                assert_eq!(stored.state, VmState::Provisioning);
                let job = jobs::get(&db, vm.job).await.unwrap();
                assert_eq!(
                    job.steps.len(),
                    passage_model::jobs::JobKind::Provision.step_names().len(),
                    "a provision's steps"
                );
                let held = devices::held_by(&db, vm.uuid).await.unwrap();
                assert_eq!(held.len(), 1);
                assert_eq!(held[0].state, DeviceState::Provisioning);
            }
            Err(_) => {
                assert!(
                    vms::get(&db, vm.uuid).await.is_err(),
                    "a loser is not written"
                );
                assert!(jobs::get(&db, vm.job).await.is_err());
            }
        }
    }
    assert_eq!(accounts::gpu_held(&db, a.uuid).await.unwrap(), 1);
    assert_eq!(accounts::gpu_held(&db, t.uuid).await.unwrap(), 2);
    // The free-device index followed: the hinted placement read sees what is left.
    let left = ids.len() - 4;
    let view = devices::placement_view(
        &db,
        "H100",
        1,
        &["H100".into()],
        0,
        false,
        100,
        100,
        fit(0, alloc),
    )
    .await
    .unwrap();
    assert_eq!(view.candidates.len(), left);
    let hinted = devices::hinted_servers(&db, "H100", 1, 0, false, 10, fit(0, alloc))
        .await
        .unwrap();
    assert_eq!(hinted, vec![(server, left as i64)]);
    assert_eq!(view.rooms[&server].vcpus_used, 8);
}
both!(
    a_batch_decides_each_creation_in_order_on,
    a_batch_decides_each_creation_in_order
);

/// Placement's reads of the free-device index suggest only servers with room for the VM
/// asked for: a server whose vCPUs or memory are spent is left out while devices are still
/// free on it, and one that never reported its resources is not checked.
async fn full_servers_are_not_suggested(b: Backend) {
    use passage_server::store::room;
    let (_tdb, db, server, ids) = seeded(b).await;
    assert!(ids.len() >= 2);
    let alloc = Allocation {
        cpu_ratio: 1.5,
        reserved_memory_mib: 1024,
    };
    let suggested = |vcpus: u32, memory_mib: u64| {
        let db = db.clone();
        async move {
            let fit = room::Fit {
                vcpus,
                memory_mib,
                alloc,
            };
            let hinted = devices::hinted_servers(&db, "H100", 1, 0, false, 10, fit)
                .await
                .unwrap();
            let view =
                devices::placement_view(&db, "H100", 1, &["H100".into()], 0, false, 100, 10, fit)
                    .await
                    .unwrap();
            let hinted: Vec<ServerId> = hinted.into_iter().map(|(s, _)| s).collect();
            assert_eq!(hinted, view.servers, "both reads agree");
            !hinted.is_empty()
        }
    };
    // Not reported yet: anything goes.
    assert!(suggested(1000, 1 << 30).await);
    // 4 CPUs at 1.5: 6 vCPUs; 9 GiB less 1 GiB kept for the host: 8 GiB.
    room::set_host(
        &db,
        server,
        Some(passage_model::protocol::HostResources {
            cpus: 4,
            memory_mib: 9 * 1024,
            ..Default::default()
        }),
    )
    .await
    .unwrap();
    assert!(suggested(6, 8 * 1024).await);
    assert!(!suggested(7, 1024).await, "7 vCPUs of 6");
    assert!(
        !suggested(1, 8 * 1024 + 1).await,
        "memory beyond what the host keeps"
    );
    // A VM of 4 vCPUs and 1 GiB (held while provisioning) leaves 2 vCPUs and 7 GiB.
    let owner = tenant(&db, "t", None).await;
    let devs = paths(&ids[..1]);
    let vm = create::create_one(&db, new_vm(owner, server, &devs, 4), alloc)
        .await
        .unwrap();
    assert!(suggested(2, 7 * 1024).await);
    assert!(!suggested(3, 1024).await, "3 vCPUs of the 2 left");
    assert!(!suggested(1, 7 * 1024 + 1).await);
    // A destroyed VM holds nothing.
    let sql = "UPDATE vms SET state = 'destroyed' WHERE uuid = $1";
    match &db {
        Db::Sqlite { write, .. } => sqlx::query(sql)
            .bind(vm.uuid.to_string())
            .execute(write)
            .await
            .map(|_| ()),
        Db::Postgres(p) => sqlx::query(sql)
            .bind(vm.uuid.to_string())
            .execute(p)
            .await
            .map(|_| ()),
    }
    .unwrap();
    assert!(suggested(6, 8 * 1024).await);
}
both!(
    full_servers_are_not_suggested_on,
    full_servers_are_not_suggested
);

/// A batch's read takes servers in policy order until they hold the devices it needs,
/// at most `limit` of them, skipping those without room: the running count of free
/// devices is that of the servers it suggests, whatever the servers after them hold.
async fn a_batch_reads_servers_in_order_until_it_has_enough(b: Backend) {
    use passage_server::store::room;
    let tdb = TestDb::new(b).await;
    let db = Db::connect(&tdb.url).await.unwrap();
    let variant: passage_model::Variant =
        serde_json::from_str(r#"{"name":"H100","type":"gpu","vendor":"10de","device":"2330"}"#)
            .unwrap();
    variants::insert(&db, &variant).await.unwrap();
    // Free devices per server: A 1, B 2, C and E 3, D 4.
    let mut by_gpus: Vec<(u32, ServerId)> = Vec::new();
    for (i, gpus) in [1u32, 2, 3, 4, 3].into_iter().enumerate() {
        let token = format!("jt-{i}");
        servers::insert_join_token(&db, &token, "test", i64::MAX)
            .await
            .unwrap();
        let server = servers::register(&db, &token, &format!("cn-{i}"), &format!("cred-{i}"))
            .await
            .unwrap()
            .unwrap();
        let root = tdb.dir.path().join(format!("sys-{i}"));
        let spec = node_agent::fake::FakeSpec {
            gpus,
            ..node_agent::fake::FakeSpec::default()
        };
        node_agent::fake::generate(&root, &spec).unwrap();
        let report = node_agent::host::discover(&root).devices;
        devices::apply_inventory(&db, server, None, &report, devices::Coverage::Whole)
            .await
            .unwrap();
        by_gpus.push((gpus, server));
    }
    let [a, b_, c_or_e, d, e_or_c] = [0, 1, 2, 3, 4].map(|i| by_gpus[i].1);
    let (c, e) = (c_or_e.min(e_or_c), c_or_e.max(e_or_c));
    let alloc = Allocation {
        cpu_ratio: 1.0,
        reserved_memory_mib: 0,
    };
    let fit = |vcpus: u32| room::Fit {
        vcpus,
        memory_mib: 1024,
        alloc,
    };
    let read = |at_least: u32, spread: bool, need: i64, limit: i64, vcpus: u32| {
        let db = db.clone();
        async move {
            let view = devices::placement_view(
                &db,
                "H100",
                at_least,
                &["H100".into()],
                0,
                spread,
                need,
                limit,
                fit(vcpus),
            )
            .await
            .unwrap();
            // Every device offered is on a suggested server, and all of theirs are.
            let offered: std::collections::BTreeSet<ServerId> =
                view.candidates.iter().map(|c| c.server_uuid).collect();
            let suggested: std::collections::BTreeSet<ServerId> =
                view.servers.iter().copied().collect();
            assert_eq!(offered, suggested);
            view.servers
        }
    };
    // Pack: fewest free first; the third server brings the count to 6, past 4.
    assert_eq!(read(1, false, 4, 10, 1).await, vec![a, b_, c]);
    assert_eq!(
        read(1, false, 4, 2, 1).await,
        vec![a, b_],
        "at most `limit`"
    );
    assert_eq!(read(1, false, 100, 10, 1).await, vec![a, b_, c, e, d]);
    assert_eq!(
        read(2, false, 4, 10, 1).await,
        vec![b_, c],
        "at least 2 free"
    );
    // Spread: most free first; D alone holds 4.
    assert_eq!(read(1, true, 4, 10, 1).await, vec![d]);
    assert_eq!(read(1, true, 5, 10, 1).await, vec![d, e]);
    // B without room for 2 vCPUs is skipped, and its devices are not counted.
    room::set_host(
        &db,
        b_,
        Some(passage_model::protocol::HostResources {
            cpus: 1,
            memory_mib: 1 << 20,
            ..Default::default()
        }),
    )
    .await
    .unwrap();
    assert_eq!(read(1, false, 5, 10, 2).await, vec![a, c, e]);
    assert_eq!(read(1, false, 5, 2, 2).await, vec![a, c]);
    assert_eq!(
        read(1, false, 4, 10, 1).await,
        vec![a, b_, c],
        "1 vCPU fits on B"
    );
}
both!(
    a_batch_reads_servers_in_order_until_it_has_enough_on,
    a_batch_reads_servers_in_order_until_it_has_enough
);

/// Every row a creation can write, as text, with what differs between two databases
/// seeded alike (account and server uuids, times) replaced by names.
async fn written_rows(db: &Db) -> Vec<String> {
    let text = |cols: &[&str]| -> String {
        cols.iter()
            .map(|c| format!("COALESCE(CAST({c} AS TEXT), '-')"))
            .collect::<Vec<_>>()
            .join(" || '|' || ")
    };
    let queries = [
        format!(
            "SELECT 'vm|' || {} FROM vms v JOIN accounts a ON a.uuid = v.owner_uuid \
             LEFT JOIN servers s ON s.uuid = v.server_uuid ORDER BY v.uuid",
            text(&[
                "v.uuid",
                "v.alias",
                "a.login",
                "s.hostname",
                "v.package_uuid",
                "v.state",
                "v.vcpus",
                "v.memory_mib",
                "v.assigned_devices",
                "v.job_uuid"
            ])
        ),
        format!(
            "SELECT 'job|' || {} FROM jobs j LEFT JOIN accounts a ON a.uuid = j.owner_uuid \
             ORDER BY j.uuid",
            text(&[
                "j.uuid",
                "j.name",
                "j.vm_uuid",
                "a.login",
                "j.payload",
                "j.state"
            ])
        ),
        format!(
            "SELECT 'step|' || {} FROM job_steps ORDER BY job_uuid, idx",
            text(&["job_uuid", "idx", "name", "state", "error"])
        ),
        format!(
            "SELECT 'device|' || {} FROM devices ORDER BY id",
            text(&["id", "variant", "state", "used_by", "generation", "missing"])
        ),
        format!(
            "SELECT 'event|' || {} FROM device_events ORDER BY device, from_state, to_state",
            text(&["device", "from_state", "to_state", "reason"])
        ),
        format!(
            "SELECT 'account|' || {} FROM accounts ORDER BY login",
            text(&["login", "gpu_quota", "gpu_held"])
        ),
        format!(
            "SELECT 'free|' || {} FROM free_devices ORDER BY variant",
            text(&["variant", "free"])
        ),
    ];
    let mut out = Vec::new();
    for q in queries {
        let rows: Vec<String> = match db {
            Db::Sqlite { read, .. } => sqlx::query_scalar(&q).fetch_all(read).await.unwrap(),
            Db::Postgres(p) => sqlx::query_scalar(&q).fetch_all(p).await.unwrap(),
        };
        out.extend(rows);
    }
    out
}

/// The same creations, once one by one (a lone request's path) and once as one batch (a
/// burst's path), each on a fresh database seeded alike: the same outcome for each, and
/// the same rows written, down to the devices' generations and history.
async fn single_and_batch_paths_write_the_same(b: Backend) {
    async fn run(b: Backend, batch: bool) -> (Vec<String>, Vec<String>) {
        use passage_server::store::room;
        let (_tdb, db, server, ids) = seeded(b).await;
        room::set_host(
            &db,
            server,
            Some(passage_model::protocol::HostResources {
                cpus: 4,
                memory_mib: 1 << 20,
                ..Default::default()
            }),
        )
        .await
        .unwrap();
        let alloc = Allocation {
            cpu_ratio: 2.0,
            reserved_memory_mib: 0,
        };
        let a = tenant(&db, "a", Some(2)).await;
        let t = tenant(&db, "t", None).await;
        let d = |r: std::ops::Range<usize>| paths(&ids[r]);
        let (d0, d1, d2, d3, d01, d23) = (d(0..1), d(1..2), d(2..3), d(3..4), d(0..2), d(2..4));
        let wants: Vec<(AccountId, &[DevicePath], u32)> = vec![
            (t, &d0, 2),
            (a, &d0, 1),  // taken by the first
            (a, &d01, 1), // one of two taken: all or none
            (a, &d1, 1),
            (a, &d23, 1), // a's quota of 2 would be exceeded
            (t, &d2, 6),  // 2 + 1 of 8 vCPUs taken: no room for 6
            (t, &[], 4),  // room alone
            (a, &d2, 1),
            (t, &d3, 1), // 8 of 8 now: no room
        ];
        let vms: Vec<NewVm<'_>> = wants
            .iter()
            .enumerate()
            .map(|(i, (owner, devices, vcpus))| NewVm {
                uuid: VmId(uuid::Uuid::from_u128(1000 + i as u128)),
                alias: "same",
                owner: *owner,
                package: None,
                vcpus: *vcpus,
                memory_mib: 1024,
                server: Some(server),
                devices,
                job: JobId(uuid::Uuid::from_u128(2000 + i as u128)),
                image: None,
                nics: &[],
                metadata: "{}",
                tags: &NO_TAGS,
                keys: None,
            })
            .collect();
        let outcomes = if batch {
            create::create_many(&db, &vms, alloc).await.unwrap()
        } else {
            let mut out = Vec::new();
            for vm in vms {
                out.push(create::create_one(&db, vm, alloc).await);
            }
            out
        };
        let kinds = outcomes
            .iter()
            .map(|o| match o {
                Ok(vm) => format!("ok {}", vm.uuid),
                Err(e) => format!("{e:?}").replace(&server.to_string(), "SERVER"),
            })
            .collect();
        (kinds, written_rows(&db).await)
    }
    let (single, single_rows) = run(b, false).await;
    let (batch, batch_rows) = run(b, true).await;
    assert_eq!(single, batch);
    assert_eq!(
        single.iter().filter(|k| k.starts_with("ok")).count(),
        4,
        "{single:?}"
    );
    for (s, b) in single_rows.iter().zip(&batch_rows) {
        assert_eq!(s, b);
    }
    assert_eq!(single_rows.len(), batch_rows.len());
}
both!(
    single_and_batch_paths_write_the_same_on,
    single_and_batch_paths_write_the_same
);

/// Each device's `updated_at`, by id.
async fn updated_at(db: &Db) -> std::collections::BTreeMap<String, i64> {
    let q = "SELECT id, updated_at FROM devices";
    let rows: Vec<(String, i64)> = match db {
        Db::Sqlite { read, .. } => sqlx::query_as(q).fetch_all(read).await.unwrap(),
        Db::Postgres(p) => sqlx::query_as(q).fetch_all(p).await.unwrap(),
    };
    rows.into_iter().collect()
}

/// A node reports its whole inventory after every bind and unbind: only the functions
/// that changed are written, and a change the health check sees still is.
async fn an_inventory_writes_only_what_changed(b: Backend) {
    let (_tdb, db, server, ids) = seeded(b).await;
    let mut report: Vec<_> = devices::for_server(&db, server)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.pci)
        .collect();
    let before = updated_at(&db).await;
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    devices::apply_inventory(&db, server, None, &report, devices::Coverage::Whole)
        .await
        .unwrap();
    assert_eq!(
        updated_at(&db).await,
        before,
        "nothing changed, nothing written"
    );

    let bound = report
        .iter_mut()
        .find(|d| d.id.to_string() == ids[0])
        .unwrap();
    bound.driver = Some("vfio-pci".into());
    devices::apply_inventory(&db, server, None, &report, devices::Coverage::Whole)
        .await
        .unwrap();
    let after = updated_at(&db).await;
    let written: Vec<&String> = after
        .iter()
        .filter(|(id, at)| before.get(*id) != Some(*at))
        .map(|(id, _)| id)
        .collect();
    assert_eq!(written, vec![&ids[0]]);
    let rec = devices::for_server(&db, server).await.unwrap();
    let d = rec.iter().find(|d| d.pci.id.to_string() == ids[0]).unwrap();
    assert_eq!(d.pci.driver.as_deref(), Some("vfio-pci"));

    // A function left out is flagged once; reported again, it is back.
    let gone = report.pop().unwrap();
    devices::apply_inventory(&db, server, None, &report, devices::Coverage::Whole)
        .await
        .unwrap();
    let rec = devices::for_server(&db, server).await.unwrap();
    let d = rec.iter().find(|d| d.pci.id == gone.id).unwrap();
    assert!(d.missing && d.taint.is_some());
    let flagged = updated_at(&db).await;
    devices::apply_inventory(&db, server, None, &report, devices::Coverage::Whole)
        .await
        .unwrap();
    assert_eq!(updated_at(&db).await, flagged, "flagged once");
    report.push(gone.clone());
    devices::apply_inventory(&db, server, None, &report, devices::Coverage::Whole)
        .await
        .unwrap();
    let rec = devices::for_server(&db, server).await.unwrap();
    let d = rec.iter().find(|d| d.pci.id == gone.id).unwrap();
    assert!(!d.missing && d.taint.is_none());

    // A task's result carries only the functions it changed: the rest stay as they are.
    let mut one = report[0].clone();
    one.driver = None;
    devices::apply_inventory(
        &db,
        server,
        None,
        std::slice::from_ref(&one),
        devices::Coverage::Changed,
    )
    .await
    .unwrap();
    let rec = devices::for_server(&db, server).await.unwrap();
    assert!(rec.iter().all(|d| !d.missing), "nothing flagged missing");
    let d = rec.iter().find(|d| d.pci.id == one.id).unwrap();
    assert_eq!(d.pci.driver, None);
}
both!(
    an_inventory_writes_only_what_changed_on,
    an_inventory_writes_only_what_changed
);

/// Nodes reporting while an operator creates the variant their GPUs match: whichever
/// comes first, every GPU ends up with the variant (an inventory that read the variants
/// before the new one was committed is recounted by the variant's creation). Half the
/// nodes send whole inventories; the other half, whose functions are already known, send
/// a task's changed functions (a new driver on each, so each is written).
async fn a_variant_created_while_nodes_report_reaches_every_device(b: Backend) {
    let tdb = TestDb::new(b).await;
    let db = Db::connect(&tdb.url).await.unwrap();
    let root = tdb.dir.path().join("sys");
    node_agent::fake::generate(&root, &node_agent::fake::FakeSpec::default()).unwrap();
    let report = node_agent::host::discover(&root).devices;
    let gpus = report
        .iter()
        .filter(|d| d.vendor.to_string() == "10de" && d.device.to_string() == "2330")
        .count();
    assert!(gpus > 0);
    let variant: passage_model::Variant =
        serde_json::from_str(r#"{"name":"H100","type":"gpu","vendor":"10de","device":"2330"}"#)
            .unwrap();
    for round in 0..4 {
        let mut nodes = Vec::new();
        for i in 0..16 {
            let token = format!("jt-{round}-{i}");
            servers::insert_join_token(&db, &token, "test", i64::MAX)
                .await
                .unwrap();
            let s = servers::register(&db, &token, "cn", &format!("cred-{round}-{i}"))
                .await
                .unwrap()
                .unwrap();
            nodes.push(s);
        }
        if round > 0 {
            variants::delete(&db, "H100").await.unwrap();
            devices::recompute_variants(&db).await.unwrap();
        }
        let mut changed = report.clone();
        for d in &mut changed {
            d.driver = Some(format!("driver-{round}"));
        }
        for s in nodes.iter().skip(1).step_by(2) {
            devices::apply_inventory(&db, *s, None, &report, devices::Coverage::Whole)
                .await
                .unwrap();
        }
        let reports = nodes.iter().enumerate().map(|(i, s)| {
            let db = db.clone();
            let (report, coverage) = if i % 2 == 0 {
                (report.clone(), devices::Coverage::Whole)
            } else {
                (changed.clone(), devices::Coverage::Changed)
            };
            let s = *s;
            tokio::spawn(async move {
                devices::apply_inventory(&db, s, None, &report, coverage)
                    .await
                    .unwrap()
            })
        });
        let reports: Vec<_> = reports.collect();
        tokio::task::yield_now().await;
        variants::insert(&db, &variant).await.unwrap();
        devices::recompute_variants(&db).await.unwrap();
        for r in reports {
            r.await.unwrap();
        }
        for s in &nodes {
            let with = devices::for_server(&db, *s)
                .await
                .unwrap()
                .into_iter()
                .filter(|d| d.variant.as_deref() == Some("H100"))
                .count();
            assert_eq!(with, gpus, "round {round}: server {s}");
        }
    }
}
both!(
    a_variant_created_while_nodes_report_reaches_every_device_on,
    a_variant_created_while_nodes_report_reaches_every_device
);

/// Agents' polls take the oldest queued tasks, each once: 16 polls at once over 48
/// tasks deliver every task exactly once; a taken task comes back only after the
/// redelivery time.
async fn tasks_are_taken_oldest_first_and_once(b: Backend) {
    use passage_model::protocol::Task;
    use passage_server::store::job_log::{self, NewTask};
    use passage_server::store::tasks;
    let (_tdb, db, server, _ids) = seeded(b).await;
    let mut queued = Vec::new();
    for _ in 0..48 {
        let task = Task::StopVm {
            vm_uuid: VmId::new_ordered(),
        };
        let id = passage_model::TaskId::new_random();
        let new = NewTask::new(id, server, None, &task).unwrap();
        job_log::write(&db, &[], &[new]).await.unwrap();
        queued.push(id);
        // Distinct creation times, so "oldest first" has one answer.
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    let first = tasks::take(&db, server, 3, i64::MAX).await.unwrap();
    let ids: Vec<_> = first.iter().map(|t| t.id).collect();
    assert_eq!(ids, queued[..3], "the oldest, in order");

    let polls: Vec<_> = (0..16)
        .map(|_| {
            let db = db.clone();
            tokio::spawn(async move { tasks::take(&db, server, 4, i64::MAX).await.unwrap() })
        })
        .collect();
    let mut got: Vec<_> = ids.clone();
    for p in polls {
        got.extend(p.await.unwrap().into_iter().map(|t| t.id));
    }
    // A poll that lost some of its rows to another (Postgres re-checks each after its
    // lock) answers fewer: the rest are there for the next poll.
    loop {
        let more = tasks::take(&db, server, 4, i64::MAX).await.unwrap();
        if more.is_empty() {
            break;
        }
        got.extend(more.into_iter().map(|t| t.id));
    }
    let mut sorted = got.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), got.len(), "a task delivered twice");
    assert_eq!(got.len(), 48, "every task delivered");
    assert!(
        tasks::take(&db, server, 32, i64::MAX)
            .await
            .unwrap()
            .is_empty()
    );

    // Past the redelivery time, what was taken and never answered comes again.
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let again = tasks::take(&db, server, 64, 1).await.unwrap();
    assert_eq!(again.len(), 48);
}
both!(
    tasks_are_taken_oldest_first_and_once_on,
    tasks_are_taken_oldest_first_and_once
);

/// Polls of several nodes looked at together: each node gets its own oldest tasks, at
/// most the limit, in order, as it would alone; a node not asked for keeps its queue;
/// 16 such looks at once deliver every task exactly once; a taken task comes back after
/// the redelivery time.
async fn tasks_taken_for_several_nodes_are_each_nodes_own(b: Backend) {
    use passage_model::protocol::Task;
    use passage_server::store::job_log::{self, NewTask};
    use passage_server::store::tasks;
    let (_tdb, db, first, _ids) = seeded(b).await;
    let mut nodes = vec![first];
    for i in 0..3 {
        let token = format!("jt-{i}");
        servers::insert_join_token(&db, &token, "test", i64::MAX)
            .await
            .unwrap();
        let s = servers::register(&db, &token, &format!("cn-x{i}"), &format!("cred-x{i}"))
            .await
            .unwrap()
            .unwrap();
        nodes.push(s);
    }
    // 7, 5, 2 and 0 tasks, interleaved in time across the nodes.
    let counts = [7, 5, 2, 0];
    let mut queued: Vec<Vec<passage_model::TaskId>> = vec![Vec::new(); nodes.len()];
    for round in 0..7 {
        for (n, node) in nodes.iter().enumerate() {
            if round >= counts[n] {
                continue;
            }
            let task = Task::StopVm {
                vm_uuid: VmId::new_ordered(),
            };
            let id = passage_model::TaskId::new_random();
            let new = NewTask::new(id, *node, None, &task).unwrap();
            job_log::write(&db, &[], &[new]).await.unwrap();
            queued[n].push(id);
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }
    // The last node is not asked for; the one with no tasks is.
    let asked = [nodes[0], nodes[1], nodes[3]];
    let got = tasks::take_many(&db, &asked, 3, i64::MAX).await.unwrap();
    let ids = |n: &ServerId| -> Vec<_> {
        got.get(n)
            .map(|t| t.iter().map(|t| t.id).collect())
            .unwrap_or_default()
    };
    assert_eq!(ids(&nodes[0]), queued[0][..3], "the oldest, in order");
    assert_eq!(ids(&nodes[1]), queued[1][..3], "the oldest, in order");
    assert!(ids(&nodes[3]).is_empty(), "no tasks");
    assert!(!got.contains_key(&nodes[2]), "not asked for");
    let third = tasks::take(&db, nodes[2], 32, i64::MAX).await.unwrap();
    let third: Vec<_> = third.iter().map(|t| t.id).collect();
    assert_eq!(third, queued[2], "a node not asked for keeps its queue");

    let looks: Vec<_> = (0..16)
        .map(|_| {
            let db = db.clone();
            let asked = nodes.clone();
            tokio::spawn(async move { tasks::take_many(&db, &asked, 1, i64::MAX).await.unwrap() })
        })
        .collect();
    let mut delivered: Vec<passage_model::TaskId> = got
        .values()
        .flatten()
        .map(|t| t.id)
        .chain(third.iter().copied())
        .collect();
    for l in looks {
        for (node, tasks) in l.await.unwrap() {
            assert!(tasks.len() <= 1, "past the limit for {node}");
            delivered.extend(tasks.into_iter().map(|t| t.id));
        }
    }
    loop {
        let more = tasks::take_many(&db, &nodes, 2, i64::MAX).await.unwrap();
        if more.values().all(Vec::is_empty) {
            break;
        }
        delivered.extend(more.into_values().flatten().map(|t| t.id));
    }
    let mut sorted = delivered.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), delivered.len(), "a task delivered twice");
    assert_eq!(delivered.len(), 14, "every task delivered");

    // Past the redelivery time, what was taken and never answered comes again, each
    // node's own.
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let again = tasks::take_many(&db, &nodes, 64, 1).await.unwrap();
    for (n, node) in nodes.iter().enumerate() {
        let mut ids: Vec<_> = again
            .get(node)
            .map(|t| t.iter().map(|t| t.id).collect())
            .unwrap_or_default();
        ids.sort();
        let mut want = queued[n].clone();
        want.sort();
        assert_eq!(ids, want, "node {n}");
    }
}
both!(
    tasks_taken_for_several_nodes_are_each_nodes_own_on,
    tasks_taken_for_several_nodes_are_each_nodes_own
);

/// One job log batch writes each job's progress as its runner asked: a first step
/// started, a step ended with the next started, a job ended with or without its last
/// step, several steps started and ended together, and tasks queued; a step started again after a failure loses its error and keeps
/// its first start time. Jobs claimed together are each claimed as alone.
async fn a_job_log_batch_writes_each_jobs_progress(b: Backend) {
    use passage_model::api::{JobState, StepState};
    use passage_model::jobs::{JobKind, StepErrorKind};
    use passage_model::protocol::Task;
    use passage_server::store::job_log::{self, NewTask, StepWrite};
    use passage_server::store::jobs::{self, NewJob, StepFailure};
    use passage_server::store::tasks;
    let (_tdb, db, server, _ids) = seeded(b).await;
    let job = |kind| NewJob {
        uuid: JobId::new_ordered(),
        kind,
        vm: None,
        owner: None,
        payload: None,
    };
    let (a, bj, c) = (
        job(JobKind::Provision),
        job(JobKind::Scrub),
        job(JobKind::Scrub),
    );
    for j in [&a, &bj, &c] {
        jobs::insert(&db, j.clone()).await.unwrap();
    }
    assert_eq!(
        step_rows(&db, a.uuid).await,
        0,
        "a job is written without its steps' rows"
    );
    assert!(
        jobs::get(&db, a.uuid)
            .await
            .unwrap()
            .steps
            .iter()
            .map(|s| s.name.as_str())
            .eq(JobKind::Provision.step_names().iter().copied()),
        "its kind names them"
    );
    let task = |vm| {
        let id = passage_model::TaskId::new_ordered();
        let t = NewTask::new(id, server, Some(a.uuid), &Task::StopVm { vm_uuid: vm }).unwrap();
        (id, t)
    };
    let (t1, new1) = task(VmId::new_ordered());
    job_log::write(
        &db,
        &[
            StepWrite::advance(a.uuid, a.kind, None, (0, 0)),
            StepWrite::advance(bj.uuid, bj.kind, None, (0, 0)),
            StepWrite::succeed(c.uuid, c.kind, None),
        ],
        &[new1],
    )
    .await
    .unwrap();
    let ra = jobs::get(&db, a.uuid).await.unwrap();
    assert_eq!(ra.steps[0].state, StepState::Running);
    assert!(ra.steps[0].started_at.is_some() && ra.steps[0].ended_at.is_none());
    assert!(ra.steps[1..].iter().all(|s| s.state == StepState::Pending));
    assert_eq!(
        step_rows(&db, a.uuid).await,
        1,
        "a row for the step started"
    );
    let rc = jobs::get(&db, c.uuid).await.unwrap();
    assert_eq!(rc.state, JobState::Succeeded);
    assert!(rc.ended_at.is_some());
    assert_eq!(
        rc.steps[0].state,
        StepState::Pending,
        "no step of it ran here"
    );

    let (t2, new2) = task(VmId::new_ordered());
    job_log::write(
        &db,
        &[
            StepWrite::advance(a.uuid, a.kind, Some((0, 0)), (1, 1)),
            StepWrite::succeed(bj.uuid, bj.kind, Some((0, 0))),
        ],
        &[new2],
    )
    .await
    .unwrap();
    let ra = jobs::get(&db, a.uuid).await.unwrap();
    assert_eq!(
        ra.state,
        JobState::Queued,
        "a step write leaves the job's state"
    );
    assert_eq!(ra.steps[0].state, StepState::Succeeded);
    assert!(ra.steps[0].ended_at.is_some());
    assert_eq!(ra.steps[1].state, StepState::Running);
    assert!(ra.steps[2..].iter().all(|s| s.state == StepState::Pending));
    let rb = jobs::get(&db, bj.uuid).await.unwrap();
    assert_eq!(rb.state, JobState::Succeeded);
    assert_eq!(rb.steps[0].state, StepState::Succeeded);
    assert!(rb.steps[0].ended_at.is_some());

    // Failed, then started again (a resumed run): the error goes, the first start stays.
    let first_start = ra.steps[1].started_at;
    let failure = StepFailure {
        kind: StepErrorKind::Retryable,
        message: "the node did not answer".into(),
    };
    jobs::step_ended(&db, (a.uuid, a.kind), 1, StepState::Failed, Some(&failure))
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    job_log::write(
        &db,
        &[StepWrite::advance(a.uuid, a.kind, None, (1, 1))],
        &[],
    )
    .await
    .unwrap();
    let ra = jobs::get(&db, a.uuid).await.unwrap();
    assert_eq!(ra.steps[1].state, StepState::Running);
    assert_eq!(ra.steps[1].failure, None);
    assert_eq!(ra.steps[1].started_at, first_start);
    assert_eq!(
        ra.steps[0].state,
        StepState::Succeeded,
        "other steps untouched"
    );

    // Steps that one step's task does with it start together and end together; those
    // before and after are untouched.
    let d = job(JobKind::Provision);
    jobs::insert(&db, d.clone()).await.unwrap();
    job_log::write(
        &db,
        &[StepWrite::advance(d.uuid, d.kind, None, (1, 3))],
        &[],
    )
    .await
    .unwrap();
    let rd = jobs::get(&db, d.uuid).await.unwrap();
    let states: Vec<StepState> = rd.steps.iter().map(|s| s.state).collect();
    use StepState::{Pending, Running, Succeeded};
    assert_eq!(states, [Pending, Running, Running, Running, Pending]);
    assert!(rd.steps[1..4].iter().all(|s| s.started_at.is_some()));
    assert!(rd.steps[4].started_at.is_none());
    job_log::write(
        &db,
        &[StepWrite::advance(d.uuid, d.kind, Some((1, 3)), (4, 4))],
        &[],
    )
    .await
    .unwrap();
    let rd = jobs::get(&db, d.uuid).await.unwrap();
    let states: Vec<StepState> = rd.steps.iter().map(|s| s.state).collect();
    assert_eq!(states, [Pending, Succeeded, Succeeded, Succeeded, Running]);
    assert!(rd.steps[1..4].iter().all(|s| s.ended_at.is_some()));
    job_log::write(&db, &[StepWrite::ended(d.uuid, d.kind, (4, 4))], &[])
        .await
        .unwrap();
    let rd = jobs::get(&db, d.uuid).await.unwrap();
    assert_eq!(rd.steps[4].state, Succeeded);
    assert_eq!(rd.state, JobState::Queued, "the job goes on");

    // A failure put on a step that has no row yet (one its task did ahead) is kept.
    let e = job(JobKind::Provision);
    jobs::insert(&db, e.clone()).await.unwrap();
    let refused = StepFailure {
        kind: StepErrorKind::Refused,
        message: "start_vm: no bridge".into(),
    };
    jobs::step_ended(&db, (e.uuid, e.kind), 3, StepState::Failed, Some(&refused))
        .await
        .unwrap();
    let re = jobs::get(&db, e.uuid).await.unwrap();
    let states: Vec<StepState> = re.steps.iter().map(|s| s.state).collect();
    assert_eq!(
        states,
        [Pending, Pending, Pending, StepState::Failed, Pending]
    );
    assert_eq!(re.steps[3].failure.as_ref(), Some(&refused));
    assert!(re.steps[3].ended_at.is_some());
    assert!(
        jobs::step_ended(&db, (e.uuid, e.kind), 9, StepState::Failed, None)
            .await
            .is_err(),
        "no such step"
    );

    let mut queued: Vec<_> = tasks::take(&db, server, 10, i64::MAX)
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.id.to_string())
        .collect();
    queued.sort();
    let mut want = vec![t1.to_string(), t2.to_string()];
    want.sort();
    assert_eq!(queued, want, "both tasks queued");

    // Claimed together: the unfinished job, as it stands, and not the finished ones; then
    // not by another owner while the lease holds.
    let until = i64::MAX / 2;
    let claimed = jobs::claim_records(&db, &[a.uuid, bj.uuid, c.uuid], "me", until)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let ra = &claimed[&a.uuid];
    assert_eq!(ra.state, JobState::Running);
    assert_eq!(ra.steps[0].state, StepState::Succeeded);
    assert_eq!(ra.steps[1].state, StepState::Running);
    assert!(
        jobs::claim_records(&db, &[a.uuid], "another", until)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        jobs::claim_records(&db, &[a.uuid], "me", until)
            .await
            .unwrap()
            .len(),
        1,
        "renewed by its owner"
    );

    // Written and claimed together: the claims see the writes before them, and answer
    // only the jobs claimed.
    let f = job(JobKind::Provision);
    jobs::insert(&db, f.clone()).await.unwrap();
    let claims = job_log::Claims {
        jobs: &[f.uuid, c.uuid, a.uuid],
        owner: "me",
        until_ms: until,
    };
    let claimed = job_log::write_and_claim(
        &db,
        &[StepWrite::advance(f.uuid, f.kind, None, (0, 1))],
        &[],
        &claims,
    )
    .await
    .unwrap();
    let mut got: Vec<JobId> = claimed.keys().copied().collect();
    got.sort();
    let mut want = vec![f.uuid, a.uuid];
    want.sort();
    assert_eq!(got, want, "the finished job is not claimed");
    let rf = &claimed[&f.uuid];
    assert_eq!(rf.state, JobState::Running);
    let states: Vec<StepState> = rf.steps.iter().map(|s| s.state).collect();
    assert_eq!(states, [Running, Running, Pending, Pending, Pending]);
    assert!(
        job_log::write_and_claim(&db, &[], &[], &job_log::Claims::default())
            .await
            .unwrap()
            .is_empty()
    );
}
both!(
    a_job_log_batch_writes_each_jobs_progress_on,
    a_job_log_batch_writes_each_jobs_progress
);

/// How many rows of `job`'s steps are stored.
async fn step_rows(db: &Db, job: JobId) -> i64 {
    let q = "SELECT COUNT(*) FROM job_steps WHERE job_uuid = $1";
    match db {
        Db::Sqlite { read, .. } => sqlx::query_scalar(q)
            .bind(job.to_string())
            .fetch_one(read)
            .await
            .unwrap(),
        Db::Postgres(p) => sqlx::query_scalar(q)
            .bind(job.to_string())
            .fetch_one(p)
            .await
            .unwrap(),
    }
}

/// Heartbeats written together mark each node named, however often, and no other.
async fn heartbeats_together_mark_each_node_named(b: Backend) {
    let (_tdb, db, first, _ids) = seeded(b).await;
    let mut nodes = vec![first];
    for i in 0..4 {
        let token = format!("jt-{i}");
        servers::insert_join_token(&db, &format!("{token}-hash"), "test", i64::MAX)
            .await
            .unwrap();
        let s = servers::register(&db, &format!("{token}-hash"), &format!("cn-{i}"), &token)
            .await
            .unwrap()
            .unwrap();
        nodes.push(s);
    }
    let before: Vec<_> = {
        let mut v = Vec::new();
        for n in &nodes {
            v.push(servers::get(&db, *n).await.unwrap().last_heartbeat);
        }
        v
    };
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    // Three of five, one twice: a list of four padded to a power of two.
    let named = [nodes[1], nodes[3], nodes[1], nodes[4]];
    servers::heartbeat_many(&db, &named).await.unwrap();
    for (i, n) in nodes.iter().enumerate() {
        let now = servers::get(&db, *n).await.unwrap().last_heartbeat;
        if named.contains(n) {
            assert!(now > before[i], "node {i} marked");
        } else {
            assert_eq!(now, before[i], "node {i} untouched");
        }
    }
    servers::heartbeat_many(&db, &[]).await.unwrap();
}
both!(
    heartbeats_together_mark_each_node_named_on,
    heartbeats_together_mark_each_node_named
);

/// A SQLite transaction sent in one call is all or nothing: a statement that fails
/// leaves nothing of those before it, and the writer takes the next one as usual.
#[tokio::test]
async fn a_transaction_in_one_call_is_all_or_nothing() {
    use passage_server::store::page::Arg;
    let (_tdb, db, server, _ids) = seeded(Backend::Sqlite).await;
    let Db::Sqlite { write, turn, .. } = &db else {
        unreachable!("a SQLite database")
    };
    let mark = |host: &str| format!("UPDATE servers SET hostname = '{host}' WHERE uuid = ?");
    let hostname = |db: &Db| {
        let db = db.clone();
        async move { servers::get(&db, server).await.unwrap().hostname }
    };
    // The second statement breaks a NOT NULL rule.
    let broken = format!(
        "{};\nUPDATE servers SET hostname = NULL WHERE uuid = ?",
        mark("renamed")
    );
    let args = [Arg::Text(server.to_string()), Arg::Text(server.to_string())];
    let e = passage_server::store::sqlite_atomic(write, turn, &broken, &args).await;
    assert!(e.is_err(), "a NULL hostname is refused");
    assert_eq!(
        hostname(&db).await,
        "cn-1",
        "the first statement rolled back"
    );
    passage_server::store::sqlite_atomic(write, turn, &mark("renamed"), &args[..1])
        .await
        .unwrap();
    assert_eq!(hostname(&db).await, "renamed");
    // A text that does not parse: whatever it began is rolled back, and the writer goes on.
    let e = passage_server::store::sqlite_atomic(write, turn, "UPDATE nowhere", &[]).await;
    assert!(e.is_err());
    passage_server::store::sqlite_atomic(write, turn, &mark("again"), &args[..1])
        .await
        .unwrap();
    assert_eq!(hostname(&db).await, "again");
}

/// Task results recorded together are each recorded as alone: once, only by the task's
/// own node; a result given twice in one batch is recorded for the first; each refused
/// one says why.
async fn task_results_are_recorded_once_and_by_their_node(b: Backend) {
    use passage_model::protocol::{Task, TaskResult};
    use passage_server::store::job_log::{self, NewTask};
    use passage_server::store::tasks::{self, Completion};
    let (_tdb, db, server, _ids) = seeded(b).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = passage_model::TaskId::new_ordered();
        let task = Task::StopVm {
            vm_uuid: VmId::new_ordered(),
        };
        let new = NewTask::new(id, server, None, &task).unwrap();
        job_log::write(&db, &[], &[new]).await.unwrap();
        ids.push(id);
    }
    let ok = TaskResult::success();
    let other = ServerId::new_random();
    let unknown = passage_model::TaskId::new_ordered();
    let done = |task, server| Completion::new(task, server, &ok).unwrap();
    let recorded = tasks::complete_many(
        &db,
        &[
            done(ids[0], server),
            done(ids[1], other),
            done(ids[0], server),
            done(unknown, server),
            done(ids[2], server),
        ],
    )
    .await
    .unwrap();
    assert_eq!(recorded, vec![true, false, false, false, true]);
    assert!(matches!(
        tasks::not_completed(&db, other, ids[1]).await,
        StoreError::NotFound(_)
    ));
    assert!(matches!(
        tasks::not_completed(&db, server, unknown).await,
        StoreError::NotFound(_)
    ));
    assert!(matches!(
        tasks::not_completed(&db, server, ids[0]).await,
        StoreError::Conflict(_)
    ));
    assert!(
        tasks::result(&db, ids[0])
            .await
            .unwrap()
            .is_some_and(|r| r.ok)
    );
    assert!(tasks::result(&db, ids[1]).await.unwrap().is_none());
    // Its own node's result, later, is recorded; a second is not.
    let again = tasks::complete_many(&db, &[done(ids[1], server), done(ids[2], server)])
        .await
        .unwrap();
    assert_eq!(again, vec![true, false]);
}
both!(
    task_results_are_recorded_once_and_by_their_node_on,
    task_results_are_recorded_once_and_by_their_node
);

/// Task results recorded together write, in their transaction, the functions their
/// tasks changed, for each node; a refused result's functions are written all the same
/// (they are the node's word on its own functions), and a held device keeps its state.
async fn task_results_write_the_functions_their_tasks_changed(b: Backend) {
    use passage_model::protocol::{Task, TaskResult};
    use passage_server::store::job_log::{self, NewTask};
    use passage_server::store::tasks::{self, Completion};
    let (_tdb, db, server, ids) = seeded(b).await;
    servers::insert_join_token(&db, "jt-2", "test", i64::MAX)
        .await
        .unwrap();
    let second = servers::register(&db, "jt-2", "cn-2", "cred-2")
        .await
        .unwrap()
        .unwrap();
    let functions: Vec<passage_model::PciDevice> = devices::for_server(&db, server)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.pci)
        .collect();
    devices::apply_inventory(&db, second, None, &functions, devices::Coverage::Whole)
        .await
        .unwrap();
    let task = |s| {
        let id = passage_model::TaskId::new_ordered();
        let t = Task::StopVm {
            vm_uuid: VmId::new_ordered(),
        };
        (id, NewTask::new(id, s, None, &t).unwrap())
    };
    let (t1, n1) = task(server);
    let (t2, n2) = task(second);
    job_log::write(&db, &[], &[n1, n2]).await.unwrap();
    let rebound = |id: &str| {
        let mut d = functions
            .iter()
            .find(|d| d.id.to_string() == id)
            .unwrap()
            .clone();
        d.driver = Some("vfio-pci".into());
        d
    };
    let with = |devices: Vec<passage_model::PciDevice>| TaskResult {
        devices,
        ..TaskResult::success()
    };
    let done = |t, s, r: &TaskResult| Completion::new(t, s, r).unwrap();
    let recorded = tasks::complete_many(
        &db,
        &[
            done(t1, server, &with(vec![rebound(&ids[0])])),
            done(t2, second, &with(vec![rebound(&ids[0]), rebound(&ids[1])])),
            done(t1, server, &with(vec![rebound(&ids[1])])),
        ],
    )
    .await
    .unwrap();
    assert_eq!(recorded, vec![true, true, false]);
    let driver = |s, id: &str| {
        let db = &db;
        let id = id.to_string();
        async move {
            let d = stored_device(db, s, &id).await;
            (d.pci.driver, d.state, d.variant.is_some())
        }
    };
    let vfio = |(driver, state, variant): (Option<String>, DeviceState, bool)| {
        driver.as_deref() == Some("vfio-pci") && state == DeviceState::Unassigned && variant
    };
    assert!(vfio(driver(server, &ids[0]).await));
    assert!(
        vfio(driver(server, &ids[1]).await),
        "a refused result's functions"
    );
    assert!(vfio(driver(second, &ids[0]).await));
    assert!(vfio(driver(second, &ids[1]).await));
    assert!(
        !vfio(driver(second, &ids[2]).await),
        "only what was reported"
    );
    assert!(tasks::result(&db, t2).await.unwrap().is_some_and(|r| r.ok));
}
both!(
    task_results_write_the_functions_their_tasks_changed_on,
    task_results_write_the_functions_their_tasks_changed
);

/// Results of several nodes recorded together write their changed functions in one read
/// and one update: every field a report carries lands (a NUMA node, a driver gone, no
/// IOMMU group), a node with two reports gets them in order, and a report that changes
/// what a node can place (a function that no longer matches its variant) takes its own
/// path and recounts the free index.
async fn task_results_of_many_nodes_write_their_functions_together(b: Backend) {
    use passage_model::protocol::{Task, TaskResult};
    use passage_server::store::job_log::{self, NewTask};
    use passage_server::store::tasks::{self, Completion};
    let (_tdb, db, a, ids) = seeded(b).await;
    let functions: Vec<passage_model::PciDevice> = devices::for_server(&db, a)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.pci)
        .collect();
    let mut nodes = vec![a];
    for n in 1..4 {
        let token = format!("jt-{n}");
        servers::insert_join_token(&db, &token, "test", i64::MAX)
            .await
            .unwrap();
        let s = servers::register(&db, &token, &format!("cn-{n}"), &format!("cred-{n}"))
            .await
            .unwrap()
            .unwrap();
        devices::apply_inventory(&db, s, None, &functions, devices::Coverage::Whole)
            .await
            .unwrap();
        nodes.push(s);
    }
    let (b_, c, d) = (nodes[1], nodes[2], nodes[3]);
    let mut tasks_of = Vec::new();
    let mut queued = Vec::new();
    for s in [a, b_, c, d, d] {
        let id = passage_model::TaskId::new_ordered();
        let t = Task::StopVm {
            vm_uuid: VmId::new_ordered(),
        };
        queued.push(NewTask::new(id, s, None, &t).unwrap());
        tasks_of.push(id);
    }
    job_log::write(&db, &[], &queued).await.unwrap();
    let function = |id: &str| {
        functions
            .iter()
            .find(|d| d.id.to_string() == id)
            .unwrap()
            .clone()
    };
    let with = |devices: Vec<passage_model::PciDevice>| TaskResult {
        devices,
        ..TaskResult::success()
    };
    let mut a0 = function(&ids[0]);
    a0.driver = Some("vfio-pci".into());
    a0.numa_node = Some(7);
    let mut a1 = function(&ids[1]);
    a1.driver = None;
    a1.iommu_group = None;
    let mut b0 = function(&ids[0]);
    b0.driver = Some("vfio-pci".into());
    let mut c0 = function(&ids[0]);
    c0.device = passage_model::pci::HexId(0x1234);
    let mut d_first = function(&ids[0]);
    d_first.driver = Some("vfio-pci".into());
    let mut d_then = function(&ids[0]);
    d_then.driver = Some("nvidia".into());
    let results = [
        (a, vec![a0, a1]),
        (b_, vec![b0]),
        (c, vec![c0]),
        (d, vec![d_first]),
        (d, vec![d_then]),
    ];
    let done: Vec<Completion> = results
        .iter()
        .zip(&tasks_of)
        .map(|((s, f), t)| Completion::new(*t, *s, &with(f.clone())).unwrap())
        .collect();
    let recorded = tasks::complete_many(&db, &done).await.unwrap();
    assert_eq!(recorded, vec![true; 5]);
    let stored = |s: ServerId, id: &str| {
        let db = &db;
        let id = id.to_string();
        async move { stored_device(db, s, &id).await }
    };
    let got = stored(a, &ids[0]).await;
    assert_eq!(got.pci.driver.as_deref(), Some("vfio-pci"));
    assert_eq!(got.pci.numa_node, Some(7));
    assert_eq!(got.variant.as_deref(), Some("H100"));
    let got = stored(a, &ids[1]).await;
    assert_eq!(got.pci.driver, None, "a driver gone");
    assert_eq!(got.pci.iommu_group, None, "no IOMMU group");
    assert_eq!(got.state, DeviceState::Unassigned);
    let got = stored(b_, &ids[0]).await;
    assert_eq!(got.pci.driver.as_deref(), Some("vfio-pci"));
    assert_eq!(got.pci.iommu_group, function(&ids[0]).iommu_group);
    let got = stored(c, &ids[0]).await;
    assert_eq!(got.pci.device, passage_model::pci::HexId(0x1234));
    assert_eq!(got.variant, None, "no longer an H100");
    assert_eq!(
        stored(d, &ids[0]).await.pci.driver.as_deref(),
        Some("nvidia"),
        "a node's reports in their order"
    );
    assert_eq!(
        stored(d, &ids[1]).await.pci,
        function(&ids[1]),
        "only what was reported"
    );
    crate::common::assert_free_index_exact(&db, "after a batch of changed functions").await;
}
both!(
    task_results_of_many_nodes_write_their_functions_together_on,
    task_results_of_many_nodes_write_their_functions_together
);

/// The job runner's lane commits without waiting for the disk on Postgres; every other
/// connection waits.
async fn the_jobs_lane_alone_relaxes_commits(b: Backend) {
    use passage_server::store::Commit;
    let tdb = TestDb::new(b).await;
    let db = Db::connect(&tdb.url).await.unwrap();
    let show = |d: Db| async move {
        match d {
            Db::Postgres(p) => Some(
                sqlx::query_scalar::<_, String>("SHOW synchronous_commit")
                    .fetch_one(&p)
                    .await
                    .unwrap(),
            ),
            Db::Sqlite { .. } => None,
        }
    };
    let relaxed = show(db.lane_with(1, Commit::Relaxed)).await;
    let durable = show(db.lane(1)).await;
    let main = show(db.clone()).await;
    match b {
        Backend::Postgres => {
            assert_eq!(relaxed.as_deref(), Some("off"));
            assert_eq!(durable.as_deref(), Some("on"));
            assert_eq!(main.as_deref(), Some("on"));
        }
        Backend::Sqlite => assert!(relaxed.is_none() && durable.is_none() && main.is_none()),
    }
}
both!(
    the_jobs_lane_alone_relaxes_commits_on,
    the_jobs_lane_alone_relaxes_commits
);

/// A GPU's life as a host of vGPUs: opened for a vGPU variant (shared, its slots free
/// in the index), never opened twice, its slots reserved as devices; an inventory keeps
/// its hands off the slots but flags them with a missing GPU; closed only when its last
/// slot is free after its scrub, and then dirty, to be scrubbed whole.
async fn a_gpu_hosts_vgpus_until_its_last_is_scrubbed(b: Backend) {
    use passage_server::placement::Policy;
    use passage_server::store::vgpus;
    let tdb = TestDb::new(b).await;
    let db = Db::connect(&tdb.url).await.unwrap();
    servers::insert_join_token(&db, "jt", "test", i64::MAX)
        .await
        .unwrap();
    let server = servers::register(&db, "jt", "cn-1", "cred")
        .await
        .unwrap()
        .unwrap();
    let root = tdb.dir.path().join("sys");
    let spec = node_agent::fake::FakeSpec {
        gpus: 1,
        model: node_agent::fake::GpuModel::A100,
        ..node_agent::fake::FakeSpec::default()
    };
    let opts = node_agent::fake::FakeOptions {
        vgpu: Some(node_agent::fake::FakeVgpu::Mdev),
        ..node_agent::fake::FakeOptions::default()
    };
    node_agent::fake::generate_with(&root, &spec, &opts).unwrap();
    let report = node_agent::host::discover(&root).devices;
    let parent: passage_model::Variant =
        serde_json::from_str(r#"{"name":"A100","type":"gpu","vendor":"10de","device":"20b0"}"#)
            .unwrap();
    variants::insert(&db, &parent).await.unwrap();
    let v: passage_model::Variant = serde_json::from_str(
        r#"{"name":"A100_10C","type":"vgpu","vendor":"10de","device":"20b0","parent":"A100",
            "vgpu_type":"GRID A100-10C","max_per_gpu":8}"#,
    )
    .unwrap();
    variants::insert(&db, &v).await.unwrap();
    devices::apply_inventory(&db, server, None, &report, devices::Coverage::Whole)
        .await
        .unwrap();
    let alloc = Allocation::default();
    // The node says GRID A100-10C (by name: its id is nvidia-475) fits 4 times: fewer
    // than the variant's 8.
    let opened = vgpus::open(&db, &v, 2, Policy::Pack, 0, fit(1, alloc), None)
        .await
        .unwrap();
    assert_eq!(opened.len(), 1, "one GPU to open");
    assert_eq!(opened[0].slots, 4);
    let gpu = opened[0].gpu.to_string();
    assert!(
        vgpus::open(&db, &v, 1, Policy::Pack, 0, fit(1, alloc), None)
            .await
            .unwrap()
            .is_empty(),
        "a shared GPU is not opened again"
    );
    assert_eq!(vgpus::free_slots(&db, "A100_10C", 0).await.unwrap(), 4);
    let all = devices::for_server(&db, server).await.unwrap();
    let state_of = |all: &[devices::DeviceRecord], id: &str| {
        all.iter()
            .find(|d| d.pci.id.to_string() == id)
            .map(|d| d.state)
    };
    assert_eq!(state_of(&all, &gpu), Some(DeviceState::Shared));
    let slots: Vec<String> = all
        .iter()
        .filter(|d| d.pci.id.vgpu().is_some())
        .map(|d| d.pci.id.to_string())
        .collect();
    assert_eq!(slots.len(), 4);
    assert!(
        devices::candidates(&db, &["A100".into()], 0)
            .await
            .unwrap()
            .is_empty(),
        "a shared GPU is not given whole"
    );

    let owner = tenant(&db, "t", None).await;
    let vm = reserved(&db, server, owner, &slots[..1]).await;
    assert_eq!(accounts::gpu_held(&db, owner).await.unwrap(), 1);
    assert!(
        vgpus::close_idle(&db, server, std::slice::from_ref(&gpu))
            .await
            .unwrap()
            .is_empty(),
        "a GPU with a held slot stays open"
    );

    // The inventory never reports slots: they are not missing, and a held one stays held.
    devices::apply_inventory(&db, server, None, &report, devices::Coverage::Whole)
        .await
        .unwrap();
    let all = devices::for_server(&db, server).await.unwrap();
    assert!(
        all.iter()
            .filter(|d| d.pci.id.vgpu().is_some())
            .all(|d| !d.missing)
    );
    assert_eq!(state_of(&all, &slots[0]), Some(DeviceState::Provisioning));
    // A missing GPU takes its slots out of placement with it; back, they are back.
    let without: Vec<_> = report
        .iter()
        .filter(|d| d.id.to_string() != gpu)
        .cloned()
        .collect();
    devices::apply_inventory(&db, server, None, &without, devices::Coverage::Whole)
        .await
        .unwrap();
    assert_eq!(vgpus::free_slots(&db, "A100_10C", 0).await.unwrap(), 0);
    devices::apply_inventory(&db, server, None, &report, devices::Coverage::Whole)
        .await
        .unwrap();
    assert_eq!(vgpus::free_slots(&db, "A100_10C", 0).await.unwrap(), 3);

    // Released, scrubbed: the last vGPU is gone and the GPU closes, dirty.
    for (event, who) in [
        (DeviceEvent::Release, Some(vm)),
        (DeviceEvent::ScrubStart, None),
    ] {
        devices::move_devices(&db, server, &slots[..1], event, who, "test")
            .await
            .unwrap();
        assert!(
            vgpus::close_idle(&db, server, std::slice::from_ref(&gpu))
                .await
                .unwrap()
                .is_empty(),
            "not closed before its slot's scrub"
        );
    }
    devices::move_devices(
        &db,
        server,
        &slots[..1],
        DeviceEvent::ScrubSucceeded,
        None,
        "test",
    )
    .await
    .unwrap();
    assert_eq!(
        vgpus::close_idle(&db, server, std::slice::from_ref(&gpu))
            .await
            .unwrap(),
        vec![gpu.clone()]
    );
    let all = devices::for_server(&db, server).await.unwrap();
    assert!(all.iter().all(|d| d.pci.id.vgpu().is_none()), "slots gone");
    assert_eq!(state_of(&all, &gpu), Some(DeviceState::Dirty));
    assert_eq!(vgpus::free_slots(&db, "A100_10C", 0).await.unwrap(), 0);
    assert_eq!(accounts::gpu_held(&db, owner).await.unwrap(), 0);
}
both!(
    a_gpu_hosts_vgpus_until_its_last_is_scrubbed_on,
    a_gpu_hosts_vgpus_until_its_last_is_scrubbed
);

/// On Postgres the statement that queues tasks tells the other replicas as it commits,
/// each node with new tasks once; results recorded together are announced in one
/// statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queued_tasks_and_recorded_results_are_announced_to_replicas() {
    use passage_model::protocol::{Task, TaskResult};
    use passage_server::store::job_log::{self, NewTask};
    use passage_server::store::tasks::{self, Completion, DONE_CHANNEL, QUEUED_CHANNEL};
    let (_tdb, db, server, _ids) = seeded(Backend::Postgres).await;
    let Db::Postgres(pool) = &db else {
        unreachable!()
    };
    let mut listener = sqlx::postgres::PgListener::connect_with(pool)
        .await
        .unwrap();
    listener
        .listen_all([QUEUED_CHANNEL, DONE_CHANNEL])
        .await
        .unwrap();
    let new = || {
        let id = passage_model::TaskId::new_ordered();
        let t = Task::StopVm {
            vm_uuid: VmId::new_ordered(),
        };
        (id, NewTask::new(id, server, None, &t).unwrap())
    };
    let (t1, n1) = new();
    let (t2, n2) = new();
    job_log::write(&db, &[], &[n1, n2]).await.unwrap();
    let ok = TaskResult::success();
    let other = ServerId::new_random();
    let recorded = tasks::complete_many(
        &db,
        &[
            Completion::new(t1, server, &ok).unwrap(),
            Completion::new(t2, other, &ok).unwrap(),
        ],
    )
    .await
    .unwrap();
    assert_eq!(recorded, vec![true, false]);
    tasks::announce(&db, DONE_CHANNEL, &[t1.to_string(), t2.to_string()])
        .await
        .unwrap();
    let mut heard = Vec::new();
    while let Ok(Ok(n)) =
        tokio::time::timeout(std::time::Duration::from_millis(500), listener.recv()).await
    {
        heard.push((n.channel().to_string(), n.payload().to_string()));
    }
    assert_eq!(
        heard,
        vec![
            (QUEUED_CHANNEL.to_string(), server.to_string()),
            (DONE_CHANNEL.to_string(), t1.to_string()),
            (DONE_CHANNEL.to_string(), t2.to_string()),
        ]
    );
}

/// On SQLite every write queues for the one writer connection. The placer's handle
/// (`first_in_line`) goes ahead of the others: with twenty writers of the ordinary handle
/// waiting, each holding the writer for a while, a write through it waits for the one in
/// progress and at most one more, where the pool alone would serve it last.
#[tokio::test]
async fn a_first_in_line_write_goes_ahead_of_queued_writers() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let tdb = TestDb::new(Backend::Sqlite).await;
    let db = Db::connect(&tdb.url).await.unwrap();
    passage_server::on_write!(&db, |p| sqlx::query("CREATE TABLE queued (who TEXT)")
        .execute(p)
        .await
        .map(|_| ()))
    .unwrap();
    let done = Arc::new(AtomicUsize::new(0));
    async fn write(db: Db, who: String, done: Arc<AtomicUsize>) -> usize {
        passage_server::on_write!(&db, |p| {
            let mut tx = p.begin().await.unwrap();
            sqlx::query("INSERT INTO queued (who) VALUES ($1)")
                .bind(&who)
                .execute(&mut *tx)
                .await
                .unwrap();
            // Holds the writer a while, as a job step's transaction does.
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            tx.commit().await.unwrap();
        });
        done.fetch_add(1, Ordering::SeqCst)
    }
    let queued: Vec<_> = (0..20)
        .map(|i| tokio::spawn(write(db.clone(), format!("job-{i}"), done.clone())))
        .collect();
    // Let them all queue (the first few are done by then).
    tokio::time::sleep(std::time::Duration::from_millis(40)).await;
    let before = done.load(Ordering::SeqCst);
    assert!(
        before < 10,
        "the writers did not queue: {before} done already"
    );
    let placer = write(db.first_in_line(), "placer".into(), done.clone()).await;
    for q in queued {
        q.await.unwrap();
    }
    assert!(
        placer <= before + 2,
        "the first-in-line write finished {}th, after {before} done before it asked",
        placer + 1
    );
}

/// Waits until Postgres's statistics count `changed` rows of `table` changed since its last
/// analysis, and `live` rows in all when given: a backend reports its counts within seconds.
async fn table_counted(pool: &sqlx::PgPool, table: &str, changed: i64, live: Option<i64>) {
    use std::time::{Duration, Instant};
    let t = Instant::now();
    loop {
        let (now_changed, now_live): (i64, i64) = sqlx::query_as(
            "SELECT n_mod_since_analyze, n_live_tup FROM pg_stat_user_tables WHERE relname = $1",
        )
        .bind(table)
        .fetch_one(pool)
        .await
        .unwrap();
        if now_changed >= changed && live.is_none_or(|l| l == now_live) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{changed} changes ({live:?} rows) of {table} never counted"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Postgres: a table filled from empty (a fleet joining) gets its planner statistics
/// gathered by the server's keeper, at most once per interval, without waiting for
/// autovacuum's round.
#[tokio::test]
async fn planner_statistics_follow_a_fleet_joining_on_postgres() {
    use passage_server::store::statistics;
    async fn servers_analyzed(
        pool: &sqlx::PgPool,
        last: &mut std::collections::HashMap<String, statistics::Analyzed>,
    ) -> bool {
        statistics::analyze_due(pool, last)
            .await
            .unwrap()
            .iter()
            .any(|t| t == "servers")
    }
    let tdb = TestDb::new(Backend::Postgres).await;
    let db = Db::connect(&tdb.url).await.unwrap();
    let Db::Postgres(pool) = &db else {
        panic!("a Postgres database")
    };
    let mut last = std::collections::HashMap::new();
    assert!(
        !servers_analyzed(pool, &mut last).await,
        "an empty table is not due"
    );
    sqlx::query(
        "INSERT INTO servers (uuid, hostname, credential_hash, created_at) \
         SELECT 'srv-' || g, 'cn-' || g, 'cred-' || g, 0 FROM generate_series(1, 1000) g",
    )
    .execute(pool)
    .await
    .unwrap();
    table_counted(pool, "servers", 1000, None).await;
    assert!(
        servers_analyzed(pool, &mut last).await,
        "1,000 new rows are due"
    );
    let manual: bool = sqlx::query_scalar(
        "SELECT last_analyze IS NOT NULL FROM pg_stat_user_tables WHERE relname = 'servers'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(manual);
    // Due again by count, but analyzed by this keeper a moment ago.
    sqlx::query("UPDATE servers SET hostname = hostname || '-x'")
        .execute(pool)
        .await
        .unwrap();
    table_counted(pool, "servers", 1000, None).await;
    assert!(
        !servers_analyzed(pool, &mut last).await,
        "analyzed again within the interval"
    );
    assert!(
        servers_analyzed(pool, &mut std::collections::HashMap::new()).await,
        "the same changes are due for a keeper that did not just analyze"
    );
}

/// Postgres: `devices` is analyzed again when devices come or go, not when their states
/// change (a burst of creations turns every free device used).
#[tokio::test]
async fn device_statistics_follow_rows_come_and_gone_not_states() {
    use passage_server::store::statistics;
    use std::time::Duration;
    async fn add(pool: &sqlx::PgPool, from: i64, to: i64) {
        sqlx::query(
            "INSERT INTO servers (uuid, hostname, credential_hash, created_at) \
             SELECT 'srv-' || g, 'cn-' || g, 'cred-' || g, 0 FROM generate_series($1, $2) g",
        )
        .bind(from)
        .bind(to)
        .execute(pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO devices (server_uuid, id, bdf, vendor, device, subvendor, subsystem, \
             revision, class, variant, state, updated_at) \
             SELECT 'srv-' || g, '0000:0' || d || ':00.0', '0000:0' || d || ':00.0', '10de', \
             '2330', '10de', '16c1', 'a1', '030200', 'h100', 'unassigned', 0 \
             FROM generate_series($1, $2) g, generate_series(1, 4) d",
        )
        .bind(from)
        .bind(to)
        .execute(pool)
        .await
        .unwrap();
    }
    let tdb = TestDb::new(Backend::Postgres).await;
    let db = Db::connect(&tdb.url).await.unwrap();
    let Db::Postgres(pool) = &db else {
        panic!("a Postgres database")
    };
    let mut last = std::collections::HashMap::new();
    let devices_analyzed = |done: Vec<String>| done.iter().any(|t| t == "devices");
    // A fleet of 250 nodes × 4 joins: due, as any table filled from empty.
    add(pool, 1, 250).await;
    table_counted(pool, "devices", 1000, Some(1000)).await;
    assert!(devices_analyzed(
        statistics::analyze_due(pool, &mut last).await.unwrap()
    ));
    // Every device taken: as many changes, no row come or gone.
    sqlx::query("UPDATE devices SET state = 'used'")
        .execute(pool)
        .await
        .unwrap();
    table_counted(pool, "devices", 1000, Some(1000)).await;
    // Past the keeper's interval, as its next round would be.
    for a in last.values_mut() {
        a.at = a.at.checked_sub(Duration::from_secs(60)).unwrap();
    }
    assert!(
        !devices_analyzed(statistics::analyze_due(pool, &mut last).await.unwrap()),
        "states changed, rows did not"
    );
    // 250 more nodes join: due by the rows come.
    add(pool, 251, 500).await;
    table_counted(pool, "devices", 2000, Some(2000)).await;
    assert!(devices_analyzed(
        statistics::analyze_due(pool, &mut last).await.unwrap()
    ));
}

/// Postgres: Passage's sessions, the lanes' included, plan with a `random_page_cost` for
/// tables read from memory, and the jobs lane keeps its relaxed commits beside it.
#[tokio::test]
async fn postgres_sessions_plan_for_tables_in_memory() {
    use passage_server::store::Commit;
    async fn setting(db: &Db, name: &str) -> String {
        let Db::Postgres(pool) = db else {
            panic!("a Postgres database")
        };
        sqlx::query_scalar(&format!("SHOW {name}"))
            .fetch_one(pool)
            .await
            .unwrap()
    }
    let tdb = TestDb::new(Backend::Postgres).await;
    let db = Db::connect(&tdb.url).await.unwrap();
    assert_eq!(setting(&db, "random_page_cost").await, "1.1");
    let placer = db.lane(1);
    assert_eq!(setting(&placer, "random_page_cost").await, "1.1");
    assert_eq!(setting(&placer, "synchronous_commit").await, "on");
    let jobs = db.lane_with(2, Commit::Relaxed);
    assert_eq!(setting(&jobs, "random_page_cost").await, "1.1");
    assert_eq!(setting(&jobs, "synchronous_commit").await, "off");
}
