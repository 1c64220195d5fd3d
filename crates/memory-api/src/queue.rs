//! Deferred release: a provider-owned queue that frees memory later (for example
//! after a CUDA event recorded on the stream that last used it has completed).

use std::fmt;
use std::sync::Arc;

use crate::allocator::{DeviceAllocator, RawAllocation};
use crate::device::DeviceKey;
use crate::error::{BackendError, ReleaseError};
use crate::identity::AllocationIdentity;
use crate::release::{ReleaseOutcome, ReleaseSummary};

/// Called exactly once with the outcome of a prepared release.
pub type ReleaseCompletion = Box<dyn FnOnce(ReleaseOutcome) + Send>;

/// A release that has been validated and is ready to run: the block, the exact
/// allocator that made it, and a completion that tells the owner what happened.
///
/// Whoever holds it must eventually call [`PreparedRelease::execute`]. Dropping it
/// unexecuted does not free the memory (that would not be safe if the device may still
/// use it); the completion then receives a quarantine with
/// [`ReleaseError::Abandoned`], so the bytes stay visible as owned.
pub struct PreparedRelease {
    identity: AllocationIdentity,
    allocator: Arc<dyn DeviceAllocator>,
    allocation: Option<RawAllocation>,
    completion: Option<ReleaseCompletion>,
}

impl PreparedRelease {
    /// Prepares the release of `allocation` through `allocator`.
    pub fn new(
        identity: AllocationIdentity,
        allocator: Arc<dyn DeviceAllocator>,
        allocation: RawAllocation,
        completion: ReleaseCompletion,
    ) -> PreparedRelease {
        PreparedRelease { identity, allocator, allocation: Some(allocation), completion: Some(completion) }
    }

    /// The allocation being released.
    pub fn identity(&self) -> &AllocationIdentity {
        &self.identity
    }

    /// The device the memory lives on.
    pub fn device(&self) -> DeviceKey {
        self.identity.device()
    }

    /// Size of the block.
    pub fn bytes(&self) -> usize {
        self.allocation.as_ref().map_or(0, RawAllocation::bytes)
    }

    /// Runs the release through the original allocator, hands the outcome to the
    /// completion and returns its summary. If the allocator panics, the completion
    /// still runs (with a quarantine of the whole block and
    /// [`ReleaseError::CallbackPanicked`]) before the panic continues, so the owner's
    /// books never wait forever for an answer.
    pub fn execute(mut self) -> ReleaseSummary {
        let Some(allocation) = self.allocation.take() else {
            // Unreachable: only `execute`, `cancel` and `drop` take the block, each
            // consuming `self`.
            return ReleaseSummary::Complete { unmapped_bytes: 0 };
        };
        let copy = RawAllocation::new(
            allocation.address(),
            allocation.bytes(),
            allocation.align(),
            allocation.device(),
            allocation.provider_tag(),
        );
        let guard = CompleteOnUnwind { completion: self.completion.take(), copy: Some(copy) };
        let outcome = self.allocator.release(allocation);
        guard.finish(outcome)
    }
}

/// Calls the completion exactly once: with the real outcome, or on unwind with a
/// quarantine of the whole block.
struct CompleteOnUnwind {
    completion: Option<ReleaseCompletion>,
    copy: Option<RawAllocation>,
}

impl CompleteOnUnwind {
    fn finish(mut self, outcome: ReleaseOutcome) -> ReleaseSummary {
        let summary = outcome.summary();
        self.copy = None;
        if let Some(completion) = self.completion.take() {
            completion(outcome);
        }
        summary
    }
}

impl Drop for CompleteOnUnwind {
    fn drop(&mut self) {
        if let (Some(completion), Some(copy)) = (self.completion.take(), self.copy.take()) {
            let bytes = copy.bytes();
            completion(ReleaseOutcome::quarantined(copy, 0, bytes, ReleaseError::CallbackPanicked));
        }
    }
}

impl PreparedRelease {
    /// Withdraws the release without running it: the completion is dropped uncalled
    /// and the block comes back (the owner re-records it, for example after a queue
    /// refused the release).
    pub fn cancel(mut self) -> RawAllocation {
        self.completion = None;
        match self.allocation.take() {
            Some(allocation) => allocation,
            // Unreachable: the block is taken only by `execute`, `cancel` and `drop`,
            // each of which consumes `self`.
            None => unreachable!("a prepared release always holds its block until consumed"),
        }
    }
}

impl Drop for PreparedRelease {
    fn drop(&mut self) {
        if let (Some(allocation), Some(completion)) = (self.allocation.take(), self.completion.take()) {
            let bytes = allocation.bytes();
            completion(ReleaseOutcome::quarantined(allocation, 0, bytes, ReleaseError::Abandoned));
        }
    }
}

impl fmt::Debug for PreparedRelease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedRelease")
            .field("identity", &self.identity)
            .field("allocator", &self.allocator.name())
            .field("allocation", &self.allocation)
            .finish()
    }
}

/// Why a queue refused a release.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QueueRefusalReason {
    /// The queue holds as many releases as it may.
    #[error("the queue is full ({capacity} pending); drain it (poll completed events) or release synchronously")]
    Full {
        /// Its capacity.
        capacity: usize,
    },
    /// The queue serves another device.
    #[error("the queue serves {queue}, the release is on {release}; use that device's queue")]
    WrongDevice {
        /// The queue's device.
        queue: DeviceKey,
        /// The release's device.
        release: DeviceKey,
    },
    /// The queue is shut down.
    #[error("the queue is closed; release synchronously")]
    Closed,
    /// The queue could not arrange the deferral (for example recording its event
    /// failed); the release was not taken.
    #[error("the queue could not defer the release: {0}; release synchronously or check the device")]
    Backend(BackendError),
}

/// A refused release, handed back exactly as it was offered.
#[derive(Debug, thiserror::Error)]
#[error("deferred release of {} refused: {reason}", .release.identity())]
pub struct QueueRefusal {
    /// The release, untouched.
    pub release: PreparedRelease,
    /// Why it was refused.
    pub reason: QueueRefusalReason,
}

/// A provider-owned queue that runs prepared releases later.
pub trait DeferredReleaseQueue: Send + Sync {
    /// The device whose releases this queue runs.
    fn device(&self) -> DeviceKey;

    /// Takes `release` to run later.
    ///
    /// # Errors
    /// A [`QueueRefusal`] carrying the exact request back when the queue cannot take it.
    fn enqueue(&self, release: PreparedRelease) -> Result<(), QueueRefusal>;
}
