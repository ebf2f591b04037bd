//! Accounts' SSH public keys. A name and a fingerprint are each unique per account; the
//! service parses and checks a key before it gets here.

use super::{Db, StoreError, StoreResult, now_ms, to_time, unique_as_conflict};
use crate::{on_read, on_write};
use passage_model::AccountId;
use passage_model::keys::{MAX_KEYS_PER_ACCOUNT, SshKey};

#[derive(sqlx::FromRow)]
struct KeyRow {
    name: String,
    public_key: String,
    fingerprint: String,
    md5_fingerprint: String,
    created_at: i64,
}

impl From<KeyRow> for SshKey {
    fn from(r: KeyRow) -> Self {
        SshKey {
            name: r.name,
            key: r.public_key,
            fingerprint: r.fingerprint,
            md5_fingerprint: r.md5_fingerprint,
            created_at: to_time(r.created_at),
        }
    }
}

const COLS: &str = "name, public_key, fingerprint, md5_fingerprint, created_at";

/// Adds a key to `account`, unless it already holds [`MAX_KEYS_PER_ACCOUNT`] (the count is
/// the insert's own condition) or one of that name or fingerprint.
pub async fn insert(db: &Db, account: AccountId, key: &SshKey) -> StoreResult<SshKey> {
    let now = now_ms();
    let n = on_write!(db, |p| sqlx::query(
        "INSERT INTO ssh_keys (account_uuid, name, public_key, fingerprint, md5_fingerprint, \
         created_at) SELECT $1, $2, $3, $4, $5, $6 \
         WHERE (SELECT COUNT(*) FROM ssh_keys WHERE account_uuid = $1) < $7"
    )
    .bind(account.to_string())
    .bind(&key.name)
    .bind(&key.key)
    .bind(&key.fingerprint)
    .bind(&key.md5_fingerprint)
    .bind(now)
    .bind(MAX_KEYS_PER_ACCOUNT)
    .execute(p)
    .await
    .map(|r| r.rows_affected()))
    .map_err(|e| {
        unique_as_conflict(e, || {
            format!(
                "the account already has a key named {:?} or the key {}",
                key.name, key.fingerprint
            )
        })
    })?;
    if n == 0 {
        return Err(StoreError::Conflict(format!(
            "an account holds at most {MAX_KEYS_PER_ACCOUNT} keys; delete one first"
        )));
    }
    Ok(SshKey {
        created_at: to_time(now),
        ..key.clone()
    })
}

/// An account's keys, newest first, and how many it has.
pub async fn list(
    db: &Db,
    account: AccountId,
    limit: i64,
    offset: i64,
) -> StoreResult<(Vec<SshKey>, i64)> {
    let sql = format!(
        "SELECT {COLS} FROM ssh_keys WHERE account_uuid = $1 \
         ORDER BY created_at DESC, name LIMIT $2 OFFSET $3"
    );
    let rows: Vec<KeyRow> = on_read!(db, |p| sqlx::query_as(&sql)
        .bind(account.to_string())
        .bind(limit)
        .bind(offset)
        .fetch_all(p)
        .await)?;
    let total: i64 = on_read!(db, |p| sqlx::query_scalar(
        "SELECT COUNT(*) FROM ssh_keys WHERE account_uuid = $1"
    )
    .bind(account.to_string())
    .fetch_one(p)
    .await)?;
    Ok((rows.into_iter().map(SshKey::from).collect(), total))
}

/// Every key of `account`, oldest first (the order a seed lists them in), in one read:
/// what a new VM is given, read on every creation.
pub async fn all(db: &Db, account: AccountId) -> StoreResult<Vec<SshKey>> {
    let sql = format!(
        "SELECT {COLS} FROM ssh_keys WHERE account_uuid = $1 \
         ORDER BY created_at, name DESC LIMIT $2"
    );
    let rows: Vec<KeyRow> = on_read!(db, |p| sqlx::query_as(&sql)
        .bind(account.to_string())
        .bind(passage_model::keys::MAX_KEYS_PER_ACCOUNT)
        .fetch_all(p)
        .await)?;
    Ok(rows.into_iter().map(SshKey::from).collect())
}

pub async fn get(db: &Db, account: AccountId, name: &str) -> StoreResult<SshKey> {
    let sql = format!("SELECT {COLS} FROM ssh_keys WHERE account_uuid = $1 AND name = $2");
    let row: Option<KeyRow> = on_read!(db, |p| sqlx::query_as(&sql)
        .bind(account.to_string())
        .bind(name)
        .fetch_optional(p)
        .await)?;
    row.map(SshKey::from).ok_or(StoreError::NotFound("key"))
}

pub async fn delete(db: &Db, account: AccountId, name: &str) -> StoreResult<()> {
    let n = on_write!(db, |p| sqlx::query(
        "DELETE FROM ssh_keys WHERE account_uuid = $1 AND name = $2"
    )
    .bind(account.to_string())
    .bind(name)
    .execute(p)
    .await
    .map(|r| r.rows_affected()))?;
    if n == 0 {
        return Err(StoreError::NotFound("key"));
    }
    Ok(())
}

/// The account of `login` and its key of MD5 fingerprint `md5`, as OpenSSH text: what an
/// HTTP Signature names (`/LOGIN/keys/MD5`). `None` when either is unknown.
pub async fn signing_key(
    db: &Db,
    login: &str,
    md5: &str,
) -> StoreResult<Option<(AccountId, String)>> {
    let row: Option<(String, String)> = on_read!(db, |p| sqlx::query_as(
        "SELECT a.uuid, k.public_key FROM accounts a \
         JOIN ssh_keys k ON k.account_uuid = a.uuid \
         WHERE a.login = $1 AND k.md5_fingerprint = $2"
    )
    .bind(login)
    .bind(md5)
    .fetch_optional(p)
    .await)?;
    row.map(|(uuid, key)| Ok((super::parse_uuid(&uuid, "account")?, key)))
        .transpose()
}

/// An account's key by its MD5 fingerprint (`aa:bb:…`), as CloudAPI's GetKey also takes.
pub async fn by_md5(db: &Db, account: AccountId, md5: &str) -> StoreResult<SshKey> {
    let sql =
        format!("SELECT {COLS} FROM ssh_keys WHERE account_uuid = $1 AND md5_fingerprint = $2");
    let row: Option<KeyRow> = on_read!(db, |p| sqlx::query_as(&sql)
        .bind(account.to_string())
        .bind(md5)
        .fetch_optional(p)
        .await)?;
    row.map(SshKey::from).ok_or(StoreError::NotFound("key"))
}
