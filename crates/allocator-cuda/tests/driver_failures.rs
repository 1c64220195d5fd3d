//! Every driver entry point allocator-cuda calls, failing.
//!
//! For each of [`allocator_cuda::REQUIRED_SYMBOLS`] the fake driver returns an injected
//! error (or a fault that surfaces later, as sticky errors do on real drivers), and the
//! test checks what the crate promises for that path: the typed error, a quarantine, or
//! the device-loss mapping, and that nothing leaks or is freed twice (the fake counts
//! frees of things that are not live). A failure no caller can be told about (a
//! destructor's) must at least be logged, and is checked through the log.
//! `every_driver_entry_point_is_injected_by_a_test` keeps the list complete.
#![cfg(target_os = "linux")]

#[macro_use]
mod common;

use crate::common::fake::control;
use crate::common::logs::capture;
use crate::common::{complete, failed, identity, request};
use allocator_cuda::{
    CudaAllocator, CudaDevice, CudaError, CudaErrorCode, CudaPoolAllocator, CudaReleaseQueue, CudaStream,
    CudaVmmAllocator, PinnedHostAllocator, PoolConfig,
};
use memory_api::{
    AllocError, ByteRange, CapabilityError, DeferredReleaseQueue, DeviceAllocator, DeviceKey, MappingAccess,
    MaybeBytes, PreparedRelease, QueueRefusalReason, RawAllocation, ReleaseError, ReleaseOutcome, SharedMapping,
    SharedPlacement, VirtualBacking,
};
use std::sync::{Arc, Mutex};
use tracing::Level;

const MIB: usize = 1 << 20;
/// The fake's VMM granularity.
const G: usize = 2 * MIB;
const GPU0: DeviceKey = DeviceKey::device(0);

/// What every test checks at its end: the injected failure of `function` was really
/// returned `times` times, nothing was freed, released or destroyed twice, and the
/// caller's context stack is as it was.
#[track_caller]
fn injected_and_clean(function: &str, times: u64) {
    assert_eq!(control::injected(function), times, "injected failures of {function} returned");
    assert_eq!(control::invalid_frees(), 0, "nothing was freed, released or destroyed twice");
    assert_eq!(control::context_depth(), 0, "the caller's context stack is as it was");
}

fn device() -> CudaDevice {
    CudaDevice::open(0).expect("the fake has device 0")
}

fn pool_on(device: &CudaDevice, config: PoolConfig) -> CudaPoolAllocator {
    let stream = CudaStream::new(device).expect("a stream");
    CudaPoolAllocator::new(&stream, config).expect("a pool")
}

/// The backend error inside a failed release.
#[track_caller]
fn release_backend(error: &ReleaseError) -> (&'static str, i64) {
    match error {
        ReleaseError::Backend(source) => (source.operation, source.code),
        other => panic!("expected a backend release error, got {other:?}"),
    }
}

/// The backend error inside a capability error.
#[track_caller]
fn capability_backend(error: &CapabilityError) -> (&'static str, i64) {
    match error {
        CapabilityError::Backend(source) => (source.operation, source.code),
        other => panic!("expected a backend capability error, got {other:?}"),
    }
}

mod device_and_context {
    use super::*;
    use allocator_cuda::device_count;

    fake_test! {
        fn a_failing_device_count_is_a_typed_driver_error() {
            control::inject("cuDeviceGetCount", 0, 2, CudaErrorCode::ERROR_UNKNOWN);
            let expected = CudaError::Driver { operation: "cuDeviceGetCount", code: CudaErrorCode::ERROR_UNKNOWN };
            assert_eq!(device_count(), Err(expected.clone()));
            assert_eq!(CudaDevice::open(0).unwrap_err(), expected, "open counts first");
            assert_eq!(control::primary_retains(0), 0);
            assert_eq!(device_count(), Ok(1), "the next call works");
            injected_and_clean("cuDeviceGetCount", 2);
        }
    }

    fake_test! {
        fn a_failing_device_lookup_opens_nothing() {
            control::inject("cuDeviceGet", 0, 1, CudaErrorCode::ERROR_INVALID_DEVICE);
            let error = CudaDevice::open(0).unwrap_err();
            assert_eq!(error, CudaError::Driver { operation: "cuDeviceGet", code: CudaErrorCode::ERROR_INVALID_DEVICE });
            assert_eq!((control::calls("cuDevicePrimaryCtxRetain"), control::primary_retains(0)), (0, 0));
            drop(device());
            injected_and_clean("cuDeviceGet", 1);
        }
    }

    fake_test! {
        fn a_failing_attribute_query_creates_no_pool_and_no_vmm_allocator() {
            let device = device();
            let stream = CudaStream::new(&device).unwrap();
            control::inject("cuDeviceGetAttribute", 0, 2, CudaErrorCode::ERROR_INVALID_DEVICE);
            let expected =
                CudaError::Driver { operation: "cuDeviceGetAttribute", code: CudaErrorCode::ERROR_INVALID_DEVICE };
            assert_eq!(CudaPoolAllocator::new(&stream, PoolConfig::default()).unwrap_err(), expected);
            assert_eq!(CudaVmmAllocator::new(&device).unwrap_err(), expected);
            assert_eq!((control::calls("cuMemPoolCreate"), control::live_pools()), (0, 0));
            assert_eq!(control::calls("cuMemGetAllocationGranularity"), 0);
            assert!(device.lost().is_none());
            injected_and_clean("cuDeviceGetAttribute", 2);
        }
    }

