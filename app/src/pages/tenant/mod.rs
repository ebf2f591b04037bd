pub mod create;
pub mod detail;
pub mod instances;
pub mod keys;
pub mod terminal;
