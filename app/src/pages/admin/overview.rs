use crate::components::errors::Loaded;
use crate::components::guard::{Audience, Guard};
use crate::components::widgets::{Badge, VmLink};
use crate::data::{load, poll};
use crate::fmt;
use crate::rpc::overview;
use leptos::prelude::*;
use leptos_meta::Title;
use passage_model::api::Capacity;

/// The states the capacity chart draws, in the order a device moves through them.
pub const STATES: [&str; 8] = [
    "unassigned",
    "shared",
    "provisioning",
    "used",
    "dirty",
    "cleaning",
    "quarantined",
    "disabled",
];

pub fn count(c: &Capacity, state: &str) -> u64 {
    match state {
        "unassigned" => c.unassigned,
        "provisioning" => c.provisioning,
        "used" => c.used,
        "dirty" => c.dirty,
        "cleaning" => c.cleaning,
        "quarantined" => c.quarantined,
        "disabled" => c.disabled,
        "shared" => c.shared,
        _ => 0,
    }
}

#[component]
pub fn OverviewPage() -> impl IntoView {
    let data = load(|| (), |_| overview());
    poll(data, 3000);
    view! {
        <Title text="Overview · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"Fleet overview"</h1>
            <Loaded data=data let:o>
                <section aria-labelledby="servers-h" class="tiles">
                    <h2 id="servers-h" class="sr-only">"Servers"</h2>
                    <div class="tile">
                        <span class="big" data-testid="servers-up">{o.servers_running}</span>
                        " servers up"
                    </div>
                    <div class="tile">
                        <span class="big" data-testid="servers-down">
                            {o.servers_total.saturating_sub(o.servers_running)}
                        </span>
                        " servers down or unknown"
                    </div>
                </section>
                <section aria-labelledby="cap-h">
                    <h2 id="cap-h">"Capacity by variant"</h2>
                    <CapacityChart capacity=o.capacity.clone()/>
                    <VgpuTable capacity=o.capacity.clone()/>
                    <CapacityTable capacity=o.capacity/>
                </section>
                <section aria-labelledby="failed-h">
                    <h2 id="failed-h">"Recent failed jobs"</h2>
                    {if o.failed_jobs.is_empty() {
                        view! { <p>"No failed jobs."</p> }.into_any()
                    } else {
                        view! {
                            <table>
                                <thead><tr><th>"Job"</th><th>"VM"</th><th>"Created"</th><th>"Error"</th></tr></thead>
                                <tbody>
                                    {o.failed_jobs.into_iter().map(|j| view! {
                                        <tr>
                                            <td>{j.name.clone()} " " <Badge state=j.state.as_str()/></td>
                                            <td>{j.vm_uuid.map(|v| view! { <VmLink uuid=v/> })}</td>
                                            <td>{fmt::time(&j.created_at)}</td>
                                            <td>{j.error.clone().unwrap_or_default()}</td>
                                        </tr>
                                    }).collect_view()}
                                </tbody>
                            </table>
                        }.into_any()
                    }}
                </section>
                <section aria-labelledby="alerts-h">
                    <h2 id="alerts-h">"Alerts"</h2>
                    {if o.alerts.is_empty() {
                        view! { <p>"No alerts."</p> }.into_any()
                    } else {
                        view! {
                            <ul class="alerts">
                                {o.alerts.into_iter().map(|a| view! {
                                    <li><Badge state=a.kind.clone()/> " " {a.message.clone()} " · " {fmt::time(&a.at)}</li>
                                }).collect_view()}
                            </ul>
                        }.into_any()
                    }}
                </section>
            </Loaded>
        </Guard>
    }
}

