//! Callbacks that lie, re-enter, panic while a thread unwinds, or run while the device
//! is lost (issue 11). Every case here is fast and runs in CI.
//!
//! The rule they check: the registry trusts no answer it did not mint, and runs no
//! callback under a lock or on a lost device.

mod common;

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::time::Duration;

use tracing::Level;

use common::{Collector, HeldQueue, PAGE, has, register, register_with, request};
use memory_api::ReleaseSummary;
use memory_api::{
    AllocError, AllocationRequest, ByteRange, CapabilityError, DeferredReleaseQueue, DeviceAddress, DeviceAllocator,
    DeviceKey, IdentityError, IdentityIssuer, MappingAccess, MechanismIdentity, PreparedRelease, QueueRefusal,
    QueueRefusalReason, RawAllocation, ReleaseError, ReleaseOutcome, SharedBacking, SharedMapping, SharedPlacement,
    VirtualBacking,
};
use memory_binding::{
    AllocateError, BindingRegistry, BoundCapabilityError, DropPolicy, HandleError, MechanismOptions, RegistryError,
};

const GPU0: DeviceKey = DeviceKey::device(0);

// ---------------------------------------------------------------------------------
// A bookkeeping allocator that remembers every block it made, released and forgot
// ---------------------------------------------------------------------------------

/// Hands out addresses from a counter (no memory behind them) and keeps exact books:
/// which blocks are live, which were released (and how often a release named a block
/// it did not hold), and which were handed to `forget_lost`.
#[derive(Default)]
struct Ledger {
    device: OnceLock<DeviceKey>,
    next: AtomicU64,
    live: Mutex<BTreeMap<u64, usize>>,
    released: AtomicUsize,
    unknown_releases: AtomicUsize,
    forgotten: Mutex<Vec<u64>>,
    /// Runs inside `allocate`, after the block is made (for example: lose the device).
    on_allocate: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Answer allocations with a block one byte short of the request.
    short_blocks: AtomicBool,
    /// Panic inside `release` (after keeping the block live).
    panic_on_release: AtomicBool,
    /// Answer a release `Complete` with this many unmapped bytes (0: the block's size).
    complete_claims: AtomicUsize,
    /// Refuse every release (nothing mutated).
    refuse_releases: AtomicBool,
}

impl Ledger {
    fn on(device: DeviceKey) -> Arc<Ledger> {
        let ledger = Ledger { next: AtomicU64::new(1 << 32), ..Ledger::default() };
        ledger.device.set(device).unwrap();
        Arc::new(ledger)
    }

    fn live(&self) -> usize {
        self.live.lock().unwrap().len()
    }

    fn released(&self) -> usize {
        self.released.load(Ordering::SeqCst)
    }

    fn unknown_releases(&self) -> usize {
        self.unknown_releases.load(Ordering::SeqCst)
    }

    fn forgotten(&self) -> Vec<u64> {
        self.forgotten.lock().unwrap().clone()
    }
}

impl DeviceAllocator for Ledger {
    fn device(&self) -> DeviceKey {
        *self.device.get().unwrap()
    }
    fn name(&self) -> &str {
        "ledger"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let span = request.bytes().max(1).next_multiple_of(PAGE) as u64;
        let address = self.next.fetch_add(span, Ordering::SeqCst);
        self.live.lock().unwrap().insert(address, request.bytes());
        if let Some(hook) = self.on_allocate.get() {
            hook();
        }
        let bytes = if self.short_blocks.load(Ordering::SeqCst) { request.bytes() - 1 } else { request.bytes() };
        Ok(RawAllocation::new(DeviceAddress::new(address).unwrap(), bytes, request.align(), self.device(), 0))
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        if self.panic_on_release.load(Ordering::SeqCst) {
            panic!("ledger release exploded");
        }
        let refused = self.refuse_releases.load(Ordering::SeqCst);
        if refused || self.live.lock().unwrap().remove(&allocation.address().get()).is_none() {
            self.unknown_releases.fetch_add(usize::from(!refused), Ordering::SeqCst);
            let error = ReleaseError::NotOwned {
                allocator: "ledger".into(),
                device: self.device(),
                address: allocation.address().get(),
            };
            return ReleaseOutcome::failed(allocation, error);
        }
        self.released.fetch_add(1, Ordering::SeqCst);
        match self.complete_claims.load(Ordering::SeqCst) {
            0 => ReleaseOutcome::complete(allocation.bytes()),
            claimed => ReleaseOutcome::complete(claimed),
        }
    }
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        let mut live = self.live.lock().unwrap();
        let mut forgotten = self.forgotten.lock().unwrap();
        for block in lost {
            live.remove(&block.address().get());
            forgotten.push(block.address().get());
        }
    }
}

fn counts(registry: &BindingRegistry, mechanism: &MechanismIdentity) -> (usize, usize, usize) {
    let s = registry.snapshot(mechanism).unwrap();
    (s.live_allocations, s.quarantined.len(), s.in_flight)
}

// ---------------------------------------------------------------------------------
// Item 3: a queue that refuses with another release than the one offered
// ---------------------------------------------------------------------------------

/// What a dishonest queue does with the release it is offered before refusing with a
/// forged one.
#[derive(Copy, Clone, Debug, PartialEq)]
enum Offered {
    /// Drops it (its completion quarantines the block as abandoned).
    Drop,
    /// Keeps it, to run later.
    Keep,
    /// Runs it at once (the block is released for real).
    Execute,
    /// Withdraws it and keeps the block it gets back.
    Cancel,
}

/// What the forged release it refuses with names.
#[derive(Copy, Clone, Debug, PartialEq)]
enum Forged {
    /// The offered identity, but a block at another address.
    OtherBlock,
    /// An exact copy of the offered identity and block (with another completion).
    ExactCopy,
}

/// An allocator for forged releases: it must never be called.
struct NeverCalled;

impl DeviceAllocator for NeverCalled {
    fn device(&self) -> DeviceKey {
        GPU0
    }
    fn name(&self) -> &str {
        "never-called"
    }
    fn allocate(&self, _: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        panic!("a forged release's allocator was asked to allocate")
    }
    fn release(&self, _: RawAllocation) -> ReleaseOutcome {
        panic!("a forged release's allocator was asked to release")
    }
}

