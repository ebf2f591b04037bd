//! The device state machine of RFD 114, as a pure function.
//!
//! `unassigned → provisioning → used → dirty → cleaning → unassigned`, plus `quarantined`
//! (scrub failed, health lost) and the operator's `disabled`. The one rule that matters
//! most: nothing leads from `dirty` back to `unassigned` except a successful scrub.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum DeviceState {
    Unassigned,
    Provisioning,
    Used,
    Dirty,
    Cleaning,
    Quarantined,
    Disabled,
    /// A GPU that hosts vGPUs: not assignable whole; its vGPU slots are devices of their
    /// own. It leaves through `dirty`, so a full scrub runs before it is whole again.
    Shared,
}

pub const ALL_STATES: [DeviceState; 8] = [
    DeviceState::Unassigned,
    DeviceState::Provisioning,
    DeviceState::Used,
    DeviceState::Dirty,
    DeviceState::Cleaning,
    DeviceState::Quarantined,
    DeviceState::Disabled,
    DeviceState::Shared,
];

impl DeviceState {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceState::Unassigned => "unassigned",
            DeviceState::Provisioning => "provisioning",
            DeviceState::Used => "used",
            DeviceState::Dirty => "dirty",
            DeviceState::Cleaning => "cleaning",
            DeviceState::Quarantined => "quarantined",
            DeviceState::Disabled => "disabled",
            DeviceState::Shared => "shared",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        ALL_STATES.into_iter().find(|st| st.as_str() == s)
    }

    /// Held by a VM: `used_by` is set exactly in these states.
    pub fn is_held(self) -> bool {
        matches!(self, DeviceState::Provisioning | DeviceState::Used)
    }
}

impl fmt::Display for DeviceState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeviceEvent {
    /// Placement picked the device for a VM.
    Reserve,
    /// The VM is running with the device attached.
    Attach,
    /// A provision unwound before any VM was started with the device.
    CancelUnused,
    /// The VM that had the device is gone (destroyed, or its launch unwound).
    Release,
    /// The agent began scrubbing.
    ScrubStart,
    /// The agent reported a scrub with every step successful.
    ScrubSucceeded,
    /// A scrub step failed.
    ScrubFailed,
    /// The scrub was interrupted (agent lost); it must run again.
    ScrubAborted,
    /// Health lost or an operator's order: keep it away from tenants.
    Quarantine,
    /// An operator checked a quarantined device: scrub it again before reuse.
    Requeue,
    Disable,
    Enable,
    /// A vGPU request turned the free GPU into a host of vGPU slots.
    Share,
    /// The GPU's last vGPU is gone: it is scrubbed whole before it is assignable again.
    Unshare,
}

