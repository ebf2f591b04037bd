//! Keyset pages (`?after=` and `x-next-cursor`) and SQL-side filters of the lists the
//! portal reads: servers, VMs, jobs and the fleet-wide device list, on SQLite and Postgres.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, Reply, TestServer, fast_config, wait_for};
use chrono::{DateTime, Utc};
use passage_model::api::{DeviceRow, Job, JobState, Server, ServerStatus, Vm, VmState};
use passage_model::{AccountId, DeviceState, ErrorCode, ServerId};
use passage_server::store::Db;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::time::Duration;

/// An item of a list: what identifies it among the others.
trait Item: DeserializeOwned + Clone + Debug {
    fn key(&self) -> String;
}

impl Item for Server {
    fn key(&self) -> String {
        self.uuid.to_string()
    }
}

impl Item for Vm {
    fn key(&self) -> String {
        self.uuid.to_string()
    }
}

impl Item for Job {
    fn key(&self) -> String {
        self.uuid.to_string()
    }
}

impl Item for DeviceRow {
    fn key(&self) -> String {
        format!("{} {}", self.server_uuid, self.id)
    }
}

/// An item of a list read newest first.
trait Timed: Item {
    fn created_at(&self) -> DateTime<Utc>;
}

impl Timed for Server {
    fn created_at(&self) -> DateTime<Utc> {
        self.created_at
    }
}

impl Timed for Vm {
    fn created_at(&self) -> DateTime<Utc> {
        self.created_at
    }
}

impl Timed for Job {
    fn created_at(&self) -> DateTime<Utc> {
        self.created_at
    }
}

/// One answer of a list; `x-resource-count` and `x-next-cursor` through [`total`] and
/// [`next`].
async fn list<T: Item>(
    s: &TestServer,
    token: &str,
    path: &str,
    query: &[(&str, &str)],
) -> Reply<Vec<T>> {
    s.with(token).get_query(path, query).await
}

fn total<T>(r: &Reply<T>) -> Option<i64> {
    r.header("x-resource-count").map(|v| v.parse().unwrap())
}

fn next<T>(r: &Reply<T>) -> Option<String> {
    r.header("x-next-cursor").map(String::from)
}

/// Every page of a list `limit` items at a time, following `x-next-cursor`: checks each
/// page's size, count header and cursor, and answers the items in the order read.
async fn walk<T: Item>(
    s: &TestServer,
    token: &str,
    path: &str,
    filters: &[(&str, &str)],
    limit: usize,
) -> Vec<T> {
    let limit_s = limit.to_string();
    let mut items = Vec::new();
    let mut after: Option<String> = None;
    let mut all_items = None;
    for pages in 1.. {
        assert!(pages < 1000, "{path}: no end");
        let mut q: Vec<(&str, &str)> = filters.to_vec();
        q.push(("limit", &limit_s));
        if let Some(a) = &after {
            q.push(("after", a));
        }
        let l = list::<T>(s, token, path, &q).await;
        let t = total(&l).expect("x-resource-count on every page");
        let cursor = next(&l);
        let page = l.ok(200);
        let n = page.len();
        assert!(n <= limit, "{path}: a page over the limit");
        assert_eq!(*all_items.get_or_insert(t), t, "{path}: the total moved");
        items.extend(page);
        match cursor {
            Some(c) => {
                assert_eq!(n, limit, "{path}: a short page with a cursor");
                after = Some(c);
            }
            None => break,
        }
    }
    assert_eq!(
        i64::try_from(items.len()).unwrap(),
        all_items.unwrap(),
        "{path} {filters:?}: the pages hold what x-resource-count says"
    );
    items
}

/// The same list in one page of 1000.
async fn all<T: Item>(s: &TestServer, token: &str, path: &str, filters: &[(&str, &str)]) -> Vec<T> {
    let mut q = filters.to_vec();
    q.push(("limit", "1000"));
    let l = list(s, token, path, &q).await;
    assert!(next(&l).is_none(), "{path}: a cursor after the last page");
    l.ok(200)
}

fn keys<T: Item>(items: &[T]) -> Vec<String> {
    items.iter().map(Item::key).collect()
}

