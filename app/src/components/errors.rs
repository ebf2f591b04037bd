//! How the portal shows what failed: a load, a form, one field of a form. Every page goes
//! through these, so an error reads (and answers with a status) the same everywhere.

use crate::data::Data;
use crate::error::PortalError;
use leptos::prelude::*;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::sync::Arc;

/// A failed load or action, said plainly. Not found answers the page with 404, not
/// allowed with 403.
#[component]
pub fn ErrorBox(error: PortalError) -> impl IntoView {
    #[cfg(feature = "ssr")]
    if let Some(status) = error.code.page_status() {
        crate::backend::set_status(status);
    }
    let sign_in = error.code.needs_sign_in();
    view! {
        <div class="error" role="alert">
            <strong>{error.code.title()}</strong>
            " "
            <span>{error.message}</span>
            {sign_in.then(|| view! { " " <a href="/login">"Sign in"</a> })}
        </div>
    }
}

/// What `data` loaded, drawn by `children`, or the error instead. Shows "Loading…" until
/// the first answer (nothing with `quiet`) and keeps the last answer on screen while a
/// newer one loads.
#[component]
pub fn Loaded<T, F, V>(data: Data<T>, children: F, #[prop(optional)] quiet: bool) -> impl IntoView
where
    T: Clone + Send + Sync + Serialize + DeserializeOwned + 'static,
    F: Fn(T) -> V + Send + Sync + 'static,
    V: IntoView + 'static,
{
    let children = Arc::new(children);
    view! {
        <Transition fallback=move || (!quiet).then(|| view! { <p class="loading">"Loading…"</p> })>
            {move || {
                let children = Arc::clone(&children);
                Suspend::new(async move {
                    match data.await {
                        Ok(value) => children(value).into_any(),
                        Err(e) => view! { <ErrorBox error=e/> }.into_any(),
                    }
                })
            }}
        </Transition>
    }
}

/// The outcome of a form's last submission: its error, unless that belongs next to a
/// field (see [`FieldError`]), or `ok` once it worked.
#[component]
pub fn FormStatus(
    #[prop(into)] result: Signal<Option<Result<(), PortalError>>>,
    /// Said once the form worked; nothing when empty.
    #[prop(optional, into)]
    ok: String,
    /// Field errors too, for a form with no place next to its fields.
    #[prop(optional)]
    with_fields: bool,
) -> impl IntoView {
    move || match result.get() {
        Some(Ok(())) if !ok.is_empty() => {
            Some(view! { <p class="ok" role="status">{ok.clone()}</p> }.into_any())
        }
        Some(Err(e)) if with_fields || e.field.is_none() => {
            Some(view! { <ErrorBox error=e/> }.into_any())
        }
        _ => None,
    }
}

/// The message for one field, next to it, tied to it by `aria-describedby`
/// (`{field}-error`).
#[component]
pub fn FieldError(
    #[prop(into)] result: Signal<Option<Result<(), PortalError>>>,
    #[prop(into)] field: String,
) -> impl IntoView {
    let id = format!("{field}-error");
    let msg = move || match result.get() {
        Some(Err(e)) => e.for_field(&field),
        _ => None,
    };
    view! {
        <span class="field-error" id=id role="alert">
            {msg}
        </span>
    }
}
