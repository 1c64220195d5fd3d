//! What an operation produces, in the model's terms: the success with the payload
//! that matters, or the error variant with the payload that matters.

use memory_api::ReleaseSummary;

use super::{ContextState, MechanismState, ObjectKind};

/// A cold-path error (`memory_binding::RegistryError`), by variant and the payload
/// that matters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reg {
    /// An identity of another registry.
    Foreign(ObjectKind),
    /// An identity of this registry that is not registered (any more).
    Unknown(ObjectKind),
    /// Devices disagree; the text names what disagrees with the context.
    DeviceMismatch(&'static str),
    /// The context is lost or terminated.
    ContextNotLive(ContextState),
    /// Termination confirmed on a live context.
    ContextStillLive,
    /// Termination confirmed while this many releases are in flight.
    ContextNotQuiescent(usize),
    /// The mechanism's state does not allow the operation.
    InvalidState(MechanismState),
    /// Removal refused: something still uses the object.
    NotQuiescent {
        /// What was to be removed.
        kind: ObjectKind,
        /// Recorded allocations.
        live: usize,
        /// Quarantined blocks.
        quarantined: usize,
        /// Releases in flight.
        in_flight: usize,
        /// Registered mechanisms using it.
        dependents: usize,
    },
    /// Anything else (never expected: the caller keeps the text for the message).
    Other(String),
}

/// A handle error (`memory_binding::HandleError`, the reason inside `Rejected` or
/// inside a view error).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Handle {
    /// The handle or binding belongs to another registry.
    Foreign,
    /// The handle belongs to another binding.
    Mismatch,
    /// Its record is gone (terminated).
    Stale,
    /// Its device was lost, with the invalidation's reason.
    DeviceLost(String),
    /// The mechanism is not in a state that admits the operation.
    Inactive(MechanismState),
    /// The allocator refused the release without mutating anything.
    ReleaseFailed,
    /// The queue is full.
    QueueFull,
    /// The queue is for another device.
    QueueWrongDevice,
    /// Anything else (never expected).
    Other(String),
}

/// What one operation produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Out {
    /// The operation had nothing to act on (no binding or handle yet).
    Skipped,
    /// Succeeded with nothing to report.
    Done,
    /// An object was registered.
    Registered,
    /// A binding of mechanism `mechanism` was made.
    Bound {
        /// Its mechanism's index.
        mechanism: usize,
    },
    /// An allocation was made.
    Allocated {
        /// Its mechanism's index.
        mechanism: usize,
        /// Its size.
        bytes: usize,
    },
    /// An explicit release was booked.
    Released(ReleaseSummary),
    /// A deferred release was queued.
    Deferred,
    /// A view was made.
    Viewed {
        /// Its length.
        len: usize,
    },
    /// `invalidate_device`'s report.
    Invalidated {
        /// Mechanisms moved to device-lost.
        mechanisms: usize,
        /// Contexts moved to lost.
        contexts: usize,
        /// Whether the device's selection was dropped.
        selection_dropped: bool,
    },
    /// `confirm_context_terminated`'s report.
    Terminated {
        /// It was terminated already (nothing done).
        already: bool,
        /// Mechanisms terminated.
        mechanisms: usize,
        /// Recorded allocations handed to `forget_lost`.
        lost_allocations: usize,
        /// Their bytes.
        lost_bytes: usize,
        /// Quarantined blocks discharged.
        discharged: usize,
    },
    /// `retry_quarantined`'s report.
    Retried {
        /// Blocks released completely.
        released: usize,
        /// Blocks still quarantined.
        still: usize,
    },
    /// A cold-path error.
    Registry(Reg),
    /// `bind` with no selection for the device.
    BindNoSelection,
    /// A bind of a mechanism that is not active.
    BindInactive(MechanismState),
    /// A bind refused by an identity check.
    BindRegistry(Reg),
    /// An allocation on a retired mechanism.
    AllocInactive(MechanismState),
    /// An allocation on a lost or terminated mechanism, with the loss's reason.
    AllocDeviceLost(String),
    /// The allocator refused (an injected fault or its heap's limit).
    AllocAllocator,
    /// A handle operation refused.
    Handle(Handle),
    /// A view outside its allocation.
    ViewOutOfBounds,
    /// A view refused by its handle's checks.
    ViewHandle(Handle),
    /// An allocator callback panicked (a planned panic) and the panic reached the
    /// caller; the model has booked what the registry keeps.
    Panicked,
    /// A registry with a serial limit ran out of identities. The model never
    /// predicts this; [`Model::allocate_unrecorded`](super::Model::allocate_unrecorded)
    /// books it for an allocation.
    IdentityExhausted,
    /// Anything else (never expected: the caller keeps the text for the message).
    Other(String),
}

impl Out {
    /// Refusals raised after the allocator was called (the callback itself failed).
    pub fn called_back(&self) -> bool {
        matches!(self, Out::AllocAllocator | Out::Handle(Handle::ReleaseFailed) | Out::Panicked)
    }

    /// Whether this is a refusal.
    pub fn is_error(&self) -> bool {
        matches!(
            self,
            Out::Registry(_)
                | Out::BindNoSelection
                | Out::BindInactive(_)
                | Out::BindRegistry(_)
                | Out::AllocInactive(_)
                | Out::AllocDeviceLost(_)
                | Out::AllocAllocator
                | Out::Handle(_)
                | Out::ViewOutOfBounds
                | Out::ViewHandle(_)
                | Out::Panicked
                | Out::IdentityExhausted
                | Out::Other(_)
        )
    }
}
