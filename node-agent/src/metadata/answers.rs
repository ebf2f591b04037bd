//! What the metadata service answers, as pure functions of what is known about the guest:
//! OpenStack's `/openstack/<version>/{meta_data.json,user_data,network_data.json}` and
//! EC2's `/<version>/meta-data/…` and `/<version>/user-data`, where a version is `latest`
//! or a date (`2009-04-04`): every version gets the same answers.
//!
//! EC2's directories list their entries one a line, those that are directories ending in
//! `/`; `public-keys/` lists `0=name`, and `public-keys/0/openssh-key` is the key.

use passage_model::VmId;
use passage_model::protocol::{GuestMetadata, NicSpec, VmSpec};
use passage_model::tags::Tags;
use serde_json::json;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;

/// The metadata key that holds the tenant's user-data (as at creation).
pub const USER_DATA_KEY: &str = "user-data";
/// The longest path answered; longer ones are not found.
pub const MAX_PATH: usize = 1024;

/// Everything a guest may be told about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Guest {
    pub uuid: VmId,
    pub hostname: String,
    pub nics: Vec<NicSpec>,
    /// Name and OpenSSH one-line key, in the VM's order.
    pub keys: Vec<(String, String)>,
    pub user_data: Option<String>,
    /// The metadata other than the user-data.
    pub meta: BTreeMap<String, String>,
    pub tags: Tags,
    /// The owning account, where the server said (OpenStack's `project_id`).
    pub project_id: Option<String>,
}

/// A key's name where only the key is known: its comment, else its place.
fn key_name(key: &str, index: usize) -> String {
    key.split_whitespace()
        .nth(2)
        .map_or_else(|| format!("key-{index}"), str::to_string)
}

impl Guest {
    /// From the VM's spec alone (what its seed says): while the server cannot answer.
    pub fn from_spec(spec: &VmSpec) -> Guest {
        let ci = spec.cloud_init.as_ref();
        let mut meta = ci.map(|c| c.metadata.clone()).unwrap_or_default();
        if let Some(us) = ci.and_then(|c| c.user_script.clone()) {
            meta.insert("user-script".into(), us);
        }
        Guest {
            uuid: spec.uuid,
            hostname: ci.map(|c| c.hostname.clone()).unwrap_or_default(),
            nics: spec.nics.clone(),
            keys: ci
                .map(|c| {
                    c.ssh_authorized_keys
                        .iter()
                        .enumerate()
                        .map(|(i, k)| (key_name(k, i), k.clone()))
                        .collect()
                })
                .unwrap_or_default(),
            user_data: ci.and_then(|c| c.user_data.clone()),
            meta,
            tags: Tags::new(),
            project_id: None,
        }
    }

    /// The spec's NICs with the server's current tags, metadata and keys.
    pub fn current(spec: &VmSpec, now: &GuestMetadata) -> Guest {
        let mut g = Guest::from_spec(spec);
        g.hostname.clone_from(&now.hostname);
        g.tags.clone_from(&now.tags);
        let mut meta = now.metadata.clone();
        g.user_data = meta.remove(USER_DATA_KEY);
        g.meta = meta;
        if let Some(keys) = &now.keys {
            g.keys = keys
                .iter()
                .map(|k| (k.name.clone(), k.key.clone()))
                .collect();
        }
        g.project_id = now.owner_uuid.map(|o| o.to_string());
        g
    }

    fn primary(&self) -> Option<&NicSpec> {
        self.nics
            .iter()
            .find(|n| n.primary)
            .or_else(|| self.nics.first())
    }
}

/// One answer: its content type and body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Text(String),
    Json(String),
}

impl Answer {
    pub fn content_type(&self) -> &'static str {
        match self {
            Answer::Text(_) => "text/plain; charset=utf-8",
            Answer::Json(_) => "application/json",
        }
    }

    pub fn body(&self) -> &str {
        match self {
            Answer::Text(s) | Answer::Json(s) => s,
        }
    }
}

fn is_version(v: &str) -> bool {
    v == "latest"
        || (v.len() == 10
            && v.bytes().enumerate().all(|(i, b)| match i {
                4 | 7 => b == b'-',
                _ => b.is_ascii_digit(),
            }))
}

