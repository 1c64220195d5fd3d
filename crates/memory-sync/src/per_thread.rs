//! Values kept per thread and per object (a mechanism's pins, its binding anchors),
//! indexed by a small thread index that is recycled when a thread exits.
//!
//! Why not the `thread_local` crate here: a pin's free list is single-writer, and a
//! release decides whether it may push onto that list by asking "is the calling
//! thread the pin's owner?". The answer has to change exactly when the table hands the
//! pin to another thread. Owning the index makes that so: [`thread_index`] stops
//! returning a thread's index (its TLS guard is gone) before the index is freed, and a
//! new thread receives it only after the free, under the manager's mutex, so the old
//! and the new owner are ordered. Code that runs in a thread's TLS destructors after
//! its guard dropped gets a fresh index that is never recycled.

use std::sync::OnceLock;

/// Thread indices served from the inline first table, without an indirection.
const INLINE: usize = 64;
/// Entries in the first spill bucket (a power of two); bucket `b` holds `FIRST << b`.
const FIRST: usize = 64;
/// Enough buckets to index every `usize` past the inline table.
const BUCKETS: usize = usize::BITS as usize - FIRST.trailing_zeros() as usize;

/// One value of `T` per thread index, created on first use and kept until the table
/// drops (a recycled index finds the previous thread's value, which is the point:
/// tables do not grow with thread churn).
pub struct PerThread<T> {
    inline: [OnceLock<T>; INLINE],
    buckets: [OnceLock<Box<[OnceLock<T>]>>; BUCKETS],
}

impl<T> PerThread<T> {
    /// An empty table (no value is created before its thread asks).
    pub fn new() -> PerThread<T> {
        PerThread {
            inline: std::array::from_fn(|_| OnceLock::new()),
            buckets: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    /// The spill bucket and offset of an index past the inline table.
    #[inline]
    fn position(index: usize) -> (usize, usize) {
        let shifted = index - INLINE + FIRST;
        let bucket = (shifted.ilog2() - FIRST.ilog2()) as usize;
        (bucket, shifted - (FIRST << bucket))
    }

    /// The value of thread `index`, if it was created.
    #[inline]
    pub fn get(&self, index: usize) -> Option<&T> {
        match self.inline.get(index) {
            Some(entry) => entry.get(),
            None => self.get_spilled(index),
        }
    }

    #[cold]
    fn get_spilled(&self, index: usize) -> Option<&T> {
        let (bucket, offset) = Self::position(index);
        self.buckets[bucket].get()?[offset].get()
    }

    /// The value of thread `index`, created by `init` on first use. Only the thread
    /// holding `index` calls this for it, so `init` runs once per index.
    #[inline]
    pub fn get_or(&self, index: usize, init: impl FnOnce() -> T) -> &T {
        match self.get(index) {
            Some(value) => value,
            None => self.create(index, init),
        }
    }

    #[cold]
    fn create(&self, index: usize, init: impl FnOnce() -> T) -> &T {
        if let Some(entry) = self.inline.get(index) {
            return entry.get_or_init(init);
        }
        let (bucket, offset) = Self::position(index);
        let entries = self.buckets[bucket].get_or_init(|| (0..FIRST << bucket).map(|_| OnceLock::new()).collect());
        entries[offset].get_or_init(init)
    }

    /// Every value created so far (cold path: sweeps, counts).
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        let spilled = self.buckets.iter().filter_map(OnceLock::get).flat_map(|entries| entries.iter());
        self.inline.iter().chain(spilled).filter_map(OnceLock::get)
    }
}

impl<T> Default for PerThread<T> {
    fn default() -> Self {
        PerThread::new()
    }
}

/// The calling thread's index: small, unique among running threads, recycled after a
/// thread exits (see the module docs for when exactly).
#[cfg(not(memory_loom))]
#[inline]
pub fn thread_index() -> usize {
    // The hot read is a plain thread-local word with no destructor and no lazy-init
    // check; `NO_INDEX` until the thread's guard is made, and again once it dropped.
    match CURRENT.get() {
        NO_INDEX => first_or_late_index(),
        index => index,
    }
}

/// Whether `index` is the calling thread's: the hot answer is one thread-local load and
/// a compare; only a thread without a live guard (before its first index, or in its TLS
/// destructors) asks [`thread_index`].
#[cfg(not(memory_loom))]
#[inline]
pub fn is_current(index: usize) -> bool {
    let current = CURRENT.get();
    current == index || (current == NO_INDEX && index == first_or_late_index())
}

/// Whether `index` is the calling thread's (under loom: the model thread's).
#[cfg(memory_loom)]
pub fn is_current(index: usize) -> bool {
    index == thread_index()
}

#[cfg(not(memory_loom))]
std::thread_local! {
    /// The calling thread's index while its guard lives (a `const` thread-local with no
    /// destructor: reading it is one load).
    static CURRENT: std::cell::Cell<usize> = const { std::cell::Cell::new(NO_INDEX) };
}

#[cfg(not(memory_loom))]
const NO_INDEX: usize = usize::MAX;

/// The thread's first call (makes its guard), or a call from its TLS destructors
/// after the guard dropped.
#[cfg(not(memory_loom))]
#[cold]
#[inline(never)]
fn first_or_late_index() -> usize {
    std::thread_local!(static INDEX: ThreadIndex = ThreadIndex::acquire());
    INDEX.try_with(|index| index.0).unwrap_or_else(|_| late_index())
}

#[cfg(not(memory_loom))]
mod manager {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    use std::sync::Mutex;

