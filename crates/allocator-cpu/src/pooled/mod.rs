//! [`PooledAllocator`]: a caching allocator over any [`DeviceAllocator`].
//!
//! Two caches:
//! - **size classes** for requests up to [`PoolConfig::max_class_bytes`]: whole inner
//!   blocks, four classes per doubling, kept in per-thread caches so that a warm pair on
//!   one thread takes no lock and makes no read-modify-write but the record table's one
//!   take;
//! - **segments** for larger requests: inner blocks carved best-fit into pieces, split
//!   when the rest could serve another large request, and merged with free neighbours
//!   when a piece comes back (as a BFC arena or PyTorch's large pool do). Memory one
//!   run of a model freed serves the next run's differently sized buffers instead of
//!   going back to the system and being faulted in again. Segments sit behind one
//!   lock: a request that large costs far more than the lock, and any thread's free
//!   segment memory serves every thread.
//!
//! Idle memory goes back to the inner allocator without a caller's `trim`: on a miss,
//! the wholly free segments too small for it (a workload whose sizes grow keeps no
//! smaller generation of its buffers); past the cap, wholly free segments least
//! recently idle first, down to three quarters of the cap, the block just released
//! last (it is the likeliest to be asked for again: a runtime's next request of the
//! same shape); and segments that stayed wholly free through 1024 large allocations.
//! The pool never calls the inner allocator, nor `stats` or `trim` on itself, with one
//! of its locks held, so an inner allocator may be slow, refuse (a governor's cache
//! backing at the device limit answers `AdmissionRefused`, handed back as it is), or
//! call into the pool's `stats` and `trim` while it runs.
//!
//! Every block handed out, from either cache, has a record in `memory_sync`'s record
//! table, and its provider tag is the record's tag: a release takes the record (one
//! compare-and-swap, refusing a foreign, forged, stale or repeated block before anything
//! is touched), and the record says which cache holds the block.
//!
//! The module is laid out by cache: `classes` holds the size classes (per-thread
//! caches of whole blocks), `segments` the segment cache (large blocks carved into
//! pieces, behind one lock), `records` the record's layout, `stats` the counters both keep; this file holds the
//! allocator itself, its settings, and the `DeviceAllocator` impl that routes each
//! request and release to its cache (the size classes' allocation path is written out
//! in `allocate`: see the comment there).

mod classes;
mod records;
mod segments;
mod stats;
#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;
use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, BackendError, DeviceAllocator, DeviceKey, RawAllocation,
    ReleaseError, ReleaseOutcome,
};
use memory_sync::per_thread::{PerThread, thread_index};
use memory_sync::records::RecordTable;

use classes::{NO_CLASS, ThreadCache, class_align, class_of};
use records::{Held, LiveCells};
use segments::{LARGE_ROUND, Segments};
pub use stats::PoolStats;

/// Settings of a [`PooledAllocator`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Bytes of freed memory the pool may keep for reuse. It bounds the size-class
    /// caches (split evenly into [`PoolConfig::shards`] shares) and, separately, the free memory of
    /// segments (pool-wide, so one large block of up to this size stays cached
    /// whichever thread frees it). Past it, wholly free segments go back down to three
    /// quarters of it. Under a governor, whose device limit bounds what the process
    /// holds (`reserved` = handed out + cached), derive it from that limit with
    /// [`PoolConfig::for_device_limit`].
    pub max_cached_bytes: usize,
    /// Requests up to this size use size classes; larger ones are carved from segments.
    pub max_class_bytes: usize,
    /// Shares of the size classes' cache (rounded up to a power of two): each thread
    /// caches its own class blocks, at most `max_cached_bytes / shards` bytes of them,
    /// and at most this many threads hold a share at once (the first to allocate a
    /// class block; the class blocks of a thread that got none are not cached), so the
    /// class caches together stay within [`PoolConfig::max_cached_bytes`].
    pub shards: usize,
}

/// [`PoolConfig::max_cached_bytes`] by default: 256 MiB.
const DEFAULT_MAX_CACHED: usize = 256 << 20;
/// [`PoolConfig::max_class_bytes`] by default: 64 KiB. Whole blocks per class serve
/// only their class, so the classes stop where sizes vary enough for one class's idle
/// blocks to be useless to the next request: above this, pieces of segments serve any
/// size. (Replaying ONNX Runtime's requests over a sweep of input shapes, classes up to
/// 1 MiB held 1.5-3.9x the peak of live bytes, up to 64 KiB 1.0-1.3x.)
const DEFAULT_MAX_CLASS: usize = 64 << 10;

