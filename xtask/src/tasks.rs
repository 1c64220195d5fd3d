//! The tasks: each builds a list of [`Step`]s (or, for `demo`, one command to hand the
//! terminal to). `bench`, whose steps depend on what earlier steps produced, lives in
//! [`crate::bench`] and takes its commands from here.
//!
//! Extending a task means pushing a step.

use std::path::{Path, PathBuf};

use crate::flags;
use crate::step::{Check, Cmd, Step};

/// Preemption bound of the loom step inside `cargo xtask test`.
pub(crate) const LOOM_PREEMPTIONS_IN_TEST: u32 = 2;

/// Crates whose loom models `cargo xtask loom` runs (and whose libraries the loom lint
/// checks): the barrier pair, owner slots and record table, the registry, the governor,
/// the C API's handle tables, the plugin loader (its block records are the record
/// table's, model-checked in memory-sync; the loom lint still checks its library), and
/// the node books' grant, claim and refund protocol.
pub(crate) const LOOM_CRATES: [&str; 7] =
    ["memory-sync", "memory-binding", "memory-governor", "memory-capi", "memory-plugin", "memory-trace", "memory-node"];

/// The steps of `cargo xtask test [--gpu]`, in order.
pub(crate) fn test_steps(flags: &flags::Test) -> Vec<Step> {
    let mut steps = Vec::new();
    if flags.gpu {
        // Fail in seconds, before the long steps, on a machine without a GPU.
        steps.push(
            Step::new(
                "cuda-probe",
                Cmd::cargo(["run", "-q", "--locked", "-p", "allocator-cuda", "--example", "cuda_probe"]),
            )
            .check(Check::CudaDevice),
        );
    }
    steps.push(Step::new("fmt", Cmd::cargo(["fmt", "--all", "--check"])));
    // memory-ort's real-model tests need ONNX Runtime and the models: fetched (once)
    // into target/ort-cache, and required by the tests step below.
    steps.push(crate::ort::fetch_step());
    // The architecture tidy test also runs inside `cargo test --workspace`; running it
    // first on its own reports a layering mistake in seconds rather than minutes.
    steps.push(Step::new("tidy", Cmd::cargo(["test", "--locked", "-p", "xtask", "--test", "tidy"])));
    steps.push(Step::new(
        "clippy",
        Cmd::cargo(["clippy", "--workspace", "--all-targets", "--all-features", "--locked", "--", "-D", "warnings"]),
    ));
    steps.push(
        Step::new("tests", crate::ort::with_assets(Cmd::cargo(["test", "--workspace", "--locked"])))
            .check(Check::Tests),
    );
    steps.push(fuzz_seeds_step(&target_dir()));
    // The optional features (serde, metrics) change what compiles and add tests of
    // their own: run the crates that have them with every feature on.
    let mut features = vec!["test", "--locked", "--all-features"];
    for krate in FEATURE_CRATES {
        features.extend(["-p", krate]);
    }
    steps.push(Step::new("features", Cmd::cargo(features)).check(Check::Tests));
    // The loom models with a low preemption bound (seconds per model); `cargo xtask
    // loom` explores deeper.
    steps.push(loom_lint_step(&loom_target_dir()));
    steps.push(loom_step(LOOM_PREEMPTIONS_IN_TEST, &loom_target_dir()));
    steps.push(budget_step());
    steps.push(Step::new(
        "docs",
        Cmd::cargo(["doc", "--workspace", "--no-deps", "--locked"])
            .env("RUSTDOCFLAGS", extend_flags(std::env::var("RUSTDOCFLAGS").ok(), "-D warnings")),
    ));
    steps.push(package_step());
    if flags.gpu {
        steps.push(
            Step::new(
                "gpu-tests",
                crate::ort::with_assets(Cmd::cargo([
                    "test",
                    "-p",
                    "allocator-cuda",
                    "-p",
                    "memory-ort",
                    "--locked",
                    "--",
                    "--ignored",
                    "gpu_",
                ])),
            )
            .check(Check::GpuTests),
        );
    }
    steps
}

/// `cargo xtask budget` as a step: the hot path's instruction counts against the
/// checked-in budget ([`crate::budget`]), in a process of its own (it builds the
/// counting programs, then counts and judges in xtask).
pub(crate) fn budget_step() -> Step {
    Step::new("budget", Cmd::cargo(["run", "--quiet", "--locked", "--package", "xtask", "--", "budget"]))
}

