//! Publishing the books through the [`metrics`] facade (feature `metrics`), so whatever
//! exporter the serving stack installs (Prometheus, OpenTelemetry, StatsD) picks them up.
//!
//! Publishing is pull-based: [`Governor::publish_metrics`] takes one snapshot and sets
//! every gauge and counter from it, so the hot path pays nothing and the figures are
//! the same ones [`Governor::snapshot`] reports. Call it from the exporter's scrape
//! hook or a timer (once a second is plenty).
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `memory_governor_device_limit_bytes` | gauge (absent when unlimited) | `device` |
//! | `memory_governor_device_current_bytes` | gauge | `device` |
//! | `memory_governor_device_used_bytes` | gauge | `device` |
//! | `memory_governor_device_peak_bytes` | gauge | `device` |
//! | `memory_governor_device_cached_credit_bytes` | gauge | `device` |
//! | `memory_governor_account_quota_bytes` | gauge (absent when unlimited) | `device`, `authority`, `label` |
//! | `memory_governor_account_current_bytes` | gauge | `device`, `authority`, `label` |
//! | `memory_governor_account_peak_bytes` | gauge | `device`, `authority`, `label` |
//! | `memory_governor_role_current_bytes` | gauge | `device`, `role` |
//! | `memory_governor_role_peak_bytes` | gauge | `device`, `role` |
//! | `memory_governor_role_quarantined_bytes` | gauge | `device`, `role` |
//! | `memory_governor_role_live_allocations` | gauge | `device`, `role` |
//! | `memory_governor_role_refusals_total` | counter | `device`, `role` |
//! | `memory_governor_role_lost_bytes_total` | counter | `device`, `role` |
//! | `memory_governor_role_allocations_total` | counter | `device`, `role` |
//! | `memory_governor_account_refusals_total` | counter | `device`, `authority`, `label` |
//! | `memory_governor_device_overdraft_limit_bytes` | gauge | `device` |
//! | `memory_governor_device_overdraft_bytes` | gauge | `device` |
//! | `memory_governor_device_overdraft_peak_bytes` | gauge | `device` |
//! | `memory_governor_device_overdraft_refusals_total` | counter | `device` |
//! | `memory_governor_account_overdraft_bytes` | gauge | `device`, `authority`, `label` |
//! | `memory_governor_account_overdraft_peak_bytes` | gauge | `device`, `authority`, `label` |
//! | `memory_governor_device_allocated_bytes` | gauge | `device` |
//! | `memory_governor_device_reserved_bytes` | gauge | `device` |
//! | `memory_governor_device_reserved_peak_bytes` | gauge | `device` |
//! | `memory_governor_device_cached_bytes` | gauge | `device` |
//! | `memory_governor_device_held_by_caches_bytes` | gauge | `device` |
//! | `memory_governor_device_largest_free_bytes` | gauge | `device` |
//! | `memory_governor_device_cache_trims_total` | counter | `device` |
//! | `memory_governor_device_cache_trimmed_bytes_total` | counter | `device` |
//! | `memory_governor_device_refused_over_reserved_total` | counter | `device` |
//! | `memory_governor_account_reserved_bytes` | gauge | `device`, `authority`, `label` |
//! | `memory_governor_account_cached_bytes` | gauge | `device`, `authority`, `label` |
//!
//! Counters are set to the governor's cumulative counts (`absolute`), so a restarted
//! exporter or a missed scrape loses nothing.

use metrics::{Label, counter, gauge};

use crate::Governor;
use crate::stats::{AccountSnapshot, DeviceSnapshot, GovernorSnapshot, RoleSnapshot};

impl Governor {
    /// Takes a snapshot and publishes it through the `metrics` facade (see the
    /// [module documentation](crate::metrics) for the names and labels).
    pub fn publish_metrics(&self) {
        publish(&self.snapshot());
    }
}

/// Publishes `snapshot` through the `metrics` facade to the recorder installed now.
pub fn publish(snapshot: &GovernorSnapshot) {
    for device in &snapshot.devices {
        publish_device(device);
    }
}

