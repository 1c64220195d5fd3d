//! The record table: one owner-local table of per-block records, the way every layer
//! keeps the blocks it handed out (a layer trusts no answer it did not mint, so each
//! keeps its own; they all keep them here).
//!
//! Each thread records in its own part of the table ([`PerThread`] by
//! [`thread_index`]), in slots of an [`OwnerSlots`]. A record is a state word and a
//! payload ([`Payload`]: the layer's fields, kept in atomics so that any thread reads
//! them without a lock).
//!
//! - **Insert** is the owner's alone: claim a slot, write the payload, publish it with
//!   a `Release` store of the state word (a generation, never zero, never reused within
//!   a part). Plain loads and stores on the owner's own lines; no read-modify-write.
//! - **Take**, from any thread, is one compare-and-swap of the state word from the
//!   generation the tag names to that generation *in transit*, so of two racing takes
//!   exactly one wins. The payload is read before the swap; the swap succeeding proves
//!   the read saw that generation's payload (a slot is rewritten only after its state
//!   left it). The caller's `accept` check (is this the block presented?) runs on that
//!   read, before the swap, so a refused take writes nothing.
//! - A taken record is settled exactly once: [`TakenRecord::free`] (a plain store; the
//!   slot goes back to the owner's own list, or from another thread to its remote
//!   stack with one compare-and-swap), [`TakenRecord::restore`] (live again, unchanged,
//!   under the same tag) or [`TakenRecord::restore_with`] (live again under the same
//!   tag with a new payload: a quarantine that changed what is still owned). Dropped
//!   unsettled, the record stays in transit for good: counted, never taken again.
//! - **Get** (a copy of a live record, any thread, no write) reads the payload between
//!   two looks at the state word and at the record's rewrite count (a seqlock:
//!   [`TakenRecord::restore_with`] makes the count odd while it rewrites), so it
//!   returns one version of the payload whole or nothing.
//!
//! # Tags and capacity
//! A tag is `owner (16 bits) | slot (24) | generation (low 24 bits)`:
//!
//! - a tag whose owner, slot or generation names no live record takes nothing (a
//!   forged or foreign tag, or a stale one: its slot was reused since, unless exactly
//!   a multiple of 2^24 generations of that part went by);
//! - threads whose index the 16 bits cannot name (65,535 and above: more than 65,534
//!   threads at once, or indices taken in thread-local destructors, which are never
//!   recycled) share one overflow part, claimed under a lock (cold). Its slot field
//!   never reaches all ones, so the all-ones tag names no record;
//! - a part holds at most [`SLOTS_PER_OWNER`] (2^24 - 32) records at once; past that,
//!   [`RecordTable::insert`] returns `None` (the layer refuses the allocation) until
//!   some are freed.
//!
//! A [`RecordRef`] names a record with its full generation, which a part never reuses:
//! for indexes kept beside the table (the plugin loader's live ranges), whose entries
//! outlive the record.
//!
//! # Correctness
//! No `unsafe`. loom models (`src/loom_records.rs`, `cargo xtask loom`) check take
//! against take, take against the owner's reuse of the slot, restore against another
//! release, a rewrite against a reader, and (in `owner_slots`) remote give-backs against
//! the owner's take-all. The unit tests below run under Miri too (`scripts/miri.sh`).

use crate::lock;
use crate::owner_slots::{FreeLink, OwnerSlots};
use crate::per_thread::{PerThread, is_current, thread_index};
use crate::primitives::{AtomicU32, AtomicU64, Mutex, Ordering, fence};

/// A record's payload: the atomics it is kept in (`Self`) and the value they hold.
///
/// [`Payload::store`] and [`Payload::load`] are `Relaxed` stores and loads of the
/// fields, nothing else: the table orders them. Implement it on a type of the layer's
/// own (a struct of atomics), with [`Payload::Value`] the plain fields.
pub trait Payload: Default + Send + Sync {
    /// The payload as plain data.
    type Value: Copy;

    /// Writes `value` into the cells (`Relaxed` stores).
    fn store(&self, value: &Self::Value);

