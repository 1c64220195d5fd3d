//! `GovernedAllocator`: any `DeviceAllocator`, with every allocation charged to an
//! authority's account by the request's role.
//!
//! # Accounting rules
//! - `allocate` charges `request.bytes()` to the account under `request.role()` before
//!   calling the inner allocator; if the inner allocator fails, the charge is cancelled.
//!   A block larger than asked is charged its real size (refused, and given back, if
//!   the account cannot hold the difference); a block smaller than asked is charged its
//!   real size too (the registry refuses such a block and releases it, which refunds).
//! - A `Complete` release refunds the whole charge.
//! - A `Quarantined` release refunds what the allocator really let go and keeps the
//!   residual still owned charged (shown as `quarantined_bytes`); retrying the release
//!   later refunds the rest, exactly once.
//! - A `Failed` release changes nothing.
//! - A quarantine or failure about *another* block than the one given is not believed:
//!   nothing is refunded, and the block given is answered as quarantined and wholly
//!   owned (so the registry keeps it and can retry it).
//! - Device loss: the registry makes no callback then, so the charge stays; when the
//!   registry confirms the context terminated it hands the lost blocks to
//!   [`DeviceAllocator::forget_lost`], which refunds them (counted as `lost_bytes`).
//!
//! # Records, not tags
//! [`RawAllocation::new`] is public and safe, so a block's `provider_tag` is a claim,
//! not a proof. Every block the governed allocator hands out has a *record*: the inner
//! allocator's block (address, size, alignment, device, its own tag), the role, the
//! bytes still charged, and whether it is quarantined or being released. The governed
//! block's tag only names its record (shard, slot, generation). Release, capability
//! calls and `forget_lost` look the record up and refuse a block whose tag names no
//! record, or a record of another block, as the `DeviceAllocator` contract says
//! ([`ReleaseError::NotOwned`], [`CapabilityError::NotOwned`]; nothing is refunded and
//! the inner allocator is not called). A record being released cannot be released
//! again concurrently, so one block is refunded at most once.
//!
//! Records live in 64 shards, one per thread (more threads share them), each behind a
//! leaf spin lock on its own cache line: allocations on different threads write
//! different lines, and a release on another thread locks the allocating thread's shard
//! for a few instructions. No lock is held across an inner-allocator call.

use std::fmt;

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, BackendError, ByteRange, CapabilityError, DeviceAddress,
    DeviceAllocator, DeviceKey, MappingAccess, MemoryRole, RawAllocation, ReleaseError, ReleaseOutcome, SharedBacking,
    SharedMapping, SharedPlacement, VirtualBacking,
};
use slab::Slab;

use crate::error::{AdmissionError, GovernError, GovernFailure};
use crate::governor::Account;
use crate::sync::{Arc, CachePadded, LeafMutex, Ordering, lock_leaf, thread_number};
use crate::timeline::TimelineEventKind;

/// Record shards per governed allocator (threads beyond this share shards).
const SHARDS: usize = 1 << SHARD_BITS;
const SHARD_BITS: u32 = 6;
const SLOT_BITS: u32 = 30;
const GENERATION_BITS: u32 = 64 - SHARD_BITS - SLOT_BITS;
const GENERATION: u64 = (1 << GENERATION_BITS) - 1;
const SLOT: u64 = (1 << SLOT_BITS) - 1;

/// Whether `error` is a governor refusal (a quota, limit or reserve), as returned
/// through the `DeviceAllocator` interface by a [`GovernedAllocator`].
pub fn is_governor_refusal(error: &AllocError) -> bool {
    matches!(error, AllocError::AdmissionRefused { .. })
}

/// What a governed block's tag names: a record's shard, slot and generation.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Key {
    shard: usize,
    slot: usize,
    generation: u64,
}

impl Key {
    fn decode(tag: u64) -> Key {
        Key {
            shard: (tag >> (SLOT_BITS + GENERATION_BITS)) as usize,
            slot: ((tag >> GENERATION_BITS) & SLOT) as usize,
            generation: tag & GENERATION,
        }
    }

