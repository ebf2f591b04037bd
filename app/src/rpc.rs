//! Server functions: what the pages ask of the server. Each one calls the REST API as the
//! session's account (see `backend`), so roles and validation are the API's own.
//! State-changing ones take the form's `csrf` field and check it first.

use crate::error::PortalError;
use leptos::prelude::*;
use passage_model::Variant;
use passage_model::api::{Account, Alert, Capacity, Job, Package, Server, Vm};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[cfg(feature = "ssr")]
use crate::backend::{self as be, query};
#[cfg(feature = "ssr")]
use http::Method;

/// One page of a list, and the cursor of the next one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub total: u64,
    pub next: Option<String>,
}

/// The signed-in person, and the CSRF token their forms carry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Me {
    pub uuid: String,
    pub login: String,
    pub role: String,
    pub gpu_quota: Option<u32>,
    pub csrf: String,
}

impl Me {
    pub fn is_staff(&self) -> bool {
        self.role == "operator" || self.role == "reader"
    }
    pub fn is_operator(&self) -> bool {
        self.role == "operator"
    }
}

/// Rows per list page: enough to scan, small enough to stay fast at any fleet size.
pub const PAGE_SIZE: u32 = 50;

#[server(prefix = "/portal/fn")]
pub async fn whoami() -> Result<Option<Me>, PortalError> {
    let Some(token) = be::session_token() else {
        return Ok(None);
    };
    match be::get::<Account>("/auth/me").await {
        Ok(a) => Ok(Some(Me {
            uuid: a.uuid.to_string(),
            login: a.login,
            role: a.role.as_str().to_string(),
            gpu_quota: a.gpu_quota,
            csrf: be::csrf_for(&token),
        })),
        // The cookie's session has ended (idle, expired, revoked): say so once, at the
        // login page, and drop the cookie.
        Err(e) if e.is_unauthorized() => {
            be::clear_session_cookie();
            Err(PortalError::new(
                SESSION_ENDED,
                "Your session has ended. Sign in again.",
            ))
        }
        Err(e) => Err(e),
    }
}

/// `whoami`'s error code when the session cookie no longer names a live session.
pub const SESSION_ENDED: &str = "SessionEnded";

/// Where to go after signing in: only a path on this site.
pub fn safe_next(next: Option<&str>) -> String {
    match next {
        // Printable ASCII only: the path goes into a Location header.
        Some(n)
            if n.starts_with('/')
                && !n.starts_with("//")
                && n.len() <= 512
                && n.bytes().all(|b| b.is_ascii_graphic() && b != b'\\') =>
        {
            n.to_string()
        }
        _ => "/".to_string(),
    }
}

#[server(prefix = "/portal/fn")]
pub async fn login(
    login: String,
    password: String,
    next: Option<String>,
) -> Result<(), PortalError> {
    be::check_same_origin()?;
    if login.trim().is_empty() {
        return Err(PortalError {
            code: "InvalidArgument".into(),
            message: "Enter your login.".into(),
            field: Some("login".into()),
        });
    }
    let body = serde_json::json!({ "login": login, "password": password });
    let r: passage_model::api::LoginResponse =
        match be::send(Method::POST, "/auth/login", &body).await {
            Ok(r) => r,
            Err(e) if e.is_unauthorized() => {
                return Err(PortalError {
                    code: "Unauthorized".into(),
                    message: "Wrong login or password.".into(),
                    field: Some("password".into()),
                });
            }
            Err(e) => return Err(e),
        };
    let secs = (r.expires_at - chrono::Utc::now()).num_seconds();
    be::set_session_cookie(&r.token, secs);
    leptos_axum::redirect(&safe_next(next.as_deref()));
    Ok(())
}

#[server(prefix = "/portal/fn")]
pub async fn logout(csrf: String) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    // Revoke the token on the server, not only in this browser.
    let r = be::call(Method::POST, "/auth/logout", None).await;
    be::clear_session_cookie();
    leptos_axum::redirect("/login");
    match r {
        Err(e) if !e.is_unauthorized() => Err(e),
        _ => Ok(()),
    }
}

// ---- operator: overview ----

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FleetOverview {
    pub capacity: Vec<Capacity>,
    pub servers_total: u64,
    pub servers_running: u64,
    pub failed_jobs: Vec<Job>,
    pub alerts: Vec<Alert>,
}

