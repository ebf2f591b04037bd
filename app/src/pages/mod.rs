//! One module per page; `admin/` for operators, `tenant/` for self-service.

pub mod admin;
pub mod home;
pub mod login;
pub mod not_found;
pub mod tenant;
