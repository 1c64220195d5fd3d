//! How allocation handles and bindings keep what they name alive without an atomic
//! read-modify-write on the thread that owns it: biased reference counts, in *units*.
//!
//! Two kinds of per-thread object are kept alive this way ([`UnitHolder`]): a
//! mechanism's pin, which every [`BoundAllocation`](crate::BoundAllocation) recorded in
//! it names, and a mechanism's anchor, which every [`MemoryBinding`](crate::MemoryBinding)
//! made through it names. Each lives in an `Arc`. Its container (the pin table, the
//! registry's mechanism) holds one strong reference, and one more, the *unit share*, is
//! taken when the object is made and stands for every unit. Units are counted so that
//! the owner (the thread the object serves) needs no read-modify-write:
//! - the owner hands a unit out, and takes one back, with plain stores of `handed`,
//!   inside a `busy` section checked against `orphaned` (a pin's owner, which allocates
//!   only while its table lives, skips the check when handing out);
//! - any other thread gives a unit back with `returned.fetch_sub(1)` and, while it holds
//!   one, hands another out with `returned.fetch_add(1)` (a binding cloned on a thread
//!   that did not make it).
//!
//! `returned` starts at [`BIAS`], far above any count of units, so before orphaning no
//! give-back can bring it to zero. While the container lives the object lives, so
//! nothing needs counting exactly. When the container drops it *orphans* each object:
//! stores `orphaned`, runs the cold side of the Dekker barrier, waits out an owner inside
//! its few-instruction `busy` section, and adds `handed − BIAS` into `returned` with one
//! read-modify-write. From then on `returned` is the exact number of units out, every
//! unit comes back through it, and whoever brings it to zero (the orphaning itself, when
//! no unit is out) drops the unit share. The owner takes its plain path only when it read
//! `orphaned` as false inside `busy`; the Dekker pair (owner: store `busy`, barrier, load
//! `orphaned`; orphaning: store `orphaned`, barrier, load `busy`) makes sure the orphaning
//! then sees `busy` and waits.
//!
//! A thread's bind cache keeps a `Weak` to its anchor, so a removed mechanism is never
//! kept alive by a cache: `bind` hands a unit out only through that busy section, and
//! refuses (a cache miss) once the anchor is orphaned.
//!
//! `unsafe` is confined to this module: a [`UnitRef`] is a pointer to its object, valid
//! while its unit is outstanding, and the last unit drops the unit share through
//! `Arc::decrement_strong_count`. The protocol itself ([`Units`]) is safe code on the
//! `sync` primitives, checked by the loom models below.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::Weak;

use crate::sync::is_current;
use crate::sync::{
    Arc, AtomicBool, AtomicIsize, AtomicUsize, BarrierMode, CachePadded, Ordering, heavy_barrier, light_barrier,
    yield_now,
};

/// Where `returned` starts: more than any number of units that can be out, so that no
/// give-back before orphaning reaches zero, and far from overflow.
const BIAS: isize = isize::MAX / 2;

/// An object kept alive by units.
pub(crate) trait UnitHolder {
    /// Its units.
    fn units(&self) -> &Units;
}

/// An object's units (see the module docs). Everything a unit operation reads is here,
/// in plain fields or atomics without drop glue, so that a bind cache's `Weak` can
/// read it even after the object's value was dropped: nothing behind a pointer.
pub(crate) struct Units {
    /// The thread index the object serves: the only one that takes the plain path.
    owner_index: usize,
    /// How the object's Dekker points are fenced (its mechanism's mode).
    barrier: BarrierMode,
    /// The owner's line: units handed out minus units it took back itself.
    owner: CachePadded<OwnerUnits>,
    /// Written by other threads: `BIAS`, plus units they handed out, minus units they
    /// gave back (plus `handed − BIAS` once orphaned).
    returned: CachePadded<AtomicIsize>,
    /// Set once, by the container's drop.
    orphaned: AtomicBool,
    /// Under loom: whether the unit share was dropped, so a model can check that
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
    pub(crate) fn new(owner_index: usize, barrier: BarrierMode) -> Units {
        Units {
            owner_index,
            barrier,
            owner: CachePadded::new(OwnerUnits::default()),
            returned: CachePadded::new(AtomicIsize::new(BIAS)),
            orphaned: AtomicBool::new(false),
            #[cfg(memory_loom)]
            freed: AtomicBool::new(false),
        }
    }

