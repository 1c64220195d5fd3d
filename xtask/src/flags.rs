//! Typed command-line flags, parsed by hand (the shape follows rust-analyzer's
//! `xtask/src/flags.rs`: one struct per command, one enum over the commands).
//!
//! Adding a command means adding a variant, a struct, a `match` arm in [`parse`] and a
//! line in [`HELP`]; the unit tests below pin every accepted and rejected form.

use std::ffi::OsString;
use std::path::PathBuf;

/// `cargo xtask help` text.
pub(crate) const HELP: &str = "\
cargo xtask: project automation for the device-memory workspace

USAGE:
    cargo xtask <COMMAND> [FLAGS]

COMMANDS:
    test [--gpu]              fmt, architecture tidy, clippy, all tests and docs (as CI runs them);
                              --gpu first probes for a CUDA device, then also runs the GPU-gated
                              tests of allocator-cuda and fails if none ran
    loom [--preemptions N]    loom models (tests named *loom*) of memory-binding and memory-governor,
                              built with --cfg memory_loom in target/loom; N bounds preemptions
                              (LOOM_MAX_PREEMPTIONS, default 3)
    bench [FLAGS] [-- CRITERION_ARGS...]
                              runs every criterion bench of memory-benches with short settings, then
                              prints one table of the ratios measured in that run (bound vs raw
                              allocator, bind, 1 vs 2 threads, live allocations, lease, governed vs
                              bound, pooled vs system, virtual commit) against the issues' targets;
                              fails if a result the table needs is missing
        --warm-up-time SECS       criterion warm-up per bench (default 1)
        --measurement-time SECS   criterion measurement per bench (default 2); pass more for
                                  steadier figures
        --output PATH             also writes the table (markdown) to PATH
        --compare REV             instead: builds the benches at REV (a git worktree under the
                                  target dir, removed afterwards) and at the working tree, runs
                                  them alternately on this machine and prints a markdown table of
                                  each bench's change (median of the candidate runs vs median of
                                  the baseline runs), then the targets table of the candidate
        --ort                     instead: fetches ONNX Runtime and the real models, then per model
                                  p50/p99 latency and peak RSS of ORT's arena, no arena, governed
                                  pool and governed system allocator, alternating, each in its own
                                  process, as ratios against the arena (args after -- go to
                                  ort-bench: --rounds N --vad-iters N --ocr-iters N)
        --gpu                     instead: probes for a CUDA device (fails without one), then runs
                                  the CUDA bench (eager vs pool vs VMM allocate+release from 4 KiB
                                  to 1 GiB, VMM commit per granule) and its ratio table
        --rounds N                with --compare: runs of each side (default 2)
        --threshold PCT           with --compare: changes within +-PCT% (default 5), or within the
                                  spread of one side's own runs, are marked \"~ noise\"
        -- CRITERION_ARGS...      passed to every bench binary (a name filter leaves table rows
                                  missing)
    stress [--secs N]         the bounded stress tests for N seconds (default 30):
                              MEMORY_STRESS_SECS=N cargo test --release -p memory-binding --test stress;
                              repeats their ops/s lines at the end
    miri                      the unsafe-bearing crates' tests under Miri on the nightly toolchain
                              (bash scripts/miri.sh; installs the component if missing; not in CI)
    fuzz [--secs N]           the registry_ops fuzz target for N seconds (default 60) on nightly:
                              cargo +nightly fuzz run registry_ops (fuzz/ is outside the workspace)
    demo [ARGS...]            runs the demo (cargo run --release -p memory-demo -- ARGS...); with --ort
                              first fetches ONNX Runtime and the real models (two tenants on
                              Silero VAD and PP-OCRv4 through governed allocators)
    help                      prints this text
";

/// Default `LOOM_MAX_PREEMPTIONS` for `cargo xtask loom`.
pub(crate) const DEFAULT_LOOM_PREEMPTIONS: u32 = 3;

/// Default criterion warm-up per bench for `cargo xtask bench`, in seconds.
pub(crate) const DEFAULT_WARM_UP_SECS: f64 = 1.0;

/// Default criterion measurement time per bench for `cargo xtask bench`, in seconds.
/// With the warm-up, the 24 benches of memory-benches take about two minutes.
pub(crate) const DEFAULT_MEASUREMENT_SECS: f64 = 2.0;

