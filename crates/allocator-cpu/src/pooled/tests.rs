//! Tests of the pool as a whole: both caches through the `DeviceAllocator` interface,
//! fault injection from the inner allocator, and a model test of random operations.

use std::panic::{AssertUnwindSafe, catch_unwind};

use memory_api::MaybeBytes;
use memory_testkit::{Callback, FaultyAllocator, RecordingAllocator};

use super::*;
use crate::SystemAllocator;

impl<A: DeviceAllocator> PooledAllocator<A> {
    /// Panics unless the books agree with the records: each shard's cached bytes are
    /// its cached class blocks; pieces tile their segment in address order with
    /// consistent links, no two free pieces neighbour, live counts match, the free
    /// index holds exactly the reusable free pieces, and the segments' cached bytes
    /// are their sum.
    fn assert_consistent(&self) {
        for index in 0..self.shards.len() {
            self.shards.lock(index).expect("shard").assert_consistent(index);
        }
        self.segments().assert_consistent();
    }
}

const KIB: usize = 1024;

fn request(bytes: usize, align: usize) -> AllocationRequest {
    AllocationRequest::new(bytes, align).unwrap()
}

fn one_shard(max_cached_bytes: usize) -> PoolConfig {
    PoolConfig { max_cached_bytes, max_class_bytes: 1 << 20, shards: 1 }
}

#[test]
fn released_blocks_are_reused_without_reaching_the_inner_allocator() {
    let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
    let first = pool.allocate(&request(64 * KIB, 256)).unwrap();
    let address = first.address();
    assert_eq!(pool.release(first).summary(), memory_api::ReleaseSummary::Complete { unmapped_bytes: 0 });
    let second = pool.allocate(&request(60 * KIB, 64)).unwrap();
    assert_eq!(second.address(), address, "a request of the same class reuses the cached block");
    assert_eq!(second.bytes(), 60 * KIB);
    let recorder = pool.inner();
    assert_eq!((recorder.calls(Callback::Allocate), recorder.calls(Callback::Release)), (1, 0));
    let stats = pool.pool_stats();
    assert_eq!((stats.hits, stats.misses, stats.live_blocks, stats.cached_blocks), (1, 1, 1, 0));
    assert_eq!(stats.requested_bytes, 124 * KIB as u64);
    assert!(pool.release(second).is_complete());
    assert_eq!(pool.trim(), 64 * KIB);
    assert_eq!(pool.inner().calls(Callback::Release), 1);
}

#[test]
fn the_cache_cap_passes_releases_through_to_the_inner_allocator() {
    let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(64 * KIB));
    let a = pool.allocate(&request(64 * KIB, 8)).unwrap();
    let b = pool.allocate(&request(64 * KIB, 8)).unwrap();
    assert!(pool.release(a).is_complete());
    let ReleaseOutcome::Complete(done) = pool.release(b) else { panic!("must complete") };
    assert_eq!(done.unmapped_bytes(), 64 * KIB, "the second block is freed, not cached");
    let stats = pool.pool_stats();
    assert_eq!((stats.cached_bytes, stats.passed_through), (64 * KIB as u64, 1));
    assert_eq!(pool.inner().calls(Callback::Release), 1);
}

#[test]
fn large_blocks_are_cached_by_exact_rounded_size() {
    let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
    let big = pool.allocate(&request(3 << 20, 8)).unwrap();
    assert!(big.address().is_aligned_to(4096));
    assert!(pool.release(big).is_complete());
    let other = pool.allocate(&request((3 << 20) + 4096, 8)).unwrap();
    assert_eq!(pool.pool_stats().hits, 0, "a different large size is not served from the cache");
    let same = pool.allocate(&request((3 << 20) - 100, 8)).unwrap();
    assert_eq!(pool.pool_stats().hits, 1, "the same size rounded to 4 KiB is");
    for block in [other, same] {
        assert!(pool.release(block).is_complete());
    }
}

