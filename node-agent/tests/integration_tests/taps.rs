//! VMs' NICs through the real QEMU backend (TCG, no disk), inside a network namespace the
//! test makes with bridges in it: a persistent tap per NIC on its bridge with its MTU (and
//! VLAN), QEMU's NICs on those taps with their MACs, the taps gone once the VM stops or
//! its launch fails, a NIC on a missing bridge refused before anything is made, and a
//! restarted agent keeping a running VM's taps while removing an orphan of its own.
//!
//! Bridge VLAN filtering needs a kernel built with it; without it the tagged case is
//! skipped with a note (the refusal on a bridge with filtering off is still tested).

use super::netns::{self, NetNs};
use super::qemu::qemu;
use node_agent::hypervisor::{Hypervisor, QemuHypervisor, VmFiles, qmp::Qmp};
use node_agent::net::{HOST_SYSFS, our_taps, tap_name};
use passage_model::VmId;
use passage_model::protocol::{NicSpec, VmSpec};
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const BR_A: &str = "pstbra";
const BR_B: &str = "pstbrb";
const BR_VLAN: &str = "pstbrv";

fn nic(mac: &str, bridge: &str, mtu: u32, primary: bool) -> NicSpec {
    NicSpec {
        mac: mac.into(),
        ip: "192.0.2.10".parse().unwrap(),
        prefix_len: 24,
        gateway: None,
        resolvers: Vec::new(),
        bridge: bridge.into(),
        vlan_id: 0,
        mtu,
        primary,
    }
}

fn spec(nics: Vec<NicSpec>) -> VmSpec {
    VmSpec {
        // As the control plane makes them: the clock first.
        uuid: VmId::new_ordered(),
        vcpus: 1,
        memory_mib: 64,
        devices: Vec::new(),
        disk: None,
        nics,
        cloud_init: None,
        bootrom: None,
    }
}

/// `ip -d -j link show dev NAME` inside this namespace.
fn link(name: &str) -> Value {
    let o = Command::new("ip")
        .args(["-d", "-j", "link", "show", "dev", name])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    v[0].clone()
}

fn taps_here() -> Vec<String> {
    our_taps(Path::new(HOST_SYSFS)).unwrap()
}

