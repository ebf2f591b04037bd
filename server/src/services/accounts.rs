//! Accounts (operator only).

use super::Ctx;
use super::auth::{Caller, hash_password};
use crate::error::{ApiError, ApiResult};
use crate::store::accounts;
use passage_model::AccountId;
use passage_model::api::{Account, CreateAccount, UpdateAccount};

pub async fn create(ctx: &Ctx, caller: &Caller, req: CreateAccount) -> ApiResult<Account> {
    caller.require_operator()?;
    req.validate()?;
    let hash = hash_password(req.password).await?;
    Ok(accounts::insert(
        &ctx.db,
        accounts::NewAccount {
            login: &req.login,
            password_hash: &hash,
            role: req.role,
            gpu_quota: req.gpu_quota,
        },
    )
    .await?)
}

/// A tenant may read itself; another account does not exist for it.
fn visible(caller: &Caller, uuid: AccountId) -> ApiResult<()> {
    if caller.account.uuid == uuid || caller.account.role.sees_all() {
        Ok(())
    } else {
        Err(ApiError::not_found("account"))
    }
}

pub async fn get(ctx: &Ctx, caller: &Caller, uuid: AccountId) -> ApiResult<Account> {
    visible(caller, uuid)?;
    Ok(accounts::get(&ctx.db, uuid).await?)
}

pub async fn list(
    ctx: &Ctx,
    caller: &Caller,
    limit: i64,
    offset: i64,
) -> ApiResult<(Vec<Account>, i64)> {
    caller.require_staff()?;
    Ok(accounts::list(&ctx.db, limit, offset).await?)
}

pub async fn update(
    ctx: &Ctx,
    caller: &Caller,
    uuid: AccountId,
    req: UpdateAccount,
) -> ApiResult<Account> {
    visible(caller, uuid)?;
    caller.require_operator()?;
    req.validate()?;
    if uuid == caller.account.uuid && req.role.is_some_and(|r| r != caller.account.role) {
        return Err(ApiError::invalid_state(
            "you cannot change your own role (ask another operator)",
        ));
    }
    let hash = match req.password {
        Some(pw) => Some(hash_password(pw).await?),
        None => None,
    };
    let changed_password = hash.is_some();
    let account = accounts::update(&ctx.db, uuid, hash.as_deref(), req.role, req.gpu_quota).await;
    // Tokens remember their account's role and quota.
    ctx.tokens.clear();
    let account = account?;
    if changed_password {
        // A new password ends every session opened with the old one.
        let r = accounts::delete_login_tokens(&ctx.db, uuid).await;
        ctx.tokens.clear();
        r?;
    }
    Ok(account)
}

pub async fn delete(ctx: &Ctx, caller: &Caller, uuid: AccountId) -> ApiResult<()> {
    visible(caller, uuid)?;
    caller.require_operator()?;
    if uuid == caller.account.uuid {
        return Err(ApiError::new(
            passage_model::ErrorCode::Conflict,
            "you cannot delete your own account",
        ));
    }
    let r = accounts::delete(&ctx.db, uuid).await;
    ctx.tokens.clear();
    Ok(r?)
}
