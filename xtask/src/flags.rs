//! Typed command-line flags: one struct per command, one enum over the commands, parsed
//! by `clap`'s derive (the help text is generated from the doc comments below, so it
//! cannot drift from what is accepted).
//!
//! Adding a command means adding a variant and a struct; the unit tests below pin every
//! accepted and rejected form that other code relies on.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Default `LOOM_MAX_PREEMPTIONS` for `cargo xtask loom`.
pub(crate) const DEFAULT_LOOM_PREEMPTIONS: u32 = 3;

/// Default criterion warm-up per bench for `cargo xtask bench`, in seconds.
pub(crate) const DEFAULT_WARM_UP_SECS: f64 = 1.0;

/// Default criterion measurement time per bench for `cargo xtask bench`, in seconds.
/// With the warm-up, the benches of memory-benches take a few minutes.
pub(crate) const DEFAULT_MEASUREMENT_SECS: f64 = 2.0;

/// Default runs of each side for `cargo xtask bench --compare`.
pub(crate) const DEFAULT_ROUNDS: u32 = 2;

/// Default noise threshold of `cargo xtask bench --compare`, in percent.
pub(crate) const DEFAULT_THRESHOLD_PCT: f64 = 5.0;

/// Default `MEMORY_STRESS_SECS` for `cargo xtask stress`.
pub(crate) const DEFAULT_STRESS_SECS: u64 = 30;

/// Default `--secs` of `cargo xtask fuzz`.
pub(crate) const DEFAULT_FUZZ_SECS: u64 = 60;

/// cargo xtask: project automation for the device-memory workspace.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask", disable_version_flag = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// One parsed invocation.
#[derive(Clone, Debug, PartialEq, Subcommand)]
pub(crate) enum Command {
    /// Runs fmt, architecture tidy, clippy, all tests, loom, docs and packaging, as CI
    /// runs them.
    Test(Test),
    /// Runs the loom models (tests named *loom*) of memory-sync, memory-binding, memory-governor,
    /// memory-capi and memory-plugin, built with --cfg memory_loom in target/loom.
    Loom(Loom),
    /// Runs every criterion bench of memory-benches with short settings, then one table of the
    /// ratios measured in that run against the performance targets; fails if a result
    /// the table needs is missing.
    Bench(Bench),
    /// Counts the hot path's instructions per operation under callgrind (release builds of
    /// the counting programs; needs valgrind) and fails when one exceeds its budget in
    /// xtask/instruction-budget.toml by more than 10 %, printing the table.
    Budget(Budget),
    /// Runs the bounded stress tests for longer
    /// (MEMORY_STRESS_SECS=N cargo test --release -p memory-binding --test stress);
    /// repeats their ops/s lines at the end.
    Stress(Stress),
    /// Runs the unsafe-bearing crates' tests under Miri on the nightly toolchain
    /// (bash scripts/miri.sh; installs the component if missing; not in CI).
    Miri,
    /// Runs the registry_ops fuzz target on nightly
    /// (cargo +nightly fuzz run registry_ops; fuzz/ is outside the workspace).
    Fuzz(Fuzz),
    /// Mutation testing of memory-binding and memory-governor with cargo-mutants (slow:
    /// run weekly, not in CI); cargo-mutants prints the missed mutants.
    Mutants(Mutants),
    /// Runs the demo (cargo run --release -p memory-demo -- ARGS...); `--gpu` also
    /// enables the demo's `cuda` feature; `--ort` first fetches ONNX Runtime and the real
    /// models (two tenants on Silero VAD and PP-OCRv4 through governed allocators).
    Demo(Demo),
    /// Replays an allocation trace (recorded with memory_trace::Recorder) against allocator
    /// stacks on a host-backed simulated device, the governor in front, and prints peak
    /// allocated and reserved, fragmentation at the peak, refusals and latency side by side
    /// (cargo run --release -p memory-trace -- replay ...).
    Replay(Replay),
}

/// Flags of `cargo xtask test`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Args)]
pub(crate) struct Test {
    /// First probe for a CUDA device (fail at once without one), then also run the
    /// GPU-gated tests of allocator-cuda and fail if none ran.
    #[arg(long)]
    pub(crate) gpu: bool,
}

