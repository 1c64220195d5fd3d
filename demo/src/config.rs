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
            progress: true,
        }
    }
}

/// `memory-demo --help`.
pub const USAGE: &str = "\
memory-demo: an LLM server's memory, simulated over the registry and the governor

USAGE:
    cargo xtask demo [FLAGS]        (or: cargo run --release -p memory-demo -- [FLAGS])

FLAGS:
    --requests N      requests to serve (default 3000)
    --secs S          stop issuing requests after S seconds (default: no limit)
    --seed N          seed for request shapes, tenants and devices (default 42)
    --threads N       worker threads (default 4)
    --gpu             run on CUDA devices (needs a driver and a device)
    --trace PATH      write the governor timeline as a Chrome trace (open in a trace viewer)
    --snapshot PATH   write the final snapshot as JSON
    --no-progress     do not draw the progress bar
    -h, --help        print this text
";

/// Why the command line was rejected.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum FlagError {
    /// `--help` was asked for.
    #[error("help requested")]
    Help,
    /// A flag the demo does not know.
    #[error("unknown flag `{0}`; see --help")]
    Unknown(String),
    /// A flag that needs a value came last.
    #[error("`{0}` needs a value; see --help")]
    MissingValue(String),
    /// A value that does not parse.
    #[error("`{flag}` expects {expected}, got `{value}`")]
    BadValue {
        /// The flag.
        flag: String,
        /// What it expects.
        expected: &'static str,
        /// What was given.
        value: String,
    },
}

/// Parses the arguments after the program name.
///
/// # Errors
/// A [`FlagError`] naming the offending flag.
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Config, FlagError> {
    let mut config = Config::default();
    let mut args = args.into_iter();
    while let Some(flag) = args.next() {
        let mut value = |expected: &'static str| -> Result<String, FlagError> {
            args.next().ok_or_else(|| FlagError::MissingValue(flag.clone())).map(|v| (v, expected).0)
        };
        match flag.as_str() {
            "--requests" => config.requests = number(&flag, &value("a whole number")?)?,
            "--seed" => config.seed = number(&flag, &value("a whole number")?)?,
            "--threads" => {
                let threads: u64 = number(&flag, &value("a whole number")?)?;
                config.threads = usize::try_from(threads.clamp(1, 64)).unwrap_or(4);
            }
            "--secs" => {
                let raw = value("seconds")?;
                let secs: f64 =
                    raw.parse().ok().filter(|s: &f64| s.is_finite() && *s > 0.0).ok_or(FlagError::BadValue {
                        flag: flag.clone(),
                        expected: "a positive number of seconds",
                        value: raw,
                    })?;
                config.duration = Some(Duration::from_secs_f64(secs));
            }
            "--trace" => config.trace = Some(PathBuf::from(value("a path")?)),
            "--snapshot" => config.snapshot = Some(PathBuf::from(value("a path")?)),
            "--gpu" => config.gpu = true,
            "--no-progress" => config.progress = false,
            "-h" | "--help" => return Err(FlagError::Help),
            _ => return Err(FlagError::Unknown(flag)),
        }
    }
    Ok(config)
}

fn number(flag: &str, value: &str) -> Result<u64, FlagError> {
    value.parse().map_err(|_| FlagError::BadValue {
        flag: flag.to_owned(),
        expected: "a whole number",
        value: value.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn flags_parse_into_the_config() {
        let config = parse(args(
            "--requests 10 --secs 1.5 --seed 7 --threads 2 --gpu --trace t.json --snapshot s.json --no-progress",
        ))
        .unwrap();
        assert_eq!(config.requests, 10);
        assert_eq!(config.duration, Some(Duration::from_millis(1500)));
        assert_eq!((config.seed, config.threads, config.gpu, config.progress), (7, 2, true, false));
        assert_eq!(config.trace, Some(PathBuf::from("t.json")));
        assert_eq!(config.snapshot, Some(PathBuf::from("s.json")));
        assert_eq!(parse(Vec::new()).unwrap(), Config::default());
    }

    #[test]
    fn bad_flags_are_typed_errors() {
        assert_eq!(parse(args("--bogus")), Err(FlagError::Unknown("--bogus".into())));
        assert_eq!(parse(args("--requests")), Err(FlagError::MissingValue("--requests".into())));
        assert!(matches!(parse(args("--requests ten")), Err(FlagError::BadValue { .. })));
        assert!(matches!(parse(args("--secs -1")), Err(FlagError::BadValue { .. })));
        assert_eq!(parse(args("--help")), Err(FlagError::Help));
    }
}
