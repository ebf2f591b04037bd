//! The two migration trees build the same schema. After migrating a fresh SQLite file and a
//! fresh Postgres database, each one's catalog is read (SQLite: `sqlite_master` and the
//! `pragma_*` functions; Postgres: `information_schema`, `pg_index`, `pg_constraint`) into
//! one description: tables, their columns (kind, nullability, default, whether the
//! database numbers them), primary keys, unique constraints, foreign keys and checks, and
//! the indexes by name. Type spellings are folded into a few kinds (`INTEGER`, `BIGINT`
//! and `INT8` are all `integer`), and a check or an index predicate is compared by the
//! columns and constants it names, since each database prints expressions its own way.
//! Anything else that differs fails the test, with a line per difference.

use crate::common::{Backend, TestDb};
use passage_server::store::Db;
use std::collections::{BTreeMap, BTreeSet};

#[derive(sqlx::FromRow)]
struct SqliteForeignKey {
    id: i64,
    to_table: String,
    from_col: String,
    /// NULL when the key names the referenced table only (its primary key).
    to_col: Option<String>,
    on_update: String,
    on_delete: String,
}

#[derive(sqlx::FromRow)]
struct PgConstraint {
    tbl: String,
    /// `p`, `u`, `f` or `c`.
    kind: String,
    cols: Vec<String>,
    to_table: String,
    to_cols: Vec<String>,
    on_delete: String,
    on_update: String,
    def: String,
}

#[derive(sqlx::FromRow)]
struct PgIndex {
    name: String,
    tbl: String,
    is_unique: bool,
    predicate: Option<String>,
    cols: Vec<String>,
}

/// A schema as a flat map: what (`table vms / column state`) → how (`text not null`).
/// Flat, so that two of them differ exactly where a line of the diff says.
type Schema = BTreeMap<String, String>;

/// The type families both databases agree on; anything else is kept as spelled.
fn kind(declared: &str) -> String {
    let t = declared.trim().to_ascii_lowercase();
    let has = |s: &str| t.contains(s);
    let k = if has("int") {
        "integer"
    } else if has("char") || has("text") || has("clob") {
        "text"
    } else if has("real") || has("floa") || has("doub") || has("numeric") || has("decimal") {
        "real"
    } else if has("blob") || t == "bytea" {
        "blob"
    } else if has("bool") {
        "boolean"
    } else {
        return t;
    };
    k.to_string()
}

/// A default as written, less Postgres's casts (`'x'::text`) and wrapping parentheses.
fn default_value(raw: &str) -> String {
    let mut s = raw.trim();
    while let Some(inner) = s.strip_prefix('(').and_then(|r| r.strip_suffix(')')) {
        s = inner.trim();
    }
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("::") {
        out.push_str(&rest[..i]);
        rest = rest[i + 2..].trim_start_matches(|c: char| c.is_alphanumeric() || c == ' ');
    }
    out.push_str(rest);
    out.trim().to_string()
}

/// The tokens of an SQL expression that mean the same in both dialects: the table's
/// columns it names and the constants it compares them with, sorted. Postgres prints
/// `x IN ('a', 'b')` as `(x = ANY (ARRAY['a'::text, 'b'::text]))`; both give
/// `x 'a' 'b'`.
fn signature(expr: &str, columns: &BTreeSet<String>) -> String {
    let mut names = BTreeSet::new();
    let mut constants = BTreeSet::new();
    let b = expr.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'\'' {
            let mut lit = String::from("'");
            i += 1;
            while i < b.len() {
                if b[i] == b'\'' {
                    if b.get(i + 1) == Some(&b'\'') {
                        lit.push('\'');
                        i += 2;
                        continue;
                    }
                    break;
                }
                lit.push(b[i] as char);
                i += 1;
            }
            lit.push('\'');
            constants.insert(lit);
            i += 1;
        } else if c.is_ascii_digit() {
            let start = i;
            while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.') {
                i += 1;
            }
            constants.insert(expr[start..i].to_string());
        } else if c.is_ascii_alphabetic() || c == b'_' || c == b'"' {
            let start = i;
            i += 1;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'"') {
                i += 1;
            }
            let word = expr[start..i].trim_matches('"').to_ascii_lowercase();
            if columns.contains(&word) {
                names.insert(word);
            }
        } else {
            i += 1;
        }
    }
    names
        .into_iter()
        .chain(constants)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The `CHECK (…)` expressions of an SQLite `CREATE TABLE`, skipping comments and string
