//! `CudaReleaseQueue`: run prepared releases once the stream work queued before them
//! has finished.

use std::collections::VecDeque;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use memory_api::{DeferredReleaseQueue, DeviceKey, PreparedRelease, QueueRefusal, QueueRefusalReason};

use crate::error::CudaError;
use crate::stream::{CudaStream, Event, EventState};

/// A bounded [`DeferredReleaseQueue`] for one stream.
///
/// [`enqueue`](DeferredReleaseQueue::enqueue) records an event on the stream behind
/// the work queued so far and keeps the release with it; [`CudaReleaseQueue::poll`]
/// runs, in enqueue order, every release whose event has completed;
/// [`CudaReleaseQueue::drain`] waits for all of them. Nothing runs inside `enqueue`, so
/// a completion never re-enters its caller.
///
/// A release the queue cannot take (full, closed, another device) is handed back
/// exactly as offered. If creating or recording the event fails, the refusal carries
/// the driver's error (`QueueRefusalReason::Backend`; [`crate::CudaError::from_backend`]
/// recovers it) and the queue closes itself, so later releases are refused as `Closed`
/// and the caller releases synchronously; a sticky error also marks the device lost.
///
/// Dropping the queue runs the releases whose events have completed; the rest are
/// dropped unexecuted, which reports them to their owners as quarantined
/// (`ReleaseError::Abandoned`) rather than freeing memory the device may still use.
/// A release that panics there does not stop the others; the panic is raised again
/// once the queue is gone (unless the thread is already unwinding).
pub struct CudaReleaseQueue {
    stream: CudaStream,
    capacity: usize,
    state: Mutex<QueueState>,
    /// Held while running releases, so they run in enqueue order. Taken with
    /// `try_lock`: a completion that polls again returns at once instead of deadlocking.
    /// A release that panics poisons it on the way out; the next runner recovers it
    /// (the entry that panicked was already taken out of the state, so nothing is
    /// half-done).
    running: Mutex<()>,
}

struct QueueState {
    pending: VecDeque<(Event, PreparedRelease)>,
    spare_events: Vec<Event>,
    closed: bool,
}

impl CudaReleaseQueue {
    /// A queue for `stream` holding at most `capacity` pending releases.
    pub fn new(stream: &CudaStream, capacity: usize) -> CudaReleaseQueue {
        CudaReleaseQueue {
            stream: stream.clone(),
            capacity,
            state: Mutex::new(QueueState { pending: VecDeque::new(), spare_events: Vec::new(), closed: false }),
            running: Mutex::new(()),
        }
    }

    /// Releases waiting for their event.
    pub fn len(&self) -> usize {
        self.state().pending.len()
    }

    /// Whether no release is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most releases the queue holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether the queue refuses new releases.
    pub fn is_closed(&self) -> bool {
        self.state().closed
    }

    /// Refuses new releases from now on; pending ones still run on `poll` / `drain`.
    pub fn close(&self) {
        self.state().closed = true;
    }

    /// The stream whose work the releases wait for.
    pub fn stream(&self) -> &CudaStream {
        &self.stream
    }

    fn state(&self) -> MutexGuard<'_, QueueState> {
        // Only this module mutates the state, and never runs foreign code under the
        // lock, so a poisoned lock still guards a consistent state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs, in enqueue order, every release whose event has completed; returns how
    /// many ran. Returns `Ok(0)` at once if another thread is running releases.
    ///
    /// # Errors
    /// The driver's failure to query an event (a sticky one marks the device lost);
    /// releases not yet run stay queued.
    ///
    /// # Panics
    /// When a release's allocator panics, the panic continues to the caller after the
    /// release's owner was told (a quarantine, by [`PreparedRelease::execute`]). The
    /// queue stays usable: the next `poll` or `drain` runs the releases behind it.
    pub fn poll(&self) -> Result<usize, CudaError> {
        self.run(false)
    }

    /// Waits for every pending event and runs every release; returns how many ran.
    ///
    /// # Errors
    /// As [`CudaReleaseQueue::poll`].
    ///
    /// # Panics
    /// As [`CudaReleaseQueue::poll`].
    pub fn drain(&self) -> Result<usize, CudaError> {
        self.run(true)
    }

