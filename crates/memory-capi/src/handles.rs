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
//! Each cell has one atomic word: generation (low 32 bits), a count of borrows in
//! progress, and `LIVE` / `TAKEN` / `DYING` bits. Borrowing (a call using the handle)
//! increments the count with a compare-and-swap that also checks generation and
//! `LIVE`; taking (a call consuming the handle: release, destroy) moves a cell with no
//! borrows from `LIVE` to `TAKEN` with one compare-and-swap, so of two racing releases
//! exactly one wins and the other gets `Stale` or `Busy`. Removing a handle that is
//! still borrowed clears `LIVE` and sets `DYING`: new borrows fail at once and the
//! last borrow drops the value. Values are dropped outside any lock.
//!
//! Free cells go to a per-thread list (no shared write on the hot path); a thread's
//! list goes to a shared orphan list when the thread ends.

use std::cell::{RefCell, UnsafeCell};
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::thread::LocalKey;

const CHUNK_BITS: u32 = 10;
const CHUNK: usize = 1 << CHUNK_BITS;
const CHUNKS: usize = 1 << 14;
/// The most cells one table can hold.
pub(crate) const MAX_CELLS: u32 = (CHUNK * CHUNKS) as u32;

const GENERATION_MASK: u64 = 0x00ff_ffff;
const USER: u64 = 1 << 32;
const USERS_MASK: u64 = ((1 << 29) - 1) << 32;
const LIVE: u64 = 1 << 61;
const TAKEN: u64 = 1 << 62;
const DYING: u64 = 1 << 63;

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

/// A free list of one table on one thread; handed to the table's orphans at thread exit.
pub(crate) struct FreeList {
    cells: Vec<u32>,
    orphans: Option<&'static Mutex<Vec<u32>>>,
}

impl FreeList {
    pub(crate) const fn new() -> FreeList {
        FreeList { cells: Vec::new(), orphans: None }
    }
}

impl Drop for FreeList {
    fn drop(&mut self) {
        if let Some(orphans) = self.orphans
            && !self.cells.is_empty()
        {
            orphans.lock().unwrap_or_else(PoisonError::into_inner).append(&mut self.cells);
        }
    }
}

struct Cell<T> {
    state: AtomicU64,
    value: UnsafeCell<MaybeUninit<T>>,
}

/// A type-stable table of `T` values named by handles of one kind.
pub(crate) struct Slots<T: 'static> {
    kind: u8,
    name: &'static str,
    chunks: [AtomicPtr<Cell<T>>; CHUNKS],
    grow: Mutex<()>,
    next: AtomicU32,
    orphans: Mutex<Vec<u32>>,
    local: &'static LocalKey<RefCell<FreeList>>,
    _values: PhantomData<T>,
}

// SAFETY: values are moved in and out of cells only by the thread that owns the cell
// at that moment (the inserting thread before it publishes `LIVE`; the thread whose
// compare-and-swap took it), and shared only as `&T` between borrowers, which needs
// `T: Sync`; a value may be dropped on another thread than it was made on, which needs
// `T: Send`.
unsafe impl<T: Send + Sync> Sync for Slots<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Send for Slots<T> {}