    fn encode(self) -> u64 {
        ((self.shard as u64) << (SLOT_BITS + GENERATION_BITS))
            | ((self.slot as u64) << GENERATION_BITS)
            | self.generation
    }
}

/// The inner allocator's block, as it returned it.
#[derive(Copy, Clone, Debug)]
struct Block {
    address: DeviceAddress,
    bytes: usize,
    align: usize,
    device: DeviceKey,
    tag: u64,
}

impl Block {
    fn of(raw: &RawAllocation) -> Block {
        Block {
            address: raw.address(),
            bytes: raw.bytes(),
            align: raw.align(),
            device: raw.device(),
            tag: raw.provider_tag(),
        }
    }

    /// Whether `raw` describes this block (address, size, alignment, device).
    fn is(&self, raw: &RawAllocation) -> bool {
        raw.address() == self.address
            && raw.bytes() == self.bytes
            && raw.align() == self.align
            && raw.device() == self.device
    }

    /// The block as the inner allocator knows it.
    fn inner(&self) -> RawAllocation {
        RawAllocation::new(self.address, self.bytes, self.align, self.device, self.tag)
    }

    /// The block as the governed allocator hands it out.
    fn governed(&self, key: Key) -> RawAllocation {
        RawAllocation::new(self.address, self.bytes, self.align, self.device, key.encode())
    }
}

/// One governed block's record.
#[derive(Debug)]
struct Record {
    generation: u64,
    block: Block,
    role: MemoryRole,
    /// Bytes still charged for the block.
    charged: u64,
    /// Whether `charged` is counted in the role's quarantined bytes.
    quarantined: bool,
    /// A release of the block is in progress (a second one is refused).
    releasing: bool,
}

/// What a release or `forget_lost` learned from a record.
#[derive(Copy, Clone, Debug)]
struct Claim {
    key: Key,
    block: Block,
    role: MemoryRole,
    charged: u64,
    quarantined: bool,
}

#[derive(Debug, Default)]
struct Shard {
    records: Slab<Record>,
    next_generation: u64,
}

/// Every record of one governed allocator.
#[derive(Debug)]
struct Records {
    shards: Box<[CachePadded<LeafMutex<Shard>>]>,
    /// Records one shard may hold (slots the tag can name).
    max_slots: usize,
}

impl Records {
    fn new() -> Records {
        Records::with_max_slots(1 << SLOT_BITS)
    }

    fn with_max_slots(max_slots: usize) -> Records {
        Records { shards: (0..SHARDS).map(|_| CachePadded::new(LeafMutex::new(Shard::default()))).collect(), max_slots }
    }

    /// Records a block the inner allocator returned; the governed block, or the inner
    /// block back when the calling thread's shard is full.
    fn insert(&self, inner: RawAllocation, role: MemoryRole, charged: u64) -> Result<RawAllocation, RawAllocation> {
        let shard = thread_number() % SHARDS;
        let block = Block::of(&inner);
        let mut guard = lock_leaf(&self.shards[shard]);
        let shard_records = &mut *guard;
        let generation = shard_records.next_generation;
        let entry = shard_records.records.vacant_entry();
        let slot = entry.key();
        if slot >= self.max_slots {
            return Err(inner);
        }
        entry.insert(Record { generation, block, role, charged, quarantined: false, releasing: false });
        shard_records.next_generation = (generation + 1) & GENERATION;
        Ok(block.governed(Key { shard, slot, generation }))
    }

    /// Runs `f` on the record `raw` names, if it is the record of exactly that block.
    fn with_record<R>(&self, raw: &RawAllocation, f: impl FnOnce(&mut Slab<Record>, Key) -> R) -> Option<R> {
        let key = Key::decode(raw.provider_tag());
        let mut guard = lock_leaf(self.shards.get(key.shard)?);
        let record = guard.records.get(key.slot)?;
        if record.generation != key.generation || !record.block.is(raw) {
            return None;
        }
        Some(f(&mut guard.records, key))
    }

