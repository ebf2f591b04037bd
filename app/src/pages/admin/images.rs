//! The image catalog for operators: the list with a form for a new record, and each
//! image's page with its file's upload, the VMs built from it, and its deletion.

use crate::app::Session;
use crate::components::errors::{FieldError, FormStatus, Loaded};
use crate::components::guard::{Audience, Guard};
use crate::components::list::{ListPage, use_query_param};
use crate::components::widgets::{Badge, CsrfField};
use crate::data::{Data, load, poll};
use crate::fmt;
use crate::rpc::{CreateImage, DeleteImage, ImageDetail, ImageRow, get_image, list_images};
use leptos::prelude::*;
use leptos_meta::Title;
use leptos_router::hooks::{use_params_map, use_query_map};
use passage_model::images::{Image, ImageState};

#[component]
pub fn ImagesPage() -> impl IntoView {
    let create = ServerAction::<CreateImage>::new();
    let get = use_query_param();
    let data = load(
        move || {
            (
                create.version().get(),
                get("offset").and_then(|o| o.parse::<u64>().ok()),
            )
        },
        |(_, offset)| list_images(offset),
    );
    // VM counts and states change as tenants come and go.
    poll(data, 5000);
    let result = Signal::derive(move || create.value().get());
    view! {
        <Title text="Images · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"Images"</h1>
            <p>"What VMs boot from. A new image is unactivated until its file is uploaded and checked."</p>
            <ListPage path="/admin/images" data=data cursor="offset" empty="No images yet." let:rows>
                <ImageTable rows=rows/>
            </ListPage>
            <section class="card" aria-labelledby="img-form-h">
                <h2 id="img-form-h">"New image"</h2>
                <ActionForm action=create>
                    <CsrfField/>
                    {TEXT_FIELDS.iter().take(3).map(|f| view! { <TextField f=*f result=result/> }).collect_view()}
                    <div class="field">
                        <label for="i-type">"Type"</label>
                        <select id="i-type" name="image_type" aria-describedby="image_type-error">
                            <option value="qcow2" selected>"qcow2"</option>
                            <option value="raw">"raw"</option>
                        </select>
                        <FieldError result=result field="image_type"/>
                    </div>
                    {TEXT_FIELDS.iter().skip(3).map(|f| view! { <TextField f=*f result=result/> }).collect_view()}
                    <div class="field">
                        <label for="i-bootrom">"Firmware (bootrom)"</label>
                        <select id="i-bootrom" name="bootrom" aria-describedby="bootrom-error">
                            <option value="" selected>"default: UEFI with devices, BIOS without"</option>
                            <option value="uefi">"uefi"</option>
                            <option value="bios">"bios"</option>
                        </select>
                        <FieldError result=result field="bootrom"/>
                    </div>
                    <div class="field check">
                        <input id="i-public" name="public" type="checkbox"/>
                        <label for="i-public">"Public: offered to every tenant"</label>
                    </div>
                    <FormStatus result=result/>
                    <button type="submit">"Create image"</button>
                </ActionForm>
            </section>
        </Guard>
    }
}

/// A text field of the new-image form: (id, name, label, initial value).
type Text = (&'static str, &'static str, &'static str, &'static str);

/// One loop over these, not one view each: every distinct view is more code in the
/// browser's bundle.
const TEXT_FIELDS: [Text; 6] = [
    ("i-name", "name", "Name", ""),
    ("i-version", "version", "Version", ""),
    ("i-os", "os", "OS", "linux"),
    ("i-description", "description", "Description", ""),
    (
        "i-user",
        "default_user",
        "Default user (the guest's login, e.g. debian)",
        "",
    ),
    ("i-disk", "min_disk_gib", "Smallest disk (GiB)", ""),
];

#[component]
fn TextField(
    f: Text,
    result: Signal<Option<Result<(), crate::error::PortalError>>>,
) -> impl IntoView {
    let (id, name, label, value) = f;
    view! {
        <div class="field">
            <label for=id>{label}</label>
            <input id=id name=name type="text" autocomplete="off" value=value aria-describedby=format!("{name}-error")/>
            <FieldError result=result field=name/>
        </div>
    }
}

/// The first characters of a digest: enough to tell files apart at a glance.
fn short_sha(img: &Image) -> String {
    img.sha256
        .as_ref()
        .map(|s| s.as_str().get(..12).unwrap_or(s.as_str()).to_string())
        .unwrap_or_else(|| "-".into())
}

