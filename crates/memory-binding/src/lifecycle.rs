//! The mechanism lifecycle word and the per-thread in-flight slots.
//!
//! ```text
//!            retire                invalidate_device          confirm_context_terminated
//!  Active ───────────▶ Retired ─────────────────────▶ DeviceLost ─────────────────────────▶ Terminated
//!     └──────────────────────── invalidate_device ──────▲
//! ```
//!
//! The protocol (checked by the loom models in `tests::loom_lifecycle`):
//! - An operation increments its own cache-line-padded slot, *then* reads the state
//!   word, and backs out (decrementing) if the state forbids it. Both are `SeqCst`.
//! - Invalidation stores the state word (`SeqCst`) and never waits.
//! - Termination requires `DeviceLost`, sums the slots (`SeqCst`) and succeeds only at
//!   zero. In the single total order of `SeqCst` operations, an operation either read
//!   the state after the invalidation (and backed out) or incremented before it, in
//!   which case the sum sees it: no callback is in flight once termination succeeds,
//!   and none starts afterwards.
//! - The decrement runs in a guard's `Drop`, so a panicking callback restores the count.
//!
//! loom does not model the single total order of `SeqCst` *accesses* (it treats them
//! as acquire/release), only `SeqCst` *fences*. Under `--cfg memory_loom` the two
//! Dekker points therefore also carry an explicit `SeqCst` fence (`dekker_fence`);
//! in C++11 terms "SeqCst RMW; SeqCst load" and "RMW; SeqCst fence; load" give the
//! same guarantee here, so the model checks the protocol the normal build runs without
//! paying for an extra `mfence` on the hot path.

use std::fmt;

use crate::sync::{AtomicU8, AtomicUsize, CachePadded, Ordering};

/// Where a mechanism is in its lifecycle.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MechanismState {
    /// Serves binds, allocations and releases.
    Active,
    /// Rejects new binds and allocations; existing allocations can still be viewed,
    /// decommitted and released.
    Retired,
    /// Its device was invalidated: every operation fails with device lost, and no
    /// allocator callback runs.
    DeviceLost,
    /// Its context was confirmed terminated; its allocation metadata is retired.
    Terminated,
    /// `remove` is checking that it is quiescent: nothing is admitted. It ends in the
    /// mechanism's removal, or back in `Retired` when something is still live.
    Removing,
}

impl MechanismState {
    const fn encode(self) -> u8 {
        match self {
            MechanismState::Active => 0,
            MechanismState::Retired => 1,
            MechanismState::DeviceLost => 2,
            MechanismState::Terminated => 3,
            MechanismState::Removing => 4,
        }
    }

    fn decode(raw: u8) -> MechanismState {
        match raw {
            0 => MechanismState::Active,
            1 => MechanismState::Retired,
            2 => MechanismState::DeviceLost,
            3 => MechanismState::Terminated,
            _ => MechanismState::Removing,
        }
    }

    /// Lower-case name for messages.
    pub const fn name(self) -> &'static str {
        match self {
            MechanismState::Active => "active",
            MechanismState::Retired => "retired",
            MechanismState::DeviceLost => "device-lost",
            MechanismState::Terminated => "terminated",
            MechanismState::Removing => "being removed",
        }
    }
}

impl fmt::Display for MechanismState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which states an operation may run in.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    /// New work: binds, allocations, commits, maps.
    ActiveOnly,
    /// Work on existing allocations: releases, decommits, unmaps, views.
    ActiveOrRetired,
}

impl Admit {
    fn allows(self, state: MechanismState) -> bool {
        match self {
            Admit::ActiveOnly => state == MechanismState::Active,
            Admit::ActiveOrRetired => matches!(state, MechanismState::Active | MechanismState::Retired),
        }
    }
}

/// Number of in-flight slots per mechanism. Threads map onto slots round-robin; two
/// threads sharing a slot stay correct (the counts are atomic) and only contend.
pub(crate) const IN_FLIGHT_SLOTS: usize = 16;

/// The lifecycle word plus the in-flight slots of one mechanism.
pub(crate) struct Lifecycle {
    state: AtomicU8,
    in_flight: Box<[CachePadded<AtomicUsize>]>,
}

impl Lifecycle {
    pub(crate) fn new() -> Lifecycle {
        Lifecycle {
            state: AtomicU8::new(MechanismState::Active.encode()),
            in_flight: (0..IN_FLIGHT_SLOTS).map(|_| CachePadded::new(AtomicUsize::new(0))).collect(),
        }
    }

    /// The current state (a plain read of the mostly-read word).
    pub(crate) fn state(&self) -> MechanismState {
        MechanismState::decode(self.state.load(Ordering::SeqCst))
    }

