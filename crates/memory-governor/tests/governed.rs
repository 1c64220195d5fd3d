//! `GovernedAllocator` registered in the `BindingRegistry`: charges by role, refunds on
//! complete release, keeps quarantined residuals charged, refunds device-lost bytes
//! only when termination is confirmed, cancels charges the allocator could not serve,
//! and forwards capabilities with the inner allocator's own view of each block.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use allocator_cpu::SystemAllocator;
#[cfg(unix)]
use allocator_cpu::VirtualHostAllocator;
use common::*;
use memory_governor::*;
use memory_testkit::{Callback, FaultyAllocator, HostHeap, RecordingAllocator};

const DEV: DeviceKey = DeviceKey::host(7);

struct Setup {
    registry: BindingRegistry,
    governor: Governor,
    account: Account,
    context: ProviderContextIdentity,
    mechanism: MechanismIdentity,
    binding: MemoryBinding,
}

fn setup(inner: Arc<dyn DeviceAllocator>, limit: u64, chunk: u64) -> Setup {
    let registry = BindingRegistry::new();
    let context = registry.register_provider_context(DEV, Arc::new("context")).unwrap();
    let authority = registry.register_authority(DEV, Arc::new("tenant")).unwrap();
    let governor = governor(chunk);
    governor.set_device_limit(DEV, limit).unwrap();
    let account = governor.open_account(AccountConfig::new(DEV, authority).with_label("tenant")).unwrap();
    let governed = governor.govern(inner, authority).unwrap();
    let mechanism = registry.register_allocator(&context, &authority, Arc::new(governed)).unwrap();
    let binding = registry.bind(DEV).unwrap();
    Setup { registry, governor, account, context, mechanism, binding }
}

fn request(bytes: usize, role: MemoryRole) -> AllocationRequest {
    AllocationRequest::new(bytes, 64).unwrap().with_role(role)
}

#[test]
fn allocations_are_charged_by_role_and_a_complete_release_refunds() {
    let s = setup(Arc::new(SystemAllocator::for_device(DEV)), 1 << 20, 4096);
    let kv = s.binding.allocate(request(10_000, MemoryRole::KvCache)).unwrap();
    let weights = s.binding.allocate(request(30_000, MemoryRole::Weights)).unwrap();
    let snapshot = s.account.snapshot();
    assert_eq!(snapshot.role(MemoryRole::KvCache).current, 10_000);
    assert_eq!(snapshot.role(MemoryRole::Weights).current, 30_000);
    assert_eq!(snapshot.totals.live, 2);
    assert!(matches!(s.binding.release(kv).unwrap(), ReleaseSummary::Complete { .. }));
    assert!(matches!(s.binding.release(weights).unwrap(), ReleaseSummary::Complete { .. }));
    s.governor.return_idle_credit();
    let snapshot = s.account.snapshot();
    assert_eq!((snapshot.current, snapshot.used), (0, 0));
    assert_eq!((snapshot.totals.allocations, snapshot.totals.releases), (2, 2));
}

#[test]
fn a_refusal_never_reaches_the_allocator_and_names_everything_through_the_registry() {
    let recording = Arc::new(RecordingAllocator::on_device(DEV));
    let s = setup(Arc::clone(&recording) as Arc<dyn DeviceAllocator>, 1000, 0);
    let held = s.binding.allocate(request(900, MemoryRole::Weights)).unwrap();
    let before = recording.calls(Callback::Allocate);
    let err = s.binding.allocate(request(200, MemoryRole::KvCache)).unwrap_err();
    assert_eq!(recording.calls(Callback::Allocate), before, "the allocator was called for a refused request");
    let AllocateError::Allocator(inner) = &err else { panic!("expected an allocator error, got {err}") };
    assert!(is_governor_refusal(inner));
    let text = err.to_string();
    for needle in ["kv-cache request of 200 bytes", "host:7", "900 of 1000 bytes used, 100 available", "\"tenant\""] {
        assert!(text.contains(needle), "missing {needle:?} in: {text}");
    }
    s.binding.release(held).unwrap();
}

