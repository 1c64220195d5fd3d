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
    let _: governor::api::ReleaseError = governor::ReleaseError::Abandoned;

    // Identities.
    let issuer: governor::IdentityIssuer = governor::api::IdentityIssuer::new().unwrap();
    let authority: governor::AuthorityIdentity = issuer.authority().unwrap();
    assert!(issuer.issued(&authority));

    // Release outcomes and capabilities.
    let outcome: governor::ReleaseOutcome = governor::api::ReleaseOutcome::complete(0);
    assert!(outcome.is_complete());
    let range: governor::ByteRange = governor::api::ByteRange::new(0, 4096);
    assert_eq!(range, memory_api::ByteRange::new(0, 4096));
}

/// The registry, its handles and errors through the governor, and `with_memory` for
/// code that still holds a bare allocator.
#[test]
fn registry_is_reexported_and_with_memory_keeps_working() {
    let registry: governor::BindingRegistry = governor::binding::BindingRegistry::new();
    let allocator: Arc<dyn governor::DeviceAllocator> = Arc::new(memory_testkit::RecordingAllocator::host());
    let binding: governor::MemoryBinding = registry.with_memory(allocator).unwrap();
    let block: governor::BoundAllocation =
        binding.allocate(governor::AllocationRequest::new(256, 64).unwrap()).unwrap();
    {
        let view: governor::AllocationView<'_> = block.view(0, 128).unwrap();
        assert_eq!(view.len(), 128);
    }
    let report: governor::ReleaseSummary = binding.release(block).unwrap();
    assert!(matches!(report, governor::api::ReleaseSummary::Complete { .. }));
    let snapshot: governor::RegistrySnapshot = registry.snapshots();
    let _: &governor::binding::RegistrySnapshot = &snapshot;
    let mechanism: governor::MechanismIdentity = binding.identity().mechanism();
    let one: governor::MechanismSnapshot = registry.snapshot(&mechanism).unwrap();
    let _: &governor::binding::MechanismSnapshot = &one;
    let _: Option<governor::MechanismState> = None::<governor::binding::MechanismState>;
    let _: Option<governor::BindError> = None;
    let _: Option<governor::binding::BoundVirtualBacking> = None;
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

/// Names one item three ways (flat through the governor, through its `api`/`binding`
/// module, and in its own crate) and proves they are the same item: a conversion that
/// only compiles when the types are identical.
macro_rules! same_types {
    ($module:ident => $krate:ident: $($name:ident $(<$($arg:tt),*>)?),* $(,)?) => {$(
        let _ = |value: $krate::$name$(<$($arg),*>)?| -> governor::$name$(<$($arg),*>)? { value };
        let _ = |value: governor::$module::$name$(<$($arg),*>)?| -> $krate::$name$(<$($arg),*>)? { value };
    )*};
}

macro_rules! same_traits {
    ($module:ident => $krate:ident: $($name:ident),* $(,)?) => {$({
        fn _flat<T: ?Sized + governor::$name>() {}
        fn _module<T: ?Sized + governor::$module::$name>() {}
        fn _own<T: ?Sized + $krate::$name>() {
            _flat::<T>();
            _module::<T>()
        }
    })*};
}

/// Every public item of `memory-api` and `memory-binding` resolves through the governor,
/// flat and through its `api` / `binding` module, as the same item (crossbeam's
/// `subcrates` test, for this facade). `every_reexport_is_listed_here` keeps the list
/// complete as the crates grow.
#[test]
#[allow(unused_variables)]
fn every_public_item_resolves_through_the_governor() {
    type Id = governor::MechanismIdentity;
    type Handle = governor::BoundAllocation;
    same_types!(api => memory_api:
        DeviceAddress, DeviceKey, MemoryRole, Tier,
        AllocationGeneration, AllocationIdentity, AuthorityIdentity, BindingGeneration, BindingId, BindingIdentity,
        IdentityBlock<Id>, IdentityIssuer, IdentityKind, MechanismIdentity, ProviderContextIdentity, RegistryId,
        AllocationRequest, AllocatorStats, RawAllocation,
        ByteRange, MappingAccess, SharedBacking, SharedPlacement,
        PreparedRelease, QueueRefusal, QueueRefusalReason, ReleaseCompletion,
        Completion, FailedRelease, Quarantine, ReleaseOutcome, ReleaseSummary,
        AllocError, BackendError, CapabilityError, IdentityError, LayoutError, MaybeBytes, ReleaseError,
    );
    same_traits!(api => memory_api: Identity, DeviceAllocator, SharedBackingResource, SharedMapping, VirtualBacking, DeferredReleaseQueue);
    same_types!(binding => memory_binding:
        BindingRegistry, InvalidationReport, MechanismOptions, DropPolicy, Resource, MechanismState,
        AllocationView<'static>, BoundAllocation, MemoryBinding,
        BoundSharedMapping, BoundVirtualBacking, CallerHold,
        AllocationState, AuthoritySnapshot, ContextSnapshot, MechanismSnapshot, QuarantineSnapshot, RegistrySnapshot,
        RetryReport, TerminationReport,
        AllocateError, BindError, BoundCapabilityError, ContextState, HandleError, ObjectKind, RegistryError,
        Rejected<Handle>, ViewError,
    );
}

/// Every name in the `pub use` lists of `memory-api` and `memory-binding` appears in
/// the test above, so an item added there and forgotten here fails.
#[test]
fn every_reexport_is_listed_here() {
    let this = include_str!("compat.rs");
    let listed = &this[this.find("fn every_public_item_resolves_through_the_governor").unwrap()..];
    for (krate, lib) in [
        ("memory-api", include_str!("../../memory-api/src/lib.rs")),
        ("memory-binding", include_str!("../../memory-binding/src/lib.rs")),
    ] {
        for name in reexported_names(lib) {
            let word = |text: &str| {
                text.match_indices(name.as_str()).any(|(at, _)| {
                    let before = text[..at].chars().next_back().is_none_or(|c| !c.is_alphanumeric() && c != '_');
                    let after = text[at + name.len()..].chars().next().is_none_or(|c| !c.is_alphanumeric() && c != '_');
                    before && after
                })
            };
            assert!(word(listed), "{krate} re-exports `{name}`, which the facade test does not check");
        }
    }
}

/// The item names of every `pub use module::{...};` / `pub use module::Name;` line.
fn reexported_names(lib: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = lib;
    while let Some(at) = rest.find("\npub use ") {
        let statement = &rest[at + 9..];
        let end = statement.find(';').unwrap();
        let body = &statement[..end];
        rest = &statement[end..];
        if body.contains(" as ") || body.ends_with('*') {
            continue; // module aliases and globs (the governor's own lines)
        }
        let items = body.split_once('{').map_or_else(|| body.rsplit("::").next().unwrap(), |(_, items)| items);
        names.extend(
            items
                .split(|c: char| c == ',' || c == '}' || c.is_whitespace())
                .filter(|n| !n.is_empty())
                .map(str::to_owned),
        );
    }
    assert!(names.len() > 20, "parsed too few names: {names:?}");
    names
}
