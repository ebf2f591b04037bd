use crate::components::guard::{Audience, Guard};
use crate::components::widgets::{Badge, ErrorBox, Pager, VmLink, poll};
use crate::fmt;
use crate::pages::admin::overview::STATES;
use crate::rpc::list_devices;
use leptos::prelude::*;
use leptos_meta::Title;
use leptos_router::hooks::use_query_map;

#[component]
pub fn DevicesPage() -> impl IntoView {
    let q = use_query_map();
    let get = move |k: &str| q.read().get(k).filter(|v| !v.is_empty());
    let data = Resource::new(
        move || (get("state"), get("variant"), get("server"), get("after")),
        |(state, variant, server, after)| list_devices(state, variant, server, after),
    );
    poll(data, 2000);
    let base = move || {
        let (state, variant, server) = (get("state"), get("variant"), get("server"));
        let q = fmt::query(&[
            ("state", state.as_deref()),
            ("variant", variant.as_deref()),
            ("server", server.as_deref()),
        ]);
        format!("/admin/devices{q}")
    };
    view! {
        <Title text="Devices · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"Devices"</h1>
            <form method="get" action="/admin/devices" class="filters" role="search">
                <label for="f-state">"State"</label>
                <select id="f-state" name="state">
                    <option value="">"any"</option>
                    {STATES.iter().map(|s| view! {
                        <option value=*s selected=move || get("state").as_deref() == Some(*s)>{*s}</option>
                    }).collect_view()}
                </select>
                <label for="f-variant">"Variant"</label>
                <input id="f-variant" name="variant" type="text" value=move || get("variant").unwrap_or_default()/>
                <label for="f-server">"Server UUID"</label>
                <input id="f-server" name="server" type="text" value=move || get("server").unwrap_or_default()/>
                <button type="submit">"Filter devices"</button>
            </form>
            <Transition fallback=|| view! { <p class="loading">"Loading…"</p> }>
                {move || Suspend::new(async move {
                    match data.await {
                        Err(e) => view! { <ErrorBox error=e/> }.into_any(),
                        Ok(p) => {
                            let shown = p.items.len();
                            view! {
                                <table data-testid="devices">
                                    <thead>
                                        <tr>
                                            <th scope="col">"Server"</th>
                                            <th scope="col">"BDF"</th>
                                            <th scope="col">"Variant"</th>
                                            <th scope="col">"State"</th>
                                            <th scope="col">"Used by"</th>
                                            <th scope="col">"NUMA"</th>
                                            <th scope="col">"Driver"</th>
                                        </tr>
                                    </thead>
                                    <tbody>
                                        {p.items.into_iter().map(|d| {
                                            let id = d.id.to_string();
                                            view! {
                                                <tr data-device=id.clone()>
                                                    <td><a href=format!("/admin/servers/{}", d.server_uuid)>{d.hostname.clone()}</a></td>
                                                    <td><code title=id.clone()>{d.address.to_string()}</code></td>
                                                    <td>{d.variant.clone().unwrap_or_default()}</td>
                                                    <td><Badge state=d.state.as_str()/></td>
                                                    <td>{d.used_by.map(|v| view! { <VmLink uuid=v/> })}</td>
                                                    <td>{d.numa_node.map(|n| n.to_string()).unwrap_or_else(|| "-".into())}</td>
                                                    <td><code>{d.driver.clone().unwrap_or_else(|| "-".into())}</code></td>
                                                </tr>
                                            }
                                        }).collect_view()}
                                    </tbody>
                                </table>
                                <Pager total=p.total shown=shown next=p.next base=base()/>
                            }.into_any()
                        }
                    }
                })}
            </Transition>
        </Guard>
    }
}
