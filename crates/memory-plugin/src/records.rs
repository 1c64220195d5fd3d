//! The host's own record of every block a plugin handed out, so that no block the
//! plugin did not issue (forged, foreign, already released) ever reaches it.
//!
//! Records live in cache-line-padded shards, one picked per thread; a block's
//! `provider_tag` names its shard (top 16 bits) and slot. Allocating and releasing on
//! one thread touches only that thread's shard.

use std::sync::atomic::{AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;
use memory_api::RawAllocation;
use memory_plugin_abi::{MpBlock, MpDevice};
use slab::Slab;

use crate::negotiate::abi_device;

const SHARDS: usize = 16;
const SLOT_BITS: u32 = 48;

pub(crate) struct Records {
    shards: Box<[CachePadded<spin::Mutex<Slab<MpBlock>>>]>,
}

fn thread_shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    // During thread teardown any shard will do (a placement hint only).
    SHARD.try_with(|shard| *shard).unwrap_or(0)
}

fn untag(tag: u64) -> (usize, usize) {
    ((tag >> SLOT_BITS) as usize, (tag & ((1 << SLOT_BITS) - 1)) as usize)
}

/// Whether a record describes the block a caller presents (on this instance's device).
fn matches(record: &MpBlock, block: &RawAllocation, device: MpDevice) -> bool {
    record.address == block.address().get()
        && record.bytes == block.bytes() as u64
        && record.align == block.align() as u64
        && record.device == device
        && abi_device(block.device()) == device
}

impl Records {
    pub(crate) fn new() -> Records {
        Records { shards: (0..SHARDS).map(|_| CachePadded::new(spin::Mutex::new(Slab::new()))).collect() }
    }

    /// Records `block`; returns the tag that names the record.
    pub(crate) fn insert(&self, block: MpBlock) -> u64 {
        let shard = thread_shard();
        let slot = self.shards[shard].lock().insert(block);
        ((shard as u64) << SLOT_BITS) | slot as u64
    }

    /// Takes the record of `block` if it is one of ours and describes exactly it.
    pub(crate) fn take(&self, block: &RawAllocation, device: MpDevice) -> Option<MpBlock> {
        let (shard, slot) = untag(block.provider_tag());
        let mut records = self.shards.get(shard)?.lock();
        if records.get(slot).is_some_and(|record| matches(record, block, device)) {
            Some(records.remove(slot))
        } else {
            None
        }
    }

    /// A copy of the record of `block`, if it is one of ours.
    pub(crate) fn get(&self, block: &RawAllocation, device: MpDevice) -> Option<MpBlock> {
        let (shard, slot) = untag(block.provider_tag());
        let records = self.shards.get(shard)?.lock();
        records.get(slot).filter(|record| matches(record, block, device)).copied()
    }

    /// Blocks recorded and their bytes (cold: locks every shard in turn).
    pub(crate) fn count(&self) -> (usize, usize) {
        self.shards.iter().fold((0, 0), |(count, bytes), shard| {
            let records = shard.lock();
            // Saturating: block sizes are the plugin's word, and a tally never panics.
            let held = records.iter().fold(0usize, |sum, (_, r)| sum.saturating_add(r.bytes as usize));
            (count + records.len(), bytes.saturating_add(held))
        })
    }
}
