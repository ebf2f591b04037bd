//! The server's one error type. Its outside face is `{"code","message","field"}` with a
//! stable code; internal detail goes to the log only. [`ErrorResponses`] states that face
//! in the OpenAPI document, once for every call.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use passage_model::{ApiErrorBody, ErrorCode};

#[derive(Debug)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    pub field: Option<String>,
    /// Logged, never sent.
    pub internal: Option<String>,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            field: None,
            internal: None,
        }
    }
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        let field = field.into();
        let message = message.into();
        ApiError {
            code: ErrorCode::InvalidArgument,
            message: format!("{field}: {message}"),
            field: Some(field),
            internal: None,
        }
    }
    /// A body names an object that does not exist (or is not the caller's to see): 404, as
    /// for the object's own URL, with the field that named it.
    pub fn missing(field: impl Into<String>, message: impl Into<String>) -> Self {
        let field = field.into();
        let message = message.into();
        ApiError {
            code: ErrorCode::ResourceNotFound,
            message: format!("{field}: {message}"),
            field: Some(field),
            internal: None,
        }
    }
    pub fn not_found(what: &str) -> Self {
        Self::new(ErrorCode::ResourceNotFound, format!("{what} not found"))
    }
    pub fn unauthorized() -> Self {
        Self::new(
            ErrorCode::Unauthorized,
            "missing, invalid or expired credentials",
        )
    }
    pub fn forbidden() -> Self {
        Self::new(ErrorCode::Forbidden, "your role may not do this")
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Conflict, message)
    }
    pub fn invalid_state(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidState, message)
    }
    pub fn internal(detail: impl Into<String>) -> Self {
        ApiError {
            code: ErrorCode::InternalError,
            message: "internal error".into(),
            field: None,
            internal: Some(detail.into()),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)?;
        if let Some(i) = &self.internal {
            write!(f, " ({i})")?;
        }
        Ok(())
    }
}

impl std::error::Error for ApiError {}

impl From<crate::store::StoreError> for ApiError {
    fn from(e: crate::store::StoreError) -> Self {
        use crate::store::StoreError as S;
        match e {
            S::NotFound(what) => ApiError::not_found(what),
            S::Conflict(m) => ApiError::conflict(m),
            S::Quota(m) => ApiError::new(passage_model::ErrorCode::QuotaExceeded, m),
            S::InvalidState(m) => ApiError::invalid_state(m),
            S::Retry => ApiError::conflict("a concurrent change won; try again"),
            S::NoRoom(m) | S::Exhausted(m) => {
                ApiError::new(passage_model::ErrorCode::InsufficientCapacity, m)
            }
            other => ApiError::internal(other.to_string()),
        }
    }
}

/// A body's field out of bounds: 400 naming it.
impl From<passage_model::decode::BodyError> for ApiError {
    fn from(e: passage_model::decode::BodyError) -> Self {
        ApiError::invalid(e.field, e.message)
    }
}

/// A body's field out of bounds (400), or naming what does not exist (404).
impl From<passage_model::api::Refusal> for ApiError {
    fn from(r: passage_model::api::Refusal) -> Self {
        use passage_model::api::Refusal;
        match r {
            Refusal::Invalid(e) => ApiError::invalid(e.field, e.message),
            Refusal::Missing(e) => ApiError::missing(e.field, e.message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let Some(detail) = &self.internal {
            tracing::error!(code = ?self.code, detail = %detail, "request failed");
        }
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = ApiErrorBody {
            code: self.code,
            message: self.message,
            field: self.field,
        };
        (status, axum::Json(body)).into_response()
    }
}

/// The errors any authenticated call of /v1 may answer, as the OpenAPI document states
/// them: each `#[utoipa::path]` lists its own successes and then this. (500 is left out:
/// no call is meant to answer it.)
#[derive(utoipa::IntoResponses)]
pub enum ErrorResponses {
    #[response(status = 400, description = "Invalid argument (names the field)")]
    InvalidArgument(ApiErrorBody),
    #[response(status = 401, description = "No valid credentials")]
    Unauthorized(ApiErrorBody),
    #[response(status = 403, description = "The caller's role may not do this")]
    Forbidden(ApiErrorBody),
    #[response(status = 404, description = "Not found (or another tenant's)")]
    NotFound(ApiErrorBody),
    #[response(status = 409, description = "Conflict with the current state")]
    Conflict(ApiErrorBody),
    #[response(status = 413, description = "Body too large")]
    PayloadTooLarge(ApiErrorBody),
}
