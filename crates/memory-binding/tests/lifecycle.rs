//! Selection, retirement, device loss, termination, quarantine, drop policy and
//! removal: each semantic of the registry, with callbacks counted.

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use common::{Caps, HeldQueue, PAGE, bind, register, register_with, request};
use memory_api::ReleaseSummary;
use memory_api::{ByteRange, DeviceAllocator, DeviceKey, Identity};
use memory_binding::{
    AllocateError, AllocationState, BindError, BindingRegistry, BoundAllocation, ContextState, DropPolicy, HandleError,
    MechanismOptions, MechanismState, RegistryError, ViewError,
};
use memory_testkit::{Callback, FaultyAllocator, RecordingAllocator};

const GPU0: DeviceKey = DeviceKey::device(0);

#[test]
fn selection_change_affects_only_future_binds() {
    let registry = BindingRegistry::new();
    let first = Arc::new(Caps::new(GPU0));
    let second = Arc::new(Caps::new(GPU0));
    let (_, _, m1) = register(&registry, first.clone());
    let (_, _, m2) = register(&registry, second.clone());
    // The first mechanism registered for a device becomes its selection.
    assert_eq!(registry.selected(GPU0), Some(m1));

    let old = registry.bind(GPU0).unwrap();
    let old_block = old.allocate(request(PAGE)).unwrap();
    let old_virtual = old.virtual_backing().unwrap();
    let queue = HeldQueue::new(GPU0, 4);
    let queued_block = old.allocate(request(PAGE)).unwrap();
    old.release_deferred(queued_block, &queue).unwrap();

    let new_generation = registry.select(&m2).unwrap();
    let new = registry.bind(GPU0).unwrap();
    assert_eq!(new.identity().mechanism(), m2);
    assert_eq!(new.identity().generation(), new_generation);
    assert_ne!(old.identity().generation(), new_generation);
    assert_eq!(old.identity().mechanism(), m1);

    // Old handles keep their original allocator: commit, release and the queued
    // release all reach `first`, none reaches `second`.
    old_virtual.commit(&old_block, ByteRange::new(0, PAGE)).unwrap();
    old.allocate(request(PAGE)).map(|b| old.release(b).unwrap()).unwrap();
    old.release(old_block).unwrap();
    queue.run_all();
    assert_eq!(first.releases.load(Ordering::SeqCst), 3);
    assert_eq!(first.commits.load(Ordering::SeqCst), 1);
    assert_eq!(second.callbacks(), 0);

    let block = new.allocate(request(PAGE)).unwrap();
    new.release(block).unwrap();
    assert_eq!(second.allocates.load(Ordering::SeqCst), 1);
}

#[test]
fn retired_mechanism_rejects_new_work_but_releases_views_and_decommits() {
    let registry = BindingRegistry::new();
    let caps = Arc::new(Caps::new(GPU0));
    let (_, _, mechanism) = register(&registry, caps.clone());
    let binding = registry.bind(GPU0).unwrap();
    let block = binding.allocate(request(2 * PAGE)).unwrap();
    let virt = binding.virtual_backing().unwrap();
    virt.commit(&block, ByteRange::new(0, 2 * PAGE)).unwrap();

    registry.retire(&mechanism).unwrap();
    assert_eq!(registry.selected(GPU0), None);
    assert!(matches!(registry.bind(GPU0), Err(BindError::NoSelection { .. })));
    assert!(matches!(
        registry.bind_registered(&mechanism),
        Err(BindError::Inactive { state: MechanismState::Retired, .. })
    ));
    let allocates = caps.allocates.load(Ordering::SeqCst);
    assert!(matches!(
        binding.allocate(request(PAGE)),
        Err(AllocateError::Inactive { state: MechanismState::Retired, .. })
    ));
    assert_eq!(caps.allocates.load(Ordering::SeqCst), allocates, "no callback for a refused allocation");
    assert!(virt.commit(&block, ByteRange::new(0, PAGE)).is_err());
    assert_eq!(caps.commits.load(Ordering::SeqCst), 1);
    assert!(matches!(registry.select(&mechanism), Err(RegistryError::InvalidState { .. })));

    // Existing allocations stay usable for views, decommit and release.
    assert_eq!(block.view(PAGE, PAGE).unwrap().len(), PAGE);
    assert_eq!(virt.decommit(&block, ByteRange::new(0, PAGE)).unwrap(), PAGE);
    assert_eq!(binding.release(block).unwrap(), ReleaseSummary::Complete { unmapped_bytes: 2 * PAGE });
    registry.remove(&mechanism).unwrap();
}

