//! A VM's network on the node: the Linux bridges VMs can attach to, read from sysfs as
//! the kernel shows them (`class/net/<name>/bridge/` is a directory for a bridge), and one
//! persistent tap per NIC, made and removed through iproute2's `ip` and `bridge`
//! commands, the host boundary here as sysfs is for devices.
//!
//! Taps are named `psg` + the last 11 hex digits of the VM's uuid + the NIC's index in one
//! hex digit (15 bytes, Linux's limit). The tail of the uuid, because
//! [`VmId::new_ordered`] puts the clock in its first digits: VMs made in the same
//! millisecond differ only at the end. The prefix is how an agent recognises its own taps
//! after a restart, to remove those whose VM is gone.

pub mod nft;

use passage_model::VmId;
use passage_model::protocol::{MAX_BRIDGES, MAX_NICS, NicSpec};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The host's own sysfs, where real taps and bridges are, whatever tree PCI devices are
/// read from.
pub const HOST_SYSFS: &str = "/sys";
pub const TAP_PREFIX: &str = "psg";
/// Linux's limit on an interface name (IFNAMSIZ less the terminating NUL).
const MAX_IFNAME_LEN: usize = 15;
const UUID_DIGITS: usize = MAX_IFNAME_LEN - TAP_PREFIX.len() - 1;
// One hex digit numbers a VM's NICs in its taps' names.
const _: () = assert!(MAX_NICS <= 16);
pub const IP_BINARY: &str = "ip";
pub const BRIDGE_BINARY: &str = "bridge";

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("NIC {index}: {field}: {message}")]
    InvalidNic {
        index: usize,
        field: &'static str,
        message: String,
    },
    #[error("{count} NICs; a VM has at most {MAX_NICS}")]
    TooManyNics { count: usize },
    #[error("bridge {0} does not exist on this node")]
    NoBridge(String),
    #[error(
        "NIC {index} is on VLAN {vlan}, but bridge {bridge} has VLAN filtering off (or this \
         kernel has none); the agent does not change the operator's bridge: turn it on \
         (`ip link set dev {bridge} type bridge vlan_filtering 1`) or use an untagged network"
    )]
    VlanFilteringOff {
        index: usize,
        vlan: u16,
        bridge: String,
    },
    #[error("{0} is not installed here (Debian: iproute2); VMs with NICs cannot start")]
    NotInstalled(&'static str),
    #[error("tap {tap} is already VM {other}'s")]
    TapInUse { tap: String, other: VmId },
    #[error("`{command}` failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
}

/// The bridges of a sysfs tree, with what was left out and why.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bridges {
    /// Sorted, without duplicates, at most [`MAX_BRIDGES`].
    pub names: Vec<String>,
    pub notes: Vec<String>,
}

fn class_net(sysfs_root: &Path) -> PathBuf {
    sysfs_root.join("class/net")
}

/// The bridges under `sysfs_root/class/net`. A tree without `class/net` has none; one whose
/// `class/net` cannot be listed is an error (the caller then cannot tell). An entry that
/// cannot be read, or whose name no network could name, is left out with a note.
pub fn bridges(sysfs_root: &Path) -> io::Result<Bridges> {
    let dir = class_net(sysfs_root);
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Bridges::default()),
        Err(e) => return Err(e),
    };
    let mut out = Bridges::default();
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                out.notes.push(format!("{}: {e}", dir.display()));
                continue;
            }
        };
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            out.notes.push(format!(
                "{}: not UTF-8",
                entry.file_name().to_string_lossy()
            ));
            continue;
        };
        // `class/net/X` is a symlink into `devices/`: metadata follows it.
        match fs::metadata(entry.path().join("bridge")) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                out.notes.push(format!("{name}: {e}"));
                continue;
            }
        }
        // A name the control plane would refuse for a network could never be used.
        if let Err(e) = passage_model::networks::check_bridge(&name) {
            out.notes
                .push(format!("bridge {name:?} left out: {}", e.message));
            continue;
        }
        out.names.push(name);
    }
    out.names.sort();
    out.names.dedup();
    if out.names.len() > MAX_BRIDGES {
        out.notes.push(format!(
            "{} bridges; reporting the first {MAX_BRIDGES}",
            out.names.len()
        ));
        out.names.truncate(MAX_BRIDGES);
    }
    Ok(out)
}

pub fn bridge_exists(sysfs_root: &Path, bridge: &str) -> bool {
    class_net(sysfs_root).join(bridge).join("bridge").is_dir()
}

