//! A GPU VM laid out as on a real HGX host, proved under emulation: eight stand-ins with
//! an H100's 128 GiB BAR each (`ivshmem-plain` over reserved, untouched memory) on a
//! generated tree with two NUMA nodes, booted by the agent through OVMF with guest RAM
//! from 2 MiB huge pages. The guest's firmware must map all eight BARs below the address
//! width QEMU gives the guest, the guest must see them on two NUMA nodes, four each, and
//! the RAM must come from the huge pages. Then a VM that requires huge pages and cannot
//! have them is refused with the reason.
//!
//! What only a real host shows: vfio pinning the RAM, the GPUs' own option ROMs and
//! drivers, and KVM's `host-phys-bits`.

use super::guest_boot::{run, test_image, wait_console};
use node_agent::agent::Executor;
use node_agent::fake::{FakeSpec, GpuModel, generate};
use node_agent::host::{Binder, open_sysfs};
use node_agent::hypervisor::{
    CpuModel, HugepagePolicy, PINNING_FILE, PinPolicy, Pinning, QemuConfig, QemuHypervisor,
    VmFiles, launch_plan, qmp::Qmp,
};
use node_agent::images::{DirSource, ImageService, cache::hash_file};
use passage_model::VmId;
use passage_model::images::ImageType;
use passage_model::protocol::{DiskSpec, ImageRef, Task, VmSpec};
use std::sync::Arc;
use std::time::{Duration, Instant};

const HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";
const FREE_2M: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";
const GIB: u64 = 1 << 30;

