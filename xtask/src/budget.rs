//! `cargo xtask budget [--update]`: the hot path's instruction budget.
//!
//! Instruction counts under callgrind are deterministic for a given build, so unlike
//! wall-clock figures they can guard the hot path on any machine, a shared CI runner
//! included. The task builds the counting programs in release (memory-benches'
//! `instructions` example and memory-plugin's `pair_instructions`, see [`Program`]), runs
//! each operation of [`OPS`] under `valgrind --tool=callgrind` once with [`SMALL_N`] and
//! once with [`LARGE_N`] operations, and divides the difference of the two counts by the
//! difference of N: instructions per operation, with everything a program does once
//! (making registries, warming up, building and loading a plugin) cancelled out.
//!
//! Each figure is judged against its budget in [`BUDGET_FILE`] (plain `operation =
//! instructions` lines): more than [`TOLERANCE`] over fails the task; more than that under
//! is a note to lower the budget, since a gain left out of the file is a gain the budget
//! no longer guards. `--update` writes the measured figures into the file instead of
//! judging them (comments kept, a missing operation appended). The counts run in
//! parallel, one valgrind per core: callgrind counts one process's instructions, which
//! other processes do not change. `cargo xtask test` runs this task as its `budget` step.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use crate::flags;
use crate::step::{Check, Cmd, Runner, Step, StepFailed};
use crate::table::{self, Align};

/// The budget, relative to the project root.
pub(crate) const BUDGET_FILE: &str = "xtask/instruction-budget.toml";

/// How far above its budget an operation may measure before the task fails (10 %), and
/// how far below before it says to lower the budget.
pub(crate) const TOLERANCE: f64 = 0.10;

/// Operations in the first, smaller run of each count.
pub(crate) const SMALL_N: u64 = 10_000;

/// Operations in the second run; per operation = (count at this − count at
/// [`SMALL_N`]) / (this − [`SMALL_N`]).
pub(crate) const LARGE_N: u64 = 60_000;

/// A counting program: an example of a workspace package, built in release.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Program {
    /// memory-benches' `instructions` example, run as `instructions OP N`.
    Instructions,
    /// memory-plugin's `pair_instructions` example, run as `pair_instructions N` and
    /// counted only inside its batch function (`--toggle-collect`), which leaves out
    /// compiling and loading the C plugin.
    Plugin,
}

impl Program {
    /// Every program, in build order.
    pub(crate) const ALL: [Program; 2] = [Program::Instructions, Program::Plugin];

    /// The package the example belongs to.
    pub(crate) fn package(self) -> &'static str {
        match self {
            Program::Instructions => "memory-benches",
            Program::Plugin => "memory-plugin",
        }
    }

    /// The example's name.
    pub(crate) fn example(self) -> &'static str {
        match self {
            Program::Instructions => "instructions",
            Program::Plugin => "pair_instructions",
        }
    }
}

/// One counted operation: its name in the budget file and the program that runs it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Op {
    /// The name in [`BUDGET_FILE`].
    pub(crate) name: &'static str,
    /// What runs it.
    pub(crate) program: Program,
    /// The operation's argument to [`Program::Instructions`] (`None` for the plugin's
    /// program, which runs one operation only).
    pub(crate) arg: Option<&'static str>,
}

impl Op {
    /// `instructions NAME N`.
    const fn instructions(name: &'static str) -> Op {
        Op::instructions_as(name, name)
    }

    /// `instructions ARG N`, under another name in the budget.
    const fn instructions_as(name: &'static str, arg: &'static str) -> Op {
        Op { name, program: Program::Instructions, arg: Some(arg) }
    }

    /// valgrind's arguments for counting `n` operations with the program at `exe`.
    pub(crate) fn valgrind_args(&self, exe: &Path, n: u64) -> Vec<String> {
        let mut args = vec!["--tool=callgrind".to_owned(), "--callgrind-out-file=/dev/null".to_owned()];
        if self.program == Program::Plugin {
            args.push("--toggle-collect=*plugin_batch*".to_owned());
        }
        args.push(exe.display().to_string());
        args.extend(self.arg.map(str::to_owned));
        args.push(n.to_string());
        args
    }
}

