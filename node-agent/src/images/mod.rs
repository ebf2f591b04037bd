//! Images on the node: the cache of image files ([`cache`]), where they come from
//! ([`source`]) and the VMs' boot disks built on them ([`disk`]).

pub mod cache;
pub mod disk;
pub mod sink;
pub mod source;

pub use cache::{GIB, ImageCache, ImageError};
pub use disk::{QEMU_IMG_BINARY, create_overlay, delete_disk, disk_path, images_in_use};
pub use source::{DirSource, FetchError, HttpSource, ImageBody, ImageSource};

use passage_model::VmId;
use passage_model::protocol::{DiskSpec, TaskProgress};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::watch;

/// The default `image_cache_gib`.
pub const DEFAULT_CACHE_GIB: u64 = 50;

/// What `FetchImage` and `DeleteDisk` need: the cache, the source, and `qemu-img`.
pub struct ImageService {
    pub cache: ImageCache,
    pub source: Arc<dyn ImageSource>,
    pub state_dir: PathBuf,
    pub qemu_img: PathBuf,
}

impl ImageService {
    /// The cache at `STATE/images` with a budget of `cache_gib`, never evicting images
    /// the VMs' disks under `STATE/qemu` are built on.
    pub fn new(state_dir: &Path, cache_gib: u64, source: Arc<dyn ImageSource>) -> Self {
        let sd = state_dir.to_path_buf();
        let in_use: cache::InUse = Arc::new(move || images_in_use(&sd));
        ImageService {
            cache: ImageCache::new(
                state_dir.join("images"),
                cache_gib.saturating_mul(GIB),
                in_use,
            ),
            source,
            state_dir: state_dir.to_path_buf(),
            qemu_img: crate::hypervisor::find_on_path(QEMU_IMG_BINARY)
                .unwrap_or_else(|| PathBuf::from(QEMU_IMG_BINARY)),
        }
    }

    pub fn with_qemu_img(mut self, qemu_img: PathBuf) -> Self {
        self.qemu_img = qemu_img;
        self
    }

    /// `FetchImage`: the image in the cache, then the VM's disk on it unless it exists.
    /// The image's lock is held until the disk is made, so eviction never sees the image
    /// unused in between.
    pub async fn fetch(
        &self,
        vm: VmId,
        disk: &DiskSpec,
        progress: &watch::Sender<TaskProgress>,
    ) -> Result<PathBuf, ImageError> {
        let _flight = self.cache.lock(&disk.image.sha256).await;
        // Even when the disk exists: it needs its backing image whole to run.
        let image = self
            .cache
            .ensure_locked(&disk.image, self.source.as_ref(), progress)
            .await?;
        let (qemu_img, state_dir, disk2) =
            (self.qemu_img.clone(), self.state_dir.clone(), disk.clone());
        tokio::task::spawn_blocking(move || {
            create_overlay(&qemu_img, &state_dir, vm, &disk2, &image)
        })
        .await
        .map_err(|e| ImageError::Join(e.to_string()))?
    }
}
