//! Opaque handles that validate like Rust handles: a handle is a number shaped like a
//! pointer (never dereferenced) naming a cell in a type-stable table, plus the cell's
//! generation and the table's kind tag. A null, foreign (another kind, or no handle
//! at all), stale or double-released handle is an error value, never undefined
//! behaviour, because the memory a handle names is never freed or reused for another
//! type: cells live in chunks that are allocated once and kept for the life of the
//! process, and a cell is reused only under a new generation.
//!
//! Layout of a handle: `kind (8 bits) | generation (24 bits) | cell index (32 bits)`.
//! A cell whose generation would wrap is retired, so a stale handle never validates
//! again.
//!
//! # The state word
//! Each cell has one atomic word: its generation (low 24 bits), a count of counted
//! borrows, and `LIVE` / `TAKEN` / `DYING` bits. Taking (a call consuming the handle:
//! release) moves a `LIVE` cell with no borrows to `TAKEN` with one compare-and-swap,
//! so of two racing releases exactly one wins and the other gets `Stale` or `Busy`.
//! Removing (destroy) clears `LIVE` and sets `DYING` with one compare-and-swap, whatever
//! borrows are in progress; new borrows fail from then on, and whoever ends the last
//! borrow reclaims the value.
//!
//! # Borrows: a hazard slot, or a count
//! A call that uses a handle borrows its value for the length of the call, in one of
//! two ways:
//! - **hazard borrow** (tables built with [`Scheme::Hazard`], when the thread's hazard
//!   slot is free, which it is unless a borrow is already in progress on this thread):
//!   store the handle in the slot, light barrier, load the state; if the generation
//!   differs or the cell is not `LIVE` (or is `TAKEN`), withdraw and fail. Ending it:
//!   store 0 in the slot, light barrier, load the state; if the cell is `DYING` under
//!   this generation, try to reclaim. No read-modify-write on the way in or out.
//! - **counted borrow** (the fallback for a nested borrow, and the only kind in
//!   [`Scheme::Counted`] tables): one compare-and-swap adds a user if the cell is `LIVE`
//!   under the generation and not `TAKEN`; ending it subtracts one, and the last user of
//!   a `DYING` cell tries to reclaim.
//!
//! **Reclaiming** (cold, any thread, [`Slots::try_reclaim`]): a read-modify-write of the
//! state (so the heavy barrier orders a write of this thread's own), heavy barrier, and
//! if any hazard slot holds the handle or a counted borrow remains, stop: that borrower
//! reclaims when it ends. Otherwise one compare-and-swap from `DYING` with no users to
//! "claimed" picks exactly one claimant, which moves the value out, frees the cell
//! (next generation, back on a free list) and drops the value outside any lock.
//!
//! Why it is sound: the borrower's "store slot; barrier; load state" and the
//! reclaimer's "write state; barrier; load slots" are the two sides of a Dekker point,
//! so either the borrower sees `DYING` (and never reads the value) or the reclaimer
//! sees the slot (and leaves the value to the borrower, whose exit check then sees
//! `DYING`). The loom models in `src/loom_handles.rs` check it in fence mode: a value is
//! dropped exactly once, never while a borrow reads it, and never leaked.
//!
//! A `take` from a hazard table pays the reclaimer's price (heavy barrier and scan)
//! and answers `Busy` if a hazard borrow is in progress; the table whose handles are
//! taken on the hot path (allocations) is therefore a counted one.
//!
//! Free cells go to an intrusive per-thread list (a link in each free cell; no shared
//! write on the hot path); a thread's list goes to the table's orphans when the thread
//! ends (from [`crate::exit`], also for a thread that freed cells from its pthread key
//! destructors), and a thread whose list is empty adopts an orphaned one.

use std::cell::{Cell, UnsafeCell};
use std::marker::PhantomData;
use std::mem::{ManuallyDrop, MaybeUninit};

use crate::hazard::{self, Hazard};
use crate::sync::{
    AtomicPtr, AtomicU32, AtomicU64, BarrierMode, LocalKey, Mutex, Ordering, heavy_barrier, lock, thread_local,
};

#[cfg(not(memory_loom))]
const CHUNK_BITS: u32 = 10;
#[cfg(not(memory_loom))]
const CHUNKS: usize = 1 << 14;
// The models need a handful of cells; loom tracks every atomic it creates.
#[cfg(memory_loom)]
const CHUNK_BITS: u32 = 2;
#[cfg(memory_loom)]
const CHUNKS: usize = 4;
const CHUNK: usize = 1 << CHUNK_BITS;
/// The most cells one table can hold.
pub(crate) const MAX_CELLS: u32 = (CHUNK * CHUNKS) as u32;

const GENERATION_MASK: u64 = 0x00ff_ffff;
const USER: u64 = 1 << 32;
const USERS_MASK: u64 = ((1 << 29) - 1) << 32;
const LIVE: u64 = 1 << 61;
const TAKEN: u64 = 1 << 62;
const DYING: u64 = 1 << 63;
/// The end of a free list.
const NO_CELL: u32 = u32::MAX;

/// Why a handle was not accepted.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The handle is null.
    Null,
    /// Not a handle of this kind (another kind, or not a handle at all).
    WrongKind {
        /// The kind tag found (0 for a value that is no handle).
        found: u8,
    },
    /// The handle was released or destroyed (or never issued).
    Stale,
    /// Another call is using the handle right now.
    Busy,
    /// The table is full.
    Exhausted,
}

/// How a table's borrows announce themselves (see the module docs).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Scheme {
    /// Through the thread's hazard slot when it is free, counted otherwise; `take` and
    /// `remove` pay a heavy barrier. For handles borrowed often and consumed rarely.
    Hazard,
    /// Always counted; `take` is one compare-and-swap. For handles consumed often.
    Counted,
}