/// The operations the budget guards, in the order of the table (what each does is said
/// beside its figure in [`BUDGET_FILE`]).
pub(crate) const OPS: [Op; 11] = [
    Op::instructions("raw"),
    Op::instructions("pair"),
    Op::instructions("drop"),
    Op::instructions("bind"),
    Op::instructions("bind64"),
    Op::instructions("remote"),
    Op::instructions("governed"),
    Op::instructions("pooled"),
    Op::instructions("segment"),
    // Over the C API's pooled allocator, not the system one: glibc's cost for a 4 KiB block
    // depends on the heap's layout, which differs between processes (see instructions.rs).
    Op::instructions_as("capi", "capi_pooled"),
    Op { name: "plugin", program: Program::Plugin, arg: None },
];

/// Why `cargo xtask budget` failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BudgetError {
    /// The build failed; the runner has printed why.
    #[error(transparent)]
    Step(#[from] StepFailed),
    /// valgrind could not be run.
    #[error(
        "valgrind could not be run ({detail}): the instruction budget counts under callgrind, so install \
         valgrind (`apt-get install valgrind` on Debian or Ubuntu; .ci/run installs it in CI)"
    )]
    NoValgrind {
        /// What running `valgrind --version` gave.
        detail: String,
    },
    /// The budget file could not be read.
    #[error("could not read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The budget file could not be written (`--update`).
    #[error("could not write {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The budget file does not say what the task needs.
    #[error("{}: {reason}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the line where one is to blame.
        reason: String,
    },
    /// The build named no executable for a counting program.
    #[error(
        "building the counting programs produced no `{example}` executable (cargo's JSON messages named \
         none); does package {package} still have that example?"
    )]
    NoExecutable {
        /// The example.
        example: &'static str,
        /// Its package.
        package: &'static str,
    },
    /// Counting failed for some operations.
    #[error("could not count {}", failures.join("; "))]
    Count {
        /// `op at N: why`, one per failed count.
        failures: Vec<String>,
    },
    /// Operations measured over their budget.
    #[error(
        "{} over budget by more than {}: {}; find the change that added the cost (run `cargo xtask budget` \
         at its parent), or, if it is worth it, record the new figure with `cargo xtask budget --update` and \
         say why in the commit",
        plural(over.len(), "operation"),
        percent(TOLERANCE),
        over.join(", ")
    )]
    Over {
        /// `op (+NN %)`, one per operation over.
        over: Vec<String>,
    },
}

