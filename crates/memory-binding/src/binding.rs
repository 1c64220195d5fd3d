//! The hot path: bindings, allocations, views, release (explicit, deferred, on drop).
//!
//! Every operation checks, before any callback, that the handle belongs to this
//! registry, mechanism and binding and that its generation still validates, then
//! enters the mechanism's lifecycle (see [`crate::lifecycle`]). No lock is taken here:
//! an allocation is recorded in the calling thread's pin (whichever thread made the
//! binding), and a release, from any thread, marks the record in transit, calls the
//! allocator, and frees the record back to its owner (see [`crate::entry::MechanismPin`]).

use std::fmt;
use std::num::NonZeroU64;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use memory_api::{
    AllocError, AllocationGeneration, AllocationIdentity, AllocationRequest, BindingGeneration, BindingIdentity,
    DeferredReleaseQueue, DeviceAddress, DeviceAllocator, DeviceKey, Identity, PreparedRelease, QueueRefusalReason,
    RawAllocation, ReleaseError, ReleaseOutcome, ReleaseSummary,
};

use crate::entry::{Anchor, DropPolicy, MechanismCore, MechanismPin, QuarantinedAllocation, Record};
use crate::error::{AllocateError, HandleError, Rejected, ViewError};
use crate::hot_trace::{HotEvent, hot_trace};
use crate::lifecycle::{Admit, MechanismState};
use crate::sync::{Arc, AtomicU8, Ordering};
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
/// Dropping a live allocation follows its mechanism's [`DropPolicy`]: immediate
/// release for host memory, a deferred queue where one is registered, otherwise
/// quarantine with a warning (device memory may still be in use). On a lost device
/// dropping does nothing; the block is retired when the context is confirmed
/// terminated.
#[must_use = "dropping a live allocation releases, defers or quarantines it by the drop policy; release it through its binding"]
pub struct BoundAllocation {
    /// The pin of the thread that allocated it (where its record lives).
    pin: Option<UnitRef<MechanismPin>>,
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

