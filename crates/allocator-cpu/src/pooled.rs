//! [`PooledAllocator`]: a caching allocator over any [`DeviceAllocator`].
//!
//! Two caches:
//! - **size classes** for requests up to [`PoolConfig::max_class_bytes`]: whole inner
//!   blocks, four classes per doubling, kept in per-thread shards so the hot path of
//!   small blocks takes no lock another thread uses;
//! - **segments** for larger requests: inner blocks carved best-fit into pieces, split
//!   when the rest could serve another large request, and merged with free neighbours
//!   when a piece comes back (as a BFC arena or PyTorch's large pool do). Memory one
//!   run of a model freed serves the next run's differently sized buffers instead of
//!   going back to the system and being faulted in again. Segments sit behind one
//!   lock: a request that large costs far more than the lock, and any thread's free
//!   segment memory serves every thread.
//!
//! Under the cap, wholly free segments go back to the inner allocator least recently
//! idle first; the block just released is the last to go, because it is the likeliest
//! to be asked for again (a runtime's next request of the same shape).

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crossbeam_utils::CachePadded;
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
/// Marks a provider tag's slot as a piece of a segment rather than a class record
/// (slots never come near 2^47).
const PIECE_TAG: usize = 1 << 47;

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
    /// Bytes of freed memory the pool may keep for reuse. It bounds the size-class
    /// caches (split evenly across shards) and, separately, the free memory of
    /// segments (pool-wide, so one large block of up to this size stays cached
    /// whichever thread frees it).
    pub max_cached_bytes: usize,
    /// Requests up to this size use size classes; larger ones are carved from segments.
    pub max_class_bytes: usize,
    /// Lock shards of the size classes; threads map onto them round-robin (rounded up
    /// to a power of two).
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

// ---------------------------------------------------------------------------------------
// Size classes: per-thread shards of whole blocks.
// ---------------------------------------------------------------------------------------

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
    /// Its size class; `None` for an uncached block.
    class: Option<usize>,
    state: State,
}

#[derive(Default)]
struct Shard {
    records: Slab<Record>,
    classes: Vec<Vec<usize>>,
    cached_bytes: usize,
    counters: PoolStats,
}

impl Shard {
    fn pop(&mut self, class: usize) -> Option<usize> {
        self.classes.get_mut(class)?.pop()
    }

    fn push(&mut self, class: usize, slot: usize) {
        if self.classes.len() <= class {
            self.classes.resize_with(class + 1, Vec::new);
        }
        self.classes[class].push(slot);
    }
}

// ---------------------------------------------------------------------------------------
// Segments: large blocks carved into pieces, behind one lock.
// ---------------------------------------------------------------------------------------

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum PieceState {
    /// Handed out with this size and alignment.
    Live { bytes: usize, align: usize },
    /// Free (in the free index unless its segment is lost, quarantined or being
    /// released).
    Free,
    /// Its whole segment is being released to the inner allocator for the caller.
    Releasing,
    /// Given up with its device (`forget_lost`): never reused or freed.
    Lost,
}

/// `size` bytes at `offset` in `segment`, with its neighbours in address order.
#[derive(Copy, Clone, Debug)]
struct Piece {
    state: PieceState,
    segment: usize,
    offset: usize,
    size: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// An inner block split into pieces that tile it. No two neighbouring pieces are both
/// free, so a wholly free segment is a single piece, its `head`.
struct Segment {
    /// The inner block; `None` while it is being released.
    block: Option<RawAllocation>,
    /// Its size (what was asked of the inner allocator).
    size: usize,
    /// The piece at offset 0 (never merged into another, so its slot is stable).
    head: usize,
    /// Pieces handed out now.
    live: usize,
    /// The clock when it last became wholly free (least recently idle goes first).
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
struct Segments {
    pieces: Slab<Piece>,
    segments: Slab<Segment>,
    /// Free pieces by (size, slot): best fit is the first at or above the request.
    free: BTreeSet<(usize, usize)>,
    cached_bytes: usize,
    clock: u64,
    counters: PoolStats,
}

impl Segments {
    /// The address of piece `slot`, while its segment holds its block.
    fn address(&self, slot: usize) -> Option<DeviceAddress> {
        let piece = self.pieces.get(slot)?;
        self.segments.get(piece.segment)?.block.as_ref()?.address().checked_add(piece.offset)
    }

