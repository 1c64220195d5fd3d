//! Every concurrency primitive the governor's protocols use, from one place.
//!
//! Normal builds re-export `std`; under `--cfg memory_loom` the atomics, locks,
//! thread-locals and the spin hint come from loom, so the admission, refund, credit
//! return and limit-change protocols of [`credit`](crate::credit) are model-checked
//! without touching their logic (see `src/loom_credit.rs`).
//!
//! `Arc` is always `std`'s: the public interface hands out `Arc<dyn Trait>` (policies,
//! reclaim holders, allocators), which loom's `Arc` cannot unsize, and no protocol
//! decision ever reads a reference count.

pub(crate) use std::sync::Arc;

#[cfg(not(memory_loom))]
pub(crate) use std::sync::{
    Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
    atomic::{AtomicBool, AtomicU64, Ordering},
};

#[cfg(memory_loom)]
pub(crate) use loom::sync::{
    Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
    atomic::{AtomicBool, AtomicU64, Ordering},
};
#[cfg(memory_loom)]
pub(crate) use std::sync::PoisonError;

#[cfg(not(memory_loom))]
pub(crate) use std::thread_local;

#[cfg(memory_loom)]
pub(crate) use loom::thread_local;

pub(crate) use crossbeam_utils::CachePadded;

/// The leaf lock of a governed allocator's record shard: held for a few instructions,
/// almost never contended (only a release on another thread than the allocation meets
/// the owner). A spin lock unlocks with a plain release store where a futex mutex
/// needs an atomic swap: one read-modify-write less per allocation and release.
#[cfg(not(memory_loom))]
pub(crate) type LeafMutex<T> = spin::Mutex<T>;
#[cfg(not(memory_loom))]
pub(crate) type LeafGuard<'a, T> = spin::MutexGuard<'a, T>;
#[cfg(memory_loom)]
pub(crate) type LeafMutex<T> = loom::sync::Mutex<T>;
#[cfg(memory_loom)]
pub(crate) type LeafGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

/// Locks a leaf mutex (never poisoned: a spin lock has no poisoning, and no callback
/// runs under it).
pub(crate) fn lock_leaf<T>(mutex: &LeafMutex<T>) -> LeafGuard<'_, T> {
    #[cfg(not(memory_loom))]
    {
        mutex.lock()
    }
    #[cfg(memory_loom)]
    {
        mutex.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A small number that stays the same for the calling thread and differs between
/// threads that started one after the other: which record shard a thread uses. A
/// placement hint only (two threads sharing a shard is correct, just slower), so it is
/// std's thread-local under loom too.
pub(crate) fn thread_number() -> usize {
    use std::cell::Cell;
    use std::sync::atomic::AtomicUsize as StdAtomicUsize;
    static NEXT: StdAtomicUsize = StdAtomicUsize::new(0);
    std::thread_local! {
        static NUMBER: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    NUMBER
        .try_with(|number| {
            if number.get() == usize::MAX {
                number.set(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            }
            number.get()
        })
        // During thread teardown: any shard will do.
        .unwrap_or(0)
}

/// Tells the scheduler this thread waits for another one to finish a short,
/// callback-free window (a credit move another thread has marked busy).
pub(crate) fn wait_for_other_thread() {
    #[cfg(not(memory_loom))]
    std::thread::yield_now();
    #[cfg(memory_loom)]
    loom::thread::yield_now();
}

/// Locks `mutex`, recovering the guard if a previous holder panicked.
///
/// No callback ever runs under a governor lock, so a panic cannot leave a
/// half-updated value behind a poisoned lock; recovering keeps one panicking thread
/// from turning every later call into a permanent error.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Read-locks `lock`, recovering from poisoning (see [`lock`]).
pub(crate) fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

/// Write-locks `lock`, recovering from poisoning (see [`lock`]).
pub(crate) fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}
