//! In-process counters for `/metrics`. Fleet gauges (devices by state) are read from the
//! store at scrape time; what only this process sees (placements, job steps) is counted
//! here.

use super::Ctx;
use super::auth::Caller;
use crate::error::ApiResult;
use crate::store::{ops, servers};
use passage_model::api::Capacity;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds of the latency buckets, seconds.
pub const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0,
];

#[derive(Clone, Debug, Default)]
pub struct Histogram {
    pub counts: [u64; BUCKETS.len()],
    pub count: u64,
    pub sum: f64,
}

impl Histogram {
    pub fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        for (i, b) in BUCKETS.iter().enumerate() {
            if s <= *b {
                self.counts[i] += 1;
            }
        }
        self.count += 1;
        self.sum += s;
    }
}

#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

#[derive(Clone, Debug, Default)]
pub struct Inner {
    /// By outcome: placed, insufficient_capacity, quota_exceeded, conflict.
    pub placements: BTreeMap<&'static str, u64>,
    pub placement_latency: Histogram,
    /// By (job, step).
    pub steps: BTreeMap<(String, String), Histogram>,
    /// Requests of nodes that posted task results, and the results they carried.
    pub result_posts: u64,
    pub results: u64,
}

impl Metrics {
    pub fn placement(&self, outcome: &'static str, took: Duration) {
        if let Ok(mut m) = self.inner.lock() {
            *m.placements.entry(outcome).or_default() += 1;
            m.placement_latency.observe(took);
        }
    }

    pub fn step(&self, job: &str, step: &str, took: Duration) {
        if let Ok(mut m) = self.inner.lock() {
            m.steps
                .entry((job.to_string(), step.to_string()))
                .or_default()
                .observe(took);
        }
    }

    /// A node's request that posted `results` task results.
    pub fn result_post(&self, results: usize) {
        if let Ok(mut m) = self.inner.lock() {
            m.result_posts += 1;
            m.results += u64::try_from(results).unwrap_or(u64::MAX);
        }
    }

    pub fn snapshot(&self) -> Inner {
        self.inner.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

/// The fleet as `/metrics` shows it, read from the store at scrape time.
pub struct Fleet {
    pub capacity: Vec<Capacity>,
    pub servers: usize,
    /// Servers whose agent was heard from recently.
    pub heartbeating: usize,
}

/// Staff only: it describes the whole fleet.
pub async fn fleet(ctx: &Ctx, caller: &Caller) -> ApiResult<Fleet> {
    caller.require_staff()?;
    let capacity = ops::capacity(&ctx.db, ctx.alive_after_ms()).await?;
    let (all, _) = servers::list(&ctx.db, 1_000_000, 0).await?;
    let heartbeating = all
        .iter()
        .filter(|s| {
            s.last_heartbeat
                .is_some_and(|t| t.timestamp_millis() >= ctx.alive_after_ms())
        })
        .count();
    Ok(Fleet {
        capacity,
        servers: all.len(),
        heartbeating,
    })
}