    /// Marks the record of `raw` as being released and returns what it says; `None`
    /// when `raw` is not a governed block of this allocator or is being released.
    fn claim(&self, raw: &RawAllocation) -> Option<Claim> {
        self.with_record(raw, |records, key| {
            let record = &mut records[key.slot];
            if record.releasing {
                return None;
            }
            record.releasing = true;
            Some(Claim {
                key,
                block: record.block,
                role: record.role,
                charged: record.charged,
                quarantined: record.quarantined,
            })
        })
        .flatten()
    }

    /// Ends a claim: the record now holds `charged` bytes of `block` (quarantined or
    /// not) and may be released again.
    fn settle(&self, key: Key, block: Block, charged: u64, quarantined: bool) {
        let mut guard = lock_leaf(&self.shards[key.shard]);
        if let Some(record) = guard.records.get_mut(key.slot) {
            *record = Record { block, charged, quarantined, releasing: false, ..*record };
        }
    }

    /// Ends a claim: the block is gone.
    fn remove(&self, key: Key) {
        let mut guard = lock_leaf(&self.shards[key.shard]);
        guard.records.try_remove(key.slot);
    }

    /// Removes the record of `raw` (a block lost with its device); `None` when `raw` is
    /// not a governed block of this allocator or is being released.
    fn take(&self, raw: &RawAllocation) -> Option<Claim> {
        self.with_record(raw, |records, key| {
            if records[key.slot].releasing {
                return None;
            }
            let record = records.remove(key.slot);
            Some(Claim {
                key,
                block: record.block,
                role: record.role,
                charged: record.charged,
                quarantined: record.quarantined,
            })
        })
        .flatten()
    }

    /// Records held (blocks handed out and not yet released or lost).
    fn len(&self) -> usize {
        self.shards.iter().map(|shard| lock_leaf(shard).records.len()).sum()
    }

    /// The inner allocator's view of a governed block (for capability calls).
    fn inner_view(&self, raw: &RawAllocation) -> Option<RawAllocation> {
        self.with_record(raw, |records, key| records[key.slot].block.inner())
    }
}

fn capability_gone(what: &'static str) -> CapabilityError {
    CapabilityError::Unsupported { allocator: "the governed allocator's inner allocator".to_owned(), what }
}

fn not_ours(name: &str, block: &RawAllocation) -> CapabilityError {
    CapabilityError::NotOwned { allocator: name.to_owned(), address: block.address().get() }
}

/// Forwards capability calls with the inner allocator's view of each block.
struct Forward {
    inner: Arc<dyn DeviceAllocator>,
    records: Arc<Records>,
    name: String,
}

impl Forward {
    fn view(&self, block: &RawAllocation) -> Result<RawAllocation, CapabilityError> {
        self.records.inner_view(block).ok_or_else(|| not_ours(&self.name, block))
    }

    fn virtual_backing(&self) -> Result<&dyn VirtualBacking, CapabilityError> {
        self.inner.virtual_backing().ok_or_else(|| capability_gone("virtual_backing"))
    }

    fn shared_mapping(&self) -> Result<&dyn SharedMapping, CapabilityError> {
        self.inner.shared_mapping().ok_or_else(|| capability_gone("shared_mapping"))
    }
}

impl VirtualBacking for Forward {
    fn granularity(&self) -> usize {
        self.inner.virtual_backing().map_or(1, |backing| backing.granularity())
    }

    fn commit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.virtual_backing()?.commit(&self.view(allocation)?, range)
    }

    fn decommit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.virtual_backing()?.decommit(&self.view(allocation)?, range)
    }

    fn committed_bytes(&self, allocation: &RawAllocation) -> Result<usize, CapabilityError> {
        self.virtual_backing()?.committed_bytes(&self.view(allocation)?)
    }
}

impl SharedMapping for Forward {
    fn granularity(&self) -> usize {
        self.inner.shared_mapping().map_or(1, |mapping| mapping.granularity())
    }

    fn create_backing(&self, bytes: usize) -> Result<SharedBacking, CapabilityError> {
        self.shared_mapping()?.create_backing(bytes)
    }

    fn map(
        &self,
        backing: &SharedBacking,
        allocation: &RawAllocation,
        placement: SharedPlacement,
        access: MappingAccess,
    ) -> Result<(), CapabilityError> {
        self.shared_mapping()?.map(backing, &self.view(allocation)?, placement, access)
    }

