//! Every allocator of this crate against a fake CUDA driver (fake-driver/fake_cuda.c),
//! through the real cudarc call paths, with the driver's failures injected.
//!
//! Each test re-runs this binary filtered to itself with `LD_LIBRARY_PATH` pointing at
//! the freshly built fake (see `common::fake`), so each test body gets a fresh driver
//! state in its own process. Runs under plain `cargo test`; needs only a C compiler.
#![cfg(target_os = "linux")]

#[macro_use]
mod common;

const MIB: usize = 1 << 20;

mod probe {
    use crate::common::fake::{self, Variant, control};
    use allocator_cuda::{CudaDevice, CudaError, CudaErrorCode, device_count, driver_available};

    #[test]
    fn without_libcuda_every_entry_point_is_the_no_driver_error() {
        if !fake::in_child() {
            fake::run_in_child(
                concat!(module_path!(), "::without_libcuda_every_entry_point_is_the_no_driver_error"),
                &[],
                Variant::Empty,
            );
            return;
        }
        if driver_available() {
            assert!(!control::is_fake(), "the empty directory cannot provide the fake");
            eprintln!("skipped: a system libcuda is installed, so 'no driver' cannot be observed here");
            return;
        }
        assert_eq!(device_count(), Err(CudaError::NoDriver));
        let error = CudaDevice::open(0).expect_err("no driver, no device");
        assert_eq!(error, CudaError::NoDriver);
        assert!(error.to_string().contains("LD_LIBRARY_PATH"), "{error}");
    }

    #[test]
    fn an_old_driver_is_reported_by_its_missing_entry_point_not_a_panic() {
        if !fake::in_child() {
            fake::run_in_child(
                concat!(module_path!(), "::an_old_driver_is_reported_by_its_missing_entry_point_not_a_panic"),
                &[],
                Variant::Old,
            );
            return;
        }
        assert!(driver_available());
        assert_eq!(device_count(), Err(CudaError::DriverTooOld { symbol: "cuMemAddressReserve" }));
        let error = CudaDevice::open(0).expect_err("the guard refuses the old driver");
        assert!(error.to_string().contains("cuMemAddressReserve") && error.to_string().contains("upgrade"), "{error}");
        // The guard stopped before any driver call.
        assert_eq!(control::calls("cuInit"), 0);
    }

    fake_test! {
        env ["FAKE_CUDA_DEVICES" = "0"]
        fn a_driver_without_devices_counts_zero_and_opens_none() {
            assert_eq!(device_count(), Ok(0));
            assert_eq!(CudaDevice::open(0).unwrap_err(), CudaError::NoDevice { ordinal: 0, available: 0 });
        }
    }

    fake_test! {
        env ["FAKE_CUDA_DEVICES" = "2"]
        fn devices_are_counted_and_opened_by_ordinal_with_their_primary_context() {
            assert_eq!(device_count(), Ok(2));
            let device = CudaDevice::open(1).expect("device 1");
            assert_eq!(device.key(), memory_api::DeviceKey::device(1));
            assert_eq!(control::primary_retains(1), 1);
            let clone = device.clone();
            drop(device);
            assert_eq!(control::primary_retains(1), 1, "a clone keeps the context retained");
            drop(clone);
            assert_eq!(control::primary_retains(1), 0, "the last handle releases the primary context");
            let error = CudaDevice::open(2).unwrap_err();
            assert_eq!(error, CudaError::NoDevice { ordinal: 2, available: 2 });
            assert!(error.to_string().contains("below 2"), "{error}");
        }
    }

    fake_test! {
        env ["FAKE_CUDA_INJECT" = "cuInit:0:-1:999"]
        fn a_failing_cu_init_is_a_typed_driver_error_with_its_raw_code() {
            let error = device_count().unwrap_err();
            assert_eq!(error, CudaError::Driver { operation: "cuInit", code: CudaErrorCode::ERROR_UNKNOWN });
            assert!(error.to_string().contains("CUDA_ERROR_UNKNOWN (999)"), "{error}");
        }
    }

    #[test]
    fn the_probe_example_prints_the_count_or_explains_and_fails() {
        let Some(output) = fake::run_probe_example(Variant::Current, &[("FAKE_CUDA_DEVICES", "3")]) else {
            eprintln!("skipped: the cuda_probe example is not built (cargo test builds it; --test alone does not)");
            return;
        };
        assert!(output.status.success(), "{output:?}");
        assert_eq!(String::from_utf8_lossy(&output.stdout), "cuda devices: 3\n");

        let output = fake::run_probe_example(Variant::Current, &[("FAKE_CUDA_DEVICES", "0")]).expect("built");
        assert!(output.status.success(), "{output:?}");
        assert_eq!(String::from_utf8_lossy(&output.stdout), "cuda devices: 0\n");

        let output = fake::run_probe_example(Variant::Old, &[]).expect("built");
        assert!(!output.status.success());
        assert!(String::from_utf8_lossy(&output.stderr).contains("cuMemAddressReserve"), "{output:?}");
    }
}

mod eager {
    use super::*;
    use crate::common::fake::control;
    use crate::common::{complete, failed, pattern, request};
    use allocator_cuda::{CudaAllocator, CudaDevice, CudaError, CudaErrorCode};
    use memory_api::{AllocError, DeviceAllocator, DeviceKey, LayoutError, MaybeBytes, RawAllocation, ReleaseError};

    fn setup() -> (CudaDevice, CudaAllocator) {
        let device = CudaDevice::open(0).expect("the fake has device 0");
        let eager = CudaAllocator::new(&device);
        (device, eager)
    }

