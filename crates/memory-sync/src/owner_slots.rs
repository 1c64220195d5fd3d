//! Slots that one thread hands out and any thread gives back: the storage under an
//! owner-local record table.
//!
//! - Taking a free slot is the owner's alone, with plain loads and stores on the
//!   owner's own line (no read-modify-write).
//! - Giving one back: the owner pushes it onto its own list (plain stores); any other
//!   thread pushes it onto a remote stack (one compare-and-swap), which the owner takes
//!   whole with one swap when its own list is empty. Take-all pops make the stack immune
//!   to ABA.
//! - Slots live in segments that never move (each twice the size of the one before; the
//!   first made with the table and reached without a `OnceLock` check), so any thread
//!   reaches a slot by its number without a lock.
//! - A table may hand out fewer numbers than a `u32` holds ([`OwnerSlots::with_limit`]):
//!   at the limit, `claim` still reuses every number given back.
//!
//! What a slot holds, and how a value says whether it is in use, is the caller's: the
//! table only recycles numbers, through one word of each value ([`FreeLink`]). Which
//! thread is the owner is the caller's too (usually [`crate::per_thread::is_current`] of
//! the index the table is kept under).

use std::sync::OnceLock;

use crate::CachePadded;
use crate::primitives::{AtomicU32, Ordering};

/// A slot value that carries the table's free-list link: a word the table alone uses
/// while the slot is free (the value's other fields stay the caller's). Keeping it in
/// the value lets a record stay as small as its own fields allow.
pub trait FreeLink {
    /// The link word (initially anything: the table writes it before reading it).
    fn free_link(&self) -> &AtomicU32;
}

/// "No slot" in the free lists (above every number a table hands out).
pub const NO_SLOT: u32 = u32::MAX;

/// Slots in the first segment (a power of two); segment `k` holds `FIRST_SEGMENT << k`.
#[cfg(not(memory_loom))]
const FIRST_SEGMENT: u32 = 32;
#[cfg(memory_loom)]
const FIRST_SEGMENT: u32 = 2;
/// Enough segments for every slot number below [`NO_SLOT`] (the first is inline).
const SEGMENTS: usize = 33 - FIRST_SEGMENT.trailing_zeros() as usize;

/// Slots in segment `k` (in `usize`: the last segments hold more than a `u32` counts).
fn segment_len(k: usize) -> usize {
    (FIRST_SEGMENT as usize) << k
}

/// A slot's segment and its offset in it.
#[inline]
fn segment_of(slot: u32) -> (usize, usize) {
    let shifted = u64::from(slot) + u64::from(FIRST_SEGMENT);
    let segment = shifted.ilog2() - FIRST_SEGMENT.ilog2();
    (segment as usize, (shifted - (u64::from(FIRST_SEGMENT) << segment)) as usize)
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
    /// Numbers from here on are never handed out.
    limit: u32,
    /// Segment 0, made with the table; `segments[0]` stays empty.
    first: Box<[T]>,
    segments: [OnceLock<Box<[T]>>; SEGMENTS],
    local: CachePadded<OwnerState>,
    remote_free: CachePadded<AtomicU32>,
}

impl<T: Default + FreeLink> Default for OwnerSlots<T> {
    fn default() -> Self {
        OwnerSlots::new()
    }
}

impl<T: Default + FreeLink> OwnerSlots<T> {
    /// A table with no slot in use (its first segment made now, the rest on demand).
    pub fn new() -> OwnerSlots<T> {
        OwnerSlots::with_limit(NO_SLOT)
    }

