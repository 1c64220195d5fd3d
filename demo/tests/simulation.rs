//! The simulation end to end on a small run: every milestone happens, nothing is lost,
//! and the trace and snapshot are JSON in the expected shape.

use memory_demo::{Config, run};

fn small() -> Config {
    Config { requests: 240, threads: 2, progress: false, ..Config::default() }
}

#[test]
fn a_small_run_switches_loses_a_device_and_loses_nothing() {
    let report = run(&small()).unwrap();
    assert!(report.check.passed(), "{:?}\n{report}", report.check);
    assert!(report.check.allocations > 1000, "{:?}", report.check);
    assert!(report.check.lost > 0, "the device loss retires the lost device's allocations");
    assert_eq!(report.check.refunded_lost, report.check.lost);
    let text = report.to_string();
    for expected in ["switch", "system -> pooled", "invalidated", "new context took over", "nothing lost", "tenant-a"] {
        assert!(text.contains(expected), "report lacks {expected:?}:\n{text}");
    }
    assert!(report.served > 0);
}

#[test]
fn the_trace_is_a_chrome_trace_with_counters_and_instants() {
    let report = run(&small()).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&report.trace_json).expect("the trace is JSON");
    let events = trace["traceEvents"].as_array().expect("traceEvents is an array");
    assert!(!events.is_empty());
    for event in events {
        for field in ["name", "ph", "pid", "ts"] {
            assert!(event.get(field).is_some(), "event lacks {field}: {event}");
        }
    }
    let phases: std::collections::BTreeSet<_> = events.iter().filter_map(|e| e["ph"].as_str()).collect();
    assert!(phases.contains("C"), "memory over time needs counter events: {phases:?}");
    assert!(phases.contains("i"), "allocations and refunds are instant events: {phases:?}");
    let counters = events.iter().filter(|e| e["ph"] == "C");
    assert!(counters.clone().all(|e| e["args"].is_object()), "counter events carry their values in args");
    assert!(counters.clone().any(|e| e["args"]["kv-cache"].as_u64().is_some_and(|b| b > 0)));
}

#[test]
fn the_snapshot_is_json_with_the_books_and_the_check() {
    let report = run(&small()).unwrap();
    let snapshot: serde_json::Value = serde_json::from_str(&report.snapshot_json()).expect("the snapshot is JSON");
    assert_eq!(snapshot["governor"]["devices"].as_array().map(Vec::len), Some(2));
    assert_eq!(snapshot["check"]["passed"], serde_json::Value::Bool(true));
    assert!(snapshot["registry"]["mechanisms"].as_array().is_some_and(|m| !m.is_empty()));
    let device = &snapshot["governor"]["devices"][0];
    assert!(device["authorities"].as_array().is_some_and(|a| a.len() == 3), "platform and two tenants");
}

#[test]
fn every_request_is_either_served_or_refused_with_a_reason() {
    let config = Config { requests: 90, threads: 3, progress: false, ..Config::default() };
    let report = run(&config).unwrap();
    let refused: u64 = report.refused.iter().map(|(_, n)| n).sum();
    assert_eq!(report.served + refused, 90);
}
