//! The portal's error: the API's `{code, message, field}` carried through server
//! functions, so a form can put the message next to the field it names.

use leptos::server_fn::codec::JsonEncoding;
use leptos::server_fn::error::{FromServerFnError, ServerFnErrorErr};
use passage_model::ErrorCode;
use serde::{Deserialize, Serialize};

/// What went wrong: the API's own code, passed on, or one of the portal's.
///
/// On the wire (server function answers, the `__err` of a form posted without
/// JavaScript) it is one string, the API's spelling for API codes, so a page hydrates
/// the error the server rendered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "WireCode", into = "WireCode")]
pub enum Code {
    Api(ErrorCode),
    /// The portal's own failure: the API out of reach or answering what it should not,
    /// a form that could not be read.
    Portal,
    /// The session cookie names no live session any more (idle, expired, revoked).
    SessionEnded,
}

#[derive(Clone, Copy, Serialize, Deserialize)]
#[serde(untagged)]
enum WireCode {
    Api(ErrorCode),
    Own(OwnCode),
}

#[derive(Clone, Copy, Serialize, Deserialize)]
enum OwnCode {
    Portal,
    SessionEnded,
}

impl From<WireCode> for Code {
    fn from(w: WireCode) -> Self {
        match w {
            WireCode::Api(c) => Code::Api(c),
            WireCode::Own(OwnCode::Portal) => Code::Portal,
            WireCode::Own(OwnCode::SessionEnded) => Code::SessionEnded,
        }
    }
}

impl From<Code> for WireCode {
    fn from(c: Code) -> Self {
        match c {
            Code::Api(c) => WireCode::Api(c),
            Code::Portal => WireCode::Own(OwnCode::Portal),
            Code::SessionEnded => WireCode::Own(OwnCode::SessionEnded),
        }
    }
}

impl From<ErrorCode> for Code {
    fn from(c: ErrorCode) -> Self {
        Code::Api(c)
    }
}

impl Code {
    /// The heading a person sees above the message.
    pub fn title(self) -> &'static str {
        match self {
            Code::Api(ErrorCode::ResourceNotFound) => "Not found",
            Code::Api(ErrorCode::Forbidden) => "Not allowed",
            Code::Api(ErrorCode::Unauthorized) | Code::SessionEnded => "Signed out",
            Code::Api(ErrorCode::InvalidArgument) => "Please check the form",
            Code::Api(ErrorCode::Conflict) => "Already exists or changed",
            Code::Api(ErrorCode::InsufficientCapacity) => "No capacity",
            Code::Api(ErrorCode::QuotaExceeded) => "Over quota",
            Code::Api(ErrorCode::InvalidState) => "Not possible now",
            Code::Api(ErrorCode::RateLimited) => "Too many attempts",
            Code::Api(ErrorCode::PayloadTooLarge | ErrorCode::InternalError) | Code::Portal => {
                "Something went wrong"
            }
        }
    }

    /// The status a page showing this error answers with, where it is not 200.
    pub fn page_status(self) -> Option<u16> {
        match self {
            Code::Api(c @ (ErrorCode::ResourceNotFound | ErrorCode::Forbidden)) => {
                Some(c.http_status())
            }
            _ => None,
        }
    }

    /// Signing in again is the way out.
    pub fn needs_sign_in(self) -> bool {
        matches!(
            self,
            Code::Api(ErrorCode::Unauthorized) | Code::SessionEnded
        )
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortalError {
    pub code: Code,
    pub message: String,
    /// The form field the message is about, as the API names it.
    pub field: Option<String>,
}

impl PortalError {
    pub fn new(code: impl Into<Code>, message: impl Into<String>) -> Self {
        PortalError {
            code: code.into(),
            message: message.into(),
            field: None,
        }
    }
    /// The portal's own failure.
    pub fn portal(message: impl Into<String>) -> Self {
        Self::new(Code::Portal, message)
    }
    /// A form field's value is wrong; the message goes next to it.
    pub fn invalid(field: &str, message: impl Into<String>) -> Self {
        PortalError {
            code: Code::Api(ErrorCode::InvalidArgument),
            message: message.into(),
            field: Some(field.to_string()),
        }
    }
    pub fn unauthorized() -> Self {
        Self::new(
            ErrorCode::Unauthorized,
            "Your session has ended. Please sign in again.",
        )
    }
    pub fn session_ended() -> Self {
        Self::new(Code::SessionEnded, "Your session has ended. Sign in again.")
    }
    pub fn is(&self, code: ErrorCode) -> bool {
        self.code == Code::Api(code)
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
        PortalError::portal(message)
    }
}

pub type PortalResult<T> = Result<T, PortalError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_travel_as_the_apis_strings() {
        for (code, wire) in [
            (Code::Api(ErrorCode::InvalidArgument), "\"InvalidArgument\""),
            (
                Code::Api(ErrorCode::ResourceNotFound),
                "\"ResourceNotFound\"",
            ),
            (Code::Portal, "\"Portal\""),
            (Code::SessionEnded, "\"SessionEnded\""),
        ] {
            assert_eq!(serde_json::to_string(&code).ok().as_deref(), Some(wire));
            assert_eq!(serde_json::from_str::<Code>(wire).ok(), Some(code));
        }
        assert!(serde_json::from_str::<Code>("\"NoSuchCode\"").is_err());
    }

    #[test]
    fn an_error_round_trips_with_its_field() {
        let e = PortalError::invalid("package", "Choose a package.");
        let json = serde_json::to_string(&e).unwrap_or_default();
        assert_eq!(
            json,
            r#"{"code":"InvalidArgument","message":"Choose a package.","field":"package"}"#
        );
        assert_eq!(serde_json::from_str::<PortalError>(&json).ok(), Some(e));
    }
}
