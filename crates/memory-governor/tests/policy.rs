//! Policies: hard limit, reclaim then fail (holders asked in order, outside any lock,
//! one retry, stingy holders respected), and guaranteed reserves per role.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use memory_governor::*;

const GPU: DeviceKey = DeviceKey::device(0);

fn leases(account: &Account, role: MemoryRole, sizes: &[u64]) -> Vec<OwnedLease> {
    sizes.iter().map(|&bytes| account.lease_owned(role, bytes).unwrap()).collect()
}

#[test]
fn hard_limit_never_asks_holders() {
    let (governor, account) = one_account(GPU, 100, u64::MAX, 0);
    let asked = Arc::new(Mutex::new(Vec::new()));
    let holder = LeaseHolder::new("kv", leases(&account, MemoryRole::KvCache, &[50, 50]), u64::MAX, Arc::clone(&asked));
    governor.register_holder(GPU, 0, holder);
    let err = account.lease(MemoryRole::Weights, 10).unwrap_err();
    assert!(asked.lock().unwrap().is_empty(), "hard-limit asked a holder");
    let exhaustion = err.exhaustion().unwrap();
    assert_eq!(exhaustion.reclaimed, None);
    let largest = exhaustion.largest_holder.as_ref().unwrap();
    assert_eq!((largest.name.as_str(), largest.reclaimable), ("kv", 100));
    assert!(err.to_string().contains("ReclaimThenFail"), "the message says what to change: {err}");
}

#[test]
fn reclaim_asks_holders_in_order_for_what_is_missing_then_retries_once() {
    let (governor, account) = one_account(GPU, 100, u64::MAX, 0);
    governor.set_policy(GPU, Arc::new(ReclaimThenFail)).unwrap();
    let asked = Arc::new(Mutex::new(Vec::new()));
    // Registered out of order: "second" (order 5) before "first" (order 1).
    let second =
        LeaseHolder::new("second", leases(&account, MemoryRole::KvCache, &[30, 30]), u64::MAX, Arc::clone(&asked));
    let first = LeaseHolder::new("first", leases(&account, MemoryRole::KvCache, &[20]), u64::MAX, Arc::clone(&asked));
    let last = LeaseHolder::new("last", leases(&account, MemoryRole::KvCache, &[20]), u64::MAX, Arc::clone(&asked));
    governor.register_holder(GPU, 5, second);
    governor.register_holder(GPU, 1, first);
    governor.register_holder(GPU, 9, last);
    // 100 used; 45 wanted: "first" frees 20, "second" is asked for the 25 still
    // missing and frees 30; "last" is not asked.
    let lease = account.lease(MemoryRole::Weights, 45).expect("reclaim made room");
    assert_eq!(*asked.lock().unwrap(), vec![("first".to_owned(), 45), ("second".to_owned(), 25)]);
    assert_eq!(lease.bytes(), 45);
    let snapshot = governor.snapshot();
    assert_eq!(snapshot.device(GPU).unwrap().current, 45 + 30 + 20);
    assert_eq!(snapshot.device(GPU).unwrap().totals.failures, 0);
}

#[test]
fn a_stingy_holder_is_respected_and_the_request_fails_cleanly() {
    let (governor, account) = one_account(GPU, 100, u64::MAX, 0);
    governor.set_policy(GPU, Arc::new(ReclaimThenFail)).unwrap();
    let asked = Arc::new(Mutex::new(Vec::new()));
    // Holds 100 but frees at most 10 per request.
    let stingy = LeaseHolder::new("stingy", leases(&account, MemoryRole::KvCache, &[10; 10]), 10, Arc::clone(&asked));
    governor.register_holder(GPU, 0, stingy);
    let err = account.lease(MemoryRole::Weights, 40).unwrap_err();
    // Asked once, for everything missing; not asked again; one retry, then a clean error.
    assert_eq!(*asked.lock().unwrap(), vec![("stingy".to_owned(), 40)]);
    let exhaustion = err.exhaustion().unwrap();
    assert_eq!(exhaustion.reclaimed, Some(10));
    assert_eq!((exhaustion.used, exhaustion.available), (90, 10));
    assert!(err.to_string().contains("reclaim holders freed 10 bytes"), "{err}");
    // Nothing was charged for the refused request.
    assert_eq!(account.snapshot().role(MemoryRole::Weights).current, 0);
    assert_eq!(account.snapshot().current, 90);
}

