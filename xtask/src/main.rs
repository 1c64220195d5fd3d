//! `cargo xtask`: the project's automation, in Rust, run through the alias in
//! `.cargo/config.toml` (`xtask = "run --quiet --package xtask --"`).
//!
//! - `cargo xtask test [--gpu]`: what CI runs (fmt, architecture tidy, clippy, tests,
//!   the instruction budget, docs); `--gpu` adds a CUDA device probe and the GPU-gated tests, and fails when no
//!   device is present or no GPU test ran.
//! - `cargo xtask loom [--preemptions N]`: the loom models, in `target/loom`.
//! - `cargo xtask bench [--compare REV]`: the criterion benches, then one table of the
//!   ratios measured in that run against the performance targets; with `--compare`, the
//!   per-bench change between REV and the working tree, measured alternately on this
//!   machine, as markdown.
//! - `cargo xtask budget [--update]`: the hot path's instructions per operation under
//!   callgrind against the checked-in budget ([`mod@budget`]); also a step of `test`.
//! - `cargo xtask stress [--secs N]`: the bounded stress tests, run for longer.
//! - `cargo xtask mutants [--file F]`: mutation testing of the core crates (weekly).
//! - `cargo xtask demo [ARGS]`: the demo binary; `demo --ort` fetches ONNX Runtime and
//!   the real models first ([`mod@ort`]).
//! - `cargo xtask replay TRACE [--allocator K] [--device-limit B] [--compare A,B] [--html F]`:
//!   memory-trace's replay of an allocation trace, side by side ([`mod@replay`]).
//!
//! Layout: [`flags`] parses the command line into types, [`tasks`] turns each command
//! into a list of steps, [`step`] runs and judges them, [`libtest`] reads test output.
//! `bench` drives its steps itself ([`mod@bench`]), reads criterion's results
//! ([`estimates`]) and prints [`ratios`] and [`compare`] tables ([`table`]); `budget`
//! builds, counts and judges itself too. The architecture tidy checks live in
//! `tests/tidy.rs`, an ordinary test.
#![forbid(unsafe_code)]

mod bench;
mod budget;
mod compare;
mod estimates;
mod flags;
mod libtest;
mod ort;
mod ratios;
mod replay;
mod step;
mod table;
mod tasks;

use std::process::ExitCode;

use flags::Command;

fn main() -> ExitCode {
    let command = match flags::parse(std::env::args_os().skip(1)) {
        Ok(command) => command,
        // Help goes to stdout with success, a usage error to stderr with status 2.
        Err(err) => err.exit(),
    };
    let root = tasks::project_root();
    let result = match command {
        Command::Demo(demo) => return run_demo(&demo, &root),
        Command::Replay(flags) => return run_replay(&flags, &root),
        Command::Test(test) => {
            tasks::clear_stale_package_sources();
            step::run_steps("xtask test", &root, &tasks::test_steps(&test))
        }
        Command::Loom(loom) => step::run_steps("xtask loom", &root, &tasks::loom_steps(&loom)),
        Command::Stress(stress) => step::run_steps("xtask stress", &root, &tasks::stress_steps(&stress)),
        Command::Miri => step::run_steps("xtask miri", &root, &tasks::miri_steps()),
        Command::Fuzz(fuzz) => step::run_steps("xtask fuzz", &root, &tasks::fuzz_steps(&fuzz)),
        Command::Mutants(mutants) => step::run_steps("xtask mutants", &root, &tasks::mutants_steps(&mutants)),
        Command::Budget(budget) => {
            return match budget::run(&budget, &root) {
                Ok(()) => ExitCode::SUCCESS,
                // The runner has already printed the failed build.
                Err(budget::BudgetError::Step(_)) => ExitCode::FAILURE,
                Err(err) => {
                    eprintln!("xtask budget: {err}");
                    ExitCode::FAILURE
                }
            };
        }
        Command::Bench(bench) if bench.ort => step::run_steps("xtask bench --ort", &root, &ort::bench_steps(&bench)),
        Command::Bench(bench) => {
            return match bench::run(&bench, &root) {
                Ok(()) => ExitCode::SUCCESS,
                // The runner has already printed the failed step.
                Err(bench::BenchError::Step(_)) => ExitCode::FAILURE,
                Err(err) => {
                    eprintln!("xtask bench: {err}");
                    ExitCode::FAILURE
                }
            };
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The runner has already printed which step failed and why.
        Err(_) => ExitCode::FAILURE,
    }
}

/// Hands the terminal to the replay and passes its exit code on.
fn run_replay(flags: &flags::Replay, root: &std::path::Path) -> ExitCode {
    let cmd = replay::replay_cmd(flags);
    match cmd.status(root) {
        Ok(status) if status.success() => ExitCode::SUCCESS,
        Ok(status) => {
            eprintln!("xtask replay: `{cmd}` failed ({status})");
            ExitCode::from(
                status.code().and_then(|code| u8::try_from(code).ok()).filter(|&code| code != 0).unwrap_or(1),
            )
        }
        Err(err) => {
            eprintln!("xtask replay: could not start `{cmd}`: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Hands the terminal to the demo and passes its exit code on.
fn run_demo(demo: &flags::Demo, root: &std::path::Path) -> ExitCode {
    let mut cmd = tasks::demo_cmd(demo);
    if ort::is_demo_ort(demo) {
        if step::run_steps("xtask demo --ort", root, &[ort::fetch_step()]).is_err() {
            return ExitCode::FAILURE;
        }
        cmd = ort::with_assets(cmd);
    }
    match cmd.status(root) {
        Ok(status) if status.success() => ExitCode::SUCCESS,
        Ok(status) => {
            eprintln!("xtask demo: `{cmd}` failed ({status})");
            ExitCode::from(
                status.code().and_then(|code| u8::try_from(code).ok()).filter(|&code| code != 0).unwrap_or(1),
            )
        }
        Err(err) => {
            eprintln!("xtask demo: could not start `{cmd}`: {err}");
            ExitCode::FAILURE
        }
    }
}
