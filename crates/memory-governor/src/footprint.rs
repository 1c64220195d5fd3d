//! The footprint: what the process holds on a device (*reserved*: handed out plus what
//! allocator caches keep idle) beside what tenants were charged (*allocated*), and the
//! first rung of the recovery ladder, trimming those caches.
//!
//! # How cached bytes are observed
//! - **Figures are reported.** Every allocator a governed allocator wraps is registered
//!   with its device (weakly: the governor keeps no mechanism alive) and asked for
//!   [`AllocatorStats::cached_bytes`] and [`AllocatorStats::largest_free_bytes`] at cold
//!   points only: snapshots, metrics, refusals and after a cache grew. Never on the hot
//!   path, and never from inside an allocator call (a cache's `stats` may take the lock
//!   it holds while it asks its backing for memory).
//! - **Growth is bounded where it happens.** A cache's own backing allocator is
//!   wrapped by [`Governor::cache_backing`](crate::Governor::cache_backing): every block
//!   a cache takes is counted exactly (`held`) and refused past the device limit, and
//!   each one bumps the device's growth count. A governed allocation that sees the count
//!   move across its inner call checks `allocated + cached` against the limit, outside
//!   every lock, and runs the ladder if it is over (see `allocator.rs`).
//!
//! Why not count every cached byte exactly: the tenant's charge and the cache's take
//! are two different moments (a block cached for reuse is neither charged nor taken), so
//! exact counts would need a charge on every cache hit and every release into the
//! cache: a read-modify-write on the pooled hot path. The pool already knows its idle
//! bytes; the governor asks it when the answer matters.

use std::sync::Weak;

use memory_api::{AllocatorStats, AuthorityIdentity, DeviceAllocator};

use crate::credit::bump_peak;
use crate::sync::{Arc, AtomicU64, Ordering, RwLock, read, write};

/// One allocator a governed allocator wraps, as its device knows it.
struct CacheEntry {
    authority: AuthorityIdentity,
    allocator: Weak<dyn DeviceAllocator>,
}

/// One cache's figures, as it reported them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CacheFigures {
    pub(crate) name: String,
    pub(crate) authority: AuthorityIdentity,
    pub(crate) stats: AllocatorStats,
}

/// What the ladder's first rung did.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Trimmed {
    /// Caches asked to trim.
    pub(crate) caches: u32,
    /// Bytes they said they gave back.
    pub(crate) bytes: u64,
}

/// A device's caches and the figures of its footprint.
pub(crate) struct Caches {
    entries: RwLock<Vec<CacheEntry>>,
    /// Blocks handed out by the device's cache backings, ever: a governed allocation
    /// that sees it move checks the footprint (one relaxed load on the hot path).
    growth: AtomicU64,
    /// Bytes the device's cache backings hold (exact).
    held: AtomicU64,
    held_peak: AtomicU64,
    /// The highest `allocated + cached` observed (at every check, snapshot and refusal).
    reserved_peak: AtomicU64,
    /// Ladder figures: trims asked, bytes they freed, allocations refused over reserved.
    trims: AtomicU64,
    trimmed_bytes: AtomicU64,
    over_reserved: AtomicU64,
}

impl Caches {
    pub(crate) fn new() -> Caches {
        Caches {
            entries: RwLock::new(Vec::new()),
            growth: AtomicU64::new(0),
            held: AtomicU64::new(0),
            held_peak: AtomicU64::new(0),
            reserved_peak: AtomicU64::new(0),
            trims: AtomicU64::new(0),
            trimmed_bytes: AtomicU64::new(0),
            over_reserved: AtomicU64::new(0),
        }
    }

    /// Registers the allocator a governed allocator of `authority` wraps (cold: once
    /// per governed allocator). Entries whose allocator is gone are dropped here.
    pub(crate) fn register(&self, authority: AuthorityIdentity, allocator: &Arc<dyn DeviceAllocator>) {
        let allocator = Arc::downgrade(allocator);
        let mut entries = write(&self.entries);
        entries.retain(|entry| entry.allocator.strong_count() > 0);
        // One cache governed twice is counted (and trimmed) once, for its first tenant.
        if !entries.iter().any(|entry| Weak::ptr_eq(&entry.allocator, &allocator)) {
            entries.push(CacheEntry { authority, allocator });
        }
    }

