//! Keyset pages (`?after=` and `x-next-cursor`) and SQL-side filters of the lists the
//! portal reads: servers, VMs, jobs and the fleet-wide device list, on SQLite and Postgres.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config, wait_for};
use passage_server::store::Db;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// One answer of a list: status, body, `x-resource-count`, `x-next-cursor`.
struct Listed {
    status: u16,
    body: Value,
    total: Option<i64>,
    next: Option<String>,
}

async fn list(s: &TestServer, token: &str, path: &str, query: &[(&str, &str)]) -> Listed {
    let r = s
        .http
        .get(s.url(path))
        .query(query)
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    let header = |k: &str| r.headers().get(k).map(|v| v.to_str().unwrap().to_string());
    let total = header("x-resource-count").map(|v| v.parse().unwrap());
    let next = header("x-next-cursor");
    let status = r.status().as_u16();
    Listed {
        status,
        body: r.json().await.unwrap(),
        total,
        next,
    }
}

/// Every page of a list `limit` items at a time, following `x-next-cursor`: checks each
/// page's size, count header and cursor, and answers the items in the order read.
async fn walk(
    s: &TestServer,
    token: &str,
    path: &str,
    filters: &[(&str, &str)],
    limit: usize,
) -> Vec<Value> {
    let limit_s = limit.to_string();
    let mut items = Vec::new();
    let mut after: Option<String> = None;
    let mut total = None;
    for pages in 1.. {
        assert!(pages < 1000, "{path}: no end");
        let mut q: Vec<(&str, &str)> = filters.to_vec();
        q.push(("limit", &limit_s));
        if let Some(a) = &after {
            q.push(("after", a));
        }
        let l = list(s, token, path, &q).await;
        assert_eq!(l.status, 200, "{path} {q:?}: {}", l.body);
        let page = l.body.as_array().unwrap().clone();
        assert!(page.len() <= limit, "{path}: a page over the limit");
        let t = l.total.expect("x-resource-count on every page");
        assert_eq!(*total.get_or_insert(t), t, "{path}: the total moved");
        items.extend(page.iter().cloned());
        match l.next {
            Some(c) => {
                assert_eq!(page.len(), limit, "{path}: a short page with a cursor");
                after = Some(c);
            }
            None => break,
        }
    }
    assert_eq!(
        i64::try_from(items.len()).unwrap(),
        total.unwrap(),
        "{path} {filters:?}: the pages hold what x-resource-count says"
    );
    items
}

/// The same list in one page of 1000.
async fn all(s: &TestServer, token: &str, path: &str, filters: &[(&str, &str)]) -> Vec<Value> {
    let mut q = filters.to_vec();
    q.push(("limit", "1000"));
    let l = list(s, token, path, &q).await;
    assert_eq!(l.status, 200, "{}", l.body);
    assert!(l.next.is_none(), "{path}: a cursor after the last page");
    l.body.as_array().unwrap().clone()
}

fn field<'a>(items: &'a [Value], k: &str) -> Vec<&'a str> {
    items.iter().map(|v| v[k].as_str().unwrap()).collect()
}

/// What identifies an item of a list.
type Key = fn(&Value) -> String;

fn uuid_of(v: &Value) -> String {
    v["uuid"].as_str().unwrap().to_string()
}

fn device_of(v: &Value) -> String {
    format!(
        "{} {}",
        v["server_uuid"].as_str().unwrap(),
        v["id"].as_str().unwrap()
    )
}

/// Walks with several page sizes: the same items as one big page, each once, in order.
async fn walks_like_one_page(
    s: &TestServer,
    token: &str,
    path: &str,
    filters: &[(&str, &str)],
    key: Key,
) -> Vec<Value> {
    let whole = all(s, token, path, filters).await;
    let ids: Vec<String> = whole.iter().map(key).collect();
    let unique: BTreeSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), ids.len(), "{path}: an item twice");
    for limit in [1, 2, 3] {
        let walked = walk(s, token, path, filters, limit).await;
        assert_eq!(
            walked.iter().map(key).collect::<Vec<_>>(),
            ids,
            "{path} {filters:?}: pages of {limit} differ from one page"
        );
    }
    whole
}

