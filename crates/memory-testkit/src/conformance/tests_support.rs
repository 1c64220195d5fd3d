//! A bookkeeping model of a reserve/commit + shared-mapping allocator, with simulated
//! memory, and deliberately broken variants of it ("mutants"). The suite's own tests
//! run it over the model (everything must pass) and over each mutant (the check named
//! for that behaviour must fail), so a check that stopped detecting its bug fails.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, ByteRange, CapabilityError, DeviceAddress, DeviceAllocator,
    DeviceKey, MappingAccess, MaybeBytes, RawAllocation, ReleaseError, ReleaseOutcome, SharedBacking,
    SharedBackingResource, SharedMapping, SharedPlacement, VirtualBacking,
};

use crate::access::{AccessError, MemoryAccess};

pub(crate) const PAGE: usize = 4096;

/// A deliberate contract violation.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub(crate) enum Bug {
    #[default]
    None,
    Misaligned,
    Overlapping,
    ZeroSizeShared,
    PanicsOnHugeSize,
    AcceptsForeignRelease,
    StatsMiscount,
    TrimLeavesCache,
    CommitIgnoresBounds,
    CommitCountsTwice,
    ReleaseUnmapsNothing,
    DecommitReportsZero,
    CapabilityIgnoresOwner,
    DecommitKeepsAccess,
    MapNotTransactional,
    AcceptsForeignBacking,
    UnmapMiscounts,
    SharedNotShared,
    ReadOnlyIgnored,
    PerThreadAddresses,
}

enum Page {
    Private(Vec<u8>),
    Shared { store: Arc<Mutex<Vec<u8>>>, offset: usize, read_only: bool },
}

struct Reservation {
    owner: u64,
    bytes: usize,
    align: usize,
    pages: BTreeMap<usize, Page>,
}

struct World {
    next: u64,
    reservations: BTreeMap<u64, Reservation>,
}

static WORLD: Mutex<World> = Mutex::new(World { next: 1 << 40, reservations: BTreeMap::new() });
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static THREAD_NEXT: std::cell::Cell<u64> = const { std::cell::Cell::new(1 << 50) };
}

fn world() -> MutexGuard<'static, World> {
    WORLD.lock().unwrap_or_else(PoisonError::into_inner)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug)]
struct ModelBacking {
    owner: u64,
    store: Arc<Mutex<Vec<u8>>>,
}

impl SharedBackingResource for ModelBacking {
    fn bytes(&self) -> usize {
        lock(&self.store).len()
    }
}

/// The model allocator (named for its granularity-sized pages).
pub(crate) struct PageReserve {
    id: u64,
    bug: Bug,
    live: AtomicU64,
    total: AtomicU64,
    calls: AtomicU64,
}

impl PageReserve {
    pub(crate) fn new() -> PageReserve {
        PageReserve::with_bug(Bug::None)
    }

    pub(crate) fn with_bug(bug: Bug) -> PageReserve {
        PageReserve {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            bug,
            live: AtomicU64::new(0),
            total: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        }
    }

    fn not_owned(&self, allocation: &RawAllocation) -> CapabilityError {
        CapabilityError::NotOwned { allocator: "model".to_owned(), address: allocation.address().get() }
    }

    /// Runs `f` on the reservation behind `allocation`, after checking ownership.
    fn with_reservation<R>(
        &self,
        allocation: &RawAllocation,
        f: impl FnOnce(&mut Reservation) -> Result<R, CapabilityError>,
    ) -> Result<R, CapabilityError> {
        let mut world = world();
        let reservation = world.reservations.get_mut(&allocation.address().get()).filter(|r| {
            self.bug == Bug::CapabilityIgnoresOwner
                || (r.owner == self.id && r.bytes == allocation.bytes() && r.align == allocation.align())
        });
        match reservation {
            Some(reservation) if allocation.device() == DeviceKey::HOST => f(reservation),
            _ => Err(self.not_owned(allocation)),
        }
    }

