//! `TracedAllocator`: a governed allocator whose every call is recorded.

use std::fmt;

use memory_governor::{
    AllocError, AllocationRequest, AllocatorStats, DeviceAllocator, DeviceKey, GovernedAllocError, GovernedAllocator,
    RawAllocation, ReleaseOutcome, SharedMapping, VirtualBacking,
};

use crate::event::{self, Block, FailureKind, MarkKind, Refusal, ReleaseKind};
use crate::recorder::{Shared, caller_tag};
use crate::sync::Arc;

/// A [`GovernedAllocator`] that records what it does; made by
/// [`Recorder::trace`](crate::Recorder::trace). Register it in the `BindingRegistry`
/// where the governed allocator would go.
///
/// - `allocate` goes through [`GovernedAllocator::try_allocate`], so a refusal is
///   recorded with the governor's own figures (scope, used, limit, the footprint:
///   allocated and reserved, idle in caches, largest free block, what trimming and
///   reclaim gave back), then answered as the governed allocator answers it.
/// - `release` records the block presented and the outcome (complete, quarantined
///   with the residual still owned, or failed). Its time is taken before the release, so
///   a block reused by another thread is released, in the trace, before it is handed
///   out again.
/// - `forget_lost` (the registry's termination of a lost context) records each lost
///   block and a termination mark.
/// - Capabilities, stats and trim are the governed allocator's, unrecorded.
///
/// Identity: a block's id in the trace is the governed block's tag, which names the
/// governed allocator's record of it (owner thread, slot, generation): unique among live
/// blocks, and a slot reused gets a new generation.
pub struct TracedAllocator {
    inner: GovernedAllocator,
    shared: Arc<Shared>,
    tenant: u32,
    device: DeviceKey,
    name: String,
}

impl fmt::Debug for TracedAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TracedAllocator").field("inner", &self.inner).field("tenant", &self.tenant).finish()
    }
}

#[inline(always)]
fn block_of(raw: &RawAllocation, requested: u64, caller: u64) -> Block {
    Block {
        id: raw.provider_tag(),
        address: raw.address().get(),
        requested,
        bytes: raw.bytes() as u64,
        align: raw.align() as u64,
        caller,
    }
}

impl TracedAllocator {
    pub(crate) fn new(inner: GovernedAllocator, shared: Arc<Shared>, tenant: u32) -> TracedAllocator {
        let device = inner.device();
        let name = format!("traced({})", inner.name());
        TracedAllocator { inner, shared, tenant, device, name }
    }

    /// The governed allocator recorded.
    pub fn inner(&self) -> &GovernedAllocator {
        &self.inner
    }

    /// This allocator's tenant number in the trace.
    pub fn tenant(&self) -> u32 {
        self.tenant
    }

    #[cold]
    #[inline(never)]
    fn failed(&self, request: &AllocationRequest, error: GovernedAllocError) -> AllocError {
        let (requested, align, caller) = (request.bytes() as u64, request.align() as u64, caller_tag());
        let (device, tenant, role) = (self.device, self.tenant, Some(request.role()));
        match &error {
            GovernedAllocError::Refused(refusal) => {
                let refusal = Refusal::of(refusal, requested, align, caller);
                self.shared.emit(|ts, thread| event::refusal_words(ts, thread, device, tenant, role, &refusal));
            }
            GovernedAllocError::Allocator(inner) => {
                let kind = FailureKind::of(inner);
                self.shared.emit(|ts, thread| {
                    event::failure_words(ts, thread, device, tenant, role, (requested, align, caller), kind)
                });
            }
            _ => {}
        }
        error.into_alloc_error(self.device)
    }
}

impl DeviceAllocator for TracedAllocator {
    fn device(&self) -> DeviceKey {
        self.device
    }

    fn name(&self) -> &str {
        &self.name
    }

    #[inline]
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        match self.inner.try_allocate(request) {
            Ok(raw) => {
                let block = block_of(&raw, request.bytes() as u64, caller_tag());
                let (device, tenant, role) = (self.device, self.tenant, request.role());
                let ts = self.shared.stamp();
                match event::compact_allocate(ts, tenant, role, &block) {
                    Some(compact) => self.shared.emit_compact(&compact),
                    None => self
                        .shared
                        .emit_at(ts, |ts, thread| event::allocate_words(ts, thread, device, tenant, role, &block)),
                }
                Ok(raw)
            }
            Err(error) => Err(self.failed(request, error)),
        }
    }

    #[inline]
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let block = block_of(&allocation, allocation.bytes() as u64, caller_tag());
        let stamp = self.shared.stamp();
        let outcome = self.inner.release(allocation);
        let (kind, residual) = match &outcome {
            ReleaseOutcome::Complete(_) => (ReleaseKind::Complete, 0),
            ReleaseOutcome::Quarantined(quarantine) => (ReleaseKind::Quarantined, quarantine.residual_bytes() as u64),
            ReleaseOutcome::Failed(_) => (ReleaseKind::Failed, 0),
        };
        let (device, tenant) = (self.device, self.tenant);
        match event::compact_release(stamp, tenant, &block, kind, residual) {
            Some(compact) => self.shared.emit_compact(&compact),
            None => self
                .shared
                .emit_at(stamp, |ts, thread| event::release_words(ts, thread, device, tenant, &block, kind, residual)),
        }
        outcome
    }

    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        self.inner.virtual_backing()
    }

    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        self.inner.shared_mapping()
    }

    fn stats(&self) -> Option<AllocatorStats> {
        self.inner.stats()
    }

    fn trim(&self) -> usize {
        self.inner.trim()
    }

    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        let (device, tenant) = (self.device, self.tenant);
        for raw in &lost {
            let block = block_of(raw, raw.bytes() as u64, 0);
            self.shared.emit(|ts, thread| event::lost_words(ts, thread, device, tenant, &block));
        }
        let label = format!("{} lost blocks handed back at termination", lost.len());
        // After finish the mark is refused and counted in `Recorder::dropped`, as the
        // lost blocks' events are: nothing to tell the registry, which is terminating.
        let _ = self.shared.mark(device, tenant, MarkKind::Terminated, lost.len() as u64, &label);
        self.inner.forget_lost(lost);
    }
}
