//! A VM's tags (Triton's `tags`): keys a tenant names its VMs by, each with a string,
//! number or boolean value, listed with the VM and filterable (`tag.KEY=VALUE`).

use crate::decode::BodyError;
use std::collections::BTreeMap;

pub type Tags = BTreeMap<String, serde_json::Value>;

pub const MAX_TAGS: usize = 64;
pub const MAX_KEY_LEN: usize = 128;
pub const MAX_VALUE_LEN: usize = 1024;

/// Whether `k` may name a tag: printable ASCII without quotes, backslashes or `=`, so
/// that it can be written in a filter (`tag.k=v`) and a JSON path.
pub fn key_ok(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= MAX_KEY_LEN
        && k.bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'"' | b'\\' | b'='))
}

/// Refuses tags beyond the limits or of another type, naming the tag at fault.
pub fn check(field: &str, tags: &Tags) -> Result<(), BodyError> {
    if tags.len() > MAX_TAGS {
        return Err(BodyError::new(field, format!("at most {MAX_TAGS} tags")));
    }
    for (k, v) in tags {
        if !key_ok(k) {
            return Err(BodyError::new(
                field,
                format!(
                    "tag {k:?}: a key is 1 to {MAX_KEY_LEN} printable ASCII characters \
                     without spaces, '\"', '\\' or '='"
                ),
            ));
        }
        let ok = match v {
            serde_json::Value::String(s) => s.len() <= MAX_VALUE_LEN && !s.contains('\0'),
            serde_json::Value::Number(_) | serde_json::Value::Bool(_) => true,
            _ => false,
        };
        if !ok {
            return Err(BodyError::new(
                format!("{field}.{k}"),
                format!(
                    "must be a string of at most {MAX_VALUE_LEN} bytes (no NUL), a number or \
                     a boolean"
                ),
            ));
        }
    }
    Ok(())
}

/// The JSON texts a filter value `v` matches: the string `"v"`, and `v` itself when it
/// is a number or a boolean (`tag.gpu=8` finds both `"8"` and `8`).
pub fn filter_texts(v: &str) -> Vec<String> {
    let mut out = vec![serde_json::Value::String(v.to_string()).to_string()];
    if let Ok(j @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_))) =
        serde_json::from_str::<serde_json::Value>(v)
    {
        out.push(j.to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tags_are_scalars_under_printable_keys() {
        let ok: Tags = [
            ("role".to_string(), json!("train")),
            ("tritoncli.ssh.port".to_string(), json!(2222)),
            ("prod".to_string(), json!(true)),
        ]
        .into();
        assert!(check("tags", &ok).is_ok());
        for (k, v) in [
            ("a b", json!("x")),
            ("", json!("x")),
            ("a=b", json!("x")),
            ("q\"", json!("x")),
            ("obj", json!({"a": 1})),
            ("arr", json!([1])),
            ("null", json!(null)),
            ("long", json!("x".repeat(MAX_VALUE_LEN + 1))),
        ] {
            let t: Tags = [(k.to_string(), v)].into();
            assert!(check("tags", &t).is_err(), "{k:?}");
        }
    }

    #[test]
    fn filter_values_match_strings_and_scalars() {
        assert_eq!(filter_texts("train"), vec!["\"train\""]);
        assert_eq!(filter_texts("8"), vec!["\"8\"", "8"]);
        assert_eq!(filter_texts("true"), vec!["\"true\"", "true"]);
        assert_eq!(filter_texts("a\"b"), vec!["\"a\\\"b\""]);
    }
}
