//! Storage on SQLite (file, WAL: the embedded default) or Postgres (by URL: for several
//! replicas). Native pools on both, one migration tree each. Queries are written once with
//! `$N` placeholders, which both backends accept, and run through the macros below, which
//! expand the same body against each backend's concrete pool type; batch statements have a
//! SQLite rendering (one call, anonymous `?`s: `sql`) and a Postgres one (arrays) side by
//! side.
//!
//! One writer per rule: every scarce thing a VM holds (devices, GPU quota, vCPUs and
//! memory, the free-device index) is reserved in `reserve`, by one creation, a batch of
//! them (`create`) or a resize's new devices (`vms::begin_job`) alike; every other device
//! state change is `devices::DeviceTx::move_many` (`device_moves`: one device or a batch
//! of callers' moves alike); jobs are written by
//! `jobs::JobTx::insert_jobs`, and their steps' rows by `job_log` as each step starts.

pub mod accounts;
pub mod create;
pub mod device_moves;
pub mod devices;
pub mod events;
pub mod images;
pub mod job_log;
pub mod jobs;
pub mod keys;
pub mod networks;
pub mod ops;
pub mod packages;
pub mod page;
pub mod reserve;
pub mod room;
pub mod servers;
pub mod sql;
pub mod statistics;
pub mod tasks;
pub mod variants;
pub mod vgpus;
pub mod vms;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::SqliteSynchronous;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Sqlx(#[from] sqlx::Error),
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("{0} not found")]
    NotFound(&'static str),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Quota(String),
    #[error("{0}")]
    InvalidState(String),
    /// A server lacks the vCPUs or memory for a VM (it may have changed since placement
    /// looked).
    #[error("{0}")]
    NoRoom(String),
    /// A network has no address left for a VM (placement elsewhere does not help).
    #[error("{0}")]
    Exhausted(String),
    /// A conditional write lost a race: the caller may re-read and try again.
    #[error("a concurrent change won")]
    Retry,
    /// A stored value no longer parses (a bug or a hand-edited database).
    #[error("corrupt stored value: {0}")]
    Corrupt(String),
    #[error("database URL {0:?} is neither sqlite://PATH nor postgres://…")]
    BadUrl(String),
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Maps a unique-constraint violation to a conflict that names what was duplicated.
pub fn unique_as_conflict(e: sqlx::Error, what: impl FnOnce() -> String) -> StoreError {
    if let sqlx::Error::Database(db) = &e
        && db.is_unique_violation()
    {
        return StoreError::Conflict(what());
    }
    StoreError::Sqlx(e)
}

/// Whether a commit waits for the disk (see [`Db::lane_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Commit {
    Durable,
    Relaxed,
}

#[derive(Clone, Debug)]
pub enum Db {
    /// SQLite takes one writer at a time: writes go through a one-connection pool so they
    /// queue in the pool instead of failing with SQLITE_BUSY; reads use the other pool.
    Sqlite {
        write: SqlitePool,
        read: SqlitePool,
        /// The turn to write that ordinary writers take before they queue for the one
        /// writer connection (see [`Db::first_in_line`]); `None`: this handle skips it.
        turn: Option<Arc<tokio::sync::Semaphore>>,
    },
    Postgres(PgPool),
}

/// Runs `$body` with `$c` bound to the write pool of whichever backend is in use.
#[macro_export]
macro_rules! on_write {
    ($db:expr, |$c:ident| $body:expr) => {
        match $db {
            $crate::store::Db::Sqlite { write, turn, .. } => {
                let _turn = $crate::store::wait_turn(turn).await;
                let $c = write;
                $body
            }
            $crate::store::Db::Postgres(p) => {
                let $c = p;
                $body
            }
        }
    };
}

/// Runs `$body` with `$c` bound to a pool fit for reads.
#[macro_export]
macro_rules! on_read {
    ($db:expr, |$c:ident| $body:expr) => {
        match $db {
            $crate::store::Db::Sqlite { read, .. } => {
                let $c = read;
                $body
            }
            $crate::store::Db::Postgres(p) => {
                let $c = p;
                $body
            }
        }
    };
}