/// A holder that calls back into the governor while reclaiming: no governor lock is
/// held across the callback, so this neither deadlocks nor poisons anything.
struct Reentrant {
    governor: Governor,
    account: Account,
    leases: Mutex<Vec<OwnedLease>>,
}

impl ReclaimHolder for Reentrant {
    fn name(&self) -> &str {
        "reentrant"
    }

    fn reclaimable(&self, _device: DeviceKey) -> u64 {
        let _ = self.governor.snapshot();
        self.leases.lock().unwrap().iter().map(|l| l.bytes()).sum()
    }

    fn reclaim(&self, request: &ReclaimRequest) -> u64 {
        let _ = self.governor.snapshot();
        self.governor.set_device_limit(request.device, 100).unwrap();
        let probe = self.account.lease(MemoryRole::Other, 0).unwrap();
        drop(probe);
        let freed: u64 = self.leases.lock().unwrap().drain(..).map(|l| l.bytes()).sum();
        freed
    }
}

#[test]
fn holders_run_with_no_governor_lock_held() {
    let (governor, account) = one_account(GPU, 100, u64::MAX, 0);
    governor.set_policy(GPU, Arc::new(ReclaimThenFail)).unwrap();
    let holder = Arc::new(Reentrant {
        governor: governor.clone(),
        account: account.clone(),
        leases: Mutex::new(leases(&account, MemoryRole::KvCache, &[60])),
    });
    governor.register_holder(GPU, 0, holder);
    let lease = account.lease(MemoryRole::Weights, 80).unwrap();
    assert_eq!(lease.bytes(), 80);
    // And an error path, which asks `reclaimable`, re-enters too.
    assert!(account.lease(MemoryRole::Weights, 80).is_err());
}

#[test]
fn unregistered_holders_are_not_asked() {
    let (governor, account) = one_account(GPU, 100, u64::MAX, 0);
    governor.set_policy(GPU, Arc::new(ReclaimThenFail)).unwrap();
    let asked = Arc::new(Mutex::new(Vec::new()));
    let holder = LeaseHolder::new("gone", leases(&account, MemoryRole::KvCache, &[100]), u64::MAX, Arc::clone(&asked));
    let id = governor.register_holder(GPU, 0, holder);
    // Keep the holder (and the leases it holds) alive after unregistering it.
    let removed = governor.unregister_holder(id).expect("it was registered");
    assert!(governor.unregister_holder(id).is_none());
    assert!(account.lease(MemoryRole::Weights, 1).is_err());
    assert!(asked.lock().unwrap().is_empty());
    drop(removed);
}

#[test]
fn a_guaranteed_reserve_keeps_weights_from_being_squeezed_out_by_kv_growth() {
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 16);
    let policy = GuaranteedReserve::new(Arc::new(HardLimit)).with_reserve(MemoryRole::Weights, 400);
    governor.set_policy(GPU, Arc::new(policy)).unwrap();
    // The KV cache grows as far as it can: 600, not a byte more.
    let mut kv = account.lease(MemoryRole::KvCache, 1).unwrap();
    while kv.grow(1).is_ok() {}
    assert_eq!(kv.bytes(), 600);
    let err = account.lease(MemoryRole::KvCache, 1).unwrap_err();
    assert_eq!(err.exhaustion().unwrap().available, 0, "{err}");
    // Weights still get their 400.
    let weights = account.lease(MemoryRole::Weights, 400).expect("the reserve holds");
    assert!(account.lease(MemoryRole::Weights, 1).is_err(), "the device is full");
    // Weights beyond their reserve compete like anyone else.
    drop(kv);
    let more_weights = account.lease(MemoryRole::Weights, 600).unwrap();
    drop((weights, more_weights));
    governor.return_idle_credit();
    let device = governor.snapshot();
    let device = device.device(GPU).unwrap();
    assert_eq!(device.current, 0);
    assert_eq!(device.used, 400, "an idle device still holds the reserve");
    assert_eq!(device.reserves.len(), 1);
    assert_eq!((device.reserves[0].target, device.reserves[0].held), (400, 400));
    assert!(device.policy.starts_with("guaranteed-reserve"));
}