#[test]
fn invalidation_makes_no_callback_and_hands_every_handle_back() {
    let registry = BindingRegistry::new();
    let recorder = Arc::new(RecordingAllocator::on_device(GPU0));
    let (context, _, mechanism) = register(&registry, recorder.clone());
    let binding = registry.bind(GPU0).unwrap();
    let block = binding.allocate(request(256)).unwrap();
    let before = recorder.counts();

    let report = registry.invalidate_device(GPU0, "Xid 79: fell off the bus");
    assert_eq!((report.mechanisms, report.contexts, report.selection_dropped), (1, 1, true));
    assert_eq!(recorder.counts(), before, "invalidation must not call the allocator");
    assert_eq!(registry.selected(GPU0), None);

    let rejected = binding.release(block).unwrap_err();
    assert!(matches!(&rejected.reason, HandleError::DeviceLost { reason, .. } if reason.contains("Xid 79")));
    let block = rejected.handle;
    assert!(matches!(block.view(0, 8), Err(ViewError::Handle(HandleError::DeviceLost { .. }))));
    assert!(matches!(binding.allocate(request(8)), Err(AllocateError::DeviceLost { .. })));
    assert!(matches!(registry.bind(GPU0), Err(BindError::NoSelection { .. })));
    assert_eq!(registry.snapshot(&mechanism).unwrap().state, MechanismState::DeviceLost);
    assert_eq!(registry.allocation_state(&block.identity().unwrap()), AllocationState::Lost);
    // Dropping a lost handle makes no callback either.
    drop(block);
    assert_eq!(recorder.counts(), before);
    assert_eq!(registry.snapshots().contexts[0].state, ContextState::Lost);
    // The lost context accepts no new mechanism.
    let authority = registry.register_authority(GPU0, Arc::new(())).unwrap();
    assert!(matches!(
        registry.register_allocator(&context, &authority, Arc::new(Caps::new(GPU0))),
        Err(RegistryError::ContextNotLive { state: ContextState::Lost, .. })
    ));
}

#[test]
fn termination_waits_for_a_blocked_allocate_then_retires_metadata() {
    let registry = BindingRegistry::new();
    let recorder = Arc::new(RecordingAllocator::on_device(GPU0));
    let (context, authority, mechanism) = register(&registry, recorder.clone());
    let binding = registry.bind(GPU0).unwrap();
    let survivor = binding.allocate(request(512)).unwrap();
    let survivor_id = survivor.identity().unwrap();

    assert!(matches!(registry.confirm_context_terminated(&context), Err(RegistryError::ContextStillLive { .. })));

    let gate = recorder.gate(Callback::Allocate);
    std::thread::scope(|scope| {
        let worker = scope.spawn(|| binding.allocate(request(1024)));
        gate.wait_until_blocked(1);
        registry.invalidate_device(GPU0, "ECC error");
        let err = registry.confirm_context_terminated(&context).unwrap_err();
        assert!(matches!(err, RegistryError::ContextNotQuiescent { in_flight: 1, .. }), "{err}");
        gate.open();
        // The callback began before the loss, so its allocation is recorded (as lost).
        let late = worker.join().unwrap().unwrap();
        drop(late);
    });
    drop(gate);

    let report = registry.confirm_context_terminated(&context).unwrap();
    assert!(!report.already_terminated);
    assert_eq!((report.lost_allocations, report.lost_bytes), (2, 1536));
    assert_eq!(recorder.forgotten_blocks(), 2);
    assert_eq!(registry.allocation_state(&survivor_id), AllocationState::Gone);

    // Idempotent, and no callback runs after confirmation.
    let again = registry.confirm_context_terminated(&context).unwrap();
    assert!(again.already_terminated);
    let before = recorder.counts();
    let rejected = binding.release(survivor).unwrap_err();
    assert_eq!(rejected.reason, HandleError::StaleAllocation);
    assert!(!rejected.handle.is_valid());
    drop(rejected);
    assert_eq!(recorder.counts(), before);

    // A terminated context takes no new mechanism; removal now succeeds in order.
    assert!(matches!(
        registry.register_allocator(&context, &authority, Arc::new(Caps::new(GPU0))),
        Err(RegistryError::ContextNotLive { state: ContextState::Terminated, .. })
    ));
    assert!(matches!(
        registry.remove_provider_context(&context),
        Err(RegistryError::NotQuiescent { dependents: 1, .. })
    ));
    registry.remove(&mechanism).unwrap();
    registry.remove_provider_context(&context).unwrap();
    registry.remove_authority(&authority).unwrap();
}

