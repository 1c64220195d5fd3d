//! The `registry_ops` fuzz harness: an arbitrary list of registry operations run
//! against a real [`BindingRegistry`] over test-kit allocators, with the registry's
//! promises checked after every step.
//!
//! The harness lives in this library (not in the fuzz target) so that it also runs as
//! an ordinary test on stable Rust (`cargo test` in `fuzz/`), replaying fixed seeds,
//! and so that a crashing input can be replayed with a readable operation list
//! (`cargo test -- --ignored replay` with `FUZZ_INPUT=path`).
//!
//! # What each allocator is
//! Every mechanism gets its own stack, outermost first:
//! [`Ledger`] (this file) → [`RecordingAllocator`] → [`FaultyAllocator`] → [`HostHeap`]
//! (a byte limit keeps arbitrary sizes cheap). The ledger sees exactly the calls the
//! registry makes and remembers every block ever handed out, so it can prove at the
//! allocator boundary that the registry never releases a block twice, never releases or
//! forgets a block it does not own, and at the end that every block was released
//! exactly once or handed to `forget_lost` when its context was confirmed terminated.
//!
//! # Invariants checked after every operation
//! 1. No panic escapes the registry except the panics the input planned (the
//!    [`FaultyAllocator`] panics inside a callback; the registry must propagate it and
//!    stay consistent).
//! 2. Operations the registry refuses make no allocator callback, and every operation
//!    makes only the callbacks its kind allows (a view or an invalidation makes none;
//!    an allocation at most one allocate, plus one release when its identity cannot be
//!    recorded).
//! 3. Success and failure of each cold-path operation agree with a small model of the
//!    lifecycles (select, bind, retire, invalidate, confirm, remove, ...).
//! 4. Every allocation ever made is, by its registry-issued identity, in exactly one of:
//!    live (a handle is held), queued (a deferred release is pending), quarantined,
//!    lost (device lost) or gone, and the ledger agrees (gone = released exactly once
//!    or forgotten at termination); a record with no handle is never live.
//! 5. Snapshots agree with the allocations' states: live counts and bytes, quarantine
//!    entries (unmapped + residual never above the block), in-flight counts (only
//!    queued releases are in flight in this single-threaded harness), selection,
//!    lifecycle states of mechanisms and contexts, registered identities.
//! 6. At the end, after dropping every handle, running every queue, retrying every
//!    quarantine and confirming every lost context, the ledgers hold no live block.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::{Arc, Mutex, MutexGuard, Once, PoisonError};

use arbitrary::Arbitrary;
use memory_api::{
    AllocError, AllocationIdentity, AllocationRequest, AllocatorStats, AuthorityIdentity, DeferredReleaseQueue,
    DeviceAllocator, DeviceKey, IdentityIssuer, MaybeBytes, MechanismIdentity, PreparedRelease,
    ProviderContextIdentity, QueueRefusal, QueueRefusalReason, RawAllocation, ReleaseOutcome, SharedMapping,
    VirtualBacking,
};
use memory_binding::{
    AllocateError, AllocationState, BindError, BindingRegistry, BoundAllocation, ContextState, DropPolicy, HandleError,
    MechanismOptions, MechanismState, MemoryBinding, RegistryError, Rejected, ViewError,
};
use memory_api::ReleaseSummary;
use memory_testkit::{CallCounts, Callback, FaultyAllocator, HostHeap, RecordingAllocator};

/// Bytes each heap may hold at once: arbitrary sizes beyond it are out-of-memory
/// errors, never real allocations.
const HEAP_LIMIT: usize = 4 << 20;
/// Largest alignment asked for (2^16): `HostHeap` over-allocates by the alignment.
const MAX_ALIGN_LOG2: u8 = 16;
/// Operations per input; longer inputs are cut.
const MAX_OPS: usize = 256;
/// The text every planned panic carries (see `FaultyAllocator::panic_on_nth`).
const INJECTED_PANIC: &str = "injected panic in call";

thread_local! {
    /// How often each outcome was reached (`FUZZ_STATS=1` prints them in the tests).
    static OUTCOMES: std::cell::RefCell<BTreeMap<&'static str, u64>> = const { std::cell::RefCell::new(BTreeMap::new()) };
}

/// Counts one outcome (cheap; read by [`outcomes`]).
fn note(what: &'static str) {
    OUTCOMES.with(|o| *o.borrow_mut().entry(what).or_default() += 1);
}

/// The outcomes reached on this thread so far, by name.
pub fn outcomes() -> BTreeMap<&'static str, u64> {
    OUTCOMES.with(|o| o.borrow().clone())
}

// ---------------------------------------------------------------------------------
// The input
// ---------------------------------------------------------------------------------

/// A device.
#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dev {
    /// `DeviceKey::HOST` (drop releases at once by default).
    Host,
    /// `DeviceKey::device(0)` (drop quarantines by default).
    Gpu0,
    /// `DeviceKey::device(1)`.
    Gpu1,
}

impl Dev {
    const ALL: [Dev; 3] = [Dev::Host, Dev::Gpu0, Dev::Gpu1];

    fn key(self) -> DeviceKey {
        match self {
            Dev::Host => DeviceKey::HOST,
            Dev::Gpu0 => DeviceKey::device(0),
            Dev::Gpu1 => DeviceKey::device(1),
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One of ours (an index, wrapped to what exists) or the foreign registry's.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Pick {
    /// Ours, by index modulo the count.
    Ours(u8),
    /// The other registry's.
    Foreign,
}

/// A mechanism's drop policy.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Policy {
    /// `DropPolicy::default_for(device)`.
    Default,
    /// Release at once.
    Release,
    /// Quarantine.
    Quarantine,
    /// Defer to the queue of this device (which may be another device: the queue then
    /// refuses, and the block is quarantined).
    Defer(Dev),
}

/// A requested size.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Size {
    /// 0..=255 bytes.
    Tiny(u8),
    /// 0..=65535 bytes.
    Small(u16),
    /// Anything (mostly refused by the heap's limit or by the request's validation).
    Any(usize),
}

impl Size {
    fn bytes(self) -> usize {
        match self {
            Size::Tiny(b) => usize::from(b),
            Size::Small(b) => usize::from(b),
            Size::Any(b) => b,
        }
    }
}

/// A fault planned on a mechanism's `FaultyAllocator`.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Fault {
    /// The n-th allocate fails with an injected backend error.
    FailAllocate,
    /// The n-th allocate reports out of memory.
    OutOfMemory,
    /// The n-th release fails (nothing mutated).
    FailRelease,
    /// The n-th release is partial (claims are corrected by `ReleaseOutcome::quarantined`).
    QuarantineRelease {
        /// Bytes claimed unmapped.
        unmapped: u16,
        /// Bytes claimed still owned.
        residual: u16,
    },
    /// The n-th allocate panics.
    PanicAllocate,
    /// The n-th release panics.
    PanicRelease,
    /// The n-th `forget_lost` panics.
    PanicForgetLost,
    /// Every pending fault is dropped.
    Clear,
}

/// One registry operation.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Op {
    /// `register_provider_context`.
    RegisterContext(Dev),
    /// `register_authority`.
    RegisterAuthority(Dev),
    /// `register_allocator_with` (a fresh allocator stack on `device`).
    RegisterAllocator {
        /// The context.
        context: Pick,
        /// The authority.
        authority: Pick,
        /// The allocator's device (may disagree with the context's).
        device: Dev,
        /// Its drop policy.
        policy: Policy,
    },
    /// `select`.
    Select(Pick),
    /// `bind`.
    Bind(Dev),
    /// `bind_registered`.
    BindRegistered(Pick),
    /// `with_memory` (a fresh allocator stack on the device).
    WithMemory(Dev),
    /// `MemoryBinding::allocate`.
    Allocate {
        /// The binding.
        binding: Pick,
        /// Bytes.
        size: Size,
        /// Alignment, as a power of two (taken modulo 17).
        align_log2: u8,
    },
    /// `MemoryBinding::release`, through any binding (right or wrong).
    Release {
        /// The binding.
        binding: Pick,
        /// The allocation (among held handles).
        allocation: Pick,
    },
    /// `MemoryBinding::release_deferred` to any device's queue.
    ReleaseDeferred {
        /// The binding.
        binding: Pick,
        /// The allocation (among held handles).
        allocation: Pick,
        /// The queue's device.
        queue: Dev,
    },
    /// `BoundAllocation::view` with an arbitrary range.
    View {
        /// The allocation (among held handles).
        allocation: Pick,
        /// Offset.
        offset: usize,
        /// Length.
        len: usize,
    },
    /// Drops a held allocation handle (the mechanism's drop policy runs).
    DropAllocation(u8),
    /// Drops a binding.
    DropBinding(u8),
    /// Runs up to `count` pending deferred releases of a queue, oldest first.
    RunQueued {
        /// The queue's device.
        queue: Dev,
        /// How many.
        count: u8,
    },
    /// Drops up to `count` pending deferred releases unrun (they are abandoned).
    AbandonQueued {
        /// The queue's device.
        queue: Dev,
        /// How many.
        count: u8,
    },
    /// `retire`.
    Retire(Pick),
    /// `invalidate_device`.
    InvalidateDevice(Dev),
    /// `confirm_context_terminated`.
    ConfirmTerminated(Pick),
    /// `remove`.
    Remove(Pick),
    /// `remove_provider_context`.
    RemoveContext(Pick),
    /// `remove_authority`.
    RemoveAuthority(Pick),
    /// `retry_quarantined`.
    RetryQuarantined(Pick),
    /// Plans a fault on the `n`-th (1..=4) matching call of a mechanism's allocator.
    Inject {
        /// The mechanism (by index among all ever registered).
        mechanism: u8,
        /// What.
        fault: Fault,
        /// Which call from now.
        nth: u8,
    },
}

