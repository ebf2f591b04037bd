//! Files sent as response bodies (image files, to nodes and to operators): read on one
//! blocking thread, straight from the disk where the file system allows it.
//!
//! Why not through the page cache: a node reads an image once (it keeps its own copy),
//! so the cache rarely serves an image twice, while filling it costs this process the
//! pages it allocates and fills. Measured on this project's 2-CPU VMs with `dd` over a
//! cold 2 GiB file: 0.7–3.4 s of system CPU through the cache, 0.1–0.2 s with `O_DIRECT`;
//! and in `cargo xtask bench images`, the rounds where the server spent 1.1–1.9 s of CPU
//! sending 2 GiB downloaded at 0.62–0.82 × `cp`, those where it spent under 0.9 s at
//! 0.87–0.94 ×. Streaming images through the cache would also push the database's pages
//! out of it.

use axum::body::Bytes;
// The alignment `O_DIRECT` asks of offsets, lengths and buffers: as for an upload's writes.
use node_agent::images::sink::{ALIGN, set_direct};
use std::io;
use std::sync::mpsc;

/// Bytes per read: a multiple of [`ALIGN`].
const FILE_CHUNK: usize = 1 << 20;

/// Reads in flight ahead of the socket.
const AHEAD: usize = 4;

/// `count` bytes of `file` from its current position, as a body. One blocking thread
/// reads the whole of it in 1 MiB reads, [`AHEAD`] reads ahead of the socket: through
/// `tokio::fs` every read is a trip to the blocking pool and back, which cost the
/// server as much CPU as the copies themselves in a 2 GiB image's download.
pub fn file_body(file: std::fs::File, count: u64) -> axum::body::Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(AHEAD);
    tokio::task::spawn_blocking(move || send_file(file, count, &tx));
    axum::body::Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}

/// A buffer whose filled part starts at an [`ALIGN`]ed address. Dropped (hyper has sent
/// it), it goes back to the reader for the next read instead of to the allocator, so the
/// reads reuse a few megabytes of memory that is already mapped.
struct Chunk {
    mem: Vec<u8>,
    /// Where the aligned part starts.
    base: usize,
    /// The bytes to send, relative to `base`.
    from: usize,
    to: usize,
    back: mpsc::Sender<Vec<u8>>,
}

impl AsRef<[u8]> for Chunk {
    fn as_ref(&self) -> &[u8] {
        &self.mem[self.base + self.from..self.base + self.to]
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        let _ = self.back.send(std::mem::take(&mut self.mem));
    }
}

fn aligned_start(mem: &[u8]) -> usize {
    mem.as_ptr().align_offset(ALIGN).min(ALIGN)
}

/// Reads `count` bytes from the file's position and sends them in chunks, until done,
/// failed (the error is the last item) or the receiver is gone (the client left).
fn send_file(file: std::fs::File, count: u64, tx: &tokio::sync::mpsc::Sender<io::Result<Bytes>>) {
    use std::io::Seek;
    let mut file = file;
    let start = match file.stream_position() {
        Ok(p) => p,
        Err(e) => {
            let _ = tx.blocking_send(Err(e));
            return;
        }
    };
    // Reads go from `start` rounded down to ALIGN; the bytes before `start` are skipped.
    let mut offset = start - start % ALIGN as u64;
    let mut skip = usize::try_from(start - offset).unwrap_or(0);
    // Where the file system refuses O_DIRECT (tmpfs), or a read with it fails, the same
    // reads go through the page cache.
    let mut direct = set_direct(&file, true).is_ok();
    let (back, returned) = mpsc::channel::<Vec<u8>>();
    let mut left = count;
    while left > 0 {
        let mut mem = returned
            .try_recv()
            .unwrap_or_else(|_| vec![0u8; FILE_CHUNK + ALIGN]);
        let base = aligned_start(&mem);
        let read = loop {
            let buf = &mut mem[base..base + FILE_CHUNK];
            match rustix::io::pread(&file, buf, offset) {
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::INVAL) if direct => {
                    tracing::debug!("direct reads refused; reading through the page cache");
                    direct = false;
                    if let Err(e) = set_direct(&file, false) {
                        break Err(e);
                    }
                }
                Err(e) => break Err(io::Error::from(e)),
                Ok(n) => break Ok(n),
            }
        };
        let chunk = match read {
            Ok(n) if n > skip => {
                let take = (n - skip).min(usize::try_from(left).unwrap_or(usize::MAX));
                left -= take as u64;
                offset += n as u64;
                let c = Chunk {
                    mem,
                    base,
                    from: skip,
                    to: skip + take,
                    back: back.clone(),
                };
                skip = 0;
                Ok(Bytes::from_owner(c))
            }
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the file is shorter than it was",
            )),
            Err(e) => Err(e),
        };
        let failed = chunk.is_err();
        // A closed channel: the client went away.
        if tx.blocking_send(chunk).is_err() || failed {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    async fn body_of(file: std::fs::File, count: u64) -> Result<Vec<u8>, String> {
        let mut stream = file_body(file, count).into_data_stream();
        let mut out = Vec::new();
        while let Some(chunk) = stream.next().await {
            out.extend_from_slice(&chunk.map_err(|e| e.to_string())?);
        }
        Ok(out)
    }

    /// Every start and length, aligned or not, in the temporary directory (on a disk
    /// here: direct reads) and in `/dev/shm` (tmpfs, which refuses `O_DIRECT`: reads
    /// through the page cache): the bytes asked for, no more, no fewer.
    #[tokio::test]
    async fn sends_the_range_asked_for() {
        use std::io::{Seek, SeekFrom, Write};
        let data: Vec<u8> = (0..(3 * FILE_CHUNK + 5000))
            .map(|i| (i % 251) as u8)
            .collect();
        let shm = std::path::Path::new("/dev/shm");
        let dirs = [
            Some(tempfile::tempdir()),
            shm.is_dir().then(|| tempfile::tempdir_in(shm)),
        ];
        for dir in dirs.into_iter().flatten() {
            let dir = dir.unwrap_or_else(|e| panic!("{e}"));
            let path = dir.path().join("f");
            std::fs::File::create(&path)
                .and_then(|mut f| f.write_all(&data))
                .unwrap_or_else(|e| panic!("{e}"));
            let len = data.len() as u64;
            for (start, count) in [
                (0, len),
                (0, 1),
                (1, len - 1),
                (4095, 2),
                (4096, FILE_CHUNK as u64),
                (FILE_CHUNK as u64 - 3, FILE_CHUNK as u64 + 7),
                (len - 1, 1),
                (12345, len - 12345),
            ] {
                let mut f = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{e}"));
                f.seek(SeekFrom::Start(start))
                    .unwrap_or_else(|e| panic!("{e}"));
                let got = body_of(f, count).await.unwrap_or_else(|e| panic!("{e}"));
                let (s, c) = (start as usize, count as usize);
                assert_eq!(got.len(), c, "{start}+{count}");
                assert!(got == data[s..s + c], "{start}+{count}: other bytes");
            }
            // A file that shrank under the reader ends the body with an error.
            let f = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{e}"));
            let err = body_of(f, len + 10).await;
            assert!(err.is_err(), "{:?}", err.map(|b| b.len()));
        }
    }
}
