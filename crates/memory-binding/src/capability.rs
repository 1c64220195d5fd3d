//! Bound capability handles: `VirtualBacking` and `SharedMapping` as seen through one
//! binding. Every call checks, before the capability runs, that the allocation was made
//! through this binding, that the mechanism admits the call, and that the range lies
//! inside the allocation on the capability's granularity.

use std::fmt;

use memory_api::{
    ByteRange, CapabilityError, MappingAccess, SharedBacking, SharedMapping, SharedPlacement, VirtualBacking,
};

use crate::binding::{BoundAllocation, MemoryBinding};
use crate::error::{BoundCapabilityError, HandleError};
use crate::lifecycle::{Admit, MechanismState};

const VIRTUAL: &str = "virtual backing";
const SHARED: &str = "shared mapping";

impl MemoryBinding {
    /// The reserve/commit capability of this binding's allocator.
    ///
    /// # Errors
    /// [`BoundCapabilityError::Unsupported`] when the allocator has none.
    pub fn virtual_backing(&self) -> Result<BoundVirtualBacking, BoundCapabilityError> {
        if self.core().allocator.virtual_backing().is_none() {
            return Err(BoundCapabilityError::Unsupported { mechanism: self.core().identity, capability: VIRTUAL });
        }
        Ok(BoundVirtualBacking { binding: self.clone() })
    }

    /// The shared-mapping capability of this binding's allocator.
    ///
    /// # Errors
    /// [`BoundCapabilityError::Unsupported`] when the allocator has none.
    pub fn shared_mapping(&self) -> Result<BoundSharedMapping, BoundCapabilityError> {
        if self.core().allocator.shared_mapping().is_none() {
            return Err(BoundCapabilityError::Unsupported { mechanism: self.core().identity, capability: SHARED });
        }
        Ok(BoundSharedMapping { binding: self.clone() })
    }

    /// Runs `call` inside the lifecycle after every check passed.
    fn capability_call<R>(
        &self,
        allocation: &BoundAllocation,
        admit: Admit,
        range: Option<ByteRange>,
        capability: &'static str,
        granularity: impl FnOnce() -> usize,
        call: impl FnOnce(&memory_api::RawAllocation) -> Option<Result<R, CapabilityError>>,
    ) -> Result<R, BoundCapabilityError> {
        // Handle and bounds first: a refused call must not reach the allocator, not
        // even for capability discovery or the granularity.
        let pin = allocation.belongs_to(self)?;
        if let Some(range) = range {
            range.check_within(allocation.bytes())?;
        }
        let core = &pin.core;
        let _in_flight = core.lifecycle.begin(&self.local_pin().in_flight, admit).map_err(|state| match state {
            MechanismState::DeviceLost => HandleError::DeviceLost { device: core.device, reason: core.lost_reason() },
            MechanismState::Terminated => HandleError::StaleAllocation,
            state => HandleError::Inactive { mechanism: core.identity, state },
        })?;
        if !allocation.is_recorded(pin) {
            return Err(HandleError::StaleAllocation.into());
        }
        if let Some(range) = range {
            range.check_aligned(granularity())?;
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
        binding.core().allocator.virtual_backing()
    }

    /// Commit granularity in bytes.
    pub fn granularity(&self) -> usize {
        Self::capability(&self.binding).map_or(0, |c| c.granularity())
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
            || self.granularity(),
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
            || self.granularity(),
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
            || self.granularity(),
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
        binding.core().allocator.shared_mapping()
    }

    /// Mapping granularity in bytes.
    pub fn granularity(&self) -> usize {
        Self::capability(&self.binding).map_or(0, |c| c.granularity())
    }

    /// Creates a physical backing of `bytes` bytes on this binding's device.
    ///
    /// # Errors
    /// An inactive or lost mechanism, a size off the granularity, or the
    /// capability's own error.
    pub fn create_backing(&self, bytes: usize) -> Result<SharedBacking, BoundCapabilityError> {
        let core = self.binding.core();
        ByteRange::new(0, bytes).check_aligned(self.granularity())?;
        let _in_flight = core.lifecycle.begin(&self.binding.local_pin().in_flight, Admit::ActiveOnly).map_err(
            |state| match state {
                MechanismState::DeviceLost => {
                    HandleError::DeviceLost { device: core.device, reason: core.lost_reason() }
                }
                state => HandleError::Inactive { mechanism: core.identity, state },
            },
        )?;
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
        let granularity = self.granularity();
        let source = ByteRange::new(placement.backing_offset, placement.target.len());
        source.check_within(backing.bytes())?;
        source.check_aligned(granularity)?;
        self.binding.capability_call(
            allocation,
            Admit::ActiveOnly,
            Some(placement.target),
            SHARED,
            || granularity,
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
            || self.granularity(),
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