#[test]
fn a_new_context_takes_over_after_loss() {
    let registry = BindingRegistry::new();
    let (old_context, _, _) = register(&registry, Arc::new(Caps::new(GPU0)));
    registry.invalidate_device(GPU0, "reset");
    registry.confirm_context_terminated(&old_context).unwrap();
    let fresh = Arc::new(Caps::new(GPU0));
    let (_, _, mechanism) = register(&registry, fresh.clone());
    assert_eq!(registry.selected(GPU0), Some(mechanism));
    let binding = registry.bind(GPU0).unwrap();
    binding.release(binding.allocate(request(64)).unwrap()).unwrap();
    assert_eq!(fresh.releases.load(Ordering::SeqCst), 1);
}

#[test]
fn reused_address_gets_a_new_generation_and_old_metadata_never_validates() {
    let registry = BindingRegistry::new();
    let caps = Arc::new(Caps::reusing(GPU0, 0x7000_0000));
    let (_, _, mechanism) = register(&registry, caps);
    let binding = bind(&registry, &mechanism);
    let first = binding.allocate(request(64)).unwrap();
    let second = binding.allocate(request(64)).unwrap();
    assert_eq!(first.address(), second.address());
    let (id1, id2) = (first.identity().unwrap(), second.identity().unwrap());
    assert_ne!(id1.generation(), id2.generation());
    binding.release(first).unwrap();
    assert_eq!(registry.allocation_state(&id1), AllocationState::Gone);
    assert_eq!(registry.allocation_state(&id2), AllocationState::Live);
    let third = binding.allocate(request(64)).unwrap();
    assert_eq!(registry.allocation_state(&id1), AllocationState::Gone, "address reuse must not revive old metadata");
    assert_ne!(third.identity().unwrap().generation(), id1.generation());
    binding.release(second).unwrap();
    binding.release(third).unwrap();
}

#[test]
fn partial_release_is_quarantined_visible_blocks_removal_and_retries() {
    let registry = BindingRegistry::new();
    let faulty = Arc::new(FaultyAllocator::host());
    let (_, _, mechanism) = register(&registry, faulty.clone());
    let binding = bind(&registry, &mechanism);
    let block = binding.allocate(request(8192)).unwrap();
    faulty.quarantine_nth_release(1, 4096, 4096);
    let report = binding.release(block).unwrap();
    assert_eq!(report, ReleaseSummary::Quarantined { unmapped_bytes: 4096, residual_bytes: 4096 });

    let snapshot = registry.snapshot(&mechanism).unwrap();
    assert_eq!(snapshot.quarantined.len(), 1);
    assert_eq!(snapshot.quarantined_bytes(), 4096);
    registry.retire(&mechanism).unwrap();
    assert!(matches!(registry.remove(&mechanism), Err(RegistryError::NotQuiescent { quarantined: 1, .. })));

    let retry = registry.retry_quarantined(&mechanism).unwrap();
    assert_eq!((retry.released, retry.still_quarantined), (1, 0));
    assert!(registry.snapshot(&mechanism).unwrap().quarantined.is_empty());
    registry.remove(&mechanism).unwrap();
}

