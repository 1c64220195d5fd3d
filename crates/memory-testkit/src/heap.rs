//! [`HostHeap`]: a host-memory allocator written in safe Rust, for tests.
//!
//! Each block is a zero-filled `Vec<u8>` over-allocated so that an aligned start fits
//! inside it; the vectors live in one process-wide table keyed by start address, which
//! lets [`HostHeapAccess`] read and write any live block without `unsafe`. One lock
//! guards the table: this allocator is for correctness tests, not for speed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, DeviceAddress, DeviceAllocator, DeviceKey, MaybeBytes,
    RawAllocation, ReleaseError, ReleaseOutcome,
};

use crate::access::{AccessError, MemoryAccess};

struct HeapBlock {
    heap: u64,
    bytes: usize,
    align: usize,
    /// Where the block starts inside `buffer`.
    offset: usize,
    buffer: Vec<u8>,
}

static BLOCKS: Mutex<BTreeMap<u64, HeapBlock>> = Mutex::new(BTreeMap::new());
static NEXT_HEAP: AtomicU64 = AtomicU64::new(1);

fn blocks() -> MutexGuard<'static, BTreeMap<u64, HeapBlock>> {
    // A panic while the table is locked cannot leave it inconsistent (every mutation is
    // one insert or remove), so a poisoned lock is still usable.
    BLOCKS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Real host memory, allocated and freed in safe Rust, labelled with any device key.
///
/// Supports every size (zero included) and every power-of-two alignment; fails with
/// [`AllocError::OutOfMemory`] when the system refuses the memory or an optional byte
/// limit would be exceeded. Releases check that the block came from this heap.
/// Memory starts zeroed. Use [`HostHeapAccess`] to read and write it.
#[derive(Debug)]
pub struct HostHeap {
    id: u64,
    device: DeviceKey,
    limit: Option<usize>,
    live_bytes: AtomicU64,
    live_allocations: AtomicU64,
    allocations_total: AtomicU64,
    failures_total: AtomicU64,
}

impl HostHeap {
    /// A heap for [`DeviceKey::HOST`].
    pub fn new() -> HostHeap {
        HostHeap::on_device(DeviceKey::HOST)
    }

    /// A heap whose allocations claim to live on `device` (a simulated device).
    pub fn on_device(device: DeviceKey) -> HostHeap {
        HostHeap {
            id: NEXT_HEAP.fetch_add(1, Ordering::Relaxed),
            device,
            limit: None,
            live_bytes: AtomicU64::new(0),
            live_allocations: AtomicU64::new(0),
            allocations_total: AtomicU64::new(0),
            failures_total: AtomicU64::new(0),
        }
    }

    /// The same heap, refusing any allocation that would take its live bytes over
    /// `limit` (a deterministic out-of-memory for tests).
    #[must_use]
    pub fn with_limit(mut self, limit: usize) -> HostHeap {
        self.limit = Some(limit);
        self
    }

    /// An accessor for the memory of every live `HostHeap` block.
    pub fn access() -> HostHeapAccess {
        HostHeapAccess
    }

    fn out_of_memory(&self, request: &AllocationRequest, available: Option<usize>) -> AllocError {
        self.failures_total.fetch_add(1, Ordering::Relaxed);
        AllocError::OutOfMemory {
            device: self.device,
            requested: request.bytes(),
            align: request.align(),
            available: MaybeBytes(available),
        }
    }
}

impl Default for HostHeap {
    fn default() -> HostHeap {
        HostHeap::new()
    }
}

impl DeviceAllocator for HostHeap {
    fn device(&self) -> DeviceKey {
        self.device
    }

    fn name(&self) -> &str {
        "testkit-host-heap"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let bytes = request.bytes();
        let align = request.align();
        let mut table = blocks();
        let live = usize::try_from(self.live_bytes.load(Ordering::Relaxed)).unwrap_or(usize::MAX);
        if let Some(limit) = self.limit
            && live.checked_add(bytes).is_none_or(|total| total > limit)
        {
            return Err(self.out_of_memory(request, Some(limit.saturating_sub(live))));
        }
        // One spare byte per alignment step lets an aligned start fit; at least one byte
        // so a zero-size block still has an address of its own.
        let Some(span) = bytes.max(1).checked_add(align - 1) else {
            return Err(self.out_of_memory(request, None));
        };
        let mut buffer = Vec::new();
        if buffer.try_reserve_exact(span).is_err() {
            return Err(self.out_of_memory(request, None));
        }
        buffer.resize(span, 0);
        let base = buffer.as_mut_ptr().expose_provenance();
        let start = base.next_multiple_of(align);
        let offset = start - base;
        let Some(address) = DeviceAddress::new(start as u64) else {
            return Err(self.out_of_memory(request, None));
        };
        table.insert(address.get(), HeapBlock { heap: self.id, bytes, align, offset, buffer });
        self.live_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.live_allocations.fetch_add(1, Ordering::Relaxed);
        self.allocations_total.fetch_add(1, Ordering::Relaxed);
        Ok(RawAllocation::new(address, bytes, align, self.device, self.id))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let mut table = blocks();
        let owned = allocation.device() == self.device
            && table.get(&allocation.address().get()).is_some_and(|block| {
                block.heap == self.id && block.bytes == allocation.bytes() && block.align == allocation.align()
            });
        if !owned {
            drop(table);
            let error = ReleaseError::NotOwned {
                allocator: self.name().to_owned(),
                device: self.device,
                address: allocation.address().get(),
            };
            return ReleaseOutcome::failed(allocation, error);
        }
        let block = table.remove(&allocation.address().get());
        drop(table);
        drop(block);
        self.live_bytes.fetch_sub(allocation.bytes() as u64, Ordering::Relaxed);
        self.live_allocations.fetch_sub(1, Ordering::Relaxed);
        ReleaseOutcome::complete(allocation.bytes())
    }