impl Default for PoolConfig {
    fn default() -> PoolConfig {
        PoolConfig {
            max_cached_bytes: DEFAULT_MAX_CACHED,
            max_class_bytes: DEFAULT_MAX_CLASS,
            shards: std::thread::available_parallelism().map_or(4, |n| n.get()).clamp(4, 64),
        }
    }
}

impl PoolConfig {
    /// The same settings with a different cache cap.
    #[must_use]
    pub fn with_max_cached_bytes(self, max_cached_bytes: usize) -> PoolConfig {
        PoolConfig { max_cached_bytes, ..self }
    }

    /// Default settings for a pool on a device whose governor limit is `limit` bytes:
    /// the cache is capped at half of it.
    ///
    /// The limit bounds what the process holds on the device, the pool's idle bytes
    /// included (`reserved` = handed out + cached), so every idle byte is one a tenant
    /// cannot be charged. Half keeps the other half for live blocks before the
    /// governor's recovery ladder has to trim the cache on an allocation's path, and
    /// is still room for a runtime's largest planned block to stay cached between runs
    /// (a cap below that block would hand it back and fault it in again every run).
    #[must_use]
    pub fn for_device_limit(limit: u64) -> PoolConfig {
        let half = usize::try_from(limit / 2).unwrap_or(usize::MAX);
        PoolConfig::default().with_max_cached_bytes(half)
    }
}

/// How a request is served.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Key {
    /// A whole block of size class `index`.
    Class(usize),
    /// A piece of a segment: `bytes` rounded to [`LARGE_ROUND`], at an address aligned
    /// to `align`.
    Large { bytes: usize, align: usize },
    /// Not cached: the inner allocator's block, released straight back.
    Direct,
}

/// A caching allocator over any [`DeviceAllocator`].
///
/// - Requests up to [`PoolConfig::max_class_bytes`] (64 KiB by default) round up to a
///   size class (four per doubling, from 256 bytes) and reuse whole blocks of that
///   class. Requests whose alignment exceeds their class's are passed through uncached.
/// - Larger requests round up to 4 KiB and are carved from **segments**: the smallest
///   free piece that holds the request at the requested alignment serves it, split when
///   the rest is larger than [`PoolConfig::max_class_bytes`] (so another large request
///   could use it); on a miss a new segment of exactly the rounded size is allocated.
///   A freed piece merges with its free neighbours, so a wholly free segment is one
///   piece again and serves any request up to its size.
/// - A released class block goes into its home thread's cache while that holds less
///   than its share of [`PoolConfig::max_cached_bytes`]; otherwise it is released
///   to the inner allocator. A released piece goes back into its segment; when free
///   segment memory exceeds the cap, wholly free segments are released to the inner
///   allocator, least recently idle first, down to three quarters of the cap, and a
///   block that alone does not fit is released itself (its outcome is the caller's).
///   A miss first releases every wholly free segment smaller than the request, and
///   every 64th release those that served none of the last 1024 large allocations.
///   [`DeviceAllocator::trim`] returns every cached class block and wholly free
///   segment; an out-of-memory from the inner allocator triggers one trim and a retry
///   (any other error, such as a governor's `AdmissionRefused`, is handed back at once:
///   the governor runs its own recovery ladder). Free pieces of a segment partly in use
///   stay until it is wholly free.
/// - Class blocks take no lock: each thread allocates from its own cache (a miss goes
///   to the inner allocator; it takes nothing from another thread's cache), and a block
///   released on another thread goes back to its home thread's cache. Each thread's
///   cache holds at most `max_cached_bytes / shards` bytes, and at most `shards`
///   threads cache at once. Segments share one lock.
/// - Every release is validated against the block's record (address, size, alignment,
///   state), so a foreign, forged or repeated release is refused and handed back.
/// - An inner release that fails or quarantines the caller's own block leaves it live,
///   so the caller can retry through the pool; a quarantine is reported with its byte
///   counts capped to the caller's block, and the block is never cached afterwards
///   (part of it may be gone): the retry goes to the inner allocator again. A cached block or free segment the inner
///   allocator refuses stays cached; one it quarantines is held for the next trim.
///
/// Capabilities of the inner allocator are not forwarded: a cached block is not tied
/// to one owner, so commit/map state could leak between owners.
pub struct PooledAllocator<A: DeviceAllocator> {
    inner: A,
    /// The inner allocator's device (asked once).
    device: DeviceKey,
    name: String,
    config: PoolConfig,
    /// Bytes each thread's class cache may hold.
    share: usize,
    /// Shares of the class cache still to hand out (to the next threads that allocate a
    /// class block).
    shares_left: AtomicUsize,
    /// Size classes up to [`PoolConfig::max_class_bytes`].
    classes: usize,
    /// Every thread's class cache and counters, by `memory_sync`'s thread index.
    caches: PerThread<Box<ThreadCache>>,
    /// The record of every block handed out; a block's provider tag is its record's tag.
    records: RecordTable<LiveCells>,
    segments: CachePadded<Mutex<Segments>>,
}

