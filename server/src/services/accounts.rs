//! Accounts (operator only).

use super::Ctx;
use super::auth::{Caller, hash_password, validate_password};
use crate::error::{ApiError, ApiResult};
use crate::store::accounts;
use passage_model::AccountId;
use passage_model::api::{Account, CreateAccount, MAX_LOGIN_LEN, UpdateAccount};

fn validate_login(login: &str) -> ApiResult<()> {
    let ok = !login.is_empty()
        && login.len() <= MAX_LOGIN_LEN
        && login
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'@'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "login",
            format!("must be 1 to {MAX_LOGIN_LEN} characters of A-Z, a-z, 0-9, '_', '-', '.', '@'"),
        ))
    }
}

fn validate_quota(q: Option<u32>) -> ApiResult<()> {
    if q.is_some_and(|q| q > 100_000) {
        return Err(ApiError::invalid("gpu_quota", "must be at most 100000"));
    }
    Ok(())
}

pub async fn create(ctx: &Ctx, caller: &Caller, req: CreateAccount) -> ApiResult<Account> {
    caller.require_operator()?;
    validate_login(&req.login)?;
    validate_password("password", &req.password)?;
    validate_quota(req.gpu_quota)?;
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
    if let Some(pw) = &req.password {
        validate_password("password", pw)?;
    }
    if let Some(q) = req.gpu_quota {
        validate_quota(q)?;
    }
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
