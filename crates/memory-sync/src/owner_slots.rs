//! Slots that one thread hands out and any thread gives back: the storage under an
//! owner-local record table.
//!
//! - Taking a free slot is the owner's alone, with plain loads and stores on the
//!   owner's own line (no read-modify-write).
//! - Giving one back: the owner pushes it onto its own list (plain stores); any other
//!   thread pushes it onto a remote stack (one compare-and-swap), which the owner takes
//!   whole with one swap when its own list is empty. Take-all pops make the stack immune
//!   to ABA.
//! - Slots live in segments that never move (each twice the size of the one before),
//!   so any thread reaches a slot by its number without a lock.
//!
//! What a slot holds, and how a value says whether it is in use, is the caller's: the
//! table only recycles numbers. Which thread is the owner is the caller's too (usually
//! [`crate::per_thread::is_current`] of the index the table is kept under).

use std::sync::OnceLock;

use crate::CachePadded;
use crate::primitives::{AtomicU32, Ordering};

/// "No slot" in the free lists; also the first number the table never hands out.
pub const NO_SLOT: u32 = u32::MAX;

/// Slots in the first segment (a power of two); segment `k` holds `FIRST_SEGMENT << k`.
#[cfg(not(memory_loom))]
const FIRST_SEGMENT: u32 = 32;
#[cfg(memory_loom)]
const FIRST_SEGMENT: u32 = 2;
/// Enough segments for every slot number below [`NO_SLOT`].
const SEGMENTS: usize = 33 - FIRST_SEGMENT.trailing_zeros() as usize;

/// A slot's segment and its offset in it.
#[inline]
fn segment_of(slot: u32) -> (usize, usize) {
    let shifted = u64::from(slot) + u64::from(FIRST_SEGMENT);
    let segment = shifted.ilog2() - FIRST_SEGMENT.ilog2();
    (segment as usize, (shifted - (u64::from(FIRST_SEGMENT) << segment)) as usize)
}

struct Slot<T> {
    value: T,
    /// The next free slot while this one is free.
    next_free: AtomicU32,
}

/// The owner's part: written by the owner alone, on its own line.
struct OwnerState {
    /// Head of the owner's free list.
    free_head: AtomicU32,
    /// The next slot never used yet.
    fresh: AtomicU32,
}

/// A table of `T` slots with one owner thread (see the module docs).
pub struct OwnerSlots<T> {
    segments: [OnceLock<Box<[Slot<T>]>>; SEGMENTS],
    local: CachePadded<OwnerState>,
    remote_free: CachePadded<AtomicU32>,
}

impl<T: Default> Default for OwnerSlots<T> {
    fn default() -> Self {
        OwnerSlots::new()
    }
}

impl<T: Default> OwnerSlots<T> {
    /// An empty table; its first segment is made on the first [`OwnerSlots::claim`].
    pub fn new() -> OwnerSlots<T> {
        OwnerSlots {
            segments: std::array::from_fn(|_| OnceLock::new()),
            local: CachePadded::new(OwnerState { free_head: AtomicU32::new(NO_SLOT), fresh: AtomicU32::new(0) }),
            remote_free: CachePadded::new(AtomicU32::new(NO_SLOT)),
        }
    }

    /// A free slot and its value, for the owner to fill: its own list's head, else the
    /// whole remote stack's, else a slot never used. `None` once every slot number
    /// below [`NO_SLOT`] is in use.
    ///
    /// Owner thread only: two threads claiming at once could be handed one slot.
    #[inline]
    pub fn claim(&self) -> Option<(u32, &T)> {
        let mut head = self.local.free_head.load(Ordering::Relaxed);
        if head == NO_SLOT {
            if self.remote_free.load(Ordering::Relaxed) == NO_SLOT {
                return self.fresh();
            }
            // Acquire: the pushers' links and whatever they did with the value before
            // giving the slot back happen before the owner reuses it.
            head = self.remote_free.swap(NO_SLOT, Ordering::Acquire);
            if head == NO_SLOT {
                return self.fresh();
            }
        }
        let slot = self.slot(head)?;
        self.local.free_head.store(slot.next_free.load(Ordering::Relaxed), Ordering::Relaxed);
        Some((head, &slot.value))
    }

    #[cold]
    fn fresh(&self) -> Option<(u32, &T)> {
        let number = self.local.fresh.load(Ordering::Relaxed);
        if number == NO_SLOT {
            return None;
        }
        let (segment, offset) = segment_of(number);
        let slots = self.segments[segment].get_or_init(|| {
            (0..FIRST_SEGMENT << segment)
                .map(|_| Slot { value: T::default(), next_free: AtomicU32::new(NO_SLOT) })
                .collect()
        });
        self.local.fresh.store(number + 1, Ordering::Relaxed);
        Some((number, &slots[offset].value))
    }
}

impl<T> OwnerSlots<T> {
    #[inline]
    fn slot(&self, number: u32) -> Option<&Slot<T>> {
        let (segment, offset) = segment_of(number);
        self.segments.get(segment)?.get()?.get(offset)
    }

