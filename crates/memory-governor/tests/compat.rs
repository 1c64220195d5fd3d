//! The compatibility surface: a runtime that depends on `memory-governor` alone gets
//! the contracts (`memory-api`) and the registry (`memory-binding`), as modules and as
//! flat names, and existing call sites (`with_memory`, capabilities) keep working.

use std::sync::Arc;

use memory_governor as governor;

/// Every flat re-export of `memory-api` names the same item as `governor::api::...`.
#[test]
fn api_is_reexported_as_module_and_flat() {
    // Vocabulary.
    let key: governor::DeviceKey = governor::api::DeviceKey::device(3);
    assert_eq!(key.tier(), governor::Tier::Device);
    assert_eq!(governor::MemoryRole::ALL.len(), governor::api::MemoryRole::ALL.len());
    let address: governor::DeviceAddress = governor::api::DeviceAddress::new(0x1000).unwrap();
    assert!(address.is_aligned_to(0x1000));

    // Requests and errors.
    let request: governor::AllocationRequest =
        governor::api::AllocationRequest::new(64, 8).unwrap().with_role(governor::MemoryRole::KvCache);
    assert_eq!(request.role(), governor::api::MemoryRole::KvCache);
    let layout: governor::LayoutError = governor::api::AllocationRequest::new(1, 3).unwrap_err();
    let _: governor::AllocError = layout.into();
    let _: governor::api::error::ReleaseError = governor::ReleaseError::Abandoned;

    // Identities.
    let issuer: governor::IdentityIssuer = governor::api::IdentityIssuer::new().unwrap();
    let authority: governor::AuthorityIdentity = issuer.authority().unwrap();
    assert!(issuer.issued(&authority));

    // Release outcomes and capabilities (the merged `capability` module too).
    let outcome: governor::ReleaseOutcome = governor::api::ReleaseOutcome::complete(0);
    assert!(outcome.is_complete());
    let range: governor::ByteRange = governor::capability::ByteRange::new(0, 4096);
    assert_eq!(range, governor::api::capability::ByteRange::new(0, 4096));
}

/// The registry, its handles and errors through the governor, and `with_memory` for
/// code that still holds a bare allocator.
#[test]
fn registry_is_reexported_and_with_memory_keeps_working() {
    let registry: governor::BindingRegistry = governor::binding::BindingRegistry::new().unwrap();
    let allocator: Arc<dyn governor::DeviceAllocator> = Arc::new(memory_testkit::RecordingAllocator::host());
    let binding: governor::MemoryBinding = registry.with_memory(allocator).unwrap();
    let block: governor::BoundAllocation =
        binding.allocate(governor::AllocationRequest::new(256, 64).unwrap()).unwrap();
    {
        let view: governor::AllocationView<'_> = block.view(0, 128).unwrap();
        assert_eq!(view.len(), 128);
    }
    let report: governor::ReleaseReport = binding.release(block).unwrap();
    assert!(matches!(report, governor::binding::ReleaseReport::Complete { .. }));
    let snapshot: governor::RegistrySnapshot = registry.snapshots();
    let _: &governor::binding::RegistrySnapshot = &snapshot;
    let mechanism: governor::MechanismIdentity = binding.identity().mechanism();
    let one: governor::MechanismSnapshot = registry.snapshot(&mechanism).unwrap();
    let _: &governor::binding::MechanismSnapshot = &one;
    let _: Option<governor::MechanismState> = None::<governor::binding::MechanismState>;
    let _: Option<governor::BindError> = None;
    let _: Option<governor::capability::BoundVirtualBacking> = None;
}

/// The governor's own surface sits beside the re-exports without shadowing them.
#[test]
fn governor_items_coexist_with_the_reexports() {
    let governor = governor::Governor::new();
    let issuer = governor::IdentityIssuer::new().unwrap();
    let authority = issuer.authority().unwrap();
    let account = governor.open_account(governor::AccountConfig::new(governor::DeviceKey::HOST, authority)).unwrap();
    let lease = account.lease(governor::MemoryRole::Workspace, 10).unwrap();
    assert_eq!(lease.bytes(), 10);
    drop(lease);
    let allocator: Arc<dyn governor::DeviceAllocator> = Arc::new(memory_testkit::RecordingAllocator::host());
    let governed: governor::GovernedAllocator = governor.govern(allocator, authority).unwrap();
    assert_eq!(governor::DeviceAllocator::name(&governed), "governed(testkit-host-heap)");
}