/// Flags of `cargo xtask loom`.
#[derive(Clone, Debug, PartialEq, Eq, Args)]
pub(crate) struct Loom {
    /// LOOM_MAX_PREEMPTIONS for the run.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_LOOM_PREEMPTIONS)]
    pub(crate) preemptions: u32,
}

impl Default for Loom {
    fn default() -> Loom {
        Loom { preemptions: DEFAULT_LOOM_PREEMPTIONS }
    }
}

/// Flags of `cargo xtask bench`.
#[derive(Clone, Debug, PartialEq, Args)]
pub(crate) struct Bench {
    /// Instead: build the benches at REV (a git worktree under the target dir, removed
    /// afterwards) and at the working tree, run them alternately on this machine and print
    /// a markdown table of each bench's change.
    #[arg(long, value_name = "REV", value_parser = git_revision, conflicts_with = "gpu")]
    pub(crate) compare: Option<String>,
    /// With --compare: runs of each side.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_ROUNDS, requires = "compare",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) rounds: u32,
    /// With --compare: changes within +-PCT% (or within the spread of one side's own
    /// runs) are marked "~ noise".
    #[arg(long = "threshold", value_name = "PCT", default_value_t = DEFAULT_THRESHOLD_PCT, requires = "compare",
          allow_negative_numbers = true,
          value_parser = non_negative)]
    pub(crate) threshold_pct: f64,
    /// Criterion warm-up per bench, in seconds.
    #[arg(long = "warm-up-time", value_name = "SECS", default_value_t = DEFAULT_WARM_UP_SECS, value_parser = positive)]
    pub(crate) warm_up_secs: f64,
    /// Criterion measurement per bench, in seconds; pass more for steadier figures.
    #[arg(long = "measurement-time", value_name = "SECS", default_value_t = DEFAULT_MEASUREMENT_SECS,
          value_parser = positive)]
    pub(crate) measurement_secs: f64,
    /// Also write the table (markdown) to PATH.
    #[arg(long, value_name = "PATH", value_parser = non_empty_path)]
    pub(crate) output: Option<PathBuf>,
    /// Instead: probe for a CUDA device (fail without one), then run the CUDA bench
    /// (eager vs pool vs VMM allocate+release, VMM commit per granule) and its table.
    #[arg(long)]
    pub(crate) gpu: bool,
    /// Instead: fetch ONNX Runtime and the real models, then per model and shape sweep
    /// p50/p99 latency and peak RSS of ORT's arena, no arena, governed pool and governed
    /// system allocator, alternating, each in its own process, as ratios against the
    /// arena (arguments after -- go to ort-bench: --rounds N --vad-iters N --ocr-iters N
    /// --sweeps N --models A,B --configs A,B, or --trace MODEL CONFIG).
    #[arg(long, conflicts_with_all = ["compare", "gpu"])]
    pub(crate) ort: bool,
    /// Passed to every bench binary after `--` (a name filter leaves table rows missing).
    #[arg(last = true, value_name = "CRITERION_ARGS")]
    pub(crate) criterion_args: Vec<String>,
}

impl Default for Bench {
    fn default() -> Bench {
        Bench {
            compare: None,
            rounds: DEFAULT_ROUNDS,
            threshold_pct: DEFAULT_THRESHOLD_PCT,
            warm_up_secs: DEFAULT_WARM_UP_SECS,
            measurement_secs: DEFAULT_MEASUREMENT_SECS,
            output: None,
            gpu: false,
            ort: false,
            criterion_args: Vec::new(),
        }
    }
}

/// Flags of `cargo xtask budget`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Args)]
pub(crate) struct Budget {
    /// Instead of judging the figures, write them into the budget file (comments kept);
    /// review the diff, and say in the commit why each figure that rose may.
    #[arg(long)]
    pub(crate) update: bool,
}

/// Flags of `cargo xtask stress`.
#[derive(Clone, Debug, PartialEq, Eq, Args)]
pub(crate) struct Stress {
    /// MEMORY_STRESS_SECS for the run.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_STRESS_SECS,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) secs: u64,
}

impl Default for Stress {
    fn default() -> Stress {
        Stress { secs: DEFAULT_STRESS_SECS }
    }
}

/// Flags of `cargo xtask fuzz`.
#[derive(Clone, Debug, PartialEq, Eq, Args)]
pub(crate) struct Fuzz {
    /// libFuzzer's -max_total_time, in seconds.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_FUZZ_SECS,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) secs: u64,
}

