//! CPU allocator benches (issue 5), each against a baseline in the same run:
//! - `kv_pages_2_threads/{system,pooled}`: two threads, each allocating a batch of 16
//!   KV pages of 64 KiB, writing one byte to each, and releasing the batch; reported
//!   per allocate+release pair.
//! - `large_blocks/{system,pooled}`: one thread cycling through blocks of 1 to 64 MiB,
//!   touching every 4 KiB page of each, then releasing it; reported per block.
//! - `virtual_commit_2mib/{lazy,populate,lazy_then_touch}`: committing a 2 MiB range of
//!   a reservation (decommitted again, untimed, after each iteration); per page = / 512.
//!
//! Each group declares its elements per iteration (pairs, blocks, pages) as criterion
//! throughput, so that `cargo xtask bench` reads per-element medians from criterion's
//! results. After criterion's own output, a summary prints the median of each bench's
//! samples (from this run) and the ratios the issue asks for.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use allocator_cpu::{PoolConfig, PooledAllocator, SystemAllocator, VirtualHostAllocator};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use memory_api::{AllocationRequest, ByteRange, DeviceAllocator, MemoryRole, RawAllocation};

const KV_PAGE: usize = 64 << 10;
const KV_BATCH: usize = 16;
const OS_PAGE: usize = 4096;
const MIB: usize = 1 << 20;
const LARGE_SIZES_MIB: [usize; 12] = [1, 2, 4, 8, 16, 32, 64, 48, 24, 12, 6, 3];
const COMMIT_BYTES: usize = 2 * MIB;

/// Per-iteration times of the measured samples, by bench name, for the summary.
static SAMPLES: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());

fn record(name: &str, elapsed: Duration, iters: u64, ops_per_iter: usize) -> Duration {
    let per_op = elapsed.as_secs_f64() * 1e9 / (iters as f64 * ops_per_iter as f64);
    SAMPLES.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(name.to_owned()).or_default().push(per_op);
    elapsed
}

/// Writes one byte at `offset` of `block`.
fn touch(block: &RawAllocation, offset: usize) {
    let ptr = std::ptr::with_exposed_provenance_mut::<u8>(block.address().get() as usize + offset);
    // SAFETY: `block` is a live host allocation (or a committed range) owned by this
    // bench and at least `offset + 1` bytes long; nothing else references it.
    unsafe { ptr.write_volatile(1) };
}

fn kv_round(allocator: &dyn DeviceAllocator, request: &AllocationRequest, batch: &mut Vec<RawAllocation>) {
    for _ in 0..KV_BATCH {
        let block = allocator.allocate(request).expect("allocate a KV page");
        touch(&block, 0);
        batch.push(block);
    }
    for block in batch.drain(..) {
        assert!(allocator.release(block).is_complete());
    }
}

/// Runs `iters` rounds on each of two threads; returns the slower thread's time.
fn kv_two_threads(allocator: &dyn DeviceAllocator, iters: u64) -> Duration {
    let request = AllocationRequest::new(KV_PAGE, 256).expect("request").with_role(MemoryRole::KvCache);
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let mut batch = Vec::with_capacity(KV_BATCH);
                    kv_round(allocator, &request, &mut batch); // first use of this thread's shard
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..iters {
                        kv_round(allocator, &request, &mut batch);
                    }
                    start.elapsed()
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("bench thread")).max().unwrap_or_default()
    })
}

fn kv_pages(c: &mut Criterion) {
    let system = SystemAllocator::new();
    let pooled = PooledAllocator::new(SystemAllocator::new());
    let mut group = c.benchmark_group("kv_pages_2_threads");
    // Per allocate+release pair of one thread (criterion's figure is per round of a batch).
    group.throughput(Throughput::Elements(KV_BATCH as u64));
    for (name, allocator) in [("system", &system as &dyn DeviceAllocator), ("pooled", &pooled)] {
        let key = format!("kv_pages_2_threads/{name}");
        group.bench_function(name, |b| {
            b.iter_custom(|iters| record(&key, kv_two_threads(allocator, iters), iters, KV_BATCH))
        });
    }
    group.finish();
}

fn large_cycle(allocator: &dyn DeviceAllocator) {
    for mib in LARGE_SIZES_MIB {
        let bytes = mib * MIB;
        let block = allocator.allocate(&AllocationRequest::new(bytes, 64).expect("request")).expect("allocate");
        for offset in (0..bytes).step_by(OS_PAGE) {
            touch(&block, offset);
        }
        assert!(allocator.release(black_box(block)).is_complete());
    }
}

