//! The closing report: what was served and refused, the books per device, tenant and
//! role, and the check that nothing was lost.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use memory_governor::{DeviceSnapshot, GovernorSnapshot, MemoryRole, RegistrySnapshot};

use crate::config::Config;
use crate::sim::world::{Backend, World};
use crate::sim::{Events, MIB, Observed};

/// The simulated server's target for what pools keep idle: the reserved peak of every
/// device at most this many times its allocated peak.
pub const RESERVED_PEAK_TARGET: f64 = 1.1;

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
    /// The governor's books when the last request finished (before shutdown released
    /// the weights and idle sequences): allocated, cached and reserved in use.
    pub at_end: GovernorSnapshot,
    /// Each account's highest `reserved` (allocated + idle in its pools), sampled by the
    /// control loop, by authority.
    pub tenant_reserved_peaks: BTreeMap<String, u64>,
    /// The governor's refusals of single allocations by the limit that refused
    /// (`LimitScope` names): count and first message.
    pub budget_refusals: Vec<(&'static str, u64, String)>,
    /// Where the footprint's books do not balance (empty when they do).
    pub footprint_violations: Vec<String>,
    /// What `--record` wrote (`None` without it).
    pub recording: Option<memory_trace::RecordingSummary>,
    lines: Vec<String>,
}

/// The line printed after `--record`: how to replay the trace and draw its page.
pub fn recorded_line(path: &std::path::Path) -> String {
    format!("replay it: cargo xtask replay {} --compare system,pooled,virtual --html report.html\n", path.display())
}

/// A device's reserved peak over its allocated peak (1 when nothing was allocated).
pub fn reserved_ratio(device: &DeviceSnapshot) -> f64 {
    if device.peak == 0 { 1.0 } else { device.reserved_peak as f64 / device.peak as f64 }
}

/// Where one snapshot's footprint does not add up: per device, `reserved = allocated +
/// cached`, `allocated` the sum over its accounts, `cached` the sum over its caches, the
/// reserved peak at least what is reserved now, what the cache backings hold at least
/// what the pools over them report; per account, `reserved = allocated + cached` and
/// `cached` the sum over the caches booked to it.
pub fn footprint_violations(snapshot: &GovernorSnapshot) -> Vec<String> {
    let mut violations = Vec::new();
    let mut expect = |what: String, ok: bool| {
        if !ok {
            violations.push(what);
        }
    };
    for device in &snapshot.devices {
        let name = &device.device;
        expect(
            format!(
                "{name}: reserved {} != allocated {} + cached {}",
                device.reserved, device.allocated, device.cached
            ),
            device.reserved == device.allocated + device.cached,
        );
        let tenants: u64 = device.authorities.iter().map(|a| a.allocated).sum();
        expect(
            format!("{name}: allocated {} != {tenants} over its accounts", device.allocated),
            device.allocated == tenants,
        );
        let cached: u64 = device.caches.iter().map(|c| c.cached).sum();
        expect(format!("{name}: cached {} != {cached} over its caches", device.cached), device.cached == cached);
        expect(
            format!("{name}: reserved peak {} < reserved {}", device.reserved_peak, device.reserved),
            device.reserved_peak >= device.reserved,
        );
        let backed: u64 = device.caches.iter().filter(|c| c.name.contains("cache-backing(")).map(|c| c.reserved).sum();
        expect(
            format!("{name}: the cache backings hold {} < {backed} the pools over them report", device.held_by_caches),
            device.held_by_caches >= backed,
        );
        for account in &device.authorities {
            let label = format!("{} @ {name}", account.label);
            expect(
                format!(
                    "{label}: reserved {} != allocated {} + cached {}",
                    account.reserved, account.allocated, account.cached
                ),
                account.reserved == account.allocated + account.cached,
            );
            let own: u64 = device.caches.iter().filter(|c| c.authority == account.authority).map(|c| c.cached).sum();
            expect(format!("{label}: cached {} != {own} over its caches", account.cached), account.cached == own);
        }
    }
    violations
}

