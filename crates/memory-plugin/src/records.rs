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
//! - A block's `provider_tag` names its record: owner index, slot, and the low bits of
//!   the generation, so a stale tag does not take a reused slot's record. The block
//!   itself is compared too (address, size, alignment, device).

use memory_api::RawAllocation;
use memory_plugin_abi::{MpBlock, MpDevice};
use memory_sync::owner_slots::{FreeLink, OwnerSlots};
use memory_sync::per_thread::{PerThread, is_current, thread_index};
use memory_sync::primitives::{AtomicU32, AtomicU64, Ordering, fence};

use crate::negotiate::abi_device;

const SLOT_BITS: u32 = 24;
const GENERATION_BITS: u32 = 24;
const OWNER_BITS: u32 = 64 - SLOT_BITS - GENERATION_BITS;
/// The owner index no part has: a tag with it (all ones, say) names no record.
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

/// One thread's records.
#[derive(Default)]
struct Part {
    slots: OwnerSlots<Record>,
    /// The next generation to record under (owner only; starts at 1, never wraps).
    next_generation: AtomicU64,
}

pub(crate) struct Records {
    parts: PerThread<Box<Part>>,
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
        Records { parts: PerThread::new() }
    }

    /// Records `block` in the calling thread's part; returns the tag that names the
    /// record. `None` when the tag cannot name it: more than 2^16 - 1 threads at once,
    /// or 2^24 blocks live from one thread.
    #[inline]
    pub(crate) fn insert(&self, block: &MpBlock) -> Option<u64> {
        let owner = thread_index();
        if owner >= NO_OWNER {
            return None;
        }
        let part = self.parts.get_or(owner, Box::default);
        let (slot, record) = part.slots.claim()?;
        if slot >> SLOT_BITS != 0 {
            part.slots.give_back(slot, record, true);
            return None;
        }
        let generation = part.next_generation.load(Ordering::Relaxed) + 1;
        part.next_generation.store(generation, Ordering::Relaxed);
        record.write(block);
        // Release: the block's fields before the generation that publishes them.
        record.state.store(generation, Ordering::Release);
        Some(tag(owner, slot, generation))
    }

    /// The live record a tag names and its state word, if its generation matches and
    /// no release of it is under way.
    #[inline]
    fn lookup(&self, tag: u64) -> Option<(&Part, u32, &Record, u64)> {
        let (owner, slot, generation) = untag(tag);
        let part = self.parts.get(owner)?;
        let record = part.slots.get(slot)?;
        let state = record.state.load(Ordering::Acquire);
        let live = state != FREE && state & IN_TRANSIT == 0 && state & GENERATION_MASK == generation;
        live.then_some((part, slot, record, state))
    }

    /// Takes the record of `block` for a release, if it is one of ours and describes
    /// exactly it (any thread; of two racing takes of one record exactly one gets it).
    /// Until the taker frees or restores it, the record counts and refuses every other
    /// take; dropping the taken record restores it.
    #[inline]
    pub(crate) fn take(&self, block: &RawAllocation, device: MpDevice) -> Option<TakenRecord<'_>> {
        let (part, slot, record, state) = self.lookup(block.provider_tag())?;
        let recorded = record.read();
        if !matches(&recorded, block, device) {
            return None;
        }
        // Success means the state stayed `state` since the Acquire load, so `recorded`
        // is that generation's block. Relaxed is enough: the slot is rewritten only
        // after the taker's `free`, which comes after these reads in program order and
        // reaches the owner through its own list or the remote stack (Release/Acquire).
        record.state.compare_exchange(state, state | IN_TRANSIT, Ordering::Relaxed, Ordering::Relaxed).ok()?;
        let owner = untag(block.provider_tag()).0;
        Some(TakenRecord { part, owner, slot, record, live: state, block: recorded })
    }

    /// A copy of the record of `block`, if it is one of ours and no release of it is
    /// under way (any thread).
    pub(crate) fn get(&self, block: &RawAllocation, device: MpDevice) -> Option<MpBlock> {
        let (_, _, record, state) = self.lookup(block.provider_tag())?;
        let recorded = record.read();
        // The reads above before the second look at the state: unchanged, they were
        // that generation's block.
        fence(Ordering::Acquire);
        let unchanged = record.state.load(Ordering::Relaxed) == state;
        (unchanged && matches(&recorded, block, device)).then_some(recorded)
    }

    /// Blocks recorded and their bytes (cold: reads every record; a racing insert or
    /// take may or may not be counted).
    pub(crate) fn count(&self) -> (usize, usize) {
        let records = self.parts.iter().flat_map(|part| part.slots.iter());
        records.filter(|record| record.state.load(Ordering::Acquire) != FREE).fold((0, 0), |(count, bytes), record| {
            // Saturating: block sizes are the plugin's word, and a tally never panics.
            let size = usize::try_from(record.bytes.load(Ordering::Relaxed)).unwrap_or(usize::MAX);
            (count + 1, bytes.saturating_add(size))
        })
    }
}

