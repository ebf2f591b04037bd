//! A fake kernel over a generated tree: it performs each attribute write, then changes the
//! tree the way Linux's PCI core would (driver links, overrides), so the binder's code
//! runs unchanged against it.

use super::vgpu::{self as fake_vgpu, TypeSpec};
use crate::host::{SysfsOps, bound_driver, link_basename, read_attr, write_existing};
use std::fs;
use std::io::{self, Write};
use std::path::{Component, Path, PathBuf};

/// Where the fake records each function reset, one address a line.
pub const RESET_LOG: &str = ".passage-fake-resets.log";
/// What the fake host did to its functions, in order, one line each: `reset BDF`,
/// `unbind DRIVER BDF`, `bind DRIVER BDF`, `probe BDF DRIVER` (the driver it ended on, `-`
/// for none) from the fake kernel, `zero BDF` from the zeroing helper's stand-in. A test
/// reads a scrub's sequence from it.
pub const HOST_LOG: &str = ".passage-fake-host.log";

/// Appends `line` to the tree's [`HOST_LOG`].
fn host_log(root: &Path, line: &str) -> io::Result<()> {
    let mut log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(root.join(HOST_LOG))?;
    writeln!(log, "{line}")
}

/// A file per busy function (`DIR/BDF`): while it is there, unbinding that function
/// from `nvidia` blocks, as the kernel's write does while a process holds the GPU open;
/// removing it lets the unbind finish. A file, so a test can switch it from outside the
/// agent's process.
pub const BUSY_DIR: &str = ".passage-fake-busy";

