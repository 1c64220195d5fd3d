//! Per-thread shards of slab-allocated records behind mutexes: the reservation tables of
//! the address-space allocators (`region.rs`), whose records are `Arc` pins of a
//! reservation with its own lock (which the record table's word payloads cannot hold),
//! and the slabs of the pooled allocator's segment cache (its BFC books, behind the
//! segments' one lock).
//!
//! A reservation's `provider_tag` names its record: the shard in the top 16 bits, the
//! record's generation in the next 24 and its slot in the low 24. A thread inserts into
//! its own shard (by `memory_sync`'s thread index), so threads that allocate and release
//! their own reservations never share a lock or a written cache line; one released on
//! another thread locks its home shard. The generation (counted per shard) tells a
//! released reservation from a later one in its reused slot: the kernel hands a freed
//! range out again at once, so without it a stale copy of a released block names a live
//! reservation exactly (same address, size, alignment and slot).

#[cfg(unix)]
use std::sync::{Mutex, MutexGuard, PoisonError};

#[cfg(unix)]
use crossbeam_utils::CachePadded;
#[cfg(unix)]
use memory_sync::per_thread::thread_index;

/// Bits of the slot, and of the generation above it.
#[cfg(unix)]
const SLOT_BITS: u32 = 24;
/// Where the shard index starts.
#[cfg(unix)]
const SHARD_SHIFT: u32 = 2 * SLOT_BITS;
/// Slots a tag can name per shard.
#[cfg(unix)]
pub(crate) const TAGGED_SLOTS: usize = 1 << SLOT_BITS;
#[cfg(unix)]
const LOW_MASK: u64 = (1 << SLOT_BITS) - 1;

/// The part of `generation` a tag carries.
#[cfg(unix)]
pub(crate) fn tag_generation(generation: u64) -> u64 {
    generation & LOW_MASK
}

/// Encodes a shard index, slot (below [`TAGGED_SLOTS`]) and generation into a provider
/// tag.
#[cfg(unix)]
pub(crate) fn tag(shard: usize, slot: usize, generation: u64) -> u64 {
    ((shard as u64) << SHARD_SHIFT) | (tag_generation(generation) << SLOT_BITS) | (slot as u64 & LOW_MASK)
}

/// Decodes a provider tag into shard index, slot and (tagged) generation.
#[cfg(unix)]
pub(crate) fn untag(tag: u64) -> (usize, usize, u64) {
    ((tag >> SHARD_SHIFT) as usize, (tag & LOW_MASK) as usize, (tag >> SLOT_BITS) & LOW_MASK)
}

enum Entry<T> {
    Occupied(T),
    Vacant(Option<usize>),
}

/// A vector of records with a free list: insert and remove are O(1), slots are reused.
pub(crate) struct Slab<T> {
    entries: Vec<Entry<T>>,
    free: Option<usize>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Slab<T> {
        Slab { entries: Vec::new(), free: None, len: 0 }
    }
}

impl<T> Slab<T> {
    pub(crate) fn insert(&mut self, value: T) -> usize {
        self.len += 1;
        match self.free {
            Some(slot) => {
                let Entry::Vacant(next) = std::mem::replace(&mut self.entries[slot], Entry::Occupied(value)) else {
                    unreachable!("the free list only holds vacant slots")
                };
                self.free = next;
                slot
            }
            None => {
                self.entries.push(Entry::Occupied(value));
                self.entries.len() - 1
            }
        }
    }

    pub(crate) fn get(&self, slot: usize) -> Option<&T> {
        match self.entries.get(slot) {
            Some(Entry::Occupied(value)) => Some(value),
            _ => None,
        }
    }

    pub(crate) fn get_mut(&mut self, slot: usize) -> Option<&mut T> {
        match self.entries.get_mut(slot) {
            Some(Entry::Occupied(value)) => Some(value),
            _ => None,
        }
    }

    pub(crate) fn remove(&mut self, slot: usize) -> Option<T> {
        if !matches!(self.entries.get(slot), Some(Entry::Occupied(_))) {
            return None;
        }
        let Entry::Occupied(value) = std::mem::replace(&mut self.entries[slot], Entry::Vacant(self.free)) else {
            unreachable!("checked above")
        };
        self.free = Some(slot);
        self.len -= 1;
        Some(value)
    }

    #[cfg_attr(not(unix), allow(dead_code, reason = "the reservation tables (unix only) and tests count records"))]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        self.entries.iter().enumerate().filter_map(|(slot, entry)| match entry {
            Entry::Occupied(value) => Some((slot, value)),
            Entry::Vacant(_) => None,
        })
    }
}

/// Cache-line-padded, mutex-guarded shards, one picked per thread.
#[cfg(unix)]
pub(crate) struct Shards<S> {
    shards: Box<[CachePadded<Mutex<S>>]>,
}

#[cfg(unix)]
impl<S: Default> Shards<S> {
    /// `count` shards (rounded up to a power of two, at most 2^16).
    pub(crate) fn new(count: usize) -> Shards<S> {
        let count = count.clamp(1, 1 << 16).next_power_of_two();
        Shards { shards: (0..count).map(|_| CachePadded::new(Mutex::new(S::default()))).collect() }
    }
}

#[cfg(unix)]
impl<S> Shards<S> {
    /// Default shard count: the machine's parallelism, at least 4.
    pub(crate) fn default_count() -> usize {
        std::thread::available_parallelism().map_or(4, |n| n.get()).clamp(4, 64)
    }

    pub(crate) fn len(&self) -> usize {
        self.shards.len()
    }

    /// The calling thread's shard index.
    pub(crate) fn local(&self) -> usize {
        thread_index() & (self.shards.len() - 1)
    }

    /// Locks shard `index`. Every critical section leaves its shard consistent before it
    /// can panic, so a poisoned lock is still usable.
    pub(crate) fn lock(&self, index: usize) -> Option<MutexGuard<'_, S>> {
        let shard = self.shards.get(index)?;
        Some(shard.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(unix)]
    fn tags_round_trip() {
        assert_eq!(untag(tag(5, 123_456, 7)), (5, 123_456, 7));
        let last = TAGGED_SLOTS - 1;
        assert_eq!(untag(tag(65_535, last, u64::MAX)), (65_535, last, tag_generation(u64::MAX)));
        assert_eq!(untag(tag(1, 2, 1 << 24)), (1, 2, 0), "generations wrap within their bits");
    }

    #[test]
    fn slab_reuses_freed_slots_and_rejects_vacant_ones() {
        let mut slab = Slab::default();
        let a = slab.insert('a');
        let b = slab.insert('b');
        assert_eq!(slab.remove(a), Some('a'));
        assert_eq!(slab.remove(a), None, "a slot is removed exactly once");
        assert!(slab.get(a).is_none());
        let c = slab.insert('c');
        assert_eq!(c, a, "the freed slot is reused next");
        assert_eq!((slab.get(b), slab.get(c), slab.len()), (Some(&'b'), Some(&'c'), 2));
        assert!(slab.get(99).is_none() && slab.remove(99).is_none());
    }

    #[test]
    #[cfg(unix)]
    fn shard_counts_are_powers_of_two() {
        assert_eq!(Shards::<()>::new(3).len(), 4);
        assert_eq!(Shards::<()>::new(0).len(), 1);
        let shards = Shards::<u32>::new(4);
        assert!(shards.lock(shards.local()).is_some());
        assert!(shards.lock(4).is_none());
    }
}
