//! Observability: the JSON snapshot shape and the Chrome trace-event timeline (the
//! tracing events are checked in `tracing_events.rs`).

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use memory_governor::*;
use serde_json::Value;

const GPU: DeviceKey = DeviceKey::device(2);

const COUNTS: [&str; 7] =
    ["allocations", "releases", "live", "failures", "quarantined_bytes", "lost_bytes", "lost_allocations"];

fn assert_u64(value: &Value, key: &str) -> u64 {
    value.get(key).and_then(Value::as_u64).unwrap_or_else(|| panic!("{key} is not a number in {value}"))
}

fn assert_roles(roles: &Value) {
    let roles = roles.as_array().expect("roles is an array");
    let names: Vec<_> = roles.iter().map(|r| r["role"].as_str().unwrap()).collect();
    assert_eq!(names, MemoryRole::ALL.map(|r| r.name()));
    for role in roles {
        for key in ["current", "peak", "peak_used", "cached_credit"].iter().chain(COUNTS.iter()) {
            assert_u64(role, key);
        }
    }
}

#[test]
fn the_snapshot_serialises_to_the_documented_json_shape() {
    let (governor, account) = one_account(GPU, 10_000, 4_000, 64);
    governor
        .set_policy(
            GPU,
            Arc::new(GuaranteedReserve::new(Arc::new(ReclaimThenFail)).with_reserve(MemoryRole::Weights, 1000)),
        )
        .unwrap();
    let asked = Arc::new(Mutex::new(Vec::new()));
    governor.register_holder(GPU, 3, LeaseHolder::new("kv-evictor", Vec::new(), 0, asked));
    let _kv = account.lease(MemoryRole::KvCache, 1500).unwrap();
    let _weights = account.lease(MemoryRole::Weights, 800).unwrap();
    assert!(account.lease(MemoryRole::KvCache, 5000).is_err());
    // An unlimited device serialises its limit as null.
    let host = governor.open_account(AccountConfig::new(DeviceKey::HOST, authority())).unwrap();
    let _staging = host.lease(MemoryRole::Staging, 10).unwrap();

    let json: Value = serde_json::from_str(&governor.snapshot().to_json()).unwrap();
    let devices = json["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    let gpu = devices.iter().find(|d| d["device"] == "device:2").unwrap();
    assert_eq!(gpu["tier"], "device");
    assert_eq!(gpu["index"], 2);
    assert_eq!(gpu["limit"], 10_000);
    assert_eq!(assert_u64(gpu, "current"), 2300);
    // Charges, plus the 200 bytes of the weights reserve not in use, plus cached credit.
    assert!(assert_u64(gpu, "used") >= 2300 + 200);
    assert!(assert_u64(gpu, "peak") >= assert_u64(gpu, "current"));
    assert!(assert_u64(gpu, "peak_used") >= assert_u64(gpu, "used"));
    assert_u64(gpu, "cached_credit");
    assert_eq!(gpu["policy"], "guaranteed-reserve(reclaim-then-fail)");
    assert_eq!(gpu["reserves"][0]["role"], "weights");
    assert_eq!(gpu["reserves"][0]["target"], 1000);
    assert_eq!(gpu["reserves"][0]["held"], 200);
    assert_eq!(gpu["holders"][0]["name"], "kv-evictor");
    assert_eq!(gpu["holders"][0]["order"], 3);
    for key in COUNTS {
        assert_u64(&gpu["totals"], key);
    }
    assert_eq!(gpu["totals"]["failures"], 1);
    assert_eq!(gpu["totals"]["live"], 2);
    assert_roles(&gpu["roles"]);
    assert_eq!(gpu["roles"][1]["role"], "kv-cache");
    assert_eq!(gpu["roles"][1]["current"], 1500);
    let tenant = &gpu["authorities"][0];
    assert_eq!(tenant["authority"], account.authority().to_string());
    assert_eq!(tenant["label"], "tenant");
    assert_eq!(tenant["quota"], 4000);
    for key in ["current", "used", "peak", "peak_used", "cached_credit"] {
        assert_u64(tenant, key);
    }
    assert_roles(&tenant["roles"]);
    let host = devices.iter().find(|d| d["device"] == "host:0").unwrap();
    assert!(host["limit"].is_null());
    assert!(host["authorities"][0]["quota"].is_null());
}

#[test]
fn peaks_bound_the_highest_charge() {
    let (_governor, account) = one_account(GPU, 10_000, u64::MAX, 0);
    let a = account.lease(MemoryRole::KvCache, 3000).unwrap();
    let b = account.lease(MemoryRole::KvCache, 2000).unwrap();
    drop((a, b));
    let _c = account.lease(MemoryRole::KvCache, 100).unwrap();
    let snapshot = account.snapshot();
    // Without credit caching (chunk 0) the peak is exact.
    assert_eq!(snapshot.peak, 5000);
    assert_eq!(snapshot.role(MemoryRole::KvCache).peak, 5000);
    assert_eq!(snapshot.current, 100);
}

const MIB: u64 = 1 << 20;

#[test]
fn peaks_count_real_charges_not_the_credit_threads_cache() {
    // Default tunables: each thread draws 4 MiB of credit at a time.
    let governor = Governor::new();
    governor.set_device_limit(GPU, 1 << 30).unwrap();
    let account = governor.open_account(AccountConfig::new(GPU, authority())).unwrap();
    let kv = account.lease(MemoryRole::KvCache, MIB).unwrap();
    let held = account.lease(MemoryRole::Weights, 2 * MIB).unwrap();
    let peaks = |governor: &Governor| {
        let snapshot = governor.snapshot();
        let device = snapshot.device(GPU).unwrap().clone();
        let tenant = device.authorities[0].clone();
        (
            device.peak,
            tenant.peak,
            device.role(MemoryRole::KvCache).peak,
            tenant.role(MemoryRole::Weights).peak,
            device.cached_credit,
        )
    };
    assert_eq!(peaks(&governor), (3 * MIB, 3 * MIB, MIB, 2 * MIB, 8 * MIB), "(device, tenant, kv, weights, credit)");
    // What the budget bounded, cached credit included, is reported beside it.
    let snapshot = governor.snapshot();
    let device = snapshot.device(GPU).unwrap();
    assert_eq!((device.peak_used, device.authorities[0].peak_used), (11 * MIB, 11 * MIB));
    let roles = (device.role(MemoryRole::KvCache).peak_used, device.role(MemoryRole::Weights).peak_used);
    assert_eq!(roles, (5 * MIB, 6 * MIB));
    // Charges served from cached credit (no shared write) still raise the peak.
    drop(kv);
    let small: Vec<_> = (0..4).map(|_| account.lease(MemoryRole::KvCache, MIB / 4).unwrap()).collect();
    assert_eq!(peaks(&governor).0, 3 * MIB, "the peak is not lowered, nor raised by a refund");
    let more = account.lease(MemoryRole::Weights, MIB).unwrap();
    let (device, tenant, kv, weights, _) = peaks(&governor);
    assert_eq!((device, tenant, kv, weights), (4 * MIB, 4 * MIB, MIB, 3 * MIB));
    drop((small, more, held));
}

#[test]
fn charges_published_by_other_threads_count_in_the_peak() {
    let governor = Governor::new();
    let account = governor.open_account(AccountConfig::new(GPU, authority())).unwrap();
    // Each thread holds 1 MiB (past the publishing slack) until all have charged.
    let barrier = std::sync::Barrier::new(4);
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                let lease = account.lease(MemoryRole::Activations, MIB).unwrap();
                barrier.wait();
                drop(lease);
            });
        }
    });
    let snapshot = governor.snapshot();
    let device = snapshot.device(GPU).unwrap();
    assert_eq!((device.peak, device.role(MemoryRole::Activations).peak, device.current), (4 * MIB, 4 * MIB, 0));
}