#[test]
fn alignments_beyond_the_class_alignment_bypass_the_cache() {
    let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
    let block = pool.allocate(&request(1000, 8192)).unwrap();
    assert!(block.address().is_aligned_to(8192));
    let ReleaseOutcome::Complete(done) = pool.release(block) else { panic!("must complete") };
    assert_eq!(done.unmapped_bytes(), 1000, "an uncached block is released to the inner allocator at once");
    assert_eq!(pool.pool_stats().cached_blocks, 0);
}

#[test]
fn cached_or_repeated_releases_are_refused() {
    let pool = PooledAllocator::new(SystemAllocator::new());
    let block = pool.allocate(&request(512, 8)).unwrap();
    let copy = RawAllocation::new(block.address(), 512, 8, block.device(), block.provider_tag());
    assert!(pool.release(block).is_complete());
    let ReleaseOutcome::Failed(failed) = pool.release(copy) else { panic!("a second release must be refused") };
    assert!(matches!(failed.error(), ReleaseError::NotOwned { .. }));
    assert_eq!(pool.pool_stats().cached_blocks, 1, "the cached block was not disturbed");
}

#[test]
fn an_inner_out_of_memory_trims_the_cache_and_retries_once() {
    let pool = PooledAllocator::new(FaultyAllocator::new(SystemAllocator::new()));
    let cached = pool.allocate(&request(4 * KIB, 8)).unwrap();
    assert!(pool.release(cached).is_complete());
    let oom = AllocError::OutOfMemory { device: DeviceKey::HOST, requested: 0, align: 0, available: MaybeBytes(None) };
    pool.inner().fail_nth_allocate_with(1, oom.clone());
    let block = pool.allocate(&request(100 * KIB, 8)).unwrap();
    assert_eq!(pool.pool_stats().cached_blocks, 0, "the retry followed a trim");
    assert_eq!(pool.inner().inner().stats().unwrap().live_allocations, 1);
    // With nothing left to trim the error comes back, naming the caller's request.
    pool.inner().fail_nth_allocate_with(1, oom);
    let err = pool.allocate(&request(5000, 8)).unwrap_err();
    assert_eq!(
        err,
        AllocError::OutOfMemory { device: DeviceKey::HOST, requested: 5000, align: 8, available: MaybeBytes(None) }
    );
    assert_eq!(pool.stats().unwrap().failures_total, 1);
    assert!(pool.release(block).is_complete());
}

#[test]
fn a_failed_inner_release_hands_the_block_back_for_a_retry() {
    let pool = PooledAllocator::with_config(FaultyAllocator::new(SystemAllocator::new()), one_shard(0));
    let block = pool.allocate(&request(1000, 8)).unwrap();
    pool.inner().fail_nth(Callback::Release, 1);
    let ReleaseOutcome::Failed(failed) = pool.release(block) else { panic!("expected Failed") };
    let (block, error) = failed.into_parts();
    assert!(matches!(error, ReleaseError::Backend(ref e) if memory_testkit::is_injected(e)));
    assert_eq!(pool.pool_stats().live_blocks, 1, "the block is still live in the pool");
    assert!(pool.release(block).is_complete());
    assert_eq!(pool.pool_stats().live_blocks, 0);
}

#[test]
fn a_quarantined_inner_release_is_capped_to_the_callers_block_and_retryable() {
    let pool = PooledAllocator::with_config(FaultyAllocator::new(SystemAllocator::new()), one_shard(0));
    let bytes = 2_000_001; // a large block: the inner block is rounded up to 2_002_944
    let block = pool.allocate(&request(bytes, 8)).unwrap();
    // The inner block (2_002_944 bytes) reports 4096 unmapped and the rest owned.
    pool.inner().quarantine_nth_release(1, 4096, 2_002_944 - 4096);
    let ReleaseOutcome::Quarantined(q) = pool.release(block) else { panic!("expected a quarantine") };
    // The residual is kept whole (ownership errs on the safe side); the unmapped
    // bytes are capped to what is left of the caller's block.
    assert_eq!((q.unmapped_bytes(), q.residual_bytes()), (bytes - (2_002_944 - 4096), 2_002_944 - 4096));
    assert!(!q.was_corrected(), "the pool reports an honest quarantine");
    let (block, _) = q.into_parts();
    assert!(pool.release(block).is_complete());
}

