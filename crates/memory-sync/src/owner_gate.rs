//! A gate biased towards one owner thread: the owner passes it with two plain stores
//! and a [`light_barrier`]; any other thread (rarely) claims it under a lock and a
//! [`heavy_barrier`], and waits for the owner to be out. Whoever is inside has the
//! values behind the gate to itself, so they can be atomics read and written with
//! plain `Relaxed` loads and stores, never a read-modify-write.
//!
//! For owner-local data that another thread must sometimes reach at once (a trim that
//! empties every thread's cache of free blocks): the owner's hot path keeps no lock
//! and writes only its own line, and the claim, which is cold, pays for both.
//!
//! # Protocol
//! A Dekker point (see [`crate::light_barrier`]):
//!
//! - **owner** ([`OwnerGate::enter`]): store `busy = true`, light barrier, load
//!   `claimed` (Acquire). Not claimed: inside, until the pass drops (`busy = false`,
//!   Release). Claimed: out again at once (`busy = false`), and the caller claims the
//!   gate like any other thread ([`OwnerGate::claim`]), which waits for the claimer;
//! - **claimer** ([`OwnerGate::claim`]): lock the claimers' mutex, store
//!   `claimed = true`, heavy barrier, wait while `busy` (Acquire); inside until the
//!   claim drops (`claimed = false`, Release; unlock).
//!
//! Of an owner pass and a claim that overlap, at least one sees the other's store: the
//! owner backs out, or the claimer waits until the owner is out, and the Release /
//! Acquire pairs order what each did inside before the other goes in. A loom model
//! (`src/loom_owner_gate.rs`) checks that no update made inside is lost between an
//! owner that passes twice and a claimer.
//!
//! The owner must not block inside (a claimer spins, yielding, until it leaves): keep
//! the section to loads and stores of the guarded values, no callback and no lock.

use crate::primitives::{AtomicBool, Mutex, MutexGuard, Ordering, yield_now};
use crate::{BarrierMode, CachePadded, heavy_barrier, light_barrier, lock};

/// The gate (see the module docs). One per owner-local value set.
pub struct OwnerGate {
    mode: BarrierMode,
    /// Written by the owner alone: it is inside.
    busy: CachePadded<AtomicBool>,
    /// Written by a claimer alone (under `claimers`): it is inside, or about to be.
    claimed: AtomicBool,
    claimers: Mutex<()>,
}

/// The owner inside the gate: out again when dropped.
#[must_use = "the owner is inside the gate while the pass lives"]
pub struct OwnerPass<'a> {
    gate: &'a OwnerGate,
}

/// A claimer inside the gate: out again when dropped.
#[must_use = "the claimer is inside the gate while the claim lives"]
pub struct Claim<'a> {
    gate: &'a OwnerGate,
    _claimers: MutexGuard<'a, ()>,
}

impl Default for OwnerGate {
    fn default() -> Self {
        OwnerGate::new(BarrierMode::detect())
    }
}

impl OwnerGate {
    /// An open gate whose two sides fence as `mode` says (every gate of a process
    /// should use [`BarrierMode::detect`]'s answer, which [`OwnerGate::default`] does).
    pub fn new(mode: BarrierMode) -> OwnerGate {
        OwnerGate {
            mode,
            busy: CachePadded::new(AtomicBool::new(false)),
            claimed: AtomicBool::new(false),
            claimers: Mutex::new(()),
        }
    }

    /// The owner goes in: `None` while another thread claims the gate (then claim it
    /// with [`OwnerGate::claim`], which waits for that thread).
    ///
    /// Owner thread only: two threads entering at once would both be inside.
    #[inline(always)]
    pub fn enter(&self) -> Option<OwnerPass<'_>> {
        self.busy.store(true, Ordering::Relaxed);
        light_barrier(self.mode);
        // Acquire: a claimer's writes inside happen before its `claimed = false`.
        if self.claimed.load(Ordering::Acquire) {
            self.busy.store(false, Ordering::Release);
            return None;
        }
        Some(OwnerPass { gate: self })
    }

    /// Any thread goes in, once the owner is out and no other claimer is in (cold: a
    /// lock and a heavy barrier). The owner itself may claim its gate too.
    pub fn claim(&self) -> Claim<'_> {
        let claimers = lock(&self.claimers);
        self.claimed.store(true, Ordering::Relaxed);
        heavy_barrier(self.mode);
        // Acquire: the owner's writes inside happen before its `busy = false`.
        while self.busy.load(Ordering::Acquire) {
            yield_now();
        }
        Claim { gate: self, _claimers: claimers }
    }
}

/// Inside the gate one way or the other ([`OwnerGate::enter_or_claim`]): out again
/// when dropped.
#[must_use = "the thread is inside the gate while this lives"]
pub enum Inside<'a> {
    /// Passed as the owner.
    Owner(OwnerPass<'a>),
    /// Claimed (the owner backed out while another thread claimed the gate).
    Claimed(Claim<'a>),
}

impl OwnerGate {
    /// The owner goes in: passed, or, while another thread claims the gate, claimed
    /// once that thread is out (see [`OwnerGate::enter`]).
    ///
    /// Owner thread only.
    #[inline(always)]
    pub fn enter_or_claim(&self) -> Inside<'_> {
        match self.enter() {
            Some(pass) => Inside::Owner(pass),
            None => Inside::Claimed(self.claim()),
        }
    }
}

impl Drop for OwnerPass<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        self.gate.busy.store(false, Ordering::Release);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.gate.claimed.store(false, Ordering::Release);
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;
    use crate::primitives::AtomicU64;

    /// Adds one to `cell` with a plain load and store (what the gate makes safe).
    fn bump(cell: &AtomicU64) {
        cell.store(cell.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }

    #[test]
    fn the_owner_backs_out_while_claimed_and_passes_once_the_claim_drops() {
        let gate = OwnerGate::default();
        assert!(gate.enter().is_some());
        let claim = gate.claim();
        assert!(gate.enter().is_none(), "claimed");
        drop(claim);
        let pass = gate.enter().expect("open again");
        drop(pass);
        drop(gate.claim());
        assert!(matches!(gate.enter_or_claim(), Inside::Owner(_)));
        let claim = gate.claim();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| matches!(gate.enter_or_claim(), Inside::Claimed(_)));
            std::thread::sleep(std::time::Duration::from_millis(10));
            drop(claim);
            assert!(waiter.join().unwrap(), "claimed once the other claim dropped");
        });
    }

    #[test]
    fn no_update_inside_is_lost_between_the_owner_and_claimers() {
        let gate = std::sync::Arc::new(OwnerGate::default());
        let count = std::sync::Arc::new(AtomicU64::new(0));
        let rounds = if cfg!(miri) { 50 } else { 20_000 };
        let claimers: Vec<_> = (0..2)
            .map(|_| {
                let (gate, count) = (std::sync::Arc::clone(&gate), std::sync::Arc::clone(&count));
                std::thread::spawn(move || {
                    for _ in 0..rounds / 100 {
                        let _claim = gate.claim();
                        bump(&count);
                    }
                })
            })
            .collect();
        for _ in 0..rounds {
            match gate.enter() {
                Some(_pass) => bump(&count),
                None => {
                    let _claim = gate.claim();
                    bump(&count);
                }
            }
        }
        for claimer in claimers {
            claimer.join().unwrap();
        }
        assert_eq!(count.load(Ordering::Relaxed), rounds + 2 * (rounds / 100));
    }
}
