//! `CudaVmmAllocator`: reserved address ranges with physical memory committed on
//! demand (`VirtualBacking`) and physical backings shared between ranges
//! (`SharedMapping`), through the CUDA virtual memory management API.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys;
use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, ByteRange, CapabilityError, DeviceAddress, DeviceAllocator,
    DeviceKey, LayoutError, MappingAccess, RawAllocation, ReleaseError, ReleaseOutcome, SharedBacking,
    SharedBackingResource, SharedMapping, SharedPlacement, VirtualBacking,
};

use crate::device::{CudaDevice, CurrentContext, DeviceInner};
use crate::error::CudaError;
use crate::table::{Counters, LiveTable};

type Handle = sys::CUmemGenericAllocationHandle;

/// Reserve-then-commit device memory with shared physical backings, through the CUDA
/// virtual memory management API.
///
/// # Model
/// An allocation is a reservation (`cuMemAddressReserve`) rounded up to
/// [`CudaVmmAllocator::granularity`]; the returned block reports the rounded size, so
/// every granule of the reservation can be committed through ranges checked against
/// the block. Nothing is committed until asked. Each granule is in one of four states,
/// kept in the allocation's record:
///
/// | state       | meaning                                           | owns physical memory |
/// |-------------|---------------------------------------------------|----------------------|
/// | (absent)    | reserved only                                     | no                   |
/// | committed   | its own `cuMemCreate` handle, mapped read-write   | yes                  |
/// | shared      | a granule of a [`SharedBacking`], mapped           | the backing does     |
/// | detached    | unmapped, but releasing its handle failed         | yes (retried later)  |
///
/// One handle per committed granule makes every decommit exact: CUDA cannot unmap part
/// of a mapping, and a handle's memory only goes back when it is released. Commit
/// refuses granules that are shared, decommit refuses ranges holding shared granules
/// (unmap them with [`SharedMapping::unmap`], which takes both kinds).
///
/// # Teardown
/// Release unmaps and releases granule by granule, then frees the reservation. If a
/// step fails, the record keeps the exact state: the outcome is
/// [`ReleaseOutcome::Quarantined`] with the bytes really returned and the bytes still
/// held, and releasing the block again resumes where the teardown stopped. A failure
/// before anything changed is [`ReleaseOutcome::Failed`]; a sticky error stops the
/// teardown at once (the context is gone).
///
/// # Stats
/// `live_bytes` is the physical memory mapped into live blocks (committed or shared),
/// `reserved_bytes` the address space reserved.
pub struct CudaVmmAllocator {
    device: CudaDevice,
    granularity: usize,
    live: LiveTable<Arc<Mutex<Reservation>>>,
    counters: Counters,
    mapped_bytes: AtomicU64,
    reserved_bytes: AtomicU64,
    /// The provider tag of the last reservation made: each gets the next, so a stale
    /// copy of a released block is told from a later reservation at its address (the
    /// driver hands freed address space out again).
    last_tag: AtomicU64,
}

struct Reservation {
    /// Its provider tag, which a block presented must carry.
    tag: u64,
    base: u64,
    size: usize,
    align: usize,
    granules: BTreeMap<usize, Granule>,
    released: bool,
}

enum Granule {
    Committed(Handle),
    Shared(SharedBacking),
    Detached(Handle),
}

/// What a teardown of some granules did.
#[derive(Default)]
struct Teardown {
    /// Bytes whose physical memory went back (or, for shared granules, was unmapped).
    returned: usize,
    /// Whether any state changed.
    changed: bool,
    /// The first failure.
    error: Option<CudaError>,
    /// Backing clones to drop after the record's lock is released.
    dropped: Vec<SharedBacking>,
}

impl CudaVmmAllocator {
    /// The largest reservation alignment served.
    pub const MAX_ALIGN: usize = 1 << 30;

