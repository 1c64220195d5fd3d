//! What the registry stores: context and authority entries, the shared mechanism core,
//! the per-thread pins that hold allocation records, and the per-thread anchors that
//! bindings hold.
//!
//! Ownership (no cycles; arrows are `Arc`s):
//!
//! ```text
//! registry ──▶ Mechanism ──▶ anchors (one per thread) ──▶ PinTable ──▶ pins (one per thread) ──▶ MechanismCore
//! MemoryBinding ──▶ its binder's Anchor ──▶ PinTable          BoundAllocation ──▶ its allocator's MechanismPin ──▶ MechanismCore
//! ```
//!
//! A binding reaches the calling thread's pin through the table, so whichever thread
//! made it, an allocation is recorded in the *allocating* thread's pin; the handle
//! holds that pin, whose refcount line only that thread writes when it also releases.
//! Every handle keeps the allocator, authority and context alive on its own, even
//! after the registry is dropped, and nothing outlives the last handle.

use std::any::Any;
use std::num::NonZeroU64;
use std::sync::OnceLock;

use memory_api::{
    AllocationGeneration, AuthorityIdentity, BindingGeneration, BindingId, DeferredReleaseQueue, DeviceAddress,
    DeviceAllocator, DeviceKey, Identity, IdentityError, IdentityIssuer, MechanismIdentity, ProviderContextIdentity,
    RawAllocation, ReleaseError,
};

use crate::lifecycle::{ContextState, InFlightSlot, Lifecycle};
use crate::sync::{Arc, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, CachePadded, Mutex, Ordering, lock};
use crate::sync::{FreeLink, NO_SLOT, OwnerSlots, PerThread, thread_index};
use crate::unit_ref::{UnitHolder, Units, orphan, take_unit_share};

/// An opaque resource pinned by a context or authority (a CUDA context owner, a
/// tenant account). Its destructor runs when the last handle pinning it is gone.
pub type Resource = Arc<dyn Any + Send + Sync>;

/// A registered provider context.
pub(crate) struct ContextEntry {
    pub(crate) identity: ProviderContextIdentity,
    pub(crate) device: DeviceKey,
    state: AtomicU8,
    pub(crate) resource: Resource,
}

impl ContextEntry {
    pub(crate) fn new(identity: ProviderContextIdentity, device: DeviceKey, resource: Resource) -> ContextEntry {
        ContextEntry { identity, device, state: AtomicU8::new(0), resource }
    }

    pub(crate) fn state(&self) -> ContextState {
        match self.state.load(Ordering::SeqCst) {
            0 => ContextState::Live,
            1 => ContextState::Lost,
            _ => ContextState::Terminated,
        }
    }

    pub(crate) fn set_state(&self, state: ContextState) {
        // Declaration order: live 0, lost 1, terminated 2, as `state` decodes.
        self.state.store(state as u8, Ordering::SeqCst);
    }
}

/// A registered authority.
pub(crate) struct AuthorityEntry {
    pub(crate) identity: AuthorityIdentity,
    pub(crate) device: DeviceKey,
    pub(crate) resource: Resource,
}

/// What dropping a live [`BoundAllocation`](crate::BoundAllocation) does.
#[derive(Clone)]
#[non_exhaustive]
pub enum DropPolicy {
    /// Release through the allocator at once (host memory, or an allocator whose
    /// release is itself stream-ordered and therefore safe at any time).
    Release,
    /// Hand the release to a deferred queue (free after the device is done with it).
    Defer(Arc<dyn DeferredReleaseQueue>),
    /// Do not free: quarantine the block with a warning, since the device may still
    /// be using it. The bytes stay visible until a retry or termination.
    Quarantine,
}

impl DropPolicy {
    /// The default for a device: immediate release for host memory, quarantine for
    /// everything else.
    pub fn default_for(device: DeviceKey) -> DropPolicy {
        match device.tier() {
            memory_api::Tier::Host => DropPolicy::Release,
            _ => DropPolicy::Quarantine,
        }
    }
}

impl std::fmt::Debug for DropPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DropPolicy::Release => "Release",
            DropPolicy::Defer(_) => "Defer",
            DropPolicy::Quarantine => "Quarantine",
        })
    }
}

/// One quarantined block: partly released, abandoned, or reported impossibly.
pub(crate) struct QuarantinedAllocation {
    pub(crate) generation: AllocationGeneration,
    pub(crate) binding: BindingId,
    pub(crate) allocation: RawAllocation,
    pub(crate) unmapped_bytes: usize,
    pub(crate) residual_bytes: usize,
    pub(crate) error: ReleaseError,
}

