//! [`PooledAllocator`]: a caching allocator over any [`DeviceAllocator`].
//!
//! Two caches share one byte cap per shard:
//! - **size classes** for requests up to [`PoolConfig::max_class_bytes`]: whole inner
//!   blocks, four classes per doubling, reused by requests of the same class;
//! - **segments** for larger requests: inner blocks carved best-fit into pieces, split
//!   when the rest could serve another large request, and coalesced with free
//!   neighbours when a piece comes back (as a BFC arena or PyTorch's large pool do). A
//!   request of any size is served from a free piece that holds it, so memory freed by
//!   one run of a model serves the next run's differently sized buffers instead of
//!   being handed back and faulted in again.
//!
//! When a release would push the shard over its cap, wholly free segments are handed
//! back to the inner allocator least recently idle first; the block just released is
//! the last to go, because it is the likeliest to be asked for again.

use std::collections::BTreeSet;
use std::fmt;

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, DeviceAddress, DeviceAllocator, DeviceKey, RawAllocation,
    ReleaseError, ReleaseOutcome,
};

use crate::table::{Shards, Slab, tag, untag};

/// Smallest size class: every block smaller than this uses one of this size.
const MIN_CLASS: usize = 256;
/// Size classes per doubling (sizes step by a quarter of their power of two).
const STEPS: usize = 4;
/// Largest alignment a class block is allocated with; requests asking for more than
/// their class's alignment bypass the cache.
const CLASS_ALIGN_MAX: usize = 4096;
/// Granularity (and least alignment) of segments and of the pieces carved from them.
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
    /// Bytes of freed memory the pool may keep for reuse (split evenly across shards):
    /// cached class blocks and free pieces of segments.
    pub max_cached_bytes: usize,
    /// Requests up to this size use size classes; larger ones are carved from segments.
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

#[derive(Debug)]
enum State {
    /// Handed out with this size and alignment.
    Live { bytes: usize, align: usize },
    /// Free: a cached class block, or a free piece of a segment.
    Cached,
    /// Being released to the inner allocator by some thread.
    Releasing,
    /// A class block the inner allocator quarantined during a trim; the next trim retries.
    Quarantined,
    /// A piece given up with its device (`forget_lost`): never reused or freed.
    Lost,
}

/// What a record stands for.
enum Body {
    /// A whole inner block: size class `class`, or an uncached block (`None`). The block
    /// is `None` only while `Releasing`.
    Whole { block: Option<RawAllocation>, class: Option<usize> },
    /// `size` bytes at `offset` in `segment`, with its neighbours in address order.
    Piece { segment: usize, offset: usize, size: usize, prev: Option<usize>, next: Option<usize> },
}

struct Record {
    state: State,
    body: Body,
}

/// An inner block serving large requests, split into pieces that cover it exactly.
/// No two neighbouring pieces are both free, so a wholly free segment is one piece,
/// its `head`.
struct Segment {
    /// The inner block; `None` while it is being released.
    block: Option<RawAllocation>,
    /// Its size (what was asked of the inner allocator).
    size: usize,
    /// The piece at offset 0 (never merged away, so its slot is stable).
    head: usize,
    /// Pieces handed out now.
    live: usize,
    /// The shard's clock when it last became wholly free (least recently idle goes first).
    idle_since: u64,
    /// Some piece was given up with the device: nothing in it is reused or freed.
    lost: bool,
    /// The inner allocator quarantined it on release; the next trim retries.
    quarantined: bool,
}

impl Segment {
    fn is_idle(&self) -> bool {
        self.live == 0 && !self.lost && !self.quarantined && self.block.is_some()
    }
}

/// A wholly free segment taken out of the cache, to be released after unlocking.
struct Eviction {
    segment: usize,
    block: RawAllocation,
}

#[derive(Default)]
struct Shard {
    records: Slab<Record>,
    classes: Vec<Vec<usize>>,
    segments: Slab<Segment>,
    /// Free pieces by (size, slot): best fit is the first at or above the request.
    free_pieces: BTreeSet<(usize, usize)>,
    cached_bytes: usize,
    clock: u64,
    counters: PoolStats,
}

impl Shard {
    fn pop_class(&mut self, index: usize) -> Option<usize> {
        self.classes.get_mut(index)?.pop()
    }

    fn push_class(&mut self, index: usize, slot: usize) {
        if self.classes.len() <= index {
            self.classes.resize_with(index + 1, Vec::new);
        }
        self.classes[index].push(slot);
    }

    fn piece(&self, slot: usize) -> Option<(usize, usize, usize, Option<usize>, Option<usize>)> {
        match self.records.get(slot)?.body {
            Body::Piece { segment, offset, size, prev, next } => Some((segment, offset, size, prev, next)),
            Body::Whole { .. } => None,
        }
    }

    fn piece_mut(&mut self, slot: usize) -> Option<(&mut usize, &mut Option<usize>, &mut Option<usize>)> {
        match &mut self.records.get_mut(slot)?.body {
            Body::Piece { size, prev, next, .. } => Some((size, prev, next)),
            Body::Whole { .. } => None,
        }
    }

    /// The address of piece `slot`, while its segment holds its block.
    fn piece_address(&self, slot: usize) -> Option<DeviceAddress> {
        let (segment, offset, ..) = self.piece(slot)?;
        self.segments.get(segment)?.block.as_ref()?.address().checked_add(offset)
    }

    fn is_free_piece(&self, slot: Option<usize>) -> Option<usize> {
        let slot = slot?;
        matches!(self.records.get(slot)?.state, State::Cached).then_some(slot)
    }

    /// Frees live piece `slot` into the cache, merging it with free neighbours.
    fn free_piece(&mut self, slot: usize) {
        let Some((segment, _, size, prev, next)) = self.piece(slot) else { return };
        if let Some(record) = self.records.get_mut(slot) {
            record.state = State::Cached;
        }
        self.cached_bytes += size;
        let mut merged = slot;
        if let Some(after) = self.is_free_piece(next) {
            self.absorb_next(merged, after);
        }
        if let Some(before) = self.is_free_piece(prev) {
            self.absorb_next(before, merged);
            merged = before;
        }
        if let Some((_, _, size, ..)) = self.piece(merged) {
            self.free_pieces.insert((size, merged));
        }
        if let Some(segment) = self.segments.get_mut(segment) {
            segment.live -= 1;
            if segment.live == 0 {
                segment.idle_since = self.clock;
                self.clock += 1;
            }
        }
    }

