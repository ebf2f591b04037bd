//! The optional facts about a function ([`PciDetails`]), from sysfs attributes only.
//!
//! None of these is needed to list or pass through a device, so a missing or garbled
//! attribute leaves its field empty and adds a note; it never drops the function.

use super::{AttrDir, FdBudget, KeptFd, read_attr};
use passage_model::pci::{
    MAX_LINK_SPEED_LEN, MAX_NAME_LEN, MAX_RESET_METHODS, MAX_SLOT_LEN, ROM_BAR_INDEX,
    valid_reset_method,
};
use passage_model::{BarKind, HexId, PciAddress, PciBar, PciDetails, pci::PciClass};
use std::collections::HashMap;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::path::Path;

/// What one discovery pass reads once and shares between functions (and threads).
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// (domain, bus, device) → slot label, from `bus/pci/slots/*/address`.
    slots: HashMap<(u32, u8, u8), String>,
}

/// The slots a [`super::Discoverer`] saw on its last pass: each slot directory's name
/// and inode with what its `address` said. A slot's address names its bus and device
/// number, which are fixed for the life of the slot, so a slot seen before (same name,
/// same inode, from the listing's `d_ino`: no `stat`) is not read again. A slot that is
/// removed and created again gets a new inode (kernfs numbers its nodes without reuse on
/// 64-bit; checked on this kernel with a network device added and removed three times),
/// and a renamed one a new name, so both are read afresh.
pub(crate) type SlotMemory = HashMap<OsString, (u64, Option<(u32, u8, u8)>)>;

impl Shared {
    /// Reads the slot table, reusing what `prev` says about slots seen before; returns
    /// the table and what to remember for the next pass. A tree without `slots/` (most
    /// VMs) has no labels.
    pub(crate) fn load(
        root: &Path,
        prev: &SlotMemory,
        notes: &mut Vec<String>,
    ) -> (Self, SlotMemory) {
        use std::os::unix::fs::DirEntryExt;
        let mut shared = Shared::default();
        let mut next = SlotMemory::new();
        let dir = root.join("bus/pci/slots");
        let Ok(entries) = fs::read_dir(&dir) else {
            return (shared, next);
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(label) = name.to_str().and_then(slot_label) else {
                notes.push(format!(
                    "{}: slot name is not a usable label",
                    entry.path().display()
                ));
                continue;
            };
            let ino = entry.ino();
            let key = match prev.get(&name) {
                Some(&(seen, key)) if seen == ino => key,
                _ => match read_attr(&entry.path().join("address")) {
                    // Empty slots show `DDDD:BB` or nothing: no device to label, not an
                    // error.
                    Ok(text) => parse_slot_address(&text),
                    // Not remembered: read again on the next pass.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => {
                        notes.push(format!("{}: {e}", entry.path().display()));
                        continue;
                    }
                },
            };
            if let Some(key) = key {
                shared.slots.insert(key, label);
            }
            next.insert(name, (ino, key));
        }
        (shared, next)
    }
}

/// A slot directory name as a label: printable, bounded.
pub(crate) fn slot_label(name: &str) -> Option<String> {
    let ok = !name.is_empty()
        && name.chars().count() <= MAX_SLOT_LEN
        && !name.chars().any(char::is_control);
    ok.then(|| name.to_string())
}

/// `DDDD:BB:DD` (the kernel's slot `address`) → (domain, bus, device).
pub(crate) fn parse_slot_address(text: &str) -> Option<(u32, u8, u8)> {
    let mut it = text.trim().split(':');
    let (d, b, dev) = (it.next()?, it.next()?, it.next()?);
    if it.next().is_some() {
        return None;
    }
    let hex = |s: &str, min: usize, max: usize| {
        (s.len() >= min && s.len() <= max && s.bytes().all(|c| c.is_ascii_hexdigit()))
            .then(|| u32::from_str_radix(s, 16).ok())
            .flatten()
    };
    let domain = hex(d, 4, 8)?;
    let bus = u8::try_from(hex(b, 2, 2)?).ok()?;
    let device = u8::try_from(hex(dev, 2, 2)?).ok()?;
    (device <= 0x1f).then_some((domain, bus, device))
}

