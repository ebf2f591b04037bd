//! A VM's boot disk on its node: the image fetched into the node's cache and the VM's
//! overlay made (`fetch_image`), or the overlay deleted (`delete_disk`). VMs made before
//! images existed have no image: for them both are no-ops.

use super::agent_task;
use super::error::StepError;
use crate::services::Ctx;
use crate::store::images;
use passage_model::api::Vm;
use passage_model::images::{Image, ImageState};
use passage_model::protocol::{DiskSpec, ImageRef, Task};
use passage_model::{ImageId, JobId, ServerId};

/// The disk a node makes for `vm`: its image, and its package's `disk_gib` (the image's
/// `min_disk_gib` when the VM has no package, or 0 when neither says: the image's own
/// size). `None` for a VM without an image.
pub async fn spec(ctx: &Ctx, vm: &Vm) -> Result<Option<DiskSpec>, StepError> {
    let Some(image) = vm.image_uuid else {
        return Ok(None);
    };
    let img = read_image(ctx, image).await?;
    let (Some(sha256), Some(size)) = (img.sha256.clone(), img.size) else {
        return Err(StepError::Refused(format!(
            "image {image} has no file ({})",
            img.state.as_str()
        )));
    };
    if img.state == ImageState::Failed || img.state == ImageState::Unactivated {
        return Err(StepError::Refused(format!(
            "image {image} is {}",
            img.state.as_str()
        )));
    }
    // Through the cache creations read packages by: a package never changes, only goes.
    let package_gib = match vm.package_uuid {
        Some(p) => crate::services::catalog::find_package(ctx, &p.to_string())
            .await
            .ok()
            .map(|p| p.disk_gib),
        None => None,
    };
    let size_gib = package_gib
        .filter(|g| *g > 0)
        .or(img.requirements.min_disk_gib)
        .unwrap_or(0);
    Ok(Some(DiskSpec {
        image: ImageRef {
            sha256,
            size,
            image_type: img.image_type,
        },
        size_gib,
    }))
}

/// An image's record, through the cache creations read images by (every image write
/// clears it).
pub async fn read_image(ctx: &Ctx, image: ImageId) -> Result<Image, StepError> {
    Ok(ctx
        .images
        .get_or_load(&image.to_string(), || images::get(&ctx.jobs_db, image))
        .await?)
}

/// The node has the image and the VM's disk (idempotent on the node).
pub async fn fetch(
    ctx: &Ctx,
    server: ServerId,
    job: Option<JobId>,
    vm: &Vm,
) -> Result<(), StepError> {
    let Some(disk) = spec(ctx, vm).await? else {
        return Ok(());
    };
    let task = Task::FetchImage {
        vm_uuid: vm.uuid,
        disk,
    };
    agent_task::run(ctx, server, job, task).await.map(drop)
}

/// The node deletes the VM's disk (idempotent on the node).
pub async fn delete(
    ctx: &Ctx,
    server: ServerId,
    job: Option<JobId>,
    vm: &Vm,
) -> Result<(), StepError> {
    if vm.image_uuid.is_none() {
        return Ok(());
    }
    let task = Task::DeleteDisk { vm_uuid: vm.uuid };
    agent_task::run(ctx, server, job, task).await.map(drop)
}
