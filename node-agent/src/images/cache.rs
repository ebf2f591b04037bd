//! The node's image cache: `STATE/images/<sha256>`, each file checked against its digest
//! before it gets its name.
//!
//! - **Download**: into `<sha256>.part`, hashed on the way; only a whole file whose size
//!   and SHA-256 match is fsynced and renamed to `<sha256>`. An interrupted download
//!   keeps its `.part` and resumes with `Range: bytes=N-` (the bytes already there are
//!   hashed first), within one task (a few retries) and across tasks and agent restarts.
//! - **Corruption**: `<sha256>.json` (the sidecar) records the file's size and mtime when
//!   its digest was last checked. On use, a file whose size or mtime differs from the
//!   sidecar (or that has none) is hashed again; a mismatch deletes it and fetches it
//!   anew. A change that keeps both size and mtime (bit rot under the file system) is
//!   not caught here: that is the file system's checksumming to catch.
//! - **Single flight**: one async lock per digest; a second fetch of an image waits for
//!   the first and then finds it cached.
//! - **Budget**: before a download, least-recently-used images no VM on this node uses
//!   (no disk overlay is built on them) and nobody is fetching are deleted until the new
//!   one fits. Images in use are never deleted: over budget, the download goes on with a
//!   warning, as refusing would fail a VM for want of space some other VM holds.

use super::sink::HashingSink;
use super::source::{FetchError, ImageSource};
use crate::state::{read_json, write_json};
use passage_model::images::Sha256;
use passage_model::protocol::{ImageRef, TaskProgress};
use serde::{Deserialize, Serialize};
use sha2::Digest;
use std::collections::{HashMap, HashSet};
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