fn link_exists(sysfs_root: &Path, name: &str) -> bool {
    fs::symlink_metadata(class_net(sysfs_root).join(name)).is_ok()
}

/// A bridge attribute as a number; absent (a kernel without the feature) is `None`.
fn bridge_attr(sysfs_root: &Path, bridge: &str, attr: &str) -> Result<Option<u32>, NetError> {
    let path = class_net(sysfs_root).join(bridge).join("bridge").join(attr);
    match crate::host::read_attr(&path) {
        Ok(v) => v.trim().parse().map(Some).map_err(|_| NetError::Read {
            source: io::Error::new(io::ErrorKind::InvalidData, format!("{v:?}")),
            path,
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(NetError::Read { path, source }),
    }
}

/// The name of the tap for NIC `index` of `vm`.
pub fn tap_name(vm: VmId, index: usize) -> String {
    let hex = vm.0.simple().to_string();
    let tail = &hex[hex.len() - UUID_DIGITS..];
    format!("{TAP_PREFIX}{tail}{:x}", index % 16)
}

/// Whether an interface name is one [`tap_name`] makes.
pub fn is_our_tap(name: &str) -> bool {
    name.len() == MAX_IFNAME_LEN
        && name.strip_prefix(TAP_PREFIX).is_some_and(|rest| {
            rest.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
}

/// The taps of this node that [`tap_name`] made, sorted.
pub fn our_taps(sysfs_root: &Path) -> io::Result<Vec<String>> {
    let dir = class_net(sysfs_root);
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut taps: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| is_our_tap(n))
        .collect();
    taps.sort();
    Ok(taps)
}

/// Every NIC valid, and its bridge on this node (in VLAN-filtering mode when the NIC is
/// tagged and `vlans` asks for it): all checked before anything on the host changes, so a
/// refused VM leaves nothing behind.
pub fn check_nics(sysfs_root: &Path, nics: &[NicSpec], vlans: bool) -> Result<(), NetError> {
    validate_nics(nics)?;
    for (index, nic) in nics.iter().enumerate() {
        if !bridge_exists(sysfs_root, &nic.bridge) {
            return Err(NetError::NoBridge(nic.bridge.clone()));
        }
        if vlans
            && nic.vlan_id != 0
            && bridge_attr(sysfs_root, &nic.bridge, "vlan_filtering")?.unwrap_or(0) == 0
        {
            return Err(NetError::VlanFilteringOff {
                index,
                vlan: nic.vlan_id,
                bridge: nic.bridge.clone(),
            });
        }
    }
    Ok(())
}

/// Every NIC as [`NicSpec::validate`] wants it, and not too many.
pub fn validate_nics(nics: &[NicSpec]) -> Result<(), NetError> {
    if nics.len() > MAX_NICS {
        return Err(NetError::TooManyNics { count: nics.len() });
    }
    for (index, nic) in nics.iter().enumerate() {
        nic.validate()
            .map_err(|(field, message)| NetError::InvalidNic {
                index,
                field,
                message,
            })?;
    }
    Ok(())
}

fn run(binary: &'static str, args: &[&str]) -> Result<(), NetError> {
    let out = Command::new(binary).args(args).output().map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            NetError::NotInstalled(binary)
        } else {
            NetError::Command {
                command: format!("{binary} {}", args.join(" ")),
                stderr: e.to_string(),
            }
        }
    })?;
    if out.status.success() {
        return Ok(());
    }
    Err(NetError::Command {
        command: format!("{binary} {}", args.join(" ")),
        stderr: format!(
            "{} ({})",
            String::from_utf8_lossy(&out.stderr).trim(),
            out.status
        ),
    })
}

/// Makes `tap` for `nic`: persistent (it outlives a QEMU that exits, until
/// [`remove_tap`]), with the NIC's MTU, a port of its bridge (untagged member of its VLAN
/// only, when it has one), up. A tap of that name already there is a leftover of an
/// earlier try for the same VM, and is made again. Half-made, it is removed again.
pub fn create_tap(sysfs_root: &Path, tap: &str, nic: &NicSpec) -> Result<(), NetError> {
    remove_tap(sysfs_root, tap)?;
    run(IP_BINARY, &["tuntap", "add", "dev", tap, "mode", "tap"])?;
    let rest = configure_tap(sysfs_root, tap, nic);
    if rest.is_err()
        && let Err(e) = remove_tap(sysfs_root, tap)
    {
        tracing::warn!(tap, error = %e, "could not remove a half-made tap");
    }
    rest
}

