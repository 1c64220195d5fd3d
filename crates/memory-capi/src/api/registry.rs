//! The registry, its provider contexts and authorities, device loss and termination.
//!
//! A registry handle keeps books of the context, authority and mechanism handles made
//! under it: `mc_registry_destroy` refuses (`MC_ERR_STATE`, with the counts) while any
//! of them lives, so that every one of them can still be removed through it.

use std::ffi::{c_char, c_void};
use std::ops::Deref;
use std::sync::Arc;

use memory_governor::{AuthorityIdentity, BindingRegistry, DeviceKey, ProviderContextIdentity, Resource};
use memory_plugin_abi::MpDevice;

use super::{
    UserPointer, borrow, check_optional_out, check_out, device_key, fill, handle_failure, text_or, vacancy, write,
    write_optional,
};
use crate::handles::{Scheme, number};
use crate::status::{Failure, MC_ERR_FOREIGN, MC_ERR_STATE, McStatus, guard};
use crate::sync::{Mutex, lock};
use crate::types::*;

pub(crate) const KIND_REGISTRY: u8 = 0xa1;
pub(crate) const KIND_CONTEXT: u8 = 0xa3;
pub(crate) const KIND_AUTHORITY: u8 = 0xa4;

/// A registry and the books of the handles made under it.
pub(crate) struct RegistryEntry {
    registry: BindingRegistry,
    pub(crate) books: Arc<HandleBooks>,
}

impl Deref for RegistryEntry {
    type Target = BindingRegistry;

    fn deref(&self) -> &BindingRegistry {
        &self.registry
    }
}

/// The kinds of handle a registry keeps books of.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Booked {
    Context,
    Authority,
    Mechanism,
}

#[derive(Default)]
struct Counts {
    contexts: u64,
    authorities: u64,
    mechanisms: u64,
    /// Set by a destroy that found nothing live: no handle is opened after it.
    closed: bool,
}

impl Counts {
    fn of(&mut self, kind: Booked) -> &mut u64 {
        match kind {
            Booked::Context => &mut self.contexts,
            Booked::Authority => &mut self.authorities,
            Booked::Mechanism => &mut self.mechanisms,
        }
    }
}

/// How many context, authority and mechanism handles of one registry live.
pub(crate) struct HandleBooks {
    counts: Mutex<Counts>,
}

impl HandleBooks {
    /// Books one more handle of `kind` before the call that makes it has any effect;
    /// the ticket gives it back when dropped (a failed call, or the handle's value
    /// dropped after its removal).
    pub(crate) fn open(self: &Arc<HandleBooks>, kind: Booked, registry: *const McRegistry) -> Result<Ticket, Failure> {
        let mut counts = lock(&self.counts);
        if counts.closed {
            return Err(handle_failure("registry", number(registry), crate::handles::Fault::Stale));
        }
        *counts.of(kind) += 1;
        Ok(Ticket { books: Arc::clone(self), kind })
    }

    /// Whether `ticket` was booked here (a handle of this registry).
    pub(crate) fn issued(self: &Arc<HandleBooks>, ticket: &Ticket) -> bool {
        Arc::ptr_eq(self, &ticket.books)
    }
}

/// One booked handle (see [`HandleBooks::open`]).
pub(crate) struct Ticket {
    books: Arc<HandleBooks>,
    kind: Booked,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut counts = lock(&self.books.counts);
        let count = counts.of(self.kind);
        *count = count.saturating_sub(1);
    }
}

/// Refuses a handle of another registry before the registry is asked (which would say
/// the same, less plainly).
pub(crate) fn check_issued(
    registry: &RegistryEntry,
    ticket: &Ticket,
    what: &str,
    handle: *const c_void,
) -> Result<(), Failure> {
    if registry.books.issued(ticket) {
        return Ok(());
    }
    Err(Failure::new(
        MC_ERR_FOREIGN,
        format!(
            "{what} {:#x} was registered with another registry; pass it with the registry that made it",
            number(handle)
        ),
    ))
}

pub(crate) struct ContextEntry {
    pub(crate) identity: ProviderContextIdentity,
    pub(crate) device: DeviceKey,
    pub(crate) ticket: Ticket,
}

pub(crate) struct AuthorityEntry {
    pub(crate) identity: AuthorityIdentity,
    pub(crate) device: DeviceKey,
    pub(crate) ticket: Ticket,
}

// Handles borrowed by many calls and consumed by one (destroy, remove) announce their
// borrows in hazard slots (see `crate::handles`).
tables! {
    REGISTRIES in REGISTRY_CELLS: RegistryEntry = (KIND_REGISTRY, Scheme::Hazard, "registry", FREE_REGISTRIES);
    CONTEXTS in CONTEXT_CELLS: ContextEntry = (KIND_CONTEXT, Scheme::Hazard, "context", FREE_CONTEXTS);
    AUTHORITIES in AUTHORITY_CELLS: AuthorityEntry = (KIND_AUTHORITY, Scheme::Hazard, "authority", FREE_AUTHORITIES);
}

