//! [`SharedHostAllocator`]: one physical backing (a memfd) mapped into several
//! reservations.

use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, BackendError, ByteRange, CapabilityError, DeviceAllocator,
    DeviceKey, MappingAccess, RawAllocation, ReleaseOutcome, SharedBacking, SharedBackingResource, SharedMapping,
    SharedPlacement,
};

use crate::ranges::RangeMap;
use crate::region::{Region, RegionTable, UnmapFailure};
use crate::sys;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The physical backing of a [`SharedHostAllocator`]: an anonymous memory file. The
/// kernel frees it once the last handle is dropped and the last mapping is gone.
#[derive(Debug)]
pub struct HostBacking {
    owner: u64,
    fd: OwnedFd,
    bytes: usize,
}

impl SharedBackingResource for HostBacking {
    fn bytes(&self) -> usize {
        self.bytes
    }
}

#[derive(Default)]
struct SharedState {
    /// Mapped runs, each holding its backing's handle while mapped.
    mapped: RangeMap<SharedBacking>,
    /// Pages a failed `MAP_FIXED` may have left unmapped and that could not be
    /// reserved again: never touched again, not even by release (someone else's
    /// mapping may live there now).
    holes: RangeMap<()>,
}

/// `SharedMapping` on the CPU: the twin of mapping one CUDA physical allocation into
/// several virtual ranges (a shared KV prefix paid for once).
///
/// `allocate` reserves inaccessible address space, like [`crate::VirtualHostAllocator`].
/// [`SharedMapping::create_backing`] makes a memfd; [`SharedMapping::map`] maps a
/// page-aligned part of it over a page-aligned part of a reservation with
/// `MAP_SHARED | MAP_FIXED`, read-only or read-write, so a write through one mapping is
/// visible through all. A map is one system call after every check, so it either maps
/// the whole placement or nothing; an overlap with an existing mapping is refused.
/// [`SharedMapping::unmap`] puts inaccessible reservation back over the range.
pub struct SharedHostAllocator {
    id: u64,
    table: RegionTable<SharedState>,
}

impl SharedHostAllocator {
    /// A shared-mapping allocator for [`DeviceKey::HOST`].
    pub fn new() -> SharedHostAllocator {
        SharedHostAllocator::for_device(DeviceKey::HOST)
    }

    /// A shared-mapping allocator whose blocks claim to live on `device`.
    pub fn for_device(device: DeviceKey) -> SharedHostAllocator {
        SharedHostAllocator {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            table: RegionTable::new("shared-host", device),
        }
    }

    fn backing_of<'b>(&self, backing: &'b SharedBacking) -> Result<&'b HostBacking, CapabilityError> {
        let ours =
            backing.resource::<HostBacking>().filter(|r| r.owner == self.id && backing.device() == self.device());
        ours.ok_or_else(|| CapabilityError::ForeignBacking {
            found: format!("a backing on {} not made by this allocator", backing.device()),
            expected: format!("{} #{} on {}", self.name(), self.id, self.device()),
        })
    }

    /// After a failed `MAP_FIXED` over `[start, end)`, makes sure the range is still
    /// reserved; returns whether the old mapping is still in place.
    fn recover(&self, region: &Region<SharedState>, state: &mut SharedState, start: usize, end: usize) -> bool {
        let page = self.table.page;
        match sys::reserve_no_replace(region.base + start * page, (end - start) * page) {
            Err(e) if e.errno == rustix::io::Errno::EXIST => true,
            Ok(()) => false,
            Err(e) => {
                tracing::warn!(error = %e.backend(""), start, end, "a failed MAP_FIXED left a hole that could not be reserved again");
                state.holes.insert(start, end, ());
                false
            }
        }
    }
}

impl Default for SharedHostAllocator {
    fn default() -> SharedHostAllocator {
        SharedHostAllocator::new()
    }
}

impl DeviceAllocator for SharedHostAllocator {
    fn device(&self) -> DeviceKey {
        self.table.device
    }

