use crate::components::guard::{Audience, Guard};
use crate::components::widgets::{ErrorBox, Pager, poll};
use crate::fmt;
use crate::pages::tenant::instances::VmTable;
use crate::rpc::list_vms;
use leptos::prelude::*;
use leptos_meta::Title;
use leptos_router::hooks::use_query_map;

pub const VM_STATES: [&str; 6] = [
    "provisioning",
    "running",
    "stopped",
    "destroying",
    "destroyed",
    "failed",
];

#[component]
pub fn VmsPage() -> impl IntoView {
    let q = use_query_map();
    let get = move |k: &str| q.read().get(k).filter(|v| !v.is_empty());
    let data = Resource::new(
        move || (get("state"), get("owner"), get("after")),
        |(state, owner, after)| list_vms(state, owner, after),
    );
    poll(data, 3000);
    let base = move || {
        let (state, owner) = (get("state"), get("owner"));
        let q = fmt::query(&[("state", state.as_deref()), ("owner", owner.as_deref())]);
        format!("/admin/vms{q}")
    };
    view! {
        <Title text="VMs · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"VMs"</h1>
            <form method="get" action="/admin/vms" class="filters" role="search">
                <label for="f-state">"State"</label>
                <select id="f-state" name="state">
                    <option value="">"any"</option>
                    {VM_STATES.iter().map(|s| view! {
                        <option value=*s selected=move || get("state").as_deref() == Some(*s)>{*s}</option>
                    }).collect_view()}
                </select>
                <label for="f-owner">"Owner UUID"</label>
                <input id="f-owner" name="owner" type="text" value=move || get("owner").unwrap_or_default()/>
                <button type="submit">"Filter VMs"</button>
            </form>
            <Transition fallback=|| view! { <p class="loading">"Loading…"</p> }>
                {move || Suspend::new(async move {
                    match data.await {
                        Err(e) => view! { <ErrorBox error=e/> }.into_any(),
                        Ok(p) => {
                            let shown = p.items.len();
                            view! {
                                <VmTable vms=p.items show_owner=true/>
                                <Pager total=p.total shown=shown next=p.next base=base()/>
                            }.into_any()
                        }
                    }
                })}
            </Transition>
        </Guard>
    }
}