    fake_test! {
        fn blocks_are_aligned_distinct_and_each_freed_exactly_once() {
            let (_device, eager) = setup();
            let mut blocks = Vec::new();
            for align in [1, 8, 256, 512, 4096, 65536, 2 * MIB] {
                for bytes in [1, 1000, MIB + 3] {
                    let block = eager.allocate(&request(bytes, align)).expect("allocate");
                    assert!(block.address().is_aligned_to(align), "{block:?} for align {align}");
                    assert_eq!((block.bytes(), block.align(), block.device()), (bytes, align, DeviceKey::device(0)));
                    blocks.push(block);
                }
            }
            let mut spans: Vec<(u64, u64)> = blocks.iter().map(|b| (b.address().get(), b.bytes() as u64)).collect();
            spans.sort_unstable();
            assert!(spans.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0), "blocks overlap: {spans:x?}");
            let count = blocks.len() as u64;
            assert_eq!(control::calls("cuMemAlloc_v2"), count);
            for block in blocks {
                complete(eager.release(block));
            }
            assert_eq!(control::calls("cuMemFree_v2"), count);
            assert_eq!(control::used_bytes(), 0, "every driver block was freed");
        }
    }

    fake_test! {
        fn zero_byte_requests_get_unique_releasable_blocks() {
            let (_device, eager) = setup();
            let a = eager.allocate(&request(0, 1)).unwrap();
            let b = eager.allocate(&request(0, 4096)).unwrap();
            assert_ne!(a.address(), b.address());
            assert!(b.address().is_aligned_to(4096));
            assert_eq!(a.bytes(), 0);
            complete(eager.release(a));
            complete(eager.release(b));
            assert_eq!(control::used_bytes(), 0);
        }
    }

    fake_test! {
        fn an_alignment_above_the_maximum_is_a_layout_error_before_any_driver_call() {
            let (_device, eager) = setup();
            let error = eager.allocate(&request(64, 4 * MIB)).unwrap_err();
            assert_eq!(
                error,
                AllocError::Layout(LayoutError::AlignmentTooLarge {
                    align: 4 * MIB,
                    max: CudaAllocator::MAX_ALIGN,
                    device: DeviceKey::device(0)
                })
            );
            assert_eq!(control::calls("cuMemAlloc_v2"), 0);
            assert_eq!(eager.stats().unwrap().failures_total, 1);
        }
    }

    fake_test! {
        fn data_round_trips_through_driver_copies_and_copies_past_the_block_are_refused() {
            let (device, eager) = setup();
            let block = eager.allocate(&request(4096, 256)).unwrap();
            let data = pattern(7, 4096);
            // SAFETY: the block is ours, live, and no device work uses it.
            unsafe { device.copy_to_device(block.address(), &data) }.expect("copy in");
            let mut back = vec![0; 4096];
            // SAFETY: as above.
            unsafe { device.copy_from_device(block.address(), &mut back) }.expect("copy out");
            assert_eq!(back, data);
            let past = block.address().checked_add(4096).unwrap();
            // SAFETY: the driver must refuse the range (it is in no live block).
            let refused = unsafe { device.copy_to_device(past, &[1; 4096]) };
            assert!(matches!(refused, Err(CudaError::InvalidValue { operation: "cuMemcpyHtoD_v2", .. })), "{refused:?}");
            complete(eager.release(block));
        }
    }

    fake_test! {
        env ["FAKE_CUDA_MEM_BYTES" = "67108864"]
        fn out_of_memory_names_the_request_and_the_bytes_still_free() {
            let (_device, eager) = setup();
            let first = eager.allocate(&request(32 * MIB, 256)).unwrap();
            let error = eager.allocate(&request(64 * MIB, 4096)).unwrap_err();
            assert_eq!(
                error,
                AllocError::OutOfMemory {
                    device: DeviceKey::device(0),
                    requested: 64 * MIB,
                    align: 4096,
                    available: MaybeBytes(Some(32 * MIB)),
                }
            );
            let text = error.to_string();
            assert!(text.contains("67108864") && text.contains("33554432 bytes available"), "{text}");
            let stats = eager.stats().unwrap();
            assert_eq!((stats.failures_total, stats.live_allocations), (1, 1));
            complete(eager.release(first));
        }
    }

    fake_test! {
        env ["FAKE_CUDA_INJECT" = "cuMemAlloc_v2:2:1:2"]
        fn out_of_memory_on_the_third_call_fails_only_that_call() {
            let (_device, eager) = setup();
            let a = eager.allocate(&request(64, 8)).unwrap();
            let b = eager.allocate(&request(64, 8)).unwrap();
            assert!(matches!(eager.allocate(&request(64, 8)), Err(AllocError::OutOfMemory { requested: 64, .. })));
            let d = eager.allocate(&request(64, 8)).unwrap();
            assert_eq!(eager.stats().unwrap().live_allocations, 3);
            for block in [a, b, d] {
                complete(eager.release(block));
            }
        }
    }

    fake_test! {
        fn a_refused_free_hands_the_block_back_unchanged_and_a_retry_frees_it() {
            let (_device, eager) = setup();
            let block = eager.allocate(&request(4096, 512)).unwrap();
            let original = RawAllocation::new(block.address(), 4096, 512, DeviceKey::device(0), block.provider_tag());
            control::inject("cuMemFree_v2", 0, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            let (back, error) = failed(eager.release(block));
            assert!(back.same_block(&original));
            let ReleaseError::Backend(source) = &error else { panic!("expected a backend error, got {error:?}") };
            assert_eq!((source.operation, source.code), ("cuMemFree_v2", 1));
            assert!(matches!(CudaError::from_backend(0, source), Some(CudaError::InvalidValue { .. })));
            assert_eq!(eager.stats().unwrap().live_allocations, 1, "a failed release keeps the block live");
            complete(eager.release(back));
            assert_eq!(control::used_bytes(), 0);
        }
    }

    fake_test! {
        fn foreign_forged_and_released_blocks_never_reach_the_driver() {
            let (device, eager) = setup();
            let other = CudaAllocator::new(&device);
            let block = eager.allocate(&request(256, 256)).unwrap();
            let (block, error) = failed(other.release(block));
            assert!(matches!(error, ReleaseError::NotOwned { .. }), "{error:?}");
            let forged = RawAllocation::new(block.address(), 257, 256, DeviceKey::device(0), block.provider_tag());
            assert!(matches!(failed(eager.release(forged)).1, ReleaseError::NotOwned { .. }));
            let elsewhere = RawAllocation::new(block.address(), 256, 256, DeviceKey::device(1), block.provider_tag());
            assert!(matches!(failed(eager.release(elsewhere)).1, ReleaseError::NotOwned { .. }));
            let stale = RawAllocation::new(block.address(), 256, 256, DeviceKey::device(0), block.provider_tag());
            complete(eager.release(block));
            assert!(matches!(failed(eager.release(stale)).1, ReleaseError::NotOwned { .. }));
            assert_eq!(control::calls("cuMemFree_v2"), 1, "only the real release reached the driver");
        }
    }

    fake_test! {
        fn a_sticky_error_reports_device_lost_and_later_calls_fail_without_the_driver() {
            let (device, eager) = setup();
            let second = CudaAllocator::new(&device);
            let block = eager.allocate(&request(4096, 256)).unwrap();
            control::set_sticky(CudaErrorCode::ERROR_ILLEGAL_ADDRESS);
            let error = eager.allocate(&request(64, 8)).unwrap_err();
            let AllocError::DeviceLost { device: key, reason } = &error else { panic!("expected DeviceLost, got {error:?}") };
            assert_eq!(*key, DeviceKey::device(0));
            assert!(reason.contains("CUDA_ERROR_ILLEGAL_ADDRESS") && reason.contains("invalidate_device"), "{reason}");
            assert!(device.lost().is_some_and(CudaError::is_device_lost));

            let pushes = control::calls("cuCtxPushCurrent_v2");
            assert!(matches!(second.allocate(&request(64, 8)), Err(AllocError::DeviceLost { .. })));
            let (block, error) = failed(eager.release(block));
            assert!(matches!(error, ReleaseError::DeviceLost { .. }), "{error:?}");
            assert_eq!(control::calls("cuCtxPushCurrent_v2"), pushes, "a lost device is not called again");
            assert_eq!(control::calls("cuMemFree_v2"), 0);

            eager.forget_lost(vec![block]);
            assert_eq!(eager.stats().unwrap().live_allocations, 0, "forgotten blocks leave the books");
        }
    }

    fake_test! {
        fn the_callers_context_stack_is_left_as_it_was() {
            let (_device, eager) = setup();
            assert_eq!(control::context_depth(), 0);
            let block = eager.allocate(&request(64, 8)).unwrap();
            assert_eq!(control::context_depth(), 0);
            complete(eager.release(block));
            assert_eq!(control::context_depth(), 0);
            assert_eq!(control::calls("cuCtxPushCurrent_v2"), control::calls("cuCtxPopCurrent_v2"));
        }
    }

    fake_test! {
        fn a_failed_context_push_is_a_typed_error_and_allocates_nothing() {
            let (_device, eager) = setup();
            control::inject("cuCtxPushCurrent_v2", 0, 1, CudaErrorCode::ERROR_INVALID_CONTEXT);
            let error = eager.allocate(&request(64, 8)).unwrap_err();
            let AllocError::Backend { source, .. } = &error else { panic!("expected a backend error, got {error:?}") };
            assert_eq!((source.operation, source.code), ("cuCtxPushCurrent_v2", 201));
            assert_eq!(control::calls("cuMemAlloc_v2"), 0);
            assert_eq!(control::context_depth(), 0);
            let block = eager.allocate(&request(64, 8)).expect("the next call works");
            complete(eager.release(block));
        }
    }

    fake_test! {
        fn stats_count_live_blocks_bytes_and_totals() {
            let (_device, eager) = setup();
            let a = eager.allocate(&request(100, 8)).unwrap();
            let b = eager.allocate(&request(200, 8)).unwrap();
            let stats = eager.stats().unwrap();
            assert_eq!((stats.live_bytes, stats.live_allocations, stats.allocations_total), (300, 2, 2));
            complete(eager.release(a));
            let stats = eager.stats().unwrap();
            assert_eq!((stats.live_bytes, stats.live_allocations, stats.allocations_total), (200, 1, 2));
            complete(eager.release(b));
            assert_eq!(eager.stats().unwrap().live_bytes, 0);
        }
    }

    fake_test! {
        fn threads_allocating_at_once_get_distinct_blocks() {
            let (_device, eager) = setup();
            let blocks = std::sync::Mutex::new(Vec::new());
            std::thread::scope(|s| {
                for t in 0..4 {
                    let (eager, blocks) = (&eager, &blocks);
                    s.spawn(move || {
                        for i in 0..50 {
                            let block = eager.allocate(&request(64 + t * 50 + i, 256)).unwrap();
                            blocks.lock().unwrap().push(block);
                        }
                    });
                }
            });
            let blocks = blocks.into_inner().unwrap();
            let mut addresses: Vec<u64> = blocks.iter().map(|b| b.address().get()).collect();
            addresses.sort_unstable();
            addresses.dedup();
            assert_eq!(addresses.len(), 200);
            for block in blocks {
                complete(eager.release(block));
            }
            assert_eq!(control::used_bytes(), 0);
        }
    }
}