fn listing(entries: &[String]) -> Answer {
    Answer::Text(entries.join("\n"))
}

/// The answer to `GET path` (without its query), or `None`: not found.
pub fn answer(g: &Guest, path: &str) -> Option<Answer> {
    if path.len() > MAX_PATH || !path.starts_with('/') {
        return None;
    }
    let dir = path.ends_with('/');
    let parts: Vec<&str> = path
        .trim_start_matches('/')
        .trim_end_matches('/')
        .split('/')
        .filter(|p| !p.is_empty())
        .collect();
    // A leaf asked for as a directory is not found, as EC2 has it.
    let leaf = |a: Answer| (!dir).then_some(a);
    match parts.as_slice() {
        [] => Some(listing(&["latest/".into(), "openstack/".into()])),
        ["openstack"] => Some(listing(&["latest/".into()])),
        ["openstack", v] if is_version(v) => {
            let mut e = vec!["meta_data.json".to_string(), "network_data.json".into()];
            if g.user_data.is_some() {
                e.push("user_data".into());
            }
            Some(listing(&e))
        }
        ["openstack", v, file] if is_version(v) => match *file {
            "meta_data.json" => leaf(Answer::Json(meta_data_json(g))),
            "network_data.json" => leaf(Answer::Json(network_data_json(g))),
            "user_data" => leaf(Answer::Text(g.user_data.clone()?)),
            _ => None,
        },
        [v] if is_version(v) => {
            let mut e = vec!["meta-data/".to_string()];
            if g.user_data.is_some() {
                e.push("user-data".into());
            }
            Some(listing(&e))
        }
        [v, "user-data"] if is_version(v) => leaf(Answer::Text(g.user_data.clone()?)),
        [v, "meta-data", rest @ ..] if is_version(v) => ec2(g, rest, dir),
        _ => None,
    }
}

/// EC2's `meta-data/` tree below `meta-data`.
fn ec2(g: &Guest, rest: &[&str], dir: bool) -> Option<Answer> {
    let leaf = |s: String| (!dir).then_some(Answer::Text(s));
    let primary = g.primary();
    match rest {
        [] => {
            let mut e: Vec<String> = ["hostname", "instance-id", "local-hostname"]
                .iter()
                .map(|s| s.to_string())
                .collect();
            if primary.is_some() {
                e.push("local-ipv4".into());
                e.push("mac".into());
            }
            if !g.keys.is_empty() {
                e.push("public-keys/".into());
            }
            e.push("tags/".into());
            Some(listing(&e))
        }
        ["instance-id"] => leaf(g.uuid.to_string()),
        ["hostname" | "local-hostname"] => leaf(g.hostname.clone()),
        ["local-ipv4"] => leaf(primary?.ip.to_string()),
        ["mac"] => leaf(primary?.mac.clone()),
        ["public-keys"] if !g.keys.is_empty() => Some(listing(
            &g.keys
                .iter()
                .enumerate()
                .map(|(i, (name, _))| format!("{i}={name}"))
                .collect::<Vec<_>>(),
        )),
        ["public-keys", i] => {
            g.keys.get(key_index(i)?)?;
            Some(listing(&["openssh-key".into()]))
        }
        ["public-keys", i, "openssh-key"] => leaf(g.keys.get(key_index(i)?)?.1.clone()),
        ["tags"] => Some(listing(&["instance/".into()])),
        ["tags", "instance"] => Some(listing(
            &g.tags
                .keys()
                .filter(|k| !k.contains('/'))
                .cloned()
                .collect::<Vec<_>>(),
        )),
        ["tags", "instance", key] => leaf(match g.tags.get(*key)? {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        }),
        _ => None,
    }
}

/// `0`, `1`, …: no sign, no leading zero.
fn key_index(s: &str) -> Option<usize> {
    if s.len() > 1 && s.starts_with('0') {
        return None;
    }
    s.bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| s.parse().ok())
        .flatten()
}

