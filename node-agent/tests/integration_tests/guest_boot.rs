//! A real Linux guest boots under QEMU (TCG) through the agent's executor: the image is
//! fetched into the cache, a qcow2 overlay is made on it, two GPUs of a generated tree are
//! bound and the guest sees one stand-in `edu` device for each, a counter the guest keeps
//! on its disk survives stop/start, and deleting the disk removes the overlay.
//!
//! The image is `cargo xtask test-image`'s (Debian, built from packages; `cargo xtask
//! test` builds it and passes its path in `PASSAGE_TEST_IMAGE`). Without it the test
//! skips with a note outside CI or with `PASSAGE_ALLOW_NO_QEMU=1`, and fails in CI.

use node_agent::agent::Executor;
use node_agent::fake::{FakeSpec, GpuModel, generate};
use node_agent::host::{Binder, open_sysfs};
use node_agent::hypervisor::{QemuConfig, QemuHypervisor, VmFiles};
use node_agent::images::{DirSource, ImageService, cache::hash_file, disk_path};
use passage_model::VmId;
use passage_model::images::ImageType;
use passage_model::protocol::{DiskSpec, ImageRef, Task, TaskProgress, TaskResult, VmSpec};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Generous: a boot under emulation takes 30-70 s on a quiet 2-core machine.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);

fn skip_or_fail(why: &str) -> Option<PathBuf> {
    let allowed = std::env::var("PASSAGE_ALLOW_NO_QEMU").as_deref() == Ok("1");
    if allowed || std::env::var_os("CI").is_none() {
        eprintln!(
            "note: SKIPPED: {why} (`cargo xtask test` provides it; or run `cargo xtask \
             test-image` and set PASSAGE_TEST_IMAGE to the path it prints)"
        );
        return None;
    }
    panic!("{why}: `cargo xtask test` builds the guest image; or set PASSAGE_ALLOW_NO_QEMU=1");
}

pub(super) fn test_image() -> Option<PathBuf> {
    if node_agent::hypervisor::find_on_path("qemu-system-x86_64").is_none() {
        return skip_or_fail("qemu-system-x86_64 is not installed");
    }
    if node_agent::hypervisor::find_on_path("qemu-img").is_none() {
        return skip_or_fail("qemu-img is not installed");
    }
    match std::env::var_os("PASSAGE_TEST_IMAGE").map(PathBuf::from) {
        Some(p) if p.is_file() => Some(p),
        Some(p) => skip_or_fail(&format!("PASSAGE_TEST_IMAGE {} is not a file", p.display())),
        None => skip_or_fail("PASSAGE_TEST_IMAGE is not set"),
    }
}

pub(super) async fn run(exec: &Arc<Executor>, task: Task) -> TaskResult {
    let (tx, _rx) = tokio::sync::watch::channel(TaskProgress { done: 0, total: 0 });
    exec.clone().run(task, tx).await
}

async fn ok(exec: &Arc<Executor>, task: Task) {
    let name = task.name();
    let r = run(exec, task).await;
    assert!(r.ok, "{name} failed: {:?}", r.error);
}

