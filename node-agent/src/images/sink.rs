//! A file written and hashed at once: the two halves of taking in a large image (the
//! server's upload, the agent's download) on threads of their own, beside the task that
//! reads the network. Hashing inline made a transfer one core's work: SHA-256 of 2 GiB is
//! about 1.2 s of CPU here, the copy into the page cache about as much again, and the
//! socket reads besides; with the three apart a transfer uses every core there is.

use bytes::Bytes;
use sha2::Digest;
use std::io::{self, Seek, Write};
use std::num::NonZeroU64;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Chunks in flight per stage. A chunk is what the network gave (up to a few hundred
/// KiB), so a slow disk holds back a few MiB at most before the reader waits.
const QUEUE: usize = 16;

/// The file's dirty pages go to the disk every this many bytes. Left to the kernel, a
/// transfer smaller than its dirty threshold (a tenth of memory) reaches the disk only at
/// the final fsync, which then waits for all of it with the network idle; started as
/// the file grows, the disk writes while the rest arrives.
const WRITEBACK_WINDOW: u64 = 32 << 20;

/// Takes chunks in order; writes them to a file and hashes them on two blocking threads.
pub struct HashingSink {
    to_file: Option<mpsc::Sender<Bytes>>,
    to_hash: Option<mpsc::Sender<Bytes>>,
    writer: JoinHandle<io::Result<std::fs::File>>,
    hasher: JoinHandle<sha2::Sha256>,
}

impl HashingSink {
    /// Appends to `file` at its current position; `hasher` may hold what came before
    /// (a resumed download).
    pub fn start(file: std::fs::File, hasher: sha2::Sha256) -> Self {
        let (to_file, mut file_rx) = mpsc::channel::<Bytes>(QUEUE);
        let (to_hash, mut hash_rx) = mpsc::channel::<Bytes>(QUEUE);
        let writer = tokio::task::spawn_blocking(move || {
            let mut out = FileWriter::new(file)?;
            while let Some(chunk) = file_rx.blocking_recv() {
                out.write(&chunk)?;
            }
            out.finish()
        });
        let hasher = tokio::task::spawn_blocking(move || {
            let mut h = hasher;
            while let Some(chunk) = hash_rx.blocking_recv() {
                h.update(&chunk);
            }
            h
        });
        HashingSink {
            to_file: Some(to_file),
            to_hash: Some(to_hash),
            writer,
            hasher,
        }
    }

    /// Queues one chunk for both. An error means the writer stopped (its error comes
    /// from [`HashingSink::finish`]).
    pub async fn push(&mut self, chunk: Bytes) -> io::Result<()> {
        let stopped = || io::Error::other("the file writer stopped");
        let (Some(f), Some(h)) = (&self.to_file, &self.to_hash) else {
            return Err(stopped());
        };
        f.send(chunk.clone()).await.map_err(|_| stopped())?;
        h.send(chunk).await.map_err(|_| stopped())
    }

    /// Waits for both threads: the file with everything written (not yet synced), and
    /// the hash of everything pushed. After an error, the bytes written so far stay in
    /// the file.
    pub async fn finish(mut self) -> io::Result<(std::fs::File, sha2::Sha256)> {
        self.to_file.take();
        self.to_hash.take();
        let joined = |e: tokio::task::JoinError| io::Error::other(e.to_string());
        let file = self.writer.await.map_err(joined)??;
        let hasher = self.hasher.await.map_err(joined)?;
        Ok((file, hasher))
    }
}

/// Bytes a direct write is aligned to: the logical block size of every disk in use
/// (512 or 4096). Where a disk needs more, its first direct write fails with `EINVAL` and
/// the file is written through the page cache instead.
pub const ALIGN: usize = 4096;

/// Bytes gathered per direct write.
const DIRECT_CHUNK: usize = 4 << 20;

/// Writes a large file once and reads nothing back: with `O_DIRECT`, from an aligned
/// buffer straight to the disk. Through the page cache every byte costs a page to find
/// and fill, then a writeback: measured here with `dd`, 1 GiB took 0.8–3 s of system CPU
/// that way and 0.2–0.3 s direct, and that CPU is what an upload or a download competes
/// for with the socket and the hash. Falls back to the page cache where the file system
/// refuses `O_DIRECT` (tmpfs), where the file starts at an unaligned offset (a resumed
/// download) and for the final partial block.
struct FileWriter {
    file: std::fs::File,
    /// `Some` while writing direct: `DIRECT_CHUNK` aligned bytes from `start`.
    direct: Option<DirectBuf>,
    /// Page-cache mode: the range not yet handed to writeback.
    unflushed_from: u64,
    unflushed: u64,
}

struct DirectBuf {
    mem: Vec<u8>,
    start: usize,
    len: usize,
}

impl DirectBuf {
    fn filled(&self) -> &[u8] {
        &self.mem[self.start..self.start + self.len]
    }
}

impl FileWriter {
    fn new(file: std::fs::File) -> io::Result<Self> {
        let mut file = file;
        let pos = file.stream_position()?;
        let direct = if pos % ALIGN as u64 == 0 && set_direct(&file, true).is_ok() {
            let mem = vec![0u8; DIRECT_CHUNK + ALIGN];
            let start = mem.as_ptr().align_offset(ALIGN);
            (start <= ALIGN).then_some(DirectBuf { mem, start, len: 0 })
        } else {
            None
        };
        if direct.is_none() {
            let _ = set_direct(&file, false);
        }
        Ok(FileWriter {
            file,
            direct,
            unflushed_from: pos,
            unflushed: 0,
        })
    }

    fn write(&mut self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let Some(buf) = self.direct.as_mut() else {
                return self.write_cached(data);
            };
            let n = (DIRECT_CHUNK - buf.len).min(data.len());
            let at = buf.start + buf.len;
            buf.mem[at..at + n].copy_from_slice(&data[..n]);
            buf.len += n;
            data = &data[n..];
            if buf.len == DIRECT_CHUNK {
                self.flush_direct(DIRECT_CHUNK)?;
            }
        }
        Ok(())
    }

    /// Writes the first `n` gathered bytes (a multiple of [`ALIGN`]) and keeps the rest.
    fn flush_direct(&mut self, n: usize) -> io::Result<()> {
        let Some(buf) = self.direct.as_mut() else {
            return Ok(());
        };
        let mut written = 0;
        while written < n {
            let from = buf.start + written;
            match self.file.write(&buf.mem[from..buf.start + n]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                // A short direct write leaves an unaligned rest: that goes through the
                // page cache like a refused one.
                Ok(k) if (written + k) % ALIGN == 0 => written += k,
                Ok(k) => {
                    written += k;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
                    tracing::debug!("direct writes refused; writing through the page cache");
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        if written == n {
            buf.mem
                .copy_within(buf.start + n..buf.start + buf.len, buf.start);
            buf.len -= n;
            return Ok(());
        }
        // Back to the page cache for good, with everything not yet written.
        let rest = buf.mem[buf.start + written..buf.start + buf.len].to_vec();
        self.direct = None;
        set_direct(&self.file, false)?;
        self.unflushed_from = self.file.stream_position()?;
        self.write_cached(&rest)
    }

    fn write_cached(&mut self, data: &[u8]) -> io::Result<()> {
        self.file.write_all(data)?;
        self.unflushed += data.len() as u64;
        if self.unflushed >= WRITEBACK_WINDOW {
            start_writeback(&self.file, self.unflushed_from, self.unflushed);
            self.unflushed_from += self.unflushed;
            self.unflushed = 0;
        }
        Ok(())
    }

    /// Everything written: the aligned part direct, the last partial block through the
    /// page cache. The file is left without `O_DIRECT` for whoever reads it next.
    fn finish(mut self) -> io::Result<std::fs::File> {
        if let Some(buf) = &self.direct {
            let aligned = buf.len - buf.len % ALIGN;
            self.flush_direct(aligned)?;
        }
        if let Some(buf) = self.direct.take() {
            set_direct(&self.file, false)?;
            self.file.write_all(buf.filled())?;
        }
        Ok(self.file)
    }
}

/// Turns `O_DIRECT` on or off for an open file (the server's direct reads use it too).
pub fn set_direct(file: &std::fs::File, on: bool) -> io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(file)?;
    let flags = if on {
        flags | rustix::fs::OFlags::DIRECT
    } else {
        flags - rustix::fs::OFlags::DIRECT
    };
    rustix::fs::fcntl_setfl(file, flags)?;
    Ok(())
}

/// Asks the kernel to start writing a range of the file to disk, without waiting.
/// Linux does that for `POSIX_FADV_DONTNEED` (then drops the range's clean pages; the
/// ones just written are dirty or under writeback and stay). Best effort: where it fails
/// the final fsync does the work, as before.
fn start_writeback(file: &std::fs::File, offset: u64, len: u64) {
    if let Err(e) = rustix::fs::fadvise(
        file,
        offset,
        NonZeroU64::new(len),
        rustix::fs::Advice::DontNeed,
    ) {
        tracing::debug!(error = %e, "starting writeback early failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn writes_and_hashes_what_it_is_given_in_order() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("f");
        let file = std::fs::File::create(&path).unwrap_or_else(|e| panic!("{e}"));
        // A resumed transfer: the hasher already holds the first part.
        let mut before = sha2::Sha256::new();
        before.update(b"head-");
        let mut sink = HashingSink::start(file, before);
        let mut whole = b"head-".to_vec();
        for i in 0..200u32 {
            let chunk = Bytes::from(vec![(i % 251) as u8; 1000 + i as usize]);
            whole.extend_from_slice(&chunk);
            sink.push(chunk).await.unwrap_or_else(|e| panic!("{e}"));
        }
        let (file, hasher) = sink.finish().await.unwrap_or_else(|e| panic!("{e}"));
        drop(file);
        assert_eq!(
            hasher.finalize().as_slice(),
            sha2::Sha256::digest(&whole).as_slice()
        );
        let written = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(written, whole[5..]);
    }

    #[tokio::test]
    async fn a_file_past_the_writeback_window_is_whole() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("f");
        let file = std::fs::File::create(&path).unwrap_or_else(|e| panic!("{e}"));
        let mut sink = HashingSink::start(file, sha2::Sha256::new());
        let mut whole = sha2::Sha256::new();
        let chunks = (WRITEBACK_WINDOW / (1 << 20)) * 2 + 3;
        // Odd sizes: direct writes gather whole blocks, the last partial one is not.
        let mut len = 0u64;
        for i in 0..chunks {
            let chunk = Bytes::from(vec![(i % 251) as u8; (1 << 20) + 7 * i as usize]);
            len += chunk.len() as u64;
            whole.update(&chunk);
            sink.push(chunk).await.unwrap_or_else(|e| panic!("{e}"));
        }
        let (file, hasher) = sink.finish().await.unwrap_or_else(|e| panic!("{e}"));
        file.sync_all().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(hasher.finalize(), whole.clone().finalize());
        let written = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(written.len() as u64, len);
        assert_eq!(sha2::Sha256::digest(&written), whole.finalize());
    }

    #[tokio::test]
    async fn a_resumed_file_at_an_unaligned_offset_is_whole() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("f");
        std::fs::write(&path, b"12345").unwrap_or_else(|e| panic!("{e}"));
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("{e}"));
        file.seek(io::SeekFrom::End(0))
            .unwrap_or_else(|e| panic!("{e}"));
        let mut sink = HashingSink::start(file, sha2::Sha256::new());
        let mut whole = b"12345".to_vec();
        for i in 0..(DIRECT_CHUNK / (1 << 20) + 3) {
            let chunk = Bytes::from(vec![i as u8; (1 << 20) + 3]);
            whole.extend_from_slice(&chunk);
            sink.push(chunk).await.unwrap_or_else(|e| panic!("{e}"));
        }
        let (file, _) = sink.finish().await.unwrap_or_else(|e| panic!("{e}"));
        drop(file);
        let written = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
        assert!(written == whole, "the file differs from what was pushed");
    }

    #[tokio::test]
    async fn a_failing_write_is_reported_by_finish() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("f");
        std::fs::write(&path, b"x").unwrap_or_else(|e| panic!("{e}"));
        // Opened read-only: every write fails.
        let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{e}"));
        let mut sink = HashingSink::start(file, sha2::Sha256::new());
        // The writer may stop before or after the first push is queued; pushes after it
        // stopped fail, and finish says why either way.
        let mut refused = false;
        let block = Bytes::from(vec![7u8; 1 << 20]);
        for _ in 0..(QUEUE * 4 + DIRECT_CHUNK / (1 << 20)) {
            if sink.push(block.clone()).await.is_err() {
                refused = true;
                break;
            }
        }
        assert!(refused, "pushes go on after the writer stopped");
        assert!(sink.finish().await.is_err());
    }
}
