//! The per-server task queue the agents long-poll.

use super::devices::{Coverage, InventoryTx, Report};
use super::page::Arg;
use super::sql::Sql;
use super::{Db, StoreError, StoreResult, corrupt, now_ms, parse_uuid};
use crate::{bind_args, on_read, on_write};
use passage_model::protocol::{TaskEnvelope, TaskResult};
use passage_model::{JobId, PciDevice, ServerId, TaskId};
use std::collections::{HashMap, HashSet};

/// The Postgres channels replicas tell each other on (`NOTIFY`; each listens:
/// `services::wake_on_notify`): a task queued for a node (payload: the server's uuid) and
/// a task given its result (payload: the task's uuid). The statement that queues tasks
/// (`store::job_log::write`) sends the first as it commits; [`announce`] the second, for
/// a batch of results at once. SQLite has no other replica to tell.
pub const QUEUED_CHANNEL: &str = "passage_task_queued";
pub const DONE_CHANNEL: &str = "passage_task_done";

/// Tells the other replicas on a shared Postgres, one statement for all of `keys`;
/// nothing to do on SQLite.
pub async fn announce(db: &Db, channel: &str, keys: &[String]) -> StoreResult<()> {
    if let (Db::Postgres(p), false) = (db, keys.is_empty()) {
        sqlx::query("SELECT pg_notify($1, k) FROM UNNEST($2::text[]) AS k")
            .bind(channel)
            .bind(keys)
            .execute(p)
            .await?;
    }
    Ok(())
}

/// Hands out queued tasks, and tasks taken longer than `redeliver_after_ms` ago whose
/// result never came (tasks are idempotent on the agent, so running one twice is safe).
pub async fn take(
    db: &Db,
    server: ServerId,
    limit: i64,
    redeliver_after_ms: i64,
) -> StoreResult<Vec<TaskEnvelope>> {
    let now = now_ms();
    let server_s = server.to_string();
    // One statement: the oldest deliverable tasks are marked taken and returned. The
    // condition is stated again outside the subquery, so that on Postgres a task another
    // replica took meanwhile is re-checked after its row lock and skipped.
    let deliverable =
        "server_uuid = $1 AND (state = 'queued' OR (state = 'taken' AND taken_at < $2))";
    let mut rows: Vec<(String, String, i64)> = on_write!(db, |p| sqlx::query_as(&format!(
        "UPDATE tasks SET state = 'taken', taken_at = $4 WHERE {deliverable} AND uuid IN \
         (SELECT uuid FROM tasks WHERE {deliverable} ORDER BY created_at LIMIT $3) \
         RETURNING uuid, payload, created_at"
    ))
    .bind(&server_s)
    .bind(now - redeliver_after_ms)
    .bind(limit)
    .bind(now)
    .fetch_all(p)
    .await)?;
    // RETURNING keeps no order.
    rows.sort_by_key(|r| r.2);
    rows.into_iter()
        .map(|(uuid, payload, _)| {
            Ok(TaskEnvelope {
                id: parse_uuid(&uuid, "task")?,
                task: serde_json::from_str(&payload).map_err(corrupt)?,
            })
        })
        .collect()
}

/// [`take`] for several nodes in one statement: each gets up to `limit` of its oldest
/// deliverable tasks, as it would alone. Nodes woken together (a batch of job steps
/// queued a task for each) are served by one write instead of one each.
pub async fn take_many(
    db: &Db,
    servers: &[ServerId],
    limit: i64,
    redeliver_after_ms: i64,
) -> StoreResult<HashMap<ServerId, Vec<TaskEnvelope>>> {
    let mut out: HashMap<ServerId, Vec<TaskEnvelope>> = HashMap::new();
    match servers {
        [] => return Ok(out),
        [one] => {
            out.insert(*one, take(db, *one, limit, redeliver_after_ms).await?);
            return Ok(out);
        }
        _ => {}
    }
    let now = now_ms();
    let cut = now - redeliver_after_ms;
    let deliverable =
        |c: &str| format!("(state = 'queued' OR (state = 'taken' AND taken_at < {c}))");
    // The oldest `limit` of each node's deliverable tasks, numbered within the node. As
    // in `take`, the condition is stated again outside, for Postgres's re-check of a row
    // another replica took meanwhile.
    let mut rows: Vec<(String, String, String, i64)> = match db {
        Db::Sqlite { .. } => {
            let mut q = Sql::default();
            let sql = format!(
                "UPDATE tasks SET state = 'taken', taken_at = {} WHERE {} AND uuid IN \
                 (SELECT uuid FROM (SELECT uuid, ROW_NUMBER() OVER \
                 (PARTITION BY server_uuid ORDER BY created_at) AS n FROM tasks \
                 WHERE server_uuid IN ({}) AND {}) WHERE n <= {}) \
                 RETURNING uuid, server_uuid, payload, created_at",
                q.int(now),
                deliverable(&q.int(cut)),
                q.list(servers),
                deliverable(&q.int(cut)),
                q.int(limit),
            );
            on_write!(db, |p| bind_args!(sqlx::query_as(&sql), &q.args)
                .fetch_all(p)
                .await)?
        }
        Db::Postgres(p) => {
            let sql = format!(
                "UPDATE tasks SET state = 'taken', taken_at = $4 WHERE server_uuid = ANY($1) \
                 AND {d} AND uuid IN (SELECT uuid FROM (SELECT uuid, ROW_NUMBER() OVER \
                 (PARTITION BY server_uuid ORDER BY created_at) AS n FROM tasks \
                 WHERE server_uuid = ANY($1) AND {d}) s WHERE n <= $3) \
                 RETURNING uuid, server_uuid, payload, created_at",
                d = deliverable("$2")
            );
            sqlx::query_as(&sql)
                .bind(servers.iter().map(ToString::to_string).collect::<Vec<_>>())
                .bind(cut)
                .bind(limit)
                .bind(now)
                .fetch_all(p)
                .await?
        }
    };
    // RETURNING keeps no order.
    rows.sort_by_key(|r| r.3);
    for (uuid, server, payload, _) in rows {
        out.entry(parse_uuid(&server, "server")?)
            .or_default()
            .push(TaskEnvelope {
                id: parse_uuid(&uuid, "task")?,
                task: serde_json::from_str(&payload).map_err(corrupt)?,
            });
    }
    Ok(out)
}

