use crate::components::guard::{Audience, Guard};
use crate::components::list::{Filter, ListPage, use_query_param};
use crate::components::widgets::{Badge, VmLink};
use crate::data::{load, poll};
use crate::pages::admin::overview::STATES;
use crate::rpc::list_devices;
use leptos::prelude::*;
use leptos_meta::Title;
use passage_model::api::DeviceRow;

const FILTERS: &[Filter] = &[
    Filter::choice("state", "State", &STATES),
    Filter::text("variant", "Variant"),
    Filter::text("server", "Server UUID"),
];

#[component]
pub fn DevicesPage() -> impl IntoView {
    let get = use_query_param();
    let data = load(
        move || (get("state"), get("variant"), get("server"), get("after")),
        |(state, variant, server, after)| list_devices(state, variant, server, after),
    );
    poll(data, 2000);
    view! {
        <Title text="Devices · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"Devices"</h1>
            <ListPage path="/admin/devices" data=data filters=FILTERS filter_label="Filter devices" let:rows>
                <DeviceTable rows=rows/>
            </ListPage>
        </Guard>
    }
}

#[component]
fn DeviceTable(rows: Vec<DeviceRow>) -> impl IntoView {
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
                {rows.into_iter().map(|d| {
                    let id = d.id.to_string();
                    view! {
                        <tr data-device=id.clone()>
                            <td><a href=format!("/admin/servers/{}", d.server_uuid)>{d.hostname.clone()}</a></td>
                            <td><code title=id.clone()>{d.address.to_string()}</code></td>
                            <td>{d.variant.clone().unwrap_or_default()}</td>
                            <td>
                                <Badge state=d.state.as_str()/>
                                {d.state_reason.clone().map(|r| {
                                    view! { " " <span class="state-reason">{r}</span> }
                                })}
                            </td>
                            <td>{d.used_by.map(|v| view! { <VmLink uuid=v/> })}</td>
                            <td>{d.numa_node.map(|n| n.to_string()).unwrap_or_else(|| "-".into())}</td>
                            <td><code>{d.driver.clone().unwrap_or_else(|| "-".into())}</code></td>
                        </tr>
                    }
                }).collect_view()}
            </tbody>
        </table>
    }
}