/// The fuzz harness's own tests on stable Rust: fixed seeds replayed through the same
/// harness (and the same reference model, `memory_testkit::reference`) that libFuzzer
/// drives under `cargo xtask fuzz`. `fuzz/` is a workspace of its own (nightly and
/// libFuzzer stay out of the main lock file); it builds in the main target directory so
/// the dependencies it shares are not built twice.
pub(crate) fn fuzz_seeds_step(target_dir: &Path) -> Step {
    let manifest = project_root().join("fuzz").join("Cargo.toml");
    Step::new(
        "fuzz-seeds",
        Cmd::cargo([
            "test".to_owned(),
            "--locked".to_owned(),
            "--manifest-path".to_owned(),
            manifest.display().to_string(),
            "--target-dir".to_owned(),
            target_dir.display().to_string(),
        ]),
    )
    .check(Check::Tests)
}

/// The crates with optional features (`serde`, `metrics`) whose tests the `features`
/// step runs with every feature on.
pub(crate) const FEATURE_CRATES: [&str; 3] = ["memory-api", "memory-binding", "memory-governor"];

/// The crates published to the registry, in dependency order: the core and the
/// providers, then the adapters a runtime adds from the registry.
pub(crate) const PUBLISHED_CRATES: [&str; 12] = [
    "memory-api",
    "memory-sync",
    "memory-binding",
    "memory-governor",
    "allocator-cpu",
    "allocator-cuda",
    "memory-plugin-abi",
    "memory-plugin",
    "memory-ort",
    "memory-trace",
    "memory-capi",
    "memory-node",
];

/// `cargo package` of every published crate together: cargo verifies each against the
/// others packaged into a local registry, so a missing version, a file left out of a
/// package or a dependency only the workspace provides fails here, not at release time.
/// `--allow-dirty` lets a developer run it before committing; CI runs on a clean clone.
pub(crate) fn package_step() -> Step {
    let mut args = vec!["package", "--locked", "--allow-dirty"];
    for krate in PUBLISHED_CRATES {
        args.extend(["-p", krate]);
    }
    Step::new("package", Cmd::cargo(args))
}

/// Removes what an earlier `package` step unpacked of our own crates. Cargo verifies a
/// package against the others through a local registry and unpacks each into
/// `$CARGO_HOME/registry/src/-<hash>/<crate>-<version>`; it reuses that directory when
/// it exists, so after a change at the same version it would build the old sources.
/// Only directories of local registries (named `-<hash>`) and of our published crates
/// are touched; a missing or unreadable directory is not an error.
pub(crate) fn clear_stale_package_sources() {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cargo")));
    let Some(sources) = home.map(|home| home.join("registry").join("src")) else { return };
    let Ok(registries) = std::fs::read_dir(&sources) else { return };
    for registry in registries.filter_map(Result::ok) {
        if !registry.file_name().to_string_lossy().starts_with('-') {
            continue; // a remote registry's sources: never ours to touch
        }
        let Ok(unpacked) = std::fs::read_dir(registry.path()) else { continue };
        for dir in unpacked.filter_map(Result::ok) {
            let name = dir.file_name().to_string_lossy().into_owned();
            let ours = PUBLISHED_CRATES.iter().any(|krate| {
                name.strip_prefix(krate)
                    .and_then(|rest| rest.strip_prefix('-'))
                    .is_some_and(|v| v.starts_with(|c: char| c.is_ascii_digit()))
            });
            if ours {
                let _ = std::fs::remove_dir_all(dir.path());
            }
        }
    }
    forget_registry_builds(&target_dir());
}

