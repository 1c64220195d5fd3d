//! Adversarial scenarios from the registry's contract that the other suites do not
//! drive: callbacks that re-enter the registry (allocate inside allocate, terminate the
//! context from inside a release, re-enter termination from `forget_lost`), a release
//! or capability call in flight on another thread while the device is lost and the
//! context is confirmed, device loss racing releases on other threads, and bindings
//! of a retired mechanism after the selection moved on.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use memory_api::{
    AllocError, AllocationRequest, ByteRange, CapabilityError, DeviceAddress, DeviceAllocator, DeviceKey,
    ProviderContextIdentity, RawAllocation, ReleaseOutcome, ReleaseSummary, VirtualBacking,
};
use memory_binding::{
    AllocateError, BindError, BindingRegistry, BoundAllocation, BoundCapabilityError, DropPolicy, HandleError,
    MechanismOptions, MechanismState, MemoryBinding, RegistryError,
};
use memory_testkit::within;

const GPU0: DeviceKey = DeviceKey::device(0);
const PAGE: usize = 4096;

type Hook = Arc<dyn Fn(&RawAllocation) + Send + Sync>;

/// Hands out addresses from a counter and keeps exact books of every block: live,
/// released (and how often a release named a block it did not hold), forgotten. Hooks
/// run inside `allocate` (after the block is made) and `release` (before it is booked),
/// and a commit can be held on a channel.
#[derive(Default)]
struct Ledger {
    next: AtomicU64,
    live: Mutex<BTreeMap<u64, usize>>,
    released: AtomicUsize,
    unknown_releases: AtomicUsize,
    forgotten: Mutex<Vec<u64>>,
    forget_calls: AtomicUsize,
    /// Set by the test once `confirm_context_terminated` returned `Ok`: any callback
    /// after that is a defect.
    terminated: AtomicBool,
    late_callbacks: AtomicUsize,
    on_allocate: Mutex<Option<Hook>>,
    on_release: Mutex<Option<Hook>>,
    on_forget: Mutex<Option<Arc<dyn Fn() + Send + Sync>>>,
    commit_gate: Mutex<Option<mpsc::Receiver<()>>>,
    commits_entered: AtomicUsize,
    commits: AtomicUsize,
}

impl Ledger {
    fn new() -> Arc<Ledger> {
        Arc::new(Ledger { next: AtomicU64::new(1 << 32), ..Ledger::default() })
    }

    fn live(&self) -> usize {
        self.live.lock().unwrap().len()
    }

    fn late(&self) {
        if self.terminated.load(Ordering::SeqCst) {
            self.late_callbacks.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl DeviceAllocator for Ledger {
    fn device(&self) -> DeviceKey {
        GPU0
    }
    fn name(&self) -> &str {
        "ledger"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.late();
        let span = request.bytes().max(1).next_multiple_of(PAGE) as u64;
        let address = self.next.fetch_add(span, Ordering::SeqCst);
        self.live.lock().unwrap().insert(address, request.bytes());
        let block = RawAllocation::new(DeviceAddress::new(address).unwrap(), request.bytes(), request.align(), GPU0, 7);
        let hook = self.on_allocate.lock().unwrap().clone();
        if let Some(hook) = hook {
            hook(&block);
        }
        Ok(block)
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.late();
        let hook = self.on_release.lock().unwrap().clone();
        if let Some(hook) = hook {
            hook(&allocation);
        }
        if self.live.lock().unwrap().remove(&allocation.address().get()).is_none() {
            self.unknown_releases.fetch_add(1, Ordering::SeqCst);
        }
        self.released.fetch_add(1, Ordering::SeqCst);
        ReleaseOutcome::complete(allocation.bytes())
    }
    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        Some(self)
    }
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        self.forget_calls.fetch_add(1, Ordering::SeqCst);
        {
            let mut live = self.live.lock().unwrap();
            let mut forgotten = self.forgotten.lock().unwrap();
            for block in lost {
                if live.remove(&block.address().get()).is_none() {
                    self.unknown_releases.fetch_add(1, Ordering::SeqCst);
                }
                forgotten.push(block.address().get());
            }
        }
        let hook = self.on_forget.lock().unwrap().clone();
        if let Some(hook) = hook {
            hook();
        }
    }
}

impl VirtualBacking for Ledger {
    fn granularity(&self) -> usize {
        PAGE
    }
    fn commit(&self, _allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.late();
        self.commits_entered.fetch_add(1, Ordering::SeqCst);
        let gate = self.commit_gate.lock().unwrap().take();
        if let Some(gate) = gate {
            gate.recv_timeout(Duration::from_secs(30)).unwrap();
        }
        self.commits.fetch_add(1, Ordering::SeqCst);
        Ok(range.len())
    }
    fn decommit(&self, _allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.late();
        Ok(range.len())
    }
    fn committed_bytes(&self, _allocation: &RawAllocation) -> Result<usize, CapabilityError> {
        Ok(0)
    }
}

fn request(bytes: usize) -> AllocationRequest {
    AllocationRequest::new(bytes, 64).unwrap()
}

fn register(
    registry: &BindingRegistry,
    ledger: &Arc<Ledger>,
    policy: DropPolicy,
) -> (ProviderContextIdentity, memory_api::MechanismIdentity) {
    let context = registry.register_provider_context(GPU0, Arc::new("context")).unwrap();
    let authority = registry.register_authority(GPU0, Arc::new("authority")).unwrap();
    let options = MechanismOptions::default().with_drop_policy(policy);
    let allocator: Arc<dyn DeviceAllocator> = ledger.clone();
    let mechanism = registry.register_allocator_with(&context, &authority, allocator, options).unwrap();
    (context, mechanism)
}

fn not_quiescent(result: Result<memory_binding::TerminationReport, RegistryError>) -> (usize, usize) {
    match result {
        Err(RegistryError::ContextNotQuiescent { in_flight, holds, .. }) => (in_flight, holds),
        other => panic!("expected ContextNotQuiescent, got {other:?}"),
    }
}

#[test]
fn a_release_blocked_on_another_thread_holds_termination_until_it_returns() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::new();
    let (context, mechanism) = register(&registry, &ledger, DropPolicy::Quarantine);
    let binding = registry.bind(GPU0).unwrap();
    let released = binding.allocate(request(PAGE)).unwrap();
    let kept = binding.allocate(request(2 * PAGE)).unwrap();
    let kept_address = kept.address().get();

