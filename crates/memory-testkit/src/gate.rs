//! [`CallbackGate`]: holds callbacks in flight until the test lets them go.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// How long [`CallbackGate::wait_until_blocked`] waits before declaring the test deadlocked.
/// A guard against hangs, not a timing assumption: correct tests never come near it.
const DEADLOCK_GUARD: Duration = Duration::from_secs(120);

#[derive(Debug, Default)]
struct GateInner {
    open: bool,
    blocked: usize,
    passed: u64,
}

/// The shared state between a [`CallbackGate`] and the wrapper that waits on it.
#[derive(Debug, Default)]
pub(crate) struct GateState {
    inner: Mutex<GateInner>,
    changed: Condvar,
}

impl GateState {
    fn lock(&self) -> MutexGuard<'_, GateInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Called inside the gated callback: blocks while the gate is closed.
    pub(crate) fn pass(&self) {
        let mut inner = self.lock();
        inner.blocked += 1;
        self.changed.notify_all();
        while !inner.open {
            inner = self.changed.wait(inner).unwrap_or_else(PoisonError::into_inner);
        }
        inner.blocked -= 1;
        inner.passed += 1;
        self.changed.notify_all();
    }
}

/// A closed gate installed on one callback of a
/// [`RecordingAllocator`](crate::RecordingAllocator).
///
/// While closed, every call to that callback is counted and then blocks before
/// reaching the inner allocator, so a test can hold a callback in flight and observe
/// what the caller does meanwhile. [`CallbackGate::wait_until_blocked`] synchronises without
/// sleeping. Dropping the gate opens it and uninstalls it, so a failing test never
/// leaves a thread blocked.
pub struct CallbackGate {
    pub(crate) state: Arc<GateState>,
    pub(crate) uninstall: Option<Box<dyn FnOnce() + Send>>,
}

impl CallbackGate {
    /// Lets every blocked call and every later call through.
    pub fn open(&self) {
        let mut inner = self.state.lock();
        inner.open = true;
        self.state.changed.notify_all();
    }

    /// Blocks later calls again (calls already let through are not recalled).
    pub fn close(&self) {
        self.state.lock().open = false;
    }

    /// Calls currently blocked at the gate.
    pub fn blocked(&self) -> usize {
        self.state.lock().blocked
    }

    /// Calls that have passed the gate.
    pub fn passed(&self) -> u64 {
        self.state.lock().passed
    }

    /// Waits until at least `count` calls are blocked at the gate.
    ///
    /// # Panics
    /// If that does not happen within two minutes (the test is deadlocked; the panic
    /// names how many calls did arrive).
    pub fn wait_until_blocked(&self, count: usize) {
        let inner = self.state.lock();
        let (inner, timeout) = self
            .state
            .changed
            .wait_timeout_while(inner, DEADLOCK_GUARD, |inner| inner.blocked < count)
            .unwrap_or_else(PoisonError::into_inner);
        if timeout.timed_out() && inner.blocked < count {
            let blocked = inner.blocked;
            drop(inner);
            panic!("gate: waited {DEADLOCK_GUARD:?} for {count} blocked calls but only {blocked} arrived");
        }
    }

    /// Waits until at least `count` calls have passed the gate (after [`CallbackGate::open`]).
    ///
    /// # Panics
    /// If that does not happen within two minutes.
    pub fn wait_until_passed(&self, count: u64) {
        let inner = self.state.lock();
        let (inner, timeout) = self
            .state
            .changed
            .wait_timeout_while(inner, DEADLOCK_GUARD, |inner| inner.passed < count)
            .unwrap_or_else(PoisonError::into_inner);
        if timeout.timed_out() && inner.passed < count {
            let passed = inner.passed;
            drop(inner);
            panic!("gate: waited {DEADLOCK_GUARD:?} for {count} passed calls but only {passed} passed");
        }
    }
}

impl std::fmt::Debug for CallbackGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.state.lock();
        f.debug_struct("CallbackGate")
            .field("open", &inner.open)
            .field("blocked", &inner.blocked)
            .field("passed", &inner.passed)
            .finish()
    }
}

impl Drop for CallbackGate {
    fn drop(&mut self) {
        if let Some(uninstall) = self.uninstall.take() {
            uninstall();
        }
        self.open();
    }
}