/// One thread's free cells of one table: the head of a list linked through the cells.
///
/// No destructor, so its thread-local is a plain load away (a thread-local with a
/// destructor is checked and registered on each access). The first time a thread puts
/// a cell on it, the table joins the thread's [`HOOKED`] tables, whose lists go to their
/// tables' orphans when the thread exits ([`crate::exit`]).
pub(crate) struct FreeList {
    head: Cell<u32>,
    hooked: Cell<bool>,
}

impl FreeList {
    pub(crate) const fn new() -> FreeList {
        FreeList { head: Cell::new(NO_CELL), hooked: Cell::new(false) }
    }
}

/// A table whose free list a thread can hand over.
trait HandOver {
    /// Moves this thread's free list of the table to the table's orphans.
    fn hand_over(&self);
}

/// The most tables one thread holds free lists of at once (the C API has 12).
const MAX_HOOKED: usize = 32;

thread_local! {
    /// The tables whose free lists this thread holds, handed over when it exits. No
    /// destructor: the hand-over runs from [`crate::exit`], possibly after the thread's
    /// thread-local destructors, when this must still be readable.
    static HOOKED: [Cell<Option<&'static dyn HandOver>>; MAX_HOOKED] =
        const { [const { Cell::new(None) }; MAX_HOOKED] };
}

/// Hands this thread's free list of every table it joined to the tables' orphans (the
/// thread is exiting).
pub(crate) fn hand_over_all() {
    let _ = HOOKED.try_with(|hooked| {
        for table in hooked {
            if let Some(table) = table.take() {
                table.hand_over();
            }
        }
    });
}

struct Entry<T> {
    state: AtomicU64,
    /// The next cell of the free list this cell is on (meaningless while in use).
    next_free: AtomicU32,
    value: UnsafeCell<MaybeUninit<T>>,
}

impl<T> Entry<T> {
    /// Sets LIVE on a cell this thread holds (a vacancy or a taken cell) whose value is
    /// in place: from now on its handle names the value. Returns the generation.
    #[inline(always)]
    fn publish(&self) -> u64 {
        let generation = self.state.load(Ordering::Acquire) & GENERATION_MASK;
        self.state.store(generation | LIVE, Ordering::Release);
        generation
    }
}

/// A type-stable table of `T` values named by handles of one kind.
///
/// What never changes (kind, scheme, name, the free-list key) lives here, in a value
/// without interior mutability, and the cells in a separate [`Store`]: a `static` table
/// is then a constant the compiler folds into each call (no load of the scheme, a
/// direct thread-local access instead of a call through the key).
pub(crate) struct Slots<T: 'static> {
    kind: u8,
    scheme: Scheme,
    name: &'static str,
    local: &'static LocalKey<FreeList>,
    store: &'static Store<T>,
}

/// The cells of a table, and its bookkeeping.
pub(crate) struct Store<T: 'static> {
    chunks: [AtomicPtr<Entry<T>>; CHUNKS],
    grow: Mutex<()>,
    next: AtomicU32,
    /// Heads of free lists left by exited threads.
    orphans: Mutex<Vec<u32>>,
    _values: PhantomData<T>,
}

// SAFETY: values are moved in and out of cells only by the thread that owns the cell
// at that moment (the inserting thread before it publishes `LIVE`; the thread whose
// compare-and-swap took or claimed it), and shared only as `&T` between borrowers,
// which needs `T: Sync`; a value may be dropped on another thread than it was made on,
// which needs `T: Send`.
unsafe impl<T: Send + Sync> Sync for Store<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Send for Store<T> {}

impl<T: Send + Sync + 'static> Store<T> {
    /// An empty store.
    #[cfg(not(memory_loom))]
    pub(crate) const fn new() -> Store<T> {
        Store {
            chunks: [const { AtomicPtr::new(std::ptr::null_mut()) }; CHUNKS],
            grow: Mutex::new(()),
            next: AtomicU32::new(0),
            orphans: Mutex::new(Vec::new()),
            _values: PhantomData,
        }
    }

    /// An empty store (loom's primitives have no const constructors: under loom the
    /// tables are built lazily, once per model execution).
    #[cfg(memory_loom)]
    pub(crate) fn new() -> Store<T> {
        Store {
            chunks: std::array::from_fn(|_| AtomicPtr::new(std::ptr::null_mut())),
            grow: Mutex::new(()),
            next: AtomicU32::new(0),
            orphans: Mutex::new(Vec::new()),
            _values: PhantomData,
        }
    }
}

fn generation_of(handle: u64) -> u64 {
    (handle >> 32) & GENERATION_MASK
}

