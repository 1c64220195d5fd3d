//! The host's own record of every block a plugin handed out, so that no block the
//! plugin did not issue (forged, foreign, already released) ever reaches it.
//!
//! The records live in `memory_sync`'s record table ([`RecordTable`]), the one every
//! layer keeps its block records in: owner-local (each thread records the blocks it
//! allocates in its own part, with plain stores), taken for a release from any thread
//! with one compare-and-swap (of two racing releases exactly one gets the block), freed
//! once the plugin took the block back or restored under the same tag when it kept it.
//! A block's `provider_tag` is the table's tag (owner, slot, generation), and the block
//! itself is compared with its record too (address, size, alignment, device) before
//! anything is taken. Capacity: 2^24 - 32 live blocks per thread; past that, recording
//! fails (the allocation is refused) until some are released. The table's tag layout,
//! its overflow part for thread indexes past 16 bits and its loom models are
//! `memory_sync::records`'.

use memory_api::RawAllocation;
use memory_plugin_abi::{MpBlock, MpDevice};
use memory_sync::primitives::{AtomicU64, Ordering};
use memory_sync::records::{Payload, RecordTable};

pub(crate) use memory_sync::records::RecordRef;

use crate::negotiate::abi_device;

/// A recorded block: the plugin's `MpBlock`, field by field.
#[derive(Default)]
pub(crate) struct BlockCells {
    address: AtomicU64,
    bytes: AtomicU64,
    align: AtomicU64,
    /// `tier << 32 | index`.
    device: AtomicU64,
    tag: AtomicU64,
}

impl Payload for BlockCells {
    type Value = MpBlock;

    #[inline]
    fn store(&self, block: &MpBlock) {
        self.address.store(block.address, Ordering::Relaxed);
        self.bytes.store(block.bytes, Ordering::Relaxed);
        self.align.store(block.align, Ordering::Relaxed);
        self.device.store(u64::from(block.device.tier) << 32 | u64::from(block.device.index), Ordering::Relaxed);
        self.tag.store(block.tag, Ordering::Relaxed);
    }

