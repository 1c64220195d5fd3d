//! [`PooledAllocator`]: a caching allocator over any [`DeviceAllocator`].

use std::collections::HashMap;
use std::fmt;

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, DeviceAllocator, DeviceKey, RawAllocation, ReleaseError,
    ReleaseOutcome,
};

use crate::table::{Shards, Slab, tag, untag};

/// Smallest size class: every block smaller than this uses one of this size.
const MIN_CLASS: usize = 256;
/// Size classes per doubling (sizes step by a quarter of their power of two).
const STEPS: usize = 4;
/// Largest alignment a class block is allocated with; requests asking for more than
/// their class's alignment bypass the cache.
const CLASS_ALIGN_MAX: usize = 4096;
/// Granularity of the large-block cache's sizes.
const LARGE_ROUND: usize = 4096;

/// The size class of `bytes` (at least [`MIN_CLASS`]): its index and size.
fn class_of(bytes: usize) -> (usize, usize) {
    if bytes <= MIN_CLASS {
        return (0, MIN_CLASS);
    }
    let power = (usize::BITS - 1 - (bytes - 1).leading_zeros()) as usize; // floor(log2(bytes - 1))
    let step = 1usize << (power - 2);
    let size = bytes.next_multiple_of(step);
    let k = (size - (1 << power)) / step; // 1..=STEPS
    let min_power = MIN_CLASS.trailing_zeros() as usize;
    (1 + (power - min_power) * STEPS + (k - 1), size)
}

/// Alignment class blocks of `size` are allocated with: the largest power of two
/// dividing it, at most [`CLASS_ALIGN_MAX`].
fn class_align(size: usize) -> usize {
    (1usize << size.trailing_zeros()).min(CLASS_ALIGN_MAX)
}

/// Settings of a [`PooledAllocator`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Bytes of freed blocks the pool may keep for reuse (split evenly across shards).
    pub max_cached_bytes: usize,
    /// Requests up to this size use size classes; larger ones an exact-size cache.
    pub max_class_bytes: usize,
    /// Lock shards; threads map onto them round-robin (rounded up to a power of two).
    pub shards: usize,
}

impl Default for PoolConfig {
    fn default() -> PoolConfig {
        PoolConfig { max_cached_bytes: 256 << 20, max_class_bytes: 1 << 20, shards: Shards::<()>::default_count() }
    }
}

impl PoolConfig {
    /// The same settings with a different cache cap.
    #[must_use]
    pub fn with_max_cached_bytes(self, max_cached_bytes: usize) -> PoolConfig {
        PoolConfig { max_cached_bytes, ..self }
    }
}

/// Which cache a block belongs to.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
enum Key {
    Class(usize),
    Large {
        bytes: usize,
        align: usize,
    },
    /// Not cached: released straight to the inner allocator.
    Direct,
}

#[derive(Debug)]
enum State {
    /// Handed out with this size and alignment.
    Live { bytes: usize, align: usize },
    /// In a free list.
    Cached,
    /// Being released to the inner allocator by some thread (block taken out).
    Releasing,
    /// The inner allocator quarantined it during a trim; the next trim retries.
    Quarantined,
}

struct Record {
    /// The inner allocator's block; `None` only while `Releasing`.
    block: Option<RawAllocation>,
    key: Key,
    state: State,
}

#[derive(Default)]
struct Shard {
    records: Slab<Record>,
    classes: Vec<Vec<usize>>,
    large: HashMap<(usize, usize), Vec<usize>>,
    cached_bytes: usize,
    counters: PoolStats,
}

impl Shard {
    fn pop(&mut self, key: Key) -> Option<usize> {
        match key {
            Key::Class(index) => self.classes.get_mut(index)?.pop(),
            Key::Large { bytes, align } => self.large.get_mut(&(bytes, align))?.pop(),
            Key::Direct => None,
        }
    }

    fn push(&mut self, key: Key, slot: usize) {
        match key {
            Key::Class(index) => {
                if self.classes.len() <= index {
                    self.classes.resize_with(index + 1, Vec::new);
                }
                self.classes[index].push(slot);
            }
            Key::Large { bytes, align } => self.large.entry((bytes, align)).or_default().push(slot),
            Key::Direct => {}
        }
    }
}

