//! A VM's serial console on disk: QEMU appends the guest's output to `console.log`; the
//! agent keeps the file bounded and answers its end ([`MAX_CONSOLE_BYTES`]).
//!
//! QEMU opens the file with `O_APPEND` (`append=on`), so it may be cut short under QEMU:
//! each write lands at the file's end, whatever its length is now. Once the file passes
//! [`TRIM_AT`] bytes its end goes to `console.log.0` (replaced whole) and the file is
//! emptied; a reader joins the two. What the guest prints between the copy and the cut is
//! lost: a few bytes at most, once per megabyte of console.

use passage_model::protocol::MAX_CONSOLE_BYTES;
use std::fs;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The console file's size past which it is trimmed: large enough that a booting guest
/// is trimmed rarely, small enough that a guest printing forever costs the node little.
pub const TRIM_AT: u64 = 1024 * 1024;

/// What the file holds before it was last emptied: its last [`MAX_CONSOLE_BYTES`].
pub fn previous(console: &Path) -> PathBuf {
    let mut name = console.as_os_str().to_owned();
    name.push(".0");
    PathBuf::from(name)
}

/// The last `max` bytes of `path`; nothing when it does not exist.
fn read_tail(path: &Path, max: usize) -> io::Result<Vec<u8>> {
    let mut f = match fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    let max = max as u64;
    f.seek(SeekFrom::Start(len.saturating_sub(max)))?;
    let mut out = Vec::new();
    // `take`: the guest may print while we read.
    f.take(max).read_to_end(&mut out)?;
    Ok(out)
}

/// Empties `console` when it has grown past [`TRIM_AT`], keeping its end in
/// [`previous`]; answers whether it did.
pub fn trim(console: &Path) -> io::Result<bool> {
    match fs::metadata(console) {
        Ok(m) if m.len() > TRIM_AT => {}
        Ok(_) => return Ok(false),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    }
    let end = read_tail(console, MAX_CONSOLE_BYTES)?;
    let prev = previous(console);
    let mut tmp = prev.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut opts = fs::OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        // The tenant's words: theirs and the agent's only.
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        opts.open(&tmp)?.write_all(&end)?;
    }
    fs::rename(&tmp, &prev)?;
    fs::OpenOptions::new()
        .write(true)
        .open(console)?
        .set_len(0)?;
    Ok(true)
}

/// The console's last [`MAX_CONSOLE_BYTES`], across a trim, as text: invalid UTF-8
/// becomes U+FFFD, and a character cut by the window is dropped rather than mangled.
pub fn tail(console: &Path) -> io::Result<String> {
    let mut bytes = read_tail(console, MAX_CONSOLE_BYTES)?;
    if bytes.len() < MAX_CONSOLE_BYTES {
        let mut before = read_tail(&previous(console), MAX_CONSOLE_BYTES - bytes.len())?;
        before.append(&mut bytes);
        bytes = before;
    }
    Ok(text(&bytes))
}

fn text(bytes: &[u8]) -> String {
    // At most three continuation bytes can open a window cut inside a character.
    let skip = bytes
        .iter()
        .take(3)
        .take_while(|b| (0x80..0xC0).contains(*b))
        .count();
    String::from_utf8_lossy(&bytes[skip..]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_console_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let c = dir.path().join("console.log");
        assert_eq!(tail(&c).unwrap(), "");
        assert!(!trim(&c).unwrap());
    }

    #[test]
    fn the_end_only_and_across_a_trim() {
        let dir = tempfile::tempdir().unwrap();
        let c = dir.path().join("console.log");
        fs::write(&c, "boot\nlogin: ").unwrap();
        assert_eq!(tail(&c).unwrap(), "boot\nlogin: ");
        assert!(!trim(&c).unwrap(), "small: left alone");

        // A guest that printed more than the limit: only the end is answered.
        let line = "0123456789abcdef\n";
        let mut f = fs::OpenOptions::new().append(true).open(&c).unwrap();
        let lines = TRIM_AT as usize / line.len() + 2;
        for _ in 0..lines {
            f.write_all(line.as_bytes()).unwrap();
        }
        let t = tail(&c).unwrap();
        assert_eq!(t.len(), MAX_CONSOLE_BYTES);
        assert!(t.ends_with(line));

        // Trimmed: the file is emptied and the writer (O_APPEND, as QEMU's) goes on at
        // its new end; the reader sees the kept end, then what came after.
        assert!(trim(&c).unwrap());
        assert_eq!(fs::metadata(&c).unwrap().len(), 0);
        assert_eq!(tail(&c).unwrap(), t);
        f.write_all(b"after the trim\n").unwrap();
        assert_eq!(fs::metadata(&c).unwrap().len(), 15);
        let t2 = tail(&c).unwrap();
        assert_eq!(t2.len(), MAX_CONSOLE_BYTES);
        assert!(t2.ends_with("0123456789abcdef\nafter the trim\n"), "{t2:?}");
    }

    #[test]
    fn a_character_cut_by_the_window_is_dropped_and_bad_bytes_replaced() {
        assert_eq!(text("é!".as_bytes()), "é!");
        // "é" is C3 A9: a window starting at A9.
        assert_eq!(text(&[0xA9, b'o', b'k']), "ok");
        assert_eq!(text(&[b'a', 0xFF, b'b']), "a\u{FFFD}b");
    }
}
