//! `cargo xtask bench [--compare REV]`: runs the criterion benches and reads their
//! results back.
//!
//! - Without `--compare`: one `cargo bench` of memory-benches with short criterion
//!   settings, its results written to `<target>/criterion` (where criterion writes them
//!   anyway, so its own "change since last run" lines keep working), then the ratio
//!   table ([`crate::ratios`]) from the results this run wrote.
//! - With `--compare REV`: a detached `git worktree` of REV under
//!   `<target>/xtask-bench`, both sides' bench binaries built once and copied aside,
//!   then run alternately, baseline then candidate, `--rounds` times, each run writing
//!   to its own criterion directory; then the comparison table ([`crate::compare`]) and
//!   the ratio table of the candidate. The worktree and the copied binaries are removed
//!   afterwards, on failure too.
//!
//! The baseline builds in its own target dir, `<target>/xtask-bench/target` (kept, so
//! third-party crates build once). It must not share the working tree's: cargo names a
//! workspace crate's artifacts by its path relative to the workspace root, the same in
//! both trees, and judges freshness by modification times, so after the baseline's
//! build the working tree's older sources look up to date and its build would silently
//! reuse the baseline's binaries (and leave them there for later builds). Both sides
//! build with the cargo that runs xtask (`$CARGO`); the comparison is meant to be of the
//! code, so a REV whose `rust-toolchain.toml` pins another toolchain is best compared
//! with that file made equal.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde_json::Value;

use crate::compare;
use crate::estimates::{self, Results};
use crate::flags;
use crate::ratios;
use crate::step::{Check, Cmd, Runner, Step, StepFailed};
use crate::tasks;

/// Why `cargo xtask bench` failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BenchError {
    /// A step failed; the runner has printed which and why.
    #[error(transparent)]
    Step(#[from] StepFailed),
    /// `--compare REV` names nothing git can resolve to a commit.
    #[error(
        "`--compare {rev}`: git cannot resolve it to a commit ({detail}); pass a branch, tag or commit that \
         exists in this clone (fetch it first, and in CI check out with full history)"
    )]
    UnknownRevision {
        /// The revision as given.
        rev: String,
        /// What git said.
        detail: String,
    },
    /// A file-system action failed.
    #[error("could not {action} {}: {source}", path.display())]
    Io {
        /// What was being done (`write the table to`).
        action: &'static str,
        /// On what.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A build named no bench executable.
    #[error(
        "building the benches of {side} produced no bench executable (cargo's JSON messages named none); \
         does {side} have the memory-benches package with [[bench]] targets?"
    )]
    NoBenchExecutables {
        /// `the working tree` or `REV (commit)`.
        side: String,
    },
    /// The ratio table lacks results.
    #[error(
        "the ratio table lacks results for {}: the run wrote no criterion result for them under {}; \
         see the list under the table",
        names.join(", "),
        home.display()
    )]
    MissingResults {
        /// The criterion ids.
        names: Vec<&'static str>,
        /// Where the results were looked for.
        home: PathBuf,
    },
}

/// Runs `cargo xtask bench` with `flags` from the project `root`.
///
/// # Errors
/// [`BenchError`]: a failed step, an unknown revision, a file that could not be
/// written, or (without `--compare`) results the ratio table needs but the run did not
/// produce. Missed targets are reported in the table, not as errors: timings on a
/// shared machine are too noisy to gate on.
pub(crate) fn run(flags: &flags::Bench, root: &Path) -> Result<(), BenchError> {
    if flags.gpu {
        let home = tasks::target_dir().join("criterion");
        crate::step::run_steps("xtask bench --gpu", root, &tasks::gpu_bench_steps(flags, &home))?;
        return Ok(());
    }
    match &flags.compare {
        None => run_once(flags, root),
        Some(rev) => run_compare(flags, rev, root),
    }
}

fn run_once(flags: &flags::Bench, root: &Path) -> Result<(), BenchError> {
    let home = tasks::target_dir().join("criterion");
    let started = SystemTime::now();
    let mut runner = Runner::new("xtask bench", root, 1);
    runner.run(&Step::new("bench", tasks::bench_cmd(flags, &home)))?;
    runner.finish();
    let results = estimates::read_results(&home, Some(started));
    let rows = ratios::rows(&ratios::RATIOS, &results.benches);
    let report = format!(
        "## Benchmark ratios, measured in one run\n\n\
         Medians from criterion (`{}`), per iteration or per element where the bench declares a throughput; \
         each ratio sets two results of this run against each other. Targets from issues {}. \
         Two-thread rows show the machine's other load while they ran (busy CPU not spent by the bench, in cores): \
         they mean something only when it is near zero.\n\n{}",
        tasks::criterion_args(flags).join(" "),
        ratios::target_issues(&ratios::RATIOS),
        ratios::render(&rows, &results.problems, &results.loads)
    );
    println!("\n{report}");
    if let Some(path) = &flags.output {
        write_output(path, &report)?;
    }
    let missing = ratios::missing(&rows);
    if missing.is_empty() { Ok(()) } else { Err(BenchError::MissingResults { names: missing, home }) }
}

