//! Books: limits per device key, quotas nested in device budgets, per-role accounting,
//! limits changed at run time, and the typed errors.

mod common;

use std::sync::Arc;

use common::*;
use memory_governor::*;

const GPU: DeviceKey = DeviceKey::device(0);

#[test]
fn device_limit_refuses_what_does_not_fit_and_says_why() {
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 0);
    let _held = account.lease(MemoryRole::Weights, 900).unwrap();
    let err = account.lease(MemoryRole::KvCache, 200).unwrap_err();
    let exhaustion = err.exhaustion().expect("an exhaustion report");
    assert_eq!(exhaustion.tier, Tier::Device);
    assert_eq!(exhaustion.device, GPU);
    assert_eq!(exhaustion.authority, account.authority());
    assert_eq!(exhaustion.role, MemoryRole::KvCache);
    assert_eq!(exhaustion.scope, LimitScope::Device);
    assert_eq!((exhaustion.requested, exhaustion.used, exhaustion.limit, exhaustion.available), (200, 900, 1000, 100));
    let text = err.to_string();
    for needle in [
        "kv-cache request of 200 bytes",
        "device:0 (device tier)",
        "device limit",
        "900 of 1000 bytes used, 100 available",
        "\"tenant\"",
        "no reclaim holder is registered",
        "Governor::set_device_limit",
        "hard-limit",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in: {text}");
    }
    assert_eq!(governor.snapshot().device(GPU).unwrap().role(MemoryRole::KvCache).failures, 1);
}

#[test]
fn limits_are_kept_per_device_key() {
    let governor = governor(64);
    let keys = [DeviceKey::device(0), DeviceKey::device(1), DeviceKey::HOST, DeviceKey::disk(0)];
    let mut accounts = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        governor.set_device_limit(*key, 100 * (i as u64 + 1)).unwrap();
        accounts.push(governor.open_account(AccountConfig::new(*key, authority())).unwrap());
    }
    // Each device holds exactly its own limit, whatever the others hold.
    let leases: Vec<_> =
        accounts.iter().enumerate().map(|(i, a)| a.lease(MemoryRole::Other, 100 * (i as u64 + 1)).unwrap()).collect();
    for (i, account) in accounts.iter().enumerate() {
        let err = account.lease(MemoryRole::Other, 1).unwrap_err();
        assert_eq!(err.exhaustion().unwrap().device, keys[i]);
        assert_eq!(err.exhaustion().unwrap().tier, keys[i].tier());
    }
    drop(leases);
    let snapshot = governor.snapshot();
    assert_eq!(snapshot.devices.len(), 4);
    for (i, key) in keys.iter().enumerate() {
        let device = snapshot.device(*key).unwrap();
        assert_eq!(device.limit, Some(100 * (i as u64 + 1)));
        assert_eq!(device.current, 0);
        assert_eq!(device.tier, key.tier().name());
    }
}

#[test]
fn authority_quotas_nest_inside_the_device_budget() {
    let governor = governor(0);
    governor.set_device_limit(GPU, 10).unwrap();
    let a = governor.open_account(AccountConfig::new(GPU, authority()).with_quota(6).with_label("a")).unwrap();
    let b = governor.open_account(AccountConfig::new(GPU, authority()).with_quota(6).with_label("b")).unwrap();
    let a_lease = a.lease(MemoryRole::KvCache, 6).unwrap();
    let err = a.lease(MemoryRole::KvCache, 1).unwrap_err();
    assert_eq!(err.exhaustion().unwrap().scope, LimitScope::Authority, "{err}");
    assert!(err.to_string().contains("authority quota") && err.to_string().contains("Governor::set_quota"), "{err}");
    // B's quota has room, but the device has only 4 left.
    let b_lease = b.lease(MemoryRole::KvCache, 4).unwrap();
    let err = b.lease(MemoryRole::KvCache, 1).unwrap_err();
    assert_eq!(err.exhaustion().unwrap().scope, LimitScope::Device, "{err}");
    assert_eq!(err.exhaustion().unwrap().available, 0);
    drop(a_lease);
    let b_more = b.lease(MemoryRole::KvCache, 2).unwrap();
    assert!(b.lease(MemoryRole::KvCache, 1).is_err(), "b is at its quota of 6");
    drop((b_lease, b_more));
    let device = governor.snapshot();
    let device = device.device(GPU).unwrap();
    assert_eq!(device.authority(a.authority()).unwrap().quota, Some(6));
    assert_eq!(device.current, 0);
}