#[test]
fn impossible_release_outcome_is_quarantined_as_wholly_owned() {
    let registry = BindingRegistry::new();
    let faulty = Arc::new(FaultyAllocator::host());
    let (_, _, mechanism) = register(&registry, faulty.clone());
    let binding = bind(&registry, &mechanism);
    let block = binding.allocate(request(4096)).unwrap();
    faulty.quarantine_nth_release(1, 0, 1 << 20);
    let report = binding.release(block).unwrap();
    assert_eq!(report, ReleaseSummary::Quarantined { unmapped_bytes: 0, residual_bytes: 4096 });
    let snapshot = registry.snapshot(&mechanism).unwrap();
    assert!(snapshot.quarantined[0].reason.contains("still owned"), "{}", snapshot.quarantined[0].reason);
}

#[test]
fn quarantine_is_discharged_at_termination() {
    let registry = BindingRegistry::new();
    let faulty = Arc::new(FaultyAllocator::new(memory_testkit::HostHeap::on_device(GPU0)));
    let (context, _, mechanism) = register(&registry, faulty.clone());
    let binding = bind(&registry, &mechanism);
    faulty.quarantine_nth_release(1, 0, 100);
    binding.release(binding.allocate(request(100)).unwrap()).unwrap();
    registry.invalidate_device(GPU0, "lost");
    assert!(registry.retry_quarantined(&mechanism).is_err(), "no retry on a lost device");
    let report = registry.confirm_context_terminated(&context).unwrap();
    assert_eq!(report.discharged_quarantine, 1);
    assert!(registry.snapshot(&mechanism).unwrap().quarantined.is_empty());
}

#[test]
fn dropping_host_memory_releases_it_at_once() {
    let registry = BindingRegistry::new();
    let recorder = Arc::new(RecordingAllocator::host());
    let (_, _, mechanism) = register(&registry, recorder.clone());
    let binding = bind(&registry, &mechanism);
    drop(binding.allocate(request(64)).unwrap());
    assert_eq!(recorder.calls(Callback::Release), 1);
    assert_eq!(registry.snapshot(&mechanism).unwrap().live_allocations, 0);
}

#[test]
fn dropping_device_memory_without_a_safe_path_quarantines_it() {
    let registry = BindingRegistry::new();
    let caps = Arc::new(Caps::new(GPU0));
    let (_, _, mechanism) = register(&registry, caps.clone());
    let binding = bind(&registry, &mechanism);
    drop(binding.allocate(request(PAGE)).unwrap());
    assert_eq!(caps.releases.load(Ordering::SeqCst), 0, "device memory may still be in use: never freed on drop");
    let snapshot = registry.snapshot(&mechanism).unwrap();
    assert_eq!(snapshot.live_allocations, 0);
    assert_eq!(snapshot.quarantined.len(), 1);
    assert!(snapshot.quarantined[0].reason.contains("dropped"), "{}", snapshot.quarantined[0].reason);
}

