//! Request bodies from outside (API clients, agents) into our types: one object, no NUL,
//! and on failure the field at fault. The server's extractors and the fuzz targets run
//! exactly this.

use serde::de::DeserializeOwned;

/// Why a body was refused: the field at fault (`body` for the whole) and why (serde's
/// words, or the bound a request type's `validate()` found broken).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct BodyError {
    pub field: String,
    pub message: String,
}

impl BodyError {
    /// `field` refused, and why.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> BodyError {
        BodyError {
            field: field.into(),
            message: message.into(),
        }
    }
}

fn whole(message: &str) -> BodyError {
    BodyError {
        field: "body".into(),
        message: message.into(),
    }
}

/// Decodes a JSON object body.
pub fn json_object<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, BodyError> {
    // Every body is an object; serde would also take an array, field by field in order.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(whole("must be a JSON object"));
    }
    // Postgres text cannot hold NUL, and no name, alias or reason needs one.
    if bytes.windows(6).any(|w| w.eq_ignore_ascii_case(b"\\u0000")) {
        return Err(whole("strings may not contain NUL (\\u0000)"));
    }
    let mut value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| BodyError {
        field: "body".into(),
        message: e.to_string(),
    })?;
    whole_numbers(&mut value);
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        // serde names a missing or unknown field in its message; the path is its parent.
        let field = quoted_field(&message)
            .map(|f| {
                if path == "." || path.is_empty() {
                    f
                } else if path == f || path.ends_with(&format!(".{f}")) {
                    path.clone()
                } else {
                    format!("{path}.{f}")
                }
            })
            .unwrap_or_else(|| if path == "." { "body".into() } else { path });
        BodyError { field, message }
    })
}

/// JSON (and JSON Schema) count `3.0` as the integer 3; serde's integer types do not. The
/// largest such number taken is 2^53, past which a float no longer holds every integer.
fn whole_numbers(v: &mut serde_json::Value) {
    use serde_json::Value;
    const EXACT: f64 = 9_007_199_254_740_992.0;
    match v {
        Value::Number(n) if n.is_f64() => {
            if let Some(f) = n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() <= EXACT) {
                *v = if f < 0.0 {
                    Value::from(f as i64)
                } else {
                    Value::from(f as u64)
                };
            }
        }
        Value::Array(items) => items.iter_mut().for_each(whole_numbers),
        Value::Object(fields) => fields.values_mut().for_each(whole_numbers),
        _ => {}
    }
}

fn quoted_field(msg: &str) -> Option<String> {
    if !(msg.starts_with("missing field") || msg.starts_with("unknown field")) {
        return None;
    }
    let start = msg.find('`')? + 1;
    let len = msg.get(start..)?.find('`')?;
    msg.get(start..start + len).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Heartbeat;

    #[test]
    fn names_the_field_at_fault() {
        let e = json_object::<Heartbeat>(b"[]").unwrap_err();
        assert_eq!(e.field, "body");
        let e = json_object::<Heartbeat>(br#"{"running_vms":[],"nope":1}"#).unwrap_err();
        assert_eq!(e.field, "nope", "{e}");
        let e = json_object::<Heartbeat>(br#"{"running_vms":["a\u0000"]}"#).unwrap_err();
        assert!(e.message.contains("NUL"), "{e}");
        let e = json_object::<Heartbeat>(br#"{"running_vms":["x"]}"#).unwrap_err();
        assert_eq!(e.field, "running_vms[0]", "{e}");
        let ok = json_object::<Heartbeat>(br#" {"running_vms":null}"#).unwrap();
        assert_eq!(ok.running_vms, None);
    }

    #[test]
    fn whole_floats_are_integers() {
        use crate::protocol::RegisterRequest;
        let body =
            br#"{"join_token":"t","hostname":"h","agent_version":"1","protocol_version":1.0}"#;
        assert_eq!(
            json_object::<RegisterRequest>(body)
                .unwrap()
                .protocol_version,
            1
        );
        let body =
            br#"{"join_token":"t","hostname":"h","agent_version":"1","protocol_version":1.5}"#;
        let e = json_object::<RegisterRequest>(body).unwrap_err();
        assert_eq!(e.field, "protocol_version", "{e}");
        let body =
            br#"{"join_token":"t","hostname":"h","agent_version":"1","protocol_version":-1.0}"#;
        assert_eq!(
            json_object::<RegisterRequest>(body).unwrap_err().field,
            "protocol_version"
        );
    }
}
