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
//! 3. Every operation's answer (the success with its payload, or the error variant
//!    with the payload that matters, or a planned panic) is the one the reference
//!    model `memory_testkit::reference` predicts, the same model the property test
//!    in `crates/memory-binding/tests/model.rs` runs; so are every allocation's
//!    state, each allocator's allocate / release / forget_lost counts, its heap's
//!    live blocks, its pending faults, and each queue's contents. Identity
//!    exhaustion (inputs with a serial limit) is the one answer the model does not
//!    predict: the harness then restores the model as it was before the operation.
//! 4. Every allocation ever made is, by its registry-issued identity, in exactly one of:
//!    live (a handle is held), queued (a deferred release is pending), quarantined,
//!    lost (device lost) or gone, and the ledger agrees (gone = released exactly once
//!    or forgotten at termination); a record with no handle is never live.
//! 5. Snapshots agree with the model: live counts and bytes, quarantine entries
//!    (bytes, unmapped, residual, reason; unmapped + residual never above the block),
//!    in-flight counts (only queued releases are in flight in this single-threaded
//!    harness), selection, lost reasons, lifecycle states of mechanisms, contexts
//!    and bindings, registered identities.
//! 6. At the end, after dropping every handle, running every queue, retrying every
//!    quarantine and confirming every lost context, the ledgers hold no live block.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::{Arc, Mutex, MutexGuard, Once, PoisonError};

use allocator_cpu::HostReleaseQueue;
use arbitrary::Arbitrary;
use memory_api::ReleaseSummary;
use memory_api::{
    AllocError, AllocationIdentity, AllocationRequest, AllocatorStats, AuthorityIdentity, DeferredReleaseQueue,
    DeviceAllocator, DeviceKey, IdentityIssuer, MaybeBytes, MechanismIdentity, ProviderContextIdentity,
    QueueRefusalReason, RawAllocation, ReleaseOutcome, SharedMapping, VirtualBacking,
};
use memory_binding::{
    AllocateError, AllocationState, BindError, BindingRegistry, BoundAllocation, ContextState, DropPolicy, HandleError,
    MechanismOptions, MechanismState, MemoryBinding, ObjectKind, RegistryError, Rejected, ViewError,
};
use memory_testkit::reference::{self, FaultOn, Handle, Model, Out, Place, Reason, Ref, Reg, Through};
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

/// The bounded queue that holds prepared releases until an operation runs or abandons
/// them: the C API's own (`allocator_cpu::HostReleaseQueue`), so the fuzzer drives the
/// queue C callers get.
type HeldQueue = HostReleaseQueue;

/// Whether `queue` holds the release of `identity`.
fn holds(queue: &HeldQueue, identity: &AllocationIdentity) -> bool {
    queue.count_where(|release| release.identity() == identity) != 0
}

/// How many releases of `mechanism` `queue` holds.
fn count_for(queue: &HeldQueue, mechanism: &MechanismIdentity) -> usize {
    queue.count_where(|release| release.identity().binding().mechanism() == *mechanism)
}

// ---------------------------------------------------------------------------------
// The registry's answers in the reference model's terms
// ---------------------------------------------------------------------------------

/// The devices in the order the model indexes them (the order of [`Dev::ALL`]).
const DEVICES: [DeviceKey; 3] = [DeviceKey::HOST, DeviceKey::device(0), DeviceKey::device(1)];

fn mechanism_state(state: MechanismState) -> reference::MechanismState {
    match state {
        MechanismState::Active => reference::MechanismState::Active,
        MechanismState::Retired => reference::MechanismState::Retired,
        MechanismState::DeviceLost => reference::MechanismState::DeviceLost,
        MechanismState::Terminated => reference::MechanismState::Terminated,
        other => panic!("a mechanism state the model does not know: {other:?}"),
    }
}

fn context_state(state: ContextState) -> reference::ContextState {
    match state {
        ContextState::Live => reference::ContextState::Live,
        ContextState::Lost => reference::ContextState::Lost,
        ContextState::Terminated => reference::ContextState::Terminated,
        other => panic!("a context state the model does not know: {other:?}"),
    }
}

fn allocation_state(state: AllocationState) -> reference::AllocationState {
    match state {
        AllocationState::Live => reference::AllocationState::Live,
        AllocationState::Quarantined => reference::AllocationState::Quarantined,
        AllocationState::Lost => reference::AllocationState::Lost,
        AllocationState::Gone => reference::AllocationState::Gone,
        other => panic!("an allocation state the model does not know: {other:?}"),
    }
}

fn object_kind(kind: ObjectKind) -> reference::ObjectKind {
    match kind {
        ObjectKind::ProviderContext => reference::ObjectKind::ProviderContext,
        ObjectKind::Authority => reference::ObjectKind::Authority,
        ObjectKind::Mechanism => reference::ObjectKind::Mechanism,
        ObjectKind::Binding => reference::ObjectKind::Binding,
        ObjectKind::Allocation => reference::ObjectKind::Allocation,
        other => panic!("an object kind the model does not know: {other:?}"),
    }
}

