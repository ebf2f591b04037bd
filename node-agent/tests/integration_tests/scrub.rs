#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Every scrub action over a generated tree driven by the fake kernel, with real helper
//! programs (shell scripts in a temp dir) standing in for nvidia-smi and the CUDA helper,
//! and regular files standing in for NVMe block devices.

use node_agent::agent::Executor;
use node_agent::fake::{
    FAKE_DEV_DIR, FAKE_GPU_MEMORY_BYTES, FAKE_GPU_ZERO, FAKE_NVME_BYTES, FakeFault, FakeSpec,
    GpuModel, HOST_LOG, RESET_LOG, generate, gpu_memory, set_busy, set_fault,
};
use node_agent::host::{Binder, SysfsOps, open_sysfs};
use node_agent::hypervisor::SimHypervisor;
use node_agent::scrub::{ScrubEnv, default_pipeline, scrub_with};
use passage_model::DevicePath;
use passage_model::protocol::{MAX_SCRUB_STEPS, ScrubAction, ScrubReport, Task};
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

struct World {
    dir: tempfile::TempDir,
    root: PathBuf,
    ops: Arc<dyn SysfsOps>,
    gpus: Vec<DevicePath>,
    nvme: DevicePath,
    nic: DevicePath,
}

impl World {
    fn new() -> World {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sys");
        let tree = generate(
            &root,
            &FakeSpec {
                gpus: 2,
                model: GpuModel::H100,
                numa_nodes: 1,
            },
        )
        .unwrap();
        let class = |d: &DevicePath| {
            fs::read_to_string(
                root.join(d.to_string().trim_start_matches('/'))
                    .join("class"),
            )
            .unwrap()
            .trim()
            .to_string()
        };
        let nvme = tree
            .functions
            .iter()
            .find(|d| class(d) == "0x010802")
            .unwrap()
            .clone();
        let nic = tree
            .functions
            .iter()
            .find(|d| class(d) == "0x020000")
            .unwrap()
            .clone();
        World {
            ops: open_sysfs(&root).unwrap(),
            dir,
            root,
            gpus: tree.gpus,
            nvme,
            nic,
        }
    }

    fn dir_of(&self, d: &DevicePath) -> PathBuf {
        // The canonical root, as the agent sees it (what `{path}` becomes).
        self.ops.root().join(d.to_string().trim_start_matches('/'))
    }

    /// What a node with no tools of its own gets (`ScrubEnv::for_sysfs` on a fake tree).
    fn env(&self) -> ScrubEnv {
        ScrubEnv::for_sysfs(self.ops.as_ref())
    }

    /// A directory of programs, searched like `PATH`.
    fn bin(&self) -> PathBuf {
        let bin = self.dir.path().join("bin");
        fs::create_dir_all(&bin).unwrap();
        bin
    }

    fn out(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn run(&self, dev: &DevicePath, steps: &[ScrubAction], env: &ScrubEnv) -> ScrubReport {
        scrub_with(&self.ops, dev, steps, env)
    }

    fn resets(&self) -> String {
        fs::read_to_string(self.root.join(RESET_LOG)).unwrap_or_default()
    }

    fn stand_in(&self) -> PathBuf {
        self.root.join(FAKE_DEV_DIR).join("nvme0n1")
    }
}

fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
    p
}

fn names(r: &ScrubReport) -> Vec<&str> {
    r.steps.iter().map(|s| s.name.as_str()).collect()
}

fn detail(r: &ScrubReport, i: usize) -> &str {
    r.steps[i].detail.as_deref().unwrap_or("")
}

#[test]
fn reset_writes_the_functions_reset() {
    let w = World::new();
    let r = w.run(&w.gpus[0], &[ScrubAction::Reset {}], &w.env());
    assert!(r.ok, "{r:?}");
    assert_eq!(names(&r), ["reset"]);
    assert_eq!(w.resets().trim(), w.gpus[0].address().to_string());
}