#[test]
fn dropping_device_memory_with_a_queue_defers_the_release() {
    let registry = BindingRegistry::new();
    let caps = Arc::new(Caps::new(GPU0));
    let queue = Arc::new(HeldQueue::new(GPU0, 1));
    let options = MechanismOptions::default().with_drop_policy(Some(DropPolicy::Defer(queue.clone())));
    let (context, _, mechanism) = register_with(&registry, caps.clone(), options);
    let binding = bind(&registry, &mechanism);
    drop(binding.allocate(request(PAGE)).unwrap());
    assert_eq!(queue.len(), 1);
    assert_eq!(caps.releases.load(Ordering::SeqCst), 0);
    // The queue is full now: the next drop quarantines instead of leaking.
    drop(binding.allocate(request(PAGE)).unwrap());
    assert_eq!(registry.snapshot(&mechanism).unwrap().quarantined.len(), 1);
    // A queued release counts as in flight: termination must wait for it.
    registry.invalidate_device(GPU0, "lost");
    assert!(matches!(registry.confirm_context_terminated(&context), Err(RegistryError::ContextNotQuiescent { .. })));
    // Run after loss, it makes no allocator callback; the block is retired as lost.
    queue.run_all();
    assert_eq!(caps.releases.load(Ordering::SeqCst), 0);
    let report = registry.confirm_context_terminated(&context).unwrap();
    assert_eq!(report.lost_allocations, 1);
    assert_eq!(caps.forgotten.load(Ordering::SeqCst), 2);
}

#[test]
fn deferred_release_refused_by_a_full_or_foreign_queue_hands_the_allocation_back() {
    let registry = BindingRegistry::new();
    let caps = Arc::new(Caps::new(GPU0));
    let (_, _, mechanism) = register(&registry, caps.clone());
    let binding = bind(&registry, &mechanism);
    let full = HeldQueue::new(GPU0, 0);
    let rejected = binding.release_deferred(binding.allocate(request(64)).unwrap(), &full).unwrap_err();
    assert!(matches!(rejected.reason, HandleError::QueueRefused(memory_api::QueueRefusalReason::Full { .. })));
    let block = rejected.handle;
    assert!(block.is_valid());
    let elsewhere = HeldQueue::new(DeviceKey::device(1), 4);
    let rejected = binding.release_deferred(block, &elsewhere).unwrap_err();
    assert!(matches!(rejected.reason, HandleError::QueueRefused(memory_api::QueueRefusalReason::WrongDevice { .. })));
    assert_eq!(registry.snapshot(&mechanism).unwrap().in_flight, 0);
    let queue = HeldQueue::new(GPU0, 1);
    binding.release_deferred(rejected.handle, &queue).unwrap();
    assert_eq!(queue.run_all().len(), 1);
    assert_eq!(caps.releases.load(Ordering::SeqCst), 1);
    assert_eq!(registry.snapshot(&mechanism).unwrap().in_flight, 0);
}

#[test]
fn refused_release_hands_the_same_allocation_back() {
    let registry = BindingRegistry::new();
    let faulty = Arc::new(FaultyAllocator::host());
    let (_, _, mechanism) = register(&registry, faulty.clone());
    let binding = bind(&registry, &mechanism);
    let block = binding.allocate(request(64)).unwrap();
    let identity = block.identity().unwrap();
    faulty.fail_nth(Callback::Release, 1);
    let rejected = binding.release(block).unwrap_err();
    assert!(matches!(rejected.reason, HandleError::ReleaseFailed(_)));
    assert_eq!(rejected.handle.identity().unwrap(), identity);
    assert_eq!(registry.allocation_state(&identity), AllocationState::Live);
    binding.release(rejected.handle).unwrap();
    assert_eq!(registry.allocation_state(&identity), AllocationState::Gone);
}

