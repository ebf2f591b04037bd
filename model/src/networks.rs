//! Networks VMs take addresses from (after Triton's NAPI): the API shapes and the pure
//! rules, address arithmetic included. A network is an IPv4 subnet on a Linux bridge of
//! each node (optionally a VLAN on it), with a range addresses are handed out from.
//! Which addresses are taken is the store's; which one comes next is decided here.

use crate::decode::BodyError;
use crate::ids::{AccountId, NetworkId};
use chrono::{DateTime, Utc};
use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

pub const MAX_NETWORK_NAME_LEN: usize = 64;
pub const MAX_RESOLVERS: usize = 8;
pub const MAX_OWNERS: usize = 64;
pub const MAX_DESCRIPTION_LEN: usize = 1024;
/// IPv4's minimum datagram every host must take, and a jumbo frame.
pub const MIN_MTU: u32 = 576;
pub const MAX_MTU: u32 = 9000;
pub const DEFAULT_MTU: u32 = 1500;
/// The largest 802.1Q VLAN id (4095 is reserved); 0 is untagged, as in Triton.
pub const MAX_VLAN_ID: u16 = 4094;
/// Linux's limit on an interface name (IFNAMSIZ less the terminating NUL).
pub const MAX_BRIDGE_NAME_LEN: usize = 15;
/// The widest subnet taken: a /16 (65,534 hosts).
pub const MIN_PREFIX_LEN: u8 = 16;
/// The narrowest: a /30, two hosts.
pub const MAX_PREFIX_LEN: u8 = 30;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Network {
    pub uuid: NetworkId,
    pub name: String,
    #[schema(example = "192.0.2.0/24")]
    pub subnet: String,
    #[schema(value_type = Option<String>, format = Ipv4)]
    pub gateway: Option<Ipv4Addr>,
    #[schema(value_type = String, format = Ipv4)]
    pub provision_start_ip: Ipv4Addr,
    #[schema(value_type = String, format = Ipv4)]
    pub provision_end_ip: Ipv4Addr,
    #[schema(value_type = Vec<String>)]
    pub resolvers: Vec<IpAddr>,
    /// 0: untagged.
    pub vlan_id: u16,
    /// The Linux bridge on each node this network's VMs attach to (Triton's nic tag).
    pub bridge: String,
    pub mtu: u32,
    /// Every tenant may use it; otherwise only `owner_uuids`.
    pub public: bool,
    pub owner_uuids: Vec<AccountId>,
    /// New VMs that name no network get one address on each default network.
    pub default: bool,
    pub description: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// A network as an operator asks for it. Addresses are strings so that a bad one is
/// refused with its field's name and the reason.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateNetwork {
    #[schema(min_length = 1, max_length = 64)]
    pub name: String,
    /// An IPv4 subnet in CIDR form, /16 to /30, with its host bits zero.
    #[schema(example = "192.0.2.0/24")]
    pub subnet: String,
    /// Inside the subnet; never handed to a VM, even inside the range.
    #[serde(default)]
    pub gateway: Option<String>,
    /// Default: the subnet's first host.
    #[serde(default)]
    pub provision_start_ip: Option<String>,
    /// Default: the subnet's last host.
    #[serde(default)]
    pub provision_end_ip: Option<String>,
    #[serde(default)]
    #[schema(max_items = 8)]
    pub resolvers: Vec<String>,
    /// 0 (the default): untagged.
    #[serde(default)]
    #[schema(maximum = 4094)]
    pub vlan_id: u16,
    #[schema(min_length = 1, max_length = 15)]
    pub bridge: String,
    /// Default 1500.
    #[serde(default)]
    #[schema(minimum = 576, maximum = 9000)]
    pub mtu: Option<u32>,
    #[serde(default)]
    pub public: bool,
    #[serde(default)]
    #[schema(max_items = 64)]
    pub owner_uuids: Vec<AccountId>,
    #[serde(default)]
    pub default: bool,
    #[serde(default)]
    #[schema(max_length = 1024)]
    pub description: Option<String>,
}

/// What an operator may change on a network. Its addresses (subnet, gateway, range),
/// bridge and VLAN stay as created: VMs hold addresses from them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateNetwork {
    #[serde(default)]
    #[schema(min_length = 1, max_length = 64)]
    pub name: Option<String>,
    #[serde(default)]
    #[schema(max_items = 8)]
    pub resolvers: Option<Vec<String>>,
    #[serde(default)]
    #[schema(minimum = 576, maximum = 9000)]
    pub mtu: Option<u32>,
    #[serde(default)]
    pub public: Option<bool>,
    /// Replaces the list.
    #[serde(default)]
    #[schema(max_items = 64)]
    pub owner_uuids: Option<Vec<AccountId>>,
    #[serde(default)]
    pub default: Option<bool>,
    /// An empty string removes it.
    #[serde(default)]
    #[schema(max_length = 1024)]
    pub description: Option<String>,
}

