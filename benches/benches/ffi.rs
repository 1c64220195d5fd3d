//! Both C directions against the same work through the Rust API, in one run (target:
//! each ratio <= 1.2):
//! - `capi_pair/rust` vs `capi_pair/c_api`: allocate + release of 4 KiB through a
//!   registry binding over the system allocator, from Rust and through the exported
//!   `mc_allocate` / `mc_release` (handle tables, guards and all).
//! - `plugin_pair/rust_system` vs `plugin_pair/plugin`: the same pair through a binding
//!   over the Rust system allocator and over the example C plugin (posix_memalign behind
//!   the plugin ABI, with the loader's records and checks).
//!
//! The same work on both sides: the plugin is built with -O2 like the Rust side (the
//! native build's default is -O0), and its plain allocate/release does what the Rust
//! system allocator does (the memory, live counters) without the example's test
//! machinery: it counts calls only when a fault is scripted and sweeps backings only
//! once one was made. What remains of the difference is the loader's (records, checks).
//!
//! Each side is timed in batches, after an untimed batch of the other side (see
//! [`interleaved`]): each then starts from the heap state the other side leaves, alike
//! for both. glibc's cost for a 64-byte-aligned block (`posix_memalign` splits and frees
//! a leader and a trailer, and the next large request consolidates the fast bins)
//! depends on that state, and two sides timed one after the other in one process can
//! differ by more than the C layer costs. `capi_pair/c_api_excess` and
//! `plugin_pair/plugin_excess` time both sides interleaved and report the C side's time
//! above the Rust side's, per pair: the two plain benches of a group run seconds apart,
//! and on a shared machine the same bench's median moves by more between runs than the
//! C layer costs. `cargo xtask bench` judges the target on `(rust + excess) / rust` and
//! reports the plain ratio beside it.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::ptr::null_mut;
use std::sync::Arc;
use std::time::Duration;

use allocator_cpu::SystemAllocator;
use criterion::{Criterion, criterion_group, criterion_main};
use memory_benches::interleaved;
use memory_capi::{
    MC_CPU_SYSTEM, MC_OK, McAllocation, McAuthority, McBinding, McContext, McMechanism, McRegistry, mc_allocate,
    mc_authority_register, mc_bind_mechanism, mc_context_register, mc_register_cpu_allocator, mc_registry_create,
    mc_release,
};
use memory_governor::{AllocationRequest, BindingRegistry, DeviceAllocator, DeviceKey, MemoryBinding, MemoryRole};
use memory_plugin::{InstanceOptions, PluginLibrary};
use memory_plugin_abi::{MP_ROLE_KV_CACHE, MP_TIER_HOST, MpDevice};
use memory_testkit::native::{Language, NativeBuild};

const BYTES: usize = 4096;
const ALIGN: usize = 64;

fn binding(allocator: Arc<dyn DeviceAllocator>) -> (BindingRegistry, MemoryBinding) {
    let registry = BindingRegistry::new();
    let device = allocator.device();
    let context = registry.register_provider_context(device, Arc::new(())).expect("a context");
    let authority = registry.register_authority(device, Arc::new(())).expect("an authority");
    let mechanism = registry.register_allocator(&context, &authority, allocator).expect("a mechanism");
    let binding = registry.bind_registered(&mechanism).expect("a binding");
    (registry, binding)
}

fn rust_pair(binding: &MemoryBinding, request: AllocationRequest) {
    let block = binding.allocate(request).expect("allocation");
    black_box(block.address());
    binding.release(block).expect("release");
}

fn capi_binding() -> *mut McBinding {
    let device = MpDevice { tier: MP_TIER_HOST, index: 5 };
    let mut registry: *mut McRegistry = null_mut();
    let mut context: *mut McContext = null_mut();
    let mut authority: *mut McAuthority = null_mut();
    let mut mechanism: *mut McMechanism = null_mut();
    let mut binding: *mut McBinding = null_mut();
    // SAFETY: every out-pointer is a live local.
    let created = unsafe { mc_registry_create(&mut registry) };
    // SAFETY: as above.
    let context_status = unsafe { mc_context_register(registry, device, null_mut(), None, &mut context) };
    // SAFETY: as above.
    let authority_status = unsafe { mc_authority_register(registry, device, null_mut(), None, &mut authority) };
    // SAFETY: as above.
    let registered =
        unsafe { mc_register_cpu_allocator(registry, null_mut(), context, authority, MC_CPU_SYSTEM, &mut mechanism) };
    // SAFETY: as above.
    let bound = unsafe { mc_bind_mechanism(registry, mechanism, &mut binding) };
    let statuses = [created, context_status, authority_status, registered, bound];
    assert!(statuses.iter().all(|&s| s == MC_OK), "{statuses:?}");
    binding
}

