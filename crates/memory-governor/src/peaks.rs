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
//! published (its *drift*). A charge adds to the thread's drift; when the drift passes
//! its highest value since the last publication, the charge raises the peak to
//! `published + drift` (two loads of a line that is rarely written, and a store only
//! when the peak rises). A thread publishes its drift (one shared add, which raises
//! the peak to the new published total) when it exceeds [`PEAK_SLACK`] or the credit
//! chunk, whichever is smaller, and when it ends. A steady lease-and-drop loop thus
//! costs a few thread-local additions per level and touches no shared line.
//!
//! Hence the peak is exact when a single thread charges a level (and always with
//! `credit_chunk(0)`, which publishes every charge). With several threads it is the
//! highest total any of them saw, which can be off by the drift other threads had not
//! yet published: at most [`PEAK_SLACK`] bytes (or the chunk) per other thread and
//! level. Unpublished refunds could make it too high, so every raise is capped at what
//! the level's budget holds at that moment (its `used`, which never is below its
//! charges): the peak never exceeds `peak_used`, hence never a limit.

use std::cell::Cell;

use crate::credit::{AccountCounters, DeviceCounters, bump_peak};
use crate::sync::{Arc, AtomicU64, Ordering};

/// The most a thread's drift may reach before it is published.
pub(crate) const PEAK_SLACK: u64 = 64 << 10;

/// What a level's charges can never exceed at any instant: the bytes drawn from its
/// budget (charges plus cached credit, plus the reserves held, for a device).
#[derive(Debug)]
pub(crate) enum Bound {
    /// A device's budget.
    Device(Arc<DeviceCounters>),
    /// An account's quota.
    Account(Arc<AccountCounters>),
    /// One role of an account.
    AccountRole(Arc<AccountCounters>, usize),
}

impl Bound {
    fn used(&self) -> u64 {
        match self {
            Bound::Device(counters) => counters.budget.used(),
            Bound::Account(counters) => counters.budget.used(),
            Bound::AccountRole(counters, role) => counters.roles[*role].used(),
        }
    }
}

/// One level's published charges and the peak of its charges (on its own cache line:
/// rarely written, read by every charge of the level).
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Charges {
    /// The sum of published drifts: a two's-complement signed total (a refund
    /// published on one thread can precede the charge still unpublished on another).
    published: AtomicU64,
    peak: AtomicU64,
    bound: Bound,
}

impl Charges {
    pub(crate) fn new(bound: Bound) -> Charges {
        Charges { published: AtomicU64::new(0), peak: AtomicU64::new(0), bound }
    }

    /// The highest total of charges seen.
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Raises the peak to the published charges plus `drift`, if that is higher.
    #[inline]
    fn observe(&self, drift: i64) {
        self.raise(self.published.load(Ordering::Relaxed) as i64, drift);
    }

    /// Raises the peak to `published + drift`, never above what the budget holds now:
    /// another thread's unpublished refunds can make the sum overstate the charges,
    /// the budget never does.
    fn raise(&self, published: i64, drift: i64) {
        let total = published.wrapping_add(drift);
        if total > 0 {
            bump_peak(&self.peak, (total as u64).min(self.bound.used()));
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
        if change > 0 {
            self.raise(total, 0);
        }
    }
}

/// One thread's unpublished change of one level's charges. Thread-local: shared by
/// the thread's slots that charge the level (so a thread charging two roles of one
/// account sees both in the account's total), never by two threads.
#[derive(Debug)]
pub(crate) struct Tally {
    charges: Arc<Charges>,
    drift: Cell<i64>,
    /// The highest drift observed since the last publication: the thread's own
    /// charges cannot make a new peak until the drift passes it again (others'
    /// publications can, by what they publish; they observe that themselves).
    high: Cell<i64>,
}

impl Tally {
    pub(crate) fn new(charges: Arc<Charges>) -> Tally {
        Tally { charges, drift: Cell::new(0), high: Cell::new(0) }
    }

    /// Whether this tallies `charges`.
    pub(crate) fn counts(&self, charges: &Arc<Charges>) -> bool {
        Arc::ptr_eq(&self.charges, charges)
    }

    /// A charge of `bytes`: raises the peak if the total is a new high.
    ///
    /// The drift stays within `[-slack, slack]` between calls and the mark is at most
    /// `slack`, so a charge can only leave that range upwards, past the mark: one
    /// comparison on the common path.
    #[inline(always)]
    pub(crate) fn charge(&self, bytes: u64, slack: u64) {
        let drift = self.drift.get().wrapping_add(bytes as i64);
        self.drift.set(drift);
        if drift > self.high.get() {
            self.new_high(drift, slack);
        }
    }

