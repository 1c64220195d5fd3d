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
    /// An honest quarantine of the block given (with a new tag of the inner
    /// allocator's own, as a real backend may record what is left to do).
    QuarantineSame { unmapped: usize, residual: usize },
}

/// The tag the liar puts on a block it quarantined.
const RETRY_TAG: u64 = 77;

/// A counter allocator (no memory behind it) that keeps honest records, answers
/// releases from a script when one is queued, and counts its callbacks.
struct Liar {
    next: AtomicU64,
    live: Mutex<HashSet<u64>>,
    script: Mutex<VecDeque<Answer>>,
    /// Sizes to hand out instead of the requested one, next first.
    sizes: Mutex<VecDeque<usize>>,
    releases: AtomicU64,
    /// The provider tag of every block presented to release.
    released_tags: Mutex<Vec<u64>>,
}

impl Liar {
    fn new() -> Arc<Liar> {
        Arc::new(Liar {
            next: AtomicU64::new(1 << 20),
            live: Mutex::new(HashSet::new()),
            script: Mutex::new(VecDeque::new()),
            sizes: Mutex::new(VecDeque::new()),
            releases: AtomicU64::new(0),
            released_tags: Mutex::new(Vec::new()),
        })
    }

    fn hand_out_next(&self, bytes: usize) {
        self.sizes.lock().unwrap().push_back(bytes);
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
        let bytes = self.sizes.lock().unwrap().pop_front().unwrap_or(request.bytes());
        Ok(RawAllocation::new(DeviceAddress::new(address).unwrap(), bytes, request.align(), DEV, 0))
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.releases.fetch_add(1, Ordering::Relaxed);
        self.released_tags.lock().unwrap().push(allocation.provider_tag());
        let scripted = self.script.lock().unwrap().pop_front();
        match scripted {
            Some(Answer::QuarantineOther { unmapped, residual }) => ReleaseOutcome::quarantined(
                Liar::other_block(allocation.bytes()),
                unmapped,
                residual,
                ReleaseError::Abandoned,
            ),
            Some(Answer::QuarantineSame { unmapped, residual }) => {
                let (address, bytes, align) = (allocation.address(), allocation.bytes(), allocation.align());
                let retagged = RawAllocation::new(address, bytes, align, DEV, RETRY_TAG);
                ReleaseOutcome::quarantined(retagged, unmapped, residual, ReleaseError::Abandoned)
            }
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
    let registry = BindingRegistry::new();
    let context = registry.register_provider_context(DEV, Arc::new("context")).unwrap();
    let authority = registry.register_authority(DEV, Arc::new("tenant")).unwrap();
    let governor = governor(0);
    governor.set_device_limit(DEV, 1 << 20).unwrap();
    let account = governor.open_account(AccountConfig::new(DEV, authority).with_label("tenant")).unwrap();
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
    assert_eq!(report, ReleaseSummary::Quarantined { unmapped_bytes: 0, residual_bytes: 4096 });
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
    assert_eq!(report, ReleaseSummary::Quarantined { unmapped_bytes: 0, residual_bytes: 2048 });
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

// Item 2: role, charge and quarantine state come from the governed allocator's own
// records; a block it did not make, or a tag that disagrees with them, is refused.

/// A governed allocator used directly (no registry), over a fresh liar.
fn direct() -> (Governor, Account, Arc<Liar>, GovernedAllocator) {
    let (governor, account) = one_account(DEV, 1 << 30, u64::MAX, 0);
    let liar = Liar::new();
    let governed = governor.govern(Arc::clone(&liar) as Arc<dyn DeviceAllocator>, account.authority()).unwrap();
    (governor, account, liar, governed)
}

fn forged(block: &RawAllocation, tag: u64) -> RawAllocation {
    RawAllocation::new(block.address(), block.bytes(), block.align(), block.device(), tag)
}

/// Asserts `outcome` refuses `presented` as not owned and hands it back untouched.
fn assert_refused(outcome: ReleaseOutcome, presented: &RawAllocation) {
    let ReleaseOutcome::Failed(failed) = outcome else { panic!("a forged block was not refused: {outcome:?}") };
    assert!(matches!(failed.error(), ReleaseError::NotOwned { .. }), "{}", failed.error());
    let (back, _) = failed.into_parts();
    assert!(back.same_block(presented) && back.provider_tag() == presented.provider_tag(), "not handed back as given");
}

#[test]
fn every_single_bit_forgery_of_a_tag_is_refused_before_the_inner_allocator_runs() {
    let (governor, account, liar, governed) = direct();
    let block = governed.allocate(&request(4096, MemoryRole::KvCache)).unwrap();
    let tag = block.provider_tag();
    for bit in 0..64 {
        let fake = forged(&block, tag ^ (1 << bit));
        assert_refused(governed.release(fake), &forged(&block, tag ^ (1 << bit)));
    }
    assert_eq!(liar.releases(), 0, "a forged block reached the inner allocator");
    // Books untouched and readable (no role wrapped), then the real block refunds once.
    let json = governor.snapshot().to_json();
    assert!(json.contains("\"kv-cache\""));
    assert_eq!(role_books(&account, MemoryRole::KvCache), (4096, 0, 1));
    assert!(governed.release(block).is_complete());
    for role in MemoryRole::ALL {
        assert_eq!(role_books(&account, role), (0, 0, 0), "{role}");
    }
    assert_eq!(account.used(), 0);
}

#[test]
fn a_block_whose_size_alignment_or_device_disagrees_with_the_records_is_refused() {
    let (_governor, account, liar, governed) = direct();
    let block = governed.allocate(&request(4096, MemoryRole::Weights)).unwrap();
    let tag = block.provider_tag();
    let variants = [
        RawAllocation::new(block.address(), 4095, 64, DEV, tag),
        RawAllocation::new(block.address(), 8192, 64, DEV, tag),
        RawAllocation::new(block.address(), 4096, 128, DEV, tag),
        RawAllocation::new(block.address(), 4096, 64, DeviceKey::host(12), tag),
        RawAllocation::new(DeviceAddress::new(block.address().get() + 64).unwrap(), 4096, 64, DEV, tag),
    ];
    for fake in variants {
        let copy = forged(&fake, tag);
        assert_refused(governed.release(fake), &copy);
    }
    assert_eq!(liar.releases(), 0);
    assert_eq!(role_books(&account, MemoryRole::Weights), (4096, 0, 1));
    assert!(governed.release(block).is_complete());
    assert_eq!(account.used(), 0);
}

#[test]
fn a_block_of_another_governed_allocator_over_the_same_inner_is_refused() {
    let (governor, first) = one_account(DEV, 1 << 30, u64::MAX, 0);
    let second = governor.open_account(AccountConfig::new(DEV, authority()).with_label("second")).unwrap();
    let liar = Liar::new();
    let a = governor.govern(Arc::clone(&liar) as Arc<dyn DeviceAllocator>, first.authority()).unwrap();
    let b = governor.govern(Arc::clone(&liar) as Arc<dyn DeviceAllocator>, second.authority()).unwrap();
    let block = a.allocate(&request(1000, MemoryRole::Activations)).unwrap();
    let copy = forged(&block, block.provider_tag());
    let ReleaseOutcome::Failed(failed) = b.release(block) else { panic!("b released a's block") };
    let (block, _) = failed.into_parts();
    assert!(block.same_block(&copy));
    assert_eq!(liar.releases(), 0);
    assert_eq!((first.snapshot().current, second.snapshot().current), (1000, 0));
    assert!(a.release(block).is_complete());
    assert_eq!((first.used(), second.used()), (0, 0));
}

#[test]
fn a_block_straight_from_the_inner_allocator_is_not_the_governors() {
    let (_governor, account, liar, governed) = direct();
    let raw = liar.allocate(&request(512, MemoryRole::Staging)).unwrap();
    let copy = forged(&raw, raw.provider_tag());
    assert_refused(governed.release(raw), &copy);
    // Nor with any tag a governed block could carry.
    let genuine = governed.allocate(&request(512, MemoryRole::Staging)).unwrap();
    let fake = forged(&copy, genuine.provider_tag());
    assert_refused(governed.release(fake), &forged(&copy, genuine.provider_tag()));
    assert_eq!(liar.releases(), 0);
    assert!(governed.release(genuine).is_complete());
    assert_eq!(account.used(), 0);
}

#[test]
fn forged_blocks_handed_to_forget_lost_refund_nothing_and_the_real_one_refunds_once() {
    let (_governor, account, _liar, governed) = direct();
    let block = governed.allocate(&request(3000, MemoryRole::KvCache)).unwrap();
    let tag = block.provider_tag();
    let fakes: Vec<RawAllocation> = (0..64).map(|bit| forged(&block, tag ^ (1 << bit))).collect();
    governed.forget_lost(fakes);
    let snapshot = account.snapshot();
    assert_eq!((snapshot.current, snapshot.totals.lost_bytes, snapshot.totals.lost_allocations), (3000, 0, 0));
    let duplicate = forged(&block, tag);
    assert_eq!(governed.live_blocks(), 1);
    governed.forget_lost(vec![block]);
    assert_eq!(governed.live_blocks(), 0);
    governed.forget_lost(vec![duplicate]);
    let snapshot = account.snapshot();
    assert_eq!((snapshot.current, snapshot.totals.lost_bytes, snapshot.totals.lost_allocations), (0, 3000, 1));
    assert_eq!(account.used(), 0);
}

#[test]
#[cfg(unix)] // the virtual and shared host allocators need mmap
fn a_forged_block_is_refused_by_every_forwarded_capability() {
    let (_governor, account) = one_account(DEV, 1 << 30, u64::MAX, 0);
    let inner = Arc::new(allocator_cpu::VirtualHostAllocator::for_device(DEV));
    let governed = GovernedAllocator::new(inner, account.clone()).unwrap();
    let backing = governed.virtual_backing().expect("forwarded");
    let granularity = backing.granularity();
    let block = governed.allocate(&request(2 * granularity, MemoryRole::KvCache)).unwrap();
    let fake = forged(&block, block.provider_tag() ^ (1 << 61));
    let range = ByteRange::new(0, granularity);
    assert!(matches!(backing.commit(&fake, range), Err(CapabilityError::NotOwned { .. })));
    assert!(matches!(backing.decommit(&fake, range), Err(CapabilityError::NotOwned { .. })));
    assert!(matches!(backing.committed_bytes(&fake), Err(CapabilityError::NotOwned { .. })));
    assert_eq!(backing.committed_bytes(&block).unwrap(), 0, "nothing was committed through the forgery");
    assert!(governed.release(block).is_complete());
    assert_eq!(account.used(), 0);
}

#[test]
fn a_duplicate_released_while_the_original_is_in_the_inner_allocator_is_refused() {
    use memory_testkit::{Callback, RecordingAllocator};
    let (_governor, account) = one_account(DEV, 1 << 30, u64::MAX, 0);
    let recording = Arc::new(RecordingAllocator::on_device(DEV));
    let governed = GovernedAllocator::new(Arc::clone(&recording) as Arc<dyn DeviceAllocator>, account.clone()).unwrap();
    let block = governed.allocate(&request(4096, MemoryRole::KvCache)).unwrap();
    let duplicate = forged(&block, block.provider_tag());
    let gate = recording.gate(Callback::Release);
    std::thread::scope(|scope| {
        let first = scope.spawn(|| governed.release(block));
        gate.wait_until_blocked(1);
        let copy = forged(&duplicate, duplicate.provider_tag());
        // On another thread, so that a duplicate let through to the (gated) inner
        // allocator fails the test instead of hanging it.
        let (sender, answer) = std::sync::mpsc::channel();
        let governed = &governed;
        scope.spawn(move || sender.send(governed.release(duplicate)));
        let refused = answer.recv_timeout(std::time::Duration::from_secs(10));
        gate.open();
        assert_refused(refused.expect("the duplicate reached the inner allocator and waited there"), &copy);
        assert!(first.join().unwrap().is_complete());
    });
    assert_eq!(recording.calls(Callback::Release), 1, "the duplicate reached the inner allocator");
    assert_eq!(account.used(), 0);
    assert_eq!(account.snapshot().totals.releases, 1);
}

#[test]
fn a_panicking_inner_release_keeps_the_block_charged_as_quarantined_until_a_retry() {
    use memory_testkit::{Callback, FaultyAllocator, HostHeap};
    let faulty = Arc::new(FaultyAllocator::new(HostHeap::on_device(DEV)));
    let s = through_registry(Arc::clone(&faulty) as Arc<dyn DeviceAllocator>);
    let block = s.binding.allocate(request(1024, MemoryRole::Weights)).unwrap();
    faulty.panic_on_nth(Callback::Release, 1);
    let binding = s.binding.clone();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || binding.release(block)));
    assert!(panicked.is_err(), "the injected panic propagates");
    assert_eq!(role_books(&s.account, MemoryRole::Weights), (1024, 1024, 1));
    let retry = s.registry.retry_quarantined(&s.mechanism).unwrap();
    assert_eq!((retry.released, retry.still_quarantined), (1, 0));
    assert_eq!(role_books(&s.account, MemoryRole::Weights), (0, 0, 0));
    assert_eq!(s.account.used(), 0);
}

// Item 5: no callback under a lock. Each re-entrant call runs on its own thread with a
// deadline, so a deadlock fails the test instead of hanging it.

/// Runs `f` on another thread; fails the test if it has not returned within a generous
/// deadline (a deadlock guard, not a timing assumption).
fn without_deadlock<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (sender, answer) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(f());
    });
    answer.recv_timeout(std::time::Duration::from_secs(20)).unwrap_or_else(|_| panic!("{what} deadlocked"))
}

