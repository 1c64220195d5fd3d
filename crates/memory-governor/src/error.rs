//! The governor's errors: one enum per operation family, messages that say what was
//! asked, what was found and what to change. Errors raised before anything was
//! mutated hand the caller's handle back.

use std::fmt;
use std::sync::Arc;

use memory_api::{AuthorityIdentity, DeviceAllocator, DeviceKey, MemoryRole, Tier};

use crate::policy::AdmissionPolicy;

/// Which limit refused an admission.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum LimitScope {
    /// The device's budget (the memory every authority on the device shares).
    Device,
    /// The authority's quota inside the device budget.
    Authority,
    /// The device limit on what the process holds there: tenants' blocks plus what
    /// allocator caches keep idle (`reserved`), after the caches were trimmed.
    Reserved,
}

impl LimitScope {
    /// Lower-case name used in messages.
    pub const fn name(self) -> &'static str {
        match self {
            LimitScope::Device => "device limit",
            LimitScope::Authority => "authority quota",
            LimitScope::Reserved => "device limit on reserved memory",
        }
    }
}

impl fmt::Display for LimitScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A reclaim holder as reported in an error or snapshot.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct HolderReport {
    /// The holder's name.
    pub name: String,
    /// Bytes it said it could free when asked for this report.
    pub reclaimable: u64,
    /// Its place in the reclaim order (lower is asked first).
    pub order: u32,
}

/// Allocated vs reserved at a refusal: what tenants were charged, and what the process
/// holds (charged plus what caches keep idle), on the device and for the tenant.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Footprint {
    /// Bytes charged to every tenant of the device.
    pub device_allocated: u64,
    /// `device_allocated` plus what the device's caches keep idle.
    pub device_reserved: u64,
    /// Bytes the device's caches keep idle (reported by the caches).
    pub device_cached: u64,
    /// Bytes charged to the refused tenant.
    pub tenant_allocated: u64,
    /// `tenant_allocated` plus what the tenant's own caches keep idle.
    pub tenant_reserved: u64,
    /// The largest block any cache of the device could hand out without asking its
    /// backing (0 when no cache reports it).
    pub largest_free: u64,
    /// Bytes the first rung of the ladder got back by trimming caches, when it ran.
    pub trimmed: Option<u64>,
}

impl Footprint {
    /// These figures without a request of `bytes` that was charged when they were
    /// taken and is being refused: its charge goes back, and if its block went back
    /// into a cache (`cached`), the block stays reserved there.
    pub(crate) fn without(self, bytes: u64, cached: bool) -> Footprint {
        let kept = if cached { bytes } else { 0 };
        Footprint {
            device_allocated: self.device_allocated.saturating_sub(bytes),
            device_cached: self.device_cached.saturating_add(kept),
            device_reserved: self.device_reserved.saturating_sub(bytes - kept),
            tenant_allocated: self.tenant_allocated.saturating_sub(bytes),
            tenant_reserved: self.tenant_reserved.saturating_sub(bytes - kept),
            ..self
        }
    }

    /// `1 - largest free / cached` over the device's caches, in [0, 1]: 0 when the
    /// idle bytes are one block (or none), near 1 when they are scattered.
    pub fn fragmentation(&self) -> f64 {
        crate::footprint::fragmentation(self.device_cached, self.largest_free)
    }
}

impl fmt::Display for Footprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "device: {} bytes allocated, {} reserved ({} idle in caches, largest free block {}, fragmentation {:.0}%); \
             tenant: {} allocated, {} reserved",
            self.device_allocated,
            self.device_reserved,
            self.device_cached,
            self.largest_free,
            self.fragmentation() * 100.0,
            self.tenant_allocated,
            self.tenant_reserved
        )?;
        if let Some(trimmed) = self.trimmed {
            write!(f, "; trimming caches gave back {trimmed} bytes")?;
        }
        Ok(())
    }
}

/// Everything known about a refused admission.
///
/// `used`, `limit` and `available` describe the budget named by `scope`. For a device
/// refusal, `available` includes what is left of the requesting role's own reserve.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Exhaustion {
    /// Tier of the device.
    pub tier: Tier,
    /// The device.
    pub device: DeviceKey,
    /// The authority charged.
    pub authority: AuthorityIdentity,
    /// The account's label.
    pub account: String,
    /// The role of the request.
    pub role: MemoryRole,
    /// Bytes asked for.
    pub requested: u64,
    /// Which limit refused.
    pub scope: LimitScope,
    /// Bytes drawn from that budget at the refusal (charges, thread credit not yet
    /// returned, and for a device the reserves held aside).
    pub used: u64,
    /// The limit of that budget.
    pub limit: u64,
    /// Bytes the request could still have had.
    pub available: u64,
    /// Bytes reclaim holders freed for this request, when the policy asked them.
    pub reclaimed: Option<u64>,
    /// The registered holder that says it could free the most, if any.
    pub largest_holder: Option<HolderReport>,
    /// Name of the device's admission policy.
    pub policy: String,
    /// Allocated vs reserved on the device and for the tenant at the refusal.
    pub footprint: Footprint,
}

