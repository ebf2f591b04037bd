//! A fake kernel over a generated tree: it performs each attribute write, then changes the
//! tree the way Linux's PCI core would (driver links, overrides), so the binder's code
//! runs unchanged against it.

use crate::host::{SysfsOps, bound_driver, read_attr, write_existing};
use std::fs;
use std::io::{self, Write};
use std::path::{Component, Path, PathBuf};

/// Where the fake records each function reset, one address a line.
pub const RESET_LOG: &str = ".passage-fake-resets.log";

/// The driver a kernel would pick for a function with no override: the module alias
/// table of this fake world. The generator binds the same drivers.
pub fn native_driver(vendor: u16, device: u16, class: u32) -> Option<&'static str> {
    match (vendor, device, class >> 8) {
        (0x10de, _, 0x0300 | 0x0302) => Some("nvidia"),
        (_, _, 0x0403) => Some("snd_hda_intel"),
        (_, _, 0x0604) => Some("pcieport"),
        (0x8086, 0x1521, _) => Some("igb"),
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
        let dir = fs::canonicalize(self.root.join("bus/pci/devices").join(bdf))
            .map_err(|_| err(io::ErrorKind::NotFound, format!("no such device {bdf}")))?;
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
                write_existing(path, value)?;
                self.detach(&dir, drv)
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
                self.attach(&dir, drv)
            }
            ["bus", "pci", "drivers_probe"] => {
                let dir = self.function_dir(value)?;
                write_existing(path, value)?;
                self.probe(&dir)
            }
            ["devices", .., "driver_override"] => {
                let text = value.trim();
                let stored = if text.is_empty() { "(null)" } else { text };
                write_existing(path, &format!("{stored}\n"))
            }
            ["devices", .., "reset"] => {
                write_existing(path, value)?;
                if value.trim() == "1" {
                    let bdf = path.parent().map(file_name).unwrap_or_default();
                    let mut log = fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(self.root.join(RESET_LOG))?;
                    writeln!(log, "{bdf}")?;
                }
                Ok(())
            }
            _ => write_existing(path, value),
        }
    }
}
