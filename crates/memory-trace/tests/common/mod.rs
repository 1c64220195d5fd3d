//! The synthetic trace the tests share: two tenants on one GPU, a KV cache that grows
//! in pages and shrinks, weights loaded once, activations per step, a refusal by the
//! recovery ladder, a quarantine and its retry, a device loss and termination, marks.
//! Times and identities are fixed, so the bytes are too (`traces/synthetic.mtrace`).
#![allow(dead_code, unreachable_pub)]

use memory_governor::{DeviceKey, MemoryRole};
use memory_trace::{
    Block, Event, FailureKind, MarkKind, Refusal, RefusalKind, ReleaseKind, Scope, Tenant, TraceWriter, What,
};

pub const GPU: DeviceKey = DeviceKey::device(0);
pub const MIB: u64 = 1 << 20;

/// The path of a checked-in trace.
pub fn trace_path(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("traces").join(name)
}

/// A refusal as the ladder makes it, with round figures.
pub fn ladder_refusal(requested: u64) -> Refusal {
    let mut refusal = memory_trace::Refusal::of(
        &memory_governor::AdmissionError::Overflow { role: MemoryRole::KvCache, requested, held: 0, max: 0 },
        requested,
        256,
        9,
    );
    refusal.kind = RefusalKind::Exhausted;
    refusal.scope = Some(Scope::Reserved);
    (refusal.used, refusal.limit, refusal.available) = (250 * MIB, 256 * MIB, 6 * MIB);
    (refusal.device_allocated, refusal.device_reserved, refusal.device_cached) = (230 * MIB, 250 * MIB, 20 * MIB);
    (refusal.largest_free, refusal.tenant_allocated, refusal.tenant_reserved) = (4 * MIB, 150 * MIB, 170 * MIB);
    refusal.trimmed = Some(0);
    refusal.reclaimed = None;
    refusal
}

