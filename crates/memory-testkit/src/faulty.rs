//! [`FaultyAllocator`]: injects failures, partial releases and panics on demand.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, BackendError, CapabilityError, DeviceAllocator, DeviceKey,
    RawAllocation, ReleaseError, ReleaseOutcome, SharedMapping, VirtualBacking,
};

use crate::callback::Callback;
use crate::heap::HostHeap;
use crate::tap::{CapabilityTap, Interposer};

/// The `backend` field of every [`BackendError`] this crate injects.
pub const INJECTED_BACKEND: &str = "fault-injection";

/// Whether `error` was injected by a [`FaultyAllocator`].
pub fn is_injected(error: &BackendError) -> bool {
    error.backend == INJECTED_BACKEND
}

#[derive(Clone, Debug)]
enum Action {
    Fail,
    FailAllocate(AllocError),
    Quarantine { unmapped: usize, residual: usize },
    Panic,
}

#[derive(Debug)]
struct Planned {
    callback: Callback,
    remaining: u64,
    nth: u64,
    action: Action,
}

struct Injector<A> {
    inner: A,
    plan: Mutex<Vec<Planned>>,
    injected: AtomicU64,
}

fn injected_error(callback: Callback, nth: u64) -> BackendError {
    BackendError {
        backend: INJECTED_BACKEND,
        operation: callback.name(),
        code: -1,
        detail: format!("failure injected into call {nth} of {callback} after it was planned"),
    }
}

impl<A> Injector<A> {
    fn plan(&self) -> MutexGuard<'_, Vec<Planned>> {
        self.plan.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one call of `callback` against every pending fault for it and returns
    /// the fault that falls due, if any. Panics (after unlocking) for a planned panic.
    fn take(&self, callback: Callback) -> Option<(Action, u64)> {
        let mut plan = self.plan();
        for planned in plan.iter_mut().filter(|p| p.callback == callback) {
            planned.remaining = planned.remaining.saturating_sub(1);
        }
        let due = plan.iter().position(|p| p.callback == callback && p.remaining == 0)?;
        let planned = plan.remove(due);
        drop(plan);
        self.injected.fetch_add(1, Ordering::SeqCst);
        if let Action::Panic = planned.action {
            panic!("injected panic in call {} of {callback} (FaultyAllocator)", planned.nth);
        }
        Some((planned.action, planned.nth))
    }
}

impl<A: DeviceAllocator> Interposer for Injector<A> {
    type Inner = A;
    type Guard<'a>
        = ()
    where
        A: 'a;

    fn inner(&self) -> &A {
        &self.inner
    }

    fn enter(&self, callback: Callback) -> Result<(), CapabilityError> {
        match self.take(callback) {
            Some((_, nth)) => Err(CapabilityError::Backend(injected_error(callback, nth))),
            None => Ok(()),
        }
    }
}

/// Wraps an allocator and makes chosen calls fail, release partially or panic.
///
/// Faults are planned per callback, counted from the call after planning: `n = 1` hits
/// the next call. Each planned fault fires once; several may be pending at once. A
/// faulted call does not reach the inner allocator, so nothing is mutated by it (the
/// inner allocator still owns a block whose release was failed or quarantined, and a
/// later release retries it for real). Injected errors are recognisable with
/// [`is_injected`].
///
/// ```
/// use memory_api::{AllocationRequest, DeviceAllocator, ReleaseOutcome};
/// use memory_testkit::{Callback, FaultyAllocator};
///
/// let faulty = FaultyAllocator::host();
/// let request = AllocationRequest::new(8192, 64)?;
/// faulty.fail_nth(Callback::Allocate, 2);
/// let block = faulty.allocate(&request)?;         // call 1 succeeds
/// assert!(faulty.allocate(&request).is_err());    // call 2 is refused
///
/// faulty.quarantine_nth_release(1, 4096, 4096);
/// let ReleaseOutcome::Quarantined(q) = faulty.release(block) else { panic!() };
/// assert_eq!((q.unmapped_bytes(), q.residual_bytes()), (4096, 4096));
/// let (block, _error) = q.into_parts();
/// assert!(faulty.release(block).is_complete());  // the retry reaches the heap
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct FaultyAllocator<A: DeviceAllocator = HostHeap> {
    core: Arc<Injector<A>>,
    tap: CapabilityTap<Injector<A>>,
}

impl FaultyAllocator<HostHeap> {
    /// A fault injector over host memory for [`DeviceKey::HOST`].
    pub fn host() -> FaultyAllocator<HostHeap> {
        FaultyAllocator::new(HostHeap::new())
    }
}

impl<A: DeviceAllocator> FaultyAllocator<A> {
    /// Wraps `inner` with no fault planned.
    pub fn new(inner: A) -> FaultyAllocator<A> {
        let core = Arc::new(Injector { inner, plan: Mutex::new(Vec::new()), injected: AtomicU64::new(0) });
        let tap = CapabilityTap(Arc::clone(&core));
        FaultyAllocator { core, tap }
    }

