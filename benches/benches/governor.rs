//! memory-governor benches (issue 4), each against a baseline in the same run:
//! - `lease/admit_refund`: `account.lease(role, 4096)` then drop, one thread (target
//!   <= 30 ns per pair).
//! - `lease_threads/one` vs `lease_threads/two`: the same pair on one account (one
//!   device budget, one role), one thread vs two; reported as aggregate time per pair
//!   (wall time / pairs of all threads), so the throughput of two threads over one is
//!   one / two (target >= 1.5x). `lease_threads/two_devices_control` runs two threads
//!   that share nothing (two accounts on two devices): the machine's own scaling in
//!   this run.
//! - `governed/*`: allocate + release through a binding, with and without a
//!   `GovernedAllocator` between the registry and the allocator (target <= 1.5x), on a
//!   counter allocator with no memory behind it (the governor's cost in full view) and
//!   on the system allocator.
//! - `governed_threads/*`: the same pair on two threads at once, each through its own
//!   binding of one mechanism (both made on this thread, each used by reference on its
//!   thread), with the governed allocator and, in the same run, the counter allocator
//!   alone (`floor_*`: the floor's own two-thread scaling) and an ALU loop that shares
//!   nothing (`alu_*`: the machine's scaling). Two-thread throughput over one thread,
//!   governed, should be at least the floor's.
//!
//! After criterion's own output, a summary prints the median of each bench's measured
//! samples from this run and the ratios.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use allocator_cpu::SystemAllocator;
use criterion::{Criterion, criterion_group, criterion_main};
use memory_benches::CounterAllocator;
use memory_governor::{
    Account, AccountConfig, AllocationRequest, BindingRegistry, DeviceAllocator, DeviceKey, Governor, IdentityIssuer,
    MemoryBinding, MemoryRole,
};

const PAIR_BYTES: u64 = 4096;

/// Per-operation times of every sample, by bench name, for the summary.
static SAMPLES: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());

fn record(name: &str, elapsed: Duration, ops: u64) -> Duration {
    let per_op = elapsed.as_secs_f64() * 1e9 / ops.max(1) as f64;
    SAMPLES.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(name.to_owned()).or_default().push(per_op);
    elapsed
}

fn account(governor: &Governor, device: DeviceKey) -> Account {
    let authority = IdentityIssuer::new().and_then(|issuer| issuer.authority()).expect("authority");
    governor.set_device_limit(device, 64 << 30).expect("limit");
    governor.open_account(AccountConfig::new(device, authority).with_label("bench")).expect("account")
}

fn lease(c: &mut Criterion) {
    let governor = Governor::new();
    let account = account(&governor, DeviceKey::device(0));
    c.bench_function("lease/admit_refund", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                let lease = account.lease(MemoryRole::KvCache, black_box(PAIR_BYTES)).expect("lease");
                drop(black_box(lease));
            }
            record("lease/admit_refund", start.elapsed(), iters)
        })
    });
}

