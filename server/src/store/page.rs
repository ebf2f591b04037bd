//! Keyset (cursor) pages for lists, and a small builder for their `WHERE` clauses.
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

use super::{Db, StoreResult};
use crate::on_read;

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

/// A value bound to a `$N` placeholder of a built query.
#[derive(Clone, Debug)]
pub enum Arg {
    Text(String),
    Int(i64),
    /// A NULL in a text column.
    Null,
}

/// `WHERE` conditions and the values they bind, numbered in order.
#[derive(Clone, Debug, Default)]
pub struct Where {
    conds: Vec<String>,
    pub args: Vec<Arg>,
}

impl Where {
    /// Records a value; answers its placeholder (`$N`).
    pub fn arg(&mut self, a: Arg) -> String {
        self.args.push(a);
        format!("${}", self.args.len())
    }

    pub fn text(&mut self, s: impl Into<String>) -> String {
        self.arg(Arg::Text(s.into()))
    }

    pub fn int(&mut self, i: i64) -> String {
        self.arg(Arg::Int(i))
    }

    /// Adds a condition (written with placeholders from `arg`).
    pub fn and(&mut self, cond: impl Into<String>) {
        self.conds.push(cond.into());
    }

    /// ` WHERE a AND b`, or nothing.
    pub fn sql(&self) -> String {
        if self.conds.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", self.conds.join(" AND "))
        }
    }
}

/// Binds `$args` (a `&[Arg]`) to the query `$q` in order.
#[macro_export]
macro_rules! bind_args {
    ($q:expr, $args:expr) => {{
        let mut q = $q;
        for a in $args {
            q = match a {
                $crate::store::page::Arg::Text(s) => q.bind(s.as_str()),
                $crate::store::page::Arg::Int(i) => q.bind(*i),
                $crate::store::page::Arg::Null => q.bind(None::<String>),
            };
        }
        q
    }};
}

/// Splits the `limit + 1` rows a page query read: when the extra row came, more items
/// follow, and the next page starts after the last row kept.
pub fn split<R>(mut rows: Vec<R>, limit: i64) -> (Vec<R>, bool) {
    let keep = usize::try_from(limit).unwrap_or(0);
    let more = rows.len() > keep;
    rows.truncate(keep);
    (rows, more)
}

/// Rows of a built query, on either backend.
pub async fn fetch<R>(db: &Db, sql: &str, args: &[Arg]) -> StoreResult<Vec<R>>
where
    R: for<'r> sqlx::FromRow<'r, sqlx::sqlite::SqliteRow>
        + for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>
        + Send
        + Unpin,
{
    Ok(on_read!(db, |p| bind_args!(
        sqlx::query_as::<_, R>(sql),
        args
    )
    .fetch_all(p)
    .await)?)
}

/// The one number a built `SELECT COUNT(*) …` answers.
pub async fn count(db: &Db, sql: &str, args: &[Arg]) -> StoreResult<i64> {
    Ok(on_read!(db, |p| bind_args!(
        sqlx::query_scalar::<_, i64>(sql),
        args
    )
    .fetch_one(p)
    .await)?)
}

/// One page of a list read newest first (`created_at DESC, uuid DESC`, a total order since
/// uuids are unique) from `from` (a table, or tables joined, whose `created_at` and `uuid`
/// columns are unqualified) under the conditions `w`: `cols` of at most `req.limit` rows,
/// the count of all rows matching `w`, and the key after which the next page starts.
pub async fn newest_first<R>(
    db: &Db,
    cols: &str,
    from: &str,
    mut w: Where,
    req: &PageReq<TimeKey>,
    key: impl Fn(&R) -> TimeKey,
) -> StoreResult<Page<R, TimeKey>>
where
    R: for<'r> sqlx::FromRow<'r, sqlx::sqlite::SqliteRow>
        + for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>
        + Send
        + Unpin,
{
    let total = count(
        db,
        &format!("SELECT COUNT(*) FROM {from}{}", w.sql()),
        &w.args,
    )
    .await?;
    let offset = match &req.start {
        Start::Offset(n) => *n,
        Start::After(k, skip) => {
            let t = w.int(k.created_at_ms);
            let u = w.text(k.uuid.clone());
            w.and(format!("(created_at, uuid) < ({t}, {u})"));
            *skip
        }
    };
    let lim = w.int(req.limit.saturating_add(1));
    let off = w.int(offset);
    let sql = format!(
        "SELECT {cols} FROM {from}{} ORDER BY created_at DESC, uuid DESC LIMIT {lim} OFFSET {off}",
        w.sql()
    );
    let rows: Vec<R> = fetch(db, &sql, &w.args).await?;
    let (items, more) = split(rows, req.limit);
    let next = if more { items.last().map(key) } else { None };
    Ok(Page { items, total, next })
}

/// `$first, $first+1, …` for `n` values: the inside of an `IN (…)`.
/// Placeholder rows `($a, $b, …), (…)` of a multi-row `VALUES`: `rows` rows of `width`
/// values, numbered from `$first`.
pub fn value_rows(first: usize, rows: usize, width: usize) -> String {
    (0..rows)
        .map(|r| format!("({})", marks(first + r * width, width)))
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn marks(first: usize, n: usize) -> String {
    (first..first + n)
        .map(|i| format!("${i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholder_rows() {
        assert_eq!(value_rows(2, 2, 3), "($2, $3, $4), ($5, $6, $7)");
    }

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

    #[test]
    fn where_numbers_its_placeholders() {
        let mut w = Where::default();
        assert_eq!(w.sql(), "");
        let a = w.text("x");
        w.and(format!("a = {a}"));
        let b = w.int(3);
        w.and(format!("b < {b}"));
        assert_eq!(w.sql(), " WHERE a = $1 AND b < $2");
        assert_eq!(w.args.len(), 2);
    }
}