#[test]
fn handles_keep_their_pins_after_the_registry_is_dropped_and_drop_in_order() {
    #[derive(Debug)]
    struct Noisy(&'static str, Arc<Mutex<Vec<&'static str>>>);
    impl Drop for Noisy {
        fn drop(&mut self) {
            self.1.lock().unwrap().push(self.0);
        }
    }
    struct NoisyAllocator(RecordingAllocator, #[allow(dead_code)] Noisy);
    impl DeviceAllocator for NoisyAllocator {
        fn device(&self) -> DeviceKey {
            self.0.device()
        }
        fn name(&self) -> &str {
            "noisy"
        }
        fn allocate(
            &self,
            r: &memory_api::AllocationRequest,
        ) -> Result<memory_api::RawAllocation, memory_api::AllocError> {
            self.0.allocate(r)
        }
        fn release(&self, a: memory_api::RawAllocation) -> memory_api::ReleaseOutcome {
            self.0.release(a)
        }
    }

    let order = Arc::new(Mutex::new(Vec::new()));
    let registry = BindingRegistry::new();
    let context =
        registry.register_provider_context(DeviceKey::HOST, Arc::new(Noisy("context", order.clone()))).unwrap();
    let authority = registry.register_authority(DeviceKey::HOST, Arc::new(Noisy("authority", order.clone()))).unwrap();
    let allocator = Arc::new(NoisyAllocator(RecordingAllocator::host(), Noisy("allocator", order.clone())));
    let mechanism = registry.register_allocator(&context, &authority, allocator).unwrap();
    let binding = bind(&registry, &mechanism);
    let block = binding.allocate(request(64)).unwrap();
    drop(registry);
    assert!(order.lock().unwrap().is_empty(), "live handles pin every resource");
    binding.release(block).unwrap();
    drop(binding);
    assert_eq!(*order.lock().unwrap(), ["allocator", "authority", "context"]);
}

#[test]
fn removal_requires_quiescence() {
    let registry = BindingRegistry::new();
    let (context, authority, mechanism) = register(&registry, Arc::new(Caps::new(DeviceKey::HOST)));
    assert!(matches!(
        registry.remove(&mechanism),
        Err(RegistryError::InvalidState { state: MechanismState::Active, .. })
    ));
    let binding = bind(&registry, &mechanism);
    let block = binding.allocate(request(64)).unwrap();
    registry.retire(&mechanism).unwrap();
    assert!(matches!(registry.remove(&mechanism), Err(RegistryError::NotQuiescent { live: 1, .. })));
    assert!(matches!(registry.remove_authority(&authority), Err(RegistryError::NotQuiescent { dependents: 1, .. })));
    binding.release(block).unwrap();
    registry.remove(&mechanism).unwrap();
    registry.remove_authority(&authority).unwrap();
    registry.remove_provider_context(&context).unwrap();
    assert!(matches!(registry.remove(&mechanism), Err(RegistryError::Unknown { .. })));
    assert!(registry.snapshots().mechanisms.is_empty());
}

#[test]
fn with_memory_adapts_a_bare_allocator() {
    let registry = BindingRegistry::new();
    let recorder = Arc::new(RecordingAllocator::host());
    let binding = registry.with_memory(recorder.clone()).unwrap();
    let block = binding.allocate(request(128)).unwrap();
    binding.release(block).unwrap();
    assert_eq!(recorder.calls(Callback::Release), 1);
    let snapshot = registry.snapshots();
    assert_eq!((snapshot.contexts.len(), snapshot.authorities.len(), snapshot.mechanisms.len()), (1, 1, 1));
    assert_eq!(binding.identity().registry(), registry.id());
    assert_eq!(binding.identity().mechanism().registry(), registry.id());
}

#[test]
fn wait_terminated_polls_until_a_queued_release_drains_and_times_out_with_the_last_answer() {
    let registry = BindingRegistry::new();
    let caps = Arc::new(Caps::new(GPU0));
    let queue = Arc::new(HeldQueue::new(GPU0, 1));
    let (context, _, mechanism) = register(&registry, caps.clone());
    let binding = bind(&registry, &mechanism);
    binding.release_deferred(binding.allocate(request(PAGE)).unwrap(), &*queue).unwrap();
    registry.invalidate_device(GPU0, "lost");

    // Still in flight: the wait ends at its timeout with the registry's own answer.
    let started = std::time::Instant::now();
    let waited = registry.wait_terminated(&context, std::time::Duration::from_millis(30));
    assert!(matches!(waited, Err(RegistryError::ContextNotQuiescent { in_flight: 1, .. })), "{waited:?}");
    assert!(started.elapsed() >= std::time::Duration::from_millis(30));

    // The queue drains on another thread while this one waits; registration stays free
    // meanwhile (no lock is held between polls).
    let drainer = {
        let queue = Arc::clone(&queue);
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            queue.run_all()
        })
    };
    let other = registry.register_authority(GPU0, Arc::new(())).unwrap();
    let report = registry.wait_terminated(&context, std::time::Duration::from_secs(30)).unwrap();
    drainer.join().unwrap();
    assert_eq!(report.lost_allocations, 1);
    assert_eq!(caps.releases.load(Ordering::SeqCst), 0, "no release ran after the loss");
    registry.remove_authority(&other).unwrap();

    // A context that was never lost is refused at once, not waited on.
    let live = registry.register_provider_context(DeviceKey::device(1), Arc::new(())).unwrap();
    let started = std::time::Instant::now();
    let refused = registry.wait_terminated(&live, std::time::Duration::from_secs(30));
    assert!(matches!(refused, Err(RegistryError::ContextStillLive { .. })), "{refused:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
}

