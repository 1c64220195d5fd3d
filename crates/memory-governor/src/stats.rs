//! Snapshots of the books, serialisable to JSON with serde.
//!
//! Byte fields, for a device, an authority and a role:
//! - `current`: bytes charged right now (leases and governed allocations, quarantined
//!   residuals included, lost allocations included until termination is confirmed).
//!   Exact when no thread is admitting or refunding during the snapshot.
//! - `used`: bytes drawn from the budget: `current`, plus credit threads cache
//!   (`cached_credit`), plus for a device the reserves held aside. This is what the
//!   limit bounds.
//! - `peak`: the high-water mark of `current`, the bytes really charged (cached credit
//!   and reserves are not charges). Exact when a single thread charges the account,
//!   role or device, and always with `credit_chunk(0)`; otherwise charges another
//!   thread has not yet published (at most 64 KiB, or the credit chunk if smaller,
//!   per thread) can make it off, either way, but never above `peak_used` (see
//!   `src/peaks.rs`). A device's per-role peak is the sum of its authorities' (an
//!   upper bound).
//! - `peak_used`: the high-water mark of `used` (what the limit bounded).
//!
//! Counts: `allocations` charges opened (leases, governed allocations), `releases`
//! charges closed, `live` the difference, `failures` refused admissions. Memory the
//! governor still charges for quarantined releases is `quarantined_bytes`; bytes lost
//! with their device and refunded at termination are `lost_bytes` (cumulative).

use std::fmt;

use memory_api::MemoryRole;
use serde::Serialize;

use crate::overdraft::OverdraftSnapshot;

/// Serialises any `Display` value as its string.
pub(crate) fn display<T: fmt::Display, S: serde::Serializer>(value: &T, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_str(value)
}

/// Per-role figures (inside an authority or a device).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RoleSnapshot {
    /// The role's name ("weights", "kv-cache", ...).
    pub role: String,
    /// Bytes charged right now.
    pub current: u64,
    /// High-water mark of the bytes charged (see the module docs for its precision).
    pub peak: u64,
    /// High-water mark of charges plus cached credit (what the budgets bounded).
    pub peak_used: u64,
    /// Credit cached by threads for this role.
    pub cached_credit: u64,
    /// Charges opened.
    pub allocations: u64,
    /// Charges closed.
    pub releases: u64,
    /// Charges open now.
    pub live: u64,
    /// Admissions refused.
    pub failures: u64,
    /// Bytes still charged for quarantined releases.
    pub quarantined_bytes: u64,
    /// Bytes of lost allocations refunded at termination (cumulative).
    pub lost_bytes: u64,
    /// Lost allocations refunded at termination (cumulative).
    pub lost_allocations: u64,
}

impl RoleSnapshot {
    pub(crate) fn empty(role: MemoryRole) -> RoleSnapshot {
        RoleSnapshot { role: role.name().to_owned(), ..RoleSnapshot::default() }
    }

    /// Adds `other`'s counts to these (peaks are summed: an upper bound). Saturating:
    /// a snapshot never panics, whatever the books hold.
    pub(crate) fn absorb(&mut self, other: &RoleSnapshot) {
        self.current = self.current.saturating_add(other.current);
        self.peak = self.peak.saturating_add(other.peak);
        self.peak_used = self.peak_used.saturating_add(other.peak_used);
        self.cached_credit = self.cached_credit.saturating_add(other.cached_credit);
        self.allocations = self.allocations.saturating_add(other.allocations);
        self.releases = self.releases.saturating_add(other.releases);
        self.live = self.live.saturating_add(other.live);
        self.failures = self.failures.saturating_add(other.failures);
        self.quarantined_bytes = self.quarantined_bytes.saturating_add(other.quarantined_bytes);
        self.lost_bytes = self.lost_bytes.saturating_add(other.lost_bytes);
        self.lost_allocations = self.lost_allocations.saturating_add(other.lost_allocations);
    }
}

