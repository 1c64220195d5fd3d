//! The live-block records: which blocks an allocator handed out, and counters for stats.
//!
//! The block allocators (eager, pool, pinned) keep theirs in `memory_sync`'s record
//! table, as every layer does: the allocating thread records with plain stores, a
//! release from any thread takes the record with one compare-and-swap, and a block's
//! `provider_tag` only names its record (the address, size and alignment presented must
//! match it). The virtual-memory allocator's reservations carry a map of mapped ranges
//! behind a mutex, not words, so they stay in the address-keyed [`LiveTable`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, BackendError, DeviceAddress, DeviceKey, LayoutError, RawAllocation,
    ReleaseError, ReleaseOutcome,
};
use memory_sync::records::{Payload, RecordTable};

use crate::device::DeviceInner;
use crate::error::{BACKEND, CudaError};

const SHARDS: usize = 16;

/// One shard on its own cache lines.
#[repr(align(128))]
struct Shard<V>(Mutex<HashMap<u64, V>>);

/// Address-keyed records of live allocations.
pub(crate) struct LiveTable<V> {
    shards: Box<[Shard<V>]>,
}

impl<V> LiveTable<V> {
    pub(crate) fn new() -> LiveTable<V> {
        LiveTable { shards: (0..SHARDS).map(|_| Shard(Mutex::new(HashMap::new()))).collect() }
    }

    fn shard(&self, address: u64) -> MutexGuard<'_, HashMap<u64, V>> {
        // Device allocations are at least 256-byte aligned: skip the always-zero bits.
        let index = ((address >> 8) ^ (address >> 21)) as usize % SHARDS;
        // No code runs under these locks but map operations, which do not panic
        // midway through a mutation, so a poisoned shard is still consistent.
        self.shards[index].0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn insert(&self, address: u64, value: V) {
        self.shard(address).insert(address, value);
    }

    /// Removes the record at `address` if `matches` accepts it.
    pub(crate) fn remove_if(&self, address: u64, matches: impl FnOnce(&V) -> bool) -> Option<V> {
        let mut shard = self.shard(address);
        if shard.get(&address).is_some_and(matches) { shard.remove(&address) } else { None }
    }

    /// Runs `f` on the record at `address`, if any.
    pub(crate) fn with<R>(&self, address: u64, f: impl FnOnce(&V) -> R) -> Option<R> {
        self.shard(address).get(&address).map(f)
    }

    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|shard| shard.0.lock().unwrap_or_else(PoisonError::into_inner).len()).sum()
    }
}

/// Counters every allocator of this crate keeps.
#[derive(Default)]
pub(crate) struct Counters {
    live_bytes: AtomicU64,
    live_allocations: AtomicU64,
    allocations_total: AtomicU64,
    failures_total: AtomicU64,
}

impl Counters {
    pub(crate) fn allocated(&self, bytes: usize) {
        self.live_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.live_allocations.fetch_add(1, Ordering::Relaxed);
        self.allocations_total.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn released(&self, bytes: usize) {
        self.live_bytes.fetch_sub(bytes as u64, Ordering::Relaxed);
        self.live_allocations.fetch_sub(1, Ordering::Relaxed);
    }

    pub(crate) fn failed(&self) {
        self.failures_total.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> AllocatorStats {
        AllocatorStats {
            live_bytes: self.live_bytes.load(Ordering::Relaxed),
            live_allocations: self.live_allocations.load(Ordering::Relaxed),
            allocations_total: self.allocations_total.load(Ordering::Relaxed),
            failures_total: self.failures_total.load(Ordering::Relaxed),
            ..AllocatorStats::default()
        }
    }
}

/// A block obtained from the driver by an allocator with a native alignment: the
/// driver's base address and size, and what the caller was handed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    /// What the driver returned (to free).
    pub(crate) base: u64,
    /// What the driver was asked for.
    pub(crate) driver_bytes: usize,
    /// What the caller asked for.
    pub(crate) bytes: usize,
    /// The caller's alignment.
    pub(crate) align: usize,
}

/// A block's record: the address handed out and the driver's block.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Recorded {
    address: u64,
    block: Block,
}

