//! Pages for signed-in people only, some for operators only.

use crate::app::Session;
use crate::components::errors::ErrorBox;
use crate::error::Code;
use leptos::prelude::*;
use leptos_router::components::Redirect;
use leptos_router::hooks::use_location;

/// Who may see a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Audience {
    Anyone,
    Staff,
    Tenant,
}

/// Renders `children` when the session may see the page; sends a signed-out person to
/// the login page (and back afterwards) and answers anyone else with a 403 page.
#[component]
pub fn Guard(audience: Audience, children: ChildrenFn) -> impl IntoView {
    let session = expect_context::<Session>();
    let location = use_location();
    let children = StoredValue::new(children);
    view! {
        <Suspense fallback=|| view! { <p class="loading">"Loading…"</p> }>
            {move || {
                let location = location.clone();
                Suspend::new(async move {
                match session.await {
                    Ok(Some(me)) => {
                        let ok = match audience {
                            Audience::Anyone => true,
                            Audience::Staff => me.is_staff(),
                            Audience::Tenant => !me.is_staff(),
                        };
                        if ok {
                            children.with_value(|c| c()).into_any()
                        } else {
                            view! { <Forbidden/> }.into_any()
                        }
                    }
                    Ok(None) => to_login(&location, false),
                    Err(e) if e.code == Code::SessionEnded => to_login(&location, true),
                    Err(e) => view! { <ErrorBox error=e/> }.into_any(),
                }
            })}}
        </Suspense>
    }
}

/// To the login page, and back here afterwards; `ended` makes it say the session ended.
fn to_login(location: &leptos_router::location::Location, ended: bool) -> AnyView {
    let here = format!(
        "{}{}",
        location.pathname.get_untracked(),
        location.search.get_untracked()
    );
    let to = format!(
        "/login{}",
        crate::fmt::query(&[("next", Some(&here)), ("ended", ended.then_some("1"))])
    );
    view! { <Redirect path=to/> }.into_any()
}

#[component]
pub fn Forbidden() -> impl IntoView {
    #[cfg(feature = "ssr")]
    crate::backend::set_status(403);
    view! {
        <section class="problem" aria-labelledby="forbidden-title">
            <h1 id="forbidden-title">"Not allowed"</h1>
            <p>"Your account may not open this page."</p>
            <p><a href="/">"Go to your start page"</a></p>
        </section>
    }
}
