//! A bounded timeline of charges and refunds, exported in the Chrome trace-event format
//! (open it in `chrome://tracing` or <https://ui.perfetto.dev>).
//!
//! Recording is off by default and costs one relaxed load per charge while off. When
//! on, each event takes a short lock (no callback runs under it), so turn it on to look,
//! not in production hot loops. The counter series count the bytes charged and
//! refunded while recording was on (they start from zero when recording starts).

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use memory_api::{AuthorityIdentity, DeviceKey, MemoryRole};
use serde_json::{Map, Value, json};

use crate::credit::ROLES;
use crate::sync::{AtomicBool, Mutex, Ordering, lock};

/// What a timeline event records.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum TimelineEventKind {
    /// Bytes were charged (a lease, a growth, a governed allocation).
    Charge,
    /// Bytes were refunded.
    Refund,
    /// A charge was refused.
    Refusal,
    /// Bytes of lost allocations were refunded at termination (a `Refund` event
    /// records the refund itself).
    Lost,
    /// The recovery ladder's first rung: caches of the device were trimmed, giving
    /// back `bytes`.
    Trim,
    /// The recovery ladder's second rung: reclaim holders were asked and freed `bytes`.
    Reclaim,
}

impl TimelineEventKind {
    fn name(self) -> &'static str {
        match self {
            TimelineEventKind::Charge => "charge",
            TimelineEventKind::Refund => "refund",
            TimelineEventKind::Refusal => "refusal",
            TimelineEventKind::Lost => "lost",
            TimelineEventKind::Trim => "trim",
            TimelineEventKind::Reclaim => "reclaim",
        }
    }
}

/// One recorded event.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TimelineEvent {
    /// Microseconds since the governor was created.
    pub ts_us: f64,
    /// What happened.
    pub kind: TimelineEventKind,
    /// The device.
    #[serde(serialize_with = "crate::stats::display")]
    pub device: DeviceKey,
    /// The authority charged.
    #[serde(serialize_with = "crate::stats::display")]
    pub authority: AuthorityIdentity,
    /// The role.
    #[serde(serialize_with = "crate::stats::display")]
    pub role: MemoryRole,
    /// Bytes charged, refunded or refused.
    pub bytes: u64,
    /// A small per-thread number (the trace's `tid`).
    pub thread: u64,
    /// Bytes charged per role on the device after this event, as the timeline counts
    /// them (in [`MemoryRole::ALL`] order).
    pub device_charged: [u64; ROLES],
}

#[derive(Debug)]
struct Ring {
    capacity: usize,
    events: VecDeque<TimelineEvent>,
    dropped: u64,
    charged: BTreeMap<DeviceKey, [u64; ROLES]>,
}

/// The recorder shared by every device of one governor.
#[derive(Debug)]
pub(crate) struct Timeline {
    enabled: AtomicBool,
    epoch: Instant,
    ring: Mutex<Ring>,
}

/// A small number per thread for the trace's `tid` (not part of any protocol).
fn thread_number() -> u64 {
    use std::cell::Cell;
    use std::sync::atomic::Ordering as StdOrdering;
    static NEXT: crate::sync::IdCounter = crate::sync::IdCounter::new(1);
    std::thread_local! {
        static NUMBER: Cell<u64> = const { Cell::new(0) };
    }
    NUMBER
        .try_with(|number| {
            if number.get() == 0 {
                number.set(NEXT.fetch_add(1, StdOrdering::Relaxed));
            }
            number.get()
        })
        .unwrap_or(0)
}

impl Timeline {
    pub(crate) fn new() -> Timeline {
        Timeline {
            enabled: AtomicBool::new(false),
            epoch: Instant::now(),
            ring: Mutex::new(Ring { capacity: 0, events: VecDeque::new(), dropped: 0, charged: BTreeMap::new() }),
        }
    }

    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Starts recording, keeping the latest `capacity` events.
    pub(crate) fn enable(&self, capacity: usize) {
        let mut ring = lock(&self.ring);
        ring.capacity = capacity.max(1);
        while ring.events.len() > ring.capacity {
            ring.events.pop_front();
            ring.dropped += 1;
        }
        self.enabled.store(true, Ordering::Relaxed);
    }