fn size(img: &Image) -> String {
    img.size.map(fmt::bytes).unwrap_or_else(|| "-".into())
}

/// The firmware the image asks for, or `default` (the VM's: UEFI with devices, BIOS
/// without).
fn bootrom(img: &Image) -> &'static str {
    img.requirements.bootrom.map_or("default", |b| b.as_str())
}

/// "public", or the owner's login for a private image.
fn audience(row: &ImageRow) -> String {
    if row.image.public {
        "public".into()
    } else {
        format!("private to {}", row.owner)
    }
}

#[component]
fn ImageTable(rows: Vec<ImageRow>) -> impl IntoView {
    view! {
        <table data-testid="images">
            <caption class="sr-only">"Images"</caption>
            <thead>
                <tr>
                    <th scope="col">"Name"</th>
                    <th scope="col">"Version"</th>
                    <th scope="col">"OS"</th>
                    <th scope="col">"Type"</th>
                    <th scope="col">"State"</th>
                    <th scope="col">"Size"</th>
                    <th scope="col">"SHA-256"</th>
                    <th scope="col">"Firmware"</th>
                    <th scope="col">"Who sees it"</th>
                    <th scope="col">"VMs"</th>
                    <th scope="col">"Published"</th>
                </tr>
            </thead>
            <tbody>
                {rows.into_iter().map(|r| {
                    let img = &r.image;
                    let uuid = img.uuid.to_string();
                    let sha = img.sha256.as_ref().map(|s| s.to_string());
                    view! {
                        <tr data-image=img.name.clone() data-version=img.version.clone()>
                            <th scope="row"><a href=format!("/admin/images/{uuid}")>{img.name.clone()}</a></th>
                            <td>{img.version.clone()}</td>
                            <td>{img.os.clone()}</td>
                            <td>{img.image_type.as_str()}</td>
                            <td data-testid="state"><Badge state=img.state.as_str()/></td>
                            <td data-testid="size">{size(img)}</td>
                            <td><code title=sha>{short_sha(img)}</code></td>
                            <td data-testid="bootrom">{bootrom(img)}</td>
                            <td>{audience(&r)}</td>
                            <td data-testid="vm-count">{img.vm_count.unwrap_or(0)}</td>
                            <td>{img.published_at.as_ref().map(fmt::time).unwrap_or_else(|| "-".into())}</td>
                        </tr>
                    }
                }).collect_view()}
            </tbody>
        </table>
    }
}

#[component]
pub fn ImagePage() -> impl IntoView {
    let params = use_params_map();
    let q = use_query_map();
    let delete = ServerAction::<DeleteImage>::new();
    let data = load(
        move || {
            (
                params.read().get("uuid").unwrap_or_default(),
                delete.version().get(),
            )
        },
        |(uuid, _)| get_image(uuid),
    );
    // Not polled: a reload would redraw the upload form and drop the file chosen in it.
    // The page reloads its data itself once an upload or a deletion is done.
    // The upload's state lives here, above the redrawn part, so it outlasts a reload.
    let sending = RwSignal::new(Sending::Idle);
    // Effects run only in the browser, after hydration: until then, no upload form.
    let scripts = RwSignal::new(false);
    Effect::new(move |_| scripts.set(true));
    let confirming = Signal::derive(move || q.read().get("confirm").as_deref() == Some("delete"));
    view! {
        <Title text="Image · Passage"/>
        <Guard audience=Audience::Staff>
            <Loaded data=data let:d>
                <ImageDetailView d=d data=data confirming=confirming delete=delete sending=sending scripts=scripts/>
            </Loaded>
            <FormStatus result=Signal::derive(move || delete.value().get())/>
        </Guard>
    }
}

