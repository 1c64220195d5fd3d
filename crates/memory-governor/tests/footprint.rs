//! Allocated vs reserved, and the recovery ladder: a device's books count what caches
//! keep idle beside what tenants were charged; a cache's backing is refused past the
//! device limit; a governed allocation that meets the limit trims the device's caches
//! (largest idle first), then asks the reclaim holders, retrying after each, and only
//! then refuses, with both figures and the ladder's results in the message and the
//! timeline.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use allocator_cpu::{PoolConfig, PooledAllocator, SystemAllocator};
use common::*;
use memory_governor::*;

const DEV: DeviceKey = DeviceKey::host(31);
const KIB: usize = 1024;

fn request(bytes: usize) -> AllocationRequest {
    AllocationRequest::new(bytes, 64).unwrap().with_role(MemoryRole::Activations)
}

/// A cache a test controls: exact-size reuse of released blocks, `pad` more bytes taken
/// from the backing (and kept idle) on every miss, and, when `pinned`, a trim that
/// frees nothing (idle bytes pinned, as by fragmentation).
struct ToyCache {
    inner: Arc<dyn DeviceAllocator>,
    pad: usize,
    pinned: AtomicBool,
    /// Blocks handed out, by address, and idle blocks (reusable or padding).
    out: Mutex<HashMap<u64, RawAllocation>>,
    idle: Mutex<Vec<(RawAllocation, bool)>>,
    trims: AtomicU64,
}

impl ToyCache {
    fn new(inner: Arc<dyn DeviceAllocator>, pad: usize) -> ToyCache {
        ToyCache {
            inner,
            pad,
            pinned: AtomicBool::new(false),
            out: Mutex::new(HashMap::new()),
            idle: Mutex::new(Vec::new()),
            trims: AtomicU64::new(0),
        }
    }

    fn cached(&self) -> u64 {
        self.idle.lock().unwrap().iter().map(|(block, _)| block.bytes() as u64).sum()
    }
}

/// The same block, named again (a test's own bookkeeping).
fn copy(block: &RawAllocation) -> RawAllocation {
    RawAllocation::new(block.address(), block.bytes(), block.align(), block.device(), block.provider_tag())
}

impl DeviceAllocator for ToyCache {
    fn device(&self) -> DeviceKey {
        self.inner.device()
    }

    fn name(&self) -> &str {
        "toy-cache"
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let reuse = {
            let mut idle = self.idle.lock().unwrap();
            let at = idle.iter().position(|(block, reusable)| *reusable && block.bytes() == request.bytes());
            at.map(|at| idle.swap_remove(at).0)
        };
        let block = match reuse {
            Some(block) => block,
            None => {
                let block = self.inner.allocate(request)?;
                if self.pad > 0 {
                    match self.inner.allocate(&AllocationRequest::new(self.pad, 64).unwrap()) {
                        Ok(pad) => self.idle.lock().unwrap().push((pad, false)),
                        Err(error) => {
                            assert!(self.inner.release(block).is_complete());
                            return Err(error);
                        }
                    }
                }
                block
            }
        };
        let handed = copy(&block);
        self.out.lock().unwrap().insert(block.address().get(), block);
        Ok(handed)
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let Some(block) = self.out.lock().unwrap().remove(&allocation.address().get()) else {
            let error = ReleaseError::NotOwned {
                allocator: "toy-cache".into(),
                device: self.device(),
                address: allocation.address().get(),
            };
            return ReleaseOutcome::failed(allocation, error);
        };
        let bytes = block.bytes();
        self.idle.lock().unwrap().push((block, true));
        ReleaseOutcome::complete(bytes)
    }

    fn stats(&self) -> Option<AllocatorStats> {
        let idle = self.idle.lock().unwrap();
        Some(AllocatorStats {
            live_bytes: self.out.lock().unwrap().values().map(|block| block.bytes() as u64).sum(),
            cached_bytes: idle.iter().map(|(block, _)| block.bytes() as u64).sum(),
            largest_free_bytes: idle.iter().map(|(block, _)| block.bytes() as u64).max().unwrap_or(0),
            ..AllocatorStats::default()
        })
    }

