//! BindingRegistry hot-path benches (issues 3 and 12), each against a baseline in the
//! same run:
//! - `pair/*`: allocate + release through `&dyn DeviceAllocator` (the floor) and
//!   through a binding, over a counter allocator with no memory behind it
//!   (`memory_benches::CounterAllocator`); `pair/bound_drop` releases by dropping a
//!   host allocation. `pair_pool/*`: the same over a per-thread slot pool
//!   (`memory_benches::SlotPoolAllocator`), the floor of a caching allocator.
//! - `bind/*`: `registry.bind(device)` + drop with 1 device registered, and binding
//!   the 64th of 64 devices.
//! - `threads/*`: aggregate throughput, pairs of all threads per second, timed as
//!   workers released together by a barrier: aggregate time per pair = (last end −
//!   first start) / pairs of all threads. One thread, then two threads: each binding
//!   for itself; using two bindings made on one (setup) thread; sharing one binding
//!   by reference; exchanging batches so that every block is released by the other
//!   thread (against the same batches released locally); on two devices; and an ALU
//!   control sharing nothing, which reads ≈ 2.0× on an idle two-core machine. Beside
//!   each figure the bench records the machine's *other* load while it ran (busy CPU
//!   time not spent by this process, in cores, from `/proc`), under
//!   `$CRITERION_HOME/load/`, for `cargo xtask bench` to print.
//! - `live/*`: the pair with 0 and 100,000 live allocations, and after releasing them.

use std::hint::black_box;
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{BenchmarkGroup, Criterion, criterion_group, criterion_main, measurement::WallTime};
use memory_api::{AllocationRequest, DeviceAllocator, DeviceKey};
use memory_benches::{CounterAllocator, SlotPoolAllocator};
use memory_binding::{BindingRegistry, MemoryBinding};

fn request() -> AllocationRequest {
    AllocationRequest::new(4096, 256).unwrap_or_else(|_| unreachable!("valid layout"))
}

/// One allocate + release through `binding`.
#[inline(always)]
fn bound_pair(binding: &MemoryBinding, request: AllocationRequest) {
    let block = binding.allocate(black_box(request)).expect("allocate");
    black_box(binding.release(block).expect("release"));
}

fn pair(c: &mut Criterion) {
    let request = request();
    for (group_name, floor) in [
        ("pair", Arc::new(CounterAllocator::new(DeviceKey::host(1))) as Arc<dyn DeviceAllocator>),
        ("pair_pool", Arc::new(SlotPoolAllocator::new(DeviceKey::host(1))) as Arc<dyn DeviceAllocator>),
    ] {
        let registry = BindingRegistry::new();
        let binding = registry.with_memory(Arc::clone(&floor)).expect("binding");
        let mut group = c.benchmark_group(group_name);
        group.bench_function("raw_dyn", |b| {
            let allocator: &dyn DeviceAllocator = &*floor;
            b.iter(|| {
                let block = allocator.allocate(black_box(&request)).expect("allocate");
                assert!(black_box(allocator.release(block)).is_complete());
            })
        });
        group.bench_function("bound", |b| b.iter(|| bound_pair(&binding, request)));
        if group_name == "pair" {
            // A host device: dropping a live allocation releases it at once.
            group.bench_function("bound_drop", |b| {
                b.iter(|| drop(black_box(binding.allocate(black_box(request)).expect("allocate"))))
            });
        }
        group.finish();
    }
}

fn bind(c: &mut Criterion) {
    let one = BindingRegistry::new();
    one.with_memory(Arc::new(CounterAllocator::new(DeviceKey::device(0)))).expect("binding");
    let many = BindingRegistry::new();
    for index in 0..64 {
        many.with_memory(Arc::new(CounterAllocator::new(DeviceKey::device(index)))).expect("binding");
    }
    let mut group = c.benchmark_group("bind");
    group.bench_function("one_device", |b| {
        b.iter(|| black_box(one.bind(black_box(DeviceKey::device(0))).expect("bind")));
    });
    group.bench_function("64_devices", |b| {
        b.iter(|| black_box(many.bind(black_box(DeviceKey::device(63))).expect("bind")));
    });
    group.finish();
}

