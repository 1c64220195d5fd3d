//! Hazard slots: how a thread says "I am reading the value behind this handle" without
//! a read-modify-write.
//!
//! Each thread that borrows gets one slot (an atomic word holding the handle it is
//! borrowing, 0 for none), registered in one process-wide list. Slots are never freed:
//! a thread's slot is handed back when the thread exits and reused by the next thread
//! that needs one, so the list is as long as the most threads that ever borrowed at
//! once. A borrower writes its slot with a plain store and fences with the light side
//! of the barrier pair; a destroyer, after marking the handle's cell, runs the heavy
//! side and reads every slot ([`protects`]). The protocol around it is in
//! [`crate::handles`].

use std::cell::Cell;

use crate::sync::{AtomicBool, AtomicPtr, AtomicU64, BarrierMode, CachePadded, Ordering, light_barrier, thread_local};

/// One thread's hazard slot.
pub(crate) struct Hazard {
    /// The handle borrowed through this slot, 0 for none. Written only by the owner.
    handle: AtomicU64,
    /// Whether a thread owns the slot.
    owned: AtomicBool,
    /// The process's barrier mode (every slot holds the same).
    mode: BarrierMode,
    /// The slot registered before this one; set before publication, never changed.
    next: Option<&'static Slot>,
}

/// A slot on a cache line of its own: each is written by its owner on every borrow.
type Slot = CachePadded<Hazard>;

impl Hazard {
    /// Whether no borrow uses the slot now (only the owner asks).
    #[inline]
    pub(crate) fn is_free(&self) -> bool {
        self.handle.load(Ordering::Relaxed) == 0
    }

    /// Announces a borrow of `handle`: after this, a destroyer's scan sees it, or this
    /// thread's next read of the cell's state sees the destroyer's mark.
    #[inline]
    pub(crate) fn announce(&self, handle: u64) {
        self.handle.store(handle, Ordering::Relaxed);
        light_barrier(self.mode);
    }

    /// Withdraws the announcement: after this, a destroyer's scan misses it, or this
    /// thread's next read of the cell's state sees the destroyer's mark.
    #[inline]
    pub(crate) fn withdraw(&self) {
        self.handle.store(0, Ordering::Release);
        light_barrier(self.mode);
    }
}

/// The process-wide list of slots (newest first).
struct HazardList {
    head: AtomicPtr<Slot>,
}

impl HazardList {
    #[cfg(not(memory_loom))]
    const fn new() -> HazardList {
        HazardList { head: AtomicPtr::new(std::ptr::null_mut()) }
    }

    #[cfg(memory_loom)]
    fn new() -> HazardList {
        HazardList { head: AtomicPtr::new(std::ptr::null_mut()) }
    }

    fn first(&self) -> Option<&'static Slot> {
        let head = self.head.load(Ordering::Acquire);
        // SAFETY: the head is null or a slot published by `register` (Release, read with
        // Acquire here) after it was fully written; slots are leaked, never freed.
        unsafe { head.as_ref() }
    }

    /// A free slot, owned by the caller from now on: a released one, or a new one.
    fn register(&self) -> &'static Hazard {
        let mut slot = self.first();
        while let Some(hazard) = slot {
            if hazard.owned.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return hazard;
            }
            slot = hazard.next;
        }
        let fresh = Box::into_raw(Box::new(CachePadded::new(Hazard {
            handle: AtomicU64::new(0),
            owned: AtomicBool::new(true),
            mode: BarrierMode::detect(),
            next: None,
        })));
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            // SAFETY: the head is null or a published slot that is never freed.
            let next = unsafe { head.as_ref() };
            // SAFETY: `fresh` is not published yet, so this is the only reference to it.
            unsafe { (&mut *fresh).next = next };
            match self.head.compare_exchange_weak(head, fresh, Ordering::AcqRel, Ordering::Acquire) {
                // SAFETY: published, and (leaked from its box) never freed.
                Ok(_) => return unsafe { &*fresh },
                Err(now) => head = now,
            }
        }
    }
}

#[cfg(not(memory_loom))]
static HAZARDS: HazardList = HazardList::new();

#[cfg(memory_loom)]
loom::lazy_static! {
    // A list per model execution (loom's atomics cannot live in a plain `static`).
    static ref HAZARDS: HazardList = HazardList::new();
}

/// Whether some thread's slot holds `handle` now. Call only after the heavy side of
/// the barrier pair, which makes every slot written before it visible here.
pub(crate) fn protects(handle: u64) -> bool {
    let mut slot = HAZARDS.first();
    while let Some(hazard) = slot {
        if hazard.handle.load(Ordering::Acquire) == handle {
            return true;
        }
        slot = hazard.next;
    }
    false
}

thread_local! {
    /// This thread's slot, once it has one (handed back by [`release_current`] when the
    /// thread exits, through [`crate::exit`]).
    static CURRENT: Cell<Option<&'static Hazard>> = const { Cell::new(None) };
}

/// Hands this thread's slot back (the thread is exiting).
pub(crate) fn release_current() {
    if let Ok(Some(hazard)) = CURRENT.try_with(Cell::take) {
        // No borrow is in progress: borrows end within the call that made them.
        hazard.owned.store(false, Ordering::Release);
    }
}

/// This thread's slot, registering one on first use; `None` while the thread exits
/// (its slot is gone; the caller borrows with a counted borrow instead).
#[inline]
pub(crate) fn current() -> Option<&'static Hazard> {
    match CURRENT.try_with(Cell::get) {
        Ok(Some(hazard)) => Some(hazard),
        _ => acquire(),
    }
}

#[cold]
#[inline(never)]
fn acquire() -> Option<&'static Hazard> {
    // The slot is handed back when the thread exits; none once it has.
    if !crate::exit::arm() {
        return None;
    }
    let hazard = HAZARDS.register();
    match CURRENT.try_with(|current| current.set(Some(hazard))) {
        Ok(()) => Some(hazard),
        Err(_) => {
            hazard.owned.store(false, Ordering::Release);
            None
        }
    }
}
