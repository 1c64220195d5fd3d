//! What the registry stores: context and authority entries, the shared mechanism core,
//! and the per-thread pins that hold allocation records.
//!
//! Ownership: the registry's tables hold `Mechanism`s; a `Mechanism` holds its
//! `MechanismCore` and one `Pin` per thread; bindings and allocations hold a pin,
//! and a pin holds the core. So cloning a handle touches only its thread's pin, and
//! every handle keeps the allocator, authority and context alive on its own, even after
//! the registry is dropped.

use std::any::Any;
use std::num::NonZeroU64;
use std::sync::OnceLock;

use memory_api::{
    AllocationGeneration, AuthorityIdentity, BindingGeneration, BindingId, DeferredReleaseQueue, DeviceAllocator,
    DeviceKey, IdentityBlock, IdentityError, IdentityIssuer, MechanismIdentity, ProviderContextIdentity, RawAllocation,
    ReleaseError,
};
use slab::Slab;
use thread_local::ThreadLocal;

use crate::error::ContextState;
use crate::lifecycle::Lifecycle;
use crate::sync::{Arc, AtomicU8, AtomicUsize, LeafMutex, Mutex, Ordering, lock, lock_leaf};

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
    /// Blocks an allocator answered after its device was lost that could not be
    /// recorded (unfit, or no identity left): no callback may give them back, so they
    /// wait here for `forget_lost` at termination.
    unrecorded_lost: Mutex<Vec<RawAllocation>>,
    quarantined: AtomicUsize,
    /// Release answers the registry did not believe (corrected and traced).
    dishonest_outcomes: AtomicUsize,
    next_pin_slot: AtomicUsize,
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
            unrecorded_lost: Mutex::new(Vec::new()),
            quarantined: AtomicUsize::new(0),
            dishonest_outcomes: AtomicUsize::new(0),
            next_pin_slot: AtomicUsize::new(0),
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

    /// Keeps a block answered after device loss that has no record (see
    /// `unrecorded_lost`).
    pub(crate) fn keep_unrecorded_lost(&self, block: RawAllocation) {
        lock(&self.unrecorded_lost).push(block);
    }

    /// Takes the unrecorded lost blocks out (termination hands them to `forget_lost`).
    pub(crate) fn take_unrecorded_lost(&self) -> Vec<RawAllocation> {
        std::mem::take(&mut *lock(&self.unrecorded_lost))
    }

    /// Unrecorded lost blocks and their bytes.
    pub(crate) fn unrecorded_lost(&self) -> (usize, usize) {
        let blocks = lock(&self.unrecorded_lost);
        (blocks.len(), blocks.iter().map(RawAllocation::bytes).sum())
    }

    /// Calls `f` on every quarantined block (snapshots, lookups).
    pub(crate) fn with_quarantine<R>(&self, f: impl FnOnce(&[QuarantinedAllocation]) -> R) -> R {
        f(&lock(&self.quarantine))
    }
}

/// A registered mechanism: the shared core plus one pin per thread.
pub(crate) struct Mechanism {
    pub(crate) core: Arc<MechanismCore>,
    pins: ThreadLocal<Arc<Pin>>,
}

impl Mechanism {
    pub(crate) fn new(core: MechanismCore) -> Mechanism {
        Mechanism { core: Arc::new(core), pins: ThreadLocal::new() }
    }

    /// This thread's pin (created on first use, then reused: no allocation).
    pub(crate) fn pin(&self) -> &Arc<Pin> {
        self.pins.get_or(|| {
            // Round-robin; the lifecycle maps the number onto its slots.
            let slot = self.core.next_pin_slot.fetch_add(1, Ordering::Relaxed);
            Arc::new(Pin::new(Arc::clone(&self.core), slot))
        })
    }

    /// Every pin ever created for this mechanism.
    pub(crate) fn pins(&self) -> impl Iterator<Item = &Arc<Pin>> {
        self.pins.iter()
    }

    /// Live allocations across all pins, plus blocks kept unrecorded after device loss.
    pub(crate) fn live(&self) -> (usize, usize) {
        let unrecorded = self.core.unrecorded_lost();
        self.pins().map(|pin| pin.live()).fold(unrecorded, |(n, b), (pn, pb)| (n + pn, b + pb))
    }
}

/// How many identities a pin reserves from the shared counters at a time.
const IDENTITY_BLOCK: u64 = 256;

