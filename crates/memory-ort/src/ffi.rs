//! The C side: the `OrtAllocator` tables ONNX Runtime calls, each laid out first in a
//! reference-counted core so the table's address is the core's.
//!
//! # One table per session
//! An adapter has a *base* core (the handle's own table, [`crate::GovernedOrtAllocator::as_ort_allocator`])
//! and one *session* core per committed session, all sharing the adapter's blocks.
//! ONNX Runtime gives nothing but the table to `Alloc`, so the table is what tells
//! which session a call is for, on whatever thread it comes (see [`crate::caller`]).
//! A session core holds a count of the base core and a [`CallerHold`] on the binding's
//! provider context, so the context is not confirmed terminated while the session or a
//! block it handed out can still call.
//!
//! # Why a core outlives every caller
//! ONNX Runtime keeps the raw `OrtAllocator*` and never says when it stops using it.
//! Every kind of holder that can still call a table holds a strong count of its core:
//! - the adapter handle ([`crate::GovernedOrtAllocator`]) and every clone of it hold
//!   the base core; every session core holds it too;
//! - every session holds its session core: the session's logger (which ONNX Runtime
//!   keeps until the session is released, so `ort` keeps it alive at least that long)
//!   captures a clone, so the core outlives the `OrtSession`, even one kept alive by
//!   `ort` values after the Rust session handle is gone;
//! - every live block holds the core of the table it came through: `Alloc`/`Reserve`
//!   take a count for the block and `Free` gives it back as its very last step, so an
//!   output tensor that outlives its session can still free into a live core.
//!
//! The environment holds a session core's pointer only inside [`crate::OrtEnvironment`]'s
//! register-create-unregister window, during which the committing call holds a count.
//!
//! # No panic crosses the boundary
//! Every entry runs its body under `catch_unwind`; a panic becomes the entry's failure
//! value (null, or an error status) and an `error` event.

use std::ffi::{CString, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex, PoisonError};

use memory_governor::{CallerHold, OwnedLease};
use ort::sys::{OrtAllocator, OrtErrorCode, OrtKeyValuePairs, OrtMemoryInfo, OrtStatus, OrtStatusPtr};

use crate::blocks::{Freed, GovernedBlocks, OrtAllocatorStats, RequestKind};
use crate::caller::Caller;
use crate::heap::own_work;

/// An `OrtMemoryInfo` this crate created and releases.
pub(crate) struct MemoryInfo(NonNull<OrtMemoryInfo>);

// SAFETY: an OrtMemoryInfo is immutable after creation; ONNX Runtime only reads it (its
// C API takes it as `const OrtMemoryInfo*` everywhere but Release), so sharing the
// pointer between threads is sound.
unsafe impl Send for MemoryInfo {}
// SAFETY: as above, every use through a shared reference is a read.
unsafe impl Sync for MemoryInfo {}

impl MemoryInfo {
    /// CPU memory, plain device allocator (no arena), default memory type.
    pub(crate) fn cpu() -> Result<MemoryInfo, String> {
        let mut out: *mut OrtMemoryInfo = ptr::null_mut();
        // SAFETY: the API table is loaded (callers hold an environment); `out` is a valid
        // out-pointer for the call's duration.
        let status = unsafe {
            (ort::api().CreateCpuMemoryInfo)(
                ort::sys::OrtAllocatorType::OrtDeviceAllocator,
                ort::sys::OrtMemType::OrtMemTypeDefault,
                &mut out,
            )
        };
        status_result(status)?;
        NonNull::new(out).map(MemoryInfo).ok_or_else(|| "CreateCpuMemoryInfo returned null".to_owned())
    }

    /// CUDA device memory of device `ordinal`, plain device allocator, default type.
    pub(crate) fn cuda(ordinal: i32) -> Result<MemoryInfo, String> {
        let mut out: *mut OrtMemoryInfo = ptr::null_mut();
        let name = c"Cuda";
        // SAFETY: the API table is loaded; `name` is a NUL-terminated string that
        // outlives the call (ONNX Runtime copies it); `out` is a valid out-pointer.
        let status = unsafe {
            (ort::api().CreateMemoryInfo)(
                name.as_ptr(),
                ort::sys::OrtAllocatorType::OrtDeviceAllocator,
                ordinal,
                ort::sys::OrtMemType::OrtMemTypeDefault,
                &mut out,
            )
        };
        status_result(status)?;
        NonNull::new(out).map(MemoryInfo).ok_or_else(|| "CreateMemoryInfo returned null".to_owned())
    }