/// Counters of a [`PooledAllocator`], summed over its shards.
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
    /// Bytes currently cached.
    pub cached_bytes: u64,
    /// Blocks currently cached.
    pub cached_blocks: u64,
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
    /// Cached blocks the inner allocator quarantined during a trim (retried next trim).
    pub quarantined_blocks: u64,
}

/// A caching allocator over any [`DeviceAllocator`].
///
/// - Requests up to [`PoolConfig::max_class_bytes`] round up to a size class (four per
///   doubling, from 256 bytes); larger requests round up to 4 KiB and are cached by
///   exact size and alignment. Requests whose alignment exceeds their class's are
///   passed through uncached.
/// - A released block goes into the releasing thread's cache shard while the shard
///   holds less than its share of [`PoolConfig::max_cached_bytes`]; otherwise it is
///   released to the inner allocator. [`DeviceAllocator::trim`] returns every cached
///   block; an out-of-memory from the inner allocator triggers one trim and a retry.
/// - No global lock: each thread allocates from its own shard (stealing from others
///   with `try_lock` only on a miss), so threads that allocate and release their own
///   blocks never contend. A block remembers its home shard in its provider tag and
///   returns there.
/// - Every release is validated against the block's record (address, size, alignment,
///   state), so a foreign, forged or repeated release is refused and handed back.
/// - An inner release that fails or quarantines leaves the record live, so the caller
///   can retry through the pool; a quarantine is reported with its byte counts capped
///   to the caller's block.
///
/// Capabilities of the inner allocator are not forwarded: a cached block is not tied
/// to one owner, so commit/map state could leak between owners.
pub struct PooledAllocator<A: DeviceAllocator> {
    inner: A,
    name: String,
    config: PoolConfig,
    shard_cap: usize,
    shards: Shards<Shard>,
}

impl<A: DeviceAllocator> PooledAllocator<A> {
    /// A pool over `inner` with default settings.
    pub fn new(inner: A) -> PooledAllocator<A> {
        PooledAllocator::with_config(inner, PoolConfig::default())
    }

    /// A pool over `inner` with `config`.
    pub fn with_config(inner: A, config: PoolConfig) -> PooledAllocator<A> {
        let shards = Shards::new(config.shards);
        let shard_cap = config.max_cached_bytes / shards.len();
        let name = format!("pooled({})", inner.name());
        PooledAllocator { inner, name, config, shard_cap, shards }
    }

    /// The wrapped allocator.
    pub fn inner(&self) -> &A {
        &self.inner
    }

    /// The settings in force.
    pub fn config(&self) -> PoolConfig {
        self.config
    }

    /// Pool counters, summed over shards.
    pub fn pool_stats(&self) -> PoolStats {
        let mut total = PoolStats::default();
        for index in 0..self.shards.len() {
            let Some(shard) = self.shards.lock(index) else { continue };
            let c = &shard.counters;
            total.requested_bytes += c.requested_bytes;
            total.hits += c.hits;
            total.misses += c.misses;
            total.failures += c.failures;
            total.live_bytes += c.live_bytes;
            total.live_blocks += c.live_blocks;
            total.passed_through += c.passed_through;
            total.trims += c.trims;
            total.trimmed_bytes += c.trimmed_bytes;
            total.cached_bytes += shard.cached_bytes as u64;
            for (_, record) in shard.records.iter() {
                match record.state {
                    State::Cached => total.cached_blocks += 1,
                    State::Quarantined => total.quarantined_blocks += 1,
                    _ => {}
                }
            }
        }
        total
    }

    fn key_for(&self, request: &AllocationRequest) -> (Key, AllocationRequest) {
        let (bytes, align) = (request.bytes(), request.align());
        if bytes <= self.config.max_class_bytes {
            let (index, size) = class_of(bytes);
            let class_align = class_align(size);
            if align <= class_align
                && let Ok(inner) = AllocationRequest::new(size, class_align)
            {
                return (Key::Class(index), inner.with_role(request.role()));
            }
        } else if let Some(rounded) = bytes.checked_next_multiple_of(LARGE_ROUND) {
            let align = align.max(LARGE_ROUND);
            if let Ok(inner) = AllocationRequest::new(rounded, align) {
                return (Key::Large { bytes: rounded, align }, inner.with_role(request.role()));
            }
        }
        (Key::Direct, *request)
    }