#[test]
fn every_role_is_accounted_separately() {
    let (governor, account) = one_account(GPU, u64::MAX, u64::MAX, 32);
    let sizes = [
        (MemoryRole::Weights, 700),
        (MemoryRole::KvCache, 300),
        (MemoryRole::Activations, 50),
        (MemoryRole::Workspace, 7),
    ];
    let leases: Vec<_> = sizes.iter().map(|&(role, bytes)| account.lease(role, bytes).unwrap()).collect();
    let snapshot = account.snapshot();
    for (role, bytes) in sizes {
        assert_eq!(snapshot.role(role).current, bytes, "{role}");
        assert_eq!(snapshot.role(role).live, 1, "{role}");
    }
    assert_eq!(snapshot.role(MemoryRole::Staging).current, 0);
    assert_eq!(snapshot.current, 1057);
    let device = governor.snapshot();
    assert_eq!(device.device(GPU).unwrap().role(MemoryRole::Weights).current, 700);
    drop(leases);
    assert_eq!(account.snapshot().current, 0);
}

#[test]
fn lowering_a_limit_revokes_nothing_and_refuses_until_usage_falls() {
    let (governor, account) = one_account(GPU, 100, u64::MAX, 8);
    let big = account.lease(MemoryRole::KvCache, 80).unwrap();
    assert_eq!(governor.set_device_limit(GPU, 50).unwrap(), Some(100));
    // Nothing revoked.
    assert_eq!(big.bytes(), 80);
    assert_eq!(current(&account, MemoryRole::KvCache), 80);
    // Refused while usage is above the new limit, even for a byte, even from credit.
    let err = account.lease(MemoryRole::KvCache, 1).unwrap_err();
    assert_eq!((err.exhaustion().unwrap().limit, err.exhaustion().unwrap().available), (50, 0));
    drop(big);
    // Usage fell below: the new limit applies exactly.
    let at_limit = account.lease(MemoryRole::KvCache, 50).unwrap();
    assert!(account.lease(MemoryRole::KvCache, 1).is_err());
    // Raised: room again.
    assert_eq!(governor.set_device_limit(GPU, 200).unwrap(), Some(50));
    let more = account.lease(MemoryRole::KvCache, 150).unwrap();
    assert!(account.lease(MemoryRole::KvCache, 1).is_err());
    drop((at_limit, more));
    assert_eq!(governor.device_limit(GPU), Some(200));
}

#[test]
fn lowering_a_quota_behaves_like_lowering_a_device_limit() {
    let (governor, account) = one_account(GPU, u64::MAX, 100, 8);
    let held = account.lease(MemoryRole::Weights, 60).unwrap();
    assert_eq!(governor.set_quota(account.authority(), 40).unwrap(), Some(100));
    assert!(account.lease(MemoryRole::Weights, 1).is_err());
    drop(held);
    let _at_quota = account.lease(MemoryRole::Weights, 40).unwrap();
    assert_eq!(account.lease(MemoryRole::Weights, 1).unwrap_err().exhaustion().unwrap().scope, LimitScope::Authority);
    assert_eq!(account.quota(), Some(40));
}

#[test]
fn oversized_requests_are_overflow_errors_and_charge_nothing() {
    let (_governor, account) = one_account(GPU, u64::MAX, u64::MAX, 0);
    let err = account.lease(MemoryRole::Weights, MAX_CHARGE + 1).unwrap_err();
    assert!(matches!(err, AdmissionError::Overflow { requested, held: 0, .. } if requested == MAX_CHARGE + 1), "{err}");
    assert!(err.to_string().contains("split"), "{err}");
    let mut lease = account.lease(MemoryRole::Weights, 10).unwrap();
    let err = lease.grow(MAX_CHARGE).unwrap_err();
    assert!(matches!(err, AdmissionError::Overflow { held: 10, .. }), "{err}");
    assert_eq!(lease.bytes(), 10);
    assert_eq!(current(&account, MemoryRole::Weights), 10);
    // Growing to exactly the largest charge is allowed.
    lease.grow(MAX_CHARGE - 10).unwrap();
    assert_eq!(lease.bytes(), MAX_CHARGE);
}

#[test]
fn unknown_authorities_are_typed_errors_that_hand_handles_back() {
    let governor = governor(0);
    let stranger = authority();
    assert_eq!(governor.account(stranger).unwrap_err(), AccountError::UnknownAuthority { authority: stranger });
    assert!(matches!(governor.set_quota(stranger, 1), Err(LimitError::Account(AccountError::UnknownAuthority { .. }))));
    assert!(matches!(
        governor.lease(stranger, MemoryRole::Other, 1),
        Err(LeaseRequestError::Account(AccountError::UnknownAuthority { .. }))
    ));
    let allocator: Arc<dyn DeviceAllocator> = Arc::new(memory_testkit::RecordingAllocator::host());
    let err = governor.govern(Arc::clone(&allocator), stranger).unwrap_err();
    assert!(Arc::ptr_eq(&err.allocator, &allocator), "the allocator is handed back");
    assert!(err.to_string().contains("Governor::open_account"), "{err}");
}

