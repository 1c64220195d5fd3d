//! The `metrics` feature: the books reach a `metrics` recorder with the names and
//! labels the module documents, and the values the snapshot reports.
#![cfg(feature = "metrics")]

mod common;

use std::sync::Arc;

use common::*;
use memory_governor::*;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::{CompositeKey, MetricKind};

const GPU: DeviceKey = DeviceKey::device(0);

type Published = Vec<(CompositeKey, DebugValue)>;

fn publish(governor: &Governor) -> Published {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    ::metrics::with_local_recorder(&recorder, || governor.publish_metrics());
    snapshotter.snapshot().into_vec().into_iter().map(|(key, _, _, value)| (key, value)).collect()
}

/// The value of the metric `name` whose labels include every pair of `labels`.
fn value(published: &Published, kind: MetricKind, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    published.iter().find_map(|(key, value)| {
        let matches = key.kind() == kind
            && key.key().name() == name
            && labels.iter().all(|(k, v)| key.key().labels().any(|l| l.key() == *k && l.value() == *v));
        matches.then(|| match value {
            DebugValue::Gauge(g) => g.into_inner(),
            DebugValue::Counter(c) => *c as f64,
            DebugValue::Histogram(_) => f64::NAN,
        })
    })
}

#[test]
fn device_tenant_and_role_books_reach_the_recorder() {
    let (governor, account) = one_account(GPU, 10_000, 4_000, 0);
    let lease = account.lease(MemoryRole::KvCache, 3_000).unwrap();
    assert!(account.lease(MemoryRole::Activations, 2_000).is_err(), "over the quota");
    let device = GPU.to_string();
    let authority = account.authority().to_string();
    let published = publish(&governor);

    let device_labels = [("device", device.as_str())];
    assert_eq!(
        value(&published, MetricKind::Gauge, "memory_governor_device_limit_bytes", &device_labels),
        Some(10_000.0)
    );
    assert_eq!(
        value(&published, MetricKind::Gauge, "memory_governor_device_current_bytes", &device_labels),
        Some(3_000.0)
    );
    assert_eq!(
        value(&published, MetricKind::Gauge, "memory_governor_device_peak_bytes", &device_labels),
        Some(3_000.0)
    );

    let account_labels = [("device", device.as_str()), ("authority", authority.as_str())];
    assert_eq!(
        value(&published, MetricKind::Gauge, "memory_governor_account_quota_bytes", &account_labels),
        Some(4_000.0)
    );
    assert_eq!(
        value(&published, MetricKind::Gauge, "memory_governor_account_current_bytes", &account_labels),
        Some(3_000.0)
    );
    assert_eq!(
        value(&published, MetricKind::Counter, "memory_governor_account_refusals_total", &account_labels),
        Some(1.0)
    );

    let kv = [("device", device.as_str()), ("role", "kv-cache")];
    assert_eq!(value(&published, MetricKind::Gauge, "memory_governor_role_current_bytes", &kv), Some(3_000.0));
    assert_eq!(value(&published, MetricKind::Gauge, "memory_governor_role_live_allocations", &kv), Some(1.0));
    assert_eq!(value(&published, MetricKind::Counter, "memory_governor_role_allocations_total", &kv), Some(1.0));
    let activations = [("device", device.as_str()), ("role", "activations")];
    assert_eq!(value(&published, MetricKind::Counter, "memory_governor_role_refusals_total", &activations), Some(1.0));

    // A later publish follows the books: the refund shows, counters keep their totals.
    drop(lease);
    let published = publish(&governor);
    assert_eq!(value(&published, MetricKind::Gauge, "memory_governor_role_current_bytes", &kv), Some(0.0));
    assert_eq!(value(&published, MetricKind::Counter, "memory_governor_role_allocations_total", &kv), Some(1.0));
}

#[test]
fn an_unlimited_device_publishes_no_limit_gauge() {
    let governor = Governor::new();
    let registry = BindingRegistry::new();
    let authority = registry.register_authority(GPU, std::sync::Arc::new(())).unwrap();
    let account = governor.open_account(AccountConfig::new(GPU, authority)).unwrap();
    let _lease = account.lease(MemoryRole::Weights, 10).unwrap();
    let published = publish(&governor);
    let device = GPU.to_string();
    assert_eq!(
        value(&published, MetricKind::Gauge, "memory_governor_device_limit_bytes", &[("device", &device)]),
        None
    );
    assert_eq!(
        value(&published, MetricKind::Gauge, "memory_governor_device_current_bytes", &[("device", &device)]),
        Some(10.0)
    );
}

