//! Steps and the runner that executes a list of them.
//!
//! A task (`test`, `loom`, `stress`) is a `Vec<Step>`: a name, a command and a
//! [`Check`] that turns the command's exit status and output into a verdict. The
//! [`Runner`] prints each step's name and command before running it, times it, stops at
//! the first failure with a message that names the step and why it failed, and ends with
//! one summary line. New steps are new entries in a list, nothing more; a task that
//! decides its next step from the last one's output (`bench --compare`) drives a
//! [`Runner`] itself.

use std::ffi::OsString;
use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::libtest::{TestCounts, parse_device_count, parse_test_results};

/// A command line: program, arguments and extra environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Cmd {
    program: OsString,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// Where it runs; `None` is the project root the runner is given.
    dir: Option<PathBuf>,
}

impl Cmd {
    /// `program <args>`.
    pub(crate) fn new<I, S>(program: impl Into<OsString>, args: I) -> Cmd
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Cmd { program: program.into(), args: args.into_iter().map(Into::into).collect(), env: Vec::new(), dir: None }
    }

    /// `cargo <args>`, using the cargo that runs xtask (`$CARGO`) when there is one.
    pub(crate) fn cargo<I, S>(args: I) -> Cmd
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let program = std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
        Cmd::new(program, args)
    }

    /// `git <args>`.
    pub(crate) fn git<I, S>(args: I) -> Cmd
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Cmd::new("git", args)
    }

    /// The same command run from `dir` instead of the project root.
    #[must_use]
    pub(crate) fn current_dir(mut self, dir: impl Into<PathBuf>) -> Cmd {
        self.dir = Some(dir.into());
        self
    }

    /// The same command with `key=value` in its environment.
    #[must_use]
    pub(crate) fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Cmd {
        self.env.push((key.into(), value.into()));
        self
    }

    /// The arguments (for tests).
    #[cfg(test)]
    pub(crate) fn arg_list(&self) -> &[String] {
        &self.args
    }

    /// The value this command sets for `key`, if any (for tests).
    #[cfg(test)]
    pub(crate) fn env_value(&self, key: &str) -> Option<&str> {
        self.env.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// The directory it runs from, if not the project root (for tests).
    #[cfg(test)]
    pub(crate) fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Runs the command from `root` (or its own directory) with inherited stdio and
    /// waits for it.
    ///
    /// # Errors
    /// When the program cannot be started.
    pub(crate) fn status(&self, root: &Path) -> io::Result<ExitStatus> {
        self.command(root).status()
    }

    /// Runs the command with stdout and stderr captured (for quick queries such as
    /// `git rev-parse`, whose output is the answer, not progress).
    ///
    /// # Errors
    /// When the program cannot be started.
    pub(crate) fn output(&self, root: &Path) -> io::Result<std::process::Output> {
        self.command(root).stdin(Stdio::null()).output()
    }

    fn command(&self, root: &Path) -> Command {
        let mut command = Command::new(&self.program);
        command.args(&self.args).current_dir(self.dir.as_deref().unwrap_or(root));
        command.envs(self.env.iter().map(|(k, v)| (k, v)));
        command
    }
}

/// Shell-like rendering (`RUSTDOCFLAGS="-D warnings" cargo doc ...`), printed before a
/// step runs so that any step can be re-run by hand.
impl fmt::Display for Cmd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(dir) = &self.dir {
            write!(f, "cd {} && ", quote(&dir.to_string_lossy()))?;
        }
        for (key, value) in &self.env {
            write!(f, "{key}={} ", quote(value))?;
        }
        // Print plain `cargo` even when `$CARGO` is a full path: that is what a reader
        // types. Other programs (a copied bench binary) keep their full path.
        let path = Path::new(&self.program);
        let program = match path.file_stem() {
            Some(stem) if stem == "cargo" => "cargo".to_owned(),
            _ => self.program.to_string_lossy().into_owned(),
        };
        f.write_str(&quote(&program))?;
        for arg in &self.args {
            write!(f, " {}", quote(arg))?;
        }
        Ok(())
    }
}

