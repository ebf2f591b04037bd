//! What a list asks for and what a page of it holds: page requests, cursors and the
//! filters of each list. Neutral ground between the HTTP layer, which reads them from a
//! query string, the services, which narrow them to what a caller may see, and the store,
//! which turns them into SQL: none of the three owns them, so none imports another's
//! types to name them.
//!
//! A list is read in a total order; a page asks for the items strictly after the key of
//! the last item it was given. The key travels as an opaque cursor string with a strict
//! format: any string of that format is a valid cursor (its values need not name an object
//! that exists, they are only compared), anything else is refused.
//!
//! - time-ordered lists (servers, VMs, jobs: newest first, uuid descending among equal
//!   times): `<created_at ms>.<uuid>`, for example
//!   `1767225600000.0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44`;
//! - devices (hostname, then server uuid, then device id, ascending):
//!   `<hostname>~<server uuid>~<device id>`.

use passage_model::api::{JobState, ServerStatus, VmState};
use passage_model::{AccountId, DeviceState, ImageId, ServerId};

/// The OpenAPI pattern of [`TimeKey`] cursors.
pub const TIME_CURSOR_PATTERN: &str =
    "^[0-9]{1,18}\\.[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$";
/// The OpenAPI pattern of [`DeviceKey`] cursors.
pub const DEVICE_CURSOR_PATTERN: &str = "^[A-Za-z0-9._-]{1,253}~[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}~[A-Za-z0-9:./]{1,512}$";

/// Longest cursor accepted: well above the longest one made (a 253-byte hostname, a uuid
/// and a device path of at most `MAX_DEVICE_PATH_LEN`).
pub const MAX_CURSOR_LEN: usize = 1024;

/// Where a page starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Start<K> {
    /// Skip this many items (Triton's `offset`).
    Offset(i64),
    /// The items strictly after this key, less the first `n` of them (`?after=…&offset=n`).
    After(K, i64),
}

/// A page request: at most `limit` items from `start`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageReq<K> {
    pub limit: i64,
    pub start: Start<K>,
}

impl<K> PageReq<K> {
    pub fn offset(limit: i64, offset: i64) -> Self {
        PageReq {
            limit,
            start: Start::Offset(offset),
        }
    }
}

/// One page: its items, how many match the filters in all, and the key of the last item
/// when more follow.
#[derive(Clone, Debug)]
pub struct Page<T, K> {
    pub items: Vec<T>,
    pub total: i64,
    pub next: Option<K>,
}

impl<T, K> Page<T, K> {
    pub fn map<U>(self, f: impl FnMut(T) -> U) -> Page<U, K> {
        Page {
            items: self.items.into_iter().map(f).collect(),
            total: self.total,
            next: self.next,
        }
    }
}

/// A key that travels as a cursor string.
pub trait Cursor: Sized {
    /// The OpenAPI pattern of this kind of cursor: exactly the strings `decode` takes
    /// (within [`MAX_CURSOR_LEN`]).
    const PATTERN: &'static str;
    fn encode(&self) -> String;
    /// `None` for anything that is not exactly a cursor of this kind.
    fn decode(s: &str) -> Option<Self>;
}

/// A uuid written as 8-4-4-4-12 hexadecimal digits (either case), lowercased; nothing
/// else (no braces, no urn, no simple form).
fn strict_uuid(s: &str) -> Option<String> {
    let b = s.as_bytes();
    if b.len() != 36 {
        return None;
    }
    for (i, c) in b.iter().enumerate() {
        let ok = if matches!(i, 8 | 13 | 18 | 23) {
            *c == b'-'
        } else {
            c.is_ascii_hexdigit()
        };
        if !ok {
            return None;
        }
    }
    Some(s.to_ascii_lowercase())
}

/// The key of a list read newest first: `created_at` descending, then uuid descending.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimeKey {
    pub created_at_ms: i64,
    /// As stored (lowercase, hyphenated); a decoded cursor's is lowercased.
    pub uuid: String,
}

impl TimeKey {
    pub fn new(created_at_ms: i64, uuid: impl std::fmt::Display) -> Self {
        TimeKey {
            created_at_ms,
            uuid: uuid.to_string(),
        }
    }
}

impl Cursor for TimeKey {
    const PATTERN: &'static str = TIME_CURSOR_PATTERN;

    fn encode(&self) -> String {
        format!("{}.{}", self.created_at_ms, self.uuid)
    }

    fn decode(s: &str) -> Option<Self> {
        let (ms, uuid) = s.split_once('.')?;
        if ms.is_empty() || ms.len() > 18 || !ms.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        Some(TimeKey {
            created_at_ms: ms.parse().ok()?,
            uuid: strict_uuid(uuid)?,
        })
    }
}

/// The key of the device list: hostname, server uuid, device id, ascending.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceKey {
    pub hostname: String,
    pub server_uuid: String,
    pub id: String,
}