fn read_u64(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Gives the huge pages back however the test ends.
struct Reserved(u64);

impl Drop for Reserved {
    fn drop(&mut self) {
        let _ = std::fs::write(HUGEPAGES, self.0.to_string());
    }
}

/// The hugetlb memory a process maps, in KiB (`Shared_Hugetlb` + `Private_Hugetlb`).
fn hugetlb_kib(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    text.lines()
        .filter(|l| l.starts_with("Shared_Hugetlb:") || l.starts_with("Private_Hugetlb:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_h100_sized_stand_ins_boot_through_ovmf_on_two_numa_nodes_from_hugepages() {
    let Some(image) = test_image() else { return };
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sys");
    let state = dir.path().join("st");
    let tree = generate(
        &root,
        &FakeSpec {
            gpus: 8,
            model: GpuModel::H100,
            numa_nodes: 2,
        },
    )
    .unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let sha256 = hash_file(&image).unwrap();
    std::os::unix::fs::symlink(&image, src.join(sha256.as_str())).unwrap();
    let size = std::fs::metadata(&image).unwrap().len();

    let mut cfg = QemuConfig::from_path(Some(&root)).unwrap();
    cfg.accel = "tcg".into();
    cfg.stand_in_bars = true;
    cfg.hugepages = HugepagePolicy::Require;
    // Stand-ins are not pinned unless asked: this VM stands for a GPU VM, which is.
    cfg.pin_vcpus = PinPolicy::Always;
    let hv = Arc::new(QemuHypervisor::open(cfg.clone(), &state).unwrap());
    let _stop = super::StopOnDrop(hv.as_ref());
    let images = ImageService::new(&state, 10, Arc::new(DirSource::new(&src)));
    let exec = Arc::new(
        Executor::new(Binder::new(open_sysfs(&root).unwrap(), &state), hv.clone())
            .with_images(Arc::new(images)),
    );

    let vm = VmId::new_random();
    let spec = VmSpec {
        uuid: vm,
        vcpus: 2,
        memory_mib: 1024,
        devices: tree.gpus.clone(),
        disk: Some(DiskSpec {
            image: ImageRef {
                sha256,
                size,
                image_type: ImageType::Qcow2,
            },
            size_gib: 4,
        }),
        nics: Vec::new(),
        cloud_init: None,
        bootrom: None,
    };
    assert_eq!(tree.gpus.len(), 8);
    // The layout, as the start will make it (with no huge pages reserved yet, asking for
    // none).
    let plain = QemuConfig {
        hugepages: HugepagePolicy::Off,
        ..cfg.clone()
    };
    let plan = launch_plan(&plain, &spec).unwrap();
    let CpuModel::Max { phys_bits } = plan.cpu else {
        panic!("emulation gets the max CPU: {plan:?}")
    };
    assert_eq!(plan.layout.nodes.len(), 2, "{plan:?}");
    // Eight 256 GiB root-port windows (128 GiB + 32 MiB, aligned) and a GiB.
    assert_eq!(plan.layout.hole64, 2049 * GIB);

    // The RAM's 512 pages, and room for any other test's guest that starts meanwhile
    // and takes some (they prefer huge pages).
    let need = 1024 / 2;
    let before = read_u64(HUGEPAGES);
    let _give_back = Reserved(before);
    std::fs::write(HUGEPAGES, (before + need + 768).to_string()).unwrap();
    let free_before = read_u64(FREE_2M);
    assert!(
        free_before >= need,
        "the kernel gave {free_before} free 2 MiB pages, fewer than {need}"
    );

    let files = VmFiles::new(&state, vm);
    let t = Instant::now();
    let r = run(
        &exec,
        Task::BootVm {
            vm: spec.clone(),
            vgpu_types: Default::default(),
        },
    )
    .await;
    assert!(r.ok, "boot_vm: {:?}", r.error);
    let started = t.elapsed();
    let pid: u32 = std::fs::read_to_string(&files.pid)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        hugetlb_kib(pid),
        1024 * 1024,
        "the guest's RAM is all huge pages"
    );
    // Each vCPU thread (named by `debug-threads=on`) may run only on the CPU the agent
    // chose for it and recorded.
    let chosen: Pinning =
        serde_json::from_slice(&std::fs::read(files.dir.join(PINNING_FILE)).unwrap()).unwrap();
    assert_eq!(chosen.vcpus.len(), 2);
    let mut seen = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
        let Some(i) = comm
            .trim()
            .strip_prefix("CPU ")
            .and_then(|r| r.split('/').next())
            .and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        let status = std::fs::read_to_string(task.join("status")).unwrap();
        let allowed = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim()
            .to_string();
        assert_eq!(allowed, chosen.vcpus[i].to_string(), "vCPU {i} ({comm:?})");
        seen.push(i);
    }
    seen.sort_unstable();
    assert_eq!(seen, [0, 1], "both vCPU threads found");
    let free_after = read_u64(FREE_2M);
    assert!(
        free_before - free_after >= need,
        "the pool's free count dropped by {} pages, not the VM's {need}",
        free_before - free_after
    );

    // QEMU's view: every stand-in's 128 GiB BAR placed, below 2^phys-bits.
    let console = wait_console(&files.console, "PASSAGE-BOOT-COUNT=1", &files.log).await;
    eprintln!(
        "QEMU answered in {:.1}s; the guest reported {:.1}s after the start",
        started.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
    let limit = 1u64 << phys_bits;
    let mut qmp = Qmp::connect(&files.qmp, Duration::from_secs(5)).unwrap();
    let pci = qmp.execute("query-pci", None).unwrap();
    let mut bars = Vec::new();
    collect_bars(&pci, &mut bars);
    let big: Vec<&(u64, u64)> = bars.iter().filter(|(_, s)| *s == 128 * GIB).collect();
    assert_eq!(big.len(), 8, "eight 128 GiB BARs: {bars:x?}");
    for (addr, size) in &big {
        assert!(
            *addr != u64::MAX && addr + size <= limit,
            "a BAR at {addr:#x} is not placed below 2^{phys_bits}: {bars:x?}"
        );
    }

    // The guest's view: its own lspci shows the eight BARs, and its sysfs puts four
    // stand-ins on each of its two NUMA nodes.
    let regions: Vec<String> = super::reported(&console, "PASSAGE-LSPCI")
        .into_iter()
        .filter(|l| l.contains("[size=128G]"))
        .collect();
    assert_eq!(regions.len(), 8, "{console}");
    assert!(
        regions
            .iter()
            .all(|l| l.contains("(64-bit, prefetchable)") && !l.contains("disabled")),
        "{regions:?}"
    );
    let nodes: Vec<String> = super::reported(&console, "PASSAGE-IVSHMEM")
        .iter()
        .filter_map(|l| l.split_whitespace().nth(1).map(str::to_string))
        .collect();
    assert_eq!(nodes.iter().filter(|n| *n == "0").count(), 4, "{nodes:?}");
    assert_eq!(nodes.iter().filter(|n| *n == "1").count(), 4, "{nodes:?}");
    assert_eq!(super::reported(&console, "PASSAGE-FIRMWARE"), ["uefi"]);

    let r = run(&exec, Task::StopVm { vm_uuid: vm }).await;
    assert!(r.ok, "{:?}", r.error);

    // Under `require`, a start without enough free huge pages fails, saying so.
    drop(_give_back);
    let free = read_u64(FREE_2M);
    let mut big_vm = spec.clone();
    big_vm.memory_mib = (free + 64) * 2;
    let r = run(&exec, Task::StartVm { vm: big_vm }).await;
    assert!(!r.ok);
    let why = r.error.unwrap_or_default();
    assert!(
        why.contains("huge pages are required") && why.contains("pages of 2 MiB free"),
        "{why}"
    );
    assert!(hv_running_none(&*hv, vm), "nothing was started");
}

fn hv_running_none(hv: &dyn node_agent::hypervisor::Hypervisor, vm: VmId) -> bool {
    !hv.running().contains(&vm)
}

/// (address, size) of every memory BAR in a `query-pci` answer, bridges' devices too;
/// an unassigned one has address -1.
fn collect_bars(v: &serde_json::Value, out: &mut Vec<(u64, u64)>) {
    match v {
        serde_json::Value::Object(m) => {
            if let Some(regions) = m.get("regions").and_then(|r| r.as_array()) {
                for r in regions {
                    if r.get("type").and_then(|t| t.as_str()) == Some("memory") {
                        let addr = r
                            .get("address")
                            .and_then(|a| a.as_i64())
                            .map_or(u64::MAX, |a| if a < 0 { u64::MAX } else { a as u64 });
                        let size = r.get("size").and_then(|s| s.as_u64()).unwrap_or(0);
                        out.push((addr, size));
                    }
                }
            }
            for (k, x) in m {
                if k != "regions" {
                    collect_bars(x, out);
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_bars(x, out)),
        _ => {}
    }
}
