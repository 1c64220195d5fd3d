//! Converters: the Chrome trace has the governor's timeline shape and its counters add
//! up; RMM's CSV has RMM's columns, only the actions RMM's parser accepts, and every
//! free matches a live allocation of the same pointer and size (what its replay needs).

mod common;

use std::collections::HashMap;

use common::*;
use memory_trace::convert::{RMM_CSV_HEADER, chrome_trace, chrome_trace_json, rmm_csv};
use memory_trace::read_trace;
use serde_json::Value;

fn synthetic() -> memory_trace::Trace {
    read_trace(&synthetic_bytes()[..]).unwrap()
}

#[test]
fn the_chrome_trace_has_the_governors_timeline_shape() {
    let trace = synthetic();
    let json: Value = serde_json::from_str(&chrome_trace_json(&trace)).expect("valid JSON");
    assert_eq!(json, chrome_trace(&trace));
    let events = json["traceEvents"].as_array().unwrap();
    let process = events.iter().find(|e| e["name"] == "process_name").unwrap();
    assert_eq!(process["args"]["name"], "memory device:0");
    let threads: Vec<&str> =
        events.iter().filter(|e| e["name"] == "thread_name").map(|e| e["args"]["name"].as_str().unwrap()).collect();
    assert_eq!(threads, ["main", "loader", "chat-engine", "embed-engine"]);
    let instants = events.iter().filter(|e| e["ph"] == "i").count();
    assert_eq!(instants, trace.events.len(), "one instant event per event");
    for name in
        ["charge weights", "charge kv-cache", "refund kv-cache", "refusal kv-cache", "lost weights", "mark device lost"]
    {
        assert!(events.iter().any(|e| e["name"] == name), "no `{name}` event");
    }
    let refusal = events.iter().find(|e| e["name"] == "refusal kv-cache").unwrap();
    assert!(refusal["args"]["refusal"].as_str().unwrap().contains("device limit on reserved memory"));
    assert_eq!(refusal["args"]["tenant"], "chat");
    // The counters: bytes held per role, ending at zero (everything released or lost).
    let counters: Vec<&Value> = events.iter().filter(|e| e["ph"] == "C").collect();
    assert!(!counters.is_empty());
    let last = counters.last().unwrap();
    for role in memory_governor::MemoryRole::ALL {
        assert_eq!(last["args"][role.name()], 0, "{role} at the end");
    }
    let peak_kv = counters.iter().map(|c| c["args"]["kv-cache"].as_u64().unwrap()).max().unwrap();
    assert!(peak_kv >= 10 * MIB, "{peak_kv}");
    // Times are microseconds, non-decreasing.
    let times: Vec<f64> = events.iter().filter(|e| e["ph"] == "i").map(|e| e["ts"].as_f64().unwrap()).collect();
    assert!(times.windows(2).all(|pair| pair[0] <= pair[1]));
    assert_eq!(times[0], 1.0, "1000 ns is 1 us");
}

#[test]
fn the_rmm_csv_has_rmms_columns_and_every_free_matches_an_allocation() {
    let trace = synthetic();
    let csv = rmm_csv(&trace, None);
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some(RMM_CSV_HEADER));
    assert_eq!(RMM_CSV_HEADER, "Thread,Time,Action,Pointer,Size,Stream");
    let mut live: HashMap<u64, u64> = HashMap::new();
    let (mut allocates, mut frees) = (0, 0);
    for line in lines {
        let cells: Vec<&str> = line.split(',').collect();
        assert_eq!(cells.len(), 6, "{line}");
        let thread: u64 = cells[0].parse().unwrap();
        assert!((1..=4).contains(&thread), "{line}");
        let (seconds, micros) = cells[1].split_once('.').unwrap();
        assert!(seconds.parse::<u64>().unwrap() >= 1_700_000_000 && micros.len() == 6, "{line}");
        let pointer = u64::from_str_radix(cells[3].strip_prefix("0x").unwrap(), 16).unwrap();
        let size: u64 = cells[4].parse().unwrap();
        let _stream: u64 = cells[5].parse().unwrap();
        match cells[2] {
            "allocate" => {
                assert!(live.insert(pointer, size).is_none(), "pointer allocated twice: {line}");
                allocates += 1;
            }
            "free" => {
                assert_eq!(live.remove(&pointer), Some(size), "a free without its allocation: {line}");
                frees += 1;
            }
            other => panic!("RMM's parser accepts allocate and free only, got {other}"),
        }
    }
    assert!(live.is_empty(), "every block is freed by the end (released or lost): {live:?}");
    let recorded = trace.events.iter().filter(|e| e.kind_name() == "allocate").count();
    assert_eq!((allocates, frees), (recorded, recorded));
    // A quarantined release is not a free: the weight's free comes with its retry.
    assert!(!csv.contains("quarantined"));
}

