//! The image cache and boot disks: downloads checked by SHA-256, resumed after an
//! interruption (from a local source and over real HTTP with `Range`), one download for
//! two fetches at once, damaged files fetched again, least-recently-used eviction that
//! spares images in use, and the qcow2 overlays made on them.

use async_trait::async_trait;
use bytes::Bytes;
use node_agent::images::{
    DirSource, FetchError, GIB, ImageBody, ImageCache, ImageService, ImageSource, cache::hash_file,
    delete_disk, disk_path,
};
use passage_model::VmId;
use passage_model::images::{ImageType, Sha256};
use passage_model::protocol::{DiskSpec, ImageRef, TaskProgress};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use tokio::sync::watch;

/// Writes `bytes` as an image into `dir` (named by its digest) and answers its ref.
fn put_image(dir: &Path, bytes: &[u8], image_type: ImageType) -> ImageRef {
    std::fs::create_dir_all(dir).unwrap();
    let tmp = dir.join("tmp");
    std::fs::write(&tmp, bytes).unwrap();
    let sha256 = hash_file(&tmp).unwrap();
    std::fs::rename(&tmp, dir.join(sha256.as_str())).unwrap();
    ImageRef {
        sha256,
        size: bytes.len() as u64,
        image_type,
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn progress() -> (watch::Sender<TaskProgress>, watch::Receiver<TaskProgress>) {
    watch::channel(TaskProgress { done: 0, total: 0 })
}

fn no_users() -> node_agent::images::cache::InUse {
    Arc::new(HashSet::new)
}

/// A source over a directory that counts its opens and the bytes it serves, and can cut
/// the first download short after some bytes, as a dropped connection would.
struct Counting {
    inner: DirSource,
    opens: AtomicUsize,
    served: Arc<AtomicU64>,
    cut_after: Option<u64>,
    offsets: std::sync::Mutex<Vec<u64>>,
    delay: std::time::Duration,
}

impl Counting {
    fn new(dir: &Path) -> Self {
        Counting {
            inner: DirSource::new(dir),
            opens: AtomicUsize::new(0),
            served: Arc::new(AtomicU64::new(0)),
            cut_after: None,
            offsets: std::sync::Mutex::new(Vec::new()),
            delay: std::time::Duration::ZERO,
        }
    }
}

struct CountingBody {
    inner: Box<dyn ImageBody>,
    served: Arc<AtomicU64>,
    left: Option<u64>,
    delay: std::time::Duration,
}

#[async_trait]
impl ImageBody for CountingBody {
    fn start(&self) -> u64 {
        self.inner.start()
    }

    async fn chunk(&mut self) -> Result<Option<Bytes>, FetchError> {
        tokio::time::sleep(self.delay).await;
        if self.left == Some(0) {
            return Err(FetchError::transient("connection reset (test)"));
        }
        let Some(mut c) = self.inner.chunk().await? else {
            return Ok(None);
        };
        if let Some(left) = &mut self.left {
            let n = (*left).min(c.len() as u64);
            c = c.slice(..n as usize);
            *left -= n;
        }
        self.served.fetch_add(c.len() as u64, Ordering::SeqCst);
        Ok(Some(c))
    }
}

#[async_trait]
impl ImageSource for Counting {
    async fn open(&self, sha256: &Sha256, offset: u64) -> Result<Box<dyn ImageBody>, FetchError> {
        let first = self.opens.fetch_add(1, Ordering::SeqCst) == 0;
        self.offsets.lock().unwrap().push(offset);
        Ok(Box::new(CountingBody {
            inner: self.inner.open(sha256, offset).await?,
            served: self.served.clone(),
            left: if first { self.cut_after } else { None },
            delay: self.delay,
        }))
    }
}

#[tokio::test]
async fn downloads_verifies_and_reuses() {
    let src = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let image = put_image(
        src.path(),
        &pattern(3 * 1024 * 1024 + 17, 1),
        ImageType::Raw,
    );
    let source = Counting::new(src.path());
    let cache = ImageCache::new(state.path().join("images"), GIB, no_users());
    let (tx, rx) = progress();
    let path = cache.ensure(&image, &source, &tx).await.unwrap();
    assert_eq!(
        path,
        state.path().join("images").join(image.sha256.as_str())
    );
    assert_eq!(hash_file(&path).unwrap(), image.sha256);
    assert_eq!(
        *rx.borrow(),
        TaskProgress {
            done: image.size,
            total: image.size
        }
    );
    // Cached: no second download.
    cache.ensure(&image, &source, &tx).await.unwrap();
    assert_eq!(source.opens.load(Ordering::SeqCst), 1);
    assert_eq!(cache.cached(), vec![image.sha256.clone()]);

    // A source whose bytes do not match the digest: refused, nothing cached under it.
    let mut wrong = image.clone();
    wrong.sha256 = "0".repeat(64).parse().unwrap();
    std::fs::copy(
        src.path().join(image.sha256.as_str()),
        src.path().join(wrong.sha256.as_str()),
    )
    .unwrap();
    let e = cache.ensure(&wrong, &source, &tx).await.unwrap_err();
    assert!(e.to_string().contains("SHA-256"), "{e}");
    assert!(!cache.path(&wrong.sha256).exists());
}

#[tokio::test]
async fn an_interrupted_download_resumes_where_it_stopped() {
    let src = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let image = put_image(src.path(), &pattern(5 * 1024 * 1024, 2), ImageType::Raw);
    let mut source = Counting::new(src.path());
    source.cut_after = Some(2 * 1024 * 1024 + 5);
    let cache = ImageCache::new(state.path().join("images"), GIB, no_users());
    let (tx, _rx) = progress();
    let path = cache.ensure(&image, &source, &tx).await.unwrap();
    assert_eq!(hash_file(&path).unwrap(), image.sha256);
    assert_eq!(
        *source.offsets.lock().unwrap(),
        vec![0, 2 * 1024 * 1024 + 5],
        "the second request resumes after the bytes already there"
    );
    assert_eq!(source.served.load(Ordering::SeqCst), image.size);
}

#[tokio::test]
async fn a_partial_file_left_by_an_earlier_agent_is_resumed() {
    let src = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let bytes = pattern(4 * 1024 * 1024, 3);
    let image = put_image(src.path(), &bytes, ImageType::Raw);
    let dir = state.path().join("images");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join(format!("{}.part", image.sha256)),
        &bytes[..1_000_000],
    )
    .unwrap();
    let source = Counting::new(src.path());
    let cache = ImageCache::new(&dir, GIB, no_users());
    let (tx, _rx) = progress();
    cache.ensure(&image, &source, &tx).await.unwrap();
    assert_eq!(*source.offsets.lock().unwrap(), vec![1_000_000]);
    assert_eq!(source.served.load(Ordering::SeqCst), image.size - 1_000_000);
}

#[tokio::test]
async fn two_fetches_at_once_download_once() {
    let src = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let image = put_image(src.path(), &pattern(4 * 1024 * 1024, 4), ImageType::Raw);
    let mut source = Counting::new(src.path());
    source.delay = std::time::Duration::from_millis(20);
    let source = Arc::new(source);
    let cache = Arc::new(ImageCache::new(
        state.path().join("images"),
        GIB,
        no_users(),
    ));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let (cache, source, image) = (cache.clone(), source.clone(), image.clone());
        tasks.push(tokio::spawn(async move {
            let (tx, _rx) = progress();
            cache.ensure(&image, source.as_ref(), &tx).await.unwrap()
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(source.opens.load(Ordering::SeqCst), 1);
    assert_eq!(source.served.load(Ordering::SeqCst), image.size);
}

#[tokio::test]
async fn a_damaged_cache_file_is_fetched_again() {
    let src = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let image = put_image(src.path(), &pattern(1024 * 1024, 5), ImageType::Raw);
    let source = Counting::new(src.path());
    let cache = ImageCache::new(state.path().join("images"), GIB, no_users());
    let (tx, _rx) = progress();
    let path = cache.ensure(&image, &source, &tx).await.unwrap();
    // Same size, other bytes, later mtime: the sidecar no longer vouches for it.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[1000] ^= 0xff;
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&path, &bytes).unwrap();
    cache.ensure(&image, &source, &tx).await.unwrap();
    assert_eq!(source.opens.load(Ordering::SeqCst), 2);
    assert_eq!(hash_file(&path).unwrap(), image.sha256);
    // Truncated: also caught.
    std::fs::write(&path, &bytes[..10]).unwrap();
    cache.ensure(&image, &source, &tx).await.unwrap();
    assert_eq!(source.opens.load(Ordering::SeqCst), 3);
    assert_eq!(hash_file(&path).unwrap(), image.sha256);
}

#[tokio::test]
async fn eviction_spares_images_in_use_and_takes_the_least_recently_used() {
    let src = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let mib = 1024 * 1024;
    let images: Vec<ImageRef> = (0..4)
        .map(|i| put_image(src.path(), &pattern(mib, 10 + i), ImageType::Raw))
        .collect();
    let source = Counting::new(src.path());
    let used = Arc::new(std::sync::Mutex::new(HashSet::new()));
    let u = used.clone();
    // Room for 3 images of 1 MiB (the budget is in bytes here).
    let cache = ImageCache::new(
        state.path().join("images"),
        3 * mib as u64,
        Arc::new(move || u.lock().unwrap().clone()),
    );
    let (tx, _rx) = progress();
    for img in &images[..3] {
        cache.ensure(img, &source, &tx).await.unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // Image 0 in use, image 1 used again recently: image 2 is the one to go.
    used.lock().unwrap().insert(images[0].sha256.clone());
    cache.ensure(&images[1], &source, &tx).await.unwrap();
    cache.ensure(&images[3], &source, &tx).await.unwrap();
    let mut want = vec![
        images[0].sha256.clone(),
        images[1].sha256.clone(),
        images[3].sha256.clone(),
    ];
    want.sort();
    assert_eq!(cache.cached(), want);
}

fn qemu_img() -> Option<PathBuf> {
    match node_agent::hypervisor::find_on_path("qemu-img") {
        Some(p) => Some(p),
        None if std::env::var("PASSAGE_ALLOW_NO_QEMU").as_deref() == Ok("1") => {
            eprintln!("note: SKIPPED: qemu-img is not installed and PASSAGE_ALLOW_NO_QEMU=1");
            None
        }
        None => panic!(
            "qemu-img is not installed: `apt-get install qemu-utils` (cargo xtask test does), \
             or set PASSAGE_ALLOW_NO_QEMU=1 to skip this test"
        ),
    }
}

#[tokio::test]
async fn boot_disks_are_overlays_kept_until_deleted() {
    let Some(qemu_img) = qemu_img() else { return };
    let src = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let image = put_image(src.path(), &pattern(2 * 1024 * 1024, 7), ImageType::Raw);
    let svc = ImageService::new(state.path(), 1, Arc::new(DirSource::new(src.path())))
        .with_qemu_img(qemu_img.clone());
    let vm = VmId::new_random();
    let disk = DiskSpec {
        image: image.clone(),
        size_gib: 3,
    };
    let (tx, _rx) = progress();
    let path = svc.fetch(vm, &disk, &tx).await.unwrap();
    assert_eq!(path, disk_path(state.path(), vm));
    let info = std::process::Command::new(&qemu_img)
        .args(["info", "--output=json"])
        .arg(&path)
        .output()
        .unwrap();
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["format"], "qcow2");
    assert_eq!(info["virtual-size"], 3 * GIB);
    assert_eq!(info["backing-filename-format"], "raw");
    assert_eq!(
        info["backing-filename"].as_str().unwrap(),
        svc.cache
            .path(&image.sha256)
            .canonicalize()
            .unwrap()
            .to_str()
            .unwrap()
    );
    assert!(node_agent::images::images_in_use(state.path()).contains(&image.sha256));

    // Idempotent: an existing disk (the guest's data) is kept as it is.
    let before = std::fs::metadata(&path).unwrap().modified().unwrap();
    svc.fetch(vm, &disk, &tx).await.unwrap();
    assert_eq!(
        std::fs::metadata(&path).unwrap().modified().unwrap(),
        before
    );

    delete_disk(state.path(), vm).unwrap();
    assert!(!path.exists());
    assert!(
        !path.parent().unwrap().exists(),
        "the VM's empty dir goes too"
    );
    delete_disk(state.path(), vm).unwrap(); // already deleted
    assert!(node_agent::images::images_in_use(state.path()).is_empty());
}

/// A loopback HTTP server with the agent API's image route: `Range: bytes=N-` answered
/// with 206 and `Content-Range`; the first answer is cut short after `cut` bytes.
async fn range_server(dir: PathBuf, cut: usize) -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
    use axum::extract::{Path as AxPath, State};
    use axum::http::{HeaderMap, StatusCode, header};
    use axum::response::{IntoResponse, Response};
    type Seen = Arc<std::sync::Mutex<Vec<String>>>;
    #[derive(Clone)]
    struct St {
        dir: PathBuf,
        seen: Seen,
        cut: usize,
    }
    async fn get(State(st): State<St>, AxPath(sha): AxPath<String>, h: HeaderMap) -> Response {
        let Ok(bytes) = std::fs::read(st.dir.join(&sha)) else {
            return StatusCode::NOT_FOUND.into_response();
        };
        let range = h
            .get(header::RANGE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let first = {
            let mut seen = st.seen.lock().unwrap();
            seen.push(range.clone().unwrap_or_default());
            seen.len() == 1
        };
        let start: usize = range
            .as_deref()
            .and_then(|r| r.strip_prefix("bytes="))
            .and_then(|r| r.strip_suffix('-'))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let total = bytes.len();
        let body = bytes[start..].to_vec();
        if first {
            // Promise the whole file, send part of it, then drop the connection.
            let part = body[..st.cut].to_vec();
            let stream = futures_stream(part);
            return Response::builder()
                .status(StatusCode::OK)
                .header(header::CONTENT_LENGTH, total)
                .body(axum::body::Body::from_stream(stream))
                .unwrap();
        }
        let mut resp = body.into_response();
        if range.is_some() {
            *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
            resp.headers_mut().insert(
                header::CONTENT_RANGE,
                format!("bytes {start}-{}/{total}", total - 1)
                    .parse()
                    .unwrap(),
            );
        }
        resp
    }
    let seen: Seen = Arc::default();
    let app = axum::Router::new()
        .route("/agent/v1/images/{sha}", axum::routing::get(get))
        .with_state(St {
            dir,
            seen: seen.clone(),
            cut,
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), seen)
}

/// The bytes, then an error: the server aborts the response mid-body.
fn futures_stream(
    part: Vec<u8>,
) -> impl futures_core_stream::Stream<Item = Result<Bytes, std::io::Error>> {
    futures_core_stream::two(part)
}

mod futures_core_stream {
    //! A two-item stream without a `futures` dependency: the bytes, then an error.
    use bytes::Bytes;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    pub use futures_core::Stream;

    pub struct Two {
        part: Option<Vec<u8>>,
        failed: bool,
    }

    pub fn two(part: Vec<u8>) -> Two {
        Two {
            part: Some(part),
            failed: false,
        }
    }

    impl Stream for Two {
        type Item = Result<Bytes, std::io::Error>;
        fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            if let Some(p) = self.part.take() {
                return Poll::Ready(Some(Ok(Bytes::from(p))));
            }
            if !self.failed {
                self.failed = true;
                return Poll::Ready(Some(Err(std::io::Error::other("cut (test)"))));
            }
            Poll::Ready(None)
        }
    }
}

#[tokio::test]
async fn resumes_over_http_with_range() {
    let src = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let image = put_image(src.path(), &pattern(3 * 1024 * 1024, 9), ImageType::Raw);
    let (url, seen) = range_server(src.path().to_path_buf(), 1_234_567).await;
    let client = node_agent::agent::AgentClient::new(&url)
        .unwrap()
        .with_credential("node-credential".into());
    let source = node_agent::images::HttpSource::new(client);
    let cache = ImageCache::new(state.path().join("images"), GIB, no_users());
    let (tx, _rx) = progress();
    let path = cache.ensure(&image, &source, &tx).await.unwrap();
    assert_eq!(hash_file(&path).unwrap(), image.sha256);
    assert_eq!(
        *seen.lock().unwrap(),
        vec![String::new(), "bytes=1234567-".to_string()]
    );
    // An image the server does not have: a clear, permanent error.
    let mut missing = image.clone();
    missing.sha256 = "1".repeat(64).parse().unwrap();
    let e = cache.ensure(&missing, &source, &tx).await.unwrap_err();
    assert!(e.to_string().contains("no such image"), "{e}");
}

/// Simulated nodes (`--sim-servers`) download nothing and make no disk, yet both tasks
/// succeed, so a provision workflow runs the same on them.
#[tokio::test]
async fn on_the_sim_hypervisor_fetch_image_and_delete_disk_succeed_at_once() {
    use node_agent::agent::Executor;
    use node_agent::fake::{FakeSpec, generate};
    use node_agent::host::{Binder, open_sysfs};
    use node_agent::hypervisor::SimHypervisor;
    use passage_model::protocol::Task;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sys");
    let state = dir.path().join("state");
    generate(&root, &FakeSpec::default()).unwrap();
    let hv = Arc::new(SimHypervisor::open(&state, Some(&root)).unwrap());
    let exec = Arc::new(Executor::new(
        Binder::new(open_sysfs(&root).unwrap(), &state),
        hv,
    ));
    let vm = VmId::new_random();
    let disk = DiskSpec {
        image: ImageRef {
            sha256: "ab".repeat(32).parse().unwrap(),
            size: 1 << 30,
            image_type: ImageType::Qcow2,
        },
        size_gib: 10,
    };
    for task in [
        Task::FetchImage { vm_uuid: vm, disk },
        Task::DeleteDisk { vm_uuid: vm },
    ] {
        let (tx, _rx) = progress();
        let r = exec.clone().run(task, tx).await;
        assert!(r.ok, "{r:?}");
    }
    assert!(!state.join("images").exists() && !disk_path(&state, vm).exists());
}

/// A disk smaller than the image's own is refused (qemu-img would cut it short), as is
/// a qcow2 image naming a backing file (QEMU would open that path on the node).
#[tokio::test]
async fn a_disk_smaller_than_its_image_or_a_chained_image_is_refused() {
    let Some(qemu_img) = qemu_img() else { return };
    let src = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let make = |args: &[&str]| {
        let ok = std::process::Command::new(&qemu_img)
            .args(args)
            .status()
            .unwrap()
            .success();
        assert!(ok, "{args:?}");
    };
    let big = src.path().join("big.qcow2");
    make(&["create", "-q", "-f", "qcow2", big.to_str().unwrap(), "3G"]);
    let chained = src.path().join("chained.qcow2");
    make(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "/etc/hostname",
        "-F",
        "raw",
        chained.to_str().unwrap(),
        "1G",
    ]);
    let svc = ImageService::new(state.path(), 1, Arc::new(DirSource::new(src.path())))
        .with_qemu_img(qemu_img.clone());
    for (file, size_gib, want) in [
        (&big, 2, "cannot hold the image"),
        (&chained, 2, "backing file"),
    ] {
        let image = put_image(src.path(), &std::fs::read(file).unwrap(), ImageType::Qcow2);
        let vm = VmId::new_random();
        let (tx, _rx) = progress();
        let e = svc
            .fetch(vm, &DiskSpec { image, size_gib }, &tx)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e}");
        assert!(!disk_path(state.path(), vm).exists());
        assert!(node_agent::images::images_in_use(state.path()).is_empty());
    }
}

