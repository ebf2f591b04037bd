//! Images: what a VM boots from. The catalog's API shapes (after Triton's IMGAPI) and the
//! two values the agent protocol shares with it: the file's SHA-256 and its format.

use crate::decode::BodyError;
use crate::ids::{AccountId, ImageId};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// A SHA-256 digest as 64 lowercase hex digits: the name an image file is stored under, on
/// the server (content-addressed) and in each node's cache.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(value_type = String, pattern = "^[0-9a-f]{64}$")]
#[serde(try_from = "String", into = "String")]
pub struct Sha256(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a SHA-256 digest is 64 hex digits")]
pub struct Sha256Error;

impl Sha256 {
    pub fn from_bytes(digest: &[u8; 32]) -> Self {
        let mut s = String::with_capacity(64);
        for b in digest {
            s.push_str(&format!("{b:02x}"));
        }
        Sha256(s)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for Sha256 {
    type Err = Sha256Error;
    /// Upper-case digits are accepted and kept lower-case, so one file has one name.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 64 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(Sha256Error);
        }
        Ok(Sha256(s.to_ascii_lowercase()))
    }
}

impl TryFrom<String> for Sha256 {
    type Error = Sha256Error;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Sha256> for String {
    fn from(s: Sha256) -> String {
        s.0
    }
}

impl fmt::Display for Sha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Sha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sha256({})", self.0)
    }
}

/// The format of an image file, as `qemu-img` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ImageType {
    Qcow2,
    Raw,
}

impl ImageType {
    pub fn as_str(self) -> &'static str {
        match self {
            ImageType::Qcow2 => "qcow2",
            ImageType::Raw => "raw",
        }
    }
}

impl fmt::Display for ImageType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ImageType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "qcow2" => Ok(ImageType::Qcow2),
            "raw" => Ok(ImageType::Raw),
            other => Err(format!("unknown image type {other:?} (qcow2 or raw)")),
        }
    }
}

/// Where an image is in its life: `unactivated` until its whole file is in and checked,
/// then `active`; `failed` when an uploaded file failed its checks (a new upload may
/// still make it active); `disabled` once deleted while VMs built from it remain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ImageState {
    Unactivated,
    Active,
    Failed,
    Disabled,
}

impl ImageState {
    pub fn as_str(self) -> &'static str {
        match self {
            ImageState::Unactivated => "unactivated",
            ImageState::Active => "active",
            ImageState::Failed => "failed",
            ImageState::Disabled => "disabled",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "unactivated" => ImageState::Unactivated,
            "active" => ImageState::Active,
            "failed" => ImageState::Failed,
            "disabled" => ImageState::Disabled,
            _ => return None,
        })
    }
}

/// What an image needs of the VM made from it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ImageRequirements {
    /// The smallest boot disk (a package's `disk_gib`) the image fits on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(maximum = 1048576)]
    pub min_disk_gib: Option<u64>,
    /// The firmware the image boots with (IMGAPI's `requirements.bootrom`); absent: the
    /// node's default for the VM ([`Bootrom::for_vm`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootrom: Option<Bootrom>,
}

/// A VM's firmware: OVMF's UEFI, or SeaBIOS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Bootrom {
    Uefi,
    Bios,
}

impl Bootrom {
    pub fn as_str(self) -> &'static str {
        match self {
            Bootrom::Uefi => "uefi",
            Bootrom::Bios => "bios",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "uefi" => Some(Bootrom::Uefi),
            "bios" => Some(Bootrom::Bios),
            _ => None,
        }
    }

    /// What a VM boots with: what its image requires, else UEFI for a VM with passed
    /// devices (a GPU's 64-bit BARs need firmware that maps them above 4 GiB, which
    /// SeaBIOS does not do for BARs this large) and BIOS for one without.
    pub fn for_vm(image: Option<Bootrom>, has_devices: bool) -> Self {
        image.unwrap_or(if has_devices {
            Bootrom::Uefi
        } else {
            Bootrom::Bios
        })
    }
}

impl std::fmt::Display for Bootrom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An image of the catalog, after Triton's IMGAPI.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Image {
    pub uuid: ImageId,
    pub name: String,
    pub version: String,
    pub os: String,
    #[serde(rename = "type")]
    pub image_type: ImageType,
    pub description: Option<String>,
    pub state: ImageState,
    pub public: bool,
    pub owner_uuid: AccountId,
    /// When its file was checked and it became active.
    pub published_at: Option<DateTime<Utc>>,
    /// The file's size in bytes, once uploaded.
    pub size: Option<u64>,
    pub sha256: Option<Sha256>,
    pub tags: BTreeMap<String, String>,
    pub requirements: ImageRequirements,
    pub created_at: DateTime<Utc>,
    /// Operators and readers only: how many VMs not yet destroyed were built from it.
    /// Absent for tenants, whom other tenants' VMs are no business of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_count: Option<u64>,
}

