//! Every message of the agent protocol, both ways, from any bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| passage_model::fuzzing::agent_messages(data));
