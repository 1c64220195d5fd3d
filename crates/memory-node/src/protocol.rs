//! The node protocol: grants drawn by a process, given back, and refunded when the
//! process is found dead. Every function works on a [`Table`] of slots, which the shared
//! mapping implements and the loom models (`src/loom_slots.rs`) implement with a few
//! loom atomics, so the models check this code, unchanged.
//!
//! # No shared counter
//!
//! What a device (or a tenant) has granted is not a word of its own: it is the sum, over
//! the slots, of each slot's grant word, and only the slot's owner changes that word
//! (a survivor zeroes it once the owner is dead). A grant is:
//!
//! 1. `seq += 1` (odd: the owner is changing its grants);
//! 2. `own += want` (one read-modify-write, on the owner's own line; `want` cut first to
//!    what the word can hold below `u64::MAX`, so it never wraps);
//! 3. read every slot's word (the slots below the high-water mark, read after step 2) and
//!    sum them, own included;
//! 4. if the sum is over the limit, take back the excess (`own -= excess`) when what is
//!    left still covers `at_least`, otherwise all of `want`;
//! 5. `seq += 1` (even).
//!
//! All of it `SeqCst`, with a `SeqCst` fence between steps 2 and 3. Two grants racing are a store-buffering pair: each stores to its
//! own word, then loads the other's, so at least one of them sees the other. Take the
//! grant whose step 2 comes last in the `SeqCst` order among those that stand: its step 3
//! saw every other standing grant (or a larger, tentative value), so the standing grants
//! together are within the limit. Hence **the sum of granted bytes never exceeds the
//! limit**, however many processes grant at once; a race can only refuse spuriously
//! (both see the other's tentative add), and the caller retries.
//!
//! Because nothing else holds a copy of a slot's grants, a process that dies at any
//! instruction leaves books that are right as they stand: its word holds what it was
//! granted (plus, if it died between steps 2 and 4, a tentative amount that only makes
//! others more careful), and refunding it is zeroing its words. Nothing is subtracted
//! from a shared total, so nothing can be refunded twice or lost in a crash window.
//!
//! # Claims and refunds
//!
//! A process claims a free slot, writes its identity (pid, start time, boot id) and marks
//! it live; a survivor that finds a live slot's process gone zeroes the slot's words and
//! frees it. Both run while holding the books' lock (`flock` on the file, which the
//! kernel drops when its holder dies), so a claim, a refund and a release never
//! interleave; a lock holder that finds a slot still `CLAIMING` or `REFUNDING` knows the
//! process that left it so died holding the lock, and finishes the job (zeroing is
//! idempotent). Grants and give-backs take no lock: a slot being refunded belongs to a
//! dead process, which makes none, and a new owner claims it only after the refund.
//!
//! # Snapshots
//!
//! A reader wanting a consistent picture (a watcher, a report) reads every slot's `seq`,
//! then the words, then the `seq`s again; if none moved and none was odd, no grant was in
//! flight, so the words it read held at once (a double collect). A slot left odd by a
//! process that died mid-grant makes snapshots inconsistent until it is refunded.

use crate::sync::{AtomicU64, Ordering::SeqCst, fence, yield_now};

/// One budget of the books: a device's limit or a tenant's quota.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Budget {
    /// A device entry.
    Device(usize),
    /// A tenant entry.
    Tenant(usize),
}

/// Slots as the protocol sees them.
pub(crate) trait Table {
    /// Slots that may hold a grant: one past the highest slot ever claimed.
    fn hwm(&self) -> &AtomicU64;
    /// How many slots there are.
    fn slot_count(&self) -> usize;
    /// A slot's state word: the state in the low byte, the generation above.
    fn state(&self, slot: usize) -> &AtomicU64;
    /// A slot's sequence word (odd while its owner changes its grants).
    fn seq(&self, slot: usize) -> &AtomicU64;
    /// A slot's grant word for `budget`.
    fn grant(&self, slot: usize, budget: Budget) -> &AtomicU64;
    /// Every budget of a slot, in order (what a refund zeroes).
    fn budgets(&self) -> impl Iterator<Item = Budget>;
}

/// Slot states (see [`crate::format`]).
pub(crate) use crate::format::{SLOT_CLAIMING, SLOT_FREE, SLOT_LIVE, SLOT_REFUNDING};

