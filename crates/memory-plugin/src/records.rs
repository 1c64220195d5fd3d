//! The host's own record of every block a plugin handed out, so that no block the
//! plugin did not issue (forged, foreign, already released) ever reaches it.
//!
//! Owner-local, like the registry's allocation records: each thread records the blocks
//! it allocates in its own part of the table ([`PerThread`] by thread index), in slots
//! of an [`OwnerSlots`].
//!
//! - Recording is the owner's alone: claim a slot, write the block, publish it with a
//!   `Release` store of the record's state word (a generation, never zero, never reused
//!   within a part). No read-modify-write.
//! - Taking a record for a release, from any thread, is one compare-and-swap of the
//!   state word from the generation the tag names to that generation in transit, so of
//!   two racing takes exactly one wins. The block is read before the swap; the swap
//!   succeeding proves the read saw that generation's block (a slot is rewritten only
//!   after its state left it). The taker then frees the record (plain store; the slot
//!   goes back to its owner) or, when the plugin kept the block, restores it as it was,
//!   under the same tag.
//! - A block's `provider_tag` names its record: owner index, slot, and the low 24 bits
//!   of the generation, so a stale tag does not take a slot reused since (unless it was
//!   reused a multiple of 2^24 times). The block itself is compared too (address, size,
//!   alignment, device).
//! - Threads whose index the tag's 16 bits cannot name share one overflow part, whose
//!   slots they claim under a lock (cold: more than 65534 threads at once, or indices
//!   taken in thread-local destructors, which are never recycled).
//! - A thread records at most 2^24 - 32 blocks live at once; past that, recording fails
//!   (the allocation is refused) until some are released.

use memory_api::RawAllocation;
use memory_plugin_abi::{MpBlock, MpDevice};
use memory_sync::lock;
use memory_sync::owner_slots::{FreeLink, OwnerSlots};
use memory_sync::per_thread::{PerThread, is_current, thread_index};
use memory_sync::primitives::{AtomicU32, AtomicU64, Mutex, Ordering, fence};

use crate::negotiate::abi_device;

const SLOT_BITS: u32 = 24;
const GENERATION_BITS: u32 = 24;
const OWNER_BITS: u32 = 64 - SLOT_BITS - GENERATION_BITS;
/// The owner index of the shared overflow part: threads whose index is this or above
/// record there. (Its slot field never reaches all ones, so the all-ones tag names no
/// record.)
const NO_OWNER: usize = (1 << OWNER_BITS) - 1;
const GENERATION_MASK: u64 = (1 << GENERATION_BITS) - 1;
/// A record's state word when it holds no block.
const FREE: u64 = 0;
/// Set in a record's state word while a release of its block is under way.
const IN_TRANSIT: u64 = 1 << 63;

/// One recorded block; every field atomic so any thread reads it without a lock.
#[derive(Default)]
struct Record {
    /// [`FREE`], or the generation the block was recorded under, with [`IN_TRANSIT`]
    /// while a release of it is under way.
    state: AtomicU64,
    address: AtomicU64,
    bytes: AtomicU64,
    align: AtomicU64,
    /// `tier << 32 | index`.
    device: AtomicU64,
    tag: AtomicU64,
    /// The slot table's link while the record is free.
    next_free: AtomicU32,
}

impl FreeLink for Record {
    #[inline]
    fn free_link(&self) -> &AtomicU32 {
        &self.next_free
    }
}

impl Record {
    #[inline]
    fn write(&self, block: &MpBlock) {
        self.address.store(block.address, Ordering::Relaxed);
        self.bytes.store(block.bytes, Ordering::Relaxed);
        self.align.store(block.align, Ordering::Relaxed);
        self.device.store(u64::from(block.device.tier) << 32 | u64::from(block.device.index), Ordering::Relaxed);
        self.tag.store(block.tag, Ordering::Relaxed);
    }

