//! The `serde` feature: through the governor alone, the registry's snapshots and the
//! contracts' values serialise too, beside the governor's own (always serialisable).
#![cfg(feature = "serde")]

use std::sync::Arc;

use memory_governor::*;

#[test]
fn registry_and_governor_snapshots_serialise_through_the_facade() {
    let registry = BindingRegistry::new();
    let device = DeviceKey::host(3);
    let context = registry.register_provider_context(device, Arc::new(())).unwrap();
    let tenant = registry.register_authority(device, Arc::new(())).unwrap();
    let governor = Governor::new();
    governor.open_account(AccountConfig::new(device, tenant).with_quota(1 << 20).with_label("tenant")).unwrap();
    let system: Arc<dyn DeviceAllocator> = Arc::new(allocator_cpu::SystemAllocator::for_device(device));
    let governed = governor.govern(system, tenant).unwrap();
    let mechanism = registry.register_allocator(&context, &tenant, Arc::new(governed)).unwrap();
    let binding = registry.bind(device).unwrap();
    let block = binding.allocate(AllocationRequest::new(4096, 64).unwrap().with_role(MemoryRole::KvCache)).unwrap();

    let registry_json = serde_json::to_value(registry.snapshots()).unwrap();
    assert_eq!(registry_json["mechanisms"][0]["identity"], mechanism.to_string());
    assert_eq!(registry_json["mechanisms"][0]["live_bytes"], 4096);
    let governor_json = serde_json::to_value(governor.snapshot()).unwrap();
    assert_eq!(governor_json["devices"][0]["current"], 4096);
    assert_eq!(serde_json::to_value(MemoryRole::KvCache).unwrap(), "KvCache");
    binding.release(block).unwrap();
}