/// Runs `cargo xtask budget` from the project `root`.
///
/// # Errors
/// [`BudgetError`]: no valgrind, a budget file that is unreadable, malformed or names
/// other operations than [`OPS`], a failed build or count, or (without `--update`) an
/// operation over its budget by more than [`TOLERANCE`].
pub(crate) fn run(flags: &flags::Budget, root: &Path) -> Result<(), BudgetError> {
    let started = Instant::now();
    let task = if flags.update { "xtask budget --update" } else { "xtask budget" };
    let path = root.join(BUDGET_FILE);
    let text = std::fs::read_to_string(&path).map_err(|source| BudgetError::Read { path: path.clone(), source })?;
    let file_error = |reason: String| BudgetError::File { path: path.clone(), reason };
    let figures = parse_budget(&text).map_err(file_error)?;
    check_names(&figures, &OPS, flags.update).map_err(file_error)?;
    let valgrind = valgrind_version(root)?;

    let mut runner = Runner::new(task, root, 1);
    let built = runner.run(&build_step())?;
    let found = crate::bench::executables(&built.stdout, "example");
    let mut programs = Vec::new();
    for program in Program::ALL {
        let exe = found
            .iter()
            .find(|(name, _)| name == program.example())
            .map(|(_, exe)| exe.clone())
            .ok_or(BudgetError::NoExecutable { example: program.example(), package: program.package() })?;
        programs.push((program, exe));
    }
    let exe_of = |op: &Op| programs.iter().find(|(program, _)| *program == op.program).map(|(_, exe)| exe.as_path());

    let jobs: Vec<(Op, &Path, u64)> = OPS
        .iter()
        .filter_map(|op| exe_of(op).map(|exe| (*op, exe)))
        .flat_map(|(op, exe)| [(op, exe, SMALL_N), (op, exe, LARGE_N)])
        .collect();
    let workers = std::thread::available_parallelism().map_or(1, std::num::NonZero::get).min(jobs.len()).max(1);
    println!(
        "\n{task}: counting {} operations under callgrind ({valgrind}), {SMALL_N} and {LARGE_N} of each, \
         {workers} at a time",
        OPS.len()
    );
    let counted = Instant::now();
    let counts = count_all(&jobs, root, workers);
    let mut failures = Vec::new();
    let mut rows = Vec::new();
    for (op, pair) in OPS.iter().zip(counts.chunks(2)) {
        let measured = match pair {
            [Ok(small), Ok(large)] => per_op(*small, *large),
            _ => Err(pair.iter().filter_map(|count| count.as_ref().err().cloned()).collect::<Vec<_>>().join("; ")),
        };
        match measured {
            Ok(measured) => rows.push(Row { name: op.name, budget: figure_of(&figures, op.name), measured }),
            Err(why) => failures.push(format!("{}: {why}", op.name)),
        }
    }
    if !failures.is_empty() {
        return Err(BudgetError::Count { failures });
    }
    println!("{task}: counted in {:.1}s\n\n{}", counted.elapsed().as_secs_f64(), render(&rows));

    if flags.update {
        let fresh: Vec<(&str, u64)> = rows.iter().map(|row| (row.name, row.figure())).collect();
        std::fs::write(&path, rewrite(&text, &fresh)).map_err(|source| BudgetError::Write { path, source })?;
        println!(
            "{task}: wrote the measured figures to {BUDGET_FILE} in {:.0}s; review the diff, and give the reason \
             for each figure that rose in the commit",
            started.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    let under: Vec<&str> = rows.iter().filter(|row| row.verdict() == Verdict::Under).map(|row| row.name).collect();
    if !under.is_empty() {
        println!(
            "{task}: note: {} more than {} under budget ({}): lower the figures with `cargo xtask budget --update` \
             in the commit that made them cheaper, so that the budget keeps the gain",
            plural(under.len(), "operation"),
            percent(TOLERANCE),
            under.join(", ")
        );
    }
    let over: Vec<String> = rows
        .iter()
        .filter(|row| row.verdict() == Verdict::Over)
        .map(|row| format!("{} ({})", row.name, row.change().unwrap_or_default()))
        .collect();
    if !over.is_empty() {
        return Err(BudgetError::Over { over });
    }
    println!(
        "{task}: {} within {} of their budget in {:.0}s",
        plural(rows.len(), "operation"),
        percent(TOLERANCE),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The release build of every [`Program`], its JSON messages kept to find the
/// executables.
pub(crate) fn build_step() -> Step {
    let mut args: Vec<&str> = vec!["build", "--release", "--locked", "--message-format=json-render-diagnostics"];
    for program in Program::ALL {
        args.extend(["-p", program.package(), "--example", program.example()]);
    }
    Step::new("build", Cmd::cargo(args)).check(Check::CargoJson)
}

/// `valgrind --version`'s answer, or why there is none.
fn valgrind_version(root: &Path) -> Result<String, BudgetError> {
    let cmd = Cmd::new("valgrind", ["--version"]);
    match cmd.output(root) {
        Ok(output) if output.status.success() => Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned()),
        Ok(output) => Err(BudgetError::NoValgrind { detail: format!("`{cmd}` failed ({})", output.status) }),
        Err(err) => Err(BudgetError::NoValgrind { detail: format!("`{cmd}`: {err}") }),
    }
}

/// Runs every job (an operation, its program, N) under callgrind, `workers` at a time:
/// each job's instruction count, or why there is none, in the jobs' order.
fn count_all(jobs: &[(Op, &Path, u64)], root: &Path, workers: usize) -> Vec<Result<u64, String>> {
    let next = AtomicUsize::new(0);
    let mut counts: Vec<Result<u64, String>> =
        vec![Err("not counted: its worker thread panicked".to_owned()); jobs.len()];
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        let Some((op, exe, n)) = jobs.get(index) else { return done };
                        done.push((index, count(op, exe, *n, root)));
                    }
                })
            })
            .collect();
        for handle in handles {
            for (index, count) in handle.join().unwrap_or_default() {
                counts[index] = count;
            }
        }
    });
    counts
}

