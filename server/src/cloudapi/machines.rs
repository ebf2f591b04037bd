//! Machines: CloudAPI's name for VMs. Created, listed, started, stopped, rebooted and
//! deleted through the same services as `/v1/vms`.

use super::shapes::{self, machine};
use super::{CloudError, CloudResult, Signed, body_object, path_id, query_pairs};
use crate::error::ApiError;
use crate::listing::{PageReq, VmFilter};
use crate::services::auth::Caller;
use crate::services::vm_labels::{self, Change};
use crate::services::{Ctx, catalog, vm_ops, vms};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use passage_model::api::{CreateVm, Package, Vm, VmState};
use passage_model::networks::NetworkChoice;
use passage_model::{ImageId, PackageId, VmId};
use serde_json::Value;
use std::collections::BTreeMap;

const MAX_PAGE: i64 = passage_model::api::MAX_LIST_LIMIT as i64;

/// Every package by uuid, for the machines' package names and disks.
async fn packages(ctx: &Ctx) -> CloudResult<BTreeMap<PackageId, Package>> {
    let (items, _) = catalog::list_packages(ctx, MAX_PAGE, 0).await?;
    Ok(items.into_iter().map(|p| (p.uuid, p)).collect())
}

/// The caller's own VM: CloudAPI's paths are the account's, so even an operator finds
/// only its own machines here.
async fn own_vm(ctx: &Ctx, caller: &Caller, id: VmId) -> CloudResult<Vm> {
    let vm = vms::get(ctx, caller, id).await?;
    if vm.owner_uuid != caller.account.uuid {
        return Err(CloudError(ApiError::not_found("vm")));
    }
    Ok(vm)
}

fn invalid(field: &str, message: impl Into<String>) -> CloudError {
    CloudError(ApiError::invalid(field, message))
}

/// `GET /:login/machines`: the account's machines, newest first, without deleted ones
/// unless `state=deleted`; `x-resource-count` is this page's length.
pub async fn list(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    uri: Uri,
) -> CloudResult<Response> {
    let mut filter = VmFilter {
        owner: Some(caller.account.uuid),
        live: true,
        ..VmFilter::default()
    };
    let (mut limit, mut offset) = (MAX_PAGE, 0i64);
    let mut none = false;
    for (k, v) in query_pairs(uri.query())? {
        match k.as_str() {
            "name" => filter.alias = Some(v),
            "state" => {
                let states = shapes::states_named(&v).ok_or_else(|| {
                    invalid(
                        "state",
                        format!(
                            "{v:?} is not a machine state (provisioning, running, stopping, \
                             stopped, deleted, failed)"
                        ),
                    )
                })?;
                filter.state = states.first().copied();
                filter.live = filter.state != Some(VmState::Destroyed);
            }
            "image" => {
                filter.image = Some(
                    v.parse::<ImageId>()
                        .map_err(|_| invalid("image", format!("{v:?} is not an image uuid")))?,
                );
            }
            "memory" => {
                filter.memory_mib = Some(
                    v.parse()
                        .map_err(|_| invalid("memory", format!("{v:?} is not a number of MiB")))?,
                );
            }
            "brand" => none |= v != "kvm",
            "type" => none |= v != "virtualmachine",
            // No machine here is a Docker container.
            "docker" => none |= v == "true",
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_PAGE).contains(n))
                    .ok_or_else(|| invalid("limit", format!("must be 1 to {MAX_PAGE}")))?;
            }
            "offset" => {
                offset = v
                    .parse()
                    .ok()
                    .filter(|n: &i64| *n >= 0)
                    .ok_or_else(|| invalid("offset", "must be 0 or more"))?;
            }
            _ => {
                if let Some(key) = k.strip_prefix("tag.") {
                    if !passage_model::tags::key_ok(key) {
                        return Err(invalid(&k, "is not a tag name"));
                    }
                    filter
                        .tags
                        .push((key.to_string(), passage_model::tags::filter_texts(&v)));
                }
                // Other parameters (`credentials`, `sort`, the CLI's own) change nothing.
            }
        }
    }
    let items = if none {
        Vec::new()
    } else {
        vms::list(&ctx, &caller, filter, &PageReq::offset(limit, offset))
            .await?
            .items
    };
    let packages = packages(&ctx).await?;
    Ok(super::page(
        items.iter().map(|vm| machine(vm, &packages)).collect(),
    ))
}

/// `GET /:login/machines/:id`: 410 with the machine once it is deleted, as CloudAPI
/// answers (the CLI's `delete -w` waits for it).
pub async fn get(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw)): Path<(String, String)>,
) -> CloudResult<Response> {
    let vm = own_vm(&ctx, &caller, path_id(&raw, "vm")?).await?;
    let m = machine(&vm, &packages(&ctx).await?);
    let status = if vm.state == VmState::Destroyed {
        StatusCode::GONE
    } else {
        StatusCode::OK
    };
    Ok((status, Json(m)).into_response())
}

