//! Server functions: what the pages ask of the server. Each one calls the REST API as the
//! session's account (see `backend`), so roles and validation are the API's own.
//! State-changing ones take the form's `csrf` field and check it first.

use crate::error::PortalError;
use leptos::prelude::*;
use passage_model::api::{Account, Alert, Capacity, Job, Package, Role, Server, Vm};
use passage_model::{AccountId, Variant};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[cfg(feature = "ssr")]
use crate::backend::{self as be, query};
#[cfg(feature = "ssr")]
use http::Method;
#[cfg(feature = "ssr")]
use passage_model::ErrorCode;
// The API's request bodies, by their module: several server functions share their names.
#[cfg(feature = "ssr")]
use passage_model::api;

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
    pub uuid: AccountId,
    pub login: String,
    pub role: Role,
    pub gpu_quota: Option<u32>,
    pub csrf: String,
}

impl Me {
    /// Operators and readers: the admin pages are theirs.
    pub fn is_staff(&self) -> bool {
        self.role.sees_all()
    }
    pub fn is_operator(&self) -> bool {
        self.role == Role::Operator
    }
}

/// Rows per list page: enough to scan, small enough to stay fast at any fleet size.
pub const PAGE_SIZE: u32 = 50;

#[server(prefix = "/portal/fn", endpoint = "whoami")]
pub async fn whoami() -> Result<Option<Me>, PortalError> {
    let Some(token) = be::session_token() else {
        return Ok(None);
    };
    match be::get::<Account>("/auth/me").await {
        Ok(a) => Ok(Some(Me {
            uuid: a.uuid,
            login: a.login,
            role: a.role,
            gpu_quota: a.gpu_quota,
            csrf: be::csrf_for(&token),
        })),
        // The cookie's session has ended (idle, expired, revoked): say so once, at the
        // login page, and drop the cookie.
        Err(e) if e.is(ErrorCode::Unauthorized) => {
            be::clear_session_cookie();
            Err(PortalError::session_ended())
        }
        Err(e) => Err(e),
    }
}

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

#[server(prefix = "/portal/fn", endpoint = "login")]
pub async fn login(
    login: String,
    password: String,
    next: Option<String>,
) -> Result<(), PortalError> {
    be::check_same_origin()?;
    if login.trim().is_empty() {
        return Err(invalid("login", "Enter your login."));
    }
    let body = api::LoginRequest { login, password };
    let r: passage_model::api::LoginResponse =
        match be::send(Method::POST, "/auth/login", &body).await {
            Ok(r) => r,
            Err(e) if e.is(ErrorCode::Unauthorized) => {
                return Err(PortalError {
                    field: Some("password".into()),
                    ..PortalError::new(ErrorCode::Unauthorized, "Wrong login or password.")
                });
            }
            Err(e) => return Err(e),
        };
    let secs = (r.expires_at - chrono::Utc::now()).num_seconds();
    be::set_session_cookie(&r.token, secs);
    leptos_axum::redirect(&safe_next(next.as_deref()));
    Ok(())
}

#[server(prefix = "/portal/fn", endpoint = "logout")]
pub async fn logout(csrf: String) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    // Revoke the token on the server, not only in this browser.
    let r = be::call(Method::POST, "/auth/logout", None).await;
    be::clear_session_cookie();
    leptos_axum::redirect("/login");
    match r {
        Err(e) if !e.is(ErrorCode::Unauthorized) => Err(e),
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

#[server(prefix = "/portal/fn", endpoint = "overview")]
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
            status: crate::fmt::server_status(s.status).to_string(),
            disabled: s.disabled,
            last_heartbeat: s.last_heartbeat,
            devices: s.device_counts.values().sum(),
            by_state,
        }
    }
}

#[server(prefix = "/portal/fn", endpoint = "list_servers")]
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

#[server(prefix = "/portal/fn", endpoint = "get_server")]
pub async fn get_server(uuid: String) -> Result<Server, PortalError> {
    be::get(&format!("/servers/{}", be::segment(&uuid)?)).await
}

#[server(prefix = "/portal/fn", endpoint = "list_devices")]
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
#[server(prefix = "/portal/fn", endpoint = "server_events")]
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

