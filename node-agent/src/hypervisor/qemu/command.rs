//! The QEMU command line a VM is started with, built from its spec and what the node's
//! configuration says about how QEMU runs here.

use super::layout::{Layout, PassedFunction};
use super::{QemuConfig, VmFiles};
use crate::net;
use passage_model::images::Bootrom;
use passage_model::protocol::VmSpec;
use std::collections::BTreeMap;

/// Where OVMF keeps a VM's UEFI variables: a copy of the template, made at its first
/// start and kept with its disk, so boot entries and settings survive a stop.
pub const OVMF_VARS_FILE: &str = "OVMF_VARS.fd";
/// The copy being made.
pub const OVMF_VARS_TMP_FILE: &str = "OVMF_VARS.fd.tmp";

/// The per-VM copy of OVMF's variables.
pub fn vars_path(files: &VmFiles) -> std::path::PathBuf {
    files.dir.join(OVMF_VARS_FILE)
}

/// How the guest's RAM is backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// Ordinary pages, as QEMU allocates them.
    Plain,
    /// Hugepages of this size (KiB), preallocated at start: vfio pins all of a VM's RAM
    /// anyway, and hugepages make that and every DMA the GPU does cheaper.
    Hugepages { page_kib: u64 },
}

/// The guest CPU model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuModel {
    /// Under KVM: the host's CPU with the host's address width (a GPU's BARs sit high).
    Host,
    /// Under emulation: every feature QEMU emulates, with this address width.
    Max { phys_bits: u8 },
}

/// What a launch decided from the host before the command line is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchPlan {
    /// What the host says about each of the spec's devices, in the spec's order.
    pub functions: Vec<PassedFunction>,
    pub layout: Layout,
    pub bootrom: Bootrom,
    pub cpu: CpuModel,
    pub backing: Backing,
    /// Bind each guest node's RAM to its host NUMA node (`policy=bind`); off where the
    /// host does not have the nodes the devices report (a generated tree).
    pub bind_numa: bool,
}

/// How each passed function appears in the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StandIn {
    /// The function itself, through vfio-pci.
    None,
    /// A QEMU `edu` device (1234:11e8) per function: a guest can count them.
    Edu,
    /// An `ivshmem-plain` (1af4:1110) per function whose shared-memory BAR has the size
    /// of the function's largest 64-bit BAR, backed by memory that is reserved, not
    /// allocated: the guest's firmware and kernel must place BARs of the real sizes.
    SizedBars,
}

/// The largest 64-bit BAR of a function, as a power of two (what an `ivshmem-plain`
/// stand-in can have); 1 MiB for a function without one.
fn stand_in_bar(f: &PassedFunction) -> u64 {
    f.bars
        .iter()
        .filter(|b| b.kind == passage_model::BarKind::Memory && b.is_64bit)
        .map(|b| b.size.next_power_of_two())
        .max()
        .unwrap_or(1 << 20)
        .max(1 << 20)
}

/// `N` in MiB, or `NG` when whole GiB.
fn size_arg(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 30) {
        format!("{}G", bytes >> 30)
    } else {
        format!("{}M", bytes.div_ceil(1 << 20))
    }
}

/// A compact list (`0-3,8`) of the numbers in `r`.
fn range_arg(r: &std::ops::Range<u32>) -> String {
    match r.end - r.start {
        1 => r.start.to_string(),
        _ => format!("{}-{}", r.start, r.end - 1),
    }
}

