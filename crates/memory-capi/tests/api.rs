//! The C API called from Rust: handle validation, foreign handles, plugin unload refusal.

use std::ptr::null_mut;

use memory_capi::*;
use memory_plugin_abi::{MP_ROLE_OTHER, MP_TIER_HOST, MpDevice};

const HOST: MpDevice = MpDevice { tier: MP_TIER_HOST, index: 3 };

struct Setup {
    registry: *mut McRegistry,
    context: *mut McContext,
    authority: *mut McAuthority,
    mechanism: *mut McMechanism,
    binding: *mut McBinding,
}

fn ok(status: McStatus) {
    // SAFETY: the message pointer is valid until the next call on this thread.
    let message = unsafe { std::ffi::CStr::from_ptr(mc_last_error_message()) }.to_string_lossy().into_owned();
    assert_eq!(status, MC_OK, "{message}");
}

fn setup() -> Setup {
    setup_with_context(null_mut(), None)
}

/// A registry with one context (`user`, `destroy`), authority, system-allocator
/// mechanism and binding.
fn setup_with_context(user: *mut std::ffi::c_void, destroy: McDestroyFn) -> Setup {
    let mut s = Setup {
        registry: null_mut(),
        context: null_mut(),
        authority: null_mut(),
        mechanism: null_mut(),
        binding: null_mut(),
    };
    // SAFETY: every out-pointer is a live local (so for each call below).
    ok(unsafe { mc_registry_create(&mut s.registry) });
    // SAFETY: as above.
    ok(unsafe { mc_context_register(s.registry, HOST, user, destroy, &mut s.context) });
    // SAFETY: as above.
    ok(unsafe { mc_authority_register(s.registry, HOST, null_mut(), None, &mut s.authority) });
    // SAFETY: as above.
    ok(unsafe {
        mc_register_cpu_allocator(s.registry, null_mut(), s.context, s.authority, MC_CPU_SYSTEM, &mut s.mechanism)
    });
    // SAFETY: as above.
    ok(unsafe { mc_bind_mechanism(s.registry, s.mechanism, &mut s.binding) });
    s
}

fn message() -> String {
    // SAFETY: valid until the next call on this thread.
    unsafe { std::ffi::CStr::from_ptr(mc_last_error_message()) }.to_string_lossy().into_owned()
}

#[test]
fn a_context_of_another_registry_is_foreign() {
    let ours = setup();
    let theirs = setup();
    let mut mechanism = null_mut();
    // SAFETY: live out-pointer.
    let status = unsafe {
        mc_register_cpu_allocator(
            ours.registry,
            null_mut(),
            theirs.context,
            ours.authority,
            MC_CPU_SYSTEM,
            &mut mechanism,
        )
    };
    assert_eq!(status, MC_ERR_FOREIGN, "{}", message());
}

#[test]
fn an_allocation_of_another_registry_is_foreign_and_stays_valid() {
    let ours = setup();
    let theirs = setup();
    let mut block = null_mut();
    // SAFETY: live out-pointer.
    ok(unsafe { mc_allocate(theirs.binding, 64, 8, MP_ROLE_OTHER, &mut block) });
    // SAFETY: a null report is allowed.
    assert_eq!(unsafe { mc_release(ours.binding, block, null_mut()) }, MC_ERR_FOREIGN, "{}", message());
    // SAFETY: as above.
    ok(unsafe { mc_release(theirs.binding, block, null_mut()) });
    // SAFETY: as above.
    assert_eq!(unsafe { mc_release(theirs.binding, block, null_mut()) }, MC_ERR_STALE_HANDLE);
}

#[test]
fn racing_double_releases_succeed_exactly_once() {
    let s = setup();
    for _ in 0..100 {
        let mut block = null_mut();
        // SAFETY: live out-pointer.
        ok(unsafe { mc_allocate(s.binding, 64, 8, MP_ROLE_OTHER, &mut block) });
        let (binding, block) = (s.binding as usize, block as usize);
        let successes: usize = std::thread::scope(|scope| {
            let racers: Vec<_> = (0..3)
                .map(|_| {
                    scope.spawn(move || {
                        // SAFETY: handles are numbers; a null report is allowed.
                        let status =
                            unsafe { mc_release(binding as *mut McBinding, block as *mut McAllocation, null_mut()) };
                        assert!(matches!(status, MC_OK | MC_ERR_STALE_HANDLE | MC_ERR_BUSY), "{status}");
                        usize::from(status == MC_OK)
                    })
                })
                .collect();
            racers.into_iter().map(|racer| racer.join().unwrap()).sum()
        });
        assert_eq!(successes, 1);
    }
}