    /// Reads the value back (`Relaxed` loads).
    fn load(&self) -> Self::Value;
}

/// A payload of `N` words (for layers whose fields pack into words, and for tests).
pub struct Words<const N: usize>([AtomicU64; N]);

impl<const N: usize> Default for Words<N> {
    fn default() -> Self {
        Words(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl<const N: usize> Payload for Words<N> {
    type Value = [u64; N];

    #[inline]
    fn store(&self, value: &[u64; N]) {
        for (cell, &word) in self.0.iter().zip(value) {
            cell.store(word, Ordering::Relaxed);
        }
    }

    #[inline]
    fn load(&self) -> [u64; N] {
        std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed))
    }
}

const SLOT_BITS: u32 = 24;
const GENERATION_BITS: u32 = 24;
const OWNER_BITS: u32 = 64 - SLOT_BITS - GENERATION_BITS;
/// The owner index of the shared overflow part: threads whose index is this or above
/// record there.
const NO_OWNER: usize = (1 << OWNER_BITS) - 1;
const GENERATION_MASK: u64 = (1 << GENERATION_BITS) - 1;
/// A record's state word when it holds nothing.
const FREE: u64 = 0;
/// Set in a record's state word while it is taken (a release of its block under way).
const IN_TRANSIT: u64 = 1 << 63;

/// Records one part (one thread, or the overflow part) holds at most at once.
pub const SLOTS_PER_OWNER: u32 = (1 << SLOT_BITS) - 32;

/// Thread indexes below this have a part of their own; the rest share the overflow
/// part.
pub const OWNERS: usize = NO_OWNER;

/// One record; every field atomic so any thread reads it without a lock.
#[derive(Default)]
struct Record<P> {
    /// [`FREE`], or the generation the payload was recorded under, with
    /// [`IN_TRANSIT`] while the record is taken.
    state: AtomicU64,
    /// How many times [`TakenRecord::restore_with`] rewrote the payload, doubled: odd
    /// while a rewrite is under way (a seqlock count for readers of live records).
    rewrites: AtomicU32,
    /// The slot table's link while the record is free.
    next_free: AtomicU32,
    payload: P,
}

impl<P> FreeLink for Record<P> {
    #[inline]
    fn free_link(&self) -> &AtomicU32 {
        &self.next_free
    }
}

/// One thread's records (or the overflow part's, claimed under a lock).
struct Part<P> {
    slots: OwnerSlots<Record<P>>,
    /// The last generation recorded under (owner only; 0 before the first; a `u64`
    /// never wraps).
    next_generation: AtomicU64,
}

impl<P: Payload> Part<P> {
    fn new(limit: u32) -> Part<P> {
        Part { slots: OwnerSlots::with_limit(limit), next_generation: AtomicU64::new(0) }
    }

    /// Records `value` in a free slot (owner only); its slot and generation.
    #[inline]
    fn record(&self, value: &P::Value) -> Option<(u32, u64)> {
        let (slot, record) = self.slots.claim()?;
        let generation = self.next_generation.load(Ordering::Relaxed) + 1;
        self.next_generation.store(generation, Ordering::Relaxed);
        // Release fence: a reader that sees one of the writes below also sees the state
        // this slot had before (freed), so its second look at the state (`get`) notices
        // the reuse. Free on x86.
        fence(Ordering::Release);
        record.payload.store(value);
        // Release: the payload before the generation that publishes it.
        record.state.store(generation, Ordering::Release);
        Some((slot, generation))
    }
}

/// Where a value is recorded: its part, slot and full generation. Unlike a tag's low
/// 24 bits, a part never reuses a generation, so [`RecordTable::is_live`] answers for
/// exactly that record, however long the reference was kept.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct RecordRef {
    owner: u32,
    slot: u32,
    generation: u64,
}

impl RecordRef {
    /// The slot number in its part (slots are reused; see [`RecordRef`]).
    pub fn slot(&self) -> u32 {
        self.slot
    }
}

