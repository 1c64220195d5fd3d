//! The allocator capabilities through a binding, as `memory-binding`'s bound capability
//! handles have them: virtual backing (an allocation is a reservation; commit and
//! decommit granule-aligned ranges of it) and shared mapping (an allocation is a
//! reservation; map granule-aligned ranges of a physical backing into it, read-only or
//! read-write, and unmap them).
//!
//! Every call checks its arguments (out-pointers, the access value, the handles, sizes
//! that fit the host), then the registry checks that the allocation was made through the
//! binding, that the mechanism admits the call and that the range lies inside the
//! allocation on the granularity, all before the allocator's capability runs.

use memory_governor::{
    BoundAllocation, BoundCapabilityError, ByteRange, CapabilityError, MappingAccess, MemoryBinding, SharedBacking,
    SharedPlacement,
};

use super::bindings::{ALLOCATIONS, BINDINGS, live_allocation};
use super::{borrow, check_optional_out, check_out, fill, host_size, vacancy, write, write_optional};
use crate::handles::Scheme;
use crate::status::{
    Failure, MC_ERR_BACKEND, MC_ERR_DEVICE_LOST, MC_ERR_FOREIGN, MC_ERR_INVALID_ARGUMENT, MC_ERR_OUT_OF_MEMORY,
    MC_ERR_STATE, MC_ERR_UNSUPPORTED, McStatus, guard,
};
use crate::types::*;

pub(crate) const KIND_BACKING: u8 = 0xaa;

tables! {
    BACKINGS in BACKING_CELLS: SharedBacking = (KIND_BACKING, Scheme::Hazard, "shared backing", FREE_BACKINGS);
}

/// A failed capability call, with what to do about it. `granularity` and `allocation`
/// add advice for a range refused against an allocation whose size is off the
/// granularity (its last partial granule can never be committed or mapped).
fn capability_failure(
    error: BoundCapabilityError,
    allocation: Option<&BoundAllocation>,
    granularity: usize,
) -> Failure {
    let status = match &error {
        BoundCapabilityError::Unsupported { .. } => MC_ERR_UNSUPPORTED,
        BoundCapabilityError::Handle(handle) => return Failure::from(handle),
        BoundCapabilityError::Capability(capability) => match capability {
            CapabilityError::OutOfBounds { .. }
            | CapabilityError::BackingOutOfBounds { .. }
            | CapabilityError::Misaligned { .. } => MC_ERR_INVALID_ARGUMENT,
            CapabilityError::NotOwned { .. } | CapabilityError::ForeignBacking { .. } => MC_ERR_FOREIGN,
            CapabilityError::AlreadyMapped { .. } => MC_ERR_STATE,
            CapabilityError::OutOfMemory { .. } => MC_ERR_OUT_OF_MEMORY,
            CapabilityError::DeviceLost { .. } => MC_ERR_DEVICE_LOST,
            CapabilityError::Unsupported { .. } => MC_ERR_UNSUPPORTED,
            _ => MC_ERR_BACKEND,
        },
        _ => MC_ERR_BACKEND,
    };
    let mut message = error.to_string();
    if let Some(allocation) = allocation
        && matches!(error, BoundCapabilityError::Capability(CapabilityError::OutOfBounds { .. }))
        && granularity != 0
        && !allocation.bytes().is_multiple_of(granularity)
    {
        message.push_str(&format!(
            "; this allocation is {} bytes, not a multiple of the {granularity}-byte granularity, so its last \
             {} bytes can never be committed or mapped: allocate multiples of the granularity",
            allocation.bytes(),
            allocation.bytes() % granularity
        ));
    }
    Failure::new(status, message)
}

/// A backing size off the granularity, refused before the allocator runs: the
/// allocator's own refusal speaks of a range "at offset 0" and of "offset and len", which
/// `mc_backing_create` has not (its one number is the size).
#[cold]
fn backing_size_failure(bytes: usize, granularity: usize) -> Failure {
    let advice = match bytes.checked_next_multiple_of(granularity) {
        Some(rounded) => format!("ask for {rounded} bytes (rounded up) or another multiple of {granularity}"),
        None => format!("ask for a multiple of {granularity} bytes"),
    };
    Failure::new(
        MC_ERR_INVALID_ARGUMENT,
        format!(
            "a backing of {bytes} bytes is not a multiple of the {granularity}-byte granularity of this binding's \
             shared mapping (mc_shared_granularity); {advice}"
        ),
    )
}

/// A range `offset .. offset + length` of an allocation, as host sizes.
fn range(offset: u64, length: u64) -> Result<ByteRange, Failure> {
    Ok(ByteRange::new(host_size(offset, "offset")?, host_size(length, "length")?))
}

