//! Clearing a GPU's memory and reading it back, over any [`Gpu`]: the CUDA driver on a
//! host ([`crate::cuda::CudaGpu`]), an in-memory fake in the tests.
//!
//! 1. Allocate chunks of [`Options::chunk`] bytes until the device says it is out of
//!    memory, then halve the chunk down to [`Options::min_chunk`] to take what is left.
//! 2. Write zeros to every allocation on the device, and wait for it.
//! 3. Read every allocation back in pieces of [`Options::piece`] bytes into host buffers
//!    (page-locked where the device allows it) and check each word for zero on
//!    [`Options::scanners`] threads, while the next piece is being copied.
//! 4. Free everything, on every path.

use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const MIB: u64 = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;

/// A device address.
pub type DevPtr = u64;

/// What the clearing needs from a device. Errors are one-line descriptions.
pub trait Gpu {
    /// Total device memory, in bytes.
    fn total_memory(&mut self) -> Result<u64, String>;
    /// Allocates `bytes` of device memory; `Ok(None)` when there is no room for it.
    fn alloc(&mut self, bytes: u64) -> Result<Option<DevPtr>, String>;
    fn free(&mut self, ptr: DevPtr) -> Result<(), String>;
    /// Starts writing zeros to `bytes` bytes at `ptr` (a multiple of 4).
    fn zero(&mut self, ptr: DevPtr, bytes: u64) -> Result<(), String>;
    /// Waits for the device to finish what was started.
    fn synchronize(&mut self) -> Result<(), String>;
    /// Copies `dst.len() * 8` bytes from `src` into `dst`.
    fn read(&mut self, src: DevPtr, dst: &mut [u64]) -> Result<(), String>;
    /// Page-locks `buf` so reads into it go at the bus's speed; `false` if it cannot
    /// (reads still work, slower). `buf` must stay allocated until [`Gpu::unpin_all`].
    fn pin(&mut self, _buf: &[u64]) -> bool {
        false
    }
    /// Undoes every [`Gpu::pin`].
    fn unpin_all(&mut self) {}
}

#[derive(Clone, Debug)]
pub struct Options {
    /// The size of the allocations tried first, in bytes.
    pub chunk: u64,
    /// The smallest allocation tried once larger ones fail.
    pub min_chunk: u64,
    /// Bytes copied back and checked at a time.
    pub piece: u64,
    /// Threads checking the copied pieces.
    pub scanners: usize,
    /// Fail unless at least this share (percent) of the device's memory was cleared.
    pub min_coverage: u8,
    /// How often to report progress.
    pub progress_every: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            chunk: 1024 * MIB,
            min_chunk: MIB,
            piece: 32 * MIB,
            scanners: 2,
            min_coverage: 90,
            progress_every: Duration::from_secs(5),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ZeroError {
    /// Something failed (a device call, too little memory): nothing is known about the
    /// memory's contents.
    Failed(String),
    /// A byte read back after clearing was not zero.
    NotZero { addr: DevPtr, value: u8 },
}

impl std::fmt::Display for ZeroError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ZeroError::Failed(why) => f.write_str(why),
            ZeroError::NotZero { addr, value } => write!(
                f,
                "GPU memory is not zero after clearing: byte {value:#04x} at device address {addr:#x}"
            ),
        }
    }
}

/// What a successful run did.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// Bytes cleared and read back as zero.
    pub bytes: u64,
    /// The device's memory.
    pub total: u64,
    pub allocations: usize,
    /// Whether the read-back buffers were page-locked.
    pub pinned: bool,
    pub elapsed: Duration,
}

impl Summary {
    /// `zeroed and verified 79.1 of 79.6 GiB in 3.2 s (24.9 GiB/s)`.
    pub fn line(&self) -> String {
        let secs = self.elapsed.as_secs_f64();
        let rate = if secs > 0.0 {
            self.bytes as f64 / GIB / secs
        } else {
            0.0
        };
        format!(
            "zeroed and verified {:.1} of {:.1} GiB in {secs:.1} s ({rate:.1} GiB/s)",
            self.bytes as f64 / GIB,
            self.total as f64 / GIB
        )
    }
}