    /// A VMM allocator on `device`, using the device's minimum allocation granularity.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when the device lacks virtual memory management, or
    /// the driver's failure to report the granularity.
    pub fn new(device: &CudaDevice) -> Result<CudaVmmAllocator, CudaError> {
        let inner = device.inner();
        let supported =
            inner.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)?;
        if supported == 0 {
            return Err(CudaError::Unsupported {
                ordinal: inner.ordinal(),
                feature: "virtual memory management (cuMemAddressReserve / cuMemMap)",
            });
        }
        let prop = allocation_prop(inner);
        let mut granularity = 0usize;
        {
            let _current = inner.enter("cuMemGetAllocationGranularity")?;
            let option = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
            // SAFETY: `granularity` is a valid out-pointer for one size_t and `prop` a
            // fully initialised allocation property that outlives the call.
            let result = unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, option) };
            inner.call("cuMemGetAllocationGranularity", result)?;
        }
        if !granularity.is_power_of_two() {
            return Err(CudaError::Driver {
                operation: "cuMemGetAllocationGranularity",
                code: crate::CudaErrorCode::ERROR_INVALID_VALUE,
            });
        }
        Ok(CudaVmmAllocator {
            device: device.clone(),
            granularity,
            live: LiveTable::new(),
            counters: Counters::default(),
            mapped_bytes: AtomicU64::new(0),
            reserved_bytes: AtomicU64::new(0),
            last_tag: AtomicU64::new(0),
        })
    }

    /// The commit and mapping granularity in bytes.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// The device handle.
    pub fn cuda_device(&self) -> &CudaDevice {
        &self.device
    }

    fn key(&self) -> DeviceKey {
        self.device.key()
    }

    /// The record of `allocation`, if this allocator made exactly that block and has
    /// not finished releasing it.
    fn reservation(&self, allocation: &RawAllocation) -> Option<Arc<Mutex<Reservation>>> {
        if allocation.device() != self.key() {
            return None;
        }
        self.live.with(allocation.address().get(), Arc::clone).filter(|record| {
            let record = lock(record);
            !record.released
                && record.tag == allocation.provider_tag()
                && record.size == allocation.bytes()
                && record.align == allocation.align()
        })
    }

    fn not_owned(&self, allocation: &RawAllocation) -> CapabilityError {
        CapabilityError::NotOwned { allocator: self.describe(), address: allocation.address().get() }
    }

    fn describe(&self) -> String {
        format!("cuda-vmm on {}", self.key())
    }

    /// Validates a range of `allocation` and finds its record.
    fn checked(
        &self,
        allocation: &RawAllocation,
        range: ByteRange,
    ) -> Result<Arc<Mutex<Reservation>>, CapabilityError> {
        range.check_within(allocation.bytes())?;
        range.check_aligned(self.granularity)?;
        self.reservation(allocation).ok_or_else(|| self.not_owned(allocation))
    }

    fn granules(&self, range: ByteRange) -> std::ops::Range<usize> {
        let first = range.offset() / self.granularity;
        first..first + range.len() / self.granularity
    }

    fn granule_address(&self, record: &Reservation, index: usize) -> u64 {
        record.base + (index * self.granularity) as u64
    }

    fn unmap_granule(
        &self,
        device: &DeviceInner,
        _current: &CurrentContext<'_>,
        address: u64,
    ) -> Result<(), CudaError> {
        // SAFETY: `address` starts a granule of a live reservation that this allocator
        // mapped with exactly one cuMemMap of `granularity` bytes, so the range is one
        // whole mapping; the context is current (proved by `_current`).
        device.call("cuMemUnmap", unsafe { sys::cuMemUnmap(address, self.granularity) })
    }

    fn release_handle(
        &self,
        device: &DeviceInner,
        _current: &CurrentContext<'_>,
        handle: Handle,
    ) -> Result<(), CudaError> {
        // SAFETY: `handle` came from cuMemCreate and is released at most once: the
        // granule holding it is removed from the record when this succeeds.
        device.call("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
    }

    fn set_access(
        &self,
        device: &DeviceInner,
        _current: &CurrentContext<'_>,
        address: u64,
        bytes: usize,
        access: MappingAccess,
    ) -> Result<(), CudaError> {
        let desc = access_desc(device, access);
        // SAFETY: `address .. address + bytes` is fully mapped by this allocator (the
        // caller mapped every granule of it just before); `desc` is one initialised
        // descriptor that outlives the call; the context is current.
        device.call("cuMemSetAccess", unsafe { sys::cuMemSetAccess(address, bytes, &desc, 1) })
    }

    /// Maps `handle` at granule `index` (read-write) and records it as committed.
    fn commit_granule(
        &self,
        device: &DeviceInner,
        current: &CurrentContext<'_>,
        record: &mut Reservation,
        index: usize,
        handle: Handle,
    ) -> Result<(), CudaError> {
        let address = self.granule_address(record, index);
        // SAFETY: `address` starts an unmapped granule of a live reservation, `handle`
        // is a live cuMemCreate handle of at least `granularity` bytes, offset 0 is
        // inside it, and flags must be 0; the context is current.
        let mapped = device.call("cuMemMap", unsafe { sys::cuMemMap(address, self.granularity, 0, handle, 0) });
        if let Err(error) = mapped {
            // Not mapped: the handle is still ours, either released now or kept.
            if self.release_handle(device, current, handle).is_err() {
                record.granules.insert(index, Granule::Detached(handle));
            }
            return Err(error);
        }
        record.granules.insert(index, Granule::Committed(handle));
        self.mapped_bytes.fetch_add(self.granularity as u64, Ordering::Relaxed);
        self.set_access(device, current, address, self.granularity, MappingAccess::ReadWrite)
    }

    /// Tears down the granules of `indices` that are mapped or detached.
    fn teardown(
        &self,
        device: &DeviceInner,
        current: &CurrentContext<'_>,
        record: &mut Reservation,
        indices: std::ops::Range<usize>,
    ) -> Teardown {
        let mut done = Teardown::default();
        let present: Vec<usize> = record.granules.range(indices).map(|(&index, _)| index).collect();
        for index in present {
            let address = self.granule_address(record, index);
            let step = match record.granules.remove(&index) {
                Some(Granule::Committed(handle)) => match self.unmap_granule(device, current, address) {
                    Err(error) => {
                        record.granules.insert(index, Granule::Committed(handle));
                        Err(error)
                    }
                    Ok(()) => {
                        done.changed = true;
                        self.mapped_bytes.fetch_sub(self.granularity as u64, Ordering::Relaxed);
                        self.release_handle(device, current, handle).inspect_err(|_| {
                            record.granules.insert(index, Granule::Detached(handle));
                        })
                    }
                },
                Some(Granule::Detached(handle)) => self.release_handle(device, current, handle).inspect_err(|_| {
                    record.granules.insert(index, Granule::Detached(handle));
                }),
                Some(Granule::Shared(backing)) => match self.unmap_granule(device, current, address) {
                    Err(error) => {
                        record.granules.insert(index, Granule::Shared(backing));
                        Err(error)
                    }
                    Ok(()) => {
                        self.mapped_bytes.fetch_sub(self.granularity as u64, Ordering::Relaxed);
                        done.dropped.push(backing);
                        Ok(())
                    }
                },
                None => Ok(()),
            };
            match step {
                Ok(()) => {
                    done.changed = true;
                    done.returned += self.granularity;
                }
                Err(error) => {
                    let sticky = error.is_device_lost();
                    done.error.get_or_insert(error);
                    if sticky {
                        // The context is gone: every further call would fail the same way.
                        break;
                    }
                }
            }
        }
        done
    }

    fn held_bytes(&self, record: &Reservation) -> usize {
        record.granules.len() * self.granularity
    }

    fn mapped_in(&self, record: &Reservation) -> usize {
        let mapped = record.granules.values().filter(|granule| !matches!(granule, Granule::Detached(_))).count();
        mapped * self.granularity
    }

    fn release_reservation(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let key = self.key();
        let Some(shared) = self.reservation(&allocation) else {
            let error =
                ReleaseError::NotOwned { allocator: self.describe(), device: key, address: allocation.address().get() };
            return ReleaseOutcome::failed(allocation, error);
        };
        let device = self.device.inner();
        let current = match device.enter("cuMemUnmap") {
            Ok(current) => current,
            Err(error) => return ReleaseOutcome::failed(allocation, error.into_release(key)),
        };
        let mut record = lock(&shared);
        let granules = record.size / self.granularity;
        let done = self.teardown(device, &current, &mut record, 0..granules);
        let (returned, changed) = (done.returned, done.changed);
        let mut error = done.error;
        if error.is_none() {
            // SAFETY: `base .. base + size` is exactly the range cuMemAddressReserve
            // returned, nothing in it is mapped any more (the teardown emptied the
            // record), and it is freed once: the record is marked released below.
            let freed = device.call("cuMemAddressFree", unsafe { sys::cuMemAddressFree(record.base, record.size) });
            match freed {
                Ok(()) => {
                    record.released = true;
                    let (base, size) = (record.base, record.size);
                    drop(record);
                    drop(current);
                    self.live.remove_if(base, |stored| Arc::ptr_eq(stored, &shared));
                    self.counters.released(0);
                    self.reserved_bytes.fetch_sub(size as u64, Ordering::Relaxed);
                    drop(done.dropped);
                    tracing::trace!(device = %key, address = base, returned, "released a VMM reservation");
                    // Granules beyond the block are the allocator's rounding: Complete never
                    // claims more than the block.
                    return ReleaseOutcome::complete(returned.min(allocation.bytes()));
                }
                Err(failure) => error = Some(failure),
            }
        }
        let residual = self.held_bytes(&record);
        drop(record);
        drop(current);
        drop(done.dropped);
        let error = error.map_or(ReleaseError::Abandoned, |error| error.into_release(key));
        if changed {
            tracing::warn!(device = %key, returned, residual, "VMM teardown stopped partway; the block is quarantined: {error}");
            ReleaseOutcome::quarantined(allocation, returned, residual, error)
        } else {
            tracing::warn!(device = %key, "VMM release failed before changing anything: {error}");
            ReleaseOutcome::failed(allocation, error)
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Records are only mutated by this module's code, which updates each granule
    // before moving on, so a record is consistent even if a panic poisoned its lock.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn allocation_prop(device: &DeviceInner) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device.raw_device(),
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

fn access_desc(device: &DeviceInner, access: MappingAccess) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device.raw_device(),
        },
        flags: match access {
            MappingAccess::ReadOnly => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
            MappingAccess::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        },
    }
}

