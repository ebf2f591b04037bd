//! The server's integration tests, built as one binary: one link of the server, the
//! agent and the harness instead of one per file (the omicron layout). Each file of
//! `integration_tests/` is a module; `common` is the harness they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;
mod integration_tests;