#[server(prefix = "/portal/fn")]
pub async fn overview() -> Result<FleetOverview, PortalError> {
    let capacity: Vec<Capacity> = be::get("/capacity").await?;
    let all = be::list::<Server>("/servers?limit=1").await?;
    let running = be::list::<Server>("/servers?limit=1&status=running").await?;
    let failed = be::list::<Job>("/jobs?limit=5&state=failed").await?;
    let alerts = be::list::<Alert>("/alerts?limit=5").await?;
    Ok(FleetOverview {
        capacity,
        servers_total: all.total,
        servers_running: running.total,
        failed_jobs: failed.items,
        alerts: alerts.items,
    })
}

// ---- operator: servers and devices ----

/// A server as the list shows it: its devices counted by state, not listed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerRow {
    pub uuid: String,
    pub hostname: String,
    pub status: String,
    pub disabled: bool,
    pub last_heartbeat: Option<chrono::DateTime<chrono::Utc>>,
    pub devices: u32,
    pub by_state: BTreeMap<String, u32>,
}

impl ServerRow {
    pub fn from_server(s: &Server) -> Self {
        let by_state: BTreeMap<String, u32> = s
            .device_counts
            .iter()
            .map(|(st, n)| (st.as_str().to_string(), *n))
            .collect();
        ServerRow {
            uuid: s.uuid.to_string(),
            hostname: s.hostname.clone(),
            status: format!("{:?}", s.status).to_lowercase(),
            disabled: s.disabled,
            last_heartbeat: s.last_heartbeat,
            devices: s.device_counts.values().sum(),
            by_state,
        }
    }
}

#[server(prefix = "/portal/fn")]
pub async fn list_servers(after: Option<String>) -> Result<Page<ServerRow>, PortalError> {
    let limit = PAGE_SIZE.to_string();
    let q = query(&[
        ("limit", Some(&limit)),
        ("after", after.as_deref()),
        ("brief", Some("true")),
    ]);
    let p = be::list::<Server>(&format!("/servers{q}")).await?;
    Ok(Page {
        items: p.items.iter().map(ServerRow::from_server).collect(),
        total: p.total,
        next: p.next,
    })
}

#[server(prefix = "/portal/fn")]
pub async fn get_server(uuid: String) -> Result<Server, PortalError> {
    be::get(&format!("/servers/{}", be::segment(&uuid)?)).await
}

#[server(prefix = "/portal/fn")]
pub async fn list_devices(
    state: Option<String>,
    variant: Option<String>,
    server: Option<String>,
    after: Option<String>,
) -> Result<Page<passage_model::api::DeviceRow>, PortalError> {
    let limit = PAGE_SIZE.to_string();
    let q = query(&[
        ("limit", Some(&limit)),
        ("state", state.as_deref()),
        ("variant", variant.as_deref()),
        ("server_uuid", server.as_deref()),
        ("after", after.as_deref()),
    ]);
    be::list(&format!("/devices{q}")).await
}

/// The server's latest device state changes, newest first.
#[server(prefix = "/portal/fn")]
pub async fn server_events(
    uuid: String,
) -> Result<Vec<passage_model::api::DeviceEventRecord>, PortalError> {
    let path = format!("/servers/{}/device-events?last=20", be::segment(&uuid)?);
    let mut all = be::list::<passage_model::api::DeviceEventRecord>(&path)
        .await?
        .items;
    all.reverse();
    Ok(all)
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinTokenView {
    pub token: String,
    pub expires_at: chrono::DateTime<chrono::Utc>,
    pub command: String,
}

#[server(prefix = "/portal/fn")]
pub async fn create_join_token(csrf: String) -> Result<JoinTokenView, PortalError> {
    be::check_csrf(&csrf)?;
    let t: passage_model::api::JoinToken =
        be::send(Method::POST, "/servers/join-tokens", &serde_json::json!({})).await?;
    let host = use_context::<http::request::Parts>()
        .and_then(|p| {
            p.headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_string)
        })
        .unwrap_or_else(|| "127.0.0.1:8080".to_string());
    let command = format!(
        "node-agent run --server http://{host} --join-token {} --state-dir /var/lib/passage-agent",
        t.token
    );
    Ok(JoinTokenView {
        token: t.token,
        expires_at: t.expires_at,
        command,
    })
}