#[server(prefix = "/portal/fn", endpoint = "create_join_token")]
pub async fn create_join_token(csrf: String) -> Result<JoinTokenView, PortalError> {
    be::check_csrf(&csrf)?;
    let t: passage_model::api::JoinToken = be::send(
        Method::POST,
        "/servers/join-tokens",
        &api::CreateJoinToken::default(),
    )
    .await?;
    let command = format!(
        "node-agent run --server {} --join-token {} --state-dir /var/lib/passage-agent",
        be::site_origin(),
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

#[server(prefix = "/portal/fn", endpoint = "list_variants")]
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

/// A form's text, `None` when left empty.
#[cfg(feature = "ssr")]
fn optional(s: &str) -> Option<&str> {
    Some(s.trim()).filter(|t| !t.is_empty())
}

/// A form field's value refused: the message goes next to the field, and a script
/// calling the server function gets a 400.
#[cfg(feature = "ssr")]
fn invalid(field: &str, message: impl Into<String>) -> PortalError {
    be::pass_status_on(http::StatusCode::BAD_REQUEST);
    PortalError::invalid(field, message)
}

#[cfg(feature = "ssr")]
fn hex_id(field: &str, v: &str) -> Result<passage_model::HexId, PortalError> {
    v.trim().parse().map_err(|e| invalid(field, format!("{e}")))
}

/// Creates a variant, or replaces the one named `original`.
#[server(prefix = "/portal/fn", endpoint = "save_variant")]
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
    #[server(default)] parent: String,
    #[server(default)] vgpu_type: String,
    #[server(default)] max_per_gpu: String,
    #[server(default)] num_vfs: String,
    #[server(default)] mix: Option<String>,
) -> Result<(), PortalError> {
    use passage_model::variant::DeviceType;
    be::check_csrf(&csrf)?;
    let original = original.as_deref().and_then(optional);
    // What the form does not show (revision, scrub pipeline) stays as it was.
    let existing = match original {
        Some(o) => Some(be::get::<Variant>(&format!("/variants/{}", be::segment(o)?)).await?),
        None => None,
    };
    let kind = DeviceType::parse(kind.trim())
        .ok_or_else(|| invalid("type", "choose one of the listed types"))?;
    // A vGPU variant's ids are its parent's: the server fills what is left empty.
    let id = |field: &str, v: &str| match optional(v) {
        None if kind == DeviceType::Vgpu => Ok(passage_model::HexId::unset()),
        _ => hex_id(field, v),
    };
    let max_per_gpu = optional(&max_per_gpu)
        .map(|n| {
            n.parse::<u32>()
                .map_err(|_| invalid("max_per_gpu", "a whole number of vGPUs, 1 or more"))
        })
        .transpose()?;
    let num_vfs = optional(&num_vfs)
        .map(|n| {
            n.parse::<u32>()
                .map_err(|_| invalid("num_vfs", "a whole number of VFs, 1 or more"))
        })
        .transpose()?;
    let variant = Variant {
        name: name.trim().to_string(),
        kind,
        vendor: id("vendor", &vendor)?,
        device: id("device", &device)?,
        subvendor: optional(&subvendor)
            .map(|v| hex_id("subvendor", v))
            .transpose()?,
        subsystem: optional(&subsystem)
            .map(|v| hex_id("subsystem", v))
            .transpose()?,
        revision: existing.as_ref().and_then(|v| v.revision),
        description: optional(&description).map(str::to_string),
        parent: optional(&parent).map(str::to_string),
        vgpu_type: optional(&vgpu_type).map(str::to_string),
        max_per_gpu,
        num_vfs,
        mix: mix.is_some(),
        // The form edits neither; an operator sets them through the API.
        scrub_policy: existing
            .as_ref()
            .map(|v| v.scrub_policy)
            .unwrap_or_default(),
        scrub: existing.and_then(|v| v.scrub),
    };
    match original {
        Some(o) => {
            let path = format!("/variants/{}", be::segment(o)?);
            be::send::<Variant>(Method::PUT, &path, &variant).await?;
        }
        None => {
            be::send::<Variant>(Method::POST, "/variants", &variant).await?;
        }
    }
    leptos_axum::redirect("/admin/variants");
    Ok(())
}

#[server(prefix = "/portal/fn", endpoint = "delete_variant")]
pub async fn delete_variant(csrf: String, name: String) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    be::delete(&format!("/variants/{}", be::segment(&name)?)).await
}

#[server(prefix = "/portal/fn", endpoint = "list_packages")]
pub async fn list_packages() -> Result<Vec<Package>, PortalError> {
    Ok(be::list::<Package>("/packages?limit=1000").await?.items)
}

#[cfg(feature = "ssr")]
fn number<T: std::str::FromStr>(field: &str, v: &str) -> Result<T, PortalError> {
    v.trim()
        .parse()
        .map_err(|_| invalid(field, format!("{field}: enter a whole number")))
}

/// The package form's device counts: `devices[VARIANT]` → how many of that variant each
/// VM gets, empty or 0 for none.
#[cfg(feature = "ssr")]
fn device_counts(form: &BTreeMap<String, String>) -> Result<BTreeMap<String, u32>, PortalError> {
    let mut devices = BTreeMap::new();
    for (variant, count) in form {
        let Some(count) = optional(count) else {
            continue;
        };
        let field = format!("devices.{variant}");
        let n: u32 = count
            .parse()
            .map_err(|_| invalid(&field, format!("{variant}: enter a whole number")))?;
        if n > 0 {
            devices.insert(variant.clone(), n);
        }
    }
    Ok(devices)
}