mod pool {
    use super::*;
    use crate::common::fake::control;
    use crate::common::{complete, failed, pattern, request};
    use allocator_cuda::{CudaDevice, CudaError, CudaErrorCode, CudaPoolAllocator, CudaStream, PoolConfig};
    use memory_api::{AllocError, DeviceAllocator, ReleaseError};

    fn setup(config: PoolConfig) -> (CudaDevice, CudaPoolAllocator) {
        let device = CudaDevice::open(0).expect("the fake has device 0");
        let stream = CudaStream::new(&device).expect("a stream");
        let pool = CudaPoolAllocator::new(&stream, config).expect("a pool");
        (device, pool)
    }

    fake_test! {
        fn the_release_threshold_is_set_at_creation() {
            let (_device, pool) = setup(PoolConfig::default());
            assert_eq!(pool.release_threshold(), Ok(u64::MAX));
            let (_device, small) = setup(PoolConfig { release_threshold: MIB as u64 });
            assert_eq!(small.release_threshold(), Ok(MIB as u64));
            assert_eq!(control::calls("cuMemPoolSetAttribute"), 2);
        }
    }

    fake_test! {
        fn freed_blocks_stay_cached_in_the_pool_and_are_reused() {
            let (_device, pool) = setup(PoolConfig::default());
            let block = pool.allocate(&request(MIB, 256)).unwrap();
            assert_eq!(control::used_bytes(), MIB as u64);
            complete(pool.release(block));
            let usage = pool.usage().unwrap();
            assert_eq!((usage.used_bytes, usage.reserved_bytes), (0, MIB as u64));
            let stats = pool.stats().unwrap();
            assert_eq!((stats.cached_bytes, stats.live_allocations), (MIB as u64, 0));
            let again = pool.allocate(&request(MIB, 256)).unwrap();
            assert_eq!(control::used_bytes(), MIB as u64, "the cached block was reused");
            assert_eq!(pool.stats().unwrap().cached_bytes, 0);
            complete(pool.release(again));
        }
    }

    fake_test! {
        fn trim_returns_cached_memory_and_keeps_live_blocks_intact() {
            let (device, pool) = setup(PoolConfig::default());
            let keep = pool.allocate(&request(MIB, 256)).unwrap();
            let drop_me = pool.allocate(&request(MIB, 256)).unwrap();
            let data = pattern(3, 4096);
            // SAFETY: the block is ours and live; the fake runs the stream at once.
            unsafe { device.copy_to_device(keep.address(), &data) }.unwrap();
            complete(pool.release(drop_me));
            assert_eq!(pool.trim(), MIB);
            assert_eq!(pool.stats().unwrap().cached_bytes, 0);
            assert_eq!(pool.trim(), 0, "nothing left to trim");
            assert_eq!(control::calls("cuStreamSynchronize"), 2, "trim waits for queued frees first");
            let mut back = vec![0; 4096];
            // SAFETY: as above.
            unsafe { device.copy_from_device(keep.address(), &mut back) }.unwrap();
            assert_eq!(back, data);
            complete(pool.release(keep));
        }
    }

    fake_test! {
        fn a_zero_threshold_hands_memory_back_when_the_stream_synchronises() {
            let (_device, pool) = setup(PoolConfig { release_threshold: 0 });
            let block = pool.allocate(&request(MIB, 256)).unwrap();
            complete(pool.release(block));
            assert_eq!(pool.usage().unwrap().reserved_bytes, MIB as u64, "a stream-ordered free only caches");
            assert_eq!(pool.stats().unwrap().cached_bytes, MIB as u64);
            pool.stream().synchronize().unwrap();
            assert_eq!(pool.usage().unwrap().reserved_bytes, 0, "the synchronisation released it");
            assert_eq!(control::used_bytes(), 0);
        }
    }

    fake_test! {
        fn an_event_synchronisation_also_hands_memory_above_the_threshold_back() {
            let (device, pool) = setup(PoolConfig { release_threshold: MIB as u64 });
            let blocks: Vec<_> = (0..3).map(|_| pool.allocate(&request(MIB, 256)).unwrap()).collect();
            for block in blocks {
                complete(pool.release(block));
            }
            assert_eq!(pool.usage().unwrap().reserved_bytes, 3 * MIB as u64);
            let eager = std::sync::Arc::new(allocator_cuda::CudaAllocator::new(&device));
            let queue = allocator_cuda::CudaReleaseQueue::new(pool.stream(), 1);
            let block = eager.allocate(&request(64, 8)).unwrap();
            let release = memory_api::PreparedRelease::new(
                crate::common::identity(memory_api::DeviceKey::device(0)),
                eager,
                block,
                Box::new(|_| {}),
            );
            memory_api::DeferredReleaseQueue::enqueue(&queue, release).unwrap();
            assert_eq!(queue.drain(), Ok(1));
            assert_eq!(control::calls("cuEventSynchronize"), 1);
            assert_eq!(pool.usage().unwrap().reserved_bytes, MIB as u64, "the pool kept its threshold's worth");
        }
    }

    fake_test! {
        fn trim_counts_the_cached_memory_its_own_synchronisation_hands_back() {
            // The stream-ordered frees reach the pool when trim synchronises, and with a
            // zero threshold that synchronisation already returns them: trim must count
            // them, or it reports 0 while the pool shrank by a mebibyte.
            let (_device, pool) = setup(PoolConfig { release_threshold: 0 });
            let block = pool.allocate(&request(MIB, 256)).unwrap();
            complete(pool.release(block));
            assert_eq!(pool.stats().unwrap().cached_bytes, MIB as u64);
            assert_eq!(pool.trim(), MIB);
            assert_eq!(pool.stats().unwrap().cached_bytes, 0);
            assert_eq!(control::used_bytes(), 0);
        }
    }

    fake_test! {
        fn a_stream_ordered_fill_lands_before_the_release() {
            let (device, pool) = setup(PoolConfig::default());
            let block = pool.allocate(&request(8192, 256)).unwrap();
            // SAFETY: the block is ours and stays allocated until the stream-ordered
            // release below, which the stream runs after the fill.
            unsafe { pool.stream().memset_async(block.address(), 0x5A, 8192) }.unwrap();
            pool.stream().synchronize().unwrap();
            let mut back = vec![0; 8192];
            // SAFETY: the block is ours and the stream is idle.
            unsafe { device.copy_from_device(block.address(), &mut back) }.unwrap();
            assert!(back.iter().all(|&b| b == 0x5A));
            complete(pool.release(block));
            assert_eq!(control::calls("cuMemFreeAsync"), 1);
        }
    }

    fake_test! {
        env ["FAKE_CUDA_NO_POOLS" = "1"]
        fn a_device_without_pools_is_a_typed_unsupported_error() {
            let device = CudaDevice::open(0).unwrap();
            let stream = CudaStream::new(&device).unwrap();
            let error = CudaPoolAllocator::new(&stream, PoolConfig::default()).unwrap_err();
            assert!(matches!(error, CudaError::Unsupported { ordinal: 0, .. }), "{error:?}");
            assert!(error.to_string().contains("memory pools"), "{error}");
            assert_eq!(control::calls("cuMemPoolCreate"), 0);
        }
    }

    fake_test! {
        env ["FAKE_CUDA_INJECT" = "cuMemPoolSetAttribute:0:1:1"]
        fn a_pool_whose_threshold_cannot_be_set_is_destroyed() {
            let device = CudaDevice::open(0).unwrap();
            let stream = CudaStream::new(&device).unwrap();
            let error = CudaPoolAllocator::new(&stream, PoolConfig::default()).unwrap_err();
            assert!(matches!(error, CudaError::InvalidValue { operation: "cuMemPoolSetAttribute", .. }), "{error:?}");
            assert_eq!(control::live_pools(), 0, "the half-made pool was destroyed");
        }
    }

