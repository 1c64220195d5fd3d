//! The recorder's clock: a raw stamp on the hot path, nanoseconds on the writer's.
//!
//! `Instant::now()` was most of a recorded call's cost (57 of the 75 ns it added to an
//! allocate + release pair on the development VM): a vDSO `clock_gettime` reads the
//! time-stamp counter inside a sequence lock and scales it on every call. The recorder
//! only needs the reading on the recording thread; the scaling can wait. So a recording
//! thread stores [`quanta`]'s raw counter reading (`rdtsc` on x86-64 with an invariant
//! TSC, `cntvct_el0` on AArch64; elsewhere, or without an invariant counter, the OS's
//! monotonic clock in nanoseconds) in the event's time word, and the writer thread turns
//! it into nanoseconds since the recording started with the scale quanta calibrated
//! against the OS's monotonic clock (once per process, at the first recorder: at most
//! 200 ms).
//!
//! Ordering: an invariant TSC runs at one rate on every core and is synchronised across
//! them by the kernel (quanta uses the counter only when the CPU says it is invariant),
//! so stamps from two threads compare as their times do. A stamp is not a serialising
//! instruction, so it may be taken a few cycles out of program order; that is far below
//! the time it takes a released block to reach another thread's allocation, and replay
//! identifies blocks by their governed tag, never by time.

/// A started clock (see the module docs).
pub(crate) struct Clock {
    source: quanta::Clock,
    origin: u64,
}

impl Clock {
    /// A clock whose zero is now.
    pub(crate) fn start() -> Clock {
        let source = quanta::Clock::new();
        let origin = source.raw();
        Clock { source, origin }
    }

    /// The raw reading now (hot path: one counter read).
    #[inline(always)]
    pub(crate) fn stamp(&self) -> u64 {
        self.source.raw()
    }

    /// Nanoseconds from the clock's start to `stamp` (0 for a stamp before it).
    pub(crate) fn nanos(&self, stamp: u64) -> u64 {
        self.source.delta_as_nanos(self.origin, stamp)
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    #[test]
    fn stamps_turn_into_nanoseconds_that_follow_the_os_clock() {
        let clock = Clock::start();
        let before = std::time::Instant::now();
        let first = clock.stamp();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let second = clock.stamp();
        let elapsed = before.elapsed().as_nanos() as u64;
        let (first, second) = (clock.nanos(first), clock.nanos(second));
        assert!(second > first, "time moves forward: {first} then {second}");
        let between = second - first;
        assert!(between >= 15_000_000, "20 ms of sleep measured {between} ns");
        assert!(between <= elapsed + 5_000_000, "{between} ns between stamps, {elapsed} ns on the OS clock");
    }

    #[test]
    fn a_stamp_from_before_the_start_reads_as_zero() {
        let clock = Clock::start();
        assert_eq!(clock.nanos(clock.origin.saturating_sub(1_000)), 0);
    }
}