#[test]
fn reset_falls_back_to_the_parent_bridge() {
    let w = World::new();
    let gpu = &w.gpus[0];
    let bridge = *gpu.parents().last().unwrap();
    fs::remove_file(w.dir_of(gpu).join("reset")).unwrap();
    let r = w.run(
        gpu,
        &[ScrubAction::Reset {}, ScrubAction::VerifyDriver {}],
        &w.env(),
    );
    assert!(r.ok, "{r:?}");
    assert_eq!(names(&r), ["bus_reset", "verify_driver"]);
    assert!(detail(&r, 0).contains(&bridge.to_string()), "{r:?}");
    assert_eq!(w.resets().trim(), bridge.to_string());

    // A bridge with another card below it is not reset: that card may be in use.
    let other = w.dir_of(gpu).parent().unwrap().join(format!(
        "{:04x}:{:02x}:01.0",
        gpu.address().domain,
        gpu.address().bus
    ));
    fs::create_dir(&other).unwrap();
    let r = w.run(
        gpu,
        &[ScrubAction::Reset {}, ScrubAction::VerifyDriver {}],
        &w.env(),
    );
    assert!(!r.ok);
    assert_eq!(names(&r), ["bus_reset"]);
    assert!(detail(&r, 0).contains("would also reset"), "{r:?}");
    assert_eq!(w.resets().lines().count(), 1, "the bridge was reset again");
    fs::remove_dir(&other).unwrap();

    // Neither the function nor its bridge can be reset.
    fs::remove_file(w.dir_of(gpu).parent().unwrap().join("reset")).unwrap();
    let r = w.run(gpu, &[ScrubAction::Reset {}], &w.env());
    assert!(!r.ok);
    assert_eq!(names(&r), ["reset"]);
    assert!(detail(&r, 0).contains("no reset attribute"), "{r:?}");
}

#[test]
fn nvidia_reset_is_skipped_without_nvidia_smi() {
    let w = World::new();
    let r = w.run(&w.gpus[0], &[ScrubAction::NvidiaReset {}], &w.env());
    assert!(r.ok && r.steps[0].ok && r.steps[0].skipped, "{r:?}");
    assert_eq!(detail(&r, 0), "nvidia-smi not installed");
    // A configured path that is not there is the same as not installed.
    let mut env = w.env();
    env.nvidia_smi = Some(w.out("no-such-nvidia-smi"));
    let r = w.run(&w.gpus[0], &[ScrubAction::NvidiaReset {}], &env);
    assert!(r.ok && r.steps[0].skipped, "{r:?}");
}

#[test]
fn nvidia_reset_runs_nvidia_smi_from_the_search_path() {
    let w = World::new();
    let args = w.out("smi-args");
    script(
        &w.bin(),
        "nvidia-smi",
        &format!("echo \"$@\" > {}", args.display()),
    );
    let mut env = w.env();
    env.search_path = vec![w.out("empty"), w.bin()];
    let r = w.run(&w.gpus[1], &[ScrubAction::NvidiaReset {}], &env);
    assert!(r.ok && !r.steps[0].skipped, "{r:?}");
    assert_eq!(
        fs::read_to_string(&args).unwrap().trim(),
        format!("--gpu-reset -i {}", w.gpus[1].address())
    );
}

#[test]
fn a_failing_step_stops_the_pipeline() {
    let w = World::new();
    let smi = script(
        &w.bin(),
        "failing-smi",
        "echo 'GPU 0000:03:00.0 is in use by another client' >&2; exit 3",
    );
    let mut env = w.env();
    env.nvidia_smi = Some(smi);
    let r = w.run(
        &w.gpus[0],
        &[
            ScrubAction::NvidiaReset {},
            ScrubAction::Reset {},
            ScrubAction::VerifyDriver {},
        ],
        &env,
    );
    assert!(!r.ok);
    assert_eq!(names(&r), ["nvidia_reset"], "later steps are not run");
    assert!(!r.steps[0].ok && !r.steps[0].skipped);
    assert!(
        detail(&r, 0).contains("is in use by another client"),
        "{r:?}"
    );
    assert!(w.resets().is_empty(), "the reset after the failure ran");
}

