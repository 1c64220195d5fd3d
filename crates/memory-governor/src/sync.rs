//! Every concurrency primitive the governor's protocols use, from one place.
//!
//! The primitives and the Dekker barrier pair come from `memory-sync`, shared with the
//! registry: `std`'s in normal builds; under `--cfg memory_loom` the atomics, locks,
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
//! (hot) side, [`heavy_barrier`] the sweeper's (cold) side: a compiler fence and
//! `membarrier(2)` where the kernel offers it, `fence(SeqCst)` on both sides elsewhere
//! and under loom (see `memory_sync`). The mode is decided once per process
//! ([`BarrierMode::detect`]), so both sides always agree. The registry uses the same
//! pair for its in-flight slots.
//!
//! `Arc` is always `std`'s: the public interface hands out `Arc<dyn Trait>` (policies,
//! reclaim holders, allocators), which loom's `Arc` cannot unsize, and no protocol
//! decision ever reads a reference count.

pub(crate) use memory_sync::primitives::*;
pub(crate) use memory_sync::{BarrierMode, CachePadded, heavy_barrier, light_barrier, lock, read, write};

/// Tells the scheduler (loom's, under the models) that this thread waits for another
/// one to finish a short, callback-free window (a credit move another thread has marked
/// busy).
pub(crate) fn wait_for_other_thread() {
    yield_now();
}

/// A counter that hands out ids (accounts, reclaim holders, trace thread numbers). Ids
/// are never part of a protocol under check, so this is std's atomic under loom too (a
/// loom atomic cannot live in a `static`, and would only multiply the models' states).
#[allow(clippy::disallowed_types, reason = "ids, not a protocol under check")]
pub(crate) type IdCounter = std::sync::atomic::AtomicU64;
