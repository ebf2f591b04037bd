//! SSH public keys: an account's own (`/v1/keys`) and, for operators, any account's
//! (`/v1/accounts/{uuid}/keys`). A key is parsed and checked here, with `ssh-key`, and
//! stored in OpenSSH's one-line form as that crate writes it back.

use super::Ctx;
use super::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::store::{StoreError, accounts, keys};
use md5::Digest;
use passage_model::AccountId;
use passage_model::keys::{CreateSshKey, MAX_KEY_TEXT_LEN, SshKey, check_key_name};
use ssh_key::public::{EcdsaPublicKey, KeyData};
use ssh_key::{HashAlg, PublicKey};

/// The smallest RSA modulus accepted, in bits.
const MIN_RSA_BITS: usize = 2048;

const ACCEPTED: &str = "ssh-ed25519, ecdsa-sha2-nistp256/384/521 or ssh-rsa of at least 2048 bits";

/// A key as the API shows it, from its OpenSSH text; `name` defaults to the key's comment,
/// else its MD5 fingerprint. Anything but one key of an accepted type is `InvalidArgument`.
pub fn parse(req: &CreateSshKey) -> ApiResult<SshKey> {
    let bad = |why: String| ApiError::invalid("key", why);
    if req.key.len() > MAX_KEY_TEXT_LEN {
        return Err(bad(format!(
            "is {} bytes; a public key is at most {MAX_KEY_TEXT_LEN}",
            req.key.len()
        )));
    }
    let text = req.key.trim();
    if text.lines().count() != 1 {
        return Err(bad("must be one public key on one line".into()));
    }
    if text.starts_with("-----BEGIN") {
        return Err(bad(
            "is a PEM block; give the public key in OpenSSH's form (the line of a .pub file)"
                .into(),
        ));
    }
    let key = PublicKey::from_openssh(text).map_err(|e| {
        bad(format!(
            "is not an OpenSSH public key ({e}); give the line of a .pub file, e.g. \
             \"ssh-ed25519 AAAA… me@laptop\""
        ))
    })?;
    match key.key_data() {
        // Every curve OpenSSH and CloudAPI's signatures take (P-384 and P-521 sign
        // ecdsa-sha384 and ecdsa-sha512).
        KeyData::Ed25519(_)
        | KeyData::Ecdsa(
            EcdsaPublicKey::NistP256(_) | EcdsaPublicKey::NistP384(_) | EcdsaPublicKey::NistP521(_),
        ) => {}
        KeyData::Rsa(rsa) => {
            let bits = rsa.n.as_positive_bytes().map_or(0, |n| {
                n.first()
                    .map_or(0, |b| n.len() * 8 - b.leading_zeros() as usize)
            });
            if bits < MIN_RSA_BITS {
                return Err(bad(format!(
                    "is an RSA key of {bits} bits; RSA keys need at least {MIN_RSA_BITS}"
                )));
            }
        }
        other => {
            return Err(bad(format!(
                "is of type {}, which is not accepted: use {ACCEPTED}",
                other.algorithm()
            )));
        }
    }
    let fingerprint = key.fingerprint(HashAlg::Sha256).to_string();
    let blob = key
        .to_bytes()
        .map_err(|e| bad(format!("cannot be encoded again ({e})")))?;
    let md5_fingerprint = md5::Md5::digest(&blob)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":");
    let name = match &req.name {
        Some(n) => n.clone(),
        None if !key.comment().trim().is_empty() && check_key_name(key.comment()).is_ok() => {
            key.comment().to_string()
        }
        // The MD5 form, as CloudAPI names such keys: the SHA-256 one is base64, whose '/'
        // no name may hold (a name is a path segment).
        None => md5_fingerprint.clone(),
    };
    check_key_name(&name)?;
    let text = key
        .to_openssh()
        .map_err(|e| bad(format!("cannot be encoded again ({e})")))?;
    Ok(SshKey {
        name,
        key: text,
        fingerprint,
        md5_fingerprint,
        created_at: chrono::Utc::now(),
    })
}

/// Whose keys the caller names: its own, or (staff) any existing account's; another
/// account does not exist for a tenant.
async fn account_of(ctx: &Ctx, caller: &Caller, account: AccountId) -> ApiResult<AccountId> {
    if account == caller.account.uuid {
        return Ok(account);
    }
    if !caller.account.role.sees_all() {
        return Err(ApiError::not_found("account"));
    }
    match accounts::get(&ctx.db, account).await {
        Ok(_) => Ok(account),
        Err(StoreError::NotFound(_)) => Err(ApiError::not_found("account")),
        Err(e) => Err(e.into()),
    }
}

