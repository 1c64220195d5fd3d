//! The small public surface around the core operations: accessors, `Debug` and
//! `Display` output, names and defaults say what they should.

mod common;

use std::sync::Arc;

use common::{Caps, PAGE, register, request};
use memory_api::{ByteRange, DeviceKey, MappingAccess, SharedPlacement};
use memory_binding::{BindingRegistry, ContextState, DropPolicy, HandleError, MechanismState, ObjectKind, Rejected};

const GPU0: DeviceKey = DeviceKey::device(0);

#[test]
fn a_binding_hands_out_the_resources_and_allocator_it_pins() {
    let registry = BindingRegistry::new();
    let context = registry.register_provider_context(GPU0, Arc::new("cuda context owner")).unwrap();
    let authority = registry.register_authority(GPU0, Arc::new(42_u32)).unwrap();
    let mechanism = registry.register_allocator(&context, &authority, Arc::new(Caps::new(GPU0))).unwrap();
    let binding = registry.bind_registered(&mechanism).unwrap();
    assert_eq!(binding.context_resource().downcast_ref::<&str>(), Some(&"cuda context owner"));
    assert_eq!(binding.authority_resource().downcast_ref::<u32>(), Some(&42));
    assert_eq!(binding.allocator().name(), "caps");
    assert_eq!((binding.device(), binding.state()), (GPU0, MechanismState::Active));

    let debug = format!("{binding:?}");
    assert!(debug.starts_with("MemoryBinding(") && debug.contains(&mechanism.to_string()), "{debug}");
    let registry_debug = format!("{registry:?}");
    assert!(registry_debug.contains("contexts: 1, authorities: 1, mechanisms: 1"), "{registry_debug}");
}

#[test]
fn allocations_views_and_capability_handles_describe_themselves() {
    let registry = BindingRegistry::new();
    let (_, _, mechanism) = register(&registry, Arc::new(Caps::new(GPU0)));
    let binding = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(request(2 * PAGE)).unwrap();
    assert_eq!((block.bytes(), block.align(), block.device()), (2 * PAGE, 64, Some(GPU0)));
    let identity = block.identity().unwrap();
    let debug = format!("{block:?}");
    assert!(debug.contains("BoundAllocation") && debug.contains("bytes: 8192"), "{debug}");
    assert!(debug.contains(&identity.generation().to_string()), "{debug}");

    let empty = block.view(PAGE, 0).unwrap();
    assert!(empty.is_empty());
    let view = block.view(PAGE, 1).unwrap();
    assert!(!view.is_empty());
    assert_eq!(view.allocation().identity(), Some(identity));
    assert_eq!(view.address().get(), block.address().get() + PAGE as u64);
    assert!(format!("{view:?}").contains("offset: 4096"));

    let virt = binding.virtual_backing().unwrap();
    let shared = binding.shared_mapping().unwrap();
    assert_eq!(virt.binding().identity(), binding.identity());
    assert_eq!(shared.binding().identity(), binding.identity());
    assert!(format!("{virt:?}").starts_with("BoundVirtualBacking("));
    assert!(format!("{shared:?}").starts_with("BoundSharedMapping("));
    let backing = shared.create_backing(PAGE).unwrap();
    let placement = SharedPlacement { target: ByteRange::new(0, PAGE), backing_offset: 0 };
    shared.map(&backing, &block, placement, MappingAccess::ReadWrite).unwrap();
    assert_eq!(shared.unmap(&block, ByteRange::new(0, PAGE)).unwrap(), PAGE);
    binding.release(block).unwrap();
}

#[test]
fn drop_policies_default_by_tier_and_print_their_names() {
    assert_eq!(format!("{:?}", DropPolicy::default_for(DeviceKey::HOST)), "Release");
    assert_eq!(format!("{:?}", DropPolicy::default_for(GPU0)), "Quarantine");
    let queue = Arc::new(common::HeldQueue::new(GPU0, 1));
    assert_eq!(format!("{:?}", DropPolicy::Defer(queue)), "Defer");
}

#[test]
fn states_and_kinds_have_lowercase_names_for_messages() {
    let states = [
        (MechanismState::Active, "active"),
        (MechanismState::Retired, "retired"),
        (MechanismState::DeviceLost, "device-lost"),
        (MechanismState::Terminated, "terminated"),
        (MechanismState::Removing, "being removed"),
    ];
    for (state, name) in states {
        assert_eq!((state.name(), state.to_string()), (name, name.to_owned()));
    }
    let contexts =
        [(ContextState::Live, "live"), (ContextState::Lost, "lost"), (ContextState::Terminated, "terminated")];
    for (state, name) in contexts {
        assert_eq!(state.to_string(), name);
    }
    let kinds = [
        (ObjectKind::ProviderContext, "provider context"),
        (ObjectKind::Authority, "authority"),
        (ObjectKind::Mechanism, "mechanism"),
        (ObjectKind::Binding, "binding"),
        (ObjectKind::Allocation, "allocation"),
    ];
    for (kind, name) in kinds {
        assert_eq!(kind.to_string(), name);
    }
}

#[test]
fn a_rejection_splits_into_the_handle_and_its_reason() {
    let registry = BindingRegistry::new();
    let (_, _, mechanism) = register(&registry, Arc::new(Caps::new(GPU0)));
    let binding = registry.bind_registered(&mechanism).unwrap();
    let other = registry.bind_registered(&mechanism).unwrap();
    let block = binding.allocate(request(64)).unwrap();
    let rejected: Rejected<_> = other.release(block).unwrap_err();
    assert!(rejected.to_string().contains("binding"), "{rejected}");
    let (block, reason) = rejected.into_parts();
    assert!(matches!(reason, HandleError::BindingMismatch { .. }));
    binding.release(block).unwrap();
}
