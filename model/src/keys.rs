//! SSH public keys on accounts (after Triton's CloudAPI keys): the API shapes and the
//! rules for a key's name. Parsing a key is the server's (it takes a crate this model,
//! built for the browser too, does without).

use crate::decode::BodyError;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// Longest key name, in characters.
pub const MAX_KEY_NAME_LEN: usize = 64;
/// Longest key text accepted, in bytes: an RSA key of 16,384 bits is under 3 KiB.
pub const MAX_KEY_TEXT_LEN: usize = 8 * 1024;
/// Most keys one account holds.
pub const MAX_KEYS_PER_ACCOUNT: i64 = 100;
/// Longest entry of a VM's `keys`: a name, or a fingerprint (`SHA256:` and 43 characters,
/// or MD5's 47).
pub const MAX_KEY_CHOICE_LEN: usize = 128;

/// One of its owner's keys a VM was given at its creation, as the VM lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VmKey {
    pub name: String,
    /// `SHA256:…`, as the key's own `fingerprint`.
    pub fingerprint: String,
}

/// Refuses a VM's chosen keys that are empty, too long or named twice, naming the entry.
pub fn check_choices(field: &str, keys: &[String]) -> Result<(), BodyError> {
    let max = usize::try_from(MAX_KEYS_PER_ACCOUNT).unwrap_or(usize::MAX);
    if keys.len() > max {
        return Err(BodyError::new(field, format!("at most {max} keys")));
    }
    for (i, k) in keys.iter().enumerate() {
        if k.is_empty() || k.len() > MAX_KEY_CHOICE_LEN {
            return Err(BodyError::new(
                format!("{field}[{i}]"),
                format!(
                    "must be a key's name or fingerprint, 1 to {MAX_KEY_CHOICE_LEN} characters"
                ),
            ));
        }
        if keys[..i].contains(k) {
            return Err(BodyError::new(format!("{field}[{i}]"), "given twice"));
        }
    }
    Ok(())
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SshKey {
    pub name: String,
    /// The key in OpenSSH's one-line form: `ssh-ed25519 AAAA… comment`.
    pub key: String,
    /// `SHA256:` and the unpadded base64 of the key's SHA-256, as `ssh-keygen -l` prints it.
    pub fingerprint: String,
    /// The older form, the key's MD5 as colon-separated hex pairs (what Triton's
    /// signatures name a key by).
    pub md5_fingerprint: String,
    pub created_at: DateTime<Utc>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSshKey {
    /// Default: the key's comment, or its MD5 fingerprint when it has none (or one that is
    /// not a valid name).
    #[serde(default)]
    #[schema(min_length = 1, max_length = 64)]
    pub name: Option<String>,
    /// One public key in OpenSSH's form (a line of `~/.ssh/id_ed25519.pub`):
    /// ssh-ed25519, ecdsa-sha2-nistp256/384/521, or ssh-rsa of at least 2048 bits.
    #[schema(min_length = 1, max_length = 8192)]
    pub key: String,
}

/// Whether `name` may name a key: it appears in URLs and in the portal, so 1 to
/// [`MAX_KEY_NAME_LEN`] printable characters, no `/`, not only spaces.
pub fn check_key_name(name: &str) -> Result<(), BodyError> {
    let ok = !name.trim().is_empty()
        && name.chars().count() <= MAX_KEY_NAME_LEN
        && !name.chars().any(|c| c.is_control() || c == '/');
    if ok {
        Ok(())
    } else {
        Err(BodyError::new(
            "name",
            format!("must be 1 to {MAX_KEY_NAME_LEN} printable characters, without '/'"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_names() {
        for good in ["laptop", "me@host", "work key 2", "ключ"] {
            assert!(check_key_name(good).is_ok(), "{good:?}");
        }
        let long = "x".repeat(MAX_KEY_NAME_LEN + 1);
        for bad in ["", "   ", "a/b", "tab\there", "nl\n", long.as_str()] {
            assert_eq!(
                check_key_name(bad).map_err(|e| e.field),
                Err("name".to_string()),
                "{bad:?}"
            );
        }
    }
}
