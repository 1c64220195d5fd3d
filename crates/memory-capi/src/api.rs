//! The exported functions. Each runs inside [`guard`] (no panic crosses the
//! boundary), checks every pointer it was given before it mutates anything, and
//! validates every handle through its table (see [`crate::handles`]).

use std::collections::VecDeque;
use std::ffi::{CStr, c_char, c_void};
use std::sync::Arc;

use allocator_cpu::{PooledAllocator, SystemAllocator};
#[cfg(unix)]
use allocator_cpu::{SharedHostAllocator, VirtualHostAllocator};
use allocator_cuda::{CudaAllocator, CudaDevice, CudaPoolAllocator, CudaStream, CudaVmmAllocator};
use memory_governor::{
    AccountConfig, AllocationRequest, AuthorityIdentity, BindingRegistry, BoundAllocation, DeferredReleaseQueue,
    DeviceAllocator, DeviceKey, Governor, HandleError, MechanismIdentity, MemoryBinding, MemoryRole, PreparedRelease,
    ProviderContextIdentity, QueueRefusal, QueueRefusalReason, RegistryError, ReleaseSummary, Resource,
};
use memory_plugin::{InstanceOptions, PluginAllocator, PluginLibrary, PluginReleaseQueue, abi_device};
use memory_plugin_abi::{MP_CAP_ALL, MP_TIER_DEVICE, MP_TIER_DISK, MP_TIER_HOST, MpAllocator, MpDevice};

use crate::handles::{FreeList, Scheme, Slots, Store, number, pointer};
use crate::status::{
    Failure, MC_ERR_BACKEND, MC_ERR_BUFFER_TOO_SMALL, MC_ERR_INVALID_ARGUMENT, MC_ERR_UNLOAD_REFUSED,
    MC_ERR_UNSUPPORTED, McStatus, guard,
};
use crate::sync::{Mutex, lock};
use crate::types::*;

/// The C API's version: major changes break callers, minor ones only add.
pub const MC_API_MAJOR: u32 = 1;
/// The C API's minor version.
pub const MC_API_MINOR: u32 = 0;

pub(crate) const KIND_REGISTRY: u8 = 0xa1;
pub(crate) const KIND_GOVERNOR: u8 = 0xa2;
pub(crate) const KIND_CONTEXT: u8 = 0xa3;
pub(crate) const KIND_AUTHORITY: u8 = 0xa4;
pub(crate) const KIND_MECHANISM: u8 = 0xa5;
pub(crate) const KIND_BINDING: u8 = 0xa6;
pub(crate) const KIND_ALLOCATION: u8 = 0xa7;
pub(crate) const KIND_LIBRARY: u8 = 0xa8;
pub(crate) const KIND_QUEUE: u8 = 0xa9;

struct ContextEntry {
    identity: ProviderContextIdentity,
    device: DeviceKey,
}

struct AuthorityEntry {
    identity: AuthorityIdentity,
    device: DeviceKey,
}

struct MechanismEntry {
    identity: MechanismIdentity,
    plugin: Option<PluginAllocator>,
}

enum QueueEntry {
    Host(HostQueue),
    Plugin(PluginReleaseQueue),
}

impl QueueEntry {
    fn queue(&self) -> &dyn DeferredReleaseQueue {
        match self {
            QueueEntry::Host(queue) => queue,
            QueueEntry::Plugin(queue) => queue,
        }
    }
}

crate::sync::thread_local! {
    static FREE_REGISTRIES: FreeList = const { FreeList::new() };
    static FREE_GOVERNORS: FreeList = const { FreeList::new() };
    static FREE_CONTEXTS: FreeList = const { FreeList::new() };
    static FREE_AUTHORITIES: FreeList = const { FreeList::new() };
    static FREE_MECHANISMS: FreeList = const { FreeList::new() };
    static FREE_BINDINGS: FreeList = const { FreeList::new() };
    static FREE_ALLOCATIONS: FreeList = const { FreeList::new() };
    static FREE_LIBRARIES: FreeList = const { FreeList::new() };
    static FREE_QUEUES: FreeList = const { FreeList::new() };
}

/// Declares the handle tables: each a constant front (`Slots`) over its cells (`Store`,
/// named after `in`); under loom (whose primitives have no const constructors) both are
/// built once per model execution.
macro_rules! tables {
    ($($name:ident in $cells:ident: $value:ty = ($kind:expr, $scheme:expr, $what:literal, $free:ident);)*) => {
        $(
            #[cfg(not(memory_loom))]
            static $name: Slots<$value> = Slots::new($kind, $scheme, $what, &$free, &$cells);
            #[cfg(not(memory_loom))]
            static $cells: Store<$value> = Store::new();
        )*
        #[cfg(memory_loom)]
        loom::lazy_static! {
            $(
                static ref $name: Slots<$value> =
                    Slots::new($kind, $scheme, $what, &$free, Box::leak(Box::new(Store::new())));
            )*
        }
    };
}

