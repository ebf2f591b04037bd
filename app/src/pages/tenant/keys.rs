//! The signed-in person's SSH keys: new instances get them, so `ssh` logs in.

use crate::components::errors::{FieldError, FormStatus, Loaded};
use crate::components::guard::{Audience, Guard};
use crate::components::widgets::CsrfField;
use crate::data::load;
use crate::fmt;
use crate::rpc::{AddKey, DeleteKey, list_keys};
use leptos::prelude::*;
use leptos_meta::Title;
use leptos_router::hooks::use_query_map;
use passage_model::keys::SshKey;

#[component]
pub fn KeysPage() -> impl IntoView {
    let add = ServerAction::<AddKey>::new();
    let delete = ServerAction::<DeleteKey>::new();
    let q = use_query_map();
    let data = load(
        move || (add.version().get(), delete.version().get()),
        |_| list_keys(),
    );
    let result = Signal::derive(move || add.value().get());
    // The key asked about, from `?delete=NAME` (a link, so it works without scripts).
    let asking = Signal::derive(move || q.read().get("delete").filter(|n| !n.is_empty()));
    view! {
        <Title text="SSH keys · Passage"/>
        <Guard audience=Audience::Anyone>
            <h1>"SSH keys"</h1>
            <p>"Instances you create from now on let these keys log in."</p>
            <Loaded data=data let:keys>
                <KeyTable keys=keys asking=asking delete=delete/>
            </Loaded>
            <FormStatus result=Signal::derive(move || delete.value().get())/>
            <section class="card" aria-labelledby="key-form-h">
                <h2 id="key-form-h">"Add a key"</h2>
                <ActionForm action=add>
                    <CsrfField/>
                    <div class="field">
                        <label for="k-name">"Name"</label>
                        <input id="k-name" name="name" type="text" autocomplete="off" maxlength="64"
                            placeholder="laptop" aria-describedby="k-name-hint name-error"/>
                        <span id="k-name-hint" class="muted">"Optional: the key's comment when left empty."</span>
                        <FieldError result=result field="name"/>
                    </div>
                    <div class="field wide">
                        <label for="k-key">"Public key"</label>
                        <textarea id="k-key" name="key" rows="4" spellcheck="false" autocomplete="off"
                            placeholder="ssh-ed25519 AAAA… you@laptop" aria-describedby="k-key-hint key-error"></textarea>
                        <span id="k-key-hint" class="muted">"One line, such as the one in ~/.ssh/id_ed25519.pub: ed25519, ECDSA P-256, or RSA of 2048 bits or more."</span>
                        <FieldError result=result field="key"/>
                    </div>
                    <FormStatus result=result ok="Key added."/>
                    <button type="submit">"Add key"</button>
                </ActionForm>
            </section>
        </Guard>
    }
}

#[component]
fn KeyTable(
    keys: Vec<SshKey>,
    asking: Signal<Option<String>>,
    delete: ServerAction<DeleteKey>,
) -> impl IntoView {
    if keys.is_empty() {
        return view! { <p>"You have no SSH keys yet: add one below to log in to your instances."</p> }
            .into_any();
    }
    view! {
        <table data-testid="keys">
            <thead>
                <tr>
                    <th scope="col">"Name"</th>
                    <th scope="col">"Fingerprint"</th>
                    <th scope="col">"Added"</th>
                    <th scope="col"><span class="sr-only">"Actions"</span></th>
                </tr>
            </thead>
            <tbody>
                {keys.into_iter().map(|k| {
                    let name = k.name.clone();
                    let confirm = move || asking.get().as_deref() == Some(name.as_str());
                    let kind = k.key.split_whitespace().next().unwrap_or("").to_string();
                    let ask = format!("/keys?delete={}", fmt::urlencode(&k.name));
                    let label = format!("Delete {}", k.name);
                    let yes = format!("Yes, delete {}", k.name);
                    let value = k.name.clone();
                    view! {
                        <tr data-key=k.name.clone()>
                            <th scope="row">{k.name.clone()}</th>
                            <td>
                                <code data-testid="fingerprint">{k.fingerprint.clone()}</code>
                                <br/>
                                <span class="muted">{kind} " · MD5 " <code>{k.md5_fingerprint.clone()}</code></span>
                            </td>
                            <td>{fmt::time(&k.created_at)}</td>
                            <td>
                                {move || if confirm() {
                                    let (value, yes) = (value.clone(), yes.clone());
                                    view! {
                                        <ActionForm action=delete>
                                            <CsrfField/>
                                            <input type="hidden" name="name" value=value/>
                                            <button type="submit" class="danger">{yes}</button>
                                            " "
                                            <a href="/keys">"Keep it"</a>
                                        </ActionForm>
                                    }.into_any()
                                } else {
                                    view! { <a class="button danger" href=ask.clone()>{label.clone()}</a> }.into_any()
                                }}
                            </td>
                        </tr>
                    }
                }).collect_view()}
            </tbody>
        </table>
    }
    .into_any()
}