/// One stacked bar per variant, drawn in SVG (no inline styles under the CSP); the
/// table below carries the same numbers for people who cannot see the colours. Whole
/// pixels throughout: segments end where the next begins, and the browser bundle needs
/// no float formatting.
#[component]
fn CapacityChart(capacity: Vec<Capacity>) -> impl IntoView {
    const W: u64 = 600;
    const ROW: u64 = 28;
    // Room for the longest variant name at about 7 px a character, within reason.
    let longest = capacity
        .iter()
        .map(|c| c.variant.chars().count())
        .max()
        .unwrap_or(0) as u64;
    let label_w = (longest * 7 + 12).clamp(80, 260);
    let height = (capacity.len().max(1) as u64 * ROW).to_string();
    let rows = capacity
        .iter()
        .zip(0u64..)
        .map(|(c, i)| {
            let y = i * ROW;
            let total = c.total.max(1);
            let x_at = |before: u64| label_w + (W - label_w) * before / total;
            let mut before = 0;
            let segs =
                STATES
                    .iter()
                    .filter_map(|s| {
                        let n = count(c, s);
                        let x = x_at(before);
                        before += n;
                        let w = x_at(before) - x;
                        (n > 0).then(|| view! {
                        <rect class=format!("seg s-{s}") x=x.to_string() y=(y + 4).to_string()
                            width=w.to_string() height="20">
                            <title>{format!("{}: {n} {s}", c.variant)}</title>
                        </rect>
                    })
                    })
                    .collect_view();
            view! {
                <g>
                    <text x="6" y=(y + 19).to_string() class="label">{c.variant.clone()}</text>
                    {segs}
                </g>
            }
        })
        .collect_view();
    view! {
        <div class="chart-box">
            <svg class="chart" role="img" aria-label="Devices by state for each variant"
                viewBox=format!("0 0 {W} {height}") width="100%" height=height.clone()
                preserveAspectRatio="xMinYMid meet">
                {rows}
            </svg>
            <Legend/>
        </div>
    }
}

/// The chart's key, laid out by the browser as wrapping text: a label is never drawn
/// over its neighbour, whatever its length, the font or the width of the screen.
#[component]
fn Legend() -> impl IntoView {
    view! {
        <ul class="legend" data-testid="capacity-legend">
            {STATES.iter().map(|s| view! {
                <li><span class=format!("swatch s-{s}")></span>{*s}</li>
            }).collect_view()}
        </ul>
    }
}

/// Per vGPU type, CloudStack's figures: slots in use, remaining, maximum, fleet-wide and
/// per server.
#[component]
fn VgpuTable(capacity: Vec<Capacity>) -> impl IntoView {
    let rows: Vec<(String, passage_model::api::VgpuCapacity)> = capacity
        .into_iter()
        .filter_map(|c| c.vgpu.map(|v| (c.variant, v)))
        .collect();
    (!rows.is_empty()).then(|| view! {
        <table class="capacity" data-testid="vgpu-capacity">
            <caption>"vGPU types"</caption>
            <thead>
                <tr>
                    <th scope="col">"vGPU variant"</th>
                    <th scope="col">"Type"</th>
                    <th scope="col">"On"</th>
                    <th scope="col">"GPUs hosting"</th>
                    <th scope="col">"In use"</th>
                    <th scope="col">"Remaining"</th>
                    <th scope="col">"Max"</th>
                    <th scope="col">"Per server (in use / remaining / max)"</th>
                </tr>
            </thead>
            <tbody>
                {rows.into_iter().map(|(name, v)| {
                    let per_server = v.servers.iter().map(|s| format!(
                        "{} {}/{}/{}", s.hostname, s.in_use, s.remaining_capacity, s.max_capacity
                    )).collect::<Vec<_>>().join(", ");
                    view! {
                        <tr data-variant=name.clone()>
                            <th scope="row">{name.clone()}</th>
                            <td>{format!("{} (max {} per GPU)", v.vgpu_type, v.max_per_gpu)}</td>
                            <td>{v.parent}</td>
                            <td data-state="gpus">{v.gpus}</td>
                            <td data-state="in_use">{v.in_use}</td>
                            <td data-state="remaining">{v.remaining_capacity}</td>
                            <td data-state="max">{v.max_capacity}</td>
                            <td>{per_server}</td>
                        </tr>
                    }
                }).collect_view()}
            </tbody>
        </table>
    })
}

#[component]
fn CapacityTable(capacity: Vec<Capacity>) -> impl IntoView {
    view! {
        <table class="capacity" data-testid="capacity">
            <thead>
                <tr>
                    <th scope="col">"Variant"</th>
                    <th scope="col">"Total"</th>
                    {STATES.iter().map(|s| view! { <th scope="col">{*s}</th> }).collect_view()}
                </tr>
            </thead>
            <tbody>
                {capacity.into_iter().map(|c| {
                    let cells = STATES.iter().map(|s| {
                        let n = count(&c, s);
                        view! { <td data-state=*s>{n}</td> }
                    }).collect_view();
                    view! {
                        <tr data-variant=c.variant.clone()>
                            <th scope="row">{c.variant.clone()}</th>
                            <td data-state="total">{c.total}</td>
                            {cells}
                        </tr>
                    }
                }).collect_view()}
            </tbody>
        </table>
    }
}