    #[inline]
    fn read(&self) -> MpBlock {
        let device = self.device.load(Ordering::Relaxed);
        MpBlock {
            address: self.address.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            align: self.align.load(Ordering::Relaxed),
            device: MpDevice { tier: (device >> 32) as u32, index: device as u32 },
            tag: self.tag.load(Ordering::Relaxed),
        }
    }
}

/// One thread's records (or, for threads whose index a tag cannot name, the shared
/// overflow part, claimed under a lock).
struct Part {
    slots: OwnerSlots<Record>,
    /// The last generation recorded under (owner only; 0 before the first; a `u64`
    /// never wraps).
    next_generation: AtomicU64,
}

impl Part {
    fn new() -> Part {
        Part { slots: OwnerSlots::with_limit(1 << SLOT_BITS), next_generation: AtomicU64::new(0) }
    }

    /// Records `block` in a free slot (owner only); its slot and generation.
    #[inline]
    fn record(&self, block: &MpBlock) -> Option<(u32, u64)> {
        let (slot, record) = self.slots.claim()?;
        let generation = self.next_generation.load(Ordering::Relaxed) + 1;
        self.next_generation.store(generation, Ordering::Relaxed);
        // Release fence: a reader that sees one of the writes below also sees the state
        // this slot had before (freed), so its second look at the state (`get`) notices
        // the reuse. Free on x86.
        fence(Ordering::Release);
        record.write(block);
        // Release: the block's fields before the generation that publishes them.
        record.state.store(generation, Ordering::Release);
        Some((slot, generation))
    }
}

/// Where a block is recorded: its part, slot and full generation. The live-range index's
/// handle on a record: unlike a tag's low 24 bits, a part never reuses a generation, so
/// the record's state word equals it exactly while that block is recorded there and no
/// release of it is under way.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct RecordRef {
    owner: u32,
    slot: u32,
    generation: u64,
}

pub(crate) struct Records {
    parts: PerThread<Box<Part>>,
    /// The records of threads whose index is [`NO_OWNER`] or above (an index a tag
    /// cannot name: more than 65534 threads at once, or indices taken in thread-local
    /// destructors and never recycled). One part, so one writer at a time claims its
    /// slots under `overflow_claims`; their slots always come back through its remote
    /// stack.
    overflow: Part,
    overflow_claims: Mutex<()>,
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

/// Whether a record describes the block a caller presents (on this instance's device).
#[inline]
fn matches(record: &MpBlock, block: &RawAllocation, device: MpDevice) -> bool {
    record.address == block.address().get()
        && record.bytes == block.bytes() as u64
        && record.align == block.align() as u64
        && record.device == device
        && abi_device(block.device()) == device
}

impl Records {
    pub(crate) fn new() -> Records {
        Records { parts: PerThread::new(), overflow: Part::new(), overflow_claims: Mutex::new(()) }
    }

    /// Records `block` in the calling thread's part; returns the tag that names the
    /// record. `None` when the part has 2^24 - 32 blocks live.
    #[cfg(test)]
    pub(crate) fn insert(&self, block: &MpBlock) -> Option<u64> {
        self.insert_ref(block).map(|(tag, _)| tag)
    }

    /// [`Records::insert`], with where the block is recorded.
    #[inline(always)]
    pub(crate) fn insert_ref(&self, block: &MpBlock) -> Option<(u64, RecordRef)> {
        self.insert_as(thread_index(), block)
    }

    /// [`Records::insert_ref`] for the thread whose index is `owner`.
    #[inline]
    fn insert_as(&self, owner: usize, block: &MpBlock) -> Option<(u64, RecordRef)> {
        if owner >= NO_OWNER {
            return self.insert_overflow(block);
        }
        let part = self.parts.get_or(owner, || Box::new(Part::new()));
        let (slot, generation) = part.record(block)?;
        Some((tag(owner, slot, generation), RecordRef { owner: owner as u32, slot, generation }))
    }