#[test]
fn the_rmm_csv_of_one_device_leaves_the_others_out() {
    let trace = synthetic();
    let csv = rmm_csv(&trace, Some(memory_governor::DeviceKey::device(3)));
    assert_eq!(csv.lines().count(), 1, "header only");
}

/// RMM's REPLAY_BENCHMARK (benchmarks/replay/replay.cpp, parse_per_thread_events) reads
/// Stream as a decimal number and refuses a log with any stream but CUDA's default (0)
/// and per-thread default (2) ones: "Non-default streams not currently supported." The
/// caller tag was written there, so the log of a trace with caller tags (the synthetic
/// trace's request ids) was one RMM would not replay. It reads Pointer with
/// `std::stoll(.., 16)`, Thread and Size as decimal numbers.
#[test]
fn the_rmm_csv_is_one_rmms_replay_accepts_whatever_the_caller_tags() {
    let trace = synthetic();
    assert!(
        trace.events.iter().any(|event| matches!(&event.what, memory_trace::What::Allocate(block) if block.caller > 2)),
        "the trace has caller tags that are no stream"
    );
    let csv = rmm_csv(&trace, None);
    for line in csv.lines().skip(1) {
        let cells: Vec<&str> = line.split(',').collect();
        let stream: u64 = cells[5].parse().unwrap_or_else(|_| panic!("Stream is decimal: {line}"));
        assert!(stream == 0 || stream == 2, "RMM replays the default streams only: {line}");
        assert!(i64::from_str_radix(cells[3].strip_prefix("0x").unwrap(), 16).is_ok(), "{line}");
        assert!(cells[0].parse::<u64>().is_ok() && cells[4].parse::<u64>().is_ok(), "{line}");
    }
}

/// A trace that allocates a block it still holds (its release missing: a damaged or
/// merged recording). The RMM log had two `allocate` rows for one pointer: RMM's replay
/// keeps the first allocation of a pointer (`unordered_map::insert`), so the next free
/// gave back the first block and the second leaked; and the Chrome counters counted
/// both, never coming back to zero. The earlier block leaves the books when the trace
/// allocates again (as replay gives it back): a free row first, the counter down first.
#[test]
fn a_block_allocated_again_while_held_is_freed_first_in_the_rmm_log_and_the_counters() {
    use memory_governor::MemoryRole;
    use memory_trace::{Block, Event, ReleaseKind, Tenant, TraceWriter, What};
    let block = Block::new(1, 0x10_0000, 4096, 256);
    let allocate = |ts| Event::new(ts, 1, GPU, 1, Some(MemoryRole::KvCache), What::Allocate(block));
    let release = Event::new(3, 1, GPU, 1, None, What::Release { block, outcome: ReleaseKind::Complete, residual: 0 });
    let mut writer = TraceWriter::new(Vec::new(), 0).unwrap();
    writer.tenant(&Tenant::new(1, GPU, "chat")).unwrap();
    for event in [allocate(1), allocate(2), release] {
        writer.event(&event).unwrap();
    }
    let trace = read_trace(&writer.finish().unwrap()[..]).unwrap();
    let csv = rmm_csv(&trace, None);
    let actions: Vec<&str> = csv.lines().skip(1).map(|line| line.split(',').nth(2).unwrap()).collect();
    assert_eq!(actions, ["allocate", "free", "allocate", "free"], "{csv}");
    // RMM's replay: a pointer's first allocation is kept; a free takes it out.
    let mut held: HashMap<&str, &str> = HashMap::new();
    for line in csv.lines().skip(1) {
        let cells: Vec<&str> = line.split(',').collect();
        match cells[2] {
            "allocate" => assert!(held.insert(cells[3], cells[4]).is_none(), "allocated while held: {csv}"),
            _ => assert_eq!(held.remove(cells[3]), Some(cells[4]), "a free of what was allocated: {csv}"),
        }
    }
    assert!(held.is_empty(), "nothing leaks in RMM's replay: {csv}");
    let json = chrome_trace(&trace);
    let counters: Vec<u64> = json["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "C")
        .map(|e| e["args"]["kv-cache"].as_u64().unwrap())
        .collect();
    assert_eq!(counters, [4096, 4096, 0], "one block held at a time, none at the end");
}
