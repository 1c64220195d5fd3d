//! memory-trace's recording overhead (issue 26), against the governed pair in the same
//! run: allocate + release of 4 KiB through a binding, with the governed allocator
//! registered as is (`governed`) and wrapped by the recorder (`traced`: two events per
//! pair into the thread's ring, a writer thread draining, framing and checksumming them
//! into a sink), on the counter
//! allocator (no memory behind it: the governor's and the recorder's cost in full view)
//! and on the system allocator. Target: traced <= 1.1x governed.
//!
//! The two sides run interleaved in batches (`memory_benches::interleaved`), so a drift of
//! the machine moves both alike. After criterion's output a summary prints the medians of
//! this run's samples and the ratios.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use allocator_cpu::SystemAllocator;
use criterion::{Criterion, criterion_group, criterion_main};
use memory_benches::{CounterAllocator, interleaved};
use memory_governor::{
    AccountConfig, AllocationRequest, BindingRegistry, DeviceAllocator, DeviceKey, Governor, MemoryBinding, MemoryRole,
};
use memory_trace::{Recorder, RecorderConfig};

/// Makes the allocator under a stack's governed allocator.
type MakeAllocator = dyn Fn() -> Arc<dyn DeviceAllocator>;

/// Per-pair times of every sample, by bench name, for the summary.
static SAMPLES: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());

fn record(name: &str, elapsed: Duration, ops: u64) {
    let per_op = elapsed.as_secs_f64() * 1e9 / ops.max(1) as f64;
    SAMPLES.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(name.to_owned()).or_default().push(per_op);
}

/// Two bindings over `inner`'s device: one through the governed allocator, one through
/// the same kind of governed allocator wrapped by `recorder`.
fn bindings(
    inner: impl Fn() -> Arc<dyn DeviceAllocator>,
    recorder: &Recorder,
) -> (Vec<BindingRegistry>, MemoryBinding, MemoryBinding, Governor) {
    let governor = Governor::new();
    let mut registries = Vec::new();
    let mut out = Vec::new();
    for traced in [false, true] {
        let allocator = inner();
        let device = allocator.device();
        let registry = BindingRegistry::new();
        let context = registry.register_provider_context(device, Arc::new("bench")).expect("context");
        let authority = registry.register_authority(device, Arc::new("bench")).expect("authority");
        governor.set_device_limit(device, 64 << 30).expect("limit");
        governor.open_account(AccountConfig::new(device, authority).with_label("bench")).expect("account");
        let governed = governor.govern(allocator, authority).expect("govern");
        let allocator: Arc<dyn DeviceAllocator> =
            if traced { Arc::new(recorder.trace(&governor, governed)) } else { Arc::new(governed) };
        let mechanism = registry.register_allocator(&context, &authority, allocator).expect("mechanism");
        out.push(registry.bind_registered(&mechanism).expect("bind"));
        registries.push(registry);
    }
    let traced = out.pop().expect("two bindings");
    let governed = out.pop().expect("two bindings");
    (registries, governed, traced, governor)
}

fn trace(c: &mut Criterion) {
    // The writer drains, frames and checksums every event, into a sink: the disk's
    // bandwidth is not the recorder's cost (at about 76 bytes an event, this bench
    // produces over 1 GB/s of trace).
    let recorder = Recorder::to_writer(std::io::sink(), RecorderConfig::default()).expect("a recorder");
    let request = AllocationRequest::new(4096, 256).expect("request").with_role(MemoryRole::KvCache);
    let stacks: [(&str, Box<MakeAllocator>); 2] = [
        ("counter", Box::new(|| Arc::new(CounterAllocator::new(DeviceKey::device(0))))),
        ("system", Box::new(|| Arc::new(SystemAllocator::for_device(DeviceKey::device(1))))),
    ];
    let mut group = c.benchmark_group("trace");
    for (name, inner) in &stacks {
        let (_registries, governed, traced, _governor) = bindings(inner, &recorder);
        let pair = |binding: &MemoryBinding| {
            let block = binding.allocate(black_box(request)).expect("allocate");
            binding.release(black_box(block)).expect("release");
        };
        let (governed_key, traced_key) = (format!("trace/{name}_governed"), format!("trace/{name}_traced"));
        group.bench_function(format!("{name}_governed_vs_traced"), |b| {
            b.iter_custom(|iters| {
                let (governed_time, traced_time) = interleaved(iters, || pair(&governed), || pair(&traced));
                record(&governed_key, governed_time, iters);
                record(&traced_key, traced_time, iters);
                governed_time + traced_time
            })
        });
    }
    group.finish();
    let summary = recorder.finish().expect("the trace is written");
    println!(
        "\nrecorded {} events ({} bytes), {} ring waits, {} dropped",
        summary.events, summary.bytes, summary.waits, summary.dropped
    );
}

fn median(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

fn summary(_: &mut Criterion) {
    let samples = SAMPLES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    println!("\nmemory-trace recording overhead (medians of this run's samples, ns per allocate + release pair):");
    for stack in ["counter", "system"] {
        let (Some(governed), Some(traced)) =
            (samples.get(&format!("trace/{stack}_governed")), samples.get(&format!("trace/{stack}_traced")))
        else {
            continue;
        };
        let (governed, traced) = (median(governed), median(traced));
        println!(
            "  {stack:<8} governed {governed:>8.1}  traced {traced:>8.1}  traced/governed {:.2}x (target <= 1.10x)",
            traced / governed
        );
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = trace, summary
}
criterion_main!(benches);
