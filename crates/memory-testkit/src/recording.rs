//! [`RecordingAllocator`]: counts every callback and can hold one in flight.

use std::fmt;
use std::ops::Index;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use memory_api::{
    AllocError, AllocationRequest, AllocatorStats, CapabilityError, DeviceAllocator, DeviceKey, RawAllocation,
    ReleaseOutcome, SharedMapping, VirtualBacking,
};

use crate::callback::Callback;
use crate::gate::{CallbackGate, GateState};
use crate::heap::HostHeap;
use crate::tap::{CapabilityTap, Interposer};

type GateTable = Mutex<[Option<Arc<GateState>>; Callback::COUNT]>;

struct Recorder<A> {
    inner: A,
    calls: [AtomicU64; Callback::COUNT],
    in_flight: AtomicU64,
    forgotten: AtomicU64,
    gates: Arc<GateTable>,
}

/// Decrements the in-flight count when a callback returns or unwinds.
struct InFlight<'a>(&'a AtomicU64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<A: DeviceAllocator> Recorder<A> {
    fn enter(&self, callback: Callback) -> InFlight<'_> {
        self.calls[callback.index()].fetch_add(1, Ordering::SeqCst);
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = InFlight(&self.in_flight);
        let gate = self.gates.lock().unwrap_or_else(PoisonError::into_inner)[callback.index()].clone();
        if let Some(gate) = gate {
            gate.pass();
        }
        guard
    }
}

impl<A: DeviceAllocator> Interposer for Recorder<A> {
    type Inner = A;
    type Guard<'a>
        = InFlight<'a>
    where
        A: 'a;

    fn inner(&self) -> &A {
        &self.inner
    }

    fn enter(&self, callback: Callback) -> Result<InFlight<'_>, CapabilityError> {
        Ok(Recorder::enter(self, callback))
    }
}

/// Wraps an allocator (or stands alone over a [`HostHeap`]) and counts every callback.
///
/// Each call is counted on entry, before it is forwarded, so a test can assert that a
/// callback was *not* made (for example that a stale handle was rejected before the
/// release callback). Capability calls go through the wrapper too and are counted
/// under their own [`Callback`] names. [`RecordingAllocator::gate`] holds calls to one
/// callback in flight until the test opens the gate.
///
/// ```
/// use memory_api::{AllocationRequest, DeviceAllocator};
/// use memory_testkit::{Callback, RecordingAllocator};
///
/// let recorder = RecordingAllocator::host();
/// let block = recorder.allocate(&AllocationRequest::new(64, 8)?)?;
/// assert!(recorder.release(block).is_complete());
/// assert_eq!(recorder.calls(Callback::Allocate), 1);
/// assert_eq!(recorder.calls(Callback::Release), 1);
/// assert_eq!(recorder.in_flight(), 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct RecordingAllocator<A: DeviceAllocator = HostHeap> {
    core: Arc<Recorder<A>>,
    tap: CapabilityTap<Recorder<A>>,
}

impl RecordingAllocator<HostHeap> {
    /// A recording allocator over host memory for [`DeviceKey::HOST`].
    pub fn host() -> RecordingAllocator<HostHeap> {
        RecordingAllocator::new(HostHeap::new())
    }

    /// A recording allocator over host memory that claims to serve `device`.
    pub fn on_device(device: DeviceKey) -> RecordingAllocator<HostHeap> {
        RecordingAllocator::new(HostHeap::on_device(device))
    }
}

impl<A: DeviceAllocator> RecordingAllocator<A> {
    /// Wraps `inner`.
    pub fn new(inner: A) -> RecordingAllocator<A> {
        let core = Arc::new(Recorder {
            inner,
            calls: std::array::from_fn(|_| AtomicU64::new(0)),
            in_flight: AtomicU64::new(0),
            forgotten: AtomicU64::new(0),
            gates: Arc::new(Mutex::new(std::array::from_fn(|_| None))),
        });
        let tap = CapabilityTap(Arc::clone(&core));
        RecordingAllocator { core, tap }
    }

    /// The wrapped allocator.
    pub fn inner(&self) -> &A {
        &self.core.inner
    }

    /// How many times `callback` has been entered.
    pub fn calls(&self, callback: Callback) -> u64 {
        self.core.calls[callback.index()].load(Ordering::SeqCst)
    }

    /// A snapshot of every counter.
    pub fn counts(&self) -> CallCounts {
        CallCounts(std::array::from_fn(|i| self.core.calls[i].load(Ordering::SeqCst)))
    }