/// A cold-path error; identity exhaustion (which the model does not predict) apart.
fn registry_out(error: &RegistryError) -> Out {
    Out::Registry(match error {
        RegistryError::Identity(_) => return Out::IdentityExhausted,
        RegistryError::ForeignRegistry { kind, .. } => Reg::Foreign(object_kind(*kind)),
        RegistryError::Unknown { kind, .. } => Reg::Unknown(object_kind(*kind)),
        RegistryError::DeviceMismatch { what, .. } => Reg::DeviceMismatch(what),
        RegistryError::ContextNotLive { state, .. } => Reg::ContextNotLive(context_state(*state)),
        RegistryError::ContextStillLive { .. } => Reg::ContextStillLive,
        RegistryError::ContextNotQuiescent { in_flight, .. } => Reg::ContextNotQuiescent(*in_flight),
        RegistryError::InvalidState { state, .. } => Reg::InvalidState(mechanism_state(*state)),
        RegistryError::NotQuiescent { kind, live, quarantined, in_flight, dependents, .. } => Reg::NotQuiescent {
            kind: object_kind(*kind),
            live: *live,
            quarantined: *quarantined,
            in_flight: *in_flight,
            dependents: *dependents,
        },
        other => Reg::Other(other.to_string()),
    })
}

fn handle_error(error: &HandleError) -> Handle {
    match error {
        HandleError::ForeignRegistry { .. } => Handle::Foreign,
        HandleError::BindingMismatch { .. } => Handle::Mismatch,
        HandleError::StaleAllocation => Handle::Stale,
        HandleError::DeviceLost { reason, .. } => Handle::DeviceLost(reason.clone()),
        HandleError::Inactive { state, .. } => Handle::Inactive(mechanism_state(*state)),
        HandleError::ReleaseFailed(_) => Handle::ReleaseFailed,
        HandleError::QueueRefused(QueueRefusalReason::Full { .. }) => Handle::QueueFull,
        HandleError::QueueRefused(QueueRefusalReason::WrongDevice { .. }) => Handle::QueueWrongDevice,
        other => Handle::Other(other.to_string()),
    }
}

fn bind_out(error: &BindError) -> Out {
    match error {
        BindError::NoSelection { .. } => Out::BindNoSelection,
        BindError::Inactive { state, .. } => Out::BindInactive(mechanism_state(*state)),
        BindError::Registry(RegistryError::Identity(_)) => Out::IdentityExhausted,
        BindError::Registry(error) => match registry_out(error) {
            Out::Registry(reg) => Out::BindRegistry(reg),
            other => other,
        },
        other => Out::Other(other.to_string()),
    }
}

/// Why a block is quarantined, from the snapshot's reason text.
fn reason_of(text: &str) -> Reason {
    if text.contains("fault-injection") {
        Reason::Injected
    } else if text.contains("dropped without a release path") {
        Reason::Abandoned
    } else if text.contains("treating all of it as owned") {
        Reason::Dishonest
    } else if text.contains("panicked while releasing") {
        Reason::Panicked
    } else {
        panic!("unexpected quarantine reason: {text}")
    }
}

// ---------------------------------------------------------------------------------
// The world: the real registry beside the reference model
// ---------------------------------------------------------------------------------

struct Mech {
    id: MechanismIdentity,
    device: DeviceKey,
    context: ProviderContextIdentity,
    authority: AuthorityIdentity,
    ledger: Arc<Ledger>,
}

struct Bound {
    binding: MemoryBinding,
    /// The model's key for this binding.
    key: usize,
}

struct Alloc {
    identity: AllocationIdentity,
    serial: u64,
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

/// The harness state for one input: the real registry, the identities it issued (by
/// the model's indices), and the reference model that predicts every answer.
pub struct World {
    limited: bool,
    registry: BindingRegistry,
    model: Model,
    foreign: Foreign,
    queues: [Arc<HeldQueue>; 3],
    contexts: Vec<ProviderContextIdentity>,
    authorities: Vec<AuthorityIdentity>,
    mechs: Vec<Mech>,
    bindings: Vec<Bound>,
    allocs: Vec<Alloc>,
    /// What the operation being run may call.
    allowed: Allowed,
    /// Human-readable trace of the operations run (printed on a failed invariant).
    pub trace: Vec<String>,
}

fn pick(index: u8, len: usize) -> Option<usize> {
    (len > 0).then(|| usize::from(index) % len)
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

/// The name `note` counts an outcome under: its variant.
fn outcome_name(out: &Out) -> &'static str {
    match out {
        Out::Skipped => "skipped",
        Out::Done => "done",
        Out::Registered => "registered",
        Out::Bound { .. } => "bound",
        Out::Allocated { .. } => "allocated",
        Out::Released(ReleaseSummary::Complete { .. }) => "released: complete",
        Out::Released(_) => "released: quarantined",
        Out::Deferred => "deferred",
        Out::Viewed { .. } => "viewed",
        Out::Invalidated { .. } => "invalidated",
        Out::Terminated { already: false, .. } => "terminated",
        Out::Terminated { already: true, .. } => "terminated already",
        Out::Retried { .. } => "retried",
        Out::Registry(_) => "registry error",
        Out::BindNoSelection => "bind: no selection",
        Out::BindInactive(_) => "bind: inactive",
        Out::BindRegistry(_) => "bind: registry error",
        Out::AllocInactive(_) => "allocate: inactive",
        Out::AllocDeviceLost(_) => "allocate: device lost",
        Out::AllocAllocator => "allocate: allocator error",
        Out::Handle(Handle::ReleaseFailed) => "handle: release failed",
        Out::Handle(Handle::QueueFull | Handle::QueueWrongDevice) => "handle: queue refused",
        Out::Handle(Handle::DeviceLost(_)) => "handle: device lost",
        Out::Handle(Handle::Stale) => "handle: stale",
        Out::Handle(_) => "handle: wrong binding or registry",
        Out::ViewOutOfBounds => "view: out of bounds",
        Out::ViewHandle(_) => "view: refused",
        Out::Panicked => "planned panic",
        Out::IdentityExhausted => "identities exhausted",
        _ => "other",
    }
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
        let queue = |dev: Dev| Arc::new(HeldQueue::new(dev.key(), capacity));
        World {
            limited: input.serial_limit.is_some(),
            registry,
            model: Model::new(&DEVICES, capacity).with_heap_limit(HEAP_LIMIT),
            foreign: Foreign::new(),
            queues: [queue(Dev::Host), queue(Dev::Gpu0), queue(Dev::Gpu1)],
            contexts: Vec::new(),
            authorities: Vec::new(),
            mechs: Vec::new(),
            bindings: Vec::new(),
            allocs: Vec::new(),
            allowed: Allowed::Nothing,
            trace: Vec::new(),
        }
    }