/// The record table (see the module docs): one per layer instance, shared by
/// reference between threads.
pub struct RecordTable<P> {
    parts: PerThread<Box<Part<P>>>,
    /// The records of threads whose index is [`OWNERS`] or above. One part, so one
    /// writer at a time claims its slots, under `overflow_claims`; its slots always come
    /// back through its remote stack.
    overflow: Part<P>,
    overflow_claims: Mutex<()>,
    /// Slots each part hands out.
    limit: u32,
}

/// A live record [`RecordTable::lookup`] found: its part, owner index, slot, the record
/// and its state word as loaded.
struct Found<'a, P> {
    part: &'a Part<P>,
    owner: usize,
    slot: u32,
    record: &'a Record<P>,
    state: u64,
}

#[inline]
fn tag(owner: usize, slot: u32, generation: u64) -> u64 {
    (owner as u64) << (SLOT_BITS + GENERATION_BITS) | u64::from(slot) << GENERATION_BITS | generation & GENERATION_MASK
}

#[inline]
fn untag(tag: u64) -> (usize, u32, u64) {
    let owner = (tag >> (SLOT_BITS + GENERATION_BITS)) as usize;
    let slot = ((tag >> GENERATION_BITS) & ((1 << SLOT_BITS) - 1)) as u32;
    (owner, slot, tag & GENERATION_MASK)
}

impl<P: Payload> Default for RecordTable<P> {
    fn default() -> Self {
        RecordTable::new()
    }
}

impl<P: Payload> RecordTable<P> {
    /// An empty table, [`SLOTS_PER_OWNER`] records per part.
    pub fn new() -> RecordTable<P> {
        RecordTable::with_limit(SLOTS_PER_OWNER)
    }

    /// An empty table whose parts hold fewer records (`limit`, at most
    /// [`SLOTS_PER_OWNER`], rounded down as [`OwnerSlots::with_limit`] does): a layer
    /// that wants a smaller bound, and tests of what happens at the bound.
    pub fn with_limit(limit: u32) -> RecordTable<P> {
        let limit = limit.min(SLOTS_PER_OWNER);
        RecordTable { parts: PerThread::new(), overflow: Part::new(limit), overflow_claims: Mutex::new(()), limit }
    }

    /// Records `value` in the calling thread's part; the tag that names the record and
    /// where it is. `None` when the part is full (see the module docs).
    #[inline(always)]
    pub fn insert(&self, value: &P::Value) -> Option<(u64, RecordRef)> {
        self.insert_as(thread_index(), value)
    }

    /// [`RecordTable::insert`] returning the tag alone (for a layer that keeps no
    /// [`RecordRef`]): always inlined, so the hot path of a layer writes the record with
    /// no call and no wider return value in between.
    #[inline(always)]
    pub fn insert_tag(&self, value: &P::Value) -> Option<u64> {
        let owner = thread_index();
        if owner >= NO_OWNER {
            return self.insert_overflow(value).map(|(tag, _)| tag);
        }
        let part = self.parts.get_or(owner, || Box::new(Part::new(self.limit)));
        let (slot, generation) = part.record(value)?;
        Some(tag(owner, slot, generation))
    }

    /// [`RecordTable::insert`] for the thread whose index is `owner`.
    #[inline]
    fn insert_as(&self, owner: usize, value: &P::Value) -> Option<(u64, RecordRef)> {
        if owner >= NO_OWNER {
            return self.insert_overflow(value);
        }
        let part = self.parts.get_or(owner, || Box::new(Part::new(self.limit)));
        let (slot, generation) = part.record(value)?;
        Some((tag(owner, slot, generation), RecordRef { owner: owner as u32, slot, generation }))
    }

    #[cold]
    fn insert_overflow(&self, value: &P::Value) -> Option<(u64, RecordRef)> {
        let _claims = lock(&self.overflow_claims);
        let (slot, generation) = self.overflow.record(value)?;
        Some((tag(NO_OWNER, slot, generation), RecordRef { owner: NO_OWNER as u32, slot, generation }))
    }

    /// The part an owner index names.
    #[inline]
    fn part(&self, owner: usize) -> Option<&Part<P>> {
        if owner >= NO_OWNER { Some(&self.overflow) } else { self.parts.get(owner).map(|part| &**part) }
    }

