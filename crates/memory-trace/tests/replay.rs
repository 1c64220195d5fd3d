//! Replay: the same trace and configuration give the same books; each stack reports
//! allocated, reserved, fragmentation, refusals (first refused event) and latencies; a
//! tighter device limit refuses where the recording did not, and a looser one admits
//! what the recording refused; the checked-in traces replay on every stack.

mod common;

use common::*;
use memory_governor::MemoryRole;
use memory_trace::replay::{self, AllocatorKind, ReplayConfig, table};
use memory_trace::{Trace, read_trace};

fn synthetic() -> Trace {
    read_trace(&synthetic_bytes()[..]).unwrap()
}

#[test]
fn the_same_trace_and_configuration_give_the_same_books() {
    let trace = synthetic();
    for &kind in AllocatorKind::ALL {
        for config in [ReplayConfig::new(kind), ReplayConfig::new(kind).with_device_limit(150 * MIB)] {
            let first = replay::replay(&trace, &config);
            let second = replay::replay(&trace, &config);
            assert_eq!(first.devices[0].books(), second.devices[0].books(), "{}", config.label());
            assert_eq!(first.devices[0].timeline, second.devices[0].timeline, "{}", config.label());
            assert_eq!(first.devices[0].largest_at_peak, second.devices[0].largest_at_peak);
        }
    }
}

#[test]
fn a_replay_reports_peaks_latencies_and_what_was_live_at_the_peak() {
    let trace = synthetic();
    let report = replay::replay(&trace, &ReplayConfig::new(AllocatorKind::System));
    let device = &report.devices[0];
    assert_eq!(device.device, GPU);
    assert_eq!(device.limit, Some(256 * MIB), "the recorded limit");
    // The recorded books: the peak the trace itself reaches.
    let mut live = 0i64;
    let mut peak = 0i64;
    let mut held = std::collections::HashMap::new();
    for event in &trace.events {
        match &event.what {
            memory_trace::What::Allocate(block) => {
                held.insert(block.address, block.bytes as i64);
                live += block.bytes as i64;
            }
            memory_trace::What::Release { block, outcome: memory_trace::ReleaseKind::Complete, .. }
            | memory_trace::What::Lost(block) => live -= held.remove(&block.address).unwrap(),
            _ => {}
        }
        peak = peak.max(live);
    }
    assert_eq!(device.peak_allocated, peak as u64, "the system stack holds exactly what was asked");
    assert_eq!(device.peak_reserved, device.peak_allocated, "no cache: reserved is allocated");
    assert_eq!(device.fragmentation_at_peak, 0.0);
    // The ladder refused 64 MiB of KV cache when recorded; here chat's quota (200 MiB)
    // refuses it; the staging failure (the allocator's) fits.
    assert_eq!(device.refusals.len(), 1, "{:?}", device.refusals);
    let refusal = &device.refusals[0];
    assert!(refusal.refused_when_recorded && refusal.requested == 64 * MIB);
    assert!(refusal.message.contains("authority quota"), "{}", refusal.message);
    assert_eq!(device.recorded_refusals_admitted, 1);
    assert_eq!((device.skipped_releases, device.live_at_end, device.failures), (0, 0, 0));
    assert_eq!(device.final_allocated, 0, "everything was released or lost by the end");
    let allocations = trace.events.iter().filter(|e| e.kind_name() == "allocate").count() as u64;
    assert_eq!(device.allocate.count, allocations + 2);
    assert!(device.allocate.p50_ns > 0 && device.allocate.p50_ns <= device.allocate.p99_ns);
    assert!(device.release.count > 0 && device.release.p99_ns <= device.release.max_ns);
    // The largest blocks at the peak, largest first: the embed weights.
    let largest = &device.largest_at_peak;
    assert!(largest.windows(2).all(|pair| pair[0].bytes >= pair[1].bytes));
    assert_eq!((largest[0].bytes, largest[0].tenant, largest[0].role), (16 * MIB, 2, MemoryRole::Weights));
    assert!(largest.iter().any(|block| block.role == MemoryRole::KvCache));
    // The timeline: one column per (tenant, role) series, its highest point the peak.
    assert!(device.series.contains(&(1, MemoryRole::KvCache)) && device.series.contains(&(2, MemoryRole::Workspace)));
    let highest = device.timeline.iter().map(|s| s.allocated.iter().sum::<u64>()).max().unwrap();
    assert_eq!(highest, device.peak_allocated, "the sampled timeline keeps the peak");
}