impl Recorded {
    /// Whether `allocation` (on this book's device) describes this record's block.
    fn is(&self, allocation: &RawAllocation) -> bool {
        allocation.address().get() == self.address
            && allocation.bytes() == self.block.bytes
            && allocation.align() == self.block.align
    }
}

/// Where a record keeps its words (the table orders the loads and stores).
#[derive(Default)]
struct RecordCells {
    address: AtomicU64,
    base: AtomicU64,
    driver_bytes: AtomicU64,
    bytes: AtomicU64,
    align: AtomicU64,
}

impl Payload for RecordCells {
    type Value = Recorded;

    fn store(&self, value: &Recorded) {
        self.address.store(value.address, Ordering::Relaxed);
        self.base.store(value.block.base, Ordering::Relaxed);
        self.driver_bytes.store(value.block.driver_bytes as u64, Ordering::Relaxed);
        self.bytes.store(value.block.bytes as u64, Ordering::Relaxed);
        self.align.store(value.block.align as u64, Ordering::Relaxed);
    }

    fn load(&self) -> Recorded {
        Recorded {
            address: self.address.load(Ordering::Relaxed),
            block: Block {
                base: self.base.load(Ordering::Relaxed),
                driver_bytes: self.driver_bytes.load(Ordering::Relaxed) as usize,
                bytes: self.bytes.load(Ordering::Relaxed) as usize,
                align: self.align.load(Ordering::Relaxed) as usize,
            },
        }
    }
}

/// Why [`BlockBook::adopt`] could not record a driver block.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Unadopted {
    /// The driver broke its alignment promise: the block cannot hold the request.
    Misaligned,
    /// The calling thread's part of the record table is full.
    Full,
}

/// Plans and records blocks for allocators whose driver call guarantees a native
/// alignment: larger alignments are served by over-allocating and aligning inside.
pub(crate) struct BlockBook {
    key: DeviceKey,
    native_align: usize,
    max_align: usize,
    live: RecordTable<RecordCells>,
    pub(crate) counters: Counters,
}

impl BlockBook {
    pub(crate) fn new(key: DeviceKey, native_align: usize, max_align: usize) -> BlockBook {
        BlockBook { key, native_align, max_align, live: RecordTable::new(), counters: Counters::default() }
    }

    pub(crate) fn key(&self) -> DeviceKey {
        self.key
    }

    /// The size to ask the driver for. Zero-byte requests get one byte, so every
    /// request yields a unique, releasable block.
    pub(crate) fn plan(&self, request: &AllocationRequest) -> Result<usize, LayoutError> {
        let align = request.align();
        if align > self.max_align {
            return Err(LayoutError::AlignmentTooLarge { align, max: self.max_align, device: self.key });
        }
        let padding = align.saturating_sub(self.native_align);
        request.bytes().max(1).checked_add(padding).ok_or(LayoutError::SizeOverflow {
            bytes: request.bytes(),
            align,
            max: AllocationRequest::MAX_BYTES,
        })
    }

    /// Records the driver's block for `request`; nothing is recorded when the driver
    /// broke its alignment promise so that the block cannot hold the request, or when
    /// the calling thread's part of the record table is full.
    pub(crate) fn adopt(
        &self,
        base: u64,
        driver_bytes: usize,
        request: &AllocationRequest,
    ) -> Result<RawAllocation, Unadopted> {
        let align = request.align() as u64;
        let fits = || {
            let aligned = base.checked_next_multiple_of(align)?;
            let end = aligned.checked_add(request.bytes().max(1) as u64)?;
            (end <= base.checked_add(driver_bytes as u64)?).then_some(aligned)
        };
        let aligned = fits().ok_or(Unadopted::Misaligned)?;
        let address = DeviceAddress::new(aligned).ok_or(Unadopted::Misaligned)?;
        let block = Block { base, driver_bytes, bytes: request.bytes(), align: request.align() };
        let (tag, _) = self.live.insert(&Recorded { address: aligned, block }).ok_or(Unadopted::Full)?;
        self.counters.allocated(request.bytes());
        Ok(RawAllocation::new(address, request.bytes(), request.align(), self.key, tag))
    }

