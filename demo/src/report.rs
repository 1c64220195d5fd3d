//! The closing report: what was served and refused, the books per device, tenant and
//! role, and the check that nothing was lost.

use std::fmt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use memory_governor::{GovernorSnapshot, MemoryRole, RegistrySnapshot};

use crate::config::Config;
use crate::sim::world::{Backend, World};
use crate::sim::{Events, MIB};

/// The nothing-lost check: every allocation the demo made is accounted released,
/// quarantined, lost with its device (and refunded at termination), or still live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    /// Allocations the demo made (weights, KV pages, activations, workspace).
    pub allocations: u64,
    /// Released completely through the allocator that made them.
    pub released: u64,
    /// Quarantined by the registry.
    pub quarantined: u64,
    /// Retired as lost when the lost device's context was confirmed terminated.
    pub lost: u64,
    /// Still recorded by the registry after shutdown.
    pub live: u64,
    /// Lost allocations the governor refunded at termination.
    pub refunded_lost: u64,
    /// Bytes the governor still counts as charged after shutdown, per device.
    pub charged_after: Vec<(String, u64)>,
    /// Replaced mechanisms removed once quiescent.
    pub removed_mechanisms: usize,
    /// Releases the registry refused as cross-binding or otherwise misdirected (a bug
    /// in the caller; zero when the demo is right).
    pub misreleased: u64,
}

impl Check {
    pub(crate) fn new(world: &World, events: &Events, removed_mechanisms: usize) -> Check {
        let ledger = &world.ledger;
        let registry = world.registry.snapshots();
        let governor = world.governor.snapshot();
        let lost = events.lost.as_ref().map_or(0, |l| l.termination.lost_allocations as u64);
        Check {
            allocations: ledger.allocations.load(Ordering::Relaxed),
            released: ledger.released.load(Ordering::Relaxed),
            quarantined: registry.mechanisms.iter().map(|m| m.quarantined.len() as u64).sum(),
            lost,
            live: registry.mechanisms.iter().map(|m| m.live_allocations as u64).sum(),
            refunded_lost: governor.devices.iter().map(|d| d.totals.lost_allocations).sum(),
            charged_after: governor.devices.iter().map(|d| (d.device.clone(), d.current)).collect(),
            removed_mechanisms,
            misreleased: ledger.misreleased.load(Ordering::Relaxed),
        }
    }

    /// Whether every allocation is accounted for and nothing stays charged.
    pub fn passed(&self) -> bool {
        self.allocations == self.released + self.quarantined + self.lost + self.live
            && self.refunded_lost == self.lost
            && self.live == 0
            && self.misreleased == 0
            && self.charged_after.iter().all(|(_, bytes)| *bytes == 0)
    }
}