    fn check_range(&self, reservation: &Reservation, range: ByteRange) -> Result<(), CapabilityError> {
        if self.bug != Bug::CommitIgnoresBounds {
            range.check_within(reservation.bytes)?;
        }
        range.check_aligned(PAGE)
    }
}

fn pages(range: ByteRange) -> std::ops::Range<usize> {
    range.offset() / PAGE..range.offset().saturating_add(range.len()) / PAGE
}

impl DeviceAllocator for PageReserve {
    fn device(&self) -> DeviceKey {
        DeviceKey::HOST
    }

    fn name(&self) -> &str {
        "model"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let calls = self.calls.fetch_add(1, Ordering::Relaxed);
        if request.bytes() > 1 << 40 {
            if self.bug == Bug::PanicsOnHugeSize {
                panic!("model: cannot allocate {} bytes", request.bytes());
            }
            return Err(AllocError::OutOfMemory {
                device: DeviceKey::HOST,
                requested: request.bytes(),
                align: request.align(),
                available: MaybeBytes(None),
            });
        }
        let span = (request.bytes().max(1).next_multiple_of(PAGE) + PAGE) as u64;
        let align = request.align().max(PAGE) as u64;
        let mut world = world();
        let mut start = match self.bug {
            Bug::PerThreadAddresses => THREAD_NEXT.with(|next| {
                let start = next.get().next_multiple_of(align);
                next.set(start + span);
                start
            }),
            _ => {
                let start = world.next.next_multiple_of(align);
                world.next = start + span;
                start
            }
        };
        if self.bug == Bug::Misaligned && request.align() > 8 {
            start += 8;
        }
        if self.bug == Bug::Overlapping && calls % 2 == 1 {
            start = *world.reservations.keys().next_back().unwrap_or(&start);
        }
        if self.bug == Bug::ZeroSizeShared && request.bytes() == 0 {
            start = 1 << 39;
        }
        let reservation =
            Reservation { owner: self.id, bytes: request.bytes(), align: request.align(), pages: BTreeMap::new() };
        world.reservations.entry(start).or_insert(reservation);
        self.live.fetch_add(1, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);
        let address = DeviceAddress::new(start).expect("model addresses are non-zero");
        Ok(RawAllocation::new(address, request.bytes(), request.align(), DeviceKey::HOST, 0))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let mut world = world();
        let key = allocation.address().get();
        let owned = world.reservations.get(&key).is_some_and(|r| {
            self.bug == Bug::AcceptsForeignRelease
                || (r.owner == self.id
                    && r.bytes == allocation.bytes()
                    && r.align == allocation.align()
                    && allocation.device() == DeviceKey::HOST)
        });
        if !owned {
            let error = ReleaseError::NotOwned { allocator: "model".to_owned(), device: DeviceKey::HOST, address: key };
            return ReleaseOutcome::failed(allocation, error);
        }
        let reservation = world.reservations.remove(&key).expect("checked above");
        if self.bug != Bug::StatsMiscount {
            self.live.fetch_sub(1, Ordering::Relaxed);
        }
        let unmapped = if self.bug == Bug::ReleaseUnmapsNothing { 0 } else { reservation.pages.len() * PAGE };
        ReleaseOutcome::complete(unmapped)
    }

    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        Some(self)
    }

    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        Some(self)
    }

    fn stats(&self) -> Option<AllocatorStats> {
        Some(AllocatorStats {
            live_allocations: self.live.load(Ordering::Relaxed),
            allocations_total: self.total.load(Ordering::Relaxed),
            cached_bytes: if self.bug == Bug::TrimLeavesCache { 4096 } else { 0 },
            largest_free_bytes: 0,
            ..AllocatorStats::default()
        })
    }
}

impl VirtualBacking for PageReserve {
    fn granularity(&self) -> usize {
        PAGE
    }