#[test]
fn messages_say_what_was_asked_found_and_what_to_do() {
    let s = setup();
    let mut block = null_mut();
    // SAFETY: live out-pointer.
    let status = unsafe { mc_allocate(s.binding, 64, 3, MP_ROLE_OTHER, &mut block) };
    assert_eq!(status, MC_ERR_INVALID_ARGUMENT);
    let text = message();
    assert!(text.starts_with("mc_allocate: MC_ERR_INVALID_ARGUMENT: "), "{text}");
    assert!(text.contains("alignment 3") && text.contains("pass 1, 2, 4"), "{text}");
    // SAFETY: live out-pointer.
    ok(unsafe { mc_allocate(s.binding, 64, 8, MP_ROLE_OTHER, &mut block) });
    assert_eq!(message(), "", "a successful call leaves no message");
    // SAFETY: the name is a static C string.
    let name = unsafe { std::ffi::CStr::from_ptr(mc_status_name(MC_ERR_STALE_HANDLE)) };
    assert_eq!(name.to_str().unwrap(), "MC_ERR_STALE_HANDLE");
}

#[test]
fn every_status_has_its_name_and_an_unknown_one_says_so() {
    let name = |status| {
        // SAFETY: the name is a static C string.
        unsafe { std::ffi::CStr::from_ptr(mc_status_name(status)) }.to_str().unwrap().to_owned()
    };
    let names: Vec<String> = (MC_OK..=MC_ERR_SUSPECT_BLOCKS).map(name).collect();
    assert!(names.iter().all(|n| n.starts_with("MC_")), "{names:?}");
    let mut distinct = names.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), names.len(), "{names:?}");
    assert_eq!(name(MC_ERR_SUSPECT_BLOCKS), "MC_ERR_SUSPECT_BLOCKS");
    assert_eq!(name(MC_ERR_SUSPECT_BLOCKS + 1), "unknown status");
    assert_eq!(name(-1), "unknown status");
}

/// Counts a context's user destructor (its user pointer is the count).
unsafe extern "C" fn count_destroy(user: *mut std::ffi::c_void) {
    // SAFETY: the tests below pass a pointer to a live (leaked) counter.
    unsafe { &*user.cast::<std::sync::atomic::AtomicUsize>() }.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

#[test]
fn a_binding_destroyed_while_threads_allocate_through_it_answers_ok_or_stale_and_is_dropped() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    const THREADS: usize = 3;
    for round in 0..20 {
        let destroyed: &'static AtomicUsize = Box::leak(Box::new(AtomicUsize::new(0)));
        // The context's destructor says when everything pinning it is gone: once the
        // handles below are gone, the binding (through its mechanism) is the last pin.
        let user = std::ptr::from_ref(destroyed).cast_mut().cast();
        let s = setup_with_context(user, Some(count_destroy));
        let binding = s.binding as usize;
        let pairs = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..THREADS {
                scope.spawn(|| {
                    let binding = binding as *mut McBinding;
                    loop {
                        let mut block = null_mut();
                        // SAFETY: handles are numbers; a live out-pointer.
                        let allocated = unsafe { mc_allocate(binding, 4096, 64, MP_ROLE_OTHER, &mut block) };
                        if allocated == MC_ERR_STALE_HANDLE {
                            return;
                        }
                        assert_eq!(allocated, MC_OK, "{}", message());
                        // SAFETY: as above; a null report is allowed.
                        match unsafe { mc_release(binding, block, null_mut()) } {
                            MC_OK => {}
                            MC_ERR_STALE_HANDLE => {
                                // The binding went between the two calls: the block is
                                // still ours, and goes by its drop policy.
                                ok(mc_allocation_drop(block));
                                return;
                            }
                            status => panic!("mc_release answered {status}: {}", message()),
                        }
                        pairs.fetch_add(1, SeqCst);
                    }
                });
            }
            scope.spawn(|| {
                while pairs.load(SeqCst) < 50 * (round % 4 + 1) {
                    std::thread::yield_now();
                }
                ok(mc_binding_destroy(binding as *mut McBinding));
                assert_eq!(mc_binding_destroy(binding as *mut McBinding), MC_ERR_STALE_HANDLE);
            });
        });
        assert_eq!(destroyed.load(SeqCst), 0, "the registry and mechanism still pin the context");
        ok(mc_mechanism_retire(s.registry, s.mechanism));
        ok(mc_mechanism_remove(s.registry, s.mechanism));
        ok(mc_context_remove(s.registry, s.context));
        ok(mc_authority_remove(s.registry, s.authority));
        ok(mc_registry_destroy(s.registry));
        assert_eq!(destroyed.load(SeqCst), 1, "round {round}: the destroyed binding's value was never dropped");
    }
}