/// literals (a comment may hold an apostrophe, a literal the word CHECK).
fn sqlite_checks(sql: &str) -> Vec<String> {
    let b = sql.as_bytes();
    let skip_literal = |mut j: usize| {
        j += 1;
        while j < b.len() && b[j] != b'\'' {
            j += 1;
        }
        j
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let rest = &b[i..];
        if rest.starts_with(b"--") {
            i += rest.iter().position(|&c| c == b'\n').unwrap_or(rest.len());
        } else if rest.starts_with(b"/*") {
            i += rest
                .windows(2)
                .position(|w| w == b"*/")
                .map_or(rest.len(), |n| n + 2);
        } else if b[i] == b'\'' {
            i = skip_literal(i) + 1;
        } else if rest.len() >= 5
            && rest[..5].eq_ignore_ascii_case(b"check")
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        {
            let Some(open) = rest.iter().position(|&c| c == b'(').map(|n| i + n) else {
                break;
            };
            let mut depth = 0;
            let mut j = open;
            while j < b.len() {
                match b[j] {
                    b'(' => depth += 1,
                    b')' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    b'\'' => j = skip_literal(j),
                    _ => {}
                }
                j += 1;
            }
            out.push(sql[open + 1..j.min(b.len())].to_string());
            i = j + 1;
        } else {
            i += 1;
        }
    }
    out
}

fn list(cols: &[String]) -> String {
    format!("({})", cols.join(", "))
}

/// What a table's description says of a foreign key.
fn foreign_key(to: &str, to_cols: &[String], on_delete: &str, on_update: &str) -> String {
    format!(
        "references {to} {} on delete {} on update {}",
        list(to_cols),
        on_delete.to_ascii_lowercase(),
        on_update.to_ascii_lowercase()
    )
}

fn column(kind: &str, nullable: bool, default: Option<&str>, generated: bool) -> String {
    let mut s = kind.to_string();
    if !nullable {
        s.push_str(" not null");
    }
    if let Some(d) = default {
        s.push_str(&format!(" default {}", default_value(d)));
    }
    if generated {
        s.push_str(" generated");
    }
    s
}