    fn commit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.with_reservation(allocation, |r| {
            self.check_range(r, range)?;
            let mut new = 0;
            for page in pages(range) {
                if let std::collections::btree_map::Entry::Vacant(slot) = r.pages.entry(page) {
                    slot.insert(Page::Private(vec![0; PAGE]));
                    new += PAGE;
                }
            }
            Ok(if self.bug == Bug::CommitCountsTwice { range.len() } else { new })
        })
    }

    fn decommit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.with_reservation(allocation, |r| {
            self.check_range(r, range)?;
            let mut released = 0;
            for page in pages(range) {
                if let Some(Page::Private(_)) = r.pages.get(&page) {
                    if self.bug != Bug::DecommitKeepsAccess {
                        r.pages.remove(&page);
                    }
                    released += PAGE;
                }
            }
            Ok(if self.bug == Bug::DecommitReportsZero { 0 } else { released })
        })
    }

    fn committed_bytes(&self, allocation: &RawAllocation) -> Result<usize, CapabilityError> {
        self.with_reservation(allocation, |r| {
            Ok(r.pages.values().filter(|p| matches!(p, Page::Private(_))).count() * PAGE)
        })
    }
}

impl SharedMapping for PageReserve {
    fn granularity(&self) -> usize {
        PAGE
    }

    fn create_backing(&self, bytes: usize) -> Result<SharedBacking, CapabilityError> {
        ByteRange::new(0, bytes).check_aligned(PAGE)?;
        let resource = ModelBacking { owner: self.id, store: Arc::new(Mutex::new(vec![0; bytes])) };
        Ok(SharedBacking::new(DeviceKey::HOST, Arc::new(resource)))
    }

    fn map(
        &self,
        backing: &SharedBacking,
        allocation: &RawAllocation,
        placement: SharedPlacement,
        access: MappingAccess,
    ) -> Result<(), CapabilityError> {
        let foreign =
            || CapabilityError::ForeignBacking { found: "another allocator".into(), expected: "model".into() };
        let resource = backing.resource::<ModelBacking>().filter(|_| backing.device() == DeviceKey::HOST);
        let resource = resource.filter(|r| r.owner == self.id);
        let Some(resource) = resource else {
            return if self.bug == Bug::AcceptsForeignBacking { Ok(()) } else { Err(foreign()) };
        };
        self.with_reservation(allocation, |r| {
            let target = placement.target;
            target.check_within(r.bytes)?;
            ByteRange::new(placement.backing_offset, target.len()).check_within_backing(backing.bytes())?;
            target.check_aligned(PAGE)?;
            ByteRange::new(placement.backing_offset, target.len()).check_aligned(PAGE)?;
            let taken = pages(target).any(|page| r.pages.contains_key(&page));
            if taken && self.bug != Bug::MapNotTransactional {
                return Err(CapabilityError::AlreadyMapped { offset: target.offset(), len: target.len() });
            }
            for (i, page) in pages(target).enumerate() {
                let store = if self.bug == Bug::SharedNotShared {
                    Arc::new(Mutex::new(lock(&resource.store).clone()))
                } else {
                    Arc::clone(&resource.store)
                };
                let offset = placement.backing_offset + i * PAGE;
                let read_only = access == MappingAccess::ReadOnly && self.bug != Bug::ReadOnlyIgnored;
                r.pages.entry(page).or_insert(Page::Shared { store, offset, read_only });
            }
            if taken {
                return Err(CapabilityError::AlreadyMapped { offset: target.offset(), len: target.len() });
            }
            Ok(())
        })
    }

    fn unmap(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.with_reservation(allocation, |r| {
            range.check_within(r.bytes)?;
            range.check_aligned(PAGE)?;
            let mut unmapped = 0;
            for page in pages(range) {
                if let Some(Page::Shared { .. }) = r.pages.get(&page) {
                    r.pages.remove(&page);
                    unmapped += PAGE;
                }
            }
            Ok(if self.bug == Bug::UnmapMiscounts { range.len() } else { unmapped })
        })
    }
}

/// Reads and writes the model's simulated memory.
pub(crate) struct ModelAccess;

