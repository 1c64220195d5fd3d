//! The demo binary as a user runs it.

use std::process::Command;

fn demo(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_memory-demo")).args(args).output().expect("the demo binary starts")
}

#[test]
fn demo_runs_and_ends_with_the_nothing_lost_check_and_writes_its_files() {
    let dir = std::env::temp_dir().join(format!("memory-demo-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (trace, snapshot) = (dir.join("trace.json"), dir.join("snapshot.json"));
    let output = demo(&[
        "--requests",
        "150",
        "--threads",
        "2",
        "--no-progress",
        "--trace",
        trace.to_str().unwrap(),
        "--snapshot",
        snapshot.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    for section in
        ["requests  served", "device", "footprint:", "resv. peak", "tenant @ device", "role", "check:", "nothing lost"]
    {
        assert!(stdout.contains(section), "missing {section:?} in:\n{stdout}");
    }
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    assert!(trace["traceEvents"].as_array().is_some_and(|events| !events.is_empty()));
    let snapshot: serde_json::Value = serde_json::from_slice(&std::fs::read(&snapshot).unwrap()).unwrap();
    assert_eq!(snapshot["check"]["passed"], serde_json::Value::Bool(true));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn demo_help_exits_zero_and_bad_flags_are_rejected() {
    let help = demo(&["--help"]);
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("Usage: memory-demo") && text.contains("--requests") && text.contains("--ort"), "{text}");
    let bad = demo(&["--bogus"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unexpected argument '--bogus'"));
    let bad = demo(&["--requests", "ten"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("invalid value 'ten' for '--requests <N>'"));
}

/// `--ort` on two requests per tenant and model: the footprint per device and tenant,
/// and the nothing-lost check. Skipped by name without the assets, unless
/// `MEMORY_ORT_REQUIRED=1` (as under `cargo xtask test`), which makes it fail instead.
#[test]
fn demo_ort_reports_allocated_and_reserved_per_device_and_tenant_and_loses_nothing() {
    if let Err(reason) = memory_ort::OrtAssets::locate() {
        assert!(!memory_ort::OrtAssets::required(), "{reason}");
        eprintln!("skipped demo_ort_reports_allocated_and_reserved_per_device_and_tenant_and_loses_nothing: {reason}");
        return;
    }
    let output = demo(&["--ort", "--requests", "2"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    for expected in [
        "Governor::cache_backing",
        "| allocated peak MiB | reserved peak MiB | reserved / allocated | held by caches peak MiB |",
        "idle in the pools",
        "largest free block",
        "fragmentation",
        "| reserved at end MiB |",
        "| voice |",
        "| scan |",
        "the footprint's books balance",
    ] {
        assert!(stdout.contains(expected), "missing {expected:?} in:\n{stdout}");
    }
}

#[test]
fn demo_record_writes_a_trace_that_replays_with_every_block_accounted_for() {
    use memory_trace::replay::{self, AllocatorKind, ReplayConfig};
    use memory_trace::{MarkKind, What};

    let dir = std::env::temp_dir().join(format!("memory-demo-record-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("demo.mtrace");
    let output = demo(&["--requests", "12", "--threads", "2", "--no-progress", "--record", path.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("recorded ") && stdout.contains("cargo xtask replay"), "{stdout}");
    let trace = memory_trace::read_trace(std::fs::File::open(&path).unwrap()).unwrap();
    assert!(trace.damage.is_none(), "{:?}", trace.damage);
    assert_eq!(trace.end.map(|end| end.events), Some(trace.events.len() as u64), "a whole recording");
    // Two simulated devices, the tenants of both installs (plain, then pooled).
    assert_eq!(trace.devices().len(), 2, "{:?}", trace.devices());
    for label in ["platform", "tenant-a", "tenant-b"] {
        assert!(trace.tenants.iter().any(|tenant| tenant.label == label), "{label}: {:?}", trace.tenants);
    }
    assert!(trace.tenants.iter().any(|tenant| tenant.allocator.starts_with("pooled")), "the switch to pools");
    // The device loss: its mark, then the blocks handed back at termination.
    assert!(trace.events.iter().any(|e| matches!(&e.what, What::Mark { kind: MarkKind::DeviceLost, .. })));
    assert!(trace.events.iter().any(|e| matches!(&e.what, What::Lost(_))));
    // Everything was released or lost by the end: the replay leaves nothing charged.
    for &kind in AllocatorKind::ALL {
        let report = replay::replay(&trace, &ReplayConfig::new(kind));
        for device in &report.devices {
            assert_eq!((device.live_at_end, device.final_allocated), (0, 0), "{kind} {}", device.device);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