/// `current_link_speed` and friends: kept as the kernel writes them (`16.0 GT/s PCIe`),
/// refused when long or odd, and `Unknown` (link down, or no PCIe) means no value.
pub(crate) fn parse_link_speed(text: &str) -> Option<String> {
    let t = text.trim();
    let ok = !t.is_empty()
        && t.len() <= MAX_LINK_SPEED_LEN
        && t.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
        && !t.eq_ignore_ascii_case("unknown")
        && t.bytes().next().is_some_and(|b| b.is_ascii_digit());
    ok.then(|| t.to_string())
}

/// `current_link_width`: a lane count. The kernel writes 0 or 255 for "unknown".
pub(crate) fn parse_link_width(text: &str) -> Option<u16> {
    match text.trim().parse::<u16>() {
        Ok(w @ 1..=64) => Some(w),
        _ => None,
    }
}

/// `sriov_totalvfs` / `sriov_numvfs`: a plain count.
pub(crate) fn parse_count(text: &str) -> Option<u32> {
    text.trim().parse().ok()
}

/// `aer_dev_fatal` / `aer_dev_nonfatal`: lines `NAME COUNT`; the total is on the line
/// named `total_key`.
pub(crate) fn parse_aer_total(text: &str, total_key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut it = line.split_whitespace();
        if it.next()? != total_key {
            return None;
        }
        let n = it.next()?.parse().ok()?;
        it.next().is_none().then_some(n)
    })
}

/// Linux's resource flags (`include/linux/ioport.h`), as `resource` writes them.
const IORESOURCE_IO: u64 = 0x100;
const IORESOURCE_MEM: u64 = 0x200;
const IORESOURCE_PREFETCH: u64 = 0x2000;
const IORESOURCE_MEM_64: u64 = 0x10_0000;
/// More lines than `resource` has (7 for the function's own regions, 6 for SR-IOV's VF
/// BARs, 4 for a bridge's windows, a few spare).
const MAX_RESOURCE_LINES: usize = 32;

/// `0x` and 1 to 16 hex digits.
fn hex64(word: &str) -> Option<u64> {
    let digits = word.strip_prefix("0x")?;
    (!digits.is_empty() && digits.len() <= 16 && digits.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| u64::from_str_radix(digits, 16).ok())
        .flatten()
}

/// `resource`: one line `0x<start> 0x<end> 0x<flags>` per resource, the BARs 0 to 5 and
/// the expansion ROM first. Unassigned resources (end 0) and those that are neither
/// memory nor I/O are left out; the lines after the ROM (SR-IOV's VF BARs, a bridge's
/// windows) are not the function's own regions and are checked but not kept. `None`
/// for anything that is not such a file.
pub(crate) fn parse_resource(text: &str) -> Option<Vec<PciBar>> {
    let mut bars = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if i >= MAX_RESOURCE_LINES {
            return None;
        }
        let mut it = line.split_whitespace();
        let (start, end, flags) = (hex64(it.next()?)?, hex64(it.next()?)?, hex64(it.next()?)?);
        if it.next().is_some() {
            return None;
        }
        let Ok(index) = u8::try_from(i) else {
            return None;
        };
        if end == 0 || index > ROM_BAR_INDEX {
            continue;
        }
        let size = end.checked_sub(start)?.checked_add(1)?;
        let kind = if flags & IORESOURCE_IO != 0 && index != ROM_BAR_INDEX {
            BarKind::Io
        } else if flags & IORESOURCE_MEM != 0 {
            BarKind::Memory
        } else {
            continue;
        };
        let memory = kind == BarKind::Memory;
        bars.push(PciBar {
            index,
            kind,
            start,
            size,
            is_64bit: memory && flags & IORESOURCE_MEM_64 != 0,
            prefetchable: memory && flags & IORESOURCE_PREFETCH != 0,
        });
    }
    Some(bars)
}

/// `reset_method`: the method names in the kernel's order, space-separated.
pub(crate) fn parse_reset_methods(text: &str) -> Option<Vec<String>> {
    let words: Vec<&str> = text.split_whitespace().collect();
    (words.len() <= MAX_RESET_METHODS && words.iter().all(|w| valid_reset_method(w)))
        .then(|| words.into_iter().map(str::to_string).collect())
}

/// A function's regions from its `resource` (opened for this read): empty, with a note,
/// when the file is garbled; empty when there is none.
pub(crate) fn read_bars(dir: &AttrDir, notes: &mut Vec<String>) -> Vec<PciBar> {
    field(dir, "resource", Via::Open, parse_resource, &[], notes).unwrap_or_default()
}