/// Sums `values`, saturating (snapshots never panic).
pub(crate) fn sum(values: impl IntoIterator<Item = u64>) -> u64 {
    values.into_iter().fold(0, u64::saturating_add)
}

/// Totals over roles.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Totals {
    /// Charges opened.
    pub allocations: u64,
    /// Charges closed.
    pub releases: u64,
    /// Charges open now.
    pub live: u64,
    /// Admissions refused.
    pub failures: u64,
    /// Bytes still charged for quarantined releases.
    pub quarantined_bytes: u64,
    /// Bytes of lost allocations refunded at termination (cumulative).
    pub lost_bytes: u64,
    /// Lost allocations refunded at termination (cumulative).
    pub lost_allocations: u64,
}

impl Totals {
    /// The counts of `roles` added up: the roles are summed the one way every
    /// aggregate is ([`RoleSnapshot::absorb`]), then the counts are taken out.
    pub(crate) fn of(roles: &[RoleSnapshot]) -> Totals {
        let mut all = RoleSnapshot::default();
        for role in roles {
            all.absorb(role);
        }
        Totals {
            allocations: all.allocations,
            releases: all.releases,
            live: all.live,
            failures: all.failures,
            quarantined_bytes: all.quarantined_bytes,
            lost_bytes: all.lost_bytes,
            lost_allocations: all.lost_allocations,
        }
    }
}

/// One authority's account.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct AccountSnapshot {
    /// The authority ("auth:r1.2").
    pub authority: String,
    /// The account's label.
    pub label: String,
    /// The quota; `None` when unlimited.
    pub quota: Option<u64>,
    /// Bytes charged right now.
    pub current: u64,
    /// Bytes drawn from the quota (charges plus cached credit).
    pub used: u64,
    /// High-water mark of the bytes charged (see the module docs for its precision).
    pub peak: u64,
    /// High-water mark of `used`.
    pub peak_used: u64,
    /// Credit cached by threads.
    pub cached_credit: u64,
    /// Counts over roles.
    pub totals: Totals,
    /// Per role, in [`MemoryRole::ALL`] order.
    pub roles: Vec<RoleSnapshot>,
    /// What adapters hold for this account past refusals (not in `current`).
    pub overdraft: OverdraftSnapshot,
    /// Bytes charged (the same as `current`): what the tenant's blocks hold.
    pub allocated: u64,
    /// Bytes the caches of this authority's governed allocators keep idle, as they
    /// report them.
    pub cached: u64,
    /// `allocated + cached`: what the process holds for this tenant.
    pub reserved: u64,
}

/// A role's reserve on a device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ReserveSnapshot {
    /// The role.
    pub role: String,
    /// Bytes reserved for it.
    pub target: u64,
    /// Bytes of the reserve not in use (held aside).
    pub held: u64,
}

/// A registered reclaim holder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct HolderSnapshot {
    /// The holder's name.
    pub name: String,
    /// Its place in the reclaim order.
    pub order: u32,
}

/// One allocator a governed allocator wraps, as it reports itself: for a cache, what
/// it hands out and what it keeps idle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CacheSnapshot {
    /// The allocator's name.
    pub name: String,
    /// The authority whose governed allocator wraps it.
    pub authority: String,
    /// Bytes it has handed out.
    pub live: u64,
    /// Bytes it keeps idle.
    pub cached: u64,
    /// `live + cached`.
    pub reserved: u64,
    /// The largest block it could hand out without asking its backing.
    pub largest_free: u64,
}

/// What the recovery ladder did on a device (see `docs/ACCOUNTING.md`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct LadderSnapshot {
    /// Caches asked to trim (rung a).
    pub trims: u64,
    /// Bytes those trims gave back.
    pub trimmed_bytes: u64,
    /// Allocations refused because what the process holds would pass the limit
    /// after the caches were trimmed and the holders asked.
    pub refused_over_reserved: u64,
}