fn quote(word: &str) -> String {
    if !word.is_empty() && word.chars().all(|c| c.is_ascii_alphanumeric() || "-_=./:,@+".contains(c)) {
        word.to_owned()
    } else {
        format!("\"{}\"", word.replace('\\', "\\\\").replace('"', "\\\""))
    }
}

/// How a step's result is judged.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Check {
    /// The command exits successfully.
    Success,
    /// A `cargo test` run: it exits successfully; its test counts are shown in the
    /// summary.
    Tests,
    /// The CUDA probe: it exits successfully and prints `cuda devices: N` with N > 0.
    CudaDevice,
    /// GPU-gated tests: success, none failed, and at least one passed. A GPU run that
    /// silently ran nothing is a failure.
    GpuTests,
    /// loom models: success and none failed. Zero models is a warning for now (the
    /// models arrive with issue 7), never reported as "checked".
    LoomModels,
    /// The stress tests: judged as [`Check::Tests`]; stderr is captured too, and the
    /// `ops/s` lines the tests print there are repeated after the summary. No such line
    /// is a warning (the figures the run exists for are missing).
    Stress,
    /// A cargo command with `--message-format=json-render-diagnostics`: it exits
    /// successfully; its stdout (JSON messages, not for reading) is captured for the
    /// task instead of echoed.
    CargoJson,
}

impl Check {
    /// Test counts for the summary, for checks that read libtest output.
    pub(crate) fn counts(self, stdout: &str) -> Option<TestCounts> {
        match self {
            Check::Success | Check::CudaDevice | Check::CargoJson => None,
            Check::Tests | Check::GpuTests | Check::LoomModels | Check::Stress => Some(parse_test_results(stdout)),
        }
    }

    /// Lines of the output worth repeating after the summary: the stress tests'
    /// throughput figures.
    pub(crate) fn notes(self, stderr: &str) -> Vec<String> {
        match self {
            Check::Stress => stress_figures(stderr),
            _ => Vec::new(),
        }
    }

    /// Whether the runner must capture stdout to judge the step.
    fn reads_output(self) -> bool {
        !matches!(self, Check::Success)
    }

    /// Whether the runner echoes the captured stdout as it arrives.
    fn echoes_stdout(self) -> bool {
        !matches!(self, Check::CargoJson)
    }

    /// Whether the runner must capture stderr (still echoed) for [`Check::notes`].
    fn reads_stderr(self) -> bool {
        matches!(self, Check::Stress)
    }

    /// The verdict on a finished command: `Ok(warning)` or `Err(reason)`.
    pub(crate) fn judge(self, status: &ExitStatus, stdout: &str, stderr: &str) -> Result<Option<String>, String> {
        self.judge_parts(status.success(), &status.to_string(), stdout, stderr)
    }

    fn judge_parts(self, success: bool, status: &str, stdout: &str, stderr: &str) -> Result<Option<String>, String> {
        match self {
            Check::Success | Check::Tests | Check::CargoJson if success => Ok(None),
            Check::Success | Check::CargoJson => Err(format!("the command failed ({status})")),
            Check::Stress => {
                Check::Tests.judge_parts(success, status, stdout, stderr)?;
                if stress_figures(stderr).is_empty() {
                    return Ok(Some(
                        "the stress tests printed no `ops/s` line on stderr: no figures from this run (was the \
                         stress test renamed or filtered out?)"
                            .to_owned(),
                    ));
                }
                Ok(None)
            }
            Check::Tests => {
                let counts = parse_test_results(stdout);
                match counts.failed {
                    0 => Err(format!(
                        "cargo test failed ({status}) without a failing test: a build error or a crashed test binary"
                    )),
                    failed => Err(format!("{failed} test(s) failed, {} passed; see the failures above", counts.passed)),
                }
            }
            Check::CudaDevice => {
                if !success {
                    return Err(format!(
                        "the CUDA probe failed ({status}): no usable CUDA driver (see its message above); \
                         `cargo xtask test --gpu` needs a machine with an NVIDIA driver and a GPU, \
                         use `cargo xtask test` elsewhere"
                    ));
                }
                match parse_device_count(stdout) {
                    Some(0) => Err("the CUDA driver reports 0 devices (cuda devices: 0); \
                                    `cargo xtask test --gpu` needs at least one GPU"
                        .to_owned()),
                    Some(_) => Ok(None),
                    None => {
                        Err("the CUDA probe printed no `cuda devices: N` line; fix the cuda_probe example".to_owned())
                    }
                }
            }
            Check::GpuTests => {
                let counts = parse_test_results(stdout);
                if counts.failed > 0 {
                    return Err(format!("{} GPU test(s) failed ({} passed)", counts.failed, counts.passed));
                }
                if !success {
                    return Err(format!("cargo test failed ({status}) before the GPU tests could report"));
                }
                if counts.passed == 0 {
                    return Err(format!(
                        "zero GPU tests ran ({} test binaries reported, {} tests filtered out): a GPU run that \
                         runs nothing is a failure; GPU tests live in allocator-cuda, are #[ignore = \"gpu: ...\"] \
                         and their names start with gpu_",
                        counts.suites, counts.filtered_out
                    ));
                }
                Ok(None)
            }
            Check::LoomModels => {
                let counts = parse_test_results(stdout);
                if counts.failed > 0 {
                    return Err(format!("{} loom model(s) failed ({} passed)", counts.failed, counts.passed));
                }
                if !success {
                    return Err(format!("cargo test failed ({status})"));
                }
                if counts.ran() == 0 {
                    return Ok(Some(
                        "no loom models ran: the loom crates (memory-sync, memory-binding, memory-governor, memory-plugin, \
                         memory-capi) have no tests whose names contain `loom` yet, so nothing was model-checked"
                            .to_owned(),
                    ));
                }
                Ok(None)
            }
        }
    }
}

