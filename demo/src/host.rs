//! A small host allocator written in safe Rust, so the demo can write to and read back
//! the memory it hands out without `unsafe` (allocator-cpu's `SystemAllocator` hands out
//! addresses, and touching those is an unsafe obligation this binary does not take).
//!
//! Each block is backed by its own heap buffer, over-allocated so that an aligned start
//! exists inside it; the block's address is that aligned start. The allocator keeps the
//! buffers by address, which gives it what the contract asks of every backend: distinct
//! blocks, unique zero-size blocks, typed errors for every bad layout, and an honest
//! `Failed(NotOwned)` (block handed back) when asked to release a block it did not make.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, DeviceAddress, DeviceAllocator, DeviceKey, LayoutError, MaybeBytes,
    RawAllocation, ReleaseError, ReleaseOutcome,
};

/// The largest alignment served (2 MiB, a huge page).
pub(crate) const MAX_ALIGN: usize = 2 << 20;

/// One live block: its buffer and where the aligned block starts inside it.
struct Block {
    buffer: Vec<u8>,
    offset: usize,
    bytes: usize,
}

#[derive(Default)]
struct State {
    blocks: HashMap<u64, Block>,
    stats: AllocatorStats,
}

/// Host memory for [`DeviceKey::HOST`], one heap buffer per block.
pub(crate) struct VecHostAllocator {
    name: &'static str,
    state: Mutex<State>,
}

/// A read or write that does not fit the block it names.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AccessError {
    /// The block is not live in this allocator.
    #[error("{allocator} has no live block at {address}")]
    NotOwned {
        /// The allocator's name.
        allocator: &'static str,
        /// The address presented.
        address: DeviceAddress,
    },
    /// The range runs past the end of the block.
    #[error("{len} bytes at offset {offset} do not fit in a {bytes}-byte block")]
    OutOfBounds {
        /// Start of the access.
        offset: usize,
        /// Length of the access.
        len: usize,
        /// Size of the block.
        bytes: usize,
    },
}

impl VecHostAllocator {
    /// An empty allocator called `name`.
    pub(crate) fn new(name: &'static str) -> VecHostAllocator {
        VecHostAllocator { name, state: Mutex::new(State::default()) }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Nothing panics while the lock is held, and every update leaves the map and the
        // counters consistent, so a poisoned lock still guards valid state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Copies `data` into `allocation` at `offset`.
    ///
    /// # Errors
    /// [`AccessError`] when the block is not live here or the range does not fit.
    pub(crate) fn write(&self, allocation: &RawAllocation, offset: usize, data: &[u8]) -> Result<(), AccessError> {
        let mut state = self.state();
        let block = self.block_mut(&mut state, allocation)?;
        let range = checked_range(offset, data.len(), block.bytes)?;
        let start = block.offset;
        block.buffer[start + range.start..start + range.end].copy_from_slice(data);
        Ok(())
    }

    /// Reads `len` bytes of `allocation` at `offset`.
    ///
    /// # Errors
    /// [`AccessError`] when the block is not live here or the range does not fit.
    pub(crate) fn read(&self, allocation: &RawAllocation, offset: usize, len: usize) -> Result<Vec<u8>, AccessError> {
        let mut state = self.state();
        let block = self.block_mut(&mut state, allocation)?;
        let range = checked_range(offset, len, block.bytes)?;
        Ok(block.buffer[block.offset + range.start..block.offset + range.end].to_vec())
    }

    fn block_mut<'s>(&self, state: &'s mut State, allocation: &RawAllocation) -> Result<&'s mut Block, AccessError> {
        let address = allocation.address();
        match state.blocks.get_mut(&address.get()) {
            Some(block) if block.bytes == allocation.bytes() => Ok(block),
            _ => Err(AccessError::NotOwned { allocator: self.name, address }),
        }
    }
}

fn checked_range(offset: usize, len: usize, bytes: usize) -> Result<std::ops::Range<usize>, AccessError> {
    match offset.checked_add(len) {
        Some(end) if end <= bytes => Ok(offset..end),
        _ => Err(AccessError::OutOfBounds { offset, len, bytes }),
    }
}

impl DeviceAllocator for VecHostAllocator {
    fn device(&self) -> DeviceKey {
        DeviceKey::HOST
    }

