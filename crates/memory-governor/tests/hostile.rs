//! Hostile callers and callbacks (issue 11): inner allocators that lie about which
//! block a release answer is about, forged provider tags, callbacks that re-enter the
//! governor from under what used to be a lock, reclaim holders that recurse. Every
//! test here must be fast: they run in CI.

mod common;

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use memory_governor::*;

const DEV: DeviceKey = DeviceKey::host(11);

/// What [`Liar`] answers to its next release.
#[derive(Copy, Clone, Debug)]
enum Answer {
    /// A quarantine about another block than the one given.
    QuarantineOther { unmapped: usize, residual: usize },
    /// A failure that hands back another block than the one given.
    FailOther,
}

/// A counter allocator (no memory behind it) that keeps honest records, answers
/// releases from a script when one is queued, and counts its callbacks.
struct Liar {
    next: AtomicU64,
    live: Mutex<HashSet<u64>>,
    script: Mutex<VecDeque<Answer>>,
    releases: AtomicU64,
}

impl Liar {
    fn new() -> Arc<Liar> {
        Arc::new(Liar {
            next: AtomicU64::new(1 << 20),
            live: Mutex::new(HashSet::new()),
            script: Mutex::new(VecDeque::new()),
            releases: AtomicU64::new(0),
        })
    }

    fn answer_next_release(&self, answer: Answer) {
        self.script.lock().unwrap().push_back(answer);
    }

    fn releases(&self) -> u64 {
        self.releases.load(Ordering::Relaxed)
    }

    fn other_block(bytes: usize) -> RawAllocation {
        RawAllocation::new(DeviceAddress::new(0xdead_0000).unwrap(), bytes, 64, DEV, 0)
    }
}

impl DeviceAllocator for Liar {
    fn device(&self) -> DeviceKey {
        DEV
    }

    fn name(&self) -> &str {
        "liar"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let address = self.next.fetch_add(1 << 20, Ordering::Relaxed);
        self.live.lock().unwrap().insert(address);
        Ok(RawAllocation::new(DeviceAddress::new(address).unwrap(), request.bytes(), request.align(), DEV, 0))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.releases.fetch_add(1, Ordering::Relaxed);
        let scripted = self.script.lock().unwrap().pop_front();
        match scripted {
            Some(Answer::QuarantineOther { unmapped, residual }) => ReleaseOutcome::quarantined(
                Liar::other_block(allocation.bytes()),
                unmapped,
                residual,
                ReleaseError::Abandoned,
            ),
            Some(Answer::FailOther) => {
                ReleaseOutcome::failed(Liar::other_block(allocation.bytes()), ReleaseError::Abandoned)
            }
            None if self.live.lock().unwrap().remove(&allocation.address().get()) => {
                ReleaseOutcome::complete(allocation.bytes())
            }
            None => {
                let error = ReleaseError::NotOwned {
                    allocator: "liar".into(),
                    device: DEV,
                    address: allocation.address().get(),
                };
                ReleaseOutcome::failed(allocation, error)
            }
        }
    }
}

struct Setup {
    registry: BindingRegistry,
    governor: Governor,
    account: Account,
    mechanism: MechanismIdentity,
    binding: MemoryBinding,
}

/// A registry with one governed mechanism over `inner`, exact books (no credit).
fn through_registry(inner: Arc<dyn DeviceAllocator>) -> Setup {
    let registry = BindingRegistry::new().unwrap();
    let context = registry.register_provider_context(DEV, Arc::new("context")).unwrap();
    let authority = registry.register_authority(DEV, Arc::new("tenant")).unwrap();
    let governor = governor(0);
    governor.set_device_limit(DEV, 1 << 20).unwrap();
    let account = governor.open_account(AccountConfig::new(DEV, authority).label("tenant")).unwrap();
    let governed = governor.govern(inner, authority).unwrap();
    let mechanism = registry.register_allocator(&context, &authority, Arc::new(governed)).unwrap();
    let binding = registry.bind(DEV).unwrap();
    Setup { registry, governor, account, mechanism, binding }
}

