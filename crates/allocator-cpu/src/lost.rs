//! What a host allocator does with the blocks of a lost device at termination.
//!
//! On a real device the memory of a lost context went with it, so `forget_lost` only
//! drops the books. The allocators here hand out host memory, even for a simulated
//! device (`DeviceKey::host(n)`): nothing else ever frees it, so a simulated loss would
//! keep every live block for the life of the process (valgrind calls it definitely
//! lost). The registry calls `forget_lost` only once the context is confirmed
//! terminated (no callback in flight, every handle refused), so nothing it handed out
//! can reach the memory any more: each block is released as if its owner had released
//! it, which also checks that it is a block this allocator handed out and still holds.

use memory_api::{DeviceAllocator, RawAllocation};

/// Releases each lost block through `allocator` (see the module docs); a block the
/// allocator refuses (not its own, or already released) is left as it is, with a
/// warning.
pub(crate) fn release_lost<A: DeviceAllocator + ?Sized>(allocator: &A, lost: Vec<RawAllocation>) {
    for block in lost {
        let outcome = allocator.release(block);
        if !outcome.is_complete() {
            tracing::warn!(
                allocator = allocator.name(),
                outcome = %outcome.summary(),
                "a lost block handed to forget_lost was not released"
            );
        }
    }
}

#[cfg(all(test, not(miri)))]
mod tests {
    use memory_api::{AllocationRequest, DeviceAllocator, DeviceKey, RawAllocation};

    use crate::SystemAllocator;

    fn live(allocator: &dyn DeviceAllocator) -> (u64, u64) {
        let stats = allocator.stats().expect("these allocators keep counters");
        (stats.live_allocations, stats.live_bytes)
    }

    /// Two blocks of `allocator` lost, one foreign block and one already released
    /// handed to `forget_lost` with them: the lost ones are released, the others
    /// refused (nothing released twice, nothing foreign touched).
    fn releases_only_its_own_live_blocks(allocator: &dyn DeviceAllocator) {
        let request = AllocationRequest::new(3 << 20, 4096).expect("request");
        let (a, b, gone) = (
            allocator.allocate(&request).unwrap(),
            allocator.allocate(&request).unwrap(),
            allocator.allocate(&request).unwrap(),
        );
        let copy = RawAllocation::new(gone.address(), gone.bytes(), gone.align(), gone.device(), gone.provider_tag());
        assert!(allocator.release(gone).is_complete());
        let other = SystemAllocator::for_device(allocator.device());
        let foreign = other.allocate(&request).unwrap();
        let foreign_copy = RawAllocation::new(
            foreign.address(),
            foreign.bytes(),
            foreign.align(),
            foreign.device(),
            foreign.provider_tag(),
        );
        assert_eq!(live(allocator), (2, 6 << 20));
        allocator.forget_lost(vec![a, copy, foreign_copy, b]);
        assert_eq!(live(allocator), (0, 0), "{}: the lost blocks went back", allocator.name());
        assert_eq!(live(&other), (1, 3 << 20), "the foreign block was not touched");
        assert!(other.release(foreign).is_complete());
    }

    #[test]
    fn the_system_allocator_releases_lost_blocks_its_own_and_live_only() {
        releases_only_its_own_live_blocks(&SystemAllocator::for_device(DeviceKey::host(3)));
        releases_only_its_own_live_blocks(&SystemAllocator::for_caches(DeviceKey::host(3)));
    }

    #[cfg(unix)]
    #[test]
    fn the_address_space_allocators_release_lost_reservations() {
        let arena = crate::VirtualHostAllocator::new();
        let reservation = arena.allocate(&AllocationRequest::new(1 << 20, 4096).unwrap()).unwrap();
        let backing = arena.virtual_backing().expect("virtual");
        assert_eq!(backing.commit(&reservation, memory_api::ByteRange::new(0, 64 << 10)).unwrap(), 64 << 10);
        let copy = RawAllocation::new(
            reservation.address(),
            reservation.bytes(),
            reservation.align(),
            reservation.device(),
            reservation.provider_tag(),
        );
        arena.forget_lost(vec![reservation]);
        assert_eq!(live(&arena).0, 0, "the reservation was unmapped");
        assert!(backing.committed_bytes(&copy).is_err(), "and is no longer known");
        releases_only_its_own_live_blocks(&crate::VirtualHostAllocator::new());
        releases_only_its_own_live_blocks(&crate::SharedHostAllocator::new());
    }
}
