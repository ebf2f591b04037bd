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
            let mut file = file;
            let mut unflushed_from = file.stream_position()?;
            let mut unflushed: u64 = 0;
            while let Some(chunk) = file_rx.blocking_recv() {
                file.write_all(&chunk)?;
                unflushed += chunk.len() as u64;
                if unflushed >= WRITEBACK_WINDOW {
                    start_writeback(&file, unflushed_from, unflushed);
                    unflushed_from += unflushed;
                    unflushed = 0;
                }
            }
            Ok(file)
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
        for i in 0..chunks {
            let chunk = Bytes::from(vec![(i % 251) as u8; 1 << 20]);
            whole.update(&chunk);
            sink.push(chunk).await.unwrap_or_else(|e| panic!("{e}"));
        }
        let (file, hasher) = sink.finish().await.unwrap_or_else(|e| panic!("{e}"));
        file.sync_all().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(hasher.finalize(), whole.clone().finalize());
        let written = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(written.len() as u64, chunks << 20);
        assert_eq!(sha2::Sha256::digest(&written), whole.finalize());
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
        for _ in 0..(QUEUE * 4) {
            if sink.push(Bytes::from_static(b"data")).await.is_err() {
                refused = true;
                break;
            }
        }
        assert!(refused, "pushes go on after the writer stopped");
        assert!(sink.finish().await.is_err());
    }
}
