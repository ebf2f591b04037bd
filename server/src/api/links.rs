//! OpenAPI links: how one answer's values feed the next call (RFC: OpenAPI 3.1 "Link
//! Object"). Clients can follow them, and Schemathesis's stateful phase chains calls with
//! them, so operations on `/vms/{uuid}`, `/jobs/{uuid}` or `/servers/{uuid}` are fuzzed with
//! objects that exist instead of random uuids that only ever get a 404.

use serde_json::{Map, Value, json};

/// One link: from an operation's answer to another operation.
pub struct Link {
    pub from: &'static str,
    pub status: &'static str,
    pub to: &'static str,
    /// Target parameter → runtime expression on the source's answer.
    pub parameters: &'static [(&'static str, &'static str)],
    /// Fields of the target's body taken from the answer (merged into a generated body);
    /// `None` sends null.
    pub body: &'static [(&'static str, Option<&'static str>)],
}

const fn link(
    from: &'static str,
    status: &'static str,
    to: &'static str,
    parameters: &'static [(&'static str, &'static str)],
) -> Link {
    Link {
        from,
        status,
        to,
        parameters,
        body: &[],
    }
}

const UUID: &[(&str, &str)] = &[("uuid", "$response.body#/uuid")];
const FIRST_UUID: &[(&str, &str)] = &[("uuid", "$response.body#/0/uuid")];
const JOB: &[(&str, &str)] = &[("uuid", "$response.body#/job_uuid")];
const NAME: &[(&str, &str)] = &[("name", "$response.body#/name")];
const FIRST_NAME: &[(&str, &str)] = &[("name", "$response.body#/0/name")];
/// A creation from a package names nothing else, so that a generated body merged with
/// the package is one the API takes (operator-only fields left out, no explicit size).
const PACKAGE_UUID: &[(&str, Option<&str>)] = &[
    ("package", Some("$response.body#/uuid")),
    ("owner_uuid", None),
    ("assigned_devices", None),
    ("server_uuid", None),
    ("vcpus", None),
    ("memory_mib", None),
];
const FIRST_PACKAGE: &[(&str, Option<&str>)] = &[
    ("package", Some("$response.body#/0/name")),
    ("owner_uuid", None),
    ("assigned_devices", None),
    ("server_uuid", None),
    ("vcpus", None),
    ("memory_mib", None),
];
const DEVICE_SERVER: &[(&str, &str)] = &[("uuid", "$response.body#/0/server_uuid")];
/// A key of the account named in the request's path.
const ACCOUNT_KEY: &[(&str, &str)] = &[
    ("uuid", "$request.path.uuid"),
    ("name", "$response.body#/name"),
];
const FIRST_ACCOUNT_KEY: &[(&str, &str)] = &[
    ("uuid", "$request.path.uuid"),
    ("name", "$response.body#/0/name"),
];

