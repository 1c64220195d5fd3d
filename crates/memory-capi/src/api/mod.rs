//! The exported functions, one module per thing a C programmer looks up:
//!
//! | module | functions | handles |
//! |--------|-----------|---------|
//! | (here) | `mc_api_version`, `mc_last_error_message`, `mc_status_name` | — |
//! | `registry` | registry, contexts, authorities, device loss and termination | `McRegistry`, `McContext`, `McAuthority` |
//! | `governor` | governor, limits, quotas, accounts, policy, reclaim holders | `McGovernor`, `McReclaimHolder` |
//! | `mechanisms` | CPU, CUDA, plugin and vtable registration; select, retire, remove, retry | `McMechanism` |
//! | `bindings` | bind, allocate, release (now, deferred, by the handle alone), drop | `McBinding`, `McAllocation` |
//! | `capabilities` | virtual backing (commit, decommit) and shared mapping (map, unmap) | `McBacking` |
//! | `queues` | deferred-release queues | `McQueue` |
//! | `plugins` | plugin libraries: load, tally, retry suspect blocks, unload | `McPluginLibrary` |
//! | `recorder` | recording governed mechanisms to a trace file; marks; the caller tag | `McRecorder` |
//! | `snapshot` | the JSON snapshot | — |
//!
//! Each function runs inside [`guard`] (no panic crosses the boundary), checks every
//! argument it was given (pointers, handles, enum values) before anything has an effect,
//! and validates every handle through its table (see [`crate::handles`]). Each handle
//! kind's table and tag live in the module of its functions.

use std::ffi::{CStr, c_char, c_void};

use memory_governor::{DeviceKey, MemoryRole};
use memory_plugin_abi::{MP_TIER_DEVICE, MP_TIER_DISK, MP_TIER_HOST, MpDevice};

use crate::handles::{Fault, Slots, number, pointer};
use crate::status::{
    Failure, MC_ERR_BUSY, MC_ERR_EXHAUSTED, MC_ERR_INVALID_ARGUMENT, MC_ERR_INVALID_HANDLE, MC_ERR_STALE_HANDLE,
    McStatus, guard,
};

/// Declares handle tables: each a constant front (`Slots`) over its cells (`Store`,
/// named after `in`) and its threads' free lists; under loom (whose primitives have no
/// const constructors) both are built once per model execution.
macro_rules! tables {
    ($($name:ident in $cells:ident: $value:ty = ($kind:expr, $scheme:expr, $what:literal, $free:ident);)*) => {
        crate::sync::thread_local! {
            $(static $free: crate::handles::FreeList = const { crate::handles::FreeList::new() };)*
        }
        $(
            #[cfg(not(memory_loom))]
            pub(crate) static $name: crate::handles::Slots<$value> =
                crate::handles::Slots::new($kind, $scheme, $what, &$free, &$cells);
            #[cfg(not(memory_loom))]
            static $cells: crate::handles::Store<$value> = crate::handles::Store::new();
        )*
        #[cfg(memory_loom)]
        loom::lazy_static! {
            $(
                pub(crate) static ref $name: crate::handles::Slots<$value> = crate::handles::Slots::new(
                    $kind, $scheme, $what, &$free, Box::leak(Box::new(crate::handles::Store::new())));
            )*
        }
    };
}

mod bindings;
mod capabilities;
mod governor;
mod mechanisms;
mod plugins;
mod queues;
mod recorder;
mod registry;
mod snapshot;

pub use bindings::*;
pub use capabilities::*;
pub use governor::*;
pub use mechanisms::*;
pub use plugins::*;
pub use queues::*;
pub use recorder::*;
pub use registry::*;
pub use snapshot::*;

/// The C API's version: major changes break callers, minor ones only add.
pub const MC_API_MAJOR: u32 = 1;
/// The C API's minor version.
pub const MC_API_MINOR: u32 = 3;