/// Walks with several page sizes: the same items as one big page, each once, in order.
async fn walks_like_one_page<T: Item>(
    s: &TestServer,
    token: &str,
    path: &str,
    filters: &[(&str, &str)],
) -> Vec<T> {
    let whole: Vec<T> = all(s, token, path, filters).await;
    let ids = keys(&whole);
    let unique: BTreeSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), ids.len(), "{path}: an item twice");
    for limit in [1, 2, 3] {
        let walked: Vec<T> = walk(s, token, path, filters, limit).await;
        assert_eq!(
            keys(&walked),
            ids,
            "{path} {filters:?}: pages of {limit} differ from one page"
        );
    }
    whole
}

/// Newest first, then uuid descending among equal times: what the time-ordered lists
/// promise (uuids compare the same in any collation: hex digits, hyphens in place).
fn assert_newest_first<T: Timed>(items: &[T]) {
    for w in items.windows(2) {
        let (a, b) = (
            (w[0].created_at(), w[0].key()),
            (w[1].created_at(), w[1].key()),
        );
        assert!(
            a.0 > b.0 || (a.0 == b.0 && a.1 > b.1),
            "out of order: {a:?} before {b:?}"
        );
    }
}

async fn set_int(
    s: &TestServer,
    table: &str,
    col: &str,
    uuid: impl std::fmt::Display,
    v: Option<i64>,
) {
    let sql = format!("UPDATE {table} SET {col} = $1 WHERE uuid = $2");
    let uuid = uuid.to_string();
    let n = match &s.ctx.db {
        Db::Sqlite { write, .. } => sqlx::query(&sql)
            .bind(v)
            .bind(&uuid)
            .execute(write)
            .await
            .unwrap()
            .rows_affected(),
        Db::Postgres(p) => sqlx::query(&sql)
            .bind(v)
            .bind(&uuid)
            .execute(p)
            .await
            .unwrap()
            .rows_affected(),
    };
    assert_eq!(n, 1, "{sql} {uuid}");
}

async fn set_text(s: &TestServer, table: &str, col: &str, uuid: impl std::fmt::Display, v: &str) {
    let sql = format!("UPDATE {table} SET {col} = $1 WHERE uuid = $2");
    let uuid = uuid.to_string();
    let n = match &s.ctx.db {
        Db::Sqlite { write, .. } => sqlx::query(&sql)
            .bind(v)
            .bind(&uuid)
            .execute(write)
            .await
            .unwrap()
            .rows_affected(),
        Db::Postgres(p) => sqlx::query(&sql)
            .bind(v)
            .bind(&uuid)
            .execute(p)
            .await
            .unwrap()
            .rows_affected(),
    };
    assert_eq!(n, 1, "{sql} {uuid}");
}

/// Many rows share a creation time, so the uuid tie-breaker carries the order.
const T0: i64 = 1_600_000_000_000;

/// Five hand-registered nodes of two H100s each (their tasks are never answered, so
/// VMs stay `provisioning` and jobs `running`), named cn-b, cn-b, cn-a, cn-a, cn-c; tenants
/// alice (4 VMs) and bob (3 VMs). Creation times are rewritten to collide.
struct Fleet {
    s: TestServer,
    servers: Vec<ServerId>,
    alice: (AccountId, String),
    bob: (AccountId, String),
    vms: Vec<Vm>,
}

async fn fleet(b: Backend) -> Fleet {
    let cfg = passage_server::config::Config {
        heartbeat_timeout: Duration::from_secs(600),
        task_timeout: Duration::from_secs(600),
        ..fast_config()
    };
    let s = TestServer::start(b, cfg).await;
    s.h100_catalog(1).await;
    let mut servers = Vec::new();
    for (i, host) in ["cn-b", "cn-b", "cn-a", "cn-a", "cn-c"].iter().enumerate() {
        let (uuid, _, _) = s.manual_node(2).await;
        s.patch::<Server>(&format!("/v1/servers/{uuid}"), &json!({ "hostname": host }))
            .await
            .ok(200);
        set_int(&s, "servers", "created_at", uuid, Some(T0 + (i as i64 % 2))).await;
        servers.push(uuid);
    }
    let alice = s.tenant("alice").await;
    let bob = s.tenant("bob").await;
    let mut vms = Vec::new();
    for (i, who) in [&alice, &alice, &bob, &alice, &bob, &alice, &bob]
        .iter()
        .enumerate()
    {
        let vm: Vm = s
            .with(&who.1)
            .post(
                "/v1/vms",
                &json!({"image": "test-image", "alias": format!("vm-{i}"), "package": "gpu-1x"}),
            )
            .await
            .ok(202);
        let t = T0 + (i as i64 % 3);
        set_int(&s, "vms", "created_at", vm.uuid, Some(t)).await;
        set_int(&s, "jobs", "created_at", vm.job_uuid.unwrap(), Some(t)).await;
        vms.push(vm);
    }
    Fleet {
        s,
        servers,
        alice,
        bob,
        vms,
    }
}

