//! Typed command-line flags, parsed by hand (the shape follows rust-analyzer's
//! `xtask/src/flags.rs`: one struct per command, one enum over the commands).
//!
//! Adding a command means adding a variant, a struct, a `match` arm in [`parse`] and a
//! line in [`HELP`]; the unit tests below pin every accepted and rejected form.

use std::ffi::OsString;

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
    bench                     runs the criterion benches (cargo bench -p memory-benches)
    demo [ARGS...]            runs the demo (cargo run --release -p memory-demo -- ARGS...)
    help                      prints this text
";

/// Default `LOOM_MAX_PREEMPTIONS` for `cargo xtask loom`.
pub(crate) const DEFAULT_LOOM_PREEMPTIONS: u32 = 3;

/// One parsed invocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Command {
    /// `cargo xtask test`.
    Test(Test),
    /// `cargo xtask loom`.
    Loom(Loom),
    /// `cargo xtask bench`.
    Bench,
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
    #[error("unknown command `{0}`; expected test, loom, bench, demo or help (see `cargo xtask help`)")]
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
    #[error("`{flag}` needs a value, for example `{flag} 2`")]
    MissingValue {
        /// The flag.
        flag: &'static str,
    },
    /// A flag's value is not a whole number.
    #[error("`{flag}` expects a whole number, got `{value}`")]
    NotANumber {
        /// The flag.
        flag: &'static str,
        /// What was given.
        value: String,
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
        "bench" => match args.next() {
            None => Ok(Command::Bench),
            Some(arg) => Err(FlagError::UnexpectedArgument { command: "bench", arg }),
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
    const FLAG: &str = "--preemptions";
    let mut loom = Loom::default();
    while let Some(arg) = args.next() {
        let value = if arg == FLAG {
            args.next().ok_or(FlagError::MissingValue { flag: FLAG })?
        } else if let Some(value) = arg.strip_prefix("--preemptions=") {
            value.to_owned()
        } else {
            return Err(FlagError::UnexpectedArgument { command: "loom", arg });
        };
        loom.preemptions = value.parse().map_err(|_| FlagError::NotANumber { flag: FLAG, value })?;
    }
    Ok(loom)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(args: &[&str]) -> Result<Command, FlagError> {
        parse(args.iter().map(OsString::from))
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
        assert_eq!(parse_str(&["loom", "--preemptions"]), Err(FlagError::MissingValue { flag: "--preemptions" }));
        assert_eq!(
            parse_str(&["loom", "--preemptions", "many"]),
            Err(FlagError::NotANumber { flag: "--preemptions", value: "many".into() })
        );
        assert_eq!(
            parse_str(&["loom", "--preemptions=-1"]),
            Err(FlagError::NotANumber { flag: "--preemptions", value: "-1".into() })
        );
        assert!(matches!(parse_str(&["loom", "--gpu"]), Err(FlagError::UnexpectedArgument { command: "loom", .. })));
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
    fn bench_and_help_take_no_arguments() {
        assert_eq!(parse_str(&["bench"]), Ok(Command::Bench));
        assert!(matches!(parse_str(&["bench", "--compare"]), Err(FlagError::UnexpectedArgument { .. })));
        assert_eq!(parse_str(&["help"]), Ok(Command::Help));
        assert_eq!(parse_str(&["--help"]), Ok(Command::Help));
        assert_eq!(parse_str(&["-h"]), Ok(Command::Help));
    }

    #[test]
    fn missing_and_unknown_commands_are_errors_with_a_hint() {
        assert_eq!(parse_str(&[]), Err(FlagError::MissingCommand));
        let err = parse_str(&["tset"]).unwrap_err();
        assert_eq!(err, FlagError::UnknownCommand("tset".into()));
        assert!(err.to_string().contains("cargo xtask help"), "{err}");
    }

    #[cfg(unix)]
    #[test]
    fn non_utf8_arguments_are_rejected() {
        use std::os::unix::ffi::OsStringExt;
        let bad = OsString::from_vec(vec![0x66, 0xff]);
        assert_eq!(parse([OsString::from("demo"), bad.clone()]), Err(FlagError::NotUtf8(bad)));
    }
}
