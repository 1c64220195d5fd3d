//! loom models of the credit protocol (see [`crate::credit`]).
//!
//! Run with `RUSTFLAGS="--cfg memory_loom" cargo test --release -p memory-governor --lib loom`
//! (set `LOOM_MAX_PREEMPTIONS=2` or `3` to bound the search). Each model uses tiny
//! budgets (a few bytes, one-byte chunks) so that every interleaving that matters
//! is reachable.

use loom::thread;

use crate::credit::{
    AccountCounters, DeviceCounters, Path, ROLES, Slot, SlotLists, UNLIMITED, admit_draining, return_credit, set_limit,
};
use crate::sync::{Arc, Mutex, lock};

const CHUNK: u64 = 1;
const KV: usize = 1;
const WEIGHTS: usize = 0;

/// One device with one account, and the slot lists a drain sweeps.
struct Books {
    account: Arc<AccountCounters>,
    device: Arc<DeviceCounters>,
    account_slots: Mutex<Vec<Arc<Slot>>>,
    device_slots: Mutex<Vec<Arc<Slot>>>,
}

impl Books {
    fn new(device_limit: u64, quota: u64) -> Arc<Books> {
        Arc::new(Books {
            account: Arc::new(AccountCounters::new(quota)),
            device: Arc::new(DeviceCounters::new(device_limit)),
            account_slots: Mutex::new(Vec::new()),
            device_slots: Mutex::new(Vec::new()),
        })
    }

    fn slot(&self, role: usize) -> Arc<Slot> {
        let slot = Arc::new(Slot::new(Arc::clone(&self.account), Arc::clone(&self.device), role));
        lock(&self.account_slots).push(Arc::clone(&slot));
        lock(&self.device_slots).push(Arc::clone(&slot));
        slot
    }

    /// The shared books of `role`, without a slot: draws and returns that go straight
    /// to the role's word on the device.
    fn path(&self, role: usize) -> Path<'_> {
        Path { account: &self.account, device: &self.device, role }
    }

    fn lists(&self) -> SlotLists<'_> {
        SlotLists { account: &self.account_slots, device: &self.device_slots }
    }

    /// The full admission: own credit, a chunk or exact draw, then draining others.
    fn admit(&self, slot: &Slot, n: u64) -> bool {
        slot.admit_fast(n) || slot.admit_slow(n, CHUNK).is_ok() || admit_draining(slot.path(), n, self.lists()).is_ok()
    }

    fn refund(&self, slot: &Slot, n: u64) {
        slot.refund(n, CHUNK, true);
    }

    fn assert_within_limits(&self) {
        let device = &self.device.budget;
        assert!(device.used() <= device.limit(), "device used {} over limit {}", device.used(), device.limit());
        let account = &self.account.budget;
        assert!(account.used() <= account.limit(), "account used {} over quota {}", account.used(), account.limit());
    }

    /// After every charge is refunded and all credit returned, the books are empty.
    /// Before returning the credit, checks that no closed slot holds any.
    fn assert_empty(&self) {
        for slot in lock(&self.device_slots).iter() {
            assert!(!(slot.is_closed() && slot.credit() > 0), "a closed slot holds credit");
        }
        return_credit(&self.device.budget, &self.device_slots);
        assert_eq!(self.account.budget.used(), 0, "account books leaked");
        for role in 0..ROLES {
            assert_eq!(self.account.roles[role].used(), 0, "role {role} leaked");
            assert_eq!(self.device.roles[role].used(), 0, "role {role} leaked on the device");
        }
        assert_eq!(self.device.budget.used(), self.device.reserve_targets(), "device books leaked");
    }
}