/// Everything the demo prints and writes.
pub struct Report {
    /// The nothing-lost check.
    pub check: Check,
    /// Requests served.
    pub served: u64,
    /// Requests refused, by reason.
    pub refused: Vec<(&'static str, u64)>,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// The governor's books after shutdown.
    pub governor: GovernorSnapshot,
    /// The registry after shutdown.
    pub registry: RegistrySnapshot,
    /// The governor timeline in the Chrome trace event format.
    pub trace_json: String,
    lines: Vec<String>,
}

impl Report {
    pub(crate) fn new(world: &World, config: &Config, events: &Events, check: Check, elapsed: Duration) -> Report {
        let ledger = &world.ledger;
        let served = ledger.served.load(Ordering::Relaxed);
        let refused: Vec<_> = ledger.refusals().into_iter().map(|(why, n)| (why.name(), n)).collect();
        let governor = world.governor.snapshot();
        let registry = world.registry.snapshots();
        let mut lines = Vec::new();
        let backend = if world.gpu { "CUDA devices" } else { "host-backed simulated devices" };
        lines.push(format!(
            "memory-demo: {} requests on {} {backend}, {} worker threads, seed {}",
            served + refused.iter().map(|(_, n)| n).sum::<u64>(),
            world.devices.len(),
            config.threads,
            config.seed
        ));
        if let Some((after, at)) = events.switched_at {
            lines.push(format!(
                "  switch   after {after} requests ({:.2}s): {} -> {} (old mechanisms retired, their allocations released through them)",
                at.as_secs_f64(),
                Backend::Plain.name(world.gpu),
                Backend::Pooled.name(world.gpu),
            ));
        }
        if let Some(loss) = &events.lost {
            lines.push(format!(
                "  loss     {} invalidated after {} requests: termination confirmed after {} poll(s), \
                 {} allocation(s) / {:.1} MiB retired as lost, new context took over",
                loss.device,
                loss.after_requests,
                loss.polls,
                loss.termination.lost_allocations,
                loss.termination.lost_bytes as f64 / MIB as f64
            ));
        }
        let seconds = elapsed.as_secs_f64().max(1e-9);
        lines.push(String::new());
        lines.push(format!("requests  served {served:>7}   ({:.0}/s)", served as f64 / seconds));
        for (why, n) in &refused {
            lines.push(format!("          refused {n:>6}   {why}"));
        }
        lines.push(format!(
            "allocations {:>9}   ({:.0}/s), reclaim evicted {} idle sequence(s) / {:.1} MiB",
            check.allocations,
            check.allocations as f64 / seconds,
            world.devices.iter().map(|d| d.kv.evicted_sequences.load(Ordering::Relaxed)).sum::<u64>(),
            world.devices.iter().map(|d| d.kv.evicted_bytes.load(Ordering::Relaxed)).sum::<u64>() as f64 / MIB as f64,
        ));
        lines.push(String::new());
        lines.push(format!(
            "{:<10} {:>10} {:>10} {:>10} {:>12} {:>10} {:>9}",
            "device", "limit MiB", "peak MiB", "final MiB", "quarant. MiB", "lost MiB", "refusals"
        ));
        for device in &governor.devices {
            let name =
                world.devices.iter().find(|d| d.key.to_string() == device.device).map_or("?", |d| d.name.as_str());
            lines.push(format!(
                "{:<10} {:>10} {:>10.1} {:>10.1} {:>12.1} {:>10.1} {:>9}",
                format!("{name} ({})", device.index),
                device.limit.map_or("-".to_owned(), |l| (l / MIB).to_string()),
                mib(device.peak),
                mib(device.current),
                mib(device.totals.quarantined_bytes),
                mib(device.totals.lost_bytes),
                device.totals.failures,
            ));
        }
        lines.push(String::new());
        lines.push(format!(
            "{:<22} {:>10} {:>10} {:>10} {:>9}",
            "tenant @ device", "quota MiB", "peak MiB", "final MiB", "refusals"
        ));
        for device in &governor.devices {
            for account in &device.authorities {
                lines.push(format!(
                    "{:<22} {:>10} {:>10.1} {:>10.1} {:>9}",
                    format!("{} @ {}", account.label, device.device),
                    account.quota.map_or("-".to_owned(), |q| (q / MIB).to_string()),
                    mib(account.peak),
                    mib(account.current),
                    account.totals.failures,
                ));
            }
        }
        lines.push(String::new());
        lines.push(format!(
            "{:<12} {:>12} {:>10} {:>10} {:>10} {:>9}",
            "role", "allocations", "peak MiB", "final MiB", "lost MiB", "refusals"
        ));
        for role in MemoryRole::ALL {
            let (mut allocations, mut peak, mut current, mut lost, mut failures) = (0, 0, 0, 0, 0);
            for device in &governor.devices {
                let r = device.role(role);
                allocations += r.allocations;
                peak += r.peak;
                current += r.current;
                lost += r.lost_bytes;
                failures += r.failures;
            }
            if allocations + failures > 0 {
                lines.push(format!(
                    "{:<12} {:>12} {:>10.1} {:>10.1} {:>10.1} {:>9}",
                    role.name(),
                    allocations,
                    mib(peak),
                    mib(current),
                    mib(lost),
                    failures
                ));
            }
        }
        lines.push(String::new());
        lines.push(format!(
            "mechanisms: {} registered now, {} replaced ones removed once quiescent",
            registry.mechanisms.len(),
            check.removed_mechanisms
        ));
        lines.push(format!(
            "check: {} allocations = {} released + {} quarantined + {} lost + {} live; {} lost refunded at termination; \
             charged after shutdown: {} -> {}",
            check.allocations,
            check.released,
            check.quarantined,
            check.lost,
            check.live,
            check.refunded_lost,
            check.charged_after.iter().map(|(d, b)| format!("{d} {b} B")).collect::<Vec<_>>().join(", "),
            if check.passed() { "nothing lost" } else { "FAILED" },
        ));
        Report {
            check,
            served,
            refused,
            elapsed,
            trace_json: world.governor.chrome_trace_json(),
            governor,
            registry,
            lines,
        }
    }

    /// The final snapshot as JSON: the governor's books plus the registry's mechanisms
    /// and the check.
    pub fn snapshot_json(&self) -> String {
        let mechanisms: Vec<_> = self
            .registry
            .mechanisms
            .iter()
            .map(|m| {
                serde_json::json!({
                    "mechanism": m.identity.to_string(),
                    "device": m.device.to_string(),
                    "allocator": m.allocator,
                    "state": m.state.name(),
                    "live_allocations": m.live_allocations,
                    "live_bytes": m.live_bytes,
                    "quarantined": m.quarantined.len(),
                })
            })
            .collect();
        let value = serde_json::json!({
            "governor": serde_json::to_value(&self.governor).unwrap_or_default(),
            "registry": { "mechanisms": mechanisms },
            "requests": {
                "served": self.served,
                "refused": self.refused.iter().map(|(why, n)| serde_json::json!({"reason": why, "count": n})).collect::<Vec<_>>(),
            },
            "check": {
                "allocations": self.check.allocations,
                "released": self.check.released,
                "quarantined": self.check.quarantined,
                "lost": self.check.lost,
                "live": self.check.live,
                "refunded_lost": self.check.refunded_lost,
                "passed": self.check.passed(),
            },
        });
        serde_json::to_string_pretty(&value).unwrap_or_default()
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for line in &self.lines {
            writeln!(f, "{line}")?;
        }
        Ok(())
    }
}