/// Makes cargo rebuild what it built of our published crates from a local registry's
/// unpacked copy: it fingerprints a registry package by name and version, not by its
/// contents, so after a change at the same version the `package` step would link the
/// old build against the new sources. A build is recognised by its dep-info file
/// (`<profile>/deps/<crate>-<hash>.d`) naming sources under `registry/src/-<hash>`; its
/// fingerprint directory is removed. Builds from the workspace itself are untouched.
fn forget_registry_builds(target: &Path) {
    for profile in ["debug", "release"] {
        let Ok(entries) = std::fs::read_dir(target.join(profile).join("deps")) else { continue };
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some((krate, hash)) = name.strip_suffix(".d").and_then(|stem| stem.rsplit_once('-')) else {
                continue;
            };
            let Some(published) = PUBLISHED_CRATES.iter().find(|published| published.replace('-', "_") == krate) else {
                continue;
            };
            let from_local_registry = std::fs::read_to_string(entry.path())
                .is_ok_and(|info| info.contains("/registry/src/-") || info.contains("\\registry\\src\\-"));
            if from_local_registry {
                let fingerprint = target.join(profile).join(".fingerprint").join(format!("{published}-{hash}"));
                let _ = std::fs::remove_dir_all(fingerprint);
            }
        }
    }
}

/// The loom step: the `--lib` tests of [`LOOM_CRATES`] whose names contain `loom`, in
/// release mode with `--cfg memory_loom`, built in `target_dir` so that the changed
/// `RUSTFLAGS` never invalidate the normal build.
pub(crate) fn loom_step(preemptions: u32, target_dir: &Path) -> Step {
    let mut args = vec!["test".to_owned(), "--release".to_owned(), "--locked".to_owned(), "--lib".to_owned()];
    for krate in LOOM_CRATES {
        args.extend(["-p".to_owned(), krate.to_owned()]);
    }
    args.extend(["--target-dir".to_owned(), target_dir.display().to_string(), "loom".to_owned()]);
    Step::new(
        "loom",
        Cmd::cargo(args)
            .env("RUSTFLAGS", extend_flags(std::env::var("RUSTFLAGS").ok(), "--cfg memory_loom"))
            .env("LOOM_MAX_PREEMPTIONS", preemptions.to_string()),
    )
    .check(Check::LoomModels)
}

/// Clippy's configuration for [`loom_lint_step`], relative to the project root.
pub(crate) const LOOM_LINT_CONFIG_DIR: &str = "xtask/loom-lint";

/// Clippy over the libraries of [`LOOM_CRATES`] built with `--cfg memory_loom`, with
/// the configuration in [`LOOM_LINT_CONFIG_DIR`]: there every synchronisation
/// primitive should come from loom through the crate's `sync` shim, so each std one
/// left (a `disallowed-types` hit) is a bypass the models would never see. Shares the
/// loom step's target directory, whose flags it matches.
pub(crate) fn loom_lint_step(target_dir: &Path) -> Step {
    let mut args = vec!["clippy".to_owned(), "--locked".to_owned(), "--no-deps".to_owned(), "--lib".to_owned()];
    for krate in LOOM_CRATES {
        args.extend(["-p".to_owned(), krate.to_owned()]);
    }
    args.extend(["--target-dir".to_owned(), target_dir.display().to_string()]);
    args.extend(["--".to_owned(), "-D".to_owned(), "warnings".to_owned()]);
    Step::new(
        "loom-lint",
        Cmd::cargo(args)
            .env("RUSTFLAGS", extend_flags(std::env::var("RUSTFLAGS").ok(), "--cfg memory_loom"))
            .env("CLIPPY_CONF_DIR", project_root().join(LOOM_LINT_CONFIG_DIR).display().to_string()),
    )
}

/// The steps of `cargo xtask loom`.
pub(crate) fn loom_steps(flags: &flags::Loom) -> Vec<Step> {
    vec![loom_lint_step(&loom_target_dir()), loom_step(flags.preemptions, &loom_target_dir())]
}

/// The package that holds the criterion benches.
pub(crate) const BENCH_PACKAGE: &str = "memory-benches";

/// The stress test of memory-binding (bounded by `MEMORY_STRESS_SECS`). memory-governor's
/// concurrency tests read no such variable: they are fixed-size and run in
/// `cargo xtask test`.
pub(crate) const STRESS_TEST: (&str, &str) = ("memory-binding", "stress");

/// The criterion flags every bench binary gets: `--warm-up-time`, `--measurement-time`,
/// then whatever followed `--`.
pub(crate) fn criterion_args(flags: &flags::Bench) -> Vec<String> {
    let mut args = vec![
        "--warm-up-time".to_owned(),
        flags.warm_up_secs.to_string(),
        "--measurement-time".to_owned(),
        flags.measurement_secs.to_string(),
    ];
    args.extend(flags.criterion_args.iter().cloned());
    args
}

