//! The hot path: bindings, allocations, views, release (explicit, deferred, on drop).
//!
//! Every operation checks, before any callback, that the handle belongs to this
//! registry, mechanism and binding and that its generation still validates, then
//! enters the mechanism's lifecycle (see [`crate::lifecycle`]). No registry-wide lock
//! is taken here; the only lock is the calling thread's pin, and it is never held
//! across a callback.

use std::fmt;
use std::num::NonZeroU64;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use memory_api::{
    AllocationGeneration, AllocationIdentity, AllocationRequest, BindingGeneration, BindingId, BindingIdentity,
    DeferredReleaseQueue, DeviceAddress, DeviceAllocator, DeviceKey, Identity, PreparedRelease, QueueRefusalReason,
    RawAllocation, ReleaseError, ReleaseOutcome, ReleaseSummary,
};

use crate::entry::{DropPolicy, MechanismCore, Pin, QuarantinedAllocation};
use crate::error::{AllocateError, HandleError, Rejected, ViewError};
use crate::lifecycle::{Admit, MechanismState};
use crate::sync::{Arc, AtomicU8, Ordering};

/// A binding: the right to allocate through one mechanism, pinned to its allocator,
/// provider context and authority. Cheap to clone; a clone is the same binding.
#[derive(Clone)]
pub struct MemoryBinding {
    pub(crate) pin: Arc<Pin>,
    pub(crate) binding: BindingId,
    pub(crate) generation: BindingGeneration,
}

impl MemoryBinding {
    /// Everything that identifies this binding.
    pub fn identity(&self) -> BindingIdentity {
        let core = &self.pin.core;
        BindingIdentity::new(
            self.binding,
            self.generation,
            core.device,
            core.identity,
            core.context.identity,
            core.authority.identity,
        )
    }

    /// The device this binding allocates on.
    pub fn device(&self) -> DeviceKey {
        self.pin.core.device
    }

    /// The state of the binding's mechanism now.
    pub fn state(&self) -> MechanismState {
        self.pin.core.lifecycle.state()
    }

    /// The provider-context resource this binding pins (for example the owner of a
    /// CUDA context), for the runtime to downcast.
    pub fn context_resource(&self) -> &crate::Resource {
        &self.pin.core.context.resource
    }

    /// The authority resource this binding pins (for example a tenant account).
    pub fn authority_resource(&self) -> &crate::Resource {
        &self.pin.core.authority.resource
    }

    /// The allocator this binding is pinned to (for stats and trim).
    pub fn allocator(&self) -> &dyn DeviceAllocator {
        &*self.pin.core.allocator
    }

    /// Allocates through the pinned allocator.
    ///
    /// # Errors
    /// [`AllocateError::Inactive`] or [`AllocateError::DeviceLost`] before any
    /// callback when the mechanism takes no new allocations; the allocator's own
    /// [`AllocError`](memory_api::AllocError) otherwise. Nothing is leaked on error.
    pub fn allocate(&self, request: AllocationRequest) -> Result<BoundAllocation, AllocateError> {
        let core = &self.pin.core;
        let _in_flight = core.lifecycle.begin(self.pin.slot, Admit::ActiveOnly).map_err(|state| match state {
            MechanismState::DeviceLost | MechanismState::Terminated => {
                AllocateError::DeviceLost { device: core.device, mechanism: core.identity, reason: core.lost_reason() }
            }
            state => AllocateError::Inactive { mechanism: core.identity, state },
        })?;
        let raw = core.allocator.allocate(&request)?;
        let (address, bytes, align, tag) = (raw.address(), raw.bytes(), raw.align(), raw.provider_tag());
        // The registry validates what an allocator reports before it trusts it.
        if raw.device() != core.device
            || bytes < request.bytes()
            || !align.is_power_of_two()
            || !address.is_aligned_to(request.align())
        {
            return Err(reject_block(core, &request, raw));
        }
        match self.pin.insert(raw) {
            Ok((slot, generation)) => {
                tracing::trace!(mechanism = %core.identity, bytes, "allocate");
                Ok(BoundAllocation {
                    pin: Some(Arc::clone(&self.pin)),
                    address,
                    bytes,
                    provider_tag: tag,
                    generation,
                    binding: self.binding.serial(),
                    binding_generation: self.generation.serial(),
                    slot,
                    align_log2: align.trailing_zeros() as u8,
                })
            }
            Err((raw, error)) => {
                // Could not record it: give it straight back rather than leak it.
                give_back(core, raw, "an allocation that cannot be recorded");
                Err(AllocateError::Identity(error))
            }
        }
    }

