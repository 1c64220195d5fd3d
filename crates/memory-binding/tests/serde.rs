//! The `serde` feature: every snapshot and report serialises, identities as their
//! display form, so a serving stack can export the registry's state as JSON.
#![cfg(feature = "serde")]

mod common;

use std::sync::Arc;

use common::{Caps, PAGE, bind, register, request};
use memory_api::DeviceKey;
use memory_binding::BindingRegistry;

#[test]
fn registry_snapshots_and_reports_serialise_with_typed_identities_as_strings() {
    let registry = BindingRegistry::new();
    let gpu = DeviceKey::device(0);
    let (context, authority, mechanism) = register(&registry, Arc::new(Caps::new(gpu)));
    let binding = bind(&registry, &mechanism);
    let block = binding.allocate(request(PAGE)).unwrap();

    let json = serde_json::to_value(registry.snapshots()).unwrap();
    assert_eq!(json["registry"], registry.id().to_string());
    let mechanisms = json["mechanisms"].as_array().unwrap();
    assert_eq!(mechanisms.len(), 1);
    assert_eq!(mechanisms[0]["identity"], mechanism.to_string());
    assert_eq!(mechanisms[0]["context"], context.to_string());
    assert_eq!(mechanisms[0]["authority"], authority.to_string());
    assert_eq!(mechanisms[0]["state"], "Active");
    assert_eq!(mechanisms[0]["live_allocations"], 1);
    assert_eq!(json["contexts"][0]["state"], "Live");

    drop(block);
    let invalidation = registry.invalidate_device(gpu, "Xid 79");
    let json = serde_json::to_value(invalidation).unwrap();
    assert_eq!(json["mechanisms"], 1);
    let report = registry.confirm_context_terminated(&context).unwrap();
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["context"], context.to_string());
    assert_eq!(json["mechanisms"], 1);
    let snapshot = serde_json::to_value(registry.snapshot(&mechanism).unwrap()).unwrap();
    assert_eq!(snapshot["state"], "Terminated");
    assert_eq!(snapshot["lost_reason"], "Xid 79");
}
