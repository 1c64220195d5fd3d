//! loom models of the barrier pair in fence mode (the mode loom runs).

use loom::sync::Arc;
use loom::thread;

use crate::primitives::{AtomicBool, Ordering};
use crate::{BarrierMode, heavy_barrier, light_barrier};

/// Runs the store-buffering shape with or without the barriers; returns whether some
/// execution had both sides miss each other's store (by panicking inside the model).
fn store_buffering(with_barriers: bool) {
    loom::model(move || {
        let hot = Arc::new(AtomicBool::new(false));
        let cold = Arc::new(AtomicBool::new(false));
        let (hot2, cold2) = (Arc::clone(&hot), Arc::clone(&cold));
        let cold_side = thread::spawn(move || {
            cold2.store(true, Ordering::Relaxed);
            if with_barriers {
                heavy_barrier(BarrierMode::Fence);
            }
            hot2.load(Ordering::Relaxed)
        });
        hot.store(true, Ordering::Relaxed);
        if with_barriers {
            light_barrier(BarrierMode::Fence);
        }
        let hot_saw_cold = cold.load(Ordering::Relaxed);
        let cold_saw_hot = cold_side.join().unwrap();
        assert!(hot_saw_cold || cold_saw_hot, "both sides missed each other's store");
    });
}

#[test]
fn loom_with_the_barrier_pair_one_side_always_sees_the_other() {
    store_buffering(true);
}

/// The model above is not vacuous: without the barriers loom finds the execution in
/// which both sides miss each other.
#[test]
#[should_panic(expected = "both sides missed")]
fn loom_without_the_barriers_both_sides_can_miss_each_other() {
    store_buffering(false);
}