/// One named command with its check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Step {
    /// Short name shown in progress and summary lines.
    pub(crate) name: &'static str,
    /// What to run.
    pub(crate) cmd: Cmd,
    /// How to judge it.
    pub(crate) check: Check,
}

impl Step {
    /// A step judged by its exit status alone.
    pub(crate) fn new(name: &'static str, cmd: Cmd) -> Step {
        Step { name, cmd, check: Check::Success }
    }

    /// The same step judged by `check`.
    #[must_use]
    pub(crate) fn check(self, check: Check) -> Step {
        Step { check, ..self }
    }
}

/// A task that did not pass.
#[derive(Debug, thiserror::Error)]
#[error("{task}: step {index}/{total} ({step}) failed: {reason}")]
pub(crate) struct StepFailed {
    /// The task (`xtask test`).
    pub(crate) task: String,
    /// The failed step's name.
    pub(crate) step: &'static str,
    /// Its 1-based position.
    pub(crate) index: usize,
    /// How many steps the task has.
    pub(crate) total: usize,
    /// Why it failed.
    pub(crate) reason: String,
}

/// A step that passed, for the summary table.
struct Passed {
    name: &'static str,
    elapsed: Duration,
    warning: Option<String>,
    check: Check,
    counts: Option<TestCounts>,
    notes: Vec<String>,
}

/// What a passed step hands back to the task that ran it.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    /// The step's stdout, when its check captures it (empty otherwise).
    pub(crate) stdout: String,
}

/// Runs steps one at a time, numbering them `[index/total]`, and prints the summary.
///
/// [`run_steps`] covers a fixed list; a task whose steps depend on earlier results calls
/// [`Runner::run`] itself, [`Runner::expect_more`] when it learns of more steps, and
/// [`Runner::finish`] at the end.
pub(crate) struct Runner<'a> {
    task: &'a str,
    root: &'a Path,
    total: usize,
    started: Instant,
    passed: Vec<Passed>,
}

