//! [`VirtualHostAllocator`]: reserve host address space, commit pages on demand.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, BackendError, ByteRange, CapabilityError, DeviceAllocator,
    DeviceKey, RawAllocation, ReleaseOutcome, VirtualBacking,
};

use crate::ranges::RangeMap;
use crate::region::{Region, RegionTable, UnmapFailure};
use crate::sys;

/// Committed page runs of one reservation.
type Committed = RangeMap<()>;

/// `VirtualBacking` on the CPU: the twin of CUDA's reserve / map / unmap.
///
/// `allocate` reserves page-rounded, inaccessible address space (`mmap` with
/// `PROT_NONE`), which costs no memory. [`VirtualBacking::commit`] makes page-granular
/// ranges readable and writable (`mprotect`, which is also where the kernel charges
/// the memory against its commit limit), optionally faulting the pages in at once
/// ([`VirtualHostAllocator::populating`]); [`VirtualBacking::decommit`] drops the
/// physical pages (`madvise(MADV_DONTNEED)`) and revokes access again. Committed runs
/// are tracked per reservation, so commit reports only newly committed bytes,
/// decommit only bytes it really released, and release the bytes it unmapped.
///
/// Commit is transactional: if a later run fails, the runs committed by the same call
/// are rolled back. Decommit is not (the contract does not ask for it): on a failure
/// the bytes already released are kept released and the error says how many.
pub struct VirtualHostAllocator {
    table: RegionTable<Committed>,
    populate: bool,
    committed: AtomicU64,
}

impl VirtualHostAllocator {
    /// A virtual allocator for [`DeviceKey::HOST`].
    pub fn new() -> VirtualHostAllocator {
        VirtualHostAllocator::for_device(DeviceKey::HOST)
    }

    /// A virtual allocator whose blocks claim to live on `device` (a simulated,
    /// host-backed device).
    pub fn for_device(device: DeviceKey) -> VirtualHostAllocator {
        VirtualHostAllocator {
            table: RegionTable::new("virtual-host", device),
            populate: false,
            committed: AtomicU64::new(0),
        }
    }

    /// The same allocator, faulting committed pages in during `commit`
    /// (`MADV_POPULATE_WRITE`, Linux 5.14+; ignored where the kernel lacks it), so the
    /// first touch costs nothing and an out-of-memory surfaces at commit.
    #[must_use]
    pub fn populating(mut self) -> VirtualHostAllocator {
        self.populate = true;
        self
    }

    /// Bytes committed across all live reservations.
    pub fn committed_total(&self) -> usize {
        self.committed.load(Ordering::Relaxed) as usize
    }

    /// Makes `[start, end)` pages of `region` accessible (and populated if asked).
    fn commit_run(&self, region: &Region<Committed>, start: usize, end: usize) -> Result<(), sys::SysError> {
        let page = self.table.page;
        let (addr, len) = (region.base + start * page, (end - start) * page);
        // SAFETY: the run lies inside the reservation (checked against the block's size,
        // which is at most the reservation's length), the region is alive (checked
        // under its lock, held by the caller), and the pages are not committed, so no
        // Rust reference can point into them.
        unsafe { sys::protect(addr, len, true) }?;
        if self.populate {
            // SAFETY: the run was just made writable and is ours (as above).
            match unsafe { sys::populate(addr, len) } {
                Err(e) if e.errno == rustix::io::Errno::INVAL => {} // kernel without MADV_POPULATE_WRITE
                Err(e) => {
                    self.uncommit_run(region, start, end).ok();
                    return Err(e);
                }
                Ok(()) => {}
            }
        }
        Ok(())
    }

    /// Drops the pages of `[start, end)` and makes them inaccessible.
    fn uncommit_run(&self, region: &Region<Committed>, start: usize, end: usize) -> Result<(), sys::SysError> {
        let page = self.table.page;
        let (addr, len) = (region.base + start * page, (end - start) * page);
        // SAFETY: the run lies inside the live reservation (see `commit_run`); the
        // contract of `decommit` is that the caller no longer uses these pages, and
        // this crate holds no reference into them.
        unsafe { sys::discard(addr, len) }?;
        // SAFETY: as above.
        unsafe { sys::protect(addr, len, false) }
    }
}