/// Refuses every release with a forged one, after doing `offered` with the real one.
struct ForgingQueue {
    offered: Offered,
    forged: Forged,
    /// The address of the block under test (a queue cannot read it from a release; the
    /// test tells it, so that it can forge an exact copy).
    address: AtomicU64,
    kept: Mutex<Vec<PreparedRelease>>,
    forged_completions: Arc<AtomicUsize>,
}

impl ForgingQueue {
    fn new(offered: Offered, forged: Forged) -> ForgingQueue {
        ForgingQueue {
            offered,
            forged,
            address: AtomicU64::new(0),
            kept: Mutex::new(Vec::new()),
            forged_completions: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl DeferredReleaseQueue for ForgingQueue {
    fn device(&self) -> DeviceKey {
        GPU0
    }
    fn enqueue(&self, release: PreparedRelease) -> Result<(), QueueRefusal> {
        let identity = *release.identity();
        let bytes = release.bytes();
        // What a queue can see of a release: its identity, size and allocator's name.
        assert!(format!("{release:?}").contains("allocator: \"ledger\""), "{release:?}");
        match self.offered {
            Offered::Drop => drop(release),
            Offered::Keep => self.kept.lock().unwrap().push(release),
            Offered::Execute => {
                let _ = release.execute();
            }
            Offered::Cancel => drop(release.cancel()),
        }
        let address = match self.forged {
            Forged::OtherBlock => 0xdead_0000,
            Forged::ExactCopy => self.address.load(Ordering::SeqCst),
        };
        let block = RawAllocation::new(DeviceAddress::new(address).unwrap(), bytes, 64, GPU0, 0);
        let calls = Arc::clone(&self.forged_completions);
        let completion = Box::new(move |_: ReleaseOutcome| {
            calls.fetch_add(1, Ordering::SeqCst);
        });
        let forged = PreparedRelease::new(identity, Arc::new(NeverCalled), block, completion);
        Err(QueueRefusal { release: forged, reason: QueueRefusalReason::Closed })
    }
}

/// A queue that refuses with a forged release never corrupts the in-flight count, never
/// re-records a forged block, and never lets the real block be released twice: the
/// real block is counted out exactly once and stays owned (quarantined) unless the
/// queue really ran its release.
#[test]
fn a_queue_refusing_with_a_forged_release_cannot_corrupt_the_books() {
    let cases = [
        (Offered::Drop, Forged::OtherBlock),
        (Offered::Drop, Forged::ExactCopy),
        (Offered::Keep, Forged::OtherBlock),
        (Offered::Keep, Forged::ExactCopy),
        (Offered::Execute, Forged::OtherBlock),
        (Offered::Execute, Forged::ExactCopy),
        (Offered::Cancel, Forged::OtherBlock),
    ];
    for (offered, forged) in cases {
        let what = format!("{offered:?} then refuse with {forged:?}");
        let registry = BindingRegistry::new();
        let ledger = Ledger::on(GPU0);
        let (context, _, mechanism) = register(&registry, ledger.clone());
        let binding = registry.bind_registered(&mechanism).unwrap();
        let queue = ForgingQueue::new(offered, forged);
        let block = binding.allocate(request(PAGE)).unwrap();
        let address = block.address().get();
        queue.address.store(address, Ordering::SeqCst);

        let collector = Collector::default();
        let traced = collector.install();
        let result = binding.release_deferred(block, &queue);
        drop(traced);
        assert!(result.is_ok(), "{what}: a release the queue lost has no handle left to give back: {result:?}");
        assert!(has(&collector.take(), Level::ERROR, "refused with another release"), "{what}: not traced");
        let (live, quarantined, in_flight) = counts(&registry, &mechanism);
        assert_eq!((live, in_flight), (0, 0), "{what}: the forged refusal was booked (or counted out twice)");
        let released = offered == Offered::Execute;
        assert_eq!(quarantined, usize::from(!released), "{what}");
        assert_eq!((ledger.released(), ledger.unknown_releases()), (usize::from(released), 0), "{what}");
        if !released {
            let snapshot = registry.snapshot(&mechanism).unwrap();
            assert_eq!((snapshot.quarantined[0].bytes, snapshot.quarantined_bytes()), (PAGE, PAGE), "{what}");
        }

        // The kept original comes due later: it must not release the block behind the
        // quarantine's back, nor count anything out again.
        for kept in std::mem::take(&mut *queue.kept.lock().unwrap()) {
            let _ = kept.execute();
        }
        assert_eq!(
            (ledger.released(), counts(&registry, &mechanism)),
            (usize::from(released), (0, usize::from(!released), 0))
        );
        assert_eq!(queue.forged_completions.load(Ordering::SeqCst), 0, "{what}: a forged completion ran");

        // Termination is not blocked and hands exactly the real block to forget_lost.
        registry.invalidate_device(GPU0, "reset");
        let report = registry.confirm_context_terminated(&context).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(report.discharged_quarantine, usize::from(!released), "{what}");
        let expected: Vec<u64> = if released { vec![] } else { vec![address] };
        assert_eq!(ledger.forgotten(), expected, "{what}");
        assert_eq!(ledger.live(), 0, "{what}: the real block leaked");
    }
}

/// The drop-time deferred path (`DropPolicy::Defer`) with a forging queue: the block is
/// counted out exactly once and stays quarantined.
#[test]
fn a_drop_time_deferral_refused_with_a_forged_release_is_counted_out_once() {
    for offered in [Offered::Drop, Offered::Keep, Offered::Cancel] {
        let registry = BindingRegistry::new();
        let ledger = Ledger::on(GPU0);
        let queue = Arc::new(ForgingQueue::new(offered, Forged::OtherBlock));
        let options = MechanismOptions::default().with_drop_policy(Some(DropPolicy::Defer(queue.clone())));
        let (context, _, mechanism) = register_with(&registry, ledger.clone(), options);
        let binding = registry.bind_registered(&mechanism).unwrap();
        let block = binding.allocate(request(PAGE)).unwrap();
        let address = block.address().get();
        drop(block);
        assert_eq!(counts(&registry, &mechanism), (0, 1, 0), "{offered:?}");
        for kept in std::mem::take(&mut *queue.kept.lock().unwrap()) {
            let _ = kept.execute();
        }
        assert_eq!((ledger.released(), counts(&registry, &mechanism)), (0, (0, 1, 0)), "{offered:?}");
        registry.invalidate_device(GPU0, "reset");
        registry.confirm_context_terminated(&context).unwrap();
        assert_eq!(ledger.forgotten(), vec![address], "{offered:?}");
    }
}

/// The control: an honest refusal (the exact release handed back) gives the caller's
/// handle back, re-recorded, with nothing in flight.
#[test]
fn an_honest_refusal_hands_the_allocation_back_recorded() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::on(GPU0);
    let (_, _, mechanism) = register(&registry, ledger.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(request(PAGE)).unwrap();
    let identity = block.identity();
    let rejected = binding.release_deferred(block, &HeldQueue::new(GPU0, 0)).unwrap_err();
    assert!(matches!(rejected.reason, HandleError::QueueRefused(QueueRefusalReason::Full { .. })));
    assert_eq!(rejected.handle.identity(), identity);
    assert_eq!(counts(&registry, &mechanism), (1, 0, 0));
    binding.release(rejected.handle).unwrap();
    assert_eq!((ledger.released(), ledger.live()), (1, 0));
}

// ---------------------------------------------------------------------------------
// Item 4: no callback runs under any registry lock
// ---------------------------------------------------------------------------------

/// The device the lock probe works on, so that it never disturbs the test's own books.
const PROBE_DEVICE: DeviceKey = DeviceKey::device(7);

/// How long a probe waits for the registry before calling the callback's caller
/// guilty of holding a lock (a healthy probe answers in microseconds).
const PROBE_PATIENCE: Duration = Duration::from_secs(10);

thread_local! {
    /// Set on probe threads: callbacks they trigger themselves (a snapshot asks every
    /// allocator its name) do not probe again.
    static PROBING: Cell<bool> = const { Cell::new(false) };
}

/// From inside a callback, asks another thread to take every registry lock class and
/// waits (with a timeout) for it: the cold lock (`select`), the identity tables' shards
/// (register and remove a context and an authority), and every pin's record lock and
/// quarantine lock (`snapshots`). A callback made under any of them stalls the probe.
#[derive(Default)]
struct LockProbe {
    registry: OnceLock<BindingRegistry>,
    spare: OnceLock<MechanismIdentity>,
    probed: Mutex<BTreeSet<&'static str>>,
    stalled: Mutex<Vec<&'static str>>,
}

impl LockProbe {
    /// Arms the probe: it needs a mechanism of its own to select.
    fn arm(&self, registry: &BindingRegistry) {
        let (_, _, spare) = register(registry, Arc::new(common::Caps::new(PROBE_DEVICE)));
        self.spare.set(spare).unwrap();
        self.registry.set(registry.clone()).unwrap();
    }

    fn probe(&self, callback: &'static str) {
        if PROBING.get() {
            return;
        }
        let (Some(registry), Some(spare)) = (self.registry.get(), self.spare.get()) else { return };
        let (registry, spare) = (registry.clone(), *spare);
        let (done, finished) = mpsc::channel();
        std::thread::spawn(move || {
            PROBING.set(true);
            registry.select(&spare).expect("the probe's own mechanism stays selectable");
            let context = registry.register_provider_context(PROBE_DEVICE, Arc::new(())).unwrap();
            let authority = registry.register_authority(PROBE_DEVICE, Arc::new(())).unwrap();
            assert!(!registry.snapshots().mechanisms.is_empty());
            registry.remove_provider_context(&context).unwrap();
            registry.remove_authority(&authority).unwrap();
            let _ = done.send(());
        });
        self.probed.lock().unwrap().insert(callback);
        if finished.recv_timeout(PROBE_PATIENCE).is_err() {
            self.stalled.lock().unwrap().push(callback);
        }
    }

    fn probed(&self) -> BTreeSet<&'static str> {
        self.probed.lock().unwrap().clone()
    }

    fn stalled(&self) -> Vec<&'static str> {
        self.stalled.lock().unwrap().clone()
    }
}

/// An allocator with both capabilities whose every method, and its destructor, probes
/// the registry's locks before doing its work.
struct ProbingAllocator {
    caps: common::Caps,
    probe: Arc<LockProbe>,
    /// Answer the next allocation with a block one byte short (to reach the give-back
    /// of an unfit block).
    unfit_next: AtomicBool,
}

impl ProbingAllocator {
    fn on(device: DeviceKey, probe: &Arc<LockProbe>) -> Arc<ProbingAllocator> {
        Arc::new(ProbingAllocator {
            caps: common::Caps::new(device),
            probe: Arc::clone(probe),
            unfit_next: AtomicBool::new(false),
        })
    }
}

impl Drop for ProbingAllocator {
    fn drop(&mut self) {
        self.probe.probe("allocator destructor");
    }
}

impl DeviceAllocator for ProbingAllocator {
    fn device(&self) -> DeviceKey {
        self.probe.probe("device");
        self.caps.device()
    }
    fn name(&self) -> &str {
        self.probe.probe("name");
        "probing"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.probe.probe("allocate");
        let block = self.caps.allocate(request)?;
        if !self.unfit_next.swap(false, Ordering::SeqCst) {
            return Ok(block);
        }
        Ok(RawAllocation::new(block.address(), block.bytes() - 1, block.align(), block.device(), 0))
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.probe.probe("release");
        self.caps.release(allocation)
    }
    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        self.probe.probe("virtual_backing");
        Some(self)
    }
    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        self.probe.probe("shared_mapping");
        Some(self)
    }
    fn stats(&self) -> Option<memory_api::AllocatorStats> {
        self.probe.probe("stats");
        None
    }
    fn trim(&self) -> usize {
        self.probe.probe("trim");
        0
    }
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        self.probe.probe("forget_lost");
        self.caps.forget_lost(lost);
    }
}