/// One side of a comparison.
struct Side {
    /// `baseline` or `candidate` (step names, directory names).
    label: &'static str,
    /// Its source tree.
    tree: PathBuf,
    /// Its bench binaries, copied out of the target dir, by bench name.
    binaries: Vec<(String, PathBuf)>,
    /// Each run's results.
    runs: Vec<Results>,
}

fn run_compare(flags: &flags::Bench, rev: &str, root: &Path) -> Result<(), BenchError> {
    let commit = resolve_commit(rev, root)?;
    let short = compare::short(&commit).to_owned();
    let layout = Layout::new(&tasks::target_dir(), &short);
    let Layout { tree, binaries, runs: runs_dir, .. } = layout.clone();
    remove_worktree(root, &tree);

    let task = "xtask bench --compare";
    let mut runner = Runner::new(task, root, 3);
    let tree_arg = tree.display().to_string();
    runner
        .run(&Step::new("worktree", Cmd::git(["worktree", "add", "--detach", tree_arg.as_str(), commit.as_str()])))?;
    // From here on the worktree and the copied binaries are removed however this ends.
    let _cleanup = Cleanup { root: root.to_path_buf(), worktree: tree.clone(), dirs: vec![binaries.clone()] };

    let mut baseline = Side { label: "baseline", tree: tree.clone(), binaries: Vec::new(), runs: Vec::new() };
    let mut candidate = Side { label: "candidate", tree: root.to_path_buf(), binaries: Vec::new(), runs: Vec::new() };
    let [build_baseline, build_candidate] = layout.build_steps(root);
    for (side, build, description) in [
        (&mut baseline, build_baseline, format!("{rev} ({short})")),
        (&mut candidate, build_candidate, "the working tree".to_owned()),
    ] {
        let outcome = runner.run(&build)?;
        let built = bench_executables(&outcome.stdout);
        if built.is_empty() {
            return Err(BenchError::NoBenchExecutables { side: description });
        }
        side.binaries = copy_binaries(&built, &binaries.join(side.label))?;
    }

    let criterion_args = tasks::criterion_args(flags);
    let rounds = usize::try_from(flags.rounds).unwrap_or(usize::MAX);
    runner.expect_more(rounds.saturating_mul(baseline.binaries.len() + candidate.binaries.len()));
    for round in 1..=flags.rounds {
        for side in [&mut baseline, &mut candidate] {
            let home = runs_dir.join(format!("{}-{round}", side.label));
            clear_dir(&home)?;
            let started = SystemTime::now();
            for (_, binary) in &side.binaries {
                let mut args = vec!["--bench".to_owned()];
                args.extend(criterion_args.iter().cloned());
                let cmd =
                    Cmd::new(binary, args).current_dir(&side.tree).env("CRITERION_HOME", home.display().to_string());
                runner.run(&Step::new(side.label, cmd))?;
            }
            side.runs.push(estimates::read_results(&home, Some(started)));
        }
    }
    runner.finish();

    let context = compare::Context {
        rev: rev.to_owned(),
        commit: commit.clone(),
        rounds: flags.rounds,
        threshold_pct: flags.threshold_pct,
        criterion_args,
    };
    let mut report = compare::render(&compare::compare(&baseline.runs, &candidate.runs, flags.threshold_pct), &context);
    let problems: Vec<String> = [&baseline, &candidate]
        .iter()
        .flat_map(|side| {
            side.runs.iter().enumerate().flat_map(move |(round, run)| {
                run.problems.iter().map(move |problem| format!("- {} run {}: {problem}\n", side.label, round + 1))
            })
        })
        .collect();
    if !problems.is_empty() {
        report.push_str("\nResults that could not be used (left out of the table above):\n");
        report.push_str(&problems.concat());
    }
    let candidate_medians = compare::medians(&candidate.runs);
    let rows = ratios::rows(&ratios::RATIOS, &candidate_medians);
    report.push_str(&format!(
        "\n### Targets at this change\n\nRatios of the candidate's medians (over its {} run(s)); targets from \
         issues {}; the other load is the candidate's last run's.\n\n{}",
        flags.rounds,
        ratios::target_issues(&ratios::RATIOS),
        ratios::render(&rows, &[], &candidate.runs.last().map(|run| run.loads.clone()).unwrap_or_default())
    ));
    println!("\n{report}");
    if let Some(path) = &flags.output {
        write_output(path, &report)?;
    }
    Ok(())
}