/// A whole fuzz input.
#[derive(Arbitrary, Debug, Clone)]
pub struct Input {
    /// Caps every identity counter of the registry at `1 + limit % 600` (exhaustion
    /// paths: below 256 no block of binding ids or generations fits at all; above it,
    /// one block per kind does).
    pub serial_limit: Option<u16>,
    /// Capacity of each device's deferred-release queue (modulo 4).
    pub queue_capacity: u8,
    /// The operations, in order.
    pub ops: Vec<Op>,
}

// ---------------------------------------------------------------------------------
// The ledger: an allocator wrapper that audits what the registry does
// ---------------------------------------------------------------------------------

/// Where a block the ledger handed out stands.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum BlockStatus {
    /// Handed out, not yet released.
    Live,
    /// Released completely (exactly once).
    Freed,
    /// Handed to `forget_lost` (its context was confirmed terminated).
    Forgotten,
}

#[derive(Debug)]
struct Block {
    address: u64,
    bytes: usize,
    align: usize,
    tag: u64,
    status: BlockStatus,
}

#[derive(Default, Debug)]
struct Book {
    /// Every block ever handed out, by serial.
    blocks: BTreeMap<u64, Block>,
    /// Live or forgotten blocks (the heap still holds them) by address.
    by_address: HashMap<u64, u64>,
    next: u64,
}

/// The outermost allocator of a mechanism: forwards every call and audits it.
pub struct Ledger {
    inner: RecordingAllocator<FaultyAllocator<HostHeap>>,
    book: Mutex<Book>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Ledger {
    fn new(device: DeviceKey) -> Ledger {
        let heap = HostHeap::on_device(device).with_limit(HEAP_LIMIT);
        Ledger { inner: RecordingAllocator::new(FaultyAllocator::new(heap)), book: Mutex::new(Book::default()) }
    }

    fn faulty(&self) -> &FaultyAllocator<HostHeap> {
        self.inner.inner()
    }

    fn counts(&self) -> CallCounts {
        self.inner.counts()
    }

    /// The serial of the live block at `address`.
    fn serial_at(&self, address: u64) -> Option<u64> {
        let book = lock(&self.book);
        let serial = *book.by_address.get(&address)?;
        (book.blocks[&serial].status == BlockStatus::Live).then_some(serial)
    }

    fn status(&self, serial: u64) -> Option<BlockStatus> {
        lock(&self.book).blocks.get(&serial).map(|b| b.status)
    }

    fn live_count(&self) -> usize {
        lock(&self.book).blocks.values().filter(|b| b.status == BlockStatus::Live).count()
    }

    /// Frees every block the heap still holds (forgotten or leaked with the registry),
    /// straight through the heap, so the fuzzer's memory does not grow across inputs.
    /// Only called once the registry and every handle are gone.
    fn reclaim(&self) {
        let mut book = lock(&self.book);
        let heap = self.faulty().inner();
        let device = heap.device();
        let held: Vec<u64> = book.by_address.values().copied().collect();
        for serial in held {
            let block = &book.blocks[&serial];
            let Some(address) = memory_api::DeviceAddress::new(block.address) else { continue };
            let raw = RawAllocation::new(address, block.bytes, block.align, device, block.tag);
            let _ = heap.release(raw);
        }
        book.by_address.clear();
    }

    /// Checks that `raw` is a live block of this ledger, exactly as handed out.
    fn audit(&self, book: &Book, raw: &RawAllocation, what: &str) -> u64 {
        let Some(&serial) = book.by_address.get(&raw.address().get()) else {
            panic!("invariant: the registry {what} a block this allocator never handed out (or already freed): {raw:?}")
        };
        let block = &book.blocks[&serial];
        assert_eq!(
            block.status,
            BlockStatus::Live,
            "invariant: the registry {what} block #{serial} after it was {:?}: {raw:?}",
            block.status
        );
        assert!(
            block.bytes == raw.bytes() && block.align == raw.align() && block.tag == raw.provider_tag(),
            "invariant: the registry {what} a block that differs from the one handed out: {block:?} vs {raw:?}"
        );
        serial
    }
}

impl DeviceAllocator for Ledger {
    fn device(&self) -> DeviceKey {
        self.inner.device()
    }

    fn name(&self) -> &str {
        "fuzz-ledger"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let raw = self.inner.allocate(request)?;
        let mut book = lock(&self.book);
        let serial = book.next;
        book.next += 1;
        let previous = book.by_address.insert(raw.address().get(), serial);
        assert!(previous.is_none(), "test-kit heap handed out a live address twice: {raw:?}");
        book.blocks.insert(
            serial,
            Block {
                address: raw.address().get(),
                bytes: raw.bytes(),
                align: raw.align(),
                tag: raw.provider_tag(),
                status: BlockStatus::Live,
            },
        );
        Ok(raw)
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let serial = self.audit(&lock(&self.book), &allocation, "released");
        let outcome = self.inner.release(allocation);
        if outcome.is_complete() {
            let mut book = lock(&self.book);
            let block = book.blocks.get_mut(&serial).expect("audited above");
            block.status = BlockStatus::Freed;
            let address = block.address;
            book.by_address.remove(&address);
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
        {
            // Booked before forwarding: a planned panic below must not hide the handoff.
            let mut book = lock(&self.book);
            for raw in &lost {
                let serial = self.audit(&book, raw, "forgot");
                book.blocks.get_mut(&serial).expect("audited above").status = BlockStatus::Forgotten;
            }
        }
        self.inner.forget_lost(lost);
    }
}

impl fmt::Debug for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ledger").field("device", &self.device()).field("live", &self.live_count()).finish()
    }
}

// ---------------------------------------------------------------------------------
// The deferred-release queue
// ---------------------------------------------------------------------------------

/// A bounded queue that holds prepared releases until an operation runs or abandons them.
struct HeldQueue {
    device: DeviceKey,
    capacity: usize,
    held: Mutex<Vec<PreparedRelease>>,
}

impl DeferredReleaseQueue for HeldQueue {
    fn device(&self) -> DeviceKey {
        self.device
    }

    fn enqueue(&self, release: PreparedRelease) -> Result<(), QueueRefusal> {
        if release.device() != self.device {
            let reason = QueueRefusalReason::WrongDevice { queue: self.device, release: release.device() };
            return Err(QueueRefusal { release, reason });
        }
        let mut held = lock(&self.held);
        if held.len() >= self.capacity {
            return Err(QueueRefusal { release, reason: QueueRefusalReason::Full { capacity: self.capacity } });
        }
        held.push(release);
        Ok(())
    }
}

impl HeldQueue {
    /// Takes up to `count` releases, oldest first (the lock is released before they run).
    fn take(&self, count: usize) -> Vec<PreparedRelease> {
        let mut held = lock(&self.held);
        let n = count.min(held.len());
        held.drain(..n).collect()
    }

    fn contains(&self, identity: &AllocationIdentity) -> bool {
        lock(&self.held).iter().any(|r| r.identity() == identity)
    }

    fn count_for(&self, mechanism: &MechanismIdentity) -> usize {
        lock(&self.held).iter().filter(|r| r.identity().binding().mechanism() == *mechanism).count()
    }
}

// ---------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Life {
    Active,
    Retired,
    Lost,
    Terminated,
}

