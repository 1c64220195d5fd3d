//! The segment cache (BFC-style): requests larger than
//! [`PoolConfig::max_class_bytes`](super::PoolConfig) round up to 4 KiB and are carved
//! best-fit from inner blocks (segments) split into pieces that tile them. The smallest
//! free piece that holds a request at its alignment serves it, split when the rest
//! could serve another large request; a freed piece merges with its free neighbours,
//! so a wholly free segment is one piece again. A miss takes a new segment of exactly
//! the rounded size: replaying recorded ONNX Runtime sweeps, segments rounded up (to
//! 2 MiB, or to a sixteenth of their power of two) held 1-15 % more at the peak and
//! carving pieces from either end of a free piece changed nothing. Segments sit behind
//! one lock: a request that large costs far more than the lock, and any thread's free
//! segment memory serves every thread.
//!
//! Wholly free segments go back to the inner allocator without a caller's `trim`:
//! - **on a miss**, every one smaller than the request, before the new segment is
//!   taken: none can ever serve it, and a workload whose sizes grow (a runtime planning
//!   memory anew for a larger input shape) would otherwise keep every smaller generation
//!   of its buffers;
//! - **past the cap** (the high-water mark), after a release: least recently idle
//!   first, down to the low-water mark (three quarters of the cap), so a workload
//!   hovering at the cap does not give one segment back per release; the block just
//!   released goes last, being the likeliest to be asked for again;
//! - **when idle for long**: every [`AGE_CHECK_RELEASES`]th release, those that stayed
//!   wholly free through the last [`IDLE_ALLOCATIONS`] large allocations (memory the
//!   workload no longer uses; one that is used again later costs one inner allocation
//!   per that many).

use std::collections::BTreeSet;
use std::sync::{MutexGuard, PoisonError};

use memory_api::{AllocError, AllocationRequest, DeviceAddress, DeviceAllocator, RawAllocation, ReleaseOutcome};
use memory_sync::records::TakenRecord;

use super::records::{self, Held, LiveCells};
use super::{PoolStats, PooledAllocator, capped};
use crate::table::Slab;

/// Granularity (and least alignment) of segments and of the pieces carved from them.
pub(super) const LARGE_ROUND: usize = 4096;
/// A wholly free segment that serves none of this many large allocations in a row is
/// given back.
pub(super) const IDLE_ALLOCATIONS: u64 = 1024;
/// Idle segments are looked for every this many releases of pieces.
pub(super) const AGE_CHECK_RELEASES: u64 = 64;

/// The low-water mark under cap `cap`: what eviction past the cap goes down to.
pub(super) fn low_water(cap: usize) -> usize {
    cap - cap / 4
}

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
    /// The allocation clock when it last became wholly free (least recently idle goes
    /// first).
    idle_since: u64,
    /// Whether it may be reused (given up with the device, or damaged by a quarantined
    /// release, it is not).
    standing: Standing,
    /// The inner allocator quarantined it on release; the next trim retries.
    quarantined: bool,
}

/// Whether a segment may be reused.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Standing {
    /// Cached and reused as usual.
    Sound,
    /// Some piece was given up with the device (`forget_lost`): nothing in it is reused
    /// or freed.
    Lost,
    /// The inner allocator quarantined its release for a caller (part of it may be gone
    /// already): its one piece is live again for the caller's retry, which goes to the
    /// inner allocator, never into the cache.
    Damaged,
}

impl Segment {
    fn is_idle(&self) -> bool {
        self.live == 0 && self.standing == Standing::Sound && !self.quarantined && self.block.is_some()
    }
}

/// A wholly free segment taken out of the cache, to be released after unlocking.
struct Eviction {
    segment: usize,
    block: RawAllocation,
    why: Why,
}

/// Why a segment goes back to the inner allocator.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Why {
    /// A caller's `trim`.
    Trim,
    /// Free bytes passed the cap.
    Cap,
    /// A miss for a larger request.
    Outgrown,
    /// Idle through [`IDLE_ALLOCATIONS`] large allocations.
    Aged,
}