impl<T: Send + Sync + 'static> Slots<T> {
    /// A table whose handles carry `kind` (non-zero) in their top byte, over `store`
    /// (which no other table may use) and the thread-local free lists `local` (one key
    /// per table).
    pub(crate) const fn new(
        kind: u8,
        scheme: Scheme,
        name: &'static str,
        local: &'static LocalKey<FreeList>,
        store: &'static Store<T>,
    ) -> Slots<T> {
        Slots { kind, scheme, name, local, store }
    }

    /// What this table's handles name ("binding", "allocation", ...).
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    #[inline(always)]
    fn entry(&self, index: u32) -> Option<&'static Entry<T>> {
        let chunk = self.store.chunks.get((index >> CHUNK_BITS) as usize)?.load(Ordering::Acquire);
        // SAFETY: a non-null chunk pointer was published (Release) after the chunk of
        // CHUNK initialised cells was built, and chunks are never freed; the offset is
        // below CHUNK.
        unsafe { chunk.wrapping_add(index as usize & (CHUNK - 1)).as_ref() }
    }

    fn ensure_chunk(&self, index: u32) -> bool {
        let Some(slot) = self.store.chunks.get((index >> CHUNK_BITS) as usize) else { return false };
        if !slot.load(Ordering::Acquire).is_null() {
            return true;
        }
        let _grow = lock(&self.store.grow);
        if slot.load(Ordering::Acquire).is_null() {
            let chunk: Box<[Entry<T>]> = (0..CHUNK)
                .map(|_| Entry {
                    state: AtomicU64::new(0),
                    next_free: AtomicU32::new(NO_CELL),
                    value: UnsafeCell::new(MaybeUninit::uninit()),
                })
                .collect();
            // Deliberately never freed: handles stay checkable for the life of the process.
            slot.store(Box::leak(chunk).as_mut_ptr(), Ordering::Release);
        }
        true
    }

    /// A free cell: this thread's list first, then an orphaned list, then a new cell.
    #[inline(always)]
    fn free_entry(&'static self) -> Option<(u32, &'static Entry<T>)> {
        let popped = self.local.try_with(|list| {
            let head = list.head.get();
            let entry = self.entry(head)?;
            list.head.set(entry.next_free.load(Ordering::Relaxed));
            Some((head, entry))
        });
        match popped {
            Ok(Some(found)) => Some(found),
            _ => self.free_entry_slow(),
        }
    }

    #[cold]
    #[inline(never)]
    fn free_entry_slow(&'static self) -> Option<(u32, &'static Entry<T>)> {
        let orphan = lock(&self.store.orphans).pop();
        if let Some(head) = orphan
            && let Some(entry) = self.entry(head)
        {
            // Adopt the rest of the orphaned list (or, while this thread exits and has
            // no list, hand it back).
            let rest = entry.next_free.load(Ordering::Relaxed);
            if rest != NO_CELL {
                let adopted = self.local.try_with(|list| {
                    let hooked = list.hooked.get() || self.hook(list);
                    if hooked {
                        list.head.set(rest);
                    }
                    hooked
                });
                if !matches!(adopted, Ok(true)) {
                    lock(&self.store.orphans).push(rest);
                }
            }
            return Some((head, entry));
        }
        let index = self.store.next.fetch_add(1, Ordering::Relaxed);
        if index >= MAX_CELLS {
            self.store.next.store(MAX_CELLS, Ordering::Relaxed);
            return None;
        }
        if !self.ensure_chunk(index) {
            return None;
        }
        Some((index, self.entry(index)?))
    }

    /// Puts a freed cell on this thread's list (the orphans' while the thread exits).
    #[inline(always)]
    fn recycle(&'static self, index: u32, entry: &Entry<T>) {
        let pushed = self.local.try_with(|list| {
            if !list.hooked.get() && !self.hook(list) {
                return false;
            }
            entry.next_free.store(list.head.get(), Ordering::Relaxed);
            list.head.set(index);
            true
        });
        if !matches!(pushed, Ok(true)) {
            entry.next_free.store(NO_CELL, Ordering::Relaxed);
            lock(&self.store.orphans).push(index);
        }
    }

    /// Joins this thread's hooked tables, so that `list` is handed over when the thread
    /// exits; `false` if the thread has exited already (keep no cell on `list` then).
    #[cold]
    #[inline(never)]
    fn hook(&'static self, list: &FreeList) -> bool {
        let joined = crate::exit::arm()
            && HOOKED
                .try_with(|hooked| match hooked.iter().find(|table| table.get().is_none()) {
                    Some(free) => {
                        free.set(Some(self as &'static dyn HandOver));
                        true
                    }
                    None => false,
                })
                .unwrap_or(false);
        list.hooked.set(joined);
        joined
    }

    #[inline]
    fn handle(&self, index: u32, generation: u64) -> u64 {
        (u64::from(self.kind) << 56) | ((generation & GENERATION_MASK) << 32) | u64::from(index)
    }

    /// The cell `handle` names and the generation it expects. Any value is safe to
    /// pass: an index beyond every chunk is stale, and a cell never used is not `LIVE`.
    #[inline(always)]
    fn decode(&self, handle: u64) -> Result<(&'static Entry<T>, u64), Fault> {
        let kind = (handle >> 56) as u8;
        if kind != self.kind {
            return Err(if handle == 0 { Fault::Null } else { Fault::WrongKind { found: kind } });
        }
        let entry = self.entry(handle as u32).ok_or(Fault::Stale)?;
        Ok((entry, generation_of(handle)))
    }

    /// Stores `value`; returns its handle, or the value back when the table is full.
    /// (The C API reserves a [`Vacancy`] before a call has any effect instead; the
    /// unit tests and the loom models store values directly.)
    #[cfg(test)]
    #[inline]
    pub(crate) fn insert(&'static self, value: T) -> Result<u64, (T, Fault)> {
        match self.vacancy() {
            Ok(vacancy) => Ok(vacancy.fill(value)),
            Err(fault) => Err((value, fault)),
        }
    }

    /// Reserves a free cell for a value still to be made; dropping the [`Vacancy`]
    /// unused puts the cell back. Reserving first lets a value that is costly to make
    /// (an allocation) be made only when it has a place, and go there in one move (a
    /// `Result` that could hand it back would stage it once more on the way).
    #[inline(always)]
    pub(crate) fn vacancy(&'static self) -> Result<Vacancy<T>, Fault> {
        match self.free_entry() {
            Some((index, entry)) => Ok(Vacancy { slots: self, entry, index }),
            None => Err(Fault::Exhausted),
        }
    }

    /// Borrows the value of `handle` for the length of a call: through this thread's
    /// hazard slot when the table uses them and the slot is free, counted otherwise.
    #[inline(always)]
    pub(crate) fn borrow(&'static self, handle: u64) -> Result<Borrow<T>, Fault> {
        let (entry, generation) = self.decode(handle)?;
        if self.scheme == Scheme::Hazard
            && let Some(hazard) = hazard::current()
            && hazard.is_free()
        {
            return self.borrow_through(hazard, entry, handle, generation);
        }
        self.borrow_counted_at(entry, handle, generation)
    }

    /// Borrows the value of `handle` with a counted borrow, whatever the table's scheme.
    #[cfg(test)]
    pub(crate) fn borrow_counted(&'static self, handle: u64) -> Result<Borrow<T>, Fault> {
        let (entry, generation) = self.decode(handle)?;
        self.borrow_counted_at(entry, handle, generation)
    }

    #[inline(always)]
    fn borrow_through(
        &'static self,
        hazard: &'static Hazard,
        entry: &'static Entry<T>,
        handle: u64,
        generation: u64,
    ) -> Result<Borrow<T>, Fault> {
        hazard.announce(handle);
        let state = entry.state.load(Ordering::Acquire);
        if state & (GENERATION_MASK | LIVE | TAKEN) == generation | LIVE {
            return Ok(Borrow { slots: self, entry, handle, hazard: Some(hazard) });
        }
        // A reclaimer may have seen the announcement and left the value to us.
        self.end_hazard_borrow(hazard, entry, handle);
        Err(if state & GENERATION_MASK != generation || state & LIVE == 0 { Fault::Stale } else { Fault::Busy })
    }

    fn borrow_counted_at(
        &'static self,
        entry: &'static Entry<T>,
        handle: u64,
        generation: u64,
    ) -> Result<Borrow<T>, Fault> {
        let mut state = entry.state.load(Ordering::Acquire);
        loop {
            if state & GENERATION_MASK != generation || state & LIVE == 0 {
                return Err(Fault::Stale);
            }
            if state & TAKEN != 0 || state & USERS_MASK == USERS_MASK {
                return Err(Fault::Busy);
            }
            match entry.state.compare_exchange_weak(state, state + USER, Ordering::Acquire, Ordering::Acquire) {
                Ok(_) => return Ok(Borrow { slots: self, entry, handle, hazard: None }),
                Err(now) => state = now,
            }
        }
    }

    /// Withdraws a hazard announcement of `handle`, then reclaims the value if the
    /// handle was removed meanwhile (a reclaimer that saw the slot left it to us).
    #[inline(always)]
    fn end_hazard_borrow(&'static self, hazard: &Hazard, entry: &'static Entry<T>, handle: u64) {
        hazard.withdraw();
        let state = entry.state.load(Ordering::Acquire);
        if state & (GENERATION_MASK | DYING) == generation_of(handle) | DYING {
            self.try_reclaim(entry, handle);
        }
    }

    /// Takes the value of `handle`: from now on only the returned [`Taken`] reaches it
    /// (its [`Taken::into_parts`] moves it out; the cell stays reserved until the
    /// [`Reservation`] frees it or puts a value back under the same handle).
    #[inline(always)]
    pub(crate) fn take(&'static self, handle: u64) -> Result<Taken<T>, Fault> {
        let (entry, generation) = self.decode(handle)?;
        let live = generation | LIVE;
        match entry.state.compare_exchange(live, live | TAKEN, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => {
                if self.scheme == Scheme::Hazard && self.hazard_borrowed(handle) {
                    // Nothing else changes a TAKEN cell's state: put LIVE back as it was.
                    entry.state.store(live, Ordering::Release);
                    return Err(Fault::Busy);
                }
                // Our compare-and-swap moved the cell from LIVE with no counted borrows
                // to TAKEN, and no hazard borrow reads it (checked above for a hazard
                // table; a counted table has none): nobody else reaches the value now.
                Ok(Taken { slots: self, entry, index: handle as u32 })
            }
            Err(state) if state & GENERATION_MASK != generation || state & LIVE == 0 => Err(Fault::Stale),
            Err(_) => Err(Fault::Busy),
        }
    }

    /// Whether a hazard borrow of `handle` is in progress, after this thread changed the
    /// handle's state (the heavy side of the Dekker point).
    #[cold]
    fn hazard_borrowed(&self, handle: u64) -> bool {
        heavy_barrier(BarrierMode::detect());
        hazard::protects(handle)
    }

    /// Removes `handle`: no borrow can start from now on, and the value is dropped now
    /// if no borrow is in progress, or by the borrow that ends last. Fails if the handle
    /// is stale or taken.
    pub(crate) fn remove(&'static self, handle: u64) -> Result<(), Fault> {
        let (entry, generation) = self.decode(handle)?;
        let mut state = entry.state.load(Ordering::Acquire);
        loop {
            if state & GENERATION_MASK != generation || state & LIVE == 0 {
                return Err(Fault::Stale);
            }
            if state & TAKEN != 0 {
                return Err(Fault::Busy);
            }
            let dying = (state & !LIVE) | DYING;
            match entry.state.compare_exchange_weak(state, dying, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) => state = now,
            }
        }
        self.try_reclaim(entry, handle);
        Ok(())
    }

    /// Drops the value of a removed (`DYING`) handle if no borrow can read it any more;
    /// otherwise leaves it to the borrow still in progress, which calls this again when
    /// it ends. Any number of threads may call it at once: one claims the value.
    #[cold]
    #[inline(never)]
    fn try_reclaim(&'static self, entry: &'static Entry<T>, handle: u64) {
        let generation = generation_of(handle);
        let dying = generation | DYING;
        if self.scheme == Scheme::Hazard {
            // A read-modify-write (rewriting the state as it is), not a load: the heavy
            // barrier below orders this thread's own write of the state before its reads
            // of the slots, so a borrower that announces after them sees DYING. It
            // fails (and writes nothing) unless the cell is DYING with no counted users.
            let still_dying = entry.state.compare_exchange(dying, dying, Ordering::AcqRel, Ordering::Acquire);
            if still_dying.is_err() || self.hazard_borrowed(handle) {
                // Claimed already, reused, or still counted (its last user reclaims);
                // or a hazard borrower holds it (and reclaims when it ends).
                return;
            }
        }
        if entry.state.compare_exchange(dying, generation | TAKEN, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            // Another claimant won, or counted borrows remain.
            return;
        }
        // SAFETY: our compare-and-swap moved the cell from DYING with no counted borrows
        // to claimed (TAKEN without LIVE), which happens once per generation; no hazard
        // borrow reads it (checked above); LIVE is clear, so no new borrow or take can
        // start; the value is initialised and is moved out exactly once, here.
        let value = unsafe { entry.value.get().cast::<T>().read() };
        self.release_cell(entry, handle as u32);
        drop(value);
    }

    /// Frees a cell whose value is gone: the next generation, back on a free list
    /// unless the generation would wrap (then the cell is retired).
    #[inline(always)]
    fn release_cell(&'static self, entry: &'static Entry<T>, index: u32) {
        let generation = entry.state.load(Ordering::Relaxed) & GENERATION_MASK;
        let next = (generation + 1) & GENERATION_MASK;
        entry.state.store(next, Ordering::Release);
        if next != 0 {
            self.recycle(index, entry);
        }
    }
}

