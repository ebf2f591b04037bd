//! bhyve: the command line only (bhyve runs on FreeBSD and illumos, not here).
//!
//! Passthrough devices go in PCI slots from 6 up, after the host bridge (0), the boot
//! disk (4) and the network (5) that a Triton-style bhyve VM has, and before the LPC
//! bridge in slot 31. How the host device is named differs: FreeBSD's bhyve takes the
//! host's `bus/slot/function`; illumos' bhyve takes the ppt device node (`/dev/pptN`,
//! see [`crate::ppt`]).

use passage_model::PciAddress;
use passage_model::protocol::VmSpec;

pub const BHYVE_BINARY: &str = "bhyve";
/// First guest slot for passthrough devices; 31 is the LPC bridge.
const FIRST_PASSTHRU_SLOT: u32 = 6;
const LPC_SLOT: u32 = 31;

/// How the host function is named on the `-s N:0,passthru,…` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PassthruRef {
    /// FreeBSD: `B/S/F` in decimal.
    Bsf(PciAddress),
    /// illumos: the ppt device node, e.g. `/dev/ppt0`.
    Ppt(String),
}

impl PassthruRef {
    fn arg(&self) -> String {
        match self {
            PassthruRef::Bsf(a) => a.bsf(),
            PassthruRef::Ppt(p) => p.clone(),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0} passthrough devices do not fit in bhyve's guest PCI slots 6 to 30")]
pub struct TooManyDevices(pub usize);

/// Guest slot of the boot disk (virtio-blk), as on a Triton bhyve VM.
const DISK_SLOT: u32 = 4;

/// `bhyve` arguments for `spec` with the given passthrough devices (in the order of
/// `spec.devices`) and boot disk (the disk file or zvol device, when the VM has one),
/// named after the VM's uuid. `-S` wires guest memory, which passthrough requires; `-H`
/// yields the CPU on HLT.
pub fn bhyve_argv(
    spec: &VmSpec,
    devices: &[PassthruRef],
    disk: Option<&str>,
) -> Result<Vec<String>, TooManyDevices> {
    if devices.len() > (LPC_SLOT - FIRST_PASSTHRU_SLOT) as usize {
        return Err(TooManyDevices(devices.len()));
    }
    let mut argv = vec![
        BHYVE_BINARY.to_string(),
        "-c".into(),
        spec.vcpus.to_string(),
        "-m".into(),
        format!("{}M", spec.memory_mib),
        "-H".into(),
        "-S".into(),
        "-s".into(),
        "0:0,hostbridge".into(),
    ];
    if let (Some(path), Some(_)) = (disk, &spec.disk) {
        argv.push("-s".into());
        argv.push(format!("{DISK_SLOT}:0,virtio-blk,{path}"));
    }
    for (slot, d) in (FIRST_PASSTHRU_SLOT..).zip(devices) {
        argv.push("-s".into());
        argv.push(format!("{slot}:0,passthru,{}", d.arg()));
    }
    argv.extend([
        "-s".into(),
        format!("{LPC_SLOT}:0,lpc"),
        spec.uuid.to_string(),
    ]);
    Ok(argv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> VmSpec {
        VmSpec {
            uuid: "6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10".parse().unwrap(),
            vcpus: 2,
            memory_mib: 2048,
            devices: Vec::new(),
            disk: None,
            nics: Vec::new(),
            cloud_init: None,
            bootrom: None,
        }
    }

    #[test]
    fn freebsd_and_illumos_lines() {
        let a: PciAddress = "0000:3b:00.0".parse().unwrap();
        let argv = bhyve_argv(&spec(), &[PassthruRef::Bsf(a)], None).unwrap();
        assert_eq!(
            argv.join(" "),
            "bhyve -c 2 -m 2048M -H -S -s 0:0,hostbridge -s 6:0,passthru,59/0/0 \
             -s 31:0,lpc 6f1c1f5e-3c1a-4a8e-9d55-4c2d1b7c9a10"
        );
        let argv = bhyve_argv(
            &spec(),
            &[
                PassthruRef::Ppt("/dev/ppt0".into()),
                PassthruRef::Ppt("/dev/ppt1".into()),
            ],
            None,
        )
        .unwrap();
        assert!(
            argv.join(" ")
                .contains("-s 6:0,passthru,/dev/ppt0 -s 7:0,passthru,/dev/ppt1")
        );
        let many = vec![PassthruRef::Bsf(a); 26];
        assert_eq!(bhyve_argv(&spec(), &many, None), Err(TooManyDevices(26)));
        assert!(bhyve_argv(&spec(), &many[..25], None).is_ok());

        let mut with_disk = spec();
        with_disk.disk = Some(passage_model::protocol::DiskSpec {
            image: passage_model::protocol::ImageRef {
                sha256: "ab".repeat(32).parse().unwrap(),
                size: 1,
                image_type: passage_model::images::ImageType::Raw,
            },
            size_gib: 10,
        });
        let argv = bhyve_argv(&with_disk, &[PassthruRef::Bsf(a)], Some("/vms/x/disk0")).unwrap();
        assert!(
            argv.join(" ")
                .contains("-s 0:0,hostbridge -s 4:0,virtio-blk,/vms/x/disk0 -s 6:0,passthru")
        );
    }
}
