//! Runs N of one hot-path operation, for instruction counting under callgrind, which is
//! a stable measure on a shared, noisy machine where wall-clock figures are not:
//!
//! ```text
//! cargo build --release -p memory-benches --example instructions
//! for n in 10000 110000; do
//!   valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/instructions pair $n 2>&1 | grep 'refs'
//! done   # (second − first) / 100000 = instructions per operation
//! ```
//!
//! Operations: `raw` (allocate + release through `&dyn`, the floor), `pair` (through a
//! binding), `drop` (allocate, then drop a host allocation), `bind` (bind + drop, one
//! device), `bind64` (the 64th of 64 devices), `remote` (allocate on this thread,
//! release on another: counted on both), `governed` (a pair through a governed allocator,
//! as the governor bench's `governed/counter_governed`), `pooled` and `segment` (a pair
//! through `&dyn` on allocator-cpu's `PooledAllocator`, warm: a 4 KiB request served from
//! a size class, a 2 MiB one carved from a segment), `capi` and `capi_pooled` (a pair
//! through the C API's `mc_allocate` / `mc_release`, on the system allocator or on the
//! pooled one; see `system_pairs`). `cargo xtask budget` counts these this way (and
//! memory-plugin's `pair_instructions`), with N at 10000 and 60000, against the budget in
//! `xtask/instruction-budget.toml`.
//!
//! And, for CPU time rather than instructions (`/usr/bin/time -f %U`), N pairs on each
//! of two threads at once: `shared` (one binding by reference), `setup` (two bindings
//! made on this thread), `own` (each thread binds for itself). CPU time per pair that
//! grows from one thread to two is time spent waiting for cache lines the threads share;
//! unlike wall-clock throughput it does not depend on the machine being otherwise idle
//! (only on the threads overlapping).

use std::hint::black_box;
use std::sync::Arc;

use memory_api::{AllocationRequest, DeviceAllocator, DeviceKey};
use memory_benches::CounterAllocator;
use memory_binding::BindingRegistry;

