//! Adversarial scenarios for the books that the other suites do not drive: a quota
//! lowered below what is charged while another thread caches credit, a lease dropped
//! while a governed allocation is inside its inner allocator, reclaim holders that
//! re-enter the registry (release governed blocks, allocate through the same binding)
//! or panic or lie, the overdraft under concurrency and below its limit, and a device
//! limit lowered below what device-lost blocks hold.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use common::*;
use memory_governor::*;
use memory_testkit::{Callback, HostHeap, RecordingAllocator, within};

const DEV: DeviceKey = DeviceKey::host(11);
const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

fn request(bytes: u64, role: MemoryRole) -> AllocationRequest {
    AllocationRequest::new(bytes as usize, 64).unwrap().with_role(role)
}

fn exhausted(error: &AdmissionError) -> &Exhaustion {
    match error {
        AdmissionError::Exhausted(exhaustion) => exhaustion,
        other => panic!("expected Exhausted, got {other:?}"),
    }
}

/// A registry with one governed allocator over `inner` for a fresh tenant.
struct Governed {
    registry: BindingRegistry,
    governor: Governor,
    account: Account,
    authority: AuthorityIdentity,
    context: ProviderContextIdentity,
    binding: MemoryBinding,
}

fn governed(inner: Arc<dyn DeviceAllocator>, limit: u64, quota: u64, chunk: u64) -> Governed {
    let registry = BindingRegistry::new();
    let context = registry.register_provider_context(DEV, Arc::new("context")).unwrap();
    let authority = registry.register_authority(DEV, Arc::new("tenant")).unwrap();
    let governor = governor(chunk);
    governor.set_device_limit(DEV, limit).unwrap();
    let account =
        governor.open_account(AccountConfig::new(DEV, authority).with_quota(quota).with_label("tenant")).unwrap();
    let allocator = governor.govern(inner, authority).unwrap();
    registry.register_allocator(&context, &authority, Arc::new(allocator)).unwrap();
    let binding = registry.bind(DEV).unwrap();
    Governed { registry, governor, account, authority, context, binding }
}

fn assert_books_zero(governor: &Governor, account: &Account) {
    governor.return_idle_credit();
    let snapshot = account.snapshot();
    assert_eq!((snapshot.current, snapshot.used, snapshot.cached_credit), (0, 0, 0), "account books");
    assert_eq!(snapshot.totals.live, 0);
    assert_eq!(snapshot.overdraft.current, 0);
    let device = governor.snapshot().device(DEV).unwrap().clone();
    assert_eq!((device.current, device.used), (0, 0), "device books");
}

#[test]
fn a_quota_lowered_below_the_charges_while_another_thread_caches_credit_refuses_until_usage_falls() {
    let (governor, account) = one_account(DEV, 64 * MIB, 16 * MIB, MIB);
    let authority = account.authority();
    let (to_worker, from_main) = mpsc::channel::<&'static str>();
    let (to_main, from_worker) = mpsc::channel::<Result<u64, String>>();
    let worker = {
        let account = account.clone();
        std::thread::spawn(move || {
            // A charge that leaves this thread holding credit drawn under the old quota.
            let mut lease = Some(account.lease_owned(MemoryRole::KvCache, 4 * MIB + 100).unwrap());
            to_main.send(Ok(0)).unwrap();
            while let Ok(step) = from_main.recv() {
                let answer = match step {
                    "one" => account.lease(MemoryRole::KvCache, 1).map(|l| l.bytes()).map_err(|e| e.to_string()),
                    "drop" => Ok(lease.take().map_or(0, |l| l.bytes())),
                    "fill" => account
                        .lease(MemoryRole::KvCache, 3 * MIB - 2 * MIB)
                        .map(|l| l.bytes())
                        .map_err(|e| e.to_string()),
                    _ => break,
                };
                to_main.send(answer).unwrap();
            }
        })
    };
    from_worker.recv().unwrap().unwrap();
    let weights = account.lease(MemoryRole::Weights, 2 * MIB).unwrap();
    assert!(account.snapshot().cached_credit > 0, "the setup should leave credit cached");

    // Charged: 6 MiB + 100. The quota goes to 3 MiB: nothing is revoked.
    governor.set_quota(authority, 3 * MIB).unwrap();
    let snapshot = account.snapshot();
    assert_eq!(snapshot.current, 6 * MIB + 100);
    assert_eq!(snapshot.cached_credit, 0, "credit cached under the old quota was not pulled back");
    assert_eq!(snapshot.used, 6 * MIB + 100);

    // Every new admission is refused, on either thread, with what was asked and found.
    to_worker.send("one").unwrap();
    let refused = from_worker.recv().unwrap().unwrap_err();
    assert!(refused.contains("authority quota"), "{refused}");
    let error = account.lease(MemoryRole::Activations, 1).unwrap_err();
    let exhaustion = exhausted(&error);
    assert_eq!((exhaustion.requested, exhaustion.limit, exhaustion.used), (1, 3 * MIB, 6 * MIB + 100));
    assert_eq!(exhaustion.scope, LimitScope::Authority);
    let text = error.to_string();
    assert!(text.contains("authority quota") && text.contains(&(3 * MIB).to_string()), "{text}");
    assert_eq!(account.snapshot().current, 6 * MIB + 100, "a refused admission changed the books");

    // The worker's lease goes: 2 MiB stay charged, 1 MiB fits again, and not a byte more.
    to_worker.send("drop").unwrap();
    assert_eq!(from_worker.recv().unwrap().unwrap(), 4 * MIB + 100);
    assert_eq!(account.snapshot().current, 2 * MIB);
    let one = account.lease(MemoryRole::Activations, MIB).unwrap();
    assert!(account.lease(MemoryRole::Activations, 1).is_err());
    to_worker.send("fill").unwrap();
    assert!(from_worker.recv().unwrap().is_err(), "the worker admitted past the lowered quota");
    assert!(account.used() <= 3 * MIB, "used {} above the quota", account.used());
    drop(one);
    to_worker.send("fill").unwrap();
    assert_eq!(from_worker.recv().unwrap().unwrap(), MIB);
    drop(weights);
    to_worker.send("stop").unwrap();
    worker.join().unwrap();
    assert_books_zero(&governor, &account);
}

