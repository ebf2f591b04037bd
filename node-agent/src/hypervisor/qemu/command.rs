//! The QEMU command line a VM is started with, built from its spec and what the node's
//! configuration says about how QEMU runs here.

use super::{QemuConfig, VmFiles};
use crate::net;
use passage_model::protocol::VmSpec;

/// The QEMU command line for `spec`: q35, no default devices, no display, the boot disk
/// (virtio-blk: Debian's cloud kernel has no AHCI), the cloud-init seed read-only when
/// the VM has one, the serial console to `console.log`,
/// one `vfio-pci` device per passed-through function (or an `edu` stand-in for each, see
/// [`QemuConfig::stand_in_devices`]), one virtio-net device per NIC on its tap (the
/// primary first, so the guest names it first), QMP on a unix socket.
pub fn qemu_argv(cfg: &QemuConfig, spec: &VmSpec, files: &VmFiles) -> Vec<String> {
    let mut argv = vec![
        cfg.binary.display().to_string(),
        "-name".into(),
        format!("guest={},debug-threads=on", spec.uuid),
        "-uuid".into(),
        spec.uuid.to_string(),
        "-machine".into(),
        format!("q35,accel={}", cfg.accel),
        "-m".into(),
        format!("{}M", spec.memory_mib),
        "-smp".into(),
        spec.vcpus.to_string(),
        "-nographic".into(),
        "-nodefaults".into(),
    ];
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
            "virtio-blk-pci,drive=disk0,bootindex=0".into(),
        ]);
    }
    if spec.cloud_init.is_some() {
        argv.extend([
            "-drive".into(),
            format!(
                "file={},if=virtio,format=raw,readonly=on",
                files.seed.display()
            ),
        ]);
    }
    argv.extend([
        "-chardev".into(),
        // Appended to, so a stopped and started VM keeps its earlier boots' output, and
        // so the agent may trim the file under QEMU (see `console`).
        format!(
            "file,id=console0,path={},append=on",
            files.console.display()
        ),
        "-serial".into(),
        "chardev:console0".into(),
    ]);
    for d in &spec.devices {
        argv.push("-device".into());
        let mdev = d
            .vgpu()
            .map(|u| format!("/sys/bus/mdev/devices/{}", u.hyphenated()));
        let is_mdev = cfg
            .sysfs_root
            .as_ref()
            .is_some_and(|r| crate::host::device_dir(r, d).is_dir());
        if cfg.stand_in_devices {
            argv.push("edu".into());
        } else if let (Some(mdev), true) = (mdev, is_mdev) {
            argv.push(format!("vfio-pci,sysfsdev={mdev}"));
        } else {
            // A function, or a vendor-VFIO vGPU: its VF (the path's last address).
            argv.push(format!("vfio-pci,host={}", d.address()));
        }
    }
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
            format!("virtio-net-pci,netdev=net{i},mac={}", nic.mac),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    #[test]
    fn command_line() {
        let cfg = QemuConfig {
            binary: PathBuf::from("/usr/bin/qemu-system-x86_64"),
            accel: "kvm:tcg".into(),
            sysfs_root: None,
            stand_in_devices: false,
        };
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
        let argv = qemu_argv(&cfg, &spec, &files);
        let dir = "/var/lib/passage-agent/qemu/6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10";
        assert_eq!(
            argv.join(" "),
            format!(
                "/usr/bin/qemu-system-x86_64 \
                 -name guest=6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10,debug-threads=on \
                 -uuid 6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10 -machine q35,accel=kvm:tcg \
                 -m 65536M -smp 8 -nographic -nodefaults \
                 -chardev file,id=console0,path={dir}/console.log,append=on -serial chardev:console0 \
                 -device vfio-pci,host=0000:3b:00.0 -device vfio-pci,host=0000:3b:00.1 \
                 -qmp unix:{dir}/qmp.sock,server,nowait -pidfile {dir}/qemu.pid"
            )
        );

        // With a boot disk, over a generated tree: virtio-blk and one edu per function.
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
        let line = qemu_argv(&cfg, &spec, &files).join(" ");
        assert!(
            line.contains(&format!(
                "-drive file={dir}/disk.qcow2,if=none,id=disk0,format=qcow2,cache=writeback \
                 -device virtio-blk-pci,drive=disk0,bootindex=0"
            )),
            "{line}"
        );
        assert_eq!(line.matches("-device edu").count(), 2, "{line}");
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
        let line = qemu_argv(&cfg, &spec, &files).join(" ");
        assert!(
            line.contains(&format!(
                "-device virtio-blk-pci,drive=disk0,bootindex=0 \
                 -drive file={dir}/seed.img,if=virtio,format=raw,readonly=on -chardev"
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
        let cfg = QemuConfig {
            binary: PathBuf::from("qemu-system-x86_64"),
            accel: "tcg".into(),
            sysfs_root: None,
            stand_in_devices: false,
        };
        let line = qemu_argv(&cfg, &spec, &VmFiles::new(Path::new("/st"), spec.uuid)).join(" ");
        assert!(
            line.contains(
                "-netdev tap,id=net1,ifname=psg1b2c3d4e5f61,script=no,downscript=no \
                 -device virtio-net-pci,netdev=net1,mac=02:00:00:00:00:0b \
                 -netdev tap,id=net0,ifname=psg1b2c3d4e5f60,script=no,downscript=no \
                 -device virtio-net-pci,netdev=net0,mac=02:00:00:00:00:0a -qmp"
            ),
            "{line}"
        );
    }

    /// An mdev vGPU is passed by its sysfs path; a vendor-VFIO vGPU by its VF's address.
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
            binary: PathBuf::from("qemu-system-x86_64"),
            accel: "tcg".into(),
            sysfs_root: Some(root.path().to_path_buf()),
            stand_in_devices: false,
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
        let line = qemu_argv(&cfg, &spec, &VmFiles::new(root.path(), spec.uuid)).join(" ");
        assert!(
            line.contains(
                "-device vfio-pci,sysfsdev=/sys/bus/mdev/devices/\
                 c9e2d4a0-3f7e-4c89-9a43-0d2f5a6b7c8d -device vfio-pci,host=0000:3b:00.4"
            ),
            "{line}"
        );
    }
}