// ---- operator: catalog ----

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VariantRow {
    pub variant: Variant,
    /// Devices in the fleet this variant matches now.
    pub matches: u64,
}

#[server(prefix = "/portal/fn")]
pub async fn list_variants() -> Result<Vec<VariantRow>, PortalError> {
    let variants = be::list::<Variant>("/variants?limit=1000").await?;
    let capacity: Vec<Capacity> = be::get("/capacity").await.unwrap_or_default();
    Ok(variants
        .items
        .into_iter()
        .map(|v| VariantRow {
            matches: capacity
                .iter()
                .find(|c| c.variant == v.name)
                .map(|c| c.total)
                .unwrap_or(0),
            variant: v,
        })
        .collect())
}

#[cfg(feature = "ssr")]
fn opt(s: &str) -> serde_json::Value {
    let t = s.trim();
    if t.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::Value::String(t.to_string())
    }
}

/// Creates a variant, or replaces the one named `original`.
#[server(prefix = "/portal/fn")]
#[allow(clippy::too_many_arguments)]
pub async fn save_variant(
    csrf: String,
    original: Option<String>,
    name: String,
    kind: String,
    vendor: String,
    device: String,
    subvendor: String,
    subsystem: String,
    description: String,
) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    let body = serde_json::json!({
        "name": name.trim(),
        "type": kind.trim(),
        "vendor": vendor.trim(),
        "device": device.trim(),
        "subvendor": opt(&subvendor),
        "subsystem": opt(&subsystem),
        "description": opt(&description),
    });
    match original.as_deref().filter(|o| !o.is_empty()) {
        Some(o) => {
            let path = format!("/variants/{}", be::segment(o)?);
            be::send::<Variant>(Method::PUT, &path, &body).await?;
        }
        None => {
            be::send::<Variant>(Method::POST, "/variants", &body).await?;
        }
    }
    leptos_axum::redirect("/admin/variants");
    Ok(())
}

#[server(prefix = "/portal/fn")]
pub async fn delete_variant(csrf: String, name: String) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    be::delete(&format!("/variants/{}", be::segment(&name)?)).await
}

#[server(prefix = "/portal/fn")]
pub async fn list_packages() -> Result<Vec<Package>, PortalError> {
    Ok(be::list::<Package>("/packages?limit=1000").await?.items)
}

#[cfg(feature = "ssr")]
fn number<T: std::str::FromStr>(field: &str, v: &str) -> Result<T, PortalError> {
    v.trim().parse().map_err(|_| {
        be::pass_status_on(http::StatusCode::BAD_REQUEST);
        PortalError {
            code: "InvalidArgument".into(),
            message: format!("{field}: enter a whole number"),
            field: Some(field.to_string()),
        }
    })
}

#[server(prefix = "/portal/fn")]
#[allow(clippy::too_many_arguments)]
pub async fn create_package(
    csrf: String,
    name: String,
    vcpus: String,
    memory_mib: String,
    disk_gib: String,
    variant: String,
    count: String,
) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    let mut devices = BTreeMap::new();
    if !variant.trim().is_empty() {
        devices.insert(variant.trim().to_string(), number::<u32>("count", &count)?);
    }
    let body = serde_json::json!({
        "name": name.trim(),
        "vcpus": number::<u32>("vcpus", &vcpus)?,
        "memory_mib": number::<u64>("memory_mib", &memory_mib)?,
        "disk_gib": if disk_gib.trim().is_empty() { 0 } else { number::<u64>("disk_gib", &disk_gib)? },
        "devices": devices,
    });
    be::send::<Package>(Method::POST, "/packages", &body).await?;
    Ok(())
}

#[server(prefix = "/portal/fn")]
pub async fn delete_package(csrf: String, uuid: String) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    be::delete(&format!("/packages/{}", be::segment(&uuid)?)).await
}

// ---- operator: accounts ----

#[server(prefix = "/portal/fn")]
pub async fn list_accounts(offset: Option<u64>) -> Result<Page<Account>, PortalError> {
    let off = offset.unwrap_or(0);
    let mut p = be::list::<Account>(&format!("/accounts?limit={PAGE_SIZE}&offset={off}")).await?;
    let seen = off + p.items.len() as u64;
    p.next = (seen < p.total).then(|| seen.to_string());
    Ok(p)
}