impl<T: Send + Sync + 'static> HandOver for Slots<T> {
    fn hand_over(&self) {
        let head = self.local.try_with(|list| {
            list.hooked.set(false);
            list.head.replace(NO_CELL)
        });
        if let Ok(head) = head
            && head != NO_CELL
        {
            lock(&self.store.orphans).push(head);
        }
    }
}

/// A value borrowed for the length of one call.
pub(crate) struct Borrow<T: Send + Sync + 'static> {
    slots: &'static Slots<T>,
    entry: &'static Entry<T>,
    handle: u64,
    /// The hazard slot announcing the borrow, or `None` for a counted borrow.
    hazard: Option<&'static Hazard>,
}

impl<T: Send + Sync + 'static> std::ops::Deref for Borrow<T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: while this borrow is announced (a hazard slot holding the handle after
        // a state read that found it LIVE, or a count in the state word) the value is
        // neither taken nor reclaimed (see the module docs); it was initialised before
        // LIVE was published.
        unsafe { &*self.entry.value.get().cast::<T>() }
    }
}

impl<T: Send + Sync + 'static> Drop for Borrow<T> {
    #[inline]
    fn drop(&mut self) {
        match self.hazard {
            Some(hazard) => self.slots.end_hazard_borrow(hazard, self.entry, self.handle),
            None => {
                let before = self.entry.state.fetch_sub(USER, Ordering::AcqRel);
                if before & DYING != 0 && before & USERS_MASK == USER {
                    // The last counted borrow of a removed handle.
                    self.slots.try_reclaim(self.entry, self.handle);
                }
            }
        }
    }
}