// Handles borrowed by many calls and consumed by one (destroy, remove) announce their
// borrows in hazard slots; allocations, consumed by every release, are counted (see
// `crate::handles`).
tables! {
    REGISTRIES in REGISTRY_CELLS: BindingRegistry = (KIND_REGISTRY, Scheme::Hazard, "registry", FREE_REGISTRIES);
    GOVERNORS in GOVERNOR_CELLS: Governor = (KIND_GOVERNOR, Scheme::Hazard, "governor", FREE_GOVERNORS);
    CONTEXTS in CONTEXT_CELLS: ContextEntry = (KIND_CONTEXT, Scheme::Hazard, "context", FREE_CONTEXTS);
    AUTHORITIES in AUTHORITY_CELLS: AuthorityEntry = (KIND_AUTHORITY, Scheme::Hazard, "authority", FREE_AUTHORITIES);
    MECHANISMS in MECHANISM_CELLS: MechanismEntry = (KIND_MECHANISM, Scheme::Hazard, "mechanism", FREE_MECHANISMS);
    BINDINGS in BINDING_CELLS: MemoryBinding = (KIND_BINDING, Scheme::Hazard, "binding", FREE_BINDINGS);
    // `None` only while a call makes or releases the allocation in its cell.
    ALLOCATIONS in ALLOCATION_CELLS: Option<BoundAllocation> =
        (KIND_ALLOCATION, Scheme::Counted, "allocation", FREE_ALLOCATIONS);
    LIBRARIES in LIBRARY_CELLS: PluginLibrary = (KIND_LIBRARY, Scheme::Hazard, "plugin library", FREE_LIBRARIES);
    QUEUES in QUEUE_CELLS: QueueEntry = (KIND_QUEUE, Scheme::Hazard, "queue", FREE_QUEUES);
}

// ---------------------------------------------------------------------------------
// Helpers

#[inline(always)]
fn borrow<T: Send + Sync + 'static, P>(
    slots: &'static Slots<T>,
    handle: *const P,
) -> Result<crate::handles::Borrow<T>, Failure> {
    let number = number(handle);
    match slots.borrow(number) {
        Ok(borrowed) => Ok(borrowed),
        Err(fault) => Err(Failure::handle(slots.name(), number, fault)),
    }
}

fn insert<T: Send + Sync + 'static, P>(slots: &'static Slots<T>, value: T) -> Result<*mut P, Failure> {
    match slots.insert(value) {
        Ok(handle) => Ok(pointer(handle)),
        Err((value, fault)) => {
            drop(value);
            Err(Failure::handle(slots.name(), 0, fault))
        }
    }
}

fn remove<T: Send + Sync + 'static, P>(slots: &'static Slots<T>, handle: *const P) -> Result<(), Failure> {
    let number = number(handle);
    slots.remove(number).map_err(|fault| Failure::handle(slots.name(), number, fault))
}

/// Checks an out-pointer before anything is mutated.
fn check_out<T>(out: *mut T, what: &str) -> Result<(), Failure> {
    if out.is_null() {
        return Err(Failure::null(what));
    }
    if !out.is_aligned() {
        return Err(Failure::new(MC_ERR_INVALID_ARGUMENT, format!("{what} {out:p} is misaligned for its type")));
    }
    Ok(())
}

/// Writes through an out-pointer that [`check_out`] accepted.
///
/// # Safety
/// `out` was accepted by [`check_out`] and points to writable memory for a `T`.
unsafe fn write<T>(out: *mut T, value: T) {
    // SAFETY: non-null and aligned (checked), writable (the caller's contract).
    unsafe { out.write(value) };
}

/// Reads a NUL-terminated UTF-8 string argument.
///
/// # Safety
/// `text` is null or NUL-terminated and readable.
unsafe fn text<'a>(text: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if text.is_null() {
        return Err(Failure::null(what));
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract).
    unsafe { CStr::from_ptr(text) }.to_str().map_err(|error| {
        Failure::new(MC_ERR_INVALID_ARGUMENT, format!("{what} is not UTF-8 ({error}); pass UTF-8 text"))
    })
}

