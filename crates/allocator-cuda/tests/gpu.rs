//! Tests on a real CUDA device. Each is `#[ignore]`d with the reason
//! "gpu: ..." so a plain `cargo test` lists it as ignored by name; `cargo xtask test
//! --gpu` runs them with `cargo test -p allocator-cuda -- --ignored gpu_` and fails if
//! none passed. On a machine without a device they fail loudly instead of passing.
//!
//! They avoid touching unmapped or read-only device memory on purpose: on real hardware
//! that can be a sticky fault that would poison the rest of the run. The refusal paths
//! are covered against the fake driver (tests/fake_driver.rs).

mod common;

use allocator_cuda::{
    CudaAllocator, CudaDevice, CudaPoolAllocator, CudaReleaseQueue, CudaStream, CudaVmmAllocator, PinnedHostAllocator,
    PoolConfig, device_count,
};
use common::{CudaAccess, complete, identity, pattern, request};
use memory_api::{
    AllocError, ByteRange, DeferredReleaseQueue, DeviceAllocator, DeviceKey, MappingAccess, PreparedRelease,
    ReleaseOutcome, SharedMapping, SharedPlacement, VirtualBacking,
};
use memory_testkit::conformance::Suite;
use std::sync::{Arc, Mutex};

const MIB: usize = 1 << 20;

fn device() -> CudaDevice {
    CudaDevice::open(0).unwrap_or_else(|e| panic!("the GPU tests need CUDA device 0: {e}"))
}

fn write(device: &CudaDevice, address: memory_api::DeviceAddress, data: &[u8]) {
    // SAFETY: every caller passes a live, committed (or mapped read-write) block it owns
    // and that no device work is using.
    unsafe { device.copy_to_device(address, data) }.unwrap_or_else(|e| panic!("copy to {address}: {e}"));
}

fn read(device: &CudaDevice, address: memory_api::DeviceAddress, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    // SAFETY: as for `write`.
    unsafe { device.copy_from_device(address, &mut out) }.unwrap_or_else(|e| panic!("copy from {address}: {e}"));
    out
}

#[test]
#[ignore = "gpu: needs a CUDA device; run cargo xtask test --gpu"]
fn gpu_probe_sees_a_device() {
    let count = device_count().unwrap_or_else(|e| panic!("probing CUDA failed: {e}"));
    assert!(count >= 1, "the driver reports no CUDA device");
    let device = device();
    let (free, total) = device.memory_info().unwrap();
    assert!(free > 0 && free <= total, "free {free} of {total}");
}

#[test]
#[ignore = "gpu: needs a CUDA device; run cargo xtask test --gpu"]
fn gpu_eager_blocks_are_aligned_hold_data_and_release() {
    let device = device();
    let eager = CudaAllocator::new(&device);
    let mut blocks = Vec::new();
    for align in [1, 256, 4096, 65536, 2 * MIB] {
        let block = eager.allocate(&request(MIB + 17, align)).unwrap();
        assert!(block.address().is_aligned_to(align), "{block:?}");
        let data = pattern(align as u8, block.bytes());
        write(&device, block.address(), &data);
        blocks.push((block, data));
    }
    for (block, data) in blocks {
        assert_eq!(read(&device, block.address(), block.bytes()), data, "{block:?} lost its contents");
        complete(eager.release(block));
    }
    let zero = eager.allocate(&request(0, 256)).unwrap();
    complete(eager.release(zero));
    assert_eq!(eager.stats().unwrap().live_allocations, 0);
}

#[test]
#[ignore = "gpu: needs a CUDA device; run cargo xtask test --gpu"]
fn gpu_eager_out_of_memory_is_a_typed_error_with_the_free_bytes() {
    let device = device();
    let eager = CudaAllocator::new(&device);
    let (_, total) = device.memory_info().unwrap();
    let too_much = total + (1 << 30);
    let error = eager.allocate(&request(too_much, 256)).unwrap_err();
    let AllocError::OutOfMemory { device: key, requested, available, .. } = &error else {
        panic!("asking for {too_much} bytes on a {total}-byte device should be OutOfMemory, got {error:?}")
    };
    assert_eq!((*key, *requested), (DeviceKey::device(0), too_much));
    assert!(available.0.is_some_and(|free| free <= total), "{error}");
    assert!(device.lost().is_none(), "out of memory is not a lost device");
    let block = eager.allocate(&request(4096, 256)).expect("the device still works");
    complete(eager.release(block));
}

#[test]
#[ignore = "gpu: needs a CUDA device; run cargo xtask test --gpu"]
fn gpu_pool_sets_its_threshold_trims_and_reports_cached_bytes() {
    let device = device();
    let stream = CudaStream::new(&device).unwrap();
    let pool = CudaPoolAllocator::new(&stream, PoolConfig::default()).unwrap();
    assert_eq!(pool.release_threshold(), Ok(u64::MAX));
    let blocks: Vec<_> = (0..4).map(|_| pool.allocate(&request(16 * MIB, 256)).unwrap()).collect();
    for block in blocks {
        complete(pool.release(block));
    }
    stream.synchronize().unwrap();
    let usage = pool.usage().unwrap();
    assert_eq!(usage.used_bytes, 0);
    assert!(usage.reserved_bytes >= 64 * MIB as u64, "{usage:?}");
    assert!(pool.stats().unwrap().cached_bytes >= 64 * MIB as u64);
    let trimmed = pool.trim();
    assert!(trimmed >= 64 * MIB, "trim returned {trimmed} bytes of {usage:?}");
    assert_eq!(pool.stats().unwrap().cached_bytes, 0);
    assert_eq!(pool.trim(), 0);
}