    pub(crate) fn as_ptr(&self) -> *const OrtMemoryInfo {
        self.0.as_ptr()
    }
}

impl Drop for MemoryInfo {
    fn drop(&mut self) {
        // SAFETY: the pointer came from CreateCpuMemoryInfo/CreateMemoryInfo, is released
        // exactly once (here), and nothing uses it afterwards (the core owning it is gone).
        unsafe { (ort::api().ReleaseMemoryInfo)(self.0.as_ptr()) };
    }
}

/// Turns an ONNX Runtime status into `Ok` or its message, releasing it.
pub(crate) fn status_result(status: OrtStatusPtr) -> Result<(), String> {
    let status = status.0;
    if status.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null status returned by the API is owned by us until released;
    // GetErrorMessage returns a NUL-terminated string that lives as long as the status,
    // and we copy it before releasing the status exactly once.
    let api = ort::api();
    // SAFETY: a non-null status returned by the API is ours until released.
    let text = unsafe { (api.GetErrorMessage)(status) };
    let message = if text.is_null() {
        "unknown error".to_owned()
    } else {
        // SAFETY: GetErrorMessage returns a NUL-terminated string that lives as long as
        // the status, which is released only below, after the copy.
        unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned()
    };
    // SAFETY: released exactly once; nothing uses it afterwards.
    unsafe { (api.ReleaseStatus)(status) };
    Err(message)
}

/// A failed status carrying `message` (ONNX Runtime takes ownership).
fn error_status(message: &str) -> OrtStatusPtr {
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    // SAFETY: the API table is loaded; CreateStatus copies the NUL-terminated message.
    unsafe { (ort::api().CreateStatus)(OrtErrorCode::ORT_FAIL, text.as_ptr()) }
}

/// The object ONNX Runtime holds: the table first, so `OrtAllocator*` is `Core*`.
#[repr(C)]
pub(crate) struct Core {
    table: OrtAllocator,
    info: Arc<MemoryInfo>,
    pub(crate) blocks: Arc<GovernedBlocks>,
    /// Who calls through this table and what it is doing.
    pub(crate) caller: Caller,
    /// A session core's base core (`None` for the base core itself).
    base: Option<Arc<Core>>,
    /// A session core's hold on the provider context (see the module docs).
    _hold: Option<CallerHold>,
    /// The base core's live blocks and, while there are any, its hold on the provider
    /// context (blocks handed out through the handle's own table can call `Free` too).
    base_blocks: Mutex<(usize, Option<CallerHold>)>,
    /// A session core's booking of ONNX Runtime's own memory for the session, refunded
    /// when the core goes (ONNX Runtime released the session and every block of it).
    runtime_lease: Mutex<Option<OwnedLease>>,
}

// SAFETY: the table holds only a version number and function pointers, written once
// before the core is shared; MemoryInfo is Send + Sync (above) and GovernedBlocks is made
// of Send + Sync parts. Nothing in the core is mutated through a shared reference except
// through atomics, dashmap and a mutex.
unsafe impl Send for Core {}
// SAFETY: as above.
unsafe impl Sync for Core {}

impl Core {
    /// An adapter's base core, whose table ONNX Runtime can call, in an `Arc` (the
    /// table's address is stable for the core's life).
    pub(crate) fn new(info: MemoryInfo, blocks: GovernedBlocks) -> Arc<Core> {
        Core::with_parts(Arc::new(info), Arc::new(blocks), None, None)
    }

    /// A table of its own for one session of `base`'s adapter, holding `hold` for as
    /// long as the session or a block it handed out can call.
    pub(crate) fn for_session(base: &Arc<Core>, hold: CallerHold) -> Arc<Core> {
        Core::with_parts(Arc::clone(&base.info), Arc::clone(&base.blocks), Some(Arc::clone(base)), Some(hold))
    }

