use crate::components::guard::{Audience, Guard};
use crate::components::widgets::{Badge, ErrorBox, VmLink, poll};
use crate::fmt;
use crate::rpc::overview;
use leptos::prelude::*;
use leptos_meta::Title;
use passage_model::api::Capacity;

/// The states the capacity chart draws, in the order a device moves through them.
pub const STATES: [&str; 7] = [
    "unassigned",
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
        _ => 0,
    }
}

#[component]
pub fn OverviewPage() -> impl IntoView {
    let data = Resource::new(|| (), |_| overview());
    poll(data, 3000);
    view! {
        <Title text="Overview · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"Fleet overview"</h1>
            <Transition fallback=|| view! { <p class="loading">"Loading…"</p> }>
                {move || Suspend::new(async move {
                    match data.await {
                        Err(e) => view! { <ErrorBox error=e/> }.into_any(),
                        Ok(o) => view! {
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
                        }.into_any(),
                    }
                })}
            </Transition>
        </Guard>
    }
}

/// One stacked bar per variant, drawn in SVG (no inline styles under the CSP); the
/// table below carries the same numbers for people who cannot see the colours.
#[component]
fn CapacityChart(capacity: Vec<Capacity>) -> impl IntoView {
    const W: f64 = 600.0;
    const ROW: usize = 28;
    let height = (capacity.len().max(1) * ROW + 24).to_string();
    let rows = capacity
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let y = (i * ROW) as f64;
            let total = c.total.max(1) as f64;
            let mut x = 160.0;
            let segs = STATES
                .iter()
                .filter_map(|s| {
                    let n = count(c, s);
                    (n > 0).then(|| {
                        let w = (W - 160.0) * n as f64 / total;
                        let seg = view! {
                            <rect class=format!("seg s-{s}") x=format!("{x:.1}") y=format!("{:.1}", y + 4.0)
                                width=format!("{w:.1}") height="20">
                                <title>{format!("{}: {n} {s}", c.variant)}</title>
                            </rect>
                        };
                        x += w;
                        seg
                    })
                })
                .collect_view();
            view! {
                <g>
                    <text x="0" y=format!("{:.1}", y + 19.0) class="label">{c.variant.clone()}</text>
                    {segs}
                </g>
            }
        })
        .collect_view();
    let legend = STATES
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let x = (i * 85) as f64;
            let y = (capacity.len() * ROW + 8) as f64;
            view! {
                <rect class=format!("seg s-{s}") x=format!("{x:.0}") y=format!("{y:.0}") width="10" height="10"/>
                <text x=format!("{:.0}", x + 14.0) y=format!("{:.0}", y + 10.0) class="legend">{*s}</text>
            }
        })
        .collect_view();
    view! {
        <svg class="chart" role="img" aria-label="Devices by state for each variant"
            viewBox=format!("0 0 {W} {height}") width="100%" height=height.clone()>
            {rows}
            {legend}
        </svg>
    }
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
