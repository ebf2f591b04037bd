//! The bodies of the `cargo fuzz` targets in `fuzz/` (`cargo xtask fuzz-parsers` runs
//! them), kept here so that ordinary tests run them too. Each takes any bytes, must not
//! panic, and asserts what must hold of whatever it accepts: a panic here is the fuzzer's
//! signal of a bug, hence the `expect`s.
#![allow(clippy::expect_used)]

use crate::decode::json_object;
use crate::pci::{DevicePath, HexId, PciAddress, PciClass, PciDevice, Revision};
use crate::protocol::{
    Heartbeat, HeartbeatResponse, InventoryReport, RegisterRequest, RegisterResponse, TaskEnvelope,
    TaskResult, TaskResults, TaskResultsAnswer,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt::{Debug, Display};
use std::str::FromStr;

/// What is accepted prints back to the same value.
fn text_roundtrip<T>(s: &str)
where
    T: FromStr + Display + PartialEq + Debug,
    T::Err: Debug,
{
    if let Ok(v) = s.parse::<T>() {
        let shown = v.to_string();
        let again = shown
            .parse::<T>()
            .expect("what was accepted is accepted again as printed");
        assert_eq!(again, v, "{s:?} printed as {shown:?}");
    }
}

/// The PCI text parsers (addresses, device paths, ids, revisions, classes) on any text,
/// and a PCI function as an agent's report carries it.
pub fn pci_parsers(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    for s in std::iter::once(text.as_ref()).chain(text.lines()) {
        text_roundtrip::<PciAddress>(s);
        text_roundtrip::<DevicePath>(s);
        text_roundtrip::<HexId>(s);
        text_roundtrip::<Revision>(s);
        text_roundtrip::<PciClass>(s);
        if let Ok(p) = s.parse::<DevicePath>() {
            // The address is the path's last component, so it must parse on its own.
            let a = p.address();
            assert_eq!(a.to_string().parse::<PciAddress>().ok(), Some(a));
        }
    }
    json_roundtrip(json_object::<PciDevice>(data));
}

/// Serialising what was decoded and decoding it again gives the same value.
fn json_roundtrip<T, E>(decoded: Result<T, E>)
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    if let Ok(v) = decoded {
        let bytes = serde_json::to_vec(&v).expect("an accepted message serialises");
        let again: T = serde_json::from_slice(&bytes).expect("and decodes again");
        assert_eq!(again, v);
    }
}

/// Every message of the agent protocol, from any bytes: the agent's requests as the
/// server decodes them, the server's answers as the agent decodes them.
pub fn agent_messages(data: &[u8]) {
    json_roundtrip(json_object::<RegisterRequest>(data));
    json_roundtrip(json_object::<Heartbeat>(data));
    json_roundtrip(json_object::<InventoryReport>(data));
    json_roundtrip(json_object::<TaskResult>(data));
    json_roundtrip(json_object::<TaskResults>(data));
    json_roundtrip(serde_json::from_slice::<TaskResultsAnswer>(data));
    json_roundtrip(serde_json::from_slice::<RegisterResponse>(data));
    json_roundtrip(serde_json::from_slice::<HeartbeatResponse>(data));
    json_roundtrip(serde_json::from_slice::<TaskEnvelope>(data));
    json_roundtrip(serde_json::from_slice::<Vec<TaskEnvelope>>(data));
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    /// Seeds: valid messages and near misses, the shapes the fuzzer starts from.
    const SEEDS: &[&str] = &[
        "0000:3b:00.0",
        "10000000:3b:1f.7",
        "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0",
        "/devices/pci0000:3a/0000:3a:00.0/../0000:3b:00.0",
        "10de",
        "a1",
        "030200",
        r#"{"id":"/devices/pci0000:00/0000:00:01.0/0000:01:00.0","vendor":"10de","device":"2330","subvendor":"10de","subsystem":"16c1","revision":"a1","class":"030200","driver":"nvidia","numa_node":0,"iommu_group":1}"#,
        r#"{"join_token":"psj_x","hostname":"cn-1","agent_version":"1","protocol_version":1}"#,
        r#"{"running_vms":[]}"#,
        r#"{"devices":[]}"#,
        r#"{"ok":true}"#,
        r#"{"ok":false,"error":"no"}"#,
        r#"{"results":[{"task":"3f2a6c1e-8a4b-4c7d-9e2f-1a2b3c4d5e6f","result":{"ok":true}}]}"#,
        r#"{"refused":[{"task":"3f2a6c1e-8a4b-4c7d-9e2f-1a2b3c4d5e6f","error":{"code":"Conflict","message":"the task already has a result"}}],"tasks":[]}"#,
        r#"{"id":"3f2a6c1e-8a4b-4c7d-9e2f-1a2b3c4d5e6f","task":{"type":"start_vm","vm":{"uuid":"3f2a6c1e-8a4b-4c7d-9e2f-1a2b3c4d5e6f","vcpus":8,"memory_mib":65536,"devices":["/devices/pci0000:00/0000:00:01.0/0000:01:00.0"]}}}"#,
    ];

    #[test]
    fn the_harnesses_take_their_seeds() {
        for s in SEEDS {
            super::pci_parsers(s.as_bytes());
            super::agent_messages(s.as_bytes());
        }
    }

    proptest! {
        #[test]
        fn the_harnesses_take_any_bytes(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            super::pci_parsers(&data);
            super::agent_messages(&data);
        }

        #[test]
        fn the_harnesses_take_mangled_seeds(i in 0..SEEDS.len(), at in 0usize..400, b in any::<u8>()) {
            let mut data = SEEDS[i].as_bytes().to_vec();
            let at = at % (data.len() + 1);
            data.insert(at, b);
            super::pci_parsers(&data);
            super::agent_messages(&data);
            data.remove(at);
            if !data.is_empty() {
                data.remove(at % data.len());
            }
            super::pci_parsers(&data);
            super::agent_messages(&data);
        }
    }
}