    fn name(&self) -> &str {
        self.table.name
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.table.reserve(request, SharedState::default())
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let page = self.table.page;
        let block = allocation.bytes();
        self.table.release_with(allocation, |region, state| {
            let mapped = state.mapped.total() * page;
            // Unmap everything but holes: normally the whole reservation in one call.
            let runs = state.holes.gaps(0, region.len / page);
            let mut unmapped = 0;
            for (i, &(lo, hi)) in runs.iter().enumerate() {
                let run_mapped = state.mapped.covered(lo, hi).iter().map(|(l, h, _)| h - l).sum::<usize>() * page;
                // SAFETY: the run lies inside the live reservation (checked under its
                // lock, which `release_with` holds while this runs); by the release
                // contract its owner no longer uses it; holes are skipped because they
                // may not be ours any more.
                if let Err(e) = unsafe { sys::unmap(region.base + lo * page, (hi - lo) * page) } {
                    let error = e.backend("releasing a shared reservation");
                    if i == 0 {
                        return Err(UnmapFailure::Nothing(error));
                    }
                    // Earlier runs are gone: never touch them again, and say what is left.
                    for &(lo, hi) in &runs[..i] {
                        state.mapped.remove(lo, hi);
                        state.holes.insert(lo, hi, ());
                    }
                    let residual = (mapped - unmapped).min(block);
                    let unmapped = unmapped.min(block - residual);
                    return Err(UnmapFailure::Partly { unmapped, residual, error });
                }
                unmapped += run_mapped;
            }
            *state = SharedState::default();
            Ok(mapped)
        })
    }

    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        Some(self)
    }

    fn stats(&self) -> Option<AllocatorStats> {
        Some(self.table.stats())
    }

    /// Host memory: released here, as nothing else ever frees it (see `lost.rs`).
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        crate::lost::release_lost(self, lost);
    }
}

impl SharedMapping for SharedHostAllocator {
    fn granularity(&self) -> usize {
        self.table.page
    }

    fn create_backing(&self, bytes: usize) -> Result<SharedBacking, CapabilityError> {
        ByteRange::new(0, bytes).check_aligned(self.table.page)?;
        let fd = sys::memfd(bytes)
            .map_err(|e| self.table.capability_error(e, bytes, &format!("creating a {bytes}-byte shared backing")))?;
        Ok(SharedBacking::new(self.device(), Arc::new(HostBacking { owner: self.id, fd, bytes })))
    }

    fn map(
        &self,
        backing: &SharedBacking,
        allocation: &RawAllocation,
        placement: SharedPlacement,
        access: MappingAccess,
    ) -> Result<(), CapabilityError> {
        let resource = self.backing_of(backing)?;
        let region = self.table.find_for_capability(allocation)?;
        let target = placement.target;
        let (start, end) = self.table.pages(allocation, target)?;
        let source = ByteRange::new(placement.backing_offset, target.len());
        source.check_within_backing(resource.bytes)?;
        source.check_aligned(self.table.page)?;
        if start == end {
            return Ok(());
        }
        let mut guard = region.lock();
        if !guard.alive {
            return Err(self.table.not_owned(allocation));
        }
        let state = &mut guard.inner;
        if state.mapped.overlaps(start, end) || state.holes.overlaps(start, end) {
            return Err(CapabilityError::AlreadyMapped { offset: target.offset(), len: target.len() });
        }
        let page = self.table.page;
        let writable = access == MappingAccess::ReadWrite;
        let (addr, len) = (region.base + start * page, target.len());
        // SAFETY: the target lies inside the live reservation (bounds checked against
        // the block, liveness under the region lock held here) and no part of it is
        // mapped, so it is inaccessible reservation that no Rust reference can point
        // into; MAP_FIXED replaces exactly that range.
        let mapped = unsafe { sys::map_shared(addr, len, &resource.fd, placement.backing_offset as u64, writable) };
        if let Err(e) = mapped {
            self.recover(&region, state, start, end);
            let context = format!("mapping {len} bytes of a shared backing at offset {}", target.offset());
            return Err(self.table.capability_error(e, len, &context));
        }
        state.mapped.insert(start, end, backing.clone());
        tracing::trace!(offset = target.offset(), len, writable, "shared-host map");
        Ok(())
    }