#[test]
fn an_allocator_failure_cancels_the_charge() {
    let faulty = Arc::new(FaultyAllocator::new(HostHeap::on_device(DEV)));
    let s = setup(Arc::clone(&faulty) as Arc<dyn DeviceAllocator>, 1 << 20, 0);
    faulty.fail_nth(Callback::Allocate, 1);
    let err = s.binding.allocate(request(4096, MemoryRole::Activations)).unwrap_err();
    assert!(matches!(err, AllocateError::Allocator(ref inner) if !is_governor_refusal(inner)), "{err}");
    let snapshot = s.account.snapshot();
    assert_eq!((snapshot.current, snapshot.used), (0, 0));
    assert_eq!((snapshot.totals.allocations, snapshot.totals.releases, snapshot.totals.failures), (0, 0, 0));
}

#[test]
fn a_quarantined_residual_stays_charged_until_a_retry_releases_it() {
    let faulty = Arc::new(FaultyAllocator::new(HostHeap::on_device(DEV)));
    let s = setup(Arc::clone(&faulty) as Arc<dyn DeviceAllocator>, 1 << 20, 0);
    let block = s.binding.allocate(request(8192, MemoryRole::KvCache)).unwrap();
    faulty.quarantine_nth_release(1, 6144, 2048);
    let report = s.binding.release(block).unwrap();
    assert_eq!(report, ReleaseSummary::Quarantined { unmapped_bytes: 6144, residual_bytes: 2048 });
    // What was let go is refunded; the residual stays charged and shows as quarantined.
    let role = s.account.snapshot().role(MemoryRole::KvCache).clone();
    assert_eq!((role.current, role.quarantined_bytes, role.live), (2048, 2048, 1));
    // A retry on the healthy device releases the rest: refunded exactly once.
    let retry = s.registry.retry_quarantined(&s.mechanism).unwrap();
    assert_eq!((retry.released, retry.still_quarantined), (1, 0));
    let role = s.account.snapshot().role(MemoryRole::KvCache).clone();
    assert_eq!((role.current, role.quarantined_bytes, role.live), (0, 0, 0));
    assert_eq!(s.account.snapshot().used, 0);
}

#[test]
fn a_quarantine_whose_retry_quarantines_again_keeps_only_the_new_residual() {
    let faulty = Arc::new(FaultyAllocator::new(HostHeap::on_device(DEV)));
    let s = setup(Arc::clone(&faulty) as Arc<dyn DeviceAllocator>, 1 << 20, 0);
    let block = s.binding.allocate(request(8192, MemoryRole::Workspace)).unwrap();
    faulty.quarantine_nth_release(1, 0, 6000);
    s.binding.release(block).unwrap();
    faulty.quarantine_nth_release(1, 0, 1000);
    let retry = s.registry.retry_quarantined(&s.mechanism).unwrap();
    assert_eq!(retry.still_quarantined, 1);
    let role = s.account.snapshot().role(MemoryRole::Workspace).clone();
    assert_eq!((role.current, role.quarantined_bytes), (1000, 1000));
    s.registry.retry_quarantined(&s.mechanism).unwrap();
    assert_eq!(s.account.snapshot().role(MemoryRole::Workspace).current, 0);
}

#[test]
fn device_lost_bytes_stay_charged_until_termination_is_confirmed() {
    let recording = Arc::new(RecordingAllocator::on_device(DEV));
    let s = setup(Arc::clone(&recording) as Arc<dyn DeviceAllocator>, 1 << 20, 512);
    let a = s.binding.allocate(request(1000, MemoryRole::KvCache)).unwrap();
    let b = s.binding.allocate(request(3000, MemoryRole::Weights)).unwrap();
    s.registry.invalidate_device(DEV, "xid 79");
    // Release fails with device lost and hands the block back; nothing is refunded.
    let rejected = s.binding.release(a).unwrap_err();
    let a = rejected.handle;
    assert_eq!(s.account.snapshot().current, 4000);
    // Termination confirmed: the registry hands the lost blocks to forget_lost.
    let report = s.registry.confirm_context_terminated(&s.context).unwrap();
    assert_eq!(report.lost_allocations, 2);
    let snapshot = s.account.snapshot();
    assert_eq!(snapshot.current, 0);
    assert_eq!((snapshot.totals.lost_bytes, snapshot.totals.lost_allocations), (4000, 2));
    assert_eq!(snapshot.role(MemoryRole::Weights).lost_bytes, 3000);
    assert_eq!(snapshot.totals.live, 0);
    assert_eq!(recording.forgotten_blocks(), 2, "the inner allocator heard about its lost blocks");
    // Confirming again refunds nothing twice.
    s.registry.confirm_context_terminated(&s.context).unwrap();
    assert_eq!(s.account.snapshot().totals.lost_bytes, 4000);
    drop((a, b));
    s.governor.return_idle_credit();
    assert_eq!(s.account.snapshot().used, 0);
}

