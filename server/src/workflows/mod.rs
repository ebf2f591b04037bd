//! Workflows as sagas. Each is a type implementing [`Workflow`]: its kind, its steps (an
//! enum of `passage_model::jobs`, in order), its payload, and each step's action and undo.
//! The runner (`runner`) runs every kind the same way: each step's state is persisted, a
//! failed step unwinds every step that started, newest first, and a restarted server
//! resumes a job where it stopped (or goes on unwinding it).
//!
//! | kind | steps | when a step fails |
//! |---|---|---|
//! | provision | reserve → bind → launch → mark_used | each step undone; the VM `failed`, or, deleted while provisioning (cancelled), destroyed |
//! | destroy | stop → unbind → release → scrub | forward only: the VM `failed`, its devices quarantined (never freed unscrubbed) |
//! | scrub | scrub | the devices that failed quarantined |
//! | stop | stop (the guest asked to shut down, then powered off after its grace; or forced) | nothing to undo; the VM `running` again |
//! | reboot | stop → start | a launched VM stopped again; the VM `stopped` |
//! | start | bind → launch | a launched VM stopped again |
//! | resize, migrate | reserve → bind → commit → unbind → scrub | before `commit`, the new devices given back; after, the reconciler finishes |
//!
//! A job is written with its kind only ([`new_job`]); its steps come from the kind, and a
//! workflow whose step enum is not its kind's does not compile (`StepsOfKind`). Dispatch
//! from a stored kind to its workflow is one exhaustive `match` ([`dispatch!`]).

pub mod agent_task;
pub mod destroy;
pub mod disk;
mod error;
pub mod lifecycle;
pub mod provision;
pub mod reconcile;
mod runner;
pub mod scrub;
pub mod sriov;

pub use error::StepError;
pub use runner::{resume_all, run, spawn, spawn_with, unwind};

use crate::services::Ctx;
use crate::store::jobs::{JobRecord, NewJob};
use passage_model::api::{StepState, Vm, VmState};
use passage_model::jobs::{JobKind, Steps, same_names};
use passage_model::{AccountId, JobId, VmId};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::marker::PhantomData;

/// One kind of job: what each of its steps does and how it is undone.
pub trait Workflow: Sized + Send + Sync + 'static {
    const KIND: JobKind;
    /// Its steps, in order: the kind's own (checked when the runner is compiled for it).
    type Step: Steps;
    /// What the job carries beside its VM, fixed when it is written.
    type Payload: Serialize + DeserializeOwned + Send + Sync;
    /// Where the job's last step leaves its VM, a moment before the job is marked done
    /// (see `services::vms::settled`); `None` when the last step does not set the VM's state.
    const LEADS_TO: Option<VmState> = None;
    /// Whether a run may read its VM once and keep it: true where no step changes, and
    /// nothing else changes while the job runs, a field of the VM that a later step or
    /// undo reads (its devices, server, image, NICs, size). Each step read it again before,
    /// five reads per VM for a provision and five for a destroy.
    const KEEPS_VM: bool = false;

    /// Runs `step`. It must be idempotent: run twice, the second run succeeds and changes
    /// nothing more (the generic tests run every action twice).
    fn action(
        ctx: &Ctx,
        run: &Run<Self>,
        step: Self::Step,
    ) -> impl Future<Output = Result<(), StepError>> + Send;

    /// Undoes what `step` may have done, whether it finished or not; idempotent too.
    /// Forward-only workflows leave the default.
    fn undo(
        _ctx: &Ctx,
        _run: &Run<Self>,
        _step: Self::Step,
    ) -> impl Future<Output = Result<(), StepError>> + Send {
        async { Ok(()) }
    }

    /// The steps right after `step` whose work its action will do as well in this run,
    /// with its own (one task to a node instead of several): they are recorded as started
    /// in the write that starts `step`, so that an unwind after a failure or a restart
    /// undoes them too, and as succeeded with it. The action learns of them through
    /// [`Run::does_too`]; each of them, when its turn comes, through
    /// [`Run::was_done_ahead`]. None by default, and none when it cannot be told.
    fn ahead(
        _ctx: &Ctx,
        _run: &Run<Self>,
        _step: Self::Step,
    ) -> impl Future<Output = Vec<Self::Step>> + Send {
        async { Vec::new() }
    }

    /// Whether `step`'s action, in this run, only looks and changes nothing, here or on a
    /// node: its start then need not be written before it runs (a restart that finds it
    /// pending runs it again), and it is written, started and succeeded, with the next
    /// step's start. A provision's first step, from the write that reserved its devices,
    /// was a turn of its own on the job log for each VM. False by default.
    fn only_looks(_run: &Run<Self>, _step: Self::Step) -> bool {
        false
    }

    /// The step a failure of `step`'s action is recorded on: `step` itself, or, where it
    /// did the work of later steps too ([`Workflow::ahead`]), the one whose part failed.
    fn failed_at(_run: &Run<Self>, step: Self::Step, _error: &StepError) -> Self::Step {
        step
    }

    /// After the unwind of a failed job: what is left to put right (the VM's state,
    /// devices whose fate is unknown).
    fn on_failed(
        _ctx: &Ctx,
        _run: &Run<Self>,
        _error: &str,
    ) -> impl Future<Output = Result<(), StepError>> + Send {
        async { Ok(()) }
    }
}

