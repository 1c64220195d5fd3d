//! Status codes, the thread-local message, and the guard every entry point runs in
//! (no panic crosses the boundary).

use std::cell::Cell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use memory_governor::{AllocError, AllocateError, BindError, HandleError, LimitError, RegistryError};
use memory_plugin::PluginError;

/// A status code: `MC_OK` or one of the `MC_ERR_*` values.
pub type McStatus = i32;
/// Success.
pub const MC_OK: McStatus = 0;
/// A required pointer argument was null (a handle, an out-pointer, a string).
pub const MC_ERR_NULL_ARGUMENT: McStatus = 1;
/// The value is not a handle of the expected kind (another kind, or no handle at all).
pub const MC_ERR_INVALID_HANDLE: McStatus = 2;
/// The handle was released or destroyed already (a double release, a use after destroy).
pub const MC_ERR_STALE_HANDLE: McStatus = 3;
/// Another call is using the handle right now; retry.
pub const MC_ERR_BUSY: McStatus = 4;
/// The handle belongs to another registry, binding or plugin instance.
pub const MC_ERR_FOREIGN: McStatus = 5;
/// An argument is invalid (layout, device, UTF-8, device mismatch, ...).
pub const MC_ERR_INVALID_ARGUMENT: McStatus = 6;
/// Out of memory (the allocator's or the handle table's).
pub const MC_ERR_OUT_OF_MEMORY: McStatus = 7;
/// The governor refused the request (limit, quota or reserve).
pub const MC_ERR_ADMISSION_REFUSED: McStatus = 8;
/// The device is lost; invalidate it and confirm its context terminated.
pub const MC_ERR_DEVICE_LOST: McStatus = 9;
/// The mechanism is retired (or otherwise inactive) and takes no new work.
pub const MC_ERR_INACTIVE: McStatus = 10;
/// The object is in a state that forbids the call (no selection, context still live, ...).
pub const MC_ERR_STATE: McStatus = 11;
/// Work is still in flight or memory still attached; poll again later.
pub const MC_ERR_NOT_QUIESCENT: McStatus = 12;
/// The operation is not supported (by this allocator, plugin or build).
pub const MC_ERR_UNSUPPORTED: McStatus = 13;
/// The allocator refused the release without mutating anything; the allocation is still yours.
pub const MC_ERR_RELEASE_FAILED: McStatus = 14;
/// The queue refused the deferred release; the allocation is still yours.
pub const MC_ERR_QUEUE_REFUSED: McStatus = 15;
/// A plugin could not be loaded or negotiated.
pub const MC_ERR_PLUGIN: McStatus = 16;
/// The plugin library cannot be unloaded yet (something made through it lives).
pub const MC_ERR_UNLOAD_REFUSED: McStatus = 17;
/// The buffer is too small; the length needed was written.
pub const MC_ERR_BUFFER_TOO_SMALL: McStatus = 18;
/// A backend (driver, operating system, plugin) failed.
pub const MC_ERR_BACKEND: McStatus = 19;
/// Identities or handles ran out.
pub const MC_ERR_EXHAUSTED: McStatus = 20;
/// A panic inside the library was caught; the registry stays consistent.
pub const MC_ERR_PANIC: McStatus = 21;
/// The plugin library cannot be unloaded: the host keeps blocks of it as suspect
/// (`mc_plugin_retry_suspects` hands them back to the plugin); the count is in the message.
pub const MC_ERR_SUSPECT_BLOCKS: McStatus = 22;

