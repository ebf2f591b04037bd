//! OpenAPI schemas of the types that travel as strings with a format of their own.

use crate::pci::{DevicePath, HexId, PciAddress, PciClass, Revision};
use std::borrow::Cow;
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};

fn string(pattern: &str, description: &str, example: &str) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(pattern))
        .description(Some(description))
        .examples([serde_json::Value::String(example.to_string())])
        .into()
}

macro_rules! string_schema {
    ($t:ty, $name:literal, $pattern:literal, $desc:literal, $example:literal) => {
        impl utoipa::PartialSchema for $t {
            fn schema() -> RefOr<Schema> {
                string($pattern, $desc, $example)
            }
        }
        impl utoipa::ToSchema for $t {
            fn name() -> Cow<'static, str> {
                Cow::Borrowed($name)
            }
        }
    };
}

string_schema!(
    HexId,
    "HexId",
    "^[0-9a-f]{4}$",
    "A 16-bit PCI id as 4 hexadecimal digits",
    "10de"
);
string_schema!(
    Revision,
    "Revision",
    "^[0-9a-f]{2}$",
    "A PCI revision as 2 hexadecimal digits",
    "a1"
);
string_schema!(
    PciClass,
    "PciClass",
    "^[0-9a-f]{6}$",
    "A PCI class code as 6 hexadecimal digits",
    "030200"
);
string_schema!(
    PciAddress,
    "PciAddress",
    "^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-1][0-9a-f]\\.[0-7]$",
    "A PCI function address, domain:bus:device.function",
    "0000:3b:00.0"
);
string_schema!(
    DevicePath,
    "DevicePath",
    "^/devices/pci[0-9a-f]{4,8}:[0-9a-f]{2}(/[0-9a-f]{4,8}:[0-9a-f]{2}:[0-1][0-9a-f]\\.[0-7])+$",
    "A device's physical path under sysfs without the leading /sys",
    "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0"
);
