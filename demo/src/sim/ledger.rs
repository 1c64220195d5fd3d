//! The demo's own books: every allocation it made and what became of it, so the
//! closing check can prove nothing was lost.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use memory_governor::{
    AllocateError, AllocationRequest, BoundAllocation, HandleError, MemoryBinding, ReleaseReport, is_governor_refusal,
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
    pub(crate) allocated_bytes: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) released_bytes: AtomicU64,
    pub(crate) quarantined: AtomicU64,
    /// Handles dropped on a lost device (retired by termination, refunded then).
    pub(crate) abandoned_on_loss: AtomicU64,
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
        self.allocated_bytes.fetch_add(block.bytes() as u64, Ordering::Relaxed);
        Ok(block)
    }

    /// Releases `block` through `binding`; returns whether it was released (a block on
    /// a lost device is dropped, and termination accounts for it).
    pub(crate) fn release(&self, binding: &MemoryBinding, block: BoundAllocation) -> bool {
        let bytes = block.bytes() as u64;
        match binding.release(block) {
            Ok(ReleaseReport::Complete { .. }) => {
                self.released.fetch_add(1, Ordering::Relaxed);
                self.released_bytes.fetch_add(bytes, Ordering::Relaxed);
                true
            }
            Ok(_) => {
                self.quarantined.fetch_add(1, Ordering::Relaxed);
                false
            }
            Err(rejected) => {
                if matches!(rejected.reason, HandleError::DeviceLost { .. } | HandleError::StaleAllocation) {
                    self.abandoned_on_loss.fetch_add(1, Ordering::Relaxed);
                } else {
                    // Dropping follows the mechanism's drop policy; the check will
                    // show the allocation as not released by the demo.
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
