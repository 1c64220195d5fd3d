//! loom models of the handle tables' borrow and destroy protocol (module docs of
//! [`crate::handles`]), in fence mode (the barrier mode loom runs).
//!
//! Each model stores a [`Probe`] in a fresh hazard table and races borrows against
//! `remove`. A probe's drop writes its payload through loom's `UnsafeCell`, which a
//! borrow reads: a drop while a borrow reads is a causality violation loom reports. After
//! the threads are joined each probe must have been dropped exactly once (never leaked).
//!
//! Run: `RUSTFLAGS="--cfg memory_loom" LOOM_MAX_PREEMPTIONS=3 cargo test -p memory-capi
//! --lib --release loom` (or `cargo xtask loom`).

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::AtomicUsize;
use loom::thread;

use super::{Fault, FreeList, Scheme, Slots, Store};
use crate::sync::Ordering;

/// What the models store: which value it is, a payload the borrowers read, and a
/// count of drops.
struct Probe {
    id: u32,
    shared: Arc<Shared>,
}

struct Shared {
    payload: UnsafeCell<u64>,
    drops: AtomicUsize,
}

// SAFETY: the payload is read and written only through loom's `UnsafeCell`, which
// reports any access not ordered by happens-before (that report is what the models
// look for).
unsafe impl Sync for Shared {}

const PAYLOAD: u64 = 0x5eed;

impl Probe {
    fn new(id: u32) -> (Probe, Arc<Shared>) {
        let shared = Arc::new(Shared { payload: UnsafeCell::new(PAYLOAD), drops: AtomicUsize::new(0) });
        (Probe { id, shared: Arc::clone(&shared) }, shared)
    }

    /// What a call does with a borrowed value: read it.
    fn read(&self, expected: u32) {
        assert_eq!(self.id, expected, "a handle reached another value than its own");
        // SAFETY: a shared read; loom reports it if a drop's write can race it.
        let payload = self.shared.payload.with(|payload| unsafe { *payload });
        assert_eq!(payload, PAYLOAD, "read a dropped value");
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        // SAFETY: an exclusive write; loom reports it if a borrow's read can race it.
        self.shared.payload.with_mut(|payload| unsafe { *payload = 0 });
        self.shared.drops.fetch_add(1, Ordering::Relaxed);
    }
}

impl Shared {
    fn drops(&self) -> usize {
        self.drops.load(Ordering::Relaxed)
    }
}

crate::sync::thread_local! {
    static FREE: FreeList = const { FreeList::new() };
}

/// A fresh hazard table for one execution of a model.
fn table() -> &'static Slots<Probe> {
    let store = Box::leak(Box::new(Store::new()));
    Box::leak(Box::new(Slots::new(0x7e, Scheme::Hazard, "probe", &FREE, store)))
}

/// Borrows `handle` the table's way and reads it (the probe `id`); `Stale` is the only
/// other answer.
fn hazard_read(table: &'static Slots<Probe>, handle: u64, id: u32) {
    match table.borrow(handle) {
        Ok(borrowed) => {
            assert!(borrowed.hazard.is_some(), "the thread's first borrow uses its hazard slot");
            borrowed.read(id);
        }
        Err(fault) => assert_eq!(fault, Fault::Stale),
    }
}

#[test]
fn loom_hazard_borrow_racing_destroy_drops_once_never_under_the_reader() {
    loom::model(|| {
        let table = table();
        let (probe, shared) = Probe::new(1);
        let handle = table.insert(probe).map_err(|(_, fault)| fault).unwrap();
        let reader = thread::spawn(move || hazard_read(table, handle, 1));
        table.remove(handle).unwrap();
        reader.join().unwrap();
        assert_eq!(shared.drops(), 1, "dropped exactly once, after every borrow ended");
    });
}

#[test]
fn loom_counted_and_hazard_borrows_racing_destroy_drop_once_never_under_a_reader() {
    loom::model(|| {
        let table = table();
        let (probe, shared) = Probe::new(1);
        let handle = table.insert(probe).map_err(|(_, fault)| fault).unwrap();
        let hazard = thread::spawn(move || hazard_read(table, handle, 1));
        let counted = thread::spawn(move || match table.borrow_counted(handle) {
            Ok(borrowed) => borrowed.read(1),
            Err(fault) => assert_eq!(fault, Fault::Stale),
        });
        table.remove(handle).unwrap();
        hazard.join().unwrap();
        counted.join().unwrap();
        assert_eq!(shared.drops(), 1, "dropped exactly once, after every borrow ended");
    });
}

#[test]
fn loom_failing_borrow_racing_destroy_and_reuse_leaks_nothing_and_reads_nothing_stale() {
    loom::model(|| {
        let table = table();
        let (first, first_shared) = Probe::new(1);
        let old = table.insert(first).map_err(|(_, fault)| fault).unwrap();
        // Borrows the old handle while it is destroyed and its cell may be reused: it
        // reads the first value or fails, never reads the second one, and whatever its
        // announcement made the destroyer leave behind, it reclaims.
        let reader = thread::spawn(move || hazard_read(table, old, 1));
        table.remove(old).unwrap();
        let (second, second_shared) = Probe::new(2);
        let new = table.insert(second).map_err(|(_, fault)| fault).unwrap();
        assert_ne!(new, old);
        table.borrow(new).unwrap().read(2);
        table.remove(new).unwrap();
        reader.join().unwrap();
        assert_eq!(first_shared.drops(), 1, "the destroyed value was dropped exactly once");
        assert_eq!(second_shared.drops(), 1, "the reused cell's value was dropped exactly once");
    });
}
