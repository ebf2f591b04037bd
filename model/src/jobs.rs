//! What jobs there are and the steps of each, in order: the names a job's record and its
//! API view (`Job.name`, `JobStep.name`) carry. The control plane's workflows
//! (`server/src/workflows/`) give each step its action and undo; a job is written with its
//! kind alone, and its steps always come from here, so no job can carry another kind's.

use serde::{Deserialize, Serialize};

/// The kinds of job, by the name a job record and the API carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    Provision,
    Destroy,
    Scrub,
    Stop,
    Start,
    Resize,
    Migrate,
    Reboot,
}

impl JobKind {
    pub const ALL: [JobKind; 8] = [
        JobKind::Provision,
        JobKind::Destroy,
        JobKind::Scrub,
        JobKind::Stop,
        JobKind::Start,
        JobKind::Resize,
        JobKind::Migrate,
        JobKind::Reboot,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            JobKind::Provision => "provision",
            JobKind::Destroy => "destroy",
            JobKind::Scrub => "scrub",
            JobKind::Stop => "stop",
            JobKind::Start => "start",
            JobKind::Resize => "resize",
            JobKind::Migrate => "migrate",
            JobKind::Reboot => "reboot",
        }
    }

    pub fn parse(s: &str) -> Option<JobKind> {
        JobKind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The names of the kind's steps, in the order they run.
    pub const fn step_names(self) -> &'static [&'static str] {
        match self {
            JobKind::Provision => ProvisionStep::NAMES,
            JobKind::Destroy => DestroyStep::NAMES,
            JobKind::Scrub => ScrubStep::NAMES,
            JobKind::Stop => StopStep::NAMES,
            JobKind::Start => StartStep::NAMES,
            JobKind::Resize | JobKind::Migrate => ReplaceStep::NAMES,
            JobKind::Reboot => RebootStep::NAMES,
        }
    }
}

impl std::fmt::Display for JobKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a step failed: what its job record keeps beside the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum StepErrorKind {
    /// Worth another try as it is (a node that did not answer, a lost race, a database
    /// that went away): the runner retries it within the step's time.
    Retryable,
    /// Refused, with the reason: a rule, or the node said no (in its own words).
    Refused,
    /// The control plane's own fault (an unreadable record, a bug): not retried.
    Broken,
}

impl StepErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StepErrorKind::Retryable => "retryable",
            StepErrorKind::Refused => "refused",
            StepErrorKind::Broken => "broken",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            StepErrorKind::Retryable,
            StepErrorKind::Refused,
            StepErrorKind::Broken,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
}

/// The steps of one kind of job, as an enum.
pub trait Steps: Copy + Eq + std::fmt::Debug + Send + Sync + 'static {
    /// Every step, in the order they run.
    const ALL: &'static [Self];
    /// Their names, in the same order.
    const NAMES: &'static [&'static str];

    fn name(self) -> &'static str;

    fn parse(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|s| s.name() == name)
    }
}

/// Whether two lists of names are the same, in a constant: a workflow whose step enum is
/// not its kind's fails to compile (see `server/src/workflows/`).
pub const fn same_names(a: &[&str], b: &[&str]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        let (x, y) = (a[i].as_bytes(), b[i].as_bytes());
        if x.len() != y.len() {
            return false;
        }
        let mut j = 0;
        while j < x.len() {
            if x[j] != y[j] {
                return false;
            }
            j += 1;
        }
        i += 1;
    }
    true
}

macro_rules! steps {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vm])* $v),+
        }

        impl Steps for $name {
            const ALL: &'static [Self] = &[$($name::$v),+];
            const NAMES: &'static [&'static str] = &[$($s),+];

            fn name(self) -> &'static str {
                match self {
                    $($name::$v => $s),+
                }
            }
        }
    };
}

steps! {
    /// A new VM: each step undone, newest first, when a later one fails.
    ProvisionStep {
        /// The reservation made with the VM row still holds.
        Reserve = "reserve",
        /// The node binds the devices for passthrough.
        Bind = "bind",
        /// The node fetches the VM's image into its cache and makes the VM's boot disk
        /// (a no-op for a VM without an image); undone by deleting the disk.
        FetchImage = "fetch_image",
        /// The node starts the VM.
        Launch = "launch",
        /// Devices `used`, VM `running`.
        MarkUsed = "mark_used",
    }
}

steps! {
    /// A VM's end. Forward only: past `stop` there is nothing to give back; on failure the
    /// VM's devices are quarantined, never freed unscrubbed.
    DestroyStep {
        Stop = "stop",
        Unbind = "unbind",
        /// The node deletes the VM's boot disk (a no-op without an image). Before the
        /// point of no return, so a node that cannot delete it fails the destroy visibly
        /// instead of leaving a tenant's disk behind a `destroyed` VM.
        DeleteDisk = "delete_disk",
        /// The point of no return: devices `dirty`, VM `destroyed`.
        Release = "release",
        Scrub = "scrub",
    }
}

steps! {
    /// Dirty devices of one server back to `unassigned` through their scrub.
    ScrubStep {
        Scrub = "scrub",
    }
}

steps! {
    /// The guest asked to shut down (ACPI power button), given its grace, then the VM
    /// ended; or, forced, ended at once. The step's detail says which happened.
    StopStep {
        Stop = "stop",
    }
}

steps! {
    /// A clean stop, then a start, in one job; `force` makes the stop a power cut (a
    /// reset).
    RebootStep {
        /// As a stop's one step; the VM `stopped` after it.
        Stop = "stop",
        /// As a start's steps in one: devices bound, disk there, VM started.
        Start = "start",
    }
}

steps! {
    StartStep {
        Bind = "bind",
        /// The image and disk are there (fetched again if the node lost them).
        FetchImage = "fetch_image",
        Launch = "launch",
    }
}

steps! {
    /// A resize (another package) or a cold migration (another server) of a stopped VM.
    ReplaceStep {
        /// The new devices reserved with the job still hold.
        Reserve = "reserve",
        Bind = "bind",
        /// The point of no return: the VM has its new devices and shape.
        Commit = "commit",
        Unbind = "unbind",
        Scrub = "scrub",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_and_steps_round_trip() {
        for k in JobKind::ALL {
            assert_eq!(JobKind::parse(k.as_str()), Some(k));
            assert_eq!(serde_json::to_value(k).ok(), Some(k.as_str().into()));
            assert!(!k.step_names().is_empty());
        }
        assert_eq!(JobKind::parse("reset"), None);
        assert_eq!(JobKind::Reboot.step_names(), ["stop", "start"]);
        for s in ProvisionStep::ALL {
            assert_eq!(ProvisionStep::parse(s.name()), Some(*s));
        }
        assert_eq!(
            JobKind::Provision.step_names(),
            ["reserve", "bind", "fetch_image", "launch", "mark_used"]
        );
        assert_eq!(ReplaceStep::parse("launch"), None);
    }

    #[test]
    fn names_compare_in_constants() {
        const { assert!(same_names(StartStep::NAMES, JobKind::Start.step_names())) };
        const { assert!(!same_names(StartStep::NAMES, JobKind::Stop.step_names())) };
        assert!(!same_names(&["bind"], &["bine"]));
        assert!(!same_names(&["bind"], &["bind", "launch"]));
    }
}