    fn unmap(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.shared_mapping()?.unmap(&self.view(allocation)?, range)
    }
}

/// Wraps any [`DeviceAllocator`] and charges each allocation to an account. Register
/// it in the `BindingRegistry` like any allocator: identity and governance compose.
/// The accounting rules are written down in `docs/ACCOUNTING.md`.
pub struct GovernedAllocator {
    account: Account,
    records: Arc<Records>,
    forward: Forward,
    has_virtual: bool,
    has_shared: bool,
}

impl fmt::Debug for GovernedAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GovernedAllocator")
            .field("inner", &self.forward.inner.name())
            .field("account", &self.account)
            .finish()
    }
}

impl GovernedAllocator {
    /// Governs `inner` with `account`.
    ///
    /// # Errors
    /// [`GovernError`] (handing `inner` back) when `inner` serves another device.
    pub fn new(inner: Arc<dyn DeviceAllocator>, account: Account) -> Result<GovernedAllocator, GovernError> {
        GovernedAllocator::with_records(inner, account, Records::new())
    }

    fn with_records(
        inner: Arc<dyn DeviceAllocator>,
        account: Account,
        records: Records,
    ) -> Result<GovernedAllocator, GovernError> {
        if inner.device() != account.device() {
            let failure = GovernFailure::DeviceMismatch {
                allocator: inner.name().to_owned(),
                allocator_device: inner.device(),
                authority: account.authority(),
                account_device: account.device(),
            };
            return Err(GovernError { failure, allocator: inner });
        }
        let records = Arc::new(records);
        let has_virtual = inner.virtual_backing().is_some();
        let has_shared = inner.shared_mapping().is_some();
        let name = format!("governed({})", inner.name());
        Ok(GovernedAllocator {
            account,
            forward: Forward { inner, records: Arc::clone(&records), name },
            records,
            has_virtual,
            has_shared,
        })
    }

    /// The account charged.
    pub fn account(&self) -> &Account {
        &self.account
    }

    /// The wrapped allocator.
    pub fn inner(&self) -> &Arc<dyn DeviceAllocator> {
        &self.forward.inner
    }

    /// Blocks this allocator has handed out and still holds records of: live,
    /// quarantined, or lost with their device and not yet handed to `forget_lost`
    /// (cold path: locks every record shard in turn).
    pub fn live_blocks(&self) -> usize {
        self.records.len()
    }

    /// Allocates like [`DeviceAllocator::allocate`], with the governor's own error.
    ///
    /// # Errors
    /// [`GovernedAllocError::Refused`] when the account cannot hold the request (or
    /// the real size of the block the inner allocator returned, which is then given
    /// back); [`GovernedAllocError::Allocator`] when the inner allocator fails (the
    /// charge is cancelled then).
    pub fn try_allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, GovernedAllocError> {
        let role = request.role();
        let bytes = request.bytes() as u64;
        self.account.charge(role, bytes).map_err(GovernedAllocError::Refused)?;
        // Cancels the charge if the inner allocator fails or panics.
        let mut charge = PendingCharge { account: &self.account, role, bytes, armed: true };
        let block = match self.forward.inner.allocate(request) {
            Ok(block) => block,
            Err(error) => return Err(GovernedAllocError::Allocator(error)),
        };
        charge.armed = false;
        // The books count the block's real size.
        let actual = block.bytes() as u64;
        if actual > bytes {
            if let Err(refusal) = self.account.grow(role, bytes, actual - bytes) {
                self.give_back_unrecorded(block, role, bytes);
                return Err(GovernedAllocError::Refused(refusal));
            }
        } else if actual < bytes {
            self.account.refund(role, bytes - actual, false);
        }
        match self.records.insert(block, role, actual) {
            Ok(governed) => Ok(governed),
            Err(block) => {
                self.give_back_unrecorded(block, role, actual);
                Err(GovernedAllocError::Allocator(AllocError::Backend {
                    device: self.device(),
                    source: BackendError {
                        backend: "governor",
                        operation: "record",
                        code: 0,
                        detail: format!(
                            "{} could not record the block: this thread's record shard is full; \
                             release some of its blocks first",
                            self.forward.name
                        ),
                    },
                }))
            }
        }
    }

