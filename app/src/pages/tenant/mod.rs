pub mod create;
pub mod detail;
pub mod instances;
