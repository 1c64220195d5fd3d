//! The size classes: requests up to [`PoolConfig::max_class_bytes`](super::PoolConfig)
//! round up to one of four classes per doubling (from 256 bytes) and reuse whole inner
//! blocks of that class. Each thread allocates from its own shard (stealing from the
//! others with `try_lock` only on a miss); a block names its home shard and record in
//! its provider tag, so a release on any thread finds and validates its record. A
//! block whose alignment exceeds its class's is recorded in its shard the same way,
//! but never cached. (The allocation path itself is written out in `allocate`, in
//! `mod.rs`: see there.)

use std::sync::MutexGuard;

use memory_api::{AllocationRequest, DeviceAllocator, RawAllocation, ReleaseOutcome};

use super::{PoolStats, PooledAllocator, capped};
use crate::table::{Slab, tag};

/// Smallest size class: every block smaller than this uses one of this size.
const MIN_CLASS: usize = 256;
/// Size classes per doubling (sizes step by a quarter of their power of two).
const STEPS: usize = 4;
/// Largest alignment a class block is allocated with; requests asking for more than
/// their class's alignment bypass the cache.
const CLASS_ALIGN_MAX: usize = 4096;

/// The size class of `bytes` (at least [`MIN_CLASS`]): its index and size.
pub(super) fn class_of(bytes: usize) -> (usize, usize) {
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
pub(super) fn class_align(size: usize) -> usize {
    (1usize << size.trailing_zeros()).min(CLASS_ALIGN_MAX)
}

#[derive(Debug)]
pub(super) enum State {
    /// Handed out with this size and alignment.
    Live { bytes: usize, align: usize },
    /// In a free list.
    Cached,
    /// Being released to the inner allocator by some thread (block taken out).
    Releasing,
    /// The inner allocator quarantined it during a trim; the next trim retries.
    Quarantined,
}

pub(super) struct Record {
    /// The inner allocator's block; `None` only while `Releasing`.
    pub(super) block: Option<RawAllocation>,
    /// Its size class; `None` for an uncached block.
    pub(super) class: Option<usize>,
    pub(super) state: State,
}

#[derive(Default)]
pub(super) struct Shard {
    pub(super) records: Slab<Record>,
    classes: Vec<Vec<usize>>,
    cached_bytes: usize,
    pub(super) counters: PoolStats,
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

    /// The largest cached block: the top class with a block in its free list.
    fn largest_cached(&self) -> usize {
        let top = self.classes.iter().rev().find_map(|free| free.last());
        top.and_then(|&slot| self.records.get(slot)?.block.as_ref()).map_or(0, RawAllocation::bytes)
    }

    /// Adds this shard's counters, cached bytes and cached and quarantined blocks to
    /// `total`.
    pub(super) fn count_into(&self, total: &mut PoolStats) {
        total.add_counters(&self.counters);
        total.cached_bytes += self.cached_bytes as u64;
        total.largest_free_bytes = total.largest_free_bytes.max(self.largest_cached() as u64);
        for (_, record) in self.records.iter() {
            match record.state {
                State::Cached => total.cached_blocks += 1,
                State::Quarantined => total.quarantined_blocks += 1,
                _ => {}
            }
        }
    }

    /// Panics unless the shard's cached bytes are its cached class blocks.
    #[cfg(test)]
    pub(super) fn assert_consistent(&self, index: usize) {
        let cached: usize = self
            .records
            .iter()
            .filter(|(_, record)| matches!(record.state, State::Cached))
            .map(|(_, record)| record.block.as_ref().expect("a cached block").bytes())
            .sum();
        assert_eq!(cached, self.cached_bytes, "cached bytes of shard {index}");
        let largest = self
            .records
            .iter()
            .filter(|(_, record)| matches!(record.state, State::Cached))
            .filter_map(|(_, record)| record.block.as_ref().map(RawAllocation::bytes))
            .max();
        assert_eq!(largest.unwrap_or(0), self.largest_cached(), "largest cached block of shard {index}");
    }

    /// Bytes of the inner blocks this shard holds: live, cached or quarantined.
    #[cfg(test)]
    pub(super) fn held_bytes(&self) -> usize {
        self.records.iter().filter_map(|(_, record)| record.block.as_ref().map(RawAllocation::bytes)).sum()
    }
}

impl<A: DeviceAllocator> PooledAllocator<A> {
    /// Serves `request` from shard `index`'s class cache, if it holds a block of `class`.
    pub(super) fn take_cached(
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

    pub(super) fn release_class(&self, index: usize, slot: usize, allocation: RawAllocation) -> ReleaseOutcome {
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

    pub(super) fn trim_classes(&self, index: usize) -> usize {
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

    /// Gives up live class block `slot` of shard `index` with its device: drops its
    /// record and returns its inner block, to be forgotten.
    pub(super) fn forget_class(&self, index: usize, slot: usize, allocation: &RawAllocation) -> Option<RawAllocation> {
        let mut shard = self.shards.lock(index)?;
        let valid = shard.records.get(slot).is_some_and(|record| {
            matches!(record.state, State::Live { .. })
                && record.block.as_ref().is_some_and(|block| block.address() == allocation.address())
        });
        if valid && let Some(record) = shard.records.remove(slot) {
            shard.counters.live_bytes -= allocation.bytes() as u64;
            shard.counters.live_blocks -= 1;
            return record.block;
        }
        None
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
}