fn c_pair(binding: *mut McBinding) {
    let mut block: *mut McAllocation = null_mut();
    // SAFETY: a live out-pointer; a null report is allowed.
    let allocated = unsafe { mc_allocate(binding, BYTES as u64, ALIGN as u64, MP_ROLE_KV_CACHE, &mut block) };
    // SAFETY: as above.
    let released = unsafe { mc_release(binding, black_box(block), null_mut()) };
    assert!(allocated == MC_OK && released == MC_OK);
}

/// The time `measured` takes, each of its batches run right after a batch of `other`
/// (see [`interleaved`]).
fn alternating(iters: u64, measured: impl FnMut(), other: impl FnMut()) -> Duration {
    interleaved(iters, other, measured).1
}

/// How much longer `candidate` takes than `baseline`, the two interleaved (see
/// [`interleaved`]); at least a nanosecond, because criterion discards a bench with
/// any zero-time sample (a floor that only biases the figure against the candidate).
fn interleaved_excess(iters: u64, baseline: impl FnMut(), candidate: impl FnMut()) -> Duration {
    let (base, cand) = interleaved(iters, baseline, candidate);
    cand.saturating_sub(base).max(Duration::from_nanos(1))
}

fn capi(c: &mut Criterion) {
    let request = AllocationRequest::new(BYTES, ALIGN).expect("layout").with_role(MemoryRole::KvCache);
    let (_registry, rust) = binding(Arc::new(SystemAllocator::for_device(DeviceKey::host(5))));
    let c_binding = capi_binding();
    let rust_side = || rust_pair(&rust, request);
    let c_side = || c_pair(c_binding);
    let mut group = c.benchmark_group("capi_pair");
    group.bench_function("rust", |b| b.iter_custom(|iters| alternating(iters, rust_side, c_side)));
    group.bench_function("c_api", |b| b.iter_custom(|iters| alternating(iters, c_side, rust_side)));
    group.bench_function("c_api_excess", |b| b.iter_custom(|iters| interleaved_excess(iters, rust_side, c_side)));
    group.finish();
}

fn example_plugin() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    NativeBuild::new(Language::C("c11"))
        .source(root.join("crates/memory-plugin/tests/c/example_plugin.c"))
        .include(root.join("include"))
        .arg("-lpthread")
        // Optimised like the Rust side it is compared with (the build's default is -O0).
        .arg("-O2")
        .shared_library(&root.join("target/bench-plugin"), "libexample_plugin.so")
}

fn plugin(c: &mut Criterion) {
    let request = AllocationRequest::new(BYTES, ALIGN).expect("layout").with_role(MemoryRole::KvCache);
    let (_rust_registry, rust) = binding(Arc::new(SystemAllocator::for_device(DeviceKey::HOST)));
    // SAFETY: the example plugin is this workspace's own C source.
    let library = unsafe { PluginLibrary::load(example_plugin()) }.expect("the example plugin loads");
    let allocator = library.instantiate(&InstanceOptions::new().offer(0)).expect("an instance");
    let (_plugin_registry, plugin) = binding(Arc::new(allocator));
    let mut group = c.benchmark_group("plugin_pair");
    let rust_side = || rust_pair(&rust, request);
    let plugin_side = || rust_pair(&plugin, request);
    group.bench_function("rust_system", |b| b.iter_custom(|iters| alternating(iters, rust_side, plugin_side)));
    group.bench_function("plugin", |b| b.iter_custom(|iters| alternating(iters, plugin_side, rust_side)));
    group.bench_function("plugin_excess", |b| b.iter_custom(|iters| interleaved_excess(iters, rust_side, plugin_side)));
    group.finish();
}

criterion_group!(benches, capi, plugin);
criterion_main!(benches);