/// The instructions callgrind counts for `n` of `op` with the program at `exe`.
fn count(op: &Op, exe: &Path, n: u64, root: &Path) -> Result<u64, String> {
    let cmd = Cmd::new("valgrind", op.valgrind_args(exe, n));
    let output = cmd.output(root).map_err(|err| format!("could not run `{cmd}`: {err}"))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(format!("`{cmd}` failed ({}):\n{}", output.status, tail(&stderr, 20)));
    }
    parse_count(&stderr).ok_or_else(|| format!("`{cmd}` printed no instruction count:\n{}", tail(&stderr, 20)))
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The instruction count callgrind prints on stderr as the program ends: `==PID==
/// Collected : 2455757` (the first figure when more events are collected), or failing
/// that the `==PID== I   refs:      2,455,757` line. The last one when there are several.
pub(crate) fn parse_count(stderr: &str) -> Option<u64> {
    let figure = |rest: &str| rest.split_whitespace().next()?.replace(',', "").parse().ok();
    let lines = || stderr.lines().rev();
    lines()
        .find_map(|line| line.split_once("Collected :").and_then(|(_, rest)| figure(rest)))
        .or_else(|| lines().find_map(|line| line.split_once("I   refs:").and_then(|(_, rest)| figure(rest))))
}

/// Instructions per operation from the counts at [`SMALL_N`] and [`LARGE_N`].
///
/// # Errors
/// When the larger run did not count more: the program did not run the operation N times.
pub(crate) fn per_op(small: u64, large: u64) -> Result<f64, String> {
    if large <= small {
        return Err(format!(
            "{large} instructions for {LARGE_N} operations, not more than {small} for {SMALL_N}: the program did \
             not run the operation N times"
        ));
    }
    Ok((large - small) as f64 / (LARGE_N - SMALL_N) as f64)
}

/// Splits a budget line into its content and its comment (from `#`, with nothing
/// before it trimmed off the content).
fn split_comment(line: &str) -> (&str, &str) {
    line.find('#').map_or((line, ""), |at| line.split_at(at))
}

/// The `operation = instructions` figures of a budget file, in its order.
///
/// # Errors
/// The first malformed line, by number: no `=`, a name that is not a bare word, a figure
/// that is not a whole number above 0, or a name given twice.
pub(crate) fn parse_budget(text: &str) -> Result<Vec<(String, u64)>, String> {
    let mut figures: Vec<(String, u64)> = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let content = split_comment(line).0.trim();
        if content.is_empty() {
            continue;
        }
        let at = |what: String| format!("line {}: {what}", index + 1);
        let Some((name, figure)) = content.split_once('=') else {
            return Err(at(format!("`{content}` is not `operation = instructions`")));
        };
        let (name, figure) = (name.trim(), figure.trim());
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
            return Err(at(format!("`{name}` is not an operation's name")));
        }
        let Some(value) = figure.replace('_', "").parse::<u64>().ok().filter(|&value| value > 0) else {
            return Err(at(format!(
                "the figure of `{name}`, `{figure}`, is not a whole number of instructions above 0"
            )));
        };
        if figures.iter().any(|(known, _)| known == name) {
            return Err(at(format!("`{name}` has a figure already")));
        }
        figures.push((name.to_owned(), value));
    }
    Ok(figures)
}