#[server(prefix = "/portal/fn", endpoint = "create_package")]
pub async fn create_package(
    csrf: String,
    name: String,
    vcpus: String,
    memory_mib: String,
    disk_gib: String,
    #[server(default)] devices: BTreeMap<String, String>,
) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    let package = api::CreatePackage {
        name: name.trim().to_string(),
        vcpus: number("vcpus", &vcpus)?,
        memory_mib: number("memory_mib", &memory_mib)?,
        disk_gib: match optional(&disk_gib) {
            Some(d) => number("disk_gib", d)?,
            None => 0,
        },
        devices: device_counts(&devices)?,
        placement: None,
        stop_grace_s: None,
    };
    be::send::<Package>(Method::POST, "/packages", &package).await?;
    Ok(())
}

#[server(prefix = "/portal/fn", endpoint = "delete_package")]
pub async fn delete_package(csrf: String, uuid: String) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    be::delete(&format!("/packages/{}", be::segment(&uuid)?)).await
}

// ---- operator: images ----

/// An image as the operator pages show it, with its owner said by login.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ImageRow {
    pub image: passage_model::images::Image,
    /// The owner's login, or the start of its uuid when it cannot be read.
    pub owner: String,
}

/// The owners' logins, one lookup per distinct owner.
#[cfg(feature = "ssr")]
async fn with_owners(images: Vec<passage_model::images::Image>) -> Vec<ImageRow> {
    let mut logins: BTreeMap<AccountId, String> = BTreeMap::new();
    for img in &images {
        if let std::collections::btree_map::Entry::Vacant(slot) = logins.entry(img.owner_uuid) {
            let login = match be::get::<Account>(&format!("/accounts/{}", img.owner_uuid)).await {
                Ok(a) => a.login,
                Err(_) => crate::fmt::short_uuid(&img.owner_uuid.to_string()).to_string(),
            };
            slot.insert(login);
        }
    }
    images
        .into_iter()
        .map(|image| ImageRow {
            owner: logins.get(&image.owner_uuid).cloned().unwrap_or_default(),
            image,
        })
        .collect()
}

#[server(prefix = "/portal/fn", endpoint = "list_images")]
pub async fn list_images(offset: Option<u64>) -> Result<Page<ImageRow>, PortalError> {
    let off = offset.unwrap_or(0);
    let p = be::list::<passage_model::images::Image>(&format!(
        "/images?limit={PAGE_SIZE}&offset={off}"
    ))
    .await?;
    let seen = off + p.items.len() as u64;
    Ok(Page {
        next: (seen < p.total).then(|| seen.to_string()),
        total: p.total,
        items: with_owners(p.items).await,
    })
}

/// One image, the VMs built from it that are not destroyed, and where its file goes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ImageDetail {
    pub row: ImageRow,
    pub vms: Vec<Vm>,
    /// `PUT` the file here (the REST API's own route).
    pub file_url: String,
}

/// VMs listed on an image's page; past that, its count says how many more there are.
pub const IMAGE_VMS_SHOWN: u32 = 200;

#[server(prefix = "/portal/fn", endpoint = "get_image")]
pub async fn get_image(uuid: String) -> Result<ImageDetail, PortalError> {
    let uuid = be::segment(&uuid)?;
    let image: passage_model::images::Image = be::get(&format!("/images/{uuid}")).await?;
    let vms = be::list::<Vm>(&format!("/vms?image_uuid={uuid}&limit={IMAGE_VMS_SHOWN}"))
        .await?
        .items
        .into_iter()
        .filter(|v| v.state != passage_model::api::VmState::Destroyed)
        .collect();
    let file_url = format!("{}/v1/images/{uuid}/file", be::site_origin());
    let row = with_owners(vec![image])
        .await
        .pop()
        .ok_or_else(|| PortalError::portal("the image went missing"))?;
    Ok(ImageDetail { row, vms, file_url })
}