    fn unmap(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        let region = self.table.find_for_capability(allocation)?;
        let (start, end) = self.table.pages(allocation, range)?;
        let mut guard = region.lock();
        if !guard.alive {
            return Err(self.table.not_owned(allocation));
        }
        let page = self.table.page;
        let state = &mut guard.inner;
        let mut unmapped = 0;
        for (lo, hi, _) in state.mapped.covered(start, end) {
            let (addr, len) = (region.base + lo * page, (hi - lo) * page);
            // SAFETY: the run lies inside the live reservation and is one of our shared
            // mappings; by the unmap contract its owner no longer uses it. MAP_FIXED
            // replaces exactly that range with inaccessible reservation.
            let replaced = unsafe { sys::reserve_fixed(addr, len) };
            // After a failure the mapping is either still in place (report it) or gone
            // (re-reserved, or a recorded hole), which is what was asked.
            if let Err(e) = replaced
                && self.recover(&region, state, lo, hi)
            {
                let detail = format!(
                    "unmapping {} bytes at offset {}: {unmapped} bytes were unmapped before the failure",
                    range.len(),
                    range.offset()
                );
                return Err(CapabilityError::Backend(BackendError { detail, ..e.backend("") }));
            }
            state.mapped.remove(lo, hi);
            unmapped += len;
        }
        Ok(unmapped)
    }
}