#[test]
fn an_authority_has_one_account() {
    let governor = governor(0);
    let who = authority();
    governor.open_account(AccountConfig::new(GPU, who)).unwrap();
    let err = governor.open_account(AccountConfig::new(GPU, who)).unwrap_err();
    assert_eq!(err, AccountError::AlreadyOpen { authority: who, device: GPU });
}

#[test]
fn a_governed_allocator_must_serve_the_account_device() {
    let governor = governor(0);
    let who = authority();
    governor.open_account(AccountConfig::new(GPU, who)).unwrap();
    let host: Arc<dyn DeviceAllocator> = Arc::new(memory_testkit::RecordingAllocator::host());
    let err = governor.govern(Arc::clone(&host), who).unwrap_err();
    assert!(matches!(err.failure, GovernFailure::DeviceMismatch { .. }));
    assert!(Arc::ptr_eq(&err.allocator, &host));
    assert!(err.to_string().contains("host:0") && err.to_string().contains("device:0"), "{err}");
    let debug = format!("{err:?}");
    assert!(debug.contains("DeviceMismatch") && debug.contains("allocator"), "{debug}");
}

#[test]
fn a_role_whose_usage_would_pass_the_largest_charge_is_an_overflow() {
    let (_governor, account) = one_account(GPU, u64::MAX, u64::MAX, 0);
    let full = account.lease(MemoryRole::KvCache, MAX_CHARGE).unwrap();
    let err = account.lease(MemoryRole::KvCache, 1).unwrap_err();
    assert!(matches!(err, AdmissionError::Overflow { requested: 1, held, .. } if held == MAX_CHARGE), "{err}");
    assert!(err.exhaustion().is_none());
    // Another role is not affected.
    drop(account.lease(MemoryRole::Weights, 1).unwrap());
    drop(full);
    assert_eq!(current(&account, MemoryRole::KvCache), 0);
}

#[test]
fn handles_and_tunables_describe_themselves() {
    let config = GovernorConfig::default().with_credit_chunk(1 << 10);
    assert_eq!(config.chunk(), 1 << 10);
    assert_eq!(
        GovernorConfig::default().with_credit_chunk(u64::MAX).chunk(),
        GovernorConfig::default().with_credit_chunk(u64::MAX / 2).chunk(),
        "capped"
    );
    let governor = Governor::with_config(config);
    assert_eq!(governor.config(), config);
    assert!(format!("{governor:?}").contains("credit_chunk: 1024"), "{governor:?}");
    assert_eq!(Governor::default().config(), GovernorConfig::default());
    let who = authority();
    let account = governor.open_account(AccountConfig::new(GPU, who).with_label("tenant-a")).unwrap();
    assert_eq!((account.label(), account.device(), account.quota()), ("tenant-a", GPU, None));
    let debug = format!("{account:?}");
    assert!(debug.contains("tenant-a") && debug.contains(&who.to_string()), "{debug}");
    let lease = account.lease(MemoryRole::Workspace, 5).unwrap();
    assert_eq!(lease.role(), MemoryRole::Workspace);
    assert!(format!("{lease:?}").contains("Workspace"), "{lease:?}");
    let unlabelled = governor.open_account(AccountConfig::new(GPU, authority())).unwrap();
    assert!(unlabelled.label().starts_with("auth:"), "{}", unlabelled.label());
}

#[test]
fn charges_made_while_a_thread_is_torn_down_balance_the_books() {
    use std::cell::RefCell;
    /// Takes a lease, grows it and drops it from a thread-local destructor that runs
    /// after the governor's own per-thread state is gone.
    struct LateCharge(Option<Account>);
    impl Drop for LateCharge {
        fn drop(&mut self) {
            if let Some(account) = self.0.take() {
                let mut lease = account.lease(MemoryRole::Staging, 100).unwrap();
                lease.grow(50).unwrap();
                lease.shrink(20).unwrap();
            }
        }
    }
    thread_local! {
        static LATE: RefCell<LateCharge> = const { RefCell::new(LateCharge(None)) };
    }
    // Chunks of 1000: the later charge below is cached credit, not an exact draw.
    let (governor, account) = one_account(GPU, 10_000, u64::MAX, 1000);
    let late = account.clone();
    std::thread::spawn(move || {
        // Registered before the governor's thread state, so destroyed after it.
        LATE.with(|cell| cell.borrow_mut().0 = Some(late.clone()));
        drop(late.lease(MemoryRole::Staging, 10).unwrap());
    })
    .join()
    .unwrap();
    governor.return_idle_credit();
    let snapshot = account.snapshot();
    let role = snapshot.role(MemoryRole::Staging);
    assert_eq!((role.current, role.allocations, role.releases, role.live), (0, 2, 2, 0));
    assert_eq!((role.peak, account.used()), (150, 0));
    // What the torn-down thread published nets to zero: a later charge peaks at itself.
    let big = account.lease(MemoryRole::Staging, 500).unwrap();
    assert_eq!(account.snapshot().role(MemoryRole::Staging).peak, 500);
    drop(big);
}