    /// Serves `request` from shard `index`'s cache, if it has a block for `key`.
    fn take_cached(
        &self,
        mut guard: std::sync::MutexGuard<'_, Shard>,
        index: usize,
        key: Key,
        request: &AllocationRequest,
    ) -> Option<RawAllocation> {
        let shard: &mut Shard = &mut guard;
        let slot = shard.pop(key)?;
        let record = shard.records.get_mut(slot).expect("free lists hold live slots");
        let block = record.block.as_ref().expect("a cached record holds its block");
        let (address, size) = (block.address(), block.bytes());
        record.state = State::Live { bytes: request.bytes(), align: request.align() };
        shard.cached_bytes -= size;
        let counters = &mut shard.counters;
        counters.hits += 1;
        counters.requested_bytes += request.bytes() as u64;
        counters.live_bytes += request.bytes() as u64;
        counters.live_blocks += 1;
        Some(RawAllocation::new(address, request.bytes(), request.align(), self.device(), tag(index, slot)))
    }

    fn refuse(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let error = ReleaseError::NotOwned {
            allocator: self.name.clone(),
            device: self.device(),
            address: allocation.address().get(),
        };
        ReleaseOutcome::failed(allocation, error)
    }

    /// Puts a block the inner allocator handed back into its record again.
    fn restore(&self, index: usize, slot: usize, block: RawAllocation, state: State) {
        let Some(mut shard) = self.shards.lock(index) else { return };
        if let Some(record) = shard.records.get_mut(slot) {
            record.block = Some(block);
            record.state = state;
        }
    }
}

impl<A: DeviceAllocator> DeviceAllocator for PooledAllocator<A> {
    fn device(&self) -> DeviceKey {
        self.inner.device()
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let (key, inner_request) = self.key_for(request);
        let home = self.shards.local();
        if key != Key::Direct {
            if let Some(shard) = self.shards.lock(home)
                && let Some(block) = self.take_cached(shard, home, key, request)
            {
                return Ok(block);
            }
            for offset in 1..self.shards.len() {
                let index = (home + offset) & (self.shards.len() - 1);
                if let Some(shard) = self.shards.try_lock(index)
                    && let Some(block) = self.take_cached(shard, index, key, request)
                {
                    return Ok(block);
                }
            }
        }
        let block = match self.inner.allocate(&inner_request) {
            Err(AllocError::OutOfMemory { .. }) if self.trim() > 0 => self.inner.allocate(&inner_request),
            other => other,
        };
        let block = match block {
            Ok(block) => block,
            Err(error) => {
                if let Some(mut shard) = self.shards.lock(home) {
                    shard.counters.failures += 1;
                }
                // Name the caller's request, not the rounded inner one.
                return Err(match error {
                    AllocError::OutOfMemory { device, available, .. } => AllocError::OutOfMemory {
                        device,
                        requested: request.bytes(),
                        align: request.align(),
                        available,
                    },
                    other => other,
                });
            }
        };
        let address = block.address();
        let Some(mut shard) = self.shards.lock(home) else { unreachable!("the local shard exists") };
        let slot = shard.records.insert(Record {
            block: Some(block),
            key,
            state: State::Live { bytes: request.bytes(), align: request.align() },
        });
        let counters = &mut shard.counters;
        counters.misses += 1;
        counters.requested_bytes += request.bytes() as u64;
        counters.live_bytes += request.bytes() as u64;
        counters.live_blocks += 1;
        drop(shard);
        Ok(RawAllocation::new(address, request.bytes(), request.align(), self.device(), tag(home, slot)))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        if allocation.device() != self.device() {
            return self.refuse(allocation);
        }
        let (index, slot) = untag(allocation.provider_tag());
        let Some(mut guard) = self.shards.lock(index) else { return self.refuse(allocation) };
        let shard: &mut Shard = &mut guard;
        let valid = shard.records.get(slot).is_some_and(|record| {
            matches!(record.state, State::Live { bytes, align } if bytes == allocation.bytes() && align == allocation.align())
                && record.block.as_ref().is_some_and(|block| block.address() == allocation.address())
        });
        if !valid {
            drop(guard);
            return self.refuse(allocation);
        }
        shard.counters.live_bytes -= allocation.bytes() as u64;
        shard.counters.live_blocks -= 1;
        let record = shard.records.get_mut(slot).expect("validated above");
        let key = record.key;
        let size = record.block.as_ref().map_or(0, RawAllocation::bytes);
        if key != Key::Direct && shard.cached_bytes + size <= self.shard_cap {
            record.state = State::Cached;
            shard.cached_bytes += size;
            shard.push(key, slot);
            return ReleaseOutcome::complete(0);
        }
        // Not cacheable, or the shard's share of the cache is full: release for real.
        record.state = State::Releasing;
        let block = record.block.take().expect("a live record holds its block");
        shard.counters.passed_through += 1;
        drop(guard);
        match self.inner.release(block) {
            ReleaseOutcome::Complete(done) => {
                if let Some(mut shard) = self.shards.lock(index) {
                    shard.records.remove(slot);
                }
                // The inner block is the size class; the caller's block may be smaller.
                ReleaseOutcome::complete(done.unmapped_bytes().min(allocation.bytes()))
            }
            ReleaseOutcome::Failed(failed) => {
                let (block, error) = failed.into_parts();
                let state = State::Live { bytes: allocation.bytes(), align: allocation.align() };
                self.restore(index, slot, block, state);
                self.undo_live(index, &allocation);
                ReleaseOutcome::failed(allocation, error)
            }
            ReleaseOutcome::Quarantined(quarantine) => {
                let residual = quarantine.residual_bytes().min(allocation.bytes());
                let unmapped = quarantine.unmapped_bytes().min(allocation.bytes() - residual);
                let (block, error) = quarantine.into_parts();
                let state = State::Live { bytes: allocation.bytes(), align: allocation.align() };
                self.restore(index, slot, block, state);
                self.undo_live(index, &allocation);
                tracing::warn!(%error, unmapped, residual, "pooled release quarantined by the inner allocator");
                ReleaseOutcome::quarantined(allocation, unmapped, residual, error)
            }
        }
    }

