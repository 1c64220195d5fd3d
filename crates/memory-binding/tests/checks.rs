//! Every cross-binding, cross-mechanism, cross-authority, cross-device,
//! foreign-registry and stale handle is rejected before any callback; capability
//! ranges are checked first; callbacks run with no lock held; panics leave the
//! registry usable with exact counts.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use common::{Caps, PAGE, bind, register, request};
use memory_api::{
    AllocError, AllocationRequest, ByteRange, CapabilityError, DeviceAllocator, DeviceKey, MappingAccess,
    RawAllocation, ReleaseOutcome, SharedPlacement,
};
use memory_binding::{BindingRegistry, BoundCapabilityError, HandleError, RegistryError, ViewError};
use memory_testkit::{Callback, FaultyAllocator, RecordingAllocator};

const GPU0: DeviceKey = DeviceKey::device(0);
const GPU1: DeviceKey = DeviceKey::device(1);

/// Asserts the allocation comes back from `binding.release` with `expected`, and
/// that no allocator saw a callback.
fn assert_rejected(
    binding: &memory_binding::MemoryBinding,
    block: memory_binding::BoundAllocation,
    counters: &[&Caps],
    expected: impl Fn(&HandleError) -> bool,
) -> memory_binding::BoundAllocation {
    let before: Vec<_> = counters.iter().map(|c| c.callbacks()).collect();
    let rejected = binding.release(block).unwrap_err();
    assert!(expected(&rejected.reason), "unexpected reason: {}", rejected.reason);
    let after: Vec<_> = counters.iter().map(|c| c.callbacks()).collect();
    assert_eq!(before, after, "a rejected release must not reach any allocator");
    rejected.handle
}

#[test]
fn cross_binding_mechanism_authority_device_and_registry_handles_are_rejected_before_callbacks() {
    let registry = BindingRegistry::new();
    let a = Arc::new(Caps::new(GPU0));
    let b = Arc::new(Caps::new(GPU0));
    let c = Arc::new(Caps::new(GPU1));
    let (ctx, _, ma) = register(&registry, a.clone());
    let (_, _, mb) = register(&registry, b.clone());
    let (_, _, mc) = register(&registry, c.clone());
    // Same context, other authority.
    let other_authority = registry.register_authority(GPU0, Arc::new(())).unwrap();
    let a2 = Arc::new(Caps::new(GPU0));
    let md = registry.register_allocator(&ctx, &other_authority, a2.clone()).unwrap();

    let owner = bind(&registry, &ma);
    let sibling = bind(&registry, &ma); // same mechanism, another binding
    let other_mechanism = bind(&registry, &mb);
    let other_device = bind(&registry, &mc);
    let other_authority_binding = bind(&registry, &md);
    let foreign_registry = BindingRegistry::new();
    let (_, _, mf) = register(&foreign_registry, Arc::new(Caps::new(GPU0)));
    let foreign = bind(&foreign_registry, &mf);

    let all = [&*a, &*b, &*c, &*a2];
    let block = owner.allocate(request(PAGE)).unwrap();
    let block = assert_rejected(&sibling, block, &all, |r| matches!(r, HandleError::BindingMismatch { .. }));
    let block = assert_rejected(&other_mechanism, block, &all, |r| matches!(r, HandleError::BindingMismatch { .. }));
    let block = assert_rejected(
        &other_device,
        block,
        &all,
        // Typed identities: the error names both bindings exactly.
        |r| {
            matches!(r, HandleError::BindingMismatch { expected, found }
                if *found == Some(owner.identity()) && *expected == other_device.identity()
                    && found.is_some_and(|f| f.device() == GPU0))
        },
    );
    let block =
        assert_rejected(&other_authority_binding, block, &all, |r| matches!(r, HandleError::BindingMismatch { .. }));
    let block = assert_rejected(&foreign, block, &all, |r| matches!(r, HandleError::ForeignRegistry { .. }));

    // Capability handles of other bindings refuse it too, before the capability runs.
    let other_virtual = other_mechanism.virtual_backing().unwrap();
    let err = other_virtual.commit(&block, ByteRange::new(0, PAGE)).unwrap_err();
    assert!(matches!(err, BoundCapabilityError::Handle(HandleError::BindingMismatch { .. })));
    let foreign_shared = foreign.shared_mapping().unwrap();
    let backing = foreign_shared.create_backing(PAGE).unwrap();
    let placement = SharedPlacement { target: ByteRange::new(0, PAGE), backing_offset: 0 };
    let err = foreign_shared.map(&backing, &block, placement, MappingAccess::ReadOnly).unwrap_err();
    assert!(matches!(err, BoundCapabilityError::Handle(HandleError::ForeignRegistry { .. })));
    assert_eq!(b.commits.load(Ordering::SeqCst), 0);

    // The rightful binding still releases it through the original allocator.
    owner.release(block).unwrap();
    assert_eq!(a.releases.load(Ordering::SeqCst), 1);
}

