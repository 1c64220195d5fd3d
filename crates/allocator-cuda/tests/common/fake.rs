//! The fake CUDA driver: building it, running a test against it, and steering it.
//!
//! The dynamic loader reads `LD_LIBRARY_PATH` when a process starts, so a test cannot
//! point cudarc at the fake after the fact. Instead every fake-driver test re-runs its
//! own test binary, filtered to itself (`--exact`), with `LD_LIBRARY_PATH` set to a
//! directory holding the fake `libcuda.so` and a marker variable that makes the test
//! body run in that child. The parent only builds the library and checks that the
//! child ran exactly one test and passed. No extra set-up: a C compiler (`cc`, or
//! `$CC`) is all it needs.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Set in the child process that runs a test body against the fake driver.
pub(crate) const CHILD_ENV: &str = "ALLOCATOR_CUDA_FAKE_DRIVER_CHILD";

/// The fake driver's source.
const SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fake-driver/fake_cuda.c");

/// Which library the child sees.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Variant {
    /// The fake driver with every entry point.
    Current,
    /// The fake driver without the VMM entry points (an old driver).
    Old,
    /// An empty directory: no libcuda at all.
    Empty,
}

/// Whether this process is a child running one test body against the fake.
pub(crate) fn in_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

fn build_root() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fake-cuda")
}

/// The directory holding the library for `variant`, built once per process (and
/// reused across processes while the source is unchanged).
pub(crate) fn library_dir(variant: Variant) -> PathBuf {
    static CURRENT: OnceLock<PathBuf> = OnceLock::new();
    static OLD: OnceLock<PathBuf> = OnceLock::new();
    static EMPTY: OnceLock<PathBuf> = OnceLock::new();
    match variant {
        Variant::Current => CURRENT.get_or_init(|| build(&[])).clone(),
        Variant::Old => OLD.get_or_init(|| build(&["-DFAKE_CUDA_OLD_DRIVER"])).clone(),
        Variant::Empty => EMPTY
            .get_or_init(|| {
                let dir = build_root().join("empty");
                std::fs::create_dir_all(&dir).expect("creating an empty library directory");
                dir
            })
            .clone(),
    }
}

fn build(defines: &[&str]) -> PathBuf {
    let source = std::fs::read(SOURCE).unwrap_or_else(|e| panic!("reading {SOURCE}: {e}"));
    let mut hasher = DefaultHasher::new();
    source.hash(&mut hasher);
    defines.hash(&mut hasher);
    let dir = build_root().join(format!("{:016x}", hasher.finish()));
    let library = dir.join("libcuda.so");
    if library.exists() {
        return dir;
    }
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    // Build under a private name, then rename: concurrent test processes never see a
    // half-written library.
    let partial = dir.join(format!("libcuda.so.partial-{}", std::process::id()));
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let output = Command::new(&compiler)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-o"])
        .arg(&partial)
        .arg(SOURCE)
        .args(defines)
        .arg("-lpthread")
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "the fake CUDA driver needs a C compiler, but `{compiler}` could not be run ({e}); \
                 install gcc or clang, or set CC"
            )
        });
    assert!(
        output.status.success(),
        "compiling the fake CUDA driver with `{compiler}` failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::rename(&partial, &library).unwrap_or_else(|e| panic!("installing {}: {e}", library.display()));
    // Some loaders look for the soname with its major version.
    let _ = std::fs::copy(&library, dir.join("libcuda.so.1"));
    dir
}

/// Runs the test `full_name` (`module_path!()::name`) in a child process whose
/// dynamic loader finds `variant`, with `env` set; panics unless the child ran exactly
/// that one test and it passed.
pub(crate) fn run_in_child(full_name: &str, env: &[(&str, &str)], variant: Variant) {
    // `module_path!()` starts with the test crate's name; libtest names omit it.
    let name = full_name.split_once("::").map_or(full_name, |(_, rest)| rest);
    let dir = library_dir(variant);
    run_child_process(name, &dir, env);
}