/// A free cell reserved for a value; back on the free list if dropped unfilled.
pub(crate) struct Vacancy<T: Send + Sync + 'static> {
    slots: &'static Slots<T>,
    entry: &'static Entry<T>,
    index: u32,
}

impl<T: Send + Sync + 'static> Vacancy<T> {
    /// Stores `value` in the cell; returns its handle.
    #[inline(always)]
    pub(crate) fn fill(self, value: T) -> u64 {
        self.write(value).publish()
    }

    /// Makes the value in the cell itself: stores `empty`, lets `make` finish it in
    /// place, and returns the handle if `make` succeeds. On error (or a panic) the
    /// value is dropped where it lies and the cell goes back to the free list.
    /// For a large value made by a call that can fail (an allocation): it is written
    /// once, where it will live, not staged through a `Result`.
    #[inline(always)]
    pub(crate) fn fill_in_place<E>(self, empty: T, make: impl FnOnce(&mut T) -> Result<(), E>) -> Result<u64, E> {
        let mut written = self.write(empty);
        make(written.value_mut())?;
        Ok(written.publish())
    }

    #[inline(always)]
    fn write(self, value: T) -> Unpublished<T> {
        // SAFETY: the cell came off a free list (or was never used): no handle names its
        // current generation with LIVE set, so nothing else reads or writes the value.
        unsafe { self.entry.value.get().cast::<T>().write(value) };
        Unpublished { vacancy: ManuallyDrop::new(self) }
    }
}

/// A vacancy whose cell holds a value no handle names yet. Dropped unpublished, it
/// drops the value in place and puts the cell back.
struct Unpublished<T: Send + Sync + 'static> {
    vacancy: ManuallyDrop<Vacancy<T>>,
}

impl<T: Send + Sync + 'static> Unpublished<T> {
    #[inline(always)]
    fn value_mut(&mut self) -> &mut T {
        // SAFETY: written by `Vacancy::write`; only this thread reaches the cell until
        // `publish` sets LIVE.
        unsafe { &mut *self.vacancy.entry.value.get().cast::<T>() }
    }

    /// Sets LIVE: the value is the handle's from now on.
    #[inline(always)]
    fn publish(self) -> u64 {
        let this = ManuallyDrop::new(self);
        let generation = this.vacancy.entry.publish();
        this.vacancy.slots.handle(this.vacancy.index, generation)
    }
}

impl<T: Send + Sync + 'static> Drop for Unpublished<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; `self.vacancy` is not used again.
        let vacancy = unsafe { ManuallyDrop::take(&mut self.vacancy) };
        // SAFETY: the value was written and never published: it is ours to drop, once.
        // `vacancy` recycles the cell after it, even if the value's drop panics.
        unsafe { vacancy.entry.value.get().cast::<T>().drop_in_place() };
        drop(vacancy);
    }
}

impl<T: Send + Sync + 'static> Drop for Vacancy<T> {
    fn drop(&mut self) {
        self.slots.recycle(self.index, self.entry);
    }
}

/// A taken cell whose value is still in place (so that it moves once, straight to
/// where the caller consumes it). Dropped unused, it drops the value and frees the cell.
pub(crate) struct Taken<T: Send + Sync + 'static> {
    slots: &'static Slots<T>,
    entry: &'static Entry<T>,
    index: u32,
}

