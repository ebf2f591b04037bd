use crate::components::guard::{Audience, Guard};
use crate::components::widgets::{Badge, ErrorBox, Pager, VmLink, poll};
use crate::fmt;
use crate::rpc::list_jobs;
use leptos::prelude::*;
use leptos_meta::Title;
use leptos_router::hooks::use_query_map;
use passage_model::api::Job;

#[component]
pub fn JobsPage() -> impl IntoView {
    let q = use_query_map();
    let get = move |k: &str| q.read().get(k).filter(|v| !v.is_empty());
    let data = Resource::new(
        move || (get("state"), get("after")),
        |(state, after)| list_jobs(state, after),
    );
    poll(data, 2000);
    view! {
        <Title text="Jobs · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"Jobs"</h1>
            <form method="get" action="/admin/jobs" class="filters" role="search">
                <label for="f-state">"State"</label>
                <select id="f-state" name="state">
                    <option value="">"any"</option>
                    {["queued", "running", "succeeded", "failed"].into_iter().map(|s| view! {
                        <option value=s selected=move || get("state").as_deref() == Some(s)>{s}</option>
                    }).collect_view()}
                </select>
                <button type="submit">"Filter jobs"</button>
            </form>
            <Transition fallback=|| view! { <p class="loading">"Loading…"</p> }>
                {move || Suspend::new(async move {
                    match data.await {
                        Err(e) => view! { <ErrorBox error=e/> }.into_any(),
                        Ok(p) => {
                            let shown = p.items.len();
                            let base = match get("state") {
                                Some(s) => format!("/admin/jobs?state={s}"),
                                None => "/admin/jobs".to_string(),
                            };
                            view! {
                                <div class="jobs">
                                    {p.items.into_iter().map(|j| view! { <JobCard job=j/> }).collect_view()}
                                </div>
                                <Pager total=p.total shown=shown next=p.next base=base/>
                            }.into_any()
                        }
                    }
                })}
            </Transition>
        </Guard>
    }
}

/// A job and each of its steps with state and time.
#[component]
pub fn JobCard(job: Job) -> impl IntoView {
    let uuid = job.uuid.to_string();
    view! {
        <article class="job card" data-job=uuid>
            <h3>
                {job.name.clone()} " " <Badge state=job.state.as_str()/>
                {job.vm_uuid.map(|v| view! { " · VM " <VmLink uuid=v/> })}
            </h3>
            <p class="muted">"Started " {fmt::time(&job.created_at)} {job.ended_at.map(|e| format!(", ended {}", fmt::time(&e)))}</p>
            {job.error.clone().map(|e| view! { <p class="error">{e}</p> })}
            <JobSteps job=job/>
        </article>
    }
}

#[component]
pub fn JobSteps(job: Job) -> impl IntoView {
    view! {
        <ol class="steps" data-testid="job-steps">
            {job.steps.into_iter().map(|s| view! {
                <li data-step=s.name.clone() data-state=s.state.as_str()>
                    <span class="step-name">{s.name.clone()}</span>
                    " " <Badge state=s.state.as_str()/>
                    " " <span class="muted">{fmt::duration(&s.started_at, &s.ended_at)}</span>
                    {s.error.clone().map(|e| view! { " " <span class="error-text">{e}</span> })}
                </li>
            }).collect_view()}
        </ol>
    }
}
