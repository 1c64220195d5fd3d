//! A map of disjoint page ranges to values: committed runs of a virtual reservation,
//! mappings of a shared one. Memory is proportional to the number of runs, not to the
//! size of the reservation (a reservation may span terabytes).

use std::collections::BTreeMap;

/// Disjoint half-open ranges `[start, end)` (in pages), each with a value.
#[derive(Debug, Clone)]
pub(crate) struct RangeMap<V> {
    runs: BTreeMap<usize, (usize, V)>,
    total: usize,
}

impl<V> Default for RangeMap<V> {
    fn default() -> RangeMap<V> {
        RangeMap { runs: BTreeMap::new(), total: 0 }
    }
}

impl<V: Clone> RangeMap<V> {
    /// Pages covered.
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// The parts of `[start, end)` that are covered, with their values, in order.
    pub(crate) fn covered(&self, start: usize, end: usize) -> Vec<(usize, usize, V)> {
        let first = self.runs.range(..=start).next_back().map_or(start, |(&s, _)| s);
        self.runs
            .range(first..end)
            .filter_map(|(&s, (e, v))| {
                let (lo, hi) = (s.max(start), (*e).min(end));
                (lo < hi).then(|| (lo, hi, v.clone()))
            })
            .collect()
    }

    /// The parts of `[start, end)` that are not covered, in order.
    pub(crate) fn gaps(&self, start: usize, end: usize) -> Vec<(usize, usize)> {
        let mut gaps = Vec::new();
        let mut at = start;
        for (lo, hi, _) in self.covered(start, end) {
            if at < lo {
                gaps.push((at, lo));
            }
            at = hi;
        }
        if at < end {
            gaps.push((at, end));
        }
        gaps
    }

    /// Whether any page of `[start, end)` is covered.
    pub(crate) fn overlaps(&self, start: usize, end: usize) -> bool {
        !self.covered(start, end).is_empty()
    }

    /// Covers `[start, end)`, which must not overlap anything covered.
    pub(crate) fn insert(&mut self, start: usize, end: usize, value: V) {
        debug_assert!(start < end && !self.overlaps(start, end));
        self.runs.insert(start, (end, value));
        self.total += end - start;
    }

    /// Uncovers `[start, end)`, splitting runs at its edges; returns the pages removed.
    pub(crate) fn remove(&mut self, start: usize, end: usize) -> usize {
        let pieces = self.covered(start, end);
        let mut removed = 0;
        for (lo, hi, _) in pieces {
            // The run containing `lo` starts at or before it.
            let (&s, _) = self.runs.range(..=lo).next_back().expect("a covered page lies in a run");
            let (e, v) = self.runs.remove(&s).expect("run exists");
            if s < lo {
                self.runs.insert(s, (lo, v.clone()));
            }
            if hi < e {
                self.runs.insert(hi, (e, v));
            }
            removed += hi - lo;
        }
        self.total -= removed;
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covered_gaps_and_removal_split_runs_exactly() {
        let mut map = RangeMap::default();
        map.insert(2, 5, 'a');
        map.insert(8, 10, 'b');
        assert_eq!(map.total(), 5);
        assert_eq!(map.covered(0, 12), vec![(2, 5, 'a'), (8, 10, 'b')]);
        assert_eq!(map.covered(3, 9), vec![(3, 5, 'a'), (8, 9, 'b')]);
        assert_eq!(map.gaps(0, 12), vec![(0, 2), (5, 8), (10, 12)]);
        assert_eq!(map.gaps(2, 5), vec![]);
        assert!(map.overlaps(4, 6) && !map.overlaps(5, 8));
        assert_eq!(map.remove(3, 9), 3);
        assert_eq!(map.covered(0, 12), vec![(2, 3, 'a'), (9, 10, 'b')]);
        assert_eq!(map.total(), 2);
        assert_eq!(map.remove(0, 12), 2);
        assert_eq!(map.total(), 0);
        assert_eq!(map.remove(0, 12), 0);
    }
}
