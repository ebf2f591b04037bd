//! Passage's own nftables table, `bridge passage`: the only rules the agent makes, in the
//! bridge family, so they see each frame with the port (tap) it came in on or leaves by.
//! The table is written whole from what the agent knows (its taps and their listeners) in
//! one `nft -f` transaction, which replaces the table it made before and touches no other.
//! A restarted agent writes it again from its VMs, so a tap gone meanwhile loses its rules.
//!
//! Layout (anti-spoofing and the firewall add their rules to the same per-tap chains):
//!
//! - set `taps`: every tap of ours;
//! - chain `prerouting` (hook prerouting, first): `iifname vmap` jumps to `in-<tap>`; from
//!   any other port, IPv4 to the metadata address is dropped (a host on the bridge's
//!   uplink cannot reach a VM's listener);
//! - chain `postrouting` (hook postrouting, last): `oifname vmap` jumps to `out-<tap>`; to
//!   any other port, IPv4 and ARP from the metadata address are dropped (the address and
//!   the answers never leave the node);
//! - chain `in-<tap>`: TCP to 169.254.169.254:80 is sent to the host (the bridge's own MAC,
//!   whatever gateway the guest routed it to) at the tap's own port; any other IPv4 to
//!   the metadata address is dropped, so a guest cannot reach another VM's port;
//! - chain `out-<tap>`: TCP from the tap's port is given port 80 back; any other IPv4
//!   from the metadata address is dropped (an answer flooded to every port reaches only
//!   its own guest).
//!
//! The rewrites are stateless (no conntrack): the kernel fixes the TCP checksum when a
//! port is set (checked with real traffic by the namespace test).

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

pub const NFT_BINARY: &str = "nft";
/// The table's family and name.
pub const TABLE: &str = "bridge passage";
/// The address guests ask for their metadata, as on EC2 and OpenStack.
pub const METADATA_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// The port guests connect to.
pub const METADATA_PORT: u16 = 80;

/// One tap's metadata redirect: frames from the guest on `tap` to port 80 go to `port` on
/// the host, addressed to `bridge_mac` (the bridge's own address, so the bridge hands
/// them up to the host).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct TapRule {
    pub tap: String,
    pub port: u16,
    /// Six lower-case hex octets joined by ':'.
    pub bridge_mac: String,
}

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("nft is not installed here (Debian: nftables); the metadata service is off")]
    NotInstalled,
    #[error("`nft -f -` failed: {0}")]
    Failed(String),
    #[error("{0}")]
    Invalid(String),
}

/// Whether `name` could be an interface name that nft reads back as written.
fn plain_ifname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 15
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

fn plain_mac(mac: &str) -> bool {
    passage_model::networks::parse_mac(mac).is_ok() && mac.len() == 17
}