// ---------------------------------------------------------------------------------
// Recording (`mc_recorder_*`)

/// A governor with `s.authority`'s account ("tenant"), a recorder writing to `path`, a
/// recording handle of the governor, and a system-allocator mechanism registered
/// through it, bound.
struct Recorded {
    s: Setup,
    governor: *mut McGovernor,
    recorder: *mut McRecorder,
    recorded: *mut McGovernor,
    mechanism: *mut McMechanism,
    binding: *mut McBinding,
}

fn c_text(text: &str) -> std::ffi::CString {
    std::ffi::CString::new(text).unwrap()
}

fn recorded(path: &std::path::Path) -> Recorded {
    let s = setup();
    let mut r = Recorded {
        s,
        governor: null_mut(),
        recorder: null_mut(),
        recorded: null_mut(),
        mechanism: null_mut(),
        binding: null_mut(),
    };
    // SAFETY: live out-pointers and NUL-terminated strings (so for each call below).
    ok(unsafe { mc_governor_create(&mut r.governor) });
    // SAFETY: as above.
    ok(unsafe { mc_governor_open_account(r.governor, r.s.authority, u64::MAX, c_text("tenant").as_ptr()) });
    let path = c_text(path.to_str().unwrap());
    // SAFETY: as above.
    ok(unsafe { mc_recorder_create(path.as_ptr(), &mut r.recorder) });
    // SAFETY: as above.
    ok(unsafe { mc_recorder_trace_governor(r.recorder, r.governor, &mut r.recorded) });
    r.mechanism = register_through(&r, r.recorded);
    // SAFETY: as above.
    ok(unsafe { mc_bind_mechanism(r.s.registry, r.mechanism, &mut r.binding) });
    r
}

fn register_through(r: &Recorded, governor: *mut McGovernor) -> *mut McMechanism {
    let mut mechanism = null_mut();
    // SAFETY: a live out-pointer.
    let status = unsafe {
        mc_register_cpu_allocator(r.s.registry, governor, r.s.context, r.s.authority, MC_CPU_SYSTEM, &mut mechanism)
    };
    if status != MC_OK {
        assert!(mechanism.is_null(), "a refused registration makes no handle");
    }
    ok(status);
    mechanism
}

/// `pairs` allocations, each released at once, through `binding`.
fn allocate_and_release(binding: *mut McBinding, pairs: usize) {
    for _ in 0..pairs {
        let mut block = null_mut();
        // SAFETY: a live out-pointer; a null report is allowed.
        ok(unsafe { mc_allocate(binding, 4096, 64, MP_ROLE_OTHER, &mut block) });
        // SAFETY: as above.
        ok(unsafe { mc_release(binding, block, null_mut()) });
    }
}

fn mark(recorder: *mut McRecorder, kind: McMark, label: &str) -> McStatus {
    // SAFETY: a NUL-terminated label.
    unsafe { mc_recorder_mark(recorder, HOST, kind, c_text(label).as_ptr()) }
}

fn finish(recorder: *mut McRecorder) -> (McStatus, McRecordingSummary) {
    let mut summary = McRecordingSummary::default();
    // SAFETY: a live out-pointer.
    let status = unsafe { mc_recorder_finish(recorder, &mut summary) };
    (status, summary)
}

