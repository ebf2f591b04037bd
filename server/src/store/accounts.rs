//! Accounts and their login/API tokens. Password hashes never leave this module.

use super::{Db, StoreError, StoreResult, now_ms, parse_uuid, to_time, unique_as_conflict};
use crate::{on_read, on_write};
use passage_model::AccountId;
use passage_model::api::{Account, Role};

#[derive(sqlx::FromRow)]
struct AccountRow {
    uuid: String,
    login: String,
    role: String,
    gpu_quota: Option<i64>,
    created_at: i64,
}

impl AccountRow {
    fn into_view(self) -> StoreResult<Account> {
        Ok(Account {
            uuid: parse_uuid(&self.uuid, "account")?,
            role: Role::parse(&self.role)
                .ok_or_else(|| StoreError::Corrupt(format!("role {:?}", self.role)))?,
            login: self.login,
            gpu_quota: self.gpu_quota.and_then(|q| u32::try_from(q).ok()),
            created_at: to_time(self.created_at),
        })
    }
}

const COLS: &str = "uuid, login, role, gpu_quota, created_at";

pub struct NewAccount<'a> {
    pub login: &'a str,
    pub password_hash: &'a str,
    pub role: Role,
    pub gpu_quota: Option<u32>,
}

pub async fn insert(db: &Db, a: NewAccount<'_>) -> StoreResult<Account> {
    let uuid = AccountId::new_random();
    let now = now_ms();
    on_write!(db, |p| {
        sqlx::query(
            "INSERT INTO accounts (uuid, login, password_hash, role, gpu_quota, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(uuid.to_string())
        .bind(a.login)
        .bind(a.password_hash)
        .bind(a.role.as_str())
        .bind(a.gpu_quota.map(i64::from))
        .bind(now)
        .execute(p)
        .await
        .map(|r| r.rows_affected())
    })
    .map_err(|e| unique_as_conflict(e, || format!("login {:?} is taken", a.login)))?;
    get(db, uuid).await
}

pub async fn count(db: &Db) -> StoreResult<i64> {
    let n: i64 = on_read!(db, |p| sqlx::query_scalar("SELECT COUNT(*) FROM accounts")
        .fetch_one(p)
        .await)?;
    Ok(n)
}

pub async fn get(db: &Db, uuid: AccountId) -> StoreResult<Account> {
    let row: Option<AccountRow> = on_read!(db, |p| sqlx::query_as(&format!(
        "SELECT {COLS} FROM accounts WHERE uuid = $1"
    ))
    .bind(uuid.to_string())
    .fetch_optional(p)
    .await)?;
    row.ok_or(StoreError::NotFound("account"))?.into_view()
}

/// The account and its password hash, for login only.
pub async fn credentials(db: &Db, login: &str) -> StoreResult<Option<(Account, String)>> {
    #[derive(sqlx::FromRow)]
    struct Row {
        #[sqlx(flatten)]
        account: AccountRow,
        password_hash: String,
    }
    let row: Option<Row> = on_read!(db, |p| sqlx::query_as(&format!(
        "SELECT {COLS}, password_hash FROM accounts WHERE login = $1"
    ))
    .bind(login)
    .fetch_optional(p)
    .await)?;
    match row {
        Some(r) => Ok(Some((r.account.into_view()?, r.password_hash))),
        None => Ok(None),
    }
}

pub async fn list(db: &Db, limit: i64, offset: i64) -> StoreResult<(Vec<Account>, i64)> {
    let rows: Vec<AccountRow> = on_read!(db, |p| sqlx::query_as(&format!(
        "SELECT {COLS} FROM accounts ORDER BY created_at DESC, uuid DESC LIMIT $1 OFFSET $2"
    ))
    .bind(limit)
    .bind(offset)
    .fetch_all(p)
    .await)?;
    let total = count(db).await?;
    Ok((
        rows.into_iter()
            .map(AccountRow::into_view)
            .collect::<StoreResult<_>>()?,
        total,
    ))
}

pub async fn update(
    db: &Db,
    uuid: AccountId,
    password_hash: Option<&str>,
    role: Option<Role>,
    gpu_quota: Option<Option<u32>>,
) -> StoreResult<Account> {
    let n = on_write!(db, |p| sqlx::query(
        "UPDATE accounts SET \
           password_hash = COALESCE($2, password_hash), \
           role = COALESCE($3, role), \
           gpu_quota = CASE WHEN $4 = 1 THEN $5 ELSE gpu_quota END \
         WHERE uuid = $1"
    )
    .bind(uuid.to_string())
    .bind(password_hash)
    .bind(role.map(|r| r.as_str()))
    .bind(i64::from(gpu_quota.is_some()))
    .bind(gpu_quota.flatten().map(i64::from))
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    if n == 0 {
        return Err(StoreError::NotFound("account"));
    }
    get(db, uuid).await
}

pub async fn delete(db: &Db, uuid: AccountId) -> StoreResult<()> {
    let live: i64 = on_read!(db, |p| {
        sqlx::query_scalar(
        "SELECT COUNT(*) FROM vms WHERE owner_uuid = $1 AND state NOT IN ('destroyed', 'failed')"
    )
    .bind(uuid.to_string())
    .fetch_one(p)
    .await
    })?;
    if live > 0 {
        return Err(StoreError::Conflict(format!(
            "the account still owns {live} VM(s); destroy them first"
        )));
    }
    let n = on_write!(db, |p| sqlx::query(
        "DELETE FROM accounts WHERE uuid = $1 AND NOT EXISTS \
         (SELECT 1 FROM vms WHERE owner_uuid = $1)"
    )
    .bind(uuid.to_string())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    if n == 0 {
        // Either gone, or it owns destroyed VMs whose history must keep its owner.
        get(db, uuid).await?;
        return Err(StoreError::Conflict(
            "the account owns VM history and cannot be deleted".into(),
        ));
    }
    Ok(())
}

// ---- tokens ----

pub struct TokenRecord {
    pub uuid: String,
    pub name: String,
    pub kind: String,
    pub expires_at: i64,
}

pub async fn insert_token(
    db: &Db,
    account: AccountId,
    token_hash: &str,
    kind: &str,
    name: &str,
    expires_at: i64,
) -> StoreResult<String> {
    let uuid = uuid::Uuid::new_v4().to_string();
    on_write!(db, |p| sqlx::query(
        "INSERT INTO tokens (uuid, account_uuid, token_hash, kind, name, expires_at, \
         created_at, last_used_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $7)"
    )
    .bind(&uuid)
    .bind(account.to_string())
    .bind(token_hash)
    .bind(kind)
    .bind(name)
    .bind(expires_at)
    .bind(now_ms())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(uuid)
}

/// A live token: its account, when it was last seen in use and when it expires (ms since
/// the epoch), and whether it is a login session (which also ends when idle).
#[derive(Clone, Debug)]
pub struct LiveToken {
    pub account: Account,
    pub last_used_at: i64,
    pub expires_at: i64,
    pub session: bool,
}

impl LiveToken {
    /// Whether it still opens the door at `now`, for a session idle since before
    /// `idle_since` not.
    pub fn live(&self, now: i64, idle_since: i64) -> bool {
        self.expires_at > now && (!self.session || self.last_used_at > idle_since)
    }
}

#[derive(sqlx::FromRow)]
struct LiveRow {
    #[sqlx(flatten)]
    account: AccountRow,
    last_used_at: i64,
    expires_at: i64,
    kind: String,
}

/// The account behind a token hash, unless the token has expired or, for a login
/// session, has not been used since `idle_since` (ms since the epoch).
pub async fn by_token(
    db: &Db,
    token_hash: &str,
    idle_since: i64,
) -> StoreResult<Option<LiveToken>> {
    let row: Option<LiveRow> = on_read!(db, |p| sqlx::query_as(
        "SELECT a.uuid, a.login, a.role, a.gpu_quota, a.created_at, t.last_used_at, \
         t.expires_at, t.kind FROM tokens t JOIN accounts a ON a.uuid = t.account_uuid \
         WHERE t.token_hash = $1 AND t.expires_at > $2 \
         AND (t.kind = 'api' OR t.last_used_at > $3)"
    )
    .bind(token_hash)
    .bind(now_ms())
    .bind(idle_since)
    .fetch_optional(p)
    .await)?;
    row.map(|r| {
        Ok(LiveToken {
            account: r.account.into_view()?,
            last_used_at: r.last_used_at,
            expires_at: r.expires_at,
            session: r.kind == "login",
        })
    })
    .transpose()
}

/// Records that a token was used now.
pub async fn touch_token(db: &Db, token_hash: &str) -> StoreResult<()> {
    let now = now_ms();
    on_write!(db, |p| sqlx::query(
        "UPDATE tokens SET last_used_at = $2 WHERE token_hash = $1 AND last_used_at < $2"
    )
    .bind(token_hash)
    .bind(now)
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

pub async fn list_tokens(db: &Db, account: AccountId) -> StoreResult<Vec<TokenRecord>> {
    let rows: Vec<(String, String, String, i64)> = on_read!(db, |p| sqlx::query_as(
        "SELECT uuid, name, kind, expires_at FROM tokens WHERE account_uuid = $1 \
         AND kind = 'api' ORDER BY created_at DESC"
    )
    .bind(account.to_string())
    .fetch_all(p)
    .await)?;
    Ok(rows
        .into_iter()
        .map(|(uuid, name, kind, expires_at)| TokenRecord {
            uuid,
            name,
            kind,
            expires_at,
        })
        .collect())
}

pub async fn delete_token(db: &Db, account: AccountId, uuid: &str) -> StoreResult<()> {
    let n = on_write!(db, |p| sqlx::query(
        "DELETE FROM tokens WHERE uuid = $1 AND account_uuid = $2"
    )
    .bind(uuid)
    .bind(account.to_string())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    if n == 0 {
        return Err(StoreError::NotFound("token"));
    }
    Ok(())
}

pub async fn delete_token_by_hash(db: &Db, token_hash: &str) -> StoreResult<()> {
    on_write!(db, |p| sqlx::query(
        "DELETE FROM tokens WHERE token_hash = $1"
    )
    .bind(token_hash)
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

pub async fn delete_login_tokens(db: &Db, account: AccountId) -> StoreResult<()> {
    on_write!(db, |p| sqlx::query(
        "DELETE FROM tokens WHERE account_uuid = $1 AND kind = 'login'"
    )
    .bind(account.to_string())
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    Ok(())
}

/// Devices the account holds now (what its GPU quota is charged with).
pub async fn gpu_held(db: &Db, uuid: AccountId) -> StoreResult<i64> {
    let n: Option<i64> = on_read!(db, |p| sqlx::query_scalar(
        "SELECT gpu_held FROM accounts WHERE uuid = $1"
    )
    .bind(uuid.to_string())
    .fetch_optional(p)
    .await)?;
    n.ok_or(StoreError::NotFound("account"))
}
