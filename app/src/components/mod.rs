//! Pieces the pages share.

pub mod guard;
pub mod layout;
pub mod widgets;