impl fmt::Debug for SharedHostAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedHostAllocator")
            .field("id", &self.id)
            .field("device", &self.table.device)
            .field("stats", &self.table.stats())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::{Op, inject};
    use memory_api::DeviceAddress;
    use rustix::io::Errno;

    fn page() -> usize {
        sys::page_size()
    }

    fn reserve(shared: &SharedHostAllocator, pages: usize) -> RawAllocation {
        shared.allocate(&AllocationRequest::new(pages * page(), page()).unwrap()).unwrap()
    }

    fn place(first: usize, pages: usize, backing_page: usize) -> SharedPlacement {
        SharedPlacement {
            target: ByteRange::new(first * page(), pages * page()),
            backing_offset: backing_page * page(),
        }
    }

    fn at(block: &RawAllocation, page_index: usize) -> DeviceAddress {
        block.address().checked_add(page_index * page()).unwrap()
    }

    fn readable(address: DeviceAddress) -> bool {
        // SAFETY: every address probed here is inside a reservation the test owns.
        unsafe { crate::probe::read(address, 1) }.is_ok()
    }

    const RW: MappingAccess = MappingAccess::ReadWrite;

    #[test]
    #[cfg_attr(miri, ignore = "memfd_create and mmap(MAP_SHARED) system calls, which Miri does not support")]
    fn a_failed_map_leaves_nothing_mapped_and_the_range_usable() {
        inject::clear();
        let shared = SharedHostAllocator::new();
        let backing = shared.create_backing(2 * page()).unwrap();
        let block = reserve(&shared, 2);
        inject::fail_nth(Op::MapShared, 1, Errno::NOMEM);
        let err = shared.map(&backing, &block, place(0, 2, 0), RW).unwrap_err();
        assert_eq!(err, CapabilityError::OutOfMemory { device: DeviceKey::HOST, requested: 2 * page() });
        assert_eq!(shared.unmap(&block, ByteRange::new(0, 2 * page())).unwrap(), 0);
        assert!(!readable(block.address()));
        shared.map(&backing, &block, place(0, 2, 0), RW).unwrap();
        assert!(readable(block.address()));
        assert!(shared.release(block).is_complete());
    }

    /// Simulates an old kernel whose failed MAP_FIXED left a hole that could not be
    /// reserved again: the range is never touched again, and a release that then fails
    /// after unmapping part of the reservation reports exactly what is left.
    #[test]
    #[cfg_attr(miri, ignore = "memfd_create and mmap(MAP_SHARED) system calls, which Miri does not support")]
    fn holes_are_never_touched_and_a_partial_release_is_quarantined_with_exact_bytes() {
        inject::clear();
        let shared = SharedHostAllocator::new();
        let backing = shared.create_backing(4 * page()).unwrap();
        let block = reserve(&shared, 4);
        inject::fail_nth(Op::MapShared, 1, Errno::NOMEM);
        inject::fail_nth(Op::ReserveNoReplace, 1, Errno::NOMEM);
        assert!(shared.map(&backing, &block, place(1, 1, 0), RW).is_err());
        assert!(matches!(shared.map(&backing, &block, place(1, 1, 0), RW), Err(CapabilityError::AlreadyMapped { .. })));
        shared.map(&backing, &block, place(0, 1, 0), RW).unwrap();
        shared.map(&backing, &block, place(3, 1, 3), RW).unwrap();
        // Release unmaps [0, 1) and then [2, 4) around the hole; the second munmap fails.
        inject::fail_nth(Op::Unmap, 2, Errno::NOMEM);
        let ReleaseOutcome::Quarantined(quarantine) = shared.release(block) else { panic!("expected a quarantine") };
        assert_eq!((quarantine.unmapped_bytes(), quarantine.residual_bytes()), (page(), page()));
        assert!(!quarantine.was_corrected());
        let (block, _) = quarantine.into_parts();
        assert!(readable(at(&block, 3)), "the run that failed to unmap is still mapped");
        let ReleaseOutcome::Complete(done) = shared.release(block) else { panic!("the retry must complete") };
        assert_eq!(done.unmapped_bytes(), page());
        assert_eq!(shared.stats().unwrap().live_allocations, 0);
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfd_create and mmap(MAP_SHARED) system calls, which Miri does not support")]
    fn a_failed_unmap_keeps_the_mapping_and_says_what_was_unmapped() {
        inject::clear();
        let shared = SharedHostAllocator::new();
        let backing = shared.create_backing(2 * page()).unwrap();
        let block = reserve(&shared, 2);
        shared.map(&backing, &block, place(0, 1, 0), RW).unwrap();
        shared.map(&backing, &block, place(1, 1, 1), RW).unwrap();
        inject::fail_nth(Op::ReserveFixed, 2, Errno::NOMEM);
        let err = shared.unmap(&block, ByteRange::new(0, 2 * page())).unwrap_err();
        assert!(err.to_string().contains(&format!("{} bytes were unmapped", page())), "{err}");
        assert!(!readable(at(&block, 0)) && readable(at(&block, 1)));
        assert_eq!(shared.unmap(&block, ByteRange::new(0, 2 * page())).unwrap(), page());
        assert!(shared.release(block).is_complete());
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfd_create and mmap(MAP_SHARED) system calls, which Miri does not support")]
    fn backing_creation_failures_are_typed() {
        inject::clear();
        let shared = SharedHostAllocator::new();
        inject::fail_nth(Op::Memfd, 1, Errno::MFILE);
        let err = shared.create_backing(page()).unwrap_err();
        let CapabilityError::Backend(backend) = &err else { panic!("expected a backend error, got {err}") };
        assert_eq!((backend.operation, backend.code), ("memfd_create", i64::from(Errno::MFILE.raw_os_error())));
        inject::fail_nth(Op::Truncate, 1, Errno::NOMEM);
        assert!(matches!(shared.create_backing(page()), Err(CapabilityError::OutOfMemory { .. })));
        assert!(matches!(shared.create_backing(page() + 1), Err(CapabilityError::Misaligned { .. })));
        assert_eq!(shared.create_backing(0).unwrap().bytes(), 0);
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfd_create and mmap(MAP_SHARED) system calls, which Miri does not support")]
    fn a_backing_of_another_instance_is_foreign_and_empty_placements_map_nothing() {
        inject::clear();
        let (ours, theirs) = (SharedHostAllocator::new(), SharedHostAllocator::new());
        let foreign = theirs.create_backing(page()).unwrap();
        let block = reserve(&ours, 1);
        let err = ours.map(&foreign, &block, place(0, 1, 0), RW).unwrap_err();
        assert!(matches!(err, CapabilityError::ForeignBacking { .. }), "{err}");
        assert!(err.to_string().contains("create the backing with the same allocator"), "{err}");
        let backing = ours.create_backing(page()).unwrap();
        ours.map(&backing, &block, place(1, 0, 0), RW).unwrap();
        assert_eq!(ours.unmap(&block, ByteRange::new(0, page())).unwrap(), 0);
        assert!(ours.release(block).is_complete());
    }
}