fn check_name(name: &str) -> Result<(), BodyError> {
    let ok = !name.is_empty()
        && name.chars().count() <= MAX_NETWORK_NAME_LEN
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if ok {
        Ok(())
    } else {
        Err(BodyError::new(
            "name",
            format!(
                "must be 1 to {MAX_NETWORK_NAME_LEN} characters of A-Z, a-z, 0-9, '_', '-', '.'"
            ),
        ))
    }
}

/// The resolvers as addresses, at most [`MAX_RESOLVERS`].
pub fn parse_resolvers(texts: &[String]) -> Result<Vec<IpAddr>, BodyError> {
    if texts.len() > MAX_RESOLVERS {
        return Err(BodyError::new(
            "resolvers",
            format!("at most {MAX_RESOLVERS} resolvers"),
        ));
    }
    texts
        .iter()
        .map(|r| {
            r.trim()
                .parse::<IpAddr>()
                .map_err(|_| BodyError::new("resolvers", format!("{r:?} is not an IP address")))
        })
        .collect()
}

fn check_mtu(mtu: Option<u32>) -> Result<(), BodyError> {
    match mtu {
        Some(m) if !(MIN_MTU..=MAX_MTU).contains(&m) => Err(BodyError::new(
            "mtu",
            format!("must be {MIN_MTU} to {MAX_MTU}"),
        )),
        _ => Ok(()),
    }
}

fn check_owners(owners: &[AccountId]) -> Result<(), BodyError> {
    if owners.len() > MAX_OWNERS {
        return Err(BodyError::new(
            "owner_uuids",
            format!("at most {MAX_OWNERS} owners"),
        ));
    }
    Ok(())
}

fn check_description(d: Option<&str>) -> Result<(), BodyError> {
    if d.is_some_and(|d| d.len() > MAX_DESCRIPTION_LEN) {
        return Err(BodyError::new(
            "description",
            format!("at most {MAX_DESCRIPTION_LEN} bytes"),
        ));
    }
    Ok(())
}

impl UpdateNetwork {
    /// The first field out of bounds, if any; the resolvers parsed when given.
    pub fn validate(&self) -> Result<Option<Vec<IpAddr>>, BodyError> {
        if let Some(n) = &self.name {
            check_name(n)?;
        }
        let resolvers = self.resolvers.as_deref().map(parse_resolvers).transpose()?;
        check_mtu(self.mtu)?;
        if let Some(o) = &self.owner_uuids {
            check_owners(o)?;
        }
        check_description(self.description.as_deref())?;
        Ok(resolvers)
    }
}

/// A network's addresses, checked: what a [`CreateNetwork`] means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressPlan {
    pub subnet: Ipv4Net,
    pub gateway: Option<Ipv4Addr>,
    pub start: Ipv4Addr,
    pub end: Ipv4Addr,
}

fn ipv4(field: &str, text: &str) -> Result<Ipv4Addr, BodyError> {
    text.trim().parse::<Ipv4Addr>().map_err(|_| {
        let why = if text.contains(':') {
            "IPv6 is not supported yet; give an IPv4 address"
        } else {
            "must be an IPv4 address such as 192.0.2.1"
        };
        BodyError::new(field, why)
    })
}

impl AddressPlan {
    /// The subnet's hosts: all but its network and broadcast addresses.
    fn hosts(subnet: &Ipv4Net) -> (Ipv4Addr, Ipv4Addr) {
        let first = u32::from(subnet.network()).saturating_add(1);
        let last = u32::from(subnet.broadcast()).saturating_sub(1);
        (Ipv4Addr::from(first), Ipv4Addr::from(last))
    }