#[test]
fn a_lease_dropped_while_a_governed_allocation_is_inside_its_inner_allocator_keeps_exact_books() {
    let inner = Arc::new(RecordingAllocator::new(HostHeap::on_device(DEV)));
    let g = governed(inner.clone(), 64 * MIB, MIB, 0);
    let held = g.account.lease_owned(MemoryRole::Workspace, 768 * KIB).unwrap();
    let gate = inner.gate(Callback::Allocate);
    std::thread::scope(|s| {
        let worker = s.spawn(|| g.binding.allocate(request(256 * KIB, MemoryRole::KvCache)));
        gate.wait_until_blocked(1);
        // The allocation is charged before its inner call: nothing else can take it.
        assert_eq!(g.account.snapshot().current, MIB);
        assert!(g.account.lease(MemoryRole::Weights, 1).is_err(), "admitted into bytes charged to an allocation");
        // The lease ends on another thread while the allocation is still inside.
        let other = std::thread::spawn(move || drop(held));
        other.join().unwrap();
        assert_eq!(g.account.snapshot().current, 256 * KIB);
        gate.open();
        let block = worker.join().unwrap().unwrap();
        assert_eq!(g.account.snapshot().role(MemoryRole::KvCache).current, 256 * KIB);
        let rest = g.account.lease(MemoryRole::Workspace, 768 * KIB).unwrap();
        assert!(g.account.lease(MemoryRole::Workspace, 1).is_err());
        drop(rest);
        g.binding.release(block).unwrap();
    });
    drop(gate);
    assert_books_zero(&g.governor, &g.account);
}

/// A holder that frees by releasing governed blocks through the registry, and may
/// allocate through the same binding from inside its reclaim.
struct BlockHolder {
    binding: MemoryBinding,
    blocks: Mutex<Vec<BoundAllocation>>,
    allocate_inside: bool,
    nested: Mutex<Vec<Result<(), String>>>,
    asked: AtomicUsize,
}

impl ReclaimHolder for BlockHolder {
    fn name(&self) -> &str {
        "block holder"
    }
    fn reclaimable(&self, _device: DeviceKey) -> u64 {
        self.blocks.lock().unwrap().iter().map(|b| b.bytes() as u64).sum()
    }
    fn reclaim(&self, request: &ReclaimRequest) -> u64 {
        self.asked.fetch_add(1, Ordering::SeqCst);
        if self.allocate_inside {
            // More than is missing: it does not fit as things stand.
            let nested = self.binding.allocate(self::request(request.bytes + 1, MemoryRole::KvCache));
            self.nested.lock().unwrap().push(match nested {
                Ok(block) => {
                    self.blocks.lock().unwrap().push(block);
                    Ok(())
                }
                Err(error) => Err(error.to_string()),
            });
        }
        let blocks: Vec<_> = self.blocks.lock().unwrap().drain(..).collect();
        let mut freed = 0;
        for block in blocks {
            let bytes = block.bytes() as u64;
            self.binding.release(block).unwrap();
            freed += bytes;
        }
        freed
    }
}