/// A policy that calls back into the governor from `reserve` (on its first call) and
/// from `name` (which, once, replaces the device's policy).
struct Reentrant {
    governor: Governor,
    authority: AuthorityIdentity,
    calls: AtomicU64,
    renames: AtomicU64,
}

impl Reentrant {
    fn new(governor: &Governor, authority: AuthorityIdentity, reserve_calls_back: bool) -> Arc<Reentrant> {
        Arc::new(Reentrant {
            governor: governor.clone(),
            authority,
            calls: AtomicU64::new(u64::from(!reserve_calls_back)),
            renames: AtomicU64::new(0),
        })
    }

    fn rename_once(&self) {
        self.renames.store(1, Ordering::Relaxed);
    }
}

impl AdmissionPolicy for Reentrant {
    fn name(&self) -> &str {
        if self.renames.swap(0, Ordering::Relaxed) == 1 {
            self.governor.set_policy(DEV, Arc::new(HardLimit)).unwrap();
        }
        "reentrant"
    }

    fn reserve(&self, role: MemoryRole) -> u64 {
        if role == MemoryRole::Weights && self.calls.fetch_add(1, Ordering::Relaxed) == 0 {
            self.governor.set_device_limit(DEV, 1 << 29).unwrap();
            self.governor.set_quota(self.authority, 1 << 28).unwrap();
            self.governor.set_policy(DEV, Arc::new(HardLimit)).unwrap();
            let _ = self.governor.snapshot();
            return 4096;
        }
        0
    }