    pub fn new(
        subnet: &str,
        gateway: Option<&str>,
        start: Option<&str>,
        end: Option<&str>,
    ) -> Result<AddressPlan, BodyError> {
        let net: Ipv4Net = subnet.trim().parse().map_err(|_| {
            BodyError::new(
                "subnet",
                if subnet.contains(':') {
                    "IPv6 is not supported yet; give an IPv4 subnet such as 192.0.2.0/24"
                } else {
                    "must be an IPv4 subnet in CIDR form, such as 192.0.2.0/24"
                },
            )
        })?;
        if !(MIN_PREFIX_LEN..=MAX_PREFIX_LEN).contains(&net.prefix_len()) {
            return Err(BodyError::new(
                "subnet",
                format!("must be a /{MIN_PREFIX_LEN} to a /{MAX_PREFIX_LEN}"),
            ));
        }
        if net.trunc() != net {
            return Err(BodyError::new(
                "subnet",
                format!("has host bits set: did you mean {}?", net.trunc()),
            ));
        }
        let (first, last) = Self::hosts(&net);
        let host = |field: &str, a: Ipv4Addr| {
            if a < first || a > last {
                Err(BodyError::new(
                    field,
                    format!("{a} is not a host of {net} ({first} to {last})"),
                ))
            } else {
                Ok(a)
            }
        };
        let gateway = gateway
            .map(|g| ipv4("gateway", g).and_then(|a| host("gateway", a)))
            .transpose()?;
        let start = match start {
            Some(s) => host("provision_start_ip", ipv4("provision_start_ip", s)?)?,
            None => first,
        };
        let end = match end {
            Some(e) => host("provision_end_ip", ipv4("provision_end_ip", e)?)?,
            None => last,
        };
        if start > end {
            return Err(BodyError::new(
                "provision_end_ip",
                format!("{end} comes before provision_start_ip {start}"),
            ));
        }
        let plan = AddressPlan {
            subnet: net,
            gateway,
            start,
            end,
        };
        if plan.capacity() == 0 {
            return Err(BodyError::new(
                "provision_end_ip",
                "the range holds only the gateway: no address is left for VMs",
            ));
        }
        Ok(plan)
    }

    /// Addresses VMs can get: the range, less the gateway when it lies inside.
    pub fn capacity(&self) -> u32 {
        let n = u32::from(self.end) - u32::from(self.start) + 1;
        n - u32::from(self.gateway.is_some_and(|g| self.in_range(g)))
    }

    pub fn in_range(&self, a: Ipv4Addr) -> bool {
        self.start <= a && a <= self.end
    }

    /// Whether `a` may be given to a VM: in the range and not the gateway.
    pub fn assignable(&self, a: Ipv4Addr) -> bool {
        self.in_range(a) && Some(a) != self.gateway
    }

    /// The lowest assignable address at or after `from` (wrapping to the range's start)
    /// that `taken` does not hold; `None` when every one is taken. Starting after the last
    /// address handed out, as NAPI does, keeps a freed address out of use for as long as
    /// the range allows.
    pub fn next_free(&self, from: Ipv4Addr, taken: &BTreeSet<Ipv4Addr>) -> Option<Ipv4Addr> {
        let (lo, hi) = (u32::from(self.start), u32::from(self.end));
        let from = u32::from(from).clamp(lo, hi);
        (from..=hi)
            .chain(lo..from)
            .map(Ipv4Addr::from)
            .find(|a| self.assignable(*a) && !taken.contains(a))
    }
}

/// Whether two subnets share an address.
pub fn overlaps(a: &Ipv4Net, b: &Ipv4Net) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// Whether `name` may name a Linux bridge: 1 to 15 bytes, none of `/`, `:`, whitespace or
/// control characters, and not `.` or `..`.
pub fn check_bridge(name: &str) -> Result<(), BodyError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_BRIDGE_NAME_LEN
        && name != "."
        && name != ".."
        && !name
            .chars()
            .any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control());
    if ok {
        Ok(())
    } else {
        Err(BodyError::new(
            "bridge",
            format!(
                "must be a Linux interface name: 1 to {MAX_BRIDGE_NAME_LEN} bytes, without \
                 '/', ':' or spaces"
            ),
        ))
    }
}

impl CreateNetwork {
    /// The first field out of bounds, else the network's addresses and resolvers.
    pub fn validate(&self) -> Result<(AddressPlan, Vec<IpAddr>), BodyError> {
        check_name(&self.name)?;
        let plan = AddressPlan::new(
            &self.subnet,
            self.gateway.as_deref(),
            self.provision_start_ip.as_deref(),
            self.provision_end_ip.as_deref(),
        )?;
        let resolvers = parse_resolvers(&self.resolvers)?;
        if self.vlan_id > MAX_VLAN_ID {
            return Err(BodyError::new(
                "vlan_id",
                format!("must be 0 (untagged) to {MAX_VLAN_ID}"),
            ));
        }
        check_bridge(&self.bridge)?;
        check_mtu(self.mtu)?;
        check_owners(&self.owner_uuids)?;
        check_description(self.description.as_deref())?;
        Ok((plan, resolvers))
    }
}

