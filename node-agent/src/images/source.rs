//! Where image files come from: the control plane over HTTP in production, a local
//! directory in tests and development. The cache only asks for "the bytes of image X from
//! offset N" and checks every byte itself, so a source is trusted for nothing.

use crate::agent::{AgentClient, ClientError};
use async_trait::async_trait;
use bytes::Bytes;
use passage_model::images::Sha256;
use std::path::PathBuf;
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// A download that stalls this long without a byte is given up (and resumed later).
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
const CHUNK: usize = 1024 * 1024;

/// Why a fetch failed, and whether trying again (resuming) may help.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct FetchError {
    pub message: String,
    pub transient: bool,
}

impl FetchError {
    pub fn transient(message: impl Into<String>) -> Self {
        FetchError {
            message: message.into(),
            transient: true,
        }
    }

    pub fn permanent(message: impl Into<String>) -> Self {
        FetchError {
            message: message.into(),
            transient: false,
        }
    }
}

/// The bytes of one image from some offset on.
#[async_trait]
pub trait ImageBody: Send {
    /// Where these bytes start: the offset asked for, or 0 when the source ignored it.
    fn start(&self) -> u64;
    /// The next bytes; `None` at the end.
    async fn chunk(&mut self) -> Result<Option<Bytes>, FetchError>;
}

#[async_trait]
pub trait ImageSource: Send + Sync {
    /// Opens image `sha256` from byte `offset` on.
    async fn open(&self, sha256: &Sha256, offset: u64) -> Result<Box<dyn ImageBody>, FetchError>;
}

/// The control plane's `GET /agent/v1/images/{sha256}`, with the node's credential.
pub struct HttpSource {
    client: AgentClient,
}

impl HttpSource {
    pub fn new(client: AgentClient) -> Self {
        HttpSource { client }
    }
}

fn client_error(e: ClientError) -> FetchError {
    let transient = e.is_transient();
    let message = match e.status() {
        Some(404) => format!("the control plane has no such image file ({e})"),
        _ => e.to_string(),
    };
    FetchError { message, transient }
}

/// `Content-Range: bytes START-END/TOTAL` → START.
fn content_range_start(resp: &reqwest::Response) -> Option<u64> {
    let v = resp
        .headers()
        .get(reqwest::header::CONTENT_RANGE)?
        .to_str()
        .ok()?;
    let rest = v.trim().strip_prefix("bytes ")?;
    rest.split('-').next()?.trim().parse().ok()
}

struct HttpBody {
    resp: reqwest::Response,
    start: u64,
}

#[async_trait]
impl ImageBody for HttpBody {
    fn start(&self) -> u64 {
        self.start
    }

    async fn chunk(&mut self) -> Result<Option<Bytes>, FetchError> {
        match tokio::time::timeout(IDLE_TIMEOUT, self.resp.chunk()).await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(FetchError::transient(format!(
                "image download interrupted: {e}"
            ))),
            Err(_) => Err(FetchError::transient(format!(
                "image download stalled: no data for {}s",
                IDLE_TIMEOUT.as_secs()
            ))),
        }
    }
}

#[async_trait]
impl ImageSource for HttpSource {
    async fn open(&self, sha256: &Sha256, offset: u64) -> Result<Box<dyn ImageBody>, FetchError> {
        let resp = self
            .client
            .get_image(sha256, offset)
            .await
            .map_err(client_error)?;
        let start = if resp.status() == reqwest::StatusCode::PARTIAL_CONTENT {
            content_range_start(&resp).ok_or_else(|| {
                FetchError::transient(
                    "image download: a 206 answer without a readable Content-Range",
                )
            })?
        } else {
            0
        };
        Ok(Box::new(HttpBody { resp, start }))
    }
}

/// Image files named by their digest in a local directory (`DIR/<sha256>`): for tests
/// and for nodes that are handed images out of band.
pub struct DirSource {
    dir: PathBuf,
}

impl DirSource {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        DirSource { dir: dir.into() }
    }
}

struct FileBody {
    file: tokio::fs::File,
    start: u64,
}

#[async_trait]
impl ImageBody for FileBody {
    fn start(&self) -> u64 {
        self.start
    }

    async fn chunk(&mut self) -> Result<Option<Bytes>, FetchError> {
        let mut buf = vec![0u8; CHUNK];
        let n = self
            .file
            .read(&mut buf)
            .await
            .map_err(|e| FetchError::transient(format!("reading the image source: {e}")))?;
        if n == 0 {
            return Ok(None);
        }
        buf.truncate(n);
        Ok(Some(Bytes::from(buf)))
    }
}

#[async_trait]
impl ImageSource for DirSource {
    async fn open(&self, sha256: &Sha256, offset: u64) -> Result<Box<dyn ImageBody>, FetchError> {
        use tokio::io::AsyncSeekExt;
        let path = self.dir.join(sha256.as_str());
        let mut file = tokio::fs::File::open(&path)
            .await
            .map_err(|e| FetchError::permanent(format!("image source {}: {e}", path.display())))?;
        file.seek(std::io::SeekFrom::Start(offset))
            .await
            .map_err(|e| FetchError::transient(format!("image source {}: {e}", path.display())))?;
        Ok(Box::new(FileBody {
            file,
            start: offset,
        }))
    }
}
