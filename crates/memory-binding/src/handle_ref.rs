//! How a [`BoundAllocation`](crate::BoundAllocation) keeps the pin that records it
//! alive without an atomic read-modify-write per allocation.
//!
//! A pin lives in an `Arc`. Its table holds one strong reference, and one more, the
//! *handle share*, is taken when the pin is made and stands for every handle that
//! names the pin. Handles are counted in *units*, split so that the common case needs
//! no read-modify-write:
//! - the owner thread (the only one that allocates on the pin) hands a unit out with a
//!   plain increment of `handed`, and takes one back, when it releases a handle itself,
//!   with a plain decrement, inside a `busy` section checked against `orphaned`;
//! - any other thread gives a unit back with `returned.fetch_sub(1)`.
//!
//! Units outstanding = `handed + returned`; `returned` stays ≤ 0 until the pin is
//! orphaned. While the table lives the pin lives, so nothing needs counting exactly.
//! The table drops only when no binding and no registry entry is left, so nobody can
//! allocate on the pin any more; it then *orphans* each pin: stores `orphaned`, runs
//! the cold side of the Dekker barrier, waits out an owner inside its few-instruction
//! `busy` section, and adds `handed` into `returned` with one read-modify-write. From
//! then on every unit comes back through `returned`, and whoever brings it to zero (the
//! orphaning itself, when no handle is left) drops the handle share. The owner takes
//! its plain path only when it read `orphaned` as false inside `busy`; the Dekker pair
//! (owner: store `busy`, barrier, load `orphaned`; orphaning: store `orphaned`,
//! barrier, load `busy`) makes sure the orphaning then sees `busy` and waits.
//!
//! `unsafe` is confined to this module: a [`PinRef`] is a pointer to its pin, valid
//! while its unit is outstanding, and the last unit drops the handle share through
//! `Arc::decrement_strong_count`. The protocol itself ([`Units`]) is safe code on the
//! `sync` primitives, checked by the loom models below.
#![allow(unsafe_code)]

use std::ptr::NonNull;

use crate::entry::MechanismPin;
use crate::sync::{
    Arc, AtomicBool, AtomicIsize, AtomicUsize, BarrierMode, CachePadded, Ordering, heavy_barrier, light_barrier,
    yield_now,
};

/// A pin's handle units (see the module docs).
pub(crate) struct Units {
    /// The owner's line: units handed out minus units it took back itself.
    owner: CachePadded<OwnerUnits>,
    /// Written by other threads: minus the units they gave back (plus `handed` once
    /// orphaned).
    returned: CachePadded<AtomicIsize>,
    /// Set once, by the table's drop.
    orphaned: AtomicBool,
    /// Under loom: whether the handle share was dropped, so a model can check that
    /// nothing touches the units afterwards.
    #[cfg(memory_loom)]
    freed: AtomicBool,
}

#[derive(Default)]
struct OwnerUnits {
    handed: AtomicUsize,
    busy: AtomicBool,
}

impl Units {
    pub(crate) fn new() -> Units {
        Units {
            owner: CachePadded::new(OwnerUnits::default()),
            returned: CachePadded::new(AtomicIsize::new(0)),
            orphaned: AtomicBool::new(false),
            #[cfg(memory_loom)]
            freed: AtomicBool::new(false),
        }
    }

    #[inline(always)]
    fn touch(&self) {
        #[cfg(memory_loom)]
        assert!(!self.freed.load(Ordering::Relaxed), "units touched after the handle share was dropped");
    }