/// The check that a workflow's step enum is its kind's, evaluated where the runner is
/// compiled for it: a mismatch is a compile error.
pub(crate) struct StepsOfKind<W>(PhantomData<W>);

impl<W: Workflow> StepsOfKind<W> {
    pub(crate) const CHECK: () = assert!(
        same_names(<W::Step as Steps>::NAMES, W::KIND.step_names()),
        "a workflow's steps must be its kind's"
    );
}

/// A job as its workflow sees it while it runs or unwinds.
pub struct Run<W: Workflow> {
    pub job: JobId,
    pub vm: Option<VmId>,
    pub owner: Option<AccountId>,
    pub payload: W::Payload,
    /// Each step, with its state and whether it ever started.
    steps: Vec<(W::Step, StepState, bool)>,
    /// The VM as first read, for a workflow that [`Workflow::KEEPS_VM`].
    kept_vm: tokio::sync::OnceCell<Vm>,
    /// The devices the VM held when a step of this run first read them
    /// ([`Run::held_first`]).
    held: tokio::sync::OnceCell<Vec<String>>,
    /// Whether the run starts from the VM as the write that started the job left it
    /// ([`Run::given`]), not from a job read back (a restart, another replica's).
    from_write: bool,
    /// The later steps whose work the step running now does too ([`Workflow::ahead`]).
    doing: Vec<W::Step>,
    /// Later steps whose work an earlier step of this run has done with its own.
    done_ahead: Vec<W::Step>,
}