impl<'a> Runner<'a> {
    /// A runner for `task` that expects `total` steps, run from `root`.
    pub(crate) fn new(task: &'a str, root: &'a Path, total: usize) -> Runner<'a> {
        Runner { task, root, total, started: Instant::now(), passed: Vec::new() }
    }

    /// Counts `extra` more steps in the `[index/total]` numbering.
    pub(crate) fn expect_more(&mut self, extra: usize) {
        self.total += extra;
    }

    /// Runs `step`: prints it, runs it, judges it.
    ///
    /// # Errors
    /// [`StepFailed`] when the step does not pass; the runner has then printed the
    /// summary so far and the failure, and the task should stop.
    pub(crate) fn run(&mut self, step: &Step) -> Result<Outcome, StepFailed> {
        let task = self.task;
        let index = self.passed.len() + 1;
        let total = self.total.max(index);
        println!("\n{task}: [{index}/{total}] {}\n$ {}", step.name, step.cmd);
        flush();
        let step_started = Instant::now();
        let verdict = execute(step, self.root);
        let elapsed = step_started.elapsed();
        match verdict {
            Ok(executed) => {
                println!("{task}: [{index}/{total}] {} ok in {}", step.name, secs(elapsed));
                if let Some(warning) = &executed.warning {
                    println!("{task}: warning: {warning}");
                }
                self.passed.push(Passed {
                    name: step.name,
                    elapsed,
                    warning: executed.warning,
                    check: step.check,
                    counts: executed.counts,
                    notes: executed.notes,
                });
                Ok(Outcome { stdout: executed.stdout })
            }
            Err(reason) => {
                print_table(task, &self.passed);
                let failure = StepFailed { task: task.to_owned(), step: step.name, index, total, reason };
                println!("{task}: [{index}/{total}] {} FAILED after {}: {}", step.name, secs(elapsed), failure.reason);
                println!(
                    "{task}: FAILED at step {index}/{total} ({}); {}/{total} steps passed in {}",
                    step.name,
                    self.passed.len(),
                    secs(self.started.elapsed())
                );
                flush();
                Err(failure)
            }
        }
    }

    /// Prints the summary table, the test totals, the notes of the steps (stress
    /// figures) and one closing line.
    pub(crate) fn finish(self) {
        let task = self.task;
        let passed = &self.passed;
        let total = self.total.max(passed.len());
        print_table(task, passed);
        let warnings: Vec<&str> = passed.iter().filter_map(|step| step.warning.as_deref()).collect();
        // The workspace's test total, as a plain `N passed, N failed` line.
        let mut tests: Option<TestCounts> = None;
        for counts in passed
            .iter()
            .filter(|step| matches!(step.check, Check::Tests | Check::Stress))
            .filter_map(|step| step.counts)
        {
            let total = tests.get_or_insert_with(TestCounts::default);
            total.passed += counts.passed;
            total.failed += counts.failed;
            total.ignored += counts.ignored;
        }
        if let Some(total) = tests {
            println!("tests: {} passed, {} failed, {} skipped", total.passed, total.failed, total.ignored);
        }
        for step in passed.iter().filter(|step| !step.notes.is_empty()) {
            println!("{} figures:", step.name);
            for note in &step.notes {
                println!("  {note}");
            }
        }
        let note = match warnings.len() {
            0 => String::new(),
            1 => format!(" with 1 warning: {}", warnings[0]),
            n => format!(" with {n} warnings (see above)"),
        };
        println!("{task}: {}/{total} steps passed in {}{note}", passed.len(), secs(self.started.elapsed()));
        flush();
    }
}

/// Runs `steps` in order from `root`, stopping at the first failure.
///
/// # Errors
/// [`StepFailed`] naming the first step that did not pass.
pub(crate) fn run_steps(task: &str, root: &Path, steps: &[Step]) -> Result<(), StepFailed> {
    let mut runner = Runner::new(task, root, steps.len());
    for step in steps {
        runner.run(step)?;
    }
    runner.finish();
    Ok(())
}

/// A command that ran and passed its check.
struct Executed {
    warning: Option<String>,
    counts: Option<TestCounts>,
    notes: Vec<String>,
    stdout: String,
}

