//! What a thread gives back when it exits: its hazard slot ([`crate::hazard`]), its
//! free lists of the handle tables ([`crate::handles`]) and its last failure's message
//! ([`crate::status`]), through [`on_exit`].
//!
//! A thread arms the hand-over ([`arm`]) the first time it takes a hazard slot or keeps
//! a free cell. On Linux the hand-over runs from a pthread key's destructor, not from a
//! Rust thread-local destructor: a C runtime calls the library from its own pthread key
//! destructors too (a per-thread cache giving its blocks back as the thread exits), and
//! glibc runs those after every thread-local destructor. A Rust thread-local first
//! touched there registers a destructor that never runs, so the thread's slot and free
//! cells would stay taken for the life of the process (and the destructor's registration
//! leak). A key set from a key destructor is run in the next round (glibc runs up to
//! `PTHREAD_DESTRUCTOR_ITERATIONS`, 4, rounds). Once the hand-over ran, the thread is
//! [`exited`]: later calls on it (from a destructor that runs after it) borrow with a
//! counted borrow and give freed cells straight to the tables' orphans.
//!
//! Elsewhere (and under loom) a thread-local destructor runs the hand-over, as before.

use std::cell::Cell;

use crate::sync::thread_local;

thread_local! {
    /// Whether this thread armed the hand-over (it runs once, when the thread exits).
    static ARMED: Cell<bool> = const { Cell::new(false) };
    /// Whether the hand-over ran: the thread is exiting.
    static EXITED: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread has exited already (its hand-over ran); such a thread keeps
/// nothing of its own.
#[inline]
pub(crate) fn exited() -> bool {
    EXITED.try_with(Cell::get).unwrap_or(true)
}

/// Arms this thread's hand-over; `false` if the thread has exited (or it cannot be
/// armed): then keep nothing for this thread.
#[cold]
#[inline(never)]
pub(crate) fn arm() -> bool {
    if exited() {
        return false;
    }
    if ARMED.try_with(Cell::get).unwrap_or(false) {
        return true;
    }
    let armed = imp::arm();
    if armed {
        let _ = ARMED.try_with(|flag| flag.set(true));
    }
    armed
}

/// Makes sure this thread's last message ([`crate::status`]) is freed when it exits:
/// arms the hand-over, or, on a thread whose hand-over ran already (a failure reported
/// from a later destructor), arms one more round of it, which frees only the message.
#[cold]
pub(crate) fn keep_message() {
    if !ARMED.try_with(Cell::get).unwrap_or(true) && imp::arm() {
        let _ = ARMED.try_with(|flag| flag.set(true));
    }
}

/// Runs the hand-over: the slot and free lists once per thread, the message each round.
fn on_exit() {
    let _ = ARMED.try_with(|flag| flag.set(false));
    if !EXITED.try_with(|flag| flag.replace(true)).unwrap_or(true) {
        crate::handles::hand_over_all();
        crate::hazard::release_current();
    }
    crate::status::forget_message();
}

#[cfg(all(target_os = "linux", not(memory_loom)))]
mod imp {
    use std::ffi::{c_char, c_int, c_uint, c_void};
    use std::sync::OnceLock;

    /// `pthread_key_t` on Linux (glibc and musl).
    type Key = c_uint;

    unsafe extern "C" {
        fn pthread_key_create(key: *mut Key, destructor: Option<unsafe extern "C" fn(*mut c_void)>) -> c_int;
        fn pthread_setspecific(key: Key, value: *const c_void) -> c_int;
    }

    /// The process's key, made on first use (`None` if the system refused one).
    static KEY: OnceLock<Option<Key>> = OnceLock::new();

    /// `Dl_info` of `<dlfcn.h>` (glibc and musl).
    #[repr(C)]
    struct DlInfo {
        fname: *const c_char,
        fbase: *mut c_void,
        sname: *const c_char,
        saddr: *mut c_void,
    }

    /// `RTLD_LAZY`, `RTLD_NOLOAD` and `RTLD_NODELETE` on Linux (glibc and musl).
    const RTLD_LAZY: c_int = 0x1;
    const RTLD_NOLOAD: c_int = 0x4;
    const RTLD_NODELETE: c_int = 0x1000;

    unsafe extern "C" {
        fn dladdr(address: *const c_void, info: *mut DlInfo) -> c_int;
        fn dlopen(file: *const c_char, flags: c_int) -> *mut c_void;
        fn dlerror() -> *mut c_char;
    }

    /// The key's destructor: the thread is exiting.
    ///
    /// # Safety
    /// Called only by the C library, as the destructor of [`KEY`] on the exiting thread;
    /// `_value` is the marker [`arm`] set and is never dereferenced, so any value is sound.
    unsafe extern "C" fn destructor(_value: *mut c_void) {
        // Nothing may unwind into the C library that called us.
        let _ = std::panic::catch_unwind(super::on_exit);
    }

    /// Keeps the shared object holding this code mapped for the life of the process.
    ///
    /// glibc calls a key's destructor through the pointer given to `pthread_key_create`
    /// whether or not the object that holds it is still mapped: a runtime that
    /// `dlopen`s `libmemory_capi.so` (or a library of its own linking the static one),
    /// calls it from a thread and `dlclose`s it while that thread runs had the thread
    /// jump into unmapped memory as it exited (SIGSEGV in `__nptl_deallocate_tsd`).
    /// The handle tables and hazard slots are kept for the life of the process anyway
    /// (docs/C-ABI.md §2), so the object is made undeletable (`RTLD_NODELETE`) before
    /// the key exists: a `dlclose` then leaves it mapped. In an executable (no shared
    /// object to pin; `dladdr` names the program, often as `argv[0]`) the `dlopen` finds
    /// nothing and nothing changes, and the loader's message of that failed lookup is
    /// cleared, so a host that reads `dlerror()` after calls of its own never sees it.
    fn pin_this_object() {
        let mut info = DlInfo {
            fname: std::ptr::null(),
            fbase: std::ptr::null_mut(),
            sname: std::ptr::null(),
            saddr: std::ptr::null_mut(),
        };
        // SAFETY: `destructor` is code of this object; `info` is a live, writable local.
        let found = unsafe { dladdr(destructor as *const c_void, &mut info) } != 0;
        if !found || info.fname.is_null() {
            return;
        }
        // SAFETY: `fname` is the NUL-terminated path the loader keeps for the mapped
        // object; with RTLD_NOLOAD nothing new is loaded, only the object already mapped
        // gets RTLD_NODELETE. The reference it returns is deliberately never closed.
        let pinned = unsafe { dlopen(info.fname, RTLD_LAZY | RTLD_NOLOAD | RTLD_NODELETE) };
        if pinned.is_null() {
            // SAFETY: `dlerror` only reads and clears this thread's last loader message.
            let _ = unsafe { dlerror() };
        }
    }

    pub(super) fn arm() -> bool {
        let key = KEY.get_or_init(|| {
            pin_this_object();
            let mut key: Key = 0;
            // SAFETY: `key` is a live local; the destructor is an `extern "C"` function
            // that lives as long as the process (`pin_this_object` keeps the object
            // holding it mapped, whatever `dlclose` the runtime makes).
            (unsafe { pthread_key_create(&mut key, Some(destructor)) } == 0).then_some(key)
        });
        let Some(key) = *key else { return false };
        // Any non-null value runs the destructor at exit; it is never dereferenced.
        let marker = std::ptr::NonNull::<c_void>::dangling().as_ptr();
        // SAFETY: `key` was made by `pthread_key_create` and is never deleted.
        unsafe { pthread_setspecific(key, marker) == 0 }
    }
}

#[cfg(not(all(target_os = "linux", not(memory_loom))))]
mod imp {
    use crate::sync::thread_local;

    struct Guard;

    impl Drop for Guard {
        fn drop(&mut self) {
            super::on_exit();
        }
    }

    thread_local! {
        static GUARD: Guard = const { Guard };
    }

    pub(super) fn arm() -> bool {
        // Touching the guard registers its destructor; it fails once the thread exits.
        GUARD.try_with(|_| ()).is_ok()
    }
}
