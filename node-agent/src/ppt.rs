//! The illumos (SmartOS) side of passthrough, as text: lines for `/etc/ppt_matches` and
//! `/etc/ppt_aliases`, and the `pptadm` command that shows the result.
//!
//! What illumos expects, from its `pptadm` source and the SmartOS bhyve write-ups:
//! - `/etc/ppt_matches` lists the *kinds* of device that may be passed through, one
//!   compatible name a line in `pciexVVVV,DDDD` form (lowercase hex, no leading zeros,
//!   as illumos writes compatible names);
//! - `/etc/ppt_aliases` reserves *specific* devices by physical path, in
//!   `driver_aliases` syntax: `ppt "/pci@0,0/pci8086,151@1/display@0"`. The kernel reads
//!   it at boot and attaches the `ppt` stub driver, keeping the host's drivers off;
//! - `pptadm` only lists (`pptadm list [-j]`, `pptadm list [-ap] [-o fields]`): there is
//!   no `pptadm add` or `remove`. Reserving or releasing a device is an edit of
//!   `ppt_aliases` followed by a reboot (on SmartOS the file lives on the boot media as
//!   a boot module, since `/etc` is a ramdisk). Whether `update_drv` can rebind a path
//!   alias at run time is not documented; this module does not rely on it.
//!
//! The physical path is the illumos one (`/pci@0,0/…`), which only an agent running on
//! illumos can read; the Linux `DevicePath` has no direct translation.

use passage_model::HexId;

/// Longest illumos physical path accepted (same bound as a Linux device path).
const MAX_PATH_LEN: usize = passage_model::pci::MAX_DEVICE_PATH_LEN;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PptError {
    #[error("{0:?} is not an illumos PCI physical path (/pci@…, printable, no quotes)")]
    Path(String),
}

/// Checks an illumos physical path: `/pci@…`, printable ASCII without quotes or spaces
/// (the aliases file quotes it, so a quote would end the entry early).
pub fn validate_path(path: &str) -> Result<(), PptError> {
    let p = path.strip_prefix("/devices").unwrap_or(path);
    let ok = p.starts_with("/pci")
        && p.len() <= MAX_PATH_LEN
        && p.bytes()
            .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
        && !p.split('/').any(|c| c == ".." || c == ".");
    if ok {
        Ok(())
    } else {
        Err(PptError::Path(path.chars().take(80).collect()))
    }
}

/// The `/etc/ppt_aliases` line reserving the device at `path` for passthrough. A leading
/// `/devices` (as vmadm's `pci_devices[].path` has it) is dropped: aliases name paths
/// below it.
pub fn ppt_alias_line(path: &str) -> Result<String, PptError> {
    validate_path(path)?;
    let p = path.strip_prefix("/devices").unwrap_or(path);
    Ok(format!("ppt \"{p}\""))
}

/// The `/etc/ppt_matches` line for a kind of device: `pciex10de,1db4`.
pub fn ppt_match_line(vendor: HexId, device: HexId) -> String {
    format!("pciex{:x},{:x}", vendor.0, device.0)
}

/// `/etc/ppt_aliases` with `path` reserved: the other lines kept as they were, the entry
/// added once. Returns the new text.
pub fn add_alias(existing: &str, path: &str) -> Result<String, PptError> {
    let line = ppt_alias_line(path)?;
    let mut out: Vec<&str> = existing.lines().collect();
    if !out.iter().any(|l| l.trim() == line) {
        out.push(&line);
    }
    Ok(join_lines(&out))
}

/// `/etc/ppt_aliases` with `path` released: its entry removed, the rest kept.
pub fn remove_alias(existing: &str, path: &str) -> Result<String, PptError> {
    let line = ppt_alias_line(path)?;
    let out: Vec<&str> = existing.lines().filter(|l| l.trim() != line).collect();
    Ok(join_lines(&out))
}

fn join_lines(lines: &[&str]) -> String {
    let mut s = lines.join("\n");
    if !s.is_empty() {
        s.push('\n');
    }
    s
}