/// Default runs of each side for `cargo xtask bench --compare`.
pub(crate) const DEFAULT_ROUNDS: u32 = 2;

/// Default noise threshold of `cargo xtask bench --compare`, in percent.
pub(crate) const DEFAULT_THRESHOLD_PCT: f64 = 5.0;

/// Default `MEMORY_STRESS_SECS` for `cargo xtask stress`.
pub(crate) const DEFAULT_STRESS_SECS: u64 = 30;

/// One parsed invocation.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Command {
    /// `cargo xtask test`.
    Test(Test),
    /// `cargo xtask loom`.
    Loom(Loom),
    /// `cargo xtask bench`.
    Bench(Bench),
    /// `cargo xtask stress`.
    Stress(Stress),
    /// `cargo xtask miri`.
    Miri,
    /// `cargo xtask fuzz`.
    Fuzz(Fuzz),
    /// `cargo xtask demo`.
    Demo(Demo),
    /// `cargo xtask help`.
    Help,
}

/// Flags of `cargo xtask test`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Test {
    /// Also probe for a CUDA device and run the GPU-gated tests.
    pub(crate) gpu: bool,
}

/// Flags of `cargo xtask loom`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Loom {
    /// `LOOM_MAX_PREEMPTIONS` for the run.
    pub(crate) preemptions: u32,
}

impl Default for Loom {
    fn default() -> Loom {
        Loom { preemptions: DEFAULT_LOOM_PREEMPTIONS }
    }
}

/// Flags of `cargo xtask bench`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Bench {
    /// `--compare REV`: the git revision to compare the working tree with.
    pub(crate) compare: Option<String>,
    /// `--rounds N` (only with `--compare`): runs of each side, at least 1.
    pub(crate) rounds: u32,
    /// `--threshold PCT` (only with `--compare`): changes within this many percent are noise.
    pub(crate) threshold_pct: f64,
    /// `--warm-up-time SECS` for every bench.
    pub(crate) warm_up_secs: f64,
    /// `--measurement-time SECS` for every bench.
    pub(crate) measurement_secs: f64,
    /// `--output PATH`: where the markdown table is written too.
    pub(crate) output: Option<PathBuf>,
    /// Everything after `--`, passed to every bench binary.
    pub(crate) criterion_args: Vec<String>,
    /// `--gpu`: probe for a CUDA device, then run only the CUDA latency bench (eager vs
    /// pool vs VMM across sizes, VMM commit per granule), which prints its own table.
    pub(crate) gpu: bool,
    /// `--ort`: fetch the real models and run the ONNX Runtime allocator bench.
    pub(crate) ort: bool,
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

/// Flags of `cargo xtask stress`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Stress {
    /// `MEMORY_STRESS_SECS` for the run, at least 1.
    pub(crate) secs: u64,
}

impl Default for Stress {
    fn default() -> Stress {
        Stress { secs: DEFAULT_STRESS_SECS }
    }
}

/// Default `--secs` of `cargo xtask fuzz`.
pub(crate) const DEFAULT_FUZZ_SECS: u64 = 60;

/// Flags of `cargo xtask fuzz`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Fuzz {
    /// libFuzzer's `-max_total_time`, at least 1.
    pub(crate) secs: u64,
}

impl Default for Fuzz {
    fn default() -> Fuzz {
        Fuzz { secs: DEFAULT_FUZZ_SECS }
    }
}

/// Arguments of `cargo xtask demo`, passed to the demo binary untouched.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Demo {
    /// Everything after `demo` (a leading `--` is dropped).
    pub(crate) args: Vec<String>,
}

