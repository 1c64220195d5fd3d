//! The demo's own books: every allocation it made and what became of it, so the
//! closing check can prove nothing was lost.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use memory_governor::{
    AllocateError, AllocationRequest, BoundAllocation, HandleError, MemoryBinding, ReleaseSummary, is_governor_refusal,
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
}

/// Classifies an allocation failure.
pub(crate) fn classify(error: &AllocateError) -> Refusal {
    match error {
        AllocateError::DeviceLost { .. } => Refusal::DeviceLost,
        AllocateError::Allocator(inner) if is_governor_refusal(inner) => Refusal::Budget,
        AllocateError::Allocator(memory_governor::AllocError::DeviceLost { .. }) => Refusal::DeviceLost,
        _ => Refusal::Allocator,
    }
}