/// Runs one step's command and judges it: what it produced, or `Err(reason)`.
fn execute(step: &Step, root: &Path) -> Result<Executed, String> {
    if !step.check.reads_output() {
        let status = step.cmd.status(root).map_err(|err| format!("could not start `{}`: {err}", step.cmd))?;
        let warning = step.check.judge(&status, "", "")?;
        return Ok(Executed { warning, counts: None, notes: Vec::new(), stdout: String::new() });
    }
    // Echo stdout line by line while keeping it for the check (unless the check keeps
    // it quiet); stderr (cargo's progress and errors) goes straight through, or is
    // echoed and kept by a thread when the check reads it too.
    let mut command = step.cmd.command(root);
    command.stdout(Stdio::piped());
    if step.check.reads_stderr() {
        command.stderr(Stdio::piped());
    }
    let mut child = command.spawn().map_err(|err| format!("could not start `{}`: {err}", step.cmd))?;
    let stderr_reader = child.stderr.take().map(|stderr| {
        std::thread::spawn(move || {
            let mut captured = String::new();
            let result = read_lines(stderr, |line| {
                // `eprintln!` so that libtest captures it in xtask's own tests.
                eprintln!("{line}");
                captured.push_str(line);
                captured.push('\n');
            });
            result.map(|()| captured)
        })
    });
    let mut captured = String::new();
    let echo = step.check.echoes_stdout();
    let read_result = match child.stdout.take() {
        Some(stdout) => read_lines(stdout, |line| {
            if echo {
                // `println!` (not a raw handle) so that libtest captures it in xtask's own tests.
                println!("{line}");
            }
            captured.push_str(line);
            captured.push('\n');
        }),
        None => Ok(()),
    };
    let status = child.wait().map_err(|err| format!("could not wait for `{}`: {err}", step.cmd))?;
    let stderr = match stderr_reader.map(std::thread::JoinHandle::join) {
        None => String::new(),
        Some(Ok(Ok(stderr))) => stderr,
        Some(Ok(Err(err))) => return Err(format!("could not read the stderr of `{}`: {err}", step.cmd)),
        Some(Err(_)) => return Err(format!("the thread reading the stderr of `{}` panicked", step.cmd)),
    };
    read_result.map_err(|err| format!("could not read the output of `{}`: {err}", step.cmd))?;
    let warning = step.check.judge(&status, &captured, &stderr)?;
    Ok(Executed {
        warning,
        counts: step.check.counts(&captured),
        notes: step.check.notes(&stderr),
        stdout: if echo { String::new() } else { captured },
    })
}

/// Calls `each` with every line of `reader` (lossily decoded, line ending removed).
fn read_lines(reader: impl Read, mut each: impl FnMut(&str)) -> io::Result<()> {
    let mut reader = BufReader::new(reader);
    let mut buffer = Vec::new();
    loop {
        buffer.clear();
        if reader.read_until(b'\n', &mut buffer)? == 0 {
            return Ok(());
        }
        let line = String::from_utf8_lossy(&buffer);
        each(line.trim_end_matches(['\n', '\r']));
    }
}

/// The throughput lines (`... ops/s ...`) the stress tests print on stderr.
fn stress_figures(stderr: &str) -> Vec<String> {
    stderr.lines().map(str::trim).filter(|line| line.contains("ops/s")).map(str::to_owned).collect()
}

fn print_table(task: &str, passed: &[Passed]) {
    if passed.is_empty() {
        return;
    }
    println!("\n{task} summary:");
    for step in passed {
        let mark = if step.warning.is_some() { "ok (warning)" } else { "ok" };
        let note = step.counts.map_or_else(String::new, |counts| {
            format!("  {} passed, {} failed, {} ignored", counts.passed, counts.failed, counts.ignored)
        });
        println!("  {:<16} {mark:<13} {:>8}{note}", step.name, secs(step.elapsed));
    }
}

fn secs(duration: Duration) -> String {
    let secs = duration.as_secs_f64();
    if secs < 10.0 { format!("{secs:.1}s") } else { format!("{secs:.0}s") }
}