#[test]
fn a_holder_that_releases_governed_blocks_through_the_registry_makes_room_and_the_books_balance() {
    for allocate_inside in [false, true] {
        let g = governed(Arc::new(HostHeap::on_device(DEV)), 64 * MIB, MIB, 0);
        g.governor.set_policy(DEV, Arc::new(ReclaimThenFail)).unwrap();
        let cached = g.binding.allocate(request(768 * KIB, MemoryRole::KvCache)).unwrap();
        let holder = Arc::new(BlockHolder {
            binding: g.binding.clone(),
            blocks: Mutex::new(vec![cached]),
            allocate_inside,
            nested: Mutex::new(Vec::new()),
            asked: AtomicUsize::new(0),
        });
        let id = g.governor.register_holder(DEV, 0, holder.clone() as Arc<dyn ReclaimHolder>);
        let block = within("a reclaim that re-enters the registry", {
            let binding = g.binding.clone();
            move || binding.allocate(request(512 * KIB, MemoryRole::Activations)).map_err(|e| e.to_string())
        })
        .expect("the holder's release makes room");
        assert_eq!(holder.asked.load(Ordering::SeqCst), 1, "reclaim recursed or was not asked");
        if allocate_inside {
            let nested = holder.nested.lock().unwrap().clone();
            assert_eq!(nested.len(), 1);
            let error = nested[0].as_ref().unwrap_err();
            assert!(error.contains("already inside a reclaim"), "{error}");
        }
        let snapshot = g.account.snapshot();
        assert_eq!(snapshot.current, 512 * KIB);
        assert_eq!(snapshot.role(MemoryRole::KvCache).current, 0);
        assert!(snapshot.used <= MIB);
        g.binding.release(block).unwrap();
        g.governor.unregister_holder(id);
        drop(holder);
        assert_books_zero(&g.governor, &g.account);
        assert_eq!(g.registry.snapshots().mechanisms[0].live_allocations, 0);
    }
}

#[test]
fn a_holder_that_panics_leaves_nothing_charged_and_the_thread_reclaims_again() {
    let g = governed(Arc::new(HostHeap::on_device(DEV)), 64 * MIB, MIB, 0);
    g.governor.set_policy(DEV, Arc::new(ReclaimThenFail)).unwrap();
    let held = g.account.lease_owned(MemoryRole::Weights, 900 * KIB).unwrap();
    let id = g.governor.register_holder(DEV, 0, Arc::new(PanickingHolder("holder exploded inside reclaim")));
    let before = g.account.snapshot().current;
    assert!(catch_unwind(AssertUnwindSafe(|| g.account.lease(MemoryRole::KvCache, 512 * KIB).map(drop))).is_err());
    assert!(
        catch_unwind(AssertUnwindSafe(|| g.binding.allocate(request(512 * KIB, MemoryRole::KvCache)).map(drop)))
            .is_err()
    );
    assert_eq!(g.account.snapshot().current, before, "a panicking holder left a charge behind");
    assert_eq!(g.registry.snapshots().mechanisms[0].in_flight, 0);
    g.governor.unregister_holder(id);
    // The same thread is not left "inside a reclaim": the next shortfall asks holders.
    let leases = vec![held];
    let asked = Arc::new(Mutex::new(Vec::new()));
    g.governor.register_holder(DEV, 0, LeaseHolder::new("leases", leases, u64::MAX, asked.clone()));
    let lease = g.account.lease(MemoryRole::KvCache, 512 * KIB).expect("reclaim works again after a panic");
    assert_eq!(asked.lock().unwrap().len(), 1);
    drop(lease);
    assert_books_zero(&g.governor, &g.account);
}

struct Liar(AtomicUsize);
impl ReclaimHolder for Liar {
    fn name(&self) -> &str {
        "liar"
    }
    fn reclaimable(&self, _device: DeviceKey) -> u64 {
        u64::MAX
    }
    fn reclaim(&self, request: &ReclaimRequest) -> u64 {
        self.0.fetch_add(1, Ordering::SeqCst);
        request.bytes.saturating_mul(4) // freed nothing
    }
}