/// Where `--compare` puts things, under `<target>/xtask-bench`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Layout {
    /// The working tree's target dir.
    target: PathBuf,
    /// The baseline's worktree.
    tree: PathBuf,
    /// The baseline's target dir: never the working tree's (see the module docs).
    baseline_target: PathBuf,
    /// Copies of both sides' bench binaries.
    binaries: PathBuf,
    /// One criterion directory per run.
    runs: PathBuf,
}

impl Layout {
    fn new(target: &Path, short_commit: &str) -> Layout {
        let work = target.join("xtask-bench");
        Layout {
            target: target.to_path_buf(),
            tree: work.join(format!("baseline-{short_commit}")),
            baseline_target: work.join("target"),
            binaries: work.join("bin"),
            runs: work.join("runs"),
        }
    }

    /// The builds of the baseline (in its worktree and target dir, not `--locked`: an
    /// old revision may predate a lock refresh) and of the candidate (`--locked`).
    fn build_steps(&self, root: &Path) -> [Step; 2] {
        let build = |tree: &Path, target: &Path, locked: bool| {
            tasks::bench_build_cmd(locked).current_dir(tree).env("CARGO_TARGET_DIR", target.display().to_string())
        };
        [
            Step::new("build baseline", build(&self.tree, &self.baseline_target, false)).check(Check::CargoJson),
            Step::new("build candidate", build(root, &self.target, true)).check(Check::CargoJson),
        ]
    }
}

/// The commit `rev` names.
fn resolve_commit(rev: &str, root: &Path) -> Result<String, BenchError> {
    let cmd = Cmd::git(["rev-parse", "--verify", "--quiet", &format!("{rev}^{{commit}}")]);
    let unknown = |detail: String| BenchError::UnknownRevision { rev: rev.to_owned(), detail };
    let output = cmd.output(root).map_err(|err| unknown(format!("could not run `{cmd}`: {err}")))?;
    let commit = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if !output.status.success() || commit.is_empty() || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        let stderr = String::from_utf8_lossy(&output.stderr).trim().to_owned();
        let detail = if stderr.is_empty() { format!("`{cmd}` failed ({})", output.status) } else { stderr };
        return Err(unknown(detail));
    }
    Ok(commit)
}

/// The bench executables named in cargo's `--message-format=json` output, by bench
/// name, sorted and without duplicates. Lines that are not JSON artifacts are ignored.
pub(crate) fn bench_executables(stdout: &str) -> Vec<(String, PathBuf)> {
    executables(stdout, "bench")
}

/// The executables of targets of `kind` (`bench`, `example`) named in cargo's
/// `--message-format=json` output, by target name, sorted and without duplicates.
pub(crate) fn executables(stdout: &str, kind: &str) -> Vec<(String, PathBuf)> {
    let mut found: Vec<(String, PathBuf)> = stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|message| message.get("reason").and_then(Value::as_str) == Some("compiler-artifact"))
        .filter_map(|message| {
            let target = message.get("target")?;
            let of_kind = target.get("kind")?.as_array()?.iter().any(|each| each.as_str() == Some(kind));
            let name = target.get("name")?.as_str()?;
            let executable = message.get("executable")?.as_str()?;
            of_kind.then(|| (name.to_owned(), PathBuf::from(executable)))
        })
        .collect();
    found.sort();
    found.dedup_by(|a, b| a.0 == b.0);
    found
}

/// Copies each binary to `dir/<bench name>` (replacing what was there).
fn copy_binaries(built: &[(String, PathBuf)], dir: &Path) -> Result<Vec<(String, PathBuf)>, BenchError> {
    clear_dir(dir)?;
    built
        .iter()
        .map(|(name, source)| {
            let copy = dir.join(name);
            std::fs::copy(source, &copy).map_err(|source| BenchError::Io {
                action: "copy a bench binary to",
                path: copy.clone(),
                source,
            })?;
            Ok((name.clone(), copy))
        })
        .collect()
}

/// Empties `dir` (creating it if needed).
fn clear_dir(dir: &Path) -> Result<(), BenchError> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(BenchError::Io { action: "empty", path: dir.to_path_buf(), source }),
    }
    std::fs::create_dir_all(dir).map_err(|source| BenchError::Io { action: "create", path: dir.to_path_buf(), source })
}

fn write_output(path: &Path, report: &str) -> Result<(), BenchError> {
    std::fs::write(path, report).map_err(|source| BenchError::Io {
        action: "write the table to",
        path: path.to_path_buf(),
        source,
    })?;
    println!("xtask bench: wrote the table to {}", path.display());
    Ok(())
}

/// Removes a worktree left at `path` (by this run, or by an interrupted one) and
/// forgets worktrees whose directories are gone. Best effort: a failure here shows up
/// as a failed `git worktree add`, which says why.
fn remove_worktree(root: &Path, path: &Path) {
    if path.exists() {
        let path_arg = path.display().to_string();
        let _ = Cmd::git(["worktree", "remove", "--force", path_arg.as_str()]).output(root);
        let _ = std::fs::remove_dir_all(path);
    }
    let _ = Cmd::git(["worktree", "prune"]).output(root);
}