/// `cargo bench` of every bench target (not the library, whose libtest harness would
/// reject criterion's flags) of [`BENCH_PACKAGE`], writing criterion's results under
/// `criterion_home`.
pub(crate) fn bench_cmd(flags: &flags::Bench, criterion_home: &Path) -> Cmd {
    let mut args: Vec<String> =
        ["bench", "--locked", "-p", BENCH_PACKAGE, "--bench", "*", "--"].map(String::from).to_vec();
    args.extend(criterion_args(flags));
    Cmd::cargo(args).env("CRITERION_HOME", criterion_home.display().to_string())
}

/// The steps of `cargo xtask bench --gpu`: the device probe of `test --gpu`, then the
/// CUDA bench alone (it prints its own table of medians and ratios).
pub(crate) fn gpu_bench_steps(flags: &flags::Bench, criterion_home: &Path) -> Vec<Step> {
    let mut args: Vec<String> =
        ["bench", "--locked", "-p", BENCH_PACKAGE, "--bench", "cuda", "--"].map(String::from).to_vec();
    args.extend(criterion_args(flags));
    vec![
        Step::new(
            "cuda-probe",
            Cmd::cargo(["run", "-q", "--locked", "-p", "allocator-cuda", "--example", "cuda_probe"]),
        )
        .check(Check::CudaDevice),
        Step::new("cuda-bench", Cmd::cargo(args).env("CRITERION_HOME", criterion_home.display().to_string())),
    ]
}

/// Builds the bench binaries of [`BENCH_PACKAGE`] without running them; cargo's JSON
/// messages on stdout name the executables. `locked` adds `--locked` (the working tree;
/// a baseline revision may predate a lock refresh).
pub(crate) fn bench_build_cmd(locked: bool) -> Cmd {
    let mut args = vec!["bench", "--no-run", "--message-format=json-render-diagnostics"];
    if locked {
        args.push("--locked");
    }
    args.extend(["-p", BENCH_PACKAGE, "--bench", "*"]);
    Cmd::cargo(args)
}

/// The steps of `cargo xtask stress --secs N`.
pub(crate) fn stress_steps(flags: &flags::Stress) -> Vec<Step> {
    let (krate, test) = STRESS_TEST;
    vec![
        Step::new(
            "stress",
            Cmd::cargo(["test", "--release", "--locked", "-p", krate, "--test", test, "--", "--nocapture"])
                .env("MEMORY_STRESS_SECS", flags.secs.to_string()),
        )
        .check(Check::Stress),
    ]
}

/// The step of `cargo xtask miri`: the script picks the crates and the Miri flags and
/// installs the component when it is missing.
pub(crate) fn miri_steps() -> Vec<Step> {
    vec![Step::new("miri", Cmd::new("bash", ["scripts/miri.sh"]))]
}

/// The step of `cargo xtask fuzz`: libFuzzer on the registry_ops target for `secs`.
/// Runs the rustup proxy (`cargo +nightly`), not `$CARGO`, since fuzzing needs nightly.
pub(crate) fn fuzz_steps(flags: &flags::Fuzz) -> Vec<Step> {
    let time = format!("-max_total_time={}", flags.secs);
    vec![Step::new("fuzz", Cmd::new("cargo", ["+nightly", "fuzz", "run", "registry_ops", "--", time.as_str()]))]
}

/// The crates `cargo xtask mutants` mutates: the registry and the governor, whose
/// tests must catch at least 90% of viable mutants per file.
pub(crate) const MUTATED_CRATES: [&str; 2] = ["memory-binding", "memory-governor"];