/// A whole `.part` (stopped between the last byte and the rename) is finished without a
/// request; a `.part` whose bytes are wrong is thrown away and downloaded from scratch.
#[tokio::test]
async fn whole_and_damaged_partial_files() {
    let src = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let bytes = pattern(2 * 1024 * 1024, 6);
    let image = put_image(src.path(), &bytes, ImageType::Raw);
    let dir = state.path().join("images");
    std::fs::create_dir_all(&dir).unwrap();
    let part = dir.join(format!("{}.part", image.sha256));
    std::fs::write(&part, &bytes).unwrap();
    let source = Counting::new(src.path());
    let cache = ImageCache::new(&dir, GIB, no_users());
    let (tx, _rx) = progress();
    cache.ensure(&image, &source, &tx).await.unwrap();
    assert_eq!(source.opens.load(Ordering::SeqCst), 0);
    assert!(!part.exists());

    let image2 = put_image(src.path(), &pattern(2 * 1024 * 1024, 8), ImageType::Raw);
    let part2 = dir.join(format!("{}.part", image2.sha256));
    std::fs::write(&part2, vec![0u8; 1_000_000]).unwrap();
    let path = cache.ensure(&image2, &source, &tx).await.unwrap();
    assert_eq!(hash_file(&path).unwrap(), image2.sha256);
    assert_eq!(*source.offsets.lock().unwrap(), vec![1_000_000, 0]);
}
