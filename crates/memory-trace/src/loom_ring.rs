//! loom model of the recorder's ring (`cargo xtask loom`): one producer pushing events
//! of several sizes through a ring smaller than their total, one consumer draining it.

use std::sync::Arc;

use crate::ring::{Pushed, Ring};

/// The consumer sees exactly the pushed words, in order, across the ring's wrap, with no
/// event torn: the producer overwrites a slot only after the consumer copied it, and the
/// consumer reads only below a published head.
#[test]
fn loom_the_writer_sees_every_pushed_word_in_order_across_the_wrap() {
    loom::model(|| {
        // 32 words (the smallest ring); three events of 12, 18 and 12 words: the third
        // fits only after a drain, and wraps.
        let ring = Arc::new(Ring::new(32));
        let events: [Vec<u64>; 3] = [(1..=12).collect(), (101..=118).collect(), (201..=212).collect()];
        let expected: Vec<u64> = events.iter().flatten().copied().collect();
        let producer = {
            let ring = Arc::clone(&ring);
            let events = events.clone();
            loom::thread::spawn(move || {
                for event in &events {
                    while ring.push(event) == Pushed::Full {
                        loom::thread::yield_now();
                    }
                }
            })
        };
        let mut seen = Vec::new();
        while seen.len() < expected.len() {
            if ring.drain(&mut seen) == 0 {
                loom::thread::yield_now();
            }
            // Whole events only: a drain ends on an event boundary.
            assert!([0, 12, 30, 42].contains(&seen.len()), "a torn event: {} words", seen.len());
        }
        producer.join().unwrap();
        assert_eq!(seen, expected);
    });
}