#[test]
fn a_quarantine_on_a_lost_device_is_refunded_at_termination() {
    let faulty = Arc::new(FaultyAllocator::new(HostHeap::on_device(DEV)));
    let s = setup(Arc::clone(&faulty) as Arc<dyn DeviceAllocator>, 1 << 20, 0);
    let block = s.binding.allocate(request(4096, MemoryRole::KvCache)).unwrap();
    faulty.quarantine_nth_release(1, 1024, 3072);
    s.binding.release(block).unwrap();
    assert_eq!(s.account.snapshot().role(MemoryRole::KvCache).quarantined_bytes, 3072);
    s.registry.invalidate_device(DEV, "lost");
    s.registry.confirm_context_terminated(&s.context).unwrap();
    let role = s.account.snapshot().role(MemoryRole::KvCache).clone();
    assert_eq!((role.current, role.quarantined_bytes, role.lost_bytes), (0, 0, 3072));
}

/// Hands out addresses from a counter with a provider tag wider than the governor's
/// inline field, and refuses any release whose tag is not the one it issued.
struct WideTags {
    next: AtomicU64,
}

const WIDE_TAG: u64 = u64::MAX - 12345;

impl DeviceAllocator for WideTags {
    fn device(&self) -> DeviceKey {
        DEV
    }
    fn name(&self) -> &str {
        "wide-tags"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let start = self.next.fetch_add(1 << 20, Ordering::Relaxed);
        Ok(RawAllocation::new(DeviceAddress::new(start).unwrap(), request.bytes(), request.align(), DEV, WIDE_TAG))
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        if allocation.provider_tag() != WIDE_TAG {
            let error = ReleaseError::NotOwned {
                allocator: "wide-tags".into(),
                device: DEV,
                address: allocation.address().get(),
            };
            return ReleaseOutcome::failed(allocation, error);
        }
        ReleaseOutcome::complete(allocation.bytes())
    }
}

#[test]
fn the_inner_allocator_gets_its_own_provider_tag_back() {
    let s = setup(Arc::new(WideTags { next: AtomicU64::new(1 << 30) }), 1 << 30, 0);
    let block = s.binding.allocate(request(100, MemoryRole::Staging)).unwrap();
    assert!(matches!(s.binding.release(block).unwrap(), ReleaseSummary::Complete { .. }));
    assert_eq!(s.account.snapshot().current, 0);
}

#[test]
#[cfg(unix)] // the virtual host allocator needs mmap
fn capabilities_are_forwarded_with_the_inner_view_of_each_block() {
    let s = setup(Arc::new(VirtualHostAllocator::for_device(DEV)), 1 << 30, 0);
    let backing = s.binding.virtual_backing().expect("the governed allocator forwards VirtualBacking");
    let granularity = backing.granularity();
    let block = s.binding.allocate(request(4 * granularity, MemoryRole::KvCache)).unwrap();
    assert_eq!(backing.commit(&block, ByteRange::new(0, 2 * granularity)).unwrap(), 2 * granularity);
    assert_eq!(backing.committed_bytes(&block).unwrap(), 2 * granularity);
    assert_eq!(backing.decommit(&block, ByteRange::new(0, granularity)).unwrap(), granularity);
    drop(backing);
    assert!(matches!(s.binding.release(block).unwrap(), ReleaseSummary::Complete { .. }));
    assert_eq!(s.account.snapshot().current, 0);
}