/// Changing another account's keys is an operator's; one's own, anyone's.
fn may_change(caller: &Caller, account: AccountId) -> ApiResult<()> {
    if account == caller.account.uuid {
        Ok(())
    } else {
        caller.require_operator()
    }
}

pub async fn list(
    ctx: &Ctx,
    caller: &Caller,
    account: AccountId,
    limit: i64,
    offset: i64,
) -> ApiResult<(Vec<SshKey>, i64)> {
    let account = account_of(ctx, caller, account).await?;
    Ok(keys::list(&ctx.db, account, limit, offset).await?)
}

pub async fn get(ctx: &Ctx, caller: &Caller, account: AccountId, name: &str) -> ApiResult<SshKey> {
    let account = account_of(ctx, caller, account).await?;
    Ok(keys::get(&ctx.db, account, name).await?)
}

pub async fn create(
    ctx: &Ctx,
    caller: &Caller,
    account: AccountId,
    req: CreateSshKey,
) -> ApiResult<SshKey> {
    let account = account_of(ctx, caller, account).await?;
    may_change(caller, account)?;
    let key = parse(&req)?;
    Ok(keys::insert(&ctx.db, account, &key).await?)
}

pub async fn delete(ctx: &Ctx, caller: &Caller, account: AccountId, name: &str) -> ApiResult<()> {
    let account = account_of(ctx, caller, account).await?;
    may_change(caller, account)?;
    Ok(keys::delete(&ctx.db, account, name).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(key: &str) -> CreateSshKey {
        CreateSshKey {
            name: None,
            key: key.to_string(),
        }
    }

    // Made with `ssh-keygen`; the fingerprints are what `ssh-keygen -l -f` and
    // `ssh-keygen -l -E md5 -f` print for them.
    const ED25519: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAICqnk2fvcqLA+0tjyUrHFA6RPpg6Lxa18w94B4M1/Nqv me@laptop";
    const ECDSA_P256: &str = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBGMt6xyGiKol+p1ukMkfdIqbfHsgbNV3GNbRV44dEmjcsHiaWyNr46dai4cUsY9vTziWg9PleQHp4H6aeCEjMKc= ec256";
    const ECDSA_P384: &str = "ecdsa-sha2-nistp384 AAAAE2VjZHNhLXNoYTItbmlzdHAzODQAAAAIbmlzdHAzODQAAABhBDuEUt5zi8zTckA4J+nj7f3lFxHRmuGWv9Jr/vnOf+c8CS64YA45JBnIA7YZN1/MwrWPpReYAAUD8Wwcpfu4vt35IaNOINxw+V3eJBbYuGDB60wZYT+3tcWvJ0+FTViDaQ== ec384";
    const RSA_2048: &str = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQDoDfUJc2D51d7DpIWsAkDMp5rCqzUglzv8YuS7uL1xs+si7uKLxPfChaJjlDirw5s0A6ABpIHveVmxPbLAJnGVcFb2SpJza6huE6JTtEcdogoh0SRsm0NixXFn2xFEFEloAVmN8CtfX7ujNVmbsPkD1mV17NTBL+u8QMvaP0qf92jlwMBqdBiqExpKKSmPJolKId6GwemmL8rVJ26zJWcnTevv55hioea9vXXTGGronbzr4SanMwOJelrYBU3v3Cjwa+KAhaIyVecngcGCkCOJuKw+Mb9SelAPDmxuNUqqM3UMqdte0Az2mHxqCair7xDp0lt6vLanYdrMVrhiE7qh rsa2048";
    const DSA: &str = "ssh-dss AAAAB3NzaC1kc3MAAACBANhny2MiH4/2HsG7BWLcapQ5i3PhKerbuMWUMD6cOpG+cQhx77IVwHlj7g0Aa4rv3PmNLVL1V7d3VDwuW4iwfxLTdZ9azPKNxI11ruTCfUlH7LZuaNkN0fE5WqwMYa/EpK0JGXfPIrxnRVIFz2yFE1n7Q/qemGnlDOA+6/xqwsbNAAAAFQDZcuZ5yQBjPG51MIQ6H2OdRkuybwAAAIAe9r6J8NgHg8oN6yQp/+qLsxMZ+EOKyyOVaIbfsVCYQyN3vTZRo2on6bc8ezFk6B4HxX6r8qyC0hQqVNRjPJbBWwNkD/Qy9xlw5/msYCBhf9PRwHZB9y/cdNRt8vvEW+ccJBaVa1+dC6RXGrwHBeUvkUH1uChxU28XERSCgH0rTAAAAIEAqY7gSpZ8eTUVWsAvVFFpnz8Gtr9M33OrXIRGjgPfWdVJs5bESV+pX/46Nr5Zm6/9WOVOIXRLmpnK3+nbAeLhb9iQebkzoYz7dibuKH3tE7AfTUQJtNh8Z/b30F6HXFfQCku5eJUOwHoIbbKk5YZhkguh8WD64os1qa6AR7F0uqM= dsa";
    const RSA_1024: &str = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQD3Mv8n2ti7kCyrbBm5WRsY8h+SxpNnCYXKAaSmFC8HAVSOwT85XWhVJHy9RiIi9rd9scAwCPsC1NUU7LBelDd9M1vWuI4UUjz/YH6wihWI5e1+i0fHFjX6JxPRVujJppjTHSL8+ocXaxiQdJ9lDz8pDXTqvzyiejptwG0z+uCgGQ== rsa1024";

    #[test]
    fn accepted_keys_get_ssh_keygens_fingerprints() {
        let cases = [
            (
                ED25519,
                "me@laptop",
                "SHA256:YTlYQAivbUAXrf2tbvJs8Ckf5i5YBCtV2IhGPvNUgjI",
                "52:84:f6:9d:76:79:e4:e4:d1:9e:96:c5:76:fa:ee:ac",
            ),
            (
                ECDSA_P256,
                "ec256",
                "SHA256:VPzhrAv4cHgS1ptOet+bJ/H19zN/JcrlmYmlVm2RPXs",
                "09:30:cf:48:1c:50:4d:4d:56:7a:1f:cc:42:21:fa:a5",
            ),
            (
                RSA_2048,
                "rsa2048",
                "SHA256:pae1V6rphiD1wzdwvDxPUeJRf8mOuiWehvNlAzsvqPI",
                "4d:8f:22:9c:45:6d:22:37:bd:5e:aa:d9:d9:db:f2:77",
            ),
        ];
        for (text, name, sha, md5) in cases {
            let k = parse(&req(text)).unwrap_or_else(|e| panic!("{name}: {}", e.message));
            assert_eq!(k.name, name);
            assert_eq!(k.fingerprint, sha);
            assert_eq!(k.md5_fingerprint, md5);
            assert_eq!(k.key, text);
        }
    }

    #[test]
    fn the_larger_ecdsa_curves_are_accepted() {
        let k = parse(&req(ECDSA_P384)).unwrap_or_else(|e| panic!("{}", e.message));
        assert_eq!(k.name, "ec384");
        assert!(k.fingerprint.starts_with("SHA256:"));
    }

    #[test]
    fn a_key_without_a_comment_is_named_by_its_fingerprint() {
        let bare: Vec<&str> = ED25519.split(' ').take(2).collect();
        let k = parse(&req(&bare.join(" "))).unwrap_or_else(|e| panic!("{}", e.message));
        assert_eq!(k.name, "52:84:f6:9d:76:79:e4:e4:d1:9e:96:c5:76:fa:ee:ac");
        let named = CreateSshKey {
            name: Some("work".into()),
            key: format!("  {ED25519}\n"),
        };
        let k = parse(&named).unwrap_or_else(|e| panic!("{}", e.message));
        assert_eq!(k.name, "work");
        assert_eq!(k.key, ED25519);
    }

    #[test]
    fn what_is_not_one_accepted_key_is_refused_with_the_reason() {
        let two = format!("{ED25519}\n{ED25519}");
        let long = "x".repeat(MAX_KEY_TEXT_LEN + 1);
        let cases = [
            ("", "one public key"),
            ("ssh-ed25519 AAAA", "not an OpenSSH public key"),
            ("ssh-ed25519", "not an OpenSSH public key"),
            ("-----BEGIN PUBLIC KEY-----", "PEM"),
            (two.as_str(), "one line"),
            (long.as_str(), "at most"),
            (RSA_1024, "RSA key of 1024 bits"),
            (DSA, "ssh-dss, which is not accepted"),
        ];
        for (text, why) in cases {
            let e = parse(&req(text))
                .err()
                .unwrap_or_else(|| panic!("{text:?} accepted"));
            assert_eq!(e.code, passage_model::ErrorCode::InvalidArgument);
            assert!(e.message.contains(why), "{text:?}: {}", e.message);
        }
        let bad_name = CreateSshKey {
            name: Some("a/b".into()),
            key: ED25519.into(),
        };
        let e = parse(&bad_name)
            .err()
            .unwrap_or_else(|| panic!("a/b accepted"));
        assert!(e.message.contains("name"), "{}", e.message);
    }
}