impl DeviceAllocator for CudaVmmAllocator {
    fn device(&self) -> DeviceKey {
        self.key()
    }

    fn name(&self) -> &str {
        "cuda-vmm"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let key = self.key();
        let align = request.align();
        if align > Self::MAX_ALIGN {
            self.counters.failed();
            return Err(LayoutError::AlignmentTooLarge { align, max: Self::MAX_ALIGN, device: key }.into());
        }
        let Some(size) = request.bytes().max(1).checked_next_multiple_of(self.granularity) else {
            self.counters.failed();
            return Err(
                LayoutError::SizeOverflow { bytes: request.bytes(), align, max: AllocationRequest::MAX_BYTES }.into()
            );
        };
        let device = self.device.inner();
        let reserved = (|| {
            let _current = device.enter("cuMemAddressReserve")?;
            let mut base: sys::CUdeviceptr = 0;
            // SAFETY: `base` is a valid out-pointer; size is a non-zero multiple of the
            // granularity and the alignment a power of two no smaller than it; a zero
            // fixed address and zero flags ask the driver to choose; the context is current.
            let result = unsafe { sys::cuMemAddressReserve(&mut base, size, align.max(self.granularity), 0, 0) };
            device.call("cuMemAddressReserve", result)?;
            Ok::<_, CudaError>(base)
        })();
        let base = match reserved {
            Ok(base) => base,
            Err(error) => {
                self.counters.failed();
                return Err(error.into_alloc(key, request.bytes(), align, None));
            }
        };
        let Some(address) = DeviceAddress::new(base).filter(|address| address.is_aligned_to(align)) else {
            self.counters.failed();
            let freed = device.enter("cuMemAddressFree").and_then(|_current| {
                // SAFETY: the range is exactly what cuMemAddressReserve just returned and
                // nothing is mapped in it; it is freed once, here.
                device.call("cuMemAddressFree", unsafe { sys::cuMemAddressFree(base, size) })
            });
            if let Err(error) = freed {
                tracing::warn!(device = %key, "freeing a misaligned reservation failed: {error}");
            }
            return Err(AllocError::Backend {
                device: key,
                source: memory_api::BackendError {
                    backend: crate::BACKEND,
                    operation: "cuMemAddressReserve",
                    code: 0,
                    detail: format!("the driver reserved {base:#x}, not aligned to {align}; report this driver bug"),
                },
            });
        };
        let tag = self.last_tag.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        let record = Reservation { tag, base, size, align, granules: BTreeMap::new(), released: false };
        self.live.insert(base, Arc::new(Mutex::new(record)));
        self.counters.allocated(0);
        self.reserved_bytes.fetch_add(size as u64, Ordering::Relaxed);
        tracing::trace!(device = %key, address = base, size, "reserved a VMM range");
        Ok(RawAllocation::new(address, size, align, key, tag))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.release_reservation(allocation)
    }

    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        Some(self)
    }

    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        Some(self)
    }

    fn stats(&self) -> Option<AllocatorStats> {
        let mut stats = self.counters.snapshot();
        stats.live_bytes = self.mapped_bytes.load(Ordering::Relaxed);
        stats.reserved_bytes = self.reserved_bytes.load(Ordering::Relaxed);
        Some(stats)
    }

    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        let mut forgotten = 0;
        for allocation in lost {
            let Some(shared) = self.reservation(&allocation) else { continue };
            let mut record = lock(&shared);
            record.released = true;
            let mapped = self.mapped_in(&record);
            let dropped: Vec<Granule> = std::mem::take(&mut record.granules).into_values().collect();
            let (base, size) = (record.base, record.size);
            drop(record);
            self.live.remove_if(base, |stored| Arc::ptr_eq(stored, &shared));
            self.mapped_bytes.fetch_sub(mapped as u64, Ordering::Relaxed);
            self.reserved_bytes.fetch_sub(size as u64, Ordering::Relaxed);
            self.counters.released(0);
            // Shared backings dropped here skip their driver release: the device is lost.
            drop(dropped);
            forgotten += 1;
        }
        tracing::info!(device = %self.key(), forgotten, "forgot VMM reservations lost with their context");
    }
}