impl VirtualBacking for ProbingAllocator {
    fn granularity(&self) -> usize {
        self.probe.probe("virtual granularity");
        VirtualBacking::granularity(&self.caps)
    }
    fn commit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.probe.probe("commit");
        self.caps.commit(allocation, range)
    }
    fn decommit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.probe.probe("decommit");
        self.caps.decommit(allocation, range)
    }
    fn committed_bytes(&self, allocation: &RawAllocation) -> Result<usize, CapabilityError> {
        self.probe.probe("committed_bytes");
        self.caps.committed_bytes(allocation)
    }
}

impl SharedMapping for ProbingAllocator {
    fn granularity(&self) -> usize {
        self.probe.probe("shared granularity");
        SharedMapping::granularity(&self.caps)
    }
    fn create_backing(&self, bytes: usize) -> Result<SharedBacking, CapabilityError> {
        self.probe.probe("create_backing");
        self.caps.create_backing(bytes)
    }
    fn map(
        &self,
        backing: &SharedBacking,
        allocation: &RawAllocation,
        placement: SharedPlacement,
        access: MappingAccess,
    ) -> Result<(), CapabilityError> {
        self.probe.probe("map");
        self.caps.map(backing, allocation, placement, access)
    }
    fn unmap(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.probe.probe("unmap");
        self.caps.unmap(allocation, range)
    }
}

