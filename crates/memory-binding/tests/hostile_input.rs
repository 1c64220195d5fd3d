//! Hostile input to every public entry point of the registry, and allocators that
//! panic in every callback kind.
//!
//! Each table row names the hostile argument, calls one entry point, asserts the typed
//! error variant, and asserts that no allocator callback touched memory (allocate,
//! release, commit, decommit, committed_bytes, create_backing, map, unmap, forget_lost),
//! counted by a `RecordingAllocator`. Nothing here may panic unless a test plans the
//! panic; after every planned panic the registry still works and its counts are exact.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use common::{Caps, HeldQueue, PAGE, register, register_with, request};
use memory_api::ReleaseSummary;
use memory_api::{
    AllocError, AllocationRequest, ByteRange, CapabilityError, DeferredReleaseQueue, DeviceAddress, DeviceAllocator,
    DeviceKey, IdentityError, IdentityIssuer, LayoutError, MappingAccess, MechanismIdentity, PreparedRelease,
    QueueRefusal, QueueRefusalReason, RawAllocation, ReleaseError, ReleaseOutcome, SharedPlacement,
};
use memory_binding::{
    AllocateError, AllocationState, BindError, BindingRegistry, BoundAllocation, BoundCapabilityError,
    BoundSharedMapping, BoundVirtualBacking, ContextState, DropPolicy, HandleError, MechanismOptions, MechanismState,
    MemoryBinding, ObjectKind, RegistryError, ViewError,
};
use memory_testkit::{CallCounts, Callback, FaultyAllocator, HostHeap, RecordingAllocator};

const GPU0: DeviceKey = DeviceKey::device(0);
const GPU1: DeviceKey = DeviceKey::device(1);

/// Callbacks that touch memory or book-keeping in an allocator (capability discovery
/// and `granularity` are queries and are counted separately).
const TOUCHING: [Callback; 9] = [
    Callback::Allocate,
    Callback::Release,
    Callback::Commit,
    Callback::Decommit,
    Callback::CommittedBytes,
    Callback::CreateBacking,
    Callback::Map,
    Callback::Unmap,
    Callback::ForgetLost,
];

type HandleCheck = fn(&HandleError) -> bool;
type CapabilityCheck<'a> = &'a dyn Fn(&CapabilityError) -> bool;
type CapabilityCall<'a> = Box<dyn Fn() -> CapabilityError + 'a>;
type QueueCheck = fn(&QueueRefusalReason) -> bool;

fn touching(counts: CallCounts) -> Vec<(Callback, u64)> {
    TOUCHING.iter().map(|&c| (c, counts[c])).collect()
}

fn catch<R>(f: impl FnOnce() -> R) -> Result<R, ()> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|_| ())
}

// ---------------------------------------------------------------------------------
// Panicking allocators
// ---------------------------------------------------------------------------------

type Faulty = RecordingAllocator<FaultyAllocator<HostHeap>>;

fn faulty(device: DeviceKey) -> Arc<Faulty> {
    Arc::new(RecordingAllocator::new(FaultyAllocator::new(HostHeap::on_device(device))))
}

fn heap_live(allocator: &Faulty) -> u64 {
    allocator.inner().inner().stats().unwrap().live_allocations
}

/// Exact counts of one mechanism: (live records, quarantined, in flight).
fn counts(registry: &BindingRegistry, mechanism: &MechanismIdentity) -> (usize, usize, usize) {
    let s = registry.snapshot(mechanism).unwrap();
    (s.live_allocations, s.quarantined.len(), s.in_flight)
}

