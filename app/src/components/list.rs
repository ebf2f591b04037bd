//! The shape every list page shares: filters in the URL's query, one page of rows, and a
//! cursor to the next page. Plain links and GET forms, so it all works without scripts.

use crate::components::errors::Loaded;
use crate::data::Data;
use crate::rpc::Page;
use leptos::prelude::*;
use leptos_router::hooks::use_query_map;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// One filter of a list page: a choice among fixed values, or free text.
#[derive(Clone, Copy, Debug)]
pub struct Filter {
    /// The query parameter, also the field's name.
    pub name: &'static str,
    pub label: &'static str,
    /// `Some`: a `<select>` of these values (and "any"); `None`: a text field.
    pub choices: Option<&'static [&'static str]>,
}

impl Filter {
    pub const fn choice(
        name: &'static str,
        label: &'static str,
        choices: &'static [&'static str],
    ) -> Self {
        Filter {
            name,
            label,
            choices: Some(choices),
        }
    }
    pub const fn text(name: &'static str, label: &'static str) -> Self {
        Filter {
            name,
            label,
            choices: None,
        }
    }
}

/// Reads the page URL's query: a parameter's value, `None` when absent or empty.
pub fn use_query_param() -> impl Fn(&str) -> Option<String> + Copy + Send + Sync + 'static {
    let q = use_query_map();
    move |k: &str| q.read().get(k).filter(|v| !v.is_empty())
}

/// A list page's body: its filters, one page of `data` drawn by `children` (or `empty`
/// when there are no rows), and the pager. The page's resource reads the same query
/// parameters as `filters` name, and the cursor.
#[component]
pub fn ListPage<T, F, V>(
    /// The page's own path: the filters submit to it and the pager links back to it.
    path: &'static str,
    data: Data<Page<T>>,
    /// The rows of one page.
    children: F,
    #[prop(optional)] filters: &'static [Filter],
    /// The filter button's words, e.g. "Filter devices".
    #[prop(optional)]
    filter_label: &'static str,
    /// The query parameter that carries the cursor.
    #[prop(default = "after")]
    cursor: &'static str,
    /// Said instead of an empty list, where the list's own empty shape says too little.
    #[prop(optional)]
    empty: Option<&'static str>,
) -> impl IntoView
where
    T: Clone + Send + Sync + Serialize + DeserializeOwned + 'static,
    F: Fn(Vec<T>) -> V + Send + Sync + 'static,
    V: IntoView + 'static,
{
    let get = use_query_param();
    // The pager keeps the filters and changes only the cursor.
    let base = move || {
        let values: Vec<(&str, Option<String>)> =
            filters.iter().map(|f| (f.name, get(f.name))).collect();
        let pairs: Vec<(&str, Option<&str>)> =
            values.iter().map(|(k, v)| (*k, v.as_deref())).collect();
        format!("{path}{}", crate::fmt::query(&pairs))
    };
    let form = (!filters.is_empty()).then(|| {
        view! {
            <form method="get" action=path class="filters" role="search">
                {filters.iter().map(|f| view! { <FilterField filter=*f/> }).collect_view()}
                <button type="submit">{filter_label}</button>
            </form>
        }
    });
    view! {
        {form}
        <Loaded data=data let:page>
            {
                let shown = page.items.len();
                let rows = match empty {
                    Some(words) if page.items.is_empty() => view! { <p>{words}</p> }.into_any(),
                    _ => children(page.items).into_any(),
                };
                view! {
                    {rows}
                    <Pager total=page.total shown=shown next=page.next base=base() cursor_param=cursor/>
                }
            }
        </Loaded>
    }
}

#[component]
fn FilterField(filter: Filter) -> impl IntoView {
    let get = use_query_param();
    let name = filter.name;
    let id = format!("f-{name}");
    let field = match filter.choices {
        Some(choices) => view! {
            <select id=id.clone() name=name>
                <option value="">"any"</option>
                {choices.iter().map(|c| view! {
                    <option value=*c selected=move || get(name).as_deref() == Some(*c)>{*c}</option>
                }).collect_view()}
            </select>
        }
        .into_any(),
        None => view! {
            <input id=id.clone() name=name type="text" value=move || get(name).unwrap_or_default()/>
        }
        .into_any(),
    };
    view! {
        <label for=id>{filter.label}</label>
        {field}
    }
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