/// What a handle of `tag` is, for a message about a handle of the wrong kind.
fn kind_name(tag: u8) -> &'static str {
    match tag {
        registry::KIND_REGISTRY => "it is a registry handle",
        governor::KIND_GOVERNOR => "it is a governor handle",
        registry::KIND_CONTEXT => "it is a context handle",
        registry::KIND_AUTHORITY => "it is an authority handle",
        mechanisms::KIND_MECHANISM => "it is a mechanism handle",
        bindings::KIND_BINDING => "it is a binding handle",
        bindings::KIND_ALLOCATION => "it is an allocation handle",
        plugins::KIND_LIBRARY => "it is a plugin library handle",
        queues::KIND_QUEUE => "it is a queue handle",
        capabilities::KIND_BACKING => "it is a shared backing handle",
        governor::KIND_HOLDER => "it is a reclaim holder handle",
        recorder::KIND_RECORDER => "it is a recorder handle",
        _ => "it is no handle of this library",
    }
}

/// A handle that did not validate.
#[cold]
#[inline(never)]
pub(crate) fn handle_failure(what: &str, handle: u64, fault: Fault) -> Failure {
    match fault {
        Fault::Null => Failure::null(what),
        Fault::WrongKind { found } => Failure::new(
            MC_ERR_INVALID_HANDLE,
            format!(
                "{what} {handle:#x} is not such a handle ({}); pass the handle this library returned for it",
                kind_name(found)
            ),
        ),
        Fault::Stale => Failure::new(
            MC_ERR_STALE_HANDLE,
            format!("{what} {handle:#x} was already released or destroyed; do not use a handle after releasing it"),
        ),
        Fault::Busy => Failure::new(
            MC_ERR_BUSY,
            format!("{what} {handle:#x} is being used by another call right now; retry once that call returned"),
        ),
        Fault::Exhausted => Failure::new(
            MC_ERR_EXHAUSTED,
            format!(
                "no {what} handle is left (the table holds at most {} live handles); release some",
                crate::handles::MAX_CELLS
            ),
        ),
    }
}

// ---------------------------------------------------------------------------------
// Helpers shared by the modules

#[inline(always)]
pub(crate) fn borrow<T: Send + Sync + 'static, P>(
    slots: &'static Slots<T>,
    handle: *const P,
) -> Result<crate::handles::Borrow<T>, Failure> {
    let number = number(handle);
    match slots.borrow(number) {
        Ok(borrowed) => Ok(borrowed),
        Err(fault) => Err(handle_failure(slots.name(), number, fault)),
    }
}

/// Borrows `handle` unless it is null (an optional handle argument).
#[inline]
pub(crate) fn borrow_optional<T: Send + Sync + 'static, P>(
    slots: &'static Slots<T>,
    handle: *const P,
) -> Result<Option<crate::handles::Borrow<T>>, Failure> {
    if handle.is_null() { Ok(None) } else { borrow(slots, handle).map(Some) }
}

/// A free cell of `slots`, reserved before a call has any effect, so that running out
/// of handles is an error before anything happened rather than after.
#[inline(always)]
pub(crate) fn vacancy<T: Send + Sync + 'static>(
    slots: &'static Slots<T>,
) -> Result<crate::handles::Vacancy<T>, Failure> {
    slots.vacancy().map_err(|fault| handle_failure(slots.name(), 0, fault))
}

/// Fills a vacancy; returns the handle as the C type.
#[inline(always)]
pub(crate) fn fill<T: Send + Sync + 'static, P>(vacancy: crate::handles::Vacancy<T>, value: T) -> *mut P {
    pointer(vacancy.fill(value))
}

pub(crate) fn remove<T: Send + Sync + 'static, P>(slots: &'static Slots<T>, handle: *const P) -> Result<(), Failure> {
    let number = number(handle);
    slots.remove(number).map_err(|fault| handle_failure(slots.name(), number, fault))
}

