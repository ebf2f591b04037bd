//! Passwords, tokens and who is calling.
//!
//! Passwords: argon2id with the crate's defaults (19 MiB, 2 passes, 1 lane), hashed off
//! the async runtime. Tokens: 32 random bytes, stored as SHA-256 hashes only.

use super::Ctx;
use crate::error::{ApiError, ApiResult};
use crate::store::{self, accounts};
use argon2::Argon2;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use passage_model::api::{Account, LoginResponse, MAX_LOGIN_LEN, MAX_PASSWORD_LEN, Role};
use rand::RngCore;
use sha2::{Digest, Sha256};
use std::sync::OnceLock;

pub const USER_TOKEN_PREFIX: &str = "pst_";
pub const NODE_CREDENTIAL_PREFIX: &str = "psn_";
pub const JOIN_TOKEN_PREFIX: &str = "psj_";

pub fn new_secret(prefix: &str) -> String {
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    format!("{prefix}{}", hex::encode(bytes))
}

pub fn sha256_hex(s: &str) -> String {
    hex::encode(Sha256::digest(s.as_bytes()))
}

pub async fn hash_password(password: String) -> ApiResult<String> {
    tokio::task::spawn_blocking(move || {
        let salt = SaltString::generate(&mut rand::rngs::OsRng);
        Argon2::default()
            .hash_password(password.as_bytes(), &salt)
            .map(|h| h.to_string())
            .map_err(|e| ApiError::internal(format!("argon2: {e}")))
    })
    .await
    .map_err(|e| ApiError::internal(format!("hashing task: {e}")))?
}

async fn verify_password(hash: String, password: String) -> bool {
    tokio::task::spawn_blocking(move || {
        PasswordHash::new(&hash)
            .map(|h| {
                Argon2::default()
                    .verify_password(password.as_bytes(), &h)
                    .is_ok()
            })
            .unwrap_or(false)
    })
    .await
    .unwrap_or(false)
}

/// A real hash of a password nobody knows: an unknown login is checked against it so it
/// costs the same time as a wrong password.
fn decoy_hash() -> &'static str {
    static DECOY: OnceLock<String> = OnceLock::new();
    DECOY.get_or_init(|| {
        let salt = SaltString::generate(&mut rand::rngs::OsRng);
        Argon2::default()
            .hash_password(new_secret("").as_bytes(), &salt)
            .map(|h| h.to_string())
            .unwrap_or_default()
    })
}

pub async fn login(
    ctx: &Ctx,
    login: &str,
    password: &str,
    addr: Option<std::net::IpAddr>,
) -> ApiResult<LoginResponse> {
    if login.is_empty() || login.len() > MAX_LOGIN_LEN || password.len() > MAX_PASSWORD_LEN {
        return Err(bad_credentials());
    }
    if let Some(wait) = ctx.login_guard.check(login, addr) {
        return Err(ApiError::new(
            passage_model::ErrorCode::RateLimited,
            format!(
                "too many failed logins; try again in {} s",
                wait.as_secs().max(1)
            ),
        ));
    }
    let found = accounts::credentials(&ctx.db, login).await?;
    let (account, hash) = match found {
        Some((a, h)) => (Some(a), h),
        None => (None, decoy_hash().to_string()),
    };
    let ok = verify_password(hash, password.to_string()).await;
    let account = match (ok, account) {
        (true, Some(a)) => a,
        _ => {
            ctx.login_guard.failed(login, addr);
            return Err(bad_credentials());
        }
    };
    ctx.login_guard.succeeded(login);
    let token = new_secret(USER_TOKEN_PREFIX);
    let ttl = chrono::Duration::from_std(ctx.cfg.token_ttl)
        .map_err(|e| ApiError::internal(format!("token ttl: {e}")))?;
    let expires_at = chrono::Utc::now() + ttl;
    accounts::insert_token(
        &ctx.db,
        account.uuid,
        &sha256_hex(&token),
        "login",
        "login",
        expires_at.timestamp_millis(),
    )
    .await?;
    Ok(LoginResponse {
        token,
        expires_at,
        account,
    })
}

fn bad_credentials() -> ApiError {
    ApiError::new(
        passage_model::ErrorCode::Unauthorized,
        "wrong login or password",
    )
}

/// The account behind a bearer token; node credentials are not user tokens. A login
/// session's use is recorded, at most once per `touch_every`, to keep it from idling out.
pub async fn caller_from_token(ctx: &Ctx, token: &str) -> ApiResult<Account> {
    if !token.starts_with(USER_TOKEN_PREFIX) || token.len() > 128 {
        return Err(ApiError::unauthorized());
    }
    let hash = sha256_hex(token);
    let now = chrono::Utc::now().timestamp_millis();
    let idle = millis(ctx.cfg.session_idle);
    let idle_since = now.saturating_sub(idle);
    let mut live = ctx
        .tokens
        .get_or_load(&hash, || async {
            accounts::by_token(&ctx.db, &hash, idle_since)
                .await?
                .ok_or_else(ApiError::unauthorized)
        })
        .await?;
    if !live.live(now, idle_since) {
        ctx.tokens.forget(&hash);
        return Err(ApiError::unauthorized());
    }
    if now.saturating_sub(live.last_used_at) >= touch_every(idle) {
        accounts::touch_token(&ctx.db, &hash).await?;
        live.last_used_at = now;
        ctx.tokens.put(&hash, live.clone());
    }
    Ok(live.account)
}

fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// How stale a session's recorded last use may get before it is written again. A write
/// per request would turn every read into a write; this way a session may end up to a
/// quarter of the idle timeout (at most a minute) before the full idle time has passed.
fn touch_every(idle_ms: i64) -> i64 {
    (idle_ms / 4).min(60_000)
}

pub async fn logout(ctx: &Ctx, token: &str) -> ApiResult<()> {
    let hash = sha256_hex(token);
    accounts::delete_token_by_hash(&ctx.db, &hash).await?;
    ctx.tokens.forget(&hash);
    Ok(())
}

/// Creates the operator `admin` on an empty database. Returns the generated password
/// when none was given, so the caller can show it once.
pub async fn bootstrap_admin(ctx: &Ctx, password: Option<String>) -> ApiResult<Option<String>> {
    if accounts::count(&ctx.db).await? > 0 {
        return Ok(None);
    }
    let generated = password.is_none();
    let password = password.unwrap_or_else(|| new_secret("")[..24].to_string());
    let hash = hash_password(password.clone()).await?;
    match accounts::insert(
        &ctx.db,
        accounts::NewAccount {
            login: "admin",
            password_hash: &hash,
            role: Role::Operator,
            gpu_quota: None,
        },
    )
    .await
    {
        Ok(_) => Ok(generated.then_some(password)),
        // Another replica created it first.
        Err(store::StoreError::Conflict(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Who is calling /v1. Every role check lives here.
#[derive(Clone, Debug)]
pub struct Caller {
    pub account: Account,
}

impl Caller {
    /// Changes to fleet-wide objects: operators only.
    pub fn require_operator(&self) -> ApiResult<()> {
        if self.account.role == Role::Operator {
            Ok(())
        } else {
            Err(ApiError::forbidden())
        }
    }

    /// Reading fleet-wide objects: operators and read-only operators.
    pub fn require_staff(&self) -> ApiResult<()> {
        if self.account.role.sees_all() {
            Ok(())
        } else {
            Err(ApiError::forbidden())
        }
    }

    /// Whether an object owned by `owner` exists for this caller at all; a tenant gets
    /// 404 for another tenant's objects, never a hint that they exist.
    pub fn sees(&self, owner: passage_model::AccountId) -> bool {
        self.account.role.sees_all() || self.account.uuid == owner
    }

    /// Changing an object owned by `owner`: its owner or an operator.
    pub fn may_change(&self, owner: passage_model::AccountId) -> ApiResult<()> {
        if !self.sees(owner) {
            return Err(ApiError::not_found("object"));
        }
        if self.account.role == Role::Reader {
            return Err(ApiError::forbidden());
        }
        Ok(())
    }
}

const DEFAULT_API_TOKEN_TTL_SECS: u64 = 90 * 24 * 3600;
const MAX_API_TOKEN_TTL_SECS: u64 = 365 * 24 * 3600;

/// A new API token for the caller; the secret is in this answer only.
pub async fn create_api_token(
    ctx: &Ctx,
    caller: &Caller,
    req: passage_model::api::CreateApiToken,
) -> ApiResult<passage_model::api::ApiToken> {
    let name = req.name.trim();
    if name.is_empty() || name.chars().count() > 64 || name.chars().any(char::is_control) {
        return Err(ApiError::invalid(
            "name",
            "must be 1 to 64 printable characters",
        ));
    }
    let ttl = req.ttl_secs.unwrap_or(DEFAULT_API_TOKEN_TTL_SECS);
    if !(60..=MAX_API_TOKEN_TTL_SECS).contains(&ttl) {
        return Err(ApiError::invalid(
            "ttl_secs",
            format!("must be 60 to {MAX_API_TOKEN_TTL_SECS}"),
        ));
    }
    let token = new_secret(USER_TOKEN_PREFIX);
    let expires_at =
        chrono::Utc::now() + chrono::Duration::seconds(i64::try_from(ttl).unwrap_or(3600));
    let uuid = accounts::insert_token(
        &ctx.db,
        caller.account.uuid,
        &sha256_hex(&token),
        "api",
        name,
        expires_at.timestamp_millis(),
    )
    .await?;
    Ok(passage_model::api::ApiToken {
        uuid: uuid.parse().map_err(|_| ApiError::internal("token uuid"))?,
        name: name.to_string(),
        expires_at,
        token: Some(token),
    })
}

pub async fn list_api_tokens(
    ctx: &Ctx,
    caller: &Caller,
) -> ApiResult<Vec<passage_model::api::ApiToken>> {
    accounts::list_tokens(&ctx.db, caller.account.uuid)
        .await?
        .into_iter()
        .map(|t| {
            Ok(passage_model::api::ApiToken {
                uuid: t
                    .uuid
                    .parse()
                    .map_err(|_| ApiError::internal("token uuid"))?,
                name: t.name,
                expires_at: store::to_time(t.expires_at),
                token: None,
            })
        })
        .collect()
}

pub async fn delete_api_token(ctx: &Ctx, caller: &Caller, uuid: uuid::Uuid) -> ApiResult<()> {
    let r = accounts::delete_token(&ctx.db, caller.account.uuid, &uuid.to_string()).await;
    // The cache is keyed by the secret's hash, which the uuid does not give.
    ctx.tokens.clear();
    Ok(r?)
}