    /// The value in slot `number`, if that slot was ever handed out (any thread; a
    /// number from untrusted input is safe to ask about).
    #[inline]
    pub fn get(&self, number: u32) -> Option<&T> {
        self.slot(number).map(|slot| &slot.value)
    }

    /// Gives slot `number` back for reuse. `owned_here` says whether the calling thread
    /// is the owner (its own list) or not (the remote stack).
    ///
    /// Exactly once per claim: the caller decides, through the value's own state, that
    /// it alone gives this slot back (a slot given back twice is handed out twice).
    /// A number that was never handed out is ignored.
    #[inline]
    pub fn give_back(&self, number: u32, owned_here: bool) {
        let Some(slot) = self.slot(number) else { return };
        if owned_here {
            slot.next_free.store(self.local.free_head.load(Ordering::Relaxed), Ordering::Relaxed);
            self.local.free_head.store(number, Ordering::Relaxed);
        } else {
            self.push_remote(number, slot);
        }
    }

    #[cold]
    fn push_remote(&self, number: u32, slot: &Slot<T>) {
        let mut head = self.remote_free.load(Ordering::Relaxed);
        loop {
            slot.next_free.store(head, Ordering::Relaxed);
            // Release: the link and everything the giver did before publish with it.
            match self.remote_free.compare_exchange_weak(head, number, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return,
                Err(actual) => head = actual,
            }
        }
    }

    /// Every slot's value handed out so far, in use or free (cold path: counts, sweeps).
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.segments.iter().filter_map(OnceLock::get).flat_map(|slots| slots.iter().map(|slot| &slot.value))
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_every_slot_number_once() {
        let mut seen = std::collections::HashSet::new();
        let count = if cfg!(miri) { 300 } else { 100_000 };
        for number in 0..count {
            let (segment, offset) = segment_of(number);
            assert!(offset < (FIRST_SEGMENT << segment) as usize, "{number}: offset {offset} outside {segment}");
            assert!(seen.insert((segment, offset)), "{number} collides");
        }
        assert!(segment_of(NO_SLOT - 1).0 < SEGMENTS, "the last number has a segment");
    }

    #[test]
    fn given_back_slots_are_reused_before_fresh_ones_and_none_twice() {
        let table = OwnerSlots::<u32>::new();
        let numbers: Vec<u32> = (0..40).map(|_| table.claim().unwrap().0).collect();
        assert_eq!(numbers, (0..40).collect::<Vec<_>>(), "fresh slots in order, across a segment boundary");
        table.give_back(3, true);
        table.give_back(7, false);
        table.give_back(9, false);
        // Own list first, then the remote stack taken whole (last pushed first).
        let again: Vec<u32> = (0..4).map(|_| table.claim().unwrap().0).collect();
        assert_eq!(again, [3, 9, 7, 40]);
        assert_eq!(table.iter().count(), 32 + 64, "two segments, the second twice the first");
        assert!(table.get(95).is_some() && table.get(96).is_none() && table.get(NO_SLOT).is_none());
        table.give_back(1_000_000, true);
        assert_eq!(table.claim().unwrap().0, 41, "a number never handed out is ignored");
    }
}

/// loom models of the give-back protocol (`cargo xtask loom`).
#[cfg(all(test, memory_loom))]
mod loom_owner_slots {
    use super::*;
    use crate::primitives::AtomicU64;
    use std::sync::Arc;

    /// Two other threads giving slots back while the owner claims: every number comes
    /// back exactly once, the table does not grow for numbers it got back, and what a
    /// giver wrote before giving back is visible to the owner's reuse.
    #[test]
    fn loom_remote_give_backs_and_the_owners_take_all_lose_nothing() {
        loom::model(|| {
            let table = Arc::new(OwnerSlots::<AtomicU64>::new());
            let first = table.claim().unwrap().0;
            let second = table.claim().unwrap().0;
            let givers: Vec<_> = [first, second]
                .into_iter()
                .map(|number| {
                    let table = Arc::clone(&table);
                    loom::thread::spawn(move || {
                        table.get(number).unwrap().store(u64::from(number) + 100, Ordering::Relaxed);
                        table.give_back(number, false);
                    })
                })
                .collect();
            let (during, _) = table.claim().unwrap();
            for giver in givers {
                giver.join().unwrap();
            }
            let mut numbers = vec![during, table.claim().unwrap().0, table.claim().unwrap().0];
            for &number in &numbers {
                if number == first || number == second {
                    let seen = table.get(number).unwrap().load(Ordering::Relaxed);
                    assert_eq!(seen, u64::from(number) + 100, "the giver's write is visible on reuse");
                }
            }
            numbers.sort_unstable();
            numbers.dedup();
            assert_eq!(numbers.len(), 3, "a slot was handed out twice");
            assert!(numbers.iter().all(|&number| number < 4), "given-back slots were lost (the table grew)");
        });
    }
}