/// A deferred-release queue that probes in every method and holds what it takes.
struct ProbingQueue {
    device: DeviceKey,
    probe: Arc<LockProbe>,
    held: Mutex<Vec<PreparedRelease>>,
}

impl DeferredReleaseQueue for ProbingQueue {
    fn device(&self) -> DeviceKey {
        self.probe.probe("queue device");
        self.device
    }
    fn enqueue(&self, release: PreparedRelease) -> Result<(), QueueRefusal> {
        self.probe.probe("enqueue");
        self.held.lock().unwrap().push(release);
        Ok(())
    }
}

impl Drop for ProbingQueue {
    fn drop(&mut self) {
        self.probe.probe("queue destructor");
    }
}

/// A context or authority resource whose destructor probes.
struct ProbingResource(Arc<LockProbe>, &'static str);

impl Drop for ProbingResource {
    fn drop(&mut self) {
        self.0.probe(self.1);
    }
}

/// Every registry operation, driven through an allocator, queue and resources whose
/// every callback and destructor checks from another thread that no registry lock is
/// held: none may stall the probe.
#[test]
fn no_callback_or_destructor_runs_under_a_registry_lock() {
    let probe = Arc::new(LockProbe::default());
    let registry = BindingRegistry::new();
    probe.arm(&registry);
    let resource = |what| -> memory_binding::Resource { Arc::new(ProbingResource(Arc::clone(&probe), what)) };

    // Registration (a device-tier mechanism deferring drops to a queue, a host one
    // releasing at once, and the one-call adapter).
    let context = registry.register_provider_context(GPU0, resource("context destructor")).unwrap();
    let authority = registry.register_authority(GPU0, resource("authority destructor")).unwrap();
    let queue = Arc::new(ProbingQueue { device: GPU0, probe: Arc::clone(&probe), held: Mutex::new(Vec::new()) });
    let allocator = ProbingAllocator::on(GPU0, &probe);
    let options = MechanismOptions::default().with_drop_policy(Some(DropPolicy::Defer(queue.clone())));
    let deferring = registry.register_allocator_with(&context, &authority, allocator.clone(), options).unwrap();
    let quarantining = registry.register_allocator(&context, &authority, ProbingAllocator::on(GPU0, &probe)).unwrap();
    let host = registry.with_memory(ProbingAllocator::on(DeviceKey::HOST, &probe)).unwrap();
    // SAFETY: the probing allocator is a bookkeeping allocator (no memory behind its
    // addresses) that implements its capabilities itself.
    let composite = unsafe {
        let allocator = ProbingAllocator::on(GPU0, &probe);
        registry.register_trusted_composite(&context, &authority, allocator, MechanismOptions::default())
    }
    .unwrap();

    // Selection and binding.
    assert_eq!(registry.selected(GPU0), Some(deferring));
    registry.select(&quarantining).unwrap();
    let binding = registry.bind(GPU0).unwrap();
    let deferring_binding = registry.bind_registered(&deferring).unwrap();

    // The hot path: allocate, view, release, the three drop policies, a deferred
    // release and an unfit block given back.
    let block = binding.allocate(request(4 * PAGE)).unwrap();
    assert_eq!(block.view(PAGE, PAGE).unwrap().len(), PAGE);
    assert_eq!(registry.allocation_state(&block.identity().unwrap()), memory_binding::AllocationState::Live);
    let virt = binding.virtual_backing().unwrap();
    let page = ByteRange::new(0, PAGE);
    assert_eq!((virt.granularity(), virt.commit(&block, page).unwrap()), (PAGE, PAGE));
    assert_eq!(virt.committed_bytes(&block).unwrap(), PAGE);
    assert_eq!(virt.decommit(&block, page).unwrap(), PAGE);
    let shared = binding.shared_mapping().unwrap();
    let backing = shared.create_backing(PAGE).unwrap();
    let placement = SharedPlacement { target: page, backing_offset: 0 };
    shared.map(&backing, &block, placement, MappingAccess::ReadOnly).unwrap();
    assert_eq!((shared.granularity(), shared.unmap(&block, page).unwrap()), (PAGE, PAGE));
    assert!(matches!(binding.release(block), Ok(ReleaseSummary::Complete { .. })));
    drop(binding.allocate(request(PAGE)).unwrap()); // quarantined on drop
    drop(host.allocate(request(PAGE)).unwrap()); // released on drop
    drop(deferring_binding.allocate(request(PAGE)).unwrap()); // deferred on drop
    deferring_binding.release_deferred(deferring_binding.allocate(request(PAGE)).unwrap(), &*queue).unwrap();
    for held in std::mem::take(&mut *queue.held.lock().unwrap()) {
        assert!(matches!(held.execute(), memory_api::ReleaseSummary::Complete { .. }));
    }
    allocator.unfit_next.store(true, Ordering::SeqCst);
    let unfit = deferring_binding.allocate(request(PAGE));
    assert!(matches!(unfit, Err(AllocateError::InvalidBlock { .. })), "{unfit:?}");
    let _ = (host.allocator().stats(), host.allocator().trim());

    // Snapshots, quarantine retry, retirement and removal.
    assert_eq!(registry.snapshot(&quarantining).unwrap().quarantined.len(), 1);
    assert_eq!(registry.snapshots().mechanisms.len(), 5);
    assert_eq!(registry.retry_quarantined(&quarantining).unwrap().released, 1);
    let host_mechanism = host.identity().mechanism();
    registry.retire(&host_mechanism).unwrap();
    drop(host);
    registry.remove(&host_mechanism).unwrap(); // the host allocator's destructor runs here

    // Device loss and termination (forget_lost), then the context and authority go.
    let kept = binding.allocate(request(PAGE)).unwrap();
    registry.invalidate_device(GPU0, "probe");
    assert_eq!(registry.confirm_context_terminated(&context).unwrap().lost_allocations, 1);
    drop((kept, binding, deferring_binding, virt, shared, backing, allocator, queue));
    registry.remove(&deferring).unwrap();
    registry.remove(&quarantining).unwrap();
    registry.remove(&composite).unwrap();
    registry.remove_provider_context(&context).unwrap();
    registry.remove_authority(&authority).unwrap();

    let expected: BTreeSet<&str> = [
        "device",
        "name",
        "allocate",
        "release",
        "virtual_backing",
        "shared_mapping",
        "stats",
        "trim",
        "forget_lost",
        "virtual granularity",
        "commit",
        "decommit",
        "committed_bytes",
        "shared granularity",
        "create_backing",
        "map",
        "unmap",
        "queue device",
        "enqueue",
        "queue destructor",
        "allocator destructor",
        "context destructor",
        "authority destructor",
    ]
    .into_iter()
    .collect();
    assert_eq!(probe.probed(), expected, "the test must reach every callback and destructor");
    assert_eq!(probe.stalled(), Vec::<&str>::new(), "callbacks made while a registry lock was held");
}

// ---------------------------------------------------------------------------------
// Item 7: the device is lost while `allocate` is inside the allocator
// ---------------------------------------------------------------------------------

/// Makes `ledger` invalidate its device from inside the `nth` allocate call from now.
fn lose_device_inside_allocate(ledger: &Ledger, registry: &BindingRegistry, nth: usize) {
    let registry = Mutex::new(Some(registry.clone()));
    let calls = AtomicUsize::new(0);
    let hook = move || {
        if calls.fetch_add(1, Ordering::SeqCst) + 1 == nth
            && let Some(registry) = registry.lock().unwrap().take()
        {
            registry.invalidate_device(GPU0, "lost inside allocate");
        }
    };
    assert!(ledger.on_allocate.set(Box::new(hook)).is_ok());
}

/// An unfit block answered after the device was lost is not released through the lost
/// device's allocator: it is kept and handed to `forget_lost` at termination.
#[test]
fn an_unfit_block_returned_after_device_loss_is_kept_for_forget_lost_not_released() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::on(GPU0);
    let (context, _, mechanism) = register(&registry, ledger.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    lose_device_inside_allocate(&ledger, &registry, 1);
    ledger.short_blocks.store(true, Ordering::SeqCst);
    let collector = Collector::default();
    let traced = collector.install();
    let error = binding.allocate(request(PAGE)).unwrap_err();
    drop(traced);
    assert!(matches!(error, AllocateError::InvalidBlock { .. }), "{error}");
    assert!(has(&collector.take(), Level::ERROR, "kept for forget_lost"));
    assert_eq!((ledger.released(), ledger.unknown_releases()), (0, 0), "a callback reached a lost device");
    assert_eq!(ledger.live(), 1);
    let snapshot = registry.snapshot(&mechanism).unwrap();
    assert_eq!((snapshot.live_allocations, snapshot.live_bytes, snapshot.in_flight), (1, PAGE - 1, 0));
    let report = registry.confirm_context_terminated(&context).unwrap();
    assert_eq!((report.lost_allocations, report.lost_bytes), (1, PAGE - 1));
    assert_eq!((ledger.forgotten().len(), ledger.live(), ledger.released()), (1, 0, 0));
}

/// The same for a block that cannot be recorded (generations exhausted): after loss it
/// is kept for `forget_lost`, not given back through the allocator.
#[test]
fn an_unrecordable_block_returned_after_device_loss_is_kept_for_forget_lost_not_released() {
    let registry = BindingRegistry::with_issuer(IdentityIssuer::with_serial_limit(256).unwrap());
    let ledger = Ledger::on(GPU0);
    let (context, _, mechanism) = register(&registry, ledger.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let blocks: Vec<_> = (0..256).map(|_| binding.allocate(request(8)).unwrap()).collect();
    lose_device_inside_allocate(&ledger, &registry, 1);
    let error = binding.allocate(request(8)).unwrap_err();
    assert!(matches!(error, AllocateError::Identity(IdentityError::Exhausted { .. })), "{error}");
    assert_eq!((ledger.released(), ledger.unknown_releases(), ledger.live()), (0, 0, 257));
    let report = registry.confirm_context_terminated(&context).unwrap();
    assert_eq!(report.lost_allocations, 257);
    assert_eq!((ledger.forgotten().len(), ledger.live(), ledger.released()), (257, 0, 0));
    drop(blocks);
    assert_eq!(ledger.released(), 0);
}

/// An unfit block the allocator then refuses to take back is reported as an error
/// event, and kept as live (the registry has no record to keep it under, but the
/// allocator still holds it).
#[test]
fn an_unfit_block_the_allocator_will_not_take_back_is_traced_as_an_error() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::on(GPU0);
    let (_, _, mechanism) = register(&registry, ledger.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    ledger.short_blocks.store(true, Ordering::SeqCst);
    ledger.refuse_releases.store(true, Ordering::SeqCst);
    let collector = Collector::default();
    let traced = collector.install();
    assert!(matches!(binding.allocate(request(PAGE)), Err(AllocateError::InvalidBlock { .. })));
    drop(traced);
    let events = collector.take();
    assert!(has(&events, Level::ERROR, "does not fit the request"), "{events:?}");
    assert!(has(&events, Level::ERROR, "an unfit block could not be given back"), "{events:?}");
    assert_eq!(counts(&registry, &mechanism), (1, 0, 0));
}

/// The control: on a healthy device an unfit block still goes straight back.
#[test]
fn an_unfit_block_on_a_healthy_device_is_given_back_at_once() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::on(GPU0);
    let (_, _, mechanism) = register(&registry, ledger.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    ledger.short_blocks.store(true, Ordering::SeqCst);
    assert!(matches!(binding.allocate(request(PAGE)), Err(AllocateError::InvalidBlock { .. })));
    assert_eq!((ledger.released(), ledger.live()), (1, 0));
    assert_eq!(counts(&registry, &mechanism), (0, 0, 0));
}

// ---------------------------------------------------------------------------------
// Item 8: a release that panics while the thread is already unwinding
// ---------------------------------------------------------------------------------

/// Runs `f` from a destructor while a worker thread unwinds from an unrelated panic
/// (as a runtime's worker does when a request fails), and returns what `f` returned.
/// A panic escaping `f` there would abort the whole process.
fn while_unwinding<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    struct RunOnDrop<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for RunOnDrop<F> {
        fn drop(&mut self) {
            assert!(std::thread::panicking(), "the destructor must run during unwinding");
            (self.0.take().unwrap())();
        }
    }
    let (sender, result) = mpsc::channel();
    let collector = Collector::current();
    let worker = std::thread::spawn(move || {
        let _traced = collector.as_ref().map(Collector::install);
        let _guard = RunOnDrop(Some(move || sender.send(f()).unwrap()));
        panic!("the worker's request failed");
    });
    assert!(worker.join().is_err(), "the worker's own panic must be the one that ends it");
    result.recv().unwrap()
}

fn panicked_quarantine(registry: &BindingRegistry, mechanism: &MechanismIdentity) -> Vec<(usize, String)> {
    let snapshot = registry.snapshot(mechanism).unwrap();
    assert_eq!((snapshot.live_allocations, snapshot.in_flight), (0, 0));
    snapshot.quarantined.iter().map(|q| (q.residual_bytes, q.reason.clone())).collect()
}

/// A live host allocation dropped by a thread that is unwinding, whose release panics:
/// the block is quarantined, the panic is logged, and the process does not abort.
#[test]
fn a_release_panicking_in_a_drop_during_unwinding_quarantines_without_aborting() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::on(DeviceKey::HOST); // host tier: dropping releases at once
    let (_, _, mechanism) = register(&registry, ledger.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(request(64)).unwrap();
    ledger.panic_on_release.store(true, Ordering::SeqCst);
    let collector = Collector::default();
    let traced = collector.install();
    while_unwinding(move || drop(block));
    drop(traced);
    let events = collector.take();
    assert!(has(&events, Level::ERROR, "a release panicked while the thread was unwinding"), "{events:?}");
    let quarantined = panicked_quarantine(&registry, &mechanism);
    assert_eq!(quarantined.len(), 1);
    assert!(quarantined[0].1.contains("panicked"), "{quarantined:?}");
    ledger.panic_on_release.store(false, Ordering::SeqCst);
    assert_eq!(registry.retry_quarantined(&mechanism).unwrap().released, 1);
    assert_eq!(ledger.live(), 0);
}

/// An explicit release from a destructor during unwinding: the panicking release is
/// reported as a quarantine instead of re-raised.
#[test]
fn an_explicit_release_panicking_during_unwinding_reports_a_quarantine() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::on(GPU0);
    let (_, _, mechanism) = register(&registry, ledger.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(request(64)).unwrap();
    ledger.panic_on_release.store(true, Ordering::SeqCst);
    let report = while_unwinding(move || binding.release(block).map_err(|rejected| rejected.reason));
    assert_eq!(report, Ok(ReleaseSummary::Quarantined { unmapped_bytes: 0, residual_bytes: 64 }));
    assert_eq!(panicked_quarantine(&registry, &mechanism).len(), 1);
}

/// A queue whose `enqueue` panics, reached from a drop during unwinding.
struct ExplodingQueue;

impl DeferredReleaseQueue for ExplodingQueue {
    fn device(&self) -> DeviceKey {
        GPU0
    }
    fn enqueue(&self, _release: PreparedRelease) -> Result<(), QueueRefusal> {
        panic!("queue exploded")
    }
}

#[test]
fn a_deferring_drop_whose_queue_panics_during_unwinding_quarantines_without_aborting() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::on(GPU0);
    let options = MechanismOptions::default().with_drop_policy(Some(DropPolicy::Defer(Arc::new(ExplodingQueue))));
    let (_, _, mechanism) = register_with(&registry, ledger.clone(), options);
    let binding = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(request(64)).unwrap();
    let collector = Collector::default();
    let traced = collector.install();
    while_unwinding(move || drop(block));
    drop(traced);
    let events = collector.take();
    assert!(has(&events, Level::ERROR, "a drop-time release panicked while the thread was unwinding"), "{events:?}");
    let quarantined = panicked_quarantine(&registry, &mechanism);
    assert_eq!(quarantined.len(), 1, "{quarantined:?}");
    assert_eq!(ledger.released(), 0);
}