    /// Callbacks currently executing (including those blocked at a gate).
    pub fn in_flight(&self) -> u64 {
        self.core.in_flight.load(Ordering::SeqCst)
    }

    /// Blocks handed to [`DeviceAllocator::forget_lost`] so far.
    pub fn forgotten_blocks(&self) -> u64 {
        self.core.forgotten.load(Ordering::SeqCst)
    }

    /// Installs a closed [`CallbackGate`] on `callback`: calls to it are counted, then block
    /// until the gate is opened or dropped. Installing a second gate on the same
    /// callback replaces the first for later calls.
    ///
    /// ```
    /// use memory_api::{AllocationRequest, DeviceAllocator};
    /// use memory_testkit::{Callback, RecordingAllocator};
    ///
    /// let recorder = RecordingAllocator::host();
    /// let gate = recorder.gate(Callback::Allocate);
    /// std::thread::scope(|s| {
    ///     let worker = s.spawn(|| recorder.allocate(&AllocationRequest::new(64, 8).unwrap()));
    ///     gate.wait_until_blocked(1);            // the allocate is now in flight
    ///     assert_eq!(recorder.in_flight(), 1);
    ///     gate.open();
    ///     let block = worker.join().unwrap().unwrap();
    ///     assert!(recorder.release(block).is_complete());
    /// });
    /// ```
    pub fn gate(&self, callback: Callback) -> CallbackGate {
        let state = Arc::new(GateState::default());
        let table = Arc::clone(&self.core.gates);
        table.lock().unwrap_or_else(PoisonError::into_inner)[callback.index()] = Some(Arc::clone(&state));
        let ours = Arc::clone(&state);
        let uninstall = Box::new(move || {
            let mut gates = table.lock().unwrap_or_else(PoisonError::into_inner);
            let slot = &mut gates[callback.index()];
            if slot.as_ref().is_some_and(|installed| Arc::ptr_eq(installed, &ours)) {
                *slot = None;
            }
        });
        CallbackGate { state, uninstall: Some(uninstall) }
    }
}

impl<A: DeviceAllocator> DeviceAllocator for RecordingAllocator<A> {
    fn device(&self) -> DeviceKey {
        self.core.inner.device()
    }

    fn name(&self) -> &str {
        self.core.inner.name()
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<RawAllocation, AllocError> {
        let _in_flight = self.core.enter(Callback::Allocate);
        self.core.inner.allocate(request)
    }

    fn release(&self, allocation: RawAllocation) -> ReleaseOutcome {
        let _in_flight = self.core.enter(Callback::Release);
        self.core.inner.release(allocation)
    }

    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        let _in_flight = self.core.enter(Callback::VirtualBacking);
        self.core.inner.virtual_backing()?;
        Some(&self.tap)
    }

    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        let _in_flight = self.core.enter(Callback::SharedMapping);
        self.core.inner.shared_mapping()?;
        Some(&self.tap)
    }

    fn stats(&self) -> Option<AllocatorStats> {
        let _in_flight = self.core.enter(Callback::Stats);
        self.core.inner.stats()
    }

    fn trim(&self) -> usize {
        let _in_flight = self.core.enter(Callback::Trim);
        self.core.inner.trim()
    }

    fn forget_lost(&self, lost: Vec<RawAllocation>) {
        let _in_flight = self.core.enter(Callback::ForgetLost);
        self.core.forgotten.fetch_add(lost.len() as u64, Ordering::SeqCst);
        self.core.inner.forget_lost(lost);
    }
}

impl<A: DeviceAllocator> fmt::Debug for RecordingAllocator<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordingAllocator")
            .field("inner", &self.core.inner.name())
            .field("device", &self.core.inner.device())
            .field("counts", &self.counts())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

/// A snapshot of a [`RecordingAllocator`]'s counters, indexed by [`Callback`].
#[derive(Copy, Clone, PartialEq, Eq, Default)]
pub struct CallCounts([u64; Callback::COUNT]);

impl CallCounts {
    /// Calls of `callback`.
    pub fn get(&self, callback: Callback) -> u64 {
        self.0[callback.index()]
    }

    /// Calls of every callback together.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

impl Index<Callback> for CallCounts {
    type Output = u64;

    fn index(&self, callback: Callback) -> &u64 {
        &self.0[callback.index()]
    }
}

impl fmt::Debug for CallCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for callback in Callback::ALL {
            if self.get(callback) != 0 {
                map.entry(&callback.name(), &self.get(callback));
            }
        }
        map.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memory_api::ByteRange;

