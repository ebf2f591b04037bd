//! A VM's NoCloud seed: the small vfat volume labelled `cidata` that the guest's
//! cloud-init reads at first boot, written to `STATE/qemu/<vm>/seed.img` and attached
//! read-only by the QEMU backend. It holds:
//!
//! - `meta-data`: `instance-id` (the VM's uuid) and `local-hostname`;
//! - `user-data`: a MIME multipart message: our `#cloud-config` with the owner's keys as
//!   `ssh_authorized_keys` (the image's default user), then the tenant's `user-data` as its
//!   own part, typed by its first line as cloud-init would, then the tenant's
//!   `user-script` as a `text/x-shellscript` part;
//! - `network-config` (when the VM has NICs): version 2, each NIC matched by its MAC;
//! - `passage-metadata.json`: the VM's other metadata keys as one JSON object. Not in
//!   `meta-data`: cloud-init copies that into the world-readable
//!   `/run/cloud-init/instance-data.json`, and a tenant's key could override one that
//!   cloud-init acts on (`instance-id`, `public-keys`, …). In the guest, root reads it
//!   with `mount -o ro -L cidata /mnt && cat /mnt/passage-metadata.json`.
//!
//! The YAML files are JSON (a subset of YAML), with the few characters escaped that PyYAML,
//! the YAML 1.1 parser cloud-init uses, refuses or reads as line breaks.

use base64::Engine;
use passage_model::VmId;
use passage_model::protocol::{CloudInitSpec, NicSpec};
use serde_json::json;
use serde_json::ser::{Formatter, PrettyFormatter};
use sha2::Digest;
use std::fmt::Write as _;
use std::io::{Cursor, Write};
use std::path::{Path, PathBuf};

/// The seed's file name in the VM's directory.
pub const SEED_FILE: &str = "seed.img";
/// Where the seed is written before it is renamed into place.
pub const SEED_TMP_FILE: &str = "seed.img.tmp";
/// The volume label cloud-init's NoCloud datasource looks for.
pub const LABEL: &str = "cidata";
/// The file holding the metadata keys cloud-init does not read.
pub const METADATA_FILE: &str = "passage-metadata.json";

/// What the seed may hold at most, all files together: far beyond any real user-data
/// (EC2 allows 16 KiB), and it keeps a tenant from filling the node's disk.
pub const MAX_CONTENT: usize = 32 << 20;
/// The smallest volume made: FAT12 with room to spare.
const MIN_VOLUME: u64 = 1 << 20;
const MIB: u64 = 1 << 20;
/// The largest cluster fatfs picks below 64 MiB is 2 KiB; 4 KiB per file leaves slack.
const CLUSTER_BOUND: u64 = 4096;

/// How a tenant's cloud-config merges into ours (cloud-init's `Merge-Type` header, the
/// MIME form of `merge_how`): lists append (their `ssh_authorized_keys` add to the
/// owner's instead of replacing them); any other key of theirs is new to our part.
/// A tenant's own `merge_how` still comes first, as cloud-init lists it before the header.
pub const MERGE_TYPE: &str = "list(append)+dict(no_replace,recurse_list)+str()";

#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    #[error("NIC {index}: {field}: {reason}")]
    Nic {
        index: usize,
        field: &'static str,
        reason: String,
    },
    #[error("the cloud-init seed would hold {size} bytes, more than the {max} allowed")]
    TooLarge { size: usize, max: usize },
    #[error("building the seed volume: {0}")]
    Volume(std::io::Error),
    #[error("writing the seed {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The files of a seed, as the guest will read them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeedContent {
    pub meta_data: String,
    pub user_data: String,
    /// Absent for a VM without NICs: cloud-init then falls back to DHCP on the first.
    pub network_config: Option<String>,
    pub metadata: String,
    /// The vfat serial (`blkid`'s UUID): from the VM's uuid, so VMs' seeds differ in it.
    pub volume_id: u32,
}

impl SeedContent {
    /// The volume's files: name and content.
    pub fn files(&self) -> Vec<(&'static str, &str)> {
        let mut files = vec![
            ("meta-data", self.meta_data.as_str()),
            ("user-data", self.user_data.as_str()),
        ];
        if let Some(n) = &self.network_config {
            files.push(("network-config", n.as_str()));
        }
        files.push((METADATA_FILE, self.metadata.as_str()));
        files
    }
}