fn large_blocks(c: &mut Criterion) {
    let system = SystemAllocator::new();
    let config = PoolConfig { max_cached_bytes: 1 << 30, shards: 1, ..PoolConfig::default() };
    let pooled = PooledAllocator::with_config(SystemAllocator::new(), config);
    large_cycle(&pooled); // steady state: every size cached once
    let mut group = c.benchmark_group("large_blocks");
    // Per block (criterion's figure is per cycle through every size).
    group.throughput(Throughput::Elements(LARGE_SIZES_MIB.len() as u64));
    group.sample_size(10);
    for (name, allocator) in [("system", &system as &dyn DeviceAllocator), ("pooled", &pooled)] {
        let key = format!("large_blocks/{name}");
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    large_cycle(allocator);
                }
                record(&key, start.elapsed(), iters, LARGE_SIZES_MIB.len())
            })
        });
    }
    group.finish();
}

fn virtual_commit(c: &mut Criterion) {
    let mut group = c.benchmark_group("virtual_commit_2mib");
    // Per 4 KiB page (criterion's figure is per 2 MiB commit).
    group.throughput(Throughput::Elements((COMMIT_BYTES / OS_PAGE) as u64));
    let lazy = VirtualHostAllocator::new();
    let populate = VirtualHostAllocator::new().populating();
    let whole = ByteRange::new(0, COMMIT_BYTES);
    for (name, arena, touch_pages) in
        [("lazy", &lazy, false), ("populate", &populate, false), ("lazy_then_touch", &lazy, true)]
    {
        let reservation =
            arena.allocate(&AllocationRequest::new(COMMIT_BYTES, COMMIT_BYTES).expect("request")).expect("reserve");
        let vb = arena.virtual_backing().expect("virtual backing");
        let key = format!("virtual_commit_2mib/{name}");
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    assert_eq!(vb.commit(&reservation, whole).expect("commit"), COMMIT_BYTES);
                    if touch_pages {
                        for offset in (0..COMMIT_BYTES).step_by(OS_PAGE) {
                            touch(&reservation, offset);
                        }
                    }
                    timed += start.elapsed();
                    assert_eq!(vb.decommit(&reservation, whole).expect("decommit"), COMMIT_BYTES);
                }
                record(&key, timed, iters, COMMIT_BYTES / OS_PAGE)
            })
        });
        assert!(arena.release(reservation).is_complete());
    }
    group.finish();
}

fn median(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Prints the medians of this run's samples (warm-up calls excluded: only the last
/// `sample_size` calls of each bench are criterion's measured samples) and the ratios.
fn summary(_: &mut Criterion) {
    let samples = SAMPLES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let measured = |name: &str, sample_size: usize| -> f64 {
        let all = samples.get(name).map(Vec::as_slice).unwrap_or_default();
        median(&all[all.len().saturating_sub(sample_size)..])
    };
    let kv_system = measured("kv_pages_2_threads/system", 100);
    let kv_pooled = measured("kv_pages_2_threads/pooled", 100);
    let large_system = measured("large_blocks/system", 10);
    let large_pooled = measured("large_blocks/pooled", 10);
    println!("\ncpu_allocators summary (medians of this run's measured samples):");
    println!(
        "  kv_pages_2_threads   system {kv_system:>10.1} ns/pair    pooled {kv_pooled:>10.1} ns/pair    system/pooled = {:.2}x (target >= 3x)",
        kv_system / kv_pooled
    );
    println!(
        "  large_blocks         system {:>10.3} ms/block   pooled {:>10.3} ms/block   system/pooled = {:.2}x (target >= 5x)",
        large_system / 1e6,
        large_pooled / 1e6,
        large_system / large_pooled
    );
    for name in ["lazy", "populate", "lazy_then_touch"] {
        let per_page = measured(&format!("virtual_commit_2mib/{name}"), 100);
        println!(
            "  virtual_commit_2mib  {name:<16} {per_page:>8.1} ns/page  ({:.1} us per 2 MiB)",
            per_page * (COMMIT_BYTES / OS_PAGE) as f64 / 1e3
        );
    }
}

criterion_group!(benches, kv_pages, large_blocks, virtual_commit, summary);
criterion_main!(benches);
