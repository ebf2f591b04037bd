//! Networks for operators: the list with a form for a new one, and each network's page
//! with the addresses in use, its edit form and its deletion.

use crate::components::errors::{FieldError, FormStatus, Loaded};
use crate::components::guard::{Audience, Guard};
use crate::components::list::{ListPage, Pager, use_query_param};
use crate::components::widgets::{Badge, CsrfField};
use crate::data::{load, poll};
use crate::error::PortalError;
use crate::rpc::{
    CreateNetwork, DeleteNetwork, NetworkDetail, NetworkRow, UpdateNetwork, get_network,
    list_networks,
};
use leptos::prelude::*;
use leptos_meta::Title;
use leptos_router::hooks::{use_params_map, use_query_map};
use passage_model::networks::Network;

#[component]
pub fn NetworksPage() -> impl IntoView {
    let create = ServerAction::<CreateNetwork>::new();
    let get = use_query_param();
    let data = load(
        move || {
            (
                create.version().get(),
                get("offset").and_then(|o| o.parse::<u64>().ok()),
            )
        },
        |(_, offset)| list_networks(offset),
    );
    // Addresses come and go with VMs.
    poll(data, 5000);
    let result = Signal::derive(move || create.value().get());
    view! {
        <Title text="Networks · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"Networks"</h1>
            <p>"The subnets VMs take addresses from, each on a Linux bridge of every node."</p>
            <ListPage path="/admin/networks" data=data cursor="offset" empty="No networks yet: VMs get no addresses." let:rows>
                <NetworkTable rows=rows/>
            </ListPage>
            <section class="card" aria-labelledby="net-form-h">
                <h2 id="net-form-h">"New network"</h2>
                <ActionForm action=create>
                    <CsrfField/>
                    {FIELDS.iter().map(|f| view! { <TextField f=*f result=result/> }).collect_view()}
                    <Checks public=false default=false/>
                    <FormStatus result=result/>
                    <button type="submit">"Create network"</button>
                </ActionForm>
            </section>
        </Guard>
    }
}

/// A text field of the form: (id, name, label, initial value, hint).
type Text = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
);

/// One loop over these, not one view each: every distinct view is more code in the
/// browser's bundle.
const FIELDS: [Text; 11] = [
    ("n-name", "name", "Name", "", ""),
    (
        "n-subnet",
        "subnet",
        "Subnet",
        "",
        "IPv4 in CIDR form, /16 to /30, e.g. 192.0.2.0/24",
    ),
    (
        "n-gateway",
        "gateway",
        "Gateway",
        "",
        "optional; inside the subnet",
    ),
    (
        "n-start",
        "provision_start_ip",
        "First address handed out",
        "",
        "default: the subnet's first host",
    ),
    (
        "n-end",
        "provision_end_ip",
        "Last address handed out",
        "",
        "default: the subnet's last host",
    ),
    (
        "n-resolvers",
        "resolvers",
        "DNS resolvers",
        "",
        "comma-separated addresses",
    ),
    (
        "n-bridge",
        "bridge",
        "Bridge",
        "br0",
        "the Linux bridge on each node",
    ),
    ("n-vlan", "vlan_id", "VLAN id", "0", "0: untagged"),
    ("n-mtu", "mtu", "MTU", "1500", ""),
    (
        "n-owners",
        "owner_uuids",
        "Owners",
        "",
        "account logins or UUIDs, comma-separated: who may use a non-public network",
    ),
    ("n-description", "description", "Description", "", ""),
];