#[server(prefix = "/portal/fn", endpoint = "create_image")]
#[allow(clippy::too_many_arguments)]
pub async fn create_image(
    csrf: String,
    name: String,
    version: String,
    os: String,
    image_type: String,
    description: String,
    // An unchecked box sends nothing.
    public: Option<String>,
    default_user: String,
    min_disk_gib: String,
    // Empty: the default for the VM (UEFI with devices, BIOS without).
    #[server(default)] bootrom: String,
) -> Result<(), PortalError> {
    use passage_model::images::{Bootrom, CreateImage, Image, ImageRequirements};
    be::check_csrf(&csrf)?;
    let mut tags = BTreeMap::new();
    if let Some(u) = optional(&default_user) {
        tags.insert("default_user".to_string(), u.to_string());
    }
    let req = CreateImage {
        name: name.trim().to_string(),
        version: version.trim().to_string(),
        os: os.trim().to_string(),
        image_type: image_type
            .trim()
            .parse()
            .map_err(|_| invalid("image_type", "choose qcow2 or raw"))?,
        description: optional(&description).map(str::to_string),
        public: public.is_some(),
        owner_uuid: None,
        tags,
        requirements: ImageRequirements {
            min_disk_gib: optional(&min_disk_gib)
                .map(|g| number("min_disk_gib", g))
                .transpose()?,
            bootrom: optional(&bootrom)
                .map(|b| {
                    Bootrom::parse(b)
                        .ok_or_else(|| invalid("bootrom", "choose uefi, bios or the default"))
                })
                .transpose()?,
        },
    };
    // The API's field names, where the form's differ.
    let img: Image =
        be::send(Method::POST, "/images", &req)
            .await
            .map_err(|e| match e.field.as_deref() {
                Some("tags.default_user") => PortalError {
                    field: Some("default_user".into()),
                    ..e
                },
                Some("requirements.min_disk_gib") => PortalError {
                    field: Some("min_disk_gib".into()),
                    ..e
                },
                Some("requirements.bootrom") => PortalError {
                    field: Some("bootrom".into()),
                    ..e
                },
                _ => e,
            })?;
    // Next comes its file, on its own page.
    leptos_axum::redirect(&format!("/admin/images/{}", img.uuid));
    Ok(())
}

#[server(prefix = "/portal/fn", endpoint = "delete_image")]
pub async fn delete_image(csrf: String, uuid: String) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    let path = format!("/images/{}", be::segment(&uuid)?);
    be::delete(&path).await?;
    // Still there (disabled, VMs were built from it): its page says so; else the list.
    match be::get::<passage_model::images::Image>(&path).await {
        Ok(_) => leptos_axum::redirect(&format!("/admin/images/{uuid}")),
        Err(_) => leptos_axum::redirect("/admin/images"),
    }
    Ok(())
}

// ---- operator: accounts ----

#[server(prefix = "/portal/fn", endpoint = "list_accounts")]
pub async fn list_accounts(offset: Option<u64>) -> Result<Page<Account>, PortalError> {
    let off = offset.unwrap_or(0);
    let mut p = be::list::<Account>(&format!("/accounts?limit={PAGE_SIZE}&offset={off}")).await?;
    let seen = off + p.items.len() as u64;
    p.next = (seen < p.total).then(|| seen.to_string());
    Ok(p)
}

/// The quota field: empty for no limit.
#[cfg(feature = "ssr")]
fn quota(gpu_quota: &str) -> Result<Option<u32>, PortalError> {
    optional(gpu_quota)
        .map(|q| number("gpu_quota", q))
        .transpose()
}

#[server(prefix = "/portal/fn", endpoint = "create_account")]
pub async fn create_account(
    csrf: String,
    login: String,
    password: String,
    role: String,
    gpu_quota: String,
) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    let account = api::CreateAccount {
        login: login.trim().to_string(),
        password,
        role: Role::parse(role.trim())
            .ok_or_else(|| invalid("role", "choose one of the listed roles"))?,
        gpu_quota: quota(&gpu_quota)?,
    };
    be::send::<Account>(Method::POST, "/accounts", &account).await?;
    Ok(())
}

#[server(prefix = "/portal/fn", endpoint = "set_quota")]
pub async fn set_quota(csrf: String, uuid: String, gpu_quota: String) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    let change = api::UpdateAccount {
        gpu_quota: Some(quota(&gpu_quota)?),
        ..api::UpdateAccount::default()
    };
    let path = format!("/accounts/{}", be::segment(&uuid)?);
    be::send::<Account>(Method::PATCH, &path, &change).await?;
    Ok(())
}

// ---- VMs and jobs ----

#[server(prefix = "/portal/fn", endpoint = "list_vms")]
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

#[server(prefix = "/portal/fn", endpoint = "list_jobs")]
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

#[server(prefix = "/portal/fn", endpoint = "offers")]
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

/// The images an instance may boot: active ones the caller sees, newest first.
#[server(prefix = "/portal/fn", endpoint = "usable_images")]
pub async fn usable_images() -> Result<Vec<passage_model::images::Image>, PortalError> {
    Ok(be::list("/images?state=active&limit=1000").await?.items)
}