fn bounded_name(s: &str) -> Option<String> {
    let s: String = s
        .chars()
        .filter(|c| !c.is_control())
        .take(MAX_NAME_LEN)
        .collect();
    (!s.trim().is_empty()).then_some(s)
}

/// The `Version:` of the pci.ids database the pinned `pci-ids` crate ships (see
/// node-agent/Cargo.toml). Names change between versions (e.g. "Virtio block device"
/// became "Virtio 1.0 block device"), so comparisons with a host's pciutils are exact
/// only when its database has this version.
pub const PCI_IDS_VERSION: &str = "2025.07.11";

/// Names from the pci.ids database compiled into the agent.
pub fn vendor_name(vendor: HexId) -> Option<String> {
    use pci_ids::FromId;
    pci_ids::Vendor::from_id(vendor.0).and_then(|v| bounded_name(v.name()))
}

pub fn device_name(vendor: HexId, device: HexId) -> Option<String> {
    pci_ids::Device::from_vid_pid(vendor.0, device.0).and_then(|d| bounded_name(d.name()))
}

pub fn class_name(class: PciClass) -> Option<String> {
    let base = class.base();
    let sub = ((class.0 >> 8) & 0xff) as u8;
    pci_ids::Subclass::from_cid_sid(base, sub).and_then(|s| bounded_name(s.name()))
}

/// What [`collect`] needs to know about the function besides its directory.
pub(crate) struct Known<'a> {
    pub addr: PciAddress,
    pub parents: &'a [PciAddress],
    pub vendor: HexId,
    pub device: HexId,
    pub class: PciClass,
}

/// The details that cannot change while the function's directory exists (they come
/// from the ids and from capability registers): a [`super::Discoverer`] reads them once
/// per directory and reuses them on later passes.
#[derive(Clone, Debug, Default)]
pub(crate) struct Fixed {
    vendor_name: Option<String>,
    device_name: Option<String>,
    class_name: Option<String>,
    max_link_speed: Option<String>,
    max_link_width: Option<u16>,
    sriov_totalvfs: Option<u32>,
    /// A VF's physical function: fixed for the life of the VF's directory.
    physfn: Option<PciAddress>,
    /// What was wrong with these attributes, repeated on every pass that reuses them.
    notes: Vec<String>,
}

/// Where an attribute is read from: opened for this read, or held open between passes.
enum Via<'a> {
    Open,
    Kept(&'a mut KeptFd, &'a FdBudget),
}

/// Reads one optional attribute: a missing one is normal (not PCIe, no SR-IOV, no AER)
/// and leaves its field empty; any other failure is a note.
fn optional(dir: &AttrDir, file: &str, via: Via<'_>, notes: &mut Vec<String>) -> Option<String> {
    let read = match via {
        Via::Open => dir.read(file),
        Via::Kept(kept, budget) => dir.read_kept(file, kept, budget),
    };
    match read {
        Ok(t) => Some(t),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            notes.push(format!("{}/{file}: {e}", dir.path().display()));
            None
        }
    }
}

/// Reads `file` and parses it with `parse`; content that does not parse is a note.
/// `unknown` lists the values the kernel writes for "no value", which are not garbage.
fn field<T>(
    dir: &AttrDir,
    file: &str,
    via: Via<'_>,
    parse: impl Fn(&str) -> Option<T>,
    unknown: &[&str],
    notes: &mut Vec<String>,
) -> Option<T> {
    let text = optional(dir, file, via, notes)?;
    let value = parse(&text);
    let t = text.trim();
    if value.is_none() && !unknown.iter().any(|u| t.eq_ignore_ascii_case(u)) {
        notes.push(format!(
            "{}/{file}: unexpected content {:?}",
            dir.path().display(),
            t.chars().take(40).collect::<String>()
        ));
    }
    value
}

/// Link speeds are `Unknown` when the link is down; widths 0 or 255.
const UNKNOWN_SPEED: &[&str] = &["unknown"];
const UNKNOWN_WIDTH: &[&str] = &["0", "255"];

