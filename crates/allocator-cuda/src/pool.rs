//! `CudaPoolAllocator`: stream-ordered allocation from a dedicated CUDA memory pool.

use std::ffi::c_void;
use std::fmt;

use cudarc::driver::{result, sys};
use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, DeviceAllocator, DeviceKey, RawAllocation, ReleaseOutcome,
};

use crate::error::{CudaError, CudaErrorCode};
use crate::stream::CudaStream;
use crate::table::BlockBook;

/// How a [`CudaPoolAllocator`] keeps memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Bytes of freed memory the pool keeps cached at each synchronisation instead of
    /// returning them to the device (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`). The driver's
    /// default is 0, which hands memory back at every synchronisation and costs
    /// milliseconds per re-acquire; the default here, `u64::MAX`, keeps everything
    /// until [`CudaPoolAllocator::trim_to`] (or `DeviceAllocator::trim`).
    pub release_threshold: u64,
}

impl Default for PoolConfig {
    fn default() -> PoolConfig {
        PoolConfig { release_threshold: u64::MAX }
    }
}

/// The pool's own counters, read from its attributes.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolUsage {
    /// Physical memory the pool holds (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
    pub reserved_bytes: u64,
    /// High-water mark of `reserved_bytes`.
    pub reserved_high_bytes: u64,
    /// Memory handed out and not yet freed (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`).
    pub used_bytes: u64,
    /// High-water mark of `used_bytes`.
    pub used_high_bytes: u64,
}

/// Stream-ordered device memory from a dedicated pool: `cuMemAllocFromPoolAsync` on
/// allocate, `cuMemFreeAsync` on release, both on one [`CudaStream`].
///
/// Blocks are valid on that stream from the allocation onwards; work on other streams
/// must wait for it (an event) first. A release is stream-ordered: the memory returns
/// to the pool only once the stream has finished the work queued before it, so
/// releasing (or dropping through the registry's release path) a block that queued
/// kernels still use is safe. The pool's release threshold is set at creation (see
/// [`PoolConfig`]); [`CudaPoolAllocator::trim_to`] hands cached memory back.
pub struct CudaPoolAllocator {
    stream: CudaStream,
    pool: RawPool,
    book: BlockBook,
}

#[derive(Copy, Clone)]
struct RawPool(sys::CUmemoryPool);

// SAFETY: a CUmemoryPool is an opaque driver handle this crate never dereferences; the
// driver API accepts it from any thread.
unsafe impl Send for RawPool {}
// SAFETY: as for `Send`: shared access only passes the handle to the thread-safe driver.
unsafe impl Sync for RawPool {}

impl CudaPoolAllocator {
    /// The alignment the pool guarantees.
    pub const NATIVE_ALIGN: usize = 256;
    /// The largest alignment served (by padding the block).
    pub const MAX_ALIGN: usize = 2 << 20;

