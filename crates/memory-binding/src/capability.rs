//! Bound capability handles: `VirtualBacking` and `SharedMapping` as seen through one
//! binding. Every call checks, before the capability runs, that the allocation was made
//! through this binding, that the mechanism admits the call, and that the range lies
//! inside the allocation on the capability's granularity.

use std::fmt;

use memory_api::{
    ByteRange, CapabilityError, DeviceAllocator, MappingAccess, SharedBacking, SharedMapping, SharedPlacement,
    VirtualBacking,
};

use crate::binding::{BoundAllocation, MemoryBinding, refusal_for};
use crate::entry::MechanismCore;
use crate::error::{BoundCapabilityError, HandleError};
use crate::lifecycle::{Admit, MechanismState};

const VIRTUAL: &str = "virtual backing";
const SHARED: &str = "shared mapping";

/// Whether `capability` lies inside the allocator's own value: the allocator itself or
/// one of its fields, which the allocator's contract covers. (Addresses only: nothing
/// is dereferenced.)
fn part_of<C: ?Sized>(allocator: &dyn DeviceAllocator, capability: &C) -> bool {
    let start = std::ptr::from_ref(allocator).cast::<u8>().addr();
    let end = start + std::mem::size_of_val(allocator);
    let at = std::ptr::from_ref(capability).cast::<u8>().addr();
    start <= at && at + std::mem::size_of_val(capability) <= end
}

/// The first capability `allocator` exposes that is not part of its own value, if any:
/// such an allocator is a composite, which only the trusted registration path accepts.
pub(crate) fn split_capability(allocator: &dyn DeviceAllocator) -> Option<&'static str> {
    if allocator.virtual_backing().is_some_and(|c| !part_of(allocator, c)) {
        return Some(VIRTUAL);
    }
    allocator.shared_mapping().is_some_and(|c| !part_of(allocator, c)).then_some(SHARED)
}

impl MechanismCore {
    /// The allocator's reserve/commit capability, if it has one the registration path
    /// admits (one that moved out of the allocator's value since a safe registration
    /// is treated as absent).
    pub(crate) fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        let allocator = &*self.allocator;
        allocator.virtual_backing().filter(|c| self.trusted_composite || part_of(allocator, *c))
    }

    /// The allocator's shared-mapping capability, as for [`MechanismCore::virtual_backing`].
    pub(crate) fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        let allocator = &*self.allocator;
        allocator.shared_mapping().filter(|c| self.trusted_composite || part_of(allocator, *c))
    }
}

impl MemoryBinding {
    /// The reserve/commit capability of this binding's allocator.
    ///
    /// # Errors
    /// [`BoundCapabilityError::Unsupported`] when the allocator has none;
    /// [`BoundCapabilityError::Handle`] when its device was lost (nothing is asked).
    pub fn virtual_backing(&self) -> Result<BoundVirtualBacking, BoundCapabilityError> {
        if !self.capability_query(|| self.core().virtual_backing().is_some())? {
            return Err(BoundCapabilityError::Unsupported { mechanism: self.core().identity, capability: VIRTUAL });
        }
        Ok(BoundVirtualBacking { binding: self.clone() })
    }

    /// The shared-mapping capability of this binding's allocator.
    ///
    /// # Errors
    /// [`BoundCapabilityError::Unsupported`] when the allocator has none;
    /// [`BoundCapabilityError::Handle`] when its device was lost (nothing is asked).
    pub fn shared_mapping(&self) -> Result<BoundSharedMapping, BoundCapabilityError> {
        if !self.capability_query(|| self.core().shared_mapping().is_some())? {
            return Err(BoundCapabilityError::Unsupported { mechanism: self.core().identity, capability: SHARED });
        }
        Ok(BoundSharedMapping { binding: self.clone() })
    }

    /// Runs a capability query (discovery, granularity) inside the lifecycle, counted in
    /// flight like any callback: on a lost or terminated mechanism nothing is asked.
    fn capability_query<R>(&self, query: impl FnOnce() -> R) -> Result<R, HandleError> {
        let core = self.core();
        let _in_flight = core
            .lifecycle
            .begin(&self.local_pin().in_flight, Admit::ActiveOrRetired)
            .map_err(|state| refusal_for(core, state))?;
        Ok(query())
    }