    let (entered_tx, entered_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = Mutex::new(go_rx);
    *ledger.on_release.lock().unwrap() = Some(Arc::new(move |_| {
        entered_tx.send(()).unwrap();
        go_rx.lock().unwrap().recv_timeout(Duration::from_secs(30)).unwrap();
    }));

    std::thread::scope(|s| {
        let worker = s.spawn(|| binding.release(released));
        entered_rx.recv_timeout(Duration::from_secs(30)).unwrap();
        // The release is inside the allocator: loss never waits for it...
        let report = within("invalidate_device during a release", {
            let registry = registry.clone();
            move || registry.invalidate_device(GPU0, "xid 79")
        });
        assert_eq!((report.mechanisms, report.contexts), (1, 1));
        // ...and termination is refused while it runs, every time it is asked.
        for _ in 0..3 {
            assert_eq!(not_quiescent(registry.confirm_context_terminated(&context)), (1, 0));
        }
        assert!(registry.wait_terminated(&context, Duration::from_millis(20)).is_err());
        assert_eq!(ledger.forget_calls.load(Ordering::SeqCst), 0, "forget_lost ran under a release in flight");
        go_tx.send(()).unwrap();
        // The release that was admitted before the loss completes.
        let summary = worker.join().unwrap().expect("an admitted release completes");
        assert_eq!(summary, ReleaseSummary::Complete { unmapped_bytes: PAGE });
    });

    let report = registry.wait_terminated(&context, Duration::from_secs(10)).unwrap();
    ledger.terminated.store(true, Ordering::SeqCst);
    // Only the block that was never released is handed to forget_lost, once.
    assert_eq!(report.lost_allocations, 1);
    assert_eq!(*ledger.forgotten.lock().unwrap(), vec![kept_address]);
    assert_eq!(ledger.released.load(Ordering::SeqCst), 1);
    assert_eq!(ledger.unknown_releases.load(Ordering::SeqCst), 0);
    assert_eq!(ledger.live(), 0);
    // The kept handle is stale now, and dropping or releasing it calls nothing.
    let rejected = binding.release(kept).unwrap_err();
    assert!(matches!(rejected.reason, HandleError::StaleAllocation), "{}", rejected.reason);
    drop(rejected);
    assert_eq!(ledger.late_callbacks.load(Ordering::SeqCst), 0);
    assert_eq!(registry.snapshot(&mechanism).unwrap().state, MechanismState::Terminated);
}

#[test]
fn a_commit_blocked_on_another_thread_holds_termination_until_it_returns() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::new();
    let (context, _) = register(&registry, &ledger, DropPolicy::Quarantine);
    let binding = registry.bind(GPU0).unwrap();
    let virt = binding.virtual_backing().unwrap();
    let block = binding.allocate(request(2 * PAGE)).unwrap();
    let (go_tx, go_rx) = mpsc::channel();
    *ledger.commit_gate.lock().unwrap() = Some(go_rx);

    std::thread::scope(|s| {
        let worker = s.spawn(|| virt.commit(&block, ByteRange::new(0, PAGE)));
        while ledger.commits_entered.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        registry.invalidate_device(GPU0, "lost during a commit");
        assert_eq!(not_quiescent(registry.confirm_context_terminated(&context)), (1, 0));
        assert_eq!(ledger.forget_calls.load(Ordering::SeqCst), 0);
        go_tx.send(()).unwrap();
        assert_eq!(worker.join().unwrap().unwrap(), PAGE);
    });
    // After loss the capability refuses without calling.
    let commits = ledger.commits_entered.load(Ordering::SeqCst);
    assert!(matches!(virt.commit(&block, ByteRange::new(0, PAGE)), Err(BoundCapabilityError::Handle(_))));
    assert_eq!(ledger.commits_entered.load(Ordering::SeqCst), commits, "a capability ran on a lost device");
    let report = registry.wait_terminated(&context, Duration::from_secs(10)).unwrap();
    assert_eq!(report.lost_allocations, 1);
    drop(block);
    assert_eq!(ledger.live(), 0);
}

#[test]
fn a_release_callback_that_terminates_its_own_context_is_refused_as_not_quiescent() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::new();
    let (context, _) = register(&registry, &ledger, DropPolicy::Quarantine);
    let binding = registry.bind(GPU0).unwrap();
    let released = binding.allocate(request(PAGE)).unwrap();
    let kept = binding.allocate(request(PAGE)).unwrap();
    let kept_address = kept.address().get();

    let inside: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = inside.clone();
    let reentrant = registry.clone();
    *ledger.on_release.lock().unwrap() = Some(Arc::new(move |_| {
        reentrant.invalidate_device(GPU0, "lost from inside a release");
        let answer = reentrant.confirm_context_terminated(&context);
        seen.lock().unwrap().push(format!("{answer:?}"));
    }));
    let summary = within("a release that terminates its own context", {
        let binding = binding.clone();
        move || binding.release(released).map_err(|r| r.reason.to_string())
    })
    .unwrap();
    assert_eq!(summary, ReleaseSummary::Complete { unmapped_bytes: PAGE });
    let inside = inside.lock().unwrap().clone();
    assert_eq!(inside.len(), 1);
    assert!(inside[0].contains("ContextNotQuiescent"), "termination inside a release: {}", inside[0]);
    *ledger.on_release.lock().unwrap() = None;

    let report = registry.confirm_context_terminated(&context).unwrap();
    assert_eq!(report.lost_allocations, 1);
    assert_eq!(*ledger.forgotten.lock().unwrap(), vec![kept_address]);
    assert_eq!(ledger.unknown_releases.load(Ordering::SeqCst), 0);
    drop(kept);
    assert_eq!(ledger.live(), 0);
}

