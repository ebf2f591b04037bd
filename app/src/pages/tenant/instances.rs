use crate::components::guard::{Audience, Guard};
use crate::components::widgets::{Badge, ErrorBox, Pager, poll};
use crate::fmt;
use crate::rpc::list_vms;
use leptos::prelude::*;
use leptos_meta::Title;
use leptos_router::hooks::use_query_map;
use passage_model::api::Vm;

#[component]
pub fn InstancesPage() -> impl IntoView {
    let q = use_query_map();
    let data = Resource::new(
        move || q.read().get("after"),
        |after| list_vms(None, None, after),
    );
    poll(data, 3000);
    view! {
        <Title text="My instances · Passage"/>
        <Guard audience=Audience::Anyone>
            <h1>"My instances"</h1>
            <p><a class="button" href="/instances/new">"Create instance"</a></p>
            <Transition fallback=|| view! { <p class="loading">"Loading…"</p> }>
                {move || Suspend::new(async move {
                    match data.await {
                        Err(e) => view! { <ErrorBox error=e/> }.into_any(),
                        Ok(p) if p.items.is_empty() => view! {
                            <p>"You have no instances yet."</p>
                        }.into_any(),
                        Ok(p) => {
                            let shown = p.items.len();
                            view! {
                                <VmTable vms=p.items show_owner=false/>
                                <Pager total=p.total shown=shown next=p.next base="/instances"/>
                            }.into_any()
                        }
                    }
                })}
            </Transition>
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