#[test]
fn command_gets_the_device_in_its_arguments() {
    let w = World::new();
    let args = w.out("cmd-args");
    let prog = script(
        &w.bin(),
        "record",
        &format!("for a in \"$@\"; do echo \"$a\"; done > {}", args.display()),
    );
    let gpu = &w.gpus[0];
    let argv = vec![
        prog.display().to_string(),
        "{bdf}".to_string(),
        "--sysfs={path}".to_string(),
        "{other} $HOME; `x`".to_string(),
    ];
    let r = w.run(
        gpu,
        &[ScrubAction::Command {
            argv,
            timeout_secs: Some(10),
        }],
        &w.env(),
    );
    assert!(r.ok, "{r:?}");
    assert_eq!(names(&r), ["command"]);
    let got = fs::read_to_string(&args).unwrap();
    let lines: Vec<&str> = got.lines().collect();
    let path = w.dir_of(gpu);
    assert_eq!(
        lines,
        [
            gpu.address().to_string(),
            format!("--sysfs={}", path.display()),
            "{other} $HOME; `x`".to_string(),
        ]
    );
    assert!(path.join("vendor").is_file(), "{{path}} names the function");

    // Failures: a non-zero exit (stderr in the detail), no program, a bad timeout.
    let fail = script(&w.bin(), "fail", "echo 'no such widget' >&2; exit 7");
    let cases = [
        (vec![fail.display().to_string()], None, "no such widget"),
        (vec![], None, "empty command"),
        (
            vec![w.out("missing").display().to_string()],
            None,
            "could not start",
        ),
        (vec!["true".to_string()], Some(0), "timeout_secs"),
        (vec!["true".to_string()], Some(u64::MAX), "timeout_secs"),
    ];
    for (argv, timeout_secs, want) in cases {
        let r = w.run(
            gpu,
            &[ScrubAction::Command { argv, timeout_secs }],
            &w.env(),
        );
        assert!(!r.ok && !r.steps[0].ok, "{r:?}");
        assert!(detail(&r, 0).contains(want), "{want}: {r:?}");
    }
    // A program found on the agent's PATH, and stderr cut to 2 KiB.
    let chatty = script(
        &w.bin(),
        "chatty",
        "head -c 100000 /dev/zero | tr '\\0' e >&2; exit 1",
    );
    let r = w.run(
        gpu,
        &[ScrubAction::Command {
            argv: vec![chatty.display().to_string()],
            timeout_secs: None,
        }],
        &w.env(),
    );
    assert!(!r.ok);
    assert!(detail(&r, 0).len() < 2048 + 100, "{}", detail(&r, 0).len());
    let r = w.run(
        gpu,
        &[ScrubAction::Command {
            argv: vec!["true".to_string()],
            timeout_secs: None,
        }],
        &w.env(),
    );
    assert!(r.ok, "{r:?}");
}

#[test]
fn command_is_killed_at_its_timeout() {
    let w = World::new();
    // A program, and a script whose own child would outlive it if only it were killed.
    let sleeper = script(&w.bin(), "sleeper", "sleep 5; echo done");
    for argv in [
        vec!["sleep".to_string(), "5".to_string()],
        vec![sleeper.display().to_string()],
    ] {
        let t = Instant::now();
        let r = w.run(
            &w.gpus[0],
            &[ScrubAction::Command {
                argv,
                timeout_secs: Some(1),
            }],
            &w.env(),
        );
        let took = t.elapsed();
        assert!(!r.ok, "{r:?}");
        assert!(detail(&r, 0).contains("killed after 1 s"), "{r:?}");
        assert!(took < Duration::from_secs(3), "took {took:?}");
        assert!(r.steps[0].duration_ms >= 1000, "{r:?}");
    }
}

#[test]
fn zero_gpu_memory_uses_the_helper() {
    let w = World::new();
    let gpu = &w.gpus[1];
    // No helper at all: the node cannot clear the GPU, and the step fails as skipped.
    let bare = ScrubEnv::isolated(&w.out("dev"));
    let r = w.run(gpu, &[ScrubAction::ZeroGpuMemory {}], &bare);
    assert!(!r.ok && !r.steps[0].ok && r.steps[0].skipped, "{r:?}");
    assert_eq!(detail(&r, 0), "passage-gpu-zero not found");

    let args = w.out("zero-args");
    script(
        &w.bin(),
        "passage-gpu-zero",
        &format!("echo \"$@\" > {}", args.display()),
    );
    let mut env = w.env();
    env.search_path = vec![w.bin()];
    let r = w.run(gpu, &[ScrubAction::ZeroGpuMemory {}], &env);
    assert!(r.ok && !r.steps[0].skipped, "{r:?}");
    assert_eq!(names(&r), ["zero_gpu_memory"]);
    assert_eq!(
        detail(&r, 0),
        format!(
            "zeroed and verified by {}",
            w.bin().join("passage-gpu-zero").display()
        ),
        "a helper that prints no summary"
    );
    assert_eq!(
        fs::read_to_string(&args).unwrap().trim(),
        format!("--bdf {}", gpu.address())
    );

    env.gpu_zero_helper = Some(script(
        &w.bin(),
        "bad-zero",
        "echo 'read back 0x5a at offset 4096' >&2; exit 2",
    ));
    let r = w.run(gpu, &[ScrubAction::ZeroGpuMemory {}], &env);
    assert!(!r.ok && !r.steps[0].skipped, "{r:?}");
    assert!(detail(&r, 0).contains("read back 0x5a"), "{r:?}");
}