fn run_child_process(name: &str, dir: &Path, env: &[(&str, &str)]) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut command = Command::new(exe);
    command.args([name, "--exact", "--nocapture", "--test-threads=1"]).env(CHILD_ENV, "1");
    let mut paths = vec![dir.to_path_buf()];
    if let Some(existing) = std::env::var_os("LD_LIBRARY_PATH") {
        paths.extend(std::env::split_paths(&existing));
    }
    command.env("LD_LIBRARY_PATH", std::env::join_paths(paths).expect("a valid LD_LIBRARY_PATH"));
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("FAKE_CUDA_") {
            command.env_remove(key);
        }
    }
    for (key, value) in env {
        command.env(key, value);
    }
    let output = command.output().expect("running the test binary again");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("test result: ok. 1 passed"),
        "the test `{name}` failed against the fake CUDA driver in {} (status {}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        dir.display(),
        output.status
    );
}

/// Steering the fake driver from inside a child. Each function looks its symbol up in
/// the libcuda cudarc loaded, which in a child is the fake.
pub(crate) mod control {
    use std::ffi::{CString, c_char, c_int, c_long, c_ulonglong};

    use allocator_cuda::CudaErrorCode;

    fn symbol<T: Copy>(name: &str) -> T {
        // SAFETY: `culib` panics only without a libcuda; a child always has the fake on
        // its search path, and the fake's initialisers only set up a mutex.
        let library = unsafe { cudarc::driver::sys::culib() };
        // SAFETY: each caller names `T` as the exact C signature of the control function
        // `name` in fake-driver/fake_cuda.c.
        let function = unsafe { library.get::<T>(name.as_bytes()) };
        *function.unwrap_or_else(|e| panic!("the fake CUDA driver does not export {name}: {e}"))
    }

    /// After `skip` more successful calls of `function`, the next `count` calls (-1:
    /// every later call) fail with `code` and do nothing.
    pub(crate) fn inject(function: &str, skip: i64, count: i64, code: CudaErrorCode) {
        let name = CString::new(function).expect("a function name");
        let inject: unsafe extern "C" fn(*const c_char, c_long, c_long, c_int) -> c_int = symbol("fake_cuda_inject");
        // SAFETY: `name` is a valid C string for the duration of the call.
        unsafe { inject(name.as_ptr(), skip as c_long, count as c_long, code.get() as c_int) };
    }

    /// Drops every pending injection.
    pub(crate) fn clear_injections() {
        let clear: unsafe extern "C" fn() = symbol("fake_cuda_clear_injections");
        // SAFETY: no arguments.
        unsafe { clear() };
    }

    /// Every later driver call fails with `code` (a destroyed context).
    pub(crate) fn set_sticky(code: CudaErrorCode) {
        let set: unsafe extern "C" fn(c_int) = symbol("fake_cuda_set_sticky");
        // SAFETY: plain integer argument.
        unsafe { set(code.get() as c_int) };
    }

    /// An asynchronous fault with `code`: calls keep working until the next
    /// synchronising one reports it; from then on it is sticky.
    pub(crate) fn fault(code: CudaErrorCode) {
        let set: unsafe extern "C" fn(c_int) = symbol("fake_cuda_fault");
        // SAFETY: plain integer argument.
        unsafe { set(code.get() as c_int) };
    }

    /// While held, recorded events stay pending until `complete_events`.
    pub(crate) fn hold_events(hold: bool) {
        let set: unsafe extern "C" fn(c_int) = symbol("fake_cuda_hold_events");
        // SAFETY: plain integer argument.
        unsafe { set(c_int::from(hold)) };
    }

    /// Completes every recorded event.
    pub(crate) fn complete_events() {
        let complete: unsafe extern "C" fn() = symbol("fake_cuda_complete_events");
        // SAFETY: no arguments.
        unsafe { complete() };
    }

    /// How often `function` was called (failed calls included).
    pub(crate) fn calls(function: &str) -> u64 {
        let name = CString::new(function).expect("a function name");
        let calls: unsafe extern "C" fn(*const c_char) -> c_ulonglong = symbol("fake_cuda_calls");
        // SAFETY: `name` is a valid C string for the duration of the call.
        unsafe { calls(name.as_ptr()) }
    }