#[test]
fn weights_inside_their_reserve_leave_the_shared_budget_to_others() {
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 0);
    let policy = GuaranteedReserve::new(Arc::new(HardLimit)).with_reserve(MemoryRole::Weights, 400);
    governor.set_policy(GPU, Arc::new(policy)).unwrap();
    let weights = account.lease(MemoryRole::Weights, 300).unwrap();
    // 300 weights sit inside their reserve: the KV cache still has 600.
    let kv = account.lease(MemoryRole::KvCache, 600).unwrap();
    assert!(account.lease(MemoryRole::KvCache, 1).is_err());
    // And weights have 100 of reserve left.
    let _rest = account.lease(MemoryRole::Weights, 100).unwrap();
    drop((weights, kv));
}

#[test]
fn a_reserve_that_does_not_fit_hands_the_policy_back_and_changes_nothing() {
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 0);
    let _held = account.lease(MemoryRole::KvCache, 700).unwrap();
    let policy: Arc<dyn AdmissionPolicy> =
        Arc::new(GuaranteedReserve::new(Arc::new(HardLimit)).with_reserve(MemoryRole::Weights, 400));
    let err = governor.set_policy(GPU, Arc::clone(&policy)).unwrap_err();
    assert!(Arc::ptr_eq(&err.policy, &policy), "the policy is handed back");
    assert_eq!((err.role, err.reserve, err.available), (MemoryRole::Weights, 400, 300));
    assert!(err.to_string().contains("reserve less"), "{err}");
    assert_eq!(governor.policy_name(GPU), "hard-limit");
    assert_eq!(governor.snapshot().device(GPU).unwrap().used, 700);
    // A limit below the reserves is refused too.
    let small: Arc<dyn AdmissionPolicy> =
        Arc::new(GuaranteedReserve::new(Arc::new(HardLimit)).with_reserve(MemoryRole::Weights, 200));
    governor.set_policy(GPU, small).unwrap();
    let err = governor.set_device_limit(GPU, 100).unwrap_err();
    assert_eq!(err, LimitError::BelowReserves { device: GPU, requested: 100, reserved: 200 });
    // Replacing the policy gives the reserve back.
    governor.set_policy(GPU, Arc::new(HardLimit)).unwrap();
    assert_eq!(governor.snapshot().device(GPU).unwrap().used, 700);
}

#[test]
fn a_second_reserve_that_does_not_fit_undoes_the_first_and_changes_nothing() {
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 0);
    let _held = account.lease(MemoryRole::KvCache, 600).unwrap();
    // Together the reserves fit the limit, but not on top of what is charged: weights
    // are raised first, then activations do not fit, and weights are put back.
    let policy: Arc<dyn AdmissionPolicy> = Arc::new(
        GuaranteedReserve::new(Arc::new(HardLimit))
            .with_reserve(MemoryRole::Weights, 300)
            .with_reserve(MemoryRole::Activations, 300),
    );
    let err = governor.set_policy(GPU, Arc::clone(&policy)).unwrap_err();
    assert_eq!((err.role, err.reserve, err.available), (MemoryRole::Activations, 300, 100));
    assert!(Arc::ptr_eq(&err.policy, &policy));
    let snapshot = governor.snapshot();
    let device = snapshot.device(GPU).unwrap();
    assert_eq!((device.used, device.reserves.len(), device.policy.as_str()), (600, 0, "hard-limit"));
    let debug = format!("{err:?}");
    assert!(debug.contains("Activations") && debug.contains("guaranteed-reserve(hard-limit)"), "{debug}");
    assert!(format!("{policy:?}").contains("AdmissionPolicy(guaranteed-reserve(hard-limit))"));
    let reserve = GuaranteedReserve::new(Arc::new(ReclaimThenFail)).with_reserve(MemoryRole::Weights, 7);
    assert!(format!("{reserve:?}").contains("reclaim-then-fail"), "{reserve:?}");
}