    #[cold]
    fn insert_overflow(&self, block: &MpBlock) -> Option<(u64, RecordRef)> {
        let _claims = lock(&self.overflow_claims);
        let (slot, generation) = self.overflow.record(block)?;
        Some((tag(NO_OWNER, slot, generation), RecordRef { owner: NO_OWNER as u32, slot, generation }))
    }

    /// The part a tag's owner index names.
    #[inline]
    fn part(&self, owner: usize) -> Option<&Part> {
        if owner >= NO_OWNER { Some(&self.overflow) } else { self.parts.get(owner).map(|part| &**part) }
    }

    /// The live record a tag names and its state word, if its generation matches and
    /// no release of it is under way.
    #[inline(always)]
    fn lookup(&self, tag: u64) -> Option<(&Part, usize, u32, &Record, u64)> {
        let (owner, slot, generation) = untag(tag);
        let part = self.part(owner)?;
        let record = part.slots.get(slot)?;
        let state = record.state.load(Ordering::Acquire);
        let live = state != FREE && state & IN_TRANSIT == 0 && state & GENERATION_MASK == generation;
        live.then_some((part, owner, slot, record, state))
    }

    /// Takes the record of `block` for a release, if it is one of ours and describes
    /// exactly it (any thread; of two racing takes of one record exactly one gets it).
    /// Until the taker frees or restores it, the record counts and refuses every other
    /// take.
    ///
    /// Always inlined: returned by value through memory, the taken record's block is
    /// read back with wider loads than it was written with, a store-forwarding stall
    /// that `perf` shows costing as much as the compare-and-swap.
    #[inline(always)]
    pub(crate) fn take(&self, block: &RawAllocation, device: MpDevice) -> Option<TakenRecord<'_>> {
        let (part, owner, slot, record, state) = self.lookup(block.provider_tag())?;
        let recorded = record.read();
        if !matches(&recorded, block, device) {
            return None;
        }
        // Success means the state stayed `state` since the Acquire load, so `recorded`
        // is that generation's block (a slot is rewritten only after it was freed).
        // Acquire: a taker that wins after another's restore sees that thread's reads as
        // done before (free on x86).
        record.state.compare_exchange(state, state | IN_TRANSIT, Ordering::Acquire, Ordering::Relaxed).ok()?;
        // Slots of the overflow part always go back through its remote stack.
        let owned_here = owner < NO_OWNER && is_current(owner);
        Some(TakenRecord { part, slot, owned_here, record, live: state, block: recorded })
    }

    /// A copy of the record of `block`, if it is one of ours and no release of it is
    /// under way (any thread).
    pub(crate) fn get(&self, block: &RawAllocation, device: MpDevice) -> Option<MpBlock> {
        let (_, _, _, record, state) = self.lookup(block.provider_tag())?;
        let recorded = record.read();
        // The reads above before the second look at the state: unchanged, they were
        // that generation's block (see the fence in `Part::record`).
        fence(Ordering::Acquire);
        let unchanged = record.state.load(Ordering::Relaxed) == state;
        (unchanged && matches(&recorded, block, device)).then_some(recorded)
    }

    /// Whether the block recorded at `at` is still recorded there with no release of it
    /// under way (any thread; for the live-range index, whose entries are not removed on
    /// release). A record in transit is not live here: the plugin may already have freed
    /// its block, and may hand the memory out again before the releasing thread frees
    /// the record.
    #[inline]
    pub(crate) fn is_live(&self, at: RecordRef) -> bool {
        let record = self.part(at.owner as usize).and_then(|part| part.slots.get(at.slot));
        record.is_some_and(|record| record.state.load(Ordering::Acquire) == at.generation)
    }