    /// A table that hands out numbers below `limit` only, rounded down to the start of a
    /// segment (past the first) so that no segment is made for numbers it would never
    /// hand out; see [`OwnerSlots::limit`].
    pub fn with_limit(limit: u32) -> OwnerSlots<T> {
        let (segment, offset) = segment_of(limit);
        let limit = if segment == 0 { limit } else { limit - offset as u32 };
        OwnerSlots {
            limit,
            first: (0..FIRST_SEGMENT).map(|_| T::default()).collect(),
            segments: std::array::from_fn(|_| OnceLock::new()),
            local: CachePadded::new(OwnerState { free_head: AtomicU32::new(NO_SLOT), fresh: AtomicU32::new(0) }),
            remote_free: CachePadded::new(AtomicU32::new(NO_SLOT)),
        }
    }

    /// A free slot and its value, for the owner to fill: its own list's head, else the
    /// whole remote stack's, else a slot never used. `None` once every number below the
    /// limit is in use.
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
        let value = self.get(head)?;
        self.local.free_head.store(value.free_link().load(Ordering::Relaxed), Ordering::Relaxed);
        Some((head, value))
    }

    #[cold]
    fn fresh(&self) -> Option<(u32, &T)> {
        let number = self.local.fresh.load(Ordering::Relaxed);
        if number >= self.limit {
            return None;
        }
        let (segment, offset) = segment_of(number);
        let value = match segment {
            0 => &self.first[offset],
            k => &self.segments[k].get_or_init(|| (0..segment_len(k)).map(|_| T::default()).collect())[offset],
        };
        self.local.fresh.store(number + 1, Ordering::Relaxed);
        Some((number, value))
    }
}

impl<T: FreeLink> OwnerSlots<T> {
    /// The first number this table never hands out.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// The value in slot `number`, if that slot's segment exists (any thread; a number
    /// from untrusted input is safe to ask about).
    #[inline]
    pub fn get(&self, number: u32) -> Option<&T> {
        match self.first.get(number as usize) {
            Some(value) => Some(value),
            None => self.beyond_first(number),
        }
    }

    fn beyond_first(&self, number: u32) -> Option<&T> {
        let (segment, offset) = segment_of(number);
        self.segments.get(segment)?.get()?.get(offset)
    }

    /// Gives slot `number`, whose value is `value` (what [`OwnerSlots::get`] returns for
    /// it), back for reuse. `owned_here` says whether the calling thread is the owner
    /// (its own list) or not (the remote stack).
    ///
    /// Exactly once per claim: the caller decides, through the value's own state, that
    /// it alone gives this slot back (a slot given back twice is handed out twice).
    #[inline]
    pub fn give_back(&self, number: u32, value: &T, owned_here: bool) {
        debug_assert!(
            self.get(number).is_some_and(|own| std::ptr::eq(own, value)),
            "slot {number} given back with another value"
        );
        if owned_here {
            value.free_link().store(self.local.free_head.load(Ordering::Relaxed), Ordering::Relaxed);
            self.local.free_head.store(number, Ordering::Relaxed);
        } else {
            self.push_remote(number, value);
        }
    }

    #[cold]
    fn push_remote(&self, number: u32, value: &T) {
        let mut head = self.remote_free.load(Ordering::Relaxed);
        loop {
            value.free_link().store(head, Ordering::Relaxed);
            // Release: the link and everything the giver did before publish with it.
            match self.remote_free.compare_exchange_weak(head, number, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return,
                Err(actual) => head = actual,
            }
        }
    }

    /// Every slot's value in segments made so far, in use or free (cold path: counts,
    /// sweeps).
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        let rest = self.segments.iter().skip(1).filter_map(OnceLock::get).flat_map(|segment| segment.iter());
        self.first.iter().chain(rest)
    }
}

/// A slot value that is its link and one payload word (for the tests and models).
#[cfg(test)]
#[derive(Default)]
struct Cell {
    link: AtomicU32,
    payload: crate::primitives::AtomicU64,
}

