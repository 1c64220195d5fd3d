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
//! bytes still charged, and whether it is quarantined. The governed block's tag only
//! names its record. Release, capability calls and `forget_lost` look the record up
//! and refuse a block whose tag names no live record, or a record of another block, as
//! the `DeviceAllocator` contract says ([`ReleaseError::NotOwned`],
//! [`CapabilityError::NotOwned`]; nothing is refunded and the inner allocator is not
//! called). A record being released cannot be released again concurrently, so one
//! block is refunded at most once.
//!
//! The records live in `memory_sync`'s record table, as every layer's do: the thread
//! that allocates records the block in its own part with plain stores; a release from
//! any thread takes the record with one compare-and-swap (the record is then *in
//! transit*: a second release, a capability call or `forget_lost` of the block is
//! refused), and settles it after the inner allocator answered: freed on a complete
//! release, restored under the same tag with what is still charged on a quarantine or
//! a failure. No lock, and none held across an inner-allocator call. The tag is the
//! table's (owner thread 16 bits, slot 24, generation 24): a thread holds at most
//! 2^24 - 32 governed blocks live at once, past which an allocation is refused with a
//! `governor`/`record` backend error (the block given back, the charge cancelled).

use std::fmt;

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, BackendError, ByteRange, CapabilityError, DeviceAddress,
    DeviceAllocator, DeviceKey, MappingAccess, MemoryRole, RawAllocation, ReleaseError, ReleaseOutcome, SharedBacking,
    SharedMapping, SharedPlacement, Tier, VirtualBacking,
};
use memory_sync::records::{Payload, RecordTable, TakenRecord};

use crate::account::Account;
use crate::device::DeviceBooks;
use crate::error::{AdmissionError, GovernError, GovernFailure};
use crate::sync::{Arc, AtomicU64, Ordering};
use crate::timeline::TimelineEventKind;

/// Whether `error` is a governor refusal (a quota, limit or reserve), as returned
/// through the `DeviceAllocator` interface by a [`GovernedAllocator`].
pub fn is_governor_refusal(error: &AllocError) -> bool {
    matches!(error, AllocError::AdmissionRefused { .. })
}

/// The inner allocator's block, as it returned it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
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
    #[inline]
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

    /// The block as the governed allocator hands it out, named by `tag`.
    fn governed(&self, tag: u64) -> RawAllocation {
        RawAllocation::new(self.address, self.bytes, self.align, self.device, tag)
    }
}

/// One governed block's record as the table keeps it: six words, compared with a
/// presented block without decoding ([`Packed::is`]). The device is kept only to be
/// compared: a block that matched its record is on the device the caller presented.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Packed {
    address: u64,
    bytes: u64,
    align: u64,
    /// The inner allocator's own tag for the block.
    tag: u64,
    /// Bytes still charged for the block.
    charged: u64,
    /// The device's index (bits 0-31) and tier (32-33), the role (40-42) and whether
    /// `charged` is counted in the role's quarantined bytes (48).
    meta: u64,
}

const TIER_SHIFT: u32 = 32;
const DEVICE_BITS: u64 = (1 << 34) - 1;
const ROLE_SHIFT: u32 = 40;
// A role is packed into 3 bits: a ninth role must widen them, not decode as another.
const _: () = assert!(MemoryRole::ALL.len() <= 8);
const QUARANTINED: u64 = 1 << 48;

/// A device's bits in [`Packed::meta`]; `None` for a tier this governor cannot record
/// (none today: `Tier` is `non_exhaustive`, so a new tier needs a code here).
#[inline]
fn device_bits(device: DeviceKey) -> Option<u64> {
    let tier = match device.tier() {
        Tier::Device => 0,
        Tier::Host => 1,
        Tier::Disk => 2,
        _ => return None,
    };
    Some(u64::from(device.index()) | tier << TIER_SHIFT)
}

impl Packed {
    /// The record of a block just handed out, charged `charged` bytes under `role`;
    /// `None` when its device's tier has no code.
    #[inline]
    fn new(block: &Block, role: MemoryRole, charged: u64) -> Option<Packed> {
        Some(Packed {
            address: block.address.get(),
            bytes: block.bytes as u64,
            align: block.align as u64,
            tag: block.tag,
            charged,
            meta: device_bits(block.device)? | (role.ordinal() as u64) << ROLE_SHIFT,
        })
    }

    /// Whether `raw` describes this record's block (address, size, alignment, device).
    #[inline]
    fn is(&self, raw: &RawAllocation) -> bool {
        raw.address().get() == self.address
            && raw.bytes() as u64 == self.bytes
            && raw.align() as u64 == self.align
            && device_bits(raw.device()) == Some(self.meta & DEVICE_BITS)
    }

    /// The inner allocator's block, given a block that [`Packed::is`] this record's.
    #[inline]
    fn inner(&self, presented: &RawAllocation) -> Block {
        Block { tag: self.tag, ..Block::of(presented) }
    }