impl Default for Fuzz {
    fn default() -> Fuzz {
        Fuzz { secs: DEFAULT_FUZZ_SECS }
    }
}

/// Flags of `cargo xtask mutants`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Args)]
pub(crate) struct Mutants {
    /// Mutate only this source file (for example
    /// crates/memory-binding/src/binding.rs); default: every file of memory-binding and
    /// memory-governor.
    #[arg(long, value_name = "FILE")]
    pub(crate) file: Option<PathBuf>,
}

/// Arguments of `cargo xtask demo`, passed to the demo binary untouched.
#[derive(Clone, Debug, Default, PartialEq, Eq, Args)]
pub(crate) struct Demo {
    /// Everything after `demo` (a leading `--` is dropped); see `cargo xtask demo --help`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "ARGS")]
    pub(crate) args: Vec<String>,
}

/// The allocator stacks `cargo xtask replay` knows (memory-trace's `AllocatorKind`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ReplayAllocator {
    /// The system allocator, no cache.
    System,
    /// A caching pool over a governed cache backing.
    Pooled,
    /// Reserve address space, commit each block whole.
    Virtual,
}

impl ReplayAllocator {
    pub(crate) fn name(self) -> &'static str {
        match self {
            ReplayAllocator::System => "system",
            ReplayAllocator::Pooled => "pooled",
            ReplayAllocator::Virtual => "virtual",
        }
    }
}

/// Flags of `cargo xtask replay`.
#[derive(Clone, Debug, PartialEq, Eq, Args)]
pub(crate) struct Replay {
    /// The trace (.mtrace), e.g. crates/memory-trace/traces/workload.mtrace.
    #[arg(value_name = "TRACE", value_parser = non_empty_path)]
    pub(crate) trace: PathBuf,
    /// The allocator stack (default pooled).
    #[arg(long, value_enum, value_name = "KIND")]
    pub(crate) allocator: Option<ReplayAllocator>,
    /// Every device's limit (default: the one recorded), e.g. 268435456 or 256MiB.
    #[arg(long = "device-limit", value_name = "BYTES")]
    pub(crate) device_limit: Option<String>,
    /// Several stacks side by side, each optionally with its own limit: system,pooled@64MiB,virtual.
    #[arg(long, value_name = "A,B,...")]
    pub(crate) compare: Option<String>,
    /// Tenants without the quotas recorded.
    #[arg(long = "no-quotas")]
    pub(crate) no_quotas: bool,
    /// Also write one self-contained HTML page (timeline, largest allocations at the peak, refusals).
    #[arg(long, value_name = "REPORT.html", value_parser = non_empty_path)]
    pub(crate) html: Option<PathBuf>,
}

/// Why the command line was not run: a usage error, or a request for help (which
/// clap has already formatted; [`FlagError::exit`] prints it the way clap would).
pub(crate) type FlagError = clap::Error;

/// Parses the arguments after `cargo xtask` (the program name already removed).
pub(crate) fn parse<I>(args: I) -> Result<Command, FlagError>
where
    I: IntoIterator<Item = OsString>,
{
    let argv = std::iter::once(OsString::from("cargo xtask")).chain(args);
    let mut command = Cli::try_parse_from(argv)?.command;
    if let Command::Demo(demo) = &mut command
        && demo.args.first().is_some_and(|first| first == "--")
    {
        demo.args.remove(0);
    }
    Ok(command)
}

fn git_revision(value: &str) -> Result<String, String> {
    if value.is_empty() || value.starts_with('-') {
        return Err("expects a git revision (a branch, tag or commit such as origin/main or HEAD~1)".into());
    }
    Ok(value.to_owned())
}

fn number(value: &str) -> Result<f64, String> {
    value.parse::<f64>().ok().filter(|n| n.is_finite()).ok_or_else(|| format!("expects a number, got `{value}`"))
}

fn non_negative(value: &str) -> Result<f64, String> {
    number(value)
        .and_then(|n| if n >= 0.0 { Ok(n) } else { Err("expects a percentage of 0 or more, such as 5".into()) })
}

fn positive(value: &str) -> Result<f64, String> {
    number(value).and_then(|n| if n > 0.0 { Ok(n) } else { Err("expects seconds above 0, such as 1 or 0.5".into()) })
}

