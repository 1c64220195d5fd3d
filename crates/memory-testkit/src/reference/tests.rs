//! The model's own bookkeeping, checked on small scripts (the registry-facing checks
//! live in the property test and the fuzz harness).

use memory_api::{AllocationRequest, DeviceAllocator, DeviceKey, ReleaseSummary};

use super::*;
use crate::{Callback, FaultyAllocator};

const GPU: DeviceKey = DeviceKey::device(0);
const HOST: DeviceKey = DeviceKey::HOST;

/// A model with one mechanism on `device` (index 0) and a binding of it (key 0).
fn one_mechanism(device: DeviceKey, policy: Option<Policy>) -> Model {
    let mut model = Model::new(&[HOST, GPU], 1);
    model.register_context(device);
    model.register_authority(device);
    assert_eq!(model.register_allocator(Ref::Ours(0), Ref::Ours(0), device, policy), Out::Registered);
    assert_eq!(model.bind(device), Out::Bound { mechanism: 0 });
    model
}

#[test]
fn fault_schedule_fires_like_the_faulty_allocator() {
    // The same plan on the real FaultyAllocator and on the model: the same calls fail.
    let faulty = FaultyAllocator::host();
    let mut model = one_mechanism(HOST, None);
    for nth in [3, 1, 3, 2] {
        faulty.fail_nth(Callback::Allocate, nth);
        model.plan_fault(0, FaultOn::Allocate, nth, Fault::Fail);
    }
    let request = AllocationRequest::new(8, 8).unwrap();
    for call in 1..=8 {
        let real = faulty.allocate(&request).map(|block| assert!(faulty.release(block).is_complete())).is_ok();
        let modelled = model.take_fault(0, FaultOn::Allocate).is_none();
        assert_eq!(real, modelled, "call {call}");
        assert_eq!(faulty.pending(), model.mechanisms[0].pending_faults(), "call {call}");
    }
    assert_eq!(model.mechanisms[0].pending_faults(), 0);
}

#[test]
fn releases_and_quarantine_keep_the_books_balanced() {
    let mut model = one_mechanism(GPU, None);
    for bytes in [64, 128, 256] {
        assert_eq!(model.allocate(0, bytes), Out::Allocated { mechanism: 0, bytes });
    }
    model.plan_fault(0, FaultOn::Release, 1, Fault::Quarantine { unmapped: 16, residual: 16 });
    let expected = ReleaseSummary::Quarantined { unmapped_bytes: 16, residual_bytes: 16 };
    assert_eq!(model.release(0, Through::Binding(0)), Out::Released(expected));
    assert_eq!(model.drop_handle(1), Out::Done, "device memory is quarantined on drop");
    assert_eq!(model.release(2, Through::Binding(0)), Out::Released(ReleaseSummary::Complete { unmapped_bytes: 256 }));
    model.check_conservation();
    assert_eq!(model.mechanisms[0].calls.heap_live, 2);
    assert_eq!(model.view_mechanism(0).quarantined.len(), 2);
    assert_eq!(model.retry(Ref::Ours(0)), Out::Retried { released: 2, still: 0 });
    model.check_conservation();
    assert_eq!((model.mechanisms[0].calls.heap_live, model.mechanisms[0].calls.heap_live_bytes), (0, 0));
}

#[test]
fn a_drop_deferred_to_a_full_queue_is_abandoned_and_a_queue_of_another_device_is_refused() {
    let mut model = one_mechanism(GPU, Some(Policy::Defer(1)));
    model.allocate(0, 64);
    model.allocate(0, 64);
    model.drop_handle(0);
    model.drop_handle(1);
    assert_eq!(model.allocations[0].place, Place::Queued(1));
    assert!(matches!(model.allocations[1].place, Place::Quarantined { reason: Reason::Abandoned, .. }), "full");
    model.check_conservation();
    // A queue of the host for a GPU mechanism: refused at registration, nothing made.
    let mut other = Model::new(&[HOST, GPU], 1);
    other.register_context(GPU);
    other.register_authority(GPU);
    assert_eq!(
        other.register_allocator(Ref::Ours(0), Ref::Ours(0), GPU, Some(Policy::Defer(0))),
        Out::Registry(Reg::DeviceMismatch("drop policy's deferred-release queue"))
    );
    assert!(other.mechanisms.is_empty());
}

#[test]
fn a_panicking_queued_release_abandons_the_rest_of_the_run() {
    let mut model = one_mechanism(HOST, Some(Policy::Defer(0)));
    model.queue_capacity = 3;
    for _ in 0..3 {
        model.allocate(0, 32);
    }
    for a in 0..3 {
        assert_eq!(model.release_deferred(a, Through::Binding(0), 0), Out::Deferred);
    }
    model.plan_fault(0, FaultOn::Release, 1, Fault::Panic);
    assert_eq!(model.run_queued(0, 2), Out::Panicked);
    assert!(matches!(model.allocations[0].place, Place::Quarantined { reason: Reason::Panicked, .. }));
    assert!(matches!(model.allocations[1].place, Place::Quarantined { reason: Reason::Abandoned, .. }));
    assert_eq!(model.allocations[2].place, Place::Queued(0), "not taken by the run");
    model.check_conservation();
}

#[test]
fn the_heap_limit_refuses_after_the_allocator_was_called() {
    let mut model = one_mechanism(HOST, None).with_heap_limit(100);
    assert_eq!(model.allocate(0, 60), Out::Allocated { mechanism: 0, bytes: 60 });
    assert_eq!(model.allocate(0, 60), Out::AllocAllocator);
    assert_eq!(model.mechanisms[0].calls.allocate, 2);
    assert_eq!(model.allocate(0, 40), Out::Allocated { mechanism: 0, bytes: 40 });
}

#[test]
fn termination_forgets_records_and_quarantine_and_reports_a_planned_panic() {
    let mut model = one_mechanism(GPU, None);
    model.allocate(0, 64);
    model.allocate(0, 32);
    model.drop_handle(1);
    model.invalidate(GPU);
    model.plan_fault(0, FaultOn::ForgetLost, 1, Fault::Panic);
    assert_eq!(model.confirm(Ref::Ours(0)), Out::Panicked);
    assert_eq!(model.contexts[0].state, ContextState::Terminated, "terminated regardless");
    assert_eq!((model.mechanisms[0].calls.forget_lost, model.mechanisms[0].calls.forgotten_blocks), (1, 2));
    assert_eq!(model.allocation_state(0), AllocationState::Gone);
    assert_eq!(
        model.confirm(Ref::Ours(0)),
        Out::Terminated { already: true, mechanisms: 0, lost_allocations: 0, lost_bytes: 0, discharged: 0 }
    );
    model.check_conservation();
}

#[test]
fn with_memory_registers_selects_and_binds() {
    let mut model = Model::new(&[HOST, GPU], 0);
    assert_eq!(model.with_memory(GPU), Out::Bound { mechanism: 0 });
    assert_eq!(model.selection, vec![None, Some(0)]);
    assert_eq!(model.mechanisms[0].policy, Policy::Quarantine);
    assert_eq!(model.bindings, vec![0]);
}