    /// Takes the record of `allocation` and settles it with `settle` (with the block it
    /// records): `true` frees the record, `false` keeps the block live under the same tag
    /// (the driver refused to free it). `None` when this book holds no such block, or it
    /// is being released.
    pub(crate) fn take<R>(&self, allocation: &RawAllocation, settle: impl FnOnce(&Block) -> (bool, R)) -> Option<R> {
        if allocation.device() != self.key {
            return None;
        }
        let taken = self.live.take(allocation.provider_tag(), |recorded| recorded.is(allocation))?;
        let (gone, result) = settle(&taken.value().block);
        if gone {
            taken.free()
        } else {
            taken.restore()
        }
        Some(result)
    }

    /// Books a completed release.
    pub(crate) fn released(&self, block: &Block) {
        self.counters.released(block.bytes);
    }

    /// Forgets blocks lost with their context: drops the records, frees nothing.
    pub(crate) fn forget(&self, lost: Vec<RawAllocation>) -> usize {
        lost.iter().filter_map(|allocation| self.take(allocation, |block| (true, self.released(block)))).count()
    }

    pub(crate) fn live_blocks(&self) -> usize {
        self.live.recorded().count()
    }

    /// The allocate path shared by the block allocators: plan the driver size, call
    /// `driver_alloc`, record the block. On any error nothing stays allocated.
    ///
    /// `available` is asked only after an out-of-memory answer.
    pub(crate) fn allocate_with(
        &self,
        device: &DeviceInner,
        operation: &'static str,
        request: &AllocationRequest,
        driver_alloc: impl FnOnce(usize) -> Result<u64, CudaError>,
        driver_free: impl FnOnce(u64) -> Result<(), CudaError>,
        available: impl FnOnce() -> Option<usize>,
    ) -> Result<RawAllocation, AllocError> {
        let size = self.plan(request).inspect_err(|_| self.counters.failed())?;
        let base = match device.ensure_alive(operation).and_then(|()| driver_alloc(size)) {
            Ok(base) => base,
            Err(error) => {
                self.counters.failed();
                let available = if matches!(error, CudaError::OutOfMemory { .. }) { available() } else { None };
                tracing::debug!(device = %self.key, bytes = request.bytes(), "{operation} failed: {error}");
                return Err(error.into_alloc(self.key, request.bytes(), request.align(), available));
            }
        };
        match self.adopt(base, size, request) {
            Ok(allocation) => {
                tracing::trace!(device = %self.key, address = base, bytes = request.bytes(), "allocated");
                Ok(allocation)
            }
            Err(why) => {
                self.counters.failed();
                if let Err(error) = driver_free(base) {
                    tracing::warn!(device = %self.key, "freeing an unrecorded driver block failed: {error}");
                }
                let detail = match why {
                    Unadopted::Misaligned => format!(
                        "the driver returned {base:#x} for {size} bytes, which is not aligned to the promised {} \
                         bytes; the block was freed (report this driver bug)",
                        self.native_align
                    ),
                    Unadopted::Full => format!(
                        "this thread holds {} blocks of this allocator, the record table's bound per thread; the \
                         block was freed: release some blocks first",
                        memory_sync::records::SLOTS_PER_OWNER
                    ),
                };
                Err(AllocError::Backend {
                    device: self.key,
                    source: BackendError { backend: BACKEND, operation, code: 0, detail },
                })
            }
        }
    }