#[test]
fn trim_keeps_blocks_the_inner_allocator_refuses_and_retries_quarantined_ones() {
    let pool = PooledAllocator::new(FaultyAllocator::new(SystemAllocator::new()));
    let a = pool.allocate(&request(8 * KIB, 8)).unwrap();
    assert!(pool.release(a).is_complete());
    pool.inner().fail_nth(Callback::Release, 1);
    assert_eq!(pool.trim(), 0);
    assert_eq!(pool.pool_stats().cached_bytes, 8 * KIB as u64, "a refused block stays cached");
    pool.inner().quarantine_nth_release(1, 0, 8 * KIB);
    assert_eq!(pool.trim(), 0);
    let stats = pool.pool_stats();
    assert_eq!((stats.cached_bytes, stats.quarantined_blocks), (0, 1));
    assert_eq!(pool.trim(), 8 * KIB, "the next trim retries the quarantined block");
    assert_eq!(pool.pool_stats().quarantined_blocks, 0);
    assert_eq!(pool.inner().inner().stats().unwrap().live_allocations, 0);
}

#[test]
fn a_panicking_inner_allocator_leaves_the_pool_consistent() {
    let pool = PooledAllocator::new(FaultyAllocator::new(SystemAllocator::new()));
    pool.inner().panic_on_nth(Callback::Allocate, 1);
    assert!(catch_unwind(AssertUnwindSafe(|| pool.allocate(&request(64, 8)))).is_err());
    let stats = pool.pool_stats();
    assert_eq!((stats.live_blocks, stats.misses, stats.hits), (0, 0, 0));
    let block = pool.allocate(&request(64, 8)).unwrap();
    assert!(pool.release(block).is_complete());
}

#[test]
fn forget_lost_drops_the_records_and_forwards_the_inner_blocks() {
    let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
    let a = pool.allocate(&request(64, 8)).unwrap();
    let b = pool.allocate(&request(64, 8)).unwrap();
    pool.forget_lost(vec![a]);
    assert_eq!(pool.inner().forgotten_blocks(), 1);
    assert_eq!(pool.pool_stats().live_blocks, 1);
    assert!(pool.release(b).is_complete());
}

#[test]
fn a_block_released_on_another_thread_returns_to_its_home_shard() {
    let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
    let block = pool.allocate(&request(64 * KIB, 8)).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| assert!(pool.release(block).is_complete()));
    });
    let again = pool.allocate(&request(64 * KIB, 8)).unwrap();
    assert_eq!(pool.pool_stats().hits, 1);
    assert_eq!(pool.inner().calls(Callback::Allocate), 1);
    assert!(pool.release(again).is_complete());
}

const MIB: usize = 1 << 20;

fn address_of(block: &RawAllocation) -> u64 {
    block.address().get()
}

#[test]
fn a_free_segment_serves_smaller_large_requests_by_splitting() {
    let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(256 * MIB));
    let big = pool.allocate(&request(8 * MIB, 64)).unwrap();
    let base = address_of(&big);
    assert!(pool.release(big).is_complete());
    let first = pool.allocate(&request(3 * MIB - 100, 64)).unwrap();
    assert_eq!(address_of(&first), base, "best fit starts at the free piece");
    let second = pool.allocate(&request(4 * MIB, 64)).unwrap();
    assert_eq!(address_of(&second), base + 3 * MIB as u64, "the split-off rest serves the next request");
    assert_eq!(pool.inner().calls(Callback::Allocate), 1, "both came out of the one segment");
    let stats = pool.pool_stats();
    assert_eq!((stats.hits, stats.misses, stats.segments, stats.segment_bytes), (2, 1, 1, 8 * MIB as u64));
    // 1 MiB is left: too small for another large request, so it went with the
    // second piece instead of staying behind as a free piece nothing could use.
    assert_eq!((stats.cached_bytes, stats.cached_blocks), (0, 0));
    let third = pool.allocate(&request(2 * MIB, 64)).unwrap();
    assert_eq!(pool.inner().calls(Callback::Allocate), 2, "nothing free holds 2 MiB");
    for block in [first, second, third] {
        assert!(pool.release(block).is_complete());
    }
}