    fn piece_mut(&mut self, slot: usize) -> &mut Piece {
        self.pieces.get_mut(slot).expect("pieces link only to live slots")
    }

    /// A new segment over `block` (`size` bytes), handed out whole for `request`.
    fn insert(&mut self, block: RawAllocation, size: usize, request: &AllocationRequest) -> usize {
        let segment = self.segments.insert(Segment {
            block: Some(block),
            size,
            head: usize::MAX,
            live: 1,
            idle_since: 0,
            lost: false,
            quarantined: false,
        });
        let state = PieceState::Live { bytes: request.bytes(), align: request.align() };
        let slot = self.pieces.insert(Piece { state, segment, offset: 0, size, prev: None, next: None });
        if let Some(segment) = self.segments.get_mut(segment) {
            segment.head = slot;
        }
        slot
    }

    /// Carves `bytes` at an address aligned to `align` out of the smallest free piece
    /// that holds it, splitting off the rest when it is larger than `split_above` (so
    /// another large request could use it; a smaller rest stays with the piece).
    fn take(
        &mut self,
        bytes: usize,
        align: usize,
        split_above: usize,
        request: &AllocationRequest,
    ) -> Option<(usize, DeviceAddress)> {
        let (size, slot) = self
            .free
            .range((bytes, 0)..)
            .copied()
            .find(|&(_, slot)| self.address(slot).is_some_and(|address| address.is_aligned_to(align)))?;
        let address = self.address(slot)?;
        self.free.remove(&(size, slot));
        let Piece { segment, offset, next, .. } = *self.pieces.get(slot)?;
        let rest = size - bytes;
        let taken = if rest > split_above {
            let split = self.pieces.insert(Piece {
                state: PieceState::Free,
                segment,
                offset: offset + bytes,
                size: rest,
                prev: Some(slot),
                next,
            });
            if let Some(following) = next {
                self.piece_mut(following).prev = Some(split);
            }
            let piece = self.piece_mut(slot);
            (piece.size, piece.next) = (bytes, Some(split));
            self.free.insert((rest, split));
            bytes
        } else {
            size
        };
        self.cached_bytes -= taken;
        self.piece_mut(slot).state = PieceState::Live { bytes: request.bytes(), align: request.align() };
        if let Some(segment) = self.segments.get_mut(segment) {
            segment.live += 1;
        }
        Some((slot, address))
    }

    /// Frees live piece `slot` into the cache, merging it with free neighbours.
    fn free_piece(&mut self, slot: usize) {
        let Some(&Piece { segment, size, prev, next, .. }) = self.pieces.get(slot) else { return };
        self.piece_mut(slot).state = PieceState::Free;
        self.cached_bytes += size;
        let mut merged = slot;
        if let Some(after) = self.free_neighbour(next) {
            self.absorb_next(merged, after);
        }
        if let Some(before) = self.free_neighbour(prev) {
            self.absorb_next(before, merged);
            merged = before;
        }
        let merged_size = self.piece_mut(merged).size;
        self.free.insert((merged_size, merged));
        if let Some(segment) = self.segments.get_mut(segment) {
            segment.live -= 1;
            if segment.live == 0 {
                segment.idle_since = self.clock;
                self.clock += 1;
            }
        }
    }

    fn free_neighbour(&self, slot: Option<usize>) -> Option<usize> {
        let slot = slot?;
        (self.pieces.get(slot)?.state == PieceState::Free).then_some(slot)
    }

    /// Merges free piece `after` into its left neighbour `into` (which leaves the free
    /// index while it grows).
    fn absorb_next(&mut self, into: usize, after: usize) {
        let Some(absorbed) = self.pieces.remove(after) else { return };
        self.free.remove(&(absorbed.size, after));
        let piece = self.piece_mut(into);
        let into_size = piece.size;
        (piece.size, piece.next) = (into_size + absorbed.size, absorbed.next);
        self.free.remove(&(into_size, into));
        if let Some(following) = absorbed.next {
            self.piece_mut(following).prev = Some(into);
        }
    }