    /// The growth count (see [`Caches`]).
    #[inline(always)]
    pub(crate) fn growth(&self) -> u64 {
        self.growth.load(Ordering::Relaxed)
    }

    /// Every live cache's figures, asked with no lock held (the list is copied out).
    pub(crate) fn poll(&self) -> Vec<CacheFigures> {
        let live: Vec<(AuthorityIdentity, Arc<dyn DeviceAllocator>)> = read(&self.entries)
            .iter()
            .filter_map(|entry| entry.allocator.upgrade().map(|allocator| (entry.authority, allocator)))
            .collect();
        live.into_iter()
            .filter_map(|(authority, allocator)| {
                let stats = allocator.stats()?;
                Some(CacheFigures { name: allocator.name().to_owned(), authority, stats })
            })
            .collect()
    }

    /// Rung (a) of the ladder: trims the device's caches, the largest idle first, until
    /// `need` bytes came back or every cache with idle bytes was asked (no lock held).
    pub(crate) fn trim_largest_first(&self, need: u64) -> Trimmed {
        let mut idle: Vec<(u64, Arc<dyn DeviceAllocator>)> = read(&self.entries)
            .iter()
            .filter_map(|entry| entry.allocator.upgrade())
            .collect::<Vec<_>>()
            .into_iter()
            .filter_map(|allocator| {
                let cached = allocator.stats()?.cached_bytes;
                (cached > 0).then_some((cached, allocator))
            })
            .collect();
        idle.sort_by_key(|(cached, _)| std::cmp::Reverse(*cached));
        let mut trimmed = Trimmed::default();
        for (_, allocator) in idle {
            if trimmed.bytes >= need {
                break;
            }
            trimmed.caches += 1;
            trimmed.bytes = trimmed.bytes.saturating_add(allocator.trim() as u64);
        }
        self.trims.fetch_add(u64::from(trimmed.caches), Ordering::Relaxed);
        self.trimmed_bytes.fetch_add(trimmed.bytes, Ordering::Relaxed);
        trimmed
    }

    /// Counts bytes a cache backing takes, refusing past `limit` (exact: one
    /// compare-and-swap). The bytes held after, or those held at the refusal.
    pub(crate) fn take(&self, bytes: u64, limit: u64) -> Result<u64, u64> {
        let before = self.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            held.checked_add(bytes).filter(|&after| after <= limit)
        })?;
        let after = before + bytes;
        bump_peak(&self.held_peak, after);
        self.growth.fetch_add(1, Ordering::Relaxed);
        Ok(after)
    }

    /// Bytes a cache backing gave back.
    pub(crate) fn give_back(&self, bytes: u64) {
        self.held.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Records an observed footprint for the peak.
    pub(crate) fn observe(&self, reserved: u64) {
        bump_peak(&self.reserved_peak, reserved);
    }

    pub(crate) fn count_over_reserved(&self) {
        self.over_reserved.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn figures(&self) -> BackingFigures {
        BackingFigures {
            held: self.held.load(Ordering::Acquire),
            held_peak: self.held_peak.load(Ordering::Relaxed),
            reserved_peak: self.reserved_peak.load(Ordering::Relaxed),
            trims: self.trims.load(Ordering::Relaxed),
            trimmed_bytes: self.trimmed_bytes.load(Ordering::Relaxed),
            over_reserved: self.over_reserved.load(Ordering::Relaxed),
        }
    }
}

/// The exact counts a device keeps of its caches.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct BackingFigures {
    pub(crate) held: u64,
    pub(crate) held_peak: u64,
    pub(crate) reserved_peak: u64,
    pub(crate) trims: u64,
    pub(crate) trimmed_bytes: u64,
    pub(crate) over_reserved: u64,
}

