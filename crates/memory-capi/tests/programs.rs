//! A C program and a C++ program, built at test time against the static library,
//! drive the registry and the governor through `include/memory_capi.h` and check every
//! status; both also run under valgrind, which must report no error and no leak.

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
    let mut build = NativeBuild::new(language)
        .source(manifest().join(source))
        .include(manifest().join("../../include"))
        .arg(static_library().display().to_string());
    // What a Rust static library needs from the system on Linux.
    for lib in ["-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl", "-lc"] {
        build = build.arg(lib);
    }
    build.executable(&PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("programs"), name)
}

fn run(program: &Path) -> String {
    let output = Command::new(program).output().expect("the program starts");
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