#[server(prefix = "/portal/fn", endpoint = "create_instance")]
#[allow(clippy::too_many_arguments)]
pub async fn create_instance(
    csrf: String,
    alias: String,
    // A form without a chosen package has no `package` field at all.
    package: Option<String>,
    image: Option<String>,
    // `networks[net-UUID]` for each box checked (a key that starts with a digit would be
    // read as a list index).
    #[server(default)] networks: BTreeMap<String, String>,
    // Set when the form offered networks: then none checked means none at all, while a
    // form that offered none leaves the choice to the server's defaults.
    #[server(default)] networks_offered: Option<String>,
    #[server(default)] user_data: String,
) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    let Some(package) = package.as_deref().and_then(optional) else {
        return Err(invalid("package", "Choose a package."));
    };
    let Some(image) = image.as_deref().and_then(optional) else {
        return Err(invalid("image", "Choose an image."));
    };
    let networks: BTreeMap<String, String> = networks
        .into_iter()
        .map(|(k, v)| (k.strip_prefix("net-").unwrap_or(&k).to_string(), v))
        .collect();
    let networks = if networks_offered.is_some() {
        // The primary NIC is the first: the order the form lists them in (defaults first).
        let offered = usable_networks().await?;
        let mut chosen: Vec<passage_model::networks::NetworkChoice> = offered
            .iter()
            .filter(|n| networks.contains_key(&n.uuid.to_string()))
            .map(|n| passage_model::networks::NetworkChoice::Named(n.uuid.to_string()))
            .collect();
        // One the list no longer shows goes to the API as sent, which says what is wrong.
        for k in networks.keys() {
            if !offered.iter().any(|n| n.uuid.to_string() == *k) {
                chosen.push(passage_model::networks::NetworkChoice::Named(k.clone()));
            }
        }
        Some(chosen)
    } else {
        None
    };
    let metadata = optional(&user_data).map(|_| {
        // Line endings as a browser posts them (CRLF) are not what cloud-init expects.
        BTreeMap::from([("user-data".to_string(), user_data.replace("\r\n", "\n"))])
    });
    let vm = api::CreateVm {
        alias: optional(&alias)
            .map(str::to_string)
            .unwrap_or_else(passage_model::ids::made_up_alias),
        package: Some(package.to_string()),
        image: Some(image.to_string()),
        owner_uuid: None,
        assigned_devices: None,
        server_uuid: None,
        vcpus: None,
        memory_mib: None,
        networks,
        metadata,
        tags: None,
        keys: None,
    };
    let vm: Vm =
        be::send(Method::POST, "/vms", &vm)
            .await
            .map_err(|e| match e.field.as_deref() {
                Some(f) if f.starts_with("networks") => PortalError {
                    field: Some("networks".into()),
                    ..e
                },
                Some(f) if f.starts_with("metadata") => PortalError {
                    field: Some("user_data".into()),
                    ..e
                },
                _ => e,
            })?;
    leptos_axum::redirect(&format!("/instances/{}", vm.uuid));
    Ok(())
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Instance {
    pub vm: Vm,
    pub job: Option<Job>,
    pub package: Option<String>,
    /// Who to log in as: the image's `default_user` tag, else `root`.
    pub login_user: String,
    /// Its image as `name@version`, where the caller may still read it.
    pub image: Option<String>,
    /// The names of the networks of its NICs, by uuid, where the caller may read them.
    pub network_names: BTreeMap<String, String>,
}

#[server(prefix = "/portal/fn", endpoint = "get_instance")]
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
    let image = match vm.image_uuid {
        Some(i) => be::get::<passage_model::images::Image>(&format!("/images/{i}"))
            .await
            .ok(),
        None => None,
    };
    let login_user = image
        .as_ref()
        .and_then(|img| img.tags.get("default_user").cloned())
        .filter(|u| !u.trim().is_empty())
        .unwrap_or_else(|| "root".to_string());
    let image = image.map(|img| format!("{}@{}", img.name, img.version));
    let mut network_names = BTreeMap::new();
    for nic in &vm.nics {
        let id = nic.network_uuid.to_string();
        if network_names.contains_key(&id) {
            continue;
        }
        if let Ok(n) = be::get::<passage_model::networks::Network>(&format!("/networks/{id}")).await
        {
            network_names.insert(id, n.name);
        }
    }
    Ok(Instance {
        vm,
        job,
        package,
        login_user,
        image,
        network_names,
    })
}

/// Stops, starts or reboots an instance (`action`); `force` (a checked box) cuts the power
/// instead of asking the guest to shut down.
#[server(prefix = "/portal/fn", endpoint = "power_instance")]
pub async fn power_instance(
    csrf: String,
    uuid: String,
    action: String,
    #[server(default)] force: Option<String>,
) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    if !matches!(action.as_str(), "stop" | "start" | "reboot") {
        return Err(invalid("action", "Stop, start or reboot."));
    }
    let path = format!("/vms/{}/{action}", be::segment(&uuid)?);
    let body = serde_json::json!({"force": force.is_some()});
    let _: Vm = be::send(Method::POST, &path, &body).await?;
    leptos_axum::redirect(&format!("/instances/{uuid}"));
    Ok(())
}

/// A tag's value as typed in the portal, read as the `triton` CLI reads `tag set k=v`:
/// `true`/`false` are booleans, a number is a number, anything else is text.
pub fn tag_value(text: &str) -> serde_json::Value {
    match text {
        "true" => serde_json::Value::Bool(true),
        "false" => serde_json::Value::Bool(false),
        _ => match text.parse::<serde_json::Number>() {
            Ok(n) if !text.starts_with('+') => serde_json::Value::Number(n),
            _ => serde_json::Value::String(text.to_string()),
        },
    }
}