impl DeviceKey {
    pub fn new(hostname: &str, server: impl std::fmt::Display, id: &str) -> Self {
        DeviceKey {
            hostname: hostname.to_string(),
            server_uuid: server.to_string(),
            id: id.to_string(),
        }
    }
}

fn hostname_ok(h: &str) -> bool {
    (1..=253).contains(&h.len())
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
}

fn device_id_ok(id: &str) -> bool {
    (1..=512).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b':' | b'.' | b'/'))
}

impl Cursor for DeviceKey {
    const PATTERN: &'static str = DEVICE_CURSOR_PATTERN;

    fn encode(&self) -> String {
        format!("{}~{}~{}", self.hostname, self.server_uuid, self.id)
    }

    fn decode(s: &str) -> Option<Self> {
        let mut parts = s.split('~');
        let (hostname, server, id) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || !hostname_ok(hostname) || !device_id_ok(id) {
            return None;
        }
        Some(DeviceKey {
            hostname: hostname.to_string(),
            server_uuid: strict_uuid(server)?,
            id: id.to_string(),
        })
    }
}

/// Which VMs a page lists.
#[derive(Clone, Debug, Default)]
pub struct VmFilter {
    pub owner: Option<AccountId>,
    pub state: Option<VmState>,
    pub server: Option<ServerId>,
    pub assigned_device: Option<String>,
    /// Only VMs built from this image.
    pub image: Option<ImageId>,
    /// Only VMs of this alias.
    pub alias: Option<String>,
    /// Leave destroyed VMs out.
    pub live: bool,
    /// Only VMs of this much memory.
    pub memory_mib: Option<u64>,
    /// Only VMs with each of these tags, by key, whose value's JSON text is one of those
    /// given (`passage_model::tags::filter_texts`).
    pub tags: Vec<(String, Vec<String>)>,
}

/// Which assignable devices the fleet-wide list shows.
#[derive(Clone, Debug, Default)]
pub struct DeviceFilter {
    pub state: Option<DeviceState>,
    pub variant: Option<String>,
    pub server: Option<ServerId>,
}

/// Which jobs a page lists.
#[derive(Clone, Copy, Debug, Default)]
pub struct JobFilter {
    /// Only the jobs on this account's VMs.
    pub owner: Option<AccountId>,
    pub state: Option<JobState>,
}

/// Which servers a page lists, by status (derived from the last heartbeat as
/// `services::servers::status` does).
#[derive(Clone, Copy, Debug, Default)]
pub struct ServerFilter {
    pub status: Option<ServerStatus>,
    /// The oldest heartbeat of a running server (ms since the epoch).
    pub alive_after_ms: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_cursors_round_trip_and_refuse_everything_else() {
        let k = TimeKey::new(1_767_225_600_000, "0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44");
        let s = k.encode();
        assert_eq!(s, "1767225600000.0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44");
        assert_eq!(TimeKey::decode(&s), Some(k.clone()));
        assert_eq!(
            TimeKey::decode("1767225600000.0F8E6A8C-3C64-4F7E-9B1A-2D7C1E0B5A44"),
            Some(k)
        );
        for bad in [
            "",
            ".",
            "1.",
            ".0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44",
            "-1.0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44",
            "+1.0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44",
            "1234567890123456789.0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44",
            "1.0f8e6a8c3c644f7e9b1a2d7c1e0b5a44",
            "1.{0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44}",
            "1.0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a4g",
            "1.0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44.",
            "1.0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44 ",
            "1.0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a4é",
            "١.0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44",
        ] {
            assert_eq!(TimeKey::decode(bad), None, "{bad:?}");
        }
        assert_eq!(
            TimeKey::decode("000000000000000001.00000000-0000-0000-0000-000000000000")
                .map(|k| k.created_at_ms),
            Some(1)
        );
    }

    #[test]
    fn device_cursors_round_trip_and_refuse_everything_else() {
        let server: passage_model::ServerId =
            "0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44".parse().unwrap();
        let k = DeviceKey::new(
            "cn-7.example",
            server,
            "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0",
        );
        let s = k.encode();
        assert_eq!(
            s,
            "cn-7.example~0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44~\
             /devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0"
        );
        assert_eq!(DeviceKey::decode(&s), Some(k));
        let id = "/devices/pci0000:3a/0000:3b:00.0";
        let u = "0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44";
        for bad in [
            String::new(),
            "~~".into(),
            format!("~{u}~{id}"),
            format!("cn~{u}~"),
            format!("cn~{u}"),
            format!("cn~{u}~{id}~"),
            format!("c n~{u}~{id}"),
            format!("cn~{u}~{id}?"),
            format!("cn~x{u}~{id}"),
            format!("{}~{u}~{id}", "h".repeat(254)),
            format!("cn~{u}~{}", "/".repeat(513)),
            format!("cn\0~{u}~{id}"),
        ] {
            assert_eq!(DeviceKey::decode(&bad), None, "{bad:?}");
        }
    }
}