/// Makes the function `bdf` of the generated tree at `root` busy (see [`BUSY_DIR`]) or
/// not.
pub fn set_busy(root: &Path, bdf: &str, busy: bool) -> io::Result<()> {
    let f = root.join(BUSY_DIR).join(bdf);
    if busy {
        fs::create_dir_all(root.join(BUSY_DIR))?;
        fs::write(f, b"")
    } else {
        match fs::remove_file(f) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// The driver a kernel would pick for a function with no override: the module alias
/// table of this fake world. The generator binds the same drivers.
pub fn native_driver(vendor: u16, device: u16, class: u32) -> Option<&'static str> {
    match (vendor, device, class >> 8) {
        (0x10de, _, 0x0300 | 0x0302) => Some("nvidia"),
        (_, _, 0x0403) => Some("snd_hda_intel"),
        (_, _, 0x0604) => Some("pcieport"),
        (0x8086, 0x1521, _) => Some("igb"),
        (0x8086, 0x1520, _) => Some("igbvf"),
        (_, _, 0x0108) => Some("nvme"),
        (0x8086, _, 0x0c05) => Some("i801_smbus"),
        _ => None,
    }
}

#[derive(Debug)]
pub struct FakeKernel {
    root: PathBuf,
}

fn err(kind: io::ErrorKind, msg: String) -> io::Error {
    io::Error::new(kind, msg)
}

impl FakeKernel {
    pub fn new(root: &Path) -> io::Result<Self> {
        Ok(FakeKernel {
            root: fs::canonicalize(root)?,
        })
    }

    fn drivers(&self) -> PathBuf {
        self.root.join("bus/pci/drivers")
    }

    /// The real directory of a function named by its address, checked to be in the tree.
    fn function_dir(&self, bdf: &str) -> io::Result<PathBuf> {
        let bdf = bdf.trim();
        bdf.parse::<passage_model::PciAddress>()
            .map_err(|e| err(io::ErrorKind::InvalidInput, e.to_string()))?;
        let list = self.root.join("bus/pci/devices");
        let missing = |_| err(io::ErrorKind::NotFound, format!("no such device {bdf}"));
        let target = fs::read_link(list.join(bdf)).map_err(missing)?;
        // The generator's links are relative and end at a real directory: resolved
        // here without a system call per component, as `canonicalize` would make. Any
        // other shape of link is left to `canonicalize`.
        let mut dir = list;
        for c in target.components() {
            match c {
                Component::ParentDir => {
                    dir.pop();
                }
                Component::Normal(n) => dir.push(n),
                _ => {}
            }
        }
        // `..` only leading: it climbs out of `bus/pci/devices`, real directories.
        let leading = target
            .components()
            .skip_while(|c| matches!(c, Component::ParentDir))
            .all(|c| matches!(c, Component::Normal(_)));
        let plain = target.is_relative()
            && leading
            && fs::symlink_metadata(&dir).is_ok_and(|m| m.file_type().is_dir());
        if !plain {
            dir = fs::canonicalize(self.root.join("bus/pci/devices").join(bdf)).map_err(missing)?;
        }
        if !dir.starts_with(self.root.join("devices")) {
            return Err(err(
                io::ErrorKind::InvalidData,
                format!("{bdf} resolves outside the tree"),
            ));
        }
        Ok(dir)
    }

    /// `../` repeated once per component of `dir` below the root: how the kernel's
    /// relative links climb back to the root.
    fn up_from(&self, dir: &Path) -> io::Result<String> {
        let rel = dir
            .strip_prefix(&self.root)
            .map_err(|_| err(io::ErrorKind::InvalidData, "outside the tree".to_string()))?;
        Ok("../".repeat(rel.components().count()))
    }

    fn attach(&self, dir: &Path, driver: &str) -> io::Result<()> {
        let bdf = file_name(dir);
        let drv = self.drivers().join(driver);
        if !drv.is_dir() {
            return Err(err(io::ErrorKind::NotFound, format!("no driver {driver}")));
        }
        if bound_driver(dir)?.is_some() {
            return Err(err(
                io::ErrorKind::ResourceBusy,
                format!("{bdf} already has a driver"),
            ));
        }
        let up = self.up_from(dir)?;
        symlink(
            &format!("{up}bus/pci/drivers/{driver}"),
            &dir.join("driver"),
        )?;
        let rel_dev = dir
            .strip_prefix(&self.root)
            .map_err(|_| err(io::ErrorKind::InvalidData, "outside the tree".to_string()))?;
        // The device's own `driver` link is the state; the driver's back link follows it.
        // A process that stopped between an earlier detach's two removals (a simulated
        // node's server killed mid-task) left this one behind: the kernel has no such
        // half state, so it must not make the next bind fail.
        match fs::remove_file(drv.join(&bdf)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        symlink(
            &format!("../../../../{}", rel_dev.display()),
            &drv.join(&bdf),
        )
    }

    fn detach(&self, dir: &Path, driver: &str) -> io::Result<()> {
        let bdf = file_name(dir);
        if bound_driver(dir)?.as_deref() != Some(driver) {
            // What the kernel answers when unbinding a device from a driver it is not on.
            return Err(err(
                io::ErrorKind::NotFound,
                format!("{bdf} is not bound to {driver}"),
            ));
        }
        fs::remove_file(dir.join("driver"))?;
        match fs::remove_file(self.drivers().join(driver).join(&bdf)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    fn override_of(dir: &Path) -> io::Result<Option<String>> {
        let text = read_attr(&dir.join("driver_override"))?;
        Ok(if text.is_empty() || text == "(null)" {
            None
        } else {
            Some(text)
        })
    }

    /// Probing: the override if one is set, else the module alias table.
    fn probe(&self, dir: &Path) -> io::Result<()> {
        if bound_driver(dir)?.is_some() {
            return Ok(());
        }
        let chosen = match Self::override_of(dir)? {
            Some(o) => Some(o),
            None => {
                let id = |f: &str| -> io::Result<u32> {
                    let t = read_attr(&dir.join(f))?;
                    u32::from_str_radix(t.trim_start_matches("0x"), 16)
                        .map_err(|e| err(io::ErrorKind::InvalidData, format!("{f}: {e}")))
                };
                native_driver(id("vendor")? as u16, id("device")? as u16, id("class")?)
                    .map(str::to_string)
            }
        };
        match chosen {
            // Like the kernel: no matching driver loaded means the device stays unbound.
            Some(d) if self.drivers().join(&d).is_dir() => self.attach(dir, &d),
            _ => Ok(()),
        }
    }
}

/// The vGPU side: mdev `create` and `remove`, vendor-VFIO `current_vgpu_type`, each
/// followed by what NVIDIA's driver updates (every type's `available_instances`, every
/// VF's `creatable_vgpu_types`). Errors name the errno the kernel would return.
impl FakeKernel {
    fn table_of(gpu: &Path) -> io::Result<&'static [TypeSpec]> {
        let device = read_attr(&gpu.join("device"))?;
        u16::from_str_radix(device.trim_start_matches("0x"), 16)
            .ok()
            .and_then(fake_vgpu::table_for_device)
            .ok_or_else(|| {
                err(
                    io::ErrorKind::Unsupported,
                    format!("{} hosts no vGPUs in this fake", gpu.display()),
                )
            })
    }

    fn mig_of(&self, gpu: &Path) -> bool {
        fake_vgpu::mig_on(&self.root, &file_name(gpu))
    }

    fn recompute_mdev(&self, gpu: &Path) -> io::Result<()> {
        let types = Self::table_of(gpu)?;
        let existing = fake_vgpu::mdev_types(gpu)?;
        let mig = self.mig_of(gpu);
        for t in types {
            let file = gpu
                .join("mdev_supported_types")
                .join(t.id)
                .join("available_instances");
            write_existing(
                &file,
                &format!("{}\n", fake_vgpu::fits(types, mig, &existing, t)),
            )?;
        }
        Ok(())
    }

    fn mdev_create(&self, type_dir: &Path, value: &str) -> io::Result<()> {
        let (Some(ty), Some(gpu)) = (
            type_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned()),
            type_dir.parent().and_then(Path::parent),
        ) else {
            return Err(err(io::ErrorKind::InvalidInput, "not a type".into()));
        };
        let uuid = value.trim();
        if uuid.len() != 36 || uuid::Uuid::try_parse(uuid).is_err() {
            return Err(err(
                io::ErrorKind::InvalidInput,
                format!("{uuid:?} is not a UUID (EINVAL)"),
            ));
        }
        let uuid = uuid.to_ascii_lowercase();
        let types = Self::table_of(gpu)?;
        let spec = types.iter().find(|t| t.id == ty).ok_or_else(|| {
            err(
                io::ErrorKind::NotFound,
                format!("no vGPU type {ty} (ENODEV)"),
            )
        })?;
        let mdev = gpu.join(&uuid);
        if mdev.exists() || self.root.join("bus/mdev/devices").join(&uuid).exists() {
            return Err(err(
                io::ErrorKind::AlreadyExists,
                format!("mdev {uuid} exists (EEXIST)"),
            ));
        }
        let existing = fake_vgpu::mdev_types(gpu)?;
        if fake_vgpu::fits(types, self.mig_of(gpu), &existing, spec) == 0 {
            return Err(err(
                io::ErrorKind::ResourceBusy,
                format!(
                    "no instance of {} available on {} (available_instances 0: EUSERS)",
                    spec.name,
                    file_name(gpu)
                ),
            ));
        }
        fs::create_dir(&mdev)?;
        symlink(
            &format!("../mdev_supported_types/{ty}"),
            &mdev.join("mdev_type"),
        )?;
        fs::write(mdev.join("remove"), "")?;
        // Each mdev gets an IOMMU group of its own, as vfio-mdev gives it.
        let groups = self.root.join("kernel/iommu_groups");
        let next = fs::read_dir(&groups)?
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .max()
            .map_or(0, |m| m + 1);
        let group = groups.join(next.to_string());
        fs::create_dir_all(group.join("devices"))?;
        let rel = mdev
            .strip_prefix(&self.root)
            .map_err(|_| err(io::ErrorKind::InvalidData, "outside the tree".into()))?;
        let up = self.up_from(&mdev)?;
        symlink(
            &format!("{up}kernel/iommu_groups/{next}"),
            &mdev.join("iommu_group"),
        )?;
        symlink(
            &format!("../../../../{}", rel.display()),
            &group.join("devices").join(&uuid),
        )?;
        symlink(
            &format!("../../../{uuid}"),
            &type_dir.join("devices").join(&uuid),
        )?;
        let bus = self.root.join("bus/mdev/devices");
        fs::create_dir_all(&bus)?;
        symlink(&format!("../../../{}", rel.display()), &bus.join(&uuid))?;
        self.recompute_mdev(gpu)
    }

    fn mdev_remove(&self, mdev: &Path, value: &str) -> io::Result<()> {
        if value.trim() != "1" {
            return Err(err(
                io::ErrorKind::InvalidInput,
                format!("remove takes 1, not {:?} (EINVAL)", value.trim()),
            ));
        }
        let (Some(gpu), Some(ty)) = (mdev.parent(), link_basename(&mdev.join("mdev_type"))?) else {
            return Err(err(io::ErrorKind::NotFound, "not an mdev".into()));
        };
        let uuid = file_name(mdev);
        let _ = fs::remove_file(
            gpu.join("mdev_supported_types")
                .join(&ty)
                .join("devices")
                .join(&uuid),
        );
        let _ = fs::remove_file(self.root.join("bus/mdev/devices").join(&uuid));
        if let Some(g) = link_basename(&mdev.join("iommu_group"))?
            && g.parse::<u32>().is_ok()
        {
            let _ = fs::remove_dir_all(self.root.join("kernel/iommu_groups").join(g));
        }
        fs::remove_dir_all(mdev)?;
        self.recompute_mdev(gpu)
    }

    /// `sriov_numvfs` written, as Linux's PCI core answers it: a count above
    /// `sriov_totalvfs` is out of range, a change between two non-zero counts is busy,
    /// and VFs go only while none is bound to vfio-pci (what igb refuses with EBUSY). VFs
    /// appear beside the PF at first VF offset 128, stride 2, each in an IOMMU group of
    /// its own and bound to its VF driver.
    fn set_numvfs(&self, attr: &Path, value: &str) -> io::Result<()> {
        let pf = attr
            .parent()
            .ok_or_else(|| err(io::ErrorKind::NotFound, "no function".into()))?;
        let n: u32 = value.trim().parse().map_err(|_| {
            err(
                io::ErrorKind::InvalidInput,
                format!("{:?} is not a count (EINVAL)", value.trim()),
            )
        })?;
        let total: u32 = read_attr(&pf.join("sriov_totalvfs"))?
            .trim()
            .parse()
            .unwrap_or(0);
        let have: u32 = read_attr(attr)?.trim().parse().unwrap_or(0);
        if n > total {
            return Err(err(
                io::ErrorKind::InvalidInput,
                format!("{n} VFs requested; only {total} supported (ERANGE)"),
            ));
        }
        if n == have {
            return Ok(());
        }
        if have != 0 && n != 0 {
            return Err(err(
                io::ErrorKind::ResourceBusy,
                format!("{have} VFs already enabled; disable them before enabling {n} (EBUSY)"),
            ));
        }
        let parent = pf
            .parent()
            .ok_or_else(|| err(io::ErrorKind::NotFound, "no bus".into()))?;
        if n == 0 {
            let vfs = Self::virtfns(pf)?;
            for (_, vf) in &vfs {
                if bound_driver(vf)?.as_deref() == Some("vfio-pci") {
                    return Err(err(
                        io::ErrorKind::ResourceBusy,
                        format!(
                            "cannot deallocate SR-IOV virtual functions while they are                              assigned: {} (EBUSY)",
                            file_name(vf)
                        ),
                    ));
                }
            }
            for (i, vf) in vfs {
                self.remove_function(&vf)?;
                fs::remove_file(pf.join(format!("virtfn{i}")))?;
            }
            return write_existing(
                attr, "0
",
            );
        }
        let pf_addr: passage_model::PciAddress = file_name(pf)
            .parse()
            .map_err(|e| err(io::ErrorKind::InvalidData, format!("{e}")))?;
        let ids = super::tree::Ids::read(pf)?.of_vf();
        let numa: u32 = read_attr(&pf.join("numa_node"))?
            .trim()
            .parse()
            .unwrap_or(0);
        let rid = (u32::from(pf_addr.bus) << 8)
            | (u32::from(pf_addr.device) << 3)
            | u32::from(pf_addr.function);
        let first_group = self.next_iommu_group()?;
        for i in 0..n {
            let vf_rid = rid + 128 + 2 * i;
            if vf_rid >> 8 != u32::from(pf_addr.bus) {
                return Err(err(
                    io::ErrorKind::OutOfMemory,
                    format!("VF {i} would be on another bus (ENOMEM)"),
                ));
            }
            let vf = passage_model::PciAddress {
                domain: pf_addr.domain,
                bus: pf_addr.bus,
                device: ((vf_rid >> 3) & 0x1f) as u8,
                function: (vf_rid & 7) as u8,
            };
            let rel = parent
                .strip_prefix(&self.root)
                .map_err(|_| err(io::ErrorKind::InvalidData, "outside the tree".into()))?
                .join(vf.to_string());
            super::tree::write_vf(&self.root, &rel, vf, pf_addr, ids, numa, first_group + i)?;
            symlink(&format!("../{vf}"), &pf.join(format!("virtfn{i}")))?;
        }
        write_existing(attr, &format!("{n}\n"))
    }

    /// A number no IOMMU group of the tree has.
    fn next_iommu_group(&self) -> io::Result<u32> {
        let mut next = 0;
        for e in fs::read_dir(self.root.join("kernel/iommu_groups"))? {
            if let Ok(g) = e?.file_name().to_string_lossy().parse::<u32>() {
                next = next.max(g + 1);
            }
        }
        Ok(next)
    }

    /// A function gone from the tree: its directory, its driver's and the bus's links to
    /// it, and its IOMMU group.
    fn remove_function(&self, dir: &Path) -> io::Result<()> {
        let bdf = file_name(dir);
        if let Some(d) = bound_driver(dir)? {
            let _ = fs::remove_file(self.drivers().join(d).join(&bdf));
        }
        let _ = fs::remove_file(self.root.join("bus/pci/devices").join(&bdf));
        if let Some(g) = link_basename(&dir.join("iommu_group"))?
            && g.parse::<u32>().is_ok()
        {
            let _ = fs::remove_dir_all(self.root.join("kernel/iommu_groups").join(g));
        }
        fs::remove_dir_all(dir)
    }

    /// The PF of a VF and all the PF's VFs' directories.
    fn vf_family(vf: &Path) -> io::Result<(PathBuf, Vec<PathBuf>)> {
        let parent = vf
            .parent()
            .ok_or_else(|| err(io::ErrorKind::NotFound, "no parent".into()))?;
        let pf = link_basename(&vf.join("physfn"))?
            .map(|b| parent.join(b))
            .ok_or_else(|| {
                err(
                    io::ErrorKind::NotFound,
                    format!("{} is not a VF", vf.display()),
                )
            })?;
        let vfs = Self::virtfns(&pf)?.into_iter().map(|(_, v)| v).collect();
        Ok((pf, vfs))
    }

    /// A PF's VFs as its `virtfnN` links name them (N and the VF's directory), for
    /// N below its `sriov_numvfs`.
    fn virtfns(pf: &Path) -> io::Result<Vec<(usize, PathBuf)>> {
        let parent = pf
            .parent()
            .ok_or_else(|| err(io::ErrorKind::NotFound, "no parent".into()))?;
        let n: usize = read_attr(&pf.join("sriov_numvfs"))?
            .trim()
            .parse()
            .unwrap_or(0);
        let mut vfs = Vec::new();
        for i in 0..n {
            if let Some(b) = link_basename(&pf.join(format!("virtfn{i}")))? {
                vfs.push((i, parent.join(b)));
            }
        }
        Ok(vfs)
    }

    fn vf_set_type(&self, nv: &Path, value: &str) -> io::Result<()> {
        let vf = nv
            .parent()
            .ok_or_else(|| err(io::ErrorKind::NotFound, "no VF".into()))?;
        let (pf, vfs) = Self::vf_family(vf)?;
        let types = Self::table_of(&pf)?;
        let want = value.trim();
        if want.is_empty() || want.len() > 10 || !want.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err(
                io::ErrorKind::InvalidInput,
                format!("{want:?} is not a vGPU type id (EINVAL)"),
            ));
        }
        let want = want.trim_start_matches('0');
        let file = nv.join("current_vgpu_type");
        let current = read_attr(&file)?;
        if want.is_empty() {
            write_existing(&file, "0\n")?;
        } else {
            if current.trim() != "0" {
                return Err(err(
                    io::ErrorKind::ResourceBusy,
                    format!(
                        "{} already is a vGPU of type {} (EBUSY)",
                        file_name(vf),
                        current.trim()
                    ),
                ));
            }
            let creatable = read_attr(&nv.join("creatable_vgpu_types"))?;
            let listed = creatable
                .lines()
                .skip(1)
                .any(|l| l.split_once(':').is_some_and(|(id, _)| id.trim() == want));
            if !listed {
                return Err(err(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "vGPU type {want} cannot be created on {} now (EINVAL)",
                        file_name(vf)
                    ),
                ));
            }
            write_existing(&file, &format!("{want}\n"))?;
        }
        let existing = fake_vgpu::vf_types(&vfs)?;
        let mig = self.mig_of(&pf);
        for v in &vfs {
            let cur = read_attr(&v.join("nvidia/current_vgpu_type"))?;
            let text = if cur.trim() == "0" {
                fake_vgpu::creatable_text(types, mig, &existing)
            } else {
                "ID    : vGPU Name\n".to_string()
            };
            write_existing(&v.join("nvidia/creatable_vgpu_types"), &text)?;
        }
        Ok(())
    }
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn symlink(target: &str, link: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(target, link)
    }
    #[cfg(not(unix))]
    {
        let _ = (target, link);
        Err(io::Error::other("symlinks need unix"))
    }
}

