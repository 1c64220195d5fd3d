//! The Dekker barrier pair.
//!
//! A hot path announces itself (an in-flight count, a hazard slot, an `active` flag)
//! and then reads a state word; a cold path writes the state word and then reads the
//! announcements. Each side needs a store→load barrier between its write and its read.
//! [`light_barrier`] is the hot side's and [`heavy_barrier`] the cold side's:
//!
//! - where the kernel offers `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (Linux 4.14
//!   and later, registered once per process), the hot side is a compiler fence only and
//!   the cold side makes the kernel run a full barrier on every CPU that is running a
//!   thread of this process (the pattern of the `membarrier(2)` manual);
//! - everywhere else (other systems, Miri, loom, a kernel that refuses the
//!   registration, valgrind) both sides are `fence(SeqCst)`.
//!
//! The cold side's write should be its own read-modify-write or store: the guarantee
//! is about stores made by the thread that runs the barrier.

#[cfg(not(memory_loom))]
use crate::primitives::compiler_fence;
use crate::primitives::{Ordering, fence};

/// How the two sides of a Dekker point are fenced (see the crate docs).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum BarrierMode {
    /// Hot side: compiler fence; cold side: `membarrier(PRIVATE_EXPEDITED)`. Chosen by
    /// [`BarrierMode::detect`] only; never build it by hand (a hot side fenced this way
    /// is sound only once the process is registered).
    Asymmetric,
    /// Both sides: `fence(SeqCst)`. Always sound; what loom models use.
    Fence,
}

impl BarrierMode {
    /// The mode this process can use: asymmetric once the `membarrier` registration
    /// succeeded (tried once per process, on the first call), fences otherwise.
    pub fn detect() -> BarrierMode {
        #[cfg(all(target_os = "linux", not(memory_loom), not(miri)))]
        {
            static MODE: std::sync::OnceLock<BarrierMode> = std::sync::OnceLock::new();
            *MODE.get_or_init(|| {
                use rustix::thread::{MembarrierCommand, MembarrierQuery, membarrier, membarrier_query};
                let wanted = MembarrierQuery::PRIVATE_EXPEDITED | MembarrierQuery::REGISTER_PRIVATE_EXPEDITED;
                if membarrier_query().contains(wanted)
                    && membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok()
                {
                    BarrierMode::Asymmetric
                } else {
                    tracing::debug!("membarrier unavailable: hot paths fence themselves");
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

/// The hot side of a Dekker point: between an announcement and the state read.
#[inline(always)]
pub fn light_barrier(mode: BarrierMode) {
    match mode {
        #[cfg(not(memory_loom))]
        BarrierMode::Asymmetric => compiler_fence(Ordering::SeqCst),
        _ => fence(Ordering::SeqCst),
    }
}

/// The cold side of a Dekker point: between a state write and reading the
/// announcements of every thread.
#[cold]
pub fn heavy_barrier(mode: BarrierMode) {
    #[cfg(all(target_os = "linux", not(memory_loom), not(miri)))]
    if mode == BarrierMode::Asymmetric {
        use rustix::thread::{MembarrierCommand, membarrier};
        // Cannot fail once registered; should it ever, the global variant (slower,
        // needs no registration) gives the same guarantee.
        if membarrier(MembarrierCommand::PrivateExpedited).is_ok() || membarrier(MembarrierCommand::Global).is_ok() {
            return;
        }
        tracing::error!("membarrier failed after registration; a cold path may miss a hot path's announcement");
    }
    let _ = mode;
    fence(Ordering::SeqCst);
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    #[test]
    fn detection_is_decided_once_per_process() {
        let first = BarrierMode::detect();
        assert!((0..4).all(|_| BarrierMode::detect() == first));
        // Both sides run in either mode.
        light_barrier(first);
        heavy_barrier(first);
        light_barrier(BarrierMode::Fence);
        heavy_barrier(BarrierMode::Fence);
    }
}