    /// Starts an operation on `slot` if the state admits it; the guard ends it.
    ///
    /// # Errors
    /// The state that refused the operation.
    pub(crate) fn begin(&self, slot: usize, admit: Admit) -> Result<InFlight<'_>, MechanismState> {
        let counter = &self.in_flight[slot % IN_FLIGHT_SLOTS];
        loop {
            counter.fetch_add(1, Ordering::SeqCst);
            dekker_fence();
            let guard = InFlight { counter };
            let state = self.state();
            if admit.allows(state) {
                return Ok(guard);
            }
            drop(guard);
            if state != MechanismState::Removing || admit != Admit::ActiveOrRetired {
                return Err(state);
            }
            // `remove` is counting (a few instructions, under no lock we could need):
            // work on existing allocations waits for the verdict instead of failing. A
            // live allocation makes that verdict "not quiescent", back to `Retired`.
            self.wait_while_removing();
        }
    }

    #[cold]
    fn wait_while_removing(&self) {
        while self.state() == MechanismState::Removing {
            crate::sync::yield_now();
        }
    }

    /// Starts an in-flight count that outlives this call (a queued release); the
    /// owner must call [`Lifecycle::end_detached`] with the same slot exactly once.
    pub(crate) fn begin_detached(&self, slot: usize, admit: Admit) -> Result<(), MechanismState> {
        let guard = self.begin(slot, admit)?;
        std::mem::forget(guard);
        Ok(())
    }

    /// Ends a count started by [`Lifecycle::begin_detached`].
    pub(crate) fn end_detached(&self, slot: usize) {
        self.in_flight[slot % IN_FLIGHT_SLOTS].fetch_sub(1, Ordering::SeqCst);
    }

    /// Operations in flight now (sum of the slots).
    pub(crate) fn in_flight(&self) -> usize {
        dekker_fence();
        self.in_flight.iter().map(|slot| slot.load(Ordering::SeqCst)).sum()
    }

    /// Moves from any state in `from` to `to`; returns the state found.
    pub(crate) fn transition(
        &self,
        from: &[MechanismState],
        to: MechanismState,
    ) -> Result<MechanismState, MechanismState> {
        let mut current = self.state.load(Ordering::SeqCst);
        loop {
            let state = MechanismState::decode(current);
            if !from.contains(&state) {
                return Err(state);
            }
            match self.state.compare_exchange(current, to.encode(), Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Ok(state),
                Err(actual) => current = actual,
            }
        }
    }
}

/// The fence between "announce" and "check" on both sides of the protocol; a no-op
/// outside loom (see the module docs).
#[inline(always)]
fn dekker_fence() {
    #[cfg(memory_loom)]
    loom::sync::atomic::fence(Ordering::SeqCst);
}

/// One operation in flight; dropping it (also during unwinding) ends the count.
#[must_use = "dropping the guard ends the in-flight count at once"]
pub(crate) struct InFlight<'a> {
    counter: &'a AtomicUsize,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    #[test]
    fn operations_are_admitted_by_state() {
        let life = Lifecycle::new();
        assert!(life.begin(0, Admit::ActiveOnly).is_ok());
        assert_eq!(life.transition(&[MechanismState::Active], MechanismState::Retired), Ok(MechanismState::Active));
        assert_eq!(life.begin(0, Admit::ActiveOnly).err(), Some(MechanismState::Retired));
        assert!(life.begin(0, Admit::ActiveOrRetired).is_ok());
        life.transition(&[MechanismState::Active, MechanismState::Retired], MechanismState::DeviceLost).unwrap();
        assert_eq!(life.begin(3, Admit::ActiveOrRetired).err(), Some(MechanismState::DeviceLost));
        // Refused operations leave no count behind.
        assert_eq!(life.in_flight(), 0);
    }

    #[test]
    fn guards_count_and_uncount_even_on_unwind() {
        let life = Lifecycle::new();
        let a = life.begin(1, Admit::ActiveOnly).unwrap();
        let b = life.begin(17, Admit::ActiveOnly).unwrap();
        assert_eq!(life.in_flight(), 2);
        drop(a);
        assert_eq!(life.in_flight(), 1);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _guard = life.begin(2, Admit::ActiveOnly).unwrap();
            panic!("callback panicked");
        }));
        assert!(result.is_err());
        assert_eq!(life.in_flight(), 1);
        drop(b);
        assert_eq!(life.in_flight(), 0);
    }

    #[test]
    fn detached_counts_last_until_ended() {
        let life = Lifecycle::new();
        life.begin_detached(5, Admit::ActiveOrRetired).unwrap();
        assert_eq!(life.in_flight(), 1);
        life.end_detached(5);
        assert_eq!(life.in_flight(), 0);
    }
}