impl SysfsOps for FakeKernel {
    fn root(&self) -> &Path {
        &self.root
    }

    fn write_attr(&self, path: &Path, value: &str) -> io::Result<()> {
        let rel = path.strip_prefix(&self.root).map_err(|_| {
            err(
                io::ErrorKind::InvalidInput,
                format!("{} is outside the tree", path.display()),
            )
        })?;
        if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(err(
                io::ErrorKind::InvalidInput,
                format!("{} is not a plain path", path.display()),
            ));
        }
        let parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
        match parts.as_slice() {
            ["bus", "pci", "drivers", drv, "unbind"] => {
                let dir = self.function_dir(value)?;
                if *drv == "nvidia" {
                    let busy = self.root.join(BUSY_DIR).join(file_name(&dir));
                    while busy.exists() {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                    }
                }
                write_existing(path, value)?;
                self.detach(&dir, drv)?;
                host_log(&self.root, &format!("unbind {drv} {}", file_name(&dir)))
            }
            ["bus", "pci", "drivers", drv, "bind"] => {
                let dir = self.function_dir(value)?;
                write_existing(path, value)?;
                // The kernel only lets the override's driver match a device that has one.
                if let Some(o) = Self::override_of(&dir)?
                    && o != *drv
                {
                    return Err(err(
                        io::ErrorKind::NotFound,
                        format!("{} has driver_override {o}", file_name(&dir)),
                    ));
                }
                self.attach(&dir, drv)?;
                host_log(&self.root, &format!("bind {drv} {}", file_name(&dir)))
            }
            ["bus", "pci", "drivers_probe"] => {
                let dir = self.function_dir(value)?;
                write_existing(path, value)?;
                self.probe(&dir)?;
                let now = bound_driver(&dir)?.unwrap_or_else(|| "-".to_string());
                host_log(&self.root, &format!("probe {} {now}", file_name(&dir)))
            }
            ["devices", .., "driver_override"] => {
                let text = value.trim();
                let stored = if text.is_empty() { "(null)" } else { text };
                write_existing(path, &format!("{stored}\n"))
            }
            ["devices", .., "reset"] => {
                if value.trim() == "1"
                    && super::gpu_zero::fault_on(&self.root, super::gpu_zero::FakeFault::ResetFails)
                {
                    return Err(io::Error::from_raw_os_error(5));
                }
                write_existing(path, value)?;
                if value.trim() == "1" {
                    let bdf = path.parent().map(file_name).unwrap_or_default();
                    let mut log = fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(self.root.join(RESET_LOG))?;
                    writeln!(log, "{bdf}")?;
                    host_log(&self.root, &format!("reset {bdf}"))?;
                }
                Ok(())
            }
            ["devices", .., "mdev_supported_types", _, "create"] => {
                let type_dir = path.parent().unwrap_or(path);
                self.mdev_create(type_dir, value)
            }
            ["devices", .., "remove"]
                if path.parent().is_some_and(|m| m.join("mdev_type").exists()) =>
            {
                self.mdev_remove(path.parent().unwrap_or(path), value)
            }
            ["devices", .., "sriov_numvfs"] => self.set_numvfs(path, value),
            ["devices", .., "nvidia", "current_vgpu_type"] => {
                self.vf_set_type(path.parent().unwrap_or(path), value)
            }
            _ => write_existing(path, value),
        }
    }
}