    #[cold]
    fn new_high(&self, drift: i64, slack: u64) {
        if drift.unsigned_abs() > slack {
            self.drift.set(0);
            self.high.set(0);
            self.charges.publish_now(drift);
        } else {
            self.high.set(drift);
            self.charges.observe(drift);
        }
    }

    /// A refund of `bytes` (it can only leave `[-slack, slack]` downwards).
    #[inline(always)]
    pub(crate) fn refund(&self, bytes: u64, slack: u64) {
        let drift = self.drift.get().wrapping_sub(bytes as i64);
        self.drift.set(drift);
        if drift < (slack as i64).wrapping_neg() {
            self.flush();
        }
    }

    /// Publishes the drift (when the thread ends).
    pub(crate) fn flush(&self) {
        let drift = self.drift.replace(0);
        self.high.set(0);
        if drift != 0 {
            self.charges.publish(drift);
        }
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    /// Charges bounded by an unlimited account whose budget shows `used` bytes.
    fn charges(used: u64) -> Arc<Charges> {
        let counters = Arc::new(AccountCounters::new(u64::MAX));
        let device = crate::credit::DeviceCounters::new(u64::MAX);
        crate::credit::Path { account: &counters, device: &device, role: 0 }.draw(used, 0).unwrap();
        Arc::new(Charges::new(Bound::Account(counters)))
    }

    #[test]
    fn one_thread_sees_its_own_unpublished_charges() {
        let charges = charges(u64::MAX >> 8);
        let tally = Tally::new(Arc::clone(&charges));
        tally.charge(100, 1000);
        tally.charge(50, 1000);
        assert_eq!((charges.peak(), charges.published.load(Ordering::Relaxed)), (150, 0), "nothing published yet");
        tally.refund(120, 1000);
        tally.charge(20, 1000);
        assert_eq!(charges.peak(), 150, "a lower total leaves the peak");
        tally.charge(2000, 1000);
        assert_eq!(charges.peak(), 2050);
        assert_eq!(
            (tally.drift.get(), charges.published.load(Ordering::Relaxed)),
            (0, 2050),
            "past the slack: published"
        );
    }

    #[test]
    fn a_refund_published_before_its_charge_leaves_no_false_peak() {
        let charges = charges(u64::MAX >> 8);
        let (a, b) = (Tally::new(Arc::clone(&charges)), Tally::new(Arc::clone(&charges)));
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

    #[test]
    fn a_thread_leasing_and_dropping_pages_touches_no_shared_line() {
        let charges = charges(u64::MAX >> 8);
        let tally = Tally::new(Arc::clone(&charges));
        for _ in 0..1000 {
            tally.charge(4096, PEAK_SLACK);
            tally.refund(4096, PEAK_SLACK);
        }
        assert_eq!((charges.published.load(Ordering::Relaxed), charges.peak()), (0, 4096));
        assert_eq!(PEAK_SLACK, 64 << 10, "the slack the docs promise");
    }

    #[test]
    fn drift_up_to_the_slack_stays_with_the_thread() {
        let charges = charges(u64::MAX >> 8);
        let tally = Tally::new(Arc::clone(&charges));
        tally.charge(PEAK_SLACK, PEAK_SLACK);
        assert_eq!((tally.drift.get(), charges.published.load(Ordering::Relaxed)), (PEAK_SLACK as i64, 0));
        assert_eq!(charges.peak(), PEAK_SLACK, "seen, though not published");
        tally.charge(1, PEAK_SLACK);
        assert_eq!((tally.drift.get(), charges.published.load(Ordering::Relaxed)), (0, PEAK_SLACK + 1));
        tally.refund(PEAK_SLACK, PEAK_SLACK);
        assert_eq!(tally.drift.get(), -(PEAK_SLACK as i64), "a refund of exactly the slack stays too");
        tally.refund(1, PEAK_SLACK);
        assert_eq!((tally.drift.get(), charges.published.load(Ordering::Relaxed)), (0, 0));
    }

    #[test]
    fn the_peak_never_exceeds_what_the_budget_holds() {
        let charges = charges(1000);
        let (a, b) = (Tally::new(Arc::clone(&charges)), Tally::new(Arc::clone(&charges)));
        // Another thread refunded 800 it has not published; this one charges 900.
        a.charge(800, 10_000);
        a.flush();
        b.refund(800, 10_000);
        a.charge(900, 10_000);
        assert_eq!(charges.peak(), 1000, "1700 seen, but the budget never held more than 1000");
    }
}
