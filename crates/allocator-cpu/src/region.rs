//! Reservations of host address space, shared by the virtual and shared-mapping
//! allocators: reserving, finding a reservation from a block, and the per-shard
//! bookkeeping that validates every block presented to a capability or a release.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, BackendError, CapabilityError, DeviceAddress, DeviceKey, MaybeBytes,
    RawAllocation, ReleaseError, ReleaseOutcome,
};

use crate::sys;
use crate::table::{Shards, Slab, TAGGED_SLOTS, tag, tag_generation, untag};

/// One reservation: `[base, base + len)`, page-aligned, of which the caller asked for
/// `bytes`. The mutable state sits behind the region's own lock, so capability calls on
/// different allocations never contend.
pub(crate) struct Region<S> {
    pub(crate) base: usize,
    pub(crate) len: usize,
    pub(crate) bytes: usize,
    pub(crate) align: usize,
    /// Its generation in its shard (the part a tag carries): a stale tag naming the
    /// same slot names another generation.
    generation: u64,
    state: Mutex<RegionState<S>>,
}

pub(crate) struct RegionState<S> {
    /// False once the reservation has been unmapped; every operation checks it under
    /// this lock before touching the range.
    pub(crate) alive: bool,
    pub(crate) inner: S,
}

impl<S> Region<S> {
    pub(crate) fn lock(&self) -> MutexGuard<'_, RegionState<S>> {
        // Every critical section leaves the state consistent before any call that can
        // panic, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

struct Shard<S> {
    regions: Slab<Arc<Region<S>>>,
    live_bytes: u64,
    reserved_bytes: u64,
    allocations_total: u64,
    failures_total: u64,
    /// Reservations recorded in this shard, ever: the generation of the next is one more.
    generations: u64,
}

impl<S> Default for Shard<S> {
    fn default() -> Shard<S> {
        Shard {
            regions: Slab::default(),
            live_bytes: 0,
            reserved_bytes: 0,
            allocations_total: 0,
            failures_total: 0,
            generations: 0,
        }
    }
}

/// Why [`RegionTable::release_with`]'s `unmap` could not give a reservation back.
pub(crate) enum UnmapFailure {
    /// Nothing was unmapped: the block is handed back whole.
    Nothing(BackendError),
    /// Part of the reservation is gone for good and `residual` bytes may still be
    /// mapped: the block is quarantined.
    Partly { unmapped: usize, residual: usize, error: BackendError },
}

/// The reservations of one allocator.
pub(crate) struct RegionTable<S> {
    pub(crate) name: &'static str,
    pub(crate) device: DeviceKey,
    pub(crate) page: usize,
    shards: Shards<Shard<S>>,
}

impl<S> RegionTable<S> {
    pub(crate) fn new(name: &'static str, device: DeviceKey) -> RegionTable<S> {
        RegionTable { name, device, page: sys::page_size(), shards: Shards::new(Shards::<()>::default_count()) }
    }

    /// Reserves address space for `request` (at least one page, so a zero-byte block
    /// is unique) and records it.
    pub(crate) fn reserve(&self, request: &AllocationRequest, inner: S) -> Result<RawAllocation, AllocError> {
        let (bytes, align) = (request.bytes(), request.align());
        let home = self.shards.local();
        let fail = |error: AllocError| {
            if let Some(mut shard) = self.shards.lock(home) {
                shard.failures_total += 1;
            }
            Err(error)
        };
        let out_of_memory =
            AllocError::OutOfMemory { device: self.device, requested: bytes, align, available: MaybeBytes(None) };
        let Some(len) = bytes.max(1).checked_next_multiple_of(self.page) else { return fail(out_of_memory) };
        let base = match sys::reserve(len, align) {
            Ok(base) => base,
            Err(e) if e.is_out_of_memory() => return fail(out_of_memory),
            Err(e) => {
                let source = e.backend(&format!("reserving {len} bytes aligned to {align}"));
                return fail(AllocError::Backend { device: self.device, source });
            }
        };
        let Some(mut shard) = self.shards.lock(home) else { unreachable!("the local shard exists") };
        shard.generations += 1;
        let generation = tag_generation(shard.generations);
        let state = Mutex::new(RegionState { alive: true, inner });
        let slot = shard.regions.insert(Arc::new(Region { base, len, bytes, align, generation, state }));
        if slot >= TAGGED_SLOTS {
            shard.regions.remove(slot);
            shard.failures_total += 1;
            drop(shard);
            // SAFETY: `[base, base + len)` is the reservation made just above, never
            // handed out (its record was just removed), so nothing refers to it.
            if unsafe { sys::unmap(base, len) }.is_err() {
                tracing::warn!(len, allocator = self.name, "an unrecorded reservation could not be unmapped");
            }
            let detail = format!(
                "this thread's shard holds {TAGGED_SLOTS} reservations of this allocator, the most a provider tag \
                 names; the {bytes}-byte request was refused: release some reservations first"
            );
            let source = BackendError { backend: "os", operation: "reserve", code: 0, detail };
            return Err(AllocError::Backend { device: self.device, source });
        }
        shard.live_bytes += bytes as u64;
        shard.reserved_bytes += len as u64;
        shard.allocations_total += 1;
        drop(shard);
        let address = DeviceAddress::new(base as u64).expect("mmap never returns null");
        tracing::trace!(bytes, len, %address, allocator = self.name, "reserved");
        Ok(RawAllocation::new(address, bytes, align, self.device, tag(home, slot, generation)))
    }