impl<T: Send + Sync + 'static> Slots<T> {
    /// An empty table whose handles carry `kind` (non-zero) in their top byte.
    pub(crate) const fn new(kind: u8, name: &'static str, local: &'static LocalKey<RefCell<FreeList>>) -> Slots<T> {
        Slots {
            kind,
            name,
            chunks: [const { AtomicPtr::new(std::ptr::null_mut()) }; CHUNKS],
            grow: Mutex::new(()),
            next: AtomicU32::new(0),
            orphans: Mutex::new(Vec::new()),
            local,
            _values: PhantomData,
        }
    }

    /// What this table's handles name ("binding", "allocation", ...).
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    fn cell(&self, index: u32) -> Option<&Cell<T>> {
        let chunk = self.chunks.get((index >> CHUNK_BITS) as usize)?.load(Ordering::Acquire);
        if chunk.is_null() {
            return None;
        }
        // SAFETY: a non-null chunk pointer was published (Release) after the chunk of
        // CHUNK initialised cells was built, and chunks are never freed; the offset is
        // below CHUNK.
        Some(unsafe { &*chunk.wrapping_add(index as usize & (CHUNK - 1)) })
    }

    fn ensure_chunk(&self, index: u32) -> bool {
        let Some(slot) = self.chunks.get((index >> CHUNK_BITS) as usize) else { return false };
        if !slot.load(Ordering::Acquire).is_null() {
            return true;
        }
        let _grow = self.grow.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.load(Ordering::Acquire).is_null() {
            let chunk: Box<[Cell<T>]> = (0..CHUNK)
                .map(|_| Cell { state: AtomicU64::new(0), value: UnsafeCell::new(MaybeUninit::uninit()) })
                .collect();
            // Deliberately never freed: handles stay checkable for the life of the process.
            slot.store(Box::leak(chunk).as_mut_ptr(), Ordering::Release);
        }
        true
    }

    fn free_cell(&'static self) -> Option<u32> {
        // A call from a thread's TLS destructors finds its list gone: the shared one serves.
        let local = self.local.try_with(|list| list.borrow_mut().cells.pop()).ok().flatten();
        if local.is_some() {
            return local;
        }
        let orphan = self.orphans.lock().unwrap_or_else(PoisonError::into_inner).pop();
        if orphan.is_some() {
            return orphan;
        }
        let index = self.next.fetch_add(1, Ordering::Relaxed);
        if index >= MAX_CELLS {
            self.next.store(MAX_CELLS, Ordering::Relaxed);
            return None;
        }
        self.ensure_chunk(index).then_some(index)
    }

    fn recycle(&'static self, index: u32) {
        let pushed = self.local.try_with(|list| {
            let mut list = list.borrow_mut();
            list.orphans.get_or_insert(&self.orphans);
            list.cells.push(index);
        });
        if pushed.is_err() {
            // This thread is exiting: its list is gone, the shared one takes the cell.
            self.orphans.lock().unwrap_or_else(PoisonError::into_inner).push(index);
        }
    }

    fn handle(&self, index: u32, generation: u64) -> u64 {
        (u64::from(self.kind) << 56) | ((generation & GENERATION_MASK) << 32) | u64::from(index)
    }

    fn decode(&self, handle: u64) -> Result<(&Cell<T>, u64), Fault> {
        if handle == 0 {
            return Err(Fault::Null);
        }
        let kind = (handle >> 56) as u8;
        if kind != self.kind {
            return Err(Fault::WrongKind { found: kind });
        }
        let index = handle as u32;
        if index >= self.next.load(Ordering::Acquire).min(MAX_CELLS) {
            return Err(Fault::Stale);
        }
        let cell = self.cell(index).ok_or(Fault::Stale)?;
        Ok((cell, (handle >> 32) & GENERATION_MASK))
    }

    /// Stores `value`; returns its handle, or the value back when the table is full.
    pub(crate) fn insert(&'static self, value: T) -> Result<u64, (T, Fault)> {
        let Some(index) = self.free_cell() else { return Err((value, Fault::Exhausted)) };
        let Some(cell) = self.cell(index) else { return Err((value, Fault::Exhausted)) };
        let generation = cell.state.load(Ordering::Acquire) & GENERATION_MASK;
        // SAFETY: the cell came off a free list (or was never used): no handle names its
        // current generation with LIVE set, so nothing else reads or writes the value.
        unsafe { cell.value.get().cast::<T>().write(value) };
        cell.state.store(generation | LIVE, Ordering::Release);
        Ok(self.handle(index, generation))
    }

    /// Borrows the value of `handle` for the length of a call.
    pub(crate) fn borrow(&'static self, handle: u64) -> Result<Borrow<T>, Fault> {
        let (cell, generation) = self.decode(handle)?;
        let mut state = cell.state.load(Ordering::Acquire);
        loop {
            if state & GENERATION_MASK != generation || state & LIVE == 0 {
                return Err(Fault::Stale);
            }
            if state & TAKEN != 0 || state & USERS_MASK == USERS_MASK {
                return Err(Fault::Busy);
            }
            match cell.state.compare_exchange_weak(state, state + USER, Ordering::Acquire, Ordering::Acquire) {
                Ok(_) => return Ok(Borrow { slots: self, cell, index: handle as u32 }),
                Err(now) => state = now,
            }
        }
    }

    /// Takes the value of `handle` out; the cell stays reserved until the returned
    /// [`Reservation`] frees it or puts a value back under the same handle.
    pub(crate) fn take(&'static self, handle: u64) -> Result<(T, Reservation<T>), Fault> {
        let (cell, generation) = self.decode(handle)?;
        let live = generation | LIVE;
        match cell.state.compare_exchange(live, live | TAKEN, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => {
                // SAFETY: our compare-and-swap moved the cell from LIVE with no borrows
                // to TAKEN, so nobody else reads the value and nobody can take it again;
                // the value was written before LIVE was published (Acquire above).
                let value = unsafe { cell.value.get().cast::<T>().read() };
                Ok((value, Reservation { slots: self, cell, index: handle as u32, done: false }))
            }
            Err(state) if state & GENERATION_MASK != generation || state & LIVE == 0 => Err(Fault::Stale),
            Err(_) => Err(Fault::Busy),
        }
    }

    /// Removes `handle`: returns its value now, or `None` when calls still borrow it
    /// (then the last of them drops the value). Fails if the handle is stale or taken.
    pub(crate) fn remove(&'static self, handle: u64) -> Result<Option<T>, Fault> {
        let (cell, generation) = self.decode(handle)?;
        let mut state = cell.state.load(Ordering::Acquire);
        loop {
            if state & GENERATION_MASK != generation || state & LIVE == 0 {
                return Err(Fault::Stale);
            }
            if state & TAKEN != 0 {
                return Err(Fault::Busy);
            }
            if state & USERS_MASK == 0 {
                return match self.take(handle) {
                    Ok((value, reservation)) => {
                        reservation.free();
                        Ok(Some(value))
                    }
                    Err(Fault::Busy) => {
                        state = cell.state.load(Ordering::Acquire);
                        continue;
                    }
                    Err(fault) => Err(fault),
                };
            }
            let dying = (state & !LIVE) | DYING;
            match cell.state.compare_exchange_weak(state, dying, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(None),
                Err(now) => state = now,
            }
        }
    }

    /// Frees a cell whose value is gone: the next generation, back on a free list
    /// unless the generation would wrap (then the cell is retired).
    fn release_cell(&'static self, cell: &Cell<T>, index: u32) {
        let generation = cell.state.load(Ordering::Relaxed) & GENERATION_MASK;
        let next = (generation + 1) & GENERATION_MASK;
        cell.state.store(next, Ordering::Release);
        if next != 0 {
            self.recycle(index);
        }
    }
}

