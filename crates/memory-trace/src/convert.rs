//! Converters: to the Chrome trace-event format and to RMM's replay CSV log.
//!
//! - [`chrome_trace_json`] writes the shape of the governor's own timeline
//!   (`Governor::chrome_trace_json`): per device a process named `memory <device>`, an
//!   instant event per allocation (`charge <role>`), release (`refund <role>`), refusal,
//!   failure, lost block and mark, and a counter (`<device> charged bytes`) of the bytes
//!   held per role after each change, which trace viewers (`chrome://tracing`,
//!   <https://ui.perfetto.dev>) draw as memory over time. Threads are named.
//! - [`rmm_csv`] writes `Thread,Time,Action,Pointer,Size,Stream` rows, the log
//!   `rmm::mr::logging_resource_adaptor` writes and RMM's `REPLAY_BENCHMARK` reads: an
//!   `allocate` row per allocation and a `free` row when a block leaves the books (a
//!   complete release, or a block lost with its device). Time is seconds since the Unix
//!   epoch with microseconds; Pointer is hexadecimal; Size is the size asked for (the
//!   free row repeats its allocation's); Stream is 0, the default stream: the replay
//!   refuses a log with any stream but the default and per-thread ones ("Non-default
//!   streams not currently supported."), and a caller tag is no CUDA stream (it was
//!   written there, so a trace with caller tags gave a log RMM would not replay).
//!   Refusals and failures have no row (RMM's parser accepts only `allocate` and
//!   `free`; its replay takes any other action for a free), and a quarantined release is
//!   not a free (the block is still held). A trace that allocates a block it still holds
//!   (its release missing: a damaged or merged trace) gets a `free` of the earlier block
//!   first, as replay gives it back and the Chrome counters take it down.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use memory_governor::{DeviceKey, MemoryRole};
use serde_json::{Map, Value, json};

use crate::books::{Books, Change};
use crate::event::What;
use crate::read::Trace;

const ROLES: usize = MemoryRole::ALL.len();

/// The trace in the Chrome trace-event format, as a JSON string.
pub fn chrome_trace_json(trace: &Trace) -> String {
    chrome_trace(trace).to_string()
}

/// The trace in the Chrome trace-event format, as a JSON value.
pub fn chrome_trace(trace: &Trace) -> Value {
    let devices = trace.devices();
    let pid = |device: DeviceKey| devices.iter().position(|known| *known == device).map_or(0, |at| at + 1);
    let mut out = Vec::with_capacity(trace.events.len() * 2 + devices.len() + trace.threads.len());
    for &device in &devices {
        out.push(json!({
            "name": "process_name", "ph": "M", "ts": 0, "pid": pid(device), "tid": 0,
            "args": { "name": format!("memory {device}") },
        }));
    }
    for &device in &devices {
        for (thread, name) in &trace.threads {
            out.push(json!({
                "name": "thread_name", "ph": "M", "ts": 0, "pid": pid(device), "tid": thread,
                "args": { "name": name },
            }));
        }
    }
    let mut books = Books::default();
    let mut held: BTreeMap<DeviceKey, [u64; ROLES]> = BTreeMap::new();
    for (index, event) in trace.events.iter().enumerate() {
        let change = books.apply(index, event);
        let role = match change {
            Change::Opened { live, .. } | Change::Freed { live, .. } => Some(live.role),
            _ => event.role,
        };
        let name = match (&event.what, role) {
            (What::Allocate(_), Some(role)) => format!("charge {role}"),
            (What::Release { .. }, Some(role)) => format!("refund {role}"),
            (What::Refusal(_), Some(role)) => format!("refusal {role}"),
            (What::Lost(_), Some(role)) => format!("lost {role}"),
            (What::Mark { kind, .. }, _) => format!("mark {}", kind.name()),
            (_, _) => event.kind_name().to_owned(),
        };
        let ts_us = event.ts_ns as f64 / 1e3;
        let mut args = Map::new();
        args.insert("bytes".into(), json!(event.bytes()));
        args.insert("device".into(), json!(event.device.to_string()));
        args.insert("tenant".into(), json!(trace.tenant_label(event.tenant)));
        if let Some(role) = role {
            args.insert("role".into(), json!(role.name()));
        }
        match &event.what {
            What::Allocate(block) | What::Release { block, .. } | What::Lost(block) => {
                args.insert("id".into(), json!(format!("{:#x}", block.id)));
                args.insert("address".into(), json!(format!("{:#x}", block.address)));
                if block.caller != 0 {
                    args.insert("caller".into(), json!(block.caller));
                }
            }
            What::Refusal(refusal) => {
                args.insert("refusal".into(), json!(refusal.to_string()));
            }
            What::Mark { label, .. } => {
                args.insert("label".into(), json!(label));
            }
            _ => {}
        }
        if let What::Release { outcome, .. } = &event.what {
            args.insert("outcome".into(), json!(outcome.name()));
        }
        out.push(json!({
            "name": name, "cat": "memory", "ph": "i", "s": "t", "ts": ts_us,
            "pid": pid(event.device), "tid": event.thread, "args": args,
        }));
        // What the event moved on the counters: a block that left the books without
        // its release (replaced by one of the same identity) goes down first.
        let moved: &[(MemoryRole, u64, bool)] = match change {
            Change::Opened { live, replaced: None } => &[(live.role, live.bytes, true)],
            Change::Opened { live, replaced: Some(gone) } => {
                &[(gone.role, gone.bytes, false), (live.role, live.bytes, true)]
            }
            Change::Freed { live, freed, .. } => &[(live.role, freed, false)],
            _ => &[],
        };
        if !moved.is_empty() {
            let counts = held.entry(event.device).or_insert([0; ROLES]);
            for &(role, bytes, up) in moved {
                let slot = &mut counts[role.ordinal()];
                *slot = if up { slot.saturating_add(bytes) } else { slot.saturating_sub(bytes) };
            }
            let args: Map<String, Value> =
                MemoryRole::ALL.iter().map(|role| (role.name().to_owned(), json!(counts[role.ordinal()]))).collect();
            out.push(json!({
                "name": format!("{} charged bytes", event.device), "ph": "C", "ts": ts_us,
                "pid": pid(event.device), "tid": event.thread, "args": args,
            }));
        }
    }
    json!({
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": { "producer": "memory-trace", "format": format!("{}.{}", trace.version.0, trace.version.1) },
    })
}