#[test]
fn the_timeline_exports_a_chrome_trace_with_counters_and_instants() {
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 64);
    governor.enable_timeline(100);
    let kv = account.lease(MemoryRole::KvCache, 300).unwrap();
    let weights = account.lease(MemoryRole::Weights, 500).unwrap();
    assert!(account.lease(MemoryRole::KvCache, 900).is_err());
    drop(kv);
    drop(weights);
    governor.disable_timeline();
    let _unrecorded = account.lease(MemoryRole::KvCache, 1).unwrap();

    let trace: Value = serde_json::from_str(&governor.chrome_trace_json()).expect("the trace is JSON");
    let events = trace["traceEvents"].as_array().expect("traceEvents is an array");
    for event in events {
        for key in ["name", "ph", "ts", "pid", "tid", "args"] {
            assert!(event.get(key).is_some(), "{key} missing in {event}");
        }
        assert!(event["ts"].is_number() && event["pid"].is_number() && event["tid"].is_number(), "{event}");
    }
    let instants: Vec<_> = events.iter().filter(|e| e["ph"] == "i").collect();
    let names: Vec<_> = instants.iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["charge kv-cache", "charge weights", "refusal kv-cache", "refund kv-cache", "refund weights"]);
    assert_eq!(instants[0]["args"]["bytes"], 300);
    assert_eq!(instants[0]["args"]["role"], "kv-cache");
    assert_eq!(instants[0]["args"]["device"], "device:2");
    assert_eq!(instants[0]["args"]["authority"], account.authority().to_string());
    // Counter events draw charged bytes per role over time.
    let counters: Vec<_> = events.iter().filter(|e| e["ph"] == "C").collect();
    let series: Vec<(u64, u64)> = counters
        .iter()
        .map(|c| (c["args"]["kv-cache"].as_u64().unwrap(), c["args"]["weights"].as_u64().unwrap()))
        .collect();
    assert_eq!(series, [(300, 0), (300, 500), (0, 500), (0, 0)]);
    let timestamps: Vec<f64> = instants.iter().map(|e| e["ts"].as_f64().unwrap()).collect();
    assert!(timestamps.windows(2).all(|w| w[0] <= w[1]), "timestamps are ordered");
    // A metadata event names the device's process.
    assert!(events.iter().any(|e| e["ph"] == "M" && e["args"]["name"] == "memory device:2"));
}