    /// Releases a block the inner allocator made but the governor never handed out,
    /// cancelling its `charged` bytes if the release completes. Otherwise the charge
    /// stays, shown as quarantined: the inner allocator still holds the memory.
    #[cold]
    fn give_back_unrecorded(&self, block: RawAllocation, role: MemoryRole, charged: u64) {
        let outcome = self.forward.inner.release(block);
        if outcome.is_complete() {
            self.account.cancel(role, charged);
        } else {
            self.account.role_stats(role).quarantined.fetch_add(charged, Ordering::Relaxed);
            tracing::warn!(allocator = %self.forward.name, outcome = %outcome.summary(), charged,
                "could not give back a block the governor did not hand out; its charge stays, quarantined");
        }
    }

    fn not_owned(&self, allocation: RawAllocation) -> ReleaseOutcome {
        tracing::error!(allocator = %self.forward.name, block = ?allocation,
            "release of a block this governed allocator did not hand out (or is releasing); refused");
        let error = ReleaseError::NotOwned {
            allocator: self.forward.name.clone(),
            device: self.device(),
            address: allocation.address().get(),
        };
        ReleaseOutcome::failed(allocation, error)
    }

    /// Moves a record's charge in or out of the role's quarantined bytes.
    fn requarantine(&self, claim: &Claim, keep: Option<u64>) {
        let quarantined = &self.account.role_stats(claim.role).quarantined;
        // Add before subtracting, so that the figure never dips below zero.
        if let Some(keep) = keep {
            quarantined.fetch_add(keep, Ordering::Relaxed);
        }
        if claim.quarantined {
            quarantined.fetch_sub(claim.charged, Ordering::Relaxed);
        }
    }
}

/// A charge made for an allocation the inner allocator has not returned yet: dropped
/// (on an error or an unwinding panic), it cancels the charge.
struct PendingCharge<'a> {
    account: &'a Account,
    role: MemoryRole,
    bytes: u64,
    armed: bool,
}

impl Drop for PendingCharge<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.account.cancel(self.role, self.bytes);
        }
    }
}

/// A claimed record whose release is in the inner allocator: dropped while armed (the
/// inner allocator panicked), it keeps the whole block charged as a quarantine, as the
/// registry does, so that a retry or termination can settle it.
struct PendingRelease<'a> {
    governed: &'a GovernedAllocator,
    claim: Claim,
    armed: bool,
}

impl Drop for PendingRelease<'_> {
    fn drop(&mut self) {
        if self.armed {
            let claim = &self.claim;
            self.governed.requarantine(claim, Some(claim.charged));
            self.governed.records.settle(claim.key, claim.block, claim.charged, true);
        }
    }
}

/// Why [`GovernedAllocator::try_allocate`] failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GovernedAllocError {
    /// The governor refused the charge; the inner allocator was not called (or, for
    /// a block larger than asked, its block was given back).
    #[error(transparent)]
    Refused(AdmissionError),
    /// The inner allocator failed; the charge was cancelled.
    #[error(transparent)]
    Allocator(AllocError),
}

impl GovernedAllocError {
    /// This error through the `DeviceAllocator` interface: a refusal becomes an
    /// [`AllocError::AdmissionRefused`] whose detail is the full message (tier, device,
    /// authority, role, sizes, largest holder, what to change).
    pub fn into_alloc_error(self, device: DeviceKey) -> AllocError {
        match self {
            GovernedAllocError::Allocator(error) => error,
            GovernedAllocError::Refused(refusal) => {
                AllocError::AdmissionRefused { device, detail: refusal.to_string() }
            }
        }
    }
}

/// The inner allocator answered a release with another block than the one it was
/// given: nothing it says is believed. The block given stays wholly owned, as a
/// quarantine that releasing again can retry.
#[cold]
fn about_another_block(sent: RawAllocation, claimed_unmapped: usize, claimed_residual: usize) -> ReleaseOutcome {
    tracing::error!(block = ?sent, "inner allocator answered a release with another block; nothing refunded");
    let bytes = sent.bytes();
    let error = ReleaseError::DishonestOutcome { claimed_unmapped, claimed_residual, allocation_bytes: bytes };
    ReleaseOutcome::quarantined(sent, 0, bytes, error)
}