impl ModelAccess {
    fn each_page(
        address: DeviceAddress,
        len: usize,
        mut f: impl FnMut(&mut Page, usize, usize, usize) -> bool,
    ) -> Result<(), AccessError> {
        let fail = |reason: &str| AccessError { address, len, reason: reason.to_owned() };
        let mut world = world();
        let (&start, r) = world.reservations.range_mut(..=address.get()).next_back().ok_or_else(|| fail("unmapped"))?;
        let mut offset = (address.get() - start) as usize;
        let end = offset + len;
        if end > r.bytes.max(1).next_multiple_of(PAGE) {
            return Err(fail("outside the reservation"));
        }
        let mut done = 0;
        while offset < end {
            let in_page = offset % PAGE;
            let chunk = (PAGE - in_page).min(end - offset);
            let page = r.pages.get_mut(&(offset / PAGE)).ok_or_else(|| fail("not committed or mapped"))?;
            if !f(page, in_page, chunk, done) {
                return Err(fail("read-only"));
            }
            offset += chunk;
            done += chunk;
        }
        Ok(())
    }
}

impl MemoryAccess for ModelAccess {
    fn write(&self, address: DeviceAddress, data: &[u8]) -> Result<(), AccessError> {
        // Check every page first so a refused write changes nothing.
        ModelAccess::each_page(address, data.len(), |page, _, _, _| {
            !matches!(page, Page::Shared { read_only: true, .. })
        })?;
        ModelAccess::each_page(address, data.len(), |page, at, len, done| {
            match page {
                Page::Private(bytes) => bytes[at..at + len].copy_from_slice(&data[done..done + len]),
                Page::Shared { store, offset, .. } => {
                    lock(store)[*offset + at..*offset + at + len].copy_from_slice(&data[done..done + len])
                }
            }
            true
        })
    }