/// `cargo xtask mutants [--file F]`: cargo-mutants over [`MUTATED_CRATES`] (or one
/// file), in two passes. The first tests each mutant with the mutated crate's own tests
/// (the stress and property tests shortened, so a mutant that hangs a protocol times
/// out rather than running for the full budget). The second (`--iterate`: only the
/// mutants the first neither caught nor found unviable) builds the crate with
/// `--cfg memory_loom` and runs its loom models, as the loom step does: a mutant of a
/// concurrent protocol may show only under an interleaving. The second pass's
/// `mutants.out` is the verdict (`missed.txt` there: missed by both; its
/// `previously_caught.txt`: what the first caught). Slow (minutes per file): a weekly
/// workflow runs it, not CI.
pub(crate) fn mutants_steps(flags: &flags::Mutants) -> Vec<Step> {
    // Every feature on: code behind one (the governor's `metrics` publication, the
    // registry's `hot-path-trace` events, `serde`) is otherwise not compiled, so its
    // mutants build unchanged and pass as missed, and the tests that would catch them
    // (gated on the same features) do not run.
    let mut args: Vec<String> =
        ["mutants", "--all-features", "--no-shuffle", "--timeout-multiplier", "3"].map(String::from).to_vec();
    for krate in MUTATED_CRATES {
        args.extend(["--package".to_owned(), krate.to_owned()]);
    }
    if let Some(file) = &flags.file {
        args.extend(["--file".to_owned(), file.display().to_string()]);
    }
    // cargo-mutants exits 2 when a mutant survives and 3 when one times out: the loom
    // pass retries those, so only the first pass's other failures stop the task.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut tests = vec!["-c".to_owned(), r#""$@"; s=$?; [ $s -eq 0 ] || [ $s -eq 2 ] || [ $s -eq 3 ]"#.to_owned()];
    tests.extend(["mutants-tests".to_owned(), cargo]);
    tests.extend(args.iter().cloned());
    let tests = Cmd::new("bash", tests).env("MEMORY_STRESS_SECS", "1").env("PROPTEST_CASES", "32");
    let mut loom = args;
    loom.extend(["--iterate", "--profile", "release", "--cargo-arg=--lib", "--", "--", "loom"].map(String::from));
    let loom = Cmd::cargo(loom)
        .env("RUSTFLAGS", extend_flags(std::env::var("RUSTFLAGS").ok(), "--cfg memory_loom"))
        .env("LOOM_MAX_PREEMPTIONS", LOOM_PREEMPTIONS_IN_TEST.to_string());
    vec![Step::new("mutants", tests), Step::new("mutants-loom", loom)]
}

/// The command `cargo xtask demo ARGS` runs.
pub(crate) fn demo_cmd(flags: &flags::Demo) -> Cmd {
    let mut args: Vec<String> = ["run", "--release", "-q", "-p", "memory-demo"].map(String::from).to_vec();
    // CUDA is an optional feature of the demo: enable it only when asked to use it.
    if flags.args.iter().any(|arg| arg == "--gpu") {
        args.extend(["--features".to_owned(), "cuda".to_owned()]);
    }
    args.push("--".to_owned());
    args.extend(flags.args.iter().cloned());
    Cmd::cargo(args)
}

/// The workspace root (the parent of xtask's manifest directory).
pub(crate) fn project_root() -> PathBuf {
    let manifest_dir =
        std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    manifest_dir.parent().map_or(manifest_dir.clone(), Path::to_path_buf)
}

/// `target/loom` under the target directory in use (`$CARGO_TARGET_DIR` or `target/`).
pub(crate) fn loom_target_dir() -> PathBuf {
    target_dir().join("loom")
}

/// The target directory in use: `$CARGO_TARGET_DIR` (made absolute) or the project's
/// `target/`.
pub(crate) fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                std::env::current_dir().map_or_else(|_| project_root().join(&dir), |cwd| cwd.join(&dir))
            }
        }
        None => project_root().join("target"),
    }
}