#[test]
fn freed_pieces_merge_with_free_neighbours_into_the_whole_segment() {
    let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(256 * MIB));
    let big = pool.allocate(&request(12 * MIB, 64)).unwrap();
    let base = address_of(&big);
    assert!(pool.release(big).is_complete());
    let pieces: Vec<_> = (0..3).map(|_| pool.allocate(&request(4 * MIB, 64)).unwrap()).collect();
    let addresses: Vec<u64> = pieces.iter().map(address_of).collect();
    assert_eq!(addresses, [base, base + 4 * MIB as u64, base + 8 * MIB as u64]);
    // Free the middle, then the ends: every order must end in one free piece.
    let [a, b, c] = <[RawAllocation; 3]>::try_from(pieces).unwrap();
    for block in [b, c, a] {
        assert!(pool.release(block).is_complete());
    }
    let stats = pool.pool_stats();
    assert_eq!((stats.cached_blocks, stats.cached_bytes), (1, 12 * MIB as u64), "{stats:?}");
    let whole = pool.allocate(&request(12 * MIB, 64)).unwrap();
    assert_eq!(address_of(&whole), base, "the merged segment serves a request of its full size");
    assert_eq!(pool.inner().calls(Callback::Allocate), 1);
    assert!(pool.release(whole).is_complete());
    assert_eq!(pool.trim(), 12 * MIB);
    assert_eq!(pool.pool_stats().segments, 0);
}

#[test]
fn the_cap_evicts_the_least_recently_idle_segment_to_keep_the_newest_block() {
    // The pattern of ONNX Runtime's first two runs: many buffers of one run are
    // cached, then the next run asks for one block larger than any of them.
    let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(24 * MIB));
    let old: Vec<_> = [4, 6, 5].map(|mib| pool.allocate(&request(mib * MIB, 64)).unwrap()).into();
    for block in old {
        assert!(pool.release(block).is_complete());
    }
    assert_eq!(pool.pool_stats().cached_bytes, 15 * MIB as u64);
    let pattern = pool.allocate(&request(16 * MIB, 64)).unwrap();
    assert!(pool.release(pattern).is_complete());
    let stats = pool.pool_stats();
    assert_eq!((stats.evicted_segments, stats.evicted_bytes), (2, 10 * MIB as u64), "the 4 and 6 MiB went first");
    assert_eq!((stats.cached_bytes, stats.passed_through), (21 * MIB as u64, 0));
    let releases = pool.inner().calls(Callback::Release);
    let allocations = pool.inner().calls(Callback::Allocate);
    for _ in 0..3 {
        let again = pool.allocate(&request(16 * MIB, 64)).unwrap();
        assert!(pool.release(again).is_complete());
    }
    assert_eq!(pool.inner().calls(Callback::Allocate), allocations, "the next runs are served from the cache");
    assert_eq!(pool.inner().calls(Callback::Release), releases);
    assert_eq!(pool.trim(), 21 * MIB);
}