/// A footprint summed over caches: idle bytes, and the largest block any of them could
/// hand out without asking its backing.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Idle {
    pub(crate) cached: u64,
    pub(crate) largest_free: u64,
}

impl Idle {
    /// Over `caches`, or over those of one authority.
    pub(crate) fn of<'a>(caches: impl IntoIterator<Item = &'a CacheFigures>) -> Idle {
        caches.into_iter().fold(Idle::default(), |idle, cache| Idle {
            cached: idle.cached.saturating_add(cache.stats.cached_bytes),
            largest_free: idle.largest_free.max(cache.stats.largest_free_bytes),
        })
    }
}

/// `1 - largest free / total free`, in [0, 1]: 0 when the idle bytes are one block
/// (or there are none), near 1 when they are scattered in small pieces.
pub fn fragmentation(cached: u64, largest_free: u64) -> f64 {
    if cached == 0 { 0.0 } else { 1.0 - (largest_free.min(cached) as f64 / cached as f64) }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use memory_api::{AllocError, AllocationRequest, DeviceKey, RawAllocation, ReleaseOutcome};

    use super::*;

    /// A cache that reports `cached` idle bytes and counts the trims asked of it.
    struct Idle {
        cached: u64,
        trims: AtomicUsize,
    }

    impl DeviceAllocator for Idle {
        fn device(&self) -> DeviceKey {
            DeviceKey::HOST
        }
        fn name(&self) -> &str {
            "idle"
        }
        fn allocate(&self, _request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
            unreachable!("the ladder only trims")
        }
        fn release(&self, _allocation: RawAllocation) -> ReleaseOutcome {
            unreachable!("the ladder only trims")
        }
        fn stats(&self) -> Option<AllocatorStats> {
            Some(AllocatorStats { cached_bytes: self.cached, ..AllocatorStats::default() })
        }
        fn trim(&self) -> usize {
            self.trims.fetch_add(1, Ordering::Relaxed);
            self.cached as usize
        }
    }

    fn cache(cached: u64) -> Arc<Idle> {
        Arc::new(Idle { cached, trims: AtomicUsize::new(0) })
    }

    fn authority() -> AuthorityIdentity {
        let registry = memory_binding::BindingRegistry::new();
        registry.register_authority(memory_api::DeviceKey::HOST, std::sync::Arc::new(())).unwrap()
    }

    #[test]
    fn the_ladder_trims_the_largest_idle_cache_first_and_never_one_with_nothing_idle() {
        let caches = Caches::new();
        let who = authority();
        let (empty, small, large) = (cache(0), cache(10), cache(100));
        for allocator in [&empty, &small, &large] {
            let allocator: Arc<dyn DeviceAllocator> = allocator.clone();
            caches.register(who, &allocator);
        }
        let trimmed = caches.trim_largest_first(50);
        assert_eq!(trimmed, Trimmed { caches: 1, bytes: 100 });
        assert_eq!(large.trims.load(Ordering::Relaxed), 1);
        assert_eq!(small.trims.load(Ordering::Relaxed), 0, "the need was met by the largest");
        let trimmed = caches.trim_largest_first(u64::MAX);
        assert_eq!(trimmed, Trimmed { caches: 2, bytes: 110 });
        assert_eq!(empty.trims.load(Ordering::Relaxed), 0, "a cache with nothing idle is not asked");
        assert_eq!(caches.figures().trims, 3);
        assert_eq!(caches.figures().trimmed_bytes, 210);
    }

    #[test]
    fn registering_drops_the_entries_of_allocators_that_are_gone_and_counts_one_cache_once() {
        let caches = Caches::new();
        let who = authority();
        let gone: Arc<dyn DeviceAllocator> = cache(1);
        caches.register(who, &gone);
        drop(gone);
        let kept: Arc<dyn DeviceAllocator> = cache(2);
        caches.register(who, &kept);
        caches.register(who, &kept);
        assert_eq!(read(&caches.entries).len(), 1, "the dead entry was dropped, the live one counted once");
    }
}
