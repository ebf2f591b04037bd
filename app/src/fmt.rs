//! Small display helpers shared by the pages.

use chrono::{DateTime, Datelike, Timelike, Utc};
use passage_model::api::ServerStatus;

/// "2026-11-22 05:14:03 UTC": exact, sortable, the same on server and browser (no
/// time-zone guess during hydration). Written out by hand: chrono's `format` would bring
/// its whole format-string interpreter into the browser bundle.
pub fn time(t: &DateTime<Utc>) -> String {
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC",
        t.year(),
        t.month(),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// A server's status as the API spells it.
pub fn server_status(s: ServerStatus) -> &'static str {
    match s {
        ServerStatus::Running => "running",
        ServerStatus::Unknown => "unknown",
        ServerStatus::Offline => "offline",
    }
}

pub fn opt_time(t: &Option<DateTime<Utc>>) -> String {
    t.as_ref().map(time).unwrap_or_else(|| "never".to_string())
}

/// A step's duration, "1.234 s", or empty while it has not both started and ended.
pub fn duration(start: &Option<DateTime<Utc>>, end: &Option<DateTime<Utc>>) -> String {
    match (start, end) {
        (Some(s), Some(e)) => {
            let ms = (*e - *s).num_milliseconds().max(0);
            format!("{}.{:03} s", ms / 1000, ms % 1000)
        }
        (Some(_), None) => "running".to_string(),
        _ => String::new(),
    }
}

/// The PCI address at the end of a device path: `/devices/pci0000:3a/0000:3b:00.0` → `0000:3b:00.0`.
pub fn bdf(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
pub fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `?k=v&…` of the pairs that have a non-empty value; empty when none do.
pub fn query(pairs: &[(&str, Option<&str>)]) -> String {
    let mut out = String::new();
    for (k, v) in pairs {
        if let Some(v) = v.filter(|v| !v.is_empty()) {
            out.push(if out.is_empty() { '?' } else { '&' });
            out.push_str(k);
            out.push('=');
            out.push_str(&urlencode(v));
        }
    }
    out
}

pub fn short_uuid(u: &str) -> &str {
    u.get(..8).unwrap_or(u)
}

#[cfg(test)]
mod tests {
    #[test]
    fn time_is_utc_to_the_second() {
        let t = chrono::DateTime::parse_from_rfc3339("2026-01-02T03:04:05.678Z")
            .map(|t| t.with_timezone(&chrono::Utc));
        assert_eq!(
            t.map(|t| super::time(&t)).ok().as_deref(),
            Some("2026-01-02 03:04:05 UTC")
        );
    }

    #[test]
    fn server_status_is_the_apis_word() {
        use passage_model::api::ServerStatus;
        for s in [
            ServerStatus::Running,
            ServerStatus::Unknown,
            ServerStatus::Offline,
        ] {
            assert_eq!(
                serde_json::to_value(s).ok(),
                Some(serde_json::Value::from(super::server_status(s)))
            );
        }
    }

    #[test]
    fn query_skips_empty_values_and_encodes() {
        assert_eq!(super::query(&[("a", None), ("b", Some(""))]), "");
        assert_eq!(
            super::query(&[("a", Some("x y")), ("b", Some("c~d&e"))]),
            "?a=x%20y&b=c~d%26e"
        );
    }

    #[test]
    fn bdf_is_the_last_component() {
        assert_eq!(
            super::bdf("/devices/pci0000:3a/0000:3b:00.0"),
            "0000:3b:00.0"
        );
        assert_eq!(super::bdf("x"), "x");
    }
}