#[cfg(test)]
impl FreeLink for Cell {
    fn free_link(&self) -> &AtomicU32 {
        &self.link
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
            assert!(offset < segment_len(segment), "{number}: offset {offset} outside {segment}");
            assert!(seen.insert((segment, offset)), "{number} collides");
        }
        let (last, offset) = segment_of(NO_SLOT - 1);
        assert!(last < SEGMENTS && offset < segment_len(last), "the last number has a place");
        assert!(segment_len(SEGMENTS - 1) > u32::MAX as usize / 4, "the last segment's length does not wrap");
    }

    fn give_back(table: &OwnerSlots<Cell>, number: u32, owned_here: bool) {
        table.give_back(number, table.get(number).unwrap(), owned_here);
    }

    #[test]
    fn at_its_limit_a_table_still_reuses_what_comes_back() {
        let table = OwnerSlots::<Cell>::with_limit(40);
        assert_eq!(table.limit(), 32, "rounded down to the second segment's start");
        assert!((0..32).all(|number| table.claim().unwrap().0 == number));
        assert!(table.claim().is_none(), "nothing past the limit");
        assert_eq!(table.iter().count(), 32, "no segment made past it");
        give_back(&table, 5, false);
        give_back(&table, 6, true);
        assert_eq!(table.claim().unwrap().0, 6, "its own list");
        assert_eq!(table.claim().unwrap().0, 5, "the remote stack");
        assert!(table.claim().is_none());
        assert_eq!(OwnerSlots::<Cell>::with_limit(20).limit(), 20, "inside the first segment: as asked");
        assert_eq!(OwnerSlots::<Cell>::with_limit(1 << 24).limit(), (1 << 24) - 32);
    }

    #[test]
    fn given_back_slots_are_reused_before_fresh_ones_and_none_twice() {
        let table = OwnerSlots::<Cell>::new();
        let numbers: Vec<u32> = (0..40).map(|_| table.claim().unwrap().0).collect();
        assert_eq!(numbers, (0..40).collect::<Vec<_>>(), "fresh slots in order, across a segment boundary");
        table.get(3).unwrap().payload.store(33, Ordering::Relaxed);
        give_back(&table, 3, true);
        give_back(&table, 7, false);
        give_back(&table, 9, false);
        // Own list first, then the remote stack taken whole (last pushed first).
        let again: Vec<u32> = (0..4).map(|_| table.claim().unwrap().0).collect();
        assert_eq!(again, [3, 9, 7, 40]);
        assert_eq!(table.get(3).unwrap().payload.load(Ordering::Relaxed), 33, "the value is the caller's: kept");
        assert_eq!(table.iter().count(), 32 + 64, "two segments, the second twice the first");
        assert!(table.get(95).is_some() && table.get(96).is_none() && table.get(NO_SLOT).is_none());
    }
}

/// loom models of the give-back protocol (`cargo xtask loom`).
#[cfg(all(test, memory_loom))]
mod loom_owner_slots {
    use super::*;
    use std::sync::Arc;

    /// Two other threads giving slots back while the owner claims: every number comes
    /// back exactly once, the table does not grow for numbers it got back, and what a
    /// giver wrote before giving back is visible to the owner's reuse.
    #[test]
    fn loom_remote_give_backs_and_the_owners_take_all_lose_nothing() {
        loom::model(|| {
            let table = Arc::new(OwnerSlots::<Cell>::new());
            let first = table.claim().unwrap().0;
            let second = table.claim().unwrap().0;
            let givers: Vec<_> = [first, second]
                .into_iter()
                .map(|number| {
                    let table = Arc::clone(&table);
                    loom::thread::spawn(move || {
                        let cell = table.get(number).unwrap();
                        cell.payload.store(u64::from(number) + 100, Ordering::Relaxed);
                        table.give_back(number, cell, false);
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
                    let seen = table.get(number).unwrap().payload.load(Ordering::Relaxed);
                    assert_eq!(seen, u64::from(number) + 100, "the giver's write is visible on reuse");
                }
            }
            numbers.sort_unstable();
            assert_eq!(numbers, [0, 1, 2], "a slot handed out twice, or a given-back one lost");
        });
    }
}