    /// Blocks recorded and their bytes, releases under way included (cold: reads every
    /// record; a racing insert or take may or may not be counted).
    pub(crate) fn count(&self) -> (usize, usize) {
        let parts = self.parts.iter().map(|part| &**part).chain(std::iter::once(&self.overflow));
        let records = parts.flat_map(|part| part.slots.iter());
        records.filter(|record| record.state.load(Ordering::Acquire) != FREE).fold((0, 0), |(count, bytes), record| {
            // Saturating: block sizes are the plugin's word, and a tally never panics.
            let size = usize::try_from(record.bytes.load(Ordering::Relaxed)).unwrap_or(usize::MAX);
            (count + 1, bytes.saturating_add(size))
        })
    }
}

/// A record taken for a release: the block as the plugin issued it. Settle it with
/// [`TakenRecord::free`] once the plugin took the block back, or
/// [`TakenRecord::restore`] when it kept it. Dropped unsettled (a panic on the way), the
/// record stays in transit: counted, so unload waits, and never taken again, since
/// whether the plugin still holds the block is unknown.
#[must_use = "free or restore the record; dropped, it stays in transit for good"]
pub(crate) struct TakenRecord<'a> {
    part: &'a Part,
    slot: u32,
    /// Whether the calling thread owns the record's slot.
    owned_here: bool,
    record: &'a Record,
    /// The record's state word while live (its generation).
    live: u64,
    block: MpBlock,
}

impl TakenRecord<'_> {
    /// The block exactly as the plugin wrote it when it issued it.
    #[inline]
    pub(crate) fn block(&self) -> &MpBlock {
        &self.block
    }

    /// The plugin no longer holds the block: the record is freed and its slot goes
    /// back to its owner.
    #[inline]
    pub(crate) fn free(self) {
        self.record.state.store(FREE, Ordering::Relaxed);
        self.part.slots.give_back(self.slot, self.record, self.owned_here);
    }

    /// The plugin kept the block: the record is live again under the same tag.
    #[inline]
    pub(crate) fn restore(self) {
        self.record.state.store(self.live, Ordering::Release);
    }
}

/// What the unit tests and the loom models build records from.
#[cfg(test)]
mod fixtures {
    use super::*;
    use memory_api::{DeviceAddress, DeviceKey};

    pub(super) const HOST: MpDevice = MpDevice { tier: memory_plugin_abi::MP_TIER_HOST, index: 0 };

    pub(super) fn block(address: u64) -> MpBlock {
        MpBlock { address, bytes: 256, align: 64, device: HOST, tag: address ^ 0xabcd }
    }

    pub(super) fn raw(block: &MpBlock, tag: u64) -> RawAllocation {
        let address = DeviceAddress::new(block.address).unwrap();
        RawAllocation::new(address, block.bytes as usize, block.align as usize, DeviceKey::HOST, tag)
    }

