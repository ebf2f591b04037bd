//! The app's frame: the HTML shell, the routes and the session every page reads.

use crate::components::layout::Layout;
use crate::pages::{admin, login::LoginPage, not_found::NotFound, tenant};
use leptos::prelude::*;
use leptos_meta::{Title, provide_meta_context};
use leptos_router::components::{Route, Router, Routes};
use leptos_router::{SsrMode, path};

/// The whole document, rendered on the server. The CSP allows this response's inline
/// hydration scripts by their nonce and nothing else inline; styles made with the nonce
/// too (the terminal's, see `pages::tenant::terminal`).
#[cfg(feature = "ssr")]
pub fn shell(options: LeptosOptions) -> impl IntoView {
    use leptos::nonce::use_nonce;
    if let (Some(n), Some(res)) = (use_nonce(), use_context::<leptos_axum::ResponseOptions>()) {
        let csp = format!(
            "default-src 'self'; script-src 'self' 'nonce-{n}' 'wasm-unsafe-eval'; \
             style-src 'self' 'nonce-{n}'; img-src 'self' data:; connect-src 'self'; \
             frame-ancestors 'none'; base-uri 'self'; form-action 'self'; object-src 'none'"
        );
        if let Ok(v) = http::HeaderValue::from_str(&csp) {
            res.insert_header(http::header::CONTENT_SECURITY_POLICY, v);
        }
    }
    // Beside the scripts, in the bundle's folder named by the hash of its files.
    let stylesheet = format!("/{}/passage.css", options.site_pkg_dir);
    view! {
        <!DOCTYPE html>
        <html lang="en">
            <head>
                <meta charset="utf-8"/>
                <meta name="viewport" content="width=device-width, initial-scale=1"/>
                <link rel="stylesheet" href=stylesheet/>
                <link rel="icon" href="/favicon.ico"/>
                <HydrationScripts options/>
                <leptos_meta::MetaTags/>
            </head>
            <body>
                <App/>
            </body>
        </html>
    }
}

/// The session, loaded once per page and shared by the layout and the pages.
pub type Session = crate::data::Data<Option<crate::rpc::Me>>;

#[component]
pub fn App() -> impl IntoView {
    provide_meta_context();
    let session: Session = crate::data::load(|| (), |_| crate::rpc::whoami());
    provide_context(session);
    // Every route renders whole before it is sent, so pages work without JavaScript.
    let ssr = SsrMode::Async;
    view! {
        <Title text="Passage"/>
        <Router>
            <Layout>
                <Routes fallback=NotFound>
                    <Route path=path!("/login") view=LoginPage ssr=ssr.clone()/>
                    <Route path=path!("/") view=crate::pages::home::Home ssr=ssr.clone()/>
                    <Route path=path!("/admin") view=admin::overview::OverviewPage ssr=ssr.clone()/>
                    <Route path=path!("/admin/servers") view=admin::servers::ServersPage ssr=ssr.clone()/>
                    <Route path=path!("/admin/servers/:uuid") view=admin::servers::ServerPage ssr=ssr.clone()/>
                    <Route path=path!("/admin/devices") view=admin::devices::DevicesPage ssr=ssr.clone()/>
                    <Route path=path!("/admin/variants") view=admin::variants::VariantsPage ssr=ssr.clone()/>
                    <Route path=path!("/admin/packages") view=admin::packages::PackagesPage ssr=ssr.clone()/>
                    <Route path=path!("/admin/images") view=admin::images::ImagesPage ssr=ssr.clone()/>
                    <Route path=path!("/admin/images/:uuid") view=admin::images::ImagePage ssr=ssr.clone()/>
                    <Route path=path!("/admin/networks") view=admin::networks::NetworksPage ssr=ssr.clone()/>
                    <Route path=path!("/admin/networks/:uuid") view=admin::networks::NetworkPage ssr=ssr.clone()/>
                    <Route path=path!("/admin/networks/:uuid/edit") view=admin::networks::NetworkEditPage ssr=ssr.clone()/>
                    <Route path=path!("/admin/accounts") view=admin::accounts::AccountsPage ssr=ssr.clone()/>
                    <Route path=path!("/admin/vms") view=admin::vms::VmsPage ssr=ssr.clone()/>
                    <Route path=path!("/admin/jobs") view=admin::jobs::JobsPage ssr=ssr.clone()/>
                    <Route path=path!("/instances") view=tenant::instances::InstancesPage ssr=ssr.clone()/>
                    <Route path=path!("/instances/new") view=tenant::create::CreatePage ssr=ssr.clone()/>
                    <Route path=path!("/keys") view=tenant::keys::KeysPage ssr=ssr.clone()/>
                    <Route path=path!("/instances/:uuid") view=tenant::detail::InstancePage ssr=ssr/>
                </Routes>
            </Layout>
        </Router>
    }
}