/// A state word: `state` in the low byte, `generation` above it.
pub(crate) const fn state_word(state: u64, generation: u64) -> u64 {
    (generation << 8) | state
}

/// The state of a state word.
pub(crate) const fn state_of(word: u64) -> u64 {
    word & 0xff
}

/// The generation of a state word.
pub(crate) const fn generation_of(word: u64) -> u64 {
    word >> 8
}

/// Bytes granted from `budget`, summed over the slots (not a snapshot: see the module
/// docs; inside a grant this is step 3).
pub(crate) fn granted<T: Table>(table: &T, budget: Budget) -> u64 {
    let slots = (table.hwm().load(SeqCst) as usize).min(table.slot_count());
    (0..slots).fold(0u64, |sum, slot| sum.saturating_add(table.grant(slot, budget).load(SeqCst)))
}

/// Draws `want` bytes (at least `at_least`) from `budget` for `slot`, whose owner calls
/// this, against `limit`. `Ok(bytes granted)`, or `Err(bytes that were available)`.
pub(crate) fn try_grant<T: Table>(
    table: &T,
    slot: usize,
    budget: Budget,
    limit: u64,
    want: u64,
    at_least: u64,
) -> Result<u64, u64> {
    let at_least = at_least.min(want);
    let seq = table.seq(slot);
    let own = table.grant(slot, budget);
    // The add never carries the own word past `u64::MAX`: wrapped, the word would hold
    // less than was granted, and the sum (so every later grant's check) would count less
    // than the slot holds. So `want` is cut to the room left in the word, and a grant
    // whose `at_least` does not fit is refused before anything is written. Only the
    // owner adds to its word, so the word read here is the one the add below adds to.
    let room = u64::MAX - own.load(SeqCst);
    if room < at_least {
        return Err(limit.saturating_sub(granted(table, budget)));
    }
    let want = want.min(room);
    seq.fetch_add(1, SeqCst);
    own.fetch_add(want, SeqCst);
    // The store-buffering point: the add before any read of the other slots. `SeqCst`
    // on the operations alone orders them in C++'s model too; the fence makes the
    // argument the textbook one (and the one loom checks: it treats `SeqCst` accesses as
    // acquire/release, fences as sequentially consistent). On x86-64 the locked add is
    // a full barrier already.
    fence(SeqCst);
    let total = granted(table, budget);
    let result = if total <= limit {
        Ok(want)
    } else {
        let excess = total - limit;
        let left = want.saturating_sub(excess);
        if left >= at_least && left > 0 {
            own.fetch_sub(want - left, SeqCst);
            Ok(left)
        } else {
            own.fetch_sub(want, SeqCst);
            Err(left)
        }
    };
    seq.fetch_add(1, SeqCst);
    result
}

/// Gives `bytes` of `slot`'s grant from `budget` back (its owner calls this, after it
/// lowered the local limit the grant backed).
pub(crate) fn give_back<T: Table>(table: &T, slot: usize, budget: Budget, bytes: u64) {
    if bytes == 0 {
        return;
    }
    let seq = table.seq(slot);
    seq.fetch_add(1, SeqCst);
    let own = table.grant(slot, budget);
    // Never below zero, even on a scribbled word.
    let _ = own.fetch_update(SeqCst, SeqCst, |held| Some(held.saturating_sub(bytes)));
    seq.fetch_add(1, SeqCst);
}

/// Reads `read` from a consistent picture of the slots (a double collect, see the module
/// docs), trying at most `tries` times; `None` if no try was consistent.
pub(crate) fn consistent<T: Table, R>(table: &T, tries: usize, read: impl Fn(&T) -> R) -> Option<R> {
    let slots = table.slot_count();
    let mut before = Vec::with_capacity(slots);
    for _ in 0..tries {
        before.clear();
        before.extend((0..slots).map(|slot| table.seq(slot).load(SeqCst)));
        if before.iter().all(|seq| seq.is_multiple_of(2)) {
            let value = read(table);
            if (0..slots).all(|slot| table.seq(slot).load(SeqCst) == before[slot]) {
                return Some(value);
            }
        }
        yield_now();
    }
    None
}

