//! Small shared views: errors, state badges, the pager, the CSRF field, live polling.

use crate::app::Session;
use crate::error::PortalError;
use leptos::prelude::*;

/// The hidden field every state-changing form carries.
#[component]
pub fn CsrfField() -> impl IntoView {
    let session = expect_context::<Session>();
    let value = move || {
        session
            .get()
            .and_then(|r| r.ok())
            .flatten()
            .map(|m| m.csrf)
            .unwrap_or_default()
    };
    view! { <input type="hidden" name="csrf" value=value/> }
}

/// A failed load or action, said plainly. Not-found answers the page with 404.
#[component]
pub fn ErrorBox(error: PortalError) -> impl IntoView {
    #[cfg(feature = "ssr")]
    {
        if error.is_not_found() {
            crate::backend::set_status(404);
        } else if error.is_forbidden() {
            crate::backend::set_status(403);
        }
    }
    let title = if error.is_not_found() {
        "Not found"
    } else if error.is_forbidden() {
        "Not allowed"
    } else if error.is_unauthorized() {
        "Signed out"
    } else {
        "Something went wrong"
    };
    let unauthorized = error.is_unauthorized();
    view! {
        <div class="error" role="alert">
            <strong>{title}</strong>
            " "
            <span>{error.message.clone()}</span>
            {unauthorized.then(|| view! { " " <a href="/login">"Sign in"</a> })}
        </div>
    }
}

/// The outcome of the last submission of a form: an error, or `ok` when it worked.
#[component]
pub fn FormStatus(
    #[prop(into)] result: Signal<Option<Result<(), PortalError>>>,
    #[prop(into)] ok: String,
) -> impl IntoView {
    move || match result.get() {
        Some(Ok(())) => Some(view! { <p class="ok" role="status">{ok.clone()}</p> }.into_any()),
        Some(Err(e)) if e.field.is_none() => Some(view! { <ErrorBox error=e/> }.into_any()),
        _ => None,
    }
}

/// The message for one field, next to it, tied to it by `aria-describedby`.
#[component]
pub fn FieldError(
    #[prop(into)] result: Signal<Option<Result<(), PortalError>>>,
    field: &'static str,
) -> impl IntoView {
    let msg = move || match result.get() {
        Some(Err(e)) => e.for_field(field),
        _ => None,
    };
    view! {
        <span class="field-error" id=format!("{field}-error") role="alert">
            {msg}
        </span>
    }
}

/// A VM by the start of its uuid, linking to its page.
#[component]
pub fn VmLink(uuid: passage_model::VmId) -> impl IntoView {
    let v = uuid.to_string();
    let short = crate::fmt::short_uuid(&v).to_string();
    view! { <a href=format!("/instances/{v}")>{short}</a> }
}

/// A state, as a word and a colour (never the colour alone).
#[component]
pub fn Badge(#[prop(into)] state: String) -> impl IntoView {
    let class = format!(
        "badge s-{}",
        state.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
    );
    view! { <span class=class>{state}</span> }
}

/// "Next page" for keyset pagination: keeps the page's filters and adds the cursor.
#[component]
pub fn Pager(
    total: u64,
    shown: usize,
    next: Option<String>,
    /// The page's own query (filters) without the cursor.
    #[prop(into)]
    base: String,
    #[prop(default = "after")] cursor_param: &'static str,
) -> impl IntoView {
    let href = next.map(|n| {
        let sep = if base.contains('?') { '&' } else { '?' };
        format!("{base}{sep}{cursor_param}={}", crate::fmt::urlencode(&n))
    });
    view! {
        <nav class="pager" aria-label="Pages">
            <span>{format!("Showing {shown} of {total}")}</span>
            {href.map(|h| view! { <a href=h rel="next">"Next page →"</a> })}
        </nav>
    }
}

/// Reloads `resource` every `ms` milliseconds while the page is open in a browser with
/// JavaScript; the server render is not affected.
pub fn poll<T>(resource: Resource<T>, ms: u64)
where
    T: Send + Sync + Clone + serde::Serialize + serde::de::DeserializeOwned + 'static,
{
    #[cfg(feature = "hydrate")]
    {
        Effect::new(move |_| {
            if let Ok(h) = set_interval_with_handle(
                move || resource.refetch(),
                std::time::Duration::from_millis(ms),
            ) {
                on_cleanup(move || h.clear());
            }
        });
    }
    #[cfg(not(feature = "hydrate"))]
    {
        let _ = (resource, ms);
    }
}
