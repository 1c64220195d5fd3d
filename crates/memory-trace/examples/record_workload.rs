//! Records a small serving workload through the registry, the governor and the
//! recorder, the way a runtime would: two tenants on one simulated GPU, each with a
//! governed pool over the device's cache backing; a loader thread that places weights;
//! two engine threads per tenant that grow a paged KV cache per request (the request id
//! is the caller tag), take activations and workspace per step, and free a request's
//! pages when it finishes; one prompt too long for the device, which the governor's
//! recovery ladder refuses (a pool segment pinned by a small piece keeps the rest
//! idle). The checked-in `traces/workload.mtrace` is its output:
//!
//! ```text
//! cargo run -p memory-trace --example record_workload -- crates/memory-trace/traces/workload.mtrace
//! ```

use std::sync::Arc;

use allocator_cpu::{PooledAllocator, SystemAllocator};
use memory_governor::*;
use memory_trace::{MarkKind, Recorder, with_caller_tag};

const GPU: DeviceKey = DeviceKey::host(1);
const MIB: usize = 1 << 20;

fn request(bytes: usize, role: MemoryRole) -> AllocationRequest {
    AllocationRequest::new(bytes, 256).expect("a valid request").with_role(role)
}

fn serve(binding: &MemoryBinding, engine: u64, requests: u64, page: usize) {
    let mut finished = Vec::new();
    for id in 0..requests {
        let request_id = engine * 1000 + id;
        with_caller_tag(request_id, || {
            let mut pages = Vec::new();
            for step in 0..(3 + id % 4) as usize {
                if let Ok(block) = binding.allocate(request(page, MemoryRole::KvCache)) {
                    pages.push(block);
                }
                let activations = binding.allocate(request((2 + step % 3) * MIB, MemoryRole::Activations));
                let workspace = binding.allocate(request(256 << 10, MemoryRole::Workspace));
                for block in [activations, workspace].into_iter().flatten() {
                    binding.release(block).expect("a healthy release");
                }
            }
            finished.push(pages);
        });
        // Requests finish two behind: their pages go back.
        if finished.len() > 2 {
            for block in finished.remove(0) {
                binding.release(block).expect("a healthy release");
            }
        }
    }
    for block in finished.into_iter().flatten() {
        binding.release(block).expect("a healthy release");
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).unwrap_or_else(|| "workload.mtrace".to_owned());
    let registry = BindingRegistry::new();
    let context = registry.register_provider_context(GPU, Arc::new("simulated gpu"))?;
    let governor = Governor::new();
    governor.set_device_limit(GPU, 160 * MIB as u64)?;
    let recorder = Recorder::create(&path)?;
    let mut bindings = Vec::new();
    for (label, quota) in [("chat", 120 * MIB as u64), ("embed", 48 * MIB as u64)] {
        let authority = registry.register_authority(GPU, Arc::new(label))?;
        governor.open_account(AccountConfig::new(GPU, authority).with_label(label).with_quota(quota))?;
        let backing = governor.cache_backing(Arc::new(SystemAllocator::for_caches(GPU)));
        let pool: Arc<dyn DeviceAllocator> = Arc::new(PooledAllocator::new(backing));
        let traced = recorder.trace(&governor, governor.govern(pool, authority)?);
        let mechanism = registry.register_allocator(&context, &authority, Arc::new(traced))?;
        bindings.push(registry.bind_registered(&mechanism)?);
    }
    let (chat, embed) = (bindings[0].clone(), bindings[1].clone());
    recorder.mark(GPU, MarkKind::Note, "load weights");
    let weights: Vec<BoundAllocation> = std::thread::Builder::new()
        .name("loader".into())
        .spawn({
            let (chat, embed) = (chat.clone(), embed.clone());
            move || {
                let mut weights = Vec::new();
                for _ in 0..6 {
                    weights.push(chat.allocate(request(8 * MIB, MemoryRole::Weights)).expect("weights fit"));
                }
                for _ in 0..2 {
                    weights.push(embed.allocate(request(12 * MIB, MemoryRole::Weights)).expect("weights fit"));
                }
                weights
            }
        })?
        .join()
        .map_err(|_| "the loader panicked")?;
    recorder.mark(GPU, MarkKind::Note, "serve");
    std::thread::scope(|scope| {
        for (engine, (binding, page)) in
            [(&chat, 2 * MIB), (&chat, 2 * MIB), (&embed, MIB), (&embed, MIB)].into_iter().enumerate()
        {
            std::thread::Builder::new()
                .name(format!("engine-{engine}"))
                .spawn_scoped(scope, move || serve(binding, engine as u64 + 1, 12, page))
                .expect("a thread starts");
        }
    });
    // A 32 MiB scratch block freed, then a 3 MiB block carved from its segment: the
    // other 29 MiB stay idle in the pool and cannot be trimmed while the piece lives.
    let scratch = chat.allocate(request(32 * MIB, MemoryRole::Workspace))?;
    chat.release(scratch).expect("a healthy release");
    let pinning = with_caller_tag(42, || chat.allocate(request(3 * MIB, MemoryRole::KvCache)))?;
    // A prompt too long for what is left: the tenant's quota and the device limit on
    // allocated bytes hold it, what the process holds does not; the ladder trims, then
    // refuses with the reserved scope.
    let refused = with_caller_tag(9999, || chat.allocate(request(64 * MIB, MemoryRole::KvCache)));
    println!("the long prompt: {}", refused.as_ref().map_or_else(ToString::to_string, |_| "admitted".to_owned()));
    if let Ok(block) = refused {
        chat.release(block).expect("a healthy release");
    }
    chat.release(pinning).expect("a healthy release");
    for block in weights {
        let binding = if block.bytes() == 8 * MIB { &chat } else { &embed };
        binding.release(block).expect("a healthy release");
    }
    let summary = recorder.finish()?;
    println!("{path}: {} events, {} bytes", summary.events, summary.bytes);
    Ok(())
}
