//! Portal benchmark: the servers, devices and VMs list pages of a real `server` process
//! (release build) over a seeded fleet, fetched as a signed-in operator by concurrent
//! clients. Prints latency percentiles and page sizes per page. Run by
//! `cargo xtask bench portal`.
//!
//! Usage: bench_portal --server-bin PATH [--backend sqlite|postgres] [--servers 2000]
//!        [--gpus 8] [--vms 5000] [--clients 16] [--requests 400] [--keep DIR]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use clap::Parser;
use common::{ms, pct, post};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// The `server` binary to start.
    #[arg(long, value_name = "PATH")]
    server_bin: String,
    /// sqlite | postgres (a fresh database on PASSAGE_TEST_PG_URL).
    #[arg(long, default_value = "sqlite", value_parser = ["sqlite", "postgres"])]
    backend: String,
    /// Simulated compute nodes.
    #[arg(long, default_value_t = 2000)]
    servers: usize,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus: usize,
    /// VMs to seed.
    #[arg(long, default_value_t = 5000)]
    vms: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Requests per page, spread over the clients.
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// Keep the SQLite database in this directory (to study its query plans afterwards).
    #[arg(long)]
    keep: Option<std::path::PathBuf>,
}

/// The pages measured: the first page of each list, and one deep in it (by cursor).
const PAGES: [&str; 3] = ["/admin/servers", "/admin/devices", "/admin/vms"];

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let a = Args::parse();
    let dir = tempfile::tempdir().unwrap();
    let db_dir = a.keep.clone().unwrap_or_else(|| dir.path().to_path_buf());
    std::fs::create_dir_all(&db_dir).unwrap();
    let db = common::database(&a.backend, &db_dir).await;
    let (mut child, base) = common::start_server(&a.server_bin, &db);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let op = common::catalog(&http, &base).await;

    let t = Instant::now();
    common::fleet(&http, &base, &op, a.servers, a.gpus).await;
    println!(
        "seeded: {} servers x {} GPUs in {:.1} s",
        a.servers,
        a.gpus,
        t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..32 {
        let (http, base, op, next) = (http.clone(), base.clone(), op.clone(), next.clone());
        let total = a.vms;
        workers.push(tokio::spawn(async move {
            let mut ok = 0usize;
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= total {
                    break ok;
                }
                let (st, _) = post(
                    &http,
                    &format!("{base}/v1/vms"),
                    Some(&op),
                    json!({"alias": format!("vm-{i}"), "package": "gpu-1x", "image": "bench"}),
                )
                .await;
                ok += usize::from(st == 202);
            }
        }));
    }
    let mut created = 0;
    for w in workers {
        created += w.await.unwrap();
    }
    println!(
        "seeded: {created} VMs in {:.1} s",
        t.elapsed().as_secs_f64()
    );

    if a.backend == "postgres" {
        // Autovacuum would get to it within minutes; the benchmark measures that steady
        // state rather than plans made on statistics of empty tables.
        let pool = sqlx::PgPool::connect(&db).await.unwrap();
        sqlx::query("VACUUM ANALYZE").execute(&pool).await.unwrap();
        pool.close().await;
        println!("postgres: VACUUM ANALYZE after seeding");
    }

    // The portal's session cookie holds an API token: the operator's will do.
    let cookie = format!("passage_session={op}");
    // A cursor deep into each list, to time a later page too.
    let mut targets: Vec<String> = PAGES.iter().map(|p| p.to_string()).collect();
    for api in ["/v1/servers", "/v1/devices", "/v1/vms"] {
        let r = http
            .get(format!("{base}{api}?limit=1000"))
            .bearer_auth(&op)
            .send()
            .await
            .unwrap();
        if let Some(c) = r
            .headers()
            .get("x-next-cursor")
            .and_then(|v| v.to_str().ok())
        {
            let page = match api {
                "/v1/servers" => "/admin/servers",
                "/v1/devices" => "/admin/devices",
                _ => "/admin/vms",
            };
            targets.push(format!(
                "{page}?{}",
                serde_urlencoded::to_string([("after", c)]).unwrap()
            ));
        }
    }

    println!(
        "\n{} clients, {} requests per page ({} backend, release build):",
        a.clients, a.requests, a.backend
    );
    println!(
        "{:<40} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "page", "p50", "p95", "p99", "max", "size"
    );
    // The API calls behind each page, on their own: what is left of a page's time is the
    // portal's (the session check, the in-process call, rendering).
    let pages = targets.len();
    for t in targets.clone() {
        let (path, query) = t.split_once('?').unwrap_or((t.as_str(), ""));
        let api = path.replace("/admin/", "/v1/");
        // The servers page asks for brief server objects.
        let brief = if api == "/v1/servers" {
            "&brief=true"
        } else {
            ""
        };
        let sep = if query.is_empty() { "" } else { "&" };
        targets.push(format!("{api}?limit=50{brief}{sep}{query}"));
    }
    for (n, target) in targets.iter().enumerate() {
        if n == pages {
            println!("API calls behind them:");
        }
        let api = n >= pages;
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut workers = Vec::new();
        for _ in 0..a.clients {
            let (http, url, cookie, next, op) = (
                http.clone(),
                format!("{base}{target}"),
                cookie.clone(),
                next.clone(),
                op.clone(),
            );
            let total = a.requests;
            workers.push(tokio::spawn(async move {
                let mut lat = Vec::new();
                let mut max_size = 0usize;
                while next.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < total {
                    let t = Instant::now();
                    let req = if api {
                        http.get(&url).bearer_auth(&op)
                    } else {
                        http.get(&url)
                            .header("cookie", &cookie)
                            .header("accept", "text/html")
                    };
                    let r = req.send().await.unwrap();
                    assert_eq!(r.status().as_u16(), 200, "{url}");
                    let body = r.bytes().await.unwrap();
                    lat.push(t.elapsed());
                    assert!(
                        api || body.windows(7).any(|w| w == b"<tbody>"),
                        "{url} rendered no table"
                    );
                    max_size = max_size.max(body.len());
                }
                (lat, max_size)
            }));
        }
        let mut lat: Vec<Duration> = Vec::new();
        let mut size = 0;
        for w in workers {
            let (l, s) = w.await.unwrap();
            lat.extend(l);
            size = size.max(s);
        }
        lat.sort();
        let shown = if target.len() > 40 {
            format!("{}…", &target[..39])
        } else {
            target.clone()
        };
        println!(
            "{shown:<40} {:>10} {:>10} {:>10} {:>10} {:>8.1} KB",
            ms(pct(&lat, 0.5)),
            ms(pct(&lat, 0.95)),
            ms(pct(&lat, 0.99)),
            ms(pct(&lat, 1.0)),
            size as f64 / 1000.0
        );
    }
    let _ = child.kill();
    let _ = child.wait();
    common::drop_database(&db).await;
}
