//! Images: what a VM boots from. The catalog's API shapes (after Triton's IMGAPI) and the
//! two values the agent protocol shares with it: the file's SHA-256 and its format.

use serde::{Deserialize, Serialize};
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
    fn image_types_are_qemu_img_names() {
        assert_eq!(
            serde_json::to_string(&ImageType::Qcow2).unwrap(),
            "\"qcow2\""
        );
        assert_eq!("raw".parse::<ImageType>(), Ok(ImageType::Raw));
        assert!("vmdk".parse::<ImageType>().is_err());
    }
}