#[test]
fn a_holder_that_claims_to_free_what_it_did_not_cannot_push_the_books_past_a_limit() {
    let g = governed(Arc::new(HostHeap::on_device(DEV)), 2 * MIB, MIB, 0);
    g.governor.set_policy(DEV, Arc::new(ReclaimThenFail)).unwrap();
    let liar = Arc::new(Liar(AtomicUsize::new(0)));
    g.governor.register_holder(DEV, 0, liar.clone() as Arc<dyn ReclaimHolder>);
    let held = g.account.lease(MemoryRole::Weights, 768 * KIB).unwrap();
    let error = g.account.lease(MemoryRole::KvCache, 512 * KIB).unwrap_err();
    let exhaustion = exhausted(&error);
    // Asked for what was missing (256 KiB), it claimed four times that.
    assert_eq!(exhaustion.reclaimed, Some(4 * 256 * KIB));
    assert_eq!(liar.0.load(Ordering::SeqCst), 1, "asked again after its answer");
    let refused = g.binding.allocate(request(512 * KIB, MemoryRole::KvCache)).unwrap_err();
    assert!(refused.to_string().contains("authority quota"), "{refused}");
    let snapshot = g.account.snapshot();
    assert_eq!(snapshot.current, 768 * KIB);
    assert!(snapshot.used <= MIB);
    assert_eq!(snapshot.totals.failures, 2);
    drop(held);
    assert_books_zero(&g.governor, &g.account);
}

#[test]
fn concurrent_overdraft_draws_never_pass_the_limit_and_stay_out_of_the_quota() {
    let (governor, account) = one_account(DEV, 4 * MIB, 2 * MIB, 64 * KIB);
    governor.set_overdraft_limit(DEV, MIB);
    let held = Arc::new(AtomicU64::new(0));
    let over = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|s| {
        for seed in 0..4u64 {
            let (account, held, over) = (account.clone(), held.clone(), over.clone());
            s.spawn(move || {
                let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                let mut draws = Vec::new();
                let mut leases = Vec::new();
                for _ in 0..2000 {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let bytes = 1 + state % (96 * KIB);
                    match state % 4 {
                        0 | 1 => {
                            if let Ok(draw) = account.draw_overdraft(bytes) {
                                // Counted after admission, uncounted before release: never
                                // above the real figure.
                                if held.fetch_add(bytes, Ordering::SeqCst) + bytes > MIB {
                                    over.fetch_add(1, Ordering::SeqCst);
                                }
                                draws.push(draw);
                            }
                        }
                        2 => {
                            if let Ok(lease) = account.lease_owned(MemoryRole::Activations, bytes) {
                                leases.push(lease);
                            }
                        }
                        _ => {
                            if let Some(draw) = draws.pop() {
                                held.fetch_sub(draw.bytes(), Ordering::SeqCst);
                                drop(draw);
                            }
                            leases.pop();
                        }
                    }
                    assert!(account.used() <= 2 * MIB, "quota passed: {}", account.used());
                }
                for draw in draws {
                    held.fetch_sub(draw.bytes(), Ordering::SeqCst);
                }
            });
        }
    });
    assert_eq!(over.load(Ordering::SeqCst), 0, "the overdraft passed its limit");
    let snapshot = governor.snapshot();
    let device = snapshot.device(DEV).unwrap();
    assert!(device.overdraft.peak <= MIB, "overdraft peak {}", device.overdraft.peak);
    assert_eq!(device.overdraft.current, 0);
    // A full overdraft takes nothing from the quota.
    let draw = account.draw_overdraft(MIB).unwrap();
    let lease = account.lease(MemoryRole::Weights, 2 * MIB).expect("the overdraft is not charged to the quota");
    assert!(account.draw_overdraft(1).is_err());
    // Lowering the overdraft limit takes nothing back and refuses until it falls below.
    governor.set_overdraft_limit(DEV, 256 * KIB);
    assert_eq!(governor.snapshot().device(DEV).unwrap().overdraft.current, MIB);
    assert!(account.draw_overdraft(1).is_err());
    drop(draw);
    let small = account.draw_overdraft(256 * KIB).unwrap();
    assert!(account.draw_overdraft(1).is_err());
    drop(small);
    drop(lease);
    assert_books_zero(&governor, &account);
}

