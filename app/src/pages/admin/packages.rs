use crate::components::guard::{Audience, Guard};
use crate::components::widgets::{CsrfField, ErrorBox, FieldError, FormStatus};
use crate::rpc::{CreatePackage, DeletePackage, list_packages, list_variants};
use leptos::prelude::*;
use leptos_meta::Title;

#[component]
pub fn PackagesPage() -> impl IntoView {
    let create = ServerAction::<CreatePackage>::new();
    let delete = ServerAction::<DeletePackage>::new();
    let data = Resource::new(
        move || (create.version().get(), delete.version().get()),
        |_| list_packages(),
    );
    let variants = Resource::new(|| (), |_| list_variants());
    let result = Signal::derive(move || create.value().get());
    view! {
        <Title text="Packages · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"Packages"</h1>
            <p>"What tenants can order: a VM size and the devices it gets."</p>
            <Transition fallback=|| view! { <p class="loading">"Loading…"</p> }>
                {move || Suspend::new(async move {
                    match data.await {
                        Err(e) => view! { <ErrorBox error=e/> }.into_any(),
                        Ok(rows) => view! {
                            <table data-testid="packages">
                                <thead>
                                    <tr>
                                        <th scope="col">"Name"</th>
                                        <th scope="col">"vCPUs"</th>
                                        <th scope="col">"Memory"</th>
                                        <th scope="col">"Disk"</th>
                                        <th scope="col">"Devices"</th>
                                        <th scope="col"><span class="sr-only">"Actions"</span></th>
                                    </tr>
                                </thead>
                                <tbody>
                                    {rows.into_iter().map(|p| {
                                        let name = p.name.clone();
                                        let row = p.name.clone();
                                        let uuid = p.uuid.to_string();
                                        let label = format!("Delete {}", p.name);
                                        let devices = p.devices.iter().map(|(v, n)| format!("{n} × {v}")).collect::<Vec<_>>().join(", ");
                                        view! {
                                            <tr data-package=row>
                                                <th scope="row">{name}</th>
                                                <td>{p.vcpus}</td>
                                                <td>{p.memory_mib} " MiB"</td>
                                                <td>{p.disk_gib} " GiB"</td>
                                                <td>{if devices.is_empty() { "none".to_string() } else { devices }}</td>
                                                <td>
                                                    <ActionForm action=delete>
                                                        <CsrfField/>
                                                        <input type="hidden" name="uuid" value=uuid/>
                                                        <button type="submit" class="danger">{label}</button>
                                                    </ActionForm>
                                                </td>
                                            </tr>
                                        }
                                    }).collect_view()}
                                </tbody>
                            </table>
                        }.into_any(),
                    }
                })}
            </Transition>
            {move || delete.value().get().and_then(|r| r.err()).map(|e| view! { <ErrorBox error=e/> })}
            <section class="card" aria-labelledby="pkg-form-h">
                <h2 id="pkg-form-h">"New package"</h2>
                <ActionForm action=create>
                    <CsrfField/>
                    <div class="field">
                        <label for="p-name">"Name"</label>
                        <input id="p-name" name="name" type="text" aria-describedby="name-error"/>
                        <FieldError result=result field="name"/>
                    </div>
                    <div class="field">
                        <label for="p-vcpus">"vCPUs"</label>
                        <input id="p-vcpus" name="vcpus" type="text" inputmode="numeric" value="8" aria-describedby="vcpus-error"/>
                        <FieldError result=result field="vcpus"/>
                    </div>
                    <div class="field">
                        <label for="p-mem">"Memory (MiB)"</label>
                        <input id="p-mem" name="memory_mib" type="text" inputmode="numeric" value="65536" aria-describedby="memory_mib-error"/>
                        <FieldError result=result field="memory_mib"/>
                    </div>
                    <div class="field">
                        <label for="p-disk">"Disk (GiB)"</label>
                        <input id="p-disk" name="disk_gib" type="text" inputmode="numeric" value="100" aria-describedby="disk_gib-error"/>
                        <FieldError result=result field="disk_gib"/>
                    </div>
                    <div class="field">
                        <label for="p-variant">"Device variant"</label>
                        <select id="p-variant" name="variant" aria-describedby="devices-error">
                            <option value="">"none"</option>
                            <Transition fallback=|| ()>
                                {move || variants.get().and_then(|r| r.ok()).map(|vs| vs.into_iter().map(|v| {
                                    let n = v.variant.name;
                                    view! { <option value=n.clone()>{n.clone()}</option> }
                                }).collect_view())}
                            </Transition>
                        </select>
                        <FieldError result=result field="devices"/>
                    </div>
                    <div class="field">
                        <label for="p-count">"Devices per VM"</label>
                        <input id="p-count" name="count" type="text" inputmode="numeric" value="1" aria-describedby="count-error"/>
                        <FieldError result=result field="count"/>
                    </div>
                    <FormStatus result=result ok="Package created."/>
                    <button type="submit">"Create package"</button>
                </ActionForm>
            </section>
        </Guard>
    }
}