    /// The live record a tag names, if its generation matches and it is not taken.
    #[inline(always)]
    fn lookup(&self, tag: u64) -> Option<Found<'_, P>> {
        let (owner, slot, generation) = untag(tag);
        let part = self.part(owner)?;
        let record = part.slots.get(slot)?;
        let state = record.state.load(Ordering::Acquire);
        let live = state != FREE && state & IN_TRANSIT == 0 && state & GENERATION_MASK == generation;
        live.then_some(Found { part, owner, slot, record, state })
    }

    /// Takes the record `tag` names, if it is live and `accept` says its payload is the
    /// one the caller presents (any thread; of two racing takes of one record exactly
    /// one gets it). Until the taker settles it, the record counts and refuses every
    /// other take and get.
    ///
    /// Always inlined: returned by value through memory, the taken payload would be
    /// read back with wider loads than it was written with, a store-forwarding stall
    /// that `perf` showed costing as much as the compare-and-swap.
    #[inline(always)]
    pub fn take(&self, tag: u64, accept: impl Fn(&P::Value) -> bool) -> Option<TakenRecord<'_, P>> {
        let Found { part, owner, slot, record, state } = self.lookup(tag)?;
        // Acquire: a count this even was published after its rewrite's payload.
        let rewrites = record.rewrites.load(Ordering::Acquire);
        let mut value = record.payload.load();
        if !accept(&value) {
            return None;
        }
        // Success means the state stayed `state` since the Acquire load, so `value` is
        // that generation's payload (a slot is rewritten only after it was freed), or
        // the record was taken and restored with a new payload meanwhile, which the
        // rewrite count says. Acquire: a taker that wins after another's restore sees
        // that thread's writes (free on x86).
        record.state.compare_exchange(state, state | IN_TRANSIT, Ordering::Acquire, Ordering::Relaxed).ok()?;
        if record.rewrites.load(Ordering::Relaxed) != rewrites {
            // Rewritten under our read: read again, now that the record is ours.
            value = record.payload.load();
            if !accept(&value) {
                record.state.store(state, Ordering::Release);
                return None;
            }
        }
        // Slots of the overflow part always go back through its remote stack.
        let owned_here = owner < NO_OWNER && is_current(owner);
        Some(TakenRecord { part, slot, owned_here, record, live: state, value, _this_thread: std::marker::PhantomData })
    }

    /// A copy of the payload of the record `tag` names, if it is live (not taken) and
    /// `accept` says it is the one the caller presents (any thread, no write).
    pub fn get(&self, tag: u64, accept: impl FnOnce(&P::Value) -> bool) -> Option<P::Value> {
        let Found { record, state, .. } = self.lookup(tag)?;
        let rewrites = record.rewrites.load(Ordering::Acquire);
        let value = record.payload.load();
        // The reads above before the second looks: unchanged, they were one version of
        // that generation's payload (see the fence in `Part::record` and in
        // `TakenRecord::restore_with`).
        fence(Ordering::Acquire);
        let unchanged =
            record.state.load(Ordering::Relaxed) == state && record.rewrites.load(Ordering::Relaxed) == rewrites;
        (unchanged && rewrites % 2 == 0 && accept(&value)).then_some(value)
    }

    /// Whether the record at `at` is still the one recorded there and not taken (any
    /// thread). A record in transit is not live here: its block may already be gone.
    #[inline]
    pub fn is_live(&self, at: RecordRef) -> bool {
        let record = self.part(at.owner as usize).and_then(|part| part.slots.get(at.slot));
        record.is_some_and(|record| record.state.load(Ordering::Acquire) == at.generation)
    }

    /// The payload of every record held, taken ones included (cold: reads every slot;
    /// a racing insert or take may or may not be seen, and a record being rewritten
    /// may be read half old, half new).
    pub fn recorded(&self) -> impl Iterator<Item = P::Value> + '_ {
        let parts = self.parts.iter().map(|part| &**part).chain(std::iter::once(&self.overflow));
        parts
            .flat_map(|part| part.slots.iter())
            .filter(|record| record.state.load(Ordering::Acquire) != FREE)
            .map(|record| record.payload.load())
    }
}