pub const GIB: u64 = 1024 * 1024 * 1024;
/// Tries per fetch; each resumes where the last stopped.
const ATTEMPTS: u32 = 5;
const FIRST_RETRY: Duration = Duration::from_millis(500);
/// Progress is published at most this often (the agent posts what it sees).
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image {sha256}: {message}")]
    Fetch { sha256: Sha256, message: String },
    #[error("image cache {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("boot disk: {0}")]
    Disk(String),
    #[error("background work failed: {0}")]
    Join(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What the cache knows of one file: its digest was checked when it had this size and
/// mtime; when it was last used (for eviction).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Sidecar {
    size: u64,
    mtime_ns: u128,
    last_used_ms: u128,
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

fn mtime_ns(meta: &fs::Metadata) -> u128 {
    meta.modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Which images VMs on this node use; the cache never evicts those.
pub type InUse = Arc<dyn Fn() -> HashSet<Sha256> + Send + Sync>;

pub struct ImageCache {
    dir: PathBuf,
    budget: u64,
    in_use: InUse,
    flights: Mutex<HashMap<Sha256, Arc<tokio::sync::Mutex<()>>>>,
}

/// Held while one image is fetched or built on: no other fetch of it runs, and eviction
/// leaves it alone.
pub struct FlightGuard<'a> {
    cache: &'a ImageCache,
    sha256: Sha256,
    lock: Arc<tokio::sync::Mutex<()>>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for FlightGuard<'_> {
    fn drop(&mut self) {
        self.guard.take();
        let mut flights = self.cache.flights();
        // The map's reference and ours: nobody else waits, so the entry can go.
        if Arc::strong_count(&self.lock) == 2 {
            flights.remove(&self.sha256);
        }
    }
}

impl ImageCache {
    /// A cache in `dir` holding at most `budget` bytes of images nobody uses.
    pub fn new(dir: impl Into<PathBuf>, budget: u64, in_use: InUse) -> Self {
        ImageCache {
            dir: dir.into(),
            budget,
            in_use,
            flights: Mutex::new(HashMap::new()),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where image `sha256` lives once cached.
    pub fn path(&self, sha256: &Sha256) -> PathBuf {
        self.dir.join(sha256.as_str())
    }

    fn part_path(&self, sha256: &Sha256) -> PathBuf {
        self.dir.join(format!("{sha256}.part"))
    }

    fn sidecar_path(&self, sha256: &Sha256) -> PathBuf {
        self.dir.join(format!("{sha256}.json"))
    }

    fn flights(&self) -> std::sync::MutexGuard<'_, HashMap<Sha256, Arc<tokio::sync::Mutex<()>>>> {
        self.flights.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for any other fetch of `sha256` and holds it off until the guard drops.
    pub async fn lock(&self, sha256: &Sha256) -> FlightGuard<'_> {
        let lock = self.flights().entry(sha256.clone()).or_default().clone();
        let guard = lock.clone().lock_owned().await;
        FlightGuard {
            cache: self,
            sha256: sha256.clone(),
            lock,
            guard: Some(guard),
        }
    }

    /// Brings `image` into the cache (unless it is there and whole) and answers its path.
    /// `progress` gets `done` of `total` bytes while a download runs.
    pub async fn ensure(
        &self,
        image: &ImageRef,
        source: &dyn ImageSource,
        progress: &watch::Sender<TaskProgress>,
    ) -> Result<PathBuf, ImageError> {
        let _flight = self.lock(&image.sha256).await;
        self.ensure_locked(image, source, progress).await
    }

    /// [`ensure`](Self::ensure) for a caller that already holds the image's
    /// [`lock`](Self::lock) (to build a disk on it before eviction may see it unused).
    pub async fn ensure_locked(
        &self,
        image: &ImageRef,
        source: &dyn ImageSource,
        progress: &watch::Sender<TaskProgress>,
    ) -> Result<PathBuf, ImageError> {
        let dir = self.dir.clone();
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(io_err(&dir))?;
        let path = self.path(&image.sha256);
        let (p, side, img) = (
            path.clone(),
            self.sidecar_path(&image.sha256),
            image.clone(),
        );
        let present = tokio::task::spawn_blocking(move || check_cached(&p, &side, &img))
            .await
            .map_err(|e| ImageError::Join(e.to_string()))??;
        if present {
            tracing::info!(image = %image.sha256, "image already in the cache: nothing fetched");
            progress.send_replace(TaskProgress {
                done: image.size,
                total: image.size,
            });
            return Ok(path);
        }
        self.make_room(image).await?;
        let mut delay = FIRST_RETRY;
        let mut attempt = 1;
        loop {
            match self.download(image, source, progress).await {
                Ok(()) => break,
                Err(Failure::Io(e)) => return Err(e),
                Err(Failure::Fetch(e)) if !e.transient || attempt >= ATTEMPTS => {
                    return Err(ImageError::Fetch {
                        sha256: image.sha256.clone(),
                        message: e.message,
                    });
                }
                Err(Failure::Fetch(e)) => {
                    tracing::warn!(image = %image.sha256, attempt, error = %e, "image download failed; resuming");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                    attempt += 1;
                }
            }
        }
        Ok(path)
    }

    /// One download attempt, resuming from the `.part` file.
    async fn download(
        &self,
        image: &ImageRef,
        source: &dyn ImageSource,
        progress: &watch::Sender<TaskProgress>,
    ) -> Result<(), Failure> {
        let started = Instant::now();
        let part = self.part_path(&image.sha256);
        let (p, size) = (part.clone(), image.size);
        let (mut have, mut hasher) = tokio::task::spawn_blocking(move || hash_partial(&p, size))
            .await
            .map_err(|e| Failure::Io(ImageError::Join(e.to_string())))?
            .map_err(|e| Failure::Io(io_err(&part)(e)))?;
        let resumed_from = have;
        // A whole `.part` (an agent stopped between the last byte and the rename) needs
        // no request: a server would answer `bytes=SIZE-` with 416.
        let mut body = if have < image.size {
            let b = source
                .open(&image.sha256, have)
                .await
                .map_err(Failure::Fetch)?;
            if b.start() != have {
                if b.start() != 0 {
                    return Err(Failure::Fetch(FetchError::transient(format!(
                        "asked for bytes from {have}, got bytes from {}",
                        b.start()
                    ))));
                }
                // The source ignored the range: start over.
                have = 0;
                hasher = sha2::Sha256::new();
            }
            Some(b)
        } else {
            None
        };
        let mut file = tokio::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .open(&part)
            .await
            .map_err(|e| Failure::Io(io_err(&part)(e)))?;
        file.set_len(have)
            .await
            .map_err(|e| Failure::Io(io_err(&part)(e)))?;
        {
            use tokio::io::AsyncSeekExt;
            file.seek(std::io::SeekFrom::Start(have))
                .await
                .map_err(|e| Failure::Io(io_err(&part)(e)))?;
        }
        let total = image.size;
        let mut last_progress = Instant::now();
        progress.send_replace(TaskProgress { done: have, total });
        let mut received = Ok(());
        let mut sink = HashingSink::start(file.into_std().await, hasher);
        let mut too_much = false;
        while let Some(b) = body.as_mut() {
            let chunk = match b.chunk().await {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) => {
                    received = Err(e);
                    break;
                }
            };
            if have + chunk.len() as u64 > total {
                too_much = true;
                break;
            }
            let n = chunk.len() as u64;
            if sink.push(chunk).await.is_err() {
                // The writer stopped: `finish` says why.
                break;
            }
            have += n;
            if last_progress.elapsed() >= PROGRESS_EVERY {
                progress.send_replace(TaskProgress { done: have, total });
                last_progress = Instant::now();
            }
        }
        // What arrived is kept (written) for the next attempt, even after an error.
        let (file, hasher) = sink
            .finish()
            .await
            .map_err(|e| Failure::Io(io_err(&part)(e)))?;
        if too_much {
            drop(file);
            let _ = tokio::fs::remove_file(&part).await;
            return Err(Failure::Fetch(FetchError::transient(format!(
                "the source sent more than the image's {total} bytes"
            ))));
        }
        received.map_err(Failure::Fetch)?;
        if have < total {
            return Err(Failure::Fetch(FetchError::transient(format!(
                "the download ended at {have} of {total} bytes"
            ))));
        }
        let digest = Sha256::from_bytes(&hasher.finalize().into());
        if digest != image.sha256 {
            drop(file);
            let _ = tokio::fs::remove_file(&part).await;
            let message = format!("the downloaded file's SHA-256 is {digest}, not the image's");
            // After a resume the bytes kept from before may be what is wrong: one more
            // try, from scratch. A download in one go is not retried: TCP (and TLS) make
            // damage on the way unlikely, so the source itself holds other bytes.
            return Err(Failure::Fetch(if resumed_from > 0 {
                FetchError::transient(message)
            } else {
                FetchError::permanent(message)
            }));
        }
        let synced = tokio::task::spawn_blocking(move || file.sync_all())
            .await
            .map_err(|e| Failure::Io(ImageError::Join(e.to_string())))?;
        synced.map_err(|e| Failure::Io(io_err(&part)(e)))?;
        let (final_path, side, dir) = (
            self.path(&image.sha256),
            self.sidecar_path(&image.sha256),
            self.dir.clone(),
        );
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            fs::rename(&part, &final_path)?;
            record_checked(&final_path, &side)?;
            sync_dir(&dir);
            Ok(())
        })
        .await
        .map_err(|e| Failure::Io(ImageError::Join(e.to_string())))?
        .map_err(|e| Failure::Io(io_err(&self.dir)(e)))?;
        progress.send_replace(TaskProgress { done: total, total });
        // The whole attempt: request, hashing, writing, fsync and rename (what `cargo
        // xtask bench images` sets beside `cp`).
        let secs = started.elapsed().as_secs_f64();
        tracing::info!(
            image = %image.sha256,
            bytes = total - resumed_from,
            resumed_from,
            elapsed_ms = (secs * 1000.0).round() as u64,
            mib_per_s = ((total - resumed_from) as f64 / (1024.0 * 1024.0) / secs.max(1e-9)).round() as u64,
            "image downloaded and verified"
        );
        Ok(())
    }

    /// Deletes least-recently-used images nobody uses until `image` fits the budget.
    async fn make_room(&self, image: &ImageRef) -> Result<(), ImageError> {
        let busy: HashSet<Sha256> = self.flights().keys().cloned().collect();
        let in_use = self.in_use.clone();
        let (dir, budget, needed, sha) = (
            self.dir.clone(),
            self.budget,
            image.size,
            image.sha256.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let mut keep = in_use();
            keep.extend(busy);
            evict(&dir, budget, needed, &sha, &keep)
        })
        .await
        .map_err(|e| ImageError::Join(e.to_string()))?
        .map_err(io_err(&self.dir))
    }

    /// The images in the cache (whole, named files), for reports and tests.
    pub fn cached(&self) -> Vec<Sha256> {
        let mut v: Vec<Sha256> = list(&self.dir).into_iter().map(|e| e.sha256).collect();
        v.sort();
        v
    }
}