    fn with_parts(
        info: Arc<MemoryInfo>,
        blocks: Arc<GovernedBlocks>,
        base: Option<Arc<Core>>,
        hold: Option<CallerHold>,
    ) -> Arc<Core> {
        // SAFETY: `OrtAllocator::default` only fills the version and null slots; every
        // slot we need is set right after.
        let mut table = unsafe { OrtAllocator::default() };
        table.version = ort::sys::ORT_API_VERSION;
        table.Alloc = Some(alloc);
        table.Free = Some(free);
        table.Info = Some(info_of);
        table.Reserve = Some(reserve);
        table.GetStats = Some(get_stats);
        // Not stream aware: frees are ordered by the binding's release path (a CUDA release
        // queue on the compute stream), so ONNX Runtime may use plain Alloc. A null
        // optional slot means unsupported.
        table.AllocOnStream = None;
        table.Shrink = Some(shrink);
        let base_blocks = Mutex::new((0, None));
        Arc::new(Core {
            table,
            info,
            blocks,
            caller: if base.is_some() { Caller::of_session() } else { Caller::default() },
            base,
            _hold: hold,
            base_blocks,
            runtime_lease: Mutex::new(None),
        })
    }

    /// Keeps the booking of ONNX Runtime's own memory for this session until the core
    /// goes.
    pub(crate) fn keep_runtime_lease(&self, lease: OwnedLease) {
        let previous = self.runtime_lease.lock().unwrap_or_else(PoisonError::into_inner).replace(lease);
        if let Some(previous) = previous {
            self.blocks.runtime_released(previous.bytes());
        }
    }

    /// Gives the booking back (the core is going).
    pub(crate) fn release_runtime_lease(&self) {
        let lease = self.runtime_lease.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(lease) = lease {
            self.blocks.runtime_released(lease.bytes());
            tracing::debug!(bytes = lease.bytes(), "onnx runtime's own memory for the session refunded");
        }
    }

    /// A block left through the base table: the first one takes a hold.
    fn base_block_taken(&self) {
        let mut held = self.base_blocks.lock().unwrap_or_else(PoisonError::into_inner);
        held.0 += 1;
        if held.1.is_none() {
            held.1 = Some(self.blocks.binding().hold_callers("blocks of the ort allocator's own table"));
        }
    }

    /// A block of the base table came back: the last one drops the hold.
    fn base_block_given_back(&self) {
        let released = {
            let mut held = self.base_blocks.lock().unwrap_or_else(PoisonError::into_inner);
            held.0 = held.0.saturating_sub(1);
            if held.0 == 0 { held.1.take() } else { None }
        };
        drop(released);
    }

    /// Whether this is a session's table (not the adapter's base table).
    pub(crate) fn is_session(&self) -> bool {
        self.base.is_some()
    }

    /// The pointer ONNX Runtime gets. Valid while a strong count of `core` is held.
    pub(crate) fn as_ort(core: &Arc<Core>) -> *mut OrtAllocator {
        Arc::as_ptr(core).cast::<OrtAllocator>().cast_mut()
    }

    pub(crate) fn info(&self) -> *const OrtMemoryInfo {
        self.info.as_ptr()
    }

    /// The base table reports the adapter's figures; a session's table its own.
    pub(crate) fn stats(&self) -> OrtAllocatorStats {
        if self.is_session() { self.caller.counters.stats(self.blocks.limit()) } else { self.blocks.stats() }
    }
}

/// # Safety
/// `this` must be a table made by [`Core::new`] whose core is alive (a strong count is
/// held by whoever lets ONNX Runtime call; see the module docs).
unsafe fn core<'a>(this: *const OrtAllocator) -> &'a Core {
    // SAFETY: per the contract, `this` is the address of a live `Core` (repr(C), table
    // first) inside an Arc allocation; only shared references are made.
    unsafe { &*this.cast::<Core>() }
}

/// The core at `address`.
///
/// # Safety
/// `address` must be a core's address (a table's) whose strong count the caller knows
/// to be held for as long as the reference is used.
unsafe fn core_at<'a>(address: usize) -> &'a Core {
    // SAFETY: per the contract, a live `Core`; only shared references are made.
    unsafe { &*std::ptr::with_exposed_provenance::<Core>(address) }
}