impl Life {
    fn state(self) -> MechanismState {
        match self {
            Life::Active => MechanismState::Active,
            Life::Retired => MechanismState::Retired,
            Life::Lost => MechanismState::DeviceLost,
            Life::Terminated => MechanismState::Terminated,
        }
    }
}

struct Ctx {
    id: ProviderContextIdentity,
    device: DeviceKey,
    state: ContextState,
    removed: bool,
}

struct Auth {
    id: AuthorityIdentity,
    device: DeviceKey,
    removed: bool,
}

struct Mech {
    id: MechanismIdentity,
    device: DeviceKey,
    context: ProviderContextIdentity,
    authority: AuthorityIdentity,
    ledger: Arc<Ledger>,
    life: Life,
    removed: bool,
}

struct Bound {
    binding: MemoryBinding,
    mech: usize,
}

struct Alloc {
    identity: AllocationIdentity,
    mech: usize,
    serial: u64,
    bytes: usize,
    handle: Option<BoundAllocation>,
}

/// The other registry, whose identities and handles must be refused as foreign.
struct Foreign {
    ledger: Arc<Ledger>,
    context: ProviderContextIdentity,
    authority: AuthorityIdentity,
    mechanism: MechanismIdentity,
    binding: MemoryBinding,
    allocation: Option<BoundAllocation>,
    // Declared last: dropped after the handles above (kept only to own the registry).
    _registry: BindingRegistry,
}

impl Foreign {
    fn new() -> Foreign {
        let registry = BindingRegistry::new();
        let ledger = Arc::new(Ledger::new(DeviceKey::HOST));
        let context = registry.register_provider_context(DeviceKey::HOST, Arc::new(())).expect("foreign context");
        let authority = registry.register_authority(DeviceKey::HOST, Arc::new(())).expect("foreign authority");
        let mechanism = registry
            .register_allocator(&context, &authority, Arc::clone(&ledger) as Arc<dyn DeviceAllocator>)
            .expect("foreign mechanism");
        let binding = registry.bind_registered(&mechanism).expect("foreign binding");
        let request = AllocationRequest::new(64, 8).expect("request");
        let allocation = Some(binding.allocate(request).expect("foreign allocation"));
        Foreign { ledger, context, authority, mechanism, binding, allocation, _registry: registry }
    }
}

/// Which callbacks an operation may make, per allocator stack.
#[derive(Clone, Copy)]
enum Allowed {
    /// None at all (refusals, cold-path operations, views).
    Nothing,
    /// Only these callbacks, on any of our stacks.
    Only(&'static [Callback]),
    /// Anything (a planned panic cut the operation short).
    Anything,
}

/// The harness state for one input.
pub struct World {
    limited: bool,
    registry: BindingRegistry,
    foreign: Foreign,
    queues: [Arc<HeldQueue>; 3],
    contexts: Vec<Ctx>,
    authorities: Vec<Auth>,
    mechs: Vec<Mech>,
    bindings: Vec<Bound>,
    allocs: Vec<Alloc>,
    selection: [Option<usize>; 3],
    /// What the operation being run may call.
    allowed: Allowed,
    /// Human-readable trace of the operations run (printed on a failed invariant).
    pub trace: Vec<String>,
}

fn pick(index: u8, len: usize) -> Option<usize> {
    (len > 0).then(|| usize::from(index) % len)
}

fn is_identity_error(error: &RegistryError) -> bool {
    matches!(error, RegistryError::Identity(_))
}

/// Whether a panic payload is one the input planned.
fn injected(payload: &(dyn std::any::Any + Send)) -> bool {
    let text = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("");
    text.contains(INJECTED_PANIC)
}

/// Installs (once) a panic hook that stays silent for planned panics and defers to
/// the previous hook (libFuzzer's, which aborts) for every other panic.
pub fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !injected(info.payload()) {
                previous(info);
            }
        }));
    });
}

impl World {
    fn new(input: &Input) -> World {
        let registry = match input.serial_limit {
            Some(limit) => BindingRegistry::with_issuer(
                IdentityIssuer::with_serial_limit(1 + u64::from(limit % 600)).expect("a registry id"),
            ),
            None => BindingRegistry::new(),
        };
        let capacity = usize::from(input.queue_capacity % 4);
        let queue = |dev: Dev| Arc::new(HeldQueue { device: dev.key(), capacity, held: Mutex::new(Vec::new()) });
        World {
            limited: input.serial_limit.is_some(),
            registry,
            foreign: Foreign::new(),
            queues: [queue(Dev::Host), queue(Dev::Gpu0), queue(Dev::Gpu1)],
            contexts: Vec::new(),
            authorities: Vec::new(),
            mechs: Vec::new(),
            bindings: Vec::new(),
            allocs: Vec::new(),
            selection: [None; 3],
            allowed: Allowed::Nothing,
            trace: Vec::new(),
        }
    }

    fn dev_index(device: DeviceKey) -> usize {
        Dev::ALL.iter().position(|d| d.key() == device).expect("one of the three devices")
    }

    fn stacks(&self) -> impl Iterator<Item = &Arc<Ledger>> {
        // The foreign stack first: stacks registered later append, so indices are stable.
        std::iter::once(&self.foreign.ledger).chain(self.mechs.iter().map(|m| &m.ledger))
    }

    fn counts(&self) -> Vec<CallCounts> {
        self.stacks().map(|l| l.counts()).collect()
    }

    fn queued_for(&self, mechanism: &MechanismIdentity) -> usize {
        self.queues.iter().map(|q| q.count_for(mechanism)).sum()
    }

    fn queued(&self, identity: &AllocationIdentity) -> bool {
        self.queues.iter().any(|q| q.contains(identity))
    }

    fn held(&self) -> Vec<usize> {
        (0..self.allocs.len()).filter(|&i| self.allocs[i].handle.is_some()).collect()
    }

    // --- running one operation --------------------------------------------------

    /// Runs `op`, catching a planned panic, then checks every invariant.
    pub fn step(&mut self, op: Op) {
        self.checked(format!("{op:?}"), |world| world.apply(op));
    }