/// Sets one tag of an instance (added, or its value replaced); the others stay.
#[server(prefix = "/portal/fn", endpoint = "set_instance_tag")]
pub async fn set_instance_tag(
    csrf: String,
    uuid: String,
    key: String,
    value: String,
) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    let key = key.trim();
    if key.is_empty() {
        return Err(invalid("key", "A tag needs a name."));
    }
    let path = format!("/vms/{}/tags", be::segment(&uuid)?);
    let body = serde_json::json!({ key: tag_value(value.trim()) });
    let _: serde_json::Value = be::send(Method::POST, &path, &body).await?;
    leptos_axum::redirect(&format!("/instances/{uuid}"));
    Ok(())
}

/// Removes one tag of an instance.
#[server(prefix = "/portal/fn", endpoint = "delete_instance_tag")]
pub async fn delete_instance_tag(
    csrf: String,
    uuid: String,
    key: String,
) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    let path = format!(
        "/vms/{}/tags/{}",
        be::segment(&uuid)?,
        crate::fmt::urlencode(&key)
    );
    be::delete(&path).await?;
    leptos_axum::redirect(&format!("/instances/{uuid}"));
    Ok(())
}

#[server(prefix = "/portal/fn", endpoint = "destroy_instance")]
pub async fn destroy_instance(csrf: String, uuid: String) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    let path = format!("/vms/{}", be::segment(&uuid)?);
    be::call(Method::DELETE, &path, None).await?;
    leptos_axum::redirect(&format!("/instances/{uuid}"));
    Ok(())
}

// ---- operator: networks ----

/// A network and how many of its addresses are in use.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NetworkRow {
    pub network: passage_model::networks::Network,
    pub in_use: u64,
}

#[server(prefix = "/portal/fn", endpoint = "list_networks")]
pub async fn list_networks(offset: Option<u64>) -> Result<Page<NetworkRow>, PortalError> {
    use passage_model::networks::{Network, NetworkIp};
    let off = offset.unwrap_or(0);
    let p = be::list::<Network>(&format!("/networks?limit={PAGE_SIZE}&offset={off}")).await?;
    let seen = off + p.items.len() as u64;
    let mut items = Vec::with_capacity(p.items.len());
    for network in p.items {
        let in_use = be::list::<NetworkIp>(&format!("/networks/{}/ips?limit=1", network.uuid))
            .await
            .map(|p| p.total)
            .unwrap_or(0);
        items.push(NetworkRow { network, in_use });
    }
    Ok(Page {
        next: (seen < p.total).then(|| seen.to_string()),
        total: p.total,
        items,
    })
}