async fn servers_vms_and_jobs_page_by_cursor(b: Backend) {
    let f = fleet(b).await;
    let s = &f.s;
    let admin = s.admin.clone();

    // Servers: every one once, newest first, whatever the page size.
    let whole: Vec<Server> = walks_like_one_page(s, &admin, "/v1/servers", &[]).await;
    assert_eq!(whole.len(), 5);
    assert_newest_first(&whole);
    let listed: BTreeSet<ServerId> = whole.iter().map(|s| s.uuid).collect();
    assert_eq!(listed, f.servers.iter().copied().collect());
    // The server objects of a page are whole: devices and VMs included.
    let held: usize = whole.iter().map(|s| s.vms.as_ref().unwrap().len()).sum();
    assert_eq!(held, 7);
    for srv in &whole {
        let devices = srv.assignable_devices.as_ref().unwrap();
        assert_eq!(devices.len(), 2);
        assert_eq!(devices[0].kind, passage_model::variant::DeviceType::Gpu);
        assert!(srv.sysinfo.as_ref().unwrap().pci_devices.len() > 2);
    }
    // A brief page: the same servers and assignable devices, without inventory or VMs.
    let brief: Vec<Server> =
        walks_like_one_page(s, &admin, "/v1/servers", &[("brief", "true")]).await;
    assert_eq!(keys(&brief), keys(&whole));
    for (b, w) in brief.iter().zip(&whole) {
        let mut by_state: BTreeMap<DeviceState, u32> = BTreeMap::new();
        for d in w.assignable_devices.as_ref().unwrap() {
            *by_state.entry(d.state).or_default() += 1;
        }
        assert_eq!(b.device_counts, by_state, "{b:?}");
        assert_eq!(w.device_counts, b.device_counts);
        assert_eq!((&b.status, &b.hostname), (&w.status, &w.hostname));
        assert!(
            b.sysinfo.is_none() && b.assignable_devices.is_none() && b.vms.is_none(),
            "{b:?}"
        );
    }
    assert!(
        brief
            .iter()
            .any(|b| b.device_counts.get(&DeviceState::Provisioning) == Some(&2)),
        "held devices are counted"
    );
    list::<Server>(s, &admin, "/v1/servers", &[("brief", "yes")])
        .await
        .invalid("brief");

    // VMs: all of them for an operator, a tenant's own for the tenant; filters and
    // cursors together.
    let whole: Vec<Vm> = walks_like_one_page(s, &admin, "/v1/vms", &[]).await;
    assert_eq!(whole.len(), 7);
    assert_newest_first(&whole);
    let mine: Vec<Vm> = walks_like_one_page(s, &f.alice.1, "/v1/vms", &[]).await;
    assert_eq!(mine.len(), 4);
    assert!(mine.iter().all(|v| v.owner_uuid == f.alice.0));
    assert_newest_first(&mine);
    let bob = f.bob.0.to_string();
    let alice = f.alice.0.to_string();
    let bobs: Vec<Vm> = walks_like_one_page(s, &admin, "/v1/vms", &[("owner_uuid", &bob)]).await;
    assert_eq!(bobs.len(), 3);
    let none: Vec<Vm> =
        walks_like_one_page(s, &f.alice.1, "/v1/vms", &[("owner_uuid", &bob)]).await;
    assert!(none.is_empty());
    let provisioning: Vec<Vm> = walks_like_one_page(
        s,
        &admin,
        "/v1/vms",
        &[("state", "provisioning"), ("owner_uuid", &alice)],
    )
    .await;
    assert_eq!(provisioning.len(), 4);
    assert!(
        provisioning
            .iter()
            .all(|v| v.state == VmState::Provisioning)
    );
    let running: Vec<Vm> = walks_like_one_page(s, &admin, "/v1/vms", &[("state", "running")]).await;
    assert!(running.is_empty());
    let on_server: BTreeMap<ServerId, usize> = whole.iter().fold(BTreeMap::new(), |mut m, v| {
        *m.entry(v.server_uuid.unwrap()).or_default() += 1;
        m
    });
    for (server, n) in &on_server {
        let here: Vec<Vm> = walks_like_one_page(
            s,
            &admin,
            "/v1/vms",
            &[("server_uuid", &server.to_string())],
        )
        .await;
        assert_eq!(here.len(), *n);
        assert!(here.iter().all(|v| v.server_uuid == Some(*server)));
    }
    let vm = &f.vms[3];
    let dev = vm.assigned_devices[0].to_string();
    // Every node has the same tree, so the same paths: a path names a device on a server.
    let holders: Vec<Vm> =
        walks_like_one_page(s, &admin, "/v1/vms", &[("assigned_device", &dev)]).await;
    let expected: Vec<String> = whole
        .iter()
        .filter(|v| v.assigned_devices[0].to_string() == dev)
        .map(Item::key)
        .collect();
    assert_eq!(keys(&holders), expected);
    let holder: Vec<Vm> = walks_like_one_page(
        s,
        &admin,
        "/v1/vms",
        &[
            ("assigned_device", &dev),
            ("server_uuid", &vm.server_uuid.unwrap().to_string()),
        ],
    )
    .await;
    assert_eq!(keys(&holder), [vm.key()]);

    // A page read by cursor does not shift when newer items arrive meanwhile.
    let first = list::<Vm>(s, &admin, "/v1/vms", &[("limit", "3")]).await;
    let cursor = next(&first).unwrap();
    let first = first.ok(200);
    s.with(&f.bob.1)
        .post::<Vm>(
            "/v1/vms",
            &json!({"image": "test-image", "alias": "late", "package": "gpu-1x"}),
        )
        .await
        .ok(202);
    let rest = list::<Vm>(
        s,
        &admin,
        "/v1/vms",
        &[("limit", "1000"), ("after", &cursor)],
    )
    .await;
    assert_eq!(total(&rest), Some(8));
    let mut seen = keys(&first);
    seen.extend(keys(&rest.ok(200)));
    assert_eq!(seen, keys(&whole), "the later VM is not on later pages");

    // Offset pages still work, and name the cursor of the page after them.
    let by_offset = list::<Vm>(s, &admin, "/v1/vms", &[("limit", "2"), ("offset", "2")]).await;
    assert_eq!(total(&by_offset), Some(8));
    let cursor = next(&by_offset).unwrap();
    let now: Vec<Vm> = all(s, &admin, "/v1/vms", &[]).await;
    assert_eq!(keys(&by_offset.ok(200)), keys(&now[2..4]));
    let after: Vec<Vm> = list(s, &admin, "/v1/vms", &[("limit", "2"), ("after", &cursor)])
        .await
        .ok(200);
    assert_eq!(keys(&after), keys(&now[4..6]));

    // Jobs: one provision job per VM, each running (its task is never answered).
    let ok = wait_for(Duration::from_secs(30), || async {
        let l = list::<Job>(
            s,
            &admin,
            "/v1/jobs",
            &[("state", "running"), ("limit", "1000")],
        )
        .await;
        (total(&l) == Some(8)).then_some(())
    })
    .await;
    assert!(ok.is_some(), "the provision jobs did not start");
    let jobs: Vec<Job> = walks_like_one_page(s, &admin, "/v1/jobs", &[]).await;
    assert_eq!(jobs.len(), 8);
    assert_newest_first(&jobs);
    assert!(jobs.iter().all(|j| !j.steps.is_empty()));
    for j in &jobs {
        let one: Job = s.get(&format!("/v1/jobs/{}", j.uuid)).await.ok(200);
        assert_eq!(
            (one.uuid, &one.name, one.vm_uuid, one.created_at),
            (j.uuid, &j.name, j.vm_uuid, j.created_at),
            "a listed job is the job"
        );
        let names = |j: &Job| -> Vec<String> { j.steps.iter().map(|s| s.name.clone()).collect() };
        assert_eq!(names(&one), names(j));
    }
    let alices: Vec<Job> = walks_like_one_page(s, &f.alice.1, "/v1/jobs", &[]).await;
    let alice_vms: BTreeSet<_> = mine.iter().map(|v| v.uuid).collect();
    assert_eq!(alices.len(), 4);
    assert!(
        alices
            .iter()
            .all(|j| alice_vms.contains(&j.vm_uuid.unwrap()))
    );
    for vm in [&f.vms[0], &f.vms[4]] {
        set_text(s, "jobs", "state", vm.job_uuid.unwrap(), "succeeded").await;
    }
    let done: Vec<Job> =
        walks_like_one_page(s, &admin, "/v1/jobs", &[("state", "succeeded")]).await;
    assert_eq!(done.len(), 2);
    assert!(done.iter().all(|j| j.state == JobState::Succeeded));
    let running: Vec<Job> =
        walks_like_one_page(s, &admin, "/v1/jobs", &[("state", "running")]).await;
    assert_eq!(running.len(), 6);
    let bob_done: Vec<Job> =
        walks_like_one_page(s, &f.bob.1, "/v1/jobs", &[("state", "succeeded")]).await;
    assert_eq!(keys(&bob_done), [f.vms[4].job_uuid.unwrap().to_string()]);
    let failed = list::<Job>(s, &admin, "/v1/jobs", &[("state", "failed")]).await;
    assert_eq!((total(&failed), next(&failed)), (Some(0), None));
    list::<Job>(s, &admin, "/v1/jobs", &[("state", "done")])
        .await
        .invalid("state");

    // By status, derived from the last heartbeat in SQL.
    set_int(s, "servers", "last_heartbeat", f.servers[0], None).await;
    set_int(s, "servers", "last_heartbeat", f.servers[1], Some(1000)).await;
    let running: Vec<Server> =
        walks_like_one_page(s, &admin, "/v1/servers", &[("status", "running")]).await;
    assert_eq!(running.len(), 3);
    assert!(running.iter().all(|s| s.status == ServerStatus::Running));
    for (status, want, server) in [
        ("unknown", ServerStatus::Unknown, f.servers[0]),
        ("offline", ServerStatus::Offline, f.servers[1]),
    ] {
        let only: Vec<Server> =
            walks_like_one_page(s, &admin, "/v1/servers", &[("status", status)]).await;
        assert_eq!(keys(&only), [server.to_string()], "{status}");
        assert_eq!(only[0].status, want);
    }
    list::<Server>(s, &admin, "/v1/servers", &[("status", "sideways")])
        .await
        .invalid("status");
}
both!(
    servers_vms_and_jobs_page_by_cursor_on,
    servers_vms_and_jobs_page_by_cursor
);