/// Runs `prepare(thread)` on each of `threads` threads, then releases them together
/// through a barrier to run the prepared work for `iters` operations each. Returns
/// what criterion divides by `iters` to get the aggregate time per operation:
/// (last end − first start) / threads.
fn aggregate<P, W>(threads: usize, iters: u64, prepare: P) -> Duration
where
    P: Fn(usize) -> W + Sync,
    W: FnOnce(u64),
{
    let barrier = Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|thread| {
                let (barrier, prepare) = (&barrier, &prepare);
                scope.spawn(move || {
                    let work = prepare(thread);
                    barrier.wait();
                    let start = Instant::now();
                    work(iters);
                    (start, Instant::now())
                })
            })
            .collect();
        workers.into_iter().map(|worker| worker.join().expect("bench thread")).collect()
    });
    let first = spans.iter().map(|span| span.0).min().expect("one thread at least");
    let last = spans.iter().map(|span| span.1).max().expect("one thread at least");
    (last - first) / threads as u32
}

/// Busy CPU time of the whole machine and of this process, from `/proc` (Linux);
/// `None` elsewhere.
fn cpu_times() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<f64> = stat.lines().next()?.split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal: busy is all but idle and iowait.
    let busy = fields.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, v)| v).sum();
    let own = std::fs::read_to_string("/proc/self/stat").ok()?;
    // After the parenthesised command, fields count from the state (field 3): utime and
    // stime are fields 14 and 15.
    let after: Vec<&str> = own.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |field: usize| after.get(field - 3)?.parse::<f64>().ok();
    Some((busy, ticks(14)? + ticks(15)?))
}

/// The 1-minute load average now.
fn loadavg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// Runs one bench of a two-thread group and records the machine's other load while it
/// ran: busy CPU not spent by this process, in cores (ticks are 1/100 s on Linux).
fn bench_with_load(group: &mut BenchmarkGroup<'_, WallTime>, id: &str, mut body: impl FnMut(u64) -> Duration) {
    let (before, started) = (cpu_times(), Instant::now());
    group.bench_function(id, |b| b.iter_custom(&mut body));
    let (after, elapsed) = (cpu_times(), started.elapsed().as_secs_f64());
    let other = match (before, after) {
        (Some((busy0, own0)), Some((busy1, own1))) if elapsed > 0.0 => {
            Some((((busy1 - busy0) - (own1 - own0)) / 100.0 / elapsed).max(0.0))
        }
        _ => None,
    };
    let line = match other {
        Some(other) => {
            format!("{other:.2} cores (loadavg {})", loadavg().map_or("?".to_owned(), |l| format!("{l:.2}")))
        }
        None => "unknown".to_owned(),
    };
    println!("threads/{id}: other load while it ran: {line}");
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        let dir = std::path::Path::new(&home).join("load").join("threads");
        let written = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join(format!("{id}.txt")), &line));
        if let Err(err) = written {
            eprintln!("could not record the load of threads/{id}: {err}");
        }
    }
}

/// Pairs in one batch of the exchange benches.
const BATCH: usize = 64;

