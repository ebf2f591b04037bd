use crate::components::errors::{ErrorBox, Loaded};
use crate::components::guard::{Audience, Guard};
use crate::components::list::{ListPage, use_query_param};
use crate::components::widgets::{Badge, CsrfField, VmLink};
use crate::data::{load, poll};
use crate::fmt;
use crate::pages::admin::overview::STATES;
use crate::rpc::{CreateJoinToken, ServerRow, get_server, list_servers, server_events};
use leptos::prelude::*;
use leptos_meta::Title;
use leptos_router::hooks::use_params_map;
use passage_model::api::Server;

#[component]
pub fn ServersPage() -> impl IntoView {
    let get = use_query_param();
    let data = load(move || get("after"), list_servers);
    poll(data, 5000);
    view! {
        <Title text="Servers · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"Servers"</h1>
            <JoinTokenForm/>
            <ListPage path="/admin/servers" data=data let:rows>
                <ServerTable rows=rows/>
            </ListPage>
        </Guard>
    }
}

#[component]
fn ServerTable(rows: Vec<ServerRow>) -> impl IntoView {
    view! {
        <table data-testid="servers">
            <caption class="sr-only">"Compute nodes"</caption>
            <thead>
                <tr>
                    <th scope="col">"Hostname"</th>
                    <th scope="col">"Status"</th>
                    <th scope="col">"GPUs"</th>
                    {STATES.iter().map(|s| view! { <th scope="col">{*s}</th> }).collect_view()}
                    <th scope="col">"Last heartbeat"</th>
                </tr>
            </thead>
            <tbody>
                {rows.into_iter().map(|s| {
                    let counts = STATES.iter().map(|st| {
                        let n = s.by_state.get(*st).copied().unwrap_or(0);
                        view! { <td data-state=*st>{n}</td> }
                    }).collect_view();
                    view! {
                        <tr data-hostname=s.hostname.clone()>
                            <th scope="row"><a href=format!("/admin/servers/{}", s.uuid)>{s.hostname.clone()}</a></th>
                            <td>
                                <Badge state=s.status.clone()/>
                                {s.disabled.then(|| view! { " " <Badge state="drained"/> })}
                            </td>
                            <td data-state="total">{s.devices}</td>
                            {counts}
                            <td>{fmt::opt_time(&s.last_heartbeat)}</td>
                        </tr>
                    }
                }).collect_view()}
            </tbody>
        </table>
    }
}

/// A single-use join token and the command that adds a node with it.
#[component]
fn JoinTokenForm() -> impl IntoView {
    let action = ServerAction::<CreateJoinToken>::new();
    view! {
        <details class="card">
            <summary>"Add a server"</summary>
            <p>"A join token admits one new node. It is shown once."</p>
            <ActionForm action=action>
                <CsrfField/>
                <button type="submit">"Create join token"</button>
            </ActionForm>
            {move || action.value().get().map(|r| match r {
                Ok(t) => view! {
                    <div role="status" class="ok">
                        <p>"Run this on the new node (the token expires " {fmt::time(&t.expires_at)} "):"</p>
                        <pre data-testid="join-command"><code>{t.command}</code></pre>
                    </div>
                }.into_any(),
                Err(e) => view! { <ErrorBox error=e/> }.into_any(),
            })}
        </details>
    }
}