/// The shared part of a mechanism: read by every handle, written only on the cold path.
pub(crate) struct MechanismCore {
    // Declaration order is drop order: allocator, then authority, then context.
    pub(crate) allocator: Arc<dyn DeviceAllocator>,
    pub(crate) authority: Arc<AuthorityEntry>,
    pub(crate) context: Arc<ContextEntry>,
    pub(crate) identity: MechanismIdentity,
    pub(crate) device: DeviceKey,
    /// Generation of bindings made through `bind_registered`.
    pub(crate) registered_generation: BindingGeneration,
    pub(crate) issuer: Arc<IdentityIssuer>,
    pub(crate) lifecycle: Lifecycle,
    pub(crate) lost_reason: OnceLock<String>,
    pub(crate) drop_policy: DropPolicy,
    /// The allocator's name, read once at registration: messages and snapshots need it
    /// also after the device is lost, when no allocator callback may run.
    pub(crate) allocator_name: String,
    /// Registered through `register_trusted_composite`: its capability objects may live
    /// outside the allocator's value.
    pub(crate) trusted_composite: bool,
    quarantine: Mutex<Vec<QuarantinedAllocation>>,
    /// Blocks the allocator holds that have no record (unfit, or no identity left):
    /// answered after the device was lost (no callback may give them back), or refused
    /// back by the allocator. They count as live and wait here for `forget_lost` at
    /// termination.
    unrecorded: Mutex<Vec<RawAllocation>>,
    quarantined: AtomicUsize,
    /// Release answers the registry did not believe (corrected and traced).
    dishonest_outcomes: AtomicUsize,
    /// Live [`CallerHold`](crate::CallerHold)s: foreign callers that may still call.
    pub(crate) caller_holds: AtomicUsize,
}

impl MechanismCore {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        identity: MechanismIdentity,
        allocator: Arc<dyn DeviceAllocator>,
        context: Arc<ContextEntry>,
        authority: Arc<AuthorityEntry>,
        registered_generation: BindingGeneration,
        issuer: Arc<IdentityIssuer>,
        drop_policy: DropPolicy,
        allocator_name: String,
        trusted_composite: bool,
    ) -> MechanismCore {
        MechanismCore {
            device: context.device,
            allocator,
            authority,
            context,
            identity,
            registered_generation,
            issuer,
            lifecycle: Lifecycle::new(),
            lost_reason: OnceLock::new(),
            drop_policy,
            allocator_name,
            trusted_composite,
            quarantine: Mutex::new(Vec::new()),
            unrecorded: Mutex::new(Vec::new()),
            quarantined: AtomicUsize::new(0),
            dishonest_outcomes: AtomicUsize::new(0),
            caller_holds: AtomicUsize::new(0),
        }
    }

    pub(crate) fn lost_reason(&self) -> String {
        self.lost_reason.get().cloned().unwrap_or_else(|| "device invalidated".to_owned())
    }

    /// Adds a quarantined block (warns: quarantined memory is owned but unusable).
    pub(crate) fn quarantine(&self, entry: QuarantinedAllocation) {
        tracing::warn!(
            mechanism = %self.identity,
            generation = %entry.generation,
            bytes = entry.allocation.bytes(),
            unmapped = entry.unmapped_bytes,
            residual = entry.residual_bytes,
            error = %entry.error,
            "allocation quarantined"
        );
        if matches!(entry.error, ReleaseError::DishonestOutcome { .. }) {
            self.count_dishonest_outcome();
            tracing::error!(mechanism = %self.identity, error = %entry.error, "allocator reported an impossible release outcome");
        }
        let mut list = lock(&self.quarantine);
        list.push(entry);
        self.quarantined.store(list.len(), Ordering::SeqCst);
    }

    /// Takes every quarantined block out (to retry or to discharge).
    pub(crate) fn take_quarantine(&self) -> Vec<QuarantinedAllocation> {
        let mut list = lock(&self.quarantine);
        self.quarantined.store(0, Ordering::SeqCst);
        std::mem::take(&mut *list)
    }

    /// Puts blocks back after a retry that did not discharge them.
    pub(crate) fn restore_quarantine(&self, entries: Vec<QuarantinedAllocation>) {
        let mut list = lock(&self.quarantine);
        list.extend(entries);
        self.quarantined.store(list.len(), Ordering::SeqCst);
    }

    /// Counts a release answer the registry corrected (shown in snapshots).
    pub(crate) fn count_dishonest_outcome(&self) {
        self.dishonest_outcomes.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn dishonest_outcomes(&self) -> usize {
        self.dishonest_outcomes.load(Ordering::Relaxed)
    }

    /// What a `Complete` release of a `bytes`-byte block reports: the unmapped bytes
    /// the allocator claims, unless it claims more than the block, which is dishonest
    /// (traced, counted, and reported as the block's size).
    #[inline]
    pub(crate) fn completed(&self, bytes: usize, claimed_unmapped: usize) -> usize {
        if claimed_unmapped <= bytes { claimed_unmapped } else { self.overclaimed(bytes, claimed_unmapped) }
    }

    #[cold]
    fn overclaimed(&self, bytes: usize, claimed_unmapped: usize) -> usize {
        self.count_dishonest_outcome();
        tracing::error!(
            mechanism = %self.identity,
            claimed_unmapped,
            allocation_bytes = bytes,
            "allocator reported a complete release unmapping more than the block; counting the block's size"
        );
        bytes
    }

    pub(crate) fn quarantined_count(&self) -> usize {
        self.quarantined.load(Ordering::SeqCst)
    }

    /// Keeps a block the allocator still holds that has no record: answered after
    /// device loss, or one the registry would not record and the allocator would not
    /// take back (see `unrecorded`).
    pub(crate) fn keep_unrecorded(&self, block: RawAllocation) {
        lock(&self.unrecorded).push(block);
    }

    /// Takes the unrecorded blocks out (termination hands them to `forget_lost`).
    pub(crate) fn take_unrecorded(&self) -> Vec<RawAllocation> {
        std::mem::take(&mut *lock(&self.unrecorded))
    }

    /// Unrecorded blocks and their bytes.
    pub(crate) fn unrecorded(&self) -> (usize, usize) {
        let blocks = lock(&self.unrecorded);
        // Sizes are the allocator's word: saturate rather than overflow.
        (blocks.len(), blocks.iter().map(RawAllocation::bytes).fold(0, usize::saturating_add))
    }

    /// Calls `f` on every quarantined block (snapshots, lookups).
    pub(crate) fn with_quarantine<R>(&self, f: impl FnOnce(&[QuarantinedAllocation]) -> R) -> R {
        f(&lock(&self.quarantine))
    }
}