    fn on_shortfall(&self, _: &Shortfall) -> ShortfallDecision {
        ShortfallDecision::Fail
    }
}

#[test]
fn a_policy_whose_reserve_changes_limits_quotas_and_policies_does_not_deadlock() {
    let (governor, account) = one_account(DEV, 1 << 30, u64::MAX, 0);
    let policy = Reentrant::new(&governor, account.authority(), true);
    let installed = {
        let governor = governor.clone();
        without_deadlock("set_policy with a re-entrant reserve()", move || governor.set_policy(DEV, policy))
    };
    assert_eq!(installed.expect("the reserve fits").name(), "hard-limit", "the policy reserve() installed");
    assert_eq!(governor.device_limit(DEV), Some(1 << 29));
    assert_eq!(account.quota(), Some(1 << 28));
    let snapshot = governor.snapshot();
    let device = snapshot.device(DEV).unwrap();
    assert_eq!((device.policy.as_str(), device.used), ("reentrant", 4096), "the outer policy won, its reserve held");
}

#[test]
fn a_policy_whose_name_installs_a_policy_does_not_deadlock_snapshots_or_policy_name() {
    let (governor, account) = one_account(DEV, 1 << 30, u64::MAX, 0);
    let policy = Reentrant::new(&governor, account.authority(), false);
    governor.set_policy(DEV, Arc::clone(&policy) as Arc<dyn AdmissionPolicy>).unwrap();
    policy.rename_once();
    let g = governor.clone();
    let json = without_deadlock("snapshot calling policy.name()", move || g.snapshot().to_json());
    assert!(json.contains("\"reentrant\""), "{json}");
    assert_eq!(governor.policy_name(DEV), "hard-limit", "name() installed hard-limit");
    governor.set_policy(DEV, Arc::clone(&policy) as Arc<dyn AdmissionPolicy>).unwrap();
    policy.rename_once();
    let g = governor.clone();
    assert_eq!(without_deadlock("policy_name calling policy.name()", move || g.policy_name(DEV)), "reentrant");
    assert_eq!(governor.policy_name(DEV), "hard-limit");
}