/// Checks an out-pointer before anything is mutated.
#[inline]
pub(crate) fn check_out<T>(out: *mut T, what: &str) -> Result<(), Failure> {
    if out.is_null() {
        return Err(Failure::null(what));
    }
    if !out.is_aligned() {
        return Err(Failure::new(MC_ERR_INVALID_ARGUMENT, format!("{what} {out:p} is misaligned for its type")));
    }
    Ok(())
}

/// Checks an optional out-pointer (null is allowed) before anything is mutated.
#[inline]
pub(crate) fn check_optional_out<T>(out: *mut T, what: &str) -> Result<(), Failure> {
    if out.is_null() { Ok(()) } else { check_out(out, what) }
}

/// Writes through an out-pointer that [`check_out`] accepted.
///
/// # Safety
/// `out` was accepted by [`check_out`] and points to writable memory for a `T`.
#[inline]
pub(crate) unsafe fn write<T>(out: *mut T, value: T) {
    // SAFETY: non-null and aligned (checked), writable (the caller's contract).
    unsafe { out.write(value) };
}

/// Writes through an optional out-pointer that [`check_optional_out`] accepted.
///
/// # Safety
/// `out` is null or was accepted by [`check_out`] and points to writable memory for a `T`.
#[inline]
pub(crate) unsafe fn write_optional<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: non-null, checked and writable (the caller's contract).
        unsafe { write(out, value) };
    }
}

/// Reads a NUL-terminated UTF-8 string argument.
///
/// # Safety
/// `text` is null or NUL-terminated and readable.
pub(crate) unsafe fn text<'a>(text: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if text.is_null() {
        return Err(Failure::null(what));
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract).
    unsafe { CStr::from_ptr(text) }.to_str().map_err(|error| {
        Failure::new(MC_ERR_INVALID_ARGUMENT, format!("{what} is not UTF-8 ({error}); pass UTF-8 text"))
    })
}

/// Reads an optional string argument (null reads as `default`).
///
/// # Safety
/// `value` is null or NUL-terminated and readable.
pub(crate) unsafe fn text_or<'a>(value: *const c_char, what: &str, default: &'a str) -> Result<&'a str, Failure> {
    if value.is_null() {
        Ok(default)
    } else {
        // SAFETY: non-null and NUL-terminated (the caller's contract).
        unsafe { text(value, what) }
    }
}

#[inline]
pub(crate) fn device_key(device: MpDevice) -> Result<DeviceKey, Failure> {
    match device.tier {
        MP_TIER_DEVICE => Ok(DeviceKey::device(device.index)),
        MP_TIER_HOST => Ok(DeviceKey::host(device.index)),
        MP_TIER_DISK => Ok(DeviceKey::disk(device.index)),
        tier => Err(Failure::new(
            MC_ERR_INVALID_ARGUMENT,
            format!("device tier {tier} is unknown; use MP_TIER_DEVICE, MP_TIER_HOST or MP_TIER_DISK"),
        )),
    }
}

#[inline]
pub(crate) fn role(code: u32) -> Result<MemoryRole, Failure> {
    MemoryRole::ALL.get(code as usize).copied().ok_or_else(|| {
        Failure::new(MC_ERR_INVALID_ARGUMENT, format!("role {code} is unknown; use MP_ROLE_WEIGHTS .. MP_ROLE_OTHER"))
    })
}

/// A byte count or offset from C as a host `usize`.
#[inline]
pub(crate) fn host_size(value: u64, what: &str) -> Result<usize, Failure> {
    usize::try_from(value)
        .map_err(|_| Failure::new(MC_ERR_INVALID_ARGUMENT, format!("{what} {value} does not fit this host's usize")))
}

/// A user pointer with its destructor: pinned by the registry as a resource, or by the
/// governor as a reclaim holder.
pub(crate) struct UserPointer {
    pub(crate) user: *mut c_void,
    destroy: crate::types::McDestroyFn,
    /// Cleared when a registration fails: the pointer stays the caller's and
    /// `destroy` is not called (docs/C-ABI.md §2).
    armed: crate::sync::AtomicBool,
}

