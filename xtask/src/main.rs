//! `cargo xtask`: the project's automation, in Rust, run through the alias in
//! `.cargo/config.toml` (`xtask = "run --quiet --package xtask --"`).
//!
//! - `cargo xtask test [--gpu]`: what CI runs (fmt, architecture tidy, clippy, tests,
//!   docs); `--gpu` adds a CUDA device probe and the GPU-gated tests, and fails when no
//!   device is present or no GPU test ran.
//! - `cargo xtask loom [--preemptions N]`: the loom models, in `target/loom`.
//! - `cargo xtask bench`: the criterion benches.
//! - `cargo xtask demo [ARGS]`: the demo binary.
//!
//! Layout: [`flags`] parses the command line into types, [`tasks`] turns each command
//! into a list of steps, [`step`] runs and judges them, [`libtest`] reads test output.
//! The architecture tidy checks live in `tests/tidy.rs`, an ordinary test.
#![forbid(unsafe_code)]

mod flags;
mod libtest;
mod step;
mod tasks;

use std::process::ExitCode;

use flags::Command;

fn main() -> ExitCode {
    let command = match flags::parse(std::env::args_os().skip(1)) {
        Ok(command) => command,
        Err(err) => {
            eprintln!("xtask: {err}\n\n{}", flags::HELP);
            return ExitCode::from(2);
        }
    };
    let root = tasks::project_root();
    let result = match command {
        Command::Help => {
            print!("{}", flags::HELP);
            return ExitCode::SUCCESS;
        }
        Command::Demo(demo) => return run_demo(&demo, &root),
        Command::Test(test) => step::run_steps("xtask test", &root, &tasks::test_steps(&test)),
        Command::Loom(loom) => step::run_steps("xtask loom", &root, &tasks::loom_steps(&loom)),
        Command::Bench => {
            println!(
                "xtask bench: runs the criterion benches of memory-benches as they are; \
                 it prints criterion's own report (no ratio table or --compare yet)"
            );
            step::run_steps("xtask bench", &root, &tasks::bench_steps())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The runner has already printed which step failed and why.
        Err(_) => ExitCode::FAILURE,
    }
}

/// Hands the terminal to the demo and passes its exit code on.
fn run_demo(demo: &flags::Demo, root: &std::path::Path) -> ExitCode {
    let cmd = tasks::demo_cmd(demo);
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