/// The seed's files for VM `vm`. Refuses NICs no guest could be configured with.
pub fn render(vm: VmId, ci: &CloudInitSpec, nics: &[NicSpec]) -> Result<SeedContent, SeedError> {
    for (index, nic) in nics.iter().enumerate() {
        nic.validate().map_err(|(field, reason)| SeedError::Nic {
            index,
            field,
            reason,
        })?;
    }
    let meta_data = yaml(&json!({
        "instance-id": vm.to_string(),
        "local-hostname": ci.hostname,
    }));
    let network_config = (!nics.is_empty()).then(|| network_config(nics));
    let content = SeedContent {
        meta_data,
        user_data: user_data(ci),
        network_config,
        metadata: yaml(&json!(ci.metadata)),
        volume_id: volume_id(vm),
    };
    let size: usize = content.files().iter().map(|(_, c)| c.len()).sum();
    if size > MAX_CONTENT {
        return Err(SeedError::TooLarge {
            size,
            max: MAX_CONTENT,
        });
    }
    Ok(content)
}

/// Writes the seed for VM `vm` to `path` (in practice `DIR/seed.img`): built in memory,
/// written to `seed.img.tmp` beside it, flushed, then renamed, so a guest never sees
/// half a seed. Mode 0600: user-data may hold the tenant's secrets.
pub fn write_seed(
    path: &Path,
    vm: VmId,
    ci: &CloudInitSpec,
    nics: &[NicSpec],
) -> Result<(), SeedError> {
    let content = render(vm, ci, nics)?;
    let volume = build_volume(&content).map_err(SeedError::Volume)?;
    let tmp = path.with_file_name(SEED_TMP_FILE);
    let io_err = |p: &Path| {
        let path = p.to_path_buf();
        move |source| SeedError::Io { path, source }
    };
    {
        let mut f = open_private(&tmp).map_err(io_err(&tmp))?;
        f.write_all(&volume).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        SeedError::Io {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// A new file only the agent may read: one left by a crash is removed first, as its mode
/// may be wider.
fn open_private(path: &Path) -> std::io::Result<std::fs::File> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    o.open(path)
}

/// The volume's size: the files rounded up to a generous cluster each, a sixteenth more,
/// and 512 KiB for the boot sector, both FATs and the root directory, in whole MiB.
pub fn volume_size(content: &SeedContent) -> u64 {
    let data: u64 = content
        .files()
        .iter()
        .map(|(_, c)| (c.len() as u64).div_ceil(CLUSTER_BOUND) * CLUSTER_BOUND)
        .sum();
    let bytes = data + data / 16 + MIB / 2;
    (bytes.div_ceil(MIB) * MIB).max(MIN_VOLUME)
}

/// The last four bytes of the VM's uuid: random in both v4 and v7 uuids.
fn volume_id(vm: VmId) -> u32 {
    let b = vm.0.as_bytes();
    u32::from_be_bytes([b[12], b[13], b[14], b[15]])
}

/// The vfat image of `content`, in memory. Its timestamps are zero (fatfs without a
/// clock), so the same content makes the same bytes.
pub fn build_volume(content: &SeedContent) -> std::io::Result<Vec<u8>> {
    let size = volume_size(content);
    let len = usize::try_from(size).map_err(std::io::Error::other)?;
    let mut disk = Cursor::new(vec![0u8; len]);
    let mut label = [b' '; 11];
    label[..LABEL.len()].copy_from_slice(LABEL.as_bytes());
    fatfs::format_volume(
        &mut disk,
        fatfs::FormatVolumeOptions::new()
            .volume_label(label)
            .volume_id(content.volume_id),
    )?;
    disk.set_position(0);
    {
        let fs = fatfs::FileSystem::new(&mut disk, fatfs::FsOptions::new())?;
        {
            let root = fs.root_dir();
            for (name, text) in content.files() {
                let mut f = root.create_file(name)?;
                f.truncate()?;
                f.write_all(text.as_bytes())?;
                f.flush()?;
            }
        }
        fs.unmount()?;
    }
    Ok(disk.into_inner())
}

/// network-config version 2: each NIC matched by its MAC and named `ethN` in the spec's
/// order, its static address, its MTU, its resolvers, and on the primary NIC the default
/// route. The route is `to: 0.0.0.0/0`: cloud-init 22.4 (Debian 12) refuses `default`.
fn network_config(nics: &[NicSpec]) -> String {
    let mut ethernets = serde_json::Map::new();
    for (i, nic) in nics.iter().enumerate() {
        let name = format!("eth{i}");
        let mut eth = serde_json::Map::new();
        eth.insert("match".into(), json!({ "macaddress": nic.mac }));
        eth.insert("set-name".into(), json!(name));
        eth.insert(
            "addresses".into(),
            json!([format!("{}/{}", nic.ip, nic.prefix_len)]),
        );
        eth.insert("mtu".into(), json!(nic.mtu));
        if let (true, Some(gw)) = (nic.primary, nic.gateway) {
            eth.insert(
                "routes".into(),
                json!([{ "to": "0.0.0.0/0", "via": gw.to_string() }]),
            );
        }
        if !nic.resolvers.is_empty() {
            let addrs: Vec<String> = nic.resolvers.iter().map(ToString::to_string).collect();
            eth.insert("nameservers".into(), json!({ "addresses": addrs }));
        }
        ethernets.insert(name, serde_json::Value::Object(eth));
    }
    yaml(&json!({ "version": 2, "ethernets": ethernets }))
}

/// The user-data: a MIME multipart message (cloud-init walks its parts in order and
/// merges the cloud-configs). Every part we make is base64, so nothing a tenant writes
/// can end a part early or be read as a header.
fn user_data(ci: &CloudInitSpec) -> String {
    let ours = format!(
        "#cloud-config\n{}",
        yaml(&json!({ "ssh_authorized_keys": ci.ssh_authorized_keys }))
    );
    let mut parts = vec![Part::encoded("text/cloud-config", "passage.cfg", &ours)];
    if let Some(ud) = ci.user_data.as_deref().filter(|u| !u.is_empty()) {
        parts.push(if is_mime(ud) {
            // Its own headers start the part, so cloud-init walks into its parts as it
            // would were it the whole user-data.
            Part::Raw(ud.to_string())
        } else {
            let ctype = content_type(ud);
            let mut p = Part::encoded(ctype, "user-data", ud);
            if matches!(ctype, "text/cloud-config" | "text/jinja2") {
                p = p.header("Merge-Type", MERGE_TYPE);
            }
            p
        });
    }
    if let Some(us) = ci.user_script.as_deref().filter(|u| !u.is_empty()) {
        // cloud-init executes the part directly: without an interpreter line the kernel
        // refuses it (ENOEXEC), where the tenant meant a shell script.
        let script = if us.starts_with("#!") {
            us.to_string()
        } else {
            format!("#!/bin/sh\n{us}")
        };
        parts.push(Part::encoded("text/x-shellscript", "user-script", &script));
    }
    let boundary = boundary(&parts);
    let mut out =
        format!("Content-Type: multipart/mixed; boundary=\"{boundary}\"\nMIME-Version: 1.0\n\n");
    for p in &parts {
        let _ = write!(out, "--{boundary}\n{}\n", p.render());
    }
    let _ = writeln!(out, "--{boundary}--");
    out
}

enum Part {
    Encoded {
        headers: Vec<(&'static str, String)>,
        body: String,
    },
    /// A tenant's own MIME message, headers and all.
    Raw(String),
}

impl Part {
    fn encoded(ctype: &str, filename: &str, text: &str) -> Part {
        Part::Encoded {
            headers: vec![
                ("Content-Type", format!("{ctype}; charset=\"utf-8\"")),
                ("MIME-Version", "1.0".into()),
                ("Content-Transfer-Encoding", "base64".into()),
                (
                    "Content-Disposition",
                    format!("attachment; filename=\"{filename}\""),
                ),
            ],
            body: base64_lines(text.as_bytes()),
        }
    }

    fn header(mut self, name: &'static str, value: &str) -> Part {
        if let Part::Encoded { headers, .. } = &mut self {
            headers.push((name, value.to_string()));
        }
        self
    }

    fn render(&self) -> String {
        match self {
            Part::Encoded { headers, body } => {
                let mut s = String::new();
                for (k, v) in headers {
                    let _ = writeln!(s, "{k}: {v}");
                }
                s.push('\n');
                s.push_str(body);
                s
            }
            Part::Raw(text) => {
                let mut s = text.clone();
                if !s.ends_with('\n') {
                    s.push('\n');
                }
                s
            }
        }
    }
}

/// Base64 in lines of 76, as MIME asks.
fn base64_lines(bytes: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
    let mut out = String::with_capacity(b64.len() + b64.len() / 76 + 1);
    for chunk in b64.as_bytes().chunks(76) {
        // Base64 is ASCII, so every chunk is whole characters.
        out.push_str(&String::from_utf8_lossy(chunk));
        out.push('\n');
    }
    out
}

/// A boundary found in no part. Base64 never holds '-', so only a tenant's raw MIME
/// message could hold one: the digest of the parts, counted up until none does.
fn boundary(parts: &[Part]) -> String {
    let rendered: Vec<String> = parts.iter().map(Part::render).collect();
    let mut h = sha2::Sha256::new();
    for r in &rendered {
        h.update(r.as_bytes());
    }
    let digest = h.finalize();
    let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
    (0u64..)
        .map(|n| format!("==passage-{hex}-{n}=="))
        .find(|b| !rendered.iter().any(|r| r.contains(b.as_str())))
        .unwrap_or_default()
}

/// Whether cloud-init would read this user-data as a MIME message: its test, verbatim
/// (`mime-version:` in the first 4096 bytes, any case).
fn is_mime(user_data: &str) -> bool {
    let head = &user_data.as_bytes()[..user_data.len().min(4096)];
    head.to_ascii_lowercase()
        .windows(b"mime-version:".len())
        .any(|w| w == b"mime-version:")
}

/// The content type cloud-init gives user-data by its start (cloud-init's
/// `INCLUSION_TYPES_MAP`: the longest prefix, any case, after leading white space);
/// `text/x-not-multipart` for anything else, the type cloud-init gives such user-data
/// itself, so it is handled (or ignored with a warning) exactly as it would be alone.
pub fn content_type(user_data: &str) -> &'static str {
    const TYPES: &[(&str, &str)] = &[
        ("#cloud-config-archive", "text/cloud-config-archive"),
        ("#cloud-config-jsonp", "text/cloud-config-jsonp"),
        ("## template: jinja", "text/jinja2"),
        ("#cloud-boothook", "text/cloud-boothook"),
        ("#include-once", "text/x-include-once-url"),
        ("#part-handler", "text/part-handler"),
        ("#cloud-config", "text/cloud-config"),
        ("#include", "text/x-include-url"),
        ("#!", "text/x-shellscript"),
    ];
    // The longest prefix is 21 characters: no need to lower the whole user-data.
    let start = user_data
        .trim_start()
        .chars()
        .take(32)
        .collect::<String>()
        .to_lowercase();
    TYPES
        .iter()
        .find(|(prefix, _)| start.starts_with(prefix))
        .map_or("text/x-not-multipart", |(_, t)| t)
}

/// `v` as JSON that PyYAML reads back as the same value (with a final newline).
pub fn yaml(v: &serde_json::Value) -> String {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, YamlSafe::default());
    // Writing a Value into a Vec fails only on a non-string map key, which a Value has not.
    if serde::Serialize::serialize(v, &mut ser).is_err() {
        return "{}\n".into();
    }
    let mut s = String::from_utf8_lossy(&out).into_owned();
    s.push('\n');
    s
}

/// Characters JSON writes raw that YAML 1.1 refuses in a document (DEL, the C1
/// controls, the non-characters U+FFFE/U+FFFF, a BOM) or reads as a line break inside
/// a quoted string (NEL, U+2028, U+2029). All are in the BMP: one `\uXXXX` each.
fn yaml_needs_escape(c: char) -> bool {
    matches!(
        c,
        '\u{7f}'..='\u{9f}' | '\u{2028}' | '\u{2029}' | '\u{feff}' | '\u{fffe}' | '\u{ffff}'
    )
}

/// serde_json's pretty printer with [`yaml_needs_escape`]'s characters escaped.
#[derive(Default)]
struct YamlSafe(PrettyFormatter<'static>);

impl Formatter for YamlSafe {
    fn write_string_fragment<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        let mut start = 0;
        for (i, c) in fragment.char_indices() {
            if yaml_needs_escape(c) {
                w.write_all(&fragment.as_bytes()[start..i])?;
                write!(w, "\\u{:04x}", u32::from(c))?;
                start = i + c.len_utf8();
            }
        }
        w.write_all(&fragment.as_bytes()[start..])
    }

    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_array(w)
    }
    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array(w)
    }
    fn begin_array_value<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.0.begin_array_value(w, first)
    }
    fn end_array_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array_value(w)
    }
    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object(w)
    }
    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object(w)
    }
    fn begin_object_key<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.0.begin_object_key(w, first)
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object_value(w)
    }
    fn end_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object_value(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;
    use std::io::Read;

    fn vm() -> VmId {
        "6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10".parse().unwrap()
    }

    fn nic(mac: &str, ip: &str, primary: bool) -> NicSpec {
        NicSpec {
            mac: mac.into(),
            ip: ip.parse().unwrap(),
            prefix_len: 24,
            gateway: Some("10.0.2.2".parse().unwrap()),
            resolvers: vec!["10.0.2.3".parse().unwrap(), "2001:db8::53".parse().unwrap()],
            bridge: "br0".into(),
            vlan_id: 0,
            mtu: 1500,
            primary,
        }
    }

    fn spec() -> CloudInitSpec {
        CloudInitSpec {
            hostname: "web-1".into(),
            ssh_authorized_keys: vec!["ssh-ed25519 AAAAC3Nza owner@laptop".into()],
            user_data: None,
            user_script: None,
            metadata: BTreeMap::new(),
        }
    }

    /// The files of a volume, read back with fatfs, and its labels (boot sector, root
    /// directory entry).
    fn read_volume(bytes: &[u8]) -> (String, Option<String>, BTreeMap<String, String>) {
        let fs =
            fatfs::FileSystem::new(Cursor::new(bytes.to_vec()), fatfs::FsOptions::new()).unwrap();
        let label = fs.volume_label();
        let dir_label = fs.read_volume_label_from_root_dir().unwrap();
        let mut files = BTreeMap::new();
        for e in fs.root_dir().iter() {
            let e = e.unwrap();
            let mut text = String::new();
            e.to_file().read_to_string(&mut text).unwrap();
            files.insert(e.file_name(), text);
        }
        (label, dir_label, files)
    }

    /// A MIME part: its headers (names in lower case) and its body, base64 decoded.
    #[derive(Debug)]
    struct MimePart {
        headers: BTreeMap<String, String>,
        body: String,
    }

    /// The parts of our multipart user-data, split at the boundary its header names
    /// (enough for the messages this module writes; cloud-init uses Python's parser).
    fn mime_parts(user_data: &str) -> Vec<MimePart> {
        let first = user_data.lines().next().unwrap();
        let boundary = first
            .split("boundary=\"")
            .nth(1)
            .and_then(|b| b.strip_suffix('"'))
            .unwrap_or_else(|| panic!("no boundary in {first:?}"));
        assert!(user_data.contains("\nMIME-Version: 1.0\n\n"));
        let close = format!("\n--{boundary}--\n");
        assert!(user_data.ends_with(&close), "{user_data}");
        let body = &user_data[..user_data.len() - close.len() + 1];
        body.split(&format!("--{boundary}\n"))
            .skip(1)
            .map(|raw| {
                let (head, body) = raw.split_once("\n\n").unwrap();
                let headers: BTreeMap<String, String> = head
                    .lines()
                    .map(|l| {
                        let (k, v) = l.split_once(": ").unwrap();
                        (k.to_ascii_lowercase(), v.to_string())
                    })
                    .collect();
                let body = if headers.get("content-transfer-encoding").map(String::as_str)
                    == Some("base64")
                {
                    for line in body.lines() {
                        assert!(line.len() <= 76, "{line}");
                    }
                    let joined: String = body.lines().collect();
                    String::from_utf8(
                        base64::engine::general_purpose::STANDARD
                            .decode(joined)
                            .unwrap(),
                    )
                    .unwrap()
                } else {
                    body.to_string()
                };
                MimePart { headers, body }
            })
            .collect()
    }

    fn cloud_config(text: &str) -> serde_json::Value {
        let json = text.strip_prefix("#cloud-config\n").unwrap();
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn the_volume_is_labelled_cidata_and_holds_the_files() {
        let mut ci = spec();
        ci.metadata.insert("role".into(), "db".into());
        let content = render(vm(), &ci, &[nic("52:54:00:12:34:56", "10.0.2.15", true)]).unwrap();
        let volume = build_volume(&content).unwrap();
        assert_eq!(volume.len() as u64, MIN_VOLUME);
        let (label, dir_label, files) = read_volume(&volume);
        assert_eq!(label, "cidata");
        assert_eq!(dir_label.as_deref(), Some("cidata"));
        let fs =
            fatfs::FileSystem::new(Cursor::new(volume.clone()), fatfs::FsOptions::new()).unwrap();
        assert_eq!(fs.volume_id(), 0x1b7c_9a10, "the uuid's last four bytes");
        let names: Vec<&str> = files.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            ["meta-data", "network-config", METADATA_FILE, "user-data"]
        );
        assert_eq!(files["user-data"], content.user_data);
        let md: serde_json::Value = serde_json::from_str(&files["meta-data"]).unwrap();
        assert_eq!(
            md,
            json!({"instance-id": vm().to_string(), "local-hostname": "web-1"})
        );
        let other: serde_json::Value = serde_json::from_str(&files[METADATA_FILE]).unwrap();
        assert_eq!(other, json!({"role": "db"}));

        // The same content, the same bytes: a restarted VM gets an identical seed.
        assert_eq!(build_volume(&content).unwrap(), volume);
    }

    #[test]
    fn a_vm_without_nics_has_no_network_config() {
        let content = render(vm(), &spec(), &[]).unwrap();
        assert_eq!(content.network_config, None);
        let (_, _, files) = read_volume(&build_volume(&content).unwrap());
        assert!(!files.contains_key("network-config"));
        assert_eq!(files[METADATA_FILE].trim(), "{}");
    }

    #[test]
    fn network_config_matches_each_nic_by_mac() {
        let mut second = nic("52:54:00:00:00:02", "192.168.7.9", false);
        second.prefix_len = 16;
        second.mtu = 9000;
        second.resolvers.clear();
        let content = render(
            vm(),
            &spec(),
            &[nic("52:54:00:12:34:56", "10.0.2.15", true), second],
        )
        .unwrap();
        let net: serde_json::Value =
            serde_json::from_str(content.network_config.as_deref().unwrap()).unwrap();
        assert_eq!(
            net,
            json!({
                "version": 2,
                "ethernets": {
                    "eth0": {
                        "match": {"macaddress": "52:54:00:12:34:56"},
                        "set-name": "eth0",
                        "addresses": ["10.0.2.15/24"],
                        "mtu": 1500,
                        "routes": [{"to": "0.0.0.0/0", "via": "10.0.2.2"}],
                        "nameservers": {"addresses": ["10.0.2.3", "2001:db8::53"]},
                    },
                    // Not the primary: no default route, though its network has a gateway.
                    "eth1": {
                        "match": {"macaddress": "52:54:00:00:00:02"},
                        "set-name": "eth1",
                        "addresses": ["192.168.7.9/16"],
                        "mtu": 9000,
                    },
                },
            })
        );
    }

    #[test]
    fn a_nic_no_guest_could_use_is_refused_by_name() {
        let mut bad = nic("52:54:00:12:34:56", "10.0.2.15", true);
        bad.mac = "52:54:00:12:34".into();
        let e = render(
            vm(),
            &spec(),
            &[nic("52:54:00:00:00:01", "10.0.2.16", true), bad],
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                SeedError::Nic {
                    index: 1,
                    field: "mac",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().starts_with("NIC 1: mac:"), "{e}");

        let mut bad = nic("52:54:00:12:34:56", "10.0.2.15", true);
        bad.prefix_len = 33;
        let e = render(vm(), &spec(), &[bad]).unwrap_err();
        assert!(
            matches!(
                e,
                SeedError::Nic {
                    field: "prefix_len",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn only_the_owners_keys_without_tenant_data() {
        let parts = mime_parts(&render(vm(), &spec(), &[]).unwrap().user_data);
        assert_eq!(parts.len(), 1);
        assert_eq!(
            parts[0].headers["content-type"],
            "text/cloud-config; charset=\"utf-8\""
        );
        assert_eq!(
            cloud_config(&parts[0].body),
            json!({"ssh_authorized_keys": ["ssh-ed25519 AAAAC3Nza owner@laptop"]})
        );

        // An empty user-data or user-script is none.
        let mut ci = spec();
        ci.user_data = Some(String::new());
        ci.user_script = Some(String::new());
        assert_eq!(
            mime_parts(&render(vm(), &ci, &[]).unwrap().user_data).len(),
            1
        );
    }

    #[test]
    fn a_tenant_cloud_config_appends_to_the_owners_keys() {
        let mut ci = spec();
        let tenant = "#cloud-config\nssh_authorized_keys:\n  - ssh-rsa AAAAB3 \"tenant\"\nruncmd:\n  - [sh, -c, 'echo héllo']\n";
        ci.user_data = Some(tenant.into());
        ci.user_script = Some("#!/bin/bash\necho done\n".into());
        let parts = mime_parts(&render(vm(), &ci, &[]).unwrap().user_data);
        assert_eq!(parts.len(), 3);
        assert_eq!(
            parts[1].headers["content-type"],
            "text/cloud-config; charset=\"utf-8\""
        );
        assert_eq!(parts[1].headers["merge-type"], MERGE_TYPE);
        assert_eq!(
            parts[1].body, tenant,
            "the tenant's part is theirs, unchanged"
        );
        assert_eq!(
            parts[2].headers["content-type"],
            "text/x-shellscript; charset=\"utf-8\""
        );
        assert_eq!(parts[2].body, "#!/bin/bash\necho done\n");
        // Scripts land in one directory under their file names: two must differ.
        assert!(parts[1].headers["content-disposition"].contains("\"user-data\""));
        assert!(parts[2].headers["content-disposition"].contains("\"user-script\""));
    }

    #[test]
    fn each_kind_of_user_data_gets_its_content_type() {
        for (text, ctype) in [
            ("#cloud-config\nhostname: x\n", "text/cloud-config"),
            ("  \n#Cloud-Config\n{}", "text/cloud-config"),
            ("#!/usr/bin/env python3\nprint(1)\n", "text/x-shellscript"),
            ("#cloud-boothook\n#!/bin/sh\n", "text/cloud-boothook"),
            (
                "#cloud-config-archive\n- type: text/x-shellscript\n",
                "text/cloud-config-archive",
            ),
            ("#cloud-config-jsonp\n[]", "text/cloud-config-jsonp"),
            ("## template: jinja\n#cloud-config\n", "text/jinja2"),
            ("#include\nhttp://example.com/x\n", "text/x-include-url"),
            (
                "#include-once\nhttp://example.com/x\n",
                "text/x-include-once-url",
            ),
            (
                "#part-handler\ndef list_types(): pass\n",
                "text/part-handler",
            ),
            ("just some text\n", "text/x-not-multipart"),
            ("\u{1F600}", "text/x-not-multipart"),
        ] {
            assert_eq!(content_type(text), ctype, "{text:?}");
            let mut ci = spec();
            ci.user_data = Some(text.into());
            let parts = mime_parts(&render(vm(), &ci, &[]).unwrap().user_data);
            assert_eq!(
                parts[1].headers["content-type"],
                format!("{ctype}; charset=\"utf-8\"")
            );
            assert_eq!(parts[1].body, text);
            assert_eq!(
                parts[1].headers.contains_key("merge-type"),
                matches!(ctype, "text/cloud-config" | "text/jinja2"),
                "{ctype}"
            );
        }
    }

    #[test]
    fn a_user_script_without_an_interpreter_line_runs_under_sh() {
        let mut ci = spec();
        ci.user_script = Some("echo \"hi\" > /dev/ttyS0\n".into());
        let parts = mime_parts(&render(vm(), &ci, &[]).unwrap().user_data);
        assert_eq!(parts[1].body, "#!/bin/sh\necho \"hi\" > /dev/ttyS0\n");
    }

    #[test]
    fn a_tenant_mime_message_is_a_part_of_its_own() {
        let mut ci = spec();
        let inner = "Content-Type: multipart/mixed; boundary=\"x\"\nMIME-Version: 1.0\n\n\
                     --x\nContent-Type: text/x-shellscript\n\n#!/bin/sh\necho in\n--x--\n";
        ci.user_data = Some(inner.into());
        let ud = render(vm(), &ci, &[]).unwrap().user_data;
        let b = ud
            .lines()
            .next()
            .and_then(|l| l.split("boundary=\"").nth(1))
            .and_then(|b| b.strip_suffix('"'))
            .unwrap();
        assert!(!inner.contains(b), "{b}");
        // It follows our part verbatim, its headers first, so cloud-init walks into it.
        let tail = ud.split(&format!("--{b}\n")).nth(2).unwrap();
        // (The line break before a boundary belongs to the boundary, not the part.)
        assert_eq!(tail, format!("{inner}\n--{b}--\n"));

        assert!(is_mime(inner));
        assert!(is_mime("#!/bin/sh\n# mime-VERSION: 1.0\n"));
        assert!(!is_mime("#cloud-config\n"));
        // Past 4096 bytes it is not MIME, to cloud-init or to us.
        let late = format!("#!/bin/sh\n{}\n# MIME-Version: 1.0\n", " ".repeat(4096));
        assert!(!is_mime(&late));
    }

    #[test]
    fn tenant_text_is_escaped_for_yaml() {
        let mut ci = spec();
        ci.hostname = "wé\"b'\n\t:{}[]#&*!|>%@`\u{7f}\u{85}\u{2028}\u{feff}😀".into();
        ci.ssh_authorized_keys
            .push("ssh-ed25519 AAAA \"quoted\"\nnext: line".into());
        ci.metadata
            .insert("k\"ey\n".into(), "v\u{2029}al\\ue".into());
        let content = render(vm(), &ci, &[]).unwrap();
        for text in [&content.meta_data, &content.metadata] {
            // Only what YAML 1.1 reads as itself: no refused characters, and no line
            // break but those between JSON's tokens.
            for c in text.chars() {
                assert!(
                    !yaml_needs_escape(c) && (c >= ' ' || c == '\n'),
                    "{c:?} in {text}"
                );
            }
        }
        let md: serde_json::Value = serde_json::from_str(&content.meta_data).unwrap();
        assert_eq!(md["local-hostname"], ci.hostname.as_str());
        let other: BTreeMap<String, String> = serde_json::from_str(&content.metadata).unwrap();
        assert_eq!(other, ci.metadata);
        let keys = cloud_config(&mime_parts(&content.user_data)[0].body);
        assert_eq!(
            keys["ssh_authorized_keys"][1],
            ci.ssh_authorized_keys[1].as_str()
        );
    }

    #[test]
    fn the_volume_grows_with_its_content_and_has_a_limit() {
        let mut ci = spec();
        ci.user_script = Some(format!("#!/bin/sh\n# {}\n", "x".repeat(5 << 20)));
        let content = render(vm(), &ci, &[]).unwrap();
        let volume = build_volume(&content).unwrap();
        assert!(volume.len() as u64 > 6 * MIB, "{}", volume.len());
        assert!((volume.len() as u64) < 10 * MIB, "{}", volume.len());
        let (_, _, files) = read_volume(&volume);
        assert_eq!(files["user-data"], content.user_data);

        // Near the limit (base64 in lines makes 35% more): still fits.
        ci.user_script = Some("x".repeat(MAX_CONTENT / 100 * 73));
        let content = render(vm(), &ci, &[]).unwrap();
        let (_, _, files) = read_volume(&build_volume(&content).unwrap());
        assert_eq!(files["user-data"].len(), content.user_data.len());

        ci.user_script = Some("x".repeat(MAX_CONTENT));
        let e = render(vm(), &ci, &[]).unwrap_err();
        assert!(matches!(e, SeedError::TooLarge { .. }), "{e}");
    }

    #[test]
    fn the_seed_is_written_whole_and_private() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SEED_FILE);
        std::fs::write(dir.path().join(SEED_TMP_FILE), b"left from a crash").unwrap();
        write_seed(&path, vm(), &spec(), &[]).unwrap();
        assert!(!dir.path().join(SEED_TMP_FILE).exists());
        let (label, _, files) = read_volume(&std::fs::read(&path).unwrap());
        assert_eq!(label, "cidata");
        assert!(files.contains_key("user-data"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        // Written again (a restart): replaced in place.
        let mut ci = spec();
        ci.hostname = "renamed".into();
        write_seed(&path, vm(), &ci, &[]).unwrap();
        let (_, _, files) = read_volume(&std::fs::read(&path).unwrap());
        assert!(files["meta-data"].contains("renamed"));

        let e =
            write_seed(&dir.path().join("no/such/dir/seed.img"), vm(), &spec(), &[]).unwrap_err();
        assert!(e.to_string().contains("seed.img.tmp"), "{e}");
    }

    proptest! {
        #[test]
        fn any_string_survives_the_yaml_writer(s in any::<String>()) {
            let text = yaml(&json!({ s.clone(): s.clone() }));
            for c in text.chars() {
                prop_assert!(!yaml_needs_escape(c) && (c >= ' ' || c == '\n'));
            }
            let back: BTreeMap<String, String> = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(back.get(&s), Some(&s));
        }
    }
}
