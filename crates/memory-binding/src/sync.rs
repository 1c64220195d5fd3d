//! Every concurrency primitive the registry's protocols use, from one place.
//!
//! Normal builds re-export `std`; under `--cfg memory_loom` the same names come from
//! loom, so the lifecycle and record protocols can be model-checked without touching
//! their logic. (The identity tables use dashmap, the selection arc-swap and the pins
//! thread_local; those are containers whose own crates are tested upstream, and the
//! loom models exercise the protocols around them with the primitives here. `Arc`
//! stays std for the reason given below.)

#[cfg(not(memory_loom))]
pub(crate) use std::sync::{
    Arc, Mutex, MutexGuard, PoisonError,
    atomic::{AtomicU8, AtomicUsize, Ordering},
};

// `Arc` stays std under loom: public signatures carry `Arc<dyn DeviceAllocator>` and
// `Arc<dyn Any>` resources (loom's `Arc` cannot unsize), and the protocols under
// check live in the atomics and locks, which loom does replace.
#[cfg(memory_loom)]
pub(crate) use loom::sync::{
    Mutex, MutexGuard,
    atomic::{AtomicU8, AtomicUsize, Ordering},
};
#[cfg(memory_loom)]
pub(crate) use std::sync::Arc;
#[cfg(memory_loom)]
pub(crate) use std::sync::PoisonError;

pub(crate) use crossbeam_utils::CachePadded;

#[cfg(memory_loom)]
pub(crate) use loom::thread::yield_now;
#[cfg(not(memory_loom))]
pub(crate) use std::thread::yield_now;

/// The leaf lock of a per-thread pin: held for a few instructions, almost never
/// contended (only a cross-thread release or a cold-path sweep meets the owner).
/// A spin lock unlocks with a plain release store where a futex mutex needs an
/// atomic swap, which is one read-modify-write less per hot-path operation.
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

/// Locks `mutex`, recovering the guard if a previous holder panicked.
///
/// No callback ever runs under a registry lock, so a panic cannot leave a
/// half-updated value behind a poisoned lock; recovering keeps one panicking
/// allocator from turning every later call into a permanent error.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    #[cfg(not(memory_loom))]
    {
        mutex.lock().unwrap_or_else(PoisonError::into_inner)
    }
    #[cfg(memory_loom)]
    {
        mutex.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
