//! How a step fails. The runner retries what is retryable within the step's time, records
//! the kind with the message in the job's step, and unwinds on anything else.

use crate::store::StoreError;
use crate::store::jobs::StepFailure;
use passage_model::jobs::StepErrorKind;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// Worth another try as it is: a node that did not answer, a lost race, a database
    /// that went away.
    #[error("{0}")]
    Retryable(String),
    /// Refused, with the reason: a rule, or the node said no (in its own words).
    #[error("{0}")]
    Refused(String),
    /// The control plane's own fault: an unreadable record, a step that cannot be.
    #[error("{0}")]
    Broken(String),
}

impl StepError {
    pub fn kind(&self) -> StepErrorKind {
        match self {
            StepError::Retryable(_) => StepErrorKind::Retryable,
            StepError::Refused(_) => StepErrorKind::Refused,
            StepError::Broken(_) => StepErrorKind::Broken,
        }
    }

    pub fn message(&self) -> &str {
        match self {
            StepError::Retryable(m) | StepError::Refused(m) | StepError::Broken(m) => m,
        }
    }

    /// The same failure with `context` in front of its message.
    pub fn context(self, context: impl std::fmt::Display) -> StepError {
        let with = |m: String| format!("{context}: {m}");
        match self {
            StepError::Retryable(m) => StepError::Retryable(with(m)),
            StepError::Refused(m) => StepError::Refused(with(m)),
            StepError::Broken(m) => StepError::Broken(with(m)),
        }
    }

    pub fn failure(&self) -> StepFailure {
        StepFailure {
            kind: self.kind(),
            message: self.message().to_string(),
        }
    }
}

impl From<StoreError> for StepError {
    fn from(e: StoreError) -> Self {
        let m = e.to_string();
        match e {
            StoreError::Sqlx(_) | StoreError::Retry => StepError::Retryable(m),
            StoreError::NotFound(_)
            | StoreError::Conflict(_)
            | StoreError::Quota(_)
            | StoreError::InvalidState(_)
            | StoreError::NoRoom(_)
            | StoreError::Exhausted(_) => StepError::Refused(m),
            StoreError::Migrate(_) | StoreError::Corrupt(_) | StoreError::BadUrl(_) => {
                StepError::Broken(m)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_errors_keep_their_nature() {
        assert_eq!(
            StepError::from(StoreError::Retry).kind(),
            StepErrorKind::Retryable
        );
        assert_eq!(
            StepError::from(StoreError::InvalidState("x".into())).kind(),
            StepErrorKind::Refused
        );
        assert_eq!(
            StepError::from(StoreError::Corrupt("x".into())).kind(),
            StepErrorKind::Broken
        );
        let e = StepError::Refused("busy".into()).context("bind");
        assert_eq!(
            (e.kind(), e.message()),
            (StepErrorKind::Refused, "bind: busy")
        );
    }
}
