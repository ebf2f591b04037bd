use crate::app::Session;
use crate::components::errors::ErrorBox;
use crate::error::Code;
use leptos::prelude::*;
use leptos_router::components::Redirect;

/// `/`: operators land on the overview, tenants on their instances.
#[component]
pub fn Home() -> impl IntoView {
    let session = expect_context::<Session>();
    view! {
        <Suspense fallback=|| ()>
            {move || Suspend::new(async move {
                match session.await {
                    Ok(Some(me)) if me.is_staff() => view! { <Redirect path="/admin"/> }.into_any(),
                    Ok(Some(_)) => view! { <Redirect path="/instances"/> }.into_any(),
                    Ok(None) => view! { <Redirect path="/login"/> }.into_any(),
                    Err(e) if e.code == Code::SessionEnded => {
                        view! { <Redirect path="/login?ended=1"/> }.into_any()
                    }
                    Err(e) => view! { <ErrorBox error=e/> }.into_any(),
                }
            })}
        </Suspense>
    }
}