/// One allocation record: the generation to validate and the block to release.
pub(crate) struct Record {
    pub(crate) generation: NonZeroU64,
    pub(crate) allocation: RawAllocation,
}

// Registry memory per live allocation: one slab entry, i.e. a record plus at most one
// word of enum tag (issue 3 budget: 64 bytes beyond the handle).
const _: () = assert!(std::mem::size_of::<Record>() + std::mem::size_of::<usize>() <= 64);

struct PinRecords {
    slab: Slab<Record>,
    live_bytes: usize,
    generations: IdentityBlock<AllocationGeneration>,
}

/// A per-thread copy of a mechanism entry: handles made on a thread pin the
/// mechanism through that thread's pin, so their refcount traffic and record
/// inserts stay on that thread's cache lines. Aligned to two cache lines so that two
/// pins allocated back to back never share one (measured: without it, two threads on
/// one mechanism ran at half of one thread's throughput).
#[repr(align(128))]
pub(crate) struct Pin {
    pub(crate) core: Arc<MechanismCore>,
    /// In-flight slot of this pin.
    pub(crate) slot: usize,
    records: LeafMutex<PinRecords>,
    binding_ids: LeafMutex<IdentityBlock<BindingId>>,
    live: AtomicUsize,
}

impl Pin {
    fn new(core: Arc<MechanismCore>, slot: usize) -> Pin {
        let registry = core.issuer.registry();
        Pin {
            core,
            slot,
            records: LeafMutex::new(PinRecords {
                slab: Slab::new(),
                live_bytes: 0,
                generations: IdentityBlock::empty(registry),
            }),
            binding_ids: LeafMutex::new(IdentityBlock::empty(registry)),
            live: AtomicUsize::new(0),
        }
    }

    /// Mints a binding id from this pin's block.
    pub(crate) fn next_binding_id(&self) -> Result<BindingId, IdentityError> {
        let mut block = lock_leaf(&self.binding_ids);
        if let Some(id) = block.next() {
            return Ok(id);
        }
        *block = self.core.issuer.block(IDENTITY_BLOCK)?;
        block.next().ok_or(IdentityError::RegistriesExhausted)
    }

    /// Records a new allocation; returns its slot and generation.
    ///
    /// # Errors
    /// Generation exhaustion, or more live records on this pin than a `u32` slot can
    /// name; the block comes back so the caller can release it.
    pub(crate) fn insert(
        &self,
        allocation: RawAllocation,
    ) -> Result<(u32, NonZeroU64), (RawAllocation, IdentityError)> {
        let mut records = lock_leaf(&self.records);
        let generation = match records.generations.next() {
            Some(generation) => generation,
            None => match self.core.issuer.block::<AllocationGeneration>(IDENTITY_BLOCK) {
                Ok(mut block) => match block.next() {
                    Some(generation) => {
                        records.generations = block;
                        generation
                    }
                    None => return Err((allocation, IdentityError::RegistriesExhausted)),
                },
                Err(error) => return Err((allocation, error)),
            },
        };
        let generation = memory_api::Identity::serial(&generation);
        self.insert_locked(&mut records, allocation, generation)
    }

    /// Puts a block back under its existing generation (a refused release).
    pub(crate) fn reinsert(&self, allocation: RawAllocation, generation: NonZeroU64) -> Result<u32, RawAllocation> {
        let mut records = lock_leaf(&self.records);
        self.insert_locked(&mut records, allocation, generation).map(|(slot, _)| slot).map_err(|(a, _)| a)
    }

    #[inline]
    fn insert_locked(
        &self,
        records: &mut PinRecords,
        allocation: RawAllocation,
        generation: NonZeroU64,
    ) -> Result<(u32, NonZeroU64), (RawAllocation, IdentityError)> {
        let entry = records.slab.vacant_entry();
        let Ok(slot) = u32::try_from(entry.key()) else {
            return Err((allocation, IdentityError::RegistriesExhausted));
        };
        let bytes = allocation.bytes();
        entry.insert(Record { generation, allocation });
        records.live_bytes += bytes;
        self.live.store(records.slab.len(), Ordering::Relaxed);
        Ok((slot, generation))
    }

    /// Removes the record at `slot` if it still holds `generation` (exactly once).
    #[inline]
    pub(crate) fn take(&self, slot: u32, generation: NonZeroU64) -> Option<RawAllocation> {
        let mut records = lock_leaf(&self.records);
        let slot = slot as usize;
        if records.slab.get(slot).is_none_or(|record| record.generation != generation) {
            return None;
        }
        let record = records.slab.remove(slot);
        records.live_bytes -= record.allocation.bytes();
        self.live.store(records.slab.len(), Ordering::Relaxed);
        Some(record.allocation)
    }