/// Removes the baseline worktree and the copied binaries when dropped.
struct Cleanup {
    root: PathBuf,
    worktree: PathBuf,
    dirs: Vec<PathBuf>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        remove_worktree(&self.root, &self.worktree);
        for dir in &self.dirs {
            let _ = std::fs::remove_dir_all(dir);
        }
        if self.worktree.exists() {
            println!(
                "xtask bench: could not remove the worktree {}; remove it with `git worktree remove --force {0}`",
                self.worktree.display()
            );
        } else {
            println!("xtask bench: removed the baseline worktree {}", self.worktree.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_executables_come_from_cargo_json_artifacts() {
        let stdout = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/crates/memory-api#0.1.0","target":{"kind":["lib"],"crate_types":["lib"],"name":"memory_api","src_path":"/w/crates/memory-api/src/lib.rs"},"executable":null,"fresh":true}
{"reason":"compiler-artifact","package_id":"path+file:///w/benches#memory-benches@0.1.0","target":{"kind":["bench"],"crate_types":["bin"],"name":"governor","src_path":"/w/benches/benches/governor.rs"},"executable":"/t/release/deps/governor-1a2b","fresh":false}
{"reason":"compiler-artifact","package_id":"path+file:///w/benches#memory-benches@0.1.0","target":{"kind":["bench"],"crate_types":["bin"],"name":"binding","src_path":"/w/benches/benches/binding.rs"},"executable":"/t/release/deps/binding-3c4d","fresh":true}
{"reason":"build-script-executed","package_id":"x"}
not json at all
{"reason":"build-finished","success":true}
"#;
        assert_eq!(
            bench_executables(stdout),
            [
                ("binding".to_owned(), PathBuf::from("/t/release/deps/binding-3c4d")),
                ("governor".to_owned(), PathBuf::from("/t/release/deps/governor-1a2b")),
            ]
        );
        assert!(bench_executables("").is_empty());
        assert!(
            bench_executables(r#"{"reason":"compiler-artifact","target":{"kind":["bench"],"name":"x"}}"#).is_empty()
        );
    }

    #[test]
    fn the_baseline_never_builds_in_the_working_trees_target_dir() {
        let layout = Layout::new(Path::new("/t"), "0123456789ab");
        assert_eq!(layout.tree, Path::new("/t/xtask-bench/baseline-0123456789ab"));
        let [baseline, candidate] = layout.build_steps(Path::new("/w"));
        assert_eq!(baseline.cmd.dir(), Some(Path::new("/t/xtask-bench/baseline-0123456789ab")));
        assert_eq!(candidate.cmd.dir(), Some(Path::new("/w")));
        assert_eq!(baseline.cmd.env_value("CARGO_TARGET_DIR"), Some("/t/xtask-bench/target"));
        assert_eq!(candidate.cmd.env_value("CARGO_TARGET_DIR"), Some("/t"));
        assert_eq!((baseline.check, candidate.check), (Check::CargoJson, Check::CargoJson));
        assert!(!baseline.cmd.arg_list().contains(&"--locked".to_owned()));
        assert!(candidate.cmd.arg_list().contains(&"--locked".to_owned()));
    }

    #[test]
    fn errors_say_what_was_asked_and_what_to_do() {
        let unknown = BenchError::UnknownRevision { rev: "nope".into(), detail: "fatal: bad revision".into() };
        let text = unknown.to_string();
        assert!(text.contains("`--compare nope`") && text.contains("fatal: bad revision"), "{text}");
        assert!(text.contains("fetch it first"), "{text}");
        let missing = BenchError::MissingResults { names: vec!["bind", "live/none"], home: PathBuf::from("/t/c") };
        assert!(missing.to_string().contains("bind, live/none"), "{missing}");
        assert!(missing.to_string().contains("/t/c"), "{missing}");
    }

    #[test]
    fn an_unknown_revision_is_a_typed_error() {
        let err = resolve_commit("no-such-branch-xtask-test", &tasks::project_root()).unwrap_err();
        assert!(matches!(err, BenchError::UnknownRevision { ref rev, .. } if rev == "no-such-branch-xtask-test"));
    }

    #[test]
    fn clearing_a_directory_empties_or_creates_it() {
        let dir = crate::estimates::tests::TempDir::new("clear");
        let inner = dir.0.join("runs").join("baseline-1");
        clear_dir(&inner).unwrap();
        std::fs::write(inner.join("old"), "x").unwrap();
        clear_dir(&inner).unwrap();
        assert_eq!(std::fs::read_dir(&inner).unwrap().count(), 0);
    }
}