/// The name of a status code.
pub(crate) fn status_name(status: McStatus) -> &'static str {
    match status {
        MC_OK => "MC_OK",
        MC_ERR_NULL_ARGUMENT => "MC_ERR_NULL_ARGUMENT",
        MC_ERR_INVALID_HANDLE => "MC_ERR_INVALID_HANDLE",
        MC_ERR_STALE_HANDLE => "MC_ERR_STALE_HANDLE",
        MC_ERR_BUSY => "MC_ERR_BUSY",
        MC_ERR_FOREIGN => "MC_ERR_FOREIGN",
        MC_ERR_INVALID_ARGUMENT => "MC_ERR_INVALID_ARGUMENT",
        MC_ERR_OUT_OF_MEMORY => "MC_ERR_OUT_OF_MEMORY",
        MC_ERR_ADMISSION_REFUSED => "MC_ERR_ADMISSION_REFUSED",
        MC_ERR_DEVICE_LOST => "MC_ERR_DEVICE_LOST",
        MC_ERR_INACTIVE => "MC_ERR_INACTIVE",
        MC_ERR_STATE => "MC_ERR_STATE",
        MC_ERR_NOT_QUIESCENT => "MC_ERR_NOT_QUIESCENT",
        MC_ERR_UNSUPPORTED => "MC_ERR_UNSUPPORTED",
        MC_ERR_RELEASE_FAILED => "MC_ERR_RELEASE_FAILED",
        MC_ERR_QUEUE_REFUSED => "MC_ERR_QUEUE_REFUSED",
        MC_ERR_PLUGIN => "MC_ERR_PLUGIN",
        MC_ERR_UNLOAD_REFUSED => "MC_ERR_UNLOAD_REFUSED",
        MC_ERR_BUFFER_TOO_SMALL => "MC_ERR_BUFFER_TOO_SMALL",
        MC_ERR_BACKEND => "MC_ERR_BACKEND",
        MC_ERR_EXHAUSTED => "MC_ERR_EXHAUSTED",
        MC_ERR_PANIC => "MC_ERR_PANIC",
        MC_ERR_SUSPECT_BLOCKS => "MC_ERR_SUSPECT_BLOCKS",
        _ => "unknown status",
    }
}

/// A failed call: its status and what to tell the caller.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) status: McStatus,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(status: McStatus, message: impl Into<String>) -> Failure {
        Failure { status, message: message.into() }
    }

    /// A null required argument.
    pub(crate) fn null(what: &str) -> Failure {
        Failure::new(MC_ERR_NULL_ARGUMENT, format!("{what} is null; pass a valid pointer"))
    }
}

impl From<RegistryError> for Failure {
    fn from(error: RegistryError) -> Failure {
        let status = match &error {
            RegistryError::ForeignRegistry { .. } => MC_ERR_FOREIGN,
            RegistryError::Unknown { .. } => MC_ERR_STALE_HANDLE,
            RegistryError::DeviceMismatch { .. } => MC_ERR_INVALID_ARGUMENT,
            RegistryError::ContextNotQuiescent { .. } | RegistryError::NotQuiescent { .. } => MC_ERR_NOT_QUIESCENT,
            RegistryError::Identity(_) => MC_ERR_EXHAUSTED,
            _ => MC_ERR_STATE,
        };
        Failure::new(status, error.to_string())
    }
}

impl From<BindError> for Failure {
    fn from(error: BindError) -> Failure {
        match error {
            BindError::Registry(error) => error.into(),
            BindError::Inactive { .. } => Failure::new(MC_ERR_INACTIVE, error.to_string()),
            error => Failure::new(MC_ERR_STATE, error.to_string()),
        }
    }
}

pub(crate) fn alloc_status(error: &AllocError) -> McStatus {
    match error {
        AllocError::Layout(_) => MC_ERR_INVALID_ARGUMENT,
        AllocError::OutOfMemory { .. } => MC_ERR_OUT_OF_MEMORY,
        AllocError::DeviceLost { .. } => MC_ERR_DEVICE_LOST,
        AllocError::AdmissionRefused { .. } => MC_ERR_ADMISSION_REFUSED,
        AllocError::Unsupported { .. } => MC_ERR_UNSUPPORTED,
        _ => MC_ERR_BACKEND,
    }
}

impl From<AllocateError> for Failure {
    fn from(error: AllocateError) -> Failure {
        let status = match &error {
            AllocateError::Inactive { .. } => MC_ERR_INACTIVE,
            AllocateError::DeviceLost { .. } => MC_ERR_DEVICE_LOST,
            AllocateError::Allocator(inner) => alloc_status(inner),
            AllocateError::Identity(_) => MC_ERR_EXHAUSTED,
            _ => MC_ERR_BACKEND,
        };
        Failure::new(status, error.to_string())
    }
}

impl From<&HandleError> for Failure {
    fn from(error: &HandleError) -> Failure {
        let status = match error {
            HandleError::ForeignRegistry { .. } | HandleError::BindingMismatch { .. } => MC_ERR_FOREIGN,
            HandleError::StaleAllocation => MC_ERR_STALE_HANDLE,
            HandleError::DeviceLost { .. } => MC_ERR_DEVICE_LOST,
            HandleError::Inactive { .. } => MC_ERR_INACTIVE,
            HandleError::ReleaseFailed(_) => MC_ERR_RELEASE_FAILED,
            HandleError::QueueRefused(_) => MC_ERR_QUEUE_REFUSED,
            _ => MC_ERR_STATE,
        };
        Failure::new(status, format!("{error}; the allocation handle stays valid"))
    }
}

