//! Every concurrency primitive of the recorder's rings, from one place: `memory-sync`'s
//! (std's, or loom's under `--cfg memory_loom`), so the ring protocol of
//! [`ring`](crate::ring) is model-checked unchanged (`src/loom_ring.rs`).

pub(crate) use memory_sync::primitives::*;
pub(crate) use memory_sync::{CachePadded, lock};
