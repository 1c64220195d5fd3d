//! Who calls through one `OrtAllocator` table, and what it is doing.
//!
//! Every session gets a table of its own ([`crate::ffi::Core`]), so a call through it
//! belongs to that session whatever thread makes it: the caller's thread, one of ONNX
//! Runtime's intra-op or inter-op workers (the parallel executor), or a global thread
//! pool shared by several sessions. The table's [`Caller`] says whether the session is
//! being committed (its `Alloc` calls are session-long memory: prepacked weights) or
//! run (a refusal stops that run), keeps the first refusal's reason, and counts the
//! session's own figures.
//!
//! The phase is one atomic read per call; the refusal and the stop handle sit behind
//! a mutex taken only on a refusal and when a commit or run begins and ends.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::blocks::Counters;

/// What the session behind a table is doing.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Neither committing nor running: no run can be stopped.
    Idle,
    /// Being committed: `Alloc` is session-long memory, a refusal fails the commit.
    Committing,
    /// Running: a refusal is recorded and stops the run.
    Running,
}

impl Phase {
    const fn code(self) -> u8 {
        match self {
            Phase::Idle => 0,
            Phase::Committing => 1,
            Phase::Running => 2,
        }
    }

    const fn of(code: u8) -> Phase {
        match code {
            1 => Phase::Committing,
            2 => Phase::Running,
            _ => Phase::Idle,
        }
    }
}

/// An ONNX Runtime run-options object whose terminate flag a refusal sets.
#[derive(Copy, Clone, Debug)]
pub(crate) struct StopFlag(NonNull<ort::sys::OrtRunOptions>);

// SAFETY: ONNX Runtime's run options may be terminated from any thread (that is what
// `RunOptionsSetTerminate` is for); the pointer is only used for that call, under the
// caller's mutex, while the run that owns the options is in progress (see
// `Caller::end`).
unsafe impl Send for StopFlag {}

impl StopFlag {
    /// The flag of `options`, which must stay alive until the run's phase ends.
    pub(crate) fn of(options: *const ort::sys::OrtRunOptions) -> Option<StopFlag> {
        NonNull::new(options.cast_mut()).map(StopFlag)
    }

    fn set(self) -> Result<(), String> {
        // SAFETY: the options are alive: `Caller::end` clears the flag under the same
        // mutex before the run (which borrows the options) returns.
        crate::ffi::status_result(unsafe { (ort::api().RunOptionsSetTerminate)(self.0.as_ptr()) })
    }

    fn clear(self) -> Result<(), String> {
        // SAFETY: as `set`; called by the run's own thread before it returns.
        crate::ffi::status_result(unsafe { (ort::api().RunOptionsUnsetTerminate)(self.0.as_ptr()) })
    }
}

#[derive(Default)]
struct Refusal {
    /// The first refusal of the current commit or run.
    reason: Option<String>,
    /// The run's options, while it runs.
    stop: Option<StopFlag>,
    /// Whether a refusal set the run's terminate flag (cleared again when the run ends).
    stopped: bool,
}

/// The state of one table's caller (see the module docs).
#[derive(Default)]
pub(crate) struct Caller {
    phase: AtomicU8,
    refusal: Mutex<Refusal>,
    pub(crate) counters: Counters,
    /// Whether the table is a session's (reachable from safe code, through
    /// `ort::memory::Allocator::new(session, ..)`), not the handle's own.
    session: bool,
}

impl Caller {
    /// The caller of a session's table.
    pub(crate) fn of_session() -> Caller {
        Caller { session: true, ..Caller::default() }
    }

    /// Whether this is a session's table (see [`Caller::of_session`]).
    pub(crate) fn is_session(&self) -> bool {
        self.session
    }

    pub(crate) fn phase(&self) -> Phase {
        Phase::of(self.phase.load(Ordering::Acquire))
    }

    /// Starts a commit (`stop: None`) or a run: forgets the previous refusal.
    pub(crate) fn begin(&self, phase: Phase, stop: Option<StopFlag>) {
        *self.lock() = Refusal { reason: None, stop, stopped: false };
        self.phase.store(phase.code(), Ordering::Release);
    }

    /// Ends the commit or run: returns its first refusal, and clears the terminate flag
    /// a refusal set (the caller's options are theirs to reuse).
    pub(crate) fn end(&self) -> Option<String> {
        self.phase.store(Phase::Idle.code(), Ordering::Release);
        let mut refusal = self.lock();
        if let (Some(stop), true) = (refusal.stop, refusal.stopped)
            && let Err(message) = stop.clear()
        {
            tracing::error!(%message, "could not clear the terminate flag a refusal set");
        }
        refusal.stop = None;
        refusal.reason.take()
    }

    /// Records a refusal; the first one of a run sets its terminate flag, so ONNX
    /// Runtime stops at the next kernel boundary.
    pub(crate) fn refused(&self, reason: &str) {
        let mut refusal = self.lock();
        if refusal.reason.is_some() {
            return;
        }
        refusal.reason = Some(reason.to_owned());
        if let Some(stop) = refusal.stop {
            match stop.set() {
                Ok(()) => refusal.stopped = true,
                Err(message) => tracing::error!(%message, "could not stop the run after a refusal"),
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Refusal> {
        self.refusal.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
