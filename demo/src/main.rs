//! `memory-demo`, the project's main job (`cargo xtask demo`).
//!
//! For now a short, real walkthrough of the memory-api contract on the CPU backend
//! (`allocator_cpu::SystemAllocator`): blocks allocated per role, a pattern written and
//! verified per role (on the demo's safe-Rust heap), bad layouts refused with typed
//! errors, every release outcome shown (including an honest `Failed` that hands the
//! block back), and a closing table with a nothing-left-live check. It exits non-zero
//! when any check fails. The full inference-server simulation replaces it later.
#![forbid(unsafe_code)]

mod host;
mod walkthrough;

use std::process::ExitCode;

const USAGE: &str = "\
memory-demo: a walkthrough of registry-issued device memory on the CPU backend

USAGE:
    cargo xtask demo            (or: cargo run --release -p memory-demo)

FLAGS:
    -h, --help    print this text

It takes no other flags yet.
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None => {}
        Some("-h" | "--help") if args.len() == 1 => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some(_) => {
            eprintln!("memory-demo: unexpected argument(s): {}\n\n{USAGE}", args.join(" "));
            return ExitCode::from(2);
        }
    }
    let mut stdout = std::io::stdout().lock();
    match walkthrough::run(&mut stdout) {
        Ok(report) if report.passed() => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("memory-demo: cannot write the report: {err}");
            ExitCode::FAILURE
        }
    }
}