/// A comma- or space-separated list from a form field, without the empty entries.
#[cfg(feature = "ssr")]
fn words(s: &str) -> Vec<String> {
    s.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

#[server(prefix = "/portal/fn", endpoint = "create_network")]
#[allow(clippy::too_many_arguments)]
pub async fn create_network(
    csrf: String,
    name: String,
    subnet: String,
    #[server(default)] gateway: String,
    #[server(default)] provision_start_ip: String,
    #[server(default)] provision_end_ip: String,
    #[server(default)] resolvers: String,
    #[server(default)] vlan_id: String,
    bridge: String,
    #[server(default)] mtu: String,
    // An unchecked box sends nothing.
    #[server(default)] public: Option<String>,
    #[server(default)] default: Option<String>,
    #[server(default)] owner_uuids: String,
    #[server(default)] description: String,
) -> Result<(), PortalError> {
    use passage_model::networks::{CreateNetwork, Network};
    be::check_csrf(&csrf)?;
    let owners = owner_ids(&owner_uuids).await?;
    let req = CreateNetwork {
        name: name.trim().to_string(),
        subnet: subnet.trim().to_string(),
        gateway: optional(&gateway).map(str::to_string),
        provision_start_ip: optional(&provision_start_ip).map(str::to_string),
        provision_end_ip: optional(&provision_end_ip).map(str::to_string),
        resolvers: words(&resolvers),
        vlan_id: match optional(&vlan_id) {
            Some(v) => number("vlan_id", v)?,
            None => 0,
        },
        bridge: bridge.trim().to_string(),
        mtu: optional(&mtu).map(|m| number("mtu", m)).transpose()?,
        public: public.is_some(),
        owner_uuids: owners,
        default: default.is_some(),
        description: optional(&description).map(str::to_string),
    };
    let n: Network = be::send(Method::POST, "/networks", &req)
        .await
        .map_err(list_field)?;
    leptos_axum::redirect(&format!("/admin/networks/{}", n.uuid));
    Ok(())
}

/// `resolvers[2]`, `owner_uuids[0]`: the form has one field for the list.
#[cfg(feature = "ssr")]
fn list_field(e: PortalError) -> PortalError {
    match e.field.as_deref().and_then(|f| f.split_once('[')) {
        Some((f, _)) => PortalError {
            field: Some(f.to_string()),
            ..e
        },
        None => e,
    }
}

/// The owners field: account logins or UUIDs, comma- or space-separated. Logins are
/// looked up in the account list (the API has no lookup by login), read once and only
/// when one is given.
#[cfg(feature = "ssr")]
async fn owner_ids(field: &str) -> Result<Vec<AccountId>, PortalError> {
    let mut by_login: Option<BTreeMap<String, AccountId>> = None;
    let mut out = Vec::new();
    for w in words(field) {
        if let Ok(id) = w.parse::<AccountId>() {
            out.push(id);
            continue;
        }
        if by_login.is_none() {
            let mut all = BTreeMap::new();
            loop {
                let p = be::list::<Account>(&format!("/accounts?limit=1000&offset={}", all.len()))
                    .await?;
                let got = p.items.len();
                all.extend(p.items.into_iter().map(|a| (a.login, a.uuid)));
                if got == 0 || all.len() as u64 >= p.total {
                    break;
                }
            }
            by_login = Some(all);
        }
        match by_login.as_ref().and_then(|m| m.get(&w)) {
            Some(id) => out.push(*id),
            None => {
                return Err(invalid(
                    "owner_uuids",
                    format!("no account has the login {w:?}"),
                ));
            }
        }
    }
    Ok(out)
}

#[server(prefix = "/portal/fn", endpoint = "update_network")]
#[allow(clippy::too_many_arguments)]
pub async fn update_network(
    csrf: String,
    uuid: String,
    name: String,
    #[server(default)] resolvers: String,
    #[server(default)] mtu: String,
    #[server(default)] public: Option<String>,
    #[server(default)] default: Option<String>,
    #[server(default)] owner_uuids: String,
    #[server(default)] description: String,
) -> Result<(), PortalError> {
    use passage_model::networks::{Network, UpdateNetwork};
    be::check_csrf(&csrf)?;
    let path = format!("/networks/{}", be::segment(&uuid)?);
    let req = UpdateNetwork {
        name: Some(name.trim().to_string()),
        resolvers: Some(words(&resolvers)),
        mtu: optional(&mtu).map(|m| number("mtu", m)).transpose()?,
        public: Some(public.is_some()),
        owner_uuids: Some(owner_ids(&owner_uuids).await?),
        default: Some(default.is_some()),
        description: Some(description.trim().to_string()),
    };
    be::send::<Network>(Method::PATCH, &path, &req)
        .await
        .map_err(list_field)?;
    leptos_axum::redirect(&path.replace("/networks", "/admin/networks"));
    Ok(())
}

/// One address of a network in use, with its VM and owner said by name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AddressRow {
    pub ip: std::net::Ipv4Addr,
    pub mac: String,
    pub vm_uuid: passage_model::VmId,
    /// The VM's alias, when it can still be read.
    pub vm_alias: Option<String>,
    pub vm_state: Option<String>,
    pub owner_uuid: AccountId,
    pub owner: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NetworkDetail {
    pub network: passage_model::networks::Network,
    /// The owners allowed on it, by login.
    pub owners: Vec<String>,
    pub addresses: Page<AddressRow>,
}

#[server(prefix = "/portal/fn", endpoint = "get_network")]
pub async fn get_network(uuid: String, offset: Option<u64>) -> Result<NetworkDetail, PortalError> {
    use passage_model::networks::{Network, NetworkIp};
    let uuid = be::segment(&uuid)?;
    let network: Network = be::get(&format!("/networks/{uuid}")).await?;
    let off = offset.unwrap_or(0);
    let p = be::list::<NetworkIp>(&format!(
        "/networks/{uuid}/ips?limit={PAGE_SIZE}&offset={off}"
    ))
    .await?;
    let mut logins: BTreeMap<AccountId, String> = BTreeMap::new();
    let mut owners = Vec::with_capacity(network.owner_uuids.len());
    for o in &network.owner_uuids {
        // The whole UUID where the login cannot be read: the edit form sends these back.
        owners.push(match be::get::<Account>(&format!("/accounts/{o}")).await {
            Ok(a) => {
                logins.insert(a.uuid, a.login.clone());
                a.login
            }
            Err(_) => o.to_string(),
        });
    }
    let seen = off + p.items.len() as u64;
    let mut items = Vec::with_capacity(p.items.len());
    for ip in p.items {
        let vm = be::get::<Vm>(&format!("/vms/{}", ip.vm_uuid)).await.ok();
        items.push(AddressRow {
            ip: ip.ip,
            mac: ip.mac,
            vm_uuid: ip.vm_uuid,
            vm_alias: vm.as_ref().map(|v| v.alias.clone()),
            vm_state: vm.map(|v| v.state.as_str().to_string()),
            owner_uuid: ip.owner_uuid,
            owner: login_of(&mut logins, ip.owner_uuid).await,
        });
    }
    Ok(NetworkDetail {
        network,
        owners,
        addresses: Page {
            next: (seen < p.total).then(|| seen.to_string()),
            total: p.total,
            items,
        },
    })
}

/// An account's login, looked up once per page.
#[cfg(feature = "ssr")]
async fn login_of(logins: &mut BTreeMap<AccountId, String>, a: AccountId) -> String {
    if let Some(l) = logins.get(&a) {
        return l.clone();
    }
    let l = match be::get::<Account>(&format!("/accounts/{a}")).await {
        Ok(acc) => acc.login,
        Err(_) => crate::fmt::short_uuid(&a.to_string()).to_string(),
    };
    logins.insert(a, l.clone());
    l
}

#[server(prefix = "/portal/fn", endpoint = "delete_network")]
pub async fn delete_network(csrf: String, uuid: String) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    be::delete(&format!("/networks/{}", be::segment(&uuid)?))
        .await
        .map_err(|e| {
            // Addresses in use: not a clash of names, a network that cannot go yet.
            if e.is(ErrorCode::Conflict) {
                PortalError::new(ErrorCode::InvalidState, e.message)
            } else {
                e
            }
        })?;
    leptos_axum::redirect("/admin/networks");
    Ok(())
}