    /// Hands a unit out (the owner thread, allocating).
    #[inline]
    pub(crate) fn hand_out(&self) {
        self.touch();
        let handed = &self.owner.handed;
        handed.store(handed.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }

    /// Takes a unit back on the owner thread. `true`: the caller brought the units to
    /// zero after orphaning and must drop the handle share.
    #[inline]
    pub(crate) fn give_back_owner(&self, barrier: BarrierMode) -> bool {
        self.touch();
        let owner = &*self.owner;
        owner.busy.store(true, Ordering::Relaxed);
        light_barrier(barrier);
        if !self.orphaned.load(Ordering::Relaxed) {
            owner.handed.store(owner.handed.load(Ordering::Relaxed) - 1, Ordering::Relaxed);
            // Release: the orphaning reads `handed` after it sees this.
            owner.busy.store(false, Ordering::Release);
            return false;
        }
        // Orphaned: this unit is (or is about to be) counted in `returned`.
        owner.busy.store(false, Ordering::Release);
        self.give_back_remote()
    }

    /// Gives a unit back from any thread. `true`: the caller brought the units to zero
    /// after orphaning and must drop the handle share. The read-modify-write is the
    /// caller's last access to the pin.
    #[inline]
    pub(crate) fn give_back_remote(&self) -> bool {
        self.touch();
        // Before orphaning `returned` is ≤ 0, so only a give-back after it sees 1.
        self.returned.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// The table is dropping: from now on units come back through `returned`. `true`:
    /// no unit is outstanding and the caller must drop the handle share.
    pub(crate) fn orphan(&self, barrier: BarrierMode) -> bool {
        self.touch();
        self.orphaned.store(true, Ordering::Relaxed);
        heavy_barrier(barrier);
        // The owner's `busy` section is a few instructions with no callback.
        while self.owner.busy.load(Ordering::Acquire) {
            yield_now();
        }
        let handed = self.owner.handed.load(Ordering::Relaxed) as isize;
        self.returned.fetch_add(handed, Ordering::AcqRel) + handed == 0
    }

    #[cfg(all(test, memory_loom))]
    fn mark_freed(&self) {
        assert!(!self.freed.swap(true, Ordering::Relaxed), "the handle share was dropped twice");
    }
}

/// What a [`BoundAllocation`](crate::BoundAllocation) holds: its pin, kept alive by a
/// unit instead of an `Arc` strong reference.
pub(crate) struct PinRef {
    pin: NonNull<MechanismPin>,
}

// SAFETY: a `PinRef` is a shared reference to a `MechanismPin`, which is `Send + Sync` (every
// field is an atomic, a lock or an `Arc` of `Sync` data); its unit keeps the pin alive
// from any thread, and giving the unit back is thread-safe (`Units`).
unsafe impl Send for PinRef {}
// SAFETY: as for `Send`: `&PinRef` only gives out `&MechanismPin`.
unsafe impl Sync for PinRef {}

impl PinRef {
    /// Hands out a unit of `pin`, which must be the calling thread's own pin (its
    /// owner hands units out with plain stores).
    #[inline]
    pub(crate) fn new(pin: &Arc<MechanismPin>) -> PinRef {
        debug_assert!(pin.owned_here(), "units are handed out by the pin's owner only");
        pin.units.hand_out();
        // From `Arc::as_ptr`, not from `&MechanismPin`: the pointer must carry the provenance of
        // the whole allocation, counts included (`to_arc`, the share's drop).
        let pin = NonNull::new(Arc::as_ptr(pin).cast_mut()).unwrap_or_else(|| unreachable!("an Arc is never null"));
        PinRef { pin }
    }

    /// The pin.
    #[inline]
    pub(crate) fn get(&self) -> &MechanismPin {
        // SAFETY: the pointer came from a live `Arc<MechanismPin>` (`new`), and the pin cannot
        // be freed while this `PinRef`'s unit is outstanding: the table's strong
        // reference holds it until the table drops, the handle share after that, and
        // the share is dropped only once every unit came back (`Units`). The unit
        // comes back in `drop`, after the last use of this borrow.
        unsafe { self.pin.as_ref() }
    }

    /// A strong reference to the pin, for what outlives the handle (a queued release).
    pub(crate) fn to_arc(&self) -> Arc<MechanismPin> {
        let ptr = self.pin.as_ptr().cast_const();
        // SAFETY: `ptr` is the data pointer of a live `Arc<MechanismPin>` allocation (see
        // `get`), so raising its strong count and owning the new count through
        // `from_raw` is exactly `Arc::clone`.
        unsafe {
            Arc::increment_strong_count(ptr);
        }
        // SAFETY: the count raised just above is the one this `Arc` owns.
        unsafe { Arc::from_raw(ptr) }
    }
}

impl Drop for PinRef {
    #[inline]
    fn drop(&mut self) {
        let pin = self.get();
        let last = if pin.owned_here() {
            pin.units.give_back_owner(pin.core.lifecycle.barrier())
        } else {
            pin.units.give_back_remote()
        };
        if last {
            // SAFETY: the units came back to zero after orphaning, which happens once
            // (`Units`): this is the one drop of the handle share, the strong count taken
            // for it when the pin was made (`take_handle_share`). The pin is not touched
            // afterwards.
            unsafe { Arc::decrement_strong_count(self.pin.as_ptr().cast_const()) }
        }
    }
}

/// Takes the handle share of a new pin (see the module docs).
pub(crate) fn take_handle_share(pin: &Arc<MechanismPin>) {
    std::mem::forget(Arc::clone(pin));
}

/// The table is dropping: orphans `pin`, dropping its handle share when no handle is
/// left (otherwise the last handle does).
pub(crate) fn orphan(pin: &Arc<MechanismPin>) {
    if pin.units.orphan(pin.core.lifecycle.barrier()) {
        // SAFETY: no unit is outstanding and the pin is orphaned, so this is the one
        // drop of the handle share taken by `take_handle_share`; the table's own
        // strong reference (`pin`) keeps the pin alive past it.
        unsafe { Arc::decrement_strong_count(Arc::as_ptr(pin)) }
    }
}

/// loom models of the unit protocol (`cargo xtask loom`).
#[cfg(all(test, memory_loom))]
mod loom_units {
    use super::*;

    /// Gives back and records a drop of the share under the model's own flag.
    fn settle(units: &Units, last: bool) {
        if last {
            units.mark_freed();
        }
    }

    /// The owner taking a unit back, another thread giving one back, and the table
    /// orphaning the pin, all at once: the handle share is dropped exactly once, after
    /// every unit came back, and nothing touches the units after that.
    #[test]
    fn loom_units_drop_the_share_once_after_the_last_unit() {
        loom::model(|| {
            let units = Arc::new(Units::new());
            units.hand_out();
            units.hand_out();
            let remote = {
                let units = Arc::clone(&units);
                loom::thread::spawn(move || settle(&units, units.give_back_remote()))
            };
            let table = {
                let units = Arc::clone(&units);
                loom::thread::spawn(move || settle(&units, units.orphan(BarrierMode::Fence)))
            };
            settle(&units, units.give_back_owner(BarrierMode::Fence));
            remote.join().unwrap();
            table.join().unwrap();
            assert!(units.freed.load(Ordering::Relaxed), "the handle share was never dropped (a leak)");
        });
    }

    /// The owner keeps allocating and releasing while another thread gives a unit back,
    /// then the table orphans the pin with one unit still out, which the owner gives
    /// back last.
    #[test]
    fn loom_units_the_last_owner_release_after_orphaning_drops_the_share() {
        loom::model(|| {
            let units = Arc::new(Units::new());
            units.hand_out();
            units.hand_out();
            let remote = {
                let units = Arc::clone(&units);
                loom::thread::spawn(move || settle(&units, units.give_back_remote()))
            };
            units.hand_out();
            settle(&units, units.give_back_owner(BarrierMode::Fence));
            let table = {
                let units = Arc::clone(&units);
                loom::thread::spawn(move || settle(&units, units.orphan(BarrierMode::Fence)))
            };
            remote.join().unwrap();
            table.join().unwrap();
            assert!(!units.freed.load(Ordering::Relaxed), "dropped while a unit is out");
            settle(&units, units.give_back_owner(BarrierMode::Fence));
            assert!(units.freed.load(Ordering::Relaxed), "the handle share was never dropped (a leak)");
        });
    }
}