/// An idle thread's cached credit is pulled back for an admission that needs it, while
/// that thread may still be admitting and refunding: the admission never fails when
/// the total demand fits.
#[test]
fn loom_admission_racing_refund_gets_idle_credit() {
    loom::model(|| {
        let books = Books::new(4, UNLIMITED);
        let b_slot = books.slot(KV);
        let a_slot = books.slot(KV);

        let b_books = Arc::clone(&books);
        let b = thread::spawn(move || {
            // Leaves up to two bytes of credit cached in its slot.
            assert!(b_books.admit(&b_slot, 1));
            b_books.assert_within_limits();
            b_books.refund(&b_slot, 1);
        });

        // 3 + B's 1 = 4 fits under any interleaving.
        assert!(books.admit(&a_slot, 3), "refused while credit sat with another thread");
        books.assert_within_limits();
        books.refund(&a_slot, 3);

        b.join().unwrap();
        books.assert_empty();
    });
}

/// Two drainers at once, and credit cached by a third thread: both admissions fit, so
/// both succeed, whichever drainer sweeps the cached credit and while it is in transit.
#[test]
fn loom_two_drainers_both_get_returned_credit() {
    loom::model(|| {
        let books = Books::new(4, UNLIMITED);
        let idle = books.slot(KV);
        assert!(books.admit(&idle, 1));
        books.refund(&idle, 1);
        assert!(idle.credit() > 0, "the model needs cached credit to start with");

        let a_slot = books.slot(KV);
        let b_slot = books.slot(KV);
        let a_books = Arc::clone(&books);
        let a = thread::spawn(move || {
            let ok = a_books.admit(&a_slot, 2);
            a_books.assert_within_limits();
            (ok, a_slot)
        });
        let ok_b = books.admit(&b_slot, 2);
        books.assert_within_limits();
        let (ok_a, a_slot) = a.join().unwrap();
        assert!(ok_a && ok_b, "2 + 2 fits in 4: a={ok_a} b={ok_b}");
        books.refund(&a_slot, 2);
        books.refund(&b_slot, 2);
        books.assert_empty();
    });
}

/// Lowering a limit races an admission, while the lowering thread itself holds
/// credit cached under the old limit: once `set_limit` returns, admissions obey the new
/// limit (the cached credit does not survive), and nothing charged is revoked.
#[test]
fn loom_limit_lowering_racing_admission() {
    loom::model(|| {
        let books = Books::new(4, UNLIMITED);
        let cached = books.slot(KV);
        assert!(books.admit(&cached, 1));
        books.refund(&cached, 1);
        assert!(cached.credit() > 0, "the model needs cached credit to start with");

        let a_slot = books.slot(KV);
        let a_books = Arc::clone(&books);
        let a = thread::spawn(move || {
            let ok = a_books.admit(&a_slot, 1);
            (ok, a_slot)
        });

        set_limit(&books.device.budget, 1, &books.device_slots);
        // Admitting from the slot that cached credit under the old limit.
        let ok_l = books.admit(&cached, 1);
        let (ok_a, a_slot) = a.join().unwrap();
        // A's charge is live until the end: both cannot fit under the new limit of 1.
        assert!(!(ok_a && ok_l), "an admission after lowering overcommitted the new limit");
        // And one of them always fits.
        assert!(ok_a || ok_l, "nothing charged, yet the admission after lowering was refused");
        if ok_a {
            books.refund(&a_slot, 1);
        }
        if ok_l {
            books.refund(&cached, 1);
        }
        books.assert_empty();
    });
}

/// A draw from the shared books racing a lowering of the device limit: if the draw
/// commits, the lowering's look at `used` (after it swapped the limit) counts it, so
/// whoever lowers a limit (a node-books member giving back part of its grant) never
/// misses a draw made against the old one.
#[test]
fn loom_draw_racing_lowering_is_seen_by_it() {
    loom::model(|| {
        let books = Books::new(4, UNLIMITED);
        let a_books = Arc::clone(&books);
        let a = thread::spawn(move || a_books.path(KV).draw(3, 0).is_ok());

        set_limit(&books.device.budget, 1, &books.device_slots);
        let seen = books.device.budget.used();
        let drew = a.join().unwrap();
        if drew {
            assert!(seen >= 3, "a draw committed against the old limit, unseen by the lowering (used read: {seen})");
            books.path(KV).give_back(3);
        }
        books.assert_empty();
    });
}

