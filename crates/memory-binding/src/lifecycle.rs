//! The lifecycle states, kept together: a mechanism's ([`MechanismState`]), a provider
//! context's ([`ContextState`]: `Live -> Lost -> Terminated`) and an allocation's
//! ([`AllocationState`], as a lookup by identity reports it). Then the mechanism's
//! lifecycle word and the per-thread in-flight slots, which enforce its states:
//!
//! ```text
//!            retire                invalidate_device          confirm_context_terminated
//!  Active ───────────▶ Retired ─────────────────────▶ DeviceLost ─────────────────────────▶ Terminated
//!     └──────────────────────── invalidate_device ──────▲
//! ```
//!
//! The protocol (checked by the loom models in `loom_lifecycle` here and
//! `loom_records` in `entry.rs`):
//! - An operation announces itself, *then* reads the state word, and withdraws if the
//!   state forbids it. The announcement is an increment of the calling thread's own
//!   in-flight slot (allocations, capability calls: single-writer, a plain store) or
//!   a record marked in transit (releases: the record itself says a release of it is
//!   under way). Between the two sits the hot side of a Dekker barrier pair
//!   ([`crate::sync::light_barrier`]).
//! - Invalidation stores the state word and never waits.
//! - Termination requires `DeviceLost`, runs the cold side of the barrier pair
//!   ([`Lifecycle::quiesce_barrier`]), then sums the slots and counts records in
//!   transit, and succeeds only at zero. Either an operation read the state after the
//!   invalidation (and withdrew) or its announcement is visible to the sum: no callback
//!   is in flight once termination succeeds, and none starts afterwards.
//! - The decrement runs in a guard's `Drop` (a `Release` store), so a panicking
//!   callback restores the count.

use std::fmt;

use crate::sync::{AtomicU8, AtomicUsize, BarrierMode, CachePadded, Ordering, heavy_barrier, light_barrier};

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

/// The lifecycle of a provider context.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ContextState {
    /// Usable.
    Live,
    /// Its device was invalidated.
    Lost,
    /// Its termination was confirmed; it can never be reused.
    Terminated,
}

impl fmt::Display for ContextState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ContextState::Live => "live",
            ContextState::Lost => "lost",
            ContextState::Terminated => "terminated",
        })
    }
}

/// Where one allocation stands, looked up by identity.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AllocationState {
    /// Recorded and usable.
    Live,
    /// Recorded, but its device was lost.
    Lost,
    /// Held in quarantine.
    Quarantined,
    /// Released, retired by termination, or never issued here.
    Gone,
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
    /// On the encoded word, so the hot path decodes only a refusal.
    #[inline]
    fn allows_raw(self, raw: u8) -> bool {
        const ACTIVE: u8 = MechanismState::Active.encode();
        const RETIRED: u8 = MechanismState::Retired.encode();
        raw == ACTIVE || (self == Admit::ActiveOrRetired && raw == RETIRED)
    }
}

/// One thread's in-flight count for one mechanism, on its own cache line.
///
/// Single-writer: only the thread that owns the pin holding the slot changes it, so
/// an increment is a plain load and store, and an operation pays one barrier (its
/// Dekker point) rather than two read-modify-writes.
#[derive(Default)]
pub(crate) struct InFlightSlot {
    count: CachePadded<AtomicUsize>,
}

impl InFlightSlot {
    /// The count now (cold path, after [`Lifecycle::quiesce_barrier`]).
    pub(crate) fn load(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }
}

/// The lifecycle word of one mechanism, and how its Dekker points are fenced.
pub(crate) struct Lifecycle {
    state: AtomicU8,
    barrier: BarrierMode,
}

impl Lifecycle {
    pub(crate) fn new() -> Lifecycle {
        Lifecycle::with_barrier(BarrierMode::detect())
    }

    pub(crate) fn with_barrier(barrier: BarrierMode) -> Lifecycle {
        Lifecycle { state: AtomicU8::new(MechanismState::Active.encode()), barrier }
    }

    /// How this mechanism's Dekker points are fenced.
    #[inline]
    pub(crate) fn barrier(&self) -> BarrierMode {
        self.barrier
    }

    /// The current state (a plain read of the mostly-read word).
    #[inline]
    pub(crate) fn state(&self) -> MechanismState {
        MechanismState::decode(self.state.load(Ordering::Acquire))
    }

    /// Whether the state admits `admit` now (a plain read, before announcing).
    ///
    /// # Errors
    /// The state that refuses it.
    #[inline]
    pub(crate) fn check(&self, admit: Admit) -> Result<(), MechanismState> {
        let raw = self.state.load(Ordering::Acquire);
        if admit.allows_raw(raw) { Ok(()) } else { Err(MechanismState::decode(raw)) }
    }