#[component]
fn ImageDetailView(
    d: ImageDetail,
    data: Data<ImageDetail>,
    confirming: Signal<bool>,
    delete: ServerAction<DeleteImage>,
    sending: RwSignal<Sending>,
    scripts: RwSignal<bool>,
) -> impl IntoView {
    let img = d.row.image.clone();
    let uuid = img.uuid.to_string();
    let title = format!("{}@{}", img.name, img.version);
    let state = img.state;
    let tags = img
        .tags
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ");
    let vm_count = img.vm_count.unwrap_or(0);
    let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    // (term, test id, value), drawn by one loop.
    // (term, test id, value, a digest or id in monospace), drawn by one loop.
    let facts: [(&str, &str, String, bool); 12] = [
        ("UUID", "image-uuid", uuid.clone(), true),
        ("OS", "image-os", img.os.clone(), false),
        (
            "Type",
            "image-type",
            img.image_type.as_str().to_string(),
            false,
        ),
        (
            "Description",
            "image-description",
            or_dash(img.description.clone()),
            false,
        ),
        ("Who sees it", "image-audience", audience(&d.row), false),
        ("Size", "image-size", size(&img), false),
        (
            "SHA-256",
            "image-sha256",
            or_dash(img.sha256.as_ref().map(|s| s.to_string())),
            true,
        ),
        (
            "Tags",
            "image-tags",
            or_dash((!tags.is_empty()).then_some(tags)),
            false,
        ),
        (
            "Smallest disk",
            "image-min-disk",
            or_dash(img.requirements.min_disk_gib.map(|g| format!("{g} GiB"))),
            false,
        ),
        (
            "Firmware",
            "image-bootrom",
            bootrom(&img).to_string(),
            false,
        ),
        (
            "Created",
            "image-created",
            fmt::time(&img.created_at),
            false,
        ),
        (
            "Published",
            "image-published",
            fmt::opt_time(&img.published_at),
            false,
        ),
    ];
    // Kept after the upload made it active, to show how it ended.
    let upload = matches!(state, ImageState::Unactivated | ImageState::Failed)
        || sending.get_untracked() != Sending::Idle;
    view! {
        <h1>"Image " {title.clone()}</h1>
        <dl class="facts">
            <dt>"State"</dt><dd data-testid="image-state"><Badge state=state.as_str()/></dd>
            {facts.into_iter().map(|(term, id, value, mono)| view! {
                <dt>{term}</dt><dd data-testid=id class:mono=mono>{value}</dd>
            }).collect_view()}
        </dl>
        {upload.then(|| view! {
            <Upload file_url=d.file_url.clone() state=state data=data sending=sending scripts=scripts/>
        })}
        <h2>"VMs using it " <span class="muted" data-testid="image-vm-count">{format!("({vm_count})")}</span></h2>
        <VmList vms=d.vms.clone() count=vm_count/>
        <Delete uuid=uuid title=title state=state vm_count=vm_count confirming=confirming delete=delete/>
    }
}

#[component]
fn VmList(vms: Vec<passage_model::api::Vm>, count: u64) -> impl IntoView {
    let more = count.saturating_sub(vms.len() as u64);
    let none = vms.is_empty();
    view! {
        {none.then_some(view! { <p>"None."</p> })}
        <table data-testid="image-vms" hidden=none>
            <thead>
                <tr>
                    <th scope="col">"Alias"</th>
                    <th scope="col">"UUID"</th>
                    <th scope="col">"State"</th>
                    <th scope="col">"Owner"</th>
                    <th scope="col">"Created"</th>
                </tr>
            </thead>
            <tbody>
                {vms.into_iter().map(|v| {
                    let uuid = v.uuid.to_string();
                    let owner = v.owner_uuid.to_string();
                    view! {
                        <tr data-vm=uuid.clone()>
                            <th scope="row"><a href=format!("/instances/{uuid}")>{v.alias.clone()}</a></th>
                            <td><code>{uuid.clone()}</code></td>
                            <td><Badge state=v.state.as_str()/></td>
                            <td><a href=format!("/admin/vms?owner={owner}")><code>{fmt::short_uuid(&owner).to_string()}</code></a></td>
                            <td>{fmt::time(&v.created_at)}</td>
                        </tr>
                    }
                }).collect_view()}
            </tbody>
        </table>
        {(more > 0).then(|| view! { <p>{format!("and {more} more")}</p> })}
    }
}

