//! Bindings and allocations: bind, allocate, where an allocation is, release (now or
//! through a queue), drop.

use memory_governor::{AllocationRequest, BoundAllocation, HandleError, MemoryBinding, ReleaseSummary};
use memory_plugin::abi_device;
use memory_plugin_abi::MpDevice;

use super::mechanisms::MECHANISMS;
use super::queues::QUEUES;
use super::registry::{REGISTRIES, check_issued};
use super::{
    borrow, check_optional_out, check_out, device_key, fill, handle_failure, role, vacancy, write, write_optional,
};
use crate::handles::{Scheme, number, pointer};
use crate::status::{Failure, MC_ERR_INVALID_ARGUMENT, McStatus, guard};
use crate::types::*;

pub(crate) const KIND_BINDING: u8 = 0xa6;
pub(crate) const KIND_ALLOCATION: u8 = 0xa7;

tables! {
    BINDINGS in BINDING_CELLS: MemoryBinding = (KIND_BINDING, Scheme::Hazard, "binding", FREE_BINDINGS);
    // `None` only while a call makes or releases the allocation in its cell. Allocations,
    // consumed by every release, are counted (see `crate::handles`).
    ALLOCATIONS in ALLOCATION_CELLS: Option<BoundAllocation> =
        (KIND_ALLOCATION, Scheme::Counted, "allocation", FREE_ALLOCATIONS);
}

/// Binds the mechanism selected for `device`.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_bind(registry: *mut McRegistry, device: MpDevice, out: *mut *mut McBinding) -> McStatus {
    guard("mc_bind", || {
        check_out(out, "out")?;
        let registry = borrow(&REGISTRIES, registry)?;
        let device = device_key(device)?;
        let cell = vacancy(&BINDINGS)?;
        let handle = fill(cell, registry.bind(device)?);
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
        let registry_entry = borrow(&REGISTRIES, registry)?;
        let entry = borrow(&MECHANISMS, mechanism)?;
        check_issued(&registry_entry, &entry.ticket, "mechanism", mechanism.cast())?;
        let cell = vacancy(&BINDINGS)?;
        let handle = fill(cell, registry_entry.bind_registered(&entry.identity)?);
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Destroys a binding handle (its allocations stay valid and pinned).
#[unsafe(no_mangle)]
pub extern "C" fn mc_binding_destroy(binding: *mut McBinding) -> McStatus {
    guard("mc_binding_destroy", || super::remove(&BINDINGS, binding))
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
        let cell = vacancy(&ALLOCATIONS)?;
        // Made in its cell: the 64-byte handle is written once, where it lives.
        let handle = cell.fill_in_place(None, |place| binding.allocate_into(request, place).map(drop))?;
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
        check_optional_out(report, "report")?;
        let binding = borrow(&BINDINGS, binding)?;
        let number = number(allocation);
        let mut taken = ALLOCATIONS.take(number).map_err(|fault| handle_failure("allocation", number, fault))?;
        // Released where it lies in its cell (not moved out and back on a refusal).
        match binding.release_from(taken.value_mut()) {
            Ok(done) => {
                taken.free();
                let written = report_of(done);
                // SAFETY: checked above.
                unsafe { write_optional(report, written) };
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

/// What an accepted release did, for C.
fn report_of(done: ReleaseSummary) -> McReleaseReport {
    match done {
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
    }
}

/// Releases `allocation` through the allocator that made it, with no binding: the
/// binding it was allocated through may be destroyed already, or be another object's.
/// The registry checks the allocation's own identity (its record and generation in the
/// mechanism it pins) before the allocator runs; a lost device is `MC_ERR_DEVICE_LOST`
/// with no callback. On success the handle is stale; on any error it stays valid and
/// yours. `report` may be null.
///
/// # Safety
/// `report` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_allocation_release(
    allocation: *mut McAllocation,
    report: *mut McReleaseReport,
) -> McStatus {
    guard("mc_allocation_release", || {
        check_optional_out(report, "report")?;
        let number = number(allocation);
        let mut taken = ALLOCATIONS.take(number).map_err(|fault| handle_failure("allocation", number, fault))?;
        match BoundAllocation::release_in_place(taken.value_mut()) {
            Ok(done) => {
                taken.free();
                // SAFETY: checked above.
                unsafe { write_optional(report, report_of(done)) };
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
        let taken = ALLOCATIONS.take(number).map_err(|fault| handle_failure("allocation", number, fault))?;
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
pub(crate) fn live_allocation(cell: &Option<BoundAllocation>) -> Result<&BoundAllocation, Failure> {
    cell.as_ref().ok_or_else(stale_allocation)
}

#[cold]
pub(crate) fn stale_allocation() -> Failure {
    Failure::from(&HandleError::StaleAllocation)
}

/// Gives up an allocation handle without an explicit release: a live allocation follows
/// its mechanism's drop policy (host memory is released, device memory quarantined); one
/// whose device was lost or whose context terminated is only forgotten.
#[unsafe(no_mangle)]
pub extern "C" fn mc_allocation_drop(allocation: *mut McAllocation) -> McStatus {
    guard("mc_allocation_drop", || super::remove(&ALLOCATIONS, allocation))
}