    #[inline]
    fn load(&self) -> MpBlock {
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

/// A record taken for a release: [`TakenRecord::value`] is the block as the plugin
/// issued it. Settle it with `free` once the plugin took the block back, or `restore`
/// when it kept it. Dropped unsettled (a panic on the way), the record stays in
/// transit: counted, so unload waits, and never taken again, since whether the plugin
/// still holds the block is unknown.
pub(crate) type TakenRecord<'a> = memory_sync::records::TakenRecord<'a, BlockCells>;

/// Whether a record describes the block a caller presents (on this instance's device).
#[inline]
fn matches(record: &MpBlock, block: &RawAllocation, device: MpDevice) -> bool {
    record.address == block.address().get()
        && record.bytes == block.bytes() as u64
        && record.align == block.align() as u64
        && record.device == device
        && abi_device(block.device()) == device
}

/// Every block one plugin instance handed out and the host has not seen released.
pub(crate) struct Records {
    table: RecordTable<BlockCells>,
}

impl Records {
    pub(crate) fn new() -> Records {
        Records { table: RecordTable::new() }
    }

    /// Records `block` in the calling thread's part; returns the tag that names the
    /// record. `None` when the part has 2^24 - 32 blocks live.
    #[cfg(all(test, not(memory_loom)))]
    pub(crate) fn insert(&self, block: &MpBlock) -> Option<u64> {
        self.insert_ref(block).map(|(tag, _)| tag)
    }

    /// [`Records::insert`], with where the block is recorded.
    #[inline(always)]
    pub(crate) fn insert_ref(&self, block: &MpBlock) -> Option<(u64, RecordRef)> {
        self.table.insert(block)
    }

    /// Takes the record of `block` for a release, if it is one of ours and describes
    /// exactly it (any thread; of two racing takes of one record exactly one gets it).
    /// Until the taker frees or restores it, the record counts and refuses every other
    /// take. Always inlined, as the table's `take` is (the block read back through
    /// memory stalls store forwarding).
    #[inline(always)]
    pub(crate) fn take(&self, block: &RawAllocation, device: MpDevice) -> Option<TakenRecord<'_>> {
        self.table.take(block.provider_tag(), |recorded| matches(recorded, block, device))
    }

    /// A copy of the record of `block`, if it is one of ours and no release of it is
    /// under way (any thread).
    pub(crate) fn get(&self, block: &RawAllocation, device: MpDevice) -> Option<MpBlock> {
        self.table.get(block.provider_tag(), |recorded| matches(recorded, block, device))
    }

    /// Whether the block recorded at `at` is still recorded there with no release of it
    /// under way (any thread; for the live-range index, whose entries are not removed on
    /// release). A record in transit is not live here: the plugin may already have freed
    /// its block, and may hand the memory out again before the releasing thread frees
    /// the record.
    #[inline]
    pub(crate) fn is_live(&self, at: RecordRef) -> bool {
        self.table.is_live(at)
    }

    /// Blocks recorded and their bytes, releases under way included (cold: reads every
    /// record; a racing insert or take may or may not be counted).
    pub(crate) fn count(&self) -> (usize, usize) {
        self.table.recorded().fold((0, 0), |(count, bytes), block| {
            // Saturating: block sizes are the plugin's word, and a tally never panics.
            let size = usize::try_from(block.bytes).unwrap_or(usize::MAX);
            (count + 1, bytes.saturating_add(size))
        })
    }
}

/// What the unit tests build records from.
#[cfg(all(test, not(memory_loom)))]
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
        let recorded = *taken.value();
        taken.free();
        Some(recorded)
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::fixtures::*;
    use super::*;

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
        let (again, at) = records.insert_ref(&first).unwrap();
        assert_eq!(at.slot(), 0, "the slot is reused");
        assert_ne!(again, tag);
        assert!(
            take_free(&records, &raw(&first, tag), HOST).is_none() && records.get(&raw(&first, tag), HOST).is_none()
        );
        assert_eq!(records.count(), (1, 256));
        assert_eq!(take_free(&records, &raw(&first, again), HOST), Some(first));
        assert_eq!(records.count(), (0, 0));
        for forged in [u64::MAX, again ^ 1] {
            assert!(records.get(&raw(&first, forged), HOST).is_none(), "{forged:#x}");
        }
    }

    #[test]
    fn a_record_in_transit_refuses_other_takes_and_a_kept_block_is_restored_under_its_tag() {
        let records = Records::new();
        let first = block(0x4000);
        let tag = records.insert(&first).unwrap();
        let presented = raw(&first, tag);
        let taken = records.take(&presented, HOST).unwrap();
        assert_eq!(*taken.value(), first);
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
        assert_eq!(again.slot(), at.slot(), "the slot is reused");
        assert!(!records.is_live(at) && records.is_live(again), "under a new generation");
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
        other = MpBlock { align: 128, ..first };
        assert!(take_free(&records, &raw(&other, tag), HOST).is_none(), "another alignment");
        assert!(records.get(&raw(&other, tag), HOST).is_none());
        let device = MpDevice { tier: memory_plugin_abi::MP_TIER_DEVICE, index: 0 };
        assert!(take_free(&records, &raw(&first, tag), device).is_none(), "another instance's device");
        assert_eq!(take_free(&records, &raw(&first, tag), HOST), Some(first), "the record survived the refusals");
    }

    #[test]
    fn records_made_on_one_thread_are_taken_on_another() {
        let records = std::sync::Arc::new(Records::new());
        let blocks: Vec<MpBlock> = (1..=40).map(|i| block(i * 0x1000)).collect();
        let tags: Vec<u64> = blocks.iter().map(|b| records.insert(b).unwrap()).collect();
        let taker = {
            let records = std::sync::Arc::clone(&records);
            let pairs: Vec<_> = blocks.iter().copied().zip(tags.iter().copied()).collect();
            std::thread::spawn(move || {
                pairs
                    .into_iter()
                    .filter(|(block, tag)| take_free(&records, &raw(block, *tag), HOST) == Some(*block))
                    .count()
            })
        };
        assert_eq!(taker.join().unwrap(), 40);
        assert_eq!(records.count(), (0, 0));
    }
}
