//! cloud-hypervisor: the command line only. Launching needs a guest firmware or kernel
//! the agent does not manage yet, so the backend refuses to start VMs.

use passage_model::protocol::VmSpec;
use std::path::Path;

pub const CLOUD_HYPERVISOR_BINARY: &str = "cloud-hypervisor";

/// `cloud-hypervisor` arguments for `spec`: the API socket, CPUs, memory, the firmware
/// (e.g. `hypervisor-fw` or `CLOUDHV.fd`), the boot disk (`--disk path=`, virtio-blk, when
/// the VM has one: the qcow2 overlay the `FetchImage` task made) and one `--device path=`
/// per function, named by its directory under `sysfs_root/bus/pci/devices/`, as
/// cloud-hypervisor's VFIO support expects.
pub fn cloud_hypervisor_argv(
    binary: &Path,
    spec: &VmSpec,
    api_socket: &Path,
    firmware: &Path,
    sysfs_root: &Path,
    disk: Option<&Path>,
) -> Vec<String> {
    let mut argv = vec![
        binary.display().to_string(),
        "--api-socket".into(),
        format!("path={}", api_socket.display()),
        "--cpus".into(),
        format!("boot={}", spec.vcpus),
        "--memory".into(),
        format!("size={}M", spec.memory_mib),
        "--firmware".into(),
        firmware.display().to_string(),
    ];
    if let (Some(path), Some(_)) = (disk, &spec.disk) {
        argv.push("--disk".into());
        argv.push(format!("path={}", path.display()));
    }
    for d in &spec.devices {
        argv.push("--device".into());
        // An mdev vGPU by its bus path; a function, or a vendor-VFIO vGPU's VF, by its own.
        let mdev = d
            .vgpu()
            .map(|u| {
                sysfs_root
                    .join("bus/mdev/devices")
                    .join(u.hyphenated().to_string())
            })
            .filter(|_| crate::host::device_dir(sysfs_root, d).is_dir());
        let path = mdev.unwrap_or_else(|| {
            sysfs_root
                .join("bus/pci/devices")
                .join(d.address().to_string())
        });
        argv.push(format!("path={}/", path.display()));
    }
    argv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line() {
        let spec = VmSpec {
            uuid: "6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10".parse().unwrap(),
            vcpus: 4,
            memory_mib: 8192,
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
        let argv = cloud_hypervisor_argv(
            Path::new("cloud-hypervisor"),
            &spec,
            Path::new("/run/ch.sock"),
            Path::new("/usr/share/cloud-hypervisor/CLOUDHV.fd"),
            Path::new("/sys"),
            None,
        );
        assert_eq!(
            argv.join(" "),
            "cloud-hypervisor --api-socket path=/run/ch.sock --cpus boot=4 --memory size=8192M \
             --firmware /usr/share/cloud-hypervisor/CLOUDHV.fd \
             --device path=/sys/bus/pci/devices/0000:3b:00.0/"
        );
        let mut spec = spec;
        spec.disk = Some(passage_model::protocol::DiskSpec {
            image: passage_model::protocol::ImageRef {
                sha256: "ab".repeat(32).parse().unwrap(),
                size: 1,
                image_type: passage_model::images::ImageType::Qcow2,
            },
            size_gib: 10,
        });
        let argv = cloud_hypervisor_argv(
            Path::new("cloud-hypervisor"),
            &spec,
            Path::new("/run/ch.sock"),
            Path::new("/fw"),
            Path::new("/sys"),
            Some(Path::new("/var/lib/passage-agent/qemu/x/disk.qcow2")),
        );
        assert!(
            argv.join(" ").contains(
                "--firmware /fw --disk path=/var/lib/passage-agent/qemu/x/disk.qcow2 --device"
            ),
            "{argv:?}"
        );
    }
}
