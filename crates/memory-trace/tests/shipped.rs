//! The traces shipped in `traces/` (see `traces/README.md`: the default demo, the demo's
//! real models through ONNX Runtime, a C program recording through the C API, the
//! recorder's own workload and the hand-written synthetic trace) replay against the
//! three allocator configurations (system, pooled, virtual) and their books close: the
//! same books on every replay, and every block the recording handed out released, lost
//! with its device, or refused by the replay (whose release is then skipped): nothing
//! left live, nothing left charged. The C program's trace also holds, figure for figure,
//! the workload that program runs (memory-capi's `tests/programs.rs` checks the same
//! figures against a fresh recording).

mod common;

use std::collections::HashMap;

use common::*;
use memory_governor::{DeviceKey, MemoryRole};
use memory_trace::replay::{self, AllocatorKind, ReplayConfig, table};
use memory_trace::{MarkKind, ReleaseKind, Scope, Trace, What, read_trace};

/// Every `.mtrace` file shipped in `traces/`.
fn shipped() -> Vec<(String, Trace)> {
    let mut names: Vec<String> = std::fs::read_dir(trace_path(""))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".mtrace"))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let trace = read_trace(std::fs::File::open(trace_path(&name)).unwrap()).unwrap();
            assert!(trace.damage.is_none(), "{name}: {:?}", trace.damage);
            (name, trace)
        })
        .collect()
}

#[test]
fn the_traces_that_matter_are_shipped_small() {
    let names: Vec<String> = shipped().into_iter().map(|(name, _)| name).collect();
    for expected in ["demo.mtrace", "demo-ort.mtrace", "capi.mtrace", "workload.mtrace", "synthetic.mtrace"] {
        assert!(names.iter().any(|name| name == expected), "traces/{expected} is missing: {names:?}");
    }
    for name in &names {
        let bytes = std::fs::metadata(trace_path(name)).unwrap().len();
        assert!(bytes <= 400 << 10, "traces/{name} is {bytes} bytes: ship a shorter recording");
    }
}

#[test]
fn every_block_a_recorded_trace_hands_out_is_released_or_lost_by_its_end() {
    for (name, trace) in shipped() {
        if name == "synthetic.mtrace" {
            continue; // Written by hand (tests/common), not recorded.
        }
        assert_eq!(trace.end.map(|end| end.events), Some(trace.events.len() as u64), "{name}: a whole recording");
        let mut live: HashMap<(memory_governor::DeviceKey, u32, u64), u64> = HashMap::new();
        for event in &trace.events {
            let key = |id| (event.device, event.tenant, id);
            match &event.what {
                What::Allocate(block) => {
                    assert!(live.insert(key(block.id), block.bytes).is_none(), "{name}: block {} twice", block.id);
                }
                What::Release { block, outcome: ReleaseKind::Complete, .. } | What::Lost(block) => {
                    assert_eq!(live.remove(&key(block.id)), Some(block.bytes), "{name}: release of {}", block.id);
                }
                _ => {}
            }
        }
        assert!(
            live.is_empty(),
            "{name}: {} blocks never released: {:?}",
            live.len(),
            live.iter().take(5).collect::<Vec<_>>()
        );
    }
}

#[test]
fn every_shipped_trace_replays_deterministically_on_three_stacks_and_its_books_close() {
    for (name, trace) in shipped() {
        let configs: Vec<ReplayConfig> = AllocatorKind::ALL.iter().copied().map(ReplayConfig::new).collect();
        assert_eq!(configs.len(), 3, "system, pooled, virtual");
        let reports = replay::replay_all(&trace, &configs);
        for (config, report) in configs.iter().zip(&reports) {
            let again = replay::replay(&trace, config);
            assert_eq!(report.devices.len(), again.devices.len());
            for (device, repeat) in report.devices.iter().zip(&again.devices) {
                let what = format!("{name} on {} ({})", config.label(), device.device);
                assert_eq!(device.books(), repeat.books(), "{what}: the same books on every replay");
                assert!(device.peak_allocated > 0, "{what}");
                assert!(device.peak_reserved >= device.peak_allocated, "{what}");
                // Accounted for: a release is skipped only for a block this replay
                // refused, and nothing is live or charged once the trace has ended.
                assert!(device.skipped_releases as usize <= device.refusals.len(), "{what}");
                if name != "synthetic.mtrace" {
                    assert_eq!(device.live_at_end, 0, "{what}: the recording released everything");
                    assert_eq!(device.final_allocated, 0, "{what}: nothing charged at the end");
                }
            }
        }
        let text = table(&trace, &reports);
        for config in ["system", "pooled", "virtual"] {
            assert!(text.contains(config), "{name}: the side-by-side table names {config}:\n{text}");
        }
    }
}