    fn parts(&self) -> BlockInTransit {
        BlockInTransit {
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

/// The plain data of a handle whose block is in transit: kept while the block is away in
/// a release callback, to book the outcome or to hand the handle back.
#[derive(Copy, Clone)]
struct BlockInTransit {
    address: DeviceAddress,
    bytes: usize,
    provider_tag: u64,
    generation: NonZeroU64,
    binding: NonZeroU64,
    binding_generation: NonZeroU64,
    align_log2: u8,
}

impl BlockInTransit {
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
    let kept = match catch_unwind(AssertUnwindSafe(|| core.allocator.release(raw))) {
        Ok(ReleaseOutcome::Complete(_)) => return,
        Ok(ReleaseOutcome::Failed(failed)) => failed.into_parts(),
        Ok(ReleaseOutcome::Quarantined(quarantine)) => quarantine.into_parts(),
        Err(panic) => {
            tracing::error!(mechanism = %core.identity, block = ?handed, "{what}: the allocator panicked taking it back; it is kept as live");
            core.keep_unrecorded(handed);
            reraise_unless_unwinding(panic, "giving back a block");
            return;
        }
    };
    let (block, error) = kept;
    tracing::error!(mechanism = %core.identity, %error, block = ?block, "{what} could not be given back; it is kept as live");
    core.keep_unrecorded(block);
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

/// Why [`take`] gave no record: small and `Copy`, so the common path carries no
/// drop glue; the caller turns it into a [`HandleError`] off the hot path.
#[derive(Copy, Clone)]
enum Refusal {
    Stale,
    State(MechanismState),
}

impl Refusal {
    #[cold]
    fn reason(self, core: &MechanismCore) -> HandleError {
        match self {
            Refusal::Stale => HandleError::StaleAllocation,
            Refusal::State(state) => refusal_for(core, state),
        }
    }
}

/// Takes the record at `slot` for a release: announces the release by marking the
/// record in transit, passes the Dekker point, and withdraws if the state refuses.
/// A `remove` that is only counting is waited out. A stale key is reported as such
/// only when the state admits releases (a lost device is reported first, as before
/// any record is touched).
#[inline]
fn take(pin: &MechanismPin, slot: u32, generation: NonZeroU64) -> Result<&Record, Refusal> {
    let lifecycle = &pin.core.lifecycle;
    let admit = Admit::ActiveOrRetired;
    loop {
        let refused = match pin.announce(slot, generation) {
            Some(record) => match lifecycle.admit_announced(admit) {
                Ok(()) => return Ok(record),
                Err(state) => {
                    record.restore(generation);
                    state
                }
            },
            None => match lifecycle.check(admit) {
                Ok(()) => return Err(Refusal::Stale),
                Err(state) => state,
            },
        };
        lifecycle.refused(refused, admit).map_err(Refusal::State)?;
    }
}

/// Explicit release: take the record, call the allocator, settle. The handle's pin is
/// the allocating thread's: its core is read through it, no shared refcount is touched.
/// On success `allocation` is left emptied (its pin taken, so dropping it does
/// nothing); on error it is as it was.
#[inline]
fn release_now(allocation: &mut BoundAllocation) -> Result<ReleaseSummary, HandleError> {
    let Some(held) = allocation.pin.take() else { return Err(HandleError::StaleAllocation) };
    let pin = held.get();
    let slot = allocation.slot;
    let record = match take(pin, slot, allocation.generation) {
        Ok(record) => record,
        // Refused before anything was taken: the handle goes back as it was.
        Err(refusal) => {
            let reason = refusal.reason(&pin.core);
            allocation.pin = Some(held);
            return Err(reason);
        }
    };
    let parts = allocation.parts();
    let core = &*pin.core;
    match call_release(pin, slot, record, &parts) {
        // The common answer needs no bookkeeping beyond freeing the record.
        Some(ReleaseOutcome::Complete(done)) => {
            // One ownership question for the record and the unit.
            let here = pin.owned_here();
            pin.free_known(slot, record, here);
            hot_trace(HotEvent::Release, &core.identity, parts.bytes);
            let unmapped_bytes = core.completed(parts.bytes, done.unmapped_bytes());
            held.give_back(here);
            Ok(ReleaseSummary::Complete { unmapped_bytes })
        }
        // It panicked while this thread unwinds: quarantined, not re-raised.
        None => Ok(ReleaseSummary::Quarantined { unmapped_bytes: 0, residual_bytes: parts.bytes }),
        Some(outcome) => match settle(pin, slot, record, &parts, outcome) {
            Settlement::Released(report) => Ok(report),
            Settlement::Refused(error) => {
                // Nothing was released: the record is live again, the handle goes back.
                record.restore(parts.generation);
                allocation.pin = Some(held);
                Err(HandleError::ReleaseFailed(*error))
            }
        },
    }
}

/// Calls the allocator's release of the block `parts` describes; a panic quarantines
/// the whole block (then frees its record), then unwinds, unless this thread is
/// unwinding already (then `None`: see [`reraise_unless_unwinding`]).
#[inline]
fn call_release(pin: &MechanismPin, slot: u32, record: &Record, parts: &BlockInTransit) -> Option<ReleaseOutcome> {
    let core = &*pin.core;
    let allocator: &dyn DeviceAllocator = &*core.allocator;
    match catch_unwind(AssertUnwindSafe(|| allocator.release(parts.raw(core.device)))) {
        Ok(outcome) => Some(outcome),
        Err(panic) => {
            let raw = parts.raw(core.device);
            let bytes = raw.bytes();
            core.quarantine(parts.quarantined(core, raw, 0, bytes, ReleaseError::CallbackPanicked));
            pin.free(slot, record);
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
    // The payload's own destructor could panic too: drop it where such a panic is
    // caught, and leak only what a payload that panicked in its destructor left.
    if let Err(unruly) = catch_unwind(AssertUnwindSafe(move || drop(panic))) {
        std::mem::forget(unruly);
    }
}

/// What booking a release outcome came to.
enum Settlement {
    /// The release is booked: complete, partial or quarantined.
    Released(ReleaseSummary),
    /// Nothing was released; the record is still in transit, for the caller to put
    /// back (a handle returns) or to quarantine (nobody holds a handle).
    // Boxed: refusals are rare, and a small `Settlement` keeps the common path in
    // registers.
    Refused(Box<ReleaseError>),
}

/// Books an outcome: complete frees the record, quarantine moves the block to the
/// registry's list first (so it is never in neither place), a refusal leaves the
/// record in transit for the caller. An outcome about another block than the one
/// given is not believed: the block given stays quarantined as wholly owned.
fn settle(
    pin: &MechanismPin,
    slot: u32,
    record: &Record,
    parts: &BlockInTransit,
    outcome: ReleaseOutcome,
) -> Settlement {
    let core = &*pin.core;
    let expected = parts.raw(core.device);
    let settled = match outcome {
        ReleaseOutcome::Complete(done) => {
            hot_trace(HotEvent::Release, &core.identity, parts.bytes);
            Settlement::Released(ReleaseSummary::Complete {
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
            Settlement::Released(report)
        }
        ReleaseOutcome::Failed(failed) => {
            let (raw, error) = failed.into_parts();
            if raw.same_block(&expected) {
                return Settlement::Refused(Box::new(error));
            }
            let entry = mismatched(core, parts, expected, 0, parts.bytes);
            let report = ReleaseSummary::Quarantined {
                unmapped_bytes: entry.unmapped_bytes,
                residual_bytes: entry.residual_bytes,
            };
            core.quarantine(entry);
            Settlement::Released(report)
        }
    };
    pin.free(slot, record);
    settled
}

/// A refused release nobody holds a handle for (a drop, a queued release): the block
/// is quarantined, then its record freed.
#[cold]
fn quarantine_in_transit(pin: &MechanismPin, slot: u32, record: &Record, parts: &BlockInTransit, error: ReleaseError) {
    let core = &*pin.core;
    let raw = parts.raw(core.device);
    let bytes = raw.bytes();
    core.quarantine(parts.quarantined(core, raw, 0, bytes, error));
    pin.free(slot, record);
}

fn mismatched(
    core: &MechanismCore,
    parts: &BlockInTransit,
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

/// Deferred release: take the record and hand the release to the queue. The record
/// stays in transit (counted in flight) until the queue runs or drops the release.
fn release_deferred(
    mut allocation: BoundAllocation,
    queue: &dyn DeferredReleaseQueue,
) -> Result<(), Rejected<BoundAllocation>> {
    let Some(held) = allocation.pin.take() else {
        return Err(Rejected { handle: allocation, reason: HandleError::StaleAllocation });
    };
    let pin = held.get();
    let (slot, parts) = (allocation.slot, allocation.parts());
    let record = match take(pin, slot, parts.generation) {
        Ok(record) => record,
        Err(refusal) => {
            let reason = refusal.reason(&pin.core);
            allocation.pin = Some(held);
            return Err(Rejected { handle: allocation, reason });
        }
    };
    // The queued release holds its own strong reference to the pin.
    match enqueue(&held.to_arc(), slot, &parts, queue) {
        Ok(()) => Ok(()),
        Err(reason) => {
            // Refused: the record is live again and the handle goes back.
            record.restore(parts.generation);
            allocation.pin = Some(held);
            Err(Rejected { handle: allocation, reason: HandleError::QueueRefused(reason) })
        }
    }
}

/// Builds the prepared release and offers it. The record stays in transit (counted in
/// flight) until the release is settled.
///
/// `Ok` when the queue took it (its completion settles the record, on whatever thread
/// the queue runs it), or when it refused with another release than the one offered:
/// then the offered release counts as lost by the queue (its block is quarantined and
/// its record freed exactly once, whoever gets there first). `Err` on an honest
/// refusal, with the record still in transit: the caller puts it back or quarantines
/// it.
fn enqueue(
    pin: &Arc<MechanismPin>,
    slot: u32,
    parts: &BlockInTransit,
    queue: &dyn DeferredReleaseQueue,
) -> Result<(), QueueRefusalReason> {
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
        // The registry may have disowned this release (its queue refused with another
        // one): then the books were settled already.
        if !withdrawn.0.claimed_by_completion() {
            return;
        }
        let pin = &*completion_pin;
        let Some(record) = pin.record(slot) else { return };
        let lost =
            matches!(&outcome, ReleaseOutcome::Failed(f) if matches!(f.error(), ReleaseError::DeviceLost { .. }));
        match settle(pin, slot, record, &completion_parts, outcome) {
            Settlement::Released(report) => {
                tracing::trace!(mechanism = %pin.core.identity, ?report, "deferred release ran")
            }
            // Nobody holds a handle any more: a lost block stays recorded (retired at
            // termination); any other refusal becomes a quarantine.
            Settlement::Refused(_) if lost => record.restore(completion_parts.generation),
            Settlement::Refused(error) => quarantine_in_transit(pin, slot, record, &completion_parts, *error),
        }
    });
    let releaser: Arc<dyn DeviceAllocator> = Arc::clone(&queued) as Arc<dyn DeviceAllocator>;
    let prepared = PreparedRelease::new(identity, releaser, parts.raw(core.device), completion);
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
        // The caller puts the record back or quarantines it; the record stays in
        // transit until then, so termination and removal never run with the block in
        // neither place.
        return Err(reason);
    }
    refused_with_another_release(pin, slot, parts, &queued, &reason);
    Ok(())
}

/// A queue refused with another release than the one offered: the offered one counts
/// as lost by the queue. Whoever claims it first settles its books (a completion that
/// already ran, or one that runs later, finds the claim taken and does nothing).
#[cold]
fn refused_with_another_release(
    pin: &MechanismPin,
    slot: u32,
    parts: &BlockInTransit,
    queued: &QueuedRelease,
    reason: &QueueRefusalReason,
) {
    tracing::error!(
        mechanism = %pin.core.identity,
        %reason,
        "deferred-release queue refused with another release than the one offered; the offered block counts as lost by the queue"
    );
    let withdrawn = queued.claim.load(Ordering::SeqCst) == WITHDRAWN;
    if (withdrawn || queued.claim.compare_exchange(QUEUED, DISOWNED, Ordering::SeqCst, Ordering::SeqCst).is_ok())
        && let Some(record) = pin.record(slot)
    {
        quarantine_in_transit(pin, slot, record, parts, ReleaseError::Abandoned);
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

/// Drop policy: see [`BoundAllocation`]. The host case (`Release`) runs the same
/// inlined path as an explicit release.
#[inline]
fn drop_release(held: &UnitRef<MechanismPin>, parts: BlockInTransit, slot: u32) {
    let pin = held.get();
    // Lost, terminated or stale: no callback; termination retires the record.
    let Ok(record) = take(pin, slot, parts.generation) else { return };
    match &pin.core.drop_policy {
        DropPolicy::Release => match call_release(pin, slot, record, &parts) {
            Some(ReleaseOutcome::Complete(_)) => {
                pin.free(slot, record);
                hot_trace(HotEvent::ReleaseOnDrop, &pin.core.identity, parts.bytes);
            }
            // Panicked while unwinding: quarantined and freed already.
            None => {}
            Some(outcome) => {
                // Nobody holds a handle any more: a refused drop-time release is
                // quarantined.
                if let Settlement::Refused(error) = settle(pin, slot, record, &parts, outcome) {
                    quarantine_in_transit(pin, slot, record, &parts, *error);
                }
            }
        },
        DropPolicy::Defer(queue) => drop_deferred(&held.to_arc(), slot, record, &parts, &**queue),
        // The device may still use the memory: nothing is freed.
        DropPolicy::Quarantine => quarantine_in_transit(pin, slot, record, &parts, ReleaseError::Abandoned),
    }
}

#[cold]
fn drop_deferred(
    pin: &Arc<MechanismPin>,
    slot: u32,
    record: &Record,
    parts: &BlockInTransit,
    queue: &dyn DeferredReleaseQueue,
) {
    if let Err(reason) = enqueue(pin, slot, parts, queue) {
        tracing::warn!(mechanism = %pin.core.identity, %reason, "drop-time deferred release refused");
        quarantine_in_transit(pin, slot, record, parts, ReleaseError::Abandoned);
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