impl<A: DeviceAllocator> PooledAllocator<A> {
    /// A pool over `inner` with default settings.
    pub fn new(inner: A) -> PooledAllocator<A> {
        PooledAllocator::with_config(inner, PoolConfig::default())
    }

    /// A pool over `inner` with `config`.
    pub fn with_config(inner: A, config: PoolConfig) -> PooledAllocator<A> {
        let shares = config.shards.clamp(1, 1 << 16).next_power_of_two();
        let name = format!("pooled({})", inner.name());
        let classes = if config.max_class_bytes == 0 { 0 } else { class_of(config.max_class_bytes).0 + 1 };
        PooledAllocator {
            device: inner.device(),
            inner,
            name,
            config,
            share: config.max_cached_bytes / shares,
            shares_left: AtomicUsize::new(shares),
            classes,
            caches: PerThread::new(),
            records: RecordTable::new(),
            segments: CachePadded::new(Mutex::new(Segments::default())),
        }
    }

    /// The calling thread's class cache and counters (made on its first call).
    #[inline(always)]
    fn own_cache(&self) -> &ThreadCache {
        let index = thread_index();
        self.caches.get_or(index, || Box::new(ThreadCache::new(index, self.classes)))
    }

    /// One share of the class cache for the calling thread's, if one is left.
    #[cold]
    fn take_share(&self) -> u64 {
        let taken = self.shares_left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| left.checked_sub(1));
        if taken.is_ok() { self.share as u64 } else { 0 }
    }

    /// The wrapped allocator.
    pub fn inner(&self) -> &A {
        &self.inner
    }

    /// The settings in force.
    pub fn config(&self) -> PoolConfig {
        self.config
    }

    /// How `request` is served, and what to ask of the inner allocator on a miss.
    fn key_for(&self, request: &AllocationRequest) -> (Key, AllocationRequest) {
        let (bytes, align) = (request.bytes(), request.align());
        if bytes <= self.config.max_class_bytes {
            let (index, size) = class_of(bytes);
            let class_align = class_align(size);
            // With `max_class_bytes` 0 there is no class at all, yet a zero-byte request
            // is "up to" it: it is served uncached, as its class has no lists.
            if index < self.classes
                && align <= class_align
                && let Ok(inner) = AllocationRequest::new(size, class_align)
            {
                return (Key::Class(index), inner.with_role(request.role()));
            }
        } else if let Some(rounded) = bytes.checked_next_multiple_of(LARGE_ROUND)
            && let Ok(inner) = AllocationRequest::new(rounded, align.max(LARGE_ROUND))
        {
            return (Key::Large { bytes: rounded, align }, inner.with_role(request.role()));
        }
        (Key::Direct, *request)
    }

    /// Asks the inner allocator, trimming once and retrying on out-of-memory; the
    /// error names the caller's request, not the rounded inner one.
    fn allocate_inner(
        &self,
        inner: &AllocationRequest,
        request: &AllocationRequest,
    ) -> Result<RawAllocation, AllocError> {
        let block = match self.inner.allocate(inner) {
            Err(AllocError::OutOfMemory { .. }) if self.trim() > 0 => self.inner.allocate(inner),
            other => other,
        };
        block.map_err(|error| match error {
            AllocError::OutOfMemory { device, available, .. } => {
                AllocError::OutOfMemory { device, requested: request.bytes(), align: request.align(), available }
            }
            other => other,
        })
    }

    /// Everything but a class hit: a class miss, an uncached request, a large one.
    #[inline(never)]
    fn allocate_missed(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let (key, inner_request) = self.key_for(request);
        let class = match key {
            Key::Large { bytes, align } => return self.allocate_large((bytes, align), &inner_request, request),
            Key::Class(class) => Some(class),
            Key::Direct => None,
        };
        let home = thread_index();
        let cache = self.caches.get_or(home, || Box::new(ThreadCache::new(home, self.classes)));
        if let Some(class) = class
            && let Some((cell, address)) = cache.pop(class)
        {
            // Only after a refused record (see `unrecorded`): served like a hit.
            let recorded = records::record(address, request.bytes(), request.align(), Held::Cell(home, cell));
            let Some(tag) = self.records.insert_tag(&recorded) else {
                return Err(self.unrecorded(cache, cell, request));
            };
            cache.counters.served(request, true);
            return Ok(RawAllocation::new(address, request.bytes(), request.align(), self.device, tag));
        }
        self.allocate_cell(cache, home, class, &inner_request, request)
    }

    /// A class miss or an uncached request: a new inner block, kept in a cell of the
    /// calling thread's cache (whose share of the class cache is decided on its first
    /// class block), recorded.
    #[inline(never)]
    fn allocate_cell(
        &self,
        cache: &ThreadCache,
        home: usize,
        class: Option<usize>,
        inner_request: &AllocationRequest,
        request: &AllocationRequest,
    ) -> Result<RawAllocation, AllocError> {
        if class.is_some() {
            cache.decide_share(|| self.take_share());
        }
        let block = self.allocate_inner(inner_request, request).inspect_err(|_| cache.counters.failed())?;
        let address = block.address();
        let class = class.map_or(NO_CLASS, |class| class as u32);
        let cell = if home <= records::MAX_HOME { cache.hold(&block, class) } else { None };
        let Some(cell) = cell else {
            let detail = format!(
                "thread index {home} holds {} blocks of this pool, the most its cells name; the block was \
                 released: release some blocks first",
                u32::MAX
            );
            if !self.inner.release(block).is_complete() {
                tracing::warn!("an unrecorded inner block could not be released; it is leaked");
            }
            cache.counters.failed();
            return Err(self.backend_error(detail));
        };
        let recorded = records::record(address, request.bytes(), request.align(), Held::Cell(home, cell));
        let Some(tag) = self.records.insert_tag(&recorded) else {
            return Err(self.unrecorded(cache, cell, request));
        };
        cache.counters.served(request, false);
        Ok(RawAllocation::new(address, request.bytes(), request.align(), self.device, tag))
    }

    /// A live cell whose block the record table had no room to record (the calling
    /// thread holds [`SLOTS_PER_OWNER`](memory_sync::records::SLOTS_PER_OWNER) blocks of
    /// this pool): its block goes back to the inner allocator, and the caller is told.
    #[cold]
    fn unrecorded(&self, cache: &ThreadCache, cell: u32, request: &AllocationRequest) -> AllocError {
        if !cache.release_unrecorded(&self.inner, self.device(), cell) {
            tracing::warn!("an unrecorded inner block could not be released; it is leaked");
        }
        cache.counters.failed();
        self.backend_error(format!(
            "this thread holds {} blocks of this pool, the record table's bound per thread; the request for {} \
             bytes was refused: release some blocks first",
            memory_sync::records::SLOTS_PER_OWNER,
            request.bytes()
        ))
    }

    fn backend_error(&self, detail: String) -> AllocError {
        AllocError::Backend {
            device: self.device(),
            source: BackendError { backend: "pooled", operation: "allocate", code: 0, detail },
        }
    }

    fn refuse(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let error = ReleaseError::NotOwned {
            allocator: self.name.clone(),
            device: self.device(),
            address: allocation.address().get(),
        };
        ReleaseOutcome::failed(allocation, error)
    }
}