    /// The live region behind `allocation`, if it is exactly one of ours.
    pub(crate) fn find(&self, allocation: &RawAllocation) -> Option<Arc<Region<S>>> {
        if allocation.device() != self.device {
            return None;
        }
        let (index, slot, generation) = untag(allocation.provider_tag());
        let shard = self.shards.lock(index)?;
        let region = shard.regions.get(slot)?;
        let matches = region.generation == generation
            && region.base as u64 == allocation.address().get()
            && region.bytes == allocation.bytes()
            && region.align == allocation.align();
        matches.then(|| Arc::clone(region))
    }

    /// Like [`RegionTable::find`], as a capability error.
    pub(crate) fn find_for_capability(&self, allocation: &RawAllocation) -> Result<Arc<Region<S>>, CapabilityError> {
        self.find(allocation).ok_or_else(|| self.not_owned(allocation))
    }

    pub(crate) fn not_owned(&self, allocation: &RawAllocation) -> CapabilityError {
        CapabilityError::NotOwned { allocator: self.name.to_owned(), address: allocation.address().get() }
    }

    /// Refuses a release, handing the block back.
    pub(crate) fn refuse(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let error = ReleaseError::NotOwned {
            allocator: self.name.to_owned(),
            device: self.device,
            address: allocation.address().get(),
        };
        ReleaseOutcome::failed(allocation, error)
    }

    /// A release that failed before anything was unmapped.
    pub(crate) fn failed(&self, allocation: RawAllocation, error: BackendError) -> ReleaseOutcome {
        ReleaseOutcome::failed(allocation, ReleaseError::Backend(error))
    }

    /// The release protocol both reservation allocators share. Finds the live region
    /// behind `allocation` (a block that is not exactly one of ours is refused and handed
    /// back) and runs `unmap` on it under the region's lock. When `unmap` returns the
    /// bytes it gave back, the region is marked dead, its record dropped, and the answer
    /// is `Complete` for at most the block's bytes (page rounding beyond the block is
    /// this allocator's own business, and the registry flags a larger claim as
    /// dishonest). When it fails, the region stays as `unmap` left it and the failure
    /// becomes the answer.
    pub(crate) fn release_with(
        &self,
        allocation: RawAllocation,
        unmap: impl FnOnce(&Region<S>, &mut S) -> Result<usize, UnmapFailure>,
    ) -> ReleaseOutcome {
        let Some(region) = self.find(&allocation) else { return self.refuse(allocation) };
        let mut state = region.lock();
        if !state.alive {
            drop(state);
            return self.refuse(allocation);
        }
        let freed = unmap(&region, &mut state.inner);
        if freed.is_ok() {
            state.alive = false;
        }
        drop(state);
        match freed {
            Ok(bytes) => {
                self.forget(&allocation, &region);
                ReleaseOutcome::complete(bytes.min(allocation.bytes()))
            }
            Err(UnmapFailure::Nothing(error)) => self.failed(allocation, error),
            Err(UnmapFailure::Partly { unmapped, residual, error }) => {
                tracing::warn!(%error, unmapped, residual, allocator = self.name, "release quarantined");
                ReleaseOutcome::quarantined(allocation, unmapped, residual, ReleaseError::Backend(error))
            }
        }
    }

    /// Drops the record of a region whose address space is gone.
    fn forget(&self, allocation: &RawAllocation, region: &Region<S>) {
        let (index, slot, _) = untag(allocation.provider_tag());
        if let Some(mut shard) = self.shards.lock(index) {
            shard.regions.remove(slot);
            shard.live_bytes -= region.bytes as u64;
            shard.reserved_bytes -= region.len as u64;
        }
    }