fn configure_tap(sysfs_root: &Path, tap: &str, nic: &NicSpec) -> Result<(), NetError> {
    let mtu = nic.mtu.to_string();
    run(
        IP_BINARY,
        &[
            "link",
            "set",
            "dev",
            tap,
            "mtu",
            &mtu,
            "master",
            &nic.bridge,
        ],
    )?;
    if nic.vlan_id != 0 {
        let vid = nic.vlan_id.to_string();
        run(
            BRIDGE_BINARY,
            &["vlan", "add", "dev", tap, "vid", &vid, "pvid", "untagged"],
        )?;
        // A new port also joins the bridge's default VLAN: the guest would see that
        // VLAN's traffic too.
        if let Some(default) = bridge_attr(sysfs_root, &nic.bridge, "default_pvid")?
            && default != 0
            && default != u32::from(nic.vlan_id)
        {
            let default = default.to_string();
            run(BRIDGE_BINARY, &["vlan", "del", "dev", tap, "vid", &default])?;
        }
    }
    run(IP_BINARY, &["link", "set", "dev", tap, "up"])
}

/// Removes `tap`; one that is not there is already removed.
pub fn remove_tap(sysfs_root: &Path, tap: &str) -> Result<(), NetError> {
    if !link_exists(sysfs_root, tap) {
        return Ok(());
    }
    match run(IP_BINARY, &["link", "del", "dev", tap]) {
        // Gone meanwhile (another remover, or QEMU's exit took it).
        Err(_) if !link_exists(sysfs_root, tap) => Ok(()),
        r => r,
    }
}

/// The routing table, and the priority of the rule that sends to it, for the metadata
/// service's answers (`from 169.254.169.254`): one on-link default per bridge, so an answer
/// goes straight to the guest on the bridge its listener is bound to, even when the host
/// has no address in the guest's subnet or routes it through a gateway on that bridge.
pub const METADATA_TABLE: &str = "16925";

/// The bridge `iface` is a port of, if any (`class/net/<iface>/master`).
pub fn master_of(sysfs_root: &Path, iface: &str) -> Option<String> {
    let link = fs::read_link(class_net(sysfs_root).join(iface).join("master")).ok()?;
    link.file_name()?.to_str().map(str::to_string)
}

/// A bridge's own MAC address, as sysfs shows it (lower-case hex octets).
pub fn link_mac(sysfs_root: &Path, iface: &str) -> Result<String, NetError> {
    let path = class_net(sysfs_root).join(iface).join("address");
    crate::host::read_attr(&path)
        .map(|v| v.trim().to_ascii_lowercase())
        .map_err(|source| NetError::Read { path, source })
}

/// Makes `bridge` answer for the metadata address: 169.254.169.254/32 on it (link scope,
/// so the host never picks it as a source elsewhere) and its on-link default in
/// [`METADATA_TABLE`]. Both `replace`, so doing it again changes nothing.
pub fn prepare_metadata_bridge(sysfs_root: &Path, bridge: &str) -> Result<(), NetError> {
    let addr = format!("{}/32", nft::METADATA_ADDR);
    run(
        IP_BINARY,
        &["addr", "replace", &addr, "dev", bridge, "scope", "link"],
    )?;
    let path = class_net(sysfs_root).join(bridge).join("ifindex");
    let ifindex =
        crate::host::read_attr(&path).map_err(|source| NetError::Read { path, source })?;
    // One default per bridge in the same table, told apart by their metric; a listener
    // bound to its bridge finds its own (the others' device does not match).
    run(
        IP_BINARY,
        &[
            "route",
            "replace",
            "default",
            "dev",
            bridge,
            "table",
            METADATA_TABLE,
            "metric",
            ifindex.trim(),
            "scope",
            "link",
        ],
    )
}

/// The rule that sends the metadata service's answers to [`METADATA_TABLE`], unless there.
pub fn ensure_metadata_rule() -> Result<(), NetError> {
    let out = Command::new(IP_BINARY)
        .args(["rule", "show", "priority", METADATA_TABLE])
        .output()
        .map_err(|e| NetError::Command {
            command: format!("{IP_BINARY} rule show"),
            stderr: e.to_string(),
        })?;
    if out.status.success() && !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
        return Ok(());
    }
    let from = nft::METADATA_ADDR.to_string();
    run(
        IP_BINARY,
        &[
            "rule",
            "add",
            "from",
            &from,
            "lookup",
            METADATA_TABLE,
            "priority",
            METADATA_TABLE,
        ],
    )
}

