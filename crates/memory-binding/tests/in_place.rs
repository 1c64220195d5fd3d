//! `allocate_into` and `release_from`: the same paths as `allocate` and `release`, with
//! the allocation kept in the caller's own `Option` cell (a C ABI's handle table). The
//! cell's contents are the contract: what it holds after every outcome.

mod common;

use std::sync::Arc;

use common::{PAGE, register, request};
use memory_api::{DeviceKey, MechanismIdentity, ReleaseSummary};
use memory_binding::{BindingRegistry, BoundAllocation, HandleError, MemoryBinding};
use memory_testkit::{Callback, FaultyAllocator, HostHeap, RecordingAllocator};

type Faulty = RecordingAllocator<FaultyAllocator<HostHeap>>;

/// A registry with one host mechanism over a recording, fault-injecting heap, and a
/// binding of it.
fn setup() -> (BindingRegistry, Arc<Faulty>, MechanismIdentity, MemoryBinding) {
    let registry = BindingRegistry::new();
    let allocator = Arc::new(RecordingAllocator::new(FaultyAllocator::new(HostHeap::on_device(DeviceKey::host(0)))));
    let (_, _, mechanism) = register(&registry, allocator.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    (registry, allocator, mechanism, binding)
}

#[test]
fn allocate_into_fills_the_place_and_release_from_empties_it() {
    let (registry, allocator, mechanism, binding) = setup();

    let mut place: Option<BoundAllocation> = None;
    let made = binding.allocate_into(request(PAGE), &mut place).unwrap();
    let identity = made.identity();
    assert_eq!(made.bytes(), PAGE);
    assert_eq!(place.as_ref().map(BoundAllocation::identity), Some(identity));
    assert_eq!(registry.snapshot(&mechanism).unwrap().live_allocations, 1);

    let summary = binding.release_from(&mut place).unwrap();
    assert!(matches!(summary, ReleaseSummary::Complete { unmapped_bytes: PAGE }), "{summary:?}");
    assert!(place.is_none(), "a released allocation leaves its place empty");
    assert_eq!(allocator.calls(Callback::Release), 1);
    assert_eq!(registry.snapshot(&mechanism).unwrap().live_allocations, 0);
}

#[test]
fn allocate_into_drops_what_the_place_held_and_leaves_it_empty_on_error() {
    let (registry, allocator, mechanism, binding) = setup();

    let mut place = Some(binding.allocate(request(PAGE)).unwrap());
    let first = place.as_ref().unwrap().identity();
    // The old allocation goes by its drop policy (host memory: released) before the new
    // one is made.
    let second = binding.allocate_into(request(PAGE), &mut place).unwrap().identity();
    assert_ne!(first, second);
    assert_eq!(allocator.calls(Callback::Release), 1);
    assert_eq!(registry.snapshot(&mechanism).unwrap().live_allocations, 1);

    allocator.inner().fail_nth(Callback::Allocate, 1);
    binding.allocate_into(request(PAGE), &mut place).unwrap_err();
    assert!(place.is_none(), "a failed allocate_into leaves its place empty");
    assert_eq!(allocator.calls(Callback::Release), 2, "what the place held was dropped by its policy");
    assert_eq!(registry.snapshot(&mechanism).unwrap().live_allocations, 0);
    assert_eq!(allocator.in_flight(), 0);
}

#[test]
fn a_refused_release_from_leaves_the_allocation_in_place_and_releasable() {
    let (registry, allocator, mechanism, binding) = setup();
    let mut place = Some(binding.allocate(request(PAGE)).unwrap());
    let identity = place.as_ref().unwrap().identity();

    allocator.inner().fail_nth(Callback::Release, 1);
    let reason = binding.release_from(&mut place).unwrap_err();
    assert!(matches!(reason, HandleError::ReleaseFailed(_)), "{reason}");
    let kept = place.as_ref().expect("a refused release leaves the allocation in place");
    assert_eq!(kept.identity(), identity);
    assert!(kept.is_valid());
    assert_eq!(registry.snapshot(&mechanism).unwrap().live_allocations, 1);

    binding.release_from(&mut place).unwrap();
    assert!(place.is_none());
    assert_eq!(registry.snapshot(&mechanism).unwrap().live_allocations, 0);
}

#[test]
fn release_from_an_empty_place_is_stale_and_calls_nothing() {
    let (_registry, allocator, _, binding) = setup();
    let before = allocator.counts().total();
    let mut place = None;
    assert_eq!(binding.release_from(&mut place).unwrap_err(), HandleError::StaleAllocation);
    assert_eq!(allocator.counts().total(), before, "no callback for an empty place");
}

#[test]
fn release_from_on_another_binding_leaves_the_allocation_in_place_without_a_callback() {
    let (registry, allocator, mechanism, owner) = setup();
    let other = registry.bind_registered(&mechanism).unwrap();
    let mut place = Some(owner.allocate(request(PAGE)).unwrap());
    let identity = place.as_ref().unwrap().identity();
    let before = allocator.counts().total();

    let reason = other.release_from(&mut place).unwrap_err();
    assert!(matches!(reason, HandleError::BindingMismatch { .. }), "{reason}");
    assert_eq!(place.as_ref().map(BoundAllocation::identity), Some(identity));
    assert_eq!(allocator.counts().total(), before, "refused before any callback");
    owner.release_from(&mut place).unwrap();
}
