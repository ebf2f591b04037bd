//! Pieces the pages share.

pub mod errors;
pub mod guard;
pub mod layout;
pub mod list;
pub mod widgets;