#[test]
fn the_overdraft_of_a_device_and_a_tenant_reaches_the_recorder_live_and_peak() {
    let (governor, account) = one_account(GPU, 10_000, 4_000, 0);
    governor.set_overdraft_limit(GPU, 5_000);
    let first = account.draw_overdraft(3_000).unwrap();
    let refused = account.draw_overdraft(2_001).unwrap_err();
    assert_eq!((refused.current, refused.limit), (3_000, 5_000), "{refused}");
    drop(first);
    let _held = account.draw_overdraft(1_000).unwrap();
    let device = GPU.to_string();
    let authority = account.authority().to_string();
    let published = publish(&governor);
    let device_labels = [("device", device.as_str())];
    let gauge = |name, labels: &[(&str, &str)]| value(&published, MetricKind::Gauge, name, labels);
    assert_eq!(gauge("memory_governor_device_overdraft_limit_bytes", &device_labels), Some(5_000.0));
    assert_eq!(gauge("memory_governor_device_overdraft_bytes", &device_labels), Some(1_000.0));
    assert_eq!(gauge("memory_governor_device_overdraft_peak_bytes", &device_labels), Some(3_000.0));
    assert_eq!(
        value(&published, MetricKind::Counter, "memory_governor_device_overdraft_refusals_total", &device_labels),
        Some(1.0)
    );
    let account_labels = [("device", device.as_str()), ("authority", authority.as_str())];
    assert_eq!(gauge("memory_governor_account_overdraft_bytes", &account_labels), Some(1_000.0));
    assert_eq!(gauge("memory_governor_account_overdraft_peak_bytes", &account_labels), Some(3_000.0));
    // The overdraft is not a charge: the books of charges did not move.
    let snapshot = governor.snapshot();
    let books = snapshot.device(GPU).unwrap();
    assert_eq!((books.current, books.overdraft.current, books.overdraft.draws), (0, 1_000, 2));
    assert!(snapshot.to_json().contains("\"overdraft\""));
}

#[test]
fn allocated_reserved_and_the_ladder_reach_the_recorder() {
    let (governor, account) = one_account(GPU, 1 << 20, 1 << 20, 4096);
    let backing: Arc<dyn DeviceAllocator> =
        Arc::new(governor.cache_backing(Arc::new(allocator_cpu::SystemAllocator::for_device(GPU))));
    let pool = Arc::new(allocator_cpu::PooledAllocator::new(backing));
    let governed = governor.govern(pool, account.authority()).unwrap();
    let request = AllocationRequest::new(64 << 10, 64).unwrap();
    let kept = governed.allocate(&request).unwrap();
    let idle = governed.allocate(&request).unwrap();
    assert!(governed.release(idle).is_complete());
    governor.return_idle_credit();
    let device = GPU.to_string();
    let authority = account.authority().to_string();
    let published = publish(&governor);
    let device_labels = [("device", device.as_str())];
    let gauge = |name, labels: &[(&str, &str)]| value(&published, MetricKind::Gauge, name, labels);
    let books = governor.snapshot().device(GPU).unwrap().clone();
    assert_eq!(books.allocated, 64 << 10);
    assert!(books.cached >= 64 << 10, "the released block is cached: {books:?}");
    assert_eq!(gauge("memory_governor_device_allocated_bytes", &device_labels), Some(books.allocated as f64));
    assert_eq!(gauge("memory_governor_device_cached_bytes", &device_labels), Some(books.cached as f64));
    assert_eq!(gauge("memory_governor_device_reserved_bytes", &device_labels), Some(books.reserved as f64));
    assert_eq!(gauge("memory_governor_device_held_by_caches_bytes", &device_labels), Some(books.held_by_caches as f64));
    let account_labels = [("device", device.as_str()), ("authority", authority.as_str())];
    assert_eq!(gauge("memory_governor_account_reserved_bytes", &account_labels), Some(books.reserved as f64));
    assert_eq!(
        value(&published, MetricKind::Counter, "memory_governor_device_cache_trims_total", &device_labels),
        Some(0.0)
    );
    assert!(governed.release(kept).is_complete());
}