    /// Whether the calling thread is the one the object serves.
    #[inline]
    pub(crate) fn owned_here(&self) -> bool {
        is_current(self.owner_index)
    }

    #[inline(always)]
    fn touch(&self) {
        #[cfg(memory_loom)]
        assert!(!self.freed.load(Ordering::Relaxed), "units touched after the unit share was dropped");
    }

    /// Hands a unit out on the owner thread, when the object cannot have been orphaned
    /// (a pin, while the binding that allocates on it keeps its table alive).
    #[inline]
    pub(crate) fn hand_out_live(&self) {
        self.touch();
        let handed = &self.owner.handed;
        handed.store(handed.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }

    /// Hands a unit out on the owner thread unless the object was orphaned. `false`:
    /// nothing was handed out. Needs no unit held: the caller only needs the object's
    /// memory to stay allocated (an `Arc` or a `Weak`).
    #[inline]
    pub(crate) fn try_hand_out_owner(&self) -> bool {
        let barrier = self.barrier;
        // No `touch`: a bind cache's `Weak` may reach the units after the share was
        // dropped, and must then read them as orphaned.
        let owner = &*self.owner;
        owner.busy.store(true, Ordering::Relaxed);
        light_barrier(barrier);
        let live = !self.orphaned.load(Ordering::Relaxed);
        if live {
            owner.handed.store(owner.handed.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        }
        // Release: the orphaning reads `handed` after it sees this.
        owner.busy.store(false, Ordering::Release);
        live
    }

    /// Hands a unit out from any thread that holds one (so the unit share cannot be
    /// dropped meanwhile).
    #[inline]
    pub(crate) fn hand_out_remote(&self) {
        self.touch();
        // Like `Arc::clone`: holding a unit, no ordering is needed to take another.
        self.returned.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes a unit back on the owner thread. `true`: the caller brought the units to
    /// zero after orphaning and must drop the unit share.
    #[inline]
    pub(crate) fn give_back_owner(&self) -> bool {
        self.touch();
        let barrier = self.barrier;
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
    /// after orphaning and must drop the unit share. The read-modify-write is the
    /// caller's last access to the object.
    #[inline]
    pub(crate) fn give_back_remote(&self) -> bool {
        self.touch();
        // Before orphaning `returned` stays near `BIAS`, so only a give-back after it
        // can see 1.
        self.returned.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// The container is dropping: from now on units come back through `returned`.
    /// `true`: no unit is outstanding and the caller must drop the unit share.
    pub(crate) fn orphan(&self) -> bool {
        self.touch();
        self.orphaned.store(true, Ordering::Relaxed);
        heavy_barrier(self.barrier);
        // The owner's `busy` section is a few instructions with no callback.
        while self.owner.busy.load(Ordering::Acquire) {
            yield_now();
        }
        let delta = self.owner.handed.load(Ordering::Relaxed) as isize - BIAS;
        self.returned.fetch_add(delta, Ordering::AcqRel) + delta == 0
    }

    #[cfg(all(test, memory_loom))]
    fn mark_freed(&self) {
        assert!(!self.freed.swap(true, Ordering::Relaxed), "the unit share was dropped twice");
    }
}

/// A pointer to a [`UnitHolder`] kept alive by one of its units instead of an `Arc`
/// strong reference: what a [`BoundAllocation`](crate::BoundAllocation) holds of its
/// pin, and a [`MemoryBinding`](crate::MemoryBinding) of its anchor.
pub(crate) struct UnitRef<T: UnitHolder> {
    object: NonNull<T>,
}

// SAFETY: a `UnitRef<T>` is a shared reference to a `T` that is `Send + Sync`; its unit
// keeps the object alive from any thread, and taking or giving units is thread-safe
// (`Units`: the owner's plain path runs only on the owner thread).
unsafe impl<T: UnitHolder + Send + Sync> Send for UnitRef<T> {}
// SAFETY: as for `Send`: `&UnitRef<T>` only gives out `&T` (and new units, thread-safely).
unsafe impl<T: UnitHolder + Send + Sync> Sync for UnitRef<T> {}

impl<T: UnitHolder> UnitRef<T> {
    /// Hands out a unit of `object`, which must be the calling thread's own and not
    /// orphaned (a pin, allocated on through a live binding).
    #[inline]
    pub(crate) fn new_live(object: &Arc<T>) -> UnitRef<T> {
        debug_assert!(object.units().owned_here(), "units are handed out by the owner only");
        object.units().hand_out_live();
        UnitRef { object: Self::pointer(Arc::as_ptr(object)) }
    }

    /// Hands out a unit of `object`, the calling thread's own, unless it was orphaned.
    #[inline]
    pub(crate) fn try_new(object: &Arc<T>) -> Option<UnitRef<T>> {
        debug_assert!(object.units().owned_here(), "units are handed out by the owner only");
        object.units().try_hand_out_owner().then(|| UnitRef { object: Self::pointer(Arc::as_ptr(object)) })
    }

    /// Hands out a unit of the object behind `pointer`, if the calling thread owns it and
    /// it was not orphaned (its value may then be dropped already: only its units are
    /// read before the unit is in hand).
    ///
    /// # Safety
    /// `pointer` is the data pointer of an `Arc<T>` allocation that a weak (or strong)
    /// count held by the caller keeps allocated for the length of the call.
    #[inline]
    unsafe fn try_from_weak_pointer(pointer: NonNull<T>) -> Option<UnitRef<T>> {
        // SAFETY: the caller's count keeps the allocation alive, so the pointer is
        // dereferenceable and aligned. If the value has been dropped, its bytes are as
        // it left them, and only the units are read: plain fields and atomics without
        // drop glue, nothing behind a pointer. The unit protocol makes a dropped object
        // read as orphaned (it is orphaned before its share and its container's
        // reference go), so no unit is handed out of it.
        let units = unsafe { pointer.as_ref() }.units();
        if !units.owned_here() {
            return None;
        }
        units.try_hand_out_owner().then_some(UnitRef { object: pointer })
    }

    fn pointer(object: *const T) -> NonNull<T> {
        NonNull::new(object.cast_mut())
            .unwrap_or_else(|| unreachable!("an Arc or a Weak of a live value is never null"))
    }

    /// The object.
    #[inline]
    pub(crate) fn get(&self) -> &T {
        // SAFETY: the pointer came from a live `Arc` or `Weak` of the object, and the
        // object cannot be freed while this `UnitRef`'s unit is outstanding: the
        // container's strong reference holds it until the container drops, the unit share
        // after that, and the share is dropped only once every unit came back (`Units`).
        // The unit comes back in `drop`, after the last use of this borrow.
        unsafe { self.object.as_ref() }
    }

    /// A strong reference to the object, for what outlives the holder (a queued release).
    pub(crate) fn to_arc(&self) -> Arc<T> {
        let ptr = self.object.as_ptr().cast_const();
        // SAFETY: `ptr` is the data pointer of a live `Arc<T>` allocation (see `get`), so
        // raising its strong count and owning the new count through `from_raw` is
        // exactly `Arc::clone`.
        unsafe {
            Arc::increment_strong_count(ptr);
        }
        // SAFETY: the count raised just above is the one this `Arc` owns.
        unsafe { Arc::from_raw(ptr) }
    }
}

impl<T: UnitHolder> Deref for UnitRef<T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        self.get()
    }
}

impl<T: UnitHolder> Clone for UnitRef<T> {
    /// Another unit of the same object: on its owner thread with plain stores (unless it
    /// was orphaned), elsewhere with one read-modify-write, as `Arc::clone`.
    #[inline]
    fn clone(&self) -> UnitRef<T> {
        let units = self.get().units();
        if !(units.owned_here() && units.try_hand_out_owner()) {
            units.hand_out_remote();
        }
        UnitRef { object: self.object }
    }
}

impl<T: UnitHolder> UnitRef<T> {
    /// Gives the unit back (as `drop` does) when the caller already knows whether the
    /// calling thread owns the object: `owned_here` must be `units().owned_here()` read
    /// on this thread (which a hot path that asked once passes on instead of asking again).
    #[inline]
    pub(crate) fn give_back(self, owned_here: bool) {
        debug_assert_eq!(owned_here, self.get().units().owned_here());
        let this = std::mem::ManuallyDrop::new(self);
        this.give_back_unit(owned_here);
    }

    #[inline]
    fn give_back_unit(&self, owned_here: bool) {
        let units = self.get().units();
        let last = if owned_here { units.give_back_owner() } else { units.give_back_remote() };
        if last {
            // SAFETY: the units came back to zero after orphaning, which happens once
            // (`Units`): this is the one drop of the unit share, the strong count taken
            // for it when the object was made (`take_unit_share`). The object is not
            // touched afterwards.
            unsafe { Arc::decrement_strong_count(self.object.as_ptr().cast_const()) }
        }
    }
}

impl<T: UnitHolder> Drop for UnitRef<T> {
    #[inline]
    fn drop(&mut self) {
        self.give_back_unit(self.get().units().owned_here());
    }
}

/// A weak reference kept in a `Cell`, for a thread's bind cache: read with no borrow
/// flag, and with no drop glue, so a `const` thread-local holding it needs no
/// destructor (and its reads no lazy-registration check). It owns one weak count
/// while it holds a pointer; whoever owns it must [`clear`](CachedWeak::clear) it
/// before it goes away, or that count (the allocation, not the value) leaks.
pub(crate) struct CachedWeak<T> {
    /// From `Weak::into_raw`, or null.
    pointer: Cell<*const T>,
}

impl<T: UnitHolder> CachedWeak<T> {
    pub(crate) const fn empty() -> CachedWeak<T> {
        CachedWeak { pointer: Cell::new(std::ptr::null()) }
    }

    /// Holds `weak` from now on, dropping the weak reference held before.
    pub(crate) fn set(&self, weak: Weak<T>) {
        let previous = self.pointer.replace(Weak::into_raw(weak));
        Self::release(previous);
    }

    /// Drops the weak reference held, if any.
    pub(crate) fn clear(&self) {
        Self::release(self.pointer.replace(std::ptr::null()));
    }

    fn release(pointer: *const T) {
        if !pointer.is_null() {
            // SAFETY: a non-null pointer came from `Weak::into_raw` in `set` and was
            // just taken out of the cell, so the weak count it owns is dropped once.
            drop(unsafe { Weak::from_raw(pointer) });
        }
    }

    /// A unit of the object held, if the calling thread owns it and it was not
    /// orphaned (see [`UnitRef::try_from_weak_pointer`]).
    #[inline]
    pub(crate) fn try_unit(&self) -> Option<UnitRef<T>> {
        let pointer = NonNull::new(self.pointer.get().cast_mut())?;
        // SAFETY: the pointer came from `Weak::into_raw` (its provenance covers the
        // whole allocation) and the weak count it owns stays in the cell for this call:
        // nothing here can replace it (no callback runs, and the cell is this thread's).
        unsafe { UnitRef::try_from_weak_pointer(pointer) }
    }
}

/// Takes the unit share of a new object (see the module docs).
pub(crate) fn take_unit_share<T: UnitHolder>(object: &Arc<T>) {
    std::mem::forget(Arc::clone(object));
}

/// The container is dropping: orphans `object`, dropping its unit share when no unit is
/// left (otherwise the last unit's holder does).
pub(crate) fn orphan<T: UnitHolder>(object: &Arc<T>) {
    if object.units().orphan() {
        // SAFETY: no unit is outstanding and the object is orphaned, so this is the one
        // drop of the unit share taken by `take_unit_share`; the container's own strong
        // reference (`object`) keeps the object alive past it.
        unsafe { Arc::decrement_strong_count(Arc::as_ptr(object)) }
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

    /// The owner taking a unit back, another thread giving one back, and the container
    /// orphaning the object, all at once: the unit share is dropped exactly once, after
    /// every unit came back, and nothing touches the units after that.
    #[test]
    fn loom_units_drop_the_share_once_after_the_last_unit() {
        loom::model(|| {
            let units = Arc::new(Units::new(0, BarrierMode::Fence));
            units.hand_out_live();
            units.hand_out_live();
            let remote = {
                let units = Arc::clone(&units);
                loom::thread::spawn(move || settle(&units, units.give_back_remote()))
            };
            let table = {
                let units = Arc::clone(&units);
                loom::thread::spawn(move || settle(&units, units.orphan()))
            };
            settle(&units, units.give_back_owner());
            remote.join().unwrap();
            table.join().unwrap();
            assert!(units.freed.load(Ordering::Relaxed), "the unit share was never dropped (a leak)");
        });
    }

    /// The owner keeps allocating and releasing while another thread gives a unit back,
    /// then the container orphans the object with one unit still out, which the owner
    /// gives back last.
    #[test]
    fn loom_units_the_last_owner_release_after_orphaning_drops_the_share() {
        loom::model(|| {
            let units = Arc::new(Units::new(0, BarrierMode::Fence));
            units.hand_out_live();
            units.hand_out_live();
            let remote = {
                let units = Arc::clone(&units);
                loom::thread::spawn(move || settle(&units, units.give_back_remote()))
            };
            units.hand_out_live();
            settle(&units, units.give_back_owner());
            let table = {
                let units = Arc::clone(&units);
                loom::thread::spawn(move || settle(&units, units.orphan()))
            };
            remote.join().unwrap();
            table.join().unwrap();
            assert!(!units.freed.load(Ordering::Relaxed), "dropped while a unit is out");
            settle(&units, units.give_back_owner());
            assert!(units.freed.load(Ordering::Relaxed), "the unit share was never dropped (a leak)");
        });
    }

    /// A bind from the cache (the owner trying to hand a unit out of an object it holds
    /// no unit of) racing the container's orphaning: either the bind gets a unit, and
    /// the share is dropped only after that unit comes back, or the bind is refused;
    /// the share is dropped exactly once either way.
    #[test]
    fn loom_units_a_cached_bind_racing_orphaning_never_revives_the_object() {
        loom::model(|| {
            let units = Arc::new(Units::new(0, BarrierMode::Fence));
            let container = {
                let units = Arc::clone(&units);
                loom::thread::spawn(move || settle(&units, units.orphan()))
            };
            if units.try_hand_out_owner() {
                assert!(!units.freed.load(Ordering::Relaxed), "a unit handed out of a dropped object");
                settle(&units, units.give_back_owner());
            }
            container.join().unwrap();
            assert!(units.freed.load(Ordering::Relaxed), "the unit share was never dropped (a leak)");
        });
    }

    /// A binding cloned on another thread (a remote hand-out by a holder of a unit)
    /// while the owner gives its unit back and the container orphans the object: the
    /// share outlives both units and is dropped exactly once.
    #[test]
    fn loom_units_a_remote_clone_racing_orphaning_keeps_the_object_alive() {
        loom::model(|| {
            let units = Arc::new(Units::new(0, BarrierMode::Fence));
            units.hand_out_live();
            units.hand_out_live();
            let remote = {
                let units = Arc::clone(&units);
                loom::thread::spawn(move || {
                    // Holding the second unit: clone, then drop the original.
                    units.hand_out_remote();
                    settle(&units, units.give_back_remote());
                    units
                })
            };
            let container = {
                let units = Arc::clone(&units);
                loom::thread::spawn(move || settle(&units, units.orphan()))
            };
            settle(&units, units.give_back_owner());
            let units = remote.join().unwrap();
            container.join().unwrap();
            assert!(!units.freed.load(Ordering::Relaxed), "dropped while the clone is out");
            settle(&units, units.give_back_remote());
            assert!(units.freed.load(Ordering::Relaxed), "the unit share was never dropped (a leak)");
        });
    }
}
