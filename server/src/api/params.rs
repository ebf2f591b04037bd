//! The query parameters of the API's calls, one type per call: [`ApiQuery`] decodes the
//! query string into it and `#[utoipa::path(params(…))]` documents it, so the parser and
//! the OpenAPI document read the same type. What serde cannot say (a limit's range, a
//! cursor's format, a time's form) each type checks in one method, with the same words as
//! before.
//!
//! A list takes its paging ([`Paging`], or [`Keyset`] for lists read by cursor) and its
//! filters as two parameter types, each taken by its own [`ApiQuery`]: serde's `flatten`
//! would hand the inner type buffered strings, losing both the parsing of numbers and the
//! name of the parameter at fault, which a 400 must give.
//!
//! [`ApiQuery`]: super::extract::ApiQuery

use crate::error::{ApiError, ApiResult};
use crate::listing::{Cursor, DeviceFilter, MAX_CURSOR_LEN, PageReq, Start, VmFilter};
use chrono::{DateTime, Utc};
use passage_model::api::{JobState, MAX_LIST_LIMIT, ServerStatus, VmState};
use passage_model::{AccountId, DevicePath, DeviceState, ImageId, ServerId};
use serde::Deserialize;
use std::marker::PhantomData;
use utoipa::openapi::Required;
use utoipa::openapi::path::{Parameter, ParameterBuilder, ParameterIn};
use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};

/// `?limit=N&offset=N`: a page of a list by position, as Triton's CloudAPI takes them.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Paging {
    limit: Option<u32>,
    offset: Option<u32>,
}

impl Paging {
    /// (limit, offset); the limit is 1 to [`MAX_LIST_LIMIT`], [`MAX_LIST_LIMIT`] if absent.
    pub fn bounds(&self) -> ApiResult<(i64, i64)> {
        Ok((limit(self.limit)?, i64::from(self.offset.unwrap_or(0))))
    }
}

impl utoipa::IntoParams for Paging {
    fn into_params(_: impl Fn() -> Option<ParameterIn>) -> Vec<Parameter> {
        vec![limit_param(), offset_param("items to skip")]
    }
}

/// `?limit=N`, with `?after=CURSOR` (the `x-next-cursor` header of the previous page)
/// and `?offset=N`: the page of `limit` items that starts `offset` items after the
/// cursor, or after the list's start without one. `K` is the list's kind of cursor.
#[derive(Deserialize)]
#[serde(bound = "")]
pub struct Keyset<K> {
    limit: Option<u32>,
    offset: Option<u32>,
    after: Option<String>,
    #[serde(skip)]
    key: PhantomData<fn() -> K>,
}

impl<K: Cursor> Keyset<K> {
    /// The page asked for; a string that is not a cursor of this list answers 400 naming
    /// `after`.
    pub fn request(&self) -> ApiResult<PageReq<K>> {
        let limit = limit(self.limit)?;
        let offset = i64::from(self.offset.unwrap_or(0));
        let Some(raw) = &self.after else {
            return Ok(PageReq::offset(limit, offset));
        };
        let key = (raw.len() <= MAX_CURSOR_LEN)
            .then(|| K::decode(raw))
            .flatten()
            .ok_or_else(|| {
                ApiError::invalid(
                    "after",
                    "is not a cursor of this list (pass the x-next-cursor header of the \
                     previous page as it came)",
                )
            })?;
        Ok(PageReq {
            limit,
            start: Start::After(key, offset),
        })
    }
}

impl<K: Cursor> utoipa::IntoParams for Keyset<K> {
    fn into_params(_: impl Fn() -> Option<ParameterIn>) -> Vec<Parameter> {
        let after = ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some(K::PATTERN))
            .build();
        vec![
            limit_param(),
            offset_param("items to skip (after the cursor, with after)"),
            query_param(
                "after",
                "Start after this cursor: the x-next-cursor header of the previous page, \
                 passed as it came",
                after,
            ),
        ]
    }
}

fn limit(raw: Option<u32>) -> ApiResult<i64> {
    let limit = raw.unwrap_or(MAX_LIST_LIMIT);
    if limit == 0 || limit > MAX_LIST_LIMIT {
        return Err(ApiError::invalid(
            "limit",
            format!("must be 1 to {MAX_LIST_LIMIT}"),
        ));
    }
    Ok(i64::from(limit))
}