async fn sqlite_schema(pool: &sqlx::SqlitePool) -> Schema {
    let mut out = Schema::new();
    let tables: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, sql FROM sqlite_master WHERE type = 'table' \
         AND name NOT LIKE 'sqlite_%' AND name <> '_sqlx_migrations' ORDER BY name",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    for (table, sql) in &tables {
        let t = format!("table {table}");
        out.insert(t.clone(), "exists".into());
        let cols: Vec<(String, String, i64, Option<String>, i64)> = sqlx::query_as(
            "SELECT name, type, \"notnull\", dflt_value, pk FROM pragma_table_info(?1) ORDER BY pk",
        )
        .bind(table)
        .fetch_all(pool)
        .await
        .unwrap();
        let names: BTreeSet<String> = cols.iter().map(|c| c.0.to_ascii_lowercase()).collect();
        let pk: Vec<String> = cols
            .iter()
            .filter(|c| c.4 > 0)
            .map(|c| c.0.clone())
            .collect();
        for (name, ty, notnull, dflt, pkpos) in &cols {
            // A lone INTEGER PRIMARY KEY is the rowid: never NULL, numbered by SQLite.
            let rowid = *pkpos > 0 && pk.len() == 1 && ty.eq_ignore_ascii_case("integer");
            out.insert(
                format!("{t} / column {name}"),
                column(&kind(ty), *notnull == 0 && !rowid, dflt.as_deref(), rowid),
            );
        }
        if !pk.is_empty() {
            out.insert(format!("{t} / primary key"), list(&pk));
        }
        let order: Vec<(String,)> =
            sqlx::query_as("SELECT name FROM pragma_table_info(?1) ORDER BY cid")
                .bind(table)
                .fetch_all(pool)
                .await
                .unwrap();
        let order: Vec<String> = order.into_iter().map(|c| c.0).collect();
        out.insert(format!("{t} / column order"), list(&order));
        let indexes: Vec<(String, i64, String, i64)> =
            sqlx::query_as("SELECT name, \"unique\", origin, partial FROM pragma_index_list(?1)")
                .bind(table)
                .fetch_all(pool)
                .await
                .unwrap();
        for (index, unique, origin, _) in &indexes {
            let cols: Vec<(String,)> =
                sqlx::query_as("SELECT name FROM pragma_index_info(?1) ORDER BY seqno")
                    .bind(index)
                    .fetch_all(pool)
                    .await
                    .unwrap();
            let cols: Vec<String> = cols.into_iter().map(|c| c.0).collect();
            match origin.as_str() {
                "pk" => {}
                "u" => {
                    out.insert(format!("{t} / unique {}", list(&cols)), "exists".into());
                }
                _ => {
                    let (isql,): (Option<String>,) =
                        sqlx::query_as("SELECT sql FROM sqlite_master WHERE name = ?1")
                            .bind(index)
                            .fetch_one(pool)
                            .await
                            .unwrap();
                    let predicate = isql.as_deref().and_then(|s| {
                        let upper = s.to_ascii_uppercase();
                        upper.rfind(" WHERE ").map(|at| s[at + 7..].to_string())
                    });
                    out.insert(
                        format!("index {index}"),
                        index_desc(table, &cols, *unique != 0, predicate, &names),
                    );
                }
            }
        }
        let fks: Vec<SqliteForeignKey> = sqlx::query_as(
            "SELECT id, \"table\" AS to_table, \"from\" AS from_col, \"to\" AS to_col, \
                    on_update, on_delete \
             FROM pragma_foreign_key_list(?1) ORDER BY id, seq",
        )
        .bind(table)
        .fetch_all(pool)
        .await
        .unwrap();
        let mut by_id: BTreeMap<i64, Vec<SqliteForeignKey>> = BTreeMap::new();
        for fk in fks {
            by_id.entry(fk.id).or_default().push(fk);
        }
        for parts in by_id.values() {
            let from: Vec<String> = parts.iter().map(|p| p.from_col.clone()).collect();
            let first = &parts[0];
            let mut to: Vec<String> = parts.iter().filter_map(|p| p.to_col.clone()).collect();
            if to.is_empty() {
                // `REFERENCES t` without columns names t's primary key.
                let pk: Vec<(String,)> = sqlx::query_as(
                    "SELECT name FROM pragma_table_info(?1) WHERE pk > 0 ORDER BY pk",
                )
                .bind(&first.to_table)
                .fetch_all(pool)
                .await
                .unwrap();
                to = pk.into_iter().map(|c| c.0).collect();
            }
            out.insert(
                format!("{t} / foreign key {}", list(&from)),
                foreign_key(&first.to_table, &to, &first.on_delete, &first.on_update),
            );
        }
        for check in sqlite_checks(sql) {
            out.insert(
                format!("{t} / check {}", signature(&check, &names)),
                "exists".into(),
            );
        }
    }
    out
}

fn index_desc(
    table: &str,
    cols: &[String],
    unique: bool,
    predicate: Option<String>,
    columns: &BTreeSet<String>,
) -> String {
    let mut s = format!(
        "{}on {table} {}",
        if unique { "unique " } else { "" },
        list(cols)
    );
    if let Some(p) = predicate {
        s.push_str(&format!(" where {}", signature(&p, columns)));
    }
    s
}

/// Postgres's one-letter foreign key actions, as SQLite spells them.
fn pg_action(c: &str) -> &'static str {
    match c {
        "a" => "no action",
        "r" => "restrict",
        "c" => "cascade",
        "n" => "set null",
        "d" => "set default",
        _ => "?",
    }
}