#[test]
fn a_segment_larger_than_the_whole_cap_is_released_to_the_inner_allocator() {
    let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(4 * MIB));
    let cached = pool.allocate(&request(2 * MIB, 64)).unwrap();
    assert!(pool.release(cached).is_complete());
    let big = pool.allocate(&request(5 * MIB, 64)).unwrap();
    let ReleaseOutcome::Complete(done) = pool.release(big) else { panic!("must complete") };
    assert_eq!(done.unmapped_bytes(), 5 * MIB, "passed through");
    let stats = pool.pool_stats();
    assert_eq!((stats.passed_through, stats.evicted_segments, stats.cached_bytes), (1, 1, 0));
    assert_eq!(pool.inner().calls(Callback::Release), 2);
}

#[test]
fn a_large_block_up_to_the_whole_cap_stays_cached_whichever_thread_frees_it() {
    // Default settings: the class caches split the cap across shards, but free
    // segment memory is pool-wide, so a runtime's one large per-run buffer (larger
    // than a shard's share) is reused, not handed back and faulted in every run.
    let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
    assert!(pool.config().shards > 1);
    let share = pool.config().max_cached_bytes / pool.config().shards;
    let bytes = share + 8 * MIB;
    let block = pool.allocate(&request(bytes, 64)).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| assert!(pool.release(block).is_complete()));
    });
    let again = std::thread::scope(|s| s.spawn(|| pool.allocate(&request(bytes, 64)).unwrap()).join().unwrap());
    assert_eq!((pool.pool_stats().hits, pool.inner().calls(Callback::Allocate)), (1, 1));
    assert!(pool.release(again).is_complete());
    assert_eq!(pool.inner().calls(Callback::Release), 0);
}

#[test]
fn pieces_honour_alignments_beyond_the_segment_granularity() {
    let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(256 * MIB));
    let big = pool.allocate(&request(16 * MIB, 64)).unwrap();
    assert!(pool.release(big).is_complete());
    let first = pool.allocate(&request(2 * MIB + 4096, 64)).unwrap();
    let aligned = pool.allocate(&request(2 * MIB, 1 << 16)).unwrap();
    assert!(aligned.address().is_aligned_to(1 << 16), "{aligned:?}");
    let misaligned_rest = address_of(&first) + (2 * MIB + 4096) as u64;
    if !misaligned_rest.is_multiple_of(1 << 16) {
        assert_eq!(pool.inner().calls(Callback::Allocate), 2, "a free piece at the wrong alignment is skipped");
    }
    for block in [first, aligned] {
        assert!(pool.release(block).is_complete());
    }
}

#[test]
fn trim_returns_free_segments_and_keeps_partly_used_ones() {
    let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(256 * MIB));
    let big = pool.allocate(&request(8 * MIB, 64)).unwrap();
    assert!(pool.release(big).is_complete());
    let piece = pool.allocate(&request(3 * MIB, 64)).unwrap();
    assert_eq!(pool.trim(), 0, "the segment is partly in use");
    assert_eq!(pool.pool_stats().cached_bytes, 5 * MIB as u64, "its free rest stays cached");
    assert!(pool.release(piece).is_complete());
    assert_eq!(pool.trim(), 8 * MIB);
    let stats = pool.pool_stats();
    assert_eq!((stats.segments, stats.cached_bytes, stats.trimmed_bytes), (0, 0, 8 * MIB as u64));
    assert_eq!(pool.inner().inner().stats().unwrap().live_allocations, 0);
}

