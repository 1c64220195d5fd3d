//! C and C++ programs, built at test time with the system compiler against the static
//! library and the checked-in headers, drive the registry and the governor through
//! `include/memory_capi.h` and check every status: the smoke programs (C and C++), every
//! allocator kind end to end (`tests/c/kinds.c`: system, pooled, virtual, shared, a C
//! vtable), and the contract a C programmer relies on (`tests/c/contract.c`: argument
//! checks before any effect, destroy rules, queue capacity, reclaim holders, messages in
//! C terms), and suspect plugin blocks (`tests/c/suspects.c`: an unknown status or an
//! overlap keeps the block, the instance and the library until a suspect retry). Every program also runs under valgrind, which must report no error and no
//! leak, and under AddressSanitizer + UndefinedBehaviorSanitizer (gcc's
//! `-fsanitize=address,undefined`, leak detection on, every finding fatal).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use memory_testkit::native::{Language, NativeBuild};

fn manifest() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The static library cargo built for this test run. The library declares
/// `crate-type = ["cdylib", "staticlib", "rlib"]`, so the one rustc invocation that makes
/// the rlib this test links against also writes `libmemory_capi.a` beside the test
/// executable (`target/<profile>/deps`): the same sources and features, and no second
/// build of the dependency tree in a target directory of its own.
fn static_library() -> &'static Path {
    static LIBRARY: OnceLock<PathBuf> = OnceLock::new();
    LIBRARY.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test knows its own path");
        let deps = exe.parent().expect("the test executable lives in a directory");
        let library = deps.join("libmemory_capi.a");
        assert!(
            library.exists(),
            "cargo built no {} beside this test; build it with `cargo test -p memory-capi --no-run` \
             (memory-capi's Cargo.toml must keep \"staticlib\" in [lib] crate-type)",
            library.display()
        );
        library
    })
}

fn build(language: Language, source: &str, name: &str) -> PathBuf {
    build_with(language, source, name, &[])
}

/// The flags of a sanitizer build: AddressSanitizer (leaks included) and
/// UndefinedBehaviorSanitizer, every finding fatal.
const SANITIZERS: &[&str] = &["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"];

fn build_with(language: Language, source: &str, name: &str, flags: &[&str]) -> PathBuf {
    let mut build = NativeBuild::new(language)
        .source(manifest().join(source))
        .include(manifest().join("../../include"))
        .include(manifest().join("tests/c"));
    for flag in flags {
        build = build.arg(*flag);
    }
    build = build.arg(static_library().display().to_string());
    // What a Rust static library needs from the system on Linux.
    for lib in ["-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl", "-lc"] {
        build = build.arg(lib);
    }
    build.executable(&PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("programs"), name)
}

fn run(program: &Path) -> String {
    run_with(program, &[])
}

fn run_with(program: &Path, args: &[&str]) -> String {
    let output = Command::new(program).args(args).output().expect("the program starts");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{} failed ({}):\n{stdout}{}",
        program.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn valgrind(program: &Path) {
    valgrind_with(program, &[]);
}

fn valgrind_with(program: &Path, args: &[&str]) {
    let valgrind = Path::new("/usr/bin/valgrind");
    let found = valgrind.exists() || Command::new("valgrind").arg("--version").output().is_ok();
    assert!(
        found,
        "valgrind is not installed; the C API's memory checks need it: apt-get install valgrind (Debian package `valgrind`)"
    );
    let output = Command::new("valgrind")
        .args([
            "--error-exitcode=99",
            "--leak-check=full",
            "--show-leak-kinds=definite,indirect,possible",
            "--errors-for-leak-kinds=definite,indirect,possible",
        ])
        .arg(program)
        .args(args)
        // valgrind would check the CUDA driver's own code too (on a machine with one).
        .env("MC_TEST_NO_DRIVER", "1")
        .output()
        .expect("valgrind starts");
    let report = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "valgrind found problems in {}:\n{report}", program.display());
    let summary = report.lines().find(|line| line.contains("ERROR SUMMARY")).unwrap_or_default().to_owned();
    assert!(summary.contains("ERROR SUMMARY: 0 errors"), "{summary}\n{report}");
    for kind in ["definitely lost", "indirectly lost", "possibly lost"] {
        if let Some(line) = report.lines().find(|line| line.contains(kind)) {
            assert!(line.contains(": 0 bytes in 0 blocks"), "{line}\n{report}");
        }
    }
    eprintln!("valgrind on {}: {summary}", program.display());
}

#[test]
fn the_c_program_drives_the_registry_and_governor_and_checks_every_status() {
    let program = build(Language::C("c11"), "tests/c/smoke.c", "smoke-c");
    let stdout = run(&program);
    assert!(stdout.contains("c smoke:") && stdout.contains("checks passed"), "{stdout}");
}

#[test]
fn the_cpp_program_hands_over_its_own_allocator_as_a_vtable() {
    let program = build(Language::Cpp("c++17"), "tests/cpp/smoke.cpp", "smoke-cpp");
    let stdout = run(&program);
    assert!(stdout.contains("c++ smoke:") && stdout.contains("checks passed"), "{stdout}");
}

#[test]
fn the_c_program_has_no_memory_errors_or_leaks_under_valgrind() {
    valgrind(&build(Language::C("c11"), "tests/c/smoke.c", "smoke-c"));
}