    /// Takes a record and frees it, as a release the plugin completed does.
    pub(super) fn take_free(records: &Records, block: &RawAllocation, device: MpDevice) -> Option<MpBlock> {
        let taken = records.take(block, device)?;
        let recorded = *taken.block();
        taken.free();
        Some(recorded)
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::fixtures::*;
    use super::*;

    #[test]
    fn tags_round_trip_and_all_ones_names_no_record() {
        assert_eq!(untag(tag(5, 77, 1 << 30 | 9)), (5, 77, 9), "the generation keeps its low bits");
        assert_eq!(untag(u64::MAX).0, NO_OWNER, "all ones names the overflow part");
        let records = Records::new();
        let first = block(0x1000);
        let recorded = records.insert(&first).unwrap();
        // The overflow part holds records too, and still the all-ones slot is never one.
        let (overflowed, _) = records.insert_as(NO_OWNER, &first).unwrap();
        assert_eq!(untag(overflowed).0, NO_OWNER);
        for forged in [u64::MAX, recorded ^ 1, overflowed ^ 1] {
            let forged = raw(&first, forged);
            assert!(records.get(&forged, HOST).is_none(), "{:#x}", forged.provider_tag());
            assert!(take_free(&records, &forged, HOST).is_none(), "{:#x}", forged.provider_tag());
        }
        assert_eq!(records.count(), (2, 512));
    }

    #[test]
    fn threads_past_the_tags_owner_field_share_the_overflow_part() {
        let records = std::sync::Arc::new(Records::new());
        let blocks: Vec<MpBlock> = (1..=40).map(|i| block(i * 0x1000)).collect();
        // Indices the tag cannot name, as a thread past 65534 or one recording in its
        // thread-local destructors has.
        let tags: Vec<u64> =
            blocks.iter().enumerate().map(|(i, b)| records.insert_as(NO_OWNER + i, b).unwrap().0).collect();
        assert!(tags.iter().all(|&tag| untag(tag).0 == NO_OWNER));
        assert_eq!(records.count(), (40, 40 * 256));
        // Released from another thread: the slots come back for the next overflowing
        // recorder, whose claims are serialised by the part's lock.
        let releaser = std::sync::Arc::clone(&records);
        let pairs: Vec<_> = blocks.iter().copied().zip(tags.iter().copied()).collect();
        std::thread::spawn(move || {
            for (block, tag) in pairs {
                assert_eq!(take_free(&releaser, &raw(&block, tag), HOST), Some(block));
            }
        })
        .join()
        .unwrap();
        assert_eq!(records.count(), (0, 0));
        let reused: Vec<u32> = blocks.iter().map(|b| untag(records.insert_as(NO_OWNER, b).unwrap().0).1).collect();
        assert!(reused.iter().all(|&slot| slot < 40), "{reused:?}");
    }

    #[test]
    fn a_full_part_refuses_to_record_until_a_block_is_released() {
        let part = Part { slots: OwnerSlots::with_limit(40), next_generation: AtomicU64::new(0) };
        let first = block(0x1000);
        let slots: Vec<u32> = (0..32).map(|_| part.record(&first).unwrap().0).collect();
        assert!(part.record(&first).is_none(), "full");
        let freed = part.slots.get(slots[7]).unwrap();
        freed.state.store(FREE, Ordering::Relaxed);
        part.slots.give_back(slots[7], freed, false);
        assert_eq!(part.record(&first).unwrap().0, slots[7], "a released slot is recorded into again");
        assert!(part.record(&first).is_none());
    }

    #[test]
    fn a_record_is_taken_once_and_a_stale_tag_never_takes_its_reused_slot() {
        let records = Records::new();
        let first = block(0x1000);
        let tag = records.insert(&first).unwrap();
        assert_eq!(records.get(&raw(&first, tag), HOST), Some(first));
        assert_eq!(
            take_free(&records, &raw(&first, tag), HOST),
            Some(first),
            "the plugin's own block back, tag included"
        );
        assert!(take_free(&records, &raw(&first, tag), HOST).is_none(), "taken once");
        // The same block again, in the same slot under a new generation.
        let again = records.insert(&first).unwrap();
        assert_eq!(untag(again).1, untag(tag).1, "the slot is reused");
        assert!(
            take_free(&records, &raw(&first, tag), HOST).is_none() && records.get(&raw(&first, tag), HOST).is_none()
        );
        assert_eq!(records.count(), (1, 256));
        assert_eq!(take_free(&records, &raw(&first, again), HOST), Some(first));
        assert_eq!(records.count(), (0, 0));
    }

    #[test]
    fn a_record_in_transit_refuses_other_takes_and_a_kept_block_is_restored_under_its_tag() {
        let records = Records::new();
        let first = block(0x4000);
        let tag = records.insert(&first).unwrap();
        let presented = raw(&first, tag);
        let taken = records.take(&presented, HOST).unwrap();
        assert_eq!(*taken.block(), first);
        assert!(records.take(&presented, HOST).is_none(), "a second release while the first is under way");
        assert!(records.get(&presented, HOST).is_none(), "no capability on a block being released");
        assert_eq!(records.count(), (1, 256), "a record in transit still counts (unload waits for it)");
        // The plugin kept the block: restored, under the same tag.
        taken.restore();
        assert_eq!(records.get(&presented, HOST), Some(first), "live again under the same tag");
        // A release that ends unsettled (a panic on the way) leaves the record in transit
        // for good: counted, never taken again.
        let unsettled = records.take(&presented, HOST).unwrap();
        std::mem::drop(unsettled);
        assert!(records.take(&presented, HOST).is_none() && records.get(&presented, HOST).is_none());
        assert_eq!(records.count(), (1, 256), "unload keeps waiting for it");
    }

    #[test]
    fn is_live_answers_only_while_that_record_is_live() {
        let records = Records::new();
        let first = block(0x5000);
        let (tag, at) = records.insert_ref(&first).unwrap();
        assert!(records.is_live(at));
        let taken = records.take(&raw(&first, tag), HOST).unwrap();
        assert!(!records.is_live(at), "in transit: the plugin may have freed it already");
        taken.restore();
        assert!(records.is_live(at), "restored under its tag");
        assert_eq!(take_free(&records, &raw(&first, tag), HOST), Some(first));
        assert!(!records.is_live(at), "released");
        let (_, again) = records.insert_ref(&first).unwrap();
        assert_eq!(again.slot, at.slot, "the slot is reused");
        assert!(!records.is_live(at) && records.is_live(again), "under a new generation");
        let (_, overflowed) = records.insert_as(NO_OWNER, &first).unwrap();
        assert!(records.is_live(overflowed));
        let forged = RecordRef { owner: 7, slot: 3, generation: 1 };
        assert!(!records.is_live(forged), "a part that does not exist");
    }

    #[test]
    fn a_block_that_differs_from_its_record_is_refused_and_the_record_kept() {
        let records = Records::new();
        let first = block(0x2000);
        let tag = records.insert(&first).unwrap();
        let mut other = first;
        other.bytes = 512;
        assert!(take_free(&records, &raw(&other, tag), HOST).is_none(), "another size");
        other = block(0x3000);
        assert!(take_free(&records, &raw(&other, tag), HOST).is_none(), "another address");
        let device = MpDevice { tier: memory_plugin_abi::MP_TIER_DEVICE, index: 0 };
        assert!(take_free(&records, &raw(&first, tag), device).is_none(), "another instance's device");
        assert_eq!(take_free(&records, &raw(&first, tag), HOST), Some(first), "the record survived the refusals");
    }

    #[test]
    fn records_made_on_one_thread_are_taken_on_another_and_their_slots_reused() {
        let records = std::sync::Arc::new(Records::new());
        let blocks: Vec<MpBlock> = (1..=40).map(|i| block(i * 0x1000)).collect();
        let tags: Vec<u64> = blocks.iter().map(|b| records.insert(b).unwrap()).collect();
        let taker = {
            let records = std::sync::Arc::clone(&records);
            let pairs: Vec<_> = blocks.iter().copied().zip(tags.iter().copied()).collect();
            std::thread::spawn(move || {
                let mut taken = 0;
                for (block, tag) in pairs {
                    taken += usize::from(take_free(&records, &raw(&block, tag), HOST) == Some(block));
                    // A record of this thread's own, among the others' (another part).
                    let own = records.insert(&block).unwrap();
                    assert_ne!(untag(own).0, untag(tag).0);
                    assert_eq!(take_free(&records, &raw(&block, own), HOST), Some(block));
                }
                taken
            })
        };
        assert_eq!(taker.join().unwrap(), 40);
        assert_eq!(records.count(), (0, 0));
        // The slots came back through the remote stack: no new segment is needed.
        let reused: Vec<u32> = blocks.iter().map(|b| untag(records.insert(b).unwrap()).1).collect();
        assert!(reused.iter().all(|&slot| slot < 40), "{reused:?}");
    }
}

/// loom models of the take protocol (`cargo xtask loom`).
#[cfg(all(test, memory_loom))]
mod loom_records {
    use super::fixtures::*;
    use super::*;
    use std::sync::Arc;

