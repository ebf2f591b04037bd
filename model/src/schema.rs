//! OpenAPI schemas of the types that travel as strings with a format of their own.

use crate::pci::{DevicePath, HexId, PciAddress, PciClass, Revision};
use std::borrow::Cow;
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};

fn string(pattern: &str, description: &str, example: &str, max: Option<usize>) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(pattern))
        .max_length(max)
        .description(Some(description))
        .examples([serde_json::Value::String(example.to_string())])
        .into()
}

macro_rules! string_schema {
    ($t:ty, $name:literal, $pattern:literal, $desc:literal, $example:literal) => {
        string_schema!($t, $name, $pattern, $desc, $example, None);
    };
    ($t:ty, $name:literal, $pattern:literal, $desc:literal, $example:literal, $max:expr) => {
        impl utoipa::PartialSchema for $t {
            fn schema() -> RefOr<Schema> {
                string($pattern, $desc, $example, $max)
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
    "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0",
    Some(crate::pci::MAX_DEVICE_PATH_LEN)
);

#[cfg(test)]
mod length_tests {
    use super::*;
    use utoipa::PartialSchema;

    /// The document states the parser's length limit, so a schema-valid path is never
    /// refused for its length alone (Schemathesis found one that was).
    #[test]
    fn device_paths_state_their_limit() {
        let doc = serde_json::to_value(DevicePath::schema()).unwrap_or_default();
        assert_eq!(doc["maxLength"], crate::pci::MAX_DEVICE_PATH_LEN);
        let mut long = String::from("/devices/pci0000:00");
        while long.len() <= crate::pci::MAX_DEVICE_PATH_LEN {
            long.push_str("/0000:00:00.0");
        }
        assert!(long.parse::<DevicePath>().is_err());
        long.truncate(long.len() - 13);
        assert!(long.len() <= crate::pci::MAX_DEVICE_PATH_LEN);
        assert!(long.parse::<DevicePath>().is_ok());
    }
}
