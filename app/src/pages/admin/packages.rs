use crate::components::errors::{FieldError, FormStatus, Loaded};
use crate::components::guard::{Audience, Guard};
use crate::components::widgets::CsrfField;
use crate::data::load;
use crate::error::PortalError;
use crate::rpc::{CreatePackage, DeletePackage, VariantRow, list_packages, list_variants};
use leptos::prelude::*;
use leptos_meta::Title;
use passage_model::api::Package;

#[component]
pub fn PackagesPage() -> impl IntoView {
    let create = ServerAction::<CreatePackage>::new();
    let delete = ServerAction::<DeletePackage>::new();
    let data = load(
        move || (create.version().get(), delete.version().get()),
        |_| list_packages(),
    );
    let variants = load(|| (), |_| list_variants());
    let result = Signal::derive(move || create.value().get());
    view! {
        <Title text="Packages · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"Packages"</h1>
            <p>"What tenants can order: a VM size and the devices it gets."</p>
            <Loaded data=data let:rows>
                <PackageTable rows=rows delete=delete/>
            </Loaded>
            <FormStatus result=Signal::derive(move || delete.value().get())/>
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
                    <fieldset class="devices" aria-describedby="devices-error">
                        <legend>"Devices per VM"</legend>
                        <p class="muted">"How many of each variant every VM of this package gets; empty for none."</p>
                        <Loaded data=variants quiet=true let:rows>
                            <DeviceCounts rows=rows result=result/>
                        </Loaded>
                        <FieldError result=result field="devices"/>
                    </fieldset>
                    <FormStatus result=result ok="Package created."/>
                    <button type="submit">"Create package"</button>
                </ActionForm>
            </section>
        </Guard>
    }
}

#[component]
fn PackageTable(rows: Vec<Package>, delete: ServerAction<DeletePackage>) -> impl IntoView {
    view! {
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
                            <td data-testid="devices">{if devices.is_empty() { "none".to_string() } else { devices }}</td>
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
    }
}

/// A count field for every variant (`devices[NAME]`), so one plain form asks for
/// devices of several variants at once, with or without scripts.
#[component]
fn DeviceCounts(
    rows: Vec<VariantRow>,
    result: Signal<Option<Result<(), PortalError>>>,
) -> impl IntoView {
    if rows.is_empty() {
        return view! {
            <p>"No device variants yet: define one on the " <a href="/admin/variants">"Variants"</a> " page first."</p>
        }
        .into_any();
    }
    view! {
        <div class="device-counts">
            {rows.into_iter().map(|r| {
                let name = r.variant.name;
                let id = format!("p-dev-{name}");
                let field = format!("devices.{name}");
                view! {
                    <div class="field" data-variant=name.clone()>
                        <label for=id.clone()>
                            {name.clone()}
                            " " <span class="muted">{format!("({} in the fleet)", r.matches)}</span>
                        </label>
                        <input id=id name=format!("devices[{name}]") type="text" inputmode="numeric"
                            size="4" placeholder="0" aria-describedby=format!("{field}-error")/>
                        <FieldError result=result field=field/>
                    </div>
                }
            }).collect_view()}
        </div>
    }
    .into_any()
}
