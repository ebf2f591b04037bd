//! The outside face of every error: a stable code, an HTTP status, a message safe for tenants.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub enum ErrorCode {
    InvalidArgument,
    Unauthorized,
    Forbidden,
    ResourceNotFound,
    Conflict,
    InsufficientCapacity,
    QuotaExceeded,
    InvalidState,
    PayloadTooLarge,
    /// Too many failed logins from this address or for this login: try again later.
    RateLimited,
    InternalError,
}

impl ErrorCode {
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidArgument => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::ResourceNotFound => 404,
            ErrorCode::Conflict
            | ErrorCode::InsufficientCapacity
            | ErrorCode::QuotaExceeded
            | ErrorCode::InvalidState => 409,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::RateLimited => 429,
            ErrorCode::InternalError => 500,
        }
    }
}

/// `{"code": "...", "message": "..."}`, plus the offending field for 400s.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ApiErrorBody {
    pub code: ErrorCode,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}