/// A VM's network interface, as the API shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Nic {
    #[schema(example = "02:5e:10:00:00:01")]
    pub mac: String,
    #[schema(value_type = String, format = Ipv4)]
    pub ip: Ipv4Addr,
    pub network_uuid: NetworkId,
    /// The NIC the default route goes through: the first one asked for.
    pub primary: bool,
}

/// An address of a network in use, and by whom (`GET /v1/networks/{uuid}/ips`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NetworkIp {
    #[schema(value_type = String, format = Ipv4)]
    pub ip: Ipv4Addr,
    pub mac: String,
    pub vm_uuid: crate::ids::VmId,
    pub owner_uuid: AccountId,
    pub created_at: DateTime<Utc>,
}

/// A network a new VM asks an address on: its uuid or name, or (as Triton's CloudAPI
/// takes it) `{"ipv4_uuid": "<uuid or name>", "ipv4_ips": ["192.0.2.10"]}` for a fixed
/// address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum NetworkChoice {
    Named(String),
    Fixed {
        ipv4_uuid: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        #[schema(max_items = 1)]
        ipv4_ips: Vec<String>,
    },
}

impl<'de> Deserialize<'de> for NetworkChoice {
    // By hand, so that a wrong shape gets a reason rather than serde's "did not match any
    // variant of untagged enum".
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Fixed {
            ipv4_uuid: String,
            #[serde(default)]
            ipv4_ips: Vec<String>,
        }
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::String(s) => Ok(NetworkChoice::Named(s)),
            v @ serde_json::Value::Object(_) => {
                let f: Fixed = serde_json::from_value(v).map_err(|e| {
                    D::Error::custom(format!(
                        "a network is its uuid or name, or {{\"ipv4_uuid\", \"ipv4_ips\"}}: {e}"
                    ))
                })?;
                Ok(NetworkChoice::Fixed {
                    ipv4_uuid: f.ipv4_uuid,
                    ipv4_ips: f.ipv4_ips,
                })
            }
            _ => Err(D::Error::custom(
                "a network is its uuid or name, or {\"ipv4_uuid\", \"ipv4_ips\"}",
            )),
        }
    }
}

impl NetworkChoice {
    /// The network's uuid or name.
    pub fn key(&self) -> &str {
        match self {
            NetworkChoice::Named(k) | NetworkChoice::Fixed { ipv4_uuid: k, .. } => k,
        }
    }
}

/// A checked list of networks for a new VM: each network's key and the fixed address
/// asked for on it, if any, in the order given (the first is the primary NIC).
pub fn check_choices(
    field: &str,
    choices: &[NetworkChoice],
) -> Result<Vec<(String, Option<Ipv4Addr>)>, BodyError> {
    if choices.len() > crate::protocol::MAX_NICS {
        return Err(BodyError::new(
            field,
            format!("at most {} networks", crate::protocol::MAX_NICS),
        ));
    }
    let mut out: Vec<(String, Option<Ipv4Addr>)> = Vec::with_capacity(choices.len());
    for (i, c) in choices.iter().enumerate() {
        let key = c.key().trim();
        if key.is_empty() || key.len() > MAX_NETWORK_NAME_LEN.max(36) {
            return Err(BodyError::new(
                format!("{field}[{i}]"),
                "must be a network's uuid or name",
            ));
        }
        if out.iter().any(|(k, _)| k == key) {
            return Err(BodyError::new(
                format!("{field}[{i}]"),
                "listed twice: a VM has one address on a network",
            ));
        }
        let fixed = match c {
            NetworkChoice::Named(_) => None,
            NetworkChoice::Fixed { ipv4_ips, .. } => match ipv4_ips.as_slice() {
                [] => None,
                [one] => Some(ipv4(&format!("{field}[{i}].ipv4_ips[0]"), one)?),
                _ => {
                    return Err(BodyError::new(
                        format!("{field}[{i}].ipv4_ips"),
                        "at most one address per network",
                    ));
                }
            },
        };
        out.push((key.to_string(), fixed));
    }
    Ok(out)
}

impl AddressPlan {
    /// Whether `a` may be asked for as a fixed address: a host of the subnet, not the
    /// gateway (outside the range is allowed, as NAPI allows it: the range is for
    /// addresses handed out).
    pub fn fixable(&self, a: Ipv4Addr) -> bool {
        let (first, last) = Self::hosts(&self.subnet);
        first <= a && a <= last && Some(a) != self.gateway
    }
}