/// Removes every tap named for `vm`, whatever NICs its spec had; logs what fails.
pub fn remove_vm_taps(sysfs_root: &Path, vm: VmId) {
    for i in 0..MAX_NICS {
        let tap = tap_name(vm, i);
        match remove_tap(sysfs_root, &tap) {
            Ok(()) => {}
            Err(e) => tracing::warn!(vm = %vm, tap, error = %e, "could not remove a VM's tap"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tap_names_fit_and_are_recognised() {
        let a: VmId = "0190f3c4-7a2b-7c3d-8e4f-a1b2c3d4e5f6".parse().unwrap();
        assert_eq!(tap_name(a, 0), "psg1b2c3d4e5f60");
        assert_eq!(tap_name(a, 7), "psg1b2c3d4e5f67");
        for i in 0..MAX_NICS {
            let n = tap_name(VmId::new_ordered(), i);
            assert_eq!(n.len(), 15, "{n}");
            assert!(is_our_tap(&n), "{n}");
        }
        // Two VMs made in the same millisecond differ in their taps.
        let (x, y) = (VmId::new_ordered(), VmId::new_ordered());
        assert_ne!(tap_name(x, 0), tap_name(y, 0));
        for other in [
            "br0",
            "eth0",
            "psg",
            "psg2b3c4d4e5f6",
            "psgXb3c4d4e5f60",
            "tap0",
        ] {
            assert!(!is_our_tap(other), "{other}");
        }
    }

    fn mk(root: &Path, name: &str, bridge: bool) {
        let dir = root.join("devices/virtual/net").join(name);
        fs::create_dir_all(&dir).unwrap();
        if bridge {
            fs::create_dir_all(dir.join("bridge")).unwrap();
        }
        fs::create_dir_all(root.join("class/net")).unwrap();
        std::os::unix::fs::symlink(
            format!("../../devices/virtual/net/{name}"),
            root.join("class/net").join(name),
        )
        .unwrap();
    }

    #[test]
    fn bridges_are_sorted_and_only_bridges() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        assert_eq!(bridges(root).unwrap(), Bridges::default());
        mk(root, "lo", false);
        mk(root, "vmbr1", true);
        mk(root, "br0", true);
        mk(root, "psg0000000000a0", false);
        // A dangling link, as an interface removed mid-walk leaves.
        std::os::unix::fs::symlink(
            "../../devices/virtual/net/gone",
            root.join("class/net/gone"),
        )
        .unwrap();
        let b = bridges(root).unwrap();
        assert_eq!(b.names, ["br0", "vmbr1"]);
        assert!(b.notes.is_empty(), "{:?}", b.notes);
        assert_eq!(our_taps(root).unwrap(), ["psg0000000000a0"]);
        assert!(bridge_exists(root, "br0") && !bridge_exists(root, "lo"));
    }

    fn nic(bridge: &str, vlan_id: u16) -> NicSpec {
        NicSpec {
            mac: "02:00:00:00:00:01".into(),
            ip: "192.0.2.10".parse().unwrap(),
            prefix_len: 24,
            gateway: None,
            resolvers: Vec::new(),
            bridge: bridge.into(),
            vlan_id,
            mtu: 1500,
            primary: true,
        }
    }

    #[test]
    fn nics_are_checked_before_anything_is_made() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        mk(root, "br0", true);
        check_nics(root, &[nic("br0", 0)], true).unwrap();
        let e = check_nics(root, &[nic("br0", 0), nic("br7", 0)], true).unwrap_err();
        assert_eq!(e.to_string(), "bridge br7 does not exist on this node");
        let mut bad = nic("br0", 0);
        bad.mtu = 10;
        let e = check_nics(root, &[bad], true).unwrap_err().to_string();
        assert!(e.starts_with("NIC 0: mtu:"), "{e}");
        // No vlan_filtering attribute: a kernel without it.
        let e = check_nics(root, &[nic("br0", 10)], true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("VLAN filtering off"), "{e}");
        check_nics(root, &[nic("br0", 10)], false).unwrap();
        fs::write(root.join("class/net/br0/bridge/vlan_filtering"), "1\n").unwrap();
        check_nics(root, &[nic("br0", 10)], true).unwrap();
        let many = vec![nic("br0", 0); MAX_NICS + 1];
        assert!(matches!(
            check_nics(root, &many, true),
            Err(NetError::TooManyNics { .. })
        ));
    }
}
