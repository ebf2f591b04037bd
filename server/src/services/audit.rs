//! The audit log's writer: every state-changing call is recorded before its answer leaves,
//! and calls that end together share one insert.

use super::Ctx;
use crate::store::ops::{self, AuditRecord};
use passage_model::AccountId;
use tokio::sync::oneshot;

/// How long a batch waits for the callers of the last one: an insert takes a millisecond
/// or two, so not long.
pub const LINGER: std::time::Duration = std::time::Duration::from_millis(1);

/// Records written together at most.
const MAX_BATCH: usize = 256;

/// What a call changed that its method and path do not say, for its audit record: a
/// handler puts it in its response's extensions, and the audit middleware takes it.
#[derive(Clone, Debug)]
pub struct AuditDetail(pub String);

pub struct Pending {
    record: AuditRecord,
    written: oneshot::Sender<Result<(), String>>,
}

/// Appends a call that `actor` (uuid and login) made and that answered `status` to the
/// audit log, timed now, with what it changed where its path does not say; returns once
/// it is stored.
pub async fn record(
    ctx: &Ctx,
    actor: Option<(AccountId, String)>,
    method: String,
    path: String,
    status: u16,
    detail: Option<String>,
) -> Result<(), String> {
    let record = AuditRecord {
        at: crate::store::now_ms(),
        actor,
        method,
        path,
        status,
        detail,
    };
    let (written, done) = oneshot::channel();
    ctx.audit
        .submit(ctx, Pending { record, written }, MAX_BATCH, write)
        .await
        .map_err(|_| "the audit writer has stopped".to_string())?;
    done.await
        .map_err(|_| "the audit writer ended without an answer".to_string())?
}

async fn write(ctx: Ctx, batch: Vec<Pending>) {
    let records: Vec<AuditRecord> = batch.iter().map(|p| p.record.clone()).collect();
    let t0 = std::time::Instant::now();
    let r = ops::audit(&ctx.audit_db, &records)
        .await
        .map_err(|e| e.to_string());
    tracing::debug!(
        records = records.len(),
        took_ms = t0.elapsed().as_secs_f64() * 1e3,
        "audit batch written"
    );
    for p in batch {
        let _ = p.written.send(r.clone());
    }
}