/// `pptadm list -a -p -o dev,path`: every device ppt could take, in parsable form, to
/// find the `/dev/pptN` node bhyve needs for a reserved path.
pub fn pptadm_list_argv() -> Vec<String> {
    ["pptadm", "list", "-a", "-p", "-o", "dev,path"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// Parses the output of [`pptadm_list_argv`]: `DEV:PATH` lines, where illumos' parsable
/// output escapes `:` and `\` inside a value with a backslash. Lines that do not parse
/// are left out.
pub fn parse_pptadm_list(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|line| {
            let mut fields = vec![String::new()];
            let mut chars = line.chars();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => fields.last_mut()?.push(chars.next()?),
                    ':' => fields.push(String::new()),
                    c => fields.last_mut()?.push(c),
                }
            }
            match fields.as_slice() {
                [dev, path] if dev.starts_with("/dev/ppt") && validate_path(path).is_ok() => {
                    Some((dev.clone(), path.clone()))
                }
                _ => None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn alias_and_match_lines() {
        assert_eq!(
            ppt_alias_line("/pci@0,0/pci8086,2f08@3/pci10de,1214@0").unwrap(),
            "ppt \"/pci@0,0/pci8086,2f08@3/pci10de,1214@0\""
        );
        assert_eq!(
            ppt_alias_line("/devices/pci@0,0/pci8086,151@1/display@0").unwrap(),
            "ppt \"/pci@0,0/pci8086,151@1/display@0\""
        );
        for bad in [
            "",
            "pci@0,0",
            "/pci@0,0/\"x",
            "/pci@0,0/a b",
            "/pci@0,0/../x",
            "/pci@0,0\n/x",
            "/sys/devices/pci0000:00",
        ] {
            assert!(ppt_alias_line(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            ppt_match_line(HexId(0x10de), HexId(0x1db4)),
            "pciex10de,1db4"
        );
        assert_eq!(
            ppt_match_line(HexId(0x10de), HexId(0x0a65)),
            "pciex10de,a65"
        );
    }

    #[test]
    fn editing_the_aliases_file() {
        let p = "/pci@0,0/pci8086,2f08@3/pci10de,1214@0";
        let start = "# reserved GPUs\nppt \"/pci@0,0/pci8086,151@1/display@0\"\n";
        let added = add_alias(start, p).unwrap();
        assert_eq!(
            added,
            format!("{start}ppt \"{p}\"\n"),
            "appended once, others kept"
        );
        assert_eq!(add_alias(&added, p).unwrap(), added, "idempotent");
        assert_eq!(remove_alias(&added, p).unwrap(), start);
        assert_eq!(remove_alias(start, p).unwrap(), start);
        assert_eq!(add_alias("", p).unwrap(), format!("ppt \"{p}\"\n"));
    }

    #[test]
    fn pptadm_listing() {
        assert_eq!(
            pptadm_list_argv().join(" "),
            "pptadm list -a -p -o dev,path"
        );
        let out = "/dev/ppt0:/pci@0,0/pci8086,151@1/display@0\n\
                   /dev/ppt1:/pci@0,0/pci8086,151@1/pci1462,2291\n\
                   garbage\n/dev/ppt2\n:\n/dev/ppt3:/pci@0,0/a\\:b\n";
        assert_eq!(
            parse_pptadm_list(out),
            vec![
                (
                    "/dev/ppt0".into(),
                    "/pci@0,0/pci8086,151@1/display@0".into()
                ),
                (
                    "/dev/ppt1".into(),
                    "/pci@0,0/pci8086,151@1/pci1462,2291".into()
                ),
                ("/dev/ppt3".into(), "/pci@0,0/a:b".into()),
            ]
        );
    }

    proptest! {
        #[test]
        fn never_panics(s in "\\PC{0,200}") {
            let _ = ppt_alias_line(&s);
            let _ = parse_pptadm_list(&s);
            let _ = add_alias(&s, "/pci@0,0/x@1");
        }
    }
}
