//! Results handed from the request that brings them to the job step waiting for them, in
//! this process. The result is in the database first (`store::tasks::complete_many`), so a
//! step that misses it here (it waits on another replica, or this one restarted) reads it
//! there; one that finds it here saves that read, one per task.

use passage_model::TaskId;
use passage_model::protocol::TaskResult;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Tasks a step of this process waits for, with their result once it came.
type Map = HashMap<TaskId, Option<TaskResult>>;

#[derive(Default)]
pub struct TaskResults {
    map: Arc<Mutex<Map>>,
}

/// A step's wait for one task's result; the entry goes when the wait ends, however it ends.
pub struct Expected {
    map: Arc<Mutex<Map>>,
    task: TaskId,
}

fn lock(map: &Mutex<Map>) -> std::sync::MutexGuard<'_, Map> {
    // Each entry is written whole under the lock: a panic elsewhere breaks none.
    map.lock().unwrap_or_else(|p| p.into_inner())
}

impl TaskResults {
    /// Made before the task is queued, so no result can come before it.
    pub fn expect(&self, task: TaskId) -> Expected {
        lock(&self.map).insert(task, None);
        Expected {
            map: self.map.clone(),
            task,
        }
    }

    /// Hands a result already recorded to the step of this process waiting for it, if
    /// one is; nothing when none is.
    pub fn deliver(&self, task: TaskId, result: &TaskResult) {
        if let Some(slot) = lock(&self.map).get_mut(&task) {
            *slot = Some(result.clone());
        }
    }
}

impl Expected {
    /// The result, if it was delivered here.
    pub fn take(&self) -> Option<TaskResult> {
        lock(&self.map).get_mut(&self.task).and_then(Option::take)
    }
}

impl Drop for Expected {
    fn drop(&mut self) {
        lock(&self.map).remove(&self.task);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok() -> TaskResult {
        TaskResult::success()
    }

    #[test]
    fn a_result_reaches_only_a_waiting_step_and_its_entry_goes_with_the_wait() {
        let r = TaskResults::default();
        let (a, b) = (TaskId::new_random(), TaskId::new_random());
        // Nobody waits on `b`: its result is not kept.
        r.deliver(b, &ok());
        assert!(lock(&r.map).is_empty());
        let wait = r.expect(a);
        assert!(wait.take().is_none(), "nothing before the result");
        r.deliver(a, &ok());
        assert_eq!(wait.take().map(|t| t.ok), Some(true));
        assert!(wait.take().is_none(), "taken once");
        drop(wait);
        assert!(lock(&r.map).is_empty());
        r.deliver(a, &ok());
        assert!(
            lock(&r.map).is_empty(),
            "a late result after the wait is not kept"
        );
    }
}