fn query_param(
    name: &str,
    description: &str,
    schema: impl Into<utoipa::openapi::RefOr<utoipa::openapi::Schema>>,
) -> Parameter {
    ParameterBuilder::new()
        .name(name)
        .parameter_in(ParameterIn::Query)
        .required(Required::False)
        .description(Some(description))
        .schema(Some(schema))
        .build()
}

fn limit_param() -> Parameter {
    query_param(
        "limit",
        &format!("1 to {MAX_LIST_LIMIT} (default {MAX_LIST_LIMIT})"),
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int32)))
            .minimum(Some(1))
            .maximum(Some(MAX_LIST_LIMIT))
            .build(),
    )
}

/// An offset is a `u32`: stated as a 64-bit integer with the `u32` bounds, since `int32`
/// would say the upper half is out of range.
fn offset_param(description: &str) -> Parameter {
    query_param(
        "offset",
        description,
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
            .minimum(Some(0))
            .maximum(Some(u32::MAX))
            .build(),
    )
}

/// `GET /v1/servers`.
#[derive(Clone, Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ServersQuery {
    /// Only servers with this status
    pub status: Option<ServerStatus>,
    /// true leaves out each server's sysinfo, assignable_devices and vms: device_counts is what a list screen needs
    pub brief: Option<bool>,
}

/// The longest `variant` filter taken: longer than any variant name, so that a list
/// filtered by one is never refused, yet short enough that no query plan has to care.
pub const MAX_VARIANT_FILTER_LEN: usize = 128;

/// `GET /v1/devices`.
#[derive(Clone, Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DevicesQuery {
    /// Only devices in this state
    pub state: Option<DeviceState>,
    /// Only devices of this variant
    #[param(max_length = 128)]
    pub variant: Option<String>,
    /// Only devices of this server
    #[param(value_type = Option<String>, format = Uuid)]
    pub server_uuid: Option<ServerId>,
}

impl DevicesQuery {
    pub fn filter(self) -> ApiResult<DeviceFilter> {
        if self
            .variant
            .as_ref()
            .is_some_and(|v| v.chars().count() > MAX_VARIANT_FILTER_LEN)
        {
            return Err(ApiError::invalid(
                "variant",
                format!("is at most {MAX_VARIANT_FILTER_LEN} characters"),
            ));
        }
        Ok(DeviceFilter {
            state: self.state,
            variant: self.variant,
            server: self.server_uuid,
        })
    }
}

/// The most events `?last=N` asks for.
pub const MAX_LAST_EVENTS: i64 = 1000;

/// `GET /v1/servers/{uuid}/device-events`.
#[derive(Clone, Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeviceEventsQuery {
    /// Only this device
    #[param(inline)]
    pub device: Option<DevicePath>,
    /// Only the newest N
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    pub last: Option<i64>,
}

impl DeviceEventsQuery {
    /// The newest N, 1 to [`MAX_LAST_EVENTS`].
    pub fn last(&self) -> ApiResult<Option<i64>> {
        match self.last {
            Some(n) if !(1..=MAX_LAST_EVENTS).contains(&n) => Err(ApiError::invalid(
                "last",
                format!("must be 1 to {MAX_LAST_EVENTS}"),
            )),
            other => Ok(other),
        }
    }
}

/// `GET /v1/servers/{uuid}/scrub-reports`.
#[derive(Clone, Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ScrubReportsQuery {
    /// Only this device
    #[param(inline)]
    pub device: Option<DevicePath>,
}

/// `GET /v1/vms`.
#[derive(Clone, Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct VmsQuery {
    /// Only VMs in this state
    pub state: Option<VmState>,
    /// Only this owner's
    #[param(value_type = Option<String>, format = Uuid)]
    pub owner_uuid: Option<AccountId>,
    /// Only on this server
    #[param(value_type = Option<String>, format = Uuid)]
    pub server_uuid: Option<ServerId>,
    /// Only VMs with this device
    #[param(inline)]
    pub assigned_device: Option<DevicePath>,
    /// Only VMs built from this image
    #[param(value_type = Option<String>, format = Uuid)]
    pub image_uuid: Option<ImageId>,
}

impl From<VmsQuery> for VmFilter {
    fn from(q: VmsQuery) -> Self {
        VmFilter {
            owner: q.owner_uuid,
            state: q.state,
            server: q.server_uuid,
            assigned_device: q.assigned_device.map(|d| d.to_string()),
            image: q.image_uuid,
            ..VmFilter::default()
        }
    }
}

