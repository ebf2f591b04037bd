use crate::components::errors::{FieldError, FormStatus, Loaded};
use crate::components::guard::{Audience, Guard};
use crate::components::widgets::CsrfField;
use crate::data::load;
use crate::rpc::{DeleteVariant, SaveVariant, list_variants};
use leptos::prelude::*;
use leptos_meta::Title;
use leptos_router::hooks::use_query_map;
use passage_model::Variant;

#[component]
pub fn VariantsPage() -> impl IntoView {
    let save = ServerAction::<SaveVariant>::new();
    let delete = ServerAction::<DeleteVariant>::new();
    let data = load(
        move || (save.version().get(), delete.version().get()),
        |_| list_variants(),
    );
    let q = use_query_map();
    let editing = move || q.read().get("edit");
    view! {
        <Title text="Variants · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"Device variants"</h1>
            <p>"A variant names a kind of device by its PCI ids; packages ask for variants."</p>
            <Loaded data=data let:rows>
                {
                let edit = editing().and_then(|n| rows.iter().find(|r| r.variant.name == n).map(|r| r.variant.clone()));
                view! {
                    <table data-testid="variants">
                        <thead>
                            <tr>
                                <th scope="col">"Name"</th>
                                <th scope="col">"Type"</th>
                                <th scope="col">"Vendor:device"</th>
                                <th scope="col">"Subsystem"</th>
                                <th scope="col">"Matches"</th>
                                <th scope="col">"Description"</th>
                                <th scope="col"><span class="sr-only">"Actions"</span></th>
                            </tr>
                        </thead>
                        <tbody>
                            {rows.into_iter().map(|r| {
                                let v = r.variant;
                                let name = v.name.clone();
                                let sub = match (&v.subvendor, &v.subsystem) {
                                    (None, None) => "any".to_string(),
                                    (a, b) => format!(
                                        "{}:{}",
                                        a.as_ref().map(|x| x.to_string()).unwrap_or_else(|| "*".into()),
                                        b.as_ref().map(|x| x.to_string()).unwrap_or_else(|| "*".into())
                                    ),
                                };
                                let kind = match (v.kind.as_str(), &v.parent) {
                                    ("vf", Some(p)) => format!("vf of {p} ({} per function)", v.num_vfs.unwrap_or(0)),
                                    ("vgpu", Some(p)) if v.mix => format!("vgpu of {p} (mixes)"),
                                    (k, Some(p)) => format!("{k} of {p}"),
                                    (k, None) => k.to_string(),
                                };
                                let hidden = name.clone();
                                let label = format!("Delete {name}");
                                view! {
                                    <tr data-variant=name.clone()>
                                        <th scope="row">{name.clone()}</th>
                                        <td>{kind}</td>
                                        <td><code>{format!("{}:{}", v.vendor, v.device)}</code></td>
                                        <td><code>{sub}</code></td>
                                        <td data-testid="matches">{r.matches} " devices"</td>
                                        <td>{v.description.clone().unwrap_or_default()}</td>
                                        <td class="actions">
                                            <a href=format!("/admin/variants?edit={name}")>"Edit " <span class="sr-only">{name.clone()}</span></a>
                                            <ActionForm action=delete>
                                                <CsrfField/>
                                                <input type="hidden" name="name" value=hidden/>
                                                <button type="submit" class="danger">{label}</button>
                                            </ActionForm>
                                        </td>
                                    </tr>
                                }
                            }).collect_view()}
                        </tbody>
                    </table>
                    <FormStatus result=Signal::derive(move || delete.value().get())/>
                    <VariantForm action=save existing=edit/>
                }
                }
            </Loaded>
        </Guard>
    }
}

#[component]
fn VariantForm(action: ServerAction<SaveVariant>, existing: Option<Variant>) -> impl IntoView {
    let result = Signal::derive(move || action.value().get());
    let editing = existing.is_some();
    let text =
        |f: fn(&Variant) -> Option<String>| existing.as_ref().and_then(f).unwrap_or_default();
    let name = text(|v| Some(v.name.clone()));
    let vendor = text(|v| Some(v.vendor.to_string()));
    let device = text(|v| Some(v.device.to_string()));
    let subvendor = text(|v| v.subvendor.as_ref().map(|h| h.to_string()));
    let subsystem = text(|v| v.subsystem.as_ref().map(|h| h.to_string()));
    let description = text(|v| v.description.clone());
    let parent = text(|v| v.parent.clone());
    let vgpu_type = text(|v| v.vgpu_type.clone());
    let max_per_gpu = text(|v| v.max_per_gpu.map(|n| n.to_string()));
    let num_vfs = text(|v| v.num_vfs.map(|n| n.to_string()));
    let mix = existing.as_ref().is_some_and(|v| v.mix);
    let kind = existing.as_ref().map(|v| v.kind.as_str()).unwrap_or("gpu");
    let field = move |id: &'static str, label: &'static str, value: String, hint: &'static str| {
        view! {
            <div class="field">
                <label for=format!("v-{id}")>{label}</label>
                <input id=format!("v-{id}") name=id type="text" value=value placeholder=hint
                    aria-describedby=format!("{id}-error")/>
                <FieldError result=result field=id/>
            </div>
        }
    };
    view! {
        <section class="card" aria-labelledby="variant-form-h">
            <h2 id="variant-form-h">{if editing { format!("Edit variant {name}") } else { "New variant".to_string() }}</h2>
            <ActionForm action=action>
                <CsrfField/>
                <input type="hidden" name="original" value=if editing { name.clone() } else { String::new() }/>
                {field("name", "Name", name.clone(), "NVIDIA_H100")}
                <div class="field">
                    <label for="v-kind">"Type"</label>
                    <select id="v-kind" name="kind">
                        {["gpu", "fpga", "nic", "nvme", "other", "vgpu", "vf"].into_iter().map(|k| view! {
                            <option value=k selected=kind == k>{k}</option>
                        }).collect_view()}
                    </select>
                    <FieldError result=result field="type"/>
                </div>
                {field("vendor", "Vendor id (hex)", vendor, "10de")}
                {field("device", "Device id (hex)", device, "2330")}
                {field("subvendor", "Subsystem vendor (optional)", subvendor, "any")}
                {field("subsystem", "Subsystem id (optional)", subsystem, "any")}
                {field("description", "Description", description, "")}
                <fieldset>
                    <legend>"Shares of a device (types vgpu and vf)"</legend>
                    {field("parent", "Parent variant (vgpu: its GPUs host them; vf: its functions make them)", parent, "NVIDIA_H100")}
                    {field("vgpu_type", "vGPU type, id or name (vgpu; ids come from the parent)", vgpu_type, "NVIDIA H100XM-10C")}
                    {field("max_per_gpu", "vGPUs per GPU (vgpu)", max_per_gpu, "4")}
                    <div class="field check">
                        <input id="v-mix" name="mix" type="checkbox" checked=mix
                            aria-describedby="mix-error"/>
                        <label for="v-mix">"Mixes: shares a GPU with other vGPU variants that mix (vgpu; MIG-backed types)"</label>
                        <FieldError result=result field="mix"/>
                    </div>
                    {field("num_vfs", "VFs per function (vf; ids are the VF's own)", num_vfs, "4")}
                </fieldset>
                <FormStatus result=result ok="Saved."/>
                <button type="submit">{if editing { "Save variant" } else { "Create variant" }}</button>
                {editing.then(|| view! { " " <a href="/admin/variants">"Cancel"</a> })}
            </ActionForm>
        </section>
    }
}