/// The cold-path calls that re-raise a callback's panic (a retried release, a
/// `forget_lost`) do not re-raise it from a destructor during unwinding either.
#[test]
fn retry_and_termination_with_panicking_callbacks_during_unwinding_do_not_abort() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::on(GPU0);
    let (context, _, mechanism) = register(&registry, ledger.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    drop(binding.allocate(request(64)).unwrap()); // device tier: quarantined on drop
    ledger.panic_on_release.store(true, Ordering::SeqCst);
    let retried = {
        let registry = registry.clone();
        while_unwinding(move || registry.retry_quarantined(&mechanism))
    };
    assert_eq!(retried.map(|r| (r.released, r.still_quarantined)), Ok((0, 1)));
    let quarantined = panicked_quarantine(&registry, &mechanism);
    assert!(quarantined[0].1.contains("panicked"), "{quarantined:?}");

    /// Panics in `forget_lost`.
    struct Forgetful;
    impl DeviceAllocator for Forgetful {
        fn device(&self) -> DeviceKey {
            GPU0
        }
        fn name(&self) -> &str {
            "forgetful"
        }
        fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
            let address = DeviceAddress::new(0x1000_0000).unwrap();
            Ok(RawAllocation::new(address, request.bytes(), request.align(), GPU0, 0))
        }
        fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
            ReleaseOutcome::complete(allocation.bytes())
        }
        fn forget_lost(&self, _: Vec<RawAllocation>) {
            panic!("forget_lost exploded")
        }
    }
    let forgetful = registry
        .register_allocator(&context, &registry.snapshot(&mechanism).unwrap().authority, Arc::new(Forgetful))
        .unwrap();
    let kept = registry.bind_registered(&forgetful).unwrap().allocate(request(64)).unwrap();
    registry.invalidate_device(GPU0, "reset");
    let terminated = {
        let registry = registry.clone();
        while_unwinding(move || registry.confirm_context_terminated(&context).map(|r| r.lost_allocations))
    };
    assert_eq!(terminated, Ok(1));
    assert_eq!(registry.snapshot(&forgetful).unwrap().live_allocations, 0);
    drop(kept);
}

