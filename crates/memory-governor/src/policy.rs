//! Admission policies: what a device does when a request does not fit.
//!
//! The budget itself never overcommits; a policy only decides two things:
//! - which bytes of the device to keep aside for a role ([`AdmissionPolicy::reserve`]),
//!   applied when the policy is installed;
//! - what to do when a request does not fit ([`AdmissionPolicy::on_shortfall`]):
//!   fail at once, or ask the device's reclaim holders to free memory and retry once.
//!
//! The policy is called on the slow path only, with no lock held.

use std::fmt;
use std::sync::Arc;

use memory_api::{AuthorityIdentity, DeviceKey, MemoryRole};

use crate::credit::ROLES;
use crate::error::LimitScope;

/// A request that did not fit, as a policy sees it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Shortfall {
    /// The device.
    pub device: DeviceKey,
    /// The authority charged.
    pub authority: AuthorityIdentity,
    /// The role of the request.
    pub role: MemoryRole,
    /// Bytes asked for.
    pub requested: u64,
    /// Which limit refused.
    pub scope: LimitScope,
    /// Bytes the request could still have had.
    pub available: u64,
}

impl Shortfall {
    /// Bytes missing: what reclaim would have to free.
    pub fn missing(&self) -> u64 {
        self.requested.saturating_sub(self.available)
    }
}

/// What to do about a [`Shortfall`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShortfallDecision {
    /// Refuse the request.
    Fail,
    /// Ask the reclaim holders (in order) for the missing bytes, then retry once.
    Reclaim,
}

/// Decides admissions on one device.
pub trait AdmissionPolicy: Send + Sync {
    /// A short name for messages and snapshots.
    fn name(&self) -> &str;

    /// Bytes of the device kept for `role` alone. Applied when the policy is installed;
    /// other roles can never use them. Default: none.
    fn reserve(&self, role: MemoryRole) -> u64 {
        let _ = role;
        0
    }

    /// What to do when a request does not fit. Called with no lock held.
    fn on_shortfall(&self, shortfall: &Shortfall) -> ShortfallDecision;
}

impl fmt::Debug for dyn AdmissionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AdmissionPolicy({})", self.name())
    }
}

/// Refuses whatever does not fit. The default policy.
#[derive(Copy, Clone, Debug, Default)]
pub struct HardLimit;

impl AdmissionPolicy for HardLimit {
    fn name(&self) -> &str {
        "hard-limit"
    }

    fn on_shortfall(&self, _shortfall: &Shortfall) -> ShortfallDecision {
        ShortfallDecision::Fail
    }
}

/// Asks the device's reclaim holders for the missing bytes, retries once, then fails.
#[derive(Copy, Clone, Debug, Default)]
pub struct ReclaimThenFail;

impl AdmissionPolicy for ReclaimThenFail {
    fn name(&self) -> &str {
        "reclaim-then-fail"
    }

    fn on_shortfall(&self, _shortfall: &Shortfall) -> ShortfallDecision {
        ShortfallDecision::Reclaim
    }
}

/// Keeps a guaranteed reserve per role (for example: weights can never be squeezed out
/// by KV-cache growth) and defers shortfalls to another policy.
#[derive(Clone)]
pub struct GuaranteedReserve {
    reserves: [u64; ROLES],
    fallback: Arc<dyn AdmissionPolicy>,
    name: String,
}

impl GuaranteedReserve {
    /// No reserves yet; shortfalls go to `fallback`.
    pub fn new(fallback: Arc<dyn AdmissionPolicy>) -> GuaranteedReserve {
        let name = format!("guaranteed-reserve({})", fallback.name());
        GuaranteedReserve { reserves: [0; ROLES], fallback, name }
    }

    /// Keeps `bytes` for `role`.
    #[must_use]
    pub fn with_reserve(mut self, role: MemoryRole, bytes: u64) -> GuaranteedReserve {
        self.reserves[role.ordinal()] = bytes;
        self
    }
}

impl fmt::Debug for GuaranteedReserve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuaranteedReserve").field("reserves", &self.reserves).field("fallback", &self.fallback).finish()
    }
}

impl AdmissionPolicy for GuaranteedReserve {
    fn name(&self) -> &str {
        &self.name
    }

    fn reserve(&self, role: MemoryRole) -> u64 {
        self.reserves[role.ordinal()]
    }

    fn on_shortfall(&self, shortfall: &Shortfall) -> ShortfallDecision {
        self.fallback.on_shortfall(shortfall)
    }
}