/// Runs `$body` (an expression of type `StoreResult<T>`, which may `.await`) inside a
/// transaction bound to `$tx`: committed on `Ok`, rolled back on `Err`. On SQLite a
/// committed transaction says at debug level where it was begun and how long its `BEGIN`,
/// its body and its `COMMIT` took: a commit that crosses the WAL's checkpoint mark copies
/// the WAL into the database file, and only this tells that cost from the statements'
/// (BENCHMARKS.md, thirty-eighth session).
#[macro_export]
macro_rules! in_tx {
    ($db:expr, |$tx:ident| $body:expr) => {
        match $db {
            $crate::store::Db::Sqlite { write, turn, .. } => {
                let _turn = $crate::store::wait_turn(turn).await;
                let t0 = std::time::Instant::now();
                let mut $tx = write.begin().await?;
                let t1 = std::time::Instant::now();
                let r: $crate::store::StoreResult<_> = async { $body }.await;
                match r {
                    Ok(v) => {
                        let t2 = std::time::Instant::now();
                        $tx.commit().await?;
                        tracing::debug!(
                            target: "passage_server::store",
                            at = %format_args!("{}:{}", file!(), line!()),
                            begin_ms = (t1 - t0).as_secs_f64() * 1e3,
                            body_ms = (t2 - t1).as_secs_f64() * 1e3,
                            commit_ms = t2.elapsed().as_secs_f64() * 1e3,
                            "transaction committed"
                        );
                        Ok(v)
                    }
                    Err(e) => {
                        $tx.rollback().await?;
                        Err(e)
                    }
                }
            }
            $crate::store::Db::Postgres(p) => {
                let mut $tx = p.begin().await?;
                let r: $crate::store::StoreResult<_> = async { $body }.await;
                match r {
                    Ok(v) => {
                        $tx.commit().await?;
                        Ok(v)
                    }
                    Err(e) => {
                        $tx.rollback().await?;
                        Err(e)
                    }
                }
            }
        }
    };
}

