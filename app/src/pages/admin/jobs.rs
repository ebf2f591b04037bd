use crate::components::guard::{Audience, Guard};
use crate::components::list::{Filter, ListPage, use_query_param};
use crate::components::widgets::{Badge, VmLink};
use crate::data::{load, poll};
use crate::fmt;
use crate::rpc::list_jobs;
use leptos::prelude::*;
use leptos_meta::Title;
use passage_model::api::Job;

const FILTERS: &[Filter] = &[Filter::choice(
    "state",
    "State",
    &["queued", "running", "succeeded", "failed"],
)];

#[component]
pub fn JobsPage() -> impl IntoView {
    let get = use_query_param();
    let data = load(
        move || (get("state"), get("after")),
        |(state, after)| list_jobs(state, after),
    );
    poll(data, 2000);
    view! {
        <Title text="Jobs · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"Jobs"</h1>
            <ListPage path="/admin/jobs" data=data filters=FILTERS filter_label="Filter jobs" let:jobs>
                <div class="jobs">
                    {jobs.into_iter().map(|j| view! { <JobCard job=j/> }).collect_view()}
                </div>
            </ListPage>
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
                    // An image download's bytes so far, as the node reports them.
                    {s.progress.filter(|p| p.total > 0).map(|p| view! {
                        " " <progress class="step-progress" max=p.total.to_string()
                            value=p.done.to_string()>{format!("{} of {} MB", p.done / 1_000_000, p.total / 1_000_000)}</progress>
                        " " <span class="muted">{format!("{}%", p.done.saturating_mul(100) / p.total)}</span>
                    })}
                    {s.error.clone().map(|e| view! { " " <span class="error-text">{e}</span> })}
                </li>
            }).collect_view()}
        </ol>
    }
}