/// Why the command line was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FlagError {
    /// No command at all.
    #[error("no command given; run `cargo xtask help` for the list")]
    MissingCommand,
    /// A command xtask does not know.
    #[error(
        "unknown command `{0}`; expected test, loom, bench, stress, miri, fuzz, demo or help (see `cargo xtask help`)"
    )]
    UnknownCommand(String),
    /// A flag or argument the command does not take.
    #[error("`cargo xtask {command}` does not take `{arg}`; see `cargo xtask help`")]
    UnexpectedArgument {
        /// The command being parsed.
        command: &'static str,
        /// The offending argument.
        arg: String,
    },
    /// A flag that needs a value came last.
    #[error("`{flag}` needs a value, for example `{flag} {example}`")]
    MissingValue {
        /// The flag.
        flag: &'static str,
        /// A value it would accept.
        example: &'static str,
    },
    /// A flag's value is not a whole number.
    #[error("`{flag}` expects a whole number, got `{value}`")]
    NotANumber {
        /// The flag.
        flag: &'static str,
        /// What was given.
        value: String,
    },
    /// A flag's value parses but is outside what the flag accepts.
    #[error("`{flag}` expects {expected}, got `{value}`")]
    BadValue {
        /// The flag.
        flag: &'static str,
        /// What was given.
        value: String,
        /// What the flag accepts, in words.
        expected: &'static str,
    },
    /// A flag of `bench --compare` given without `--compare`.
    #[error("`{flag}` only applies to `cargo xtask bench --compare REV`; add `--compare REV` or drop `{flag}`")]
    NeedsCompare {
        /// The flag.
        flag: &'static str,
    },
    /// An argument is not valid UTF-8.
    #[error("argument {0:?} is not valid UTF-8")]
    NotUtf8(OsString),
}

/// Parses the arguments after `cargo xtask` (the program name already removed).
pub(crate) fn parse<I>(args: I) -> Result<Command, FlagError>
where
    I: IntoIterator<Item = OsString>,
{
    let args: Vec<String> =
        args.into_iter().map(|arg| arg.into_string().map_err(FlagError::NotUtf8)).collect::<Result<_, _>>()?;
    let mut args = args.into_iter();
    let Some(command) = args.next() else { return Err(FlagError::MissingCommand) };
    match command.as_str() {
        "test" => parse_test(args).map(Command::Test),
        "loom" => parse_loom(args).map(Command::Loom),
        "bench" => parse_bench(args).map(Command::Bench),
        "stress" => parse_stress(args).map(Command::Stress),
        "fuzz" => parse_secs("fuzz", args, DEFAULT_FUZZ_SECS).map(|secs| Command::Fuzz(Fuzz { secs })),
        "miri" => match args.next() {
            None => Ok(Command::Miri),
            Some(arg) => Err(FlagError::UnexpectedArgument { command: "miri", arg }),
        },
        "demo" => {
            let mut rest: Vec<String> = args.collect();
            if rest.first().is_some_and(|first| first == "--") {
                rest.remove(0);
            }
            Ok(Command::Demo(Demo { args: rest }))
        }
        "help" | "--help" | "-h" => match args.next() {
            None => Ok(Command::Help),
            Some(arg) => Err(FlagError::UnexpectedArgument { command: "help", arg }),
        },
        _ => Err(FlagError::UnknownCommand(command)),
    }
}

/// A flag that takes a value, as `--flag VALUE` or `--flag=VALUE`.
struct ValueFlag {
    name: &'static str,
    example: &'static str,
}

impl ValueFlag {
    /// The value when `arg` is this flag (taking the next argument for the spaced form),
    /// `Ok(None)` when it is another argument.
    fn value(&self, arg: &str, rest: &mut impl Iterator<Item = String>) -> Result<Option<String>, FlagError> {
        if arg == self.name {
            return rest.next().map(Some).ok_or(FlagError::MissingValue { flag: self.name, example: self.example });
        }
        Ok(arg.strip_prefix(self.name).and_then(|tail| tail.strip_prefix('=')).map(str::to_owned))
    }
}

const PREEMPTIONS: ValueFlag = ValueFlag { name: "--preemptions", example: "2" };
const COMPARE: ValueFlag = ValueFlag { name: "--compare", example: "origin/main" };
const ROUNDS: ValueFlag = ValueFlag { name: "--rounds", example: "3" };
const THRESHOLD: ValueFlag = ValueFlag { name: "--threshold", example: "5" };
const WARM_UP: ValueFlag = ValueFlag { name: "--warm-up-time", example: "1" };
const MEASUREMENT: ValueFlag = ValueFlag { name: "--measurement-time", example: "5" };
const OUTPUT: ValueFlag = ValueFlag { name: "--output", example: "bench.md" };
const SECS: ValueFlag = ValueFlag { name: "--secs", example: "30" };

fn parse_test(args: impl Iterator<Item = String>) -> Result<Test, FlagError> {
    let mut test = Test::default();
    for arg in args {
        match arg.as_str() {
            "--gpu" => test.gpu = true,
            _ => return Err(FlagError::UnexpectedArgument { command: "test", arg }),
        }
    }
    Ok(test)
}

