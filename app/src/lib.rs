//! The portal: one Leptos app, server-rendered and hydrated. Operators get the admin
//! pages, tenants their instances; the session's role decides what a page shows.
//!
//! Under `ssr` the server functions call the control plane's REST API in-process through
//! a [`backend::Backend`] taken from context, so the portal has exactly the API's rules
//! (roles, validation, another tenant's object reads as not found) and never its own SQL.

#![recursion_limit = "512"]

pub mod app;
#[cfg(feature = "ssr")]
pub mod backend;
pub mod components;
pub mod data;
pub mod error;
pub mod fmt;
pub mod pages;
pub mod rpc;

pub use app::App;
#[cfg(feature = "ssr")]
pub use app::shell;

/// The wasm entry point: attaches the app to the server-rendered page.
#[cfg(feature = "hydrate")]
#[wasm_bindgen::prelude::wasm_bindgen]
pub fn hydrate() {
    console_error_panic_hook::set_once();
    leptos::mount::hydrate_body(App);
    // Lets tests (and curious people) tell a hydrated page from a server-rendered one.
    if let Some(body) = leptos::prelude::document().body() {
        let _ = body.set_attribute("data-hydrated", "true");
    }
}
