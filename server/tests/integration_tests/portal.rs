//! The portal as the server serves it: redirects, status codes, the session cookie, CSRF
//! and the CSP nonce. (The pages in a real browser: end2end/, run by `cargo xtask test`.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{ADMIN_PASSWORD, Backend, TestServer, fast_config};
use passage_model::api::{Account, Package, PackageAvailability, Vm};

fn browser() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

async fn page(
    s: &TestServer,
    path: &str,
    cookie: Option<&str>,
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut rb = browser().get(s.url(path)).header("accept", "text/html");
    if let Some(c) = cookie {
        rb = rb.header("cookie", format!("passage_session={c}"));
    }
    let r = rb.send().await.unwrap();
    let st = r.status().as_u16();
    let h = r.headers().clone();
    (st, h, r.text().await.unwrap())
}

/// The form action of the login server function, as the page gives it.
fn login_action(html: &str) -> String {
    let at = html
        .find("action=\"/portal/fn/login")
        .expect("a login form");
    let rest = &html[at + 8..];
    rest[..rest.find('"').unwrap()].to_string()
}

#[tokio::test]
async fn signed_out_visitors_are_sent_to_sign_in() {
    let s = TestServer::start(Backend::Sqlite, fast_config()).await;
    let (st, h, _) = page(&s, "/", None).await;
    assert_eq!(st, 302);
    assert_eq!(h["location"], "/login");
    let (st, h, _) = page(&s, "/admin/servers", None).await;
    assert_eq!(st, 302);
    assert_eq!(h["location"], "/login?next=%2Fadmin%2Fservers");
    let (st, _, _) = page(&s, "/no/such/page", None).await;
    assert_eq!(st, 404);
}

#[tokio::test]
async fn an_ended_session_is_sent_to_sign_in_with_a_word_why() {
    let mut cfg = fast_config();
    cfg.session_idle = std::time::Duration::from_millis(1500);
    let s = TestServer::start(Backend::Sqlite, cfg).await;
    let tok = s.login("admin", ADMIN_PASSWORD).await;
    let (st, _, _) = page(&s, "/admin/servers", Some(&tok)).await;
    assert_eq!(st, 200);
    tokio::time::sleep(std::time::Duration::from_millis(2000)).await;
    let (st, h, _) = page(&s, "/admin/servers", Some(&tok)).await;
    assert_eq!(st, 302);
    assert_eq!(
        h["location"], "/login?next=%2Fadmin%2Fservers&ended=1",
        "back here after signing in again"
    );
    let cleared = h
        .get_all("set-cookie")
        .iter()
        .any(|c| c.to_str().unwrap().starts_with("passage_session=;"));
    assert!(cleared, "the dead cookie is dropped: {h:?}");
    let (st, _, html) = page(&s, "/login?next=%2Fadmin%2Fservers&ended=1", None).await;
    assert_eq!(st, 200);
    assert!(html.contains("Your session has ended. Sign in again."));
    let (_, _, html) = page(&s, "/login", None).await;
    assert!(!html.contains("Your session has ended"));
}

#[tokio::test]
async fn inline_scripts_run_only_by_this_responses_nonce() {
    let s = TestServer::start(Backend::Sqlite, fast_config()).await;
    let (st, h, html) = page(&s, "/login", None).await;
    assert_eq!(st, 200);
    let csp = h["content-security-policy"].to_str().unwrap();
    let nonce = csp
        .split("'nonce-")
        .nth(1)
        .and_then(|r| r.split('\'').next())
        .expect("a nonce in the CSP");
    assert!(nonce.len() >= 16, "{csp}");
    assert!(!csp.contains("unsafe-inline"), "{csp}");
    let scripts = html.matches("<script").count();
    assert!(scripts > 0);
    assert_eq!(
        html.matches(&format!("<script nonce=\"{nonce}\"")).count()
            + html
                .matches(&format!("<script type=\"module\" nonce=\"{nonce}\""))
                .count(),
        scripts,
        "every inline script carries the nonce"
    );
    let (_, h2, _) = page(&s, "/login", None).await;
    assert_ne!(
        h2["content-security-policy"], h["content-security-policy"],
        "a new nonce per page"
    );
}