    fake_test! {
        fn a_failing_primary_context_retain_opens_nothing() {
            control::inject("cuDevicePrimaryCtxRetain", 0, 1, CudaErrorCode::ERROR_OUT_OF_MEMORY);
            let error = CudaDevice::open(0).unwrap_err();
            assert!(matches!(error, CudaError::OutOfMemory { operation: "cuDevicePrimaryCtxRetain", .. }), "{error:?}");
            control::inject("cuDevicePrimaryCtxRetain", 0, 1, CudaErrorCode::ERROR_ECC_UNCORRECTABLE);
            let error = CudaDevice::open(0).unwrap_err();
            assert!(
                matches!(error, CudaError::DeviceLost { ordinal: 0, operation: "cuDevicePrimaryCtxRetain", .. }),
                "a sticky answer tells the runtime to invalidate the device: {error:?}"
            );
            assert_eq!(control::primary_retains(0), 0);
            let device = device();
            assert!(device.lost().is_none(), "a failed open leaves nothing behind that later opens inherit");
            drop(device);
            assert_eq!(control::primary_retains(0), 0);
            injected_and_clean("cuDevicePrimaryCtxRetain", 2);
        }
    }

    fake_test! {
        fn a_refused_primary_context_release_is_logged_and_not_repeated() {
            let device = device();
            let clone = device.clone();
            control::inject("cuDevicePrimaryCtxRelease_v2", 0, 1, CudaErrorCode::ERROR_INVALID_CONTEXT);
            drop(device);
            let ((), logs) = capture(|| drop(clone));
            assert!(logs.has(Level::WARN, &["releasing the primary context failed", "CUDA_ERROR_INVALID_CONTEXT"]), "{:?}", logs.all());
            assert_eq!(control::calls("cuDevicePrimaryCtxRelease_v2"), 1, "one release for the one retain");
            assert_eq!(control::primary_retains(0), 1, "the driver kept the retain it refused to release");
            injected_and_clean("cuDevicePrimaryCtxRelease_v2", 1);
        }
    }

    fake_test! {
        fn a_failed_context_push_in_every_release_path_hands_the_block_back() {
            let device = device();
            let eager = CudaAllocator::new(&device);
            let pinned = PinnedHostAllocator::new(&device);
            let pool = pool_on(&device, PoolConfig::default());
            let vmm = CudaVmmAllocator::new(&device).unwrap();
            let allocators: [&dyn DeviceAllocator; 4] = [&eager, &pinned, &pool, &vmm];
            for allocator in allocators {
                let block = allocator.allocate(&request(4096, 256)).unwrap();
                let copy = RawAllocation::new(block.address(), block.bytes(), block.align(), block.device(), block.provider_tag());
                control::inject("cuCtxPushCurrent_v2", 0, 1, CudaErrorCode::ERROR_INVALID_CONTEXT);
                let (back, error) = failed(allocator.release(block));
                assert!(back.same_block(&copy), "{}: the very block comes back", allocator.name());
                assert_eq!(release_backend(&error), ("cuCtxPushCurrent_v2", 201), "{}", allocator.name());
                assert_eq!(allocator.stats().unwrap().live_allocations, 1, "{}: still owned", allocator.name());
                complete(allocator.release(back));
                assert_eq!(allocator.stats().unwrap().live_allocations, 0);
            }
            assert_eq!(control::calls("cuMemFree_v2") + control::calls("cuMemFreeHost"), 2);
            assert_eq!((control::live_host_blocks(), control::live_reservations()), (0, 0));
            assert!(device.lost().is_none());
            injected_and_clean("cuCtxPushCurrent_v2", 4);
        }
    }

    fake_test! {
        fn a_failed_context_push_in_every_capability_path_is_typed_and_changes_nothing() {
            let device = device();
            let vmm = CudaVmmAllocator::new(&device).unwrap();
            let block = vmm.allocate(&request(2 * G, G)).unwrap();
            let backing = vmm.create_backing(G).unwrap();
            vmm.commit(&block, ByteRange::new(0, G)).unwrap();
            let place = SharedPlacement { target: ByteRange::new(G, G), backing_offset: 0 };
            let push_failed = |error: CapabilityError| assert_eq!(capability_backend(&error), ("cuCtxPushCurrent_v2", 201));
            control::inject("cuCtxPushCurrent_v2", 0, 6, CudaErrorCode::ERROR_INVALID_CONTEXT);
            push_failed(vmm.commit(&block, ByteRange::new(G, G)).unwrap_err());
            push_failed(vmm.decommit(&block, ByteRange::new(0, G)).unwrap_err());
            push_failed(vmm.map(&backing, &block, place, MappingAccess::ReadWrite).unwrap_err());
            push_failed(vmm.unmap(&block, ByteRange::new(0, G)).unwrap_err());
            push_failed(vmm.create_backing(G).unwrap_err());
            let allocate = vmm.allocate(&request(G, G)).unwrap_err();
            assert!(matches!(allocate, AllocError::Backend { ref source, .. } if source.operation == "cuCtxPushCurrent_v2"), "{allocate:?}");
            assert_eq!(vmm.committed_bytes(&block), Ok(G), "nothing changed");
            assert_eq!((control::live_handles(), control::live_mappings(), control::live_reservations()), (2, 1, 1));
            assert_eq!(vmm.stats().unwrap().failures_total, 1);
            complete(vmm.release(block));
            drop(backing);
            assert_eq!((control::live_handles(), control::used_bytes()), (0, 0));
            injected_and_clean("cuCtxPushCurrent_v2", 6);
        }
    }

