//! The public handle types: bindings, allocations and views, with the allocation path.
//!
//! Every operation checks, before any callback, that the handle belongs to this
//! registry, mechanism and binding and that its generation still validates, then
//! enters the mechanism's lifecycle (see [`crate::lifecycle`]). No lock is taken here:
//! an allocation is recorded in the calling thread's pin (whichever thread made the
//! binding). A release (explicit, deferred, on drop) enters through the handles'
//! methods and `Drop` here and runs in [`crate::release`]: from any thread, it marks the
//! record in transit, calls the allocator, and frees the record back to its owner (see
//! [`crate::entry::MechanismPin`]).

use std::fmt;
use std::num::NonZeroU64;
use std::panic::{AssertUnwindSafe, catch_unwind};

use memory_api::{
    AllocError, AllocationGeneration, AllocationIdentity, AllocationRequest, BindingGeneration, BindingIdentity,
    DeferredReleaseQueue, DeviceAddress, DeviceAllocator, DeviceKey, Identity, QueueRefusalReason, RawAllocation,
    ReleaseOutcome, ReleaseSummary,
};

use crate::entry::{Anchor, MechanismCore, MechanismPin};
use crate::error::{AllocateError, HandleError, Rejected, ViewError};
use crate::hot_trace::{HotEvent, hot_trace};
use crate::lifecycle::{Admit, MechanismState};
use crate::release::{drop_release, release_deferred, release_now, reraise_unless_unwinding};
use crate::sync::Arc;
use crate::unit_ref::UnitRef;

/// A binding: the right to allocate through one mechanism, pinned to its allocator,
/// provider context and authority. Cheap to clone; a clone is the same binding.
///
/// Share it however the runtime likes: by reference across a thread pool, or cloned
/// into workers. Each thread that allocates through it records its allocations in its
/// own per-thread pin of the mechanism, so threads share no written cache line.
#[derive(Clone)]
pub struct MemoryBinding {
    /// This binding's unit of the binder's anchor (see `unit_ref`).
    pub(crate) anchor: UnitRef<Anchor>,
    /// The binding id's serial (the issuer's, so it is recognised back).
    pub(crate) binding: NonZeroU64,
    pub(crate) generation: BindingGeneration,
}

impl MemoryBinding {
    #[inline]
    pub(crate) fn core(&self) -> &MechanismCore {
        &self.anchor.core
    }

    /// The calling thread's pin of this binding's mechanism.
    #[inline]
    pub(crate) fn local_pin(&self) -> &Arc<MechanismPin> {
        self.anchor.table.pin()
    }

    /// Everything that identifies this binding.
    pub fn identity(&self) -> BindingIdentity {
        let core = self.core();
        BindingIdentity::new(
            recognise(&core.issuer, self.binding),
            self.generation,
            core.device,
            core.identity,
            core.context.identity,
            core.authority.identity,
        )
    }

    /// The device this binding allocates on.
    pub fn device(&self) -> DeviceKey {
        self.core().device
    }

    /// The state of the binding's mechanism now.
    pub fn state(&self) -> MechanismState {
        self.core().lifecycle.state()
    }

    /// The provider-context resource this binding pins (for example the owner of a
    /// CUDA context), for the runtime to downcast.
    pub fn context_resource(&self) -> &crate::Resource {
        &self.core().context.resource
    }

    /// The authority resource this binding pins (for example a tenant account).
    pub fn authority_resource(&self) -> &crate::Resource {
        &self.core().authority.resource
    }

    /// The allocator this binding is pinned to (for stats and trim).
    pub fn allocator(&self) -> &dyn DeviceAllocator {
        &*self.core().allocator
    }

    /// Allocates through the pinned allocator. The allocation is recorded in the
    /// calling thread's pin, so threads allocating through one binding (shared by
    /// reference or cloned) do not contend.
    ///
    /// # Errors
    /// [`AllocateError::Inactive`] or [`AllocateError::DeviceLost`] before any
    /// callback when the mechanism takes no new allocations; the allocator's own
    /// [`AllocError`](memory_api::AllocError) otherwise. Nothing is leaked on error.
    #[inline]
    pub fn allocate(&self, request: AllocationRequest) -> Result<BoundAllocation, AllocateError> {
        self.allocate_then(request, |allocation| allocation)
    }