    /// The wrapped allocator.
    pub fn inner(&self) -> &A {
        &self.core.inner
    }

    fn push(&self, callback: Callback, n: u64, action: Action) {
        assert!(n >= 1, "fault plans count calls from 1 (the next call); got n = 0");
        self.core.plan().push(Planned { callback, remaining: n, nth: n, action });
    }

    /// Makes the `n`-th call of `callback` from now fail without reaching the inner
    /// allocator: `allocate` returns [`AllocError::Backend`]; `release` returns
    /// [`ReleaseOutcome::Failed`] handing the block back; capability calls return
    /// [`CapabilityError::Backend`]; `stats` returns `None`; `trim` returns 0; capability
    /// discovery returns `None`.
    ///
    /// # Panics
    /// If `n` is 0, or for [`Callback::ForgetLost`], which cannot fail (plan a panic).
    pub fn fail_nth(&self, callback: Callback, n: u64) {
        assert!(callback != Callback::ForgetLost, "forget_lost cannot fail; use panic_on_nth(ForgetLost, n)");
        self.push(callback, n, Action::Fail);
    }

    /// Makes the `n`-th `allocate` from now return `error` (an out-of-memory or a device
    /// loss, for example).
    ///
    /// # Panics
    /// If `n` is 0.
    pub fn fail_nth_allocate_with(&self, n: u64, error: AllocError) {
        self.push(Callback::Allocate, n, Action::FailAllocate(error));
    }

    /// Makes the `n`-th `release` from now report a partial release: quarantined, with
    /// `unmapped` bytes claimed unmapped and `residual` still owned, and the block handed
    /// back. Claims larger than the block are corrected by
    /// [`ReleaseOutcome::quarantined`] (use that to test how callers treat dishonest
    /// allocators).
    ///
    /// # Panics
    /// If `n` is 0.
    pub fn quarantine_nth_release(&self, n: u64, unmapped: usize, residual: usize) {
        self.push(Callback::Release, n, Action::Quarantine { unmapped, residual });
    }

    /// Makes the `n`-th call of `callback` from now panic before reaching the inner
    /// allocator.
    ///
    /// # Panics
    /// If `n` is 0.
    pub fn panic_on_nth(&self, callback: Callback, n: u64) {
        self.push(callback, n, Action::Panic);
    }

    /// Drops every pending fault.
    pub fn clear(&self) {
        self.core.plan().clear();
    }

    /// Faults planned but not yet fired.
    pub fn pending(&self) -> usize {
        self.core.plan().len()
    }

    /// Faults fired so far (panics included).
    pub fn injected(&self) -> u64 {
        self.core.injected.load(Ordering::SeqCst)
    }
}

impl<A: DeviceAllocator> DeviceAllocator for FaultyAllocator<A> {
    fn device(&self) -> DeviceKey {
        self.core.inner.device()
    }

    fn name(&self) -> &str {
        self.core.inner.name()
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        match self.core.take(Callback::Allocate) {
            None => self.core.inner.allocate(request),
            Some((Action::FailAllocate(error), _)) => Err(error),
            Some((_, nth)) => {
                Err(AllocError::Backend { device: self.device(), source: injected_error(Callback::Allocate, nth) })
            }
        }
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        match self.core.take(Callback::Release) {
            None => self.core.inner.release(allocation),
            Some((Action::Quarantine { unmapped, residual }, nth)) => ReleaseOutcome::quarantined(
                allocation,
                unmapped,
                residual,
                ReleaseError::Backend(injected_error(Callback::Release, nth)),
            ),
            Some((_, nth)) => {
                ReleaseOutcome::failed(allocation, ReleaseError::Backend(injected_error(Callback::Release, nth)))
            }
        }
    }

    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        if self.core.take(Callback::VirtualBacking).is_some() {
            return None;
        }
        self.core.inner.virtual_backing()?;
        Some(&self.tap)
    }

    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        if self.core.take(Callback::SharedMapping).is_some() {
            return None;
        }
        self.core.inner.shared_mapping()?;
        Some(&self.tap)
    }

    fn stats(&self) -> Option<AllocatorStats> {
        if self.core.take(Callback::Stats).is_some() {
            return None;
        }
        self.core.inner.stats()
    }

    fn trim(&self) -> usize {
        if self.core.take(Callback::Trim).is_some() {
            return 0;
        }
        self.core.inner.trim()
    }

    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        // Only a panic can be planned here (see `fail_nth`).
        let _ = self.core.take(Callback::ForgetLost);
        self.core.inner.forget_lost(lost);
    }
}