/// A registered mechanism as the registry holds it: the pin table, and one anchor per
/// thread for the bindings that thread makes.
pub(crate) struct Mechanism {
    pub(crate) core: Arc<MechanismCore>,
    pub(crate) table: Arc<PinTable>,
    anchors: PerThread<Arc<Anchor>>,
}

impl Mechanism {
    pub(crate) fn new(core: MechanismCore) -> Mechanism {
        let core = Arc::new(core);
        Mechanism { table: Arc::new(PinTable::new(Arc::clone(&core))), core, anchors: PerThread::new() }
    }

    /// The calling thread's anchor (created on first use, then reused: no allocation).
    #[inline]
    pub(crate) fn anchor(&self) -> &Arc<Anchor> {
        let index = thread_index();
        self.anchors.get_or(index, || {
            let anchor = Arc::new(Anchor::new(Arc::clone(&self.table), index));
            take_unit_share(&anchor);
            anchor
        })
    }

    /// Every pin ever created for this mechanism.
    pub(crate) fn pins(&self) -> impl Iterator<Item = &Arc<MechanismPin>> {
        self.table.pins.iter()
    }

    /// Live allocations, their bytes, and operations in flight (counted in slots,
    /// and releases whose record is in transit), from one pass over every record
    /// after the cold side of the Dekker barrier. One pass matters: a release that
    /// keeps being refused moves its record between live and in transit, and two
    /// separate scans could each see it as the other.
    pub(crate) fn census(&self) -> Census {
        let slots = self.core.lifecycle.in_flight(self.pins().map(|pin| &pin.in_flight));
        // Blocks the allocator holds without a record count as live.
        let (live, live_bytes) = self.core.unrecorded();
        let mut census = Census { live, live_bytes, in_flight: slots };
        for pin in self.pins() {
            pin.count_into(&mut census);
        }
        census
    }
}

impl Drop for Mechanism {
    /// The registry no longer holds this mechanism: nobody can bind through its anchors
    /// any more, so from now on their bindings keep them alive, and the last one frees
    /// each (see `unit_ref`).
    fn drop(&mut self) {
        for anchor in self.anchors.iter() {
            orphan(anchor);
        }
    }
}

