use crate::components::guard::{Audience, Guard};
use crate::components::list::{ListPage, use_query_param};
use crate::components::widgets::Badge;
use crate::data::{load, poll};
use crate::fmt;
use crate::rpc::list_vms;
use leptos::prelude::*;
use leptos_meta::Title;
use passage_model::api::Vm;

#[component]
pub fn InstancesPage() -> impl IntoView {
    let get = use_query_param();
    let data = load(move || get("after"), |after| list_vms(None, None, after));
    poll(data, 3000);
    view! {
        <Title text="My instances · Passage"/>
        <Guard audience=Audience::Anyone>
            <h1>"My instances"</h1>
            <p><a class="button" href="/instances/new">"Create instance"</a></p>
            <ListPage path="/instances" data=data empty="You have no instances yet." let:vms>
                <VmTable vms=vms show_owner=false/>
            </ListPage>
        </Guard>
    }
}

#[component]
pub fn VmTable(vms: Vec<Vm>, show_owner: bool) -> impl IntoView {
    view! {
        <table data-testid="vms">
            <thead>
                <tr>
                    <th scope="col">"Alias"</th>
                    <th scope="col">"State"</th>
                    <th scope="col">"Devices"</th>
                    <th scope="col">"Addresses"</th>
                    {show_owner.then(|| view! { <th scope="col">"Owner"</th> })}
                    <th scope="col">"Created"</th>
                </tr>
            </thead>
            <tbody>
                {vms.into_iter().map(|v| {
                    let uuid = v.uuid.to_string();
                    let owner = v.owner_uuid.to_string();
                    view! {
                        <tr data-vm=uuid.clone() data-alias=v.alias.clone()>
                            <th scope="row"><a href=format!("/instances/{uuid}")>{v.alias.clone()}</a></th>
                            <td><Badge state=v.state.as_str()/></td>
                            <td>{v.assigned_devices.len()}</td>
                            <td data-testid="ips">
                                {if v.nics.is_empty() { "-".to_string() } else {
                                    v.nics.iter().map(|n| n.ip.to_string()).collect::<Vec<_>>().join(", ")
                                }}
                            </td>
                            {show_owner.then(|| view! {
                                <td><a href=format!("/admin/vms?owner={owner}")><code>{fmt::short_uuid(&owner).to_string()}</code></a></td>
                            })}
                            <td>{fmt::time(&v.created_at)}</td>
                        </tr>
                    }
                }).collect_view()}
            </tbody>
        </table>
    }
}