#[derive(Default)]
pub(super) struct Segments {
    pieces: Slab<Piece>,
    segments: Slab<Segment>,
    /// Free pieces by (size, slot): best fit is the first at or above the request.
    free: BTreeSet<(usize, usize)>,
    cached_bytes: usize,
    /// Large allocations served, ever: the clock of `idle_since`.
    clock: u64,
    /// Releases of pieces, ever (idle segments are looked for every
    /// [`AGE_CHECK_RELEASES`]).
    releases: u64,
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
            standing: Standing::Sound,
            quarantined: false,
        });
        let state = PieceState::Live { bytes: request.bytes(), align: request.align() };
        let slot = self.pieces.insert(Piece { state, segment, offset: 0, size, prev: None, next: None });
        if let Some(segment) = self.segments.get_mut(segment) {
            segment.head = slot;
        }
        self.clock += 1;
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
        self.clock += 1;
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

    /// Takes out, for release, every wholly free segment `pick` chooses.
    fn take_out_idle(&mut self, why: Why, pick: impl Fn(&Segment) -> bool) -> Vec<Eviction> {
        let picked: Vec<usize> = self
            .segments
            .iter()
            .filter(|&(_, segment)| segment.is_idle() && pick(segment))
            .map(|(index, _)| index)
            .collect();
        picked.into_iter().filter_map(|index| self.take_out(index, why)).collect()
    }

    /// Takes wholly free (or quarantined) segment `index` out of the cache for release.
    fn take_out(&mut self, index: usize, why: Why) -> Option<Eviction> {
        let segment = self.segments.get_mut(index)?;
        let was_quarantined = std::mem::take(&mut segment.quarantined);
        let block = segment.block.take()?;
        let (head, size) = (segment.head, segment.size);
        if !was_quarantined {
            self.free.remove(&(size, head));
            self.cached_bytes -= size;
        }
        Some(Eviction { segment: index, block, why })
    }

    /// Puts back a segment the inner allocator did not release: free again, or held
    /// (quarantined) for the next trim.
    fn put_back(&mut self, index: usize, block: RawAllocation, quarantined: bool) {
        let Some(segment) = self.segments.get_mut(index) else { return };
        (segment.block, segment.quarantined) = (Some(block), quarantined);
        // Idle from now: the next age check does not retry it at once.
        segment.idle_since = self.clock;
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
        if self.segments.get(segment).is_some_and(|entry| entry.standing != Standing::Lost) {
            // Its free pieces leave the cache for good.
            for piece in self.pieces_of(segment) {
                let Piece { state, size, .. } = *self.pieces.get(piece)?;
                if state == PieceState::Free && self.free.remove(&(size, piece)) {
                    self.cached_bytes -= size;
                }
            }
        }
        let entry = self.segments.get_mut(segment)?;
        entry.standing = Standing::Lost;
        entry.live -= 1;
        if entry.live > 0 {
            return None;
        }
        for piece in self.pieces_of(segment) {
            self.pieces.remove(piece);
        }
        self.segments.remove(segment)?.block
    }

    /// Adds the segments' counters, free pieces and segments to `total`.
    pub(super) fn count_into(&self, total: &mut PoolStats) {
        total.add_counters(&self.counters);
        total.cached_bytes += self.cached_bytes as u64;
        total.cached_blocks += self.free.len() as u64;
        let largest = self.free.last().map_or(0, |&(size, _)| size);
        total.largest_free_bytes = total.largest_free_bytes.max(largest as u64);
        for (_, segment) in self.segments.iter() {
            total.segments += 1;
            total.segment_bytes += segment.size as u64;
            total.quarantined_blocks += u64::from(segment.quarantined);
        }
    }

    /// Panics unless pieces tile their segment in address order with consistent
    /// links, no two free pieces neighbour, live counts match, the free index holds
    /// exactly the reusable free pieces, and the cached bytes are their sum.
    #[cfg(test)]
    pub(super) fn assert_consistent(&self) {
        let (mut cached, mut indexed, mut tiled) = (0, 0, 0);
        for (index, segment) in self.segments.iter() {
            let (mut offset, mut live, mut previous, mut previous_free) = (0, 0, None, false);
            for slot in self.pieces_of(index) {
                let piece = self.pieces.get(slot).expect("a piece");
                assert_eq!((piece.segment, piece.offset, piece.prev), (index, offset, previous), "piece {slot}");
                let free = piece.state == PieceState::Free;
                assert!(!(free && previous_free), "two free pieces neighbour in segment {index}");
                live += usize::from(matches!(piece.state, PieceState::Live { .. } | PieceState::Releasing));
                let reusable =
                    free && segment.standing == Standing::Sound && !segment.quarantined && segment.block.is_some();
                assert_eq!(self.free.contains(&(piece.size, slot)), reusable, "free index at piece {slot}");
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
        assert_eq!(tiled, self.pieces.len(), "pieces outside any segment");
        assert_eq!(indexed, self.free.len(), "the free index holds stale entries");
        assert_eq!(cached, self.cached_bytes, "cached bytes of the segments");
        let largest = self.free.iter().map(|&(size, _)| size).max();
        assert_eq!(largest, self.free.last().map(|&(size, _)| size), "the free index is ordered by size");
    }

    /// Bytes of the inner blocks the segments hold (those being released excepted).
    #[cfg(test)]
    pub(super) fn held_bytes(&self) -> usize {
        self.segments.iter().filter(|(_, segment)| segment.block.is_some()).map(|(_, segment)| segment.size).sum()
    }
}

impl<A: DeviceAllocator> PooledAllocator<A> {
    /// Locks the segments. Every critical section leaves them consistent before it can
    /// panic, so a poisoned lock is still usable.
    pub(super) fn segments(&self) -> MutexGuard<'_, Segments> {
        self.segments.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Piece `slot` at `address` as the caller's block, recorded in the record table
    /// (the segments unlocked).
    #[inline(always)]
    fn piece_block(
        &self,
        slot: usize,
        address: DeviceAddress,
        request: &AllocationRequest,
    ) -> Result<RawAllocation, AllocError> {
        let recorded = records::record(address, request.bytes(), request.align(), Held::Piece(slot));
        match self.records.insert_tag(&recorded) {
            Some(tag) => Ok(RawAllocation::new(address, request.bytes(), request.align(), self.device, tag)),
            None => Err(self.unrecorded_piece(slot, request)),
        }
    }

    /// A thread whose part of the record table is full: the piece goes back into its
    /// segment, and the caller gets an error.
    #[cold]
    fn unrecorded_piece(&self, slot: usize, request: &AllocationRequest) -> AllocError {
        let mut large = self.segments();
        large.counters.live_bytes -= request.bytes() as u64;
        large.counters.live_blocks -= 1;
        large.counters.failures += 1;
        large.free_piece(slot);
        drop(large);
        self.backend_error(format!(
            "this thread holds {} blocks of this pool, the record table's bound per thread; the request for {} \
             bytes was refused: release some blocks first",
            memory_sync::records::SLOTS_PER_OWNER,
            request.bytes()
        ))
    }

    /// Serves a large request (inlined into the pool's one call behind a class hit).
    #[inline(always)]
    pub(super) fn allocate_large(
        &self,
        (bytes, align): (usize, usize),
        inner_request: &AllocationRequest,
        request: &AllocationRequest,
    ) -> Result<RawAllocation, AllocError> {
        let outgrown = {
            let mut large = self.segments();
            if let Some((slot, address)) = large.take(bytes, align, self.config.max_class_bytes, request) {
                large.counters.served(request, true);
                drop(large);
                return self.piece_block(slot, address, request);
            }
            // No free piece holds the request: wholly free segments smaller than it
            // never will, and go back before a larger one is taken.
            large.take_out_idle(Why::Outgrown, |segment| segment.size < bytes)
        };
        self.finish_evictions(outgrown);
        let block =
            self.allocate_inner(inner_request, request).inspect_err(|_| self.segments().counters.failures += 1)?;
        let address = block.address();
        let mut large = self.segments();
        let slot = large.insert(block, inner_request.bytes(), request);
        large.counters.served(request, false);
        drop(large);
        self.piece_block(slot, address, request)
    }

    /// Takes wholly free segments out, least recently idle first and never `keep`,
    /// once `incoming` more free bytes would pass the cap (the high-water mark), until
    /// they fit under the low-water mark. The caller releases them with
    /// [`PooledAllocator::finish_evictions`] after unlocking.
    fn make_room(&self, large: &mut Segments, incoming: usize, keep: Option<usize>) -> Vec<Eviction> {
        let cap = self.config.max_cached_bytes;
        if large.cached_bytes + incoming <= cap {
            return Vec::new();
        }
        let low = low_water(cap);
        let mut evictions = Vec::new();
        for segment in large.idle_lru(keep) {
            if large.cached_bytes + incoming <= low {
                break;
            }
            evictions.extend(large.take_out(segment, Why::Cap));
        }
        evictions
    }

    /// Every [`AGE_CHECK_RELEASES`]th release: takes out the segments wholly free
    /// through the last [`IDLE_ALLOCATIONS`] large allocations.
    fn take_out_aged(large: &mut Segments) -> Vec<Eviction> {
        large.releases += 1;
        if !large.releases.is_multiple_of(AGE_CHECK_RELEASES) || large.clock < IDLE_ALLOCATIONS {
            return Vec::new();
        }
        let since = large.clock - IDLE_ALLOCATIONS;
        large.take_out_idle(Why::Aged, |segment| segment.idle_since <= since)
    }

    /// Releases segments taken out of the cache to the inner allocator (eviction or
    /// trim); returns the bytes released. One the inner allocator refuses is cached
    /// again; one it quarantines is held for the next trim.
    fn finish_evictions(&self, evictions: Vec<Eviction>) -> usize {
        let mut returned = 0;
        for Eviction { segment, block, why } in evictions {
            let outcome = self.inner.release(block);
            let mut large = self.segments();
            match outcome {
                ReleaseOutcome::Complete(_) => {
                    let Some(gone) = large.remove(segment) else { continue };
                    returned += gone.size;
                    let bytes = gone.size as u64;
                    let counters = &mut large.counters;
                    match why {
                        Why::Trim => counters.trimmed_bytes += bytes,
                        Why::Cap | Why::Outgrown | Why::Aged => {
                            counters.evicted_segments += 1;
                            counters.evicted_bytes += bytes;
                            counters.outgrown_segments += u64::from(why == Why::Outgrown);
                            counters.aged_segments += u64::from(why == Why::Aged);
                            tracing::debug!(bytes, ?why, "pooled allocator gave an idle segment back");
                        }
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

    /// Releases a piece: back into its segment (merged with free neighbours), evicting
    /// idle segments to stay under the cap. A piece that is its whole segment and alone
    /// does not fit is released to the inner allocator, its outcome the caller's.
    pub(super) fn release_piece(
        &self,
        taken: TakenRecord<'_, LiveCells>,
        slot: usize,
        allocation: RawAllocation,
    ) -> ReleaseOutcome {
        let mut guard = self.segments();
        let large: &mut Segments = &mut guard;
        // The record matched the block; the piece agrees with the record (a check of the
        // segments' own books, never expected to fail).
        let valid = large.pieces.get(slot).is_some_and(|piece| {
            matches!(piece.state, PieceState::Live { bytes, align } if bytes == allocation.bytes() && align == allocation.align())
        });
        if !valid {
            drop(guard);
            taken.restore();
            return self.refuse(allocation);
        }
        large.counters.live_bytes -= allocation.bytes() as u64;
        large.counters.live_blocks -= 1;
        let Piece { segment, size, prev, next, .. } = *large.pieces.get(slot).expect("validated above");
        if let Some(entry) = large.segments.get(segment)
            && entry.standing != Standing::Sound
        {
            return self.release_unsound_piece(guard, taken, (slot, segment), allocation);
        }
        let whole = prev.is_none() && next.is_none();
        let mut evictions = if whole {
            let evictions = self.make_room(large, size, Some(segment));
            if large.cached_bytes + size > self.config.max_cached_bytes {
                return self.pass_piece_through(guard, taken, (slot, segment), allocation, evictions);
            }
            large.free_piece(slot);
            evictions
        } else {
            large.free_piece(slot);
            self.make_room(large, 0, None)
        };
        evictions.extend(Self::take_out_aged(large));
        drop(guard);
        taken.free();
        self.finish_evictions(evictions);
        ReleaseOutcome::complete(0)
    }

    /// Releases a piece of a segment that is not reused: one given up with the device
    /// (the piece is given up too, and the segment forgotten once no piece of it is
    /// live), or one whose release for the caller the inner allocator quarantined (the
    /// caller's retry goes to the inner allocator again, whatever room the cache has).
    #[cold]
    fn release_unsound_piece(
        &self,
        mut guard: MutexGuard<'_, Segments>,
        taken: TakenRecord<'_, LiveCells>,
        (slot, segment): (usize, usize),
        allocation: RawAllocation,
    ) -> ReleaseOutcome {
        let large: &mut Segments = &mut guard;
        if large.segments.get(segment).is_some_and(|entry| entry.standing == Standing::Damaged) {
            // A damaged segment is a single piece, the caller's (it was whole when passed
            // through): back to the inner allocator, counted live again if it refuses.
            return self.pass_piece_through(guard, taken, (slot, segment), allocation, Vec::new());
        }
        // Another piece went with the device: nothing in the segment is reused or freed.
        let forgotten = large.lose(slot);
        drop(guard);
        taken.free();
        self.inner.forget_lost(forgotten.into_iter().collect());
        ReleaseOutcome::complete(0)
    }

    /// Releases the whole segment of piece `slot` to the inner allocator for the caller.
    fn pass_piece_through(
        &self,
        mut guard: MutexGuard<'_, Segments>,
        taken: TakenRecord<'_, LiveCells>,
        (slot, segment): (usize, usize),
        allocation: RawAllocation,
        evictions: Vec<Eviction>,
    ) -> ReleaseOutcome {
        let large: &mut Segments = &mut guard;
        large.piece_mut(slot).state = PieceState::Releasing;
        let entry = large.segments.get_mut(segment).expect("a piece has its segment");
        let block = entry.block.take().expect("a segment with a live piece holds its block");
        large.counters.passed_through += 1;
        drop(guard);
        self.finish_evictions(evictions);
        let outcome = self.inner.release(block);
        let mut large = self.segments();
        let (block, result) = match outcome {
            ReleaseOutcome::Complete(done) => {
                large.remove(segment);
                drop(large);
                taken.free();
                // The segment is the request rounded up; the caller's block may be smaller.
                return ReleaseOutcome::complete(done.unmapped_bytes().min(allocation.bytes()));
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
        // Live again: the caller may retry. After a quarantine part of the block may be
        // gone, so the retry goes to the inner allocator again, never into the cache.
        if let Some(entry) = large.segments.get_mut(segment) {
            entry.block = Some(block);
            if result.is_ok() {
                entry.standing = Standing::Damaged;
            }
        }
        large.piece_mut(slot).state = PieceState::Live { bytes: allocation.bytes(), align: allocation.align() };
        large.counters.live_bytes += allocation.bytes() as u64;
        large.counters.live_blocks += 1;
        large.counters.passed_through -= 1;
        drop(large);
        taken.restore();
        match result {
            Err(error) => ReleaseOutcome::failed(allocation, error),
            Ok((error, unmapped, residual)) => ReleaseOutcome::quarantined(allocation, unmapped, residual, error),
        }
    }

    pub(super) fn trim_segments(&self) -> usize {
        let taken = {
            let mut large = self.segments();
            let candidates: Vec<usize> = large
                .segments
                .iter()
                .filter(|(_, segment)| segment.is_idle() || (segment.quarantined && segment.live == 0))
                .map(|(index, _)| index)
                .collect();
            candidates.into_iter().filter_map(|segment| large.take_out(segment, Why::Trim)).collect()
        };
        self.finish_evictions(taken)
    }

    /// Gives up live piece `slot` with its device; returns its segment's inner block
    /// once no piece of it is live, to be forgotten.
    pub(super) fn forget_piece(
        &self,
        taken: TakenRecord<'_, LiveCells>,
        slot: usize,
        bytes: usize,
    ) -> Option<RawAllocation> {
        let mut large = self.segments();
        if !large.pieces.get(slot).is_some_and(|piece| matches!(piece.state, PieceState::Live { .. })) {
            drop(large);
            taken.restore();
            return None;
        }
        large.counters.live_bytes -= bytes as u64;
        large.counters.live_blocks -= 1;
        let forgotten = large.lose(slot);
        drop(large);
        taken.free();
        forgotten
    }
}