/// Runs `iters` lease pairs on one thread per account in `accounts`; returns the wall
/// time divided by the number of threads (so criterion's figure, like the summary's, is
/// ns per pair of all threads together: lower means more aggregate throughput), and
/// records it per pair of all threads together.
fn run_threads(name: &str, accounts: &[&Account], iters: u64) -> Duration {
    let barrier = Arc::new(Barrier::new(accounts.len() + 1));
    let done = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = accounts
        .iter()
        .map(|&account| {
            let (account, barrier, done) = (account.clone(), Arc::clone(&barrier), Arc::clone(&done));
            std::thread::spawn(move || {
                // Warm this thread's credit before the clock starts.
                drop(account.lease(MemoryRole::KvCache, PAIR_BYTES).expect("lease"));
                barrier.wait();
                for _ in 0..iters {
                    let lease = account.lease(MemoryRole::KvCache, black_box(PAIR_BYTES)).expect("lease");
                    drop(black_box(lease));
                }
                done.fetch_add(iters, Ordering::Relaxed);
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for handle in handles {
        handle.join().expect("bench thread");
    }
    let elapsed = start.elapsed();
    record(name, elapsed, done.load(Ordering::Relaxed));
    elapsed / accounts.len().max(1) as u32
}

fn threads(c: &mut Criterion) {
    let governor = Governor::new();
    let first = account(&governor, DeviceKey::device(0));
    // The control: two threads sharing nothing (two accounts on two devices), so the
    // machine's own two-thread scaling is measured in the same run.
    let second = account(&governor, DeviceKey::device(1));
    // Not `threads`: the binding bench has a group of that name in the same criterion
    // directory.
    let mut group = c.benchmark_group("lease_threads");
    group.bench_function("one", |b| b.iter_custom(|iters| run_threads("lease_threads/one", &[&first], iters)));
    group.bench_function("two", |b| b.iter_custom(|iters| run_threads("lease_threads/two", &[&first, &first], iters)));
    group.bench_function("two_devices_control", |b| {
        b.iter_custom(|iters| run_threads("lease_threads/two_devices_control", &[&first, &second], iters))
    });
    group.finish();
}

/// Runs `iters` allocate + release pairs on one thread per binding (`None`: an ALU loop
/// of about the same length that touches nothing shared); returns the wall time divided
/// by the number of threads, and records it per pair of all threads together.
fn run_pairs(name: &str, bindings: &[Option<&MemoryBinding>], iters: u64) -> Duration {
    let request = AllocationRequest::new(PAIR_BYTES as usize, 256).expect("request").with_role(MemoryRole::KvCache);
    let barrier = Barrier::new(bindings.len() + 1);
    let start = std::thread::scope(|scope| {
        for &binding in bindings {
            let barrier = &barrier;
            scope.spawn(move || {
                if let Some(binding) = binding {
                    // Warm this thread's pins and credit before the clock starts.
                    drop(binding.allocate(request).expect("allocate"));
                }
                barrier.wait();
                let mut x = 1u64;
                for _ in 0..iters {
                    match binding {
                        Some(binding) => {
                            let block = binding.allocate(black_box(request)).expect("allocate");
                            black_box(binding.release(block).expect("release"));
                        }
                        None => {
                            for _ in 0..64 {
                                x = black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                            }
                        }
                    }
                }
                black_box(x);
            });
        }
        barrier.wait();
        Instant::now()
    });
    let elapsed = start.elapsed();
    record(name, elapsed, iters * bindings.len() as u64);
    elapsed / bindings.len().max(1) as u32
}

fn governed_threads(c: &mut Criterion) {
    let counter = || Arc::new(CounterAllocator::new(DeviceKey::device(0))) as Arc<dyn DeviceAllocator>;
    let (governed_registry, governed, _governor) = binding(counter(), true);
    let governed_second = governed_registry.bind(DeviceKey::device(0)).expect("bind");
    let (floor_registry, floor, _plain) = binding(counter(), false);
    let floor_second = floor_registry.bind(DeviceKey::device(0)).expect("bind");
    let mut group = c.benchmark_group("governed_threads");
    for (name, one, two) in [
        ("governed", Some(&governed), Some(&governed_second)),
        ("floor", Some(&floor), Some(&floor_second)),
        ("alu", None, None),
    ] {
        let (one_key, two_key) = (format!("governed_threads/{name}_one"), format!("governed_threads/{name}_two"));
        group.bench_function(format!("{name}_one"), |b| b.iter_custom(|iters| run_pairs(&one_key, &[one], iters)));
        group.bench_function(format!("{name}_two"), |b| b.iter_custom(|iters| run_pairs(&two_key, &[one, two], iters)));
    }
    group.finish();
}

/// A binding over `inner`, with or without a governed allocator in between.
fn binding(inner: Arc<dyn DeviceAllocator>, governed: bool) -> (BindingRegistry, MemoryBinding, Governor) {
    let device = inner.device();
    let registry = BindingRegistry::new();
    let context = registry.register_provider_context(device, Arc::new("bench")).expect("context");
    let authority = registry.register_authority(device, Arc::new("bench")).expect("authority");
    let governor = Governor::new();
    let allocator: Arc<dyn DeviceAllocator> = if governed {
        governor.set_device_limit(device, 64 << 30).expect("limit");
        governor.open_account(AccountConfig::new(device, authority)).expect("account");
        Arc::new(governor.govern(inner, authority).expect("govern"))
    } else {
        inner
    };
    let mechanism = registry.register_allocator(&context, &authority, allocator).expect("mechanism");
    let binding = registry.bind_registered(&mechanism).expect("bind");
    (registry, binding, governor)
}

fn governed(c: &mut Criterion) {
    let request = AllocationRequest::new(PAIR_BYTES as usize, 256).expect("request").with_role(MemoryRole::KvCache);
    let mut group = c.benchmark_group("governed");
    for (inner_name, make) in [
        (
            "counter",
            (|| Arc::new(CounterAllocator::new(DeviceKey::device(0))) as Arc<dyn DeviceAllocator>) as fn() -> _,
        ),
        ("system", || Arc::new(SystemAllocator::for_device(DeviceKey::device(0))) as Arc<dyn DeviceAllocator>),
    ] {
        for governed in [false, true] {
            let (_registry, binding, _governor) = binding(make(), governed);
            let name = format!("{inner_name}_{}", if governed { "governed" } else { "ungoverned" });
            let key = format!("governed/{name}");
            group.bench_function(name.as_str(), |b| {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let block = binding.allocate(black_box(request)).expect("allocate");
                        black_box(binding.release(block).expect("release"));
                    }
                    record(&key, start.elapsed(), iters)
                })
            });
        }
    }
    group.finish();
}

fn median(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Prints the medians of this run's measured samples (criterion's warm-up calls
/// excluded: only the last `sample_size` calls of each bench are its samples) and the
/// ratios the issue asks for.
fn summary(_: &mut Criterion) {
    const SAMPLE_SIZE: usize = 100;
    let samples = SAMPLES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let measured = |name: &str| -> f64 {
        let all = samples.get(name).map(Vec::as_slice).unwrap_or_default();
        median(&all[all.len().saturating_sub(SAMPLE_SIZE)..])
    };
    let lease = measured("lease/admit_refund");
    let one = measured("lease_threads/one");
    let two = measured("lease_threads/two");
    let control = measured("lease_threads/two_devices_control");
    println!("\ngovernor summary (medians of this run's measured samples):");
    println!("  lease admit+refund, 1 thread      {lease:>8.1} ns/pair (target <= 30 ns)");
    println!(
        "  lease pairs, 1 thread             {one:>8.1} ns/pair aggregate\n  \
         lease pairs, 2 threads            {two:>8.1} ns/pair aggregate   2 threads / 1 thread throughput = {:.2}x (target >= 1.5x)",
        one / two
    );
    println!(
        "  lease pairs, 2 threads, 2 devices {control:>8.1} ns/pair aggregate   control (nothing shared)       = {:.2}x",
        one / control
    );
    for inner in ["counter", "system"] {
        let plain = measured(&format!("governed/{inner}_ungoverned"));
        let governed = measured(&format!("governed/{inner}_governed"));
        println!(
            "  binding pair over {inner:<8}        ungoverned {plain:>7.1} ns   governed {governed:>7.1} ns   governed/ungoverned = {:.2}x (target <= {})",
            governed / plain,
            if inner == "counter" { "1.3x" } else { "1.2x" }
        );
    }
    let scaling = |name: &str| {
        measured(&format!("governed_threads/{name}_one")) / measured(&format!("governed_threads/{name}_two"))
    };
    let (governed, floor, alu) = (scaling("governed"), scaling("floor"), scaling("alu"));
    println!(
        "  2 threads / 1 thread throughput: governed binding {governed:.2}x, floor allocator alone {floor:.2}x, \
         nothing shared {alu:.2}x (target: governed >= floor)"
    );
}

criterion_group!(benches, lease, threads, governed, governed_threads, summary);
criterion_main!(benches);
