//! Every concurrency primitive of the handle tables, from one place: `memory-sync`'s
//! (std's in normal builds, loom's under `--cfg memory_loom`, so the borrow and
//! destroy protocols of [`crate::handles`] are model-checked unchanged).

pub(crate) use memory_sync::primitives::*;
pub(crate) use memory_sync::{BarrierMode, CachePadded, heavy_barrier, light_barrier, lock};
