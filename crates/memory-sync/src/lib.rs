//! The concurrency primitives of the device-memory crates, from one place.
//!
//! `memory-binding`, `memory-governor` and `memory-capi` take every atomic, lock,
//! thread-local and barrier they use from here (each through a crate-private `sync`
//! module that adds its own helpers), so that one switch model-checks all of them:
//!
//! - [`primitives`] re-exports `std`'s atomics, locks, `thread_local!` and
//!   `yield_now`; under `RUSTFLAGS="--cfg memory_loom"` the same names come from loom.
//!   The cfg is namespaced (declared in the workspace's `check-cfg`), so it switches loom
//!   on in these crates only, never in a third-party crate. `Arc` stays `std`'s under
//!   loom: the crates' public signatures carry `Arc<dyn Trait>`, which loom's `Arc`
//!   cannot unsize, and no protocol decision reads a reference count.
//! - [`light_barrier`] / [`heavy_barrier`] are the two sides of a Dekker point (store,
//!   barrier, load on each side: at least one side sees the other's store). Where the
//!   kernel offers `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`, the hot side costs a
//!   compiler fence and the cold side a system call; elsewhere both are
//!   `fence(SeqCst)`. [`BarrierMode::detect`] decides once per process, so the two
//!   sides always agree.
//! - [`per_thread`] keeps one value per thread and per object ([`per_thread::PerThread`]),
//!   indexed by a small thread index that is recycled only once its thread can no longer
//!   ask for it, so "is the calling thread this value's owner?" is one load and a
//!   compare. The registry's pins and anchors are owner-local through it, with
//!   [`owner_slots::OwnerSlots`]: slot numbers that the owner hands out with no
//!   read-modify-write and that any thread gives back.
//! - [`records`] is the record table built on both: per-block records inserted by the
//!   owner thread with plain stores, taken from any thread with one compare-and-swap,
//!   restored under the same tag or freed, named by tags (owner, slot, generation) that
//!   a forged or stale tag cannot match. The plugin loader and the governed allocator
//!   keep their block records in it.
//! - [`owner_gate`] lets another thread reach owner-local values at once, rarely: the
//!   owner passes the gate with plain stores and a light barrier, a claimer under a
//!   lock and a heavy barrier (the pooled allocator's per-thread caches, which a trim
//!   empties from any thread).
//! - [`CachePadded`] keeps per-thread slots on lines of their own; [`lock()`], [`read()`]
//!   and [`write()`] recover a poisoned lock (the crates never run a callback under a
//!   lock, so a panic cannot leave a half-updated value behind one).
//!
//! # Correctness
//! - No `unsafe` code (`#![forbid(unsafe_code)]`).
//! - The owner slots' give-back, the record table's take, restore, rewrite and reuse,
//!   and the owner gate's exclusion are checked by loom models (`src/loom_records.rs`,
//!   `src/loom_owner_gate.rs`, and in `src/owner_slots.rs`).
//! - The barrier pair's guarantee in fence mode is the textbook store-buffering fix,
//!   checked by a loom model in this crate (`cargo xtask loom`), together with a model
//!   that shows loom finds the missed store when the barriers are left out. The
//!   asymmetric mode differs only in who pays: the kernel's documented `membarrier`
//!   guarantee ("fast path: store A; barrier(); load B / slow path: store B;
//!   membarrier(); load A": either the fast path sees B or the slow path sees A).
//!
//! # Quickstart
//! ```
//! use memory_sync::primitives::{AtomicBool, Ordering};
//! use memory_sync::{BarrierMode, heavy_barrier, light_barrier};
//!
//! let mode = BarrierMode::detect();
//! let (announced, closed) = (AtomicBool::new(false), AtomicBool::new(false));
//!
//! // Hot side (often): announce, barrier, check.
//! announced.store(true, Ordering::Relaxed);
//! light_barrier(mode);
//! let may_proceed = !closed.load(Ordering::Relaxed);
//!
//! // Cold side (rarely): close, barrier, look for announcements.
//! closed.store(true, Ordering::Relaxed);
//! heavy_barrier(mode);
//! let must_wait = announced.load(Ordering::Relaxed);
//!
//! // Either the hot side saw the close, or the cold side saw the announcement.
//! assert!(!may_proceed || must_wait);
//! ```
#![forbid(unsafe_code)]

mod barrier;
mod lock;
pub mod owner_gate;
pub mod owner_slots;
pub mod per_thread;
pub mod primitives;
pub mod records;
mod thread_local;

// The public interface.
pub use barrier::{BarrierMode, heavy_barrier, light_barrier};
pub use crossbeam_utils::CachePadded;
pub use lock::{lock, read, write};

/// loom, for [`thread_local!`] under `--cfg memory_loom`.
#[cfg(memory_loom)]
#[doc(hidden)]
pub use loom as __loom;

#[cfg(all(test, memory_loom))]
mod loom_barrier;
#[cfg(all(test, memory_loom))]
mod loom_owner_gate;
#[cfg(all(test, memory_loom))]
mod loom_records;