#[test]
fn foreign_and_unknown_identities_are_rejected_at_registration() {
    let registry = BindingRegistry::new();
    let other = BindingRegistry::new();
    let ctx = registry.register_provider_context(GPU0, Arc::new(())).unwrap();
    let auth = registry.register_authority(GPU0, Arc::new(())).unwrap();
    let foreign_ctx = other.register_provider_context(GPU0, Arc::new(())).unwrap();
    let host_auth = registry.register_authority(DeviceKey::HOST, Arc::new(())).unwrap();
    let allocator = Arc::new(Caps::new(GPU0));
    let err = registry.register_allocator(&foreign_ctx, &auth, allocator.clone()).unwrap_err();
    assert!(matches!(err, RegistryError::ForeignRegistry { .. }), "{err}");
    assert!(err.to_string().contains("use the registry that issued it"));
    let err = registry.register_allocator(&ctx, &host_auth, allocator.clone()).unwrap_err();
    assert!(matches!(err, RegistryError::DeviceMismatch { what: "authority", .. }), "{err}");
    let err = registry.register_allocator(&ctx, &auth, Arc::new(Caps::new(GPU1))).unwrap_err();
    assert!(matches!(err, RegistryError::DeviceMismatch { what: "allocator", .. }), "{err}");
    registry.remove_authority(&host_auth).unwrap();
    let err = registry.register_allocator(&ctx, &host_auth, allocator.clone()).unwrap_err();
    assert!(matches!(err, RegistryError::Unknown { .. }), "{err}");
    // Nothing was published by the failed registrations.
    assert!(registry.snapshots().mechanisms.is_empty());
    assert_eq!(registry.selected(GPU0), None);
    let (_, _, other_mech) = register(&other, Arc::new(Caps::new(GPU0)));
    assert!(matches!(registry.select(&other_mech), Err(RegistryError::ForeignRegistry { .. })));
    assert!(registry.bind_registered(&other_mech).is_err());
}