#[test]
fn an_allocate_that_allocates_and_releases_through_its_own_binding_keeps_exact_books() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::new();
    let (context, mechanism) = register(&registry, &ledger, DropPolicy::Release);
    let binding = registry.bind(GPU0).unwrap();
    let cell: Arc<Mutex<Option<MemoryBinding>>> = Arc::new(Mutex::new(Some(binding.clone())));
    let nested: Arc<Mutex<Vec<BoundAllocation>>> = Arc::default();
    let depth = Arc::new(AtomicUsize::new(0));
    {
        let (cell, nested, depth, registry) = (cell.clone(), nested.clone(), depth.clone(), registry.clone());
        *ledger.on_allocate.lock().unwrap() = Some(Arc::new(move |_| {
            if depth.fetch_add(1, Ordering::SeqCst) == 0 {
                let binding = cell.lock().unwrap().clone().unwrap();
                // A nested allocate and release on the same thread and pin...
                let inner = binding.allocate(request(PAGE)).unwrap();
                binding.release(inner).unwrap();
                // ...and one kept past the outer call.
                nested.lock().unwrap().push(binding.allocate(request(PAGE)).unwrap());
                // The outer allocation is in flight: removal and termination must see it.
                let in_flight = registry.snapshot(&mechanism).unwrap().in_flight;
                assert!(in_flight >= 1, "the outer allocate is not counted in flight ({in_flight})");
                assert!(registry.remove(&mechanism).is_err());
            }
            depth.fetch_sub(1, Ordering::SeqCst);
        }));
    }
    let outer = within("a re-entrant allocate", {
        let binding = binding.clone();
        move || binding.allocate(request(3 * PAGE)).map_err(|e| e.to_string())
    })
    .unwrap();
    *ledger.on_allocate.lock().unwrap() = None;
    cell.lock().unwrap().take();
    let snapshot = registry.snapshot(&mechanism).unwrap();
    assert_eq!((snapshot.live_allocations, snapshot.in_flight), (2, 0));
    assert_eq!(snapshot.live_bytes, 4 * PAGE);
    let inner = nested.lock().unwrap().pop().unwrap();
    assert_ne!(inner.identity(), outer.identity());
    binding.release(inner).unwrap();
    binding.release(outer).unwrap();
    assert_eq!(ledger.live(), 0);
    assert_eq!(ledger.unknown_releases.load(Ordering::SeqCst), 0);
    registry.invalidate_device(GPU0, "done");
    let report = registry.confirm_context_terminated(&context).unwrap();
    assert_eq!(report.lost_allocations, 0);
}

#[test]
fn forget_lost_that_re_enters_termination_removal_and_snapshots_does_not_deadlock() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::new();
    let (context, mechanism) = register(&registry, &ledger, DropPolicy::Quarantine);
    let binding = registry.bind(GPU0).unwrap();
    let block = binding.allocate(request(PAGE)).unwrap();
    let answers: Arc<Mutex<Vec<String>>> = Arc::default();
    {
        let (registry, answers) = (registry.clone(), answers.clone());
        *ledger.on_forget.lock().unwrap() = Some(Arc::new(move || {
            let again = registry.confirm_context_terminated(&context);
            let snapshots = registry.snapshots();
            let removed = registry.remove(&mechanism);
            answers.lock().unwrap().push(format!("{again:?} | {} | {removed:?}", snapshots.mechanisms.len()));
        }));
    }
    registry.invalidate_device(GPU0, "lost");
    let report = within("termination with a re-entrant forget_lost", {
        let registry = registry.clone();
        move || registry.confirm_context_terminated(&context).map_err(|e| e.to_string())
    })
    .unwrap();
    assert_eq!(report.lost_allocations, 1);
    let answers = answers.lock().unwrap().clone();
    assert_eq!(answers.len(), 1);
    assert!(answers[0].contains("already_terminated: true"), "{}", answers[0]);
    assert_eq!(ledger.forget_calls.load(Ordering::SeqCst), 1, "forget_lost was called again from inside itself");
    assert_eq!(ledger.live(), 0);
    *ledger.on_forget.lock().unwrap() = None; // the hook holds the registry
    drop(block);
    drop(binding);
    // Whatever the nested remove said, a second one leaves the registry consistent.
    let _ = registry.remove(&mechanism);
    assert!(registry.snapshot(&mechanism).is_err());
}