fn flush() {
    let _ = io::stdout().flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = "exit status: 0";
    const FAIL: &str = "exit status: 101";

    impl Check {
        fn judge_stdout(self, success: bool, status: &str, stdout: &str) -> Result<Option<String>, String> {
            self.judge_parts(success, status, stdout, "")
        }
    }

    #[test]
    fn zero_gpu_tests_ran_is_a_failure() {
        let output = "test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 12 filtered out; finished in 0.00s\n";
        let err = Check::GpuTests.judge_stdout(true, OK, output).unwrap_err();
        assert!(err.contains("zero GPU tests ran"), "{err}");
        assert!(err.contains("12 tests filtered out"), "{err}");
    }

    #[test]
    fn gpu_run_with_no_summary_at_all_is_a_failure() {
        assert!(Check::GpuTests.judge_stdout(true, OK, "").unwrap_err().contains("zero GPU tests ran"));
    }

    #[test]
    fn failed_gpu_tests_are_counted_in_the_failure() {
        let output = "test result: FAILED. 3 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n";
        let err = Check::GpuTests.judge_stdout(false, FAIL, output).unwrap_err();
        assert!(err.contains("1 GPU test(s) failed (3 passed)"), "{err}");
    }

    #[test]
    fn gpu_build_failure_is_reported_as_such() {
        let err = Check::GpuTests.judge_stdout(false, FAIL, "").unwrap_err();
        assert!(err.contains("before the GPU tests could report"), "{err}");
    }

    #[test]
    fn passing_gpu_tests_pass() {
        let output = "test result: ok. 4 passed; 0 failed; 0 ignored; 0 measured; 9 filtered out\n";
        assert_eq!(Check::GpuTests.judge_stdout(true, OK, output), Ok(None));
    }

    #[test]
    fn cuda_probe_needs_a_driver_and_a_device() {
        let no_driver = Check::CudaDevice.judge_stdout(false, "exit status: 1", "").unwrap_err();
        assert!(no_driver.contains("no usable CUDA driver"), "{no_driver}");
        let no_device = Check::CudaDevice.judge_stdout(true, OK, "cuda devices: 0\n").unwrap_err();
        assert!(no_device.contains("0 devices"), "{no_device}");
        let silent = Check::CudaDevice.judge_stdout(true, OK, "hello\n").unwrap_err();
        assert!(silent.contains("no `cuda devices: N` line"), "{silent}");
        assert_eq!(Check::CudaDevice.judge_stdout(true, OK, "cuda devices: 1\n"), Ok(None));
    }

    #[test]
    fn zero_loom_models_is_a_warning_not_a_pass_in_silence() {
        let output = "test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 40 filtered out\n";
        let warning = Check::LoomModels.judge_stdout(true, OK, output).unwrap().expect("a warning");
        assert!(warning.contains("no loom models ran"), "{warning}");
        let output = "test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 40 filtered out\n";
        assert_eq!(Check::LoomModels.judge_stdout(true, OK, output), Ok(None));
        let output = "test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n";
        assert!(Check::LoomModels.judge_stdout(false, FAIL, output).unwrap_err().contains("1 loom model(s) failed"));
    }

    #[test]
    fn test_runs_report_failures_and_build_errors_differently() {
        let output = "test result: FAILED. 7 passed; 2 failed; 1 ignored; 0 measured; 0 filtered out\n";
        let err = Check::Tests.judge_stdout(false, FAIL, output).unwrap_err();
        assert!(err.contains("2 test(s) failed, 7 passed"), "{err}");
        let err = Check::Tests.judge_stdout(false, FAIL, "").unwrap_err();
        assert!(err.contains("build error"), "{err}");
        let output = "test result: ok. 7 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out\n";
        assert_eq!(Check::Tests.judge_stdout(true, OK, output), Ok(None));
        assert_eq!(Check::Tests.counts(output).map(|counts| (counts.passed, counts.ignored)), Some((7, 1)));
        assert_eq!(Check::Success.counts(output), None);
    }

    #[test]
    fn plain_steps_are_judged_by_exit_status() {
        assert_eq!(Check::Success.judge_stdout(true, OK, ""), Ok(None));
        assert_eq!(Check::Success.judge_stdout(false, FAIL, ""), Err(format!("the command failed ({FAIL})")));
    }

    #[test]
    fn commands_render_like_a_shell_line() {
        let cmd = Cmd::new("/usr/bin/cargo", ["doc", "--no-deps"]).env("RUSTDOCFLAGS", "-D warnings");
        assert_eq!(cmd.to_string(), "RUSTDOCFLAGS=\"-D warnings\" cargo doc --no-deps");
        assert_eq!(cmd.env_value("RUSTDOCFLAGS"), Some("-D warnings"));
        let bench = Cmd::new("/t/xtask bench/binding", ["--bench", "*"]).current_dir("/w/benches").env("K", "v");
        assert_eq!(bench.to_string(), "cd /w/benches && K=v \"/t/xtask bench/binding\" --bench \"*\"");
        assert_eq!(bench.dir(), Some(Path::new("/w/benches")));
    }

    #[cfg(unix)]
    #[test]
    fn runner_stops_at_the_first_failure() {
        let sh = |script: &str| Cmd::new("sh", ["-c", script]);
        let steps = [
            Step::new("first", sh("exit 0")),
            Step::new("second", sh("exit 3")),
            Step::new("third", sh("echo must-not-run; exit 9")),
        ];
        let failure = run_steps("xtask self-test", Path::new("."), &steps).unwrap_err();
        assert_eq!((failure.step, failure.index, failure.total), ("second", 2, 3));
        assert!(failure.reason.contains("exit status: 3"), "{}", failure.reason);
    }

    #[cfg(unix)]
    #[test]
    fn runner_judges_captured_output() {
        let sh = |script: &str| Cmd::new("sh", ["-c", script]);
        let nothing_ran =
            Step::new("gpu", sh("echo 'test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out'"))
                .check(Check::GpuTests);
        let failure = run_steps("xtask self-test", Path::new("."), &[nothing_ran]).unwrap_err();
        assert!(failure.reason.contains("zero GPU tests ran"), "{}", failure.reason);
        let ran =
            Step::new("gpu", sh("echo 'test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out'"))
                .check(Check::GpuTests);
        assert!(run_steps("xtask self-test", Path::new("."), &[ran]).is_ok());
    }

    #[test]
    fn stress_runs_are_judged_as_tests_and_keep_their_figures() {
        let stdout = "test result: ok. 3 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out\n";
        let stderr = "stress: 4 workers + control, 30.00 s, 1200 ops (40 ops/s); Totals\nnoise\n";
        assert_eq!(Check::Stress.judge_parts(true, OK, stdout, stderr), Ok(None));
        assert_eq!(Check::Stress.notes(stderr), ["stress: 4 workers + control, 30.00 s, 1200 ops (40 ops/s); Totals"]);
        assert_eq!(Check::Stress.counts(stdout).map(|counts| counts.passed), Some(3));
        let silent = Check::Stress.judge_parts(true, OK, stdout, "").unwrap().expect("a warning");
        assert!(silent.contains("no `ops/s` line"), "{silent}");
        let failed = "test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n";
        assert!(Check::Stress.judge_parts(false, FAIL, failed, stderr).unwrap_err().contains("1 test(s) failed"));
        assert!(Check::Tests.notes(stderr).is_empty());
    }

    #[cfg(unix)]
    #[test]
    fn runner_captures_stderr_figures_and_quiet_stdout() {
        let sh = |script: &str| Cmd::new("sh", ["-c", script]);
        let stress = Step::new(
            "stress",
            sh("echo 'test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out'; \
                echo 'stress: 12 ops/s' >&2"),
        )
        .check(Check::Stress);
        let mut runner = Runner::new("xtask self-test", Path::new("."), 1);
        assert_eq!(runner.run(&stress).unwrap().stdout, "", "echoed stdout is not handed back");
        assert_eq!(runner.passed[0].notes, ["stress: 12 ops/s"]);
        let json = Step::new("build", sh("echo '{\"reason\":\"x\"}'")).check(Check::CargoJson);
        runner.expect_more(1);
        assert_eq!(runner.run(&json).unwrap().stdout, "{\"reason\":\"x\"}\n");
        let failing = Step::new("build", sh("echo '{}'; exit 4")).check(Check::CargoJson);
        runner.expect_more(1);
        let failure = runner.run(&failing).unwrap_err();
        assert_eq!((failure.index, failure.total), (3, 3));
        assert!(failure.reason.contains("exit status: 4"), "{}", failure.reason);
    }

    #[cfg(unix)]
    #[test]
    fn commands_run_in_their_own_directory() {
        let dir = std::env::temp_dir();
        let step = Step::new("pwd", Cmd::new("sh", ["-c", "pwd"]).current_dir(&dir)).check(Check::CargoJson);
        let mut runner = Runner::new("xtask self-test", Path::new("/"), 1);
        let printed = runner.run(&step).unwrap().stdout;
        let printed = std::fs::canonicalize(printed.trim()).unwrap();
        assert_eq!(printed, std::fs::canonicalize(&dir).unwrap());
    }
}