#[test]
fn an_eviction_the_inner_allocator_refuses_or_quarantines_stays_with_the_pool() {
    let pool = PooledAllocator::with_config(FaultyAllocator::new(SystemAllocator::new()), one_shard(10 * MIB));
    let old = pool.allocate(&request(6 * MIB, 64)).unwrap();
    assert!(pool.release(old).is_complete());
    let new = pool.allocate(&request(8 * MIB, 64)).unwrap();
    pool.inner().fail_nth(Callback::Release, 1);
    assert!(pool.release(new).is_complete(), "the caller's block went into the cache");
    let stats = pool.pool_stats();
    assert_eq!((stats.evicted_segments, stats.cached_bytes), (0, 14 * MIB as u64), "the refused segment stays");
    // The next eviction is quarantined: the segment is held, not reused, until a trim.
    let other = pool.allocate(&request(2 * MIB, 64)).unwrap();
    pool.inner().quarantine_nth_release(1, 0, 6 * MIB);
    assert!(pool.release(other).is_complete());
    let stats = pool.pool_stats();
    assert_eq!(stats.quarantined_blocks, 1, "{stats:?}");
    assert_eq!(pool.trim(), 6 * MIB + 8 * MIB, "trim retries the quarantined segment and frees the rest");
    let stats = pool.pool_stats();
    assert_eq!((stats.quarantined_blocks, stats.segments, stats.cached_bytes), (0, 0, 0), "{stats:?}");
    assert_eq!(pool.inner().inner().stats().unwrap().live_allocations, 0);
}

#[test]
fn a_lost_piece_retires_its_segment_and_forwards_it_once_empty() {
    let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), one_shard(256 * MIB));
    let big = pool.allocate(&request(12 * MIB, 64)).unwrap();
    assert!(pool.release(big).is_complete());
    let a = pool.allocate(&request(4 * MIB, 64)).unwrap();
    let b = pool.allocate(&request(4 * MIB, 64)).unwrap();
    pool.forget_lost(vec![a]);
    assert_eq!(pool.pool_stats().cached_bytes, 0, "the lost segment's free rest is not reused");
    let fresh = pool.allocate(&request(4 * MIB, 64)).unwrap();
    assert_eq!(pool.inner().calls(Callback::Allocate), 2);
    assert_eq!(pool.inner().forgotten_blocks(), 0, "b still lives in the segment");
    pool.forget_lost(vec![b]);
    assert_eq!(pool.inner().forgotten_blocks(), 1, "the whole segment is forgotten, once");
    let stats = pool.pool_stats();
    assert_eq!((stats.segments, stats.live_blocks), (1, 1));
    assert!(pool.release(fresh).is_complete());
}

#[test]
fn a_repeated_pattern_of_runs_reaches_a_steady_state_without_inner_calls() {
    // Default settings, as a runtime would use them: a first run of many sizes,
    // then runs of the same few large blocks.
    let pool = PooledAllocator::new(RecordingAllocator::new(SystemAllocator::new()));
    let mut live = Vec::new();
    for i in 0..200usize {
        live.push(pool.allocate(&request((1 + i % 9) * MIB + i * 4096, 64)).unwrap());
        if live.len() > 6 {
            assert!(pool.release(live.remove(i % 5)).is_complete());
        }
    }
    for block in live.drain(..) {
        assert!(pool.release(block).is_complete());
    }
    let mut steady = None;
    for run in 0..5 {
        let blocks: Vec<_> =
            [43 * MIB, 3 * MIB + 12345, 2 * MIB].map(|b| pool.allocate(&request(b, 64)).unwrap()).into();
        for block in blocks {
            assert!(pool.release(block).is_complete());
        }
        let calls = pool.inner().counts().total();
        if run >= 1 {
            assert_eq!(*steady.get_or_insert(calls), calls, "run {run} reached the inner allocator");
        }
    }
    assert!(pool.pool_stats().cached_bytes as usize <= pool.config().max_cached_bytes);
}

mod model {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Allocate { bytes: usize, align: usize },
        Release(usize),
        Trim,
        Lose(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        let sizes = prop_oneof![1..4096usize, 4096..(2 * MIB), (2 * MIB)..(24 * MIB)];
        let aligns = prop_oneof![Just(8usize), Just(64), Just(4096), Just(1 << 16)];
        prop_oneof![
            6 => (sizes, aligns).prop_map(|(bytes, align)| Op::Allocate { bytes, align }),
            5 => any::<usize>().prop_map(Op::Release),
            1 => Just(Op::Trim),
            1 => any::<usize>().prop_map(Op::Lose),
        ]
    }