// ---------------------------------------------------------------------------------
// A `Complete` that claims more unmapped bytes than the block
// ---------------------------------------------------------------------------------

/// An allocator answering `Complete` with more unmapped bytes than the block holds is
/// dishonest: the registry reports the block's size instead, traces an error and
/// counts the outcome, on the explicit, deferred and retried release paths alike.
#[test]
fn a_complete_release_claiming_more_than_the_block_is_corrected_and_counted() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::on(GPU0);
    let (_, _, mechanism) = register(&registry, ledger.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let dishonest = |registry: &BindingRegistry| registry.snapshot(&mechanism).unwrap().dishonest_outcomes;

    // Honest claims (the block's size, or nothing) are taken as they are.
    ledger.complete_claims.store(PAGE, Ordering::SeqCst);
    let report = binding.release(binding.allocate(request(PAGE)).unwrap()).unwrap();
    assert_eq!((report, dishonest(&registry)), (ReleaseSummary::Complete { unmapped_bytes: PAGE }, 0));

    ledger.complete_claims.store(1 << 40, Ordering::SeqCst);
    let collector = Collector::default();
    let traced = collector.install();
    let report = binding.release(binding.allocate(request(PAGE)).unwrap()).unwrap();
    drop(traced);
    assert_eq!(report, ReleaseSummary::Complete { unmapped_bytes: PAGE }, "the claim was not checked");
    assert_eq!(dishonest(&registry), 1);
    assert!(has(&collector.take(), Level::ERROR, "unmapping more than the block"));

    let queue = HeldQueue::new(GPU0, 1);
    binding.release_deferred(binding.allocate(request(PAGE)).unwrap(), &queue).unwrap();
    assert_eq!(queue.run_all().len(), 1);
    assert_eq!(dishonest(&registry), 2);

    drop(binding.allocate(request(PAGE)).unwrap()); // device tier: quarantined on drop
    assert_eq!(registry.retry_quarantined(&mechanism).unwrap().released, 1);
    assert_eq!(dishonest(&registry), 3);
    assert_eq!((ledger.released(), ledger.live()), (4, 0));
    assert_eq!(counts(&registry, &mechanism), (0, 0, 0));
}