    /// Runs `f` (one operation), catching a planned panic, then checks that it made
    /// only the callbacks it may make and every invariant.
    fn checked(&mut self, label: String, f: impl FnOnce(&mut World)) {
        self.trace.push(label);
        let before = self.counts();
        self.allowed = Allowed::Nothing;
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f(self))) {
            if !injected(&*payload) {
                resume_unwind(payload);
            }
            // Every operation that can panic took its handle out of the model before
            // the call; the invariant check finds where the block went.
            self.trace.push("  (planned panic)".to_owned());
            note("planned panic caught");
            self.allowed = Allowed::Anything;
        }
        self.check_callbacks(&before);
        self.check();
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::RegisterContext(dev) => match self.registry.register_provider_context(dev.key(), Arc::new(())) {
                Ok(id) => self.contexts.push(Ctx { id, device: dev.key(), state: ContextState::Live, removed: false }),
                Err(e) => assert!(self.limited && is_identity_error(&e), "register_provider_context: {e}"),
            },
            Op::RegisterAuthority(dev) => match self.registry.register_authority(dev.key(), Arc::new(())) {
                Ok(id) => self.authorities.push(Auth { id, device: dev.key(), removed: false }),
                Err(e) => assert!(self.limited && is_identity_error(&e), "register_authority: {e}"),
            },
            Op::RegisterAllocator { context, authority, device, policy } => {
                self.register_allocator(context, authority, device, policy)
            }
            Op::Select(mech) => self.select(mech),
            Op::Bind(dev) => self.bind(dev),
            Op::BindRegistered(mech) => self.bind_registered(mech),
            Op::WithMemory(dev) => self.with_memory(dev),
            Op::Allocate { binding, size, align_log2 } => self.allocate(binding, size, align_log2),
            Op::Release { binding, allocation } => self.release(binding, allocation),
            Op::ReleaseDeferred { binding, allocation, queue } => self.release_deferred(binding, allocation, queue),
            Op::View { allocation, offset, len } => self.view(allocation, offset, len),
            Op::DropAllocation(i) => self.drop_allocation(i),
            Op::DropBinding(i) => {
                if let Some(i) = pick(i, self.bindings.len()) {
                    drop(self.bindings.swap_remove(i));
                }
            }
            Op::RunQueued { queue, count } => {
                self.allowed = Allowed::Only(&[Callback::Release]);
                for release in self.queues[queue.index()].take(usize::from(count % 4) + 1) {
                    release.execute();
                }
            }
            Op::AbandonQueued { queue, count } => {
                drop(self.queues[queue.index()].take(usize::from(count % 4) + 1));
            }
            Op::Retire(mech) => self.retire(mech),
            Op::InvalidateDevice(dev) => self.invalidate(dev),
            Op::ConfirmTerminated(context) => self.confirm(context),
            Op::Remove(mech) => self.remove(mech),
            Op::RemoveContext(context) => self.remove_context(context),
            Op::RemoveAuthority(authority) => self.remove_authority(authority),
            Op::RetryQuarantined(mech) => self.retry(mech),
            Op::Inject { mechanism, fault, nth } => self.inject(mechanism, fault, nth),
        }
    }

    fn context_id(&self, pick_: Pick) -> Option<(ProviderContextIdentity, Option<usize>)> {
        match pick_ {
            Pick::Foreign => Some((self.foreign.context, None)),
            Pick::Ours(i) => pick(i, self.contexts.len()).map(|i| (self.contexts[i].id, Some(i))),
        }
    }

    fn authority_id(&self, pick_: Pick) -> Option<(AuthorityIdentity, Option<usize>)> {
        match pick_ {
            Pick::Foreign => Some((self.foreign.authority, None)),
            Pick::Ours(i) => pick(i, self.authorities.len()).map(|i| (self.authorities[i].id, Some(i))),
        }
    }

    fn mech_id(&self, pick_: Pick) -> Option<(MechanismIdentity, Option<usize>)> {
        match pick_ {
            Pick::Foreign => Some((self.foreign.mechanism, None)),
            Pick::Ours(i) => pick(i, self.mechs.len()).map(|i| (self.mechs[i].id, Some(i))),
        }
    }

    /// A live (registered, not removed) mechanism of ours.
    fn registered(&self, index: Option<usize>) -> Option<usize> {
        index.filter(|&i| !self.mechs[i].removed)
    }

    fn register_allocator(&mut self, context: Pick, authority: Pick, device: Dev, policy: Policy) {
        let (Some((ctx_id, ctx)), Some((auth_id, auth))) = (self.context_id(context), self.authority_id(authority))
        else {
            return;
        };
        let ledger = Arc::new(Ledger::new(device.key()));
        let drop_policy = match policy {
            Policy::Default => None,
            Policy::Release => Some(DropPolicy::Release),
            Policy::Quarantine => Some(DropPolicy::Quarantine),
            Policy::Defer(dev) => {
                Some(DropPolicy::Defer(Arc::clone(&self.queues[dev.index()]) as Arc<dyn DeferredReleaseQueue>))
            }
        };
        let options = MechanismOptions::default().with_drop_policy(drop_policy);
        // Registered and every precondition holds: the model expects success.
        let ctx_entry = ctx.map(|i| &self.contexts[i]).filter(|c| !c.removed);
        let auth_ok = auth.is_some_and(|i| !self.authorities[i].removed);
        let auth_device = auth.map(|i| self.authorities[i].device);
        let expect_ok = ctx_entry.is_some_and(|c| {
            c.state == ContextState::Live && auth_ok && auth_device == Some(c.device) && c.device == device.key()
        });
        if expect_ok {
            // Admitted registrations ask once for each capability (the safe path checks
            // that they are part of the allocator); refused ones make no callback.
            self.allowed = Allowed::Only(&[Callback::VirtualBacking, Callback::SharedMapping]);
        }
        let result = self.registry.register_allocator_with(
            &ctx_id,
            &auth_id,
            Arc::clone(&ledger) as Arc<dyn DeviceAllocator>,
            options,
        );
        match result {
            Ok(id) => {
                assert!(expect_ok, "register_allocator succeeded against the model: {id}");
                note("register_allocator: ok");
                self.push_mech(id, device.key(), ctx_id, auth_id, ledger);
            }
            Err(e) => {
                note("register_allocator: refused");
                assert!(
                    !expect_ok || (self.limited && is_identity_error(&e)),
                    "register_allocator failed although every precondition holds: {e}"
                )
            }
        }
    }

    fn push_mech(
        &mut self,
        id: MechanismIdentity,
        device: DeviceKey,
        context: ProviderContextIdentity,
        authority: AuthorityIdentity,
        ledger: Arc<Ledger>,
    ) {
        let d = World::dev_index(device);
        let index = self.mechs.len();
        self.mechs.push(Mech { id, device, context, authority, ledger, life: Life::Active, removed: false });
        if self.selection[d].is_none() {
            self.selection[d] = Some(index);
        }
    }

    fn select(&mut self, mech: Pick) {
        let Some((id, index)) = self.mech_id(mech) else { return };
        let index = self.registered(index);
        let expect_ok = index.is_some_and(|i| self.mechs[i].life == Life::Active);
        match self.registry.select(&id) {
            Ok(_) => {
                assert!(expect_ok, "select succeeded against the model");
                let i = index.expect("expected");
                self.selection[World::dev_index(self.mechs[i].device)] = Some(i);
            }
            Err(e) => assert!(!expect_ok || (self.limited && is_identity_error(&e)), "select failed: {e}"),
        }
    }

    fn push_binding(&mut self, binding: MemoryBinding) {
        let id = binding.identity().mechanism();
        let mech = self.mechs.iter().position(|m| m.id == id).expect("a binding of one of our mechanisms");
        self.bindings.push(Bound { binding, mech });
    }

    fn bind(&mut self, dev: Dev) {
        let selected = self.selection[dev.index()];
        match self.registry.bind(dev.key()) {
            Ok(binding) => {
                let mech = binding.identity().mechanism();
                assert_eq!(selected.map(|i| self.mechs[i].id), Some(mech), "bind used another mechanism");
                self.push_binding(binding);
            }
            Err(BindError::NoSelection { .. }) => assert!(selected.is_none(), "bind found no selection"),
            Err(BindError::Registry(e)) if self.limited && is_identity_error(&e) => {}
            Err(e) => panic!("bind failed with a selection in place: {e}"),
        }
    }

    fn bind_registered(&mut self, mech: Pick) {
        let Some((id, index)) = self.mech_id(mech) else { return };
        if index.is_none() {
            // A foreign mechanism must be refused as foreign.
            let err = self.registry.bind_registered(&id).expect_err("a foreign mechanism was bound");
            assert!(
                matches!(err, BindError::Registry(RegistryError::ForeignRegistry { .. })),
                "foreign mechanism: {err}"
            );
            return;
        }
        let index = self.registered(index);
        let expect_ok = index.is_some_and(|i| self.mechs[i].life == Life::Active);
        match self.registry.bind_registered(&id) {
            Ok(binding) => {
                assert!(expect_ok, "bind_registered succeeded against the model");
                self.push_binding(binding);
            }
            Err(BindError::Registry(e)) if self.limited && is_identity_error(&e) => {}
            Err(e) => assert!(!expect_ok, "bind_registered failed: {e}"),
        }
    }

    fn with_memory(&mut self, dev: Dev) {
        let ledger = Arc::new(Ledger::new(dev.key()));
        self.allowed = Allowed::Only(&[Callback::VirtualBacking, Callback::SharedMapping]);
        let result = self.registry.with_memory(Arc::clone(&ledger) as Arc<dyn DeviceAllocator>);
        // Pick up whatever was registered (all of it on success; a prefix when
        // identities ran out).
        let snapshot = self.registry.snapshots();
        for c in &snapshot.contexts {
            if !self.contexts.iter().any(|k| k.id == c.identity) {
                self.contexts.push(Ctx { id: c.identity, device: c.device, state: c.state, removed: false });
            }
        }
        for a in &snapshot.authorities {
            if !self.authorities.iter().any(|k| k.id == a.identity) {
                self.authorities.push(Auth { id: a.identity, device: a.device, removed: false });
            }
        }
        for m in &snapshot.mechanisms {
            if !self.mechs.iter().any(|k| k.id == m.identity) {
                self.push_mech(m.identity, m.device, m.context, m.authority, Arc::clone(&ledger));
            }
        }
        match result {
            Ok(binding) => self.push_binding(binding),
            Err(BindError::Registry(e)) if self.limited && is_identity_error(&e) => {}
            Err(e) => panic!("with_memory failed: {e}"),
        }
    }

    fn binding(&self, pick_: Pick) -> Option<(&MemoryBinding, Option<usize>)> {
        match pick_ {
            Pick::Foreign => Some((&self.foreign.binding, None)),
            Pick::Ours(i) => pick(i, self.bindings.len()).map(|i| (&self.bindings[i].binding, Some(i))),
        }
    }

    fn allocate(&mut self, binding: Pick, size: Size, align_log2: u8) {
        let Pick::Ours(b) = binding else { return };
        let Some(b) = pick(b, self.bindings.len()) else { return };
        let Ok(request) = AllocationRequest::new(size.bytes(), 1usize << (align_log2 % (MAX_ALIGN_LOG2 + 1))) else {
            return;
        };
        let mech = self.bindings[b].mech;
        let life = self.mechs[mech].life;
        self.allowed = Allowed::Only(&[Callback::Allocate]);
        match self.bindings[b].binding.allocate(request) {
            Ok(handle) => {
                assert_eq!(life, Life::Active, "allocate succeeded on a {life:?} mechanism");
                assert!(handle.bytes() >= request.bytes() && handle.address().is_aligned_to(request.align()));
                let identity = handle.identity().expect("a live handle has an identity");
                assert_eq!(
                    *identity.binding(),
                    self.bindings[b].binding.identity(),
                    "allocation names another binding"
                );
                let ledger = &self.mechs[mech].ledger;
                let serial = ledger
                    .serial_at(handle.address().get())
                    .unwrap_or_else(|| panic!("invariant: allocation {identity} is not a live block of its allocator"));
                let bytes = handle.bytes();
                self.allocs.push(Alloc { identity, mech, serial, bytes, handle: Some(handle) });
                note("allocate: ok");
            }
            Err(AllocateError::Inactive { state, .. }) => {
                assert_eq!(life, Life::Retired, "allocate refused as {state}");
                note("allocate: inactive");
                self.allowed = Allowed::Nothing;
            }
            Err(AllocateError::DeviceLost { .. }) => {
                assert!(matches!(life, Life::Lost | Life::Terminated), "allocate refused as device lost on {life:?}");
                note("allocate: device lost");
                self.allowed = Allowed::Nothing;
            }
            Err(AllocateError::Allocator(e)) => {
                assert_eq!(life, Life::Active, "the allocator was called on a {life:?} mechanism ({e})");
                note("allocate: allocator error");
            }
            Err(AllocateError::Identity(e)) => {
                assert!(self.limited, "identity exhaustion without a limit: {e}");
                note("allocate: identities exhausted");
                // The block was made, then given straight back.
                self.allowed = Allowed::Only(&[Callback::Allocate, Callback::Release]);
            }
            Err(e) => panic!("allocate failed unexpectedly: {e}"),
        }
    }

    /// Takes a held allocation out of the model (ours or the foreign one).
    fn take_handle(&mut self, allocation: Pick) -> Option<(BoundAllocation, Option<usize>)> {
        match allocation {
            Pick::Foreign => self.foreign.allocation.take().map(|h| (h, None)),
            Pick::Ours(i) => {
                let held = self.held();
                let i = held[pick(i, held.len())?];
                self.allocs[i].handle.take().map(|h| (h, Some(i)))
            }
        }
    }

    fn put_back(&mut self, handle: BoundAllocation, index: Option<usize>) {
        match index {
            None => self.foreign.allocation = Some(handle),
            Some(i) => {
                assert_eq!(handle.identity(), Some(self.allocs[i].identity), "a refused release changed the handle");
                self.allocs[i].handle = Some(handle);
            }
        }
    }

    /// Whether `binding` made allocation `index` (the foreign ones are never ours).
    fn owns(&self, binding: Option<usize>, index: Option<usize>) -> bool {
        match (binding, index) {
            (Some(b), Some(i)) => self.bindings[b].binding.identity() == *self.allocs[i].identity.binding(),
            (None, None) => true,
            _ => false,
        }
    }

    fn release(&mut self, binding: Pick, allocation: Pick) {
        if matches!((binding, allocation), (Pick::Foreign, Pick::Foreign)) {
            return;
        }
        let Some((b, b_index)) = self.binding(binding).map(|(b, i)| (b.clone(), i)) else { return };
        let Some((handle, index)) = self.take_handle(allocation) else { return };
        let owns = self.owns(b_index, index);
        let life = index.map(|i| self.mechs[self.allocs[i].mech].life);
        self.allowed = Allowed::Only(&[Callback::Release]);
        match b.release(handle) {
            Ok(report) => {
                assert!(owns, "a release through the wrong binding was accepted");
                assert!(matches!(life, Some(Life::Active | Life::Retired)), "release accepted on {life:?}");
                let i = index.expect("ours");
                let state = self.registry.allocation_state(&self.allocs[i].identity);
                match report {
                    ReleaseSummary::Complete { .. } => {
                        note("release: complete");
                        assert_eq!(state, AllocationState::Gone)
                    }
                    ReleaseSummary::Quarantined { unmapped_bytes, residual_bytes } => {
                        note("release: quarantined");
                        assert_eq!(state, AllocationState::Quarantined);
                        assert!(unmapped_bytes.checked_add(residual_bytes).is_some_and(|t| t <= self.allocs[i].bytes));
                    }
                    _ => panic!("unknown release report {report:?}"),
                }
            }
            Err(Rejected { handle, reason }) => {
                match &reason {
                    HandleError::ReleaseFailed(_) => {
                        note("release: refused by the allocator");
                        assert!(owns && matches!(life, Some(Life::Active | Life::Retired)), "refused by the allocator")
                    }
                    HandleError::ForeignRegistry { .. } | HandleError::BindingMismatch { .. } => {
                        note("release: wrong binding or registry");
                        assert!(!owns, "the right binding was refused: {reason}");
                        self.allowed = Allowed::Nothing;
                    }
                    HandleError::DeviceLost { .. } => {
                        note("release: device lost");
                        assert!(owns && life == Some(Life::Lost), "refused as device lost on {life:?}");
                        self.allowed = Allowed::Nothing;
                    }
                    HandleError::StaleAllocation => {
                        note("release: stale after termination");
                        assert!(owns && life == Some(Life::Terminated), "refused as stale on {life:?}");
                        self.allowed = Allowed::Nothing;
                    }
                    other => panic!("release refused unexpectedly: {other}"),
                }
                self.put_back(handle, index);
            }
        }
    }

    fn release_deferred(&mut self, binding: Pick, allocation: Pick, queue: Dev) {
        if matches!((binding, allocation), (Pick::Foreign, Pick::Foreign)) {
            return;
        }
        let Some((b, b_index)) = self.binding(binding).map(|(b, i)| (b.clone(), i)) else { return };
        let Some((handle, index)) = self.take_handle(allocation) else { return };
        let owns = self.owns(b_index, index);
        let life = index.map(|i| self.mechs[self.allocs[i].mech].life);
        let queue = Arc::clone(&self.queues[queue.index()]);
        let full = lock(&queue.held).len() >= queue.capacity;
        let same_device = queue.device == b.device();
        // A deferral makes no allocator callback at all: the queue runs it later.
        self.allowed = Allowed::Nothing;
        match b.release_deferred(handle, &*queue) {
            Ok(()) => {
                assert!(owns && same_device && !full, "a deferral was accepted against the model");
                assert!(matches!(life, Some(Life::Active | Life::Retired)), "deferral accepted on {life:?}");
                let i = index.expect("ours");
                assert!(queue.contains(&self.allocs[i].identity), "the queue does not hold the deferred release");
                note("defer: queued");
            }
            Err(Rejected { handle, reason }) => {
                let expected = match &reason {
                    HandleError::ForeignRegistry { .. } | HandleError::BindingMismatch { .. } => !owns,
                    HandleError::QueueRefused(QueueRefusalReason::WrongDevice { .. }) => owns && !same_device,
                    HandleError::DeviceLost { .. } => owns && life == Some(Life::Lost),
                    HandleError::StaleAllocation => owns && life == Some(Life::Terminated),
                    HandleError::QueueRefused(QueueRefusalReason::Full { .. }) => owns && full,
                    _ => false,
                };
                assert!(expected, "deferral refused against the model: {reason} (life {life:?})");
                note("defer: refused");
                self.put_back(handle, index);
            }
        }
    }

    fn view(&mut self, allocation: Pick, offset: usize, len: usize) {
        let (handle, life) = match allocation {
            Pick::Foreign => match &self.foreign.allocation {
                Some(h) => (h, Life::Active),
                None => return,
            },
            Pick::Ours(i) => {
                let held = self.held();
                let Some(k) = pick(i, held.len()) else { return };
                let a = &self.allocs[held[k]];
                (a.handle.as_ref().expect("held"), self.mechs[a.mech].life)
            }
        };
        let inside = offset.checked_add(len).is_some_and(|end| end <= handle.bytes());
        match handle.view(offset, len) {
            Ok(view) => {
                assert!(inside, "a view outside the allocation was made");
                assert!(matches!(life, Life::Active | Life::Retired), "a view was made on a {life:?} mechanism");
                assert_eq!((view.offset(), view.len()), (offset, len));
                assert_eq!(view.address().get(), handle.address().get() + offset as u64);
                note("view: ok");
            }
            Err(ViewError::OutOfBounds { .. }) => {
                note("view: out of bounds");
                assert!(!inside, "an in-bounds view was refused")
            }
            Err(ViewError::Handle(HandleError::DeviceLost { .. })) => assert_eq!(life, Life::Lost),
            Err(ViewError::Handle(HandleError::StaleAllocation)) => assert_eq!(life, Life::Terminated),
            Err(e) => panic!("view failed unexpectedly: {e}"),
        }
    }

    fn drop_allocation(&mut self, i: u8) {
        let held = self.held();
        let Some(k) = pick(i, held.len()) else { return };
        let handle = self.allocs[held[k]].handle.take().expect("held");
        // Drop policy Release calls release; Defer and Quarantine call nothing.
        self.allowed = Allowed::Only(&[Callback::Release]);
        drop(handle);
    }

    fn retire(&mut self, mech: Pick) {
        let Some((id, index)) = self.mech_id(mech) else { return };
        let index = self.registered(index);
        let expect_ok = index.is_some_and(|i| self.mechs[i].life == Life::Active);
        match self.registry.retire(&id) {
            Ok(()) => {
                assert!(expect_ok, "retire succeeded against the model");
                let i = index.expect("expected");
                self.mechs[i].life = Life::Retired;
                let d = World::dev_index(self.mechs[i].device);
                if self.selection[d] == Some(i) {
                    self.selection[d] = None;
                }
            }
            Err(e) => assert!(!expect_ok, "retire failed: {e}"),
        }
    }

    fn invalidate(&mut self, dev: Dev) {
        let report = self.registry.invalidate_device(dev.key(), "fuzzed device loss");
        let mut moved = 0;
        for m in self.mechs.iter_mut().filter(|m| !m.removed && m.device == dev.key()) {
            if matches!(m.life, Life::Active | Life::Retired) {
                m.life = Life::Lost;
                moved += 1;
            }
        }
        let mut contexts = 0;
        for c in self.contexts.iter_mut().filter(|c| !c.removed && c.device == dev.key()) {
            if c.state == ContextState::Live {
                c.state = ContextState::Lost;
                contexts += 1;
            }
        }
        let dropped = self.selection[dev.index()].take().is_some();
        assert_eq!(
            (report.mechanisms, report.contexts, report.selection_dropped),
            (moved, contexts, dropped),
            "invalidation report disagrees with the model"
        );
    }

    fn confirm(&mut self, context: Pick) {
        let Some((id, index)) = self.context_id(context) else { return };
        self.confirm_at(id, index, matches!(context, Pick::Foreign));
    }

    fn confirm_at(&mut self, id: ProviderContextIdentity, index: Option<usize>, foreign: bool) {
        let index = index.filter(|&i| !self.contexts[i].removed);
        let mechs: Vec<usize> =
            (0..self.mechs.len()).filter(|&m| !self.mechs[m].removed && self.mechs[m].context == id).collect();
        let queued: usize = mechs.iter().map(|&m| self.queued_for(&self.mechs[m].id)).sum();
        let state = index.map(|i| self.contexts[i].state);
        // Lost blocks and discharged quarantine go to forget_lost, one call per mechanism.
        self.allowed = Allowed::Only(&[Callback::ForgetLost]);
        // Mark the transition before the call: a planned panic in forget_lost comes
        // after the registry has terminated everything.
        let terminates = state == Some(ContextState::Lost) && queued == 0;
        if terminates {
            for &m in &mechs {
                self.mechs[m].life = Life::Terminated;
            }
            self.contexts[index.expect("known")].state = ContextState::Terminated;
        }
        match self.registry.confirm_context_terminated(&id) {
            Ok(report) => {
                assert!(
                    terminates || state == Some(ContextState::Terminated),
                    "confirm succeeded on a {state:?} context with {queued} queued"
                );
                assert_eq!(report.already_terminated, !terminates);
                note(if terminates { "confirm: terminated" } else { "confirm: already terminated" });
                if terminates {
                    assert_eq!(report.mechanisms, mechs.len(), "termination report: {report:?}");
                }
            }
            Err(e) => {
                self.allowed = Allowed::Nothing;
                let expected = match &e {
                    RegistryError::ForeignRegistry { .. } => foreign,
                    RegistryError::Unknown { .. } => !foreign && state.is_none(),
                    RegistryError::ContextStillLive { .. } => state == Some(ContextState::Live),
                    RegistryError::ContextNotQuiescent { in_flight, .. } => {
                        state == Some(ContextState::Lost) && *in_flight == queued && queued > 0
                    }
                    _ => false,
                };
                assert!(expected, "confirm failed against the model: {e}");
                note("confirm: refused");
            }
        }
    }

    /// Live, quarantined and in-flight counts of mechanism `m`, from the allocations'
    /// states (themselves checked against the ledger after every step).
    fn busy(&self, m: usize) -> usize {
        let id = self.mechs[m].id;
        let recorded = self
            .allocs
            .iter()
            .filter(|a| a.mech == m)
            .filter(|a| {
                matches!(
                    self.registry.allocation_state(&a.identity),
                    AllocationState::Live | AllocationState::Lost | AllocationState::Quarantined
                )
            })
            .count();
        recorded + self.queued_for(&id)
    }

    fn remove(&mut self, mech: Pick) {
        let Some((id, index)) = self.mech_id(mech) else { return };
        let index = self.registered(index);
        let expect_ok =
            index.is_some_and(|i| matches!(self.mechs[i].life, Life::Retired | Life::Terminated) && self.busy(i) == 0);
        match self.registry.remove(&id) {
            Ok(()) => {
                assert!(expect_ok, "remove succeeded against the model");
                note("remove: ok");
                self.mechs[index.expect("expected")].removed = true;
            }
            Err(e) => assert!(!expect_ok, "remove of a quiescent retired or terminated mechanism failed: {e}"),
        }
    }

    fn remove_context(&mut self, context: Pick) {
        let Some((id, index)) = self.context_id(context) else { return };
        let index = index.filter(|&i| !self.contexts[i].removed);
        let dependents = self.mechs.iter().any(|m| !m.removed && m.context == id);
        let expect_ok = index.is_some() && !dependents;
        match self.registry.remove_provider_context(&id) {
            Ok(()) => {
                assert!(expect_ok, "remove_provider_context succeeded against the model");
                self.contexts[index.expect("expected")].removed = true;
            }
            Err(e) => assert!(!expect_ok, "remove_provider_context failed: {e}"),
        }
    }

    fn remove_authority(&mut self, authority: Pick) {
        let Some((id, index)) = self.authority_id(authority) else { return };
        let index = index.filter(|&i| !self.authorities[i].removed);
        let dependents = self.mechs.iter().any(|m| !m.removed && m.authority == id);
        let expect_ok = index.is_some() && !dependents;
        match self.registry.remove_authority(&id) {
            Ok(()) => {
                assert!(expect_ok, "remove_authority succeeded against the model");
                self.authorities[index.expect("expected")].removed = true;
            }
            Err(e) => assert!(!expect_ok, "remove_authority failed: {e}"),
        }
    }

    fn retry(&mut self, mech: Pick) {
        let Some((id, index)) = self.mech_id(mech) else { return };
        self.retry_at(id, index);
    }

    fn retry_at(&mut self, id: MechanismIdentity, index: Option<usize>) {
        let index = self.registered(index);
        let expect_ok = index.is_some_and(|i| matches!(self.mechs[i].life, Life::Active | Life::Retired));
        let before = index.and_then(|_| self.registry.snapshot(&id).ok()).map_or(0, |s| s.quarantined.len());
        self.allowed = Allowed::Only(&[Callback::Release]);
        match self.registry.retry_quarantined(&id) {
            Ok(report) => {
                assert!(expect_ok, "retry_quarantined succeeded against the model");
                assert_eq!(report.released + report.still_quarantined, before, "retry report {report:?}");
                if report.released > 0 {
                    note("retry: released some");
                }
            }
            Err(e) => {
                assert!(!expect_ok, "retry_quarantined failed: {e}");
                self.allowed = Allowed::Nothing;
            }
        }
    }

    fn inject(&mut self, mechanism: u8, fault: Fault, nth: u8) {
        let Some(m) = pick(mechanism, self.mechs.len()) else { return };
        let faulty = self.mechs[m].ledger.faulty();
        let n = u64::from(nth % 4) + 1;
        match fault {
            Fault::FailAllocate => faulty.fail_nth(Callback::Allocate, n),
            Fault::OutOfMemory => faulty.fail_nth_allocate_with(
                n,
                AllocError::OutOfMemory {
                    device: self.mechs[m].device,
                    requested: 0,
                    align: 1,
                    available: MaybeBytes(None),
                },
            ),
            Fault::FailRelease => faulty.fail_nth(Callback::Release, n),
            Fault::QuarantineRelease { unmapped, residual } => {
                faulty.quarantine_nth_release(n, usize::from(unmapped), usize::from(residual))
            }
            Fault::PanicAllocate => faulty.panic_on_nth(Callback::Allocate, n),
            Fault::PanicRelease => faulty.panic_on_nth(Callback::Release, n),
            Fault::PanicForgetLost => faulty.panic_on_nth(Callback::ForgetLost, n),
            Fault::Clear => faulty.clear(),
        }
    }

    // --- invariants -------------------------------------------------------------

    fn check_callbacks(&self, before: &[CallCounts]) {
        let after = self.counts();
        // New stacks registered by this operation start at zero.
        for (k, now) in after.iter().enumerate() {
            for callback in Callback::ALL {
                let was = before.get(k).map_or(0, |c| c.get(callback));
                let made = now.get(callback) - was;
                if made == 0 {
                    continue;
                }
                let ok = match self.allowed {
                    Allowed::Nothing => false,
                    Allowed::Only(list) => list.contains(&callback),
                    Allowed::Anything => true,
                };
                assert!(
                    ok,
                    "invariant: {} made {made} {callback} callback(s) on allocator #{k}, which it may not make",
                    self.trace.last().map_or("the operation", String::as_str)
                );
            }
        }
    }

    /// Every invariant of the module docs (4 and 5), after every operation.
    pub fn check(&self) {
        let mut per_mech: Vec<(usize, usize, usize)> = vec![(0, 0, 0); self.mechs.len()]; // (records, bytes, quarantined)
        let mut ledger_live = vec![0usize; self.mechs.len()];
        for a in &self.allocs {
            let mech = &self.mechs[a.mech];
            let state = self.registry.allocation_state(&a.identity);
            let status = mech.ledger.status(a.serial).expect("every allocation has a ledger entry");
            let queued = self.queued(&a.identity);
            let ctx = || format!("allocation {} ({:?} mechanism, queued {queued})", a.identity, mech.life);
            match &a.handle {
                Some(handle) => {
                    assert_eq!(handle.identity(), Some(a.identity), "{}: handle identity changed", ctx());
                    assert!(!queued, "{}: held and queued at once", ctx());
                    let (expected_state, expected_status) = match mech.life {
                        Life::Active | Life::Retired => (AllocationState::Live, BlockStatus::Live),
                        Life::Lost => (AllocationState::Lost, BlockStatus::Live),
                        Life::Terminated => (AllocationState::Gone, BlockStatus::Forgotten),
                    };
                    assert_eq!(state, expected_state, "{}: registry state of a held handle", ctx());
                    assert_eq!(status, expected_status, "{}: ledger status of a held handle", ctx());
                    assert_eq!(handle.is_valid(), mech.life != Life::Terminated, "{}: is_valid", ctx());
                }
                None => match state {
                    AllocationState::Live => panic!("invariant: {} is live with no handle (leaked)", ctx()),
                    AllocationState::Lost => {
                        note("state: lost with no handle");
                        assert_eq!(mech.life, Life::Lost, "{}: lost on a healthy mechanism", ctx());
                        assert_eq!(status, BlockStatus::Live, "{}: a lost record's block", ctx());
                        assert!(!queued, "{}: lost and queued", ctx());
                    }
                    AllocationState::Quarantined => {
                        note("state: quarantined");
                        assert_eq!(status, BlockStatus::Live, "{}: a quarantined block was freed", ctx());
                        assert!(!queued, "{}: quarantined and queued", ctx());
                    }
                    AllocationState::Gone if queued => {
                        assert_eq!(status, BlockStatus::Live, "{}: a queued block was freed", ctx())
                    }
                    AllocationState::Gone => match status {
                        BlockStatus::Freed => {}
                        BlockStatus::Forgotten => {
                            note("state: forgotten at termination");
                            assert_eq!(mech.life, Life::Terminated, "{}: forgotten before termination", ctx())
                        }
                        BlockStatus::Live => {
                            panic!("invariant: {} is gone from the registry but its block was never released", ctx())
                        }
                    },
                    other => panic!("{}: unknown allocation state {other:?}", ctx()),
                },
            }
            if matches!(state, AllocationState::Live | AllocationState::Lost) {
                per_mech[a.mech].0 += 1;
                per_mech[a.mech].1 += a.bytes;
            }
            if state == AllocationState::Quarantined {
                per_mech[a.mech].2 += 1;
            }
            if status == BlockStatus::Live {
                ledger_live[a.mech] += 1;
            }
        }
        // No block is live in a ledger without an allocation of ours accounting for it
        // (a block made but never recorded, for example).
        for (m, mech) in self.mechs.iter().enumerate() {
            assert_eq!(
                mech.ledger.live_count(),
                ledger_live[m],
                "invariant: mechanism {} holds blocks no allocation accounts for",
                mech.id
            );
        }

        let snapshot = self.registry.snapshots();
        assert_eq!(snapshot.registry, self.registry.id());
        let registered: Vec<_> = self.mechs.iter().filter(|m| !m.removed).map(|m| m.id).collect();
        let mut found: Vec<_> = snapshot.mechanisms.iter().map(|m| m.identity).collect();
        let mut expected = registered.clone();
        found.sort();
        expected.sort();
        assert_eq!(found, expected, "snapshot mechanisms disagree with the model");
        for (m, mech) in self.mechs.iter().enumerate() {
            if mech.removed {
                assert!(
                    matches!(self.registry.snapshot(&mech.id), Err(RegistryError::Unknown { .. })),
                    "a removed mechanism is still known"
                );
                continue;
            }
            let s = snapshot.mechanisms.iter().find(|s| s.identity == mech.id).expect("listed");
            let d = World::dev_index(mech.device);
            assert_eq!(s.state, mech.life.state(), "mechanism {} state", mech.id);
            assert_eq!((s.device, s.context, s.authority), (mech.device, mech.context, mech.authority));
            assert_eq!(s.selected, self.selection[d] == Some(m), "mechanism {} selection", mech.id);
            assert_eq!(s.live_allocations, per_mech[m].0, "mechanism {} live count", mech.id);
            assert_eq!(s.live_bytes, per_mech[m].1, "mechanism {} live bytes", mech.id);
            assert_eq!(s.quarantined.len(), per_mech[m].2, "mechanism {} quarantine count", mech.id);
            assert_eq!(s.in_flight, self.queued_for(&mech.id), "mechanism {} in flight", mech.id);
            for q in &s.quarantined {
                let a = self
                    .allocs
                    .iter()
                    .find(|a| a.identity.generation() == q.generation && a.mech == m)
                    .unwrap_or_else(|| panic!("quarantine entry {q:?} names no allocation of ours"));
                assert_eq!(q.bytes, a.bytes, "quarantine entry size");
                assert!(
                    q.unmapped_bytes.checked_add(q.residual_bytes).is_some_and(|t| t <= q.bytes),
                    "invariant: quarantine claims more than the block: {q:?}"
                );
                assert_eq!(q.binding, a.identity.binding().binding(), "quarantine entry binding");
            }
            if mech.life == Life::Terminated {
                assert!(s.live_allocations == 0 && s.quarantined.is_empty(), "terminated with records: {s:?}");
            }
        }
        for dev in Dev::ALL {
            let expected = self.selection[dev.index()].map(|i| self.mechs[i].id);
            assert_eq!(self.registry.selected(dev.key()), expected, "selection of {}", dev.key());
        }
        let contexts: Vec<_> = self.contexts.iter().filter(|c| !c.removed).map(|c| (c.id, c.device, c.state)).collect();
        let mut found: Vec<_> = snapshot.contexts.iter().map(|c| (c.identity, c.device, c.state)).collect();
        let mut expected = contexts;
        found.sort_by_key(|c| c.0);
        expected.sort_by_key(|c| c.0);
        assert_eq!(found, expected, "snapshot contexts disagree with the model");
        let mut found: Vec<_> = snapshot.authorities.iter().map(|a| a.identity).collect();
        let mut expected: Vec<_> = self.authorities.iter().filter(|a| !a.removed).map(|a| a.id).collect();
        found.sort();
        expected.sort();
        assert_eq!(found, expected, "snapshot authorities disagree with the model");
        for bound in &self.bindings {
            assert_eq!(bound.binding.state(), self.mechs[bound.mech].life.state(), "binding state");
        }
    }

    /// The end of an input: drop every handle, run every queue, retry every
    /// quarantine, confirm every lost context; then no block may be live anywhere.
    pub fn finish(&mut self) {
        for m in &self.mechs {
            m.ledger.faulty().clear();
        }
        while !self.held().is_empty() {
            self.step(Op::DropAllocation(0));
        }
        for dev in Dev::ALL {
            while !lock(&self.queues[dev.index()].held).is_empty() {
                self.step(Op::RunQueued { queue: dev, count: 3 });
            }
        }
        for m in 0..self.mechs.len() {
            if !self.mechs[m].removed {
                let id = self.mechs[m].id;
                self.checked(format!("end: retry_quarantined({id})"), |world| world.retry_at(id, Some(m)));
            }
        }
        for c in 0..self.contexts.len() {
            if !self.contexts[c].removed && self.contexts[c].state == ContextState::Lost {
                let id = self.contexts[c].id;
                self.checked(format!("end: confirm_context_terminated({id})"), |world| {
                    world.confirm_at(id, Some(c), false)
                });
                assert_eq!(
                    self.contexts[c].state,
                    ContextState::Terminated,
                    "a drained lost context was not terminated"
                );
            }
        }
        for m in &self.mechs {
            assert_eq!(
                m.ledger.live_count(),
                0,
                "invariant: at the end mechanism {} ({:?}) still holds blocks released by no path",
                m.id,
                m.life
            );
        }
        // The foreign allocation goes back through its own binding.
        if let Some(handle) = self.foreign.allocation.take() {
            let report = self.foreign.binding.release(handle);
            assert!(matches!(report, Ok(ReleaseSummary::Complete { .. })), "foreign release: {report:?}");
        }
        assert_eq!(self.foreign.ledger.live_count(), 0, "the foreign allocation was not released");
    }

    /// Frees what the heaps still hold once nothing can reach it any more.
    fn reclaim(self) {
        let ledgers: Vec<Arc<Ledger>> = self.stacks().cloned().collect();
        drop(self);
        for ledger in ledgers {
            ledger.reclaim();
        }
    }
}