    fn stacks(&self) -> impl Iterator<Item = &Arc<Ledger>> {
        // The foreign stack first: stacks registered later append, so indices are stable.
        std::iter::once(&self.foreign.ledger).chain(self.mechs.iter().map(|m| &m.ledger))
    }

    fn counts(&self) -> Vec<CallCounts> {
        self.stacks().map(|l| l.counts()).collect()
    }

    fn queued_for(&self, mechanism: &MechanismIdentity) -> usize {
        self.queues.iter().map(|q| count_for(q, mechanism)).sum()
    }

    fn queued(&self, identity: &AllocationIdentity) -> bool {
        self.queues.iter().any(|q| holds(q, identity))
    }

    fn held(&self) -> Vec<usize> {
        (0..self.allocs.len()).filter(|&i| self.allocs[i].handle.is_some()).collect()
    }

    fn mech_index(&self, id: MechanismIdentity) -> usize {
        self.mechs.iter().position(|m| m.id == id).expect("one of our mechanisms")
    }

    // --- running one operation --------------------------------------------------

    /// Runs `op`, catching a planned panic, then checks every invariant.
    pub fn step(&mut self, op: Op) {
        self.checked(format!("{op:?}"), |world| world.apply(op));
    }

    /// Runs `f` (one operation), catching a planned panic it did not catch itself,
    /// then checks that it made only the callbacks it may make and every invariant.
    fn checked(&mut self, label: String, f: impl FnOnce(&mut World)) {
        self.trace.push(label);
        let before = self.counts();
        self.allowed = Allowed::Nothing;
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f(self))) {
            if !injected(&*payload) {
                resume_unwind(payload);
            }
            panic!("invariant: a planned panic escaped where the model did not expect one");
        }
        self.check_callbacks(&before);
        self.check();
    }

    /// Runs one real registry call; a planned panic becomes `Err(Out::Panicked)`.
    fn guard<T>(&mut self, f: impl FnOnce(&mut World) -> T) -> Result<T, Out> {
        match catch_unwind(AssertUnwindSafe(|| f(self))) {
            Ok(value) => Ok(value),
            Err(payload) if injected(&*payload) => {
                self.trace.push("  (planned panic)".to_owned());
                self.allowed = Allowed::Anything;
                Err(Out::Panicked)
            }
            Err(payload) => resume_unwind(payload),
        }
    }

    /// The registry answered `actual` where the model predicted `expected` (after
    /// changing itself as the registry must have). Identity exhaustion, which the
    /// model does not predict, is admitted on a registry with a serial limit: then
    /// nothing changed in the registry, and the model goes back to `saved`.
    fn agree(&mut self, expected: Out, actual: Out, saved: Option<Model>) {
        note(outcome_name(&actual));
        if actual == Out::IdentityExhausted && expected != Out::IdentityExhausted {
            assert!(self.limited, "identities ran out without a serial limit");
            self.model = saved.expect("a limited registry saves the model before each operation");
            return;
        }
        assert_eq!(
            actual,
            expected,
            "invariant: the registry and the reference model disagree on {}",
            self.trace.last().map_or("the operation", String::as_str)
        );
        if expected.is_error() && !expected.called_back() {
            self.allowed = Allowed::Nothing;
        }
    }

    /// A copy of the model to go back to if the registry runs out of identities.
    fn save(&self) -> Option<Model> {
        self.limited.then(|| self.model.clone())
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::RegisterContext(dev) => {
                let saved = self.save();
                let expected = self.model.register_context(dev.key());
                let actual = match self.registry.register_provider_context(dev.key(), Arc::new(())) {
                    Ok(id) => {
                        self.contexts.push(id);
                        Out::Registered
                    }
                    Err(e) => registry_out(&e),
                };
                self.agree(expected, actual, saved);
            }
            Op::RegisterAuthority(dev) => {
                let saved = self.save();
                let expected = self.model.register_authority(dev.key());
                let actual = match self.registry.register_authority(dev.key(), Arc::new(())) {
                    Ok(id) => {
                        self.authorities.push(id);
                        Out::Registered
                    }
                    Err(e) => registry_out(&e),
                };
                self.agree(expected, actual, saved);
            }
            Op::RegisterAllocator { context, authority, device, policy } => {
                self.register_allocator(context, authority, device, policy)
            }
            Op::Select(mech) => {
                let Some((id, r)) = self.mech_id(mech) else { return };
                let expected = self.model.select(r);
                let actual = self.registry.select(&id).map_or_else(|e| registry_out(&e), |_| Out::Done);
                self.agree(expected, actual, None);
            }
            Op::Bind(dev) => {
                let saved = self.save();
                let expected = self.model.bind(dev.key());
                let result = self.registry.bind(dev.key());
                let actual = self.bound(result);
                self.agree(expected, actual, saved);
            }
            Op::BindRegistered(mech) => {
                let Some((id, r)) = self.mech_id(mech) else { return };
                let saved = self.save();
                let expected = self.model.bind_registered(r);
                let result = self.registry.bind_registered(&id);
                let actual = self.bound(result);
                self.agree(expected, actual, saved);
            }
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
                let (q, count) = (queue.index(), usize::from(count % 4) + 1);
                let due = count.min(self.model.queues[q].len());
                let expected = self.model.run_queued(q, count);
                self.allowed = Allowed::Only(&[Callback::Release]);
                let taken = self.queues[q].take(count);
                assert_eq!(taken.len(), due, "queue {q} held another number of releases than the model");
                let run = |_: &mut World| {
                    for release in taken {
                        release.execute();
                    }
                };
                let actual = self.guard(run).map_or_else(|e| e, |()| Out::Done);
                self.agree(expected, actual, None);
            }
            Op::AbandonQueued { queue, count } => {
                let (q, count) = (queue.index(), usize::from(count % 4) + 1);
                let expected = self.model.drop_queued(q, count);
                drop(self.queues[q].take(count));
                self.agree(expected, Out::Done, None);
            }
            Op::Retire(mech) => {
                let Some((id, r)) = self.mech_id(mech) else { return };
                let expected = self.model.retire(r);
                let actual = self.registry.retire(&id).map_or_else(|e| registry_out(&e), |()| Out::Done);
                self.agree(expected, actual, None);
            }
            Op::InvalidateDevice(dev) => {
                let (expected, reason) = self.model.invalidate(dev.key());
                let report = self.registry.invalidate_device(dev.key(), &reason);
                let actual = Out::Invalidated {
                    mechanisms: report.mechanisms,
                    contexts: report.contexts,
                    selection_dropped: report.selection_dropped,
                };
                self.agree(expected, actual, None);
            }
            Op::ConfirmTerminated(context) => {
                let Some((id, r)) = self.context_id(context) else { return };
                self.confirm_at(id, r);
            }
            Op::Remove(mech) => {
                let Some((id, r)) = self.mech_id(mech) else { return };
                let expected = self.model.remove(r);
                let actual = self.registry.remove(&id).map_or_else(|e| registry_out(&e), |()| Out::Done);
                self.agree(expected, actual, None);
            }
            Op::RemoveContext(context) => {
                let Some((id, r)) = self.context_id(context) else { return };
                let expected = self.model.remove_context(r);
                let actual =
                    self.registry.remove_provider_context(&id).map_or_else(|e| registry_out(&e), |()| Out::Done);
                self.agree(expected, actual, None);
            }
            Op::RemoveAuthority(authority) => {
                let Some((id, r)) = self.authority_id(authority) else { return };
                let expected = self.model.remove_authority(r);
                let actual = self.registry.remove_authority(&id).map_or_else(|e| registry_out(&e), |()| Out::Done);
                self.agree(expected, actual, None);
            }
            Op::RetryQuarantined(mech) => {
                let Some((id, r)) = self.mech_id(mech) else { return };
                self.retry_at(id, r);
            }
            Op::Inject { mechanism, fault, nth } => self.inject(mechanism, fault, nth),
        }
    }

    fn context_id(&self, pick_: Pick) -> Option<(ProviderContextIdentity, Ref)> {
        match pick_ {
            Pick::Foreign => Some((self.foreign.context, Ref::Foreign)),
            Pick::Ours(i) => pick(i, self.contexts.len()).map(|i| (self.contexts[i], Ref::Ours(i))),
        }
    }

    fn authority_id(&self, pick_: Pick) -> Option<(AuthorityIdentity, Ref)> {
        match pick_ {
            Pick::Foreign => Some((self.foreign.authority, Ref::Foreign)),
            Pick::Ours(i) => pick(i, self.authorities.len()).map(|i| (self.authorities[i], Ref::Ours(i))),
        }
    }

    fn mech_id(&self, pick_: Pick) -> Option<(MechanismIdentity, Ref)> {
        match pick_ {
            Pick::Foreign => Some((self.foreign.mechanism, Ref::Foreign)),
            Pick::Ours(i) => pick(i, self.mechs.len()).map(|i| (self.mechs[i].id, Ref::Ours(i))),
        }
    }

    fn register_allocator(&mut self, context: Pick, authority: Pick, device: Dev, policy: Policy) {
        let (Some((ctx_id, ctx)), Some((auth_id, auth))) = (self.context_id(context), self.authority_id(authority))
        else {
            return;
        };
        let ledger = Arc::new(Ledger::new(device.key()));
        let (drop_policy, model_policy) = match policy {
            Policy::Default => (None, None),
            Policy::Release => (Some(DropPolicy::Release), Some(reference::Policy::Release)),
            Policy::Quarantine => (Some(DropPolicy::Quarantine), Some(reference::Policy::Quarantine)),
            Policy::Defer(dev) => (
                Some(DropPolicy::Defer(Arc::clone(&self.queues[dev.index()]) as Arc<dyn DeferredReleaseQueue>)),
                Some(reference::Policy::Defer(dev.index())),
            ),
        };
        let options = MechanismOptions::default().with_drop_policy(drop_policy);
        let saved = self.save();
        let expected = self.model.register_allocator(ctx, auth, device.key(), model_policy);
        if expected == Out::Registered {
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
        let actual = match result {
            Ok(id) => {
                self.mechs.push(Mech { id, device: device.key(), context: ctx_id, authority: auth_id, ledger });
                Out::Registered
            }
            Err(e) => registry_out(&e),
        };
        self.agree(expected, actual, saved);
    }

    /// A bind's answer in the model's terms; a new binding takes the model's newest key.
    fn bound(&mut self, result: Result<MemoryBinding, BindError>) -> Out {
        match result {
            Ok(binding) => {
                let mechanism = self.mech_index(binding.identity().mechanism());
                let key = self.model.bindings.len().saturating_sub(1);
                self.bindings.push(Bound { binding, key });
                Out::Bound { mechanism }
            }
            Err(e) => bind_out(&e),
        }
    }

    fn with_memory(&mut self, dev: Dev) {
        let ledger = Arc::new(Ledger::new(dev.key()));
        self.allowed = Allowed::Only(&[Callback::VirtualBacking, Callback::SharedMapping]);
        let saved = self.model.clone();
        let expected = self.model.with_memory(dev.key());
        let result = self.registry.with_memory(Arc::clone(&ledger) as Arc<dyn DeviceAllocator>);
        // Pick up whatever was registered (all of it on success; a prefix when
        // identities ran out).
        let snapshot = self.registry.snapshots();
        let (mut contexts, mut authorities, mut mechanisms) = (0, 0, 0);
        for c in &snapshot.contexts {
            if !self.contexts.contains(&c.identity) {
                self.contexts.push(c.identity);
                contexts += 1;
            }
        }
        for a in &snapshot.authorities {
            if !self.authorities.contains(&a.identity) {
                self.authorities.push(a.identity);
                authorities += 1;
            }
        }
        for m in &snapshot.mechanisms {
            if !self.mechs.iter().any(|k| k.id == m.identity) {
                let ledger = Arc::clone(&ledger);
                self.mechs.push(Mech {
                    id: m.identity,
                    device: m.device,
                    context: m.context,
                    authority: m.authority,
                    ledger,
                });
                mechanisms += 1;
            }
        }
        let actual = match result {
            Ok(binding) => self.bound(Ok(binding)),
            Err(e) => bind_out(&e),
        };
        if actual == Out::IdentityExhausted {
            // The model books the prefix the registry managed, step by step.
            assert!(self.limited, "identities ran out without a serial limit");
            self.model = saved;
            for _ in 0..contexts {
                self.model.register_context(dev.key());
            }
            for _ in 0..authorities {
                self.model.register_authority(dev.key());
            }
            if mechanisms > 0 {
                let (c, a) = (self.model.contexts.len() - 1, self.model.authorities.len() - 1);
                let out = self.model.register_allocator(Ref::Ours(c), Ref::Ours(a), dev.key(), None);
                assert_eq!(out, Out::Registered, "with_memory's own mechanism");
            }
            note(outcome_name(&actual));
            return;
        }
        assert_eq!((contexts, authorities, mechanisms), (1, 1, 1), "with_memory registers one of each");
        self.agree(expected, actual, None);
    }

    fn allocate(&mut self, binding: Pick, size: Size, align_log2: u8) {
        let Pick::Ours(b) = binding else { return };
        let Some(b) = pick(b, self.bindings.len()) else { return };
        let Ok(request) = AllocationRequest::new(size.bytes(), 1usize << (align_log2 % (MAX_ALIGN_LOG2 + 1))) else {
            return;
        };
        let (key, binding) = (self.bindings[b].key, self.bindings[b].binding.clone());
        let saved = self.save();
        let expected = self.model.allocate(key, request.bytes());
        self.allowed = Allowed::Only(&[Callback::Allocate]);
        if self.limited {
            // An allocation that cannot be recorded is given straight back.
            self.allowed = Allowed::Only(&[Callback::Allocate, Callback::Release]);
        }
        let actual = match self.guard(|_| binding.allocate(request)) {
            Ok(Ok(handle)) => {
                assert!(handle.address().is_aligned_to(request.align()));
                let identity = handle.identity().expect("a live handle has an identity");
                assert_eq!(*identity.binding(), binding.identity(), "allocation names another binding");
                let mechanism = self.mech_index(identity.binding().mechanism());
                let serial = self.mechs[mechanism]
                    .ledger
                    .serial_at(handle.address().get())
                    .unwrap_or_else(|| panic!("invariant: allocation {identity} is not a live block of its allocator"));
                let bytes = handle.bytes();
                self.allocs.push(Alloc { identity, serial, handle: Some(handle) });
                Out::Allocated { mechanism, bytes }
            }
            Ok(Err(AllocateError::Inactive { state, .. })) => Out::AllocInactive(mechanism_state(state)),
            Ok(Err(AllocateError::DeviceLost { reason, .. })) => Out::AllocDeviceLost(reason),
            Ok(Err(AllocateError::Allocator(_))) => Out::AllocAllocator,
            Ok(Err(AllocateError::Identity(_))) => Out::IdentityExhausted,
            Ok(Err(e)) => Out::Other(e.to_string()),
            Err(panicked) => panicked,
        };
        if self.limited && expected != actual && matches!(actual, Out::IdentityExhausted | Out::Panicked) {
            // Made, not recorded, given back (and that release may have panicked).
            self.model = saved.expect("saved");
            let expected = self.model.allocate_unrecorded(key, request.bytes());
            return self.agree(expected, actual, None);
        }
        self.agree(expected, actual, None);
    }

    /// Takes a held allocation out (ours, by model index, or the foreign one).
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

    /// The binding an operation goes through, and what the model calls it.
    fn through(&self, binding: Pick) -> Option<(MemoryBinding, Through)> {
        match binding {
            Pick::Foreign => Some((self.foreign.binding.clone(), Through::Foreign)),
            Pick::Ours(i) => pick(i, self.bindings.len())
                .map(|i| (self.bindings[i].binding.clone(), Through::Binding(self.bindings[i].key))),
        }
    }

    /// A refused handle operation: the handle comes back intact.
    fn rejected(&mut self, rejected: Rejected<BoundAllocation>, index: Option<usize>) -> Out {
        let Rejected { handle, reason } = rejected;
        self.put_back(handle, index);
        Out::Handle(handle_error(&reason))
    }

    fn release(&mut self, binding: Pick, allocation: Pick) {
        if matches!((binding, allocation), (Pick::Foreign, Pick::Foreign)) {
            return;
        }
        let Some((b, through)) = self.through(binding) else { return };
        let Some((handle, index)) = self.take_handle(allocation) else { return };
        // Another registry's handle is refused as foreign before anything else.
        let expected = index.map_or(Out::Handle(Handle::Foreign), |i| self.model.release(i, through));
        self.allowed = Allowed::Only(&[Callback::Release]);
        // Boxed: a rejection carries the whole handle back.
        let actual = match self.guard(|_| b.release(handle).map_err(Box::new)) {
            Ok(Ok(report)) => Out::Released(report),
            Ok(Err(rejected)) => self.rejected(*rejected, index),
            Err(panicked) => panicked,
        };
        self.agree(expected, actual, None);
    }

    fn release_deferred(&mut self, binding: Pick, allocation: Pick, queue: Dev) {
        if matches!((binding, allocation), (Pick::Foreign, Pick::Foreign)) {
            return;
        }
        let Some((b, through)) = self.through(binding) else { return };
        let Some((handle, index)) = self.take_handle(allocation) else { return };
        let expected =
            index.map_or(Out::Handle(Handle::Foreign), |i| self.model.release_deferred(i, through, queue.index()));
        // A deferral makes no allocator callback at all: the queue runs it later.
        self.allowed = Allowed::Nothing;
        let held = Arc::clone(&self.queues[queue.index()]);
        let actual = match b.release_deferred(handle, &*held) {
            Ok(()) => {
                let i = index.expect("only our handles can be deferred");
                assert!(holds(&held, &self.allocs[i].identity), "the queue does not hold the deferred release");
                Out::Deferred
            }
            Err(rejected) => self.rejected(rejected, index),
        };
        self.agree(expected, actual, None);
    }

    fn view(&mut self, allocation: Pick, offset: usize, len: usize) {
        let (handle, expected) = match allocation {
            Pick::Foreign => match &self.foreign.allocation {
                // Viewing checks the handle's own registry: the foreign one is live there.
                Some(h) => {
                    let inside = offset.checked_add(len).is_some_and(|end| end <= h.bytes());
                    (h, if inside { Out::Viewed { len } } else { Out::ViewOutOfBounds })
                }
                None => return,
            },
            Pick::Ours(i) => {
                let held = self.held();
                let Some(k) = pick(i, held.len()) else { return };
                (self.allocs[held[k]].handle.as_ref().expect("held"), self.model.view(held[k], offset, len))
            }
        };
        let actual = match handle.view(offset, len) {
            Ok(view) => {
                assert_eq!(view.offset(), offset);
                assert_eq!(view.address().get(), handle.address().get() + offset as u64);
                Out::Viewed { len: view.len() }
            }
            Err(ViewError::OutOfBounds { .. }) => Out::ViewOutOfBounds,
            Err(ViewError::Handle(e)) => Out::ViewHandle(handle_error(&e)),
            Err(e) => Out::Other(e.to_string()),
        };
        self.agree(expected, actual, None);
    }

    fn drop_allocation(&mut self, i: u8) {
        let held = self.held();
        let Some(k) = pick(i, held.len()) else { return };
        let handle = self.allocs[held[k]].handle.take().expect("held");
        let expected = self.model.drop_handle(held[k]);
        // Drop policy Release calls release; Defer and Quarantine call nothing.
        self.allowed = Allowed::Only(&[Callback::Release]);
        let actual = self.guard(|_| drop(handle)).map_or_else(|e| e, |()| Out::Done);
        self.agree(expected, actual, None);
    }

    fn confirm_at(&mut self, id: ProviderContextIdentity, context: Ref) {
        let expected = self.model.confirm(context);
        // Lost blocks and discharged quarantine go to forget_lost, one call per mechanism.
        self.allowed = Allowed::Only(&[Callback::ForgetLost]);
        let actual = match self.guard(|world| world.registry.confirm_context_terminated(&id)) {
            Ok(Ok(report)) => {
                assert_eq!(report.context, id);
                Out::Terminated {
                    already: report.already_terminated,
                    mechanisms: report.mechanisms,
                    lost_allocations: report.lost_allocations,
                    lost_bytes: report.lost_bytes,
                    discharged: report.discharged_quarantine,
                }
            }
            Ok(Err(e)) => registry_out(&e),
            Err(panicked) => panicked,
        };
        self.agree(expected, actual, None);
    }

    fn retry_at(&mut self, id: MechanismIdentity, mechanism: Ref) {
        let expected = self.model.retry(mechanism);
        self.allowed = Allowed::Only(&[Callback::Release]);
        let actual = match self.guard(|world| world.registry.retry_quarantined(&id)) {
            Ok(Ok(report)) => Out::Retried { released: report.released, still: report.still_quarantined },
            Ok(Err(e)) => registry_out(&e),
            Err(panicked) => panicked,
        };
        self.agree(expected, actual, None);
    }

    fn inject(&mut self, mechanism: u8, fault: Fault, nth: u8) {
        let Some(m) = pick(mechanism, self.mechs.len()) else { return };
        let faulty = self.mechs[m].ledger.faulty();
        let n = u64::from(nth % 4) + 1;
        let planned = match fault {
            Fault::FailAllocate => {
                faulty.fail_nth(Callback::Allocate, n);
                (FaultOn::Allocate, reference::Fault::Fail)
            }
            Fault::OutOfMemory => {
                let oom = AllocError::OutOfMemory {
                    device: self.mechs[m].device,
                    requested: 0,
                    align: 1,
                    available: MaybeBytes(None),
                };
                faulty.fail_nth_allocate_with(n, oom);
                (FaultOn::Allocate, reference::Fault::Fail)
            }
            Fault::FailRelease => {
                faulty.fail_nth(Callback::Release, n);
                (FaultOn::Release, reference::Fault::Fail)
            }
            Fault::QuarantineRelease { unmapped, residual } => {
                let (unmapped, residual) = (usize::from(unmapped), usize::from(residual));
                faulty.quarantine_nth_release(n, unmapped, residual);
                (FaultOn::Release, reference::Fault::Quarantine { unmapped, residual })
            }
            Fault::PanicAllocate => {
                faulty.panic_on_nth(Callback::Allocate, n);
                (FaultOn::Allocate, reference::Fault::Panic)
            }
            Fault::PanicRelease => {
                faulty.panic_on_nth(Callback::Release, n);
                (FaultOn::Release, reference::Fault::Panic)
            }
            Fault::PanicForgetLost => {
                faulty.panic_on_nth(Callback::ForgetLost, n);
                (FaultOn::ForgetLost, reference::Fault::Panic)
            }
            Fault::Clear => {
                faulty.clear();
                self.model.clear_faults(m);
                return;
            }
        };
        self.model.plan_fault(m, planned.0, n, planned.1);
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
        self.model.check_conservation();
        let mut ledger_live = vec![0usize; self.mechs.len()];
        for (i, a) in self.allocs.iter().enumerate() {
            let m = self.model.allocations[i].mechanism;
            let mech_state = self.model.mechanisms[m].state;
            let mech = &self.mechs[m];
            let state = self.registry.allocation_state(&a.identity);
            let status = mech.ledger.status(a.serial).expect("every allocation has a ledger entry");
            let queued = self.queued(&a.identity);
            let ctx = || format!("allocation {} ({mech_state:?} mechanism, queued {queued})", a.identity);
            assert_eq!(allocation_state(state), self.model.allocation_state(i), "{}: allocation_state", ctx());
            assert_eq!(queued, matches!(self.model.allocations[i].place, Place::Queued(_)), "{}: queued", ctx());
            match &a.handle {
                Some(handle) => {
                    assert_eq!(handle.identity(), Some(a.identity), "{}: handle identity changed", ctx());
                    let (expected_place, expected_status) = match mech_state {
                        reference::MechanismState::Terminated => (Place::Forgotten, BlockStatus::Forgotten),
                        _ => (Place::Record, BlockStatus::Live),
                    };
                    assert_eq!(self.model.allocations[i].place, expected_place, "{}: a held handle's block", ctx());
                    assert_eq!(status, expected_status, "{}: ledger status of a held handle", ctx());
                    assert_eq!(handle.is_valid(), self.model.handle_valid(i), "{}: is_valid", ctx());
                }
                None => match state {
                    AllocationState::Live => panic!("invariant: {} is live with no handle (leaked)", ctx()),
                    AllocationState::Lost | AllocationState::Quarantined => {
                        assert_eq!(status, BlockStatus::Live, "{}: a lost or quarantined block was freed", ctx())
                    }
                    AllocationState::Gone if queued => {
                        assert_eq!(status, BlockStatus::Live, "{}: a queued block was freed", ctx())
                    }
                    AllocationState::Gone => match status {
                        BlockStatus::Freed => {}
                        BlockStatus::Forgotten => {
                            note("state: forgotten at termination");
                            assert_eq!(mech_state, reference::MechanismState::Terminated, "{}: forgotten early", ctx())
                        }
                        BlockStatus::Live => {
                            panic!("invariant: {} is gone from the registry but its block was never released", ctx())
                        }
                    },
                    other => panic!("{}: unknown allocation state {other:?}", ctx()),
                },
            }
            if status == BlockStatus::Live {
                ledger_live[m] += 1;
            }
        }
        for (m, mech) in self.mechs.iter().enumerate() {
            // No block is live in a ledger without an allocation of ours accounting for it.
            assert_eq!(
                mech.ledger.live_count(),
                ledger_live[m],
                "invariant: mechanism {} holds blocks no allocation accounts for",
                mech.id
            );
            // The callbacks and the heap agree with the model's books.
            let (counts, calls) = (mech.ledger.counts(), self.model.mechanisms[m].calls);
            assert_eq!(
                (counts.get(Callback::Allocate), counts.get(Callback::Release), counts.get(Callback::ForgetLost)),
                (calls.allocate, calls.release, calls.forget_lost),
                "mechanism {}: allocate, release and forget_lost callbacks",
                mech.id
            );
            let heap = mech.ledger.faulty().inner().stats().expect("the heap keeps stats");
            assert_eq!(heap.live_allocations, calls.heap_live, "mechanism {}: blocks in the heap", mech.id);
            assert_eq!(mech.ledger.faulty().pending(), self.model.mechanisms[m].pending_faults(), "pending faults");
        }
        for (q, queue) in self.queues.iter().enumerate() {
            let held = queue.identities();
            let expected: Vec<_> = self.model.queues[q].iter().map(|&i| self.allocs[i].identity).collect();
            assert_eq!(held, expected, "queue {q} holds other releases than the model");
        }

        let snapshot = self.registry.snapshots();
        assert_eq!(snapshot.registry, self.registry.id());
        let mut found: Vec<_> = snapshot.mechanisms.iter().map(|m| self.mech_index(m.identity)).collect();
        found.sort_unstable();
        assert_eq!(found, self.model.registered().collect::<Vec<_>>(), "snapshot mechanisms disagree with the model");
        for (m, mech) in self.mechs.iter().enumerate() {
            if self.model.mechanisms[m].removed {
                assert!(
                    matches!(self.registry.snapshot(&mech.id), Err(RegistryError::Unknown { .. })),
                    "a removed mechanism is still known"
                );
                continue;
            }
            let s = snapshot.mechanisms.iter().find(|s| s.identity == mech.id).expect("listed");
            let expected = self.model.view_mechanism(m);
            assert_eq!((s.device, s.context, s.authority), (mech.device, mech.context, mech.authority));
            assert_eq!(self.contexts[expected.context], mech.context, "mechanism {} context", mech.id);
            assert_eq!(self.authorities[expected.authority], mech.authority, "mechanism {} authority", mech.id);
            assert_eq!(mechanism_state(s.state), expected.state, "mechanism {} state", mech.id);
            assert_eq!(s.selected, expected.selected, "mechanism {} selection", mech.id);
            assert_eq!(
                (s.live_allocations, s.live_bytes, s.in_flight),
                (expected.live_allocations, expected.live_bytes, expected.in_flight),
                "mechanism {} live count, bytes and in-flight count",
                mech.id
            );
            assert_eq!(s.in_flight, self.queued_for(&mech.id), "mechanism {} in flight", mech.id);
            assert_eq!(s.lost_reason, expected.lost_reason, "mechanism {} lost reason", mech.id);
            let mut quarantined: Vec<_> = s
                .quarantined
                .iter()
                .map(|q| {
                    let i = self
                        .allocs
                        .iter()
                        .position(|a| {
                            a.identity.generation() == q.generation && a.identity.binding().mechanism() == mech.id
                        })
                        .unwrap_or_else(|| panic!("quarantine entry {q:?} names no allocation of ours"));
                    assert!(
                        q.unmapped_bytes.checked_add(q.residual_bytes).is_some_and(|t| t <= q.bytes),
                        "invariant: quarantine claims more than the block: {q:?}"
                    );
                    assert_eq!(q.binding, self.allocs[i].identity.binding().binding(), "quarantine entry binding");
                    (i, (q.bytes, q.unmapped_bytes, q.residual_bytes, reason_of(&q.reason)))
                })
                .collect();
            quarantined.sort_unstable_by_key(|q| q.0);
            assert_eq!(quarantined, expected.quarantined, "mechanism {} quarantine", mech.id);
        }
        for dev in Dev::ALL {
            let expected = self.model.selection[dev.index()].map(|i| self.mechs[i].id);
            assert_eq!(self.registry.selected(dev.key()), expected, "selection of {}", dev.key());
        }
        let mut found: Vec<_> = snapshot
            .contexts
            .iter()
            .map(|c| {
                let i = self.contexts.iter().position(|k| *k == c.identity).expect("one of our contexts");
                (i, c.device, context_state(c.state))
            })
            .collect();
        found.sort_unstable_by_key(|c| c.0);
        let view = self.model.view_all();
        assert_eq!(found, view.contexts, "snapshot contexts disagree with the model");
        let mut found: Vec<_> = snapshot
            .authorities
            .iter()
            .map(|a| (self.authorities.iter().position(|k| *k == a.identity).expect("ours"), a.device))
            .collect();
        found.sort_unstable_by_key(|a| a.0);
        assert_eq!(found, view.authorities, "snapshot authorities disagree with the model");
        for bound in &self.bindings {
            let m = self.model.bindings[bound.key];
            assert_eq!(mechanism_state(bound.binding.state()), self.model.mechanisms[m].state, "binding state");
        }
    }

    /// The end of an input: drop every handle, run every queue, retry every
    /// quarantine, confirm every lost context; then no block may be live anywhere.
    pub fn finish(&mut self) {
        for (m, mech) in self.mechs.iter().enumerate() {
            mech.ledger.faulty().clear();
            self.model.clear_faults(m);
        }
        while !self.held().is_empty() {
            self.step(Op::DropAllocation(0));
        }
        for dev in Dev::ALL {
            while !self.queues[dev.index()].is_empty() {
                self.step(Op::RunQueued { queue: dev, count: 3 });
            }
        }
        for m in 0..self.mechs.len() {
            if !self.model.mechanisms[m].removed {
                let id = self.mechs[m].id;
                self.checked(format!("end: retry_quarantined({id})"), |world| world.retry_at(id, Ref::Ours(m)));
            }
        }
        for c in 0..self.contexts.len() {
            let context = &self.model.contexts[c];
            if !context.removed && context.state == reference::ContextState::Lost {
                let id = self.contexts[c];
                self.checked(format!("end: confirm_context_terminated({id})"), |world| {
                    world.confirm_at(id, Ref::Ours(c))
                });
                assert_eq!(
                    self.model.contexts[c].state,
                    reference::ContextState::Terminated,
                    "a drained lost context was not terminated"
                );
            }
        }
        for (m, mech) in self.mechs.iter().enumerate() {
            assert_eq!(
                mech.ledger.live_count(),
                0,
                "invariant: at the end mechanism {} ({:?}) still holds blocks released by no path",
                mech.id,
                self.model.mechanisms[m].state
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