    /// [`allocate`](Self::allocate), writing the allocation straight into `place` (a
    /// cell of the caller's own table: a C ABI's handle table, an arena's slots) rather
    /// than returning it, so the 64-byte handle is written once, where it will live,
    /// instead of being staged through a `Result` on the way. Whatever `place` held is
    /// dropped first, by its drop policy. On error `place` is `None`.
    ///
    /// # Errors
    /// As [`allocate`](Self::allocate).
    #[inline]
    pub fn allocate_into<'place>(
        &self,
        request: AllocationRequest,
        place: &'place mut Option<BoundAllocation>,
    ) -> Result<&'place mut BoundAllocation, AllocateError> {
        *place = None;
        self.allocate_then(request, |allocation| place.insert(allocation))
    }

    /// The allocation path, handing the new allocation to `finish` (which moves it to
    /// where it is kept) before anything else is returned.
    #[inline(always)]
    fn allocate_then<R>(
        &self,
        request: AllocationRequest,
        finish: impl FnOnce(BoundAllocation) -> R,
    ) -> Result<R, AllocateError> {
        let pin = self.local_pin();
        let core = &*pin.core;
        let in_flight = match core.lifecycle.begin(&pin.in_flight, Admit::ActiveOnly) {
            Ok(guard) => guard,
            Err(state) => return Err(refused_allocation(core, state)),
        };
        // Through `&dyn` directly (not the `Arc` forwarding impl): the result is
        // written once.
        let allocator: &dyn DeviceAllocator = &*core.allocator;
        let answer = allocator.allocate(&request);
        // Read in place: the block is moved out of the answer only on a cold path.
        let raw = match answer {
            Ok(ref raw) => raw,
            Err(error) => return Err(error.into()),
        };
        let (address, bytes, align, tag) = (raw.address(), raw.bytes(), raw.align(), raw.provider_tag());
        // The registry validates what an allocator reports before it trusts it.
        if raw.device() != core.device
            || bytes < request.bytes()
            || !align.is_power_of_two()
            // `request.align()` is a power of two: a mask, not a division.
            || address.get() & (request.align() as u64 - 1) != 0
        {
            return Err(reject_block(core, &request, answer));
        }
        let align_log2 = align.trailing_zeros() as u8;
        match pin.insert(address, bytes, align_log2, tag) {
            Ok((slot, generation)) => {
                drop(in_flight);
                hot_trace(HotEvent::Allocate, &core.identity, bytes);
                Ok(finish(BoundAllocation {
                    pin: Some(UnitRef::new_live(pin)),
                    address,
                    bytes,
                    provider_tag: tag,
                    generation,
                    binding: self.binding,
                    binding_generation: self.generation.serial(),
                    slot,
                    align_log2,
                }))
            }
            Err(error) => {
                // Could not record it: give it straight back rather than leak it.
                give_back(core, answered_block(answer), "an allocation that cannot be recorded");
                Err(AllocateError::Identity(error))
            }
        }
    }

    /// Releases `allocation` through the allocator that made it, from any thread.
    ///
    /// # Errors
    /// A [`Rejected`] handing the allocation back when it belongs to another
    /// registry or binding, its generation is stale, its device was lost (no
    /// callback runs then), or the allocator refused without mutating anything.
    #[inline]
    pub fn release(&self, mut allocation: BoundAllocation) -> Result<ReleaseSummary, Rejected<BoundAllocation>> {
        match self.release_emptying(&mut allocation) {
            Ok(summary) => {
                // Emptied (its pin is taken): nothing is left for `Drop` to do.
                std::mem::forget(allocation);
                Ok(summary)
            }
            Err(reason) => Err(Rejected { handle: allocation, reason }),
        }
    }

    /// [`release`](Self::release) of the allocation kept in `place` (see
    /// [`allocate_into`](Self::allocate_into)), read where it lies rather than moved
    /// out first. On success `place` is `None`; on error it holds the allocation as it
    /// was. (Should an allocator callback's panic propagate out of the call, `place`
    /// holds the allocation emptied: every call then reports it stale, and dropping
    /// it does nothing.)
    ///
    /// # Errors
    /// As [`release`](Self::release), with the reason only (the handle stays in
    /// `place`); [`HandleError::StaleAllocation`] when `place` is `None`.
    #[inline]
    pub fn release_from(&self, place: &mut Option<BoundAllocation>) -> Result<ReleaseSummary, HandleError> {
        let Some(allocation) = place.as_mut() else { return Err(HandleError::StaleAllocation) };
        let summary = self.release_emptying(allocation)?;
        // Emptied: forgetting it only clears `place`.
        std::mem::forget(place.take());
        Ok(summary)
    }

    /// Checks `allocation` belongs to this binding, then releases it, leaving it
    /// emptied (its pin taken) on success and as it was on error.
    #[inline(always)]
    fn release_emptying(&self, allocation: &mut BoundAllocation) -> Result<ReleaseSummary, HandleError> {
        self.check_owns(allocation)?;
        release_now(allocation)
    }

    /// Hands the release of `allocation` to `queue` (for example "free after this
    /// stream's pending work"). The queued release counts as in flight, so its
    /// context cannot be confirmed terminated until the queue has run or dropped it.
    ///
    /// A queue that refuses with another release than the one offered has lost the one
    /// offered: this returns `Ok`, and its block stays quarantined (error event).
    ///
    /// # Errors
    /// A [`Rejected`] handing the allocation back on a foreign, cross-binding, stale or
    /// device-lost handle, a queue for another device, or a queue that refused, handing
    /// back the exact release offered.
    pub fn release_deferred(
        &self,
        allocation: BoundAllocation,
        queue: &dyn DeferredReleaseQueue,
    ) -> Result<(), Rejected<BoundAllocation>> {
        if let Err(reason) = self.check_owns(&allocation) {
            return Err(Rejected { handle: allocation, reason });
        }
        if queue.device() != self.device() {
            let reason = HandleError::QueueRefused(QueueRefusalReason::WrongDevice {
                queue: queue.device(),
                release: self.device(),
            });
            return Err(Rejected { handle: allocation, reason });
        }
        release_deferred(allocation, queue)
    }

    /// Checks that `allocation` was made through this binding.
    #[inline]
    pub(crate) fn check_owns(&self, allocation: &BoundAllocation) -> Result<(), HandleError> {
        // Fast path: the same core (hence the same registry, mechanism, authority,
        // context and device) and the same binding. Everything else is an error,
        // classified off the hot path.
        match allocation.pin.as_ref().map(UnitRef::get) {
            Some(pin)
                if Arc::ptr_eq(&self.anchor.core, &pin.core)
                    && allocation.binding == self.binding
                    && allocation.binding_generation == self.generation.serial() =>
            {
                Ok(())
            }
            _ => Err(self.ownership_error(allocation)),
        }
    }

    #[cold]
    fn ownership_error(&self, allocation: &BoundAllocation) -> HandleError {
        let Some(pin) = allocation.pin.as_ref().map(UnitRef::get) else { return HandleError::StaleAllocation };
        let (expected, found) = (self.core().issuer.registry(), pin.core.issuer.registry());
        if expected != found {
            return HandleError::ForeignRegistry { expected, found };
        }
        HandleError::BindingMismatch { expected: self.identity(), found: allocation.binding_identity() }
    }
}