    /// Where a stamp goes in a block: its first 8 bytes, and its last 8 when they do
    /// not overlap the first.
    fn stamp_offsets(block: &RawAllocation) -> Vec<usize> {
        match block.bytes() {
            0..8 => vec![],
            8..16 => vec![0],
            bytes => vec![0, bytes - 8],
        }
    }

    /// Writes `stamp` at the ends of `block` (host memory the test owns).
    fn stamp(block: &RawAllocation, stamp: u64) {
        for at in stamp_offsets(block) {
            let word = block.address().checked_add(at).expect("inside the block").as_host_ptr().cast::<u64>();
            // SAFETY: the block is live host memory handed to this test alone, and
            // `at + 8 <= bytes`; the write is unaligned-safe.
            unsafe { word.write_unaligned(stamp) };
        }
    }

    /// Whether the stamps of `block` all read `stamp`.
    fn stamped(block: &RawAllocation, stamp: u64) -> bool {
        stamp_offsets(block).into_iter().all(|at| {
            let word = block.address().checked_add(at).expect("inside the block").as_host_ptr().cast::<u64>();
            // SAFETY: as in `stamp`: a live host block of at least `at + 8` bytes.
            unsafe { word.read_unaligned() == stamp }
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

        /// Random allocations, releases, trims and device losses: blocks stay disjoint,
        /// aligned and intact, the pool's books stay consistent after every step, and
        /// once everything is released and trimmed the inner allocator holds nothing
        /// but what was lost (forgotten, not freed).
        #[test]
        fn pieces_stay_disjoint_intact_and_accounted(
            ops in proptest::collection::vec(op(), 1..120),
            cap_mib in prop_oneof![Just(0usize), Just(8), Just(40), Just(256)],
            class_bytes in prop_oneof![Just(4096usize), Just(MIB)],
        ) {
            let config = PoolConfig { max_cached_bytes: cap_mib * MIB, max_class_bytes: class_bytes, shards: 1 };
            let pool = PooledAllocator::with_config(RecordingAllocator::new(SystemAllocator::new()), config);
            let mut live: Vec<(RawAllocation, u64)> = Vec::new();
            for (step, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Allocate { bytes, align } => {
                        let block = pool.allocate(&request(bytes, align)).unwrap();
                        prop_assert!(block.address().is_aligned_to(align));
                        prop_assert_eq!(block.bytes(), bytes);
                        let (start, end) = (block.address().get(), block.address().get() + bytes as u64);
                        for (other, _) in &live {
                            let (a, b) = (other.address().get(), other.address().get() + other.bytes() as u64);
                            prop_assert!(end <= a || b <= start, "{:?} overlaps {:?}", block, other);
                        }
                        stamp(&block, step as u64);
                        live.push((block, step as u64));
                    }
                    Op::Release(pick) if !live.is_empty() => {
                        let (block, id) = live.swap_remove(pick % live.len());
                        prop_assert!(stamped(&block, id), "{:?} was overwritten", block);
                        prop_assert!(pool.release(block).is_complete());
                    }
                    Op::Lose(pick) if !live.is_empty() => {
                        let (block, _) = live.swap_remove(pick % live.len());
                        pool.forget_lost(vec![block]);
                    }
                    Op::Trim => {
                        pool.trim();
                    }
                    Op::Release(_) | Op::Lose(_) => {}
                }
                pool.assert_consistent();
                let stats = pool.pool_stats();
                prop_assert_eq!(stats.live_blocks, live.len() as u64);
                prop_assert_eq!(stats.live_bytes, live.iter().map(|(b, _)| b.bytes() as u64).sum::<u64>());
            }
            for (block, _) in live {
                prop_assert!(pool.release(block).is_complete());
            }
            pool.trim();
            pool.assert_consistent();
            let inner = pool.inner();
            let left = inner.inner().stats().unwrap().live_allocations;
            prop_assert_eq!(left, inner.forgotten_blocks(), "inner blocks left: {}", left);
        }
    }
}