fn device_key(device: MpDevice) -> Result<DeviceKey, Failure> {
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

fn role(code: u32) -> Result<MemoryRole, Failure> {
    MemoryRole::ALL.get(code as usize).copied().ok_or_else(|| {
        Failure::new(MC_ERR_INVALID_ARGUMENT, format!("role {code} is unknown; use MP_ROLE_WEIGHTS .. MP_ROLE_OTHER"))
    })
}

/// A user pointer with its destructor, pinned by the registry as a resource.
struct UserResource {
    user: *mut c_void,
    destroy: McDestroyFn,
}

// SAFETY: the C caller hands the pointer over to the registry, which may drop it on
// any thread; `mc_context_register` and `mc_authority_register` document that the
// destructor must be callable from any thread.
unsafe impl Send for UserResource {}
// SAFETY: the pointer is never dereferenced on the Rust side; only the destructor uses it.
unsafe impl Sync for UserResource {}

impl Drop for UserResource {
    fn drop(&mut self) {
        if let Some(destroy) = self.destroy {
            // SAFETY: the caller registered this destructor for this pointer; it runs
            // exactly once (the resource's last `Arc` is gone) and with no lock held
            // (the registry drops resources outside its locks).
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
        MC_ERR_PANIC
    )
}

// ---------------------------------------------------------------------------------
// Registry and governor

/// Creates a registry.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_registry_create(out: *mut *mut McRegistry) -> McStatus {
    guard("mc_registry_create", || {
        check_out(out, "out")?;
        let registry = BindingRegistry::new();
        let handle = insert(&REGISTRIES, registry)?;
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Destroys a registry handle. Mechanisms, bindings and allocations made under it keep
/// what they pin; user destructors run when the last of them is gone.
#[unsafe(no_mangle)]
pub extern "C" fn mc_registry_destroy(registry: *mut McRegistry) -> McStatus {
    guard("mc_registry_destroy", || remove(&REGISTRIES, registry))
}

/// Creates a governor (no limits until set).
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_governor_create(out: *mut *mut McGovernor) -> McStatus {
    guard("mc_governor_create", || {
        check_out(out, "out")?;
        let handle = insert(&GOVERNORS, Governor::new())?;
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Destroys a governor handle (governed mechanisms keep the books they use).
#[unsafe(no_mangle)]
pub extern "C" fn mc_governor_destroy(governor: *mut McGovernor) -> McStatus {
    guard("mc_governor_destroy", || remove(&GOVERNORS, governor))
}

/// Sets the byte limit of `device` (`UINT64_MAX`: unlimited).
#[unsafe(no_mangle)]
pub extern "C" fn mc_governor_set_device_limit(governor: *mut McGovernor, device: MpDevice, bytes: u64) -> McStatus {
    guard("mc_governor_set_device_limit", || {
        let governor = borrow(&GOVERNORS, governor)?;
        governor.set_device_limit(device_key(device)?, bytes)?;
        Ok(())
    })
}

/// Opens the account of `authority` with a quota (`UINT64_MAX`: unlimited) and a label
/// (may be null). Needed before a governed mechanism is registered for the authority.
///
/// # Safety
/// `label` is null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_governor_open_account(
    governor: *mut McGovernor,
    authority: *mut McAuthority,
    quota: u64,
    label: *const c_char,
) -> McStatus {
    guard("mc_governor_open_account", || {
        let governor = borrow(&GOVERNORS, governor)?;
        let authority = borrow(&AUTHORITIES, authority)?;
        let mut config = AccountConfig::new(authority.device, authority.identity).with_quota(quota);
        if !label.is_null() {
            // SAFETY: non-null and NUL-terminated (the caller's contract).
            config = config.with_label(unsafe { text(label, "label") }?);
        }
        governor.open_account(config).map_err(|error| Failure::new(MC_ERR_INVALID_ARGUMENT, error.to_string()))?;
        Ok(())
    })
}

/// Sets the quota of `authority`'s account (`UINT64_MAX`: unlimited).
#[unsafe(no_mangle)]
pub extern "C" fn mc_governor_set_quota(
    governor: *mut McGovernor,
    authority: *mut McAuthority,
    bytes: u64,
) -> McStatus {
    guard("mc_governor_set_quota", || {
        let governor = borrow(&GOVERNORS, governor)?;
        let authority = borrow(&AUTHORITIES, authority)?;
        governor.set_quota(authority.identity, bytes)?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------
// Contexts and authorities

fn resource(user: *mut c_void, destroy: McDestroyFn) -> Resource {
    Arc::new(UserResource { user, destroy })
}

/// Registers a provider context for `device`. `user` (may be null) is pinned as its
/// resource; `destroy` (may be null) is called once with it, from any thread and with
/// no lock held, when nothing needs it any more.
///
/// # Safety
/// `out` is null or writable; `destroy`, if not null, may be called with `user` from
/// any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_context_register(
    registry: *mut McRegistry,
    device: MpDevice,
    user: *mut c_void,
    destroy: McDestroyFn,
    out: *mut *mut McContext,
) -> McStatus {
    guard("mc_context_register", || {
        check_out(out, "out")?;
        let registry = borrow(&REGISTRIES, registry)?;
        let device = device_key(device)?;
        let identity = registry.register_provider_context(device, resource(user, destroy))?;
        let handle = insert(&CONTEXTS, ContextEntry { identity, device })?;
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Removes a context that no registered mechanism references, and frees its handle.
#[unsafe(no_mangle)]
pub extern "C" fn mc_context_remove(registry: *mut McRegistry, context: *mut McContext) -> McStatus {
    guard("mc_context_remove", || {
        {
            let registry = borrow(&REGISTRIES, registry)?;
            let entry = borrow(&CONTEXTS, context)?;
            registry.remove_provider_context(&entry.identity)?;
        }
        remove(&CONTEXTS, context)
    })
}

/// Registers an authority (a tenant, a quota owner) for `device`; `user` and `destroy`
/// as for `mc_context_register`.
///
/// # Safety
/// As for `mc_context_register`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_authority_register(
    registry: *mut McRegistry,
    device: MpDevice,
    user: *mut c_void,
    destroy: McDestroyFn,
    out: *mut *mut McAuthority,
) -> McStatus {
    guard("mc_authority_register", || {
        check_out(out, "out")?;
        let registry = borrow(&REGISTRIES, registry)?;
        let device = device_key(device)?;
        let identity = registry.register_authority(device, resource(user, destroy))?;
        let handle = insert(&AUTHORITIES, AuthorityEntry { identity, device })?;
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Removes an authority that no registered mechanism references, and frees its handle.
#[unsafe(no_mangle)]
pub extern "C" fn mc_authority_remove(registry: *mut McRegistry, authority: *mut McAuthority) -> McStatus {
    guard("mc_authority_remove", || {
        {
            let registry = borrow(&REGISTRIES, registry)?;
            let entry = borrow(&AUTHORITIES, authority)?;
            registry.remove_authority(&entry.identity)?;
        }
        remove(&AUTHORITIES, authority)
    })
}

// ---------------------------------------------------------------------------------
// Mechanisms

/// Registers `allocator` (governed by `governor` when it is not null) and returns the
/// mechanism handle.
fn register(
    registry: *mut McRegistry,
    governor: *mut McGovernor,
    context: *mut McContext,
    authority: *mut McAuthority,
    allocator: Arc<dyn DeviceAllocator>,
    plugin: Option<PluginAllocator>,
) -> Result<*mut McMechanism, Failure> {
    let registry = borrow(&REGISTRIES, registry)?;
    let context = borrow(&CONTEXTS, context)?;
    let authority = borrow(&AUTHORITIES, authority)?;
    let allocator: Arc<dyn DeviceAllocator> = if governor.is_null() {
        allocator
    } else {
        let governor = borrow(&GOVERNORS, governor)?;
        let governed = governor.govern(allocator, authority.identity).map_err(|error| {
            Failure::new(
                MC_ERR_INVALID_ARGUMENT,
                format!("{error}; call mc_governor_open_account for the authority first"),
            )
        })?;
        Arc::new(governed)
    };
    let identity = registry.register_allocator(&context.identity, &authority.identity, allocator)?;
    insert(&MECHANISMS, MechanismEntry { identity, plugin })
}

/// The device a context handle was registered for.
fn context_device(context: *mut McContext) -> Result<DeviceKey, Failure> {
    Ok(borrow(&CONTEXTS, context)?.device)
}

/// Registers a built-in host allocator (`MC_CPU_*`) on the context's device. With a
/// non-null `governor` every allocation is charged to the authority's account.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_register_cpu_allocator(
    registry: *mut McRegistry,
    governor: *mut McGovernor,
    context: *mut McContext,
    authority: *mut McAuthority,
    kind: McCpuAllocator,
    out: *mut *mut McMechanism,
) -> McStatus {
    guard("mc_register_cpu_allocator", || {
        check_out(out, "out")?;
        let device = context_device(context)?;
        let allocator: Arc<dyn DeviceAllocator> = match kind {
            MC_CPU_SYSTEM => Arc::new(SystemAllocator::for_device(device)),
            MC_CPU_POOLED => Arc::new(PooledAllocator::new(SystemAllocator::for_device(device))),
            #[cfg(unix)]
            MC_CPU_VIRTUAL => Arc::new(VirtualHostAllocator::for_device(device)),
            #[cfg(unix)]
            MC_CPU_SHARED => Arc::new(SharedHostAllocator::for_device(device)),
            // Address-space reservation and shared mappings need mmap (Linux, macOS).
            #[cfg(not(unix))]
            MC_CPU_VIRTUAL | MC_CPU_SHARED => {
                return Err(Failure::new(
                    MC_ERR_UNSUPPORTED,
                    format!(
                        "cpu allocator kind {kind} needs mmap, which this platform lacks; use MC_CPU_SYSTEM or MC_CPU_POOLED"
                    ),
                ));
            }
            other => {
                return Err(Failure::new(
                    MC_ERR_INVALID_ARGUMENT,
                    format!("cpu allocator kind {other} is unknown; use MC_CPU_SYSTEM .. MC_CPU_SHARED"),
                ));
            }
        };
        let handle = register(registry, governor, context, authority, allocator, None)?;
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Registers a built-in CUDA allocator (`MC_CUDA_*`) on the context's device (a
/// `MP_TIER_DEVICE` device whose index is the CUDA ordinal). Without a driver or device
/// this is `MC_ERR_BACKEND` with the reason.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_register_cuda_allocator(
    registry: *mut McRegistry,
    governor: *mut McGovernor,
    context: *mut McContext,
    authority: *mut McAuthority,
    kind: McCudaAllocator,
    out: *mut *mut McMechanism,
) -> McStatus {
    guard("mc_register_cuda_allocator", || {
        check_out(out, "out")?;
        let device = context_device(context)?;
        if device.tier() != memory_governor::Tier::Device {
            return Err(Failure::new(
                MC_ERR_INVALID_ARGUMENT,
                format!("the context is on {device}; CUDA allocators need a MP_TIER_DEVICE context"),
            ));
        }
        let cuda = |error: allocator_cuda::CudaError| Failure::new(MC_ERR_BACKEND, format!("{error}"));
        let gpu = CudaDevice::open(device.index()).map_err(cuda)?;
        let allocator: Arc<dyn DeviceAllocator> = match kind {
            MC_CUDA_EAGER => Arc::new(CudaAllocator::new(&gpu)),
            MC_CUDA_POOL => {
                let stream = CudaStream::new(&gpu).map_err(cuda)?;
                Arc::new(CudaPoolAllocator::new(&stream, allocator_cuda::PoolConfig::default()).map_err(cuda)?)
            }
            MC_CUDA_VMM => Arc::new(CudaVmmAllocator::new(&gpu).map_err(cuda)?),
            other => {
                return Err(Failure::new(
                    MC_ERR_INVALID_ARGUMENT,
                    format!("cuda allocator kind {other} is unknown; use MC_CUDA_EAGER .. MC_CUDA_VMM"),
                ));
            }
        };
        let handle = register(registry, governor, context, authority, allocator, None)?;
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Registers a new instance of a loaded plugin, created with `config` (may be null).
///
/// # Safety
/// `config` is null or NUL-terminated; `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_register_plugin(
    registry: *mut McRegistry,
    governor: *mut McGovernor,
    context: *mut McContext,
    authority: *mut McAuthority,
    library: *mut McPluginLibrary,
    config: *const c_char,
    out: *mut *mut McMechanism,
) -> McStatus {
    guard("mc_register_plugin", || {
        check_out(out, "out")?;
        let config = if config.is_null() {
            ""
        } else {
            // SAFETY: non-null and NUL-terminated (the caller's contract).
            unsafe { text(config, "config") }?
        };
        let plugin = borrow(&LIBRARIES, library)?.instantiate(&InstanceOptions::new().config(config))?;
        let handle = register(registry, governor, context, authority, Arc::new(plugin.clone()), Some(plugin))?;
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Registers an allocator the caller implements as an `MpAllocator` vtable (the plugin
/// ABI, without a library). The table is negotiated like a plugin's (every capability
/// is offered) and copied. On success the library owns `instance` and calls `destroy`
/// once, after the mechanism is removed and its last block released; on any error
/// nothing of the table was called and `instance` is still the caller's.
///
/// # Safety
/// `table` is null or points to a readable `MpAllocator` of at least its `struct_size`
/// bytes whose slots follow `docs/C-ABI.md` and stay callable until `destroy` returned;
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_register_vtable(
    registry: *mut McRegistry,
    governor: *mut McGovernor,
    context: *mut McContext,
    authority: *mut McAuthority,
    table: *const MpAllocator,
    out: *mut *mut McMechanism,
) -> McStatus {
    guard("mc_register_vtable", || {
        check_out(out, "out")?;
        if table.is_null() {
            return Err(Failure::null("table"));
        }
        // SAFETY: forwarded from the caller's contract.
        let plugin = unsafe { PluginAllocator::from_table(table, MP_CAP_ALL) }?;
        match register(registry, governor, context, authority, Arc::new(plugin.clone()), Some(plugin.clone())) {
            Ok(handle) => {
                // SAFETY: checked above.
                unsafe { write(out, handle) };
                Ok(())
            }
            Err(failure) => {
                // Refused: the instance goes back to the caller without `destroy`
                // (the clones given to the registry died with the refusal).
                if let Err(still_held) = plugin.relinquish() {
                    tracing::error!("a refused vtable's instance is still referenced; it is destroyed when that ends");
                    drop(still_held);
                }
                Err(failure)
            }
        }
    })
}

fn with_mechanism<R>(
    registry: *mut McRegistry,
    mechanism: *mut McMechanism,
    call: impl FnOnce(&BindingRegistry, &MechanismIdentity) -> Result<R, RegistryError>,
) -> Result<R, Failure> {
    let registry = borrow(&REGISTRIES, registry)?;
    let entry = borrow(&MECHANISMS, mechanism)?;
    Ok(call(&registry, &entry.identity)?)
}

/// Makes `mechanism` the one future `mc_bind` calls on its device use.
#[unsafe(no_mangle)]
pub extern "C" fn mc_mechanism_select(registry: *mut McRegistry, mechanism: *mut McMechanism) -> McStatus {
    guard("mc_mechanism_select", || with_mechanism(registry, mechanism, |r, m| r.select(m).map(drop)))
}

/// Retires `mechanism`: no new binds or allocations; existing ones still release.
#[unsafe(no_mangle)]
pub extern "C" fn mc_mechanism_retire(registry: *mut McRegistry, mechanism: *mut McMechanism) -> McStatus {
    guard("mc_mechanism_retire", || with_mechanism(registry, mechanism, |r, m| r.retire(m)))
}

/// Removes a retired or terminated mechanism with nothing live, and frees its handle.
#[unsafe(no_mangle)]
pub extern "C" fn mc_mechanism_remove(registry: *mut McRegistry, mechanism: *mut McMechanism) -> McStatus {
    guard("mc_mechanism_remove", || {
        with_mechanism(registry, mechanism, |r, m| r.remove(m))?;
        remove(&MECHANISMS, mechanism)
    })
}

/// Retries the quarantined releases of `mechanism`; writes how many were released and
/// how many are still quarantined (either pointer may be null).
///
/// # Safety
/// `released` and `still_quarantined` are null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_mechanism_retry_quarantined(
    registry: *mut McRegistry,
    mechanism: *mut McMechanism,
    released: *mut u64,
    still_quarantined: *mut u64,
) -> McStatus {
    guard("mc_mechanism_retry_quarantined", || {
        for (out, what) in [(released, "released"), (still_quarantined, "still_quarantined")] {
            if !out.is_null() {
                check_out(out, what)?;
            }
        }
        let report = with_mechanism(registry, mechanism, |r, m| r.retry_quarantined(m))?;
        if !released.is_null() {
            // SAFETY: checked above.
            unsafe { write(released, report.released as u64) };
        }
        if !still_quarantined.is_null() {
            // SAFETY: checked above.
            unsafe { write(still_quarantined, report.still_quarantined as u64) };
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------
// Bindings and allocations

/// Binds the mechanism selected for `device`.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_bind(registry: *mut McRegistry, device: MpDevice, out: *mut *mut McBinding) -> McStatus {
    guard("mc_bind", || {
        check_out(out, "out")?;
        let binding = borrow(&REGISTRIES, registry)?.bind(device_key(device)?)?;
        let handle = insert(&BINDINGS, binding)?;
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Binds a specific mechanism, selected or not.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_bind_mechanism(
    registry: *mut McRegistry,
    mechanism: *mut McMechanism,
    out: *mut *mut McBinding,
) -> McStatus {
    guard("mc_bind_mechanism", || {
        check_out(out, "out")?;
        let registry = borrow(&REGISTRIES, registry)?;
        let entry = borrow(&MECHANISMS, mechanism)?;
        let binding = registry.bind_registered(&entry.identity)?;
        let handle = insert(&BINDINGS, binding)?;
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Destroys a binding handle (its allocations stay valid and pinned).
#[unsafe(no_mangle)]
pub extern "C" fn mc_binding_destroy(binding: *mut McBinding) -> McStatus {
    guard("mc_binding_destroy", || remove(&BINDINGS, binding))
}

/// Allocates `bytes` bytes aligned to `align` (a power of two) for `role` (`MP_ROLE_*`).
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_allocate(
    binding: *mut McBinding,
    bytes: u64,
    align: u64,
    role_code: u32,
    out: *mut *mut McAllocation,
) -> McStatus {
    guard("mc_allocate", || {
        check_out(out, "out")?;
        let binding = borrow(&BINDINGS, binding)?;
        let too_large = |_| {
            Failure::new(MC_ERR_INVALID_ARGUMENT, format!("{bytes} bytes aligned to {align} does not fit this host"))
        };
        let request = AllocationRequest::new(
            usize::try_from(bytes).map_err(too_large)?,
            usize::try_from(align).map_err(too_large)?,
        )
        .map_err(|error| Failure::new(MC_ERR_INVALID_ARGUMENT, error.to_string()))?
        .with_role(role(role_code)?);
        let vacancy = ALLOCATIONS.vacancy().map_err(|fault| Failure::handle("allocation", 0, fault))?;
        // Made in its cell: the 64-byte handle is written once, where it lives.
        let handle = vacancy.fill_in_place(None, |place| binding.allocate_into(request, place).map(drop))?;
        // SAFETY: checked above.
        unsafe { write(out, pointer::<McAllocation>(handle)) };
        Ok(())
    })
}

/// Writes where `allocation` is.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_allocation_info(allocation: *mut McAllocation, out: *mut McAllocationInfo) -> McStatus {
    guard("mc_allocation_info", || {
        check_out(out, "out")?;
        let allocation = borrow(&ALLOCATIONS, allocation)?;
        let allocation = live_allocation(&allocation)?;
        let info = McAllocationInfo {
            address: allocation.address().get(),
            bytes: allocation.bytes() as u64,
            align: allocation.align() as u64,
            device: allocation.device().map(abi_device).unwrap_or_default(),
        };
        // SAFETY: checked above.
        unsafe { write(out, info) };
        Ok(())
    })
}

/// Releases `allocation` through `binding` (the binding it was allocated through). On
/// success the handle is stale; on any error it stays valid and yours. `report` may be
/// null.
///
/// # Safety
/// `report` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_release(
    binding: *mut McBinding,
    allocation: *mut McAllocation,
    report: *mut McReleaseReport,
) -> McStatus {
    guard("mc_release", || {
        if !report.is_null() {
            check_out(report, "report")?;
        }
        let binding = borrow(&BINDINGS, binding)?;
        let number = number(allocation);
        let mut taken = ALLOCATIONS.take(number).map_err(|fault| Failure::handle("allocation", number, fault))?;
        // Released where it lies in its cell (not moved out and back on a refusal).
        match binding.release_from(taken.value_mut()) {
            Ok(done) => {
                taken.free();
                let written = match done {
                    ReleaseSummary::Complete { unmapped_bytes } => McReleaseReport {
                        kind: MC_RELEASE_COMPLETE,
                        reserved: 0,
                        unmapped_bytes: unmapped_bytes as u64,
                        residual_bytes: 0,
                    },
                    ReleaseSummary::Quarantined { unmapped_bytes, residual_bytes } => McReleaseReport {
                        kind: MC_RELEASE_QUARANTINED,
                        reserved: 0,
                        unmapped_bytes: unmapped_bytes as u64,
                        residual_bytes: residual_bytes as u64,
                    },
                    _ => McReleaseReport::default(),
                };
                if !report.is_null() {
                    // SAFETY: checked above.
                    unsafe { write(report, written) };
                }
                Ok(())
            }
            Err(reason) => {
                let failure = Failure::from(&reason);
                taken.restore();
                Err(failure)
            }
        }
    })
}

/// Hands the release of `allocation` to `queue`; the handle is stale on success.
#[unsafe(no_mangle)]
pub extern "C" fn mc_release_deferred(
    binding: *mut McBinding,
    allocation: *mut McAllocation,
    queue: *mut McQueue,
) -> McStatus {
    guard("mc_release_deferred", || {
        let binding = borrow(&BINDINGS, binding)?;
        let queue = borrow(&QUEUES, queue)?;
        let number = number(allocation);
        let taken = ALLOCATIONS.take(number).map_err(|fault| Failure::handle("allocation", number, fault))?;
        let (value, reservation) = taken.into_parts();
        let Some(value) = value else {
            reservation.restore(None);
            return Err(stale_allocation());
        };
        match binding.release_deferred(value, queue.queue()) {
            Ok(()) => {
                reservation.free();
                Ok(())
            }
            Err(rejected) => {
                let failure = Failure::from(&rejected.reason);
                reservation.restore(Some(rejected.handle));
                Err(failure)
            }
        }
    })
}

/// The allocation a live handle's cell holds (always one: a cell is emptied only by a
/// release that frees it).
fn live_allocation(cell: &Option<BoundAllocation>) -> Result<&BoundAllocation, Failure> {
    cell.as_ref().ok_or_else(stale_allocation)
}

#[cold]
fn stale_allocation() -> Failure {
    Failure::from(&HandleError::StaleAllocation)
}

/// Gives up an allocation handle without an explicit release: a live allocation follows
/// its mechanism's drop policy (host memory is released, device memory quarantined); one
/// whose device was lost or whose context terminated is only forgotten.
#[unsafe(no_mangle)]
pub extern "C" fn mc_allocation_drop(allocation: *mut McAllocation) -> McStatus {
    guard("mc_allocation_drop", || remove(&ALLOCATIONS, allocation))
}

// ---------------------------------------------------------------------------------
// Deferred-release queues

/// A queue whose releases run when the caller polls it (for example after it has
/// synchronised the work that used the memory).
struct HostQueue {
    device: DeviceKey,
    capacity: usize,
    pending: Mutex<VecDeque<PreparedRelease>>,
}

impl DeferredReleaseQueue for HostQueue {
    fn device(&self) -> DeviceKey {
        self.device
    }

    fn enqueue(&self, release: PreparedRelease) -> Result<(), QueueRefusal> {
        if release.device() != self.device {
            let reason = QueueRefusalReason::WrongDevice { queue: self.device, release: release.device() };
            return Err(QueueRefusal { release, reason });
        }
        let mut pending = lock(&self.pending);
        if pending.len() >= self.capacity {
            drop(pending);
            return Err(QueueRefusal { release, reason: QueueRefusalReason::Full { capacity: self.capacity } });
        }
        pending.push_back(release);
        Ok(())
    }
}

impl HostQueue {
    fn poll(&self) -> usize {
        let ready: Vec<PreparedRelease> = lock(&self.pending).drain(..).collect();
        let ran = ready.len();
        for release in ready {
            let _summary = release.execute();
        }
        ran
    }
}

/// Creates a queue for `device` holding at most `capacity` releases, which run when
/// `mc_queue_poll` is called.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_queue_create(device: MpDevice, capacity: usize, out: *mut *mut McQueue) -> McStatus {
    guard("mc_queue_create", || {
        check_out(out, "out")?;
        let queue = HostQueue { device: device_key(device)?, capacity, pending: Mutex::new(VecDeque::new()) };
        let handle = insert(&QUEUES, QueueEntry::Host(queue))?;
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Creates the deferred-release queue of a plugin mechanism (`MP_CAP_DEFERRED_RELEASE`):
/// its releases run once the plugin reports them ready, when `mc_queue_poll` is called.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_plugin_queue_create(
    mechanism: *mut McMechanism,
    capacity: usize,
    out: *mut *mut McQueue,
) -> McStatus {
    guard("mc_plugin_queue_create", || {
        check_out(out, "out")?;
        let entry = borrow(&MECHANISMS, mechanism)?;
        let Some(plugin) = entry.plugin.as_ref() else {
            return Err(Failure::new(
                MC_ERR_UNSUPPORTED,
                "the mechanism is not a plugin or vtable mechanism; use mc_queue_create for a host-run queue",
            ));
        };
        let queue = plugin.release_queue(capacity)?;
        let handle = insert(&QUEUES, QueueEntry::Plugin(queue))?;
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Runs every release of `queue` that is ready; writes how many ran (`ran` may be null).
///
/// # Safety
/// `ran` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_queue_poll(queue: *mut McQueue, ran: *mut usize) -> McStatus {
    guard("mc_queue_poll", || {
        if !ran.is_null() {
            check_out(ran, "ran")?;
        }
        let queue = borrow(&QUEUES, queue)?;
        let count = match &*queue {
            QueueEntry::Host(queue) => queue.poll(),
            QueueEntry::Plugin(queue) => queue.poll(),
        };
        if !ran.is_null() {
            // SAFETY: checked above.
            unsafe { write(ran, count) };
        }
        Ok(())
    })
}

/// Destroys a queue; releases still waiting stay quarantined (poll first).
#[unsafe(no_mangle)]
pub extern "C" fn mc_queue_destroy(queue: *mut McQueue) -> McStatus {
    guard("mc_queue_destroy", || remove(&QUEUES, queue))
}

// ---------------------------------------------------------------------------------
// Plugins

/// Loads a plugin library.
///
/// # Safety
/// `path` is null or NUL-terminated; `out` is null or writable. Loading runs the
/// library's code in this process: load only plugins you trust (docs/C-ABI.md).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_plugin_load(path: *const c_char, out: *mut *mut McPluginLibrary) -> McStatus {
    guard("mc_plugin_load", || {
        check_out(out, "out")?;
        // SAFETY: null or NUL-terminated (the caller's contract).
        let path = unsafe { text(path, "path") }?;
        // SAFETY: the caller trusts the library (documented above).
        let library = unsafe { PluginLibrary::load(path) }?;
        let handle = insert(&LIBRARIES, library)?;
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Writes both sides' tallies of a plugin library.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_plugin_tally(library: *mut McPluginLibrary, out: *mut McPluginTallies) -> McStatus {
    guard("mc_plugin_tally", || {
        check_out(out, "out")?;
        let library = borrow(&LIBRARIES, library)?;
        let tallies = tallies(&library.host_tally(), library.plugin_tally());
        // SAFETY: checked above.
        unsafe { write(out, tallies) };
        Ok(())
    })
}

fn tallies(host: &memory_plugin::HostTally, plugin: Option<memory_plugin::PluginTally>) -> McPluginTallies {
    let plugin_abi = plugin.map(|t| memory_plugin_abi::MpTally {
        instances: t.instances,
        allocations: t.allocations,
        bytes: t.bytes,
        backings: t.backings,
        deferred: t.deferred,
    });
    McPluginTallies {
        host_instances: host.instances as u64,
        host_allocations: host.allocations as u64,
        host_bytes: host.bytes as u64,
        host_backings: host.backings as u64,
        host_queued_releases: host.queued_releases as u64,
        host_suspect_blocks: host.suspect_blocks as u64,
        host_other_pins: host.other_pins as u64,
        plugin_reported: u32::from(plugin_abi.is_some()),
        reserved: 0,
        plugin: plugin_abi.unwrap_or_default(),
    }
}

/// Unloads a plugin library if nothing made through it lives on either side, and frees
/// the handle. Otherwise `MC_ERR_UNLOAD_REFUSED` with both tallies in the message; the
/// handle stays valid.
#[unsafe(no_mangle)]
pub extern "C" fn mc_plugin_unload(library: *mut McPluginLibrary) -> McStatus {
    guard("mc_plugin_unload", || {
        let number = number(library);
        let (value, reservation) =
            LIBRARIES.take(number).map_err(|fault| Failure::handle("plugin library", number, fault))?.into_parts();
        match value.unload() {
            Ok(()) => {
                reservation.free();
                Ok(())
            }
            Err(refused) => {
                let message = refused.to_string();
                reservation.restore(refused.library);
                Err(Failure::new(MC_ERR_UNLOAD_REFUSED, message))
            }
        }
    })
}

// ---------------------------------------------------------------------------------
// Device loss and termination

/// Marks `device` lost (`reason` may be null): its mechanisms stop at once; no
/// allocator callback runs and nothing is freed. `out` may be null.
///
/// # Safety
/// `reason` is null or NUL-terminated; `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_invalidate_device(
    registry: *mut McRegistry,
    device: MpDevice,
    reason: *const c_char,
    out: *mut McInvalidation,
) -> McStatus {
    guard("mc_invalidate_device", || {
        if !out.is_null() {
            check_out(out, "out")?;
        }
        let reason = if reason.is_null() {
            "invalidated through the C API"
        } else {
            // SAFETY: non-null and NUL-terminated (the caller's contract).
            unsafe { text(reason, "reason") }?
        };
        let registry = borrow(&REGISTRIES, registry)?;
        let report = registry.invalidate_device(device_key(device)?, reason);
        if !out.is_null() {
            let written = McInvalidation {
                mechanisms: report.mechanisms as u64,
                contexts: report.contexts as u64,
                selection_dropped: u32::from(report.selection_dropped),
                reserved: 0,
            };
            // SAFETY: checked above.
            unsafe { write(out, written) };
        }
        Ok(())
    })
}

/// Confirms that a lost context is gone and its callbacks drained: retires its
/// allocations (governed ones are refunded). `MC_ERR_NOT_QUIESCENT` while callbacks are
/// in flight (poll again). `out` may be null.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_confirm_terminated(
    registry: *mut McRegistry,
    context: *mut McContext,
    out: *mut McTermination,
) -> McStatus {
    guard("mc_confirm_terminated", || {
        if !out.is_null() {
            check_out(out, "out")?;
        }
        let registry = borrow(&REGISTRIES, registry)?;
        let entry = borrow(&CONTEXTS, context)?;
        let report = registry.confirm_context_terminated(&entry.identity)?;
        if !out.is_null() {
            let written = McTermination {
                already_terminated: u32::from(report.already_terminated),
                reserved: 0,
                mechanisms: report.mechanisms as u64,
                lost_allocations: report.lost_allocations as u64,
                lost_bytes: report.lost_bytes as u64,
                discharged_quarantine: report.discharged_quarantine as u64,
            };
            // SAFETY: checked above.
            unsafe { write(out, written) };
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------
// Snapshots

fn registry_json(registry: &BindingRegistry) -> serde_json::Value {
    use serde_json::json;
    let snapshot = registry.snapshots();
    json!({
        "registry": snapshot.registry.to_string(),
        "contexts": snapshot.contexts.iter().map(|c| json!({
            "identity": c.identity.to_string(),
            "device": c.device.to_string(),
            "state": c.state.to_string(),
        })).collect::<Vec<_>>(),
        "authorities": snapshot.authorities.iter().map(|a| json!({
            "identity": a.identity.to_string(),
            "device": a.device.to_string(),
        })).collect::<Vec<_>>(),
        "mechanisms": snapshot.mechanisms.iter().map(|m| json!({
            "identity": m.identity.to_string(),
            "device": m.device.to_string(),
            "context": m.context.to_string(),
            "authority": m.authority.to_string(),
            "state": m.state.to_string(),
            "allocator": m.allocator,
            "selected": m.selected,
            "live_allocations": m.live_allocations,
            "live_bytes": m.live_bytes,
            "in_flight": m.in_flight,
            "quarantined_bytes": m.quarantined_bytes(),
            "quarantined": m.quarantined.iter().map(|q| json!({
                "generation": q.generation.to_string(),
                "binding": q.binding.to_string(),
                "bytes": q.bytes,
                "unmapped_bytes": q.unmapped_bytes,
                "residual_bytes": q.residual_bytes,
                "reason": q.reason,
            })).collect::<Vec<_>>(),
            "lost_reason": m.lost_reason,
        })).collect::<Vec<_>>(),
    })
}

/// Writes a JSON snapshot of the registry (and of the governor's books when `governor`
/// is not null) to `buffer`, NUL-terminated, and its length without the NUL to `length`.
/// With a null or too small buffer: `MC_ERR_BUFFER_TOO_SMALL` and the length needed.
///
/// # Safety
/// `buffer` is null or writable for `capacity` bytes; `length` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_snapshot_json(
    registry: *mut McRegistry,
    governor: *mut McGovernor,
    buffer: *mut c_char,
    capacity: usize,
    length: *mut usize,
) -> McStatus {
    guard("mc_snapshot_json", || {
        check_out(length, "length")?;
        let registry = borrow(&REGISTRIES, registry)?;
        let governor_json = if governor.is_null() {
            serde_json::Value::Null
        } else {
            let snapshot = borrow(&GOVERNORS, governor)?.snapshot();
            serde_json::to_value(&snapshot)
                .map_err(|error| Failure::new(MC_ERR_BACKEND, format!("serialising the governor snapshot: {error}")))?
        };
        let text = serde_json::json!({ "registry": registry_json(&registry), "governor": governor_json }).to_string();
        // SAFETY: checked above.
        unsafe { write(length, text.len()) };
        if buffer.is_null() || capacity <= text.len() {
            return Err(Failure::new(
                MC_ERR_BUFFER_TOO_SMALL,
                format!(
                    "the snapshot is {} bytes (plus a NUL) and the buffer holds {capacity}; pass a buffer of at least {} bytes",
                    text.len(),
                    text.len() + 1
                ),
            ));
        }
        // SAFETY: `buffer` is writable for `capacity` bytes (the caller's contract) and
        // `text.len() + 1 <= capacity` (checked); the source is our own string.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), buffer.cast::<u8>(), text.len()) };
        // SAFETY: `text.len() < capacity`, so this byte is inside the buffer.
        unsafe { buffer.wrapping_add(text.len()).write(0) };
        Ok(())
    })
}
