//! The simulation end to end on a small run: every milestone happens, nothing is lost,
//! and the trace and snapshot are JSON in the expected shape.

use memory_demo::{Config, footprint_violations, reserved_ratio, run};

fn small() -> Config {
    Config { requests: 240, threads: 2, progress: false, ..Config::default() }
}

#[test]
fn a_small_run_switches_loses_a_device_and_loses_nothing() {
    let report = run(&small()).unwrap();
    assert!(report.passed(), "{:?} {:?}\n{report}", report.check, report.footprint_violations);
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

#[test]
fn the_report_books_allocated_and_reserved_per_device_and_tenant_and_they_balance() {
    let report = run(&small()).unwrap();
    let text = report.to_string();
    for expected in [
        "footprint: allocated = charged to tenants, reserved = allocated + idle in pools",
        "Governor::cache_backing",
        "alloc. peak",
        "resv. peak",
        "resv/alloc",
        "caches peak",
        "trims",
        "largest free",
        "fragm.",
        "cached end",
        "reserved peak / allocated peak per device: gpu0 ",
        "footprint: books balance",
    ] {
        assert!(text.contains(expected), "report lacks {expected:?}:\n{text}");
    }
    assert_eq!(footprint_violations(&report.at_end), Vec::<String>::new());
    assert!(report.footprint_violations.is_empty());
    for device in report.at_end.devices.iter().chain(&report.governor.devices) {
        assert!(device.reserved >= device.allocated, "{device:?}");
        assert!(device.reserved_peak >= device.reserved, "{device:?}");
        for account in &device.authorities {
            assert!(account.reserved >= account.allocated, "{account:?}");
        }
    }
    // The pools ran over cache backings: both devices' caches held memory, and what
    // they held stayed within the device limit.
    for device in &report.governor.devices {
        assert!(device.held_by_caches_peak > 0, "{device:?}");
        assert!(device.held_by_caches_peak <= device.limit.unwrap(), "{device:?}");
        assert!(reserved_ratio(device) > 0.0);
        assert!(device.caches.iter().any(|c| c.name.contains("cache-backing(")), "{:?}", device.caches);
    }
    // A tenant's sampled reserved peak covers what it reserved when the requests ended.
    for device in &report.at_end.devices {
        for account in &device.authorities {
            let peak = report.tenant_reserved_peaks[&account.authority];
            assert!(peak >= account.reserved, "{}: peak {peak} < {}", account.label, account.reserved);
        }
    }
    let snapshot: serde_json::Value = serde_json::from_str(&report.snapshot_json()).unwrap();
    assert!(snapshot["at_end"]["devices"][0]["reserved"].as_u64().is_some());
    assert_eq!(snapshot["check"]["footprint_violations"].as_array().map(Vec::len), Some(0));
}
