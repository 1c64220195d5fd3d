//! Mechanisms: built-in CPU and CUDA allocators, plugin instances and C vtables
//! registered with a registry (governed or not); select, retire, remove, retry
//! (quarantined releases; a plugin's or vtable's suspect blocks).
//!
//! Every registration borrows and checks all it names (registry, governor, context,
//! authority, kind, out-pointer, a free handle) before any allocator is made: no driver
//! is opened, no plugin instantiated and no vtable negotiated for a call that is refused.
//! A governor handle made by `mc_recorder_trace_governor` makes a governed registration
//! a recorded one: the governed allocator is wrapped by the recording (memory-trace's
//! `TracedAllocator`) before the registry gets it.

use std::ffi::c_char;
use std::sync::Arc;

use allocator_cpu::{PooledAllocator, SystemAllocator};
#[cfg(unix)]
use allocator_cpu::{SharedHostAllocator, VirtualHostAllocator};
use allocator_cuda::{CudaAllocator, CudaDevice, CudaPoolAllocator, CudaStream, CudaVmmAllocator};
use memory_governor::{BindingRegistry, DeviceAllocator, MechanismIdentity, MechanismState, RegistryError};
use memory_plugin::{InstanceOptions, PluginAllocator};
use memory_plugin_abi::{MP_CAP_ALL, MpAllocator};

use super::governor::{GOVERNORS, GovernorEntry};
use super::plugins::LIBRARIES;
use super::registry::{
    AUTHORITIES, AuthorityEntry, Booked, CONTEXTS, ContextEntry, REGISTRIES, RegistryEntry, Ticket, check_issued,
};
use super::{borrow, borrow_optional, check_optional_out, check_out, fill, text_or, vacancy, write, write_optional};
use crate::handles::{Borrow, Scheme, Vacancy};
use crate::status::{
    Failure, MC_ERR_BACKEND, MC_ERR_DEVICE_LOST, MC_ERR_INVALID_ARGUMENT, MC_ERR_UNSUPPORTED, McStatus, guard,
};
use crate::types::*;

pub(crate) const KIND_MECHANISM: u8 = 0xa5;

pub(crate) struct MechanismEntry {
    pub(crate) identity: MechanismIdentity,
    pub(crate) plugin: Option<PluginAllocator>,
    pub(crate) ticket: Ticket,
}

tables! {
    MECHANISMS in MECHANISM_CELLS: MechanismEntry = (KIND_MECHANISM, Scheme::Hazard, "mechanism", FREE_MECHANISMS);
}

/// What a registration names, borrowed and checked, and the handle it will fill.
struct Parties {
    registry: Borrow<RegistryEntry>,
    governor: Option<Borrow<GovernorEntry>>,
    context: Borrow<ContextEntry>,
    authority: Borrow<AuthorityEntry>,
    cell: Vacancy<MechanismEntry>,
    ticket: Ticket,
}

/// Checks every argument a registration shares, before anything has an effect.
fn parties(
    registry: *mut McRegistry,
    governor: *mut McGovernor,
    context: *mut McContext,
    authority: *mut McAuthority,
    out: *mut *mut McMechanism,
) -> Result<Parties, Failure> {
    check_out(out, "out")?;
    let registry_entry = borrow(&REGISTRIES, registry)?;
    let governor_entry = borrow_optional(&GOVERNORS, governor)?;
    let context_entry = borrow(&CONTEXTS, context)?;
    let authority_entry = borrow(&AUTHORITIES, authority)?;
    check_issued(&registry_entry, &context_entry.ticket, "context", context.cast())?;
    check_issued(&registry_entry, &authority_entry.ticket, "authority", authority.cast())?;
    if context_entry.device != authority_entry.device {
        return Err(Failure::new(
            MC_ERR_INVALID_ARGUMENT,
            format!(
                "the context is on {} and the authority on {}; register both for the device of the mechanism",
                context_entry.device, authority_entry.device
            ),
        ));
    }
    if let Some(governor) = &governor_entry
        && let Err(error) = governor.account(authority_entry.identity)
    {
        return Err(Failure::new(
            MC_ERR_INVALID_ARGUMENT,
            format!("{error}, or pass a null governor to register the mechanism ungoverned"),
        ));
    }
    if let Some(recording) = governor_entry.as_ref().and_then(|entry| entry.recording.as_ref()) {
        recording.check_open(governor.cast())?;
    }
    let cell = vacancy(&MECHANISMS)?;
    let ticket = registry_entry.books.open(Booked::Mechanism, registry)?;
    Ok(Parties {
        registry: registry_entry,
        governor: governor_entry,
        context: context_entry,
        authority: authority_entry,
        cell,
        ticket,
    })
}