    #[inline]
    fn role(&self) -> MemoryRole {
        MemoryRole::ALL.get(((self.meta >> ROLE_SHIFT) & 7) as usize).copied().unwrap_or_default()
    }

    #[inline]
    fn quarantined(&self) -> bool {
        self.meta & QUARANTINED != 0
    }

    /// This record after a release that kept `charged` bytes of it, as a quarantine or
    /// not, and the inner allocator's (possibly new) tag.
    #[inline]
    fn settled(&self, tag: u64, charged: u64, quarantined: bool) -> Packed {
        let meta = if quarantined { self.meta | QUARANTINED } else { self.meta & !QUARANTINED };
        Packed { tag, charged, meta, ..*self }
    }
}

/// Where a record keeps its words (any thread reads them without a lock; the table
/// orders the loads and stores).
#[derive(Default)]
struct RecordCells {
    address: AtomicU64,
    bytes: AtomicU64,
    align: AtomicU64,
    tag: AtomicU64,
    charged: AtomicU64,
    meta: AtomicU64,
}

impl Payload for RecordCells {
    type Value = Packed;

    #[inline]
    fn store(&self, packed: &Packed) {
        self.address.store(packed.address, Ordering::Relaxed);
        self.bytes.store(packed.bytes, Ordering::Relaxed);
        self.align.store(packed.align, Ordering::Relaxed);
        self.tag.store(packed.tag, Ordering::Relaxed);
        self.charged.store(packed.charged, Ordering::Relaxed);
        self.meta.store(packed.meta, Ordering::Relaxed);
    }

    #[inline]
    fn load(&self) -> Packed {
        Packed {
            address: self.address.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            align: self.align.load(Ordering::Relaxed),
            tag: self.tag.load(Ordering::Relaxed),
            charged: self.charged.load(Ordering::Relaxed),
            meta: self.meta.load(Ordering::Relaxed),
        }
    }
}

/// A record taken for a release or `forget_lost`.
type Taken<'a> = TakenRecord<'a, RecordCells>;

/// Every record of one governed allocator.
struct Records {
    table: RecordTable<RecordCells>,
}

impl Records {
    fn new() -> Records {
        Records { table: RecordTable::new() }
    }

    /// Records that hold at most `limit` blocks per thread (tests of a full table).
    #[cfg(all(test, not(memory_loom)))]
    fn with_limit(limit: u32) -> Records {
        Records { table: RecordTable::with_limit(limit) }
    }

    /// Records a block the inner allocator returned; the governed block, or the inner
    /// block back when the calling thread's part of the table is full (or the block is
    /// on a tier the record has no code for).
    #[inline(always)]
    fn insert(&self, inner: RawAllocation, role: MemoryRole, charged: u64) -> Result<RawAllocation, RawAllocation> {
        let block = Block::of(&inner);
        let Some(packed) = Packed::new(&block, role, charged) else {
            return Err(inner);
        };
        match self.table.insert(&packed) {
            Some((tag, _)) => Ok(block.governed(tag)),
            None => Err(inner),
        }
    }

    /// Takes the record of `raw` for a release (or `forget_lost`); `None` when `raw` is
    /// not a governed block of this allocator, names a record of another block, or is
    /// being released.
    #[inline(always)]
    fn take(&self, raw: &RawAllocation) -> Option<Taken<'_>> {
        self.table.take(raw.provider_tag(), |packed| packed.is(raw))
    }

    /// Records held (blocks handed out and not yet released or lost).
    fn len(&self) -> usize {
        self.table.recorded().count()
    }

    /// The inner allocator's view of a governed block (for capability calls).
    fn inner_view(&self, raw: &RawAllocation) -> Option<RawAllocation> {
        self.table.get(raw.provider_tag(), |packed| packed.is(raw)).map(|packed| packed.inner(raw).inner())
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

/// Whose books a governed allocator keeps: a tenant's [`Account`] (a
/// [`GovernedAllocator`]) or the device's cache backings (a [`CacheBacking`]). One
/// mechanism, two payers: the records, the release protocol and the trust rules are the
/// same.
pub(crate) trait Books: Send + Sync + 'static {
    /// Who pays, for messages.
    fn payer(&self) -> String;
    fn charge(&self, role: MemoryRole, bytes: u64) -> Result<(), AdmissionError>;
    fn grow(&self, role: MemoryRole, held: u64, extra: u64) -> Result<(), AdmissionError>;
    fn refund(&self, role: MemoryRole, bytes: u64, close: bool);
    fn cancel(&self, role: MemoryRole, bytes: u64);
    fn quarantined(&self, role: MemoryRole) -> &AtomicU64;
    /// Counts a block lost with its device (its refund follows).
    fn lost(&self, role: MemoryRole, bytes: u64);
    /// The tenant a recovery ladder runs for; `None` for books that run none.
    #[inline(always)]
    fn tenant(&self) -> Option<&Account> {
        None
    }
}

impl Books for Account {
    fn payer(&self) -> String {
        self.authority().to_string()
    }