/// The QEMU command line for `spec` as `plan` lays it out: q35, the firmware and CPU
/// model, the guest RAM (hugepage-backed, NUMA-bound where the plan says), no default
/// devices, no display, the boot disk (virtio-blk: Debian's cloud kernel has no AHCI),
/// the cloud-init seed read-only when the VM has one, the serial console to
/// `console.log`, each passed device on a PCIe root port of its own (behind a
/// `pxb-pcie` expander per guest NUMA node when it has several), one virtio-net device
/// per NIC on its tap (the primary first, so the guest names it first), QMP on a unix
/// socket.
pub fn qemu_argv(
    cfg: &QemuConfig,
    spec: &VmSpec,
    files: &VmFiles,
    plan: &LaunchPlan,
) -> Vec<String> {
    let layout = &plan.layout;
    let mut argv = vec![
        cfg.binary.display().to_string(),
        "-name".into(),
        format!("guest={},debug-threads=on", spec.uuid),
        "-uuid".into(),
        spec.uuid.to_string(),
    ];
    let single_backend = layout.nodes.is_empty() && needs_backend(plan);
    let mut machine = format!("q35,accel={}", cfg.accel);
    if single_backend {
        machine.push_str(",memory-backend=ram0");
    }
    argv.extend(["-machine".into(), machine, "-cpu".into()]);
    argv.push(match plan.cpu {
        CpuModel::Host => "host,host-phys-bits=on".into(),
        CpuModel::Max { phys_bits } => format!("max,phys-bits={phys_bits}"),
    });
    if layout.hole64 > 0 {
        argv.extend([
            "-global".into(),
            format!("q35-pcihost.pci-hole64-size={}", size_arg(layout.hole64)),
        ]);
        if plan.bootrom == Bootrom::Uefi {
            // OVMF sizes its 64-bit aperture from this, not from QEMU's hole.
            argv.extend([
                "-fw_cfg".into(),
                format!(
                    "name=opt/ovmf/X-PciMmio64Mb,string={}",
                    layout.hole64.div_ceil(1 << 20)
                ),
            ]);
        }
    }
    if plan.bootrom == Bootrom::Uefi {
        argv.extend([
            "-drive".into(),
            format!(
                "if=pflash,format=raw,unit=0,file={},readonly=on",
                cfg.ovmf_code.display()
            ),
            "-drive".into(),
            format!(
                "if=pflash,format=raw,unit=1,file={}",
                vars_path(files).display()
            ),
        ]);
    }
    argv.extend([
        "-m".into(),
        format!("{}M", spec.memory_mib),
        "-smp".into(),
        spec.vcpus.to_string(),
    ]);
    if single_backend {
        argv.extend([
            "-object".into(),
            backend(plan, "ram0", spec.memory_mib, None),
        ]);
    }
    for (k, n) in layout.nodes.iter().enumerate() {
        let id = format!("ram{k}");
        argv.extend([
            "-object".into(),
            backend(plan, &id, n.memory_mib, Some(n.host_node)),
            "-numa".into(),
            if n.vcpus.is_empty() {
                format!("node,nodeid={k},memdev={id}")
            } else {
                format!("node,nodeid={k},cpus={},memdev={id}", range_arg(&n.vcpus))
            },
        ]);
    }
    argv.extend(["-nographic".into(), "-nodefaults".into()]);
    // Every device not behind a root port names `bus=pcie.0`: QEMU gives a device without
    // a bus the last bus made, which is an expander's once there are any, and an
    // expander takes only bridges.
    if spec.disk.is_some() {
        argv.extend([
            "-drive".into(),
            // writeback: the guest's flushes still reach the disk; cache=none needs
            // O_DIRECT, which tmpfs and some overlay file systems refuse.
            format!(
                "file={},if=none,id=disk0,format=qcow2,cache=writeback",
                files.disk.display()
            ),
            "-device".into(),
            "virtio-blk-pci,drive=disk0,bootindex=0,bus=pcie.0".into(),
        ]);
    }
    if spec.cloud_init.is_some() {
        argv.extend([
            "-drive".into(),
            format!(
                "file={},if=none,id=seed0,format=raw,readonly=on",
                files.seed.display()
            ),
            "-device".into(),
            "virtio-blk-pci,drive=seed0,bus=pcie.0".into(),
        ]);
    }
    argv.extend([
        "-chardev".into(),
        // A socket for the interactive console (one client at a time; nothing waits for
        // one), and every byte the guest prints also goes to the log, whether a client is
        // connected or not. The log is appended to (O_APPEND), so a stopped and started VM
        // keeps its earlier boots' output, and so the agent may trim the file under QEMU
        // (see `console`).
        format!(
            "socket,id=console0,path={},server=on,wait=off,logfile={},logappend=on",
            files.serial.display(),
            files.console.display()
        ),
        "-serial".into(),
        "chardev:console0".into(),
    ]);
    devices(cfg, spec, plan, &mut argv);
    // Stable: the others keep the spec's order.
    let mut nics: Vec<(usize, &passage_model::protocol::NicSpec)> =
        spec.nics.iter().enumerate().collect();
    nics.sort_by_key(|(_, n)| !n.primary);
    for (i, nic) in nics {
        argv.extend([
            "-netdev".into(),
            format!(
                "tap,id=net{i},ifname={},script=no,downscript=no",
                net::tap_name(spec.uuid, i)
            ),
            "-device".into(),
            format!("virtio-net-pci,netdev=net{i},mac={},bus=pcie.0", nic.mac),
        ]);
    }
    argv.extend([
        "-qmp".into(),
        format!("unix:{},server,nowait", files.qmp.display()),
        "-pidfile".into(),
        files.pid.display().to_string(),
    ]);
    argv
}