    /// Wholly free segments, least recently idle first, except `keep`.
    fn idle_lru(&self, keep: Option<usize>) -> Vec<usize> {
        let mut idle: Vec<(u64, usize)> = self
            .segments
            .iter()
            .filter(|&(index, segment)| Some(index) != keep && segment.is_idle())
            .map(|(index, segment)| (segment.idle_since, index))
            .collect();
        idle.sort_unstable();
        idle.into_iter().map(|(_, index)| index).collect()
    }

    /// Takes wholly free (or quarantined) segment `index` out of the cache for release.
    fn take_out(&mut self, index: usize) -> Option<Eviction> {
        let segment = self.segments.get_mut(index)?;
        let was_quarantined = std::mem::take(&mut segment.quarantined);
        let block = segment.block.take()?;
        let (head, size) = (segment.head, segment.size);
        if !was_quarantined {
            self.free.remove(&(size, head));
            self.cached_bytes -= size;
        }
        Some(Eviction { segment: index, block })
    }

    /// Puts back a segment the inner allocator did not release: free again, or held
    /// (quarantined) for the next trim.
    fn put_back(&mut self, index: usize, block: RawAllocation, quarantined: bool) {
        let Some(segment) = self.segments.get_mut(index) else { return };
        (segment.block, segment.quarantined) = (Some(block), quarantined);
        if !quarantined {
            let (head, size) = (segment.head, segment.size);
            self.free.insert((size, head));
            self.cached_bytes += size;
        }
    }

    /// Forgets a released segment and its single piece.
    fn remove(&mut self, index: usize) -> Option<Segment> {
        let segment = self.segments.remove(index)?;
        self.pieces.remove(segment.head);
        Some(segment)
    }

    /// The pieces of `segment` in address order.
    fn pieces_of(&self, segment: usize) -> Vec<usize> {
        let mut pieces = Vec::new();
        let mut cursor = self.segments.get(segment).map(|segment| segment.head);
        while let Some(slot) = cursor {
            pieces.push(slot);
            cursor = self.pieces.get(slot).and_then(|piece| piece.next);
        }
        pieces
    }

    /// Gives up live piece `slot` with its device; once its segment has no live piece
    /// left, the segment is dropped and its block returned, to be forgotten.
    fn lose(&mut self, slot: usize) -> Option<RawAllocation> {
        let segment = self.pieces.get(slot)?.segment;
        self.piece_mut(slot).state = PieceState::Lost;
        if self.segments.get(segment).is_some_and(|entry| !entry.lost) {
            // Its free pieces leave the cache for good.
            for piece in self.pieces_of(segment) {
                let Piece { state, size, .. } = *self.pieces.get(piece)?;
                if state == PieceState::Free && self.free.remove(&(size, piece)) {
                    self.cached_bytes -= size;
                }
            }
        }
        let entry = self.segments.get_mut(segment)?;
        entry.lost = true;
        entry.live -= 1;
        if entry.live > 0 {
            return None;
        }
        for piece in self.pieces_of(segment) {
            self.pieces.remove(piece);
        }
        self.segments.remove(segment)?.block
    }
}

// ---------------------------------------------------------------------------------------
// The pool.
// ---------------------------------------------------------------------------------------

/// Counters of a [`PooledAllocator`], summed over its shards and segments.
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
    /// Cached blocks or segments the inner allocator quarantined during a trim or an
    /// eviction (retried next trim).
    pub quarantined_blocks: u64,
    /// Inner blocks held to serve large requests (segments), in use or free.
    pub segments: u64,
    /// Their bytes.
    pub segment_bytes: u64,
    /// Wholly free segments handed back to the inner allocator to stay under the cap.
    pub evicted_segments: u64,
    /// Their bytes.
    pub evicted_bytes: u64,
}

impl PoolStats {
    fn add_counters(&mut self, c: &PoolStats) {
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
    }

