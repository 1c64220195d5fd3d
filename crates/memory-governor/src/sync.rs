//! Every concurrency primitive the governor's protocols use, from one place.
//!
//! Normal builds re-export `std`; under `--cfg memory_loom` the atomics, locks,
//! thread-locals and the spin hint come from loom, so the admission, refund, credit
//! return and limit-change protocols of [`credit`](crate::credit) are model-checked
//! without touching their logic (see `src/loom_credit.rs`).
//!
//! # The Dekker barrier pair
//!
//! A credit slot is written by its owner thread with plain stores; a sweeping thread
//! announces itself in the slot's `sweeping` flag and then reads the owner's `active`
//! flag, while the owner stores `active` and then reads `sweeping`. Each side needs a
//! store→load barrier between its write and its read: [`light_barrier`] is the owner's
//! (hot) side, [`heavy_barrier`] the sweeper's (cold) side. Where the kernel offers
//! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (Linux), the hot side is a compiler
//! fence and the cold side makes the kernel run a full barrier on every CPU running a
//! thread of this process ("fast path: store A; barrier(); load B / slow path: store B;
//! membarrier(); load A": either the fast path sees B or the slow path sees A). Elsewhere,
//! under Miri and under loom, and when the registration is refused, both sides are
//! `fence(SeqCst)`. The mode is decided once per process ([`barrier_mode`]), so both
//! sides always agree. The registry uses the same pair for its in-flight slots.
//!
//! `Arc` is always `std`'s: the public interface hands out `Arc<dyn Trait>` (policies,
//! reclaim holders, allocators), which loom's `Arc` cannot unsize, and no protocol
//! decision ever reads a reference count.

pub(crate) use crossbeam_utils::CachePadded;
pub(crate) use primitives::*;

/// Normal builds: `std`'s primitives, and a spin lock for the record shards' leaf lock.
#[cfg(not(memory_loom))]
mod primitives {
    pub(crate) use std::sync::{
        Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
        atomic::{AtomicBool, AtomicU64, Ordering, compiler_fence, fence},
    };
    pub(crate) use std::thread_local;

    /// The leaf lock of a governed allocator's record shard: held for a few
    /// instructions, almost never contended (only a release on another thread than the
    /// allocation meets the owner). A spin lock unlocks with a plain release store where
    /// a futex mutex needs an atomic swap: one read-modify-write less per allocation and
    /// release.
    pub(crate) type LeafMutex<T> = spin::Mutex<T>;
    pub(crate) type LeafGuard<'a, T> = spin::MutexGuard<'a, T>;

    /// Locks a leaf mutex (a spin lock has no poisoning, and no callback runs under it).
    pub(crate) fn lock_leaf<T>(mutex: &LeafMutex<T>) -> LeafGuard<'_, T> {
        mutex.lock()
    }

    /// Tells the scheduler this thread waits for another one to finish a short,
    /// callback-free window (a credit move another thread has marked busy).
    pub(crate) fn wait_for_other_thread() {
        std::thread::yield_now();
    }
}

/// `--cfg memory_loom`: loom's atomics, locks and thread-locals, so the admission,
/// refund, credit return and limit-change protocols are model-checked.
#[cfg(memory_loom)]
mod primitives {
    pub(crate) use loom::sync::{
        Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
        atomic::{AtomicBool, AtomicU64, Ordering, fence},
    };
    pub(crate) use loom::thread_local;
    pub(crate) use std::sync::{Arc, PoisonError};

    /// The leaf lock is loom's mutex under the model.
    pub(crate) type LeafMutex<T> = loom::sync::Mutex<T>;
    pub(crate) type LeafGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

    /// Locks a leaf mutex, recovering from poisoning (no callback runs under it).
    pub(crate) fn lock_leaf<T>(mutex: &LeafMutex<T>) -> LeafGuard<'_, T> {
        mutex.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Yields to the model's scheduler while another thread finishes a short window.
    pub(crate) fn wait_for_other_thread() {
        loom::thread::yield_now();
    }
}

/// How the two sides of the Dekker point are fenced (see the module docs).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum BarrierMode {
    /// Hot side: compiler fence; cold side: `membarrier(PRIVATE_EXPEDITED)`.
    #[cfg_attr(any(not(target_os = "linux"), memory_loom, miri), allow(dead_code))]
    Asymmetric,
    /// Both sides: `fence(SeqCst)`.
    Fence,
}

/// The mode this process uses: asymmetric once the `membarrier` registration succeeded
/// (tried once per process), fences otherwise.
pub(crate) fn barrier_mode() -> BarrierMode {
    #[cfg(all(target_os = "linux", not(memory_loom), not(miri)))]
    {
        static MODE: std::sync::OnceLock<BarrierMode> = std::sync::OnceLock::new();
        *MODE.get_or_init(|| {
            use rustix::thread::{MembarrierCommand, MembarrierQuery, membarrier, membarrier_query};
            let wanted = MembarrierQuery::PRIVATE_EXPEDITED | MembarrierQuery::REGISTER_PRIVATE_EXPEDITED;
            if membarrier_query().contains(wanted) && membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok() {
                BarrierMode::Asymmetric
            } else {
                tracing::debug!("membarrier unavailable: credit slot owners fence themselves");
                BarrierMode::Fence
            }
        })
    }
    #[cfg(not(all(target_os = "linux", not(memory_loom), not(miri))))]
    {
        BarrierMode::Fence
    }
}

/// The hot (owner's) side of a Dekker point: between storing `active` and reading
/// `sweeping`.
#[inline(always)]
pub(crate) fn light_barrier(mode: BarrierMode) {
    match mode {
        #[cfg(not(memory_loom))]
        BarrierMode::Asymmetric => compiler_fence(Ordering::SeqCst),
        _ => fence(Ordering::SeqCst),
    }
}

/// The cold (sweeper's) side of a Dekker point: between storing `sweeping` and reading
/// the owners' `active` flags.
#[cold]
pub(crate) fn heavy_barrier(mode: BarrierMode) {
    #[cfg(all(target_os = "linux", not(memory_loom), not(miri)))]
    if mode == BarrierMode::Asymmetric {
        use rustix::thread::{MembarrierCommand, membarrier};
        // Cannot fail once registered; should it ever, the global variant (slower, needs
        // no registration) gives the same guarantee.
        if membarrier(MembarrierCommand::PrivateExpedited).is_ok() || membarrier(MembarrierCommand::Global).is_ok() {
            return;
        }
        tracing::error!("membarrier failed after registration; a sweep may miss a slot's owner");
    }
    let _ = mode;
    fence(Ordering::SeqCst);
}

/// A counter that hands out ids (accounts, reclaim holders, trace thread numbers). Ids
/// are never part of a protocol under check, so this is std's atomic under loom too (a
/// loom atomic cannot live in a `static`, and would only multiply the models' states).
#[allow(clippy::disallowed_types, reason = "ids, not a protocol under check")]
pub(crate) type IdCounter = std::sync::atomic::AtomicU64;

/// A small number that stays the same for the calling thread and differs between
/// threads that started one after the other: which record shard a thread uses. A
/// placement hint only (two threads sharing a shard is correct, just slower), so it is
/// std's thread-local under loom too.
#[allow(clippy::disallowed_types, reason = "a placement hint, not part of any protocol")]
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
