//! HTTP Signature authentication as Triton's CloudAPI takes it: the `Authorization:
//! Signature keyId=…,algorithm=…,headers=…,signature=…` header (draft-cavage, as
//! `http-signature` 1.x writes it), over `(request-target)` and `date`, made with one of the
//! account's SSH keys named by its MD5 fingerprint.
//!
//! Everything here is pure: parsing the header, building the signing string, checking the
//! date and verifying the signature. Looking the key up is the caller's.

use base64::Engine;
use ssh_key::PublicKey;
use ssh_key::public::{EcdsaPublicKey, KeyData};

/// How far the `date` header may be from the server's clock, as CloudAPI allows.
pub const MAX_CLOCK_SKEW_SECS: i64 = 300;
/// Longer headers are not signatures any client makes (a 4096-bit RSA one is ~700 bytes).
const MAX_HEADER_LEN: usize = 4096;

/// Why a request's signature was not accepted. The client is told only that its
/// credentials are invalid (or why its header is malformed); the detail goes to the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the Authorization header is not an HTTP Signature: {0}")]
    Malformed(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Date(String),
    #[error("the signature does not verify with the key {0}")]
    BadSignature(String),
}

/// An `Authorization: Signature …` header, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignatureHeader {
    /// The account that signs, from `/LOGIN/keys/FP`.
    pub login: String,
    /// The key's MD5 fingerprint, colon-separated lower-case hex.
    pub md5_fingerprint: String,
    pub algorithm: Algorithm,
    /// The headers signed, in order, lower-case.
    pub headers: Vec<String>,
    pub signature: Vec<u8>,
}

/// A signature algorithm CloudAPI accepts (`lib/auth.js`), without DSA, which OpenSSH
/// dropped and no key Passage stores can be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    RsaSha1,
    RsaSha256,
    RsaSha512,
    EcdsaSha256,
    EcdsaSha384,
    EcdsaSha512,
    Ed25519Sha512,
}

