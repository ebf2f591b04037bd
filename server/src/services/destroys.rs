//! Group commit for deletions: the VMs deleted together go `destroying`, with their destroy
//! jobs, in one transaction (`store::vms::begin_destroy_many`). A deletion alone was a
//! transaction of its own, and a burst of them on Postgres waited for the WAL's flush once
//! per VM.

use super::Ctx;
use crate::store::jobs::NewJob;
use crate::store::vms::{self, DestroyReq};
use crate::store::{StoreError, StoreResult};
use crate::workflows::{self, destroy::Destroy};
use passage_model::api::Vm;
use tokio::sync::oneshot;

/// Deletions written together at most.
const MAX_BATCH: usize = 256;

/// A deletion waits for its answer: whatever queued while the last batch was written is
/// the next batch.
pub const LINGER: std::time::Duration = std::time::Duration::ZERO;

pub struct Pending {
    req: DestroyReq,
    begun: oneshot::Sender<StoreResult<Option<Vm>>>,
}

/// Starts destroying `req.vm` with the job `req.job`, batched with the deletions that come
/// with it. `None`: the VM was not changed (missing, another's, busy or destroyed).
pub async fn begin(ctx: &Ctx, req: DestroyReq) -> StoreResult<Option<Vm>> {
    ctx.destroys
        .ask(ctx, |begun| Pending { req, begun }, MAX_BATCH, write)
        .await
        .ok_or(StoreError::Sqlx(sqlx::Error::PoolClosed))?
}

/// The destroy job of a VM as the update that began its destroy left it (alone or in a
/// batch): the job is the one the VM row now names.
pub fn job_for(vm: &Vm) -> StoreResult<NewJob> {
    let Some(job) = vm.job_uuid else {
        return Err(StoreError::Corrupt("a VM destroyed without its job".into()));
    };
    workflows::new_job::<Destroy>(job, Some(vm.uuid), Some(vm.owner_uuid), &())
        .map_err(|e| StoreError::Corrupt(e.to_string()))
}

async fn write(ctx: Ctx, batch: Vec<Pending>) {
    let (reqs, answers): (Vec<DestroyReq>, Vec<_>) =
        batch.into_iter().map(|p| (p.req, p.begun)).unzip();
    match vms::begin_destroy_many(&ctx.api_db, &reqs, job_for).await {
        Ok(begun) => {
            for (vm, answer) in begun.into_iter().zip(answers) {
                let _ = answer.send(Ok(vm));
            }
        }
        // One transaction, all or nothing: each alone, so that an error is its own.
        Err(e) if reqs.len() > 1 => {
            tracing::warn!(error = %e, deletions = reqs.len(),
                "a batch of deletions failed; writing them one by one");
            for (req, answer) in reqs.into_iter().zip(answers) {
                let r = vms::begin_destroy_many(&ctx.api_db, std::slice::from_ref(&req), job_for)
                    .await
                    .map(|mut v| v.pop().flatten());
                let _ = answer.send(r);
            }
        }
        Err(e) => {
            if let Some(answer) = answers.into_iter().next() {
                let _ = answer.send(Err(e));
            }
        }
    }
}