    /// How many injected failures `function` actually returned.
    pub(crate) fn injected(function: &str) -> u64 {
        let name = CString::new(function).expect("a function name");
        let injected: unsafe extern "C" fn(*const c_char) -> c_ulonglong = symbol("fake_cuda_injected");
        // SAFETY: `name` is a valid C string for the duration of the call.
        unsafe { injected(name.as_ptr()) }
    }

    /// Frees, releases and destroys of something that was not live (double frees).
    pub(crate) fn invalid_frees() -> u64 {
        let read: unsafe extern "C" fn() -> c_ulonglong = symbol("fake_cuda_invalid_frees");
        // SAFETY: no arguments.
        unsafe { read() }
    }

    fn counter(name: &str) -> i64 {
        let read: unsafe extern "C" fn() -> c_int = symbol(name);
        // SAFETY: no arguments.
        i64::from(unsafe { read() })
    }

    /// Device bytes the fake has handed out (eager blocks, pool reservations, physical
    /// handles).
    pub(crate) fn used_bytes() -> u64 {
        let read: unsafe extern "C" fn() -> c_ulonglong = symbol("fake_cuda_used_bytes");
        // SAFETY: no arguments.
        unsafe { read() }
    }

    /// Physical VMM handles not yet freed (released and unmapped).
    pub(crate) fn live_handles() -> i64 {
        counter("fake_cuda_live_handles")
    }

    /// Memory pools not yet destroyed.
    pub(crate) fn live_pools() -> i64 {
        counter("fake_cuda_live_pools")
    }

    /// Events not yet destroyed.
    pub(crate) fn live_events() -> i64 {
        counter("fake_cuda_live_events")
    }

    /// Streams not yet destroyed.
    pub(crate) fn live_streams() -> i64 {
        counter("fake_cuda_live_streams")
    }

    /// Address reservations not yet freed.
    pub(crate) fn live_reservations() -> i64 {
        counter("fake_cuda_live_reservations")
    }

    /// VMM mappings not yet unmapped.
    pub(crate) fn live_mappings() -> i64 {
        counter("fake_cuda_live_mappings")
    }

    /// Pinned host blocks not yet freed.
    pub(crate) fn live_host_blocks() -> i64 {
        counter("fake_cuda_live_host_blocks")
    }

    /// Contexts pushed on the calling thread.
    pub(crate) fn context_depth() -> i64 {
        counter("fake_cuda_context_depth")
    }

    /// Retains of device `ordinal`'s primary context.
    pub(crate) fn primary_retains(ordinal: i32) -> i64 {
        let read: unsafe extern "C" fn(c_int) -> c_int = symbol("fake_cuda_primary_retains");
        // SAFETY: plain integer argument.
        i64::from(unsafe { read(ordinal) })
    }

    /// Whether the loaded libcuda is the fake (and not a system driver).
    pub(crate) fn is_fake() -> bool {
        // SAFETY: as in `symbol`.
        let library = unsafe { cudarc::driver::sys::culib() };
        // SAFETY: the symbol is only looked up.
        unsafe { library.get::<unsafe extern "C" fn()>(b"fake_cuda_inject") }.is_ok()
    }
}

/// Runs the `cuda_probe` example (built next to this test binary by `cargo test`)
/// with the loader seeing `variant`; `None` when the example was not built (for
/// example under `cargo test --test fake_driver`).
pub(crate) fn run_probe_example(variant: Variant, env: &[(&str, &str)]) -> Option<std::process::Output> {
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    let probe = profile_dir.join("examples").join("cuda_probe");
    if !probe.exists() {
        return None;
    }
    let mut command = Command::new(probe);
    command.env("LD_LIBRARY_PATH", library_dir(variant));
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("FAKE_CUDA_") {
            command.env_remove(key);
        }
    }
    for (key, value) in env {
        command.env(key, value);
    }
    Some(command.output().expect("running the cuda_probe example"))
}