impl Exhaustion {
    /// What to change so that the request succeeds.
    pub fn advice(&self) -> String {
        let mut advice = match self.scope {
            LimitScope::Authority => format!(
                "raise {}'s quota (Governor::set_quota), release memory it holds, or ask for less",
                self.authority
            ),
            LimitScope::Device => format!(
                "raise the limit of {} (Governor::set_device_limit), release memory other authorities hold \
                 on it, or ask for less",
                self.device
            ),
            LimitScope::Reserved => format!(
                "the caches' idle memory could not be given back in a piece that fits: lower the caches' bound \
                 (a pool's max cached bytes) or their segment size, release blocks that pin partly used \
                 segments, or raise the limit of {} (Governor::set_device_limit)",
                self.device
            ),
        };
        match (&self.largest_holder, self.reclaimed) {
            (Some(holder), None) if holder.reclaimable > 0 => advice.push_str(&format!(
                "; holder \"{}\" could free {} bytes: install a policy that reclaims (ReclaimThenFail)",
                holder.name, holder.reclaimable
            )),
            (None, _) => advice.push_str("; or register a reclaim holder (Governor::register_holder)"),
            _ => {}
        }
        advice
    }
}

impl fmt::Display for Exhaustion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} request of {} bytes for {} (\"{}\") on {} ({} tier) refused by the {}: {} of {} bytes used, {} available",
            self.role,
            self.requested,
            self.authority,
            self.account,
            self.device,
            self.tier,
            self.scope,
            self.used,
            self.limit,
            self.available
        )?;
        if let Some(reclaimed) = self.reclaimed {
            write!(f, "; reclaim holders freed {reclaimed} bytes")?;
        }
        match &self.largest_holder {
            Some(holder) => write!(
                f,
                "; largest reclaimable holder: \"{}\" ({} bytes, order {})",
                holder.name, holder.reclaimable, holder.order
            )?,
            None => write!(f, "; no reclaim holder is registered on {}", self.device)?,
        }
        write!(f, "; {}; policy {}; {}", self.footprint, self.policy, self.advice())
    }
}

impl std::error::Error for Exhaustion {}

/// Why a charge (a lease, a lease's growth, a governed allocation) was refused.
/// Nothing was charged when this is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdmissionError {
    /// The budget cannot hold the request (boxed: it is large and on the cold path).
    #[error(transparent)]
    Exhausted(Box<Exhaustion>),
    /// The budget cannot hold the request, and this thread is already inside a reclaim
    /// holder's `reclaim` (a holder asked for memory while freeing memory): the
    /// request was refused without asking the holders again, which would recurse.
    #[error(
        "{0}; not reclaimed again: this thread is already inside a reclaim holder's reclaim \
         (free memory before asking for more inside reclaim, or ask after it returns)"
    )]
    ReentrantReclaim(Box<Exhaustion>),
    /// The request, added to what the lease already holds, exceeds the largest charge.
    #[error(
        "{role} request of {requested} bytes on top of {held} bytes already held exceeds the largest charge \
         ({max} bytes); split the memory over several leases"
    )]
    Overflow {
        /// The role of the request.
        role: MemoryRole,
        /// Bytes asked for.
        requested: u64,
        /// Bytes the lease already held.
        held: u64,
        /// The largest charge one lease may hold.
        max: u64,
    },
    /// A cache asked its backing ([`Governor::cache_backing`](crate::Governor::cache_backing))
    /// for more than the device limit leaves: the caches of the device already hold
    /// `held` bytes. The governed allocator above the cache answers with the recovery
    /// ladder (trim, reclaim, retry) before it refuses its tenant.
    #[error(
        "a cache on {device} asked its backing for {requested} bytes, but the device's caches hold {held} of its \
         {limit}-byte limit; trim the caches, lower their bound, or raise the device limit"
    )]
    CacheLimit {
        /// The device.
        device: DeviceKey,
        /// Bytes the cache asked for.
        requested: u64,
        /// Bytes the device's caches held.
        held: u64,
        /// The device limit.
        limit: u64,
    },
}

impl AdmissionError {
    /// The exhaustion report, when the budget refused.
    pub fn exhaustion(&self) -> Option<&Exhaustion> {
        match self {
            AdmissionError::Exhausted(exhaustion) | AdmissionError::ReentrantReclaim(exhaustion) => Some(exhaustion),
            AdmissionError::Overflow { .. } | AdmissionError::CacheLimit { .. } => None,
        }
    }
}

/// A lease was asked to shrink below zero; nothing changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "cannot shrink a {role} lease of {held} bytes by {requested} bytes; shrink by at most {held}, or drop the lease"
)]
pub struct ShrinkError {
    /// The lease's role.
    pub role: MemoryRole,
    /// Bytes the lease holds.
    pub held: u64,
    /// Bytes asked to give back.
    pub requested: u64,
}