impl Algorithm {
    pub fn parse(s: &str) -> Option<Algorithm> {
        Some(match s.to_ascii_lowercase().as_str() {
            "rsa-sha1" => Algorithm::RsaSha1,
            "rsa-sha256" => Algorithm::RsaSha256,
            "rsa-sha512" => Algorithm::RsaSha512,
            "ecdsa-sha256" => Algorithm::EcdsaSha256,
            "ecdsa-sha384" => Algorithm::EcdsaSha384,
            "ecdsa-sha512" => Algorithm::EcdsaSha512,
            "ed25519-sha512" => Algorithm::Ed25519Sha512,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::RsaSha1 => "rsa-sha1",
            Algorithm::RsaSha256 => "rsa-sha256",
            Algorithm::RsaSha512 => "rsa-sha512",
            Algorithm::EcdsaSha256 => "ecdsa-sha256",
            Algorithm::EcdsaSha384 => "ecdsa-sha384",
            Algorithm::EcdsaSha512 => "ecdsa-sha512",
            Algorithm::Ed25519Sha512 => "ed25519-sha512",
        }
    }
}

fn malformed(why: impl Into<String>) -> SignatureError {
    SignatureError::Malformed(why.into())
}

/// Parses the header's value. `keyId` must be `/LOGIN/keys/MD5`; a sub-user's
/// (`/LOGIN/users/USER/keys/…`) is refused, Passage having no sub-users.
pub fn parse(value: &str) -> Result<SignatureHeader, SignatureError> {
    if value.len() > MAX_HEADER_LEN {
        return Err(malformed("too long"));
    }
    let rest = value
        .strip_prefix("Signature ")
        .ok_or_else(|| malformed("it does not start with \"Signature \""))?;
    let mut key_id = None;
    let mut algorithm = None;
    let mut headers = None;
    let mut signature = None;
    for (k, v) in params(rest)? {
        let slot = match k.to_ascii_lowercase().as_str() {
            "keyid" => &mut key_id,
            "algorithm" => &mut algorithm,
            "headers" => &mut headers,
            "signature" => &mut signature,
            // Parameters a later draft added (`created`, `expires`) change nothing here.
            _ => continue,
        };
        if slot.replace(v).is_some() {
            return Err(malformed(format!("{k} is given twice")));
        }
    }
    let key_id = key_id.ok_or_else(|| malformed("keyId is missing"))?;
    let algorithm = algorithm.ok_or_else(|| malformed("algorithm is missing"))?;
    let signature = signature.ok_or_else(|| malformed("signature is missing"))?;
    let parts: Vec<&str> = key_id.split('/').collect();
    let (login, fp) = match parts.as_slice() {
        ["", login, "keys", fp] if !login.is_empty() => (*login, *fp),
        ["", _, "users", _, "keys", _] => {
            return Err(SignatureError::Unsupported(
                "sub-users (keyId /LOGIN/users/USER/keys/…) are not supported; sign as the account"
                    .into(),
            ));
        }
        _ => return Err(malformed("keyId is not /LOGIN/keys/FINGERPRINT")),
    };
    let md5_fingerprint = md5_fingerprint(fp)
        .ok_or_else(|| malformed("keyId's fingerprint is not an MD5 fingerprint"))?;
    let algorithm = Algorithm::parse(&algorithm).ok_or_else(|| {
        SignatureError::Unsupported(format!("the algorithm {algorithm:?} is not supported"))
    })?;
    // Without the parameter, draft-cavage signs the date alone.
    let headers: Vec<String> = headers
        .as_deref()
        .unwrap_or("date")
        .split_ascii_whitespace()
        .map(str::to_ascii_lowercase)
        .collect();
    let signature = base64::engine::general_purpose::STANDARD
        .decode(signature.as_bytes())
        .map_err(|_| malformed("signature is not base64"))?;
    Ok(SignatureHeader {
        login: login.to_string(),
        md5_fingerprint,
        algorithm,
        headers,
        signature,
    })
}

/// `k="v",k="v"` pairs; values may be quoted or not, with no escapes (none of the four
/// parameters can hold a quote).
fn params(s: &str) -> Result<Vec<(String, String)>, SignatureError> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let (k, after) = rest
            .split_once('=')
            .ok_or_else(|| malformed("a parameter has no value"))?;
        let k = k.trim();
        if k.is_empty() || !k.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(malformed(format!("{k:?} is not a parameter name")));
        }
        let after = after.trim_start();
        let (v, tail) = if let Some(q) = after.strip_prefix('"') {
            let end = q
                .find('"')
                .ok_or_else(|| malformed(format!("{k}'s value has no closing quote")))?;
            (&q[..end], &q[end + 1..])
        } else {
            match after.find(',') {
                Some(i) => (&after[..i], &after[i..]),
                None => (after, ""),
            }
        };
        out.push((k.to_string(), v.trim().to_string()));
        let tail = tail.trim_start();
        rest = match tail.strip_prefix(',') {
            Some(t) => t.trim_start(),
            None if tail.is_empty() => "",
            None => return Err(malformed("parameters must be separated by commas")),
        };
    }
    Ok(out)
}

/// `aa:bb:…` (16 bytes), optionally prefixed `MD5:`, in lower case; `None` otherwise.
fn md5_fingerprint(s: &str) -> Option<String> {
    let s = s.strip_prefix("MD5:").unwrap_or(s).to_ascii_lowercase();
    let ok = s.len() == 47
        && s.split(':')
            .all(|b| b.len() == 2 && b.bytes().all(|c| c.is_ascii_hexdigit()))
        && s.split(':').count() == 16;
    ok.then_some(s)
}

/// The string the client signed: each signed header on its own line, `(request-target)`
/// as the lower-case method and the path with its query as sent. Every header named must
/// be present, and `date` (or `x-date`) must be among them: an unsigned date would let a
/// signature be replayed forever.
pub fn signing_string(
    sig: &SignatureHeader,
    method: &str,
    path_and_query: &str,
    header: impl Fn(&str) -> Option<String>,
) -> Result<String, SignatureError> {
    if !sig.headers.iter().any(|h| h == "date" || h == "x-date") {
        return Err(malformed("the date header must be signed"));
    }
    let mut lines = Vec::with_capacity(sig.headers.len());
    for h in &sig.headers {
        if h == "(request-target)" {
            lines.push(format!(
                "(request-target): {} {path_and_query}",
                method.to_ascii_lowercase()
            ));
        } else {
            let v =
                header(h).ok_or_else(|| malformed(format!("the signed header {h} is missing")))?;
            lines.push(format!("{h}: {}", v.trim()));
        }
    }
    Ok(lines.join("\n"))
}