enum Failure {
    Fetch(FetchError),
    Io(ImageError),
}

/// Whether `path` holds `image` whole. A file whose sidecar matches its size and mtime
/// counts as checked; otherwise it is hashed now; a bad file is deleted.
fn check_cached(path: &Path, side: &Path, image: &ImageRef) -> Result<bool, ImageError> {
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err(path)(e)),
    };
    let recorded: Option<Sidecar> = read_json(side).ok().flatten();
    let fresh = recorded
        .as_ref()
        .is_some_and(|s| s.size == meta.len() && s.mtime_ns == mtime_ns(&meta));
    let good = if fresh {
        meta.len() == image.size
    } else {
        meta.len() == image.size && hash_file(path).map_err(io_err(path))? == image.sha256
    };
    if !good {
        tracing::warn!(
            image = %image.sha256,
            path = %path.display(),
            "cached image is damaged (size or SHA-256 differ); fetching it again"
        );
        let _ = fs::remove_file(path);
        let _ = crate::state::remove_json(side);
        return Ok(false);
    }
    if fresh {
        touch(side);
    } else {
        record_checked(path, side).map_err(io_err(side))?;
    }
    Ok(true)
}

/// Writes the sidecar: checked now, at this size and mtime, used now.
fn record_checked(path: &Path, side: &Path) -> std::io::Result<()> {
    let meta = fs::metadata(path)?;
    write_json(
        side,
        &Sidecar {
            size: meta.len(),
            mtime_ns: mtime_ns(&meta),
            last_used_ms: now_ms(),
        },
        0o600,
    )
}