    fn stats(&self) -> Option<AllocatorStats> {
        let pool = self.pool_stats();
        Some(AllocatorStats {
            live_bytes: pool.live_bytes,
            live_allocations: pool.live_blocks,
            cached_bytes: pool.cached_bytes,
            reserved_bytes: 0,
            allocations_total: pool.hits + pool.misses,
            failures_total: pool.failures,
        })
    }

    fn trim(&self) -> usize {
        let mut returned = 0;
        for index in 0..self.shards.len() {
            let taken: Vec<(usize, RawAllocation)> = {
                let Some(mut shard) = self.shards.lock(index) else { continue };
                let mut taken = Vec::new();
                for (slot, record) in shard.records.iter_mut() {
                    if matches!(record.state, State::Cached | State::Quarantined) {
                        record.state = State::Releasing;
                        taken.extend(record.block.take().map(|block| (slot, block)));
                    }
                }
                shard.classes.iter_mut().for_each(Vec::clear);
                shard.large.clear();
                shard.cached_bytes = 0;
                shard.counters.trims += u64::from(index == 0);
                taken
            };
            for (slot, block) in taken {
                let size = block.bytes();
                match self.inner.release(block) {
                    ReleaseOutcome::Complete(_) => {
                        returned += size;
                        if let Some(mut shard) = self.shards.lock(index) {
                            shard.records.remove(slot);
                            shard.counters.trimmed_bytes += size as u64;
                        }
                    }
                    ReleaseOutcome::Failed(failed) => {
                        // Nothing happened: keep it cached.
                        let (block, _) = failed.into_parts();
                        if let Some(mut shard) = self.shards.lock(index)
                            && let Some(record) = shard.records.get_mut(slot)
                        {
                            let key = record.key;
                            record.block = Some(block);
                            record.state = State::Cached;
                            shard.cached_bytes += size;
                            shard.push(key, slot);
                        }
                    }
                    ReleaseOutcome::Quarantined(quarantine) => {
                        tracing::warn!(error = %quarantine.error(), "trim: inner allocator quarantined a cached block");
                        let (block, _) = quarantine.into_parts();
                        self.restore(index, slot, block, State::Quarantined);
                    }
                }
            }
        }
        returned
    }

    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        let mut inner_blocks = Vec::with_capacity(lost.len());
        for allocation in lost {
            let (index, slot) = untag(allocation.provider_tag());
            let Some(mut shard) = self.shards.lock(index) else { continue };
            let valid = shard.records.get(slot).is_some_and(|record| {
                matches!(record.state, State::Live { .. })
                    && record.block.as_ref().is_some_and(|block| block.address() == allocation.address())
            });
            if valid && let Some(record) = shard.records.remove(slot) {
                shard.counters.live_bytes -= allocation.bytes() as u64;
                shard.counters.live_blocks -= 1;
                inner_blocks.extend(record.block);
            }
        }
        self.inner.forget_lost(inner_blocks);
    }
}

