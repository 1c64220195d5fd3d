//! Caller holds: termination waits for callers the registry cannot see.
//!
//! The registry counts the callbacks it makes itself, so it knows when none is in
//! flight. An adapter that hands memory to a foreign runtime (an ONNX Runtime session,
//! a C program) cannot promise the same: that runtime may still call `Free` on a lost
//! device's block at any time, long after the registry's own callbacks drained. A
//! [`CallerHold`] says so: while one lives, [`confirm_context_terminated`] of the
//! binding's provider context answers
//! [`ContextNotQuiescent`](crate::RegistryError::ContextNotQuiescent), so the books are
//! not refunded while the foreign runtime still holds the memory.
//!
//! A hold is a count on the mechanism, taken and dropped on the cold path (once per
//! session, not per allocation). Take it *before* handing the foreign runtime anything
//! it can call: a hold taken after the context was confirmed terminated has nothing
//! left to hold.
//!
//! [`confirm_context_terminated`]: crate::BindingRegistry::confirm_context_terminated

use std::fmt;

use crate::binding::MemoryBinding;
use crate::sync::Ordering;

/// Keeps the provider context of a binding's mechanism from being confirmed
/// terminated until dropped: while it lives,
/// [`confirm_context_terminated`](crate::BindingRegistry::confirm_context_terminated)
/// answers [`ContextNotQuiescent`](crate::RegistryError::ContextNotQuiescent). For an
/// adapter whose foreign runtime (an ONNX Runtime session, a C program) may still call
/// `Free` on the mechanism's blocks. Also pins the binding.
#[must_use = "the hold ends as soon as it is dropped"]
pub struct CallerHold {
    binding: MemoryBinding,
    holder: String,
}

impl MemoryBinding {
    /// A hold on this binding's provider context for `holder` (named in logs): until it
    /// drops, termination of the context is refused as not quiescent.
    pub fn hold_callers(&self, holder: impl Into<String>) -> CallerHold {
        let holder = holder.into();
        let now = self.core().caller_holds.fetch_add(1, Ordering::AcqRel) + 1;
        tracing::debug!(mechanism = %self.core().identity, %holder, holds = now, "caller hold taken");
        CallerHold { binding: self.clone(), holder }
    }
}

impl CallerHold {
    /// The binding the hold was taken through.
    pub fn binding(&self) -> &MemoryBinding {
        &self.binding
    }

    /// Who holds.
    pub fn holder(&self) -> &str {
        &self.holder
    }
}

impl fmt::Debug for CallerHold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallerHold")
            .field("mechanism", &self.binding.core().identity)
            .field("holder", &self.holder)
            .finish()
    }
}

impl Drop for CallerHold {
    fn drop(&mut self) {
        let core = self.binding.core();
        let left = core.caller_holds.fetch_sub(1, Ordering::AcqRel) - 1;
        tracing::debug!(mechanism = %core.identity, holder = %self.holder, holds = left, "caller hold dropped");
    }
}