/// What [`Mechanism::census`] counted.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Census {
    pub(crate) live: usize,
    pub(crate) live_bytes: usize,
    pub(crate) in_flight: usize,
}

/// The per-thread pins of one mechanism. Bindings reach it through their anchor and
/// pick the calling thread's pin; it is read-only on the hot path.
pub(crate) struct PinTable {
    pub(crate) core: Arc<MechanismCore>,
    pins: PerThread<Arc<MechanismPin>>,
}

impl PinTable {
    fn new(core: Arc<MechanismCore>) -> PinTable {
        PinTable { core, pins: PerThread::new() }
    }

    /// The calling thread's pin (created on first use: one heap allocation per thread
    /// and mechanism, then reused).
    #[inline]
    pub(crate) fn pin(&self) -> &Arc<MechanismPin> {
        let index = thread_index();
        self.pins.get_or(index, || {
            let pin = Arc::new(MechanismPin::new(Arc::clone(&self.core), index));
            take_unit_share(&pin);
            pin
        })
    }
}

impl Drop for PinTable {
    /// Nobody can allocate on these pins any more: from now on their handles keep
    /// them alive, and the last one frees each (see `unit_ref`).
    fn drop(&mut self) {
        for pin in self.pins.iter() {
            orphan(pin);
        }
    }
}

/// What a [`MemoryBinding`](crate::MemoryBinding) holds: a per-thread strong reference
/// to the pin table, so binding and cloning bindings write only the binder's line.
/// Aligned to two cache lines so anchors of different threads never share one.
#[repr(align(128))]
pub(crate) struct Anchor {
    /// The mechanism, one hop closer than through the table: `bind` and every
    /// allocation read it first.
    pub(crate) core: Arc<MechanismCore>,
    pub(crate) table: Arc<PinTable>,
    binding_ids: OwnerBlock,
    /// What keeps the anchor alive for its bindings once its mechanism is gone; also
    /// names the thread whose anchor this is, the only one that mints from it.
    units: Units,
}

impl UnitHolder for Anchor {
    #[inline]
    fn units(&self) -> &Units {
        &self.units
    }
}

impl Anchor {
    fn new(table: Arc<PinTable>, owner: usize) -> Anchor {
        let core = Arc::clone(&table.core);
        let barrier = core.lifecycle.barrier();
        Anchor { core, table, binding_ids: OwnerBlock::new(), units: Units::new(owner, barrier) }
    }

    /// Mints a binding id serial from this anchor's block (owner thread only).
    #[inline]
    pub(crate) fn next_binding_id(&self) -> Result<NonZeroU64, IdentityError> {
        self.binding_ids.next::<BindingId>(&self.core.issuer)
    }
}

/// How many identities a pin or anchor reserves from the shared counters at a time.
const IDENTITY_BLOCK: u64 = 256;

/// A run of identity serials reserved from the issuer, used by one thread only
/// (plain loads and stores: the atomics only make the type shareable).
struct OwnerBlock {
    next: AtomicU64,
    end: AtomicU64,
}

impl OwnerBlock {
    fn new() -> OwnerBlock {
        OwnerBlock { next: AtomicU64::new(1), end: AtomicU64::new(1) }
    }

    #[inline]
    fn next<I: Identity>(&self, issuer: &IdentityIssuer) -> Result<NonZeroU64, IdentityError> {
        let next = self.next.load(Ordering::Relaxed);
        // Serials start at 1: never zero.
        if next < self.end.load(Ordering::Relaxed)
            && let Some(serial) = NonZeroU64::new(next)
        {
            self.next.store(next + 1, Ordering::Relaxed);
            return Ok(serial);
        }
        self.refill::<I>(issuer)
    }

    #[cold]
    #[inline(never)]
    fn refill<I: Identity>(&self, issuer: &IdentityIssuer) -> Result<NonZeroU64, IdentityError> {
        let mut block = issuer.block::<I>(IDENTITY_BLOCK)?;
        let first = block.next().ok_or(IdentityError::RegistriesExhausted)?.serial();
        let next = first.get() + 1;
        self.next.store(next, Ordering::Relaxed);
        self.end.store(next + block.remaining(), Ordering::Relaxed);
        Ok(first)
    }
}

/// A record's state word: free, live under its generation, or live and in transit
/// (a release of it is under way: the announcement of the Dekker protocol).
const FREE: u64 = 0;
const IN_TRANSIT: u64 = 1 << 63;