impl VirtualBacking for CudaVmmAllocator {
    fn granularity(&self) -> usize {
        self.granularity
    }

    fn commit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        let key = self.key();
        let shared = self.checked(allocation, range)?;
        let mut record = lock(&shared);
        if record.released {
            return Err(self.not_owned(allocation));
        }
        let indices = self.granules(range);
        if let Some((&index, _)) =
            record.granules.range(indices.clone()).find(|(_, granule)| matches!(granule, Granule::Shared(_)))
        {
            return Err(CapabilityError::AlreadyMapped { offset: index * self.granularity, len: self.granularity });
        }
        if range.is_empty() {
            return Ok(0);
        }
        let device = self.device.inner();
        let current = device.enter("cuMemCreate").map_err(|error| error.into_capability(key, range.len()))?;
        let prop = allocation_prop(device);
        let mut fresh = Vec::new();
        let mut failure = None;
        for index in indices {
            let handle = match record.granules.get(&index) {
                Some(Granule::Committed(_)) | Some(Granule::Shared(_)) => continue,
                Some(Granule::Detached(handle)) => {
                    // Unmapped but still owned: map the same physical memory again.
                    let handle = *handle;
                    record.granules.remove(&index);
                    handle
                }
                None => {
                    let mut handle: Handle = 0;
                    // SAFETY: `handle` is a valid out-pointer, the size is one granule (a
                    // multiple of the granularity), `prop` is initialised and outlives the
                    // call, flags must be 0; the context is current.
                    let created = unsafe { sys::cuMemCreate(&mut handle, self.granularity, &prop, 0) };
                    if let Err(error) = device.call("cuMemCreate", created) {
                        failure = Some(error);
                        break;
                    }
                    handle
                }
            };
            fresh.push(index);
            if let Err(error) = self.commit_granule(device, &current, &mut record, index, handle) {
                failure = Some(error);
                break;
            }
        }
        let Some(error) = failure else {
            return Ok(fresh.len() * self.granularity);
        };
        // Transactional: undo this call's commits. A granule whose undo fails stays in
        // the record (and in `committed_bytes`), so the books stay exact.
        for index in fresh {
            let undone = self.teardown(device, &current, &mut record, index..index + 1);
            if let Some(undo_error) = undone.error {
                tracing::error!(device = %key, index, "undoing a failed commit failed: {undo_error}");
            }
        }
        Err(error.into_capability(key, range.len()))
    }

    fn decommit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        let key = self.key();
        let shared = self.checked(allocation, range)?;
        let mut record = lock(&shared);
        if record.released {
            return Err(self.not_owned(allocation));
        }
        let indices = self.granules(range);
        if let Some((&index, _)) =
            record.granules.range(indices.clone()).find(|(_, granule)| matches!(granule, Granule::Shared(_)))
        {
            return Err(CapabilityError::AlreadyMapped { offset: index * self.granularity, len: self.granularity });
        }
        if record.granules.range(indices.clone()).next().is_none() {
            return Ok(0);
        }
        let device = self.device.inner();
        let current = device.enter("cuMemUnmap").map_err(|error| error.into_capability(key, range.len()))?;
        let done = self.teardown(device, &current, &mut record, indices);
        drop(record);
        drop(current);
        drop(done.dropped);
        match done.error {
            None => Ok(done.returned),
            Some(error) => Err(error.into_capability(key, range.len())),
        }
    }

    fn committed_bytes(&self, allocation: &RawAllocation) -> Result<usize, CapabilityError> {
        let shared = self.reservation(allocation).ok_or_else(|| self.not_owned(allocation))?;
        let record = lock(&shared);
        Ok(self.mapped_in(&record))
    }
}

