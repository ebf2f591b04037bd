//! Small shared views: state badges, VM links, the CSRF field.

use crate::app::Session;
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