impl DeviceAllocator for GovernedAllocator {
    fn device(&self) -> DeviceKey {
        self.forward.inner.device()
    }

    fn name(&self) -> &str {
        &self.forward.name
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.try_allocate(request).map_err(|error| error.into_alloc_error(self.device()))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let Some(claim) = self.records.claim(&allocation) else {
            return self.not_owned(allocation);
        };
        let mut pending = PendingRelease { governed: self, claim, armed: true };
        let sent = claim.block;
        let outcome = match self.forward.inner.release(sent.inner()) {
            ReleaseOutcome::Quarantined(q) if !sent.is(q.allocation()) => {
                about_another_block(sent.inner(), q.unmapped_bytes(), q.residual_bytes())
            }
            ReleaseOutcome::Failed(f) if !sent.is(f.allocation()) => about_another_block(sent.inner(), 0, sent.bytes),
            outcome => outcome,
        };
        pending.armed = false;
        let role = claim.role;
        match outcome {
            ReleaseOutcome::Complete(done) => {
                self.records.remove(claim.key);
                self.requarantine(&claim, None);
                self.account.refund(role, claim.charged, true);
                ReleaseOutcome::Complete(done)
            }
            ReleaseOutcome::Quarantined(quarantine) => {
                let keep = (quarantine.residual_bytes() as u64).min(claim.charged);
                let (unmapped, residual) = (quarantine.unmapped_bytes(), quarantine.residual_bytes());
                let (block, error) = quarantine.into_parts();
                let block = Block::of(&block);
                self.requarantine(&claim, Some(keep));
                self.records.settle(claim.key, block, keep, true);
                let refunded = claim.charged - keep;
                self.account.refund(role, refunded, false);
                tracing::warn!(
                    allocator = %self.forward.name, authority = %self.account.authority(), role = %role,
                    refunded, still_charged = keep, "quarantined release: residual stays charged"
                );
                ReleaseOutcome::quarantined(block.governed(claim.key), unmapped, residual, error)
            }
            ReleaseOutcome::Failed(failed) => {
                let (block, error) = failed.into_parts();
                let block = Block::of(&block);
                self.records.settle(claim.key, block, claim.charged, claim.quarantined);
                ReleaseOutcome::failed(block.governed(claim.key), error)
            }
        }
    }

    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        self.has_virtual.then_some(&self.forward as &dyn VirtualBacking)
    }

    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        self.has_shared.then_some(&self.forward as &dyn SharedMapping)
    }

    fn stats(&self) -> Option<AllocatorStats> {
        self.forward.inner.stats()
    }

    fn trim(&self) -> usize {
        self.forward.inner.trim()
    }

    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        let mut inner = Vec::with_capacity(lost.len());
        for block in lost {
            let Some(claim) = self.records.take(&block) else {
                tracing::error!(allocator = %self.forward.name, block = ?block,
                    "lost block was not handed out by this governed allocator; not refunded");
                continue;
            };
            let stats = self.account.role_stats(claim.role);
            self.requarantine(&claim, None);
            stats.lost_bytes.fetch_add(claim.charged, Ordering::Relaxed);
            stats.lost_allocations.fetch_add(1, Ordering::Relaxed);
            self.account.refund(claim.role, claim.charged, true);
            if self.account.timeline().enabled() {
                self.account.timeline().record(
                    TimelineEventKind::Lost,
                    self.account.device(),
                    self.account.authority(),
                    claim.role,
                    claim.charged,
                );
            }
            inner.push(claim.block.inner());
        }
        tracing::info!(allocator = %self.forward.name, authority = %self.account.authority(), blocks = inner.len(),
            "lost blocks refunded after termination");
        self.forward.inner.forget_lost(inner);
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_through_tags() {
        for key in [
            Key { shard: 0, slot: 0, generation: 0 },
            Key { shard: SHARDS - 1, slot: SLOT as usize, generation: GENERATION },
            Key { shard: 5, slot: 12345, generation: 678 },
        ] {
            assert_eq!(Key::decode(key.encode()), key);
        }
    }

    #[test]
    fn a_full_shard_refuses_to_record_and_hands_the_block_back() {
        let records = Records::with_max_slots(1);
        let address = DeviceAddress::new(0x4000).unwrap();
        let first = records.insert(RawAllocation::new(address, 64, 8, DeviceKey::HOST, 7), MemoryRole::KvCache, 64);
        let first = first.expect("one record fits");
        let second = RawAllocation::new(DeviceAddress::new(0x8000).unwrap(), 32, 8, DeviceKey::HOST, 9);
        let back = records.insert(second, MemoryRole::KvCache, 32).expect_err("the shard is full");
        assert_eq!((back.address().get(), back.provider_tag()), (0x8000, 9));
        let claim = records.take(&first).expect("the first record is there");
        assert_eq!((claim.block.tag, claim.charged), (7, 64));
        assert!(records.take(&first).is_none(), "taken exactly once");
    }

    #[test]
    fn a_block_that_cannot_be_recorded_is_given_back_and_its_charge_cancelled() {
        use memory_testkit::{Callback, RecordingAllocator};
        let governor = crate::Governor::new();
        let authority = memory_api::IdentityIssuer::new().unwrap().authority().unwrap();
        let account = governor.open_account(crate::AccountConfig::new(DeviceKey::HOST, authority)).unwrap();
        let recording = Arc::new(RecordingAllocator::on_device(DeviceKey::HOST));
        let inner = Arc::clone(&recording) as Arc<dyn DeviceAllocator>;
        let governed = GovernedAllocator::with_records(inner, account.clone(), Records::with_max_slots(0)).unwrap();
        let request = AllocationRequest::new(4096, 64).unwrap();
        let err = governed.allocate(&request).unwrap_err();
        let AllocError::Backend { source, .. } = &err else { panic!("expected a backend error, got {err}") };
        assert_eq!((source.backend, source.operation), ("governor", "record"));
        assert!(err.to_string().contains("record shard is full"), "{err}");
        assert_eq!(recording.calls(Callback::Release), 1, "the block went back to the inner allocator");
        assert_eq!(governed.live_blocks(), 0);
        let snapshot = account.snapshot();
        assert_eq!((snapshot.current, snapshot.totals.allocations, snapshot.totals.live), (0, 0, 0));
    }

    #[test]
    fn threads_record_in_different_shards() {
        let records = Arc::new(Records::new());
        let shard_of_a_new_thread = |address: u64| {
            let records = Arc::clone(&records);
            std::thread::spawn(move || {
                let block = RawAllocation::new(DeviceAddress::new(address).unwrap(), 64, 8, DeviceKey::HOST, 0);
                Key::decode(records.insert(block, MemoryRole::Weights, 64).unwrap().provider_tag()).shard
            })
            .join()
            .unwrap()
        };
        let (first, second) = (shard_of_a_new_thread(0x1000), shard_of_a_new_thread(0x2000));
        assert_ne!(first, second, "two threads share a record shard (and its cache line)");
        assert_eq!(records.len(), 2);
    }

    #[test]
    fn generations_tell_a_reused_slot_apart() {
        let records = Records::new();
        let address = DeviceAddress::new(0x4000).unwrap();
        let block = |tag| RawAllocation::new(address, 64, 8, DeviceKey::HOST, tag);
        // The same block recorded again and again in the same slot: every earlier tag
        // is stale, never a name for the live record.
        let mut stale = Vec::new();
        for _ in 0..8 {
            let governed = records.insert(block(0), MemoryRole::Weights, 64).unwrap();
            let tag = governed.provider_tag();
            assert!(stale.iter().all(|&old| Key::decode(old).slot == Key::decode(tag).slot), "the slot is reused");
            for &old in &stale {
                assert_ne!(old, tag, "a generation came back");
                assert!(records.take(&block(old)).is_none());
            }
            stale.push(tag);
            assert_eq!(records.take(&governed).map(|claim| claim.charged), Some(64));
        }
        assert_eq!(records.len(), 0);
    }
}
