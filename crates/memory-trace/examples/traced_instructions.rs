//! Counts what recording adds to a governed allocate + release pair, in instructions,
//! under callgrind (deterministic for one build, unlike time on a shared machine):
//!
//! ```text
//! cargo build --release -p memory-trace --example traced_instructions
//! for n in 10000 60000; do
//!     valgrind --tool=callgrind --callgrind-out-file=cg.$n target/release/examples/traced_instructions traced $n
//! done
//! callgrind_annotate --inclusive=no cg.10000; callgrind_annotate --inclusive=no cg.60000
//! ```
//!
//! `governed N` or `traced N` runs N pairs of 4 KiB through a binding over a counter
//! allocator (addresses from a counter: no memory and no malloc behind them, so nothing
//! the writer thread does moves the count), the governed allocator registered as is or
//! wrapped by a recorder writing into a sink. The difference of a function's counts at
//! the two N, divided by 50,000, is its instructions per pair, whatever runs once left
//! out. The recording thread's part is `TracedAllocator`'s `allocate` and `release`
//! (their own instructions; the governed allocate is inlined in the first), and
//! `quanta::Clock::raw`; the writer's, `Shared::drain_ring`, `Ring::drain` and
//! `crc32fast` (and `memset`, which an earlier writer called). (A thread that finds its ring full drains it itself, in the same
//! functions; how often depends on how valgrind schedules the writer, so only the
//! program's total moves with it.)

use std::cell::Cell;
use std::hint::black_box;
use std::sync::Arc;

use memory_governor::{
    AccountConfig, AllocError, AllocationRequest, BindingRegistry, DeviceAddress, DeviceAllocator, DeviceKey, Governor,
    MemoryBinding, MemoryRole, RawAllocation, ReleaseOutcome,
};
use memory_trace::{Recorder, RecorderConfig};

/// Hands out addresses from a counter: no memory behind them.
struct Counter(DeviceKey);

std::thread_local!(static NEXT: Cell<u64> = const { Cell::new(1 << 20) });

impl DeviceAllocator for Counter {
    fn device(&self) -> DeviceKey {
        self.0
    }

    fn name(&self) -> &str {
        "counter"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let start = NEXT.with(|next| next.replace(next.get() + 4096));
        let address = DeviceAddress::new(start).expect("the counter does not wrap");
        Ok(RawAllocation::new(address, request.bytes(), request.align(), self.0, 0))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        ReleaseOutcome::complete(allocation.bytes())
    }
}

/// `n` pairs through `binding` (the function callgrind's `--toggle-collect` names).
#[inline(never)]
fn pairs(binding: &MemoryBinding, request: AllocationRequest, n: u64) {
    for _ in 0..n {
        let block = binding.allocate(black_box(request)).expect("allocate");
        black_box(binding.release(block).expect("release"));
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let what = args.next().unwrap_or_else(|| "traced".to_owned());
    let n: u64 = args.next().and_then(|n| n.parse().ok()).unwrap_or(100_000);
    let recorder = Recorder::to_writer(std::io::sink(), RecorderConfig::default()).expect("a recorder");
    let device = DeviceKey::host(1);
    let governor = Governor::new();
    governor.set_device_limit(device, 64 << 30).expect("limit");
    let registry = BindingRegistry::new();
    let context = registry.register_provider_context(device, Arc::new("count")).expect("context");
    let authority = registry.register_authority(device, Arc::new("count")).expect("authority");
    governor.open_account(AccountConfig::new(device, authority).with_label("count")).expect("account");
    let governed = governor.govern(Arc::new(Counter(device)), authority).expect("govern");
    let allocator: Arc<dyn DeviceAllocator> = match what.as_str() {
        "governed" => Arc::new(governed),
        "traced" => Arc::new(recorder.trace(&governor, governed)),
        other => panic!("{other}: say governed or traced"),
    };
    let mechanism = registry.register_allocator(&context, &authority, allocator).expect("mechanism");
    let binding = registry.bind_registered(&mechanism).expect("bind");
    let request = AllocationRequest::new(4096, 256).expect("request").with_role(MemoryRole::KvCache);
    pairs(&binding, request, 300); // warm up: pins, identity blocks, the thread's ring
    pairs(&binding, request, n);
    let summary = recorder.finish().expect("written");
    eprintln!("{what} {n}: {} events recorded", summary.events);
}