impl UserPointer {
    pub(crate) fn new(user: *mut c_void, destroy: crate::types::McDestroyFn) -> UserPointer {
        UserPointer { user, destroy, armed: crate::sync::AtomicBool::new(true) }
    }

    /// Hands the pointer back to the caller: `destroy` will not run.
    pub(crate) fn disarm(&self) {
        self.armed.store(false, crate::sync::Ordering::SeqCst);
    }
}

// SAFETY: the C caller hands the pointer over to the library, which may drop it on any
// thread; every function taking a `user` + `destroy` pair documents that the
// destructor (and any callback given with it) must be callable from any thread.
unsafe impl Send for UserPointer {}
// SAFETY: the pointer is never dereferenced on the Rust side; only the caller's own
// functions (destructor, callbacks) receive it, and they are documented thread-safe.
unsafe impl Sync for UserPointer {}

impl Drop for UserPointer {
    fn drop(&mut self) {
        if let Some(destroy) = self.destroy
            && self.armed.load(crate::sync::Ordering::SeqCst)
        {
            // SAFETY: the caller registered this destructor for this pointer; it runs
            // exactly once (the last reference is gone) and with no lock held (the
            // registry and the governor drop resources outside their locks).
            unsafe { destroy(self.user) };
        }
    }
}

// ---------------------------------------------------------------------------------
// Version and messages

/// Writes the C API version (`MC_API_MAJOR`, `MC_API_MINOR`).
///
/// # Safety
/// `major` and `minor` are null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_api_version(major: *mut u32, minor: *mut u32) -> McStatus {
    guard("mc_api_version", || {
        check_out(major, "major")?;
        check_out(minor, "minor")?;
        // SAFETY: checked; writable by the caller's contract.
        unsafe { write(major, MC_API_MAJOR) };
        // SAFETY: as above.
        unsafe { write(minor, MC_API_MINOR) };
        Ok(())
    })
}

/// The message of the last failed call on this thread (what was asked, what was found,
/// what to do), or "" if the last call succeeded. Valid until the next call on this
/// thread; never null.
#[unsafe(no_mangle)]
pub extern "C" fn mc_last_error_message() -> *const c_char {
    crate::status::last_message()
}

/// The name of a status code ("MC_ERR_STALE_HANDLE"); never null.
#[unsafe(no_mangle)]
pub extern "C" fn mc_status_name(status: McStatus) -> *const c_char {
    macro_rules! names {
        ($($code:ident),*) => {
            match status {
                $(crate::status::$code => concat!(stringify!($code), "\0").as_ptr().cast(),)*
                _ => c"unknown status".as_ptr(),
            }
        };
    }
    names!(
        MC_OK,
        MC_ERR_NULL_ARGUMENT,
        MC_ERR_INVALID_HANDLE,
        MC_ERR_STALE_HANDLE,
        MC_ERR_BUSY,
        MC_ERR_FOREIGN,
        MC_ERR_INVALID_ARGUMENT,
        MC_ERR_OUT_OF_MEMORY,
        MC_ERR_ADMISSION_REFUSED,
        MC_ERR_DEVICE_LOST,
        MC_ERR_INACTIVE,
        MC_ERR_STATE,
        MC_ERR_NOT_QUIESCENT,
        MC_ERR_UNSUPPORTED,
        MC_ERR_RELEASE_FAILED,
        MC_ERR_QUEUE_REFUSED,
        MC_ERR_PLUGIN,
        MC_ERR_UNLOAD_REFUSED,
        MC_ERR_BUFFER_TOO_SMALL,
        MC_ERR_BACKEND,
        MC_ERR_EXHAUSTED,
        MC_ERR_PANIC,
        MC_ERR_SUSPECT_BLOCKS
    )
}
