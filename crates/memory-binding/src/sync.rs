//! Every concurrency primitive the registry's protocols use, from one place.
//!
//! Normal builds re-export `std`; under `--cfg memory_loom` the same names come from
//! loom, so the lifecycle and record protocols can be model-checked without touching
//! their logic. (The identity tables use dashmap, the selection arc-swap and the pins
//! thread_local; those are containers whose own crates are tested upstream, and the
//! loom models exercise the protocols around them with the primitives here. `Arc`
//! stays std for the reason given below.)
//!
//! # The Dekker barrier pair
//!
//! The hot path announces itself (an in-flight count, a record marked in transit)
//! and then reads the lifecycle word; the cold path writes the lifecycle word and then
//! reads the announcements. Each side needs a store→load barrier between its write and
//! its read. [`light_barrier`] is the hot side's and [`heavy_barrier`] the cold side's:
//!
//! - where the kernel offers `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (Linux 4.14
//!   and later, registered once per process), the hot side is a compiler fence only and
//!   the cold side makes the kernel run a full barrier on every CPU that is running a
//!   thread of this process (the pattern of the `membarrier(2)` manual: "fast path:
//!   store A; barrier(); load B / slow path: store B; membarrier(); load A" — either the
//!   fast path sees B or the slow path sees A);
//! - everywhere else (other systems, Miri, loom, a kernel that refuses the
//!   registration) both sides are `fence(SeqCst)`, the textbook store-buffering fix.
//!
//! Which one a mechanism uses is fixed when its [`Lifecycle`](crate::lifecycle) is
//! made ([`BarrierMode::detect`]), so its hot and cold sides always agree. The loom
//! models run the fence variant; the asymmetric one differs only in who pays for the
//! barrier, which is the kernel's documented guarantee.

pub(crate) use crossbeam_utils::CachePadded;
pub(crate) use primitives::*;

/// Normal builds: `std`'s primitives.
#[cfg(not(memory_loom))]
mod primitives {
    pub(crate) use std::sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{
            AtomicBool, AtomicIsize, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering, compiler_fence, fence,
        },
    };
    pub(crate) use std::thread::yield_now;
}

/// `--cfg memory_loom`: loom's atomics and locks. `Arc` stays std: public signatures
/// carry `Arc<dyn DeviceAllocator>` and `Arc<dyn Any>` resources (loom's `Arc` cannot
/// unsize), and the protocols under check live in the atomics and locks, which loom does
/// replace.
#[cfg(memory_loom)]
mod primitives {
    pub(crate) use loom::sync::{
        Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicIsize, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence},
    };
    pub(crate) use loom::thread::yield_now;
    pub(crate) use std::sync::{Arc, PoisonError};
}

/// Locks `mutex`, recovering the guard if a previous holder panicked.
///
/// No callback ever runs under a registry lock, so a panic cannot leave a
/// half-updated value behind a poisoned lock; recovering keeps one panicking
/// allocator from turning every later call into a permanent error.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How the two sides of the Dekker points are fenced (see the module docs).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum BarrierMode {
    /// Hot side: compiler fence; cold side: `membarrier(PRIVATE_EXPEDITED)`.
    // Chosen only on Linux (membarrier); elsewhere, and in the loom models, the fence
    // mode is the only one.
    #[cfg_attr(any(not(target_os = "linux"), memory_loom), allow(dead_code))]
    Asymmetric,
    /// Both sides: `fence(SeqCst)`.
    Fence,
}

impl BarrierMode {
    /// The mode this process can use: asymmetric once the `membarrier` registration
    /// succeeded (tried once per process), fences otherwise.
    pub(crate) fn detect() -> BarrierMode {
        #[cfg(all(target_os = "linux", not(memory_loom), not(miri)))]
        {
            static MODE: std::sync::OnceLock<BarrierMode> = std::sync::OnceLock::new();
            *MODE.get_or_init(|| {
                use rustix::thread::{MembarrierCommand, MembarrierQuery, membarrier, membarrier_query};
                let offered = membarrier_query();
                let wanted = MembarrierQuery::PRIVATE_EXPEDITED | MembarrierQuery::REGISTER_PRIVATE_EXPEDITED;
                if offered.contains(wanted) && membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok() {
                    BarrierMode::Asymmetric
                } else {
                    tracing::debug!("membarrier unavailable: the hot path fences itself");
                    BarrierMode::Fence
                }
            })
        }
        #[cfg(not(all(target_os = "linux", not(memory_loom), not(miri))))]
        {
            BarrierMode::Fence
        }
    }
}

/// The hot side of a Dekker point: between an announcement and the lifecycle read.
#[inline(always)]
pub(crate) fn light_barrier(mode: BarrierMode) {
    match mode {
        #[cfg(not(memory_loom))]
        BarrierMode::Asymmetric => compiler_fence(Ordering::SeqCst),
        _ => fence(Ordering::SeqCst),
    }
}

/// The cold side of a Dekker point: between a lifecycle write and reading the
/// announcements of every thread.
#[cold]
pub(crate) fn heavy_barrier(mode: BarrierMode) {
    #[cfg(all(target_os = "linux", not(memory_loom), not(miri)))]
    if mode == BarrierMode::Asymmetric {
        use rustix::thread::{MembarrierCommand, membarrier};
        // Cannot fail once registered; should it ever, the global variant (slower,
        // needs no registration) gives the same guarantee.
        if membarrier(MembarrierCommand::PrivateExpedited).is_ok() || membarrier(MembarrierCommand::Global).is_ok() {
            return;
        }
        tracing::error!("membarrier failed after registration; quiescence checks may be premature");
    }
    let _ = mode;
    fence(Ordering::SeqCst);
}