#[test]
fn capability_ranges_are_checked_before_the_capability_runs() {
    let registry = BindingRegistry::new();
    let caps = Arc::new(Caps::new(GPU0));
    let (_, _, mechanism) = register(&registry, caps.clone());
    let binding = bind(&registry, &mechanism);
    let block = binding.allocate(request(4 * PAGE)).unwrap();
    let virt = binding.virtual_backing().unwrap();
    let out = virt.commit(&block, ByteRange::new(3 * PAGE, 2 * PAGE)).unwrap_err();
    assert!(matches!(out, BoundCapabilityError::Capability(CapabilityError::OutOfBounds { .. })));
    let overflow = virt.commit(&block, ByteRange::new(usize::MAX - PAGE + 1, PAGE)).unwrap_err();
    assert!(matches!(overflow, BoundCapabilityError::Capability(CapabilityError::OutOfBounds { .. })));
    let misaligned = virt.decommit(&block, ByteRange::new(100, PAGE)).unwrap_err();
    assert!(matches!(misaligned, BoundCapabilityError::Capability(CapabilityError::Misaligned { .. })));
    assert_eq!(caps.commits.load(Ordering::SeqCst) + caps.decommits.load(Ordering::SeqCst), 0);
    assert_eq!(virt.commit(&block, ByteRange::new(PAGE, 2 * PAGE)).unwrap(), 2 * PAGE);
    assert_eq!(virt.committed_bytes(&block).unwrap(), 2 * PAGE);

    let shared = binding.shared_mapping().unwrap();
    let backing = shared.create_backing(2 * PAGE).unwrap();
    let beyond_backing = SharedPlacement { target: ByteRange::new(0, 2 * PAGE), backing_offset: PAGE };
    let err = shared.map(&backing, &block, beyond_backing, MappingAccess::ReadWrite).unwrap_err();
    assert!(
        matches!(
            err,
            BoundCapabilityError::Capability(CapabilityError::BackingOutOfBounds { offset: PAGE, len, backing_bytes })
                if len == 2 * PAGE && backing_bytes == 2 * PAGE
        ),
        "the backing's range, named as the backing's: {err}"
    );
    let beyond_block = SharedPlacement { target: ByteRange::new(3 * PAGE, 2 * PAGE), backing_offset: 0 };
    let err = shared.map(&backing, &block, beyond_block, MappingAccess::ReadWrite).unwrap_err();
    assert!(
        matches!(err, BoundCapabilityError::Capability(CapabilityError::OutOfBounds { offset, .. }) if offset == 3 * PAGE)
    );
    assert!(shared.create_backing(100).is_err());
    assert_eq!(caps.maps.load(Ordering::SeqCst), 0);
    let ok = SharedPlacement { target: ByteRange::new(2 * PAGE, 2 * PAGE), backing_offset: 0 };
    shared.map(&backing, &block, ok, MappingAccess::ReadOnly).unwrap();
    assert_eq!(shared.unmap(&block, ByteRange::new(2 * PAGE, 2 * PAGE)).unwrap(), 2 * PAGE);

    let unsupported = registry.with_memory(Arc::new(RecordingAllocator::host())).unwrap();
    assert!(matches!(unsupported.virtual_backing(), Err(BoundCapabilityError::Unsupported { .. })));
    binding.release(block).unwrap();
}

#[test]
fn views_are_bounded_to_their_allocation() {
    let registry = BindingRegistry::new();
    let binding = registry.with_memory(Arc::new(RecordingAllocator::host())).unwrap();
    let block = binding.allocate(request(100)).unwrap();
    assert_eq!(block.view(0, 100).unwrap().len(), 100);
    assert_eq!(block.view(100, 0).unwrap().len(), 0);
    assert!(matches!(block.view(50, 51), Err(ViewError::OutOfBounds { .. })));
    assert!(matches!(block.view(usize::MAX, 2), Err(ViewError::OutOfBounds { .. })));
    let view = block.view(10, 20).unwrap();
    assert_eq!(view.address().get(), block.address().get() + 10);
    // `binding.release(block)` here would not compile: the view borrows the block.
    assert_eq!(view.offset(), 10);
    binding.release(block).unwrap();
}

/// An allocator that calls back into the registry from every callback.
struct Reentrant {
    inner: RecordingAllocator,
    registry: OnceLock<BindingRegistry>,
    reentered: AtomicUsize,
}