    /// Stops recording; recorded events stay.
    pub(crate) fn disable(&self) {
        self.enabled.store(false, Ordering::Relaxed);
    }

    pub(crate) fn record(
        &self,
        kind: TimelineEventKind,
        device: DeviceKey,
        authority: AuthorityIdentity,
        role: MemoryRole,
        bytes: u64,
    ) {
        let ts_us = self.epoch.elapsed().as_secs_f64() * 1e6;
        let thread = thread_number();
        let mut ring = lock(&self.ring);
        let charged = ring.charged.entry(device).or_insert([0; ROLES]);
        let slot = &mut charged[role.ordinal()];
        match kind {
            TimelineEventKind::Charge => *slot = slot.saturating_add(bytes),
            TimelineEventKind::Refund => *slot = slot.saturating_sub(bytes),
            // A loss is recorded beside the refund that takes the bytes off the books.
            // The ladder's rungs free memory the charges do not count (caches') or that
            // later refunds take off the books (holders').
            TimelineEventKind::Refusal
            | TimelineEventKind::Lost
            | TimelineEventKind::Trim
            | TimelineEventKind::Reclaim => {}
        }
        let device_charged = *charged;
        if ring.events.len() == ring.capacity {
            ring.events.pop_front();
            ring.dropped += 1;
        }
        if ring.capacity > 0 {
            ring.events.push_back(TimelineEvent {
                ts_us,
                kind,
                device,
                authority,
                role,
                bytes,
                thread,
                device_charged,
            });
        }
    }

    /// The recorded events, oldest first, and how many older ones were dropped.
    pub(crate) fn events(&self) -> (Vec<TimelineEvent>, u64) {
        let ring = lock(&self.ring);
        (ring.events.iter().cloned().collect(), ring.dropped)
    }

    /// The recorded events as a Chrome trace (`{"traceEvents": [...]}`): per device a
    /// process (named by a metadata event), an instant event (`ph: "i"`) per charge,
    /// refund, refusal or loss, and a counter event (`ph: "C"`) per change of the bytes
    /// charged per role, so the viewer draws memory over time as stacked areas.
    pub(crate) fn chrome_trace(&self) -> Value {
        let (events, dropped) = self.events();
        let mut pids: BTreeMap<DeviceKey, u64> = BTreeMap::new();
        for event in &events {
            let next = pids.len() as u64 + 1;
            pids.entry(event.device).or_insert(next);
        }
        let mut trace = Vec::with_capacity(events.len() * 2 + pids.len());
        for (device, pid) in &pids {
            trace.push(json!({
                "name": "process_name", "ph": "M", "ts": 0, "pid": pid, "tid": 0,
                "args": { "name": format!("memory {device}") },
            }));
        }
        for event in &events {
            let pid = pids[&event.device];
            trace.push(json!({
                "name": format!("{} {}", event.kind.name(), event.role),
                "cat": "memory",
                "ph": "i",
                "s": "t",
                "ts": event.ts_us,
                "pid": pid,
                "tid": event.thread,
                "args": {
                    "bytes": event.bytes,
                    "role": event.role.name(),
                    "device": event.device.to_string(),
                    "authority": event.authority.to_string(),
                },
            }));
            if event.kind != TimelineEventKind::Refusal {
                let args: Map<String, Value> = MemoryRole::ALL
                    .iter()
                    .map(|role| (role.name().to_owned(), json!(event.device_charged[role.ordinal()])))
                    .collect();
                trace.push(json!({
                    "name": format!("{} charged bytes", event.device),
                    "ph": "C",
                    "ts": event.ts_us,
                    "pid": pid,
                    "tid": event.thread,
                    "args": args,
                }));
            }
        }
        json!({
            "traceEvents": trace,
            "displayTimeUnit": "ms",
            "otherData": { "producer": "memory-governor", "dropped_events": dropped },
        })
    }
}
