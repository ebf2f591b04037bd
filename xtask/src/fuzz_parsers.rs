//! `cargo xtask fuzz-parsers [--secs N] [--target T]`: the `cargo fuzz` targets in `fuzz/`
//! (libFuzzer on nightly Rust), each for N seconds (default 600). Installs the nightly
//! toolchain and cargo-fuzz when missing. Each run starts from the seeds in
//! `fuzz/seeds/<target>/` plus what earlier runs kept in `fuzz/corpus/<target>/`; a crash
//! leaves its input in `fuzz/artifacts/<target>/` and fails the command.

use crate::util::{self, repo_root};
use anyhow::{Context, Result, bail};
use std::process::Command;
use std::time::Instant;

const TARGETS: [&str; 2] = ["pci_parsers", "agent_messages"];

/// `cargo xtask fuzz-parsers [--secs N] [--target T]`.
#[derive(clap::Args)]
pub struct Args {
    /// Seconds to fuzz each target
    #[arg(long, value_name = "N", default_value_t = 600)]
    secs: u64,
    /// Fuzz only this target (default: all of them)
    #[arg(long, value_name = "T", value_parser = TARGETS)]
    target: Option<String>,
}

pub fn run(args: &Args) -> Result<()> {
    let secs = args.secs;
    let targets: Vec<&str> = match &args.target {
        Some(t) => vec![t.as_str()],
        None => TARGETS.to_vec(),
    };
    tools()?;
    let fuzz = repo_root().join("fuzz");
    let mut summary = Vec::new();
    for t in targets {
        let corpus = fuzz.join("corpus").join(t);
        std::fs::create_dir_all(&corpus)
            .with_context(|| format!("creating {}", corpus.display()))?;
        println!("==> fuzzing {t} for {secs} s");
        let started = Instant::now();
        let out = Command::new("cargo")
            .current_dir(&fuzz)
            .args(["+nightly", "fuzz", "run", t])
            .arg(&corpus)
            .arg(fuzz.join("seeds").join(t))
            .arg("--")
            .arg(format!("-max_total_time={secs}"))
            .arg("-print_final_stats=1")
            .output()
            .with_context(|| format!("running cargo fuzz run {t}"))?;
        let log = String::from_utf8_lossy(&out.stderr);
        let runs = log
            .lines()
            .find_map(|l| l.strip_prefix("stat::number_of_executed_units:"))
            .map(|n| n.trim().to_string())
            .unwrap_or_else(|| "?".into());
        let tail: Vec<&str> = log.lines().rev().take(25).collect();
        if !out.status.success() {
            eprintln!("{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
            bail!(
                "{t}: the fuzzer stopped with a failure (its input is under fuzz/artifacts/{t}/)"
            );
        }
        summary.push(format!(
            "{t}: {runs} inputs in {}, no crash",
            util::secs(started.elapsed())
        ));
    }
    for s in summary {
        println!("{s}");
    }
    Ok(())
}

/// The nightly toolchain and cargo-fuzz, installed when missing.
fn tools() -> Result<()> {
    let nightly = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !nightly {
        util::run_checked(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))?;
    }
    if !util::on_path("cargo-fuzz") {
        util::run_checked(Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]))?;
    }
    Ok(())
}