    #[inline(always)]
    fn charge(&self, role: MemoryRole, bytes: u64) -> Result<(), AdmissionError> {
        Account::charge(self, role, bytes)
    }

    fn grow(&self, role: MemoryRole, held: u64, extra: u64) -> Result<(), AdmissionError> {
        Account::grow(self, role, held, extra)
    }

    #[inline(always)]
    fn refund(&self, role: MemoryRole, bytes: u64, close: bool) {
        Account::refund(self, role, bytes, close);
    }

    fn cancel(&self, role: MemoryRole, bytes: u64) {
        Account::cancel(self, role, bytes);
    }

    fn quarantined(&self, role: MemoryRole) -> &AtomicU64 {
        &self.role_stats(role).quarantined
    }

    fn lost(&self, role: MemoryRole, bytes: u64) {
        let stats = self.role_stats(role);
        stats.lost_bytes.fetch_add(bytes, Ordering::Relaxed);
        stats.lost_allocations.fetch_add(1, Ordering::Relaxed);
        self.record_event(TimelineEventKind::Lost, role, bytes);
    }

    #[inline(always)]
    fn tenant(&self) -> Option<&Account> {
        Some(self)
    }
}

/// The books of a cache backing ([`CacheBacking`](crate::CacheBacking)): the device's
/// `held_by_caches`, bounded by the device limit.
pub(crate) struct BackingBooks {
    device: Arc<DeviceBooks>,
    /// Bytes of blocks the backing could not take back (still held, still counted).
    quarantined: AtomicU64,
    /// Bytes of blocks lost with the device and refunded at termination.
    lost: AtomicU64,
}

impl BackingBooks {
    pub(crate) fn new(device: Arc<DeviceBooks>) -> BackingBooks {
        BackingBooks { device, quarantined: AtomicU64::new(0), lost: AtomicU64::new(0) }
    }
}

impl Books for BackingBooks {
    fn payer(&self) -> String {
        format!("the caches of {}", self.device.key())
    }

    fn charge(&self, _role: MemoryRole, bytes: u64) -> Result<(), AdmissionError> {
        let limit = self.device.limit();
        match self.device.caches.take(bytes, limit) {
            Ok(_) => Ok(()),
            Err(held) => Err(AdmissionError::CacheLimit { device: self.device.key(), requested: bytes, held, limit }),
        }
    }

    fn grow(&self, role: MemoryRole, _held: u64, extra: u64) -> Result<(), AdmissionError> {
        self.charge(role, extra)
    }

    fn refund(&self, _role: MemoryRole, bytes: u64, _close: bool) {
        self.device.caches.give_back(bytes);
    }

    fn cancel(&self, role: MemoryRole, bytes: u64) {
        self.refund(role, bytes, false);
    }

    fn quarantined(&self, _role: MemoryRole) -> &AtomicU64 {
        &self.quarantined
    }

    fn lost(&self, _role: MemoryRole, bytes: u64) {
        self.lost.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// The allocator both payers share (see [`Books`]).
struct Governed<B> {
    books: B,
    records: Arc<Records>,
    forward: Forward,
    has_virtual: bool,
    has_shared: bool,
}

/// Wraps any [`DeviceAllocator`] and charges each allocation to an account. Register
/// it in the `BindingRegistry` like any allocator: identity and governance compose.
/// The accounting rules are written down in `docs/ACCOUNTING.md`.
///
/// When the inner allocator runs out of memory (or a cache's backing refuses it, see
/// [`Governor::cache_backing`](crate::Governor::cache_backing)), or a cache grew past
/// the device limit while serving it, the governed allocator runs the recovery ladder
/// outside every lock: trim the device's caches (the largest idle first), ask the
/// reclaim holders, retrying after each; then refuse with [`LimitScope::Reserved`](crate::LimitScope::Reserved).
pub struct GovernedAllocator(Governed<Account>);

/// Wraps the backing of a cache (made by
/// [`Governor::cache_backing`](crate::Governor::cache_backing)): every block the cache
/// takes is counted in its device's `held_by_caches`, refused past the device limit
/// ([`AdmissionError::CacheLimit`]), and recorded like a governed block.
pub struct CacheBacking(Governed<BackingBooks>);

impl fmt::Debug for GovernedAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GovernedAllocator")
            .field("inner", &self.0.forward.inner.name())
            .field("account", &self.0.books)
            .finish()
    }
}

impl fmt::Debug for CacheBacking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CacheBacking").field("inner", &self.0.forward.inner.name()).finish()
    }
}

impl<B: Books> Governed<B> {
    fn new(inner: Arc<dyn DeviceAllocator>, books: B, records: Records, name: String) -> Governed<B> {
        let records = Arc::new(records);
        let has_virtual = inner.virtual_backing().is_some();
        let has_shared = inner.shared_mapping().is_some();
        Governed {
            books,
            forward: Forward { inner, records: Arc::clone(&records), name },
            records,
            has_virtual,
            has_shared,
        }
    }
}