#[test]
fn device_loss_racing_releases_on_other_threads_accounts_for_every_block_exactly_once() {
    for round in 0..if cfg!(miri) { 2 } else { 40 } {
        let registry = BindingRegistry::new();
        let ledger = Ledger::new();
        let policy = if round % 2 == 0 { DropPolicy::Release } else { DropPolicy::Quarantine };
        let (context, mechanism) = register(&registry, &ledger, policy);
        let binding = registry.bind(GPU0).unwrap();
        const N: usize = 64;
        let blocks: Vec<BoundAllocation> = (0..N).map(|_| binding.allocate(request(PAGE)).unwrap()).collect();
        let (first, second): (Vec<_>, Vec<_>) = blocks.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
        let tally = |outcomes: Vec<Result<ReleaseSummary, HandleError>>| {
            let mut done = 0;
            for outcome in outcomes {
                match outcome {
                    Ok(ReleaseSummary::Complete { .. }) => done += 1,
                    Ok(other) => panic!("unexpected summary {other:?}"),
                    Err(HandleError::DeviceLost { device, .. }) => assert_eq!(device, GPU0),
                    Err(other) => panic!("a release racing loss got {other}"),
                }
            }
            done
        };
        let completed = std::thread::scope(|s| {
            let workers: Vec<_> = [first, second]
                .into_iter()
                .map(|half| {
                    let binding = &binding;
                    s.spawn(move || {
                        half.into_iter()
                            .map(|(_, block)| match binding.release(block) {
                                Ok(summary) => Ok(summary),
                                Err(rejected) => {
                                    let (handle, reason) = rejected.into_parts();
                                    // Handed back as it was: still valid, still refused.
                                    assert!(handle.is_valid() || matches!(reason, HandleError::DeviceLost { .. }));
                                    drop(handle);
                                    Err(reason)
                                }
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            std::thread::yield_now();
            registry.invalidate_device(GPU0, "racing loss");
            workers.into_iter().map(|w| tally(w.join().unwrap())).sum::<usize>()
        });
        let report = registry.wait_terminated(&context, Duration::from_secs(10)).unwrap();
        ledger.terminated.store(true, Ordering::SeqCst);
        assert_eq!(ledger.released.load(Ordering::SeqCst), completed, "round {round}");
        assert_eq!(report.lost_allocations, N - completed, "round {round}");
        assert_eq!(ledger.forgotten.lock().unwrap().len(), N - completed, "round {round}");
        assert_eq!(ledger.unknown_releases.load(Ordering::SeqCst), 0, "round {round}: a block went out twice");
        assert_eq!(ledger.live(), 0, "round {round}");
        let snapshot = registry.snapshot(&mechanism).unwrap();
        assert_eq!((snapshot.live_allocations, snapshot.in_flight), (0, 0), "round {round}");
        drop(binding);
        assert_eq!(ledger.late_callbacks.load(Ordering::SeqCst), 0);
    }
}

#[test]
fn a_binding_of_a_retired_mechanism_after_a_switch_refuses_new_work_and_releases_through_its_own_allocator() {
    let registry = BindingRegistry::new();
    let first = Ledger::new();
    let second = Ledger::new();
    let (_, m1) = register(&registry, &first, DropPolicy::Release);
    let (_, m2) = register(&registry, &second, DropPolicy::Release);
    let old = registry.bind(GPU0).unwrap();
    assert_eq!(old.identity().mechanism(), m1);
    let old_block = old.allocate(request(PAGE)).unwrap();
    let old_kept = old.allocate(request(PAGE)).unwrap();
    let old_virt = old.virtual_backing().unwrap();

    registry.retire(&m1).unwrap();
    // A retired mechanism cannot be selected again.
    assert!(matches!(registry.select(&m1), Err(RegistryError::InvalidState { .. })));
    registry.select(&m2).unwrap();
    let new = registry.bind(GPU0).unwrap();
    assert_eq!(new.identity().mechanism(), m2);
    assert!(matches!(registry.bind_registered(&m1), Err(BindError::Inactive { .. })));

    let allocations = first.next.load(Ordering::SeqCst);
    let refused = old.allocate(request(PAGE)).unwrap_err();
    assert!(matches!(refused, AllocateError::Inactive { state: MechanismState::Retired, .. }), "{refused}");
    let text = refused.to_string();
    assert!(text.contains(&m1.to_string()) && text.contains("retired"), "{text}");
    assert_eq!(first.next.load(Ordering::SeqCst), allocations, "a retired mechanism's allocator was called");

    // The new binding does not take the old mechanism's handle, and hands it back.
    let rejected = new.release(old_block).unwrap_err();
    assert!(matches!(rejected.reason, HandleError::BindingMismatch { .. }), "{}", rejected.reason);
    assert_eq!(second.released.load(Ordering::SeqCst) + first.released.load(Ordering::SeqCst), 0);
    let old_block = rejected.handle;
    assert!(old_block.is_valid());
    // Existing work on the retired mechanism still runs, through the first allocator.
    // (commit is new work: refused; decommit is not.)
    let commits = first.commits_entered.load(Ordering::SeqCst);
    assert!(old_virt.commit(&old_kept, ByteRange::new(0, PAGE)).is_err());
    assert_eq!(first.commits_entered.load(Ordering::SeqCst), commits);
    assert_eq!(old_virt.decommit(&old_kept, ByteRange::new(0, PAGE)).unwrap(), PAGE);
    old.release(old_block).unwrap();
    drop(old_kept); // drop policy Release: through `first`
    assert_eq!(first.released.load(Ordering::SeqCst), 2);
    assert_eq!(first.live(), 0);
    assert_eq!(second.released.load(Ordering::SeqCst), 0);
    // And the new binding serves from the second allocator only.
    let block = new.allocate(request(PAGE)).unwrap();
    new.release(block).unwrap();
    assert_eq!((second.released.load(Ordering::SeqCst), first.released.load(Ordering::SeqCst)), (1, 2));
    drop(old_virt);
    drop(old);
    registry.remove(&m1).unwrap();
}

#[test]
fn a_handle_refused_for_a_lost_device_comes_back_unchanged_and_releases_nothing_after_termination() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::new();
    let (context, _) = register(&registry, &ledger, DropPolicy::Release);
    let binding = registry.bind(GPU0).unwrap();
    let mut place = Some(binding.allocate(request(PAGE)).unwrap());
    let identity = place.as_ref().unwrap().identity();
    registry.invalidate_device(GPU0, "lost");
    for _ in 0..2 {
        let error = binding.release_from(&mut place).unwrap_err();
        assert!(matches!(error, HandleError::DeviceLost { .. }), "{error}");
        let text = error.to_string();
        assert!(text.contains("lost") && text.contains("confirm the context terminated"), "{text}");
        assert_eq!(place.as_ref().unwrap().identity(), identity);
    }
    let block = place.take().unwrap();
    let rejected = binding.release(block).unwrap_err();
    assert!(matches!(rejected.reason, HandleError::DeviceLost { .. }));
    let block = rejected.handle;
    assert_eq!(ledger.released.load(Ordering::SeqCst), 0);
    registry.confirm_context_terminated(&context).unwrap();
    ledger.terminated.store(true, Ordering::SeqCst);
    let rejected = binding.release(block).unwrap_err();
    assert!(matches!(rejected.reason, HandleError::StaleAllocation), "{}", rejected.reason);
    drop(rejected);
    assert_eq!(ledger.late_callbacks.load(Ordering::SeqCst), 0);
    assert_eq!(ledger.released.load(Ordering::SeqCst), 0);
    assert_eq!(ledger.forgotten.lock().unwrap().len(), 1);
}

#[test]
fn a_retry_whose_release_loses_the_device_makes_no_further_callback_and_keeps_the_rest_for_forget_lost() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::new();
    let (context, mechanism) = register(&registry, &ledger, DropPolicy::Quarantine);
    let binding = registry.bind(GPU0).unwrap();
    for _ in 0..3 {
        drop(binding.allocate(request(PAGE)).unwrap()); // quarantined by the drop policy
    }
    assert_eq!(registry.snapshot(&mechanism).unwrap().quarantined.len(), 3);
    let losses = Arc::new(AtomicUsize::new(0));
    {
        let (registry, losses) = (registry.clone(), losses.clone());
        *ledger.on_release.lock().unwrap() = Some(Arc::new(move |_| {
            // The first retried release learns the device is gone (an Xid, a reset).
            if losses.fetch_add(1, Ordering::SeqCst) == 0 {
                registry.invalidate_device(GPU0, "lost during a retry");
            }
        }));
    }
    let report = within("a retry that loses the device", {
        let registry = registry.clone();
        move || registry.retry_quarantined(&mechanism).map_err(|e| e.to_string())
    })
    .unwrap();
    assert_eq!(ledger.released.load(Ordering::SeqCst), 1, "the retry kept calling release on a lost device");
    assert_eq!((report.released, report.still_quarantined), (1, 2));
    assert_eq!(registry.snapshot(&mechanism).unwrap().quarantined.len(), 2);
    // The two left are the allocator's to forget at termination, once.
    *ledger.on_release.lock().unwrap() = None; // the hook holds the registry
    let report = registry.confirm_context_terminated(&context).unwrap();
    assert_eq!(report.discharged_quarantine, 2);
    assert_eq!(ledger.forgotten.lock().unwrap().len(), 2);
    assert_eq!(ledger.unknown_releases.load(Ordering::SeqCst), 0);
    assert_eq!(ledger.live(), 0);
}

/// A queue that accepts every release and keeps it, for the test to run, drop or
/// withdraw later.
struct KeepingQueue(Mutex<Vec<memory_api::PreparedRelease>>);

impl memory_api::DeferredReleaseQueue for KeepingQueue {
    fn device(&self) -> DeviceKey {
        GPU0
    }
    fn enqueue(&self, release: memory_api::PreparedRelease) -> Result<(), memory_api::QueueRefusal> {
        self.0.lock().unwrap().push(release);
        Ok(())
    }
}

#[test]
fn a_queue_that_withdraws_an_accepted_release_cannot_hold_termination_or_lose_the_block() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::new();
    let (context, mechanism) = register(&registry, &ledger, DropPolicy::Quarantine);
    let binding = registry.bind(GPU0).unwrap();
    let queue = KeepingQueue(Mutex::new(Vec::new()));
    let block = binding.allocate(request(PAGE)).unwrap();
    let address = block.address().get();
    binding.release_deferred(block, &queue).unwrap();
    assert_eq!(registry.snapshot(&mechanism).unwrap().in_flight, 1);
    // The queue withdraws what it accepted (and keeps the raw block to itself).
    let withdrawn = queue.0.lock().unwrap().pop().unwrap().cancel();
    assert_eq!(withdrawn.address().get(), address);
    // The registry's books settle: nothing in flight, the block kept as abandoned.
    let snapshot = registry.snapshot(&mechanism).unwrap();
    assert_eq!(snapshot.in_flight, 0, "a withdrawn release stays in flight for good");
    assert_eq!(snapshot.quarantined.len(), 1, "the withdrawn block is in neither live nor quarantine");
    assert_eq!(ledger.released.load(Ordering::SeqCst), 0);
    registry.invalidate_device(GPU0, "lost");
    let report = registry.wait_terminated(&context, Duration::from_secs(5)).expect("termination is not held for good");
    assert_eq!(report.discharged_quarantine, 1);
    assert_eq!(*ledger.forgotten.lock().unwrap(), vec![address]);
    assert_eq!(ledger.live(), 0);
}

/// A queue that keeps the first release it is offered and refuses every later one,
/// handing back (withdrawn) the one it kept instead of the one offered.
struct SwappingQueue(Mutex<Option<memory_api::PreparedRelease>>);

impl memory_api::DeferredReleaseQueue for SwappingQueue {
    fn device(&self) -> DeviceKey {
        GPU0
    }
    fn enqueue(&self, release: memory_api::PreparedRelease) -> Result<(), memory_api::QueueRefusal> {
        let mut kept = self.0.lock().unwrap();
        match kept.take() {
            None => {
                *kept = Some(release);
                Ok(())
            }
            Some(earlier) => {
                // The offered one is dropped unrun; the earlier, accepted one comes back.
                drop(release);
                Err(memory_api::QueueRefusal {
                    release: earlier,
                    reason: memory_api::QueueRefusalReason::Full { capacity: 1 },
                })
            }
        }
    }
}

#[test]
fn a_queue_refusing_with_a_release_it_accepted_earlier_settles_both_exactly_once() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::new();
    let (context, mechanism) = register(&registry, &ledger, DropPolicy::Quarantine);
    let binding = registry.bind(GPU0).unwrap();
    let queue = SwappingQueue(Mutex::new(None));
    binding.release_deferred(binding.allocate(request(PAGE)).unwrap(), &queue).unwrap();
    // Refused with the first: the registry counts the offered one as lost by the queue.
    binding.release_deferred(binding.allocate(request(PAGE)).unwrap(), &queue).unwrap();
    let snapshot = registry.snapshot(&mechanism).unwrap();
    assert_eq!((snapshot.live_allocations, snapshot.in_flight), (0, 0), "a release stayed in transit");
    assert_eq!(snapshot.quarantined.len(), 2);
    assert_eq!(ledger.released.load(Ordering::SeqCst), 0);
    registry.invalidate_device(GPU0, "lost");
    let report = registry.wait_terminated(&context, Duration::from_secs(5)).unwrap();
    assert_eq!(report.discharged_quarantine, 2);
    assert_eq!(ledger.forgotten.lock().unwrap().len(), 2);
    assert_eq!(ledger.unknown_releases.load(Ordering::SeqCst), 0);
    assert_eq!(ledger.live(), 0);
}

#[test]
fn after_device_loss_no_capability_query_or_call_reaches_the_allocator() {
    type Rec = memory_testkit::RecordingAllocator<common::Caps>;
    let registry = BindingRegistry::new();
    let allocator: Arc<Rec> = Arc::new(memory_testkit::RecordingAllocator::new(common::Caps::new(GPU0)));
    let (context, _, _) = common::register(&registry, allocator.clone());
    let binding = registry.bind(GPU0).unwrap();
    let virt = binding.virtual_backing().unwrap();
    let shared = binding.shared_mapping().unwrap();
    let backing = shared.create_backing(PAGE).unwrap();
    let block = binding.allocate(request(PAGE)).unwrap();
    assert_eq!((virt.granularity(), shared.granularity()), (PAGE, PAGE));
    registry.invalidate_device(GPU0, "Xid 79");
    for phase in ["after device loss", "after termination"] {
        if phase == "after termination" {
            registry.confirm_context_terminated(&context).unwrap();
        }
        let before = allocator.counts();
        // Discovery and granularity are callbacks too: none may run on a lost device.
        let found = binding.virtual_backing().map(drop);
        assert!(matches!(found, Err(BoundCapabilityError::Handle(_))), "{phase}: virtual_backing gave {found:?}");
        let found = binding.shared_mapping().map(drop);
        assert!(matches!(found, Err(BoundCapabilityError::Handle(_))), "{phase}: shared_mapping gave {found:?}");
        assert_eq!((virt.granularity(), shared.granularity()), (0, 0), "{phase}");
        assert!(matches!(shared.create_backing(PAGE), Err(BoundCapabilityError::Handle(_))), "{phase}");
        let placement = memory_api::SharedPlacement { target: ByteRange::new(0, PAGE), backing_offset: 0 };
        let mapped = shared.map(&backing, &block, placement, memory_api::MappingAccess::ReadWrite);
        assert!(matches!(mapped, Err(BoundCapabilityError::Handle(_))), "{phase}: map gave {mapped:?}");
        assert!(virt.commit(&block, ByteRange::new(0, PAGE)).is_err());
        assert!(virt.decommit(&block, ByteRange::new(0, PAGE)).is_err());
        assert!(virt.committed_bytes(&block).is_err());
        assert!(shared.unmap(&block, ByteRange::new(0, PAGE)).is_err());
        assert_eq!(allocator.counts(), before, "{phase}: a callback reached the allocator of a lost device");
    }
    drop(block);
}

#[test]
fn a_thread_whose_bind_cache_holds_the_old_selection_binds_the_new_one_after_every_switch() {
    let registry = BindingRegistry::new();
    let ledgers: Vec<_> = (0..3).map(|_| Ledger::new()).collect();
    let mechanisms: Vec<_> = ledgers.iter().map(|l| register(&registry, l, DropPolicy::Release).1).collect();
    let (ask_tx, ask_rx) = mpsc::channel::<()>();
    let (answer_tx, answer_rx) = mpsc::channel::<Result<memory_api::MechanismIdentity, String>>();
    let worker = {
        let registry = registry.clone();
        std::thread::spawn(move || {
            while ask_rx.recv().is_ok() {
                // Twice: the second bind is served from this thread's cache.
                let first = registry.bind(GPU0).map(|b| b.identity().mechanism());
                let second = registry.bind(GPU0).map(|b| b.identity().mechanism());
                let answer = match (first, second) {
                    (Ok(a), Ok(b)) if a == b => Ok(a),
                    (a, b) => Err(format!("{a:?} then {b:?}")),
                };
                answer_tx.send(answer).unwrap();
            }
        })
    };
    let ask = || {
        ask_tx.send(()).unwrap();
        answer_rx.recv_timeout(Duration::from_secs(10)).unwrap()
    };
    for round in 0..30 {
        let chosen = mechanisms[round % 2];
        registry.select(&chosen).unwrap();
        assert_eq!(ask(), Ok(chosen), "round {round}: a cached bind served the old selection");
    }
    // Retiring the selected mechanism: the cached thread gets no binding at all.
    let selected = registry.selected(GPU0).unwrap();
    registry.retire(&selected).unwrap();
    let refused = ask().unwrap_err();
    assert!(refused.contains("NoSelection"), "{refused}");
    registry.select(&mechanisms[2]).unwrap();
    assert_eq!(ask(), Ok(mechanisms[2]));
    // And after loss nothing is served from any cache.
    registry.invalidate_device(GPU0, "lost");
    assert!(ask().is_err());
    drop(ask_tx);
    worker.join().unwrap();
}

#[test]
fn an_allocate_that_retires_its_mechanism_and_switches_the_selection_still_hands_out_a_releasable_block() {
    let registry = BindingRegistry::new();
    let first = Ledger::new();
    let second = Ledger::new();
    let (_, m1) = register(&registry, &first, DropPolicy::Release);
    let (_, m2) = register(&registry, &second, DropPolicy::Release);
    let binding = registry.bind(GPU0).unwrap();
    let inside: Arc<Mutex<Vec<String>>> = Arc::default();
    {
        let (registry, inside) = (registry.clone(), inside.clone());
        *first.on_allocate.lock().unwrap() = Some(Arc::new(move |_| {
            registry.retire(&m1).unwrap();
            registry.select(&m2).unwrap();
            // The allocation is in flight: the retired mechanism cannot be removed under it.
            inside.lock().unwrap().push(format!("{:?}", registry.remove(&m1)));
        }));
    }
    let block = within("an allocate that retires its own mechanism", {
        let binding = binding.clone();
        move || binding.allocate(request(PAGE)).map_err(|e| e.to_string())
    })
    .expect("an allocation admitted before the retirement completes");
    *first.on_allocate.lock().unwrap() = None;
    let inside = inside.lock().unwrap().clone();
    assert!(inside[0].contains("NotQuiescent") || inside[0].contains("Err"), "remove under an allocate: {}", inside[0]);
    assert!(registry.snapshot(&m1).is_ok(), "the mechanism was removed under an allocation in flight");
    // New work is refused, the block releases through its own allocator, and only then
    // does the mechanism go.
    assert!(matches!(binding.allocate(request(PAGE)), Err(AllocateError::Inactive { .. })));
    assert!(registry.remove(&m1).is_err(), "removed with a live allocation");
    assert_eq!(registry.bind(GPU0).unwrap().identity().mechanism(), m2);
    binding.release(block).unwrap();
    assert_eq!(first.released.load(Ordering::SeqCst), 1);
    assert_eq!(second.released.load(Ordering::SeqCst), 0);
    assert_eq!(first.live(), 0);
    drop(binding);
    registry.remove(&m1).unwrap();
}

/// A queue on a device of its choosing that runs each release at once.
struct QueueOn(DeviceKey, AtomicUsize);

impl memory_api::DeferredReleaseQueue for QueueOn {
    fn device(&self) -> DeviceKey {
        self.0
    }
    fn enqueue(&self, release: memory_api::PreparedRelease) -> Result<(), memory_api::QueueRefusal> {
        self.1.fetch_add(1, Ordering::SeqCst);
        release.execute();
        Ok(())
    }
}

#[test]
fn a_drop_policy_deferring_to_a_queue_of_another_device_is_refused_at_registration() {
    let registry = BindingRegistry::new();
    let ledger = Ledger::new();
    let other = DeviceKey::device(1);
    let queue = Arc::new(QueueOn(other, AtomicUsize::new(0)));
    let context = registry.register_provider_context(GPU0, Arc::new("context")).unwrap();
    let authority = registry.register_authority(GPU0, Arc::new("authority")).unwrap();
    let options = MechanismOptions::default().with_drop_policy(DropPolicy::Defer(queue.clone()));
    let allocator: Arc<dyn DeviceAllocator> = ledger.clone();
    let refused = registry.register_allocator_with(&context, &authority, allocator.clone(), options).unwrap_err();
    assert!(
        matches!(refused, RegistryError::DeviceMismatch { expected, found, .. } if expected == GPU0 && found == other),
        "{refused:?}"
    );
    let text = refused.to_string();
    assert!(text.contains(&GPU0.to_string()) && text.contains(&other.to_string()) && text.contains("queue"), "{text}");
    assert!(registry.snapshots().mechanisms.is_empty());
    // A queue of the mechanism's own device is taken, and a drop defers to it.
    let own = Arc::new(QueueOn(GPU0, AtomicUsize::new(0)));
    let options = MechanismOptions::default().with_drop_policy(DropPolicy::Defer(own.clone()));
    registry.register_allocator_with(&context, &authority, allocator, options).unwrap();
    let binding = registry.bind(GPU0).unwrap();
    drop(binding.allocate(request(PAGE)).unwrap());
    assert_eq!((own.1.load(Ordering::SeqCst), queue.1.load(Ordering::SeqCst)), (1, 0));
    assert_eq!(ledger.released.load(Ordering::SeqCst), 1);
}

#[test]
fn a_release_callback_that_drops_the_last_binding_and_the_registry_completes_and_lets_go_once() {
    let ledger = Ledger::new();
    let block = {
        let registry = BindingRegistry::new();
        register(&registry, &ledger, DropPolicy::Release);
        let binding = registry.bind(GPU0).unwrap();
        let block = binding.allocate(request(PAGE)).unwrap();
        let kept: Arc<Mutex<Option<(BindingRegistry, MemoryBinding)>>> =
            Arc::new(Mutex::new(Some((registry, binding))));
        let inside = kept.clone();
        *ledger.on_release.lock().unwrap() = Some(Arc::new(move |_| {
            // The last registry and binding go while the release is inside the allocator.
            drop(inside.lock().unwrap().take());
        }));
        (block, kept)
    };
    let (block, kept) = block;
    let summary =
        within("a release that drops the registry", move || block.release().map_err(|r| r.reason.to_string()));
    assert_eq!(summary.unwrap(), ReleaseSummary::Complete { unmapped_bytes: PAGE });
    assert!(kept.lock().unwrap().is_none());
    *ledger.on_release.lock().unwrap() = None;
    assert_eq!(ledger.live(), 0);
    // Nothing else holds the allocator: the registry, its mechanism and the handle let go.
    assert_eq!(Arc::strong_count(&ledger), 1, "the allocator is still held after everything was dropped");
}

/// Quarantines every release with the same block under another tag, and records the
/// tags it is handed back.
struct TagForger {
    next: AtomicU64,
    seen: Mutex<Vec<(&'static str, u64)>>,
    honest: AtomicBool,
}

impl DeviceAllocator for TagForger {
    fn device(&self) -> DeviceKey {
        GPU0
    }
    fn name(&self) -> &str {
        "tag-forger"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let address = self.next.fetch_add(1 << 20, Ordering::SeqCst);
        Ok(RawAllocation::new(DeviceAddress::new(address).unwrap(), request.bytes(), request.align(), GPU0, 42))
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.seen.lock().unwrap().push(("release", allocation.provider_tag()));
        if self.honest.load(Ordering::SeqCst) {
            return ReleaseOutcome::complete(allocation.bytes());
        }
        let forged = RawAllocation::new(
            allocation.address(),
            allocation.bytes(),
            allocation.align(),
            allocation.device(),
            allocation.provider_tag() ^ 0xdead,
        );
        let bytes = forged.bytes();
        ReleaseOutcome::quarantined(forged, 0, bytes, memory_api::ReleaseError::Abandoned)
    }
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        self.seen.lock().unwrap().extend(lost.iter().map(|b| ("forget", b.provider_tag())));
    }
}

#[test]
fn a_quarantine_answered_under_another_tag_keeps_the_tag_the_allocator_first_gave() {
    let registry = BindingRegistry::new();
    let forger =
        Arc::new(TagForger { next: AtomicU64::new(1 << 32), seen: Mutex::default(), honest: AtomicBool::new(false) });
    let context = registry.register_provider_context(GPU0, Arc::new("context")).unwrap();
    let authority = registry.register_authority(GPU0, Arc::new("authority")).unwrap();
    let mechanism = registry.register_allocator(&context, &authority, forger.clone()).unwrap();
    let binding = registry.bind(GPU0).unwrap();
    let first = binding.allocate(request(PAGE)).unwrap();
    let second = binding.allocate(request(PAGE)).unwrap();
    assert!(matches!(binding.release(first).unwrap(), ReleaseSummary::Quarantined { .. }));
    assert!(matches!(binding.release(second).unwrap(), ReleaseSummary::Quarantined { .. }));
    // A retry quarantines again under yet another tag; the next one completes.
    registry.retry_quarantined(&mechanism).unwrap();
    forger.honest.store(true, Ordering::SeqCst);
    let report = registry.retry_quarantined(&mechanism).unwrap();
    assert_eq!(report.released, 2);
    let seen = forger.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 6);
    assert!(seen.iter().all(|&(_, tag)| tag == 42), "the registry handed back a tag it did not record: {seen:?}");
    drop(binding);
    // And termination hands forget_lost the recorded tag too.
    let binding = registry.bind(GPU0).unwrap();
    forger.honest.store(false, Ordering::SeqCst);
    assert!(matches!(
        binding.release(binding.allocate(request(PAGE)).unwrap()).unwrap(),
        ReleaseSummary::Quarantined { .. }
    ));
    registry.invalidate_device(GPU0, "lost");
    registry.confirm_context_terminated(&context).unwrap();
    let seen = forger.seen.lock().unwrap().clone();
    assert_eq!(seen.last(), Some(&("forget", 42)), "{seen:?}");
}

/// Answers every request with a block one byte short (unfit), and refuses to take one
/// back, naming another block in its refusal.
struct ShortAndLying {
    next: AtomicU64,
    forgotten: Mutex<Vec<u64>>,
}

impl DeviceAllocator for ShortAndLying {
    fn device(&self) -> DeviceKey {
        GPU0
    }
    fn name(&self) -> &str {
        "short-and-lying"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let address = self.next.fetch_add(1 << 20, Ordering::SeqCst);
        Ok(RawAllocation::new(DeviceAddress::new(address).unwrap(), request.bytes() - 1, request.align(), GPU0, 1))
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let other = RawAllocation::new(
            DeviceAddress::new(allocation.address().get() + (1 << 40)).unwrap(),
            allocation.bytes() * 2,
            allocation.align(),
            GPU0,
            99,
        );
        ReleaseOutcome::failed(
            other,
            memory_api::ReleaseError::NotOwned { allocator: "liar".into(), device: GPU0, address: 0 },
        )
    }
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        self.forgotten.lock().unwrap().extend(lost.iter().map(|b| b.address().get()));
    }
}