/// A reclaim holder whose `name` registers another holder (once).
struct Breeder {
    governor: Governor,
    bred: AtomicU64,
}

impl ReclaimHolder for Breeder {
    fn name(&self) -> &str {
        if self.bred.fetch_add(1, Ordering::Relaxed) == 0 {
            let child = Breeder { governor: self.governor.clone(), bred: 1.into() };
            self.governor.register_holder(DEV, 7, Arc::new(child));
        }
        "breeder"
    }

    fn reclaimable(&self, _: DeviceKey) -> u64 {
        0
    }

    fn reclaim(&self, _: &ReclaimRequest) -> u64 {
        0
    }
}

#[test]
fn a_holder_whose_name_registers_a_holder_does_not_deadlock_a_snapshot() {
    let (governor, _account) = one_account(DEV, 1 << 30, u64::MAX, 0);
    // Registration itself asks the name (for its log line) before it locks anything.
    governor.register_holder(DEV, 1, Arc::new(Breeder { governor: governor.clone(), bred: 1.into() }));
    governor.register_holder(DEV, 2, Arc::new(Breeder { governor: governor.clone(), bred: 0.into() }));
    let orders = |snapshot: GovernorSnapshot| -> Vec<u32> {
        let device = snapshot.device(DEV).unwrap().clone();
        assert!(device.holders.iter().all(|h| h.name == "breeder"));
        device.holders.iter().map(|h| h.order).collect()
    };
    let g = governor.clone();
    let snapshot = without_deadlock("snapshot calling holder.name()", move || g.snapshot());
    // The snapshot lists the holders registered when it copied the list; the one
    // registered from inside `name()` shows in the next.
    assert_eq!(orders(snapshot), [1, 2]);
    assert_eq!(orders(governor.snapshot()), [1, 2, 7]);
}