pub const ALL_EVENTS: [DeviceEvent; 14] = [
    DeviceEvent::Reserve,
    DeviceEvent::Attach,
    DeviceEvent::CancelUnused,
    DeviceEvent::Release,
    DeviceEvent::ScrubStart,
    DeviceEvent::ScrubSucceeded,
    DeviceEvent::ScrubFailed,
    DeviceEvent::ScrubAborted,
    DeviceEvent::Quarantine,
    DeviceEvent::Requeue,
    DeviceEvent::Disable,
    DeviceEvent::Enable,
    DeviceEvent::Share,
    DeviceEvent::Unshare,
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a device in state {from} cannot take event {event:?}")]
pub struct TransitionError {
    pub from: DeviceState,
    pub event: DeviceEvent,
}

pub fn transition(from: DeviceState, event: DeviceEvent) -> Result<DeviceState, TransitionError> {
    use DeviceEvent as E;
    use DeviceState as S;
    let to = match (from, event) {
        (S::Unassigned, E::Reserve) => S::Provisioning,
        (S::Provisioning, E::Attach) => S::Used,
        (S::Provisioning, E::CancelUnused) => S::Unassigned,
        (S::Provisioning | S::Used, E::Release) => S::Dirty,
        (S::Dirty, E::ScrubStart) => S::Cleaning,
        (S::Cleaning, E::ScrubSucceeded) => S::Unassigned,
        (S::Cleaning, E::ScrubFailed) => S::Quarantined,
        (S::Cleaning, E::ScrubAborted) => S::Dirty,
        // From a held state only when the VM's fate is unknown (a destroy that could not
        // stop it): the device must not be scrubbed under a VM that may still run.
        (_, E::Quarantine) => S::Quarantined,
        (S::Quarantined, E::Requeue) => S::Dirty,
        (S::Unassigned, E::Disable) => S::Disabled,
        (S::Disabled, E::Enable) => S::Unassigned,
        (S::Unassigned, E::Share) => S::Shared,
        (S::Shared, E::Unshare) => S::Dirty,
        _ => return Err(TransitionError { from, event }),
    };
    Ok(to)
}

/// Every state an event may start from: what a conditional `UPDATE … WHERE state IN (…)`
/// needs.
pub fn sources(event: DeviceEvent) -> Vec<DeviceState> {
    ALL_STATES
        .into_iter()
        .filter(|s| transition(*s, event).is_ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use DeviceEvent as E;
    use DeviceState as S;
    use proptest::prelude::*;

    #[test]
    fn table() {
        let allowed: &[(S, E, S)] = &[
            (S::Unassigned, E::Reserve, S::Provisioning),
            (S::Provisioning, E::Attach, S::Used),
            (S::Provisioning, E::CancelUnused, S::Unassigned),
            (S::Provisioning, E::Release, S::Dirty),
            (S::Used, E::Release, S::Dirty),
            (S::Dirty, E::ScrubStart, S::Cleaning),
            (S::Cleaning, E::ScrubSucceeded, S::Unassigned),
            (S::Cleaning, E::ScrubFailed, S::Quarantined),
            (S::Cleaning, E::ScrubAborted, S::Dirty),
            (S::Unassigned, E::Quarantine, S::Quarantined),
            (S::Provisioning, E::Quarantine, S::Quarantined),
            (S::Used, E::Quarantine, S::Quarantined),
            (S::Dirty, E::Quarantine, S::Quarantined),
            (S::Cleaning, E::Quarantine, S::Quarantined),
            (S::Disabled, E::Quarantine, S::Quarantined),
            (S::Quarantined, E::Quarantine, S::Quarantined),
            (S::Quarantined, E::Requeue, S::Dirty),
            (S::Unassigned, E::Disable, S::Disabled),
            (S::Disabled, E::Enable, S::Unassigned),
            (S::Unassigned, E::Share, S::Shared),
            (S::Shared, E::Unshare, S::Dirty),
            (S::Shared, E::Quarantine, S::Quarantined),
        ];
        for from in ALL_STATES {
            for ev in ALL_EVENTS {
                let expected = allowed
                    .iter()
                    .find(|(f, e, _)| *f == from && *e == ev)
                    .map(|(_, _, t)| *t);
                assert_eq!(transition(from, ev).ok(), expected, "{from} + {ev:?}");
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for s in ALL_STATES {
            assert_eq!(DeviceState::parse(s.as_str()), Some(s));
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
        assert_eq!(DeviceState::parse("free"), None);
        assert_eq!(sources(E::Release), vec![S::Provisioning, S::Used]);
    }

    #[test]
    fn held_states_only_reached_by_reserve_and_attach() {
        for from in ALL_STATES {
            for ev in ALL_EVENTS {
                if let Ok(to) = transition(from, ev)
                    && to.is_held()
                    && !from.is_held()
                {
                    assert_eq!(ev, E::Reserve);
                }
            }
        }
    }

    proptest! {
        /// Walk random event sequences: once a device has been dirty, it reaches
        /// `unassigned` only through a successful scrub after its latest dirtying.
        #[test]
        fn dirty_never_reaches_unassigned_without_scrub(
            start in proptest::sample::select(ALL_STATES.to_vec()),
            events in proptest::collection::vec(proptest::sample::select(ALL_EVENTS.to_vec()), 0..64)
        ) {
            let mut state = start;
            let mut needs_scrub = matches!(start, S::Dirty | S::Cleaning | S::Quarantined);
            let mut scrubbed = false;
            for ev in events {
                match transition(state, ev) {
                    Ok(next) => {
                        if matches!(next, S::Dirty) {
                            needs_scrub = true;
                            scrubbed = false;
                        }
                        if ev == E::ScrubSucceeded {
                            scrubbed = true;
                        }
                        if next == S::Unassigned && needs_scrub {
                            prop_assert!(scrubbed, "{state} -{ev:?}-> unassigned without scrub");
                            needs_scrub = false;
                        }
                        state = next;
                    }
                    Err(e) => {
                        prop_assert_eq!(e.from, state);
                    }
                }
            }
        }
    }
}