fn unsupported(error: BoundCapabilityError) -> Failure {
    capability_failure(error, None, 0)
}

/// Runs `call` with the binding and the live allocation behind two handles.
fn with_allocation<R>(
    binding: *mut McBinding,
    allocation: *mut McAllocation,
    call: impl FnOnce(&MemoryBinding, &BoundAllocation) -> Result<R, Failure>,
) -> Result<R, Failure> {
    let binding = borrow(&BINDINGS, binding)?;
    let cell = borrow(&ALLOCATIONS, allocation)?;
    call(&binding, live_allocation(&cell)?)
}

// ---------------------------------------------------------------------------------
// Virtual backing

/// Writes the commit granularity of `binding`'s allocator (bytes; a page on the CPU).
/// `MC_ERR_UNSUPPORTED` when it has no virtual backing (only `MC_CPU_VIRTUAL`,
/// `MC_CUDA_VMM` and plugins or vtables with `MP_CAP_VIRTUAL_BACKING` have one).
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_virtual_granularity(binding: *mut McBinding, out: *mut u64) -> McStatus {
    guard("mc_virtual_granularity", || {
        check_out(out, "out")?;
        let binding = borrow(&BINDINGS, binding)?;
        let backing = binding.virtual_backing().map_err(unsupported)?;
        // SAFETY: checked above.
        unsafe { write(out, backing.granularity() as u64) };
        Ok(())
    })
}

/// Commits `offset .. offset + length` of `allocation` (both multiples of the
/// granularity, inside the allocation): the range becomes readable and writable host
/// memory on the CPU. Writes the bytes newly committed to `committed` (may be null;
/// pages committed already count zero). On error nothing was committed.
///
/// # Safety
/// `committed` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_virtual_commit(
    binding: *mut McBinding,
    allocation: *mut McAllocation,
    offset: u64,
    length: u64,
    committed: *mut u64,
) -> McStatus {
    guard("mc_virtual_commit", || {
        check_optional_out(committed, "committed")?;
        let range = range(offset, length)?;
        let bytes = with_allocation(binding, allocation, |binding, allocation| {
            let backing = binding.virtual_backing().map_err(unsupported)?;
            backing
                .commit(allocation, range)
                .map_err(|e| capability_failure(e, Some(allocation), backing.granularity()))
        })?;
        // SAFETY: checked above.
        unsafe { write_optional(committed, bytes as u64) };
        Ok(())
    })
}

/// Decommits `offset .. offset + length` of `allocation` (as for `mc_virtual_commit`;
/// allowed on a retired mechanism): the physical pages are given back and the range is
/// inaccessible again. Writes the bytes really released to `released` (may be null).
/// A backend failure part-way may have released some pages: ask
/// `mc_virtual_committed_bytes` after an error.
///
/// # Safety
/// `released` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_virtual_decommit(
    binding: *mut McBinding,
    allocation: *mut McAllocation,
    offset: u64,
    length: u64,
    released: *mut u64,
) -> McStatus {
    guard("mc_virtual_decommit", || {
        check_optional_out(released, "released")?;
        let range = range(offset, length)?;
        let bytes = with_allocation(binding, allocation, |binding, allocation| {
            let backing = binding.virtual_backing().map_err(unsupported)?;
            backing
                .decommit(allocation, range)
                .map_err(|e| capability_failure(e, Some(allocation), backing.granularity()))
        })?;
        // SAFETY: checked above.
        unsafe { write_optional(released, bytes as u64) };
        Ok(())
    })
}

/// Writes the bytes of `allocation` committed now.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_virtual_committed_bytes(
    binding: *mut McBinding,
    allocation: *mut McAllocation,
    out: *mut u64,
) -> McStatus {
    guard("mc_virtual_committed_bytes", || {
        check_out(out, "out")?;
        let bytes = with_allocation(binding, allocation, |binding, allocation| {
            let backing = binding.virtual_backing().map_err(unsupported)?;
            backing.committed_bytes(allocation).map_err(unsupported)
        })?;
        // SAFETY: checked above.
        unsafe { write(out, bytes as u64) };
        Ok(())
    })
}

// ---------------------------------------------------------------------------------
// Shared mapping