fn parse_loom(mut args: impl Iterator<Item = String>) -> Result<Loom, FlagError> {
    let mut loom = Loom::default();
    while let Some(arg) = args.next() {
        let Some(value) = PREEMPTIONS.value(&arg, &mut args)? else {
            return Err(FlagError::UnexpectedArgument { command: "loom", arg });
        };
        loom.preemptions = whole_number(PREEMPTIONS.name, value)?;
    }
    Ok(loom)
}

fn parse_bench(mut args: impl Iterator<Item = String>) -> Result<Bench, FlagError> {
    let mut bench = Bench::default();
    // Flags of `--compare` seen, to reject them when `--compare` is absent.
    let mut compare_only: Option<&'static str> = None;
    while let Some(arg) = args.next() {
        if arg == "--" {
            bench.criterion_args = args.by_ref().collect();
            break;
        }
        if let Some(value) = COMPARE.value(&arg, &mut args)? {
            if value.is_empty() || value.starts_with('-') {
                return Err(FlagError::BadValue {
                    flag: COMPARE.name,
                    value,
                    expected: "a git revision (a branch, tag or commit such as origin/main or HEAD~1)",
                });
            }
            bench.compare = Some(value);
        } else if let Some(value) = ROUNDS.value(&arg, &mut args)? {
            bench.rounds = whole_number(ROUNDS.name, value.clone())?;
            if bench.rounds == 0 {
                return Err(FlagError::BadValue { flag: ROUNDS.name, value, expected: "at least 1 round" });
            }
            compare_only.get_or_insert(ROUNDS.name);
        } else if let Some(value) = THRESHOLD.value(&arg, &mut args)? {
            bench.threshold_pct = number(THRESHOLD.name, value, 0.0, "a percentage of 0 or more, such as 5 or 2.5")?;
            compare_only.get_or_insert(THRESHOLD.name);
        } else if let Some(value) = WARM_UP.value(&arg, &mut args)? {
            bench.warm_up_secs = seconds(WARM_UP.name, value)?;
        } else if let Some(value) = MEASUREMENT.value(&arg, &mut args)? {
            bench.measurement_secs = seconds(MEASUREMENT.name, value)?;
        } else if arg == "--gpu" {
            bench.gpu = true;
        } else if arg == "--ort" {
            bench.ort = true;
        } else if let Some(value) = OUTPUT.value(&arg, &mut args)? {
            if value.is_empty() {
                return Err(FlagError::BadValue { flag: OUTPUT.name, value, expected: "a file path" });
            }
            bench.output = Some(PathBuf::from(value));
        } else {
            return Err(FlagError::UnexpectedArgument { command: "bench", arg });
        }
    }
    if bench.gpu && bench.compare.is_some() {
        // The GPU bench prints its own table; comparing revisions on a GPU is a later step.
        return Err(FlagError::UnexpectedArgument { command: "bench --compare", arg: "--gpu".into() });
    }
    if bench.ort && (bench.gpu || bench.compare.is_some()) {
        // The ONNX Runtime bench prints its own table and runs alone.
        return Err(FlagError::UnexpectedArgument { command: "bench --ort", arg: "--gpu or --compare".into() });
    }
    match compare_only {
        Some(flag) if bench.compare.is_none() => Err(FlagError::NeedsCompare { flag }),
        _ => Ok(bench),
    }
}

fn parse_stress(args: impl Iterator<Item = String>) -> Result<Stress, FlagError> {
    parse_secs("stress", args, DEFAULT_STRESS_SECS).map(|secs| Stress { secs })
}

/// Parses commands whose only flag is `--secs N` (N at least 1).
fn parse_secs(command: &'static str, mut args: impl Iterator<Item = String>, default: u64) -> Result<u64, FlagError> {
    let mut secs = default;
    while let Some(arg) = args.next() {
        let Some(value) = SECS.value(&arg, &mut args)? else {
            return Err(FlagError::UnexpectedArgument { command, arg });
        };
        secs = whole_number(SECS.name, value.clone())?;
        if secs == 0 {
            return Err(FlagError::BadValue { flag: SECS.name, value, expected: "at least 1 second" });
        }
    }
    Ok(secs)
}

fn whole_number<T: std::str::FromStr>(flag: &'static str, value: String) -> Result<T, FlagError> {
    value.parse().map_err(|_| FlagError::NotANumber { flag, value })
}