    fn trim(&self) -> usize {
        self.trims.fetch_add(1, Ordering::Relaxed);
        if self.pinned.load(Ordering::Relaxed) {
            return 0;
        }
        let idle: Vec<_> = self.idle.lock().unwrap().drain(..).collect();
        idle.into_iter()
            .map(|(block, _)| {
                let bytes = block.bytes();
                assert!(self.inner.release(block).is_complete());
                bytes
            })
            .sum()
    }
}

struct Tenant {
    governor: Governor,
    account: Account,
    cache: Arc<ToyCache>,
    governed: GovernedAllocator,
}

/// A governor with a device limit and one tenant allocating through a toy cache whose
/// backing is the device's cache backing.
fn tenant_over_cache(limit: u64, pad: usize) -> Tenant {
    let governor = governor(4096);
    governor.set_device_limit(DEV, limit).unwrap();
    governor.enable_timeline(1024);
    let account = governor.open_account(AccountConfig::new(DEV, authority()).with_label("pooled")).unwrap();
    let backing = Arc::new(governor.cache_backing(Arc::new(SystemAllocator::for_device(DEV))));
    let cache = Arc::new(ToyCache::new(backing, pad));
    let governed = governor.govern(Arc::clone(&cache) as Arc<dyn DeviceAllocator>, account.authority()).unwrap();
    Tenant { governor, account, cache, governed }
}

fn device(governor: &Governor) -> DeviceSnapshot {
    governor.return_idle_credit();
    governor.snapshot().device(DEV).unwrap().clone()
}

fn kinds(governor: &Governor) -> Vec<TimelineEventKind> {
    governor
        .timeline_events()
        .0
        .into_iter()
        .map(|event| event.kind)
        .filter(|kind| !matches!(kind, TimelineEventKind::Charge | TimelineEventKind::Refund))
        .collect()
}

#[test]
fn reserved_is_allocated_plus_what_the_caches_keep_idle_per_device_and_tenant() {
    let t = tenant_over_cache(64 << 20, 0);
    let blocks: Vec<_> = (0..3).map(|_| t.governed.allocate(&request(256 * KIB)).unwrap()).collect();
    let mut blocks = blocks.into_iter();
    assert!(t.governed.release(blocks.next().unwrap()).is_complete());
    assert!(t.governed.release(blocks.next().unwrap()).is_complete());
    let d = device(&t.governor);
    assert_eq!(d.allocated, 256 * KIB as u64);
    assert_eq!(d.cached, 512 * KIB as u64);
    assert_eq!(d.reserved, 768 * KIB as u64);
    assert_eq!(d.held_by_caches, 768 * KIB as u64, "the backing counts every block the cache took");
    assert_eq!(d.largest_free, 256 * KIB as u64);
    assert!((d.fragmentation() - 0.5).abs() < 1e-9, "two idle blocks of 256 KiB: {}", d.fragmentation());
    assert_eq!(d.caches.len(), 1);
    assert_eq!((d.caches[0].name.as_str(), d.caches[0].live, d.caches[0].cached), ("toy-cache", 256 << 10, 512 << 10));
    let a = t.account.snapshot();
    assert_eq!((a.allocated, a.cached, a.reserved), (256 << 10, 512 << 10, 768 << 10));
    let footprint = t.account.footprint();
    assert_eq!((footprint.device_reserved, footprint.tenant_reserved), (768 << 10, 768 << 10));
    assert!(t.governor.snapshot().to_json().contains("\"held_by_caches\""));
    // A trim gives the idle bytes back: reserved falls to allocated.
    assert_eq!(t.governed.trim(), 512 * KIB);
    let d = device(&t.governor);
    assert_eq!((d.reserved, d.held_by_caches, d.reserved_peak), (256 << 10, 256 << 10, 768 << 10));
    assert!(t.governed.release(blocks.next().unwrap()).is_complete());
    t.governed.trim();
    assert_eq!(device(&t.governor).held_by_caches, 0);
}