    /// Releases `allocation` through the allocator that made it.
    ///
    /// # Errors
    /// A [`Rejected`] handing the allocation back when it belongs to another
    /// registry or binding, its generation is stale, its device was lost (no
    /// callback runs then), or the allocator refused without mutating anything.
    pub fn release(&self, allocation: BoundAllocation) -> Result<ReleaseSummary, Rejected<BoundAllocation>> {
        if let Err(reason) = self.check_owns(&allocation) {
            return Err(Rejected { handle: allocation, reason });
        }
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
        match allocation.pin.as_ref() {
            Some(pin)
                if Arc::ptr_eq(&self.pin.core, &pin.core)
                    && allocation.binding == self.binding.serial()
                    && allocation.binding_generation == self.generation.serial() =>
            {
                Ok(())
            }
            _ => Err(self.ownership_error(allocation)),
        }
    }

    #[cold]
    fn ownership_error(&self, allocation: &BoundAllocation) -> HandleError {
        let Some(pin) = allocation.pin.as_ref() else { return HandleError::StaleAllocation };
        let (expected, found) = (self.pin.core.issuer.registry(), pin.core.issuer.registry());
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
/// authority it came from.
///
/// Dropping a live allocation follows its mechanism's [`DropPolicy`]: immediate
/// release for host memory, a deferred queue where one is registered, otherwise
/// quarantine with a warning (device memory may still be in use). On a lost device
/// dropping does nothing; the block is retired when the context is confirmed
/// terminated.
#[must_use = "dropping a live allocation releases, defers or quarantines it by the drop policy; release it through its binding"]
pub struct BoundAllocation {
    pin: Option<Arc<Pin>>,
    address: DeviceAddress,
    bytes: usize,
    provider_tag: u64,
    generation: NonZeroU64,
    binding: NonZeroU64,
    binding_generation: NonZeroU64,
    slot: u32,
    align_log2: u8,
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
        self.pin.as_ref().map(|pin| pin.core.device)
    }

    /// Everything that identifies this allocation (`None` only for a handle whose
    /// release is already under way, which safe code cannot observe).
    pub fn identity(&self) -> Option<AllocationIdentity> {
        let binding = self.binding_identity()?;
        let issuer = &self.pin.as_ref()?.core.issuer;
        let generation: AllocationGeneration = issuer.recognise(self.generation)?;
        Some(AllocationIdentity::new(binding, generation))
    }

    fn binding_identity(&self) -> Option<BindingIdentity> {
        let core = &self.pin.as_ref()?.core;
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
        self.pin.as_ref().is_some_and(|pin| pin.holds(self.slot, self.generation))
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
    pub(crate) fn check_usable(&self) -> Result<&Arc<Pin>, HandleError> {
        let pin = self.pin.as_ref().ok_or(HandleError::StaleAllocation)?;
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

    pub(crate) fn belongs_to(&self, binding: &MemoryBinding) -> Result<&Arc<Pin>, HandleError> {
        binding.check_owns(self)?;
        self.check_usable()
    }

    /// Rebuilds a handle for a block put back into the registry.
    fn rebuilt(parts: &HandleParts, pin: Arc<Pin>, slot: u32) -> BoundAllocation {
        BoundAllocation {
            pin: Some(pin),
            address: parts.address,
            bytes: parts.bytes,
            provider_tag: parts.provider_tag,
            generation: parts.generation,
            binding: parts.binding,
            binding_generation: parts.binding_generation,
            slot,
            align_log2: parts.align_log2,
        }
    }

    fn parts(&self) -> HandleParts {
        HandleParts {
            address: self.address,
            bytes: self.bytes,
            provider_tag: self.provider_tag,
            generation: self.generation,
            binding: self.binding,
            binding_generation: self.binding_generation,
            align_log2: self.align_log2,
        }
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
    fn drop(&mut self) {
        let Some(pin) = self.pin.take() else { return };
        let parts = self.parts();
        if std::thread::panicking() {
            // A callback panicking here (a queue's enqueue) would abort the process: the
            // drop policy has booked the block already, so the panic is only logged.
            let slot = self.slot;
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| drop_release(pin, parts, slot))) {
                reraise_unless_unwinding(panic, "a drop-time release");
            }
            return;
        }
        drop_release(pin, parts, self.slot);
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

/// Anything that can produce a handle's plain-data parts (the handle itself on the
/// explicit path, a copy of its parts on drop and deferred paths).
trait AsParts {
    fn as_parts(&self) -> HandleParts;
}

impl AsParts for BoundAllocation {
    fn as_parts(&self) -> HandleParts {
        self.parts()
    }
}

impl AsParts for HandleParts {
    fn as_parts(&self) -> HandleParts {
        *self
    }
}

/// The plain-data part of a handle, kept while its block is away in a callback.
#[derive(Copy, Clone)]
struct HandleParts {
    address: DeviceAddress,
    bytes: usize,
    provider_tag: u64,
    generation: NonZeroU64,
    binding: NonZeroU64,
    binding_generation: NonZeroU64,
    align_log2: u8,
}

impl HandleParts {
    fn raw(&self, device: DeviceKey) -> RawAllocation {
        RawAllocation::new(self.address, self.bytes, 1usize << self.align_log2, device, self.provider_tag)
    }

    fn quarantined(
        &self,
        core: &MechanismCore,
        allocation: RawAllocation,
        unmapped_bytes: usize,
        residual_bytes: usize,
        error: ReleaseError,
    ) -> QuarantinedAllocation {
        let issuer = &core.issuer;
        QuarantinedAllocation {
            generation: recognise(issuer, self.generation),
            binding: recognise(issuer, self.binding),
            allocation,
            unmapped_bytes,
            residual_bytes,
            error,
        }
    }
}

fn recognise<I: Identity>(issuer: &memory_api::IdentityIssuer, serial: NonZeroU64) -> I {
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
fn reject_block(core: &MechanismCore, request: &AllocationRequest, raw: RawAllocation) -> AllocateError {
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
/// release is the same race as one that lands during the allocator's own call.)
#[cold]
fn give_back(core: &MechanismCore, raw: RawAllocation, what: &'static str) {
    if matches!(core.lifecycle.state(), MechanismState::DeviceLost | MechanismState::Terminated) {
        tracing::error!(mechanism = %core.identity, block = ?raw, "device lost during allocate: {what} is kept for forget_lost at termination");
        core.keep_unrecorded_lost(raw);
        return;
    }
    let outcome = core.allocator.release(raw);
    if !outcome.is_complete() {
        tracing::error!(mechanism = %core.identity, outcome = %outcome.summary(), "{what} could not be given back");
    }
}

/// Explicit release: validate, take the record exactly once, call the allocator.
/// Borrows the core through the handle's pin: no shared refcount is touched.
#[inline]
fn release_now(mut allocation: BoundAllocation) -> Result<ReleaseSummary, Rejected<BoundAllocation>> {
    let Some(pin) = allocation.pin.take() else {
        return Err(Rejected { handle: allocation, reason: HandleError::StaleAllocation });
    };
    let settled = {
        let core = &pin.core;
        match core.lifecycle.begin(pin.slot, Admit::ActiveOrRetired) {
            Err(state) => Err(refusal_for(core, state)),
            Ok(in_flight) => match pin.take(allocation.slot, allocation.generation) {
                None => Err(HandleError::StaleAllocation),
                Some(raw) => {
                    let settled = match call_release(core, &allocation, raw) {
                        // The common answer needs no bookkeeping beyond the record
                        // already taken.
                        Some(ReleaseOutcome::Complete(done)) => {
                            tracing::trace!(mechanism = %core.identity, bytes = allocation.bytes, "release");
                            let unmapped_bytes = core.completed(allocation.bytes, done.unmapped_bytes());
                            Settled::Done(ReleaseSummary::Complete { unmapped_bytes })
                        }
                        Some(outcome) => settle(core, &pin, &allocation.parts(), outcome),
                        // It panicked while this thread unwinds: quarantined, not re-raised.
                        None => Settled::Done(ReleaseSummary::Quarantined {
                            unmapped_bytes: 0,
                            residual_bytes: allocation.bytes,
                        }),
                    };
                    drop(in_flight);
                    Ok(settled)
                }
            },
        }
    };
    match settled {
        // Refused before anything was taken: the handle goes back as it was.
        Err(reason) => {
            allocation.pin = Some(pin);
            Err(Rejected { handle: allocation, reason })
        }
        Ok(Settled::Done(report)) => Ok(report),
        Ok(Settled::Refused { slot, error }) => Err(Rejected {
            handle: BoundAllocation::rebuilt(&allocation.parts(), pin, slot),
            reason: HandleError::ReleaseFailed(*error),
        }),
    }
}

/// Calls the allocator's release; a panic quarantines the whole block, then unwinds,
/// unless this thread is unwinding already (then `None`: see [`reraise_unless_unwinding`]).
#[inline]
fn call_release(core: &MechanismCore, handle: &impl AsParts, raw: RawAllocation) -> Option<ReleaseOutcome> {
    match catch_unwind(AssertUnwindSafe(|| core.allocator.release(raw))) {
        Ok(outcome) => Some(outcome),
        Err(panic) => {
            let parts = handle.as_parts();
            let raw = parts.raw(core.device);
            let bytes = raw.bytes();
            core.quarantine(parts.quarantined(core, raw, 0, bytes, ReleaseError::CallbackPanicked));
            reraise_unless_unwinding(panic, "a release");
            None
        }
    }
}

/// Re-raises a callback's panic, unless this thread is already unwinding: a panic
/// escaping a destructor then aborts the process, so the panic is logged and dropped
/// instead. The caller has already booked what the callback left (a quarantine).
#[cold]
pub(crate) fn reraise_unless_unwinding(panic: Box<dyn std::any::Any + Send>, callback: &str) {
    if !std::thread::panicking() {
        resume_unwind(panic);
    }
    let message = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a non-string payload");
    tracing::error!(
        panic = message,
        "{callback} panicked while the thread was unwinding; not re-raised (it would abort)"
    );
    // The payload's own destructor could panic too: leak it rather than risk that.
    std::mem::forget(panic);
}

enum Settled {
    Done(ReleaseSummary),
    /// Nothing was released; the block is back in the pin at `slot`.
    Refused {
        slot: u32,
        // Boxed: refusals are rare, and a small `Settled` keeps the common path in
        // registers.
        error: Box<ReleaseError>,
    },
}

/// Books an outcome: complete is done, quarantine goes to the registry's list, and a
/// refusal puts the record back. An outcome about another block than the one given
/// is not believed: the block given stays quarantined as wholly owned.
#[inline]
fn settle(core: &MechanismCore, pin: &Arc<Pin>, parts: &HandleParts, outcome: ReleaseOutcome) -> Settled {
    let expected = parts.raw(core.device);
    match outcome {
        ReleaseOutcome::Complete(done) => {
            tracing::trace!(mechanism = %core.identity, bytes = parts.bytes, "release");
            Settled::Done(ReleaseSummary::Complete {
                unmapped_bytes: core.completed(parts.bytes, done.unmapped_bytes()),
            })
        }
        ReleaseOutcome::Quarantined(q) => {
            let (unmapped, residual) = (q.unmapped_bytes(), q.residual_bytes());
            let (raw, error) = q.into_parts();
            let entry = if raw.same_block(&expected) {
                parts.quarantined(core, raw, unmapped, residual, error)
            } else {
                mismatched(core, parts, expected, unmapped, residual)
            };
            let report = ReleaseSummary::Quarantined {
                unmapped_bytes: entry.unmapped_bytes,
                residual_bytes: entry.residual_bytes,
            };
            core.quarantine(entry);
            Settled::Done(report)
        }
        ReleaseOutcome::Failed(failed) => {
            let (raw, error) = failed.into_parts();
            if !raw.same_block(&expected) {
                let entry = mismatched(core, parts, expected, 0, parts.bytes);
                let report = ReleaseSummary::Quarantined {
                    unmapped_bytes: entry.unmapped_bytes,
                    residual_bytes: entry.residual_bytes,
                };
                core.quarantine(entry);
                return Settled::Done(report);
            }
            match pin.reinsert(raw, parts.generation) {
                Ok(slot) => Settled::Refused { slot, error: Box::new(error) },
                Err(raw) => {
                    let bytes = raw.bytes();
                    core.quarantine(parts.quarantined(core, raw, 0, bytes, error));
                    Settled::Done(ReleaseSummary::Quarantined { unmapped_bytes: 0, residual_bytes: bytes })
                }
            }
        }
    }
}

fn mismatched(
    core: &MechanismCore,
    parts: &HandleParts,
    expected: RawAllocation,
    claimed_unmapped: usize,
    claimed_residual: usize,
) -> QuarantinedAllocation {
    let bytes = expected.bytes();
    tracing::error!(mechanism = %core.identity, "allocator answered a release with another block");
    parts.quarantined(
        core,
        expected,
        0,
        bytes,
        ReleaseError::DishonestOutcome { claimed_unmapped, claimed_residual, allocation_bytes: bytes },
    )
}

/// Deferred release: take the record, count it in flight until the queue runs it.
fn release_deferred(
    mut allocation: BoundAllocation,
    queue: &dyn DeferredReleaseQueue,
) -> Result<(), Rejected<BoundAllocation>> {
    let Some(pin) = allocation.pin.take() else {
        return Err(Rejected { handle: allocation, reason: HandleError::StaleAllocation });
    };
    let parts = allocation.parts();
    let taken = match pin.core.lifecycle.begin_detached(pin.slot, Admit::ActiveOrRetired) {
        // `begin_detached` leaves no count behind when it refuses.
        Err(state) => Err(refusal_for(&pin.core, state)),
        Ok(()) => pin.take(allocation.slot, parts.generation).ok_or_else(|| {
            pin.core.lifecycle.end_detached(pin.slot);
            HandleError::StaleAllocation
        }),
    };
    let raw = match taken {
        Ok(raw) => raw,
        Err(reason) => {
            allocation.pin = Some(pin);
            return Err(Rejected { handle: allocation, reason });
        }
    };
    match enqueue(&pin, &parts, raw, queue) {
        Ok(()) => Ok(()),
        Err((raw, reason)) => {
            let result = match pin.reinsert(raw, parts.generation) {
                Ok(slot) => Err((slot, reason)),
                Err(raw) => {
                    let bytes = raw.bytes();
                    pin.core.quarantine(parts.quarantined(&pin.core, raw, 0, bytes, ReleaseError::Abandoned));
                    Ok(())
                }
            };
            pin.core.lifecycle.end_detached(pin.slot);
            result.map_err(|(slot, reason)| Rejected {
                handle: BoundAllocation::rebuilt(&parts, pin, slot),
                reason: HandleError::QueueRefused(reason),
            })
        }
    }
}

/// Builds the prepared release and offers it.
///
/// `Ok` when the queue took it, or when it refused with another release than the one
/// offered: then the offered release counts as lost by the queue (its block stays
/// quarantined and its in-flight count ends exactly once, whoever gets there first).
/// `Err` hands the block back on an honest refusal; the caller re-records or
/// quarantines it, then ends the count.
fn enqueue(
    pin: &Arc<Pin>,
    parts: &HandleParts,
    raw: RawAllocation,
    queue: &dyn DeferredReleaseQueue,
) -> Result<(), (RawAllocation, QueueRefusalReason)> {
    let core = &pin.core;
    let identity = AllocationIdentity::new(
        BindingIdentity::new(
            recognise(&core.issuer, parts.binding),
            recognise(&core.issuer, parts.binding_generation),
            core.device,
            core.identity,
            core.context.identity,
            core.authority.identity,
        ),
        recognise(&core.issuer, parts.generation),
    );
    let queued = Arc::new(QueuedRelease { core: Arc::clone(core), claim: AtomicU8::new(QUEUED) });
    let withdrawn = WithdrawOnDrop(Arc::clone(&queued));
    let completion_pin = Arc::clone(pin);
    let completion_parts = *parts;
    let completion = Box::new(move |outcome: ReleaseOutcome| {
        let queued = &withdrawn.0;
        // The registry may have disowned this release (its queue refused with another
        // one): then the books were settled already.
        if !queued.claimed_by_completion() {
            return;
        }
        let core = &completion_pin.core;
        let lost =
            matches!(&outcome, ReleaseOutcome::Failed(f) if matches!(f.error(), ReleaseError::DeviceLost { .. }));
        match settle(core, &completion_pin, &completion_parts, outcome) {
            Settled::Done(report) => tracing::trace!(mechanism = %core.identity, ?report, "deferred release ran"),
            // Nobody holds a handle any more: a lost block stays recorded (retired at
            // termination); any other refusal becomes a quarantine.
            Settled::Refused { slot, error } if !lost => {
                if let Some(raw) = completion_pin.take(slot, completion_parts.generation) {
                    let bytes = raw.bytes();
                    core.quarantine(completion_parts.quarantined(core, raw, 0, bytes, *error));
                }
            }
            Settled::Refused { .. } => {}
        }
        core.lifecycle.end_detached(completion_pin.slot);
    });
    let releaser: Arc<dyn DeviceAllocator> = Arc::clone(&queued) as Arc<dyn DeviceAllocator>;
    let prepared = PreparedRelease::new(identity, releaser, raw, completion);
    let refusal = match queue.enqueue(prepared) {
        Ok(()) => return Ok(()),
        Err(refusal) => refusal,
    };
    // A refusal must hand back the very release offered. Withdrawing whatever came back
    // drops its completion uncalled: if it was ours, the claim now says so.
    let same_identity = *refusal.release.identity() == identity;
    let reason = refusal.reason;
    let block = refusal.release.cancel();
    if queued.claim.load(Ordering::SeqCst) == WITHDRAWN && same_identity && block.same_block(&parts.raw(core.device)) {
        // The caller re-records or quarantines the block, then ends the count: ending
        // it first would let termination or removal run while the block is nowhere.
        return Err((block, reason));
    }
    refused_with_another_release(pin, parts, &queued, &reason);
    Ok(())
}

/// A queue refused with another release than the one offered: the offered one counts
/// as lost by the queue. Whoever claims it first settles its books (a completion that
/// already ran, or one that runs later, finds the claim taken and does nothing).
#[cold]
fn refused_with_another_release(pin: &Pin, parts: &HandleParts, queued: &QueuedRelease, reason: &QueueRefusalReason) {
    let core = &pin.core;
    tracing::error!(
        mechanism = %core.identity,
        %reason,
        "deferred-release queue refused with another release than the one offered; the offered block counts as lost by the queue"
    );
    let withdrawn = queued.claim.load(Ordering::SeqCst) == WITHDRAWN;
    if withdrawn || queued.claim.compare_exchange(QUEUED, DISOWNED, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
        let raw = parts.raw(core.device);
        let bytes = raw.bytes();
        core.quarantine(parts.quarantined(core, raw, 0, bytes, ReleaseError::Abandoned));
        core.lifecycle.end_detached(pin.slot);
    }
}

/// Claim states of a queued release: the first of its completion, its withdrawal and
/// its disowning by the registry settles the books.
const QUEUED: u8 = 0;
/// The queue runs it: the allocator is (being) called, the completion books the outcome.
const RUNNING: u8 = 1;
/// The queue dropped it unrun: the completion books the abandoned block.
const COMPLETED: u8 = 2;
/// Withdrawn by `cancel`: the completion never runs; the refusal's receiver books it.
const WITHDRAWN: u8 = 3;
/// Its queue refused with another release: the registry booked it as lost by the
/// queue; running it later makes no allocator call.
const DISOWNED: u8 = 4;

/// The allocator a queued release runs through: it claims the release (so a release
/// the registry disowned makes no allocator call) and re-checks the lifecycle when the
/// queue finally runs it (so a release that comes due after device loss makes no
/// allocator callback either).
struct QueuedRelease {
    core: Arc<MechanismCore>,
    claim: AtomicU8,
}

impl QueuedRelease {
    /// Whether the completion settles the books: it was run (the allocator claimed it)
    /// or it claims it now (dropped unrun).
    fn claimed_by_completion(&self) -> bool {
        self.claim.load(Ordering::SeqCst) == RUNNING
            || self.claim.compare_exchange(QUEUED, COMPLETED, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }
}

/// Held by a queued release's completion: dropped uncalled (the release was withdrawn),
/// it marks the claim so the refusal's receiver knows the completion will never run.
struct WithdrawOnDrop(Arc<QueuedRelease>);

impl Drop for WithdrawOnDrop {
    fn drop(&mut self) {
        let _ = self.0.claim.compare_exchange(QUEUED, WITHDRAWN, Ordering::SeqCst, Ordering::SeqCst);
    }
}

impl DeviceAllocator for QueuedRelease {
    fn device(&self) -> DeviceKey {
        self.core.device
    }
    fn name(&self) -> &str {
        &self.core.allocator_name
    }
    fn allocate(&self, _request: &AllocationRequest) -> Result<RawAllocation, memory_api::AllocError> {
        Err(memory_api::AllocError::Unsupported {
            allocator: "deferred release".to_owned(),
            device: self.core.device,
            what: "allocation through a prepared release",
        })
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        if self.claim.compare_exchange(QUEUED, RUNNING, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            // Disowned: the block is quarantined already; the completion ignores this.
            return ReleaseOutcome::failed(allocation, ReleaseError::Abandoned);
        }
        match self.core.lifecycle.state() {
            MechanismState::DeviceLost | MechanismState::Terminated => ReleaseOutcome::failed(
                allocation,
                ReleaseError::DeviceLost { device: self.core.device, reason: self.core.lost_reason() },
            ),
            // A queued release counts in flight, so `remove` cannot complete under it.
            MechanismState::Active | MechanismState::Retired | MechanismState::Removing => {
                self.core.allocator.release(allocation)
            }
        }
    }
}

/// Drop policy: see [`BoundAllocation`].
fn drop_release(pin: Arc<Pin>, parts: HandleParts, slot: u32) {
    let core = &pin.core;
    match &core.drop_policy {
        DropPolicy::Release => {
            let Ok(in_flight) = core.lifecycle.begin(pin.slot, Admit::ActiveOrRetired) else {
                return; // Lost or terminated: no callback; termination retires the record.
            };
            let Some(raw) = pin.take(slot, parts.generation) else { return };
            let Some(outcome) = call_release(core, &parts, raw) else { return };
            // Nobody holds a handle any more: a refused drop-time release is quarantined.
            if let Settled::Refused { slot, error } = settle(core, &pin, &parts, outcome)
                && let Some(raw) = pin.take(slot, parts.generation)
            {
                let bytes = raw.bytes();
                core.quarantine(parts.quarantined(core, raw, 0, bytes, *error));
            }
            drop(in_flight);
        }
        DropPolicy::Defer(queue) => {
            if core.lifecycle.begin_detached(pin.slot, Admit::ActiveOrRetired).is_err() {
                return;
            }
            let Some(raw) = pin.take(slot, parts.generation) else {
                core.lifecycle.end_detached(pin.slot);
                return;
            };
            if let Err((raw, reason)) = enqueue(&pin, &parts, raw, &**queue) {
                tracing::warn!(mechanism = %core.identity, %reason, "drop-time deferred release refused");
                let bytes = raw.bytes();
                core.quarantine(parts.quarantined(core, raw, 0, bytes, ReleaseError::Abandoned));
                core.lifecycle.end_detached(pin.slot);
            }
        }
        DropPolicy::Quarantine => {
            // Counted in flight while the block moves from its record to quarantine,
            // so termination and removal never run with the block in neither place.
            let Ok(in_flight) = core.lifecycle.begin(pin.slot, Admit::ActiveOrRetired) else {
                return; // Lost or terminated: termination retires the record.
            };
            if let Some(raw) = pin.take(slot, parts.generation) {
                let bytes = raw.bytes();
                core.quarantine(parts.quarantined(core, raw, 0, bytes, ReleaseError::Abandoned));
            }
            drop(in_flight);
        }
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
