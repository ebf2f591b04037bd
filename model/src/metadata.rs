//! A VM's metadata (Triton's customer_metadata): string keys and values a tenant gives at
//! creation, handed to the guest through its cloud-init seed. Two keys mean something:
//! `user-data` is cloud-init's user-data, `user-script` a script run at first boot; the
//! others reach the guest as given.

use crate::decode::BodyError;
use std::collections::BTreeMap;

pub const MAX_KEYS: usize = 64;
pub const MAX_KEY_LEN: usize = 128;
/// Keys and values together, in bytes: a seed stays small, and the request under the
/// API's body limit.
pub const MAX_TOTAL_BYTES: usize = 32 * 1024;
pub const USER_DATA: &str = "user-data";
pub const USER_SCRIPT: &str = "user-script";

/// Refuses metadata beyond the limits, naming the key at fault.
pub fn check(field: &str, metadata: &BTreeMap<String, String>) -> Result<(), BodyError> {
    if metadata.len() > MAX_KEYS {
        return Err(BodyError::new(field, format!("at most {MAX_KEYS} keys")));
    }
    let mut total = 0usize;
    for (k, v) in metadata {
        let key_ok = !k.is_empty()
            && k.len() <= MAX_KEY_LEN
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'));
        if !key_ok {
            return Err(BodyError::new(
                field,
                format!(
                    "key {k:?}: must be 1 to {MAX_KEY_LEN} characters of A-Z, a-z, 0-9, \
                     '_', '-', '.', ':'"
                ),
            ));
        }
        if v.contains('\0') {
            return Err(BodyError::new(
                format!("{field}.{k}"),
                "must not hold a NUL character",
            ));
        }
        total += k.len() + v.len();
        if total > MAX_TOTAL_BYTES {
            return Err(BodyError::new(
                field,
                format!("keys and values hold more than {MAX_TOTAL_BYTES} bytes in all"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn user_data_and_plain_keys_pass() {
        let m = md(&[
            ("user-data", "#cloud-config\nruncmd: [\"echo hi\"]\n"),
            ("user-script", "#!/bin/sh\necho ünïcode\n"),
            ("role", "db"),
        ]);
        assert_eq!(check("metadata", &m), Ok(()));
    }

    #[test]
    fn bad_keys_values_and_sizes_are_refused() {
        for (m, field) in [
            (md(&[("", "x")]), "metadata"),
            (md(&[("a b", "x")]), "metadata"),
            (md(&[("k", "a\0b")]), "metadata.k"),
            (md(&[("k", &"x".repeat(MAX_TOTAL_BYTES))]), "metadata"),
        ] {
            let e = check("metadata", &m).err();
            assert_eq!(e.map(|e| e.field), Some(field.to_string()), "{m:?}");
        }
        let many: BTreeMap<String, String> = (0..=MAX_KEYS)
            .map(|i| (format!("k{i}"), String::new()))
            .collect();
        assert!(check("metadata", &many).is_err());
    }
}