#[test]
fn rung_a_a_backing_refused_at_the_limit_trims_the_caches_and_the_retry_succeeds() {
    let t = tenant_over_cache(1 << 20, 0);
    let blocks: Vec<_> = (0..3).map(|_| t.governed.allocate(&request(256 * KIB)).unwrap()).collect();
    for block in blocks {
        assert!(t.governed.release(block).is_complete());
    }
    assert_eq!(t.cache.cached(), 768 << 10);
    // No idle block fits 512 KiB; the backing would hold 1.25 MiB of a 1 MiB limit.
    let block = t.governed.allocate(&request(512 * KIB)).expect("served after the caches were trimmed");
    assert_eq!(t.cache.trims.load(Ordering::Relaxed), 1);
    let d = device(&t.governor);
    assert_eq!((d.ladder.trims, d.ladder.trimmed_bytes, d.ladder.refused_over_reserved), (1, 768 << 10, 0));
    assert_eq!((d.allocated, d.reserved, d.held_by_caches), (512 << 10, 512 << 10, 512 << 10));
    assert_eq!(kinds(&t.governor), [TimelineEventKind::Trim]);
    assert!(t.governed.release(block).is_complete());
}

/// A holder that owns a live block of the tenant and gives it back when asked.
struct BlockHolder {
    governed: Arc<GovernedAllocator>,
    block: Mutex<Option<RawAllocation>>,
    /// Allocates through the same governed allocator from inside `reclaim` first.
    reenter: bool,
    nested: Mutex<Option<Result<(), AllocError>>>,
}

impl ReclaimHolder for BlockHolder {
    fn name(&self) -> &str {
        "block-holder"
    }

    fn reclaimable(&self, _: DeviceKey) -> u64 {
        self.block.lock().unwrap().as_ref().map_or(0, |block| block.bytes() as u64)
    }

    fn reclaim(&self, _: &ReclaimRequest) -> u64 {
        if self.reenter {
            let nested = self.governed.allocate(&request(384 * KIB)).map(|block| {
                assert!(self.governed.release(block).is_complete());
            });
            *self.nested.lock().unwrap() = Some(nested);
        }
        let Some(block) = self.block.lock().unwrap().take() else { return 0 };
        let bytes = block.bytes() as u64;
        assert!(self.governed.release(block).is_complete());
        bytes
    }
}

/// A tenant whose cache holds 256 KiB idle (pinned: a trim frees nothing) and a holder
/// with a live 512 KiB block, on a 1 MiB device.
fn pinned_with_holder(reenter: bool) -> (Tenant, Arc<GovernedAllocator>, Arc<BlockHolder>) {
    let t = tenant_over_cache(1 << 20, 0);
    let shared =
        Arc::new(t.governor.govern(Arc::clone(&t.cache) as Arc<dyn DeviceAllocator>, t.account.authority()).unwrap());
    let idle = shared.allocate(&request(256 * KIB)).unwrap();
    assert!(shared.release(idle).is_complete());
    t.cache.pinned.store(true, Ordering::Relaxed);
    let held = shared.allocate(&request(512 * KIB)).unwrap();
    let holder = Arc::new(BlockHolder {
        governed: Arc::clone(&shared),
        block: Mutex::new(Some(held)),
        reenter,
        nested: Mutex::new(None),
    });
    t.governor.register_holder(DEV, 0, Arc::clone(&holder) as Arc<dyn ReclaimHolder>);
    (t, shared, holder)
}

#[test]
fn rung_b_when_trimming_frees_too_little_the_holders_are_asked_and_the_retry_succeeds() {
    let (t, shared, holder) = pinned_with_holder(false);
    // 768 KiB held; 512 KiB more would pass the limit; the trim frees nothing; the
    // holder's block goes back into the cache, which then serves the request.
    let block = shared.allocate(&request(512 * KIB)).expect("served after the holder gave its block back");
    assert!(holder.block.lock().unwrap().is_none());
    let d = device(&t.governor);
    assert_eq!((d.ladder.trims, d.ladder.trimmed_bytes, d.ladder.refused_over_reserved), (1, 0, 0));
    assert_eq!(kinds(&t.governor), [TimelineEventKind::Trim, TimelineEventKind::Reclaim]);
    assert_eq!(d.allocated, 512 << 10);
    assert!(shared.release(block).is_complete());
}