/// Marks the image used now (best effort: a failure only makes eviction less exact).
fn touch(side: &Path) {
    if let Ok(Some(mut s)) = read_json::<Sidecar>(side) {
        s.last_used_ms = now_ms();
        let _ = write_json(side, &s, 0o600);
    }
}

/// The SHA-256 of a whole file.
pub fn hash_file(path: &Path) -> std::io::Result<Sha256> {
    let mut f = fs::File::open(path)?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1024 * 1024];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(Sha256::from_bytes(&h.finalize().into()))
}

/// The length of a partial download and the hash of its bytes; one longer than the
/// image cannot be a prefix of it and starts over.
fn hash_partial(part: &Path, size: u64) -> std::io::Result<(u64, sha2::Sha256)> {
    let mut h = sha2::Sha256::new();
    let mut f = match fs::File::open(part) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((0, h)),
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    if len > size {
        drop(f);
        fs::remove_file(part)?;
        return Ok((0, h));
    }
    let mut buf = vec![0u8; 1024 * 1024];
    let mut have = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        have += n as u64;
    }
    Ok((have, h))
}

struct Entry {
    sha256: Sha256,
    size: u64,
    last_used_ms: u128,
}

/// The whole images in `dir`, with their size and last use.
fn list(dir: &Path) -> Vec<Entry> {
    let Ok(rd) = fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| {
            let sha256: Sha256 = e.file_name().to_str()?.parse().ok()?;
            let meta = e.metadata().ok()?;
            let side: Option<Sidecar> = read_json(&dir.join(format!("{sha256}.json")))
                .ok()
                .flatten();
            let last_used_ms = side.map(|s| s.last_used_ms).unwrap_or_else(|| {
                meta.modified()
                    .ok()
                    .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                    .map(|d| d.as_millis())
                    .unwrap_or(0)
            });
            Some(Entry {
                sha256,
                size: meta.len(),
                last_used_ms,
            })
        })
        .collect()
}

/// A partial download nobody has resumed for this long is given up.
const STALE_PART: Duration = Duration::from_secs(24 * 3600);

/// Bytes of partial downloads in `dir` (they take room too), after deleting those of
/// images nobody is fetching that have not grown for [`STALE_PART`].
fn partial_bytes(dir: &Path, keep: &HashSet<Sha256>) -> u64 {
    let Ok(rd) = fs::read_dir(dir) else { return 0 };
    let mut total = 0;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(sha) = name.strip_suffix(".part") else {
            continue;
        };
        let Ok(meta) = e.metadata() else { continue };
        let stale = meta
            .modified()
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > STALE_PART);
        let wanted = sha.parse::<Sha256>().is_ok_and(|s| keep.contains(&s));
        if stale && !wanted && fs::remove_file(e.path()).is_ok() {
            tracing::info!(file = %e.path().display(), "deleted an abandoned partial download");
            continue;
        }
        total += meta.len();
    }
    total
}

fn evict(
    dir: &Path,
    budget: u64,
    needed: u64,
    fetching: &Sha256,
    keep: &HashSet<Sha256>,
) -> std::io::Result<()> {
    let mut entries = list(dir);
    let mut total: u64 = entries.iter().map(|e| e.size).sum::<u64>() + partial_bytes(dir, keep);
    entries.sort_by_key(|e| e.last_used_ms);
    for e in entries {
        if total.saturating_add(needed) <= budget {
            break;
        }
        if &e.sha256 == fetching || keep.contains(&e.sha256) {
            continue;
        }
        tracing::info!(image = %e.sha256, bytes = e.size, "evicting an unused image from the cache");
        fs::remove_file(dir.join(e.sha256.as_str()))?;
        let _ = crate::state::remove_json(&dir.join(format!("{}.json", e.sha256)));
        total = total.saturating_sub(e.size);
    }
    if total.saturating_add(needed) > budget {
        tracing::warn!(
            cached = total,
            needed,
            budget,
            "the image cache is over its budget with images VMs use; downloading anyway"
        );
    }
    Ok(())
}

/// Makes a rename durable (best effort: not every file system supports it).
pub(crate) fn sync_dir(dir: &Path) {
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
}
