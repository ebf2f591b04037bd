//! Prometheus text exposition at `/metrics` (operators and readers: it describes the
//! whole fleet).

use crate::error::ApiResult;
use crate::services::Ctx;
use crate::services::auth::Caller;
use crate::services::metrics::{self, BUCKETS, Histogram};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::fmt::Write;

fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn histogram(out: &mut String, name: &str, labels: &str, h: &Histogram) {
    let sep = if labels.is_empty() { "" } else { "," };
    for (b, c) in BUCKETS.iter().zip(h.counts.iter()) {
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum);
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
}

pub async fn render(State(ctx): State<Ctx>, caller: Caller) -> ApiResult<Response> {
    let fleet = metrics::fleet(&ctx, &caller).await?;
    let mut out = String::new();
    out.push_str("# HELP passage_devices Assignable devices by variant and state.\n");
    out.push_str("# TYPE passage_devices gauge\n");
    for c in &fleet.capacity {
        let v = label(&c.variant);
        for (state, n) in [
            ("unassigned", c.unassigned),
            ("provisioning", c.provisioning),
            ("used", c.used),
            ("dirty", c.dirty),
            ("cleaning", c.cleaning),
            ("quarantined", c.quarantined),
            ("disabled", c.disabled),
        ] {
            let _ = writeln!(
                out,
                "passage_devices{{variant=\"{v}\",state=\"{state}\"}} {n}"
            );
        }
        let _ = writeln!(out, "passage_devices_free{{variant=\"{v}\"}} {}", c.free);
    }
    out.push_str(
        "# HELP passage_agents_heartbeating Servers whose agent was heard from recently.\n",
    );
    out.push_str("# TYPE passage_agents_heartbeating gauge\n");
    let _ = writeln!(out, "passage_agents_heartbeating {}", fleet.heartbeating);
    let _ = writeln!(out, "passage_servers_total {}", fleet.servers);
    let m = ctx.metrics.snapshot();
    out.push_str("# HELP passage_placements_total VM placements by outcome.\n");
    out.push_str("# TYPE passage_placements_total counter\n");
    for (outcome, n) in &m.placements {
        let _ = writeln!(out, "passage_placements_total{{outcome=\"{outcome}\"}} {n}");
    }
    out.push_str("# HELP passage_placement_seconds Time to place and reserve a VM.\n");
    out.push_str("# TYPE passage_placement_seconds histogram\n");
    histogram(
        &mut out,
        "passage_placement_seconds",
        "",
        &m.placement_latency,
    );
    out.push_str("# HELP passage_job_step_seconds Job step durations.\n");
    out.push_str("# TYPE passage_job_step_seconds histogram\n");
    for ((job, step), h) in &m.steps {
        let labels = format!("job=\"{}\",step=\"{}\"", label(job), label(step));
        histogram(&mut out, "passage_job_step_seconds", &labels, h);
    }
    out.push_str(
        "# HELP passage_agent_result_posts_total Nodes' requests that posted task results.\n",
    );
    out.push_str("# TYPE passage_agent_result_posts_total counter\n");
    let _ = writeln!(out, "passage_agent_result_posts_total {}", m.result_posts);
    out.push_str("# HELP passage_agent_results_total Task results the nodes posted.\n");
    out.push_str("# TYPE passage_agent_results_total counter\n");
    let _ = writeln!(out, "passage_agent_results_total {}", m.results);
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
        .into_response())
}
