//! The portal's error: the API's `{code, message, field}` carried through server
//! functions, so a form can put the message next to the field it names.

use leptos::server_fn::codec::JsonEncoding;
use leptos::server_fn::error::{FromServerFnError, ServerFnErrorErr};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortalError {
    /// The API's error code (`InvalidArgument`, `ResourceNotFound`…) or `Portal` for the
    /// portal's own failures (a lost connection, a stale form).
    pub code: String,
    pub message: String,
    pub field: Option<String>,
}

impl PortalError {
    pub fn new(code: &str, message: impl Into<String>) -> Self {
        PortalError {
            code: code.to_string(),
            message: message.into(),
            field: None,
        }
    }
    pub fn unauthorized() -> Self {
        Self::new(
            "Unauthorized",
            "Your session has ended. Please sign in again.",
        )
    }
    pub fn is_unauthorized(&self) -> bool {
        self.code == "Unauthorized"
    }
    pub fn is_not_found(&self) -> bool {
        self.code == "ResourceNotFound"
    }
    pub fn is_forbidden(&self) -> bool {
        self.code == "Forbidden"
    }
    /// The message, when it belongs to `field`.
    pub fn for_field(&self, field: &str) -> Option<String> {
        (self.field.as_deref() == Some(field)).then(|| self.message.clone())
    }
}

impl std::fmt::Display for PortalError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PortalError {}

impl FromServerFnError for PortalError {
    type Encoder = JsonEncoding;

    fn from_server_fn_error(value: ServerFnErrorErr) -> Self {
        let message = match &value {
            ServerFnErrorErr::Request(_) => {
                "The server could not be reached. Check your connection and try again.".to_string()
            }
            ServerFnErrorErr::Args(e) | ServerFnErrorErr::MissingArg(e) => {
                format!("The form was incomplete: {e}")
            }
            other => other.to_string(),
        };
        PortalError::new("Portal", message)
    }
}

pub type PortalResult<T> = Result<T, PortalError>;