async fn postgres_schema(pool: &sqlx::PgPool) -> Schema {
    let mut out = Schema::new();
    let cols: Vec<(String, String, String, String, Option<String>, String)> = sqlx::query_as(
        "SELECT c.table_name::text, c.column_name::text, c.data_type::text, \
                c.is_nullable::text, c.column_default::text, c.is_identity::text \
         FROM information_schema.columns c \
         JOIN information_schema.tables t USING (table_schema, table_name) \
         WHERE c.table_schema = 'public' AND t.table_type = 'BASE TABLE' \
           AND c.table_name <> '_sqlx_migrations' \
         ORDER BY c.table_name, c.ordinal_position",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut names: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut order: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (table, name, ty, nullable, dflt, identity) in &cols {
        order.entry(table.clone()).or_default().push(name.clone());
        out.insert(format!("table {table}"), "exists".into());
        names
            .entry(table.clone())
            .or_default()
            .insert(name.to_ascii_lowercase());
        out.insert(
            format!("table {table} / column {name}"),
            column(
                &kind(ty),
                nullable == "YES",
                dflt.as_deref(),
                identity == "YES",
            ),
        );
    }
    for (table, cols) in &order {
        out.insert(format!("table {table} / column order"), list(cols));
    }
    let attnames = |key: &str, rel: &str| {
        format!(
            "ARRAY(SELECT a.attname::text FROM unnest({key}) WITH ORDINALITY k(n, o) \
             JOIN pg_attribute a ON a.attrelid = {rel} AND a.attnum = k.n ORDER BY k.o)"
        )
    };
    let constraints: Vec<PgConstraint> = sqlx::query_as(&format!(
        "SELECT c.conrelid::regclass::text AS tbl, c.contype::text AS kind, {} AS cols, \
                c.confrelid::regclass::text AS to_table, {} AS to_cols, \
                c.confdeltype::text AS on_delete, c.confupdtype::text AS on_update, \
                pg_get_constraintdef(c.oid) AS def \
         FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace \
         WHERE n.nspname = 'public' AND c.contype IN ('p', 'u', 'f', 'c') \
           AND c.conrelid <> 0 AND c.conrelid::regclass::text <> '_sqlx_migrations'",
        attnames("c.conkey", "c.conrelid"),
        attnames("c.confkey", "c.confrelid"),
    ))
    .fetch_all(pool)
    .await
    .unwrap();
    for c in &constraints {
        let t = format!("table {}", c.tbl);
        match c.kind.as_str() {
            "p" => {
                out.insert(format!("{t} / primary key"), list(&c.cols));
            }
            "u" => {
                out.insert(format!("{t} / unique {}", list(&c.cols)), "exists".into());
            }
            "f" => {
                out.insert(
                    format!("{t} / foreign key {}", list(&c.cols)),
                    foreign_key(
                        &c.to_table,
                        &c.to_cols,
                        pg_action(&c.on_delete),
                        pg_action(&c.on_update),
                    ),
                );
            }
            _ => {
                let expr = c.def.trim_start_matches("CHECK").trim();
                let columns = names.get(&c.tbl).cloned().unwrap_or_default();
                out.insert(
                    format!("{t} / check {}", signature(expr, &columns)),
                    "exists".into(),
                );
            }
        }
    }
    let indexes: Vec<PgIndex> = sqlx::query_as(&format!(
        "SELECT i.relname::text AS name, t.relname::text AS tbl, ix.indisunique AS is_unique, \
                pg_get_expr(ix.indpred, ix.indrelid) AS predicate, {} AS cols \
         FROM pg_index ix \
         JOIN pg_class i ON i.oid = ix.indexrelid \
         JOIN pg_class t ON t.oid = ix.indrelid \
         JOIN pg_namespace n ON n.oid = t.relnamespace \
         WHERE n.nspname = 'public' AND t.relname <> '_sqlx_migrations' \
           AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = ix.indexrelid \
               AND c.conrelid = ix.indrelid AND c.contype IN ('p', 'u', 'x'))",
        attnames("ix.indkey::int2[]", "t.oid"),
    ))
    .fetch_all(pool)
    .await
    .unwrap();
    for ix in indexes {
        let columns = names.get(&ix.tbl).cloned().unwrap_or_default();
        out.insert(
            format!("index {}", ix.name),
            index_desc(&ix.tbl, &ix.cols, ix.is_unique, ix.predicate, &columns),
        );
    }
    out
}

/// One line per difference, or none.
fn diff(sqlite: &Schema, postgres: &Schema) -> Vec<String> {
    let mut lines = Vec::new();
    for (k, v) in sqlite {
        match postgres.get(k) {
            None => lines.push(format!("only in sqlite:   {k}: {v}")),
            Some(p) if p != v => {
                lines.push(format!("differs:          {k}: sqlite {v} / postgres {p}"));
            }
            Some(_) => {}
        }
    }
    for (k, v) in postgres {
        if !sqlite.contains_key(k) {
            lines.push(format!("only in postgres: {k}: {v}"));
        }
    }
    lines
}

async fn migrated(b: Backend) -> (TestDb, Db) {
    let tdb = TestDb::new(b).await;
    let db = Db::connect(&tdb.url).await.unwrap();
    (tdb, db)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_migration_trees_build_the_same_schema() {
    let (_s, sqlite) = migrated(Backend::Sqlite).await;
    let (_p, postgres) = migrated(Backend::Postgres).await;
    let Db::Sqlite { read, .. } = &sqlite else {
        panic!("not SQLite")
    };
    let Db::Postgres(pg) = &postgres else {
        panic!("not Postgres")
    };
    let a = sqlite_schema(read).await;
    let b = postgres_schema(pg).await;
    // Read at all: a query that silently found nothing would make any two trees agree.
    for s in [&a, &b] {
        assert!(s.contains_key("table vms / column state"), "{s:#?}");
        assert!(s.contains_key("index tokens_account"), "{s:#?}");
        assert!(s.keys().any(|k| k.contains("/ check ")), "{s:#?}");
        assert!(s.keys().any(|k| k.contains("/ foreign key ")), "{s:#?}");
        assert!(s.keys().any(|k| k.contains("/ unique ")), "{s:#?}");
    }
    let lines = diff(&a, &b);
    assert!(
        lines.is_empty(),
        "migrations/sqlite and migrations/postgres build different schemas:\n{}",
        lines.join("\n")
    );
}

/// The comparison itself, on two descriptions written by hand: it sees a difference in
/// anything but type spelling, and says where.
#[test]
fn the_comparison_tells_what_differs() {
    let cols: BTreeSet<String> = ["role".to_string()].into();
    let table = |ty: &str, nullable: bool, check: &str| -> Schema {
        [
            (
                "table a / column role".to_string(),
                column(&kind(ty), nullable, None, false),
            ),
            (
                format!("table a / check {}", signature(check, &cols)),
                "exists".to_string(),
            ),
        ]
        .into()
    };
    let sqlite = table("TEXT", false, "role IN ('operator', 'reader')");
    let same = table(
        "character varying",
        false,
        "((role = ANY (ARRAY['operator'::text, 'reader'::text])))",
    );
    assert_eq!(diff(&sqlite, &same), Vec::<String>::new());
    assert_eq!(kind("INT8"), kind("integer"));
    assert_eq!(kind("BIGINT"), kind("INTEGER"));
    assert_eq!(default_value("'x'::text"), "'x'");
    assert_eq!(default_value("(0)"), "0");

    let nullable = table("text", true, "role IN ('operator', 'reader')");
    assert_eq!(
        diff(&sqlite, &nullable),
        vec!["differs:          table a / column role: sqlite text not null / postgres text"]
    );
    let other_check = table("TEXT", false, "role IN ('operator', 'tenant')");
    let lines = diff(&sqlite, &other_check);
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert!(lines[0].starts_with("only in sqlite:   table a / check role 'operator' 'reader'"));
    assert!(lines[1].starts_with("only in postgres: table a / check role 'operator' 'tenant'"));
}

#[test]
fn checks_are_found_past_comments_and_literals() {
    let sql = "CREATE TABLE a (\n  -- the account's role: CHECK (nothing)\n  \
               role TEXT NOT NULL CHECK (role IN ('a', 'check (b)')),\n  \
               n INTEGER CHECK (n >= (0))\n)";
    assert_eq!(
        sqlite_checks(sql),
        vec![
            "role IN ('a', 'check (b)')".to_string(),
            "n >= (0)".to_string()
        ]
    );
}