/// The physical memory behind a [`SharedBacking`] made by [`CudaVmmAllocator`]: one
/// `cuMemCreate` handle, released when the last backing clone and the last mapping of
/// it are gone.
pub struct CudaPhysicalBacking {
    device: CudaDevice,
    handle: Handle,
    bytes: usize,
}

impl fmt::Debug for CudaPhysicalBacking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaPhysicalBacking")
            .field("device", &self.device.ordinal())
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl SharedBackingResource for CudaPhysicalBacking {
    fn bytes(&self) -> usize {
        self.bytes
    }
}

impl CudaPhysicalBacking {
    /// The device the physical memory lives on.
    pub fn cuda_device(&self) -> &CudaDevice {
        &self.device
    }
}

impl Drop for CudaPhysicalBacking {
    fn drop(&mut self) {
        let device = self.device.inner();
        let Some(_current) = device.enter_to_destroy("cuMemRelease", "shared backing") else {
            return;
        };
        // SAFETY: the handle came from cuMemCreate in `create_backing` and this is its
        // only owner; mappings still using it keep the memory alive until unmapped.
        if let Err(error) = device.call("cuMemRelease", unsafe { sys::cuMemRelease(self.handle) }) {
            tracing::warn!(
                ordinal = device.ordinal(),
                bytes = self.bytes,
                "releasing a shared backing failed: {error}"
            );
        }
    }
}