#[tokio::test]
async fn login_sets_an_httponly_cookie_and_logout_revokes_it() {
    let s = TestServer::start(Backend::Sqlite, fast_config()).await;
    let (_, _, html) = page(&s, "/login", None).await;
    let action = login_action(&html);
    let origin = s.url("");
    let post = |form: Vec<(&'static str, String)>, origin: String| {
        let url = s.url(&action);
        let referer = s.url("/login");
        async move {
            browser()
                .post(url)
                .header("accept", "text/html")
                .header("referer", referer)
                .header("origin", origin)
                .form(&form)
                .send()
                .await
                .unwrap()
        }
    };
    // Wrong password: back to the form with the error, no cookie.
    let r = post(
        vec![("login", "admin".into()), ("password", "nope".into())],
        origin.clone(),
    )
    .await;
    assert_eq!(r.status().as_u16(), 302);
    assert!(r.headers().get("set-cookie").is_none());
    assert!(r.headers()["location"].to_str().unwrap().contains("__err="));
    // From another site: refused even with the right password.
    let r = post(
        vec![
            ("login", "admin".into()),
            ("password", ADMIN_PASSWORD.into()),
        ],
        "http://evil.example".into(),
    )
    .await;
    assert!(r.headers().get("set-cookie").is_none());
    // Right password: a session cookie the page's scripts cannot read.
    let r = post(
        vec![
            ("login", "admin".into()),
            ("password", ADMIN_PASSWORD.into()),
            ("next", "/admin/devices".into()),
        ],
        origin,
    )
    .await;
    assert_eq!(r.status().as_u16(), 302);
    assert_eq!(r.headers()["location"], "/admin/devices");
    let cookie = r.headers()["set-cookie"].to_str().unwrap().to_string();
    assert!(cookie.contains("HttpOnly"), "{cookie}");
    assert!(cookie.contains("SameSite=Lax"), "{cookie}");
    let token = cookie
        .strip_prefix("passage_session=")
        .and_then(|c| c.split(';').next())
        .unwrap()
        .to_string();
    let (st, _, html) = page(&s, "/admin/servers", Some(&token)).await;
    assert_eq!(st, 200);
    // Type-erased views mark each text node (`<h1>Servers<!></h1>`), so no closing tag here.
    assert!(html.contains("<h1>Servers"), "{html}");

    // Sign out: a form post with the CSRF token; the token stops working for the API too.
    let csrf = html
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap()
        .to_string();
    let logout = html
        .split("action=\"/portal/fn/logout")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .map(|r| format!("/portal/fn/logout{r}"))
        .unwrap();
    let forged = browser()
        .post(s.url(&logout))
        .header("cookie", format!("passage_session={token}"))
        .form(&[("csrf", "0000")])
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status().as_u16(), 403);
    s.with(&token).get::<Account>("/v1/auth/me").await.ok(200);
    let r = browser()
        .post(s.url(&logout))
        .header("accept", "text/html")
        .header("referer", s.url("/admin/servers"))
        .header("cookie", format!("passage_session={token}"))
        .form(&[("csrf", csrf)])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 302);
    assert_eq!(r.headers()["location"], "/login");
    assert!(
        r.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );
    s.with(&token).get::<Account>("/v1/auth/me").await.err(401);
}

#[tokio::test]
async fn tenants_get_403_on_operator_pages_and_404_on_others_instances() {
    let s = TestServer::start(Backend::Sqlite, fast_config()).await;
    let (_, tenant) = s.tenant("pat").await;
    for path in [
        "/admin",
        "/admin/servers",
        "/admin/devices",
        "/admin/accounts",
    ] {
        let (st, _, html) = page(&s, path, Some(&tenant)).await;
        assert_eq!(st, 403, "{path}");
        assert!(html.contains("Not allowed"), "{path}");
    }
    let (st, _, html) = page(&s, "/instances", Some(&tenant)).await;
    assert_eq!(st, 200);
    assert!(html.contains("My instances"));
    let missing = uuid::Uuid::new_v4();
    let (st, _, _) = page(&s, &format!("/instances/{missing}"), Some(&tenant)).await;
    assert_eq!(st, 404);
    let (st, _, _) = page(&s, "/instances/..%2F..%2Fv1%2Fservers", Some(&tenant)).await;
    assert_eq!(st, 404);
}