impl Parties {
    /// Registers `allocator` (governed when a governor was given, and recorded when that
    /// governor handle names a recording) and fills the handle.
    fn register(
        self,
        allocator: Arc<dyn DeviceAllocator>,
        plugin: Option<PluginAllocator>,
    ) -> Result<*mut McMechanism, Failure> {
        let allocator: Arc<dyn DeviceAllocator> = match &self.governor {
            None => allocator,
            Some(governor) => {
                let governed = governor.govern(allocator, self.authority.identity).map_err(|error| {
                    Failure::new(
                        MC_ERR_INVALID_ARGUMENT,
                        format!("{error}; call mc_governor_open_account for the authority first"),
                    )
                })?;
                match &governor.recording {
                    None => Arc::new(governed),
                    Some(recording) => Arc::new(recording.trace(&governor.governor, governed)),
                }
            }
        };
        let identity = self.registry.register_allocator(&self.context.identity, &self.authority.identity, allocator)?;
        Ok(fill(self.cell, MechanismEntry { identity, plugin, ticket: self.ticket }))
    }
}

/// Registers a built-in host allocator (`MC_CPU_*`) on the context's device. With a
/// non-null `governor` every allocation is charged to the authority's account (and
/// recorded, when the handle was made by `mc_recorder_trace_governor`). What an
/// allocation of each kind is (usable at once, or reserved until committed or mapped):
/// docs/C-ABI.md §6.
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
        if !matches!(kind, MC_CPU_SYSTEM | MC_CPU_POOLED | MC_CPU_VIRTUAL | MC_CPU_SHARED) {
            return Err(Failure::new(
                MC_ERR_INVALID_ARGUMENT,
                format!("cpu allocator kind {kind} is unknown; use MC_CPU_SYSTEM .. MC_CPU_SHARED"),
            ));
        }
        // Address-space reservation and shared mappings need mmap (Linux, macOS).
        if cfg!(not(unix)) && matches!(kind, MC_CPU_VIRTUAL | MC_CPU_SHARED) {
            return Err(Failure::new(
                MC_ERR_UNSUPPORTED,
                format!(
                    "cpu allocator kind {kind} needs mmap, which this platform lacks; use MC_CPU_SYSTEM or MC_CPU_POOLED"
                ),
            ));
        }
        let parties = parties(registry, governor, context, authority, out)?;
        let device = parties.context.device;
        let allocator: Arc<dyn DeviceAllocator> = match kind {
            MC_CPU_POOLED => Arc::new(PooledAllocator::new(SystemAllocator::for_caches(device))),
            #[cfg(unix)]
            MC_CPU_VIRTUAL => Arc::new(VirtualHostAllocator::for_device(device)),
            #[cfg(unix)]
            MC_CPU_SHARED => Arc::new(SharedHostAllocator::for_device(device)),
            _ => Arc::new(SystemAllocator::for_device(device)),
        };
        let handle = parties.register(allocator, None)?;
        // SAFETY: checked by `parties`.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Registers a built-in CUDA allocator (`MC_CUDA_*`) on the context's device (a
/// `MP_TIER_DEVICE` device whose index is the CUDA ordinal). Every argument is checked
/// before the driver is loaded; without a driver or device this is `MC_ERR_BACKEND`
/// with the reason.
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
        if !matches!(kind, MC_CUDA_EAGER | MC_CUDA_POOL | MC_CUDA_VMM) {
            return Err(Failure::new(
                MC_ERR_INVALID_ARGUMENT,
                format!("cuda allocator kind {kind} is unknown; use MC_CUDA_EAGER .. MC_CUDA_VMM"),
            ));
        }
        let parties = parties(registry, governor, context, authority, out)?;
        let device = parties.context.device;
        if device.tier() != memory_governor::Tier::Device {
            return Err(Failure::new(
                MC_ERR_INVALID_ARGUMENT,
                format!("the context is on {device}; CUDA allocators need a MP_TIER_DEVICE context"),
            ));
        }
        let cuda = |error: allocator_cuda::CudaError| Failure::new(MC_ERR_BACKEND, format!("{error}"));
        let gpu = CudaDevice::open(device.index()).map_err(cuda)?;
        let allocator: Arc<dyn DeviceAllocator> = match kind {
            MC_CUDA_POOL => {
                let stream = CudaStream::new(&gpu).map_err(cuda)?;
                Arc::new(CudaPoolAllocator::new(&stream, allocator_cuda::PoolConfig::default()).map_err(cuda)?)
            }
            MC_CUDA_VMM => Arc::new(CudaVmmAllocator::new(&gpu).map_err(cuda)?),
            _ => Arc::new(CudaAllocator::new(&gpu)),
        };
        let handle = parties.register(allocator, None)?;
        // SAFETY: checked by `parties`.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Registers a new instance of a loaded plugin, created with `config` (may be null).