    fake_test! {
        env ["FAKE_CUDA_INJECT" = "cuMemAllocFromPoolAsync:1:1:2"]
        fn an_out_of_memory_pool_allocation_is_typed_and_leaves_nothing_behind() {
            let (_device, pool) = setup(PoolConfig::default());
            let first = pool.allocate(&request(4096, 256)).unwrap();
            let error = pool.allocate(&request(4096, 256)).unwrap_err();
            assert!(matches!(error, AllocError::OutOfMemory { requested: 4096, align: 256, .. }), "{error:?}");
            let stats = pool.stats().unwrap();
            assert_eq!((stats.live_allocations, stats.failures_total), (1, 1));
            complete(pool.release(first));
        }
    }

    fake_test! {
        fn a_refused_async_free_hands_the_block_back() {
            let (_device, pool) = setup(PoolConfig::default());
            let block = pool.allocate(&request(4096, 256)).unwrap();
            control::inject("cuMemFreeAsync", 0, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            let (block, error) = failed(pool.release(block));
            assert!(matches!(error, ReleaseError::Backend(ref e) if e.operation == "cuMemFreeAsync"), "{error:?}");
            assert_eq!(pool.usage().unwrap().used_bytes, 4096);
            complete(pool.release(block));
            assert_eq!(pool.usage().unwrap().used_bytes, 0);
        }
    }

    fake_test! {
        fn dropping_the_allocator_destroys_its_pool_and_stream() {
            let (device, pool) = setup(PoolConfig::default());
            assert_eq!(control::live_pools(), 1);
            drop(pool);
            assert_eq!(control::live_pools(), 0);
            assert_eq!(control::calls("cuStreamDestroy_v2"), 1);
            assert_eq!(control::primary_retains(0), 1, "the caller's device handle still holds the context");
            drop(device);
            assert_eq!(control::primary_retains(0), 0);
        }
    }
}

mod vmm {
    use super::*;
    use crate::common::fake::control;
    use crate::common::{CudaAccess, complete, failed, pattern, request};
    use allocator_cuda::{CudaDevice, CudaError, CudaErrorCode, CudaVmmAllocator};
    use memory_api::{
        ByteRange, CapabilityError, DeviceAllocator, DeviceKey, MappingAccess, RawAllocation, ReleaseError,
        ReleaseOutcome, SharedBacking, SharedBackingResource, SharedMapping, SharedPlacement, VirtualBacking,
    };
    use memory_testkit::MemoryAccess;
    use std::sync::Arc;

    const G: usize = 2 * MIB;

    fn setup() -> (CudaDevice, CudaVmmAllocator) {
        let device = CudaDevice::open(0).expect("the fake has device 0");
        let vmm = CudaVmmAllocator::new(&device).expect("VMM on the fake");
        assert_eq!(vmm.granularity(), G);
        (device, vmm)
    }

    fn quarantined(outcome: ReleaseOutcome) -> (usize, usize, RawAllocation, ReleaseError) {
        match outcome {
            ReleaseOutcome::Quarantined(q) => {
                let (unmapped, residual) = (q.unmapped_bytes(), q.residual_bytes());
                assert!(!q.was_corrected(), "the allocator's claim broke the honesty rules: {q:?}");
                let (block, error) = q.into_parts();
                (unmapped, residual, block, error)
            }
            other => panic!("expected a quarantine, got {}: {other:?}", other.summary()),
        }
    }

    fake_test! {
        fn reservations_are_rounded_to_the_granularity_and_commit_nothing() {
            let (_device, vmm) = setup();
            let block = vmm.allocate(&request(3 * MIB, 256)).unwrap();
            assert_eq!(block.bytes(), 2 * G, "3 MiB rounds up to two granules");
            assert!(block.address().is_aligned_to(G));
            assert_eq!(vmm.committed_bytes(&block), Ok(0));
            assert_eq!(control::used_bytes(), 0, "a reservation holds no physical memory");
            let stats = vmm.stats().unwrap();
            assert_eq!((stats.reserved_bytes, stats.live_bytes, stats.live_allocations), (2 * G as u64, 0, 1));
            assert_eq!(complete(vmm.release(block)), 0);
            assert_eq!(vmm.stats().unwrap().reserved_bytes, 0);
            assert_eq!(control::calls("cuMemAddressFree"), 1);
        }
    }

    fake_test! {
        fn commit_and_decommit_count_each_granule_once_and_release_reports_the_rest() {
            let (_device, vmm) = setup();
            let block = vmm.allocate(&request(4 * G, G)).unwrap();
            assert_eq!(vmm.commit(&block, ByteRange::new(G, G)), Ok(G));
            assert_eq!(vmm.commit(&block, ByteRange::new(G, G)), Ok(0));
            assert_eq!(vmm.commit(&block, ByteRange::new(0, 3 * G)), Ok(2 * G));
            assert_eq!(vmm.committed_bytes(&block), Ok(3 * G));
            assert_eq!(control::used_bytes(), 3 * G as u64);
            assert_eq!(vmm.stats().unwrap().live_bytes, 3 * G as u64);
            assert_eq!(vmm.decommit(&block, ByteRange::new(0, G)), Ok(G));
            assert_eq!(vmm.decommit(&block, ByteRange::new(0, G)), Ok(0));
            assert_eq!(control::used_bytes(), 2 * G as u64, "decommit returned the physical memory");
            assert_eq!(control::live_handles(), 2);
            assert_eq!(complete(vmm.release(block)), 2 * G);
            assert_eq!((control::used_bytes(), control::live_handles()), (0, 0));
        }
    }

    fake_test! {
        fn ranges_are_checked_against_the_block_and_the_granularity_before_the_driver() {
            let (_device, vmm) = setup();
            let block = vmm.allocate(&request(4 * G, G)).unwrap();
            assert!(matches!(vmm.commit(&block, ByteRange::new(3 * G, 2 * G)), Err(CapabilityError::OutOfBounds { .. })));
            assert!(matches!(vmm.commit(&block, ByteRange::new(G / 2, G)), Err(CapabilityError::Misaligned { .. })));
            assert!(matches!(vmm.decommit(&block, ByteRange::new(0, G + 1)), Err(CapabilityError::Misaligned { .. })));
            assert_eq!(vmm.commit(&block, ByteRange::new(4 * G, 0)), Ok(0));
            assert_eq!(control::calls("cuMemCreate"), 0);
            complete(vmm.release(block));
        }
    }

    fake_test! {
        fn committed_granules_hold_data_and_uncommitted_ones_refuse_copies() {
            let (device, vmm) = setup();
            let access = CudaAccess { device };
            let block = vmm.allocate(&request(2 * G, G)).unwrap();
            assert!(access.write(block.address(), &[1]).is_err(), "nothing is committed yet");
            vmm.commit(&block, ByteRange::new(0, G)).unwrap();
            let data = pattern(9, G);
            access.write(block.address(), &data).unwrap();
            assert_eq!(access.read(block.address(), G).unwrap(), data);
            let second = block.address().checked_add(G).unwrap();
            assert!(access.write(second, &[1]).is_err(), "the second granule is not committed");
            vmm.decommit(&block, ByteRange::new(0, G)).unwrap();
            assert!(access.read(block.address(), 1).is_err(), "a decommitted granule cannot be read");
            complete(vmm.release(block));
        }
    }