/// Waits until the console shows `line`; answers the console's text.
pub(super) async fn wait_console(console: &Path, line: &str, qemu_log: &Path) -> String {
    let started = Instant::now();
    loop {
        let text =
            String::from_utf8_lossy(&std::fs::read(console).unwrap_or_default()).into_owned();
        if text.lines().any(|l| l.trim_end().ends_with(line)) {
            return text;
        }
        if started.elapsed() > BOOT_TIMEOUT {
            let tail: String = text
                .chars()
                .rev()
                .take(3000)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            panic!(
                "no {line:?} on the console within {}s; console tail:\n{tail}\nQEMU log:\n{}",
                BOOT_TIMEOUT.as_secs(),
                std::fs::read_to_string(qemu_log).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_guest_boots_sees_its_stand_in_gpus_and_keeps_its_disk() {
    let Some(image) = test_image() else { return };
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sys");
    let state = dir.path().join("st");
    let tree = generate(
        &root,
        &FakeSpec {
            gpus: 2,
            model: GpuModel::H100,
            numa_nodes: 1,
        },
    )
    .unwrap();
    // The image source: a directory holding the image under its digest.
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let sha256 = hash_file(&image).unwrap();
    std::os::unix::fs::symlink(&image, src.join(sha256.as_str())).unwrap();
    let size = std::fs::metadata(&image).unwrap().len();

    // The configuration `node-agent run --hypervisor qemu` makes for a generated tree
    // (stand-in devices), with emulation: KVM does not work on these machines.
    let mut cfg = QemuConfig::from_path(Some(&root)).unwrap();
    assert!(
        cfg.stand_in_devices,
        "a generated tree gets stand-in devices"
    );
    cfg.accel = "tcg".into();
    let hv = Arc::new(QemuHypervisor::open(cfg.clone(), &state).unwrap());
    let _stop = super::StopOnDrop(hv.as_ref());
    let images = ImageService::new(&state, 10, Arc::new(DirSource::new(&src)));
    let exec = Arc::new(
        Executor::new(Binder::new(open_sysfs(&root).unwrap(), &state), hv.clone())
            .with_images(Arc::new(images)),
    );

    let vm = VmId::new_random();
    let disk = DiskSpec {
        image: ImageRef {
            sha256,
            size,
            image_type: ImageType::Qcow2,
        },
        size_gib: 4,
    };
    let spec = VmSpec {
        uuid: vm,
        vcpus: 1,
        memory_mib: 512,
        devices: tree.gpus.clone(),
        disk: Some(disk.clone()),
        nics: Vec::new(),
        cloud_init: None,
        bootrom: None,
    };
    assert_eq!(tree.gpus.len(), 2);
    ok(
        &exec,
        Task::FetchImage {
            vm_uuid: vm,
            disk: disk.clone(),
        },
    )
    .await;
    assert!(disk_path(&state, vm).is_file());

    // A second VM from the same image transfers nothing: with the source gone, its disk
    // is still made, from the cache.
    std::fs::remove_file(src.join(disk.image.sha256.as_str())).unwrap();
    let vm2 = VmId::new_random();
    let t = Instant::now();
    ok(
        &exec,
        Task::FetchImage {
            vm_uuid: vm2,
            disk: disk.clone(),
        },
    )
    .await;
    eprintln!(
        "a second VM's disk from the cached image was ready in {} ms",
        t.elapsed().as_millis()
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    ok(&exec, Task::DeleteDisk { vm_uuid: vm2 }).await;

    ok(
        &exec,
        Task::BindPassthrough {
            vm_uuid: vm,
            devices: tree.gpus.clone(),
            vgpu_types: Default::default(),
        },
    )
    .await;

    let files = VmFiles::new(&state, vm);
    let t = Instant::now();
    ok(&exec, Task::StartVm { vm: spec.clone() }).await;
    let console = wait_console(&files.console, "PASSAGE-BOOT-COUNT=1", &files.log).await;
    eprintln!(
        "boot 1 reached its report in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    assert!(
        super::reported(&console, "PASSAGE-EDU-COUNT").contains(&"2".to_string()),
        "the guest should see 2 stand-in devices:\n{console}"
    );
    // A VM with devices and no firmware asked for boots UEFI, with variables of its own.
    assert_eq!(
        super::reported(&console, "PASSAGE-FIRMWARE"),
        ["uefi"],
        "{console}"
    );
    let vars = node_agent::hypervisor::vars_path(&files);
    assert!(vars.is_file(), "the VM's own OVMF variables");

    // A disk may not go while its VM runs.
    let r = run(&exec, Task::DeleteDisk { vm_uuid: vm }).await;
    assert!(
        !r.ok && r.error.as_deref().unwrap_or("").contains("running"),
        "{r:?}"
    );

    ok(&exec, Task::StopVm { vm_uuid: vm }).await;
    // A restarted agent finds the disk where it was.
    drop(QemuHypervisor::open(cfg, &state).unwrap());
    assert!(disk_path(&state, vm).is_file());

    // The second boot as a node that runs `boot_vm` gets it: bind, disk and start in
    // one task (the bind and the disk are there already, and stay).
    let t = Instant::now();
    ok(
        &exec,
        Task::BootVm {
            vm: spec.clone(),
            vgpu_types: Default::default(),
        },
    )
    .await;
    let console = wait_console(&files.console, "PASSAGE-BOOT-COUNT=2", &files.log).await;
    eprintln!(
        "boot 2 reached its report in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    assert!(super::reported(&console, "PASSAGE-EDU-COUNT").contains(&"2".to_string()));
    ok(&exec, Task::StopVm { vm_uuid: vm }).await;

    // The console as the API reads it: kept after the VM stopped, its end only. The
    // file holds both boots (it is appended to).
    let r = run(&exec, Task::ReadConsole { vm_uuid: vm }).await;
    let read = r.console.unwrap_or_default();
    assert!(r.ok, "{:?}", r.error);
    assert!(read.contains("PASSAGE-BOOT-COUNT=2"), "{read}");
    assert!(read.len() <= passage_model::protocol::MAX_CONSOLE_BYTES);
    let whole = std::fs::read_to_string(&files.console).unwrap_or_default();
    assert!(whole.contains("PASSAGE-BOOT-COUNT=1"), "{whole}");

    ok(&exec, Task::DeleteDisk { vm_uuid: vm }).await;
    assert!(
        !disk_path(&state, vm).exists(),
        "destroy removes the overlay"
    );
    assert!(!files.console.exists());
    assert!(!vars.exists(), "the UEFI variables went with the disk");
    let r = run(&exec, Task::ReadConsole { vm_uuid: vm }).await;
    assert_eq!(
        r.console.as_deref(),
        Some(""),
        "the console went with the disk"
    );
    // The image stays cached for the next VM (and is no longer in use).
    assert!(node_agent::images::images_in_use(&state).is_empty());
    ok(
        &exec,
        Task::UnbindPassthrough {
            vm_uuid: vm,
            devices: tree.gpus.clone(),
        },
    )
    .await;
}
