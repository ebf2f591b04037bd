//! The frame around every page: header, navigation for the person's role, sign-out.

use crate::app::Session;
use crate::components::widgets::CsrfField;
use crate::rpc::{Logout, Me};
use leptos::prelude::*;
use leptos_router::hooks::use_location;

/// The operators' and readers' pages, in menu order.
const STAFF_LINKS: &[(&str, &str)] = &[
    ("/admin", "Overview"),
    ("/admin/servers", "Servers"),
    ("/admin/devices", "Devices"),
    ("/admin/variants", "Variants"),
    ("/admin/packages", "Packages"),
    ("/admin/images", "Images"),
    ("/admin/networks", "Networks"),
    ("/admin/accounts", "Accounts"),
    ("/admin/vms", "VMs"),
    ("/admin/jobs", "Jobs"),
];

const TENANT_LINKS: &[(&str, &str)] = &[
    ("/instances", "My instances"),
    ("/instances/new", "Create instance"),
    ("/keys", "SSH keys"),
];

/// How a menu link relates to the page shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Current {
    /// It is this page.
    Page,
    /// This page lies below it (a server's page below Servers).
    Section,
}

/// The one link of `hrefs` to mark for `path`: the page itself, else the deepest link
/// the path lies below. A link is never current for its neighbours: `/admin` is not
/// current on `/admin/servers`, since `/admin/servers` is a link of its own.
fn current_link(hrefs: &[&str], path: &str) -> Option<(usize, Current)> {
    let path = match path.trim_end_matches('/') {
        "" => "/",
        p => p,
    };
    if let Some(i) = hrefs.iter().position(|h| *h == path) {
        return Some((i, Current::Page));
    }
    hrefs
        .iter()
        .enumerate()
        .filter(|(_, h)| {
            path.strip_prefix(**h)
                .is_some_and(|rest| rest.starts_with('/'))
        })
        .max_by_key(|(_, h)| h.len())
        .map(|(i, _)| (i, Current::Section))
}

#[component]
pub fn Layout(children: Children) -> impl IntoView {
    let session = expect_context::<Session>();
    let logout = ServerAction::<Logout>::new();
    let pathname = use_location().pathname;
    let nav = move || {
        session.get().and_then(|r| r.ok()).flatten().map(|me: Me| {
            let links = if me.is_staff() {
                STAFF_LINKS
            } else {
                TENANT_LINKS
            };
            let hrefs: Vec<&'static str> = links.iter().map(|(h, _)| *h).collect();
            let current = Memo::new(move |_| pathname.with(|p| current_link(&hrefs, p)));
            view! {
                <nav aria-label="Main">
                    <ul>
                        {links.iter().enumerate().map(|(i, (href, label))| {
                            let aria_current = move || match current.get() {
                                Some((c, Current::Page)) if c == i => Some("page"),
                                Some((c, Current::Section)) if c == i => Some("true"),
                                _ => None,
                            };
                            view! { <li><a href=*href aria-current=aria_current>{*label}</a></li> }
                        }).collect_view()}
                    </ul>
                </nav>
                <div class="who">
                    <span>{me.login.clone()} " (" {me.role.as_str()} ")"</span>
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

#[cfg(test)]
mod tests {
    use super::{Current, STAFF_LINKS, TENANT_LINKS, current_link};

    fn hrefs(links: &[(&'static str, &str)]) -> Vec<&'static str> {
        links.iter().map(|(h, _)| *h).collect()
    }

    #[test]
    fn only_the_page_itself_is_current() {
        let staff = hrefs(STAFF_LINKS);
        assert_eq!(current_link(&staff, "/admin"), Some((0, Current::Page)));
        assert_eq!(current_link(&staff, "/admin/"), Some((0, Current::Page)));
        for (i, href) in staff.iter().enumerate() {
            assert_eq!(
                current_link(&staff, href),
                Some((i, Current::Page)),
                "{href}"
            );
        }
        let tenant = hrefs(TENANT_LINKS);
        assert_eq!(
            current_link(&tenant, "/instances/new"),
            Some((1, Current::Page))
        );
    }

    #[test]
    fn a_page_below_a_link_marks_that_section_only() {
        let staff = hrefs(STAFF_LINKS);
        assert_eq!(
            current_link(&staff, "/admin/servers/0a1b"),
            Some((1, Current::Section))
        );
        let tenant = hrefs(TENANT_LINKS);
        assert_eq!(
            current_link(&tenant, "/instances/0a1b"),
            Some((0, Current::Section))
        );
        assert_eq!(current_link(&staff, "/adminx"), None);
        assert_eq!(current_link(&staff, "/login"), None);
    }
}
