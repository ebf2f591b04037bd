use crate::components::errors::{FieldError, FormStatus, Loaded};
use crate::components::guard::{Audience, Guard};
use crate::components::widgets::CsrfField;
use crate::data::load;
use crate::error::PortalError;
use crate::rpc::{CreateInstance, Offer, offers, usable_images, usable_networks};
use leptos::prelude::*;
use leptos_meta::Title;

#[component]
pub fn CreatePage() -> impl IntoView {
    let create = ServerAction::<CreateInstance>::new();
    let data = load(move || create.version().get(), |_| offers());
    let images = load(move || create.version().get(), |_| usable_images());
    let networks = load(move || create.version().get(), |_| usable_networks());
    let result = Signal::derive(move || create.value().get());
    view! {
        <Title text="Create instance · Passage"/>
        <Guard audience=Audience::Anyone>
            <h1>"Create instance"</h1>
            <ActionForm action=create>
                <CsrfField/>
                <div class="field">
                    <label for="alias">"Name " <span class="muted">"(optional)"</span></label>
                    <input id="alias" name="alias" type="text" maxlength="64"
                        placeholder="training-1" aria-describedby="alias-hint alias-error"/>
                    <span id="alias-hint" class="muted">"Letters, digits, '.', '_' and '-'; left empty, one is made up."</span>
                    <FieldError result=result field="alias"/>
                </div>
                <div class="field">
                    <label for="image">"Image"</label>
                    <Loaded data=images let:list>
                        <ImageSelect list=list/>
                    </Loaded>
                    <FieldError result=result field="image"/>
                </div>
                <fieldset aria-describedby="package-error">
                    <legend>"Package"</legend>
                    <FieldError result=result field="package"/>
                    <Loaded data=data let:list>
                        <Offers list=list/>
                    </Loaded>
                </fieldset>
                <Loaded data=networks let:list>
                    <Networks list=list result=result/>
                </Loaded>
                <div class="field wide">
                    <label for="user_data">"User data " <span class="muted">"(optional)"</span></label>
                    <textarea id="user_data" name="user_data" rows="6" spellcheck="false"
                        placeholder="#cloud-config" aria-describedby="user_data-hint user_data-error"></textarea>
                    <span id="user_data-hint" class="muted">"Given to cloud-init at first boot: a #cloud-config document or a script."</span>
                    <FieldError result=result field="user_data"/>
                </div>
                <FormStatus result=result/>
                <button type="submit" disabled=move || create.pending().get()>
                    {move || if create.pending().get() { "Creating…" } else { "Create instance" }}
                </button>
            </ActionForm>
        </Guard>
    }
}

/// The images to boot from; with exactly one, it is chosen already.
#[component]
fn ImageSelect(list: Vec<passage_model::images::Image>) -> impl IntoView {
    if list.is_empty() {
        return view! { <p>"No images are offered yet. Ask your operator."</p> }.into_any();
    }
    let only = list.len() == 1;
    let options = list
        .into_iter()
        .map(|i| {
            let key = format!("{}@{}", i.name, i.version);
            let label = format!("{} {} ({})", i.name, i.version, i.os);
            view! { <option value=key selected=only>{label}</option> }
        })
        .collect_view();
    view! {
        <select id="image" name="image" required aria-describedby="image-error">
            {(!only).then(|| view! { <option value="" disabled selected>"Choose an image"</option> })}
            {options}
        </select>
    }
    .into_any()
}

/// The packages to choose from, each with whether it can be had now. When exactly one
/// can, it is chosen already.
#[component]
fn Offers(list: Vec<Offer>) -> impl IntoView {
    if list.is_empty() {
        return view! { <p>"No packages are offered yet. Ask your operator."</p> }.into_any();
    }
    let fits = |o: &Offer| o.availability.quota_ok && o.availability.capacity_ok;
    let only_fit = match list.iter().filter(|o| fits(o)).count() {
        1 => list.iter().find(|o| fits(o)).map(|o| o.package.uuid),
        _ => None,
    };
    list.into_iter()
        .map(|o| {
            let ok = fits(&o);
            let p = o.package;
            let a = o.availability;
            let id = format!("pkg-{}", p.uuid);
            let chosen = only_fit == Some(p.uuid);
            let devices = p.devices.iter().map(|(v, n)| format!("{n} × {v}")).collect::<Vec<_>>().join(", ");
            let verdict = if !a.quota_ok {
                "over your GPU quota"
            } else if !a.capacity_ok {
                "no capacity right now"
            } else {
                "available now"
            };
            view! {
                <div class="offer" data-package=p.name.clone()>
                    <input type="radio" name="package" id=id.clone() value=p.name.clone() checked=chosen/>
                    <label for=id>
                        <strong>{p.name.clone()}</strong>
                        " · " {p.vcpus} " vCPUs · " {p.memory_mib / 1024} " GiB memory · "
                        {if devices.is_empty() { "no devices".to_string() } else { devices }}
                        " · "
                        <span class=if ok { "avail yes" } else { "avail no" } data-testid="availability">
                            {if ok { "✔ " } else { "✘ " }}{verdict}
                        </span>
                        {a.message.clone().map(|m| view! { <span class="muted">" (" {m} ")"</span> })}
                    </label>
                </div>
            }
        })
        .collect_view()
        .into_any()
}

/// The networks the instance gets an address on, the defaults checked already; the
/// first one checked is its primary. With none offered, the server's defaults apply.
#[component]
fn Networks(
    list: Vec<passage_model::networks::Network>,
    result: Signal<Option<Result<(), PortalError>>>,
) -> impl IntoView {
    if list.is_empty() {
        // The server's defaults apply; where it has none for you, it says so here.
        return view! { <FieldError result=result field="networks"/> }.into_any();
    }
    view! {
        <fieldset class="networks" aria-describedby="networks-error">
            <legend>"Networks"</legend>
            <input type="hidden" name="networks_offered" value="1"/>
            <FieldError result=result field="networks"/>
            {list.into_iter().map(|n| {
                let id = format!("net-{}", n.uuid);
                view! {
                    <div class="field check" data-network=n.name.clone()>
                        <input type="checkbox" id=id.clone() name=format!("networks[net-{}]", n.uuid) value="on" checked=n.default/>
                        <label for=id>
                            <strong>{n.name.clone()}</strong>
                            " " <code>{n.subnet.clone()}</code>
                            {n.default.then(|| view! { " " <span class="muted">"(default)"</span> })}
                            {n.description.clone().map(|d| view! { " · " <span class="muted">{d}</span> })}
                        </label>
                    </div>
                }
            }).collect_view()}
        </fieldset>
    }
    .into_any()
}