#[test]
fn a_device_limit_lowered_below_lost_blocks_is_refunded_to_zero_at_termination() {
    let g = governed(Arc::new(HostHeap::on_device(DEV)), 8 * MIB, 8 * MIB, 256 * KIB);
    let blocks: Vec<_> = (0..6).map(|_| g.binding.allocate(request(MIB, MemoryRole::KvCache)).unwrap()).collect();
    g.governor.set_device_limit(DEV, 2 * MIB).unwrap();
    g.governor.set_quota(g.authority, MIB).unwrap();
    assert!(g.binding.allocate(request(1, MemoryRole::KvCache)).is_err());
    g.registry.invalidate_device(DEV, "lost");
    // Lost bytes stay charged until termination is confirmed, whatever the limits.
    assert_eq!(g.account.snapshot().current, 6 * MIB);
    let report = g.registry.confirm_context_terminated(&g.context).unwrap();
    assert_eq!(report.lost_allocations, 6);
    let snapshot = g.account.snapshot();
    assert_eq!((snapshot.totals.lost_allocations, snapshot.totals.lost_bytes), (6, 6 * MIB));
    drop(blocks);
    assert_books_zero(&g.governor, &g.account);
    // A new lease under the lowered quota fits exactly.
    let lease = g.account.lease(MemoryRole::Weights, MIB).unwrap();
    assert!(g.account.lease(MemoryRole::Weights, 1).is_err());
    drop(lease);
}

#[test]
fn hostile_sizes_are_typed_errors_that_change_nothing_never_panics() {
    let (governor, account) = one_account(DEV, 4 * MIB, 2 * MIB, 64 * KIB);
    let held = account.lease(MemoryRole::Weights, MIB).unwrap();
    for bytes in [u64::MAX, MAX_CHARGE + 1, u64::MAX / 2] {
        let error = catch_unwind(AssertUnwindSafe(|| account.lease(MemoryRole::KvCache, bytes).map(drop)))
            .unwrap_or_else(|_| panic!("lease({bytes}) panicked"))
            .unwrap_err();
        assert!(error.to_string().contains(&bytes.to_string()), "{error}");
        assert!(catch_unwind(AssertUnwindSafe(|| account.draw_overdraft(bytes).map(drop).is_err())).unwrap());
    }
    let mut lease = account.lease(MemoryRole::KvCache, 100).unwrap();
    for extra in [u64::MAX, u64::MAX - 99, MAX_CHARGE] {
        let grown = catch_unwind(AssertUnwindSafe(|| lease.grow(extra))).unwrap_or_else(|_| panic!("grow panicked"));
        assert!(grown.is_err(), "grow({extra}) was admitted");
        assert_eq!(lease.bytes(), 100);
    }
    let shrunk = lease.shrink(u64::MAX).unwrap_err();
    assert!(shrunk.to_string().contains("100"), "{shrunk}");
    assert!(catch_unwind(AssertUnwindSafe(|| lease.resize(u64::MAX))).unwrap().is_err());
    assert_eq!(lease.bytes(), 100);
    assert_eq!(account.snapshot().current, MIB + 100);
    // Extreme limits are accepted or refused with a type, and the books still hold.
    for limit in [u64::MAX, 0, MAX_CHARGE, 1] {
        let _ = catch_unwind(AssertUnwindSafe(|| governor.set_device_limit(DEV, limit)))
            .unwrap_or_else(|_| panic!("set_device_limit({limit}) panicked"));
        let _ = catch_unwind(AssertUnwindSafe(|| governor.set_quota(account.authority(), limit)))
            .unwrap_or_else(|_| panic!("set_quota({limit}) panicked"));
        let _ = governor.set_overdraft_limit(DEV, limit);
        assert_eq!(account.snapshot().current, MIB + 100);
    }
    governor.set_device_limit(DEV, 4 * MIB).unwrap();
    governor.set_quota(account.authority(), 2 * MIB).unwrap();
    let rest = account.lease(MemoryRole::Activations, MIB - 100).unwrap();
    assert!(account.lease(MemoryRole::Activations, 1).is_err());
    drop((rest, lease, held));
    assert_books_zero(&governor, &account);
}

#[test]
fn a_reserve_removed_while_its_role_holds_charges_inside_it_balances_to_zero() {
    let (governor, account) = one_account(DEV, 4 * MIB, u64::MAX, 64 * KIB);
    let policy = GuaranteedReserve::new(Arc::new(HardLimit)).with_reserve(MemoryRole::Weights, 2 * MIB);
    governor.set_policy(DEV, Arc::new(policy)).unwrap();
    let weights = account.lease(MemoryRole::Weights, MIB).unwrap();
    let kv = account.lease(MemoryRole::KvCache, 2 * MIB).unwrap();
    // The reserve keeps the last 2 MiB for weights: KV is full.
    assert!(account.lease(MemoryRole::KvCache, 1).is_err());
    governor.set_policy(DEV, Arc::new(HardLimit)).unwrap();
    // Without the reserve the free MiB is anyone's, exactly.
    let more = account.lease(MemoryRole::KvCache, MIB).unwrap();
    assert!(account.lease(MemoryRole::KvCache, 1).is_err());
    assert!(account.lease(MemoryRole::Weights, 1).is_err());
    drop(more);
    // And back: the reserve fits what is charged again.
    let policy = GuaranteedReserve::new(Arc::new(HardLimit)).with_reserve(MemoryRole::Weights, 2 * MIB);
    governor.set_policy(DEV, Arc::new(policy)).unwrap();
    assert!(account.lease(MemoryRole::KvCache, 1).is_err());
    let w2 = account.lease(MemoryRole::Weights, MIB).unwrap();
    assert!(account.lease(MemoryRole::Weights, 1).is_err());
    drop((w2, kv, weights));
    governor.set_policy(DEV, Arc::new(HardLimit)).unwrap();
    assert_books_zero(&governor, &account);
}

