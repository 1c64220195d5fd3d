//! The allocator contract: requests, raw allocations and the `DeviceAllocator` trait.

use std::fmt;
use std::sync::Arc;

use crate::address::DeviceAddress;
use crate::capability::{SharedMapping, VirtualBacking};
use crate::device::{DeviceKey, MemoryRole};
use crate::error::{AllocError, LayoutError};
use crate::release::ReleaseOutcome;

/// A validated allocation request: size, power-of-two alignment and role.
///
/// The size rounded up to the alignment never exceeds `isize::MAX`, so every backend
/// can turn a request into a `std::alloc::Layout` or a driver size without overflow.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct AllocationRequest {
    bytes: usize,
    align: usize,
    role: MemoryRole,
}

impl AllocationRequest {
    /// The largest size any request may have.
    pub const MAX_BYTES: usize = isize::MAX as usize;

    /// A request for `bytes` bytes (zero allowed) aligned to `align`.
    ///
    /// # Errors
    /// [`LayoutError::AlignmentNotPowerOfTwo`] for a zero or non-power-of-two
    /// alignment; [`LayoutError::SizeOverflow`] when the size rounded up to the
    /// alignment exceeds [`AllocationRequest::MAX_BYTES`].
    #[inline]
    pub fn new(bytes: usize, align: usize) -> Result<AllocationRequest, LayoutError> {
        if !align.is_power_of_two() {
            return Err(LayoutError::AlignmentNotPowerOfTwo { align });
        }
        match bytes.checked_next_multiple_of(align) {
            Some(rounded) if rounded <= Self::MAX_BYTES => {
                Ok(AllocationRequest { bytes, align, role: MemoryRole::Other })
            }
            _ => Err(LayoutError::SizeOverflow { bytes, align, max: Self::MAX_BYTES }),
        }
    }

    /// The same request, accounted to `role`.
    #[must_use]
    #[inline]
    pub fn with_role(self, role: MemoryRole) -> AllocationRequest {
        AllocationRequest { role, ..self }
    }

    /// Bytes asked for.
    #[inline]
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Alignment asked for (a power of two).
    #[inline]
    pub fn align(&self) -> usize {
        self.align
    }

    /// What the memory is for.
    #[inline]
    pub fn role(&self) -> MemoryRole {
        self.role
    }
}

/// Ownership of one block of memory, as an allocator returned it.
///
/// Deliberately neither `Clone` nor `Copy`: it is the token that
/// [`DeviceAllocator::release`] consumes, so one allocation cannot be released twice
/// through safe code. The address and sizes are what the allocator reported; the
/// registry never derives identity from them.
#[derive(PartialEq, Eq)]
pub struct RawAllocation {
    address: DeviceAddress,
    bytes: usize,
    align: usize,
    device: DeviceKey,
    provider_tag: u64,
}

impl RawAllocation {
    /// Records an allocation of `bytes` bytes at `address` on `device`.
    /// `provider_tag` is private to the allocator that made it (a size class, a handle
    /// slot); nothing else reads it.
    #[inline]
    pub fn new(
        address: DeviceAddress,
        bytes: usize,
        align: usize,
        device: DeviceKey,
        provider_tag: u64,
    ) -> RawAllocation {
        RawAllocation { address, bytes, align, device, provider_tag }
    }

    /// Start of the allocation.
    #[inline]
    pub fn address(&self) -> DeviceAddress {
        self.address
    }

    /// Usable size in bytes: at least what was requested (an allocator may round up,
    /// for example to its commit granularity, and report the rounded size).
    #[inline]
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Alignment of [`RawAllocation::address`].
    #[inline]
    pub fn align(&self) -> usize {
        self.align
    }

    /// Device the memory lives on.
    #[inline]
    pub fn device(&self) -> DeviceKey {
        self.device
    }

    /// The allocator's private tag.
    #[inline]
    pub fn provider_tag(&self) -> u64 {
        self.provider_tag
    }

    /// Whether `other` describes the same block (address, size, alignment, device).
    #[inline]
    pub fn same_block(&self, other: &RawAllocation) -> bool {
        self.address == other.address
            && self.bytes == other.bytes
            && self.align == other.align
            && self.device == other.device
    }
}

impl fmt::Debug for RawAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RawAllocation({} bytes at {} on {}, align {})", self.bytes, self.address, self.device, self.align)
    }
}

/// Counters an allocator may report. Fields it does not track stay zero.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct AllocatorStats {
    /// Bytes currently handed out to callers.
    pub live_bytes: u64,
    /// Allocations currently handed out.
    pub live_allocations: u64,
    /// Bytes held by the allocator but not handed out (a pool's cache).
    pub cached_bytes: u64,
    /// The largest block the allocator could hand out from `cached_bytes` without
    /// asking for more memory (a pool's largest free piece). With `cached_bytes` it
    /// says how scattered the cache is: `1 - largest / cached`.
    pub largest_free_bytes: u64,
    /// Bytes of address space reserved (virtual allocators).
    pub reserved_bytes: u64,
    /// Successful allocations since creation.
    pub allocations_total: u64,
    /// Failed allocations since creation.
    pub failures_total: u64,
}