/// One allocation record. Every field is an atomic so a remote thread can reach it
/// without a lock; the fields are written before the `Release` store of the state
/// word that publishes them, and read after an `Acquire` load of it.
pub(crate) struct Record {
    state: AtomicU64,
    address: AtomicU64,
    bytes: AtomicUsize,
    provider_tag: AtomicU64,
    /// The slot table's link while the record is free.
    next_free: AtomicU32,
    align_log2: AtomicU8,
}

impl FreeLink for Record {
    #[inline]
    fn free_link(&self) -> &AtomicU32 {
        &self.next_free
    }
}

// Registry memory per live allocation (issue 3 budget: 64 bytes beyond the handle).
const _: () = assert!(std::mem::size_of::<Record>() <= 64);

impl Default for Record {
    fn default() -> Record {
        Record {
            state: AtomicU64::new(FREE),
            address: AtomicU64::new(0),
            bytes: AtomicUsize::new(0),
            provider_tag: AtomicU64::new(0),
            next_free: AtomicU32::new(NO_SLOT),
            align_log2: AtomicU8::new(0),
        }
    }
}

impl Record {
    /// Whether this record is live under `generation` (not in transit).
    #[inline]
    fn holds(&self, generation: NonZeroU64) -> bool {
        self.state.load(Ordering::Acquire) == generation.get()
    }

    /// The block this record describes.
    fn block(&self, device: DeviceKey) -> Option<RawAllocation> {
        let address = DeviceAddress::new(self.address.load(Ordering::Relaxed))?;
        let align = 1usize << self.align_log2.load(Ordering::Relaxed);
        let bytes = self.bytes.load(Ordering::Relaxed);
        Some(RawAllocation::new(address, bytes, align, device, self.provider_tag.load(Ordering::Relaxed)))
    }

    /// Puts a record that was in transit back as live (a refused release).
    #[inline]
    pub(crate) fn restore(&self, generation: NonZeroU64) {
        self.state.store(generation.get(), Ordering::Release);
    }
}

/// A per-thread copy of a mechanism entry: the records of the allocations made on
/// its thread, that thread's in-flight slot and generation block, and the stack where
/// other threads return the slots they release.
///
/// - Insert and slot reuse are the owner's alone (single writer: plain loads and
///   stores on the owner's line).
/// - A release from any thread marks the record in transit, then frees it with a
///   `Release` store of its state word and gives the slot back: the owner onto its own
///   free list, any other thread onto the remote stack (a CAS push), which the owner
///   takes whole with one swap when its own list is empty
///   ([`OwnerSlots`], shared with the plugin loader's block records).
/// - Records live in segments that never move, so a remote thread reaches one without
///   a lock.
///
/// Aligned to two cache lines, like every part that one thread writes, so that pins of
/// different threads never share a line.
#[repr(align(128))]
pub(crate) struct MechanismPin {
    pub(crate) core: Arc<MechanismCore>,
    /// The records, in slots that only this pin's thread hands out.
    slots: OwnerSlots<Record>,
    /// What keeps the pin alive for its handles once its table is gone; also names the
    /// thread index that owns this pin (fixed: a recycled index inherits the pin).
    pub(crate) units: Units,
    pub(crate) in_flight: InFlightSlot,
    generations: CachePadded<OwnerBlock>,
}

impl UnitHolder for MechanismPin {
    #[inline]
    fn units(&self) -> &Units {
        &self.units
    }
}

impl MechanismPin {
    pub(crate) fn new(core: Arc<MechanismCore>, owner: usize) -> MechanismPin {
        let barrier = core.lifecycle.barrier();
        MechanismPin {
            core,
            slots: OwnerSlots::new(),
            units: Units::new(owner, barrier),
            in_flight: InFlightSlot::default(),
            generations: CachePadded::new(OwnerBlock::new()),
        }
    }

    /// The record at `slot`, if its segment exists.
    #[inline]
    pub(crate) fn record(&self, slot: u32) -> Option<&Record> {
        self.slots.get(slot)
    }

    /// Whether the calling thread owns this pin.
    #[inline]
    pub(crate) fn owned_here(&self) -> bool {
        self.units.owned_here()
    }

