//! loom models of the node protocol ([`crate::protocol`]): grants racing against a
//! limit and a watcher's snapshots, a give-back racing a grant, and a process that died
//! mid-grant refunded (once) while another grants and a new process claims the slot.
//!
//! Run with `cargo xtask loom` (or `RUSTFLAGS="--cfg memory_loom" cargo test --release
//! -p memory-node --lib loom`). Budgets are a few bytes, so every interleaving that
//! matters is reachable. A dead process is modelled as the state it left (its slot's
//! words as they were when it stopped): a dead process makes no further step, which is
//! all the protocol relies on.

use loom::thread;

use crate::protocol::{self, Budget, SLOT_LIVE, Table, consistent, give_back, granted, refund, state_word, try_grant};
use crate::sync::{Arc, AtomicU64, Mutex, Ordering::SeqCst, lock};

const BUDGET: Budget = Budget::Device(0);

/// Slots with one budget each.
struct Model {
    hwm: AtomicU64,
    states: Vec<AtomicU64>,
    seqs: Vec<AtomicU64>,
    grants: Vec<AtomicU64>,
    /// The books' lock (`flock` in the file).
    lock: Mutex<()>,
}

impl Model {
    fn new(slots: usize) -> Arc<Model> {
        Arc::new(Model {
            hwm: AtomicU64::new(slots as u64),
            states: (0..slots).map(|_| AtomicU64::new(state_word(SLOT_LIVE, 1))).collect(),
            seqs: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            grants: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            lock: Mutex::new(()),
        })
    }
}

impl Table for Model {
    fn hwm(&self) -> &AtomicU64 {
        &self.hwm
    }

    fn slot_count(&self) -> usize {
        self.states.len()
    }

    fn state(&self, slot: usize) -> &AtomicU64 {
        &self.states[slot]
    }

    fn seq(&self, slot: usize) -> &AtomicU64 {
        &self.seqs[slot]
    }

    fn grant(&self, slot: usize, _budget: Budget) -> &AtomicU64 {
        &self.grants[slot]
    }

    fn budgets(&self) -> impl Iterator<Item = Budget> {
        std::iter::once(BUDGET)
    }
}

fn sum_of(model: &Model) -> u64 {
    (0..model.slot_count()).map(|slot| model.grants[slot].load(SeqCst)).sum()
}

#[test]
fn loom_racing_grants_never_pass_the_limit_and_snapshots_see_it() {
    loom::model(|| {
        let model = Model::new(2);
        let grants: Vec<_> = (0..2)
            .map(|slot| {
                let model = Arc::clone(&model);
                thread::spawn(move || try_grant(&*model, slot, BUDGET, 3, 2, 1).unwrap_or(0))
            })
            .collect();
        let watcher = {
            let model = Arc::clone(&model);
            thread::spawn(move || {
                if let Some(sum) = consistent(&*model, 2, sum_of) {
                    assert!(sum <= 3, "a consistent snapshot saw {sum} bytes granted against a limit of 3");
                }
            })
        };
        let confirmed: u64 = grants.into_iter().map(|g| g.join().unwrap()).sum();
        watcher.join().unwrap();
        assert!(confirmed <= 3, "grants confirmed {confirmed} bytes against a limit of 3");
        assert_eq!(granted(&*model, BUDGET), confirmed, "the slots' words are the confirmed grants");
        assert!(model.seqs.iter().all(|seq| seq.load(SeqCst).is_multiple_of(2)));
    });
}

#[test]
fn loom_a_give_back_racing_a_grant_keeps_the_books_exact() {
    loom::model(|| {
        let model = Model::new(2);
        // Slot 0 holds 2 of 3.
        model.grants[0].store(2, SeqCst);
        let giver = {
            let model = Arc::clone(&model);
            thread::spawn(move || give_back(&*model, 0, BUDGET, 2))
        };
        let granter = {
            let model = Arc::clone(&model);
            thread::spawn(move || try_grant(&*model, 1, BUDGET, 3, 3, 1).unwrap_or(0))
        };
        giver.join().unwrap();
        let got = granter.join().unwrap();
        assert!(got <= 3);
        assert_eq!(model.grants[0].load(SeqCst), 0);
        assert_eq!(model.grants[1].load(SeqCst), got);
    });
}

#[test]
fn loom_a_process_dead_mid_grant_is_refunded_once_and_the_new_owner_keeps_its_grant() {
    loom::model(|| {
        let model = Model::new(2);
        // Slot 0's process died between steps 2 and 4 of a grant: `seq` odd, a tentative 2.
        let dead = state_word(SLOT_LIVE, 1);
        model.seqs[0].store(1, SeqCst);
        model.grants[0].store(2, SeqCst);
        // A survivor refunds it, then a new process claims the slot and grants.
        let survivor = {
            let model = Arc::clone(&model);
            thread::spawn(move || {
                let refunded = {
                    let _books = lock(&model.lock);
                    refund(&*model, 0, dead)
                };
                let claimed = {
                    let _books = lock(&model.lock);
                    protocol::claim(&*model, |_| {})
                };
                let (slot, _) = claimed.expect("the refunded slot is free");
                (refunded, try_grant(&*model, slot, BUDGET, 3, 2, 1).unwrap_or(0))
            })
        };
        // A second survivor read the dead slot's state before the first one refunded it,
        // and refunds it late: it must not touch the slot's new owner.
        let late = {
            let model = Arc::clone(&model);
            thread::spawn(move || {
                let _books = lock(&model.lock);
                refund(&*model, 0, dead)
            })
        };
        // A live process grants meanwhile.
        let live = {
            let model = Arc::clone(&model);
            thread::spawn(move || try_grant(&*model, 1, BUDGET, 3, 2, 1).unwrap_or(0))
        };
        let (first, new_owner) = survivor.join().unwrap();
        let second = late.join().unwrap();
        let other = live.join().unwrap();
        // Refunded exactly once, of what the dead process held.
        let refunds: Vec<u64> = [first, second].into_iter().flatten().collect();
        assert_eq!(refunds, vec![2], "the dead slot was refunded {refunds:?}");
        assert!(new_owner + other <= 3, "granted {new_owner} + {other} against 3");
        assert_eq!(model.grants[0].load(SeqCst), new_owner, "the new owner's grant was kept");
        assert_eq!(model.grants[1].load(SeqCst), other);
        assert!(model.seqs.iter().all(|seq| seq.load(SeqCst).is_multiple_of(2)));
    });
}
