//! The demo's own books: every allocation it made and what became of it, so the
//! closing check can prove nothing was lost.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use memory_governor::{
    AllocError, AllocateError, AllocationRequest, BoundAllocation, HandleError, LimitScope, MemoryBinding,
    ReleaseSummary, is_governor_refusal,
};

/// Why a request or an allocation did not go through.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Refusal {
    /// The governor refused (quota or budget, after reclaim).
    Budget,
    /// The device was lost under the request.
    DeviceLost,
    /// The allocator itself failed.
    Allocator,
}

impl Refusal {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Refusal::Budget => "quota/budget exhausted after reclaim",
            Refusal::DeviceLost => "device lost mid-request",
            Refusal::Allocator => "allocator error",
        }
    }
}

/// Counters shared by every worker.
#[derive(Default)]
pub(crate) struct Ledger {
    pub(crate) allocations: AtomicU64,
    pub(crate) released: AtomicU64,
    /// Releases the registry refused for another reason (a bug in the demo).
    pub(crate) misreleased: AtomicU64,
    pub(crate) served: AtomicU64,
    refusals: Mutex<BTreeMap<Refusal, u64>>,
    /// The governor's refusals by the limit that refused: how many, and the first
    /// message (what was asked, allocated vs reserved, what the ladder did).
    budget: Mutex<BTreeMap<Scope, (u64, String)>>,
}

/// The limit named in a governor's refusal, in the order the report prefers an example:
/// the ladder's own refusal first.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Scope {
    Reserved,
    Device,
    Authority,
    /// A refusal whose message names none of the limits (a cache backing's own).
    Other,
}

impl Scope {
    const NAMED: [(Scope, LimitScope); 3] = [
        (Scope::Reserved, LimitScope::Reserved),
        (Scope::Device, LimitScope::Device),
        (Scope::Authority, LimitScope::Authority),
    ];

    /// The scope a refusal's message names (`"... refused by the <scope>: ..."`).
    fn of(detail: &str) -> Scope {
        Scope::NAMED
            .iter()
            .find(|(_, limit)| detail.contains(&format!("refused by the {}:", limit.name())))
            .map_or(Scope::Other, |(scope, _)| *scope)
    }

    pub(crate) fn name(self) -> &'static str {
        match Scope::NAMED.iter().find(|(scope, _)| *scope == self) {
            Some((_, limit)) => limit.name(),
            None => "other",
        }
    }
}

impl Ledger {
    /// Allocates through `binding`, counting the outcome.
    pub(crate) fn allocate(
        &self,
        binding: &MemoryBinding,
        request: AllocationRequest,
    ) -> Result<BoundAllocation, AllocateError> {
        let block = binding.allocate(request)?;
        self.allocations.fetch_add(1, Ordering::Relaxed);
        Ok(block)
    }

    /// Releases `block` through `binding`; returns whether it was released (a block on
    /// a lost device is dropped, and termination accounts for it).
    pub(crate) fn release(&self, binding: &MemoryBinding, block: BoundAllocation) -> bool {
        match binding.release(block) {
            Ok(ReleaseSummary::Complete { .. }) => {
                self.released.fetch_add(1, Ordering::Relaxed);
                true
            }
            // Quarantined: the registry keeps it (the check counts its quarantine).
            Ok(_) => false,
            Err(rejected) => {
                // A block on a lost device is retired by termination (counted there);
                // any other refusal is a bug in the demo, which the check reports.
                if !matches!(rejected.reason, HandleError::DeviceLost { .. } | HandleError::StaleAllocation) {
                    self.misreleased.fetch_add(1, Ordering::Relaxed);
                }
                drop(rejected.handle);
                false
            }
        }
    }

    pub(crate) fn refuse(&self, why: Refusal) {
        *self.refusals.lock().unwrap_or_else(PoisonError::into_inner).entry(why).or_default() += 1;
    }

    pub(crate) fn refusals(&self) -> BTreeMap<Refusal, u64> {
        self.refusals.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Classifies an allocation failure, keeping the first message of each limit that
    /// refused.
    pub(crate) fn classify(&self, error: &AllocateError) -> Refusal {
        match error {
            AllocateError::DeviceLost { .. } => Refusal::DeviceLost,
            AllocateError::Allocator(inner) if is_governor_refusal(inner) => {
                let detail = inner.to_string();
                let mut budget = self.budget.lock().unwrap_or_else(PoisonError::into_inner);
                budget.entry(Scope::of(&detail)).or_insert((0, detail)).0 += 1;
                Refusal::Budget
            }
            AllocateError::Allocator(AllocError::DeviceLost { .. }) => Refusal::DeviceLost,
            _ => Refusal::Allocator,
        }
    }

    /// The governor's refusals by scope: count and first message.
    pub(crate) fn budget_refusals(&self) -> BTreeMap<Scope, (u64, String)> {
        self.budget.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_filed_under_the_limit_its_message_names() {
        for (scope, limit) in Scope::NAMED {
            let detail = format!("kv-cache request of 65536 bytes refused by the {}: 1 of 2 bytes used", limit.name());
            assert_eq!(Scope::of(&detail), scope, "{detail}");
        }
        assert_eq!(Scope::of("a cache on host:1 asked its backing for 4096 bytes"), Scope::Other);
    }
}