/// A node's result for one of its tasks, to record.
#[derive(Clone, Debug)]
pub struct Completion {
    pub task: TaskId,
    pub server: ServerId,
    /// The result as JSON.
    pub result: String,
    /// The node's functions as the task left them (a bind's or an unbind's drivers),
    /// written with the result: the job it wakes sees them so.
    pub changed: Vec<PciDevice>,
}

impl Completion {
    pub fn new(task: TaskId, server: ServerId, result: &TaskResult) -> StoreResult<Self> {
        Ok(Completion {
            task,
            server,
            result: serde_json::to_string(result).map_err(corrupt)?,
            changed: result.devices.clone(),
        })
    }
}

/// Records results, in one statement; only the server a task was for may give its result,
/// and only once. Answers, in order, whether each was recorded ([`not_completed`] says
/// why one was not). A task given twice is recorded for its first. The functions the
/// tasks changed are written first, in the same transaction, whether or not their result
/// is recorded (they are the node's word on its own functions, as an inventory is).
pub async fn complete_many(db: &Db, done: &[Completion]) -> StoreResult<Vec<bool>> {
    let mut seen = HashSet::new();
    let first: Vec<&Completion> = done.iter().filter(|c| seen.insert(c.task)).collect();
    if first.is_empty() {
        return Ok(Vec::new());
    }
    let now = now_ms();
    let changed = changed_by_server(done);
    let mut reports: Vec<Report<'_>> = changed
        .iter()
        .map(|(server, devices)| Report {
            server: *server,
            host: None,
            devices,
            coverage: Coverage::Changed,
        })
        .collect();
    // By server, as placements lock servers' rows (a report that recounts locks its
    // own).
    reports.sort_by_cached_key(|r| r.server.to_string());
    let written: Vec<String> = if reports.is_empty() {
        match db {
            Db::Sqlite { .. } => {
                let (sql, args) = complete_sqlite(&first, now);
                on_write!(db, |p| bind_args!(sqlx::query_scalar(&sql), &args)
                    .fetch_all(p)
                    .await)?
            }
            Db::Postgres(p) => complete_pg(&first, now).fetch_all(p).await?,
        }
    } else {
        let servers: Vec<ServerId> = reports.iter().map(|r| r.server).collect();
        crate::in_tx!(db, |tx| {
            tx.lock_reports(&servers).await?;
            let variants = tx.read_variants().await?;
            tx.apply_changed(&reports, &variants).await?;
            tx.complete(&first, now).await
        })?
    };
    let written: HashSet<&str> = written.iter().map(String::as_str).collect();
    let mut answered = HashSet::new();
    Ok(done
        .iter()
        .map(|c| written.contains(c.task.to_string().as_str()) && answered.insert(c.task))
        .collect())
}

/// The functions the tasks changed, one list per node: a node posts a batch's results
/// together, and each of them applied as its own report cost a read and a write per
/// function, where one report per node is read and written with the other nodes'. A
/// function in several results takes its state in the last (the order the node sent
/// them, which is the order its tasks left it in).
fn changed_by_server(done: &[Completion]) -> Vec<(ServerId, Vec<PciDevice>)> {
    let mut out: Vec<(ServerId, Vec<PciDevice>)> = Vec::new();
    let mut at: HashMap<ServerId, usize> = HashMap::new();
    for c in done.iter().filter(|c| !c.changed.is_empty()) {
        let i = *at.entry(c.server).or_insert_with(|| {
            out.push((c.server, Vec::new()));
            out.len() - 1
        });
        let devices = &mut out[i].1;
        for d in &c.changed {
            match devices.iter_mut().find(|x| x.id == d.id) {
                Some(x) => *x = d.clone(),
                None => devices.push(d.clone()),
            }
        }
    }
    out
}