impl<A: DeviceAllocator> PooledAllocator<A> {
    /// Counts a block live again after its release failed.
    fn undo_live(&self, index: usize, allocation: &RawAllocation) {
        if let Some(mut shard) = self.shards.lock(index) {
            shard.counters.live_bytes += allocation.bytes() as u64;
            shard.counters.live_blocks += 1;
            shard.counters.passed_through -= 1;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_step_by_quarters_and_cover_every_size() {
        assert_eq!(class_of(0), (0, 256));
        assert_eq!(class_of(256), (0, 256));
        assert_eq!(class_of(257), (1, 320));
        assert_eq!(class_of(512), (4, 512));
        assert_eq!(class_of(513), (5, 640));
        assert_eq!(class_of(65536), (class_of(65536).0, 65536));
        let mut last = (0, 256);
        for bytes in 1..=(1 << 16) {
            let (index, size) = class_of(bytes);
            assert!(size >= bytes && (bytes <= MIN_CLASS || size - bytes < size / 4), "{bytes} -> {size}");
            assert!(index == last.0 || index == last.0 + 1, "classes are dense at {bytes}");
            assert!(size == last.1 || index == last.0 + 1);
            last = (index, size);
        }
        assert_eq!(class_align(320), 64);
        assert_eq!(class_align(65536), 4096);
    }

    use crate::SystemAllocator;
    use memory_api::MaybeBytes;
    use memory_testkit::{Callback, FaultyAllocator, RecordingAllocator};
    use std::panic::{AssertUnwindSafe, catch_unwind};

    const KIB: usize = 1024;

    fn request(bytes: usize, align: usize) -> AllocationRequest {
        AllocationRequest::new(bytes, align).unwrap()
    }

    fn one_shard(max_cached_bytes: usize) -> PoolConfig {
        PoolConfig { max_cached_bytes, max_class_bytes: 1 << 20, shards: 1 }
    }

    #[test]
    fn released_blocks_are_reused_without_reaching_the_inner_allocator() {
        let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
        let first = pool.allocate(&request(64 * KIB, 256)).unwrap();
        let address = first.address();
        assert_eq!(pool.release(first).summary(), memory_api::ReleaseSummary::Complete { unmapped_bytes: 0 });
        let second = pool.allocate(&request(60 * KIB, 64)).unwrap();
        assert_eq!(second.address(), address, "a request of the same class reuses the cached block");
        assert_eq!(second.bytes(), 60 * KIB);
        let recorder = pool.inner();
        assert_eq!((recorder.calls(Callback::Allocate), recorder.calls(Callback::Release)), (1, 0));
        let stats = pool.pool_stats();
        assert_eq!((stats.hits, stats.misses, stats.live_blocks, stats.cached_blocks), (1, 1, 1, 0));
        assert_eq!(stats.requested_bytes, 124 * KIB as u64);
        assert!(pool.release(second).is_complete());
        assert_eq!(pool.trim(), 64 * KIB);
        assert_eq!(pool.inner().calls(Callback::Release), 1);
    }

    #[test]
    fn the_cache_cap_passes_releases_through_to_the_inner_allocator() {
        let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(64 * KIB));
        let a = pool.allocate(&request(64 * KIB, 8)).unwrap();
        let b = pool.allocate(&request(64 * KIB, 8)).unwrap();
        assert!(pool.release(a).is_complete());
        let ReleaseOutcome::Complete(done) = pool.release(b) else { panic!("must complete") };
        assert_eq!(done.unmapped_bytes(), 64 * KIB, "the second block is freed, not cached");
        let stats = pool.pool_stats();
        assert_eq!((stats.cached_bytes, stats.passed_through), (64 * KIB as u64, 1));
        assert_eq!(pool.inner().calls(Callback::Release), 1);
    }

    #[test]
    fn large_blocks_are_cached_by_exact_rounded_size() {
        let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
        let big = pool.allocate(&request(3 << 20, 8)).unwrap();
        assert!(big.address().is_aligned_to(4096));
        assert!(pool.release(big).is_complete());
        let other = pool.allocate(&request((3 << 20) + 4096, 8)).unwrap();
        assert_eq!(pool.pool_stats().hits, 0, "a different large size is not served from the cache");
        let same = pool.allocate(&request((3 << 20) - 100, 8)).unwrap();
        assert_eq!(pool.pool_stats().hits, 1, "the same size rounded to 4 KiB is");
        for block in [other, same] {
            assert!(pool.release(block).is_complete());
        }
    }

    #[test]
    fn alignments_beyond_the_class_alignment_bypass_the_cache() {
        let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
        let block = pool.allocate(&request(1000, 8192)).unwrap();
        assert!(block.address().is_aligned_to(8192));
        let ReleaseOutcome::Complete(done) = pool.release(block) else { panic!("must complete") };
        assert_eq!(done.unmapped_bytes(), 1000, "an uncached block is released to the inner allocator at once");
        assert_eq!(pool.pool_stats().cached_blocks, 0);
    }

    #[test]
    fn cached_or_repeated_releases_are_refused() {
        let pool = PooledAllocator::new(SystemAllocator::new());
        let block = pool.allocate(&request(512, 8)).unwrap();
        let copy = RawAllocation::new(block.address(), 512, 8, block.device(), block.provider_tag());
        assert!(pool.release(block).is_complete());
        let ReleaseOutcome::Failed(failed) = pool.release(copy) else { panic!("a second release must be refused") };
        assert!(matches!(failed.error(), ReleaseError::NotOwned { .. }));
        assert_eq!(pool.pool_stats().cached_blocks, 1, "the cached block was not disturbed");
    }

    #[test]
    fn an_inner_out_of_memory_trims_the_cache_and_retries_once() {
        let pool = PooledAllocator::new(FaultyAllocator::new(SystemAllocator::new()));
        let cached = pool.allocate(&request(4 * KIB, 8)).unwrap();
        assert!(pool.release(cached).is_complete());
        let oom =
            AllocError::OutOfMemory { device: DeviceKey::HOST, requested: 0, align: 0, available: MaybeBytes(None) };
        pool.inner().fail_nth_allocate_with(1, oom.clone());
        let block = pool.allocate(&request(100 * KIB, 8)).unwrap();
        assert_eq!(pool.pool_stats().cached_blocks, 0, "the retry followed a trim");
        assert_eq!(pool.inner().inner().stats().unwrap().live_allocations, 1);
        // With nothing left to trim the error comes back, naming the caller's request.
        pool.inner().fail_nth_allocate_with(1, oom);
        let err = pool.allocate(&request(5000, 8)).unwrap_err();
        assert_eq!(
            err,
            AllocError::OutOfMemory { device: DeviceKey::HOST, requested: 5000, align: 8, available: MaybeBytes(None) }
        );
        assert_eq!(pool.stats().unwrap().failures_total, 1);
        assert!(pool.release(block).is_complete());
    }

    #[test]
    fn a_failed_inner_release_hands_the_block_back_for_a_retry() {
        let pool = PooledAllocator::with_config(FaultyAllocator::new(SystemAllocator::new()), one_shard(0));
        let block = pool.allocate(&request(1000, 8)).unwrap();
        pool.inner().fail_nth(Callback::Release, 1);
        let ReleaseOutcome::Failed(failed) = pool.release(block) else { panic!("expected Failed") };
        let (block, error) = failed.into_parts();
        assert!(matches!(error, ReleaseError::Backend(ref e) if memory_testkit::is_injected(e)));
        assert_eq!(pool.pool_stats().live_blocks, 1, "the block is still live in the pool");
        assert!(pool.release(block).is_complete());
        assert_eq!(pool.pool_stats().live_blocks, 0);
    }

    #[test]
    fn a_quarantined_inner_release_is_capped_to_the_callers_block_and_retryable() {
        let pool = PooledAllocator::with_config(FaultyAllocator::new(SystemAllocator::new()), one_shard(0));
        let bytes = 2_000_001; // a large block: the inner block is rounded up to 2_002_944
        let block = pool.allocate(&request(bytes, 8)).unwrap();
        // The inner block (2_002_944 bytes) reports 4096 unmapped and the rest owned.
        pool.inner().quarantine_nth_release(1, 4096, 2_002_944 - 4096);
        let ReleaseOutcome::Quarantined(q) = pool.release(block) else { panic!("expected a quarantine") };
        // The residual is kept whole (ownership errs on the safe side); the unmapped
        // bytes are capped to what is left of the caller's block.
        assert_eq!((q.unmapped_bytes(), q.residual_bytes()), (bytes - (2_002_944 - 4096), 2_002_944 - 4096));
        assert!(!q.was_corrected(), "the pool reports an honest quarantine");
        let (block, _) = q.into_parts();
        assert!(pool.release(block).is_complete());
    }

    #[test]
    fn trim_keeps_blocks_the_inner_allocator_refuses_and_retries_quarantined_ones() {
        let pool = PooledAllocator::new(FaultyAllocator::new(SystemAllocator::new()));
        let a = pool.allocate(&request(8 * KIB, 8)).unwrap();
        assert!(pool.release(a).is_complete());
        pool.inner().fail_nth(Callback::Release, 1);
        assert_eq!(pool.trim(), 0);
        assert_eq!(pool.pool_stats().cached_bytes, 8 * KIB as u64, "a refused block stays cached");
        pool.inner().quarantine_nth_release(1, 0, 8 * KIB);
        assert_eq!(pool.trim(), 0);
        let stats = pool.pool_stats();
        assert_eq!((stats.cached_bytes, stats.quarantined_blocks), (0, 1));
        assert_eq!(pool.trim(), 8 * KIB, "the next trim retries the quarantined block");
        assert_eq!(pool.pool_stats().quarantined_blocks, 0);
        assert_eq!(pool.inner().inner().stats().unwrap().live_allocations, 0);
    }

    #[test]
    fn a_panicking_inner_allocator_leaves_the_pool_consistent() {
        let pool = PooledAllocator::new(FaultyAllocator::new(SystemAllocator::new()));
        pool.inner().panic_on_nth(Callback::Allocate, 1);
        assert!(catch_unwind(AssertUnwindSafe(|| pool.allocate(&request(64, 8)))).is_err());
        let stats = pool.pool_stats();
        assert_eq!((stats.live_blocks, stats.misses, stats.hits), (0, 0, 0));
        let block = pool.allocate(&request(64, 8)).unwrap();
        assert!(pool.release(block).is_complete());
    }

    #[test]
    fn forget_lost_drops_the_records_and_forwards_the_inner_blocks() {
        let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
        let a = pool.allocate(&request(64, 8)).unwrap();
        let b = pool.allocate(&request(64, 8)).unwrap();
        pool.forget_lost(vec![a]);
        assert_eq!(pool.inner().forgotten_blocks(), 1);
        assert_eq!(pool.pool_stats().live_blocks, 1);
        assert!(pool.release(b).is_complete());
    }

    #[test]
    fn a_block_released_on_another_thread_returns_to_its_home_shard() {
        let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
        let block = pool.allocate(&request(64 * KIB, 8)).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| assert!(pool.release(block).is_complete()));
        });
        let again = pool.allocate(&request(64 * KIB, 8)).unwrap();
        assert_eq!(pool.pool_stats().hits, 1);
        assert_eq!(pool.inner().calls(Callback::Allocate), 1);
        assert!(pool.release(again).is_complete());
    }
}