impl<A: DeviceAllocator> fmt::Debug for FaultyAllocator<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyAllocator")
            .field("inner", &self.core.inner.name())
            .field("pending", &self.pending())
            .field("injected", &self.injected())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memory_api::{ByteRange, MaybeBytes};
    use std::panic::{AssertUnwindSafe, catch_unwind};

    fn request() -> AllocationRequest {
        AllocationRequest::new(4096, 64).unwrap()
    }

    #[test]
    fn the_nth_allocate_fails_and_only_that_one() {
        let faulty = FaultyAllocator::host();
        faulty.fail_nth(Callback::Allocate, 3);
        let a = faulty.allocate(&request()).unwrap();
        let b = faulty.allocate(&request()).unwrap();
        let AllocError::Backend { source, .. } = faulty.allocate(&request()).unwrap_err() else {
            panic!("expected an injected backend error")
        };
        assert!(is_injected(&source));
        assert!(source.to_string().contains("call 3 of allocate"), "{source}");
        let c = faulty.allocate(&request()).unwrap();
        assert_eq!(faulty.injected(), 1);
        assert_eq!(faulty.inner().stats().unwrap().live_allocations, 3);
        for block in [a, b, c] {
            assert!(faulty.release(block).is_complete());
        }
    }

    #[test]
    fn a_chosen_allocate_error_is_returned_verbatim() {
        let faulty = FaultyAllocator::host();
        let oom =
            AllocError::OutOfMemory { device: DeviceKey::HOST, requested: 1, align: 1, available: MaybeBytes(None) };
        faulty.fail_nth_allocate_with(1, oom.clone());
        assert_eq!(faulty.allocate(&request()).unwrap_err(), oom);
        assert_eq!(faulty.inner().stats().unwrap().allocations_total, 0, "a faulted call must not reach the heap");
    }

    #[test]
    fn a_failed_release_hands_the_block_back_untouched() {
        let faulty = FaultyAllocator::host();
        let block = faulty.allocate(&request()).unwrap();
        faulty.fail_nth(Callback::Release, 1);
        let ReleaseOutcome::Failed(failed) = faulty.release(block) else { panic!("expected Failed") };
        let (block, error) = failed.into_parts();
        assert!(matches!(error, ReleaseError::Backend(ref e) if is_injected(e)));
        assert_eq!(faulty.inner().stats().unwrap().live_allocations, 1);
        assert!(faulty.release(block).is_complete());
    }

    #[test]
    fn a_dishonest_quarantine_is_corrected_by_the_outcome_constructor() {
        let faulty = FaultyAllocator::host();
        let block = faulty.allocate(&request()).unwrap();
        faulty.quarantine_nth_release(1, 4096, 4096);
        let ReleaseOutcome::Quarantined(q) = faulty.release(block) else { panic!("expected Quarantined") };
        assert!(q.was_corrected());
        assert_eq!(q.residual_bytes(), 4096);
        let (block, _) = q.into_parts();
        assert!(faulty.release(block).is_complete());
    }

    #[test]
    fn a_planned_panic_fires_once_and_leaves_the_allocator_usable() {
        let faulty = FaultyAllocator::host();
        faulty.panic_on_nth(Callback::Trim, 2);
        assert_eq!(faulty.trim(), 0);
        let payload = catch_unwind(AssertUnwindSafe(|| faulty.trim())).unwrap_err();
        let message = payload.downcast_ref::<String>().unwrap();
        assert!(message.contains("call 2 of trim"), "{message}");
        assert_eq!(faulty.trim(), 0);
        assert_eq!(faulty.pending(), 0);
        let block = faulty.allocate(&request()).unwrap();
        assert!(faulty.release(block).is_complete());
    }

    #[test]
    fn faults_on_queries_and_capabilities_take_their_failure_forms() {
        let faulty = FaultyAllocator::new(crate::conformance::tests_support::PageReserve::new());
        faulty.fail_nth(Callback::Stats, 1);
        faulty.fail_nth(Callback::VirtualBacking, 1);
        assert!(faulty.stats().is_none());
        assert!(faulty.stats().is_some());
        assert!(faulty.virtual_backing().is_none());
        let vb = faulty.virtual_backing().unwrap();
        let block = faulty.allocate(&AllocationRequest::new(8192, 4096).unwrap()).unwrap();
        faulty.fail_nth(Callback::Commit, 1);
        let err = vb.commit(&block, ByteRange::new(0, 4096)).unwrap_err();
        assert!(matches!(err, CapabilityError::Backend(ref e) if is_injected(e)), "{err}");
        assert_eq!(vb.committed_bytes(&block).unwrap(), 0, "a faulted commit must not reach the inner allocator");
        assert_eq!(vb.commit(&block, ByteRange::new(0, 4096)).unwrap(), 4096);
        assert!(faulty.release(block).is_complete());
    }

    #[test]
    #[should_panic(expected = "forget_lost cannot fail")]
    fn planning_a_failure_of_forget_lost_is_a_test_bug() {
        FaultyAllocator::host().fail_nth(Callback::ForgetLost, 1);
    }
}