/// Every link the document states. `logout`, `delete_token` and `revoke_credential` are not
/// targets: following them would cut off the caller or its nodes.
pub const LINKS: &[Link] = &[
    // Instances and their jobs.
    link("create_vm", "202", "get_vm", UUID),
    link("create_vm", "202", "stop_vm", UUID),
    link("create_vm", "202", "start_vm", UUID),
    link("create_vm", "202", "reboot_vm", UUID),
    link("create_vm", "202", "resize_vm", UUID),
    link("create_vm", "202", "migrate_vm", UUID),
    link("create_vm", "202", "delete_vm", UUID),
    link("create_vm", "202", "get_job", JOB),
    link("create_vm", "202", "vm_console", UUID),
    link("list_vms", "200", "vm_console", FIRST_UUID),
    link("list_vms", "200", "get_vm", FIRST_UUID),
    link("list_vms", "200", "stop_vm", FIRST_UUID),
    link("list_vms", "200", "start_vm", FIRST_UUID),
    link("list_vms", "200", "reboot_vm", FIRST_UUID),
    link("list_vms", "200", "resize_vm", FIRST_UUID),
    link("list_vms", "200", "migrate_vm", FIRST_UUID),
    link("stop_vm", "202", "get_job", JOB),
    link("stop_vm", "202", "start_vm", UUID),
    link("start_vm", "202", "get_job", JOB),
    link("reboot_vm", "202", "get_job", JOB),
    link("resize_vm", "202", "get_job", JOB),
    link("migrate_vm", "202", "get_job", JOB),
    link("delete_vm", "202", "get_job", JOB),
    link("list_jobs", "200", "get_job", FIRST_UUID),
    // A VM's tags and metadata (keys of one are the fuzzer's to make up).
    link("create_vm", "202", "list_vm_tags", UUID),
    link("create_vm", "202", "add_vm_tags", UUID),
    link("create_vm", "202", "replace_vm_tags", UUID),
    link("create_vm", "202", "delete_vm_tags", UUID),
    link("create_vm", "202", "get_vm_tag", UUID),
    link("create_vm", "202", "delete_vm_tag", UUID),
    link("create_vm", "202", "list_vm_metadata", UUID),
    link("create_vm", "202", "add_vm_metadata", UUID),
    link("create_vm", "202", "replace_vm_metadata", UUID),
    link("create_vm", "202", "delete_vm_metadata", UUID),
    link("create_vm", "202", "get_vm_metadata_key", UUID),
    link("create_vm", "202", "delete_vm_metadata_key", UUID),
    // Accounts.
    link("create_account", "201", "get_account", UUID),
    link("create_account", "201", "update_account", UUID),
    link("create_account", "201", "delete_account", UUID),
    link("list_accounts", "200", "get_account", FIRST_UUID),
    // Networks.
    link("create_network", "201", "get_network", UUID),
    link("create_network", "201", "update_network", UUID),
    link("create_network", "201", "delete_network", UUID),
    link("list_networks", "200", "get_network", FIRST_UUID),
    link("create_network", "201", "list_network_ips", UUID),
    link("list_networks", "200", "list_network_ips", FIRST_UUID),
    // SSH keys: the caller's own, and any account's.
    link("create_key", "201", "get_key", NAME),
    link("create_key", "201", "delete_key", NAME),
    link("list_keys", "200", "get_key", FIRST_NAME),
    link("create_account", "201", "list_account_keys", UUID),
    link("create_account", "201", "create_account_key", UUID),
    link("list_accounts", "200", "list_account_keys", FIRST_UUID),
    link("create_account_key", "201", "get_account_key", ACCOUNT_KEY),
    link(
        "create_account_key",
        "201",
        "delete_account_key",
        ACCOUNT_KEY,
    ),
    link(
        "list_account_keys",
        "200",
        "get_account_key",
        FIRST_ACCOUNT_KEY,
    ),
    // Variants and packages.
    link("create_variant", "201", "get_variant", NAME),
    link("create_variant", "201", "put_variant", NAME),
    link("create_variant", "201", "delete_variant", NAME),
    link("list_variants", "200", "get_variant", FIRST_NAME),
    link("create_package", "201", "get_package", UUID),
    link("create_package", "201", "package_availability", UUID),
    link("create_package", "201", "delete_package", UUID),
    Link {
        from: "create_package",
        status: "201",
        to: "create_vm",
        parameters: &[],
        body: PACKAGE_UUID,
    },
    // Images.
    link("create_image", "201", "get_image", UUID),
    link("create_image", "201", "update_image", UUID),
    link("create_image", "201", "upload_image_file", UUID),
    link("create_image", "201", "download_image_file", UUID),
    link("create_image", "201", "delete_image", UUID),
    link("list_images", "200", "get_image", FIRST_UUID),
    link("list_images", "200", "download_image_file", FIRST_UUID),
    link("list_packages", "200", "get_package", FIRST_UUID),
    link("list_packages", "200", "package_availability", FIRST_UUID),
    Link {
        from: "list_packages",
        status: "200",
        to: "create_vm",
        parameters: &[],
        body: FIRST_PACKAGE,
    },
    // Servers and their devices.
    link("list_servers", "200", "get_server", FIRST_UUID),
    link("list_servers", "200", "update_server", FIRST_UUID),
    link("list_servers", "200", "device_events", FIRST_UUID),
    link("list_servers", "200", "scrub_reports", FIRST_UUID),
    link("list_devices", "200", "get_server", DEVICE_SERVER),
    Link {
        from: "list_devices",
        status: "200",
        to: "device_action",
        parameters: DEVICE_SERVER,
        body: &[("device", Some("$response.body#/0/id"))],
    },
];

/// Adds [`LINKS`] to the served document (a JSON value, after utoipa's own output).
pub fn add(doc: &mut Value) {
    for l in LINKS {
        let Some(response) = operation_mut(doc, l.from)
            .and_then(|op| op.pointer_mut(&format!("/responses/{}", l.status)))
            .and_then(Value::as_object_mut)
        else {
            continue;
        };
        let mut def = Map::new();
        def.insert("operationId".into(), json!(l.to));
        if !l.parameters.is_empty() {
            def.insert("parameters".into(), object(l.parameters));
        }
        if !l.body.is_empty() {
            def.insert("requestBody".into(), object(l.body));
        }
        let links = response
            .entry("links")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Some(links) = links.as_object_mut() {
            links.insert(name(l.to), Value::Object(def));
        }
    }
}

fn object<V: serde::Serialize>(pairs: &[(&str, V)]) -> Value {
    Value::Object(
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), json!(v)))
            .collect(),
    )
}

/// `get_vm` → `GetVm`: link names are keys, unique per response because each response
/// links once to each target.
fn name(operation: &str) -> String {
    operation
        .split('_')
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

fn operation_mut<'a>(doc: &'a mut Value, id: &str) -> Option<&'a mut Value> {
    doc.get_mut("paths")?
        .as_object_mut()?
        .values_mut()
        .filter_map(Value::as_object_mut)
        .flat_map(|item| item.values_mut())
        .find(|op| op.get("operationId").and_then(Value::as_str) == Some(id))
}

#[cfg(test)]
mod tests {
    #[test]
    fn names() {
        assert_eq!(super::name("get_vm"), "GetVm");
        assert_eq!(super::name("package_availability"), "PackageAvailability");
    }
}