#[test]
fn panic_in_allocate_leaves_nothing_recorded_or_in_flight() {
    let registry = BindingRegistry::new();
    let allocator = faulty(DeviceKey::HOST);
    let (_, _, mechanism) = register(&registry, allocator.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    allocator.inner().panic_on_nth(Callback::Allocate, 1);
    assert!(catch(|| binding.allocate(request(64))).is_err());
    assert_eq!(counts(&registry, &mechanism), (0, 0, 0));
    assert_eq!((allocator.in_flight(), heap_live(&allocator)), (0, 0));
    let block = binding.allocate(request(64)).unwrap();
    assert_eq!(counts(&registry, &mechanism), (1, 0, 0));
    binding.release(block).unwrap();
    assert_eq!(heap_live(&allocator), 0);
    registry.retire(&mechanism).unwrap();
    registry.remove(&mechanism).unwrap();
}

#[test]
fn panic_in_explicit_and_drop_time_release_quarantines_the_block_and_retry_frees_it() {
    let registry = BindingRegistry::new();
    let allocator = faulty(DeviceKey::HOST); // host tier: dropping releases at once
    let (_, _, mechanism) = register(&registry, allocator.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();

    let block = binding.allocate(request(64)).unwrap();
    allocator.inner().panic_on_nth(Callback::Release, 1);
    assert!(catch(|| binding.release(block)).is_err());
    assert_eq!(counts(&registry, &mechanism), (0, 1, 0));

    let block = binding.allocate(request(128)).unwrap();
    allocator.inner().panic_on_nth(Callback::Release, 1);
    assert!(catch(move || drop(block)).is_err());
    assert_eq!(counts(&registry, &mechanism), (0, 2, 0));
    let snapshot = registry.snapshot(&mechanism).unwrap();
    assert!(snapshot.quarantined.iter().all(|q| q.reason.contains("panicked")), "{:?}", snapshot.quarantined);
    assert_eq!(snapshot.quarantined_bytes(), 192);
    assert_eq!((allocator.in_flight(), heap_live(&allocator)), (0, 2));

    let retry = registry.retry_quarantined(&mechanism).unwrap();
    assert_eq!((retry.released, retry.still_quarantined), (2, 0));
    assert_eq!((counts(&registry, &mechanism), heap_live(&allocator)), ((0, 0, 0), 0));
    registry.retire(&mechanism).unwrap();
    registry.remove(&mechanism).unwrap();
}

#[test]
fn panic_in_retry_keeps_every_quarantined_block_quarantined() {
    let registry = BindingRegistry::new();
    let allocator = faulty(GPU0);
    let (_, _, mechanism) = register(&registry, allocator.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    for _ in 0..3 {
        drop(binding.allocate(request(64)).unwrap()); // device tier: quarantined on drop
    }
    assert_eq!(counts(&registry, &mechanism), (0, 3, 0));
    allocator.inner().panic_on_nth(Callback::Release, 2);
    assert!(catch(|| registry.retry_quarantined(&mechanism)).is_err());
    // One block was released before the panic; the one whose release panicked and
    // the one not yet tried are still owned by the allocator and must stay visible.
    assert_eq!(heap_live(&allocator), 2);
    assert_eq!(counts(&registry, &mechanism), (0, 2, 0), "quarantined blocks vanished from the registry");
    registry.retire(&mechanism).unwrap();
    assert!(matches!(registry.remove(&mechanism), Err(RegistryError::NotQuiescent { quarantined: 2, .. })));
}

#[test]
fn panic_in_a_queued_release_ends_its_in_flight_count() {
    let registry = BindingRegistry::new();
    let allocator = faulty(GPU0);
    let (context, _, mechanism) = register(&registry, allocator.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let queue = HeldQueue::new(GPU0, 4);
    binding.release_deferred(binding.allocate(request(64)).unwrap(), &queue).unwrap();
    assert_eq!(counts(&registry, &mechanism), (0, 0, 1));
    allocator.inner().panic_on_nth(Callback::Release, 1);
    assert!(catch(|| queue.run_all()).is_err());
    assert_eq!(allocator.in_flight(), 0);
    // The block is still owned by the allocator: it must be quarantined (or recorded),
    // and the queued release must no longer count as in flight.
    assert_eq!(heap_live(&allocator), 1);
    assert_eq!(counts(&registry, &mechanism), (0, 1, 0), "the panicked queued release is still in flight");
    registry.invalidate_device(GPU0, "reset");
    let report = registry.confirm_context_terminated(&context).expect("nothing is in flight any more");
    assert_eq!(report.discharged_quarantine, 1);
}

#[test]
fn panic_in_forget_lost_still_retires_every_mechanism_of_the_context() {
    let registry = BindingRegistry::new();
    let context = registry.register_provider_context(GPU0, Arc::new(())).unwrap();
    let authority = registry.register_authority(GPU0, Arc::new(())).unwrap();
    let first = faulty(GPU0);
    let second = faulty(GPU0);
    let m1 = registry.register_allocator(&context, &authority, first.clone()).unwrap();
    let m2 = registry.register_allocator(&context, &authority, second.clone()).unwrap();
    let b1 = registry.bind_registered(&m1).unwrap();
    let b2 = registry.bind_registered(&m2).unwrap();
    let kept = [b1.allocate(request(64)).unwrap(), b2.allocate(request(64)).unwrap()];
    registry.invalidate_device(GPU0, "reset");
    // Whichever mechanism is terminated first panics in forget_lost.
    first.inner().panic_on_nth(Callback::ForgetLost, 1);
    second.inner().panic_on_nth(Callback::ForgetLost, 1);
    assert!(catch(|| registry.confirm_context_terminated(&context)).is_err());
    let _ = catch(|| registry.confirm_context_terminated(&context));
    for mechanism in [&m1, &m2] {
        let snapshot = registry.snapshot(mechanism).unwrap();
        assert_eq!(snapshot.state, MechanismState::Terminated);
        assert_eq!(snapshot.live_allocations, 0, "a terminated mechanism still holds lost records");
    }
    drop(kept);
    registry.remove(&m1).unwrap();
    registry.remove(&m2).unwrap();
}

#[test]
fn panic_in_forget_lost_of_a_single_mechanism_leaves_exact_counts() {
    let registry = BindingRegistry::new();
    let allocator = faulty(GPU0);
    let (context, _, mechanism) = register(&registry, allocator.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let kept = binding.allocate(request(64)).unwrap();
    drop(binding.allocate(request(64)).unwrap()); // quarantined
    registry.invalidate_device(GPU0, "reset");
    allocator.inner().panic_on_nth(Callback::ForgetLost, 1);
    assert!(catch(|| registry.confirm_context_terminated(&context)).is_err());
    assert_eq!(allocator.in_flight(), 0);
    assert_eq!(counts(&registry, &mechanism), (0, 0, 0));
    assert!(registry.confirm_context_terminated(&context).unwrap().already_terminated);
    assert_eq!(binding.release(kept).unwrap_err().reason, HandleError::StaleAllocation);
    registry.remove(&mechanism).unwrap();
}

/// Capability calls that panic (discovery included) restore the in-flight count and
/// leave the allocation usable.
#[test]
fn panic_in_every_capability_callback_leaves_the_allocation_usable() {
    let registry = BindingRegistry::new();
    let allocator = Arc::new(FaultyAllocator::new(Caps::new(GPU0)));
    let (_, _, mechanism) = register(&registry, allocator.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(request(4 * PAGE)).unwrap();
    let virt = binding.virtual_backing().unwrap();
    let shared = binding.shared_mapping().unwrap();
    let backing = shared.create_backing(PAGE).unwrap();
    let page = ByteRange::new(0, PAGE);
    let placement = SharedPlacement { target: page, backing_offset: 0 };

    type Call<'a> = Box<dyn Fn() -> bool + 'a>;
    let calls: [(Callback, Call<'_>); 8] = [
        (Callback::Commit, Box::new(|| virt.commit(&block, page).is_ok())),
        (Callback::Decommit, Box::new(|| virt.decommit(&block, page).is_ok())),
        (Callback::CommittedBytes, Box::new(|| virt.committed_bytes(&block).is_ok())),
        (Callback::CreateBacking, Box::new(|| shared.create_backing(PAGE).is_ok())),
        (Callback::Map, Box::new(|| shared.map(&backing, &block, placement, MappingAccess::ReadOnly).is_ok())),
        (Callback::Unmap, Box::new(|| shared.unmap(&block, page).is_ok())),
        (Callback::VirtualBacking, Box::new(|| binding.virtual_backing().is_ok())),
        (Callback::SharedMapping, Box::new(|| binding.shared_mapping().is_ok())),
    ];
    for (callback, call) in &calls {
        allocator.panic_on_nth(*callback, 1);
        assert!(catch(call).is_err(), "{callback}: the planned panic did not fire");
        assert_eq!(allocator.pending(), 0);
        assert_eq!(counts(&registry, &mechanism), (1, 0, 0), "{callback}");
        assert!(call(), "{callback}: the call fails after a panic");
        assert!(block.is_valid());
    }
    drop(calls);
    binding.release(block).unwrap();
    assert_eq!(counts(&registry, &mechanism), (0, 0, 0));
    registry.retire(&mechanism).unwrap();
    registry.remove(&mechanism).unwrap();
}

/// A deferred-release queue whose `enqueue` panics.
struct PanickingQueue(DeviceKey);

impl DeferredReleaseQueue for PanickingQueue {
    fn device(&self) -> DeviceKey {
        self.0
    }
    fn enqueue(&self, _release: PreparedRelease) -> Result<(), QueueRefusal> {
        panic!("queue exploded")
    }
}

#[test]
fn panic_in_a_queue_quarantines_the_block_and_ends_its_in_flight_count() {
    let registry = BindingRegistry::new();
    let allocator = faulty(GPU0);
    let queue = Arc::new(PanickingQueue(GPU0));
    let options = MechanismOptions::default().with_drop_policy(Some(DropPolicy::Defer(queue.clone())));
    let (context, _, mechanism) = register_with(&registry, allocator.clone(), options);
    let binding = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(request(64)).unwrap();
    assert!(catch(|| binding.release_deferred(block, &*queue)).is_err());
    assert_eq!(counts(&registry, &mechanism), (0, 1, 0));
    let block = binding.allocate(request(64)).unwrap();
    assert!(catch(move || drop(block)).is_err()); // drop policy defers to the same queue
    assert_eq!(counts(&registry, &mechanism), (0, 2, 0));
    assert_eq!(allocator.calls(Callback::Release), 0, "nothing was released");
    registry.invalidate_device(GPU0, "reset");
    assert_eq!(registry.confirm_context_terminated(&context).unwrap().discharged_quarantine, 2);
}

// ---------------------------------------------------------------------------------
// Hostile arguments
// ---------------------------------------------------------------------------------

type Rec = RecordingAllocator<Caps>;

/// A recording allocator with both capabilities (bookkeeping only, no memory).
fn rec(device: DeviceKey) -> Arc<Rec> {
    Arc::new(RecordingAllocator::new(Caps::new(device)))
}

/// Runs `f` and asserts that none of `recorders` saw a memory-touching callback.
fn untouched<R>(what: &str, recorders: &[&Rec], f: impl FnOnce() -> R) -> R {
    let before: Vec<_> = recorders.iter().map(|r| touching(r.counts())).collect();
    let out = f();
    let after: Vec<_> = recorders.iter().map(|r| touching(r.counts())).collect();
    assert_eq!(before, after, "{what}: a refused call reached an allocator");
    out
}

/// Refuses alignments above `max` the way a real backend does, then delegates.
struct MaxAlign<A> {
    inner: A,
    max: usize,
}

impl<A: DeviceAllocator> DeviceAllocator for MaxAlign<A> {
    fn device(&self) -> DeviceKey {
        self.inner.device()
    }
    fn name(&self) -> &str {
        "max-align"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        if request.align() > self.max {
            let (align, max, device) = (request.align(), self.max, self.device());
            return Err(AllocError::Layout(LayoutError::AlignmentTooLarge { align, max, device }));
        }
        self.inner.allocate(request)
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.inner.release(allocation)
    }
    fn stats(&self) -> Option<memory_api::AllocatorStats> {
        self.inner.stats()
    }
}

#[derive(Debug)]
enum Request {
    /// `AllocationRequest::new` refuses it; the registry is never asked.
    Layout(fn(&LayoutError) -> bool),
    /// The allocator is asked once and refuses with this error.
    Refused(fn(&AllocError) -> bool),
    Allocated,
}

#[test]
#[cfg_attr(miri, ignore = "allocates multi-MiB zeroed blocks: about 3 minutes under Miri")]
fn hostile_sizes_and_alignments_are_typed_errors_and_refusals_leave_nothing_behind() {
    let not_pow2: fn(&LayoutError) -> bool = |e| matches!(e, LayoutError::AlignmentNotPowerOfTwo { .. });
    let overflow: fn(&LayoutError) -> bool = |e| matches!(e, LayoutError::SizeOverflow { .. });
    let too_aligned: fn(&AllocError) -> bool =
        |e| matches!(e, AllocError::Layout(LayoutError::AlignmentTooLarge { .. }));
    let oom: fn(&AllocError) -> bool = |e| matches!(e, AllocError::OutOfMemory { .. });
    let max = AllocationRequest::MAX_BYTES;
    let table: [(&str, usize, usize, Request); 17] = [
        ("zero alignment", 64, 0, Request::Layout(not_pow2)),
        ("alignment 3", 64, 3, Request::Layout(not_pow2)),
        ("alignment 48", 64, 48, Request::Layout(not_pow2)),
        ("alignment usize::MAX", 64, usize::MAX, Request::Layout(not_pow2)),
        ("size usize::MAX", usize::MAX, 1, Request::Layout(overflow)),
        ("size one past isize::MAX", max + 1, 1, Request::Layout(overflow)),
        ("size that overflows when rounded up", usize::MAX - 10, 4096, Request::Layout(overflow)),
        ("isize::MAX rounded past the maximum", max, 2, Request::Layout(overflow)),
        ("one byte at alignment 2^63", 1, 1 << 63, Request::Layout(overflow)),
        ("zero bytes at alignment 2^62", 0, 1 << 62, Request::Refused(too_aligned)),
        ("alignment above the allocator's maximum", 64, 1 << 20, Request::Refused(too_aligned)),
        ("the largest valid size", max, 1, Request::Refused(oom)),
        ("over the heap's limit", (1 << 20) + 1, 64, Request::Refused(oom)),
        ("zero bytes", 0, 1, Request::Allocated),
        ("one byte", 1, 1, Request::Allocated),
        ("one byte at the largest supported alignment", 1, 1 << 16, Request::Allocated),
        ("exactly the heap's limit", 1 << 20, 64, Request::Allocated),
    ];
    let registry = BindingRegistry::new();
    let heap = MaxAlign { inner: HostHeap::on_device(DeviceKey::HOST).with_limit(1 << 20), max: 1 << 16 };
    let recorder = Arc::new(RecordingAllocator::new(heap));
    let (_, _, mechanism) = register(&registry, recorder.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    for (what, bytes, align, expected) in table {
        let before = recorder.counts();
        match (AllocationRequest::new(bytes, align), &expected) {
            (Err(error), Request::Layout(matches)) => assert!(matches(&error), "{what}: {error}"),
            (Ok(request), Request::Refused(matches)) => match binding.allocate(request) {
                Err(AllocateError::Allocator(error)) => {
                    assert!(matches(&error), "{what}: {error}");
                    assert_eq!(recorder.calls(Callback::Allocate), before[Callback::Allocate] + 1, "{what}");
                    assert_eq!(recorder.calls(Callback::Release), before[Callback::Release], "{what}");
                }
                other => panic!("{what}: expected the allocator's refusal, got {other:?}"),
            },
            (Ok(request), Request::Allocated) => {
                let block = binding.allocate(request).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(block.bytes(), bytes, "{what}");
                assert!(block.address().is_aligned_to(align), "{what}");
                assert!(matches!(block.view(bytes, 1), Err(ViewError::OutOfBounds { .. })), "{what}");
                assert_eq!(binding.release(block).unwrap(), ReleaseSummary::Complete { unmapped_bytes: bytes });
            }
            (result, expected) => panic!("{what}: request {result:?}, expected {expected:?}"),
        }
        let snapshot = registry.snapshot(&mechanism).unwrap();
        assert_eq!((snapshot.live_allocations, snapshot.quarantined.len(), snapshot.in_flight), (0, 0, 0), "{what}");
        assert_eq!(recorder.inner().inner.stats().unwrap().live_allocations, 0, "{what}: a block leaked");
    }
}

#[test]
fn hostile_view_ranges_are_out_of_bounds_errors_naming_the_range() {
    let registry = BindingRegistry::new();
    let recorder = rec(GPU0);
    let (_, _, mechanism) = register(&registry, recorder.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(request(100)).unwrap();
    let table: [(usize, usize, bool); 12] = [
        (0, 100, true),
        (100, 0, true),
        (99, 1, true),
        (0, 101, false),
        (100, 1, false),
        (101, 0, false),
        (50, 51, false),
        (usize::MAX, 0, false),
        (usize::MAX, 1, false),
        (1, usize::MAX, false),
        (usize::MAX, usize::MAX, false),
        (usize::MAX - 50, 100, false),
    ];
    for (offset, len, fits) in table {
        let result = untouched("view", &[&recorder], || block.view(offset, len).map(|v| (v.address(), v.len())));
        match result {
            Ok((address, got)) if fits => {
                assert_eq!((address.get(), got), (block.address().get() + offset as u64, len));
            }
            Err(ViewError::OutOfBounds { offset: o, len: l, allocation_bytes: 100 }) if !fits => {
                assert_eq!((o, l), (offset, len));
            }
            other => panic!("view({offset}, {len}): {other:?}"),
        }
    }
    binding.release(block).unwrap();
}

/// Hands out one block that ends at the very top of the address space.
struct TopOfAddressSpace;

impl DeviceAllocator for TopOfAddressSpace {
    fn device(&self) -> DeviceKey {
        GPU0
    }
    fn name(&self) -> &str {
        "top"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let address = DeviceAddress::new(u64::MAX - 4095).unwrap();
        Ok(RawAllocation::new(address, request.bytes(), request.align(), GPU0, 0))
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        ReleaseOutcome::complete(allocation.bytes())
    }
}

#[test]
fn a_view_whose_address_would_wrap_is_out_of_bounds_not_a_panic() {
    let registry = BindingRegistry::new();
    let binding = registry.with_memory(Arc::new(TopOfAddressSpace)).unwrap();
    // The allocator claims 8192 bytes from 4096 below the top: the second page wraps.
    let block = binding.allocate(request(8192)).unwrap();
    assert_eq!(block.view(4095, 1).unwrap().address().get(), u64::MAX);
    assert!(matches!(block.view(4096, 1), Err(ViewError::OutOfBounds { offset: 4096, .. })));
    binding.release(block).unwrap();
}

/// The entry points that take an allocation handle together with a binding.
#[derive(Copy, Clone, Debug)]
enum Entry {
    Release,
    ReleaseFrom,
    ReleaseDeferred,
    View,
    Commit,
    Decommit,
    CommittedBytes,
    Map,
    Unmap,
}

const ENTRIES: [Entry; 9] = [
    Entry::Release,
    Entry::ReleaseFrom,
    Entry::ReleaseDeferred,
    Entry::View,
    Entry::Commit,
    Entry::Decommit,
    Entry::CommittedBytes,
    Entry::Map,
    Entry::Unmap,
];

/// A binding plus what its handle calls need: a backing and a queue of its device.
struct Caller {
    binding: MemoryBinding,
    virt: BoundVirtualBacking,
    shared: BoundSharedMapping,
    backing: memory_api::SharedBacking,
    queue: HeldQueue,
}

impl Caller {
    fn new(binding: MemoryBinding) -> Caller {
        let virt = binding.virtual_backing().unwrap();
        let shared = binding.shared_mapping().unwrap();
        let backing = shared.create_backing(PAGE).unwrap();
        let queue = HeldQueue::new(binding.device(), 4);
        Caller { binding, virt, shared, backing, queue }
    }

    /// Calls `entry` on `handle`; returns the handle error and the handle (which every
    /// refused call must give back or leave borrowed).
    fn call(&self, entry: Entry, handle: BoundAllocation) -> (HandleError, BoundAllocation) {
        let page = ByteRange::new(0, PAGE);
        let capability = |result: Result<usize, BoundCapabilityError>| match result {
            Err(BoundCapabilityError::Handle(e)) => e,
            other => panic!("{entry:?}: expected a handle error, got {other:?}"),
        };
        let binding = &self.binding;
        match entry {
            Entry::Release => match binding.release(handle) {
                Err(rejected) => (rejected.reason, rejected.handle),
                Ok(report) => panic!("release accepted a hostile handle: {report:?}"),
            },
            Entry::ReleaseFrom => {
                let mut place = Some(handle);
                match binding.release_from(&mut place) {
                    Err(reason) => (reason, place.expect("a refused release_from leaves the handle in place")),
                    Ok(report) => panic!("release_from accepted a hostile handle: {report:?}"),
                }
            }
            Entry::ReleaseDeferred => match binding.release_deferred(handle, &self.queue) {
                Err(rejected) => (rejected.reason, rejected.handle),
                Ok(()) => panic!("release_deferred accepted a hostile handle"),
            },
            Entry::View => match handle.view(0, 1).map(|v| v.len()) {
                Err(ViewError::Handle(e)) => (e, handle),
                other => panic!("view: expected a handle error, got {other:?}"),
            },
            Entry::Commit => (capability(self.virt.commit(&handle, page)), handle),
            Entry::Decommit => (capability(self.virt.decommit(&handle, page)), handle),
            Entry::CommittedBytes => (capability(self.virt.committed_bytes(&handle)), handle),
            Entry::Map => {
                let placement = SharedPlacement { target: page, backing_offset: 0 };
                let result = self.shared.map(&self.backing, &handle, placement, MappingAccess::ReadWrite).map(|()| 0);
                (capability(result), handle)
            }
            Entry::Unmap => (capability(self.shared.unmap(&handle, page)), handle),
        }
    }
}

#[test]
fn handles_of_another_registry_or_binding_are_refused_by_every_entry_point_before_any_callback() {
    let registry = BindingRegistry::new();
    let other_registry = BindingRegistry::new();
    let (a, b, c, d, f) = (rec(GPU0), rec(GPU0), rec(GPU1), rec(GPU0), rec(GPU0));
    let (context, _, ma) = register(&registry, a.clone());
    let (_, _, mb) = register(&registry, b.clone());
    let (_, _, mc) = register(&registry, c.clone());
    let other_authority = registry.register_authority(GPU0, Arc::new(())).unwrap();
    let md = registry.register_allocator(&context, &other_authority, d.clone()).unwrap();
    let (_, _, mf) = register(&other_registry, f.clone());
    let recorders = [&*a, &*b, &*c, &*d, &*f];

    let owner = registry.bind_registered(&ma).unwrap();
    let foreign_owner = other_registry.bind_registered(&mf).unwrap();
    // handles[0] is ours (made by `owner`), handles[1] the other registry's.
    let mut handles =
        [Some(owner.allocate(request(PAGE)).unwrap()), Some(foreign_owner.allocate(request(PAGE)).unwrap())];
    let mismatch: fn(&HandleError) -> bool = |e| matches!(e, HandleError::BindingMismatch { .. });
    let foreign: fn(&HandleError) -> bool = |e| matches!(e, HandleError::ForeignRegistry { .. });
    let table: [(&str, Caller, usize, HandleCheck); 6] = [
        ("another binding of the same mechanism", Caller::new(registry.bind_registered(&ma).unwrap()), 0, mismatch),
        ("a binding of another mechanism", Caller::new(registry.bind_registered(&mb).unwrap()), 0, mismatch),
        ("a binding on another device", Caller::new(registry.bind_registered(&mc).unwrap()), 0, mismatch),
        ("a binding under another authority", Caller::new(registry.bind_registered(&md).unwrap()), 0, mismatch),
        ("a binding of another registry", Caller::new(foreign_owner.clone()), 0, foreign),
        ("our binding, another registry's handle", Caller::new(owner.clone()), 1, foreign),
    ];
    for (what, caller, which, expected) in &table {
        // A view takes no binding: only the owner-independent rows are not about it.
        for entry in ENTRIES.into_iter().filter(|e| !matches!(e, Entry::View)) {
            let held = handles[*which].take().unwrap();
            let identity = held.identity();
            let (reason, back) = untouched(what, &recorders, || caller.call(entry, held));
            assert!(expected(&reason), "{what}, {entry:?}: {reason}");
            assert_eq!(back.identity(), identity, "{what}, {entry:?}: the handle came back changed");
            assert!(back.is_valid(), "{what}, {entry:?}");
            handles[*which] = Some(back);
        }
    }
    assert_eq!(registry.snapshot(&ma).unwrap().in_flight, 0);
    owner.release(handles[0].take().unwrap()).unwrap();
    foreign_owner.release(handles[1].take().unwrap()).unwrap();
    assert_eq!((a.calls(Callback::Release), f.calls(Callback::Release)), (1, 1));
}

#[test]
fn refused_capability_calls_make_no_allocator_call_at_all() {
    let registry = BindingRegistry::new();
    let (owner_allocator, other_allocator) = (rec(GPU0), rec(GPU0));
    let (_, _, mine) = register(&registry, owner_allocator.clone());
    let (_, _, other) = register(&registry, other_allocator.clone());
    let owner = registry.bind_registered(&mine).unwrap();
    let mut block = owner.allocate(request(PAGE)).unwrap();
    let caller = Caller::new(registry.bind_registered(&other).unwrap());
    for entry in [Entry::Commit, Entry::Decommit, Entry::CommittedBytes, Entry::Map, Entry::Unmap] {
        let before = other_allocator.counts();
        let (reason, back) = caller.call(entry, block);
        block = back;
        assert!(matches!(reason, HandleError::BindingMismatch { .. }), "{entry:?}: {reason}");
        // docs/LIFECYCLE.md: a cross-binding handle is rejected before the
        // allocator or a capability is called, capability discovery included.
        assert_eq!(other_allocator.counts(), before, "{entry:?} called the other allocator before rejecting");
    }
    owner.release(block).unwrap();
}

/// What a refused cold-path call returned.
#[derive(Debug)]
enum Refusal {
    Registry(RegistryError),
    Bind(BindError),
    State(AllocationState),
}

/// One cold-path call with a hostile identity or state, and the refusal it must give.
type ColdRow<'a> = (&'a str, Box<dyn Fn() -> Result<(), Refusal> + 'a>, fn(&Refusal) -> bool);

fn registry_error(result: Result<impl Sized, RegistryError>) -> Result<(), Refusal> {
    result.map(drop).map_err(Refusal::Registry)
}

fn bind_error(result: Result<MemoryBinding, BindError>) -> Result<(), Refusal> {
    result.map(drop).map_err(Refusal::Bind)
}

#[test]
#[cfg_attr(miri, ignore = "large table of cold-path calls: about 2 minutes under Miri")]
fn foreign_unknown_and_wrong_state_identities_are_refused_by_every_cold_path_entry_point() {
    let registry = BindingRegistry::new();
    let other = BindingRegistry::new();
    let live = rec(GPU0);
    let (context, authority, mechanism) = register(&registry, live.clone());
    let retired = registry.register_allocator(&context, &authority, rec(GPU0)).unwrap();
    registry.retire(&retired).unwrap();
    let removed = registry.register_allocator(&context, &authority, rec(GPU0)).unwrap();
    registry.retire(&removed).unwrap();
    registry.remove(&removed).unwrap();
    let removed_context = registry.register_provider_context(GPU0, Arc::new(())).unwrap();
    registry.remove_provider_context(&removed_context).unwrap();
    let removed_authority = registry.register_authority(GPU0, Arc::new(())).unwrap();
    registry.remove_authority(&removed_authority).unwrap();
    let gpu1_authority = registry.register_authority(GPU1, Arc::new(())).unwrap();
    let lost_allocator = rec(GPU1);
    let (lost_context, lost_authority, lost) = register(&registry, lost_allocator.clone());
    registry.invalidate_device(GPU1, "hostile test");
    let host2 = DeviceKey::host(2);
    let (dead_context, dead_authority, _) = register(&registry, rec(host2));
    registry.invalidate_device(host2, "hostile test");
    registry.confirm_context_terminated(&dead_context).unwrap();
    let foreign_allocator = rec(GPU0);
    let (foreign_context, foreign_authority, foreign) = register(&other, foreign_allocator.clone());
    let foreign_allocation =
        other.bind_registered(&foreign).unwrap().allocate(request(64)).unwrap().identity().unwrap();

    let table: Vec<ColdRow<'_>> = vec![
        (
            "register_allocator, foreign context",
            Box::new(|| registry_error(registry.register_allocator(&foreign_context, &authority, rec(GPU0)))),
            |e| {
                matches!(e, Refusal::Registry(RegistryError::ForeignRegistry { kind: ObjectKind::ProviderContext, .. }))
            },
        ),
        (
            "register_allocator, foreign authority",
            Box::new(|| registry_error(registry.register_allocator(&context, &foreign_authority, rec(GPU0)))),
            |e| matches!(e, Refusal::Registry(RegistryError::ForeignRegistry { kind: ObjectKind::Authority, .. })),
        ),
        (
            "register_allocator, removed context",
            Box::new(|| registry_error(registry.register_allocator(&removed_context, &authority, rec(GPU0)))),
            |e| matches!(e, Refusal::Registry(RegistryError::Unknown { kind: ObjectKind::ProviderContext, .. })),
        ),
        (
            "register_allocator, removed authority",
            Box::new(|| registry_error(registry.register_allocator(&context, &removed_authority, rec(GPU0)))),
            |e| matches!(e, Refusal::Registry(RegistryError::Unknown { kind: ObjectKind::Authority, .. })),
        ),
        (
            "register_allocator, authority on another device",
            Box::new(|| registry_error(registry.register_allocator(&context, &gpu1_authority, rec(GPU0)))),
            |e| matches!(e, Refusal::Registry(RegistryError::DeviceMismatch { what: "authority", .. })),
        ),
        (
            "register_allocator, allocator on another device",
            Box::new(|| registry_error(registry.register_allocator(&context, &authority, rec(GPU1)))),
            |e| matches!(e, Refusal::Registry(RegistryError::DeviceMismatch { what: "allocator", .. })),
        ),
        (
            "register_allocator, allocator on device u32::MAX",
            Box::new(|| {
                registry_error(registry.register_allocator(&context, &authority, rec(DeviceKey::device(u32::MAX))))
            }),
            |e| matches!(e, Refusal::Registry(RegistryError::DeviceMismatch { what: "allocator", .. })),
        ),
        (
            "register_allocator, lost context",
            Box::new(|| registry_error(registry.register_allocator(&lost_context, &lost_authority, rec(GPU1)))),
            |e| matches!(e, Refusal::Registry(RegistryError::ContextNotLive { state: ContextState::Lost, .. })),
        ),
        (
            "register_allocator, terminated context",
            Box::new(|| registry_error(registry.register_allocator(&dead_context, &dead_authority, rec(host2)))),
            |e| matches!(e, Refusal::Registry(RegistryError::ContextNotLive { state: ContextState::Terminated, .. })),
        ),
        ("select, foreign mechanism", Box::new(|| registry_error(registry.select(&foreign))), |e| {
            matches!(e, Refusal::Registry(RegistryError::ForeignRegistry { kind: ObjectKind::Mechanism, .. }))
        }),
        ("select, removed mechanism", Box::new(|| registry_error(registry.select(&removed))), |e| {
            matches!(e, Refusal::Registry(RegistryError::Unknown { kind: ObjectKind::Mechanism, .. }))
        }),
        ("select, retired mechanism", Box::new(|| registry_error(registry.select(&retired))), |e| {
            matches!(e, Refusal::Registry(RegistryError::InvalidState { state: MechanismState::Retired, .. }))
        }),
        ("select, lost mechanism", Box::new(|| registry_error(registry.select(&lost))), |e| {
            matches!(e, Refusal::Registry(RegistryError::InvalidState { state: MechanismState::DeviceLost, .. }))
        }),
        ("bind, device without selection", Box::new(|| bind_error(registry.bind(GPU1))), |e| {
            matches!(e, Refusal::Bind(BindError::NoSelection { .. }))
        }),
        ("bind, device never seen", Box::new(|| bind_error(registry.bind(DeviceKey::disk(u32::MAX)))), |e| {
            matches!(e, Refusal::Bind(BindError::NoSelection { .. }))
        }),
        ("bind_registered, foreign mechanism", Box::new(|| bind_error(registry.bind_registered(&foreign))), |e| {
            matches!(
                e,
                Refusal::Bind(BindError::Registry(RegistryError::ForeignRegistry { kind: ObjectKind::Mechanism, .. }))
            )
        }),
        ("bind_registered, removed mechanism", Box::new(|| bind_error(registry.bind_registered(&removed))), |e| {
            matches!(e, Refusal::Bind(BindError::Registry(RegistryError::Unknown { kind: ObjectKind::Mechanism, .. })))
        }),
        ("bind_registered, retired mechanism", Box::new(|| bind_error(registry.bind_registered(&retired))), |e| {
            matches!(e, Refusal::Bind(BindError::Inactive { state: MechanismState::Retired, .. }))
        }),
        ("bind_registered, lost mechanism", Box::new(|| bind_error(registry.bind_registered(&lost))), |e| {
            matches!(e, Refusal::Bind(BindError::Inactive { state: MechanismState::DeviceLost, .. }))
        }),
        ("retire, foreign mechanism", Box::new(|| registry_error(registry.retire(&foreign))), |e| {
            matches!(e, Refusal::Registry(RegistryError::ForeignRegistry { kind: ObjectKind::Mechanism, .. }))
        }),
        ("retire, removed mechanism", Box::new(|| registry_error(registry.retire(&removed))), |e| {
            matches!(e, Refusal::Registry(RegistryError::Unknown { kind: ObjectKind::Mechanism, .. }))
        }),
        ("retire, retired mechanism", Box::new(|| registry_error(registry.retire(&retired))), |e| {
            matches!(e, Refusal::Registry(RegistryError::InvalidState { state: MechanismState::Retired, .. }))
        }),
        ("retire, lost mechanism", Box::new(|| registry_error(registry.retire(&lost))), |e| {
            matches!(e, Refusal::Registry(RegistryError::InvalidState { state: MechanismState::DeviceLost, .. }))
        }),
        (
            "confirm, foreign context",
            Box::new(|| registry_error(registry.confirm_context_terminated(&foreign_context))),
            |e| {
                matches!(e, Refusal::Registry(RegistryError::ForeignRegistry { kind: ObjectKind::ProviderContext, .. }))
            },
        ),
        (
            "confirm, removed context",
            Box::new(|| registry_error(registry.confirm_context_terminated(&removed_context))),
            |e| matches!(e, Refusal::Registry(RegistryError::Unknown { kind: ObjectKind::ProviderContext, .. })),
        ),
        ("confirm, live context", Box::new(|| registry_error(registry.confirm_context_terminated(&context))), |e| {
            matches!(e, Refusal::Registry(RegistryError::ContextStillLive { .. }))
        }),
        ("retry, foreign mechanism", Box::new(|| registry_error(registry.retry_quarantined(&foreign))), |e| {
            matches!(e, Refusal::Registry(RegistryError::ForeignRegistry { kind: ObjectKind::Mechanism, .. }))
        }),
        ("retry, removed mechanism", Box::new(|| registry_error(registry.retry_quarantined(&removed))), |e| {
            matches!(e, Refusal::Registry(RegistryError::Unknown { kind: ObjectKind::Mechanism, .. }))
        }),
        ("retry, lost mechanism", Box::new(|| registry_error(registry.retry_quarantined(&lost))), |e| {
            matches!(e, Refusal::Registry(RegistryError::InvalidState { state: MechanismState::DeviceLost, .. }))
        }),
        ("remove, foreign mechanism", Box::new(|| registry_error(registry.remove(&foreign))), |e| {
            matches!(e, Refusal::Registry(RegistryError::ForeignRegistry { kind: ObjectKind::Mechanism, .. }))
        }),
        ("remove, removed mechanism", Box::new(|| registry_error(registry.remove(&removed))), |e| {
            matches!(e, Refusal::Registry(RegistryError::Unknown { kind: ObjectKind::Mechanism, .. }))
        }),
        ("remove, active mechanism", Box::new(|| registry_error(registry.remove(&mechanism))), |e| {
            matches!(e, Refusal::Registry(RegistryError::InvalidState { state: MechanismState::Active, .. }))
        }),
        ("remove, lost mechanism", Box::new(|| registry_error(registry.remove(&lost))), |e| {
            matches!(e, Refusal::Registry(RegistryError::InvalidState { state: MechanismState::DeviceLost, .. }))
        }),
        (
            "remove_provider_context, foreign",
            Box::new(|| registry_error(registry.remove_provider_context(&foreign_context))),
            |e| {
                matches!(e, Refusal::Registry(RegistryError::ForeignRegistry { kind: ObjectKind::ProviderContext, .. }))
            },
        ),
        (
            "remove_provider_context, removed",
            Box::new(|| registry_error(registry.remove_provider_context(&removed_context))),
            |e| matches!(e, Refusal::Registry(RegistryError::Unknown { kind: ObjectKind::ProviderContext, .. })),
        ),
        (
            "remove_provider_context, with mechanisms",
            Box::new(|| registry_error(registry.remove_provider_context(&context))),
            |e| {
                matches!(
                    e,
                    Refusal::Registry(RegistryError::NotQuiescent {
                        kind: ObjectKind::ProviderContext,
                        dependents: 2,
                        ..
                    })
                )
            },
        ),
        (
            "remove_authority, foreign",
            Box::new(|| registry_error(registry.remove_authority(&foreign_authority))),
            |e| matches!(e, Refusal::Registry(RegistryError::ForeignRegistry { kind: ObjectKind::Authority, .. })),
        ),
        (
            "remove_authority, removed",
            Box::new(|| registry_error(registry.remove_authority(&removed_authority))),
            |e| matches!(e, Refusal::Registry(RegistryError::Unknown { kind: ObjectKind::Authority, .. })),
        ),
        (
            "remove_authority, with mechanisms",
            Box::new(|| registry_error(registry.remove_authority(&authority))),
            |e| {
                matches!(
                    e,
                    Refusal::Registry(RegistryError::NotQuiescent { kind: ObjectKind::Authority, dependents: 2, .. })
                )
            },
        ),
        ("snapshot, foreign mechanism", Box::new(|| registry_error(registry.snapshot(&foreign))), |e| {
            matches!(e, Refusal::Registry(RegistryError::ForeignRegistry { kind: ObjectKind::Mechanism, .. }))
        }),
        ("snapshot, removed mechanism", Box::new(|| registry_error(registry.snapshot(&removed))), |e| {
            matches!(e, Refusal::Registry(RegistryError::Unknown { kind: ObjectKind::Mechanism, .. }))
        }),
        (
            "allocation_state, foreign allocation",
            Box::new(|| match registry.allocation_state(&foreign_allocation) {
                AllocationState::Gone => Err(Refusal::State(AllocationState::Gone)),
                other => panic!("a foreign allocation's state is {other:?}"),
            }),
            |e| matches!(e, Refusal::State(AllocationState::Gone)),
        ),
    ];
    let recorders = [&*live, &*lost_allocator, &*foreign_allocator];
    for (what, call, expected) in &table {
        let before = registry.snapshots();
        let result = untouched(what, &recorders, call);
        match result {
            Err(error) => assert!(expected(&error), "{what}: unexpected refusal {error:?}"),
            Ok(()) => panic!("{what}: accepted"),
        }
        assert_eq!(registry.snapshots(), before, "{what}: a refused call changed the registry");
    }
    // Invalidating a device nothing lives on is a no-op, not an error.
    let report = untouched("invalidate", &recorders, || registry.invalidate_device(DeviceKey::disk(9), "nothing"));
    assert_eq!((report.mechanisms, report.contexts, report.selection_dropped), (0, 0, false));
}

#[test]
fn handles_after_device_loss_and_after_termination_are_refused_by_every_entry_point_without_callbacks() {
    let registry = BindingRegistry::new();
    let allocator = rec(GPU0);
    let (context, _, mechanism) = register(&registry, allocator.clone());
    let owner = Caller::new(registry.bind_registered(&mechanism).unwrap());
    let mut block = owner.binding.allocate(request(PAGE)).unwrap();
    let identity = block.identity().unwrap();
    let survivor = owner.binding.allocate(request(PAGE)).unwrap();
    registry.invalidate_device(GPU0, "Xid 79");
    let lost = |e: &HandleError| matches!(e, HandleError::DeviceLost { reason, .. } if reason == "Xid 79");
    let stale = |e: &HandleError| matches!(e, HandleError::StaleAllocation);
    for (phase, expected) in
        [("after device loss", &lost as &dyn Fn(&HandleError) -> bool), ("after termination", &stale)]
    {
        if phase == "after termination" {
            let report = registry.confirm_context_terminated(&context).unwrap();
            assert_eq!(report.lost_allocations, 2);
        }
        for entry in ENTRIES {
            let (reason, back) = untouched(phase, &[&allocator], || owner.call(entry, block));
            assert!(expected(&reason), "{phase}, {entry:?}: {reason}");
            assert_eq!(back.identity(), Some(identity), "{phase}, {entry:?}");
            block = back;
        }
        let allocate = untouched(phase, &[&allocator], || owner.binding.allocate(request(64)));
        assert!(matches!(allocate, Err(AllocateError::DeviceLost { .. })), "{phase}: {allocate:?}");
        let backing = untouched(phase, &[&allocator], || owner.shared.create_backing(PAGE));
        let refused = match backing {
            Err(BoundCapabilityError::Handle(reason)) => reason,
            other => panic!("{phase}: create_backing gave {other:?}"),
        };
        // No allocation is involved: a terminated mechanism is reported as such.
        let terminated = |e: &HandleError| matches!(e, HandleError::Inactive { state: MechanismState::Terminated, .. });
        assert!(if phase == "after termination" { terminated(&refused) } else { lost(&refused) }, "{phase}: {refused}");
    }
    assert!(!block.is_valid());
    assert_eq!(registry.allocation_state(&identity), AllocationState::Gone);
    untouched("dropping handles after termination", &[&allocator], || drop((block, survivor)));
    assert_eq!(allocator.counts()[Callback::ForgetLost], 1);
    assert_eq!(allocator.forgotten_blocks(), 2);
}

#[test]
fn a_released_identity_never_validates_again_even_when_the_address_is_reused() {
    let registry = BindingRegistry::new();
    let binding = registry.with_memory(Arc::new(Caps::reusing(GPU0, 0x7000_0000))).unwrap();
    let first = binding.allocate(request(64)).unwrap();
    let old = first.identity().unwrap();
    binding.release(first).unwrap();
    for _ in 0..3 {
        let again = binding.allocate(request(64)).unwrap();
        assert_eq!(again.address().get(), 0x7000_0000);
        assert_ne!(again.identity().unwrap().generation(), old.generation());
        assert_eq!(registry.allocation_state(&old), AllocationState::Gone);
        binding.release(again).unwrap();
    }
}

#[test]
fn hostile_capability_ranges_are_refused_before_the_capability_runs() {
    let registry = BindingRegistry::new();
    let allocator = rec(GPU0);
    let (_, _, mechanism) = register(&registry, allocator.clone());
    let caller = Caller::new(registry.bind_registered(&mechanism).unwrap());
    let block = caller.binding.allocate(request(4 * PAGE)).unwrap();
    let out = |e: &CapabilityError| matches!(e, CapabilityError::OutOfBounds { .. });
    let misaligned = |e: &CapabilityError| matches!(e, CapabilityError::Misaligned { .. });
    let ranges: [(&str, ByteRange, CapabilityCheck<'_>); 9] = [
        ("offset usize::MAX", ByteRange::new(usize::MAX, 1), &out),
        ("length usize::MAX", ByteRange::new(1, usize::MAX), &out),
        ("page-aligned range whose end overflows", ByteRange::new(usize::MAX - PAGE + 1, PAGE), &out),
        ("both usize::MAX", ByteRange::new(usize::MAX, usize::MAX), &out),
        ("one page past the end", ByteRange::new(4 * PAGE, PAGE), &out),
        ("longer than the block", ByteRange::new(0, 5 * PAGE), &out),
        ("misaligned offset", ByteRange::new(100, PAGE), &misaligned),
        ("misaligned length", ByteRange::new(0, 100), &misaligned),
        ("misaligned length at the end", ByteRange::new(3 * PAGE, PAGE - 1), &misaligned),
    ];
    let capability = |result: Result<usize, BoundCapabilityError>| match result {
        Err(BoundCapabilityError::Capability(e)) => e,
        other => panic!("expected a capability error, got {other:?}"),
    };
    for (what, range, expected) in &ranges {
        let placement = SharedPlacement { target: *range, backing_offset: 0 };
        let calls: [(&str, CapabilityCall<'_>); 4] = [
            ("commit", Box::new(|| capability(caller.virt.commit(&block, *range)))),
            ("decommit", Box::new(|| capability(caller.virt.decommit(&block, *range)))),
            ("unmap", Box::new(|| capability(caller.shared.unmap(&block, *range)))),
            (
                "map",
                Box::new(|| {
                    let big = caller.shared.create_backing(8 * PAGE).unwrap();
                    let result = caller.shared.map(&big, &block, placement, MappingAccess::ReadWrite);
                    capability(result.map(|()| 0))
                }),
            ),
        ];
        for (name, call) in &calls {
            let before = touching(allocator.counts());
            let error = call();
            let mut after = touching(allocator.counts());
            if *name == "map" {
                after.iter_mut().filter(|(c, _)| *c == Callback::CreateBacking).for_each(|(_, n)| *n -= 1);
            }
            // `map` checks the backing side (offset 0, same length, 8 pages) first.
            let source = ByteRange::new(0, range.len());
            match source.check_within_backing(8 * PAGE).and_then(|()| source.check_aligned(PAGE)) {
                Err(source_error) if *name == "map" => assert_eq!(error, source_error, "{name}, {what}"),
                _ => assert!(expected(&error), "{name}, {what}: {error}"),
            }
            assert_eq!(before, after, "{name}, {what}: the capability ran");
        }
    }
    // The backing side of a placement, and backings themselves.
    let backing = caller.shared.create_backing(PAGE).unwrap();
    let two_pages = caller.shared.create_backing(2 * PAGE).unwrap();
    let elsewhere = Caller::new(registry.with_memory(rec(GPU1)).unwrap());
    let foreign_backing = elsewhere.shared.create_backing(PAGE).unwrap();
    let page = ByteRange::new(0, PAGE);
    let out_of_backing = |e: &CapabilityError| matches!(e, CapabilityError::BackingOutOfBounds { .. });
    let placements: [(&str, &memory_api::SharedBacking, usize, CapabilityCheck<'_>); 4] = [
        ("backing offset usize::MAX", &backing, usize::MAX, &out_of_backing),
        ("placement past the backing's end", &backing, PAGE, &out_of_backing),
        ("misaligned backing offset", &two_pages, 100, &misaligned),
        ("a backing of another device", &foreign_backing, 0, &|e| matches!(e, CapabilityError::ForeignBacking { .. })),
    ];
    for (what, backing, backing_offset, expected) in placements {
        let placement = SharedPlacement { target: page, backing_offset };
        let result =
            untouched(what, &[&allocator], || caller.shared.map(backing, &block, placement, MappingAccess::ReadOnly));
        assert!(matches!(&result, Err(BoundCapabilityError::Capability(e)) if expected(e)), "{what}: {result:?}");
    }
    for bytes in [100, usize::MAX, PAGE + 1] {
        let result = untouched("create_backing", &[&allocator], || caller.shared.create_backing(bytes));
        assert!(matches!(result, Err(BoundCapabilityError::Capability(CapabilityError::Misaligned { .. }))), "{bytes}");
    }
    // The capability still works with sane ranges afterwards.
    assert_eq!(caller.virt.commit(&block, page).unwrap(), PAGE);
    caller.binding.release(block).unwrap();
}

/// A capability that reports a zero granularity: every range is refused as
/// misaligned and the capability never runs.
struct ZeroGranularity(Caps);

impl DeviceAllocator for ZeroGranularity {
    fn device(&self) -> DeviceKey {
        self.0.device()
    }
    fn name(&self) -> &str {
        "zero-granularity"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.0.allocate(request)
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.0.release(allocation)
    }
    fn virtual_backing(&self) -> Option<&dyn memory_api::VirtualBacking> {
        Some(self)
    }
}

impl memory_api::VirtualBacking for ZeroGranularity {
    fn granularity(&self) -> usize {
        0
    }
    fn commit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.0.commit(allocation, range)
    }
    fn decommit(&self, allocation: &RawAllocation, range: ByteRange) -> Result<usize, CapabilityError> {
        self.0.decommit(allocation, range)
    }
    fn committed_bytes(&self, allocation: &RawAllocation) -> Result<usize, CapabilityError> {
        self.0.committed_bytes(allocation)
    }
}

#[test]
fn a_capability_with_zero_granularity_refuses_every_range_without_running() {
    let registry = BindingRegistry::new();
    let allocator = Arc::new(RecordingAllocator::new(ZeroGranularity(Caps::new(GPU0))));
    let binding = registry.with_memory(allocator.clone()).unwrap();
    let block = binding.allocate(request(PAGE)).unwrap();
    let virt = binding.virtual_backing().unwrap();
    for range in [ByteRange::new(0, 0), ByteRange::new(0, PAGE), ByteRange::new(1, 1)] {
        let before = touching(allocator.counts());
        let error = virt.commit(&block, range).unwrap_err();
        assert!(matches!(error, BoundCapabilityError::Capability(CapabilityError::Misaligned { granularity: 0, .. })));
        assert_eq!(touching(allocator.counts()), before);
    }
    assert!(matches!(binding.shared_mapping(), Err(BoundCapabilityError::Unsupported { .. })));
    binding.release(block).unwrap();
}

/// A queue that is closed.
struct ClosedQueue(DeviceKey);

impl DeferredReleaseQueue for ClosedQueue {
    fn device(&self) -> DeviceKey {
        self.0
    }
    fn enqueue(&self, release: PreparedRelease) -> Result<(), QueueRefusal> {
        Err(QueueRefusal { release, reason: QueueRefusalReason::Closed })
    }
}

#[test]
fn hostile_queues_hand_the_allocation_back_without_a_release_callback() {
    let registry = BindingRegistry::new();
    let allocator = rec(GPU0);
    let (_, _, mechanism) = register(&registry, allocator.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let mut block = binding.allocate(request(PAGE)).unwrap();
    let identity = block.identity();
    let queues: [(&str, &dyn DeferredReleaseQueue, QueueCheck); 4] = [
        ("a queue of another device", &HeldQueue::new(GPU1, 4), |r| {
            matches!(r, QueueRefusalReason::WrongDevice { .. })
        }),
        ("a host queue", &HeldQueue::new(DeviceKey::HOST, 4), |r| matches!(r, QueueRefusalReason::WrongDevice { .. })),
        ("a full queue", &HeldQueue::new(GPU0, 0), |r| matches!(r, QueueRefusalReason::Full { capacity: 0 })),
        ("a closed queue", &ClosedQueue(GPU0), |r| matches!(r, QueueRefusalReason::Closed)),
    ];
    for (what, queue, expected) in queues {
        let rejected = untouched(what, &[&allocator], || binding.release_deferred(block, queue)).unwrap_err();
        assert!(matches!(&rejected.reason, HandleError::QueueRefused(r) if expected(r)), "{what}: {}", rejected.reason);
        assert_eq!(rejected.handle.identity(), identity, "{what}");
        assert!(rejected.handle.is_valid(), "{what}");
        let snapshot = registry.snapshot(&mechanism).unwrap();
        assert_eq!((snapshot.live_allocations, snapshot.quarantined.len(), snapshot.in_flight), (1, 0, 0), "{what}");
        block = rejected.handle;
    }
    binding.release(block).unwrap();
}

#[test]
fn identity_exhaustion_is_a_typed_error_everywhere_and_leaks_no_block() {
    // Registration: one serial of each kind.
    let registry = BindingRegistry::with_issuer(IdentityIssuer::with_serial_limit(1).unwrap());
    let allocator = rec(GPU0);
    let (_, _, mechanism) = register(&registry, allocator.clone());
    let exhausted = |e: &RegistryError| matches!(e, RegistryError::Identity(IdentityError::Exhausted { .. }));
    assert!(exhausted(&registry.register_provider_context(GPU0, Arc::new(())).unwrap_err()));
    assert!(exhausted(&registry.register_authority(GPU0, Arc::new(())).unwrap_err()));
    // Binding ids come in blocks of 256: none fits under a limit of 1.
    let bind = untouched("bind", &[&allocator], || registry.bind_registered(&mechanism));
    assert!(matches!(bind, Err(BindError::Registry(ref e)) if exhausted(e)), "{bind:?}");
    assert!(registry.snapshots().mechanisms.len() == 1);

    // Allocation generations: one block of 256, then exhaustion. The 257th block
    // is allocated, cannot be recorded, and goes straight back to the allocator.
    let registry = BindingRegistry::with_issuer(IdentityIssuer::with_serial_limit(256).unwrap());
    let heap = Arc::new(RecordingAllocator::new(HostHeap::on_device(GPU0)));
    let (_, _, mechanism) = register(&registry, heap.clone());
    let binding = registry.bind_registered(&mechanism).unwrap();
    let blocks: Vec<_> = (0..256).map(|_| binding.allocate(request(8)).unwrap()).collect();
    let error = binding.allocate(request(8)).unwrap_err();
    assert!(matches!(error, AllocateError::Identity(IdentityError::Exhausted { .. })), "{error}");
    assert_eq!((heap.calls(Callback::Allocate), heap.calls(Callback::Release)), (257, 1));
    assert_eq!(heap.inner().stats().unwrap().live_allocations, 256, "the unrecordable block leaked");
    assert_eq!(registry.snapshot(&mechanism).unwrap().live_allocations, 256);
    for block in blocks {
        binding.release(block).unwrap();
    }
    assert_eq!(heap.inner().stats().unwrap().live_allocations, 0);
}

// ---------------------------------------------------------------------------------
// Hostile allocator answers
// ---------------------------------------------------------------------------------

/// Answers releases (while `lying` is set) with a partial or failed outcome about
/// another block than the one given.
struct Liar {
    inner: RecordingAllocator,
    lying: std::sync::atomic::AtomicU8,
}

impl Liar {
    const HONEST: u8 = 0;
    const QUARANTINE_OTHER: u8 = 1;
    const FAIL_OTHER: u8 = 2;

    fn set(&self, mode: u8) {
        self.lying.store(mode, std::sync::atomic::Ordering::SeqCst);
    }
}

impl DeviceAllocator for Liar {
    fn device(&self) -> DeviceKey {
        GPU0
    }
    fn name(&self) -> &str {
        "liar"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.inner.allocate(request)
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let other = RawAllocation::new(DeviceAddress::new(0xdead_0000).unwrap(), 1 << 20, 4096, GPU0, 0);
        let error = ReleaseError::NotOwned { allocator: "liar".into(), device: GPU0, address: 0 };
        match self.lying.load(std::sync::atomic::Ordering::SeqCst) {
            Liar::HONEST => self.inner.release(allocation),
            // The block given is simply kept (still live in the heap).
            Liar::QUARANTINE_OTHER => ReleaseOutcome::quarantined(other, 0, 1 << 20, error),
            _ => ReleaseOutcome::failed(other, error),
        }
    }
}

fn liar() -> Arc<Liar> {
    Arc::new(Liar { inner: RecordingAllocator::on_device(GPU0), lying: std::sync::atomic::AtomicU8::new(0) })
}

#[test]
fn a_release_answered_with_another_block_keeps_the_given_block_quarantined_as_wholly_owned() {
    for mode in [Liar::QUARANTINE_OTHER, Liar::FAIL_OTHER] {
        let registry = BindingRegistry::new();
        let allocator = liar();
        let binding = registry.with_memory(allocator.clone()).unwrap();
        let mechanism = binding.identity().mechanism();
        let block = binding.allocate(request(100)).unwrap();
        allocator.set(mode);
        let report = binding.release(block).unwrap();
        assert_eq!(report, ReleaseSummary::Quarantined { unmapped_bytes: 0, residual_bytes: 100 }, "mode {mode}");
        let quarantined = &registry.snapshot(&mechanism).unwrap().quarantined;
        assert_eq!((quarantined.len(), quarantined[0].bytes, quarantined[0].residual_bytes), (1, 100, 100));
        assert!(quarantined[0].reason.contains("treating all of it as owned"), "{}", quarantined[0].reason);
        assert_eq!(registry.snapshot(&mechanism).unwrap().dishonest_outcomes, 1, "mode {mode}");
        allocator.set(Liar::HONEST);
        assert_eq!(registry.retry_quarantined(&mechanism).unwrap().released, 1);
        assert_eq!(allocator.inner.inner().stats().unwrap().live_allocations, 0);
    }
}

#[test]
fn a_retry_answered_with_another_block_keeps_the_original_block_quarantined() {
    for mode in [Liar::QUARANTINE_OTHER, Liar::FAIL_OTHER] {
        let registry = BindingRegistry::new();
        let allocator = liar();
        let binding = registry.with_memory(allocator.clone()).unwrap();
        let mechanism = binding.identity().mechanism();
        drop(binding.allocate(request(100)).unwrap()); // device tier: quarantined on drop
        allocator.set(mode);
        let retry = registry.retry_quarantined(&mechanism).unwrap();
        assert_eq!((retry.released, retry.still_quarantined), (0, 1));
        let quarantined = &registry.snapshot(&mechanism).unwrap().quarantined;
        // The registry must keep the block it handed out, not the one the allocator named.
        assert_eq!((quarantined[0].bytes, quarantined[0].residual_bytes), (100, 100), "mode {mode}");
        assert_eq!(registry.snapshot(&mechanism).unwrap().dishonest_outcomes, 1, "mode {mode}");
        allocator.set(Liar::HONEST);
        assert_eq!(registry.retry_quarantined(&mechanism).unwrap().released, 1);
        assert_eq!(allocator.inner.inner().stats().unwrap().live_allocations, 0, "mode {mode}: the real block leaked");
    }
}

/// Answers allocations with a block that does not fit the request, in one of several
/// ways (or honestly, as a control).
#[derive(Copy, Clone, Debug, PartialEq)]
enum Unfit {
    Honest,
    ZeroAlignment,
    AlignmentThree,
    OtherDevice,
    OneByteShort,
    MisalignedAddress,
}

struct UnfitAllocator(Caps, Unfit);

impl DeviceAllocator for UnfitAllocator {
    fn device(&self) -> DeviceKey {
        self.0.device()
    }
    fn name(&self) -> &str {
        "unfit"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let block = self.0.allocate(request)?;
        let (address, bytes, align, device) = (block.address(), block.bytes(), block.align(), block.device());
        Ok(match self.1 {
            Unfit::Honest => block,
            Unfit::ZeroAlignment => RawAllocation::new(address, bytes, 0, device, 0),
            Unfit::AlignmentThree => RawAllocation::new(address, bytes, 3, device, 0),
            Unfit::OtherDevice => RawAllocation::new(address, bytes, align, GPU1, 0),
            Unfit::OneByteShort => RawAllocation::new(address, bytes - 1, align, device, 0),
            Unfit::MisalignedAddress => RawAllocation::new(address.checked_add(8).unwrap(), bytes, align, device, 0),
        })
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.0.release(allocation)
    }
    fn virtual_backing(&self) -> Option<&dyn memory_api::VirtualBacking> {
        Some(&self.0)
    }
}

#[test]
fn unfit_blocks_from_allocate_are_given_back_and_reported_as_invalid_blocks() {
    for unfit in [
        Unfit::Honest,
        Unfit::ZeroAlignment,
        Unfit::AlignmentThree,
        Unfit::OtherDevice,
        Unfit::OneByteShort,
        Unfit::MisalignedAddress,
    ] {
        let registry = BindingRegistry::new();
        let allocator = Arc::new(RecordingAllocator::new(UnfitAllocator(Caps::new(GPU0), unfit)));
        let binding = registry.with_memory(allocator.clone()).unwrap();
        let mechanism = binding.identity().mechanism();
        let result = catch(|| binding.allocate(request(PAGE)));
        let result = result.unwrap_or_else(|()| panic!("{unfit:?}: allocate panicked"));
        match (unfit, result) {
            (Unfit::Honest, Ok(block)) => {
                // The control: a fitting block gives a handle whose every method works.
                assert_eq!((block.bytes(), block.align()), (PAGE, 64));
                let virt = binding.virtual_backing().unwrap();
                assert_eq!(virt.commit(&block, ByteRange::new(0, PAGE)).unwrap(), PAGE);
                binding.release(block).unwrap();
            }
            (_, Err(AllocateError::InvalidBlock { requested, align, device, .. })) => {
                assert_eq!((requested, align, device), (PAGE, 64, GPU0), "{unfit:?}");
                let calls = (allocator.calls(Callback::Allocate), allocator.calls(Callback::Release));
                assert_eq!(calls, (1, 1), "{unfit:?}: the unfit block must go straight back to the allocator");
            }
            (_, other) => panic!("{unfit:?}: {other:?}"),
        }
        let snapshot = registry.snapshot(&mechanism).unwrap();
        assert_eq!((snapshot.live_allocations, snapshot.quarantined.len(), snapshot.in_flight), (0, 0, 0), "{unfit:?}");
    }
}
