//! The audit log's writer: every state-changing call is recorded before its answer leaves,
//! and calls that end together share one insert.

use super::Ctx;
use crate::store::ops::{self, AuditRecord};
use tokio::sync::oneshot;

/// Records written together at most.
const MAX_BATCH: usize = 256;

pub struct Pending {
    record: AuditRecord,
    written: oneshot::Sender<Result<(), String>>,
}

/// Appends `record` to the audit log; returns once it is stored.
pub async fn record(ctx: &Ctx, record: AuditRecord) -> Result<(), String> {
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
    let r = ops::audit(&ctx.db, &records)
        .await
        .map_err(|e| e.to_string());
    for p in batch {
        let _ = p.written.send(r.clone());
    }
}
