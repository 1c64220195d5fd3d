//! Callbacks that lie, re-enter, panic while a thread unwinds, or run while the device
//! is lost (issue 11). Every case here is fast and runs in CI.
//!
//! The rule they check: the registry trusts no answer it did not mint, and runs no
//! callback under a lock or on a lost device.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use common::{HeldQueue, PAGE, register, register_with, request};
use memory_api::{
    AllocError, AllocationRequest, DeferredReleaseQueue, DeviceAddress, DeviceAllocator, DeviceKey, MechanismIdentity,
    PreparedRelease, QueueRefusal, QueueRefusalReason, RawAllocation, ReleaseError, ReleaseOutcome,
};
use memory_binding::{BindingRegistry, DropPolicy, HandleError, MechanismOptions};

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
        if self.live.lock().unwrap().remove(&allocation.address().get()).is_none() {
            self.unknown_releases.fetch_add(1, Ordering::SeqCst);
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
        let registry = BindingRegistry::new().unwrap();
        let ledger = Ledger::on(GPU0);
        let (context, _, mechanism) = register(&registry, ledger.clone());
        let binding = registry.bind_registered(&mechanism).unwrap();
        let queue = ForgingQueue::new(offered, forged);
        let block = binding.allocate(request(PAGE)).unwrap();
        let address = block.address().get();
        queue.address.store(address, Ordering::SeqCst);

        let result = binding.release_deferred(block, &queue);
        assert!(result.is_ok(), "{what}: a release the queue lost has no handle left to give back: {result:?}");
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
        let registry = BindingRegistry::new().unwrap();
        let ledger = Ledger::on(GPU0);
        let queue = Arc::new(ForgingQueue::new(offered, Forged::OtherBlock));
        let options = MechanismOptions { drop_policy: Some(DropPolicy::Defer(queue.clone())) };
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
    let registry = BindingRegistry::new().unwrap();
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