/// Whether the RAM needs a memory backend object of its own (hugepages or a NUMA bind);
/// plain RAM on one node is QEMU's default and needs none.
fn needs_backend(plan: &LaunchPlan) -> bool {
    plan.backing != Backing::Plain || (plan.bind_numa && single_host_node(plan).is_some())
}

/// The one host node all of a VM's devices report, if they report one.
fn single_host_node(plan: &LaunchPlan) -> Option<u32> {
    let mut nodes = plan.functions.iter().filter_map(|f| f.numa_node);
    let first = nodes.next()?;
    nodes.all(|n| n == first).then_some(first)
}

fn backend(plan: &LaunchPlan, id: &str, mib: u64, host_node: Option<u32>) -> String {
    let mut s = match plan.backing {
        Backing::Plain => format!("memory-backend-ram,id={id},size={mib}M"),
        Backing::Hugepages { page_kib } => format!(
            "memory-backend-memfd,id={id},size={mib}M,hugetlb=on,hugetlbsize={},prealloc=on",
            size_arg(page_kib * 1024)
        ),
    };
    let node = host_node.or_else(|| single_host_node(plan));
    if plan.bind_numa
        && let Some(n) = node
    {
        s.push_str(&format!(",host-nodes={n},policy=bind"));
    }
    s
}