    fake_test! {
        fn one_backing_mapped_into_two_blocks_shares_its_bytes_and_read_only_refuses_writes() {
            let (device, vmm) = setup();
            let access = CudaAccess { device };
            let backing = vmm.create_backing(2 * G).unwrap();
            assert_eq!((backing.bytes(), backing.device()), (2 * G, DeviceKey::device(0)));
            let writer = vmm.allocate(&request(2 * G, G)).unwrap();
            let reader = vmm.allocate(&request(G, G)).unwrap();
            let whole = SharedPlacement { target: ByteRange::new(0, 2 * G), backing_offset: 0 };
            vmm.map(&backing, &writer, whole, MappingAccess::ReadWrite).unwrap();
            let second_half = SharedPlacement { target: ByteRange::new(0, G), backing_offset: G };
            vmm.map(&backing, &reader, second_half, MappingAccess::ReadOnly).unwrap();
            assert_eq!(control::live_handles(), 1, "one physical handle behind both blocks");
            assert_eq!(control::used_bytes(), 2 * G as u64, "the shared bytes are paid for once");

            let data = pattern(5, 4096);
            access.write(writer.address().checked_add(G).unwrap(), &data).unwrap();
            assert_eq!(access.read(reader.address(), 4096).unwrap(), data, "visible through the other mapping");
            assert!(access.write(reader.address(), &[0xEE; 8]).is_err(), "a read-only mapping refuses writes");

            drop(backing);
            assert_eq!(control::live_handles(), 1, "mappings keep the physical memory alive");
            assert_eq!(vmm.committed_bytes(&writer), Ok(2 * G));
            assert_eq!(vmm.unmap(&writer, ByteRange::new(0, 2 * G)), Ok(2 * G));
            assert_eq!(complete(vmm.release(reader)), G);
            assert_eq!(control::live_handles(), 0, "the last unmap released the backing");
            assert_eq!(control::used_bytes(), 0);
            complete(vmm.release(writer));
        }
    }

    #[derive(Debug)]
    struct ForeignResource;
    impl SharedBackingResource for ForeignResource {
        fn bytes(&self) -> usize {
            2 * G
        }
    }

    fake_test! {
        env ["FAKE_CUDA_DEVICES" = "2"]
        fn map_refuses_misplaced_foreign_and_overlapping_placements_without_mapping() {
            let (_device, vmm) = setup();
            let backing = vmm.create_backing(2 * G).unwrap();
            let block = vmm.allocate(&request(4 * G, G)).unwrap();
            let rw = MappingAccess::ReadWrite;
            let place = |offset, len, backing_offset| SharedPlacement { target: ByteRange::new(offset, len), backing_offset };
            assert!(matches!(vmm.map(&backing, &block, place(3 * G, 2 * G, 0), rw), Err(CapabilityError::OutOfBounds { .. })));
            assert!(matches!(vmm.map(&backing, &block, place(0, 2 * G, G), rw), Err(CapabilityError::BackingOutOfBounds { .. })));
            assert!(matches!(vmm.map(&backing, &block, place(0, G, G / 2), rw), Err(CapabilityError::Misaligned { .. })));
            let foreign = SharedBacking::new(DeviceKey::device(0), Arc::new(ForeignResource));
            assert!(matches!(vmm.map(&foreign, &block, place(0, G, 0), rw), Err(CapabilityError::ForeignBacking { .. })));
            let other_device = CudaDevice::open(1).unwrap();
            let other_vmm = CudaVmmAllocator::new(&other_device).unwrap();
            let theirs = other_vmm.create_backing(G).unwrap();
            assert!(matches!(vmm.map(&theirs, &block, place(0, G, 0), rw), Err(CapabilityError::ForeignBacking { .. })));
            let their_block = other_vmm.allocate(&request(G, G)).unwrap();
            assert!(matches!(vmm.map(&backing, &their_block, place(0, G, 0), rw), Err(CapabilityError::NotOwned { .. })));
            assert_eq!(control::calls("cuMemMap"), 0, "every refusal came before the driver");

            vmm.commit(&block, ByteRange::new(G, G)).unwrap();
            let overlap = vmm.map(&backing, &block, place(0, 2 * G, 0), rw);
            assert_eq!(overlap, Err(CapabilityError::AlreadyMapped { offset: G, len: G }));
            vmm.map(&backing, &block, place(2 * G, 2 * G, 0), rw).unwrap();
            assert_eq!(
                vmm.commit(&block, ByteRange::new(2 * G, G)),
                Err(CapabilityError::AlreadyMapped { offset: 2 * G, len: G }),
                "commit does not paper over a shared granule"
            );
            assert_eq!(
                vmm.decommit(&block, ByteRange::new(0, 4 * G)),
                Err(CapabilityError::AlreadyMapped { offset: 2 * G, len: G }),
                "shared granules are unmapped, not decommitted"
            );
            assert_eq!(vmm.unmap(&block, ByteRange::new(0, 4 * G)), Ok(3 * G), "unmap takes committed and shared");
            complete(vmm.release(block));
            complete(other_vmm.release(their_block));
        }
    }

