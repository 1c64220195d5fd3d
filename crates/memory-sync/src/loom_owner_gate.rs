//! loom model of the owner gate (`cargo xtask loom`).

use std::sync::Arc;

use crate::BarrierMode;
use crate::owner_gate::OwnerGate;
use crate::primitives::{AtomicU64, Ordering};

/// Adds one with a plain load and store: an update the gate must keep whole.
fn bump(cell: &AtomicU64) {
    cell.store(cell.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
}

/// The owner passes twice (claiming the gate itself when it backs out) while another
/// thread claims it once: every update made inside survives, so the two were never
/// inside at once and each saw the other's writes.
#[test]
fn loom_an_owner_and_a_claimer_are_never_inside_at_once() {
    loom::model(|| {
        let gate = Arc::new(OwnerGate::new(BarrierMode::Fence));
        let count = Arc::new(AtomicU64::new(0));
        let claimer = {
            let (gate, count) = (Arc::clone(&gate), Arc::clone(&count));
            loom::thread::spawn(move || {
                let _claim = gate.claim();
                bump(&count);
            })
        };
        for _ in 0..2 {
            match gate.enter() {
                Some(_pass) => bump(&count),
                None => {
                    let _claim = gate.claim();
                    bump(&count);
                }
            }
        }
        claimer.join().unwrap();
        assert_eq!(count.load(Ordering::Relaxed), 3, "an update made inside the gate was lost");
    });
}