#[test]
fn an_allocator_that_panics_leaves_no_charge_behind() {
    let faulty = Arc::new(FaultyAllocator::new(HostHeap::on_device(DEV)));
    let s = setup(Arc::clone(&faulty) as Arc<dyn DeviceAllocator>, 1 << 20, 0);
    faulty.panic_on_nth(Callback::Allocate, 1);
    let binding = s.binding.clone();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = binding.allocate(request(4096, MemoryRole::KvCache));
    }));
    assert!(panicked.is_err(), "the injected panic propagates");
    let snapshot = s.account.snapshot();
    assert_eq!((snapshot.current, snapshot.used, snapshot.totals.live), (0, 0, 0));
    // And the books still work.
    let block = s.binding.allocate(request(4096, MemoryRole::KvCache)).unwrap();
    assert_eq!(s.account.snapshot().current, 4096);
    s.binding.release(block).unwrap();
}

#[test]
fn stats_and_trim_are_forwarded_to_the_inner_allocator() {
    use allocator_cpu::PooledAllocator;
    let (governor, account) = one_account(DEV, 1 << 20, u64::MAX, 0);
    let pooled = Arc::new(PooledAllocator::new(SystemAllocator::for_device(DEV)));
    let governed = governor.govern(Arc::clone(&pooled) as Arc<dyn DeviceAllocator>, account.authority()).unwrap();
    let block = governed.allocate(&request(1000, MemoryRole::KvCache)).unwrap();
    assert_eq!(account.snapshot().current, 1000);
    assert!(governed.release(block).is_complete());
    assert_eq!(account.used(), 0);
    let stats = governed.stats().expect("the pool keeps stats");
    assert_eq!(Some(stats), pooled.stats());
    assert!(stats.cached_bytes > 0, "the pool cached the released block: {stats:?}");
    assert_eq!(governed.trim() as u64, stats.cached_bytes, "trim returned what the pool cached");
    assert_eq!(governed.stats().unwrap().cached_bytes, 0);
    // An inner allocator without stats has none through the governor either.
    let plain = governor
        .open_account(AccountConfig::new(DeviceKey::host(8), IdentityIssuer::new().unwrap().authority().unwrap()))
        .unwrap();
    let counter = GovernedAllocator::new(Arc::new(NoStats), plain).unwrap();
    assert_eq!((counter.stats(), counter.trim()), (None, 0));
}

/// An allocator without stats or capabilities (the trait's defaults).
struct NoStats;

impl DeviceAllocator for NoStats {
    fn device(&self) -> DeviceKey {
        DeviceKey::host(8)
    }
    fn name(&self) -> &str {
        "no-stats"
    }
    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        Ok(RawAllocation::new(DeviceAddress::new(1 << 20).unwrap(), request.bytes(), request.align(), self.device(), 0))
    }
    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        ReleaseOutcome::complete(allocation.bytes())
    }
}

#[test]
fn the_governed_allocator_names_its_inner_allocator_and_account() {
    let (governor, account) = one_account(DEV, 1 << 20, u64::MAX, 0);
    let inner: Arc<dyn DeviceAllocator> = Arc::new(SystemAllocator::for_device(DEV));
    let governed = governor.govern(Arc::clone(&inner), account.authority()).unwrap();
    assert!(Arc::ptr_eq(governed.inner(), &inner));
    assert_eq!(governed.account().authority(), account.authority());
    assert_eq!(governed.name(), format!("governed({})", inner.name()));
    assert_eq!(governed.device(), DEV);
    let debug = format!("{governed:?}");
    assert!(debug.contains(inner.name()) && debug.contains("tenant"), "{debug}");
    assert!(governed.virtual_backing().is_none() && governed.shared_mapping().is_none());
    // An allocator for another device than the account is handed back.
    let other: Arc<dyn DeviceAllocator> = Arc::new(SystemAllocator::for_device(DeviceKey::host(9)));
    let refused = GovernedAllocator::new(Arc::clone(&other), account.clone()).unwrap_err();
    assert!(Arc::ptr_eq(&refused.allocator, &other));
    assert!(refused.to_string().contains("host:9"), "{refused}");
}