impl CacheBacking {
    pub(crate) fn new(inner: Arc<dyn DeviceAllocator>, device: Arc<DeviceBooks>) -> CacheBacking {
        let name = format!("cache-backing({})", inner.name());
        CacheBacking(Governed::new(inner, BackingBooks::new(device), Records::new(), name))
    }

    /// The wrapped backing allocator.
    pub fn inner(&self) -> &Arc<dyn DeviceAllocator> {
        &self.0.forward.inner
    }

    /// Blocks the cache holds from its backing (cold path: reads every record).
    pub fn live_blocks(&self) -> usize {
        self.0.records.len()
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
        // The device asks it for its cache's figures, and trims it on the ladder.
        account.device_books().caches.register(account.authority(), &inner);
        let name = format!("governed({})", inner.name());
        Ok(GovernedAllocator(Governed::new(inner, account, records, name)))
    }

    /// The account charged.
    pub fn account(&self) -> &Account {
        &self.0.books
    }

    /// The wrapped allocator.
    pub fn inner(&self) -> &Arc<dyn DeviceAllocator> {
        &self.0.forward.inner
    }

    /// Blocks this allocator has handed out and still holds records of: live,
    /// quarantined, or lost with their device and not yet handed to `forget_lost`
    /// (cold path: reads every record).
    pub fn live_blocks(&self) -> usize {
        self.0.records.len()
    }

    /// Allocates like [`DeviceAllocator::allocate`], with the governor's own error.
    ///
    /// # Errors
    /// [`GovernedAllocError::Refused`] when the account cannot hold the request (or
    /// the real size of the block the inner allocator returned, which is then given
    /// back); [`GovernedAllocError::Allocator`] when the inner allocator fails (the
    /// charge is cancelled then).
    #[inline]
    pub fn try_allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, GovernedAllocError> {
        self.0.allocate_governed(request)
    }
}

/// Whether an inner allocator's failure is one the recovery ladder may cure.
fn for_lack_of_memory(error: &AllocError) -> bool {
    matches!(error, AllocError::OutOfMemory { .. } | AllocError::AdmissionRefused { .. })
}

impl<B: Books> Governed<B> {
    #[inline(always)]
    fn allocate_governed(&self, request: &AllocationRequest) -> Result<RawAllocation, GovernedAllocError> {
        self.allocate_as(request, |error| error)
    }

    /// The allocation path, with its errors in the caller's type (`fail` is called on
    /// cold paths only): the common case builds its result once.
    #[inline(always)]
    fn allocate_as<E>(
        &self,
        request: &AllocationRequest,
        fail: impl FnOnce(GovernedAllocError) -> E,
    ) -> Result<RawAllocation, E> {
        let role = request.role();
        let bytes = request.bytes() as u64;
        if let Err(refusal) = self.books.charge(role, bytes) {
            return Err(fail(GovernedAllocError::Refused(refusal)));
        }
        // Cancels the charge if the inner allocator fails or panics.
        let mut charge = PendingCharge { books: &self.books, role, bytes, armed: true };
        // A cache of the device grew across the inner call: what the process holds is
        // checked against the limit after it (one load here).
        let growth = self.books.tenant().map_or(0, |tenant| tenant.device_books().caches.growth());
        let block = match self.forward.inner.allocate(request) {
            Ok(block) => block,
            Err(error) => match self.books.tenant() {
                Some(tenant) if for_lack_of_memory(&error) => match self.recover(tenant, request, error) {
                    Ok(block) => block,
                    Err(error) => return Err(fail(error)),
                },
                _ => return Err(fail(GovernedAllocError::Allocator(error))),
            },
        };
        charge.armed = false;
        // The books count the block's real size.
        let actual = block.bytes() as u64;
        let governed = if actual == bytes {
            match self.records.insert(block, role, actual) {
                Ok(governed) => governed,
                Err(block) => return Err(fail(self.unrecorded(block, role, actual))),
            }
        } else {
            match self.resized(block, role, bytes, actual) {
                Ok(governed) => governed,
                Err(error) => return Err(fail(error)),
            }
        };
        if let Some(tenant) = self.books.tenant()
            && tenant.device_books().caches.growth() != growth
        {
            return self.check_footprint(tenant, governed, role, actual).map_err(fail);
        }
        Ok(governed)
    }