/// The column header of [`rmm_csv`].
pub const RMM_CSV_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// The Stream of every [`rmm_csv`] row: CUDA's default stream, the one RMM's replay
/// takes (with the per-thread default stream, 2).
pub const RMM_DEFAULT_STREAM: u64 = 0;

/// The trace as RMM's replay CSV log; only `device`'s events when one is given (RMM
/// replays one device).
pub fn rmm_csv(trace: &Trace, device: Option<DeviceKey>) -> String {
    let mut csv = String::with_capacity(64 * trace.events.len() + 64);
    csv.push_str(RMM_CSV_HEADER);
    csv.push('\n');
    let mut books = Books::default();
    for (index, event) in trace.events.iter().enumerate() {
        let change = books.apply(index, event);
        if device.is_some_and(|device| device != event.device) {
            continue;
        }
        let time_ns = trace.origin_unix_ns.saturating_add(event.ts_ns);
        let (seconds, micros) = (time_ns / 1_000_000_000, time_ns % 1_000_000_000 / 1_000);
        // The default stream (see the module docs).
        let stream = RMM_DEFAULT_STREAM;
        let (action, address, size) = match (&event.what, change) {
            (What::Allocate(block), Change::Opened { replaced, .. }) => {
                if let Some(gone) = replaced {
                    // The trace allocates a block it still holds (its release is missing):
                    // the earlier one is freed first, as replay gives it back, or RMM's
                    // replay, which keeps the first allocation of a pointer, would free
                    // that one at the next free and leak this one.
                    let (address, size) = (block.address, gone.requested);
                    let _ = writeln!(csv, "{},{seconds}.{micros:06},free,{address:#x},{size},{stream}", event.thread);
                }
                ("allocate", block.address, block.requested)
            }
            (What::Release { block, .. }, Change::Freed { live, closed: true, .. }) => {
                ("free", block.address, live.requested)
            }
            (What::Lost(block), Change::Freed { live, closed: true, .. }) => ("free", block.address, live.requested),
            _ => continue,
        };
        let _ = writeln!(csv, "{},{seconds}.{micros:06},{action},{address:#x},{size},{stream}", event.thread);
    }
    csv
}