    /// Creates a pool on `stream`'s device and sets its release threshold.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when the device has no memory pools, or the driver's
    /// failure to create or configure the pool (nothing is left allocated then).
    pub fn new(stream: &CudaStream, config: PoolConfig) -> Result<CudaPoolAllocator, CudaError> {
        let device = stream.device_inner();
        let ordinal = device.ordinal();
        if device.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? == 0 {
            return Err(CudaError::Unsupported { ordinal, feature: "memory pools (cuMemAllocFromPoolAsync)" });
        }
        let props = sys::CUmemPoolProps {
            allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: device.raw_device(),
            },
            win32SecurityAttributes: std::ptr::null_mut(),
            maxSize: 0,
            usage: 0,
            reserved: [0; 54],
        };
        let pool = {
            let _current = device.enter("cuMemPoolCreate")?;
            // SAFETY: `props` is a fully initialised CUmemPoolProps that outlives the
            // call; the context is current. The pool is destroyed in `Drop` (or below).
            unsafe { result::mem_pool::create(&props) }
                .map_err(|error| device.fail("cuMemPoolCreate", CudaErrorCode(error.0 as u32)))?
        };
        let allocator = CudaPoolAllocator {
            stream: stream.clone(),
            pool: RawPool(pool),
            book: BlockBook::new(device.key(), Self::NATIVE_ALIGN, Self::MAX_ALIGN),
        };
        // On failure `allocator` drops here and destroys the pool.
        allocator.set_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, config.release_threshold)?;
        tracing::debug!(ordinal, release_threshold = config.release_threshold, "created a CUDA memory pool");
        Ok(allocator)
    }

    /// The stream allocations and releases are ordered on.
    pub fn stream(&self) -> &CudaStream {
        &self.stream
    }

    /// The release threshold as the pool reports it.
    ///
    /// # Errors
    /// The driver's failure.
    pub fn release_threshold(&self) -> Result<u64, CudaError> {
        self.get_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
    }

    /// The pool's counters.
    ///
    /// # Errors
    /// The driver's failure.
    pub fn usage(&self) -> Result<PoolUsage, CudaError> {
        use sys::CUmemPool_attribute::*;
        Ok(PoolUsage {
            reserved_bytes: self.get_u64(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high_bytes: self.get_u64(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            used_bytes: self.get_u64(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high_bytes: self.get_u64(CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        })
    }

    /// Waits for the stream (so that queued frees have reached the pool), then returns
    /// cached memory to the device until the pool holds at most `keep_bytes`; the bytes
    /// returned, counting what the synchronisation itself gave back (the pool releases
    /// memory above its release threshold at every synchronisation).
    ///
    /// # Errors
    /// The driver's failure; a sticky error marks the device lost.
    pub fn trim_to(&self, keep_bytes: usize) -> Result<usize, CudaError> {
        // Read before synchronising: the synchronisation may already shrink the pool.
        let before = self.get_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        self.stream.synchronize()?;
        let device = self.stream.device_inner();
        {
            let _current = device.enter("cuMemPoolTrimTo")?;
            // SAFETY: the pool was created by `new` and is destroyed only in `Drop`.
            unsafe { result::mem_pool::trim_to(self.pool.0, keep_bytes) }
                .map_err(|error| device.fail("cuMemPoolTrimTo", CudaErrorCode(error.0 as u32)))?;
        }
        let after = self.get_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        let trimmed = usize::try_from(before.saturating_sub(after)).unwrap_or(usize::MAX);
        tracing::debug!(device = %self.book.key(), trimmed, "trimmed the CUDA pool");
        Ok(trimmed)
    }

    fn get_u64(&self, attribute: sys::CUmemPool_attribute) -> Result<u64, CudaError> {
        let device = self.stream.device_inner();
        let _current = device.enter("cuMemPoolGetAttribute")?;
        let mut value: u64 = 0;
        // SAFETY: the pool is alive (destroyed only in `Drop`); every attribute read
        // here is a cuuint64_t, so `value` is a valid out-pointer of the right type.
        unsafe { result::mem_pool::get_attribute(self.pool.0, attribute, (&raw mut value).cast::<c_void>()) }
            .map_err(|error| device.fail("cuMemPoolGetAttribute", CudaErrorCode(error.0 as u32)))?;
        Ok(value)
    }

    fn set_u64(&self, attribute: sys::CUmemPool_attribute, mut value: u64) -> Result<(), CudaError> {
        let device = self.stream.device_inner();
        let _current = device.enter("cuMemPoolSetAttribute")?;
        // SAFETY: the pool is alive; the attributes set here are cuuint64_t, so `value`
        // points to memory of the right type for the duration of the call.
        unsafe { result::mem_pool::set_attribute(self.pool.0, attribute, (&raw mut value).cast::<c_void>()) }
            .map_err(|error| device.fail("cuMemPoolSetAttribute", CudaErrorCode(error.0 as u32)))
    }

    fn driver_free(&self, base: u64) -> Result<(), CudaError> {
        let device = self.stream.device_inner();
        let _current = device.enter("cuMemFreeAsync")?;
        // SAFETY: `base` came from cuMemAllocFromPoolAsync on this stream and was taken
        // out of the live table, so it is freed at most once; the stream is alive (we
        // hold a clone) and the context is current. The free is ordered after all work
        // queued on the stream, so no queued kernel loses its memory.
        unsafe { result::free_async(base, self.stream.raw()) }
            .map_err(|error| device.fail("cuMemFreeAsync", CudaErrorCode(error.0 as u32)))
    }
}

impl DeviceAllocator for CudaPoolAllocator {
    fn device(&self) -> DeviceKey {
        self.book.key()
    }

    fn name(&self) -> &str {
        "cuda-pool"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let device = self.stream.device_inner();
        self.book.allocate_with(
            device,
            "cuMemAllocFromPoolAsync",
            request,
            |size| {
                let _current = device.enter("cuMemAllocFromPoolAsync")?;
                // SAFETY: pool and stream are alive (owned by `self`) and the context is
                // current. The memory is uninitialised, which is fine for a raw block.
                unsafe { result::mem_pool::alloc_async(self.pool.0, size, self.stream.raw()) }
                    .map_err(|error| device.fail("cuMemAllocFromPoolAsync", CudaErrorCode(error.0 as u32)))
            },
            |base| self.driver_free(base),
            || self.stream.device().memory_info().ok().map(|(free, _)| free),
        )
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.book.release_with(self.stream.device_inner(), self.name(), "cuMemFreeAsync", allocation, |base| {
            self.driver_free(base)
        })
    }

    fn stats(&self) -> Option<AllocatorStats> {
        let mut stats = self.book.counters.snapshot();
        match self.usage() {
            Ok(usage) => stats.cached_bytes = usage.reserved_bytes.saturating_sub(usage.used_bytes),
            Err(error) => tracing::debug!(device = %self.book.key(), "pool attributes unavailable: {error}"),
        }
        Some(stats)
    }

    fn trim(&self) -> usize {
        self.trim_to(0).unwrap_or_else(|error| {
            tracing::warn!(device = %self.book.key(), "trimming the CUDA pool failed: {error}");
            0
        })
    }

    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        let forgotten = self.book.forget(lost);
        tracing::info!(device = %self.book.key(), forgotten, "forgot pool blocks lost with their context");
    }
}

impl Drop for CudaPoolAllocator {
    fn drop(&mut self) {
        let device = self.stream.device_inner();
        let live = self.book.live_blocks();
        if live > 0 {
            tracing::warn!(device = %self.book.key(), live, "dropping a CUDA pool with live blocks: nothing can free them any more, and the driver keeps them (and the pool) until the context goes");
        }
        if let Err(error) = self.stream.synchronize() {
            tracing::warn!(device = %self.book.key(), "synchronising before destroying the pool failed: {error}");
        }
        let Some(_current) = device.enter_to_destroy("cuMemPoolDestroy", "pool") else {
            return;
        };
        // SAFETY: the pool was created by `new` and is destroyed only here. Blocks still
        // allocated from it (warned about above) keep it alive inside the driver, which
        // finishes the destruction once they are freed.
        if let Err(error) = unsafe { result::mem_pool::destroy(self.pool.0) } {
            let error = device.fail("cuMemPoolDestroy", CudaErrorCode(error.0 as u32));
            tracing::warn!(device = %self.book.key(), "destroying the CUDA pool failed: {error}");
        }
    }
}

impl fmt::Debug for CudaPoolAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaPoolAllocator")
            .field("device", &self.book.key())
            .field("live", &self.book.live_blocks())
            .finish_non_exhaustive()
    }
}