#[test]
fn zero_gpu_memory_without_the_cuda_driver_fails_as_skipped() {
    let w = World::new();
    let gpu = &w.gpus[0];
    let mut env = w.env();
    // What passage-gpu-zero does on a host without libcuda.so.1.
    env.gpu_zero_helper = Some(script(
        &w.bin(),
        "no-driver",
        "echo 'CUDA driver (libcuda.so.1) not found; GPU memory not zeroed' >&2; exit 3",
    ));
    let steps = [ScrubAction::ZeroGpuMemory {}, ScrubAction::VerifyDriver {}];
    let r = w.run(gpu, &steps, &env);
    assert!(!r.ok && !r.steps[0].ok && r.steps[0].skipped, "{r:?}");
    assert_eq!(names(&r), ["zero_gpu_memory"], "the pipeline stops there");
    assert_eq!(
        detail(&r, 0),
        "CUDA driver (libcuda.so.1) not found; GPU memory not zeroed"
    );
    // Exit 3 with nothing said: the same, with the agent's own words.
    env.gpu_zero_helper = Some(script(&w.bin(), "no-driver-quiet", "exit 3"));
    let r = w.run(gpu, &steps, &env);
    assert!(!r.ok && r.steps[0].skipped, "{r:?}");
    assert_eq!(
        detail(&r, 0),
        "passage-gpu-zero found no CUDA driver; GPU memory not zeroed"
    );

    // Every other failure quarantines: a CUDA error (1), bad arguments (2), memory not
    // zero (4), any other code, a signal.
    for (name, body) in [
        (
            "cuda-error",
            "echo 'cuInit: CUDA_ERROR_NO_DEVICE' >&2; exit 1",
        ),
        ("usage", "echo 'bad --bdf' >&2; exit 2"),
        (
            "dirty",
            "echo 'byte 0x5a at device address 0x7f0000001000' >&2; exit 4",
        ),
        ("odd", "exit 33"),
        ("killed", "kill -9 $$"),
    ] {
        env.gpu_zero_helper = Some(script(&w.bin(), name, body));
        let r = w.run(gpu, &steps, &env);
        assert!(
            !r.ok && !r.steps[0].ok && !r.steps[0].skipped,
            "{name}: {r:?}"
        );
        assert_eq!(names(&r), ["zero_gpu_memory"], "{name}");
    }
}

