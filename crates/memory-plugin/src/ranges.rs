//! The address ranges of an instance's live blocks, so that a block overlapping one
//! still live (a plugin handing the same memory out twice) is refused before the
//! registry ever sees two allocations sharing memory.
//!
//! - An ordered map per shard: block start → (size, where its record is). Live
//!   entries of one shard never overlap (an overlapping block is refused), so the
//!   entries that can overlap a new block `[start, end)` are the ones just below `end`,
//!   walked down until one ends at or before `start`.
//! - Only `allocate` touches it; a release does not. Entries are dropped lazily: an entry
//!   whose record ([`Records::is_live`]) is no longer live is removed when a new block
//!   overlaps it, and by a sweep once a shard has doubled since its last one, so stale
//!   entries never outnumber live ones by more than that.
//! - The usual answer of an honest plugin is an address it handed out before (its free
//!   list): the stale entry there is overwritten in place, and when it was no smaller
//!   than the new block that one lookup is the whole check (the entry itself proves no
//!   other overlaps). Only a new address, or a larger block at an old one, walks the
//!   entries below the new block's end.
//! - Shards by 64 MiB address region, so threads allocating from different regions
//!   (glibc's per-thread arenas are 64 MiB heaps) take different locks on different cache
//!   lines; a block spanning regions is entered in every shard it spans (all of them from
//!   `SHARDS` regions up), their locks taken in index order.
//! - A block whose release is under way is not live here: the plugin may already have
//!   freed its memory and handed it out again before the releasing thread frees the
//!   record. So a block that overlaps one being released at that very moment is admitted
//!   (and the other's entry dropped); if that release is then refused and the block kept,
//!   the two overlap unnoticed. That is the one overlap this check can miss, and it needs
//!   a plugin that both refuses a release and hands out the same memory meanwhile.

#![allow(
    clippy::disallowed_types,
    reason = "loom models only the block records (src/records.rs, all from memory-sync); the index's locks are the loader's own bookkeeping, outside every model"
)]

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use memory_plugin_abi::MpBlock;

use crate::records::{RecordRef, Records};

/// Address bits per region: 64 MiB, glibc's per-thread heap size.
const REGION_BITS: u32 = 26;
const SHARDS: usize = 32;
/// A shard sweeps its stale entries once it holds this many, and then once it has
/// doubled since the last sweep.
const FIRST_SWEEP: usize = 256;

/// One block's range, for messages: where it starts and how many bytes it spans.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) address: u64,
    pub(crate) bytes: u64,
}

/// Entries of one shard: start → (bytes, where the block is recorded).
struct Entries {
    map: BTreeMap<u64, (u64, RecordRef)>,
    sweep_at: usize,
}

/// One shard, on its own cache lines.
#[repr(align(128))]
struct Shard(Mutex<Entries>);

pub(crate) struct LiveRanges {
    shards: Box<[Shard]>,
}

/// The first byte past a block; a block occupies at least its first byte, so two
/// blocks at one address always overlap.
#[inline]
fn end_of(address: u64, bytes: u64) -> u64 {
    address.saturating_add(bytes.max(1))
}

#[inline]
fn shard_of(address: u64) -> usize {
    (address >> REGION_BITS) as usize % SHARDS
}

impl Entries {
    /// The first live entry overlapping `[start, end)`; stale ones met on the way are
    /// removed (an entry at `start` itself is left for the insert to overwrite).
    #[inline]
    fn live_overlap(&mut self, start: u64, end: u64, records: &Records) -> Option<Span> {
        let mut below = end;
        loop {
            let (&at, &(bytes, recorded)) = self.map.range(..below).next_back()?;
            if end_of(at, bytes) <= start {
                return None;
            }
            if records.is_live(recorded) {
                return Some(Span { address: at, bytes });
            }
            if at != start {
                self.map.remove(&at);
            }
            below = at;
        }
    }

    #[inline]
    fn insert(&mut self, start: u64, bytes: u64, recorded: RecordRef, records: &Records) {
        self.map.insert(start, (bytes, recorded));
        if self.map.len() >= self.sweep_at {
            self.sweep(records);
        }
    }