/// Every argument is checked before the plugin is asked for an instance.
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
        // SAFETY: null or NUL-terminated (the caller's contract).
        let config = unsafe { text_or(config, "config", "") }?;
        let library = borrow(&LIBRARIES, library)?;
        let parties = parties(registry, governor, context, authority, out)?;
        let plugin = library.instantiate(&InstanceOptions::new().config(config))?;
        let handle = parties.register(Arc::new(plugin.clone()), Some(plugin))?;
        // SAFETY: checked by `parties`.
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
        if table.is_null() {
            return Err(Failure::null("table"));
        }
        let parties = parties(registry, governor, context, authority, out)?;
        // SAFETY: forwarded from the caller's contract.
        let plugin = unsafe { PluginAllocator::from_table(table, MP_CAP_ALL) }?;
        match parties.register(Arc::new(plugin.clone()), Some(plugin.clone())) {
            Ok(handle) => {
                // SAFETY: checked by `parties`.
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
    let registry_entry = borrow(&REGISTRIES, registry)?;
    let entry = borrow(&MECHANISMS, mechanism)?;
    check_issued(&registry_entry, &entry.ticket, "mechanism", mechanism.cast())?;
    Ok(call(&registry_entry, &entry.identity)?)
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
        super::remove(&MECHANISMS, mechanism)
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
        check_optional_out(released, "released")?;
        check_optional_out(still_quarantined, "still_quarantined")?;
        let report = with_mechanism(registry, mechanism, |r, m| r.retry_quarantined(m))?;
        // SAFETY: checked above.
        unsafe { write_optional(released, report.released as u64) };
        // SAFETY: as above.
        unsafe { write_optional(still_quarantined, report.still_quarantined as u64) };
        Ok(())
    })
}

/// Hands the blocks the host keeps as suspect through `mechanism`'s plugin instance (a
/// `mc_register_plugin` or `mc_register_vtable` mechanism, while it is registered) back
/// to the plugin's `release`, as `mc_plugin_retry_suspects` does for a whole library,
/// and writes how many were discharged and how many are still kept. A built-in
/// mechanism keeps no suspect blocks: `MC_ERR_UNSUPPORTED`. While its device is lost
/// (before `mc_confirm_terminated`) nothing is handed back: `MC_ERR_DEVICE_LOST`.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_mechanism_retry_suspects(
    registry: *mut McRegistry,
    mechanism: *mut McMechanism,
    out: *mut McSuspectRetry,
) -> McStatus {
    guard("mc_mechanism_retry_suspects", || {
        check_out(out, "out")?;
        let registry_entry = borrow(&REGISTRIES, registry)?;
        let entry = borrow(&MECHANISMS, mechanism)?;
        check_issued(&registry_entry, &entry.ticket, "mechanism", mechanism.cast())?;
        let Some(plugin) = &entry.plugin else {
            return Err(Failure::new(
                MC_ERR_UNSUPPORTED,
                format!(
                    "mechanism {:#x} is a built-in allocator (mc_register_cpu_allocator or \
                     mc_register_cuda_allocator), which keeps no suspect blocks; only mc_register_plugin and \
                     mc_register_vtable mechanisms do",
                    crate::handles::number(mechanism)
                ),
            ));
        };
        let state = registry_entry.snapshot(&entry.identity)?.state;
        if state == MechanismState::DeviceLost {
            return Err(Failure::new(
                MC_ERR_DEVICE_LOST,
                format!(
                    "mechanism {:#x} is device-lost: no block is handed back to a lost device; confirm its context \
                     terminated (mc_confirm_terminated), then retry",
                    crate::handles::number(mechanism)
                ),
            ));
        }
        let retry = McSuspectRetry::from(plugin.retry_suspects());
        // SAFETY: checked above.
        unsafe { write(out, retry) };
        Ok(())
    })
}