pub(crate) fn read_fixed(dir: &AttrDir, known: &Known<'_>) -> Fixed {
    let mut notes = Vec::new();
    Fixed {
        vendor_name: vendor_name(known.vendor),
        device_name: device_name(known.vendor, known.device),
        class_name: class_name(known.class),
        max_link_speed: field(
            dir,
            "max_link_speed",
            Via::Open,
            parse_link_speed,
            UNKNOWN_SPEED,
            &mut notes,
        ),
        max_link_width: field(
            dir,
            "max_link_width",
            Via::Open,
            parse_link_width,
            UNKNOWN_WIDTH,
            &mut notes,
        ),
        sriov_totalvfs: field(
            dir,
            "sriov_totalvfs",
            Via::Open,
            parse_count,
            &[],
            &mut notes,
        ),
        physfn: match dir.link_basename("physfn") {
            Ok(Some(b)) => b.parse().ok(),
            Ok(None) => None,
            Err(e) => {
                notes.push(format!("{}/physfn: {e}", dir.path().display()));
                None
            }
        },
        notes,
    }
}

/// The attributes [`collect`] reads on every pass, held open between passes by a
/// [`super::Discoverer`] (see [`AttrDir::read_kept`]); dropped with the function's
/// memory when its directory goes or is replaced.
#[derive(Clone, Debug, Default)]
pub(crate) struct Kept {
    current_link_speed: KeptFd,
    current_link_width: KeptFd,
    aer_dev_fatal: KeptFd,
    aer_dev_nonfatal: KeptFd,
    sriov_numvfs: KeptFd,
    resource: KeptFd,
    reset_method: KeptFd,
}