#[test]
fn the_cpp_program_has_no_memory_errors_or_leaks_under_valgrind() {
    valgrind(&build(Language::Cpp("c++17"), "tests/cpp/smoke.cpp", "smoke-cpp"));
}

/// memory-plugin's example plugin (`crates/memory-plugin/tests/c/example_plugin.c`), built
/// once as a shared library; its configuration scripts its faults.
fn example_plugin() -> &'static Path {
    static PLUGIN: OnceLock<PathBuf> = OnceLock::new();
    PLUGIN.get_or_init(|| {
        NativeBuild::new(Language::C("c11"))
            .source(manifest().join("../memory-plugin/tests/c/example_plugin.c"))
            .include(manifest().join("../../include"))
            .arg("-lpthread")
            .shared_library(&PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("plugin"), "libexample_plugin.so")
    })
}

fn plugin_arg() -> Vec<&'static str> {
    vec![example_plugin().to_str().expect("the target directory's path is UTF-8")]
}

/// Every allocator kind the C API registers without a GPU (and a C vtable with virtual
/// backing, so the capability calls reach a vtable's slots), and memory-plugin's example
/// plugin as a shared library (`plugin:PATH`).
fn kinds() -> &'static [String] {
    static KINDS: OnceLock<Vec<String>> = OnceLock::new();
    KINDS.get_or_init(|| {
        let plugin = example_plugin();
        ["system", "pooled", "virtual", "shared", "vtable", "vtable-virtual"]
            .iter()
            .map(|kind| (*kind).to_owned())
            .chain(std::iter::once(format!("plugin:{}", plugin.display())))
            .collect()
    })
}

fn kind_args() -> Vec<&'static str> {
    kinds().iter().map(String::as_str).collect()
}

#[test]
fn every_allocator_kind_is_usable_from_c_committed_or_mapped_where_it_reserves() {
    let program = build(Language::C("c11"), "tests/c/kinds.c", "kinds-c");
    let stdout = run_with(&program, &kind_args());
    for kind in kinds() {
        assert!(stdout.contains(&format!("c kinds {kind}:")), "{kind} did not run:\n{stdout}");
    }
    assert!(stdout.contains("c kinds:") && stdout.contains("checks passed"), "{stdout}");
}

#[test]
fn every_allocator_kind_has_no_memory_errors_or_leaks_under_valgrind() {
    valgrind_with(&build(Language::C("c11"), "tests/c/kinds.c", "kinds-c"), &kind_args());
}

#[test]
fn the_c_contract_holds_arguments_destroy_rules_queues_holders_and_messages_in_c_terms() {
    let program = build(Language::C("c11"), "tests/c/contract.c", "contract-c");
    let stdout = run(&program);
    assert!(stdout.contains("c contract:") && stdout.contains("failure messages checked"), "{stdout}");
}

#[test]
fn the_c_contract_program_has_no_memory_errors_or_leaks_under_valgrind() {
    valgrind(&build(Language::C("c11"), "tests/c/contract.c", "contract-c"));
}

#[test]
fn suspect_plugin_blocks_keep_the_library_loaded_until_a_retry_hands_them_back() {
    let program = build(Language::C("c11"), "tests/c/suspects.c", "suspects-c");
    let stdout = run_with(&program, &plugin_arg());
    assert!(stdout.contains("c suspects:") && stdout.contains("failure messages checked"), "{stdout}");
}

#[test]
fn the_c_suspects_program_has_no_memory_errors_or_leaks_under_valgrind() {
    valgrind_with(&build(Language::C("c11"), "tests/c/suspects.c", "suspects-c"), &plugin_arg());
}

/// Runs a sanitizer build; any finding fails it (and the exit status says so too).
fn sanitized(program: &Path, args: &[&str]) {
    let output = Command::new(program)
        .args(args)
        .env("MC_TEST_NO_DRIVER", "1")
        .env("ASAN_OPTIONS", "detect_leaks=1:halt_on_error=1:abort_on_error=0:exitcode=98")
        .env("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1:exitcode=97")
        .output()
        .expect("the sanitized program starts");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{} failed under AddressSanitizer + UndefinedBehaviorSanitizer ({}):\n{}{stderr}",
        program.display(),
        output.status,
        String::from_utf8_lossy(&output.stdout)
    );
    for finding in ["ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:"] {
        assert!(!stderr.contains(finding), "{} reported {finding}:\n{stderr}", program.display());
    }
}

#[test]
fn the_c_and_cpp_programs_are_clean_under_address_and_undefined_behaviour_sanitizers() {
    let build = |language, source, name| {
        let program = build_with(language, source, name, SANITIZERS);
        // gcc's runtimes are the packages libasan8 and libubsan1 (Debian 12).
        assert!(program.exists(), "no sanitizer build of {source}; install gcc's libasan and libubsan");
        program
    };
    sanitized(&build(Language::C("c11"), "tests/c/kinds.c", "kinds-c-asan"), &kind_args());
    sanitized(&build(Language::C("c11"), "tests/c/contract.c", "contract-c-asan"), &[]);
    sanitized(&build(Language::C("c11"), "tests/c/suspects.c", "suspects-c-asan"), &plugin_arg());
    sanitized(&build(Language::C("c11"), "tests/c/smoke.c", "smoke-c-asan"), &[]);
    sanitized(&build(Language::Cpp("c++17"), "tests/cpp/smoke.cpp", "smoke-cpp-asan"), &[]);
}