    fn request(bytes: usize) -> AllocationRequest {
        AllocationRequest::new(bytes, 8).unwrap()
    }

    #[test]
    fn every_callback_is_counted_before_it_is_forwarded() {
        let recorder = RecordingAllocator::on_device(DeviceKey::device(3));
        assert_eq!(recorder.device(), DeviceKey::device(3));
        let a = recorder.allocate(&request(16)).unwrap();
        let b = recorder.allocate(&request(16)).unwrap();
        assert!(recorder.release(a).is_complete());
        assert!(recorder.virtual_backing().is_none());
        assert!(recorder.shared_mapping().is_none());
        assert!(recorder.stats().is_some());
        assert_eq!(recorder.trim(), 0);
        recorder.forget_lost(vec![b]);
        let counts = recorder.counts();
        assert_eq!(counts[Callback::Allocate], 2);
        assert_eq!(counts[Callback::Release], 1);
        for callback in [Callback::VirtualBacking, Callback::SharedMapping, Callback::Stats, Callback::Trim] {
            assert_eq!(counts[callback], 1, "{callback}");
        }
        assert_eq!(counts[Callback::ForgetLost], 1);
        assert_eq!(recorder.forgotten_blocks(), 1);
        assert_eq!(counts.total(), 8);
        assert_eq!(counts[Callback::Commit], 0);
    }

    #[test]
    fn a_gate_holds_release_in_flight_until_opened() {
        let recorder = RecordingAllocator::host();
        let block = recorder.allocate(&request(32)).unwrap();
        let gate = recorder.gate(Callback::Release);
        std::thread::scope(|s| {
            let worker = s.spawn(|| recorder.release(block));
            gate.wait_until_blocked(1);
            assert_eq!(recorder.in_flight(), 1);
            assert_eq!(recorder.calls(Callback::Release), 1);
            // The inner heap has not been reached: the block is still live.
            assert_eq!(recorder.inner().stats().unwrap().live_allocations, 1);
            gate.open();
            assert!(worker.join().unwrap().is_complete());
        });
        assert_eq!(gate.passed(), 1);
        assert_eq!(recorder.in_flight(), 0);
        assert_eq!(recorder.inner().stats().unwrap().live_allocations, 0);
    }

    #[test]
    fn dropping_a_gate_releases_blocked_calls_and_uninstalls_it() {
        let recorder = RecordingAllocator::host();
        let gate = recorder.gate(Callback::Allocate);
        std::thread::scope(|s| {
            let worker = s.spawn(|| recorder.allocate(&request(8)));
            gate.wait_until_blocked(1);
            drop(gate);
            let block = worker.join().unwrap().unwrap();
            assert!(recorder.release(block).is_complete());
        });
        // No gate any more: this call must not block.
        let block = recorder.allocate(&request(8)).unwrap();
        assert!(recorder.release(block).is_complete());
    }

    #[test]
    fn in_flight_is_restored_when_the_inner_callback_panics() {
        let faulty = crate::FaultyAllocator::new(HostHeap::new());
        faulty.panic_on_nth(Callback::Allocate, 1);
        let recorder = RecordingAllocator::new(faulty);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| recorder.allocate(&request(8))));
        assert!(result.is_err());
        assert_eq!(recorder.in_flight(), 0);
        assert_eq!(recorder.calls(Callback::Allocate), 1);
    }

    #[test]
    fn capability_calls_are_counted_and_forwarded() {
        // A FaultyAllocator over a heap offers no capabilities, so wrap a tiny
        // allocator that does.
        let recorder = RecordingAllocator::new(crate::conformance::tests_support::PageReserve::new());
        let vb = recorder.virtual_backing().expect("inner offers VirtualBacking");
        let block = recorder.allocate(&AllocationRequest::new(8192, 4096).unwrap()).unwrap();
        assert_eq!(vb.commit(&block, ByteRange::new(0, 4096)).unwrap(), 4096);
        assert_eq!(vb.committed_bytes(&block).unwrap(), 4096);
        assert_eq!(vb.decommit(&block, ByteRange::new(0, 4096)).unwrap(), 4096);
        assert!(recorder.release(block).is_complete());
        let counts = recorder.counts();
        assert_eq!((counts[Callback::Commit], counts[Callback::CommittedBytes], counts[Callback::Decommit]), (1, 1, 1));
        assert_eq!(counts[Callback::VirtualBacking], 1);
    }
}