    /// Starts an operation counted on `slot` (the calling thread's own) if the state
    /// admits it; the guard ends it.
    ///
    /// # Errors
    /// The state that refused the operation.
    #[inline]
    pub(crate) fn begin<'s>(&self, slot: &'s InFlightSlot, admit: Admit) -> Result<InFlight<'s>, MechanismState> {
        let counter = &*slot.count;
        loop {
            // Single writer: no read-modify-write needed.
            counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            let guard = InFlight { counter };
            match self.admit_announced(admit) {
                Ok(()) => return Ok(guard),
                Err(state) => {
                    drop(guard);
                    self.refused(state, admit)?;
                }
            }
        }
    }

    /// The hot side of a Dekker point: after the caller announced itself (counted
    /// in its slot, or marked a record in transit), reads the state and says whether
    /// it admits `admit`.
    ///
    /// # Errors
    /// The state that refuses it; the caller withdraws its announcement.
    #[inline]
    pub(crate) fn admit_announced(&self, admit: Admit) -> Result<(), MechanismState> {
        light_barrier(self.barrier);
        let raw = self.state.load(Ordering::Relaxed);
        if admit.allows_raw(raw) { Ok(()) } else { Err(MechanismState::decode(raw)) }
    }

    /// After a withdrawn announcement: `Ok` to try again (`remove` was only
    /// counting), or the state to report.
    ///
    /// # Errors
    /// `state`, when it is a verdict rather than `remove`'s momentary check.
    #[cold]
    pub(crate) fn refused(&self, state: MechanismState, admit: Admit) -> Result<(), MechanismState> {
        if state != MechanismState::Removing || admit != Admit::ActiveOrRetired {
            return Err(state);
        }
        // `remove` is counting (a few instructions, under no lock we could need):
        // work on existing allocations waits for the verdict instead of failing. A
        // live allocation makes that verdict "not quiescent", back to `Retired`.
        while self.state() == MechanismState::Removing {
            crate::sync::yield_now();
        }
        Ok(())
    }

    /// The cold side of the Dekker points: call after changing the state and before
    /// reading any slot or record announcement.
    pub(crate) fn quiesce_barrier(&self) {
        heavy_barrier(self.barrier);
    }

    /// Operations in flight on `slots` now (their sum; cold path).
    pub(crate) fn in_flight<'a>(&self, slots: impl IntoIterator<Item = &'a InFlightSlot>) -> usize {
        self.quiesce_barrier();
        slots.into_iter().map(InFlightSlot::load).sum()
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

/// One operation in flight; dropping it (also during unwinding) ends the count.
#[must_use = "dropping the guard ends the in-flight count at once"]
pub(crate) struct InFlight<'a> {
    counter: &'a AtomicUsize,
}