#[test]
fn the_timeline_keeps_the_latest_events_and_counts_the_dropped() {
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 0);
    governor.enable_timeline(3);
    for _ in 0..4 {
        drop(account.lease(MemoryRole::Workspace, 10).unwrap());
    }
    let (events, dropped) = governor.timeline_events();
    assert_eq!((events.len(), dropped), (3, 5));
    let trace: serde_json::Value = serde_json::from_str(&governor.chrome_trace_json()).unwrap();
    assert_eq!(trace["otherData"]["dropped_events"], 5);
}

#[test]
fn timeline_events_serialise_and_a_smaller_capacity_keeps_the_latest() {
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 0);
    governor.enable_timeline(10);
    for bytes in 1..=5 {
        drop(account.lease(MemoryRole::Weights, bytes).unwrap());
    }
    governor.enable_timeline(2);
    let (events, dropped) = governor.timeline_events();
    assert_eq!((events.len(), dropped), (2, 8));
    let json: Value = serde_json::to_value(&events[1]).unwrap();
    assert_eq!((json["kind"].as_str(), json["bytes"].as_u64()), (Some("refund"), Some(5)), "{json}");
    assert_eq!((json["device"].as_str(), json["role"].as_str()), (Some("device:2"), Some("weights")));
}

#[test]
fn timeline_events_carry_their_thread_and_microseconds_since_the_governor_began() {
    let started = std::time::Instant::now();
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 0);
    governor.enable_timeline(8);
    std::thread::sleep(std::time::Duration::from_millis(5));
    drop(account.lease(MemoryRole::Weights, 1).unwrap());
    let other = account.clone();
    std::thread::spawn(move || drop(other.lease(MemoryRole::Weights, 2).unwrap())).join().unwrap();
    let events = governor.timeline_events().0;
    let elapsed_us = started.elapsed().as_secs_f64() * 1e6;
    assert!(events.iter().all(|e| e.ts_us >= 5000.0 && e.ts_us <= elapsed_us), "{events:?}");
    let threads: Vec<u64> = events.iter().map(|e| e.thread).collect();
    assert_eq!(threads.len(), 4);
    assert!(threads.iter().all(|&t| t > 0), "{threads:?}");
    assert_eq!((threads[0], threads[2]), (threads[1], threads[3]), "one number per thread");
    assert_ne!(threads[0], threads[2], "two threads, two numbers");
    // Each device is a process of the trace, numbered from 1.
    let host = governor.open_account(AccountConfig::new(DeviceKey::HOST, authority())).unwrap();
    drop(host.lease(MemoryRole::Staging, 1).unwrap());
    let trace: Value = serde_json::from_str(&governor.chrome_trace_json()).unwrap();
    let mut pids: Vec<u64> =
        trace["traceEvents"].as_array().unwrap().iter().filter_map(|e| e["pid"].as_u64()).collect();
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(pids, [1, 2]);
}