/// `existing` flags (from the environment) with `extra` appended.
pub(crate) fn extend_flags(existing: Option<String>, extra: &str) -> String {
    match existing {
        Some(flags) if !flags.trim().is_empty() => format!("{} {extra}", flags.trim()),
        _ => extra.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_builds_of_our_crates_from_a_local_registry_are_forgotten() {
        let target = std::env::temp_dir().join(format!("xtask-forget-{}", std::process::id()));
        let (deps, fingerprints) = (target.join("debug/deps"), target.join("debug/.fingerprint"));
        std::fs::create_dir_all(&deps).unwrap();
        let builds = [
            ("memory_sync-aaa.d", "memory-sync-aaa", "/home/u/.cargo/registry/src/-1f2e/memory-sync-0.1.0/src/lib.rs"),
            ("memory_sync-bbb.d", "memory-sync-bbb", "/work/crates/memory-sync/src/lib.rs"),
            ("memory_api-ccc.d", "memory-api-ccc", "/home/u/.cargo/registry/src/-1f2e/memory-api-0.1.0/src/lib.rs"),
            ("serde-ddd.d", "serde-ddd", "/home/u/.cargo/registry/src/-1f2e/serde-1.0.0/src/lib.rs"),
        ];
        for (info, fingerprint, source) in builds {
            std::fs::write(deps.join(info), format!("{source}:\n")).unwrap();
            std::fs::create_dir_all(fingerprints.join(fingerprint)).unwrap();
        }
        forget_registry_builds(&target);
        let left = |fingerprint: &str| fingerprints.join(fingerprint).exists();
        assert!(!left("memory-sync-aaa") && !left("memory-api-ccc"), "our crates built from a local registry");
        assert!(left("memory-sync-bbb"), "a workspace build is kept");
        assert!(left("serde-ddd"), "another crate is never touched");
        std::fs::remove_dir_all(&target).unwrap();
    }

    fn names(steps: &[Step]) -> Vec<&'static str> {
        steps.iter().map(|step| step.name).collect()
    }

    #[test]
    fn test_runs_fmt_tidy_clippy_tests_docs_in_that_order() {
        let steps = test_steps(&flags::Test { gpu: false });
        assert_eq!(
            names(&steps),
            [
                "fmt",
                "ort-fetch",
                "tidy",
                "clippy",
                "tests",
                "fuzz-seeds",
                "features",
                "loom-lint",
                "loom",
                "budget",
                "docs",
                "package"
            ]
        );
        let checks: Vec<Check> = steps.iter().map(|step| step.check).collect();
        assert_eq!(
            checks,
            [
                Check::Success,
                Check::Success,
                Check::Success,
                Check::Success,
                Check::Tests,
                Check::Tests,
                Check::Tests,
                Check::Success,
                Check::LoomModels,
                Check::Success,
                Check::Success,
                Check::Success
            ]
        );
        assert_eq!(steps[4].cmd.env_value(crate::ort::REQUIRED_ENV), Some("1"), "real-model tests never skip");
        let loom = &steps[8];
        assert_eq!(loom.cmd.env_value("LOOM_MAX_PREEMPTIONS"), Some("2"));
        assert_eq!(steps[9].cmd.to_string(), "cargo run --quiet --locked --package xtask -- budget");
    }

    #[test]
    fn gpu_probes_first_and_runs_the_gpu_tests_last() {
        let steps = test_steps(&flags::Test { gpu: true });
        assert_eq!(
            names(&steps),
            [
                "cuda-probe",
                "fmt",
                "ort-fetch",
                "tidy",
                "clippy",
                "tests",
                "fuzz-seeds",
                "features",
                "loom-lint",
                "loom",
                "budget",
                "docs",
                "package",
                "gpu-tests"
            ]
        );
        assert_eq!(steps[0].check, Check::CudaDevice);
        let gpu = steps.last().unwrap();
        assert_eq!(gpu.check, Check::GpuTests);
        assert!(gpu.cmd.arg_list().ends_with(&["--".into(), "--ignored".into(), "gpu_".into()]));
        assert!(gpu.cmd.to_string().contains("-p memory-ort"), "{}", gpu.cmd);
    }

    #[test]
    fn building_steps_are_locked_and_clippy_denies_warnings() {
        for step in test_steps(&flags::Test { gpu: true }) {
            if step.name != "fmt" && step.name != "ort-fetch" {
                assert!(step.cmd.arg_list().contains(&"--locked".to_owned()), "{} is not --locked", step.name);
            }
        }
        let steps = test_steps(&flags::Test::default());
        let clippy = steps.iter().find(|step| step.name == "clippy").unwrap();
        assert!(clippy.cmd.to_string().ends_with("-- -D warnings"), "{}", clippy.cmd);
        let docs = steps.iter().find(|step| step.name == "docs").unwrap();
        assert!(docs.cmd.env_value("RUSTDOCFLAGS").unwrap().ends_with("-D warnings"));
    }

    /// The crates with loom models, as both loom steps must name them (written out, not
    /// taken from `LOOM_CRATES`, so a crate dropped from that list fails here).
    const LOOM_PACKAGE_ARGS: [&str; 7] = [
        "-p memory-sync",
        "-p memory-binding",
        "-p memory-governor",
        "-p memory-capi",
        "-p memory-plugin",
        "-p memory-trace",
        "-p memory-node",
    ];

    #[test]
    fn loom_builds_in_its_own_target_dir_with_the_namespaced_cfg() {
        let step = loom_step(2, Path::new("/tmp/t/loom"));
        assert_eq!(step.check, Check::LoomModels);
        assert_eq!(step.cmd.env_value("LOOM_MAX_PREEMPTIONS"), Some("2"));
        assert!(step.cmd.env_value("RUSTFLAGS").unwrap().ends_with("--cfg memory_loom"));
        let line = step.cmd.to_string();
        for part in ["--release", "--lib", "--target-dir /tmp/t/loom"].into_iter().chain(LOOM_PACKAGE_ARGS) {
            assert!(line.contains(part), "{line} lacks {part}");
        }
        assert!(line.ends_with(" loom"), "{line}");
        assert!(loom_target_dir().ends_with("loom"));
    }

    #[test]
    fn loom_lint_lints_only_our_libraries_under_the_loom_cfg_with_its_own_config() {
        let step = loom_lint_step(Path::new("/tmp/t/loom"));
        assert!(step.cmd.env_value("RUSTFLAGS").unwrap().ends_with("--cfg memory_loom"));
        let config = PathBuf::from(step.cmd.env_value("CLIPPY_CONF_DIR").unwrap());
        let toml = std::fs::read_to_string(config.join("clippy.toml")).expect("the loom lint config exists");
        for banned in ["std::sync::Mutex", "std::sync::atomic::AtomicU64", "std::sync::atomic::fence"] {
            assert!(toml.contains(&format!("\"{banned}\"")), "the loom lint config does not ban {banned}");
        }
        let line = step.cmd.to_string();
        for part in ["clippy", "--no-deps", "--lib", "--target-dir /tmp/t/loom"].into_iter().chain(LOOM_PACKAGE_ARGS) {
            assert!(line.contains(part), "{line} lacks {part}");
        }
        assert!(line.ends_with("-- -D warnings"), "{line}");
        let names: Vec<_> = loom_steps(&flags::Loom { preemptions: 3 }).iter().map(|step| step.name).collect();
        assert_eq!(names, ["loom-lint", "loom"]);
    }

    #[test]
    fn bench_runs_only_bench_targets_with_criterion_settings_and_home() {
        let flags = flags::Bench {
            warm_up_secs: 0.5,
            measurement_secs: 3.0,
            criterion_args: vec!["pair".into()],
            ..flags::Bench::default()
        };
        let cmd = bench_cmd(&flags, Path::new("/t/criterion"));
        assert_eq!(
            cmd.to_string(),
            "CRITERION_HOME=/t/criterion cargo bench --locked -p memory-benches --bench \"*\" -- \
             --warm-up-time 0.5 --measurement-time 3 pair"
        );
        assert_eq!(criterion_args(&flags::Bench::default()), ["--warm-up-time", "1", "--measurement-time", "2"]);
        let build = bench_build_cmd(false).to_string();
        assert!(
            build.ends_with("bench --no-run --message-format=json-render-diagnostics -p memory-benches --bench \"*\"")
        );
        assert!(bench_build_cmd(true).arg_list().contains(&"--locked".to_owned()));
    }

    #[test]
    fn stress_runs_the_registry_stress_test_for_the_asked_seconds() {
        let steps = stress_steps(&flags::Stress { secs: 45 });
        assert_eq!(names(&steps), ["stress"]);
        assert_eq!(steps[0].check, Check::Stress);
        assert_eq!(steps[0].cmd.env_value("MEMORY_STRESS_SECS"), Some("45"));
        assert!(
            steps[0]
                .cmd
                .to_string()
                .ends_with("cargo test --release --locked -p memory-binding --test stress -- --nocapture"),
            "{}",
            steps[0].cmd
        );
    }

    #[test]
    fn gpu_bench_probes_first_then_runs_only_the_cuda_bench() {
        let flags = flags::Bench { gpu: true, ..flags::Bench::default() };
        let steps = gpu_bench_steps(&flags, Path::new("/tmp/criterion"));
        assert_eq!(names(&steps), ["cuda-probe", "cuda-bench"]);
        assert_eq!(steps[0].check, Check::CudaDevice);
        assert!(steps[1].cmd.to_string().contains("--bench cuda --"), "{}", steps[1].cmd);
    }

    #[test]
    fn miri_runs_the_script_and_fuzz_bounds_libfuzzer_by_time() {
        let miri = miri_steps();
        assert_eq!(miri[0].cmd.to_string(), "bash scripts/miri.sh");
        let fuzz = fuzz_steps(&flags::Fuzz { secs: 90 });
        assert_eq!(fuzz[0].cmd.to_string(), "cargo +nightly fuzz run registry_ops -- -max_total_time=90");
    }

    #[test]
    fn mutants_covers_both_core_crates_or_one_file() {
        let all = mutants_steps(&flags::Mutants { file: None });
        let cmd = all[0].cmd.to_string();
        assert!(cmd.contains("--package memory-binding --package memory-governor"), "{cmd}");
        assert!(!cmd.contains("--file"), "{cmd}");
        // Feature-gated code (metrics, hot-path-trace, serde) is mutated and tested too.
        assert!(cmd.contains("mutants --all-features"), "{cmd}");
        let file = "crates/memory-governor/src/allocator.rs";
        let one = mutants_steps(&flags::Mutants { file: Some(file.into()) });
        assert!(one[0].cmd.to_string().ends_with(&format!("--file {file}")), "{}", one[0].cmd);
        assert_eq!(one[0].cmd.env_value("MEMORY_STRESS_SECS"), Some("1"));
    }

    #[test]
    fn mutants_retries_what_the_tests_missed_under_the_loom_models() {
        let steps = mutants_steps(&flags::Mutants { file: Some("crates/memory-governor/src/credit.rs".into()) });
        assert_eq!(steps.iter().map(|step| step.name).collect::<Vec<_>>(), ["mutants", "mutants-loom"]);
        // The first pass may miss (2) or time out (3): the second decides.
        let first = steps[0].cmd.arg_list();
        assert!(first[1].ends_with("[ $s -eq 2 ] || [ $s -eq 3 ]"), "{first:?}");
        assert!(Path::new(&first[3]).file_stem().is_some_and(|stem| stem == "cargo"), "{first:?}");
        assert_eq!(first[4], "mutants", "{first:?}");
        let loom = &steps[1].cmd;
        assert!(loom.arg_list().contains(&"--all-features".to_owned()), "{loom}");
        let args = loom.arg_list();
        assert!(args.contains(&"--iterate".to_owned()) && args.contains(&"--file".to_owned()), "{loom}");
        assert!(loom.to_string().ends_with("--profile release --cargo-arg=--lib -- -- loom"), "{loom}");
        assert!(loom.env_value("RUSTFLAGS").is_some_and(|flags| flags.ends_with("--cfg memory_loom")), "{loom}");
        assert_eq!(loom.env_value("LOOM_MAX_PREEMPTIONS"), Some("2"));
    }

    #[test]
    fn demo_enables_cuda_only_for_gpu_runs() {
        let cmd = demo_cmd(&flags::Demo { args: vec!["--gpu".into()] });
        assert!(cmd.to_string().ends_with("-p memory-demo --features cuda -- --gpu"), "{cmd}");
        let cmd = demo_cmd(&flags::Demo { args: vec!["--seed".into(), "3".into()] });
        assert!(!cmd.to_string().contains("cuda"), "{cmd}");
    }

    #[test]
    fn demo_forwards_its_arguments_after_a_separator() {
        let cmd = demo_cmd(&flags::Demo { args: vec!["--help".into()] });
        assert!(cmd.to_string().ends_with("run --release -q -p memory-demo -- --help"), "{cmd}");
    }

    #[test]
    fn extra_flags_are_appended_to_the_environment() {
        assert_eq!(extend_flags(None, "-D warnings"), "-D warnings");
        assert_eq!(extend_flags(Some("  ".into()), "-D warnings"), "-D warnings");
        assert_eq!(extend_flags(Some("-C target-cpu=native".into()), "--cfg x"), "-C target-cpu=native --cfg x");
    }

    #[test]
    fn project_root_holds_the_workspace_manifest() {
        assert!(project_root().join("Cargo.toml").is_file());
        assert!(project_root().join("xtask").is_dir());
    }
}
