//! `cargo xtask`: Passage's own task runner.
//!
//! - `cargo xtask test [-- ARGS]`: everything CI runs (set-up, fmt, clippy, build, tests).
//! - `cargo xtask demo [--servers N] [--gpus G] [--model M] [--port P] [--reset]`: a local
//!   control plane with simulated compute nodes.
//! - `cargo xtask site`: the portal's WebAssembly bundle and stylesheet, into `<target>/site`.
//! - `cargo xtask bench discovery`: PCI discovery timings next to pciutils' `lspci`.
//! - `cargo xtask bench placement`: VM creations per second through the API, and
//!   multi-GPU placement decisions.
//! - `cargo xtask bench portal`: the portal's list pages over a seeded fleet.
//! - `cargo xtask bench images`: a 2 GiB image's upload and a node's download of it next
//!   to `cp` on the same disk, and a second VM from the cached image.
//! - `cargo xtask bench ssh`: create → `ssh` answers through Passage, next to the same
//!   guest started by hand with `qemu-system-x86_64` (same image, seed and tap).
//! - `cargo xtask bench launch`: `POST /v1/vms` to QEMU answering QMP for an 8-GPU VM,
//!   with ordinary RAM and with 2 MiB huge pages, side by side.
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
mod test_image;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// Passage's own task runner.
#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "Passage's own task runner",
    arg_required_else_help = true,
    after_help = "Run `cargo xtask help <COMMAND>` or `cargo xtask <COMMAND> --help` for a \
                  command's options."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Everything CI runs: set-up, fmt, clippy, build, tests, end2end
    ///
    /// Sets up lspci, QEMU and PostgreSQL if needed, then runs fmt --check, clippy, builds
    /// the binaries and the portal bundle and runs every test (nextest if installed, else
    /// cargo test) plus the doc tests and the end2end tests. ARGS go to the test runner
    /// (e.g. `cargo xtask test -- store_`).
    Test(test::Args),
    /// A local server with simulated GPU nodes, until Ctrl-C
    Demo(demo::Args),
    /// Benchmarks: PCI discovery, placement, fleet, portal pages, image transfers
    #[command(subcommand)]
    Bench(bench::Bench),
    /// Fuzz the REST API with Schemathesis against a throwaway server
    ///
    /// Installs Schemathesis with pip if missing; exits non-zero on any failure.
    FuzzApi(fuzz::Args),
    /// Run the cargo-fuzz targets in fuzz/ (pci_parsers, agent_messages)
    ///
    /// Each target runs for N seconds; installs nightly and cargo-fuzz if missing. A crash
    /// leaves its input in fuzz/artifacts/<target>/ and fails the command.
    FuzzParsers(fuzz_parsers::Args),
    /// Build the portal's browser half into <target>/site
    ///
    /// wasm32 + wasm-bindgen and the stylesheet, where `server` serves them from.
    Site,
    /// Build (or find cached) the Debian guest image the agent's boot tests run
    ///
    /// From Debian packages with mmdebstrap, cached in ~/.cache/passage-images/ by a hash
    /// of its recipe; `cargo xtask test` does this itself. Prints the image's path.
    TestImage,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> Result<()> {
    match command {
        Command::Test(args) => test::run(&args),
        Command::Demo(args) => demo::run(&args),
        Command::Bench(bench) => bench::run(&bench),
        Command::FuzzApi(args) => fuzz::run(&args),
        Command::FuzzParsers(args) => fuzz_parsers::run(&args),
        Command::Site => site::build().map(|dir| println!("portal bundle in {}", dir.display())),
        Command::TestImage => test_image::ensure().map(|p| println!("{}", p.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Command, clap::Error> {
        Cli::try_parse_from(std::iter::once("xtask").chain(args.iter().copied())).map(|c| c.command)
    }

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn test_passes_everything_on() {
        for (args, want) in [
            (&["test"][..], &[][..]),
            (&["test", "--", "store_"], &["store_"]),
            (
                &["test", "store_", "--no-capture"],
                &["store_", "--no-capture"],
            ),
            (&["test", "--", "--help"], &["--help"]),
            (&["test", "--", "-E", "test(x)"], &["-E", "test(x)"]),
            (&["test", "--no-capture", "x"], &["--no-capture", "x"]),
        ] {
            let Ok(Command::Test(t)) = parse(args) else {
                panic!("{args:?} did not parse as test");
            };
            assert_eq!(t.passthrough(), want, "{args:?}");
        }
    }

    #[test]
    fn fuzz_api_takes_schemathesis_args_after_dashes() {
        let Ok(Command::FuzzApi(a)) = parse(&[
            "fuzz-api",
            "--cases",
            "50",
            "--backend=postgresql",
            "--",
            "--seed",
            "1",
        ]) else {
            panic!("fuzz-api did not parse");
        };
        assert_eq!(a.passthrough(), ["--seed", "1"]);
        assert!(parse(&["fuzz-api", "--seed", "1"]).is_err());
        assert!(parse(&["fuzz-api", "--cases", "0"]).is_err());
        assert!(parse(&["fuzz-api", "--workers", "65"]).is_err());
    }

    #[test]
    fn unknown_and_bad_values_are_refused() {
        for args in [
            &["demo", "--bogus"][..],
            &["demo", "--servers", "65"],
            &["demo", "--model", "k80"],
            &["demo", "--port", "70000"],
            &["fuzz-parsers", "--target", "nope"],
            &["fuzz-parsers", "--secs", "x"],
            &["bench", "placement", "--requests", "5"],
            &["bench", "nope"],
            &["nope"],
        ] {
            assert!(parse(args).is_err(), "{args:?} was accepted");
        }
        assert!(parse(&["demo", "--model", "H100", "--port=9000", "--reset"]).is_ok());
        assert!(parse(&["bench", "portal", "--keep", "/tmp/x", "--requests", "5"]).is_ok());
    }
}