impl<W: Workflow> Run<W> {
    /// Reads a job record as a job of `W`.
    pub(crate) fn of(rec: &JobRecord) -> Result<Self, StepError> {
        let payload = serde_json::from_str(rec.payload.as_deref().unwrap_or("null"))
            .map_err(|e| StepError::Broken(format!("the job's payload is unreadable: {e}")))?;
        let steps = rec
            .steps
            .iter()
            .map(|s| {
                W::Step::parse(&s.name)
                    .map(|step| (step, s.state, s.started_at.is_some()))
                    .ok_or_else(|| {
                        StepError::Broken(format!("{} has no step {:?}", W::KIND, s.name))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let names: Vec<&str> = steps.iter().map(|(s, _, _)| s.name()).collect();
        if names != <W::Step as Steps>::NAMES {
            return Err(StepError::Broken(format!(
                "the {} job's steps are {names:?}, not its kind's",
                W::KIND
            )));
        }
        Ok(Run {
            job: rec.uuid,
            vm: rec.vm,
            owner: rec.owner,
            payload,
            steps,
            kept_vm: tokio::sync::OnceCell::new(),
            held: tokio::sync::OnceCell::new(),
            from_write: false,
            doing: Vec::new(),
            done_ahead: Vec::new(),
        })
    }

    /// Starts from `vm`, as the write that started the job left it, when the workflow
    /// keeps its VM and it is the job's.
    pub(crate) fn given(mut self, vm: Option<Vm>) -> Self {
        if let Some(vm) = vm
            && W::KEEPS_VM
            && self.vm == Some(vm.uuid)
        {
            // Empty until now: `Run::of` made it.
            let _ = self.kept_vm.set(vm);
            self.from_write = true;
        }
        self
    }

    /// Whether this run started from the VM as the write that started the job left it,
    /// in this process, rather than from a job read back after a restart.
    pub fn from_write(&self) -> bool {
        self.from_write
    }

    /// Whether the step running now does `later`'s work too ([`Workflow::ahead`]).
    pub fn does_too(&self, later: W::Step) -> bool {
        self.doing.contains(&later)
    }

    /// For [`Workflow::ahead`]: `later`, when the run's VM is on a node whose agent said
    /// it runs tasks of `kind` (one task doing their work with the step's); none otherwise.
    pub async fn ahead_if_node_runs(
        &self,
        ctx: &Ctx,
        kind: &str,
        later: &[W::Step],
    ) -> Vec<W::Step> {
        match self.vm(ctx).await {
            Ok(vm)
                if vm
                    .server_uuid
                    .is_some_and(|s| crate::services::agents::runs(ctx, s, kind)) =>
            {
                later.to_vec()
            }
            _ => Vec::new(),
        }
    }

    /// For [`Workflow::failed_at`]: the step among those `step` is doing whose part of
    /// `task` (a task of several parts, by name) failed, as `parts` pairs them; `step`
    /// when the error names none of them.
    pub fn failed_part(
        &self,
        step: W::Step,
        error: &StepError,
        task: &str,
        parts: &[(&str, W::Step)],
    ) -> W::Step {
        let Some(part) = agent_task::failed_part(error, task) else {
            return step;
        };
        parts
            .iter()
            .find(|(name, s)| *name == part && self.does_too(*s))
            .map_or(step, |(_, s)| *s)
    }

    /// Whether an earlier step of this run did `step`'s work ([`Workflow::ahead`]). A
    /// run read back after a restart knows nothing of it and does their work again, as it
    /// would any step's.
    pub fn was_done_ahead(&self, step: W::Step) -> bool {
        self.done_ahead.contains(&step)
    }

    fn find(&self, step: W::Step) -> Option<&(W::Step, StepState, bool)> {
        self.steps.iter().find(|(s, _, _)| *s == step)
    }

    /// Whether `step` ever started.
    pub fn started(&self, step: W::Step) -> bool {
        self.find(step).is_some_and(|(_, _, started)| *started)
    }

    /// Whether `step` finished successfully (and was not undone since).
    pub fn succeeded(&self, step: W::Step) -> bool {
        self.find(step)
            .is_some_and(|(_, st, _)| *st == StepState::Succeeded)
    }

    /// The VM the job works on, as it is now (as it was first read, for a workflow that
    /// [`Workflow::KEEPS_VM`]).
    pub async fn vm(&self, ctx: &Ctx) -> Result<Vm, StepError> {
        let id = self
            .vm
            .ok_or_else(|| StepError::Broken(format!("the {} job has no VM", W::KIND)))?;
        let read = || async { crate::store::vms::get(&ctx.jobs_db, id).await };
        if W::KEEPS_VM {
            return Ok(self.kept_vm.get_or_try_init(read).await?.clone());
        }
        Ok(read().await?)
    }

    /// The devices the VM held when a step of this run first read them, by id. Only for
    /// a workflow whose VM gains no device while it runs, and whose later steps only move
    /// them: a device it stopped holding since is then skipped by the move, as any move
    /// skips a device not held by its VM.
    pub async fn held_first(&self, ctx: &Ctx, vm: &Vm) -> Result<Vec<String>, StepError> {
        Ok(self
            .held
            .get_or_try_init(|| provision::held(ctx, vm))
            .await?
            .clone())
    }

    fn set(&mut self, idx: usize, state: StepState) {
        if let Some(s) = self.steps.get_mut(idx) {
            s.1 = state;
            s.2 |= state != StepState::Pending;
        }
    }
}

/// A job of `W` to write: its steps are its kind's.
pub fn new_job<W: Workflow>(
    uuid: JobId,
    vm: Option<VmId>,
    owner: Option<AccountId>,
    payload: &W::Payload,
) -> Result<NewJob, StepError> {
    let value = serde_json::to_value(payload)
        .map_err(|e| StepError::Broken(format!("the job's payload: {e}")))?;
    Ok(NewJob {
        uuid,
        kind: W::KIND,
        vm,
        owner,
        payload: (!value.is_null()).then(|| value.to_string()),
    })
}

/// Runs `$body` with the type alias `$w` naming the workflow of `$kind`: the one place a
/// stored kind becomes a type, exhaustive over the kinds.
macro_rules! dispatch {
    ($kind:expr, $w:ident => $body:expr) => {{
        use passage_model::jobs::JobKind;
        match $kind {
            JobKind::Provision => {
                type $w = $crate::workflows::provision::Provision;
                const _: () = assert!(
                    matches!(
                        <$w as $crate::workflows::Workflow>::KIND,
                        JobKind::Provision
                    ),
                    "dispatched to a workflow of another kind"
                );
                $body
            }
            JobKind::Destroy => {
                type $w = $crate::workflows::destroy::Destroy;
                const _: () = assert!(
                    matches!(<$w as $crate::workflows::Workflow>::KIND, JobKind::Destroy),
                    "dispatched to a workflow of another kind"
                );
                $body
            }
            JobKind::Scrub => {
                type $w = $crate::workflows::scrub::Scrub;
                const _: () = assert!(
                    matches!(<$w as $crate::workflows::Workflow>::KIND, JobKind::Scrub),
                    "dispatched to a workflow of another kind"
                );
                $body
            }
            JobKind::Stop => {
                type $w = $crate::workflows::lifecycle::Stop;
                const _: () = assert!(
                    matches!(<$w as $crate::workflows::Workflow>::KIND, JobKind::Stop),
                    "dispatched to a workflow of another kind"
                );
                $body
            }
            JobKind::Start => {
                type $w = $crate::workflows::lifecycle::Start;
                const _: () = assert!(
                    matches!(<$w as $crate::workflows::Workflow>::KIND, JobKind::Start),
                    "dispatched to a workflow of another kind"
                );
                $body
            }
            JobKind::Resize => {
                type $w = $crate::workflows::lifecycle::Resize;
                const _: () = assert!(
                    matches!(<$w as $crate::workflows::Workflow>::KIND, JobKind::Resize),
                    "dispatched to a workflow of another kind"
                );
                $body
            }
            JobKind::Migrate => {
                type $w = $crate::workflows::lifecycle::Migrate;
                const _: () = assert!(
                    matches!(<$w as $crate::workflows::Workflow>::KIND, JobKind::Migrate),
                    "dispatched to a workflow of another kind"
                );
                $body
            }
            JobKind::Reboot => {
                type $w = $crate::workflows::lifecycle::Reboot;
                const _: () = assert!(
                    matches!(<$w as $crate::workflows::Workflow>::KIND, JobKind::Reboot),
                    "dispatched to a workflow of another kind"
                );
                $body
            }
        }
    }};
}
pub(crate) use dispatch;

/// Where a job of `kind` leaves its VM when it succeeds.
pub fn leads_to(kind: JobKind) -> Option<VmState> {
    dispatch!(kind, W => W::LEADS_TO)
}
