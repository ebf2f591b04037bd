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

/// `n / unit` to one decimal, rounded down: "1.5". Integer arithmetic only: formatting
/// floats would bring the float printer into the browser bundle.
fn tenths(n: u64, unit: u64) -> String {
    let t = u128::from(n) * 10 / u128::from(unit.max(1));
    format!("{}.{}", t / 10, t % 10)
}

/// A size in bytes for people: "512 B", "1.5 MiB", "20.0 GiB" (binary units, as disk
/// images are sized).
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut unit = 1024u64;
    let mut i = 0;
    while n / unit >= 1024 && i + 1 < UNITS.len() {
        unit *= 1024;
        i += 1;
    }
    format!("{} {}", tenths(n, unit), UNITS[i])
}

/// Upload progress: "3.2 MiB of 10.0 MiB, 32 %". Always in MiB, so the two numbers
/// compare at a glance.
pub fn progress(done: u64, total: u64) -> String {
    const MIB: u64 = 1024 * 1024;
    let done = done.min(total);
    let pct = match total {
        0 => 100,
        t => u128::from(done) * 100 / u128::from(t),
    };
    format!(
        "{} MiB of {} MiB, {pct} %",
        tenths(done, MIB),
        tenths(total, MIB)
    )
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
    fn sizes_in_binary_units() {
        assert_eq!(super::bytes(0), "0 B");
        assert_eq!(super::bytes(1023), "1023 B");
        assert_eq!(super::bytes(1024), "1.0 KiB");
        assert_eq!(super::bytes(1536 * 1024), "1.5 MiB");
        assert_eq!(super::bytes(20 << 30), "20.0 GiB");
        assert_eq!(super::bytes(u64::MAX), "16383.9 PiB");
    }

    #[test]
    fn progress_in_mib_and_whole_percent() {
        let mib = 1024 * 1024;
        assert_eq!(super::progress(0, 4 * mib), "0.0 MiB of 4.0 MiB, 0 %");
        assert_eq!(super::progress(mib, 3 * mib), "1.0 MiB of 3.0 MiB, 33 %");
        assert_eq!(
            super::progress(4 * mib, 4 * mib),
            "4.0 MiB of 4.0 MiB, 100 %"
        );
        assert_eq!(super::progress(9, 4), "0.0 MiB of 0.0 MiB, 100 %");
        assert_eq!(super::progress(0, 0), "0.0 MiB of 0.0 MiB, 100 %");
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