    fake_test! {
        fn a_failed_context_push_when_a_resource_is_destroyed_is_logged_as_a_leak() {
            // A destructor cannot return an error: the leak must at least be reported,
            // and not as "the context is gone" while the device is healthy.
            let device = device();
            let stream = CudaStream::new(&device).unwrap();
            let pool = pool_on(&device, PoolConfig::default());
            let vmm = CudaVmmAllocator::new(&device).unwrap();
            let backing = vmm.create_backing(G).unwrap();
            let queue = CudaReleaseQueue::new(&stream, 2);
            let eager = Arc::new(CudaAllocator::new(&device));
            let block = eager.allocate(&request(64, 8)).unwrap();
            queue.enqueue(PreparedRelease::new(identity(GPU0), eager, block, Box::new(|_| {}))).unwrap();
            assert_eq!(queue.poll(), Ok(1), "the queue now keeps a spare event");
            type Destroy = Box<dyn FnOnce()>;
            let cases: [(&str, Destroy); 4] = [
                ("event", Box::new(move || drop(queue))),
                ("stream", Box::new(move || drop(stream))),
                ("pool", Box::new(move || drop(pool))),
                ("backing", Box::new(move || drop(backing))),
            ];
            for (what, destroy) in cases {
                // The pool synchronises its stream before destroying itself: fail every push.
                control::inject("cuCtxPushCurrent_v2", 0, -1, CudaErrorCode::ERROR_INVALID_CONTEXT);
                let ((), logs) = capture(destroy);
                control::clear_injections();
                assert!(logs.has(Level::ERROR, &[what, "leak", "CUDA_ERROR_INVALID_CONTEXT"]), "{what}: {:?}", logs.all());
            }
            assert!(device.lost().is_none(), "a refused push is not a lost device");
            // The driver refused every destroy: each resource is still there, once.
            assert_eq!((control::live_events(), control::live_pools(), control::live_handles()), (1, 1, 1));
            assert_eq!(control::live_streams(), 2, "the queue's stream and the pool's stream");
            assert_eq!(control::invalid_frees(), 0);
        }
    }

    fake_test! {
        fn a_failed_context_pop_keeps_the_calls_result_and_is_logged() {
            let device = device();
            let eager = CudaAllocator::new(&device);
            control::inject("cuCtxPopCurrent_v2", 0, 1, CudaErrorCode::ERROR_INVALID_CONTEXT);
            let (block, logs) = capture(|| eager.allocate(&request(64, 8)));
            let block = block.expect("the allocation itself succeeded and is not lost");
            assert!(logs.has(Level::WARN, &["popping the CUDA context failed"]), "{:?}", logs.all());
            assert_eq!(control::context_depth(), 1, "the driver kept the context it refused to pop");
            assert!(device.lost().is_none());
            complete(eager.release(block));
            assert_eq!(control::context_depth(), 1, "later calls push and pop in balance");
            assert_eq!(control::injected("cuCtxPopCurrent_v2"), 1);
            assert_eq!(control::invalid_frees(), 0);
        }
    }

    fake_test! {
        fn a_sticky_error_from_a_context_pop_marks_the_device_lost() {
            let device = device();
            let eager = CudaAllocator::new(&device);
            control::inject("cuCtxPopCurrent_v2", 0, 1, CudaErrorCode::ERROR_LAUNCH_FAILED);
            let block = eager.allocate(&request(64, 8)).expect("the allocation happened before the pop");
            let lost = device.lost().expect("a sticky code from any call means the context is gone");
            assert!(matches!(lost, CudaError::DeviceLost { operation: "cuCtxPopCurrent_v2", .. }), "{lost:?}");
            let pushes = control::calls("cuCtxPushCurrent_v2");
            let (block, error) = failed(eager.release(block));
            assert!(matches!(error, ReleaseError::DeviceLost { .. }), "{error:?}");
            assert_eq!(control::calls("cuCtxPushCurrent_v2"), pushes, "a lost device is not called again");
            eager.forget_lost(vec![block]);
            assert_eq!(eager.stats().unwrap().live_allocations, 0);
            assert_eq!(control::calls("cuMemFree_v2"), 0);
            assert_eq!(control::invalid_frees(), 0);
        }
    }
}

mod memory {
    use super::*;

    fake_test! {
        fn out_of_memory_with_a_failing_free_memory_query_reports_no_available_bytes() {
            let device = device();
            let eager = CudaAllocator::new(&device);
            control::inject("cuMemAlloc_v2", 0, 1, CudaErrorCode::ERROR_OUT_OF_MEMORY);
            control::inject("cuMemGetInfo_v2", 0, 2, CudaErrorCode::ERROR_UNKNOWN);
            let error = eager.allocate(&request(4096, 256)).unwrap_err();
            assert_eq!(
                error,
                AllocError::OutOfMemory { device: GPU0, requested: 4096, align: 256, available: MaybeBytes(None) }
            );
            assert_eq!(
                device.memory_info(),
                Err(CudaError::Driver { operation: "cuMemGetInfo_v2", code: CudaErrorCode::ERROR_UNKNOWN })
            );
            assert_eq!((control::used_bytes(), eager.stats().unwrap().failures_total), (0, 1));
            injected_and_clean("cuMemGetInfo_v2", 2);
        }
    }

