//! Small JSON files in the agent's state dir, written so a crash never leaves half a file.

use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Reads a JSON file; `Ok(None)` when it does not exist.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> io::Result<Option<T>> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    serde_json::from_str(&text).map(Some).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {e}", path.display()),
        )
    })
}

/// Writes through a scratch file beside `path`, swapped in atomically: a reader (or a
/// restarted agent) sees the old content or the new, never a torn one. `mode` applies to
/// the file (Unix).
///
/// The scratch file is kept and reused, and the two are exchanged (`renameat2` with
/// `RENAME_EXCHANGE`) rather than renamed over: a rename deletes the old file's inode and
/// the next write makes a new one. On a file system without a journal (this project's
/// test machines) ext4 then scans past every inode deleted in the last seconds for each new
/// one, and a fleet of simulated nodes spent a fifth of its CPU there. Where the exchange
/// is not supported, a plain rename.
pub fn write_json<T: Serialize>(path: &Path, value: &T, mode: u32) -> io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    fs::create_dir_all(dir)?;
    let text = serde_json::to_vec_pretty(value).map_err(io::Error::other)?;
    let tmp = scratch_path(path);
    {
        let mut opts = fs::OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(mode);
        }
        let mut f = opts.open(&tmp)?;
        // A scratch file made before keeps the mode it was made with.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            if f.metadata()?.permissions().mode() & 0o7777 != mode {
                f.set_permissions(fs::Permissions::from_mode(mode))?;
            }
        }
        #[cfg(not(unix))]
        let _ = mode;
        f.write_all(&text)?;
        f.write_all(b"\n")?;
        f.sync_all()?;
    }
    if exchange(&tmp, path)? {
        // The old content is in the scratch file now: emptied, so that nothing old (a
        // replaced credential) lingers there.
        if let Ok(f) = fs::OpenOptions::new().write(true).open(&tmp) {
            let _ = f.set_len(0);
        }
        return Ok(());
    }
    fs::rename(&tmp, path)
}

/// Removes a file written by [`write_json`] and its scratch file; a missing file is
/// `NotFound`, as with `fs::remove_file`.
pub fn remove_json(path: &Path) -> io::Result<()> {
    match fs::remove_file(scratch_path(path)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    fs::remove_file(path)
}

/// `DIR/.NAME.tmp`: hidden, so nothing that lists a state directory takes it for a record.
pub fn scratch_path(path: &Path) -> PathBuf {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "state".to_string());
    dir.join(format!(".{file_name}.tmp"))
}

/// Swaps the two names; `false` where that cannot be done here (no `path` yet, or a file
/// system or kernel without the exchange), for the caller to rename instead.
fn exchange(tmp: &Path, path: &Path) -> io::Result<bool> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        use rustix::fs::{CWD, RenameFlags, renameat_with};
        use rustix::io::Errno;
        match renameat_with(CWD, tmp, CWD, path, RenameFlags::EXCHANGE) {
            Ok(()) => Ok(true),
            Err(Errno::NOENT | Errno::INVAL | Errno::NOSYS | Errno::NOTSUP | Errno::PERM) => {
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        let _ = (tmp, path);
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_missing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/x.json");
        assert_eq!(read_json::<Vec<u32>>(&p).unwrap(), None);
        write_json(&p, &vec![1u32, 2], 0o600).unwrap();
        assert_eq!(read_json::<Vec<u32>>(&p).unwrap(), Some(vec![1, 2]));
        fs::write(&p, "{garbage").unwrap();
        assert!(read_json::<Vec<u32>>(&p).is_err());
    }

    #[test]
    fn rewrites_reuse_one_scratch_file_and_leave_nothing_old_in_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("credential.json");
        for i in 0..5u32 {
            write_json(&p, &vec![i; 3], 0o600).unwrap();
            assert_eq!(read_json::<Vec<u32>>(&p).unwrap(), Some(vec![i; 3]));
        }
        let names: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.len() <= 2, "left behind: {names:?}");
        let scratch = scratch_path(&p);
        if scratch.exists() {
            assert_eq!(fs::read(&scratch).unwrap().len(), 0, "old content kept");
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
        remove_json(&p).unwrap();
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
        assert_eq!(remove_json(&p).unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    #[cfg(unix)]
    #[test]
    fn a_scratch_file_left_with_another_mode_gets_the_one_asked() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.json");
        fs::write(scratch_path(&p), "stale").unwrap();
        fs::set_permissions(scratch_path(&p), fs::Permissions::from_mode(0o644)).unwrap();
        write_json(&p, &1u32, 0o600).unwrap();
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(read_json::<u32>(&p).unwrap(), Some(1));
    }
}