fn assert_tap(tap: &str, bridge: &str, mtu: u64) {
    let l = link(tap);
    assert_eq!(l["master"], bridge, "{l}");
    assert_eq!(l["mtu"], mtu, "{l}");
    assert_eq!(l["linkinfo"]["info_data"]["type"], "tap", "{l}");
    assert_eq!(l["linkinfo"]["info_data"]["persist"], true, "{l}");
    let flags: Vec<&str> = l["flags"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(flags.contains(&"UP"), "{l}");
}

/// QEMU's own account of its NICs: each virtio-net device's MAC, and the tap under it.
fn info_network(state: &Path, vm: VmId) -> String {
    let mut q = Qmp::connect(&VmFiles::new(state, vm).qmp, Duration::from_secs(5)).unwrap();
    let out = q
        .execute(
            "human-monitor-command",
            Some(serde_json::json!({"command-line": "info network"})),
        )
        .unwrap();
    out.as_str().unwrap().to_string()
}

#[test]
fn taps_on_bridges() {
    if netns::inside().is_some() {
        return taps_on_bridges_inside();
    }
    if qemu().is_none() {
        return;
    }
    let Some(ns) = NetNs::new("taps") else { return };
    ns.ip_ok(&["link", "add", BR_A, "type", "bridge"]);
    ns.ip_ok(&["link", "add", BR_B, "type", "bridge"]);
    // Where the kernel has bridge VLAN filtering; the test inside looks for this bridge.
    let vlan = ns.ip(&[
        "link",
        "add",
        BR_VLAN,
        "type",
        "bridge",
        "vlan_filtering",
        "1",
    ]);
    if !vlan.status.success() {
        eprintln!(
            "note: this kernel has no bridge VLAN filtering ({}); the tagged NIC case is skipped",
            String::from_utf8_lossy(&vlan.stderr).trim()
        );
    }
    ns.run_test(&netns::test_name(module_path!(), "taps_on_bridges"));
}

fn taps_on_bridges_inside() {
    let cfg = qemu().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let h = QemuHypervisor::open(cfg.clone(), state).unwrap();
    let _stop = super::StopOnDrop(&h);
    // Opened now: opening removes the taps of ours that its own state dir does not run,
    // as an agent restarting on this node would.
    let mut broken = cfg.clone();
    broken.accel = "no-such-accelerator".into();
    let hb = QemuHypervisor::open(broken, &state.join("broken")).unwrap();

    // Two NICs on two bridges, with their own MTUs.
    let s = spec(vec![
        nic("02:00:5e:10:00:01", BR_A, 1500, true),
        nic("02:00:5e:10:00:02", BR_B, 1400, false),
    ]);
    let (tap0, tap1) = (tap_name(s.uuid, 0), tap_name(s.uuid, 1));
    h.start(&s).unwrap();
    assert_tap(&tap0, BR_A, 1500);
    assert_tap(&tap1, BR_B, 1400);
    let info = info_network(state, s.uuid);
    let mac0 = info.find("macaddr=02:00:5e:10:00:01");
    let mac1 = info.find("macaddr=02:00:5e:10:00:02");
    assert!(
        mac0.is_some() && mac1.is_some() && mac0 < mac1,
        "the primary NIC first: {info}"
    );
    assert!(info.contains(&format!("ifname={tap0}")), "{info}");
    assert!(info.contains(&format!("ifname={tap1}")), "{info}");

    // A NIC on a bridge this node lacks: refused before anything is made, even the tap
    // of the NIC before it.
    let missing = spec(vec![
        nic("02:00:5e:10:00:03", BR_A, 1500, true),
        nic("02:00:5e:10:00:04", "br7", 1500, false),
    ]);
    let e = h.start(&missing).unwrap_err().to_string();
    assert!(e.contains("bridge br7 does not exist on this node"), "{e}");
    // A tagged NIC on a bridge with VLAN filtering off: refused, the bridge untouched.
    let mut tagged = nic("02:00:5e:10:00:05", BR_A, 1500, true);
    tagged.vlan_id = 10;
    let e = h
        .start(&spec(vec![tagged.clone()]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("VLAN filtering off"), "{e}");
    assert_eq!(
        link(BR_A)["linkinfo"]["info_data"]["vlan_filtering"],
        0,
        "the bridge was changed"
    );
    assert_eq!(taps_here(), [tap0.clone(), tap1.clone()]);

    // A launch that fails once the taps are made (QEMU refuses to start): they go too.
    let failing = spec(vec![nic("02:00:5e:10:00:06", BR_A, 1500, true)]);
    let e = hb.start(&failing).unwrap_err().to_string();
    assert!(e.contains("launch failed"), "{e}");
    assert!(!taps_here().contains(&tap_name(failing.uuid, 0)));

    if Path::new(HOST_SYSFS)
        .join("class/net")
        .join(BR_VLAN)
        .exists()
    {
        tagged.bridge = BR_VLAN.into();
        let v = spec(vec![tagged]);
        h.start(&v).unwrap();
        let tap = tap_name(v.uuid, 0);
        assert_tap(&tap, BR_VLAN, 1500);
        let o = Command::new("bridge")
            .args(["-j", "vlan", "show", "dev", &tap])
            .output()
            .unwrap();
        let shown: Value = serde_json::from_slice(&o.stdout).unwrap();
        let vlans = &shown[0]["vlans"];
        assert_eq!(
            vlans,
            &serde_json::json!([{"vlan": 10, "flags": ["PVID", "Egress Untagged"]}]),
            "only VLAN 10, untagged: {shown}"
        );
        h.stop(v.uuid).unwrap();
        assert!(!taps_here().contains(&tap));
    } else {
        eprintln!("note: SKIPPED: the tagged NIC case (no bridge VLAN filtering here)");
    }

    // An agent restart: the running VM keeps its taps; an orphan of ours (a VM that is
    // not running) is removed, an interface not of ours is not.
    let orphan = tap_name(VmId::new_ordered(), 0);
    for tap in [orphan.as_str(), "pstkeep0"] {
        let o = Command::new("ip")
            .args(["tuntap", "add", "dev", tap, "mode", "tap"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert!(taps_here().contains(&orphan));
    let again = QemuHypervisor::open(cfg, state).unwrap();
    assert_eq!(again.running(), vec![s.uuid]);
    assert_eq!(taps_here(), [tap0.clone(), tap1.clone()]);
    assert_tap(&tap0, BR_A, 1500);
    assert!(Path::new(HOST_SYSFS).join("class/net/pstkeep0").exists());

    // Stopped: its taps are gone.
    again.stop(s.uuid).unwrap();
    assert!(taps_here().is_empty(), "{:?}", taps_here());
    h.stop(s.uuid).unwrap(); // the first instance: already stopped, nothing left to do
}
