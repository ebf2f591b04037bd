use crate::components::errors::{FormStatus, Loaded};
use crate::components::guard::{Audience, Guard};
use crate::components::widgets::{Badge, CsrfField};
use crate::data::{load, poll};
use crate::fmt;
use crate::pages::admin::jobs::JobSteps;
use crate::pages::tenant::terminal::Terminal;
use crate::rpc::{
    Console, DeleteInstanceTag, DestroyInstance, Instance, PowerInstance, SetInstanceTag,
    get_console, get_instance,
};
use leptos::prelude::*;
use leptos_meta::Title;
use leptos_router::hooks::{use_params_map, use_query_map};

#[component]
pub fn InstancePage() -> impl IntoView {
    let params = use_params_map();
    let q = use_query_map();
    let destroy = ServerAction::<DestroyInstance>::new();
    let power = ServerAction::<PowerInstance>::new();
    let set_tag = ServerAction::<SetInstanceTag>::new();
    let delete_tag = ServerAction::<DeleteInstanceTag>::new();
    let data = load(
        move || {
            (
                params.read().get("uuid").unwrap_or_default(),
                destroy.version().get(),
                power.version().get(),
                set_tag.version().get() + delete_tag.version().get(),
            )
        },
        |(uuid, _, _, _)| get_instance(uuid),
    );
    // Job steps and device states move on their own: follow them until the VM settles.
    poll(data, 1000);
    // The console is read from the VM's node: again every 2 s while it boots and for the
    // first minute it runs, never once it is gone.
    let tick = RwSignal::new(0u32);
    let console = load(
        move || (params.read().get("uuid").unwrap_or_default(), tick.get()),
        |(uuid, _)| async move {
            match get_console(uuid).await {
                // Not found or not allowed: the page itself says so, once.
                Err(e) if e.code.page_status().is_some() => Ok(Console::Hidden),
                other => other,
            }
        },
    );
    follow_console(data, tick);
    let confirming = move || q.read().get("confirm").as_deref() == Some("destroy");
    view! {
        <Title text="Instance · Passage"/>
        <Guard audience=Audience::Anyone>
            <Loaded data=data let:i>
                {
                let vm = i.vm.clone();
                let uuid = vm.uuid.to_string();
                let state = vm.state.as_str();
                let gone = matches!(state, "destroying" | "destroyed");
                view! {
                    <h1>"Instance " {vm.alias.clone()}</h1>
                    <dl class="facts">
                        <dt>"State"</dt><dd data-testid="vm-state"><Badge state=state/></dd>
                        <dt>"UUID"</dt><dd><code>{uuid.clone()}</code></dd>
                        <dt>"Package"</dt><dd>{i.package.clone().unwrap_or_else(|| "-".into())}</dd>
                        <dt>"Image"</dt><dd data-testid="vm-image">{i.image.clone().unwrap_or_else(|| "-".into())}</dd>
                        <dt>"Size"</dt><dd>{vm.vcpus} " vCPUs, " {vm.memory_mib} " MiB"</dd>
                        <dt>"Created"</dt><dd>{fmt::time(&vm.created_at)}</dd>
                    </dl>
                    <Power action=power uuid=uuid.clone() state=state.to_string()/>
                    <Addresses i=i.clone() gone=gone/>
                    <Keys keys=vm.keys.clone()/>
                    <Tags set=set_tag delete=delete_tag uuid=uuid.clone() tags=vm.tags.clone() gone=gone/>
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
            <FormStatus result=Signal::derive(move || power.value().get())/>
            <FormStatus result=Signal::derive(move || set_tag.value().get())/>
            <FormStatus result=Signal::derive(move || delete_tag.value().get())/>
            <Show when=move || {
                data.get()
                    .and_then(|r| r.ok())
                    .is_some_and(|i| i.vm.state == passage_model::api::VmState::Running)
            }>
                <Terminal uuid=params.read_untracked().get("uuid").unwrap_or_default()/>
            </Show>
            <Loaded data=console quiet=true let:c>
                <ConsoleView c=c/>
            </Loaded>
        </Guard>
    }
}

/// Stop, start and reboot, each with the states it leads to; offered as the VM's state
/// allows (a running VM stops or reboots, a stopped one starts).
#[component]
fn Power(action: ServerAction<PowerInstance>, uuid: String, state: String) -> impl IntoView {
    let offered: &[(&str, &str, &str)] = match state.as_str() {
        "running" => &[
            (
                "stop",
                "Stop",
                "stopping, then stopped: the guest is asked to shut down",
            ),
            ("reboot", "Reboot", "stopping, then running again"),
        ],
        "stopped" => &[("start", "Start", "running")],
        _ => &[],
    };
    if offered.is_empty() {
        return ().into_any();
    }
    view! {
        <section class="power" data-testid="power" aria-labelledby="power-h">
            <h2 id="power-h">"Power"</h2>
            {offered.iter().map(|(what, label, leads)| {
                let force = *what != "start";
                let uuid = uuid.clone();
                view! {
                    <ActionForm action=action>
                        <CsrfField/>
                        <input type="hidden" name="uuid" value=uuid/>
                        <input type="hidden" name="action" value=*what/>
                        <button type="submit" data-action=*what
                            disabled=move || action.pending().get()>{*label}</button>
                        " "
                        <span class="muted">"→ " {*leads}</span>
                        {force.then(|| view! {
                            " "
                            <label class="muted">
                                <input type="checkbox" name="force" value="on"/>
                                " force (cut the power)"
                            </label>
                        })}
                    </ActionForm>
                }
            }).collect_view()}
        </section>
    }
    .into_any()
}

/// The owner's SSH keys the instance was given, by name and fingerprint.
#[component]
fn Keys(keys: Option<Vec<passage_model::keys::VmKey>>) -> impl IntoView {
    let body = match keys {
        None => view! {
            <p class="muted">"All of the owner's keys at its creation (made before keys could be chosen)."</p>
        }
        .into_any(),
        Some(k) if k.is_empty() => view! { <p>"None: no SSH key logs in to it."</p> }.into_any(),
        Some(k) => view! {
            <ul data-testid="vm-keys">
                {k.into_iter().map(|k| {
                    let name = k.name.clone();
                    view! {
                        <li data-key=name>{k.name} " " <code class="muted">{k.fingerprint}</code></li>
                    }
                }).collect_view()}
            </ul>
        }
        .into_any(),
    };
    view! {
        <h2>"SSH keys"</h2>
        {body}
    }
}

/// Its tags, each changed or removed where it stands, and a row that adds one. Values
/// are typed as the `triton` CLI types them: `true`, `false` and numbers keep their type.
#[component]
fn Tags(
    set: ServerAction<SetInstanceTag>,
    delete: ServerAction<DeleteInstanceTag>,
    uuid: String,
    tags: passage_model::tags::Tags,
    gone: bool,
) -> impl IntoView {
    let shown = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let busy = move || set.pending().get() || delete.pending().get();
    let empty = tags.is_empty();
    let rows = tags
        .into_iter()
        .map(|(k, v)| {
            let value = shown(&v);
            let kind = match v {
                serde_json::Value::Bool(_) => "boolean",
                serde_json::Value::Number(_) => "number",
                _ => "text",
            };
            let (u1, u2, k1, k2) = (uuid.clone(), uuid.clone(), k.clone(), k.clone());
            let label = format!("Value of {k}");
            let row = k.clone();
            view! {
                <tr data-tag=row>
                    <th scope="row"><code>{k}</code></th>
                    <td>
                        {if gone {
                            view! { <span data-kind=kind>{value}</span> }.into_any()
                        } else {
                            view! {
                                <ActionForm action=set>
                                    <CsrfField/>
                                    <input type="hidden" name="uuid" value=u1/>
                                    <input type="hidden" name="key" value=k1/>
                                    <input name="value" value=value data-kind=kind
                                        aria-label=label maxlength="1024"/>
                                    " "
                                    <button type="submit" disabled=busy>"Save"</button>
                                </ActionForm>
                            }.into_any()
                        }}
                    </td>
                    <td>
                        {(!gone).then(|| view! {
                            <ActionForm action=delete>
                                <CsrfField/>
                                <input type="hidden" name="uuid" value=u2/>
                                <input type="hidden" name="key" value=k2/>
                                <button type="submit" class="danger" disabled=busy>"Remove"</button>
                            </ActionForm>
                        })}
                    </td>
                </tr>
            }
        })
        .collect_view();
    view! {
        <section class="tags" data-testid="tags" aria-labelledby="tags-h">
            <h2 id="tags-h">"Tags"</h2>
            {empty.then(|| view! { <p class="muted">"None yet."</p> })}
            {(!empty).then(|| view! {
                <table class="list">
                    <thead><tr><th scope="col">"Name"</th><th scope="col">"Value"</th><th></th></tr></thead>
                    <tbody>{rows}</tbody>
                </table>
            })}
            {(!gone).then(|| view! {
                <div class="add-tag" data-testid="add-tag">
                <ActionForm action=set>
                    <CsrfField/>
                    <input type="hidden" name="uuid" value=uuid.clone()/>
                    <label>"Name " <input name="key" required maxlength="128"/></label>
                    " "
                    <label>"Value " <input name="value" maxlength="1024"/></label>
                    " "
                    <button type="submit" disabled=busy>"Add tag"</button>
                    " "
                    <span class="muted">"true, false and numbers keep their type."</span>
                </ActionForm>
                </div>
            })}
        </section>
    }
}

/// Its addresses, the primary marked, and the command that logs in to it.
#[component]
fn Addresses(i: Instance, gone: bool) -> impl IntoView {
    let vm = i.vm;
    if vm.nics.is_empty() {
        return view! {
            <h2>"Addresses"</h2>
            <p>"None: this instance is on no network."</p>
        }
        .into_any();
    }
    let ssh = vm
        .primary_ip
        .filter(|_| !gone)
        .map(|ip| format!("ssh {}@{ip}", i.login_user));
    view! {
        <h2>"Addresses"</h2>
        <ul class="nics" data-testid="nics">
            {vm.nics.iter().map(|n| {
                let net = n.network_uuid.to_string();
                let name = i.network_names.get(&net).cloned()
                    .unwrap_or_else(|| fmt::short_uuid(&net).to_string());
                view! {
                    <li data-ip=n.ip.to_string() data-primary=n.primary.to_string()>
                        <code>{n.ip.to_string()}</code>
                        " on " {name}
                        " · MAC " <code>{n.mac.clone()}</code>
                        {n.primary.then(|| view! { " " <span class="badge s-primary">"primary"</span> })}
                    </li>
                }
            }).collect_view()}
        </ul>
        {ssh.map(|cmd| view! { <SshCommand cmd=cmd/> })}
    }
    .into_any()
}

/// The command to paste into a terminal, with a button that copies it.
#[component]
fn SshCommand(cmd: String) -> impl IntoView {
    let copied = RwSignal::new(None::<bool>);
    #[cfg(feature = "hydrate")]
    let on_copy = {
        let cmd = cmd.clone();
        move |_: leptos::ev::MouseEvent| copied.set(Some(copy_text(&cmd)))
    };
    #[cfg(not(feature = "hydrate"))]
    let on_copy = move |_: leptos::ev::MouseEvent| copied.set(None);
    view! {
        <p class="ssh">
            <span class="muted">"Log in with "</span>
            <code data-testid="ssh-command">{cmd}</code>
            " "
            <button type="button" class="copy" on:click=on_copy aria-describedby="copy-status">"Copy"</button>
            " "
            <span id="copy-status" class="muted" role="status">
                {move || match copied.get() {
                    Some(true) => "Copied.",
                    Some(false) => "Select the command and copy it.",
                    None => "",
                }}
            </span>
        </p>
    }
}

/// Puts `text` on the clipboard; false where the browser offers no clipboard (a page
/// not served over HTTPS or from this machine).
#[cfg(feature = "hydrate")]
fn copy_text(text: &str) -> bool {
    let Some(w) = web_sys::window() else {
        return false;
    };
    let clip = w.navigator().clipboard();
    if clip.is_undefined() || clip.is_null() {
        return false;
    }
    let _ = clip.write_text(text);
    true
}

/// The console panel: the end of the VM's serial console, or why there is none now.
#[component]
fn ConsoleView(c: Console) -> impl IntoView {
    let body = match c {
        Console::Hidden => return ().into_any(),
        Console::Output { text, read_at } if !text.is_empty() => view! {
            <div class="console-scroll">
                <pre data-testid="console-output">{text}</pre>
            </div>
            <p class="muted">"Read " {fmt::time(&read_at)} "."</p>
        }
        .into_any(),
        Console::Output { .. } => {
            view! { <p class="muted" data-testid="console-empty">"Nothing on the console yet."</p> }
                .into_any()
        }
        Console::Unavailable(why) => view! {
            <p class="muted" data-testid="console-unavailable">"The console is not available now (" {why} ")."</p>
        }
        .into_any(),
    };
    view! {
        <section class="console" data-testid="console" aria-labelledby="console-h">
            <h2 id="console-h">"Console"</h2>
            {body}
        </section>
    }
    .into_any()
}

/// Moves `tick` on every 2 s while the VM is provisioning, and during the first minute
/// after the page loaded while it runs; not at all once it is stopping or gone.
fn follow_console(data: crate::data::Data<Instance>, tick: RwSignal<u32>) {
    #[cfg(feature = "hydrate")]
    {
        use passage_model::api::VmState;
        Effect::new(move |_| {
            let ticks = std::rc::Rc::new(std::cell::Cell::new(0u32));
            if let Ok(h) = set_interval_with_handle(
                move || {
                    let n = ticks.get() + 1;
                    ticks.set(n);
                    let state = data
                        .get_untracked()
                        .and_then(|r| r.ok())
                        .map(|i| i.vm.state);
                    let follow = match state {
                        Some(VmState::Provisioning | VmState::Stopping) => true,
                        Some(VmState::Running) => n <= 30,
                        _ => false,
                    };
                    if follow {
                        tick.update(|t| *t += 1);
                    }
                },
                std::time::Duration::from_millis(2000),
            ) {
                on_cleanup(move || h.clear());
            }
        });
    }
    #[cfg(not(feature = "hydrate"))]
    {
        let _ = (data, tick);
    }
}