/// Tears down what `recorded` made (the recorder already destroyed).
fn teardown(r: Recorded) {
    ok(mc_binding_destroy(r.binding));
    ok(mc_binding_destroy(r.s.binding));
    for mechanism in [r.mechanism, r.s.mechanism] {
        ok(mc_mechanism_retire(r.s.registry, mechanism));
        ok(mc_mechanism_remove(r.s.registry, mechanism));
    }
    ok(mc_context_remove(r.s.registry, r.s.context));
    ok(mc_authority_remove(r.s.registry, r.s.authority));
    ok(mc_registry_destroy(r.s.registry));
    ok(mc_governor_destroy(r.recorded));
    ok(mc_governor_destroy(r.governor));
}

fn temporary(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("memory-capi-api-{}-{name}.mtrace", std::process::id()))
}

fn read_recording(path: &std::path::Path) -> memory_trace::Trace {
    let trace = memory_trace::read_trace(std::fs::File::open(path).unwrap()).unwrap();
    assert!(trace.damage.is_none(), "{:?}", trace.damage);
    trace
}

#[test]
fn a_finished_recording_refuses_a_second_finish_marks_and_registrations_with_mc_err_state() {
    let path = temporary("finished");
    let r = recorded(&path);
    allocate_and_release(r.binding, 3);
    ok(mark(r.recorder, MC_MARK_NOTE, "done"));
    let (status, summary) = finish(r.recorder);
    ok(status);
    assert_eq!((summary.events, summary.dropped), (7, 0));

    // Once only: the second finish leaves the summary alone and says what to do.
    let (status, again) = finish(r.recorder);
    assert_eq!(status, MC_ERR_STATE, "{}", message());
    let text = message();
    assert!(text.starts_with("mc_recorder_finish: MC_ERR_STATE: "), "{text}");
    assert!(text.contains("already finished") && text.contains("mc_recorder_create"), "{text}");
    assert_eq!(again, McRecordingSummary::default());
    assert_eq!(mark(r.recorder, MC_MARK_NOTE, "late"), MC_ERR_STATE);
    let text = message();
    assert!(text.contains("finished its recording") && text.contains("mc_recorder_create"), "{text}");
    let mut another = null_mut();
    // SAFETY: a live out-pointer.
    assert_eq!(unsafe { mc_recorder_trace_governor(r.recorder, r.governor, &mut another) }, MC_ERR_STATE);
    assert!(another.is_null());
    let mut late = null_mut();
    // SAFETY: a live out-pointer.
    let status = unsafe {
        mc_register_cpu_allocator(r.s.registry, r.recorded, r.s.context, r.s.authority, MC_CPU_SYSTEM, &mut late)
    };
    assert_eq!(status, MC_ERR_STATE, "{}", message());
    assert!(message().contains("whose recording is finished"), "{}", message());
    assert!(late.is_null());
    // The recorded mechanism keeps working, unrecorded (its events are dropped).
    allocate_and_release(r.binding, 1);
    // A destroy after a finish has nothing left to finish.
    ok(mc_recorder_destroy(r.recorder));
    assert_eq!(mc_recorder_destroy(r.recorder), MC_ERR_STALE_HANDLE);
    teardown(r);

    let trace = read_recording(&path);
    assert_eq!(trace.events.len(), 7, "the late events are not in the file");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_recorder_destroyed_unfinished_writes_every_event_recorded_and_the_end_record() {
    let path = temporary("unfinished");
    let r = recorded(&path);
    ok(mark(r.recorder, MC_MARK_NOTE, "serve"));
    allocate_and_release(r.binding, 5);
    ok(mark(r.recorder, MC_MARK_DEVICE_LOST, "lost"));
    // No mc_recorder_finish: the destroy finishes the recording.
    ok(mc_recorder_destroy(r.recorder));
    assert_eq!(mc_recorder_destroy(r.recorder), MC_ERR_STALE_HANDLE);
    assert_eq!(finish(r.recorder).0, MC_ERR_STALE_HANDLE);
    // The recording handle stays a governor handle; the mechanism works, unrecorded, and
    // nothing more is registered through the handle.
    allocate_and_release(r.binding, 2);
    let mut late = null_mut();
    // SAFETY: a live out-pointer.
    let status = unsafe {
        mc_register_cpu_allocator(r.s.registry, r.recorded, r.s.context, r.s.authority, MC_CPU_SYSTEM, &mut late)
    };
    assert_eq!(status, MC_ERR_STATE, "{}", message());
    teardown(r);

    let trace = read_recording(&path);
    let end = trace.end.expect("the destroy wrote the end record");
    assert_eq!((end.events, end.dropped), (12, 0), "5 allocations, 5 releases, 2 marks; nothing dropped before it");
    let marks: Vec<(memory_trace::MarkKind, &str)> = trace
        .events
        .iter()
        .filter_map(|event| match &event.what {
            memory_trace::What::Mark { kind, label, .. } => Some((*kind, label.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(marks, [(memory_trace::MarkKind::Note, "serve"), (memory_trace::MarkKind::DeviceLost, "lost")]);
    let lost = trace
        .events
        .iter()
        .find(|event| matches!(event.what, memory_trace::What::Mark { kind: memory_trace::MarkKind::DeviceLost, .. }))
        .expect("the device-lost mark");
    assert_eq!(lost.device, memory_governor::DeviceKey::host(3));
    let allocations = trace.events.iter().filter(|event| matches!(event.what, memory_trace::What::Allocate(_))).count();
    assert_eq!(allocations, 5);
    assert_eq!(trace.tenants.len(), 1);
    assert_eq!(trace.tenants[0].label, "tenant");
    std::fs::remove_file(&path).unwrap();
}

/// A file every write to fails (ENOSPC), as root too.
const FULL: &str = "/dev/full";

#[test]
fn a_finish_that_cannot_write_is_mc_err_backend_and_the_recording_is_finished() {
    assert!(std::path::Path::new(FULL).exists(), "{FULL} is the file no write to succeeds");
    let r = recorded(std::path::Path::new(FULL));
    allocate_and_release(r.binding, 2);
    ok(mark(r.recorder, MC_MARK_DEVICE_LOST, "lost"));
    let (status, summary) = finish(r.recorder);
    assert_eq!(status, MC_ERR_BACKEND, "{}", message());
    let text = message();
    assert!(text.starts_with("mc_recorder_finish: MC_ERR_BACKEND: "), "{text}");
    assert!(text.contains("\"/dev/full\"") && text.contains("os error 28"), "{text}");
    assert!(text.contains("readable up to there") && text.contains("the recording is finished"), "{text}");
    assert!(!text.contains("::"), "{text}");
    assert_eq!(summary, McRecordingSummary::default(), "no summary on failure");
    // Finished either way.
    assert_eq!(finish(r.recorder).0, MC_ERR_STATE);
    assert!(message().contains("already finished"), "{}", message());
    assert_eq!(mark(r.recorder, MC_MARK_NOTE, "late"), MC_ERR_STATE);
    ok(mc_recorder_destroy(r.recorder));
    teardown(r);
}

#[test]
fn a_destroy_whose_finish_cannot_write_is_mc_err_backend_and_a_second_destroy_succeeds() {
    let r = recorded(std::path::Path::new(FULL));
    allocate_and_release(r.binding, 2);
    assert_eq!(mc_recorder_destroy(r.recorder), MC_ERR_BACKEND, "{}", message());
    assert!(message().starts_with("mc_recorder_destroy: MC_ERR_BACKEND: "), "{}", message());
    // The recording is finished and the handle still valid: destroy it again.
    assert_eq!(mark(r.recorder, MC_MARK_NOTE, "late"), MC_ERR_STATE);
    ok(mc_recorder_destroy(r.recorder));
    assert_eq!(mc_recorder_destroy(r.recorder), MC_ERR_STALE_HANDLE);
    teardown(r);
}

/// `mc_plugin_load("")` is refused as an invalid argument (`dlopen("")` would open the
/// program itself), and a path the loader cannot open is `MC_ERR_PLUGIN` with the
/// loader's reason; neither writes a handle.
#[test]
fn a_plugin_load_of_an_empty_or_missing_path_says_why() {
    let mut library: *mut McPluginLibrary = null_mut();
    // SAFETY: a NUL-terminated path and a live out-pointer.
    assert_eq!(unsafe { mc_plugin_load(c"".as_ptr(), &mut library) }, MC_ERR_INVALID_ARGUMENT);
    assert!(message().contains("path is empty") && message().contains("pass the path of the plugin"), "{}", message());
    assert!(library.is_null());
    // SAFETY: as above.
    let status = unsafe { mc_plugin_load(c"/nonexistent/libno-plugin.so".as_ptr(), &mut library) };
    assert_eq!(status, MC_ERR_PLUGIN, "{}", message());
    assert!(message().contains("No such file or directory"), "{}", message());
    assert!(library.is_null());
}