#[test]
fn a_caller_hold_keeps_termination_not_quiescent_until_it_drops_and_makes_no_callback() {
    let registry = BindingRegistry::new();
    let recorder = Arc::new(RecordingAllocator::new(Caps::new(GPU0)));
    let (context, _, mechanism) = register(&registry, recorder.clone());
    let binding = bind(&registry, &mechanism);
    let block = binding.allocate(request(PAGE)).unwrap();
    // A foreign runtime (say an ONNX Runtime session) may still free `block`.
    let hold = binding.hold_callers("session 1");
    let second = binding.hold_callers("session 2");
    assert_eq!(hold.holder(), "session 1");
    registry.invalidate_device(GPU0, "lost");
    let err = registry.confirm_context_terminated(&context).unwrap_err();
    assert!(matches!(err, RegistryError::ContextNotQuiescent { in_flight: 0, holds: 2, .. }), "{err}");
    assert!(err.to_string().contains("2 caller hold(s)"), "{err}");
    drop(hold);
    assert!(matches!(
        registry.confirm_context_terminated(&context),
        Err(RegistryError::ContextNotQuiescent { holds: 1, .. })
    ));
    // The holder frees after the loss: no callback, the handle comes back.
    let rejected = binding.release(block).unwrap_err();
    assert!(matches!(rejected.reason, HandleError::DeviceLost { .. }));
    drop(rejected);
    drop(second);
    let report = registry.confirm_context_terminated(&context).unwrap();
    assert_eq!(report.lost_allocations, 1);
    assert_eq!(recorder.calls(Callback::Release), 0);
    assert_eq!(recorder.calls(Callback::ForgetLost), 1);
}

