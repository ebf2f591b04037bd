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

/// Batches in flight per stage: a slow disk holds back a few MiB at most before the
/// reader waits.
const QUEUE: usize = 4;

/// Bytes of network chunks handed over at once. A chunk is what one socket read gave,
/// often 64 KiB (what curl writes at a time); handing each to both threads cost two
/// wake-ups per chunk, and the threads then sat idle a third of an upload. The chunks
/// are handed over as they are, uncopied.
const BATCH: usize = 1 << 20;

type Batch = std::sync::Arc<Vec<Bytes>>;

/// The file's dirty pages go to the disk every this many bytes. Left to the kernel, a
/// transfer smaller than its dirty threshold (a tenth of memory) reaches the disk only at
/// the final fsync, which then waits for all of it with the network idle; started as
/// the file grows, the disk writes while the rest arrives.
const WRITEBACK_WINDOW: u64 = 32 << 20;

/// Takes chunks in order; writes them to a file and hashes them on two blocking threads.
pub struct HashingSink {
    to_file: Option<mpsc::Sender<Batch>>,
    to_hash: Option<mpsc::Sender<Batch>>,
    pending: Vec<Bytes>,
    pending_len: usize,
    writer: JoinHandle<io::Result<std::fs::File>>,
    hasher: JoinHandle<sha2::Sha256>,
}

impl HashingSink {
    /// Appends to `file` at its current position; `hasher` may hold what came before
    /// (a resumed download).
    pub fn start(file: std::fs::File, hasher: sha2::Sha256) -> Self {
        let (to_file, mut file_rx) = mpsc::channel::<Batch>(QUEUE);
        let (to_hash, mut hash_rx) = mpsc::channel::<Batch>(QUEUE);
        let writer = tokio::task::spawn_blocking(move || {
            let mut out = FileWriter::new(file)?;
            while let Some(batch) = file_rx.blocking_recv() {
                for chunk in batch.iter() {
                    if let Err(e) = out.write(chunk) {
                        // The disk thread's own error says more than "it stopped".
                        return Err(out.finish().err().unwrap_or(e));
                    }
                }
            }
            out.finish()
        });
        let hasher = tokio::task::spawn_blocking(move || {
            let mut h = hasher;
            while let Some(batch) = hash_rx.blocking_recv() {
                for chunk in batch.iter() {
                    h.update(chunk);
                }
            }
            h
        });
        HashingSink {
            to_file: Some(to_file),
            to_hash: Some(to_hash),
            pending: Vec::new(),
            pending_len: 0,
            writer,
            hasher,
        }
    }

    /// Queues one chunk for both. An error means the writer stopped (its error comes
    /// from [`HashingSink::finish`]).
    pub async fn push(&mut self, chunk: Bytes) -> io::Result<()> {
        self.pending_len += chunk.len();
        self.pending.push(chunk);
        if self.pending_len >= BATCH {
            self.hand_over().await?;
        }
        Ok(())
    }

    async fn hand_over(&mut self) -> io::Result<()> {
        let (Some(f), Some(h)) = (&self.to_file, &self.to_hash) else {
            return Err(writer_stopped());
        };
        let batch: Batch = std::sync::Arc::new(std::mem::take(&mut self.pending));
        self.pending_len = 0;
        f.send(batch.clone()).await.map_err(|_| writer_stopped())?;
        h.send(batch).await.map_err(|_| writer_stopped())
    }