    fn run(&self, wait: bool) -> Result<usize, CudaError> {
        let _running = match self.running.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::WouldBlock) => return Ok(0),
            Err(TryLockError::Poisoned(poisoned)) => {
                // An earlier release panicked while running (its owner was told, by
                // `PreparedRelease::execute`). The lock guards no data, so recover and
                // clear the flag instead of refusing to run anything ever again.
                self.running.clear_poison();
                tracing::warn!(device = %self.device(), "a queued release panicked earlier; running the rest");
                poisoned.into_inner()
            }
        };
        let mut ran = 0;
        loop {
            // Take the oldest entry out so that no lock is held while waiting on its
            // event; only this (single) runner puts entries back at the front.
            let Some((event, release)) = self.state().pending.pop_front() else { break };
            let ready = if wait { event.synchronize().map(|()| EventState::Complete) } else { event.query() };
            match ready {
                Ok(EventState::Complete) => {}
                Ok(EventState::Pending) => {
                    self.state().pending.push_front((event, release));
                    break;
                }
                Err(error) => {
                    self.state().pending.push_front((event, release));
                    tracing::error!(device = %self.device(), "waiting for a release event failed: {error}");
                    return Err(error);
                }
            }
            // The release and its completion run with no lock of this queue's state held.
            let summary = release.execute();
            tracing::trace!(device = %self.device(), %summary, "ran a deferred release");
            ran += 1;
            let mut state = self.state();
            if state.spare_events.len() < self.capacity {
                state.spare_events.push(event);
            }
        }
        Ok(ran)
    }

    fn refuse(release: PreparedRelease, reason: QueueRefusalReason) -> Result<(), QueueRefusal> {
        Err(QueueRefusal { release, reason })
    }
}

impl DeferredReleaseQueue for CudaReleaseQueue {
    fn device(&self) -> DeviceKey {
        self.stream.device().key()
    }

    fn enqueue(&self, release: PreparedRelease) -> Result<(), QueueRefusal> {
        let device = self.device();
        let offered = release.device();
        if offered != device {
            return Self::refuse(release, QueueRefusalReason::WrongDevice { queue: device, release: offered });
        }
        let mut state = self.state();
        if state.closed {
            return Self::refuse(release, QueueRefusalReason::Closed);
        }
        if state.pending.len() >= self.capacity {
            return Self::refuse(release, QueueRefusalReason::Full { capacity: self.capacity });
        }
        let event = match state.spare_events.pop() {
            Some(event) => Ok(event),
            None => Event::new(&self.stream),
        };
        match event.and_then(|event| event.record().map(|()| event)) {
            Ok(event) => {
                state.pending.push_back((event, release));
                Ok(())
            }
            Err(error) => {
                state.closed = true;
                drop(state);
                tracing::error!(%device, "recording a release event failed; the queue is closed: {error}");
                Self::refuse(release, QueueRefusalReason::Backend(error.to_backend()))
            }
        }
    }
}

impl Drop for CudaReleaseQueue {
    fn drop(&mut self) {
        // Run what is due. A release that panics is reported to its owner by
        // `execute`; keep running the others (each panic consumes one entry, so this
        // ends), then re-raise the first panic unless the thread is already unwinding
        // (a second panic there would abort the process).
        let mut first_panic = None;
        loop {
            match catch_unwind(AssertUnwindSafe(|| self.poll())) {
                Ok(Ok(_)) => break,
                Ok(Err(error)) => {
                    tracing::warn!(device = %self.device(), "polling the release queue on drop failed: {error}");
                    break;
                }
                Err(panic) => {
                    tracing::error!(device = %self.device(), "a queued release panicked while the queue was dropped");
                    first_panic.get_or_insert(panic);
                }
            }
        }
        let abandoned = std::mem::take(&mut self.state().pending);
        if !abandoned.is_empty() {
            tracing::warn!(
                device = %self.device(),
                pending = abandoned.len(),
                "dropping a release queue with releases whose stream work has not finished; they are quarantined"
            );
        }
        // Each PreparedRelease reports itself as abandoned (quarantined) when dropped.
        drop(abandoned);
        if let Some(panic) = first_panic
            && !std::thread::panicking()
        {
            resume_unwind(panic);
        }
    }
}

impl fmt::Debug for CudaReleaseQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaReleaseQueue")
            .field("device", &self.device())
            .field("pending", &self.len())
            .field("capacity", &self.capacity)
            .finish()
    }
}