/// Progress reports: bytes checked so far, of how many.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64, Duration);

/// Clears and checks as much of the device's memory as can be allocated, then frees it.
pub fn zero_and_verify(
    gpu: &mut dyn Gpu,
    opts: &Options,
    progress: Progress<'_>,
) -> Result<Summary, ZeroError> {
    let started = Instant::now();
    let total = gpu.total_memory().map_err(ZeroError::Failed)?;
    let mut allocs = Vec::new();
    let result = allocate(gpu, opts, total, &mut allocs)
        .map_err(ZeroError::Failed)
        .and_then(|()| check_coverage(&allocs, total, opts.min_coverage))
        .and_then(|()| clear(gpu, &allocs).map_err(ZeroError::Failed))
        .and_then(|()| verify(gpu, &allocs, opts, started, progress));
    let freed = free_all(gpu, &allocs);
    let pinned = result?;
    freed.map_err(ZeroError::Failed)?;
    Ok(Summary {
        bytes: allocs.iter().map(|a| a.1).sum(),
        total,
        allocations: allocs.len(),
        pinned,
        elapsed: started.elapsed(),
    })
}

fn allocate(
    gpu: &mut dyn Gpu,
    opts: &Options,
    total: u64,
    allocs: &mut Vec<(DevPtr, u64)>,
) -> Result<(), String> {
    let min_chunk = opts.min_chunk.max(8) & !7;
    let mut size = opts.chunk.max(min_chunk) & !7;
    let mut got = 0u64;
    // Never more than the device has, whatever it answers.
    while got < total {
        let want = size.min((total - got) & !7);
        if want == 0 {
            break;
        }
        match gpu.alloc(want)? {
            Some(ptr) => {
                allocs.push((ptr, want));
                got += want;
            }
            None if size > min_chunk => size = (size / 2).max(min_chunk) & !7,
            None => break,
        }
    }
    Ok(())
}

fn check_coverage(allocs: &[(DevPtr, u64)], total: u64, min_percent: u8) -> Result<(), ZeroError> {
    let got: u64 = allocs.iter().map(|a| a.1).sum();
    if got == 0 {
        return Err(ZeroError::Failed(
            "could not allocate any GPU memory".to_string(),
        ));
    }
    if u128::from(got) * 100 < u128::from(total) * u128::from(min_percent) {
        return Err(ZeroError::Failed(format!(
            "could allocate only {:.1} of {:.1} GiB of GPU memory (less than {min_percent} %): \
             another process may hold the rest",
            got as f64 / GIB,
            total as f64 / GIB
        )));
    }
    Ok(())
}

fn clear(gpu: &mut dyn Gpu, allocs: &[(DevPtr, u64)]) -> Result<(), String> {
    for &(ptr, bytes) in allocs {
        gpu.zero(ptr, bytes)?;
    }
    gpu.synchronize()
}