#[test]
fn holders_are_named_in_debug_output_and_ids_name_their_device() {
    let (governor, account) = one_account(GPU, 100, u64::MAX, 0);
    let asked = Arc::new(Mutex::new(Vec::new()));
    let holder: Arc<dyn ReclaimHolder> =
        LeaseHolder::new("kv", leases(&account, MemoryRole::KvCache, &[10]), 10, asked);
    assert_eq!(format!("{holder:?}"), "ReclaimHolder(kv)");
    let id = governor.register_holder(GPU, 0, holder);
    assert_eq!(id.device(), GPU);
    assert!(governor.unregister_holder(id).is_some());
    assert!(governor.unregister_holder(id).is_none(), "unregistered once");
}

#[test]
fn a_device_refusal_counts_the_roles_own_reserve_as_available_and_a_quota_refusal_does_not() {
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 0);
    let policy = GuaranteedReserve::new(Arc::new(HardLimit)).with_reserve(MemoryRole::Weights, 300);
    governor.set_policy(GPU, Arc::new(policy)).unwrap();
    assert_eq!(account.device_used(), 300, "the idle reserve is held on the device");
    let _kv = account.lease(MemoryRole::KvCache, 700).unwrap();
    assert_eq!((account.device_used(), account.used()), (1000, 700));
    // The device is full, but weights still have their 300.
    let err = account.lease(MemoryRole::Weights, 400).unwrap_err();
    let exhaustion = err.exhaustion().unwrap();
    assert_eq!((exhaustion.scope, exhaustion.available), (LimitScope::Device, 300), "{err}");
    // With a quota of 900 (700 used) the quota refuses first: no reserve counts.
    governor.set_quota(account.authority(), 900).unwrap();
    let err = account.lease(MemoryRole::Weights, 250).unwrap_err();
    let exhaustion = err.exhaustion().unwrap();
    assert_eq!((exhaustion.scope, exhaustion.available), (LimitScope::Authority, 200), "{err}");
}

#[test]
fn reserves_may_add_up_to_exactly_the_limit() {
    let (governor, _account) = one_account(GPU, 1000, u64::MAX, 0);
    let policy = GuaranteedReserve::new(Arc::new(HardLimit))
        .with_reserve(MemoryRole::Weights, 600)
        .with_reserve(MemoryRole::KvCache, 400);
    governor.set_policy(GPU, Arc::new(policy)).expect("600 + 400 fit a limit of 1000");
    assert_eq!(governor.snapshot().device(GPU).unwrap().used, 1000);
}

#[test]
fn refusals_say_which_holder_could_help_and_what_to_install() {
    let (governor, account) = one_account(GPU, 100, u64::MAX, 0);
    let _all = account.lease(MemoryRole::KvCache, 100).unwrap();
    let message = account.lease(MemoryRole::Weights, 1).unwrap_err().to_string();
    assert!(message.contains("register a reclaim holder"), "no holder: say so: {message}");
    // A holder that could free nothing is named, but no reclaiming policy is advised.
    let asked = Arc::new(Mutex::new(Vec::new()));
    governor.register_holder(GPU, 0, LeaseHolder::new("empty", Vec::new(), u64::MAX, asked));
    let message = account.lease(MemoryRole::Weights, 1).unwrap_err().to_string();
    assert!(message.contains("\"empty\" (0 bytes"), "{message}");
    assert!(!message.contains("install a policy that reclaims") && !message.contains("register a reclaim holder"));
}