/// Checks an RFC 1123 date (`Tue, 24 Nov 2026 07:04:14 GMT`) against `now`.
pub fn check_date(date: &str, now: chrono::DateTime<chrono::Utc>) -> Result<(), SignatureError> {
    let at = chrono::DateTime::parse_from_rfc2822(date.trim())
        .map_err(|_| SignatureError::Date(format!("the date {date:?} is not an RFC 1123 date")))?;
    let skew = (now.timestamp() - at.timestamp()).abs();
    if skew > MAX_CLOCK_SKEW_SECS {
        return Err(SignatureError::Date(format!(
            "the date {date:?} is {skew} s from the server's clock; at most {MAX_CLOCK_SKEW_SECS} s is allowed"
        )));
    }
    Ok(())
}

/// Verifies `sig` over `message` with `key`, by the header's algorithm; the algorithm
/// must suit the key (an RSA signature for an RSA key, ECDSA with the curve's own hash
/// or a stronger one, Ed25519 for Ed25519).
pub fn verify(
    key: &PublicKey,
    sig: &SignatureHeader,
    message: &[u8],
) -> Result<(), SignatureError> {
    use signature::Verifier;
    let fail = || SignatureError::BadSignature(sig.md5_fingerprint.clone());
    let mismatch = || {
        SignatureError::Unsupported(format!(
            "the algorithm {} does not suit the key {}, a {} key",
            sig.algorithm.as_str(),
            sig.md5_fingerprint,
            key.algorithm()
        ))
    };
    match (key.key_data(), sig.algorithm) {
        (KeyData::Ed25519(k), Algorithm::Ed25519Sha512) => {
            let vk = ed25519_dalek::VerifyingKey::try_from(k).map_err(|_| fail())?;
            let s = ed25519_dalek::Signature::from_slice(&sig.signature).map_err(|_| fail())?;
            vk.verify(message, &s).map_err(|_| fail())
        }
        (KeyData::Rsa(k), alg) => {
            let pk = rsa::RsaPublicKey::try_from(k).map_err(|_| fail())?;
            let s =
                rsa::pkcs1v15::Signature::try_from(sig.signature.as_slice()).map_err(|_| fail())?;
            let ok = match alg {
                Algorithm::RsaSha1 => {
                    rsa::pkcs1v15::VerifyingKey::<sha1::Sha1>::new(pk).verify(message, &s)
                }
                Algorithm::RsaSha256 => {
                    rsa::pkcs1v15::VerifyingKey::<sha2::Sha256>::new(pk).verify(message, &s)
                }
                Algorithm::RsaSha512 => {
                    rsa::pkcs1v15::VerifyingKey::<sha2::Sha512>::new(pk).verify(message, &s)
                }
                _ => return Err(mismatch()),
            };
            ok.map_err(|_| fail())
        }
        (KeyData::Ecdsa(k), alg) => verify_ecdsa(k, alg, &sig.signature, message)
            .ok_or_else(mismatch)?
            .then_some(())
            .ok_or_else(fail),
        _ => Err(mismatch()),
    }
}