    struct Indices {
        next: usize,
        free: BinaryHeap<Reverse<usize>>,
    }

    static INDICES: Mutex<Indices> = Mutex::new(Indices { next: 0, free: BinaryHeap::new() });

    fn indices() -> std::sync::MutexGuard<'static, Indices> {
        INDICES.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The smallest free index (keeps the tables dense).
    pub(super) fn acquire() -> usize {
        let mut indices = indices();
        match indices.free.pop() {
            Some(Reverse(index)) => index,
            None => {
                let index = indices.next;
                indices.next += 1;
                index
            }
        }
    }

    pub(super) fn release(index: usize) {
        indices().free.push(Reverse(index));
    }
}

/// Holds a thread's index; its TLS destructor frees it.
#[cfg(not(memory_loom))]
struct ThreadIndex(usize);

#[cfg(not(memory_loom))]
impl ThreadIndex {
    fn acquire() -> ThreadIndex {
        let index = manager::acquire();
        CURRENT.set(index);
        ThreadIndex(index)
    }
}

#[cfg(not(memory_loom))]
impl Drop for ThreadIndex {
    fn drop(&mut self) {
        // Stop answering with the index before another thread can receive it.
        CURRENT.set(NO_INDEX);
        manager::release(self.0);
    }
}

/// The index of a thread whose guard is already gone (code in its TLS destructors):
/// acquired once and never freed, so no other thread can ever own it.
#[cfg(not(memory_loom))]
#[cold]
fn late_index() -> usize {
    std::thread_local!(static LATE: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) });
    LATE.with(|late| {
        if late.get() == usize::MAX {
            late.set(manager::acquire());
        }
        late.get()
    })
}

/// Under loom every model thread gets the next index of the execution (deterministic;
/// nothing is recycled inside one execution).
#[cfg(memory_loom)]
pub fn thread_index() -> usize {
    loom::lazy_static! {
        static ref NEXT: loom::sync::atomic::AtomicUsize = loom::sync::atomic::AtomicUsize::new(0);
    }
    loom::thread_local!(static INDEX: usize = NEXT.fetch_add(1, loom::sync::atomic::Ordering::Relaxed));
    INDEX.with(|index| *index)
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    #[test]
    fn positions_cover_every_spilled_index_once_in_growing_buckets() {
        let mut seen = std::collections::HashSet::new();
        let count = if cfg!(miri) { 300 } else { 10_000 };
        for index in INLINE..INLINE + count {
            let (bucket, offset) = PerThread::<()>::position(index);
            assert!(offset < FIRST << bucket, "{index}: offset {offset} outside bucket {bucket}");
            assert!(seen.insert((bucket, offset)), "{index} collides");
        }
        assert_eq!(PerThread::<()>::position(INLINE), (0, 0));
        assert_eq!(PerThread::<()>::position(INLINE + FIRST), (1, 0));
        assert!(PerThread::<()>::position(usize::MAX).0 < BUCKETS);
    }

    #[test]
    fn values_are_per_index_and_iterated_once_each() {
        let table = PerThread::new();
        assert!(table.get(3).is_none());
        assert_eq!(*table.get_or(3, || 30), 30);
        assert_eq!(*table.get_or(3, || 31), 30, "created once");
        assert_eq!(*table.get_or(100, || 1000), 1000);
        assert_eq!(*table.get_or(5000, || 5), 5);
        assert_eq!(table.get(100), Some(&1000));
        let mut all: Vec<_> = table.iter().copied().collect();
        all.sort_unstable();
        assert_eq!(all, [5, 30, 1000]);
    }

    #[test]
    fn running_threads_hold_distinct_indices_and_exited_ones_are_recycled() {
        let here = thread_index();
        assert_eq!(thread_index(), here, "stable within a thread");
        let (tx, rx) = std::sync::mpsc::channel();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let worker = std::thread::spawn(move || {
            tx.send(thread_index()).unwrap();
            wait.recv().unwrap();
        });
        assert_ne!(here, rx.recv().unwrap(), "two running threads");
        go.send(()).unwrap();
        worker.join().unwrap();
        // Threads one after another (200; 70 under Miri): without recycling their
        // indices would climb past 64; recycled, they stay below the number of threads
        // alive at once.
        let threads = if cfg!(miri) { 70 } else { 200 };
        let highest = (0..threads).map(|_| std::thread::spawn(thread_index).join().unwrap()).max().unwrap();
        assert!(highest < 64, "exited threads' indices are not recycled (reached {highest})");
    }
}