    /// Rungs (a) and (b) of the recovery ladder, after the inner allocator failed for
    /// lack of memory, each followed by one retry; then (c), the refusal. Runs with no
    /// lock held (the inner allocator returned). The charge stays made throughout.
    #[cold]
    #[inline(never)]
    fn recover(
        &self,
        tenant: &Account,
        request: &AllocationRequest,
        error: AllocError,
    ) -> Result<RawAllocation, GovernedAllocError> {
        let (role, bytes) = (request.role(), request.bytes() as u64);
        let trimmed = tenant.device_books().caches.trim_largest_first(bytes);
        tenant.record_event(TimelineEventKind::Trim, role, trimmed.bytes);
        if trimmed.bytes > 0
            && let Ok(block) = self.forward.inner.allocate(request)
        {
            return Ok(block);
        }
        let reclaimed = tenant.reclaim_for_ladder(role, bytes);
        if reclaimed.is_some_and(|freed| freed > 0)
            && let Ok(block) = self.forward.inner.allocate(request)
        {
            return Ok(block);
        }
        tracing::warn!(allocator = %self.forward.name, error = %error, trimmed = trimmed.bytes, reclaimed = ?reclaimed,
            "inner allocator out of memory after trimming caches and asking reclaim holders");
        match error {
            // A cache's backing refused at the device limit: the governor's refusal.
            AllocError::AdmissionRefused { .. } => Err(GovernedAllocError::Refused(tenant.refuse_over_reserved(
                role,
                bytes,
                tenant.footprint_after(Some(trimmed.bytes)).without(bytes, false),
                reclaimed,
            ))),
            error => Err(GovernedAllocError::Allocator(error)),
        }
    }

    /// A cache grew while serving `governed`: if what the process holds on the device
    /// (allocated + cached) is over its limit, the ladder runs (trim, reclaim), and if
    /// it stays over, the block goes back and the allocation is refused.
    #[cold]
    #[inline(never)]
    fn check_footprint(
        &self,
        tenant: &Account,
        governed: RawAllocation,
        role: MemoryRole,
        bytes: u64,
    ) -> Result<RawAllocation, GovernedAllocError> {
        let books = tenant.device_books();
        let limit = books.limit();
        let over = |trimmed| Some(tenant.footprint_after(trimmed)).filter(|f| f.device_reserved > limit);
        // The block is recorded and charged, but nobody holds it yet: should a cache's
        // figures or trim, or a holder, panic on the ladder, it goes back before the
        // panic goes on (else its charge would stay for good).
        let ladder = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let footprint = over(None)?;
            let trimmed = books.caches.trim_largest_first(footprint.device_reserved - limit);
            tenant.record_event(TimelineEventKind::Trim, role, trimmed.bytes);
            let footprint = over(Some(trimmed.bytes))?;
            let reclaimed = tenant.reclaim_for_ladder(role, footprint.device_reserved - limit);
            Some((over(Some(trimmed.bytes))?, reclaimed))
        }));
        let (footprint, reclaimed) = match ladder {
            Ok(Some(over)) => over,
            Ok(None) => return Ok(governed),
            Err(panic) => {
                let outcome = self.release(governed);
                if !outcome.is_complete() {
                    tracing::warn!(allocator = %self.forward.name, outcome = %outcome.summary(),
                        "a block whose growth check panicked could not be given back");
                }
                std::panic::resume_unwind(panic)
            }
        };
        // The block goes back, and with a trim what its cache grew by for it.
        let outcome = self.release(governed);
        if !outcome.is_complete() {
            tracing::warn!(allocator = %self.forward.name, outcome = %outcome.summary(),
                "a block refused over the device's reserved limit could not be given back");
        }
        books.caches.trim_largest_first(bytes);
        let footprint = footprint.without(bytes, true);
        Err(GovernedAllocError::Refused(tenant.refuse_over_reserved(role, bytes, footprint, reclaimed)))
    }

    /// Charges a block the inner allocator made larger (or smaller) than asked at its
    /// real size, then records it.
    #[cold]
    #[inline(never)]
    fn resized(
        &self,
        block: RawAllocation,
        role: MemoryRole,
        asked: u64,
        actual: u64,
    ) -> Result<RawAllocation, GovernedAllocError> {
        if actual > asked {
            // The growth may run the policy and its holders: should one panic, the
            // block (recorded nowhere yet) and its charge go back before the panic
            // goes on.
            let grown =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.books.grow(role, asked, actual - asked)));
            match grown {
                Ok(Ok(())) => {}
                Ok(Err(refusal)) => {
                    self.give_back_unrecorded(block, role, asked);
                    return Err(GovernedAllocError::Refused(refusal));
                }
                Err(panic) => {
                    self.give_back_unrecorded(block, role, asked);
                    std::panic::resume_unwind(panic)
                }
            }
        } else {
            self.books.refund(role, asked - actual, false);
        }
        self.record(block, role, actual)
    }

    /// Records a block charged `charged` bytes; the governed block.
    #[inline(always)]
    fn record(
        &self,
        block: RawAllocation,
        role: MemoryRole,
        charged: u64,
    ) -> Result<RawAllocation, GovernedAllocError> {
        match self.records.insert(block, role, charged) {
            Ok(governed) => Ok(governed),
            Err(block) => Err(self.unrecorded(block, role, charged)),
        }
    }

    /// The calling thread's part of the record table is full: the block goes back.
    #[cold]
    #[inline(never)]
    fn unrecorded(&self, block: RawAllocation, role: MemoryRole, charged: u64) -> GovernedAllocError {
        self.give_back_unrecorded(block, role, charged);
        GovernedAllocError::Allocator(AllocError::Backend {
            device: self.device(),
            source: BackendError {
                backend: "governor",
                operation: "record",
                code: 0,
                detail: format!(
                    "{} could not record the block: this thread holds 2^24 - 32 governed blocks \
                     (the record table's bound per thread); release some of its blocks first",
                    self.forward.name
                ),
            },
        })
    }

    /// Releases a block the inner allocator made but the governor never handed out,
    /// cancelling its `charged` bytes if the release completes. Otherwise the charge
    /// stays, shown as quarantined: the inner allocator still holds the memory.
    #[cold]
    fn give_back_unrecorded(&self, block: RawAllocation, role: MemoryRole, charged: u64) {
        let outcome = self.forward.inner.release(block);
        if outcome.is_complete() {
            self.books.cancel(role, charged);
        } else {
            self.books.quarantined(role).fetch_add(charged, Ordering::Relaxed);
            tracing::warn!(allocator = %self.forward.name, outcome = %outcome.summary(), charged,
                "could not give back a block the governor did not hand out; its charge stays, quarantined");
        }
    }

    #[cold]
    #[inline(never)]
    fn alloc_error(&self, error: GovernedAllocError) -> AllocError {
        error.into_alloc_error(self.device())
    }

    #[cold]
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
    fn requarantine(&self, record: &Packed, keep: Option<u64>) {
        let quarantined = self.books.quarantined(record.role());
        // Add before subtracting, so that the figure never dips below zero.
        if let Some(keep) = keep {
            quarantined.fetch_add(keep, Ordering::Relaxed);
        }
        if record.quarantined() {
            quarantined.fetch_sub(record.charged, Ordering::Relaxed);
        }
    }
}