impl Db {
    /// `sqlite://PATH` (created if missing) or `postgres://…`.
    pub async fn connect(url: &str) -> StoreResult<Db> {
        if let Some(path) = url
            .strip_prefix("sqlite://")
            .or_else(|| url.strip_prefix("sqlite:"))
        {
            let base = SqliteConnectOptions::from_str(&format!("sqlite://{path}"))?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Normal)
                .foreign_keys(true)
                .busy_timeout(Duration::from_secs(30))
                // List pages and capacity counts walk indexes of the whole fleet: a larger
                // cache per connection keeps their pages between requests while nothing
                // is written. No memory map: in WAL mode SQLite unmaps the whole file at
                // the start of every read after any commit, so under a stream of job
                // steps each read paid a munmap (a TLB shootdown on every CPU) and page
                // faults to map it again, about 250 remaps a second in the fleet bench.
                .pragma("cache_size", "-16384");
            // No ping as a connection is taken from the pool: a connection to a file in
            // this process cannot have gone away, and the ping was a round trip to the
            // connection's thread before every statement (without it a fleet's VMs took 47
            // context switches each to reach `running`, not 58).
            let write = SqlitePoolOptions::new()
                .max_connections(1)
                .test_before_acquire(false)
                .acquire_timeout(Duration::from_secs(60))
                .connect_with(base.clone())
                .await?;
            sqlx::migrate!("../migrations/sqlite").run(&write).await?;
            let read = SqlitePoolOptions::new()
                .max_connections(8)
                .test_before_acquire(false)
                .acquire_timeout(Duration::from_secs(60))
                .connect_with(base.read_only(true))
                .await?;
            Ok(Db::Sqlite {
                write,
                read,
                turn: Some(Arc::new(tokio::sync::Semaphore::new(1))),
            })
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            // Postgres's default `random_page_cost` of 4 models a spinning disk; the control
            // plane's tables are read from memory. At 4, the job log's step write for a
            // batch of 64 jobs was planned, each time a connection planned it again after
            // an `ANALYZE`, as a hash join over a sequential scan of `job_steps` (20–130 ms
            // a write at 26,000–64,000 rows) instead of 64 lookups by its primary key
            // (2.4 ms): 43 of the 54 step writes over 40 ms in a fleet run. At 1.1, the
            // value Postgres's documentation gives for solid-state drives, all were planned
            // by key (BENCHMARKS.md, thirty-second session). Set for Passage's own
            // sessions, whatever the database's default; the lanes inherit it.
            let opts = PgConnectOptions::from_str(url)?.options([("random_page_cost", "1.1")]);
            let pool = pg_pool_options()
                .max_connections(16)
                .acquire_timeout(Duration::from_secs(60))
                .connect_with(opts)
                .await?;
            sqlx::migrate!("../migrations/postgres").run(&pool).await?;
            Ok(Db::Postgres(pool))
        } else {
            Err(StoreError::BadUrl(
                redact_url(url).chars().take(60).collect(),
            ))
        }
    }

    /// A lane of its own for latency-critical work, beside the shared pool: on Postgres a
    /// second pool of `connections` to the same database, so that work queued for the main
    /// pool (a burst of job steps) never delays it; on SQLite the same pools, as every
    /// write takes the one writer in turn anyway.
    pub fn lane(&self, connections: u32) -> Db {
        self.lane_with(connections, Commit::Durable)
    }

    /// [`Db::lane`] whose commits on Postgres return before their WAL reaches the disk
    /// (`synchronous_commit = off`), for the job runner's writes. A crash of the database
    /// host then loses at most its last fraction of a second of job progress (Postgres
    /// flushes the WAL in order, so never a commit that a later durable one depends on),
    /// and every job step is idempotent and replayed from its saga log. On this machine
    /// a WAL flush took about 2 ms, once per step write.
    pub fn lane_with(&self, connections: u32, commit: Commit) -> Db {
        match self {
            Db::Sqlite { .. } => self.clone(),
            Db::Postgres(p) => {
                let mut opts = (*p.connect_options()).clone();
                if commit == Commit::Relaxed {
                    opts = opts.options([("synchronous_commit", "off")]);
                }
                Db::Postgres(
                    pg_pool_options()
                        .max_connections(connections.max(1))
                        // Opened in the background at start: the first request that needs
                        // the lane does not wait for a connection to be set up.
                        .min_connections(connections.max(1))
                        .acquire_timeout(Duration::from_secs(60))
                        .connect_lazy_with(opts),
                )
            }
        }
    }

    /// This handle's writes on SQLite go ahead of the others': they queue for the one
    /// writer connection directly, while every other handle's writes first take a turn
    /// (one at a time) and only then queue there. So a write through this handle waits
    /// for at most the write in progress and one other, however many job steps and node
    /// reports are waiting, instead of behind all of them (the pool serves its waiters in
    /// order). For the placer's batches and the audit records that API answers wait for.
    /// On Postgres, where writers do not queue for one connection, the same handle.
    pub fn first_in_line(&self) -> Db {
        match self {
            Db::Sqlite { write, read, .. } => Db::Sqlite {
                write: write.clone(),
                read: read.clone(),
                turn: None,
            },
            Db::Postgres(_) => self.clone(),
        }
    }

    pub fn backend(&self) -> &'static str {
        match self {
            Db::Sqlite { .. } => "sqlite",
            Db::Postgres(_) => "postgres",
        }
    }

    pub async fn close(&self) {
        match self {
            Db::Sqlite { write, read, .. } => {
                read.close().await;
                write.close().await;
            }
            Db::Postgres(p) => p.close().await,
        }
    }
}

/// How long a Postgres connection may sit in the pool before it is pinged as it is taken.
const PG_PING_IDLE: Duration = Duration::from_secs(1);

