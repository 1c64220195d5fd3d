//! Every concurrency primitive the registry's protocols use, from one place.
//!
//! The primitives and the Dekker barrier pair come from `memory-sync`: `std`'s in normal
//! builds, loom's under `--cfg memory_loom`, so the lifecycle and record protocols can
//! be model-checked without touching their logic. (The identity tables use dashmap,
//! the selection arc-swap; those are containers whose own
//! crates are tested upstream, and the loom models exercise the protocols around them
//! with the primitives here. `Arc` stays std, see `memory_sync::primitives`.)
//!
//! # The Dekker barrier pair
//!
//! The hot path announces itself (an in-flight count, a record marked in transit)
//! and then reads the lifecycle word; the cold path writes the lifecycle word and then
//! reads the announcements. [`light_barrier`] is the hot side's store→load barrier and
//! [`heavy_barrier`] the cold side's: a compiler fence and `membarrier(2)` where the
//! kernel offers it, `fence(SeqCst)` on both sides elsewhere (see `memory_sync`).
//!
//! Which one a mechanism uses is fixed when its [`Lifecycle`](crate::lifecycle) is
//! made ([`BarrierMode::detect`]), so its hot and cold sides always agree. The loom
//! models run the fence variant; the asymmetric one differs only in who pays for the
//! barrier, which is the kernel's documented guarantee.

pub(crate) use memory_sync::owner_slots::{FreeLink, NO_SLOT, OwnerSlots};
pub(crate) use memory_sync::per_thread::{PerThread, is_current, thread_index};
pub(crate) use memory_sync::primitives::*;
pub(crate) use memory_sync::{BarrierMode, CachePadded, heavy_barrier, light_barrier, lock};
