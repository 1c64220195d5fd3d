//! Command-line flags of the demo.

use std::path::PathBuf;
use std::time::Duration;

/// What to simulate.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Requests to serve (the run stops earlier if `duration` passes).
    pub requests: u64,
    /// Stop issuing requests after this long.
    pub duration: Option<Duration>,
    /// Seed of every random choice (request shapes, tenants, devices).
    pub seed: u64,
    /// Worker threads serving requests.
    pub threads: usize,
    /// Run on CUDA devices instead of host-backed simulated devices.
    pub gpu: bool,
    /// Write the governor timeline (Chrome trace event format) here.
    pub trace: Option<PathBuf>,
    /// Write the final snapshot (JSON) here.
    pub snapshot: Option<PathBuf>,
    /// Record every governed allocation to this memory-trace file (`--record`).
    pub record: Option<PathBuf>,
    /// Draw a progress bar.
    pub progress: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            requests: 3000,
            duration: None,
            seed: 42,
            threads: 4,
            gpu: false,
            trace: None,
            snapshot: None,
            record: None,
            progress: true,
        }
    }
}

/// What the command line asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Invocation {
    /// The simulation (the default).
    Simulate(Config),
    /// `--ort`: real models through ONNX Runtime, `requests` per tenant and model.
    RealModels {
        /// Requests per tenant and model.
        requests: usize,
        /// Record every governed allocation to this memory-trace file (`--record`).
        record: Option<PathBuf>,
    },
    /// `--processes N`: N engine processes sharing node books.
    #[cfg(unix)]
    Processes(crate::processes::ProcessesConfig),
    /// One engine of a `--processes` run (the hidden `--engine-of` flag).
    #[cfg(unix)]
    Engine(crate::processes::EngineConfig),
}

/// memory-demo: an LLM server's memory, simulated over the registry and the governor
/// (`cargo xtask demo [FLAGS]`, or `cargo run --release -p memory-demo -- [FLAGS]`).
#[derive(Debug, clap::Parser)]
#[command(name = "memory-demo", disable_version_flag = true)]
struct Cli {
    /// Requests to serve (default 3000; with --ort, per tenant and model, default 40).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    requests: Option<u64>,
    /// Stop issuing requests after S seconds (default: no limit).
    #[arg(long, value_name = "S", value_parser = positive_seconds, conflicts_with = "ort")]
    secs: Option<Duration>,
    /// Seed for request shapes, tenants and devices.
    #[arg(long, value_name = "N", default_value_t = 42, conflicts_with = "ort")]
    seed: u64,
    /// Worker threads (1 to 64).
    #[arg(long, value_name = "N", default_value_t = 4, conflicts_with = "ort",
          value_parser = clap::value_parser!(u64).range(1..=64))]
    threads: u64,
    /// Run on CUDA devices (needs a driver, a device and the `cuda` feature).
    #[arg(long, conflicts_with = "ort")]
    gpu: bool,
    /// Write the governor timeline as a Chrome trace (open in a trace viewer).
    #[arg(long, value_name = "PATH", conflicts_with = "ort")]
    trace: Option<PathBuf>,
    /// Write the final snapshot as JSON.
    #[arg(long, value_name = "PATH", conflicts_with = "ort")]
    snapshot: Option<PathBuf>,
    /// Record every governed allocation (allocations, releases, refusals, lost blocks)
    /// to a memory-trace file; replay it with `cargo xtask replay PATH --compare
    /// system,pooled,virtual --html report.html`. Works with --ort too.
    #[arg(long, value_name = "PATH")]
    record: Option<PathBuf>,
    /// Do not draw the progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Serve real models instead: Silero VAD streams and PP-OCRv4 detection for two
    /// tenants through governed ONNX Runtime allocators (the runtime and models come from
    /// target/ort-cache; `cargo xtask demo --ort` fetches them).
    #[arg(long)]
    ort: bool,
    /// Run N engine processes (2 to 16), each with its own registry and governor, sharing
    /// the simulated devices' budgets and the tenants' quotas through node books; one is
    /// killed two thirds in, and the report ends with the nothing-lost check across
    /// processes. --requests is per engine (default 900).
    #[arg(long, value_name = "N", conflicts_with_all = ["ort", "gpu", "trace", "snapshot", "record"],
          value_parser = clap::value_parser!(u64).range(2..=16))]
    processes: Option<u64>,
    /// (internal) Run as one engine of a --processes run, on the books at PATH.
    #[arg(long, value_name = "PATH", hide = true, requires = "engine_index")]
    engine_of: Option<PathBuf>,
    /// (internal) The engine's index.
    #[arg(long, value_name = "N", hide = true)]
    engine_index: Option<usize>,
}

/// Why the command line was not run: a usage error or a request for help, already
/// formatted by clap (`error.exit()` prints it the way clap would).
pub type FlagError = clap::Error;