/// Checks that `figures` names exactly the operations of `ops`; with `update`, missing
/// ones are allowed (the update appends them).
///
/// # Errors
/// The operations without a figure and the figures of no operation.
pub(crate) fn check_names(figures: &[(String, u64)], ops: &[Op], update: bool) -> Result<(), String> {
    let unknown: Vec<&str> =
        figures.iter().map(|(name, _)| name.as_str()).filter(|name| !ops.iter().any(|op| op.name == *name)).collect();
    let missing: Vec<&str> =
        ops.iter().map(|op| op.name).filter(|name| figure_of(figures, name).is_none() && !update).collect();
    let mut problems = Vec::new();
    if !missing.is_empty() {
        problems.push(format!(
            "no figure for {} (`cargo xtask budget --update` measures and adds them)",
            missing.join(", ")
        ));
    }
    if !unknown.is_empty() {
        let known: Vec<&str> = ops.iter().map(|op| op.name).collect();
        problems.push(format!(
            "figures for {}, which xtask does not count (it counts {}): remove them or add the operation to \
             xtask's budget::OPS",
            unknown.join(", "),
            known.join(", ")
        ));
    }
    if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) }
}

fn figure_of(figures: &[(String, u64)], name: &str) -> Option<u64> {
    figures.iter().find(|(known, _)| known == name).map(|&(_, figure)| figure)
}

/// `text` with each figure replaced by the one `fresh` gives for its operation, every
/// other line and each line's comment kept (the comment where it was when the new
/// figure fits); operations with no line yet are appended.
pub(crate) fn rewrite(text: &str, fresh: &[(&str, u64)]) -> String {
    let mut out = String::with_capacity(text.len() + 64);
    let mut written = Vec::new();
    for line in text.split_inclusive('\n') {
        let body = line.trim_end_matches(['\n', '\r']);
        let ending = &line[body.len()..];
        let (content, comment) = split_comment(body);
        let name = content.split_once('=').map(|(name, _)| name.trim());
        match name.and_then(|name| fresh.iter().find(|(op, _)| *op == name)) {
            Some(&(op, figure)) => {
                let entry = format!("{op} = {figure}");
                out.push_str(&entry);
                if !comment.is_empty() {
                    out.push_str(&" ".repeat(content.len().saturating_sub(entry.len()).max(1)));
                    out.push_str(comment);
                }
                written.push(op);
            }
            None => out.push_str(body),
        }
        out.push_str(ending);
    }
    for &(op, figure) in fresh.iter().filter(|(op, _)| !written.contains(op)) {
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(&format!("{op} = {figure}\n"));
    }
    out
}

/// How a measured operation stands against its budget.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Within [`TOLERANCE`] of the budget either way.
    Within,
    /// More than [`TOLERANCE`] over: the task fails.
    Over,
    /// More than [`TOLERANCE`] under: the budget should come down.
    Under,
    /// No budget yet (`--update` of a new operation).
    New,
}

/// One operation's row of the table.
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) struct Row {
    /// The operation.
    pub(crate) name: &'static str,
    /// Its figure in the budget file, if it has one.
    pub(crate) budget: Option<u64>,
    /// Instructions per operation, measured.
    pub(crate) measured: f64,
}

impl Row {
    /// Measured over budget.
    pub(crate) fn ratio(&self) -> Option<f64> {
        self.budget.map(|budget| self.measured / budget as f64)
    }

    /// The verdict, by [`Row::ratio`] against [`TOLERANCE`] (exactly 10 % over passes).
    pub(crate) fn verdict(&self) -> Verdict {
        match self.ratio() {
            None => Verdict::New,
            Some(ratio) if ratio > 1.0 + TOLERANCE => Verdict::Over,
            Some(ratio) if ratio < 1.0 - TOLERANCE => Verdict::Under,
            Some(_) => Verdict::Within,
        }
    }

