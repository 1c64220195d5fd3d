//! The `serde` feature: plain data round-trips, identities serialise as their display
//! form and cannot be deserialised (they are minted by a registry, never read in).
#![cfg(feature = "serde")]

use memory_api::{AllocatorStats, DeviceKey, IdentityIssuer, MemoryRole, Tier};

#[test]
fn devices_roles_and_stats_round_trip_through_json() {
    for device in [DeviceKey::HOST, DeviceKey::device(3), DeviceKey::host(7)] {
        let text = serde_json::to_string(&device).unwrap();
        assert_eq!(serde_json::from_str::<DeviceKey>(&text).unwrap(), device, "{text}");
    }
    let role = MemoryRole::KvCache;
    assert_eq!(serde_json::from_str::<MemoryRole>(&serde_json::to_string(&role).unwrap()).unwrap(), role);
    assert_eq!(serde_json::to_string(&Tier::Device).unwrap(), "\"Device\"");
    let stats = AllocatorStats { live_bytes: 4096, ..AllocatorStats::default() };
    assert_eq!(serde_json::from_str::<AllocatorStats>(&serde_json::to_string(&stats).unwrap()).unwrap(), stats);
}

#[test]
fn identities_serialise_as_their_display_form() {
    let issuer = IdentityIssuer::new().unwrap();
    let mechanism = issuer.mechanism().unwrap();
    assert_eq!(serde_json::to_value(mechanism).unwrap(), serde_json::Value::String(mechanism.to_string()));
    assert_eq!(
        serde_json::to_value(issuer.registry()).unwrap(),
        serde_json::Value::String(issuer.registry().to_string())
    );
}
