//! `cargo xtask`: Passage's own task runner.
//!
//! - `cargo xtask test [-- ARGS]`: everything CI runs (set-up, fmt, clippy, build, tests).
//! - `cargo xtask demo [--servers N] [--gpus G] [--model M] [--port P] [--reset]`: a local
//!   control plane with simulated compute nodes.
//! - `cargo xtask site`: the portal's WebAssembly bundle and stylesheet, into `<target>/site`.
//! - `cargo xtask bench discovery`: PCI discovery timings next to pciutils' `lspci`.
//! - `cargo xtask bench placement`: VM creations per second through the API, and
//!   multi-GPU placement decisions.
//! - `cargo xtask fuzz-api [--cases N] [--backend sqlite|postgres] [--max-minutes M]`: the
//!   REST API fuzzed with Schemathesis against its own OpenAPI document.
//! - `cargo xtask fuzz-parsers [--secs N] [--target T]`: the `cargo fuzz` targets (PCI
//!   parsers, agent messages) for N seconds each.

mod bench;
mod demo;
mod fuzz;
mod fuzz_parsers;
mod http;
mod site;
mod test;
mod util;

use anyhow::{Result, bail};
use std::process::ExitCode;

const USAGE: &str = "\
usage: cargo xtask <command> [options]

commands:
  test [-- ARGS]   set up lspci, QEMU and PostgreSQL if needed, then run fmt --check, clippy,
                   build the binaries and run every test (nextest if installed, else
                   cargo test) plus the doc tests; ARGS go to the test runner
                   (e.g. `cargo xtask test -- store_`)
  demo [options]   run a local server with simulated GPU nodes until Ctrl-C
      --servers N    compute nodes to start (default 2)
      --gpus G       GPUs per node (default 8)
      --model M      v100 | a100 | h100 | l40s (default h100)
      --port P       HTTP port on 127.0.0.1 (default 8080)
      --reset        delete .passage-demo/ first (new database, new password)
  bench discovery  time node-agent's PCI discovery on a ~300-function fake tree,
                   next to `lspci` on the same tree (builds node-agent --release)
  bench placement [--backend sqlite|postgres] [--servers N] [--gpus G] [--vms N] [--clients C]
                   VM creations through the HTTP API onto simulated nodes (default
                   1250 x 8 GPUs, 10000 VMs, 64 clients), then 4- and 8-GPU decisions
  bench portal [--backend sqlite|postgres] [--servers N] [--gpus G] [--vms N] [--clients C]
                   the servers, devices and VMs list pages over a seeded fleet (default
                   2000 x 8 GPUs, 5000 VMs, 16 clients): p50/p95/p99 and page size
  fuzz-api [options] [-- ARGS]
                   fuzz the REST API with Schemathesis (installed with pip if missing)
                   against a throwaway server; non-zero exit on any failure
      --cases N            cases per API operation (default 1000)
      --backend B          sqlite | postgres (default sqlite)
      --max-minutes M      stop after M minutes with what was found (default 20)
      --workers W          concurrent Schemathesis workers (default 2)
  fuzz-parsers [--secs N] [--target T]
                   run the cargo-fuzz targets in fuzz/ (pci_parsers, agent_messages) for
                   N seconds each (default 600); installs nightly and cargo-fuzz if missing
  site             build the portal's browser half (wasm32 + wasm-bindgen, stylesheet)
                   into <target>/site, where `server` serves it from
  help             this text
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<()> {
    let Some((cmd, rest)) = args.split_first() else {
        eprint!("{USAGE}");
        bail!("no command given");
    };
    match cmd.as_str() {
        "test" => test::run(rest),
        "demo" => demo::run(rest),
        "bench" => bench::run(rest),
        "fuzz-api" => fuzz::run(rest),
        "fuzz-parsers" => fuzz_parsers::run(rest),
        "site" => site::build().map(|dir| println!("portal bundle in {}", dir.display())),
        "help" | "-h" | "--help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => {
            eprint!("{USAGE}");
            bail!("unknown command {other:?}")
        }
    }
}
