//! A VM's tags and metadata after its creation: read, merged, replaced and deleted by the
//! same limits as at creation. Tenants change their own VMs' (others' are not found),
//! operators any; readers only read. The audit log records the calls (its middleware).

use super::Ctx;
use super::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::store::vms::{self, Labels};
use crate::store::{StoreError, corrupt};
use passage_model::api::{Role, VmState};
use passage_model::decode::BodyError;
use passage_model::tags::Tags;
use passage_model::{VmId, metadata, tags};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;

/// Changes made at once each re-read what the other wrote; this bounds the retries, not
/// correctness.
const MAX_ATTEMPTS: usize = 16;

/// What a call does to the keys.
#[derive(Clone, Debug)]
pub enum Change<V> {
    /// Sets the given keys, keeping the others.
    Merge(BTreeMap<String, V>),
    /// Makes these the only keys.
    Replace(BTreeMap<String, V>),
    /// Removes one key (not found if absent).
    Delete(String),
    /// Removes every key.
    DeleteAll,
}

/// How each kind of label is named in answers and checked.
trait Kind {
    type Value: Serialize + DeserializeOwned + Clone;
    const WHICH: Labels;
    const FIELD: &'static str;
    const ONE: &'static str;
    fn check(field: &str, all: &BTreeMap<String, Self::Value>) -> Result<(), BodyError>;
}

struct TagKind;
impl Kind for TagKind {
    type Value = serde_json::Value;
    const WHICH: Labels = Labels::Tags;
    const FIELD: &'static str = "tags";
    const ONE: &'static str = "tag";
    fn check(field: &str, all: &Tags) -> Result<(), BodyError> {
        tags::check(field, all)
    }
}

struct MetadataKind;
impl Kind for MetadataKind {
    type Value = String;
    const WHICH: Labels = Labels::Metadata;
    const FIELD: &'static str = "metadata";
    const ONE: &'static str = "metadata key";
    fn check(field: &str, all: &BTreeMap<String, String>) -> Result<(), BodyError> {
        metadata::check(field, all)
    }
}

/// The VM's labels as stored, if the caller sees the VM.
async fn read<K: Kind>(
    ctx: &Ctx,
    caller: &Caller,
    uuid: VmId,
) -> ApiResult<(VmState, String, BTreeMap<String, K::Value>)> {
    let (owner, state, text) = match vms::labels(&ctx.db, uuid, K::WHICH).await {
        Ok(r) => r,
        Err(StoreError::NotFound(_)) => return Err(ApiError::not_found("vm")),
        Err(e) => return Err(e.into()),
    };
    if !caller.sees(owner) {
        return Err(ApiError::not_found("vm"));
    }
    let all = serde_json::from_str(&text).map_err(corrupt)?;
    Ok((state, text, all))
}

async fn change<K: Kind>(
    ctx: &Ctx,
    caller: &Caller,
    uuid: VmId,
    change: Change<K::Value>,
) -> ApiResult<BTreeMap<String, K::Value>> {
    if caller.account.role == Role::Reader {
        // Only after the VM is known to be visible would a 403 say more than a 404; a
        // reader sees every VM, so it says nothing.
        return Err(ApiError::forbidden());
    }
    for _ in 0..MAX_ATTEMPTS {
        let (state, old_text, old) = read::<K>(ctx, caller, uuid).await?;
        if state == VmState::Destroyed {
            return Err(ApiError::invalid_state("the VM is destroyed"));
        }
        let new = match &change {
            Change::Merge(m) => {
                let mut all = old;
                all.extend(m.iter().map(|(k, v)| (k.clone(), v.clone())));
                all
            }
            Change::Replace(m) => m.clone(),
            Change::Delete(k) => {
                let mut all = old;
                if all.remove(k).is_none() {
                    return Err(ApiError::not_found(K::ONE));
                }
                all
            }
            Change::DeleteAll => BTreeMap::new(),
        };
        K::check(K::FIELD, &new)?;
        let new_text = serde_json::to_string(&new)
            .map_err(|e| ApiError::internal(format!("{}: {e}", K::FIELD)))?;
        if new_text == old_text
            || vms::swap_labels(&ctx.db, uuid, K::WHICH, &old_text, &new_text).await?
        {
            return Ok(new);
        }
    }
    Err(ApiError::conflict(format!(
        "the VM's {} kept changing; try again",
        K::FIELD
    )))
}

pub async fn tags(ctx: &Ctx, caller: &Caller, uuid: VmId) -> ApiResult<Tags> {
    Ok(read::<TagKind>(ctx, caller, uuid).await?.2)
}

pub async fn tag(
    ctx: &Ctx,
    caller: &Caller,
    uuid: VmId,
    key: &str,
) -> ApiResult<serde_json::Value> {
    tags(ctx, caller, uuid)
        .await?
        .remove(key)
        .ok_or_else(|| ApiError::not_found("tag"))
}

/// Applies `c` to the VM's tags; answers them as they are after it.
pub async fn change_tags(
    ctx: &Ctx,
    caller: &Caller,
    uuid: VmId,
    c: Change<serde_json::Value>,
) -> ApiResult<Tags> {
    change::<TagKind>(ctx, caller, uuid, c).await
}

pub async fn metadata(
    ctx: &Ctx,
    caller: &Caller,
    uuid: VmId,
) -> ApiResult<BTreeMap<String, String>> {
    Ok(read::<MetadataKind>(ctx, caller, uuid).await?.2)
}

pub async fn metadata_value(
    ctx: &Ctx,
    caller: &Caller,
    uuid: VmId,
    key: &str,
) -> ApiResult<String> {
    metadata(ctx, caller, uuid)
        .await?
        .remove(key)
        .ok_or_else(|| ApiError::not_found("metadata key"))
}

/// Applies `c` to the VM's metadata; answers it as it is after it. The guest reads it
/// from the seed made at its next start.
pub async fn change_metadata(
    ctx: &Ctx,
    caller: &Caller,
    uuid: VmId,
    c: Change<String>,
) -> ApiResult<BTreeMap<String, String>> {
    change::<MetadataKind>(ctx, caller, uuid, c).await
}

/// What node `server`'s metadata service tells VM `uuid`'s guest: its tags, metadata and
/// keys as they are now. Not found unless the VM is placed on that node and not destroyed,
/// so a node learns nothing of another node's VMs.
pub async fn for_guest(
    ctx: &Ctx,
    server: passage_model::ServerId,
    uuid: VmId,
) -> ApiResult<passage_model::protocol::GuestMetadata> {
    let vm = match vms::get(&ctx.db, uuid).await {
        Ok(v) => v,
        Err(StoreError::NotFound(_)) => return Err(ApiError::not_found("vm")),
        Err(e) => return Err(e.into()),
    };
    if vm.server_uuid != Some(server) || vm.state == VmState::Destroyed {
        return Err(ApiError::not_found("vm"));
    }
    let keys = match vms::given_keys(&ctx.db, uuid).await {
        Ok(k) => k,
        Err(StoreError::NotFound(_)) => return Err(ApiError::not_found("vm")),
        Err(e) => return Err(e.into()),
    };
    Ok(passage_model::protocol::GuestMetadata {
        uuid,
        owner_uuid: Some(vm.owner_uuid),
        hostname: vm.alias,
        tags: vm.tags,
        metadata: vm.metadata,
        keys: keys.map(|ks| {
            ks.into_iter()
                .map(|k| passage_model::protocol::GuestKey {
                    name: k.name,
                    key: k.key,
                })
                .collect()
        }),
    })
}