    /// The change from the budget in whole percent (`+16 %`, `-40 %`).
    fn change(&self) -> Option<String> {
        self.ratio().map(|ratio| format!("{:+.0} %", (ratio - 1.0) * 100.0))
    }

    /// The figure `--update` records: the measured one, rounded.
    pub(crate) fn figure(&self) -> u64 {
        self.measured.round() as u64
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Within => "ok",
            Verdict::Over => "OVER",
            Verdict::Under => "under: lower the budget",
            Verdict::New => "new",
        })
    }
}

/// The table: operation, budget, measured, ratio and verdict, as markdown.
pub(crate) fn render(rows: &[Row]) -> String {
    let headers = [
        ("op", Align::Left),
        ("budget", Align::Right),
        ("measured", Align::Right),
        ("ratio", Align::Right),
        ("verdict", Align::Left),
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            let verdict = match (row.verdict(), row.change()) {
                (Verdict::Over, Some(change)) => format!("OVER ({change})"),
                (verdict, _) => verdict.to_string(),
            };
            vec![
                row.name.to_owned(),
                row.budget.map_or_else(|| "-".to_owned(), |budget| budget.to_string()),
                format!("{:.1}", row.measured),
                row.ratio().map_or_else(|| "-".to_owned(), |ratio| format!("{ratio:.3}")),
                verdict,
            ]
        })
        .collect();
    table::markdown(&headers, &cells)
}

fn plural(n: usize, what: &str) -> String {
    if n == 1 { format!("1 {what}") } else { format!("{n} {what}s") }
}

