//! `memory-demo` (`cargo xtask demo`): see the library docs.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use memory_demo::{Invocation, parse, run};

fn main() -> ExitCode {
    let config = match parse(std::env::args().skip(1)) {
        Ok(Invocation::Simulate(config)) => config,
        Ok(Invocation::RealModels { requests, record }) => {
            return match memory_demo::real_models::run(requests, record.as_deref()) {
                Ok((report, passed)) => {
                    print!("{report}");
                    if let Some(path) = &record {
                        print!("{}", memory_demo::recorded_line(path));
                    }
                    if passed { ExitCode::SUCCESS } else { ExitCode::FAILURE }
                }
                Err(error) => {
                    eprintln!("memory-demo --ort: {error}");
                    ExitCode::FAILURE
                }
            };
        }
        #[cfg(unix)]
        Ok(Invocation::Processes(config)) => {
            return match memory_demo::processes::run(&config) {
                Ok(report) => {
                    print!("{report}");
                    if report.passed() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
                }
                Err(error) => {
                    eprintln!("memory-demo --processes: {error}");
                    ExitCode::FAILURE
                }
            };
        }
        #[cfg(unix)]
        Ok(Invocation::Engine(config)) => {
            return match memory_demo::processes::engine(&config) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("memory-demo engine {}: {error}", config.index);
                    ExitCode::FAILURE
                }
            };
        }
        // Help goes to stdout with success, a usage error to stderr with status 2.
        Err(error) => error.exit(),
    };
    let report = match run(&config) {
        Ok(report) => report,
        Err(error) => {
            eprintln!("memory-demo: {error}");
            return ExitCode::FAILURE;
        }
    };
    print!("{report}");
    for (path, contents, what) in [
        (&config.trace, &report.trace_json, "trace (Chrome trace event format)"),
        (&config.snapshot, &report.snapshot_json(), "snapshot"),
    ] {
        if let Some(path) = path {
            match std::fs::write(path, contents) {
                Ok(()) => println!("wrote the {what} to {}", path.display()),
                Err(error) => {
                    eprintln!("memory-demo: cannot write the {what} to {}: {error}", path.display());
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    if let (Some(path), Some(recording)) = (&config.record, &report.recording) {
        println!(
            "recorded {} events ({} bytes, {} ring waits) to {}",
            recording.events,
            recording.bytes,
            recording.waits,
            path.display()
        );
        print!("{}", memory_demo::recorded_line(path));
    }
    if report.passed() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