#[test]
fn the_c_api_trace_holds_the_c_programs_workload_and_replays_its_refusal() {
    // memory-capi's tests/c/record.c: chat (a governed pool, quota 4 MiB) and embed (the
    // governed system allocator, quota 1 MiB) on host:1 (limit 8 MiB), each on a thread
    // of its own, every request's id its caller tag; embed's request 12 asks for 2 MiB.
    // The plain governor handle set embed's quota to 3 MiB and the limit to 16 MiB; the
    // recording handle lowered both before registration, so the 1 MiB and 8 MiB here
    // (and the refusal) are the books both handles share.
    let trace = read_trace(std::fs::File::open(trace_path("capi.mtrace")).unwrap()).unwrap();
    assert!(trace.damage.is_none(), "{:?}", trace.damage);
    let device = DeviceKey::host(1);
    let tenants: Vec<(&str, Option<u64>, Option<u64>)> =
        trace.tenants.iter().map(|tenant| (tenant.label.as_str(), tenant.quota, tenant.device_limit)).collect();
    assert_eq!(tenants, [("chat", Some(4 * MIB), Some(8 * MIB)), ("embed", Some(MIB), Some(8 * MIB))]);
    assert!(trace.tenants[0].allocator.starts_with("pooled("), "{:?}", trace.tenants[0]);
    assert!(trace.tenants.iter().all(|tenant| tenant.device == device));

    // Per tenant: allocations, releases, refusals, bytes asked for.
    let mut figures = [[0u64; 4]; 2];
    let mut marks = Vec::new();
    for event in &trace.events {
        assert_eq!(event.device, device);
        let tally = |tenant: u32| tenant as usize - 1;
        match &event.what {
            What::Allocate(block) => {
                let tenant = tally(event.tenant);
                figures[tenant][0] += 1;
                figures[tenant][3] += block.requested;
                let requests = if tenant == 0 { 1000..1024 } else { 2000..2024 };
                assert!(
                    requests.contains(&block.caller) || (block.caller == 1 && event.role == Some(MemoryRole::Weights)),
                    "an allocation of tenant {} tagged {}",
                    event.tenant,
                    block.caller
                );
            }
            What::Release { outcome: ReleaseKind::Complete, .. } => figures[tally(event.tenant)][1] += 1,
            What::Refusal(refusal) => {
                figures[tally(event.tenant)][2] += 1;
                assert_eq!((event.tenant, refusal.requested, refusal.caller), (2, 2 * MIB, 2012), "{refusal:?}");
                assert_eq!((refusal.scope, refusal.limit), (Some(Scope::Authority), MIB), "{refusal:?}");
            }
            What::Mark { kind: MarkKind::Note, label, .. } => marks.push(label.as_str()),
            other => panic!("the C program records no {other:?}"),
        }
    }
    assert_eq!(figures, [[169, 169, 0, 12_435_456], [48, 48, 1, 1_646_592]]);
    assert_eq!(marks, ["serve", "drain"]);
    let threads: std::collections::BTreeSet<u32> =
        trace.events.iter().filter(|event| event.tenant != 0).map(|event| event.thread).collect();
    assert_eq!(threads.len(), 2, "chat and embed on a thread each");

    for config in AllocatorKind::ALL.iter().copied().map(ReplayConfig::new) {
        let report = replay::replay(&trace, &config);
        let books = &report.devices[0];
        assert_eq!(books.refusals.len(), 1, "{}: the quota refuses the 2 MiB request again", config.label());
        assert!(books.refusals[0].refused_when_recorded && books.refusals[0].tenant == 2, "{}", config.label());
        assert!(books.peak_allocated >= MIB + 2 * (64 << 10), "{}: peak {}", config.label(), books.peak_allocated);
    }
}