/// Parses the arguments after the program name.
///
/// # Errors
/// A [`FlagError`] naming the offending flag, or carrying the help text.
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Invocation, FlagError> {
    let cli = <Cli as clap::Parser>::try_parse_from(std::iter::once("memory-demo".to_owned()).chain(args))?;
    if cli.ort {
        let requests = cli.requests.map_or(40, |n| usize::try_from(n).unwrap_or(usize::MAX));
        return Ok(Invocation::RealModels { requests, record: cli.record });
    }
    let threads = usize::try_from(cli.threads).unwrap_or(4);
    #[cfg(not(unix))]
    if cli.engine_of.is_some() || cli.processes.is_some() {
        return Err(<Cli as clap::CommandFactory>::command().error(
            clap::error::ErrorKind::ArgumentConflict,
            "--processes needs node books in shared memory, which this build has only on Unix; run it on Linux",
        ));
    }
    #[cfg(unix)]
    if let Some(books) = cli.engine_of {
        return Ok(Invocation::Engine(crate::processes::EngineConfig {
            books,
            index: cli.engine_index.unwrap_or(0),
            requests: cli.requests.unwrap_or(900),
            seed: cli.seed,
            threads,
        }));
    }
    #[cfg(unix)]
    if let Some(processes) = cli.processes {
        return Ok(Invocation::Processes(crate::processes::ProcessesConfig {
            processes: usize::try_from(processes).unwrap_or(3),
            requests: cli.requests.unwrap_or(900),
            seed: cli.seed,
            threads: threads.min(2),
        }));
    }
    Ok(Invocation::Simulate(Config {
        requests: cli.requests.unwrap_or(Config::default().requests),
        duration: cli.secs,
        seed: cli.seed,
        threads,
        gpu: cli.gpu,
        trace: cli.trace,
        snapshot: cli.snapshot,
        record: cli.record,
        progress: !cli.no_progress,
    }))
}

fn positive_seconds(value: &str) -> Result<Duration, String> {
    value
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| "expects a positive number of seconds, such as 1.5".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(String::from).collect()
    }

    fn simulate(line: &str) -> Config {
        match parse(args(line)).unwrap() {
            Invocation::Simulate(config) => config,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn flags_parse_into_the_config() {
        let config = simulate(
            "--requests 10 --secs 1.5 --seed 7 --threads 2 --gpu --trace t.json --snapshot s.json --no-progress",
        );
        assert_eq!(config.requests, 10);
        assert_eq!(config.duration, Some(Duration::from_millis(1500)));
        assert_eq!((config.seed, config.threads, config.gpu, config.progress), (7, 2, true, false));
        assert_eq!(config.trace, Some(PathBuf::from("t.json")));
        assert_eq!(config.snapshot, Some(PathBuf::from("s.json")));
        assert_eq!(simulate("--record r.mtrace").record, Some(PathBuf::from("r.mtrace")));
        assert_eq!(simulate(""), Config::default());
    }

    #[test]
    fn ort_mode_takes_requests_per_tenant_and_model() {
        assert_eq!(parse(args("--ort")).unwrap(), Invocation::RealModels { requests: 40, record: None });
        assert_eq!(parse(args("--ort --requests 5")).unwrap(), Invocation::RealModels { requests: 5, record: None });
        assert_eq!(
            parse(args("--ort --record o.mtrace")).unwrap(),
            Invocation::RealModels { requests: 40, record: Some(PathBuf::from("o.mtrace")) }
        );
        assert!(parse(args("--ort --gpu")).unwrap_err().to_string().contains("--gpu"));
    }

    #[cfg(unix)]
    #[test]
    fn processes_mode_takes_requests_per_engine() {
        match parse(args("--processes 3")).unwrap() {
            Invocation::Processes(config) => {
                assert_eq!((config.processes, config.requests, config.threads), (3, 900, 2));
            }
            other => panic!("{other:?}"),
        }
        assert!(parse(args("--processes 1")).unwrap_err().to_string().contains("--processes"));
        assert!(parse(args("--processes 3 --gpu")).unwrap_err().to_string().contains("--gpu"));
        match parse(args("--engine-of /dev/shm/b --engine-index 2 --requests 5")).unwrap() {
            Invocation::Engine(engine) => assert_eq!((engine.index, engine.requests), (2, 5)),
            other => panic!("{other:?}"),
        }
    }

    #[cfg(not(unix))]
    #[test]
    fn processes_mode_says_it_needs_unix() {
        assert!(parse(args("--processes 3")).unwrap_err().to_string().contains("only on Unix"));
    }

    #[test]
    fn bad_flags_are_errors_naming_the_flag() {
        use clap::error::ErrorKind;
        assert_eq!(parse(args("--bogus")).unwrap_err().kind(), ErrorKind::UnknownArgument);
        assert!(parse(args("--requests")).unwrap_err().to_string().contains("--requests"));
        assert!(parse(args("--requests ten")).unwrap_err().to_string().contains("ten"));
        assert!(parse(args("--secs=-1")).unwrap_err().to_string().contains("positive number of seconds"));
        assert!(parse(args("--threads 0")).unwrap_err().to_string().contains("--threads"));
        assert_eq!(parse(args("--help")).unwrap_err().kind(), ErrorKind::DisplayHelp);
    }

    #[test]
    fn clap_definition_is_consistent() {
        <Cli as clap::CommandFactory>::command().debug_assert();
    }
}