impl SharedMapping for CudaVmmAllocator {
    fn granularity(&self) -> usize {
        self.granularity
    }

    fn create_backing(&self, bytes: usize) -> Result<SharedBacking, CapabilityError> {
        let key = self.key();
        if bytes == 0 || !bytes.is_multiple_of(self.granularity) {
            return Err(CapabilityError::Misaligned { offset: 0, len: bytes, granularity: self.granularity });
        }
        let device = self.device.inner();
        let handle = (|| {
            let _current = device.enter("cuMemCreate")?;
            let prop = allocation_prop(device);
            let mut handle: Handle = 0;
            // SAFETY: `handle` is a valid out-pointer, `bytes` a non-zero multiple of the
            // granularity, `prop` initialised and outliving the call, flags 0; the
            // context is current. `CudaPhysicalBacking` releases the handle.
            device.call("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, bytes, &prop, 0) })?;
            Ok(handle)
        })()
        .map_err(|error: CudaError| error.into_capability(key, bytes))?;
        tracing::debug!(device = %key, bytes, "created a shared CUDA backing");
        Ok(SharedBacking::new(key, Arc::new(CudaPhysicalBacking { device: self.device.clone(), handle, bytes })))
    }

    fn map(
        &self,
        backing: &SharedBacking,
        allocation: &RawAllocation,
        placement: SharedPlacement,
        access: MappingAccess,
    ) -> Result<(), CapabilityError> {
        let key = self.key();
        let Some(physical) = backing.resource::<CudaPhysicalBacking>() else {
            return Err(CapabilityError::ForeignBacking {
                found: format!("a backing on {} made by another kind of allocator", backing.device()),
                expected: self.describe(),
            });
        };
        if backing.device() != key || physical.device.ordinal() != self.device.ordinal() {
            return Err(CapabilityError::ForeignBacking {
                found: format!("cuda-vmm on {}", backing.device()),
                expected: self.describe(),
            });
        }
        let target = placement.target;
        ByteRange::new(placement.backing_offset, target.len()).check_within_backing(backing.bytes())?;
        ByteRange::new(placement.backing_offset, target.len()).check_aligned(self.granularity)?;
        let shared = self.checked(allocation, target)?;
        let mut record = lock(&shared);
        if record.released {
            return Err(self.not_owned(allocation));
        }
        let indices = self.granules(target);
        if let Some((&index, _)) = record.granules.range(indices.clone()).next() {
            return Err(CapabilityError::AlreadyMapped { offset: index * self.granularity, len: self.granularity });
        }
        if target.is_empty() {
            return Ok(());
        }
        let device = self.device.inner();
        let current = device.enter("cuMemMap").map_err(|error| error.into_capability(key, target.len()))?;
        let mut failure = None;
        for (step, index) in indices.clone().enumerate() {
            let address = self.granule_address(&record, index);
            let offset = placement.backing_offset + step * self.granularity;
            // SAFETY: `address` starts an unmapped granule of a live reservation;
            // `offset .. offset + granularity` lies inside the backing's handle (checked
            // above) and is granularity-aligned; the handle is alive (the backing holds
            // it); flags 0; the context is current.
            let result = unsafe { sys::cuMemMap(address, self.granularity, offset, physical.handle, 0) };
            if let Err(error) = device.call("cuMemMap", result) {
                failure = Some(error);
                break;
            }
            record.granules.insert(index, Granule::Shared(backing.clone()));
            self.mapped_bytes.fetch_add(self.granularity as u64, Ordering::Relaxed);
        }
        if failure.is_none() {
            let address = self.granule_address(&record, indices.start);
            match self.set_access(device, &current, address, target.len(), access) {
                Ok(()) => return Ok(()),
                Err(error) => failure = Some(error),
            }
        }
        // Transactional: unmap what this call mapped.
        let undone = self.teardown(device, &current, &mut record, indices);
        if let Some(undo_error) = undone.error {
            tracing::error!(device = %key, "undoing a failed shared mapping failed: {undo_error}");
        }
        drop(record);
        drop(current);
        drop(undone.dropped);
        Err(failure.map_or_else(|| self.not_owned(allocation), |error| error.into_capability(key, target.len())))
    }

    fn unmap(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        let key = self.key();
        let shared = self.checked(allocation, range)?;
        let mut record = lock(&shared);
        if record.released {
            return Err(self.not_owned(allocation));
        }
        let indices = self.granules(range);
        if record.granules.range(indices.clone()).next().is_none() {
            return Ok(0);
        }
        let device = self.device.inner();
        let current = device.enter("cuMemUnmap").map_err(|error| error.into_capability(key, range.len()))?;
        let done = self.teardown(device, &current, &mut record, indices);
        drop(record);
        drop(current);
        drop(done.dropped);
        match done.error {
            None => Ok(done.returned),
            Some(error) => Err(error.into_capability(key, range.len())),
        }
    }
}

impl fmt::Debug for CudaVmmAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaVmmAllocator")
            .field("device", &self.device)
            .field("granularity", &self.granularity)
            .field("live", &self.live.len())
            .finish()
    }
}