/// A locally administered, unicast MAC address from six random bytes: the first octet's
/// "local" bit set and its "group" bit clear, so it can clash with no vendor's address.
pub fn local_mac(random: [u8; 6]) -> String {
    let mut b = random;
    b[0] = (b[0] & 0xfc) | 0x02;
    b.iter()
        .map(|x| format!("{x:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// A MAC address in the one form the control plane writes (six lower-case hex octets
/// joined by ':'), as bytes; anything else is refused with the reason.
pub fn parse_mac(text: &str) -> Result<[u8; 6], String> {
    let bad = || format!("{text:?} is not a MAC address such as 02:00:5e:10:00:01");
    let mut out = [0u8; 6];
    let mut parts = text.split(':');
    for b in &mut out {
        let p = parts.next().ok_or_else(bad)?;
        if p.len() != 2 || !p.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(bad());
        }
        *b = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn plan(subnet: &str, gw: Option<&str>, start: Option<&str>, end: Option<&str>) -> AddressPlan {
        AddressPlan::new(subnet, gw, start, end).unwrap_or_else(|e| panic!("{e:?}"))
    }

    fn refused(
        subnet: &str,
        gw: Option<&str>,
        start: Option<&str>,
        end: Option<&str>,
    ) -> BodyError {
        match AddressPlan::new(subnet, gw, start, end) {
            Ok(p) => panic!("{subnet} {gw:?} {start:?} {end:?} accepted: {p:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn the_range_defaults_to_the_subnets_hosts_and_skips_the_gateway() {
        let p = plan("192.0.2.0/24", Some("192.0.2.1"), None, None);
        assert_eq!((p.start, p.end), (ip("192.0.2.1"), ip("192.0.2.254")));
        assert_eq!(p.capacity(), 253);
        assert!(!p.assignable(ip("192.0.2.1")));
        assert_eq!(
            p.next_free(p.start, &BTreeSet::new()),
            Some(ip("192.0.2.2"))
        );
        let p = plan("10.0.0.0/30", None, None, None);
        assert_eq!(p.capacity(), 2);
        let p = plan(
            "10.1.0.0/16",
            Some("10.1.0.1"),
            Some("10.1.8.0"),
            Some("10.1.8.255"),
        );
        assert_eq!(
            p.capacity(),
            256,
            "a gateway outside the range costs nothing"
        );
    }

    #[test]
    fn bad_addresses_name_their_field_and_why() {
        let cases = [
            (refused("192.0.2.0", None, None, None), "subnet", "CIDR"),
            (refused("2001:db8::/64", None, None, None), "subnet", "IPv6"),
            (
                refused("192.0.2.7/24", None, None, None),
                "subnet",
                "192.0.2.0/24",
            ),
            (refused("10.0.0.0/8", None, None, None), "subnet", "/16"),
            (refused("10.0.0.0/31", None, None, None), "subnet", "/30"),
            (
                refused("192.0.2.0/24", Some("192.0.3.1"), None, None),
                "gateway",
                "not a host",
            ),
            (
                refused("192.0.2.0/24", Some("192.0.2.0"), None, None),
                "gateway",
                "not a host",
            ),
            (
                refused("192.0.2.0/24", Some("gw"), None, None),
                "gateway",
                "IPv4",
            ),
            (
                refused("192.0.2.0/24", None, Some("192.0.2.255"), None),
                "provision_start_ip",
                "not a host",
            ),
            (
                refused("192.0.2.0/24", None, Some("192.0.2.50"), Some("192.0.2.10")),
                "provision_end_ip",
                "before",
            ),
            (
                refused(
                    "192.0.2.0/24",
                    Some("192.0.2.9"),
                    Some("192.0.2.9"),
                    Some("192.0.2.9"),
                ),
                "provision_end_ip",
                "only the gateway",
            ),
        ];
        for (e, field, why) in cases {
            assert_eq!(e.field, field, "{e:?}");
            assert!(e.message.contains(why), "{e:?}");
        }
    }

    #[test]
    fn a_network_request_is_checked_field_by_field() {
        let good = CreateNetwork {
            name: "tenant-net".into(),
            subnet: "198.51.100.0/24".into(),
            gateway: Some("198.51.100.1".into()),
            resolvers: vec!["198.51.100.1".into(), "2001:db8::53".into()],
            bridge: "br0".into(),
            ..CreateNetwork::default()
        };
        assert!(good.validate().is_ok());
        let bad = |f: fn(&mut CreateNetwork), field: &str| {
            let mut r = good.clone();
            f(&mut r);
            assert_eq!(r.validate().map_err(|e| e.field), Err(field.into()));
        };
        bad(|r| r.name = "has space".into(), "name");
        bad(|r| r.name = String::new(), "name");
        bad(|r| r.resolvers = vec!["dns".into()], "resolvers");
        bad(|r| r.resolvers = vec!["1.1.1.1".into(); 9], "resolvers");
        bad(|r| r.vlan_id = 4095, "vlan_id");
        bad(|r| r.bridge = "a-very-long-bridge".into(), "bridge");
        bad(|r| r.bridge = "br/0".into(), "bridge");
        bad(|r| r.bridge = "..".into(), "bridge");
        bad(|r| r.mtu = Some(100), "mtu");
        bad(|r| r.mtu = Some(9001), "mtu");
        bad(
            |r| r.owner_uuids = vec![AccountId::new_random(); 65],
            "owner_uuids",
        );
        bad(|r| r.description = Some("x".repeat(1025)), "description");
    }

    #[test]
    fn subnets_overlap_when_one_holds_the_others_start() {
        let n = |s: &str| s.parse::<Ipv4Net>().unwrap_or_else(|e| panic!("{e}"));
        assert!(overlaps(&n("10.0.0.0/16"), &n("10.0.5.0/24")));
        assert!(overlaps(&n("10.0.5.0/24"), &n("10.0.0.0/16")));
        assert!(overlaps(&n("10.0.5.0/24"), &n("10.0.5.0/24")));
        assert!(!overlaps(&n("10.0.5.0/24"), &n("10.0.6.0/24")));
    }

    #[test]
    fn macs_are_local_and_unicast() {
        assert_eq!(local_mac([0xff; 6]), "fe:ff:ff:ff:ff:ff");
        assert_eq!(local_mac([0; 6]), "02:00:00:00:00:00");
    }

    #[test]
    fn macs_parse_only_in_the_written_form() {
        assert_eq!(parse_mac("02:00:5e:10:00:01"), Ok([2, 0, 0x5e, 0x10, 0, 1]));
        for bad in [
            "",
            "02:00:5e:10:00",
            "02:00:5e:10:00:01:02",
            "02:00:5E:10:00:01",
            "02-00-5e-10-00-01",
            "2:00:5e:10:00:01",
            "+2:00:5e:10:00:01",
            "02:00:5e:10:00:0g",
        ] {
            assert!(parse_mac(bad).is_err(), "{bad:?} parsed");
        }
    }

    proptest! {
        /// `next_free` hands out every assignable address once, never the gateway, never
        /// one outside the range, and says `None` only when all are taken.
        #[test]
        fn next_free_hands_out_each_assignable_address_once(
            third in 0u8..=255,
            prefix in 24u8..=30,
            gw_at in 0u32..64,
            from_at in 0u32..64,
            pre_taken in proptest::collection::vec(0u32..64, 0..16),
        ) {
            let subnet = format!("10.9.{third}.0/{prefix}");
            let net: Ipv4Net = subnet.parse().unwrap_or_else(|e| panic!("{e}"));
            let (first, last) = AddressPlan::hosts(&net);
            let span = u32::from(last) - u32::from(first) + 1;
            let at = |k: u32| Ipv4Addr::from(u32::from(first) + k % span);
            let gw = at(gw_at).to_string();
            let p = AddressPlan::new(&subnet, Some(&gw), None, None)
                .map_err(|e| TestCaseError::fail(format!("{subnet} refused: {e:?}")))?;
            let mut taken: BTreeSet<Ipv4Addr> = pre_taken.iter().map(|k| at(*k)).collect();
            let mut given = 0u32;
            let mut from = at(from_at);
            while let Some(a) = p.next_free(from, &taken) {
                prop_assert!(p.assignable(a));
                prop_assert!(taken.insert(a), "{} twice", a);
                given += 1;
                from = a;
            }
            let left = (0..span).map(at).filter(|a| p.assignable(*a)).count() as u32;
            let pre = pre_taken.iter().map(|k| at(*k)).filter(|a| p.assignable(*a))
                .collect::<BTreeSet<_>>().len() as u32;
            prop_assert_eq!(given + pre, left);
            prop_assert_eq!(left, p.capacity());
        }
    }
}
