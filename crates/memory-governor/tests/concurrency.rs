//! Concurrency: threads hammering one limit never overcommit it (checked after every
//! step), idle credit of a live thread is pulled back for an admission that needs it,
//! and lowering a limit under load is obeyed by every admission that starts after it.
//! Nothing here depends on timing: each check holds under every interleaving.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, mpsc};

use common::*;
use memory_governor::*;

const GPU: DeviceKey = DeviceKey::device(0);

/// A tiny deterministic generator per thread (no timing, no global state).
struct Rng(u64);

impl Rng {
    fn next(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound
    }
}

#[test]
fn threads_hammering_one_limit_never_overcommit_it() {
    const LIMIT: u64 = 4096;
    const THREADS: u64 = 6;
    const STEPS: u64 = 3000;
    let (governor, account) = one_account(GPU, LIMIT, u64::MAX, 128);
    // Bytes the test holds in leases: raised after an admission, lowered before a
    // refund, so it never exceeds what is really charged.
    let held = Arc::new(AtomicU64::new(0));
    let successes = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(THREADS as usize));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (account, held, successes, failures, start) =
                (account.clone(), Arc::clone(&held), Arc::clone(&successes), Arc::clone(&failures), Arc::clone(&start));
            std::thread::spawn(move || {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (t + 1));
                let mut mine: Vec<Lease<&Account>> = Vec::new();
                start.wait();
                for _ in 0..STEPS {
                    match rng.next(4) {
                        0 | 1 => {
                            let bytes = 1 + rng.next(700);
                            match account.lease(MemoryRole::KvCache, bytes) {
                                Ok(lease) => {
                                    let now = held.fetch_add(bytes, Ordering::SeqCst) + bytes;
                                    assert!(now <= LIMIT, "leases hold {now} bytes over the limit {LIMIT}");
                                    successes.fetch_add(1, Ordering::Relaxed);
                                    mine.push(lease);
                                }
                                Err(err) => {
                                    assert_eq!(err.exhaustion().unwrap().limit, LIMIT);
                                    failures.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                        2 if !mine.is_empty() => {
                            let lease = mine.swap_remove(rng.next(mine.len() as u64) as usize);
                            held.fetch_sub(lease.bytes(), Ordering::SeqCst);
                            drop(lease);
                        }
                        _ => {
                            if let Some(lease) = mine.last_mut() {
                                let extra = rng.next(200);
                                if lease.grow(extra).is_ok() {
                                    let now = held.fetch_add(extra, Ordering::SeqCst) + extra;
                                    assert!(now <= LIMIT, "leases hold {now} bytes over the limit {LIMIT}");
                                } else {
                                    failures.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                    }
                    let used = account.device_used();
                    assert!(used <= LIMIT, "the device budget drew {used} bytes over its limit {LIMIT}");
                }
                for lease in mine.drain(..) {
                    held.fetch_sub(lease.bytes(), Ordering::SeqCst);
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    assert!(successes.load(Ordering::Relaxed) > 0 && failures.load(Ordering::Relaxed) > 0, "the limit was contended");
    let device = governor.snapshot();
    let device = device.device(GPU).unwrap();
    assert_eq!((device.current, device.used, device.cached_credit), (0, 0, 0), "books exact after the storm");
    assert!(device.peak <= device.peak_used && device.peak_used <= LIMIT, "{} {}", device.peak, device.peak_used);
    assert_eq!(device.totals.live, 0);
    assert_eq!(device.totals.failures, failures.load(Ordering::Relaxed));
}

#[test]
fn idle_credit_of_a_live_thread_is_pulled_back_for_an_admission_that_needs_it() {
    idle_credit_is_pulled_back(one_account(GPU, 1000, u64::MAX, 256).1);
}

#[test]
fn idle_credit_of_a_live_thread_is_pulled_back_when_the_quota_is_short() {
    // The device has room; the authority's quota is what the idle credit fills.
    idle_credit_is_pulled_back(one_account(GPU, u64::MAX, 1000, 256).1);
}

/// An idle thread caches credit of `account`, whose limit (device or quota) is 1000;
/// a lease of the whole 1000 on another thread must get that credit back.
fn idle_credit_is_pulled_back(account: Account) {
    let (cached_tx, cached_rx) = mpsc::channel();
    let (finish_tx, finish_rx) = mpsc::channel::<()>();
    let worker = account.clone();
    let idle = std::thread::spawn(move || {
        drop(worker.lease(MemoryRole::KvCache, 100).unwrap());
        cached_tx.send(worker.snapshot().cached_credit).unwrap();
        // Alive and idle, holding its credit, until told to finish.
        finish_rx.recv().unwrap();
    });
    let cached = cached_rx.recv().unwrap();
    assert!(cached > 0, "the idle thread caches credit");
    // The whole limit: only possible with the idle thread's credit back.
    let all = account.lease(MemoryRole::KvCache, 1000).expect("refused while credit sat with an idle thread");
    assert_eq!(account.snapshot().cached_credit, 0);
    // The admission that pulled the credit back drew straight from the books: it is
    // counted all the same (the idle thread's lease and this one opened, one closed).
    let role = account.snapshot().role(MemoryRole::KvCache).clone();
    assert_eq!((role.current, role.allocations, role.releases, role.live), (1000, 2, 1, 1));
    drop(all);
    finish_tx.send(()).unwrap();
    idle.join().unwrap();
}

/// A thread's very first charge of a role already draws its chunk of credit: the
/// next small charges on that thread are served from it, with no shared write.
#[test]
fn a_threads_first_charge_draws_a_chunk_of_credit_for_the_next() {
    let (_governor, account) = one_account(GPU, 1 << 20, u64::MAX, 256);
    let worker = account.clone();
    std::thread::spawn(move || {
        let first = worker.lease(MemoryRole::Activations, 100).unwrap();
        let snapshot = worker.snapshot();
        assert_eq!(snapshot.role(MemoryRole::Activations).current, 100);
        assert!(snapshot.cached_credit >= 256, "the first charge drew a chunk: {snapshot:?}");
        drop(first);
    })
    .join()
    .unwrap();
}

#[test]
fn lowering_a_limit_under_load_binds_every_admission_that_starts_after_it() {
    const OLD: u64 = 8192;
    const NEW: u64 = 1024;
    const THREADS: usize = 4;
    let (governor, account) = one_account(GPU, OLD, u64::MAX, 256);
    let held = Arc::new(AtomicU64::new(0));
    let lowered = Arc::new(AtomicBool::new(false));
    let checked_after = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(THREADS + 1));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (account, held, lowered, checked_after, start) = (
                account.clone(),
                Arc::clone(&held),
                Arc::clone(&lowered),
                Arc::clone(&checked_after),
                Arc::clone(&start),
            );
            std::thread::spawn(move || {
                let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ (t as u64 + 7));
                let mut mine: Vec<Lease<&Account>> = Vec::new();
                // Warm up: cache credit under the old limit.
                for _ in 0..20 {
                    drop(account.lease(MemoryRole::Activations, 1 + rng.next(300)).unwrap());
                }
                assert!(account.snapshot().cached_credit > 0);
                start.wait();
                let mut after = 0;
                // Run until this thread made 500 attempts after the lowering.
                while after < 500 {
                    let started_after_lowering = lowered.load(Ordering::SeqCst);
                    let bytes = 1 + rng.next(300);
                    if let Ok(lease) = account.lease(MemoryRole::Activations, bytes) {
                        let now = held.fetch_add(bytes, Ordering::SeqCst) + bytes;
                        if started_after_lowering {
                            assert!(now <= NEW, "an admission after lowering to {NEW} left {now} bytes charged");
                        }
                        mine.push(lease);
                    }
                    if started_after_lowering {
                        after += 1;
                    }
                    if (mine.len() > 4 || rng.next(3) == 0)
                        && let Some(lease) = mine.pop()
                    {
                        held.fetch_sub(lease.bytes(), Ordering::SeqCst);
                    }
                }
                checked_after.fetch_add(after, Ordering::Relaxed);
                for lease in mine.drain(..) {
                    held.fetch_sub(lease.bytes(), Ordering::SeqCst);
                }
            })
        })
        .collect();
    start.wait();
    // Lower while the workers run (wherever they are).
    governor.set_device_limit(GPU, NEW).unwrap();
    lowered.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.join().unwrap();
    }
    assert_eq!(checked_after.load(Ordering::Relaxed), 500 * THREADS as u64);
    governor.return_idle_credit();
    let device = governor.snapshot();
    assert_eq!(device.device(GPU).unwrap().used, 0);
}