/// The generated tree's stand-in helper really clears the fake GPU's memory (a file) and
/// reads it back, answers as `passage-gpu-zero` does, and takes each injected fault.
#[test]
fn the_trees_zeroing_helper_clears_its_gpus_memory() {
    let w = World::new();
    let gpu = &w.gpus[0];
    let bdf = gpu.address().to_string();
    let mem = gpu_memory(&w.root, &bdf);
    let zero = [ScrubAction::ZeroGpuMemory {}];
    // First use: the helper makes the GPU's memory, full of the last tenant's bytes.
    let r = w.run(gpu, &zero, &w.env());
    assert!(r.ok && !r.steps[0].skipped, "{r:?}");
    assert_eq!(
        fs::metadata(&mem).unwrap().len(),
        FAKE_GPU_MEMORY_BYTES,
        "made on first use"
    );
    // A tenant's data, larger than the default: all of it is zeroed and checked.
    fill(&mem, MIB);
    let r = w.run(gpu, &zero, &w.env());
    assert!(r.ok, "{r:?}");
    assert_eq!(
        detail(&r, 0),
        format!(
            "{bdf} (Passage fake GPU): zeroed and verified 0.0 of 0.0 GiB in 0.0 s (0.0 GiB/s)"
        )
    );
    let data = fs::read(&mem).unwrap();
    assert_eq!(data.len(), MIB);
    assert!(data.iter().all(|&b| b == 0));

    // A byte that stays set after clearing: the read-back finds it (exit 4).
    set_fault(&w.root, FakeFault::GpuZeroVerifyFails, true).unwrap();
    fill(&mem, MIB);
    let r = w.run(gpu, &zero, &w.env());
    assert!(!r.ok && !r.steps[0].skipped, "{r:?}");
    assert!(
        detail(&r, 0).contains(
            "(exit status: 4): GPU memory is not zero after clearing: byte 0x5a at device address 0x80000"
        ),
        "{r:?}"
    );
    set_fault(&w.root, FakeFault::GpuZeroVerifyFails, false).unwrap();

    // No helper, no CUDA driver: this node cannot clear the GPU.
    set_fault(&w.root, FakeFault::GpuZeroMissing, true).unwrap();
    set_fault(&w.root, FakeFault::GpuZeroMissing, true).unwrap();
    assert!(!w.root.join(FAKE_GPU_ZERO).exists());
    let r = w.run(gpu, &zero, &w.env());
    assert!(!r.ok && r.steps[0].skipped, "{r:?}");
    assert_eq!(detail(&r, 0), "passage-gpu-zero not found");
    set_fault(&w.root, FakeFault::GpuZeroMissing, false).unwrap();
    set_fault(&w.root, FakeFault::NoCudaDriver, true).unwrap();
    let r = w.run(gpu, &zero, &w.env());
    assert!(!r.ok && r.steps[0].skipped, "{r:?}");
    assert_eq!(
        detail(&r, 0),
        "CUDA driver (libcuda.so.1) not found; GPU memory not zeroed"
    );
    set_fault(&w.root, FakeFault::NoCudaDriver, false).unwrap();
    assert!(w.run(gpu, &zero, &w.env()).ok);

    // CUDA reaches a GPU only through NVIDIA's driver: on vfio-pci the helper finds none.
    let state = w.dir.path().join("state");
    let binder = Binder::new(w.ops.clone(), &state);
    binder.bind_passthrough(&w.gpus[1]).unwrap();
    let out = std::process::Command::new(w.root.join(FAKE_GPU_ZERO))
        .args(["--bdf", &w.gpus[1].address().to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no CUDA device at"));
    binder.unbind_passthrough(&w.gpus[1]).unwrap();

    // Its arguments are checked as the real helper's are.
    let helper = w.root.join(FAKE_GPU_ZERO);
    for bad in [
        &["--bdf"][..],
        &["--bdf", "3b:00.0"],
        &["--bdf", "0000:3b:00.0;x"],
    ] {
        let out = std::process::Command::new(&helper)
            .args(bad)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
    }
}

/// On a passthrough host the GPU waits on vfio-pci: the zeroing step lends it to NVIDIA's
/// driver, zeroes it there and gives it back, in that order, each move bounded in time; a
/// host without NVIDIA's driver cannot clear it.
#[test]
fn zeroing_lends_the_gpu_to_the_vendor_driver_and_takes_it_back() {
    let w = World::new();
    let gpu = &w.gpus[1];
    let bdf = gpu.address().to_string();
    let state = w.dir.path().join("state");
    let binder = Binder::new(w.ops.clone(), &state);
    binder.bind_passthrough(gpu).unwrap();
    let log_before = fs::read_to_string(w.root.join(HOST_LOG)).unwrap_or_default();
    let steps = [
        ScrubAction::Reset {},
        ScrubAction::ZeroGpuMemory {},
        ScrubAction::VerifyDriver {},
    ];
    let r = w.run(gpu, &steps, &w.env());
    assert!(r.ok, "{r:?}");
    assert_eq!(
        names(&r),
        [
            "reset",
            "bind_vendor_driver",
            "zero_gpu_memory",
            "bind_back",
            "verify_driver"
        ]
    );
    assert_eq!(
        detail(&r, 1),
        format!("{bdf} lent to nvidia (from vfio-pci)")
    );
    assert_eq!(detail(&r, 3), format!("{bdf} back on vfio-pci"));
    let log = fs::read_to_string(w.root.join(HOST_LOG)).unwrap();
    let seq: Vec<&str> = log[log_before.len()..].lines().collect();
    assert_eq!(
        seq,
        [
            format!("reset {bdf}"),
            format!("unbind vfio-pci {bdf}"),
            format!("probe {bdf} nvidia"),
            format!("zero {bdf}"),
            format!("unbind nvidia {bdf}"),
            format!("bind vfio-pci {bdf}"),
        ]
    );
    let dir = w.dir_of(gpu);
    assert_eq!(
        fs::read_to_string(dir.join("driver_override"))
            .unwrap()
            .trim(),
        "vfio-pci",
        "its override is back too"
    );

    // A GPU its driver will not let go of: the bound ends the step, reported.
    set_busy(&w.root, &bdf, true).unwrap();
    let mut env = w.env();
    env.driver_timeout = Duration::from_millis(300);
    let t = Instant::now();
    let r = w.run(gpu, &steps, &env);
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(!r.ok, "{r:?}");
    assert_eq!(names(&r).last(), Some(&"bind_back"));
    assert!(detail(&r, 3).contains("did not finish within"), "{r:?}");
    set_busy(&w.root, &bdf, false).unwrap();

    // No NVIDIA driver on the host: this node cannot clear the GPU.
    let other = &w.gpus[0];
    wait_off_driver(&w, gpu, "nvidia");
    binder.unbind_passthrough(gpu).unwrap();
    binder
        .bind_passthrough_many(&[gpu.clone(), other.clone()])
        .unwrap();
    let drivers = w.root.join("bus/pci/drivers");
    fs::rename(drivers.join("nvidia"), drivers.join("nvidia.gone")).unwrap();
    let r = w.run(other, &steps, &w.env());
    assert!(!r.ok && r.steps[1].skipped, "{r:?}");
    assert_eq!(names(&r), ["reset", "zero_gpu_memory"]);
    assert!(
        detail(&r, 1).starts_with("the nvidia driver is not loaded"),
        "{r:?}"
    );
}

/// Waits until the fake kernel's late unbind (left behind by a bounded write) is done:
/// `dev` is off `driver`.
fn wait_off_driver(w: &World, dev: &DevicePath, driver: &str) {
    let t = Instant::now();
    while node_agent::host::bound_driver(&w.dir_of(dev))
        .unwrap()
        .as_deref()
        == Some(driver)
        && t.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn fill(path: &Path, len: usize) {
    fs::write(path, vec![0xABu8; len]).unwrap();
}

/// Which bytes are zero: the runs of zero and of 0xAB, as (start, end, byte).
fn runs(data: &[u8]) -> Vec<(usize, usize, u8)> {
    let mut out: Vec<(usize, usize, u8)> = Vec::new();
    for (i, &b) in data.iter().enumerate() {
        match out.last_mut() {
            Some(last) if last.2 == b && last.1 == i => last.1 = i + 1,
            _ => out.push((i, i + 1, b)),
        }
    }
    out
}

#[test]
fn wipe_nvme_labels_zeroes_both_ends() {
    let w = World::new();
    let size = FAKE_NVME_BYTES as usize;
    fill(&w.stand_in(), size);
    let r = w.run(&w.nvme, &[ScrubAction::WipeNvmeLabels {}], &w.env());
    assert!(r.ok, "{r:?}");
    assert_eq!(names(&r), ["wipe_nvme_labels"]);
    assert!(detail(&r, 0).contains("nvme0n1"), "{r:?}");
    let data = fs::read(w.stand_in()).unwrap();
    assert_eq!(data.len(), size, "the stand-in grew or shrank");
    assert_eq!(
        runs(&data),
        [(0, MIB, 0), (MIB, size - MIB, 0xAB), (size - MIB, size, 0)]
    );
}

#[test]
fn wipe_nvme_labels_covers_partitions_and_multipath_names() {
    let w = World::new();
    let size = FAKE_NVME_BYTES as usize;
    let ctrl = w.dir_of(&w.nvme).join("nvme/nvme0");
    // Native multipath shows the controller's path device; its node is the head's.
    fs::rename(ctrl.join("nvme0n1"), ctrl.join("nvme0c0n1")).unwrap();
    // A partition from 2 MiB to 10 MiB, as the kernel lists it (512-byte sectors).
    let part = ctrl.join("nvme0c0n1/nvme0n1p1");
    fs::create_dir(&part).unwrap();
    fs::write(part.join("start"), "4096\n").unwrap();
    fs::write(part.join("size"), "16384\n").unwrap();
    fill(&w.stand_in(), size);
    let r = w.run(&w.nvme, &[ScrubAction::WipeNvmeLabels {}], &w.env());
    assert!(r.ok, "{r:?}");
    let data = fs::read(w.stand_in()).unwrap();
    assert_eq!(
        runs(&data),
        [
            (0, MIB, 0),
            (MIB, 2 * MIB, 0xAB),
            (2 * MIB, 3 * MIB, 0),
            (3 * MIB, 9 * MIB, 0xAB),
            (9 * MIB, 10 * MIB, 0),
            (10 * MIB, size - MIB, 0xAB),
            (size - MIB, size, 0),
        ]
    );

    // A partition said to reach past the end is refused before anything is written.
    fs::write(part.join("size"), "99999999\n").unwrap();
    fill(&w.stand_in(), size);
    let r = w.run(&w.nvme, &[ScrubAction::WipeNvmeLabels {}], &w.env());
    assert!(!r.ok, "{r:?}");
    assert!(detail(&r, 0).contains("beyond"), "{r:?}");
    assert_eq!(runs(&fs::read(w.stand_in()).unwrap()), [(0, size, 0xAB)]);
}

#[test]
fn wipe_nvme_labels_respects_the_size() {
    let w = World::new();
    let ns = w.dir_of(&w.nvme).join("nvme/nvme0/nvme0n1");
    // Smaller than 2 MiB: all of it.
    fs::write(ns.join("size"), "3000\n").unwrap();
    fill(&w.stand_in(), 3000 * 512);
    let r = w.run(&w.nvme, &[ScrubAction::WipeNvmeLabels {}], &w.env());
    assert!(r.ok, "{r:?}");
    assert_eq!(runs(&fs::read(w.stand_in()).unwrap()), [(0, 3000 * 512, 0)]);

    // A device whose size differs from what sysfs says is not the namespace: untouched.
    fill(&w.stand_in(), 4000 * 512);
    let r = w.run(&w.nvme, &[ScrubAction::WipeNvmeLabels {}], &w.env());
    assert!(!r.ok, "{r:?}");
    assert!(detail(&r, 0).contains("sysfs says"), "{r:?}");
    assert_eq!(
        runs(&fs::read(w.stand_in()).unwrap()),
        [(0, 4000 * 512, 0xAB)]
    );

    // No device node: failed, and nothing created.
    fs::remove_file(w.stand_in()).unwrap();
    let r = w.run(&w.nvme, &[ScrubAction::WipeNvmeLabels {}], &w.env());
    assert!(!r.ok, "{r:?}");
    assert!(!w.stand_in().exists());

    // A garbage size is an error, not a panic.
    fs::write(ns.join("size"), "lots\n").unwrap();
    let r = w.run(&w.nvme, &[ScrubAction::WipeNvmeLabels {}], &w.env());
    assert!(!r.ok && detail(&r, 0).contains("sector count"), "{r:?}");

    // A function without namespaces has nothing to wipe.
    let r = w.run(&w.gpus[0], &[ScrubAction::WipeNvmeLabels {}], &w.env());
    assert!(r.ok, "{r:?}");
    assert_eq!(detail(&r, 0), "no namespaces");
}

#[test]
fn default_pipelines_follow_the_class() {
    use ScrubAction::*;
    let w = World::new();
    let ops = w.ops.as_ref();
    assert_eq!(
        default_pipeline(ops, &w.gpus[0]),
        [Reset {}, NvidiaReset {}, ZeroGpuMemory {}, VerifyDriver {}]
    );
    assert_eq!(
        default_pipeline(ops, &w.nvme),
        [WipeNvmeLabels {}, Reset {}, VerifyDriver {}]
    );
    assert_eq!(default_pipeline(ops, &w.nic), [Reset {}, VerifyDriver {}]);
    // Another vendor's GPU, and a processing accelerator (class 12): no NVIDIA steps.
    fs::write(w.dir_of(&w.gpus[1]).join("vendor"), "0x1002\n").unwrap();
    assert_eq!(
        default_pipeline(ops, &w.gpus[1]),
        [Reset {}, VerifyDriver {}]
    );
    fs::write(w.dir_of(&w.gpus[0]).join("class"), "0x120000\n").unwrap();
    assert_eq!(
        default_pipeline(ops, &w.gpus[0]),
        [Reset {}, NvidiaReset {}, ZeroGpuMemory {}, VerifyDriver {}]
    );
    let ghost: DevicePath = "/devices/pci0000:00/0000:00:09.0".parse().unwrap();
    assert_eq!(default_pipeline(ops, &ghost), [Reset {}, VerifyDriver {}]);
    let r = w.run(&ghost, &default_pipeline(ops, &ghost), &w.env());
    assert!(!r.ok);
    assert_eq!(names(&r), ["reset"]);
}

fn executor(w: &World) -> Executor {
    let state = w.dir.path().join("state");
    let hv = Arc::new(SimHypervisor::open(&state, Some(&w.root)).unwrap());
    Executor::new(Binder::new(w.ops.clone(), &state), hv)
}

#[test]
fn task_scrub_uses_default_pipelines() {
    let w = World::new();
    fill(&w.stand_in(), FAKE_NVME_BYTES as usize);
    let exec = executor(&w);
    let r = exec.execute(&Task::Scrub {
        devices: vec![w.gpus[0].clone(), w.nvme.clone(), w.nic.clone()],
        pipelines: BTreeMap::new(),
    });
    assert!(r.ok, "{r:?}");
    let reports = &r.scrub_reports;
    assert_eq!(reports.len(), 3);
    assert_eq!(
        names(&reports[0]),
        ["reset", "nvidia_reset", "zero_gpu_memory", "verify_driver"]
    );
    // No nvidia-smi in a tree without vGPUs; the tree's zeroing helper clears the GPU.
    assert!(reports[0].steps[1].skipped && !reports[0].steps[2].skipped);
    assert!(
        detail(&reports[0], 2).contains(": zeroed and verified 0.0 of 0.0 GiB in "),
        "{:?}",
        reports[0]
    );
    assert_eq!(
        names(&reports[1]),
        ["wipe_nvme_labels", "reset", "verify_driver"]
    );
    assert_eq!(names(&reports[2]), ["reset", "verify_driver"]);
    let data = fs::read(w.stand_in()).unwrap();
    assert!(data[..MIB].iter().all(|&b| b == 0));
    // The fake node never looked at the host's tools: a fake GPU's reset is skipped
    // even on a machine with nvidia-smi installed.
    assert_eq!(detail(&reports[0], 1), "nvidia-smi not installed");
    let resets = w.resets();
    for d in [&w.gpus[0], &w.nvme, &w.nic] {
        assert!(resets.contains(&d.address().to_string()), "{resets}");
    }

    // With the node's tools configured, the same task runs them.
    let args = w.out("smi-args");
    let mut env = w.env();
    env.nvidia_smi = Some(script(
        &w.bin(),
        "nvidia-smi",
        &format!("echo \"$@\" >> {}", args.display()),
    ));
    let exec = exec.with_scrub_env(env);
    let r = exec.execute(&Task::Scrub {
        devices: vec![w.gpus[0].clone(), w.gpus[1].clone()],
        pipelines: BTreeMap::new(),
    });
    assert!(r.ok, "{r:?}");
    assert!(!r.scrub_reports[0].steps[1].skipped);
    assert_eq!(fs::read_to_string(&args).unwrap().lines().count(), 2);
}

#[test]
fn task_scrub_uses_explicit_pipelines() {
    let w = World::new();
    let exec = executor(&w);
    let marker = w.out("marker");
    let touch = script(
        &w.bin(),
        "touch-marker",
        &format!("echo \"$1\" >> {}", marker.display()),
    );
    let mut pipelines = BTreeMap::new();
    pipelines.insert(
        w.gpus[0].to_string(),
        vec![
            ScrubAction::Command {
                argv: vec![touch.display().to_string(), "{bdf}".to_string()],
                timeout_secs: None,
            },
            ScrubAction::VerifyDriver {},
        ],
    );
    // A key with its hex digits in upper case still names the device.
    let smbus: DevicePath = "/devices/pci0000:00/0000:00:1f.4".parse().unwrap();
    assert!(w.dir_of(&smbus).is_dir());
    pipelines.insert(
        "/devices/pci0000:00/0000:00:1F.4".to_string(),
        vec![ScrubAction::VerifyDriver {}],
    );
    let r = exec.execute(&Task::Scrub {
        devices: vec![w.gpus[0].clone(), w.gpus[1].clone(), smbus.clone()],
        pipelines: pipelines.clone(),
    });
    assert!(r.ok, "{r:?}");
    assert_eq!(names(&r.scrub_reports[0]), ["command", "verify_driver"]);
    assert_eq!(
        names(&r.scrub_reports[1]),
        ["reset", "nvidia_reset", "zero_gpu_memory", "verify_driver"],
        "a device without a pipeline gets the default"
    );
    assert_eq!(names(&r.scrub_reports[2]), ["verify_driver"]);
    assert_eq!(
        fs::read_to_string(&marker).unwrap().trim(),
        w.gpus[0].address().to_string()
    );
    assert!(
        !w.resets().contains(&w.gpus[0].address().to_string()),
        "the explicit pipeline has no reset"
    );

    // Too many steps, or none: that device fails, the others are still scrubbed.
    pipelines.insert(
        w.gpus[1].to_string(),
        vec![ScrubAction::VerifyDriver {}; MAX_SCRUB_STEPS + 1],
    );
    pipelines.insert(w.nic.to_string(), vec![]);
    let r = exec.execute(&Task::Scrub {
        devices: vec![w.gpus[0].clone(), w.gpus[1].clone(), w.nic.clone()],
        pipelines,
    });
    assert!(!r.ok);
    assert_eq!(r.scrub_reports.len(), 3);
    assert!(r.scrub_reports[0].ok);
    for bad in &r.scrub_reports[1..] {
        assert!(!bad.ok);
        assert_eq!(names(bad), ["pipeline"]);
    }
    assert!(detail(&r.scrub_reports[1], 0).contains("more than the 16"));
    assert!(detail(&r.scrub_reports[2], 0).contains("no steps"));
    let err = r.error.unwrap();
    assert!(err.contains(&w.gpus[1].to_string()) && err.contains(&w.nic.to_string()));
}