    fn stats(&self) -> Option<AllocatorStats> {
        Some(AllocatorStats {
            live_bytes: self.live_bytes.load(Ordering::Relaxed),
            live_allocations: self.live_allocations.load(Ordering::Relaxed),
            allocations_total: self.allocations_total.load(Ordering::Relaxed),
            failures_total: self.failures_total.load(Ordering::Relaxed),
            ..AllocatorStats::default()
        })
    }
}

/// Reads and writes the memory of live [`HostHeap`] blocks (of any heap), in safe Rust.
/// A range that is not wholly inside one live block is an [`AccessError`].
#[derive(Copy, Clone, Debug, Default)]
pub struct HostHeapAccess;

impl HostHeapAccess {
    fn with_block<R>(address: DeviceAddress, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> Result<R, AccessError> {
        let mut table = blocks();
        let found = table.range_mut(..=address.get()).next_back().and_then(|(&start, block)| {
            let delta = usize::try_from(address.get() - start).ok()?;
            let end = delta.checked_add(len)?;
            (end <= block.bytes).then(|| &mut block.buffer[block.offset + delta..block.offset + end])
        });
        match found {
            Some(bytes) => Ok(f(bytes)),
            None => Err(AccessError { address, len, reason: "not inside a live host-heap block".to_owned() }),
        }
    }
}

impl MemoryAccess for HostHeapAccess {
    fn write(&self, address: DeviceAddress, data: &[u8]) -> Result<(), AccessError> {
        HostHeapAccess::with_block(address, data.len(), |bytes| bytes.copy_from_slice(data))
    }

    fn read(&self, address: DeviceAddress, len: usize) -> Result<Vec<u8>, AccessError> {
        HostHeapAccess::with_block(address, len, |bytes| bytes.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(bytes: usize, align: usize) -> AllocationRequest {
        AllocationRequest::new(bytes, align).unwrap()
    }

    #[test]
    fn blocks_are_aligned_zeroed_and_accessible_within_bounds_only() {
        let heap = HostHeap::new();
        let block = heap.allocate(&request(100, 4096)).unwrap();
        assert!(block.address().is_aligned_to(4096));
        let access = HostHeap::access();
        assert_eq!(access.read(block.address(), 100).unwrap(), vec![0; 100]);
        let inside = block.address().checked_add(10).unwrap();
        access.write(inside, &[7; 90]).unwrap();
        assert_eq!(access.read(inside, 90).unwrap(), vec![7; 90]);
        assert!(access.write(inside, &[7; 91]).is_err(), "one byte past the end must be refused");
        let address = block.address();
        assert!(heap.release(block).is_complete());
        assert!(access.read(address, 1).is_err(), "a released block must not be accessible");
    }

    #[test]
    fn limit_refuses_with_out_of_memory_naming_what_is_left() {
        let heap = HostHeap::new().with_limit(1000);
        let first = heap.allocate(&request(600, 8)).unwrap();
        let err = heap.allocate(&request(600, 8)).unwrap_err();
        assert_eq!(
            err,
            AllocError::OutOfMemory {
                device: DeviceKey::HOST,
                requested: 600,
                align: 8,
                available: MaybeBytes(Some(400))
            }
        );
        assert!(heap.release(first).is_complete());
        assert!(heap.allocate(&request(600, 8)).is_ok());
        assert_eq!(heap.stats().unwrap().failures_total, 1);
    }

    #[test]
    fn release_through_another_heap_hands_the_block_back() {
        let (a, b) = (HostHeap::new(), HostHeap::new());
        let block = a.allocate(&request(8, 8)).unwrap();
        let ReleaseOutcome::Failed(failed) = b.release(block) else { panic!("foreign release must fail") };
        assert!(matches!(failed.error(), ReleaseError::NotOwned { .. }));
        let (block, _) = failed.into_parts();
        assert!(a.release(block).is_complete());
    }
}
