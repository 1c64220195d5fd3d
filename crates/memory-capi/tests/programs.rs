//! C and C++ programs, built at test time with the system compiler against the static
//! library and the checked-in headers, drive the registry and the governor through
//! `include/memory_capi.h` and check every status: the smoke programs (C and C++), every
//! allocator kind end to end (`tests/c/kinds.c`: system, pooled, virtual, shared, a C
//! vtable), and the contract a C programmer relies on (`tests/c/contract.c`: argument
//! checks before any effect, destroy rules, queue capacity, reclaim holders, messages in
//! C terms), and suspect plugin blocks (`tests/c/suspects.c`: an unknown status or an
//! overlap keeps the block, the instance and the library until a suspect retry), and
//! threads (`tests/c/threads.c`: blocks handed between pthreads, racing releases, a
//! binding destroyed under load, a device lost with handles live on threads), and
//! recording (`tests/c/record.c`: two tenants' governed mechanisms recorded to a trace,
//! which the tests here read with memory-trace's reader, compare with what the program
//! did, and replay). Every program also runs under valgrind, which must report no error and no
//! leak, and under AddressSanitizer + UndefinedBehaviorSanitizer (gcc's
//! `-fsanitize=address,undefined`, leak detection on, every finding fatal).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use memory_governor::{DeviceKey, MemoryRole};
use memory_testkit::native::{Language, NativeBuild};
use memory_trace::replay::{self, AllocatorKind, ReplayConfig};
use memory_trace::{MarkKind, ReleaseKind, Scope, Trace, What, read_trace};

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
    valgrind_suppressing(program, args, None);
}