impl fmt::Debug for MemoryBinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("MemoryBinding").field(&self.identity()).finish()
    }
}

/// One live allocation, pinned to the binding, mechanism, allocator, context and
/// authority it came from. It may be released, dropped or sent to any thread.
///
/// Dropping a live allocation follows its mechanism's [`DropPolicy`](crate::DropPolicy):
/// immediate release for host memory, a deferred queue where one is registered,
/// otherwise quarantine with a warning (device memory may still be in use). On a lost
/// device dropping does nothing; the block is retired when the context is confirmed
/// terminated.
#[must_use = "dropping a live allocation releases, defers or quarantines it by the drop policy; release it through its binding"]
pub struct BoundAllocation {
    /// The pin of the thread that allocated it (where its record lives).
    pub(crate) pin: Option<UnitRef<MechanismPin>>,
    pub(crate) address: DeviceAddress,
    pub(crate) bytes: usize,
    pub(crate) provider_tag: u64,
    pub(crate) generation: NonZeroU64,
    pub(crate) binding: NonZeroU64,
    pub(crate) binding_generation: NonZeroU64,
    pub(crate) slot: u32,
    pub(crate) align_log2: u8,
}

const _: () = assert!(std::mem::size_of::<BoundAllocation>() <= 64);

impl BoundAllocation {
    /// Start address.
    pub fn address(&self) -> DeviceAddress {
        self.address
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Alignment of the address.
    pub fn align(&self) -> usize {
        1usize << self.align_log2
    }

    /// The device the memory lives on.
    pub fn device(&self) -> Option<DeviceKey> {
        self.pin().map(|pin| pin.core.device)
    }

    #[inline]
    fn pin(&self) -> Option<&MechanismPin> {
        self.pin.as_ref().map(UnitRef::get)
    }

    /// Everything that identifies this allocation (`None` only for a handle whose
    /// release is already under way, which safe code cannot observe).
    pub fn identity(&self) -> Option<AllocationIdentity> {
        let binding = self.binding_identity()?;
        let issuer = &self.pin()?.core.issuer;
        let generation: AllocationGeneration = issuer.recognise(self.generation)?;
        Some(AllocationIdentity::new(binding, generation))
    }

    fn binding_identity(&self) -> Option<BindingIdentity> {
        let core = &self.pin()?.core;
        Some(BindingIdentity::new(
            core.issuer.recognise(self.binding)?,
            core.issuer.recognise(self.binding_generation)?,
            core.device,
            core.identity,
            core.context.identity,
            core.authority.identity,
        ))
    }

    /// Whether the registry still holds this allocation's record under its generation
    /// (termination retires every record of its mechanisms).
    pub fn is_valid(&self) -> bool {
        self.pin().is_some_and(|pin| {
            !matches!(pin.core.lifecycle.state(), MechanismState::Terminated) && pin.holds(self.slot, self.generation)
        })
    }

    /// Releases this allocation through the allocator that made it, from any thread,
    /// without the binding it was made through (which may be gone): the registry checks
    /// the allocation's own record, under its generation, in the mechanism it pins, as
    /// [`MemoryBinding::release`] does once it has checked the binding. A runtime that
    /// frees on another object than the one that allocated needs only the handle.
    ///
    /// # Errors
    /// A [`Rejected`] handing the allocation back when its generation is stale, its
    /// device was lost (no callback runs then), or the allocator refused without
    /// mutating anything.
    #[inline]
    pub fn release(mut self) -> Result<ReleaseSummary, Rejected<BoundAllocation>> {
        match release_now(&mut self) {
            Ok(summary) => {
                // Emptied (its pin is taken): nothing is left for `Drop` to do.
                std::mem::forget(self);
                Ok(summary)
            }
            Err(reason) => Err(Rejected { handle: self, reason }),
        }
    }

    /// [`release`](Self::release) of the allocation kept in `place`, read where it lies
    /// (as [`MemoryBinding::release_from`]). On success `place` is `None`; on error it
    /// holds the allocation as it was.
    ///
    /// # Errors
    /// As [`release`](Self::release), with the reason only;
    /// [`HandleError::StaleAllocation`] when `place` is `None`.
    #[inline]
    pub fn release_in_place(place: &mut Option<BoundAllocation>) -> Result<ReleaseSummary, HandleError> {
        let Some(allocation) = place.as_mut() else { return Err(HandleError::StaleAllocation) };
        let summary = release_now(allocation)?;
        // Emptied: forgetting it only clears `place`.
        std::mem::forget(place.take());
        Ok(summary)
    }

    /// A view of `len` bytes at `offset`. It borrows the allocation, so the
    /// allocation cannot be released while the view exists.
    ///
    /// # Errors
    /// [`ViewError::OutOfBounds`] for a range outside the allocation; a handle error
    /// when the device was lost or the mechanism terminated.
    pub fn view(&self, offset: usize, len: usize) -> Result<AllocationView<'_>, ViewError> {
        let end = offset.checked_add(len);
        if end.is_none_or(|end| end > self.bytes) {
            return Err(ViewError::OutOfBounds { offset, len, allocation_bytes: self.bytes });
        }
        self.check_usable()?;
        let address = self.address.checked_add(offset).ok_or(ViewError::OutOfBounds {
            offset,
            len,
            allocation_bytes: self.bytes,
        })?;
        Ok(AllocationView { allocation: self, address, offset, len })
    }