async fn the_fleet_device_list(b: Backend) {
    let f = fleet(b).await;
    let s = &f.s;
    let admin = s.admin.clone();
    let whole: Vec<DeviceRow> = walks_like_one_page(s, &admin, "/v1/devices", &[]).await;
    assert_eq!(whole.len(), 10, "two H100s on each of five servers");
    // Ordered by hostname, then server, then device id: each server's devices together.
    let hosts: Vec<&str> = whole.iter().map(|d| d.hostname.as_str()).collect();
    assert_eq!(
        hosts,
        [
            "cn-a", "cn-a", "cn-a", "cn-a", "cn-b", "cn-b", "cn-b", "cn-b", "cn-c", "cn-c"
        ]
    );
    let servers: Vec<ServerId> = whole.iter().map(|d| d.server_uuid).collect();
    for w in servers.chunks(2) {
        assert_eq!(w[0], w[1], "a server's devices are listed together");
    }
    if b == Backend::Sqlite {
        // Byte order on SQLite (Postgres compares text in the database's collation).
        let keys: Vec<(String, String, String)> = whole
            .iter()
            .map(|d| {
                (
                    d.hostname.clone(),
                    d.server_uuid.to_string(),
                    d.id.to_string(),
                )
            })
            .collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
    }
    let held: BTreeMap<(ServerId, String), passage_model::VmId> = f
        .vms
        .iter()
        .map(|v| {
            (
                (v.server_uuid.unwrap(), v.assigned_devices[0].to_string()),
                v.uuid,
            )
        })
        .collect();
    for d in &whole {
        assert_eq!(d.address, d.id.address(), "{d:?}");
        assert_eq!(d.variant.as_deref(), Some("NVIDIA_H100"));
        assert_eq!(
            (d.vendor.to_string(), d.device.to_string()),
            ("10de".to_string(), "2330".to_string())
        );
        let server = s.server(d.server_uuid).await;
        assert_eq!(server.hostname, d.hostname);
        let same = server
            .assignable_devices
            .unwrap()
            .into_iter()
            .find(|a| a.id == d.id)
            .unwrap();
        assert_eq!((same.state, same.used_by), (d.state, d.used_by));
        match held.get(&(d.server_uuid, d.id.to_string())) {
            Some(vm) => {
                assert_eq!(d.state, DeviceState::Provisioning);
                assert_eq!(d.used_by, Some(*vm));
            }
            None => assert_eq!((d.state, d.used_by), (DeviceState::Unassigned, None)),
        }
    }

    // Filters, alone and together, with cursors.
    let one = f.servers[2];
    let here: Vec<DeviceRow> = walks_like_one_page(
        s,
        &admin,
        "/v1/devices",
        &[("server_uuid", &one.to_string())],
    )
    .await;
    assert_eq!(here.len(), 2);
    assert!(here.iter().all(|d| d.server_uuid == one));
    let used: Vec<DeviceRow> =
        walks_like_one_page(s, &admin, "/v1/devices", &[("state", "provisioning")]).await;
    assert_eq!(used.len(), 7);
    let free: Vec<DeviceRow> = walks_like_one_page(
        s,
        &admin,
        "/v1/devices",
        &[("state", "unassigned"), ("variant", "NVIDIA_H100")],
    )
    .await;
    assert_eq!(free.len(), 3);
    for srv in &f.servers {
        let n = free.iter().filter(|d| d.server_uuid == *srv).count();
        let both: Vec<DeviceRow> = walks_like_one_page(
            s,
            &admin,
            "/v1/devices",
            &[("state", "unassigned"), ("server_uuid", &srv.to_string())],
        )
        .await;
        assert_eq!(both.len(), n);
    }
    let l = list::<DeviceRow>(s, &admin, "/v1/devices", &[("variant", "NVIDIA_NOPE")]).await;
    assert_eq!((total(&l), next(&l)), (Some(0), None));
    assert!(l.ok(200).is_empty());
    list::<DeviceRow>(s, &admin, "/v1/devices", &[("state", "gone")])
        .await
        .invalid("state");
    list::<DeviceRow>(s, &admin, "/v1/devices", &[("server_uuid", "cn-a")])
        .await
        .invalid("server_uuid");

    // Staff only: a reader may look, a tenant may not.
    list::<DeviceRow>(s, &f.alice.1, "/v1/devices", &[])
        .await
        .fails(403, ErrorCode::Forbidden);
    let reader = s.reader("rita").await;
    let seen: Vec<DeviceRow> = walks_like_one_page(s, &reader, "/v1/devices", &[]).await;
    assert_eq!(keys(&seen), keys(&whole));
}
both!(the_fleet_device_list_on, the_fleet_device_list);

