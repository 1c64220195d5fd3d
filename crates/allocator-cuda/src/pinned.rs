//! `PinnedHostAllocator`: page-locked host memory from `cuMemHostAlloc`.

use std::fmt;

use cudarc::driver::sys;
use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, DeviceAllocator, DeviceKey, RawAllocation, ReleaseOutcome,
};

use crate::device::CudaDevice;
use crate::error::CudaError;
use crate::table::BlockBook;

/// Page-locked (pinned) host memory for fast, asynchronous host-device copies
/// (staging buffers, offloaded KV pages).
///
/// Blocks live on [`DeviceKey::HOST`]; their addresses are host pointers
/// ([`memory_api::DeviceAddress::as_host_ptr`]) usable from every CUDA context
/// (`CU_MEMHOSTALLOC_PORTABLE`). Pinned memory is a scarce system resource: keep it to
/// staging-sized buffers.
pub struct PinnedHostAllocator {
    device: CudaDevice,
    book: BlockBook,
}

impl PinnedHostAllocator {
    /// The alignment `cuMemHostAlloc` guarantees (a page).
    pub const NATIVE_ALIGN: usize = 4096;
    /// The largest alignment served (by padding the block).
    pub const MAX_ALIGN: usize = 2 << 20;

    /// An allocator of pinned host memory, registered through `device`'s context.
    pub fn new(device: &CudaDevice) -> PinnedHostAllocator {
        PinnedHostAllocator {
            device: device.clone(),
            book: BlockBook::new(DeviceKey::HOST, Self::NATIVE_ALIGN, Self::MAX_ALIGN),
        }
    }

    /// The device whose context pins the memory.
    pub fn cuda_device(&self) -> &CudaDevice {
        &self.device
    }

    fn driver_free(&self, base: u64) -> Result<(), CudaError> {
        let device = self.device.inner();
        let _current = device.enter("cuMemFreeHost")?;
        // SAFETY: `base` is a pointer cuMemHostAlloc returned and that was taken out of
        // the live table, so it is freed at most once; the context is current.
        device
            .call("cuMemFreeHost", unsafe { sys::cuMemFreeHost(std::ptr::with_exposed_provenance_mut(base as usize)) })
    }
}

impl DeviceAllocator for PinnedHostAllocator {
    fn device(&self) -> DeviceKey {
        DeviceKey::HOST
    }

    fn name(&self) -> &str {
        "cuda-pinned-host"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let device = self.device.inner();
        self.book.allocate_with(
            device,
            "cuMemHostAlloc",
            request,
            |size| {
                let _current = device.enter("cuMemHostAlloc")?;
                let mut pointer: *mut std::ffi::c_void = std::ptr::null_mut();
                // SAFETY: `pointer` is a valid out-pointer for one host pointer and the
                // device's context is current (held by `_current`).
                let result = unsafe { sys::cuMemHostAlloc(&mut pointer, size, sys::CU_MEMHOSTALLOC_PORTABLE) };
                device.call("cuMemHostAlloc", result)?;
                Ok(pointer.expose_provenance() as u64)
            },
            |base| self.driver_free(base),
            || None,
        )
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.book
            .release_with(self.device.inner(), self.name(), "cuMemFreeHost", allocation, |base| self.driver_free(base))
    }

    fn stats(&self) -> Option<AllocatorStats> {
        Some(self.book.counters.snapshot())
    }

    /// The blocks live on [`DeviceKey::HOST`]: a loss of the host key (a registry's
    /// `invalidate_device`) leaves them pinned by a context that is still alive, and
    /// nothing else would ever free them, so they are freed here as their owner would
    /// have (`cuMemFreeHost`). A block the free does not complete (the pinning context is
    /// lost itself, and the memory went with it; or the driver refused) leaves the books
    /// instead, so nothing stays recorded that nobody can release.
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        for block in lost {
            match self.release(block) {
                ReleaseOutcome::Complete(_) => {}
                ReleaseOutcome::Failed(failed) => {
                    let (block, error) = failed.into_parts();
                    let forgotten = self.book.forget(vec![block]);
                    tracing::info!(forgotten, %error, "a lost pinned block could not be freed: forgotten");
                }
                outcome => tracing::warn!(outcome = %outcome.summary(), "a lost pinned block was not freed"),
            }
        }
    }
}

impl fmt::Debug for PinnedHostAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedHostAllocator")
            .field("device", &self.device)
            .field("live", &self.book.live_blocks())
            .finish()
    }
}