#[test]
#[ignore = "gpu: needs a CUDA device; run cargo xtask test --gpu"]
fn gpu_pool_with_a_zero_threshold_keeps_freed_memory_until_a_synchronisation() {
    // The behaviour the fake driver models (tests/driver_failures.rs relies on it):
    // cuMemFreeAsync only returns a block to its pool; memory above the release
    // threshold leaves the pool at the next synchronisation, and trim counts what its
    // own synchronisation hands back.
    let device = device();
    let stream = CudaStream::new(&device).unwrap();
    let pool = CudaPoolAllocator::new(&stream, PoolConfig { release_threshold: 0 }).unwrap();
    complete(pool.release(pool.allocate(&request(64 * MIB, 256)).unwrap()));
    let before = pool.usage().unwrap();
    assert!(before.reserved_bytes >= 64 * MIB as u64, "a stream-ordered free only caches: {before:?}");
    stream.synchronize().unwrap();
    assert_eq!(pool.usage().unwrap().reserved_bytes, 0, "the synchronisation released it");
    complete(pool.release(pool.allocate(&request(64 * MIB, 256)).unwrap()));
    let trimmed = pool.trim();
    assert!(trimmed >= 64 * MIB, "trim returned {trimmed} bytes");
    assert_eq!(pool.usage().unwrap().reserved_bytes, 0);
}

#[test]
#[ignore = "gpu: needs a CUDA device; run cargo xtask test --gpu"]
fn gpu_pool_release_is_ordered_after_a_memset_on_its_stream() {
    let device = device();
    let stream = CudaStream::new(&device).unwrap();
    let pool = CudaPoolAllocator::new(&stream, PoolConfig::default()).unwrap();
    let first = pool.allocate(&request(64 * MIB, 256)).unwrap();
    let address = first.address();
    // SAFETY: the block is ours; its release below is ordered after the fill on the
    // same stream, so it stays allocated until the fill has run.
    unsafe { stream.memset_async(address, 0x5A, 64 * MIB) }.unwrap();
    complete(pool.release(first));
    // Reuse on the same stream is ordered after the fill and the free.
    let second = pool.allocate(&request(64 * MIB, 256)).unwrap();
    stream.synchronize().unwrap();
    if second.address() == address {
        let contents = read(&device, second.address(), 64 * MIB);
        assert!(contents.iter().all(|&b| b == 0x5A), "the fill had not finished when the memory was reused");
    }
    complete(pool.release(second));
    stream.synchronize().unwrap();
    assert_eq!(pool.usage().unwrap().used_bytes, 0);
}

#[test]
#[ignore = "gpu: needs a CUDA device; run cargo xtask test --gpu"]
fn gpu_vmm_commit_and_decommit_with_data_read_back() {
    let device = device();
    let vmm = CudaVmmAllocator::new(&device).unwrap();
    let g = vmm.granularity();
    let block = vmm.allocate(&request(4 * g, g)).unwrap();
    assert_eq!(vmm.committed_bytes(&block), Ok(0));
    assert_eq!(vmm.commit(&block, ByteRange::new(g, 2 * g)), Ok(2 * g));
    assert_eq!(vmm.commit(&block, ByteRange::new(0, 3 * g)), Ok(g));
    let data = pattern(11, 3 * g);
    write(&device, block.address(), &data);
    assert_eq!(read(&device, block.address(), 3 * g), data);
    assert_eq!(vmm.decommit(&block, ByteRange::new(0, g)), Ok(g));
    assert_eq!(vmm.committed_bytes(&block), Ok(2 * g));
    let tail = block.address().checked_add(g).unwrap();
    assert_eq!(read(&device, tail, 2 * g), data[g..], "decommitting one granule kept the others");
    assert_eq!(vmm.commit(&block, ByteRange::new(0, g)), Ok(g));
    assert_eq!(complete(vmm.release(block)), 3 * g);
    assert_eq!(vmm.stats().unwrap().reserved_bytes, 0);
}