#[component]
fn TextField(
    f: Text,
    result: Signal<Option<Result<(), PortalError>>>,
    /// The value shown instead of the field's initial one.
    #[prop(optional)]
    value: Option<String>,
) -> impl IntoView {
    let (id, name, label, initial, hint) = f;
    let value = value.unwrap_or_else(|| initial.to_string());
    let hint_id = format!("{name}-hint");
    let described = if hint.is_empty() {
        format!("{name}-error")
    } else {
        format!("{hint_id} {name}-error")
    };
    view! {
        <div class="field">
            <label for=id>{label}</label>
            <input id=id name=name type="text" autocomplete="off" value=value aria-describedby=described/>
            {(!hint.is_empty()).then(|| view! { <span id=hint_id class="muted">{hint}</span> })}
            <FieldError result=result field=name/>
        </div>
    }
}

/// The form's two boxes: public, default.
#[component]
fn Checks(public: bool, default: bool) -> impl IntoView {
    view! {
        <div class="field check">
            <input id="n-public" name="public" type="checkbox" checked=public/>
            <label for="n-public">"Public: every tenant may use it"</label>
        </div>
        <div class="field check">
            <input id="n-default" name="default" type="checkbox" checked=default/>
            <label for="n-default">"Default: new VMs that name no network get an address on it"</label>
        </div>
    }
}

/// What a network keeps for good (the API changes none of it): its subnet, gateway,
/// range, bridge and VLAN, as terms of a `<dl>`.
fn fixed(n: &Network) -> impl IntoView + use<> {
    view! {
        <dt>"Subnet"</dt><dd><code>{n.subnet.clone()}</code></dd>
        <dt>"Gateway"</dt><dd>{n.gateway.map(|g| g.to_string()).unwrap_or_else(|| "-".into())}</dd>
        <dt>"Range"</dt><dd>{format!("{} – {}", n.provision_start_ip, n.provision_end_ip)}</dd>
        <dt>"Bridge"</dt><dd><code>{n.bridge.clone()}</code></dd>
        <dt>"VLAN"</dt><dd>{if n.vlan_id == 0 { "untagged".to_string() } else { n.vlan_id.to_string() }}</dd>
    }
}

/// "public", "default", or who may use it.
fn audience(n: &Network) -> String {
    let mut out = if n.public {
        "public".to_string()
    } else {
        format!("{} owner(s)", n.owner_uuids.len())
    };
    if n.default {
        out.push_str(", default");
    }
    out
}

#[component]
fn NetworkTable(rows: Vec<NetworkRow>) -> impl IntoView {
    view! {
        <table data-testid="networks">
            <caption class="sr-only">"Networks"</caption>
            <thead>
                <tr>
                    <th scope="col">"Name"</th>
                    <th scope="col">"Subnet"</th>
                    <th scope="col">"Gateway"</th>
                    <th scope="col">"Range"</th>
                    <th scope="col">"Bridge"</th>
                    <th scope="col">"VLAN"</th>
                    <th scope="col">"MTU"</th>
                    <th scope="col">"Who uses it"</th>
                    <th scope="col">"In use"</th>
                </tr>
            </thead>
            <tbody>
                {rows.into_iter().map(|r| {
                    let n = r.network;
                    let who = audience(&n);
                    view! {
                        <tr data-network=n.name.clone()>
                            <th scope="row"><a href=format!("/admin/networks/{}", n.uuid)>{n.name.clone()}</a></th>
                            <td><code>{n.subnet.clone()}</code></td>
                            <td>{n.gateway.map(|g| g.to_string()).unwrap_or_else(|| "-".into())}</td>
                            <td>{format!("{} – {}", n.provision_start_ip, n.provision_end_ip)}</td>
                            <td><code>{n.bridge.clone()}</code></td>
                            <td>{if n.vlan_id == 0 { "untagged".to_string() } else { n.vlan_id.to_string() }}</td>
                            <td>{n.mtu}</td>
                            <td>{who}</td>
                            <td data-testid="in-use">{r.in_use}</td>
                        </tr>
                    }
                }).collect_view()}
            </tbody>
        </table>
    }
}