/// `None` when the algorithm does not suit the curve; else whether it verifies. The
/// signature is ASN.1 DER, as `http-signature` (through sshpk) writes it.
fn verify_ecdsa(k: &EcdsaPublicKey, alg: Algorithm, der: &[u8], message: &[u8]) -> Option<bool> {
    use sha2::Digest;
    use signature::hazmat::PrehashVerifier;
    let digest: Vec<u8> = match alg {
        Algorithm::EcdsaSha256 => sha2::Sha256::digest(message).to_vec(),
        Algorithm::EcdsaSha384 => sha2::Sha384::digest(message).to_vec(),
        Algorithm::EcdsaSha512 => sha2::Sha512::digest(message).to_vec(),
        _ => return None,
    };
    Some(match (k, alg) {
        (EcdsaPublicKey::NistP256(_), Algorithm::EcdsaSha256) => {
            let vk = p256::ecdsa::VerifyingKey::try_from(k).ok()?;
            p256::ecdsa::Signature::from_der(der)
                .is_ok_and(|s| vk.verify_prehash(&digest, &s).is_ok())
        }
        (EcdsaPublicKey::NistP384(_), Algorithm::EcdsaSha384) => {
            let vk = p384::ecdsa::VerifyingKey::try_from(k).ok()?;
            p384::ecdsa::Signature::from_der(der)
                .is_ok_and(|s| vk.verify_prehash(&digest, &s).is_ok())
        }
        (EcdsaPublicKey::NistP521(_), Algorithm::EcdsaSha512) => {
            let vk = p521::ecdsa::VerifyingKey::try_from(k).ok()?;
            p521::ecdsa::Signature::from_der(der)
                .is_ok_and(|s| vk.verify_prehash(&digest, &s).is_ok())
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::engine::general_purpose::STANDARD as B64;
    use rand::rngs::OsRng;
    use ssh_key::public::{Ed25519PublicKey, KeyData};

    const FP: &str = "11:d1:ac:12:e5:ed:db:87:3a:a5:2d:d3:b2:7c:e6:f5";

    fn header(alg: &str, sig: &[u8]) -> String {
        format!(
            "Signature keyId=\"/alice/keys/{FP}\",algorithm=\"{alg}\",\
             headers=\"(request-target) date\",signature=\"{}\"",
            B64.encode(sig)
        )
    }

    const DATE: &str = "Tue, 24 Nov 2026 07:04:14 GMT";

    fn message() -> Vec<u8> {
        format!("(request-target): get /alice/machines?limit=1000&offset=0\ndate: {DATE}")
            .into_bytes()
    }

    /// Signs the CLI's signing string with `sign`, then checks that the header parses,
    /// the string rebuilds, the signature verifies with `key`, and fails on another
    /// request.
    fn round_trip(key: &PublicKey, alg: &str, sign: impl Fn(&[u8]) -> Vec<u8>) {
        let h = parse(&header(alg, &sign(&message()))).unwrap();
        assert_eq!(h.login, "alice");
        assert_eq!(h.md5_fingerprint, FP);
        let m = signing_string(&h, "GET", "/alice/machines?limit=1000&offset=0", |n| {
            (n == "date").then(|| DATE.to_string())
        })
        .unwrap();
        assert_eq!(m.as_bytes(), message().as_slice());
        verify(key, &h, m.as_bytes()).unwrap_or_else(|e| panic!("{alg}: {e}"));
        let other = m.replace("offset=0", "offset=1000");
        assert!(
            matches!(
                verify(key, &h, other.as_bytes()),
                Err(SignatureError::BadSignature(_))
            ),
            "{alg}"
        );
    }

    #[test]
    fn ed25519_signatures_verify() {
        let sk = ed25519_dalek::SigningKey::generate(&mut OsRng);
        let key = PublicKey::from(KeyData::Ed25519(Ed25519PublicKey(
            sk.verifying_key().to_bytes(),
        )));
        round_trip(&key, "ed25519-sha512", |m| {
            use ed25519_dalek::Signer;
            sk.sign(m).to_bytes().to_vec()
        });
    }

    #[test]
    fn ecdsa_signatures_verify_on_each_curve_with_its_hash() {
        use signature::Signer;
        let sk = p256::ecdsa::SigningKey::random(&mut OsRng);
        let key = PublicKey::from(KeyData::Ecdsa(EcdsaPublicKey::from(sk.verifying_key())));
        round_trip(&key, "ecdsa-sha256", |m| {
            let s: p256::ecdsa::Signature = sk.sign(m);
            s.to_der().as_bytes().to_vec()
        });
        let sk = p384::ecdsa::SigningKey::random(&mut OsRng);
        let key = PublicKey::from(KeyData::Ecdsa(EcdsaPublicKey::from(sk.verifying_key())));
        round_trip(&key, "ecdsa-sha384", |m| {
            let s: p384::ecdsa::Signature = sk.sign(m);
            s.to_der().as_bytes().to_vec()
        });
        let sk = p521::ecdsa::SigningKey::random(&mut OsRng);
        let vk = p521::ecdsa::VerifyingKey::from(&sk);
        let key = PublicKey::from(KeyData::Ecdsa(EcdsaPublicKey::from(&vk)));
        round_trip(&key, "ecdsa-sha512", |m| {
            let s: p521::ecdsa::Signature = sk.sign(m);
            s.to_der().as_bytes().to_vec()
        });
        // A P-256 key's signature under another hash does not suit the key.
        let h = parse(&header("ecdsa-sha512", &[0x30, 0])).unwrap();
        let sk = p256::ecdsa::SigningKey::random(&mut OsRng);
        let key = PublicKey::from(KeyData::Ecdsa(EcdsaPublicKey::from(sk.verifying_key())));
        assert!(matches!(
            verify(&key, &h, &message()),
            Err(SignatureError::Unsupported(_))
        ));
    }

    #[test]
    fn rsa_signatures_verify_with_sha1_sha256_and_sha512() {
        use rsa::pkcs1::DecodeRsaPrivateKey;
        use rsa::signature::{SignatureEncoding, Signer};
        let sk = rsa::RsaPrivateKey::from_pkcs1_pem(RSA_PRIVATE).unwrap();
        let pk = ssh_key::public::RsaPublicKey::try_from(sk.to_public_key()).unwrap();
        let key = PublicKey::from(KeyData::Rsa(pk));
        round_trip(&key, "rsa-sha256", |m| {
            rsa::pkcs1v15::SigningKey::<sha2::Sha256>::new(sk.clone())
                .sign(m)
                .to_vec()
        });
        round_trip(&key, "rsa-sha512", |m| {
            rsa::pkcs1v15::SigningKey::<sha2::Sha512>::new(sk.clone())
                .sign(m)
                .to_vec()
        });
        round_trip(&key, "RSA-SHA1", |m| {
            rsa::pkcs1v15::SigningKey::<sha1::Sha1>::new(sk.clone())
                .sign(m)
                .to_vec()
        });
        // An ed25519 signature for an RSA key: refused, not tried.
        let h = parse(&header("ed25519-sha512", &[0; 64])).unwrap();
        assert!(matches!(
            verify(&key, &h, &message()),
            Err(SignatureError::Unsupported(_))
        ));
    }

    #[test]
    fn headers_that_are_not_signatures_are_refused_with_the_reason() {
        let good = header("ed25519-sha512", &[1; 64]);
        assert!(parse(&good).is_ok());
        let cases = [
            ("Bearer x", "Signature"),
            (
                "Signature keyId=\"/alice/keys/zz\",algorithm=\"rsa-sha256\",signature=\"AA==\"",
                "MD5",
            ),
            (
                "Signature keyId=\"alice\",algorithm=\"rsa-sha256\",signature=\"AA==\"",
                "keyId",
            ),
            (
                &format!("Signature keyId=\"/alice/keys/{FP}\",signature=\"AA==\""),
                "algorithm",
            ),
            (
                &format!(
                    "Signature keyId=\"/alice/keys/{FP}\",algorithm=\"dsa-sha1\",signature=\"AA==\""
                ),
                "not supported",
            ),
            (
                &format!(
                    "Signature keyId=\"/alice/keys/{FP}\",algorithm=\"rsa-sha256\",signature=\"!!\""
                ),
                "base64",
            ),
            (
                &format!(
                    "Signature keyId=\"/alice/keys/{FP}\",keyId=\"x\",algorithm=\"rsa-sha256\",signature=\"AA==\""
                ),
                "twice",
            ),
            (
                &format!("Signature keyId=\"/alice/keys/{FP},algorithm=rsa"),
                "quote",
            ),
            (
                &format!(
                    "Signature keyId=\"/alice/users/bob/keys/{FP}\",algorithm=\"rsa-sha256\",signature=\"AA==\""
                ),
                "sub-users",
            ),
        ];
        for (h, why) in cases {
            let e = parse(h).unwrap_err().to_string();
            assert!(e.contains(why), "{h}: {e}");
        }
        let long = format!("{good}{}", " ".repeat(MAX_HEADER_LEN));
        assert!(parse(&long).is_err());
        // The date must be signed, and every signed header present.
        let mut h = parse(&good).unwrap();
        h.headers = vec!["(request-target)".into()];
        assert!(signing_string(&h, "GET", "/", |_| None).is_err());
        h.headers = vec!["date".into(), "host".into()];
        let e = signing_string(&h, "GET", "/", |n| (n == "date").then(|| DATE.into()));
        assert!(e.unwrap_err().to_string().contains("host"));
    }

    #[test]
    fn the_date_must_be_within_five_minutes() {
        let at = chrono::DateTime::parse_from_rfc2822(DATE)
            .unwrap()
            .with_timezone(&chrono::Utc);
        assert!(check_date(DATE, at).is_ok());
        assert!(check_date(DATE, at + chrono::Duration::seconds(300)).is_ok());
        assert!(check_date(DATE, at - chrono::Duration::seconds(300)).is_ok());
        let e = check_date(DATE, at + chrono::Duration::seconds(301)).unwrap_err();
        assert!(e.to_string().contains("301 s"), "{e}");
        assert!(check_date("yesterday", at).is_err());
    }

    proptest::proptest! {
        #[test]
        fn no_header_makes_the_parser_panic(s in "\\PC{0,300}") {
            let _ = parse(&s);
            let _ = parse(&format!("Signature {s}"));
        }
    }

    // `openssl genrsa -traditional 2048`, for these tests only.
    const RSA_PRIVATE: &str = include_str!("testdata/rsa2048.pem");
}