/// A record taken for a release: the block as the plugin issued it. [`TakenRecord::free`]
/// once the plugin took the block back; dropping it puts the record back as it was.
pub(crate) struct TakenRecord<'a> {
    part: &'a Part,
    owner: usize,
    slot: u32,
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
        self.part.slots.give_back(self.slot, self.record, is_current(self.owner));
        std::mem::forget(self);
    }
}

impl Drop for TakenRecord<'_> {
    /// The block stays the plugin's: the record is live again under its tag.
    #[inline]
    fn drop(&mut self) {
        self.record.state.store(self.live, Ordering::Release);
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;
    use memory_api::{DeviceAddress, DeviceKey};

    const HOST: MpDevice = MpDevice { tier: memory_plugin_abi::MP_TIER_HOST, index: 0 };

    fn block(address: u64) -> MpBlock {
        MpBlock { address, bytes: 256, align: 64, device: HOST, tag: address ^ 0xabcd }
    }

    fn raw(block: &MpBlock, tag: u64) -> RawAllocation {
        let address = DeviceAddress::new(block.address).unwrap();
        RawAllocation::new(address, block.bytes as usize, block.align as usize, DeviceKey::HOST, tag)
    }

    /// Takes a record and frees it, as a release the plugin completed does.
    fn take_free(records: &Records, block: &RawAllocation, device: MpDevice) -> Option<MpBlock> {
        let taken = records.take(block, device)?;
        let recorded = *taken.block();
        taken.free();
        Some(recorded)
    }

    #[test]
    fn tags_round_trip_and_all_ones_names_no_record() {
        assert_eq!(untag(tag(5, 77, 1 << 30 | 9)), (5, 77, 9), "the generation keeps its low bits");
        assert_eq!(untag(u64::MAX).0, NO_OWNER, "all ones names no part");
        let records = Records::new();
        let first = block(0x1000);
        let mut forged = raw(&first, u64::MAX);
        assert!(take_free(&records, &forged, HOST).is_none() && records.get(&forged, HOST).is_none());
        let recorded = records.insert(&first).unwrap();
        forged = raw(&first, recorded ^ 1);
        assert!(take_free(&records, &forged, HOST).is_none(), "another generation's tag takes nothing");
        assert_eq!(records.count(), (1, 256));
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
        // The plugin kept the block: dropping the taken record restores it.
        drop(taken);
        assert_eq!(records.get(&presented, HOST), Some(first), "live again under the same tag");
        assert_eq!(take_free(&records, &presented, HOST), Some(first));
        assert_eq!(records.count(), (0, 0));
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
    use super::*;
    use memory_api::{DeviceAddress, DeviceKey};
    use std::sync::Arc;

    const HOST: MpDevice = MpDevice { tier: memory_plugin_abi::MP_TIER_HOST, index: 0 };

    fn block(address: u64) -> MpBlock {
        MpBlock { address, bytes: 64, align: 64, device: HOST, tag: address + 1 }
    }

    fn raw(block: &MpBlock, tag: u64) -> RawAllocation {
        let address = DeviceAddress::new(block.address).unwrap();
        RawAllocation::new(address, block.bytes as usize, block.align as usize, DeviceKey::HOST, tag)
    }

    fn take_free(records: &Records, block: &RawAllocation, device: MpDevice) -> Option<MpBlock> {
        let taken = records.take(block, device)?;
        let recorded = *taken.block();
        taken.free();
        Some(recorded)
    }

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
            assert_eq!(records.count(), (1, 64));
        });
    }

    /// A take from another thread racing the owner's reuse of that thread's given-back
    /// slot: a reader of the old tag never gets the new block.
    #[test]
    fn loom_a_stale_tag_never_reads_a_reused_record() {
        loom::model(|| {
            let records = Arc::new(Records::new());
            let first = block(0x1000);
            let tag = records.insert(&first).unwrap();
            assert_eq!(take_free(&records, &raw(&first, tag), HOST), Some(first));
            let reader = {
                let records = Arc::clone(&records);
                loom::thread::spawn(move || {
                    (records.get(&raw(&first, tag), HOST), take_free(&records, &raw(&first, tag), HOST))
                })
            };
            let again = records.insert(&first).unwrap();
            let (got, taken) = reader.join().unwrap();
            assert!(got.is_none() && taken.is_none(), "the stale tag reached the reused record");
            assert_eq!(take_free(&records, &raw(&first, again), HOST), Some(first));
        });
    }
}