/// What the self-service page shows next to a package: capacity now, and quota room.
#[tokio::test]
async fn package_availability_follows_capacity_and_quota() {
    let mut s = TestServer::start(Backend::Sqlite, fast_config()).await;
    let name = s.h100_catalog(2).await;
    let pkgs: Vec<Package> = s.get("/v1/packages").await.ok(200);
    let pkg = pkgs[0].uuid;
    let (uuid, tenant) = s.tenant("pat").await;
    let path = format!("/v1/packages/{pkg}/availability");
    let a: PackageAvailability = s.with(&tenant).get(&path).await.ok(200);
    assert!(!a.capacity_ok, "no nodes yet: {a:?}");
    assert!(a.quota_ok);
    assert!(
        a.message.as_deref().unwrap().contains("no running server"),
        "{a:?}"
    );

    s.add_node(2).await;
    let a: PackageAvailability = s.with(&tenant).get(&path).await.ok(200);
    assert!(a.capacity_ok, "{a:?}");
    assert!(a.message.is_none());

    s.patch::<Account>(
        &format!("/v1/accounts/{uuid}"),
        &serde_json::json!({"gpu_quota": 1}),
    )
    .await
    .ok(200);
    let a: PackageAvailability = s.with(&tenant).get(&path).await.ok(200);
    assert!(!a.quota_ok, "2 devices over a quota of 1: {a:?}");
    assert!(a.message.as_deref().unwrap().contains("quota"), "{a:?}");

    // Nothing was reserved by asking: the tenant with room can still take both devices.
    s.post::<Vm>(
        "/v1/vms",
        &serde_json::json!({"image": "test-image", "alias": "probe", "package": name}),
    )
    .await
    .ok(202);
    // A malformed id names no package.
    s.with(&tenant)
        .get::<PackageAvailability>("/v1/packages/not-a-uuid/availability")
        .await
        .err(404);
}

/// The admin images page's form sets an image's firmware (`bootrom`), refuses a name it
/// does not know, and the list shows what was set.
#[tokio::test]
async fn the_image_form_sets_the_firmware() {
    use passage_model::images::{Bootrom, Image};
    let s = TestServer::start(Backend::Sqlite, fast_config()).await;
    let (st, _, html) = page(&s, "/admin/images", Some(&s.admin)).await;
    assert_eq!(st, 200);
    assert!(html.contains("id=\"i-bootrom\""), "{html}");
    let csrf = passage_app::backend::csrf_for(&s.admin);
    let action = html
        .split("action=\"/portal/fn/create_image")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .map(|r| format!("/portal/fn/create_image{r}"))
        .unwrap();
    let create = |name: &'static str, bootrom: &'static str| {
        let form = [
            ("csrf", csrf.as_str()),
            ("name", name),
            ("version", "1"),
            ("os", "linux"),
            ("image_type", "raw"),
            ("description", ""),
            ("default_user", ""),
            ("min_disk_gib", ""),
            ("bootrom", bootrom),
        ];
        let rb = browser()
            .post(s.url(&action))
            .header("accept", "text/html")
            .header("referer", s.url("/admin/images"))
            .header("origin", s.url(""))
            .header("cookie", format!("passage_session={}", s.admin))
            .form(&form);
        async move { rb.send().await.unwrap() }
    };
    let r = create("fw-form", "uefi").await;
    assert_eq!(r.status().as_u16(), 302);
    let to = r.headers()["location"].to_str().unwrap().to_string();
    assert!(to.starts_with("/admin/images/"), "{to}");
    let made: Vec<Image> = s.get("/v1/images?name=fw-form").await.ok(200);
    assert_eq!(made[0].requirements.bootrom, Some(Bootrom::Uefi));
    // The default sends nothing.
    create("fw-default", "").await;
    let made: Vec<Image> = s.get("/v1/images?name=fw-default").await.ok(200);
    assert_eq!(made[0].requirements.bootrom, None);
    let r = create("fw-bad", "efi").await;
    assert!(
        r.headers()["location"].to_str().unwrap().contains("__err="),
        "{r:?}"
    );
    let none: Vec<Image> = s.get("/v1/images?name=fw-bad").await.ok(200);
    assert!(none.is_empty());
    let (_, _, html) = page(&s, "/admin/images", Some(&s.admin)).await;
    assert!(html.contains("data-testid=\"bootrom\">uefi"), "{html}");
    assert!(html.contains("data-testid=\"bootrom\">default"), "{html}");
    let (_, _, html) = page(&s, &to, Some(&s.admin)).await;
    let fact = html
        .split("data-testid=\"image-bootrom\"")
        .nth(1)
        .and_then(|r| r.split_once('>'))
        .map(|(_, text)| text);
    assert!(fact.is_some_and(|t| t.starts_with("uefi")), "{html}");
}