/// The table's whole text for `rules` (each tap once): a script for `nft -f`, which
/// creates the table if missing, deletes it and writes it again, all in one transaction.
pub fn render(rules: &[TapRule]) -> Result<String, NftError> {
    for r in rules {
        if !plain_ifname(&r.tap) {
            return Err(NftError::Invalid(format!("tap name {:?}", r.tap)));
        }
        if !plain_mac(&r.bridge_mac) {
            return Err(NftError::Invalid(format!("bridge MAC {:?}", r.bridge_mac)));
        }
        if r.port == 0 {
            return Err(NftError::Invalid(format!("port 0 for {}", r.tap)));
        }
    }
    let addr = METADATA_ADDR;
    let mut s = String::new();
    // `add` makes the table if it is not there, so the `delete` that follows never fails.
    let _ = writeln!(s, "add table {TABLE}");
    let _ = writeln!(s, "delete table {TABLE}");
    let _ = writeln!(s, "table {TABLE} {{");
    let _ = writeln!(s, "  set taps {{");
    let _ = writeln!(s, "    type ifname;");
    if !rules.is_empty() {
        let names: Vec<String> = rules.iter().map(|r| format!("\"{}\"", r.tap)).collect();
        let _ = writeln!(s, "    elements = {{ {} }};", names.join(", "));
    }
    let _ = writeln!(s, "  }}");
    let vmap = |dir: &str| -> String {
        rules
            .iter()
            .map(|r| format!("\"{}\" : jump {dir}-{}", r.tap, r.tap))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(s, "  chain prerouting {{");
    let _ = writeln!(
        s,
        "    type filter hook prerouting priority -300; policy accept;"
    );
    if !rules.is_empty() {
        let _ = writeln!(s, "    iifname vmap {{ {} }}", vmap("in"));
    }
    let _ = writeln!(s, "    iifname != @taps ether type ip ip daddr {addr} drop");
    let _ = writeln!(s, "  }}");
    let _ = writeln!(s, "  chain postrouting {{");
    let _ = writeln!(
        s,
        "    type filter hook postrouting priority 300; policy accept;"
    );
    if !rules.is_empty() {
        let _ = writeln!(s, "    oifname vmap {{ {} }}", vmap("out"));
    }
    let _ = writeln!(s, "    oifname != @taps ether type ip ip saddr {addr} drop");
    let _ = writeln!(
        s,
        "    oifname != @taps ether type arp arp saddr ip {addr} drop"
    );
    let _ = writeln!(s, "  }}");
    for r in rules {
        let (tap, port, mac) = (&r.tap, r.port, &r.bridge_mac);
        let _ = writeln!(s, "  chain in-{tap} {{");
        let _ = writeln!(
            s,
            "    ether type ip ip daddr {addr} tcp dport {METADATA_PORT} ether daddr set {mac} \
             meta pkttype set host tcp dport set {port} accept"
        );
        let _ = writeln!(s, "    ether type ip ip daddr {addr} drop");
        let _ = writeln!(s, "  }}");
        let _ = writeln!(s, "  chain out-{tap} {{");
        let _ = writeln!(
            s,
            "    ether type ip ip saddr {addr} tcp sport {port} tcp sport set {METADATA_PORT} accept"
        );
        let _ = writeln!(s, "    ether type ip ip saddr {addr} drop");
        let _ = writeln!(s, "  }}");
    }
    let _ = writeln!(s, "}}");
    Ok(s)
}

/// Runs `script` through `nft -f -` (one transaction: all of it or none).
pub fn apply(script: &str) -> Result<(), NftError> {
    let mut child = Command::new(NFT_BINARY)
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                NftError::NotInstalled
            } else {
                NftError::Failed(e.to_string())
            }
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| NftError::Failed(format!("writing the script: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| NftError::Failed(e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NftError::Failed(format!(
            "{} ({})",
            String::from_utf8_lossy(&out.stderr).trim(),
            out.status
        )))
    }
}

/// Writes the table for `rules`.
pub fn install(rules: &[TapRule]) -> Result<(), NftError> {
    apply(&render(rules)?)
}

/// Removes the table (nothing else); one that is not there is already removed.
pub fn remove() -> Result<(), NftError> {
    apply(&format!("add table {TABLE}\ndelete table {TABLE}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(tap: &str, port: u16) -> TapRule {
        TapRule {
            tap: tap.into(),
            port,
            bridge_mac: "02:00:00:00:00:01".into(),
        }
    }

    #[test]
    fn each_tap_has_its_chains_and_its_port() {
        let s = render(&[
            rule("psg1b2c3d4e5f60", 40001),
            rule("psg000000000aa0", 40002),
        ])
        .unwrap();
        assert!(s.starts_with("add table bridge passage\ndelete table bridge passage\n"));
        assert!(s.contains("elements = { \"psg1b2c3d4e5f60\", \"psg000000000aa0\" };"));
        assert!(s.contains(
            "iifname vmap { \"psg1b2c3d4e5f60\" : jump in-psg1b2c3d4e5f60, \"psg000000000aa0\" : jump in-psg000000000aa0 }"
        ));
        assert!(s.contains("chain in-psg000000000aa0 {"));
        assert!(s.contains(
            "ether daddr set 02:00:00:00:00:01 meta pkttype set host tcp dport set 40002 accept"
        ));
        assert!(s.contains("ip saddr 169.254.169.254 tcp sport 40001 tcp sport set 80 accept"));
    }

    #[test]
    fn no_taps_still_keeps_the_address_in() {
        let s = render(&[]).unwrap();
        assert!(!s.contains("vmap"));
        assert!(s.contains("type ifname;\n  }"));
        assert!(s.contains("iifname != @taps ether type ip ip daddr 169.254.169.254 drop"));
    }

    #[test]
    fn names_nft_would_misread_are_refused() {
        for bad in ["psg\"; flush ruleset", "", "a b", "toolonginterfacename"] {
            assert!(render(&[rule(bad, 1)]).is_err(), "{bad:?}");
        }
        let mut r = rule("psg0", 1);
        r.bridge_mac = "02:00:00:00:00:01 drop".into();
        assert!(render(&[r]).is_err());
        assert!(render(&[rule("psg0", 0)]).is_err());
    }
}