/// `GET /:login/machines/:id/tags`: the machine's tags (`triton instance tag list`).
pub async fn tags(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw)): Path<(String, String)>,
) -> CloudResult<Response> {
    let vm = own_vm(&ctx, &caller, path_id(&raw, "vm")?).await?;
    Ok(Json(vm.tags).into_response())
}

/// `GET /:login/machines/:id/tags/:key`: one tag's value (`triton instance tag get`).
pub async fn tag(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw, key)): Path<(String, String, String)>,
) -> CloudResult<Response> {
    let vm = own_vm(&ctx, &caller, path_id(&raw, "vm")?).await?;
    let v = vm
        .tags
        .get(&key)
        .cloned()
        .ok_or_else(|| CloudError(ApiError::not_found("tag")))?;
    Ok(Json(v).into_response())
}

/// A body's keys and values as tags (`triton instance tag set|replace-all` send a JSON
/// object whose values the CLI has already typed: strings, numbers, booleans).
fn tags_body(headers: &HeaderMap, body: &[u8]) -> CloudResult<passage_model::tags::Tags> {
    Ok(body_object(headers, body)?.into_iter().collect())
}

/// `POST /:login/machines/:id/tags` (AddMachineTags): sets the given tags, keeps the
/// others, and answers all of them.
pub async fn add_tags(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> CloudResult<Response> {
    let id: VmId = path_id(&raw, "vm")?;
    let tags = tags_body(&headers, &body)?;
    own_vm(&ctx, &caller, id).await?;
    let all = vm_labels::change_tags(&ctx, &caller, id, Change::Merge(tags)).await?;
    Ok(Json(all).into_response())
}

/// `PUT /:login/machines/:id/tags` (ReplaceMachineTags): these tags and no others.
pub async fn replace_tags(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> CloudResult<Response> {
    let id: VmId = path_id(&raw, "vm")?;
    let tags = tags_body(&headers, &body)?;
    own_vm(&ctx, &caller, id).await?;
    let all = vm_labels::change_tags(&ctx, &caller, id, Change::Replace(tags)).await?;
    Ok(Json(all).into_response())
}

/// `DELETE /:login/machines/:id/tags` (DeleteMachineTags): 204.
pub async fn delete_tags(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw)): Path<(String, String)>,
) -> CloudResult<StatusCode> {
    let id: VmId = path_id(&raw, "vm")?;
    own_vm(&ctx, &caller, id).await?;
    vm_labels::change_tags(&ctx, &caller, id, Change::DeleteAll).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `DELETE /:login/machines/:id/tags/:key` (DeleteMachineTag): 204, 404 if absent.
pub async fn delete_tag(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw, key)): Path<(String, String, String)>,
) -> CloudResult<StatusCode> {
    let id: VmId = path_id(&raw, "vm")?;
    own_vm(&ctx, &caller, id).await?;
    vm_labels::change_tags(&ctx, &caller, id, Change::Delete(key)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /:login/machines/:id/metadata` (ListMachineMetadata).
pub async fn list_metadata(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw)): Path<(String, String)>,
) -> CloudResult<Response> {
    let vm = own_vm(&ctx, &caller, path_id(&raw, "vm")?).await?;
    Ok(Json(vm.metadata).into_response())
}

/// `GET /:login/machines/:id/metadata/:key` (GetMachineMetadata): the value, a string.
pub async fn get_metadata(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw, key)): Path<(String, String, String)>,
) -> CloudResult<Response> {
    let vm = own_vm(&ctx, &caller, path_id(&raw, "vm")?).await?;
    let v = vm
        .metadata
        .get(&key)
        .cloned()
        .ok_or_else(|| CloudError(ApiError::not_found("metadata key")))?;
    Ok(Json(v).into_response())
}

/// `POST /:login/machines/:id/metadata` (UpdateMachineMetadata): sets the given keys
/// (values other than strings as their JSON text, as at creation), keeps the others, and
/// answers all of them.
pub async fn update_metadata(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> CloudResult<Response> {
    let id: VmId = path_id(&raw, "vm")?;
    let md: BTreeMap<String, String> = body_object(&headers, &body)?
        .into_iter()
        .map(|(k, v)| (k, as_text(v)))
        .collect();
    own_vm(&ctx, &caller, id).await?;
    let all = vm_labels::change_metadata(&ctx, &caller, id, Change::Merge(md)).await?;
    Ok(Json(all).into_response())
}

/// `DELETE /:login/machines/:id/metadata` (DeleteAllMachineMetadata): 204.
pub async fn delete_all_metadata(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw)): Path<(String, String)>,
) -> CloudResult<StatusCode> {
    let id: VmId = path_id(&raw, "vm")?;
    own_vm(&ctx, &caller, id).await?;
    vm_labels::change_metadata(&ctx, &caller, id, Change::DeleteAll).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `DELETE /:login/machines/:id/metadata/:key` (DeleteMachineMetadata): 204, 404 if
/// absent.
pub async fn delete_metadata(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw, key)): Path<(String, String, String)>,
) -> CloudResult<StatusCode> {
    let id: VmId = path_id(&raw, "vm")?;
    own_vm(&ctx, &caller, id).await?;
    vm_labels::change_metadata(&ctx, &caller, id, Change::Delete(key)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A metadata value as the guest gets it: strings as given, other values as JSON text.
fn as_text(v: Value) -> String {
    match v {
        Value::String(s) => s,
        other => other.to_string(),
    }
}

/// CreateMachine's body (JSON, or a form) as `/v1`'s creation.
fn create_request(body: serde_json::Map<String, Value>) -> CloudResult<CreateVm> {
    let mut name = None;
    let mut image = None;
    let mut package = None;
    let mut networks = None;
    let mut metadata = BTreeMap::new();
    let mut tags = passage_model::tags::Tags::new();
    let string = |k: &str, v: Value| match v {
        Value::String(s) => Ok(s),
        _ => Err(invalid(k, "must be a string")),
    };
    for (k, v) in body {
        match k.as_str() {
            "name" => name = Some(string(&k, v)?),
            "image" => image = Some(string(&k, v)?),
            "package" => package = Some(string(&k, v)?),
            "networks" => {
                let list = match v {
                    // A form gives them comma-separated.
                    Value::String(s) => s
                        .split(',')
                        .map(|n| Value::String(n.trim().to_string()))
                        .collect(),
                    Value::Array(a) => a,
                    _ => return Err(invalid("networks", "must be an array")),
                };
                let choices: Vec<NetworkChoice> = list
                    .into_iter()
                    .enumerate()
                    .map(|(i, n)| {
                        serde_json::from_value(n)
                            .map_err(|e| invalid(&format!("networks[{i}]"), e.to_string()))
                    })
                    .collect::<CloudResult<_>>()?;
                networks = Some(choices);
            }
            "metadata" | "tags" => {
                let Value::Object(o) = v else {
                    return Err(invalid(&k, "must be an object"));
                };
                for (mk, mv) in o {
                    if k == "tags" {
                        tags.insert(mk, mv);
                    } else {
                        metadata.insert(mk, as_text(mv));
                    }
                }
            }
            "firewall_enabled" | "deletion_protection" => {
                if v != Value::Bool(false) {
                    return Err(invalid(&k, "is not supported by Passage; leave it out"));
                }
            }
            _ => {
                if let Some(mk) = k.strip_prefix("metadata.") {
                    metadata.insert(mk.to_string(), as_text(v));
                } else if let Some(tk) = k.strip_prefix("tag.") {
                    tags.insert(tk.to_string(), v);
                } else {
                    return Err(invalid(
                        &k,
                        "is not a field Passage takes (name, image, package, networks, \
                         metadata.KEY, tag.KEY)",
                    ));
                }
            }
        }
    }
    let image = image.ok_or_else(|| invalid("image", "an image uuid is required"))?;
    let package = package.ok_or_else(|| invalid("package", "a package is required"))?;
    let alias = name.unwrap_or_else(passage_model::ids::made_up_alias);
    Ok(CreateVm {
        alias,
        package: Some(package),
        image: Some(image),
        owner_uuid: None,
        assigned_devices: None,
        server_uuid: None,
        vcpus: None,
        memory_mib: None,
        networks,
        metadata: (!metadata.is_empty()).then_some(metadata),
        tags: (!tags.is_empty()).then_some(tags),
        // Triton's CreateMachine has no such field: the machine gets all the account's keys.
        keys: None,
    })
}

/// `/v1` names the machine's name `alias`; a CloudAPI client gave `name`.
fn renamed(e: ApiError) -> CloudError {
    let field = e.field.as_deref().map(|f| {
        f.strip_prefix("alias")
            .map_or_else(|| f.to_string(), |rest| format!("name{rest}"))
    });
    let message = e.message.replace("alias", "name");
    CloudError(ApiError {
        field,
        message,
        ..e
    })
}

/// `POST /:login/machines`: 201 with the machine (still `provisioning`) and its
/// `Location`.
pub async fn create(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    headers: HeaderMap,
    body: Bytes,
) -> CloudResult<Response> {
    let req = create_request(body_object(&headers, &body)?)?;
    let vm = vms::create(&ctx, &caller, req).await.map_err(renamed)?;
    let m = machine(&vm, &packages(&ctx).await?);
    let mut r = (StatusCode::CREATED, Json(m)).into_response();
    let location = format!("/{}/machines/{}", caller.account.login, vm.uuid);
    if let Ok(v) = HeaderValue::from_str(&location) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    Ok(r)
}

/// `POST /:login/machines/:id` with `action` (`start`, `stop`, `reboot`) in a JSON or
/// form body, or in the query: 202 with no body.
pub async fn action(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw)): Path<(String, String)>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> CloudResult<StatusCode> {
    let id: VmId = path_id(&raw, "vm")?;
    let mut b = body_object(&headers, &body)?;
    let action = match b.remove("action") {
        Some(Value::String(a)) => Some(a),
        Some(_) => return Err(invalid("action", "must be a string")),
        None => query_pairs(uri.query())?
            .into_iter()
            .find(|(k, _)| k == "action")
            .map(|(_, v)| v),
    }
    .ok_or_else(|| invalid("action", "an action (start, stop, reboot) is required"))?;
    own_vm(&ctx, &caller, id).await?;
    match action.as_str() {
        "start" => vm_ops::start(&ctx, &caller, id).await?,
        "stop" => vm_ops::stop(&ctx, &caller, id, false).await?,
        "reboot" => vm_ops::reboot(&ctx, &caller, id, false).await?,
        other => {
            return Err(invalid(
                "action",
                format!("{other:?} is not supported (start, stop, reboot)"),
            ));
        }
    };
    Ok(StatusCode::ACCEPTED)
}

/// `DELETE /:login/machines/:id`: 204; the machine reads `deleted` (410) once its devices
/// are released for scrubbing.
pub async fn delete(
    State(ctx): State<Ctx>,
    Signed { caller }: Signed,
    Path((_, raw)): Path<(String, String)>,
) -> CloudResult<StatusCode> {
    let id: VmId = path_id(&raw, "vm")?;
    own_vm(&ctx, &caller, id).await?;
    vms::destroy(&ctx, &caller, id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> serde_json::Map<String, Value> {
        match v {
            Value::Object(o) => o,
            _ => serde_json::Map::new(),
        }
    }

    #[test]
    fn the_clis_create_body_becomes_a_creation() {
        // What `triton instance create -m foo=bar -m count=3 -t role=train --network A
        // --nic ipv4_uuid=B,ipv4_ips=10.10.0.50` sends.
        let req = create_request(body(json!({
            "name": "gpu2", "image": "img", "package": "pkg",
            "networks": ["a", {"ipv4_uuid": "b", "ipv4_ips": ["10.10.0.50"]}],
            "metadata.foo": "bar", "metadata.count": 3, "metadata.json": {"x": 1},
            "tag.role": "train", "tag.prod": true
        })))
        .unwrap();
        assert_eq!(req.alias, "gpu2");
        assert_eq!(req.networks.as_ref().map(Vec::len), Some(2));
        let md = req.metadata.unwrap();
        assert_eq!(md["foo"], "bar");
        assert_eq!(md["count"], "3");
        assert_eq!(md["json"], "{\"x\":1}");
        let tags = req.tags.unwrap();
        assert_eq!(tags["role"], json!("train"));
        assert_eq!(tags["prod"], json!(true));
    }

    #[test]
    fn a_name_is_made_when_none_is_given_and_unknown_fields_are_named() {
        let req = create_request(body(json!({"image": "i", "package": "p"}))).unwrap();
        assert_eq!(req.alias.len(), 8);
        assert!(req.alias.bytes().all(|b| b.is_ascii_hexdigit()));
        let e = create_request(body(json!({"image": "i", "package": "p", "affinity": []})))
            .unwrap_err();
        assert_eq!(e.0.field.as_deref(), Some("affinity"));
        let e = create_request(body(json!({"package": "p"}))).unwrap_err();
        assert_eq!(e.0.field.as_deref(), Some("image"));
        let e = create_request(body(json!({"image": "i", "package": "p", "name": 7}))).unwrap_err();
        assert_eq!(e.0.field.as_deref(), Some("name"));
        let e = create_request(body(
            json!({"image": "i", "package": "p", "firewall_enabled": true}),
        ))
        .unwrap_err();
        assert_eq!(e.0.field.as_deref(), Some("firewall_enabled"));
        // A form's networks are comma-separated.
        let req = create_request(body(
            json!({"image": "i", "package": "p", "networks": "a, b"}),
        ))
        .unwrap();
        assert_eq!(req.networks.map(|n| n.len()), Some(2));
    }
}