fn copy(block: &RawAllocation) -> RawAllocation {
    RawAllocation::new(block.address(), block.bytes(), block.align(), block.device(), block.provider_tag())
}

#[test]
fn a_release_racing_forget_lost_of_the_same_block_refunds_it_exactly_once() {
    let (governor, account) = one_account(DEV, 64 * MIB, 64 * MIB, 64 * KIB);
    let inner = Arc::new(RecordingAllocator::new(HostHeap::on_device(DEV)));
    let governed = governor.govern(inner.clone() as Arc<dyn DeviceAllocator>, account.authority()).unwrap();
    let rounds = 300;
    for round in 0..rounds {
        let block = governed.allocate(&request(4096, MemoryRole::KvCache)).unwrap();
        let duplicate = copy(&block);
        let released = std::thread::scope(|s| {
            let release = s.spawn(|| governed.release(block).is_complete());
            // Twice in one call, racing the release on another thread.
            let forget = s.spawn(|| governed.forget_lost(vec![copy(&duplicate), copy(&duplicate)]));
            forget.join().unwrap();
            release.join().unwrap()
        });
        let snapshot = account.snapshot();
        // Every charge is closed once (a lost block counts as closed, and as lost).
        let settled = snapshot.totals.releases;
        assert_eq!(
            settled,
            round + 1,
            "round {round}: refunded {} times (released {released}: {:?}; inner releases {}, forgotten {}; used {})",
            settled - round,
            snapshot.totals,
            inner.calls(Callback::Release),
            inner.forgotten_blocks(),
            account.used()
        );
        assert_eq!(snapshot.current, 0, "round {round}");
        assert_eq!(governed.live_blocks(), 0, "round {round}");
        assert_eq!(
            inner.calls(Callback::Release) + inner.forgotten_blocks(),
            round + 1,
            "round {round}: the inner allocator heard of the block twice (released {released})"
        );
    }
    let calls = inner.calls(Callback::Release) + inner.forgotten_blocks();
    assert_eq!(calls, rounds, "the inner allocator heard of a block twice");
    assert_books_zero(&governor, &account);
}

#[test]
fn reserves_installed_and_removed_while_threads_charge_their_role_balance_to_zero() {
    let (governor, account) = one_account(DEV, 8 * MIB, u64::MAX, 64 * KIB);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let refused_policies = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for seed in 0..3u64 {
            let (account, stop) = (account.clone(), stop.clone());
            s.spawn(move || {
                let mut state = (seed + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                let mut leases = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let role = if state % 3 == 0 { MemoryRole::KvCache } else { MemoryRole::Weights };
                    if state % 5 < 3 {
                        if let Ok(lease) = account.lease_owned(role, 1 + state % (300 * KIB)) {
                            leases.push(lease);
                        }
                    } else if !leases.is_empty() {
                        let at = (state as usize / 7) % leases.len();
                        let mut lease: OwnedLease = leases.swap_remove(at);
                        if state % 2 == 0 {
                            let _ = lease.grow(state % (64 * KIB));
                            leases.push(lease);
                        }
                    }
                }
            });
        }
        for round in 0..3000 {
            let result = if round % 2 == 0 {
                let reserve = (1 + round as u64 % 4) * MIB;
                let policy = GuaranteedReserve::new(Arc::new(HardLimit)).with_reserve(MemoryRole::Weights, reserve);
                governor.set_policy(DEV, Arc::new(policy)).map(drop)
            } else {
                governor.set_policy(DEV, Arc::new(HardLimit)).map(drop)
            };
            if result.is_err() {
                refused_policies.fetch_add(1, Ordering::Relaxed);
            }
            let device = governor.snapshot().device(DEV).unwrap().clone();
            assert!(device.used <= 8 * MIB, "round {round}: device used {} over its limit", device.used);
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
    });
    governor.set_policy(DEV, Arc::new(HardLimit)).unwrap();
    assert_books_zero(&governor, &account);
    // The whole device is anyone's again, exactly.
    let all = account.lease(MemoryRole::KvCache, 8 * MIB).unwrap();
    assert!(account.lease(MemoryRole::Weights, 1).is_err());
    drop(all);
}