    /// Merges free piece `after` into its left neighbour `into` (which leaves the free
    /// index while it grows).
    fn absorb_next(&mut self, into: usize, after: usize) {
        let Some((_, _, after_size, _, after_next)) = self.piece(after) else { return };
        if let Some((_, _, into_size, ..)) = self.piece(into) {
            self.free_pieces.remove(&(into_size, into));
        }
        self.free_pieces.remove(&(after_size, after));
        self.records.remove(after);
        if let Some((size, _, next)) = self.piece_mut(into) {
            *size += after_size;
            *next = after_next;
        }
        if let Some(following) = after_next
            && let Some((_, prev, _)) = self.piece_mut(following)
        {
            *prev = Some(into);
        }
    }

    /// Takes wholly free segment `index` out of the cache for release.
    fn take_idle(&mut self, index: usize) -> Option<Eviction> {
        let segment = self.segments.get_mut(index)?;
        let block = segment.block.take()?;
        let (head, size) = (segment.head, segment.size);
        self.free_pieces.remove(&(size, head));
        self.cached_bytes -= size;
        Some(Eviction { segment: index, block })
    }

    /// The pieces of `segment` in address order.
    fn pieces_of(&self, segment: usize) -> Vec<usize> {
        let mut pieces = Vec::new();
        let mut cursor = self.segments.get(segment).map(|segment| segment.head);
        while let Some(slot) = cursor {
            pieces.push(slot);
            cursor = self.piece(slot).and_then(|(.., next)| next);
        }
        pieces
    }

    /// Marks `segment` lost: its free pieces leave the cache for good.
    fn lose_segment(&mut self, segment: usize) {
        if self.segments.get(segment).is_none_or(|segment| segment.lost) {
            return;
        }
        for slot in self.pieces_of(segment) {
            if let Some((_, _, size, ..)) = self.piece(slot)
                && self.free_pieces.remove(&(size, slot))
            {
                self.cached_bytes -= size;
            }
        }
        if let Some(segment) = self.segments.get_mut(segment) {
            segment.lost = true;
        }
    }