/// Writes the mapping granularity of `binding`'s allocator (bytes; a page on the CPU).
/// `MC_ERR_UNSUPPORTED` when it has no shared mapping (only `MC_CPU_SHARED` and plugins
/// or vtables with `MP_CAP_SHARED_MAPPING` have one).
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_shared_granularity(binding: *mut McBinding, out: *mut u64) -> McStatus {
    guard("mc_shared_granularity", || {
        check_out(out, "out")?;
        let binding = borrow(&BINDINGS, binding)?;
        let mapping = binding.shared_mapping().map_err(unsupported)?;
        // SAFETY: checked above.
        unsafe { write(out, mapping.granularity() as u64) };
        Ok(())
    })
}

/// Creates a physical backing of `bytes` bytes (a multiple of the granularity) on
/// `binding`'s device, to map into allocations with `mc_shared_map`. Its memory is
/// zeroed on the CPU, and lives until the handle is destroyed and no allocation maps it.
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_backing_create(binding: *mut McBinding, bytes: u64, out: *mut *mut McBacking) -> McStatus {
    guard("mc_backing_create", || {
        check_out(out, "out")?;
        let bytes = host_size(bytes, "bytes")?;
        let binding = borrow(&BINDINGS, binding)?;
        let mapping = binding.shared_mapping().map_err(unsupported)?;
        let granularity = mapping.granularity();
        if granularity != 0 && !bytes.is_multiple_of(granularity) {
            return Err(backing_size_failure(bytes, granularity));
        }
        let cell = vacancy(&BACKINGS)?;
        let backing = mapping.create_backing(bytes).map_err(|e| capability_failure(e, None, 0))?;
        let handle = fill(cell, backing);
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Destroys a backing handle. Ranges mapped from it stay mapped (and keep the physical
/// memory) until they are unmapped or their allocation is released.
#[unsafe(no_mangle)]
pub extern "C" fn mc_backing_destroy(backing: *mut McBacking) -> McStatus {
    guard("mc_backing_destroy", || super::remove(&BACKINGS, backing))
}

/// Maps `backing_offset .. backing_offset + length` of `backing` into `offset .. offset +
/// length` of `allocation` with `access` (`MC_ACCESS_READ_ONLY` or
/// `MC_ACCESS_READ_WRITE`). Offsets and length are multiples of the granularity and lie
/// inside the allocation and the backing; the target must not be mapped already. On the
/// CPU the range then reads (and, read-write, writes) the backing's memory: every
/// allocation mapping the same backing range sees the same bytes. On error nothing was
/// mapped.
#[unsafe(no_mangle)]
pub extern "C" fn mc_shared_map(
    binding: *mut McBinding,
    backing: *mut McBacking,
    allocation: *mut McAllocation,
    offset: u64,
    length: u64,
    backing_offset: u64,
    access: McAccess,
) -> McStatus {
    guard("mc_shared_map", || {
        let access = match access {
            MC_ACCESS_READ_ONLY => MappingAccess::ReadOnly,
            MC_ACCESS_READ_WRITE => MappingAccess::ReadWrite,
            other => {
                return Err(Failure::new(
                    MC_ERR_INVALID_ARGUMENT,
                    format!("access {other} is unknown; use MC_ACCESS_READ_ONLY or MC_ACCESS_READ_WRITE"),
                ));
            }
        };
        let placement = SharedPlacement {
            target: range(offset, length)?,
            backing_offset: host_size(backing_offset, "backing_offset")?,
        };
        let backing = borrow(&BACKINGS, backing)?;
        with_allocation(binding, allocation, |binding, allocation| {
            let mapping = binding.shared_mapping().map_err(unsupported)?;
            mapping
                .map(&backing, allocation, placement, access)
                .map_err(|e| capability_failure(e, Some(allocation), mapping.granularity()))
        })
    })
}

/// Unmaps `offset .. offset + length` of `allocation` (granularity multiples, inside
/// the allocation; allowed on a retired mechanism): the range is inaccessible again.
/// Writes the bytes really unmapped to `unmapped` (may be null; unmapped parts of the
/// range count zero).
///
/// # Safety
/// `unmapped` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_shared_unmap(
    binding: *mut McBinding,
    allocation: *mut McAllocation,
    offset: u64,
    length: u64,
    unmapped: *mut u64,
) -> McStatus {
    guard("mc_shared_unmap", || {
        check_optional_out(unmapped, "unmapped")?;
        let range = range(offset, length)?;
        let bytes = with_allocation(binding, allocation, |binding, allocation| {
            let mapping = binding.shared_mapping().map_err(unsupported)?;
            mapping.unmap(allocation, range).map_err(|e| capability_failure(e, Some(allocation), mapping.granularity()))
        })?;
        // SAFETY: checked above.
        unsafe { write_optional(unmapped, bytes as u64) };
        Ok(())
    })
}