// Item 6: a reclaim holder that charges the still-short account does not recurse.

/// Holds leases; asked to reclaim, it first asks the governor for the same bytes
/// (on the same, still short, account), then frees what it holds.
struct Greedy {
    account: Account,
    leases: Mutex<Vec<OwnedLease>>,
    depth: AtomicU64,
    deepest: AtomicU64,
    nested: Mutex<Vec<Result<u64, AdmissionError>>>,
}

impl ReclaimHolder for Greedy {
    fn name(&self) -> &str {
        "greedy"
    }

    fn reclaimable(&self, _: DeviceKey) -> u64 {
        self.leases.lock().unwrap().iter().map(|l| l.bytes()).sum()
    }

    fn reclaim(&self, request: &ReclaimRequest) -> u64 {
        let depth = self.depth.fetch_add(1, Ordering::SeqCst) + 1;
        self.deepest.fetch_max(depth, Ordering::SeqCst);
        // Bounded here so that a governor that recurses fails this test instead of
        // overflowing the stack.
        if depth <= 8 {
            let nested = self.account.lease_owned(request.role, request.bytes).map(|lease| lease.bytes());
            self.nested.lock().unwrap().push(nested);
        }
        self.depth.fetch_sub(1, Ordering::SeqCst);
        let freed: Vec<OwnedLease> = self.leases.lock().unwrap().drain(..).collect();
        freed.iter().map(|l| l.bytes()).sum()
    }
}