/// Delete, after a confirmation on the page itself (a link, so it works without
/// scripts). With VMs built from it the image is disabled instead, and says so first.
#[component]
fn Delete(
    uuid: String,
    title: String,
    state: ImageState,
    vm_count: u64,
    confirming: Signal<bool>,
    delete: ServerAction<DeleteImage>,
) -> impl IntoView {
    let disabled = state == ImageState::Disabled;
    let what = if vm_count > 0 { "Disable" } else { "Delete" };
    let consequence = if vm_count > 0 {
        "VMs were built from it, so it stays, disabled: no new VM can use it. Its file goes once those VMs are destroyed."
    } else {
        "The record goes, and its file unless another image has the same bytes. This cannot be undone."
    };
    let ask = format!("/admin/images/{uuid}?confirm=delete");
    let keep = format!("/admin/images/{uuid}");
    let heading = format!("{what} {title}?");
    let yes = format!("Yes, {} {title}", what.to_lowercase());
    let id = uuid;
    let shown = move || {
        let (id, yes, keep, ask) = (id.clone(), yes.clone(), keep.clone(), ask.clone());
        let asking = confirming.get() && !disabled;
        view! {
            {(!asking && !disabled).then(|| view! {
                <p><a class="button danger" href=ask>{format!("{what} image")}</a></p>
            })}
            {asking.then(|| view! {
                <section class="card danger-zone" aria-labelledby="delete-h">
                    <h2 id="delete-h">{heading.clone()}</h2>
                    <p>{consequence}</p>
                    <ActionForm action=delete>
                        <CsrfField/>
                        <input type="hidden" name="uuid" value=id/>
                        <button type="submit" class="danger">{yes}</button>
                        " "
                        <a href=keep>"Keep it"</a>
                    </ActionForm>
                </section>
            })}
        }
    };
    view! {
        {disabled.then_some(view! {
            <p>"Disabled: no new VM can use it. The record stays while VMs built from it remain."</p>
        })}
        {shown}
    }
}

/// Where an upload from this page stands.
// Only the browser's half moves it on.
#[cfg_attr(not(feature = "hydrate"), allow(dead_code))]
#[derive(Clone, Debug, PartialEq)]
enum Sending {
    Idle,
    /// Bytes sent so far, of the total.
    Busy {
        sent: u64,
        total: u64,
    },
    Done {
        total: u64,
    },
    Failed(String),
}

/// The file upload. It streams the file from the browser straight to the REST API
/// (`PUT /v1/images/{uuid}/file`), so it needs scripts; without them the page shows the
/// same call as a `curl` command instead of a form that could not work.
#[component]
fn Upload(
    file_url: String,
    state: ImageState,
    data: Data<ImageDetail>,
    sending: RwSignal<Sending>,
    scripts: RwSignal<bool>,
) -> impl IntoView {
    let input = NodeRef::<leptos::html::Input>::new();
    let session = expect_context::<Session>();
    let url = StoredValue::new(file_url.clone());
    let start = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let csrf = session
            .get_untracked()
            .and_then(|r| r.ok())
            .flatten()
            .map(|m| m.csrf)
            .unwrap_or_default();
        #[cfg(feature = "hydrate")]
        {
            let Some(file) = input
                .get_untracked()
                .and_then(|i| i.files())
                .and_then(|f| f.get(0))
            else {
                sending.set(Sending::Failed("Choose a file first.".into()));
                return;
            };
            if let Err(e) = browser::send(&url.get_value(), &csrf, &file, sending, data) {
                sending.set(Sending::Failed(e));
            }
        }
        #[cfg(not(feature = "hydrate"))]
        let _ = (csrf, input, url, data);
    };
    // Said when the page opens on a failed image; after an upload here its own answer
    // says why instead.
    let failed = state == ImageState::Failed && sending.get_untracked() == Sending::Idle;
    let uploadable = matches!(state, ImageState::Unactivated | ImageState::Failed);
    let busy = move || matches!(sending.get(), Sending::Busy { .. });
    let curl = format!("curl -T FILE -H 'authorization: Bearer TOKEN' {file_url}");
    view! {
        <section class="card" aria-labelledby="upload-h">
            <h2 id="upload-h">"Upload its file"</h2>
            {failed.then(|| view! {
                <p class="error" role="alert">"The last file uploaded failed its checks. Upload another."</p>
            })}
            {move || (scripts.get() && uploadable).then(|| view! {
                <form class="upload" on:submit=start>
                    <div class="field">
                        <label for="u-file">"Image file"</label>
                        <input id="u-file" type="file" node_ref=input disabled=busy/>
                    </div>
                    <button type="submit" disabled=busy>"Upload"</button>
                </form>
            })}
            {move || {
                // One shape for every stage: (bar, words, how it ended).
                let (bar, words, end) = match sending.get() {
                    Sending::Idle => return None,
                    Sending::Busy { sent, total } => (
                        Some((sent, total)),
                        fmt::progress(sent, total),
                        if sent >= total { " · checking the file…" } else { "" },
                    ),
                    Sending::Done { total } => (
                        Some((total, total)),
                        fmt::progress(total, total),
                        " · uploaded and checked.",
                    ),
                    Sending::Failed(message) => (None, message, ""),
                };
                let failed = bar.is_none();
                Some(view! {
                    <div class=if failed { "error" } else { "upload-progress" } role=if failed { "alert" } else { "status" }
                        data-testid=if failed { "upload-error" } else { "upload-progress" }>
                        {bar.map(|(v, m)| view! { <progress max=m.to_string() value=v.to_string()></progress> " " })}
                        {failed.then_some(view! { <strong>"Upload failed."</strong> " " })}
                        <span data-testid="upload-text">{words}</span>
                        {end}
                    </div>
                })
            }}
            <details open=move || !scripts.get() hidden=!uploadable>
                <summary>"Upload from a shell"</summary>
                <p>
                    "Without scripts this page cannot stream a file. Send it with an API token "
                    "(from " <code>"POST /v1/auth/login"</code> " or " <code>"/v1/tokens"</code> "). "
                    "Add " <code>"-H 'x-content-sha256: DIGEST'"</code> " to have it refused unless its SHA-256 matches."
                </p>
                <pre class="wrap" data-testid="upload-curl"><code>{curl}</code></pre>
            </details>
        </section>
    }
}