/// Opening or finding an account failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AccountError {
    /// No account was opened for this authority.
    #[error("no account is open for authority {authority}; open one with Governor::open_account first")]
    UnknownAuthority {
        /// The authority asked for.
        authority: AuthorityIdentity,
    },
    /// The authority already has an account.
    #[error(
        "authority {authority} already has an account on {device}; use Governor::account to get it, \
         or Governor::set_quota to change its quota"
    )]
    AlreadyOpen {
        /// The authority.
        authority: AuthorityIdentity,
        /// The device of its existing account.
        device: DeviceKey,
    },
}

/// Changing a limit failed; nothing changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitError {
    /// The new device limit would not even hold the reserves of its policy.
    #[error(
        "cannot set the limit of {device} to {requested} bytes: its policy reserves {reserved} bytes for roles; \
         install a policy with smaller reserves first, or keep the limit at {reserved} bytes or more"
    )]
    BelowReserves {
        /// The device.
        device: DeviceKey,
        /// The limit asked for.
        requested: u64,
        /// Sum of the reserves.
        reserved: u64,
    },
    /// No account is open for this authority.
    #[error(transparent)]
    Account(#[from] AccountError),
}

/// Installing a policy failed because its reserves do not fit; the policy is handed
/// back and the previous policy stays in force.
#[derive(Clone, thiserror::Error)]
#[error(
    "policy \"{name}\" reserves {reserve} bytes for {role} on {device}, but only {available} bytes are \
     available; release memory, raise the device limit, or reserve less",
    name = policy.name()
)]
#[non_exhaustive]
pub struct PolicyError {
    /// The device.
    pub device: DeviceKey,
    /// The role whose reserve did not fit.
    pub role: MemoryRole,
    /// The reserve asked for.
    pub reserve: u64,
    /// Bytes the device could still set aside.
    pub available: u64,
    /// The policy, handed back.
    pub policy: Arc<dyn AdmissionPolicy>,
}

impl fmt::Debug for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyError")
            .field("device", &self.device)
            .field("role", &self.role)
            .field("reserve", &self.reserve)
            .field("available", &self.available)
            .field("policy", &self.policy.name())
            .finish()
    }
}

/// Why an allocator could not be governed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GovernFailure {
    /// No account is open for the authority.
    #[error(transparent)]
    Account(#[from] AccountError),
    /// The allocator serves another device than the account.
    #[error(
        "allocator \"{allocator}\" serves {allocator_device}, but the account of {authority} is on {account_device}; \
         govern it with an account on {allocator_device}"
    )]
    DeviceMismatch {
        /// The allocator's name.
        allocator: String,
        /// The allocator's device.
        allocator_device: DeviceKey,
        /// The account's authority.
        authority: AuthorityIdentity,
        /// The account's device.
        account_device: DeviceKey,
    },
}

/// Wrapping an allocator in a [`GovernedAllocator`](crate::GovernedAllocator) failed;
/// the allocator is handed back.
#[derive(Clone, thiserror::Error)]
#[error("{failure}")]
pub struct GovernError {
    /// What went wrong.
    pub failure: GovernFailure,
    /// The allocator, handed back untouched.
    pub allocator: Arc<dyn DeviceAllocator>,
}

impl fmt::Debug for GovernError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GovernError")
            .field("failure", &self.failure)
            .field("allocator", &self.allocator.name())
            .finish()
    }
}

/// A lease asked for by authority failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseRequestError {
    /// The authority has no account.
    #[error(transparent)]
    Account(#[from] AccountError),
    /// The account refused the charge.
    #[error(transparent)]
    Admission(#[from] AdmissionError),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn footprint() -> Footprint {
        Footprint {
            device_allocated: 1000,
            device_reserved: 1400,
            device_cached: 400,
            tenant_allocated: 300,
            tenant_reserved: 350,
            largest_free: 100,
            trimmed: None,
        }
    }

    #[test]
    fn a_refused_request_leaves_the_figures_and_its_block_stays_reserved_only_if_cached() {
        // The block went back to the inner allocator: neither allocated nor reserved.
        let gone = footprint().without(200, false);
        assert_eq!((gone.device_allocated, gone.device_reserved, gone.device_cached), (800, 1200, 400), "{gone:?}");
        assert_eq!((gone.tenant_allocated, gone.tenant_reserved), (100, 150));
        // The block went back into a cache: no longer allocated, still reserved, cached.
        let cached = footprint().without(200, true);
        assert_eq!(
            (cached.device_allocated, cached.device_reserved, cached.device_cached),
            (800, 1400, 600),
            "{cached:?}"
        );
        assert_eq!((cached.tenant_allocated, cached.tenant_reserved), (100, 350));
        assert_eq!(cached.largest_free, 100);
    }

    #[test]
    fn fragmentation_is_one_less_the_largest_free_block_over_the_idle_bytes() {
        assert!((footprint().fragmentation() - 0.75).abs() < 1e-9);
        let one_block = Footprint { largest_free: 400, ..footprint() };
        assert_eq!(one_block.fragmentation(), 0.0);
    }
}
