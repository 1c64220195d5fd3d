//! The pool's counters: each thread's class cache (written by that thread alone) and the
//! segment cache keep their own, summed on demand into a [`PoolStats`].

use memory_api::{AllocationRequest, DeviceAllocator};

use super::PooledAllocator;

/// Counters of a [`PooledAllocator`], summed over its threads' class caches and its segments.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes callers asked for, over all successful allocations.
    pub requested_bytes: u64,
    /// Allocations served from the cache.
    pub hits: u64,
    /// Allocations that went to the inner allocator.
    pub misses: u64,
    /// Allocations that failed.
    pub failures: u64,
    /// Bytes currently cached: free class blocks and free pieces of segments.
    pub cached_bytes: u64,
    /// Blocks currently cached (free class blocks and free pieces).
    pub cached_blocks: u64,
    /// The largest of them: the largest request the pool could serve without asking
    /// the inner allocator (a free piece serves any large request up to its size; a
    /// class block only requests of its class).
    pub largest_free_bytes: u64,
    /// Bytes handed out to callers now.
    pub live_bytes: u64,
    /// Blocks handed out to callers now.
    pub live_blocks: u64,
    /// Releases that went to the inner allocator because the cache was full or the
    /// block is not cacheable.
    pub passed_through: u64,
    /// Calls of `trim`.
    pub trims: u64,
    /// Bytes `trim` returned to the inner allocator.
    pub trimmed_bytes: u64,
    /// Cached blocks or segments the inner allocator quarantined during a trim or an
    /// eviction (retried next trim).
    pub quarantined_blocks: u64,
    /// Inner blocks held to serve large requests (segments), in use or free.
    pub segments: u64,
    /// Their bytes.
    pub segment_bytes: u64,
    /// Wholly free segments given back to the inner allocator without a `trim`: past
    /// the cap, outgrown by a larger request, or idle for long.
    pub evicted_segments: u64,
    /// Their bytes.
    pub evicted_bytes: u64,
    /// Of them, those given back on a miss for a larger request (none could serve it).
    pub outgrown_segments: u64,
    /// Of them, those given back after staying wholly free through 1024 large
    /// allocations in a row.
    pub aged_segments: u64,
}

impl PoolStats {
    pub(super) fn add_counters(&mut self, c: &PoolStats) {
        self.requested_bytes += c.requested_bytes;
        self.hits += c.hits;
        self.misses += c.misses;
        self.failures += c.failures;
        self.live_bytes += c.live_bytes;
        self.live_blocks += c.live_blocks;
        self.passed_through += c.passed_through;
        self.trims += c.trims;
        self.trimmed_bytes += c.trimmed_bytes;
        self.evicted_segments += c.evicted_segments;
        self.evicted_bytes += c.evicted_bytes;
        self.outgrown_segments += c.outgrown_segments;
        self.aged_segments += c.aged_segments;
    }

    pub(super) fn served(&mut self, request: &AllocationRequest, hit: bool) {
        if hit {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        self.requested_bytes += request.bytes() as u64;
        self.live_bytes += request.bytes() as u64;
        self.live_blocks += 1;
    }
}

impl<A: DeviceAllocator> PooledAllocator<A> {
    /// Pool counters, summed over the threads' class caches and the segments.
    pub fn pool_stats(&self) -> PoolStats {
        let mut total = PoolStats::default();
        for cache in self.caches.iter() {
            cache.count_into(&mut total);
        }
        self.segments().count_into(&mut total);
        total
    }
}