// ---------------------------------------------------------------------------------
// The trust boundary: `register_trusted_composite`
// ---------------------------------------------------------------------------------

/// A composite that allocates through one object and hands out the virtual backing of
/// another, separately allocated one (as a wrapper routing to inner objects does).
struct SplitComposite {
    allocation: common::Caps,
    backing: Arc<common::Caps>,
    /// When false, it hands out its own (inline) allocation object's capability.
    split: AtomicBool,
}

impl SplitComposite {
    fn new(split: bool) -> Arc<SplitComposite> {
        Arc::new(SplitComposite {
            allocation: common::Caps::new(GPU0),
            backing: Arc::new(common::Caps::new(GPU0)),
            split: AtomicBool::new(split),
        })
    }
}

impl DeviceAllocator for SplitComposite {
    fn device(&self) -> DeviceKey {
        GPU0
    }
    fn name(&self) -> &str {
        "split"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.allocation.allocate(request)
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.allocation.release(allocation)
    }
    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        if self.split.load(Ordering::SeqCst) { Some(&*self.backing) } else { Some(&self.allocation) }
    }
}

/// The safe path accepts only capabilities that are part of the allocator's own value
/// (the allocator or one of its fields), which its own contract covers; a capability
/// object reached through a pointer to another object is a composite, which only
/// `register_trusted_composite` accepts, on the caller's word, and the snapshot says so.
#[test]
fn only_the_trusted_path_registers_a_composite_whose_capabilities_live_in_another_object() {
    let registry = BindingRegistry::new();
    let context = registry.register_provider_context(GPU0, Arc::new(())).unwrap();
    let authority = registry.register_authority(GPU0, Arc::new(())).unwrap();
    let composite = SplitComposite::new(true);
    let refused = registry.register_allocator(&context, &authority, composite.clone());
    match refused {
        Err(RegistryError::SplitComposite { ref allocator, capability }) => {
            assert_eq!((allocator.as_str(), capability), ("split", "virtual backing"));
            let message = refused.unwrap_err().to_string();
            assert!(message.contains("register_trusted_composite"), "{message}");
        }
        other => panic!("the safe path accepted a split composite: {other:?}"),
    }
    assert!(registry.snapshots().mechanisms.is_empty(), "a refused registration published something");
    assert_eq!(registry.selected(GPU0), None);

    // The same allocator through the trust boundary: registered, marked, and usable.
    // SAFETY: the composite allocates and releases through `allocation` and commits
    // through `backing`, two bookkeeping allocators with no memory behind them; no
    // host memory is ever dereferenced.
    let trusted = unsafe {
        registry.register_trusted_composite(&context, &authority, composite.clone(), MechanismOptions::default())
    }
    .unwrap();
    let plain = registry.register_allocator(&context, &authority, SplitComposite::new(false)).unwrap();
    assert!(registry.snapshot(&trusted).unwrap().trusted_composite);
    assert!(!registry.snapshot(&plain).unwrap().trusted_composite);
    let binding = registry.bind_registered(&trusted).unwrap();
    let block = binding.allocate(request(PAGE)).unwrap();
    let virt = binding.virtual_backing().unwrap();
    assert_eq!(virt.commit(&block, ByteRange::new(0, PAGE)).unwrap(), PAGE);
    assert_eq!(composite.backing.commits.load(Ordering::SeqCst), 1, "the commit went to the composite's backing");
    binding.release(block).unwrap();

    // A safely registered allocator whose capability later moves out of its value is
    // treated as not offering it: the safe path's guarantee holds after registration.
    let shifty = SplitComposite::new(false);
    let mechanism = registry.register_allocator(&context, &authority, shifty.clone()).unwrap();
    let binding = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(request(PAGE)).unwrap();
    let virt = binding.virtual_backing().unwrap();
    assert_eq!(virt.commit(&block, ByteRange::new(0, PAGE)).unwrap(), PAGE);
    shifty.split.store(true, Ordering::SeqCst);
    let refused = virt.commit(&block, ByteRange::new(PAGE, 0));
    assert!(matches!(refused, Err(BoundCapabilityError::Unsupported { .. })), "{refused:?}");
    assert!(matches!(binding.virtual_backing(), Err(BoundCapabilityError::Unsupported { .. })));
    assert_eq!(virt.granularity(), 0);
    assert_eq!(shifty.backing.commits.load(Ordering::SeqCst), 0);
    binding.release(block).unwrap();
}

