//! Per-thread shards of slab-allocated records, used by every allocator here to
//! validate released blocks in O(1) without a global lock.
//!
//! A block's `provider_tag` names its record: the shard in the top 16 bits, the slot
//! below. A thread inserts into its own shard, so threads that allocate and release
//! their own blocks never share a lock or a written cache line; a block released on
//! another thread locks its home shard.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crossbeam_utils::CachePadded;

const SLOT_BITS: u32 = 48;

/// Encodes a shard index and slot into a provider tag.
pub(crate) fn tag(shard: usize, slot: usize) -> u64 {
    ((shard as u64) << SLOT_BITS) | slot as u64
}

/// Decodes a provider tag into shard index and slot.
pub(crate) fn untag(tag: u64) -> (usize, usize) {
    ((tag >> SLOT_BITS) as usize, (tag & ((1 << SLOT_BITS) - 1)) as usize)
}

/// This thread's stable index, assigned round-robin on first use.
pub(crate) fn thread_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static INDEX: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    INDEX.with(|index| *index)
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

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        self.entries.iter().enumerate().filter_map(|(slot, entry)| match entry {
            Entry::Occupied(value) => Some((slot, value)),
            Entry::Vacant(_) => None,
        })
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (usize, &mut T)> {
        self.entries.iter_mut().enumerate().filter_map(|(slot, entry)| match entry {
            Entry::Occupied(value) => Some((slot, value)),
            Entry::Vacant(_) => None,
        })
    }
}

/// Cache-line-padded, mutex-guarded shards, one picked per thread.
pub(crate) struct Shards<S> {
    shards: Box<[CachePadded<Mutex<S>>]>,
}

impl<S: Default> Shards<S> {
    /// `count` shards (rounded up to a power of two, at most 2^16).
    pub(crate) fn new(count: usize) -> Shards<S> {
        let count = count.clamp(1, 1 << 16).next_power_of_two();
        Shards { shards: (0..count).map(|_| CachePadded::new(Mutex::new(S::default()))).collect() }
    }
}

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

    /// Locks shard `index` unless another thread holds it.
    pub(crate) fn try_lock(&self, index: usize) -> Option<MutexGuard<'_, S>> {
        match self.shards.get(index)?.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip() {
        assert_eq!(untag(tag(5, 123_456)), (5, 123_456));
        assert_eq!(untag(tag(65_535, (1 << 48) - 1)), (65_535, (1 << 48) - 1));
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
    fn shard_counts_are_powers_of_two() {
        assert_eq!(Shards::<()>::new(3).len(), 4);
        assert_eq!(Shards::<()>::new(0).len(), 1);
        let shards = Shards::<u32>::new(4);
        assert!(shards.lock(shards.local()).is_some());
        assert!(shards.lock(4).is_none());
    }
}