#[test]
fn an_allocation_releases_by_its_handle_alone_through_its_original_allocator_after_its_binding_is_dropped() {
    let registry = BindingRegistry::new();
    let first = Arc::new(RecordingAllocator::new(FaultyAllocator::new(memory_testkit::HostHeap::on_device(GPU0))));
    let second = Arc::new(RecordingAllocator::on_device(GPU0));
    let (_, _, m1) = register(&registry, first.clone());
    let (_, _, m2) = register(&registry, second.clone());
    let binding = bind(&registry, &m1);
    let block = binding.allocate(request(PAGE)).unwrap();
    let kept = binding.allocate(request(PAGE)).unwrap();
    let refused = binding.allocate(request(PAGE)).unwrap();
    let (block_id, kept_id) = (block.identity().unwrap(), kept.identity().unwrap());
    drop(binding);
    // The selection moves on; the allocations stay pinned to the mechanism that made them.
    registry.select(&m2).unwrap();

    assert_eq!(block.release().unwrap(), ReleaseSummary::Complete { unmapped_bytes: PAGE });
    assert_eq!(first.calls(Callback::Release), 1);
    assert_eq!(registry.allocation_state(&block_id), AllocationState::Gone);
    assert_eq!(registry.allocation_state(&kept_id), AllocationState::Live);

    // From a place: emptied on success; an empty place is stale and calls nothing.
    let mut place = Some(kept);
    assert_eq!(
        BoundAllocation::release_in_place(&mut place).unwrap(),
        ReleaseSummary::Complete { unmapped_bytes: PAGE }
    );
    assert!(place.is_none());
    assert_eq!(registry.allocation_state(&kept_id), AllocationState::Gone);
    assert_eq!(first.calls(Callback::Release), 2);
    assert_eq!(BoundAllocation::release_in_place(&mut place).unwrap_err(), HandleError::StaleAllocation);
    assert_eq!(first.calls(Callback::Release), 2, "no callback for an empty place");

    // A refusal by the allocator hands the same allocation back, still releasable.
    let refused_id = refused.identity().unwrap();
    first.inner().fail_nth(Callback::Release, 1);
    let rejected = refused.release().unwrap_err();
    assert!(matches!(rejected.reason, HandleError::ReleaseFailed(_)), "{}", rejected.reason);
    assert_eq!(rejected.handle.identity(), Some(refused_id));
    assert_eq!(registry.allocation_state(&refused_id), AllocationState::Live);
    let mut place = Some(rejected.handle);
    first.inner().fail_nth(Callback::Release, 1);
    assert!(matches!(BoundAllocation::release_in_place(&mut place), Err(HandleError::ReleaseFailed(_))));
    assert_eq!(place.as_ref().and_then(BoundAllocation::identity), Some(refused_id));
    BoundAllocation::release_in_place(&mut place).unwrap();
    assert_eq!(registry.allocation_state(&refused_id), AllocationState::Gone);

    assert_eq!(
        (second.calls(Callback::Allocate), second.calls(Callback::Release)),
        (0, 0),
        "the selected mechanism's allocator never runs"
    );
    assert_eq!(registry.snapshot(&m1).unwrap().live_allocations, 0);
    registry.retire(&m1).unwrap();
    registry.remove(&m1).unwrap();
}

#[test]
fn release_by_handle_on_a_lost_device_or_after_termination_hands_it_back_with_no_callback() {
    let registry = BindingRegistry::new();
    let recorder = Arc::new(RecordingAllocator::on_device(GPU0));
    let (context, _, mechanism) = register(&registry, recorder.clone());
    let binding = bind(&registry, &mechanism);
    let block = binding.allocate(request(256)).unwrap();
    let mut place = Some(binding.allocate(request(256)).unwrap());
    let identity = block.identity().unwrap();
    drop(binding);

    registry.invalidate_device(GPU0, "Xid 79: fell off the bus");
    let before = recorder.counts();
    let rejected = block.release().unwrap_err();
    assert!(matches!(&rejected.reason, HandleError::DeviceLost { reason, .. } if reason.contains("Xid 79")));
    assert!(rejected.handle.is_valid());
    assert_eq!(rejected.handle.identity(), Some(identity));
    assert!(matches!(BoundAllocation::release_in_place(&mut place), Err(HandleError::DeviceLost { .. })));
    assert!(place.as_ref().is_some_and(BoundAllocation::is_valid), "a refused release leaves the place as it was");
    assert_eq!(recorder.counts(), before, "a lost device gets no callback");

    // After termination the records are retired: the handle's generation no longer
    // validates, and still nothing is called.
    registry.confirm_context_terminated(&context).unwrap();
    let before = recorder.counts();
    let stale = rejected.handle.release().unwrap_err();
    assert_eq!(stale.reason, HandleError::StaleAllocation);
    assert!(!stale.handle.is_valid());
    assert_eq!(BoundAllocation::release_in_place(&mut place).unwrap_err(), HandleError::StaleAllocation);
    drop((stale, place));
    assert_eq!(recorder.counts(), before, "a stale handle gets no callback");
    registry.remove(&mechanism).unwrap();
}
