//! A small builder for the `WHERE` clauses of list queries, and the keyset read of a
//! newest-first list. What a page request and a cursor are is in [`crate::listing`].

use super::{Db, StoreResult};
pub use crate::listing::{Cursor, DeviceKey, Page, PageReq, Start, TimeKey};
use crate::on_read;

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