fn main() {
    let mut args = std::env::args().skip(1);
    let what = args.next().unwrap_or_else(|| "pair".to_owned());
    let n: u64 = args.next().and_then(|n| n.parse().ok()).unwrap_or(100_000);
    let request = AllocationRequest::new(4096, 256).expect("request");
    let registry = BindingRegistry::new();
    let floor: Arc<dyn DeviceAllocator> = Arc::new(CounterAllocator::new(DeviceKey::host(1)));
    let binding = registry.with_memory(Arc::clone(&floor)).expect("binding");
    for index in 0..64 {
        registry.with_memory(Arc::new(CounterAllocator::new(DeviceKey::device(index)))).expect("binding");
    }
    // Warm up: the pins, identity blocks and caches are created once.
    for _ in 0..300 {
        drop(binding.allocate(request).expect("allocate"));
        drop(registry.bind(DeviceKey::device(63)).expect("bind"));
        drop(registry.bind(DeviceKey::host(1)).expect("bind"));
    }
    match what.as_str() {
        "raw" => (0..n).for_each(|_| {
            let block = floor.allocate(black_box(&request)).expect("allocate");
            assert!(black_box(floor.release(block)).is_complete());
        }),
        "pair" => (0..n).for_each(|_| {
            let block = binding.allocate(black_box(request)).expect("allocate");
            black_box(binding.release(block).expect("release"));
        }),
        "drop" => (0..n).for_each(|_| drop(black_box(binding.allocate(black_box(request)).expect("allocate")))),
        "bind" => (0..n).for_each(|_| drop(black_box(registry.bind(black_box(DeviceKey::host(1))).expect("bind")))),
        "bind64" => {
            (0..n).for_each(|_| drop(black_box(registry.bind(black_box(DeviceKey::device(63))).expect("bind"))))
        }
        "remote" => {
            let (send, receive) = std::sync::mpsc::sync_channel(1024);
            std::thread::scope(|scope| {
                let binding = &binding;
                scope.spawn(move || {
                    for block in receive {
                        black_box(binding.release(block).expect("release"));
                    }
                });
                for _ in 0..n {
                    send.send(binding.allocate(black_box(request)).expect("allocate")).expect("releaser alive");
                }
                drop(send);
            });
        }
        "shared" | "setup" | "own" => {
            let setup =
                [registry.bind(DeviceKey::host(1)).expect("bind"), registry.bind(DeviceKey::host(1)).expect("bind")];
            let start = std::sync::Barrier::new(2);
            std::thread::scope(|scope| {
                for worker in 0..2 {
                    let (binding, setup, start, registry, what) = (&binding, &setup, &start, &registry, what.as_str());
                    scope.spawn(move || {
                        let own;
                        let using = match what {
                            "shared" => binding,
                            "setup" => &setup[worker],
                            _ => {
                                own = registry.bind(DeviceKey::host(1)).expect("bind");
                                &own
                            }
                        };
                        start.wait();
                        for _ in 0..n {
                            let block = using.allocate(black_box(request)).expect("allocate");
                            black_box(using.release(block).expect("release"));
                        }
                    });
                }
            });
        }
        "system" | "capi" | "capi_pooled" | "alternate" => system_pairs(&what, n),
        "pooled" | "segment" => {
            // Warm, every request is served from the pool's cache: the inner allocator is
            // not called, so the count is the pool's own bookkeeping.
            let pool: Arc<dyn DeviceAllocator> =
                Arc::new(allocator_cpu::PooledAllocator::new(allocator_cpu::SystemAllocator::new()));
            let request = match what.as_str() {
                "pooled" => request,
                _ => AllocationRequest::new(2 << 20, 256).expect("request"),
            };
            for _ in 0..300 {
                assert!(pool.release(pool.allocate(&request).expect("allocate")).is_complete());
            }
            (0..n).for_each(|_| {
                let block = pool.allocate(black_box(&request)).expect("allocate");
                assert!(black_box(pool.release(block)).is_complete());
            });
        }
        "governed" => {
            // The governor bench's `governed/counter_governed`: a pair through a binding
            // whose allocator is governed (an account with a limit on the device).
            let device = DeviceKey::device(100);
            let governor = memory_governor::Governor::new();
            let context = registry.register_provider_context(device, Arc::new(())).expect("context");
            let authority = registry.register_authority(device, Arc::new(())).expect("authority");
            governor.set_device_limit(device, 64 << 30).expect("limit");
            governor.open_account(memory_governor::AccountConfig::new(device, authority)).expect("account");
            let inner: Arc<dyn DeviceAllocator> = Arc::new(CounterAllocator::new(device));
            let governed: Arc<dyn DeviceAllocator> = Arc::new(governor.govern(inner, authority).expect("govern"));
            let mechanism = registry.register_allocator(&context, &authority, governed).expect("mechanism");
            let binding = registry.bind_registered(&mechanism).expect("bind");
            let request = request.with_role(memory_api::MemoryRole::KvCache);
            for _ in 0..300 {
                drop(binding.allocate(request).expect("allocate"));
            }
            (0..n).for_each(|_| {
                let block = binding.allocate(black_box(request)).expect("allocate");
                black_box(binding.release(block).expect("release"));
            });
        }
        other => {
            panic!(
                "unknown operation {other}: raw, pair, drop, bind, bind64, remote, governed, pooled, segment, system, capi, \
                 capi_pooled, shared, setup or own"
            )
        }
    }
}