/// Runs the hoarding scenario: an idle slot caches two bytes of a budget of 4; the
/// main thread needs 3 (so it drains); thread X admits 1 meanwhile. 3 + 1 fits, so the
/// drainer must never fail, whatever X caches. `register_in_thread` makes X create its
/// slot inside the thread (possibly after the drainer swept).
fn hoarding_scenario(register_in_thread: bool) {
    let books = Books::new(4, UNLIMITED);
    let idle = books.slot(KV);
    assert!(books.admit(&idle, 1));
    books.refund(&idle, 1);
    let d_slot = books.slot(KV);
    let early = (!register_in_thread).then(|| books.slot(KV));
    let x_books = Arc::clone(&books);
    let x = thread::spawn(move || {
        let slot = early.unwrap_or_else(|| x_books.slot(KV));
        assert!(x_books.admit(&slot, 1), "1 + 3 fits in 4");
        slot
    });
    assert!(books.admit(&d_slot, 3), "refused while credit sat with another thread");
    books.assert_within_limits();
    let x_slot = x.join().unwrap();
    books.refund(&x_slot, 1);
    books.refund(&d_slot, 3);
    books.assert_empty();
}

/// A closed slot reopens only when no drainer is at work (checked with a
/// read-modify-write inside its section), so it cannot hoard credit a drainer needs.
#[test]
fn loom_closed_slot_does_not_reopen_during_drain() {
    loom::model(|| hoarding_scenario(false));
}

/// A thread that starts admitting (a new slot) while another drains cannot cache
/// credit the drainer needs: new slots start closed.
#[test]
fn loom_new_thread_during_drain_does_not_hoard() {
    loom::model(|| hoarding_scenario(true));
}

/// An authority quota nested in a device budget: both are kept exact when the
/// quota is the short one and credit sits in another thread's slot.
#[test]
fn loom_quota_nested_in_device_budget() {
    loom::model(|| {
        let books = Books::new(8, 3);
        let b_slot = books.slot(WEIGHTS);
        let a_slot = books.slot(KV);
        let b_books = Arc::clone(&books);
        let b = thread::spawn(move || {
            assert!(b_books.admit(&b_slot, 1));
            b_books.assert_within_limits();
            b_books.refund(&b_slot, 1);
        });
        assert!(books.admit(&a_slot, 2), "2 + 1 fits a quota of 3");
        books.assert_within_limits();
        books.refund(&a_slot, 2);
        b.join().unwrap();
        books.assert_empty();
    });
}

/// A role's reserve cannot be taken by another role, even while credit moves.
#[test]
fn loom_reserve_is_kept_for_its_role() {
    loom::model(|| {
        let books = Books::new(3, UNLIMITED);
        books.device.set_reserve(WEIGHTS, 1).unwrap();
        let kv_slot = books.slot(KV);
        let w_slot = books.slot(WEIGHTS);
        let kv_books = Arc::clone(&books);
        let kv = thread::spawn(move || {
            // Only 2 bytes are open to the KV cache.
            let first = kv_books.admit(&kv_slot, 2);
            let second = kv_books.admit(&kv_slot, 1);
            kv_books.assert_within_limits();
            (first, second, kv_slot)
        });
        // Weights always get their reserved byte.
        assert!(books.admit(&w_slot, 1), "the weights reserve was squeezed out");
        let (first, second, kv_slot) = kv.join().unwrap();
        assert!(first, "2 bytes outside the reserve fit");
        assert!(!second, "the kv cache took the weights reserve");
        books.refund(&kv_slot, 2);
        books.refund(&w_slot, 1);
        books.assert_empty();
    });
}

/// Changing a reserve while its role draws and returns keeps the books exact: after
/// everything is refunded the device holds exactly the reserves.
#[test]
fn loom_reserve_change_racing_draws() {
    loom::model(|| {
        let books = Books::new(4, UNLIMITED);
        books.device.set_reserve(WEIGHTS, 1).unwrap();
        let w_slot = books.slot(WEIGHTS);
        let w_books = Arc::clone(&books);
        let w = thread::spawn(move || {
            assert!(w_books.admit(&w_slot, 2), "2 fits in 4");
            w_books.assert_within_limits();
            w_books.refund(&w_slot, 2);
        });
        books.device.set_reserve(WEIGHTS, 2).unwrap();
        books.assert_within_limits();
        w.join().unwrap();
        books.assert_empty();
        assert_eq!(books.device.budget.used(), 2, "the device holds exactly the new reserve");
    });
}