/// The synthetic trace's events, in time order.
pub fn synthetic_events() -> Vec<Event> {
    let mut events = Vec::new();
    let mut ts = 1_000u64;
    let mut next_id = 0x1_0000u64;
    let mut address = 0x7f00_0000_0000u64;
    let mut tick = |step: u64| {
        ts += step;
        ts
    };
    let mut block = |bytes: u64, caller: u64| {
        next_id += 1;
        let at = address;
        address += bytes.next_multiple_of(4096);
        Block::new(next_id, at, bytes, 256).with_caller(caller)
    };
    let allocate = |ts: u64, thread: u32, tenant: u32, role: MemoryRole, block: Block| {
        Event::new(ts, thread, GPU, tenant, Some(role), What::Allocate(block))
    };
    let release = |ts: u64, thread: u32, tenant: u32, block: Block| {
        Event::new(ts, thread, GPU, tenant, None, What::Release { block, outcome: ReleaseKind::Complete, residual: 0 })
    };
    events.push(Event::new(
        tick(0),
        1,
        GPU,
        0,
        None,
        What::Mark { kind: MarkKind::Note, value: 0, label: "load".into() },
    ));
    // Weights: tenant 1 (chat) 96 MiB in 8 pieces, tenant 2 (embed) 32 MiB in 2.
    let mut weights = Vec::new();
    for i in 0..8 {
        let b = block(12 * MIB, 0);
        events.push(allocate(tick(5_000 + i * 10), 1, 1, MemoryRole::Weights, b));
        weights.push((1, b));
    }
    for _ in 0..2 {
        let b = block(16 * MIB, 0);
        events.push(allocate(tick(7_000), 2, 2, MemoryRole::Weights, b));
        weights.push((2, b));
    }
    events.push(Event::new(
        tick(100),
        1,
        GPU,
        0,
        None,
        What::Mark { kind: MarkKind::Note, value: 0, label: "serve".into() },
    ));
    // Serving: 24 steps; tenant 1 grows its KV cache by 2 MiB pages per request and frees
    // the pages of a finished request; both tenants take activations per step.
    let mut kv: Vec<Vec<Block>> = Vec::new();
    for step in 0..24u64 {
        let request = step % 6 + 1;
        if kv.len() < 6 {
            kv.push(Vec::new());
        }
        let pages = &mut kv[(request - 1) as usize];
        for _ in 0..(2 + step % 3) {
            let b = block(2 * MIB, request);
            events.push(allocate(tick(2_000), 3, 1, MemoryRole::KvCache, b));
            pages.push(b);
        }
        let acts = block((4 + step % 5) * MIB, request);
        events.push(allocate(tick(500), 3, 1, MemoryRole::Activations, acts));
        let embed = block(3 * MIB + step * 4096, 100 + step);
        events.push(allocate(tick(300), 4, 2, MemoryRole::Activations, embed));
        let workspace = block(512 << 10, 100 + step);
        events.push(allocate(tick(200), 4, 2, MemoryRole::Workspace, workspace));
        events.push(release(tick(20_000), 3, 1, acts));
        events.push(release(tick(300), 4, 2, embed));
        events.push(release(tick(100), 4, 2, workspace));
        if step % 6 == 5 {
            // Request finished: its pages go back (the oldest first).
            for finished in kv.iter_mut().take(3) {
                for page in finished.drain(..) {
                    events.push(release(tick(50), 3, 1, page));
                }
            }
        }
        if step == 17 {
            // A long prompt asks for 64 MiB of KV cache: the ladder refuses it.
            let refusal = ladder_refusal(64 * MIB);
            events.push(Event::new(
                tick(1_000),
                3,
                GPU,
                1,
                Some(MemoryRole::KvCache),
                What::Refusal(Box::new(refusal)),
            ));
            events.push(Event::new(
                tick(10),
                4,
                GPU,
                2,
                Some(MemoryRole::Staging),
                What::Failure { requested: MIB, align: 4096, caller: 7, error: FailureKind::OutOfMemory },
            ));
        }
    }
    // A quarantined release of an embed weight, then its retry.
    let (_, quarantined) = weights.pop().unwrap();
    events.push(Event::new(
        tick(1_000),
        2,
        GPU,
        2,
        None,
        What::Release { block: quarantined, outcome: ReleaseKind::Quarantined, residual: 8 * MIB },
    ));
    events.push(release(tick(1_000), 2, 2, quarantined));
    // The device is lost; at termination the rest comes back as lost blocks.
    events.push(Event::new(
        tick(5_000),
        1,
        GPU,
        0,
        None,
        What::Mark { kind: MarkKind::DeviceLost, value: 0, label: "xid 79".into() },
    ));
    let mut lost = 0;
    for (tenant, b) in weights {
        events.push(Event::new(tick(10), 1, GPU, tenant, None, What::Lost(b.with_caller(0))));
        lost += 1;
    }
    for page in kv.into_iter().flatten() {
        events.push(Event::new(tick(10), 1, GPU, 1, None, What::Lost(page.with_caller(0))));
        lost += 1;
    }
    events.push(Event::new(
        tick(10),
        1,
        GPU,
        0,
        None,
        What::Mark { kind: MarkKind::Terminated, value: lost, label: format!("{lost} lost blocks handed back") },
    ));
    events
}

/// The synthetic trace's bytes.
pub fn synthetic_bytes() -> Vec<u8> {
    let mut writer = TraceWriter::new(Vec::new(), 1_700_000_000_000_000_000).unwrap();
    let mut chat = Tenant::new(1, GPU, "chat").with_quota(200 * MIB).with_device_limit(256 * MIB);
    chat.authority = "auth:r1.1".into();
    chat.allocator = "cuda-pool".into();
    let mut embed = Tenant::new(2, GPU, "embed").with_device_limit(256 * MIB);
    embed.authority = "auth:r1.2".into();
    embed.allocator = "cuda-pool".into();
    writer.tenant(&chat).unwrap();
    writer.tenant(&embed).unwrap();
    for (thread, name) in [(1, "main"), (2, "loader"), (3, "chat-engine"), (4, "embed-engine")] {
        writer.thread(thread, name).unwrap();
    }
    for event in synthetic_events() {
        writer.event(&event).unwrap();
    }
    writer.finish().unwrap()
}