/// Runs an allocation entry: on success the block takes a strong count of the core.
///
/// # Safety
/// As [`core`].
unsafe fn allocate_entry(this: *const OrtAllocator, size: usize, kind: RequestKind) -> *mut c_void {
    if this.is_null() {
        return ptr::null_mut();
    }
    // SAFETY: forwarded contract.
    let core = unsafe { core(this) };
    let origin = this.addr();
    let allocated =
        catch_unwind(AssertUnwindSafe(|| own_work(|| core.blocks.allocate(&core.caller, origin, size, kind))));
    match allocated {
        Ok(Some(address)) => {
            // SAFETY: `this` is a live Arc<Core>'s pointer (contract); the count taken here
            // is given back by `free` of this block, through whichever table it comes.
            unsafe { Arc::increment_strong_count(this.cast::<Core>()) };
            if !core.is_session() {
                core.base_block_taken();
            }
            ptr::with_exposed_provenance_mut(address)
        }
        Ok(None) => ptr::null_mut(),
        Err(_) => {
            tracing::error!(?kind, size, "panic inside the ort allocator; answered null");
            ptr::null_mut()
        }
    }
}

unsafe extern "system" fn alloc(this: *mut OrtAllocator, size: usize) -> *mut c_void {
    // SAFETY: ONNX Runtime calls with the table it was given, whose core is alive.
    unsafe { allocate_entry(this, size, RequestKind::Alloc) }
}

unsafe extern "system" fn reserve(this: *const OrtAllocator, size: usize) -> *mut c_void {
    // SAFETY: as `alloc`.
    unsafe { allocate_entry(this, size, RequestKind::Reserve) }
}

unsafe extern "system" fn free(this: *mut OrtAllocator, p: *mut c_void) {
    if this.is_null() || p.is_null() {
        return;
    }
    // SAFETY: ONNX Runtime calls through a table whose session (or handle) is alive.
    let core = unsafe { core(this) };
    let address = p.expose_provenance();
    let freed = catch_unwind(AssertUnwindSafe(|| {
        own_work(|| {
            core.blocks.free(&core.caller, address, |origin| {
                // SAFETY: `origin` is the address of the core whose table handed the block
                // out; the block holds a strong count of it until the decrement below.
                unsafe { &core_at(origin).caller }
            })
        })
    }));
    match freed {
        Ok((Freed::Unknown, _)) => {}
        Ok((Freed::Released | Freed::AfterLoss | Freed::Refused, origin)) => {
            if origin != this.addr() {
                tracing::warn!(address, "onnx runtime freed a block through another table than the one that made it");
            }
            // The last count drops the core, its binding and whatever they release: a
            // panic there must not unwind into ONNX Runtime.
            let dropped = catch_unwind(AssertUnwindSafe(|| {
                // SAFETY: the block held one strong count of its origin core.
                let origin_core = unsafe { core_at(origin) };
                if !origin_core.is_session() {
                    origin_core.base_block_given_back();
                }
                // SAFETY: this block held one strong count of its origin core, taken in
                // `allocate_entry`; it is given back exactly once (the block left the live
                // table above), and neither core reference is used after this line (it may
                // be the last count).
                unsafe { Arc::decrement_strong_count(std::ptr::with_exposed_provenance::<Core>(origin)) };
            }));
            if dropped.is_err() {
                tracing::error!("panic while dropping the ort allocator's core after its last block");
            }
        }
        Err(_) => {
            // Whether the block left the table is unknown; keep its count (the core then
            // outlives its owners, never the reverse).
            tracing::error!(address = p.expose_provenance(), "panic inside the ort allocator's free");
        }
    }
}

unsafe extern "system" fn info_of(this: *const OrtAllocator) -> *const OrtMemoryInfo {
    if this.is_null() {
        return ptr::null();
    }
    // SAFETY: as `alloc`.
    let core = unsafe { core(this) };
    core.info()
}