    fake_test! {
        fn a_map_whose_access_cannot_be_set_leaves_nothing_mapped() {
            let (_device, vmm) = setup();
            let backing = vmm.create_backing(2 * G).unwrap();
            let block = vmm.allocate(&request(2 * G, G)).unwrap();
            control::inject("cuMemSetAccess", 0, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            let placement = SharedPlacement { target: ByteRange::new(0, 2 * G), backing_offset: 0 };
            let error = vmm.map(&backing, &block, placement, MappingAccess::ReadWrite).unwrap_err();
            assert!(matches!(error, CapabilityError::Backend(ref e) if e.operation == "cuMemSetAccess"), "{error:?}");
            assert_eq!(vmm.committed_bytes(&block), Ok(0));
            assert_eq!(control::calls("cuMemUnmap"), 2, "both mapped granules were undone");
            vmm.map(&backing, &block, placement, MappingAccess::ReadWrite).expect("the range is free again");
            complete(vmm.release(block));
        }
    }

    fake_test! {
        fn a_commit_that_fails_partway_is_undone() {
            let (_device, vmm) = setup();
            let block = vmm.allocate(&request(4 * G, G)).unwrap();
            control::inject("cuMemCreate", 2, 1, CudaErrorCode::ERROR_OUT_OF_MEMORY);
            let error = vmm.commit(&block, ByteRange::new(0, 4 * G)).unwrap_err();
            assert_eq!(error, CapabilityError::OutOfMemory { device: DeviceKey::device(0), requested: 4 * G });
            assert_eq!(vmm.committed_bytes(&block), Ok(0));
            assert_eq!((control::live_handles(), control::used_bytes()), (0, 0), "the two granules made were freed");
            assert_eq!(vmm.stats().unwrap().live_bytes, 0);
            assert_eq!(vmm.commit(&block, ByteRange::new(0, 4 * G)), Ok(4 * G));
            complete(vmm.release(block));
        }
    }

    fake_test! {
        fn a_teardown_whose_second_unmap_fails_is_quarantined_with_the_exact_bytes_and_resumes() {
            let (_device, vmm) = setup();
            let block = vmm.allocate(&request(4 * G, G)).unwrap();
            vmm.commit(&block, ByteRange::new(0, 4 * G)).unwrap();
            control::inject("cuMemUnmap", 1, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            let (unmapped, residual, block, error) = quarantined(vmm.release(block));
            assert_eq!((unmapped, residual), (3 * G, G), "three granules went back, one is still held");
            assert!(matches!(error, ReleaseError::Backend(ref e) if e.operation == "cuMemUnmap"), "{error:?}");
            assert_eq!(control::used_bytes(), G as u64);
            assert_eq!(vmm.committed_bytes(&block), Ok(G), "the record knows which granule is left");
            assert_eq!(vmm.stats().unwrap().live_bytes, G as u64);
            assert_eq!(control::calls("cuMemAddressFree"), 0, "the reservation is kept while anything is mapped");
            assert_eq!(complete(vmm.release(block)), G, "the retry releases only what was left");
            assert_eq!((control::used_bytes(), control::live_handles()), (0, 0));
            assert_eq!(vmm.stats().unwrap().reserved_bytes, 0);
        }
    }

    fake_test! {
        fn a_granule_whose_handle_release_fails_stays_owned_until_the_retry() {
            let (_device, vmm) = setup();
            let block = vmm.allocate(&request(2 * G, G)).unwrap();
            vmm.commit(&block, ByteRange::new(0, 2 * G)).unwrap();
            control::inject("cuMemRelease", 0, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            let (unmapped, residual, block, error) = quarantined(vmm.release(block));
            assert_eq!((unmapped, residual), (G, G));
            assert!(matches!(error, ReleaseError::Backend(ref e) if e.operation == "cuMemRelease"), "{error:?}");
            assert_eq!(vmm.committed_bytes(&block), Ok(0), "the granule is unmapped, only its handle is held");
            assert_eq!(control::used_bytes(), G as u64);
            assert_eq!(complete(vmm.release(block)), G);
            assert_eq!(control::used_bytes(), 0);
        }
    }

    fake_test! {
        fn a_failing_address_free_after_a_full_teardown_is_quarantined_with_nothing_held() {
            let (_device, vmm) = setup();
            let block = vmm.allocate(&request(G, G)).unwrap();
            vmm.commit(&block, ByteRange::new(0, G)).unwrap();
            control::inject("cuMemAddressFree", 0, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            let (unmapped, residual, block, _) = quarantined(vmm.release(block));
            assert_eq!((unmapped, residual), (G, 0));
            assert_eq!(complete(vmm.release(block)), 0);
            assert_eq!(vmm.stats().unwrap().live_allocations, 0);
        }
    }

    fake_test! {
        fn a_release_that_fails_before_changing_anything_is_failed_and_hands_the_block_back() {
            let (_device, vmm) = setup();
            let block = vmm.allocate(&request(G, G)).unwrap();
            vmm.commit(&block, ByteRange::new(0, G)).unwrap();
            control::inject("cuMemUnmap", 0, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            let (block, _) = failed(vmm.release(block));
            assert_eq!(vmm.committed_bytes(&block), Ok(G));
            assert_eq!(complete(vmm.release(block)), G);
        }
    }

    fake_test! {
        fn a_sticky_error_mid_teardown_stops_it_and_reports_the_device_lost() {
            let (device, vmm) = setup();
            let block = vmm.allocate(&request(4 * G, G)).unwrap();
            vmm.commit(&block, ByteRange::new(0, 4 * G)).unwrap();
            control::inject("cuMemUnmap", 1, -1, CudaErrorCode::ERROR_LAUNCH_FAILED);
            let (unmapped, residual, block, error) = quarantined(vmm.release(block));
            assert_eq!((unmapped, residual), (G, 3 * G));
            assert!(matches!(error, ReleaseError::DeviceLost { .. }), "{error:?}");
            assert_eq!(control::calls("cuMemUnmap"), 2, "no call after the sticky error");
            assert!(device.lost().is_some());
            let (block, error) = failed(vmm.release(block));
            assert!(matches!(error, ReleaseError::DeviceLost { .. }));
            assert_eq!(control::calls("cuMemUnmap"), 2, "a lost device is not called again");
            assert!(matches!(
                vmm.commit(&block, ByteRange::new(0, G)),
                Err(CapabilityError::DeviceLost { .. })
            ));
            vmm.forget_lost(vec![block]);
            let stats = vmm.stats().unwrap();
            assert_eq!((stats.live_allocations, stats.reserved_bytes, stats.live_bytes), (0, 0, 0));
        }
    }

    fake_test! {
        fn capability_calls_on_foreign_and_released_blocks_are_not_owned() {
            let (device, vmm) = setup();
            let other = CudaVmmAllocator::new(&device).unwrap();
            let theirs = other.allocate(&request(G, G)).unwrap();
            assert!(matches!(vmm.commit(&theirs, ByteRange::new(0, G)), Err(CapabilityError::NotOwned { .. })));
            assert!(matches!(vmm.committed_bytes(&theirs), Err(CapabilityError::NotOwned { .. })));
            let ours = vmm.allocate(&request(G, G)).unwrap();
            let stale = RawAllocation::new(ours.address(), ours.bytes(), ours.align(), ours.device(), 0);
            complete(vmm.release(ours));
            assert!(matches!(vmm.commit(&stale, ByteRange::new(0, G)), Err(CapabilityError::NotOwned { .. })));
            assert!(matches!(failed(vmm.release(stale)).1, ReleaseError::NotOwned { .. }));
            complete(other.release(theirs));
        }
    }

    fake_test! {
        fn a_stale_copy_never_releases_the_reservation_that_reused_its_address() {
            // The driver hands a freed range of address space out again (the fake at
            // once): a copy of a released block then has the address, size and
            // alignment of a live one, and must still be refused.
            let (_device, vmm) = setup();
            let first = vmm.allocate(&request(G, G)).unwrap();
            let stale = RawAllocation::new(first.address(), first.bytes(), first.align(), first.device(), first.provider_tag());
            complete(vmm.release(first));
            let reused = vmm.allocate(&request(G, G)).unwrap();
            assert_eq!(reused.address(), stale.address(), "the fake reuses the freed range");
            assert!(matches!(vmm.commit(&stale, ByteRange::new(0, G)), Err(CapabilityError::NotOwned { .. })));
            assert!(matches!(failed(vmm.release(stale)).1, ReleaseError::NotOwned { .. }));
            assert_eq!(vmm.committed_bytes(&reused), Ok(0), "the reused reservation is untouched");
            assert_eq!(vmm.commit(&reused, ByteRange::new(0, G)), Ok(G));
            assert_eq!(vmm.stats().unwrap().live_allocations, 1);
            assert_eq!(complete(vmm.release(reused)), G);
        }
    }

    fake_test! {
        env ["FAKE_CUDA_NO_VMM" = "1"]
        fn a_device_without_vmm_is_a_typed_unsupported_error() {
            let device = CudaDevice::open(0).unwrap();
            let error = CudaVmmAllocator::new(&device).unwrap_err();
            assert!(matches!(error, CudaError::Unsupported { ordinal: 0, .. }), "{error:?}");
            assert!(error.to_string().contains("virtual memory management"), "{error}");
        }
    }

    fake_test! {
        env ["FAKE_CUDA_MEM_BYTES" = "4194304"]
        fn a_backing_larger_than_the_device_is_out_of_memory() {
            let (_device, vmm) = setup();
            let error = vmm.create_backing(4 * G).unwrap_err();
            assert_eq!(error, CapabilityError::OutOfMemory { device: DeviceKey::device(0), requested: 4 * G });
            assert!(matches!(vmm.create_backing(G + 1), Err(CapabilityError::Misaligned { .. })));
            assert!(matches!(vmm.create_backing(0), Err(CapabilityError::Misaligned { .. })));
        }
    }
}

mod pinned {
    use crate::common::fake::control;
    use crate::common::{complete, pattern, request};
    use allocator_cuda::{CudaDevice, CudaErrorCode, PinnedHostAllocator};
    use memory_api::{AllocError, DeviceAllocator, DeviceKey, RawAllocation};

    fake_test! {
        fn pinned_blocks_are_aligned_host_memory_that_holds_data() {
            let device = CudaDevice::open(0).unwrap();
            let pinned = PinnedHostAllocator::new(&device);
            assert_eq!(pinned.device(), DeviceKey::HOST);
            for align in [8, 4096, 65536] {
                let block = pinned.allocate(&request(10_000, align)).unwrap();
                assert!(block.address().is_aligned_to(align));
                assert_eq!(block.device(), DeviceKey::HOST);
                let data = pattern(align as u8, 10_000);
                let pointer: *mut u8 = std::ptr::with_exposed_provenance_mut(block.address().get() as usize);
                // SAFETY: the block is 10,000 bytes of live host memory that we own and
                // nothing else references.
                let bytes = unsafe { std::slice::from_raw_parts_mut(pointer, 10_000) };
                bytes.copy_from_slice(&data);
                let mut back = vec![0; 10_000];
                // SAFETY: the driver reads the same live block; no reference is in use.
                unsafe { device.copy_from_device(block.address(), &mut back) }.unwrap();
                assert_eq!(back, data);
                complete(pinned.release(block));
            }
            assert_eq!(control::calls("cuMemHostAlloc"), control::calls("cuMemFreeHost"));
        }
    }

    fake_test! {
        fn lost_pinned_blocks_are_freed_while_their_context_lives_and_only_forgotten_once_it_is_lost() {
            let device = CudaDevice::open(0).unwrap();
            let pinned = PinnedHostAllocator::new(&device);
            // The host key lost (its context alive): nothing else would free the memory.
            let (a, b) = (pinned.allocate(&request(8192, 64)).unwrap(), pinned.allocate(&request(64, 8)).unwrap());
            let stale = RawAllocation::new(b.address(), b.bytes(), b.align(), b.device(), b.provider_tag());
            pinned.forget_lost(vec![a, b, stale]);
            assert_eq!(control::calls("cuMemFreeHost"), 2, "each lost block freed once, the stale copy refused");
            assert_eq!(pinned.stats().unwrap().live_allocations, 0);
            // The pinning context lost: the memory went with it; only the books go.
            let c = pinned.allocate(&request(4096, 64)).unwrap();
            control::set_sticky(CudaErrorCode::ERROR_ILLEGAL_ADDRESS);
            assert!(pinned.allocate(&request(64, 8)).is_err(), "the sticky error marks the context lost");
            pinned.forget_lost(vec![c]);
            assert_eq!(control::calls("cuMemFreeHost"), 2, "no driver call on a lost context");
            assert_eq!(pinned.stats().unwrap().live_allocations, 0, "forgotten blocks leave the books");
        }
    }

    fake_test! {
        fn a_refused_host_allocation_is_typed_on_the_host_key() {
            let device = CudaDevice::open(0).unwrap();
            let pinned = PinnedHostAllocator::new(&device);
            control::inject("cuMemHostAlloc", 0, 1, CudaErrorCode::ERROR_OUT_OF_MEMORY);
            let error = pinned.allocate(&request(4096, 64)).unwrap_err();
            assert!(matches!(error, AllocError::OutOfMemory { device: DeviceKey::HOST, requested: 4096, .. }), "{error:?}");
            assert_eq!(pinned.stats().unwrap().failures_total, 1);
        }
    }
}

mod queue {
    use crate::common::fake::control;
    use crate::common::{identity, request};
    use allocator_cuda::{CudaAllocator, CudaDevice, CudaErrorCode, CudaReleaseQueue, CudaStream};
    use memory_api::{
        DeferredReleaseQueue, DeviceAllocator, DeviceKey, PreparedRelease, QueueRefusalReason, ReleaseError,
        ReleaseOutcome, ReleaseSummary,
    };
    use std::sync::{Arc, Mutex};

    type Log = Arc<Mutex<Vec<(usize, ReleaseSummary, bool)>>>;

    struct Setup {
        eager: Arc<CudaAllocator>,
        queue: Arc<CudaReleaseQueue>,
        log: Log,
    }

    fn setup(capacity: usize) -> Setup {
        let device = CudaDevice::open(0).expect("the fake has device 0");
        let stream = CudaStream::new(&device).expect("a stream");
        Setup {
            eager: Arc::new(CudaAllocator::new(&device)),
            queue: Arc::new(CudaReleaseQueue::new(&stream, capacity)),
            log: Log::default(),
        }
    }

    impl Setup {
        /// A prepared release of a fresh block whose completion logs `index`.
        fn prepared(&self, index: usize) -> PreparedRelease {
            let block = self.eager.allocate(&request(4096, 256)).unwrap();
            let log = Arc::clone(&self.log);
            PreparedRelease::new(
                identity(DeviceKey::device(0)),
                self.eager.clone(),
                block,
                Box::new(move |outcome: ReleaseOutcome| {
                    let abandoned =
                        matches!(&outcome, ReleaseOutcome::Quarantined(q) if *q.error() == ReleaseError::Abandoned);
                    log.lock().unwrap().push((index, outcome.summary(), abandoned));
                }),
            )
        }

        fn ran(&self) -> Vec<usize> {
            self.log.lock().unwrap().iter().map(|(index, _, _)| *index).collect()
        }
    }

    fake_test! {
        fn releases_wait_for_their_event_and_run_in_enqueue_order() {
            let s = setup(8);
            control::hold_events(true);
            for index in 0..3 {
                s.queue.enqueue(s.prepared(index)).unwrap();
            }
            assert_eq!(s.queue.poll(), Ok(0), "no event has completed");
            assert_eq!(s.queue.len(), 3);
            assert!(s.ran().is_empty());
            assert_eq!(s.eager.stats().unwrap().live_allocations, 3, "nothing was freed early");
            control::complete_events();
            assert_eq!(s.queue.poll(), Ok(3));
            assert_eq!(s.ran(), vec![0, 1, 2]);
            assert!(s.log.lock().unwrap().iter().all(|(_, summary, _)| matches!(summary, ReleaseSummary::Complete { .. })));
            assert_eq!(s.eager.stats().unwrap().live_allocations, 0);
            assert!(s.queue.is_empty());
        }
    }

    fake_test! {
        fn only_the_completed_prefix_runs() {
            let s = setup(8);
            control::hold_events(true);
            s.queue.enqueue(s.prepared(0)).unwrap();
            control::complete_events();
            s.queue.enqueue(s.prepared(1)).unwrap();
            assert_eq!(s.queue.poll(), Ok(1));
            assert_eq!(s.ran(), vec![0]);
            assert_eq!(s.queue.len(), 1);
            assert_eq!(s.queue.drain(), Ok(1), "drain waits for the pending event");
            assert_eq!(s.ran(), vec![0, 1]);
        }
    }

    fake_test! {
        fn a_full_queue_hands_back_the_exact_release() {
            let s = setup(1);
            control::hold_events(true);
            s.queue.enqueue(s.prepared(0)).unwrap();
            let offered = s.prepared(1);
            let identity = *offered.identity();
            let refusal = s.queue.enqueue(offered).unwrap_err();
            assert_eq!(refusal.reason, QueueRefusalReason::Full { capacity: 1 });
            assert_eq!(*refusal.release.identity(), identity, "the very release offered comes back");
            let block = refusal.release.cancel();
            assert!(matches!(s.eager.release(block), ReleaseOutcome::Complete(_)));
            assert_eq!(s.queue.drain(), Ok(1));
        }
    }

    fake_test! {
        fn a_release_for_another_device_or_a_closed_queue_is_refused() {
            let s = setup(4);
            let block = s.eager.allocate(&request(64, 8)).unwrap();
            let elsewhere = PreparedRelease::new(identity(DeviceKey::device(3)), s.eager.clone(), block, Box::new(|_| {}));
            let refusal = s.queue.enqueue(elsewhere).unwrap_err();
            assert_eq!(
                refusal.reason,
                QueueRefusalReason::WrongDevice { queue: DeviceKey::device(0), release: DeviceKey::device(3) }
            );
            assert!(matches!(s.eager.release(refusal.release.cancel()), ReleaseOutcome::Complete(_)));
            s.queue.close();
            let refusal = s.queue.enqueue(s.prepared(0)).unwrap_err();
            assert_eq!(refusal.reason, QueueRefusalReason::Closed);
            assert!(matches!(s.eager.release(refusal.release.cancel()), ReleaseOutcome::Complete(_)));
            assert_eq!(control::calls("cuEventRecord"), 0, "refusals record nothing");
        }
    }

    fake_test! {
        fn an_event_that_cannot_be_recorded_closes_the_queue_and_hands_the_release_back() {
            let s = setup(4);
            control::inject("cuEventRecord", 0, 1, CudaErrorCode::ERROR_INVALID_VALUE);
            let refusal = s.queue.enqueue(s.prepared(0)).unwrap_err();
            let QueueRefusalReason::Backend(source) = &refusal.reason else {
                panic!("expected the driver's error, got {:?}", refusal.reason)
            };
            assert_eq!((source.operation, source.code), ("cuEventRecord", 1));
            assert!(s.queue.is_closed());
            let again = s.queue.enqueue(s.prepared(1)).unwrap_err();
            assert_eq!(again.reason, QueueRefusalReason::Closed, "later releases meet a closed queue");
            assert!(matches!(s.eager.release(again.release.cancel()), ReleaseOutcome::Complete(_)));
            assert!(matches!(s.eager.release(refusal.release.cancel()), ReleaseOutcome::Complete(_)));
        }
    }

    fake_test! {
        fn dropping_the_queue_quarantines_releases_whose_work_is_pending() {
            let s = setup(4);
            control::hold_events(true);
            s.queue.enqueue(s.prepared(0)).unwrap();
            let Setup { eager, queue, log } = s;
            drop(queue);
            let log = log.lock().unwrap();
            assert_eq!(log.len(), 1);
            assert!(log[0].2, "the completion was told the release was abandoned: {:?}", log[0]);
            assert_eq!(control::calls("cuMemFree_v2"), 0, "memory the device may use was not freed");
            assert_eq!(eager.stats().unwrap().live_allocations, 1);
            assert_eq!(control::live_events(), 0, "the queue's events were destroyed");
        }
    }

    fake_test! {
        fn a_completion_that_polls_the_queue_again_does_not_deadlock() {
            let s = setup(4);
            let block = s.eager.allocate(&request(64, 8)).unwrap();
            let queue = Arc::clone(&s.queue);
            let nested = Arc::new(Mutex::new(None));
            let seen = Arc::clone(&nested);
            let release = PreparedRelease::new(
                identity(DeviceKey::device(0)),
                s.eager.clone(),
                block,
                Box::new(move |_| *seen.lock().unwrap() = Some(queue.poll())),
            );
            s.queue.enqueue(release).unwrap();
            assert_eq!(s.queue.poll(), Ok(1));
            assert_eq!(*nested.lock().unwrap(), Some(Ok(0)), "the nested poll returned at once");
        }
    }

    fake_test! {
        fn events_are_reused_across_releases() {
            let s = setup(2);
            for index in 0..10 {
                s.queue.enqueue(s.prepared(index)).unwrap();
                assert_eq!(s.queue.poll(), Ok(1));
            }
            assert_eq!(control::calls("cuEventCreate"), 1);
            assert_eq!(control::calls("cuEventRecord"), 10);
        }
    }

    /// An allocator whose every release panics (a hostile or buggy inner allocator).
    struct PanicsOnRelease;

    impl DeviceAllocator for PanicsOnRelease {
        fn device(&self) -> DeviceKey {
            DeviceKey::device(0)
        }
        fn name(&self) -> &str {
            "panics-on-release"
        }
        fn allocate(
            &self,
            request: &memory_api::AllocationRequest,
        ) -> Result<memory_api::RawAllocation, memory_api::AllocError> {
            let address = memory_api::DeviceAddress::new(0x10_0000).expect("non-zero");
            Ok(memory_api::RawAllocation::new(address, request.bytes(), request.align(), DeviceKey::device(0), 0))
        }
        fn release(&self, _allocation: memory_api::RawAllocation) -> ReleaseOutcome {
            panic!("a queued release panicked (on purpose)");
        }
    }

    fake_test! {
        fn a_queued_release_that_panics_does_not_stop_later_polls_and_drains() {
            let s = setup(8);
            let hostile: Arc<dyn DeviceAllocator> = Arc::new(PanicsOnRelease);
            let panicked = Arc::new(Mutex::new(Vec::new()));
            let prepared_panicking = || {
                let seen = Arc::clone(&panicked);
                PreparedRelease::new(
                    identity(DeviceKey::device(0)),
                    Arc::clone(&hostile),
                    hostile.allocate(&request(64, 8)).unwrap(),
                    Box::new(move |outcome: ReleaseOutcome| seen.lock().unwrap().push(outcome.summary())),
                )
            };
            for release in [prepared_panicking(), s.prepared(1), s.prepared(2)] {
                s.queue.enqueue(release).unwrap();
            }
            let first = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.queue.poll()));
            assert!(first.is_err(), "the panic reaches the caller of poll");
            assert_eq!(panicked.lock().unwrap().len(), 1, "the panicking release's owner was told (quarantined)");
            assert_eq!(s.queue.len(), 2, "nothing else was lost with the panic");
            // Before the fix the panic poisoned the runner lock and every later poll
            // answered Ok(0) without running anything.
            assert_eq!(s.queue.poll(), Ok(2), "the next poll runs the releases behind it");
            assert_eq!(s.ran(), vec![1, 2]);

            control::hold_events(true);
            for release in [prepared_panicking(), s.prepared(3)] {
                s.queue.enqueue(release).unwrap();
            }
            let second = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.queue.drain()));
            assert!(second.is_err());
            assert_eq!(s.queue.drain(), Ok(1), "drain recovers as well");
            assert_eq!(s.ran(), vec![1, 2, 3]);
            assert!(s.queue.is_empty());
            assert_eq!(s.eager.stats().unwrap().live_allocations, 0, "every real block was freed");
            assert_eq!(panicked.lock().unwrap().len(), 2);
        }
    }

    fake_test! {
        fn dropping_a_queue_whose_due_release_panics_runs_the_others_then_re_raises() {
            let s = setup(8);
            let hostile: Arc<dyn DeviceAllocator> = Arc::new(PanicsOnRelease);
            let block = hostile.allocate(&request(64, 8)).unwrap();
            let panicking = PreparedRelease::new(identity(DeviceKey::device(0)), hostile, block, Box::new(|_| {}));
            s.queue.enqueue(panicking).unwrap();
            s.queue.enqueue(s.prepared(1)).unwrap();
            let Setup { eager, queue, log } = s;
            let queue = Arc::into_inner(queue).expect("the only handle");
            let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(queue)));
            assert!(dropped.is_err(), "the release's panic is not swallowed");
            let log = log.lock().unwrap();
            assert_eq!(log.len(), 1);
            assert!(
                matches!(log[0], (1, ReleaseSummary::Complete { .. }, false)),
                "the due release behind the panicking one ran instead of being abandoned: {:?}",
                log[0]
            );
            assert_eq!(eager.stats().unwrap().live_allocations, 0);
            assert_eq!(control::live_events(), 0, "the queue's events were destroyed");
        }
    }