// ---- SSH keys ----

#[server(prefix = "/portal/fn", endpoint = "list_keys")]
pub async fn list_keys() -> Result<Vec<passage_model::keys::SshKey>, PortalError> {
    // An account holds at most 100 keys: one page has them all.
    Ok(be::list("/keys?limit=1000").await?.items)
}

#[server(prefix = "/portal/fn", endpoint = "add_key")]
pub async fn add_key(csrf: String, name: String, key: String) -> Result<(), PortalError> {
    use passage_model::keys::{CreateSshKey, SshKey};
    be::check_csrf(&csrf)?;
    if optional(&key).is_none() {
        return Err(invalid(
            "key",
            "Paste a public key, a line such as the one in ~/.ssh/id_ed25519.pub.",
        ));
    }
    let req = CreateSshKey {
        name: optional(&name).map(str::to_string),
        key: key.trim().to_string(),
    };
    be::send::<SshKey>(Method::POST, "/keys", &req).await?;
    Ok(())
}

#[server(prefix = "/portal/fn", endpoint = "delete_key")]
pub async fn delete_key(csrf: String, name: String) -> Result<(), PortalError> {
    be::check_csrf(&csrf)?;
    if name.is_empty() || name.contains('/') {
        return Err(PortalError::new(ErrorCode::ResourceNotFound, "no such key"));
    }
    be::delete(&format!("/keys/{}", crate::fmt::urlencode(&name))).await?;
    leptos_axum::redirect("/keys");
    Ok(())
}

// ---- tenant: networks and console ----

/// The networks the caller may put an instance on, the defaults first.
#[server(prefix = "/portal/fn", endpoint = "usable_networks")]
pub async fn usable_networks() -> Result<Vec<passage_model::networks::Network>, PortalError> {
    let mut all: Vec<passage_model::networks::Network> =
        be::list("/networks?limit=1000").await?.items;
    all.sort_by_key(|n| !n.default);
    Ok(all)
}

/// A VM's console, or why there is none now.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Console {
    Output {
        text: String,
        read_at: chrono::DateTime<chrono::Utc>,
    },
    /// Not placed yet, destroyed, or its node did not answer: said calmly, not an error.
    Unavailable(String),
    /// No such VM for the caller: the page says so already, the panel stays away.
    Hidden,
}

#[server(prefix = "/portal/fn", endpoint = "get_console")]
pub async fn get_console(uuid: String) -> Result<Console, PortalError> {
    let path = format!("/vms/{}/console", be::segment(&uuid)?);
    match be::get::<passage_model::api::VmConsole>(&path).await {
        Ok(c) => Ok(Console::Output {
            text: c.output,
            read_at: c.read_at,
        }),
        Err(e) if e.is(ErrorCode::InvalidState) || e.is(ErrorCode::Conflict) => {
            // Not an error of the page's: a script's call answers 200.
            if let Some(res) = use_context::<leptos_axum::ResponseOptions>() {
                res.set_status(http::StatusCode::OK);
            }
            Ok(Console::Unavailable(e.message))
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::tag_value;
    use serde_json::json;

    #[test]
    fn tag_values_are_typed_as_the_triton_cli_types_them() {
        assert_eq!(tag_value("true"), json!(true));
        assert_eq!(tag_value("false"), json!(false));
        assert_eq!(tag_value("42"), json!(42));
        assert_eq!(tag_value("-1.5"), json!(-1.5));
        assert_eq!(tag_value("web"), json!("web"));
        assert_eq!(tag_value("01"), json!("01"));
        assert_eq!(tag_value("+1"), json!("+1"));
        assert_eq!(tag_value("True"), json!("True"));
        assert_eq!(tag_value(""), json!(""));
    }
}