/// An image's name and version, in characters.
pub const MAX_IMAGE_NAME_LEN: usize = 128;
pub const MAX_IMAGE_VERSION_LEN: usize = 64;
pub const MAX_IMAGE_OS_LEN: usize = 64;
pub const MAX_IMAGE_DESCRIPTION_LEN: usize = 1024;
pub const MAX_IMAGE_TAGS: usize = 32;
pub const MAX_IMAGE_TAG_LEN: usize = 256;
pub const MAX_MIN_DISK_GIB: u64 = 1024 * 1024;

/// Name characters: letters, digits, `_ - .`; no `@` (it separates `name@version`).
fn check_word(field: &str, v: &str, max: usize) -> Result<(), BodyError> {
    let ok = !v.is_empty()
        && v.len() <= max
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if !ok {
        return Err(BodyError::new(
            field,
            format!("must be 1 to {max} characters of A-Z, a-z, 0-9, '_', '-', '.'"),
        ));
    }
    Ok(())
}

fn check_description(d: Option<&str>) -> Result<(), BodyError> {
    if let Some(d) = d
        && (d.chars().count() > MAX_IMAGE_DESCRIPTION_LEN || d.contains('\0'))
    {
        return Err(BodyError::new(
            "description",
            format!("at most {MAX_IMAGE_DESCRIPTION_LEN} characters"),
        ));
    }
    Ok(())
}

fn check_tags(tags: &BTreeMap<String, String>) -> Result<(), BodyError> {
    if tags.len() > MAX_IMAGE_TAGS {
        return Err(BodyError::new(
            "tags",
            format!("at most {MAX_IMAGE_TAGS} tags"),
        ));
    }
    for (k, v) in tags {
        check_word(&format!("tags.{k}"), k, MAX_IMAGE_TAG_LEN)?;
        if v.chars().count() > MAX_IMAGE_TAG_LEN || v.chars().any(char::is_control) {
            return Err(BodyError::new(
                format!("tags.{k}"),
                format!("at most {MAX_IMAGE_TAG_LEN} printable characters"),
            ));
        }
    }
    Ok(())
}

fn check_requirements(r: &ImageRequirements) -> Result<(), BodyError> {
    if r.min_disk_gib.is_some_and(|g| g > MAX_MIN_DISK_GIB) {
        return Err(BodyError::new(
            "requirements.min_disk_gib",
            format!("must be at most {MAX_MIN_DISK_GIB}"),
        ));
    }
    Ok(())
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateImage {
    #[schema(min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9_.-]+$")]
    pub name: String,
    #[schema(min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9_.-]+$")]
    pub version: String,
    #[schema(min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9_.-]+$")]
    pub os: String,
    #[serde(rename = "type")]
    pub image_type: ImageType,
    #[serde(default)]
    #[schema(max_length = 1024)]
    pub description: Option<String>,
    /// Public images are offered to every tenant; others only to their owner.
    #[serde(default)]
    pub public: bool,
    /// Operators only: the owning account (default: the caller).
    #[serde(default)]
    pub owner_uuid: Option<AccountId>,
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    #[serde(default)]
    pub requirements: ImageRequirements,
}

impl CreateImage {
    /// The first field out of bounds, if any.
    pub fn validate(&self) -> Result<(), BodyError> {
        check_word("name", &self.name, MAX_IMAGE_NAME_LEN)?;
        if self.name.parse::<uuid::Uuid>().is_ok() {
            return Err(BodyError::new(
                "name",
                "must not be a uuid (images are looked up by uuid or name)",
            ));
        }
        check_word("version", &self.version, MAX_IMAGE_VERSION_LEN)?;
        check_word("os", &self.os, MAX_IMAGE_OS_LEN)?;
        check_description(self.description.as_deref())?;
        check_tags(&self.tags)?;
        check_requirements(&self.requirements)
    }
}

/// What may change after creation; the file, its type and its identity do not.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateImage {
    #[serde(default)]
    #[schema(max_length = 1024)]
    pub description: Option<String>,
    #[serde(default)]
    pub public: Option<bool>,
    /// Replaces all tags.
    #[serde(default)]
    pub tags: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub requirements: Option<ImageRequirements>,
}

impl UpdateImage {
    /// The first field out of bounds, if any.
    pub fn validate(&self) -> Result<(), BodyError> {
        check_description(self.description.as_deref())?;
        if let Some(t) = &self.tags {
            check_tags(t)?;
        }
        if let Some(r) = &self.requirements {
            check_requirements(r)?;
        }
        Ok(())
    }
}

/// `name`, or `name@version`, as `POST /v1/vms` takes an image (a uuid is tried first).
pub fn split_image_key(key: &str) -> (&str, Option<&str>) {
    match key.split_once('@') {
        Some((n, v)) => (n, Some(v)),
        None => (key, None),
    }
}

