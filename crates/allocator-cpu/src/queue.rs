//! [`HostReleaseQueue`]: a bounded deferred-release queue whose releases run when its
//! owner says so.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};

use memory_api::{
    AllocationIdentity, DeferredReleaseQueue, DeviceKey, PreparedRelease, QueueRefusal, QueueRefusalReason,
    ReleaseSummary,
};

/// A bounded [`DeferredReleaseQueue`] for one device that holds prepared releases until
/// its owner runs them ([`HostReleaseQueue::run_all`], after it has synchronised the
/// work that used the memory) or takes them out ([`HostReleaseQueue::take`]).
///
/// It refuses a release for another device ([`QueueRefusalReason::WrongDevice`]) and
/// one past its capacity ([`QueueRefusalReason::Full`]), handing the exact release
/// back. A capacity of 0 makes a queue that refuses everything (useful in tests; the C
/// API refuses to create one). Releases run with no lock of the queue held, so a
/// release may enqueue again. Dropping the queue drops what it still holds: each such
/// release stays quarantined in its registry, by [`PreparedRelease`]'s contract.
#[derive(Debug)]
pub struct HostReleaseQueue {
    device: DeviceKey,
    capacity: usize,
    pending: Mutex<VecDeque<PreparedRelease>>,
}

impl HostReleaseQueue {
    /// A queue for `device` holding at most `capacity` releases.
    pub fn new(device: DeviceKey, capacity: usize) -> HostReleaseQueue {
        HostReleaseQueue { device, capacity, pending: Mutex::new(VecDeque::new()) }
    }

    /// The most releases it holds at once.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Releases held now.
    pub fn len(&self) -> usize {
        self.pending().len()
    }

    /// Whether it holds no release.
    pub fn is_empty(&self) -> bool {
        self.pending().is_empty()
    }

    /// Runs every held release, oldest first, with no lock held; returns what each did.
    pub fn run_all(&self) -> Vec<ReleaseSummary> {
        // Taken whole under the lock (no copy), run after it is released.
        let ready = std::mem::take(&mut *self.pending());
        ready.into_iter().map(PreparedRelease::execute).collect()
    }

    /// Takes up to `count` held releases out, oldest first, without running them: the
    /// caller must execute them (or drop them, which quarantines their blocks).
    pub fn take(&self, count: usize) -> Vec<PreparedRelease> {
        let mut pending = self.pending();
        let n = count.min(pending.len());
        pending.drain(..n).collect()
    }

    /// The allocations whose releases it holds, oldest first.
    pub fn identities(&self) -> Vec<AllocationIdentity> {
        self.pending().iter().map(|release| *release.identity()).collect()
    }

    /// How many held releases `matches` accepts (for example those of one mechanism).
    pub fn count_where(&self, matches: impl Fn(&PreparedRelease) -> bool) -> usize {
        self.pending().iter().filter(|release| matches(release)).count()
    }

    /// A poisoned lock only means a panic elsewhere while it was held; the queue itself
    /// (a list) is consistent at every point, so it is used as it is.
    fn pending(&self) -> MutexGuard<'_, VecDeque<PreparedRelease>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl DeferredReleaseQueue for HostReleaseQueue {
    fn device(&self) -> DeviceKey {
        self.device
    }

    fn enqueue(&self, release: PreparedRelease) -> Result<(), QueueRefusal> {
        if release.device() != self.device {
            let reason = QueueRefusalReason::WrongDevice { queue: self.device, release: release.device() };
            return Err(QueueRefusal { release, reason });
        }
        let mut pending = self.pending();
        if pending.len() >= self.capacity {
            drop(pending);
            return Err(QueueRefusal { release, reason: QueueRefusalReason::Full { capacity: self.capacity } });
        }
        pending.push_back(release);
        Ok(())
    }
}
