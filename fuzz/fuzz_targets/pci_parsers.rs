//! PCI addresses, device paths, ids and reported functions from any bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| passage_model::fuzzing::pci_parsers(data));