/// A finite number of at least `min`.
fn number(flag: &'static str, value: String, min: f64, expected: &'static str) -> Result<f64, FlagError> {
    match value.parse::<f64>() {
        Ok(number) if number.is_finite() && number >= min => Ok(number),
        _ => Err(FlagError::BadValue { flag, value, expected }),
    }
}

/// A positive, finite number of seconds of at most a day (criterion takes `f64` seconds).
fn seconds(flag: &'static str, value: String) -> Result<f64, FlagError> {
    const EXPECTED: &str = "a number of seconds above 0 and at most 86400, such as 2 or 0.5";
    match value.parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs > 0.0 && secs <= 86_400.0 => Ok(secs),
        _ => Err(FlagError::BadValue { flag, value, expected: EXPECTED }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(args: &[&str]) -> Result<Command, FlagError> {
        parse(args.iter().map(OsString::from))
    }

    fn bench(args: &[&str]) -> Result<Bench, FlagError> {
        let mut all = vec!["bench"];
        all.extend_from_slice(args);
        parse_str(&all).map(|command| match command {
            Command::Bench(bench) => bench,
            other => panic!("bench parsed as {other:?}"),
        })
    }

    #[test]
    fn test_command_takes_only_the_gpu_flag() {
        assert_eq!(parse_str(&["test"]), Ok(Command::Test(Test { gpu: false })));
        assert_eq!(parse_str(&["test", "--gpu"]), Ok(Command::Test(Test { gpu: true })));
        assert_eq!(
            parse_str(&["test", "--cpu"]),
            Err(FlagError::UnexpectedArgument { command: "test", arg: "--cpu".into() })
        );
        assert_eq!(
            parse_str(&["test", "gpu"]),
            Err(FlagError::UnexpectedArgument { command: "test", arg: "gpu".into() })
        );
    }

    #[test]
    fn loom_preemptions_default_to_three_and_accept_both_spellings() {
        assert_eq!(parse_str(&["loom"]), Ok(Command::Loom(Loom { preemptions: 3 })));
        assert_eq!(parse_str(&["loom", "--preemptions", "2"]), Ok(Command::Loom(Loom { preemptions: 2 })));
        assert_eq!(parse_str(&["loom", "--preemptions=5"]), Ok(Command::Loom(Loom { preemptions: 5 })));
    }

    #[test]
    fn loom_rejects_missing_or_non_numeric_preemptions() {
        assert_eq!(
            parse_str(&["loom", "--preemptions"]),
            Err(FlagError::MissingValue { flag: "--preemptions", example: "2" })
        );
        assert_eq!(
            parse_str(&["loom", "--preemptions", "many"]),
            Err(FlagError::NotANumber { flag: "--preemptions", value: "many".into() })
        );
        assert_eq!(
            parse_str(&["loom", "--preemptions=-1"]),
            Err(FlagError::NotANumber { flag: "--preemptions", value: "-1".into() })
        );
        assert!(matches!(parse_str(&["loom", "--gpu"]), Err(FlagError::UnexpectedArgument { command: "loom", .. })));
        // A prefix of the flag is not the flag.
        assert!(matches!(
            parse_str(&["loom", "--preemptionsx=2"]),
            Err(FlagError::UnexpectedArgument { command: "loom", .. })
        ));
    }

    #[test]
    fn demo_passes_everything_through_and_drops_a_leading_separator() {
        assert_eq!(parse_str(&["demo"]), Ok(Command::Demo(Demo { args: vec![] })));
        assert_eq!(
            parse_str(&["demo", "--help", "x"]),
            Ok(Command::Demo(Demo { args: vec!["--help".into(), "x".into()] }))
        );
        assert_eq!(parse_str(&["demo", "--", "--help"]), Ok(Command::Demo(Demo { args: vec!["--help".into()] })));
        assert_eq!(parse_str(&["demo", "a", "--"]), Ok(Command::Demo(Demo { args: vec!["a".into(), "--".into()] })));
    }

    #[test]
    fn bench_defaults_are_short_settings_without_compare() {
        let plain = bench(&[]).unwrap();
        assert_eq!(plain, Bench::default());
        assert_eq!(plain.compare, None);
        assert_eq!((plain.warm_up_secs, plain.measurement_secs), (1.0, 2.0));
        assert_eq!((plain.rounds, plain.threshold_pct), (2, 5.0));
        assert_eq!(plain.output, None);
        assert!(plain.criterion_args.is_empty());
    }

    #[test]
    fn bench_accepts_every_flag_in_both_spellings() {
        let spaced = bench(&[
            "--compare",
            "origin/main",
            "--rounds",
            "3",
            "--threshold",
            "2.5",
            "--warm-up-time",
            "0.5",
            "--measurement-time",
            "10",
            "--output",
            "bench.md",
        ])
        .unwrap();
        let joined = bench(&[
            "--compare=origin/main",
            "--rounds=3",
            "--threshold=2.5",
            "--warm-up-time=0.5",
            "--measurement-time=10",
            "--output=bench.md",
        ])
        .unwrap();
        let expected = Bench {
            compare: Some("origin/main".into()),
            rounds: 3,
            threshold_pct: 2.5,
            warm_up_secs: 0.5,
            measurement_secs: 10.0,
            output: Some(PathBuf::from("bench.md")),
            criterion_args: vec![],
            gpu: false,
            ort: false,
        };
        assert_eq!(spaced, expected);
        assert_eq!(joined, expected);
    }

    #[test]
    fn bench_passes_everything_after_the_separator_to_criterion() {
        let parsed = bench(&["--measurement-time", "3", "--", "pair", "--rounds", "--"]).unwrap();
        assert_eq!(parsed.measurement_secs, 3.0);
        assert_eq!(parsed.criterion_args, ["pair", "--rounds", "--"]);
        assert_eq!(parsed.rounds, DEFAULT_ROUNDS, "flags after -- are criterion's, not xtask's");
    }

    #[test]
    fn compare_flags_without_compare_are_rejected_by_name() {
        assert_eq!(bench(&["--rounds", "3"]), Err(FlagError::NeedsCompare { flag: "--rounds" }));
        assert_eq!(bench(&["--threshold=1"]), Err(FlagError::NeedsCompare { flag: "--threshold" }));
        let err = bench(&["--rounds", "3"]).unwrap_err().to_string();
        assert!(err.contains("--compare REV"), "{err}");
        // The order of the flags does not matter.
        assert_eq!(bench(&["--rounds", "3", "--compare", "HEAD"]).unwrap().rounds, 3);
        // --output works with and without --compare.
        assert!(bench(&["--output", "t.md"]).is_ok());
    }

    #[test]
    fn bench_rejects_bad_values_saying_what_it_expects() {
        let cases: [(&[&str], &str); 10] = [
            (&["--rounds", "0", "--compare", "HEAD"], "at least 1 round"),
            (&["--threshold", "-1", "--compare", "HEAD"], "a percentage"),
            (&["--threshold", "NaN", "--compare", "HEAD"], "a percentage"),
            (&["--threshold", "inf", "--compare", "HEAD"], "a percentage"),
            (&["--warm-up-time", "0"], "above 0"),
            (&["--measurement-time", "-2"], "above 0"),
            (&["--measurement-time", "fast"], "a number of seconds"),
            (&["--measurement-time", "1e9"], "at most 86400"),
            (&["--compare", "--rounds"], "a git revision"),
            (&["--output="], "a file path"),
        ];
        for (args, expected) in cases {
            let err = bench(args).expect_err(&format!("{args:?} must be rejected"));
            assert!(matches!(err, FlagError::BadValue { .. }), "{args:?}: {err:?}");
            assert!(err.to_string().contains(expected), "{args:?}: {err}");
        }
        assert_eq!(
            bench(&["--rounds", "two", "--compare", "HEAD"]),
            Err(FlagError::NotANumber { flag: "--rounds", value: "two".into() })
        );
        assert_eq!(bench(&["--compare"]), Err(FlagError::MissingValue { flag: "--compare", example: "origin/main" }));
        assert_eq!(
            bench(&["--measurement-time"]),
            Err(FlagError::MissingValue { flag: "--measurement-time", example: "5" })
        );
        assert_eq!(bench(&["--quick"]), Err(FlagError::UnexpectedArgument { command: "bench", arg: "--quick".into() }));
        assert_eq!(bench(&["pair"]), Err(FlagError::UnexpectedArgument { command: "bench", arg: "pair".into() }));
    }

    #[test]
    fn stress_defaults_to_thirty_seconds_and_takes_a_positive_whole_number() {
        assert_eq!(parse_str(&["stress"]), Ok(Command::Stress(Stress { secs: 30 })));
        assert_eq!(parse_str(&["stress", "--secs", "300"]), Ok(Command::Stress(Stress { secs: 300 })));
        assert_eq!(parse_str(&["stress", "--secs=5"]), Ok(Command::Stress(Stress { secs: 5 })));
        assert_eq!(parse_str(&["stress", "--secs"]), Err(FlagError::MissingValue { flag: "--secs", example: "30" }));
        assert_eq!(
            parse_str(&["stress", "--secs", "1.5"]),
            Err(FlagError::NotANumber { flag: "--secs", value: "1.5".into() })
        );
        let zero = parse_str(&["stress", "--secs", "0"]).unwrap_err();
        assert!(zero.to_string().contains("at least 1 second"), "{zero}");
        assert_eq!(
            parse_str(&["stress", "30"]),
            Err(FlagError::UnexpectedArgument { command: "stress", arg: "30".into() })
        );
    }

    #[test]
    fn bench_ort_is_a_flag_of_its_own() {
        let Ok(Command::Bench(bench)) = parse_str(&["bench", "--ort", "--", "--rounds", "2"]) else {
            panic!("bench --ort parses")
        };
        assert!(bench.ort && bench.criterion_args == ["--rounds", "2"]);
        assert!(parse_str(&["bench", "--ort", "--gpu"]).is_err());
        assert!(parse_str(&["bench", "--ort", "--compare", "HEAD~1"]).is_err());
    }

    #[test]
    fn bench_gpu_is_a_flag_of_its_own() {
        let Ok(Command::Bench(bench)) = parse_str(&["bench", "--gpu"]) else { panic!("bench --gpu parses") };
        assert!(bench.gpu);
        assert!(parse_str(&["bench", "--gpu", "--compare", "HEAD~1"]).is_err());
    }

    #[test]
    fn fuzz_defaults_to_a_minute_and_miri_takes_no_arguments() {
        assert_eq!(parse_str(&["fuzz"]), Ok(Command::Fuzz(Fuzz { secs: 60 })));
        assert_eq!(parse_str(&["fuzz", "--secs", "600"]), Ok(Command::Fuzz(Fuzz { secs: 600 })));
        assert!(parse_str(&["fuzz", "--secs", "0"]).unwrap_err().to_string().contains("at least 1 second"));
        assert_eq!(parse_str(&["fuzz", "x"]), Err(FlagError::UnexpectedArgument { command: "fuzz", arg: "x".into() }));
        assert_eq!(parse_str(&["miri"]), Ok(Command::Miri));
        assert_eq!(
            parse_str(&["miri", "-p"]),
            Err(FlagError::UnexpectedArgument { command: "miri", arg: "-p".into() })
        );
    }

    #[test]
    fn help_takes_no_arguments() {
        assert_eq!(parse_str(&["help"]), Ok(Command::Help));
        assert_eq!(parse_str(&["--help"]), Ok(Command::Help));
        assert_eq!(parse_str(&["-h"]), Ok(Command::Help));
        assert!(matches!(parse_str(&["help", "bench"]), Err(FlagError::UnexpectedArgument { command: "help", .. })));
    }

    #[test]
    fn help_text_names_every_command_and_flag() {
        for word in [
            "test [--gpu]",
            "loom [--preemptions N]",
            "bench [FLAGS]",
            "--warm-up-time",
            "--measurement-time",
            "--output",
            "--compare REV",
            "--rounds",
            "--threshold",
            "stress [--secs N]",
            "MEMORY_STRESS_SECS",
            "demo [ARGS...]",
            "miri",
            "fuzz [--secs N]",
            "help",
        ] {
            assert!(HELP.contains(word), "help text lacks {word}");
        }
    }

    #[test]
    fn missing_and_unknown_commands_are_errors_with_a_hint() {
        assert_eq!(parse_str(&[]), Err(FlagError::MissingCommand));
        let err = parse_str(&["tset"]).unwrap_err();
        assert_eq!(err, FlagError::UnknownCommand("tset".into()));
        assert!(err.to_string().contains("cargo xtask help"), "{err}");
        assert!(err.to_string().contains("stress"), "{err}");
    }

    #[cfg(unix)]
    #[test]
    fn non_utf8_arguments_are_rejected() {
        use std::os::unix::ffi::OsStringExt;
        let bad = OsString::from_vec(vec![0x66, 0xff]);
        assert_eq!(parse([OsString::from("demo"), bad.clone()]), Err(FlagError::NotUtf8(bad)));
    }
}
