//! Peaks of real charges, kept without a shared write per admission.
//!
//! A budget's `used` counts credit that threads cache besides the charges, so its
//! high-water mark overstates the peak of what was charged (after charging 1 MiB and
//! 2 MiB on one thread, `used` had peaked at 11 MiB: two 4 MiB chunks of credit). The
//! total of charges itself cannot be one shared counter: every admission would write
//! it, which is the scaling wall credit exists to avoid.
//!
//! So each level of the books (an account's role, an account, a device) keeps
//! [`Charges`]: the charges threads have *published*, and the peak. Each thread keeps,
//! per level it charges, a [`Tally`] of what it charged and refunded since it last
//! published (its *drift*). A charge adds to the thread's drift and raises the peak to
//! `published + drift` (two loads of lines that are rarely written, and a store only
//! when the peak rises); a thread publishes its drift (one shared add) when it exceeds
//! [`PEAK_SLACK`] or the credit chunk, whichever is smaller, and when it ends.
//!
//! Hence the peak is exact when a single thread charges a level (and always with
//! `credit_chunk(0)`, which publishes every charge). With several threads it is the
//! highest total any of them saw, which can be off, either way, by the drift other
//! threads had not yet published: at most [`PEAK_SLACK`] bytes (or the chunk) per
//! other thread and level.

use crate::credit::bump_peak;
use crate::sync::{Arc, AtomicU64, Ordering};

/// The most a thread's drift may reach before it is published.
pub(crate) const PEAK_SLACK: u64 = 64 << 10;

/// One level's published charges and the peak of its charges (on its own cache line:
/// rarely written, read by every charge of the level).
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Charges {
    /// The sum of published drifts: a two's-complement signed total (a refund
    /// published on one thread can precede the charge still unpublished on another).
    published: AtomicU64,
    peak: AtomicU64,
}

impl Charges {
    pub(crate) fn new() -> Charges {
        Charges { published: AtomicU64::new(0), peak: AtomicU64::new(0) }
    }

    /// The highest total of charges seen.
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Raises the peak to the published charges plus `drift`, if that is higher.
    fn observe(&self, drift: i64) {
        let total = (self.published.load(Ordering::Relaxed) as i64).wrapping_add(drift);
        if total > 0 {
            bump_peak(&self.peak, total as u64);
        }
    }

    /// Adds `drift` to the published charges; returns the new total. The add itself
    /// returns it, so of threads publishing at once the last sees every charge.
    fn publish(&self, drift: i64) -> i64 {
        (self.published.fetch_add(drift as u64, Ordering::Relaxed) as i64).wrapping_add(drift)
    }

    /// A change made with no thread tally (during thread teardown): published at once.
    pub(crate) fn publish_now(&self, change: i64) {
        let total = self.publish(change);
        if change > 0 && total > 0 {
            bump_peak(&self.peak, total as u64);
        }
    }
}

/// One thread's unpublished change of one level's charges.
#[derive(Debug)]
pub(crate) struct Tally {
    charges: Arc<Charges>,
    drift: i64,
}

impl Tally {
    pub(crate) fn new(charges: Arc<Charges>) -> Tally {
        Tally { charges, drift: 0 }
    }

    /// Whether this tallies `charges`.
    pub(crate) fn counts(&self, charges: &Arc<Charges>) -> bool {
        Arc::ptr_eq(&self.charges, charges)
    }

    /// A charge of `bytes`: raises the peak if the total is a new high.
    #[inline]
    pub(crate) fn charge(&mut self, bytes: i64, slack: i64) {
        self.drift += bytes;
        if self.drift.abs() > slack {
            self.charges.publish_now(std::mem::take(&mut self.drift));
        } else {
            self.charges.observe(self.drift);
        }
    }

    /// A refund of `bytes`.
    #[inline]
    pub(crate) fn refund(&mut self, bytes: i64, slack: i64) {
        self.drift -= bytes;
        if self.drift.abs() > slack {
            self.flush();
        }
    }

    /// Publishes the drift (also when the thread ends).
    pub(crate) fn flush(&mut self) {
        if self.drift != 0 {
            self.charges.publish(std::mem::take(&mut self.drift));
        }
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    #[test]
    fn one_thread_sees_its_own_unpublished_charges() {
        let charges = Arc::new(Charges::new());
        let mut tally = Tally::new(Arc::clone(&charges));
        tally.charge(100, 1000);
        tally.charge(50, 1000);
        assert_eq!((charges.peak(), charges.published.load(Ordering::Relaxed)), (150, 0), "nothing published yet");
        tally.refund(120, 1000);
        tally.charge(20, 1000);
        assert_eq!(charges.peak(), 150, "a lower total leaves the peak");
        tally.charge(2000, 1000);
        assert_eq!(charges.peak(), 2050);
        assert_eq!((tally.drift, charges.published.load(Ordering::Relaxed)), (0, 2050), "past the slack: published");
    }

    #[test]
    fn a_refund_published_before_its_charge_leaves_no_false_peak() {
        let charges = Arc::new(Charges::new());
        let (mut a, mut b) = (Tally::new(Arc::clone(&charges)), Tally::new(Arc::clone(&charges)));
        a.charge(500, 1000);
        b.refund(500, 0);
        assert_eq!(charges.published.load(Ordering::Relaxed) as i64, -500);
        a.flush();
        assert_eq!((charges.published.load(Ordering::Relaxed), charges.peak()), (0, 500));
        charges.publish_now(300);
        assert_eq!(charges.peak(), 500);
        charges.publish_now(300);
        assert_eq!(charges.peak(), 600);
    }
}
