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