    fn served(&mut self, request: &AllocationRequest, hit: bool) {
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

/// A caching allocator over any [`DeviceAllocator`].
///
/// - Requests up to [`PoolConfig::max_class_bytes`] round up to a size class (four per
///   doubling, from 256 bytes) and reuse whole blocks of that class. Requests whose
///   alignment exceeds their class's are passed through uncached.
/// - Larger requests round up to 4 KiB and are carved from **segments**: the smallest
///   free piece that holds the request at the requested alignment serves it, split when
///   the rest is larger than [`PoolConfig::max_class_bytes`] (so another large request
///   could use it); on a miss a new segment of exactly the rounded size is allocated.
///   A freed piece merges with its free neighbours, so a wholly free segment is one
///   piece again and serves any request up to its size.
/// - A released class block goes into its home shard's cache while the shard holds
///   less than its share of [`PoolConfig::max_cached_bytes`]; otherwise it is released
///   to the inner allocator. A released piece goes back into its segment; when free
///   segment memory exceeds the cap, wholly free segments are released to the inner
///   allocator, least recently idle first, and a block that alone does not fit is
///   released itself (its outcome is the caller's). [`DeviceAllocator::trim`] returns
///   every cached class block and wholly free segment; an out-of-memory from the inner
///   allocator triggers one trim and a retry. Free pieces of a segment partly in use
///   stay until it is wholly free.
/// - Class blocks take no global lock: each thread allocates from its own shard
///   (stealing from others with `try_lock` only on a miss), and a block remembers its
///   home shard in its provider tag. Segments share one lock.
/// - Every release is validated against the block's record (address, size, alignment,
///   state), so a foreign, forged or repeated release is refused and handed back.
/// - An inner release that fails or quarantines the caller's own block leaves it live,
///   so the caller can retry through the pool; a quarantine is reported with its byte
///   counts capped to the caller's block. A cached block or free segment the inner
///   allocator refuses stays cached; one it quarantines is held for the next trim.
///
/// Capabilities of the inner allocator are not forwarded: a cached block is not tied
/// to one owner, so commit/map state could leak between owners.
pub struct PooledAllocator<A: DeviceAllocator> {
    inner: A,
    name: String,
    config: PoolConfig,
    shard_cap: usize,
    shards: Shards<Shard>,
    segments: CachePadded<Mutex<Segments>>,
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
        let segments = CachePadded::new(Mutex::new(Segments::default()));
        PooledAllocator { inner, name, config, shard_cap, shards, segments }
    }

    /// The wrapped allocator.
    pub fn inner(&self) -> &A {
        &self.inner
    }

    /// The settings in force.
    pub fn config(&self) -> PoolConfig {
        self.config
    }

    /// Pool counters, summed over shards and segments.
    pub fn pool_stats(&self) -> PoolStats {
        let mut total = PoolStats::default();
        for index in 0..self.shards.len() {
            let Some(shard) = self.shards.lock(index) else { continue };
            total.add_counters(&shard.counters);
            total.cached_bytes += shard.cached_bytes as u64;
            for (_, record) in shard.records.iter() {
                match record.state {
                    State::Cached => total.cached_blocks += 1,
                    State::Quarantined => total.quarantined_blocks += 1,
                    _ => {}
                }
            }
        }
        let large = self.segments();
        total.add_counters(&large.counters);
        total.cached_bytes += large.cached_bytes as u64;
        total.cached_blocks += large.free.len() as u64;
        for (_, segment) in large.segments.iter() {
            total.segments += 1;
            total.segment_bytes += segment.size as u64;
            total.quarantined_blocks += u64::from(segment.quarantined);
        }
        total
    }

    /// Locks the segments. Every critical section leaves them consistent before it can
    /// panic, so a poisoned lock is still usable.
    fn segments(&self) -> MutexGuard<'_, Segments> {
        self.segments.lock().unwrap_or_else(PoisonError::into_inner)
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

    /// Serves `request` from shard `index`'s class cache, if it holds a block of `class`.
    fn take_cached(
        &self,
        mut guard: MutexGuard<'_, Shard>,
        index: usize,
        class: usize,
        request: &AllocationRequest,
    ) -> Option<RawAllocation> {
        let shard: &mut Shard = &mut guard;
        let slot = shard.pop(class)?;
        let record = shard.records.get_mut(slot).expect("free lists hold live slots");
        let block = record.block.as_ref().expect("a cached record holds its block");
        let (address, size) = (block.address(), block.bytes());
        record.state = State::Live { bytes: request.bytes(), align: request.align() };
        shard.cached_bytes -= size;
        shard.counters.served(request, true);
        Some(RawAllocation::new(address, request.bytes(), request.align(), self.device(), tag(index, slot)))
    }

    /// A piece of `slot` as the caller's block.
    fn piece_block(&self, slot: usize, address: DeviceAddress, request: &AllocationRequest) -> RawAllocation {
        RawAllocation::new(address, request.bytes(), request.align(), self.device(), tag(0, PIECE_TAG | slot))
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

    fn allocate_large(
        &self,
        (bytes, align): (usize, usize),
        inner_request: &AllocationRequest,
        request: &AllocationRequest,
    ) -> Result<RawAllocation, AllocError> {
        {
            let mut large = self.segments();
            if let Some((slot, address)) = large.take(bytes, align, self.config.max_class_bytes, request) {
                large.counters.served(request, true);
                return Ok(self.piece_block(slot, address, request));
            }
        }
        let block =
            self.allocate_inner(inner_request, request).inspect_err(|_| self.segments().counters.failures += 1)?;
        let address = block.address();
        let mut large = self.segments();
        let slot = large.insert(block, inner_request.bytes(), request);
        large.counters.served(request, false);
        Ok(self.piece_block(slot, address, request))
    }

    /// Takes wholly free segments out, least recently idle first and never `keep`,
    /// until `incoming` more free bytes fit under the cap. The caller releases them
    /// with [`PooledAllocator::finish_evictions`] after unlocking.
    fn make_room(&self, large: &mut Segments, incoming: usize, keep: Option<usize>) -> Vec<Eviction> {
        let cap = self.config.max_cached_bytes;
        if large.cached_bytes + incoming <= cap {
            return Vec::new();
        }
        let mut evictions = Vec::new();
        for segment in large.idle_lru(keep) {
            if large.cached_bytes + incoming <= cap {
                break;
            }
            evictions.extend(large.take_out(segment));
        }
        evictions
    }

    /// Releases segments taken out of the cache to the inner allocator (eviction or
    /// trim); returns the bytes released. One the inner allocator refuses is cached
    /// again; one it quarantines is held for the next trim.
    fn finish_evictions(&self, evictions: Vec<Eviction>, trimming: bool) -> usize {
        let mut returned = 0;
        for Eviction { segment, block } in evictions {
            let outcome = self.inner.release(block);
            let mut large = self.segments();
            match outcome {
                ReleaseOutcome::Complete(_) => {
                    let Some(gone) = large.remove(segment) else { continue };
                    returned += gone.size;
                    if trimming {
                        large.counters.trimmed_bytes += gone.size as u64;
                    } else {
                        large.counters.evicted_segments += 1;
                        large.counters.evicted_bytes += gone.size as u64;
                        tracing::debug!(bytes = gone.size, "pooled allocator evicted an idle segment");
                    }
                }
                ReleaseOutcome::Failed(failed) => {
                    let (block, error) = failed.into_parts();
                    tracing::debug!(%error, "inner allocator refused a free segment; it stays cached");
                    large.put_back(segment, block, false);
                }
                ReleaseOutcome::Quarantined(quarantine) => {
                    tracing::warn!(error = %quarantine.error(), "inner allocator quarantined a free segment");
                    let (block, _) = quarantine.into_parts();
                    large.put_back(segment, block, true);
                }
            }
        }
        returned
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

    /// Counts a class block live again after its release failed.
    fn undo_live(&self, index: usize, allocation: &RawAllocation) {
        if let Some(mut shard) = self.shards.lock(index) {
            shard.counters.live_bytes += allocation.bytes() as u64;
            shard.counters.live_blocks += 1;
            shard.counters.passed_through -= 1;
        }
    }

    fn release_class(&self, index: usize, slot: usize, allocation: RawAllocation) -> ReleaseOutcome {
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
        let size = record.block.as_ref().map_or(0, RawAllocation::bytes);
        if let Some(class) = record.class
            && shard.cached_bytes + size <= self.shard_cap
        {
            record.state = State::Cached;
            shard.cached_bytes += size;
            shard.push(class, slot);
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
                let (block, error, unmapped, residual) = capped(quarantine, &allocation);
                let state = State::Live { bytes: allocation.bytes(), align: allocation.align() };
                self.restore(index, slot, block, state);
                self.undo_live(index, &allocation);
                ReleaseOutcome::quarantined(allocation, unmapped, residual, error)
            }
        }
    }

    /// Releases a piece: back into its segment (merged with free neighbours), evicting
    /// idle segments to stay under the cap. A piece that is its whole segment and alone
    /// does not fit is released to the inner allocator, its outcome the caller's.
    fn release_piece(&self, slot: usize, allocation: RawAllocation) -> ReleaseOutcome {
        let mut guard = self.segments();
        let large: &mut Segments = &mut guard;
        let valid = large.pieces.get(slot).is_some_and(|piece| {
            matches!(piece.state, PieceState::Live { bytes, align } if bytes == allocation.bytes() && align == allocation.align())
        }) && large.address(slot) == Some(allocation.address());
        if !valid {
            drop(guard);
            return self.refuse(allocation);
        }
        large.counters.live_bytes -= allocation.bytes() as u64;
        large.counters.live_blocks -= 1;
        let Piece { segment, size, prev, next, .. } = *large.pieces.get(slot).expect("validated above");
        if large.segments.get(segment).is_some_and(|entry| entry.lost) {
            // Another piece went with the device: nothing in the segment is reused or freed.
            let forgotten = large.lose(slot);
            drop(guard);
            self.inner.forget_lost(forgotten.into_iter().collect());
            return ReleaseOutcome::complete(0);
        }
        let whole = prev.is_none() && next.is_none();
        let evictions = if whole {
            let evictions = self.make_room(large, size, Some(segment));
            if large.cached_bytes + size > self.config.max_cached_bytes {
                return self.pass_piece_through(guard, slot, segment, allocation, evictions);
            }
            large.free_piece(slot);
            evictions
        } else {
            large.free_piece(slot);
            self.make_room(large, 0, None)
        };
        drop(guard);
        self.finish_evictions(evictions, false);
        ReleaseOutcome::complete(0)
    }

    /// Releases the whole segment of piece `slot` to the inner allocator for the caller.
    fn pass_piece_through(
        &self,
        mut guard: MutexGuard<'_, Segments>,
        slot: usize,
        segment: usize,
        allocation: RawAllocation,
        evictions: Vec<Eviction>,
    ) -> ReleaseOutcome {
        let large: &mut Segments = &mut guard;
        large.piece_mut(slot).state = PieceState::Releasing;
        let entry = large.segments.get_mut(segment).expect("a piece has its segment");
        let block = entry.block.take().expect("a segment with a live piece holds its block");
        large.counters.passed_through += 1;
        drop(guard);
        self.finish_evictions(evictions, false);
        let outcome = self.inner.release(block);
        let mut large = self.segments();
        let (block, result) = match outcome {
            ReleaseOutcome::Complete(done) => {
                large.remove(segment);
                return ReleaseOutcome::complete(done.unmapped_bytes());
            }
            ReleaseOutcome::Failed(failed) => {
                let (block, error) = failed.into_parts();
                (block, Err(error))
            }
            ReleaseOutcome::Quarantined(quarantine) => {
                let (block, error, unmapped, residual) = capped(quarantine, &allocation);
                (block, Ok((error, unmapped, residual)))
            }
        };
        // Live again: the caller may retry.
        if let Some(entry) = large.segments.get_mut(segment) {
            entry.block = Some(block);
        }
        large.piece_mut(slot).state = PieceState::Live { bytes: allocation.bytes(), align: allocation.align() };
        large.counters.live_bytes += allocation.bytes() as u64;
        large.counters.live_blocks += 1;
        large.counters.passed_through -= 1;
        drop(large);
        match result {
            Err(error) => ReleaseOutcome::failed(allocation, error),
            Ok((error, unmapped, residual)) => ReleaseOutcome::quarantined(allocation, unmapped, residual, error),
        }
    }

    fn trim_classes(&self, index: usize) -> usize {
        let taken: Vec<(usize, RawAllocation)> = {
            let Some(mut shard) = self.shards.lock(index) else { return 0 };
            let mut taken = Vec::new();
            for (slot, record) in shard.records.iter_mut() {
                if matches!(record.state, State::Cached | State::Quarantined) {
                    record.state = State::Releasing;
                    taken.extend(record.block.take().map(|block| (slot, block)));
                }
            }
            shard.classes.iter_mut().for_each(Vec::clear);
            shard.cached_bytes = 0;
            shard.counters.trims += u64::from(index == 0);
            taken
        };
        let mut returned = 0;
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
                        let class = record.class;
                        record.block = Some(block);
                        record.state = State::Cached;
                        shard.cached_bytes += size;
                        if let Some(class) = class {
                            shard.push(class, slot);
                        }
                    }
                }
                ReleaseOutcome::Quarantined(quarantine) => {
                    tracing::warn!(error = %quarantine.error(), "trim: inner allocator quarantined a cached block");
                    let (block, _) = quarantine.into_parts();
                    self.restore(index, slot, block, State::Quarantined);
                }
            }
        }
        returned
    }

    fn trim_segments(&self) -> usize {
        let taken = {
            let mut large = self.segments();
            let candidates: Vec<usize> = large
                .segments
                .iter()
                .filter(|(_, segment)| segment.is_idle() || (segment.quarantined && segment.live == 0))
                .map(|(index, _)| index)
                .collect();
            candidates.into_iter().filter_map(|segment| large.take_out(segment)).collect()
        };
        self.finish_evictions(taken, true)
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
        self.inner.device()
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let (key, inner_request) = self.key_for(request);
        let class = match key {
            Key::Large { bytes, align } => return self.allocate_large((bytes, align), &inner_request, request),
            Key::Class(class) => Some(class),
            Key::Direct => None,
        };
        let home = self.shards.local();
        if let Some(class) = class {
            if let Some(shard) = self.shards.lock(home)
                && let Some(block) = self.take_cached(shard, home, class, request)
            {
                return Ok(block);
            }
            for offset in 1..self.shards.len() {
                let index = (home + offset) & (self.shards.len() - 1);
                if let Some(shard) = self.shards.try_lock(index)
                    && let Some(block) = self.take_cached(shard, index, class, request)
                {
                    return Ok(block);
                }
            }
        }
        let block = self.allocate_inner(&inner_request, request).inspect_err(|_| {
            if let Some(mut shard) = self.shards.lock(home) {
                shard.counters.failures += 1;
            }
        })?;
        let address = block.address();
        let Some(mut shard) = self.shards.lock(home) else { unreachable!("the local shard exists") };
        let state = State::Live { bytes: request.bytes(), align: request.align() };
        let slot = shard.records.insert(Record { block: Some(block), class, state });
        shard.counters.served(request, false);
        drop(shard);
        Ok(RawAllocation::new(address, request.bytes(), request.align(), self.device(), tag(home, slot)))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        if allocation.device() != self.device() {
            return self.refuse(allocation);
        }
        match untag(allocation.provider_tag()) {
            (0, slot) if slot & PIECE_TAG != 0 => self.release_piece(slot & !PIECE_TAG, allocation),
            (index, slot) => self.release_class(index, slot, allocation),
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
        (0..self.shards.len()).map(|index| self.trim_classes(index)).sum::<usize>() + self.trim_segments()
    }

    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        let mut inner_blocks = Vec::with_capacity(lost.len());
        for allocation in lost {
            match untag(allocation.provider_tag()) {
                (0, slot) if slot & PIECE_TAG != 0 => {
                    let slot = slot & !PIECE_TAG;
                    let mut large = self.segments();
                    let valid =
                        large.pieces.get(slot).is_some_and(|piece| matches!(piece.state, PieceState::Live { .. }))
                            && large.address(slot) == Some(allocation.address());
                    if valid {
                        large.counters.live_bytes -= allocation.bytes() as u64;
                        large.counters.live_blocks -= 1;
                        inner_blocks.extend(large.lose(slot));
                    }
                }
                (index, slot) => {
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
            }
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

#[cfg(test)]
impl<A: DeviceAllocator> PooledAllocator<A> {
    /// Panics unless the books agree with the records: each shard's cached bytes are
    /// its cached class blocks; pieces tile their segment in address order with
    /// consistent links, no two free pieces neighbour, live counts match, the free
    /// index holds exactly the reusable free pieces, and the segments' cached bytes
    /// are their sum.
    fn assert_consistent(&self) {
        for index in 0..self.shards.len() {
            let shard = self.shards.lock(index).expect("shard");
            let cached: usize = shard
                .records
                .iter()
                .filter(|(_, record)| matches!(record.state, State::Cached))
                .map(|(_, record)| record.block.as_ref().expect("a cached block").bytes())
                .sum();
            assert_eq!(cached, shard.cached_bytes, "cached bytes of shard {index}");
        }
        let large = self.segments();
        let (mut cached, mut indexed, mut tiled) = (0, 0, 0);
        for (index, segment) in large.segments.iter() {
            let (mut offset, mut live, mut previous, mut previous_free) = (0, 0, None, false);
            for slot in large.pieces_of(index) {
                let piece = large.pieces.get(slot).expect("a piece");
                assert_eq!((piece.segment, piece.offset, piece.prev), (index, offset, previous), "piece {slot}");
                let free = piece.state == PieceState::Free;
                assert!(!(free && previous_free), "two free pieces neighbour in segment {index}");
                live += usize::from(matches!(piece.state, PieceState::Live { .. } | PieceState::Releasing));
                let reusable = free && !segment.lost && !segment.quarantined && segment.block.is_some();
                assert_eq!(large.free.contains(&(piece.size, slot)), reusable, "free index at piece {slot}");
                if reusable {
                    cached += piece.size;
                    indexed += 1;
                }
                (offset, previous, previous_free) = (offset + piece.size, Some(slot), free);
                tiled += 1;
            }
            assert_eq!(offset, segment.size, "pieces of segment {index} do not tile it");
            assert_eq!(live, segment.live, "live pieces of segment {index}");
        }
        assert_eq!(tiled, large.pieces.len(), "pieces outside any segment");
        assert_eq!(indexed, large.free.len(), "the free index holds stale entries");
        assert_eq!(cached, large.cached_bytes, "cached bytes of the segments");
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
    fn a_large_block_up_to_the_whole_cap_stays_cached_whichever_thread_frees_it() {
        // Default settings: the class caches split the cap across shards, but free
        // segment memory is pool-wide, so a runtime's one large per-run buffer (larger
        // than a shard's share) is reused, not handed back and faulted in every run.
        let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
        assert!(pool.config().shards > 1);
        let share = pool.config().max_cached_bytes / pool.config().shards;
        let bytes = share + 8 * MIB;
        let block = pool.allocate(&request(bytes, 64)).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| assert!(pool.release(block).is_complete()));
        });
        let again = std::thread::scope(|s| s.spawn(|| pool.allocate(&request(bytes, 64)).unwrap()).join().unwrap());
        assert_eq!((pool.pool_stats().hits, pool.inner().calls(Callback::Allocate)), (1, 1));
        assert!(pool.release(again).is_complete());
        assert_eq!(pool.inner().calls(Callback::Release), 0);
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
        if !misaligned_rest.is_multiple_of(1 << 16) {
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

        /// Where a stamp goes in a block: its first 8 bytes, and its last 8 when they do
        /// not overlap the first.
        fn stamp_offsets(block: &RawAllocation) -> Vec<usize> {
            match block.bytes() {
                0..8 => vec![],
                8..16 => vec![0],
                bytes => vec![0, bytes - 8],
            }
        }

        /// Writes `stamp` at the ends of `block` (host memory the test owns).
        fn stamp(block: &RawAllocation, stamp: u64) {
            for at in stamp_offsets(block) {
                let word = block.address().checked_add(at).expect("inside the block").as_host_ptr().cast::<u64>();
                // SAFETY: the block is live host memory handed to this test alone, and
                // `at + 8 <= bytes`; the write is unaligned-safe.
                unsafe { word.write_unaligned(stamp) };
            }
        }

        /// Whether the stamps of `block` all read `stamp`.
        fn stamped(block: &RawAllocation, stamp: u64) -> bool {
            stamp_offsets(block).into_iter().all(|at| {
                let word = block.address().checked_add(at).expect("inside the block").as_host_ptr().cast::<u64>();
                // SAFETY: as in `stamp`: a live host block of at least `at + 8` bytes.
                unsafe { word.read_unaligned() == stamp }
            })
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
                            prop_assert!(stamped(&block, id), "{:?} was overwritten", block);
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