impl Report {
    pub(crate) fn new(
        world: &World,
        config: &Config,
        events: &Events,
        observed: &Observed,
        check: Check,
        elapsed: Duration,
    ) -> Report {
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
        let name_of = |device: &DeviceSnapshot| {
            world.devices.iter().find(|d| d.key.to_string() == device.device).map_or("?", |d| d.name.as_str())
        };
        let at_end = &observed.at_end;
        lines.push(String::new());
        lines.push(format!(
            "footprint: allocated = charged to tenants, reserved = allocated + idle in pools ({})",
            if world.gpu {
                "CUDA pools report what they cache; the device limit bounds what tenants are charged"
            } else {
                "pools take their memory through Governor::cache_backing, so the device limit bounds reserved"
            }
        ));
        lines.push(format!(
            "{:<10} {:>11} {:>11} {:>9} {:>12} {:>6} {:>9} {:>18}",
            "device",
            "alloc. peak",
            "resv. peak",
            "resv/alloc",
            "caches peak",
            "trims",
            "trim. MiB",
            "refused over resv."
        ));
        let budget_refusals: Vec<_> = ledger
            .budget_refusals()
            .into_iter()
            .map(|(scope, (count, message))| (scope.name(), count, message))
            .collect();
        let mut verdicts = Vec::new();
        for device in &governor.devices {
            let ratio = reserved_ratio(device);
            lines.push(format!(
                "{:<10} {:>11.1} {:>11.1} {:>8.3}x {:>12.1} {:>6} {:>9.1} {:>18}",
                format!("{} ({})", name_of(device), device.index),
                mib(device.peak),
                mib(device.reserved_peak),
                ratio,
                mib(device.held_by_caches_peak),
                device.ladder.trims,
                mib(device.ladder.trimmed_bytes),
                device.ladder.refused_over_reserved,
            ));
            verdicts.push(format!(
                "{} {ratio:.3}x [target <= {RESERVED_PEAK_TARGET:.2}x: {}]",
                name_of(device),
                if ratio <= RESERVED_PEAK_TARGET { "met" } else { "missed" }
            ));
        }
        lines.push(format!("  reserved peak / allocated peak per device: {}", verdicts.join(", ")));
        lines.push(format!(
            "{:<10} {:>11} {:>11} {:>11} {:>12} {:>12} {:>9}   (when the last request finished)",
            "device", "alloc. MiB", "cached MiB", "resv. MiB", "caches MiB", "largest free", "fragm."
        ));
        for device in &at_end.devices {
            lines.push(format!(
                "{:<10} {:>11.1} {:>11.1} {:>11.1} {:>12.1} {:>12.1} {:>8.1}%",
                format!("{} ({})", name_of(device), device.index),
                mib(device.allocated),
                mib(device.cached),
                mib(device.reserved),
                mib(device.held_by_caches),
                mib(device.largest_free),
                device.fragmentation() * 100.0,
            ));
        }
        lines.push(String::new());
        lines.push(format!(
            "{:<22} {:>9} {:>11} {:>11} {:>11} {:>11} {:>10} {:>9}",
            "tenant @ device",
            "quota MiB",
            "alloc. peak",
            "resv. peak",
            "alloc. end",
            "cached end",
            "resv. end",
            "refusals"
        ));
        for device in &governor.devices {
            let end = at_end.devices.iter().find(|d| d.device == device.device);
            for account in &device.authorities {
                let now = end.and_then(|d| d.authorities.iter().find(|a| a.authority == account.authority));
                lines.push(format!(
                    "{:<22} {:>9} {:>11.1} {:>11.1} {:>11.1} {:>11.1} {:>10.1} {:>9}",
                    format!("{} @ {}", account.label, device.device),
                    account.quota.map_or("-".to_owned(), |q| (q / MIB).to_string()),
                    mib(account.peak),
                    mib(observed.tenant_reserved_peaks.get(&account.authority).copied().unwrap_or(0)),
                    mib(now.map_or(0, |a| a.allocated)),
                    mib(now.map_or(0, |a| a.cached)),
                    mib(now.map_or(0, |a| a.reserved)),
                    account.totals.failures,
                ));
            }
        }
        lines.push(format!(
            "  (resv. peak: sampled {} times by the control loop, a lower bound that can miss a short peak the \
             governor's alloc. peak caught; end: when the last request finished)",
            observed.samples
        ));
        if !budget_refusals.is_empty() {
            lines.push(String::new());
            lines.push(format!(
                "governor refusals by limit: {}",
                budget_refusals.iter().map(|(scope, n, _)| format!("{scope} {n}")).collect::<Vec<_>>().join(", ")
            ));
            // The first refusal of the most telling limit: the ladder's own when there is one.
            let (scope, _, message) = &budget_refusals[0];
            lines.push(format!("example refusal ({scope}):"));
            for clause in message.split("; ") {
                lines.push(format!("    {clause}"));
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
        let footprint_violations = footprint_violations(at_end);
        lines.push(if footprint_violations.is_empty() {
            "footprint: books balance (per device and tenant reserved = allocated + cached; allocated and cached \
             the sums over tenants and caches; cache backings hold what their pools report)"
                .to_owned()
        } else {
            format!("footprint: BOOKS DO NOT BALANCE: {}", footprint_violations.join("; "))
        });
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
            at_end: observed.at_end.clone(),
            tenant_reserved_peaks: observed.tenant_reserved_peaks.clone(),
            budget_refusals,
            footprint_violations,
            recording: None,
            lines,
        }
    }

    /// Whether nothing was lost and the footprint's books balance.
    pub fn passed(&self) -> bool {
        self.check.passed() && self.footprint_violations.is_empty()
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
            "at_end": serde_json::to_value(&self.at_end).unwrap_or_default(),
            "tenant_reserved_peaks": self.tenant_reserved_peaks,
            "budget_refusals": self.budget_refusals.iter()
                .map(|(scope, n, message)| serde_json::json!({"scope": scope, "count": n, "first": message}))
                .collect::<Vec<_>>(),
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
                "footprint_violations": self.footprint_violations,
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