impl<B: Books> Governed<B> {
    /// A release the inner allocator did not complete: what it still holds stays
    /// charged (as a quarantine) and the record live under `tag`; an answer about
    /// another block than `sent` is not believed.
    #[cold]
    #[inline(never)]
    fn settle_partial(
        &self,
        mut pending: PendingRelease<'_, B>,
        allocation: RawAllocation,
        outcome: ReleaseOutcome,
    ) -> ReleaseOutcome {
        // `release` took the record before calling here.
        let Some(record) = pending.taken.as_ref().map(|taken| *taken.value()) else {
            return outcome;
        };
        let record = &record;
        let tag = allocation.provider_tag();
        let sent = record.inner(&allocation);
        let outcome = match outcome {
            ReleaseOutcome::Quarantined(q) if !sent.is(q.allocation()) => {
                about_another_block(sent.inner(), q.unmapped_bytes(), q.residual_bytes())
            }
            ReleaseOutcome::Failed(f) if !sent.is(f.allocation()) => about_another_block(sent.inner(), 0, sent.bytes),
            outcome => outcome,
        };
        let role = record.role();
        match outcome {
            ReleaseOutcome::Complete(done) => {
                pending.free();
                self.requarantine(record, None);
                self.books.refund(role, record.charged, true);
                ReleaseOutcome::Complete(done)
            }
            ReleaseOutcome::Quarantined(quarantine) => {
                let keep = (quarantine.residual_bytes() as u64).min(record.charged);
                let (unmapped, residual) = (quarantine.unmapped_bytes(), quarantine.residual_bytes());
                let (block, error) = quarantine.into_parts();
                // The same block as sent (checked above), perhaps under a new inner tag.
                let block = Block::of(&block);
                self.requarantine(record, Some(keep));
                pending.restore(&record.settled(block.tag, keep, true));
                let refunded = record.charged - keep;
                self.books.refund(role, refunded, false);
                tracing::warn!(
                    allocator = %self.forward.name, payer = %self.books.payer(), role = %role,
                    refunded, still_charged = keep, "quarantined release: residual stays charged"
                );
                ReleaseOutcome::quarantined(block.governed(tag), unmapped, residual, error)
            }
            ReleaseOutcome::Failed(failed) => {
                let (block, error) = failed.into_parts();
                let block = Block::of(&block);
                pending.restore(&record.settled(block.tag, record.charged, record.quarantined()));
                ReleaseOutcome::failed(block.governed(tag), error)
            }
        }
    }
}

/// A charge made for an allocation the inner allocator has not returned yet: dropped
/// (on an error or an unwinding panic), it cancels the charge.
struct PendingCharge<'a, B: Books> {
    books: &'a B,
    role: MemoryRole,
    bytes: u64,
    armed: bool,
}

impl<B: Books> Drop for PendingCharge<'_, B> {
    fn drop(&mut self) {
        if self.armed {
            self.books.cancel(self.role, self.bytes);
        }
    }
}

/// A record taken for a release whose inner-allocator call is under way: dropped still
/// holding it (the inner allocator panicked), it keeps the whole block charged as a
/// quarantine, as the registry does, so that a retry or termination can settle it.
struct PendingRelease<'a, B: Books> {
    governed: &'a Governed<B>,
    taken: Option<Taken<'a>>,
}

