//! The traces shipped in `traces/` (see `traces/README.md`: the default demo, the demo's
//! real models through ONNX Runtime, the recorder's own workload and the hand-written
//! synthetic trace; no C API program yet: the C API has no recorder) replay against the
//! three allocator configurations (system, pooled, virtual) and their books close: the
//! same books on every replay, and every block the recording handed out released, lost
//! with its device, or refused by the replay (whose release is then skipped): nothing
//! left live, nothing left charged.

mod common;

use std::collections::HashMap;

use common::*;
use memory_trace::replay::{self, AllocatorKind, ReplayConfig, table};
use memory_trace::{ReleaseKind, Trace, What, read_trace};

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
    for expected in ["demo.mtrace", "demo-ort.mtrace", "workload.mtrace", "synthetic.mtrace"] {
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