    /// Live counts over all shards.
    pub(crate) fn stats(&self) -> AllocatorStats {
        let mut stats = AllocatorStats::default();
        for index in 0..self.shards.len() {
            let Some(shard) = self.shards.lock(index) else { continue };
            stats.live_bytes += shard.live_bytes;
            stats.live_allocations += shard.regions.len() as u64;
            stats.reserved_bytes += shard.reserved_bytes;
            stats.allocations_total += shard.allocations_total;
            stats.failures_total += shard.failures_total;
        }
        stats
    }

    /// Maps a failed system call in a capability call to the contract's error.
    pub(crate) fn capability_error(&self, error: sys::SysError, requested: usize, context: &str) -> CapabilityError {
        if error.is_out_of_memory() {
            CapabilityError::OutOfMemory { device: self.device, requested }
        } else {
            CapabilityError::Backend(error.backend(context))
        }
    }

    /// The page range `[start, end)` of `range`, after checking bounds and granularity
    /// against the block.
    pub(crate) fn pages(
        &self,
        allocation: &RawAllocation,
        range: memory_api::ByteRange,
    ) -> Result<(usize, usize), CapabilityError> {
        range.check_within(allocation.bytes())?;
        range.check_aligned(self.page)?;
        Ok((range.offset() / self.page, (range.offset() + range.len()) / self.page))
    }
}

impl<S> Drop for RegionTable<S> {
    fn drop(&mut self) {
        // Reservations still live are leaked (their address space stays mapped): whoever
        // holds them may still use the memory.
        let live = self.stats().live_allocations;
        if live > 0 {
            tracing::warn!(live, allocator = self.name, "allocator dropped with live reservations; leaking them");
        }
    }
}

#[cfg(test)]
mod tests {
    use memory_api::{AllocationRequest, ByteRange, DeviceAllocator, RawAllocation, ReleaseError, ReleaseOutcome};

    use crate::{SharedHostAllocator, VirtualHostAllocator};

    fn copy(block: &RawAllocation) -> RawAllocation {
        RawAllocation::new(block.address(), block.bytes(), block.align(), block.device(), block.provider_tag())
    }

    /// A stale copy of a released reservation, presented once a new reservation of the
    /// same size took its address (the kernel hands a freed range out again at once) and
    /// its slot, is refused and leaves the new reservation live.
    fn a_stale_copy_is_refused_when_its_address_and_slot_are_reused(allocator: &dyn DeviceAllocator) {
        let name = allocator.name();
        let request = AllocationRequest::new(1 << 20, 4096).unwrap();
        let first = allocator.allocate(&request).unwrap();
        let stale = copy(&first);
        assert!(allocator.release(first).is_complete());
        // The same address again (at once on Linux; a few tries elsewhere).
        let mut others = Vec::new();
        let reused = loop {
            let block = allocator.allocate(&request).unwrap();
            if block.address() == stale.address() || others.len() == 8 {
                break block;
            }
            others.push(block);
        };
        // On Linux the next reservation takes both the address and the slot, the case the
        // generation tells apart; a later try would sit in another slot and prove nothing.
        if cfg!(target_os = "linux") {
            assert!(
                others.is_empty() && reused.address() == stale.address(),
                "{name}: the address was not reused at once"
            );
        }
        let ReleaseOutcome::Failed(failed) = allocator.release(stale) else {
            panic!("{name}: a stale copy of a released reservation released the live one at its address")
        };
        assert!(matches!(failed.error(), ReleaseError::NotOwned { .. }), "{name}: {}", failed.error());
        let live = allocator.stats().unwrap().live_allocations;
        assert_eq!(live, 1 + others.len() as u64, "{name}: the reused reservation is still live");
        if let Some(vb) = allocator.virtual_backing() {
            assert_eq!(vb.commit(&reused, ByteRange::new(0, 4096)), Ok(4096), "{name}: and still usable");
        }
        for block in others.into_iter().chain([reused]) {
            assert!(allocator.release(block).is_complete(), "{name}");
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "mmap system calls, which Miri does not support")]
    fn a_stale_copy_of_a_released_reservation_never_releases_its_successor() {
        a_stale_copy_is_refused_when_its_address_and_slot_are_reused(&VirtualHostAllocator::new());
        a_stale_copy_is_refused_when_its_address_and_slot_are_reused(&SharedHostAllocator::new());
    }
}