#[test]
fn governed_blocks_released_on_other_threads_racing_device_loss_are_refunded_exactly_once() {
    for round in 0..20 {
        let g = governed(Arc::new(HostHeap::on_device(DEV)), 64 * MIB, 32 * MIB, 64 * KIB);
        let blocks: Vec<BoundAllocation> =
            (0..48).map(|i| g.binding.allocate(request(4096 * (1 + i % 3), MemoryRole::KvCache)).unwrap()).collect();
        let total: u64 = blocks.iter().map(|b| b.bytes() as u64).sum();
        let (even, odd): (Vec<_>, Vec<_>) = blocks.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
        let released = std::thread::scope(|s| {
            let workers: Vec<_> = [even, odd]
                .into_iter()
                .map(|half| {
                    let binding = &g.binding;
                    s.spawn(move || {
                        let mut bytes = 0u64;
                        for (_, block) in half {
                            let size = block.bytes() as u64;
                            match binding.release(block) {
                                Ok(ReleaseSummary::Complete { .. }) => bytes += size,
                                Ok(other) => panic!("unexpected {other:?}"),
                                Err(rejected) => {
                                    assert!(
                                        matches!(rejected.reason, HandleError::DeviceLost { .. }),
                                        "{}",
                                        rejected.reason
                                    )
                                }
                            }
                        }
                        bytes
                    })
                })
                .collect();
            g.registry.invalidate_device(DEV, "racing loss");
            workers.into_iter().map(|w| w.join().unwrap()).sum::<u64>()
        });
        // What was not released stays charged until termination, then is refunded once.
        assert_eq!(g.account.snapshot().current, total - released, "round {round}");
        let report = g.registry.wait_terminated(&g.context, Duration::from_secs(10)).unwrap();
        assert_eq!(report.lost_bytes as u64, total - released, "round {round}");
        let snapshot = g.account.snapshot();
        assert_eq!(snapshot.totals.lost_bytes, total - released, "round {round}");
        assert_eq!(snapshot.totals.releases, 48, "round {round}: a charge closed twice or never");
        assert_books_zero(&g.governor, &g.account);
    }
}

/// Claims one device and hands out blocks of another.
struct OtherDevice(HostHeap, AtomicUsize);

impl DeviceAllocator for OtherDevice {
    fn device(&self) -> DeviceKey {
        DEV
    }
    fn name(&self) -> &str {
        "other-device"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        self.0.allocate(request)
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.release(allocation)
    }
}

#[test]
fn a_block_of_another_device_is_refused_by_the_registry_and_its_charge_refunded_exactly() {
    let inner = Arc::new(OtherDevice(HostHeap::on_device(DeviceKey::host(12)), AtomicUsize::new(0)));
    let g = governed(inner.clone(), 64 * MIB, MIB, 64 * KIB);
    for _ in 0..3 {
        let error = g.binding.allocate(request(64 * KIB, MemoryRole::KvCache)).unwrap_err();
        let text = error.to_string();
        assert!(text.contains(&DeviceKey::host(12).to_string()), "{text}");
        assert_eq!(g.account.snapshot().current, 0, "the refused block stayed charged");
    }
    assert_eq!(inner.1.load(Ordering::SeqCst), 3, "each refused block went back once");
    assert_eq!(inner.0.stats().unwrap().live_allocations, 0);
    let lease = g.account.lease(MemoryRole::Weights, MIB).unwrap();
    drop(lease);
    assert_books_zero(&g.governor, &g.account);
}