/// A source of memory on one device.
///
/// Object safe and `Send + Sync`: the registry holds allocators as
/// `Arc<dyn DeviceAllocator>` and calls them from many threads at once.
///
/// # Contract
/// - `allocate` returns a block of at least `request.bytes()` bytes aligned to
///   `request.align()`, distinct from every other live block; a zero-byte request
///   yields a unique, releasable block.
/// - `release` is the one canonical release path and consumes the block. It returns
///   an honest [`ReleaseOutcome`]: `Complete` when nothing remains owned,
///   `Quarantined` when something was mutated but ownership remains, `Failed` (with
///   the block handed back) only when nothing was mutated.
/// - `release` and every capability call check the block against the allocator's own
///   records and refuse any block it did not issue or has already released
///   ([`ReleaseOutcome::failed`] / [`CapabilityError::NotOwned`](crate::CapabilityError::NotOwned)).
///   [`RawAllocation::new`] is public and safe, so a forged or duplicated block must
///   never reach memory the allocator does not own. The conformance suite in
///   `memory-testkit` checks this.
/// - Neither method panics on bad input; errors are values.
pub trait DeviceAllocator: Send + Sync {
    /// The device this allocator serves.
    fn device(&self) -> DeviceKey;

    /// A short human-readable name for messages ("system", "cuda-pool").
    fn name(&self) -> &str;

    /// Allocates memory for `request`.
    ///
    /// # Errors
    /// An [`AllocError`] when nothing could be allocated; nothing is leaked then.
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError>;

    /// Releases a block this allocator returned.
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome;

    /// The reserve/commit capability, if this allocator has one.
    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        None
    }

    /// The shared-mapping capability, if this allocator has one.
    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        None
    }

    /// Current counters, if this allocator keeps any.
    fn stats(&self) -> Option<AllocatorStats> {
        None
    }

    /// Returns cached memory to the layer below; the bytes returned.
    fn trim(&self) -> usize {
        0
    }

    /// Hands back blocks that were lost with their device, once the registry has
    /// confirmed their provider context terminated (no callback in flight, every
    /// handle refused). On a real device the memory is already gone with the context:
    /// the allocator must not free it through the device, only drop its own books (a
    /// governed allocator refunds the charge here). An allocator of host memory (a
    /// host-backed simulated device) releases the blocks here instead, as nothing else
    /// ever frees them. The default just drops them.
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        drop(lost);
    }
}

impl<A: DeviceAllocator + ?Sized> DeviceAllocator for Arc<A> {
    fn device(&self) -> DeviceKey {
        (**self).device()
    }
    fn name(&self) -> &str {
        (**self).name()
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        (**self).allocate(request)
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        (**self).release(allocation)
    }
    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        (**self).virtual_backing()
    }
    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        (**self).shared_mapping()
    }
    fn stats(&self) -> Option<AllocatorStats> {
        (**self).stats()
    }
    fn trim(&self) -> usize {
        (**self).trim()
    }
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        (**self).forget_lost(lost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_validate_alignment_and_size() {
        assert!(AllocationRequest::new(0, 1).is_ok());
        assert!(AllocationRequest::new(100, 2 << 20).is_ok());
        assert_eq!(AllocationRequest::new(8, 0), Err(LayoutError::AlignmentNotPowerOfTwo { align: 0 }));
        assert_eq!(AllocationRequest::new(8, 3), Err(LayoutError::AlignmentNotPowerOfTwo { align: 3 }));
        assert!(matches!(AllocationRequest::new(usize::MAX, 1), Err(LayoutError::SizeOverflow { .. })));
        assert!(matches!(AllocationRequest::new(isize::MAX as usize, 2), Err(LayoutError::SizeOverflow { .. })));
        assert!(AllocationRequest::new(isize::MAX as usize - 7, 8).is_ok());
    }

    #[test]
    fn role_defaults_to_other_and_is_kept() {
        let request = AllocationRequest::new(64, 8).unwrap();
        assert_eq!(request.role(), MemoryRole::Other);
        assert_eq!(request.with_role(MemoryRole::KvCache).role(), MemoryRole::KvCache);
        assert_eq!(request.with_role(MemoryRole::KvCache).bytes(), 64);
    }

    fn assert_object_safe(_: Option<&dyn DeviceAllocator>) {}
    fn assert_send_sync<T: Send + Sync + ?Sized>() {}

    #[test]
    fn allocator_trait_is_object_safe_and_thread_safe() {
        assert_object_safe(None);
        assert_send_sync::<dyn DeviceAllocator>();
        assert_send_sync::<RawAllocation>();
    }
}
