//! One thread's ring of event words: a single-producer, single-consumer queue of 64-bit
//! words. The producer is the thread that owns the ring (the recording thread, through
//! `memory_sync`'s per-thread table); the consumer is whoever holds the recorder's output
//! lock: its writer thread, or a recording thread that found its ring full. The lock
//! orders one consumer's drain before the next one's (its release and acquire), so to
//! the ring they are one consumer.
//!
//! # Protocol
//! - `head` counts words ever pushed; only the producer stores it. `tail` counts words
//!   ever drained; only the consumer stores it. Both only grow, so `head - tail` is the
//!   fill and never wraps (2^64 words are centuries of events).
//! - **Push** (producer): load `tail` with `Acquire`; if the event does not fit, become
//!   the consumer for a drain (or drop the event when the recording is closed); store the event's
//!   words with `Relaxed` into `[head, head + n)` modulo the capacity, then publish
//!   `head + n` with `Release`. No read-modify-write: on x86 a push is plain loads and
//!   stores on lines only this thread writes (and one read of `tail`).
//! - **Drain** (consumer): load `head` with `Acquire` (so every word below it is
//!   visible), copy `[tail, head)`, then store `tail = head` with `Release`.
//! - Why no word is overwritten before it was copied: the producer writes slot `s` for
//!   word `w` only after it has loaded a `tail` with `w - tail < capacity`, i.e. a `tail`
//!   past the word `w - capacity` that used that slot before. That `tail` was stored by the
//!   consumer after its copy loads of that word, with `Release`, and loaded by the
//!   producer with `Acquire`, so the copy happens before the overwrite (a load that
//!   happens before a store cannot read it).
//! - Why the consumer never reads a torn event: it copies only below a `head` it loaded
//!   with `Acquire`, and the producer publishes `head` only past whole events, after
//!   their words.
//!
//! The loom model in `src/loom_ring.rs` runs a producer pushing events of several sizes
//! through a ring smaller than their total against a consumer draining it, and checks the
//! consumer sees exactly the pushed words, in order.

use crate::sync::{AtomicU64, CachePadded, Ordering};

/// One thread's ring.
pub(crate) struct Ring {
    words: Box<[AtomicU64]>,
    mask: u64,
    /// Words pushed (stored by the producer only).
    head: CachePadded<AtomicU64>,
    /// Words drained (stored by the consumer only).
    tail: CachePadded<AtomicU64>,
}

/// What a push did.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// The event is in the ring.
    Queued,
    /// The event is in the ring and the ring is now more than half full: wake the consumer.
    QueuedWake,
    /// The ring is full: the caller wakes the consumer and tries again (or gives up).
    Full,
}

impl Ring {
    /// A ring of `capacity` words (rounded up to a power of two, at least 32).
    pub(crate) fn new(capacity: usize) -> Ring {
        let capacity = capacity.max(32).next_power_of_two();
        Ring {
            words: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            mask: capacity as u64 - 1,
            head: CachePadded::new(AtomicU64::new(0)),
            tail: CachePadded::new(AtomicU64::new(0)),
        }
    }

    fn capacity(&self) -> u64 {
        self.mask + 1
    }

    /// Pushes one event's words (producer only). An event larger than the ring never
    /// fits; the recorder's events are at most 18 words and rings at least 32.
    #[inline(always)]
    pub(crate) fn push(&self, event: &[u64]) -> Pushed {
        let n = event.len() as u64;
        let head = self.head.load(Ordering::Relaxed);
        let tail = self.tail.load(Ordering::Acquire);
        let fill = head.wrapping_sub(tail);
        if fill + n > self.capacity() {
            return Pushed::Full;
        }
        // The event's slots in one piece (one bounds check, the ring's fields read once:
        // a store through an atomic could otherwise alias them), unless it wraps.
        let start = (head & self.mask) as usize;
        match self.words.get(start..start + event.len()) {
            Some(slots) => {
                for (slot, &word) in slots.iter().zip(event) {
                    slot.store(word, Ordering::Relaxed);
                }
            }
            None => {
                for (offset, &word) in event.iter().enumerate() {
                    self.words[((head + offset as u64) & self.mask) as usize].store(word, Ordering::Relaxed);
                }
            }
        }
        self.head.store(head + n, Ordering::Release);
        let half = self.capacity() / 2;
        if fill <= half && fill + n > half { Pushed::QueuedWake } else { Pushed::Queued }
    }

    /// Appends every word pushed and not yet drained to `out`, in order, a contiguous
    /// piece at a time (consumer only); the number of words drained.
    pub(crate) fn drain(&self, out: &mut Vec<u64>) -> usize {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        let (start, n) = ((tail & self.mask) as usize, head.wrapping_sub(tail) as usize);
        let first = n.min(self.words.len() - start);
        out.reserve(n);
        for piece in [&self.words[start..start + first], &self.words[..n - first]] {
            out.extend(piece.iter().map(|word| word.load(Ordering::Relaxed)));
        }
        self.tail.store(head, Ordering::Release);
        n
    }

    /// Whether anything waits to be drained (consumer's view).
    pub(crate) fn is_empty(&self) -> bool {
        self.head.load(Ordering::Acquire) == self.tail.load(Ordering::Relaxed)
    }
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use super::*;

    #[test]
    fn words_come_out_in_order_across_the_wrap() {
        let ring = Ring::new(32);
        let mut out = Vec::new();
        let mut expected: Vec<u64> = Vec::new();
        for round in 0..20u64 {
            let event: Vec<u64> = (0..7).map(|i| round * 100 + i).collect();
            assert_ne!(ring.push(&event), Pushed::Full);
            expected.extend(&event);
            if round % 3 == 2 {
                ring.drain(&mut out);
            }
        }
        ring.drain(&mut out);
        assert_eq!(out, expected);
        assert!(ring.is_empty());
    }

    #[test]
    fn a_full_ring_refuses_and_asks_for_a_wake_at_half() {
        let ring = Ring::new(32);
        assert_eq!(ring.push(&[1; 10]), Pushed::Queued);
        assert_eq!(ring.push(&[2; 10]), Pushed::QueuedWake, "past half (16 words)");
        assert_eq!(ring.push(&[3; 10]), Pushed::Queued);
        assert_eq!(ring.push(&[4; 10]), Pushed::Full, "30 + 10 > 32");
        let mut out = Vec::new();
        assert_eq!(ring.drain(&mut out), 30);
        assert_eq!(ring.push(&[4; 10]), Pushed::Queued);
    }

    #[test]
    fn a_consumer_thread_sees_every_word_of_a_producer_thread() {
        let ring = std::sync::Arc::new(Ring::new(64));
        let producer = {
            let ring = std::sync::Arc::clone(&ring);
            std::thread::spawn(move || {
                for i in 0..20_000u64 {
                    let event = [i, i ^ 0xffff, i.wrapping_mul(31)];
                    while ring.push(&event) == Pushed::Full {
                        std::thread::yield_now();
                    }
                }
            })
        };
        let mut out = Vec::new();
        while out.len() < 60_000 {
            if ring.drain(&mut out) == 0 {
                std::thread::yield_now();
            }
        }
        producer.join().unwrap();
        for (i, event) in out.chunks(3).enumerate() {
            let i = i as u64;
            assert_eq!(event, [i, i ^ 0xffff, i.wrapping_mul(31)]);
        }
    }
}