impl Reentrant {
    fn poke(&self) {
        if let Some(registry) = self.registry.get() {
            // Cold-path and hot-path calls from inside a callback must not deadlock.
            let snapshot = registry.snapshots();
            assert!(!snapshot.mechanisms.is_empty());
            // After invalidation there is no selection; the call must still return.
            drop(registry.bind(DeviceKey::HOST));
            self.reentered.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl DeviceAllocator for Reentrant {
    fn device(&self) -> DeviceKey {
        DeviceKey::HOST
    }
    fn name(&self) -> &str {
        "reentrant"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.poke();
        self.inner.allocate(request)
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.poke();
        self.inner.release(allocation)
    }
    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        self.poke();
        drop(lost);
    }
}

#[test]
fn callbacks_and_destructors_run_with_no_lock_held() {
    let registry = BindingRegistry::new();
    let allocator = Arc::new(Reentrant {
        inner: RecordingAllocator::host(),
        registry: OnceLock::new(),
        reentered: AtomicUsize::new(0),
    });
    let (context, _, mechanism) = register(&registry, allocator.clone());
    let _ = allocator.registry.set(registry.clone());
    let binding = bind(&registry, &mechanism);
    let block = binding.allocate(request(64)).unwrap();
    binding.release(block).unwrap();
    drop(binding.allocate(request(64)).unwrap()); // drop-time release
    let kept = binding.allocate(request(64)).unwrap();
    registry.invalidate_device(DeviceKey::HOST, "test");
    registry.confirm_context_terminated(&context).unwrap(); // forget_lost callback
    assert_eq!(allocator.reentered.load(Ordering::SeqCst), 6);
    drop(kept);

    // A resource whose destructor calls into the registry.
    struct CallsBack(BindingRegistry, Arc<AtomicUsize>);
    impl Drop for CallsBack {
        fn drop(&mut self) {
            let _ = self.0.snapshots();
            self.1.fetch_add(1, Ordering::SeqCst);
        }
    }
    let dropped = Arc::new(AtomicUsize::new(0));
    let ctx = registry.register_provider_context(GPU0, Arc::new(CallsBack(registry.clone(), dropped.clone()))).unwrap();
    registry.remove_provider_context(&ctx).unwrap();
    assert_eq!(dropped.load(Ordering::SeqCst), 1);
}

#[test]
fn a_panicking_allocator_leaves_the_registry_usable_with_exact_counts() {
    let registry = BindingRegistry::new();
    let faulty = Arc::new(FaultyAllocator::host());
    let (_, _, mechanism) = register(&registry, faulty.clone());
    let binding = bind(&registry, &mechanism);

    faulty.panic_on_nth(Callback::Allocate, 1);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| binding.allocate(request(64))));
    assert!(panicked.is_err());
    let snapshot = registry.snapshot(&mechanism).unwrap();
    assert_eq!((snapshot.in_flight, snapshot.live_allocations), (0, 0));

    let block = binding.allocate(request(64)).unwrap();
    faulty.panic_on_nth(Callback::Release, 1);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| binding.release(block)));
    assert!(panicked.is_err());
    let snapshot = registry.snapshot(&mechanism).unwrap();
    assert_eq!((snapshot.in_flight, snapshot.live_allocations, snapshot.quarantined.len()), (0, 0, 1));
    assert!(snapshot.quarantined[0].reason.contains("panicked"));

    // Still fully usable, and the quarantined block can be retried.
    let block = binding.allocate(request(64)).unwrap();
    binding.release(block).unwrap();
    assert_eq!(registry.retry_quarantined(&mechanism).unwrap().released, 1);
    registry.retire(&mechanism).unwrap();
    registry.remove(&mechanism).unwrap();
}

#[test]
fn allocator_errors_pass_through_and_leak_nothing() {
    let registry = BindingRegistry::new();
    let faulty = Arc::new(FaultyAllocator::host());
    let (_, _, mechanism) = register(&registry, faulty.clone());
    let binding = bind(&registry, &mechanism);
    faulty.fail_nth(Callback::Allocate, 1);
    let err = binding.allocate(request(64)).unwrap_err();
    assert!(matches!(err, memory_binding::AllocateError::Allocator(_)), "{err}");
    let snapshot = registry.snapshot(&mechanism).unwrap();
    assert_eq!((snapshot.in_flight, snapshot.live_allocations), (0, 0));
}

#[test]
fn identity_exhaustion_is_an_error_not_a_wrap() {
    let registry = BindingRegistry::with_issuer(memory_api::IdentityIssuer::with_serial_limit(1).unwrap());
    let (_, _, _) = register(&registry, Arc::new(Caps::new(GPU0)));
    let err = registry.register_provider_context(GPU0, Arc::new(())).unwrap_err();
    assert!(matches!(err, RegistryError::Identity(_)), "{err}");
}