async fn bad_cursors_are_refused(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    s.h100_catalog(1).await;
    s.manual_node(2).await;
    s.manual_node(2).await;
    let admin = s.admin.clone();
    let time = list::<Server>(&s, &admin, "/v1/servers", &[("limit", "1")]).await;
    let time_cursor = next(&time).expect("a cursor: two servers, pages of one");
    let dev = list::<DeviceRow>(&s, &admin, "/v1/devices", &[("limit", "1")]).await;
    let dev_cursor = next(&dev).expect("a cursor: four devices, pages of one");
    let nul = format!("{time_cursor}\0");
    let long = format!("{}{}", "1".repeat(2000), &time_cursor[13..]);
    let upper = time_cursor.to_uppercase();
    let bad = [
        "x",
        "nonsense",
        "1.2.3",
        "-5.00000000-0000-0000-0000-000000000000",
        "1.not-a-uuid",
        "99999999999999999999.00000000-0000-0000-0000-000000000000",
        "1.{00000000-0000-0000-0000-000000000000}",
        "💥",
        &nul,
        &long,
        &dev_cursor,
    ];
    // A cursor of another list of the same kind is a valid starting point, and its case
    // does not matter.
    let good = [time_cursor.as_str(), upper.as_str()];
    time_cursors::<Server>(&s, "/v1/servers", &bad, &good).await;
    time_cursors::<Vm>(&s, "/v1/vms", &bad, &good).await;
    time_cursors::<Job>(&s, "/v1/jobs", &bad, &good).await;
    for bad in [
        "cn~x~/devices/pci0000:00/0000:00:01.0",
        &time_cursor,
        "a~b~c~d",
        "~~",
    ] {
        list::<DeviceRow>(&s, &admin, "/v1/devices", &[("after", bad)])
            .await
            .invalid("after");
    }
    let plain: Vec<DeviceRow> = list(&s, &admin, "/v1/devices", &[("after", &dev_cursor)])
        .await
        .ok(200);
    let skipped: Vec<DeviceRow> = list(
        &s,
        &admin,
        "/v1/devices",
        &[("after", &dev_cursor), ("offset", "2")],
    )
    .await
    .ok(200);
    assert_eq!(
        keys(&skipped),
        keys(&plain[2..]),
        "offset skips items after the cursor"
    );
    // After the last item: an empty page, the total, no cursor.
    let whole: Vec<DeviceRow> = all(&s, &admin, "/v1/devices", &[]).await;
    assert_eq!(whole.len(), 4);
    let last = &whole[3];
    let cursor = format!("{}~{}~{}", last.hostname, last.server_uuid, last.id);
    let tail = list::<DeviceRow>(&s, &admin, "/v1/devices", &[("after", &cursor)]).await;
    assert_eq!((total(&tail), next(&tail)), (Some(4), None));
    assert!(tail.ok(200).is_empty());
    let servers: Vec<Server> = all(&s, &admin, "/v1/servers", &[]).await;
    let last = &servers[1];
    let cursor = format!("{}.{}", last.created_at.timestamp_millis(), last.uuid);
    let tail = list::<Server>(&s, &admin, "/v1/servers", &[("after", &cursor)]).await;
    assert_eq!((total(&tail), next(&tail)), (Some(2), None));
    assert!(tail.ok(200).is_empty());
}
both!(bad_cursors_are_refused_on, bad_cursors_are_refused);