/// A record taken from a [`RecordTable`]: its payload as recorded. Settle it with
/// [`TakenRecord::free`], [`TakenRecord::restore`] or [`TakenRecord::restore_with`].
/// Dropped unsettled (a panic on the way), the record stays in transit: counted, and
/// never taken again, since whether its block is still held is unknown.
#[must_use = "free or restore the record; dropped, it stays in transit for good"]
pub struct TakenRecord<'a, P: Payload> {
    part: &'a Part<P>,
    slot: u32,
    /// Whether the calling thread owns the record's slot.
    owned_here: bool,
    record: &'a Record<P>,
    /// The record's state word while live (its generation).
    live: u64,
    value: P::Value,
    /// Not `Send`: `owned_here` is the taking thread's answer, and a free on another
    /// thread would push onto the owner's single-writer list.
    _this_thread: std::marker::PhantomData<*const ()>,
}

impl<P: Payload> TakenRecord<'_, P> {
    /// The payload, exactly as recorded (or last restored with).
    #[inline]
    pub fn value(&self) -> &P::Value {
        &self.value
    }

    /// Whether the calling thread owns the record's part: it recorded the record (or
    /// holds that thread's index now). Never for the overflow part, whose slots always
    /// go back through its remote stack.
    #[inline]
    pub fn is_owned_here(&self) -> bool {
        self.owned_here
    }

    /// The block is gone: the record is freed and its slot goes back to its owner.
    #[inline]
    pub fn free(self) {
        self.record.state.store(FREE, Ordering::Relaxed);
        self.part.slots.give_back(self.slot, self.record, self.owned_here);
    }

    /// The block is still held, unchanged: the record is live again under the same tag.
    #[inline]
    pub fn restore(self) {
        self.record.state.store(self.live, Ordering::Release);
    }

    /// The block is still held, with a new payload (what is still owned changed): the
    /// record is live again under the same tag, holding `value`.
    pub fn restore_with(self, value: &P::Value) {
        let rewrites = self.record.rewrites.load(Ordering::Relaxed);
        // Odd while the payload is rewritten; the fence orders it before the payload's
        // stores, so a reader that sees one of them sees the count moved.
        self.record.rewrites.store(rewrites.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        self.record.payload.store(value);
        // Release: the payload before the even count and the live state.
        self.record.rewrites.store(rewrites.wrapping_add(2), Ordering::Release);
        self.record.state.store(self.live, Ordering::Release);
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    type Table = RecordTable<Words<2>>;

    fn take_free(table: &Table, tag: u64, value: [u64; 2]) -> Option<[u64; 2]> {
        let taken = table.take(tag, |recorded| *recorded == value)?;
        let recorded = *taken.value();
        taken.free();
        Some(recorded)
    }

    #[test]
    fn tags_round_trip_and_all_ones_names_no_record() {
        assert_eq!(untag(tag(5, 77, 1 << 30 | 9)), (5, 77, 9), "the generation keeps its low bits");
        assert_eq!(untag(u64::MAX).0, NO_OWNER, "all ones names the overflow part");
        let table = Table::new();
        let value = [0x1000, 256];
        let (recorded, _) = table.insert(&value).unwrap();
        // The overflow part holds records too, and still the all-ones slot is never one.
        let (overflowed, _) = table.insert_as(NO_OWNER, &value).unwrap();
        assert_eq!(untag(overflowed).0, NO_OWNER);
        for forged in [u64::MAX, recorded ^ 1, overflowed ^ 1, recorded ^ 1 << 40, recorded ^ 1 << 60] {
            assert!(table.get(forged, |_| true).is_none(), "{forged:#x}");
            assert!(take_free(&table, forged, value).is_none(), "{forged:#x}");
        }
        assert_eq!(table.recorded().count(), 2);
    }

    #[test]
    fn threads_past_the_tags_owner_field_share_the_overflow_part() {
        let table = std::sync::Arc::new(Table::new());
        let values: Vec<[u64; 2]> = (1..=40).map(|i| [i * 0x1000, 256]).collect();
        // Indices the tag cannot name, as a thread past 65534 or one recording in its
        // thread-local destructors has.
        let tags: Vec<u64> =
            values.iter().enumerate().map(|(i, v)| table.insert_as(NO_OWNER + i, v).unwrap().0).collect();
        assert!(tags.iter().all(|&tag| untag(tag).0 == NO_OWNER));
        assert_eq!(table.recorded().count(), 40);
        // Freed from another thread: the slots come back for the next overflowing
        // recorder, whose claims are serialised by the part's lock.
        let releaser = std::sync::Arc::clone(&table);
        let pairs: Vec<_> = values.iter().copied().zip(tags.iter().copied()).collect();
        std::thread::spawn(move || {
            for (value, tag) in pairs {
                assert_eq!(take_free(&releaser, tag, value), Some(value));
            }
        })
        .join()
        .unwrap();
        assert_eq!(table.recorded().count(), 0);
        let reused: Vec<u32> = values.iter().map(|v| untag(table.insert_as(NO_OWNER, v).unwrap().0).1).collect();
        assert!(reused.iter().all(|&slot| slot < 40), "{reused:?}");
    }

    #[test]
    fn insert_tag_records_as_insert_does() {
        let table = Table::with_limit(32);
        let value = [0x3000, 64];
        let tag = table.insert_tag(&value).unwrap();
        let taken = table.take(tag, |_| true).unwrap();
        assert!(taken.is_owned_here(), "recorded on this thread");
        taken.restore();
        std::thread::scope(|s| {
            s.spawn(|| {
                let taken = table.take(tag, |_| true).unwrap();
                assert!(!taken.is_owned_here(), "taken on another");
                taken.restore();
            });
        });
        assert_eq!(table.get(tag, |_| true), Some(value));
        let (other, at) = table.insert(&value).unwrap();
        assert_eq!(untag(other).0, untag(tag).0, "the same part");
        assert_ne!(untag(other).1, untag(tag).1);
        assert!(table.is_live(at));
        while table.insert_tag(&value).is_some() {}
        assert_eq!(table.recorded().count(), 32, "a full part refuses insert_tag too");
        assert_eq!(take_free(&table, tag, value), Some(value));
        assert_eq!(untag(table.insert_tag(&value).unwrap()).1, untag(tag).1, "and reuses a freed slot");
    }

    #[test]
    fn a_full_part_refuses_to_record_until_a_record_is_freed() {
        let table = Table::with_limit(40);
        let value = [0x1000, 256];
        let tags: Vec<u64> = (0..32).map(|_| table.insert(&value).unwrap().0).collect();
        assert!(table.insert(&value).is_none(), "full (the limit rounds down to a segment)");
        assert_eq!(take_free(&table, tags[7], value), Some(value));
        let (again, _) = table.insert(&value).unwrap();
        assert_eq!(untag(again).1, untag(tags[7]).1, "a freed slot is recorded into again");
        assert!(table.insert(&value).is_none());
        assert!(Table::with_limit(0).insert(&value).is_none(), "a table of no records refuses every one");
        assert_eq!(Table::with_limit(u32::MAX).limit, SLOTS_PER_OWNER, "no part holds more than a tag names");
    }

    #[test]
    fn a_record_is_taken_once_and_a_stale_tag_never_takes_its_reused_slot() {
        let table = Table::new();
        let value = [0x1000, 256];
        let (tag, _) = table.insert(&value).unwrap();
        assert_eq!(table.get(tag, |_| true), Some(value));
        assert_eq!(take_free(&table, tag, value), Some(value));
        assert!(take_free(&table, tag, value).is_none(), "taken once");
        // The same value again, in the same slot under a new generation.
        let (again, _) = table.insert(&value).unwrap();
        assert_eq!(untag(again).1, untag(tag).1, "the slot is reused");
        assert!(take_free(&table, tag, value).is_none() && table.get(tag, |_| true).is_none());
        assert_eq!(table.recorded().count(), 1);
        assert_eq!(take_free(&table, again, value), Some(value));
        assert_eq!(table.recorded().count(), 0);
    }

    #[test]
    fn a_refused_take_leaves_the_record_live() {
        let table = Table::new();
        let value = [0x2000, 256];
        let (tag, at) = table.insert(&value).unwrap();
        assert!(take_free(&table, tag, [0x2000, 512]).is_none(), "another payload");
        assert!(table.get(tag, |recorded| recorded[1] == 512).is_none());
        assert!(table.is_live(at), "a refusal writes nothing");
        assert_eq!(take_free(&table, tag, value), Some(value), "the record survived the refusals");
    }

    #[test]
    fn a_taken_record_refuses_other_takes_and_is_restored_under_its_tag() {
        let table = Table::new();
        let value = [0x4000, 256];
        let (tag, at) = table.insert(&value).unwrap();
        let taken = table.take(tag, |_| true).unwrap();
        assert_eq!(*taken.value(), value);
        assert!(table.take(tag, |_| true).is_none(), "a second release while the first is under way");
        assert!(table.get(tag, |_| true).is_none() && !table.is_live(at), "nothing reads a record being released");
        assert_eq!(table.recorded().count(), 1, "a taken record still counts");
        taken.restore();
        assert_eq!(table.get(tag, |_| true), Some(value), "live again under the same tag");
        // Restored with a new payload: the same tag now names the new one.
        table.take(tag, |_| true).unwrap().restore_with(&[0x4000, 64]);
        assert_eq!(table.get(tag, |_| true), Some([0x4000, 64]));
        assert!(table.is_live(at));
        assert_eq!(table.take(tag, |_| true).map(|taken| *taken.value()), Some([0x4000, 64]), "and is taken");
        // That take was dropped unsettled (as a panic on the way would): in transit for
        // good, counted, never taken again.
        assert!(table.take(tag, |_| true).is_none() && table.get(tag, |_| true).is_none());
        assert_eq!(table.recorded().count(), 1);
    }

    #[test]
    fn is_live_answers_only_while_that_record_is_live() {
        let table = Table::new();
        let value = [0x5000, 256];
        let (tag, at) = table.insert(&value).unwrap();
        assert!(table.is_live(at));
        assert_eq!(take_free(&table, tag, value), Some(value));
        assert!(!table.is_live(at), "freed");
        let (_, again) = table.insert(&value).unwrap();
        assert_eq!(again.slot(), at.slot(), "the slot is reused");
        assert!(!table.is_live(at) && table.is_live(again), "under a new generation");
        let (_, overflowed) = table.insert_as(NO_OWNER, &value).unwrap();
        assert!(table.is_live(overflowed));
        let forged = RecordRef { owner: 7, slot: 3, generation: 1 };
        assert!(!table.is_live(forged), "a part that does not exist");
    }

    #[test]
    fn records_made_on_one_thread_are_taken_on_another_and_their_slots_reused() {
        let table = std::sync::Arc::new(Table::new());
        let values: Vec<[u64; 2]> = (1..=40).map(|i| [i * 0x1000, 256]).collect();
        let tags: Vec<u64> = values.iter().map(|v| table.insert(v).unwrap().0).collect();
        let taker = {
            let table = std::sync::Arc::clone(&table);
            let pairs: Vec<_> = values.iter().copied().zip(tags.iter().copied()).collect();
            std::thread::spawn(move || {
                let mut taken = 0;
                for (value, tag) in pairs {
                    taken += usize::from(take_free(&table, tag, value) == Some(value));
                    // A record of this thread's own, among the others' (another part).
                    let (own, _) = table.insert(&value).unwrap();
                    assert_ne!(untag(own).0, untag(tag).0);
                    assert_eq!(take_free(&table, own, value), Some(value));
                }
                taken
            })
        };
        assert_eq!(taker.join().unwrap(), 40);
        assert_eq!(table.recorded().count(), 0);
        // The slots came back through the remote stack: no new segment is needed.
        let reused: Vec<u32> = values.iter().map(|v| untag(table.insert(v).unwrap().0).1).collect();
        assert!(reused.iter().all(|&slot| slot < 40), "{reused:?}");
    }
}