/// Checks the start of an image file against its declared type: a qcow2 file begins with
/// `QFI\xfb` and a big-endian version 2 or 3; a raw file may be anything but empty or a
/// qcow2 file (which a raw boot disk would expose to the guest as its header). `head` is
/// the first bytes of the file (at least 8 when the file has them); `size` its length.
pub fn check_format(image_type: ImageType, head: &[u8], size: u64) -> Result<(), String> {
    const MAGIC: &[u8; 4] = b"QFI\xfb";
    let is_qcow2 = head.len() >= 4 && &head[..4] == MAGIC;
    match image_type {
        ImageType::Qcow2 => {
            if !is_qcow2 {
                return Err("not a qcow2 file (no QFI\\xfb magic)".into());
            }
            let version = head
                .get(4..8)
                .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
            match version {
                Some(2 | 3) => Ok(()),
                Some(v) => Err(format!("qcow2 version {v} (2 or 3 expected)")),
                None => Err("qcow2 header cut short".into()),
            }
        }
        ImageType::Raw => {
            if size == 0 {
                return Err("an empty file is no disk image".into());
            }
            if is_qcow2 {
                return Err("this file is qcow2, not raw".into());
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_64_hex_digits_kept_lower_case() {
        let d: Sha256 = "AB".repeat(32).parse().unwrap();
        assert_eq!(d.as_str(), "ab".repeat(32));
        assert_eq!(Sha256::from_bytes(&[0xab; 32]), d);
        for bad in [
            "",
            "ab",
            &"g".repeat(64),
            &"a".repeat(65),
            "../../etc/passwd",
        ] {
            assert!(bad.parse::<Sha256>().is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<Sha256>("\"../x\"").is_err());
        assert_eq!(
            serde_json::to_string(&d).unwrap(),
            format!("\"{}\"", "ab".repeat(32))
        );
    }

    #[test]
    fn formats_are_checked_by_their_header() {
        let q3 = b"QFI\xfb\0\0\0\x03rest";
        assert!(check_format(ImageType::Qcow2, q3, 100).is_ok());
        assert!(check_format(ImageType::Qcow2, b"QFI\xfb\0\0\0\x09", 100).is_err());
        assert!(check_format(ImageType::Qcow2, b"QFI", 3).is_err());
        assert!(check_format(ImageType::Qcow2, b"\0\0\0\0\0\0\0\0", 8).is_err());
        assert!(check_format(ImageType::Raw, q3, 100).is_err());
        assert!(check_format(ImageType::Raw, b"", 0).is_err());
        assert!(check_format(ImageType::Raw, b"\0\0", 2).is_ok());
    }

    #[test]
    fn create_image_bounds() {
        let ok: CreateImage = serde_json::from_value(serde_json::json!(
            {"name":"debian","version":"12.1","os":"linux","type":"qcow2"}))
        .unwrap();
        assert!(ok.validate().is_ok());
        let mut bad = ok.clone();
        bad.name = "a@b".into();
        assert_eq!(bad.validate().unwrap_err().field, "name");
        let mut bad = ok.clone();
        bad.requirements.min_disk_gib = Some(MAX_MIN_DISK_GIB + 1);
        assert_eq!(
            bad.validate().unwrap_err().field,
            "requirements.min_disk_gib"
        );
        assert_eq!(split_image_key("debian@12"), ("debian", Some("12")));
    }

    #[test]
    fn bootrom_is_uefi_or_bios_named_by_its_path() {
        let body = br#"{"name":"d","version":"1","os":"linux","type":"raw",
                        "requirements":{"bootrom":"uefi"}}"#;
        let ok: CreateImage = crate::decode::json_object(body).unwrap();
        assert_eq!(ok.requirements.bootrom, Some(Bootrom::Uefi));
        for bad in [r#""efi""#, r#""BIOS""#, "1", "[]"] {
            let body = format!(r#"{{"requirements":{{"bootrom":{bad}}}}}"#);
            let e = crate::decode::json_object::<UpdateImage>(body.as_bytes()).unwrap_err();
            assert_eq!(e.field, "requirements.bootrom", "{bad}: {e}");
        }
        for b in [Bootrom::Uefi, Bootrom::Bios] {
            assert_eq!(Bootrom::parse(b.as_str()), Some(b));
        }
        assert_eq!(Bootrom::for_vm(None, true), Bootrom::Uefi);
        assert_eq!(Bootrom::for_vm(None, false), Bootrom::Bios);
        assert_eq!(Bootrom::for_vm(Some(Bootrom::Bios), true), Bootrom::Bios);
        assert_eq!(Bootrom::for_vm(Some(Bootrom::Uefi), false), Bootrom::Uefi);
    }

    #[test]
    fn image_types_are_qemu_img_names() {
        assert_eq!(
            serde_json::to_string(&ImageType::Qcow2).unwrap(),
            "\"qcow2\""
        );
        assert_eq!("raw".parse::<ImageType>(), Ok(ImageType::Raw));
        assert!("vmdk".parse::<ImageType>().is_err());
    }
}