/// Runs one input: every operation, the invariants after each, then the end checks.
pub fn run(input: &Input) {
    install_panic_hook();
    let mut world = World::new(input);
    for &op in input.ops.iter().take(MAX_OPS) {
        world.step(op);
    }
    world.finish();
    if std::env::var_os("FUZZ_TRACE").is_some() {
        eprintln!("{}", world.trace.join("\n"));
    }
    world.reclaim();
}

/// Decodes raw fuzz bytes into an input: the header fields, then operations until the
/// bytes run out (denser than `arbitrary`'s own `Vec` encoding, which spends a
/// continue-bit per element and so averages two operations on random bytes).
pub fn decode(data: &[u8]) -> Option<Input> {
    let mut u = arbitrary::Unstructured::new(data);
    let serial_limit = u.arbitrary().ok()?;
    let queue_capacity = u.arbitrary().ok()?;
    let mut ops = Vec::new();
    while !u.is_empty() && ops.len() < MAX_OPS {
        ops.push(u.arbitrary().ok()?);
    }
    Some(Input { serial_limit, queue_capacity, ops })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: deterministic bytes for the seed corpus of the plain test.
    fn bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
            })
            .collect()
    }

    /// A few hundred pseudo-random inputs through the harness, on stable Rust (no
    /// libFuzzer): the harness itself must hold on inputs that reach every operation.
    #[test]
    fn pseudo_random_inputs_keep_every_invariant() {
        let cases: u64 = std::env::var("FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300);
        for seed in 0..cases {
            let data = bytes(seed, 64 + (seed as usize * 37) % 4000);
            if let Some(input) = decode(&data) {
                run(&input);
            }
        }
        if std::env::var_os("FUZZ_STATS").is_some() {
            eprintln!("{:#?}", outcomes());
        }
    }

    /// A script that walks every lifecycle: allocate on three devices, a wrong-binding
    /// release, faults, deferral, retire, device loss, termination and removal.
    #[test]
    fn scripted_lifecycle_keeps_every_invariant() {
        use Op::*;
        let ops = vec![
            RegisterContext(Dev::Gpu0),
            RegisterAuthority(Dev::Gpu0),
            RegisterAllocator {
                context: Pick::Ours(0),
                authority: Pick::Ours(0),
                device: Dev::Gpu0,
                policy: Policy::Defer(Dev::Gpu0),
            },
            WithMemory(Dev::Host),
            Bind(Dev::Gpu0),
            Bind(Dev::Host),
            Allocate { binding: Pick::Ours(0), size: Size::Small(5000), align_log2: 12 },
            Allocate { binding: Pick::Ours(1), size: Size::Tiny(10), align_log2: 3 },
            Allocate { binding: Pick::Ours(0), size: Size::Tiny(0), align_log2: 0 },
            Release { binding: Pick::Ours(1), allocation: Pick::Ours(0) },
            Release { binding: Pick::Foreign, allocation: Pick::Ours(0) },
            Release { binding: Pick::Ours(0), allocation: Pick::Foreign },
            View { allocation: Pick::Ours(0), offset: 4999, len: 1 },
            View { allocation: Pick::Ours(0), offset: usize::MAX, len: 2 },
            Inject { mechanism: 0, fault: Fault::QuarantineRelease { unmapped: 100, residual: 60000 }, nth: 0 },
            Release { binding: Pick::Ours(0), allocation: Pick::Ours(0) },
            ReleaseDeferred { binding: Pick::Ours(0), allocation: Pick::Ours(1), queue: Dev::Gpu1 },
            ReleaseDeferred { binding: Pick::Ours(0), allocation: Pick::Ours(1), queue: Dev::Gpu0 },
            Inject { mechanism: 1, fault: Fault::PanicRelease, nth: 0 },
            DropAllocation(0),
            Retire(Pick::Ours(0)),
            Remove(Pick::Ours(0)),
            InvalidateDevice(Dev::Gpu0),
            ConfirmTerminated(Pick::Ours(0)),
            RunQueued { queue: Dev::Gpu0, count: 3 },
            ConfirmTerminated(Pick::Ours(0)),
            Remove(Pick::Ours(0)),
            RemoveContext(Pick::Ours(0)),
            RemoveAuthority(Pick::Ours(0)),
            RetryQuarantined(Pick::Ours(1)),
        ];
        run(&Input { serial_limit: None, queue_capacity: 2, ops });
    }

    /// The ledger itself catches what it exists to catch: a second release of one block.
    #[test]
    #[should_panic(expected = "never handed out (or already freed)")]
    fn the_ledger_refuses_a_block_released_twice() {
        let ledger = Ledger::new(DeviceKey::HOST);
        let block = ledger.allocate(&AllocationRequest::new(64, 8).unwrap()).unwrap();
        let twin =
            RawAllocation::new(block.address(), block.bytes(), block.align(), block.device(), block.provider_tag());
        assert!(ledger.release(block).is_complete());
        let _ = ledger.release(twin);
    }

    /// ... and a block the registry never released shows up at the end.
    #[test]
    fn the_ledger_counts_a_block_nobody_released() {
        let ledger = Ledger::new(DeviceKey::HOST);
        let block = ledger.allocate(&AllocationRequest::new(64, 8).unwrap()).unwrap();
        assert_eq!(ledger.live_count(), 1);
        assert!(ledger.release(block).is_complete());
        assert_eq!(ledger.live_count(), 0);
    }

    /// Replays one input file, or every file of a directory (a corpus):
    /// `FUZZ_INPUT=path cargo test -- --ignored replay --nocapture`
    /// (`FUZZ_STATS=1` prints how often each outcome was reached).
    #[test]
    #[ignore = "replays the file or directory named by FUZZ_INPUT"]
    fn replay() {
        let path = std::path::PathBuf::from(std::env::var("FUZZ_INPUT").expect("set FUZZ_INPUT to a file or corpus"));
        let files: Vec<_> = if path.is_dir() {
            let mut files: Vec<_> =
                std::fs::read_dir(&path).expect("read FUZZ_INPUT").flatten().map(|e| e.path()).collect();
            files.sort();
            files
        } else {
            vec![path]
        };
        for file in &files {
            let data = std::fs::read(file).expect("read an input");
            let Some(input) = decode(&data) else { continue };
            if files.len() == 1 {
                println!("{input:#?}");
            }
            run(&input);
        }
        println!("replayed {} input(s)", files.len());
        if std::env::var_os("FUZZ_STATS").is_some() {
            println!("{:#?}", outcomes());
        }
    }
}