    fake_test! {
        fn a_sticky_error_while_polling_keeps_the_releases_queued() {
            let s = setup(4);
            control::hold_events(true);
            s.queue.enqueue(s.prepared(0)).unwrap();
            control::set_sticky(CudaErrorCode::ERROR_ECC_UNCORRECTABLE);
            let error = s.queue.poll().unwrap_err();
            assert!(error.is_device_lost(), "{error:?}");
            assert_eq!(s.queue.len(), 1, "the release is still queued, not lost");
            assert!(s.ran().is_empty());
        }
    }
}

mod conformance {
    use crate::common::CudaAccess;
    use allocator_cuda::{
        CudaAllocator, CudaDevice, CudaPoolAllocator, CudaStream, CudaVmmAllocator, PinnedHostAllocator, PoolConfig,
    };
    use memory_testkit::conformance::Suite;

    fn device() -> CudaDevice {
        CudaDevice::open(0).expect("the fake has device 0")
    }

    fake_test! {
        fn the_eager_allocator_passes_the_conformance_suite() {
            let device = device();
            let access = CudaAccess { device: device.clone() };
            let report = Suite::new(|| CudaAllocator::new(&device)).with_access(&access).run();
            eprintln!("{report}");
            report.assert_passed();
            assert!(report.ran("memory_is_writable"));
        }
    }

