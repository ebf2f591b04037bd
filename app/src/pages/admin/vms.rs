use crate::components::guard::{Audience, Guard};
use crate::components::list::{Filter, ListPage, use_query_param};
use crate::data::{load, poll};
use crate::pages::tenant::instances::VmTable;
use crate::rpc::list_vms;
use leptos::prelude::*;
use leptos_meta::Title;

pub const VM_STATES: [&str; 7] = [
    "provisioning",
    "running",
    "stopping",
    "stopped",
    "destroying",
    "destroyed",
    "failed",
];

const FILTERS: &[Filter] = &[
    Filter::choice("state", "State", &VM_STATES),
    Filter::text("owner", "Owner UUID"),
];

#[component]
pub fn VmsPage() -> impl IntoView {
    let get = use_query_param();
    let data = load(
        move || (get("state"), get("owner"), get("after")),
        |(state, owner, after)| list_vms(state, owner, after),
    );
    poll(data, 3000);
    view! {
        <Title text="VMs · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"VMs"</h1>
            <ListPage path="/admin/vms" data=data filters=FILTERS filter_label="Filter VMs" let:vms>
                <VmTable vms=vms show_owner=true/>
            </ListPage>
        </Guard>
    }
}