    /// Runs `call` inside the lifecycle after every check passed.
    fn capability_call<R>(
        &self,
        allocation: &BoundAllocation,
        admit: Admit,
        range: Option<ByteRange>,
        capability: &'static str,
        granularity: impl FnOnce() -> Option<usize>,
        call: impl FnOnce(&memory_api::RawAllocation) -> Option<Result<R, CapabilityError>>,
    ) -> Result<R, BoundCapabilityError> {
        // Handle and bounds first: a refused call must not reach the allocator, not
        // even for capability discovery or the granularity.
        let pin = allocation.belongs_to(self)?;
        if let Some(range) = range {
            range.check_within(allocation.bytes())?;
        }
        let core = &pin.core;
        let _in_flight =
            core.lifecycle.begin(&self.local_pin().in_flight, admit).map_err(|state| refusal_for(core, state))?;
        // The record exists: the allocation is borrowed, so nothing releases it during
        // this call, and the in-flight count above keeps termination (the only other
        // path that retires records) from running until the call is over.
        if let Some(range) = range {
            let granularity =
                granularity().ok_or(BoundCapabilityError::Unsupported { mechanism: core.identity, capability })?;
            range.check_aligned(granularity)?;
        }
        let result = call(&allocation.raw_view(core.device))
            .ok_or(BoundCapabilityError::Unsupported { mechanism: core.identity, capability })?;
        Ok(result?)
    }
}

/// `VirtualBacking` through one binding.
#[derive(Clone)]
pub struct BoundVirtualBacking {
    binding: MemoryBinding,
}

impl BoundVirtualBacking {
    fn capability(binding: &MemoryBinding) -> Option<&dyn VirtualBacking> {
        binding.core().virtual_backing()
    }

    /// Commit granularity in bytes; 0 when the capability is gone or the device was
    /// lost (then nothing is asked).
    pub fn granularity(&self) -> usize {
        self.binding.capability_query(|| Self::capability(&self.binding).map_or(0, |c| c.granularity())).unwrap_or(0)
    }

    /// Commits `range` of `allocation`; returns the bytes newly committed.
    ///
    /// # Errors
    /// A cross-binding, stale or lost handle, a retired mechanism, or a range out of
    /// bounds or off the granularity, all before the capability runs; then the
    /// capability's own error.
    pub fn commit(&self, allocation: &BoundAllocation, range: ByteRange) -> Result<usize, BoundCapabilityError> {
        self.binding.capability_call(
            allocation,
            Admit::ActiveOnly,
            Some(range),
            VIRTUAL,
            || Self::capability(&self.binding).map(|c| c.granularity()),
            |raw| Self::capability(&self.binding).map(|c| c.commit(raw, range)),
        )
    }

    /// Decommits `range` of `allocation` (allowed on a retired mechanism); returns the
    /// bytes really released.
    ///
    /// # Errors
    /// As for [`BoundVirtualBacking::commit`].
    pub fn decommit(&self, allocation: &BoundAllocation, range: ByteRange) -> Result<usize, BoundCapabilityError> {
        self.binding.capability_call(
            allocation,
            Admit::ActiveOrRetired,
            Some(range),
            VIRTUAL,
            || Self::capability(&self.binding).map(|c| c.granularity()),
            |raw| Self::capability(&self.binding).map(|c| c.decommit(raw, range)),
        )
    }

    /// Bytes of `allocation` committed now.
    ///
    /// # Errors
    /// A cross-binding, stale or lost handle.
    pub fn committed_bytes(&self, allocation: &BoundAllocation) -> Result<usize, BoundCapabilityError> {
        self.binding.capability_call(
            allocation,
            Admit::ActiveOrRetired,
            None,
            VIRTUAL,
            || Self::capability(&self.binding).map(|c| c.granularity()),
            |raw| Self::capability(&self.binding).map(|c| c.committed_bytes(raw)),
        )
    }

    /// The binding this handle is pinned to.
    pub fn binding(&self) -> &MemoryBinding {
        &self.binding
    }
}

impl fmt::Debug for BoundVirtualBacking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BoundVirtualBacking").field(&self.binding.identity()).finish()
    }
}

/// `SharedMapping` through one binding.
#[derive(Clone)]
pub struct BoundSharedMapping {
    binding: MemoryBinding,
}

impl BoundSharedMapping {
    fn capability(binding: &MemoryBinding) -> Option<&dyn SharedMapping> {
        binding.core().shared_mapping()
    }

    /// Mapping granularity in bytes; 0 when the capability is gone or the device was
    /// lost (then nothing is asked).
    pub fn granularity(&self) -> usize {
        self.binding.capability_query(|| Self::capability(&self.binding).map_or(0, |c| c.granularity())).unwrap_or(0)
    }

    /// Creates a physical backing of `bytes` bytes on this binding's device.
    ///
    /// # Errors
    /// An inactive or lost mechanism, a size off the granularity, or the
    /// capability's own error.
    pub fn create_backing(&self, bytes: usize) -> Result<SharedBacking, BoundCapabilityError> {
        let core = self.binding.core();
        // The lifecycle first: on a lost device not even the granularity is asked.
        let _in_flight = core.lifecycle.begin(&self.binding.local_pin().in_flight, Admit::ActiveOnly).map_err(
            |state| match state {
                MechanismState::DeviceLost => HandleError::DeviceLost {
                    device: core.device,
                    mechanism: core.identity,
                    reason: core.lost_reason(),
                },
                state => HandleError::Inactive { mechanism: core.identity, state },
            },
        )?;
        let granularity = Self::capability(&self.binding).map_or(0, |c| c.granularity());
        ByteRange::new(0, bytes).check_aligned(granularity)?;
        let capability = Self::capability(&self.binding)
            .ok_or(BoundCapabilityError::Unsupported { mechanism: core.identity, capability: SHARED })?;
        Ok(capability.create_backing(bytes)?)
    }

