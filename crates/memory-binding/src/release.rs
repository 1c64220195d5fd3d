//! The release protocol, top to bottom: how an allocation's record is taken, its
//! allocator called and the outcome booked, for an explicit release, a deferred one and
//! a drop. The entry points are the handles' methods and `Drop` (`binding.rs`); the
//! records driven here are in `entry.rs` (`MechanismPin::announce`, `free`,
//! [`Record::restore`]).
//!
//! 1. [`take`]: announce the release by marking the record in transit, pass the Dekker
//!    point, and withdraw (restore the record) if the mechanism's state refuses (see
//!    [`crate::lifecycle`]). From here until it is freed or restored, the record in
//!    transit is the release's in-flight count.
//! 2. The allocator is called ([`call_release`]: a panic quarantines the block), or the
//!    release is handed to a queue ([`enqueue`]), whose completion comes back here on
//!    whatever thread runs it; [`QueuedRelease`]'s claim word makes sure its books are
//!    settled once.
//! 3. [`settle`] books the outcome (an explicit release books the common `Complete`
//!    in place): a complete release frees the record, a quarantine moves the block to
//!    the mechanism's list and then frees the record, a refusal leaves the record in
//!    transit for the caller, who puts it back when a handle returns
//!    ([`Record::restore`]) or quarantines the block when nobody holds one
//!    ([`quarantine_in_transit`]).
//! 4. A drop follows the mechanism's [`DropPolicy`] ([`drop_release`]): the same path as
//!    an explicit release, a deferred one, or a quarantine.

use std::num::NonZeroU64;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use memory_api::{
    AllocationIdentity, AllocationRequest, BindingIdentity, DeferredReleaseQueue, DeviceAddress, DeviceAllocator,
    DeviceKey, PreparedRelease, QueueRefusalReason, RawAllocation, ReleaseError, ReleaseOutcome, ReleaseSummary,
};

use crate::binding::{BoundAllocation, recognise, refusal_for};
use crate::entry::{DropPolicy, MechanismCore, MechanismPin, QuarantinedAllocation, Record};
use crate::error::{HandleError, Rejected};
use crate::hot_trace::{HotEvent, hot_trace};
use crate::lifecycle::{Admit, MechanismState};
use crate::sync::{Arc, AtomicU8, Ordering};
use crate::unit_ref::UnitRef;

/// The plain data of a handle whose block is in transit: kept while the block is away in
/// a release callback, to book the outcome or to hand the handle back.
#[derive(Copy, Clone)]
pub(crate) struct BlockInTransit {
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

impl BoundAllocation {
    /// The handle's plain data, for a release to carry.
    pub(crate) fn parts(&self) -> BlockInTransit {
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
pub(crate) fn release_now(allocation: &mut BoundAllocation) -> Result<ReleaseSummary, HandleError> {
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
            // The registry keeps its own copy of the block: an answer's tag is not
            // believed over the one the allocator gave at allocation.
            let entry = if raw.same_block(&expected) {
                parts.quarantined(core, expected, unmapped, residual, error)
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
pub(crate) fn release_deferred(
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
    let withdrawn = WithdrawOnDrop { queued: Arc::clone(&queued), pin: Arc::clone(pin), slot, parts: *parts };
    let completion = Box::new(move |outcome: ReleaseOutcome| {
        // The registry may have disowned this release (its queue refused with another
        // one): then the books were settled already.
        if !withdrawn.queued.claimed_by_completion() {
            return;
        }
        let (pin, completion_parts) = (&*withdrawn.pin, withdrawn.parts);
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
        Ok(()) => {
            // Accepted: a withdrawal from now on is booked where the completion drops
            // uncalled. One the queue made during the call itself is booked here.
            if queued.claim.compare_exchange(QUEUED, ACCEPTED, Ordering::SeqCst, Ordering::SeqCst).is_err()
                && queued.claim.load(Ordering::SeqCst) == WITHDRAWN
            {
                withdrawn_unbooked(pin, slot, parts);
            }
            return Ok(());
        }
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

/// A release the queue withdrew (`cancel`) after it had accepted it: nobody will hand
/// the block back, so it is kept as abandoned and the record freed (termination hands
/// it to `forget_lost`), and the in-flight count ends.
#[cold]
fn withdrawn_unbooked(pin: &MechanismPin, slot: u32, parts: &BlockInTransit) {
    tracing::error!(
        mechanism = %pin.core.identity,
        "deferred-release queue withdrew a release it had accepted; the block counts as abandoned by the queue"
    );
    if let Some(record) = pin.record(slot) {
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
/// The queue accepted it (its `enqueue` returned `Ok`) and nothing else claimed it yet:
/// as `QUEUED`, except that a withdrawal now is booked by the withdrawal itself.
const ACCEPTED: u8 = 5;

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
        self.claim.load(Ordering::SeqCst) == RUNNING || self.claim_from_queued(COMPLETED)
    }

    /// Moves the claim from `QUEUED` or `ACCEPTED` to `to`; whether it did.
    fn claim_from_queued(&self, to: u8) -> bool {
        [QUEUED, ACCEPTED]
            .into_iter()
            .any(|from| self.claim.compare_exchange(from, to, Ordering::SeqCst, Ordering::SeqCst).is_ok())
    }
}

/// Held by a queued release's completion, with what the completion books: dropped
/// uncalled (the release was withdrawn), it marks the claim so the refusal's receiver
/// knows the completion will never run; withdrawn after the queue accepted it, it books
/// the block as abandoned itself.
struct WithdrawOnDrop {
    queued: Arc<QueuedRelease>,
    pin: Arc<MechanismPin>,
    slot: u32,
    parts: BlockInTransit,
}

impl Drop for WithdrawOnDrop {
    fn drop(&mut self) {
        let claim = &self.queued.claim;
        if claim.compare_exchange(QUEUED, WITHDRAWN, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            // Offered and not yet accepted: `enqueue` books it (refusal or acceptance).
            return;
        }
        if claim.compare_exchange(ACCEPTED, WITHDRAWN, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            withdrawn_unbooked(&self.pin, self.slot, &self.parts);
        }
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
        if !self.claim_from_queued(RUNNING) {
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
pub(crate) fn drop_release(held: &UnitRef<MechanismPin>, parts: BlockInTransit, slot: u32) {
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