#[test]
fn a_holder_that_charges_the_short_account_while_reclaiming_is_refused_without_recursion() {
    let (governor, account) = one_account(DEV, 100, u64::MAX, 0);
    governor.set_policy(DEV, Arc::new(ReclaimThenFail)).unwrap();
    let held = vec![account.lease_owned(MemoryRole::KvCache, 100).unwrap()];
    let greedy = Arc::new(Greedy {
        account: account.clone(),
        leases: Mutex::new(held),
        depth: 0.into(),
        deepest: 0.into(),
        nested: Mutex::new(Vec::new()),
    });
    governor.register_holder(DEV, 0, Arc::clone(&greedy) as Arc<dyn ReclaimHolder>);
    let lease = account.lease(MemoryRole::Activations, 60).expect("the outer request is served after reclaim");
    assert_eq!(greedy.deepest.load(Ordering::SeqCst), 1, "reclaim recursed");
    let nested = greedy.nested.lock().unwrap().drain(..).collect::<Vec<_>>();
    assert_eq!(nested.len(), 1);
    let Err(AdmissionError::ReentrantReclaim(exhaustion)) = &nested[0] else {
        panic!("the nested request was not refused as re-entrant: {:?}", nested[0])
    };
    assert_eq!((exhaustion.requested, exhaustion.reclaimed), (60, None));
    let message = nested[0].as_ref().unwrap_err().to_string();
    assert!(message.contains("already inside a reclaim"), "{message}");
    assert_eq!(nested[0].as_ref().unwrap_err().exhaustion().map(|e| e.requested), Some(60));
    let snapshot = account.snapshot();
    assert_eq!((snapshot.current, snapshot.totals.failures), (60, 1));
    drop(lease);
    // Once the reclaim is over, the same thread reclaims again as usual.
    greedy.leases.lock().unwrap().push(account.lease_owned(MemoryRole::KvCache, 100).unwrap());
    let again = account.lease(MemoryRole::Weights, 100).expect("reclaimed again");
    assert_eq!(again.bytes(), 100);
    assert_eq!(greedy.deepest.load(Ordering::SeqCst), 1);
    assert!(matches!(greedy.nested.lock().unwrap()[..], [Err(AdmissionError::ReentrantReclaim(_))]));
}

// Blocks of another size than asked (the contract says "at least the request"; the
// books count what the block really is).

#[test]
fn a_block_larger_than_asked_is_charged_its_real_size_and_refunded_exactly() {
    let (_governor, account, liar, governed) = direct();
    liar.hand_out_next(4096);
    let block = governed.allocate(&request(1000, MemoryRole::KvCache)).unwrap();
    assert_eq!(block.bytes(), 4096);
    let snapshot = account.snapshot();
    assert_eq!((snapshot.current, snapshot.totals.allocations, snapshot.totals.live), (4096, 1, 1));
    assert!(governed.release(block).is_complete());
    let snapshot = account.snapshot();
    assert_eq!((snapshot.current, snapshot.totals.releases, snapshot.totals.live), (0, 1, 0));
    assert_eq!(account.used(), 0);
}

#[test]
fn a_block_larger_than_the_account_can_hold_is_given_back_and_refused() {
    let (_governor, account) = one_account(DEV, 2000, u64::MAX, 0);
    let liar = Liar::new();
    let governed = GovernedAllocator::new(Arc::clone(&liar) as Arc<dyn DeviceAllocator>, account.clone()).unwrap();
    liar.hand_out_next(4096);
    let err = governed.try_allocate(&request(1000, MemoryRole::KvCache)).unwrap_err();
    let GovernedAllocError::Refused(refusal) = &err else { panic!("expected a refusal, got {err}") };
    assert_eq!(refusal.exhaustion().map(|e| e.requested), Some(3096), "the extra bytes were refused");
    assert_eq!(liar.releases(), 1, "the block went back to the inner allocator");
    assert!(liar.live.lock().unwrap().is_empty());
    let snapshot = account.snapshot();
    assert_eq!((snapshot.current, snapshot.totals.allocations, snapshot.totals.live), (0, 0, 0));
    assert_eq!((account.used(), snapshot.totals.failures), (0, 1));
    // Through the DeviceAllocator interface it is a governor refusal.
    liar.hand_out_next(4096);
    let err = governed.allocate(&request(1000, MemoryRole::KvCache)).unwrap_err();
    assert!(is_governor_refusal(&err), "{err}");
}

