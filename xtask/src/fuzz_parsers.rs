//! `cargo xtask fuzz-parsers [--secs N] [--target T]`: the `cargo fuzz` targets in `fuzz/`
//! (libFuzzer on nightly Rust), each for N seconds (default 600). Installs the nightly
//! toolchain and cargo-fuzz when missing. Each run starts from the seeds in
//! `fuzz/seeds/<target>/` plus what earlier runs kept in `fuzz/corpus/<target>/`; a crash
//! leaves its input in `fuzz/artifacts/<target>/` and fails the command. Prints, per
//! target, the inputs run, seconds, exec/s, coverage and corpus from libFuzzer's final
//! stats, and keeps each log in `<target dir>/fuzz-parsers/<target>.log`.

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
    let logs = util::target_dir()?.join("fuzz-parsers");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
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
        let log_file = logs.join(format!("{t}.log"));
        std::fs::write(&log_file, log.as_bytes())
            .with_context(|| format!("writing {}", log_file.display()))?;
        let tail: Vec<&str> = log.lines().rev().take(25).collect();
        if !out.status.success() {
            eprintln!("{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
            bail!(
                "{t}: the fuzzer stopped with a failure (its input is under fuzz/artifacts/{t}/, \
                 its log in {})",
                log_file.display()
            );
        }
        let f = Figures::of(&log);
        let show = |v: Option<u64>| v.map_or_else(|| "?".to_string(), |n| n.to_string());
        summary.push(format!(
            "{t}: {} runs in {} s of fuzzing ({} exec/s), cov {}, ft {}, corpus {}, no crash \
             ({} with the build; log {})",
            show(f.runs),
            show(f.secs),
            show(f.exec_per_sec),
            show(f.cov),
            show(f.ft),
            f.corpus.as_deref().unwrap_or("?"),
            util::secs(started.elapsed()),
            log_file.display()
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

/// What libFuzzer's log (with `-print_final_stats=1`) says about a run that ended.
#[derive(Debug, Default, PartialEq)]
struct Figures {
    /// Inputs executed (`stat::number_of_executed_units`).
    runs: Option<u64>,
    /// Seconds of fuzzing (`Done N runs in S second(s)`).
    secs: Option<u64>,
    /// `stat::average_exec_per_sec`.
    exec_per_sec: Option<u64>,
    /// Coverage counters and features of the last status line (`cov:`, `ft:`).
    cov: Option<u64>,
    ft: Option<u64>,
    /// The corpus of the last status line (`corp: units/bytes`).
    corpus: Option<String>,
}

impl Figures {
    fn of(log: &str) -> Figures {
        let stat = |k: &str| {
            log.lines()
                .find_map(|l| l.strip_prefix(k)?.trim().parse().ok())
        };
        let mut f = Figures {
            runs: stat("stat::number_of_executed_units:"),
            exec_per_sec: stat("stat::average_exec_per_sec:"),
            secs: log.lines().rev().find_map(|l| {
                let rest = l.strip_prefix("Done ")?;
                let (_, secs) = rest.split_once(" runs in ")?;
                secs.split_whitespace().next()?.parse().ok()
            }),
            ..Figures::default()
        };
        let status = log
            .lines()
            .rev()
            .find(|l| l.starts_with('#') && l.contains(" cov: "));
        if let Some(line) = status {
            let words: Vec<&str> = line.split_whitespace().collect();
            let after = |k: &str| {
                let i = words.iter().position(|w| *w == k)?;
                words.get(i + 1).copied()
            };
            f.cov = after("cov:").and_then(|n| n.parse().ok());
            f.ft = after("ft:").and_then(|n| n.parse().ok());
            f.corpus = after("corp:").map(str::to_string);
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use super::Figures;

    #[test]
    fn figures_of_a_log() {
        let log = "\
INFO: Seed: 1234
#2\tINITED cov: 100 ft: 120 corp: 4/200b exec/s: 0 rss: 40Mb
#65536\tpulse  cov: 900 ft: 2000 corp: 250/9Kb lim: 4096 exec/s: 21845 rss: 300Mb
#12582912\tDONE   cov: 1234 ft: 5678 corp: 301/12Kb lim: 4096 exec/s: 20936 rss: 410Mb
Done 12582912 runs in 601 second(s)
stat::number_of_executed_units: 12582912
stat::average_exec_per_sec:     20936
stat::new_units_added:          1234
stat::slowest_unit_time_sec:    0
stat::peak_rss_mb:              410
";
        assert_eq!(
            Figures::of(log),
            Figures {
                runs: Some(12_582_912),
                secs: Some(601),
                exec_per_sec: Some(20_936),
                cov: Some(1234),
                ft: Some(5678),
                corpus: Some("301/12Kb".into()),
            }
        );
        assert_eq!(Figures::of(""), Figures::default());
    }
}