#[test]
fn a_device_limit_lowered_below_the_charges_pulls_back_every_accounts_credit_on_every_thread() {
    let governor = governor(MIB);
    governor.set_device_limit(DEV, 64 * MIB).unwrap();
    let accounts: Vec<Account> = (0..2)
        .map(|i| governor.open_account(AccountConfig::new(DEV, authority()).with_label(format!("t{i}"))).unwrap())
        .collect();
    let (to_main, from_workers) = mpsc::channel::<()>();
    let mut steps = Vec::new();
    let mut workers = Vec::new();
    for account in &accounts {
        for _ in 0..2 {
            let (step_tx, step_rx) = mpsc::channel::<&'static str>();
            let (account, to_main) = (account.clone(), to_main.clone());
            let (answer_tx, answer_rx) = mpsc::channel::<bool>();
            workers.push(std::thread::spawn(move || {
                let lease = account.lease_owned(MemoryRole::KvCache, 1500 * KIB).unwrap();
                to_main.send(()).unwrap();
                while let Ok(step) = step_rx.recv() {
                    match step {
                        "one" => answer_tx.send(account.lease(MemoryRole::KvCache, 1).is_ok()).unwrap(),
                        _ => break,
                    }
                }
                drop(lease);
            }));
            steps.push((step_tx, answer_rx));
        }
    }
    for _ in 0..4 {
        from_workers.recv().unwrap();
    }
    let before = governor.snapshot().device(DEV).unwrap().clone();
    assert!(before.cached_credit > 0, "the setup should leave credit cached");
    assert_eq!(before.current, 6000 * KIB);
    governor.set_device_limit(DEV, 4 * MIB).unwrap();
    let after = governor.snapshot().device(DEV).unwrap().clone();
    assert_eq!(after.cached_credit, 0, "credit cached under the old limit survived the lowering");
    assert_eq!((after.current, after.used), (6000 * KIB, 6000 * KIB));
    for (step, answer) in &steps {
        step.send("one").unwrap();
        assert!(!answer.recv().unwrap(), "a thread admitted past the lowered device limit");
    }
    for (step, _) in &steps {
        step.send("stop").unwrap();
    }
    for worker in workers {
        worker.join().unwrap();
    }
    for account in &accounts {
        assert_books_zero_for(&governor, account);
    }
    let full = accounts[0].lease(MemoryRole::Weights, 4 * MIB).unwrap();
    assert!(accounts[1].lease(MemoryRole::Weights, 1).is_err());
    drop(full);
}

fn assert_books_zero_for(governor: &Governor, account: &Account) {
    governor.return_idle_credit();
    let snapshot = account.snapshot();
    assert_eq!((snapshot.current, snapshot.used, snapshot.cached_credit), (0, 0, 0));
    let device = governor.snapshot().device(DEV).unwrap().clone();
    assert_eq!((device.current, device.used), (0, 0));
}

/// A holder that frees a lease, then lowers the quota below what is left charged.
struct Lowering {
    governor: Governor,
    authority: AuthorityIdentity,
    lease: Mutex<Option<OwnedLease>>,
}

impl ReclaimHolder for Lowering {
    fn name(&self) -> &str {
        "lowering"
    }
    fn reclaimable(&self, _device: DeviceKey) -> u64 {
        self.lease.lock().unwrap().as_ref().map_or(0, |l| l.bytes())
    }
    fn reclaim(&self, _request: &ReclaimRequest) -> u64 {
        let freed = self.lease.lock().unwrap().take().map_or(0, |l| l.bytes());
        self.governor.set_quota(self.authority, 256 * KIB).unwrap();
        self.governor.set_device_limit(DEV, 8 * MIB).unwrap();
        self.governor.set_policy(DEV, Arc::new(ReclaimThenFail)).unwrap();
        freed
    }
}

#[test]
fn a_holder_that_lowers_the_quota_below_the_charges_while_reclaiming_is_obeyed_without_deadlock() {
    let (governor, account) = one_account(DEV, 64 * MIB, MIB, 64 * KIB);
    governor.set_policy(DEV, Arc::new(ReclaimThenFail)).unwrap();
    let kept = account.lease(MemoryRole::Weights, 512 * KIB).unwrap();
    let holder = Arc::new(Lowering {
        governor: governor.clone(),
        authority: account.authority(),
        lease: Mutex::new(Some(account.lease_owned(MemoryRole::KvCache, 512 * KIB).unwrap())),
    });
    governor.register_holder(DEV, 0, holder);
    let outcome = within("a holder that lowers the quota", {
        let account = account.clone();
        move || account.lease_owned(MemoryRole::Activations, 256 * KIB).map(|l| l.bytes()).map_err(|e| e.to_string())
    });
    // The holder freed 512 KiB, but the quota it left (256 KiB) is below the 512 KiB
    // still charged: the retry is refused, and says so.
    let refused = outcome.unwrap_err();
    assert!(refused.contains("authority quota") && refused.contains(&(256 * KIB).to_string()), "{refused}");
    let snapshot = account.snapshot();
    assert_eq!(snapshot.current, 512 * KIB);
    assert_eq!(snapshot.quota, Some(256 * KIB));
    drop(kept);
    let fits = account.lease(MemoryRole::Activations, 256 * KIB).unwrap();
    assert!(account.lease(MemoryRole::Activations, 1).is_err());
    drop(fits);
    assert_books_zero(&governor, &account);
}