#[test]
fn an_oversized_block_the_inner_allocator_cannot_take_back_stays_charged_as_quarantined() {
    let (_governor, account) = one_account(DEV, 2000, u64::MAX, 0);
    let liar = Liar::new();
    let governed = GovernedAllocator::new(Arc::clone(&liar) as Arc<dyn DeviceAllocator>, account.clone()).unwrap();
    liar.hand_out_next(4096);
    liar.answer_next_release(Answer::QuarantineSame { unmapped: 0, residual: 4096 });
    assert!(governed.try_allocate(&request(1000, MemoryRole::Workspace)).is_err());
    // The inner allocator still holds the memory: what was charged stays, visibly.
    assert_eq!(role_books(&account, MemoryRole::Workspace), (1000, 1000, 1));
}

#[test]
fn a_block_smaller_than_asked_is_charged_what_it_is() {
    let (_governor, account, liar, governed) = direct();
    liar.hand_out_next(1000);
    let block = governed.allocate(&request(4096, MemoryRole::Staging)).unwrap();
    assert_eq!(role_books(&account, MemoryRole::Staging), (1000, 0, 1));
    assert!(governed.release(block).is_complete());
    assert_eq!(role_books(&account, MemoryRole::Staging), (0, 0, 0));
    assert_eq!(account.used(), 0);
}

#[test]
fn the_registry_refuses_a_block_smaller_than_asked_and_its_release_refunds_it() {
    let liar = Liar::new();
    let s = through_registry(Arc::clone(&liar) as Arc<dyn DeviceAllocator>);
    liar.hand_out_next(1000);
    let err = s.binding.allocate(request(4096, MemoryRole::Staging)).unwrap_err();
    assert!(matches!(err, AllocateError::InvalidBlock { .. }), "{err}");
    assert_eq!(liar.releases(), 1);
    let snapshot = s.account.snapshot();
    assert_eq!((snapshot.current, snapshot.totals.live), (0, 0));
    assert_eq!(s.account.used(), 0);
}

#[test]
fn an_honest_quarantine_refunds_what_was_let_go_and_a_retry_the_rest() {
    let (_governor, account, liar, governed) = direct();
    let block = governed.allocate(&request(4096, MemoryRole::KvCache)).unwrap();
    liar.answer_next_release(Answer::QuarantineSame { unmapped: 3072, residual: 1024 });
    let ReleaseOutcome::Quarantined(quarantine) = governed.release(block) else { panic!("expected a quarantine") };
    assert_eq!((quarantine.unmapped_bytes(), quarantine.residual_bytes()), (3072, 1024));
    assert_eq!(role_books(&account, MemoryRole::KvCache), (1024, 1024, 1));
    assert_eq!(governed.live_blocks(), 1, "a quarantined block keeps its record");
    // The block handed back is the governed block: releasing it again settles it, and
    // the inner allocator sees the tag it put on the quarantined block.
    let (block, _) = quarantine.into_parts();
    assert!(governed.release(block).is_complete());
    assert_eq!(*liar.released_tags.lock().unwrap(), [0, RETRY_TAG]);
    assert_eq!(role_books(&account, MemoryRole::KvCache), (0, 0, 0));
    assert_eq!((account.used(), governed.live_blocks()), (0, 0));
}

#[test]
fn a_released_block_leaves_no_record_behind() {
    let (governor, account, _liar, governed) = direct();
    governor.enable_timeline(16);
    let blocks: Vec<_> = (0..3).map(|_| governed.allocate(&request(4096, MemoryRole::KvCache)).unwrap()).collect();
    assert_eq!(governed.live_blocks(), 3);
    for block in blocks {
        assert!(governed.release(block).is_complete());
    }
    assert_eq!((governed.live_blocks(), account.used()), (0, 0));
    // An allocation of exactly the size asked is one charge and one refund.
    let kinds: Vec<_> = governor.timeline_events().0.iter().map(|e| (e.kind, e.bytes)).collect();
    let charge = (TimelineEventKind::Charge, 4096);
    let refund = (TimelineEventKind::Refund, 4096);
    assert_eq!(kinds, [charge, charge, charge, refund, refund, refund]);
}