#[test]
fn a_pool_reserves_more_than_it_allocates_and_says_how_scattered_its_cache_is() {
    let trace = synthetic();
    let system = replay::replay(&trace, &ReplayConfig::new(AllocatorKind::System));
    let pooled = replay::replay(&trace, &ReplayConfig::new(AllocatorKind::Pooled));
    let (system, pooled) = (&system.devices[0], &pooled.devices[0]);
    assert!(pooled.peak_allocated >= system.peak_allocated, "a pool rounds blocks up");
    assert!(pooled.peak_reserved >= pooled.peak_allocated, "{} < {}", pooled.peak_reserved, pooled.peak_allocated);
    assert!((0.0..=1.0).contains(&pooled.fragmentation_at_peak));
    assert!(pooled.timeline.iter().all(|sample| sample.reserved >= sample.allocated.iter().sum::<u64>()));
}

#[test]
fn a_tighter_limit_refuses_and_names_the_first_refused_event() {
    let trace = synthetic();
    let report = replay::replay(&trace, &ReplayConfig::new(AllocatorKind::System).with_device_limit(140 * MIB));
    let device = &report.devices[0];
    let first = device.refusals.first().expect("140 MiB is below the recorded peak");
    assert!(first.message.contains("device limit"), "{}", first.message);
    assert!(device.skipped_releases > 0, "the refused blocks' releases are skipped");
    assert!(device.peak_allocated <= 140 * MIB);
    let text = table(&trace, std::slice::from_ref(&report));
    assert!(text.contains(&format!("first refused event #{}", first.event)), "{text}");
    // A limit below the weights refuses a weight first.
    let report = replay::replay(&trace, &ReplayConfig::new(AllocatorKind::Pooled).with_device_limit(64 * MIB));
    let first = &report.devices[0].refusals[0];
    assert_eq!((first.role, first.tenant), (MemoryRole::Weights, 1));
}

#[test]
fn quotas_are_the_recorded_ones_unless_left_out() {
    let trace = synthetic();
    // chat's recorded quota is 200 MiB: at 160 MiB it binds before the device limit does.
    let mut chat = trace.clone();
    chat.tenants[0].quota = Some(100 * MIB);
    let report = replay::replay(&chat, &ReplayConfig::new(AllocatorKind::System));
    let first = report.devices[0].refusals.first().expect("chat's quota of 100 MiB binds");
    assert!(first.message.contains("authority quota"), "{}", first.message);
    let report = replay::replay(&chat, &ReplayConfig::new(AllocatorKind::System).without_quotas());
    assert!(report.devices[0].refusals.is_empty());
}

#[test]
fn the_side_by_side_table_has_a_column_per_configuration() {
    let trace = synthetic();
    let configs: Vec<ReplayConfig> = AllocatorKind::ALL.iter().copied().map(ReplayConfig::new).collect();
    let reports = replay::replay_all(&trace, &configs);
    let text = table(&trace, &reports);
    println!("{text}");
    let header = text.lines().find(|line| line.starts_with("device:0")).unwrap();
    for name in ["system", "pooled", "virtual"] {
        assert!(header.contains(name), "{header}");
    }
    for row in ["peak allocated", "peak reserved", "fragmentation at peak", "refusals", "allocate p50 / p99"] {
        let line = text.lines().find(|line| line.starts_with(row)).unwrap_or_else(|| panic!("no {row} row"));
        assert_eq!(line.split("  ").filter(|cell| !cell.trim().is_empty()).count(), 4, "{line}");
    }
}