fn percent(fraction: f64) -> String {
    format!("{:.0} %", fraction * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What callgrind printed for `instructions raw 10000` (valgrind 3.19).
    const CALLGRIND_STDERR: &str = "==10660== Callgrind, a call-graph generating cache profiler
==10660== Copyright (C) 2002-2017, and GNU GPL'd, by Josef Weidendorfer et al.
==10660== Using Valgrind-3.19.0 and LibVEX; rerun with -h for copyright info
==10660== Command: target/release/examples/instructions raw 10000
==10660==
==10660== For interactive control, run 'callgrind_control -h'.
==10660==
==10660== Events    : Ir
==10660== Collected : 2455757
==10660==
==10660== I   refs:      2,455,757
";

    #[test]
    fn the_count_is_read_from_callgrinds_summary() {
        assert_eq!(parse_count(CALLGRIND_STDERR), Some(2_455_757));
        let refs_only = "==1== Events    : Ir\n==1== I   refs:      12,345,678\n";
        assert_eq!(parse_count(refs_only), Some(12_345_678));
        let more_events = "==1== Collected : 900 12 3\n";
        assert_eq!(parse_count(more_events), Some(900));
        let two = "==1== Collected : 5\n==2== Collected : 7\n";
        assert_eq!(parse_count(two), Some(7), "the last summary wins");
        assert_eq!(parse_count("thread 'main' panicked at 'unknown operation'\n"), None);
        assert_eq!(parse_count("==1== Collected : lots\n"), None);
    }

    #[test]
    fn per_op_is_the_difference_over_the_difference_of_n() {
        assert_eq!(per_op(2_455_757, 5_804_625), Ok(66.977_36));
        let err = per_op(100, 100).unwrap_err();
        assert!(err.contains("not more than 100"), "{err}");
        assert!(per_op(200, 100).is_err());
    }

    #[test]
    fn the_plugin_is_counted_inside_its_batch_and_the_others_by_name() {
        let exe = Path::new("/t/release/examples/x");
        let pair = Op::instructions("pair").valgrind_args(exe, 10);
        assert_eq!(pair, ["--tool=callgrind", "--callgrind-out-file=/dev/null", "/t/release/examples/x", "pair", "10"]);
        let capi = OPS.iter().find(|op| op.name == "capi").unwrap().valgrind_args(exe, 10);
        assert_eq!(capi[3..], ["capi_pooled", "10"], "the C API is counted over its pooled allocator");
        let plugin = OPS.iter().find(|op| op.name == "plugin").unwrap().valgrind_args(exe, 60);
        assert_eq!(
            plugin,
            [
                "--tool=callgrind",
                "--callgrind-out-file=/dev/null",
                "--toggle-collect=*plugin_batch*",
                "/t/release/examples/x",
                "60"
            ]
        );
    }

    #[test]
    fn the_build_is_release_locked_and_names_every_program() {
        let step = build_step();
        assert_eq!(step.check, Check::CargoJson);
        let line = step.cmd.to_string();
        assert!(line.contains("build --release --locked --message-format=json-render-diagnostics"), "{line}");
        assert!(
            line.ends_with("-p memory-benches --example instructions -p memory-plugin --example pair_instructions")
        );
    }

    const FILE: &str = "# header\n\n# raw: the floor\nraw = 67   # through &dyn\npair=364\ngoverned = 1_002\n";

    #[test]
    fn a_budget_file_is_name_equals_figure_lines_with_comments() {
        let figures = parse_budget(FILE).unwrap();
        assert_eq!(figures, [("raw".to_owned(), 67), ("pair".to_owned(), 364), ("governed".to_owned(), 1002)]);
        assert_eq!(parse_budget("# nothing\n"), Ok(Vec::new()));
    }

    #[test]
    fn a_malformed_budget_line_is_named_by_number() {
        let err = |text: &str| parse_budget(text).unwrap_err();
        assert_eq!(err("raw = 1\n[budget]\n"), "line 2: `[budget]` is not `operation = instructions`");
        assert!(err("raw = 0").starts_with("line 1: the figure of `raw`, `0`"), "{}", err("raw = 0"));
        assert!(err("raw = 6.5").contains("whole number"), "{}", err("raw = 6.5"));
        assert!(err("raw = \"67\"").contains("whole number"));
        assert_eq!(err("\n\nraw = 1\nraw = 2\n"), "line 4: `raw` has a figure already");
        assert_eq!(err("a b = 1\n"), "line 1: `a b` is not an operation's name");
        assert_eq!(err(" = 1\n"), "line 1: `` is not an operation's name");
    }

    #[test]
    fn the_budget_names_every_counted_operation_and_no_other() {
        let ops = [Op::instructions("raw"), Op::instructions("pair"), Op::instructions("bind")];
        let figures = parse_budget("raw = 1\npair = 2\nbind = 3\n").unwrap();
        assert_eq!(check_names(&figures, &ops, false), Ok(()));
        let figures = parse_budget("raw = 1\nold = 2\n").unwrap();
        let err = check_names(&figures, &ops, false).unwrap_err();
        assert!(err.contains("no figure for pair, bind"), "{err}");
        assert!(err.contains("figures for old, which xtask does not count"), "{err}");
        let err = check_names(&figures, &ops, true).unwrap_err();
        assert!(!err.contains("no figure"), "an update adds missing figures: {err}");
        let figures = parse_budget("raw = 1\n").unwrap();
        assert_eq!(check_names(&figures, &ops, true), Ok(()));
    }

    #[test]
    fn the_checked_in_budget_parses_and_covers_exactly_the_counted_operations() {
        let path = crate::tasks::project_root().join(BUDGET_FILE);
        let text = std::fs::read_to_string(&path).expect("the budget file exists");
        let figures = parse_budget(&text).expect("the budget file parses");
        assert_eq!(check_names(&figures, &OPS, false), Ok(()));
        for needed in ["cargo xtask budget --update", "commit", "compiler"] {
            assert!(text.contains(needed), "the budget file's header does not mention `{needed}`");
        }
    }

    #[test]
    fn an_update_replaces_figures_keeps_comments_and_appends_new_operations() {
        let fresh = [("raw", 66), ("pair", 1_000), ("governed", 941), ("plugin", 1501)];
        assert_eq!(
            rewrite(FILE, &fresh),
            "# header\n\n# raw: the floor\nraw = 66   # through &dyn\npair = 1000\ngoverned = 941\nplugin = 1501\n"
        );
        assert_eq!(rewrite("raw = 9 # c", &[("raw", 12_345)]), "raw = 12345 # c");
        assert_eq!(rewrite("raw = 9\r\n", &[("raw", 8)]), "raw = 8\r\n");
        assert_eq!(rewrite("# only a comment", &[("raw", 8)]), "# only a comment\nraw = 8\n");
        let again = rewrite(&rewrite(FILE, &fresh), &fresh);
        assert_eq!(again, rewrite(FILE, &fresh), "an update of an updated file changes nothing");
    }

    fn row(budget: Option<u64>, measured: f64) -> Row {
        Row { name: "pair", budget, measured }
    }

    #[test]
    fn more_than_ten_percent_over_fails_and_more_than_ten_under_asks_to_lower() {
        assert_eq!(row(Some(100), 110.0).verdict(), Verdict::Within, "exactly 10 % over passes");
        assert_eq!(row(Some(100), 110.1).verdict(), Verdict::Over);
        assert_eq!(row(Some(100), 90.0).verdict(), Verdict::Within);
        assert_eq!(row(Some(100), 89.9).verdict(), Verdict::Under);
        assert_eq!(row(Some(364), 363.95).verdict(), Verdict::Within);
        assert_eq!(row(None, 10.0).verdict(), Verdict::New);
        assert_eq!(row(Some(100), 116.2).change().as_deref(), Some("+16 %"));
        assert_eq!(row(Some(1000), 600.4).figure(), 600);
        assert_eq!(row(Some(1000), 600.5).figure(), 601);
    }

    #[test]
    fn the_table_shows_budget_measured_ratio_and_verdict() {
        let rows = [
            Row { name: "raw", budget: Some(67), measured: 66.977 },
            Row { name: "pair", budget: Some(364), measured: 420.5 },
            Row { name: "governed", budget: Some(1002), measured: 600.0 },
            Row { name: "plugin", budget: None, measured: 1501.2 },
        ];
        assert_eq!(
            render(&rows),
            "| op       | budget | measured | ratio | verdict                 |\n\
             | -------- | -----: | -------: | ----: | ----------------------- |\n\
             | raw      |     67 |     67.0 | 1.000 | ok                      |\n\
             | pair     |    364 |    420.5 | 1.155 | OVER (+16 %)            |\n\
             | governed |   1002 |    600.0 | 0.599 | under: lower the budget |\n\
             | plugin   |      - |   1501.2 |     - | new                     |\n"
        );
    }

    #[test]
    fn an_over_budget_failure_says_how_to_proceed() {
        let err = BudgetError::Over { over: vec!["pair (+16 %)".into()] }.to_string();
        assert!(err.starts_with("1 operation over budget by more than 10 %: pair (+16 %);"), "{err}");
        assert!(err.contains("cargo xtask budget --update") && err.contains("commit"), "{err}");
        let err = BudgetError::NoValgrind { detail: "`valgrind --version`: No such file".into() }.to_string();
        assert!(err.contains("install valgrind"), "{err}");
    }

    #[cfg(unix)]
    #[test]
    fn counting_runs_every_job_and_keeps_their_order() {
        // Jobs that fail fast whether valgrind is installed (no such program to run under
        // it) or not (no valgrind): one error per job, each in its job's place.
        let missing = Path::new("/nonexistent/xtask-budget-test");
        let jobs: Vec<(Op, &Path, u64)> = OPS.iter().take(3).map(|op| (*op, missing, 1)).collect();
        let counts = count_all(&jobs, Path::new("."), 2);
        assert_eq!(counts.len(), 3);
        for (count, (op, _, _)) in counts.iter().zip(&jobs) {
            let err = count.as_ref().unwrap_err();
            assert!(err.contains(&format!("xtask-budget-test {} 1", op.arg.unwrap())), "{err}");
        }
    }
}