    fn read(&self, address: DeviceAddress, len: usize) -> Result<Vec<u8>, AccessError> {
        let mut out = vec![0; len];
        ModelAccess::each_page(address, len, |page, at, n, done| {
            match page {
                Page::Private(bytes) => out[done..done + n].copy_from_slice(&bytes[at..at + n]),
                Page::Shared { store, offset, .. } => {
                    out[done..done + n].copy_from_slice(&lock(store)[*offset + at..*offset + at + n])
                }
            }
            true
        })?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance::{CHECKS, Suite, Verdict};

    fn report(bug: Bug) -> crate::conformance::Report {
        Suite::new(move || PageReserve::with_bug(bug)).with_access(&ModelAccess).run()
    }

    #[test]
    fn the_model_passes_every_check() {
        let report = report(Bug::None);
        report.assert_passed();
        // The model offers every capability and memory access, so nothing is skipped
        // except the plain-memory check (its allocations are reservations).
        assert_eq!(report.skipped().iter().map(|(name, _)| *name).collect::<Vec<_>>(), ["memory_is_writable"]);
        assert_eq!(report.records.len(), CHECKS.len());
    }

    #[test]
    #[cfg_attr(miri, ignore = "two full conformance suites: about 85 s under Miri")]
    fn the_wrappers_forward_every_capability_and_pass_over_the_model() {
        let recorded =
            Suite::new(|| crate::RecordingAllocator::new(PageReserve::new())).with_access(&ModelAccess).run();
        recorded.assert_passed();
        let faulty = Suite::new(|| crate::FaultyAllocator::new(PageReserve::new())).with_access(&ModelAccess).run();
        faulty.assert_passed();
        for report in [recorded, faulty] {
            assert_eq!(report.skipped().len(), 1, "{report}");
        }
    }

    #[test]
    fn every_check_without_memory_access_says_it_was_skipped() {
        let report = Suite::new(PageReserve::new).run();
        report.assert_passed();
        for name in
            ["memory_is_writable", "virtual_memory_access", "shared_visibility_across_mappings", "shared_read_only"]
        {
            let (_, reason) = report.skipped().into_iter().find(|(n, _)| *n == name).expect(name);
            assert!(reason.contains("no MemoryAccess"), "{name}: {reason}");
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "full conformance suite over HostHeap: over 10 minutes under Miri")]
    fn capability_checks_say_they_were_skipped_for_a_plain_allocator() {
        let report = Suite::new(crate::HostHeap::new).with_access(&crate::HostHeap::access()).run();
        report.assert_passed();
        let skipped: Vec<_> = report.skipped().into_iter().map(|(name, _)| name).collect();
        let capability_checks: Vec<_> =
            CHECKS.iter().map(|c| c.name).filter(|n| n.starts_with("virtual_") || n.starts_with("shared_")).collect();
        assert_eq!(skipped, capability_checks);
        assert!(report.ran("memory_is_writable") && report.ran("concurrent_use"));
    }

    /// Each mutant must make the check named for its behaviour fail.
    #[test]
    fn each_broken_behaviour_is_caught_by_its_check() {
        let cases = [
            (Bug::Misaligned, "alignment"),
            (Bug::Overlapping, "distinct_blocks"),
            (Bug::ZeroSizeShared, "zero_size"),
            (Bug::PanicsOnHugeSize, "invalid_layouts"),
            (Bug::AcceptsForeignRelease, "release_refuses_foreign_blocks"),
            (Bug::StatsMiscount, "stats_follow_live_blocks"),
            (Bug::TrimLeavesCache, "trim_keeps_live_blocks"),
            (Bug::CommitIgnoresBounds, "virtual_bounds_and_granularity"),
            (Bug::CommitCountsTwice, "virtual_commit_accounting"),
            (Bug::ReleaseUnmapsNothing, "virtual_commit_accounting"),
            (Bug::DecommitReportsZero, "virtual_decommit_returns_released_bytes"),
            (Bug::CapabilityIgnoresOwner, "virtual_rejects_foreign_allocations"),
            (Bug::DecommitKeepsAccess, "virtual_memory_access"),
            (Bug::CommitCountsTwice, "virtual_concurrent_commit_counts_each_page_once"),
            (Bug::AcceptsForeignBacking, "shared_placement_validation"),
            (Bug::MapNotTransactional, "shared_map_is_transactional"),
            (Bug::UnmapMiscounts, "shared_unmap_accounting"),
            (Bug::SharedNotShared, "shared_visibility_across_mappings"),
            (Bug::ReadOnlyIgnored, "shared_read_only"),
            (Bug::PerThreadAddresses, "concurrent_use"),
        ];
        for (bug, check) in cases {
            let record = Suite::new(move || PageReserve::with_bug(bug))
                .with_access(&ModelAccess)
                .run_check(check)
                .unwrap_or_else(|| panic!("no check named {check}"));
            assert!(
                matches!(record.verdict, Verdict::Failed(_)),
                "{bug:?} was not caught by {check}: {:?}",
                record.verdict
            );
        }
        // Every behavioural check has a mutant.
        for check in CHECKS {
            if check.name != "memory_is_writable" {
                assert!(cases.iter().any(|(_, name)| *name == check.name), "no mutant exercises {}", check.name);
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "full memory_is_writable check over HostHeap: about 100 s under Miri")]
    fn a_plain_allocator_that_corrupts_neighbours_fails_memory_is_writable() {
        // memory_is_writable needs a plain allocator: a heap whose blocks all alias one
        // buffer is simulated by handing every request the same block.
        struct Aliasing(crate::HostHeap, Mutex<Option<(u64, usize)>>);
        impl DeviceAllocator for Aliasing {
            fn device(&self) -> DeviceKey {
                DeviceKey::HOST
            }
            fn name(&self) -> &str {
                "aliasing"
            }
            fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
                let block = self.0.allocate(&AllocationRequest::new(1 << 17, 64).unwrap())?;
                // Leaked on purpose: every block of this allocator aliases the first one.
                let address = block.address();
                let first = *lock(&self.1).get_or_insert((address.get(), 0));
                let address = DeviceAddress::new(first.0).unwrap();
                Ok(RawAllocation::new(address, request.bytes(), request.align(), DeviceKey::HOST, 0))
            }
            fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
                ReleaseOutcome::complete(allocation.bytes())
            }
        }
        let record = Suite::new(|| Aliasing(crate::HostHeap::new(), Mutex::new(None)))
            .with_access(&crate::HostHeap::access())
            .run_check("memory_is_writable")
            .unwrap();
        assert!(matches!(record.verdict, Verdict::Failed(_)), "{:?}", record.verdict);
    }
}