    fn name(&self) -> &str {
        self.name
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let (bytes, align) = (request.bytes(), request.align());
        if align > MAX_ALIGN {
            self.state().stats.failures_total += 1;
            return Err(LayoutError::AlignmentTooLarge { align, max: MAX_ALIGN, device: DeviceKey::HOST }.into());
        }
        // Room for the block plus the slack to align its start; at least one byte so a
        // zero-size block still has an address of its own.
        let capacity = bytes.checked_add(align).ok_or(LayoutError::SizeOverflow {
            bytes,
            align,
            max: AllocationRequest::MAX_BYTES,
        })?;
        let mut buffer = Vec::new();
        if buffer.try_reserve_exact(capacity).is_err() {
            self.state().stats.failures_total += 1;
            return Err(AllocError::OutOfMemory {
                device: DeviceKey::HOST,
                requested: bytes,
                align,
                available: MaybeBytes(None),
            });
        }
        buffer.resize(capacity, 0);
        let offset = buffer.as_ptr().align_offset(align);
        let start = buffer.as_ptr().addr() + offset;
        let address = DeviceAddress::new(start as u64).expect("a heap buffer is never at address zero");
        let mut state = self.state();
        state.stats.live_bytes += bytes as u64;
        state.stats.live_allocations += 1;
        state.stats.allocations_total += 1;
        // The buffer's heap storage does not move when the Vec moves into the map.
        state.blocks.insert(address.get(), Block { buffer, offset, bytes });
        Ok(RawAllocation::new(address, bytes, align, DeviceKey::HOST, 0))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let mut state = self.state();
        let key = allocation.address().get();
        match state.blocks.get(&key) {
            Some(block) if block.bytes == allocation.bytes() => {}
            _ => {
                drop(state);
                let error =
                    ReleaseError::NotOwned { allocator: self.name.to_owned(), device: DeviceKey::HOST, address: key };
                return ReleaseOutcome::failed(allocation, error);
            }
        }
        let block = state.blocks.remove(&key).expect("checked above under the same lock");
        state.stats.live_bytes -= block.bytes as u64;
        state.stats.live_allocations -= 1;
        drop(state);
        drop(block);
        ReleaseOutcome::complete(allocation.bytes())
    }

    fn stats(&self) -> Option<AllocatorStats> {
        Some(self.state().stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(bytes: usize, align: usize) -> AllocationRequest {
        AllocationRequest::new(bytes, align).unwrap()
    }

    #[test]
    fn blocks_are_aligned_distinct_and_writable() {
        let host = VecHostAllocator::new("test");
        let mut blocks = Vec::new();
        for align in [1, 8, 256, 4096, MAX_ALIGN] {
            let block = host.allocate(&request(100, align)).unwrap();
            assert!(block.address().is_aligned_to(align), "{block:?}");
            host.write(&block, 0, &[align as u8; 100]).unwrap();
            blocks.push(block);
        }
        for (i, a) in blocks.iter().enumerate() {
            for b in &blocks[i + 1..] {
                assert_ne!(a.address(), b.address());
            }
            assert_eq!(host.read(a, 0, 100).unwrap(), vec![a.align() as u8; 100]);
        }
        for block in blocks {
            assert!(host.release(block).is_complete());
        }
        assert_eq!(host.stats().unwrap().live_bytes, 0);
    }

    #[test]
    fn zero_size_blocks_are_unique_and_releasable() {
        let host = VecHostAllocator::new("test");
        let a = host.allocate(&request(0, 1)).unwrap();
        let b = host.allocate(&request(0, 1)).unwrap();
        assert_ne!(a.address(), b.address());
        assert!(host.release(a).is_complete());
        assert!(host.release(b).is_complete());
    }

    #[test]
    fn too_large_alignment_is_a_typed_error() {
        let host = VecHostAllocator::new("test");
        let err = host.allocate(&request(8, MAX_ALIGN * 2)).unwrap_err();
        assert!(matches!(err, AllocError::Layout(LayoutError::AlignmentTooLarge { .. })), "{err}");
        assert_eq!(host.stats().unwrap().failures_total, 1);
    }

    #[test]
    fn a_size_the_heap_refuses_is_out_of_memory_not_an_abort() {
        let host = VecHostAllocator::new("test");
        let err = host.allocate(&request(AllocationRequest::MAX_BYTES - 64, 64)).unwrap_err();
        assert!(matches!(err, AllocError::OutOfMemory { .. } | AllocError::Layout(_)), "{err}");
    }

    #[test]
    fn foreign_blocks_are_handed_back_not_freed() {
        let owner = VecHostAllocator::new("owner");
        let stranger = VecHostAllocator::new("stranger");
        let block = owner.allocate(&request(64, 8)).unwrap();
        let ReleaseOutcome::Failed(failed) = stranger.release(block) else { panic!("stranger must refuse") };
        assert!(failed.error().to_string().contains("stranger does not own"), "{}", failed.error());
        let (block, _) = failed.into_parts();
        assert!(owner.release(block).is_complete());
    }

    #[test]
    fn out_of_bounds_and_released_blocks_cannot_be_accessed() {
        let host = VecHostAllocator::new("test");
        let block = host.allocate(&request(16, 8)).unwrap();
        assert_eq!(host.write(&block, 8, &[0; 9]), Err(AccessError::OutOfBounds { offset: 8, len: 9, bytes: 16 }));
        assert!(host.read(&block, usize::MAX, 2).is_err());
        let copy = RawAllocation::new(block.address(), block.bytes(), block.align(), block.device(), 0);
        assert!(host.release(block).is_complete());
        assert!(matches!(host.read(&copy, 0, 1), Err(AccessError::NotOwned { .. })));
        assert!(!host.release(copy).is_complete(), "a second release must not succeed");
    }
}
