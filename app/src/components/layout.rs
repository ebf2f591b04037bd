//! The frame around every page: header, navigation for the person's role, sign-out.

use crate::app::Session;
use crate::components::widgets::CsrfField;
use crate::rpc::{Logout, Me};
use leptos::prelude::*;
use leptos_router::components::A;

#[component]
pub fn Layout(children: Children) -> impl IntoView {
    let session = expect_context::<Session>();
    let logout = ServerAction::<Logout>::new();
    let nav = move || {
        session.get().and_then(|r| r.ok()).flatten().map(|me: Me| {
            let staff = me.is_staff();
            view! {
                <nav aria-label="Main">
                    <ul>
                        {staff.then(|| view! {
                            <li><A href="/admin">"Overview"</A></li>
                            <li><A href="/admin/servers">"Servers"</A></li>
                            <li><A href="/admin/devices">"Devices"</A></li>
                            <li><A href="/admin/variants">"Variants"</A></li>
                            <li><A href="/admin/packages">"Packages"</A></li>
                            <li><A href="/admin/accounts">"Accounts"</A></li>
                            <li><A href="/admin/vms">"VMs"</A></li>
                            <li><A href="/admin/jobs">"Jobs"</A></li>
                        })}
                        {(!staff).then(|| view! {
                            <li><A href="/instances">"My instances"</A></li>
                            <li><A href="/instances/new">"Create instance"</A></li>
                        })}
                    </ul>
                </nav>
                <div class="who">
                    <span>{me.login.clone()} " (" {me.role.clone()} ")"</span>
                    <ActionForm action=logout>
                        <CsrfField/>
                        <button type="submit">"Sign out"</button>
                    </ActionForm>
                </div>
            }
        })
    };
    view! {
        <a class="skip" href="#main">"Skip to content"</a>
        <header class="top">
            <a class="brand" href="/">"Passage"</a>
            <Transition fallback=|| ()>{nav}</Transition>
        </header>
        <main id="main">{children()}</main>
    }
}