#[cfg(feature = "ssr")]
fn quota_value(gpu_quota: &str) -> Result<serde_json::Value, PortalError> {
    Ok(if gpu_quota.trim().is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::json!(number::<u32>("gpu_quota", gpu_quota)?)
    })
}

#[server(prefix = "/portal/fn")]
pub async fn create_account(
    csrf: String,
    login: String,
    password: String,
    role: String,
    gpu_quota: String,
) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    let body = serde_json::json!({
        "login": login.trim(),
        "password": password,
        "role": role,
        "gpu_quota": quota_value(&gpu_quota)?,
    });
    be::send::<Account>(Method::POST, "/accounts", &body).await?;
    Ok(())
}

#[server(prefix = "/portal/fn")]
pub async fn set_quota(csrf: String, uuid: String, gpu_quota: String) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    let body = serde_json::json!({ "gpu_quota": quota_value(&gpu_quota)? });
    let path = format!("/accounts/{}", be::segment(&uuid)?);
    be::send::<Account>(Method::PATCH, &path, &body).await?;
    Ok(())
}

// ---- VMs and jobs ----

#[server(prefix = "/portal/fn")]
pub async fn list_vms(
    state: Option<String>,
    owner: Option<String>,
    after: Option<String>,
) -> Result<Page<Vm>, PortalError> {
    let limit = PAGE_SIZE.to_string();
    let q = query(&[
        ("limit", Some(&limit)),
        ("state", state.as_deref()),
        ("owner_uuid", owner.as_deref()),
        ("after", after.as_deref()),
    ]);
    be::list(&format!("/vms{q}")).await
}

#[server(prefix = "/portal/fn")]
pub async fn list_jobs(
    state: Option<String>,
    after: Option<String>,
) -> Result<Page<Job>, PortalError> {
    let limit = PAGE_SIZE.to_string();
    let q = query(&[
        ("limit", Some(&limit)),
        ("state", state.as_deref()),
        ("after", after.as_deref()),
    ]);
    be::list(&format!("/jobs{q}")).await
}

// ---- tenant: instances ----

/// A package as the create page offers it: can it be had right now?
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Offer {
    pub package: Package,
    pub availability: passage_model::api::PackageAvailability,
}

#[server(prefix = "/portal/fn")]
pub async fn offers() -> Result<Vec<Offer>, PortalError> {
    let packages = be::list::<Package>("/packages?limit=1000").await?.items;
    let mut out = Vec::with_capacity(packages.len());
    for p in packages {
        let availability = be::get(&format!("/packages/{}/availability", p.uuid)).await?;
        out.push(Offer {
            package: p,
            availability,
        });
    }
    Ok(out)
}

#[server(prefix = "/portal/fn")]
pub async fn create_instance(
    csrf: String,
    alias: String,
    package: String,
) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    if package.trim().is_empty() {
        return Err(PortalError {
            code: "InvalidArgument".into(),
            message: "Choose a package.".into(),
            field: Some("package".into()),
        });
    }
    let body = serde_json::json!({ "alias": alias.trim(), "package": package.trim() });
    let vm: Vm = be::send(Method::POST, "/vms", &body).await?;
    leptos_axum::redirect(&format!("/instances/{}", vm.uuid));
    Ok(())
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Instance {
    pub vm: Vm,
    pub job: Option<Job>,
    pub package: Option<String>,
}

#[server(prefix = "/portal/fn")]
pub async fn get_instance(uuid: String) -> Result<Instance, PortalError> {
    let vm: Vm = be::get(&format!("/vms/{}", be::segment(&uuid)?)).await?;
    let job = match vm.job_uuid {
        Some(j) => be::get(&format!("/jobs/{j}")).await.ok(),
        None => None,
    };
    let package = match vm.package_uuid {
        Some(p) => be::get::<Package>(&format!("/packages/{p}"))
            .await
            .ok()
            .map(|p| p.name),
        None => None,
    };
    Ok(Instance { vm, job, package })
}

#[server(prefix = "/portal/fn")]
pub async fn destroy_instance(csrf: String, uuid: String) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    let path = format!("/vms/{}", be::segment(&uuid)?);
    be::call(Method::DELETE, &path, None).await?;
    leptos_axum::redirect(&format!("/instances/{uuid}"));
    Ok(())
}