#[test]
fn an_unfit_block_refused_back_under_another_block_is_kept_as_the_block_given() {
    let registry = BindingRegistry::new();
    let liar = Arc::new(ShortAndLying { next: AtomicU64::new(1 << 32), forgotten: Mutex::default() });
    let context = registry.register_provider_context(GPU0, Arc::new("context")).unwrap();
    let authority = registry.register_authority(GPU0, Arc::new("authority")).unwrap();
    let mechanism = registry.register_allocator(&context, &authority, liar.clone()).unwrap();
    let binding = registry.bind(GPU0).unwrap();
    let error = binding.allocate(request(PAGE)).unwrap_err();
    assert!(matches!(error, AllocateError::InvalidBlock { .. }), "{error}");
    let snapshot = registry.snapshot(&mechanism).unwrap();
    assert_eq!((snapshot.live_allocations, snapshot.live_bytes), (1, PAGE - 1), "the block kept is not the one given");
    registry.invalidate_device(GPU0, "lost");
    registry.confirm_context_terminated(&context).unwrap();
    assert_eq!(
        *liar.forgotten.lock().unwrap(),
        vec![1u64 << 32],
        "forget_lost was handed a block the registry never saw"
    );
}

#[test]
fn a_queue_that_runs_drops_or_withdraws_accepted_releases_on_another_thread_settles_each_block_once() {
    for round in 0..if cfg!(miri) { 1 } else { 20 } {
        let registry = BindingRegistry::new();
        let ledger = Ledger::new();
        let (context, mechanism) = register(&registry, &ledger, DropPolicy::Quarantine);
        let binding = registry.bind(GPU0).unwrap();
        let queue = Arc::new(KeepingQueue(Mutex::new(Vec::new())));
        const N: usize = 60;
        let blocks: Vec<_> = (0..N).map(|_| binding.allocate(request(PAGE)).unwrap()).collect();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let runner = s.spawn(|| {
                let mut done = 0usize;
                loop {
                    let next = queue.0.lock().unwrap().pop();
                    let Some(release) = next else {
                        if stop.load(Ordering::SeqCst) {
                            break;
                        }
                        std::thread::yield_now();
                        continue;
                    };
                    match done % 3 {
                        0 => drop(release.execute()),
                        1 => drop(release),          // dropped unrun: abandoned
                        _ => drop(release.cancel()), // withdrawn after it was accepted
                    }
                    done += 1;
                }
            });
            for (i, block) in blocks.into_iter().enumerate() {
                if i == N / 2 {
                    registry.invalidate_device(GPU0, "lost mid-queue");
                }
                if let Err(rejected) = binding.release_deferred(block, &*queue) {
                    assert!(matches!(rejected.reason, HandleError::DeviceLost { .. }), "{}", rejected.reason);
                }
            }
            stop.store(true, Ordering::SeqCst);
            runner.join().unwrap();
        });
        // Everything queued settled: nothing stays in flight, termination goes through.
        registry.wait_terminated(&context, Duration::from_secs(10)).expect("a queued release stayed in flight");
        let snapshot = registry.snapshot(&mechanism).unwrap();
        assert_eq!((snapshot.live_allocations, snapshot.in_flight), (0, 0), "round {round}");
        let released = ledger.released.load(Ordering::SeqCst);
        let forgotten = ledger.forgotten.lock().unwrap().len();
        assert_eq!(ledger.unknown_releases.load(Ordering::SeqCst), 0, "round {round}: a block was settled twice");
        assert_eq!(released + forgotten, N, "round {round}");
        assert_eq!(ledger.live(), 0, "round {round}: a block reached neither release nor forget_lost");
    }
}