#[test]
#[ignore = "gpu: needs a CUDA device; run cargo xtask test --gpu"]
fn gpu_vmm_shared_backing_is_visible_through_every_mapping() {
    let device = device();
    let vmm = CudaVmmAllocator::new(&device).unwrap();
    let g = vmm.granularity();
    let backing = vmm.create_backing(2 * g).unwrap();
    let whole = vmm.allocate(&request(2 * g, g)).unwrap();
    let half = vmm.allocate(&request(g, g)).unwrap();
    let reader = vmm.allocate(&request(2 * g, g)).unwrap();
    let at = |offset, len, backing_offset| SharedPlacement { target: ByteRange::new(offset, len), backing_offset };
    vmm.map(&backing, &whole, at(0, 2 * g, 0), MappingAccess::ReadWrite).unwrap();
    vmm.map(&backing, &half, at(0, g, g), MappingAccess::ReadWrite).unwrap();
    vmm.map(&backing, &reader, at(0, 2 * g, 0), MappingAccess::ReadOnly).unwrap();
    drop(backing);
    let data = pattern(21, g);
    write(&device, whole.address().checked_add(g).unwrap(), &data);
    assert_eq!(read(&device, half.address(), g), data, "not visible at backing offset g");
    assert_eq!(read(&device, reader.address().checked_add(g).unwrap(), g), data, "not visible read-only");
    let data = pattern(22, g);
    write(&device, half.address(), &data);
    assert_eq!(read(&device, whole.address().checked_add(g).unwrap(), g), data);
    assert_eq!(vmm.unmap(&half, ByteRange::new(0, g)), Ok(g));
    for block in [whole, half, reader] {
        complete(vmm.release(block));
    }
}

#[test]
#[ignore = "gpu: needs a CUDA device; run cargo xtask test --gpu"]
fn gpu_pinned_host_memory_is_written_on_the_host_and_copied_to_the_device() {
    let device = device();
    let pinned = PinnedHostAllocator::new(&device);
    let eager = CudaAllocator::new(&device);
    let staging = pinned.allocate(&request(8 * MIB, 4096)).unwrap();
    assert_eq!(staging.device(), DeviceKey::HOST);
    assert!(staging.address().is_aligned_to(4096));
    let data = pattern(31, 8 * MIB);
    let pointer: *mut u8 = std::ptr::with_exposed_provenance_mut(staging.address().get() as usize);
    // SAFETY: the block is 8 MiB of live pinned host memory that we own; the slice is
    // dropped before the block is released.
    let host = unsafe { std::slice::from_raw_parts_mut(pointer, 8 * MIB) };
    host.copy_from_slice(&data);
    let target = eager.allocate(&request(8 * MIB, 256)).unwrap();
    write(&device, target.address(), host);
    assert_eq!(read(&device, target.address(), 8 * MIB), data);
    complete(eager.release(target));
    complete(pinned.release(staging));
}

#[test]
#[ignore = "gpu: needs a CUDA device; run cargo xtask test --gpu"]
fn gpu_release_queue_runs_releases_after_their_stream_work_in_order() {
    let device = device();
    let stream = CudaStream::new(&device).unwrap();
    let pool = Arc::new(CudaPoolAllocator::new(&stream, PoolConfig::default()).unwrap());
    let queue = CudaReleaseQueue::new(&stream, 8);
    let ran = Arc::new(Mutex::new(Vec::new()));
    for index in 0..3 {
        let block = pool.allocate(&request(32 * MIB, 256)).unwrap();
        // SAFETY: the block is ours and is released only after the event recorded
        // behind this fill has completed.
        unsafe { stream.memset_async(block.address(), index as u8, 32 * MIB) }.unwrap();
        let log = Arc::clone(&ran);
        let release = PreparedRelease::new(
            identity(DeviceKey::device(0)),
            pool.clone(),
            block,
            Box::new(move |outcome: ReleaseOutcome| log.lock().unwrap().push((index, outcome.is_complete()))),
        );
        queue.enqueue(release).unwrap();
    }
    assert_eq!(queue.drain(), Ok(3));
    assert_eq!(*ran.lock().unwrap(), vec![(0, true), (1, true), (2, true)]);
    assert_eq!(pool.stats().unwrap().live_allocations, 0);
}

#[test]
#[ignore = "gpu: needs a CUDA device; run cargo xtask test --gpu"]
fn gpu_conformance_of_the_eager_pool_and_pinned_allocators() {
    let device = device();
    let access = CudaAccess { device: device.clone() };
    let stream = CudaStream::new(&device).unwrap();
    let reports = [
        Suite::new(|| CudaAllocator::new(&device)).with_access(&access).run(),
        Suite::new(|| CudaPoolAllocator::new(&stream, PoolConfig::default()).unwrap()).with_access(&access).run(),
        Suite::new(|| PinnedHostAllocator::new(&device)).with_access(&access).run(),
    ];
    for report in &reports {
        eprintln!("{report}");
    }
    for report in reports {
        report.assert_passed();
    }
}

#[test]
#[ignore = "gpu: needs a CUDA device; run cargo xtask test --gpu"]
fn gpu_conformance_of_the_vmm_allocator_without_faulting_accesses() {
    // No MemoryAccess: its checks write to uncommitted and read-only memory on purpose,
    // which real hardware may answer with a sticky fault. The read-back tests above
    // cover committed and shared memory.
    let device = device();
    let report = Suite::new(|| CudaVmmAllocator::new(&device).unwrap()).run();
    eprintln!("{report}");
    report.assert_passed();
    assert!(report.ran("virtual_commit_accounting") && report.ran("shared_map_is_transactional"));
}
