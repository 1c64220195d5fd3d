//! tracing events on refusals, reclaim and limit changes.
//!
//! Alone in its own test binary: tracing caches each callsite's interest globally, and
//! a callsite first hit on another test thread while this test installs its scoped
//! subscriber can be cached as uninteresting (a race inside tracing-core), which would
//! make the check flaky.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use memory_governor::*;

const GPU: DeviceKey = DeviceKey::device(2);

/// A minimal subscriber that records each event's level, message and fields.
#[derive(Clone, Default)]
struct Capture {
    events: Arc<Mutex<Vec<(tracing::Level, String)>>>,
}

struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={:?} ", field.name(), value));
    }
}

impl tracing::Subscriber for Capture {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        self.events.lock().unwrap().push((*event.metadata().level(), fields.0));
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

fn find(events: &[(tracing::Level, String)], message: &str) -> Option<(tracing::Level, String)> {
    events.iter().find(|(_, fields)| fields.contains(&format!("message={message} "))).cloned()
}

#[test]
fn refusals_reclaim_and_limit_changes_emit_tracing_events() {
    let capture = Capture::default();
    let events = Arc::clone(&capture.events);
    tracing::subscriber::with_default(capture, || {
        let (governor, account) = one_account(GPU, 100, u64::MAX, 0);
        governor.set_quota(account.authority(), 90).unwrap();
        governor.set_policy(GPU, Arc::new(ReclaimThenFail)).unwrap();
        let asked = Arc::new(Mutex::new(Vec::new()));
        let held = vec![account.lease_owned(MemoryRole::KvCache, 50).unwrap()];
        governor.register_holder(GPU, 0, LeaseHolder::new("kv", held, u64::MAX, asked));
        let _big = account.lease(MemoryRole::Weights, 80).unwrap();
        assert!(account.lease(MemoryRole::Weights, 80).is_err());
    });
    let events = events.lock().unwrap();
    let (level, fields) = find(&events, "device limit changed").expect("limit change event");
    assert_eq!(level, tracing::Level::INFO);
    assert!(fields.contains("new=Some(100)"), "{fields}");
    let (level, _) = find(&events, "authority quota changed").expect("quota change event");
    assert_eq!(level, tracing::Level::INFO);
    assert!(find(&events, "admission policy installed").is_some());
    let (level, fields) = find(&events, "reclaim holder asked").expect("reclaim event");
    assert_eq!(level, tracing::Level::DEBUG);
    assert!(fields.contains("holder=\"kv\"") && fields.contains("freed=50"), "{fields}");
    assert!(find(&events, "reclaim finished").is_some());
    let (level, fields) = find(&events, "admission refused").expect("refusal event");
    assert_eq!(level, tracing::Level::WARN);
    for needle in ["device=device:2", "role=weights", "requested=80", "used=80", "limit=90", "available=10"] {
        assert!(fields.contains(needle), "missing {needle} in {fields}");
    }
}