/// `GET /v1/jobs`.
#[derive(Clone, Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct JobsQuery {
    /// Only jobs in this state
    pub state: Option<JobState>,
}

/// `GET /v1/usage`.
#[derive(Clone, Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct UsageQuery {
    /// Only this account (operators)
    #[param(value_type = Option<String>, format = Uuid)]
    pub owner_uuid: Option<AccountId>,
    /// RFC 3339 start (default 30 days ago)
    #[param(format = DateTime)]
    pub from: Option<String>,
    /// RFC 3339 end (default now)
    #[param(format = DateTime)]
    pub to: Option<String>,
}

impl UsageQuery {
    /// `from` as a time.
    pub fn start(&self) -> ApiResult<Option<DateTime<Utc>>> {
        rfc3339("from", self.from.as_deref())
    }

    /// `to` as a time.
    pub fn end(&self) -> ApiResult<Option<DateTime<Utc>>> {
        rfc3339("to", self.to.as_deref())
    }
}

/// RFC 3339 only, not the looser forms chrono's own parser takes.
fn rfc3339(field: &str, value: Option<&str>) -> ApiResult<Option<DateTime<Utc>>> {
    value
        .map(|v| {
            DateTime::parse_from_rfc3339(v)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|_| {
                    ApiError::invalid(field, "must be an RFC 3339 time, e.g. 2026-11-01T00:00:00Z")
                })
        })
        .transpose()
}

/// `GET /agent/v1/tasks` and `POST /agent/v1/tasks/{id}/result`: how long to wait for a
/// task, in seconds, and the later task kinds the node runs, by name, comma-separated
/// (`passage_model::protocol::TASKS_RUN`; the agent API is not in the document).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct TasksQuery {
    pub wait: Option<u64>,
    pub runs: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use utoipa::IntoParams;

    fn schema(params: &[Parameter], name: &str) -> serde_json::Value {
        let p = params
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no parameter {name}"));
        serde_json::to_value(&p.schema).unwrap_or_default()
    }

    /// Attributes take literals only: the bounds they state are those the checks apply.
    #[test]
    fn the_document_states_the_bounds_checked() {
        let devices = DevicesQuery::into_params(|| None);
        assert_eq!(
            schema(&devices, "variant")["maxLength"],
            MAX_VARIANT_FILTER_LEN
        );
        let events = DeviceEventsQuery::into_params(|| None);
        assert_eq!(schema(&events, "last")["minimum"], 1);
        assert_eq!(schema(&events, "last")["maximum"], MAX_LAST_EVENTS);
        let page = Paging::into_params(|| None);
        assert_eq!(schema(&page, "limit")["maximum"], MAX_LIST_LIMIT);
        assert_eq!(schema(&page, "offset")["maximum"], u32::MAX);
    }

    #[test]
    fn limits_and_cursors() {
        use crate::listing::TimeKey;
        let k = |limit, after: Option<&str>| Keyset::<TimeKey> {
            limit,
            offset: Some(2),
            after: after.map(String::from),
            key: PhantomData,
        };
        assert_eq!(k(None, None).request().unwrap().limit, 1000);
        assert_eq!(k(Some(1), None).request().unwrap().limit, 1);
        for bad in [0, 1001] {
            assert_eq!(
                k(Some(bad), None).request().unwrap_err().field.as_deref(),
                Some("limit")
            );
        }
        let cursor = "1.0f8e6a8c-3c64-4f7e-9b1a-2d7c1e0b5a44";
        assert!(matches!(
            k(None, Some(cursor)).request().unwrap().start,
            Start::After(_, 2)
        ));
        let long = format!("{}{cursor}", "1".repeat(MAX_CURSOR_LEN));
        for bad in ["", "x", long.as_str()] {
            assert_eq!(
                k(None, Some(bad)).request().unwrap_err().field.as_deref(),
                Some("after")
            );
        }
    }
}

/// `GET /v1/images`.
#[derive(Clone, Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ImagesQuery {
    /// Only images of this name
    pub name: Option<String>,
    /// Only this version
    pub version: Option<String>,
    /// Only images in this state
    pub state: Option<passage_model::images::ImageState>,
    /// Only images of this operating system
    pub os: Option<String>,
}

impl From<ImagesQuery> for crate::store::images::ImageFilter {
    fn from(q: ImagesQuery) -> Self {
        crate::store::images::ImageFilter {
            name: q.name,
            version: q.version,
            state: q.state,
            os: q.os,
            visible_to: None,
        }
    }
}