/// SQLite's statement for [`complete_many`]: one row of values per result.
fn complete_sqlite(first: &[&Completion], now: i64) -> (String, Vec<Arg>) {
    let mut q = Sql::default();
    let rows = q.rows(first, |q, c| {
        format!(
            "{}, {}, {}",
            q.text(c.task),
            q.text(c.server),
            q.arg(Arg::Text(c.result.clone()))
        )
    });
    let sql = format!(
        "WITH x(uuid, server, result) AS (VALUES {rows}) \
         UPDATE tasks SET state = 'done', result = x.result, done_at = {} FROM x \
         WHERE tasks.uuid = x.uuid AND tasks.server_uuid = x.server \
         AND tasks.state <> 'done' RETURNING tasks.uuid",
        q.int(now)
    );
    (sql, q.args)
}

/// Postgres's statement for [`complete_many`]: one text whatever the count, with arrays.
fn complete_pg<'q>(
    first: &[&Completion],
    now: i64,
) -> sqlx::query::QueryScalar<'q, sqlx::Postgres, String, sqlx::postgres::PgArguments> {
    sqlx::query_scalar(
        "UPDATE tasks SET state = 'done', result = x.r, done_at = $1 \
         FROM UNNEST($2::text[], $3::text[], $4::text[]) AS x(u, s, r) \
         WHERE tasks.uuid = x.u AND tasks.server_uuid = x.s \
         AND tasks.state <> 'done' RETURNING tasks.uuid",
    )
    .bind(now)
    .bind(first.iter().map(|c| c.task.to_string()).collect::<Vec<_>>())
    .bind(
        first
            .iter()
            .map(|c| c.server.to_string())
            .collect::<Vec<_>>(),
    )
    .bind(first.iter().map(|c| c.result.clone()).collect::<Vec<_>>())
}

/// [`complete_many`]'s statement in the caller's transaction.
trait CompleteTx {
    fn complete(
        &mut self,
        first: &[&Completion],
        now: i64,
    ) -> impl Future<Output = StoreResult<Vec<String>>> + Send;
}

impl CompleteTx for sqlx::Transaction<'_, sqlx::Sqlite> {
    async fn complete(&mut self, first: &[&Completion], now: i64) -> StoreResult<Vec<String>> {
        let (sql, args) = complete_sqlite(first, now);
        Ok(bind_args!(sqlx::query_scalar(&sql), &args)
            .fetch_all(&mut **self)
            .await?)
    }
}

impl CompleteTx for sqlx::Transaction<'_, sqlx::Postgres> {
    async fn complete(&mut self, first: &[&Completion], now: i64) -> StoreResult<Vec<String>> {
        Ok(complete_pg(first, now).fetch_all(&mut **self).await?)
    }
}

/// Why [`complete_many`] did not record a result: the task is not `server`'s (or unknown
/// here), or it has one already.
pub async fn not_completed(db: &Db, server: ServerId, task: TaskId) -> StoreError {
    let known: Result<Option<(String,)>, sqlx::Error> = on_read!(db, |p| sqlx::query_as(
        "SELECT state FROM tasks WHERE uuid = $1 AND server_uuid = $2"
    )
    .bind(task.to_string())
    .bind(server.to_string())
    .fetch_optional(p)
    .await);
    match known {
        Err(e) => e.into(),
        Ok(None) => StoreError::NotFound("task"),
        Ok(Some(_)) => StoreError::Conflict("the task already has a result".into()),
    }
}

pub async fn result(db: &Db, task: TaskId) -> StoreResult<Option<TaskResult>> {
    let row: Option<(String, Option<String>)> = on_read!(db, |p| sqlx::query_as(
        "SELECT state, result FROM tasks WHERE uuid = $1"
    )
    .bind(task.to_string())
    .fetch_optional(p)
    .await)?;
    match row {
        Some((state, Some(result))) if state == "done" => {
            Ok(Some(serde_json::from_str(&result).map_err(corrupt)?))
        }
        Some(_) => Ok(None),
        None => Err(StoreError::NotFound("task")),
    }
}

/// A task its node reports progress on is alive: it is not handed out again meanwhile.
pub async fn touch(db: &Db, task: TaskId) -> StoreResult<()> {
    on_write!(db, |p| sqlx::query(
        "UPDATE tasks SET taken_at = $2 WHERE uuid = $1 AND state = 'taken'"
    )
    .bind(task.to_string())
    .bind(now_ms())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

/// The job a task of `server`'s works for, if the task is `server`'s and not yet done.
pub async fn open_task_job(db: &Db, server: ServerId, task: TaskId) -> StoreResult<Option<JobId>> {
    let row: Option<(Option<String>,)> = on_read!(db, |p| sqlx::query_as(
        "SELECT job_uuid FROM tasks WHERE uuid = $1 AND server_uuid = $2 AND state <> 'done'"
    )
    .bind(task.to_string())
    .bind(server.to_string())
    .fetch_optional(p)
    .await)?;
    let (job,) = row.ok_or(StoreError::NotFound("task"))?;
    job.as_deref().map(|j| parse_uuid(j, "job")).transpose()
}