fn threads(c: &mut Criterion) {
    let request = request();
    let registry = BindingRegistry::new();
    let first = registry.with_memory(Arc::new(CounterAllocator::new(DeviceKey::device(0)))).expect("binding");
    let second = registry.with_memory(Arc::new(CounterAllocator::new(DeviceKey::device(1)))).expect("binding");
    let (m0, m1) = (first.identity().mechanism(), second.identity().mechanism());
    // Made on this (setup) thread, used by the workers.
    let setup = [registry.bind_registered(&m0).expect("bind"), registry.bind_registered(&m0).expect("bind")];
    let shared = registry.bind_registered(&m0).expect("bind");
    let pairs = |binding: &MemoryBinding, iters: u64| {
        for _ in 0..iters {
            bound_pair(binding, request);
        }
    };
    // Bound in `prepare`, on the worker thread, before the barrier.
    let own = |mechanism| {
        let binding = registry.bind_registered(&mechanism).expect("bind");
        move |iters: u64| pairs(&binding, iters)
    };
    // `iters` operations in batches of at most `BATCH`.
    let batches = |iters: u64| {
        (0..iters.div_ceil(BATCH as u64)).map(move |round| (iters - round * BATCH as u64).min(BATCH as u64) as usize)
    };

    let mut group = c.benchmark_group("threads");
    bench_with_load(&mut group, "one_thread", |iters| aggregate(1, iters, |_| own(m0)));
    bench_with_load(&mut group, "two_own_bindings", |iters| aggregate(2, iters, |_| own(m0)));
    bench_with_load(&mut group, "two_bound_on_one_thread", |iters| {
        aggregate(2, iters, |thread| {
            let binding = &setup[thread];
            move |iters| pairs(binding, iters)
        })
    });
    bench_with_load(&mut group, "two_shared_ref", |iters| {
        aggregate(2, iters, |_| {
            let binding = &shared;
            move |iters| pairs(binding, iters)
        })
    });
    bench_with_load(&mut group, "two_devices", |iters| {
        aggregate(2, iters, |thread| own(if thread == 0 { m0 } else { m1 }))
    });
    // Batches of one shared binding: released locally, or by the other thread.
    bench_with_load(&mut group, "two_local_batches", |iters| {
        aggregate(2, iters, |_| {
            let binding = &shared;
            move |iters| {
                let mut batch = Vec::with_capacity(BATCH);
                for size in batches(iters) {
                    batch.extend((0..size).map(|_| binding.allocate(request).expect("allocate")));
                    for block in batch.drain(..) {
                        black_box(binding.release(block).expect("release"));
                    }
                }
            }
        })
    });
    bench_with_load(&mut group, "two_cross_release", |iters| {
        let (to_second, from_first) = sync_channel::<Vec<_>>(2);
        let (to_first, from_second) = sync_channel::<Vec<_>>(2);
        let ends = std::sync::Mutex::new(vec![Some((to_second, from_second)), Some((to_first, from_first))]);
        aggregate(2, iters, |thread| {
            let (send, receive) = ends.lock().expect("ends")[thread].take().expect("one end per thread");
            let binding = &shared;
            move |iters| {
                for size in batches(iters) {
                    let mine: Vec<_> = (0..size).map(|_| binding.allocate(request).expect("allocate")).collect();
                    send.send(mine).expect("peer alive");
                    for block in receive.recv().expect("peer alive") {
                        black_box(binding.release(block).expect("release"));
                    }
                }
            }
        })
    });
    let alu = |iters: u64| {
        let mut x = black_box(0x9E37_79B9_7F4A_7C15u64);
        for _ in 0..iters {
            for _ in 0..8 {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                x ^= x >> 29;
            }
        }
        black_box(x);
    };
    bench_with_load(&mut group, "alu_one", |iters| aggregate(1, iters, |_| alu));
    bench_with_load(&mut group, "alu_two", |iters| aggregate(2, iters, |_| alu));
    group.finish();
}

fn live(c: &mut Criterion) {
    let request = request();
    let registry = BindingRegistry::new();
    let binding = registry.with_memory(Arc::new(CounterAllocator::new(DeviceKey::device(0)))).expect("binding");
    let mut group = c.benchmark_group("live");
    let mut measure = |name: &str| {
        group.bench_function(name, |b| b.iter(|| bound_pair(&binding, request)));
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

criterion_group!(benches, pair, bind, threads, live);
criterion_main!(benches);