    /// Checks the allocation can still be used (device not lost, metadata not retired).
    pub(crate) fn check_usable(&self) -> Result<&MechanismPin, HandleError> {
        let pin = self.pin().ok_or(HandleError::StaleAllocation)?;
        match pin.core.lifecycle.state() {
            MechanismState::DeviceLost => Err(HandleError::DeviceLost {
                device: pin.core.device,
                mechanism: pin.core.identity,
                reason: pin.core.lost_reason(),
            }),
            MechanismState::Terminated => Err(HandleError::StaleAllocation),
            // A view makes no callback; `Removing` is a momentary check by `remove`.
            MechanismState::Active | MechanismState::Retired | MechanismState::Removing => Ok(pin),
        }
    }

    /// A borrowed copy of the block for capability calls (never released).
    pub(crate) fn raw_view(&self, device: DeviceKey) -> RawAllocation {
        RawAllocation::new(self.address, self.bytes, self.align(), device, self.provider_tag)
    }

    pub(crate) fn belongs_to(&self, binding: &MemoryBinding) -> Result<&MechanismPin, HandleError> {
        binding.check_owns(self)?;
        self.check_usable()
    }
}

impl fmt::Debug for BoundAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoundAllocation")
            .field("address", &self.address)
            .field("bytes", &self.bytes)
            .field("identity", &self.identity())
            .finish()
    }
}

