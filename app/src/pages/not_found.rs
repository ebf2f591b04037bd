use leptos::prelude::*;

#[component]
pub fn NotFound() -> impl IntoView {
    #[cfg(feature = "ssr")]
    crate::backend::set_status(404);
    view! {
        <section class="problem" aria-labelledby="nf-title">
            <h1 id="nf-title">"Not found"</h1>
            <p>"There is no such page, or it is not yours to see."</p>
            <p><a href="/">"Go to your start page"</a></p>
        </section>
    }
}