    fake_test! {
        fn a_refused_host_free_hands_the_pinned_block_back_and_a_retry_frees_it() {
            let device = device();
            let pinned = PinnedHostAllocator::new(&device);
            let block = pinned.allocate(&request(10_000, 64)).unwrap();
            let copy = RawAllocation::new(block.address(), block.bytes(), block.align(), block.device(), block.provider_tag());
            control::inject("cuMemFreeHost", 0, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            let (back, error) = failed(pinned.release(block));
            assert!(back.same_block(&copy));
            assert_eq!(release_backend(&error), ("cuMemFreeHost", 1));
            assert_eq!((pinned.stats().unwrap().live_allocations, control::live_host_blocks()), (1, 1));
            complete(pinned.release(back));
            assert_eq!((pinned.stats().unwrap().live_allocations, control::live_host_blocks()), (0, 0));
            injected_and_clean("cuMemFreeHost", 1);
        }
    }

    fake_test! {
        fn failed_copies_and_fills_are_typed_and_write_nothing() {
            let device = device();
            let pool = pool_on(&device, PoolConfig::default());
            let block = pool.allocate(&request(4096, 256)).unwrap();
            let data = vec![7u8; 4096];
            // SAFETY: the block is ours and live; the fake runs its stream at once.
            unsafe { device.copy_to_device(block.address(), &data) }.unwrap();
            control::inject("cuMemcpyHtoD_v2", 0, 1, CudaErrorCode::ERROR_UNKNOWN);
            control::inject("cuMemsetD8Async", 0, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            control::inject("cuMemcpyDtoH_v2", 0, 1, CudaErrorCode::ERROR_UNKNOWN);
            // SAFETY: as above.
            let write = unsafe { device.copy_to_device(block.address(), &[1; 4096]) };
            assert_eq!(write, Err(CudaError::Driver { operation: "cuMemcpyHtoD_v2", code: CudaErrorCode::ERROR_UNKNOWN }));
            // SAFETY: as above; the block outlives the fill (released below, after it).
            let fill = unsafe { pool.stream().memset_async(block.address(), 2, 4096) };
            assert!(matches!(fill, Err(CudaError::InvalidValue { operation: "cuMemsetD8Async", .. })), "{fill:?}");
            let mut back = vec![0; 4096];
            // SAFETY: as above.
            let read = unsafe { device.copy_from_device(block.address(), &mut back) };
            assert_eq!(read, Err(CudaError::Driver { operation: "cuMemcpyDtoH_v2", code: CudaErrorCode::ERROR_UNKNOWN }));
            // SAFETY: as above.
            unsafe { device.copy_from_device(block.address(), &mut back) }.unwrap();
            assert_eq!(back, data, "no failed call wrote anything");
            complete(pool.release(block));
            for function in ["cuMemcpyHtoD_v2", "cuMemsetD8Async"] {
                assert_eq!(control::injected(function), 1, "{function}");
            }
            injected_and_clean("cuMemcpyDtoH_v2", 1);
        }
    }
}

mod streams_and_pools {
    use super::*;

    fake_test! {
        fn a_failed_stream_creation_is_typed_and_leaves_nothing() {
            let device = device();
            control::inject("cuStreamCreate", 0, 1, CudaErrorCode::ERROR_OUT_OF_MEMORY);
            let error = CudaStream::new(&device).unwrap_err();
            assert!(matches!(error, CudaError::OutOfMemory { operation: "cuStreamCreate", .. }), "{error:?}");
            assert_eq!(control::live_streams(), 0);
            drop(CudaStream::new(&device).unwrap());
            assert_eq!(control::live_streams(), 0);
            injected_and_clean("cuStreamCreate", 1);
        }
    }

    fake_test! {
        fn a_refused_stream_destroy_is_logged_and_not_repeated() {
            let device = device();
            let stream = CudaStream::new(&device).unwrap();
            control::inject("cuStreamDestroy_v2", 0, 1, CudaErrorCode::ERROR_INVALID_HANDLE);
            let ((), logs) = capture(|| drop(stream));
            assert!(logs.has(Level::WARN, &["destroying a CUDA stream failed", "CUDA_ERROR_INVALID_HANDLE"]), "{:?}", logs.all());
            assert_eq!((control::calls("cuStreamDestroy_v2"), control::live_streams()), (1, 1));
            assert!(device.lost().is_none());
            injected_and_clean("cuStreamDestroy_v2", 1);
        }
    }

    fake_test! {
        fn a_failed_stream_synchronisation_fails_trim_and_trims_nothing() {
            let device = device();
            let pool = pool_on(&device, PoolConfig::default());
            complete(pool.release(pool.allocate(&request(MIB, 256)).unwrap()));
            control::inject("cuStreamSynchronize", 0, 3, CudaErrorCode::ERROR_UNKNOWN);
            let expected = CudaError::Driver { operation: "cuStreamSynchronize", code: CudaErrorCode::ERROR_UNKNOWN };
            assert_eq!(pool.stream().synchronize(), Err(expected.clone()));
            assert_eq!(pool.trim_to(0), Err(expected));
            assert_eq!(pool.trim(), 0);
            assert_eq!(control::calls("cuMemPoolTrimTo"), 0, "nothing is trimmed before the frees have landed");
            assert_eq!((pool.stats().unwrap().cached_bytes, control::used_bytes()), (MIB as u64, MIB as u64));
            assert_eq!(pool.trim(), MIB);
            control::inject("cuStreamSynchronize", 0, 1, CudaErrorCode::ERROR_UNKNOWN);
            drop(pool);
            assert_eq!(control::live_pools(), 0, "a pool whose stream cannot synchronise is still destroyed");
            injected_and_clean("cuStreamSynchronize", 4);
        }
    }

    fake_test! {
        fn a_failed_pool_creation_is_typed_and_leaves_nothing() {
            let device = device();
            let stream = CudaStream::new(&device).unwrap();
            control::inject("cuMemPoolCreate", 0, 1, CudaErrorCode::ERROR_OUT_OF_MEMORY);
            let error = CudaPoolAllocator::new(&stream, PoolConfig::default()).unwrap_err();
            assert!(matches!(error, CudaError::OutOfMemory { operation: "cuMemPoolCreate", .. }), "{error:?}");
            assert_eq!((control::live_pools(), control::calls("cuMemPoolSetAttribute")), (0, 0));
            injected_and_clean("cuMemPoolCreate", 1);
        }
    }

    fake_test! {
        fn a_refused_pool_destroy_is_logged_and_not_repeated() {
            let device = device();
            let pool = pool_on(&device, PoolConfig::default());
            control::inject("cuMemPoolDestroy", 0, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            let ((), logs) = capture(|| drop(pool));
            assert!(logs.has(Level::WARN, &["destroying the CUDA pool failed", "CUDA_ERROR_INVALID_VALUE"]), "{:?}", logs.all());
            assert_eq!((control::calls("cuMemPoolDestroy"), control::live_pools()), (1, 1));
            injected_and_clean("cuMemPoolDestroy", 1);
        }
    }

    fake_test! {
        fn failing_pool_attribute_reads_are_typed_and_stats_fall_back_to_the_books() {
            let device = device();
            let pool = pool_on(&device, PoolConfig::default());
            let live = pool.allocate(&request(4096, 256)).unwrap();
            complete(pool.release(pool.allocate(&request(MIB, 256)).unwrap()));
            control::inject("cuMemPoolGetAttribute", 0, 4, CudaErrorCode::ERROR_UNKNOWN);
            let expected = CudaError::Driver { operation: "cuMemPoolGetAttribute", code: CudaErrorCode::ERROR_UNKNOWN };
            assert_eq!(pool.usage(), Err(expected.clone()));
            assert_eq!(pool.release_threshold(), Err(expected.clone()));
            let stats = pool.stats().expect("stats from the allocator's own books");
            assert_eq!((stats.live_allocations, stats.live_bytes, stats.cached_bytes), (1, 4096, 0));
            assert_eq!(pool.trim_to(0), Err(expected), "a trim that cannot measure the pool does not start");
            assert_eq!(control::calls("cuMemPoolTrimTo"), 0);
            assert_eq!(pool.trim(), MIB, "the next trim works");
            complete(pool.release(live));
            injected_and_clean("cuMemPoolGetAttribute", 4);
        }
    }

    fake_test! {
        fn a_failed_pool_trim_is_typed_and_trims_nothing() {
            let device = device();
            let pool = pool_on(&device, PoolConfig::default());
            complete(pool.release(pool.allocate(&request(MIB, 256)).unwrap()));
            control::inject("cuMemPoolTrimTo", 0, 2, CudaErrorCode::ERROR_INVALID_VALUE);
            let error = pool.trim_to(0).unwrap_err();
            assert!(matches!(error, CudaError::InvalidValue { operation: "cuMemPoolTrimTo", .. }), "{error:?}");
            assert_eq!(pool.trim(), 0);
            assert_eq!(control::used_bytes(), MIB as u64, "nothing was trimmed");
            assert_eq!(pool.trim(), MIB);
            injected_and_clean("cuMemPoolTrimTo", 2);
        }
    }
}

mod release_queue {
    use super::*;

    type Outcomes = Arc<Mutex<Vec<ReleaseOutcome>>>;

    struct Setup {
        device: CudaDevice,
        eager: Arc<CudaAllocator>,
        queue: CudaReleaseQueue,
        outcomes: Outcomes,
    }

    fn setup(capacity: usize) -> Setup {
        let device = device();
        let stream = CudaStream::new(&device).unwrap();
        let eager = Arc::new(CudaAllocator::new(&device));
        Setup { queue: CudaReleaseQueue::new(&stream, capacity), device, eager, outcomes: Outcomes::default() }
    }

    impl Setup {
        fn prepared(&self) -> PreparedRelease {
            let block = self.eager.allocate(&request(4096, 256)).unwrap();
            let outcomes = Arc::clone(&self.outcomes);
            let completion = Box::new(move |outcome| outcomes.lock().unwrap().push(outcome));
            PreparedRelease::new(identity(GPU0), self.eager.clone(), block, completion)
        }

        fn completed(&self) -> usize {
            self.outcomes.lock().unwrap().iter().filter(|outcome| outcome.is_complete()).count()
        }
    }

    #[track_caller]
    fn refused_by_the_driver(reason: &QueueRefusalReason, operation: &str, code: CudaErrorCode) {
        match reason {
            QueueRefusalReason::Backend(source) => {
                assert_eq!((source.operation, source.code), (operation, i64::from(code.get())));
                assert!(source.detail.contains(code.name()), "{}", source.detail);
            }
            other => panic!("expected the driver's error in the refusal, got {other:?}"),
        }
    }

    fake_test! {
        fn a_failed_event_creation_refuses_with_the_drivers_error_and_closes_the_queue() {
            let s = setup(4);
            control::inject("cuEventCreate", 0, 1, CudaErrorCode::ERROR_OUT_OF_MEMORY);
            let offered = s.prepared();
            let identity = *offered.identity();
            let refusal = s.queue.enqueue(offered).unwrap_err();
            refused_by_the_driver(&refusal.reason, "cuEventCreate", CudaErrorCode::ERROR_OUT_OF_MEMORY);
            assert_eq!(*refusal.release.identity(), identity, "the very release offered comes back");
            assert!(s.queue.is_closed());
            assert_eq!(refusal.release.execute(), memory_api::ReleaseSummary::Complete { unmapped_bytes: 4096 });
            assert_eq!((s.eager.stats().unwrap().live_allocations, control::live_events()), (0, 0));
            assert!(s.device.lost().is_none());
            injected_and_clean("cuEventCreate", 1);
        }
    }

    fake_test! {
        fn a_failed_event_record_refuses_with_the_drivers_error_and_destroys_the_event() {
            let s = setup(4);
            s.queue.enqueue(s.prepared()).unwrap();
            assert_eq!(s.queue.poll(), Ok(1));
            assert_eq!(control::live_events(), 1, "a spare event is kept");
            control::inject("cuEventRecord", 0, 1, CudaErrorCode::ERROR_INVALID_HANDLE);
            let refusal = s.queue.enqueue(s.prepared()).unwrap_err();
            refused_by_the_driver(&refusal.reason, "cuEventRecord", CudaErrorCode::ERROR_INVALID_HANDLE);
            assert!(s.queue.is_closed());
            assert_eq!(control::live_events(), 0, "the event that could not be recorded was destroyed, once");
            complete(s.eager.release(refusal.release.cancel()));
            assert_eq!(s.eager.stats().unwrap().live_allocations, 0);
            injected_and_clean("cuEventRecord", 1);
        }
    }

    fake_test! {
        fn a_failed_event_query_keeps_the_release_queued_until_a_later_poll() {
            let s = setup(4);
            s.queue.enqueue(s.prepared()).unwrap();
            control::inject("cuEventQuery", 0, 1, CudaErrorCode::ERROR_INVALID_HANDLE);
            assert_eq!(
                s.queue.poll(),
                Err(CudaError::Driver { operation: "cuEventQuery", code: CudaErrorCode::ERROR_INVALID_HANDLE })
            );
            assert_eq!((s.queue.len(), s.completed()), (1, 0), "kept, not run and not lost");
            assert_eq!(control::calls("cuMemFree_v2"), 0);
            assert!(s.device.lost().is_none());
            assert_eq!(s.queue.poll(), Ok(1));
            assert_eq!(s.completed(), 1);
            injected_and_clean("cuEventQuery", 1);
        }
    }

    fake_test! {
        fn a_failed_event_wait_keeps_the_release_queued_until_a_later_drain() {
            let s = setup(4);
            control::hold_events(true);
            s.queue.enqueue(s.prepared()).unwrap();
            control::inject("cuEventSynchronize", 0, 1, CudaErrorCode::ERROR_UNKNOWN);
            assert_eq!(
                s.queue.drain(),
                Err(CudaError::Driver { operation: "cuEventSynchronize", code: CudaErrorCode::ERROR_UNKNOWN })
            );
            assert_eq!((s.queue.len(), s.completed()), (1, 0));
            assert_eq!(s.queue.drain(), Ok(1));
            assert_eq!((s.completed(), s.eager.stats().unwrap().live_allocations), (1, 0));
            injected_and_clean("cuEventSynchronize", 1);
        }
    }

    fake_test! {
        fn a_refused_event_destroy_is_logged_and_not_repeated() {
            let s = setup(4);
            s.queue.enqueue(s.prepared()).unwrap();
            assert_eq!(s.queue.poll(), Ok(1));
            control::inject("cuEventDestroy_v2", 0, 1, CudaErrorCode::ERROR_INVALID_HANDLE);
            let Setup { queue, .. } = s;
            let ((), logs) = capture(|| drop(queue));
            assert!(logs.has(Level::WARN, &["destroying a CUDA event failed", "CUDA_ERROR_INVALID_HANDLE"]), "{:?}", logs.all());
            assert_eq!((control::calls("cuEventDestroy_v2"), control::live_events()), (1, 1));
            injected_and_clean("cuEventDestroy_v2", 1);
        }
    }
}

mod vmm {
    use super::*;

    fn setup() -> (CudaDevice, CudaVmmAllocator) {
        let device = device();
        let vmm = CudaVmmAllocator::new(&device).expect("VMM on the fake");
        (device, vmm)
    }

    fake_test! {
        fn a_failed_granularity_query_creates_no_vmm_allocator() {
            let device = device();
            control::inject("cuMemGetAllocationGranularity", 0, 1, CudaErrorCode::ERROR_INVALID_DEVICE);
            let error = CudaVmmAllocator::new(&device).unwrap_err();
            assert_eq!(
                error,
                CudaError::Driver { operation: "cuMemGetAllocationGranularity", code: CudaErrorCode::ERROR_INVALID_DEVICE }
            );
            assert!(CudaVmmAllocator::new(&device).is_ok());
            injected_and_clean("cuMemGetAllocationGranularity", 1);
        }
    }

    fake_test! {
        env ["FAKE_CUDA_GRANULARITY" = "3000000"]
        fn a_granularity_that_is_not_a_power_of_two_is_refused() {
            let error = CudaVmmAllocator::new(&device()).unwrap_err();
            assert_eq!(
                (error.operation(), error.code()),
                (Some("cuMemGetAllocationGranularity"), Some(CudaErrorCode::ERROR_INVALID_VALUE)),
                "{error:?}"
            );
        }
    }

    fake_test! {
        fn a_failed_address_reservation_is_out_of_memory_and_reserves_nothing() {
            let (_device, vmm) = setup();
            control::inject("cuMemAddressReserve", 0, 1, CudaErrorCode::ERROR_OUT_OF_MEMORY);
            let error = vmm.allocate(&request(3 * MIB, 4096)).unwrap_err();
            assert_eq!(
                error,
                AllocError::OutOfMemory { device: GPU0, requested: 3 * MIB, align: 4096, available: MaybeBytes(None) }
            );
            let stats = vmm.stats().unwrap();
            assert_eq!((stats.failures_total, stats.reserved_bytes, stats.live_allocations), (1, 0, 0));
            assert_eq!(control::live_reservations(), 0);
            complete(vmm.release(vmm.allocate(&request(G, G)).unwrap()));
            injected_and_clean("cuMemAddressReserve", 1);
        }
    }

    fake_test! {
        fn a_failed_backing_creation_is_typed_and_creates_nothing() {
            let (_device, vmm) = setup();
            control::inject("cuMemCreate", 0, 1, CudaErrorCode::ERROR_OUT_OF_MEMORY);
            assert_eq!(vmm.create_backing(2 * G).unwrap_err(), CapabilityError::OutOfMemory { device: GPU0, requested: 2 * G });
            assert_eq!((control::live_handles(), control::used_bytes()), (0, 0));
            injected_and_clean("cuMemCreate", 1);
        }
    }

    fake_test! {
        fn a_map_that_fails_partway_through_a_commit_is_undone() {
            let (_device, vmm) = setup();
            let block = vmm.allocate(&request(3 * G, G)).unwrap();
            control::inject("cuMemMap", 1, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            let error = vmm.commit(&block, ByteRange::new(0, 3 * G)).unwrap_err();
            assert_eq!(capability_backend(&error), ("cuMemMap", 1));
            assert_eq!(vmm.committed_bytes(&block), Ok(0));
            assert_eq!((control::live_handles(), control::live_mappings(), control::used_bytes()), (0, 0, 0));
            assert_eq!(vmm.stats().unwrap().live_bytes, 0);
            assert_eq!(vmm.commit(&block, ByteRange::new(0, 3 * G)), Ok(3 * G));
            assert_eq!(complete(vmm.release(block)), 3 * G);
            injected_and_clean("cuMemMap", 1);
        }
    }

    fake_test! {
        fn a_granule_whose_map_and_handle_release_both_fail_is_kept_and_mapped_again_later() {
            let (_device, vmm) = setup();
            let block = vmm.allocate(&request(G, G)).unwrap();
            control::inject("cuMemMap", 0, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            // Once when the map fails, once more when the commit undoes itself.
            control::inject("cuMemRelease", 0, 2, CudaErrorCode::ERROR_INVALID_VALUE);
            let error = vmm.commit(&block, ByteRange::new(0, G)).unwrap_err();
            assert_eq!(capability_backend(&error), ("cuMemMap", 1));
            assert_eq!(vmm.committed_bytes(&block), Ok(0), "nothing is mapped");
            assert_eq!((control::live_handles(), control::used_bytes()), (1, G as u64), "the handle is still owned");
            let creates = control::calls("cuMemCreate");
            assert_eq!(vmm.commit(&block, ByteRange::new(0, G)), Ok(G));
            assert_eq!(control::calls("cuMemCreate"), creates, "the kept handle was mapped, not a new one");
            assert_eq!(control::live_handles(), 1);
            assert_eq!(complete(vmm.release(block)), G);
            assert_eq!((control::live_handles(), control::used_bytes()), (0, 0));
            assert_eq!(control::injected("cuMemMap"), 1);
            injected_and_clean("cuMemRelease", 2);
        }
    }

    fake_test! {
        fn a_shared_map_that_fails_partway_is_undone_and_keeps_the_backing() {
            let (_device, vmm) = setup();
            let backing = vmm.create_backing(2 * G).unwrap();
            let block = vmm.allocate(&request(2 * G, G)).unwrap();
            control::inject("cuMemMap", 1, 1, CudaErrorCode::ERROR_OUT_OF_MEMORY);
            let placement = SharedPlacement { target: ByteRange::new(0, 2 * G), backing_offset: 0 };
            let error = vmm.map(&backing, &block, placement, MappingAccess::ReadOnly).unwrap_err();
            assert_eq!(error, CapabilityError::OutOfMemory { device: GPU0, requested: 2 * G });
            assert_eq!((vmm.committed_bytes(&block), control::live_mappings()), (Ok(0), 0));
            assert_eq!(control::calls("cuMemUnmap"), 1, "the one granule mapped was unmapped");
            assert_eq!(control::live_handles(), 1, "the backing is intact");
            vmm.map(&backing, &block, placement, MappingAccess::ReadOnly).unwrap();
            drop(backing);
            assert_eq!(complete(vmm.release(block)), 2 * G);
            assert_eq!((control::live_handles(), control::used_bytes()), (0, 0));
            injected_and_clean("cuMemMap", 1);
        }
    }

    fake_test! {
        fn a_commit_whose_access_cannot_be_set_is_undone() {
            let (_device, vmm) = setup();
            let block = vmm.allocate(&request(2 * G, G)).unwrap();
            control::inject("cuMemSetAccess", 1, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            let error = vmm.commit(&block, ByteRange::new(0, 2 * G)).unwrap_err();
            assert_eq!(capability_backend(&error), ("cuMemSetAccess", 1));
            assert_eq!(vmm.committed_bytes(&block), Ok(0));
            assert_eq!((control::live_handles(), control::live_mappings(), vmm.stats().unwrap().live_bytes), (0, 0, 0));
            complete(vmm.release(block));
            injected_and_clean("cuMemSetAccess", 1);
        }
    }

    fake_test! {
        fn a_refused_backing_release_is_logged_and_not_repeated() {
            let (_device, vmm) = setup();
            let backing = vmm.create_backing(G).unwrap();
            control::inject("cuMemRelease", 0, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            let ((), logs) = capture(|| drop(backing));
            assert!(logs.has(Level::WARN, &["releasing a shared backing failed", "CUDA_ERROR_INVALID_VALUE"]), "{:?}", logs.all());
            assert_eq!((control::calls("cuMemRelease"), control::live_handles()), (1, 1));
            injected_and_clean("cuMemRelease", 1);
        }
    }
}

/// Faults that real drivers report later than they happen: at the next synchronising call.
mod asynchronous_faults {
    use super::*;

    fake_test! {
        fn a_fault_surfaces_at_the_next_synchronous_free_which_hands_the_block_back() {
            let device = device();
            let eager = CudaAllocator::new(&device);
            let first = eager.allocate(&request(4096, 256)).unwrap();
            control::fault(CudaErrorCode::ERROR_ILLEGAL_ADDRESS);
            let second = eager.allocate(&request(4096, 256)).expect("the fault is not reported yet");
            assert!(device.lost().is_none());
            let (first, error) = failed(eager.release(first));
            assert!(matches!(error, ReleaseError::DeviceLost { .. }), "{error:?}");
            assert!(matches!(device.lost(), Some(CudaError::DeviceLost { operation: "cuMemFree_v2", .. })));
            let calls = control::calls("cuMemFree_v2");
            let (second, error) = failed(eager.release(second));
            assert!(matches!(error, ReleaseError::DeviceLost { .. }), "{error:?}");
            assert_eq!(control::calls("cuMemFree_v2"), calls, "a lost device is not called again");
            eager.forget_lost(vec![first, second]);
            assert_eq!(eager.stats().unwrap().live_allocations, 0);
            assert_eq!(control::invalid_frees(), 0);
        }
    }

    fake_test! {
        fn a_fault_surfaces_at_the_queue_poll_which_keeps_the_release_and_frees_nothing() {
            let device = device();
            let stream = CudaStream::new(&device).unwrap();
            let queue = CudaReleaseQueue::new(&stream, 4);
            let eager = Arc::new(CudaAllocator::new(&device));
            let block = eager.allocate(&request(4096, 256)).unwrap();
            let outcome = Arc::new(Mutex::new(None));
            let seen = Arc::clone(&outcome);
            control::fault(CudaErrorCode::ERROR_LAUNCH_FAILED);
            let release = PreparedRelease::new(
                identity(GPU0),
                eager.clone(),
                block,
                Box::new(move |result: ReleaseOutcome| *seen.lock().unwrap() = Some(result)),
            );
            queue.enqueue(release).expect("recording an event does not synchronise");
            let error = queue.poll().unwrap_err();
            assert!(matches!(error, CudaError::DeviceLost { operation: "cuEventQuery", .. }), "{error:?}");
            assert!(device.lost().is_some());
            assert_eq!(queue.len(), 1, "the release is kept, not run on a lost device");
            let ((), logs) = capture(|| drop(queue));
            let outcome = outcome.lock().unwrap().take().expect("the owner was told");
            let ReleaseOutcome::Quarantined(quarantine) = outcome else { panic!("expected a quarantine, got {outcome:?}") };
            assert_eq!(*quarantine.error(), ReleaseError::Abandoned);
            assert_eq!(control::calls("cuMemFree_v2"), 0, "memory the device may still use was not freed");
            assert!(!logs.has(Level::ERROR, &["leak"]), "events of a lost context go with it: {:?}", logs.all());
            assert_eq!(control::invalid_frees(), 0);
        }
    }

    fake_test! {
        fn a_fault_surfaces_at_trim_after_stream_ordered_calls_that_still_worked() {
            let device = device();
            let pool = pool_on(&device, PoolConfig::default());
            control::fault(CudaErrorCode::ERROR_ILLEGAL_ADDRESS);
            let block = pool.allocate(&request(MIB, 256)).expect("stream-ordered calls do not synchronise");
            complete(pool.release(block));
            assert_eq!(pool.trim(), 0);
            let lost = device.lost().expect("the synchronisation reported the fault");
            assert!(matches!(lost, CudaError::DeviceLost { operation: "cuStreamSynchronize", .. }), "{lost:?}");
            let allocations = control::calls("cuMemAllocFromPoolAsync");
            assert!(matches!(pool.allocate(&request(64, 8)), Err(AllocError::DeviceLost { .. })));
            assert_eq!(control::calls("cuMemAllocFromPoolAsync"), allocations);
            assert!(matches!(pool.trim_to(0), Err(CudaError::DeviceLost { .. })));
            assert_eq!(control::invalid_frees(), 0);
        }
    }

    fake_test! {
        fn a_fault_surfaces_at_a_synchronous_copy() {
            let device = device();
            let vmm = CudaVmmAllocator::new(&device).unwrap();
            let block = vmm.allocate(&request(G, G)).unwrap();
            control::fault(CudaErrorCode::ERROR_MISALIGNED_ADDRESS);
            assert_eq!(vmm.commit(&block, ByteRange::new(0, G)), Ok(G), "commit does not synchronise");
            // SAFETY: the granule is committed and ours; the fake refuses nothing here.
            let error = unsafe { device.copy_to_device(block.address(), &[1; 64]) }.unwrap_err();
            assert!(matches!(error, CudaError::DeviceLost { operation: "cuMemcpyHtoD_v2", .. }), "{error:?}");
            let (block, error) = failed(vmm.release(block));
            assert!(matches!(error, ReleaseError::DeviceLost { .. }), "{error:?}");
            assert_eq!(control::calls("cuMemUnmap"), 0);
            vmm.forget_lost(vec![block]);
            let stats = vmm.stats().unwrap();
            assert_eq!((stats.live_allocations, stats.live_bytes, stats.reserved_bytes), (0, 0, 0));
        }
    }
}

#[test]
fn every_driver_entry_point_is_injected_by_a_test() {
    // A test injects an entry point with `control::inject("name", ...)` or the
    // `FAKE_CUDA_INJECT` environment ("name:skip:count:code"), and the fake must route
    // the entry point through its injection guard.
    let tests = [include_str!("driver_failures.rs"), include_str!("fake_driver.rs")];
    let fake = include_str!("../fake-driver/fake_cuda.c");
    let mut missing = Vec::new();
    for symbol in allocator_cuda::REQUIRED_SYMBOLS {
        let by_call = format!("inject(\"{symbol}\"");
        let by_env = format!("\"{symbol}:");
        if !tests.iter().any(|source| source.contains(&by_call) || source.contains(&by_env)) {
            missing.push(format!("{symbol}: no test injects it"));
        }
        if !fake.contains(&format!("GUARD(\"{symbol}\")")) {
            missing.push(format!("{symbol}: the fake does not guard it"));
        }
    }
    assert!(missing.is_empty(), "entry points without an injection test:\n{}", missing.join("\n"));
}
