use crate::app::Session;
use crate::components::errors::{FieldError, FormStatus};
use crate::rpc::Login;
use leptos::prelude::*;
use leptos_meta::Title;
use leptos_router::components::Redirect;
use leptos_router::hooks::use_query_map;

#[component]
pub fn LoginPage() -> impl IntoView {
    let session = expect_context::<Session>();
    let action = ServerAction::<Login>::new();
    let q = use_query_map();
    let next = move || q.read().get("next").unwrap_or_default();
    let ended = move || q.read().get("ended").is_some();
    let result = Signal::derive(move || action.value().get().map(|r| r.map(|_| ())));
    // After a successful sign-in the session changes.
    Effect::new(move |_| {
        if let Some(Ok(())) = action.value().get() {
            session.refetch();
        }
    });
    let signed_in = move || {
        session
            .get()
            .and_then(|r| r.ok())
            .flatten()
            .map(|_| view! { <Redirect path=crate::rpc::safe_next(Some(&next()))/> })
    };
    view! {
        <Title text="Sign in · Passage"/>
        <Transition fallback=|| ()>{signed_in}</Transition>
        <section class="card narrow" aria-labelledby="login-title">
            <h1 id="login-title">"Sign in to Passage"</h1>
            {move || (ended() && action.value().get().is_none()).then(|| view! {
                <p class="notice" role="status" data-testid="session-ended">
                    "Your session has ended. Sign in again."
                </p>
            })}
            <ActionForm action=action>
                <input type="hidden" name="next" value=next/>
                <label for="login">"Login"</label>
                <input id="login" name="login" type="text" autocomplete="username" required
                    aria-describedby="login-error"/>
                <FieldError result=result field="login"/>
                <label for="password">"Password"</label>
                <input id="password" name="password" type="password"
                    autocomplete="current-password" required aria-describedby="password-error"/>
                <FieldError result=result field="password"/>
                <FormStatus result=result ok=""/>
                <button type="submit" disabled=move || action.pending().get()>"Sign in"</button>
            </ActionForm>
        </section>
    }
}