impl From<LimitError> for Failure {
    fn from(error: LimitError) -> Failure {
        Failure::new(MC_ERR_INVALID_ARGUMENT, error.to_string())
    }
}

impl From<PluginError> for Failure {
    fn from(error: PluginError) -> Failure {
        let status = match &error {
            PluginError::Unsupported { .. } => MC_ERR_UNSUPPORTED,
            PluginError::ConfigHasNul { .. } => MC_ERR_INVALID_ARGUMENT,
            _ => MC_ERR_PLUGIN,
        };
        Failure::new(status, error.to_string())
    }
}

thread_local! {
    /// The last failure's message (`CString::into_raw`, null for none). A raw pointer, so
    /// no destructor: a call made while the thread exits, after its thread-local
    /// destructors ran (from a C runtime's pthread key destructor), still finds it, and
    /// it is freed by [`forget_message`] when the thread exits ([`crate::exit`]).
    static MESSAGE: Cell<*mut c_char> = const { Cell::new(std::ptr::null_mut()) };
    static FAILED: Cell<bool> = const { Cell::new(false) };
}

/// Frees this thread's message (the thread is exiting).
pub(crate) fn forget_message() {
    let _ = FAILED.try_with(|failed| failed.set(false));
    let old = MESSAGE.try_with(|message| message.replace(std::ptr::null_mut())).unwrap_or(std::ptr::null_mut());
    if !old.is_null() {
        // SAFETY: a non-null MESSAGE came from `CString::into_raw` in `remember` and was
        // just taken out of the cell, so this is its only owner.
        drop(unsafe { CString::from_raw(old) });
    }
}

/// Advice in the messages of the Rust crates below that names a Rust item, and what a C
/// caller does instead. Applied in order to every message that reaches C; the longer
/// phrases come before the names they contain. The C programs (`tests/c/contract.c`
/// walks every failure the C API produces; `tests/c/suspects.c` the loader's) check,
/// through `tests/c/check.h`, that no message names a Rust item.
const C_TERMS: &[(&str, &str)] = &[
    // memory-governor: exhaustion advice and account errors.
    (
        "use Governor::account to get it, or Governor::set_quota to change its quota",
        "change its quota with mc_governor_set_quota",
    ),
    (
        "install a policy that reclaims (ReclaimThenFail)",
        "install a policy that reclaims (mc_governor_set_policy with MC_POLICY_RECLAIM_THEN_FAIL)",
    ),
    (
        "raise it with Governor::set_overdraft_limit or GovernorConfig::with_overdraft_limit, or give",
        "the C API keeps the governor's default overdraft limit, so give",
    ),
    ("Governor::register_holder", "mc_governor_register_holder"),
    ("Governor::open_account", "mc_governor_open_account"),
    ("Governor::set_device_limit", "mc_governor_set_device_limit"),
    ("Governor::set_quota", "mc_governor_set_quota"),
    ("Governor::set_policy", "mc_governor_set_policy"),
    // memory-binding: lifecycle advice.
    (
        "call invalidate_device for its device first, then confirm termination",
        "call mc_invalidate_device for its device first, then mc_confirm_terminated",
    ),
    ("register an allocator for it or call select", "register an allocator for it or call mc_mechanism_select"),
    ("discharged by confirm_context_terminated", "discharged by mc_confirm_terminated"),
    (
        "release, retry quarantine or terminate first",
        "release its allocations (mc_release), retry its quarantine (mc_mechanism_retry_quarantined) or confirm \
         its context terminated (mc_confirm_terminated), and remove the dependent mechanisms (mc_mechanism_remove) \
         first",
    ),
    (
        "or register the composite with register_trusted_composite, attesting that its parts are coherent",
        "or register it as one vtable (mc_register_vtable)",
    ),
    ("is active; retire it first", "is active; retire it first (mc_mechanism_retire)"),
    (
        "is device-lost; confirm its context terminated first",
        "is device-lost; confirm its context terminated first (mc_confirm_terminated)",
    ),
    ("rebind to the selected mechanism", "bind again (mc_bind) to the selected mechanism"),
    // memory-api: a full queue.
    (
        "drain it (poll completed events) or release synchronously",
        "drain it (mc_queue_poll) or release now (mc_release)",
    ),
    // allocator-cuda: no driver, and a sticky error.
    (
        "(CPU-only machines should use allocator-cpu)",
        "(CPU-only machines register MC_CPU_* allocators with mc_register_cpu_allocator)",
    ),
    ("call invalidate_device for device:", "call mc_invalidate_device for device:"),
    (" on the registry, then recreate the context", ", then recreate the context"),
    // memory-plugin: suspect blocks, discharged by a suspect retry.
    (
        "until a suspect retry discharges it",
        "until mc_plugin_retry_suspects (or mc_mechanism_retry_suspects) discharges it",
    ),
    ("retry the suspect blocks (each goes", "retry the suspect blocks with mc_plugin_retry_suspects (each goes"),
];