#[component]
pub fn NetworkPage() -> impl IntoView {
    let params = use_params_map();
    let q = use_query_map();
    let get = use_query_param();
    let delete = ServerAction::<DeleteNetwork>::new();
    let data = load(
        move || {
            (
                params.read().get("uuid").unwrap_or_default(),
                get("offset").and_then(|o| o.parse::<u64>().ok()),
                delete.version().get(),
            )
        },
        |(uuid, offset, _)| get_network(uuid, offset),
    );
    poll(data, 5000);
    let confirming = Signal::derive(move || q.read().get("confirm").as_deref() == Some("delete"));
    view! {
        <Title text="Network · Passage"/>
        <Guard audience=Audience::Staff>
            <Loaded data=data let:d>
                <NetworkView d=d confirming=confirming delete=delete/>
            </Loaded>
            <FormStatus result=Signal::derive(move || delete.value().get())/>
        </Guard>
    }
}

#[component]
fn NetworkView(
    d: NetworkDetail,
    confirming: Signal<bool>,
    delete: ServerAction<DeleteNetwork>,
) -> impl IntoView {
    let n = d.network;
    let uuid = n.uuid.to_string();
    let resolvers = if n.resolvers.is_empty() {
        "-".to_string()
    } else {
        n.resolvers
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let who = if n.public {
        "every tenant (public)".to_string()
    } else if d.owners.is_empty() {
        "operators only".to_string()
    } else {
        d.owners.join(", ")
    };
    let page = d.addresses;
    let shown = page.items.len();
    let base = format!("/admin/networks/{uuid}");
    let in_use = page.total;
    view! {
        <h1>"Network " {n.name.clone()}</h1>
        <dl class="facts">
            {fixed(&n)}
            <dt>"Resolvers"</dt><dd>{resolvers}</dd>
            <dt>"MTU"</dt><dd>{n.mtu}</dd>
            <dt>"Used by"</dt><dd data-testid="owners">{who}</dd>
            <dt>"Default"</dt><dd>{if n.default { "yes: new VMs that name no network get an address on it" } else { "no" }}</dd>
            <dt>"UUID"</dt><dd><code>{uuid.clone()}</code></dd>
            {n.description.clone().map(|t| view! { <dt>"Description"</dt><dd>{t}</dd> })}
        </dl>
        <p><a class="button" href=format!("/admin/networks/{uuid}/edit")>"Edit network"</a></p>
        <h2>"Addresses in use " <span class="muted" data-testid="address-count">{format!("({in_use})")}</span></h2>
        {if page.items.is_empty() {
            view! { <p>"None: no VM holds an address on this network."</p> }.into_any()
        } else {
            view! {
                <table data-testid="addresses">
                    <thead>
                        <tr>
                            <th scope="col">"Address"</th>
                            <th scope="col">"MAC"</th>
                            <th scope="col">"VM"</th>
                            <th scope="col">"State"</th>
                            <th scope="col">"Owner"</th>
                        </tr>
                    </thead>
                    <tbody>
                        {page.items.into_iter().map(|a| {
                            let vm = a.vm_uuid.to_string();
                            let label = a.vm_alias.clone().unwrap_or_else(|| crate::fmt::short_uuid(&vm).to_string());
                            let owner = a.owner_uuid.to_string();
                            view! {
                                <tr data-ip=a.ip.to_string() data-vm=vm.clone()>
                                    <th scope="row"><code>{a.ip.to_string()}</code></th>
                                    <td><code>{a.mac.clone()}</code></td>
                                    <td><a href=format!("/instances/{vm}") title=vm.clone()>{label}</a></td>
                                    <td>{a.vm_state.clone().map(|s| view! { <Badge state=s/> })}</td>
                                    <td><a href=format!("/admin/vms?owner={owner}")>{a.owner.clone()}</a></td>
                                </tr>
                            }
                        }).collect_view()}
                    </tbody>
                </table>
            }.into_any()
        }}
        <Pager total=page.total shown=shown next=page.next base=base cursor_param="offset"/>
        <Delete uuid=uuid name=n.name.clone() in_use=in_use confirming=confirming delete=delete/>
    }
}

/// Delete, after a confirmation on the page itself (a link, so it works without
/// scripts). The server refuses while addresses are in use, and says so.
#[component]
fn Delete(
    uuid: String,
    name: String,
    in_use: u64,
    confirming: Signal<bool>,
    delete: ServerAction<DeleteNetwork>,
) -> impl IntoView {
    let ask = format!("/admin/networks/{uuid}?confirm=delete");
    let keep = format!("/admin/networks/{uuid}");
    let heading = format!("Delete {name}?");
    let yes = format!("Yes, delete {name}");
    let consequence = if in_use > 0 {
        "VMs hold addresses on it: the server keeps a network while they do."
    } else {
        "The network goes; VMs can no longer ask for it. This cannot be undone."
    };
    move || {
        let (uuid, yes, keep, ask) = (uuid.clone(), yes.clone(), keep.clone(), ask.clone());
        if confirming.get() {
            view! {
                <section class="card danger-zone" aria-labelledby="delete-h">
                    <h2 id="delete-h">{heading.clone()}</h2>
                    <p>{consequence}</p>
                    <ActionForm action=delete>
                        <CsrfField/>
                        <input type="hidden" name="uuid" value=uuid/>
                        <button type="submit" class="danger">{yes}</button>
                        " "
                        <a href=keep>"Keep it"</a>
                    </ActionForm>
                </section>
            }
            .into_any()
        } else {
            view! { <p><a class="button danger" href=ask>"Delete network"</a></p> }.into_any()
        }
    }
}

/// The edit form on a page of its own: the network's page reloads every few seconds,
/// which would wipe what is being typed.
#[component]
pub fn NetworkEditPage() -> impl IntoView {
    let params = use_params_map();
    let update = ServerAction::<UpdateNetwork>::new();
    let data = load(
        move || params.read().get("uuid").unwrap_or_default(),
        |uuid| get_network(uuid, None),
    );
    view! {
        <Title text="Edit network · Passage"/>
        <Guard audience=Audience::Staff>
            <Loaded data=data let:d>
                <EditForm d=d update=update/>
            </Loaded>
        </Guard>
    }
}

#[component]
fn EditForm(d: NetworkDetail, update: ServerAction<UpdateNetwork>) -> impl IntoView {
    let result = Signal::derive(move || update.value().get());
    let n = d.network;
    let uuid = n.uuid.to_string();
    let resolvers: Vec<String> = n.resolvers.iter().map(|r| r.to_string()).collect();
    // Name, resolvers, MTU, owners (by login), description.
    let values = [
        n.name.clone(),
        resolvers.join(", "),
        n.mtu.to_string(),
        d.owners.join(", "),
        n.description.clone().unwrap_or_default(),
    ];
    let fields = [FIELDS[0], FIELDS[5], FIELDS[8], FIELDS[9], FIELDS[10]];
    view! {
        <h1>"Edit network " {n.name.clone()}</h1>
        <section class="card" aria-labelledby="net-fixed-h">
            <h2 id="net-fixed-h">"Fixed"</h2>
            <p class="muted">"A network keeps these: for others, make a new network."</p>
            <dl class="facts">{fixed(&n)}</dl>
        </section>
        <section class="card" aria-labelledby="net-edit-h">
            <h2 id="net-edit-h">"Settings"</h2>
            <ActionForm action=update>
                <CsrfField/>
                <input type="hidden" name="uuid" value=uuid.clone()/>
                {fields.into_iter().zip(values).map(|(f, v)| view! { <TextField f=f result=result value=v/> }).collect_view()}
                <Checks public=n.public default=n.default/>
                <FormStatus result=result/>
                <button type="submit">"Save network"</button>
                " "
                <a href=format!("/admin/networks/{uuid}")>"Cancel"</a>
            </ActionForm>
        </section>
    }
}
