//! Leases: RAII charges that grow and shrink in place and are refunded exactly once.

mod common;

use common::*;
use memory_governor::*;

const GPU: DeviceKey = DeviceKey::device(0);

/// After `return_idle_credit`, `used` must equal what is charged: a refund counted
/// twice would leave it short (or wrapped), one never made would leave it high.
fn assert_books_exact(governor: &Governor, account: &Account, charged: u64) {
    governor.return_idle_credit();
    let snapshot = account.snapshot();
    assert_eq!(snapshot.current, charged, "current");
    assert_eq!(snapshot.used, charged, "used after returning idle credit");
    assert_eq!(snapshot.cached_credit, 0);
    assert_eq!(governor.snapshot().device(account.device()).unwrap().used, charged, "device used");
}

#[test]
fn a_lease_is_refunded_exactly_once_on_drop() {
    for chunk in [0, 16, 4096] {
        let (governor, account) = one_account(GPU, 10_000, u64::MAX, chunk);
        let lease = account.lease(MemoryRole::KvCache, 100).unwrap();
        assert_books_exact(&governor, &account, 100);
        drop(lease);
        assert_books_exact(&governor, &account, 0);
        let role = account.snapshot().role(MemoryRole::KvCache).clone();
        assert_eq!((role.allocations, role.releases, role.live), (1, 1, 0), "chunk {chunk}");
    }
}

#[test]
fn grow_and_shrink_change_the_charge_in_place() {
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 64);
    let mut lease = account.lease(MemoryRole::Activations, 100).unwrap();
    lease.grow(400).unwrap();
    assert_eq!(lease.bytes(), 500);
    assert_books_exact(&governor, &account, 500);
    lease.shrink(200).unwrap();
    assert_eq!(lease.bytes(), 300);
    assert_books_exact(&governor, &account, 300);
    lease.resize(900).unwrap();
    assert_books_exact(&governor, &account, 900);
    lease.resize(10).unwrap();
    assert_books_exact(&governor, &account, 10);
    // Growing and shrinking is one charge, not many.
    let role = account.snapshot().role(MemoryRole::Activations).clone();
    assert_eq!((role.allocations, role.releases, role.live), (1, 0, 1));
    drop(lease);
    assert_books_exact(&governor, &account, 0);
}

#[test]
fn a_failed_growth_or_shrink_changes_nothing() {
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 64);
    let mut lease = account.lease(MemoryRole::Workspace, 600).unwrap();
    let err = lease.grow(401).unwrap_err();
    assert_eq!(err.exhaustion().unwrap().requested, 401);
    assert_eq!(lease.bytes(), 600);
    let err = lease.shrink(601).unwrap_err();
    assert_eq!(err, ShrinkError { role: MemoryRole::Workspace, held: 600, requested: 601 });
    assert!(err.to_string().contains("at most 600"), "{err}");
    assert_eq!(lease.bytes(), 600);
    assert_books_exact(&governor, &account, 600);
    // Exactly the rest still fits.
    lease.grow(400).unwrap();
    assert_books_exact(&governor, &account, 1000);
}

#[test]
fn an_owned_lease_dropped_on_another_thread_is_refunded_there() {
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 64);
    let lease = account.lease_owned(MemoryRole::KvCache, 300).unwrap();
    std::thread::spawn(move || drop(lease)).join().unwrap();
    assert_books_exact(&governor, &account, 0);
    let role = account.snapshot().role(MemoryRole::KvCache).clone();
    assert_eq!((role.allocations, role.releases, role.live), (1, 1, 0));
}

#[test]
fn zero_byte_leases_are_counted_and_cost_nothing() {
    let (governor, account) = one_account(GPU, 0, u64::MAX, 64);
    let lease = account.lease(MemoryRole::Other, 0).unwrap();
    assert_eq!(account.snapshot().role(MemoryRole::Other).live, 1);
    drop(lease);
    assert_books_exact(&governor, &account, 0);
}

#[test]
fn leases_by_authority_go_through_the_governor() {
    let (governor, account) = one_account(GPU, 100, u64::MAX, 0);
    let lease = governor.lease(account.authority(), MemoryRole::Weights, 60).unwrap();
    assert_eq!(lease.account().authority(), account.authority());
    assert!(matches!(
        governor.lease(account.authority(), MemoryRole::Weights, 60),
        Err(LeaseRequestError::Admission(AdmissionError::Exhausted(_)))
    ));
    drop(lease);
    assert_books_exact(&governor, &account, 0);
}

#[test]
fn a_thread_that_ends_returns_its_credit() {
    let (governor, account) = one_account(GPU, 1 << 20, u64::MAX, 4096);
    let worker = account.clone();
    std::thread::spawn(move || {
        for _ in 0..10 {
            drop(worker.lease(MemoryRole::KvCache, 100).unwrap());
        }
        assert!(worker.snapshot().cached_credit > 0, "the thread caches credit while it runs");
    })
    .join()
    .unwrap();
    // Not pulled back by anyone: the thread's end returned it.
    let snapshot = account.snapshot();
    assert_eq!((snapshot.cached_credit, snapshot.used, snapshot.current), (0, 0, 0));
    let role = snapshot.role(MemoryRole::KvCache).clone();
    assert_eq!((role.allocations, role.releases), (10, 10), "counts of ended threads are kept");
    assert_eq!(governor.snapshot().device(GPU).unwrap().used, 0);
}

#[test]
fn a_lease_shrinks_to_zero_and_a_zero_shrink_is_no_refund() {
    let (governor, account) = one_account(GPU, 1000, u64::MAX, 0);
    governor.enable_timeline(8);
    let mut lease = account.lease(MemoryRole::Workspace, 300).unwrap();
    lease.shrink(0).unwrap();
    lease.shrink(300).expect("shrinking by everything it holds is allowed");
    assert_eq!((lease.bytes(), current(&account, MemoryRole::Workspace)), (0, 0));
    let kinds: Vec<_> = governor.timeline_events().0.iter().map(|e| (e.kind, e.bytes)).collect();
    assert_eq!(kinds, [(TimelineEventKind::Charge, 300), (TimelineEventKind::Refund, 300)]);
    drop(lease);
}