/// Creates a registry.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_registry_create(out: *mut *mut McRegistry) -> McStatus {
    guard("mc_registry_create", || {
        check_out(out, "out")?;
        let cell = vacancy(&REGISTRIES)?;
        let books = Arc::new(HandleBooks { counts: Mutex::new(Counts::default()) });
        let handle = fill(cell, RegistryEntry { registry: BindingRegistry::new(), books });
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Destroys a registry handle once no context, authority or mechanism handle made under
/// it lives; otherwise `MC_ERR_STATE`, naming how many of each are left, and the handle
/// stays valid (remove them first: retire and remove the mechanisms, then the contexts
/// and authorities). Bindings and allocations may outlive the handle: they keep what
/// they pin, and user destructors run when the last of them is gone.
#[unsafe(no_mangle)]
pub extern "C" fn mc_registry_destroy(registry: *mut McRegistry) -> McStatus {
    guard("mc_registry_destroy", || {
        {
            let entry = borrow(&REGISTRIES, registry)?;
            let mut counts = lock(&entry.books.counts);
            if counts.closed {
                return Err(handle_failure("registry", number(registry), crate::handles::Fault::Stale));
            }
            if counts.contexts + counts.authorities + counts.mechanisms != 0 {
                return Err(Failure::new(
                    MC_ERR_STATE,
                    format!(
                        "registry {:#x} still has {} mechanism, {} context and {} authority handles; remove them \
                         first (mc_mechanism_retire and mc_mechanism_remove, then mc_context_remove and \
                         mc_authority_remove), then destroy the registry",
                        number(registry),
                        counts.mechanisms,
                        counts.contexts,
                        counts.authorities
                    ),
                ));
            }
            counts.closed = true;
        }
        super::remove(&REGISTRIES, registry)
    })
}

fn resource(user: &Arc<UserPointer>) -> Resource {
    Arc::clone(user) as Resource
}

/// Registers a provider context for `device`. `user` (may be null) is pinned as its
/// resource; `destroy` (may be null) is called once with it, from any thread and with
/// no lock held, when nothing needs it any more. On any error `destroy` is not called
/// and `user` is still the caller's.
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
    // Made outside the guard, so that a failure of any kind (a panic included) disarms it.
    let pointer = Arc::new(UserPointer::new(user, destroy));
    let status = guard("mc_context_register", || {
        check_out(out, "out")?;
        let entry = borrow(&REGISTRIES, registry)?;
        let device = device_key(device)?;
        let cell = vacancy(&CONTEXTS)?;
        let ticket = entry.books.open(Booked::Context, registry)?;
        let identity = entry.register_provider_context(device, resource(&pointer))?;
        let handle = fill(cell, ContextEntry { identity, device, ticket });
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    });
    if status != crate::status::MC_OK {
        pointer.disarm();
    }
    status
}

/// Removes a context that no registered mechanism references, and frees its handle.
#[unsafe(no_mangle)]
pub extern "C" fn mc_context_remove(registry: *mut McRegistry, context: *mut McContext) -> McStatus {
    guard("mc_context_remove", || {
        {
            let registry_entry = borrow(&REGISTRIES, registry)?;
            let entry = borrow(&CONTEXTS, context)?;
            check_issued(&registry_entry, &entry.ticket, "context", context.cast())?;
            registry_entry.remove_provider_context(&entry.identity)?;
        }
        super::remove(&CONTEXTS, context)
    })
}

/// Registers an authority (a tenant, a quota owner) for `device`; `user` and `destroy`
/// as for `mc_context_register` (on any error `destroy` is not called).
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
    let pointer = Arc::new(UserPointer::new(user, destroy));
    let status = guard("mc_authority_register", || {
        check_out(out, "out")?;
        let entry = borrow(&REGISTRIES, registry)?;
        let device = device_key(device)?;
        let cell = vacancy(&AUTHORITIES)?;
        let ticket = entry.books.open(Booked::Authority, registry)?;
        let identity = entry.register_authority(device, resource(&pointer))?;
        let handle = fill(cell, AuthorityEntry { identity, device, ticket });
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    });
    if status != crate::status::MC_OK {
        pointer.disarm();
    }
    status
}

/// Removes an authority that no registered mechanism references, and frees its handle.
#[unsafe(no_mangle)]
pub extern "C" fn mc_authority_remove(registry: *mut McRegistry, authority: *mut McAuthority) -> McStatus {
    guard("mc_authority_remove", || {
        {
            let registry_entry = borrow(&REGISTRIES, registry)?;
            let entry = borrow(&AUTHORITIES, authority)?;
            check_issued(&registry_entry, &entry.ticket, "authority", authority.cast())?;
            registry_entry.remove_authority(&entry.identity)?;
        }
        super::remove(&AUTHORITIES, authority)
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
        check_optional_out(out, "out")?;
        // SAFETY: null or NUL-terminated (the caller's contract).
        let reason = unsafe { text_or(reason, "reason", "invalidated through the C API") }?;
        let registry = borrow(&REGISTRIES, registry)?;
        let device = device_key(device)?;
        let report = registry.invalidate_device(device, reason);
        let written = McInvalidation {
            mechanisms: report.mechanisms as u64,
            contexts: report.contexts as u64,
            selection_dropped: u32::from(report.selection_dropped),
            reserved: 0,
        };
        // SAFETY: checked above.
        unsafe { write_optional(out, written) };
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
        check_optional_out(out, "out")?;
        let registry = borrow(&REGISTRIES, registry)?;
        let entry = borrow(&CONTEXTS, context)?;
        check_issued(&registry, &entry.ticket, "context", context.cast())?;
        let report = registry.confirm_context_terminated(&entry.identity)?;
        let written = McTermination {
            already_terminated: u32::from(report.already_terminated),
            reserved: 0,
            mechanisms: report.mechanisms as u64,
            lost_allocations: report.lost_allocations as u64,
            lost_bytes: report.lost_bytes as u64,
            discharged_quarantine: report.discharged_quarantine as u64,
        };
        // SAFETY: checked above.
        unsafe { write_optional(out, written) };
        Ok(())
    })
}