    /// Removes a lost segment whose last piece is gone; returns its block to forget.
    fn drop_lost_segment(&mut self, segment: usize) -> Option<RawAllocation> {
        if self.segments.get(segment).is_none_or(|segment| !segment.lost || segment.live > 0) {
            return None;
        }
        for slot in self.pieces_of(segment) {
            self.records.remove(slot);
        }
        self.segments.remove(segment)?.block
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
    /// Bytes currently cached: free class blocks and free pieces of segments.
    pub cached_bytes: u64,
    /// Blocks currently cached (free class blocks and free pieces).
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
    /// Cached blocks the inner allocator quarantined during a trim or an eviction
    /// (retried next trim).
    pub quarantined_blocks: u64,
    /// Inner blocks held to serve large requests (segments), whether in use or free.
    pub segments: u64,
    /// Their bytes.
    pub segment_bytes: u64,
    /// Wholly free segments handed back to the inner allocator to stay under the cap.
    pub evicted_segments: u64,
    /// Their bytes.
    pub evicted_bytes: u64,
}

/// A caching allocator over any [`DeviceAllocator`].
///
/// - Requests up to [`PoolConfig::max_class_bytes`] round up to a size class (four per
///   doubling, from 256 bytes) and reuse whole blocks of that class. Requests whose
///   alignment exceeds their class's are passed through uncached.
/// - Larger requests round up to 4 KiB and are carved from **segments**: the smallest
///   free piece that holds the request (at the requested alignment) serves it, split
///   when the rest is larger than [`PoolConfig::max_class_bytes`] (so it could serve
///   another large request); on a miss a new segment of exactly the rounded size is
///   allocated. A freed piece merges with free neighbours, so a wholly free segment is
///   one piece again and serves any request up to its size.
/// - A released block goes into its home shard's cache. When that would take the
///   shard over its share of [`PoolConfig::max_cached_bytes`], wholly free segments
///   are released to the inner allocator, least recently idle first; a block that
///   still does not fit is released to the inner allocator itself (its outcome is the
///   caller's). [`DeviceAllocator::trim`] returns every cached class block and wholly
///   free segment; an out-of-memory from the inner allocator triggers one trim and a
///   retry. Free pieces of a segment that is partly in use stay until it is free.
/// - No global lock: each thread allocates from its own shard (stealing from others
///   with `try_lock` only on a miss), so threads that allocate and release their own
///   blocks never contend. A block remembers its home shard in its provider tag and
///   returns there.
/// - Every release is validated against the block's record (address, size, alignment,
///   state), so a foreign, forged or repeated release is refused and handed back.
/// - An inner release that fails or quarantines the caller's own block leaves the
///   record live, so the caller can retry through the pool; a quarantine is reported
///   with its byte counts capped to the caller's block. A cached block or segment the
///   inner allocator refuses or quarantines stays with the pool (cached, or held for
///   the next trim).
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
            total.evicted_segments += c.evicted_segments;
            total.evicted_bytes += c.evicted_bytes;
            total.cached_bytes += shard.cached_bytes as u64;
            for (_, record) in shard.records.iter() {
                match record.state {
                    State::Cached => total.cached_blocks += 1,
                    State::Quarantined => total.quarantined_blocks += 1,
                    _ => {}
                }
            }
            for (_, segment) in shard.segments.iter() {
                total.segments += 1;
                total.segment_bytes += segment.size as u64;
                total.quarantined_blocks += u64::from(segment.quarantined);
            }
        }
        total
    }

    /// How `request` is served, and what to ask of the inner allocator on a miss.
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
        } else if let Some(rounded) = bytes.checked_next_multiple_of(LARGE_ROUND)
            && let Ok(inner) = AllocationRequest::new(rounded, align.max(LARGE_ROUND))
        {
            return (Key::Large { bytes: rounded, align }, inner.with_role(request.role()));
        }
        (Key::Direct, *request)
    }

    /// Serves `request` from shard `index`'s cache, if it holds a fitting block.
    fn take_cached(
        &self,
        shard: &mut Shard,
        index: usize,
        key: Key,
        request: &AllocationRequest,
    ) -> Option<RawAllocation> {
        let (slot, address) = match key {
            Key::Class(class) => {
                let slot = shard.pop_class(class)?;
                let record = shard.records.get_mut(slot).expect("free lists hold live slots");
                let Body::Whole { block: Some(block), .. } = &record.body else {
                    unreachable!("a cached class record holds its block")
                };
                let (address, size) = (block.address(), block.bytes());
                record.state = State::Live { bytes: request.bytes(), align: request.align() };
                shard.cached_bytes -= size;
                (slot, address)
            }
            Key::Large { bytes, align } => self.take_piece(shard, bytes, align, request)?,
            Key::Direct => return None,
        };
        let counters = &mut shard.counters;
        counters.hits += 1;
        counters.requested_bytes += request.bytes() as u64;
        counters.live_bytes += request.bytes() as u64;
        counters.live_blocks += 1;
        Some(RawAllocation::new(address, request.bytes(), request.align(), self.device(), tag(index, slot)))
    }

    /// Carves `bytes` at an address aligned to `align` out of the smallest free piece
    /// that holds it, splitting off the rest when another large request could use it.
    fn take_piece(
        &self,
        shard: &mut Shard,
        bytes: usize,
        align: usize,
        request: &AllocationRequest,
    ) -> Option<(usize, DeviceAddress)> {
        let (size, slot) = shard
            .free_pieces
            .range((bytes, 0)..)
            .copied()
            .find(|&(_, slot)| shard.piece_address(slot).is_some_and(|address| address.is_aligned_to(align)))?;
        let address = shard.piece_address(slot)?;
        shard.free_pieces.remove(&(size, slot));
        let (segment, offset, _, _, next) = shard.piece(slot)?;
        let rest = size - bytes;
        let taken = if rest > self.config.max_class_bytes {
            let split = shard.records.insert(Record {
                state: State::Cached,
                body: Body::Piece { segment, offset: offset + bytes, size: rest, prev: Some(slot), next },
            });
            if let Some(following) = next
                && let Some((_, prev, _)) = shard.piece_mut(following)
            {
                *prev = Some(split);
            }
            if let Some((piece_size, _, piece_next)) = shard.piece_mut(slot) {
                *piece_size = bytes;
                *piece_next = Some(split);
            }
            shard.free_pieces.insert((rest, split));
            bytes
        } else {
            size
        };
        shard.cached_bytes -= taken;
        if let Some(record) = shard.records.get_mut(slot) {
            record.state = State::Live { bytes: request.bytes(), align: request.align() };
        }
        if let Some(segment) = shard.segments.get_mut(segment) {
            segment.live += 1;
        }
        Some((slot, address))
    }

    /// Takes wholly free segments of `shard` out of the cache, least recently idle first
    /// and never `keep`, until `incoming` more bytes fit under the shard's cap. The
    /// caller releases them with [`PooledAllocator::finish_evictions`] after unlocking.
    fn make_room(&self, shard: &mut Shard, incoming: usize, keep: Option<usize>) -> Vec<Eviction> {
        let mut evictions = Vec::new();
        if shard.cached_bytes + incoming <= self.shard_cap {
            return evictions;
        }
        let mut idle: Vec<(u64, usize)> = shard
            .segments
            .iter()
            .filter(|&(index, segment)| Some(index) != keep && segment.is_idle())
            .map(|(index, segment)| (segment.idle_since, index))
            .collect();
        idle.sort_unstable();
        for (_, segment) in idle {
            if shard.cached_bytes + incoming <= self.shard_cap {
                break;
            }
            evictions.extend(shard.take_idle(segment));
        }
        evictions
    }

    /// Releases segments taken out of shard `index` to the inner allocator. One the
    /// inner allocator refuses is cached again; one it quarantines is held for the next
    /// trim.
    fn finish_evictions(&self, index: usize, evictions: Vec<Eviction>) {
        for Eviction { segment, block } in evictions {
            let size = block.bytes();
            let outcome = self.inner.release(block);
            let Some(mut guard) = self.shards.lock(index) else { continue };
            let shard: &mut Shard = &mut guard;
            match outcome {
                ReleaseOutcome::Complete(_) => {
                    if let Some(gone) = shard.segments.remove(segment) {
                        shard.records.remove(gone.head);
                        shard.counters.evicted_segments += 1;
                        shard.counters.evicted_bytes += gone.size as u64;
                    }
                    tracing::debug!(bytes = size, "pooled allocator evicted an idle segment");
                }
                ReleaseOutcome::Failed(failed) => {
                    let (block, error) = failed.into_parts();
                    tracing::debug!(%error, "inner allocator refused an idle segment; it stays cached");
                    if let Some(entry) = shard.segments.get_mut(segment) {
                        let (head, size) = (entry.head, entry.size);
                        entry.block = Some(block);
                        shard.free_pieces.insert((size, head));
                        shard.cached_bytes += size;
                    }
                }
                ReleaseOutcome::Quarantined(quarantine) => {
                    tracing::warn!(error = %quarantine.error(), "eviction: inner allocator quarantined a segment");
                    let (block, _) = quarantine.into_parts();
                    if let Some(entry) = shard.segments.get_mut(segment) {
                        entry.block = Some(block);
                        entry.quarantined = true;
                    }
                }
            }
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

    /// Puts a block the inner allocator handed back into its record (or segment) again,
    /// live for the caller's retry.
    fn restore_live(&self, index: usize, slot: usize, block: RawAllocation, allocation: &RawAllocation) {
        let Some(mut guard) = self.shards.lock(index) else { return };
        let shard: &mut Shard = &mut guard;
        let segment = shard.piece(slot).map(|(segment, ..)| segment);
        if let Some(record) = shard.records.get_mut(slot) {
            record.state = State::Live { bytes: allocation.bytes(), align: allocation.align() };
            match (&mut record.body, segment.and_then(|segment| shard.segments.get_mut(segment))) {
                (Body::Whole { block: slot_block, .. }, _) => *slot_block = Some(block),
                (Body::Piece { .. }, Some(segment)) => segment.block = Some(block),
                (Body::Piece { .. }, None) => {}
            }
        }
        let counters = &mut shard.counters;
        counters.live_bytes += allocation.bytes() as u64;
        counters.live_blocks += 1;
        counters.passed_through -= 1;
    }

    /// Releases a block the cache does not keep; the inner outcome is the caller's.
    /// `forget` removes the record (and segment) once the inner release completed.
    fn pass_through(
        &self,
        index: usize,
        slot: usize,
        block: RawAllocation,
        allocation: RawAllocation,
        evictions: Vec<Eviction>,
    ) -> ReleaseOutcome {
        self.finish_evictions(index, evictions);
        match self.inner.release(block) {
            ReleaseOutcome::Complete(done) => {
                if let Some(mut guard) = self.shards.lock(index) {
                    let shard: &mut Shard = &mut guard;
                    if let Some((segment, ..)) = shard.piece(slot) {
                        shard.segments.remove(segment);
                    }
                    shard.records.remove(slot);
                }
                ReleaseOutcome::complete(done.unmapped_bytes())
            }
            ReleaseOutcome::Failed(failed) => {
                let (block, error) = failed.into_parts();
                self.restore_live(index, slot, block, &allocation);
                ReleaseOutcome::failed(allocation, error)
            }
            ReleaseOutcome::Quarantined(quarantine) => {
                let residual = quarantine.residual_bytes().min(allocation.bytes());
                let unmapped = quarantine.unmapped_bytes().min(allocation.bytes() - residual);
                let (block, error) = quarantine.into_parts();
                self.restore_live(index, slot, block, &allocation);
                tracing::warn!(%error, unmapped, residual, "pooled release quarantined by the inner allocator");
                ReleaseOutcome::quarantined(allocation, unmapped, residual, error)
            }
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
            if let Some(mut shard) = self.shards.lock(home)
                && let Some(block) = self.take_cached(&mut shard, home, key, request)
            {
                return Ok(block);
            }
            for offset in 1..self.shards.len() {
                let index = (home + offset) & (self.shards.len() - 1);
                if let Some(mut shard) = self.shards.try_lock(index)
                    && let Some(block) = self.take_cached(&mut shard, index, key, request)
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
        let Some(mut guard) = self.shards.lock(home) else { unreachable!("the local shard exists") };
        let shard: &mut Shard = &mut guard;
        let state = State::Live { bytes: request.bytes(), align: request.align() };
        let slot = match key {
            Key::Class(class) => {
                shard.records.insert(Record { state, body: Body::Whole { block: Some(block), class: Some(class) } })
            }
            Key::Direct => {
                shard.records.insert(Record { state, body: Body::Whole { block: Some(block), class: None } })
            }
            Key::Large { .. } => {
                let size = inner_request.bytes();
                let segment = shard.segments.insert(Segment {
                    block: Some(block),
                    size,
                    head: usize::MAX,
                    live: 1,
                    idle_since: 0,
                    lost: false,
                    quarantined: false,
                });
                let slot = shard
                    .records
                    .insert(Record { state, body: Body::Piece { segment, offset: 0, size, prev: None, next: None } });
                if let Some(segment) = shard.segments.get_mut(segment) {
                    segment.head = slot;
                }
                slot
            }
        };
        let counters = &mut shard.counters;
        counters.misses += 1;
        counters.requested_bytes += request.bytes() as u64;
        counters.live_bytes += request.bytes() as u64;
        counters.live_blocks += 1;
        drop(guard);
        Ok(RawAllocation::new(address, request.bytes(), request.align(), self.device(), tag(home, slot)))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        if allocation.device() != self.device() {
            return self.refuse(allocation);
        }
        let (index, slot) = untag(allocation.provider_tag());
        let Some(mut guard) = self.shards.lock(index) else { return self.refuse(allocation) };
        let shard: &mut Shard = &mut guard;
        let address = match shard.records.get(slot) {
            Some(Record { state: State::Live { bytes, align }, body })
                if *bytes == allocation.bytes() && *align == allocation.align() =>
            {
                match body {
                    Body::Whole { block, .. } => block.as_ref().map(RawAllocation::address),
                    Body::Piece { .. } => shard.piece_address(slot),
                }
            }
            _ => None,
        };
        if address != Some(allocation.address()) {
            drop(guard);
            return self.refuse(allocation);
        }
        shard.counters.live_bytes -= allocation.bytes() as u64;
        shard.counters.live_blocks -= 1;
        match shard.piece(slot) {
            None => self.release_whole(guard, index, slot, allocation),
            Some((segment, _, size, prev, next)) => {
                self.release_piece(guard, index, slot, (segment, size, prev.is_none() && next.is_none()), allocation)
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
            let (wholes, segments) = {
                let Some(mut guard) = self.shards.lock(index) else { continue };
                let shard: &mut Shard = &mut guard;
                let mut wholes = Vec::new();
                let mut uncached = 0;
                for (slot, record) in shard.records.iter_mut() {
                    if matches!(record.state, State::Cached | State::Quarantined)
                        && let Body::Whole { block, .. } = &mut record.body
                        && let Some(block) = block.take()
                    {
                        if matches!(record.state, State::Cached) {
                            uncached += block.bytes();
                        }
                        record.state = State::Releasing;
                        wholes.push((slot, block));
                    }
                }
                shard.cached_bytes -= uncached;
                shard.classes.iter_mut().for_each(Vec::clear);
                let mut segments = Vec::new();
                let candidates: Vec<usize> = shard
                    .segments
                    .iter()
                    .filter(|(_, segment)| segment.is_idle() || (segment.quarantined && segment.live == 0))
                    .map(|(segment, _)| segment)
                    .collect();
                for segment in candidates {
                    if shard.segments.get(segment).is_some_and(|segment| segment.quarantined) {
                        if let Some(entry) = shard.segments.get_mut(segment) {
                            entry.quarantined = false;
                            segments.extend(entry.block.take().map(|block| Eviction { segment, block }));
                        }
                    } else {
                        segments.extend(shard.take_idle(segment));
                    }
                }
                shard.counters.trims += u64::from(index == 0);
                (wholes, segments)
            };
            for (slot, block) in wholes {
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
                        if let Some(mut guard) = self.shards.lock(index) {
                            let shard: &mut Shard = &mut guard;
                            if let Some(record) = shard.records.get_mut(slot)
                                && let Body::Whole { block: slot_block, class } = &mut record.body
                            {
                                *slot_block = Some(block);
                                record.state = State::Cached;
                                let class = *class;
                                shard.cached_bytes += size;
                                if let Some(class) = class {
                                    shard.push_class(class, slot);
                                }
                            }
                        }
                    }
                    ReleaseOutcome::Quarantined(quarantine) => {
                        tracing::warn!(error = %quarantine.error(), "trim: inner allocator quarantined a cached block");
                        let (block, _) = quarantine.into_parts();
                        if let Some(mut shard) = self.shards.lock(index)
                            && let Some(record) = shard.records.get_mut(slot)
                            && let Body::Whole { block: slot_block, .. } = &mut record.body
                        {
                            *slot_block = Some(block);
                            record.state = State::Quarantined;
                        }
                    }
                }
            }
            for Eviction { segment, block } in segments {
                let size = block.bytes();
                let outcome = self.inner.release(block);
                let Some(mut guard) = self.shards.lock(index) else { continue };
                let shard: &mut Shard = &mut guard;
                match outcome {
                    ReleaseOutcome::Complete(_) => {
                        returned += size;
                        if let Some(gone) = shard.segments.remove(segment) {
                            shard.records.remove(gone.head);
                        }
                        shard.counters.trimmed_bytes += size as u64;
                    }
                    ReleaseOutcome::Failed(failed) => {
                        // Nothing happened: keep it cached.
                        let (block, _) = failed.into_parts();
                        if let Some(entry) = shard.segments.get_mut(segment) {
                            let (head, size) = (entry.head, entry.size);
                            entry.block = Some(block);
                            shard.free_pieces.insert((size, head));
                            shard.cached_bytes += size;
                        }
                    }
                    ReleaseOutcome::Quarantined(quarantine) => {
                        tracing::warn!(error = %quarantine.error(), "trim: inner allocator quarantined a free segment");
                        let (block, _) = quarantine.into_parts();
                        if let Some(entry) = shard.segments.get_mut(segment) {
                            entry.block = Some(block);
                            entry.quarantined = true;
                        }
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
            let Some(mut guard) = self.shards.lock(index) else { continue };
            let shard: &mut Shard = &mut guard;
            let address = match shard.records.get(slot) {
                Some(Record { state: State::Live { .. }, body: Body::Whole { block, .. } }) => {
                    block.as_ref().map(RawAllocation::address)
                }
                Some(Record { state: State::Live { .. }, body: Body::Piece { .. } }) => shard.piece_address(slot),
                _ => None,
            };
            if address != Some(allocation.address()) {
                continue;
            }
            shard.counters.live_bytes -= allocation.bytes() as u64;
            shard.counters.live_blocks -= 1;
            match shard.piece(slot) {
                None => {
                    if let Some(Record { body: Body::Whole { block, .. }, .. }) = shard.records.remove(slot) {
                        inner_blocks.extend(block);
                    }
                }
                Some((segment, ..)) => {
                    if let Some(record) = shard.records.get_mut(slot) {
                        record.state = State::Lost;
                    }
                    shard.lose_segment(segment);
                    if let Some(entry) = shard.segments.get_mut(segment) {
                        entry.live -= 1;
                    }
                    inner_blocks.extend(shard.drop_lost_segment(segment));
                }
            }
        }
        self.inner.forget_lost(inner_blocks);
    }
}

impl<A: DeviceAllocator> PooledAllocator<A> {
    /// Releases a validated size-class or uncached block: cached if it fits under the
    /// cap (after evicting idle segments), otherwise released to the inner allocator.
    fn release_whole(
        &self,
        mut guard: std::sync::MutexGuard<'_, Shard>,
        index: usize,
        slot: usize,
        allocation: RawAllocation,
    ) -> ReleaseOutcome {
        let shard: &mut Shard = &mut guard;
        let Some(Record { body: Body::Whole { block, class }, .. }) = shard.records.get(slot) else {
            unreachable!("validated as a whole block")
        };
        let (class, size) = (*class, block.as_ref().map_or(0, RawAllocation::bytes));
        let evictions = if class.is_some() { self.make_room(shard, size, None) } else { Vec::new() };
        if let Some(class) = class
            && shard.cached_bytes + size <= self.shard_cap
        {
            if let Some(record) = shard.records.get_mut(slot) {
                record.state = State::Cached;
            }
            shard.cached_bytes += size;
            shard.push_class(class, slot);
            drop(guard);
            self.finish_evictions(index, evictions);
            return ReleaseOutcome::complete(0);
        }
        // Not cacheable, or the shard's share of the cache is full: release for real.
        let Some(record) = shard.records.get_mut(slot) else { unreachable!("validated above") };
        record.state = State::Releasing;
        let Body::Whole { block, .. } = &mut record.body else { unreachable!("validated as a whole block") };
        let block = block.take().expect("a live record holds its block");
        shard.counters.passed_through += 1;
        drop(guard);
        self.pass_through(index, slot, block, allocation, evictions)
    }

    /// Releases a validated piece of `segment` (`size` bytes; `whole` when it is the
    /// entire segment): into the cache, merged with free neighbours, evicting idle
    /// segments to stay under the cap. A whole segment that cannot fit is released to
    /// the inner allocator, its outcome the caller's.
    fn release_piece(
        &self,
        mut guard: std::sync::MutexGuard<'_, Shard>,
        index: usize,
        slot: usize,
        (segment, size, whole): (usize, usize, bool),
        allocation: RawAllocation,
    ) -> ReleaseOutcome {
        let shard: &mut Shard = &mut guard;
        if shard.segments.get(segment).is_some_and(|entry| entry.lost) {
            // The device went with another piece: nothing in the segment is reused or freed.
            if let Some(record) = shard.records.get_mut(slot) {
                record.state = State::Lost;
            }
            if let Some(entry) = shard.segments.get_mut(segment) {
                entry.live -= 1;
            }
            let forgotten = shard.drop_lost_segment(segment);
            drop(guard);
            self.inner.forget_lost(forgotten.into_iter().collect());
            return ReleaseOutcome::complete(0);
        }
        let evictions = if whole {
            let evictions = self.make_room(shard, size, Some(segment));
            if shard.cached_bytes + size > self.shard_cap {
                let Some(record) = shard.records.get_mut(slot) else { unreachable!("validated above") };
                record.state = State::Releasing;
                let Some(entry) = shard.segments.get_mut(segment) else { unreachable!("a piece has its segment") };
                let block = entry.block.take().expect("a segment with a live piece holds its block");
                shard.counters.passed_through += 1;
                drop(guard);
                return self.pass_through(index, slot, block, allocation, evictions);
            }
            shard.free_piece(slot);
            evictions
        } else {
            shard.free_piece(slot);
            self.make_room(shard, 0, None)
        };
        drop(guard);
        self.finish_evictions(index, evictions);
        ReleaseOutcome::complete(0)
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
impl<A: DeviceAllocator> PooledAllocator<A> {
    /// Panics unless every shard's books agree with its records: pieces tile their
    /// segment in address order with consistent links, no two free pieces neighbour,
    /// live counts match, the free index holds exactly the reusable free pieces, and
    /// `cached_bytes` is their sum plus the cached class blocks.
    fn assert_consistent(&self) {
        for index in 0..self.shards.len() {
            let shard = self.shards.lock(index).expect("shard");
            let mut cached = 0;
            let mut indexed = 0;
            for (_, record) in shard.records.iter() {
                if let (State::Cached, Body::Whole { block, .. }) = (&record.state, &record.body) {
                    cached += block.as_ref().expect("a cached class block holds its block").bytes();
                }
            }
            for (segment_index, segment) in shard.segments.iter() {
                let (mut offset, mut live, mut previous, mut previous_free) = (0, 0, None, false);
                for slot in shard.pieces_of(segment_index) {
                    let (owner, at, size, prev, _) = shard.piece(slot).expect("a piece");
                    let state = &shard.records.get(slot).expect("a record").state;
                    assert_eq!((owner, at, prev), (segment_index, offset, previous), "piece {slot} out of place");
                    let free = matches!(state, State::Cached);
                    assert!(!(free && previous_free) || segment.lost, "two free pieces neighbour in {segment_index}");
                    live += usize::from(matches!(state, State::Live { .. } | State::Releasing));
                    let reusable = free && !segment.lost && !segment.quarantined && segment.block.is_some();
                    assert_eq!(shard.free_pieces.contains(&(size, slot)), reusable, "free index at piece {slot}");
                    if reusable {
                        cached += size;
                        indexed += 1;
                    }
                    (offset, previous, previous_free) = (offset + size, Some(slot), free);
                }
                assert_eq!(offset, segment.size, "pieces of segment {segment_index} do not tile it");
                assert_eq!(live, segment.live, "live pieces of segment {segment_index}");
            }
            assert_eq!(indexed, shard.free_pieces.len(), "the free index holds stale entries");
            assert_eq!(cached, shard.cached_bytes, "cached bytes of shard {index}");
        }
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

    const MIB: usize = 1 << 20;

    fn address_of(block: &RawAllocation) -> u64 {
        block.address().get()
    }

    #[test]
    fn a_free_segment_serves_smaller_large_requests_by_splitting() {
        let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(256 * MIB));
        let big = pool.allocate(&request(8 * MIB, 64)).unwrap();
        let base = address_of(&big);
        assert!(pool.release(big).is_complete());
        let first = pool.allocate(&request(3 * MIB - 100, 64)).unwrap();
        assert_eq!(address_of(&first), base, "best fit starts at the free piece");
        let second = pool.allocate(&request(4 * MIB, 64)).unwrap();
        assert_eq!(address_of(&second), base + 3 * MIB as u64, "the split-off rest serves the next request");
        assert_eq!(pool.inner().calls(Callback::Allocate), 1, "both came out of the one segment");
        let stats = pool.pool_stats();
        assert_eq!((stats.hits, stats.misses, stats.segments, stats.segment_bytes), (2, 1, 1, 8 * MIB as u64));
        // 1 MiB is left: too small for another large request, so it went with the
        // second piece instead of staying behind as a free piece nothing could use.
        assert_eq!((stats.cached_bytes, stats.cached_blocks), (0, 0));
        let third = pool.allocate(&request(2 * MIB, 64)).unwrap();
        assert_eq!(pool.inner().calls(Callback::Allocate), 2, "nothing free holds 2 MiB");
        for block in [first, second, third] {
            assert!(pool.release(block).is_complete());
        }
    }

    #[test]
    fn freed_pieces_merge_with_free_neighbours_into_the_whole_segment() {
        let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(256 * MIB));
        let big = pool.allocate(&request(12 * MIB, 64)).unwrap();
        let base = address_of(&big);
        assert!(pool.release(big).is_complete());
        let pieces: Vec<_> = (0..3).map(|_| pool.allocate(&request(4 * MIB, 64)).unwrap()).collect();
        let addresses: Vec<u64> = pieces.iter().map(address_of).collect();
        assert_eq!(addresses, [base, base + 4 * MIB as u64, base + 8 * MIB as u64]);
        // Free the middle, then the ends: every order must end in one free piece.
        let [a, b, c] = <[RawAllocation; 3]>::try_from(pieces).unwrap();
        for block in [b, c, a] {
            assert!(pool.release(block).is_complete());
        }
        let stats = pool.pool_stats();
        assert_eq!((stats.cached_blocks, stats.cached_bytes), (1, 12 * MIB as u64), "{stats:?}");
        let whole = pool.allocate(&request(12 * MIB, 64)).unwrap();
        assert_eq!(address_of(&whole), base, "the merged segment serves a request of its full size");
        assert_eq!(pool.inner().calls(Callback::Allocate), 1);
        assert!(pool.release(whole).is_complete());
        assert_eq!(pool.trim(), 12 * MIB);
        assert_eq!(pool.pool_stats().segments, 0);
    }

    #[test]
    fn the_cap_evicts_the_least_recently_idle_segment_to_keep_the_newest_block() {
        // The pattern of ONNX Runtime's first two runs: many buffers of one run are
        // cached, then the next run asks for one block larger than any of them.
        let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(24 * MIB));
        let old: Vec<_> = [4, 6, 5].map(|mib| pool.allocate(&request(mib * MIB, 64)).unwrap()).into();
        for block in old {
            assert!(pool.release(block).is_complete());
        }
        assert_eq!(pool.pool_stats().cached_bytes, 15 * MIB as u64);
        let pattern = pool.allocate(&request(16 * MIB, 64)).unwrap();
        assert!(pool.release(pattern).is_complete());
        let stats = pool.pool_stats();
        assert_eq!((stats.evicted_segments, stats.evicted_bytes), (2, 10 * MIB as u64), "the 4 and 6 MiB went first");
        assert_eq!((stats.cached_bytes, stats.passed_through), (21 * MIB as u64, 0));
        let releases = pool.inner().calls(Callback::Release);
        let allocations = pool.inner().calls(Callback::Allocate);
        for _ in 0..3 {
            let again = pool.allocate(&request(16 * MIB, 64)).unwrap();
            assert!(pool.release(again).is_complete());
        }
        assert_eq!(pool.inner().calls(Callback::Allocate), allocations, "the next runs are served from the cache");
        assert_eq!(pool.inner().calls(Callback::Release), releases);
        assert_eq!(pool.trim(), 21 * MIB);
    }

    #[test]
    fn a_segment_larger_than_the_whole_cap_is_released_to_the_inner_allocator() {
        let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(4 * MIB));
        let cached = pool.allocate(&request(2 * MIB, 64)).unwrap();
        assert!(pool.release(cached).is_complete());
        let big = pool.allocate(&request(5 * MIB, 64)).unwrap();
        let ReleaseOutcome::Complete(done) = pool.release(big) else { panic!("must complete") };
        assert_eq!(done.unmapped_bytes(), 5 * MIB, "passed through");
        let stats = pool.pool_stats();
        assert_eq!((stats.passed_through, stats.evicted_segments, stats.cached_bytes), (1, 1, 0));
        assert_eq!(pool.inner().calls(Callback::Release), 2);
    }

    #[test]
    fn pieces_honour_alignments_beyond_the_segment_granularity() {
        let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(256 * MIB));
        let big = pool.allocate(&request(16 * MIB, 64)).unwrap();
        assert!(pool.release(big).is_complete());
        let first = pool.allocate(&request(2 * MIB + 4096, 64)).unwrap();
        let aligned = pool.allocate(&request(2 * MIB, 1 << 16)).unwrap();
        assert!(aligned.address().is_aligned_to(1 << 16), "{aligned:?}");
        let misaligned_rest = address_of(&first) + (2 * MIB + 4096) as u64;
        if misaligned_rest % (1 << 16) != 0 {
            assert_eq!(pool.inner().calls(Callback::Allocate), 2, "a free piece at the wrong alignment is skipped");
        }
        for block in [first, aligned] {
            assert!(pool.release(block).is_complete());
        }
    }

    #[test]
    fn trim_returns_free_segments_and_keeps_partly_used_ones() {
        let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(256 * MIB));
        let big = pool.allocate(&request(8 * MIB, 64)).unwrap();
        assert!(pool.release(big).is_complete());
        let piece = pool.allocate(&request(3 * MIB, 64)).unwrap();
        assert_eq!(pool.trim(), 0, "the segment is partly in use");
        assert_eq!(pool.pool_stats().cached_bytes, 5 * MIB as u64, "its free rest stays cached");
        assert!(pool.release(piece).is_complete());
        assert_eq!(pool.trim(), 8 * MIB);
        let stats = pool.pool_stats();
        assert_eq!((stats.segments, stats.cached_bytes, stats.trimmed_bytes), (0, 0, 8 * MIB as u64));
        assert_eq!(pool.inner().inner().stats().unwrap().live_allocations, 0);
    }

    #[test]
    fn an_eviction_the_inner_allocator_refuses_or_quarantines_stays_with_the_pool() {
        let pool = PooledAllocator::with_config(FaultyAllocator::new(SystemAllocator::new()), one_shard(10 * MIB));
        let old = pool.allocate(&request(6 * MIB, 64)).unwrap();
        assert!(pool.release(old).is_complete());
        let new = pool.allocate(&request(8 * MIB, 64)).unwrap();
        pool.inner().fail_nth(Callback::Release, 1);
        assert!(pool.release(new).is_complete(), "the caller's block went into the cache");
        let stats = pool.pool_stats();
        assert_eq!((stats.evicted_segments, stats.cached_bytes), (0, 14 * MIB as u64), "the refused segment stays");
        // The next eviction is quarantined: the segment is held, not reused, until a trim.
        let other = pool.allocate(&request(2 * MIB, 64)).unwrap();
        pool.inner().quarantine_nth_release(1, 0, 6 * MIB);
        assert!(pool.release(other).is_complete());
        let stats = pool.pool_stats();
        assert_eq!(stats.quarantined_blocks, 1, "{stats:?}");
        assert_eq!(pool.trim(), 6 * MIB + 8 * MIB, "trim retries the quarantined segment and frees the rest");
        let stats = pool.pool_stats();
        assert_eq!((stats.quarantined_blocks, stats.segments, stats.cached_bytes), (0, 0, 0), "{stats:?}");
        assert_eq!(pool.inner().inner().stats().unwrap().live_allocations, 0);
    }

    #[test]
    fn a_lost_piece_retires_its_segment_and_forwards_it_once_empty() {
        let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(256 * MIB));
        let big = pool.allocate(&request(12 * MIB, 64)).unwrap();
        assert!(pool.release(big).is_complete());
        let a = pool.allocate(&request(4 * MIB, 64)).unwrap();
        let b = pool.allocate(&request(4 * MIB, 64)).unwrap();
        pool.forget_lost(vec![a]);
        assert_eq!(pool.pool_stats().cached_bytes, 0, "the lost segment's free rest is not reused");
        let fresh = pool.allocate(&request(4 * MIB, 64)).unwrap();
        assert_eq!(pool.inner().calls(Callback::Allocate), 2);
        assert_eq!(pool.inner().forgotten_blocks(), 0, "b still lives in the segment");
        pool.forget_lost(vec![b]);
        assert_eq!(pool.inner().forgotten_blocks(), 1, "the whole segment is forgotten, once");
        let stats = pool.pool_stats();
        assert_eq!((stats.segments, stats.live_blocks), (1, 1));
        assert!(pool.release(fresh).is_complete());
    }

    #[test]
    fn a_repeated_pattern_of_runs_reaches_a_steady_state_without_inner_calls() {
        // Default settings, as a runtime would use them: a first run of many sizes,
        // then runs of the same few large blocks.
        let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
        let mut live = Vec::new();
        for i in 0..200usize {
            live.push(pool.allocate(&request((1 + i % 9) * MIB + i * 4096, 64)).unwrap());
            if live.len() > 6 {
                assert!(pool.release(live.remove(i % 5)).is_complete());
            }
        }
        for block in live.drain(..) {
            assert!(pool.release(block).is_complete());
        }
        let mut steady = None;
        for run in 0..5 {
            let blocks: Vec<_> =
                [43 * MIB, 3 * MIB + 12345, 2 * MIB].map(|b| pool.allocate(&request(b, 64)).unwrap()).into();
            for block in blocks {
                assert!(pool.release(block).is_complete());
            }
            let calls = pool.inner().counts().total();
            if run >= 1 {
                assert_eq!(*steady.get_or_insert(calls), calls, "run {run} reached the inner allocator");
            }
        }
        assert!(pool.pool_stats().cached_bytes as usize <= pool.config().max_cached_bytes);
    }

    mod model {
        use super::*;
        use proptest::prelude::*;

        #[derive(Clone, Debug)]
        enum Op {
            Allocate { bytes: usize, align: usize },
            Release(usize),
            Trim,
            Lose(usize),
        }

        fn op() -> impl Strategy<Value = Op> {
            let sizes = prop_oneof![1..4096usize, 4096..(2 * MIB), (2 * MIB)..(24 * MIB)];
            let aligns = prop_oneof![Just(8usize), Just(64), Just(4096), Just(1 << 16)];
            prop_oneof![
                6 => (sizes, aligns).prop_map(|(bytes, align)| Op::Allocate { bytes, align }),
                5 => any::<usize>().prop_map(Op::Release),
                1 => Just(Op::Trim),
                1 => any::<usize>().prop_map(Op::Lose),
            ]
        }

        /// Writes `stamp` at both ends of `block` (host memory the test owns).
        fn stamp(block: &RawAllocation, stamp: u64) {
            let ends = [0, block.bytes().saturating_sub(8)];
            for at in ends.into_iter().filter(|_| block.bytes() >= 8) {
                // SAFETY: the block is live, at least 8 bytes long and host memory handed
                // to this test alone; `at + 8 <= bytes`. Unaligned writes are used.
                unsafe { block.address().as_host_ptr().add(at).cast::<u64>().write_unaligned(stamp) };
            }
        }

        fn stamped(block: &RawAllocation) -> Option<[u64; 2]> {
            if block.bytes() < 8 {
                return None;
            }
            let read = |at: usize| {
                // SAFETY: as in `stamp`: a live host block of at least `at + 8` bytes.
                unsafe { block.address().as_host_ptr().add(at).cast::<u64>().read_unaligned() }
            };
            Some([read(0), read(block.bytes() - 8)])
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

            /// Random allocations, releases, trims and device losses: blocks stay disjoint,
            /// aligned and intact, the pool's books stay consistent after every step, and
            /// once everything is released and trimmed the inner allocator holds nothing
            /// but what was lost (forgotten, not freed).
            #[test]
            fn pieces_stay_disjoint_intact_and_accounted(
                ops in proptest::collection::vec(op(), 1..120),
                cap_mib in prop_oneof![Just(0usize), Just(8), Just(40), Just(256)],
                class_bytes in prop_oneof![Just(4096usize), Just(MIB)],
            ) {
                let config = PoolConfig { max_cached_bytes: cap_mib * MIB, max_class_bytes: class_bytes, shards: 1 };
                let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), config);
                let mut live: Vec<(RawAllocation, u64)> = Vec::new();
                for (step, op) in ops.into_iter().enumerate() {
                    match op {
                        Op::Allocate { bytes, align } => {
                            let block = pool.allocate(&request(bytes, align)).unwrap();
                            prop_assert!(block.address().is_aligned_to(align));
                            prop_assert_eq!(block.bytes(), bytes);
                            let (start, end) = (block.address().get(), block.address().get() + bytes as u64);
                            for (other, _) in &live {
                                let (a, b) = (other.address().get(), other.address().get() + other.bytes() as u64);
                                prop_assert!(end <= a || b <= start, "{:?} overlaps {:?}", block, other);
                            }
                            stamp(&block, step as u64);
                            live.push((block, step as u64));
                        }
                        Op::Release(pick) if !live.is_empty() => {
                            let (block, id) = live.swap_remove(pick % live.len());
                            if let Some(ends) = stamped(&block) {
                                prop_assert_eq!(ends, [id, id], "{:?} was overwritten", block);
                            }
                            prop_assert!(pool.release(block).is_complete());
                        }
                        Op::Lose(pick) if !live.is_empty() => {
                            let (block, _) = live.swap_remove(pick % live.len());
                            pool.forget_lost(vec![block]);
                        }
                        Op::Trim => {
                            pool.trim();
                        }
                        Op::Release(_) | Op::Lose(_) => {}
                    }
                    pool.assert_consistent();
                    let stats = pool.pool_stats();
                    prop_assert_eq!(stats.live_blocks, live.len() as u64);
                    prop_assert_eq!(stats.live_bytes, live.iter().map(|(b, _)| b.bytes() as u64).sum::<u64>());
                }
                for (block, _) in live {
                    prop_assert!(pool.release(block).is_complete());
                }
                pool.trim();
                pool.assert_consistent();
                let inner = pool.inner();
                let left = inner.inner().stats().unwrap().live_allocations;
                prop_assert_eq!(left, inner.forgotten_blocks(), "inner blocks left: {}", left);
            }
        }
    }
}