/// Newest first, then uuid descending among equal times: what the time-ordered lists
/// promise (uuids compare the same in any collation: hex digits, hyphens in place).
fn assert_newest_first(items: &[Value]) {
    let keys: Vec<(String, String)> = items
        .iter()
        .map(|v| {
            (
                v["created_at"].as_str().unwrap().to_string(),
                v["uuid"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for w in keys.windows(2) {
        let t = |s: &str| chrono::DateTime::parse_from_rfc3339(s).unwrap();
        let (a, b) = (&w[0], &w[1]);
        assert!(
            t(&a.0) > t(&b.0) || (t(&a.0) == t(&b.0) && a.1 > b.1),
            "out of order: {a:?} before {b:?}"
        );
    }
}

async fn set_int(s: &TestServer, table: &str, col: &str, uuid: &str, v: Option<i64>) {
    let sql = format!("UPDATE {table} SET {col} = $1 WHERE uuid = $2");
    let n = match &s.ctx.db {
        Db::Sqlite { write, .. } => sqlx::query(&sql)
            .bind(v)
            .bind(uuid)
            .execute(write)
            .await
            .unwrap()
            .rows_affected(),
        Db::Postgres(p) => sqlx::query(&sql)
            .bind(v)
            .bind(uuid)
            .execute(p)
            .await
            .unwrap()
            .rows_affected(),
    };
    assert_eq!(n, 1, "{sql} {uuid}");
}

async fn set_text(s: &TestServer, table: &str, col: &str, uuid: &str, v: &str) {
    let sql = format!("UPDATE {table} SET {col} = $1 WHERE uuid = $2");
    let n = match &s.ctx.db {
        Db::Sqlite { write, .. } => sqlx::query(&sql)
            .bind(v)
            .bind(uuid)
            .execute(write)
            .await
            .unwrap()
            .rows_affected(),
        Db::Postgres(p) => sqlx::query(&sql)
            .bind(v)
            .bind(uuid)
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
    servers: Vec<String>,
    alice: (String, String),
    bob: (String, String),
    vms: Vec<Value>,
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
        let (st, e) = s
            .admin_call(
                "PATCH",
                &format!("/v1/servers/{uuid}"),
                Some(json!({ "hostname": host })),
            )
            .await;
        assert_eq!(st, 200, "{e}");
        set_int(
            &s,
            "servers",
            "created_at",
            &uuid,
            Some(T0 + (i as i64 % 2)),
        )
        .await;
        servers.push(uuid);
    }
    let alice = s.tenant("alice").await;
    let bob = s.tenant("bob").await;
    let mut vms = Vec::new();
    for (i, who) in [&alice, &alice, &bob, &alice, &bob, &alice, &bob]
        .iter()
        .enumerate()
    {
        let (st, vm) = s
            .call(
                "POST",
                "/v1/vms",
                Some(&who.1),
                Some(json!({"alias": format!("vm-{i}"), "package": "gpu-1x"})),
            )
            .await;
        assert_eq!(st, 202, "{vm}");
        let t = T0 + (i as i64 % 3);
        set_int(
            &s,
            "vms",
            "created_at",
            vm["uuid"].as_str().unwrap(),
            Some(t),
        )
        .await;
        set_int(
            &s,
            "jobs",
            "created_at",
            vm["job_uuid"].as_str().unwrap(),
            Some(t),
        )
        .await;
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
    let whole = walks_like_one_page(s, &admin, "/v1/servers", &[], uuid_of).await;
    assert_eq!(whole.len(), 5);
    assert_newest_first(&whole);
    let listed: BTreeSet<&str> = field(&whole, "uuid").into_iter().collect();
    assert_eq!(listed, f.servers.iter().map(String::as_str).collect());
    // The server objects of a page are whole: devices and VMs included.
    let held: usize = whole
        .iter()
        .map(|s| s["vms"].as_object().unwrap().len())
        .sum();
    assert_eq!(held, 7);
    for srv in &whole {
        assert_eq!(srv["assignable_devices"].as_array().unwrap().len(), 2);
        assert_eq!(srv["assignable_devices"][0]["type"], "gpu");
        assert!(srv["sysinfo"]["PCI Devices"].as_array().unwrap().len() > 2);
    }
    // A brief page: the same servers and assignable devices, without inventory or VMs.
    let brief = walks_like_one_page(s, &admin, "/v1/servers", &[("brief", "true")], uuid_of).await;
    assert_eq!(field(&brief, "uuid"), field(&whole, "uuid"));
    for (b, w) in brief.iter().zip(&whole) {
        let mut by_state = serde_json::Map::new();
        for d in w["assignable_devices"].as_array().unwrap() {
            let st = d["state"].as_str().unwrap().to_string();
            let n = by_state.get(&st).and_then(Value::as_u64).unwrap_or(0);
            by_state.insert(st, json!(n + 1));
        }
        assert_eq!(b["device_counts"], Value::Object(by_state), "{b}");
        assert_eq!(w["device_counts"], b["device_counts"]);
        assert_eq!(
            (&b["status"], &b["hostname"]),
            (&w["status"], &w["hostname"])
        );
        for gone in ["sysinfo", "assignable_devices", "vms"] {
            assert!(b.get(gone).is_none(), "{b}");
        }
    }
    assert!(
        brief
            .iter()
            .any(|b| b["device_counts"]["provisioning"] == 2),
        "held devices are counted"
    );
    let l = list(s, &admin, "/v1/servers", &[("brief", "yes")]).await;
    assert_invalid(&l, "brief");

    // VMs: all of them for an operator, a tenant's own for the tenant; filters and
    // cursors together.
    let whole = walks_like_one_page(s, &admin, "/v1/vms", &[], uuid_of).await;
    assert_eq!(whole.len(), 7);
    assert_newest_first(&whole);
    let mine = walks_like_one_page(s, &f.alice.1, "/v1/vms", &[], uuid_of).await;
    assert_eq!(mine.len(), 4);
    assert!(mine.iter().all(|v| v["owner_uuid"] == f.alice.0.as_str()));
    assert_newest_first(&mine);
    let bobs =
        walks_like_one_page(s, &admin, "/v1/vms", &[("owner_uuid", &f.bob.0)], uuid_of).await;
    assert_eq!(bobs.len(), 3);
    let none = walks_like_one_page(
        s,
        &f.alice.1,
        "/v1/vms",
        &[("owner_uuid", &f.bob.0)],
        uuid_of,
    )
    .await;
    assert!(none.is_empty());
    let provisioning = walks_like_one_page(
        s,
        &admin,
        "/v1/vms",
        &[("state", "provisioning"), ("owner_uuid", &f.alice.0)],
        uuid_of,
    )
    .await;
    assert_eq!(provisioning.len(), 4);
    let running = walks_like_one_page(s, &admin, "/v1/vms", &[("state", "running")], uuid_of).await;
    assert!(running.is_empty());
    let on_server: BTreeMap<&str, usize> = whole.iter().fold(BTreeMap::new(), |mut m, v| {
        *m.entry(v["server_uuid"].as_str().unwrap()).or_default() += 1;
        m
    });
    for (server, n) in &on_server {
        let here =
            walks_like_one_page(s, &admin, "/v1/vms", &[("server_uuid", server)], uuid_of).await;
        assert_eq!(here.len(), *n);
        assert!(here.iter().all(|v| v["server_uuid"] == *server));
    }
    let vm = &f.vms[3];
    let dev = vm["assigned_devices"][0].as_str().unwrap();
    // Every node has the same tree, so the same paths: a path names a device on a server.
    let holders =
        walks_like_one_page(s, &admin, "/v1/vms", &[("assigned_device", dev)], uuid_of).await;
    let expected: Vec<&str> = whole
        .iter()
        .filter(|v| v["assigned_devices"][0] == dev)
        .map(|v| v["uuid"].as_str().unwrap())
        .collect();
    assert_eq!(field(&holders, "uuid"), expected);
    let holder = walks_like_one_page(
        s,
        &admin,
        "/v1/vms",
        &[
            ("assigned_device", dev),
            ("server_uuid", vm["server_uuid"].as_str().unwrap()),
        ],
        uuid_of,
    )
    .await;
    assert_eq!(field(&holder, "uuid"), [vm["uuid"].as_str().unwrap()]);

    // A page read by cursor does not shift when newer items arrive meanwhile.
    let first = list(s, &admin, "/v1/vms", &[("limit", "3")]).await;
    let (st, newer) = s
        .call(
            "POST",
            "/v1/vms",
            Some(&f.bob.1),
            Some(json!({"alias": "late", "package": "gpu-1x"})),
        )
        .await;
    assert_eq!(st, 202, "{newer}");
    let cursor = first.next.unwrap();
    let rest = list(
        s,
        &admin,
        "/v1/vms",
        &[("limit", "1000"), ("after", &cursor)],
    )
    .await;
    assert_eq!(rest.total, Some(8));
    let mut seen = field(first.body.as_array().unwrap(), "uuid");
    seen.extend(field(rest.body.as_array().unwrap(), "uuid"));
    assert_eq!(
        seen,
        field(&whole, "uuid"),
        "the later VM is not on later pages"
    );

    // Offset pages still work, and name the cursor of the page after them.
    let by_offset = list(s, &admin, "/v1/vms", &[("limit", "2"), ("offset", "2")]).await;
    assert_eq!(by_offset.total, Some(8));
    let now = all(s, &admin, "/v1/vms", &[]).await;
    assert_eq!(
        field(by_offset.body.as_array().unwrap(), "uuid"),
        field(&now[2..4], "uuid")
    );
    let after = list(
        s,
        &admin,
        "/v1/vms",
        &[("limit", "2"), ("after", &by_offset.next.unwrap())],
    )
    .await;
    assert_eq!(
        field(after.body.as_array().unwrap(), "uuid"),
        field(&now[4..6], "uuid")
    );

    // Jobs: one provision job per VM, each running (its task is never answered).
    let ok = wait_for(Duration::from_secs(30), || async {
        let l = list(
            s,
            &admin,
            "/v1/jobs",
            &[("state", "running"), ("limit", "1000")],
        )
        .await;
        (l.total == Some(8)).then_some(())
    })
    .await;
    assert!(ok.is_some(), "the provision jobs did not start");
    let jobs = walks_like_one_page(s, &admin, "/v1/jobs", &[], uuid_of).await;
    assert_eq!(jobs.len(), 8);
    assert_newest_first(&jobs);
    assert!(
        jobs.iter()
            .all(|j| !j["steps"].as_array().unwrap().is_empty())
    );
    for j in &jobs {
        let (_, one) = s
            .admin_call(
                "GET",
                &format!("/v1/jobs/{}", j["uuid"].as_str().unwrap()),
                None,
            )
            .await;
        for k in ["uuid", "name", "vm_uuid", "created_at"] {
            assert_eq!(one[k], j[k], "a listed job is the job");
        }
        let names = |j: &Value| -> Vec<Value> {
            j["steps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["name"].clone())
                .collect()
        };
        assert_eq!(names(&one), names(j));
    }
    let alices = walks_like_one_page(s, &f.alice.1, "/v1/jobs", &[], uuid_of).await;
    let alice_vms: BTreeSet<&str> = field(&mine, "uuid").into_iter().collect();
    assert_eq!(alices.len(), 4);
    assert!(
        alices
            .iter()
            .all(|j| alice_vms.contains(j["vm_uuid"].as_str().unwrap()))
    );
    for j in [&f.vms[0], &f.vms[4]] {
        set_text(
            s,
            "jobs",
            "state",
            j["job_uuid"].as_str().unwrap(),
            "succeeded",
        )
        .await;
    }
    let done = walks_like_one_page(s, &admin, "/v1/jobs", &[("state", "succeeded")], uuid_of).await;
    assert_eq!(done.len(), 2);
    assert!(done.iter().all(|j| j["state"] == "succeeded"));
    let running =
        walks_like_one_page(s, &admin, "/v1/jobs", &[("state", "running")], uuid_of).await;
    assert_eq!(running.len(), 6);
    let bob_done =
        walks_like_one_page(s, &f.bob.1, "/v1/jobs", &[("state", "succeeded")], uuid_of).await;
    assert_eq!(
        field(&bob_done, "uuid"),
        [f.vms[4]["job_uuid"].as_str().unwrap()]
    );
    let failed = list(s, &admin, "/v1/jobs", &[("state", "failed")]).await;
    assert_eq!((failed.total, failed.next), (Some(0), None));
    let l = list(s, &admin, "/v1/jobs", &[("state", "done")]).await;
    assert_invalid(&l, "state");

    // By status, derived from the last heartbeat in SQL.
    set_int(s, "servers", "last_heartbeat", &f.servers[0], None).await;
    set_int(s, "servers", "last_heartbeat", &f.servers[1], Some(1000)).await;
    let running =
        walks_like_one_page(s, &admin, "/v1/servers", &[("status", "running")], uuid_of).await;
    assert_eq!(running.len(), 3);
    assert!(running.iter().all(|s| s["status"] == "running"));
    for (status, server) in [("unknown", &f.servers[0]), ("offline", &f.servers[1])] {
        let only =
            walks_like_one_page(s, &admin, "/v1/servers", &[("status", status)], uuid_of).await;
        assert_eq!(field(&only, "uuid"), [server.as_str()], "{status}");
        assert_eq!(only[0]["status"], status);
    }
    let l = list(s, &admin, "/v1/servers", &[("status", "sideways")]).await;
    assert_invalid(&l, "status");
}
both!(
    servers_vms_and_jobs_page_by_cursor_on,
    servers_vms_and_jobs_page_by_cursor
);

async fn the_fleet_device_list(b: Backend) {
    let f = fleet(b).await;
    let s = &f.s;
    let admin = s.admin.clone();
    let whole = walks_like_one_page(s, &admin, "/v1/devices", &[], device_of).await;
    assert_eq!(whole.len(), 10, "two H100s on each of five servers");
    // Ordered by hostname, then server, then device id: each server's devices together.
    let hosts: Vec<&str> = field(&whole, "hostname");
    assert_eq!(
        hosts,
        [
            "cn-a", "cn-a", "cn-a", "cn-a", "cn-b", "cn-b", "cn-b", "cn-b", "cn-c", "cn-c"
        ]
    );
    let servers: Vec<&str> = field(&whole, "server_uuid");
    for w in servers.chunks(2) {
        assert_eq!(w[0], w[1], "a server's devices are listed together");
    }
    if b == Backend::Sqlite {
        // Byte order on SQLite (Postgres compares text in the database's collation).
        let keys: Vec<(&str, &str, &str)> = whole
            .iter()
            .map(|d| {
                (
                    d["hostname"].as_str().unwrap(),
                    d["server_uuid"].as_str().unwrap(),
                    d["id"].as_str().unwrap(),
                )
            })
            .collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
    }
    let held: BTreeMap<(&str, &str), &str> = f
        .vms
        .iter()
        .map(|v| {
            (
                (
                    v["server_uuid"].as_str().unwrap(),
                    v["assigned_devices"][0].as_str().unwrap(),
                ),
                v["uuid"].as_str().unwrap(),
            )
        })
        .collect();
    for d in &whole {
        let id = d["id"].as_str().unwrap();
        assert_eq!(d["address"].as_str(), id.rsplit('/').next(), "{d}");
        assert_eq!(d["variant"], "NVIDIA_H100");
        assert_eq!(
            (d["vendor"].as_str(), d["device"].as_str()),
            (Some("10de"), Some("2330"))
        );
        let server = s.server(d["server_uuid"].as_str().unwrap()).await;
        assert_eq!(server["hostname"], d["hostname"]);
        let same = server["assignable_devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["id"] == d["id"])
            .unwrap();
        assert_eq!(
            (&same["state"], &same["used_by"]),
            (&d["state"], &d["used_by"])
        );
        match held.get(&(d["server_uuid"].as_str().unwrap(), id)) {
            Some(vm) => {
                assert_eq!(d["state"], "provisioning");
                assert_eq!(d["used_by"], *vm);
            }
            None => assert_eq!(
                (&d["state"], &d["used_by"]),
                (&json!("unassigned"), &Value::Null)
            ),
        }
    }

    // Filters, alone and together, with cursors.
    let one = &f.servers[2];
    let here =
        walks_like_one_page(s, &admin, "/v1/devices", &[("server_uuid", one)], device_of).await;
    assert_eq!(here.len(), 2);
    assert!(here.iter().all(|d| d["server_uuid"] == one.as_str()));
    let used = walks_like_one_page(
        s,
        &admin,
        "/v1/devices",
        &[("state", "provisioning")],
        device_of,
    )
    .await;
    assert_eq!(used.len(), 7);
    let free = walks_like_one_page(
        s,
        &admin,
        "/v1/devices",
        &[("state", "unassigned"), ("variant", "NVIDIA_H100")],
        device_of,
    )
    .await;
    assert_eq!(free.len(), 3);
    for srv in &f.servers {
        let n = free
            .iter()
            .filter(|d| d["server_uuid"] == srv.as_str())
            .count();
        let both = walks_like_one_page(
            s,
            &admin,
            "/v1/devices",
            &[("state", "unassigned"), ("server_uuid", srv)],
            device_of,
        )
        .await;
        assert_eq!(both.len(), n);
    }
    let l = list(s, &admin, "/v1/devices", &[("variant", "NVIDIA_NOPE")]).await;
    assert_eq!((l.status, l.total, l.next.as_deref()), (200, Some(0), None));
    assert_eq!(l.body, json!([]));
    assert_invalid(
        &list(s, &admin, "/v1/devices", &[("state", "gone")]).await,
        "state",
    );
    assert_invalid(
        &list(s, &admin, "/v1/devices", &[("server_uuid", "cn-a")]).await,
        "server_uuid",
    );

    // Staff only: a reader may look, a tenant may not.
    let l = list(s, &f.alice.1, "/v1/devices", &[]).await;
    assert_eq!(
        (l.status, l.body["code"].as_str()),
        (403, Some("Forbidden"))
    );
    let (st, e) = s
        .admin_call(
            "POST",
            "/v1/accounts",
            Some(json!({"login": "rita", "password": "reader-password", "role": "reader"})),
        )
        .await;
    assert_eq!(st, 201, "{e}");
    let reader = s.login("rita", "reader-password").await;
    let seen = walks_like_one_page(s, &reader, "/v1/devices", &[], device_of).await;
    assert_eq!(seen, whole);
}
both!(the_fleet_device_list_on, the_fleet_device_list);

fn assert_invalid(l: &Listed, field: &str) {
    assert_eq!(l.status, 400, "{}", l.body);
    assert_eq!(l.body["code"], "InvalidArgument", "{}", l.body);
    assert_eq!(l.body["field"], field, "{}", l.body);
}

async fn bad_cursors_are_refused(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    s.h100_catalog(1).await;
    s.manual_node(2).await;
    s.manual_node(2).await;
    let admin = s.admin.clone();
    let time = list(&s, &admin, "/v1/servers", &[("limit", "1")]).await;
    let time_cursor = time.next.expect("a cursor: two servers, pages of one");
    let dev = list(&s, &admin, "/v1/devices", &[("limit", "1")]).await;
    let dev_cursor = dev.next.expect("a cursor: four devices, pages of one");
    let nul = format!("{time_cursor}\0");
    let long = format!("{}{}", "1".repeat(2000), &time_cursor[13..]);
    let upper = time_cursor.to_uppercase();
    for path in ["/v1/servers", "/v1/vms", "/v1/jobs"] {
        for bad in [
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
        ] {
            let l = list(&s, &admin, path, &[("after", bad)]).await;
            assert_invalid(&l, "after");
        }
        // A cursor of another list of the same kind is a valid starting point, and its
        // case does not matter.
        for good in [&time_cursor, &upper] {
            let l = list(&s, &admin, path, &[("after", good)]).await;
            assert_eq!(l.status, 200, "{path}: {}", l.body);
        }
        // With an offset, that many items after the cursor are skipped.
        let plain = list(&s, &admin, path, &[("after", &upper)]).await;
        let plain = field(plain.body.as_array().unwrap(), "uuid").join(",");
        for (skip, n) in [("0", 0), ("1", 1), ("3", 3)] {
            let l = list(&s, &admin, path, &[("after", &upper), ("offset", skip)]).await;
            assert_eq!(l.status, 200, "{path}: {}", l.body);
            let got = field(l.body.as_array().unwrap(), "uuid");
            let want: Vec<&str> = plain.split(',').filter(|u| !u.is_empty()).skip(n).collect();
            assert_eq!(got, want, "{path} after the cursor, offset {skip}");
        }
        // An empty value is a value, and not a cursor.
        let l = list(&s, &admin, path, &[("after", ""), ("offset", "1")]).await;
        assert_invalid(&l, "after");
    }
    for bad in [
        "cn~x~/devices/pci0000:00/0000:00:01.0",
        &time_cursor,
        "a~b~c~d",
        "~~",
    ] {
        let l = list(&s, &admin, "/v1/devices", &[("after", bad)]).await;
        assert_invalid(&l, "after");
    }
    let plain = list(&s, &admin, "/v1/devices", &[("after", &dev_cursor)]).await;
    let l = list(
        &s,
        &admin,
        "/v1/devices",
        &[("after", &dev_cursor), ("offset", "2")],
    )
    .await;
    assert_eq!(l.status, 200, "{}", l.body);
    assert_eq!(
        field(l.body.as_array().unwrap(), "id"),
        field(plain.body.as_array().unwrap(), "id")[2..],
        "offset skips items after the cursor"
    );
    // After the last item: an empty page, the total, no cursor.
    let whole = all(&s, &admin, "/v1/devices", &[]).await;
    assert_eq!(whole.len(), 4);
    let last = &whole[3];
    let cursor = format!(
        "{}~{}~{}",
        last["hostname"].as_str().unwrap(),
        last["server_uuid"].as_str().unwrap(),
        last["id"].as_str().unwrap()
    );
    let tail = list(&s, &admin, "/v1/devices", &[("after", &cursor)]).await;
    assert_eq!((tail.status, tail.total, tail.next), (200, Some(4), None));
    assert_eq!(tail.body, json!([]));
    let servers = all(&s, &admin, "/v1/servers", &[]).await;
    let last = &servers[1];
    let t = chrono::DateTime::parse_from_rfc3339(last["created_at"].as_str().unwrap()).unwrap();
    let cursor = format!(
        "{}.{}",
        t.timestamp_millis(),
        last["uuid"].as_str().unwrap()
    );
    let tail = list(&s, &admin, "/v1/servers", &[("after", &cursor)]).await;
    assert_eq!((tail.status, tail.total, tail.next), (200, Some(2), None));
    assert_eq!(tail.body, json!([]));
}
both!(bad_cursors_are_refused_on, bad_cursors_are_refused);

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