impl Drop for BoundAllocation {
    #[inline]
    fn drop(&mut self) {
        let Some(held) = self.pin.take() else { return };
        let (parts, slot) = (self.parts(), self.slot);
        if std::thread::panicking() {
            // A callback panicking here (a queue's enqueue) would abort the process: the
            // drop policy has booked the block already, so the panic is only logged.
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| drop_release(&held, parts, slot))) {
                reraise_unless_unwinding(panic, "a drop-time release");
            }
            return;
        }
        drop_release(&held, parts, slot);
    }
}

/// A bounded, borrowed window into a live allocation.
#[derive(Debug)]
pub struct AllocationView<'a> {
    allocation: &'a BoundAllocation,
    address: DeviceAddress,
    offset: usize,
    len: usize,
}

impl AllocationView<'_> {
    /// Address of the first byte of the view.
    pub fn address(&self) -> DeviceAddress {
        self.address
    }

    /// Offset of the view inside its allocation.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The allocation viewed.
    pub fn allocation(&self) -> &BoundAllocation {
        self.allocation
    }
}

pub(crate) fn recognise<I: Identity>(issuer: &memory_api::IdentityIssuer, serial: NonZeroU64) -> I {
    // Handles store only serials this issuer minted, so recognition cannot fail.
    issuer.recognise(serial).expect("handle serials are minted by the mechanism's own issuer")
}