#[component]
pub fn ServerPage() -> impl IntoView {
    let params = use_params_map();
    let data = load(
        move || params.read().get("uuid").unwrap_or_default(),
        get_server,
    );
    let events = load(
        move || params.read().get("uuid").unwrap_or_default(),
        server_events,
    );
    poll(data, 2000);
    poll(events, 2000);
    view! {
        <Title text="Server · Passage"/>
        <Guard audience=Audience::Staff>
            <Loaded data=data let:s>
                <ServerDetail s=s/>
            </Loaded>
            <h2>"Recent device events"</h2>
            <Loaded data=events quiet=true let:list>
                {if list.is_empty() {
                    view! { <p>"No state changes yet."</p> }.into_any()
                } else {
                    view! {
                        <table data-testid="device-events">
                            <thead>
                                <tr>
                                    <th scope="col">"When"</th>
                                    <th scope="col">"Device"</th>
                                    <th scope="col">"From"</th>
                                    <th scope="col">"To"</th>
                                    <th scope="col">"Why"</th>
                                </tr>
                            </thead>
                            <tbody>
                                {list.into_iter().map(|e| {
                                    let id = e.device.to_string();
                                    view! {
                                        <tr data-device=id.clone() data-to=e.to.as_str()>
                                            <td>{fmt::time(&e.at)}</td>
                                            <td><code>{fmt::bdf(&id).to_string()}</code></td>
                                            <td><Badge state=e.from.as_str()/></td>
                                            <td><Badge state=e.to.as_str()/></td>
                                            <td>{e.reason.clone()}</td>
                                        </tr>
                                    }
                                }).collect_view()}
                            </tbody>
                        </table>
                    }.into_any()
                }}
            </Loaded>
        </Guard>
    }
}

/// One server: its facts and its assignable devices.
#[component]
fn ServerDetail(s: Server) -> impl IntoView {
    let status = fmt::server_status(s.status);
    let pci = s
        .sysinfo
        .as_ref()
        .map(|i| i.pci_devices.as_slice())
        .unwrap_or_default();
    let functions = pci.len();
    let drivers: std::collections::HashMap<String, String> = pci
        .iter()
        .map(|d| (d.id.to_string(), d.driver.clone()))
        .collect();
    view! {
        <h1>"Server " {s.hostname.clone()}</h1>
        <dl class="facts">
            <dt>"Status"</dt><dd><Badge state=status/>{s.disabled.then(|| view! { " " <Badge state="drained"/> })}</dd>
            <dt>"UUID"</dt><dd><code>{s.uuid.to_string()}</code></dd>
            <dt>"Last heartbeat"</dt><dd>{fmt::opt_time(&s.last_heartbeat)}</dd>
            <dt>"PCI functions"</dt><dd>{functions}</dd>
            <dt>"vCPUs"</dt><dd data-testid="vcpus">{match s.resources {
                Some(r) => format!("{} of {} allocated", r.vcpus_used, r.vcpus_total),
                None => "not reported".to_string(),
            }}</dd>
            <dt>"Memory"</dt><dd data-testid="memory">{match s.resources {
                Some(r) => format!("{} of {} MiB allocated", r.memory_used_mib, r.memory_total_mib),
                None => "not reported".to_string(),
            }}</dd>
        </dl>
        <h2>"Assignable devices"</h2>
        <table data-testid="devices">
            <thead>
                <tr>
                    <th scope="col">"Device"</th>
                    <th scope="col">"BDF"</th>
                    <th scope="col">"Variant"</th>
                    <th scope="col">"State"</th>
                    <th scope="col">"Used by"</th>
                    <th scope="col">"NUMA"</th>
                    <th scope="col">"Driver"</th>
                </tr>
            </thead>
            <tbody>
                {s.assignable_devices.unwrap_or_default().into_iter().map(|d| {
                    let id = d.id.to_string();
                    let driver = drivers.get(&id).cloned().unwrap_or_else(|| "-".into());
                    view! {
                        <tr data-device=id.clone()>
                            <td><code>{id.clone()}</code></td>
                            <td><code>{fmt::bdf(&id).to_string()}</code></td>
                            <td>{d.variant.clone()}</td>
                            <td>
                                <Badge state=d.state.as_str()/>
                                {d.taint.clone().map(|t| {
                                    let title = t.clone();
                                    view! { " " <span class="taint" title=title>"tainted: " {t}</span> }
                                })}
                                {d.state_reason.clone().map(|r| {
                                    view! { " " <span class="state-reason">{r}</span> }
                                })}
                            </td>
                            <td>{d.used_by.map(|v| view! { <VmLink uuid=v/> })}</td>
                            <td>{d.numa_node.map(|n| n.to_string()).unwrap_or_else(|| "-".into())}</td>
                            <td><code>{driver}</code></td>
                        </tr>
                    }
                }).collect_view()}
            </tbody>
        </table>
        <p><a href=format!("/admin/devices?server={}", s.uuid)>"Filter these in the devices list"</a></p>
    }
}
