//! The portal. For now one placeholder page served at `/`; the Leptos admin portal and
//! tenant self-service replace it.

/// The page served at `/` until the portal exists.
pub fn placeholder_page(version: &str) -> String {
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
<title>Passage</title></head><body><main><h1>Passage</h1>\
<p>GPU instances for your own datacenter. The web portal is coming; the API is at \
<a href=\"/v1/ping\">/v1</a>.</p><p>Version {}</p></main></body></html>\n",
        escape(version)
    )
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    #[test]
    fn page_escapes_its_input() {
        let p = super::placeholder_page("<b>");
        assert!(p.contains("&lt;b&gt;"));
        assert!(!p.contains("<b>"));
    }
}