/// Why an operation on an existing allocation was refused in `state`.
pub(crate) fn refusal_for(core: &MechanismCore, state: MechanismState) -> HandleError {
    match state {
        MechanismState::DeviceLost => {
            HandleError::DeviceLost { device: core.device, mechanism: core.identity, reason: core.lost_reason() }
        }
        MechanismState::Terminated => HandleError::StaleAllocation,
        state => HandleError::Inactive { mechanism: core.identity, state },
    }
}

/// An allocator answered a request with a block that does not fit it: give the block
/// back and report the allocator's error.
#[cold]
fn reject_block(
    core: &MechanismCore,
    request: &AllocationRequest,
    answer: Result<RawAllocation, AllocError>,
) -> AllocateError {
    let raw = answered_block(answer);
    let found = format!("{raw:?}");
    tracing::error!(mechanism = %core.identity, block = %found, "allocator returned a block that does not fit the request");
    give_back(core, raw, "an unfit block");
    AllocateError::InvalidBlock {
        allocator: core.allocator_name.clone(),
        requested: request.bytes(),
        align: request.align(),
        device: core.device,
        found,
    }
}

/// Gives a block the registry will not record back to the allocator inside `allocate`
/// (still counted in flight, so termination cannot run meanwhile). If the device was
/// lost while the allocator ran, no callback may run any more: the block is kept for
/// `forget_lost` at termination instead. (A loss that lands between this check and the
/// release is the same race as one that lands during the allocator's own call.) A block
/// the allocator does not take back whole (a failure, a quarantine, a panic) is kept the
/// same way: it counts as live, so the mechanism is not removed while the allocator
/// holds memory nobody can name, and termination hands it to `forget_lost`.
#[cold]
fn give_back(core: &MechanismCore, raw: RawAllocation, what: &'static str) {
    if matches!(core.lifecycle.state(), MechanismState::DeviceLost | MechanismState::Terminated) {
        tracing::error!(mechanism = %core.identity, block = ?raw, "device lost during allocate: {what} is kept for forget_lost at termination");
        core.keep_unrecorded(raw);
        return;
    }
    // What was handed over, in case the allocator panics with it.
    let handed = RawAllocation::new(raw.address(), raw.bytes(), raw.align(), raw.device(), raw.provider_tag());
    // A refusal or quarantine keeps the registry's own copy of the block: the answer's
    // block (perhaps another one, or another tag) is not believed.
    let error = match catch_unwind(AssertUnwindSafe(|| core.allocator.release(raw))) {
        Ok(ReleaseOutcome::Complete(_)) => return,
        Ok(ReleaseOutcome::Failed(failed)) => failed.into_parts().1,
        Ok(ReleaseOutcome::Quarantined(quarantine)) => quarantine.into_parts().1,
        Err(panic) => {
            tracing::error!(mechanism = %core.identity, block = ?handed, "{what}: the allocator panicked taking it back; it is kept as live");
            core.keep_unrecorded(handed);
            reraise_unless_unwinding(panic, "giving back a block");
            return;
        }
    };
    tracing::error!(mechanism = %core.identity, %error, block = ?handed, "{what} could not be given back; it is kept as live");
    core.keep_unrecorded(handed);
}

/// The block of an allocator's answer that `allocate` already matched as `Ok` (it
/// reads the answer in place and takes the block out only on its cold paths).
#[cold]
fn answered_block(answer: Result<RawAllocation, AllocError>) -> RawAllocation {
    answer.unwrap_or_else(|_| unreachable!("allocate matched this answer as Ok"))
}

/// An allocation refused by the lifecycle, before any callback.
#[cold]
fn refused_allocation(core: &MechanismCore, state: MechanismState) -> AllocateError {
    match state {
        MechanismState::DeviceLost | MechanismState::Terminated => {
            AllocateError::DeviceLost { device: core.device, mechanism: core.identity, reason: core.lost_reason() }
        }
        state => AllocateError::Inactive { mechanism: core.identity, state },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn handles_are_send_and_sync_without_unsafe() {
        assert_send_sync::<MemoryBinding>();
        assert_send_sync::<BoundAllocation>();
    }
}