/// The ffi bench's `capi_pair`: N pairs of 4 KiB over the system allocator, through a
/// Rust binding (`system`) or through `mc_allocate` / `mc_release` (`capi`); or through
/// `mc_allocate` / `mc_release` over the C API's pooled CPU allocator (`capi_pooled`),
/// which once warm calls no `malloc` or `free` for a block: glibc's cost for a 4 KiB
/// block depends on the heap's layout, which differs from one process to the next, so
/// `capi` counts come in two modes about 200 instructions apart and `capi_pooled` is
/// the one the instruction budget guards.
fn system_pairs(what: &str, n: u64) {
    use memory_capi::{
        MC_CPU_POOLED, MC_CPU_SYSTEM, MC_OK, mc_authority_register, mc_bind_mechanism, mc_context_register,
        mc_register_cpu_allocator, mc_registry_create,
    };
    use std::ptr::null_mut;
    let registry = BindingRegistry::new();
    let allocator = Arc::new(allocator_cpu::SystemAllocator::for_device(DeviceKey::host(5)));
    let rust = registry.with_memory(allocator).expect("binding");
    let request = AllocationRequest::new(SYSTEM_BYTES as usize, SYSTEM_ALIGN as usize).expect("request");
    let device = memory_plugin_abi::MpDevice { tier: memory_plugin_abi::MP_TIER_HOST, index: 5 };
    let kind = if what == "capi_pooled" { MC_CPU_POOLED } else { MC_CPU_SYSTEM };
    let (mut c_registry, mut context, mut authority, mut mechanism, mut c_binding) =
        (null_mut(), null_mut(), null_mut(), null_mut(), null_mut());
    // Every out-pointer is a live local, every handle one an earlier call made.
    let statuses = [
        // SAFETY: see above.
        unsafe { mc_registry_create(&mut c_registry) },
        // SAFETY: see above.
        unsafe { mc_context_register(c_registry, device, null_mut(), None, &mut context) },
        // SAFETY: see above.
        unsafe { mc_authority_register(c_registry, device, null_mut(), None, &mut authority) },
        // SAFETY: see above.
        unsafe { mc_register_cpu_allocator(c_registry, null_mut(), context, authority, kind, &mut mechanism) },
        // SAFETY: see above.
        unsafe { mc_bind_mechanism(c_registry, mechanism, &mut c_binding) },
    ];
    assert!(statuses.iter().all(|&status| status == MC_OK), "{statuses:?}");
    match what {
        "system" => rust_batch(&rust, request, n + 300),
        "capi" | "capi_pooled" => c_batch(c_binding, n + 300),
        // Batches of each in turn (see `memory_benches::interleaved`); run under
        // callgrind with `--toggle-collect=*rust_batch*` or `*c_batch*` to count one side.
        _ => {
            let (rust_time, c_time) =
                memory_benches::interleaved(n + 300, || rust_batch(&rust, request, 1), || c_batch(c_binding, 1));
            let per = |time: std::time::Duration| time.as_secs_f64() * 1e9 / (n + 300) as f64;
            println!(
                "rust {:.1} ns, c {:.1} ns, ratio {:.3}",
                per(rust_time),
                per(c_time),
                per(c_time) / per(rust_time)
            );
        }
    }
}

const SYSTEM_BYTES: u64 = 4096;
const SYSTEM_ALIGN: u64 = 64;

#[inline(never)]
fn rust_batch(binding: &memory_binding::MemoryBinding, request: AllocationRequest, n: u64) {
    (0..n).for_each(|_| {
        let block = binding.allocate(black_box(request)).expect("allocate");
        black_box(binding.release(block).expect("release"));
    });
}

#[inline(never)]
fn c_batch(binding: *mut memory_capi::McBinding, n: u64) {
    use memory_capi::{MC_OK, mc_allocate, mc_release};
    (0..n).for_each(|_| {
        let mut block = std::ptr::null_mut();
        // SAFETY: a live binding handle and out-pointer; the block is released once.
        let allocated = unsafe {
            mc_allocate(binding, SYSTEM_BYTES, SYSTEM_ALIGN, memory_plugin_abi::MP_ROLE_KV_CACHE, &mut block)
        };
        // SAFETY: as above.
        let released = unsafe { mc_release(binding, black_box(block), std::ptr::null_mut()) };
        assert!(allocated == MC_OK && released == MC_OK);
    });
}