    /// Records a new allocation (owner thread only); returns its slot and generation.
    ///
    /// # Errors
    /// Generation exhaustion, or more live records on this pin than a `u32` slot can
    /// name.
    #[inline]
    pub(crate) fn insert(
        &self,
        address: DeviceAddress,
        bytes: usize,
        align_log2: u8,
        provider_tag: u64,
    ) -> Result<(u32, NonZeroU64), IdentityError> {
        let generation = self.generations.next::<AllocationGeneration>(&self.core.issuer)?;
        if generation.get() & IN_TRANSIT != 0 {
            return Err(IdentityError::RegistriesExhausted);
        }
        let (slot, record) = self.slots.claim().ok_or(IdentityError::RegistriesExhausted)?;
        record.address.store(address.get(), Ordering::Relaxed);
        record.bytes.store(bytes, Ordering::Relaxed);
        record.provider_tag.store(provider_tag, Ordering::Relaxed);
        record.align_log2.store(align_log2, Ordering::Relaxed);
        record.state.store(generation.get(), Ordering::Release);
        Ok((slot, generation))
    }

    /// Announces a release of the record at `slot`: marks it in transit if it is live
    /// under `generation`. `None` for a stale key. The caller then passes the Dekker
    /// point ([`Lifecycle::admit_announced`]) and either finishes ([`MechanismPin::free`]) or
    /// withdraws ([`Record::restore`]).
    ///
    /// Exactly once: a record is announced only through the one handle that carries
    /// its generation (handles are neither `Clone` nor `Copy`, and a release consumes
    /// the handle); generations are never reused, so a stale handle never matches a
    /// reused slot; and the termination sweep, the only other writer of a live record,
    /// runs only once no record is in transit and no release can be admitted.
    #[inline]
    pub(crate) fn announce(&self, slot: u32, generation: NonZeroU64) -> Option<&Record> {
        let record = self.record(slot)?;
        if !record.holds(generation) {
            return None;
        }
        record.state.store(generation.get() | IN_TRANSIT, Ordering::Relaxed);
        Some(record)
    }

    /// Frees a record in transit (its release is settled) and returns its slot.
    #[inline]
    pub(crate) fn free(&self, slot: u32, record: &Record) {
        self.free_known(slot, record, self.owned_here());
    }

    /// [`MechanismPin::free`] when the caller already asked [`MechanismPin::owned_here`].
    #[inline]
    pub(crate) fn free_known(&self, slot: u32, record: &Record, owned_here: bool) {
        record.state.store(FREE, Ordering::Release);
        self.slots.give_back(slot, record, owned_here);
    }

    /// Whether the record at `slot` is live under `generation` (the caller checks the
    /// mechanism is not terminated).
    pub(crate) fn holds(&self, slot: u32, generation: NonZeroU64) -> bool {
        self.record(slot).is_some_and(|record| record.holds(generation))
    }

    /// Every record that exists (cold path).
    fn records(&self) -> impl Iterator<Item = &Record> {
        self.slots.iter()
    }

    /// Whether any record is live under `generation` (cold path: a scan; none once
    /// terminated).
    pub(crate) fn find(&self, generation: NonZeroU64) -> bool {
        !self.retired() && self.records().any(|record| record.holds(generation))
    }

    /// Adds this pin's live records, their bytes and its records in transit to
    /// `census` (cold path). Once terminated, no record is live.
    fn count_into(&self, census: &mut Census) {
        let retired = self.retired();
        for record in self.records() {
            // The state word decides where the record counts, from one read. The bytes
            // are read after it and kept if the generation is still the same one (the
            // record may go in and out of transit meanwhile, and stays counted); a record
            // freed or reused meanwhile is read again.
            let mut state = record.state.load(Ordering::Acquire);
            loop {
                if state == FREE {
                    break;
                }
                if state & IN_TRANSIT != 0 {
                    census.in_flight += 1;
                    break;
                }
                if retired {
                    break;
                }
                let bytes = record.bytes.load(Ordering::Relaxed);
                crate::sync::fence(Ordering::Acquire);
                let again = record.state.load(Ordering::Relaxed);
                if again & !IN_TRANSIT == state {
                    census.live += 1;
                    // Sizes are the allocator's word: saturate rather than overflow.
                    census.live_bytes = census.live_bytes.saturating_add(bytes);
                    break;
                }
                state = again;
            }
        }
    }

    /// Live records and their bytes (none once terminated).
    #[cfg(all(test, memory_loom))]
    fn live(&self) -> (usize, usize) {
        let mut census = Census::default();
        self.count_into(&mut census);
        (census.live, census.live_bytes)
    }

    /// Records in transit now (cold path, after the Dekker barrier).
    #[cfg(all(test, memory_loom))]
    fn in_transit(&self) -> usize {
        let mut census = Census::default();
        self.count_into(&mut census);
        census.in_flight
    }