impl<B: Books> PendingRelease<'_, B> {
    /// The block is gone: the record is freed.
    #[inline]
    fn free(&mut self) {
        if let Some(taken) = self.taken.take() {
            taken.free();
        }
    }

    /// The block is still owned: the record is live again under its tag, holding
    /// `record`.
    #[inline]
    fn restore(&mut self, record: &Packed) {
        if let Some(taken) = self.taken.take() {
            if taken.value() == record { taken.restore() } else { taken.restore_with(record) }
        }
    }
}

impl<B: Books> Drop for PendingRelease<'_, B> {
    fn drop(&mut self) {
        if let Some(taken) = self.taken.take() {
            let record = *taken.value();
            self.governed.requarantine(&record, Some(record.charged));
            taken.restore_with(&record.settled(record.tag, record.charged, true));
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

impl<B: Books> DeviceAllocator for Governed<B> {
    fn device(&self) -> DeviceKey {
        self.forward.inner.device()
    }

    fn name(&self) -> &str {
        &self.forward.name
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.allocate_as(request, |error| self.alloc_error(error))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let mut pending = PendingRelease { governed: self, taken: self.records.take(&allocation) };
        let Some(taken) = &pending.taken else {
            return self.not_owned(allocation);
        };
        // Only what the common case needs is read out of the record.
        let record = taken.value();
        let (inner_tag, role, charged, quarantined) = (record.tag, record.role(), record.charged, record.quarantined());
        let sent = RawAllocation::new(
            allocation.address(),
            allocation.bytes(),
            allocation.align(),
            allocation.device(),
            inner_tag,
        );
        match self.forward.inner.release(sent) {
            // The common case, kept short: the block is gone, so is its charge.
            ReleaseOutcome::Complete(done) => {
                pending.free();
                if quarantined {
                    self.books.quarantined(role).fetch_sub(charged, Ordering::Relaxed);
                }
                self.books.refund(role, charged, true);
                ReleaseOutcome::Complete(done)
            }
            outcome => self.settle_partial(pending, allocation, outcome),
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
            let Some(taken) = self.records.take(&block) else {
                tracing::error!(allocator = %self.forward.name, block = ?block,
                    "lost block was not handed out by this governed allocator; not refunded");
                continue;
            };
            let claim = *taken.value();
            taken.free();
            let role = claim.role();
            self.requarantine(&claim, None);
            self.books.lost(role, claim.charged);
            self.books.refund(role, claim.charged, true);
            inner.push(claim.inner(&block).inner());
        }
        tracing::info!(allocator = %self.forward.name, payer = %self.books.payer(), blocks = inner.len(),
            "lost blocks refunded after termination");
        self.forward.inner.forget_lost(inner);
    }
}

/// Both public allocators are the one [`Governed`] allocator with their payer's books.
macro_rules! delegate_allocator {
    ($name:ty) => {
        impl DeviceAllocator for $name {
            #[inline]
            fn device(&self) -> DeviceKey {
                self.0.device()
            }

            fn name(&self) -> &str {
                self.0.name()
            }

            #[inline]
            fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
                self.0.allocate(request)
            }

            #[inline]
            fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
                self.0.release(allocation)
            }

            fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
                self.0.virtual_backing()
            }

            fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
                self.0.shared_mapping()
            }

            fn stats(&self) -> Option<AllocatorStats> {
                self.0.stats()
            }

            fn trim(&self) -> usize {
                self.0.trim()
            }

            fn forget_lost(&self, lost: Vec<RawAllocation>) {
                self.0.forget_lost(lost)
            }
        }
    };
}

