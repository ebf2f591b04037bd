//! `passage-gpu-zero --bdf 0000:3b:00.0`: clears a GPU's memory between tenants and
//! reads it back, for the node agent's `zero_gpu_memory` scrub step (its contract is
//! in `node-agent/src/scrub/programs.rs`).
//!
//! It selects the GPU by PCI address through the CUDA driver API (`libcuda.so.1`,
//! loaded at run time, so the helper builds and installs anywhere), allocates as much of
//! the GPU's memory as it can in chunks, writes zeros to all of it, copies every chunk
//! back and checks that each byte is zero, frees it, and prints one summary line on
//! stdout. Exit codes:
//!
//! | code | meaning |
//! |---|---|
//! | 0 | the memory it could allocate (at least `--min-coverage` % of it) is zero |
//! | 1 | failed: a CUDA error, no such GPU, too little memory allocatable, a broken driver library |
//! | 2 | bad arguments |
//! | 3 | no CUDA driver library (`libcuda.so.1`) on this host: nothing was done |
//! | 4 | a byte read back after clearing was not zero |
//!
//! Every failure prints one line on stderr saying why. Progress goes to stderr at most
//! every 5 seconds.

// The one module allowed `unsafe` (the crate denies it): calls into the driver library.
#[allow(unsafe_code)]
mod cuda;
mod zero;

use clap::Parser;
use passage_model::PciAddress;
use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

/// Exit codes (see the module documentation).
const EXIT_FAILED: u8 = 1;
const EXIT_USAGE: u8 = 2;
const EXIT_NO_DRIVER: u8 = 3;
const EXIT_NOT_ZERO: u8 = 4;

const DRIVER_LIBRARY: &str = "libcuda.so.1";

/// Clears a GPU's memory and checks that it reads back as zero.
#[derive(Debug, Parser)]
#[command(
    name = "passage-gpu-zero",
    version,
    after_help = "Exit codes: 0 cleared and verified, 1 failed, 2 bad arguments, \
                  3 no CUDA driver (libcuda.so.1) on this host, 4 memory not zero after clearing."
)]
struct Args {
    /// The GPU's PCI address, domain:bus:device.function (as in /sys/bus/pci/devices).
    #[arg(long, value_parser = parse_bdf)]
    bdf: PciAddress,
    /// Size of the allocations tried first, in MiB; smaller ones follow until the GPU
    /// has no room left.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=65536))]
    chunk_mib: u64,
    /// Fail unless at least this share (percent) of the GPU's memory could be
    /// allocated, cleared and checked (the CUDA context itself takes some).
    #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u8).range(0..=100))]
    min_coverage: u8,
    /// The driver library to load (tests point it elsewhere).
    #[arg(long, default_value = DRIVER_LIBRARY, hide = true)]
    cuda_library: OsString,
}

fn parse_bdf(s: &str) -> Result<PciAddress, String> {
    s.parse::<PciAddress>()
        .map_err(|_| "expected a PCI address like 0000:3b:00.0".to_string())
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) if !e.use_stderr() => {
            // --help, --version.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // One line, as the agent reports it: clap's first, without its "error: ".
            let text = e.to_string();
            let line = text.lines().next().unwrap_or("bad arguments");
            eprintln!("{}", line.trim_start_matches("error: "));
            return ExitCode::from(EXIT_USAGE);
        }
    };
    run(&args)
}

fn run(args: &Args) -> ExitCode {
    let api = match cuda::Api::load(&args.cuda_library) {
        Ok(api) => api,
        Err(cuda::LoadError::NotFound) => {
            eprintln!(
                "CUDA driver ({}) not found; GPU memory not zeroed",
                args.cuda_library.to_string_lossy()
            );
            return ExitCode::from(EXIT_NO_DRIVER);
        }
        Err(cuda::LoadError::Broken(why)) => return fail(EXIT_FAILED, &why),
    };
    let mut gpu = match cuda::CudaGpu::open(api, args.bdf) {
        Ok(g) => g,
        Err(why) => return fail(EXIT_FAILED, &why),
    };
    let opts = zero::Options {
        chunk: args.chunk_mib * zero::MIB,
        min_coverage: args.min_coverage,
        scanners: std::thread::available_parallelism()
            .map_or(1, |n| n.get().saturating_sub(1))
            .clamp(1, 4),
        progress_every: Duration::from_secs(5),
        ..zero::Options::default()
    };
    let bdf = args.bdf;
    let mut progress = |done: u64, of: u64, took: Duration| {
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        eprintln!(
            "{bdf}: checked {:.1} of {:.1} GiB ({:.0} s)",
            gib(done),
            gib(of),
            took.as_secs_f64()
        );
    };
    let result = zero::zero_and_verify(&mut gpu, &opts, &mut progress);
    let name = gpu.name().map(|n| format!(" ({n})")).unwrap_or_default();
    drop(gpu);
    match result {
        Ok(summary) => {
            let paged = if summary.pinned {
                ""
            } else {
                " [pageable buffers]"
            };
            println!("{bdf}{name}: {}{paged}", summary.line());
            ExitCode::SUCCESS
        }
        Err(e @ zero::ZeroError::NotZero { .. }) => fail(EXIT_NOT_ZERO, &e.to_string()),
        Err(e) => fail(EXIT_FAILED, &e.to_string()),
    }
}

fn fail(code: u8, why: &str) -> ExitCode {
    // One line: the agent quotes it in the scrub report.
    eprintln!("{}", why.replace('\n', " "));
    ExitCode::from(code)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("passage-gpu-zero").chain(args.iter().copied()))
    }

    #[test]
    fn arguments() {
        let a = parse(&["--bdf", "0000:3b:00.0"]).unwrap();
        assert_eq!(a.bdf.to_string(), "0000:3b:00.0");
        assert_eq!((a.chunk_mib, a.min_coverage), (1024, 90));
        assert_eq!(a.cuda_library, "libcuda.so.1");
        let a = parse(&[
            "--bdf=10000:e1:1f.7",
            "--chunk-mib",
            "256",
            "--min-coverage",
            "0",
        ])
        .unwrap();
        assert_eq!(a.bdf.to_string(), "10000:e1:1f.7");
        assert_eq!((a.chunk_mib, a.min_coverage), (256, 0));
        // Upper-case hex is a PCI address too; it is passed on in sysfs's spelling.
        assert_eq!(
            parse(&["--bdf", "0000:3B:00.0"]).unwrap().bdf.to_string(),
            "0000:3b:00.0"
        );
    }

    #[test]
    fn bad_arguments() {
        for bad in [
            &[][..],
            &["--bdf"],
            &["--bdf", "3b:00.0"],
            &["--bdf", "0000:3b:00"],
            &["--bdf", "0000:3b:20.0"],
            &["--bdf", "0000:3b:00.8"],
            &["--bdf", "0000:3b:00.0;reboot"],
            &["--bdf", ""],
            &["--bdf", "0000:3b:00.0", "--chunk-mib", "0"],
            &["--bdf", "0000:3b:00.0", "--min-coverage", "101"],
            &["--bdf", "0000:3b:00.0", "extra"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        let e = parse(&["--bdf", "3b:00.0"]).unwrap_err().to_string();
        assert!(
            e.contains("expected a PCI address like 0000:3b:00.0"),
            "{e}"
        );
    }
}