    /// Waits for both threads: the file with everything written (not yet synced), and
    /// the hash of everything pushed. After an error, the bytes written so far stay in
    /// the file.
    pub async fn finish(mut self) -> io::Result<(std::fs::File, sha2::Sha256)> {
        if !self.pending.is_empty() {
            // A stopped writer says why below.
            let _ = self.hand_over().await;
        }
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

/// Aligned buffers per file: one on its way to the disk, one full and waiting, one
/// filling. With a single buffer the disk sat idle while it was refilled and the network
/// stalled while it was written: measured on a disk-bound VM, the disk was busy 4.1–4.8 s
/// of a 5.1–5.7 s upload.
const DIRECT_BUFFERS: usize = 3;

/// Writes a large file once and reads nothing back: with `O_DIRECT`, from aligned
/// buffers straight to the disk. Through the page cache every byte costs a page to find
/// and fill, then a writeback: measured here with `dd`, 1 GiB took 0.8–3 s of system CPU
/// that way and 0.2–0.3 s direct, and that CPU is what an upload or a download competes
/// for with the socket and the hash. The buffers are filled on the caller's thread and
/// written on a thread of their own, so the disk always has the next one. Falls back to
/// the page cache where the file system refuses `O_DIRECT` (tmpfs), where the file
/// starts at an unaligned offset (a resumed download) and for the final partial block.
enum FileWriter {
    Direct {
        filling: DirectBuf,
        to_disk: std::sync::mpsc::SyncSender<DirectBuf>,
        spare: std::sync::mpsc::Receiver<DirectBuf>,
        disk: std::thread::JoinHandle<io::Result<std::fs::File>>,
    },
    Cached(CachedWriter),
}

struct DirectBuf {
    mem: Vec<u8>,
    start: usize,
    len: usize,
}

impl DirectBuf {
    fn new() -> Option<Self> {
        let mem = vec![0u8; DIRECT_CHUNK + ALIGN];
        let start = mem.as_ptr().align_offset(ALIGN);
        (start <= ALIGN).then_some(DirectBuf { mem, start, len: 0 })
    }

    fn filled(&self) -> &[u8] {
        &self.mem[self.start..self.start + self.len]
    }
}

/// Page-cache writes, with writeback started as the file grows.
struct CachedWriter {
    file: std::fs::File,
    /// The range not yet handed to writeback.
    unflushed_from: u64,
    unflushed: u64,
}

impl CachedWriter {
    fn new(mut file: std::fs::File) -> io::Result<Self> {
        let unflushed_from = file.stream_position()?;
        Ok(CachedWriter {
            file,
            unflushed_from,
            unflushed: 0,
        })
    }

    fn write(&mut self, data: &[u8]) -> io::Result<()> {
        self.file.write_all(data)?;
        self.unflushed += data.len() as u64;
        if self.unflushed >= WRITEBACK_WINDOW {
            start_writeback(&self.file, self.unflushed_from, self.unflushed);
            self.unflushed_from += self.unflushed;
            self.unflushed = 0;
        }
        Ok(())
    }
}

fn writer_stopped() -> io::Error {
    io::Error::other("the file writer stopped")
}

impl FileWriter {
    fn new(mut file: std::fs::File) -> io::Result<Self> {
        let pos = file.stream_position()?;
        let bufs: Option<Vec<DirectBuf>> = if pos % ALIGN as u64 == 0 {
            (0..DIRECT_BUFFERS).map(|_| DirectBuf::new()).collect()
        } else {
            None
        };
        let Some(mut bufs) = bufs.filter(|_| set_direct(&file, true).is_ok()) else {
            let _ = set_direct(&file, false);
            return Ok(FileWriter::Cached(CachedWriter::new(file)?));
        };
        let filling = bufs.pop().ok_or_else(writer_stopped)?;
        let (to_disk, full) = std::sync::mpsc::sync_channel::<DirectBuf>(1);
        let (give_back, spare) = std::sync::mpsc::sync_channel::<DirectBuf>(DIRECT_BUFFERS);
        for b in bufs {
            give_back.send(b).map_err(|_| writer_stopped())?;
        }
        let disk = std::thread::Builder::new()
            .name("image-disk".into())
            .spawn(move || write_to_disk(file, full, give_back))?;
        Ok(FileWriter::Direct {
            filling,
            to_disk,
            spare,
            disk,
        })
    }

    fn write(&mut self, mut data: &[u8]) -> io::Result<()> {
        match self {
            FileWriter::Cached(w) => w.write(data),
            FileWriter::Direct {
                filling,
                to_disk,
                spare,
                ..
            } => {
                while !data.is_empty() {
                    let n = (DIRECT_CHUNK - filling.len).min(data.len());
                    let at = filling.start + filling.len;
                    filling.mem[at..at + n].copy_from_slice(&data[..n]);
                    filling.len += n;
                    data = &data[n..];
                    if filling.len == DIRECT_CHUNK {
                        // A stopped disk thread says why when it is joined.
                        let mut next = spare.recv().map_err(|_| writer_stopped())?;
                        next.len = 0;
                        let full = std::mem::replace(filling, next);
                        to_disk.send(full).map_err(|_| writer_stopped())?;
                    }
                }
                Ok(())
            }
        }
    }

    /// Everything written, the last partial buffer too. The file is left without
    /// `O_DIRECT` for whoever reads it next.
    fn finish(self) -> io::Result<std::fs::File> {
        match self {
            FileWriter::Cached(w) => Ok(w.file),
            FileWriter::Direct {
                filling,
                to_disk,
                disk,
                spare,
            } => {
                let sent = filling.len == 0 || to_disk.send(filling).is_ok();
                drop(to_disk);
                drop(spare);
                let file = disk
                    .join()
                    .map_err(|_| io::Error::other("the disk writer panicked"))??;
                if !sent {
                    return Err(writer_stopped());
                }
                Ok(file)
            }
        }
    }
}

/// The disk thread: writes each buffer it is given, in order, and hands it back. The
/// aligned part of a buffer goes direct; an unaligned rest (only the last buffer has
/// one), a short direct write's rest, and everything after the file system refused
/// `O_DIRECT`, through the page cache.
fn write_to_disk(
    mut file: std::fs::File,
    full: std::sync::mpsc::Receiver<DirectBuf>,
    give_back: std::sync::mpsc::SyncSender<DirectBuf>,
) -> io::Result<std::fs::File> {
    let mut cached: Option<CachedWriter> = None;
    while let Ok(buf) = full.recv() {
        let data = buf.filled();
        let mut written = 0;
        if cached.is_none() {
            let aligned = data.len() - data.len() % ALIGN;
            while written < aligned {
                match file.write(&data[written..aligned]) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(k) => {
                        written += k;
                        // A short direct write leaves an unaligned rest: that goes
                        // through the page cache like a refused one.
                        if written % ALIGN != 0 {
                            break;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
                        tracing::debug!("direct writes refused; writing through the page cache");
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
            if written < data.len() {
                // Back to the page cache for good, with everything not yet written.
                set_direct(&file, false)?;
                cached = Some(CachedWriter::new(file.try_clone()?)?);
            }
        }
        if let Some(c) = cached.as_mut() {
            c.write(&data[written..])?;
        }
        // The filler may be gone (finishing): the buffer is then simply dropped.
        let _ = give_back.try_send(buf);
    }
    if cached.is_none() {
        set_direct(&file, false)?;
    }
    Ok(file)
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