#[test]
fn the_checked_in_traces_replay_on_every_stack() {
    for name in ["synthetic.mtrace", "workload.mtrace"] {
        let path = trace_path(name);
        let trace = read_trace(std::fs::File::open(&path).unwrap()).unwrap();
        assert!(trace.damage.is_none(), "{name}: {:?}", trace.damage);
        assert!(trace.events.len() > 100, "{name}");
        for &kind in AllocatorKind::ALL {
            let report = replay::replay(&trace, &ReplayConfig::new(kind));
            for device in &report.devices {
                assert!(device.peak_allocated > 0, "{name} on {kind}");
                // A release is skipped only for a block this replay refused.
                assert!(device.skipped_releases as usize <= device.refusals.len(), "{name} on {kind}");
            }
        }
    }
}

#[test]
fn the_checked_in_workload_was_recorded_by_the_recorder_with_a_ladder_refusal() {
    // traces/workload.mtrace is examples/record_workload.rs's output.
    let trace = read_trace(std::fs::File::open(trace_path("workload.mtrace")).unwrap()).unwrap();
    let labels: Vec<&str> = trace.tenants.iter().map(|tenant| tenant.label.as_str()).collect();
    assert_eq!(labels, ["chat", "embed"]);
    assert!(trace.tenants.iter().all(|tenant| tenant.allocator.starts_with("pooled(")), "{:?}", trace.tenants);
    let names: Vec<&str> = trace.threads.iter().map(|(_, name)| name.as_str()).collect();
    for name in ["loader", "engine-0", "engine-3"] {
        assert!(names.contains(&name), "{names:?}");
    }
    let refusal = trace
        .events
        .iter()
        .find_map(|event| match &event.what {
            memory_trace::What::Refusal(refusal) => Some(refusal),
            _ => None,
        })
        .expect("the long prompt's refusal");
    assert_eq!(
        (refusal.scope, refusal.requested, refusal.caller),
        (Some(memory_trace::Scope::Reserved), 64 * MIB, 9999)
    );
    assert!(refusal.device_reserved > refusal.device_allocated && refusal.trimmed.is_some(), "{refusal}");
    assert!(
        trace.events.iter().any(|event| matches!(&event.what, memory_trace::What::Allocate(b) if b.caller == 1003))
    );
    assert_eq!(trace.end.map(|end| end.events), Some(trace.events.len() as u64));
}

/// A trace with events missing (a damaged file, traces merged): a block released twice,
/// one released that was never allocated, one allocated again while the trace still held
/// it. Each is reported with its event, and the table warns; the block allocated again is
/// given back first, so the replay leaves nothing charged (it used to keep the first
/// block charged, allocated and in host memory to the end, uncounted as live).
#[test]
fn events_the_recordings_books_cannot_pair_are_reported_and_leave_nothing_charged() {
    use memory_trace::replay::UnpairedKind::{AlreadyLive, NotLive};
    use memory_trace::{Block, Event, ReleaseKind, Tenant, TraceWriter, What};
    let (a, b) = (Block::new(1, 0x10_0000, 4096, 256), Block::new(2, 0x20_0000, 4096, 256));
    let allocate = |ts, block| Event::new(ts, 1, GPU, 1, Some(MemoryRole::KvCache), What::Allocate(block));
    let release = |ts, block| {
        Event::new(ts, 1, GPU, 1, None, What::Release { block, outcome: ReleaseKind::Complete, residual: 0 })
    };
    let mut writer = TraceWriter::new(Vec::new(), 0).unwrap();
    writer.tenant(&Tenant::new(1, GPU, "chat")).unwrap();
    for event in [allocate(1, a), allocate(2, a), release(3, a), release(4, a), release(5, b), allocate(6, b)] {
        writer.event(&event).unwrap();
    }
    let trace = read_trace(&writer.finish().unwrap()[..]).unwrap();
    for &kind in AllocatorKind::ALL {
        let report = replay::replay(&trace, &ReplayConfig::new(kind));
        let device = &report.devices[0];
        let unpaired: Vec<_> = device.unpaired.iter().map(|unpaired| (unpaired.event, unpaired.kind)).collect();
        assert_eq!(unpaired, [(1, AlreadyLive), (3, NotLive), (4, NotLive)], "{kind}");
        assert_eq!((device.unpaired[0].id, device.unpaired[0].address), (1, 0x10_0000));
        assert_eq!(device.final_allocated, 4096, "{kind}: only b, live at the end, is charged at the end");
        assert_eq!(device.live_at_end, 1, "{kind}");
        assert_eq!(device.peak_allocated, 4096, "{kind}: never both copies of a at once");
        let text = table(&trace, std::slice::from_ref(&report));
        assert!(
            text.contains(
                "releases or loses blocks it never allocated or had already released: 2 such event(s), the first #3"
            ) && text.contains("allocates blocks it still held: 1 such event(s), the first #1")
                && text.contains("record again"),
            "{text}"
        );
    }
    // A recorded trace pairs every event.
    for &kind in AllocatorKind::ALL {
        assert!(replay::replay(&synthetic(), &ReplayConfig::new(kind)).devices[0].unpaired.is_empty());
    }
}