/// A quarantine's parts, its byte counts capped to the caller's block: the residual
/// is kept whole (ownership errs on the safe side), the unmapped bytes are what is left.
fn capped(
    quarantine: memory_api::Quarantine,
    allocation: &RawAllocation,
) -> (RawAllocation, ReleaseError, usize, usize) {
    let residual = quarantine.residual_bytes().min(allocation.bytes());
    let unmapped = quarantine.unmapped_bytes().min(allocation.bytes() - residual);
    let (block, error) = quarantine.into_parts();
    tracing::warn!(%error, unmapped, residual, "pooled release quarantined by the inner allocator");
    (block, error, unmapped, residual)
}

impl<A: DeviceAllocator> DeviceAllocator for PooledAllocator<A> {
    fn device(&self) -> DeviceKey {
        self.device
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        // The size classes' hit, written out in the function the hot path enters rather
        // than called in `classes.rs` (as a call of its own it cost the warm pooled pair
        // 31 instructions, and 2 even when forced inline: callgrind), and the segments'
        // path inlined (as a call of its own, 33 more per segment pair); a class miss
        // and an uncached request are behind one call.
        let (bytes, align) = (request.bytes(), request.align());
        if bytes > self.config.max_class_bytes {
            // A large request: the segments' path, inlined here (one call less).
            if let (Key::Large { bytes, align }, inner_request) = self.key_for(request) {
                return self.allocate_large((bytes, align), &inner_request, request);
            }
        } else {
            let (class, size) = class_of(bytes);
            if align <= class_align(size) {
                let home = thread_index();
                let cache = self.caches.get_or(home, || Box::new(ThreadCache::new(home, self.classes)));
                if let Some((cell, address)) = cache.pop(class) {
                    let recorded = records::record(address, bytes, align, Held::Cell(home, cell));
                    if let Some(tag) = self.records.insert_tag(&recorded) {
                        cache.counters.served(request, true);
                        return Ok(RawAllocation::new(address, bytes, align, self.device, tag));
                    }
                    return Err(self.unrecorded(cache, cell, request));
                }
            }
        }
        self.allocate_missed(request)
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        if allocation.device() != self.device {
            return self.refuse(allocation);
        }
        let Some(taken) = self.records.take(allocation.provider_tag(), |recorded| records::is(recorded, &allocation))
        else {
            return self.refuse(allocation);
        };
        match records::held(taken.value()) {
            Held::Cell(home, cell) => self.release_cell(taken, (home, cell), allocation),
            Held::Piece(slot) => self.release_piece(taken, slot, allocation),
        }
    }

