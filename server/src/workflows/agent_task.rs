//! A job step that needs a node: queue a task for its agent and wait for the answer.

use super::StepError;
use crate::services::Ctx;
use crate::store::job_log::NewTask;
use crate::store::tasks;
use passage_model::protocol::{Task, TaskResult};
use passage_model::{JobId, ServerId, TaskId};
use std::time::Duration;

/// Waits for a successful answer; the node's refusal is one, in its own words.
pub async fn run(
    ctx: &Ctx,
    server: ServerId,
    job: Option<JobId>,
    task: Task,
) -> Result<TaskResult, StepError> {
    let name = task.name();
    let r = run_raw(ctx, server, job, task).await?;
    if r.ok {
        Ok(r)
    } else {
        Err(StepError::Refused(format!(
            "{name}{NODE_FAILED}{}",
            r.error.as_deref().unwrap_or("no reason given")
        )))
    }
}

/// The part of a task of several parts (`boot_vm`, `destroy_vm`) that the node said
/// failed, from [`run`]'s error: the node names it first in its error.
pub fn failed_part<'e>(e: &'e StepError, task: &str) -> Option<&'e str> {
    let StepError::Refused(m) = e else {
        return None;
    };
    let said = m.strip_prefix(task)?.strip_prefix(NODE_FAILED)?;
    said.split_once(": ").map(|(part, _)| part)
}

/// What [`run`] says between the task's name and the node's words.
const NODE_FAILED: &str = " failed on the node: ";

/// Waits for the node's answer, whatever it says; an error only if none came (retryable:
/// the node may be back, and every task is idempotent on the node).
pub async fn run_raw(
    ctx: &Ctx,
    server: ServerId,
    job: Option<JobId>,
    task: Task,
) -> Result<TaskResult, StepError> {
    // Time-ordered: the tasks table is keyed by it and grows by one row per task.
    run_raw_as(ctx, server, job, TaskId::new_ordered(), task).await
}

/// [`run_raw`] for a task whose id the caller chose, to record beside what the result
/// brings (`new_ordered`, as every task's).
pub async fn run_raw_as(
    ctx: &Ctx,
    server: ServerId,
    job: Option<JobId>,
    id: TaskId,
    task: Task,
) -> Result<TaskResult, StepError> {
    let name = task.name();
    let waker = ctx.task_done.handle(&id);
    // Made before the task exists, so no wake-up of its result can come before it: the
    // first look at the database waits for one (a result cannot be there sooner), which
    // saves a read per task.
    let mut done = std::pin::pin!(waker.notified());
    let expected = ctx.task_results.expect(id);
    let queued = match NewTask::new(id, server, job, &task) {
        Ok(t) => crate::services::job_log::task(ctx, t).await,
        Err(e) => Err(e),
    };
    queued.map_err(|e| StepError::from(e).context(format!("could not queue {name}")))?;
    // Other replicas were told as the task was written.
    ctx.queue_marks.queued(&server);
    ctx.tasks_queued.wake(&server);
    let deadline = tokio::time::Instant::now() + timeout_for(ctx, &task);
    loop {
        let until = match ctx.replica_poll() {
            // Polling as well covers a result whose announcement was lost.
            Some(every) => deadline.min(tokio::time::Instant::now() + every),
            None => deadline,
        };
        let _ = tokio::time::timeout_at(until, done.as_mut()).await;
        // Before the look, so that a wake-up between the look and the wait is not lost.
        done.set(waker.notified());
        if let Some(r) = expected.take() {
            return Ok(r);
        }
        match tasks::result(&ctx.jobs_db, id).await {
            Ok(Some(r)) => return Ok(r),
            Ok(None) => {}
            Err(e) => {
                return Err(StepError::from(e).context(format!("reading the result of {name}")));
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(StepError::Retryable(format!(
                "the node did not answer {name} within {} s",
                timeout_for(ctx, &task).as_secs()
            )));
        }
    }
}

/// A scrub runs a pipeline per device (a vendor reset alone may take a minute, memory
/// zeroing several): it gets 15 minutes per device on top of the usual limit.
fn timeout_for(ctx: &Ctx, task: &Task) -> Duration {
    match task {
        Task::Scrub { devices, .. } => {
            ctx.cfg.task_timeout + Duration::from_secs(900) * devices.len().max(1) as u32
        }
        // An image download: the usual limit plus its size at 10 MB/s.
        Task::FetchImage { disk, .. } => {
            ctx.cfg.task_timeout + Duration::from_secs(disk.image.size / 10_000_000)
        }
        Task::BootVm { vm, .. } => {
            ctx.cfg.task_timeout
                + Duration::from_secs(vm.disk.as_ref().map_or(0, |d| d.image.size / 10_000_000))
        }
        // The guest's grace on top: the node answers once the VM has ended.
        Task::ShutdownVm { grace_s, .. } => {
            ctx.cfg.task_timeout + Duration::from_secs(u64::from(*grace_s))
        }
        // Someone is waiting at a page: a node that cannot answer in seconds is down.
        Task::ReadConsole { .. } | Task::AttachConsole { .. } => {
            ctx.cfg.task_timeout.min(CONSOLE_TIMEOUT)
        }
        _ => ctx.cfg.task_timeout,
    }
}

/// How long a console read waits for the node.
pub const CONSOLE_TIMEOUT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_failed_part_is_read_from_the_nodes_words() {
        let node =
            |task: &str, said: &str| StepError::Refused(format!("{task}{NODE_FAILED}{said}"));
        let e = node("boot_vm", "start_vm: no bridge br0: gone");
        assert_eq!(failed_part(&e, "boot_vm"), Some("start_vm"));
        assert_eq!(failed_part(&e, "destroy_vm"), None, "another task's");
        assert_eq!(
            failed_part(&node("boot_vm", "no reason given"), "boot_vm"),
            None
        );
        let retry = StepError::Retryable(format!("boot_vm{NODE_FAILED}start_vm: x"));
        assert_eq!(
            failed_part(&retry, "boot_vm"),
            None,
            "only the node's refusal"
        );
    }
}