impl Default for VirtualHostAllocator {
    fn default() -> VirtualHostAllocator {
        VirtualHostAllocator::new()
    }
}

impl DeviceAllocator for VirtualHostAllocator {
    fn device(&self) -> DeviceKey {
        self.table.device
    }

    fn name(&self) -> &str {
        self.table.name
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.table.reserve(request, Committed::default())
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let page = self.table.page;
        self.table.release_with(allocation, |region, committed_pages| {
            let committed = committed_pages.total() * page;
            // SAFETY: the reservation is ours and alive (checked under its lock, which
            // `release_with` holds while this runs, so no capability call can race), and
            // by the release contract its owner no longer uses it; after success the
            // region is marked dead and its record dropped.
            if let Err(e) = unsafe { sys::unmap(region.base, region.len) } {
                return Err(UnmapFailure::Nothing(e.backend("releasing a reservation")));
            }
            self.committed.fetch_sub(committed as u64, Ordering::Relaxed);
            tracing::trace!(committed, "virtual-host release");
            Ok(committed)
        })
    }

    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
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

impl VirtualBacking for VirtualHostAllocator {
    fn granularity(&self) -> usize {
        self.table.page
    }

    fn commit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        let region = self.table.find_for_capability(allocation)?;
        let (start, end) = self.table.pages(allocation, range)?;
        let mut state = region.lock();
        if !state.alive {
            return Err(self.table.not_owned(allocation));
        }
        let page = self.table.page;
        let gaps = state.inner.gaps(start, end);
        for (i, &(lo, hi)) in gaps.iter().enumerate() {
            if let Err(error) = self.commit_run(&region, lo, hi) {
                // Roll back the runs this call committed, so a failed commit commits nothing.
                let mut stuck = 0;
                for &(lo, hi) in &gaps[..i] {
                    if self.uncommit_run(&region, lo, hi).is_err() {
                        state.inner.insert(lo, hi, ());
                        stuck += (hi - lo) * page;
                    }
                }
                self.committed.fetch_add(stuck as u64, Ordering::Relaxed);
                let context = format!(
                    "committing {} bytes at offset {} ({stuck} bytes of earlier runs could not be rolled back)",
                    range.len(),
                    range.offset()
                );
                return Err(self.table.capability_error(error, range.len(), &context));
            }
        }
        let mut newly = 0;
        for (lo, hi) in gaps {
            state.inner.insert(lo, hi, ());
            newly += (hi - lo) * page;
        }
        self.committed.fetch_add(newly as u64, Ordering::Relaxed);
        Ok(newly)
    }

    fn decommit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        let region = self.table.find_for_capability(allocation)?;
        let (start, end) = self.table.pages(allocation, range)?;
        let mut state = region.lock();
        if !state.alive {
            return Err(self.table.not_owned(allocation));
        }
        let page = self.table.page;
        let mut released = 0;
        for (lo, hi, ()) in state.inner.covered(start, end) {
            if let Err(error) = self.uncommit_run(&region, lo, hi) {
                self.committed.fetch_sub(released as u64, Ordering::Relaxed);
                let detail = format!(
                    "decommitting {} bytes at offset {}: {released} bytes were released before the failure \
                     and stay released; the rest stays committed",
                    range.len(),
                    range.offset()
                );
                return Err(CapabilityError::Backend(BackendError { detail, ..error.backend("") }));
            }
            state.inner.remove(lo, hi);
            released += (hi - lo) * page;
        }
        self.committed.fetch_sub(released as u64, Ordering::Relaxed);
        Ok(released)
    }

    fn committed_bytes(&self, allocation: &RawAllocation) -> Result<usize, CapabilityError> {
        let region = self.table.find_for_capability(allocation)?;
        let state = region.lock();
        if !state.alive {
            return Err(self.table.not_owned(allocation));
        }
        Ok(state.inner.total() * self.table.page)
    }
}

