//! BindingRegistry hot-path benches (issue 3), each against a baseline in the same run:
//! - `pair/raw_dyn` vs `pair/bound`: allocate + release through `&dyn DeviceAllocator`
//!   and through a binding, on a counter allocator with no memory behind it, so the
//!   difference is the registry's own cost.
//! - `bind`: `registry.bind(device)`.
//! - `threads/*`: aggregate throughput of 1 thread vs 2 threads on one mechanism
//!   (two bindings) and on two mechanisms on two devices.
//! - `live/*`: the pair with 0, 100,000 live allocations, and after releasing them.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use memory_api::MechanismIdentity;
use memory_api::{
    AllocError, AllocationRequest, DeviceAddress, DeviceAllocator, DeviceKey, RawAllocation, ReleaseOutcome,
};
use memory_benches::CounterAllocator;
use memory_binding::BindingRegistry;

/// Hands out addresses from a per-allocator counter and frees nothing: the cheapest
/// possible allocator, so the benches measure the layers above it.
struct Counter {
    device: DeviceKey,
    next: AtomicU64,
}

impl Counter {
    fn new(device: DeviceKey) -> Counter {
        Counter { device, next: AtomicU64::new(1 << 20) }
    }
}

impl DeviceAllocator for Counter {
    fn device(&self) -> DeviceKey {
        self.device
    }
    fn name(&self) -> &str {
        "counter"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        // Relaxed and per-allocator: on two devices nothing is shared.
        let start = self.next.fetch_add(4096, Ordering::Relaxed);
        let address = DeviceAddress::new(start).unwrap_or(DeviceAddress::new(1).unwrap_or_else(|| unreachable!()));
        Ok(RawAllocation::new(address, request.bytes(), request.align(), self.device, 0))
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        ReleaseOutcome::complete(allocation.bytes())
    }
}

fn request() -> AllocationRequest {
    AllocationRequest::new(4096, 256).unwrap_or_else(|_| unreachable!("valid layout"))
}

fn pair(c: &mut Criterion) {
    let request = request();
    let raw: Arc<dyn DeviceAllocator> = Arc::new(Counter::new(DeviceKey::device(0)));
    let registry = BindingRegistry::new();
    let binding = registry.with_memory(Arc::new(Counter::new(DeviceKey::device(0)))).expect("binding");
    let mut group = c.benchmark_group("pair");
    group.bench_function("raw_dyn", |b| {
        let allocator: &dyn DeviceAllocator = &*raw;
        b.iter(|| {
            let block = allocator.allocate(black_box(&request)).expect("allocate");
            assert!(black_box(allocator.release(block)).is_complete());
        })
    });
    group.bench_function("bound", |b| {
        b.iter(|| {
            let block = binding.allocate(black_box(request)).expect("allocate");
            black_box(binding.release(block).expect("release"));
        })
    });
    group.finish();

    c.bench_function("bind", |b| {
        b.iter(|| black_box(registry.bind(black_box(DeviceKey::device(0))).expect("bind")));
    });
}

/// Runs `iters` pairs on each thread, one thread per mechanism listed, each thread
/// binding for itself as a worker would; returns the wall time divided by the number
/// of threads (so lower means more aggregate throughput).
fn run_threads(registry: &BindingRegistry, mechanisms: &[MechanismIdentity], iters: u64) -> Duration {
    let request = request();
    let barrier = Arc::new(Barrier::new(mechanisms.len() + 1));
    let handles: Vec<_> = mechanisms
        .iter()
        .map(|&mechanism| {
            let barrier = Arc::clone(&barrier);
            let registry = registry.clone();
            std::thread::spawn(move || {
                let binding = registry.bind_registered(&mechanism).expect("bind");
                barrier.wait();
                for _ in 0..iters {
                    let block = binding.allocate(request).expect("allocate");
                    black_box(binding.release(block).expect("release"));
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for handle in handles {
        handle.join().expect("bench thread");
    }
    start.elapsed() / mechanisms.len() as u32
}

fn threads(c: &mut Criterion) {
    let registry = BindingRegistry::new();
    let first = registry.with_memory(Arc::new(CounterAllocator::new(DeviceKey::device(0)))).expect("binding");
    let second = registry.with_memory(Arc::new(CounterAllocator::new(DeviceKey::device(1)))).expect("binding");
    let (m0, m1) = (first.identity().mechanism(), second.identity().mechanism());
    let mut group = c.benchmark_group("threads");
    group.bench_function("one_thread", |b| b.iter_custom(|iters| run_threads(&registry, &[m0], iters)));
    group.bench_function("two_threads_one_mechanism", |b| {
        b.iter_custom(|iters| run_threads(&registry, &[m0, m0], iters))
    });
    group
        .bench_function("two_threads_two_devices", |b| b.iter_custom(|iters| run_threads(&registry, &[m0, m1], iters)));
    group.finish();
}

fn live(c: &mut Criterion) {
    let request = request();
    let registry = BindingRegistry::new();
    let binding = registry.with_memory(Arc::new(Counter::new(DeviceKey::device(0)))).expect("binding");
    let mut group = c.benchmark_group("live");
    let mut measure = |name: &str| {
        group.bench_function(name, |b| {
            b.iter(|| {
                let block = binding.allocate(black_box(request)).expect("allocate");
                black_box(binding.release(block).expect("release"));
            })
        });
    };
    measure("none");
    let held: Vec<_> = (0..100_000).map(|_| binding.allocate(request).expect("allocate")).collect();
    measure("100k_live");
    for block in held {
        binding.release(block).expect("release");
    }
    measure("after_release");
    group.finish();
}

criterion_group!(benches, pair, threads, live);
criterion_main!(benches);