/// A return of a role racing a change of its reserve: the return either commits
/// before the role is frozen or waits for the change, never lands on the frozen word
/// (the change would then write back the usage it read, and the return would be lost).
#[test]
fn loom_return_racing_reserve_change() {
    loom::model(|| {
        let books = Books::new(4, UNLIMITED);
        books.path(WEIGHTS).draw(1, 0).unwrap();
        let changer_books = Arc::clone(&books);
        let changer = thread::spawn(move || changer_books.device.set_reserve(WEIGHTS, 2).unwrap());
        books.path(WEIGHTS).give_back(1);
        changer.join().unwrap();
        books.assert_empty();
        assert_eq!(books.device.budget.used(), 2, "the device holds exactly the new reserve");
    });
}

/// A draw of a role racing two changes of its reserve, from the role's first word (no
/// usage, version 0, so the frozen word is exactly the frozen flag): the draw commits
/// against the reserve it read or is recomputed, never onto a frozen word or onto a word
/// whose version came back after the reserve moved.
#[test]
fn loom_draw_racing_two_reserve_changes() {
    loom::model(|| {
        let books = Books::new(8, UNLIMITED);
        let changer_books = Arc::clone(&books);
        let changer = thread::spawn(move || {
            changer_books.device.set_reserve(WEIGHTS, 2).unwrap();
            changer_books.device.set_reserve(WEIGHTS, 3).unwrap();
        });
        books.path(WEIGHTS).draw(1, 0).unwrap();
        books.assert_within_limits();
        books.path(WEIGHTS).give_back(1);
        changer.join().unwrap();
        books.assert_empty();
        assert_eq!(books.device.budget.used(), 3, "the device holds exactly the last reserve");
    });
}

/// A draw retried because another draw or return of its role committed first: the
/// retry costs the device what the new usage costs over the reserve, taking or giving
/// back only the difference from what it already took.
#[test]
fn loom_draw_retried_after_its_role_moved() {
    loom::model(|| {
        let books = Books::new(8, UNLIMITED);
        books.device.set_reserve(WEIGHTS, 2).unwrap();
        // Usage 1 inside a reserve of 2: a draw of 2 costs 1, or 2 once another byte is drawn.
        books.path(WEIGHTS).draw(1, 0).unwrap();
        let other_books = Arc::clone(&books);
        let other = thread::spawn(move || {
            other_books.path(WEIGHTS).draw(1, 0).unwrap();
            other_books.path(WEIGHTS).give_back(1);
        });
        books.path(WEIGHTS).draw(2, 0).unwrap();
        books.assert_within_limits();
        other.join().unwrap();
        assert_eq!(books.device.budget.used(), 3, "usage 3 over a reserve of 2 occupies 3");
        books.path(WEIGHTS).give_back(3);
        books.assert_empty();
    });
}

/// An admission served from the owner's own credit racing a sweep of that credit: the
/// owner's look before entering its section may be stale, so inside the section it
/// admits only from an open word (a swept word is closed and holds nothing).
#[test]
fn loom_fast_admission_racing_sweep() {
    loom::model(|| {
        let books = Books::new(4, UNLIMITED);
        let owner = books.slot(KV);
        assert!(books.admit(&owner, 1));
        books.refund(&owner, 1);
        assert!(owner.credit() >= 1, "the model needs cached credit to start with");
        let sweeper_books = Arc::clone(&books);
        let sweeper = thread::spawn(move || {
            return_credit(&sweeper_books.device.budget, &sweeper_books.device_slots);
        });
        assert!(books.admit(&owner, 1), "1 fits in 4");
        books.assert_within_limits();
        sweeper.join().unwrap();
        books.refund(&owner, 1);
        books.assert_empty();
    });
}