/// Reports capabilities when asked at wrapping time, then loses them.
#[cfg(unix)] // its inner allocators need mmap
struct Fickle {
    inner: allocator_cpu::SharedHostAllocator,
    virtual_inner: allocator_cpu::VirtualHostAllocator,
    lost: std::sync::atomic::AtomicBool,
}

#[cfg(unix)]
impl DeviceAllocator for Fickle {
    fn device(&self) -> DeviceKey {
        DEV
    }
    fn name(&self) -> &str {
        "fickle"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.virtual_inner.allocate(request)
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.virtual_inner.release(allocation)
    }
    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        if self.lost.load(Ordering::Relaxed) { None } else { self.virtual_inner.virtual_backing() }
    }
    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        if self.lost.load(Ordering::Relaxed) { None } else { self.inner.shared_mapping() }
    }
}

#[test]
#[cfg(unix)] // the virtual and shared host allocators need mmap
fn a_capability_the_inner_allocator_lost_is_reported_unsupported() {
    let (_governor, account) = one_account(DEV, 1 << 30, u64::MAX, 0);
    let fickle = Arc::new(Fickle {
        inner: allocator_cpu::SharedHostAllocator::for_device(DEV),
        virtual_inner: allocator_cpu::VirtualHostAllocator::for_device(DEV),
        lost: false.into(),
    });
    let governed = GovernedAllocator::new(Arc::clone(&fickle) as Arc<dyn DeviceAllocator>, account.clone()).unwrap();
    let block = governed.allocate(&request(1 << 16, MemoryRole::KvCache)).unwrap();
    fickle.lost.store(true, Ordering::Relaxed);
    let backing = governed.virtual_backing().expect("the governed allocator still answers");
    let mapping = governed.shared_mapping().expect("the governed allocator still answers");
    assert_eq!((backing.granularity(), mapping.granularity()), (1, 1));
    let range = ByteRange::new(0, 4096);
    let unsupported = |result: Result<usize, CapabilityError>| {
        assert!(matches!(result, Err(CapabilityError::Unsupported { .. })), "{result:?}");
    };
    unsupported(backing.commit(&block, range));
    unsupported(backing.decommit(&block, range));
    unsupported(backing.committed_bytes(&block));
    unsupported(mapping.unmap(&block, range));
    assert!(matches!(mapping.create_backing(4096), Err(CapabilityError::Unsupported { .. })));
    assert!(governed.release(block).is_complete());
    assert_eq!(account.used(), 0);
}

#[test]
fn a_holder_panicking_while_an_oversized_block_is_charged_gives_the_block_and_its_charge_back() {
    let (governor, account) = one_account(DEV, 2000, u64::MAX, 0);
    governor.set_policy(DEV, Arc::new(ReclaimThenFail)).unwrap();
    governor.register_holder(DEV, 0, Arc::new(PanickingHolder("holder exploded while an oversized block was charged")));
    let liar = Liar::new();
    let governed = GovernedAllocator::new(Arc::clone(&liar) as Arc<dyn DeviceAllocator>, account.clone()).unwrap();
    liar.hand_out_next(4096);
    // The 1000 bytes asked fit; the 3096 more the block really is do not, and the
    // policy's holder panics while the block is out.
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        governed.try_allocate(&request(1000, MemoryRole::KvCache)).map(drop)
    }));
    assert!(outcome.is_err(), "the holder's panic propagates");
    assert_eq!(liar.releases(), 1, "the block did not go back to the inner allocator");
    assert!(liar.live.lock().unwrap().is_empty());
    let snapshot = account.snapshot();
    assert_eq!((snapshot.current, snapshot.totals.live), (0, 0), "the asked bytes stayed charged");
    assert_eq!(account.used(), 0);
}