delegate_allocator!(GovernedAllocator);
delegate_allocator!(CacheBacking);

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    /// The record table's tag: owner thread (16 bits), slot (24), generation (24).
    fn owner_and_slot(tag: u64) -> (u64, u64) {
        (tag >> 48, (tag >> 24) & 0xff_ffff)
    }

    fn host_block(address: u64, bytes: usize, tag: u64) -> RawAllocation {
        RawAllocation::new(DeviceAddress::new(address).unwrap(), bytes, 8, DeviceKey::HOST, tag)
    }

    #[test]
    fn records_round_trip_through_their_cells_and_match_only_their_block() {
        let cells = RecordCells::default();
        for (role, device) in [
            (MemoryRole::Weights, DeviceKey::device(7)),
            (MemoryRole::Other, DeviceKey::host(u32::MAX)),
            (MemoryRole::Staging, DeviceKey::disk(3)),
            (MemoryRole::KvCache, DeviceKey::HOST),
        ] {
            let address = DeviceAddress::new(u64::MAX - 1).unwrap();
            let block = Block { address, bytes: 4096, align: 256, device, tag: 99 };
            let record = Packed::new(&block, role, u64::MAX).unwrap();
            cells.store(&record);
            let back = cells.load();
            assert_eq!(back, record);
            assert_eq!((back.role(), back.charged, back.quarantined()), (role, u64::MAX, false));
            let presented = block.governed(12345);
            assert!(back.is(&presented));
            assert_eq!(back.inner(&presented), block, "the inner block, with the inner allocator's tag");
            let settled = back.settled(7, 10, true);
            assert_eq!((settled.tag, settled.charged, settled.quarantined(), settled.role()), (7, 10, true, role));
            assert!(settled.is(&presented) && !settled.settled(7, 10, false).quarantined());
            for other in [
                Block { device: DeviceKey::device(device.index().wrapping_add(1)), ..block },
                Block { device: DeviceKey::host(device.index()), ..block },
                Block { bytes: 4097, ..block },
                Block { align: 128, ..block },
                Block { address: DeviceAddress::new(0x1000).unwrap(), ..block },
            ] {
                assert!(other == block || !back.is(&other.governed(12345)), "{other:?}");
            }
        }
    }

    #[test]
    fn a_full_table_refuses_to_record_and_hands_the_block_back() {
        let records = Records::with_limit(1);
        let first = records.insert(host_block(0x4000, 64, 7), MemoryRole::KvCache, 64);
        let first = first.expect("one record fits");
        let back = records.insert(host_block(0x8000, 32, 9), MemoryRole::KvCache, 32).expect_err("the table is full");
        assert_eq!((back.address().get(), back.provider_tag()), (0x8000, 9));
        let taken = records.take(&first).expect("the first record is there");
        assert_eq!((taken.value().tag, taken.value().charged), (7, 64));
        taken.free();
        assert!(records.take(&first).is_none(), "taken exactly once");
        assert!(records.insert(host_block(0x8000, 32, 9), MemoryRole::KvCache, 32).is_ok(), "its slot is free again");
    }

    #[test]
    fn a_block_that_cannot_be_recorded_is_given_back_and_its_charge_cancelled() {
        use memory_testkit::{Callback, RecordingAllocator};
        let governor = crate::Governor::new();
        let authority = memory_api::IdentityIssuer::new().unwrap().authority().unwrap();
        let account = governor.open_account(crate::AccountConfig::new(DeviceKey::HOST, authority)).unwrap();
        let recording = Arc::new(RecordingAllocator::on_device(DeviceKey::HOST));
        let inner = Arc::clone(&recording) as Arc<dyn DeviceAllocator>;
        let governed = GovernedAllocator::with_records(inner, account.clone(), Records::with_limit(0)).unwrap();
        let request = AllocationRequest::new(4096, 64).unwrap();
        let err = governed.allocate(&request).unwrap_err();
        let AllocError::Backend { source, .. } = &err else { panic!("expected a backend error, got {err}") };
        assert_eq!((source.backend, source.operation), ("governor", "record"));
        assert!(err.to_string().contains("release some of its blocks first"), "{err}");
        assert_eq!(recording.calls(Callback::Release), 1, "the block went back to the inner allocator");
        assert_eq!(governed.live_blocks(), 0);
        let snapshot = account.snapshot();
        assert_eq!((snapshot.current, snapshot.totals.allocations, snapshot.totals.live), (0, 0, 0));
    }

    #[test]
    fn threads_record_in_parts_of_their_own() {
        let records = Arc::new(Records::new());
        let owner_of_a_new_thread = |address: u64| {
            let records = Arc::clone(&records);
            std::thread::spawn(move || {
                let governed = records.insert(host_block(address, 64, 0), MemoryRole::Weights, 64).unwrap();
                owner_and_slot(governed.provider_tag()).0
            })
            .join()
            .unwrap()
        };
        // Two threads alive at once hold different indexes (an exited thread's index is
        // recycled, with its part).
        let first = records.insert(host_block(0x3000, 64, 0), MemoryRole::Weights, 64).unwrap();
        let second = owner_of_a_new_thread(0x1000);
        assert_ne!(owner_and_slot(first.provider_tag()).0, second, "two threads share a part (and its lines)");
        assert_eq!(records.len(), 2);
    }

    #[test]
    fn generations_tell_a_reused_slot_apart_and_a_differing_block_takes_nothing() {
        let records = Records::new();
        let block = |tag| host_block(0x4000, 64, tag);
        // The same block recorded again and again in the same slot: every earlier tag
        // is stale, never a name for the live record.
        let mut stale = Vec::new();
        for _ in 0..8 {
            let governed = records.insert(block(0), MemoryRole::Weights, 64).unwrap();
            let tag = governed.provider_tag();
            assert!(stale.iter().all(|&old| owner_and_slot(old) == owner_and_slot(tag)), "the slot is reused");
            for &old in &stale {
                assert_ne!(old, tag, "a generation came back");
                assert!(records.take(&block(old)).is_none());
            }
            stale.push(tag);
            for other in [host_block(0x8000, 64, tag), host_block(0x4000, 128, tag), block(tag ^ 1)] {
                assert!(records.take(&other).is_none() && records.inner_view(&other).is_none(), "{other:?}");
            }
            assert_eq!(records.inner_view(&governed).map(|inner| inner.provider_tag()), Some(0));
            let taken = records.take(&governed).expect("the live record");
            assert_eq!(taken.value().charged, 64);
            assert!(records.take(&governed).is_none() && records.inner_view(&governed).is_none(), "in transit");
            taken.free();
        }
        assert_eq!(records.len(), 0);
    }
}