/// The expanders, root ports and the devices on them. Root ports on `pcie.0` take
/// slots from 0x10 as multifunction groups of eight (as libvirt packs them), clear of
/// the slots QEMU gives the disks and NICs from 1 upwards; on an expander, from slot 0.
fn devices(cfg: &QemuConfig, spec: &VmSpec, plan: &LaunchPlan, argv: &mut Vec<String>) {
    let layout = &plan.layout;
    let stand_in = cfg.stand_in();
    for (k, bus_nr) in layout.expander_buses.iter().enumerate() {
        argv.extend([
            "-device".into(),
            format!("pxb-pcie,id=pxb{k},bus_nr={bus_nr},numa_node={k},bus=pcie.0"),
        ]);
    }
    let mut per_bus: BTreeMap<Option<usize>, u32> = BTreeMap::new();
    for (i, slot) in layout.slots.iter().enumerate() {
        let n = per_bus.entry(slot.guest_node).or_insert(0);
        let (bus, first) = match slot.guest_node {
            Some(k) => (format!("pxb{k}"), 0),
            None => ("pcie.0".to_string(), 0x10),
        };
        let (dev, func) = (first + *n / 8, *n % 8);
        *n += 1;
        let multi = if func == 0 { ",multifunction=on" } else { "" };
        argv.extend([
            "-device".into(),
            format!(
                "pcie-root-port,id=rp{i},bus={bus},addr={dev:#04x}.{func}{multi},chassis={}",
                i + 1
            ),
        ]);
        let several = slot.functions.len() > 1;
        for (gf, &fi) in slot.functions.iter().enumerate() {
            let d = &spec.devices[fi];
            let at = format!(
                "bus=rp{i},addr=0.{gf}{}",
                if gf == 0 && several {
                    ",multifunction=on"
                } else {
                    ""
                }
            );
            let line = match stand_in {
                StandIn::Edu => format!("edu,{at}"),
                StandIn::SizedBars => {
                    let id = format!("bar{i}.{gf}");
                    argv.extend([
                        "-object".into(),
                        format!(
                            "memory-backend-ram,id={id},size={},share=on,reserve=off",
                            size_arg(plan.functions.get(fi).map_or(1 << 20, stand_in_bar))
                        ),
                    ]);
                    format!("ivshmem-plain,memdev={id},{at}")
                }
                StandIn::None => {
                    let mdev = d
                        .vgpu()
                        .map(|u| format!("/sys/bus/mdev/devices/{}", u.hyphenated()));
                    let is_mdev = cfg
                        .sysfs_root
                        .as_ref()
                        .is_some_and(|r| crate::host::device_dir(r, d).is_dir());
                    let mut l = match (mdev, is_mdev) {
                        (Some(mdev), true) => format!("vfio-pci,sysfsdev={mdev},{at}"),
                        // A function, or a vendor-VFIO vGPU: its VF (the path's last
                        // address).
                        _ => format!("vfio-pci,host={},{at}", d.address()),
                    };
                    if gf == 0
                        && let Some(c) = slot.clique
                    {
                        l.push_str(&format!(",x-nv-gpudirect-clique={c}"));
                    }
                    l
                }
            };
            argv.extend(["-device".into(), line]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::layout::{self, PassedFunction};
    use super::*;
    use std::path::{Path, PathBuf};

    fn cfg(accel: &str) -> QemuConfig {
        QemuConfig {
            binary: PathBuf::from("/usr/bin/qemu-system-x86_64"),
            accel: accel.into(),
            sysfs_root: None,
            stand_in_devices: false,
            stand_in_bars: false,
            ovmf_code: PathBuf::from("/usr/share/OVMF/OVMF_CODE_4M.fd"),
            ovmf_vars: PathBuf::from("/usr/share/OVMF/OVMF_VARS_4M.fd"),
            start: Default::default(),
            hugepages: super::super::HugepagePolicy::Prefer,
            pin_vcpus: super::super::PinPolicy::Never,
            host_reserved_cpus: Default::default(),
            host_sysfs: PathBuf::from("/sys"),
        }
    }

    /// The plan for devices the host says nothing about.
    fn bare_plan(spec: &VmSpec, bootrom: Bootrom, cpu: CpuModel) -> LaunchPlan {
        let functions: Vec<PassedFunction> = spec
            .devices
            .iter()
            .map(|d| PassedFunction {
                path: d.clone(),
                vendor: 0x10de,
                class: 0x030200,
                numa_node: None,
                switch: None,
                bars: Vec::new(),
            })
            .collect();
        LaunchPlan {
            layout: layout::plan(spec.vcpus, spec.memory_mib, &functions, 4).unwrap(),
            functions,
            bootrom,
            cpu,
            backing: Backing::Plain,
            bind_numa: false,
        }
    }

    #[test]
    fn command_line() {
        let cfg = cfg("kvm:tcg");
        let mut spec = VmSpec {
            uuid: "6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10".parse().unwrap(),
            vcpus: 8,
            memory_mib: 65536,
            devices: vec![
                "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0"
                    .parse()
                    .unwrap(),
                "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.1"
                    .parse()
                    .unwrap(),
            ],
            disk: None,
            nics: Vec::new(),
            cloud_init: None,
            bootrom: None,
        };
        let files = VmFiles::new(Path::new("/var/lib/passage-agent"), spec.uuid);
        let plan = bare_plan(&spec, Bootrom::Uefi, CpuModel::Host);
        let argv = qemu_argv(&cfg, &spec, &files, &plan);
        let dir = "/var/lib/passage-agent/qemu/6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10";
        // A GPU and its second function: one root port, one multifunction device.
        assert_eq!(
            argv.join(" "),
            format!(
                "/usr/bin/qemu-system-x86_64 \
                 -name guest=6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10,debug-threads=on \
                 -uuid 6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10 -machine q35,accel=kvm:tcg \
                 -cpu host,host-phys-bits=on \
                 -drive if=pflash,format=raw,unit=0,file=/usr/share/OVMF/OVMF_CODE_4M.fd,readonly=on \
                 -drive if=pflash,format=raw,unit=1,file={dir}/OVMF_VARS.fd \
                 -m 65536M -smp 8 -nographic -nodefaults \
                 -chardev socket,id=console0,path={dir}/serial.sock,server=on,wait=off,logfile={dir}/console.log,logappend=on -serial chardev:console0 \
                 -device pcie-root-port,id=rp0,bus=pcie.0,addr=0x10.0,multifunction=on,chassis=1 \
                 -device vfio-pci,host=0000:3b:00.0,bus=rp0,addr=0.0,multifunction=on \
                 -device vfio-pci,host=0000:3b:00.1,bus=rp0,addr=0.1 \
                 -qmp unix:{dir}/qmp.sock,server,nowait -pidfile {dir}/qemu.pid"
            )
        );

        // With a boot disk, over a generated tree: virtio-blk and one edu per function;
        // SeaBIOS when asked, and the emulated CPU.
        spec.disk = Some(passage_model::protocol::DiskSpec {
            image: passage_model::protocol::ImageRef {
                sha256: "ab".repeat(32).parse().unwrap(),
                size: 1,
                image_type: passage_model::images::ImageType::Raw,
            },
            size_gib: 10,
        });
        let cfg = QemuConfig {
            stand_in_devices: true,
            ..cfg
        };
        let plan = bare_plan(&spec, Bootrom::Bios, CpuModel::Max { phys_bits: 40 });
        let line = qemu_argv(&cfg, &spec, &files, &plan).join(" ");
        assert!(
            line.contains(&format!(
                "-drive file={dir}/disk.qcow2,if=none,id=disk0,format=qcow2,cache=writeback \
                 -device virtio-blk-pci,drive=disk0,bootindex=0,bus=pcie.0"
            )),
            "{line}"
        );
        assert!(line.contains("-cpu max,phys-bits=40 -m"), "{line}");
        assert!(!line.contains("pflash"), "{line}");
        assert!(
            line.contains(
                "-device edu,bus=rp0,addr=0.0,multifunction=on -device edu,bus=rp0,addr=0.1"
            ),
            "{line}"
        );
        assert!(!line.contains("vfio-pci"), "{line}");
        assert!(!line.contains("seed.img"), "no cloud-init, no seed: {line}");

        // With cloud-init: the seed, read-only, after the boot disk.
        spec.cloud_init = Some(passage_model::protocol::CloudInitSpec {
            hostname: "web-1".into(),
            ssh_authorized_keys: Vec::new(),
            user_data: None,
            user_script: None,
            metadata: Default::default(),
        });
        let line = qemu_argv(&cfg, &spec, &files, &plan).join(" ");
        assert!(
            line.contains(&format!(
                "-device virtio-blk-pci,drive=disk0,bootindex=0,bus=pcie.0 \
                 -drive file={dir}/seed.img,if=none,id=seed0,format=raw,readonly=on \
                 -device virtio-blk-pci,drive=seed0,bus=pcie.0 -chardev"
            )),
            "{line}"
        );
    }

    /// One tap netdev and virtio-net device per NIC, the primary first, each keeping its
    /// NIC's index in its ids and tap name.
    #[test]
    fn nics_on_the_command_line() {
        let nic = |mac: &str, primary| passage_model::protocol::NicSpec {
            mac: mac.into(),
            ip: "192.0.2.10".parse().unwrap(),
            prefix_len: 24,
            gateway: None,
            resolvers: Vec::new(),
            bridge: "br0".into(),
            vlan_id: 0,
            mtu: 1500,
            primary,
        };
        let spec = VmSpec {
            uuid: "0190f3c4-7a2b-7c3d-8e4f-a1b2c3d4e5f6".parse().unwrap(),
            vcpus: 1,
            memory_mib: 64,
            devices: Vec::new(),
            disk: None,
            nics: vec![
                nic("02:00:00:00:00:0a", false),
                nic("02:00:00:00:00:0b", true),
            ],
            cloud_init: None,
            bootrom: None,
        };
        let cfg = cfg("tcg");
        let plan = bare_plan(&spec, Bootrom::Bios, CpuModel::Max { phys_bits: 40 });
        let line = qemu_argv(
            &cfg,
            &spec,
            &VmFiles::new(Path::new("/st"), spec.uuid),
            &plan,
        )
        .join(" ");
        assert!(
            line.contains(
                "-netdev tap,id=net1,ifname=psg1b2c3d4e5f61,script=no,downscript=no \
                 -device virtio-net-pci,netdev=net1,mac=02:00:00:00:00:0b,bus=pcie.0 \
                 -netdev tap,id=net0,ifname=psg1b2c3d4e5f60,script=no,downscript=no \
                 -device virtio-net-pci,netdev=net0,mac=02:00:00:00:00:0a,bus=pcie.0 -qmp"
            ),
            "{line}"
        );
    }

    /// An mdev vGPU is passed by its sysfs path; a vendor-VFIO vGPU by its VF's address.
    /// Each is a device of its own, on a root port of its own.
    #[test]
    fn vgpus_on_the_command_line() {
        let root = tempfile::tempdir().unwrap();
        let mdev: passage_model::DevicePath = "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/\
                                c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c8d"
            .parse()
            .unwrap();
        std::fs::create_dir_all(crate::host::device_dir(root.path(), &mdev)).unwrap();
        let vf: passage_model::DevicePath = "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.4/\
                              0b6e3f55-6a55-4a11-8f1e-2d1b8f0c9e77"
            .parse()
            .unwrap();
        let cfg = QemuConfig {
            sysfs_root: Some(root.path().to_path_buf()),
            ..cfg("tcg")
        };
        let spec = VmSpec {
            uuid: "6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10".parse().unwrap(),
            vcpus: 1,
            memory_mib: 1024,
            devices: vec![mdev, vf],
            disk: None,
            nics: Vec::new(),
            cloud_init: None,
            bootrom: None,
        };
        let plan = bare_plan(&spec, Bootrom::Uefi, CpuModel::Max { phys_bits: 40 });
        let line = qemu_argv(&cfg, &spec, &VmFiles::new(root.path(), spec.uuid), &plan).join(" ");
        assert!(
            line.contains(
                "-device vfio-pci,sysfsdev=/sys/bus/mdev/devices/\
                 c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c8d,bus=rp0,addr=0.0 \
                 -device pcie-root-port,id=rp1,bus=pcie.0,addr=0x10.1,chassis=2 \
                 -device vfio-pci,host=0000:3b:00.4,bus=rp1,addr=0.0"
            ),
            "{line}"
        );
    }

    /// Huge pages: a memfd backend of that page size, preallocated, as the machine's RAM;
    /// bound to the devices' host node when the plan binds.
    #[test]
    fn hugepage_backed_ram() {
        let spec = VmSpec {
            uuid: "6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10".parse().unwrap(),
            vcpus: 2,
            memory_mib: 4096,
            devices: vec![
                "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0"
                    .parse()
                    .unwrap(),
            ],
            disk: None,
            nics: Vec::new(),
            cloud_init: None,
            bootrom: None,
        };
        let mut plan = bare_plan(&spec, Bootrom::Uefi, CpuModel::Host);
        plan.backing = Backing::Hugepages {
            page_kib: 1024 * 1024,
        };
        plan.functions[0].numa_node = Some(1);
        plan.bind_numa = true;
        let line = qemu_argv(
            &cfg("kvm"),
            &spec,
            &VmFiles::new(Path::new("/st"), spec.uuid),
            &plan,
        )
        .join(" ");
        assert!(
            line.contains("-machine q35,accel=kvm,memory-backend=ram0 "),
            "{line}"
        );
        assert!(
            line.contains(
                "-m 4096M -smp 2 -object memory-backend-memfd,id=ram0,size=4096M,hugetlb=on,\
                 hugetlbsize=1G,prealloc=on,host-nodes=1,policy=bind -nographic"
            ),
            "{line}"
        );
    }

    /// The whole command line for GPUs of an HGX-like generated tree (two NUMA nodes, two
    /// GPUs behind each PCIe switch, 1 GiB huge pages free on each node), with a boot disk,
    /// a seed and a NIC, as the agent
    /// builds it on a KVM host from what the tree says: compared with the files under
    /// `golden/`, one argument a line. `PASSAGE_UPDATE_GOLDEN=1` writes them afresh.
    fn golden(name: &str, gpus: usize, audio: bool) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sys");
        let tree = crate::fake::generate_with(
            &root,
            &crate::fake::FakeSpec {
                gpus: 8,
                model: crate::fake::GpuModel::H100,
                numa_nodes: 2,
            },
            &crate::fake::FakeOptions {
                gpu_audio: audio,
                hugepages_per_node: (0, 512),
                ..Default::default()
            },
        )
        .unwrap();
        // One GPU per node first, so two GPUs span both nodes; then the rest in order.
        let mut order: Vec<usize> = vec![0, 4];
        order.extend((0..8).filter(|i| *i != 0 && *i != 4));
        let mut devices = Vec::new();
        for &i in order.iter().take(gpus) {
            let g = &tree.gpus[i];
            devices.push(g.clone());
            if audio {
                let a = g.address();
                let f = tree
                    .functions
                    .iter()
                    .find(|f| {
                        let b = f.address();
                        (b.domain, b.bus, b.device, b.function) == (a.domain, a.bus, a.device, 1)
                    })
                    .expect("the GPU's audio function");
                devices.push(f.clone());
            }
        }
        let cfg = QemuConfig {
            sysfs_root: Some(root.clone()),
            host_sysfs: root.clone(),
            ..cfg("kvm")
        };
        let spec = VmSpec {
            uuid: "6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10".parse().unwrap(),
            vcpus: 8 * gpus as u32,
            memory_mib: 128 * 1024 * gpus as u64,
            devices,
            disk: Some(passage_model::protocol::DiskSpec {
                image: passage_model::protocol::ImageRef {
                    sha256: "ab".repeat(32).parse().unwrap(),
                    size: 1,
                    image_type: passage_model::images::ImageType::Qcow2,
                },
                size_gib: 100,
            }),
            nics: vec![passage_model::protocol::NicSpec {
                mac: "02:00:00:00:00:0a".into(),
                ip: "192.0.2.10".parse().unwrap(),
                prefix_len: 24,
                gateway: None,
                resolvers: Vec::new(),
                bridge: "br0".into(),
                vlan_id: 0,
                mtu: 1500,
                primary: true,
            }],
            cloud_init: Some(passage_model::protocol::CloudInitSpec {
                hostname: "gpu-1".into(),
                ssh_authorized_keys: Vec::new(),
                user_data: None,
                user_script: None,
                metadata: Default::default(),
            }),
            bootrom: None,
        };
        let plan = super::super::launch_plan(&cfg, &spec).unwrap();
        let files = VmFiles::new(Path::new("/var/lib/passage-agent"), spec.uuid);
        let text = qemu_argv(&cfg, &spec, &files, &plan).join("\n") + "\n";
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("src/hypervisor/qemu/golden")
            .join(format!("{name}.txt"));
        if std::env::var("PASSAGE_UPDATE_GOLDEN").as_deref() == Ok("1") {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &text).unwrap();
        }
        let want = std::fs::read_to_string(&path).unwrap_or_default();
        assert_eq!(
            text,
            want,
            "{} differs (PASSAGE_UPDATE_GOLDEN=1 rewrites it)",
            path.display()
        );
    }

    #[test]
    fn golden_one_h100() {
        golden("h100x1", 1, false);
    }

    #[test]
    fn golden_two_h100s_on_two_nodes() {
        golden("h100x2", 2, false);
    }

    #[test]
    fn golden_four_h100s() {
        golden("h100x4", 4, false);
    }

    #[test]
    fn golden_eight_h100s() {
        golden("h100x8", 8, false);
    }

    #[test]
    fn golden_gpus_with_audio_functions() {
        golden("h100x2-audio", 2, true);
    }
}