fn free_all(gpu: &mut dyn Gpu, allocs: &[(DevPtr, u64)]) -> Result<(), String> {
    let mut first_err = None;
    for &(ptr, _) in allocs {
        if let Err(e) = gpu.free(ptr) {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Page size the read-back buffers are aligned to (the largest in use on Linux hosts,
/// so page-locking never takes in a neighbour's memory).
const BUFFER_ALIGN: usize = 64 * 1024;

/// A host buffer whose usable part starts on a [`BUFFER_ALIGN`] boundary.
struct Buffer {
    storage: Vec<u64>,
    start: usize,
    words: usize,
}

impl Buffer {
    fn new(words: usize) -> Buffer {
        let storage = vec![0u64; words + BUFFER_ALIGN / 8];
        let addr = storage.as_ptr() as usize;
        let start = ((BUFFER_ALIGN - addr % BUFFER_ALIGN) % BUFFER_ALIGN) / 8;
        Buffer {
            storage,
            start,
            words,
        }
    }

    fn words(&self) -> &[u64] {
        &self.storage[self.start..self.start + self.words]
    }

    fn words_mut(&mut self) -> &mut [u64] {
        &mut self.storage[self.start..self.start + self.words]
    }
}

/// A piece handed to a scanner: its buffer, how many words of it were filled, and the
/// device address they came from.
struct Job {
    buf: Buffer,
    words: usize,
    addr: DevPtr,
}

/// A scanner's answer: which scanner, the buffer back, and the first non-zero byte.
struct Done {
    scanner: usize,
    buf: Buffer,
    found: Option<(DevPtr, u8)>,
}

/// Takes a buffer back from its scanner, keeping the first non-zero byte seen.
fn take_back(d: Done, free: &mut [Vec<Buffer>], found: &mut Option<(DevPtr, u8)>) {
    if found.is_none() {
        *found = d.found;
    }
    free[d.scanner].push(d.buf);
}

/// Reads everything back and checks it; `Ok(pinned)`: whether the buffers were
/// page-locked.
fn verify(
    gpu: &mut dyn Gpu,
    allocs: &[(DevPtr, u64)],
    opts: &Options,
    started: Instant,
    progress: Progress<'_>,
) -> Result<bool, ZeroError> {
    let total: u64 = allocs.iter().map(|a| a.1).sum();
    let piece = (opts.piece.max(8) & !7).min(total.max(8));
    let piece_words = usize::try_from(piece / 8)
        .map_err(|_| ZeroError::Failed(format!("read-back piece of {piece} bytes too large")))?;
    let scanners = opts.scanners.max(1);
    // Two buffers per scanner: one being checked while the next piece is copied.
    let mut free: Vec<Vec<Buffer>> = (0..scanners)
        .map(|_| (0..2).map(|_| Buffer::new(piece_words)).collect())
        .collect();
    let mut pinned = true;
    for b in free.iter().flatten() {
        pinned &= gpu.pin(b.words());
    }
    let result = std::thread::scope(|scope| {
        let (done_tx, done_rx) = mpsc::channel::<Done>();
        let mut jobs = Vec::with_capacity(scanners);
        for scanner in 0..scanners {
            let (job_tx, job_rx) = mpsc::channel::<Job>();
            let done_tx = done_tx.clone();
            scope.spawn(move || {
                for job in job_rx {
                    let found = first_nonzero(&job.words()[..job.words])
                        .map(|(i, v)| (job.addr + i as u64, v));
                    let done = Done {
                        scanner,
                        buf: job.buf,
                        found,
                    };
                    if done_tx.send(done).is_err() {
                        break;
                    }
                }
            });
            jobs.push(job_tx);
        }
        drop(done_tx);
        let mut in_flight = 0usize;
        let mut found = None;
        let mut checked = 0u64;
        let mut last_report = started;
        let copied = (|| -> Result<(), ZeroError> {
            let mut next = 0usize;
            for &(base, bytes) in allocs {
                let mut offset = 0u64;
                while offset < bytes {
                    let n = piece.min(bytes - offset);
                    let k = next;
                    next = (next + 1) % scanners;
                    while free[k].is_empty() {
                        let d = done_rx.recv().map_err(|_| scanner_lost())?;
                        in_flight -= 1;
                        take_back(d, &mut free, &mut found);
                    }
                    if found.is_some() {
                        return Ok(());
                    }
                    let Some(mut buf) = free[k].pop() else {
                        return Err(scanner_lost());
                    };
                    let words = (n / 8) as usize;
                    let addr = base + offset;
                    gpu.read(addr, &mut buf.words_mut()[..words])
                        .map_err(ZeroError::Failed)?;
                    jobs[k]
                        .send(Job { buf, words, addr })
                        .map_err(|_| scanner_lost())?;
                    in_flight += 1;
                    offset += n;
                    checked += n;
                    if last_report.elapsed() >= opts.progress_every {
                        last_report = Instant::now();
                        progress(checked, total, started.elapsed());
                    }
                }
            }
            Ok(())
        })();
        // Every buffer comes back before the buffers are unpinned and dropped.
        drop(jobs);
        while in_flight > 0 {
            match done_rx.recv() {
                Ok(d) => {
                    in_flight -= 1;
                    take_back(d, &mut free, &mut found);
                }
                Err(_) => break,
            }
        }
        copied?;
        match found {
            Some((addr, value)) => Err(ZeroError::NotZero { addr, value }),
            None if in_flight > 0 => Err(scanner_lost()),
            None => Ok(()),
        }
    });
    gpu.unpin_all();
    drop(free);
    result.map(|()| pinned)
}

fn scanner_lost() -> ZeroError {
    ZeroError::Failed("a checking thread stopped".to_string())
}

impl Job {
    fn words(&self) -> &[u64] {
        self.buf.words()
    }
}

/// The first non-zero byte of `words` (in memory order) and its value. Whole blocks are
/// OR-ed together first, which the compiler turns into wide vector instructions; only a
/// block that is not all zero is looked at byte by byte.
pub fn first_nonzero(words: &[u64]) -> Option<(usize, u8)> {
    const BLOCK: usize = 1024;
    for (b, block) in words.chunks(BLOCK).enumerate() {
        if block.iter().fold(0u64, |acc, &w| acc | w) == 0 {
            continue;
        }
        let (i, w) = block.iter().enumerate().find(|(_, w)| **w != 0)?;
        let (j, v) = w
            .to_ne_bytes()
            .into_iter()
            .enumerate()
            .find(|(_, v)| *v != 0)?;
        return Some(((b * BLOCK + i) * 8 + j, v));
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::collections::BTreeMap;

    const BASE: DevPtr = 0x7f00_0000_0000;

    /// Device memory in a map: allocations start dirty (0xAB), some bytes may refuse to
    /// clear, a read at some address may fail, allocations may be capped in size.
    struct FakeGpu {
        total: u64,
        usable: u64,
        max_alloc: u64,
        next: DevPtr,
        mem: BTreeMap<DevPtr, Vec<u8>>,
        stuck: Vec<(DevPtr, u8)>,
        fail_read_at: Option<DevPtr>,
        fail_zero: bool,
        reads: Vec<(DevPtr, u64)>,
        freed: Vec<DevPtr>,
        pinned: usize,
    }

    impl FakeGpu {
        fn new(total: u64) -> FakeGpu {
            FakeGpu {
                total,
                usable: total,
                max_alloc: u64::MAX,
                next: BASE,
                mem: BTreeMap::new(),
                stuck: Vec::new(),
                fail_read_at: None,
                fail_zero: false,
                reads: Vec::new(),
                freed: Vec::new(),
                pinned: 0,
            }
        }

        fn used(&self) -> u64 {
            self.mem.values().map(|m| m.len() as u64).sum()
        }

        fn alloc_of(&mut self, ptr: DevPtr) -> (DevPtr, &mut Vec<u8>) {
            let (&base, m) = self.mem.range_mut(..=ptr).next_back().unwrap();
            assert!(ptr < base + m.len() as u64, "{ptr:#x} is not allocated");
            (base, m)
        }
    }

    impl Gpu for FakeGpu {
        fn total_memory(&mut self) -> Result<u64, String> {
            Ok(self.total)
        }
        fn alloc(&mut self, bytes: u64) -> Result<Option<DevPtr>, String> {
            if bytes > self.max_alloc || self.used() + bytes > self.usable {
                return Ok(None);
            }
            let ptr = self.next;
            // A gap between allocations, as a real allocator leaves.
            self.next += bytes + 2 * MIB;
            self.mem.insert(ptr, vec![0xAB; bytes as usize]);
            Ok(Some(ptr))
        }
        fn free(&mut self, ptr: DevPtr) -> Result<(), String> {
            self.mem.remove(&ptr).ok_or("not allocated")?;
            self.freed.push(ptr);
            Ok(())
        }
        fn zero(&mut self, ptr: DevPtr, bytes: u64) -> Result<(), String> {
            if self.fail_zero {
                return Err("CUDA_ERROR_ECC_UNCORRECTABLE".to_string());
            }
            let stuck = self.stuck.clone();
            let (base, m) = self.alloc_of(ptr);
            assert_eq!((base, m.len() as u64), (ptr, bytes), "whole allocations");
            m.fill(0);
            for (addr, v) in stuck {
                if (base..base + bytes).contains(&addr) {
                    m[(addr - base) as usize] = v;
                }
            }
            Ok(())
        }
        fn synchronize(&mut self) -> Result<(), String> {
            Ok(())
        }
        fn read(&mut self, src: DevPtr, dst: &mut [u64]) -> Result<(), String> {
            let len = dst.len() as u64 * 8;
            if self
                .fail_read_at
                .is_some_and(|a| (src..src + len).contains(&a))
            {
                return Err("CUDA_ERROR_LAUNCH_FAILED".to_string());
            }
            self.reads.push((src, len));
            let (base, m) = self.alloc_of(src);
            let from = (src - base) as usize;
            let bytes = &m[from..from + len as usize];
            for (w, b) in dst.iter_mut().zip(bytes.chunks_exact(8)) {
                *w = u64::from_ne_bytes(b.try_into().unwrap());
            }
            Ok(())
        }
        fn pin(&mut self, _buf: &[u64]) -> bool {
            self.pinned += 1;
            true
        }
        fn unpin_all(&mut self) {
            self.pinned = 0;
        }
    }

    fn opts() -> Options {
        Options {
            chunk: 8 * MIB,
            min_chunk: MIB,
            // Not a divisor of the allocations: the last piece of each is short.
            piece: 3 * MIB,
            scanners: 3,
            min_coverage: 90,
            progress_every: Duration::ZERO,
        }
    }

    fn run(gpu: &mut FakeGpu, o: &Options) -> (Result<Summary, ZeroError>, Vec<(u64, u64)>) {
        let mut seen = Vec::new();
        let r = zero_and_verify(gpu, o, &mut |done, of, _| seen.push((done, of)));
        (r, seen)
    }

    /// Every allocated byte was read back exactly once.
    fn assert_read_whole(gpu: &FakeGpu, allocs: &[(DevPtr, u64)]) {
        let mut reads = gpu.reads.clone();
        reads.sort();
        let mut want = Vec::new();
        for &(base, bytes) in allocs {
            let mut off = 0;
            while off < bytes {
                let n = (3 * MIB).min(bytes - off);
                want.push((base + off, n));
                off += n;
            }
        }
        want.sort();
        assert_eq!(reads, want);
    }

    #[test]
    fn clears_and_checks_all_it_can_allocate() {
        // 40.5 MiB: five 8 MiB chunks, then the half MiB left (never more than the
        // device has).
        let total = 40 * MIB + MIB / 2;
        let mut gpu = FakeGpu::new(total);
        let (r, seen) = run(&mut gpu, &opts());
        let s = r.unwrap();
        assert_eq!((s.bytes, s.total, s.allocations), (total, total, 6));
        assert!(s.pinned);
        assert!(gpu.mem.is_empty(), "everything is freed");
        assert_eq!(gpu.freed.len(), 6);
        assert_eq!(gpu.pinned, 0, "every buffer is unpinned");
        let mut allocs: Vec<_> = (0..5).map(|i| (BASE + i * 10 * MIB, 8 * MIB)).collect();
        allocs.push((BASE + 50 * MIB, MIB / 2));
        assert_read_whole(&gpu, &allocs);
        // Progress counts up to the total.
        assert_eq!(seen.last(), Some(&(total, total)));
        assert!(seen.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(
            s.line()
                .starts_with("zeroed and verified 0.0 of 0.0 GiB in "),
            "{}",
            s.line()
        );
    }

    #[test]
    fn smaller_chunks_take_what_large_ones_cannot() {
        // No allocation over 3 MiB: 8 → 4 → 2 MiB chunks, then 1 MiB for the rest.
        let mut gpu = FakeGpu::new(11 * MIB);
        gpu.max_alloc = 3 * MIB;
        let s = run(&mut gpu, &opts()).0.unwrap();
        assert_eq!(s.bytes, 11 * MIB);
        assert_eq!(s.allocations, 6, "five of 2 MiB and one of 1 MiB");
        assert!(gpu.mem.is_empty());
    }

    #[test]
    fn a_byte_that_stays_dirty_is_found() {
        // In the middle of a piece, at the end of an allocation's short last piece, and
        // in the last byte of the last allocation.
        for addr in [
            BASE + 10 * MIB + 4 * MIB + 12_345,
            BASE + 8 * MIB - 1,
            BASE + 30 * MIB + 8 * MIB - 1,
        ] {
            let mut gpu = FakeGpu::new(32 * MIB);
            gpu.stuck = vec![(addr, 0x5a)];
            let (r, _) = run(&mut gpu, &opts());
            assert_eq!(r, Err(ZeroError::NotZero { addr, value: 0x5a }));
            assert!(gpu.mem.is_empty(), "freed after a failure");
            assert_eq!(gpu.pinned, 0);
        }
        let e = ZeroError::NotZero {
            addr: 0x7f00_0000_1000,
            value: 0x5a,
        };
        assert_eq!(
            e.to_string(),
            "GPU memory is not zero after clearing: byte 0x5a at device address 0x7f0000001000"
        );
    }

    #[test]
    fn device_errors_fail_and_free() {
        let mut gpu = FakeGpu::new(32 * MIB);
        gpu.fail_read_at = Some(BASE + 20 * MIB);
        let (r, _) = run(&mut gpu, &opts());
        assert_eq!(
            r,
            Err(ZeroError::Failed("CUDA_ERROR_LAUNCH_FAILED".to_string()))
        );
        assert!(gpu.mem.is_empty());

        let mut gpu = FakeGpu::new(32 * MIB);
        gpu.fail_zero = true;
        let (r, _) = run(&mut gpu, &opts());
        assert!(
            matches!(r, Err(ZeroError::Failed(ref e)) if e.contains("ECC")),
            "{r:?}"
        );
        assert!(gpu.mem.is_empty());
        assert!(gpu.reads.is_empty(), "nothing is read after a failed clear");
    }

    #[test]
    fn too_little_memory_is_a_failure() {
        let mut gpu = FakeGpu::new(100 * MIB);
        gpu.usable = 80 * MIB;
        let (r, _) = run(&mut gpu, &opts());
        let Err(ZeroError::Failed(e)) = r else {
            panic!("{r:?}")
        };
        assert!(e.contains("only 0.1 of 0.1 GiB"), "{e}");
        assert!(gpu.mem.is_empty() && gpu.reads.is_empty());

        // With a lower bar the same device passes.
        let mut gpu = FakeGpu::new(100 * MIB);
        gpu.usable = 80 * MIB;
        let o = Options {
            min_coverage: 80,
            ..opts()
        };
        assert_eq!(run(&mut gpu, &o).0.unwrap().bytes, 80 * MIB);

        let mut gpu = FakeGpu::new(100 * MIB);
        gpu.usable = 0;
        let o = Options {
            min_coverage: 0,
            ..opts()
        };
        assert_eq!(
            run(&mut gpu, &o).0,
            Err(ZeroError::Failed(
                "could not allocate any GPU memory".to_string()
            ))
        );
    }

    #[test]
    fn one_scanner_and_one_piece_work_too() {
        let mut gpu = FakeGpu::new(5 * MIB);
        let o = Options {
            scanners: 0,
            piece: 64 * MIB,
            ..opts()
        };
        assert_eq!(run(&mut gpu, &o).0.unwrap().bytes, 5 * MIB);
        assert_eq!(gpu.reads, [(BASE, 5 * MIB)]);
    }

    #[test]
    fn finds_the_first_nonzero_byte() {
        assert_eq!(first_nonzero(&[]), None);
        assert_eq!(first_nonzero(&[0; 5000]), None);
        for at in [0usize, 7, 8, 8191, 8192, 39_999] {
            let mut bytes = vec![0u8; 40_000];
            bytes[at] = 0x80;
            bytes[39_999] |= 1;
            let words: Vec<u64> = bytes
                .chunks_exact(8)
                .map(|b| u64::from_ne_bytes(b.try_into().unwrap()))
                .collect();
            let want = if at == 39_999 { 0x81 } else { 0x80 };
            assert_eq!(first_nonzero(&words), Some((at, want)), "{at}");
        }
    }

    #[test]
    fn buffers_are_aligned() {
        for words in [1, 1000, 4 * 1024 * 1024 / 8] {
            let mut b = Buffer::new(words);
            assert_eq!(b.words().len(), words);
            assert_eq!(b.words_mut().as_ptr() as usize % BUFFER_ALIGN, 0);
        }
    }
}