/// loom models of the lifecycle protocol: `RUSTFLAGS="--cfg memory_loom" cargo test
/// --release -p memory-binding --lib loom` (run by `cargo xtask loom`).
#[cfg(all(test, memory_loom))]
mod loom_lifecycle {
    use super::*;
    use crate::sync::Arc;
    use loom::sync::atomic::AtomicBool;

    /// An operation racing invalidation and termination: once termination is
    /// confirmed, no callback is in flight and none starts afterwards.
    #[test]
    fn loom_no_callback_in_flight_or_started_after_confirmation() {
        loom::model(|| {
            let life = Arc::new(Lifecycle::new());
            let terminated = Arc::new(AtomicBool::new(false));

            let op = {
                let (life, terminated) = (Arc::clone(&life), Arc::clone(&terminated));
                loom::thread::spawn(move || {
                    if let Ok(guard) = life.begin(0, Admit::ActiveOrRetired) {
                        // The callback: it must never overlap a confirmed termination.
                        assert!(!terminated.load(Ordering::SeqCst), "callback ran after termination");
                        drop(guard);
                    }
                })
            };

            // Invalidation, then a confirmation attempt (the caller would poll).
            life.transition(&[MechanismState::Active, MechanismState::Retired], MechanismState::DeviceLost).unwrap();
            if life.in_flight() == 0 {
                life.transition(&[MechanismState::DeviceLost], MechanismState::Terminated).unwrap();
                terminated.store(true, Ordering::SeqCst);
            }
            op.join().unwrap();
            assert_eq!(life.in_flight(), 0);
        });
    }

    /// Two threads sharing one slot and one on its own: counts are never lost.
    #[test]
    fn loom_in_flight_slots_count_exactly() {
        loom::model(|| {
            let life = Arc::new(Lifecycle::new());
            let threads: Vec<_> = [0usize, 0, 1]
                .into_iter()
                .map(|slot| {
                    let life = Arc::clone(&life);
                    loom::thread::spawn(move || {
                        let guard = life.begin(slot, Admit::ActiveOnly).unwrap();
                        assert!(life.in_flight() >= 1);
                        drop(guard);
                    })
                })
                .collect();
            for thread in threads {
                thread.join().unwrap();
            }
            assert_eq!(life.in_flight(), 0);
        });
    }

    /// `remove` racing a release that takes a live record and puts it back (refused):
    /// removal never succeeds while the record exists, and the release is never
    /// refused because of the momentary check.
    #[test]
    fn loom_remove_never_succeeds_under_a_live_record_in_transit() {
        loom::model(|| {
            let life = Arc::new(Lifecycle::new());
            life.transition(&[MechanismState::Active], MechanismState::Retired).unwrap();
            let live = Arc::new(AtomicBool::new(true));
            let release = {
                let (life, live) = (Arc::clone(&life), Arc::clone(&live));
                loom::thread::spawn(move || {
                    let guard = life.begin(0, Admit::ActiveOrRetired).expect("a release is never refused by remove");
                    live.store(false, Ordering::SeqCst); // take the record
                    live.store(true, Ordering::SeqCst); // refused: put it back
                    drop(guard);
                })
            };
            // `remove`: close, count, then remove or reopen.
            let closed = life.transition(&[MechanismState::Retired], MechanismState::Removing).is_ok();
            let quiescent = life.in_flight() == 0 && !live.load(Ordering::SeqCst);
            assert!(!quiescent, "removed a mechanism whose record was in transit");
            if closed {
                life.transition(&[MechanismState::Removing], MechanismState::Retired).unwrap();
            }
            release.join().unwrap();
        });
    }

    /// Retire racing invalidation: the state ends device-lost either way, and an
    /// admitted release never observes a lost device mid-callback as "active".
    #[test]
    fn loom_retire_racing_invalidate_ends_device_lost() {
        loom::model(|| {
            let life = Arc::new(Lifecycle::new());
            let retire = {
                let life = Arc::clone(&life);
                loom::thread::spawn(move || {
                    let _ = life.transition(&[MechanismState::Active], MechanismState::Retired);
                })
            };
            life.transition(&[MechanismState::Active, MechanismState::Retired], MechanismState::DeviceLost).unwrap();
            retire.join().unwrap();
            assert_eq!(life.state(), MechanismState::DeviceLost);
            assert!(life.begin(0, Admit::ActiveOrRetired).is_err());
            assert_eq!(life.in_flight(), 0);
        });
    }
}