    /// The release path shared by the block allocators: check ownership, call
    /// `driver_free` on the driver's base address, and book the outcome. A refused
    /// free hands the block back untouched (`Failed`).
    pub(crate) fn release_with(
        &self,
        device: &DeviceInner,
        allocator: &str,
        operation: &'static str,
        allocation: RawAllocation,
        driver_free: impl FnOnce(u64) -> Result<(), CudaError>,
    ) -> ReleaseOutcome {
        let freed = self.take(&allocation, |block| match device.ensure_alive(operation).and_then(|()| driver_free(block.base)) {
            Ok(()) => {
                self.released(block);
                tracing::trace!(device = %self.key, address = block.base, "released");
                // Never more than the block (the driver may have rounded it up).
                (true, Ok(block.driver_bytes.min(allocation.bytes())))
            }
            Err(error) => {
                tracing::warn!(device = %self.key, address = block.base, "{operation} failed; the block is handed back: {error}");
                (false, Err(error))
            }
        });
        match freed {
            Some(Ok(unmapped)) => ReleaseOutcome::complete(unmapped),
            Some(Err(error)) => ReleaseOutcome::failed(allocation, error.into_release(self.key)),
            None => {
                let error = ReleaseError::NotOwned {
                    allocator: allocator.to_owned(),
                    device: self.key,
                    address: allocation.address().get(),
                };
                ReleaseOutcome::failed(allocation, error)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book() -> BlockBook {
        BlockBook::new(DeviceKey::device(0), 256, 1 << 21)
    }

    #[test]
    fn large_alignments_are_served_by_padding_and_small_ones_are_not_padded() {
        let book = book();
        assert_eq!(book.plan(&AllocationRequest::new(1000, 64).unwrap()), Ok(1000));
        assert_eq!(book.plan(&AllocationRequest::new(1000, 4096).unwrap()), Ok(1000 + 4096 - 256));
        assert_eq!(book.plan(&AllocationRequest::new(0, 1).unwrap()), Ok(1));
        assert_eq!(
            book.plan(&AllocationRequest::new(8, 1 << 22).unwrap()),
            Err(LayoutError::AlignmentTooLarge { align: 1 << 22, max: 1 << 21, device: DeviceKey::device(0) })
        );
    }

    #[test]
    fn adopted_blocks_are_aligned_inside_the_driver_block_and_taken_back_exactly_once() {
        let book = book();
        let request = AllocationRequest::new(1000, 4096).unwrap();
        let size = book.plan(&request).unwrap();
        let block = book.adopt(0x10_0100, size, &request).expect("fits");
        assert!(block.address().is_aligned_to(4096));
        assert_eq!(block.address().get(), 0x10_1000);
        assert_eq!(book.counters.snapshot().live_bytes, 1000);
        // A forged block with the same address and tag but another size is not ours,
        // and neither is the right block under another tag.
        let forged = RawAllocation::new(block.address(), 999, 4096, DeviceKey::device(0), block.provider_tag());
        assert!(book.take(&forged, |_| (true, ())).is_none());
        let retagged = RawAllocation::new(block.address(), 1000, 4096, DeviceKey::device(0), block.provider_tag() ^ 1);
        assert!(book.take(&retagged, |_| (true, ())).is_none());
        // Kept (the driver refused to free it): live again under the same tag.
        let base = book.take(&block, |taken| (false, taken.base)).expect("ours");
        assert_eq!(base, 0x10_0100);
        assert_eq!(book.live_blocks(), 1);
        assert!(book.take(&block, |_| (true, ())).is_some(), "a kept block can be taken again");
        assert!(book.take(&block, |_| (true, ())).is_none(), "a freed block is taken once");
        assert_eq!(book.live_blocks(), 0);
    }

    #[test]
    fn a_driver_block_that_breaks_the_native_alignment_is_refused() {
        let book = book();
        let request = AllocationRequest::new(1000, 4096).unwrap();
        let size = book.plan(&request).unwrap();
        // Base only 16-byte aligned: the padding of 3840 bytes is not enough.
        assert_eq!(book.adopt(0x10_0010, size, &request), Err(Unadopted::Misaligned));
        assert_eq!(book.live_blocks(), 0);
        assert_eq!(book.counters.snapshot().live_allocations, 0);
    }

    #[test]
    fn blocks_of_another_device_are_never_taken() {
        let book = book();
        let request = AllocationRequest::new(64, 8).unwrap();
        let block = book.adopt(0x20_0000, 64, &request).unwrap();
        let other = RawAllocation::new(block.address(), 64, 8, DeviceKey::device(1), block.provider_tag());
        assert!(book.take(&other, |_| (true, ())).is_none());
        assert_eq!(book.forget(vec![other]), 0);
        assert_eq!(book.forget(vec![block]), 1);
        assert_eq!(book.counters.snapshot().live_allocations, 0);
    }
}