/// `--compare` runs the configurations one after another in one process: the books of
/// each do not depend on which ran before it (each replay has its own governor and
/// stacks; the host allocator's addresses differ run to run, and nothing in the books
/// may follow them).
#[test]
fn the_books_of_a_configuration_do_not_depend_on_the_compare_order() {
    let trace = synthetic();
    let mut configs: Vec<ReplayConfig> = AllocatorKind::ALL
        .iter()
        .flat_map(|&kind| [ReplayConfig::new(kind), ReplayConfig::new(kind).with_device_limit(150 * MIB)])
        .collect();
    let forward = replay::replay_all(&trace, &configs);
    configs.reverse();
    let backward = replay::replay_all(&trace, &configs);
    for report in &forward {
        let other = backward.iter().find(|other| other.config == report.config).unwrap();
        assert_eq!(report.devices[0].books(), other.devices[0].books(), "{}", report.config.label());
        assert_eq!(report.devices[0].timeline, other.devices[0].timeline, "{}", report.config.label());
        assert_eq!(report.devices[0].unpaired, other.devices[0].unpaired);
    }
}

/// The virtual stack commits every block whole: a block whose size is not a page
/// multiple is reserved as whole pages and committed as such (it used to be refused as
/// misaligned, the error ignored, and the block counted though nothing was committed).
#[cfg(unix)]
#[test]
fn the_virtual_stack_rounds_blocks_to_whole_pages_and_commits_them() {
    use memory_trace::{Block, Event, Tenant, TraceWriter, What};
    let blocks = [Block::new(1, 0x10_0000, 100, 64), Block::new(2, 0x20_0000, 5000, 64)];
    let mut writer = TraceWriter::new(Vec::new(), 0).unwrap();
    writer.tenant(&Tenant::new(1, GPU, "chat")).unwrap();
    for (ts, block) in blocks.into_iter().enumerate() {
        writer.event(&Event::new(ts as u64, 1, GPU, 1, Some(MemoryRole::KvCache), What::Allocate(block))).unwrap();
    }
    let trace = read_trace(&writer.finish().unwrap()[..]).unwrap();
    let page = {
        use memory_governor::DeviceAllocator;
        let host = allocator_cpu::VirtualHostAllocator::new();
        host.virtual_backing().expect("reserve/commit").granularity() as u64
    };
    let device = replay::replay(&trace, &ReplayConfig::new(AllocatorKind::Virtual)).devices.remove(0);
    assert_eq!(device.failures, 0, "both blocks committed");
    assert_eq!(
        device.peak_allocated,
        100u64.next_multiple_of(page) + 5000u64.next_multiple_of(page),
        "whole pages: {device:?}"
    );
    let device = replay::replay(&trace, &ReplayConfig::new(AllocatorKind::System)).devices.remove(0);
    assert_eq!(device.peak_allocated, 5100, "other stacks hold what was asked");
}