/// The composite check makes no mistake about allocators whose capabilities are the
/// allocator itself, a field of it, or a zero-sized allocator.
#[test]
fn capabilities_inside_the_allocator_value_pass_the_safe_path() {
    /// A zero-sized allocator implementing its own capability.
    struct Tiny;
    impl DeviceAllocator for Tiny {
        fn device(&self) -> DeviceKey {
            GPU0
        }
        fn name(&self) -> &str {
            "tiny"
        }
        fn allocate(&self, _: &AllocationRequest) -> Result<RawAllocation, AllocError> {
            Err(AllocError::Unsupported { allocator: "tiny".into(), device: GPU0, what: "allocation" })
        }
        fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
            ReleaseOutcome::complete(allocation.bytes())
        }
        fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
            Some(self)
        }
    }
    impl SharedMapping for Tiny {
        fn granularity(&self) -> usize {
            PAGE
        }
        fn create_backing(&self, _: usize) -> Result<SharedBacking, CapabilityError> {
            Err(CapabilityError::Unsupported { allocator: "tiny".into(), what: "backings" })
        }
        fn map(
            &self,
            _: &SharedBacking,
            _: &RawAllocation,
            _: SharedPlacement,
            _: MappingAccess,
        ) -> Result<(), CapabilityError> {
            Ok(())
        }
        fn unmap(&self, _: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
            Ok(range.len())
        }
    }
    /// Its shared mapping is a separate zero-sized static: a composite.
    struct TinyElsewhere;
    static ELSEWHERE: Tiny = Tiny;
    impl DeviceAllocator for TinyElsewhere {
        fn device(&self) -> DeviceKey {
            GPU0
        }
        fn name(&self) -> &str {
            "tiny-elsewhere"
        }
        fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
            Tiny.allocate(request)
        }
        fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
            Tiny.release(allocation)
        }
        fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
            Some(&ELSEWHERE)
        }
    }
    let registry = BindingRegistry::new();
    let context = registry.register_provider_context(GPU0, Arc::new(())).unwrap();
    let authority = registry.register_authority(GPU0, Arc::new(())).unwrap();
    let wrapped = Arc::new(memory_testkit::RecordingAllocator::new(common::Caps::new(GPU0)));
    for allocator in [Arc::new(Tiny) as Arc<dyn DeviceAllocator>, Arc::new(common::Caps::new(GPU0)), wrapped] {
        let name = allocator.name().to_owned();
        let mechanism = registry.register_allocator(&context, &authority, allocator).unwrap();
        let binding = registry.bind_registered(&mechanism).unwrap();
        assert!(binding.shared_mapping().is_ok(), "{name}");
    }
    let refused = registry.register_allocator(&context, &authority, Arc::new(TinyElsewhere));
    assert!(matches!(refused, Err(RegistryError::SplitComposite { capability: "shared mapping", .. })), "{refused:?}");
}

/// An unfit block the allocator will not take back (it refuses, or panics) is memory
/// the allocator holds and nobody can name: it counts as live, so the mechanism is not
/// removed over it, and termination hands it to `forget_lost`.
#[test]
fn an_unfit_block_the_allocator_will_not_take_back_counts_as_live_until_forget_lost() {
    for panics in [false, true] {
        let registry = BindingRegistry::new();
        let ledger = Ledger::on(GPU0);
        let (context, _, mechanism) = register(&registry, ledger.clone());
        let binding = registry.bind_registered(&mechanism).unwrap();
        ledger.short_blocks.store(true, Ordering::SeqCst);
        if panics {
            ledger.panic_on_release.store(true, Ordering::SeqCst);
            let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| binding.allocate(request(PAGE))));
            assert!(unwound.is_err(), "the allocator's panic propagates out of allocate");
        } else {
            ledger.refuse_releases.store(true, Ordering::SeqCst);
            let unfit = binding.allocate(request(PAGE));
            assert!(matches!(unfit, Err(AllocateError::InvalidBlock { .. })), "{unfit:?}");
        }
        ledger.short_blocks.store(false, Ordering::SeqCst);
        ledger.panic_on_release.store(false, Ordering::SeqCst);
        ledger.refuse_releases.store(false, Ordering::SeqCst);
        assert_eq!(ledger.live(), 1, "panics {panics}: the allocator still holds the block");
        assert_eq!(counts(&registry, &mechanism), (1, 0, 0), "panics {panics}: the kept block counts as live");
        registry.retire(&mechanism).unwrap();
        assert!(registry.remove(&mechanism).is_err(), "panics {panics}: removed over a block the allocator holds");
        drop(binding);
        registry.invalidate_device(GPU0, "reset");
        registry.confirm_context_terminated(&context).unwrap();
        assert_eq!(ledger.forgotten().len(), 1, "panics {panics}: termination hands the block to forget_lost");
        assert_eq!(ledger.live(), 0);
        registry.remove(&mechanism).unwrap();
    }
}