fn request(bytes: usize, role: MemoryRole) -> AllocationRequest {
    AllocationRequest::new(bytes, 64).unwrap().with_role(role)
}

/// (current, quarantined bytes, live charges) of one role.
fn role_books(account: &Account, role: MemoryRole) -> (u64, u64, u64) {
    let snapshot = account.snapshot();
    let role = snapshot.role(role);
    (role.current, role.quarantined_bytes, role.live)
}

// Item 1: an answer about another block refunds nothing.

#[test]
fn a_quarantine_about_another_block_refunds_nothing_and_a_retry_refunds_exactly_once() {
    let liar = Liar::new();
    let s = through_registry(Arc::clone(&liar) as Arc<dyn DeviceAllocator>);
    let block = s.binding.allocate(request(4096, MemoryRole::KvCache)).unwrap();
    liar.answer_next_release(Answer::QuarantineOther { unmapped: 4000, residual: 16 });
    let report = s.binding.release(block).unwrap();
    assert_eq!(report, ReleaseReport::Quarantined { unmapped_bytes: 0, residual_bytes: 4096 });
    // Nothing is believed: the whole block stays charged, shown as quarantined.
    assert_eq!(role_books(&s.account, MemoryRole::KvCache), (4096, 4096, 1));
    assert_eq!(s.account.used(), 4096);
    // A retry on the healthy device releases it: refunded exactly once, no wrap.
    let retry = s.registry.retry_quarantined(&s.mechanism).unwrap();
    assert_eq!((retry.released, retry.still_quarantined), (1, 0));
    assert_eq!(role_books(&s.account, MemoryRole::KvCache), (0, 0, 0));
    assert_eq!(s.account.used(), 0, "the account's books wrapped or kept a charge");
    // And the account still admits up to its limit.
    drop(s.account.lease(MemoryRole::Weights, 1 << 20).expect("the whole device is free again"));
    assert_eq!(s.governor.snapshot().device(DEV).unwrap().current, 0);
}

#[test]
fn a_failure_about_another_block_keeps_the_whole_charge_until_a_retry() {
    let liar = Liar::new();
    let s = through_registry(Arc::clone(&liar) as Arc<dyn DeviceAllocator>);
    let block = s.binding.allocate(request(2048, MemoryRole::Activations)).unwrap();
    liar.answer_next_release(Answer::FailOther);
    let report = s.binding.release(block).unwrap();
    assert_eq!(report, ReleaseReport::Quarantined { unmapped_bytes: 0, residual_bytes: 2048 });
    assert_eq!(role_books(&s.account, MemoryRole::Activations), (2048, 2048, 1));
    let retry = s.registry.retry_quarantined(&s.mechanism).unwrap();
    assert_eq!((retry.released, retry.still_quarantined), (1, 0));
    assert_eq!(role_books(&s.account, MemoryRole::Activations), (0, 0, 0));
    assert_eq!(s.account.used(), 0);
}

#[test]
fn a_retried_release_answered_about_another_block_keeps_the_residual_charged() {
    let liar = Liar::new();
    let s = through_registry(Arc::clone(&liar) as Arc<dyn DeviceAllocator>);
    let block = s.binding.allocate(request(4096, MemoryRole::Workspace)).unwrap();
    liar.answer_next_release(Answer::QuarantineOther { unmapped: 0, residual: 4096 });
    s.binding.release(block).unwrap();
    // The retry lies again: still nothing refunded, still one quarantined charge.
    liar.answer_next_release(Answer::QuarantineOther { unmapped: 4096, residual: 0 });
    let retry = s.registry.retry_quarantined(&s.mechanism).unwrap();
    assert_eq!((retry.released, retry.still_quarantined), (0, 1));
    assert_eq!(role_books(&s.account, MemoryRole::Workspace), (4096, 4096, 1));
    // The third time it tells the truth.
    s.registry.retry_quarantined(&s.mechanism).unwrap();
    assert_eq!(role_books(&s.account, MemoryRole::Workspace), (0, 0, 0));
    assert_eq!(s.account.used(), 0);
    assert_eq!(liar.releases(), 3);
}