#[test]
fn a_failed_inner_release_changes_nothing_and_the_handle_releases_later() {
    let faulty = Arc::new(FaultyAllocator::new(HostHeap::on_device(DEV)));
    let s = setup(Arc::clone(&faulty) as Arc<dyn DeviceAllocator>, 1 << 20, 0);
    let block = s.binding.allocate(request(2048, MemoryRole::Activations)).unwrap();
    faulty.fail_nth(Callback::Release, 1);
    let rejected = s.binding.release(block).unwrap_err();
    assert!(matches!(rejected.reason, HandleError::ReleaseFailed(_)), "{}", rejected.reason);
    let role = s.account.snapshot().role(MemoryRole::Activations).clone();
    assert_eq!((role.current, role.quarantined_bytes, role.live, role.releases), (2048, 0, 1, 0));
    assert!(matches!(s.binding.release(rejected.handle).unwrap(), ReleaseSummary::Complete { .. }));
    let role = s.account.snapshot().role(MemoryRole::Activations).clone();
    assert_eq!((role.current, role.live, role.releases), (0, 0, 1));
}

#[test]
#[cfg(unix)] // the shared host allocator needs mmap
fn shared_mappings_are_forwarded_with_the_inner_view_of_each_block() {
    use allocator_cpu::SharedHostAllocator;
    let (governor, account) = one_account(DEV, 1 << 30, u64::MAX, 0);
    let inner = Arc::new(SharedHostAllocator::for_device(DEV));
    let governed = governor.govern(inner, account.authority()).unwrap();
    let mapping = governed.shared_mapping().expect("the governed allocator forwards SharedMapping");
    let page = mapping.granularity();
    assert!(page >= 4096, "{page}");
    let backing = mapping.create_backing(2 * page).unwrap();
    let (a, b) = (
        governed.allocate(&request(2 * page, MemoryRole::KvCache)).unwrap(),
        governed.allocate(&request(2 * page, MemoryRole::KvCache)).unwrap(),
    );
    let placement = SharedPlacement { target: ByteRange::new(0, 2 * page), backing_offset: 0 };
    mapping.map(&backing, &a, placement, MappingAccess::ReadWrite).unwrap();
    mapping.map(&backing, &b, placement, MappingAccess::ReadOnly).unwrap();
    assert_eq!(mapping.unmap(&a, ByteRange::new(0, 2 * page)).unwrap(), 2 * page);
    // A block the governor did not hand out is refused before the inner allocator.
    let forged = RawAllocation::new(b.address(), b.bytes(), b.align(), b.device(), b.provider_tag() ^ 1);
    let refused = mapping.map(&backing, &forged, placement, MappingAccess::ReadWrite);
    assert!(matches!(refused, Err(CapabilityError::NotOwned { .. })), "{refused:?}");
    assert!(matches!(mapping.unmap(&forged, ByteRange::new(0, page)), Err(CapabilityError::NotOwned { .. })));
    drop(backing);
    assert!(governed.release(a).is_complete());
    assert!(governed.release(b).is_complete());
    assert_eq!(account.used(), 0);
}

#[test]
fn lost_blocks_refunded_at_termination_show_on_the_timeline() {
    let recording = Arc::new(RecordingAllocator::on_device(DEV));
    let s = setup(Arc::clone(&recording) as Arc<dyn DeviceAllocator>, 1 << 20, 0);
    s.governor.enable_timeline(64);
    let block = s.binding.allocate(request(1500, MemoryRole::KvCache)).unwrap();
    s.registry.invalidate_device(DEV, "xid 79");
    s.registry.confirm_context_terminated(&s.context).unwrap();
    drop(block);
    let (events, _) = s.governor.timeline_events();
    let lost: Vec<_> = events.iter().filter(|e| e.kind == TimelineEventKind::Lost).collect();
    assert_eq!(lost.len(), 1, "{events:?}");
    assert_eq!((lost[0].role, lost[0].bytes), (MemoryRole::KvCache, 1500));
    let trace = s.governor.chrome_trace_json();
    assert!(trace.contains("lost kv-cache"), "{trace}");
    assert_eq!(s.account.snapshot().totals.lost_bytes, 1500);
}