    /// Maps `placement` of `backing` into `allocation` with `access`.
    ///
    /// # Errors
    /// A cross-binding, stale or lost handle, a backing of another device, a
    /// placement out of bounds (in the allocation or in the backing) or off the
    /// granularity, all before the capability runs; then the capability's own error.
    pub fn map(
        &self,
        backing: &SharedBacking,
        allocation: &BoundAllocation,
        placement: SharedPlacement,
        access: MappingAccess,
    ) -> Result<(), BoundCapabilityError> {
        // The handle first: a cross-binding call must not reach the allocator at all.
        allocation.belongs_to(&self.binding)?;
        let device = self.binding.device();
        if backing.device() != device {
            return Err(CapabilityError::ForeignBacking {
                found: backing.device().to_string(),
                expected: device.to_string(),
            }
            .into());
        }
        let source = ByteRange::new(placement.backing_offset, placement.target.len());
        source.check_within_backing(backing.bytes())?;
        // The lifecycle before the granularity is asked (the call below checks it again,
        // nested): on a lost device nothing is asked.
        let core = self.binding.core();
        let _in_flight = core
            .lifecycle
            .begin(&self.binding.local_pin().in_flight, Admit::ActiveOnly)
            .map_err(|state| refusal_for(core, state))?;
        let mechanism = core.identity;
        let granularity = Self::capability(&self.binding)
            .map(|c| c.granularity())
            .ok_or(BoundCapabilityError::Unsupported { mechanism, capability: SHARED })?;
        source.check_aligned(granularity)?;
        self.binding.capability_call(
            allocation,
            Admit::ActiveOnly,
            Some(placement.target),
            SHARED,
            || Some(granularity),
            |raw| Self::capability(&self.binding).map(|c| c.map(backing, raw, placement, access)),
        )
    }

    /// Unmaps `range` of `allocation` (allowed on a retired mechanism); returns the
    /// bytes really unmapped.
    ///
    /// # Errors
    /// As for [`BoundSharedMapping::map`].
    pub fn unmap(&self, allocation: &BoundAllocation, range: ByteRange) -> Result<usize, BoundCapabilityError> {
        self.binding.capability_call(
            allocation,
            Admit::ActiveOrRetired,
            Some(range),
            SHARED,
            || Self::capability(&self.binding).map(|c| c.granularity()),
            |raw| Self::capability(&self.binding).map(|c| c.unmap(raw, range)),
        )
    }

    /// The binding this handle is pinned to.
    pub fn binding(&self) -> &MemoryBinding {
        &self.binding
    }
}

impl fmt::Debug for BoundSharedMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BoundSharedMapping").field(&self.binding.identity()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memory_api::{AllocError, AllocationRequest, DeviceKey, RawAllocation, ReleaseOutcome};

    /// An allocator with a little state, so that it has a size.
    struct Sized8(#[allow(dead_code)] u64);

    impl DeviceAllocator for Sized8 {
        fn device(&self) -> DeviceKey {
            DeviceKey::HOST
        }
        fn name(&self) -> &str {
            "sized"
        }
        fn allocate(&self, _: &AllocationRequest) -> Result<RawAllocation, AllocError> {
            Err(AllocError::Unsupported { allocator: "sized".into(), device: DeviceKey::HOST, what: "allocation" })
        }
        fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
            ReleaseOutcome::complete(allocation.bytes())
        }
    }

    /// An allocator and, right behind it in memory, an object that is not part of it.
    #[repr(C)]
    struct Neighbours {
        allocator: Sized8,
        after: [u64; 4],
    }

    #[test]
    fn only_objects_wholly_inside_the_allocator_value_are_part_of_it() {
        let pair = Neighbours { allocator: Sized8(7), after: [0; 4] };
        let allocator: &dyn DeviceAllocator = &pair.allocator;
        assert!(part_of(allocator, &pair.allocator), "the allocator itself");
        assert!(part_of(allocator, &pair.allocator.0), "its field");
        assert!(!part_of(allocator, &pair.after), "the object right behind it");
        assert!(!part_of(allocator, &pair.after[0]), "the first word behind it");
        let unrelated = [0u64; 2];
        assert!(!part_of(allocator, &unrelated), "an unrelated object");
    }
}