    /// Two threads taking one record while the owner records more: exactly one take
    /// wins, it gets the block as recorded, and the slot is reused only after it.
    #[test]
    fn loom_racing_takes_one_wins_and_the_owner_reuses_the_slot() {
        loom::model(|| {
            let records = Arc::new(Records::new());
            let first = block(0x1000);
            let tag = records.insert(&first).unwrap();
            let takers: Vec<_> = (0..2)
                .map(|_| {
                    let records = Arc::clone(&records);
                    loom::thread::spawn(move || take_free(&records, &raw(&first, tag), HOST))
                })
                .collect();
            // The owner records a block meanwhile: a fresh slot, or the taken one.
            let second = block(0x2000);
            let second_tag = records.insert(&second).unwrap();
            let won: Vec<_> = takers.into_iter().filter_map(|taker| taker.join().unwrap()).collect();
            assert_eq!(won, [first], "exactly one take wins, with the recorded block");
            assert_ne!(second_tag, tag, "a reused slot is recorded under a new generation");
            assert_eq!(records.get(&raw(&second, second_tag), HOST), Some(second));
            assert_eq!(records.count(), (1, 256));
        });
    }

    /// A reader of a stale tag (a capability lookup and a release) racing the release of
    /// the block and the owner's reuse of its slot for another block that differs only
    /// in the plugin's own tag: it gets the old block whole or nothing, never the new
    /// record, and never takes it.
    #[test]
    fn loom_a_stale_tag_never_reads_or_takes_a_reused_record() {
        loom::model(|| {
            let records = Arc::new(Records::new());
            let first = block(0x1000);
            let tag = records.insert(&first).unwrap();
            let reader = {
                let records = Arc::clone(&records);
                loom::thread::spawn(move || {
                    let got = records.get(&raw(&first, tag), HOST);
                    let taken = records.take(&raw(&first, tag), HOST).map(|taken| {
                        let block = *taken.block();
                        taken.restore();
                        block
                    });
                    (got, taken)
                })
            };
            let released = take_free(&records, &raw(&first, tag), HOST);
            let second = MpBlock { tag: first.tag + 1, ..first };
            let again = records.insert(&second).unwrap();
            let (got, taken) = reader.join().unwrap();
            assert!(got.is_none() || got == Some(first), "read {got:?}");
            assert!(taken.is_none() || taken == Some(first), "took {taken:?}");
            // The owner's release either won, or found the reader's take in progress (a
            // release racing another release of one block loses) and left it live.
            let live = usize::from(released.is_none()) + 1;
            assert_eq!(records.count().0, live);
            assert_eq!(take_free(&records, &raw(&second, again), HOST), Some(second));
        });
    }

    /// A release the plugin refused (take, then restore) racing a second release of the
    /// same block (take, then free): the second wins only if it took the record while it
    /// was live, and either way the record ends freed exactly once or live under its tag.
    #[test]
    fn loom_a_restore_racing_another_release_frees_the_record_once_or_leaves_it_live() {
        loom::model(|| {
            let records = Arc::new(Records::new());
            let first = block(0x1000);
            let tag = records.insert(&first).unwrap();
            let refused = {
                let records = Arc::clone(&records);
                loom::thread::spawn(move || records.take(&raw(&first, tag), HOST).map(TakenRecord::restore).is_some())
            };
            let freed = take_free(&records, &raw(&first, tag), HOST).is_some();
            let restored = refused.join().unwrap();
            assert!(freed || restored, "neither release took the record");
            if freed {
                assert_eq!(records.count(), (0, 0));
                assert!(records.get(&raw(&first, tag), HOST).is_none());
            } else {
                assert_eq!(records.get(&raw(&first, tag), HOST), Some(first), "live again under its tag");
                assert_eq!(take_free(&records, &raw(&first, tag), HOST), Some(first));
            }
        });
    }
}