impl Drop for InFlight<'_> {
    #[inline]
    fn drop(&mut self) {
        // Release: the callback's effects happen before a cold path that reads zero.
        self.counter.store(self.counter.load(Ordering::Relaxed) - 1, Ordering::Release);
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    #[test]
    fn operations_are_admitted_by_state() {
        let life = Lifecycle::new();
        let slot = InFlightSlot::default();
        assert!(life.begin(&slot, Admit::ActiveOnly).is_ok());
        assert_eq!(life.transition(&[MechanismState::Active], MechanismState::Retired), Ok(MechanismState::Active));
        assert_eq!(life.begin(&slot, Admit::ActiveOnly).err(), Some(MechanismState::Retired));
        assert!(life.begin(&slot, Admit::ActiveOrRetired).is_ok());
        life.transition(&[MechanismState::Active, MechanismState::Retired], MechanismState::DeviceLost).unwrap();
        assert_eq!(life.begin(&slot, Admit::ActiveOrRetired).err(), Some(MechanismState::DeviceLost));
        // Refused operations leave no count behind.
        assert_eq!(life.in_flight([&slot]), 0);
    }

    #[test]
    fn guards_count_and_uncount_even_on_unwind_and_nest() {
        for barrier in [BarrierMode::Fence, BarrierMode::detect()] {
            let life = Lifecycle::with_barrier(barrier);
            let (mine, other) = (InFlightSlot::default(), InFlightSlot::default());
            let a = life.begin(&mine, Admit::ActiveOnly).unwrap();
            let b = life.begin(&other, Admit::ActiveOnly).unwrap();
            // A callback that re-enters on the same thread nests on the same slot.
            let nested = life.begin(&mine, Admit::ActiveOnly).unwrap();
            assert_eq!(life.in_flight([&mine, &other]), 3);
            drop(nested);
            drop(a);
            assert_eq!(life.in_flight([&mine, &other]), 1);
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _guard = life.begin(&mine, Admit::ActiveOnly).unwrap();
                panic!("callback panicked");
            }));
            assert!(result.is_err());
            assert_eq!(life.in_flight([&mine, &other]), 1);
            drop(b);
            assert_eq!(life.in_flight([&mine, &other]), 0);
        }
    }

    #[test]
    fn a_running_removal_check_is_waited_out_by_work_on_existing_allocations() {
        let life = std::sync::Arc::new(Lifecycle::new());
        life.transition(&[MechanismState::Active], MechanismState::Retired).unwrap();
        life.transition(&[MechanismState::Retired], MechanismState::Removing).unwrap();
        assert_eq!(life.check(Admit::ActiveOnly), Err(MechanismState::Removing));
        let reopen = {
            let life = std::sync::Arc::clone(&life);
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(20));
                life.transition(&[MechanismState::Removing], MechanismState::Retired).unwrap();
            })
        };
        let slot = InFlightSlot::default();
        // Waits for the verdict, then is admitted on the reopened mechanism.
        assert!(life.begin(&slot, Admit::ActiveOrRetired).is_ok());
        reopen.join().unwrap();
        // New work is refused outright.
        assert_eq!(life.begin(&slot, Admit::ActiveOnly).err(), Some(MechanismState::Retired));
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
    /// confirmed, no callback is in flight and none starts afterwards. The slot is the
    /// operation's own (single writer: a plain store, then the barrier).
    #[test]
    fn loom_no_callback_in_flight_or_started_after_confirmation() {
        loom::model(|| {
            let life = Arc::new(Lifecycle::new());
            let slot = Arc::new(InFlightSlot::default());
            let terminated = Arc::new(AtomicBool::new(false));

            let op = {
                let (life, slot, terminated) = (Arc::clone(&life), Arc::clone(&slot), Arc::clone(&terminated));
                loom::thread::spawn(move || {
                    if let Ok(guard) = life.begin(&slot, Admit::ActiveOrRetired) {
                        // The callback: it must never overlap a confirmed termination.
                        assert!(!terminated.load(Ordering::SeqCst), "callback ran after termination");
                        drop(guard);
                    }
                })
            };

            // Invalidation, then a confirmation attempt (the caller would poll).
            life.transition(&[MechanismState::Active, MechanismState::Retired], MechanismState::DeviceLost).unwrap();
            if life.in_flight([&*slot]) == 0 {
                life.transition(&[MechanismState::DeviceLost], MechanismState::Terminated).unwrap();
                terminated.store(true, Ordering::SeqCst);
            }
            op.join().unwrap();
            assert_eq!(life.in_flight([&*slot]), 0);
        });
    }

    /// Per-thread slots, one of them with a nested (re-entrant) operation, summed by a
    /// cold path while they run: counts are never lost, and a sum never exceeds what
    /// is in flight.
    #[test]
    fn loom_in_flight_slots_count_exactly() {
        loom::model(|| {
            let life = Arc::new(Lifecycle::new());
            let slots = Arc::new([InFlightSlot::default(), InFlightSlot::default()]);
            let threads: Vec<_> = [2usize, 1]
                .into_iter()
                .enumerate()
                .map(|(index, depth)| {
                    let (life, slots) = (Arc::clone(&life), Arc::clone(&slots));
                    loom::thread::spawn(move || {
                        let outer = life.begin(&slots[index], Admit::ActiveOnly).unwrap();
                        let inner = (depth > 1).then(|| life.begin(&slots[index], Admit::ActiveOnly).unwrap());
                        assert!(slots[index].load() >= depth);
                        drop(inner);
                        drop(outer);
                    })
                })
                .collect();
            assert!(life.in_flight(slots.iter()) <= 3);
            for thread in threads {
                thread.join().unwrap();
            }
            assert_eq!(life.in_flight(slots.iter()), 0);
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
            let slot = Arc::new(InFlightSlot::default());
            let live = Arc::new(AtomicBool::new(true));
            let release = {
                let (life, slot, live) = (Arc::clone(&life), Arc::clone(&slot), Arc::clone(&live));
                loom::thread::spawn(move || {
                    let guard =
                        life.begin(&slot, Admit::ActiveOrRetired).expect("a release is never refused by remove");
                    live.store(false, Ordering::SeqCst); // take the record
                    live.store(true, Ordering::SeqCst); // refused: put it back
                    drop(guard);
                })
            };
            // `remove`: close, count, then remove or reopen.
            let closed = life.transition(&[MechanismState::Retired], MechanismState::Removing).is_ok();
            let quiescent = life.in_flight([&*slot]) == 0 && !live.load(Ordering::SeqCst);
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
            let slot = InFlightSlot::default();
            assert!(life.begin(&slot, Admit::ActiveOrRetired).is_err());
            assert_eq!(life.in_flight([&slot]), 0);
        });
    }
}