/// A value borrowed for the length of one call.
pub(crate) struct Borrow<T: Send + Sync + 'static> {
    slots: &'static Slots<T>,
    cell: &'static Cell<T>,
    index: u32,
}

impl<T: Send + Sync + 'static> std::ops::Deref for Borrow<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: while this borrow counts in the state word the cell cannot be taken
        // (take needs zero borrows) and a removal only marks it DYING; the value was
        // initialised before LIVE was published.
        unsafe { &*self.cell.value.get().cast::<T>() }
    }
}

impl<T: Send + Sync + 'static> Drop for Borrow<T> {
    fn drop(&mut self) {
        let before = self.cell.state.fetch_sub(USER, Ordering::AcqRel);
        if before & DYING != 0 && before & USERS_MASK == USER {
            // The last borrow of a removed handle: no one else can reach the value.
            // SAFETY: DYING with no other borrow left; LIVE is clear, so no new borrow
            // or take can start; the value is initialised and dropped exactly once here.
            let value = unsafe { self.cell.value.get().cast::<T>().read() };
            self.slots.release_cell(self.cell, self.index);
            drop(value);
        }
    }
}

/// A cell whose value was taken out; its handle is reserved until this is consumed.
pub(crate) struct Reservation<T: Send + Sync + 'static> {
    slots: &'static Slots<T>,
    cell: &'static Cell<T>,
    index: u32,
    done: bool,
}

impl<T: Send + Sync + 'static> Reservation<T> {
    /// Frees the handle: it is stale from now on.
    pub(crate) fn free(mut self) {
        self.done = true;
        self.slots.release_cell(self.cell, self.index);
    }

    /// Puts `value` back under the same handle (an operation refused without effect).
    pub(crate) fn restore(mut self, value: T) {
        self.done = true;
        // SAFETY: the cell is TAKEN by us: nobody else reads or writes its value.
        unsafe { self.cell.value.get().cast::<T>().write(value) };
        let generation = self.cell.state.load(Ordering::Relaxed) & GENERATION_MASK;
        self.cell.state.store(generation | LIVE, Ordering::Release);
    }
}