/// What every time-ordered list does with cursors: `bad` ones refused naming `after`,
/// `good` ones taken, an offset skipping items after the cursor.
async fn time_cursors<T: Item>(s: &TestServer, path: &str, bad: &[&str], good: &[&str]) {
    let admin = s.admin.clone();
    for b in bad {
        list::<T>(s, &admin, path, &[("after", b)])
            .await
            .invalid("after");
    }
    for g in good {
        list::<T>(s, &admin, path, &[("after", g)]).await.ok(200);
    }
    let plain: Vec<T> = list(s, &admin, path, &[("after", good[1])]).await.ok(200);
    for (skip, n) in [("0", 0), ("1", 1), ("3", 3)] {
        let got: Vec<T> = list(s, &admin, path, &[("after", good[1]), ("offset", skip)])
            .await
            .ok(200);
        let want: Vec<String> = keys(&plain).into_iter().skip(n).collect();
        assert_eq!(keys(&got), want, "{path} after the cursor, offset {skip}");
    }
    // An empty value is a value, and not a cursor.
    list::<T>(s, &admin, path, &[("after", ""), ("offset", "1")])
        .await
        .invalid("after");
}

/// The document is read as it is served: what it states of each parameter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursors_and_filters_are_documented() {
    let s = TestServer::start(Backend::Sqlite, fast_config()).await;
    let (st, doc) = s.call("GET", "/v1/openapi.json", None, None).await;
    assert_eq!(st, 200);
    let param = |path: &str, name: &str| -> Value {
        doc["paths"][path]["get"]["parameters"]
            .as_array()
            .unwrap_or_else(|| panic!("{path} has no parameters"))
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("{path} does not document {name}"))
            .clone()
    };
    for path in ["/v1/servers", "/v1/vms", "/v1/jobs"] {
        assert_eq!(
            param(path, "after")["schema"]["pattern"],
            passage_server::listing::TIME_CURSOR_PATTERN,
            "{path}"
        );
        let ok = &doc["paths"][path]["get"]["responses"]["200"];
        assert!(ok["headers"]["x-next-cursor"].is_object(), "{path}: {ok}");
        assert!(
            ok["headers"]["x-resource-count"].is_object(),
            "{path}: {ok}"
        );
    }
    assert_eq!(
        param("/v1/devices", "after")["schema"]["pattern"],
        passage_server::listing::DEVICE_CURSOR_PATTERN
    );
    for name in ["limit", "offset", "state", "variant", "server_uuid"] {
        param("/v1/devices", name);
    }
    param("/v1/servers", "status");
    param("/v1/jobs", "state");
    assert!(doc["components"]["schemas"]["DeviceRow"].is_object());
}