    /// Whether the record at `slot` still holds `generation`.
    pub(crate) fn holds(&self, slot: u32, generation: NonZeroU64) -> bool {
        lock_leaf(&self.records).slab.get(slot as usize).is_some_and(|record| record.generation == generation)
    }

    // The record exists: the allocation is borrowed, so nothing releases it during
    // this call, and the in-flight count above keeps termination (the only other
    // path that retires records) from running until the call is over.
    /// Whether any record holds `generation`.
    pub(crate) fn find(&self, generation: NonZeroU64) -> bool {
        lock_leaf(&self.records).slab.iter().any(|(_, record)| record.generation == generation)
    }

    /// Removes every record (termination retires the metadata).
    pub(crate) fn drain(&self) -> Vec<RawAllocation> {
        let mut records = lock_leaf(&self.records);
        records.live_bytes = 0;
        self.live.store(0, Ordering::Relaxed);
        records.slab.drain().map(|record| record.allocation).collect()
    }

    /// Live records and their bytes.
    pub(crate) fn live(&self) -> (usize, usize) {
        let records = lock_leaf(&self.records);
        (records.slab.len(), records.live_bytes)
    }

    /// Live records, read without the lock (cold-path quiescence checks).
    pub(crate) fn live_count(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }
}

/// loom models of the record protocol (`cargo xtask loom`).
#[cfg(all(test, memory_loom))]
mod loom_records {
    use super::*;
    use memory_api::{AllocError, AllocationRequest, DeviceAddress, ReleaseOutcome};

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

    fn pin() -> Arc<Pin> {
        let issuer = Arc::new(IdentityIssuer::new().unwrap());
        let context = Arc::new(ContextEntry::new(issuer.provider_context().unwrap(), DeviceKey::HOST, Arc::new(())));
        let authority = Arc::new(AuthorityEntry {
            identity: issuer.authority().unwrap(),
            device: DeviceKey::HOST,
            resource: Arc::new(()),
        });
        let core = MechanismCore::new(
            issuer.mechanism().unwrap(),
            Arc::new(Unused),
            context,
            authority,
            issuer.binding_generation().unwrap(),
            Arc::clone(&issuer),
            DropPolicy::Release,
            "unused".to_owned(),
            false,
        );
        Arc::new(Pin::new(Arc::new(core), 0))
    }

    fn block() -> RawAllocation {
        RawAllocation::new(DeviceAddress::new(0x1000).unwrap(), 64, 8, DeviceKey::HOST, 0)
    }

    /// Two paths releasing one record (an explicit release and a drop, or two
    /// handles): exactly one takes it, and a slot reused for a new allocation is never
    /// taken with the old generation.
    #[test]
    fn loom_one_record_is_taken_exactly_once() {
        loom::model(|| {
            let pin = pin();
            let (slot, generation) = pin.insert(block()).unwrap();
            let other = {
                let pin = Arc::clone(&pin);
                loom::thread::spawn(move || {
                    let taken = pin.take(slot, generation).is_some();
                    // Reuse whatever slot is free next under a fresh generation.
                    let (new_slot, new_generation) = pin.insert(block()).unwrap();
                    (taken, new_slot, new_generation)
                })
            };
            let mine = pin.take(slot, generation).is_some();
            let (theirs, new_slot, new_generation) = other.join().unwrap();
            assert!(mine ^ theirs, "exactly one path releases the record");
            assert_ne!(new_generation, generation);
            assert!(pin.take(new_slot, generation).is_none() || new_slot != slot);
            assert!(pin.take(new_slot, new_generation).is_some());
        });
    }

    /// A release racing the termination sweep: the block goes to exactly one of them.
    #[test]
    fn loom_release_racing_termination_sweep_is_exactly_once() {
        loom::model(|| {
            let pin = pin();
            let (slot, generation) = pin.insert(block()).unwrap();
            let sweep = {
                let pin = Arc::clone(&pin);
                loom::thread::spawn(move || pin.drain().len())
            };
            let released = usize::from(pin.take(slot, generation).is_some());
            let swept = sweep.join().unwrap();
            assert_eq!(released + swept, 1);
            assert_eq!(pin.live(), (0, 0));
        });
    }
}