impl<T: Send + Sync + 'static> Drop for Reservation<T> {
    fn drop(&mut self) {
        if !self.done {
            self.slots.release_cell(self.cell, self.index);
        }
    }
}

/// The handle number behind a pointer-typed handle (never dereferenced).
pub(crate) fn number<P>(handle: *const P) -> u64 {
    handle.addr() as u64
}

/// A pointer-typed handle for C (never dereferenced by anyone).
pub(crate) fn pointer<P>(handle: u64) -> *mut P {
    std::ptr::without_provenance_mut(handle as usize)
}

const _: () = assert!(std::mem::size_of::<usize>() == 8, "handles need 64-bit pointers");

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    thread_local! {
        static FREE: RefCell<FreeList> = const { RefCell::new(FreeList::new()) };
        static FREE_OTHER: RefCell<FreeList> = const { RefCell::new(FreeList::new()) };
    }
    static TABLE: Slots<Arc<AtomicUsize>> = Slots::new(0x71, "test", &FREE);
    static OTHER: Slots<u32> = Slots::new(0x72, "other", &FREE_OTHER);

    #[test]
    fn released_handles_are_stale_and_never_validate_again() {
        let drops = Arc::new(AtomicUsize::new(0));
        let handle = TABLE.insert(Arc::clone(&drops)).unwrap();
        assert_eq!(TABLE.borrow(handle).unwrap().load(Ordering::Relaxed), 0);
        let (value, reservation) = TABLE.take(handle).unwrap();
        reservation.free();
        drop(value);
        assert!(matches!(TABLE.take(handle), Err(Fault::Stale)));
        assert!(matches!(TABLE.borrow(handle), Err(Fault::Stale)));
        // The cell is reused under a new generation; the old handle stays stale.
        let again = TABLE.insert(drops).unwrap();
        assert_ne!(again, handle);
        assert_eq!(again as u32, handle as u32, "same cell");
        assert!(matches!(TABLE.borrow(handle), Err(Fault::Stale)));
        assert!(TABLE.remove(again).unwrap().is_some());
    }

    #[test]
    fn null_foreign_and_made_up_handles_are_faults() {
        assert_eq!(TABLE.borrow(0).err(), Some(Fault::Null));
        let other = OTHER.insert(7).unwrap();
        assert_eq!(TABLE.borrow(other).err(), Some(Fault::WrongKind { found: 0x72 }));
        assert_eq!(TABLE.borrow(0x7fff_dead_beef).err(), Some(Fault::WrongKind { found: 0 }));
        assert_eq!(TABLE.borrow((0x71 << 56) | 0xffff_fff0).err(), Some(Fault::Stale));
        assert_eq!(OTHER.remove(other).unwrap(), Some(7));
    }

    #[test]
    fn a_restored_value_keeps_its_handle_and_a_borrowed_one_cannot_be_taken() {
        let handle = TABLE.insert(Arc::new(AtomicUsize::new(5))).unwrap();
        let (value, reservation) = TABLE.take(handle).unwrap();
        assert_eq!(TABLE.borrow(handle).err(), Some(Fault::Busy));
        reservation.restore(value);
        let borrowed = TABLE.borrow(handle).unwrap();
        assert_eq!(TABLE.take(handle).err(), Some(Fault::Busy));
        drop(borrowed);
        assert!(TABLE.remove(handle).unwrap().is_some());
    }

    #[test]
    fn removing_a_borrowed_handle_drops_the_value_with_the_last_borrow() {
        let counter = Arc::new(AtomicUsize::new(0));
        let handle = TABLE.insert(Arc::clone(&counter)).unwrap();
        let borrowed = TABLE.borrow(handle).unwrap();
        assert!(TABLE.remove(handle).unwrap().is_none(), "deferred to the last borrow");
        assert_eq!(TABLE.borrow(handle).err(), Some(Fault::Stale));
        assert_eq!(Arc::strong_count(&counter), 2);
        drop(borrowed);
        assert_eq!(Arc::strong_count(&counter), 1);
    }

    #[test]
    fn racing_takes_succeed_exactly_once() {
        for _ in 0..200 {
            let handle = TABLE.insert(Arc::new(AtomicUsize::new(0))).unwrap();
            let wins = AtomicUsize::new(0);
            std::thread::scope(|scope| {
                for _ in 0..4 {
                    scope.spawn(|| {
                        if let Ok((value, reservation)) = TABLE.take(handle) {
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