/// [`valgrind_with`], with the suppressions in `suppressions` (each names the other
/// crate's defect it hides and why).
fn valgrind_suppressing(program: &Path, args: &[&str], suppressions: Option<&Path>) {
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
        .args(suppressions.map(|file| format!("--suppressions={}", file.display())))
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

/// A runtime that `dlopen`s `libmemory_capi.so`, calls it from a worker thread and
/// `dlclose`s it while the thread runs (`tests/c/dlclose.c`): the library's pthread key
/// destructor runs as the thread exits, so the library must stay mapped. Before the fix
/// the thread's exit jumped into the unmapped destructor (SIGSEGV).
#[test]
fn a_library_dlclosed_while_a_thread_that_called_it_runs_stays_mapped_for_its_exit() {
    let shared = static_library().with_file_name("libmemory_capi.so");
    assert!(shared.exists(), "cargo built no {} (memory-capi's crate-type keeps \"cdylib\")", shared.display());
    let program = NativeBuild::new(Language::C("c11"))
        .source(manifest().join("tests/c/dlclose.c"))
        .include(manifest().join("../../include"))
        .arg("-lpthread")
        .arg("-ldl")
        .executable(&PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("programs"), "dlclose-c");
    let stdout = run_with(&program, &[shared.to_str().expect("the target directory's path is UTF-8")]);
    assert!(stdout.contains("still mapped after dlclose") && stdout.contains("checks passed"), "{stdout}");
}

/// A program that exits with one of every kind of handle still live, under valgrind
/// with the leak kinds that mean a leak (definite, indirect) as errors: none of its
/// blocks is lost, and the program ran to the end (docs/C-ABI.md section 2).
#[test]
fn handles_live_at_exit_leak_nothing_definitely_or_indirectly() {
    let program = build(Language::C("c11"), "tests/c/live_at_exit.c", "live-at-exit");
    let output = Command::new("valgrind")
        .args(["--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=definite,indirect"])
        .arg(&program)
        .env("MC_TEST_NO_DRIVER", "1")
        .output()
        .expect("valgrind starts (apt-get install valgrind)");
    let report = String::from_utf8_lossy(&output.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "valgrind: {}\n{stdout}{report}", output.status);
    assert!(stdout.contains("8 handles left live"), "{stdout}");
    assert!(report.contains("ERROR SUMMARY: 0 errors"), "{report}");
    for kind in ["definitely lost", "indirectly lost"] {
        if let Some(line) = report.lines().find(|line| line.contains(kind)) {
            assert!(line.contains(": 0 bytes in 0 blocks"), "{line}\n{report}");
        }
    }
    // The handles' memory is still there to be found: reachable or possibly lost.
    assert!(report.contains("still reachable") || report.contains("possibly lost"), "{report}");
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

/// The kinds `tests/c/threads.c` runs: every CPU kind, a thread-safe C vtable and the
/// example plugin.
fn thread_kinds() -> Vec<String> {
    ["system", "pooled", "virtual", "shared", "vtable"]
        .iter()
        .map(|kind| (*kind).to_owned())
        .chain(std::iter::once(format!("plugin:{}", example_plugin().display())))
        .collect()
}

#[test]
fn blocks_handed_between_c_threads_raced_and_held_through_destroy_and_loss_answer_typed_statuses() {
    let program = build(Language::C("c11"), "tests/c/threads.c", "threads-c");
    let kinds = thread_kinds();
    let trace = recording_path("threads.mtrace");
    let record = format!("record:{}", trace.display());
    let args: Vec<&str> = kinds.iter().map(String::as_str).chain([record.as_str()]).collect();
    let stdout = run_with(&program, &args);
    for kind in &kinds {
        assert!(stdout.contains(&format!("c threads {kind}:")), "{kind} did not run:\n{stdout}");
    }
    assert!(stdout.contains("c threads:") && stdout.contains("checks passed"), "{stdout}");
    check_raced_recording(&read(&trace), &stdout);
}

#[test]
fn the_c_threads_program_has_no_memory_errors_or_leaks_under_valgrind() {
    let kinds = thread_kinds();
    let trace = recording_path("threads-valgrind.mtrace");
    let record = format!("record:{}", trace.display());
    let args: Vec<&str> = kinds.iter().map(String::as_str).chain([record.as_str()]).collect();
    valgrind_with(&build(Language::C("c11"), "tests/c/threads.c", "threads-c"), &args);
    let trace = read(&trace);
    assert_eq!(trace.end.map(|end| end.events), Some(trace.events.len() as u64));
}

/// A C runtime's per-thread cache under a pthread key gives its blocks back from the
/// key's destructor, which glibc runs after every thread-local destructor (Rust's
/// included): on workers whose first call it is, and on workers that allocated before.
/// Every call answers `MC_OK`, and valgrind finds nothing lost: the library's per-thread
/// state (a hazard slot, the handle tables' free lists) is handed back at that exit too.
#[test]
fn calls_from_pthread_key_destructors_answer_ok_and_leave_nothing_behind() {
    let program = build(Language::C("c11"), "tests/c/thread_exit.c", "thread-exit-c");
    let stdout = run(&program);
    assert!(stdout.contains("c thread exit:") && stdout.contains("checks passed"), "{stdout}");
    // memory-sync's own leak on such a thread, named in the file, is suppressed.
    valgrind_suppressing(&program, &[], Some(&manifest().join("tests/c/thread_exit.supp")));
}

/// The recording `tests/c/threads.c` finished, then destroyed, while three threads
/// allocated through it and a fourth marked: the file is whole and holds what the summary
/// says, every mark that answered `MC_OK` (and no other), and every block it releases
/// was allocated in it; the threads' caller tags are their own.
fn check_raced_recording(trace: &Trace, stdout: &str) {
    let line = stdout.lines().find(|line| line.starts_with("c threads record: marks")).expect("the program recorded");
    let words: Vec<&str> = line.split_whitespace().collect();
    let figure = |name: &str| -> u64 {
        let at = words.iter().position(|word| *word == name).unwrap_or_else(|| panic!("no {name} in {line}"));
        words[at + 1].parse().unwrap_or_else(|_| panic!("{name} in {line} is no number"))
    };
    let end = trace.end.expect("the finish wrote the end record");
    assert_eq!(end.events, trace.events.len() as u64, "{line}");
    assert_eq!(end.events, figure("events"), "the summary's events are the file's: {line}");
    let mut allocated = std::collections::HashSet::new();
    let mut marks = 0;
    for event in &trace.events {
        match &event.what {
            What::Mark { kind, label, .. } => {
                assert_eq!((*kind, label.as_str()), (MarkKind::Note, "m"));
                marks += 1;
            }
            What::Allocate(block) => {
                assert!((100..103).contains(&block.caller), "an allocation tagged {}", block.caller);
                assert!(allocated.insert((event.tenant, block.id)), "block {} allocated twice", block.id);
            }
            What::Release { block, outcome, .. } => {
                assert_eq!(*outcome, ReleaseKind::Complete);
                assert!(allocated.contains(&(event.tenant, block.id)), "block {} released, never allocated", block.id);
            }
            other => panic!("the raced recording holds no {other:?}"),
        }
    }
    assert_eq!(marks, figure("marks"), "every mark that answered MC_OK is in the file, and only those: {line}");
    assert!(allocated.len() > 100, "{line}");
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
    let kinds = thread_kinds();
    let record = format!("record:{}", recording_path("threads-asan.mtrace").display());
    let thread_args: Vec<&str> = kinds.iter().map(String::as_str).chain([record.as_str()]).collect();
    sanitized(&build(Language::C("c11"), "tests/c/threads.c", "threads-c-asan"), &thread_args);
    let trace = recording_path("record-asan.mtrace");
    sanitized(&build(Language::C("c11"), "tests/c/record.c", "record-c-asan"), &[trace.to_str().unwrap()]);
    check_recording(&read(&trace), &Workload::parse(WORKLOAD_SHAPE), Exact::CountsOnly);
    sanitized(&build(Language::Cpp("c++17"), "tests/cpp/smoke.cpp", "smoke-cpp-asan"), &[]);
}

// ---------------------------------------------------------------------------------
// Recording from C (`tests/c/record.c`)

/// Where a test's recording goes.
fn recording_path(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("recordings");
    std::fs::create_dir_all(&dir).expect("the target directory is writable");
    dir.join(name)
}

fn read(path: &Path) -> Trace {
    let file = std::fs::File::open(path).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    let trace = read_trace(file).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    assert!(trace.damage.is_none(), "{}: {:?}", path.display(), trace.damage);
    trace
}

/// The shipped recording of `tests/c/record.c` (regenerate it with
/// `MEMORY_BLESS_TRACES=1 cargo test -p memory-capi --test programs recorded`).
fn shipped_recording() -> PathBuf {
    manifest().join("../memory-trace/traces/capi.mtrace")
}

/// The per-tenant figures `tests/c/record.c` prints: its workload is deterministic
/// (fixed sizes and counts on each thread), only the interleaving of its two threads is not.
const WORKLOAD_SHAPE: &str = "c record tenant chat: allocations 169 releases 169 refusals 0 bytes 12435456\n\
                              c record tenant embed: allocations 48 releases 48 refusals 1 bytes 1646592\n\
                              c record: marks 2 events 437 bytes 0";

/// What the program says it did.
#[derive(Debug, PartialEq, Eq)]
struct Workload {
    /// Per tenant label: allocations, releases, refusals, bytes asked for.
    tenants: BTreeMap<String, [u64; 4]>,
    marks: u64,
    events: u64,
}

impl Workload {
    fn parse(stdout: &str) -> Workload {
        let mut tenants = BTreeMap::new();
        let (mut marks, mut events) = (None, None);
        let number = |words: &[&str], name: &str| -> u64 {
            let at = words.iter().position(|word| *word == name).unwrap_or_else(|| panic!("no {name} in {words:?}"));
            words[at + 1].parse().unwrap_or_else(|_| panic!("{name} in {words:?} is no number"))
        };
        for line in stdout.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            if let Some(label) = line.strip_prefix("c record tenant ").and_then(|rest| rest.split(':').next()) {
                let figures = ["allocations", "releases", "refusals", "bytes"].map(|name| number(&words, name));
                tenants.insert(label.to_owned(), figures);
            } else if line.starts_with("c record: marks") {
                (marks, events) = (Some(number(&words, "marks")), Some(number(&words, "events")));
            }
        }
        Workload { tenants, marks: marks.expect("the program printed its marks"), events: events.expect("and events") }
    }
}

#[derive(Copy, Clone, PartialEq, Eq)]
enum Exact {
    /// The program's own figures: every count and byte.
    Everything,
    /// A recording made by another run (the shipped one, a sanitizer run): counts and bytes
    /// per tenant, whatever the interleaving.
    CountsOnly,
}

/// The trace holds exactly the program's workload: per tenant its allocations (and
/// their bytes), releases and refusals, the marks, the caller tags, the tenants' books
/// as they were at registration, every block given back; and it replays with the same
/// books every time on every stack, the refusal refused again.
fn check_recording(trace: &Trace, did: &Workload, exact: Exact) {
    let end = trace.end.expect("a finished recording has its end record");
    assert_eq!(end.events, trace.events.len() as u64);
    assert_eq!(end.dropped, 0);
    if exact == Exact::Everything {
        assert_eq!(end.events, did.events, "the summary the program checked");
    }
    let device = DeviceKey::host(1);
    let labels: Vec<&str> = trace.tenants.iter().map(|tenant| tenant.label.as_str()).collect();
    assert_eq!(labels, ["chat", "embed"], "one tenant per mechanism registered through the recording handle");
    for tenant in &trace.tenants {
        assert_eq!(tenant.device, device);
        assert_eq!(tenant.device_limit, Some(8 << 20), "{}", tenant.label);
    }
    assert_eq!(trace.tenants[0].quota, Some(4 << 20));
    assert_eq!(trace.tenants[1].quota, Some(1 << 20));
    assert!(trace.tenants[0].allocator.starts_with("pooled("), "{:?}", trace.tenants[0]);
    assert!(trace.tenants[1].allocator.starts_with("system"), "{:?}", trace.tenants[1]);

    let mut figures: BTreeMap<String, [u64; 4]> = BTreeMap::new();
    let mut live: HashMap<(u32, u64), u64> = HashMap::new();
    let mut marks = Vec::new();
    let mut threads = BTreeMap::<u32, String>::new();
    for event in &trace.events {
        assert_eq!(event.device, device);
        if let What::Mark { kind, label, .. } = &event.what {
            assert_eq!(*kind, MarkKind::Note);
            marks.push(label.as_str());
            continue;
        }
        let tenant = &trace.tenants[event.tenant as usize - 1];
        let name = trace.threads.iter().find(|(number, _)| *number == event.thread).map(|(_, name)| name.clone());
        threads.insert(event.thread, name.unwrap_or_default());
        let tally = figures.entry(tenant.label.clone()).or_default();
        let callers = if tenant.label == "chat" { 1000..1024 } else { 2000..2024 };
        match &event.what {
            What::Allocate(block) => {
                tally[0] += 1;
                tally[3] += block.requested;
                assert!(
                    callers.contains(&block.caller) || (block.caller == 1 && event.role == Some(MemoryRole::Weights)),
                    "{}: an allocation tagged {}",
                    tenant.label,
                    block.caller
                );
                assert!(live.insert((event.tenant, block.id), block.bytes).is_none(), "block {} twice", block.id);
            }
            What::Release { block, outcome, .. } => {
                tally[1] += 1;
                assert_eq!(*outcome, ReleaseKind::Complete);
                assert_eq!(live.remove(&(event.tenant, block.id)), Some(block.bytes), "release of {}", block.id);
                assert!(callers.contains(&block.caller) || block.caller == 0, "a release tagged {}", block.caller);
            }
            What::Refusal(refusal) => {
                tally[2] += 1;
                assert_eq!(tenant.label, "embed");
                assert_eq!((refusal.requested, refusal.caller), (2 << 20, 2012), "{refusal:?}");
                assert_eq!(refusal.scope, Some(Scope::Authority), "refused by the tenant's quota: {refusal:?}");
                assert_eq!(refusal.limit, 1 << 20, "{refusal:?}");
                assert_eq!(event.role, Some(MemoryRole::Workspace));
            }
            other => panic!("the program's workload records no {other:?}"),
        }
    }
    assert_eq!(figures, did.tenants, "the trace holds what the program did");
    assert_eq!(marks, ["serve", "drain"]);
    assert_eq!(marks.len() as u64, did.marks);
    // The program marks "serve" before it starts its threads and "drain" after it joined
    // them: in time order (events carry the clock's raw stamps, turned into nanoseconds
    // by the writer; marks nanoseconds at once) every allocation lies between the two.
    let label = |event: &memory_trace::Event| match &event.what {
        What::Mark { label, .. } => Some(label.clone()),
        _ => None,
    };
    assert_eq!(trace.events.first().and_then(label).as_deref(), Some("serve"), "the first event in time");
    assert_eq!(trace.events.last().and_then(label).as_deref(), Some("drain"), "the last event in time");
    assert!(live.is_empty(), "{} blocks never released", live.len());
    assert!(threads.len() >= 2, "chat and embed ran on two threads: {threads:?}");

    let configs: Vec<ReplayConfig> = AllocatorKind::ALL.iter().copied().map(ReplayConfig::new).collect();
    for config in &configs {
        let report = replay::replay(trace, config);
        let again = replay::replay(trace, config);
        assert_eq!(report.devices.len(), 1);
        let (books, repeat) = (&report.devices[0], &again.devices[0]);
        let what = config.label();
        assert_eq!(books.books(), repeat.books(), "{what}: the same books on every replay");
        assert_eq!(books.refusals.len(), 1, "{what}: the quota refuses the 2 MiB request again");
        assert!(books.refusals[0].refused_when_recorded, "{what}");
        assert_eq!(books.refusals[0].requested, 2 << 20, "{what}");
        assert_eq!((books.live_at_end, books.final_allocated), (0, 0), "{what}: nothing live or charged at the end");
        // The weights and at least the chat pages of two requests in flight.
        assert!(books.peak_allocated >= (1 << 20) + 2 * (64 << 10), "{what}: peak {}", books.peak_allocated);
        assert!(books.peak_reserved >= books.peak_allocated, "{what}");
    }
}

/// The recorder `tests/c/record.c` only destroyed (no `mc_recorder_finish`): the destroy
/// wrote a whole trace, with everything recorded before it: chat's account on a system
/// allocator, `LATE_PAIRS` (3) blocks of 4 KiB taken and given back on a thread, tagged
/// 3000 to 3002, and a device-lost mark; nothing of what the mechanism did after it.
fn check_unfinished(trace: &Trace) {
    let end = trace.end.expect("the destroy wrote the end record");
    assert_eq!((end.events, end.dropped), (7, 0), "3 allocations, 3 releases, 1 mark");
    assert_eq!(trace.events.len(), 7);
    let tenants: Vec<(&str, Option<u64>, Option<u64>)> =
        trace.tenants.iter().map(|tenant| (tenant.label.as_str(), tenant.quota, tenant.device_limit)).collect();
    assert_eq!(tenants, [("chat", Some(4 << 20), Some(8 << 20))]);
    assert!(trace.tenants[0].allocator.starts_with("system"), "{:?}", trace.tenants[0]);
    let (mut tags, mut released, mut marks) = (Vec::new(), 0, Vec::new());
    for event in &trace.events {
        assert_eq!(event.device, DeviceKey::host(1));
        match &event.what {
            What::Allocate(block) => {
                assert_eq!(block.requested, 4 << 10);
                tags.push(block.caller);
            }
            What::Release { outcome: ReleaseKind::Complete, .. } => released += 1,
            What::Mark { kind, label, .. } => marks.push((*kind, label.as_str())),
            other => panic!("the unfinished recording holds no {other:?}"),
        }
    }
    assert_eq!((tags, released), (vec![3000, 3001, 3002], 3));
    assert_eq!(marks, [(MarkKind::DeviceLost, "lost")]);
}

#[test]
fn a_c_program_records_its_governed_mechanisms_and_the_trace_is_its_workload() {
    let program = build(Language::C("c11"), "tests/c/record.c", "record-c");
    let path = recording_path("record.mtrace");
    let stdout = run_with(&program, &[path.to_str().unwrap()]);
    assert!(stdout.contains("c record:") && stdout.contains("failure messages checked"), "{stdout}");
    let did = Workload::parse(&stdout);
    assert_eq!(did.tenants, Workload::parse(WORKLOAD_SHAPE).tenants, "the workload is deterministic:\n{stdout}");
    check_recording(&read(&path), &did, Exact::Everything);
    check_unfinished(&read(&PathBuf::from(format!("{}.unfinished", path.display()))));
    if std::env::var_os("MEMORY_BLESS_TRACES").is_some() {
        std::fs::copy(&path, shipped_recording()).expect("crates/memory-trace/traces is writable");
    }
}

#[test]
fn the_shipped_capi_trace_is_what_the_c_program_records() {
    let path = shipped_recording();
    let trace = read(&path);
    check_recording(&trace, &Workload::parse(WORKLOAD_SHAPE), Exact::CountsOnly);
    let bytes = std::fs::metadata(&path).unwrap().len();
    assert!(bytes <= 64 << 10, "{} is {bytes} bytes: keep the C program's workload small", path.display());
}

#[test]
fn the_c_record_program_has_no_memory_errors_or_leaks_under_valgrind() {
    let path = recording_path("record-valgrind.mtrace");
    valgrind_with(&build(Language::C("c11"), "tests/c/record.c", "record-c"), &[path.to_str().unwrap()]);
    check_recording(&read(&path), &Workload::parse(WORKLOAD_SHAPE), Exact::CountsOnly);
    check_unfinished(&read(&PathBuf::from(format!("{}.unfinished", path.display()))));
}