fn non_empty_path(value: &str) -> Result<PathBuf, String> {
    if value.is_empty() { Err("expects a file path".into()) } else { Ok(PathBuf::from(value)) }
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;

    use super::*;

    fn parse_str(args: &[&str]) -> Result<Command, FlagError> {
        parse(args.iter().map(OsString::from))
    }

    fn bench(args: &[&str]) -> Result<Bench, FlagError> {
        match parse_str(&[&["bench"], args].concat())? {
            Command::Bench(bench) => Ok(bench),
            other => panic!("not a bench command: {other:?}"),
        }
    }

    fn rejected(args: &[&str]) -> String {
        parse_str(args).expect_err("should be rejected").to_string()
    }

    #[test]
    fn clap_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn test_command_takes_only_the_gpu_flag() {
        assert_eq!(parse_str(&["test"]).unwrap(), Command::Test(Test { gpu: false }));
        assert_eq!(parse_str(&["test", "--gpu"]).unwrap(), Command::Test(Test { gpu: true }));
        assert!(rejected(&["test", "--release"]).contains("--release"));
    }

    #[test]
    fn loom_preemptions_default_to_three_and_accept_both_spellings() {
        assert_eq!(parse_str(&["loom"]).unwrap(), Command::Loom(Loom { preemptions: 3 }));
        assert_eq!(parse_str(&["loom", "--preemptions", "2"]).unwrap(), Command::Loom(Loom { preemptions: 2 }));
        assert_eq!(parse_str(&["loom", "--preemptions=5"]).unwrap(), Command::Loom(Loom { preemptions: 5 }));
        assert!(rejected(&["loom", "--preemptions", "two"]).contains("two"));
        assert_eq!(parse_str(&["loom", "--preemptions"]).unwrap_err().kind(), ErrorKind::InvalidValue);
    }

    #[test]
    fn demo_passes_everything_through_and_drops_a_leading_separator() {
        let args = ["--gpu", "--seed", "7", "--unknown-to-xtask"];
        let demo = |extra: &[&str]| match parse_str(&[&["demo"], extra].concat()).unwrap() {
            Command::Demo(demo) => demo.args,
            other => panic!("{other:?}"),
        };
        assert_eq!(demo(&args), args);
        assert_eq!(demo(&[&["--"], &args[..]].concat()), args);
        assert!(demo(&[]).is_empty());
    }

    #[test]
    fn replay_takes_a_trace_and_the_replay_flags() {
        let replay = match parse_str(&[
            "replay",
            "t.mtrace",
            "--allocator",
            "virtual",
            "--device-limit",
            "64MiB",
            "--compare",
            "system,pooled@1GiB",
            "--no-quotas",
            "--html",
            "r.html",
        ])
        .unwrap()
        {
            Command::Replay(replay) => replay,
            other => panic!("{other:?}"),
        };
        assert_eq!(replay.trace, PathBuf::from("t.mtrace"));
        assert_eq!(replay.allocator, Some(ReplayAllocator::Virtual));
        assert_eq!(
            (replay.device_limit.as_deref(), replay.compare.as_deref()),
            (Some("64MiB"), Some("system,pooled@1GiB"))
        );
        assert!(replay.no_quotas);
        assert_eq!(replay.html, Some(PathBuf::from("r.html")));
        assert!(rejected(&["replay"]).contains("TRACE"));
        assert!(rejected(&["replay", "t", "--allocator", "slab"]).contains("slab"));
    }

    #[test]
    fn bench_defaults_are_short_settings_without_compare() {
        assert_eq!(bench(&[]).unwrap(), Bench::default());
    }

    #[test]
    fn bench_accepts_every_flag_in_both_spellings() {
        let parsed = bench(&[
            "--compare",
            "origin/main",
            "--rounds=3",
            "--threshold",
            "2.5",
            "--warm-up-time=0.5",
            "--measurement-time",
            "4",
            "--output",
            "t.md",
        ])
        .unwrap();
        assert_eq!(parsed.compare.as_deref(), Some("origin/main"));
        assert_eq!((parsed.rounds, parsed.threshold_pct), (3, 2.5));
        assert_eq!((parsed.warm_up_secs, parsed.measurement_secs), (0.5, 4.0));
        assert_eq!(parsed.output, Some(PathBuf::from("t.md")));
        assert!(bench(&["--gpu"]).unwrap().gpu);
        assert!(bench(&["--ort"]).unwrap().ort);
        assert!(rejected(&["bench", "--ort", "--gpu"]).contains("--ort"));
    }

    #[test]
    fn bench_passes_everything_after_the_separator_to_criterion() {
        let parsed = bench(&["--", "--sample-size", "10", "binding"]).unwrap();
        assert_eq!(parsed.criterion_args, ["--sample-size", "10", "binding"]);
    }

    #[test]
    fn compare_flags_without_compare_are_rejected_by_name() {
        for flag in [&["--rounds", "3"][..], &["--threshold", "5"]] {
            let message = rejected(&[&["bench"], flag].concat());
            assert!(message.contains(flag[0]) && message.contains("--compare"), "{message}");
        }
        assert!(rejected(&["bench", "--compare", "main", "--gpu"]).contains("--gpu"));
    }

    #[test]
    fn bench_rejects_bad_values_saying_what_it_expects() {
        assert!(rejected(&["bench", "--compare", "main", "--rounds", "0"]).contains("--rounds"));
        assert!(rejected(&["bench", "--compare", "main", "--threshold", "-1"]).contains("0 or more"));
        assert!(rejected(&["bench", "--warm-up-time", "0"]).contains("above 0"));
        assert!(rejected(&["bench", "--measurement-time", "soon"]).contains("expects a number"));
        assert!(rejected(&["bench", "--output="]).contains("file path"));
        assert!(rejected(&["bench", "--compare="]).contains("git revision"));
    }

    #[test]
    fn stress_and_fuzz_take_a_positive_whole_number_of_seconds() {
        assert_eq!(parse_str(&["stress"]).unwrap(), Command::Stress(Stress { secs: 30 }));
        assert_eq!(parse_str(&["stress", "--secs", "5"]).unwrap(), Command::Stress(Stress { secs: 5 }));
        assert_eq!(parse_str(&["fuzz"]).unwrap(), Command::Fuzz(Fuzz { secs: 60 }));
        assert_eq!(parse_str(&["fuzz", "--secs=90"]).unwrap(), Command::Fuzz(Fuzz { secs: 90 }));
        assert!(rejected(&["stress", "--secs", "0"]).contains("--secs"));
        assert!(rejected(&["fuzz", "--secs", "x"]).contains("--secs"));
        assert!(rejected(&["miri", "--fast"]).contains("--fast"));
    }

    #[test]
    fn budget_judges_by_default_and_updates_when_asked() {
        assert_eq!(parse_str(&["budget"]).unwrap(), Command::Budget(Budget { update: false }));
        assert_eq!(parse_str(&["budget", "--update"]).unwrap(), Command::Budget(Budget { update: true }));
        assert!(rejected(&["budget", "--write"]).contains("--write"));
    }

    #[test]
    fn mutants_takes_an_optional_file() {
        assert_eq!(parse_str(&["mutants"]).unwrap(), Command::Mutants(Mutants { file: None }));
        let file = "crates/memory-binding/src/binding.rs";
        assert_eq!(
            parse_str(&["mutants", "--file", file]).unwrap(),
            Command::Mutants(Mutants { file: Some(PathBuf::from(file)) })
        );
    }

    #[test]
    fn help_names_every_command_and_flag() {
        let help = parse_str(&["--help"]).unwrap_err();
        assert_eq!(help.kind(), ErrorKind::DisplayHelp);
        let text = help.to_string();
        for command in ["test", "loom", "bench", "budget", "stress", "miri", "fuzz", "mutants", "demo"] {
            assert!(text.contains(command), "help lacks `{command}`:\n{text}");
        }
        let bench_help = parse_str(&["bench", "--help"]).unwrap_err().to_string();
        for flag in
            ["--compare", "--rounds", "--threshold", "--warm-up-time", "--measurement-time", "--output", "--gpu"]
        {
            assert!(bench_help.contains(flag), "bench help lacks `{flag}`:\n{bench_help}");
        }
    }

    #[test]
    fn missing_and_unknown_commands_are_errors_with_a_hint() {
        assert!(parse_str(&[]).is_err());
        assert!(rejected(&["deploy"]).contains("deploy"));
    }
}