/// Postgres pools ping a connection as it is taken only when it sat idle for a while
/// ([`PG_PING_IDLE`]): a database restarted or a connection cut meanwhile is found there
/// and the connection replaced, while one in steady use goes straight to its statement
/// instead of paying a round trip to the database first.
fn pg_pool_options() -> PgPoolOptions {
    PgPoolOptions::new()
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PG_PING_IDLE {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// Waits for a turn to write, where the handle takes one (see [`Db::first_in_line`]).
/// The turn, once given back, says at debug level where it was taken, how long it was
/// waited for and how long it was held: on SQLite those turns are what a burst of job
/// steps waits for, and which writer holds them longest is the first thing to know
/// there (BENCHMARKS.md, thirty-seventh session).
#[doc(hidden)]
#[track_caller]
pub fn wait_turn(
    turn: &Option<Arc<tokio::sync::Semaphore>>,
) -> impl Future<Output = Option<Turn>> + use<> {
    let at = std::panic::Location::caller();
    let turn = turn.clone();
    async move {
        let asked = std::time::Instant::now();
        let permit = turn?.acquire_owned().await.ok()?;
        Some(Turn {
            _permit: permit,
            at,
            asked,
            got: std::time::Instant::now(),
        })
    }
}

/// A turn to write on SQLite's one writer ([`wait_turn`]), given back when dropped.
#[doc(hidden)]
pub struct Turn {
    _permit: tokio::sync::OwnedSemaphorePermit,
    at: &'static std::panic::Location<'static>,
    asked: std::time::Instant,
    got: std::time::Instant,
}

impl Drop for Turn {
    fn drop(&mut self) {
        tracing::debug!(
            at = %format_args!("{}:{}", self.at.file(), self.at.line()),
            waited_ms = (self.got - self.asked).as_secs_f64() * 1e3,
            held_ms = self.got.elapsed().as_secs_f64() * 1e3,
            "writer turn given back"
        );
    }
}

/// SQLite: `sql`, one or more statements whose `?`s are bound in order from `args`, as a
/// transaction sent to the writer's thread in one call; answers the rows its statements
/// returned (a `RETURNING`'s), in order. A transaction of `in_tx!` is three calls
/// (`BEGIN`, the statements, `COMMIT`): between two calls the writer waits, idle and
/// held, for the caller's task to be run again, and every other writer waits for its
/// turn behind it (BENCHMARKS.md, thirty-sixth session). All or nothing: on an error the
/// transaction is rolled back; a call dropped part-way closes the connection, which rolls
/// back whatever it had begun, instead of handing it to the next writer inside a
/// transaction.
pub async fn sqlite_atomic(
    write: &SqlitePool,
    turn: &Option<Arc<tokio::sync::Semaphore>>,
    sql: &str,
    args: &[page::Arg],
) -> StoreResult<Vec<sqlx::sqlite::SqliteRow>> {
    /// The writer while a call that may leave a transaction open is under way.
    struct Held(Option<sqlx::pool::PoolConnection<sqlx::Sqlite>>);
    impl Drop for Held {
        fn drop(&mut self) {
            if let Some(mut c) = self.0.take() {
                c.close_on_drop();
            }
        }
    }
    let _turn = wait_turn(turn).await;
    let mut held = Held(Some(write.acquire().await?));
    let Some(conn) = held.0.as_mut() else {
        return Err(StoreError::Corrupt(
            "the writer connection went missing".into(),
        ));
    };
    let text = format!("BEGIN;\n{sql};\nCOMMIT");
    let r = crate::bind_args!(sqlx::query(&text), args)
        .fetch_all(&mut **conn)
        .await;
    match r {
        Ok(rows) => {
            // Committed: the connection goes back to the pool as it is.
            drop(held.0.take());
            Ok(rows)
        }
        Err(e) => {
            // Rolled back, or nothing was begun; any other answer leaves the connection
            // to be closed by `held`.
            match sqlx::query("ROLLBACK").execute(&mut **conn).await {
                Ok(_) => drop(held.0.take()),
                Err(sqlx::Error::Database(d)) if d.message().contains("no transaction") => {
                    drop(held.0.take())
                }
                Err(_) => {}
            }
            Err(e.into())
        }
    }
}

/// A database URL fit for messages and logs: any password in it replaced.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (authority, tail) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{scheme}://{user}:<redacted>@{host}{tail}")
        }
        None => url.to_string(),
    }
}

/// Milliseconds since the Unix epoch: the one time format in both schemas.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

pub fn to_time(ms: i64) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp_millis(ms).unwrap_or_default()
}

/// A stored value that no longer parses.
pub(crate) fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

pub fn parse_uuid<T: FromStr>(s: &str, what: &str) -> StoreResult<T> {
    s.parse()
        .map_err(|_| StoreError::Corrupt(format!("{what} {s:?} is not a uuid")))
}

#[cfg(test)]
mod tests {
    #[test]
    fn passwords_never_leave_in_urls() {
        use super::redact_url;
        assert_eq!(
            redact_url("postgres://passage:hunter2@db:5432/passage"),
            "postgres://passage:<redacted>@db:5432/passage"
        );
        assert_eq!(
            redact_url("sqlite:///var/lib/p.db"),
            "sqlite:///var/lib/p.db"
        );
        assert_eq!(
            redact_url("mysql://u:p@h/x?a=b"),
            "mysql://u:<redacted>@h/x?a=b"
        );
    }

    #[tokio::test]
    async fn an_unknown_scheme_is_refused_without_its_password() {
        let e = super::Db::connect("mysql://u:hunter2@h/x")
            .await
            .unwrap_err();
        let shown = e.to_string();
        assert!(shown.contains("neither sqlite"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
