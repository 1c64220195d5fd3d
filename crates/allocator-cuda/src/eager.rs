//! `CudaAllocator`: one `cuMemAlloc` per allocation, one `cuMemFree` per release.

use std::fmt;

use cudarc::driver::sys;
use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, DeviceAllocator, DeviceKey, RawAllocation, ReleaseOutcome,
};

use crate::device::CudaDevice;
use crate::table::BlockBook;

/// Eager device memory: `cuMemAlloc_v2` on allocate, `cuMemFree_v2` on release.
///
/// The simplest CUDA mechanism and the reference the others are compared with. The
/// driver aligns blocks to at least [`CudaAllocator::NATIVE_ALIGN`]; larger alignments
/// (up to [`CudaAllocator::MAX_ALIGN`]) are served by over-allocating and aligning
/// inside the block. `cuMemFree` synchronises with the device, so a release never
/// frees memory a queued kernel still uses.
pub struct CudaAllocator {
    device: CudaDevice,
    book: BlockBook,
}

impl CudaAllocator {
    /// The alignment `cuMemAlloc` guarantees.
    pub const NATIVE_ALIGN: usize = 256;
    /// The largest alignment served (by padding the block).
    pub const MAX_ALIGN: usize = 2 << 20;

    /// An allocator on `device`'s primary context.
    pub fn new(device: &CudaDevice) -> CudaAllocator {
        CudaAllocator {
            device: device.clone(),
            book: BlockBook::new(device.key(), Self::NATIVE_ALIGN, Self::MAX_ALIGN),
        }
    }

    /// The device handle.
    pub fn cuda_device(&self) -> &CudaDevice {
        &self.device
    }

    fn driver_free(&self, base: u64) -> Result<(), crate::CudaError> {
        let device = self.device.inner();
        let _current = device.enter("cuMemFree_v2")?;
        // SAFETY: `base` is an address cuMemAlloc_v2 returned on this context and that
        // was taken out of the live table, so it is freed at most once; the context is
        // current (held by `_current`).
        device.call("cuMemFree_v2", unsafe { sys::cuMemFree_v2(base) })
    }
}

impl DeviceAllocator for CudaAllocator {
    fn device(&self) -> DeviceKey {
        self.book.key()
    }

    fn name(&self) -> &str {
        "cuda-eager"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let device = self.device.inner();
        self.book.allocate_with(
            device,
            "cuMemAlloc_v2",
            request,
            |size| {
                let _current = device.enter("cuMemAlloc_v2")?;
                let mut base: sys::CUdeviceptr = 0;
                // SAFETY: `base` is a valid out-pointer for one CUdeviceptr and the
                // device's context is current (held by `_current`).
                device.call("cuMemAlloc_v2", unsafe { sys::cuMemAlloc_v2(&mut base, size) })?;
                Ok(base)
            },
            |base| self.driver_free(base),
            || self.device.memory_info().ok().map(|(free, _)| free),
        )
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.book
            .release_with(self.device.inner(), self.name(), "cuMemFree_v2", allocation, |base| self.driver_free(base))
    }

    fn stats(&self) -> Option<AllocatorStats> {
        Some(self.book.counters.snapshot())
    }

    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        let forgotten = self.book.forget(lost);
        tracing::info!(device = %self.book.key(), forgotten, "forgot blocks lost with their context");
    }
}

impl fmt::Debug for CudaAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaAllocator").field("device", &self.device).field("live", &self.book.live_blocks()).finish()
    }
}
