//! https without a proxy: the certificate chain and key an operator gives (PEM), served
//! with rustls on the ring provider. SIGHUP reloads both, so a renewed certificate needs
//! no restart; a bad pair is refused and the one in use stays.

use axum_server::tls_rustls::RustlsConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where the certificate chain and its private key are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A PEM file bigger than this is not a certificate chain or a key.
const MAX_PEM_LEN: u64 = 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {detail}")]
    File { path: String, detail: String },
    #[error("{cert} and {key} do not make a usable pair: {detail}")]
    Pair {
        cert: String,
        key: String,
        detail: String,
    },
}

fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    let bad = |detail: String| TlsError::File {
        path: path.display().to_string(),
        detail,
    };
    let len = std::fs::metadata(path)
        .map_err(|e| bad(e.to_string()))?
        .len();
    if len > MAX_PEM_LEN {
        return Err(bad(format!("{len} bytes: more than {MAX_PEM_LEN}")));
    }
    std::fs::read(path).map_err(|e| bad(e.to_string()))
}

/// The rustls settings for `files`: TLS 1.2 and 1.3, HTTP/2 and HTTP/1.1 offered.
pub fn server_config(files: &TlsFiles) -> Result<rustls::ServerConfig, TlsError> {
    let cert_pem = read_pem(&files.cert)?;
    let key_pem = read_pem(&files.key)?;
    let bad_file = |path: &Path, detail: String| TlsError::File {
        path: path.display().to_string(),
        detail,
    };
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad_file(&files.cert, format!("not a PEM certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err(bad_file(&files.cert, "holds no certificate".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| bad_file(&files.key, format!("no PEM private key: {e}")))?;
    let pair = |detail: String| TlsError::Pair {
        cert: files.cert.display().to_string(),
        key: files.key.display().to_string(),
        detail,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| pair(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| pair(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// The settings axum-server serves with (and swaps on reload).
pub fn load(files: &TlsFiles) -> Result<RustlsConfig, TlsError> {
    Ok(RustlsConfig::from_config(Arc::new(server_config(files)?)))
}

/// On each SIGHUP, reads `files` again and serves new connections with them.
pub fn reload_on_hangup(files: TlsFiles, config: RustlsConfig) {
    #[cfg(unix)]
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            tracing::warn!("cannot watch for SIGHUP: the certificate reloads only on restart");
            return;
        };
        while hup.recv().await.is_some() {
            match server_config(&files) {
                Ok(c) => {
                    config.reload_from_config(Arc::new(c));
                    tracing::info!(cert = %files.cert.display(), "TLS certificate reloaded");
                }
                Err(e) => {
                    tracing::error!(error = %e, "TLS certificate not reloaded; the one in use stays");
                }
            }
        }
    });
    #[cfg(not(unix))]
    let _ = (files, config);
}