/// One device's books.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DeviceSnapshot {
    /// The device ("device:0").
    pub device: String,
    /// Its tier ("device", "host", "disk").
    pub tier: String,
    /// Its index in the tier.
    pub index: u32,
    /// The limit; `None` when unlimited.
    pub limit: Option<u64>,
    /// Bytes charged right now, over every authority.
    pub current: u64,
    /// Bytes drawn from the budget (charges, cached credit, reserves held).
    pub used: u64,
    /// High-water mark of the bytes charged, over every authority (see the module
    /// docs for its precision).
    pub peak: u64,
    /// High-water mark of `used`.
    pub peak_used: u64,
    /// Credit cached by threads.
    pub cached_credit: u64,
    /// The admission policy's name.
    pub policy: String,
    /// Reserves per role (only roles with a reserve).
    pub reserves: Vec<ReserveSnapshot>,
    /// Registered reclaim holders, in the order they are asked.
    pub holders: Vec<HolderSnapshot>,
    /// Counts over roles and authorities.
    pub totals: Totals,
    /// Per role over every authority, in [`MemoryRole::ALL`] order.
    pub roles: Vec<RoleSnapshot>,
    /// Per authority.
    pub authorities: Vec<AccountSnapshot>,
    /// What adapters hold on the device past refusals (not in `current`), bounded by
    /// its overdraft limit.
    pub overdraft: OverdraftSnapshot,
    /// Bytes charged to tenants (the same as `current`).
    pub allocated: u64,
    /// Bytes the device's caches keep idle, as they report them.
    pub cached: u64,
    /// `allocated + cached`: what the process holds on the device. The device limit
    /// bounds it where caches grow (see `docs/ACCOUNTING.md`).
    pub reserved: u64,
    /// The highest `reserved` observed (at growth checks, refusals and snapshots).
    pub reserved_peak: u64,
    /// Bytes cache backings hold (exact: every block a cache took from its backing).
    pub held_by_caches: u64,
    /// High-water mark of `held_by_caches`.
    pub held_by_caches_peak: u64,
    /// The largest block any cache of the device could hand out without asking its
    /// backing.
    pub largest_free: u64,
    /// Every allocator governed on the device, as it reports itself.
    pub caches: Vec<CacheSnapshot>,
    /// What the recovery ladder did.
    pub ladder: LadderSnapshot,
}

/// Every device's books.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct GovernorSnapshot {
    /// Per device, ordered by device key.
    pub devices: Vec<DeviceSnapshot>,
}

impl GovernorSnapshot {
    /// The snapshot as JSON.
    pub fn to_json(&self) -> String {
        // Plain data with string keys: serialisation cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_else(|err| format!("{{\"error\": \"{err}\"}}"))
    }

    /// The books of `device`, if it has any.
    pub fn device(&self, device: memory_api::DeviceKey) -> Option<&DeviceSnapshot> {
        let name = device.to_string();
        self.devices.iter().find(|d| d.device == name)
    }
}

impl DeviceSnapshot {
    /// `1 - largest_free / cached`, in [0, 1]: how scattered the caches' idle bytes are.
    pub fn fragmentation(&self) -> f64 {
        crate::footprint::fragmentation(self.cached, self.largest_free)
    }

    /// The account of `authority`, if it has one here.
    pub fn authority(&self, authority: memory_api::AuthorityIdentity) -> Option<&AccountSnapshot> {
        let name = authority.to_string();
        self.authorities.iter().find(|a| a.authority == name)
    }

    /// The per-role figures of `role`.
    pub fn role(&self, role: MemoryRole) -> &RoleSnapshot {
        &self.roles[role.ordinal()]
    }
}

impl AccountSnapshot {
    /// The per-role figures of `role`.
    pub fn role(&self, role: MemoryRole) -> &RoleSnapshot {
        &self.roles[role.ordinal()]
    }
}
