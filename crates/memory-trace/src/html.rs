//! The page: one self-contained HTML file (inline SVG, style and script; nothing is
//! fetched) that draws a trace's replays.
//!
//! - **Active memory over time**, per device: the first configuration's allocated bytes
//!   stacked by tenant and role, its reserved bytes (allocated + idle in caches) as a line
//!   over them, the device limit, and, for `--compare`, every other configuration's
//!   allocated and reserved as lines over the same axes.
//! - **Markers**: each configuration's refusals (the first one labelled), the refusals the
//!   recording itself saw, device losses and notes.
//! - **Tables**: the configurations side by side (peaks, fragmentation at the peak,
//!   refusals and the first refused event, latencies) and the largest allocations live at
//!   the first configuration's peak, with their identities (id, address, tenant, role,
//!   thread, caller tag).
//!
//! The script reports how it went in the page itself: `<p id="status">` reads
//! `ok: drew N series, M configurations, K refusals` (and `data-status="ok"`), or
//! `error: ...` if anything threw, so a headless browser's dumped DOM says whether the
//! page works (`tests/html.rs` runs Chromium on it).

use serde_json::{Value, json};

use crate::event::{MarkKind, What};
use crate::read::Trace;
use crate::replay::{DeviceReport, ReplayReport};

const TEMPLATE: &str = include_str!("report.html");

/// The page for `trace` and its replays (at least one).
pub fn report(title: &str, trace: &Trace, reports: &[ReplayReport]) -> String {
    let data = data(title, trace, reports).to_string();
    // The data sits in a <script> element: no `</script` may close it early, and no
    // `<!--` followed by `<script` may put the parser in the script's double-escaped
    // state, where the element's own `</script>` no longer closes it and the page's
    // script never runs. In JSON a `<` is only ever inside a string, where `\u003c`
    // is the same character, so none is left.
    let data = data.replace('<', "\\u003c");
    let (head, rest) = TEMPLATE.split_once("/*TITLE*/").unwrap_or((TEMPLATE, ""));
    let (middle, tail) = rest.split_once("/*DATA*/").unwrap_or((rest, ""));
    [head, &escape(title), middle, &data, tail].concat()
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn device_data(trace: &Trace, device: &DeviceReport) -> Value {
    let series: Vec<Value> = device
        .series
        .iter()
        .map(|(tenant, role)| json!({ "tenant": trace.tenant_label(*tenant), "role": role.name() }))
        .collect();
    let columns: Vec<Vec<u64>> = (0..device.series.len())
        .map(|column| device.timeline.iter().map(|sample| sample.allocated[column]).collect())
        .collect();
    json!({
        "device": device.device.to_string(),
        "limit": device.limit,
        "peak_allocated": device.peak_allocated,
        "peak_reserved": device.peak_reserved,
        "governor_peak": device.governor_peak,
        "governor_reserved_peak": device.governor_reserved_peak,
        "fragmentation_at_peak": device.fragmentation_at_peak,
        "peak_event": device.peak_event,
        "refusals": device.refusals.iter().map(|refusal| json!({
            "event": refusal.event,
            "ts": refusal.ts_ns,
            "tenant": trace.tenant_label(refusal.tenant),
            "role": refusal.role.name(),
            "bytes": refusal.requested,
            "recorded": refusal.refused_when_recorded,
            "message": refusal.message,
        })).collect::<Vec<_>>(),
        "failures": device.failures,
        "recorded_refusals_admitted": device.recorded_refusals_admitted,
        "skipped_releases": device.skipped_releases,
        "allocate": [device.allocate.p50_ns, device.allocate.p99_ns],
        "release": [device.release.p50_ns, device.release.p99_ns],
        "series": series,
        "ts": device.timeline.iter().map(|sample| sample.ts_ns).collect::<Vec<_>>(),
        "reserved": device.timeline.iter().map(|sample| sample.reserved).collect::<Vec<_>>(),
        "allocated": columns,
        "largest": device.largest_at_peak.iter().map(|block| json!({
            "event": block.event,
            "ts": block.ts_ns,
            "id": format!("{:#x}", block.id),
            "address": format!("{:#x}", block.address),
            "tenant": trace.tenant_label(block.tenant),
            "role": block.role.name(),
            "bytes": block.bytes,
            "thread": trace.thread_name(block.thread).map_or_else(|| block.thread.to_string(), str::to_owned),
            "caller": block.caller,
        })).collect::<Vec<_>>(),
    })
}

fn data(title: &str, trace: &Trace, reports: &[ReplayReport]) -> Value {
    let marks: Vec<Value> = trace
        .events
        .iter()
        .filter_map(|event| match &event.what {
            What::Mark { kind, label, .. } => Some(json!({
                "ts": event.ts_ns,
                "device": event.device.to_string(),
                "kind": match kind {
                    MarkKind::DeviceLost => "device-lost",
                    MarkKind::Terminated => "terminated",
                    _ => "note",
                },
                "label": label,
            })),
            What::Refusal(refusal) => Some(json!({
                "ts": event.ts_ns,
                "device": event.device.to_string(),
                "kind": "recorded-refusal",
                "label": format!("recorded refusal: {} {} {}", trace.tenant_label(event.tenant),
                    event.role.map_or("", |role| role.name()), crate::replay::bytes(refusal.requested)),
            })),
            _ => None,
        })
        .collect();
    json!({
        "title": title,
        "events": trace.events.len(),
        "duration": trace.events.last().map_or(0, |event| event.ts_ns),
        "tenants": trace.tenants.iter().map(|tenant| tenant.label.clone()).collect::<Vec<_>>(),
        "threads": trace.threads.len(),
        "damage": trace.damage.as_ref().map(ToString::to_string),
        "marks": marks,
        "configs": reports.iter().map(|report| json!({
            "label": report.config.label(),
            "devices": report.devices.iter().map(|device| device_data(trace, device)).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}