fn publish_device(device: &DeviceSnapshot) {
    let labels = vec![Label::new("device", device.device.clone())];
    if let Some(limit) = device.limit {
        gauge!("memory_governor_device_limit_bytes", labels.clone()).set(limit as f64);
    }
    gauge!("memory_governor_device_current_bytes", labels.clone()).set(device.current as f64);
    gauge!("memory_governor_device_used_bytes", labels.clone()).set(device.used as f64);
    gauge!("memory_governor_device_peak_bytes", labels.clone()).set(device.peak as f64);
    gauge!("memory_governor_device_cached_credit_bytes", labels.clone()).set(device.cached_credit as f64);
    if let Some(limit) = device.overdraft.limit {
        gauge!("memory_governor_device_overdraft_limit_bytes", labels.clone()).set(limit as f64);
    }
    gauge!("memory_governor_device_overdraft_bytes", labels.clone()).set(device.overdraft.current as f64);
    gauge!("memory_governor_device_overdraft_peak_bytes", labels.clone()).set(device.overdraft.peak as f64);
    counter!("memory_governor_device_overdraft_refusals_total", labels.clone()).absolute(device.overdraft.refused);
    gauge!("memory_governor_device_allocated_bytes", labels.clone()).set(device.allocated as f64);
    gauge!("memory_governor_device_reserved_bytes", labels.clone()).set(device.reserved as f64);
    gauge!("memory_governor_device_reserved_peak_bytes", labels.clone()).set(device.reserved_peak as f64);
    gauge!("memory_governor_device_cached_bytes", labels.clone()).set(device.cached as f64);
    gauge!("memory_governor_device_held_by_caches_bytes", labels.clone()).set(device.held_by_caches as f64);
    gauge!("memory_governor_device_largest_free_bytes", labels.clone()).set(device.largest_free as f64);
    counter!("memory_governor_device_cache_trims_total", labels.clone()).absolute(device.ladder.trims);
    counter!("memory_governor_device_cache_trimmed_bytes_total", labels.clone()).absolute(device.ladder.trimmed_bytes);
    counter!("memory_governor_device_refused_over_reserved_total", labels)
        .absolute(device.ladder.refused_over_reserved);
    for role in &device.roles {
        publish_role(&device.device, role);
    }
    for account in &device.authorities {
        publish_account(&device.device, account);
    }
}

fn publish_role(device: &str, role: &RoleSnapshot) {
    let labels = vec![Label::new("device", device.to_owned()), Label::new("role", role.role.clone())];
    gauge!("memory_governor_role_current_bytes", labels.clone()).set(role.current as f64);
    gauge!("memory_governor_role_peak_bytes", labels.clone()).set(role.peak as f64);
    gauge!("memory_governor_role_quarantined_bytes", labels.clone()).set(role.quarantined_bytes as f64);
    gauge!("memory_governor_role_live_allocations", labels.clone()).set(role.live as f64);
    counter!("memory_governor_role_refusals_total", labels.clone()).absolute(role.failures);
    counter!("memory_governor_role_lost_bytes_total", labels.clone()).absolute(role.lost_bytes);
    counter!("memory_governor_role_allocations_total", labels).absolute(role.allocations);
}

fn publish_account(device: &str, account: &AccountSnapshot) {
    let labels = vec![
        Label::new("device", device.to_owned()),
        Label::new("authority", account.authority.clone()),
        Label::new("label", account.label.clone()),
    ];
    if let Some(quota) = account.quota {
        gauge!("memory_governor_account_quota_bytes", labels.clone()).set(quota as f64);
    }
    gauge!("memory_governor_account_current_bytes", labels.clone()).set(account.current as f64);
    gauge!("memory_governor_account_peak_bytes", labels.clone()).set(account.peak as f64);
    gauge!("memory_governor_account_overdraft_bytes", labels.clone()).set(account.overdraft.current as f64);
    gauge!("memory_governor_account_overdraft_peak_bytes", labels.clone()).set(account.overdraft.peak as f64);
    gauge!("memory_governor_account_reserved_bytes", labels.clone()).set(account.reserved as f64);
    gauge!("memory_governor_account_cached_bytes", labels.clone()).set(account.cached as f64);
    counter!("memory_governor_account_refusals_total", labels).absolute(account.totals.failures);
}
