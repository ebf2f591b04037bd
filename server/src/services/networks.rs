//! Networks: operators create and change them; tenants read the public ones and those
//! made for them (`owner_uuids`); another network does not exist for a tenant.

use super::Ctx;
use super::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::store::networks::{self as store, Changes, NewNetwork};
use crate::store::{StoreError, accounts};
use passage_model::NetworkId;
use passage_model::networks::{CreateNetwork, DEFAULT_MTU, Network, UpdateNetwork};

/// Every owner named exists.
async fn owners_exist(ctx: &Ctx, owners: &[passage_model::AccountId]) -> ApiResult<()> {
    for o in owners {
        match accounts::get(&ctx.db, *o).await {
            Ok(_) => {}
            Err(StoreError::NotFound(_)) => {
                return Err(ApiError::invalid("owner_uuids", format!("no account {o}")));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

pub async fn create(ctx: &Ctx, caller: &Caller, req: CreateNetwork) -> ApiResult<Network> {
    caller.require_operator()?;
    let (plan, resolvers) = req.validate()?;
    owners_exist(ctx, &req.owner_uuids).await?;
    Ok(store::insert(
        &ctx.db,
        NewNetwork {
            name: &req.name,
            plan,
            resolvers: &resolvers,
            vlan_id: req.vlan_id,
            bridge: &req.bridge,
            mtu: req.mtu.unwrap_or(DEFAULT_MTU),
            public: req.public,
            owners: &req.owner_uuids,
            default: req.default,
            description: req.description.as_deref().filter(|d| !d.is_empty()),
        },
    )
    .await?)
}

fn visible(caller: &Caller, n: &Network) -> bool {
    caller.account.role.sees_all() || n.public || n.owner_uuids.contains(&caller.account.uuid)
}

pub async fn get(ctx: &Ctx, caller: &Caller, uuid: NetworkId) -> ApiResult<Network> {
    let n = store::get(&ctx.db, uuid).await?;
    if visible(caller, &n) {
        Ok(n)
    } else {
        Err(ApiError::not_found("network"))
    }
}

pub async fn list(
    ctx: &Ctx,
    caller: &Caller,
    limit: i64,
    offset: i64,
) -> ApiResult<(Vec<Network>, i64)> {
    let who = (!caller.account.role.sees_all()).then_some(caller.account.uuid);
    Ok(store::list(&ctx.db, who, limit, offset).await?)
}

pub async fn update(
    ctx: &Ctx,
    caller: &Caller,
    uuid: NetworkId,
    req: UpdateNetwork,
) -> ApiResult<Network> {
    // A tenant learns nothing of a network it cannot see.
    get(ctx, caller, uuid).await?;
    caller.require_operator()?;
    let resolvers = req.validate()?;
    if let Some(o) = &req.owner_uuids {
        owners_exist(ctx, o).await?;
    }
    Ok(store::update(
        &ctx.db,
        uuid,
        Changes {
            name: req.name.as_deref(),
            resolvers: resolvers.as_deref(),
            mtu: req.mtu,
            public: req.public,
            owners: req.owner_uuids.as_deref(),
            default: req.default,
            description: req
                .description
                .as_deref()
                .map(|d| Some(d).filter(|d| !d.is_empty())),
        },
    )
    .await?)
}

pub async fn delete(ctx: &Ctx, caller: &Caller, uuid: NetworkId) -> ApiResult<()> {
    get(ctx, caller, uuid).await?;
    caller.require_operator()?;
    Ok(store::delete(&ctx.db, uuid).await?)
}
