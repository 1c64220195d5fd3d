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
