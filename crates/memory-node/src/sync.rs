//! Every atomic and lock the node protocol uses, from one place: `std`'s in normal
//! builds, loom's under `--cfg memory_loom` (through `memory-sync`), so the grant, give-back,
//! claim and refund protocol of [`protocol`](crate::protocol) is model-checked unchanged
//! (see `src/loom_slots.rs`).
//!
//! In a normal build the atomics are also what the shared mapping holds: the books file
//! is a `#[repr(C)]` array of `AtomicU64` words ([`format`](crate::format)), which every
//! process reads and writes with atomic operations only.

pub(crate) use memory_sync::lock;
pub(crate) use memory_sync::primitives::*;