    #[cold]
    fn sweep(&mut self, records: &Records) {
        self.map.retain(|_, &mut (_, recorded)| records.is_live(recorded));
        self.sweep_at = (self.map.len() * 2).max(FIRST_SWEEP);
    }
}

fn lock(shard: &Shard) -> MutexGuard<'_, Entries> {
    // Nothing that can panic runs under the lock but `BTreeMap`'s own allocation;
    // entries are valid whatever a panic interrupted.
    shard.0.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LiveRanges {
    pub(crate) fn new() -> LiveRanges {
        let shards = (0..SHARDS).map(|_| Shard(Mutex::new(Entries { map: BTreeMap::new(), sweep_at: FIRST_SWEEP })));
        LiveRanges { shards: shards.collect() }
    }

    /// Admits `block` if it overlaps no live block: calls `record` (which records it
    /// and returns its tag and record, or `None` when it cannot) with the block's shards
    /// locked, so
    /// two overlapping blocks admitted at once are seen by whichever comes second.
    /// `Err` names the live block it overlaps; `Ok(None)` when `record` failed.
    #[inline(always)]
    pub(crate) fn admit(
        &self,
        block: &MpBlock,
        records: &Records,
        record: impl FnOnce() -> Option<(u64, RecordRef)>,
    ) -> Result<Option<u64>, Span> {
        let (start, end) = (block.address, end_of(block.address, block.bytes));
        let first = shard_of(start);
        if start >> REGION_BITS != (end - 1) >> REGION_BITS {
            return self.admit_spanning(block, records, record);
        }
        let mut entries = lock(&self.shards[first]);
        // An address the plugin hands out again (a free list's usual answer): its stale
        // entry, when no smaller than the new block, proves nothing else overlaps it
        // (entries never overlap one another), so one lookup does.
        if let Some(entry) = entries.map.get_mut(&start) {
            let (bytes, recorded) = *entry;
            if records.is_live(recorded) {
                return Err(Span { address: start, bytes });
            }
            if block.bytes.max(1) <= bytes.max(1) {
                let Some((tag, recorded)) = record() else { return Ok(None) };
                *entry = (block.bytes, recorded);
                return Ok(Some(tag));
            }
        }
        if let Some(live) = entries.live_overlap(start, end, records) {
            return Err(live);
        }
        let Some((tag, recorded)) = record() else { return Ok(None) };
        entries.insert(start, block.bytes, recorded, records);
        Ok(Some(tag))
    }

    /// [`LiveRanges::admit`] for a block that spans more than one region.
    #[cold]
    fn admit_spanning(
        &self,
        block: &MpBlock,
        records: &Records,
        record: impl FnOnce() -> Option<(u64, RecordRef)>,
    ) -> Result<Option<u64>, Span> {
        let (start, end) = (block.address, end_of(block.address, block.bytes));
        let mut guards: Vec<MutexGuard<'_, Entries>> =
            self.spanned(start, end).map(|i| lock(&self.shards[i])).collect();
        for entries in &mut guards {
            if let Some(live) = entries.live_overlap(start, end, records) {
                return Err(live);
            }
        }
        let Some((tag, recorded)) = record() else { return Ok(None) };
        for entries in &mut guards {
            entries.insert(start, block.bytes, recorded, records);
        }
        Ok(Some(tag))
    }

    /// The shards `[start, end)` spans, in index order (each once).
    fn spanned(&self, start: u64, end: u64) -> impl Iterator<Item = usize> {
        let regions = ((end - 1) >> REGION_BITS) - (start >> REGION_BITS) + 1;
        let mut spanned = [false; SHARDS];
        if regions >= SHARDS as u64 {
            spanned = [true; SHARDS];
        } else {
            for region in 0..regions {
                spanned[shard_of(start + (region << REGION_BITS))] = true;
            }
        }
        (0..SHARDS).filter(move |&i| spanned[i])
    }

    /// The first live block that `block` overlaps (cold: a suspect retry asks before it
    /// hands an overlapping block back).
    pub(crate) fn overlaps_live(&self, block: &MpBlock, records: &Records) -> Option<Span> {
        let (start, end) = (block.address, end_of(block.address, block.bytes));
        self.spanned(start, end).find_map(|i| lock(&self.shards[i]).live_overlap(start, end, records))
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;
    use memory_api::{DeviceAddress, DeviceKey, RawAllocation};
    use memory_plugin_abi::{MP_TIER_HOST, MpDevice};

    const HOST: MpDevice = MpDevice { tier: MP_TIER_HOST, index: 0 };

    fn block(address: u64, bytes: u64) -> MpBlock {
        MpBlock { address, bytes, align: 64, device: HOST, tag: address }
    }

    fn admit(ranges: &LiveRanges, records: &Records, block: &MpBlock) -> Result<u64, Span> {
        ranges.admit(block, records, || records.insert_ref(block)).map(Option::unwrap)
    }

    fn release(records: &Records, block: &MpBlock, tag: u64) {
        let raw = RawAllocation::new(
            DeviceAddress::new(block.address).unwrap(),
            block.bytes as usize,
            64,
            DeviceKey::HOST,
            tag,
        );
        records.take(&raw, HOST).unwrap().free();
    }

    #[test]
    fn a_block_overlapping_a_live_one_is_refused_and_admitted_once_that_one_is_released() {
        let (ranges, records) = (LiveRanges::new(), Records::new());
        let live = block(0x10_000, 0x1000);
        let tag = admit(&ranges, &records, &live).unwrap();
        let live_span = Span { address: 0x10_000, bytes: 0x1000 };
        for (address, bytes) in
            [(0x10_000, 0x1000), (0x10_000, 0), (0x10_800, 0x1000), (0xf_f00, 0x200), (0xf_000, 0x4000)]
        {
            assert_eq!(admit(&ranges, &records, &block(address, bytes)), Err(live_span), "{address:#x}+{bytes:#x}");
        }
        // Neighbours touching it are not overlaps.
        let below = admit(&ranges, &records, &block(0xf_000, 0x1000)).unwrap();
        let above = admit(&ranges, &records, &block(0x11_000, 0x1000)).unwrap();
        assert_eq!(admit(&ranges, &records, &block(0x11_0ff, 1)), Err(Span { address: 0x11_000, bytes: 0x1000 }));
        release(&records, &live, tag);
        // Released: the same address again (its stale entry overwritten), then a block
        // over all three once the neighbours go too.
        let again = admit(&ranges, &records, &live).unwrap();
        release(&records, &live, again);
        release(&records, &block(0xf_000, 0x1000), below);
        release(&records, &block(0x11_000, 0x1000), above);
        admit(&ranges, &records, &block(0xf_000, 0x3000)).unwrap();
        assert_eq!(ranges.shards.iter().map(|shard| lock(shard).map.len()).sum::<usize>(), 1, "stale entries removed");
    }

    #[test]
    fn a_block_spanning_regions_is_checked_in_every_shard_it_spans() {
        let (ranges, records) = (LiveRanges::new(), Records::new());
        let region = 1u64 << REGION_BITS;
        let big = block(3 * region - 0x1000, 2 * region);
        admit(&ranges, &records, &big).unwrap();
        // A small block in the middle region, and one at the far end, overlap it.
        assert!(admit(&ranges, &records, &block(3 * region + 0x40, 0x40)).is_err());
        assert!(admit(&ranges, &records, &block(5 * region - 0x1040, 0x40)).is_err());
        admit(&ranges, &records, &block(5 * region - 0x1000, 0x40)).unwrap();
        // A block larger than all shards' regions together.
        let huge = block(64 * region, (SHARDS as u64 + 3) * region);
        admit(&ranges, &records, &huge).unwrap();
        assert!(ranges.overlaps_live(&block(80 * region, 0x40), &records).is_some());
        assert!(ranges.overlaps_live(&block(63 * region, 0x40), &records).is_none());
    }

    #[test]
    fn stale_entries_are_swept_once_a_shard_doubles() {
        let (ranges, records) = (LiveRanges::new(), Records::new());
        for i in 0..10 * FIRST_SWEEP as u64 {
            let one = block(0x100_000 + i * 0x100, 0x100);
            let tag = admit(&ranges, &records, &one).unwrap();
            release(&records, &one, tag);
        }
        let entries = lock(&ranges.shards[shard_of(0x100_000)]).map.len();
        assert!(entries < FIRST_SWEEP, "{entries} stale entries kept");
    }
}