    fn stats(&self) -> Option<AllocatorStats> {
        let pool = self.pool_stats();
        Some(AllocatorStats {
            live_bytes: pool.live_bytes,
            live_allocations: pool.live_blocks,
            cached_bytes: pool.cached_bytes,
            largest_free_bytes: pool.largest_free_bytes,
            reserved_bytes: 0,
            allocations_total: pool.hits + pool.misses,
            failures_total: pool.failures,
        })
    }

    fn trim(&self) -> usize {
        self.trim_classes() + self.trim_segments()
    }

    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        let mut inner_blocks = Vec::with_capacity(lost.len());
        for allocation in lost {
            let Some(taken) =
                self.records.take(allocation.provider_tag(), |recorded| records::is_at(recorded, &allocation))
            else {
                continue;
            };
            let bytes = taken.value()[1] as usize;
            let inner = match records::held(taken.value()) {
                Held::Cell(home, cell) => self.forget_cell(taken, (home, cell), bytes),
                Held::Piece(slot) => self.forget_piece(taken, slot, bytes),
            };
            inner_blocks.extend(inner);
        }
        self.inner.forget_lost(inner_blocks);
    }
}

impl<A: DeviceAllocator> Drop for PooledAllocator<A> {
    fn drop(&mut self) {
        self.trim();
        let pool = self.pool_stats();
        if pool.live_blocks > 0 || pool.quarantined_blocks > 0 {
            tracing::warn!(
                live = pool.live_blocks,
                quarantined = pool.quarantined_blocks,
                "pooled allocator dropped with blocks outstanding; their inner blocks are leaked"
            );
        }
    }
}

impl<A: DeviceAllocator> fmt::Debug for PooledAllocator<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledAllocator")
            .field("name", &self.name)
            .field("config", &self.config)
            .field("stats", &self.pool_stats())
            .finish()
    }
}