impl fmt::Debug for VirtualHostAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VirtualHostAllocator")
            .field("device", &self.table.device)
            .field("populate", &self.populate)
            .field("committed", &self.committed_total())
            .field("stats", &self.table.stats())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::{Op, inject};
    use memory_api::{DeviceAddress, MaybeBytes};
    use rustix::io::Errno;

    fn page() -> usize {
        sys::page_size()
    }

    fn reserve(arena: &VirtualHostAllocator, pages: usize) -> RawAllocation {
        arena.allocate(&AllocationRequest::new(pages * page(), page()).unwrap()).unwrap()
    }

    fn range(first: usize, pages: usize) -> ByteRange {
        ByteRange::new(first * page(), pages * page())
    }

    fn at(block: &RawAllocation, page_index: usize) -> DeviceAddress {
        block.address().checked_add(page_index * page()).unwrap()
    }

    fn writable(address: DeviceAddress) -> bool {
        // SAFETY: every address probed here is inside a reservation the test owns.
        unsafe { crate::probe::write(address, &[7]) }.is_ok()
    }

    #[test]
    #[cfg_attr(miri, ignore = "mmap/mprotect/madvise system calls, which Miri does not support")]
    fn a_commit_that_fails_midway_rolls_back_the_runs_it_committed() {
        inject::clear();
        let arena = VirtualHostAllocator::new();
        let block = reserve(&arena, 4);
        assert_eq!(arena.commit(&block, range(1, 1)).unwrap(), page());
        // [0, 4) has two gaps, [0, 1) and [2, 4): the second mprotect fails.
        inject::fail_nth(Op::Protect, 2, Errno::NOMEM);
        let err = arena.commit(&block, range(0, 4)).unwrap_err();
        assert_eq!(err, CapabilityError::OutOfMemory { device: DeviceKey::HOST, requested: 4 * page() });
        assert_eq!(arena.committed_bytes(&block).unwrap(), page(), "only the page committed before stays");
        assert!(!writable(at(&block, 0)), "the rolled-back run must be inaccessible again");
        assert!(writable(at(&block, 1)));
        assert_eq!(arena.committed_total(), page());
        assert_eq!(arena.commit(&block, range(0, 4)).unwrap(), 3 * page(), "a retry commits the rest");
        assert!(arena.release(block).is_complete());
        assert_eq!(arena.committed_total(), 0);
    }

    #[test]
    #[cfg_attr(miri, ignore = "mmap/mprotect/madvise system calls, which Miri does not support")]
    fn a_populate_failure_rolls_back_and_a_kernel_without_populate_is_tolerated() {
        inject::clear();
        let arena = VirtualHostAllocator::new().populating();
        let block = reserve(&arena, 2);
        inject::fail_nth(Op::Populate, 1, Errno::NOMEM);
        assert!(matches!(arena.commit(&block, range(0, 2)), Err(CapabilityError::OutOfMemory { .. })));
        assert_eq!(arena.committed_bytes(&block).unwrap(), 0);
        assert!(!writable(block.address()));
        inject::fail_nth(Op::Populate, 1, Errno::INVAL);
        assert_eq!(arena.commit(&block, range(0, 2)).unwrap(), 2 * page(), "EINVAL means no populate support");
        assert!(writable(block.address()));
        assert!(arena.release(block).is_complete());
    }

    #[test]
    #[cfg_attr(miri, ignore = "mmap/mprotect/madvise system calls, which Miri does not support")]
    fn a_decommit_failure_reports_the_bytes_already_released() {
        inject::clear();
        let arena = VirtualHostAllocator::new();
        let block = reserve(&arena, 4);
        arena.commit(&block, range(0, 1)).unwrap();
        arena.commit(&block, range(2, 1)).unwrap();
        inject::fail_nth(Op::Discard, 2, Errno::AGAIN);
        let err = arena.decommit(&block, range(0, 4)).unwrap_err();
        let CapabilityError::Backend(backend) = &err else { panic!("expected a backend error, got {err}") };
        assert_eq!(backend.code, i64::from(Errno::AGAIN.raw_os_error()));
        assert!(backend.detail.contains(&format!("{} bytes were released", page())), "{err}");
        assert_eq!(arena.committed_bytes(&block).unwrap(), page(), "the failed run stays committed");
        assert!(writable(at(&block, 2)) && !writable(at(&block, 0)));
        assert_eq!(arena.decommit(&block, range(0, 4)).unwrap(), page());
        assert!(arena.release(block).is_complete());
    }

    #[test]
    #[cfg_attr(miri, ignore = "mmap/mprotect/madvise system calls, which Miri does not support")]
    fn a_failed_unmap_hands_the_reservation_back_untouched() {
        inject::clear();
        let arena = VirtualHostAllocator::new();
        let block = reserve(&arena, 2);
        arena.commit(&block, range(0, 1)).unwrap();
        inject::fail_nth(Op::Unmap, 1, Errno::NOMEM);
        let ReleaseOutcome::Failed(failed) = arena.release(block) else { panic!("expected Failed") };
        assert!(failed.error().to_string().contains("munmap"), "{}", failed.error());
        let (block, _) = failed.into_parts();
        assert_eq!(arena.committed_bytes(&block).unwrap(), page(), "nothing was mutated");
        assert!(writable(block.address()));
        let ReleaseOutcome::Complete(done) = arena.release(block) else { panic!("the retry must complete") };
        assert_eq!(done.unmapped_bytes(), page());
        assert_eq!(arena.stats().unwrap().live_allocations, 0);
    }

    #[test]
    #[cfg_attr(miri, ignore = "mmap/mprotect/madvise system calls, which Miri does not support")]
    fn a_refused_reservation_is_a_typed_error_and_counted() {
        inject::clear();
        let arena = VirtualHostAllocator::for_device(DeviceKey::host(2));
        let request = AllocationRequest::new(3 * page(), 64).unwrap();
        inject::fail_nth(Op::Reserve, 1, Errno::NOMEM);
        assert_eq!(
            arena.allocate(&request).unwrap_err(),
            AllocError::OutOfMemory {
                device: DeviceKey::host(2),
                requested: 3 * page(),
                align: 64,
                available: MaybeBytes(None)
            }
        );
        inject::fail_nth(Op::Reserve, 1, Errno::PERM);
        let err = arena.allocate(&request).unwrap_err();
        let AllocError::Backend { source, .. } = &err else { panic!("expected a backend error, got {err}") };
        assert_eq!(source.code, i64::from(Errno::PERM.raw_os_error()));
        assert!(err.to_string().contains("mmap(PROT_NONE)") && err.to_string().contains("host:2"), "{err}");
        assert_eq!(arena.stats().unwrap().failures_total, 2);
        let block = arena.allocate(&request).unwrap();
        assert!(arena.release(block).is_complete());
    }

    #[test]
    #[cfg_attr(miri, ignore = "mmap/mprotect/madvise system calls, which Miri does not support")]
    fn recommitted_pages_read_as_zero_and_reservations_are_lazy() {
        inject::clear();
        let arena = VirtualHostAllocator::new();
        let block = reserve(&arena, 1);
        assert_eq!(arena.stats().unwrap().reserved_bytes, page() as u64);
        arena.commit(&block, range(0, 1)).unwrap();
        // SAFETY: the page is committed and owned by this test.
        unsafe { crate::probe::write(block.address(), &[0xAB; 64]) }.unwrap();
        assert_eq!(arena.decommit(&block, range(0, 1)).unwrap(), page());
        arena.commit(&block, range(0, 1)).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { crate::probe::read(block.address(), 64) }.unwrap(), vec![0; 64]);
        assert!(arena.release(block).is_complete());
    }

    #[test]
    #[cfg_attr(miri, ignore = "mmap/mprotect/madvise system calls, which Miri does not support")]
    fn huge_reservations_far_beyond_memory_cost_nothing_until_committed() {
        inject::clear();
        // 64 GiB of address space on a machine with far less memory: reserving is free.
        let arena = VirtualHostAllocator::new();
        let block = arena.allocate(&AllocationRequest::new(64 << 30, 2 << 20).unwrap()).unwrap();
        assert!(block.address().is_aligned_to(2 << 20));
        let last = ByteRange::new((64 << 30) - page(), page());
        assert_eq!(arena.commit(&block, last).unwrap(), page());
        let ReleaseOutcome::Complete(done) = arena.release(block) else { panic!("release must complete") };
        assert_eq!(done.unmapped_bytes(), page());
    }
}
