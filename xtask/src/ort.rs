//! memory-ort's real-model assets and tasks: the fetch step (`scripts/ort_fetch.py`:
//! pip downloads the pinned ONNX Runtime, Silero VAD and RapidOCR wheels into
//! `target/ort-cache/wheels` and extracts the runtime library and four models; nothing
//! binary is committed), the environment that points the tests at the cache and makes
//! them required, `demo --ort`, and `bench --ort`.

use std::path::PathBuf;

use crate::flags;
use crate::step::{Cmd, Step};
use crate::tasks;

/// Where the tests, demo and bench find the cache (memory-ort's `assets::CACHE_ENV`).
pub(crate) const CACHE_ENV: &str = "MEMORY_ORT_CACHE";

/// Makes a missing asset fail the real-model tests instead of skipping them
/// (memory-ort's `assets::REQUIRED_ENV`).
pub(crate) const REQUIRED_ENV: &str = "MEMORY_ORT_REQUIRED";

/// The cache: `ort-cache` under the target directory in use.
pub(crate) fn cache_dir() -> PathBuf {
    tasks::target_dir().join("ort-cache")
}

/// Downloads (once) and extracts the runtime and models; on failure the script prints
/// one line with the command to retry.
pub(crate) fn fetch_step() -> Step {
    Step::new("ort-fetch", Cmd::new("python3", ["scripts/ort_fetch.py".to_owned(), cache_dir().display().to_string()]))
}

/// `cmd` pointed at the cache, with the real-model tests required (never skipped).
pub(crate) fn with_assets(cmd: Cmd) -> Cmd {
    cmd.env(CACHE_ENV, cache_dir().display().to_string()).env(REQUIRED_ENV, "1")
}

/// Whether `cargo xtask demo ARGS` is the real mode.
pub(crate) fn is_demo_ort(demo: &flags::Demo) -> bool {
    demo.args.first().is_some_and(|arg| arg == "--ort")
}

/// The steps of `cargo xtask bench --ort`: fetch, then the ort-bench binary (release),
/// which runs every (model, configuration) in its own process and prints the table,
/// then the multi-session case (N = 2 and 4 sessions of one tenant, two models each, on
/// threads at once: one governed pool over `Governor::cache_backing` shared by all of
/// them vs an ONNX Runtime arena per model) and its table. Arguments after `--` go to
/// the binary (`--rounds N`, `--sessions 2,4` or `0` to skip the multi-session case,
/// `--multi-rounds N`, `--multi-requests N`, and the others its docs list).
pub(crate) fn bench_steps(flags: &flags::Bench) -> Vec<Step> {
    let mut args: Vec<String> =
        ["run", "--release", "-q", "--locked", "-p", "memory-benches", "--bin", "ort-bench", "--"]
            .map(String::from)
            .to_vec();
    args.extend(flags.criterion_args.iter().cloned());
    vec![fetch_step(), Step::new("ort-bench", with_assets(Cmd::cargo(args)))]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetch_runs_the_script_into_the_cache_under_the_target_dir() {
        let step = fetch_step();
        assert_eq!(step.name, "ort-fetch");
        let line = step.cmd.to_string();
        assert!(line.starts_with("python3 scripts/ort_fetch.py "), "{line}");
        assert!(line.ends_with("ort-cache"), "{line}");
    }

    #[test]
    fn tests_get_the_cache_and_are_required() {
        let cmd = with_assets(Cmd::cargo(["test"]));
        assert_eq!(cmd.env_value(REQUIRED_ENV), Some("1"));
        assert!(cmd.env_value(CACHE_ENV).is_some_and(|dir| dir.ends_with("ort-cache")));
    }

    #[test]
    fn bench_ort_fetches_then_runs_the_release_binary_with_extra_args() {
        let flags =
            flags::Bench { ort: true, criterion_args: vec!["--rounds".into(), "2".into()], ..Default::default() };
        let steps = bench_steps(&flags);
        let names: Vec<&str> = steps.iter().map(|step| step.name).collect();
        assert_eq!(names, ["ort-fetch", "ort-bench"]);
        let line = steps[1].cmd.to_string();
        assert!(line.contains("--release") && line.contains("--bin ort-bench -- --rounds 2"), "{line}");
        assert_eq!(steps[1].cmd.env_value(REQUIRED_ENV), Some("1"));
    }

    #[test]
    fn bench_ort_forwards_the_multi_session_flags() {
        let args = ["--sessions", "2,4", "--multi-rounds", "1", "--multi-requests", "6"].map(String::from).to_vec();
        let steps = bench_steps(&flags::Bench { ort: true, criterion_args: args, ..Default::default() });
        let line = steps[1].cmd.to_string();
        assert!(line.ends_with("--bin ort-bench -- --sessions 2,4 --multi-rounds 1 --multi-requests 6"), "{line}");
    }

    #[test]
    fn only_a_leading_ort_flag_selects_the_real_demo() {
        assert!(is_demo_ort(&flags::Demo { args: vec!["--ort".into(), "--requests".into(), "5".into()] }));
        assert!(!is_demo_ort(&flags::Demo { args: vec!["--seed".into(), "--ort".into()] }));
        assert!(!is_demo_ort(&flags::Demo::default()));
    }
}