/// The browser's half of the upload: `XMLHttpRequest`, for its upload progress events.
#[cfg(feature = "hydrate")]
mod browser {
    use super::Sending;
    use crate::data::Data;
    use crate::rpc::ImageDetail;
    use leptos::prelude::*;
    use wasm_bindgen::JsCast;
    use wasm_bindgen::closure::Closure;

    fn js(e: wasm_bindgen::JsValue) -> String {
        e.as_string()
            .unwrap_or_else(|| "the browser refused the upload".into())
    }

    /// Sends `file` as the raw body, authenticated by the session cookie and the CSRF
    /// token (the REST API takes the two together), and refreshes the page once done.
    pub fn send(
        url: &str,
        csrf: &str,
        file: &web_sys::File,
        sending: RwSignal<Sending>,
        data: Data<ImageDetail>,
    ) -> Result<(), String> {
        let xhr = web_sys::XmlHttpRequest::new().map_err(js)?;
        xhr.open_with_async("PUT", url, true).map_err(js)?;
        xhr.set_request_header("content-type", "application/octet-stream")
            .map_err(js)?;
        xhr.set_request_header("accept", "application/json")
            .map_err(js)?;
        xhr.set_request_header("x-csrf-token", csrf).map_err(js)?;
        // Whole bytes: a file's size is one, and the page never formats floats.
        let total = file.size() as u64;
        sending.set(Sending::Busy { sent: 0, total });
        // Registered before `send`: a browser only reports upload progress to listeners
        // present when the request starts.
        let progress =
            Closure::<dyn FnMut(web_sys::ProgressEvent)>::new(move |e: web_sys::ProgressEvent| {
                let total = if e.length_computable() {
                    e.total() as u64
                } else {
                    total
                };
                sending.set(Sending::Busy {
                    sent: (e.loaded() as u64).min(total),
                    total,
                });
            });
        xhr.upload()
            .map_err(js)?
            .set_onprogress(Some(progress.as_ref().unchecked_ref()));
        let answer = xhr.clone();
        let end = Closure::<dyn FnMut()>::new(move || {
            let status = answer.status().unwrap_or(0);
            let body = answer.response_text().ok().flatten().unwrap_or_default();
            sending.set(match status {
                200 => Sending::Done { total },
                0 => Sending::Failed("The connection broke off before the server answered.".into()),
                _ => Sending::Failed(
                    serde_json::from_slice::<passage_model::ApiErrorBody>(body.as_bytes())
                        .map(|b| b.message)
                        .unwrap_or_else(|_| format!("The server answered {status}.")),
                ),
            });
            // The image's state, size and digest as the server now has them.
            data.refetch();
        });
        xhr.set_onloadend(Some(end.as_ref().unchecked_ref()));
        xhr.send_with_opt_blob(Some(file)).map_err(js)?;
        // The request holds the handlers until it ends; one pair per upload is kept.
        progress.forget();
        end.forget();
        Ok(())
    }
}