    /// The blocks of every live record (the termination sweep; the mechanism is
    /// `Terminated`, so it admits nothing and no record will be used again).
    ///
    /// The sweep reads and does not write: a release refused by the termination may
    /// still be withdrawing (its announcement and its withdrawal are plain stores), so
    /// a record in transit here is one being put back, and counts as live. Once the
    /// mechanism is terminated every record reads as retired (`live`, `find`).
    pub(crate) fn collect_lost(&self) -> Vec<RawAllocation> {
        self.records()
            .filter(|record| record.state.load(Ordering::Acquire) != FREE)
            .filter_map(|record| record.block(self.core.device))
            .collect()
    }

    /// Whether the mechanism's records are retired (terminated).
    fn retired(&self) -> bool {
        self.core.lifecycle.state() == crate::lifecycle::MechanismState::Terminated
    }
}

/// loom models of the record protocol (`cargo xtask loom`).
#[cfg(all(test, memory_loom))]
mod loom_records {
    use super::*;
    use crate::lifecycle::{Admit, MechanismState};
    use memory_api::{AllocError, AllocationRequest, ReleaseOutcome};

    struct Unused;
    impl DeviceAllocator for Unused {
        fn device(&self) -> DeviceKey {
            DeviceKey::HOST
        }
        fn name(&self) -> &str {
            "unused"
        }
        fn allocate(&self, _: &AllocationRequest) -> Result<RawAllocation, AllocError> {
            Err(AllocError::Unsupported { allocator: "unused".into(), device: DeviceKey::HOST, what: "allocation" })
        }
        fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
            ReleaseOutcome::complete(allocation.bytes())
        }
    }

    fn core() -> Arc<MechanismCore> {
        let issuer = Arc::new(IdentityIssuer::new().unwrap());
        let context = Arc::new(ContextEntry::new(issuer.provider_context().unwrap(), DeviceKey::HOST, Arc::new(())));
        let authority = Arc::new(AuthorityEntry {
            identity: issuer.authority().unwrap(),
            device: DeviceKey::HOST,
            resource: Arc::new(()),
        });
        Arc::new(MechanismCore::new(
            issuer.mechanism().unwrap(),
            Arc::new(Unused),
            context,
            authority,
            issuer.binding_generation().unwrap(),
            Arc::clone(&issuer),
            DropPolicy::Release,
            "unused".to_owned(),
            false,
        ))
    }

    /// A pin owned by the calling (model) thread.
    fn pin() -> Arc<MechanismPin> {
        Arc::new(MechanismPin::new(core(), thread_index()))
    }

    fn insert(pin: &MechanismPin) -> (u32, NonZeroU64) {
        pin.insert(DeviceAddress::new(0x1000).unwrap(), 64, 3, 0).unwrap()
    }

    /// The whole release protocol as `release.rs` runs it: announce, Dekker point,
    /// then free (or withdraw when the state refuses). Returns whether it released.
    fn release(pin: &MechanismPin, slot: u32, generation: NonZeroU64) -> bool {
        let Some(record) = pin.announce(slot, generation) else { return false };
        match pin.core.lifecycle.admit_announced(Admit::ActiveOrRetired) {
            Ok(()) => {
                pin.free(slot, record);
                true
            }
            Err(_) => {
                record.restore(generation);
                false
            }
        }
    }

    /// A release on another thread racing the owner, which allocates meanwhile and
    /// afterwards: the slot comes back to the owner through the remote stack, is
    /// reused under a new generation, and the old key never takes the new record.
    #[test]
    fn loom_remote_release_and_owner_reuse() {
        loom::model(|| {
            let pin = pin();
            let (slot, generation) = insert(&pin);
            let remote = {
                let pin = Arc::clone(&pin);
                loom::thread::spawn(move || release(&pin, slot, generation))
            };
            let (second, second_generation) = insert(&pin);
            assert!(remote.join().unwrap(), "a live record is released from any thread");
            let (third, third_generation) = insert(&pin);
            assert_ne!(second, third, "two live records never share a slot");
            assert!(third_generation != generation && third_generation != second_generation);
            assert!(!release(&pin, slot, generation), "a stale key takes nothing");
            assert_eq!(pin.live().0, 2);
            assert!(release(&pin, second, second_generation) && release(&pin, third, third_generation));
            assert_eq!(pin.live(), (0, 0));
        });
    }

    /// Two remote threads freeing onto one stack while the owner takes it whole: no
    /// slot is lost or handed out twice.
    #[test]
    fn loom_remote_frees_and_the_owners_take_all_lose_nothing() {
        loom::model(|| {
            let pin = pin();
            let keys = [insert(&pin), insert(&pin)];
            let remotes: Vec<_> = keys
                .into_iter()
                .map(|(slot, generation)| {
                    let pin = Arc::clone(&pin);
                    loom::thread::spawn(move || assert!(release(&pin, slot, generation)))
                })
                .collect();
            // The owner allocates while the frees land: a fresh slot or a freed one.
            let during = insert(&pin);
            for remote in remotes {
                remote.join().unwrap();
            }
            let after = [insert(&pin), insert(&pin)];
            let mut slots = vec![during.0, after[0].0, after[1].0];
            slots.sort_unstable();
            slots.dedup();
            assert_eq!(slots.len(), 3, "a slot was handed out twice");
            assert!(slots.iter().all(|&slot| slot < 4), "freed slots were lost (the pin grew)");
            assert_eq!(pin.live().0, 3);
        });
    }

    /// A release racing invalidation and the termination sweep: the block is released
    /// by exactly one of them, no release callback runs once termination is
    /// confirmed, and a release refused meanwhile never brings a swept record back.
    #[test]
    fn loom_release_racing_termination_sweep_is_exactly_once() {
        loom::model(|| {
            let pin = pin();
            let (slot, generation) = insert(&pin);
            let terminated = Arc::new(loom::sync::atomic::AtomicBool::new(false));
            let releaser = {
                let (pin, terminated) = (Arc::clone(&pin), Arc::clone(&terminated));
                loom::thread::spawn(move || {
                    let Some(record) = pin.announce(slot, generation) else { return false };
                    match pin.core.lifecycle.admit_announced(Admit::ActiveOrRetired) {
                        Ok(()) => {
                            // The allocator's release callback.
                            assert!(!terminated.load(Ordering::SeqCst), "callback ran after termination");
                            pin.free(slot, record);
                            true
                        }
                        Err(_) => {
                            record.restore(generation);
                            false
                        }
                    }
                })
            };
            let life = &pin.core.lifecycle;
            life.transition(&[MechanismState::Active], MechanismState::DeviceLost).unwrap();
            // `confirm_context_terminated`: barrier, count, terminate and sweep at zero.
            let confirm = || {
                life.quiesce_barrier();
                if pin.in_transit() > 0 || pin.in_flight.load() > 0 {
                    return None;
                }
                life.transition(&[MechanismState::DeviceLost], MechanismState::Terminated).unwrap();
                terminated.store(true, Ordering::SeqCst);
                Some(pin.collect_lost().len())
            };
            let first = confirm();
            let released = releaser.join().unwrap();
            // The caller polls: once the release is done, confirmation succeeds.
            let swept = first.unwrap_or_else(|| confirm().expect("quiescent once the release is done"));
            assert_eq!(usize::from(released) + swept, 1, "released {released}, swept {swept}");
            assert_eq!(pin.live(), (0, 0));
            assert!(!pin.find(generation));
        });
    }

    /// `remove` racing a release that the allocator keeps refusing (the record goes
    /// live → in transit → live, twice): the census after closing the mechanism always
    /// sees the record, as live or as in flight, so removal never succeeds under it.
    #[test]
    fn loom_remove_census_never_misses_a_record_flipping_in_transit() {
        loom::model(|| {
            let pin = pin();
            let life = &pin.core.lifecycle;
            life.transition(&[MechanismState::Active], MechanismState::Retired).unwrap();
            let (slot, generation) = insert(&pin);
            let releaser = {
                let pin = Arc::clone(&pin);
                loom::thread::spawn(move || {
                    for _ in 0..2 {
                        let record = pin.announce(slot, generation).expect("the record stays live");
                        // Admitted or not (`remove` is counting), the allocator refuses:
                        // the record is put back either way.
                        let _ = pin.core.lifecycle.admit_announced(Admit::ActiveOrRetired);
                        record.restore(generation);
                    }
                })
            };
            let closed = life.transition(&[MechanismState::Retired], MechanismState::Removing).is_ok();
            life.quiesce_barrier();
            let mut census = Census::default();
            pin.count_into(&mut census);
            assert!(census.live + census.in_flight > 0, "remove would succeed under a live record");
            if closed {
                life.transition(&[MechanismState::Removing], MechanismState::Retired).unwrap();
            }
            releaser.join().unwrap();
        });
    }
}