unsafe extern "system" fn get_stats(this: *const OrtAllocator, out: *mut *mut OrtKeyValuePairs) -> OrtStatusPtr {
    if this.is_null() || out.is_null() {
        return error_status("GetStats needs an allocator and an output pointer");
    }
    // SAFETY: as `alloc`.
    let core = unsafe { core(this) };
    let written = catch_unwind(AssertUnwindSafe(|| {
        let stats = core.stats();
        // SAFETY: `out` is non-null and points to writable storage (ONNX Runtime's
        // contract); the pairs are created by the API and handed to the caller, who
        // releases them.
        unsafe { write_stats(&stats, out) };
    }));
    match written {
        Ok(()) => OrtStatusPtr(ptr::null_mut::<OrtStatus>()),
        Err(_) => error_status("panic while reading the governed allocator's stats"),
    }
}

/// # Safety
/// `out` must be valid for a write of one pointer; the API table must be loaded.
pub(crate) unsafe fn write_stats(stats: &OrtAllocatorStats, out: *mut *mut OrtKeyValuePairs) {
    let api = ort::api();
    let mut pairs: *mut OrtKeyValuePairs = ptr::null_mut();
    // SAFETY: `pairs` is a valid out-pointer.
    unsafe { (api.CreateKeyValuePairs)(&mut pairs) };
    if !pairs.is_null() {
        for (key, value) in stats.key_values() {
            let key = CString::new(key).unwrap_or_default();
            let value = CString::new(value.to_string()).unwrap_or_default();
            // SAFETY: `pairs` was just created; both strings are NUL-terminated and
            // copied by the call.
            unsafe { (api.AddKeyValuePair)(pairs, key.as_ptr(), value.as_ptr()) };
        }
    }
    // SAFETY: the caller guarantees `out` is writable.
    unsafe { out.write(pairs) };
}

unsafe extern "system" fn shrink(this: *mut OrtAllocator) -> OrtStatusPtr {
    if this.is_null() {
        return error_status("Shrink needs an allocator");
    }
    // SAFETY: as `alloc`.
    let core = unsafe { core(this) };
    match catch_unwind(AssertUnwindSafe(|| core.blocks.trim_and_return_heap_pages(&core.caller.counters))) {
        Ok(bytes) => {
            tracing::debug!(bytes, "ort allocator shrunk: cached memory returned");
            OrtStatusPtr(ptr::null_mut::<OrtStatus>())
        }
        Err(_) => error_status("panic while shrinking the governed allocator"),
    }
}

/// Host memory for a refused run-time block (see `RefusalAnswer`), from the global
/// allocator, outside the books.
pub(crate) fn overdraft_allocate(size: usize, align: usize) -> Option<usize> {
    let layout = std::alloc::Layout::from_size_align(size, align).ok()?;
    // SAFETY: `size` is non-zero (zero-byte requests never get here) and the layout is
    // valid; the block is freed by `overdraft_free` with the same layout.
    let block = unsafe { std::alloc::alloc(layout) };
    (!block.is_null()).then(|| block.expose_provenance())
}

/// Frees a block from [`overdraft_allocate`].
pub(crate) fn overdraft_free(address: usize, size: usize, align: usize) {
    let Ok(layout) = std::alloc::Layout::from_size_align(size, align) else { return };
    // SAFETY: `address` came from `overdraft_allocate(size, align)` (the live table
    // recorded it as an overdraft block of `size` and removed it exactly once before
    // this call), so the pointer and layout match that allocation.
    unsafe { std::alloc::dealloc(std::ptr::with_exposed_provenance_mut(address), layout) };
}

/// Registers `core`'s table with the environment `env`.
///
/// # Safety
/// `env` must be a live `OrtEnv`, and the table must be unregistered (with
/// [`unregister`]) before the caller's count of `core` is dropped, or kept alive.
pub(crate) unsafe fn register(env: *mut ort::sys::OrtEnv, core: &Arc<Core>) -> Result<(), String> {
    // SAFETY: per the contract `env` is live; the table is alive while `core` is.
    status_result(unsafe { (ort::api().RegisterAllocator)(env, Core::as_ort(core)) })
}

/// Unregisters the allocator of `core`'s memory info from `env`.
///
/// # Safety
/// `env` must be a live `OrtEnv`.
pub(crate) unsafe fn unregister(env: *mut ort::sys::OrtEnv, core: &Arc<Core>) -> Result<(), String> {
    // SAFETY: `env` is live; the memory info is the core's, alive while `core` is.
    status_result(unsafe { (ort::api().UnregisterAllocator)(env, core.info()) })
}