impl<T: Send + Sync + 'static> Taken<T> {
    /// The value, where it lies (for a call that consumes it in place).
    #[inline(always)]
    pub(crate) fn value_mut(&mut self) -> &mut T {
        // SAFETY: the cell is TAKEN by us (see `Slots::take`): nobody else reads or
        // writes its value, which was written before LIVE was published (read with
        // Acquire by the taking compare-and-swap).
        unsafe { &mut *self.entry.value.get().cast::<T>() }
    }

    /// Drops the value in place and frees the handle: it is stale from now on.
    #[inline(always)]
    pub(crate) fn free(self) {
        let this = ManuallyDrop::new(self);
        // Frees the cell after the value's drop, even if that drop panics.
        let reservation = Reservation { slots: this.slots, entry: this.entry, index: this.index };
        // SAFETY: the cell is TAKEN by us and holds a value; `ManuallyDrop` keeps
        // `Drop` from dropping it a second time.
        unsafe { this.entry.value.get().cast::<T>().drop_in_place() };
        reservation.free();
    }

    /// Puts the handle back live with its value as it now is (an operation refused
    /// without effect).
    #[inline(always)]
    pub(crate) fn restore(self) {
        ManuallyDrop::new(self).entry.publish();
    }

    /// The value, and the reservation of its cell.
    #[inline(always)]
    pub(crate) fn into_parts(self) -> (T, Reservation<T>) {
        let this = ManuallyDrop::new(self);
        // SAFETY: the cell is TAKEN by us (see `Slots::take`): nobody else reads or
        // writes its value, which was written before LIVE was published (read with
        // Acquire by the taking compare-and-swap); `ManuallyDrop` makes this the one move.
        let value = unsafe { this.entry.value.get().cast::<T>().read() };
        (value, Reservation { slots: this.slots, entry: this.entry, index: this.index })
    }
}

impl<T: Send + Sync + 'static> Drop for Taken<T> {
    fn drop(&mut self) {
        let (value, reservation) = Taken { slots: self.slots, entry: self.entry, index: self.index }.into_parts();
        reservation.free();
        drop(value);
    }
}

/// A cell whose value was taken out; its handle is reserved until this is consumed
/// (or dropped, which frees it, as on a panic between take and free).
pub(crate) struct Reservation<T: Send + Sync + 'static> {
    slots: &'static Slots<T>,
    entry: &'static Entry<T>,
    index: u32,
}

impl<T: Send + Sync + 'static> Reservation<T> {
    /// Frees the handle: it is stale from now on.
    #[inline(always)]
    pub(crate) fn free(self) {
        // Consumed here, not by `Drop` (whose call would keep the table in memory
        // rather than a constant the compiler folds).
        let this = ManuallyDrop::new(self);
        this.slots.release_cell(this.entry, this.index);
    }

    /// Puts `value` back under the same handle (an operation refused without effect).
    pub(crate) fn restore(self, value: T) {
        let this = ManuallyDrop::new(self);
        // SAFETY: the cell is TAKEN by us: nobody else reads or writes its value.
        unsafe { this.entry.value.get().cast::<T>().write(value) };
        this.entry.publish();
    }
}

impl<T: Send + Sync + 'static> Drop for Reservation<T> {
    fn drop(&mut self) {
        self.slots.release_cell(self.entry, self.index);
    }
}

/// The handle number behind a pointer-typed handle (never dereferenced).
#[inline]
pub(crate) fn number<P>(handle: *const P) -> u64 {
    handle.addr() as u64
}

/// A pointer-typed handle for C (never dereferenced by anyone).
#[inline]
pub(crate) fn pointer<P>(handle: u64) -> *mut P {
    std::ptr::without_provenance_mut(handle as usize)
}

const _: () = assert!(std::mem::size_of::<usize>() == 8, "handles need 64-bit pointers");