/// OpenStack's `meta_data.json`; `tags` is Passage's own addition (Triton's tags).
pub fn meta_data_json(g: &Guest) -> String {
    let public_keys: serde_json::Map<String, serde_json::Value> =
        g.keys.iter().map(|(n, k)| (n.clone(), json!(k))).collect();
    let keys: Vec<serde_json::Value> = g
        .keys
        .iter()
        .map(|(n, k)| json!({"name": n, "type": "ssh", "data": k}))
        .collect();
    json!({
        "uuid": g.uuid.to_string(),
        "name": g.hostname,
        "hostname": g.hostname,
        "launch_index": 0,
        "availability_zone": null,
        "project_id": g.project_id,
        "public_keys": public_keys,
        "keys": keys,
        "meta": g.meta,
        "tags": g.tags,
    })
    .to_string()
}

fn netmask(prefix_len: u8) -> Ipv4Addr {
    let bits = u32::MAX
        .checked_shl(32 - u32::from(prefix_len.min(32)))
        .unwrap_or(0);
    Ipv4Addr::from(bits)
}

/// OpenStack's `network_data.json`: a link per NIC (by MAC), its static IPv4 network with
/// the default route on the primary NIC, and the resolvers as DNS services.
pub fn network_data_json(g: &Guest) -> String {
    let mut links = Vec::new();
    let mut networks = Vec::new();
    let mut dns: Vec<String> = Vec::new();
    for (i, nic) in g.nics.iter().enumerate() {
        links.push(json!({
            "id": format!("interface{i}"),
            "type": "phy",
            "ethernet_mac_address": nic.mac,
            "mtu": nic.mtu,
        }));
        let routes: Vec<serde_json::Value> = match (nic.primary, nic.gateway) {
            (true, Some(gw)) => vec![json!({
                "network": "0.0.0.0", "netmask": "0.0.0.0", "gateway": gw.to_string()
            })],
            _ => Vec::new(),
        };
        networks.push(json!({
            "id": format!("network{i}"),
            "link": format!("interface{i}"),
            "type": "ipv4",
            "ip_address": nic.ip.to_string(),
            "netmask": netmask(nic.prefix_len).to_string(),
            "routes": routes,
        }));
        for r in &nic.resolvers {
            let r = r.to_string();
            if !dns.contains(&r) {
                dns.push(r);
            }
        }
    }
    let services: Vec<serde_json::Value> = dns
        .iter()
        .map(|a| json!({"type": "dns", "address": a}))
        .collect();
    json!({"links": links, "networks": networks, "services": services}).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use passage_model::protocol::{CloudInitSpec, GuestKey};

    fn spec() -> VmSpec {
        VmSpec {
            uuid: "0190f3c4-7a2b-7c3d-8e4f-a1b2c3d4e5f6".parse().unwrap(),
            vcpus: 1,
            memory_mib: 512,
            devices: Vec::new(),
            disk: None,
            nics: vec![NicSpec {
                mac: "02:00:00:00:00:01".into(),
                ip: "10.77.0.10".parse().unwrap(),
                prefix_len: 24,
                gateway: Some("10.77.0.1".parse().unwrap()),
                resolvers: vec!["10.77.0.1".parse().unwrap()],
                bridge: "br0".into(),
                vlan_id: 0,
                mtu: 1500,
                primary: true,
            }],
            cloud_init: Some(CloudInitSpec {
                hostname: "box".into(),
                ssh_authorized_keys: vec!["ssh-ed25519 AAAA me@laptop".into()],
                user_data: Some("#cloud-config\n".into()),
                user_script: None,
                metadata: BTreeMap::from([("role".into(), "db".into())]),
            }),
            bootrom: None,
        }
    }

    fn text(g: &Guest, path: &str) -> Option<String> {
        answer(g, path).map(|a| a.body().to_string())
    }

    #[test]
    fn ec2_tree() {
        let g = Guest::from_spec(&spec());
        assert_eq!(
            text(&g, "/latest/meta-data/instance-id").unwrap(),
            "0190f3c4-7a2b-7c3d-8e4f-a1b2c3d4e5f6"
        );
        assert_eq!(
            text(&g, "/2009-04-04/meta-data/local-ipv4").unwrap(),
            "10.77.0.10"
        );
        assert_eq!(
            text(&g, "/latest/meta-data/").unwrap(),
            "hostname\ninstance-id\nlocal-hostname\nlocal-ipv4\nmac\npublic-keys/\ntags/"
        );
        assert_eq!(
            text(&g, "/latest/meta-data"),
            text(&g, "/latest/meta-data/")
        );
        assert_eq!(
            text(&g, "/latest/meta-data/public-keys/").unwrap(),
            "0=me@laptop"
        );
        assert_eq!(
            text(&g, "/latest/meta-data/public-keys/0/").unwrap(),
            "openssh-key"
        );
        assert_eq!(
            text(&g, "/latest/meta-data/public-keys/0/openssh-key").unwrap(),
            "ssh-ed25519 AAAA me@laptop"
        );
        assert_eq!(text(&g, "/latest/user-data").unwrap(), "#cloud-config\n");
        for missing in [
            "/latest/meta-data/instance-id/",
            "/latest/meta-data/public-keys/1/openssh-key",
            "/latest/meta-data/public-keys/00",
            "/latest/meta-data/nope",
            "/v1/meta-data/instance-id",
            "latest/meta-data/instance-id",
            "/2009-4-04/meta-data/instance-id",
        ] {
            assert_eq!(answer(&g, missing), None, "{missing}");
        }
        assert_eq!(answer(&g, &format!("/latest/{}", "a/".repeat(600))), None);
    }

    #[test]
    fn current_labels_replace_the_specs() {
        let s = spec();
        let now = GuestMetadata {
            uuid: s.uuid,
            owner_uuid: None,
            hostname: "renamed".into(),
            tags: Tags::from([("env".into(), json!("prod")), ("n".into(), json!(3))]),
            metadata: BTreeMap::from([
                ("user-data".into(), "#!/bin/sh\n".into()),
                ("k".into(), "v".into()),
            ]),
            keys: Some(vec![GuestKey {
                name: "work".into(),
                key: "ssh-ed25519 BBBB".into(),
            }]),
        };
        let g = Guest::current(&s, &now);
        assert_eq!(text(&g, "/latest/meta-data/hostname").unwrap(), "renamed");
        assert_eq!(
            text(&g, "/latest/meta-data/tags/instance/").unwrap(),
            "env\nn"
        );
        assert_eq!(text(&g, "/latest/meta-data/tags/instance/n").unwrap(), "3");
        assert_eq!(
            text(&g, "/openstack/latest/user_data").unwrap(),
            "#!/bin/sh\n"
        );
        let md: serde_json::Value =
            serde_json::from_str(&text(&g, "/openstack/latest/meta_data.json").unwrap()).unwrap();
        assert_eq!(md["uuid"], json!(s.uuid.to_string()));
        assert_eq!(md["public_keys"], json!({"work": "ssh-ed25519 BBBB"}));
        assert_eq!(md["meta"], json!({"k": "v"}));
        assert_eq!(md["tags"]["env"], json!("prod"));
    }

    #[test]
    fn openstack_network_data() {
        let g = Guest::from_spec(&spec());
        let nd: serde_json::Value =
            serde_json::from_str(&text(&g, "/openstack/2018-08-27/network_data.json").unwrap())
                .unwrap();
        assert_eq!(nd["links"][0]["ethernet_mac_address"], "02:00:00:00:00:01");
        assert_eq!(nd["networks"][0]["netmask"], "255.255.255.0");
        assert_eq!(nd["networks"][0]["routes"][0]["gateway"], "10.77.0.1");
        assert_eq!(
            nd["services"],
            json!([{"type": "dns", "address": "10.77.0.1"}])
        );
        assert_eq!(
            text(&g, "/openstack/latest/").unwrap(),
            "meta_data.json\nnetwork_data.json\nuser_data"
        );
        assert_eq!(netmask(32).to_string(), "255.255.255.255");
        assert_eq!(netmask(0).to_string(), "0.0.0.0");
    }
}