#[test]
fn rung_b_a_holder_that_allocates_inside_its_reclaim_is_refused_without_recursion() {
    let (t, shared, holder) = pinned_with_holder(true);
    let block = shared.allocate(&request(512 * KIB)).expect("the outer allocation is served");
    let nested = holder.nested.lock().unwrap().take().expect("the holder tried to allocate");
    let error = nested.expect_err("the nested allocation finds the limit and may not reclaim again");
    assert!(is_governor_refusal(&error), "{error}");
    assert!(error.to_string().contains("reserved"), "{error}");
    assert!(shared.release(block).is_complete());
    drop(t);
}

#[test]
fn rung_c_a_refusal_says_allocated_vs_reserved_the_largest_free_block_and_what_each_rung_did() {
    let (t, shared, holder) = pinned_with_holder(false);
    // The holder already gave its block back once; now nothing can free memory.
    let first = shared.allocate(&request(512 * KIB)).unwrap();
    assert!(holder.block.lock().unwrap().is_none());
    // 384 KiB fits the tenants' charges (896 KiB of 1 MiB) but not what the process
    // would hold: the backing holds 768 KiB, and no idle block fits.
    let error = match shared.try_allocate(&request(384 * KIB)) {
        Err(GovernedAllocError::Refused(error)) => error,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let exhaustion = error.exhaustion().expect("an exhaustion report");
    assert_eq!(exhaustion.scope, LimitScope::Reserved);
    assert_eq!((exhaustion.requested, exhaustion.used, exhaustion.available), (384 << 10, 768 << 10, 256 << 10));
    let f = exhaustion.footprint;
    assert_eq!((f.device_allocated, f.device_cached, f.device_reserved), (512 << 10, 256 << 10, 768 << 10));
    assert_eq!(
        (f.tenant_allocated, f.tenant_reserved, f.largest_free, f.trimmed),
        (512 << 10, 768 << 10, 256 << 10, Some(0))
    );
    let message = error.to_string();
    for needle in [
        "393216 bytes",
        "device limit on reserved memory",
        "524288 bytes allocated, 786432 reserved (262144 idle in caches, largest free block 262144, fragmentation 0%)",
        "tenant: 524288 allocated, 786432 reserved",
        "trimming caches gave back 0 bytes",
        "lower the caches' bound",
    ] {
        assert!(message.contains(needle), "{needle:?} missing from: {message}");
    }
    let d = device(&t.governor);
    assert_eq!(d.ladder.refused_over_reserved, 1);
    assert_eq!(d.allocated, 512 << 10, "the refused charge was cancelled");
    let tail: Vec<_> = kinds(&t.governor).into_iter().rev().take(3).collect();
    assert_eq!(tail, [TimelineEventKind::Refusal, TimelineEventKind::Reclaim, TimelineEventKind::Trim]);
    assert!(shared.release(first).is_complete());
}

/// A tenant through a padding cache beside a tenant that allocates directly (no cache).
fn cache_beside_direct(pad: usize) -> (Tenant, GovernedAllocator, RawAllocation) {
    let t = tenant_over_cache(1 << 20, pad);
    let other = t.governor.open_account(AccountConfig::new(DEV, authority()).with_label("direct")).unwrap();
    let direct = t.governor.govern(Arc::new(SystemAllocator::for_device(DEV)), other.authority()).unwrap();
    let held = direct.allocate(&request(600 * KIB)).unwrap();
    (t, direct, held)
}

#[test]
fn a_cache_that_grows_past_the_limit_while_serving_is_trimmed_after_the_allocation() {
    let (t, direct, held) = cache_beside_direct(300 * KIB);
    let first = t.governed.allocate(&request(100 * KIB)).unwrap();
    assert_eq!(device(&t.governor).reserved, 1000 << 10);
    // The second miss takes 400 KiB more: 800 KiB held by the cache is under the limit,
    // but with the direct tenant's 600 KiB the process would hold 1.4 MiB.
    let second = t.governed.allocate(&request(100 * KIB)).expect("kept after the pads were trimmed");
    let d = device(&t.governor);
    assert_eq!((d.ladder.trims, d.ladder.trimmed_bytes), (1, 600 << 10));
    assert_eq!((d.allocated, d.cached, d.reserved), (800 << 10, 0, 800 << 10));
    // Between the cache's growth and the check after it, the process held 1.4 MiB: the
    // peak says so (the backing alone never passed the limit).
    assert_eq!((d.reserved_peak, d.held_by_caches_peak), (1400 << 10, 800 << 10));
    for block in [first, second] {
        assert!(t.governed.release(block).is_complete());
    }
    assert!(direct.release(held).is_complete());
}

#[test]
fn a_cache_that_grows_past_the_limit_and_cannot_trim_gives_the_block_back_and_is_refused() {
    let (t, direct, held) = cache_beside_direct(300 * KIB);
    let first = t.governed.allocate(&request(100 * KIB)).unwrap();
    t.cache.pinned.store(true, Ordering::Relaxed);
    let error = t.governed.allocate(&request(100 * KIB)).expect_err("over the limit with nothing to trim");
    assert!(is_governor_refusal(&error), "{error}");
    let d = device(&t.governor);
    assert_eq!(d.ladder.refused_over_reserved, 1);
    assert_eq!(d.allocated, 700 << 10, "the refused block's charge went back");
    assert_eq!(t.account.snapshot().allocated, 100 << 10);
    assert!(t.governed.release(first).is_complete());
    assert!(direct.release(held).is_complete());
}

#[test]
fn a_governed_pool_over_a_cache_backing_books_its_cache_and_trims_it_on_the_ladder() {
    let governor = governor(4096);
    governor.set_device_limit(DEV, 8 << 20).unwrap();
    let account = governor.open_account(AccountConfig::new(DEV, authority()).with_label("pool")).unwrap();
    let backing: Arc<dyn DeviceAllocator> =
        Arc::new(governor.cache_backing(Arc::new(SystemAllocator::for_device(DEV))));
    let pool = Arc::new(PooledAllocator::with_config(backing, PoolConfig::default()));
    let governed = governor.govern(pool, account.authority()).unwrap();
    let blocks: Vec<_> = (0..8).map(|_| governed.allocate(&request(512 * KIB)).unwrap()).collect();
    for block in blocks {
        assert!(governed.release(block).is_complete());
    }
    let d = device(&governor);
    assert_eq!(d.allocated, 0);
    assert!(d.cached > 0 && d.reserved == d.cached, "the pool's idle bytes are reserved: {d:?}");
    assert!(d.held_by_caches >= d.cached, "the backing holds at least what the pool keeps idle: {d:?}");
    // 6 MiB more in one piece: with the pool's idle bytes still held, the backing would
    // pass the limit; the pool gives them back (by its own policy, or trimmed on the
    // ladder) and the allocation is served within the limit.
    let cached_before = d.cached;
    let big = governed.allocate(&request(6 << 20)).expect("served within the limit");
    let d = device(&governor);
    assert!(d.held_by_caches <= 8 << 20 && d.reserved <= 8 << 20, "{d:?}");
    if cached_before + (6 << 20) > 8 << 20 && d.ladder.trims == 0 {
        assert!(d.cached < cached_before, "the pool gave idle memory back itself: {d:?}");
    }
    assert!(governed.release(big).is_complete());
}

#[test]
fn a_holder_panicking_on_the_growth_checks_ladder_leaves_no_block_or_charge_behind() {
    let (t, direct, held) = cache_beside_direct(300 * KIB);
    let first = t.governed.allocate(&request(100 * KIB)).unwrap();
    t.cache.pinned.store(true, Ordering::Relaxed);
    t.governor.register_holder(DEV, 0, Arc::new(PanickingHolder("holder exploded on the ladder")));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.governed.allocate(&request(100 * KIB))));
    assert!(outcome.is_err(), "the holder's panic propagates");
    let d = device(&t.governor);
    assert_eq!(d.allocated, 700 << 10, "the block the panicking ladder was checking stayed charged");
    assert_eq!(t.account.snapshot().allocated, 100 << 10);
    assert_eq!(t.account.snapshot().totals.live, 1);
    assert_eq!(t.cache.out.lock().unwrap().len(), 1, "the block stayed out of its cache");
    assert!(t.governed.release(first).is_complete());
    assert!(direct.release(held).is_complete());
    assert_eq!(device(&t.governor).allocated, 0);
}