#[cfg(all(test, memory_loom))]
#[path = "loom_handles.rs"]
mod loom_handles;

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    std::thread_local! {
        static FREE: FreeList = const { FreeList::new() };
        static FREE_HAZARD: FreeList = const { FreeList::new() };
        static FREE_OTHER: FreeList = const { FreeList::new() };
        static FREE_ADOPT: FreeList = const { FreeList::new() };
        static FREE_PANICKY: FreeList = const { FreeList::new() };
    }
    static TABLE: Slots<Arc<AtomicUsize>> = Slots::new(0x71, Scheme::Counted, "test", &FREE, &TABLE_CELLS);
    static TABLE_CELLS: Store<Arc<AtomicUsize>> = Store::new();
    static HAZARD_TABLE: Slots<Arc<AtomicUsize>> =
        Slots::new(0x73, Scheme::Hazard, "hazard test", &FREE_HAZARD, &HAZARD_CELLS);
    static HAZARD_CELLS: Store<Arc<AtomicUsize>> = Store::new();
    static OTHER: Slots<u32> = Slots::new(0x72, Scheme::Counted, "other", &FREE_OTHER, &OTHER_CELLS);
    static OTHER_CELLS: Store<u32> = Store::new();
    /// Used by one test only, so no other test adopts its orphaned cells.
    static ADOPT: Slots<Arc<AtomicUsize>> = Slots::new(0x74, Scheme::Hazard, "adopt test", &FREE_ADOPT, &ADOPT_CELLS);
    static ADOPT_CELLS: Store<Arc<AtomicUsize>> = Store::new();
    static PANICKY: Slots<PanicOnDrop> = Slots::new(0x75, Scheme::Counted, "panicky", &FREE_PANICKY, &PANICKY_CELLS);
    static PANICKY_CELLS: Store<PanicOnDrop> = Store::new();

    /// Panics when dropped with its flag set.
    #[derive(Debug)]
    struct PanicOnDrop(bool);

    impl Drop for PanicOnDrop {
        fn drop(&mut self) {
            assert!(!self.0, "a value whose drop panics");
        }
    }

    #[test]
    fn released_handles_are_stale_and_never_validate_again() {
        for table in [&TABLE, &HAZARD_TABLE] {
            let drops = Arc::new(AtomicUsize::new(0));
            let handle = table.insert(Arc::clone(&drops)).unwrap();
            assert_eq!(table.borrow(handle).unwrap().load(Ordering::Relaxed), 0);
            let (value, reservation) = table.take(handle).unwrap().into_parts();
            reservation.free();
            drop(value);
            assert!(matches!(table.take(handle), Err(Fault::Stale)));
            assert!(matches!(table.borrow(handle), Err(Fault::Stale)));
            // The cell is reused under a new generation; the old handle stays stale.
            let again = table.insert(drops).unwrap();
            assert_ne!(again, handle);
            assert_eq!(again as u32, handle as u32, "same cell");
            assert!(matches!(table.borrow(handle), Err(Fault::Stale)));
            assert_eq!(table.remove(handle), Err(Fault::Stale));
            table.remove(again).unwrap();
        }
    }

    #[test]
    fn null_foreign_and_made_up_handles_are_faults() {
        assert_eq!(TABLE.borrow(0).err(), Some(Fault::Null));
        let other = OTHER.insert(7).unwrap();
        assert_eq!(TABLE.borrow(other).err(), Some(Fault::WrongKind { found: 0x72 }));
        assert_eq!(TABLE.borrow(0x7fff_dead_beef).err(), Some(Fault::WrongKind { found: 0 }));
        assert_eq!(TABLE.borrow((0x71 << 56) | 0xffff_fff0).err(), Some(Fault::Stale));
        // A cell of an existing chunk that was never handed out is not live.
        assert_eq!(HAZARD_TABLE.borrow((0x73 << 56) | (5 << 32) | 1000).err(), Some(Fault::Stale));
        assert_eq!(HAZARD_TABLE.remove((0x73 << 56) | 1000).err(), Some(Fault::Stale));
        assert!(hazard::current().unwrap().is_free(), "a failed borrow withdraws its announcement");
        OTHER.remove(other).unwrap();
    }

    #[test]
    fn a_restored_value_keeps_its_handle_and_a_borrowed_one_cannot_be_taken() {
        for table in [&TABLE, &HAZARD_TABLE] {
            let handle = table.insert(Arc::new(AtomicUsize::new(5))).unwrap();
            let (value, reservation) = table.take(handle).unwrap().into_parts();
            assert_eq!(table.borrow(handle).err(), Some(Fault::Busy));
            assert!(hazard::current().unwrap().is_free());
            reservation.restore(value);
            let borrowed = table.borrow(handle).unwrap();
            assert_eq!(table.take(handle).err(), Some(Fault::Busy));
            drop(borrowed);
            table.remove(handle).unwrap();
        }
    }

    #[test]
    fn a_hazard_borrow_on_another_thread_blocks_a_take_until_it_ends() {
        let value = Arc::new(AtomicUsize::new(1));
        let handle = HAZARD_TABLE.insert(Arc::clone(&value)).unwrap();
        let (borrowed_tx, borrowed_rx) = std::sync::mpsc::channel();
        let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|scope| {
            scope.spawn(move || {
                let borrowed = HAZARD_TABLE.borrow(handle).unwrap();
                borrowed_tx.send(()).unwrap();
                end_rx.recv().unwrap();
                drop(borrowed);
            });
            borrowed_rx.recv().unwrap();
            assert_eq!(HAZARD_TABLE.take(handle).err(), Some(Fault::Busy), "the other thread reads it");
            // The refused take left the handle as it was.
            assert_eq!(HAZARD_TABLE.borrow(handle).unwrap().load(Ordering::Relaxed), 1);
            end_tx.send(()).unwrap();
        });
        let (taken, reservation) = HAZARD_TABLE.take(handle).unwrap().into_parts();
        reservation.free();
        assert!(Arc::ptr_eq(&taken, &value));
    }

    #[test]
    fn a_nested_borrow_is_counted_and_the_slot_is_free_again_after_both() {
        let outer = HAZARD_TABLE.insert(Arc::new(AtomicUsize::new(1))).unwrap();
        let inner = HAZARD_TABLE.insert(Arc::new(AtomicUsize::new(2))).unwrap();
        let first = HAZARD_TABLE.borrow(outer).unwrap();
        assert!(first.hazard.is_some(), "the first borrow uses the slot");
        let second = HAZARD_TABLE.borrow(inner).unwrap();
        assert!(second.hazard.is_none(), "the slot is busy: counted");
        let again = HAZARD_TABLE.borrow(outer).unwrap();
        assert!(again.hazard.is_none());
        drop((second, again, first));
        assert!(hazard::current().unwrap().is_free());
        assert!(HAZARD_TABLE.borrow(inner).unwrap().hazard.is_some());
        HAZARD_TABLE.remove(outer).unwrap();
        HAZARD_TABLE.remove(inner).unwrap();
    }

    #[test]
    fn removing_a_borrowed_handle_drops_the_value_with_the_last_borrow() {
        for table in [&TABLE, &HAZARD_TABLE] {
            let counter = Arc::new(AtomicUsize::new(0));
            let handle = table.insert(Arc::clone(&counter)).unwrap();
            let hazard_borrow = table.borrow(handle).unwrap();
            let counted_borrow = table.borrow_counted(handle).unwrap();
            table.remove(handle).unwrap();
            assert_eq!(table.borrow(handle).err(), Some(Fault::Stale));
            assert_eq!(table.remove(handle).err(), Some(Fault::Stale), "removed once");
            assert_eq!(Arc::strong_count(&counter), 2, "deferred to the last borrow");
            drop(counted_borrow);
            assert_eq!(Arc::strong_count(&counter), 2, "a borrow still reads it");
            drop(hazard_borrow);
            assert_eq!(Arc::strong_count(&counter), 1);
        }
    }

    #[test]
    fn an_unfilled_vacancy_and_an_unused_take_give_their_cells_back() {
        let vacancy = TABLE.vacancy().unwrap();
        let index = vacancy.index;
        drop(vacancy);
        let value = Arc::new(AtomicUsize::new(0));
        let handle = TABLE.insert(Arc::clone(&value)).unwrap();
        assert_eq!(handle as u32, index, "the cell went back on this thread's list");
        drop(TABLE.take(handle).unwrap());
        assert_eq!(Arc::strong_count(&value), 1, "an unused take drops the value");
        assert_eq!(TABLE.borrow(handle).err(), Some(Fault::Stale));
        assert_eq!(TABLE.insert(value).unwrap() as u32, index, "and frees the cell");
    }

    #[test]
    fn a_value_made_in_place_is_published_only_if_making_it_succeeds() {
        let made = Arc::new(AtomicUsize::new(0));
        let handle = TABLE
            .vacancy()
            .unwrap()
            .fill_in_place(Arc::new(AtomicUsize::new(0)), |value| {
                *value = Arc::clone(&made);
                Ok::<(), ()>(())
            })
            .unwrap();
        assert!(Arc::ptr_eq(&TABLE.borrow(handle).unwrap(), &made), "the handle names the finished value");
        TABLE.remove(handle).unwrap();

        // A failed make drops the value where it lies and frees the cell unpublished.
        let dropped = Arc::new(AtomicUsize::new(0));
        let vacancy = TABLE.vacancy().unwrap();
        let index = vacancy.index;
        let failed = vacancy.fill_in_place(Arc::clone(&dropped), |value| {
            value.store(9, Ordering::Relaxed);
            Err("refused")
        });
        assert_eq!(failed, Err("refused"));
        assert_eq!(dropped.load(Ordering::Relaxed), 9, "make ran on the value in the cell");
        assert_eq!(Arc::strong_count(&dropped), 1, "the unpublished value was dropped");
        let reused = TABLE.insert(dropped).unwrap();
        assert_eq!(reused as u32, index, "the cell went back on this thread's list");
        TABLE.remove(reused).unwrap();
    }

    #[test]
    fn a_taken_value_changed_in_place_is_restored_or_freed_as_it_now_is() {
        for table in [&TABLE, &HAZARD_TABLE] {
            let first = Arc::new(AtomicUsize::new(1));
            let handle = table.insert(Arc::clone(&first)).unwrap();
            let mut taken = table.take(handle).unwrap();
            assert_eq!(table.borrow(handle).err(), Some(Fault::Busy));
            let second = Arc::new(AtomicUsize::new(2));
            *taken.value_mut() = Arc::clone(&second);
            assert_eq!(Arc::strong_count(&first), 1, "the replaced value was dropped");
            taken.restore();
            assert!(Arc::ptr_eq(&table.borrow(handle).unwrap(), &second), "restored under its handle");

            table.take(handle).unwrap().free();
            assert_eq!(Arc::strong_count(&second), 1, "free drops the value in place");
            assert_eq!(table.borrow(handle).err(), Some(Fault::Stale));
            assert_eq!(table.take(handle).err(), Some(Fault::Stale));
        }
    }

    #[test]
    fn a_value_whose_drop_panics_still_gives_its_cell_back() {
        use std::panic::{AssertUnwindSafe, catch_unwind};
        // Unpublished: the failed make's value panics as it is dropped in place.
        let vacancy = PANICKY.vacancy().unwrap();
        let index = vacancy.index;
        let unwound = catch_unwind(AssertUnwindSafe(|| {
            let _ = vacancy.fill_in_place(PanicOnDrop(false), |value| {
                value.0 = true;
                Err(())
            });
        }));
        assert!(unwound.is_err());
        let handle = PANICKY.insert(PanicOnDrop(false)).unwrap();
        assert_eq!(handle as u32, index, "the cell went back on this thread's list");

        // Taken::free: the handle is stale, not stuck taken, and the cell is reused.
        let mut taken = PANICKY.take(handle).unwrap();
        taken.value_mut().0 = true;
        assert!(catch_unwind(AssertUnwindSafe(|| taken.free())).is_err());
        assert_eq!(PANICKY.borrow(handle).err(), Some(Fault::Stale));
        let again = PANICKY.insert(PanicOnDrop(false)).unwrap();
        assert_eq!(again as u32, index);
        PANICKY.remove(again).unwrap();
    }

    #[test]
    fn racing_takes_succeed_exactly_once() {
        for table in [&TABLE, &HAZARD_TABLE] {
            for _ in 0..100 {
                let handle = table.insert(Arc::new(AtomicUsize::new(0))).unwrap();
                let wins = AtomicUsize::new(0);
                std::thread::scope(|scope| {
                    for _ in 0..4 {
                        scope.spawn(|| {
                            if let Ok((value, reservation)) = table.take(handle).map(Taken::into_parts) {
                                wins.fetch_add(1, Ordering::Relaxed);
                                reservation.free();
                                drop(value);
                            }
                        });
                    }
                });
                assert_eq!(wins.load(Ordering::Relaxed), 1);
            }
        }
    }

    #[test]
    fn an_exited_threads_free_cells_are_adopted_and_its_hazard_slot_reused() {
        let handles: Vec<u64> = std::thread::spawn(|| {
            let handles: Vec<u64> = (0..8).map(|_| ADOPT.insert(Arc::new(AtomicUsize::new(0))).unwrap()).collect();
            for &handle in &handles {
                assert!(ADOPT.borrow(handle).unwrap().hazard.is_some());
                ADOPT.remove(handle).unwrap();
            }
            handles
        })
        .join()
        .unwrap();
        // Another thread gets the exited one's cells before any new one.
        let reused: Vec<u64> =
            std::thread::spawn(|| (0..8).map(|_| ADOPT.insert(Arc::new(AtomicUsize::new(0))).unwrap()).collect())
                .join()
                .unwrap();
        let freed: std::collections::BTreeSet<u32> = handles.iter().map(|&h| h as u32).collect();
        assert!(reused.iter().any(|&h| freed.contains(&(h as u32))), "{handles:x?} vs {reused:x?}");
        for handle in reused {
            ADOPT.remove(handle).unwrap();
        }
    }
}