/// Claims a free slot for a new owner; the caller holds the books' lock. `identity`
/// writes the owner's identity words into the slot before it is published live.
/// `Some((slot, generation))`, or `None` when every slot is taken.
pub(crate) fn claim<T: Table>(table: &T, identity: impl FnOnce(usize)) -> Option<(usize, u64)> {
    for slot in 0..table.slot_count() {
        let word = table.state(slot).load(SeqCst);
        if state_of(word) != SLOT_FREE {
            continue;
        }
        let generation = generation_of(word).wrapping_add(1);
        if table.state(slot).compare_exchange(word, state_word(SLOT_CLAIMING, generation), SeqCst, SeqCst).is_err() {
            continue;
        }
        // A free slot holds nothing (its refund or release zeroed it); zero it anyway so a
        // scribbled word cannot be inherited.
        zero(table, slot);
        identity(slot);
        table.hwm().fetch_max(slot as u64 + 1, SeqCst);
        table.state(slot).store(state_word(SLOT_LIVE, generation), SeqCst);
        return Some((slot, generation));
    }
    None
}

/// Zeroes every grant of `slot` (its owner is gone or leaving, and the caller holds the
/// books' lock) and frees it, if its state word is still `expected`. Returns the bytes
/// its grants held, or `None` if the slot changed hands in between.
pub(crate) fn refund<T: Table>(table: &T, slot: usize, expected: u64) -> Option<u64> {
    let generation = generation_of(expected);
    let refunding = state_word(SLOT_REFUNDING, generation);
    if expected != refunding && table.state(slot).compare_exchange(expected, refunding, SeqCst, SeqCst).is_err() {
        return None;
    }
    let held = zero(table, slot);
    table.state(slot).store(state_word(SLOT_FREE, generation), SeqCst);
    Some(held)
}

/// Zeroes a slot's grants inside one odd `seq` window; the bytes they held.
fn zero<T: Table>(table: &T, slot: usize) -> u64 {
    let seq = table.seq(slot);
    // A process that died mid-grant left `seq` odd: keep it odd while zeroing.
    if seq.load(SeqCst).is_multiple_of(2) {
        seq.fetch_add(1, SeqCst);
    }
    let held = table.budgets().fold(0u64, |sum, budget| sum.saturating_add(table.grant(slot, budget).swap(0, SeqCst)));
    seq.fetch_add(1, SeqCst);
    held
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    /// Two slots and one budget, in plain atomics.
    #[derive(Default)]
    struct Two {
        hwm: AtomicU64,
        state: [AtomicU64; 2],
        seq: [AtomicU64; 2],
        grant: [AtomicU64; 2],
    }

    impl Table for Two {
        fn hwm(&self) -> &AtomicU64 {
            &self.hwm
        }
        fn slot_count(&self) -> usize {
            2
        }
        fn state(&self, slot: usize) -> &AtomicU64 {
            &self.state[slot]
        }
        fn seq(&self, slot: usize) -> &AtomicU64 {
            &self.seq[slot]
        }
        fn grant(&self, slot: usize, _budget: Budget) -> &AtomicU64 {
            &self.grant[slot]
        }
        fn budgets(&self) -> impl Iterator<Item = Budget> {
            std::iter::once(Budget::Device(0))
        }
    }

    #[test]
    fn a_grant_that_would_wrap_its_slots_word_is_refused_and_writes_nothing() {
        let table = Two::default();
        table.hwm.store(2, SeqCst);
        let budget = Budget::Device(0);
        // A huge limit (no limit is u64::MAX): the sum saturates, the own word must not wrap.
        let limit = u64::MAX - 4;
        let first = u64::MAX / 2 + 8;
        assert_eq!(try_grant(&table, 0, budget, limit, first, first), Ok(first));
        // Wrapped, the word would read `2 * first - 2^64` = 14 bytes, within the limit: the
        // second grant stood, and the two together (2^64 + 14 bytes) were counted as 14.
        assert_eq!(try_grant(&table, 0, budget, limit, first, first), Err(limit - first));
        assert_eq!(table.grant[0].load(SeqCst), first, "the slot's word holds the first grant only");
        assert!(table.seq[0].load(SeqCst).is_multiple_of(2), "no grant is left in flight");
        // A grant that may be less gets what fits (a huge grant chunk keeps working).
        assert_eq!(try_grant(&table, 0, budget, limit, first, 1), Ok(limit - first));
        assert_eq!(granted(&table, budget), limit);
        assert_eq!(try_grant(&table, 0, budget, limit, u64::MAX, 1), Err(0), "the limit is reached");
        assert_eq!(table.grant[0].load(SeqCst), limit);
    }
}
