//! The node agent's integration tests, built as one binary (the omicron layout): each
//! file of `integration_tests/` is a module.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod integration_tests;