/// `message` in a C caller's terms (see [`C_TERMS`]).
pub(crate) fn in_c_terms(message: &str) -> String {
    let mut text = message.to_owned();
    for (rust, c) in C_TERMS {
        if text.contains(rust) {
            text = text.replace(rust, c);
        }
    }
    text
}

#[cold]
#[inline(never)]
fn remember(function: &str, failure: &Failure) {
    let message = in_c_terms(&failure.message);
    let text = format!("{function}: {}: {message}", status_name(failure.status)).replace('\0', " ");
    let text = CString::new(text).unwrap_or_default().into_raw();
    let old = MESSAGE.try_with(|message| message.replace(text)).unwrap_or(text);
    if !old.is_null() {
        // SAFETY: `old` came from `CString::into_raw` (the cell's previous message, now
        // out of the cell, or `text` itself if the cell is unreachable): its only owner.
        drop(unsafe { CString::from_raw(old) });
    }
    let _ = FAILED.try_with(|failed| failed.set(true));
    // The message is freed when the thread exits (again if this call came after that).
    crate::exit::keep_message();
}

/// Runs one entry point: catches panics, maps the outcome to a status and leaves the
/// message for `mc_last_error_message`.
#[inline]
pub(crate) fn guard(function: &'static str, body: impl FnOnce() -> Result<(), Failure>) -> McStatus {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => {
            // Written only when it changes: most calls follow a success, and a store
            // costs more than a load (every store drains before the next locked
            // instruction, such as the allocator's own).
            let _ = FAILED.try_with(|failed| {
                if failed.get() {
                    failed.set(false);
                }
            });
            MC_OK
        }
        Ok(Err(failure)) => {
            remember(function, &failure);
            failure.status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_owned());
            let failure = Failure::new(
                MC_ERR_PANIC,
                format!("caught {what}; the registry stays consistent, but report this as a bug"),
            );
            remember(function, &failure);
            MC_ERR_PANIC
        }
    }
}

/// The message of the last failed call on this thread, or "" if the last call succeeded.
pub(crate) fn last_message() -> *const c_char {
    static EMPTY: &std::ffi::CStr = c"";
    if !FAILED.try_with(Cell::get).unwrap_or(false) {
        return EMPTY.as_ptr();
    }
    match MESSAGE.try_with(Cell::get) {
        Ok(message) if !message.is_null() => message,
        _ => EMPTY.as_ptr(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What no message reaching C may contain (as `tests/c/check.h` checks).
    fn names_a_rust_item(text: &str) -> bool {
        ["::", "Governor", "call select", "call invalidate_device", "confirm_context_terminated", "ReclaimThenFail"]
            .iter()
            .any(|item| text.contains(item))
    }

    #[test]
    fn every_piece_of_rust_advice_reaches_c_as_c_advice() {
        for (rust, c) in C_TERMS {
            assert_eq!(in_c_terms(rust), *c, "{rust:?} is not translated as the table says");
            assert!(!names_a_rust_item(c), "the C term {c:?} names a Rust item");
            assert!(c.contains("mc_") || c.contains("MC_") || !rust.contains('('), "{c:?} names no C function");
        }
        // In a sentence, with the longer phrase winning over the names inside it.
        let message = "authority a already has an account on host:0; use Governor::account to get it, or \
                       Governor::set_quota to change its quota";
        assert_eq!(
            in_c_terms(message),
            "authority a already has an account on host:0; change its quota with mc_governor_set_quota"
        );
        let advice = "raise a's quota (Governor::set_quota), release memory it holds, or ask for less; or register \
                      a reclaim holder (Governor::register_holder)";
        let c = in_c_terms(advice);
        assert!(
            !names_a_rust_item(&c) && c.contains("mc_governor_set_quota") && c.contains("mc_governor_register_holder"),
            "{c}"
        );
        assert_eq!(in_c_terms("nothing to translate"), "nothing to translate");
    }
}
