use crate::components::errors::{FormStatus, Loaded};
use crate::components::guard::{Audience, Guard};
use crate::components::widgets::{Badge, CsrfField};
use crate::data::{load, poll};
use crate::fmt;
use crate::pages::admin::jobs::JobSteps;
use crate::rpc::{DestroyInstance, get_instance};
use leptos::prelude::*;
use leptos_meta::Title;
use leptos_router::hooks::{use_params_map, use_query_map};

#[component]
pub fn InstancePage() -> impl IntoView {
    let params = use_params_map();
    let q = use_query_map();
    let destroy = ServerAction::<DestroyInstance>::new();
    let data = load(
        move || {
            (
                params.read().get("uuid").unwrap_or_default(),
                destroy.version().get(),
            )
        },
        |(uuid, _)| get_instance(uuid),
    );
    // Job steps and device states move on their own: follow them until the VM settles.
    poll(data, 1000);
    let confirming = move || q.read().get("confirm").as_deref() == Some("destroy");
    view! {
        <Title text="Instance · Passage"/>
        <Guard audience=Audience::Anyone>
            <Loaded data=data let:i>
                {
                let vm = i.vm;
                let uuid = vm.uuid.to_string();
                let state = vm.state.as_str();
                let gone = matches!(state, "destroying" | "destroyed");
                view! {
                    <h1>"Instance " {vm.alias.clone()}</h1>
                    <dl class="facts">
                        <dt>"State"</dt><dd data-testid="vm-state"><Badge state=state/></dd>
                        <dt>"UUID"</dt><dd><code>{uuid.clone()}</code></dd>
                        <dt>"Package"</dt><dd>{i.package.clone().unwrap_or_else(|| "-".into())}</dd>
                        <dt>"Size"</dt><dd>{vm.vcpus} " vCPUs, " {vm.memory_mib} " MiB"</dd>
                        <dt>"Created"</dt><dd>{fmt::time(&vm.created_at)}</dd>
                    </dl>
                    <h2>"Assigned devices"</h2>
                    {if vm.assigned_devices.is_empty() {
                        view! { <p>"None."</p> }.into_any()
                    } else {
                        view! {
                            <ul data-testid="assigned-devices">
                                {vm.assigned_devices.iter().map(|d| {
                                    let d = d.to_string();
                                    view! { <li><code title=d.clone()>{fmt::bdf(&d).to_string()}</code></li> }
                                }).collect_view()}
                            </ul>
                        }.into_any()
                    }}
                    {i.job.map(|j| view! {
                        <h2>"Last job: " {j.name.clone()} " " <Badge state=j.state.as_str()/></h2>
                        <JobSteps job=j/>
                    })}
                    {(!gone).then(|| if confirming() {
                        view! {
                            <section class="card danger-zone" aria-labelledby="destroy-h">
                                <h2 id="destroy-h">"Destroy " {vm.alias.clone()} "?"</h2>
                                <p>"The VM stops and its devices are wiped. This cannot be undone."</p>
                                <ActionForm action=destroy>
                                    <CsrfField/>
                                    <input type="hidden" name="uuid" value=uuid.clone()/>
                                    <button type="submit" class="danger">"Yes, destroy " {vm.alias.clone()}</button>
                                    " "
                                    <a href=format!("/instances/{uuid}")>"Keep it"</a>
                                </ActionForm>
                            </section>
                        }.into_any()
                    } else {
                        view! {
                            <p><a class="button danger" href=format!("/instances/{uuid}?confirm=destroy")>"Destroy instance"</a></p>
                        }.into_any()
                    })}
                }
                }
            </Loaded>
            <FormStatus result=Signal::derive(move || destroy.value().get())/>
        </Guard>
    }
}