/// Answers every request with a block of half the address space (at least the size
/// asked, so it fits), and forgets what it is handed.
struct Enormous(AtomicU64, Mutex<Vec<usize>>);

impl DeviceAllocator for Enormous {
    fn device(&self) -> DeviceKey {
        GPU0
    }
    fn name(&self) -> &str {
        "enormous"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let address = self.0.fetch_add(1 << 20, Ordering::SeqCst);
        let bytes = usize::MAX / 2 + PAGE;
        Ok(RawAllocation::new(DeviceAddress::new(address).unwrap(), bytes, request.align(), GPU0, 0))
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        ReleaseOutcome::complete(allocation.bytes())
    }
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        self.1.lock().unwrap().extend(lost.iter().map(RawAllocation::bytes));
    }
}

#[test]
fn block_sizes_that_sum_past_the_address_space_saturate_the_figures_instead_of_panicking() {
    let registry = BindingRegistry::new();
    let enormous = Arc::new(Enormous(AtomicU64::new(1 << 32), Mutex::default()));
    let context = registry.register_provider_context(GPU0, Arc::new("context")).unwrap();
    let authority = registry.register_authority(GPU0, Arc::new("authority")).unwrap();
    let options = MechanismOptions::default().with_drop_policy(DropPolicy::Quarantine);
    let mechanism = registry.register_allocator_with(&context, &authority, enormous.clone(), options).unwrap();
    let binding = registry.bind(GPU0).unwrap();
    let blocks: Vec<_> = (0..3).map(|_| binding.allocate(request(PAGE)).unwrap()).collect();
    let snapshot = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| registry.snapshot(&mechanism)))
        .expect("a snapshot panicked on the sizes an allocator reported")
        .unwrap();
    assert_eq!((snapshot.live_allocations, snapshot.live_bytes), (3, usize::MAX));
    assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| registry.snapshots())).is_ok());
    registry.invalidate_device(GPU0, "lost");
    let report =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| registry.confirm_context_terminated(&context)))
            .expect("termination panicked on the sizes an allocator reported")
            .unwrap();
    assert_eq!((report.lost_allocations, report.lost_bytes), (3, usize::MAX));
    assert_eq!(enormous.1.lock().unwrap().len(), 3, "forget_lost was not handed every lost block");
    drop(blocks);
}