    fake_test! {
        fn the_pool_allocator_passes_the_conformance_suite() {
            let device = device();
            let access = CudaAccess { device: device.clone() };
            let stream = CudaStream::new(&device).unwrap();
            let report = Suite::new(|| CudaPoolAllocator::new(&stream, PoolConfig::default()).expect("a pool"))
                .with_access(&access)
                .run();
            eprintln!("{report}");
            report.assert_passed();
            assert!(report.ran("trim_keeps_live_blocks"));
        }
    }

    fake_test! {
        fn the_vmm_allocator_passes_the_conformance_suite() {
            let device = device();
            let access = CudaAccess { device: device.clone() };
            let report = Suite::new(|| CudaVmmAllocator::new(&device).expect("VMM")).with_access(&access).run();
            eprintln!("{report}");
            report.assert_passed();
            for check in ["virtual_memory_access", "shared_visibility_across_mappings", "shared_read_only"] {
                assert!(report.ran(check), "{check} did not run");
            }
        }
    }

    fake_test! {
        fn the_pinned_host_allocator_passes_the_conformance_suite() {
            let device = device();
            let access = CudaAccess { device: device.clone() };
            let report = Suite::new(|| PinnedHostAllocator::new(&device)).with_access(&access).run();
            eprintln!("{report}");
            report.assert_passed();
        }
    }
}