/// Reads the details of the function in `dir` that can change (driver-independent
/// link state, VF count, error counters) and adds the `fixed` ones. Problems become
/// `notes`, never errors. The IOMMU group's members are filled in by the caller once
/// every function of the pass has been seen (see [`super::discover`]).
pub(crate) fn collect(
    dir: &AttrDir,
    known: &Known<'_>,
    fixed: &Fixed,
    shared: &Shared,
    kept: &mut Kept,
    budget: &FdBudget,
    notes: &mut Vec<String>,
) -> PciDetails {
    notes.extend(fixed.notes.iter().cloned());
    let a = known.addr;
    let mut d = PciDetails {
        vendor_name: fixed.vendor_name.clone(),
        device_name: fixed.device_name.clone(),
        class_name: fixed.class_name.clone(),
        max_link_speed: fixed.max_link_speed.clone(),
        max_link_width: fixed.max_link_width,
        sriov_totalvfs: fixed.sriov_totalvfs,
        physfn: fixed.physfn,
        bridges: known.parents.to_vec(),
        slot: shared.slots.get(&(a.domain, a.bus, a.device)).cloned(),
        // Power management retrains links (a GPU at idle drops to 2.5 GT/s), so the
        // current speed and width are read on every pass.
        current_link_speed: field(
            dir,
            "current_link_speed",
            Via::Kept(&mut kept.current_link_speed, budget),
            parse_link_speed,
            UNKNOWN_SPEED,
            notes,
        ),
        current_link_width: field(
            dir,
            "current_link_width",
            Via::Kept(&mut kept.current_link_width, budget),
            parse_link_width,
            UNKNOWN_WIDTH,
            notes,
        ),
        aer_fatal: field(
            dir,
            "aer_dev_fatal",
            Via::Kept(&mut kept.aer_dev_fatal, budget),
            |t| parse_aer_total(t, "TOTAL_ERR_FATAL"),
            &[],
            notes,
        ),
        aer_nonfatal: field(
            dir,
            "aer_dev_nonfatal",
            Via::Kept(&mut kept.aer_dev_nonfatal, budget),
            |t| parse_aer_total(t, "TOTAL_ERR_NONFATAL"),
            &[],
            notes,
        ),
        // Read on every pass: a driver may resize a BAR when it binds (amdgpu does), and
        // root may write `reset_method`, both without the directory changing.
        bars: field(
            dir,
            "resource",
            Via::Kept(&mut kept.resource, budget),
            parse_resource,
            &[],
            notes,
        )
        .unwrap_or_default(),
        reset_methods: field(
            dir,
            "reset_method",
            Via::Kept(&mut kept.reset_method, budget),
            parse_reset_methods,
            &[],
            notes,
        )
        .unwrap_or_default(),
        ..PciDetails::default()
    };
    // Only functions that can have VFs have `sriov_numvfs`: no open for the others.
    if fixed.sriov_totalvfs.is_some() {
        d.sriov_numvfs = field(
            dir,
            "sriov_numvfs",
            Via::Kept(&mut kept.sriov_numvfs, budget),
            parse_count,
            &[],
            notes,
        );
    }
    // Only NVIDIA GPUs that are not themselves VFs can host vGPUs; every other function
    // costs nothing here.
    if known.vendor.0 == super::vgpu::NVIDIA && known.class.is_gpu_like() && d.physfn.is_none() {
        d.vgpu = super::vgpu::read_host(dir, d.sriov_numvfs, notes);
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn link_attributes() {
        assert_eq!(
            parse_link_speed("16.0 GT/s PCIe\n").as_deref(),
            Some("16.0 GT/s PCIe")
        );
        assert_eq!(parse_link_speed("8 GT/s").as_deref(), Some("8 GT/s"));
        for bad in [
            "",
            "Unknown",
            "unknown\n",
            "GT/s",
            "1\u{0}",
            &"9".repeat(100),
        ] {
            assert_eq!(parse_link_speed(bad), None, "{bad:?}");
        }
        assert_eq!(parse_link_width("16\n"), Some(16));
        for bad in ["0", "255", "-1", "x16", "", "99999999999"] {
            assert_eq!(parse_link_width(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn counts() {
        assert_eq!(parse_count("64\n"), Some(64));
        assert_eq!(parse_count("0"), Some(0));
        for bad in ["", "-1", "sixty", "1 2", "4294967296"] {
            assert_eq!(parse_count(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn aer_totals() {
        let text = "Undefined 0\nDLP 0\nSDES 0\nTLP 1\nFCP 0\nCmpltTO 0\nCmpltAbrt 0\n\
                    UnxCmplt 0\nRxOF 0\nMalfTLP 2\nECRC 0\nUnsupReq 0\nACSViol 0\n\
                    UncorrIntErr 0\nBlockedTLP 0\nAtomicOpBlocked 0\nTLPBlockedErr 0\n\
                    PoisonTLPBlocked 0\nTOTAL_ERR_FATAL 3\n";
        assert_eq!(parse_aer_total(text, "TOTAL_ERR_FATAL"), Some(3));
        assert_eq!(parse_aer_total(text, "TOTAL_ERR_NONFATAL"), None);
        assert_eq!(
            parse_aer_total("TOTAL_ERR_NONFATAL 0\n", "TOTAL_ERR_NONFATAL"),
            Some(0)
        );
        for bad in [
            "",
            "TOTAL_ERR_FATAL",
            "TOTAL_ERR_FATAL x",
            "TOTAL_ERR_FATAL -1",
            "TOTAL_ERR_FATAL 1 2",
            "TOTAL_ERR_FATALX 1",
            "\u{0}\u{1}garbage",
        ] {
            assert_eq!(parse_aer_total(bad, "TOTAL_ERR_FATAL"), None, "{bad:?}");
        }
    }

    #[test]
    fn slots() {
        assert_eq!(parse_slot_address("0000:3b:00\n"), Some((0, 0x3b, 0)));
        assert_eq!(
            parse_slot_address("10000:e1:1f"),
            Some((0x10000, 0xe1, 0x1f))
        );
        for bad in [
            "",
            "0000:3b",
            "0000:3b:00.0",
            "0000:3b:20",
            "zz:3b:00",
            "0000:3b:00:1",
        ] {
            assert_eq!(parse_slot_address(bad), None, "{bad:?}");
        }
        assert_eq!(slot_label("CPU2 SLOT2").as_deref(), Some("CPU2 SLOT2"));
        assert_eq!(slot_label(""), None);
        assert_eq!(slot_label("a\nb"), None);
        assert_eq!(slot_label(&"s".repeat(MAX_SLOT_LEN + 1)), None);
    }

    #[test]
    fn names_come_from_the_shipped_database() {
        assert_eq!(
            vendor_name(HexId(0x10de)).as_deref(),
            Some("NVIDIA Corporation")
        );
        assert!(device_name(HexId(0x10de), HexId(0x1db4)).is_some_and(|n| n.contains("V100")),);
        // An H200 seen on a real host (10de:2335, driver 580.159.04): the database the
        // agent shipped before 2025 had no name for it.
        assert_eq!(
            device_name(HexId(0x10de), HexId(0x2335)).as_deref(),
            Some("GH100 [H200 SXM 141GB]")
        );
        assert_eq!(vendor_name(HexId(0xfff0)), None);
        assert_eq!(device_name(HexId(0x10de), HexId(0xfffe)), None);
        assert_eq!(
            class_name(PciClass(0x030200)).as_deref(),
            Some("3D controller")
        );
        assert_eq!(class_name(PciClass(0xfe0000)), None);
    }

    /// An H100 SXM5 as a kernel shows it: BAR0 32-bit registers, BAR1 the 64-bit
    /// framebuffer, BAR3 64-bit, no ROM assigned, then six SR-IOV lines and nothing else.
    const H100_RESOURCE: &str = "0x00000000e2000000 0x00000000e2ffffff 0x0000000000040200
0x0000228000000000 0x0000229fffffffff 0x000000000014220c
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x000022a000000000 0x000022a001ffffff 0x000000000014220c
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x00000000e3000000 0x00000000e303ffff 0x0000000000040200
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
";

    #[test]
    fn resources() {
        let bars = parse_resource(H100_RESOURCE).unwrap();
        assert_eq!(
            bars,
            vec![
                PciBar {
                    index: 0,
                    kind: BarKind::Memory,
                    start: 0xe200_0000,
                    size: 16 << 20,
                    is_64bit: false,
                    prefetchable: false,
                },
                PciBar {
                    index: 1,
                    kind: BarKind::Memory,
                    start: 0x2280_0000_0000,
                    size: 128 << 30,
                    is_64bit: true,
                    prefetchable: true,
                },
                PciBar {
                    index: 3,
                    kind: BarKind::Memory,
                    start: 0x22a0_0000_0000,
                    size: 32 << 20,
                    is_64bit: true,
                    prefetchable: true,
                },
            ]
        );
        // An I/O BAR and a ROM (flags as the kernel writes them for an i350 and a VGA
        // card); a disabled ROM has the memory flag all the same.
        let text = "0x000000000000e000 0x000000000000e01f 0x0000000000040101\n\
                    0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
                    0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
                    0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
                    0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
                    0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
                    0x00000000c0000000 0x00000000c007ffff 0x0000000000046200\n";
        let bars = parse_resource(text).unwrap();
        assert_eq!(bars.len(), 2);
        assert_eq!((bars[0].kind, bars[0].size), (BarKind::Io, 32));
        assert_eq!(
            (bars[1].index, bars[1].kind),
            (ROM_BAR_INDEX, BarKind::Memory)
        );
        assert_eq!(parse_resource(""), Some(vec![]));
        for bad in [
            "0x1 0x2",
            "0x1 0x2 0x200 0x4",
            "1 2 3",
            "0x 0x1 0x200",
            "0x10 0x1 0x200",
            "0x0 0xffffffffffffffff 0x200",
            "0x00000000000000001 0x2 0x200",
            "0xzz 0x2 0x200",
        ] {
            assert_eq!(parse_resource(bad), None, "{bad:?}");
        }
        let long = "0x0 0x0 0x0\n".repeat(MAX_RESOURCE_LINES + 1);
        assert_eq!(parse_resource(&long), None);
    }

    #[test]
    fn reset_methods() {
        assert_eq!(
            parse_reset_methods("flr bus\n"),
            Some(vec!["flr".to_string(), "bus".to_string()])
        );
        assert_eq!(parse_reset_methods(""), Some(vec![]));
        assert_eq!(
            parse_reset_methods("device_specific acpi pm"),
            Some(vec!["device_specific".into(), "acpi".into(), "pm".into()])
        );
        for bad in [
            "FLR",
            "flr,bus",
            "flr \u{0}",
            &"bus ".repeat(MAX_RESET_METHODS + 1),
        ] {
            assert_eq!(parse_reset_methods(bad), None, "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn resource_like_text_never_panics(
            lines in proptest::collection::vec(
                ("0x[0-9a-f]{0,17}", "0x[0-9a-f]{0,17}", "0x[0-9a-f]{0,8}"), 0..20)
        ) {
            let text: String = lines
                .iter()
                .map(|(a, b, c)| format!("{a} {b} {c}\n"))
                .collect();
            if let Some(bars) = parse_resource(&text) {
                let details = PciDetails { bars, ..PciDetails::default() };
                prop_assert!(details.validate().is_ok());
            }
        }

        #[test]
        fn parsers_never_panic(s in "\\PC{0,200}") {
            let _ = parse_resource(&s);
            let _ = parse_reset_methods(&s);
            let _ = parse_link_speed(&s);
            let _ = parse_link_width(&s);
            let _ = parse_count(&s);
            let _ = parse_aer_total(&s, "TOTAL_ERR_FATAL");
            let _ = parse_slot_address(&s);
            let _ = slot_label(&s);
        }
    }
}
